"""3-D volumes: MONAI's two loading recipes against the ``device`` strategy, side by side in one run.

The same work on every side: from 1 x S^3 int16 CT-like volumes (blobs of another
intensity, noise) and their uint8 masks, held in memory, each training sample is a
random C^3 crop centred on foreground or background with equal odds (MONAI's
``RandCropByPosNegLabeld``, pos=1, neg=1), flipped along each spatial axis
independently with probability 0.5, windowed from HU [-1000, 1000] to [0, 1] and
scaled by a random factor in [0.9, 1.1]; batches of float32 images (B, 1, C, C, C) and
their masks, delivered on ``--device``. Loader-only: no model; median samples/s over
``--repeats`` timed segments of ``--batches`` batches after ``--warmup`` untimed ones. The
sides take turns: each round times one segment of every side, so a slow spell of a shared
machine falls on all of them, not on whichever happened to run then.

- ``monai DataLoader``: MONAI's usual recipe. ``CacheDataset`` caches the deterministic
  part (``EnsureTyped``, ``ScaleIntensityRanged``, ``FgBgToIndicesd``: the foreground
  and background voxel indices, so crops need not scan the mask), then
  ``RandCropByPosNegLabeld`` (with those indices), ``RandFlipd`` on each axis,
  ``RandScaleIntensityd``, ``EnsureTyped`` per sample in ``monai.data.DataLoader``
  workers (persistent, so they are not restarted every epoch of 4 batches), at every
  ``--workers`` count (default 0, 1, 2, 4, ... up to the cores); the best is reported.
- ``monai ThreadDataLoader``: MONAI's GPU-cache recipe (its fast-training tutorial):
  the cached transforms end in ``EnsureTyped(device=...)``, so the cache lives on the
  device and the random transforms run there, per sample, in ``ThreadDataLoader``
  (``num_workers=0``).
- ``lightning_fastdata device``: an ``OptimizedDataModule`` over the same volumes, int16
  and uint8 in its store, placed whole on the device (``strategy="device"``), with
  ``field_kinds={"image": "image", "label": "mask"}`` and ``train_augment`` =
  ``RandomCropByLabel``, ``RandomFlip(dims=(-3, -2, -1))``, ``ScaleIntensityRange``,
  ``RandomScaleIntensity``, batched on the device; the training loader timed, with its
  augmentation (as in training with the default ``augment_ahead="auto"``: ahead of the
  consumer in a background thread on CUDA, between batches in the consumer's thread on a CPU).
- ``lightning_fastdata device, window cached``: the same, with the window applied once per
  volume by the data module's ``static_transform`` (float32 images in the store, as in
  MONAI's cache), so each batch gets the crop, flips and random scale only: MONAI's per-sample work.

Each row also records what its cache holds in memory (``cache_mb``): MONAI's cached images,
masks and foreground/background index lists; our store.

Both MONAI recipes use ``copy_cache=False`` and ``set_track_meta(False)``, as MONAI's
fast-training tutorial does. The JSON records each side's output shapes and dtypes and
whether they agree. Every side runs in one process with glibc's malloc keeping freed
memory (``host_memory.keep_freed_memory``, which ``OptimizedDataModule`` applies on a CPU run
where it builds the batches), set before the first side runs; ``--default-malloc`` runs every
side with glibc's defaults instead. Install MONAI with ``pip install lightning-fastdata[bench]``.

Usage::

    python benchmarks/volumes.py                    # 16 volumes 128^3, 96^3 crops, on the CPU
    python benchmarks/volumes.py --device cuda      # the same on a GPU
    python benchmarks/volumes.py --quick            # seconds-long smoke test (64^3 volumes, 48^3 crops), no JSON
    python benchmarks/volumes.py --default-malloc   # every side with glibc's default malloc

Writes ``benchmarks/results/volumes.json`` (``--out``; a ``--quick`` run only when
``--out`` is given) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_fastdata import OptimizedDataModule
from lightning_fastdata import augment as A
from lightning_fastdata._util import atomic_write_text, cpu_count
from lightning_fastdata.host_memory import describe as host_memory_state
from lightning_fastdata.host_memory import keep_freed_memory

RESULTS = Path(__file__).parent / "results" / "volumes.json"
FASTDATA = "lightning_fastdata device"
FASTDATA_CACHED = "lightning_fastdata device, window cached"
HU_MIN, HU_MAX = -1000, 1000
SCALE = 0.1  # intensity factor in [1 - SCALE, 1 + SCALE]


# --------------------------------------------------------------------------- data


def make_volumes(n: int, side: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` int16 CT-like volumes (n, 1, side, side, side) with 1-3 blobs each, and uint8 masks of the blobs."""
    rng = np.random.default_rng(seed)
    g = (np.arange(side, dtype=np.float32) + 0.5) / side
    z, y, x = g[:, None, None], g[None, :, None], g[None, None, :]
    images = np.empty((n, 1, side, side, side), np.int16)
    labels = np.zeros((n, 1, side, side, side), np.uint8)
    for i in range(n):
        body = ((x - 0.5) / 0.45) ** 2 + ((y - 0.5) / 0.4) ** 2 + ((z - 0.5) / 0.48) ** 2 <= 1
        hu = np.where(body, 40.0, -1000.0).astype(np.float32)
        for _ in range(int(rng.integers(1, 4))):
            c, r = rng.uniform(0.3, 0.7, 3), rng.uniform(0.06, 0.14, 3)
            blob = ((x - c[2]) / r[2]) ** 2 + ((y - c[1]) / r[1]) ** 2 + ((z - c[0]) / r[0]) ** 2 <= 1
            hu[blob] = rng.uniform(130, 200)
            labels[i, 0][blob] = 1
        hu += rng.normal(0, 20, hu.shape).astype(np.float32)
        images[i, 0] = np.clip(np.rint(hu), HU_MIN, HU_MAX)
    return images, labels


