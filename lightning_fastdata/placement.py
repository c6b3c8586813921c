"""Placing stores on the device, with the out-of-memory fallback ``device`` -> ``chunked`` -> ``workers``.

Every device allocation of a placement goes through :func:`device_empty` (and every
pinned host buffer through :func:`staging_empty`), so that tests can inject a CUDA
out-of-memory error at the k-th allocation, or a pinning failure, with
:func:`inject_faults` on any machine.

:func:`place` tries the plan's level; a ``torch.OutOfMemoryError`` frees what that level
allocated and proposes the level below. Ranks all-reduce the lowest proposal, so every
rank ends on the same level and batch counts stay equal. Any other error propagates
unchanged.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lightning_fastdata import distributed as D
from lightning_fastdata._util import fmt_bytes
from lightning_fastdata.plan import LEVELS, Plan, fall_back
from lightning_fastdata.store import Store

if TYPE_CHECKING:  # loaders imports this module; import it back only for types
    from lightning_fastdata.loaders import ChunkBuffers

_NAMES = {v: k for k, v in LEVELS.items()}


class _Faults(threading.local):
    """Test seam: raise at chosen device allocations, or fail every pin."""

    def __init__(self) -> None:
        self.oom_at: frozenset[int] = frozenset()
        self.error: BaseException | None = None
        self.pin_fails = False
        self.count = 0


_faults = _Faults()


@contextlib.contextmanager
def inject_faults(oom_at: int | Iterable[int] = (), pin_fails: bool = False,
                  error: BaseException | None = None) -> Iterator[_Faults]:
    """Test seam: make placement fail on purpose, on any machine, in this thread.

    Within the block, the ``oom_at``-th calls of :func:`device_empty` (1-based, counted
    from the start of the block) raise ``torch.OutOfMemoryError`` (or ``error`` when
    given), and :func:`staging_empty` cannot pin when ``pin_fails``.

    Yields the fault state; its ``count`` is the number of device allocations made so far.
    """
    saved = (_faults.oom_at, _faults.error, _faults.pin_fails, _faults.count)
    _faults.oom_at = frozenset([oom_at] if isinstance(oom_at, int) else oom_at)
    _faults.error, _faults.pin_fails, _faults.count = error, pin_fails, 0
    try:
        yield _faults
    finally:
        _faults.oom_at, _faults.error, _faults.pin_fails, _faults.count = saved


def device_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` on ``device``, through the fault seam of :func:`inject_faults`."""
    _faults.count += 1
    if _faults.count in _faults.oom_at:
        if _faults.error is not None:
            raise _faults.error
        raise torch.OutOfMemoryError(
            f"injected: CUDA out of memory at device allocation {_faults.count} ({tuple(shape)}, {dtype})"
        )
    return torch.empty(shape, dtype=dtype, device=device)


def staging_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    """A host buffer for host-to-device copies: pinned when possible, else pageable with a warning.

    Pinning fails under a low ``ulimit -l`` (memlock) or without a driver; the copies then
    still work, only without overlap with compute.
    """
    if pin:
        try:
            if _faults.pin_fails:
                raise RuntimeError("injected: cannot pin host memory")
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as e:  # torch.OutOfMemoryError included: pinned memory is host memory
            nbytes = dtype.itemsize * int(torch.Size(shape).numel())
            warnings.warn(
                f"lightning_fastdata: could not pin a {fmt_bytes(nbytes)} staging buffer ({e}); using "
                "pageable memory, so host-to-device copies will not overlap compute. Raise the memlock "
                "limit (ulimit -l) or lower vram_fraction to get pinned staging.",
                RuntimeWarning,
                stacklevel=2,
            )
    return torch.empty(shape, dtype=dtype)


@dataclass
class Placement:
    """The outcome of :func:`place`: the plan actually in force and what was placed.

    Attributes:
        plan: The plan (its strategy lowered, with a ``fallback`` reason, after an OOM).
        fields: Per split, one device tensor per field (``device`` strategy).
        buffers: Per split, the chunk buffers (``chunked`` strategy).
    """

    plan: Plan
    fields: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    buffers: dict[str, ChunkBuffers] = field(default_factory=dict)


