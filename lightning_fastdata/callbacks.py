"""``FastDataCallback``: the one callback users add to their ``Trainer``.

It works with any LightningDataModule or plain dataloaders, not only
:class:`~lightning_fastdata.OptimizedDataModule`:

* profiles data wait vs compute for every step (:class:`DataWaitProfiler`, on by default);
* calls ``set_epoch(epoch)`` at each training epoch start on the objects Lightning skips:
  Lightning reaches ``loader.sampler`` and ``loader.batch_sampler.sampler`` only, so an
  ``IterableDataset`` that shuffles per epoch, a custom batch sampler or a loader object
  with its own ``set_epoch`` would otherwise replay epoch 0's order forever;
* logs the plan (or, for a plain loader, its settings) once to the Trainer's loggers as
  hyperparameters;
* logs device memory per epoch: ``fastdata/mem_allocated_mb`` and
  ``fastdata/mem_reserved_mb`` on a GPU, ``fastdata/host_rss_mb`` on a CPU run.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
import psutil
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from lightning_fastdata import _lightning as door
from lightning_fastdata._util import as_flag
from lightning_fastdata.profiler import FALLBACK_HOOKS, UNUSED_STEP_HOOKS, DataWaitProfiler
from lightning_fastdata.report import loader_info
from lightning_fastdata.seeding import (
    WorkerSeeding,
    install_worker_seeding,
    randomness_repeats,
    set_worker_epoch,
    worker_seeding,
)

# The worker seedings a FastDataCallback installed (a loader keeps its seeding when it is
# reused by another stage or Trainer): each stage sets their epoch again.
_INSTALLED: weakref.WeakSet[WorkerSeeding] = weakref.WeakSet()


class FastDataCallback(Callback):
    """Keeps an eye on the input pipeline: profiling, ``set_epoch``, plan and memory logging.

    The profiling is a :class:`DataWaitProfiler` (``callback.profiler``) that this callback
    drives; :meth:`report` is its report.

    Args:
        profile: Time data wait vs compute for every step and report at the end of ``fit``.
        replay_steps: Replay mode (see :class:`DataWaitProfiler`); 0 turns it off.
        replay_batches: Batches captured for replay.
        print_report: Print the profile report at the end of ``fit`` (rank 0).
        set_epoch: Call ``set_epoch`` where Lightning does not.
        log_memory: Log device memory at each training epoch end.
        seed_workers: Install per-(seed, rank, worker, epoch) seeding into DataLoaders that
            lack it (the user's ``worker_init_fn`` still runs, after ours), and warn once
            when a loader's randomness would repeat.
        trace: Write a Chrome trace of a window of training steps to this path (see
            :class:`DataWaitProfiler`); the report names the file. None: no trace. Needs ``profile``.
        trace_steps: ``(first, count)``: the traced training steps, counted from 0 over the fit, one
            per batch (under gradient accumulation, several make one optimizer step).
        clock: Time source in seconds (tests inject a fake one).
    """

    def __init__(self, profile: bool = True, replay_steps: int = 0, replay_batches: int = 4,
                 print_report: bool = True, set_epoch: bool = True, log_memory: bool = True,
                 seed_workers: bool = True, trace: str | os.PathLike | None = None,
                 trace_steps: tuple[int, int] = (5, 20), clock: Callable[[], float] = time.perf_counter) -> None:
        self.profiler = DataWaitProfiler(clock=clock, replay_steps=replay_steps, replay_batches=replay_batches,
                                         print_report=print_report, trace=trace, trace_steps=trace_steps)
        flags = {"profile": profile, "set_epoch": set_epoch, "log_memory": log_memory, "seed_workers": seed_workers}
        for name, value in flags.items():
            flags[name] = as_flag(value)  # numpy's bool too, kept as a plain one
            if flags[name] is None:
                raise ValueError(f"{name} must be True or False, got {value!r}")
        profile, set_epoch, log_memory, seed_workers = (flags[name] for name in flags)
        if trace is not None and not profile:
            # The profiler takes the trace: with profile=False nothing would ever be written.
            raise ValueError(f"trace={trace!r} needs profile=True (the profiler records the traced steps): set "
                             "profile=True, or drop trace")
        self.profile = profile
        self.set_epoch, self.log_memory = set_epoch, log_memory
        self.set_epoch_calls: list[tuple[str, int]] = []
        self.memory: list[dict[str, float]] = []
        self._plan_logged = False
        self.seed_workers = seed_workers
        self.seeded_loaders = 0
        self._warned_repeats = False
        # Loaders of each split set up since that split's loop last started: a loop processes
        # all its loaders, in order, then starts (see ``_seed_loader``).
        self._loaders_set_up: dict[str, int] = {}
        self._process_dataloader: door.Site | None = None
        # Nothing of this callback runs per step (see DataWaitProfiler): Lightning does not even dispatch those hooks.
        door.hide_hooks(self, UNUSED_STEP_HOOKS, FastDataCallback)

    def report(self) -> dict[str, Any]:
        """The profiler's report (see :meth:`DataWaitProfiler.report`)."""
        return self.profiler.report()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Install worker seeding, then the profiler's timers."""
        self._loaders_set_up.clear()
        if stage == "fit":
            self._plan_logged = False  # each fit's loggers get the data plan (a reused callback's too)
        self._install_worker_seeding(trainer)
        if self.profile:
            self.profiler.setup(trainer, pl_module, stage)
            if self.profiler.timing == "hooks":
                door.show_hooks(self, FALLBACK_HOOKS)  # the profiler's fallback needs the batch hooks

    def _install_worker_seeding(self, trainer: L.Trainer) -> None:
        """Give DataLoader workers distinct, reproducible seeds where the loader has none of ours.

        Lightning may rebuild a DataLoader (to add a ``DistributedSampler``) and starts the
        first epoch's workers inside its loops, after every callback hook has run. The one
        place that sees each final loader before its workers start is
        ``strategy.process_dataloader``, so it is wrapped here (and restored in
        :meth:`teardown`).
        """
        if not (self.seed_workers or self.set_epoch) or self._process_dataloader is not None:
            return
        site = door.site(trainer.strategy, "process_dataloader")
        original = site.original
        self._process_dataloader = site

        def process_dataloader(dataloader: object) -> object:
            dataloader = original(dataloader)
            if self.set_epoch:
                self._early_set_epoch(trainer, dataloader)
            if self.seed_workers:
                self._seed_loader(trainer, dataloader)
            return dataloader

        trainer.strategy.process_dataloader = process_dataloader  # type: ignore[method-assign]

    def _early_set_epoch(self, trainer: L.Trainer, dataloader: object) -> None:
        """Tell a loader being set up for a fit its epoch before Lightning first iterates it.

        Lightning creates the first epoch's iterator while it sets the loader up, before any
        epoch hook, and on a resume does not create it again: a batch sampler (or a sampler
        read eagerly by workers) whose order follows ``set_epoch`` replayed epoch 0's order
        in the resumed epoch. Our own loaders restore their position after this.
        """
        if trainer.state.fn != TrainerFn.FITTING:
            return
        epoch = trainer.fit_loop.epoch_progress.current.processed
        dl = dataloader
        batch_sampler = getattr(dl, "batch_sampler", None)
        seen: set[int] = set()
        for obj in (getattr(dl, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None),
                    getattr(dl, "dataset", None)):
            if obj is not None and id(obj) not in seen and callable(getattr(obj, "set_epoch", None)):
                seen.add(id(obj))
                obj.set_epoch(epoch)

    def _seed_loader(self, trainer: L.Trainer, dataloader: object) -> None:
        seed = _base_seed(trainer)
        # The loop setting up this loader names its split (the sanity check's is "val"), so
        # the validation workers do not replay the training workers' draws.
        stage = trainer.state.stage
        split = (stage.dataloader_prefix if stage is not None else None) or "train"
        # A loop hands Lightning's strategy each of its loaders in order, before the loop's
        # start hook (which resets the count): loader k > 0 of a split seeds its workers as
        # "<split>/k", so two validation loaders' workers do not draw the same numbers.
        position = self._loaders_set_up.get(split, 0)
        self._loaders_set_up[split] = position + 1
        name = split if position == 0 else f"{split}/{position}"
        if install_worker_seeding(dataloader, seed, trainer.global_rank, split=name):
            worker_seeding(dataloader).dataset_epoch = self.set_epoch
            _INSTALLED.add(worker_seeding(dataloader))
            self.seeded_loaders += 1
        seeding = worker_seeding(dataloader)
        if seeding in _INSTALLED:
            # An evaluation loader's workers seed for epoch 0 and keep it (Lightning sets the fit's
            # progress on the loader's sampler), in a fit and outside one: every epoch's validation
            # and every validate or test draws the same numbers, whatever this Trainer fitted
            # before, as the data module's loaders do. A training loader follows the fit's epoch.
            following = trainer.state.fn == TrainerFn.FITTING and split == "train"
            seeding.set_epoch(trainer.current_epoch if following else 0)  # ``held`` only stops a followed sampler's
            seeding.held = not following
        reason = randomness_repeats(dataloader)
        if reason is not None and not self._warned_repeats:
            self._warned_repeats = True
            rank_zero_warn(f"lightning_fastdata: {reason}")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Restore everything :meth:`setup` wrapped."""
        if self._process_dataloader is not None:
            door.restore(self._process_dataloader)
            self._process_dataloader = None
        if self.profile:
            self.profiler.teardown(trainer, pl_module, stage)
        door.hide_hooks(self, FALLBACK_HOOKS, FastDataCallback)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """The run stopped on an exception (Lightning skips ``teardown`` then): write the trace
        recorded so far and restore everything :meth:`setup` wrapped."""
        if self.profile:
            self.profiler.on_exception(trainer, pl_module, exception)
        self.teardown(trainer, pl_module, "fit")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.profile:
            self.profiler.on_train_start(trainer, pl_module)
        if not self._plan_logged:
            self._plan_logged = True
            params = _plan_params(trainer)
            for logger in trainer.loggers:
                logger.log_hyperparams(params)
        if door.restarted_mid_epoch(trainer):
            # Resumed inside an epoch: Lightning skips on_train_epoch_start for it (the
            # profiler, above, starts its epoch itself), but the loaders still need their epoch.
            self._epoch_start(trainer)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.profile:
            self.profiler.on_train_epoch_start(trainer, pl_module)
        self._epoch_start(trainer)

    def _epoch_start(self, trainer: L.Trainer) -> None:
        """``set_epoch`` and the workers' seeding epoch for the training epoch starting (or resuming) now."""
        self._loaders_set_up.pop("train", None)  # the next reload counts from the first loader again
        if self.set_epoch:
            epoch = trainer.fit_loop.epoch_progress.current.processed
            loaders = _flatten(trainer.train_dataloader) + _flatten(trainer.val_dataloaders)
            for where, obj in _uncovered_set_epoch(loaders):
                obj.set_epoch(epoch)
                self.set_epoch_calls.append((where, epoch))
        if self.seed_workers:
            # Persistent workers pick the new epoch up at their next fetch. Validation loaders
            # stay at epoch 0 (see ``_process_dataloader``), and reseed at each validation run, a
            # new pass: every epoch's validation draws the same numbers, a resumed run's too.
            epoch = trainer.fit_loop.epoch_progress.current.processed
            for dl in _flatten(trainer.train_dataloader):
                set_worker_epoch(dl, epoch)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.profile:
            self.profiler.on_train_epoch_end(trainer, pl_module)
        if self.log_memory:
            device = trainer.strategy.root_device
            if device.type == "cuda":
                mem = {"fastdata/mem_allocated_mb": torch.cuda.memory_allocated(device) / 2**20,
                       "fastdata/mem_reserved_mb": torch.cuda.memory_reserved(device) / 2**20}
            else:
                mem = {"fastdata/host_rss_mb": psutil.Process().memory_info().rss / 2**20}
            self.memory.append(mem)
            try:
                step = door.batches_that_stepped(trainer, epoch_end=True)
            except door.DoorClosed:
                step = trainer.global_step  # the profiler has warned already
            for logger in trainer.loggers:
                logger.log_metrics(mem, step=step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.profile:
            self.profiler.on_train_end(trainer, pl_module)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.profile:
            self.profiler.on_fit_end(trainer, pl_module)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._loaders_set_up.pop("val", None)
        if self.profile:
            self.profiler.on_validation_start(trainer, pl_module)

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._loaders_set_up.pop("test", None)

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._loaders_set_up.pop("predict", None)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.profile:
            self.profiler.on_validation_epoch_start(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.profile:
            self.profiler.on_validation_epoch_end(trainer, pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.profile:
            self.profiler.on_validation_end(trainer, pl_module)

    # The profiler's fallback timing (public batch hooks); hidden from Lightning otherwise.

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.profiler.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.profiler.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        self.profiler.on_validation_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self.profiler.on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)


def _flatten(loaders: Any) -> list[Any]:
    if loaders is None:
        return []
    if isinstance(loaders, Mapping):
        return [x for v in loaders.values() for x in _flatten(v)]
    if isinstance(loaders, (list, tuple)):
        return [x for v in loaders for x in _flatten(v)]
    return [loaders]


def _uncovered_set_epoch(loaders: list[Any]) -> list[tuple[str, Any]]:
    """Objects with a ``set_epoch`` that Lightning's ``_set_sampler_epoch`` does not reach."""
    covered: set[int] = set()
    candidates: list[tuple[str, Any]] = []
    for i, dl in enumerate(loaders):
        sampler = getattr(dl, "sampler", None)
        batch_sampler = getattr(dl, "batch_sampler", None)
        covered.add(id(sampler))
        covered.add(id(getattr(batch_sampler, "sampler", None)))
        candidates += [(f"loader[{i}]", dl), (f"loader[{i}].dataset", getattr(dl, "dataset", None)),
                       (f"loader[{i}].batch_sampler", batch_sampler)]
    out, seen = [], set()
    for where, obj in candidates:
        if obj is None or id(obj) in covered or id(obj) in seen:
            continue
        seen.add(id(obj))
        if callable(getattr(obj, "set_epoch", None)):
            out.append((where, obj))
    return out


def _plan_params(trainer: L.Trainer) -> dict[str, Any]:
    plan = getattr(trainer.datamodule, "plan", None)
    if plan is not None and hasattr(plan, "as_dict"):
        return {"fastdata_plan": plan.as_dict()}
    try:
        info = loader_info(trainer.train_dataloader)
    except Exception:  # noqa: BLE001 (nothing to log is better than a failed fit)
        info = {}
    return {"fastdata_loader": info}



def _base_seed(trainer: L.Trainer) -> int:
    """The run's seed: the data module's, else ``seed_everything``'s, else this process's torch seed."""
    seed = getattr(trainer.datamodule, "seed", None)
    if isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0:
        return seed
    env = os.environ.get("PL_GLOBAL_SEED")
    if env is not None and env.lstrip("-").isdigit():
        return abs(int(env))
    return torch.initial_seed() % (1 << 63)
