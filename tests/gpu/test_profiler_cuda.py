"""DataWaitProfiler on a GPU: CUDA-event compute read lazily, no per-step synchronize, idle gap.

Skipped without CUDA. The model's step launches ``torch.cuda._sleep`` (a kernel that spins
for a known number of cycles), so the host returns at once while the device is busy: only
device-side timing can see the compute.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _helpers import trainer as make_trainer  # noqa: E402
from _timing import Spend, loader  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from lightning_fastdata import DataWaitProfiler  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cycles_per_ms() -> float:
    torch.cuda._sleep(1_000_000)  # warm up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / start.elapsed_time(end)


class DeviceSleeper(L.LightningModule):
    """Each step keeps the GPU busy ``ms`` milliseconds; the host does not wait for it."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 2)
        self.cycles = int(ms * _cycles_per_ms())

    def training_step(self, batch, batch_idx):
        torch.cuda._sleep(self.cycles)
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, device_ms, fetch_s, batches=12, **kwargs):
    prof = DataWaitProfiler(print_report=False, **kwargs)
    logger = CSVLogger(str(tmp_path), name="gpu")
    trainer = make_trainer(tmp_path, accelerator="gpu", devices=1, callbacks=[prof], logger=logger,
                           log_every_n_steps=1)
    trainer.fit(DeviceSleeper(device_ms), loader(4 * batches, 4, Spend(fetch_s)))
    return prof, Path(logger.log_dir) / "metrics.csv"


def test_compute_is_device_time_of_asynchronous_work(tmp_path):
    prof, _ = _fit(tmp_path, device_ms=20.0, fetch_s=0.0)
    train = prof.report()["stages"]["train"]
    assert abs(train["compute_ms_p50"] - 20.0) <= 2.0, train
    assert "gpu_idle_frac" in train


def test_no_per_step_synchronize(tmp_path, monkeypatch):
    calls = []
    real_sync = torch.cuda.synchronize
    real_event_sync = torch.cuda.Event.synchronize

    def sync(*args, **kwargs):
        calls.append("device")
        return real_sync(*args, **kwargs)

    def event_sync(self):
        if not self.query():
            calls.append("event")  # only a blocking wait counts
        return real_event_sync(self)

    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", event_sync)
    prof, _ = _fit(tmp_path, device_ms=5.0, fetch_s=0.0, batches=24, max_pending=64)
    assert prof.report()["steps"] == 24
    assert len(calls) <= 3, calls  # at most the epoch-end drain, never one per step


def test_a_slow_loader_shows_as_device_idle_time(tmp_path):
    prof, metrics = _fit(tmp_path, device_ms=5.0, fetch_s=0.03)
    train = prof.report()["stages"]["train"]
    assert train["verdict"] == "data-bound"
    assert train["gpu_idle_frac"] > 0.6, train
    rows = [r for r in csv.DictReader(open(metrics)) if r.get("fastdata/gpu_idle_frac")]
    assert rows and all(float(r["fastdata/gpu_idle_frac"]) > 0.5 for r in rows[1:])


def test_a_busy_device_is_not_reported_as_data_wait(tmp_path):
    """Without data wait, a device-bound run must not be called data-bound, whatever the host blocks on."""
    prof, _ = _fit(tmp_path, device_ms=20.0, fetch_s=0.0)
    train = prof.report()["stages"]["train"]
    assert train["verdict"] == "compute-bound" and train["data_wait_frac"] < 0.2, train


def test_replay_measures_the_device_step(tmp_path):
    prof, _ = _fit(tmp_path, device_ms=20.0, fetch_s=0.03, batches=6, replay_steps=10)
    replay = prof.report()["replay"]
    assert abs(replay["step_ms"] - 20.0) <= 2.0, replay
    assert replay["slowdown"] > 1.2


class _BusyHost(L.Callback):
    """Framework overhead: the host is busy 5 ms before every training step; the device waits."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        Spend(0.005)()


def test_a_gpu_idled_by_host_work_is_host_bound_not_data_wait(tmp_path):
    prof = DataWaitProfiler(print_report=False)
    trainer = make_trainer(tmp_path, accelerator="gpu", devices=1, callbacks=[_BusyHost(), prof])
    trainer.fit(DeviceSleeper(1.0), loader(48, 4, Spend(0.0)))
    train = prof.report()["stages"]["train"]
    assert train["gpu_idle_frac"] > 0.5, train
    assert train["verdict"] == "host-bound", train
    assert train["advice"][0].startswith("host-bound: the GPU is idle") and "CUDA graphs" in train["advice"][0]


def test_trace_on_a_gpu_has_device_compute_and_idle_lanes(tmp_path):
    import json

    path = tmp_path / "trace.json"
    prof = DataWaitProfiler(print_report=False, trace=path, trace_steps=(2, 4))
    trainer = make_trainer(tmp_path, accelerator="gpu", devices=1, callbacks=[prof])
    trainer.fit(DeviceSleeper(5.0), loader(48, 4, Spend(0.01)))
    spans = [e for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"]
    gpu = [e for e in spans if e["name"] == "gpu compute"]
    idle = [e for e in spans if e["name"] == "gpu idle"]
    assert len(gpu) == 4 and all(abs(e["dur"] - 5000) < 1000 for e in gpu), gpu
    assert len(idle) == 4 and all(e["dur"] > 5000 for e in idle), idle  # the 10 ms fetch, at least half of it
    assert [e["ts"] for e in spans] == sorted(e["ts"] for e in spans)
    assert prof.report()["trace"]["path"] == str(path)
