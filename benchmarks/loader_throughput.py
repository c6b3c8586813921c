"""Loader-only throughput: plain DataLoader vs the ``workers`` and ``device`` strategies.

On synthetic CIFAR-sized (50,000 x 3x32x32 uint8, batch 256) and ImageNet-sized
(2,000 x 3x224x224 uint8, batch 64) stores, this measures samples/s delivered with
random flip + crop(padding 4):

- ``plain``: a per-sample ``Dataset`` applying torchvision v2 ``RandomHorizontalFlip`` +
  ``RandomCrop`` to each sample, in a ``DataLoader`` (one ``__getitem__`` per sample, then
  the default collate), as most training scripts do;
- ``plain_batched``: what a competent user writes without this package: the same
  arrays and the same per-sample transforms, but a ``Dataset.__getitems__`` that takes
  the batch's rows with one indexing call, transforms each sample in the worker and
  stacks them (no per-sample ``__getitem__`` and collate);
- ``workers``: :class:`~lightning_fastdata.loaders.WorkerLoader` reading whole batches
  from the store, then the batched augmentation;
- ``device``: :class:`~lightning_fastdata.loaders.IndexLoader` gathering batches from
  the placed store, then ``Compose([RandomCrop, RandomHorizontalFlip])`` with per-sample
  keys (``SampleKeys``) as ``OptimizedDataModule`` draws them;
- ``raw gather``: the index loader alone, in GB/s and as a fraction of the machine's
  memcpy bandwidth (a torch copy into a preallocated buffer), measured two ways:
  store-sized (DRAM to DRAM, the usual "memcpy bandwidth") and batch-sized (contiguous
  batch-sized slices of the store into one reused batch buffer: the same bytes as a
  gather, read in order).

``plain``, ``plain_batched`` and ``workers`` are measured at every ``--workers`` value
(default 0, 1, 2, 4, ... up to the CPU count, and the CPU count) and reported at their
best. Each figure is the median of ``--repeats`` timed segments after a warm-up, for
every ``--threads`` setting (``torch.set_num_threads``). Results go to JSON and a markdown
table. On a shared machine, expect noise: compare figures from one run only.

Usage::

    python benchmarks/loader_throughput.py                  # full run on the CPU
    python benchmarks/loader_throughput.py --device cuda    # the same on a GPU
    python benchmarks/loader_throughput.py --quick          # seconds-long smoke test; no JSON unless --out
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from lightning_fastdata import augment as A
from lightning_fastdata._util import atomic_write_text, cpu_count
from lightning_fastdata.demo import worker_candidates
from lightning_fastdata.keys import SampleKeys
from lightning_fastdata.loaders import FastBatch, IndexLoader, ShardedOrder, WorkerLoader
from lightning_fastdata.placement import DeviceSource, HostSource, place_fields
from lightning_fastdata.store import Store

HERE = Path(__file__).resolve().parent
SEED = 0

#: name -> (samples, image side, batch size); ``--quick`` shrinks samples only.
SHAPES = {
    "cifar": (50_000, 32, 256),
    "imagenet": (2_000, 224, 64),
}
QUICK_SAMPLES = {"cifar": 1_024, "imagenet": 128}


# --------------------------------------------------------------------------- data


def synthetic(n: int, side: int, classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Random uint8 images (n, 3, side, side) and int64 labels, deterministic."""
    rng = np.random.default_rng(SEED)
    images = rng.integers(0, 256, size=(n, 3, side, side), dtype=np.uint8)
    labels = rng.integers(0, classes, size=n, dtype=np.int64)
    return images, labels


