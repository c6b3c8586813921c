"""Host memory that stays with the process: glibc's malloc told to keep freed buffers.

A run that assembles and augments batches on the CPU allocates and frees buffers of batch
size on every step (the gathered rows, each op's output). glibc returns large freed blocks
to the operating system (``munmap``, or trimming the heap's top), so the next batch's
buffer is fresh memory again: the kernel zero-fills it one 4 KiB page fault at a time,
which costs more than the copy that fills it. Measured on 2 cores with the volumes
benchmark (batches of four 1x128^3 int16 volumes with masks, 96^3 crops): about 750 page
faults per sample (3 MB zero-filled by the kernel), and the loader about 1.5x faster with
them gone (``benchmarks/volumes.py``). PyTorch's CUDA caching allocator keeps device memory for the
same reason; its CPU allocator has no cache.

:func:`keep_freed_memory` sets two ``mallopt`` parameters for the whole process: blocks up
to ``mmap_threshold`` bytes come from the heap rather than their own mappings, and the heap
is not trimmed below ``trim_threshold`` of free space. Freed memory is then reused by the
next allocation instead of being handed back; the process's resident memory stays at its
high-water mark. There is no way back short of a new process, which is why
:class:`~lightning_fastdata.OptimizedDataModule` does it only where it helps (the CPU runs
where the training process builds every batch) and says so in its plan, and
``keep_freed_memory=False`` turns it off.

Only glibc has these parameters; elsewhere (macOS, musl) nothing is changed.

This module imports nothing from the package.
"""

from __future__ import annotations

import ctypes
import threading

#: glibc's ``mallopt`` parameter numbers (``<malloc.h>``).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

#: Blocks up to this size come from the heap once kept: larger than any batch buffer of a
#: training step that fits a host (a 256 x 3 x 224 x 224 float32 batch is 154 MB).
DEFAULT_MMAP_THRESHOLD = 1 << 30
#: Free space at the heap's top kept before glibc trims it (the largest value mallopt takes).
DEFAULT_TRIM_THRESHOLD = (1 << 31) - 1
_MAX = (1 << 31) - 1  # mallopt takes a C int

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}


def _glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc, else None."""
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc; TypeError: Windows has no CDLL(None)
        return None
    version.restype = ctypes.c_char_p
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return libc


def keep_freed_memory(mmap_threshold: int = DEFAULT_MMAP_THRESHOLD,
                      trim_threshold: int = DEFAULT_TRIM_THRESHOLD) -> bool:
    """Tell glibc's malloc to keep freed memory in the process for reuse (process-wide, for good).

    Args:
        mmap_threshold: Allocations up to this many bytes come from the heap (glibc's
            default is 128 KiB, raised by itself up to 32 MiB as blocks are freed).
        trim_threshold: Free bytes at the top of the heap kept rather than returned.

    Returns:
        True if the setting is in force (now or from an earlier call), False where the C
        library is not glibc or refused the values.

    Raises:
        ValueError: A threshold is not an int of bytes in [1 MiB, 2 GiB - 1].
    """
    for name, value in (("mmap_threshold", mmap_threshold), ("trim_threshold", trim_threshold)):
        if isinstance(value, bool) or not isinstance(value, int) or not (1 << 20) <= value <= _MAX:
            raise ValueError(f"keep_freed_memory {name} must be an int of bytes in [1 MiB, 2 GiB - 1], "
                             f"got {value!r}")
    with _LOCK:
        if _STATE.get("kept"):
            return True
        libc = _glibc()
        if libc is None:
            return False
        ok = bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))
        if ok:
            _STATE.update(kept=True, mmap_threshold=mmap_threshold, trim_threshold=trim_threshold,
                          glibc=libc.gnu_get_libc_version().decode())
        return ok


def freed_memory_kept() -> bool:
    """Whether :func:`keep_freed_memory` is in force in this process."""
    return bool(_STATE.get("kept"))


def describe() -> str:
    """One line on the setting in force, for the plan's log."""
    if not _STATE.get("kept"):
        return "glibc's defaults (freed batch buffers go back to the operating system)"
    mb = 1 << 20
    return (f"freed memory kept for reuse (glibc {_STATE['glibc']} mallopt: M_MMAP_THRESHOLD "
            f"{int(_STATE['mmap_threshold']) // mb} MiB, M_TRIM_THRESHOLD {int(_STATE['trim_threshold']) // mb} MiB)")


__all__ = ["DEFAULT_MMAP_THRESHOLD", "DEFAULT_TRIM_THRESHOLD", "describe", "freed_memory_kept",
           "keep_freed_memory"]
