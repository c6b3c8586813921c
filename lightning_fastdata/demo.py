"""The demo: the same small CNN trained from PNG files, with a plain DataLoader and with fastdata.

Run ``python -m lightning_fastdata.demo`` (``make demo``). The first run draws an embedded
dataset of 10 procedurally generated shape classes (32x32 RGB, random colour, position,
size and noise) and writes it once as PNG files in an ImageFolder layout
(``<data-dir>/shapes32-.../{train,val}/<class>/*.png``); later runs reuse it. Then the
model is trained three times from the same seed:

* plain: ``torchvision.datasets.ImageFolder`` (PIL decode in ``__getitem__``), per-sample
  torchvision transforms, a ``DataLoader`` at the ``num_workers`` measured fastest for
  this pipeline among 0..cores (median of 3 turns each; ``--num-workers`` forces one);
* fastdata, twice: :class:`DemoImages`, an :class:`~lightning_fastdata.OptimizedDataModule`
  over the same folders (decoded once into a cached uint8 store, augmented in batches on
  the device), with :class:`~lightning_fastdata.FastDataCallback`; the first run builds
  its cache inside its timed fit, the second reuses it.

All are timed by the same :class:`~lightning_fastdata.DataWaitProfiler` and compared in
one table. :class:`DemoImages` and :class:`DemoCNN` are importable, so a LightningCLI
config can name them (see ``examples/``).
"""

from __future__ import annotations

import argparse
import colorsys
import json
import logging
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from torch import nn

from lightning_fastdata import augment as A
from lightning_fastdata._util import atomic_write_text, cpu_count, pid_alive
from lightning_fastdata.callbacks import FastDataCallback
from lightning_fastdata.datamodule import OptimizedDataModule
from lightning_fastdata.host_memory import describe as host_memory_state
from lightning_fastdata.host_memory import keep_freed_memory
from lightning_fastdata.profiler import DataWaitProfiler

CLASSES = (
    "circle",
    "square",
    "triangle",
    "plus",
    "ring",
    "hstripes",
    "vstripes",
    "checker",
    "diamond",
    "cross",
)
#: Per-channel mean and std of the generated images (measured on the full training split).
MEAN = (0.460, 0.453, 0.456)
STD = (0.304, 0.301, 0.304)
IMAGE_SIZE = 32
#: Images per class: (train, val).
SIZES = {"full": (500, 100), "quick": (60, 20)}
DATASET_VERSION = 1
_MARKER = "demo_dataset.json"
_TMP_PREFIX = ".tmp-"


# --------------------------------------------------------------------------- the dataset


