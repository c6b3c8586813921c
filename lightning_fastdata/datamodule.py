"""``OptimizedDataModule``: Lightning's hooks, orchestration only.

``prepare_data`` caches every split's static outputs once per node (:mod:`~lightning_fastdata.store`);
``setup`` opens the caches, asks :mod:`~lightning_fastdata.plan` where they go and has
:mod:`~lightning_fastdata.placement` put them there; the ``*_dataloader`` hooks return
loaders from :mod:`~lightning_fastdata.loaders`, whose batches carry the global indices of
their samples; ``on_after_batch_transfer`` augments each sample on the device, keyed by
(seed, epoch, sample index), then runs the LightningModule's own batch hook.
"""

from __future__ import annotations

import functools
import math
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from lightning_fastdata import distributed as D
from lightning_fastdata._lightning import (
    DoorClosed,
    batch_index_record,
    given_hyperparameters,
    quiet_shared_hook_warnings,
    training_steps_in_flight,
)
from lightning_fastdata._util import as_flag, as_int
from lightning_fastdata.augment import Batch, BatchTransform, starts_with_crop
from lightning_fastdata.decode import decode_jpegs
from lightning_fastdata.encode import check_settings
from lightning_fastdata.graphs import GraphedAugment
from lightning_fastdata.host_memory import describe as host_memory_state
from lightning_fastdata.host_memory import freed_memory_kept, keep_freed_memory
from lightning_fastdata.keys import SampleKeys
from lightning_fastdata.loaders import (
    BlockOrder,
    FastBatch,
    IndexLoader,
    ShardedOrder,
    WorkerLoader,
    flatten_batch,
    prepared_row_nbytes,
    transformed,
)
from lightning_fastdata.placement import (
    ChunkBuffers,
    ChunkedSource,
    DeviceSource,
    HostSource,
    Placement,
    Sharing,
    place,
)
from lightning_fastdata.plan import Plan, PlanError, auto_flag, check_config, decide, probe_resources
from lightning_fastdata.ragged import RaggedArray, RaggedBatch
from lightning_fastdata.seeding import WorkerSeeding
from lightning_fastdata.store import Store, build_store
from lightning_fastdata.structure import (
    StoreError,
    UnstorableSampleError,
    fixed_leads,
    lead_error,
    sample_name,
    unflatten,
)

Split = Literal["train", "val", "test", "predict"]
SPLITS = ("train", "val", "test", "predict")
_STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}
_AUTO = "auto"
_KINDS = ("image", "mask", "other")
#: The tag of loader iterations started by a fit's validation run (see ``_close_evaluations``).
_VALIDATION_IN_FIT = "validation in a fit"
#: The LightningModule hooks that see batches; the datamodule owns them and calls the model's.
_BATCH_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
#: What a checkpoint's data plan must match for a resumed run to see the batches it would have seen.
_PLAN_KEYS = ("strategy", "chunk_mode", "seed", "shuffle", "drop_last", "batch_size", "fingerprints")
#: Init arguments that never change what is cached (loader, placement and augmentation
#: settings; cache_key has its own place in the fingerprint).
_NOT_CACHED = frozenset({
    "batch_size", "eval_batch_size", "strategy", "vram_fraction", "shared_memory", "num_workers", "pin_memory",
    "prefetch_factor", "persistent_workers", "shuffle", "drop_last", "seed", "train_augment", "eval_augment",
    "device", "progress", "cache_dir", "cache_key", "augment_field", "store", "field_kinds", "augment_ahead",
    # what changes the stored layout enters the fingerprint through build_store (only what matters)
    "ragged", "encode", "jpeg_quality", "max_side",
    "cuda_graphs", "keep_freed_memory",
})
#: What a run attaches to a data module, each with its value before any: a pickled copy (a spawned
#: DataLoader worker's ``static_transform``, a ``ddp_spawn`` rank) gets these, not the Trainer (its
#: strategy holds closures), the loaders (their worker processes) or the placed stores.
_RUN_STATE: dict[str, Callable[[], Any]] = {
    "trainer": lambda: None, "plan": lambda: None, "placement": lambda: None, "stores": dict, "_raw": dict,
    "_stale": set, "_set_up": set, "_loaders": dict, "_made": dict, "_graphed": dict,
    "_validation_iterated": lambda: False, "_resume_hint": lambda: None, "_train_position": lambda: None,
}


def default_cache_dir() -> str:
    """``$LIGHTNING_FASTDATA_CACHE``, else ``~/.cache/lightning_fastdata``."""
    return os.environ.get("LIGHTNING_FASTDATA_CACHE", str(Path.home() / ".cache" / "lightning_fastdata"))


def _checked_int(name: str, value: Any, low: int, high: float, must: str) -> int:
    """``value`` as a plain int in ``[low, high)`` (numpy integers too: sweeps give them), else a
    ValueError saying what ``name`` must be."""
    number = as_int(value)
    if number is None or not low <= number < high:
        raise ValueError(f"{name} must be {must}, got {value!r}")
    return number


def _plain_int(value: Any) -> Any:
    """A numpy integer as a plain int; anything else as given (for a check elsewhere to refuse by name)."""
    number = as_int(value)
    return value if number is None else number


