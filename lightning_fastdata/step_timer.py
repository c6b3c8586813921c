"""The per-step timer: the wrappers set on the Trainer's own calls, and the rows they record.

Each wrapper runs every step, between the model's own work, with cold caches: locals over
attributes, one clock read per boundary, no argument tuple or dict built, no call that is
not needed (see ``docs/profiler.md`` for the measured cost). The state they share sits in
two small slotted objects, :class:`Hot` (what every step reads) and :class:`Stage` (one
per stage: the rows).

A row has 8 columns (``STEP`` ... ``SAMPLES``), in seconds except the sample count; on a
CPU it is a tuple, complete when the step ends; on a GPU a list whose compute, idle and
corrected wait are filled in by :mod:`~lightning_fastdata.cuda_events` once the step's
CUDA events have completed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_fastdata import _lightning as door
from lightning_fastdata._util import batch_len

# Columns of a per-step row.
STEP, WAIT, FETCH, TRANSFER, COMPUTE, OVERHEAD, IDLE, SAMPLES = range(8)
WIDTH = SAMPLES + 1
# How the loops call a wrapped step (see make_step); ABSENT: an argument not passed.
AUTO, MANUAL, EVAL = range(3)
ABSENT: Any = object()
_NAN = math.nan


class Stage:
    """Timing state and per-step rows of one stage ("train" or "validate")."""

    # Slots: the fields a step touches sit together in a few cache lines, read without a dict lookup.
    __slots__ = ("name", "rows", "history", "epochs", "epoch_times", "samples", "pending", "fetch", "transfer",
                 "prev_end", "epoch_start", "prev_event", "resolved", "logged", "carry", "augment")

    def __init__(self, name: str) -> None:
        self.name = name
        self.rows: list[Sequence[float]] = []  # this epoch, this rank (tuples on a CPU, lists on a GPU)
        self.history: list[Sequence[float]] = []  # completed epochs, reduced over ranks
        self.epochs: list[dict[str, Any]] = []
        self.epoch_times: list[float] = []
        self.samples = 0
        # Seconds an OptimizedDataModule's loader spent augmenting this stage's batches (in its
        # fetch, or ahead of the step in its thread), over the fit: the report tells it from the
        # gather. None: not timed (no such data module).
        self.augment: float | None = None
        self.pending: deque[tuple[list[float], Any, Any, Any]] = deque()
        # The last epoch's rows after its last logged interval: the next interval's mean includes them.
        self.carry: list[Sequence[float]] = []
        self.new_epoch(None)

    def new_epoch(self, now: float | None) -> None:
        self.rows = []
        # The data wait of the step so far is fetch + transfer (kept apart, added once at step end).
        self.fetch = self.transfer = 0.0
        self.prev_end = self.epoch_start = now  # None before the first epoch: no step is timed
        self.prev_event: Any = None
        self.pending.clear()
        self.resolved = self.logged = 0


class Hot:
    """The timer state every step reads or writes, in one small object next to :class:`Stage`.

    The callback's own ``__dict__`` holds dozens of attributes (Lightning's hooks set to None
    among them); the wrappers touch this instead.
    """

    __slots__ = ("active", "fetch_t0", "fetch_end", "n", "log_every", "log_in", "cuda", "capture", "split")

    def __init__(self) -> None:
        self.active: Stage | None = None
        self.fetch_t0 = 0.0
        self.fetch_end: float | None = None
        self.n: int | None = None  # samples in the batch batch_to_device returned, for the step that takes it
        self.log_every = 0
        # Training steps until the next check of Lightning's logging step (0: no logger). Counting
        # down here replaces a read of the loop's step counter in every step.
        self.log_in = 0
        self.cuda = False
        self.capture = False  # replay mode still collecting batches
        # The stage whose batches hold several loaders' batches (a dict or list of training
        # loaders, combined by Lightning's CombinedLoader): their samples add up.
        self.split: Stage | None = None


def combined_len(batch: Any) -> int:
    """Samples in a batch combining several loaders' batches (a dict or list of them): the sum of theirs."""
    if isinstance(batch, dict):
        return sum(batch_len(b) for b in batch.values() if b is not None) or 1
    if isinstance(batch, (list, tuple)):
        # min_size/max_size modes leave None where a loader is exhausted.
        return sum(batch_len(b) for b in batch if b is not None) or 1
    return batch_len(batch)


#: ``trace(lane, t0, t1)`` records one span of the step running now; None when no trace is taken.
SpanSink = Callable[[int, float, float], None] | None


