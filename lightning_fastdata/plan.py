"""Pure decisions: where the store goes and how it is loaded, each with its reason in numbers.

:func:`probe_resources` reads the machine once into a :class:`Resources` snapshot (tests
build their own); :func:`decide` turns a store size, a snapshot and the user's settings
into a :class:`Plan`. Nothing here touches a device or a file.
"""

from __future__ import annotations

import difflib
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from lightning_fastdata._util import (
    as_flag,
    as_float,
    as_int,
    cgroup_memory_limit,
    cpu_count,
    fmt_bytes,
    physical_cores,
)

STRATEGIES = ("auto", "device", "chunked", "workers")
#: Placement levels, most device memory first; a failed placement falls back one level.
LEVELS = {"workers": 0, "chunked": 1, "device": 2}
#: Largest chunk buffer the plan chooses, unless one batch is larger.
CHUNK_CAP_BYTES = 64 << 20
#: Free device memory kept back for the model, activations and the allocator.
VRAM_MARGIN_BYTES = 1 << 30



@dataclass(frozen=True)
class Resources:
    """A snapshot of what this rank can use.

    Attributes:
        physical_cores: Physical CPU cores of the node (or those this process may use).
        logical_cores: Logical CPUs this process may run on.
        ram_total: Node RAM in bytes, or the container's memory limit where that is lower.
        ram_available: RAM available now, in bytes (under the container's limit, if any).
        device_type: "cuda" or "cpu": where training runs.
        device_total: Total memory of this rank's device (RAM on a CPU run).
        device_free: Free memory of this rank's device (available RAM on a CPU run).
        shm_free: Free bytes in /dev/shm (0 when absent).
        local_world_size: Training processes on this node.
        ram_limit: The cgroup memory limit (a container's ``--memory``) that lowered
            ``ram_total``, in bytes; 0 when the node's RAM is the bound.
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
    ram_limit: int = 0


def ram_text(r: Resources) -> str:
    """``"RAM"``, or ``"RAM (the container's memory limit)"`` when a cgroup limit bounds it."""
    return "RAM (the container's memory limit)" if r.ram_limit else "RAM"


def probe_resources(device: torch.device | str = "cpu", local_world_size: int = 1) -> Resources:
    """Read the machine: CPU cores (affinity-aware), RAM, this rank's device memory, /dev/shm.

    RAM is the node's (psutil), capped by the cgroup memory limit of a container: the host's
    /proc/meminfo does not see it, and a plan over the host's RAM ends in an OOM kill.
    """
    device = torch.device(device)
    logical = cpu_count()
    physical = physical_cores()
    vm = psutil.virtual_memory()
    ram_total, ram_available, ram_limit = int(vm.total), int(vm.available), 0
    cgroup = cgroup_memory_limit()
    if cgroup is not None:
        if cgroup[0] < ram_total:
            ram_total = ram_limit = cgroup[0]
        ram_available = min(ram_available, cgroup[1])
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    else:
        free, total = ram_available, ram_total
    try:
        shm_free = shutil.disk_usage("/dev/shm").free
    except OSError:
        shm_free = 0
    return Resources(physical, logical, ram_total, ram_available, device.type, int(total), int(free),
                     int(shm_free), max(1, local_world_size), ram_limit)


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
        num_workers_candidates: Worker counts to time when ``num_workers="measure"``
            (empty otherwise).
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
    num_workers_candidates: list[int] = field(default_factory=list)
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
    """A setting out of range, or a forced one that cannot work on this machine; the message
    names the setting and gives the numbers and the fix."""


def _auto_int(name: str, value: Any, minimum: int, words: tuple[str, ...] = ("auto",)) -> int | str:
    if isinstance(value, str) and value in words:
        return value
    number = as_int(value)
    if number is None or number < minimum:
        allowed = ", ".join(repr(w) for w in words)
        raise PlanError(f"{name} must be {allowed} or an int >= {minimum}, got {value!r}")
    return number


def auto_flag(name: str, value: Any) -> bool | str:
    """``"auto"``, or ``value`` as a plain bool (numpy's included); a PlanError naming ``name`` otherwise."""
    if isinstance(value, str) and value == "auto":
        return value
    flag = as_flag(value)
    if flag is None:  # a string such as "False" would read as True
        raise PlanError(f"{name} must be 'auto', True or False, got {value!r}")
    return flag


def _strategy(name: str, value: Any) -> str:
    if not isinstance(value, str) or value not in STRATEGIES:
        raise PlanError(f"{name} must be one of {STRATEGIES}, got {value!r}")
    return value


def _fraction(name: str, value: Any) -> float:
    fraction = as_float(value)
    if fraction is None or not 0.0 < fraction <= 1.0:  # NaN fails the comparison too
        raise PlanError(f"{name} must be in (0, 1], got {value!r}; 0.6 keeps 40% for the model")
    return fraction


def _flag(name: str, value: Any) -> bool:
    flag = as_flag(value)
    if flag is None:
        raise PlanError(f"{name} must be True or False, got {value!r}")
    return flag


def _nbytes(name: str, value: Any) -> int | None:
    if value is None:
        return None
    number = as_int(value)
    if number is None or number < 0:
        raise PlanError(f"{name} must be None or an int >= 0 (bytes), got {value!r}")
    return number


#: The settings :func:`decide` reads, each with its check (which returns the value as plain Python).
CONFIG_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "strategy": _strategy,
    "vram_fraction": _fraction,
    "num_workers": lambda name, value: _auto_int(name, value, 0, ("auto", "measure")),
    "pin_memory": auto_flag,
    "prefetch_factor": lambda name, value: _auto_int(name, value, 1),
    "persistent_workers": auto_flag,
    "store": _flag,
    "batch_nbytes": _nbytes,
    "sent_batch_nbytes": _nbytes,
}


