"""``DataWaitProfiler``: how much of each training step is spent waiting for data.

Minimal form: wall-clock timestamps at Lightning's batch hooks. The wait of step k is
the time from the end of step k-1 to the start of step k (fetch, transfer, on-device
augmentation launch); its compute is the time from its start to its end.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback


class DataWaitProfiler(Callback):
    """Times data wait vs compute for every training step.

    Args:
        clock: Time source in seconds (tests inject a fake one).
    """

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self.clock = clock
        self.waits: list[float] = []
        self.computes: list[float] = []
        self.epoch_times: list[float] = []
        self.samples = 0
        self._last_end: float | None = None
        self._start: float | None = None
        self._epoch_start: float | None = None

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_start = self._last_end = self.clock()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        now = self.clock()
        if self._last_end is not None:
            self.waits.append(now - self._last_end)
        self._start = now

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        now = self.clock()
        if self._start is not None:
            self.computes.append(now - self._start)
        self._last_end = now
        self.samples += _batch_len(batch)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._epoch_start is not None:
            self.epoch_times.append(self.clock() - self._epoch_start)

    def report(self) -> dict[str, float]:
        """Totals and shares over all recorded steps."""
        wait, compute = sum(self.waits), sum(self.computes)
        total = wait + compute
        return {
            "steps": len(self.computes),
            "data_wait_s": wait,
            "compute_s": compute,
            "data_wait_frac": wait / total if total else 0.0,
            "data_wait_ms_p50": 1e3 * statistics.median(self.waits) if self.waits else 0.0,
            "epoch_time_s": self.epoch_times[-1] if self.epoch_times else 0.0,
            "samples": self.samples,
        }


def _batch_len(batch: Any) -> int:
    node = batch
    while isinstance(node, (tuple, list, dict)):
        node = next(iter(node.values())) if isinstance(node, dict) else node[0]
    return int(node.shape[0]) if hasattr(node, "shape") and len(node.shape) else 1
