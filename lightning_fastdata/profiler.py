"""``DataWaitProfiler``: how much of each step is spent waiting for data, timed where it happens.

Every training and validation step is split into three parts that add up to its wall time:

* **data wait**: time the loop is blocked getting the next batch, measured inside the
  calls that do it: the loader's fetch (Lightning's fetcher hooks ``_on_before_fetch`` /
  ``_on_after_fetch``, which bracket ``next(iterator)``), then from the end of the fetch
  to the end of ``strategy.batch_to_device`` (the module's ``on_before_batch_transfer``,
  the host-to-device copy, and ``on_after_batch_transfer``, where on-device augmentation
  is launched);
* **compute**: the step itself, minus any wait inside it (a ``dataloader_iter`` step
  fetches inside): for training, Lightning's optimisation run (``training_step``,
  ``backward`` and the optimizer step, automatic or manual); for validation,
  ``strategy.validation_step``. On a GPU it is the device time between two CUDA events
  recorded around it, read a few steps later once the events have completed
  (``Event.query``), so no step is ever synchronised. There, the data wait counts only
  the part of the host's blocked time that device compute does not cover
  (``min(wait, step - compute)``): a synchronising copy that waits for earlier kernels is
  compute showing up on the host, the error Lightning's SimpleProfiler makes;
* **overhead**: the rest of the step: the batch hooks of callbacks and of the module,
  logging, loop bookkeeping.

A step runs from the end of the previous one (or the start of the epoch, or the end of a
validation run) to the end of its own. On a GPU the device's idle gap between steps (end
event of one step to start event of the next) is reported too.

Nothing here runs as a per-step callback hook: Lightning dispatches each of the six batch
hooks to every callback that has it, at about 1.4 us per hook, so an empty ``Callback``
already costs a 0.7 ms step 1.4% (see ``benchmarks/callback_overhead.py``). Instead the
calls above are wrapped on the Trainer's own loop and strategy objects for the duration of
the run and restored in ``teardown``.

Figures are logged through the Trainer's loggers every ``log_every_n_steps`` (the mean of
the steps since the last log) and per epoch (mean, p50, p95). Under DDP each figure is
the largest over ranks, reduced in one collective per logging interval and per epoch,
never per step. After ``fit``, rank 0 prints a report with a verdict and advice; the same
is returned by :meth:`DataWaitProfiler.report`.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_fastdata import distributed as D
from lightning_fastdata._util import batch_len, fmt_bytes

_NAN = math.nan
# Columns of a per-step row.
STEP, WAIT, FETCH, TRANSFER, COMPUTE, OVERHEAD, IDLE, SAMPLES = range(8)
# How the loops call a wrapped step (see DataWaitProfiler._wrap_step); _ABSENT: an argument not passed.
_AUTO, _MANUAL, _EVAL = range(3)
_ABSENT: Any = object()
_FIGURES = (("step", STEP), ("data_wait", WAIT), ("compute", COMPUTE), ("overhead", OVERHEAD))
#: A data wait at or above this share of the step gets data-loading advice.
DATA_ADVICE_FRAC = 0.10
#: Framework overhead at or above this share of the step gets its own advice.
OVERHEAD_ADVICE_FRAC = 0.25
#: Per-step hooks the profiler never uses. Lightning dispatches every hook to every callback,
#: and each dispatch costs ~1.4 us (~16,000 instructions) per step even for an empty hook (a
#: profiler context and an f-string): a no-op Callback adds ~1.6% to a tiny model's step.
#: Lightning's ``_call_callback_hooks`` skips a hook attribute that is not callable, so these
#: are set to None on the instance (unless a subclass overrides them).
_UNUSED_STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_validation_batch_start",
                      "on_validation_batch_end", "on_test_batch_start", "on_test_batch_end",
                      "on_predict_batch_start", "on_predict_batch_end", "on_before_backward",
                      "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")


class _Stage:
    """Timing state and per-step rows of one stage ("train" or "validate")."""

    # Slots: the fields a step touches sit together in a few cache lines, read without a dict lookup.
    __slots__ = ("name", "rows", "history", "epochs", "epoch_times", "samples", "pending", "fetch", "transfer",
                 "prev_end", "epoch_start", "prev_event", "resolved", "logged")

    def __init__(self, name: str) -> None:
        self.name = name
        self.rows: list[Sequence[float]] = []  # this epoch, this rank (tuples on a CPU, lists on a GPU)
        self.history: list[Sequence[float]] = []  # completed epochs, reduced over ranks
        self.epochs: list[dict[str, Any]] = []
        self.epoch_times: list[float] = []
        self.samples = 0
        self.pending: deque[tuple[list[float], Any, Any, Any]] = deque()
        self.new_epoch(None)

    def new_epoch(self, now: float | None) -> None:
        self.rows = []
        # The data wait of the step so far is fetch + transfer (kept apart, added once at step end).
        self.fetch = self.transfer = 0.0
        self.prev_end = self.epoch_start = now  # None before the first epoch: no step is timed
        self.prev_event: Any = None
        self.pending.clear()
        self.resolved = self.logged = 0


class _Hot:
    """The profiler state every step reads or writes, in one small object next to :class:`_Stage`.

    The callback's own ``__dict__`` holds dozens of attributes (Lightning's hooks set to None
    among them); the wrappers run between the model's own work, with cold caches, so they
    touch this instead.
    """

    __slots__ = ("active", "fetch_t0", "fetch_end", "n", "log_every", "cuda", "capture")

    def __init__(self) -> None:
        self.active: _Stage | None = None
        self.fetch_t0 = 0.0
        self.fetch_end: float | None = None
        self.n: int | None = None  # samples in the batch batch_to_device returned, for the step that takes it
        self.log_every = 0
        self.cuda = False
        self.capture = False  # replay mode still collecting batches


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
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, replay_steps: int = 0,
                 replay_batches: int = 4, replay_warmup: int = 2, max_pending: int = 16,
                 print_report: bool = True) -> None:
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        for name, value, low in (("replay_steps", replay_steps, 0), ("replay_batches", replay_batches, 1),
                                 ("replay_warmup", replay_warmup, 0), ("max_pending", max_pending, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self.clock = clock
        self.replay_steps, self.replay_batches, self.replay_warmup = replay_steps, replay_batches, replay_warmup
        self.max_pending = max_pending
        self.print_report = print_report
        self._train, self._val = _Stage("train"), _Stage("validate")
        self._hot = _Hot()
        self._patches: list[tuple[object, str, Any]] = []
        self._captured: list[Any] = []
        self._replay: dict[str, Any] | None = None
        self._context: dict[str, Any] = {}
        # FastDataCallback(profile=False) wraps nothing and times nothing (see _disable).
        self._enabled = True
        _skip_dispatch(self, _UNUSED_STEP_HOOKS, Callback)

    def _disable(self) -> None:
        """Stop timing: :meth:`setup` then wraps nothing."""
        self._enabled = False
        self._hot.active = None

    # ------------------------------------------------------------------ installation

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Wrap the calls that fetch, transfer, augment and compute batches (restored in ``teardown``)."""
        if not self._enabled or stage not in ("fit", "validate") or self._patches:
            return
        if getattr(trainer.strategy.batch_to_device, "_fastdata_wrapper", False):
            # Two profilers would nest their wrappers and could not restore them in any order.
            rank_zero_warn(f"{type(self).__name__}: another DataWaitProfiler/FastDataCallback already times this "
                           "Trainer; this one stays idle. Keep one of them (FastDataCallback includes the profiler).")
            self._disable()
            return
        self._hot.cuda = trainer.strategy.root_device.type == "cuda"
        # Lightning's own fetch hooks only feed trainer.profiler; with the default no-op profiler
        # they are skipped, so that the timed fetch costs no more than the untimed one.
        quiet = type(trainer.profiler) is PassThroughProfiler
        epoch_loop = trainer.fit_loop.epoch_loop
        for loop in (epoch_loop, epoch_loop.val_loop, trainer.validate_loop):
            self._patch(loop, "_on_before_fetch", self._wrap_before_fetch(None if quiet else loop._on_before_fetch))
            self._patch(loop, "_on_after_fetch", self._wrap_after_fetch(None if quiet else loop._on_after_fetch))
        # Each is called through instance attribute lookup by the loops (Lightning 2.x).
        strategy = trainer.strategy
        self._patch(strategy, "batch_to_device", self._wrap_transfer(strategy.batch_to_device))
        auto, manual = epoch_loop.automatic_optimization, epoch_loop.manual_optimization
        self._patch(auto, "run", self._wrap_step(auto.run, trainer, self._train, _AUTO))
        self._patch(manual, "run", self._wrap_step(manual.run, trainer, self._train, _MANUAL))
        self._patch(strategy, "validation_step", self._wrap_step(strategy.validation_step, trainer, self._val, _EVAL))

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Restore everything :meth:`setup` wrapped."""
        for obj, name, old in reversed(self._patches):
            _restore(obj, name, old)
        self._patches.clear()
        self._hot.active = None

    def _patch(self, obj: object, name: str, wrapper: Callable[..., Any]) -> None:
        # Never read obj.__dict__: on CPython 3.11+ that materialises the instance dict and
        # slows every later attribute read on these hot loop objects (measured: ~2% of a step).
        self._patches.append((obj, name, getattr(obj, name)))
        wrapper._fastdata_wrapper = True  # type: ignore[attr-defined]
        object.__setattr__(obj, name, wrapper)

    # The wrappers run every step: locals over attributes, one clock read per boundary.

    def _wrap_before_fetch(self, original: Callable[[], None] | None) -> Callable[[], None]:
        clock, hot = self.clock, self._hot
        if original is None:
            def before_fetch() -> None:
                hot.fetch_t0 = clock()
        else:
            def before_fetch() -> None:
                original()
                hot.fetch_t0 = clock()
        return before_fetch

    def _wrap_after_fetch(self, original: Callable[[], None] | None) -> Callable[[], None]:
        clock, hot = self.clock, self._hot

        def after_fetch() -> None:
            now = clock()
            stage = hot.active
            if stage is not None:
                stage.fetch += now - hot.fetch_t0
            hot.fetch_end = now
            if original is not None:
                original()
        return after_fetch

    def _wrap_transfer(self, original: Callable[..., Any]) -> Callable[..., Any]:
        # Timed from the end of the fetch: the loop's convert_input and on_before_batch_transfer
        # run between the two, and are data preparation too. Strategy.batch_to_device's own
        # signature, passed on positionally: no argument tuple or dict is built per step.
        clock, hot = self.clock, self._hot

        def transfer(batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
            t0 = hot.fetch_end
            if t0 is None:  # called outside the loop's fetch-then-transfer sequence
                t0 = clock()
            out = original(batch, device, dataloader_idx)
            hot.fetch_end = None
            stage = hot.active
            if stage is not None:
                stage.transfer += clock() - t0
                # The step's batch length, read here while the batch is still in the caches
                # (after the step, reading it again cost ~1.4 us in place, 0.2% of a tiny step).
                # batch_len's common case inlined (a list or tuple of tensors): one tensor attribute read.
                first = out[0] if (type(out) is list or type(out) is tuple) and out else None
                if type(first) is torch.Tensor:
                    try:
                        hot.n = first.shape[0]
                    except IndexError:  # a 0-d tensor: one sample
                        hot.n = 1
                else:
                    hot.n = batch_len(out)
            return out
        return transfer

    def _wrap_step(self, original: Callable[..., Any], trainer: L.Trainer, stage: _Stage,
                   calls: int) -> Callable[..., Any]:
        """Time ``original`` as the compute of one ``stage`` step, in one closure with no further calls.

        ``calls`` says how the loop calls it (Lightning 2.x, positionally): ``_AUTO``,
        ``_AutomaticOptimization.run(optimizer, batch_idx, kwargs)``; ``_MANUAL``,
        ``_ManualOptimization.run(kwargs)``; ``_EVAL``, ``strategy.validation_step(batch[,
        batch_idx[, dataloader_idx]])``. The step's kwargs hold the batch. A step that takes
        a ``dataloader_iter`` gets the iterator instead; the loop's data fetcher then holds
        the batch it took. Fixed parameters instead of ``*args, **kwargs``: CPython then
        calls the wrapper and ``original`` without building an argument tuple and dict.
        """
        clock, hot, train, nan = self.clock, self._hot, stage is not self._val, _NAN
        fit_loop = trainer.fit_loop
        epoch_loop = fit_loop.epoch_loop  # fixed for the Trainer's life; one attribute read less per step

        def step(a: Any, b: Any = _ABSENT, c: Any = _ABSENT) -> Any:
            if hot.active is not stage:
                return original(a) if b is _ABSENT else original(a, b) if c is _ABSENT else original(a, b, c)
            event = self._record() if hot.cuda else None
            wait0 = stage.fetch + stage.transfer
            start = clock()
            out = original(a) if b is _ABSENT else original(a, b) if c is _ABSENT else original(a, b, c)
            now = clock()
            n = hot.n  # read by the transfer wrapper
            if n is None or (train and hot.capture):
                if calls == _EVAL:
                    batch = a if not hasattr(type(a), "__next__") else None
                else:
                    kwargs = c if calls == _AUTO else a
                    batch = kwargs.get("batch") if isinstance(kwargs, dict) else None
                if batch is not None and train and hot.capture:
                    self._captured.append(batch)
                    hot.capture = len(self._captured) < self.replay_batches
                if n is None:  # no transfer (a dataloader_iter step): the batch the fetcher took
                    n = batch_len(batch if batch is not None else
                                  _fetched_batch(fit_loop if train else _eval_loop(trainer)))
            hot.n = None
            fetch, transfer = stage.fetch, stage.transfer
            wait, step_s = fetch + transfer, now - stage.prev_end
            if event is None:
                compute = now - start - (wait - wait0)  # a fetch inside the step (dataloader_iter) is wait
                # A tuple of floats: the collector stops tracking it at its first pass.
                stage.rows.append((step_s, wait, fetch, transfer, compute, step_s - wait - compute, nan, n))
                stage.resolved += 1
            else:
                self._end_on_device(stage, [step_s, wait, fetch, transfer, nan, nan, nan, n], event)
            stage.samples += n
            stage.fetch = stage.transfer = 0.0
            stage.prev_end = now
            if train:
                every = hot.log_every  # set once per epoch
                if every and (epoch_loop._batches_that_stepped + 1) % every == 0:
                    self._log_interval(trainer, stage)
            return out
        return step

    # ------------------------------------------------------------------ training hooks

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._context = _context(trainer)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._enabled:
            return
        self._train.new_epoch(self.clock())
        self._hot.active = self._train
        self._hot.n = None
        self._hot.log_every = trainer.log_every_n_steps if trainer.loggers else 0
        self._hot.capture = bool(self.replay_steps) and len(self._captured) < self.replay_batches

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stage = self._train
        if not self._enabled:
            return
        if stage.epoch_start is not None:
            stage.epoch_times.append(self.clock() - stage.epoch_start)
        self._finish_epoch(trainer, stage, "fastdata/epoch/")
        self._hot.active = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.replay_steps and self._captured:
            self._replay = self._run_replay(trainer, pl_module)
        elif self.replay_steps and self._enabled and self._train.history:
            rank_zero_warn(f"{type(self).__name__}: replay_steps={self.replay_steps} but no batch was captured: "
                           "a training_step that takes a dataloader_iter cannot be replayed; set replay_steps=0.")
        self._captured = []

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._enabled and self.print_report and trainer.is_global_zero:
            rank_zero_info(format_report(self.report()))

    # ------------------------------------------------------------------ validation hooks

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._hot.active = None if trainer.sanity_checking or not self._enabled else self._val

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._hot.active is self._val:
            self._val.new_epoch(self.clock())

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
        else:
            self._hot.active = None

    # ------------------------------------------------------------------ per step

    @staticmethod
    def _record() -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _end_on_device(self, stage: _Stage, row: list[float], start_event: Any) -> None:
        """Queue a GPU step's row: its compute is read from its CUDA events once they have completed."""
        end_event = self._record()
        stage.pending.append((row, start_event, end_event, stage.prev_event))
        stage.prev_event = end_event
        stage.rows.append(row)
        self._resolve(stage, block=False)

    def _resolve(self, stage: _Stage, block: bool) -> None:
        """Read the CUDA events of finished steps; wait only at epoch end or when too many are unread."""
        if block and stage.pending:
            # One wait for the newest step: the stream runs in order, so every older event is then done too.
            stage.pending[-1][2].synchronize()
        while stage.pending:
            row, start, end, prev = stage.pending[0]
            if not (block or len(stage.pending) > self.max_pending or end.query()):
                break
            end.synchronize()  # returns at once when query() was True
            compute = start.elapsed_time(end) / 1e3
            row[COMPUTE] = compute
            # A blocking copy can hold the host inside batch_to_device while the device is still
            # busy with earlier steps: that time is compute, not starvation. Only the part of the
            # host's wait that device compute does not cover counts (fetch/transfer stay raw).
            row[WAIT] = min(row[WAIT], max(0.0, row[STEP] - compute))
            row[OVERHEAD] = row[STEP] - row[WAIT] - compute if row[STEP] > compute else 0.0
            row[IDLE] = prev.elapsed_time(start) / 1e3 if prev is not None else 0.0
            stage.pending.popleft()
            stage.resolved += 1

    # ------------------------------------------------------------------ logging

    def _log_interval(self, trainer: L.Trainer, stage: _Stage) -> None:
        rows = stage.rows[stage.logged:stage.resolved]
        stage.logged = stage.resolved
        # Plain sums over the transposed rows: a few dozen rows, where numpy's call overhead would dominate.
        columns = list(zip(*rows, strict=True)) if rows else []
        means = [sum(columns[c]) / len(rows) if rows else 0.0 for c in (STEP, WAIT, COMPUTE, OVERHEAD, IDLE)]
        means = [0.0 if math.isnan(v) else v for v in means]
        # One collective per logging interval: the slowest rank's figures gate the step.
        count, step, wait, compute, overhead, idle = D.all_reduce_max_list([len(rows), *means])
        if not count:
            return
        metrics = {"fastdata/data_wait_ms": 1e3 * wait, "fastdata/compute_ms": 1e3 * compute,
                   "fastdata/overhead_ms": 1e3 * overhead, "fastdata/step_ms": 1e3 * step,
                   "fastdata/data_wait_frac": wait / step if step > 0 else 0.0}
        if self._hot.cuda:
            metrics["fastdata/gpu_idle_frac"] = idle / (idle + compute) if idle + compute > 0 else 0.0
        _log(trainer, metrics)

    def _finish_epoch(self, trainer: L.Trainer, stage: _Stage, prefix: str) -> None:
        self._resolve(stage, block=True)
        rows = stage.rows
        if D.world_size() > 1 and D.is_initialized():
            # Ranks run equal step counts under DistributedSampler semantics; keep the common ones.
            k = D.all_reduce_min(len(rows))
            flat = D.all_reduce_max_list([0.0 if math.isnan(v) else v for r in rows[:k] for v in r[:SAMPLES]])
            rows = [[*flat[i * SAMPLES:(i + 1) * SAMPLES], rows[i][SAMPLES]] for i in range(k)]
            if not self._hot.cuda:
                for r in rows:
                    r[IDLE] = math.nan
        stage.rows = []
        stage.resolved = stage.logged = 0
        if not rows:
            return
        stage.history.extend(rows)
        summary = summarize(rows)
        summary["epoch_time_s"] = stage.epoch_times[-1] if stage.epoch_times else 0.0
        stage.epochs.append(summary)
        metrics = {f"{prefix}{k}": v for k, v in summary.items()
                   if k.endswith(("_mean", "_p50", "_p95", "_frac"))}
        if trainer.loggers:
            _log(trainer, metrics)

    # ------------------------------------------------------------------ replay

    def _run_replay(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """Optimise on captured device batches only; restore every state it touched."""
        self._hot.active = None
        optimizers = list(trainer.optimizers)
        model_state = copy.deepcopy(pl_module.state_dict())
        opt_states = [copy.deepcopy(o.state_dict()) for o in optimizers]
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if self._hot.cuda else None
        patched = {name: getattr(pl_module, name) for name in ("log", "log_dict")}
        # self.log outside the loop has no result collection to write to; replay logs nothing.
        object.__setattr__(pl_module, "log", _no_log)
        object.__setattr__(pl_module, "log_dict", _no_log)
        times: list[float] = []
        try:
            for i in range(self.replay_warmup):
                self._replay_step(trainer, pl_module, optimizers, i)
            self._sync()
            t_all = self.clock()
            for i in range(self.replay_steps):
                t0 = self.clock()
                self._replay_step(trainer, pl_module, optimizers, i)
                times.append(self.clock() - t0)
            self._sync()
            total = self.clock() - t_all
        finally:
            for name, old in patched.items():
                if getattr(old, "__self__", None) is pl_module:
                    object.__delattr__(pl_module, name)  # it came from the class
                else:
                    object.__setattr__(pl_module, name, old)
            pl_module.load_state_dict(model_state)
            for opt, state in zip(optimizers, opt_states, strict=True):
                opt.load_state_dict(state)
                opt.zero_grad(set_to_none=True)
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        # Without a per-step synchronize, per-step host times mean nothing on a GPU: use the total.
        step_s = total / self.replay_steps if self._hot.cuda else float(np.median(times))
        real = summarize(self._train.history) if self._train.history else None
        out: dict[str, Any] = {"steps": self.replay_steps, "batches": len(self._captured),
                               "step_ms": 1e3 * step_s}
        if real is not None and real["steps"]:
            real_ms = real["step_ms_p50"]
            out.update(real_step_ms=real_ms, real_compute_ms=real["compute_ms_p50"],
                       slowdown=real_ms / (1e3 * step_s) if step_s > 0 else math.inf,
                       loader_cost_ms=real_ms - 1e3 * step_s)
        return out

    def _replay_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizers: list[Any],
                     i: int) -> None:
        batch = self._captured[i % len(self._captured)]
        try:
            kwargs = trainer.fit_loop.epoch_loop._build_kwargs({}, batch, i)
        except AttributeError:
            kwargs = {"batch": batch, "batch_idx": i}
        out = trainer.strategy.training_step(*kwargs.values())
        if not pl_module.automatic_optimization:
            return  # the step optimised itself
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor) or not optimizers:
            return
        trainer.strategy.backward(loss, optimizers[0])
        optimizers[0].step()
        optimizers[0].zero_grad(set_to_none=True)

    def _sync(self) -> None:
        if self._hot.cuda:
            torch.cuda.synchronize()

    # ------------------------------------------------------------------ report

    def report(self) -> dict[str, Any]:
        """The figures so far, per stage, with a verdict and advice.

        Top-level keys describe training: ``steps``, ``samples``, ``epoch_time_s`` (last
        epoch), ``step_s``, ``data_wait_s``, ``compute_s``, ``overhead_s`` (totals),
        ``data_wait_frac``, ``compute_frac``, ``overhead_frac``, ``verdict``, ``share``,
        ``advice``. ``stages`` holds the same for "train" and "validate" (plus per-step
        p50/p95 in ms and per-epoch summaries); ``replay`` holds the replay result or None.
        """
        stages = {s.name: self._stage_report(s) for s in (self._train, self._val)}
        train = stages["train"]
        keys = ("steps", "samples", "epoch_time_s", "step_s", "data_wait_s", "compute_s", "overhead_s",
                "data_wait_frac", "compute_frac", "overhead_frac", "verdict", "share", "advice")
        out: dict[str, Any] = {k: train[k] for k in keys}
        out["stages"] = stages
        out["replay"] = self._replay
        if self._replay is not None and "slowdown" in self._replay:
            r = self._replay
            out["advice"] = [*out["advice"],
                             f"replay: compute-only step {r['step_ms']:.1f} ms vs {r['real_step_ms']:.1f} ms with "
                             f"the real loader ({r['slowdown']:.2f}x the speed of light)"]
        return out

    def _stage_report(self, stage: _Stage) -> dict[str, Any]:
        rows = stage.history + stage.rows[:stage.resolved]
        rep = summarize(rows)
        rep["samples"] = stage.samples
        rep["epoch_time_s"] = stage.epoch_times[-1] if stage.epoch_times else 0.0
        rep["epochs"] = list(stage.epochs)
        rep.update(verdict_of(rep))
        rep["advice"] = advise(rep, self._context) if rep["steps"] else []
        return rep