class PlainDataset(Dataset):
    """What a typical script does: one sample at a time, torchvision v2 transforms per sample."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, side: int) -> None:
        self.images, self.labels = images, labels
        self.transform = v2.Compose([v2.RandomHorizontalFlip(), v2.RandomCrop(side, padding=4)])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.transform(torch.from_numpy(self.images[i])), int(self.labels[i])


class BatchedPlainDataset(PlainDataset):
    """What a competent user writes without this package: one ``__getitems__`` call per batch.

    The batch's rows come from the array in one indexing call; each sample still gets
    its own draw of the same torchvision v2 transforms (a v2 transform called on a whole
    batch would draw one crop and one flip for all of it), and the results are stacked
    in the worker. The ``DataLoader`` passes the batch through :func:`as_is`, not the
    default per-sample collate.
    """

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.asarray(indices)
        images = torch.from_numpy(self.images[rows])
        return torch.stack([self.transform(img) for img in images]), torch.from_numpy(self.labels[rows])


def as_is(batch: Any) -> Any:
    """The ``collate_fn`` of a dataset whose ``__getitems__`` returns the finished batch."""
    return batch


def train_augment(side: int) -> A.Compose:
    """The batched augmentation under test (crop first, so Compose fuses it with the flip)."""
    return A.Compose([A.RandomCrop(side, padding=4), A.RandomHorizontalFlip()])


def augment_batch(batch: FastBatch, augment: A.BatchTransform) -> Any:
    """As ``OptimizedDataModule`` augments: keys of (seed, epoch, the samples' global indices)."""
    x, y = batch
    return augment(x, SampleKeys(SEED, batch.epoch, batch.indices)), y


# --------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_stream(stream: Iterator[Any], batches: int, warmup: int, repeats: int,
                samples_of: Callable[[Any], int], device: torch.device) -> list[float]:
    """Samples/s of ``repeats`` consecutive segments of ``batches`` batches, after ``warmup``."""
    for _ in range(warmup):
        next(stream)
    _sync(device)
    rates = []
    for _ in range(repeats):
        seen = 0
        t0 = time.perf_counter()
        for _ in range(batches):
            seen += samples_of(next(stream))
        _sync(device)
        rates.append(seen / (time.perf_counter() - t0))
    return rates


def epochs(make_iter: Callable[[int], Iterator[Any]]) -> Iterator[Any]:
    """Batches of epoch 0, 1, 2, ... back to back (what a training loop sees)."""
    for epoch in itertools.count():
        yield from make_iter(epoch)


def _n(batch: Any) -> int:
    return int(batch[0].shape[0])


def summary(rates: list[float]) -> dict[str, Any]:
    return {"samples_per_s": statistics.median(rates), "repeats": rates}


# --------------------------------------------------------------------------- measurements


def memcpy_gbps(nbytes: int, repeats: int, device: torch.device) -> float:
    """The machine's copy bandwidth: ``nbytes`` (well beyond the caches) into a preallocated buffer."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the destination in
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def batch_copy_gbps(data: torch.Tensor, batch: int, repeats: int, device: torch.device) -> float:
    """Contiguous batch-sized slices of the store into one reused batch buffer: a gather in order."""
    flat = data.reshape(data.shape[0], -1)
    out = torch.empty((batch, flat.shape[1]), dtype=flat.dtype, device=flat.device)
    nb = flat.shape[0] // batch
    rates = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for b in range(nb):
            out.copy_(flat[b * batch:(b + 1) * batch])
        _sync(device)
        rates.append(nb * out.numel() * out.element_size() / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def measure_plain(images: np.ndarray, labels: np.ndarray, side: int, bs: int, workers: list[int],
                  seg: int, repeats: int, device: torch.device, batched: bool = False) -> dict[str, Any]:
    """The plain ``DataLoader`` at each worker count, per sample or (``batched``) per batch."""
    ds = (BatchedPlainDataset if batched else PlainDataset)(images, labels, side)
    collate = {"collate_fn": as_is} if batched else {}
    by_workers = {}
    for w in workers:
        loader = DataLoader(ds, batch_size=bs, shuffle=True, drop_last=True, num_workers=w,
                            persistent_workers=w > 0, pin_memory=device.type == "cuda",
                            generator=torch.Generator().manual_seed(SEED), **collate)

        def stream(loader=loader) -> Iterator[Any]:
            for x, y in epochs(lambda _: iter(loader)):
                yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

        it = stream()
        by_workers[w] = summary(time_stream(it, seg, max(2, 2 * w), repeats, _n, device))
        it.close()
        _shutdown(loader)
    return _best(by_workers)


def _shutdown(loader: DataLoader) -> None:
    """Stop persistent workers now: a live iterator would be inherited by the next loader's forks."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    loader._iterator = None


def measure_workers(store: Store, side: int, bs: int, workers: list[int], seg: int, repeats: int,
                    device: torch.device) -> dict[str, Any]:
    aug = train_augment(side)
    by_workers = {}
    for w in workers:
        loader = WorkerLoader(ShardedOrder(len(store), bs, shuffle=True, drop_last=True, seed=SEED),
                              source=HostSource(list(store.fields)), spec=store.spec,
                              names=[i.name for i in store.infos], num_workers=w, persistent_workers=w > 0,
                              pin_memory=device.type == "cuda")

        def stream(loader=loader) -> Iterator[Any]:
            def one(epoch: int) -> Iterator[Any]:
                loader.set_epoch(epoch)
                for batch in loader:
                    yield augment_batch(batch.to(device, non_blocking=True), aug)
            return epochs(one)

        it = stream()
        by_workers[w] = summary(time_stream(it, seg, max(2, 2 * w), repeats, _n, device))
        it.close()
        _shutdown(loader.dataloader)
    return _best(by_workers)


