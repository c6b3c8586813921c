"""Where the chunked strategy's bandwidth goes: host gather, host-to-device copy, end to end.

The ``chunked`` source streams a host-resident store to the device: a background thread
gathers the next chunk's rows (in the epoch's random order) into a staging buffer (pinned
on CUDA), then copies it to the device, while the current chunk's batches are used. Its
throughput is bounded by the slowest of: the host gather (row copies from pageable memory,
``fill_threads`` threads), the host-to-device copy, and the per-chunk handoffs. This
measures each, for 3 KB rows (CIFAR, 3x32x32 uint8) and 150 KB rows (ImageNet, 3x224x224
uint8):

* ``gather``: GB/s of ``HostSource.gather_into`` of one chunk's random rows into the
  staging buffer, with 1, 2 and 4 threads, beside a plain contiguous copy of the same bytes
  (``memcpy``: what one thread can move);
* ``h2d`` (CUDA): GB/s of the pinned staging buffer's copy to the device;
* ``end_to_end``: GB/s of a whole epoch of the chunked source (``ChunkedSource`` with each
  ``fill_threads``), every batch consumed.

Every figure is the best of ``--repeats``; on a shared machine they are noisy.

    python benchmarks/chunked_bandwidth.py                 # cuda when available, else cpu
    python benchmarks/chunked_bandwidth.py --quick --device cpu   # smoke test: writes no JSON
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
#: name -> (row shape, batch size)
ROWS = {"3 KB rows (3x32x32)": ((3, 32, 32), 256), "150 KB rows (3x224x224)": ((3, 224, 224), 64)}
CHUNK_BYTES = 32 << 20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn: Any, repeats: int, device: torch.device) -> float:
    """The fastest of ``repeats`` runs of ``fn`` in seconds (after one untimed run)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_rows(name: str, shape: tuple[int, ...], batch: int, store_bytes: int, threads: list[int],
                 device: torch.device, repeats: int) -> dict[str, Any]:
    """Gather, copy and end-to-end bandwidth for one row size."""
    from lightning_fastdata.loaders import IndexLoader, ShardedOrder
    from lightning_fastdata.placement import ChunkBuffers, ChunkedSource, HostSource, rows_per_chunk
    from lightning_fastdata.store import Store

    row = int(np.prod(shape))
    n = max(2 * batch, store_bytes // row // batch * batch)
    images = np.random.default_rng(0).integers(0, 256, (n, *shape), dtype=np.uint8)
    host = HostSource([images])
    rows = rows_per_chunk(row, CHUNK_BYTES, batch, n)
    chunk_bytes = rows * row
    cuda = device.type == "cuda"
    staging = torch.empty((rows, *shape), dtype=torch.uint8, pin_memory=cuda)
    out: dict[str, Any] = {"rows": name, "row_bytes": row, "store_rows": n, "store_MB": n * row / 1e6,
                           "chunk_rows": rows, "chunk_MB": chunk_bytes / 1e6, "staging_pinned": staging.is_pinned()}
    flat_src = torch.from_numpy(images.reshape(-1)[:chunk_bytes])
    flat_dst = staging.view(-1)
    out["memcpy_GBps"] = chunk_bytes / _best(lambda: flat_dst.copy_(flat_src), repeats, torch.device("cpu")) / 1e9
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:rows]
    out["gather_GBps"] = {}
    for t in threads:
        pool = ThreadPoolExecutor(max_workers=t) if t > 1 else None
        try:
            s = _best(lambda pool=pool, t=t: host.gather_into(idx, [staging], pool=pool, parts=t), repeats,
                      torch.device("cpu"))
        finally:
            if pool is not None:
                pool.shutdown()
        out["gather_GBps"][str(t)] = chunk_bytes / s / 1e9
    if cuda:
        dst = torch.empty_like(staging, device=device)
        out["h2d_GBps"] = chunk_bytes / _best(lambda: dst.copy_(staging, non_blocking=True), repeats, device) / 1e9
        del dst
    store = Store.from_arrays((images,))
    out["end_to_end_GBps"] = {}
    for t in threads:
        source = ChunkedSource(HostSource([images]), ChunkBuffers.for_store(store, device, CHUNK_BYTES, batch),
                               fill_threads=t)
        loader = IndexLoader(source, ShardedOrder(n, batch, seed=0), store.spec, [i.name for i in store.infos])

        def epoch(loader: IndexLoader = loader) -> None:
            for _ in loader:
                pass

        try:
            out["end_to_end_GBps"][str(t)] = n * row / _best(epoch, max(1, repeats // 2), device) / 1e9
        finally:
            source.close()
    if cuda:
        best = max(out["end_to_end_GBps"].values())
        out["end_to_end_over_h2d"] = best / out["h2d_GBps"]
    return out


def run(device: torch.device, quick: bool, threads: list[int], repeats: int) -> dict[str, Any]:
    """Every row size on ``device``; prints one line per measurement."""
    store_bytes = (32 << 20) if quick else (256 << 20)
    results = []
    for name, (shape, batch) in ROWS.items():
        r = measure_rows(name, shape, batch, store_bytes, threads, device, repeats)
        gathers = ", ".join(f"{t} thread{'s' if t != '1' else ''} {g:.1f}" for t, g in r["gather_GBps"].items())
        ends = ", ".join(f"{t}: {g:.1f}" for t, g in r["end_to_end_GBps"].items())
        print(f"{name:24s} chunk {r['chunk_rows']:6d} rows ({r['chunk_MB']:.0f} MB) | memcpy {r['memcpy_GBps']:5.1f} "
              f"GB/s | gather into staging {gathers} GB/s"
              + (f" | H2D {r['h2d_GBps']:.1f} GB/s" if "h2d_GBps" in r else "")
              + f" | chunked end to end (fill threads {ends}) GB/s")
        results.append(r)
    return {"device": str(device), "quick": quick, "threads": threads, "repeats": repeats,
            "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "load_before": None, "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--quick", action="store_true", help="32 MB stores, few repeats")
    p.add_argument("--threads", default="1,2,4", help="fill threads to compare (default %(default)s)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per figure (default 5, --quick 3)")
    p.add_argument("--json", default=None, help="write the results here (default "
                   "benchmarks/results/chunked_bandwidth_<device type>.json; with --quick nowhere "
                   "unless given, so a smoke test leaves the committed results alone; '' for nowhere)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    threads = [int(t) for t in args.threads.split(",")]
    load = os.getloadavg()[0]
    out = run(device, args.quick, threads, args.repeats or (3 if args.quick else 5))
    out["load_before"], out["load_after"] = load, os.getloadavg()[0]
    if device.type == "cuda":
        out["name"] = torch.cuda.get_device_name(device)
    print(f"load average {load:.2f} before, {out['load_after']:.2f} after")
    # A --quick run's figures are not results: the committed file is kept unless a path is given.
    path = args.json if args.json is not None else "" if args.quick else str(
        ROOT / "benchmarks" / "results" / f"chunked_bandwidth_{device.type}.json")
    if not path:
        print("no JSON written" + (" (--quick; --json PATH writes one)" if args.quick else ""))
    else:
        sys.path.insert(0, str(ROOT))
        from lightning_fastdata._util import atomic_write_text

        atomic_write_text(path, json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
