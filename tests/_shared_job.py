"""Child processes for the shared-memory tests (run as a script; results go to JSON files).

Modes:
    stall-in-fill          one process that stops inside the leader's fill (prints "filling")
    stall-named            one that stops once its segment is named, before it unlinks it (prints "named")
    gloo-rank OUT          a rank of a plain gloo job calling ``share_stores``
    fit-rank CACHE OUT MODE N  a rank of a Lightning ``ddp`` fit on CPU ("normal", "raise", "slow")
    device-jpeg-rank OUT   a rank of a gloo job placing a JPEG store with the ``device`` strategy
The ranks read RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import zlib
from datetime import timedelta
from pathlib import Path

import numpy as np
import psutil
import torch

#: Samples of the fit jobs: 16 KiB each (4 x 64 x 64 uint8), so N=4096 is a 64 MiB store.
SHAPE = (4, 64, 64)


class IndexedImages(torch.utils.data.Dataset):
    """``n`` deterministic uint8 images; the label is the sample's index."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(7000 + i)
        return torch.randint(0, 256, SHAPE, dtype=torch.uint8, generator=g), i


def is_segment(target: str) -> bool:
    """Whether a mapping's or a descriptor's target is one of this package's segments: its name,
    or (the leader's, created nameless with ``O_TMPFILE`` and linked later) ``/dev/shm/#<inode>``."""
    path = Path(target.strip().removesuffix(" (deleted)"))
    return (path.name.startswith(os.environ.get("LIGHTNING_FASTDATA_SHM_PREFIX", "lfd_"))
            or (path.parent == Path("/dev/shm") and re.fullmatch(r"#\d+", path.name) is not None))


def shm_mappings(pid: int | str = "self") -> list[tuple[int, int]]:
    """(inode, bytes) of every mapping of this package's segments in ``pid``."""
    out = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.readlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and is_segment(parts[5]):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((int(parts[4]), hi - lo))
    return out


def _stall(where: str) -> None:
    """A leader that stops inside its fill, or once its segment is named (the collective that
    tells the other local ranks the names), until a signal ends it."""
    from lightning_fastdata import shared
    from lightning_fastdata.store import Store

    def stall(*args, **kwargs):
        print(where, flush=True)
        time.sleep(120)

    if where == "filling":
        shared._fill = stall
    else:
        real, calls = shared.D.all_gather_object, [0]

        def gather(obj):
            calls[0] += 1
            return stall() if calls[0] == 2 else real(obj)

        shared.D.all_gather_object = gather
    store = Store.from_arrays((np.zeros((16, 1024), np.uint8),), fingerprint="s" * 64)
    shared.share_stores({"train": store})


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _init_gloo() -> int:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=60))
    return rank


def _gloo_rank(out: Path) -> None:
    """Ranks with different data are refused; then an attaching rank exits first, harmlessly."""
    from multiprocessing import resource_tracker

    import torch.distributed as dist

    from lightning_fastdata.shared import SharedMemoryError, share_stores
    from lightning_fastdata.store import Store

    rank = _init_gloo()
    data = np.arange(1 << 16, dtype=np.int64).reshape(256, 256)
    result: dict = {"pid": os.getpid()}
    try:
        share_stores({"train": Store.from_arrays((data,), fingerprint=f"{rank}" * 64)})
    except SharedMemoryError as e:
        result["error"] = str(e)
    try:  # a launcher that says every rank is local rank 0 of 2: every rank must be told
        share_stores({"train": Store.from_arrays((data,), fingerprint="e" * 64)}, local_rank=0, local_world_size=2)
    except SharedMemoryError as e:
        result["launcher_error"] = str(e)
    store = Store.from_arrays((data,), fingerprint="e" * 64)
    share_stores({"train": store})
    result["crc"] = zlib.crc32(store.fields[0].tobytes())
    result["tracker_started"] = resource_tracker._resource_tracker._pid is not None
    if rank == 0:
        dist.barrier()  # rank 1 has read; it exits now, then this rank reads again
        peer = json.loads((out / "rank1.pid").read_text())
        deadline = time.monotonic() + 30
        while _running(peer) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        result["crc_after_peer_exit"] = zlib.crc32(store.fields[0].tobytes())
        (out / "rank0.json").write_text(json.dumps(result))
    else:
        (out / "rank1.json").write_text(json.dumps(result))
        (out / "rank1.pid").write_text(json.dumps(os.getpid()))
        dist.barrier()
        os._exit(0)  # no teardown at all: the attaching rank simply goes away first


def jpeg_store(n: int = 12, fingerprint: str = "j" * 64):
    """``n`` real JPEGs of varying sizes (an encoded ragged field) and their labels, as a Store."""
    from torchvision.io import encode_jpeg

    from lightning_fastdata.ragged import RaggedArray
    from lightning_fastdata.store import Store

    g = torch.Generator().manual_seed(4)
    images = [torch.randint(0, 256, (3, 8 + i, 12 + 2 * i), dtype=torch.uint8, generator=g) for i in range(n)]
    jpegs = [encode_jpeg(x, quality=90).numpy() for x in images]
    decoded = np.array([x.shape for x in images], dtype=np.int64)
    return Store.from_arrays({"image": RaggedArray.from_list(jpegs, encoding="jpeg", decoded=decoded),
                              "y": np.arange(n, dtype=np.int64)}, fingerprint=fingerprint)