def make_before_fetch(clock: Callable[[], float], hot: Hot, original: Callable[[], None] | None) -> Callable[[], None]:
    """The fetch-start wrapper; ``original`` None skips Lightning's own hook (it only feeds a no-op profiler)."""
    if original is None:
        def before_fetch() -> None:
            hot.fetch_t0 = clock()
    else:
        def before_fetch() -> None:
            original()
            hot.fetch_t0 = clock()
    return before_fetch


def make_after_fetch(clock: Callable[[], float], hot: Hot, original: Callable[[], None] | None,
                     trace: SpanSink, lane: int = FETCH) -> Callable[[], None]:
    """The fetch-end wrapper: adds the fetch to the running stage's wait."""
    def after_fetch() -> None:
        now = clock()
        stage = hot.active
        if stage is not None:
            stage.fetch += now - hot.fetch_t0
            if trace is not None:
                trace(lane, hot.fetch_t0, now)
        hot.fetch_end = now
        if original is not None:
            original()
    return after_fetch


def make_transfer(clock: Callable[[], float], hot: Hot, original: Callable[..., Any],
                  trace: SpanSink, lane: int = TRANSFER) -> Callable[..., Any]:
    """The ``strategy.batch_to_device`` wrapper, timed from the end of the fetch.

    The loop's ``convert_input`` and ``on_before_batch_transfer`` run between the two, and
    are data preparation too. ``batch_to_device``'s own signature, passed on positionally:
    no argument tuple or dict is built per step.
    """
    def transfer(batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        t0 = hot.fetch_end
        if t0 is None:  # called outside the loop's fetch-then-transfer sequence
            t0 = clock()
        out = original(batch, device, dataloader_idx)
        hot.fetch_end = None
        stage = hot.active
        if stage is not None:
            t1 = clock()
            stage.transfer += t1 - t0
            if trace is not None:
                trace(lane, t0, t1)
            # The step's batch length, read here while the batch is still in the caches
            # (after the step, reading it again cost ~1.4 us in place, 0.2% of a tiny step).
            # batch_len's common case inlined (a list or tuple of tensors): one tensor attribute read.
            first = out[0] if (type(out) is list or type(out) is tuple) and out else None
            if stage is hot.split:
                hot.n = combined_len(out)
            elif type(first) is torch.Tensor:
                try:
                    hot.n = first.shape[0]
                except IndexError:  # a 0-d tensor: one sample
                    hot.n = 1
            else:
                hot.n = batch_len(out)
        return out
    return transfer


def make_prefetch_iter(original: Callable[[Any], Any], clock: Callable[[], float],
                       fetched: Callable[[Any, float, float], None]) -> Callable[[Any], Any]:
    """``_PrefetchDataFetcher.__iter__`` wrapped: the batch it fetches before the loop binds its
    fetch hooks (a loader without a length, see :func:`~lightning_fastdata._lightning.prefetch_iter`)
    is timed too, and handed to ``fetched(fetcher, start, end)``.
    """
    def __iter__(fetcher: Any) -> Any:
        start0, stop0 = door.fetch_hooks(fetcher)
        if door.is_wrapped(start0):  # already the loop's wrapped hook (a training epoch > 0): timed there
            return original(fetcher)
        t0 = 0.0

        def start() -> None:
            nonlocal t0
            start0()
            t0 = clock()

        def stop() -> None:
            fetched(fetcher, t0, clock())
            stop0()

        door.bind_fetch_hooks(fetcher, start, stop)
        try:
            return original(fetcher)
        finally:
            door.bind_fetch_hooks(fetcher, start0, stop0)
    return __iter__


class StepHooks:
    """What the step wrapper calls outside its common path, bound once when it is built.

    Attributes:
        record: Record a CUDA event now (GPU runs).
        end_on_device: ``(stage, row, start_event)``: queue a GPU row until its events complete.
        capture: ``(batch) -> still capturing``: replay mode's batch capture.
        fetched_batch: ``(train) -> batch``: the batch a ``dataloader_iter`` step took.
        log_due: ``(stage)``: Lightning's logging step may be due (sets ``Hot.log_in`` again).
        trace: ``(stage, row, start, now, start_event)``, or None when no trace is taken.
    """

    __slots__ = ("record", "end_on_device", "capture", "fetched_batch", "log_due", "trace")

    def __init__(self, record: Callable[[], Any], end_on_device: Callable[[Stage, list[float], Any], None],
                 capture: Callable[[Any], bool], fetched_batch: Callable[[bool], Any],
                 log_due: Callable[[Stage], None], trace: Callable[..., None] | None) -> None:
        self.record, self.end_on_device, self.capture = record, end_on_device, capture
        self.fetched_batch, self.log_due, self.trace = fetched_batch, log_due, trace


def make_step(original: Callable[..., Any], clock: Callable[[], float], hot: Hot, stage: Stage, train: bool,
              calls: int, hooks: StepHooks) -> Callable[..., Any]:
    """Time ``original`` as the compute of one ``stage`` step, in one closure with no further calls.

    ``calls`` says how the loop calls it (positionally): ``AUTO``, ``run(optimizer,
    batch_idx, kwargs)``; ``MANUAL``, ``run(kwargs)``; ``EVAL``,
    ``strategy.validation_step(batch[, batch_idx[, dataloader_idx]])``. The step's kwargs
    hold the batch. A step that takes a ``dataloader_iter`` gets the iterator instead; the
    loop's data fetcher then holds the batch it took. Fixed parameters instead of ``*args,
    **kwargs``: CPython then calls the wrapper and ``original`` without building an argument
    tuple and dict.
    """
    nan = _NAN
    record, end_on_device, trace = hooks.record, hooks.end_on_device, hooks.trace

    def step(a: Any, b: Any = ABSENT, c: Any = ABSENT) -> Any:
        if hot.active is not stage:
            return original(a) if b is ABSENT else original(a, b) if c is ABSENT else original(a, b, c)
        event = record() if hot.cuda else None
        wait0 = stage.fetch + stage.transfer
        start = clock()
        out = original(a) if b is ABSENT else original(a, b) if c is ABSENT else original(a, b, c)
        now = clock()
        n = hot.n  # read by the transfer wrapper
        if n is None or (train and hot.capture):
            if calls == EVAL:
                batch = a if not hasattr(type(a), "__next__") else None
            else:
                kwargs = c if calls == AUTO else a
                batch = kwargs.get("batch") if isinstance(kwargs, dict) else None
            if batch is not None and train and hot.capture:
                hot.capture = hooks.capture(batch)
            if n is None:  # no transfer (a dataloader_iter step): the batch the fetcher took
                b = batch if batch is not None else hooks.fetched_batch(train)
                n = combined_len(b) if stage is hot.split else batch_len(b)
        hot.n = None
        fetch, transfer = stage.fetch, stage.transfer
        wait, step_s = fetch + transfer, now - stage.prev_end
        if event is None:
            compute = now - start - (wait - wait0)  # a fetch inside the step (dataloader_iter) is wait
            # A tuple of floats: the collector stops tracking it at its first pass.
            row: Any = (step_s, wait, fetch, transfer, compute, step_s - wait - compute, nan, n)
            stage.rows.append(row)
            stage.resolved += 1
        else:
            row = [step_s, wait, fetch, transfer, nan, nan, nan, n]
            end_on_device(stage, row, event)
        if trace is not None:
            trace(stage, row, start, now, event)
        stage.samples += n
        stage.fetch = stage.transfer = 0.0
        stage.prev_end = now
        if train:
            left = hot.log_in  # 0: nothing logs per step
            if left:
                if left == 1:
                    hooks.log_due(stage)
                else:
                    hot.log_in = left - 1
        return out
    return step


class HookTimer:
    """The fallback when Lightning's loop internals cannot be wrapped: public batch hooks only.

    The wait is the time from the end of one batch (or the start of the epoch, or the end
    of a validation run) to the start of the next: fetch, transfer and on-device
    augmentation, and also whatever other callbacks do before it; the compute is
    ``on_*_batch_start`` to ``on_*_batch_end``. Fetch and transfer are not told apart
    (the whole wait counts as fetch) and the overhead is 0.
    """

    def __init__(self, clock: Callable[[], float], hot: Hot) -> None:
        self.clock, self.hot = clock, hot
        self.start = 0.0

    def batch_start(self, stage: Stage) -> None:
        if self.hot.active is stage and stage.prev_end is not None:
            self.start = self.clock()

    def batch_end(self, stage: Stage, batch: Any) -> None:
        if self.hot.active is not stage or stage.prev_end is None:
            return
        now = self.clock()
        wait, compute = self.start - stage.prev_end, now - self.start
        n = combined_len(batch) if stage is self.hot.split else batch_len(batch)
        stage.rows.append((wait + compute, wait, wait, 0.0, compute, 0.0, _NAN, n))
        stage.resolved += 1
        stage.samples += n
        stage.prev_end = now
