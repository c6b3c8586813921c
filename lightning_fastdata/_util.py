"""Small helpers every layer uses: plain numbers from numpy ones, sizes as text, batch length,
process liveness, atomic files.

This module imports nothing from the package, so any module may import it.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def fmt_bytes(n: float) -> str:
    """Human-readable size, e.g. ``1.4 GB``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def as_int(value: Any) -> int | None:
    """``value`` as a plain int when it is an integer (a Python or numpy one, as ``np.arange``, a
    pandas row or a sweep gives), else None: a bool, a float and a string ("4") included. Plain,
    so that hparams, reprs and YAML show ``64``, not ``np.int64(64)``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return operator.index(value)


def as_float(value: Any) -> float | None:
    """``value`` as a plain float when it is a real number (ints and numpy ones included), else
    None: a bool (``True`` is no fraction) and a string included."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def as_flag(value: Any) -> bool | None:
    """``value`` as a plain bool when it is True or False (numpy's ``np.bool_`` included), else None:
    ``bool()`` read the string "False" as True, and 0 or 1 are no flags."""
    return bool(value) if isinstance(value, (bool, np.bool_)) else None


def batch_len(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first array, through tuples, lists and dicts.

    A list of plain values (file names, numbers) is one field with one value per sample: it is
    skipped for an array after it (its strings' lengths are no batch size), and its length
    counts where the batch holds no array. A leaf with a length but no shape (a FastBatch)
    counts its samples. Else 1.
    """
    found = _first_len(batch)
    return found[0] if found is not None else 1


def _first_len(node: Any) -> tuple[int, bool] | None:
    """``(length, is_an_array)`` of the first array-like leaf of ``node``, else of its first list of plain values."""
    if isinstance(node, (str, bytes, bytearray)):
        return None
    if hasattr(node, "shape"):
        return (int(node.shape[0]) if len(node.shape) else 1), True
    if not isinstance(node, (tuple, list, dict)):
        return (len(node), True) if hasattr(node, "__len__") else None  # e.g. a FastBatch: its samples
    if isinstance(node, dict):
        children: Any = node.values()
    elif node and all(isinstance(v, (str, bytes, bytearray, int, float)) for v in node):
        return len(node), False  # a list of plain values, one per sample (collated file names)
    else:
        children = node
    plain: tuple[int, bool] | None = None
    for child in children:
        found = _first_len(child)
        if found is not None and found[1]:
            return found
        plain = plain or found
    return plain


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: Where the CPU quota, the memory limit and the topology are read (tests point them at a fake tree).
CGROUP_ROOT, PROC_CGROUP, CPU_TOPOLOGY = "/sys/fs/cgroup", "/proc/self/cgroup", "/sys/devices/system/cpu"


def _allowed_cpus() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def cpu_count() -> int:
    """CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota (a
    container's ``--cpus``), rounded up."""
    allowed = len(_allowed_cpus())
    quota = cgroup_cpu_quota()
    return max(1, min(allowed, math.ceil(quota))) if quota is not None else allowed


def _cgroup_dirs(v1_mounts: tuple[str, ...], controller: str) -> list[tuple[Path, bool]]:
    """This process's cgroup directories, its own first then every ancestor, with whether each is v2.

    v2 is the ``0::/path`` line under ``CGROUP_ROOT``; v1 is the line naming ``controller``,
    under each of ``v1_mounts`` (the controller's mount, e.g. ``cpu,cpuacct``).
    """
    try:
        lines = Path(PROC_CGROUP).read_text().splitlines()
    except OSError:
        return []
    dirs: list[tuple[Path, bool]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            bases = [Path(CGROUP_ROOT)]
        elif controller in controllers.split(","):
            bases = [Path(CGROUP_ROOT) / mount for mount in v1_mounts]
        else:
            continue
        for base in bases:
            here = base / path.lstrip("/")
            while True:
                dirs.append((here, controllers == ""))
                if here == base or base not in here.parents:
                    break
                here = here.parent
    return dirs


def cgroup_cpu_quota() -> float | None:
    """CPUs the process's cgroup quota allows (the tightest on its path up the hierarchy), or None.

    cgroup v2: ``cpu.max`` ("max 100000" or "50000 100000"); v1: ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us`` in the cpu controller's mount (-1: none).
    """
    limits = [q for d, v2 in _cgroup_dirs(("cpu,cpuacct", "cpu"), "cpu") if (q := _read_quota(d, v2)) is not None]
    return min(limits) if limits else None


#: At or above this a v1 ``memory.limit_in_bytes`` means "no limit" (the kernel writes
#: PAGE_COUNTER_MAX pages, about 9.2e18 bytes, there).
_V1_UNLIMITED = 1 << 62


def cgroup_memory_limit() -> tuple[int, int] | None:
    """The tightest memory limit on the process's cgroup path, and the bytes still free under it; or None.

    cgroup v2: ``memory.max`` ("max": none) less ``memory.current``; v1:
    ``memory.limit_in_bytes`` (a huge sentinel: none) less ``memory.usage_in_bytes``, in
    the memory controller's mount. Inactive page cache (``memory.stat``) is not counted as
    used: the kernel reclaims it before it kills (``docker stats`` counts it the same way).
    """
    found: tuple[int, int] | None = None
    for d, v2 in _cgroup_dirs(("memory",), "memory"):
        read = _read_memory(d, v2)
        if read is not None:
            found = read if found is None else (min(found[0], read[0]), min(found[1], read[1]))
    return found


def _read_memory(directory: Path, v2: bool) -> tuple[int, int] | None:
    limit_file, usage_file, inactive = (("memory.max", "memory.current", "inactive_file") if v2 else
                                        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    try:
        text = (directory / limit_file).read_text().strip()
        if text == "max":
            return None
        limit = int(text)
    except (OSError, ValueError):
        return None
    if limit >= _V1_UNLIMITED:
        return None
    try:
        used = int((directory / usage_file).read_text())
    except (OSError, ValueError):
        return limit, limit  # usage unknown: the caller still caps by the host's available memory
    try:
        stat = dict(line.split() for line in (directory / "memory.stat").read_text().splitlines()
                    if line.count(" ") == 1)
        used -= int(stat.get(inactive, 0))
    except (OSError, ValueError):
        pass
    return limit, max(0, limit - max(0, used))


def _read_quota(directory: Path, v2: bool) -> float | None:
    try:
        if v2:
            quota, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
            if quota == "max":
                return None
            return int(quota) / int(period or 100000)
        quota_us = int((directory / "cpu.cfs_quota_us").read_text())
        period_us = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def physical_cores() -> int:
    """Physical cores among the CPUs this process may use (hyperthread siblings counted once),
    capped like :func:`cpu_count`; psutil's node-wide count where the topology cannot be read."""
    allowed = _allowed_cpus()
    cores: set[tuple[str, str]] = set()
    try:
        for cpu in allowed:
            topology = Path(CPU_TOPOLOGY) / f"cpu{cpu}" / "topology"
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        physical = len(cores)
    except OSError:
        import psutil

        physical = psutil.cpu_count(logical=False) or len(allowed)
    return max(1, min(physical, cpu_count()))


def atomic_write_text(path: str | os.PathLike, text: str, mode: int = 0o644) -> Path:
    """Write ``text`` to ``path`` through a unique temporary file and one ``rename``.

    A reader sees the old file or the new one, never half of one; the temporary is
    removed on any error.
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return dest