# ---------------------------------------------------------------------- pure helpers


def summarize(rows: Sequence[Sequence[float]]) -> dict[str, Any]:
    """Totals, shares, and mean/p50/p95 in ms of step, data wait, compute and overhead (rows of 8 columns)."""
    out: dict[str, Any] = {"steps": len(rows)}
    # fromiter over the flat rows: np.asarray would inspect every float of every row (epoch end, all rows).
    flat = itertools.chain.from_iterable(rows)
    arr = np.fromiter(flat, dtype=np.float64, count=len(rows) * (SAMPLES + 1)).reshape(len(rows), SAMPLES + 1)
    total = float(arr[:, STEP].sum())
    for name, col in _FIGURES:
        v = arr[:, col]
        out[f"{name}_s"] = float(v.sum())
        out[f"{name}_ms_mean"] = 1e3 * float(v.mean()) if len(v) else 0.0
        out[f"{name}_ms_p50"] = 1e3 * float(np.percentile(v, 50)) if len(v) else 0.0
        out[f"{name}_ms_p95"] = 1e3 * float(np.percentile(v, 95)) if len(v) else 0.0
    for name, col in (("fetch", FETCH), ("transfer", TRANSFER)):
        out[f"{name}_ms_mean"] = 1e3 * float(arr[:, col].mean()) if len(rows) else 0.0
    for name in ("data_wait", "compute", "overhead"):
        out[f"{name}_frac"] = out[f"{name}_s"] / total if total > 0 else 0.0
    idle = arr[:, IDLE]
    if len(rows) and not np.isnan(idle).all():
        busy = float(np.nansum(idle)) + out["compute_s"]
        out["gpu_idle_frac"] = float(np.nansum(idle)) / busy if busy > 0 else 0.0
    return out


