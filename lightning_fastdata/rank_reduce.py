"""The profiler's DDP reduction: the slowest rank's figures, one collective per logging interval or epoch.

Never per step: the step timer records rows locally, and these functions reduce them when
they are logged. Whole rows are reduced, never columns one by one: per step, the row of the
rank that waited longest for its data (then the longest step) is kept, so a step's parts
still add up to its time. A column-wise max would mix ranks: with each rank's loader
stalling in turn, one rank's long wait and the other's long compute (the all-reduce
waiting for the stalled rank) would be reported as one step well over 100%. Without a
process group they return the local figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_fastdata import distributed as D
from lightning_fastdata.step_timer import COMPUTE, IDLE, OVERHEAD, SAMPLES, STEP, WAIT


def slowest_rows(per_rank: Sequence[Sequence[Sequence[float]]]) -> list[list[float]]:
    """Per step, the whole row of the rank with the largest data wait (ties: the largest step time, then the
    lowest rank), over the steps every rank ran. Pure: ``per_rank`` holds each rank's rows, in rank order.

    Ranks run equal step counts under DistributedSampler semantics; the common ones are kept.
    Columns are copied as they are, the sample count included.
    """
    k = min((len(rows) for rows in per_rank), default=0)
    out = []
    for i in range(k):
        # max() keeps the first of equal keys: the lowest rank.
        row = max((rows[i] for rows in per_rank), key=lambda r: (_num(r[WAIT]), _num(r[STEP])))
        out.append(list(row))
    return out


def _num(v: float) -> float:
    return 0.0 if math.isnan(v) else float(v)


def _gathered(rows: Sequence[Sequence[float]]) -> list[list[float]]:
    """Every rank's rows in one collective (``rows`` itself, copied, without a process group)."""
    if not (D.world_size() > 1 and D.is_initialized()):
        return [list(r) for r in rows]
    return slowest_rows(D.all_gather_object([list(r) for r in rows]))


def interval_means(rows: Sequence[Sequence[float]]) -> tuple[float, float, float, float, float, float]:
    """``(count, step, wait, compute, overhead, idle)``: the per-step means since the last log, of the slowest
    rank's row per step (see :func:`slowest_rows`). NaN (idle on a CPU) counts as 0. One collective.
    """
    rows = _gathered(rows)
    if not rows:
        return 0, 0.0, 0.0, 0.0, 0.0, 0.0
    # Plain sums over the transposed rows: a few dozen rows, where numpy's call overhead would dominate.
    columns = list(zip(*rows, strict=True))
    means = [sum(_num(v) for v in columns[c]) / len(rows) for c in (STEP, WAIT, COMPUTE, OVERHEAD, IDLE)]
    step, wait, compute, overhead, idle = means
    return len(rows), step, wait, compute, overhead, idle


def epoch_rows(rows: list[Sequence[float]], cuda: bool) -> list[Sequence[float]]:
    """An epoch's rows, the slowest rank's row per step (see :func:`slowest_rows`; one collective).

    The sample count stays this rank's; idle stays NaN on a CPU run.
    """
    if not (D.world_size() > 1 and D.is_initialized()):
        return rows
    out = _gathered(rows)
    for r, own in zip(out, rows, strict=False):
        r[SAMPLES] = own[SAMPLES]
        r[IDLE] = _num(r[IDLE]) if cuda else math.nan
    return out
