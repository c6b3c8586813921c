"""The demo: the same small CNN trained from PNG files, with a plain DataLoader and with fastdata.

Run ``python -m lightning_fastdata.demo`` (``make demo``). The first run draws an embedded
dataset of 10 procedurally generated shape classes (32x32 RGB, random colour, position,
size and noise) and writes it once as PNG files in an ImageFolder layout
(``<data-dir>/shapes32-.../{train,val}/<class>/*.png``); later runs reuse it. Then the
model is trained twice from the same seed:

* plain: ``torchvision.datasets.ImageFolder`` (PIL decode in ``__getitem__``), per-sample
  torchvision transforms, a ``DataLoader`` with the usual ``num_workers``;
* fastdata: :class:`DemoImages`, an :class:`~lightning_fastdata.OptimizedDataModule` over
  the same folders (decoded once into a cached uint8 store, augmented in batches on the
  device), with :class:`~lightning_fastdata.FastDataCallback`.

Both are timed by the same :class:`~lightning_fastdata.DataWaitProfiler` and compared in
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
import shutil
import sys
import time
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from torch import nn

from lightning_fastdata import augment as A
from lightning_fastdata._util import pid_alive
from lightning_fastdata.callbacks import FastDataCallback
from lightning_fastdata.datamodule import OptimizedDataModule
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


def _sweep(data_dir: Path) -> None:
    """Remove temporaries that a killed writer left (their pid is in the name and is dead)."""
    for tmp in data_dir.glob(f"{_TMP_PREFIX}shapes32-*"):
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


# --------------------------------------------------------------------------- the two runs


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
    name: str, profiler: DataWaitProfiler, model: DemoCNN, epochs: int, setup_s: float, fit_s: float
) -> dict[str, Any]:
    rep = profiler.report()
    per_epoch = rep["samples"] / max(epochs, 1)
    epoch_s = rep["epoch_time_s"]
    return {
        "name": name,
        "epoch_time_s": epoch_s,
        "samples_per_s": per_epoch / epoch_s if epoch_s else 0.0,
        "data_wait_frac": rep["data_wait_frac"],
        "val_acc": model.val_acc,
        "steps": rep["steps"],
        "samples": rep["samples"],
        "setup_s": setup_s,
        "fit_s": fit_s,
    }


def _cores() -> int:
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )


def default_num_workers() -> int:
    """The usual choice: ``min(4, cores)``."""
    return min(4, _cores())


def run_plain(
    path: Path,
    epochs: int,
    batch_size: int,
    seed: int,
    work_dir: Path,
    num_workers: int | None = None,
) -> dict[str, Any]:
    """Train with ImageFolder + per-sample torchvision transforms + a DataLoader with workers."""
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2 as T

    nw = default_num_workers() if num_workers is None else num_workers
    to_float = [T.ToImage(), T.ToDtype(torch.float32, scale=True), T.Normalize(MEAN, STD)]
    train_tf = T.Compose([T.RandomCrop(IMAGE_SIZE, padding=4), T.RandomHorizontalFlip(), *to_float])
    t0 = time.perf_counter()
    L.seed_everything(seed, workers=True, verbose=False)
    pin = torch.cuda.is_available()
    common = dict(num_workers=nw, pin_memory=pin, persistent_workers=nw > 0)
    train = DataLoader(
        ImageFolder(str(path / "train"), transform=train_tf),
        batch_size=batch_size,
        shuffle=True,
        **common,
    )
    val = DataLoader(
        ImageFolder(str(path / "val"), transform=T.Compose(to_float)),
        batch_size=batch_size,
        shuffle=False,
        **common,
    )
    model = DemoCNN()
    profiler = DataWaitProfiler()
    trainer = _trainer(epochs, profiler, work_dir)
    setup_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    trainer.fit(model, train, val)
    return _result(
        f"plain DataLoader ({nw} workers)",
        profiler,
        model,
        epochs,
        setup_s,
        time.perf_counter() - t1,
    )


def run_fastdata(
    path_root: str,
    sizes: tuple[int, int],
    epochs: int,
    batch_size: int,
    seed: int,
    cache_dir: str,
    work_dir: Path,
) -> dict[str, Any]:
    """Train with :class:`DemoImages` (cached uint8 store, batched on-device augmentation)."""
    t0 = time.perf_counter()
    L.seed_everything(seed, workers=True, verbose=False)
    dm = DemoImages(
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
    # Build (or reuse) the cache before fit, so its one-time cost is reported on its own.
    dm.prepare_data()
    setup_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    strategy = dm.plan.strategy if dm.plan is not None else "?"
    return _result(
        f"fastdata ({strategy})", callback, model, epochs, setup_s, time.perf_counter() - t1
    )


# --------------------------------------------------------------------------- report


def format_table(plain: dict[str, Any], fast: dict[str, Any], epochs: int) -> str:
    """The side-by-side table with the speed-up column."""

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b and math.isfinite(a / b) else "-"

    rows = [
        ("", "plain", "fastdata", "speed-up"),
        (
            "epoch time (last, train+val)",
            f"{plain['epoch_time_s']:.2f} s",
            f"{fast['epoch_time_s']:.2f} s",
            ratio(plain["epoch_time_s"], fast["epoch_time_s"]),
        ),
        (
            "samples/s (train)",
            f"{plain['samples_per_s']:,.0f}",
            f"{fast['samples_per_s']:,.0f}",
            ratio(fast["samples_per_s"], plain["samples_per_s"]),
        ),
        (
            "step time waiting for data",
            f"{plain['data_wait_frac']:.1%}",
            f"{fast['data_wait_frac']:.1%}",
            "",
        ),
        (
            f"val accuracy after {epochs} epochs",
            f"{plain['val_acc']:.1%}",
            f"{fast['val_acc']:.1%}",
            "",
        ),
        (
            "setup before fit (cache build)",
            f"{plain['setup_s']:.2f} s",
            f"{fast['setup_s']:.2f} s",
            "",
        ),
        (
            "whole fit",
            f"{plain['fit_s']:.2f} s",
            f"{fast['fit_s']:.2f} s",
            ratio(plain["fit_s"], fast["fit_s"]),
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join([f"plain:    {plain['name']}", f"fastdata: {fast['name']}", "", *lines])


def _quiet() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
    # Lightning's own use of a deprecated torch API; nothing a demo user can act on.
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")


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
    p.add_argument("--cache-dir", default=None, help="fastdata cache (default <data-dir>/cache)")
    p.add_argument("--epochs", type=int, default=2, help="epochs per run (default %(default)s)")
    p.add_argument(
        "--batch-size", type=int, default=None, help="batch size (default 128, 32 with --quick)"
    )
    p.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="plain DataLoader workers (default min(4, cores))",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of both runs (default %(default)s)")
    p.add_argument(
        "--quick", action="store_true", help=f"tiny dataset {SIZES['quick']} per class, for tests"
    )
    p.add_argument("--json-out", default=None, help="also write the results as JSON to this file")
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error(f"--epochs must be >= 1, got {args.epochs}")
    if args.batch_size is None:
        args.batch_size = 32 if args.quick else 128
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    _quiet()
    sizes = SIZES["quick" if args.quick else "full"]
    cache_dir = args.cache_dir or str(Path(args.data_dir) / "cache")
    work_dir = Path(args.data_dir)
    path = make_dataset(args.data_dir, *sizes, verbose=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"training DemoCNN for {args.epochs} epochs on {10 * sizes[0]} images ({device}, "
        f"torch threads {torch.get_num_threads()}), validating on {10 * sizes[1]}",
        flush=True,
    )
    print("run 1/2: plain DataLoader ...", flush=True)
    plain = run_plain(path, args.epochs, args.batch_size, args.seed, work_dir, args.num_workers)
    print("run 2/2: fastdata ...", flush=True)
    fast = run_fastdata(
        args.data_dir, sizes, args.epochs, args.batch_size, args.seed, cache_dir, work_dir
    )
    print()
    print(format_table(plain, fast, args.epochs))
    print(
        "\nwaiting for data: share of the training steps' wall time spent between the end of one"
        "\nstep and the start of the next (fetch, host-to-device copy, augmentation launch)."
    )
    if device == "cpu":
        print(
            f"cpu run: the model's compute shares {_cores()} cores with the plain run's worker "
            "processes."
        )
    if args.json_out:
        out = {
            "plain": plain,
            "fastdata": fast,
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "train_images": 10 * sizes[0],
            "val_images": 10 * sizes[1],
            "device": device,
            "speedup_epoch_time": plain["epoch_time_s"] / fast["epoch_time_s"]
            if fast["epoch_time_s"]
            else None,
        }
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