def _device_memory(device: torch.device) -> str:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return f"{fmt_bytes(free)} free of {fmt_bytes(total)} on {device}"
    return f"on {device}"


def _release(device: torch.device) -> None:
    # Break reference cycles that may still hold partial tensors, then give the cached
    # blocks back to the driver so the next level (or the model) can have them.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _place_level(level: int, stores: dict[str, Store], plan: Plan, device: torch.device,
                 batch_sizes: dict[str, int], world_size: int, pin: bool, out: Placement) -> None:
    from lightning_fastdata.loaders import ChunkBuffers, place_fields

    if level == LEVELS["device"]:
        for split, store in stores.items():
            out.fields[split] = place_fields(store, device)
    elif level == LEVELS["chunked"]:
        for split, store in stores.items():
            out.buffers[split] = ChunkBuffers.for_store(store, device, plan.chunk_bytes, batch_sizes[split],
                                                        world_size=world_size, pin=pin)


def place(stores: dict[str, Store], plan: Plan, device: torch.device | str, config: dict[str, Any],
          batch_sizes: dict[str, int], world_size: int = 1) -> Placement:
    """Place ``stores`` at the plan's level, falling back one level per out-of-memory error.

    Every rank must call this (it all-reduces the level, and the chunk size, over ranks).

    Args:
        stores: The stores to place, by split.
        plan: The plan from :func:`~lightning_fastdata.plan.decide`.
        device: The training device.
        config: The settings the plan was made from (the fallback redoes loader parameters).
        batch_sizes: Batch size per split (chunks hold whole batches).
        world_size: Number of ranks (a chunk need not exceed one rank's shard).

    Returns:
        The :class:`Placement`; ``placement.plan`` is the plan in force.
    """
    device = torch.device(device)
    pin = device.type == "cuda" and config.get("pin_memory", "auto") is not False
    # Ranks may have planned differently (free memory differs): start from the lowest level,
    # and with one chunk size, so block-mode orders agree and batch counts are equal.
    level = D.all_reduce_min(LEVELS[plan.strategy])
    chunk_bytes = D.all_reduce_min(plan.chunk_bytes)
    if chunk_bytes != plan.chunk_bytes:
        plan.chunk_bytes = chunk_bytes
        if plan.strategy == "chunked":
            plan.reasons["chunk_bytes"] = f"{fmt_bytes(chunk_bytes)} per buffer: the smallest over ranks"
    if level < LEVELS[plan.strategy]:
        plan = fall_back(plan, _NAMES[level], "another rank planned a lower level", config)
    while True:
        out = Placement(plan)
        failure = None
        if stores:
            try:
                _place_level(level, stores, plan, device, batch_sizes, world_size, pin, out)
            except torch.OutOfMemoryError as e:
                allocated = sum(t.nbytes for ts in out.fields.values() for t in ts)
                allocated += sum(b.nbytes for b in out.buffers.values())
                out = Placement(plan)
                need = plan.store_nbytes if level == LEVELS["device"] else 2 * plan.chunk_bytes * len(stores)
                failure = (f"rank {D.rank()}: out of device memory placing {_NAMES[level]} "
                           f"(needs {fmt_bytes(need)}, {fmt_bytes(allocated)} in complete fields when it "
                           f"failed, {_device_memory(device)}): {str(e).splitlines()[0]}")
                del e
                _release(device)
        agreed = D.all_reduce_min(level - 1 if failure else level)
        if agreed == level:
            return out
        if failure is None:
            failure = f"rank {D.rank()}: placed {_NAMES[level]}, but another rank ran out of device memory"
            out = Placement(plan)
            _release(device)
        warnings.warn(f"lightning_fastdata: {failure}; falling back to strategy '{_NAMES[agreed]}' "
                      "on every rank", RuntimeWarning, stacklevel=2)
        plan = fall_back(plan, _NAMES[agreed], failure, config)
        level = agreed