def verdict_of(summary: Mapping[str, Any]) -> dict[str, Any]:
    """``data-bound`` when the data wait exceeds compute, else ``compute-bound``, with the share."""
    if not summary.get("steps"):
        return {"verdict": "no steps", "share": 0.0}
    if summary["data_wait_s"] > summary["compute_s"]:
        return {"verdict": "data-bound", "share": summary["data_wait_frac"]}
    return {"verdict": "compute-bound", "share": summary["compute_frac"]}


def advise(summary: Mapping[str, Any], context: Mapping[str, Any]) -> list[str]:
    """Concrete advice from the measured shares and what is known of the input pipeline.

    Args:
        summary: A stage summary (:func:`summarize` plus :func:`verdict_of`).
        context: ``plan`` (a :class:`~lightning_fastdata.plan.Plan` or None),
            ``vram_fraction``, ``loader`` (``num_workers``, ``pin_memory``, ``kind``),
            ``cores`` (CPU cores per local rank) and ``device_type``.
    """
    w, c, o = summary["data_wait_frac"], summary["compute_frac"], summary["overhead_frac"]
    wait_ms, transfer_ms = summary["data_wait_ms_mean"], summary["transfer_ms_mean"]
    plan, loader = context.get("plan"), context.get("loader") or {}
    cores = int(context.get("cores") or 1)
    cuda = context.get("device_type") == "cuda"
    advice: list[str] = []
    lead = f"data wait is {w:.0%} of the step"
    if w >= DATA_ADVICE_FRAC:
        strategy = getattr(plan, "strategy", None)
        resources = getattr(plan, "resources", None)
        store = int(getattr(plan, "store_nbytes", 0) or 0)
        if strategy == "device" or loader.get("kind") == "device":
            advice.append(f"{lead}, with the data already on the device: the wait is the batch gather and "
                          f"on-device augmentation ({transfer_ms:.1f} of {wait_ms:.1f} ms): use a lighter "
                          "train_augment or a larger batch")
        elif strategy in ("workers", "chunked") and store and resources is not None:
            vf = float(context.get("vram_fraction") or 0.6)
            what = "GPU" if resources.device_type == "cuda" else "device"
            total = resources.device_total
            if store <= vf * total:
                advice.append(f"{lead}; the store ({fmt_bytes(store)}) fits {vf:.0%} of this {what}'s "
                              f"{fmt_bytes(total)}: set strategy=device")
            else:
                advice.append(f"{lead}; the store ({fmt_bytes(store)}) is more than {vf:.0%} of this "
                              f"{what}'s {fmt_bytes(total)}, so it stays on the host")
        nw = loader.get("num_workers")
        if strategy != "device" and loader.get("kind") != "device" and nw is not None:
            if nw == 0:
                fix = "" if plan is not None else " or cache the preprocessing with OptimizedDataModule"
                advice.append(f"{lead}; batches are loaded in the main process (num_workers=0): set "
                              f"num_workers={max(1, cores - 1)}{fix}")
            elif nw >= cores:
                advice.append(f"workers are saturated: {nw} of {cores} cores; more workers cannot help: "
                              "cache the static preprocessing (OptimizedDataModule) and move augmentation "
                              "to the device")
            elif nw + 1 >= cores:
                advice.append(f"workers are saturated: {nw} workers + the main process on {cores} cores; "
                              "cache the static preprocessing and move augmentation to the device")
            else:
                advice.append(f"{lead}; {nw} workers on {cores} cores: raise num_workers to {cores - 1}")
            if cuda and not loader.get("pin_memory"):
                advice.append("set pin_memory=True: host-to-device copies come from pageable memory")
        if wait_ms > 0 and transfer_ms > 0.5 * wait_ms and strategy != "device":
            advice.append(f"transfer and on-device augmentation take {transfer_ms:.1f} of the {wait_ms:.1f} ms "
                          "wait: keep the data on the device (strategy=device) or lighten the augmentation")
    if summary.get("verdict") == "compute-bound":
        advice.append(f"compute-bound: compute is {c:.0%} of the step, data wait {w:.0%}; the input pipeline "
                      "keeps up: speed now comes from the model (mixed precision, a larger batch, "
                      "torch.compile)")
    if o >= OVERHEAD_ADVICE_FRAC:
        advice.append(f"framework overhead is {o:.0%} of the step (logging, callbacks, loop bookkeeping): "
                      "raise log_every_n_steps or the batch size")
    idle = summary.get("gpu_idle_frac")
    if idle is not None and idle >= DATA_ADVICE_FRAC:
        advice.append(f"the GPU is idle {idle:.0%} of the time between steps")
    return advice


