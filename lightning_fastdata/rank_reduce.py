"""The profiler's DDP reduction: the slowest rank's figures, one collective per logging interval or epoch.

Never per step: the step timer records rows locally, and these functions reduce them when
they are logged. Without a process group they return the local figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_fastdata import distributed as D
from lightning_fastdata.step_timer import COMPUTE, IDLE, OVERHEAD, SAMPLES, STEP, WAIT


def interval_means(rows: Sequence[Sequence[float]]) -> tuple[float, float, float, float, float, float]:
    """``(count, step, wait, compute, overhead, idle)``: the per-step means since the last log, max over ranks.

    NaN (idle on a CPU) counts as 0. One collective.
    """
    # Plain sums over the transposed rows: a few dozen rows, where numpy's call overhead would dominate.
    columns = list(zip(*rows, strict=True)) if rows else []
    means = [sum(columns[c]) / len(rows) if rows else 0.0 for c in (STEP, WAIT, COMPUTE, OVERHEAD, IDLE)]
    means = [0.0 if math.isnan(v) else v for v in means]
    count, step, wait, compute, overhead, idle = D.all_reduce_max_list([len(rows), *means])
    return count, step, wait, compute, overhead, idle


def epoch_rows(rows: list[Sequence[float]], cuda: bool) -> list[Sequence[float]]:
    """An epoch's rows, column-wise max over ranks for the steps every rank ran (one collective each).

    Ranks run equal step counts under DistributedSampler semantics; the common ones are kept.
    The sample count stays this rank's; idle stays NaN on a CPU run.
    """
    if not (D.world_size() > 1 and D.is_initialized()):
        return rows
    k = D.all_reduce_min(len(rows))
    flat = D.all_reduce_max_list([0.0 if math.isnan(v) else v for r in rows[:k] for v in r[:SAMPLES]])
    out = [[*flat[i * SAMPLES:(i + 1) * SAMPLES], rows[i][SAMPLES]] for i in range(k)]
    if not cuda:
        for r in out:
            r[IDLE] = math.nan
    return out
