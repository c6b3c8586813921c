"""The loaders: sample order, rank sharding, and the ``device`` and ``workers`` strategies.

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
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

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
    out = []
    for arr in store.fields:
        dst = _empty_huge(arr.shape, _torch_dtype(arr.dtype), device)
        rows = max(1, chunk_bytes // max(1, arr[0:1].nbytes))
        for a in range(0, arr.shape[0], rows):
            dst[a:a + rows].copy_(_as_tensor(arr[a:a + rows]))
        out.append(dst)
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
        return torch.empty(shape, dtype=dtype, device=device)
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

    def __iter__(self) -> Iterator[Any]:
        self._first_batch = start = self._start()
        for b, batch in enumerate(self.dataloader, start):
            self._emit(b)
            yield batch