def format_report(report: Mapping[str, Any]) -> str:
    """The report as text: per stage, the figures, the verdict and the advice."""
    lines = ["lightning_fastdata profile"]
    for name, s in report["stages"].items():
        if not s["steps"]:
            continue
        lines.append(f"  {name}: {s['steps']} steps, step p50 {s['step_ms_p50']:.1f} ms "
                     f"(p95 {s['step_ms_p95']:.1f}); data wait {s['data_wait_ms_mean']:.1f} ms "
                     f"({s['data_wait_frac']:.0%}), compute {s['compute_ms_mean']:.1f} ms "
                     f"({s['compute_frac']:.0%}), overhead {s['overhead_ms_mean']:.1f} ms "
                     f"({s['overhead_frac']:.0%})"
                     + (f", GPU idle {s['gpu_idle_frac']:.0%}" if "gpu_idle_frac" in s else ""))
        lines.append(f"    verdict: {s['verdict']} ({s['share']:.0%})")
        lines += [f"    - {a}" for a in s["advice"]]
    r = report.get("replay")
    if r:
        line = f"  replay: compute-only step {r['step_ms']:.1f} ms over {r['steps']} steps"
        if "real_step_ms" in r:
            line += f"; real loader {r['real_step_ms']:.1f} ms ({r['slowdown']:.2f}x the speed of light)"
        lines.append(line)
    return "\n".join(lines)