def measure_device(fields: list[torch.Tensor], spec: dict, side: int, bs: int, seg: int, repeats: int,
                   device: torch.device, augment: bool) -> dict[str, Any]:
    order = ShardedOrder(fields[0].shape[0], bs, shuffle=True, drop_last=True, seed=SEED)
    loader = IndexLoader(DeviceSource(fields), order, spec, [str(k) for k in range(len(fields))])
    aug = train_augment(side)

    def one(epoch: int) -> Iterator[Any]:
        loader.set_epoch(epoch)
        for batch in loader:
            yield augment_batch(batch, aug) if augment else batch

    return summary(time_stream(epochs(one), seg, 3, repeats, _n, device))


def augment_us_per_sample(fields: list[torch.Tensor], side: int, bs: int, repeats: int,
                          device: torch.device) -> float:
    """The batched crop + flip alone, on one resident batch: microseconds per sample."""
    x = fields[0][:bs].clone()
    aug = train_augment(side)
    times = []
    for r in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        for step in range(20):
            rows = torch.arange(step * bs, (step + 1) * bs, device=device)
            augment_batch(FastBatch.of((x, rows), rows, epoch=r, index=step), aug)
        _sync(device)
        times.append((time.perf_counter() - t0) / (20 * bs) * 1e6)
    return statistics.median(times[1:])


def _best(by_workers: dict[int, dict[str, Any]]) -> dict[str, Any]:
    w = max(by_workers, key=lambda k: by_workers[k]["samples_per_s"])
    return {"samples_per_s": by_workers[w]["samples_per_s"], "repeats": by_workers[w]["repeats"],
            "best_num_workers": w,
            "by_num_workers": {str(k): v for k, v in by_workers.items()}}


def run_shape(name: str, args: argparse.Namespace, device: torch.device, threads: list[int]) -> dict[str, Any]:
    n, side, bs = SHAPES[name]
    if args.quick:
        n = QUICK_SAMPLES[name]
    images, labels = synthetic(n, side)
    store = Store.from_arrays((images, labels), fingerprint=f"synthetic-{name}")
    fields = place_fields(list(store.fields), device)
    sample_bytes = sum(int(f[0].numel()) * f.element_size() for f in fields)
    nb = n // bs
    # Segment length: about a quarter epoch (CIFAR) or one epoch (ImageNet) per timing.
    seg = max(2, min(nb, 48 if not args.quick else 4))
    plain_seg = max(2, min(nb, 16 if not args.quick else 2))
    print(f"[{name}] {n} x 3x{side}x{side} uint8, batch {bs}, {nb} batches/epoch", file=sys.stderr)
    memcpy = {"store_gbps": args.memcpy_gbps,
              "batch_gbps": batch_copy_gbps(fields[0], bs, args.repeats, device)}
    out: dict[str, Any] = {"samples": n, "side": side, "batch_size": bs, "sample_bytes": sample_bytes,
                           "memcpy": memcpy, "by_threads": {}}
    for t in threads:
        torch.set_num_threads(t)
        print(f"[{name}] torch threads {t}", file=sys.stderr)
        t0 = time.perf_counter()
        raw = measure_device(fields, store.spec, side, bs, seg, args.repeats, device, augment=False)
        gbps = raw["samples_per_s"] * sample_bytes / 1e9
        raw.update(gbps=gbps, fraction_of_memcpy_store=gbps / memcpy["store_gbps"],
                   fraction_of_memcpy_batch=gbps / memcpy["batch_gbps"])
        dev = measure_device(fields, store.spec, side, bs, seg, args.repeats, device, augment=True)
        aug_us = augment_us_per_sample(fields, side, bs, args.repeats, device)
        workers = measure_workers(store, side, bs, args.workers, plain_seg, args.repeats, device)
        t1 = time.perf_counter()
        plain = measure_plain(images, labels, side, bs, args.workers, plain_seg, args.repeats, device)
        batched = measure_plain(images, labels, side, bs, args.workers, plain_seg, args.repeats, device,
                                batched=True)
        print(f"[{name}] threads {t}: device {t1 - t0:.1f}s, plain {time.perf_counter() - t1:.1f}s",
              file=sys.stderr)
        out["by_threads"][str(t)] = {
            "plain": plain,
            "plain_batched": batched,
            "workers": workers,
            "device": dev,
            "raw_gather": raw,
            "augment_us_per_sample": aug_us,
            "speedup_device_vs_plain": dev["samples_per_s"] / plain["samples_per_s"],
            "speedup_workers_vs_plain": workers["samples_per_s"] / plain["samples_per_s"],
            "speedup_device_vs_plain_batched": dev["samples_per_s"] / batched["samples_per_s"],
            "speedup_workers_vs_plain_batched": workers["samples_per_s"] / batched["samples_per_s"],
        }
    return out