def device_plan(store):
    """The plan of a ``device`` placement of ``store`` on a (pretend) 16 GiB GPU."""
    from lightning_fastdata.plan import Resources, decide

    res = Resources(device_type="cuda", device_total=16 << 30, device_free=16 << 30, ram_total=8 << 30,
                    ram_available=8 << 30, physical_cores=2, logical_cores=2, shm_free=1 << 30)
    return decide(store.nbytes, res, {"strategy": "device"})


def _device_jpeg_rank(out: Path, shm: str = "ample") -> None:
    """Place a JPEG store with the ``device`` strategy as one of two local ranks: report where
    the encoded bytes live (the shared-memory mappings) and what the rank reads from them.
    ``shm="tiny"``: /dev/shm reports no free space (a container's default 64 MB, full)."""
    import warnings

    import torch.distributed as dist

    from lightning_fastdata import shared
    from lightning_fastdata.placement import Sharing, place

    if shm == "tiny":
        shared.shm_free_bytes = lambda: 0
    rank = _init_gloo()
    store = jpeg_store()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        placement = place({"train": store}, device_plan(store), "cpu", {"strategy": "device"}, {"train": 4},
                          world_size=2, sharing=Sharing(mode="auto", rank=rank, local_rank=rank, local_world_size=2))
    source = placement.sources["train"]
    batch = source.gather(torch.arange(len(store)))
    result = {"reason": placement.plan.reasons.get("shared_memory", ""), "segments": sorted(placement.segments),
              "maps": shm_mappings(), "crc": zlib.crc32(batch[0].values.numpy().tobytes()),
              "want": zlib.crc32(store.fields[0].values.tobytes()), "private": source.segment is None,
              "warnings": [str(w.message) for w in caught]}
    placement.release("train")
    del source, batch
    dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _fit_rank(cache: str, out: Path, mode: str, n: int, shared_memory: str = "auto") -> None:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_fastdata import OptimizedDataModule

    rank = int(os.environ["RANK"])
    me = psutil.Process()
    record: dict = {"pid": os.getpid(), "indices": [], "crcs": []}

    class DM(OptimizedDataModule):
        def source(self, split):
            return IndexedImages(n) if split == "train" else None

        def setup(self, stage=None):
            record["uss_setup"] = me.memory_full_info().uss
            super().setup(stage)
            record["uss_after_setup"] = me.memory_full_info().uss
            record["segment"] = (self.placement.segments["train"].name if "train" in self.placement.segments else None)
            record["setup_maps"] = shm_mappings()
            record["plan"] = str(self.plan)

        def train_dataloader(self):
            loader = super().train_dataloader()

            def worker_init(worker_id: int) -> None:
                uss = psutil.Process().memory_full_info().uss
                (out / f"rank{rank}.worker{os.getpid()}").write_text(str(uss))

            loader.dataloader.worker_init_fn = worker_init
            return loader

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(int(np.prod(SHAPE)), 4)

        def training_step(self, batch, batch_idx):
            x, y = batch
            record["indices"] += y.tolist()
            record["crcs"] += [zlib.crc32(row.numpy().tobytes()) for row in x]
            if mode == "raise" and batch_idx == 1:
                raise RuntimeError("boom in training_step")
            if mode == "slow":
                if batch_idx == 1:
                    (out / f"rank{rank}.mid").write_text("1")
                time.sleep(0.5)
            return torch.nn.functional.cross_entropy(self.net(x.float().flatten(1) / 255), y % 4)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Probe(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            record["uss_end"] = me.memory_full_info().uss
            workers = me.children()
            record["worker_uss"] = [(w.memory_full_info().uss,
                                     int((out / f"rank{rank}.worker{w.pid}").read_text())) for w in workers]
            record["maps"] = shm_mappings()
            record["worker_maps"] = [shm_mappings(w.pid) for w in workers]

        def on_train_end(self, trainer, pl_module):
            arrays = trainer.datamodule.placement.sources["train"].arrays
            record["field_crcs"] = [zlib.crc32(a.tobytes()) for a in arrays]

    dm = DM(batch_size=256, cache_dir=cache, strategy="workers", num_workers=2, device="cpu",
            progress=False, shared_memory=shared_memory)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, num_nodes=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out),
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
        callbacks=[Probe()], num_sanity_val_steps=0,
    )
    try:
        trainer.fit(Model(), dm)
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(record))
    from _helpers import ddp_exit_in_order

    ddp_exit_in_order()


if __name__ == "__main__":
    from _jobs import dump_stacks_on_signal

    dump_stacks_on_signal()
    torch.set_num_threads(1)
    what = sys.argv[1]
    if what == "stall-in-fill":
        _stall("filling")
    elif what == "stall-named":
        _stall("named")
    elif what == "gloo-rank":
        _gloo_rank(Path(sys.argv[2]))
    elif what == "device-jpeg-rank":
        _device_jpeg_rank(Path(sys.argv[2]), *sys.argv[3:])
    elif what == "fit-rank":
        from _shared_job import _fit_rank as fit  # the dataset's class must be _shared_job.IndexedImages

        fit(sys.argv[2], Path(sys.argv[3]), sys.argv[4], int(sys.argv[5]), *sys.argv[6:])
    else:
        raise SystemExit(f"unknown mode {what!r}")
