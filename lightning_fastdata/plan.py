"""Pure decisions: where the store goes and how it is loaded, each with its reason in numbers.

:func:`probe_resources` reads the machine once into a :class:`Resources` snapshot (tests
build their own); :func:`decide` turns a store size, a snapshot and the user's settings
into a :class:`Plan`. Nothing here touches a device or a file.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

STRATEGIES = ("auto", "device", "chunked", "workers")
#: Placement levels, most device memory first; a failed placement falls back one level.
LEVELS = {"workers": 0, "chunked": 1, "device": 2}
#: Largest chunk buffer the plan chooses, unless one batch is larger.
CHUNK_CAP_BYTES = 64 << 20
#: Free device memory kept back for the model, activations and the allocator.
VRAM_MARGIN_BYTES = 1 << 30


def fmt_bytes(n: float) -> str:
    """Human-readable size, e.g. ``1.4 GB``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@dataclass(frozen=True)
class Resources:
    """A snapshot of what this rank can use.

    Attributes:
        physical_cores: Physical CPU cores of the node (or those this process may use).
        logical_cores: Logical CPUs this process may run on.
        ram_total: Node RAM in bytes.
        ram_available: RAM available now, in bytes.
        device_type: "cuda" or "cpu": where training runs.
        device_total: Total memory of this rank's device (RAM on a CPU run).
        device_free: Free memory of this rank's device (available RAM on a CPU run).
        shm_free: Free bytes in /dev/shm (0 when absent).
        local_world_size: Training processes on this node.
    """

    physical_cores: int
    logical_cores: int
    ram_total: int
    ram_available: int
    device_type: str
    device_total: int
    device_free: int
    shm_free: int
    local_world_size: int = 1


def probe_resources(device: torch.device | str = "cpu", local_world_size: int = 1) -> Resources:
    """Read the machine: CPU cores (affinity-aware), RAM, this rank's device memory, /dev/shm."""
    device = torch.device(device)
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    physical = psutil.cpu_count(logical=False) or logical
    physical = min(physical, logical)
    vm = psutil.virtual_memory()
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    else:
        free, total = vm.available, vm.total
    try:
        shm_free = shutil.disk_usage("/dev/shm").free
    except OSError:
        shm_free = 0
    return Resources(physical, logical, vm.total, vm.available, device.type, int(total), int(free),
                     int(shm_free), max(1, local_world_size))