def _context(trainer: L.Trainer) -> dict[str, Any]:
    dm = trainer.datamodule
    try:
        loader = trainer.train_dataloader
    except Exception:  # noqa: BLE001 (a loader the Trainer cannot describe gets no loader advice)
        loader = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"plan": getattr(dm, "plan", None), "vram_fraction": getattr(dm, "vram_fraction", None),
            "loader": loader_info(loader), "cores": max(1, cores // max(1, D.local_world_size())),
            "device_type": trainer.strategy.root_device.type}


def loader_info(loader: Any) -> dict[str, Any]:
    """``kind``, ``num_workers``, ``pin_memory``, ``persistent_workers`` of a loader (first of several)."""
    if isinstance(loader, Mapping):
        loader = next(iter(loader.values()), None)
    elif isinstance(loader, (list, tuple)):
        loader = loader[0] if loader else None
    if loader is None:
        return {}
    if hasattr(loader, "fields") and hasattr(loader, "order"):
        return {"kind": "device"}
    dl = getattr(loader, "dataloader", loader)
    if not hasattr(dl, "num_workers"):
        return {"kind": type(loader).__name__}
    return {"kind": "dataloader", "num_workers": int(dl.num_workers),
            "pin_memory": bool(getattr(dl, "pin_memory", False)),
            "persistent_workers": bool(getattr(dl, "persistent_workers", False))}


