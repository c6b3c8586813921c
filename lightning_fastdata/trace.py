"""The profile as a picture: a Chrome trace (JSON trace event format) of a window of training steps.

Opened by https://ui.perfetto.dev or chrome://tracing. One process per rank (``pid`` =
global rank), one thread per lane (``tid``), one complete event (``"ph": "X"``, ``ts`` and
``dur`` in microseconds of the profiler's clock) per span:

* ``step``: the whole step, from the end of the previous one;
* ``fetch``, ``transfer``: the loader's fetch and ``batch_to_device`` (timed from the end of
  the fetch, as the data wait is); ``augment``: the datamodule's ``on_after_batch_transfer``,
  which runs inside the transfer, and an ``OptimizedDataModule`` loader's augmentation inside
  the fetch; ``augment (loader thread)``: that augmentation run ahead in the loader's thread
  (``augment_ahead``), drawn where it ran, overlapping the steps before the one it feeds, and
  labelled with the step it ended in;
* ``compute``: the step call (training_step, backward, optimizer step), less any fetch or
  transfer inside it (a ``dataloader_iter`` step: compute in pieces around its fetch); on a
  GPU, the host's time in that call (launching the work);
* ``overhead``: the rest of the step (callbacks' and the module's batch hooks, logging);
  fetch + transfer + compute + overhead tile the step;
* on a GPU, ``gpu compute`` and ``gpu idle`` from the step's CUDA events, placed on the
  host's time line at the first traced step's compute start.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_fastdata._util import atomic_write_text
from lightning_fastdata.step_timer import COMPUTE, FETCH, IDLE, OVERHEAD, STEP, TRANSFER, Stage

#: Lanes (``tid``) in display order; fetch, transfer, compute, overhead and idle share the row columns' numbers.
#: ``AUGMENT_AHEAD``: the loader thread's augmentation, in a lane of its own: it runs while the main
#: thread's spans do, and no two spans of a lane overlap.
AUGMENT, GPU_COMPUTE, AUGMENT_AHEAD = 10, 11, 12
LANES = ((STEP, "step"), (FETCH, "fetch"), (TRANSFER, "transfer"), (AUGMENT, "augment"),
         (AUGMENT_AHEAD, "augment (loader thread)"), (COMPUTE, "compute"), (OVERHEAD, "overhead"),
         (GPU_COMPUTE, "gpu compute"), (IDLE, "gpu idle"))
_NAMES = dict(LANES)


@dataclass
class TracedStep:
    """What is known of one traced step when it ends; its row is complete once its CUDA events are read."""

    index: int
    row: Sequence[float]
    start: float  # the step call's start (host clock)
    end: float
    spans: list[tuple[int, float, float]]  # (lane, t0, t1) of fetch, transfer, augment (both lanes)
    events: tuple[Any, Any] | None = None  # (start, end) CUDA events on a GPU
    gpu: list[tuple[int, float, float]] = field(default_factory=list)


class StepTrace:
    """Collects the spans of training steps ``first`` to ``first + count - 1`` (0-based, over the fit).

    Args:
        path: Where the trace is written (rank r > 0 writes ``<stem>.rank<r><suffix>`` beside it).
        first: The first traced training step.
        count: How many steps are traced.
    """

    def __init__(self, path: str | os.PathLike, first: int, count: int) -> None:
        self.path, self.first, self.count = Path(path), first, count
        self.seen = 0  # training steps ended so far
        self.steps: list[TracedStep] = []
        self._open: list[tuple[int, float, float]] = []
        self.written: Path | None = None
        self._written_steps = 0
        self._written_range: tuple[int, int] = (0, 0)

    def span(self, lane: int, t0: float, t1: float) -> None:
        """A span of the step running now (fetch, transfer, augment), or one the loader's thread ended during it."""
        self._open.append((lane, t0, t1))

    def step(self, stage: Stage, row: Sequence[float], start: float, now: float, start_event: Any) -> None:
        """A step ended: keep it when it is a training step inside the window."""
        spans, self._open = self._open, []
        if stage.name != "train":
            return
        index = self.seen
        self.seen += 1
        if not self.first <= index < self.first + self.count:
            return
        prev_end = now - row[STEP]
        # The main thread's spans tile the step: one that started before it (a fetch at the end of
        # a validation run) is not its own. The loader thread (augment_ahead) augments later
        # batches while steps run: a span of it that ended in this step is kept whole, where it
        # ran (dropping those that began in an earlier step dropped nearly all of them).
        kept = [s for s in spans if s[1] >= prev_end or s[0] == AUGMENT_AHEAD]
        events = (start_event, stage.prev_event) if start_event is not None else None
        self.steps.append(TracedStep(index, row, start, now, kept, events))

    @property
    def complete(self) -> bool:
        """Whether every step of the window has ended."""
        return self.seen >= self.first + self.count

    def rank_path(self, rank: int) -> Path:
        """The file this rank writes."""
        return self.path if rank == 0 else self.path.with_name(f"{self.path.stem}.rank{rank}{self.path.suffix}")

    def write(self, rank: int) -> Path | None:
        """Write the steps traced so far (their CUDA events must have completed); None when there are none new."""
        if not self.steps or len(self.steps) == self._written_steps:
            return None
        _place_gpu(self.steps)
        trace = chrome_trace(self.steps, rank)
        self.written = atomic_write_text(self.rank_path(rank), json.dumps(trace))
        self._written_steps = len(self.steps)
        self._written_range = (self.steps[0].index, self.steps[-1].index)
        return self.written

    def summary(self) -> dict[str, Any] | None:
        """``path``, ``first_step``, ``last_step`` of the written trace, for the report; None before one is written."""
        if self.written is None:
            return None
        first, last = self._written_range
        return {"path": str(self.written), "first_step": first, "last_step": last}


