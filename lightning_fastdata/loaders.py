"""The loaders: sample order, rank sharding, and the ``device``, ``chunked`` and ``workers`` strategies.

Every loader draws its order from :class:`ShardedOrder`, which reproduces
``torch.utils.data.DistributedSampler`` exactly (one permutation per epoch from
``seed + epoch``, padded or truncated to equal shards, rank ``r`` takes every
``world_size``-th index). Switching strategy therefore never changes which samples a
rank sees, nor their order.

Loaders are plain iterables, not ``DataLoader`` subclasses, so Lightning does not wrap
them in a second ``DistributedSampler``; Lightning still reaches ``loader.sampler.set_epoch``
and, through ``state_dict``/``load_state_dict``, checkpoints their position.
"""

from __future__ import annotations

import math
import mmap
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from lightning_fastdata.placement import device_empty, staging_empty
from lightning_fastdata.seeding import derive_seed
from lightning_fastdata.store import Store


class BatchKey(NamedTuple):
    """Where a batch sits in the run: its epoch and its index within the epoch."""

    epoch: int
    index: int


class ShardedOrder:
    """One permutation per epoch, sharded per rank with ``DistributedSampler`` semantics.

    Args:
        n: Number of samples.
        batch_size: Samples per batch.
        shuffle: Permute per epoch (from ``seed + epoch``), else keep index order.
        drop_last: Truncate to equal shards and drop the last partial batch; otherwise
            pad shards by repeating the first indices (as ``DistributedSampler`` does)
            and keep the partial batch.
        seed: Base seed, identical on every rank.
        rank: This process's rank.
        world_size: Number of ranks.
    """

    def __init__(self, n: int, batch_size: int, shuffle: bool = True, drop_last: bool = False,
                 seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        if n <= 0:
            raise ValueError(f"n must be > 0, got {n}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
        if drop_last and n < world_size:
            raise ValueError(f"drop_last with {n} samples over {world_size} ranks leaves nothing to load")
        self.n, self.batch_size, self.shuffle, self.drop_last = n, batch_size, shuffle, drop_last
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch = 0
        if drop_last and n % world_size:
            self.num_samples = math.ceil((n - world_size) / world_size)
        else:
            self.num_samples = math.ceil(n / world_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose permutation the next iteration uses."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    def indices(self, epoch: int | None = None) -> torch.Tensor:
        """This rank's sample indices for ``epoch`` (default: the current one), int64 on the CPU."""
        epoch = self.epoch if epoch is None else epoch
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        total = self.num_samples * self.world_size
        if total > self.n:
            reps = math.ceil((total - self.n) / self.n)
            order = torch.cat([order, order.repeat(reps)[: total - self.n]])
        else:
            order = order[:total]
        mine = order[self.rank:total:self.world_size]
        if self.drop_last:
            mine = mine[: len(self) * self.batch_size]
        return mine

    def batches(self, epoch: int | None = None, start: int = 0) -> Iterator[torch.Tensor]:
        """Index tensors of this rank's batches, from batch ``start``."""
        idx = self.indices(epoch)
        for b in range(start, len(self)):
            yield idx[b * self.batch_size:(b + 1) * self.batch_size]


class _Loader:
    """Shared machinery: order, epoch, the queue of yielded batch keys, resumable position.

    Consumers that know when a batch is actually used (the datamodule's
    ``on_after_batch_transfer``) call :meth:`next_key`; then ``state_dict`` counts
    consumed batches, not batches a prefetcher pulled ahead. Otherwise it counts yielded
    batches.
    """

    def __init__(self, order: ShardedOrder) -> None:
        self.order = order
        self._pending: deque[BatchKey] = deque()
        self._yielded = 0
        self._consumed = 0
        self._tracking = False
        self._resume: tuple[int, int] | None = None

    @property
    def sampler(self) -> ShardedOrder:
        """The order object; Lightning calls ``set_epoch`` on a loader's ``sampler``."""
        return self.order

    @property
    def batch_sampler(self) -> None:
        """Always ``None``: batches are formed by the loader itself (Lightning probes this)."""
        return None

    @property
    def epoch(self) -> int:
        return self.order.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next iteration."""
        self.order.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.order)

    def next_key(self) -> BatchKey | None:
        """Pop the key of the oldest yielded, not yet consumed batch, and count it consumed."""
        self._tracking = True
        if not self._pending:
            return None
        key = self._pending.popleft()
        self._consumed = key.index + 1
        return key

    def _start(self) -> int:
        self._pending.clear()
        start = 0
        if self._resume is not None:
            epoch, start = self._resume
            self._resume = None
            if epoch != self.order.epoch:
                start = 0
        self._yielded = self._consumed = start
        return start

    def _emit(self, index: int) -> None:
        self._pending.append(BatchKey(self.order.epoch, index))
        self._yielded = index + 1

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from: epoch and batches consumed, plus what must match."""
        return {
            "epoch": self.order.epoch,
            "batch": self._consumed if self._tracking else self._yielded,
            "n": self.order.n,
            "batch_size": self.order.batch_size,
            "world_size": self.order.world_size,
            "seed": self.order.seed,
            "shuffle": self.order.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration of ``state['epoch']`` starts at batch ``state['batch']``."""
        o = self.order
        for key in ("n", "batch_size", "world_size", "seed", "shuffle"):
            if key in state and state[key] != getattr(o, key):
                raise ValueError(
                    f"cannot resume this loader: checkpoint has {key}={state[key]!r}, the loader has "
                    f"{key}={getattr(o, key)!r}; resume with the configuration the checkpoint was made with"
                )
        o.set_epoch(int(state["epoch"]))
        self._resume = (int(state["epoch"]), int(state["batch"]))


def place_fields(store: Store, device: torch.device | str, chunk_bytes: int = 64 << 20) -> list[torch.Tensor]:
    """Copy every field of ``store`` into one tensor on ``device``, in chunks (bounded host staging)."""
    device = torch.device(device)
    out: list[torch.Tensor] = []
    try:
        for arr in store.fields:
            dst = _empty_huge(arr.shape, _torch_dtype(arr.dtype), device)
            out.append(dst)
            rows = max(1, chunk_bytes // max(1, arr[0:1].nbytes))
            for a in range(0, arr.shape[0], rows):
                dst[a:a + rows].copy_(_as_tensor(arr[a:a + rows]))
    except BaseException:
        # The traceback keeps this frame alive: drop the partial copies now, not with it.
        out.clear()
        dst = None  # noqa: F841
        raise
    return out


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


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _as_tensor(a: np.ndarray) -> torch.Tensor:
    # Read-only memmaps: torch warns that the tensor is not writable; we only read it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


class DeviceLoader(_Loader):
    """Batches gathered by index from fields that live on the training device.

    Args:
        fields: One tensor per store field, on the target device (see :func:`place_fields`).
        spec: The store's sample structure.
        order: The sample order.
        ring: On the CPU, batches are gathered with ``index_select`` into a ring of
            ``ring`` preallocated buffers (fresh memory costs page faults, 3-4x slower);
            a yielded batch stays valid until ``ring - 1`` more have been drawn. On CUDA
            the caching allocator already recycles memory, so each batch is fresh.
            ``ring=0`` always allocates.
    """

    def __init__(self, fields: list[torch.Tensor], spec: dict, order: ShardedOrder, ring: int = 3) -> None:
        super().__init__(order)
        if not fields or any(f.shape[0] != order.n for f in fields):
            raise ValueError(f"every field needs {order.n} rows, got {[tuple(f.shape) for f in fields]}")
        self.fields, self.spec = fields, spec
        self.device = fields[0].device
        self.ring = ring if self.device.type == "cpu" else 0
        self._buffers: list[list[torch.Tensor]] = []
        self._slot = 0

    def _out(self, k: int, rows: int) -> torch.Tensor | None:
        if not self.ring:
            return None
        if not self._buffers:
            self._buffers = [
                [torch.empty((self.order.batch_size, *f.shape[1:]), dtype=f.dtype, device=self.device)
                 for f in self.fields]
                for _ in range(self.ring)
            ]
        return self._buffers[self._slot][k][:rows]

    def __iter__(self) -> Iterator[Any]:
        from lightning_fastdata.store import unflatten

        start = self._start()
        idx = self.order.indices().to(self.device, non_blocking=True)
        bs = self.order.batch_size
        for b in range(start, len(self)):
            sel = idx[b * bs:(b + 1) * bs]
            leaves = []
            for k, f in enumerate(self.fields):
                out = self._out(k, sel.numel())
                leaves.append(torch.index_select(f, 0, sel, out=out) if out is not None
                              else torch.index_select(f, 0, sel))
            if self.ring:
                self._slot = (self._slot + 1) % self.ring
            self._emit(b)
            yield unflatten(self.spec, leaves)


def _rows_per_chunk(row_nbytes: int, chunk_bytes: int, batch_size: int, max_rows: int) -> int:
    """Rows of one chunk: whole batches within ``chunk_bytes`` (at least one), at most ``max_rows`` rounded up."""
    rows = max(batch_size, (chunk_bytes // max(1, row_nbytes)) // batch_size * batch_size)
    return min(rows, max(1, math.ceil(max_rows / batch_size)) * batch_size)


class ChunkBuffers:
    """The chunked loader's memory, allocated once and reused for the whole run.

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
        row = sum(info.row_nbytes for info in store.infos)
        rows = _rows_per_chunk(row, chunk_bytes, batch_size, math.ceil(len(store) / max(1, world_size)))
        infos = [(info.shape, _torch_dtype(np.dtype(info.dtype))) for info in store.infos]
        return cls(infos, rows, batch_size, device, pin=pin)

    @property
    def nbytes(self) -> int:
        """Device bytes held (both slots, every field)."""
        return sum(t.nbytes for slot in self.slots for t in slot)

    @property
    def pinned(self) -> bool:
        """Whether the staging buffers are pinned (``False`` on the CPU, where there are none)."""
        return bool(self.staging) and all(t.is_pinned() for t in self.staging)


class ChunkedLoader(_Loader):
    """Batches streamed to the device chunk by chunk; chunk k+1 is loaded while chunk k is used.

    The store stays in host memory. A background thread gathers the next chunk's rows
    from the store (into the pinned staging buffer, then copied on a side CUDA stream;
    on the CPU straight into the idle buffer) while batches are cut from the current
    chunk. A chunk holds whole batches.

    Modes:
        ``global``: chunk k holds the next rows of the epoch's permutation, so batches are
            exactly those of :class:`DeviceLoader` for the same seed, epoch and rank.
        ``block``: for stores larger than host RAM. Contiguous blocks of one chunk's rows,
            in an order shuffled per epoch, are split into equal contiguous rank shards and
            shuffled within windows of ``window`` chunks: every sample once per epoch
            (DistributedSampler padding aside), reads stay local.

    Yielded batches are fresh tensors on CUDA. On the CPU they stay valid until
    ``ring - 1`` more have been drawn, as with :class:`DeviceLoader`: views of the chunk
    buffer (no copy) when a chunk holds more than ``ring - 1`` batches, else copies in a
    ring of ``ring`` preallocated buffers.

    Args:
        store: The host-resident store.
        order: The sample order.
        device: Training device (``"cpu"`` runs the same code with plain copies).
        chunk_bytes: Size of one buffer when ``buffers`` is not given.
        mode: ``"global"`` or ``"block"``.
        window: Chunks shuffled together in ``block`` mode.
        buffers: Preallocated :class:`ChunkBuffers` (from the placement); else allocated here.
        ring: Output ring on the CPU (0: every batch freshly allocated).
        pin: Pin the staging buffers when allocating them here.
    """

    def __init__(self, store: Store, order: ShardedOrder, device: torch.device | str = "cpu",
                 chunk_bytes: int = 64 << 20, mode: str = "global", window: int = 4,
                 buffers: ChunkBuffers | None = None, ring: int = 3, pin: bool = True) -> None:
        super().__init__(order)
        if mode not in ("global", "block"):
            raise ValueError(f"mode must be 'global' or 'block', got {mode!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        if len(store) != order.n:
            raise ValueError(f"the store has {len(store)} rows, the order expects {order.n}")
        if buffers is None:
            buffers = ChunkBuffers.for_store(store, device, chunk_bytes, order.batch_size,
                                             world_size=order.world_size, pin=pin)
        expected = [(info.shape, _torch_dtype(np.dtype(info.dtype))) for info in store.infos]
        if buffers.rows % order.batch_size or buffers.infos != expected:
            raise ValueError(f"buffers of {buffers.rows} rows with fields {buffers.infos} do not fit batches "
                             f"of {order.batch_size} with fields {expected}")
        self.store, self.spec, self.buffers = store, store.spec, buffers
        self.device = buffers.device
        self.mode, self.window = mode, window
        self.rows = buffers.rows
        self.sources = [_as_tensor(a) for a in store.fields]  # zero-copy views of the host arrays
        self.ring = ring if self.device.type == "cpu" else 0
        self._ring: list[list[torch.Tensor]] = []
        self._slot = 0
        self._executor: ThreadPoolExecutor | None = None
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._stream = torch.cuda.Stream(self.device)
            self._ready = [torch.cuda.Event(), torch.cuda.Event()]  # copy into slot done
            self._freed = [torch.cuda.Event(), torch.cuda.Event()]  # consumer done with slot
            self._staging_free: torch.cuda.Event | None = None

    # ------------------------------------------------------------------ order

    def indices(self, epoch: int | None = None) -> torch.Tensor:
        """This rank's sample indices for ``epoch`` in the order batches are cut."""
        if self.mode == "global":
            return self.order.indices(epoch)
        return self._block_indices(self.order.epoch if epoch is None else epoch)

    def _block_indices(self, epoch: int) -> torch.Tensor:
        o, rows = self.order, self.rows
        nblocks = math.ceil(o.n / rows)
        if o.shuffle:
            g = torch.Generator().manual_seed(derive_seed(o.seed, stream="block", epoch=epoch))
            blocks = torch.randperm(nblocks, generator=g)
        else:
            blocks = torch.arange(nblocks)
        order = torch.cat([torch.arange(b * rows, min(o.n, (b + 1) * rows)) for b in blocks.tolist()])
        total = o.num_samples * o.world_size
        if total > o.n:  # pad by repeating the first indices, as DistributedSampler does
            order = torch.cat([order, order.repeat(math.ceil((total - o.n) / o.n))[: total - o.n]])
        # Contiguous shards (not strided as in global mode) keep each rank's reads local.
        mine = order[o.rank * o.num_samples:(o.rank + 1) * o.num_samples].clone()
        if o.shuffle:
            span = rows * self.window
            for w, a in enumerate(range(0, mine.numel(), span)):
                g = torch.Generator().manual_seed(
                    derive_seed(o.seed, stream="block", rank=o.rank, epoch=epoch, step=w + 1))
                seg = mine[a:a + span]
                mine[a:a + span] = seg[torch.randperm(seg.numel(), generator=g)]
        if o.drop_last:
            mine = mine[: len(o) * o.batch_size]
        return mine

    # ------------------------------------------------------------------ loading

    def _load(self, slot: int, idx: torch.Tensor) -> None:
        """Gather rows ``idx`` of every field into buffer ``slot`` (runs in the loader thread)."""
        k = idx.numel()
        dst = self.buffers.slots[slot]
        if self.buffers.staging is None:
            for src, d in zip(self.sources, dst, strict=True):
                torch.index_select(src, 0, idx, out=d[:k])
            return
        if not self._cuda:
            for src, st, d in zip(self.sources, self.buffers.staging, dst, strict=True):
                torch.index_select(src, 0, idx, out=st[:k])
                d[:k].copy_(st[:k])
            return
        if self._staging_free is not None:
            self._staging_free.synchronize()  # the previous copy out of the staging buffer is done
        for src, st in zip(self.sources, self.buffers.staging, strict=True):
            torch.index_select(src, 0, idx, out=st[:k])
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            # Do not overwrite the slot before the consumer's work on its previous chunk ran.
            self._stream.wait_event(self._freed[slot])
            for st, d in zip(self.buffers.staging, dst, strict=True):
                d[:k].copy_(st[:k], non_blocking=True)
                # The buffer was allocated on the consumer's stream and is written on this
                # one: if it is freed (loader dropped mid-epoch), the allocator must wait
                # for this copy before reusing the memory.
                d.record_stream(self._stream)
            self._ready[slot].record(self._stream)
        self._staging_free = self._ready[slot]

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_fastdata-chunk")
        return self._executor

    def _out(self, k: int, view: torch.Tensor) -> torch.Tensor:
        if not self.ring:
            return view.clone()
        if not self._ring:
            self._ring = [[torch.empty((self.order.batch_size, *shape), dtype=dtype) for shape, dtype in
                           self.buffers.infos] for _ in range(self.ring)]
        return self._ring[self._slot][k][:view.shape[0]].copy_(view)

    def __iter__(self) -> Iterator[Any]:
        from lightning_fastdata.store import unflatten

        start = self._start()
        idx = self.indices()
        bs, per_chunk, n_batches = self.order.batch_size, self.rows // self.order.batch_size, len(self)
        n_chunks = math.ceil(n_batches / per_chunk)
        first = start // per_chunk
        pending: dict[int, Future] = {}

        def submit(c: int) -> None:
            pending[c] = self._pool().submit(self._load, c % 2, idx[c * self.rows:(c + 1) * self.rows])

        # On the CPU a batch is a view of its chunk, valid until ``ring - 1`` more batches
        # were drawn (as for DeviceLoader): the idle slot is refilled only after that many
        # batches of the new chunk went out. Chunks too short for that get copies.
        views = self.ring > 0 and per_chunk > self.ring - 1
        keep = self.ring - 1 if views else 0
        try:
            if first < n_chunks:
                submit(first)
            for c in range(first, n_chunks):
                lo, hi = max(c * per_chunk, start), min((c + 1) * per_chunk, n_batches)
                refill_at = max(c * per_chunk + keep, start) if c + 1 < n_chunks else -1
                if refill_at == lo:
                    submit(c + 1)  # its slot held chunk c - 1, which is done
                pending.pop(c).result()
                if self._cuda:
                    torch.cuda.current_stream(self.device).wait_event(self._ready[c % 2])
                chunk = self.buffers.slots[c % 2]
                for b in range(lo, hi):
                    if b == refill_at and b != lo:
                        submit(c + 1)
                    a = (b - c * per_chunk) * bs
                    rows = min(bs, idx.numel() - b * bs)
                    if views:
                        leaves = [f[a:a + rows] for f in chunk]
                    else:
                        leaves = [self._out(k, f[a:a + rows]) for k, f in enumerate(chunk)]
                        if self.ring:
                            self._slot = (self._slot + 1) % self.ring
                    self._emit(b)
                    yield unflatten(self.spec, leaves)
                if self._cuda:
                    self._freed[c % 2].record(torch.cuda.current_stream(self.device))
        finally:
            # Stopped early or failed: let in-flight loads finish before the buffers are reused,
            # and make the next refills wait for the consumer's reads already enqueued.
            wait(list(pending.values()))
            if self._cuda:
                for event in self._freed:
                    event.record(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        """Stop the loader thread (it is also stopped when the loader is garbage-collected)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def state_dict(self) -> dict[str, Any]:
        """As :meth:`_Loader.state_dict`, plus the mode (and, in block mode, what shapes the order)."""
        state = super().state_dict()
        state["mode"] = self.mode
        if self.mode == "block":
            state["chunk_rows"], state["window"] = self.rows, self.window
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume mid-epoch, mid-chunk included; refuses a checkpoint of another order."""
        mine = {"mode": self.mode, "chunk_rows": self.rows, "window": self.window}
        for key in ("mode",) + (("chunk_rows", "window") if self.mode == "block" else ()):
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"cannot resume this chunked loader: checkpoint has {key}={state[key]!r}, the loader has "
                    f"{key}={mine[key]!r}; resume with the configuration the checkpoint was made with"
                )
        super().load_state_dict(state)


class _StoreBatches(Dataset):
    """Map-style view of a store whose ``__getitems__`` gathers a whole batch (no per-sample collate)."""

    def __init__(self, store: Store) -> None:
        self.fields, self.spec = store.fields, store.spec

    def __len__(self) -> int:
        return int(self.fields[0].shape[0])

    def __getitem__(self, i: int) -> Any:
        return self.__getitems__([i])

    def __getitems__(self, indices: list[int]) -> Any:
        from lightning_fastdata.store import unflatten

        idx = np.asarray(indices, dtype=np.int64)
        return unflatten(self.spec, [_as_tensor(np.ascontiguousarray(a[idx])) for a in self.fields])


class _Transformed(Dataset):
    """The raw source with the static transform applied per sample (when nothing can be stored)."""

    def __init__(self, source: Any, transform: Callable[[Any], Any]) -> None:
        self.source, self.transform = source, transform

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> Any:
        return self.transform(self.source[i])


def _identity(batch: list[Any]) -> Any:
    return batch


class _BatchIndexSampler:
    """A batch sampler reading the owning loader's order; it runs in the main process."""

    def __init__(self, loader: WorkerLoader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader.order)

    def __iter__(self) -> Iterator[list[int]]:
        for sel in self.loader.order.batches(start=self.loader._first_batch):
            yield sel.tolist()


class WorkerLoader(_Loader):
    """The classic path: a ``torch.utils.data.DataLoader`` with worker processes.

    Over a store, each worker gathers whole batches from the memory-mapped fields (one
    fancy-index per field, no per-sample collate). Over a raw source (``store=None``), it
    runs ``dataset[i]`` (the static transform included) per sample and collates.

    Args:
        order: The sample order.
        store: The store to read, or ``None`` to read ``dataset``.
        dataset: A per-sample dataset, used when ``store`` is ``None``.
        num_workers, pin_memory, prefetch_factor, persistent_workers, worker_init_fn,
        multiprocessing_context: As for ``DataLoader``.
    """

    def __init__(self, order: ShardedOrder, store: Store | None = None, dataset: Any = None,
                 num_workers: int = 0, pin_memory: bool = False, prefetch_factor: int | None = None,
                 persistent_workers: bool = False, worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: str | None = None) -> None:
        super().__init__(order)
        if (store is None) == (dataset is None):
            raise ValueError("WorkerLoader needs exactly one of store= or dataset=")
        self._first_batch = 0
        ds = _StoreBatches(store) if store is not None else dataset
        self.dataloader = DataLoader(
            ds,
            batch_sampler=_BatchIndexSampler(self),
            collate_fn=_identity if store is not None else default_collate,
            num_workers=num_workers,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            persistent_workers=persistent_workers and num_workers > 0,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context if num_workers > 0 else None,
        )

    @property
    def num_workers(self) -> int:
        return self.dataloader.num_workers

    def close(self) -> None:
        """Stop worker processes now. Persistent workers otherwise live until the loader is
        garbage-collected, which the loader/sampler reference cycle delays to the next collection."""
        it = getattr(self.dataloader, "_iterator", None)
        stop = getattr(it, "_shutdown_workers", None)
        if stop is not None:
            stop()
        self.dataloader._iterator = None

    def __iter__(self) -> Iterator[Any]:
        self._first_batch = start = self._start()
        for b, batch in enumerate(self.dataloader, start):
            self._emit(b)
            yield batch
