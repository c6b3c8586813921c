"""Seeds: one derivation for every random stream, and the seeding of DataLoader workers.

Every random stream of the package comes from :func:`derive_seed`, built on numpy's
``SeedSequence`` so nearby keys (rank 0 vs 1, epoch 3 vs 4) give statistically
independent streams, not shifted copies of one another.

:class:`WorkerSeeding` is a ``worker_init_fn`` that seeds python ``random``, numpy and
torch in each worker from (seed, split, global rank, worker id, epoch), then calls the
user's own ``worker_init_fn``. The split (``"train"``, ``"val"`` ...) keeps the workers of
the training and the evaluation loaders apart: without it, worker 0 of the validation
loader would replay the draws of worker 0 of the training loader in the same epoch.
The epoch lives in a shared-memory tensor that the main process writes (``set_epoch``) and
every worker reads, so persistent workers, which are started once, still reseed at their
first fetch of each new epoch. Next to it, a pass counter that the main process bumps when
an iteration of the loader starts (:meth:`WorkerSeeding.new_pass`) makes them reseed at
every pass, too: two validation runs of one epoch draw the same numbers, whatever ran
before them and whether or not the workers persist.
"""

from __future__ import annotations

import os
import random
import warnings
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_fastdata import _lightning as door

#: Stream tags keep the augmentation, shuffling and worker streams apart even when
#: their other keys coincide.
STREAMS = {"augment": 1, "worker": 2, "order": 3, "block": 4, "worker-unset-epoch": 5}