def _same_but_plain(given: Any, plain: Any) -> bool:
    """Whether ``given`` is ``plain`` as a numpy scalar (saved hyperparameters then show the plain one)."""
    return type(given) is not type(plain) and isinstance(given, np.generic) and bool(given == plain)


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
        seed: Base seed of the sample order and of the augmentation (keyed per sample), in [0, 2**64).
            The order is ``DistributedSampler``'s (``seed + epoch``, low 32 bits: docs/seeding.md).
            Lightning's ``seed_everything`` does not change it: a sweep over seeds sets this one
            (e.g. ``--data.seed`` next to ``--seed_everything`` in a LightningCLI run).
        train_augment: Batched on-device transform for training batches.
        eval_augment: Batched on-device transform for val/test/predict batches.
        field_kinds: Kind of each field by name ("image", "mask" or "other"), e.g.
            ``{"image": "image", "label": "mask"}``; fields not named keep the kind the
            store recorded (torchvision ``tv_tensors`` types, else the first field is the
            image and the rest ``other``).
        augment_field: Shorthand for ``field_kinds={augment_field: "image"}`` with every
            other field ``other``.
        augment_ahead: With the ``device`` and ``chunked`` strategies, how many batches (an int
            in [0, 4]) are gathered and augmented ahead of the training step in a background
            thread (on CUDA, on a side stream): the next batch is ready when the step ends. 0 does
            that work in the training loop's thread, between steps. ``"auto"``: 1 on CUDA; 0 on a
            CPU run, where the thread competes with the training step for the same cores and the
            GIL (measured on 2 cores, ``benchmarks/null_model_epoch.py``, four runs: a null-model
            epoch took 5.4-6.4x a free loader's with 1, 3.4-7.6x with 0; neither was ahead in
            every run).
        ragged: Fields whose shape may change from sample to sample (e.g. images of
            varying sizes), by name; each is stored end to end with offsets and shapes,
            and reaches the augmentation (and, without a size-fixing op, the model) as a
            list of tensors. The number of dimensions and the dtype may not change.
        encode: Field -> "jpeg": store that field as JPEG bytes (encoded once, at store
            time; a source that yields JPEG bytes is stored as it is), decoded in batches
            where the batch is used, into a list of uint8 (C, H, W) tensors. Implies
            ``ragged`` for the field.
        jpeg_quality: Quality of store-time JPEG encoding, 1-100.
        max_side: Longest side of an encoded image, capped at store time (antialiased
            resize, aspect kept); ``None`` keeps the source's size.
        cuda_graphs: On CUDA, capture the augmentation of each fixed-shape batch in a CUDA
            graph once and replay it (one launch instead of dozens; the same output, bit for
            bit); batches of other shapes, ragged fields and ops from outside this package
            run eagerly. No effect elsewhere.
        keep_freed_memory: Tell glibc's malloc to keep freed memory in the process for reuse
            (process-wide, from ``setup`` on; see :mod:`~lightning_fastdata.host_memory`), so
            that each batch's buffers are not page-faulted in afresh: "auto" where this
            process builds every batch on the CPU (training on the CPU with no DataLoader
            workers), True always, False never. The plan says which.
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
        field_kinds: dict[str, Literal["image", "mask", "other"]] | None = None,
        augment_field: str | None = None,
        augment_ahead: int | Literal["auto"] = "auto",
        ragged: list[str] | None = None,
        encode: dict[str, Literal["jpeg"]] | None = None,
        jpeg_quality: int = 90,
        max_side: int | None = None,
        cuda_graphs: bool = True,
        keep_freed_memory: bool | Literal["auto"] = "auto",
        store: bool = True,
        device: str | None = None,
        progress: bool = True,
    ) -> None:
        super().__init__()
        # Each value is kept as plain Python (numpy scalars from sweeps are welcome): hparams,
        # repr and YAML show 64, not np.int64(64).
        batch_size = _checked_int("batch_size", batch_size, 1, math.inf, "an int > 0")
        if eval_batch_size is not None:
            eval_batch_size = _checked_int("eval_batch_size", eval_batch_size, 1, math.inf, "an int > 0 or None")
        # The plan's own checks (decide() runs them too), so both refuse and accept alike.
        plan_settings = check_config({
            "strategy": strategy, "vram_fraction": vram_fraction, "num_workers": num_workers,
            "prefetch_factor": prefetch_factor, "pin_memory": pin_memory, "persistent_workers": persistent_workers})
        vram_fraction, num_workers = plan_settings["vram_fraction"], plan_settings["num_workers"]
        prefetch_factor, pin_memory = plan_settings["prefetch_factor"], plan_settings["pin_memory"]
        persistent_workers = plan_settings["persistent_workers"]
        if shared_memory not in ("auto", "on", "off"):
            raise ValueError(f"shared_memory must be 'auto', 'on' or 'off', got {shared_memory!r}")
        if device is not None:
            try:
                torch.device(device)
            except (RuntimeError, TypeError) as e:  # found at setup otherwise, after the caches are built
                raise ValueError(f"device must be a torch device such as 'cpu', 'cuda' or 'cuda:1' (None: the "
                                 f"Trainer's), got {device!r}") from e
        # Keys fold the seed modulo 2**64: seed 2**64 would replay seed 0's augmentation.
        seed = _checked_int("seed", seed, 0, 1 << 64, "an int in [0, 2**64)")
        for name, aug in (("train_augment", train_augment), ("eval_augment", eval_augment)):
            if aug is not None and not callable(aug):
                raise TypeError(f"{name} must be a callable transform (see lightning_fastdata.augment), "
                                f"got {type(aug).__name__}")
        if field_kinds is not None:
            if not isinstance(field_kinds, dict):
                raise TypeError(f"field_kinds must be a dict of field name -> kind, got {type(field_kinds).__name__}")
            for name, kind in field_kinds.items():
                if kind not in _KINDS:
                    raise ValueError(f"field_kinds[{name!r}] must be one of {_KINDS}, got {kind!r}")
        if not (isinstance(augment_ahead, str) and augment_ahead == _AUTO):
            augment_ahead = _checked_int("augment_ahead", augment_ahead, 0, 5, "'auto' or an int in [0, 4]")
        flags = {"cuda_graphs": cuda_graphs, "shuffle": shuffle, "drop_last": drop_last, "store": store,
                 "progress": progress}
        for name, value in flags.items():
            flags[name] = as_flag(value)
            if flags[name] is None:  # a string such as "False" would read as True
                raise TypeError(f"{name} must be True or False, got {value!r}")
        cuda_graphs, shuffle, drop_last = flags["cuda_graphs"], flags["shuffle"], flags["drop_last"]
        store, progress = flags["store"], flags["progress"]
        keep_freed_memory = auto_flag("keep_freed_memory", keep_freed_memory)
        if augment_field is not None:
            # A list or a number failed only in setup, after the caches were built ("unhashable type").
            if not isinstance(augment_field, str):
                raise TypeError(f"augment_field must be a field name (a str such as 'image') or None, got "
                                f"{augment_field!r}")
            if not augment_field:
                raise ValueError("augment_field must be a field name such as 'image' (or None), got ''")
        if augment_field is not None and field_kinds is not None:
            raise ValueError("give field_kinds or augment_field, not both "
                             "(augment_field=X is field_kinds={X: 'image'})")
        if ragged is not None and (isinstance(ragged, str) or not isinstance(ragged, (list, tuple)) or not all(
                isinstance(r, str) for r in ragged)):
            raise ValueError(f"ragged must be a list of field names, got {ragged!r}")
        jpeg_quality, max_side = _plain_int(jpeg_quality), _plain_int(max_side)
        encode = check_settings(encode, jpeg_quality, max_side)
        masks = [name for name, kind in (field_kinds or {}).items() if kind == "mask" and name in encode]
        if masks:
            raise ValueError(f"encode={encode!r} names the mask field {masks[0]!r} (field_kinds): JPEG is lossy and "
                             "would change its labels (and max_side would blend them); store masks as they are, "
                             f"naming the field in ragged=['{masks[0]}'] if its size varies")
        if max_side is not None and not encode:
            # It caps the images the store encodes only: without encode every image keeps its size.
            rank_zero_warn(f"max_side={max_side!r} caps the longest side of encoded images only, and encode names "
                           "no field: the images are stored at their own size. Add encode={'<image field>': "
                           "'jpeg'}, or resize in static_transform and leave max_side None.")
        if not store and (ragged or encode):
            raise ValueError(f"ragged={ragged!r} and encode={encode!r} describe how fields are stored; they need "
                             "store=True")
        self.batch_size = batch_size
        self._eval_batch_size = eval_batch_size  # None: follows batch_size (see the property)
        self.strategy = strategy
        self.vram_fraction = vram_fraction
        self.cache_dir = os.path.expanduser(os.fspath(cache_dir or default_cache_dir()))  # YAML configs write ~
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
        self.field_kinds = dict(field_kinds) if field_kinds is not None else None
        self.augment_field = augment_field
        self.augment_ahead = augment_ahead
        self._warned_unsharded = False
        self._warned_unkinded: set[str] = set()  # fields named once by _warn_unkinded_masks
        self._sent_nbytes: dict[str, tuple[Any, int]] = {}  # split -> (augment, bytes): _sent_row_nbytes
        self._resume_hint: tuple[int, ...] | None = None  # the checkpoint's train position, for its loader
        self._train_position: tuple[int, int, int] | None = None  # the last training loader's, at its teardown
        self.ragged = list(ragged) if ragged is not None else None
        self.encode = encode or None
        self.jpeg_quality = jpeg_quality
        self.max_side = max_side
        self.cuda_graphs = cuda_graphs
        self.keep_freed_memory = keep_freed_memory
        self._graphed: dict[int, GraphedAugment] = {}
        self.use_store = store
        self.device = device
        self.progress = progress
        self.plan: Plan | None = None
        self.stores: dict[str, Store] = {}
        self.placement: Placement | None = None
        self._raw: dict[str, Any] = {}
        #: Splits whose stage was torn down: their stores stay inspectable, but the next setup
        #: opens them again (the data may have changed since: a fingerprint decides reuse).
        self._stale: set[str] = set()
        #: Splits a setup opened (with or without a source): a loader of another split is refused.
        self._set_up: set[str] = set()
        self._loaders: dict[str, Any] = {}
        #: Every loader made for each split since its setup, with the Trainer request it answered.
        self._made: dict[str, list[tuple[Any, Any]]] = {}
        #: A fit's validation run started a loader iteration since training last closed them.
        self._validation_iterated = False
        self._restored_plan: dict[str, Any] | None = None
        # dm.hparams shows the whole configuration (the subclass's arguments included);
        # augmentations by their repr, so checkpoints and loggers get text, not objects.
        # Ignored, not deep-copied into hparams (an augmentation holding a lock or a large tensor,
        # an nn.Module Lightning warns about); put back below as text.
        self.save_hyperparameters(ignore=["train_augment", "eval_augment"], logger=False)
        # A subclass's own arguments (or its **kwargs) are saved as it got them: a numpy scalar it
        # passed on is shown as the plain value checked above.
        checked = {"batch_size": batch_size, "eval_batch_size": eval_batch_size, "vram_fraction": vram_fraction,
                   "num_workers": num_workers, "pin_memory": pin_memory, "prefetch_factor": prefetch_factor,
                   "persistent_workers": persistent_workers, "seed": seed, "augment_ahead": augment_ahead,
                   "jpeg_quality": jpeg_quality, "max_side": max_side, "keep_freed_memory": keep_freed_memory, **flags}
        for key, value in checked.items():
            for saved in (self._hparams, self._hparams_initial):
                if key in saved and _same_but_plain(saved[key], value):
                    saved[key] = value
        try:
            given = given_hyperparameters() or {}
        except DoorClosed:  # a Lightning before the CLI saved its config: the text, as for Python
            given = {}
        for key, augment in (("train_augment", train_augment), ("eval_augment", eval_augment)):
            # LightningCLI's config gives a {"class_path": ...} dict its instantiator rebuilds on
            # load_from_checkpoint: kept; an object is kept as its repr (see ``hparams``).
            config = given.get(key)
            value = config if isinstance(config, dict) else (repr(augment) if augment is not None else None)
            self.hparams[key] = value
            self._hparams_initial[key] = value  # what loggers record (a subclass that logs them)

    @property
    def eval_batch_size(self) -> int:
        """Batch size of val/test/predict: the one given, else ``batch_size``, followed when that
        changes (Lightning's ``Tuner.scale_batch_size(method="validate")`` sets ``batch_size``)."""
        return self._eval_batch_size or self.batch_size

    @eval_batch_size.setter
    def eval_batch_size(self, value: int | None) -> None:
        if value is not None:
            value = _checked_int("eval_batch_size", value, 1, math.inf, "an int > 0 or None")
        self._eval_batch_size = value
        if hasattr(self, "_hparams"):  # saved with checkpoints (a tuned value); None: follows batch_size
            if value is None:
                self._hparams.pop("eval_batch_size", None)
            else:
                self._hparams["eval_batch_size"] = value

    @property
    def hparams(self) -> Any:
        """Lightning's ``hparams``, the augmentations as their repr: a subclass's own
        ``save_hyperparameters()`` puts the objects back, and a checkpoint holding them cannot
        be loaded (torch's ``weights_only`` refuses the class), neither to resume nor by
        ``load_from_checkpoint``. An ``eval_batch_size`` left to follow ``batch_size`` is left
        out (Lightning's batch-size tuner read its None from here and failed on an assertion;
        a number here would be saved, and a module loaded with another ``batch_size`` would
        not follow it)."""
        hparams = _augments_as_text(super().hparams)
        if hparams.get("eval_batch_size", 0) is None:
            del hparams["eval_batch_size"]
        return hparams

    @property
    def hparams_initial(self) -> Any:
        """Lightning's ``hparams_initial`` (what loggers record), the augmentations as their repr."""
        return _augments_as_text(super().hparams_initial)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``LightningDataModule.load_from_checkpoint``.

        A checkpoint of a data module made in Python keeps ``train_augment`` and
        ``eval_augment`` as text (their repr, for loggers), which cannot be rebuilt: pass them
        again, e.g. ``MyData.load_from_checkpoint(path, train_augment=..., eval_augment=None)``.
        One LightningCLI made keeps their config, which Lightning's instantiator rebuilds.
        """
        try:
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)
        except Exception as e:
            clash = re.search(r"multiple values for keyword argument '(train_augment|eval_augment)'", str(e))
            if clash is not None:
                # The subclass passes this augmentation to super().__init__ itself, and the
                # checkpoint passes its text back next to it.
                name = clash.group(1)
                raise TypeError(
                    f"{cls.__name__}.load_from_checkpoint: {cls.__name__} passes {name} to "
                    f"OptimizedDataModule.__init__ itself, and the checkpoint's hparams hold its text too, passed "
                    f"back next to it; in {cls.__name__}.__init__, after super().__init__(...), drop it from the "
                    f"saved hyperparameters: del self.hparams[{name!r}] (its own arguments rebuild it)") from e
            missing = [k for k in ("train_augment", "eval_augment") if k not in kwargs and k in str(e)]
            if not missing:
                raise
            given = ", ".join(f"{k}=..." for k in missing)
            raise TypeError(
                f"{cls.__name__}.load_from_checkpoint: the checkpoint keeps {' and '.join(missing)} as text (the "
                f"augmentation's repr), which cannot be rebuilt; pass it again: "
                f"{cls.__name__}.load_from_checkpoint(path, {given})") from e

    def __getstate__(self) -> dict[str, Any]:
        """The configuration without the run's state (``_RUN_STATE``), for pickling.

        ``store=False`` workers get ``static_transform`` bound to this module, so the "spawn"
        start method pickles it; a copy is as if just made, and its ``setup`` opens the data again.
        """
        state = dict(self.__dict__)
        for name, fresh in _RUN_STATE.items():
            if name in state:
                state[name] = fresh()
        return state

    # ------------------------------------------------------------------ user hooks

    def source(self, split: str) -> Any:
        """Return the map-style dataset of ``split`` ("train", "val", "test", "predict"), or None."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement source(split) returning a Dataset (or None to skip a split)"
        )

    def static_transform(self, sample: Any) -> Any:
        """Deterministic per-sample preprocessing whose output is cached (identity by default)."""
        return sample

    # ------------------------------------------------------------------ caches

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
        same name (the usual ``self.root = root``); every other ``hparams`` entry that is not a
        loader setting is added (``save_hyperparameters({"clip": clip})`` with ``clip`` taken
        from ``**kwargs``). An argument kept only under another attribute name is not seen.
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
                        config[p.name] = _config_value(hparams[p.name])
                    elif p.name in vars(self):
                        config[p.name] = _config_value(vars(self)[p.name])
            if cls is OptimizedDataModule:
                break
        for name, value in hparams.items():
            # Lightning's CLI adds "_class_path" and "_instantiator" to the hparams of what it
            # builds: they say how the module was made, not what it caches (``fastdata plan``,
            # which builds it without them, would otherwise use another cache than ``fit``).
            if name not in config and name not in _NOT_CACHED and not name.startswith("_"):
                config[name] = _config_value(value)
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
                               config=self._cache_config(), files=self.source_files(split), warn=rank_zero_warn,
                               ragged=self.ragged, encode=self.encode, jpeg_quality=self.jpeg_quality,
                               max_side=self.max_side)
        except UnstorableSampleError as e:
            if self.ragged or self.encode:
                # Per-sample loading would ignore ragged/encode: samples of varying shapes then
                # fail to collate on the first batch, and JPEG fields would not be encoded.
                raise StoreError(
                    f"the '{split}' split cannot be stored ({e}), and ragged={self.ragged!r}, "
                    f"encode={self.encode!r} need it stored: make static_transform return only tensors, "
                    "ndarrays and numbers (drop that field, or convert it)"
                ) from None
            rank_zero_warn(f"lightning_fastdata: the '{split}' split cannot be stored ({e}); "
                           "loading it per sample in DataLoader workers instead")
            return None

    def prepare_data(self) -> None:
        """Cache every split's static outputs (Lightning runs this once per node)."""
        self._refuse_absent_cuda()
        for split, src in self._sources(SPLITS).items():
            self._store_for(split, src)

    def _open(self, split: str, src: Any) -> Store | None:
        """Open the split's store (sizes checked, no checksum pass); build it under the lock if missing."""
        return self._store_for(split, src, verify=False)

    def open_splits(self, splits: tuple[str, ...] = SPLITS) -> dict[str, Store]:
        """Open (or build) the store of each split with a source; returns the open stores.

        Splits whose samples cannot be stored are loaded per sample (see ``store``).
        """
        for split, src in self._sources(splits).items():
            if split in self._stale:
                self._stale.discard(split)
                old = self.stores.pop(split, None)
                if old is not None:
                    old.close()
                self._raw.pop(split, None)
            if split in self.stores or split in self._raw:
                continue
            store = self._open(split, src)
            if store is None:
                self._raw[split] = src
            else:
                self.stores[split] = store
                try:
                    self._check_ragged_channels(split, store, src)
                except StoreError:
                    self.stores.pop(split).close()
                    raise
        return self.stores

    def _refuse_absent_cuda(self) -> None:
        """``device="cuda"`` where there is none: said before any cache is built (the plan's
        probe of the device failed with torch's "Found no NVIDIA driver" after every build)."""
        if self.device is not None and torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise PlanError(f"device={self.device!r} asks for CUDA, but CUDA is not available on this machine "
                            "(torch.cuda.is_available() is False); set device='cpu', or leave it None for the "
                            "Trainer's device")

    def _check_ragged_channels(self, split: str, store: Store, src: Any) -> None:
        """Refuse a ragged image or mask field (by this module's kinds) whose samples differ in
        their channels, when the split's augmentation will batch them: it failed at the first
        batch that mixed them, naming a position in the batch. Without an augmentation the
        samples come as a list, as they are (a sequence, a clip, an image kept HWC)."""
        augment = self.train_augment if split == "train" else self.eval_augment
        if augment is None:
            return
        kinds = self.kinds(split, [i.name for i in store.infos])
        infos = [replace(i, kind=kinds[i.name]) for i in store.infos]
        for k, lead in fixed_leads(infos).items():
            field = store.fields[k]
            shapes = np.asarray(field.decoded if field.encoding else field.shapes)
            bad = np.flatnonzero((shapes[:, :lead] != shapes[0, :lead]).any(axis=1))
            if bad.size:
                i = int(bad[0])
                raise lead_error(infos[k], lead, sample_name(src, i), shapes[i], sample_name(src, 0), shapes[0])

    @property
    def raw_sources(self) -> dict[str, Any]:
        """Splits whose samples cannot be stored, by split: their sources, loaded per sample."""
        return dict(self._raw)

    # ------------------------------------------------------------------ plan and placement

    def target_device(self) -> torch.device:
        """Where batches are consumed: ``device`` if given, else the Trainer's root device."""
        if self.device is not None:
            return torch.device(self.device)
        trainer = self.trainer
        if trainer is not None:
            return trainer.strategy.root_device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _rank_world(self) -> tuple[int, int]:
        """This process's shard: the Trainer's, else the process group's, else the whole data.

        Without either, launcher variables alone (an ``sbatch -n4`` batch step runs one
        process with SLURM_NTASKS=4) would silently read a quarter of the data: warned instead.
        """
        trainer = self.trainer
        if trainer is not None:
            return trainer.global_rank, trainer.world_size
        if D.is_initialized():
            return D.rank(), D.world_size()
        if D.world_size() > 1 and not self._warned_unsharded:
            self._warned_unsharded = True
            rank_zero_warn(f"lightning_fastdata: the environment says this is rank {D.rank()} of {D.world_size()} "
                           "(RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS), but no process group is initialised "
                           "and no Trainer is attached: these loaders read every sample. To shard them, call "
                           "torch.distributed.init_process_group first, or let the Trainer run them.")
        return 0, 1

    def _local_place(self) -> tuple[int, int, int]:
        """(global rank, local rank, local world size) from the Trainer, else the launcher's environment."""
        trainer = self.trainer
        if trainer is not None:
            return trainer.global_rank, trainer.local_rank, trainer.num_devices
        return D.rank(), D.local_rank(), D.local_world_size()

    def make_plan(self, device: torch.device | None = None, local_world_size: int | None = None,
                  strategy: str | None = None, splits: Sequence[str] | None = None) -> Plan:
        """The plan for the open stores on ``device`` as one of ``local_world_size`` ranks; places nothing.

        ``strategy`` overrides the configured one (``fastdata bench`` tries each). ``splits``
        limits the stores counted against the memory budget (default: every open one).
        """
        device = device or self.target_device()
        local_world = self._local_place()[2] if local_world_size is None else local_world_size
        resources = probe_resources(device, local_world_size=local_world)
        config = self.plan_config(device)
        if strategy is not None:
            config["strategy"] = strategy
        counted = [st for sp, st in self.stores.items() if splits is None or sp in splits]
        plan = decide(None if self._raw else sum(s.nbytes for s in counted), resources, config)
        keep, why = self._host_memory_choice(device, plan)
        # What setup will do (setup applies it and records the state then in force).
        plan.reasons["host_memory"] = (f"{'kept for reuse' if keep else 'left alone'} from setup on: {why}"
                                       if not freed_memory_kept() else f"{host_memory_state()}: {why}")
        return plan

    def plan_config(self, device: torch.device | None = None) -> dict[str, Any]:
        """The settings :func:`~lightning_fastdata.plan.decide` reads, with the largest batch's bytes
        (those a worker sends counted for training on ``device``, default :meth:`target_device`)."""
        return {
            "strategy": self.strategy, "vram_fraction": self.vram_fraction,
            "num_workers": self.num_workers, "pin_memory": self.pin_memory,
            "prefetch_factor": self.prefetch_factor, "persistent_workers": self.persistent_workers,
            "store": self.use_store,
            "batch_nbytes": max((sum(i.row_nbytes for i in st.infos) * self._batch_size(split)
                                 for split, st in self.stores.items()), default=0),
            # What a worker sends through /dev/shm (its caps and the shared-memory headroom);
            # chunks hold stored rows and are sized by the stored batch above.
            "sent_batch_nbytes": max((self._sent_row_nbytes(split, st, device) * self._batch_size(split)
                                      for split, st in self.stores.items()), default=0),
        }

    def _sent_row_nbytes(self, split: str, store: Store, device: torch.device | None = None) -> int:
        """Bytes per sample of a batch a DataLoader worker sends: the stored row's (a ragged
        field's mean), or where the workers may augment (a CPU run without a ``device`` or
        ``chunked`` strategy), each field's largest augmented size among sample 0 and each ragged
        field's largest sample (once per split and augmentation, the global generators left as
        they were);
        the /dev/shm headroom and the workers' caps count it. Counted from the stored row
        only, a float32 ``Normalize`` output (4x) overran a small /dev/shm, and torch's workers
        then hung the fit."""
        stored = sum(i.row_nbytes for i in store.infos)
        augment = self.train_augment if split == "train" else self.eval_augment
        if (augment is None or len(store) == 0 or self.strategy in ("device", "chunked")
                or (device or self.target_device()).type != "cpu"):
            return stored
        known = self._sent_nbytes.get(split)
        if known is not None and known[0] is augment:
            return known[1]
        names = [i.name for i in store.infos]
        prepare = functools.partial(_prepared, augment=augment, seed=self.seed, stream=SPLITS.index(split),
                                    kinds=self.kinds(split, names))
        source = HostSource(list(store.fields))
        state = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[]):  # an augmentation not keyed by the samples draws
                grown = [prepared_row_nbytes(source, store.spec, names, prepare, row) for row in _extreme_rows(store)]
            # Per field, the largest of: its mean stored row, and what the augmentation made of
            # sample 0 and of the largest sample of each ragged field (a resize to a fixed size
            # gives the same for every sample, an elementwise op grows the largest the most).
            sent = max(stored, sum(max(info.row_nbytes, *(g[k] for g in grown)) for k, info in enumerate(store.infos)))
        except Exception:  # the first batch raises it where the user sees it: this is an estimate
            sent = stored
        finally:
            random.setstate(state[0])
            np.random.set_state(state[1])
        self._sent_nbytes[split] = (augment, sent)
        return sent

    def _batch_size(self, split: str) -> int:
        return self.batch_size if split == "train" else self.eval_batch_size

    def setup(self, stage: str | None = None) -> None:
        """Open the caches of the stage's splits, make the plan, and place the stores."""
        splits = SPLITS if stage is None else _STAGE_SPLITS.get(stage, SPLITS)
        self._refuse_absent_cuda()
        self.open_splits(splits)
        self._set_up.update(splits)
        self._check_field_kinds()
        device = self.target_device()
        rank, local_rank, local_world = self._local_place()
        placed = self.placement.sources if self.placement is not None else {}
        # Only the stage's splits are placed (a test after a fit must not put the train and val
        # stores released at the fit's teardown back on the device), and the budget counts
        # them with what is still placed.
        plan = self.make_plan(device, local_world, splits={*splits, *placed})
        config = self.plan_config(device)
        todo = {s: st for s, st in self.stores.items() if s in splits and s not in placed}
        sharing = Sharing(self.shared_memory, rank, local_rank, local_world, config["sent_batch_nbytes"])
        placement = place(todo, plan, device, config, {s: self._batch_size(s) for s in todo},
                          world_size=self._rank_world()[1], sharing=sharing)
        if self.placement is not None:
            placement.sources = {**self.placement.sources, **placement.sources}
            placement.segments = {**self.placement.segments, **placement.segments}
        self.placement, self.plan = placement, placement.plan
        if self.plan.num_workers_candidates:
            self._measure_workers(config, device, splits)
            self._unshare_unread(todo, device, config, sharing)
        self._host_memory(device)
        if self.trainer is not None:
            # The model's own batch hooks are run by this module's hooks (see on_after_batch_transfer).
            quiet_shared_hook_warnings()
        rank_zero_info(f"lightning_fastdata plan:\n{self.plan}")

    def _unshare_unread(self, todo: dict[str, Store], device: torch.device, config: dict[str, Any],
                        sharing: Sharing) -> None:
        """``num_workers="measure"`` chose no worker: a /dev/shm copy made for the candidate workers is
        read by this one process alone, so its splits are placed again without one (one process only:
        ranks measure on their own, and sharing is decided together)."""
        placement, plan = self.placement, self.plan
        assert placement is not None and plan is not None
        shared = {s: st for s, st in todo.items() if s in placement.segments}
        if (not shared or plan.num_workers > 0 or sharing.mode != "auto" or sharing.local_world_size > 1
                or self._rank_world()[1] > 1):
            return
        for split in shared:
            placement.release(split)
        again = place(shared, plan, device, config, {s: self._batch_size(s) for s in shared}, sharing=sharing)
        placement.sources.update(again.sources)
        placement.segments.update(again.segments)

    def _host_memory(self, device: torch.device) -> None:
        """Apply ``keep_freed_memory`` and record what is in force in the plan's reasons."""
        assert self.plan is not None
        keep, why = self._host_memory_choice(device, self.plan)
        if keep and not keep_freed_memory():
            why = "not glibc: nothing to change"
        self.plan.reasons["host_memory"] = f"{host_memory_state()}: {why}"

    def _host_memory_choice(self, device: torch.device, plan: Plan) -> tuple[bool, str]:
        """Whether ``setup`` keeps freed memory under ``plan``, and why."""
        if self.keep_freed_memory is True:
            return True, "set by configuration"
        if self.keep_freed_memory is False:
            return False, "left alone by configuration"
        if device.type == "cpu" and plan.num_workers == 0:
            return True, ("this process builds every batch on the CPU (no workers): their buffers are reused, not "
                          "page-faulted in afresh each step")
        return False, "batches are built on an accelerator or in DataLoader workers: nothing to gain in this process"

    def _refuse_unset(self, split: str) -> None:
        """A loader asked for a split the current stage did not set up (a ``val_dataloader``
        that returns ``self.test_dataloader()`` in a fit): an error naming the setup to run,
        not an empty loader or a KeyError. A split without a source is no error: ``[]``."""
        if split not in self.stores and split not in self._raw and self.source(split) is None:
            return
        stage = next(st for st, sp in _STAGE_SPLITS.items() if split in sp)
        raise RuntimeError(
            f"{type(self).__name__}.{split}_dataloader(): the '{split}' split is not set up for this stage (Lightning "
            f"sets up the stage's splits only; a teardown releases them): call self.setup({stage!r}) before asking "
            f"for its loader")

    def _measure_workers(self, config: dict[str, Any], device: torch.device, splits: Sequence[str]) -> None:
        """``num_workers="measure"``: time the candidates on the loader of the stage's first split (see autotune)."""
        from lightning_fastdata.autotune import measure_num_workers

        assert self.placement is not None
        # A split of this stage: a test after a fit must not time the train split it released.
        split = next((s for s in SPLITS if s in splits and (s in self.placement.sources or s in self._raw)), None)
        if split is None or self.plan is None:
            return
        measure_num_workers(self.plan, self.plan.resources, config, lambda trial: self.build_loader(split, trial),
                            device)

    def teardown(self, stage: str | None = None) -> None:
        """Release device copies, shared memory and loaders of the stage's splits, and of any
        split whose loader this stage asked for (a fit's ``val_dataloader`` that also returns
        the test split's loader)."""
        stage = stage or "fit"
        asked = [s for s, made in self._made.items()
                 if any(request is not None and request[0] == stage for request, _ in made)]
        for split in dict.fromkeys([*_STAGE_SPLITS.get(stage, ()), *asked]):
            self._stale.add(split)
            loader = self._loaders.pop(split, None)
            if split == "train" and hasattr(loader, "state_dict"):
                self._train_position = _position_of(loader)
            for _, made in self._made.pop(split, []):
                _close(made)  # persistent workers must not outlive the stage (every loader made for it)
            if self.placement is not None:
                self.placement.release(split)
        for graphed in self._graphed.values():
            graphed.clear()  # captured graphs hold device memory

    def on_exception(self, exception: BaseException) -> None:
        """The Trainer stopped on an exception (it skips ``teardown`` then): release what
        ``teardown`` would, for every split: the loaders' background threads and worker
        processes, the device copies and the shared-memory segments (each failed fit in a
        long-lived process, a sweep's pruned trials say, kept a whole store in RAM). The next
        ``setup`` places the stores again."""
        for stage in _STAGE_SPLITS:
            self.teardown(stage)

    # ------------------------------------------------------------------ loaders

    def build_loader(self, split: str, plan: Plan | None = None) -> Any:
        """A new loader of ``split`` under ``plan`` (default: the plan in force); ``[]`` without a source."""
        plan = plan or self.plan
        if plan is None or self.placement is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before {split}_dataloader()")
        if split not in self._set_up or (split in self.stores and split not in self.placement.sources):
            self._refuse_unset(split)
        if split not in self.stores and split not in self._raw:
            return []
        rank, world = self._rank_world()
        train = split == "train"
        n = len(self.stores[split]) if split in self.stores else len(self._raw[split])
        # Prediction gives every sample to one rank (Lightning's UnrepeatedDistributedSamplerWrapper):
        # padding would predict some samples twice.
        if split == "predict" and n < world:
            # A rank with no sample gets an empty loader, which Lightning refuses with a message
            # that names neither the split's size nor the ranks; every rank sees the same n and
            # world, so all stop here together (no rank left waiting in a collective).
            raise ValueError(f"the predict split has {n} sample(s) for {world} ranks: with no padding (each sample "
                             f"predicted once), rank {n} and above would predict nothing; predict on at most {n} "
                             f"device(s) (Trainer(devices={n})) or on more samples")
        # overfit_batches: the same first batches every epoch (Lightning turns a DataLoader's
        # shuffling off, but can do nothing to these loaders, which have no dataset).
        overfit = self.trainer is not None and bool(self.trainer.overfit_batches)
        kw = dict(shuffle=self.shuffle and train and not overfit, drop_last=self.drop_last and train, seed=self.seed,
                  rank=rank, world_size=world, pad=split != "predict")
        if split in ("val", "test") and world > 1 and n % world:
            self._warn_padded_evaluation(split, n, world)
        source = self.placement.sources.get(split)
        if isinstance(source, ChunkedSource) and source.rows % self._batch_size(split):
            source = self._rechunk(split, source, plan, world)
        if isinstance(source, ChunkedSource) and plan.chunk_mode == "block":
            order: ShardedOrder = BlockOrder(n, self._batch_size(split), rows=source.rows, **kw)
        else:
            order = ShardedOrder(n, self._batch_size(split), **kw)
        # An evaluation's epoch stays 0 (Lightning sets the fit's epoch on its loaders): a random
        # eval_augment gives each fit epoch's validation the same samples, so its metric moves
        # with the model only, and trainer.validate after the fit reproduces it; a test or a
        # prediction is the same whether or not this Trainer fitted before.
        order.held = not train
        if source is not None and not isinstance(source, HostSource):
            store = self.stores[split]
            augment = self.train_augment if train else self.eval_augment
            # A model hook that runs before the transfer must see the batch before its augmentation.
            early_hooks = any(self._model_hook(h) is not None for h in _BATCH_HOOKS[:2])
            prepare = (None if augment is None or early_hooks else
                       functools.partial(self._loader_augment, split=split, augment=augment))
            names = [i.name for i in store.infos]
            defer = (self._deferred_fields(source, augment, self.kinds(split, names), names)
                     if prepare is not None else frozenset())
            return IndexLoader(source, order, store.spec, names, prepare=prepare,
                               ahead=self._ahead(source.device), defer=defer)
        seeding = WorkerSeeding(self.seed, rank, split=split)
        seeding.follow(order)  # workers seeded per (seed, split, rank, worker, epoch)
        loader_kw = dict(num_workers=plan.num_workers, pin_memory=plan.pin_memory,
                         prefetch_factor=plan.prefetch_factor, persistent_workers=plan.persistent_workers,
                         worker_init_fn=seeding)
        if source is not None:
            store = self.stores[split]
            names = [i.name for i in store.infos]
            augment = self.train_augment if train else self.eval_augment
            # Training on the CPU: the workers augment (keyed by the samples, so where does not
            # matter) and the training process only trains. On an accelerator the batch is
            # augmented there, after its transfer.
            in_workers = (augment is not None and plan.num_workers > 0 and self.target_device().type == "cpu"
                          and not any(self._model_hook(h) is not None for h in _BATCH_HOOKS[:2]))
            prepare = (functools.partial(_prepared, augment=augment, seed=self.seed, stream=SPLITS.index(split),
                                         kinds=self.kinds(split, names)) if in_workers else None)
            return WorkerLoader(order, source=source, spec=store.spec, names=names, prepare=prepare, **loader_kw)
        return WorkerLoader(order, dataset=transformed(self._raw[split], self.static_transform), **loader_kw)

    def _rechunk(self, split: str, source: ChunkedSource, plan: Plan, world: int) -> ChunkedSource:
        """``source`` with chunk buffers cut in whole batches of the current batch size: the
        batch size changed since setup (Lightning's ``Tuner.scale_batch_size`` does), and
        chunks sized for the old one do not hold whole batches of the new one."""
        assert self.placement is not None
        source.close()
        buffers = ChunkBuffers.for_store(self.stores[split], source.device, plan.chunk_bytes, self._batch_size(split),
                                         world_size=world, pin=source.buffers.pinned)
        again = ChunkedSource(source.host, buffers, fill_threads=source.fill_threads)
        self.placement.sources[split] = again
        return again

    def _deferred_fields(self, source: Any, augment: Any, kinds: dict[str, str], names: list[str]) -> frozenset[int]:
        """The fields the loader hands to ``augment`` as rows of the store, not gathered: every
        image and mask field when the store is whole on the device and ``augment`` starts with
        a crop, which then cuts its windows from the store (a 96^3 window of a 128^3 volume
        reads 42% of it, and the whole volume is never copied). Else none. Not under CUDA graph
        replay (its captured batch is gathered; unmeasured against it on a GPU, so unchanged)."""
        graphed = self.cuda_graphs and source.device.type == "cuda"
        if not isinstance(source, DeviceSource) or graphed or not starts_with_crop(augment):
            return frozenset()
        wanted = frozenset(k for k, n in enumerate(names) if kinds.get(n, "other") != "other")
        return wanted if wanted and wanted <= source.deferrable() else frozenset()

    def _ahead(self, device: torch.device) -> int:
        if self.augment_ahead != _AUTO:
            return int(self.augment_ahead)
        return 1 if device.type == "cuda" else 0

    def _make_loader(self, split: str) -> Any:
        loader = self.build_loader(split)
        if loader != []:
            self._loaders[split] = loader
            augment = self.train_augment if split == "train" else self.eval_augment
            loader.augmented_later = augment is not None and getattr(loader, "prepare", None) is None
            loader.split = split  # its batches are augmented as this split's, in whatever loop they run
            # Loaders made for an earlier request and not being iterated (those
            # reload_dataloaders_every_n_epochs replaced) are closed now, not left holding
            # worker processes until a garbage collection; those of this request (a list of
            # several) are kept, and every one is closed at the teardown.
            trainer = self.trainer
            request = ((trainer.state.fn, trainer.state.stage, trainer.current_epoch, trainer.global_step)
                       if trainer is not None else None)
            made = self._made.setdefault(split, [])
            for old_request, old in list(made):
                # Outside a Trainer every request is a new one (a dropped loader must not be kept
                # alive here); an idle loader closed and used again restarts its workers.
                if (request is None or old_request != request) and not getattr(old, "active", 0):
                    _close(old)
                    made.remove((old_request, old))
            made.append((request, loader))
            if split == "predict":
                loader.index_record = batch_index_record(loader)  # batch_indices for prediction writers
            if hasattr(loader, "iteration_tag"):
                loader.iteration_tag = self._validation_in_fit
            if split == "train" and hasattr(loader, "steps_in_flight"):
                loader.steps_in_flight = self._train_steps_in_flight
                loader.epoch_batches = self._train_epoch_batches
                loader.resume_hint, self._resume_hint = self._resume_hint, None
            if split == "train":
                self._warn_dataloader_iter()
        return loader

    def _warn_padded_evaluation(self, split: str, n: int, world: int) -> None:
        """Say that a ``trainer.validate``/``trainer.test`` on several ranks counts some samples
        twice, as Lightning says for the ``DistributedSampler`` it puts in a plain loader (it
        puts none in these loaders, so it never said so for them)."""
        trainer = self.trainer
        fn = getattr(trainer.state.fn, "value", None) if trainer is not None else None
        if fn not in ("validate", "test"):
            return
        extra = world - n % world
        rank_zero_warn(
            f"lightning_fastdata: trainer.{fn}() on {world} ranks: the {split} split's {n} samples are "
            f"padded to {n + extra} with {extra} repeated (every rank gets as many batches, as DistributedSampler "
            "does), so those are counted twice in the metrics; for each sample evaluated exactly once, run it on "
            "one device: Trainer(devices=1, num_nodes=1)", category=PossibleUserWarning)

    def _warn_dataloader_iter(self) -> None:
        """A ``training_step(dataloader_iter)`` gets batches no Lightning hook has seen (Lightning
        transfers nothing then): this module's augmentation runs only where the loader applies
        it itself (device, chunked, workers on the CPU), so say how to get the same batches everywhere."""
        trainer = self.trainer
        model = trainer.lightning_module if trainer is not None else None
        if model is None or self.train_augment is None:
            return
        if not is_param_in_hook_signature(model.training_step, "dataloader_iter", explicit=True):
            return
        rank_zero_warn(
            f"{type(model).__name__}.training_step takes a dataloader_iter: Lightning then calls no batch transfer "
            f"hook, so {type(self).__name__} cannot move or augment the batches, and the loader augments them "
            "itself under some strategies only. Call `batch = self.trainer.datamodule.augment_batch("
            "batch.to(self.device))` on each batch the iterator yields: the same augmented batch under every "
            "strategy (a batch its loader augmented already is returned as it is)."
        )

    def _train_epoch_batches(self) -> int | None:
        """Batches of a training epoch as the Trainer runs it (``limit_train_batches`` applied), or None."""
        trainer = self.trainer
        n = getattr(trainer, "num_training_batches", None) if trainer is not None else None
        return int(n) if isinstance(n, (int, float)) and math.isfinite(n) else None

    def _train_steps_in_flight(self) -> tuple[int, int] | None:
        """(epoch, training batches transferred whose step has not finished) during a fit."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != "fit":
            return None
        pending = training_steps_in_flight(trainer)
        if pending is None:  # a Lightning without this progress tracker: count transfers only
            return None
        return int(trainer.current_epoch), pending

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

    # ------------------------------------------------------------------ batches

    def _current_split(self) -> str:
        trainer = self.trainer
        if trainer is None or trainer.training:
            return "train"
        if trainer.testing:
            return "test"
        if trainer.predicting:
            return "predict"
        return "val"

    def _model_hook(self, name: str) -> Any:
        """The LightningModule's own ``name`` hook when it overrides Lightning's, else None."""
        trainer = self.trainer
        model = trainer.lightning_module if trainer is not None else None
        if model is None or not is_overridden(name, model, parent=L.LightningModule):
            return None
        return getattr(model, name)

    def _through_structure(self, batch: FastBatch, hook: str, call: Any) -> FastBatch:
        """Run a model hook on the sample structure of ``batch``; it must keep the fields."""
        out = call(batch.structure())
        spec, names, leaves = flatten_batch(out)
        if names != batch.names:
            raise RuntimeError(
                f"{type(self.trainer.lightning_module).__name__}.{hook} returned a batch with fields {names}, "
                f"the data module's loader yields {batch.names}: a hook that changes the batch's structure "
                "must run after the augmentation; move it to on_after_batch_transfer"
            )
        n = len(batch.indices)
        split = self._current_split()
        augment = self.train_augment if split == "train" else self.eval_augment
        for name, leaf in zip(names, leaves, strict=True) if augment is not None else ():  # keyed by index
            shape = getattr(leaf, "shape", None)
            got = len(leaf) if isinstance(leaf, (list, RaggedBatch)) else int(shape[0]) if shape else n
            if got != n:
                raise RuntimeError(
                    f"{type(self.trainer.lightning_module).__name__}.{hook} returned field '{name}' with {got} "
                    f"samples, the batch has {n}: each sample's augmentation is keyed by its index, so a hook "
                    "that drops or adds samples must run after the augmentation; move it to on_after_batch_transfer"
                )
        # Still the loader's batch: its loader counts it as used (resume), its split and pending state hold.
        return batch.with_leaves(leaves)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Run the LightningModule's own ``on_before_batch_transfer`` on the sample structure."""
        hook = self._model_hook("on_before_batch_transfer")
        if hook is None:
            return batch
        if isinstance(batch, FastBatch):
            return self._through_structure(batch, "on_before_batch_transfer", lambda s: hook(s, dataloader_idx))
        return hook(batch, dataloader_idx)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move the batch and its sample indices to ``device`` (the fields by the model's own hook, if any)."""
        hook = self._model_hook("transfer_batch_to_device")
        if isinstance(batch, FastBatch):
            if hook is None:
                return batch.to(device, non_blocking=True)
            moved = self._through_structure(batch, "transfer_batch_to_device", lambda s: hook(s, device,
                                                                                             dataloader_idx))
            moved.indices = batch.indices.to(device, non_blocking=True)
            return moved
        if hook is not None:
            return hook(batch, device, dataloader_idx)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Augment each sample on the device, keyed by (seed, epoch, sample index), then run the model's hook.

        The batch must come from this data module's loaders (it carries its sample
        indices); with ``train_augment``/``eval_augment`` set, any other batch is an error.
        The LightningModule's own ``on_after_batch_transfer`` runs after the augmentation,
        on the sample structure.
        """
        split = self._current_split()
        augment = self.train_augment if split == "train" else self.eval_augment
        if split == "train":
            self._close_evaluations()
        if isinstance(batch, FastBatch):
            if batch.loader is not None:
                batch.loader.consumed(batch)  # resume counts batches used, not those fetched ahead
            out = self._finish(batch, split, augment)
        elif isinstance(batch, (dict, list, tuple)) and any(
                isinstance(b, FastBatch) for b in (batch.values() if isinstance(batch, dict) else batch)):
            # Several loaders of this module combined by Lightning (a dict or list returned by
            # a *_dataloader override): each batch carries its own indices, and is counted as
            # used by its own loader (else a checkpoint saved while its step runs skips it).
            def finish(b: Any) -> Any:
                if not isinstance(b, FastBatch):
                    return b
                if b.loader is not None:
                    b.loader.consumed(b)
                return self._finish(b, split, augment)

            out = ({k: finish(v) for k, v in batch.items()} if isinstance(batch, dict)
                   else type(batch)(finish(b) for b in batch))
        elif augment is not None:
            raise RuntimeError(
                f"{type(self).__name__}: a {split} batch of type {type(batch).__name__} reached "
                "on_after_batch_transfer without its sample indices, so its augmentation cannot be keyed "
                "per sample; it did not come from this data module's loaders (a dataloader passed to "
                "the Trainer directly, or a *_dataloader override?): return the loaders of "
                f"{type(self).__name__}, or set {'train' if split == 'train' else 'eval'}_augment=None. With "
                "several of its loaders combined, a model's on_before_batch_transfer or transfer_batch_to_device "
                "gets their batches as they are and may have replaced them: move it to on_after_batch_transfer"
            )
        else:
            out = batch
        hook = self._model_hook("on_after_batch_transfer")
        return hook(out, dataloader_idx) if hook is not None else out

    def _validation_in_fit(self) -> str | None:
        """The tag of an iteration a fit's validation run (or sanity check) starts, else None."""
        trainer = self.trainer
        if trainer is not None and trainer.state.fn == "fit" and (trainer.sanity_checking or trainer.validating):
            self._validation_iterated = True
            return _VALIDATION_IN_FIT
        return None

    def _close_evaluations(self) -> None:
        """Training goes on in a fit: its validation runs are over, and one cut short (the
        sanity check, ``limit_val_batches``) left its iteration open, which Lightning keeps until
        the next run; its background thread and the batches it made ahead (device memory on a
        GPU), or its worker processes, are freed now. Only iterations a validation run started:
        a loader of another split iterated in training (a val loader among the training
        loaders, a callback's own evaluation) is never cut."""
        if not self._validation_iterated:
            return  # the per-batch cost while no validation run started an iteration: one attribute read
        trainer = self.trainer
        if trainer is None or trainer.state.fn != "fit" or not trainer.training:
            return
        self._validation_iterated = False
        for made in self._made.values():
            for _, loader in made:
                if getattr(loader, "active", 0):
                    loader.close_iterations(_VALIDATION_IN_FIT)

    def _finish(self, batch: FastBatch, split: str, augment: BatchTransform | None) -> Any:
        """A batch of this module's loaders in the sample's structure, augmented unless its loader did.

        A batch of another split's loader (a val loader among the training loaders) gets its
        own split's augmentation, as the ``device`` loader, which augments it itself, gives it.
        """
        if batch.split is not None and batch.split != split:
            split = batch.split
            augment = self.train_augment if split == "train" else self.eval_augment
        if batch.prepared:
            return batch.structure()
        if augment is None:
            return unflatten(batch.spec, self.unragged(batch))
        return self.augment_batch(batch, augment, split)

    def _loader_augment(self, batch: FastBatch, split: str, augment: BatchTransform) -> FastBatch:
        """The loader's hook: augment a freshly gathered batch (ahead of the step, see ``augment_ahead``)."""
        leaves = self._augmented_leaves(batch, augment, split)
        return FastBatch(leaves, batch.spec, batch.names, batch.indices, batch.epoch, batch.index, prepared=True)

    def augment_batch(self, batch: FastBatch, augment: BatchTransform | None = None, split: str = "train") -> Any:
        """Augment a batch from this module's loaders; returns it in the sample's structure.

        Every random parameter of a sample is a pure function of (seed, epoch, the sample's
        global index, the op's position): the same whatever the batch, rank or strategy.

        A batch its loader augmented ahead (``batch.prepared``, see ``augment_ahead``) is
        returned as it is.

        Args:
            batch: A batch from one of this module's loaders (on the training device).
            augment: The transform (default: ``train_augment`` for "train", else ``eval_augment``).
            split: Which split the batch is from.
        """
        if not isinstance(batch, FastBatch):
            raise TypeError(f"augment_batch needs a batch from this data module's loaders, got "
                            f"{type(batch).__name__}")
        if augment is None:
            augment = self.train_augment if split == "train" else self.eval_augment
        if batch.prepared:
            return batch.structure()  # a prepared batch was augmented by its loader already
        if augment is None:
            return unflatten(batch.spec, self.unragged(batch))
        return unflatten(batch.spec, self._augmented_leaves(batch, augment, split))

    @staticmethod
    def unragged(batch: FastBatch) -> list[Any]:
        """The batch's leaves with each ragged field as a list of per-sample tensors.

        A JPEG field's bytes stay in host memory (the decoders read them there) and are
        decoded onto the batch's device (``decode.decode_jpegs``: one batched nvJPEG call on
        CUDA, threads on the CPU) into uint8 ``(C, H, W)`` tensors; any other ragged field
        becomes views of its values (no copy).
        """
        return _unragged(batch)

    def _augmented_leaves(self, batch: FastBatch, augment: BatchTransform, split: str) -> list[Any]:
        return _augment_leaves(batch, self._runner(augment), self.seed, SPLITS.index(split),
                               self.kinds(split, batch.names))

    def _runner(self, augment: BatchTransform) -> Any:
        """``augment``, or with ``cuda_graphs`` its graph-replaying wrapper (one per transform; it runs
        batches off CUDA eagerly)."""
        if not self.cuda_graphs:
            return augment
        graphed = self._graphed.get(id(augment))
        if graphed is None or graphed.augment is not augment:
            graphed = self._graphed[id(augment)] = GraphedAugment(augment, warn=rank_zero_warn)
        return graphed

    # ------------------------------------------------------------------ field kinds

    def kinds(self, split: str, names: list[str] | None = None) -> dict[str, str]:
        """The kind ("image", "mask", "other") of each field of ``split``."""
        store = self.stores.get(split)
        if names is None:
            names = [i.name for i in store.infos] if store is not None else []
        recorded = getattr(store, "kinds", None) or {}
        kinds = {n: recorded.get(n, "image" if k == 0 else "other") for k, n in enumerate(names)}
        if self.augment_field is not None:
            kinds = {n: "image" if n == self.augment_field else "other" for n in names}
        for name, kind in (self.field_kinds or {}).items():
            if name in kinds:
                kinds[name] = kind
        return kinds

    def _check_field_kinds(self) -> None:
        named = dict(self.field_kinds or {})
        if self.augment_field is not None:
            named[self.augment_field] = "image"
        for split, store in self.stores.items():
            fields = [i.name for i in store.infos]
            for name in named:
                if name not in fields:
                    key = "augment_field" if name == self.augment_field else "field_kinds"
                    raise StoreError(f"{key} names a field {name!r} that the '{split}' samples do not have; "
                                     f"their fields are {fields} (dict keys, or positions '0', '1' for tuples)")
            augment = "train_augment" if split == "train" else "eval_augment"
            if getattr(self, augment) is not None:
                self._check_augmented_shapes(split, store, augment)
                self._warn_unkinded_masks(split, store, augment)

    def _check_augmented_shapes(self, split: str, store: Store, augment: str) -> None:
        """Refuse, at setup, an image (mask) field whose samples have too few dimensions to be one.

        The augmentation would fail on the first batch with an error about ``spatial_dims``,
        which a data module user cannot pass; the usual cause is the default kinds (the
        first field is the image), e.g. a label before a JPEG image in a dict sample.
        """
        kinds = self.kinds(split)
        for info in store.infos:
            kind = kinds.get(info.name, "other")
            ndim = 3 if info.encoding else len(info.shape)  # an encoded image decodes to (C, H, W)
            if (kind == "image" and ndim < 3) or (kind == "mask" and ndim < 2):
                shape = "(varies)" if info.ragged else str(info.shape)
                raise ValueError(
                    f"{augment} gets the '{split}' field {info.name!r} as {'an' if kind == 'image' else 'a'} "
                    f"{kind} (kinds: {kinds}; without field_kinds the first field is the image), but its samples "
                    f"have {ndim} dimension(s) {shape}; an image needs (C, H, W) or (C, D, H, W), a mask (H, W) or "
                    "more: name each field's kind in field_kinds (e.g. {'image': 'image', 'label': 'other'}), "
                    "or add the channel dimension in static_transform (x[None])"
                )

    def _warn_unkinded_masks(self, split: str, store: Store, augment: str) -> None:
        """Warn once per field of a field kept ``other`` by default (not named in ``field_kinds``
        or by ``augment_field``) that has the image's spatial size when ``augment`` moves pixels.

        No op moves an ``other`` field: a per-pixel label left so stays put while its image is
        flipped or cropped, silently. Ragged sizes are compared sample by sample, from the
        shapes the store recorded; a JPEG field has none recorded, and is not compared.
        """
        if self.augment_field is not None or not getattr(getattr(self, augment), "moves_pixels", True):
            return
        kinds, named = self.kinds(split), self.field_kinds or {}
        image = next((k for k, i in enumerate(store.infos) if kinds.get(i.name) == "image"), None)
        image_shapes = _sample_shapes(store, image) if image is not None else None
        if image is None or image_shapes is None or image_shapes.shape[1] < 2:
            return
        spatial = image_shapes[:, 1:]  # (C, *spatial)
        for k, info in enumerate(store.infos):
            if kinds.get(info.name) != "other" or info.name in named or info.name in self._warned_unkinded:
                continue
            shapes = _sample_shapes(store, k)
            if shapes is None or shapes.shape[1] < spatial.shape[1]:
                continue
            if not (shapes[:, shapes.shape[1] - spatial.shape[1]:] == spatial).all():
                continue
            self._warned_unkinded.add(info.name)
            name, image_name = info.name, store.infos[image].name
            rank_zero_warn(
                f"lightning_fastdata: {augment} moves the '{split}' image field {image_name!r} and not the field "
                f"{name!r}, which has the image's spatial size but the kind 'other' (its default: not named in "
                f"field_kinds), and no op moves an 'other' field. If it is a per-pixel label, pass "
                f"field_kinds={{{name!r}: 'mask'}} (moved with the image, nearest-neighbour); if not, "
                f"field_kinds={{{name!r}: 'other'}} to silence this warning"
            )

    # ------------------------------------------------------------------ checkpoints

    def data_plan(self) -> dict[str, Any]:
        """What decides the batches of this run: strategy, order mode, seed, batching and store fingerprints."""
        plan = self.plan
        return {
            "strategy": plan.strategy if plan is not None else self.strategy,
            "chunk_mode": plan.chunk_mode if plan is not None and plan.strategy == "chunked" else "global",
            "seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last,
            "batch_size": self.batch_size,
            "fingerprints": {s: st.fingerprint for s, st in sorted(self.stores.items())},
        }

    def state_dict(self) -> dict[str, Any]:
        """Saved in checkpoints: the data plan (see :meth:`data_plan`) and the training loader's
        position (Lightning keeps its own copy; this one survives a resume that skips it)."""
        state: dict[str, Any] = {"data_plan": self.data_plan()}
        loader = self._loaders.get("train")
        if hasattr(loader, "state_dict"):
            self._train_position = _position_of(loader)
        if self._train_position is not None:  # after the fit's teardown too (trainer.save_checkpoint)
            state["train_position"] = list(self._train_position)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """On resume: warn, naming both plans, when this run's data plan differs from the checkpoint's."""
        saved = state_dict.get("data_plan")
        if not saved:
            return
        self._restored_plan = saved
        trainer = self.trainer
        if trainer is not None and trainer.state.fn != "fit":
            return  # a test, validate or predict from a checkpoint resumes no batches: nothing to differ
        position = state_dict.get("train_position")
        self._resume_hint = tuple(int(v) for v in position) if position else None
        now = self.data_plan()
        differ = [k for k in _PLAN_KEYS if k in saved and not _same_plan_value(k, saved[k], now[k])]
        if not differ:
            return
        batches = [k for k in differ if k != "strategy"]
        effect = ("the remaining batches will differ from those of the run the checkpoint came from"
                  if batches else "the batches are the same (every strategy yields the same samples in the "
                  "same order)")
        rank_zero_warn(
            f"lightning_fastdata: resuming with a different data plan ({', '.join(differ)} changed): {effect}. "
            f"checkpoint: {_plan_text(saved, differ)}; this run: {_plan_text(now, differ)}"
        )


