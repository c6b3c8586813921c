"""A Lightning fit on CPU for the launcher tests (run as a script; results go to JSON files).

Usage: ``_launcher_job.py LAUNCH OUT CACHE N`` where LAUNCH is

    spawn     Lightning's ``ddp_spawn``, devices=2: this process spawns both ranks
    ddp       Lightning's ``ddp``, devices=2, ranks started by a launcher (torchrun)
    nodes     Lightning's ``ddp``, num_nodes=2, devices=1: one rank per simulated node,
              started by the test with NODE_RANK and LOCAL_RANK=0

Each rank writes ``OUT/rank{global_rank}.json``: its place, the plan's shared-memory
reason, the segment it mapped (inode, bytes) at setup and at epoch end, its DataLoader
workers' mappings, what it read, and a checksum of every field of the store.
The DataModule and the model live at module level: ``ddp_spawn`` pickles them.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import zlib
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
import torch
from _jobs import dump_stacks_on_signal
from _shared_job import SHAPE, IndexedImages, shm_mappings
from lightning.pytorch.strategies import DDPStrategy

from lightning_fastdata import OptimizedDataModule

dump_stacks_on_signal()  # at import: spawned ranks import this module too


def _record_worker(out: str, rank: int, worker_id: int) -> None:
    """DataLoader worker start: what this worker maps (forked: inherited; spawned: from the descriptor)."""
    Path(out, f"rank{rank}.worker{os.getpid()}.json").write_text(json.dumps(shm_mappings()))


class DM(OptimizedDataModule):
    """The ``IndexedImages(n)`` training split, read by DataLoader workers from host memory."""

    def __init__(self, n: int, out: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.n, self.out = n, out
        self.record: dict = {}

    def source(self, split):
        return IndexedImages(self.n) if split == "train" else None

    def setup(self, stage=None):
        super().setup(stage)
        self.record.update(
            segment=(self.placement.segments["train"].name if "train" in self.placement.segments else None),
            reason=self.plan.reasons.get("shared_memory"),
            setup_maps=shm_mappings(),
        )

    def train_dataloader(self):
        loader = super().train_dataloader()
        loader.dataloader.worker_init_fn = functools.partial(_record_worker, self.out, self.trainer.global_rank)
        return loader


class Model(L.LightningModule):
    """A linear probe that records the indices and checksums of the samples it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(int(np.prod(SHAPE)), 4)
        self.seen: dict = {"indices": [], "crcs": []}

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen["indices"] += y.tolist()
        self.seen["crcs"] += [zlib.crc32(row.numpy().tobytes()) for row in x]
        return torch.nn.functional.cross_entropy(self.net(x.float().flatten(1) / 255), y % 4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Probe(L.Callback):
    """Writes the rank's record at the end of training, while the store is still shared."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_epoch_end(self, trainer, pl_module):
        dm = trainer.datamodule
        dm.record["maps"] = shm_mappings()

    def on_train_end(self, trainer, pl_module):
        dm = trainer.datamodule
        rec = dict(dm.record, **pl_module.seen)
        rec.update(
            pid=os.getpid(), global_rank=trainer.global_rank, local_rank=trainer.local_rank,
            node_rank=trainer.node_rank, world_size=trainer.world_size,
            field_crcs=[zlib.crc32(np.ascontiguousarray(a).tobytes()) for a in dm.placement.sources["train"].arrays],
        )
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(rec))


def main(launch: str, out: str, cache: str, n: int) -> None:
    torch.set_num_threads(1)
    # A rank blocked on a peer that died fails within a minute and a half, with a traceback, instead of hanging.
    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=90),
                           start_method="spawn" if launch == "spawn" else "popen")
    devices, num_nodes = (1, 2) if launch == "nodes" else (2, 1)
    dm = DM(n, out, batch_size=128, cache_dir=cache, strategy="workers", num_workers=1, device="cpu",
            progress=False, shared_memory="auto")
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=out, callbacks=[Probe(out)], num_sanity_val_steps=0,
    )
    trainer.fit(Model(), dm)
    from _helpers import ddp_exit_in_order

    ddp_exit_in_order()


if __name__ == "__main__":
    if sys.argv[1] not in ("spawn", "ddp", "nodes"):
        raise SystemExit(f"unknown launch {sys.argv[1]!r}")
    from _launcher_job import main as run  # pickled classes must be _launcher_job's, not __main__'s

    run(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