def derive_seed(
    seed: int,
    *,
    stream: str = "augment",
    rank: int = 0,
    worker: int = 0,
    epoch: int = 0,
    step: int = 0,
) -> int:
    """Derive a reproducible 63-bit seed from a base seed and the position of a stream.

    Args:
        seed: The user's base seed (any non-negative int).
        stream: What the seed is for; one of :data:`STREAMS` or any other name.
        rank: Global rank of the process.
        worker: DataLoader worker id (0 in the main process).
        epoch: Epoch number.
        step: Batch index within the epoch.

    Returns:
        An int in ``[0, 2**63)``, identical for identical arguments on every machine.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    tag = STREAMS.get(stream)
    if tag is None:
        tag = 1000 + zlib.crc32(stream.encode())
    keys = [tag, rank, worker, epoch, step]
    if min(keys) < 0:
        raise ValueError(
            f"seed keys must be >= 0, got rank={rank} worker={worker} epoch={epoch} step={step}"
        )
    state = np.random.SeedSequence(entropy=seed, spawn_key=keys).generate_state(2, np.uint64)
    return int(state[0] >> np.uint64(1))


def seed_libraries(seed: int) -> None:
    """Seed python ``random``, numpy's global state and torch from one 63-bit seed.

    The three libraries get three different words of ``SeedSequence(seed)``, so their
    streams are unrelated even though two of them use the same Mersenne Twister.
    """
    words = np.random.SeedSequence(seed).generate_state(8, np.uint32)
    torch.manual_seed(int(words[0]) << 31 | int(words[1]) >> 1)
    random.seed(int(words[2]) << 32 | int(words[3]))
    np.random.seed(words[4:8])


def _worker_stream(stream: str, split: str) -> str:
    """The :func:`derive_seed` stream of ``split``'s workers.

    The training loader keeps the bare stream name, so training workers draw what they
    drew before splits were seeded apart; every other split gets a stream of its own.
    """
    return stream if split == "train" else f"{stream}/{split}"


# Worker-process state: the active seeding, this worker's id, the epoch last seeded and the
# pass it was seeded for. Module globals are per process, so every worker has its own.
_WORKER: dict[str, Any] = {}
_UNSET = -1
# Slots of the shared tensor: the epoch, and the count of passes started over the loader.
_EPOCH, _PASS = 0, 1


class WorkerSeeding:
    """A ``worker_init_fn`` seeding ``random``, numpy and torch per (seed, split, rank, worker, epoch).

    Call :meth:`set_epoch` in the main process before each epoch's iteration starts (or let
    :meth:`follow` do it from a sampler's ``set_epoch``); workers, persistent ones included,
    reseed at their first fetch of the new epoch. Persistent workers also reseed at their
    first fetch of each new pass over the loader, when the main process announces passes
    (:meth:`new_pass`; :func:`install_worker_seeding` and the package's loaders do), so
    every pass of an epoch draws the same numbers. Until an epoch is set, workers mix in
    torch's per-iteration base seed instead, which also differs per epoch (it is drawn
    from the main process's generator) but cannot be resumed mid-run.

    Args:
        seed: Base seed, identical on every rank.
        rank: Global rank of this process.
        user_fn: The user's own ``worker_init_fn``, called after the seeding.
        epoch: Initial epoch (None: not set yet).
        split: Which loader the workers serve (``"train"``, ``"val"``, ``"test"``,
            ``"predict"``, or e.g. ``"val/1"`` for a second validation loader). Loaders of
            different splits draw unrelated streams even at the same seed, rank, worker and
            epoch; the same split draws the same streams on every rerun.
    """

    def __init__(
        self,
        seed: int,
        rank: int = 0,
        user_fn: Callable[[int], None] | None = None,
        epoch: int | None = None,
        split: str = "train",
    ) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {rank!r}")
        if user_fn is not None and not callable(user_fn):
            raise TypeError(f"user_fn must be callable, got {type(user_fn).__name__}")
        if isinstance(user_fn, WorkerSeeding):
            raise ValueError("user_fn is already a WorkerSeeding; install the seeding only once")
        if not isinstance(split, str) or not split:
            raise ValueError(
                f"split must be a non-empty str naming the loader ('train', 'val', 'test', "
                f"'predict'), got {split!r}"
            )
        self.seed, self.rank, self.user_fn, self.split = seed, rank, user_fn, split
        # Shared memory: a write in the main process is seen by workers that already run.
        self._shared = torch.tensor([_UNSET, 0], dtype=torch.int64)
        self._shared.share_memory_()
        if epoch is not None:
            # Checked like set_epoch: -1 would silently mean "unset", and any other negative
            # value would only fail later, inside a worker.
            self.set_epoch(epoch)
        self.followed = False
        #: While True, a followed sampler's ``set_epoch`` leaves the workers' epoch alone
        #: (``FastDataCallback`` holds it at 0 in an evaluation outside a fit, as
        #: ``ShardedOrder.held`` holds the order).
        self.held = False
        #: Also call the worker's copy of the dataset's ``set_epoch`` with each new epoch
        #: (``FastDataCallback(set_epoch=True)`` sets it: it calls the main process's copy).
        self.dataset_epoch = False

    @property
    def epoch(self) -> int | None:
        """The epoch workers seed for, or None when none was set."""
        value = int(self._shared[_EPOCH])
        return None if value == _UNSET else value

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the workers' next fetches are seeded for (main process)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._shared[_EPOCH] = epoch

    def new_pass(self) -> None:
        """Announce that a new pass over the loader starts (main process).

        Call it when the pass draws its first indices: torch draws them only after
        persistent workers acknowledged the new iteration, so no fetch left over from the
        previous pass sees the new count. Workers reseed at their first fetch of the pass
        (for the current epoch: the pass changes when, not what, they draw).
        """
        self._shared[_PASS] += 1

    def follow(self, sampler: Any) -> None:
        """Mirror every ``sampler.set_epoch(e)`` (Lightning calls it each epoch) here."""
        original = getattr(sampler, "set_epoch", None)
        if not callable(original):
            raise TypeError(f"{type(sampler).__name__} has no set_epoch to follow")
        if getattr(original, "_lfd_follows", None) is self:
            return
        sampler.set_epoch = _Following(sampler, original, self)
        current = getattr(sampler, "epoch", None)
        if isinstance(current, int) and current >= 0:
            self.set_epoch(current)
        self.followed = True

    def worker_seed(self, worker_id: int, epoch: int | None = None, base_seed: int = 0) -> int:
        """The seed of ``worker_id`` for ``epoch``; with no epoch, for torch's ``base_seed``."""
        if epoch is None:
            return derive_seed(
                self.seed,
                stream=_worker_stream("worker-unset-epoch", self.split),
                rank=self.rank,
                worker=worker_id,
                step=base_seed,
            )
        return derive_seed(
            self.seed,
            stream=_worker_stream("worker", self.split),
            rank=self.rank,
            worker=worker_id,
            epoch=epoch,
        )

    def _reseed(self) -> None:
        raw = int(_WORKER["view"][_EPOCH])
        epoch = None if raw == _UNSET else raw
        seed_libraries(self.worker_seed(_WORKER["worker"], epoch, _WORKER["base_seed"]))
        _WORKER["epoch"] = raw
        dataset = _WORKER.get("dataset")
        if self.dataset_epoch and epoch is not None and callable(getattr(dataset, "set_epoch", None)):
            # The main process told its copy of the dataset; a persistent worker's copy (an
            # IterableDataset that shuffles by its epoch) would otherwise replay epoch 0's.
            dataset.set_epoch(epoch)

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        _WORKER.clear()
        _WORKER.update(
            seeding=self,
            worker=worker_id,
            view=self._shared.numpy(),
            base_seed=info.seed if info is not None else 0,
            dataset=info.dataset if info is not None else None,
            # Unknown until the first fetch, which belongs to the pass this worker started
            # for (main may announce it before or after this): the seeding below is its.
            passes=None,
            iterations=0,
        )
        self._reseed()
        if info is not None:
            _reseed_on_epoch_change(info.dataset)
        if self.user_fn is not None:
            self.user_fn(worker_id)

    def __repr__(self) -> str:
        return (
            f"WorkerSeeding(seed={self.seed}, rank={self.rank}, split={self.split!r}, "
            f"epoch={self.epoch}, user_fn={self.user_fn!r})"
        )


class _Following:
    """A followed sampler's ``set_epoch``: the sampler's own, then the seeding's (see
    :meth:`WorkerSeeding.follow`). A class, not a closure, so that the sampler still pickles
    (``ddp_spawn``, "spawn" workers) and a deep copy moves the copied sampler and seeding."""

    def __init__(self, sampler: Any, original: Callable[[int], None], seeding: WorkerSeeding) -> None:
        self.sampler, self._lfd_follows = sampler, seeding
        # The sampler's own method is kept unbound: a bound one pickles as getattr(sampler,
        # "set_epoch"), which, read back after the sampler's state, would be this object.
        self.unbound = getattr(original, "__self__", None) is sampler and hasattr(original, "__func__")
        self.original = original.__func__ if self.unbound else original  # type: ignore[attr-defined]

    def __call__(self, epoch: int) -> None:
        if self.unbound:
            self.original(self.sampler, epoch)
        else:
            self.original(epoch)
        seeding = self._lfd_follows
        if seeding.held:
            return
        # Mirror the epoch the sampler took, not the one it was told: a held ShardedOrder
        # keeps epoch 0 in an evaluation outside a fit, and its workers must too.
        taken = getattr(self.sampler, "epoch", epoch)
        ok = isinstance(taken, int) and not isinstance(taken, bool) and taken >= 0
        seeding.set_epoch(taken if ok else int(epoch))


def _maybe_reseed() -> None:
    """In a worker, before a fetch: reseed when a new epoch or a new pass began since the last seeding."""
    state = _WORKER
    if not state:
        return
    epoch, passes = int(state["view"][_EPOCH]), int(state["view"][_PASS])
    seen, state["passes"] = state["passes"], passes
    # Without an epoch the seed is torch's base seed, which a persistent worker keeps: a
    # reseed per pass would replay the first pass, so its stream continues as before.
    new_pass = seen is not None and passes != seen and epoch != _UNSET
    if epoch != state["epoch"] or new_pass:
        state["seeding"]._reseed()


def _reseed_per_iteration() -> None:
    """In a worker, at ``iter(dataset)`` of an iterable dataset: reseed for each new pass.

    Torch calls it once when the worker starts and again whenever a persistent worker
    resumes for the next pass, in the worker's own order of work, so the count of calls is
    the pass, exactly (the main process's announcement could arrive after this call).
    """
    state = _WORKER
    if not state:
        return
    state["iterations"] += 1
    if state["iterations"] > 1 and int(state["view"][_EPOCH]) != _UNSET:  # unset: see _maybe_reseed
        state["seeding"]._reseed()
    else:
        _maybe_reseed()


_SUBCLASSES: dict[type, type] = {}


def _reseeding_class(cls: type) -> type:
    """A subclass of ``cls`` whose fetch entry points check the epoch and pass first (cached per class)."""
    sub = _SUBCLASSES.get(cls)
    if sub is not None:
        return sub
    ns: dict[str, Any] = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    if issubclass(cls, IterableDataset) or (
        hasattr(cls, "__iter__") and not hasattr(cls, "__getitem__")
    ):

        def __iter__(self: Any) -> Any:
            _reseed_per_iteration()
            return cls.__iter__(self)

        ns["__iter__"] = __iter__
    if hasattr(cls, "__getitem__"):

        def __getitem__(self: Any, index: Any) -> Any:
            _maybe_reseed()
            return cls.__getitem__(self, index)

        ns["__getitem__"] = __getitem__
    if hasattr(cls, "__getitems__"):

        def __getitems__(self: Any, indices: Any) -> Any:
            _maybe_reseed()
            return cls.__getitems__(self, indices)  # type: ignore[attr-defined]

        ns["__getitems__"] = __getitems__
    sub = type(cls.__name__, (cls,), ns)
    _SUBCLASSES[cls] = sub
    return sub


def _reseed_on_epoch_change(dataset: Any) -> None:
    """Make this worker's copy of ``dataset`` reseed when the epoch or pass changes (worker process only).

    The dataset object in a worker is the worker's own copy, so giving it a subclass that
    checks the epoch before each fetch changes nothing in the main process or elsewhere.
    """
    try:
        door.reclass_worker_dataset(dataset, _reseeding_class(type(dataset)))
    except TypeError as e:
        warnings.warn(
            f"lightning_fastdata: a {type(dataset).__name__} dataset cannot be wrapped ({e}); "
            "persistent workers will not reseed per epoch or pass, their streams continue instead",
            stacklevel=2,
        )


def _torch_loader(dataloader: Any) -> DataLoader | None:
    """The ``torch.utils.data.DataLoader`` behind ``dataloader`` (a WorkerLoader wraps one)."""
    if isinstance(dataloader, DataLoader):
        return dataloader
    inner = getattr(dataloader, "dataloader", None)
    return inner if isinstance(inner, DataLoader) else None


_PASS_CLASSES: dict[type, type] = {}


def _pass_counting_class(cls: type) -> type:
    """A subclass of the sampler class ``cls`` announcing a new pass when an iteration starts (cached)."""
    cls = getattr(cls, "_lfd_pass_root", cls)  # a pass-counting class made before: its user's class
    sub = _PASS_CLASSES.get(cls)
    if sub is not None:
        return sub

    def __iter__(self: Any) -> Iterator[Any]:
        # The class's own iterator, stepped with next() only: a sampler that is its own
        # iterator (Lightning's _IndexBatchSamplerWrapper returns self) must not be iter()-ed
        # again, which would come back here.
        return _announcing(cls.__iter__(self), getattr(self, "_lfd_pass_seeding", None))

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        # Pickled (ddp_spawn, deepcopy) as an instance of the user's own class, without the
        # seeding: pickle looks classes up by name, and this one's name is the original's.
        state = {k: _unrecorded(v) for k, v in vars(self).items() if k != "_lfd_pass_seeding"}
        return _new_instance, (cls,), state

    ns = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__iter__": __iter__,
          "__reduce_ex__": __reduce_ex__, "_lfd_pass_root": cls}
    sub = type(cls.__name__, (cls,), ns)
    _PASS_CLASSES[sub] = _PASS_CLASSES[cls] = sub
    return sub


