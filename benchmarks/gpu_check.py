"""GPU placement check: full preload vs chunked streaming vs a plain DataLoader, side by side.

Prints, for CIFAR-sized (50000x3x32x32 uint8) and ImageNet-sized (2000x3x224x224 uint8)
data: samples/s of the ``device`` (full preload) and ``chunked`` loaders and their ratio;
the chunked loader's effective host-to-device rate against a plain pinned copy; and the
GPU idle time between the steps of a torchvision ResNet-18 trained from each loader and
from a plain ``DataLoader``. Runs on the CPU too (``--device cpu``: no copies, no events;
the idle time is then the host's wait for the next batch).

    python benchmarks/gpu_check.py                   # cuda when available, else cpu
    python benchmarks/gpu_check.py --device cpu --only throughput --datasets cifar
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch

from lightning_fastdata.loaders import IndexLoader, ShardedOrder
from lightning_fastdata.placement import ChunkBuffers, ChunkedSource, DeviceSource, HostSource, place_fields
from lightning_fastdata.store import Store

DATASETS = {"cifar": (50000, (3, 32, 32), 256), "imagenet": (2000, (3, 224, 224), 64)}


def make_store(n: int, shape: tuple[int, ...], seed: int = 0) -> Store:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    return Store.from_arrays((images, rng.integers(0, 10, n, dtype=np.int64)))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _names(store: Store) -> list[str]:
    return [i.name for i in store.infos]


def device_loader(store: Store, fields: list[torch.Tensor], bs: int) -> IndexLoader:
    return IndexLoader(DeviceSource(fields), ShardedOrder(len(store), bs, seed=0), store.spec, _names(store))


def chunked_loader(store: Store, device: torch.device, bs: int, chunk_mb: float) -> IndexLoader:
    buffers = ChunkBuffers.for_store(store, device, int(chunk_mb * 2**20), bs)
    return IndexLoader(ChunkedSource(HostSource(list(store.fields)), buffers), ShardedOrder(len(store), bs, seed=0),
                       store.spec, _names(store))


def rate(make: Callable[[int], Iterable], n: int, device: torch.device, epochs: int) -> float:
    """Median samples/s over ``epochs`` timed epochs (after one untimed), work completed."""
    times = []
    for epoch in range(epochs + 1):
        loader = make(epoch)
        sync(device)
        t0 = time.perf_counter()
        for _batch in loader:
            pass
        sync(device)
        if epoch:
            times.append(time.perf_counter() - t0)
    return n / statistics.median(times)


def pinned_copy_gbps(device: torch.device, nbytes: int = 256 << 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return nbytes / min(times) / 1e9


def at_epoch(loader: IndexLoader, epoch: int) -> IndexLoader:
    loader.set_epoch(epoch)
    return loader


def _full_rate(store: Store, bs: int, device: torch.device, epochs: int) -> float:
    loader = device_loader(store, place_fields(list(store.fields), device), bs)
    return rate(lambda e: at_epoch(loader, e), len(store), device, epochs)


def throughput(name: str, store: Store, bs: int, device: torch.device, args: argparse.Namespace) -> dict:
    n = len(store)
    full = _full_rate(store, bs, device, args.epochs)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    chunked = chunked_loader(store, device, bs, args.chunk_mb)
    streamed = rate(lambda e: at_epoch(chunked, e), n, device, args.epochs)
    out = {"dataset": name, "store_MB": store.nbytes / 1e6, "batch_size": bs, "chunk_rows": chunked.source.rows,
           "full_samples_s": full, "chunked_samples_s": streamed, "chunked_over_full": streamed / full}
    print(f"{name:9s} store {store.nbytes / 1e6:7.1f} MB  bs {bs:4d}  chunk {chunked.source.rows:6d} rows | "
          f"full preload {full:12,.0f} samples/s | chunked {streamed:12,.0f} samples/s | "
          f"chunked/full {streamed / full:6.2f}")
    if device.type == "cuda":
        effective = streamed * store.nbytes / n / 1e9
        plain = pinned_copy_gbps(device)
        out.update(chunked_effective_GBps=effective, pinned_copy_GBps=plain,
                   staging_pinned=chunked.source.buffers.pinned)
        print(f"{'':9s} H2D: chunked effective {effective:6.1f} GB/s (store bytes / epoch time, staging pinned: "
              f"{chunked.source.buffers.pinned}) vs plain pinned copy {plain:6.1f} GB/s = {effective / plain:5.1%}")
    chunked.close()
    return out


def plain_dataloader(store: Store, bs: int, workers: int, device: torch.device) -> torch.utils.data.DataLoader:
    ds = torch.utils.data.TensorDataset(torch.from_numpy(store.fields[0]), torch.from_numpy(store.fields[1]))
    return torch.utils.data.DataLoader(ds, batch_size=bs, shuffle=True, num_workers=workers,
                                       pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                                       drop_last=True)


def train_idle(name: str, loader: Iterable, steps: int, device: torch.device, warmup: int = 5) -> dict:
    """Train a ResNet-18 for ``steps`` steps; time the GPU idle gap between consecutive steps."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mean = torch.tensor([0.49, 0.48, 0.45], device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.25, 0.24, 0.26], device=device).view(1, 3, 1, 1) * 255
    cuda = device.type == "cuda"
    marks: list[tuple] = []
    waits: list[float] = []
    last_end = time.perf_counter()
    it = iter(loader)
    t0 = None
    for step in range(steps + warmup):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if step == warmup:
            sync(device)
            t0 = time.perf_counter()
        start = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        if cuda:
            start.record()
        elif step >= warmup:
            waits.append(start - last_end)
        xf = ((x.float() - mean) / std).contiguous(memory_format=torch.channels_last)
        loss = torch.nn.functional.cross_entropy(model(xf), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            if step >= warmup:
                marks.append((start, end))
        last_end = time.perf_counter()
    sync(device)
    wall = time.perf_counter() - t0
    if cuda:
        gaps = [marks[i - 1][1].elapsed_time(marks[i][0]) for i in range(1, len(marks))]
        busy = sum(s.elapsed_time(e) for s, e in marks)
        idle = sum(gaps)
        res = {"idle_ms_per_step": idle / len(gaps), "idle_ms_p50": statistics.median(gaps),
               "idle_frac": idle / (idle + busy)}
    else:
        res = {"idle_ms_per_step": 1e3 * statistics.fmean(waits), "idle_ms_p50": 1e3 * statistics.median(waits),
               "idle_frac": sum(waits) / wall}
    res.update(loader=name, steps=steps, steps_s=steps / wall)
    print(f"  {name:28s} idle between steps: mean {res['idle_ms_per_step']:8.3f} ms  p50 {res['idle_ms_p50']:8.3f} ms"
          f"  idle {res['idle_frac']:6.1%}  | {res['steps_s']:7.1f} steps/s")
    return res


def resnet(store: Store, device: torch.device, args: argparse.Namespace) -> list[dict]:
    bs = args.resnet_batch
    print(f"ResNet-18 on {len(store)}x{tuple(store.infos[0].shape)} uint8, batch {bs}, {args.steps} steps "
          f"({'GPU idle from CUDA events' if device.type == 'cuda' else 'host wait for the next batch'}):")
    rows = []
    fields = place_fields(list(store.fields), device)
    rows.append(train_idle("device (full preload)", device_loader(store, fields, bs), args.steps, device))
    del fields
    chunked = chunked_loader(store, device, bs, args.chunk_mb)
    rows.append(train_idle(f"chunked ({args.chunk_mb:g} MB chunks)", chunked, args.steps, device))
    chunked.close()
    for workers in sorted({0, args.workers}):
        dl = plain_dataloader(store, bs, workers, device)
        rows.append(train_idle(f"DataLoader num_workers={workers}", dl, args.steps, device))
        del dl
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--only", choices=["throughput", "resnet"], help="run one section")
    p.add_argument("--datasets", default="cifar,imagenet", help="comma-separated: cifar, imagenet")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per loader (median)")
    p.add_argument("--chunk-mb", type=float, default=32.0, help="chunk buffer size")
    p.add_argument("--steps", type=int, default=None, help="ResNet steps per loader (default 100 cuda, 8 cpu)")
    p.add_argument("--resnet-batch", type=int, default=None, help="default 256 cuda, 32 cpu")
    p.add_argument("--resnet-samples", type=int, default=None, help="default 50000 cuda, 2048 cpu")
    p.add_argument("--workers", type=int, default=min(8, len(os.sched_getaffinity(0))),
                   help="num_workers of the plain DataLoader (also compared with 0)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    args.steps = args.steps or (100 if cuda else 8)
    args.resnet_batch = args.resnet_batch or (256 if cuda else 32)
    args.resnet_samples = args.resnet_samples or (50000 if cuda else 2048)
    name = torch.cuda.get_device_name(device) if cuda else f"CPU ({len(os.sched_getaffinity(0))} cores)"
    print(f"device: {device} ({name}), torch {torch.__version__}, "
          f"OMP threads {torch.get_num_threads()}")
    if not cuda:
        print("no CUDA: no host-to-device copies or CUDA events; H2D bandwidth is skipped")
    results: dict = {"device": str(device), "name": name, "throughput": [], "resnet": []}
    t_start = time.perf_counter()
    stores = {}
    for key in args.datasets.split(","):
        n, shape, bs = DATASETS[key]
        stores[key] = make_store(n, shape)
        if args.only in (None, "throughput"):
            results["throughput"].append(throughput(key, stores[key], bs, device, args))
    if args.only in (None, "resnet"):
        base = stores.get("cifar") or make_store(*DATASETS["cifar"][:2])
        sub = Store.from_arrays((np.asarray(base.fields[0][:args.resnet_samples]),
                                 np.asarray(base.fields[1][:args.resnet_samples])))
        results["resnet"] = resnet(sub, device, args)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
