"""Full training augmentation: batched on the device vs per-sample torchvision v2 in a DataLoader.

The pipeline is random-resized-crop + horizontal flip + color jitter (brightness, contrast,
saturation 0.4) + normalize, on uint8 images of CIFAR size (3x32x32) and ImageNet size
(3x224x224), output the input's size. The batched side is ``lightning_fastdata.augment``
on ``--device`` (default: CUDA if present, else the CPU); the baseline is the same
``torchvision.transforms.v2`` pipeline per sample in a DataLoader, at its best
``num_workers`` in {0, 1, 2}. Each figure is the median of ``--repeats`` timed passes
after a warm-up pass.

    python benchmarks/augment_throughput.py [--device cpu] [--repeats 5] [--threads N] [--quick]

Writes ``benchmarks/results/augment_throughput.json`` (``--out``; a ``--quick`` run only
when ``--out`` is given) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torchvision.transforms.v2 as T
from torch.utils.data import DataLoader, Dataset

from lightning_fastdata import augment as A
from lightning_fastdata.keys import SampleKeys

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def device_pipeline(size: int) -> A.Compose:
    """The batched pipeline."""
    return A.Compose(
        [
            A.RandomResizedCrop(size),
            A.RandomHorizontalFlip(),
            A.ColorJitter(0.4, 0.4, 0.4),
            A.Normalize(MEAN, STD),
        ]
    )


def torchvision_pipeline(size: int) -> T.Compose:
    """The same pipeline, per sample, as users write it with torchvision v2."""
    return T.Compose(
        [
            T.RandomResizedCrop(size, antialias=True),
            T.RandomHorizontalFlip(),
            T.ColorJitter(0.4, 0.4, 0.4),
            T.ToDtype(torch.float32, scale=True),
            T.Normalize(MEAN, STD),
        ]
    )


class Augmented(Dataset):
    """In-memory uint8 images, augmented per sample in ``__getitem__``."""

    def __init__(self, images: torch.Tensor, transform: T.Compose) -> None:
        self.images, self.transform = images, transform

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.transform(self.images[i])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_device(
    images: torch.Tensor, batch: int, repeats: int, device: torch.device
) -> list[float]:
    """Samples/s of one pass over ``images`` in batches, per repeat (after one warm-up pass)."""
    data = images.to(device)
    aug = device_pipeline(images.shape[-1])
    rates = []
    for r in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        for a in range(0, data.shape[0], batch):
            x = data[a : a + batch]
            out = aug(x, SampleKeys(0, r, torch.arange(a, a + x.shape[0], device=device)))
        _sync(device)
        if r:
            rates.append(data.shape[0] / (time.perf_counter() - t0))
    del out
    return rates


def time_loader(images: torch.Tensor, batch: int, repeats: int, workers: int) -> list[float]:
    """Samples/s of one pass of a DataLoader running the torchvision pipeline, per repeat."""
    ds = Augmented(images, torchvision_pipeline(images.shape[-1]))
    dl = DataLoader(
        ds,
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers else None,
    )
    rates = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        n = sum(b.shape[0] for b in dl)
        if r:
            rates.append(n / (time.perf_counter() - t0))
    del dl
    return rates


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark with ``argv`` (default ``sys.argv[1:]``); return the report written."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads in the main process (0: torch's default)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer samples, 2 repeats: checks the script runs"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="write the results here (default benchmarks/results/augment_throughput.json; "
        "with --quick nowhere unless given, so a smoke test leaves the committed results alone)",
    )
    args = parser.parse_args(argv)
    if args.out is None and not args.quick:
        args.out = str(Path(__file__).parent / "results" / "augment_throughput.json")
    device = torch.device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    repeats = 2 if args.quick else args.repeats
    configs = [
        ("cifar", 32, 4096 if not args.quick else 1024, 256),
        ("imagenet", 224, 512 if not args.quick else 128, 64),
    ]
    results = []
    for name, size, n, batch in configs:
        images = torch.randint(
            0,
            256,
            (n, 3, size, size),
            dtype=torch.uint8,
            generator=torch.Generator().manual_seed(0),
        )
        dev = statistics.median(time_device(images, batch, repeats, device))
        loaders = {w: statistics.median(time_loader(images, batch, repeats, w)) for w in (0, 1, 2)}
        best = max(loaders, key=loaders.get)
        results.append(
            {
                "data": name,
                "shape": [3, size, size],
                "samples": n,
                "batch_size": batch,
                "device_samples_per_s": dev,
                "torchvision_samples_per_s": loaders,
                "torchvision_best_num_workers": best,
                "speedup_vs_best": dev / loaders[best],
            }
        )
    report = {
        "benchmark": "augment_throughput",
        "pipeline": "RandomResizedCrop(size) + RandomHorizontalFlip + ColorJitter(0.4, 0.4, 0.4) "
        "+ Normalize",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor(),
        "cpu_count": os.cpu_count(),
        # The conditions of the comparison: the batched side runs in this process on
        # torch_threads threads; each torchvision DataLoader worker runs on one (PyTorch's default).
        "torch_threads": torch.get_num_threads(),
        "threads_arg": args.threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "command": " ".join([Path(sys.argv[0]).name if argv is None else "augment_throughput.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "quick": bool(args.quick),
        "torch": torch.__version__,
        "repeats": repeats,
        "statistic": "median samples/s over repeats, after one warm-up pass",
        "results": results,
    }
    if args.out is not None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    else:
        print("no JSON written (--quick; --out PATH writes one)")
    print(
        f"{'data':<9} {'batched on ' + str(device):>18} "
        f"{'tv w=0':>10} {'tv w=1':>10} {'tv w=2':>10} "
        f"{'best w':>7} {'speedup':>8}"
    )
    for r in results:
        tv = r["torchvision_samples_per_s"]
        print(
            f"{r['data']:<9} {r['device_samples_per_s']:>18,.0f} "
            f"{tv[0]:>10,.0f} {tv[1]:>10,.0f} {tv[2]:>10,.0f} "
            f"{r['torchvision_best_num_workers']:>7} {r['speedup_vs_best']:>7.1f}x"
        )
    print(f"(samples/s, median of {repeats}; batched side on {report['torch_threads']} torch thread(s); "
          f"written to {args.out})")
    return report


if __name__ == "__main__":
    main()
