"""``OptimizedDataModule``: Lightning's hooks, orchestration only.

``prepare_data`` caches every split's static outputs once per node; ``setup`` opens the
caches, asks :mod:`~lightning_fastdata.plan` where they go and places them; the
``*_dataloader`` hooks return loaders from :mod:`~lightning_fastdata.loaders`;
``on_after_batch_transfer`` runs the augmentation on the device with a generator seeded
from (seed, rank, epoch, batch index).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_fastdata import distributed as D
from lightning_fastdata.augment import BatchTransform
from lightning_fastdata.loaders import (
    ChunkBuffers,
    ChunkedLoader,
    DeviceLoader,
    ShardedOrder,
    WorkerLoader,
    _Loader,
    _Transformed,
)
from lightning_fastdata.placement import place
from lightning_fastdata.plan import STRATEGIES, Plan, decide, probe_resources
from lightning_fastdata.seeding import WorkerSeeding, derive_seed
from lightning_fastdata.shared import Segment, share_stores, worker_headroom
from lightning_fastdata.store import (
    Store,
    StoreError,
    UnstorableSampleError,
    build_store,
)

Split = Literal["train", "val", "test", "predict"]
_STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}
_AUTO = "auto"
#: Init arguments that never change what is cached (loader, placement and augmentation
#: settings; cache_key has its own place in the fingerprint).
_NOT_CACHED = frozenset({
    "batch_size", "eval_batch_size", "strategy", "vram_fraction", "shared_memory", "num_workers", "pin_memory",
    "prefetch_factor", "persistent_workers", "shuffle", "drop_last", "seed", "train_augment", "eval_augment",
    "device", "progress", "cache_dir", "cache_key", "augment_field", "store",
})


def default_cache_dir() -> str:
    """``$LIGHTNING_FASTDATA_CACHE``, else ``~/.cache/lightning_fastdata``."""
    return os.environ.get("LIGHTNING_FASTDATA_CACHE", str(Path.home() / ".cache" / "lightning_fastdata"))


def _check_auto_int(name: str, value: Any, minimum: int) -> None:
    if value == _AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be 'auto' or an int >= {minimum}, got {value!r}")


def _check_auto_bool(name: str, value: Any) -> None:
    if value != _AUTO and not isinstance(value, bool):
        raise ValueError(f"{name} must be 'auto', True or False, got {value!r}")


class OptimizedDataModule(L.LightningDataModule):
    """A LightningDataModule that caches static preprocessing and keeps the device fed.

    Subclasses implement :meth:`source` (and usually :meth:`static_transform`).

    Args:
        batch_size: Training batch size per rank.
        eval_batch_size: Batch size for val/test/predict (default: ``batch_size``).
        strategy: "auto" (decided by the plan), "device" (whole store on the device),
            "chunked" (streamed to the device) or "workers" (DataLoader workers).
        vram_fraction: Share of the device's total memory the store may take, in (0, 1].
        cache_dir: Where caches live (default :func:`default_cache_dir`).
        cache_key: Extra key mixed into the cache fingerprint; change it to force a rebuild.
        shared_memory: Node-local shared memory for host-resident stores: "auto", "on", "off".
        num_workers: DataLoader workers: "auto" (from cores per local rank, RAM and
            /dev/shm), "measure" (time a few batches per candidate in ``setup``, keep the
            fastest) or an int >= 0.
        pin_memory: Pinned host batches ("auto", True, False).
        prefetch_factor: Batches in flight per worker ("auto" or an int >= 1).
        persistent_workers: Keep workers across epochs ("auto", True, False).
        shuffle: Shuffle the training split every epoch.
        drop_last: Drop the last partial training batch (and truncate rank shards).
        seed: Base seed of the sample order and of the augmentation streams.
        train_augment: Batched on-device transform for training batches.
        eval_augment: Batched on-device transform for val/test/predict batches.
        augment_field: Which field the augmentation applies to, by name ("0", "image"):
            default the sample's first leaf.
        store: Cache static outputs in a store (False: per-sample loading in workers).
        device: Device to place stores on (default: the Trainer's root device).
        progress: Show progress bars while caching.
    """

    def __init__(
        self,
        batch_size: int = 256,
        eval_batch_size: int | None = None,
        strategy: Literal["auto", "device", "chunked", "workers"] = "auto",
        vram_fraction: float = 0.6,
        cache_dir: str | None = None,
        cache_key: str | None = None,
        shared_memory: Literal["auto", "on", "off"] = "auto",
        num_workers: int | Literal["auto", "measure"] = "auto",
        pin_memory: bool | Literal["auto"] = "auto",
        prefetch_factor: int | Literal["auto"] = "auto",
        persistent_workers: bool | Literal["auto"] = "auto",
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        train_augment: BatchTransform | None = None,
        eval_augment: BatchTransform | None = None,
        augment_field: str | None = None,
        store: bool = True,
        device: str | None = None,
        progress: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be an int > 0, got {batch_size!r}")
        if eval_batch_size is not None and (not isinstance(eval_batch_size, int) or eval_batch_size <= 0):
            raise ValueError(f"eval_batch_size must be an int > 0 or None, got {eval_batch_size!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if not isinstance(vram_fraction, (int, float)) or not 0.0 < vram_fraction <= 1.0:
            raise ValueError(f"vram_fraction must be in (0, 1], got {vram_fraction!r}; 0.6 keeps 40% for the model")
        if shared_memory not in ("auto", "on", "off"):
            raise ValueError(f"shared_memory must be 'auto', 'on' or 'off', got {shared_memory!r}")
        if num_workers != "measure" and (num_workers != _AUTO and (isinstance(num_workers, bool) or
                                                                  not isinstance(num_workers, int) or num_workers < 0)):
            raise ValueError(f"num_workers must be 'auto', 'measure' or an int >= 0, got {num_workers!r}")
        _check_auto_int("prefetch_factor", prefetch_factor, 1)
        _check_auto_bool("pin_memory", pin_memory)
        _check_auto_bool("persistent_workers", persistent_workers)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        for name, aug in (("train_augment", train_augment), ("eval_augment", eval_augment)):
            if aug is not None and not callable(aug):
                raise TypeError(f"{name} must be a callable transform (see lightning_fastdata.augment), "
                                f"got {type(aug).__name__}")
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.strategy = strategy
        self.vram_fraction = float(vram_fraction)
        self.cache_dir = cache_dir or default_cache_dir()
        self.cache_key = cache_key
        self.shared_memory = shared_memory
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.train_augment = train_augment
        self.eval_augment = eval_augment
        self.augment_field = augment_field
        self.use_store = store
        self.device = device
        self.progress = progress
        self.plan: Plan | None = None
        self.stores: dict[str, Store] = {}
        self._raw: dict[str, Any] = {}
        self._placed: dict[str, list[torch.Tensor]] = {}
        self._chunks: dict[str, ChunkBuffers] = {}
        self._loaders: dict[str, _Loader] = {}
        self._shared: dict[str, Segment] = {}

    # ------------------------------------------------------------------ user hooks

    def source(self, split: str) -> Any:
        """Return the map-style dataset of ``split`` ("train", "val", "test", "predict"), or None."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement source(split) returning a Dataset (or None to skip a split)"
        )

    def static_transform(self, sample: Any) -> Any:
        """Deterministic per-sample preprocessing whose output is cached (identity by default)."""
        return sample

    # ------------------------------------------------------------------ building and placing

    def _sources(self, splits: tuple[str, ...]) -> dict[str, Any]:
        out = {}
        for split in splits:
            src = self.source(split)
            if src is not None:
                out[split] = src
        return out

    def source_files(self, split: str) -> list[str] | None:
        """The files ``source(split)`` reads, for the cache's fingerprint (path, size and mtime of each).

        ``None`` (the default) discovers them on the dataset: ``ImageFolder``/``DatasetFolder``
        ``samples``, and any attribute listing existing paths. Override it when the source
        reads files it does not list (an index file, a directory it globs lazily), or
        return ``[]`` when stat-ing millions of files at every ``setup`` is too slow.
        """
        return None

    def _cache_config(self) -> dict[str, Any]:
        """Init arguments that can change what is cached: those of every class up to this one, minus loader settings.

        Values come from ``hparams`` when saved there, else from the attribute of the
        same name (the usual ``self.root = root``); an argument kept under another name
        is not seen (its effect on the outputs still shows in the probes).
        """
        import inspect

        hparams = dict(getattr(self, "hparams", None) or {})
        config: dict[str, Any] = {}
        for cls in type(self).__mro__:
            init = vars(cls).get("__init__")
            if init is not None:
                for p in list(inspect.signature(init).parameters.values())[1:]:
                    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in _NOT_CACHED or p.name in config:
                        continue
                    if p.name in hparams:
                        config[p.name] = hparams[p.name]
                    elif p.name in vars(self):
                        config[p.name] = vars(self)[p.name]
            if cls is OptimizedDataModule:
                break
        return config

    def _store_for(self, split: str, src: Any, verify: bool = True) -> Store | None:
        """Build or open the split's store; ``None`` when its samples cannot be stored.

        The cache lives in ``cache_dir/<module.QualName>/``, so two projects never share or
        evict each other's caches; its fingerprint covers the code of ``static_transform``
        and of the source's class, :meth:`_cache_config` and :meth:`source_files`.
        """
        if not self.use_store:
            return None
        try:
            return build_store(src, self.static_transform, self.cache_dir, name=split, cache_key=self.cache_key,
                               progress=self.progress and D.local_rank() == 0, verify=verify,
                               namespace=f"{type(self).__module__}.{type(self).__qualname__}",
                               config=self._cache_config(), files=self.source_files(split), warn=rank_zero_warn)
        except UnstorableSampleError as e:
            rank_zero_warn(f"lightning_fastdata: the '{split}' split cannot be stored ({e}); "
                           "loading it per sample in DataLoader workers instead")
            return None

    def prepare_data(self) -> None:
        """Cache every split's static outputs (Lightning runs this once per node)."""
        for split, src in self._sources(("train", "val", "test", "predict")).items():
            self._store_for(split, src)

    def _open(self, split: str, src: Any) -> Store | None:
        """Open the split's store (sizes checked, no checksum pass); build it under the lock if missing."""
        return self._store_for(split, src, verify=False)

    def target_device(self) -> torch.device:
        """Where batches are consumed: ``device`` if given, else the Trainer's root device."""
        if self.device is not None:
            return torch.device(self.device)
        trainer = self.trainer
        if trainer is not None:
            return trainer.strategy.root_device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is not None:
            return trainer.global_rank, trainer.world_size
        return D.rank(), D.world_size()

    def setup(self, stage: str | None = None) -> None:
        """Open the caches of the stage's splits, make the plan, and place the stores."""
        splits = _STAGE_SPLITS.get(stage or "fit", ("train", "val", "test", "predict"))
        if stage is None:
            splits = ("train", "val", "test", "predict")
        self._open_splits(splits)
        device = self.target_device()
        resources = probe_resources(device, local_world_size=self._local_place()[2])
        nbytes = self._stores_nbytes()
        batch_sizes = self._batch_sizes()
        config = self._plan_config()
        self.plan = plan = decide(nbytes, resources, config)
        self._share_host_stores()
        # Place what is not placed yet; an OOM falls back a level, the same on every rank.
        todo = {s: st for s, st in self.stores.items() if s not in self._placed and s not in self._chunks}
        placement = place(todo, plan, device, config, batch_sizes, world_size=self._rank_world()[1])
        self.plan = placement.plan
        self._placed.update(placement.fields)
        self._chunks.update(placement.buffers)
        if self.plan.num_workers_candidates:
            self._measure_workers(resources, config, device)
        rank_zero_info(f"lightning_fastdata plan:\n{self.plan}")

    def _open_splits(self, splits: tuple[str, ...]) -> None:
        """Open (or build) the store of each split with a source; unstorable ones stay raw."""
        for split, src in self._sources(splits).items():
            if split in self.stores or split in self._raw:
                continue
            store = self._open(split, src)
            if store is None:
                self._raw[split] = src
            else:
                self.stores[split] = store

    def _stores_nbytes(self) -> int | None:
        """Bytes of all open stores; ``None`` when a split cannot be stored (only workers can load it)."""
        return None if self._raw else sum(s.nbytes for s in self.stores.values())

    def _batch_sizes(self) -> dict[str, int]:
        return {split: self.batch_size if split == "train" else self.eval_batch_size for split in self.stores}

    def _plan_config(self) -> dict[str, Any]:
        """The settings :func:`~lightning_fastdata.plan.decide` reads, with the largest batch's bytes."""
        batch_sizes = self._batch_sizes()
        return {
            "strategy": self.strategy, "vram_fraction": self.vram_fraction,
            "num_workers": self.num_workers, "pin_memory": self.pin_memory,
            "prefetch_factor": self.prefetch_factor, "persistent_workers": self.persistent_workers,
            "batch_nbytes": max((sum(i.row_nbytes for i in st.infos) * batch_sizes[split]
                                 for split, st in self.stores.items()), default=0),
        }

    def _measure_workers(self, resources: Any, config: dict[str, Any], device: torch.device) -> None:
        """``num_workers="measure"``: time the candidates on the first split's loader (see autotune)."""
        from lightning_fastdata.autotune import measure_num_workers

        split = next((s for s in ("train", "val", "test", "predict") if s in self.stores or s in self._raw), None)
        if split is None:
            return
        plan = self.plan

        def make(trial: Plan) -> Any:
            self.plan = trial
            try:
                return self._make_loader(split)
            finally:
                self.plan = plan
                self._loaders.pop(split, None)  # the measurement shuts its workers down

        measure_num_workers(plan, resources, config, make, device)

    def teardown(self, stage: str | None = None) -> None:
        """Release device copies and loaders of the stage's splits."""
        for split in _STAGE_SPLITS.get(stage or "fit", ()):
            self._placed.pop(split, None)
            self._chunks.pop(split, None)
            loader = self._loaders.pop(split, None)
            if hasattr(loader, "close"):
                loader.close()  # persistent workers must not outlive the stage
            self._release_shared(split)

    # ------------------------------------------------------------------ shared memory

    def _local_place(self) -> tuple[int, int, int]:
        """(global rank, local rank, local world size) from the Trainer, else the launcher's environment."""
        trainer = self.trainer
        if trainer is not None:
            return trainer.global_rank, trainer.local_rank, trainer.num_devices
        return D.rank(), D.local_rank(), D.local_world_size()

    def _share_host_stores(self) -> None:
        """Move host-resident stores to node-local shared memory when several processes read them.

        With ``shared_memory="auto"`` that is when the plan reads the store from host memory
        (``workers``, ``chunked``) with more than one local rank or any DataLoader worker;
        ``"on"`` always shares (the ``device`` strategy then loads from it). Every rank
        takes part, because the placement is collective.
        """
        plan = self.plan
        assert plan is not None
        rank, local_rank, local_world = self._local_place()
        todo = {s: st for s, st in self.stores.items() if s not in self._shared}
        readers = plan.strategy in ("workers", "chunked") and (local_world > 1 or plan.num_workers > 0)
        want = self.shared_memory == "on" or (self.shared_memory == "auto" and readers)
        if not todo:
            return
        # Ranks may plan differently (free memory differs); if one shares, all must take part.
        if not D.all_reduce_max(float(want)):
            plan.reasons["shared_memory"] = (
                "off: set by configuration" if self.shared_memory == "off" else
                f"not used: strategy {plan.strategy!r}, {local_world} local rank(s), {plan.num_workers} "
                "worker(s): no host-memory store read by several processes"
            )
            return
        row_bytes = max(sum(i.row_nbytes for i in st.infos) for st in todo.values())
        headroom = worker_headroom(row_bytes * max(self.batch_size, self.eval_batch_size), plan.num_workers,
                                   plan.prefetch_factor, local_world)
        notes: list[str] = []

        def warn(msg: str) -> None:
            notes.append(msg)
            if local_rank == 0:
                warnings.warn(msg, UserWarning, stacklevel=3)

        segments = share_stores(todo, headroom=headroom, fallback=self.shared_memory == "auto", warn=warn,
                                rank=rank, local_rank=local_rank, local_world_size=local_world)
        self._shared.update(segments)
        if segments:
            nbytes = sum(seg.size for seg in segments.values())
            plan.reasons["shared_memory"] = (
                f"on: one copy of {', '.join(sorted(segments))} ({nbytes / 1e6:.1f} MB) in /dev/shm for "
                f"{local_world} local rank(s) x {max(plan.num_workers, 1)} reader(s) each"
            )
        else:
            plan.reasons["shared_memory"] = "fallback to the disk cache: " + (notes[0] if notes else "")

    def _release_shared(self, split: str) -> None:
        seg = self._shared.pop(split, None)
        if seg is not None:
            seg.release(self.stores.get(split))

    # ------------------------------------------------------------------ loaders

    def _make_loader(self, split: str) -> _Loader | list:
        if self.plan is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before {split}_dataloader()")
        if split not in self.stores and split not in self._raw:
            return []
        rank, world = self._rank_world()
        train = split == "train"
        n = len(self.stores[split]) if split in self.stores else len(self._raw[split])
        order = ShardedOrder(n, self.batch_size if train else self.eval_batch_size,
                             shuffle=self.shuffle and train, drop_last=self.drop_last and train,
                             seed=self.seed, rank=rank, world_size=world)
        if split in self._placed:
            loader: _Loader = DeviceLoader(self._placed[split], self.stores[split].spec, order)
        elif split in self._chunks:
            loader = ChunkedLoader(self.stores[split], order, buffers=self._chunks[split], mode=self.plan.chunk_mode)
        else:
            p = self.plan
            kwargs = dict(num_workers=p.num_workers, pin_memory=p.pin_memory, prefetch_factor=p.prefetch_factor,
                          persistent_workers=p.persistent_workers, worker_init_fn=self._worker_init_fn(order))
            if split in self.stores:
                loader = WorkerLoader(order, store=self.stores[split], **kwargs)
            else:
                loader = WorkerLoader(order, dataset=_Transformed(self._raw[split], self.static_transform), **kwargs)
        self._loaders[split] = loader
        return loader

    def _worker_init_fn(self, order: ShardedOrder | None = None) -> WorkerSeeding:
        """Workers seeded per (seed, rank, worker, epoch); the epoch follows ``order.set_epoch``."""
        rank, _ = self._rank_world()
        seeding = WorkerSeeding(self.seed, rank)
        if order is not None:
            seeding.follow(order)
        return seeding

    def train_dataloader(self) -> Any:
        """The training loader for the planned strategy."""
        return self._make_loader("train")

    def val_dataloader(self) -> Any:
        """The validation loader (an empty list without a "val" source)."""
        return self._make_loader("val")

    def test_dataloader(self) -> Any:
        """The test loader (an empty list without a "test" source)."""
        return self._make_loader("test")

    def predict_dataloader(self) -> Any:
        """The predict loader (an empty list without a "predict" source)."""
        return self._make_loader("predict")

    # ------------------------------------------------------------------ augmentation

    def _current_split(self) -> str:
        trainer = self.trainer
        if trainer is None or trainer.training:
            return "train"
        if trainer.testing:
            return "test"
        if trainer.predicting:
            return "predict"
        return "val"

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Apply ``train_augment``/``eval_augment`` on the device with a per-batch seeded generator."""
        split = self._current_split()
        loader = self._loaders.get(split)
        key = loader.next_key() if loader is not None else None
        augment = self.train_augment if split == "train" else self.eval_augment
        if augment is None:
            return batch
        rank, _ = self._rank_world()
        epoch, step = (key.epoch, key.index) if key is not None else (0, 0)
        return self.augment_batch(batch, augment, split=split, rank=rank, epoch=epoch, step=step)

    def augment_batch(self, batch: Any, augment: BatchTransform, split: str = "train", rank: int = 0,
                      epoch: int = 0, step: int = 0) -> Any:
        """Apply ``augment`` to the augmented field of ``batch`` with the generator of (seed, rank, epoch, step)."""
        path = self.augment_field
        x = _get_field(batch, path)
        g = torch.Generator(device=x.device)
        g.manual_seed(derive_seed(self.seed, stream=f"augment-{split}" if split != "train" else "augment",
                                  rank=rank, epoch=epoch, step=step))
        return _set_field(batch, path, augment(x, g))


def _first_path(batch: Any) -> list[Any]:
    path: list[Any] = []
    node = batch
    while isinstance(node, (tuple, list, dict)):
        key = next(iter(node)) if isinstance(node, dict) else 0
        path.append(key)
        node = node[key]
    return path


def _split_path(batch: Any, path: str | None) -> list[Any]:
    if path is None:
        return _first_path(batch)
    out: list[Any] = []
    node = batch
    for part in path.split("."):
        key: Any = int(part) if isinstance(node, (tuple, list)) and part.isdigit() else part
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError) as e:
            raise StoreError(f"augment_field={path!r} does not name a field of the batch") from e
        out.append(key)
    return out


def _get_field(batch: Any, path: str | None) -> torch.Tensor:
    node = batch
    for key in _split_path(batch, path):
        node = node[key]
    if not isinstance(node, torch.Tensor):
        raise StoreError(f"augment_field={path!r} is a {type(node).__name__}, not a tensor")
    return node


def _set_field(batch: Any, path: str | None, value: torch.Tensor) -> Any:
    keys = _split_path(batch, path)

    def put(node: Any, depth: int) -> Any:
        if depth == len(keys):
            return value
        key = keys[depth]
        if isinstance(node, dict):
            return {**node, key: put(node[key], depth + 1)}
        items = list(node)
        items[key] = put(items[key], depth + 1)
        return type(node)(items) if isinstance(node, tuple) else items

    return put(batch, 0)
