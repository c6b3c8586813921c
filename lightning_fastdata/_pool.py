"""One persistent pool of CPU threads for per-sample work (JPEG decoding, per-image resizes).

Python threads run in parallel where the work releases the GIL: libjpeg-turbo's decode and
torch's kernels do. But a torch kernel called from a plain thread starts its own OpenMP team
of ``torch.get_num_threads()`` threads, so P pool threads would run P x T threads on T
cores (measured here: 4x slower than single-threaded workers). The pool's threads
therefore run torch single-threaded. torch only has a process-wide setter (``torch.set_num_threads`` sets the
calling thread's OpenMP and MKL counts, and a global default that threads started later
adopt): each pool thread sets 1 when it starts, and the thread that made the pool puts the
global default back as it was once they have all started.

This module imports nothing from the package.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

_POOLS: dict[int, ThreadPoolExecutor] = {}
_LOCK = threading.Lock()
_LOCAL = threading.local()


def _forget_pools() -> None:
    """In a forked child: the parent's pools have no threads there (a task submitted to one
    would wait forever, e.g. under Lightning's ``ddp_fork``), and the lock may have been
    held by another thread at the fork. Start afresh; the child makes its own pools."""
    global _LOCK
    _POOLS.clear()
    _LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def _start(barrier: threading.Barrier) -> None:
    # torch sets a thread's counts from the global default on the thread's first parallel
    # call (or query): trigger that first, or it would undo the 1 below later.
    torch.get_num_threads()
    torch.set_num_threads(1)
    _LOCAL.in_pool = True
    barrier.wait()


def pool(threads: int) -> ThreadPoolExecutor:
    """The shared pool of ``threads`` threads (made on first use, all started, torch single-threaded)."""
    with _LOCK:
        ex = _POOLS.get(threads)
        if ex is None:
            before = torch.get_num_threads()
            ex = ThreadPoolExecutor(threads, thread_name_prefix=f"fastdata-cpu{threads}")
            barrier = threading.Barrier(threads)
            # One task per thread, each waiting for the others: every thread starts (and sets
            # its torch threads) now, not in the middle of a later batch.
            for f in [ex.submit(_start, barrier) for _ in range(threads)]:
                f.result()
            torch.set_num_threads(before)  # the global default the pool's threads changed
            _POOLS[threads] = ex
        return ex


def runs(weights: Sequence[int], parts: int) -> list[range]:
    """``range(len(weights))`` cut into at most ``parts`` contiguous runs of about equal weight."""
    w = list(weights) if sum(weights) > 0 else [1] * len(weights)
    total = sum(w)
    out: list[range] = []
    start = done = 0
    for i, wi in enumerate(w):
        done += wi
        if done * parts >= total * (len(out) + 1) or i == len(w) - 1:
            out.append(range(start, i + 1))
            start = i + 1
    return out


def map_runs(fn: Callable[[range], list[T]], weights: Sequence[int], threads: int) -> list[T]:
    """``fn`` over contiguous runs of the items (one per thread, about equal ``weights``), in
    order, concatenated. In the calling thread when ``threads <= 1``, for a single item, or
    when called from a pool thread (no nested waiting on the same pool)."""
    n = len(weights)
    threads = int(threads)
    if min(threads, n) <= 1 or getattr(_LOCAL, "in_pool", False):
        return fn(range(n))
    # Fewer items than threads: fewer runs on the same pool (a pool per list length left an
    # idle pool behind for every last partial batch).
    parts = pool(threads).map(fn, runs(weights, min(threads, n)))
    return [item for part in parts for item in part]


def default_threads() -> int:
    """The calling thread's torch intra-op budget: the cores by default, 1 in DataLoader workers."""
    return max(1, torch.get_num_threads())


__all__ = ["default_threads", "map_runs", "pool", "runs"]