def _same_plan_value(key: str, saved: Any, now: Any) -> bool:
    """Whether a data plan's ``key`` is unchanged; fingerprints of the splits both plans hold
    (a split one of them never opened has nothing to compare)."""
    if key == "fingerprints" and isinstance(saved, dict) and isinstance(now, dict):
        return all(saved[s] == now[s] for s in saved.keys() & now.keys())
    return saved == now


def _plan_text(plan: dict[str, Any], keys: list[str]) -> str:
    parts = []
    for k in keys:
        v = plan.get(k)
        if k == "fingerprints" and isinstance(v, dict):
            v = {s: f[:16] for s, f in v.items()}
        parts.append(f"{k}={v!r}")
    return ", ".join(parts)


def _sample_shapes(store: Store, k: int) -> np.ndarray | None:
    """Field ``k``'s per-sample shapes, ``(N, ndim)`` (one row for a fixed-size field); None for
    a JPEG field (its decoded size is not its stored one)."""
    info = store.infos[k]
    if info.encoding is not None:
        return None
    if info.ragged:
        return np.asarray(store.fields[k].shapes)
    return np.asarray(info.shape, dtype=np.int64).reshape(1, -1)


def _unragged(batch: FastBatch) -> list[Any]:
    out: list[Any] = []
    for leaf in batch.leaves:
        if isinstance(leaf, RaggedBatch):
            tensors = leaf.tensors()
            if leaf.encoding == "jpeg":
                channels = leaf.decoded_shapes[:, 0].tolist() if leaf.decoded_shapes is not None else None
                tensors = decode_jpegs(tensors, batch.indices.device, indices=batch.indices, channels=channels)
            out.append(tensors)
        else:
            out.append(leaf)
    return out


