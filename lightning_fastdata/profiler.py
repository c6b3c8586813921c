"""``DataWaitProfiler``: how much of each step is spent waiting for data, timed where it happens.

Every training and validation step is split into three parts that add up to its wall time:

* **data wait**: time the loop is blocked getting the next batch, measured inside the
  calls that do it: the loader's fetch (the hooks Lightning's data fetcher calls around
  ``next(iterator)``), then from the end of the fetch to the end of
  ``strategy.batch_to_device`` (the module's ``on_before_batch_transfer``, the
  host-to-device copy, and ``on_after_batch_transfer``, where on-device augmentation is
  launched);
* **compute**: the step itself, minus any wait inside it (a ``dataloader_iter`` step
  fetches inside): for training, Lightning's optimisation run (``training_step``,
  ``backward`` and the optimizer step, automatic or manual); for validation,
  ``strategy.validation_step``. On a GPU it is the device time between two CUDA events
  recorded around it, read a few steps later once the events have completed, so no step
  is ever synchronised (:mod:`~lightning_fastdata.cuda_events`). There, the data wait
  counts only the part of the host's blocked time that device compute does not cover;
* **overhead**: the rest of the step: the batch hooks of callbacks and of the module,
  logging, loop bookkeeping.

A step runs from the end of the previous one (or the start of the epoch, or the end of a
validation run) to the end of its own. On a GPU the device's idle gap between steps is
reported too.

Nothing here runs as a per-step callback hook: Lightning dispatches each batch hook to
every callback that has it, at about 1.4 us per hook. Instead the calls above are wrapped
on the Trainer's own loop and strategy objects for the duration of the run
(:mod:`~lightning_fastdata.step_timer`, through :mod:`~lightning_fastdata._lightning`) and
restored in ``teardown``. When a Lightning version has moved those internals, the
profiler warns once and times steps with the public batch hooks instead.

This class composes the parts: the step timer, the CUDA event resolver, the DDP reduction
(:mod:`~lightning_fastdata.rank_reduce`), the report (:mod:`~lightning_fastdata.report`,
pure), replay (:mod:`~lightning_fastdata.replay`) and the Chrome trace
(:mod:`~lightning_fastdata.trace`). Figures are logged every ``log_every_n_steps`` and per
epoch; after ``fit``, rank 0 prints the report, which :meth:`DataWaitProfiler.report` returns.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_fastdata import _lightning as door
from lightning_fastdata import distributed as D
from lightning_fastdata import rank_reduce
from lightning_fastdata._util import as_flag, as_int, cpu_count
from lightning_fastdata.cuda_events import EventResolver, record
from lightning_fastdata.replay import Replay
from lightning_fastdata.report import (  # noqa: F401 (re-exported: the profiler's public report functions)
    DATA_ADVICE_FRAC,
    HOST_IDLE_FRAC,
    OVERHEAD_ADVICE_FRAC,
    advise,
    format_report,
    loader_info,
    summarize,
    verdict_of,
)
from lightning_fastdata.step_timer import (
    AUTO,
    EVAL,
    FETCH,
    MANUAL,
    TRANSFER,
    HookTimer,
    Hot,
    Stage,
    StepHooks,
    make_after_fetch,
    make_before_fetch,
    make_prefetch_iter,
    make_step,
    make_transfer,
)
from lightning_fastdata.trace import AUGMENT, AUGMENT_AHEAD, StepTrace, check_path

#: Per-step hooks the profiler does not use while it times the loop itself. Lightning dispatches
#: every hook to every callback, and each dispatch costs ~1.4 us (~16,000 instructions) per step
#: even for an empty hook: they are hidden from the dispatch (see ``_lightning.hide_hooks``) unless a
#: subclass overrides them. The four batch hooks come back when the loop cannot be wrapped.
UNUSED_STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_validation_batch_start",
                     "on_validation_batch_end", "on_test_batch_start", "on_test_batch_end",
                     "on_predict_batch_start", "on_predict_batch_end", "on_before_backward",
                     "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")
#: The hooks the fallback timing needs (:class:`~lightning_fastdata.step_timer.HookTimer`).
FALLBACK_HOOKS = UNUSED_STEP_HOOKS[:4]


class DataWaitProfiler(Callback):
    """Times data wait vs compute vs framework overhead for every training and validation step.

    Args:
        clock: Time source in seconds (tests inject a fake one).
        replay_steps: Opt-in replay mode: after training, run this many optimisation
            steps on batches captured on the device (no loader involved) to measure the
            compute-only step time; the model, optimizer and RNG states are restored
            afterwards. 0 turns it off.
        replay_batches: How many training batches replay mode captures (the first ones).
        replay_warmup: Replay steps run before timing starts (allocator, kernel caches).
        max_pending: On a GPU, steps whose CUDA events are still unread before the oldest
            one is waited for; normally events complete long before.
        print_report: Print the report at the end of ``fit`` (rank 0).
        trace: Write a Chrome trace of a window of training steps to this path (None: off; ``~`` is
            expanded). Refused at once when it names a directory, ends in a separator, or lies
            under a file or a directory this process may not write in.
        trace_steps: ``(first, count)``: the window, in training steps counted from 0 over the fit,
            one per batch (under gradient accumulation, several make one optimizer step).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, replay_steps: int = 0,
                 replay_batches: int = 4, replay_warmup: int = 2, max_pending: int = 16,
                 print_report: bool = True, trace: str | os.PathLike | None = None,
                 trace_steps: tuple[int, int] = (5, 20)) -> None:
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        counts = {}
        for name, value, low in (("replay_steps", replay_steps, 0), ("replay_batches", replay_batches, 1),
                                 ("replay_warmup", replay_warmup, 0), ("max_pending", max_pending, 1)):
            counts[name] = as_int(value)  # numpy integers too, kept as plain ones
            if counts[name] is None or counts[name] < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        replay_steps, replay_batches, replay_warmup, max_pending = (counts[name] for name in counts)
        if as_flag(print_report) is None:
            raise ValueError(f"print_report must be True or False, got {print_report!r}")
        print_report = as_flag(print_report)
        if trace is not None and not isinstance(trace, (str, os.PathLike)):
            raise TypeError(f"trace must be a file path or None, got {trace!r}")
        if trace is not None:
            trace = check_path(trace)
        window = tuple(as_int(v) for v in trace_steps) if isinstance(trace_steps, (tuple, list)) else ()
        if len(window) != 2 or None in window or window[0] < 0 or window[1] < 1:
            raise ValueError(f"trace_steps must be (first, count) with first >= 0 and count >= 1, "
                             f"got {trace_steps!r}")
        self.clock = clock
        self.replay_steps, self.replay_batches, self.replay_warmup = replay_steps, replay_batches, replay_warmup
        self.max_pending = max_pending
        self.print_report = print_report
        self.trace, self.trace_steps = trace, window
        self._train, self._val = Stage("train"), Stage("validate")
        self._hot = Hot()
        self._events = EventResolver(max_pending)
        self._replay = Replay(replay_steps, replay_batches, replay_warmup)
        self._replayed: dict[str, Any] | None = None
        self._tracer = StepTrace(trace, *self.trace_steps) if trace is not None else None
        self._patches = door.Patches()
        # A loader without a length has its first batch fetched before the loop's fetch hooks are
        # bound: (fetcher, start, seconds) by id(fetcher), until the stage's epoch starts
        # (_take_early). Weak references: a sanity check's fetcher, never taken, is not kept
        # alive (nor its loader's workers); a plain dict, so ddp_spawn can pickle the callback.
        self._early: dict[int, tuple[weakref.ref, float, float]] = {}
        self._hooks: HookTimer | None = None  # the fallback timing, when the loop could not be wrapped
        # What advice knows of each stage's pipeline ("train", "validate"), read at its start.
        self._contexts: dict[str, dict[str, Any]] = {}
        self._trainer: L.Trainer | None = None
        self._warned: set[str] = set()
        # FastDataCallback(profile=False) wraps nothing and times nothing (see _disable).
        self._enabled = True
        door.hide_hooks(self, UNUSED_STEP_HOOKS, DataWaitProfiler)

    def _disable(self) -> None:
        """Stop timing: :meth:`setup` then wraps nothing."""
        self._enabled = False
        self._hot.active = None

    @property
    def timing(self) -> str:
        """``"loop"`` (the loop's own calls are wrapped) or ``"hooks"`` (the public batch hooks, a fallback)."""
        return "hooks" if self._hooks is not None else "loop"

    # ------------------------------------------------------------------ installation

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Wrap the calls that fetch, transfer, augment and compute batches (restored in ``teardown``)."""
        if not self._enabled or stage not in ("fit", "validate") or self._patches:
            return
        if door.is_wrapped(trainer.strategy.batch_to_device):
            # Two profilers would nest their wrappers and could not restore them in any order.
            rank_zero_warn(f"{type(self).__name__}: another DataWaitProfiler/FastDataCallback already times this "
                           "Trainer; this one stays idle. Keep one of them (FastDataCallback includes the profiler).")
            self._disable()
            return
        self._trainer = trainer
        self._hot.cuda = trainer.strategy.root_device.type == "cuda"
        self._hooks = None
        if stage == "fit":
            # Each fit has its own figures: a callback reused for a second Trainer reported both
            # fits mixed (a validate or test after a fit keeps the fit's).
            self._train, self._val = Stage("train"), Stage("validate")
            self._replayed = None
            if self.trace is not None:
                self._new_trace()
        try:
            sites = door.timing_sites(trainer)
        except door.DoorClosed as e:
            rank_zero_warn(f"{type(self).__name__}: {e} Timing each step with the public batch hooks instead: the "
                           "wait is from one batch's end to the next one's start, the compute from its start to "
                           "its end.")
            self._hooks = HookTimer(self.clock, self._hot)
            door.show_hooks(self, FALLBACK_HOOKS)
            if stage == "fit" and self._tracer is not None:
                self._warn_once("trace_hooks", f"the public batch hooks take no trace: {self.trace} is not written.")
                self._tracer = None
            return
        clock, hot, tracer = self.clock, self._hot, self._tracer
        span = tracer.span if tracer is not None else None
        # Lightning's own fetch hooks only feed trainer.profiler; with the default no-op profiler
        # they are skipped, so that the timed fetch costs no more than the untimed one.
        quiet = type(trainer.profiler) is PassThroughProfiler
        for before, after in zip(sites.before_fetch, sites.after_fetch, strict=True):
            self._patches.wrap(before, make_before_fetch(clock, hot, None if quiet else before.original))
            self._patches.wrap(after, make_after_fetch(clock, hot, None if quiet else after.original, span, FETCH))
        try:
            prefetch = door.prefetch_iter()
        except door.DoorClosed as e:
            self._warn_once("prefetch", f"{e} The first batch of a loader without a length goes untimed.")
        else:
            if not door.is_wrapped(prefetch.original):  # another Trainer's profiler times it already
                self._patches.wrap(prefetch, make_prefetch_iter(prefetch.original, clock, self._prefetched))
        strategy = trainer.strategy
        transfer = door.site(strategy, "batch_to_device")
        self._patches.wrap(transfer, make_transfer(clock, hot, transfer.original, span, TRANSFER))
        hooks = StepHooks(record, self._events.end_on_device, self._replay.capture, self._fetched_batch,
                          self._log_due, tracer.step if tracer is not None else None)
        for s, stage_, calls in ((sites.auto_run, self._train, AUTO), (sites.manual_run, self._train, MANUAL),
                                 (door.site(strategy, "validation_step"), self._val, EVAL)):
            self._patches.wrap(s, make_step(s.original, clock, hot, stage_, stage_ is self._train, calls, hooks))
        self._patches.wrap(sites.val_run, self._after_validation(sites.val_run.original))
        if tracer is not None:
            self._trace_augment(trainer)
        self._time_loader_augment(trainer)

    def _new_trace(self) -> None:
        """A fit's own trace: ``trace_steps`` counts from 0 over each fit.

        The file an earlier fit of this profiler wrote goes first: a fit that traces no step
        (shorter than the window's start, or stopped before it) left it in place, to be taken
        for its own.
        """
        old = self._tracer
        if old is not None and old.written is not None:
            try:
                old.written.unlink(missing_ok=True)
            except OSError as e:
                warnings.warn(f"lightning_fastdata: could not remove {old.written}, the trace of an earlier fit: "
                              f"{e}; it is not this fit's", stacklevel=2)
        self._tracer = StepTrace(self.trace, *self.trace_steps)  # type: ignore[arg-type]

    def _after_validation(self, original: Callable[[], Any]) -> Callable[[], Any]:
        """The validation loop inside fit, wrapped: the next training step starts when it returns.

        Callbacks after this one (``ModelCheckpoint`` saving in ``on_validation_end``) still run
        inside it: their time is neither the validation's nor the next training step's.
        """
        clock, hot, train = self.clock, self._hot, self._train

        def run() -> Any:
            out = original()
            if hot.active is train:
                train.prev_end = clock()
                train.prev_event = None  # the device's idle before the next step is not measured across it
            return out

        return run

    def _trace_augment(self, trainer: L.Trainer) -> None:
        """Time the datamodule's ``on_after_batch_transfer`` for the trace, when it has one (inside the transfer)."""
        dm = trainer.datamodule
        base = L.LightningDataModule.on_after_batch_transfer
        if dm is None or getattr(type(dm), "on_after_batch_transfer", base) is base:
            return
        augment = door.site(dm, "on_after_batch_transfer")
        original, clock, hot, span = augment.original, self.clock, self._hot, self._tracer.span  # type: ignore[union-attr]

        def on_after_batch_transfer(batch: Any, dataloader_idx: int) -> Any:
            t0 = clock()
            out = original(batch, dataloader_idx)
            if hot.active is not None:
                span(AUGMENT, t0, clock())
            return out

        self._patches.wrap(augment, on_after_batch_transfer)

    def _time_loader_augment(self, trainer: L.Trainer) -> None:
        """Time an :class:`~lightning_fastdata.datamodule.OptimizedDataModule`'s loader hook, which
        augments each batch as it is gathered: in the fetch, or ahead of the step in the loader's
        thread with ``augment_ahead``.

        Its total per stage tells the report whether a wait in the fetch is the gather or the
        augmentation (a ``chunked`` store's advice to move it to the device was the same for
        both); with a trace, each call is a span (the loader thread's in a lane of its own).
        """
        dm = trainer.datamodule
        # Recognised by its module: the profiler sits below the data module and does not import it.
        hook = getattr(type(dm), "_loader_augment", None) if dm is not None else None
        if getattr(hook, "__module__", None) != "lightning_fastdata.datamodule":
            return
        if getattr(getattr(dm, "plan", None), "strategy", None) == "workers":
            # DataLoader workers augment in their own processes, where this clock's figures never
            # come back (and a closure in the loader would not pickle for spawned workers).
            return
        # Wrapped on the instance before Lightning asks for the loaders, which bind it.
        site = door.site(dm, "_loader_augment")
        prepare, clock, hot = site.original, self.clock, self._hot
        span = self._tracer.span if self._tracer is not None else None
        main = threading.get_ident()  # the Trainer's thread: another one is the loader's (augment_ahead)

        def timed_prepare(batch: Any, split: str, augment: Any) -> Any:
            t0 = clock()
            out = prepare(batch, split=split, augment=augment)
            if hot.active is not None:  # not in the sanity check
                t1 = clock()
                # The stages are read now: each fit makes its own.
                stage = self._train if split == "train" else self._val if split == "val" else None
                if stage is not None and stage.augment is not None:
                    stage.augment += t1 - t0
                if span is not None and split == "train":  # the trace has training steps only
                    span(AUGMENT if threading.get_ident() == main else AUGMENT_AHEAD, t0, t1)
            return out

        self._patches.wrap(site, timed_prepare)
        for stage in (self._train, self._val):
            if stage.augment is None:
                stage.augment = 0.0  # timed from now on

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """The run stopped on an exception (Lightning skips ``teardown`` then): write the steps
        traced so far, and restore everything :meth:`setup` wrapped."""
        if self._enabled and self._tracer is not None and self._trainer is not None:
            self._write_trace(trainer)
            self._check_traced()
        self.teardown(trainer, pl_module, "fit")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Restore everything :meth:`setup` wrapped."""
        self._patches.restore()
        self._trainer = None
        door.hide_hooks(self, FALLBACK_HOOKS, DataWaitProfiler)  # the fallback's hooks, if it was used
        self._hot.active = None

    # ------------------------------------------------------------------ what the step timer calls back

    def _fetched_batch(self, train: bool) -> Any:
        trainer = self._trainer
        loop = trainer.fit_loop if train else _eval_loop(trainer)  # type: ignore[union-attr]
        try:
            return door.fetched_batch(loop)
        except door.DoorClosed as e:
            self._warn_once("fetched_batch", f"{e} A dataloader_iter step counts as one sample.")
            return None

    def _log_due(self, stage: Stage) -> None:
        """Lightning logs when its step + 1 is a multiple of ``log_every_n_steps``: log the interval then."""
        every, hot = self._hot.log_every, self._hot
        due = (self._logging_step() + 1) % every
        if due == 0:
            if self._accumulating():
                # A batch that only accumulates: Lightning logs at the group's stepping batch,
                # with the same step; look again next batch (the rows keep adding up).
                hot.log_in = 1
                return
            self._log_interval(stage)
            # The step rises at this batch's end, by at most one per batch: the next log is
            # at least ``every`` batches away.
            hot.log_in = every
        else:
            # The step rises by at most one per batch: no earlier batch can be due.
            hot.log_in = every - due

    def _accumulating(self) -> bool:
        try:
            return door.accumulating(self._trainer)
        except door.DoorClosed as e:
            self._warn_once("accumulating", f"{e} Logging on every batch of an accumulation group.")
            return False

    def _logging_step(self, epoch_end: bool = False) -> int:
        """The step Lightning logs at now (``epoch_end``: see :func:`door.batches_that_stepped`)."""
        trainer = self._trainer
        try:
            return door.batches_that_stepped(trainer, epoch_end)
        except door.DoorClosed as e:
            self._warn_once("logging_step", f"{e} Logging with trainer.global_step instead.")
            return int(trainer.global_step)  # type: ignore[union-attr]

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(f"{type(self).__name__}: {message}")

    # ------------------------------------------------------------------ training hooks

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._contexts["train"] = _context(trainer, "train")
        if door.restarted_mid_epoch(trainer):
            # Resumed inside an epoch: Lightning skips on_train_epoch_start for it, and the
            # epoch's remaining steps would otherwise go untimed.
            self.on_train_epoch_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._enabled:
            return
        self._trainer = trainer
        hot = self._hot
        self._train.new_epoch(self.clock())
        self._take_early(self._train, trainer.fit_loop)
        hot.active = self._train
        hot.n = None
        # Each interval's figures are reduced over ranks (a collective): under DDP every rank keeps
        # the schedule, with a logger or not (a logger on rank 0 only made the ranks' collectives
        # mismatch, and the run hang until the process group's timeout).
        hot.log_every = trainer.log_every_n_steps if trainer.loggers or trainer.world_size > 1 else 0
        hot.log_in = 1 if hot.log_every else 0  # look at Lightning's step at the first batch
        hot.capture = self._replay.wants_more()
        hot.split = self._train if _several_loaders(trainer) else None

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stage = self._train
        if not self._enabled:
            return
        if stage.epoch_start is not None:
            stage.epoch_times.append(self.clock() - stage.epoch_start)
        self._finish_epoch(trainer, stage, "fastdata/epoch/")
        self._hot.active = None
        if self._tracer is not None:
            self._write_trace(trainer)

    def _write_trace(self, trainer: L.Trainer) -> None:
        """Write the steps traced so far (their events are read: the epoch has ended); a failure only warns."""
        tracer = self._tracer
        assert tracer is not None
        rank = trainer.global_rank
        try:
            written = tracer.write(rank)
        except OSError as e:
            if "trace" not in self._warned:
                # Every rank writes its own file: a rank > 0 that cannot says so itself (rank_zero_warn
                # would drop its warning, and the file would just be missing).
                self._warned.add("trace")
                who = f"rank {rank} " if rank or trainer.world_size > 1 else ""
                warnings.warn(f"lightning_fastdata: {who}could not write the trace to {tracer.rank_path(rank)}: "
                              f"{e}; training goes on without it", stacklevel=2)
            return
        if written is not None and tracer.complete:
            s = tracer.summary()
            rank_zero_info(f"lightning_fastdata: trace of training steps {s['first_step']} to {s['last_step']} "
                           f"written to {s['path']}")

    def _check_traced(self) -> None:
        """Warn when this fit ran no step of the trace's window: no trace is written then."""
        tracer = self._tracer
        if tracer is None or tracer.steps:
            return
        first, last = tracer.first, tracer.first + tracer.count - 1
        rank_zero_warn(f"lightning_fastdata: no training step in {first}..{last} (trace_steps={self.trace_steps}) "
                       f"ran: this fit ran {tracer.seen} training steps; the trace was not written to {tracer.path}. "
                       "Start the window at a step the fit reaches (trace_steps=(first, count)).")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        replay = self._replay
        if self.replay_steps and replay.captured:
            self._hot.active = None
            real = summarize(self._train.history) if self._train.history else None
            self._replayed = replay.run(trainer, pl_module, self.clock, self._hot.cuda, real)
        elif self.replay_steps and self._enabled and self._train.history:
            rank_zero_warn(f"{type(self).__name__}: replay_steps={self.replay_steps} but no batch was captured: "
                           "a training_step that takes a dataloader_iter cannot be replayed; set replay_steps=0.")
        replay.captured = []

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._enabled:
            # Here, not in on_train_end: Lightning skips that when the fit trains nothing
            # (limit_train_batches=0, max_epochs=0, max_steps=0), which then said nothing.
            self._check_traced()
        if self._enabled and self.print_report and trainer.is_global_zero:
            rank_zero_info(format_report(self.report()))

    # ------------------------------------------------------------------ validation hooks

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._hot.active = None if trainer.sanity_checking or not self._enabled else self._val
        if self._hot.active is not None:
            # Validation's own loader: its advice described the training loader's settings (and
            # trainer.validate alone, with no training start, got none).
            self._contexts["validate"] = _context(trainer, "validate")

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._hot.active is self._val:
            self._val.new_epoch(self.clock())
            self._take_early(self._val, _eval_loop(trainer))

    def _prefetched(self, fetcher: Any, t0: float, t1: float) -> None:
        """A batch fetched in ``iter(fetcher)``, before the loop bound its fetch hooks.

        Inside a training epoch (a reloaded loader's fetcher is iterated a second time there) it is
        the running step's fetch; before the epoch (or a validation run) starts, it waits in
        ``_early`` for :meth:`_take_early`.
        """
        train = self._train
        if self._hot.active is train and fetcher is door.loop_fetcher(self._trainer.fit_loop):  # type: ignore[union-attr]
            train.fetch += t1 - t0
            if self._tracer is not None:
                self._tracer.span(FETCH, t0, t1)
            return
        early = self._early
        for key in [k for k, (ref, _, _) in early.items() if ref() is None]:
            del early[key]
        ref, first, seconds = early.get(id(fetcher), (weakref.ref(fetcher), t0, 0.0))
        early[id(fetcher)] = (ref, first, seconds + t1 - t0)

    def _take_early(self, stage: Stage, loop: Any) -> None:
        """Count the batch the loop's fetcher took before this epoch started (see ``make_prefetch_iter``)
        as the first step's fetch: that step, and the epoch, start that much earlier."""
        try:
            fetcher = door.loop_fetcher(loop)
        except door.DoorClosed:
            return  # the prefetch was not wrapped either (same Lightning internals)
        got = self._early.pop(id(fetcher), None) if fetcher is not None else None
        if got is None or got[0]() is not fetcher or stage.prev_end is None or stage.epoch_start is None:
            return
        seconds = got[2]
        stage.fetch += seconds
        stage.prev_end -= seconds
        stage.epoch_start -= seconds
        if self._tracer is not None:
            # Drawn just before the step's start, where it is counted (it ran during the set-up).
            self._tracer.span(FETCH, stage.prev_end, stage.prev_end + seconds)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._hot.active is self._val:
            stage = self._val
            if stage.epoch_start is not None:
                stage.epoch_times.append(self.clock() - stage.epoch_start)
            self._finish_epoch(trainer, stage, "fastdata/val/epoch/")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._enabled and trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            # Validation inside fit: the next training step starts now, not before validation.
            self._hot.active = self._train
            self._train.prev_end = self.clock()
            # And on the device: the idle before the next step is measured from the last
            # training step's end event, which would count the validation's device time.
            self._train.prev_event = None
        else:
            self._hot.active = None

    # ------------------------------------------------------------------ batch hooks: the fallback only

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._hooks is not None:
            self._hooks.batch_start(self._train)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        hooks = self._hooks
        if hooks is not None:
            hooks.batch_end(self._train, batch)
            left = self._hot.log_in
            if left == 1:
                self._log_due(self._train)
            elif left:
                self._hot.log_in = left - 1

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._hooks is not None:
            self._hooks.batch_start(self._val)

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._hooks is not None:
            self._hooks.batch_end(self._val, batch)

    # ------------------------------------------------------------------ logging

    def _log_interval(self, stage: Stage) -> None:
        # The steps since the last log, across an epoch's end too (an epoch shorter than the
        # interval was missing from the series).
        rows = stage.carry + stage.rows[stage.logged:stage.resolved]
        stage.carry = []
        stage.logged = stage.resolved
        # One collective per logging interval: the slowest rank's figures gate the step.
        count, step, wait, compute, overhead, idle = rank_reduce.interval_means(rows)
        if not count:
            return
        metrics = {"fastdata/data_wait_ms": 1e3 * wait, "fastdata/compute_ms": 1e3 * compute,
                   "fastdata/overhead_ms": 1e3 * overhead, "fastdata/step_ms": 1e3 * step,
                   "fastdata/data_wait_frac": wait / step if step > 0 else 0.0}
        if self._hot.cuda:
            metrics["fastdata/gpu_idle_frac"] = idle / (idle + compute) if idle + compute > 0 else 0.0
        self._log(metrics)

    def _finish_epoch(self, trainer: L.Trainer, stage: Stage, prefix: str) -> None:
        self._events.resolve(stage, block=True)
        if stage is self._train and self._hot.log_every:
            stage.carry = stage.carry + stage.rows[stage.logged:stage.resolved]
        rows = rank_reduce.epoch_rows(stage.rows, self._hot.cuda)
        stage.rows = []
        stage.resolved = stage.logged = 0
        if not rows:
            return
        stage.history.extend(rows)
        summary = summarize(rows)
        summary["epoch_time_s"] = stage.epoch_times[-1] if stage.epoch_times else 0.0
        stage.epochs.append(summary)
        metrics = {f"{prefix}{k}": v for k, v in summary.items() if k.endswith(("_mean", "_p50", "_p95", "_frac"))}
        if trainer.loggers:
            self._log(metrics, epoch_end=stage is self._train)

    def _log(self, metrics: dict[str, float], epoch_end: bool = False) -> None:
        trainer = self._trainer
        step = self._logging_step(epoch_end)
        for logger in trainer.loggers:  # type: ignore[union-attr]
            logger.log_metrics(metrics, step=step)

    # ------------------------------------------------------------------ report

    def report(self) -> dict[str, Any]:
        """The figures so far, per stage, with a verdict and advice.

        Top-level keys describe training: ``steps``, ``samples``, ``epoch_time_s`` (last
        epoch), ``step_s``, ``data_wait_s``, ``compute_s``, ``overhead_s`` (totals),
        ``data_wait_frac``, ``compute_frac``, ``overhead_frac``, ``verdict``, ``share``,
        ``advice``. ``stages`` holds the same for "train" and "validate" (plus per-step
        p50/p95 in ms, per-epoch summaries and, with an ``OptimizedDataModule``,
        ``augment_ms_mean``: its loader's augmentation per step, in the fetch or ahead of it);
        ``replay`` holds the replay result or None;
        ``trace`` the written trace (``path``, ``first_step``, ``last_step``) or None;
        ``timing`` is ``"loop"``, or ``"hooks"`` when the public batch hooks were used.
        """
        stages = {s.name: self._stage_report(s) for s in (self._train, self._val)}
        train = stages["train"]
        keys = ("steps", "samples", "epoch_time_s", "step_s", "data_wait_s", "compute_s", "overhead_s",
                "data_wait_frac", "compute_frac", "overhead_frac", "verdict", "share", "advice")
        out: dict[str, Any] = {k: train[k] for k in keys}
        out["stages"] = stages
        out["replay"] = self._replayed
        out["trace"] = self._tracer.summary() if self._tracer is not None else None
        out["timing"] = self.timing
        r = self._replayed
        if r is not None and "slowdown" in r:
            out["advice"] = [*out["advice"],
                             f"replay: compute-only step {r['step_ms']:.1f} ms vs {r['real_step_ms']:.1f} ms with "
                             f"the real loader ({r['slowdown']:.2f}x the speed of light)"]
        return out

    def _stage_report(self, stage: Stage) -> dict[str, Any]:
        rows = stage.history + stage.rows[:stage.resolved]
        rep = summarize(rows)
        rep["samples"] = stage.samples
        rep["epoch_time_s"] = stage.epoch_times[-1] if stage.epoch_times else 0.0
        rep["epochs"] = list(stage.epochs)
        if stage.augment is not None and rep["steps"]:
            rep["augment_ms_mean"] = 1e3 * stage.augment / rep["steps"]
        context = self._contexts.get(stage.name, {})
        rep.update(verdict_of(rep, context))
        rep["advice"] = advise(rep, context, stage.name) if rep["steps"] else []
        return rep


def _context(trainer: L.Trainer, stage: str) -> dict[str, Any]:
    """What :func:`advise` knows of ``stage``'s ("train" or "validate") pipeline: the plan, its loader, the cores."""
    dm = trainer.datamodule
    try:
        loader = trainer.train_dataloader if stage == "train" else trainer.val_dataloaders
    except Exception:  # noqa: BLE001 (a loader the Trainer cannot describe gets no loader advice)
        loader = None
    return {"plan": getattr(dm, "plan", None), "vram_fraction": getattr(dm, "vram_fraction", None),
            "loader": loader_info(loader), "cores": max(1, cpu_count() // max(1, D.local_world_size())),
            "device_type": trainer.strategy.root_device.type}


def _several_loaders(trainer: L.Trainer) -> bool:
    """Whether training combines several loaders: each batch then holds one batch of each (a dict or list).

    ``trainer.fit`` refuses ``CombinedLoader(mode="sequential")``, the one mode that yields
    one loader's batch at a time.
    """
    try:
        loaders = trainer.train_dataloader
    except Exception:  # noqa: BLE001 (a loader the Trainer cannot describe counts as one)
        return False
    loaders = getattr(loaders, "iterables", loaders)  # a CombinedLoader passed to fit as such
    return isinstance(loaders, (dict, list, tuple)) and len(loaders) > 1


def _eval_loop(trainer: L.Trainer) -> Any:
    """The loop running validation now: the fit loop's own, or ``trainer.validate``'s."""
    return trainer.fit_loop.epoch_loop.val_loop if trainer.state.fn == TrainerFn.FITTING else trainer.validate_loop