def _step(trainer: L.Trainer) -> int:
    try:
        return int(trainer.fit_loop.epoch_loop._batches_that_stepped)
    except AttributeError:
        return int(trainer.global_step)


def _log(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    step = _step(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def _skip_dispatch(callback: Callback, names: tuple[str, ...], owner: type) -> None:
    """Hide hooks from Lightning's dispatch (see ``_UNUSED_STEP_HOOKS``) unless a subclass overrides them."""
    for name in names:
        if getattr(type(callback), name, None) is getattr(owner, name):
            setattr(callback, name, None)


def _restore(obj: object, name: str, original: Any) -> None:
    """Undo a wrapper set on ``obj.name``: a method of ``obj``'s class shows through again."""
    if getattr(original, "__self__", None) is obj:  # a bound method: it came from the class
        object.__delattr__(obj, name)
    else:
        object.__setattr__(obj, name, original)


def _eval_loop(trainer: L.Trainer) -> Any:
    """The loop running validation now: the fit loop's own, or ``trainer.validate``'s."""
    return trainer.fit_loop.epoch_loop.val_loop if trainer.state.fn == TrainerFn.FITTING else trainer.validate_loop


def _fetched_batch(loop: Any) -> Any:
    """The batch a loop's data fetcher took last (how a ``dataloader_iter`` step's batch is known)."""
    return getattr(getattr(loop, "_data_fetcher", None), "_batch", None)


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None