def _colour(
    rng: np.random.Generator, hue: float
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """A foreground colour near ``hue`` and a background that contrasts with it in brightness."""
    fg_v = rng.uniform(0.55, 1.0) if rng.random() < 0.5 else rng.uniform(0.25, 0.5)
    fg = colorsys.hsv_to_rgb(hue % 1.0, rng.uniform(0.55, 1.0), fg_v)
    bg_v = rng.uniform(0.0, max(fg_v - 0.3, 0.05)) if fg_v > 0.5 else rng.uniform(fg_v + 0.3, 1.0)
    bg = colorsys.hsv_to_rgb(rng.random(), rng.uniform(0.0, 0.4), bg_v)
    return tuple(int(255 * c) for c in fg), tuple(int(255 * c) for c in bg)  # type: ignore[return-value]


def draw_image(label: int, rng: np.random.Generator, size: int = IMAGE_SIZE) -> Image.Image:
    """Draw one image of class ``label``: its shape at a random place, size and colour, plus noise.

    A class has a base hue, jittered by more than half the spacing between classes, so
    colour alone does not separate neighbouring classes; the shape does. Every shape is
    symmetric under a horizontal flip, so flip augmentation keeps the label.
    """
    if not 0 <= label < len(CLASSES):
        raise ValueError(f"label must be in [0, {len(CLASSES)}), got {label}")
    fg, bg = _colour(rng, label / len(CLASSES) + rng.normal(0.0, 0.05))
    img = Image.new("RGB", (size, size), bg)
    d = ImageDraw.Draw(img)
    s = size / 32.0
    r = rng.uniform(7.0, 11.0) * s
    cx, cy = (rng.uniform(r - 2 * s, size - r + 2 * s) for _ in range(2))
    box = (cx - r, cy - r, cx + r, cy + r)
    thick = max(2.0, r / 2.5)
    name = CLASSES[label]
    if name == "circle":
        d.ellipse(box, fill=fg)
    elif name == "square":
        q = r * 0.85
        d.rectangle((cx - q, cy - q, cx + q, cy + q), fill=fg)
    elif name == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r * 0.8), (cx + r, cy + r * 0.8)], fill=fg)
    elif name == "plus":
        d.rectangle((cx - r, cy - thick / 2, cx + r, cy + thick / 2), fill=fg)
        d.rectangle((cx - thick / 2, cy - r, cx + thick / 2, cy + r), fill=fg)
    elif name == "ring":
        d.ellipse(box, outline=fg, width=max(2, round(r / 3.5)))
    elif name in ("hstripes", "vstripes", "checker"):
        period = max(2, round(4 * s))
        x0, y0, x1, y1 = (round(v) for v in box)
        for y in range(y0, y1, period):
            for x in range(x0, x1, period):
                on = {
                    "hstripes": (y - y0) // period % 2 == 0,
                    "vstripes": (x - x0) // period % 2 == 0,
                    "checker": ((x - x0) // period + (y - y0) // period) % 2 == 0,
                }[name]
                if on:
                    d.rectangle((x, y, x + period - 1, y + period - 1), fill=fg)
    elif name == "diamond":
        d.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fg)
    else:  # cross
        w = max(2, round(thick * 0.8))
        d.line((cx - r, cy - r, cx + r, cy + r), fill=fg, width=w)
        d.line((cx - r, cy + r, cx + r, cy - r), fill=fg, width=w)
    noise = rng.normal(0.0, 14.0, (size, size, 3))
    pixels = np.clip(np.asarray(img, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def dataset_dir(
    data_dir: str | os.PathLike, train_per_class: int, val_per_class: int, seed: int = 0
) -> Path:
    """Where the dataset of these sizes lives under ``data_dir`` (one folder per size and seed)."""
    return (
        Path(data_dir) / f"shapes32-v{DATASET_VERSION}-{train_per_class}x{val_per_class}-seed{seed}"
    )


def _expected(train_per_class: int, val_per_class: int, seed: int) -> dict[str, Any]:
    return {
        "version": DATASET_VERSION,
        "classes": list(CLASSES),
        "image_size": IMAGE_SIZE,
        "train_per_class": train_per_class,
        "val_per_class": val_per_class,
        "seed": seed,
    }


def is_complete(path: Path, train_per_class: int, val_per_class: int, seed: int = 0) -> bool:
    """True when ``path`` holds the finished dataset: its marker matches and every file is there."""
    try:
        marker = json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker != _expected(train_per_class, val_per_class, seed):
        return False
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        for name in CLASSES:
            folder = path / split / name
            if not folder.is_dir() or sum(1 for _ in folder.glob("*.png")) != per_class:
                return False
    return True


def _sweep(data_dir: Path, pattern: str = f"{_TMP_PREFIX}shapes32-*") -> None:
    """Remove temporaries that a killed writer left (their pid is in the name and is dead)."""
    for tmp in data_dir.glob(pattern):
        try:
            pid = int(tmp.name.rsplit("-", 2)[-2])
        except (ValueError, IndexError):
            continue
        if not pid_alive(pid):
            shutil.rmtree(tmp, ignore_errors=True)


def make_dataset(
    data_dir: str | os.PathLike = "demo_data",
    train_per_class: int = SIZES["full"][0],
    val_per_class: int = SIZES["full"][1],
    seed: int = 0,
    verbose: bool = False,
) -> Path:
    """Write the demo dataset as PNG files in an ImageFolder layout, once; return its folder.

    The files are written into a temporary folder next to the final one and published by
    one ``rename``, so a killed run never leaves a folder that looks complete; a later run
    sweeps the temporary. A present, complete dataset is reused as is.

    Args:
        data_dir: Parent folder (created if missing).
        train_per_class: Training images per class.
        val_per_class: Validation images per class.
        seed: Seed of the drawing; every image is a function of (seed, split, index).
        verbose: Print what is done.
    """
    for name, value in (("train_per_class", train_per_class), ("val_per_class", val_per_class)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    final = dataset_dir(data_dir, train_per_class, val_per_class, seed)
    if is_complete(final, train_per_class, val_per_class, seed):
        return final
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    _sweep(parent)
    if final.exists():
        if is_complete(final, train_per_class, val_per_class, seed):
            return final  # another process published it since the first check
        # Incomplete or from another version: move it aside first (atomic), then delete.
        stale = parent / f"{_TMP_PREFIX}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = parent / f"{_TMP_PREFIX}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    n = len(CLASSES) * (train_per_class + val_per_class)
    if verbose:
        print(f"writing the demo dataset ({n} PNG files) to {final} ...", flush=True)
    try:
        for split_id, (split, per_class) in enumerate(
            (("train", train_per_class), ("val", val_per_class))
        ):
            for label, name in enumerate(CLASSES):
                folder = tmp / split / name
                folder.mkdir(parents=True)
                for i in range(per_class):
                    rng = np.random.default_rng([seed, split_id, label, i])
                    draw_image(label, rng).save(
                        folder / f"{i:05d}.png", optimize=False, compress_level=1
                    )
        (tmp / _MARKER).write_text(
            json.dumps(_expected(train_per_class, val_per_class, seed), indent=1)
        )
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process published the same dataset first: use theirs.
            if not is_complete(final, train_per_class, val_per_class, seed):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(f"  done in {time.perf_counter() - t0:.1f} s", flush=True)
    return final


# --------------------------------------------------------------------------- data module and model


class DemoImages(OptimizedDataModule):
    """The demo dataset as an :class:`~lightning_fastdata.OptimizedDataModule`.

    ``source`` returns ``torchvision.datasets.ImageFolder`` over the PNG files (written on
    first use); ``static_transform`` decodes each image once to uint8 CHW, which is cached.

    Args:
        root: Data folder holding the generated dataset (see :func:`make_dataset`).
        train_per_class: Training images per class.
        val_per_class: Validation images per class.
        data_seed: Seed the images are drawn from.
        batch_size: Training batch size.
        **kwargs: Any other :class:`~lightning_fastdata.OptimizedDataModule` argument
            (``train_augment``, ``eval_augment``, ``cache_dir``, ``strategy``, ...).
    """

    def __init__(
        self,
        root: str = "demo_data",
        train_per_class: int = SIZES["full"][0],
        val_per_class: int = SIZES["full"][1],
        data_seed: int = 0,
        batch_size: int = 128,
        **kwargs: Any,
    ) -> None:
        super().__init__(batch_size=batch_size, **kwargs)
        for name, value in (("train_per_class", train_per_class), ("val_per_class", val_per_class)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.root = root
        self.train_per_class, self.val_per_class, self.data_seed = (
            train_per_class,
            val_per_class,
            data_seed,
        )

    def dataset_path(self) -> Path:
        """The dataset folder, generated first if missing or incomplete."""
        return make_dataset(
            self.root, self.train_per_class, self.val_per_class, self.data_seed, verbose=True
        )

    def source(self, split: str) -> Any:
        """ImageFolder over the ``train`` or ``val`` folder; no test or predict split."""
        from torchvision.datasets import ImageFolder

        if split not in ("train", "val"):
            return None
        return ImageFolder(str(self.dataset_path() / split))

    def static_transform(self, sample: Any) -> Any:
        """(PIL image, label) -> (uint8 CHW tensor, label)."""
        from torchvision.transforms.functional import pil_to_tensor

        image, label = sample
        return pil_to_tensor(image), label


class DemoCNN(L.LightningModule):
    """A small CNN for 32x32 RGB images: three conv blocks, global pooling, a linear head.

    Args:
        num_classes: Output classes.
        width: Channels of the first block (doubled in each of the next two).
        lr: Adam learning rate.
    """

    def __init__(self, num_classes: int = len(CLASSES), width: int = 8, lr: float = 3e-3) -> None:
        super().__init__()
        if width < 1 or num_classes < 2 or lr <= 0:
            raise ValueError(
                f"need width >= 1, num_classes >= 2, lr > 0; got {width}, {num_classes}, {lr}"
            )
        self.save_hyperparameters()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
            )

        self.net = nn.Sequential(
            block(3, width),
            nn.MaxPool2d(2),
            block(width, 2 * width),
            nn.MaxPool2d(2),
            block(2 * width, 4 * width),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4 * width, num_classes),
        )
        self.lr = lr
        self.val_acc: float = float("nan")
        self._correct = self._seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        self._correct = self._seen = 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self._correct += int((logits.argmax(1) == y).sum())
        self._seen += int(y.numel())
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self.val_acc = self._correct / max(self._seen, 1)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


# --------------------------------------------------------------------------- the runs


def train_augment() -> A.Compose:
    """The fastdata run's batched training augmentation (the plain run's, per batch)."""
    return A.Compose(
        [A.RandomCrop(IMAGE_SIZE, padding=4), A.RandomHorizontalFlip(), A.Normalize(MEAN, STD)]
    )


def _trainer(epochs: int, profiler: DataWaitProfiler, root: Path) -> L.Trainer:
    return L.Trainer(
        max_epochs=epochs,
        accelerator="auto",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[profiler],
        default_root_dir=str(root),
    )


def _result(
    name: str, profiler: DataWaitProfiler, model: DemoCNN, epochs: int, whole_fit_s: float
) -> dict[str, Any]:
    rep = profiler.report()
    per_epoch = rep["samples"] / max(epochs, 1)
    epoch_s = rep["epoch_time_s"]
    # The last epoch's wait, as its time: the first also holds the plain DataLoader starting its workers.
    train_epochs = rep["stages"]["train"]["epochs"]
    return {
        "name": name,
        "epoch_time_s": epoch_s,
        "samples_per_s": per_epoch / epoch_s if epoch_s else 0.0,
        "data_wait_frac": rep["data_wait_frac"],  # over every epoch (the figure of earlier results)
        "data_wait_frac_last_epoch": train_epochs[-1]["data_wait_frac"] if train_epochs else None,
        "val_acc": model.val_acc,
        "steps": rep["steps"],
        "samples": rep["samples"],
        "whole_fit_s": whole_fit_s,
    }


def worker_candidates(cores: int) -> list[int]:
    """The plain run's ``num_workers`` to measure: 0, 1, 2, 4, ... below ``cores``, and ``cores``.

    Every value from 0 to ``cores`` on small machines (0/1/2 on 2 cores); powers of two
    in between on large ones, so measuring stays a few seconds on 16 or 64 cores.
    """
    if cores < 0:
        raise ValueError(f"cores must be >= 0, got {cores}")
    out, k = {0, cores}, 1
    while k < cores:
        out.add(k)
        k *= 2
    return sorted(out)


def _plain_transforms() -> tuple[Any, Any]:
    """Per-sample torchvision v2 pipelines of the plain run: (train, val)."""
    from torchvision.transforms import v2 as T

    to_float = [T.ToImage(), T.ToDtype(torch.float32, scale=True), T.Normalize(MEAN, STD)]
    train = T.Compose([T.RandomCrop(IMAGE_SIZE, padding=4), T.RandomHorizontalFlip(), *to_float])
    return train, T.Compose(to_float)


def _plain_loader(
    dataset: Any, batch_size: int, shuffle: bool, num_workers: int, persistent: bool
) -> Any:
    from torch.utils.data import DataLoader

    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=persistent and num_workers > 0,
    )


def _epochs(loader: Any) -> Any:
    """Batches of ``loader``, epoch after epoch: a small training split still fills the timing."""
    while True:
        yield from loader


#: How often each ``num_workers`` candidate is timed (round-robin); the median of its repeats is its rate.
WORKER_REPEATS = 3


def measure_plain_workers(
    path: Path,
    batch_size: int,
    candidates: Sequence[int],
    device: torch.device | str = "cpu",
    repeats: int = WORKER_REPEATS,
) -> dict[int, list[float]]:
    """Loader-only samples/s of the plain training pipeline, ``repeats`` times per ``num_workers`` candidate.

    The same ImageFolder + per-sample transforms + DataLoader as :func:`run_plain`, each
    batch moved to ``device``. The candidates take turns (0, 1, 2, 0, 1, 2, ...), so a busy
    spell of the machine falls on all of them rather than on one. Each turn starts the
    candidate's workers afresh (kept between turns, their prefetching would run into the
    next candidate's timing), drains ``2 + num_workers`` warm-up batches (the first batches
    the workers made all at once) and times ``4 + num_workers`` (see
    :func:`~lightning_fastdata.autotune.time_loader`).

    Returns:
        Per candidate, the rate of each turn, in the order taken.
    """
    from torchvision.datasets import ImageFolder

    from lightning_fastdata.autotune import time_loader

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    train_tf, _ = _plain_transforms()
    dataset = ImageFolder(str(path / "train"), transform=train_tf)
    rates: dict[int, list[float]] = {nw: [] for nw in candidates}
    for _ in range(repeats):
        for nw in candidates:
            loader = _plain_loader(dataset, batch_size, True, nw, persistent=False)
            # Closing the generator drops the loader's iterator, which stops its workers now.
            rates[nw].append(time_loader(_epochs(loader), device, batches=4 + nw, warmup=2 + nw)[0])
    return rates


def pick_workers(rates: Mapping[int, Sequence[float]]) -> tuple[int, int | None]:
    """The candidate with the highest median rate, and the runner-up if the two are within the noise.

    Within the noise means their repeats overlap (the best one's slowest repeat is no faster
    than the runner-up's fastest): which of the two is faster is then chance.

    Args:
        rates: Per ``num_workers``, the rate of each repeat (as :func:`measure_plain_workers` returns).
    """
    if not rates or not all(rates.values()):
        raise ValueError(f"rates must give at least one repeat per candidate, got {dict(rates)!r}")
    order = sorted(rates, key=lambda nw: (-statistics.median(rates[nw]), nw))
    best = order[0]
    if len(order) > 1 and min(rates[best]) <= max(rates[order[1]]):
        return best, order[1]
    return best, None


def run_plain(
    path: Path,
    epochs: int,
    batch_size: int,
    seed: int,
    work_dir: Path,
    num_workers: int,
    name: str | None = None,
) -> dict[str, Any]:
    """Train with ImageFolder + per-sample torchvision transforms + a DataLoader with workers.

    The whole fit is timed from building the datasets and loaders to the end of
    ``trainer.fit``.
    """
    from torchvision.datasets import ImageFolder

    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    train_tf, val_tf = _plain_transforms()
    t0 = time.perf_counter()
    L.seed_everything(seed, workers=True, verbose=False)
    train = _plain_loader(
        ImageFolder(str(path / "train"), transform=train_tf), batch_size, True, num_workers, True
    )
    val = _plain_loader(
        ImageFolder(str(path / "val"), transform=val_tf), batch_size, False, num_workers, True
    )
    model = DemoCNN()
    profiler = DataWaitProfiler()
    trainer = _trainer(epochs, profiler, work_dir)
    setup_s = time.perf_counter() - t0
    trainer.fit(model, train, val)
    out = _result(
        name or f"plain DataLoader ({num_workers} workers)",
        profiler,
        model,
        epochs,
        time.perf_counter() - t0,
    )
    out.update(num_workers=num_workers, setup_s=setup_s)
    return out


class _TimedDemoImages(DemoImages):
    """:class:`DemoImages` that records how long Lightning's ``prepare_data`` call took."""

    prepare_s: float = 0.0

    def prepare_data(self) -> None:
        t0 = time.perf_counter()
        super().prepare_data()
        self.prepare_s += time.perf_counter() - t0


def _store_dirs(cache_dir: str) -> set[str]:
    return {str(p.relative_to(cache_dir)) for p in Path(cache_dir).rglob("*") if p.is_dir()}


def run_fastdata(
    path_root: str,
    sizes: tuple[int, int],
    epochs: int,
    batch_size: int,
    seed: int,
    cache_dir: str,
    work_dir: Path,
) -> dict[str, Any]:
    """Train with :class:`DemoImages` (cached uint8 store, batched on-device augmentation).

    The whole fit is timed from building the data module to the end of ``trainer.fit``,
    so it includes ``prepare_data``: the cache build when ``cache_dir`` has no valid cache
    (``cache_built`` is then true), else the check that reuses it.
    """
    before = _store_dirs(cache_dir)
    t0 = time.perf_counter()
    L.seed_everything(seed, workers=True, verbose=False)
    dm = _TimedDemoImages(
        root=path_root,
        train_per_class=sizes[0],
        val_per_class=sizes[1],
        batch_size=batch_size,
        cache_dir=cache_dir,
        seed=seed,
        progress=False,
        train_augment=train_augment(),
        eval_augment=A.Normalize(MEAN, STD),
    )
    model = DemoCNN()
    callback = FastDataCallback()
    trainer = _trainer(epochs, callback, work_dir)
    trainer.fit(model, datamodule=dm)
    whole_s = time.perf_counter() - t0
    strategy = dm.plan.strategy if dm.plan is not None else "?"
    out = _result(f"fastdata ({strategy})", callback, model, epochs, whole_s)
    out.update(
        strategy=strategy,
        cache_build_s=dm.prepare_s,
        cache_built=_store_dirs(cache_dir) != before,
    )
    return out


def _warm_up(device: str, batch_size: int) -> None:
    """One forward and backward pass of a throwaway model before anything is timed.

    The CUDA context, cuDNN's and the CPU kernels' first-call costs are paid here, so
    neither run (the first one above all) pays them inside its timing.
    """
    model = DemoCNN().to(device)
    x = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, device=device)
    y = torch.zeros(batch_size, dtype=torch.long, device=device)
    F.cross_entropy(model(x), y).backward()
    if device == "cuda":
        torch.cuda.synchronize()