@dataclass
class Plan:
    """What was chosen, and why.

    Attributes:
        strategy: "device", "chunked" or "workers".
        num_workers, pin_memory, prefetch_factor, persistent_workers: Loader settings
            (used by the ``workers`` strategy).
        chunk_bytes: Per-buffer size of the ``chunked`` strategy (also kept by a
            ``device`` plan for its fallback).
        chunk_mode: ``global`` or ``block`` (see :class:`~lightning_fastdata.loaders.ChunkedLoader`).
        store_nbytes: Size of the store the plan is for.
        reasons: One sentence per decision, with its numbers.
        resources: The snapshot the plan was made from.
    """

    strategy: str
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    chunk_bytes: int = 0
    chunk_mode: str = "global"
    store_nbytes: int = 0
    reasons: dict[str, str] = field(default_factory=dict)
    resources: Resources | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain-data form for logging and JSON."""
        d = {k: v for k, v in vars(self).items() if k != "resources"}
        d["resources"] = vars(self.resources) if self.resources else None
        return d

    def __str__(self) -> str:
        lines = [f"strategy: {self.strategy}"]
        lines += [f"  {k}: {v}" for k, v in self.reasons.items()]
        return "\n".join(lines)


class PlanError(ValueError):
    """A forced setting cannot work on this machine; the message gives the numbers and the fix."""


def _budget(resources: Resources, vram_fraction: float) -> tuple[int, str]:
    """Bytes of the device the store may take: the fraction of total, bounded by free less a margin."""
    by_fraction = int(vram_fraction * resources.device_total)
    margin = VRAM_MARGIN_BYTES if resources.device_type == "cuda" else 0
    by_free = max(0, resources.device_free - margin)
    what = "VRAM" if resources.device_type == "cuda" else "RAM"
    why = (f"{vram_fraction:.0%} of {fmt_bytes(resources.device_total)} {what} = {fmt_bytes(by_fraction)}, "
           f"free {fmt_bytes(resources.device_free)}" + (f" less a {fmt_bytes(margin)} margin" if margin else ""))
    return min(by_fraction, by_free), why


def _chunk_mode(store_nbytes: int, resources: Resources) -> str:
    """``global`` (exact device-loader order) unless the store exceeds the RAM available now."""
    return "block" if store_nbytes > resources.ram_available else "global"


def _chunk_mode_reason(mode: str, store_nbytes: int, resources: Resources) -> str:
    if mode == "block":
        return (f"block: store {fmt_bytes(store_nbytes)} exceeds the {fmt_bytes(resources.ram_available)} "
                "of RAM available; contiguous blocks in shuffled order, shuffled within a window")
    return (f"global: store {fmt_bytes(store_nbytes)} within the {fmt_bytes(resources.ram_available)} of RAM "
            "available; chunks follow the epoch's permutation (same batches as the device strategy)")


def _chunk_bytes(store_nbytes: int, budget: int, batch_nbytes: int = 0) -> int:
    """Size of one chunk buffer: four must fit the budget (two for training, two for evaluation)."""
    # A store in at least 4 chunks, so loading overlaps use within an epoch (the first chunk
    # of each epoch is waited for); beyond some tens of MB a chunk buys no more overlap.
    want = max(batch_nbytes, -(-store_nbytes // 4))
    return max(0, min(max(CHUNK_CAP_BYTES, batch_nbytes), budget // 4, want))


def decide(store_nbytes: int | None, resources: Resources, config: dict[str, Any]) -> Plan:
    """Choose the strategy and loader parameters.

    ``device`` when the store fits the budget (``vram_fraction`` of the device's total
    memory, bounded by its free memory less a margin); ``chunked`` when it does not but
    two chunk buffers of at least one batch do; ``workers`` otherwise, and whenever the
    samples cannot be stored.

    Args:
        store_nbytes: Size of the store, or ``None`` when samples cannot be stored
            (then only the ``workers`` strategy over the raw source is possible).
        resources: The snapshot to decide from.
        config: The user's settings: ``strategy``, ``vram_fraction``, ``num_workers``,
            ``pin_memory``, ``prefetch_factor``, ``persistent_workers`` ("auto" or a value),
            and ``batch_nbytes`` (bytes of the largest batch; a chunk must hold one).

    Raises:
        PlanError: when a forced strategy cannot work, with the numbers and the fix.
    """
    strategy = config.get("strategy", "auto")
    if strategy not in STRATEGIES:
        raise PlanError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    fraction = float(config.get("vram_fraction", 0.6))
    batch_nbytes = int(config.get("batch_nbytes", 0) or 0)
    reasons: dict[str, str] = {}
    budget, why = _budget(resources, fraction)
    chunk = 0
    if store_nbytes is None:
        if strategy not in ("auto", "workers"):
            raise PlanError(f"strategy={strategy!r} needs a stored dataset, but the samples cannot be "
                            "stored; use strategy='workers' or make static_transform return arrays")
        chosen = "workers"
        reasons["strategy"] = "samples cannot be stored: per-sample loading in DataLoader workers"
    else:
        store = fmt_bytes(store_nbytes)
        chunk = _chunk_bytes(store_nbytes, budget, batch_nbytes)
        chunk_fits = chunk > 0 and chunk >= batch_nbytes
        chunk_why = (f"4 chunk buffers of {fmt_bytes(chunk)} (2 for training, 2 for evaluation) "
                     f"within the budget {fmt_bytes(budget)}, one batch = {fmt_bytes(batch_nbytes)}")
        if strategy == "auto":
            if store_nbytes <= budget:
                chosen = "device"
                reasons["strategy"] = f"store {store} fits the budget {fmt_bytes(budget)} ({why})"
            elif chunk_fits:
                chosen = "chunked"
                reasons["strategy"] = (f"store {store} exceeds the budget {fmt_bytes(budget)} ({why}): "
                                       f"streamed from host memory in chunks, {chunk_why}")
            else:
                chosen = "workers"
                reasons["strategy"] = (f"store {store} exceeds the budget {fmt_bytes(budget)} ({why}) and "
                                       f"a chunk of {fmt_bytes(chunk)} cannot hold one batch of "
                                       f"{fmt_bytes(batch_nbytes)}: loading in DataLoader workers")
        elif strategy == "device":
            if store_nbytes > budget:
                raise PlanError(
                    f"strategy='device' needs {store} on the device, the budget is "
                    f"{fmt_bytes(budget)} ({why}); raise vram_fraction, or use strategy='auto' "
                    "(which streams it in chunks)"
                )
            chosen = "device"
            reasons["strategy"] = f"forced; store {store} within the budget {fmt_bytes(budget)} ({why})"
        elif strategy == "chunked":
            if not chunk_fits:
                raise PlanError(
                    f"strategy='chunked' needs two device buffers of at least one batch "
                    f"(2 x {fmt_bytes(batch_nbytes)}) for training and two for evaluation, but a chunk "
                    f"buffer can only get {fmt_bytes(chunk)} (a quarter of the budget "
                    f"{fmt_bytes(budget)}: {why}); lower batch_size, raise vram_fraction, "
                    "or use strategy='workers'"
                )
            chosen = "chunked"
            reasons["strategy"] = f"forced; store {store} streamed in chunks, {chunk_why}"
        else:
            chosen = "workers"
            reasons["strategy"] = "forced by configuration"

    plan = Plan(chosen, store_nbytes=store_nbytes or 0, reasons=reasons, resources=resources)
    if store_nbytes is not None:
        # Kept for a fallback to ``chunked`` even when the plan is ``device``.
        plan.chunk_bytes = chunk
        plan.chunk_mode = _chunk_mode(store_nbytes, resources)
    if chosen == "chunked":
        reasons["chunk_bytes"] = f"{fmt_bytes(chunk)} per buffer: {chunk_why}"
        reasons["chunk_mode"] = _chunk_mode_reason(plan.chunk_mode, store_nbytes, resources)
    _loader_params(plan, resources, config)
    return plan


def fall_back(plan: Plan, strategy: str, reason: str, config: dict[str, Any]) -> Plan:
    """The plan one level down (``device`` -> ``chunked`` -> ``workers``) after a placement failure.

    Args:
        plan: The plan that could not be placed.
        strategy: The level all ranks agreed on.
        reason: Why, with the numbers; kept in ``reasons["fallback"]``.
        config: The settings :func:`decide` was given (the loader parameters are redone).
    """
    if LEVELS[strategy] >= LEVELS[plan.strategy]:
        raise ValueError(f"cannot fall back from {plan.strategy!r} to {strategy!r}")
    reasons = {"strategy": f"{strategy}: fallback from {plan.strategy}",
               "fallback": reason,
               f"planned ({plan.strategy})": plan.reasons.get("strategy", "")}
    new = Plan(strategy, store_nbytes=plan.store_nbytes, reasons=reasons, resources=plan.resources)
    if strategy == "chunked":
        new.chunk_mode = plan.chunk_mode
        new.chunk_bytes = plan.chunk_bytes
        if not new.chunk_bytes:
            budget, _ = _budget(plan.resources, float(config.get("vram_fraction", 0.6)))
            new.chunk_bytes = _chunk_bytes(plan.store_nbytes, budget, int(config.get("batch_nbytes", 0) or 0))
        reasons["chunk_bytes"] = f"{fmt_bytes(new.chunk_bytes)} per buffer"
        reasons["chunk_mode"] = plan.reasons.get("chunk_mode", new.chunk_mode)
    _loader_params(new, plan.resources, config)
    return new


def _loader_params(plan: Plan, r: Resources, config: dict[str, Any]) -> None:
    """Worker settings; only the ``workers`` strategy uses worker processes."""
    nw = config.get("num_workers", "auto")
    if plan.strategy != "workers":
        plan.num_workers = 0 if nw == "auto" else int(nw)
        plan.reasons["num_workers"] = (f"{plan.num_workers}: batches are gathered in the main process"
                                       if nw == "auto" else f"{plan.num_workers}: set by configuration")
    elif nw == "auto":
        per_rank = max(1, r.physical_cores // max(1, r.local_world_size))
        plan.num_workers = max(0, per_rank - 1) if per_rank > 1 else 0
        plan.reasons["num_workers"] = (
            f"{plan.num_workers}: {r.physical_cores} physical cores / {r.local_world_size} local ranks "
            f"= {per_rank} per rank, less one for the main process"
        )
    else:
        plan.num_workers = int(nw)
        plan.reasons["num_workers"] = f"{plan.num_workers}: set by configuration"

    pm = config.get("pin_memory", "auto")
    copies = plan.strategy == "workers" and r.device_type == "cuda"
    plan.pin_memory = copies if pm == "auto" else bool(pm)
    plan.reasons["pin_memory"] = (
        f"{plan.pin_memory}: " + ("host-to-device copies exist" if copies else "no host-to-device copy")
        if pm == "auto" else f"{plan.pin_memory}: set by configuration"
    )
    pf = config.get("prefetch_factor", "auto")
    if plan.num_workers == 0:
        plan.prefetch_factor = None
        plan.reasons["prefetch_factor"] = "None: no worker processes"
    else:
        plan.prefetch_factor = 2 if pf == "auto" else int(pf)
        why = "two batches in flight per worker" if pf == "auto" else "set by configuration"
        plan.reasons["prefetch_factor"] = f"{plan.prefetch_factor}: {why}"
    pw = config.get("persistent_workers", "auto")
    plan.persistent_workers = plan.num_workers > 0 if pw == "auto" else bool(pw) and plan.num_workers > 0
    plan.reasons["persistent_workers"] = (
        f"{plan.persistent_workers}: " + ("workers kept across epochs (no restart cost)" if plan.num_workers
                                          else "no worker processes")
    )