# --------------------------------------------------------------------------- timing


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_batches(batches: Iterable[dict[str, Any]], device: torch.device, count: int, warmup: int,
                 finish: Callable[[Any], dict[str, Any]] | None = None) -> tuple[float, dict[str, Any]]:
    """Samples/s over ``count`` batches after ``warmup``, each moved to ``device`` and passed through
    ``finish``; returns it and the first batch's fields as ``{name: [shape, dtype, device]}``."""
    it = iter(batches)
    samples, start, first = 0, None, None
    try:
        for k in range(warmup + count):
            if k == warmup:
                _sync(device)
                start = time.perf_counter()
            batch = next(it)
            out = _to(batch, device) if finish is None else finish(batch)
            if first is None:
                first = {n: [list(v.shape), str(v.dtype).replace("torch.", ""), v.device.type]
                         for n, v in out.items() if n in ("image", "label")}
            if k >= warmup:
                samples += int(out["image"].shape[0])
        _sync(device)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return samples / (time.perf_counter() - start), first or {}


class Side(NamedTuple):
    """One loader of the comparison: ``make()`` gives a fresh endless iterator of its batches,
    ``finish`` turns a batch into its output on the device, ``close`` releases it at the end."""

    loader: str
    settings: str
    num_workers: int
    make: Callable[[], Iterable[Any]]
    finish: Callable[[Any], dict[str, Any]] | None
    cache_s: float
    cache_bytes: int
    close: Callable[[], None] = lambda: None