def _ratio(old: float | None, new: float | None) -> float | None:
    """``old / new``: above 1 when ``new`` takes less time (or, for rates, pass them swapped)."""
    if old is None or new is None or not new or not math.isfinite(old / new):
        return None
    return old / new


def speedups(result: dict[str, Any]) -> dict[str, float | None]:
    """Every ratio the table shows, above 1 where fastdata is faster, below 1 where it is slower."""
    plain, fast, cached = result["plain"], result["fastdata"], result.get("fastdata_cached")
    return {
        "epoch_time": _ratio(plain["epoch_time_s"], fast["epoch_time_s"]),
        "samples_per_s": _ratio(fast["samples_per_s"], plain["samples_per_s"]),
        "whole_fit_first_run": _ratio(plain["whole_fit_s"], fast["whole_fit_s"]),
        "whole_fit_cache_reused": _ratio(plain["whole_fit_s"], cached and cached["whole_fit_s"]),
    }


# --------------------------------------------------------------------------- report


def _fmt_ratio(r: float | None) -> str:
    """A speed-up, with a loss said as plainly as a win."""
    if r is None:
        return "-"
    return f"{r:.2f}x" if r >= 1 else f"{r:.2f}x (slower)"


def _workers_lines(plain: dict[str, Any]) -> list[str]:
    """The measured rates by ``num_workers``: each median with its repeats' range, and whether the top two are apart."""
    rates = plain.get("workers_measured")
    if not rates:
        return []
    repeats = plain.get("workers_repeats")  # absent from results written before the repeats
    keys = sorted(rates, key=int)
    took = plain.get("measure_s")
    took_s = f"; measured in {took:.1f} s before the runs" if took is not None else ""
    if not repeats:
        by = " / ".join(f"{k}: {rates[k]:,.0f}" for k in keys)
        return [f"          loader-only samples/s by num_workers: {by}{took_s}"]
    by = " / ".join(f"{k}: {rates[k]:,.0f} ({min(repeats[k]):,.0f}-{max(repeats[k]):,.0f})" for k in keys)
    turns = min(len(v) for v in repeats.values())
    lines = [f"          loader-only samples/s by num_workers, median (range) of {turns} turns taken in "
             f"rotation: {by}{took_s}"]
    best, runner_up = pick_workers({int(k): v for k, v in repeats.items()})
    if runner_up is not None:
        lines.append(f"          {best} and {runner_up} workers are within the noise (their repeats overlap): "
                     "which of the two is faster is chance")
    return lines


