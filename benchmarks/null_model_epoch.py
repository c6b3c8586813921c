"""What the data path costs a Lightning epoch when the model costs nothing.

A null model (its ``training_step`` returns ``None``: no forward, no backward, no
optimizer step) trains one epoch over 50,000 CIFAR-sized samples (3x32x32 uint8, batch
256) four ways, side by side in one process:

* ``free loader``: a loader that hands out one ready batch, already augmented, again and
  again: the floor, Lightning's own per-step cost;
* ``fastdata device, ahead``: ``OptimizedDataModule`` with the ``device`` strategy and
  ``RandomCrop(32, padding=4)`` + ``RandomHorizontalFlip()``, the next batch gathered and
  augmented in a background thread while the step runs (``augment_ahead=1``, the default on CUDA);
* ``fastdata device, inline``: the same with ``augment_ahead=0`` (the default on a CPU run: gather and augment in the
  training loop's thread, between steps);
* ``fastdata workers``: the ``workers`` strategy, its ``num_workers`` chosen by the plan: the
  DataLoader workers gather and augment, the training process only receives ready batches.

Each arm runs ``--epochs`` epochs; the median epoch time after the first is reported, with
the ratio to the free loader. Results go to ``benchmarks/results/null_model_epoch.json``.

    OMP_NUM_THREADS=1 python benchmarks/null_model_epoch.py
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch

from lightning_fastdata import OptimizedDataModule
from lightning_fastdata import augment as A

RESULTS = Path(__file__).parent / "results" / "null_model_epoch.json"


class NullModel(L.LightningModule):
    """Does nothing with its batches: what remains of a step is the loop and the data path."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1))
        self.samples = 0

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.samples += batch[0].shape[0]
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Epochs(L.Callback):
    """Wall time of every training epoch."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0 = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.times.append(time.perf_counter() - self._t0)


class FreeLoader:
    """``steps`` times the same ready batch: costs nothing but Lightning's own handling."""

    def __init__(self, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> None:
        self.batch, self.steps = batch, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            yield self.batch


class Cifar(OptimizedDataModule):
    """50,000 random CIFAR-sized uint8 images with labels, held in memory."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.images, self.labels = images, labels

    def source(self, split: str) -> Any:
        if split != "train":
            return None
        return torch.utils.data.TensorDataset(torch.from_numpy(self.images), torch.from_numpy(self.labels))


def _trainer(epochs: int, timer: Epochs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     limit_val_batches=0, callbacks=[timer])


def run(samples: int, batch_size: int, epochs: int, cache_dir: str) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (samples, 3, 32, 32), dtype=np.uint8)
    labels = rng.integers(0, 10, samples, dtype=np.int64)
    augment = A.Compose([A.RandomCrop(32, padding=4), A.RandomHorizontalFlip()])
    steps = samples // batch_size
    out: dict[str, Any] = {"samples": samples, "batch_size": batch_size, "epochs": epochs,
                           "torch_threads": torch.get_num_threads(), "arms": {}}
    ready = (augment(torch.from_numpy(images[:batch_size])), torch.from_numpy(labels[:batch_size]))
    arms = {
        "free loader": lambda: (FreeLoader(ready, steps), None),
        "fastdata device, ahead": lambda: (None, Cifar(images, labels, batch_size=batch_size, drop_last=True,
                                                       strategy="device", device="cpu", cache_dir=cache_dir,
                                                       train_augment=augment, augment_ahead=1, progress=False)),
        "fastdata device, inline": lambda: (None, Cifar(images, labels, batch_size=batch_size, drop_last=True,
                                                        strategy="device", device="cpu", cache_dir=cache_dir,
                                                        train_augment=augment, augment_ahead=0, progress=False)),
        "fastdata workers": lambda: (None, Cifar(images, labels, batch_size=batch_size, drop_last=True,
                                                 strategy="workers", device="cpu", cache_dir=cache_dir,
                                                 train_augment=augment, progress=False)),
    }
    for name, make in arms.items():
        loader, dm = make()
        timer, model = Epochs(), NullModel()
        trainer = _trainer(epochs, timer)
        if dm is not None:
            dm.prepare_data()  # the cache is built once, outside the timed epochs
            trainer.fit(model, datamodule=dm)
        else:
            trainer.fit(model, train_dataloaders=loader)
        epoch_s = statistics.median(timer.times[1:]) if len(timer.times) > 1 else timer.times[0]
        out["arms"][name] = {"epoch_s": epoch_s, "epoch_times_s": timer.times,
                             "samples_per_epoch": model.samples // epochs}
        if dm is not None and dm.plan is not None and dm.plan.strategy == "workers":
            out["arms"][name]["num_workers"] = dm.plan.num_workers
        print(f"{name:26s} {epoch_s * 1e3:8.1f} ms/epoch", file=sys.stderr)
    free = out["arms"]["free loader"]["epoch_s"]
    for arm in out["arms"].values():
        arm["vs_free_loader"] = arm["epoch_s"] / free
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=50_000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--json", default=str(RESULTS))
    args = p.parse_args(argv)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as cache:
        out = run(args.samples, args.batch_size, args.epochs, cache)
    for name, arm in out["arms"].items():
        print(f"{name:26s} {arm['vs_free_loader']:.2f}x the free loader's epoch")
    if args.json:
        from lightning_fastdata._util import atomic_write_text

        atomic_write_text(args.json, json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