def run_sides(sides: list[Side], args: argparse.Namespace, device: torch.device) -> list[dict]:
    """``--repeats`` rounds; in each, one timed segment of every side in turn (so a slow spell of
    the machine falls on every side alike, not on whichever ran then); a row per side with the
    median samples/s."""
    rates: list[list[float]] = [[] for _ in sides]
    shapes: list[dict[str, Any]] = [{} for _ in sides]
    for _ in range(args.repeats):
        for j, side in enumerate(sides):
            rate, shapes[j] = time_batches(side.make(), device, args.batches, args.warmup, side.finish)
            rates[j].append(rate)
    rows = []
    for side, r, shape in zip(sides, rates, shapes, strict=True):
        print(f"  {side.loader} ({side.settings}): {statistics.median(r):,.1f} samples/s", file=sys.stderr)
        rows.append({"loader": side.loader, "settings": side.settings, "num_workers": side.num_workers,
                     "samples_per_s": statistics.median(r), "rates": r, "cache_s": side.cache_s,
                     "cache_mb": side.cache_bytes / 1e6, "output": shape})
    return rows


def _endless(loader: Iterable[Any]) -> Iterable[Any]:
    while True:
        yield from loader


# --------------------------------------------------------------------------- MONAI


def _monai_transforms(crop: int, device: torch.device | None) -> tuple[list[Any], list[Any]]:
    """(cached deterministic transforms, random transforms) of MONAI's recipe; ``device``: cache there."""
    from monai.transforms import (
        EnsureTyped,
        FgBgToIndicesd,
        RandCropByPosNegLabeld,
        RandFlipd,
        RandScaleIntensityd,
        ScaleIntensityRanged,
    )

    keys = ["image", "label"]
    cached = [
        EnsureTyped(keys=keys, track_meta=False),
        ScaleIntensityRanged(keys="image", a_min=HU_MIN, a_max=HU_MAX, b_min=0.0, b_max=1.0, clip=True),
        FgBgToIndicesd(keys="label", fg_postfix="_fg", bg_postfix="_bg"),
    ]
    if device is not None:
        cached.append(EnsureTyped(keys=keys, device=device, track_meta=False))
    rand = [
        RandCropByPosNegLabeld(keys=keys, label_key="label", spatial_size=(crop,) * 3, pos=1, neg=1, num_samples=1,
                               fg_indices_key="label_fg", bg_indices_key="label_bg"),
        *(RandFlipd(keys=keys, prob=0.5, spatial_axis=a) for a in range(3)),
        RandScaleIntensityd(keys="image", factors=SCALE, prob=1.0),
        EnsureTyped(keys=keys, track_meta=False),
    ]
    return cached, rand


def _nbytes(item: Any) -> int:
    """Bytes of the arrays and tensors in a cached item (a dict of them)."""
    if isinstance(item, dict):
        return sum(_nbytes(v) for v in item.values())
    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    return int(getattr(item, "nbytes", 0))


def _monai_dataset(images: np.ndarray, labels: np.ndarray, crop: int, device: torch.device | None) -> tuple[Any, float]:
    from monai.data import CacheDataset
    from monai.transforms import Compose

    cached, rand = _monai_transforms(crop, device)
    data = [{"image": images[i], "label": labels[i]} for i in range(len(images))]
    t0 = time.perf_counter()
    ds = CacheDataset(data, transform=Compose(cached + rand), cache_rate=1.0, num_workers=None, progress=False,
                      copy_cache=False)
    return ds, time.perf_counter() - t0


def _monai_finish(device: torch.device) -> Callable[[Any], dict[str, Any]]:
    keep = ("image", "label")  # the fg/bg index lists are not part of the output

    def finish(batch: Any) -> dict[str, Any]:
        return {k: batch[k].to(device, non_blocking=True) for k in keep}

    return finish


def _cache_bytes(ds: Any) -> int:
    """What a MONAI CacheDataset holds: images, labels and the foreground/background index lists."""
    return sum(_nbytes(item) for item in ds._cache)


def monai_dataloader_sides(images: np.ndarray, labels: np.ndarray, args: argparse.Namespace,
                           device: torch.device) -> list[Side]:
    """MONAI CacheDataset + DataLoader (random transforms per sample in workers), at each worker count."""
    from monai.data import DataLoader

    ds, cache_s = _monai_dataset(images, labels, args.crop, None)

    def make(nw: int) -> Callable[[], Iterable[Any]]:
        return lambda: _endless(DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=nw,
                                           pin_memory=device.type == "cuda", persistent_workers=nw > 0,
                                           prefetch_factor=2 if nw else None, drop_last=True))

    return [Side("monai DataLoader", f"CacheDataset, num_workers={nw}" + (", persistent" if nw else ""), nw, make(nw),
                 _monai_finish(device), cache_s, _cache_bytes(ds)) for nw in args.workers]