def _augment_leaves(batch: FastBatch, augment: Any, seed: int, stream: int, kinds: dict[str, str]) -> list[Any]:
    """The batch's leaves augmented, every sample keyed by (seed, stream, epoch, its global index)."""
    keys = SampleKeys(seed, batch.epoch, batch.indices, stream=stream)
    fields = dict(zip(batch.names, _unragged(batch), strict=True))
    out = augment(Batch(fields, kinds, keys))
    return [out.fields[name] for name in batch.names]


def _config_value(value: Any) -> Any:
    """An init argument as the cache fingerprint sees it: tuples as lists, paths as strings,
    through lists and dicts. A ``tuple[int, int]`` argument arrives as a list from a YAML
    file under ``fit`` (LightningCLI keeps the loaded values) and as a tuple from Python or
    ``fastdata plan``: the same configuration must find the same cache."""
    if isinstance(value, (tuple, list)):
        return [_config_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _config_value(v) for k, v in value.items()}
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def _prepared(batch: FastBatch, augment: BatchTransform, seed: int, stream: int, kinds: dict[str, str]) -> FastBatch:
    """A DataLoader worker's prepare step (module-level, so a spawned worker can unpickle it)."""
    leaves = _augment_leaves(batch, augment, seed, stream, kinds)
    return FastBatch(leaves, batch.spec, batch.names, batch.indices, batch.epoch, batch.index, prepared=True)


def _extreme_rows(store: Store) -> list[int]:
    """Sample 0 and the largest sample of each ragged field (decoded size for JPEG bytes)."""
    rows = {0}
    for field in store.fields:
        if isinstance(field, RaggedArray) and len(field):
            sizes = field.decoded if field.decoded is not None else field.shapes
            rows.add(int(np.prod(sizes, axis=1).argmax()))
    return sorted(rows)


def _position_of(loader: Any) -> tuple[int, int, int]:
    """A training loader's ``(epoch, batches used, batches)``, as its checkpoint state says."""
    state = loader.state_dict()
    return int(state["epoch"]), int(state["batch"]), int(state["batches"])


def _augments_as_text(hparams: Any) -> Any:
    """``hparams`` with augmentation objects replaced by their repr, in place."""
    for key in ("train_augment", "eval_augment"):
        if isinstance(hparams.get(key), BatchTransform):
            hparams[key] = repr(hparams[key])
    return hparams


def _close(loader: Any) -> None:
    """Stop a loader's background threads and worker processes (loaders without ``close`` have none)."""
    if hasattr(loader, "close"):
        loader.close()
