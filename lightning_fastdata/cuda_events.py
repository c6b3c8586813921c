"""The CUDA event resolver: a GPU step's compute is read from its events once they have completed.

The step timer records one event before and one after each step; this module reads them a
few steps later (``Event.query``), never synchronising a step: the stream runs in order,
so only at epoch end, or when more than ``max_pending`` steps are unread, does it wait,
once, for the newest.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_fastdata.step_timer import COMPUTE, IDLE, OVERHEAD, STEP, WAIT, Stage


def record() -> Any:
    """A timing CUDA event recorded now on the current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class EventResolver:
    """Fills in GPU rows from their CUDA events.

    Args:
        max_pending: Steps whose events may stay unread before the oldest is waited for.
    """

    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending

    def end_on_device(self, stage: Stage, row: list[float], start_event: Any) -> None:
        """Queue a GPU step's row: its compute is read from its CUDA events once they have completed."""
        end_event = record()
        stage.pending.append((row, start_event, end_event, stage.prev_event))
        stage.prev_event = end_event
        stage.rows.append(row)
        self.resolve(stage, block=False)

    def resolve(self, stage: Stage, block: bool) -> None:
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
