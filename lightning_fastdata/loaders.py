"""The loaders: sample order, rank sharding, and batches that carry their identity.

Every loader draws its order from :class:`ShardedOrder`, which reproduces
``torch.utils.data.DistributedSampler`` exactly (one permutation per epoch from
``seed + epoch`` (modulo 2**64), padded or truncated to equal shards, rank ``r`` takes every
``world_size``-th index). Switching strategy therefore never changes which samples a
rank sees, nor their order (:class:`BlockOrder`, for stores larger than host RAM, is the
documented exception).

Two loaders: :class:`IndexLoader` cuts the order into batches and gathers them from a
:mod:`~lightning_fastdata.placement` source (the ``device`` and ``chunked`` strategies);
:class:`WorkerLoader` runs a ``torch.utils.data.DataLoader`` with worker processes (the
``workers`` strategy). Both yield :class:`FastBatch`: the batch's fields plus the global
sample indices and the (epoch, batch index) that key its augmentation.

Loaders are plain iterables, not ``DataLoader`` subclasses, so Lightning does not wrap
them in a second ``DistributedSampler``; Lightning still reaches ``loader.sampler.set_epoch``
and, through ``state_dict``/``load_state_dict``, checkpoints their position.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import queue
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from lightning_fastdata import distributed as D
from lightning_fastdata._lightning import shutdown_dataloader_workers
from lightning_fastdata.augment_base import StoreRows
from lightning_fastdata.placement import DeviceSource, HostSource, Source, as_tensor
from lightning_fastdata.ragged import RaggedArray, RaggedBatch, gather_host
from lightning_fastdata.seeding import derive_seed, new_worker_pass
from lightning_fastdata.structure import tuple_spec, unflatten, unique_names


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
        pad: Pad the shards to equal lengths (``DistributedSampler``); False gives every sample
            to exactly one rank, shards differing by one sample at most (prediction, as
            Lightning's ``UnrepeatedDistributedSamplerWrapper``). Needs ``drop_last=False``.
    """

    def __init__(self, n: int, batch_size: int, shuffle: bool = True, drop_last: bool = False,
                 seed: int = 0, rank: int = 0, world_size: int = 1, pad: bool = True) -> None:
        if n <= 0:
            raise ValueError(f"n must be > 0, got {n}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
        if drop_last and n < world_size:
            raise ValueError(f"drop_last with {n} samples over {world_size} ranks leaves nothing to load")
        if not pad and drop_last:
            raise ValueError("pad=False keeps every sample once; it needs drop_last=False")
        self.n, self.batch_size, self.shuffle, self.drop_last = n, batch_size, shuffle, drop_last
        self.seed, self.rank, self.world_size, self.pad = seed, rank, world_size, pad
        self.epoch = 0
        if not pad:
            self.num_samples = n // world_size + (rank < n % world_size)
        elif drop_last and n % world_size:
            self.num_samples = math.ceil((n - world_size) / world_size)
        else:
            self.num_samples = math.ceil(n / world_size)

    #: When True, :meth:`set_epoch` keeps epoch 0: an evaluation outside a fit (``trainer.test``,
    #: ``predict``, ``validate``), whose order and augmentation keys must not depend on how many
    #: epochs the Trainer fitted before (Lightning sets its fit progress on those loaders too).
    held = False

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose permutation the next iteration uses (ignored while :attr:`held`)."""
        if not self.held:
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
            g.manual_seed((self.seed + epoch) % 2**64)  # a seed near 2**64 would overflow torch's seed
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        if not self.pad:
            return order[self.rank::self.world_size]
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

    def identity(self) -> dict[str, Any]:
        """The shape of the order, which a checkpoint's must match to resume from a batch position.

        The seed and shuffling are not part of it: a run resumed with another seed goes on
        from the same position of its own order (the data module warns about the change).
        """
        return {"n": self.n, "batch_size": self.batch_size, "world_size": self.world_size, "mode": "global"}

    def batches(self, epoch: int | None = None, start: int = 0) -> Iterator[torch.Tensor]:
        """Index tensors of this rank's batches, from batch ``start``."""
        idx = self.indices(epoch)
        for b in range(start, len(self)):
            yield idx[b * self.batch_size:(b + 1) * self.batch_size]


class BlockOrder(ShardedOrder):
    """For stores larger than host RAM: contiguous blocks in a shuffled order, shuffled within windows.

    Contiguous blocks of ``rows`` samples, in an order shuffled per epoch, are split into
    equal contiguous rank shards (not strided: each rank's reads stay local) and shuffled
    within windows of ``window`` blocks: every sample once per epoch (DistributedSampler
    padding aside). The batches differ from :class:`ShardedOrder`'s; the augmentation of a
    sample does not (it is keyed by the sample).

    Args:
        n, batch_size, shuffle, drop_last, seed, rank, world_size: As :class:`ShardedOrder`.
        rows: Samples per block (the chunk size of the chunked source).
        window: Blocks shuffled together.
    """

    def __init__(self, n: int, batch_size: int, rows: int, window: int = 4, **kwargs: Any) -> None:
        super().__init__(n, batch_size, **kwargs)
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an int >= 1, got {rows!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        self.rows, self.window = rows, window

    def indices(self, epoch: int | None = None) -> torch.Tensor:
        epoch = self.epoch if epoch is None else epoch
        rows = self.rows
        nblocks = math.ceil(self.n / rows)
        if self.shuffle:
            g = torch.Generator().manual_seed(derive_seed(self.seed, stream="block", epoch=epoch))
            blocks = torch.randperm(nblocks, generator=g)
        else:
            blocks = torch.arange(nblocks)
        order = torch.cat([torch.arange(b * rows, min(self.n, (b + 1) * rows)) for b in blocks.tolist()])
        if self.pad:
            total = self.num_samples * self.world_size
            if total > self.n:  # pad by repeating the first indices, as DistributedSampler does
                order = torch.cat([order, order.repeat(math.ceil((total - self.n) / self.n))[: total - self.n]])
            first = self.rank * self.num_samples
        else:  # contiguous shards of n // world_size samples, the first n % world_size one longer
            first = self.rank * (self.n // self.world_size) + min(self.rank, self.n % self.world_size)
        mine = order[first:first + self.num_samples].clone()
        if self.shuffle:
            span = rows * self.window
            for w, a in enumerate(range(0, mine.numel(), span)):
                g = torch.Generator().manual_seed(
                    derive_seed(self.seed, stream="block", rank=self.rank, epoch=epoch, step=w + 1))
                seg = mine[a:a + span]
                mine[a:a + span] = seg[torch.randperm(seg.numel(), generator=g)]
        if self.drop_last:
            mine = mine[: len(self) * self.batch_size]
        return mine

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "mode": "block", "chunk_rows": self.rows, "window": self.window}


_WARNED_PENDING = False


class FastBatch:
    """A batch plus what it is: the global indices of its samples and its place in the epoch.

    The datamodule's ``on_after_batch_transfer`` keys the augmentation of every sample by
    ``(seed, epoch, indices[i])`` from these attributes, never from loader state, so a
    batch that arrives late, early or on another rank is augmented the same.

    Iterating or indexing a ``FastBatch`` reaches the sample structure (``x, y = batch``).

    Attributes:
        leaves: One batched value per field: tensors, a
            :class:`~lightning_fastdata.ragged.RaggedBatch` for a ragged field (values on
            the batch's device, offsets and shapes on the CPU); raw sources may hold other
            objects.
        spec: The sample structure (see :func:`~lightning_fastdata.structure.flatten`).
        names: Field names, one per leaf ("0", "1", or dict keys).
        indices: Global sample indices, int64, on the batch's device.
        epoch: The epoch the batch belongs to.
        index: The batch's index within the epoch.
    """

    __slots__ = ("leaves", "spec", "names", "indices", "epoch", "index", "prepared", "pending", "split", "loader")

    def __init__(self, leaves: list[Any], spec: dict, names: list[str], indices: torch.Tensor, epoch: int,
                 index: int, prepared: bool = False) -> None:
        if len(leaves) != len(names):
            raise ValueError(f"{len(leaves)} leaves for {len(names)} field names {names}")
        self.leaves, self.spec, self.names = leaves, spec, names
        self.indices, self.epoch, self.index = indices, epoch, index
        self.prepared = prepared  # already augmented by the loader (see IndexLoader's prepare)
        #: Its data module's augmentation is still to run (in ``on_after_batch_transfer``).
        self.pending = False
        #: The split of the loader it came from (set by the data module's loaders), or None.
        self.split: str | None = None
        #: The loader that handed it out (which counts it as used, for resuming), or None.
        self.loader: _Loader | None = None

    @classmethod
    def of(cls, structure: Any, indices: torch.Tensor, epoch: int = 0, index: int = 0) -> FastBatch:
        """A batch from a sample structure of batched values (e.g. ``(images, labels)``)."""
        spec, names, leaves = flatten_batch(structure)
        return cls(leaves, spec, names, indices, epoch, index)

    def __len__(self) -> int:
        """Samples in the batch."""
        return int(self.indices.numel())

    def structure(self) -> Any:
        """The batch in the sample's structure (tuple, dict, ...)."""
        return unflatten(self.spec, self.leaves)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> FastBatch:
        """The same batch with every tensor on ``device`` (Lightning's transfer calls this).

        A ragged field moves its values only; its offsets and shapes stay on the CPU.
        """
        leaves = [v.to(device, non_blocking=non_blocking) if isinstance(v, (torch.Tensor, RaggedBatch)) else v
                  for v in self.leaves]
        return self.with_leaves(leaves, self.indices.to(device, non_blocking=non_blocking))

    def with_leaves(self, leaves: list[Any], indices: torch.Tensor | None = None) -> FastBatch:
        """The same batch (structure, samples, loader, state) holding ``leaves`` (and ``indices``)."""
        out = FastBatch(leaves, self.spec, self.names, self.indices if indices is None else indices, self.epoch,
                        self.index, self.prepared)
        out.pending, out.split, out.loader = self.pending, self.split, self.loader
        return out

    def __iter__(self) -> Iterator[Any]:
        self._warn_pending()
        return iter(self.structure())

    def __getitem__(self, key: Any) -> Any:
        self._warn_pending()
        return self.structure()[key]

    def _warn_pending(self) -> None:
        """Unpacking a batch whose augmentation has not run yet hands out raw samples: say so, once."""
        global _WARNED_PENDING
        if self.pending and not _WARNED_PENDING:
            _WARNED_PENDING = True
            warnings.warn(
                "lightning_fastdata: a batch of an OptimizedDataModule's loader was unpacked before its augmentation "
                "ran, so it holds the samples unaugmented: the data module's on_after_batch_transfer did not see it "
                "(its loader used by a Trainer the data module was not given to, or by a training_step that takes a "
                "dataloader_iter). Pass the data module to the Trainer, or call "
                "`batch = datamodule.augment_batch(batch.to(device))` first.", stacklevel=3)

    def __repr__(self) -> str:
        return (f"FastBatch(epoch={self.epoch}, index={self.index}, samples={len(self)}, "
                f"fields={self.names}, prepared={self.prepared})")


def flatten_batch(batch: Any) -> tuple[dict, list[str], list[Any]]:
    """``(spec, names, leaves)`` of a collated batch, in the store's leaf order and naming."""
    names: list[str] = []
    leaves: list[Any] = []

    def walk(node: Any, path: str) -> dict:
        if isinstance(node, (tuple, list)) and not (node and isinstance(node[0], str)):
            items = [walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(node)]
            return tuple_spec(node, {"kind": "tuple" if isinstance(node, tuple) else "list", "items": items})
        if isinstance(node, dict):
            keys = list(node)
            items = [walk(node[k], f"{path}.{k}" if path else str(k)) for k in keys]
            return {"kind": "dict", "keys": keys, "items": items}
        names.append(path or "0")
        leaves.append(node)
        return {"kind": "leaf", "field": len(leaves) - 1}

    spec = walk(batch, "")
    unique_names(names, "the batch")
    return spec, names, leaves


class ResumeError(ValueError):
    """A checkpoint's loader position that this loader cannot go on from (another batch size,
    world size, shuffle or chunking in the middle of an epoch)."""


class _Loader:
    """Shared machinery: order, epoch, resumable position.

    The consumer that knows when a batch is actually used (the datamodule's
    ``on_after_batch_transfer``) reports it with :meth:`consumed`; ``state_dict`` then
    counts consumed batches, not those a prefetcher pulled ahead. Otherwise it counts
    yielded batches.
    """

    #: The stored fields it reads (its teardown checks ``dropped``), or None (a raw dataset).
    source: Source | None = None

    def __init__(self, order: ShardedOrder) -> None:
        self.order = order
        #: Iterations running (a generator suspended mid-epoch counts until it is closed).
        self._running = 0
        #: Those iterations, each with the tag ``iteration_tag`` gave when it started, to close
        #: one its loop left unfinished (see ``close_iterations``).
        self._live: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        #: Set by the data module: what an iteration starting now is for (a Trainer's validation
        #: run inside a fit), or None.
        self.iteration_tag: Callable[[], Any] | None = None
        #: Set by the data module: its augmentation runs after the transfer, not in this loader;
        #: the batches handed out say so (``FastBatch.pending``).
        self.augmented_later = False
        #: Set by the data module: the split its batches belong to (``FastBatch.split``).
        self.split: str | None = None
        self._yielded = 0
        self._consumed = 0
        self._counted_epoch = order.epoch  # the epoch the two counts above belong to
        self._tracking = False
        self._resume: tuple[int, int] | None = None
        self._resume_total: int | None = None  # batches in the checkpoint's epoch (its own configuration)
        #: Set by the data module on resume: the training loader's ``(epoch, batch, batches)`` its
        #: checkpoint recorded. Lightning restores a loader's position only when it resumes inside
        #: that epoch; from where ``max_steps`` stopped it may go on with the next epoch without
        #: a word, and this tells the first iteration what that skips.
        self.resume_hint: tuple[int, int, int] | None = None
        #: Set by the data module: ``(epoch, batches transferred whose step has not finished)``
        #: from the Trainer's own progress, or None outside a fit. A checkpoint saved while a
        #: step is in flight (an exception, a preemption signal) must not count that batch as
        #: used: the Trainer replays it on resume.
        self.steps_in_flight: Callable[[], tuple[int, int] | None] | None = None
        #: Set by the data module: the batches a training epoch runs (``limit_train_batches``
        #: applied), or None; tells an epoch the checkpoint left unfinished from a limited one.
        self.epoch_batches: Callable[[], int | None] | None = None
        #: Set by the data module on a prediction loader: where each yielded batch's sample
        #: indices are recorded for Lightning's prediction writers (see ``batch_sampler``).
        self.index_record: Any = None

    @property
    def active(self) -> int:
        """Iterations under way: those running and those handed out but not started yet.

        A loop takes its iterator before the first batch (a training CombinedLoader holding the
        val loader, before the val loop asks for its own): one not yet started is in use too,
        and must not be closed as idle (its first ``next`` would end it at once).
        """
        created = sum(inspect.getgeneratorstate(it) == inspect.GEN_CREATED for it in list(self._live))
        return self._running + created

    @property
    def sampler(self) -> ShardedOrder:
        """The order object; Lightning calls ``set_epoch`` on a loader's ``sampler``."""
        return self.order

    def __iter__(self) -> Iterator[FastBatch]:
        if self.source is not None and self.source.dropped:
            # Its fields were emptied to free the memory: a batch would come out with no fields.
            split, again = (f"{self.split} ", f"call {self.split}_dataloader()") if self.split else ("", "ask")
            raise RuntimeError(
                f"this {split}loader's data was released by its data module's teardown (the end of the "
                f"stage that set it up): run setup(stage) again and {again} for a new loader")
        it = self._iterate()
        self._live[it] = self.iteration_tag() if self.iteration_tag is not None else None
        return it

    def _iterate(self) -> Iterator[FastBatch]:
        raise NotImplementedError

    def close_iterations(self, tag: Any = None) -> None:
        """Close the iterations under way that started with ``tag`` (every one when None): the
        background thread and the batches it holds ready (``ahead``), or the workers of a
        non-persistent loader, are freed now, not when the loop that abandoned the iteration
        starts again (Lightning keeps a validation run's iterator, cut short by
        ``limit_val_batches`` or the sanity check, until the next one)."""
        for it, started in list(self._live.items()):
            if tag is None or started == tag:
                it.close()

    @property
    def batch_sampler(self) -> Any:
        """``None``: batches are formed by the loader itself (Lightning probes this). A prediction
        loader's is the record of each yielded batch's sample indices, which Lightning hands
        to prediction writers as ``batch_indices``."""
        return self.index_record

    def _noting(self, epoch: int, idx: torch.Tensor | None = None) -> Callable[[int], None] | None:
        """Start recording the sample indices of the batches yielded from now (prediction), or None.

        ``idx``: the epoch's indices when the caller has them already."""
        record = self.index_record
        if record is None:
            return None
        record.seen_batch_indices = []
        idx = self.order.indices(epoch) if idx is None else idx
        bs = self.order.batch_size

        def note(b: int) -> None:
            record.seen_batch_indices.append(idx[b * bs:(b + 1) * bs].tolist())
        return note

    @property
    def epoch(self) -> int:
        return self.order.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next iteration."""
        self.order.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.order)

    def consumed(self, batch: FastBatch) -> None:
        """Count ``batch`` (and every batch before it in its epoch) as used."""
        self._tracking = True
        if batch.epoch == self.order.epoch == self._counted_epoch:
            self._consumed = max(self._consumed, batch.index + 1)

    def _start(self) -> int:
        start = 0
        hint, self.resume_hint = self.resume_hint, None
        if self._resume is not None:
            epoch, start = self._resume
            self._resume = None
            if epoch != self.order.epoch:
                self._warn_skipped(epoch, start, numbered_from=True)
                start = 0
        elif hint is not None and hint[0] < self.order.epoch:
            self._resume_total = hint[2]
            self._warn_skipped(hint[0], hint[1])
        self._yielded = self._consumed = start
        self._counted_epoch = self.order.epoch
        return start

    def _warn_skipped(self, epoch: int, batch: int, numbered_from: bool = False) -> None:
        """The Trainer resumed into another epoch than the checkpoint's position: say what is never seen.

        Lightning does so from a checkpoint saved where ``max_steps`` stopped inside an epoch:
        resumed under ``max_steps`` it restores this loader into the next epoch and numbers
        that epoch's batches from the stopped position (``numbered_from``: it then ends the
        epoch early); under ``max_epochs`` it counts the epoch as done and restores nothing
        (the data module's ``resume_hint`` tells). With a plain DataLoader it warns, but not
        for a loader that restores its position.
        """
        total = self._resume_total if self._resume_total is not None else len(self.order)
        limit = self.epoch_batches() if self.epoch_batches is not None else None
        if limit is not None:
            total = min(total, limit)
        skipped = []
        if batch < total:
            skipped.append(f"batches {batch} to {total - 1} of epoch {epoch}")
        if self.order.epoch > epoch + 1:
            gap = self.order.epoch - epoch - 1
            skipped.append(f"epoch{'s' if gap > 1 else ''} {epoch + 1}"
                           + (f" to {self.order.epoch - 1}" if gap > 1 else ""))
        if numbered_from and 0 < batch < total and self.order.epoch == epoch + 1:
            skipped.append(f"batches {total - batch} to {total - 1} of epoch {self.order.epoch} (Lightning numbers its "
                           f"batches from {batch} and ends it after {total - batch})")
        if skipped and D.rank() == 0:  # every rank skips the same batches of its shard: say it once
            warnings.warn(
                f"lightning_fastdata: the checkpoint's training loader stopped at batch {batch} of {total} of "
                f"epoch {epoch}, but the Trainer goes on with epoch {self.order.epoch}, so {' and '.join(skipped)} "
                "are never seen (Lightning does this on resuming from where max_steps stopped inside an epoch). "
                "For the batches of an uninterrupted run, resume from a checkpoint saved at an epoch's end, or "
                "stop with max_epochs", UserWarning, stacklevel=3
            )

    def _position(self) -> tuple[int, int]:
        """(epoch, batches used in it) as a checkpoint must record them."""
        if self._resume is not None:
            return self._resume  # restored, not iterated yet: still the checkpoint's position
        epoch = self.order.epoch
        if self._counted_epoch != epoch:
            return epoch, 0  # a new epoch was selected and no batch of it has been used yet
        used = self._consumed if self._tracking else self._yielded
        pending = self.steps_in_flight() if self.steps_in_flight is not None and self._tracking else None
        if pending is not None and pending[0] == epoch:
            used = max(0, used - pending[1])
        return epoch, used

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from: epoch and batches consumed, plus what must match."""
        epoch, used = self._position()
        return {"epoch": epoch, "batch": used, "batches": len(self.order), "seed": self.order.seed,
                "shuffle": self.order.shuffle, **self.order.identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration of ``state['epoch']`` starts at batch ``state['batch']``."""
        mine = self.order.identity()
        state = {"mode": "global", **state}
        total = state.get("batches")
        # Saved at its epoch's end, the position replays nothing: another batch size or world size
        # (which a mid-epoch position cannot follow) is fine there.
        done = total is not None and int(state["batch"]) >= int(total)
        for key, value in mine.items():
            if not done and key in state and state[key] != value:
                why = ("; in block mode the sample order follows the chunk size, which the plan takes from this "
                       "machine's free host memory: resume where as much memory is free") if key == "chunk_rows" else ""
                raise ResumeError(
                    f"cannot resume this loader: checkpoint has {key}={state[key]!r}, the loader has "
                    f"{key}={value!r}; resume with the configuration the checkpoint was made with{why}, resume from "
                    "a checkpoint saved at an epoch's end (any configuration goes on from there), or restart the "
                    "epoch with the new one: load only the checkpoint's weights (the model's load_from_checkpoint), "
                    "not its loop state"
                )
        self.order.set_epoch(int(state["epoch"]))
        self._resume = (int(state["epoch"]), int(state["batch"]))
        self._resume_total = int(total) if total is not None else None


class IndexLoader(_Loader):
    """Batches gathered by index from a source (the ``device`` and ``chunked`` strategies).

    With ``ahead > 0`` a background thread gathers (and ``prepare``s, e.g. augments) the
    next batches while the training step runs: on the CPU torch's kernels release the GIL,
    so the two overlap on two cores; on CUDA the thread enqueues its work on a side stream
    and the consumer's stream waits for it on an event, never the host. At most ``ahead``
    batches are ready and waiting. The resume position still counts consumed batches only.

    Args:
        source: Where the fields live (see :mod:`~lightning_fastdata.placement`).
        order: The sample order (a :class:`BlockOrder` for a chunked source in block mode).
        spec: The sample structure.
        names: Field names, one per field of the source.
        prepare: Applied to every batch before it is handed out (in the background thread
            when ``ahead > 0``); must return a :class:`FastBatch`.
        ahead: Batches prepared ahead in a background thread; 0 prepares each batch when it
            is asked for, in the caller's thread.
        defer: Positions of the fields ``prepare`` receives as
            :class:`~lightning_fastdata.augment_base.StoreRows` (the whole field and the
            batch's rows) instead of gathered: a ``prepare`` that starts with a crop cuts the
            windows from the store directly. A :class:`~lightning_fastdata.placement.DeviceSource`
            and a ``prepare`` are needed; ``prepare`` must return gathered values.
    """

    def __init__(self, source: Source, order: ShardedOrder, spec: dict, names: list[str],
                 prepare: Callable[[FastBatch], FastBatch] | None = None, ahead: int = 0,
                 defer: frozenset[int] = frozenset()) -> None:
        super().__init__(order)
        if source.n != order.n:
            raise ValueError(f"the source has {source.n} rows, the order expects {order.n}")
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise ValueError(f"ahead must be an int >= 0, got {ahead!r}")
        defer = frozenset(defer)
        if defer:
            if prepare is None:
                raise ValueError("defer needs a prepare that gathers the deferred rows (StoreRows) it is given")
            allowed = source.deferrable() if isinstance(source, DeviceSource) else frozenset()
            if not defer <= allowed:
                raise ValueError(f"defer names fields {sorted(defer - allowed)} that this {source.kind} source "
                                 f"cannot hand out as rows (it can: {sorted(allowed)})")
        self.source, self.spec, self.names = source, spec, names
        self.prepare, self.ahead, self.defer = prepare, ahead, defer
        self.device = source.device

    def indices(self, epoch: int | None = None) -> torch.Tensor:
        """This rank's sample indices for ``epoch``, in the order batches are cut."""
        return self.order.indices(epoch)

    def _produce(self, start: int) -> Iterator[FastBatch]:
        epoch, prepare = self.order.epoch, self.prepare
        extra = {"defer": self.defer} if self.defer else {}
        batches = self.source.batches(self.order.indices(), self.order.batch_size, start, **extra)
        try:
            for b, (leaves, sel) in enumerate(batches, start):
                batch = FastBatch(leaves, self.spec, self.names, sel, epoch, b)
                if prepare is None:
                    yield batch
                    continue
                out = prepare(batch)
                if self.defer:  # rows a prepare left untouched are gathered: none leave the loader
                    out.leaves = [v.gather() if isinstance(v, StoreRows) else v for v in out.leaves]
                yield out
        finally:
            batches.close()  # the source's finally runs here, in the producing thread

    def _iterate(self) -> Iterator[FastBatch]:
        start = self._start()
        note = self._noting(self.order.epoch)
        produced = self._produce(start)
        if self.ahead:
            produced = _run_ahead(produced, self.ahead, self.device)
        self._running += 1
        try:
            for batch in produced:
                self._yielded = batch.index + 1
                batch.pending = self.augmented_later and not batch.prepared
                batch.split, batch.loader = self.split, self
                if note is not None:
                    note(batch.index)
                yield batch
        finally:
            self._running -= 1
            produced.close()

    def close(self) -> None:
        """Stop the iterations under way and the source's background work (restarted when
        iterated again). An iteration a failed loop still holds (an error in
        ``validation_step``) would otherwise keep its ``ahead`` thread and ready batches."""
        self.close_iterations()
        self.source.close()


_DONE = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _leaf_tensors(leaf: Any) -> Iterator[torch.Tensor]:
    """Every tensor a batch leaf holds: itself, a ragged field's values, or the items of a list,
    tuple or dict (a ragged field augmented without a size-fixing op stays a list of
    per-sample tensors, views of its values or freshly decoded images)."""
    if isinstance(leaf, torch.Tensor):
        yield leaf
    elif isinstance(leaf, RaggedBatch):
        yield leaf.values
    elif isinstance(leaf, (list, tuple)):
        for item in leaf:
            yield from _leaf_tensors(item)
    elif isinstance(leaf, dict):
        for item in leaf.values():
            yield from _leaf_tensors(item)


def _run_ahead(batches: Iterator[FastBatch], depth: int, device: torch.device) -> Iterator[FastBatch]:
    """Iterate ``batches`` in a background thread, at most ``depth`` ready batches ahead of the consumer."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    cuda = device.type == "cuda"
    side = torch.cuda.Stream(device) if cuda else None

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
                for batch in batches:
                    event = None
                    if cuda:
                        event = torch.cuda.Event()
                        event.record(side)
                    if not put((batch, event)):
                        return
            put((_DONE, None))
        except BaseException as e:  # handed to the consumer, raised there
            put((_Failure(e), None))
        finally:
            batches.close()

    thread = threading.Thread(target=work, name="lightning_fastdata-ahead", daemon=True)
    thread.start()
    try:
        while True:
            item, event = ready.get()
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.error
            if event is not None:
                current = torch.cuda.current_stream(device)
                current.wait_event(event)  # the device waits, not the host
                for t in _leaf_tensors([*item.leaves, item.indices]):
                    if t.is_cuda:
                        # Made on the side stream, used on this one: the allocator must not
                        # reuse the memory before this stream's work on it is done.
                        t.record_stream(current)
            yield item
    finally:
        stop.set()
        thread.join()


class _Rows(list):
    """A batch's sample indices, with the epoch and batch index they belong to (what keys its augmentation)."""

    def __init__(self, rows: list[int], epoch: int, index: int) -> None:
        super().__init__(rows)
        self.epoch, self.index = epoch, index


class _HostBatches(Dataset):
    """Map-style view of host fields whose ``__getitems__`` gathers a whole batch (no per-sample collate).

    A ragged field's rows come as a :class:`~lightning_fastdata.ragged.RaggedBatch`, which
    the identity collate passes through (and DataLoader's pinning pins its values). With a
    ``prepare``, the worker also hands the batch to it (e.g. decodes and augments it, keyed
    by the samples' indices) and sends back the prepared :class:`FastBatch`.
    """

    #: It draws no random numbers (``seeding.randomness_repeats`` reads this): the augmentation
    #: it may run is keyed by the samples, not by a generator.
    draws_randomness = False

    def __init__(self, source: HostSource, spec: dict | None = None, names: list[str] | None = None,
                 prepare: Callable[[FastBatch], FastBatch] | None = None) -> None:
        self.arrays, self.spec, self.names, self.prepare = source.arrays, spec, names, prepare

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __getitem__(self, i: int) -> Any:
        return self.__getitems__([i])

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor | RaggedBatch] | FastBatch:
        idx = np.asarray(indices, dtype=np.int64)
        leaves = [gather_host(a, idx) if isinstance(a, RaggedArray) else as_tensor(np.ascontiguousarray(a[idx]))
                  for a in self.arrays]
        if self.prepare is None or not isinstance(indices, _Rows):
            return leaves
        batch = FastBatch(leaves, self.spec, self.names, torch.from_numpy(idx), indices.epoch, indices.index)
        return self.prepare(batch)


def prepared_row_nbytes(source: HostSource, spec: dict, names: list[str],
                        prepare: Callable[[FastBatch], FastBatch], row: int = 0) -> list[int]:
    """Bytes of each field of sample ``row`` as a DataLoader worker sends it, gathered and
    ``prepare``d (``Normalize`` to float32 makes 4x the stored uint8 row, a JPEG's decoding
    many times its bytes)."""
    out = _HostBatches(source, spec, names, prepare).__getitems__(_Rows([row], 0, 0))
    return [sum(t.nbytes for t in _leaf_tensors(leaf)) for leaf in out.leaves]


class _Transformed(Dataset):
    """The raw source with the static transform applied per sample (when nothing can be stored)."""

    def __init__(self, source: Any, transform: Callable[[Any], Any]) -> None:
        self.source, self.transform = source, transform

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> Any:
        return self.transform(self.source[i])


def transformed(source: Any, transform: Callable[[Any], Any]) -> Dataset:
    """A per-sample dataset: ``transform(source[i])``."""
    return _Transformed(source, transform)


def _identity(batch: list[Any]) -> Any:
    return batch


class _BatchIndexSampler:
    """A batch sampler reading the owning loader's order; it runs in the main process."""

    def __init__(self, loader: WorkerLoader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader.order)

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start = self.loader.iter_epoch, self.loader.iter_start
        # Here, at the first draw, persistent workers are done with the last pass: they reseed for this one.
        new_worker_pass(self.loader.dataloader)
        for b, sel in enumerate(self.loader.order.batches(epoch=epoch, start=start), start):
            yield _Rows(sel.tolist(), epoch, b)


class WorkerLoader(_Loader):
    """The classic path: a ``torch.utils.data.DataLoader`` with worker processes.

    Over host fields, each worker gathers whole batches (one fancy-index per field, no
    per-sample collate). Over a raw source (``source=None``), it runs ``dataset[i]`` (the
    static transform included) per sample and collates.

    Args:
        order: The sample order.
        source: The host fields to read, or ``None`` to read ``dataset``.
        spec: The sample structure of ``source``'s fields (required with ``source``).
        names: Field names of ``source``'s fields (required with ``source``).
        dataset: A per-sample dataset, used when ``source`` is ``None``.
        prepare: With ``source``: applied to each batch inside the worker that gathers it
            (must be picklable for spawned workers); the batch then arrives prepared.
        num_workers, pin_memory, prefetch_factor, persistent_workers, worker_init_fn,
        multiprocessing_context: As for ``DataLoader``.
    """

    def __init__(self, order: ShardedOrder, source: HostSource | None = None, spec: dict | None = None,
                 names: list[str] | None = None, dataset: Any = None,
                 prepare: Callable[[FastBatch], FastBatch] | None = None, num_workers: int = 0,
                 pin_memory: bool = False, prefetch_factor: int | None = None, persistent_workers: bool = False,
                 worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: str | None = None) -> None:
        super().__init__(order)
        if (source is None) == (dataset is None):
            raise ValueError("WorkerLoader needs exactly one of source= or dataset=")
        if source is not None and (spec is None or names is None):
            raise ValueError("WorkerLoader over a source needs its spec= and names=")
        self.spec, self.names = spec, names
        self.iter_epoch, self.iter_start = 0, 0
        if prepare is not None and source is None:
            raise ValueError("WorkerLoader's prepare= needs source= (a raw dataset's samples are collated first)")
        self.source = source
        ds = _HostBatches(source, spec, names, prepare) if source is not None else dataset
        self.dataloader = DataLoader(
            ds,
            batch_sampler=_BatchIndexSampler(self),
            collate_fn=_identity if source is not None else default_collate,
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
        """Stop the iterations under way and the worker processes now. Persistent workers
        otherwise live until the loader is garbage-collected, which the loader/sampler
        reference cycle delays to the next collection; a non-persistent iteration a failed
        loop still holds (an error in ``validation_step``) keeps its own workers."""
        self.close_iterations()
        shutdown_dataloader_workers(self.dataloader)

    def _iterate(self) -> Iterator[FastBatch]:
        start = self._start()
        epoch = self.iter_epoch = self.order.epoch
        self.iter_start = start
        idx = self.order.indices(epoch)
        bs = self.order.batch_size
        note = self._noting(epoch, idx)
        self._running += 1
        try:
            yield from self._batches(start, epoch, idx, bs, note)
        finally:
            self._running -= 1

    def _batches(self, start: int, epoch: int, idx: torch.Tensor, bs: int,
                 note: Callable[[int], None] | None) -> Iterator[FastBatch]:
        for b, batch in enumerate(self.dataloader, start):
            if note is not None:
                note(b)
            if isinstance(batch, FastBatch):  # prepared in the worker
                self._yielded = b + 1
                batch.split, batch.loader = self.split, self
                yield batch
                continue
            if self.spec is not None:
                spec, names, leaves = self.spec, self.names, batch
            else:
                spec, names, leaves = flatten_batch(batch)
            self._yielded = b + 1
            out = FastBatch(leaves, spec, names, idx[b * bs:(b + 1) * bs], epoch, b)
            out.pending, out.split, out.loader = self.augmented_later, self.split, self
            yield out