def check_path(trace: str | os.PathLike) -> str:
    """``trace`` with ``~`` expanded, or a ValueError naming it when no trace could ever be written there.

    Checked when the profiler is built: the first write, at the first epoch end, would
    otherwise fail with an unclear OS error, or write where nobody looks.
    """
    raw = os.fspath(trace)
    path = os.path.expanduser(raw)
    if not path:
        raise ValueError("trace must be a file path, got '' (an empty path): name a file such as 'trace.json', or "
                         "pass trace=None for no trace")
    if path.endswith((os.sep, os.altsep or os.sep)):
        raise ValueError(f"trace must be a file path, got {raw!r}, which ends in a separator (a directory): name a "
                         f"file in it, e.g. {os.path.join(raw, 'trace.json')!r}")
    if os.path.isdir(path):
        raise ValueError(f"trace must be a file path, got {raw!r}, an existing directory: name a file in it, e.g. "
                         f"{os.path.join(raw, 'trace.json')!r}")
    # The missing folders are created at the first write: the nearest one that exists must take them.
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(f"trace={raw!r} cannot be written: {ancestor} is a file, not a directory; choose a path "
                         "under a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"trace={raw!r} cannot be written: this process may not write in the directory "
                         f"{ancestor}; choose a writable location")
    return path


def _place_gpu(steps: list[TracedStep]) -> None:
    """Device spans on the host time line: device times relative to the first traced start event."""
    ref = next((s for s in steps if s.events is not None), None)
    if ref is None:
        return
    anchor, ref_event = ref.start, ref.events[0]  # type: ignore[index]
    for s in steps:
        if s.events is None:
            continue
        start_ev, end_ev = s.events
        t0 = anchor + ref_event.elapsed_time(start_ev) / 1e3
        t1 = anchor + ref_event.elapsed_time(end_ev) / 1e3
        s.gpu = [(GPU_COMPUTE, t0, t1)]
        idle = s.row[IDLE]
        if idle == idle and idle > 0:  # not NaN
            s.gpu.append((IDLE, t0 - idle, t0))


def host_spans(s: TracedStep) -> list[tuple[int, float, float]]:
    """The host lanes of one step: step, fetch/transfer/augment (both lanes), compute, and overhead filling the gaps.

    Compute is the step call less the fetches and transfers inside it (a ``dataloader_iter``
    step fetches in the middle of its call): several pieces then, none overlapping a wait.
    """
    prev_end = s.end - s.row[STEP]
    waits = [(t0, t1) for lane, t0, t1 in s.spans if lane in (FETCH, TRANSFER)]
    compute = _less(s.start, s.end, waits)
    # Overhead: what fetch, transfer and compute (the step call) leave of the step.
    overhead = _less(prev_end, s.end, [*waits, (s.start, s.end)])
    return [(STEP, prev_end, s.end), *s.spans, *((COMPUTE, t0, t1) for t0, t1 in compute),
            *((OVERHEAD, t0, t1) for t0, t1 in overhead)]


def _less(t0: float, t1: float, holes: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The interval ``[t0, t1]`` less ``holes``: the pieces left, in time order."""
    pieces, at = [], t0
    for h0, h1 in sorted(holes):
        if at >= t1:
            break
        if h0 > at:
            pieces.append((at, min(h0, t1)))
        at = max(at, h1)
    if t1 > at:
        pieces.append((at, t1))
    return pieces


def chrome_trace(steps: Sequence[TracedStep], rank: int) -> dict[str, Any]:
    """The Chrome trace of ``steps`` as a JSON-able dict: metadata events, then spans sorted by time."""
    meta: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                                   "args": {"name": f"rank {rank}"}}]
    for order, (lane, name) in enumerate(LANES):
        meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": lane, "args": {"name": name}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": lane,
                     "args": {"sort_index": order}})
    order_of = {lane: i for i, (lane, _) in enumerate(LANES)}
    spans = []
    for s in steps:
        for lane, t0, t1 in [*host_spans(s), *s.gpu]:
            spans.append((t0, order_of[lane], lane, t1, s.index))
    spans.sort()
    events = [{"name": _NAMES[lane] if lane != STEP else f"step {index}", "cat": "fastdata", "ph": "X",
               "ts": 1e6 * t0, "dur": 1e6 * (t1 - t0), "pid": rank, "tid": lane, "args": {"step": index}}
              for t0, _, lane, t1, index in spans]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"producer": "lightning_fastdata", "rank": rank,
                          "steps": [steps[0].index, steps[-1].index] if steps else []}}