# --------------------------------------------------------------------------- report


def table(results: dict[str, Any]) -> str:
    rows = ["| data | threads | plain (best w) | plain batched (best w) | workers (best w) | device | "
            "device/plain | device/batched | crop+flip us/sample | raw gather GB/s | of memcpy store / batch |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["shapes"].items():
        for t, x in r["by_threads"].items():
            rows.append(
                f"| {name} | {t} | {x['plain']['samples_per_s']:,.0f} ({x['plain']['best_num_workers']}) "
                f"| {x['plain_batched']['samples_per_s']:,.0f} ({x['plain_batched']['best_num_workers']}) "
                f"| {x['workers']['samples_per_s']:,.0f} ({x['workers']['best_num_workers']}) "
                f"| {x['device']['samples_per_s']:,.0f} | {x['speedup_device_vs_plain']:.1f}x "
                f"| {x['speedup_device_vs_plain_batched']:.1f}x "
                f"| {x['augment_us_per_sample']:.2f} | {x['raw_gather']['gbps']:.1f} "
                f"| {x['raw_gather']['fraction_of_memcpy_store']:.0%} / "
                f"{x['raw_gather']['fraction_of_memcpy_batch']:.0%} |")
    lines = [f"Loader-only samples/s (median of repeats). memcpy {results['memcpy_gbps']:.1f} GB/s "
             "(store-sized); batch-sized copies: "
             + ", ".join(f"{k} {v['memcpy']['batch_gbps']:.1f} GB/s" for k, v in results["shapes"].items()),
             f"load average before/after: {results['meta']['loadavg_before']} / {results['meta']['loadavg_after']}",
             "", *rows]
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--quick", action="store_true", help="tiny stores and few repeats: a smoke test")
    p.add_argument("--shapes", default="cifar,imagenet", help="comma list of: " + ", ".join(SHAPES))
    p.add_argument("--threads", default="1,2", help="torch.set_num_threads values to measure")
    p.add_argument("--workers", default=None,
                   help="num_workers values for plain, plain_batched and workers "
                        "(default 0,1,2,4,... up to the CPU count, and the CPU count)")
    p.add_argument("--repeats", type=int, default=None, help="timed segments per figure (median)")
    p.add_argument("--out", type=Path, default=None,
                   help="write the results here (default benchmarks/results/loader_throughput.json; "
                        "with --quick nowhere unless given, so a smoke test leaves the committed results alone)")
    args = p.parse_args(argv)
    if args.out is None and not args.quick:
        args.out = HERE / "results" / "loader_throughput.json"
    args.threads = [int(t) for t in args.threads.split(",") if t]
    args.workers = (worker_candidates(cpu_count()) if args.workers is None
                    else [int(w) for w in args.workers.split(",") if w])
    args.shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in args.shapes if s not in SHAPES]
    if bad:
        p.error(f"unknown shape(s) {bad}; choose from {sorted(SHAPES)}")
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.repeats < 1 or not args.threads or min(args.threads) < 1 or not args.workers:
        p.error("need --repeats >= 1, --threads >= 1 and at least one --workers value")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch.cuda.is_available() is False")
    started = time.time()
    results: dict[str, Any] = {
        "meta": {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
            or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "quick": args.quick,
            "repeats": args.repeats,
            "threads": args.threads,
            "workers": args.workers,
            "loadavg_before": [round(v, 2) for v in os.getloadavg()],
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        },
        "shapes": {},
    }
    torch.set_num_threads(args.threads[0])
    args.memcpy_gbps = memcpy_gbps((32 if args.quick else 512) << 20, max(3, args.repeats), device)
    results["memcpy_gbps"] = args.memcpy_gbps
    for name in args.shapes:
        results["shapes"][name] = run_shape(name, args, device, args.threads)
    results["meta"]["loadavg_after"] = [round(v, 2) for v in os.getloadavg()]
    results["meta"]["seconds"] = round(time.time() - started, 1)
    if args.out is not None:
        atomic_write_text(args.out, json.dumps(results, indent=2))
    print(table(results))
    print(f"\nJSON: {args.out}" if args.out is not None else "\nno JSON written (--quick; --out PATH writes one)")
    return results


if __name__ == "__main__":
    main()
