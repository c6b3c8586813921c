"""lightning_fastdata against what users run today, on the same data, side by side in one run.

Contenders, all loader-only (fetch, move to the training device, random crop + flip;
no model), median samples/s over ``--repeats``:

- ``DataLoader``: the plain PyTorch way. A map-style dataset over the uint8 arrays,
  torchvision's ``RandomCrop(32, padding=4)`` and ``RandomHorizontalFlip`` per sample in
  ``__getitem__``, ``default_collate``, shuffled; at each ``num_workers`` in
  ``--workers`` (default 0, 1, 2), the best reported as the baseline.
- ``litdata``: ``litdata.optimize()`` writes the same samples into its chunk format
  once; ``StreamingDataset`` (shuffled, the same per-sample augmentation) and
  ``StreamingDataLoader`` at each ``num_workers``, the best reported.
- ``lightning_fastdata device`` and ``workers``: an ``OptimizedDataModule`` over the same
  samples (cached once into its store), batches from the ``device`` strategy (the store
  on the training device, gathered by index) and the ``workers`` strategy (auto-tuned
  DataLoader workers over the memory-mapped store), augmented batched on the device
  with ``augment.RandomCrop(32, padding=4)`` + ``RandomHorizontalFlip``.

Data: CIFAR-sized synthetic uint8 images (3x32x32) with int labels, written once.
Install the peers with ``pip install lightning-fastdata[bench]``. Run::

    python benchmarks/peers.py                      # ~2-4 minutes on 2 CPU cores
    python benchmarks/peers.py --n 50000 --batches 100

Writes ``benchmarks/results/peers.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_fastdata import OptimizedDataModule
from lightning_fastdata import augment as A
from lightning_fastdata.autotune import shutdown_workers, time_loader
from lightning_fastdata.cli import bench_strategy

RESULTS = Path(__file__).parent / "results" / "peers.json"


def make_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """CIFAR-sized uint8 images (n, 3, 32, 32) and int64 labels in [0, 10)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8), rng.integers(0, 10, n, dtype=np.int64)


def _per_sample_augment() -> Any:
    from torchvision.transforms import v2 as T

    return T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()])


class ArrayImages(Dataset):
    """Per-sample reads from memory-mapped .npy files, optionally augmented per sample (torchvision)."""

    def __init__(self, images: str, labels: str, augment: bool = False) -> None:
        self.images_path, self.labels_path, self.augment = images, labels, augment
        self.images = np.load(images, mmap_mode="r")
        self.labels = np.load(labels, mmap_mode="r")
        self.transform = _per_sample_augment() if augment else None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = torch.from_numpy(np.array(self.images[i]))
        if self.transform is not None:
            x = self.transform(x)
        return x, int(self.labels[i])