def check_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` checked, its numbers plain Python ones (numpy scalars are accepted).

    Raises:
        PlanError: naming an unknown key (with the known ones) or a value out of range.
    """
    unknown = [key for key in config if key not in CONFIG_CHECKS]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), CONFIG_CHECKS, n=1)
        raise PlanError(f"unknown plan setting {unknown[0]!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                        + f"; the settings are {', '.join(CONFIG_CHECKS)}")
    return {key: CONFIG_CHECKS[key](key, value) for key, value in config.items()}


def _budget(resources: Resources, vram_fraction: float) -> tuple[int, str]:
    """Bytes of the device the store may take: the fraction of total, bounded by free less a margin."""
    cuda = resources.device_type == "cuda"
    # On the CPU every local rank keeps its own copy of a device-placed store in the node's
    # one RAM: each gets its share. A GPU is one per rank.
    ranks = 1 if cuda else max(1, resources.local_world_size)
    by_fraction = int(vram_fraction * resources.device_total) // ranks
    margin = VRAM_MARGIN_BYTES if cuda else 0
    by_free = max(0, resources.device_free - margin) // ranks
    what = "VRAM" if cuda else ram_text(resources)
    why = (f"{vram_fraction * 100:g}% of {fmt_bytes(resources.device_total)} {what}"
           + (f" / {ranks} local ranks (each keeps its own copy)" if ranks > 1 else "")
           + f" = {fmt_bytes(by_fraction)}, free {fmt_bytes(resources.device_free)}"
           + (f" less a {fmt_bytes(margin)} margin" if margin else "")
           + (f" / {ranks} ranks = {fmt_bytes(by_free)}" if ranks > 1 else ""))
    return min(by_fraction, by_free), why


def _chunk_mode(store_nbytes: int, resources: Resources) -> str:
    """``global`` (exact device-loader order) unless the store exceeds the RAM available now."""
    return "block" if store_nbytes > resources.ram_available else "global"


def _chunk_mode_reason(mode: str, store_nbytes: int, resources: Resources) -> str:
    if mode == "block":
        return (f"block: store {fmt_bytes(store_nbytes)} exceeds the {fmt_bytes(resources.ram_available)} "
                f"of {ram_text(resources)} available; contiguous blocks in shuffled order, shuffled within a window")
    return (f"global: store {fmt_bytes(store_nbytes)} within the {fmt_bytes(resources.ram_available)} of "
            f"{ram_text(resources)} available; chunks follow the epoch's permutation (same batches as the device "
            "strategy)")


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
        config: The user's settings: ``strategy``, ``vram_fraction``, ``num_workers``
            ("auto", "measure" or a value), ``pin_memory``, ``prefetch_factor``,
            ``persistent_workers`` ("auto" or a value), ``store`` (False: the user opted
            out of the store, said in the reason), ``batch_nbytes`` (bytes of the
            largest batch; a chunk must hold one, and the workers' RAM and /dev/shm caps
            count it) and ``sent_batch_nbytes`` (see :func:`loader_params`); each is
            checked as ``OptimizedDataModule`` checks it, and any other key is refused.

    Raises:
        PlanError: when a setting is unknown or out of range (checked first: :func:`check_config`),
            or a forced strategy cannot work, with the numbers and the fix.
    """
    # A public entry point: an unchecked -3 workers reached the Plan, prefetch 0 divided by zero.
    config = check_config(config)
    strategy = config.get("strategy", "auto")
    fraction = config.get("vram_fraction", 0.6)
    batch_nbytes = config.get("batch_nbytes") or 0
    reasons: dict[str, str] = {}
    budget, why = _budget(resources, fraction)
    chunk = 0
    if store_nbytes is None:
        # store=False is the user's choice; otherwise a split's samples had no array form.
        opted_out = config.get("store", True) is False
        if strategy not in ("auto", "workers"):
            raise PlanError(f"strategy={strategy!r} needs a stored dataset, but " +
                            ("store=False; set store=True or use strategy='workers'" if opted_out else
                             "the samples cannot be stored; use strategy='workers' or make static_transform "
                             "return arrays"))
        chosen = "workers"
        reasons["strategy"] = (f"{'store=False' if opted_out else 'samples cannot be stored'}: "
                               "per-sample loading in DataLoader workers")
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
    loader_params(plan, resources, config)
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
    loader_params(new, plan.resources, config)
    return new


#: Private memory one DataLoader worker costs beyond its batches: a forked interpreter with
#: torch imported dirties a few hundred MB copy-on-write; per-sample decoding costs more.
WORKER_RAM_BYTES = 512 << 20
#: Share of this rank's available RAM the workers may take; the rest is for the main
#: process, the model on a CPU run, and the page cache that serves the store.
WORKER_RAM_SHARE = 0.5
#: Batch size assumed when the batch's bytes are unknown (samples that cannot be stored).
UNKNOWN_BATCH_BYTES = 16 << 20
#: Slack on /dev/shm: a batch can sit there twice (the worker's copy and the pinned one
#: in flight), and other processes of the node use it too.
SHM_SLACK = 2
#: Batches per rank in /dev/shm beyond its workers' prefetch: the one the training step
#: still holds, and the next epoch's first ones, requested while the last is alive. Measured
#: on a 64 MB /dev/shm with 25 MB batches, 1 persistent worker, prefetch 1: 4 batches at the
#: peak (2 x 1 x 1 + 2); the plan counted 2, and the worker ran out of space in epoch 2 (a
#: hang, not an error).
SHM_EXTRA_BATCHES = 2


def _auto_workers(r: Resources, batch_nbytes: int | None, prefetch: int) -> tuple[int, str]:
    """Workers for one rank: physical cores per local rank less one, capped by RAM and /dev/shm."""
    ranks = max(1, r.local_world_size)
    per_rank = max(1, r.physical_cores // ranks)
    n = per_rank - 1
    share = str(per_rank) if r.physical_cores >= ranks else f"{r.physical_cores / ranks:.2g} (fewer than one)"
    why = (f"{r.physical_cores} physical cores / {ranks} local rank{'s' if ranks > 1 else ''} = {share} per "
           f"rank, less one for the main process = {n}")
    if n == 0:
        return 0, why + ": batches are loaded in the main process"
    batch = batch_nbytes if batch_nbytes else UNKNOWN_BATCH_BYTES
    guess = "" if batch_nbytes else " (assumed: batch size unknown)"
    ram = int(WORKER_RAM_SHARE * r.ram_available / ranks)
    per_worker = WORKER_RAM_BYTES + prefetch * batch
    by_ram = ram // per_worker
    if by_ram < n:
        n = by_ram
        why += (f"; capped to {n} by {ram_text(r)}: {WORKER_RAM_SHARE:.0%} of {fmt_bytes(r.ram_available)} "
                f"available / "
                f"{ranks} rank(s) = {fmt_bytes(ram)}, {fmt_bytes(per_worker)} per worker "
                f"({fmt_bytes(WORKER_RAM_BYTES)} process + {prefetch} x {fmt_bytes(batch)} batches{guess})")
    # Worker batches reach the main process through /dev/shm; a full /dev/shm is a SIGBUS
    # ("bus error", "unable to write to file </torch_...>"), not a Python exception.
    shm = r.shm_free // ranks
    per_worker_shm = SHM_SLACK * prefetch * batch
    by_shm = max(0, shm - SHM_EXTRA_BATCHES * batch) // per_worker_shm
    if by_shm < n:
        n = by_shm
        why += (f"; capped to {n} by /dev/shm: {fmt_bytes(r.shm_free)} free / {ranks} rank(s) = {fmt_bytes(shm)}, "
                f"less {SHM_EXTRA_BATCHES} x {fmt_bytes(batch)} (the batch in use, the next epoch's first) = "
                f"{fmt_bytes(max(0, shm - SHM_EXTRA_BATCHES * batch))}, {fmt_bytes(per_worker_shm)} per worker "
                f"({SHM_SLACK} x {prefetch} x {fmt_bytes(batch)} batches in flight{guess})")
        if n == 0:
            why += "; 0 workers avoids the bus error: enlarge /dev/shm (docker run --shm-size=2g)"
    return n, why


def _memory_cap(r: Resources, batch_nbytes: int | None, prefetch: int) -> int:
    """Workers per rank that RAM and /dev/shm afford at ``prefetch`` batches in flight each (cores aside)."""
    ranks = max(1, r.local_world_size)
    batch = batch_nbytes if batch_nbytes else UNKNOWN_BATCH_BYTES
    by_ram = int(WORKER_RAM_SHARE * r.ram_available / ranks) // (WORKER_RAM_BYTES + prefetch * batch)
    by_shm = max(0, r.shm_free // ranks - SHM_EXTRA_BATCHES * batch) // (SHM_SLACK * prefetch * batch)
    return min(by_ram, by_shm)


def _measure_candidates(best_guess: int) -> list[int]:
    """Worker counts worth timing: none, one, half and all of the auto value (never more)."""
    return sorted({0, min(1, best_guess), best_guess // 2, best_guess})


def loader_params(plan: Plan, r: Resources, config: dict[str, Any]) -> None:
    """Loader settings, each with its reason; only ``workers`` uses worker processes.

    ``config`` may carry ``batch_nbytes`` (bytes of one training batch) and
    ``sent_batch_nbytes`` (of one a worker sends, augmented: it wins when given) so that RAM
    and /dev/shm caps count the batches in flight; without them a batch is assumed to be
    :data:`UNKNOWN_BATCH_BYTES`.
    """
    nw = config.get("num_workers", "auto")
    pf = config.get("prefetch_factor", "auto")
    batch_nbytes = config.get("sent_batch_nbytes") or config.get("batch_nbytes")
    plan.num_workers_candidates = []
    one_in_flight = False  # the worker count is affordable only with one batch in flight each
    if plan.strategy != "workers":
        # The device and chunked loaders have no worker processes: a configured count is unused.
        plan.num_workers = 0
        plan.reasons["num_workers"] = (
            f"0: strategy {plan.strategy!r} gathers batches in the main process, no workers to feed"
            + ("" if nw in ("auto", "measure") else f" (the configured {nw} has no effect)"))
    else:
        prefetch = 2 if pf == "auto" else int(pf)
        auto, why = _auto_workers(r, batch_nbytes, prefetch)
        if pf == "auto" and auto < max(1, r.physical_cores // max(1, r.local_world_size)) - 1:
            # A cap bound at two batches per worker: one batch each may buy more workers.
            one, why_one = _auto_workers(r, batch_nbytes, 1)
            if one > auto:
                auto, why = one, why_one + " (at one batch in flight per worker)"
                one_in_flight = True
        if nw == "auto":
            plan.num_workers = auto
            plan.reasons["num_workers"] = f"{auto}: {why}"
        elif nw == "measure":
            plan.num_workers = auto
            plan.num_workers_candidates = _measure_candidates(auto)
            plan.reasons["num_workers"] = (f"{auto} until measured: candidates {plan.num_workers_candidates} "
                                           f"are timed in setup, capped by the auto value ({why})")
        else:
            plan.num_workers = int(nw)
            plan.reasons["num_workers"] = (f"{plan.num_workers}: set by configuration" +
                                           (f" (auto would pick {auto}: {why})" if auto != plan.num_workers else ""))
            # The batches in flight are sized for this count, not for the auto one.
            one_in_flight = (pf == "auto" and plan.num_workers > _memory_cap(r, batch_nbytes, 2)
                             and plan.num_workers <= _memory_cap(r, batch_nbytes, 1))

    pm = config.get("pin_memory", "auto")
    cuda = r.device_type == "cuda"
    copies = cuda and plan.strategy in ("workers", "chunked")
    if pm is True and plan.strategy == "device":
        plan.pin_memory = False
        plan.reasons["pin_memory"] = ("False: the store lives on the device, batches never cross the "
                                      "host-to-device link (the configured True has no effect)")
    elif pm is True and not cuda:
        # Nothing crosses to a device: the chunked loader pins only for CUDA, and a pinned
        # DataLoader would lock host pages for nothing. The plan says what runs.
        plan.pin_memory = False
        plan.reasons["pin_memory"] = ("False: no host-to-device copy to speed up (the configured True has no "
                                      "effect: training runs on the CPU)")
    elif pm != "auto":
        plan.pin_memory = bool(pm)
        plan.reasons["pin_memory"] = f"{plan.pin_memory}: set by configuration"
    else:
        plan.pin_memory = copies
        if copies:
            why = "batches are copied host-to-device; pinned pages make the copy asynchronous and faster"
        elif not cuda:
            why = "training runs on the CPU: there is no host-to-device copy to speed up"
        elif plan.strategy == "device":
            why = "the store lives on the device: batches never cross the host-to-device link"
        else:
            why = "no host-to-device copy"
        plan.reasons["pin_memory"] = f"{plan.pin_memory}: {why}"

    if plan.num_workers == 0:
        plan.prefetch_factor = None
        plan.reasons["prefetch_factor"] = ("None: no worker processes (PyTorch requires None then)"
                                           + ("" if pf in ("auto", None) else f" (the configured {pf} has no effect)"))
    elif pf != "auto":
        plan.prefetch_factor = int(pf)
        plan.reasons["prefetch_factor"] = f"{plan.prefetch_factor}: set by configuration"
    else:
        plan.prefetch_factor = 1 if one_in_flight else 2
        plan.reasons["prefetch_factor"] = (
            "1: /dev/shm or RAM holds only one batch in flight per worker" if one_in_flight else
            f"2: {2 * plan.num_workers} batches in flight over {plan.num_workers} worker(s) hide per-batch "
            "jitter; more costs RAM and /dev/shm without speed when the workers keep up")

    pw = config.get("persistent_workers", "auto")
    if plan.num_workers == 0:
        plan.persistent_workers = False
        plan.reasons["persistent_workers"] = "False: no worker processes" + (
            " (the configured True has no effect)" if pw is True else "")
    elif pw != "auto":
        plan.persistent_workers = bool(pw)
        plan.reasons["persistent_workers"] = f"{plan.persistent_workers}: set by configuration"
    else:
        plan.persistent_workers = True
        plan.reasons["persistent_workers"] = ("True: workers are kept across epochs; restarting them costs a fork "
                                              "and a re-pickled dataset per worker every epoch")