def _loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where the system does not tell."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):  # not on Windows
        return None


def _loadavg_line(result: dict[str, Any]) -> str | None:
    before, after = result.get("loadavg_before"), result.get("loadavg_after")
    if before is None and after is None:
        return None

    def fmt(v: list[float] | None) -> str:
        return " ".join(f"{x:.2f}" for x in v) if v else "-"

    line = f"load average (1/5/15 min): {fmt(before)} before the demo, {fmt(after)} after"
    cores = result.get("cores")
    if before and cores and before[0] > cores:
        line += f"; busy: above its {cores} cores before it started, so every timing shared them"
    return line


def format_table(result: dict[str, Any]) -> str:
    """The side-by-side table of one demo result (as written by ``--json-out``), with ratios.

    The rows above "whole fit" come from the fastdata run that built its cache. A run
    that is missing (``fastdata_cached`` is ``None`` in results of the earlier demo
    format) shows as "not measured".
    """
    plain, fast, cached = result["plain"], result["fastdata"], result.get("fastdata_cached")
    ratios = speedups(result)

    def secs(v: float | None) -> str:
        # Three decimals: a speed-up recomputed from the printed times agrees with the one
        # printed (from the unrounded times) to within 0.5%, not 3% as with two on 0.2 s epochs.
        return "not measured" if v is None else f"{v:.3f} s"

    def pct(v: float | None) -> str:
        return "not measured" if v is None else f"{v:.1%}"

    # Results written before the demo kept the last epoch's wait have only the all-epochs one.
    last = "data_wait_frac_last_epoch" in plain and "data_wait_frac_last_epoch" in fast
    wait_key = "data_wait_frac_last_epoch" if last else "data_wait_frac"
    wait_label = "step time waiting for data (last epoch)" if last else "step time waiting for data (all epochs)"
    rows = [
        ("", "plain", "fastdata", "speed-up"),
        (
            "epoch time (last, train+val)",
            secs(plain["epoch_time_s"]),
            secs(fast["epoch_time_s"]),
            _fmt_ratio(ratios["epoch_time"]),
        ),
        (
            "samples/s (train samples / epoch time)",
            f"{plain['samples_per_s']:,.0f}",
            f"{fast['samples_per_s']:,.0f}",
            _fmt_ratio(ratios["samples_per_s"]),
        ),
        (wait_label, pct(plain.get(wait_key)), pct(fast.get(wait_key)), ""),
        (
            f"val accuracy after {result['epochs']} epochs",
            f"{plain['val_acc']:.1%}",
            f"{fast['val_acc']:.1%}",
            "",
        ),
        (
            "whole fit, first run",
            secs(plain["whole_fit_s"]),
            secs(fast["whole_fit_s"]),
            _fmt_ratio(ratios["whole_fit_first_run"]),
        ),
        ("  of which prepare_data (cache build)", "-", secs(fast.get("cache_build_s")), ""),
        (
            "whole fit, cache reused",
            secs(plain["whole_fit_s"]),
            secs(cached and cached["whole_fit_s"]),
            _fmt_ratio(ratios["whole_fit_cache_reused"]),
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]
    lines.insert(1, "-" * max(len(line) for line in lines))
    head = [f"plain:    {plain['name']}", *_workers_lines(plain), f"fastdata: {fast['name']}"]
    load = _loadavg_line(result)
    if load:
        head.append(load)
    return "\n".join([*head, "", *lines])


NOTES = """\
whole fit: from building the loaders (plain) or the data module (fastdata) to the end of
trainer.fit, so fastdata's first run includes building its cache in prepare_data; the
plain run has no cache, so its one whole fit is on both rows. The other rows are from
fastdata's first run. A speed-up below 1x is a loss.
waiting for data: in the last epoch (as the epoch time: the first also starts the plain
run's workers), the share of the training steps' wall time spent between the end of one
step and the start of the next (fetch, host-to-device copy, augmentation launch)."""


def _quiet() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
    # Lightning's own use of a deprecated torch API; nothing a demo user can act on.
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")


def _fresh_cache(parent: Path) -> Path:
    """A new, empty cache folder for this demo run (its name carries our pid for the sweep)."""
    parent.mkdir(parents=True, exist_ok=True)
    _sweep(parent, f"{_TMP_PREFIX}demo-cache-*")
    return Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}demo-cache-{os.getpid()}-", dir=parent))