def _unrecorded(value: Any) -> Any:
    """``value`` without the entries that record our own attribute sets (``__class__``, the
    seeding): Lightning, while it fits, records a sampler's attribute sets in its state as
    ``[((name, value), tag), ...]`` to replay them, and the swapped class cannot be pickled."""
    if isinstance(value, list) and value and all(
            isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], tuple) and e[0] for e in value):
        return [e for e in value if e[0][0] not in ("__class__", "_lfd_pass_seeding")]
    return value


def _new_instance(cls: type) -> Any:
    """A bare instance of ``cls`` (its state is set by pickle afterwards)."""
    return cls.__new__(cls)


def _announcing(it: Iterator[Any], seeding: WorkerSeeding | None) -> Iterator[Any]:
    """``it``'s items; the pass is announced at the first draw, not at ``iter()``: after
    persistent workers acknowledged the new iteration (see :meth:`WorkerSeeding.new_pass`)."""
    if seeding is not None:
        seeding.new_pass()
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        yield item


def _count_passes(dl: DataLoader, seeding: WorkerSeeding) -> None:
    """Make every iteration of ``dl`` announce a new pass to ``seeding``'s workers.

    The iteration draws its indices from the loader's batch sampler (or sampler), which
    gets a subclass of its own class that announces the pass. An iterable dataset needs
    none: its workers count their own passes (see :func:`_reseed_per_iteration`).
    """
    if isinstance(dl.dataset, IterableDataset) or not dl.persistent_workers:
        return  # workers started afresh for each pass are seeded at their start
    sampler = dl.batch_sampler if dl.batch_sampler is not None else dl.sampler
    if sampler is None or getattr(sampler, "_lfd_pass_seeding", None) is not None:
        return  # a sampler shared with another seeded loader: announcing there would reseed its workers mid-pass
    try:
        door.reclass_sampler(sampler, _pass_counting_class(type(sampler)))
        sampler._lfd_pass_seeding = seeding
    except (TypeError, AttributeError) as e:
        warnings.warn(
            f"lightning_fastdata: the {type(sampler).__name__} of a DataLoader cannot count its passes "
            f"({e}); persistent workers reseed per epoch only, a second pass of an epoch continues their "
            "streams",
            stacklevel=3,
        )


