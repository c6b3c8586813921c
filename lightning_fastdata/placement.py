"""Where a store's memory lives, and reading it by sample index.

A *source* holds one split's field arrays somewhere and serves rows by index:

* :class:`DeviceSource`: every field copied whole onto the training device;
* :class:`HostSource`: the fields in host memory: the disk cache's memory maps, or one
  node-local shared-memory copy (:mod:`~lightning_fastdata.shared`) read by every rank and
  DataLoader worker;
* :class:`ChunkedSource`: a prefetching view over a :class:`HostSource` that streams the
  epoch's rows to the device through two reused chunk buffers.

Each has ``gather(indices)``, returning fresh tensors that nobody else writes (a batch
handed to the user never changes afterwards), and ``batches(order, batch_size, start)``,
the rows of a whole epoch in order (the chunked source overlaps loading with use there).
A ragged field (:mod:`~lightning_fastdata.ragged`) is gathered into a
:class:`~lightning_fastdata.ragged.RaggedBatch`: on the device by an element index built
on the device (no host sync, no Python loop per sample), on the host by one copy per
sample; the chunked source gathers its ragged fields from host memory per batch.

:func:`place` allocates everything for a plan. Every device allocation goes through
:func:`device_empty` (and every pinned host buffer through :func:`staging_empty`), so tests
can inject a CUDA out-of-memory error at the k-th allocation, or a pinning failure, with
:func:`inject_faults` on any machine. A ``torch.OutOfMemoryError`` frees what its level
allocated and proposes the level below (``device`` -> ``chunked`` -> ``workers``); ranks
all-reduce the lowest proposal, so every rank ends on the same level. Any other error
propagates unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import mmap
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from lightning_fastdata import distributed as D
from lightning_fastdata._util import cpu_count, fmt_bytes
from lightning_fastdata.augment_base import StoreRows
from lightning_fastdata.plan import LEVELS, Plan, fall_back
from lightning_fastdata.ragged import RaggedArray, RaggedBatch, RaggedField, gather_host
from lightning_fastdata.shared import Segment, share_stores, worker_headroom
from lightning_fastdata.store import Store

#: A batch leaf: a tensor, or a ragged field's batch.
Leaf = torch.Tensor | RaggedBatch | StoreRows

_NAMES = {v: k for k, v in LEVELS.items()}


# --------------------------------------------------------------------------- allocation seam


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


_HUGE_PAGE = 2 << 20


def _empty_huge(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor; on the CPU, a large one lives in transparent-huge-page memory.

    Batches are random row gathers across the whole field: with 4 KiB pages nearly every
    row misses the TLB, with 2 MiB pages few do (gathers about 25% faster on CIFAR-sized
    fields). The memory is a private anonymous mapping advised ``MADV_HUGEPAGE`` and
    aligned to 2 MiB; where the platform lacks either, a plain ``torch.empty``.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    flags = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if device.type != "cpu" or nbytes < 4 * _HUGE_PAGE or None in flags or advice is None:
        return device_empty(shape, dtype, device)
    device_empty((0,), dtype, device)  # the allocation still passes the fault-injection seam
    try:
        buf = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=flags[0] | flags[1])
        buf.madvise(advice)
    except (OSError, ValueError):
        return torch.empty(shape, dtype=dtype, device=device)
    flat = torch.frombuffer(buf, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -flat.data_ptr() % _HUGE_PAGE
    return flat[start:start + nbytes].view(dtype).view(shape)


def torch_dtype(dtype: np.dtype | str) -> torch.dtype:
    """The torch dtype of a numpy dtype (or its string form)."""
    return torch.from_numpy(np.empty(0, dtype=np.dtype(dtype))).dtype


def as_tensor(a: np.ndarray) -> torch.Tensor:
    """A zero-copy tensor view of a (possibly read-only) array; we only ever read it."""
    with warnings.catch_warnings():
        # Read-only memmaps: torch warns that the tensor is not writable.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _place_array(arr: np.ndarray, device: torch.device, chunk_bytes: int) -> torch.Tensor:
    dst = _empty_huge(arr.shape, torch_dtype(arr.dtype), device)
    rows = max(1, chunk_bytes // max(1, arr[0:1].nbytes))
    for a in range(0, arr.shape[0], rows):
        dst[a:a + rows].copy_(as_tensor(np.ascontiguousarray(arr[a:a + rows])))
    return dst


def _host_copy(arr: np.ndarray) -> torch.Tensor:
    """A private in-memory copy (offsets and shapes are read on every batch: no page faults on a memmap)."""
    return torch.from_numpy(np.array(arr, copy=True))


def place_fields(arrays: list[np.ndarray | RaggedArray], device: torch.device | str,
                 chunk_bytes: int = 64 << 20, private_encoded: bool = True) -> list[torch.Tensor | RaggedField]:
    """Copy every array into one tensor on ``device``, in chunks (bounded host staging).

    A ragged field becomes a :class:`~lightning_fastdata.ragged.RaggedField`: its values
    and offsets on ``device``, its offsets, shapes (and decoded shapes) also on the host.
    An encoded field's bytes stay in host memory: a private copy, or with
    ``private_encoded=False`` a view of ``arrays`` (see :meth:`DeviceSource.hold_encoded`).
    """
    device = torch.device(device)
    out: list[torch.Tensor | RaggedField] = []
    try:
        for arr in arrays:
            if isinstance(arr, RaggedArray):
                host_offsets = _host_copy(arr.offsets)
                # Encoded bytes stay in host memory: the decoders (nvJPEG included) read them there.
                where = torch.device("cpu") if arr.encoding else device
                if arr.encoding and not private_encoded:
                    values = as_tensor(arr.values)
                else:
                    values = _place_array(arr.values, where, chunk_bytes)
                offsets = host_offsets if where.type == "cpu" else _place_array(arr.offsets, device, chunk_bytes)
                decoded = _host_copy(arr.decoded) if arr.decoded is not None else None
                out.append(RaggedField(values, offsets, host_offsets, _host_copy(arr.shapes), arr.encoding, decoded))
            else:
                out.append(_place_array(arr, device, chunk_bytes))
    except BaseException:
        # The traceback keeps this frame alive: drop the partial copies now, not with it.
        out.clear()
        raise
    return out


# --------------------------------------------------------------------------- sources


class Source:
    """One split's fields somewhere, read by sample index.

    Attributes:
        kind: "device", "host" or "chunked".
        device: Where gathered batches live.
        n: Number of samples.
    """

    kind = "source"
    device: torch.device
    n: int

    def gather(self, indices: torch.Tensor, on_device: torch.Tensor | None = None) -> list[Leaf]:
        """Rows ``indices`` of every field, as fresh tensors on :attr:`device`.

        Args:
            indices: Sample indices, int64; on the CPU, so that ragged fields know the
                sizes of their samples without a device synchronisation (indices on
                the device are copied back, which waits for the device).
            on_device: The same indices already on :attr:`device`, if at hand.

        A ragged field's rows come as a :class:`~lightning_fastdata.ragged.RaggedBatch`.
        """
        raise NotImplementedError

    def batches(self, order: torch.Tensor, batch_size: int, start: int = 0, defer: frozenset[int] = frozenset()
                ) -> Iterator[tuple[list[Leaf], torch.Tensor]]:
        """``(leaves, indices)`` of the batches cut from ``order`` (CPU int64), from batch ``start``.

        ``indices`` is the batch's slice of ``order``, on :attr:`device`. ``defer``: positions
        of fields to hand out as :class:`~lightning_fastdata.augment_base.StoreRows`, not
        gathered (a :class:`DeviceSource` only, see :meth:`DeviceSource.gather`).
        """
        on_device = order.to(self.device, non_blocking=True)
        extra = {"defer": defer} if defer else {}
        for b in range(start, math.ceil(order.numel() / batch_size)):
            sel = on_device[b * batch_size:(b + 1) * batch_size]
            yield self.gather(order[b * batch_size:(b + 1) * batch_size], sel, **extra), sel

    @property
    def nbytes(self) -> int:
        """Bytes this source holds on the device (0 for host memory)."""
        return 0

    def close(self) -> None:
        """Stop background work (nothing by default)."""

    #: Set by :meth:`drop`: the loaders made from this source refuse to start an iteration.
    dropped = False

    def drop(self) -> None:
        """Forget the fields, after :meth:`close`, for good: their lists are emptied in place,
        so the loaders made from this source (which share them) let go too, and the memory
        (a shared-memory segment's pages, device copies) goes even while a Trainer still holds
        those loaders."""
        self.dropped = True
        self._forget()

    def _forget(self) -> None:
        """Empty the field lists in place (see :meth:`drop`)."""


def _rows(field: Any) -> int:
    return len(field) if isinstance(field, (RaggedArray, RaggedField)) else int(field.shape[0])


def _check_rows(fields: list[Any]) -> None:
    if not fields or len({_rows(f) for f in fields}) != 1:
        raise ValueError(f"every field needs the same number of rows, got {[_rows(f) for f in fields]}")


class DeviceSource(Source):
    """Every field whole on the device; a batch is one ``index_select`` per field (or, for an
    augmentation that starts with a crop, the field and the batch's rows: see :meth:`gather`).

    Args:
        fields: One tensor per field, ``(n, *sample_shape)``, on the device, or a
            :class:`~lightning_fastdata.ragged.RaggedField` (values on the device).
    """

    kind = "device"

    def __init__(self, fields: list[torch.Tensor | RaggedField], device: torch.device | str | None = None) -> None:
        _check_rows(fields)
        self.fields = fields
        self.segment: Segment | None = None  # the shared memory the encoded bytes view, if any
        if device is None:  # the device of the fields that are not encoded bytes (those stay on the host)
            placed = [f.values if isinstance(f, RaggedField) else f for f in fields
                      if not (isinstance(f, RaggedField) and f.encoding)]
            device = placed[0].device if placed else torch.device("cpu")
        self.device = torch.device(device)
        self.n = _rows(fields[0])

    @classmethod
    def from_arrays(cls, arrays: list[np.ndarray | RaggedArray], device: torch.device | str,
                    private_encoded: bool = True) -> DeviceSource:
        """Copy host arrays onto ``device`` (see :func:`place_fields`)."""
        return cls(place_fields(arrays, device, private_encoded=private_encoded), device)

    def encoded(self) -> list[int]:
        """Positions of the encoded fields (their bytes stay in host memory, for the decoders)."""
        return [k for k, f in enumerate(self.fields) if isinstance(f, RaggedField) and f.encoding]

    def hold_encoded(self, values: Mapping[int, np.ndarray] | None = None, segment: Segment | None = None) -> None:
        """Settle where the encoded fields' bytes live: views of ``values`` (by field position;
        one node-wide copy in shared memory, kept alive with ``segment``), or, without
        ``values``, a private copy of the bytes they view now (the disk cache's memory map)."""
        for k in self.encoded():
            f = self.fields[k]
            if values is not None:
                kept = as_tensor(values[k])
            else:
                kept = _place_array(f.values.numpy(), torch.device("cpu"), 64 << 20)
            self.fields[k] = replace(f, values=kept, offsets=f.host_offsets)
        self.segment = segment

    def gather(self, indices: torch.Tensor, on_device: torch.Tensor | None = None,
               defer: frozenset[int] = frozenset()) -> list[Leaf]:
        """As :meth:`Source.gather`; the fixed-shape fields at positions ``defer`` come as
        :class:`~lightning_fastdata.augment_base.StoreRows` (the whole field and the rows, no
        copy), for an augmentation that cuts its windows from the store (see ``IndexLoader``)."""
        idx = on_device if on_device is not None else indices.to(self.device, non_blocking=True)
        host = None
        out: list[Leaf] = []
        for k, f in enumerate(self.fields):
            if isinstance(f, RaggedField):
                if host is None:
                    host = indices if indices.device.type == "cpu" else indices.cpu()
                out.append(f.gather(host, idx))
            elif k in defer:
                out.append(StoreRows(f, idx))
            else:
                out.append(torch.index_select(f, 0, idx))
        return out

    def deferrable(self) -> frozenset[int]:
        """Positions of the fields :meth:`gather` can hand out as rows (the fixed-shape ones)."""
        return frozenset(k for k, f in enumerate(self.fields) if isinstance(f, torch.Tensor))

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.fields)

    def _forget(self) -> None:
        self.fields.clear()
        self.segment = None


class HostSource(Source):
    """The fields in host memory (memory maps of the disk cache, or a shared-memory segment).

    Args:
        arrays: One array per field, ``(n, *sample_shape)``, or a
            :class:`~lightning_fastdata.ragged.RaggedArray` for a ragged field.
        segment: The shared-memory segment the arrays view, if any (kept alive with them).

    Attributes:
        fixed: Positions of the fixed-shape fields (those :meth:`gather_into` fills).
        tensors: Zero-copy tensor views of the fixed-shape fields, in field order.
    """

    kind = "host"

    def __init__(self, arrays: list[np.ndarray | RaggedArray], segment: Segment | None = None) -> None:
        _check_rows(arrays)
        self.arrays, self.segment = arrays, segment
        self.fixed = [k for k, a in enumerate(arrays) if not isinstance(a, RaggedArray)]
        self.tensors = [as_tensor(arrays[k]) for k in self.fixed]  # zero-copy views
        self.device = torch.device("cpu")
        self.n = _rows(arrays[0])

    def gather(self, indices: torch.Tensor, on_device: torch.Tensor | None = None) -> list[Leaf]:
        idx = indices.cpu()
        tensors = iter(self.tensors)
        return [gather_host(a, idx) if isinstance(a, RaggedArray) else torch.index_select(next(tensors), 0, idx)
                for a in self.arrays]

    def _forget(self) -> None:
        self.arrays.clear()
        self.tensors.clear()
        self.segment = None

    def gather_ragged(self, indices: torch.Tensor) -> dict[int, RaggedBatch]:
        """Rows ``indices`` (CPU) of the ragged fields only, by field position."""
        return {k: gather_host(a, indices) for k, a in enumerate(self.arrays) if isinstance(a, RaggedArray)}

    def gather_into(self, indices: torch.Tensor, out: list[torch.Tensor], pool: ThreadPoolExecutor | None = None,
                    parts: int = 1) -> None:
        """Rows ``indices`` of every fixed-shape field into the first rows of ``out`` (one buffer per such field).

        With a ``pool``, the rows are split into ``parts`` ranges gathered in parallel:
        ``index_select`` releases the GIL, and one thread's row copies do not reach the
        memory bandwidth that a host-to-device copy can take.
        """
        k = indices.numel()
        if pool is None or parts <= 1 or k < 2 * parts:
            for t, o in zip(self.tensors, out, strict=True):
                torch.index_select(t, 0, indices, out=o[:k])
            return
        step = -(-k // parts)
        jobs = [pool.submit(self._gather_rows, indices, out, a, min(a + step, k)) for a in range(0, k, step)]
        for job in jobs:
            job.result()

    def _gather_rows(self, indices: torch.Tensor, out: list[torch.Tensor], a: int, b: int) -> None:
        for t, o in zip(self.tensors, out, strict=True):
            torch.index_select(t, 0, indices[a:b], out=o[a:b])


def rows_per_chunk(row_nbytes: int, chunk_bytes: int, batch_size: int, max_rows: int) -> int:
    """Rows of one chunk: whole batches within ``chunk_bytes`` (at least one), at most ``max_rows`` rounded up."""
    rows = max(batch_size, (chunk_bytes // max(1, row_nbytes)) // batch_size * batch_size)
    return min(rows, max(1, math.ceil(max_rows / batch_size)) * batch_size)


class ChunkBuffers:
    """The chunked source's memory, allocated once and reused for the whole run.

    Two device buffers per field (the chunk being consumed and the next one being
    filled), so the allocator sees no churn and memory cannot fragment; off the CPU, one
    host staging buffer per field (pinned when possible) that the next chunk is gathered
    into before its copy. On the CPU the chunk is gathered straight into its buffer.

    Args:
        infos: Per field, the per-sample shape and the dtype.
        rows: Rows per chunk, a multiple of ``batch_size``.
        batch_size: The batch size the chunks are cut into.
        device: Where the buffers live.
        pin: Pin the staging buffers (falls back to pageable memory with a warning).
    """

    def __init__(self, infos: list[tuple[tuple[int, ...], torch.dtype]], rows: int, batch_size: int,
                 device: torch.device | str, pin: bool = True) -> None:
        if batch_size <= 0 or rows <= 0 or rows % batch_size:
            raise ValueError(f"rows must be a positive multiple of batch_size, got rows={rows} "
                             f"batch_size={batch_size}")
        self.rows, self.batch_size, self.device = rows, batch_size, torch.device(device)
        self.infos = [(tuple(shape), dtype) for shape, dtype in infos]
        self.slots: list[list[torch.Tensor]] = []
        self.staging: list[torch.Tensor] | None = None
        # Ordinary tensors even when made under inference mode (a setup or a validation's rechunk
        # inside ``torch.inference_mode()``): the fill thread, outside it, writes into them, and
        # torch refuses an in-place update of an inference tensor there.
        with torch.inference_mode(False):
            try:
                for _ in range(2):
                    self.slots.append([device_empty((rows, *shape), dtype, self.device) for shape, dtype in infos])
            except BaseException:
                self.slots = []  # free the partial buffers before the error travels up
                raise
            if self.device.type != "cpu":
                self.staging = [staging_empty((rows, *shape), dtype, pin=pin and self.device.type == "cuda")
                                for shape, dtype in infos]

    @classmethod
    def for_store(cls, store: Store, device: torch.device | str, chunk_bytes: int, batch_size: int,
                  world_size: int = 1, pin: bool = True) -> ChunkBuffers:
        """Buffers for ``store``: as many whole batches as fit ``chunk_bytes``, no more than one rank's shard."""
        infos = [(info.shape, torch_dtype(info.dtype)) for info in store.infos if not info.ragged]
        return cls(infos, cls.rows_for(store, chunk_bytes, batch_size, world_size)[1], batch_size, device, pin=pin)

    @staticmethod
    def rows_for(store: Store, chunk_bytes: int, batch_size: int, world_size: int = 1) -> tuple[int, int]:
        """``(row bytes, rows per chunk)`` of :meth:`for_store`'s buffers (ragged fields are not chunked)."""
        row = sum(info.row_nbytes for info in store.infos if not info.ragged)
        return row, rows_per_chunk(row, chunk_bytes, batch_size, math.ceil(len(store) / max(1, world_size)))

    @property
    def nbytes(self) -> int:
        """Device bytes held (both slots, every field)."""
        return sum(t.nbytes for slot in self.slots for t in slot)

    @property
    def pinned(self) -> bool:
        """Whether the staging buffers are pinned (``False`` on the CPU, where there are none)."""
        return bool(self.staging) and all(t.is_pinned() for t in self.staging)


class ChunkedSource(Source):
    """A host source streamed to the device chunk by chunk; chunk k+1 loads while chunk k is used.

    A background thread gathers the next chunk's rows from host memory (into the pinned
    staging buffer, then copied on a side CUDA stream; on the CPU straight into the idle
    buffer) while batches are cut from the current chunk. Each batch is copied out of its
    chunk, so a batch stays valid after its buffer is refilled.

    Ragged fields are not chunked: each batch's ragged rows are gathered from host memory
    when the batch is cut and copied to the device (from pinned memory on CUDA, without
    blocking the host); only the fixed-shape fields go through the chunk buffers.

    Args:
        host: The host-resident fields.
        buffers: The two chunk buffers (see :class:`ChunkBuffers`).
        fill_threads: Threads gathering one chunk's rows (default: the CPUs, at most 4).
    """

    kind = "chunked"

    def __init__(self, host: HostSource, buffers: ChunkBuffers, fill_threads: int | None = None) -> None:
        expected = [(tuple(host.arrays[k].shape[1:]), torch_dtype(host.arrays[k].dtype)) for k in host.fixed]
        if buffers.infos != expected:
            raise ValueError(f"buffers with fields {buffers.infos} do not fit the source's fields {expected}")
        if fill_threads is None:
            fill_threads = min(4, cpu_count())
        if isinstance(fill_threads, bool) or not isinstance(fill_threads, int) or fill_threads < 1:
            raise ValueError(f"fill_threads must be an int >= 1, got {fill_threads!r}")
        self.host, self.buffers, self.fill_threads = host, buffers, fill_threads
        self.device, self.n, self.rows = buffers.device, host.n, buffers.rows
        self._executor: ThreadPoolExecutor | None = None
        self._fill: ThreadPoolExecutor | None = None
        # The iteration that owns the two chunk buffers: the latest one started. An older
        # iteration still alive (a second loader of the split iterated mid-epoch) stops with
        # an error rather than read rows the newer one loaded into the shared buffers.
        self._owner: object | None = None
        self._owner_lock = threading.Lock()
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._stream = torch.cuda.Stream(self.device)
            self._ready = [torch.cuda.Event(), torch.cuda.Event()]  # copy into slot done
            self._freed = [torch.cuda.Event(), torch.cuda.Event()]  # consumer done with slot
            self._staging_free: Any = None

    @property
    def nbytes(self) -> int:
        return self.buffers.nbytes

    def gather(self, indices: torch.Tensor, on_device: torch.Tensor | None = None) -> list[Leaf]:
        """Random access, outside the stream: rows from host memory, copied to the device."""
        return [t.to(self.device) for t in self.host.gather(indices)]

    def _ragged_to_device(self, batch: RaggedBatch) -> RaggedBatch:
        if batch.encoding:
            return batch  # encoded bytes are decoded from host memory
        if self._cuda:
            return batch.pin_memory().to(self.device, non_blocking=True)
        return batch.to(self.device)

    def _load(self, slot: int, idx: torch.Tensor) -> None:
        """Gather rows ``idx`` of every field into buffer ``slot`` (runs in the loader thread)."""
        k = idx.numel()
        dst = self.buffers.slots[slot]
        staging = self.buffers.staging
        if self.fill_threads > 1 and self._fill is None:
            self._fill = ThreadPoolExecutor(max_workers=self.fill_threads, thread_name_prefix="lightning_fastdata-fill")
        gather = functools.partial(self.host.gather_into, pool=self._fill, parts=self.fill_threads)
        if staging is None:
            gather(idx, dst)
            return
        if not self._cuda:
            gather(idx, staging)
            for st, d in zip(staging, dst, strict=True):
                d[:k].copy_(st[:k])
            return
        if self._staging_free is not None:
            self._staging_free.synchronize()  # the previous copy out of the staging buffer is done
        gather(idx, staging)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            # Do not overwrite the slot before the consumer's work on its previous chunk ran.
            self._stream.wait_event(self._freed[slot])
            for st, d in zip(staging, dst, strict=True):
                d[:k].copy_(st[:k], non_blocking=True)
                # Allocated on the consumer's stream, written on this one: if it is freed
                # mid-epoch, the allocator must wait for this copy before reusing it.
                d.record_stream(self._stream)
            self._ready[slot].record(self._stream)
        self._staging_free = self._ready[slot]

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_fastdata-chunk")
        return self._executor

    def batches(self, order: torch.Tensor, batch_size: int, start: int = 0
                ) -> Iterator[tuple[list[Leaf], torch.Tensor]]:
        if self.rows % batch_size:
            raise ValueError(f"chunks of {self.rows} rows do not hold whole batches of {batch_size}")
        rows, per_chunk = self.rows, self.rows // batch_size
        n_batches = math.ceil(order.numel() / batch_size)
        n_chunks = math.ceil(n_batches / per_chunk)
        on_device = order.to(self.device, non_blocking=True)
        pending: dict[int, Future] = {}
        me = object()
        with self._owner_lock:
            # Loads are queued on one thread in order: those an older iteration left pending
            # finish before this one's first load, which then overwrites them.
            self._owner = me

        def submit(c: int) -> None:
            pending[c] = self._pool().submit(self._load, c % 2, order[c * rows:(c + 1) * rows])

        first = start // per_chunk
        try:
            if first < n_chunks:
                submit(first)
            for c in range(first, n_chunks):
                pending.pop(c).result()
                if self._cuda:
                    torch.cuda.current_stream(self.device).wait_event(self._ready[c % 2])
                chunk = self.buffers.slots[c % 2]
                with self._owner_lock:
                    self._check_owner(me)
                    # The idle slot held chunk c - 1, whose batches were all copied out: refill it now.
                    if c + 1 < n_chunks:
                        submit(c + 1)
                for b in range(max(c * per_chunk, start), min((c + 1) * per_chunk, n_batches)):
                    a = (b - c * per_chunk) * batch_size
                    k = min(batch_size, order.numel() - b * batch_size)
                    with self._owner_lock:  # no newer iteration may start loading mid-copy
                        self._check_owner(me)
                        fixed = iter([f[a:a + k].clone() for f in chunk])
                    ragged = {j: self._ragged_to_device(r) for j, r in
                              self.host.gather_ragged(order[b * batch_size:b * batch_size + k]).items()}
                    leaves = [ragged[j] if j in ragged else next(fixed) for j in range(len(self.host.arrays))]
                    yield leaves, on_device[b * batch_size:b * batch_size + k]
                if self._cuda:
                    self._freed[c % 2].record(torch.cuda.current_stream(self.device))
        finally:
            # Stopped early or failed: let in-flight loads finish before the buffers are reused,
            # and make the next refills wait for the consumer's reads already enqueued.
            wait(list(pending.values()))
            if self._cuda:
                for event in self._freed:
                    event.record(torch.cuda.current_stream(self.device))

    def _check_owner(self, me: object) -> None:
        if self._owner is not me:
            raise RuntimeError(
                "lightning_fastdata: this iteration of a 'chunked' loader was stopped because another iteration "
                "of the same split started while it was running (two live iterators over one split, e.g. a "
                "callback iterating trainer.datamodule.train_dataloader() during training). They share the "
                "split's two chunk buffers, so this one would have yielded the other's rows. Iterate one loader "
                "of a split at a time; to look at samples during training, read the store instead "
                "(datamodule.stores[split].fields), or use strategy='device'"
            )

    def close(self) -> None:
        """Stop the loader threads (they restart when iterated again)."""
        for pool in (self._executor, self._fill):
            if pool is not None:
                pool.shutdown(wait=True)
        self._executor = self._fill = None

    def _forget(self) -> None:
        self.host.drop()
        self.buffers.slots.clear()
        if self.buffers.staging is not None:
            self.buffers.staging.clear()


# --------------------------------------------------------------------------- placement


@dataclass
class Placement:
    """The outcome of :func:`place`: the plan actually in force and a source per split.

    Attributes:
        plan: The plan (its strategy lowered, with a ``fallback`` reason, after an OOM).
        sources: Per split, where its fields are read from.
        segments: Per split, the shared-memory segment its host source views (if shared).
    """

    plan: Plan
    sources: dict[str, Source] = field(default_factory=dict)
    segments: dict[str, Segment] = field(default_factory=dict)

    def release(self, split: str) -> None:
        """Drop a split's source and close its segment (the pages go with the last view)."""
        source = self.sources.pop(split, None)
        if source is not None:
            source.close()
            source.drop()
        seg = self.segments.pop(split, None)
        if seg is not None:
            seg.release()


@dataclass(frozen=True)
class Sharing:
    """How host-resident stores may be shared between the processes of a node.

    Attributes:
        mode: ``"auto"``, ``"on"`` or ``"off"`` (the ``shared_memory`` setting).
        rank, local_rank, local_world_size: This process's place.
        batch_nbytes: Bytes of the largest batch (DataLoader workers keep some in /dev/shm).
    """

    mode: str = "auto"
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    batch_nbytes: int = 0


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


class _EncodedBytes:
    """The encoded fields of a store, as :func:`~lightning_fastdata.shared.share_stores` reads
    a store (``fields``, ``fingerprint``, ``nbytes``): what a ``device`` placement keeps in
    host memory."""

    def __init__(self, store: Store, positions: list[int]) -> None:
        self.fields = [store.fields[k] for k in positions]
        self.fingerprint = f"{store.fingerprint}:encoded"
        self.nbytes = sum(int(a.nbytes) for f in self.fields for a in f.parts().values())


def _share(stores: Mapping[str, Any], plan: Plan, sharing: Sharing, readers: bool | None = None,
           what: str = "", fallback_to: str | None = None) -> dict[str, Segment]:
    """One node-local copy of the host-resident stores when several processes read them.

    With ``shared_memory="auto"`` that is when the plan reads stores from host memory
    (``workers``, ``chunked``) with more than one local rank or any DataLoader worker, or
    when ``readers`` says so; ``"on"`` always shares. Collective: every rank takes part.
    """
    if readers is None:
        readers = plan.strategy in ("workers", "chunked") and (sharing.local_world_size > 1 or plan.num_workers > 0)
    want = sharing.mode == "on" or (sharing.mode == "auto" and readers)
    if not stores:
        return {}
    # Ranks may plan differently (free memory differs); if one shares, all must take part.
    if not D.all_reduce_max(float(want)):
        plan.reasons["shared_memory"] = (
            "off: set by configuration" if sharing.mode == "off" else
            f"not used: strategy {plan.strategy!r}, {sharing.local_world_size} local rank(s), "
            f"{plan.num_workers} worker(s): no host-memory store read by several processes"
        )
        return {}
    headroom = worker_headroom(sharing.batch_nbytes, plan.num_workers, plan.prefetch_factor,
                              sharing.local_world_size)
    notes: list[str] = []

    def warn(msg: str) -> None:
        notes.append(msg)
        if sharing.local_rank == 0:
            warnings.warn(msg, UserWarning, stacklevel=4)

    segments = share_stores(stores, headroom=headroom, fallback=sharing.mode == "auto", warn=warn,
                            rank=sharing.rank, local_rank=sharing.local_rank,
                            local_world_size=sharing.local_world_size, fallback_to=fallback_to)
    if segments:
        nbytes = sum(seg.size for seg in segments.values())
        plan.reasons["shared_memory"] = (
            f"on: one copy of {what}{', '.join(sorted(segments))} ({nbytes / 1e6:.1f} MB) in /dev/shm for "
            f"{sharing.local_world_size} local rank(s) x {max(plan.num_workers, 1)} reader(s) each"
        )
    else:
        plan.reasons["shared_memory"] = f"fallback to {fallback_to or 'the disk cache'}: " + (notes[0] if notes else "")
    return segments


def _hold_encoded(encoded: dict[str, DeviceSource], stores: Mapping[str, Store], plan: Plan, sharing: Sharing,
                  out: Placement) -> None:
    """Where a ``device`` placement keeps its encoded bytes (the JPEG decoders read them from host
    memory): one node-wide copy in shared memory when several local ranks read them (or with
    ``shared_memory="on"``), else a private copy per process. Collective: every rank placed the
    same level, so every rank has the same encoded splits."""
    parts = {s: _EncodedBytes(stores[s], src.encoded()) for s, src in encoded.items()}
    segments = _share(parts, plan, sharing, readers=sharing.local_world_size > 1, what="the encoded bytes of ",
                      fallback_to="a private copy of the encoded bytes per rank")
    for split, src in encoded.items():
        seg = segments.get(split)
        if seg is None:
            src.hold_encoded()
            continue
        arrays = seg.arrays()
        src.hold_encoded({k: arrays[j].values for j, k in enumerate(src.encoded())}, seg)
        out.segments[split] = seg


def _place_level(level: int, hosts: dict[str, HostSource], stores: Mapping[str, Store], plan: Plan,
                 device: torch.device, batch_sizes: Mapping[str, int], world_size: int, pin: bool,
                 out: dict[str, Source]) -> None:
    for split, host in hosts.items():
        if level == LEVELS["device"]:
            # Encoded bytes stay views of the disk cache until place() settles where they live.
            out[split] = DeviceSource.from_arrays(host.arrays, device, private_encoded=False)
        elif level == LEVELS["chunked"]:
            buffers = ChunkBuffers.for_store(stores[split], device, plan.chunk_bytes, batch_sizes[split],
                                             world_size=world_size, pin=pin)
            out[split] = ChunkedSource(host, buffers)
        else:
            out[split] = host


def _chunk_buffer_bytes(stores: Mapping[str, Store], chunk_bytes: int, batch_sizes: Mapping[str, int],
                        world_size: int) -> int:
    """Device bytes the chunked level allocates: two chunks per split, each as
    :meth:`ChunkBuffers.for_store` sizes it (whole batches, at most one rank's shard)."""
    return sum(2 * math.prod(ChunkBuffers.rows_for(store, chunk_bytes, batch_sizes[split], world_size))
               for split, store in stores.items())


def place(stores: Mapping[str, Store], plan: Plan, device: torch.device | str, config: Mapping[str, Any],
          batch_sizes: Mapping[str, int], world_size: int = 1, sharing: Sharing | None = None) -> Placement:
    """Place ``stores`` at the plan's level, falling back one level per out-of-memory error.

    Every rank must call this (it all-reduces the level, the chunk size and the sharing
    decision over ranks).

    Args:
        stores: The stores to place, by split.
        plan: The plan from :func:`~lightning_fastdata.plan.decide`.
        device: The training device.
        config: The settings the plan was made from (the fallback redoes loader parameters).
        batch_sizes: Batch size per split (chunks hold whole batches).
        world_size: Number of ranks (a chunk need not exceed one rank's shard).
        sharing: Node-local shared memory settings (default: one process, ``auto``).

    Returns:
        The :class:`Placement`; ``placement.plan`` is the plan in force.
    """
    device = torch.device(device)
    sharing = sharing or Sharing()
    pin = device.type == "cuda" and config.get("pin_memory", "auto") is not False
    # Ranks may have planned differently (free memory differs): start from the lowest level,
    # and with one chunk size, so block-mode orders agree and batch counts are equal.
    level = D.all_reduce_min(LEVELS[plan.strategy])
    chunk_bytes = D.all_reduce_min(plan.chunk_bytes)
    if chunk_bytes != plan.chunk_bytes:
        plan.chunk_bytes = chunk_bytes
        if plan.strategy == "chunked":
            plan.reasons["chunk_bytes"] = f"{fmt_bytes(chunk_bytes)} per buffer: the smallest over ranks"
    # The chunk mode decides how samples are dealt to ranks (block: contiguous shards,
    # global: strided): every rank must use the same, or samples overlap and go missing.
    block = D.all_reduce_max(1.0 if plan.chunk_mode == "block" else 0.0) > 0
    if block != (plan.chunk_mode == "block"):
        plan.chunk_mode = "block" if block else "global"
        if plan.strategy == "chunked":
            plan.reasons["chunk_mode"] = f"{plan.chunk_mode}: another rank's store does not fit its free host memory"
    if level < LEVELS[plan.strategy]:
        plan = fall_back(plan, _NAMES[level], "another rank planned a lower level", config)
    hosts = {split: HostSource(list(store.fields)) for split, store in stores.items()}
    while True:
        sources: dict[str, Source] = {}
        failure = None
        try:
            _place_level(level, hosts, stores, plan, device, batch_sizes, world_size, pin, sources)
        except torch.OutOfMemoryError as e:
            allocated = sum(s.nbytes for s in sources.values())
            sources = {}
            need = (plan.store_nbytes if level == LEVELS["device"] else
                    _chunk_buffer_bytes(stores, plan.chunk_bytes, batch_sizes, world_size))
            failure = (f"rank {D.rank()}: out of device memory placing {_NAMES[level]} "
                       f"(needs {fmt_bytes(need)}, {fmt_bytes(allocated)} in complete splits when it "
                       f"failed, {_device_memory(device)}): {str(e).splitlines()[0]}")
            del e
            _release(device)
        agreed = D.all_reduce_min(level - 1 if failure else level)
        if agreed == level:
            break
        if failure is None:
            failure = f"rank {D.rank()}: placed {_NAMES[level]}, but another rank ran out of device memory"
            sources = {}
            _release(device)
        warnings.warn(f"lightning_fastdata: {failure}; falling back to strategy '{_NAMES[agreed]}' "
                      "on every rank", RuntimeWarning, stacklevel=2)
        plan = fall_back(plan, _NAMES[agreed], failure, config)
        level = agreed
    out = Placement(plan, sources)
    encoded = {s: src for s, src in sources.items() if isinstance(src, DeviceSource) and src.encoded()}
    if encoded:
        _hold_encoded(encoded, stores, plan, sharing, out)
    # Host memory is shared once the level is known, and only for the splits read from host
    # memory: a device source holds its own copy, a segment beside it would only take RAM.
    # Every rank placed the same level, so every rank takes part in the same sharing.
    host_read = {s: st for s, st in stores.items() if isinstance(sources.get(s), (ChunkedSource, HostSource))}
    if not host_read:
        if sharing.mode == "on" and not out.segments:
            plan.reasons["shared_memory"] = (f"on, but nothing to share: strategy {plan.strategy!r} holds every "
                                             "store on the device, read from the disk cache once")
        return out
    segments = _share(host_read, plan, sharing)
    for split, seg in segments.items():
        shared = HostSource(seg.arrays(), seg)
        out.segments[split] = seg
        source = sources[split]
        if isinstance(source, ChunkedSource):
            out.sources[split] = ChunkedSource(shared, source.buffers)
        elif isinstance(source, HostSource):
            out.sources[split] = shared
    return out