def _check_paths(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a data, cache or JSON path the demo cannot write, naming its option, before any run.

    Found later, the folder would fail as a bare traceback, and ``--json-out`` only after
    every run had been made (and its figures lost).
    """
    folders = [("--data-dir", Path(args.data_dir)),
               ("--cache-dir", Path(args.cache_dir) if args.cache_dir else Path(args.data_dir) / "cache")]
    if args.json_out:
        out = Path(args.json_out)
        if out.is_dir():
            p.error(f"--json-out {out} is a folder; give a file name, e.g. {out / 'demo.json'}")
        folders.append(("--json-out", out.parent))
    for option, folder in folders:  # every check that creates nothing first
        if folder.exists() and not folder.is_dir():
            p.error(f"{option} {folder} is a file, not a folder")
    for option, folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):  # can files be created there? (removed on close)
                pass
        except OSError as e:
            p.error(f"{option}: cannot write into {folder}: {e.strerror or e}")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: see ``python -m lightning_fastdata.demo --help``."""
    p = argparse.ArgumentParser(
        prog="python -m lightning_fastdata.demo", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--data-dir",
        default="demo_data",
        help="where the PNG dataset is written (default %(default)s)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where fastdata's cache is built, in a fresh folder removed at exit "
        "(default <data-dir>/cache)",
    )
    p.add_argument("--epochs", type=int, default=2,
                   help="epochs per run, at least 2: the last one is timed (default %(default)s)")
    p.add_argument(
        "--batch-size", type=int, default=None, help="batch size (default 128, 32 with --quick)"
    )
    p.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="plain DataLoader workers (default: the fastest measured among 0..cores)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of every run (default %(default)s)")
    p.add_argument(
        "--quick", action="store_true", help=f"tiny dataset {SIZES['quick']} per class, for tests"
    )
    p.add_argument("--json-out", default=None, help="also write the results as JSON to this file")
    args = p.parse_args(argv)
    loadavg_before = _loadavg()  # before the demo adds its own load
    if args.epochs < 2:
        # The report's epoch rows time the last epoch; with one epoch that is the first, which
        # includes the plain DataLoader's worker start-up but not fastdata's set-up (done before it).
        p.error(f"--epochs must be >= 2, got {args.epochs}: the epoch time reported is the last "
                "epoch's, and the first also times the plain DataLoader starting its workers "
                "(fastdata sets up before it), so the two sides are not timed alike; use --epochs 2 or more")
    if args.batch_size is None:
        args.batch_size = 32 if args.quick else 128
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.num_workers is not None and args.num_workers < 0:
        p.error(f"--num-workers must be >= 0, got {args.num_workers}")
    _check_paths(p, args)
    _quiet()
    sizes = SIZES["quick" if args.quick else "full"]
    work_dir = Path(args.data_dir)
    path = make_dataset(args.data_dir, *sizes, verbose=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cores = cpu_count()
    print(
        f"training DemoCNN for {args.epochs} epochs on {10 * sizes[0]} images ({device}, "
        f"{cores} cores, torch threads {torch.get_num_threads()}), validating on {10 * sizes[1]}",
        flush=True,
    )
    _warm_up(device, args.batch_size)
    if device == "cpu":
        # OptimizedDataModule keeps freed host memory on a CPU run (host_memory.py), for the
        # whole process: set before the plain run too, so every run has the same malloc.
        keep_freed_memory()
    rates: dict[int, list[float]] | None = None
    measure_s: float | None = None
    if args.num_workers is None:
        candidates = worker_candidates(cores)
        print(
            f"measuring the plain DataLoader at num_workers {'/'.join(map(str, candidates))} "
            f"(loader only, {WORKER_REPEATS} turns each, in rotation) ...",
            flush=True,
        )
        t0 = time.perf_counter()
        rates = measure_plain_workers(path, args.batch_size, candidates, device)
        measure_s = time.perf_counter() - t0
        nw, _ = pick_workers(rates)
        name = f"plain DataLoader (best of {'/'.join(map(str, candidates))} workers: {nw})"
    else:
        nw = args.num_workers
        name = f"plain DataLoader ({nw} workers, set by --num-workers)"
    print(f"run 1/3: {name} ...", flush=True)
    plain = run_plain(path, args.epochs, args.batch_size, args.seed, work_dir, nw, name)
    plain.update(
        # The median of each candidate's repeats (the single rate in earlier results), and the repeats.
        workers_measured={str(k): statistics.median(v) for k, v in rates.items()} if rates else None,
        workers_repeats={str(k): v for k, v in rates.items()} if rates else None,
        measure_s=measure_s,
    )
    cache_dir = _fresh_cache(Path(args.cache_dir or work_dir / "cache"))
    try:
        runs = []
        for i, what in ((2, "first run, builds its cache"), (3, "second run, cache reused")):
            print(f"run {i}/3: fastdata, {what} ...", flush=True)
            runs.append(
                run_fastdata(
                    args.data_dir, sizes, args.epochs, args.batch_size, args.seed, str(cache_dir),
                    work_dir,
                )
            )
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    result: dict[str, Any] = {
        "format": 2,
        "plain": plain,
        "fastdata": runs[0],
        "fastdata_cached": runs[1],
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "train_images": 10 * sizes[0],
        "val_images": 10 * sizes[1],
        "quick": args.quick,
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.machine(),
        "cores": cores,
        "torch_threads": torch.get_num_threads(),
        "host_memory": host_memory_state(),
        "loadavg_before": loadavg_before,
        "loadavg_after": _loadavg(),
        "torch": torch.__version__,
        "lightning": L.__version__,
        "command": " ".join(["python -m lightning_fastdata.demo", *(sys.argv[1:] if argv is None else argv)]),
    }
    result["speedups"] = speedups(result)
    print()
    print(format_table(result))
    print()
    print(NOTES)
    if device == "cpu":
        print(f"cpu run: the model's compute shares {cores} cores with the plain run's workers; every run "
              f"with host memory: {result['host_memory']}.")
    if args.json_out:
        atomic_write_text(args.json_out, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