def new_worker_pass(dataloader: Any) -> bool:
    """Tell the loader's workers that a new pass starts (see :meth:`WorkerSeeding.new_pass`).

    Returns:
        False without a :class:`WorkerSeeding`.
    """
    fn = getattr(_torch_loader(dataloader), "worker_init_fn", None)
    if not isinstance(fn, WorkerSeeding):
        return False
    fn.new_pass()
    return True


def install_worker_seeding(dataloader: Any, seed: int, rank: int, split: str = "train") -> bool:
    """Install :class:`WorkerSeeding` as ``dataloader.worker_init_fn``, chaining the user's.

    Nothing is installed in a loader without workers, or one already seeded by this
    package. When the loader's sampler has ``set_epoch`` (``DistributedSampler``, which
    Lightning advances every epoch) the seeding follows it. Each iteration of the loader
    starts a new pass for the workers: persistent ones reseed, so every pass of an epoch
    draws the same numbers (the loader's batch sampler, or sampler, gets a subclass of its
    class that announces the pass).

    Args:
        dataloader: A ``torch.utils.data.DataLoader`` (or the package's ``WorkerLoader``).
        seed: Base seed, identical on every rank.
        rank: Global rank of this process.
        split: Which loader this is (``"train"``, ``"val"``, ``"test"``, ``"predict"``, or
            e.g. ``"val/1"``): give each loader of a run its own, or the workers of two
            loaders draw the same numbers (see :class:`WorkerSeeding`).

    Returns:
        Whether the seeding was installed.
    """
    dl = _torch_loader(dataloader)
    if dl is None or dl.num_workers == 0 or isinstance(dl.worker_init_fn, WorkerSeeding):
        return False
    seeding = WorkerSeeding(seed, rank, user_fn=dl.worker_init_fn, split=split)
    for sampler in (
        getattr(dl, "sampler", None),
        getattr(getattr(dl, "batch_sampler", None), "sampler", None),
    ):
        if callable(getattr(sampler, "set_epoch", None)):
            seeding.follow(sampler)
            break
    dl.worker_init_fn = seeding
    _count_passes(dl, seeding)
    return True


