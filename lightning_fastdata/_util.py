"""Small helpers every layer uses: sizes as text, batch length, process liveness, atomic files.

This module imports nothing from the package, so any module may import it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any


def fmt_bytes(n: float) -> str:
    """Human-readable size, e.g. ``1.4 GB``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def batch_len(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first array (through tuples, lists, dicts); else 1."""
    node = batch
    while isinstance(node, (tuple, list, dict)):
        if not node:
            return 1
        node = next(iter(node.values())) if isinstance(node, dict) else node[0]
    if hasattr(node, "shape"):
        return int(node.shape[0]) if len(node.shape) else 1
    return len(node) if hasattr(node, "__len__") else 1  # e.g. a FastBatch: its samples


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cpu_count() -> int:
    """CPUs this process may run on (affinity-aware)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


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