class PeerImages(OptimizedDataModule):
    """The same samples as an OptimizedDataModule (static transform: none; augmentation on the device).

    Args:
        images, labels: The .npy files.
    """

    def __init__(self, images: str, labels: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.images, self.labels = images, labels

    def source(self, split: str) -> Dataset | None:
        return ArrayImages(self.images, self.labels) if split == "train" else None


def _median(rates: list[float]) -> float:
    return statistics.median(rates)


def _timed(make_loader: Any, device: torch.device, batches: int, warmup: int, repeats: int) -> list[float]:
    loader = make_loader()
    try:
        return [time_loader(loader, device, batches=batches, warmup=warmup)[0] for _ in range(repeats)]
    finally:
        shutdown_workers(loader)


def bench_dataloader(images: str, labels: str, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Plain DataLoader with per-sample torchvision augmentation, at each worker count."""
    rows = []
    ds = ArrayImages(images, labels, augment=True)
    for nw in args.workers:
        def make(nw: int = nw) -> DataLoader:
            return DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=nw,
                              pin_memory=device.type == "cuda", persistent_workers=nw > 0,
                              prefetch_factor=2 if nw else None)
        rates = _timed(make, device, args.batches, args.warmup, args.repeats)
        rows.append({"loader": "DataLoader", "settings": f"num_workers={nw}", "num_workers": nw,
                     "samples_per_s": _median(rates), "rates": rates})
        print(f"  DataLoader num_workers={nw}: {_median(rates):,.0f} samples/s", file=sys.stderr)
    return rows


def bench_litdata(images: str, labels: str, work: Path, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """litdata: optimize() once, then StreamingDataset + StreamingDataLoader at each worker count."""
    try:
        import litdata as ld
    except ImportError:
        return [{"loader": "litdata", "settings": "-", "samples_per_s": None,
                 "reason": "litdata is not installed: pip install 'lightning-fastdata[bench]'"}]

    out = work / "litdata"
    method = multiprocessing.get_start_method()
    t0 = time.perf_counter()
    ld.optimize(fn=_LitSample(images, labels), inputs=list(range(args.n)), output_dir=str(out),
                chunk_bytes="16MB", num_workers=1, mode="overwrite")
    optimize_s = time.perf_counter() - t0
    # optimize() switches the process-wide start method to spawn; every loader here is
    # timed with the same (the platform's default) method.
    multiprocessing.set_start_method(method, force=True)

    rows = []
    for nw in args.workers:
        def make(nw: int = nw) -> Any:
            ds = ld.StreamingDataset(str(out), shuffle=True, seed=0, transform=_LitAugment())
            return ld.StreamingDataLoader(ds, batch_size=args.batch_size, num_workers=nw,
                                          pin_memory=device.type == "cuda", persistent_workers=nw > 0)
        rates = _timed(make, device, args.batches, args.warmup, args.repeats)
        rows.append({"loader": "litdata", "settings": f"StreamingDataLoader num_workers={nw}", "num_workers": nw,
                     "samples_per_s": _median(rates), "rates": rates, "prepare_s": optimize_s,
                     "version": getattr(ld, "__version__", "?")})
        print(f"  litdata num_workers={nw}: {_median(rates):,.0f} samples/s", file=sys.stderr)
    return rows


class _LitAugment:
    """Per-sample torchvision crop + flip for litdata's ``transform=``: dict in, (image, label) out."""

    def __init__(self) -> None:
        self.transform = _per_sample_augment()

    def __call__(self, sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
        return self.transform(torch.from_numpy(np.asarray(sample["image"]))), int(sample["label"])


class _LitSample:
    """Picklable ``fn`` for ``litdata.optimize``: sample i as a dict of numpy image and int label."""

    def __init__(self, images: str, labels: str) -> None:
        self.images, self.labels = images, labels

    def __call__(self, i: int) -> dict[str, Any]:
        images = np.load(self.images, mmap_mode="r")
        labels = np.load(self.labels, mmap_mode="r")
        return {"image": np.array(images[i]), "label": int(labels[i])}


def bench_fastdata(images: str, labels: str, work: Path, args: argparse.Namespace,
                   device: torch.device) -> list[dict]:
    """lightning_fastdata's device and workers strategies, augmentation batched on the device."""
    augment = A.Compose([A.RandomCrop(32, padding=4), A.RandomHorizontalFlip()])
    dm = PeerImages(images, labels, batch_size=args.batch_size, cache_dir=str(work / "fastdata"),
                    train_augment=augment, device=str(device), progress=False)
    t0 = time.perf_counter()
    dm.prepare_data()
    prepare_s = time.perf_counter() - t0
    rows = []
    for strategy in ("device", "workers"):
        r = bench_strategy(dm, strategy, device, 1, args.batches, args.warmup, args.repeats, progress=False)
        if not r.get("samples_per_s"):
            rows.append({"loader": f"lightning_fastdata {strategy}", "settings": "-", "samples_per_s": None,
                         "reason": r.get("reason", "")})
            continue
        rows.append({"loader": f"lightning_fastdata {strategy}",
                     "settings": f"num_workers={r['num_workers']} (auto)" if strategy == "workers" else "store on "
                                 f"{device.type}", "num_workers": r["num_workers"],
                     "samples_per_s": r["samples_per_s"], "rates": r["rates"], "prepare_s": prepare_s})
        print(f"  lightning_fastdata {strategy}: {r['samples_per_s']:,.0f} samples/s", file=sys.stderr)
    return rows


def machine(device: torch.device) -> dict[str, Any]:
    """What the figures were measured on."""
    import psutil

    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpu": platform.processor() or platform.machine(), "physical_cores": psutil.cpu_count(logical=False),
            "logical_cores": psutil.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "ram_gb": round(psutil.virtual_memory().total / 1e9, 1), "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def table(rows: list[dict], baseline: float) -> str:
    """Markdown table: the best row of each loader first, then every setting."""
    lines = ["| loader | settings | samples/s | vs best DataLoader |", "|---|---|---:|---:|"]
    for r in rows:
        rate = r.get("samples_per_s")
        if rate is None:
            lines.append(f"| {r['loader']} | {r['settings']} | - | {r.get('reason', '')} |")
        else:
            lines.append(f"| {r['loader']} | {r['settings']} | {rate:,.0f} | {rate / baseline:.2f}x |")
    return "\n".join(lines)


def best_of(rows: list[dict], loader: str) -> dict | None:
    """The fastest row of one loader."""
    measured = [r for r in rows if r["loader"] == loader and r.get("samples_per_s")]
    return max(measured, key=lambda r: r["samples_per_s"]) if measured else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=20000, help="samples (CIFAR-10 train has 50000)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--batches", type=int, default=30, help="timed batches per repeat")
    p.add_argument("--warmup", type=int, default=3, help="untimed batches per repeat")
    p.add_argument("--repeats", type=int, default=3, help="repeats; the median is reported")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="num_workers tried for the peers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--work-dir", default=None, help="where the data and caches go (default: a temporary dir)")
    args = p.parse_args(argv)
    if min(args.n, args.batch_size, args.batches, args.repeats) <= 0 or args.warmup < 0:
        p.error("--n, --batch-size, --batches and --repeats must be > 0, --warmup >= 0")
    device = torch.device(args.device)
    torch.manual_seed(0)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="lfd-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        x, y = make_data(args.n)
        images, labels = str(work / "images.npy"), str(work / "labels.npy")
        np.save(images, x)
        np.save(labels, y)
        del x, y
        print(f"peers: {args.n} samples 3x32x32 uint8, batch {args.batch_size}, on {device}", file=sys.stderr)
        rows = bench_dataloader(images, labels, args, device)
        rows += bench_litdata(images, labels, work, args, device)
        rows += bench_fastdata(images, labels, work, args, device)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    base = best_of(rows, "DataLoader")
    baseline = base["samples_per_s"]
    summary = [base, best_of(rows, "litdata"), best_of(rows, "lightning_fastdata device"),
               best_of(rows, "lightning_fastdata workers")]
    summary = [r for r in summary if r is not None]
    report = {
        "command": "python benchmarks/peers.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(device), "n": args.n, "batch_size": args.batch_size, "batches": args.batches,
        "warmup": args.warmup, "repeats": args.repeats, "augmentation": "RandomCrop(32, padding=4) + "
        "RandomHorizontalFlip", "baseline": f"DataLoader {base['settings']}",
        "summary": [{"loader": r["loader"], "settings": r["settings"], "samples_per_s": r["samples_per_s"],
                     "vs_dataloader": r["samples_per_s"] / baseline} for r in summary],
        "results": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("\nbest of each:\n")
    print(table(summary, baseline))
    print("\nevery setting:\n")
    print(table(rows, baseline))
    print(f"\nmachine: {report['machine']}\nwrote {out}")
    return report


if __name__ == "__main__":
    main()