def worker_seeding(dataloader: Any) -> WorkerSeeding | None:
    """The loader's :class:`WorkerSeeding` (its ``worker_init_fn``), or None."""
    fn = getattr(_torch_loader(dataloader), "worker_init_fn", None)
    return fn if isinstance(fn, WorkerSeeding) else None


def set_worker_epoch(dataloader: Any, epoch: int) -> bool:
    """Tell the loader's workers the next epoch; False without a :class:`WorkerSeeding`."""
    dl = _torch_loader(dataloader)
    fn = getattr(dl, "worker_init_fn", None)
    if not isinstance(fn, WorkerSeeding):
        return False
    fn.set_epoch(epoch)
    return True


_RNG_TYPES = (random.Random, np.random.Generator, np.random.RandomState, torch.Generator)


def _held_generators(obj: Any, path: str, depth: int, seen: set[int]) -> list[str]:
    """Attribute paths under ``obj`` (a few levels deep) that hold a random generator object."""
    if id(obj) in seen or depth < 0:
        return []
    seen.add(id(obj))
    if isinstance(obj, _RNG_TYPES):
        return [path]
    if isinstance(obj, (list, tuple)):
        items: list[tuple[str, Any]] = [(f"{path}[{i}]", v) for i, v in enumerate(obj[:32])]
    elif isinstance(obj, dict):
        items = [(f"{path}[{k!r}]", v) for k, v in list(obj.items())[:32]]
    elif hasattr(obj, "__dict__") and not isinstance(
        obj, (type, torch.Tensor, np.ndarray, torch.nn.Module)
    ):
        items = [(f"{path}.{k}", v) for k, v in list(vars(obj).items())[:64]]
    else:
        return []
    found: list[str] = []
    for sub_path, value in items:
        found += _held_generators(value, sub_path, depth - 1, seen)
    return found