def monai_thread_side(images: np.ndarray, labels: np.ndarray, args: argparse.Namespace, device: torch.device) -> Side:
    """MONAI's GPU-cache recipe: the cache on the device, random transforms there, ThreadDataLoader."""
    from monai.data import ThreadDataLoader

    ds, cache_s = _monai_dataset(images, labels, args.crop, device)

    def make() -> Iterable[Any]:
        return _endless(ThreadDataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=0,
                                         drop_last=True))
    return Side("monai ThreadDataLoader", f"CacheDataset on {device.type}, num_workers=0", 0, make,
                _monai_finish(device), cache_s, _cache_bytes(ds))


# --------------------------------------------------------------------------- lightning_fastdata


class ArrayVolumes(Dataset):
    """The in-memory volumes as samples ``{"image": int16 (1, S, S, S), "label": uint8 (1, S, S, S)}``."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": torch.from_numpy(self.images[i]), "label": torch.from_numpy(self.labels[i])}


#: The HU window every side applies: MONAI's recipe caches it, the int16 store applies it per batch.
WINDOW = A.ScaleIntensityRange(a_min=HU_MIN, a_max=HU_MAX, b_min=0.0, b_max=1.0, clip=True)


class BenchVolumes(OptimizedDataModule):
    """The same volumes as an OptimizedDataModule: the arrays are the samples (int16 images in the
    store), or, with ``window``, the static transform windows the images once (float32 in the store,
    as MONAI's cache holds them)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, window: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._images, self._labels, self._window = images, labels, window

    def source(self, split: str) -> Dataset | None:
        return ArrayVolumes(self._images, self._labels) if split == "train" else None

    def static_transform(self, sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self._window:
            return sample
        return {"image": WINDOW(sample["image"][None])[0], "label": sample["label"]}


def fastdata_augment(crop: int, window: bool = True) -> A.BatchTransform:
    """The device strategy's equivalent of the MONAI random transforms (crop first: int16 is cheaper);
    without ``window`` for a store that holds windowed images already."""
    return A.Compose([
        A.RandomCropByLabel((crop,) * 3, pos=1, neg=1, label="label"),
        A.RandomFlip(dims=(-3, -2, -1), p=0.5),
        *([WINDOW] if window else []),
        A.RandomScaleIntensity(SCALE, p=1.0),
    ])


def fastdata_side(images: np.ndarray, labels: np.ndarray, work: Path, args: argparse.Namespace,
                  device: torch.device, cached_window: bool = False) -> Side:
    """lightning_fastdata's device strategy: the training loader with its batched augmentation; the
    window applied per batch to the int16 store, or, with ``cached_window``, cached as MONAI caches it."""
    dm = BenchVolumes(images, labels, window=cached_window, batch_size=args.batch_size, strategy="device",
                      device=str(device), keep_freed_memory=not args.default_malloc,
                      cache_dir=str(work / ("fastdata-window" if cached_window else "fastdata")),
                      field_kinds={"image": "image", "label": "mask"},
                      train_augment=fastdata_augment(args.crop, window=not cached_window), drop_last=True,
                      progress=False)
    quiet = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # the plan's log would bury the table
    try:
        t0 = time.perf_counter()
        dm.prepare_data()
        dm.setup("fit")
        cache_s = time.perf_counter() - t0
    finally:
        quiet.setLevel(level)

    def finish(batch: Any) -> dict[str, Any]:
        # Batches come augmented from the loader's background thread (augment_ahead, on CUDA);
        # otherwise the datamodule's hook does it, as in training.
        batch = batch.to(device, non_blocking=True)
        return batch.structure() if batch.prepared else dm.augment_batch(batch)

    loader = dm.train_dataloader()

    def close() -> None:
        shut = getattr(loader, "close", None)
        if shut is not None:
            shut()
        dm.teardown("fit")

    name, store = ((FASTDATA_CACHED, f"float32 store on {device.type} (window cached)") if cached_window
                   else (FASTDATA, f"int16 store on {device.type}"))
    return Side(name, f"{store}, batched augmentation", 0, lambda: _endless(loader), finish, cache_s,
                sum(st.nbytes for st in dm.stores.values()), close)


# --------------------------------------------------------------------------- report


def machine(device: torch.device) -> dict[str, Any]:
    """What the figures were measured on."""
    import psutil

    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpu": platform.processor() or platform.machine(), "logical_cores": psutil.cpu_count(),
            "affinity": cpu_count(), "torch_threads": torch.get_num_threads(),
            "ram_gb": round(psutil.virtual_memory().total / 1e9, 1), "device": str(device)}
    try:
        import monai

        info["monai"] = monai.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def best_of(rows: list[dict], loader: str) -> dict | None:
    """The fastest row of one loader."""
    measured = [r for r in rows if r["loader"] == loader and r.get("samples_per_s")]
    return max(measured, key=lambda r: r["samples_per_s"]) if measured else None


def table(rows: list[dict], baseline: float) -> str:
    """Markdown table of ``rows`` with their ratio to ``baseline`` samples/s."""
    lines = ["| loader | settings | samples/s | vs MONAI's best |", "|---|---|---:|---:|"]
    for r in rows:
        rate = r["samples_per_s"]
        lines.append(f"| {r['loader']} | {r['settings']} | {rate:,.1f} | {rate / baseline:.2f}x |")
    return "\n".join(lines)


def _worker_candidates(cores: int) -> list[int]:
    out, k = {0, cores}, 1
    while k < cores:
        out.add(k)
        k *= 2
    return sorted(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--volumes", type=int, default=16, help="volumes held in memory")
    p.add_argument("--side", type=int, default=128, help="volume side S (1 x S^3 int16)")
    p.add_argument("--crop", type=int, default=96, help="crop side C")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--batches", type=int, default=40, help="timed batches per segment")
    p.add_argument("--warmup", type=int, default=3, help="untimed batches before each segment")
    p.add_argument("--repeats", type=int, default=5,
                   help="rounds of timed segments, one per side in turn; each side's median is reported")
    p.add_argument("--workers", type=int, nargs="+", default=None,
                   help="num_workers tried for MONAI's DataLoader (default 0, 1, 2, 4, ... up to the cores)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="4 volumes of 64^3, 48^3 crops, few batches: a smoke test")
    p.add_argument("--default-malloc", action="store_true",
                   help="leave glibc's malloc at its defaults on every side (by default every side runs with "
                        "freed memory kept, as OptimizedDataModule sets it on a CPU run: host_memory.py)")
    p.add_argument("--out", default=None, help="write the results here (default "
                   "benchmarks/results/volumes.json; "
                   "with --quick nowhere unless given, so a smoke test leaves the committed results alone)")
    args = p.parse_args(argv)
    if args.out is None and not args.quick:
        args.out = str(RESULTS)
    if args.quick:
        args.volumes, args.side, args.crop = 4, 64, 48
        args.batch_size, args.batches, args.warmup, args.repeats = 2, 3, 1, 1
        args.workers = args.workers or [0, 1]
    args.workers = args.workers or _worker_candidates(cpu_count())
    if min(args.volumes, args.side, args.crop, args.batch_size, args.batches, args.repeats) <= 0 or args.warmup < 0:
        p.error("--volumes, --side, --crop, --batch-size, --batches and --repeats must be > 0, --warmup >= 0")
    if args.crop > args.side:
        p.error(f"--crop {args.crop} is larger than --side {args.side}")
    try:
        from monai.data import set_track_meta
    except ImportError:
        p.error("MONAI is not installed: pip install 'lightning-fastdata[bench]' (or pip install monai)")
    set_track_meta(False)
    device = torch.device(args.device)
    # Process-wide, so set before any side runs: MONAI's recipes get the same malloc as ours.
    kept = False if args.default_malloc else keep_freed_memory()
    torch.manual_seed(0)
    images, labels = make_volumes(args.volumes, args.side)
    print(f"volumes: {args.volumes} x 1x{args.side}^3 int16 + uint8 masks, {args.crop}^3 crops, batch "
          f"{args.batch_size}, on {device}", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="lfd-volumes-"))
    sides: list[Side] = []
    try:
        sides += monai_dataloader_sides(images, labels, args, device)
        sides.append(monai_thread_side(images, labels, args, device))
        sides.append(fastdata_side(images, labels, work, args, device))
        sides.append(fastdata_side(images, labels, work, args, device, cached_window=True))
        rows = run_sides(sides, args, device)
    finally:
        for side in sides:
            side.close()
        shutil.rmtree(work, ignore_errors=True)
    summary = [r for r in (best_of(rows, n) for n in ("monai DataLoader", "monai ThreadDataLoader", FASTDATA,
                                                       FASTDATA_CACHED)) if r is not None]
    monai_best = max((r for r in summary if r["loader"].startswith("monai")), key=lambda r: r["samples_per_s"])
    ours, cached = best_of(rows, FASTDATA), best_of(rows, FASTDATA_CACHED)
    outputs = {r["loader"]: r["output"] for r in summary}
    shapes = {json.dumps({k: v[0] for k, v in o.items()}, sort_keys=True) for o in outputs.values()}
    dtypes = {json.dumps({k: v[1] for k, v in o.items()}, sort_keys=True) for o in outputs.values()}
    report = {
        "command": "python benchmarks/volumes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "quick": args.quick, "machine": machine(device), "volumes": args.volumes, "side": args.side,
        "crop": args.crop, "batch_size": args.batch_size, "batches": args.batches, "warmup": args.warmup,
        "repeats": args.repeats, "interleaved": True,
        "host_memory": host_memory_state() + (" on every side" if kept else ""),
        "work": (f"RandCropByPosNegLabeld-equivalent {args.crop}^3 crops (pos=1, neg=1), a flip per spatial axis "
                 f"(p=0.5 each), HU [{HU_MIN}, {HU_MAX}] -> [0, 1] clipped, intensity x U(1 - {SCALE}, 1 + {SCALE})"),
        "outputs": outputs, "same_output_shapes": len(shapes) == 1, "same_output_dtypes": len(dtypes) == 1,
        "baseline": f"{monai_best['loader']} ({monai_best['settings']})",
        "summary": [{"loader": r["loader"], "settings": r["settings"], "samples_per_s": r["samples_per_s"],
                     "cache_mb": r["cache_mb"], "vs_monai_best": r["samples_per_s"] / monai_best["samples_per_s"]}
                    for r in summary],
        "device_vs_monai_best": ours["samples_per_s"] / monai_best["samples_per_s"] if ours else None,
        "window_cached_vs_monai_best": cached["samples_per_s"] / monai_best["samples_per_s"] if cached else None,
        "results": rows,
    }
    if args.out is not None:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(report, indent=2) + "\n")
    print("\nbest of each:\n")
    print(table(summary, monai_best["samples_per_s"]))
    print("\nevery setting:\n")
    print(table(rows, monai_best["samples_per_s"]))
    print(f"\noutputs (shape, dtype, device): {json.dumps(outputs)}\nsame shapes: {report['same_output_shapes']}, "
          f"same dtypes: {report['same_output_dtypes']}\nmachine: {report['machine']}\n"
          + (f"wrote {args.out}" if args.out is not None else "no JSON written (--quick; --out PATH writes one)"))
    return report


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
    main()