def _main_process_repeats(dl: Any) -> str | None:
    """Under DDP with ``seed_everything`` and no workers: the dataset draws in each rank's main
    process, from generators seeded alike on every rank (not the store's gather, which draws
    nothing)."""
    from lightning_fastdata import distributed as D

    if (D.world_size() <= 1 or os.environ.get("PL_GLOBAL_SEED") is None
            or not getattr(dl.dataset, "draws_randomness", True)):
        return None
    return ("under DDP with num_workers=0 the dataset runs in each rank's main process, whose random "
            "generators seed_everything seeds alike on every rank: if it draws random numbers (a random "
            "transform), every rank draws the same ones for its different samples; give the loader workers "
            "(num_workers >= 1: lightning_fastdata seeds them per rank), or draw from a generator seeded "
            "with the rank")


def randomness_repeats(dataloader: Any) -> str | None:
    """Why ``dataloader``'s workers would draw repeated random numbers, or None when they would not.

    Reports a dataset (or its transforms) holding its own generator object, which every
    worker copies with one state and nobody reseeds; and, under DDP, workers seeded only
    by torch from a main-process generator that ``seed_everything`` makes identical on
    every rank.

    Args:
        dataloader: A ``torch.utils.data.DataLoader`` (or the package's ``WorkerLoader``).

    Returns:
        A sentence naming the cause and the fix, meant for a one-time warning; None if fine.
    """
    dl = _torch_loader(dataloader)
    if dl is None:
        return None
    if dl.num_workers == 0:
        return _main_process_repeats(dl)
    held = _held_generators(dl.dataset, "dataset", depth=3, seen=set())
    if held:
        return (
            f"{held[0]} is a random generator object: every DataLoader worker gets a copy in the "
            "same state and no worker_init_fn reseeds it, so workers (and, without persistent "
            "workers, epochs) repeat the same draws; draw from torch, numpy or random's global "
            "functions instead, which "
            "are reseeded per worker, rank and epoch"
        )
    fn = dl.worker_init_fn
    if isinstance(fn, WorkerSeeding):
        return None
    from lightning_fastdata import distributed as D

    if D.world_size() > 1 and (
        os.environ.get("PL_GLOBAL_SEED") is not None or dl.generator is not None
    ):
        what = "its generator" if dl.generator is not None else "seed_everything"
        return (
            f"under DDP the workers of every rank get the same seeds ({what} makes the generator "
            "torch "
            "seeds workers from identical on all ranks), so all ranks draw the same augmentations; "
            "install lightning_fastdata's worker seeding (install_worker_seeding) or a "
            "worker_init_fn "
            "that mixes in the global rank"
        )
    return None
