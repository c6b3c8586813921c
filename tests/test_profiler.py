"""DataWaitProfiler: exact figures on a fake clock, logging, verdict, replay, the fallback timing, the trace."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from _helpers import trainer as make_trainer
from _timing import (
    COMPUTE,
    FETCH,
    OVERHEAD,
    TRANSFER,
    FakeClock,
    Spend,
    SpendBeforeBatch,
    SpendingModel,
    loader,
)
from lightning.pytorch.loggers import CSVLogger

from lightning_fastdata import DataWaitProfiler
from lightning_fastdata import _lightning as door
from lightning_fastdata.plan import Plan, Resources
from lightning_fastdata.profiler import advise, format_report, summarize, verdict_of

GB = 10**9


def _fit_fake(tmp_path, fetch=FETCH, transfer=TRANSFER, compute=COMPUTE, overhead=OVERHEAD, epochs=2,
              val=True, stream=False, **trainer_kwargs):
    clock = FakeClock()
    prof = DataWaitProfiler(clock=clock, print_report=False)
    model = SpendingModel(Spend(compute, clock), Spend(transfer, clock), Spend(COMPUTE / 2, clock))
    val_loader = loader(8, 4, Spend(FETCH / 2, clock), stream) if val else None
    trainer_kwargs.setdefault("callbacks", [SpendBeforeBatch(Spend(overhead, clock)), prof])
    trainer = make_trainer(tmp_path, max_epochs=epochs, **trainer_kwargs)
    trainer.fit(model, loader(24, 4, Spend(fetch, clock), stream), val_loader)
    return prof, trainer, model


def test_fake_clock_gives_exact_figures(tmp_path):
    prof, _, _ = _fit_fake(tmp_path)
    rep = prof.report()
    train = rep["stages"]["train"]
    steps = 2 * 6
    assert rep["steps"] == train["steps"] == steps
    assert rep["samples"] == 2 * 24
    wait = FETCH + TRANSFER
    assert rep["data_wait_s"] == steps * wait
    assert rep["compute_s"] == steps * COMPUTE
    assert rep["overhead_s"] == steps * OVERHEAD
    assert rep["step_s"] == steps * (wait + COMPUTE + OVERHEAD)
    assert rep["data_wait_frac"] == wait / (wait + COMPUTE + OVERHEAD)
    assert train["fetch_ms_mean"] == pytest.approx(1e3 * FETCH, abs=1e-9)
    assert train["transfer_ms_mean"] == pytest.approx(1e3 * TRANSFER, abs=1e-9)
    for name, value in (("data_wait", wait), ("compute", COMPUTE), ("overhead", OVERHEAD)):
        for q in ("mean", "p50", "p95"):
            assert train[f"{name}_ms_{q}"] == pytest.approx(1e3 * value, abs=1e-9)
    assert rep["epoch_time_s"] == 6 * (wait + COMPUTE + OVERHEAD) + 2 * (FETCH / 2 + TRANSFER + COMPUTE / 2)
    assert "gpu_idle_frac" not in train  # CPU run


@pytest.mark.parametrize("reload", [0, 1])
def test_a_loader_without_a_length_has_its_first_batch_timed(tmp_path, reload):
    # Lightning fetches the first batch of such a loader while it sets the loader up, before
    # its loops bind the fetch hooks: epoch 0 and every validation run (every epoch when the
    # loaders are reloaded). Those waits count as the first step's.
    prof, _, _ = _fit_fake(tmp_path, stream=True, reload_dataloaders_every_n_epochs=reload)
    rep = prof.report()
    steps = 2 * 6
    # A reloaded training loader is iterated twice by Lightning at epoch 1 (when it is set up,
    # and again at the epoch loop's start): its first batch is fetched twice, a real wait.
    extra = FETCH if reload else 0.0
    assert rep["steps"] == steps and rep["samples"] == 2 * 24
    assert rep["data_wait_s"] == steps * (FETCH + TRANSFER) + extra
    assert rep["step_s"] == steps * (FETCH + TRANSFER + COMPUTE + OVERHEAD) + extra
    assert rep["overhead_s"] == steps * OVERHEAD
    val_run = 2 * (FETCH / 2 + TRANSFER + COMPUTE / 2)
    assert rep["epoch_time_s"] == 6 * (FETCH + TRANSFER + COMPUTE + OVERHEAD) + val_run + extra
    val = rep["stages"]["validate"]
    assert val["steps"] == 4 and val["data_wait_s"] == 4 * (FETCH / 2 + TRANSFER)
    assert [e["epoch_time_s"] for e in val["epochs"]] == [val_run] * 2


def test_validate_alone_times_the_first_batch_of_a_loader_without_a_length(tmp_path):
    clock = FakeClock()
    prof = DataWaitProfiler(clock=clock, print_report=False)
    model = SpendingModel(Spend(COMPUTE, clock), Spend(TRANSFER, clock), Spend(COMPUTE, clock))
    trainer = make_trainer(tmp_path, callbacks=[prof])
    trainer.validate(model, loader(12, 4, Spend(FETCH, clock), stream=True), verbose=False)
    val = prof.report()["stages"]["validate"]
    assert val["steps"] == 3 and val["data_wait_s"] == 3 * (FETCH + TRANSFER)
    from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    assert not door.is_wrapped(_PrefetchDataFetcher.__iter__)  # the class is restored


def test_validation_steps_are_timed_and_sanity_check_is_not(tmp_path):
    prof, _, _ = _fit_fake(tmp_path)  # default num_sanity_val_steps=2 runs but is excluded
    val = prof.report()["stages"]["validate"]
    assert val["steps"] == 2 * 2  # 8 samples / 4 per batch, 2 epochs
    assert val["data_wait_s"] == 4 * (FETCH / 2 + TRANSFER)
    assert val["compute_s"] == 4 * (COMPUTE / 2)
    assert val["overhead_s"] == 0.0
    assert len(val["epochs"]) == 2


def test_wrapped_calls_are_restored_after_fit(tmp_path):
    prof, trainer, model = _fit_fake(tmp_path, epochs=1)
    assert "batch_to_device" not in vars(trainer.strategy) and "validation_step" not in vars(trainer.strategy)
    for loop in (trainer.fit_loop.epoch_loop, trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop):
        assert "_on_before_fetch" not in vars(loop) and "_on_after_fetch" not in vars(loop)
    epoch_loop = trainer.fit_loop.epoch_loop
    assert "run" not in vars(epoch_loop.automatic_optimization) and "run" not in vars(epoch_loop.manual_optimization)


def test_manual_optimization_steps_are_timed(tmp_path):
    clock = FakeClock()

    class Manual(SpendingModel):
        def __init__(self, *args):
            super().__init__(*args)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            opt.step()

    prof = DataWaitProfiler(clock=clock, print_report=False)
    trainer = make_trainer(tmp_path, callbacks=[SpendBeforeBatch(Spend(OVERHEAD, clock)), prof])
    trainer.fit(Manual(Spend(COMPUTE, clock), Spend(TRANSFER, clock)), loader(16, 4, Spend(FETCH, clock)))
    train = prof.report()["stages"]["train"]
    assert train["steps"] == 4 and train["samples"] == 16
    assert train["compute_s"] == 4 * COMPUTE and train["data_wait_s"] == 4 * (FETCH + TRANSFER)
    assert train["overhead_s"] == 4 * OVERHEAD


def test_lightning_profilers_still_see_the_fetch(tmp_path):
    """The default no-op profiler's fetch hooks are skipped; a real one still records every fetch."""
    from lightning.pytorch.profilers import SimpleProfiler

    def fetches(callbacks):
        lightning_profiler = SimpleProfiler()
        trainer = make_trainer(tmp_path, callbacks=callbacks, profiler=lightning_profiler, num_sanity_val_steps=0)
        trainer.fit(SpendingModel(Spend(0.0)), loader(16, 4, Spend(0.0)), loader(8, 4, Spend(0.0)))
        recorded = lightning_profiler.recorded_durations
        return {k: len(v) for k, v in recorded.items() if k.endswith("_next")}

    prof = DataWaitProfiler(print_report=False)
    seen = fetches([prof])
    assert seen == fetches([]) and seen["[_TrainingEpochLoop].train_dataloader_next"] == 4
    assert seen["[_EvaluationLoop].val_next"] == 2
    assert prof.report()["steps"] == 4 and prof.report()["stages"]["validate"]["steps"] == 2


def test_fetch_inside_a_dataloader_iter_step_is_wait_not_compute(tmp_path):
    clock = FakeClock()

    class IterModel(SpendingModel):
        def training_step(self, dataloader_iter):
            batch, _, _ = next(dataloader_iter)
            self.step()
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

    prof = DataWaitProfiler(clock=clock, print_report=False)
    trainer = make_trainer(tmp_path, callbacks=[prof], limit_train_batches=4)
    trainer.fit(IterModel(Spend(COMPUTE, clock)), loader(32, 4, Spend(FETCH, clock)))
    train = prof.report()["stages"]["train"]
    assert train["steps"] >= 3
    assert train["compute_ms_p50"] == pytest.approx(1e3 * COMPUTE, abs=1e-9)
    assert train["data_wait_ms_p50"] == pytest.approx(1e3 * FETCH, abs=1e-9)


def test_replay_of_a_dataloader_iter_step_is_refused_with_a_warning(tmp_path):
    class IterModel(SpendingModel):
        def training_step(self, dataloader_iter):
            x, y = next(dataloader_iter)[0]
            return torch.nn.functional.cross_entropy(self.net(x), y)

    prof = DataWaitProfiler(replay_steps=3, print_report=False)
    trainer = make_trainer(tmp_path, callbacks=[prof])
    with pytest.warns(UserWarning, match="replay_steps=3 but no batch was captured: a training_step that takes a "
                                         "dataloader_iter cannot be replayed; set replay_steps=0"):
        trainer.fit(IterModel(Spend(0.0)), loader(16, 4, Spend(0.0)))
    assert prof.report()["replay"] is None and prof.report()["samples"] == 16


def test_verdict_flips_between_data_and_compute_bound(tmp_path):
    slow_data, _, _ = _fit_fake(tmp_path / "a", fetch=4 * COMPUTE, epochs=1, val=False)
    slow_model, _, _ = _fit_fake(tmp_path / "b", fetch=COMPUTE / 4, compute=8 * COMPUTE, epochs=1, val=False)
    a, b = slow_data.report(), slow_model.report()
    assert a["verdict"] == "data-bound"
    assert a["share"] == a["data_wait_frac"] == (4 * COMPUTE + TRANSFER) / (5 * COMPUTE + TRANSFER + OVERHEAD)
    assert b["verdict"] == "compute-bound"
    assert b["share"] == b["compute_frac"] == 8 * COMPUTE / (COMPUTE / 4 + TRANSFER + 8 * COMPUTE + OVERHEAD)
    # The plain main-process loader gets concrete advice only when data-bound.
    assert any("num_workers=0" in line for line in a["advice"])
    assert not any("num_workers" in line for line in b["advice"])
    assert any(line.startswith("compute-bound") for line in b["advice"])
    text = format_report(a)
    assert "verdict: data-bound" in text and "train:" in text


def test_per_step_figures_reach_a_csv_logger_exactly(tmp_path):
    logger = CSVLogger(str(tmp_path), name="csv")
    _fit_fake(tmp_path, epochs=1, logger=logger, log_every_n_steps=2)
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    steps = [r for r in rows if r.get("fastdata/data_wait_ms")]
    assert [int(r["step"]) for r in steps] == [1, 3, 5]  # log_every_n_steps=2, as Lightning's own logs
    for r in steps:
        assert float(r["fastdata/data_wait_ms"]) == pytest.approx(1e3 * (FETCH + TRANSFER))
        assert float(r["fastdata/compute_ms"]) == pytest.approx(1e3 * COMPUTE)
        assert float(r["fastdata/overhead_ms"]) == pytest.approx(1e3 * OVERHEAD)
        total = FETCH + TRANSFER + COMPUTE + OVERHEAD
        assert float(r["fastdata/data_wait_frac"]) == pytest.approx((FETCH + TRANSFER) / total)
    epoch = [r for r in rows if r.get("fastdata/epoch/data_wait_ms_p95")]
    assert len(epoch) == 1
    # At the epoch's last batch (step 5 of 0..5), where Lightning logs its own epoch metrics; at
    # step 6 they went where the next epoch's first step logs, and reached loggers out of order.
    assert int(epoch[0]["step"]) == 5
    assert float(epoch[0]["fastdata/epoch/compute_ms_p50"]) == pytest.approx(1e3 * COMPUTE)
    assert any(r.get("fastdata/val/epoch/data_wait_ms_mean") for r in rows)


def test_replay_reports_the_compute_only_step(tmp_path):
    clock = FakeClock()
    prof = DataWaitProfiler(clock=clock, print_report=False, replay_steps=6, replay_batches=2, replay_warmup=1)
    trainer = make_trainer(tmp_path, callbacks=[prof], num_sanity_val_steps=0)
    trainer.fit(SpendingModel(Spend(COMPUTE, clock)), loader(16, 4, Spend(FETCH, clock)))
    replay = prof.report()["replay"]
    assert replay["steps"] == 6 and replay["batches"] == 2
    assert replay["step_ms"] == 1e3 * COMPUTE
    # The real loader adds its fetch on top of the compute-only step.
    assert replay["real_step_ms"] == 1e3 * (FETCH + COMPUTE)
    assert replay["slowdown"] == (FETCH + COMPUTE) / COMPUTE
    assert any(line.startswith("replay:") for line in prof.report()["advice"])


def test_replay_leaves_the_trained_model_untouched(tmp_path):
    def train(replay_steps):
        torch.manual_seed(0)
        model = SpendingModel(Spend(0.0))
        prof = DataWaitProfiler(replay_steps=replay_steps, replay_warmup=1, print_report=False)
        make_trainer(tmp_path, callbacks=[prof]).fit(model, loader(16, 4, Spend(0.0)))
        return model, prof

    plain, _ = train(0)
    replayed, prof = train(5)
    assert prof.report()["replay"]["steps"] == 5
    for a, b in zip(plain.parameters(), replayed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert "log" not in vars(replayed)


# ---------------------------------------------------------------------- advice (pure)


def _summary(wait, compute, overhead, transfer=0.0):
    rows = [[wait + compute + overhead, wait, wait - transfer, transfer, compute, overhead, float("nan"), 1]]
    s = summarize(rows)
    s.update(verdict_of(s))
    return s


def _resources(device_type="cuda", total=80 * GB):
    return Resources(physical_cores=8, logical_cores=8, ram_total=256 * GB, ram_available=200 * GB,
                     device_type=device_type, device_total=total, device_free=total, shm_free=64 * GB)


def test_advice_moves_a_store_that_fits_onto_the_device():
    plan = Plan("workers", num_workers=7, store_nbytes=int(1.4 * GB), resources=_resources())
    advice = advise(_summary(0.063, 0.030, 0.007), {"plan": plan, "vram_fraction": 0.6, "cores": 8,
                                                    "device_type": "cuda",
                                                    "loader": {"num_workers": 7, "pin_memory": True}})
    assert advice[0] == "data wait is 63% of the step; the store (1.4 GB) fits 60% of this GPU's 80.0 GB: " \
                        "set strategy=device"
    assert any("workers are saturated: 7 workers + the main process on 8 cores" in a for a in advice)


def test_advice_keeps_a_store_too_large_for_the_device_on_the_host():
    plan = Plan("workers", num_workers=2, store_nbytes=60 * GB, resources=_resources())
    advice = advise(_summary(0.06, 0.03, 0.01), {"plan": plan, "cores": 8, "device_type": "cuda",
                                                 "loader": {"num_workers": 2, "pin_memory": False}})
    assert "stays on the host" in advice[0]
    assert any("raise num_workers to 7" in a for a in advice)
    assert any(a.startswith("set pin_memory=True") for a in advice)


def test_advice_for_a_plain_dataloader_with_saturated_workers():
    advice = advise(_summary(0.05, 0.02, 0.0), {"plan": None, "cores": 2, "device_type": "cpu",
                                                "loader": {"kind": "dataloader", "num_workers": 2}})
    assert any(a.startswith("workers are saturated: 2 of 2 cores") for a in advice)


def test_advice_for_data_on_the_device_points_at_augmentation():
    plan = Plan("device", store_nbytes=GB, resources=_resources())
    advice = advise(_summary(0.02, 0.01, 0.0, transfer=0.015), {"plan": plan, "cores": 8, "device_type": "cuda",
                                                                 "loader": {"kind": "device"}})
    # The data module's loader augments in its fetch: that share was quoted as the transfer's
    # (0.5 of 60 ms, a 50 ms Resize + CenterCrop read as costing 0.5 ms).
    assert advice[0] == ("data wait is 67% of the step, with the data already on the device: the wait is the batch "
                         "gather and on-device augmentation, 20.0 ms a step (5.0 in the loader's fetch, where the "
                         "data module gathers and augments, 15.0 in the transfer and batch hooks): use a lighter "
                         "train_augment, a larger batch, or augment_ahead=1 to prepare the next batch during the step")
    assert not any("num_workers" in a for a in advice)
    val = advise(_summary(0.02, 0.01, 0.0, transfer=0.015), {"plan": plan, "cores": 8, "device_type": "cuda",
                                                              "loader": {"kind": "device"}}, stage="validate")
    assert "use a lighter eval_augment" in val[0]  # validation's cost is eval_augment's
    # Never advised where it is on already, nor on a CPU run (the thread competes with the step
    # for the cores and the GIL): it was, on every data-bound run.
    for device_type, info in (("cuda", {"kind": "device", "ahead": 1}), ("cpu", {"kind": "device", "ahead": 0})):
        advice = advise(_summary(0.02, 0.01, 0.0, transfer=0.015), {"plan": plan, "cores": 8,
                                                                     "device_type": device_type, "loader": info})
        assert advice[0].endswith("use a lighter train_augment or a larger batch"), advice[0]


def test_advice_for_a_wait_in_the_transfer_does_not_blame_the_workers():
    """The wait is a batch hook after the transfer (40 ms), the fetch next to nothing: the report
    advised num_workers=1 (with none) and "workers are saturated" (with one), for a wait no worker
    can take. Worker advice now needs the fetch itself to be a real share of the step."""
    for nw in (0, 1):
        advice = advise(_summary(0.040, 0.008, 0.0, transfer=0.0395),
                        {"plan": None, "cores": 2, "device_type": "cpu",
                         "loader": {"kind": "dataloader", "num_workers": nw}})
        assert not any("num_workers" in a or "workers are" in a for a in advice), advice
        assert any(a.startswith("transfer and on-device augmentation take 39.5 of the 40.0 ms") for a in advice)
    fetching = advise(_summary(0.040, 0.008, 0.0, transfer=0.001),
                      {"plan": None, "cores": 2, "loader": {"kind": "dataloader", "num_workers": 0}})
    assert any("(fetching batches 81%); batches are loaded in the main process (num_workers=0)" in a
               for a in fetching)


def test_compute_bound_with_a_real_data_wait_does_not_say_the_pipeline_keeps_up():
    """Compute 52%, data wait 47%: the verdict is compute-bound, and the advice said "the input
    pipeline keeps up" a line after telling the user to add workers."""
    s = _summary(0.025, 0.027, 0.0)
    assert s["verdict"] == "compute-bound"
    advice = advise(s, {"plan": None, "cores": 2, "loader": {"kind": "dataloader", "num_workers": 0}})
    assert any("num_workers=0" in a for a in advice)
    line = next(a for a in advice if a.startswith("compute-bound"))
    assert "keeps up" not in line and line.endswith("then from the data advice above")
    small = next(a for a in advise(_summary(0.001, 0.05, 0.0), {"cores": 2}) if a.startswith("compute-bound"))
    assert "the input pipeline keeps up" in small


def test_advice_flags_framework_overhead():
    advice = advise(_summary(0.0, 0.01, 0.01), {"cores": 2})
    assert any(a.startswith("framework overhead is 50%") for a in advice)
    # Non-persistent workers restart at each epoch's start, which lands in overhead: the fix is
    # theirs, not log_every_n_steps (a reviewer measured 45% overhead from 2 restarting workers).
    restarting = advise(_summary(0.0, 0.01, 0.01), {"cores": 2, "loader": {
        "kind": "dataloader", "num_workers": 2, "persistent_workers": False}})
    assert any("2 workers restart at every epoch (persistent_workers=False)" in a
               and "set persistent_workers=True" in a for a in restarting)


@pytest.mark.parametrize("kwargs, match", [
    (dict(replay_steps=-1), "replay_steps"),
    (dict(replay_batches=0), "replay_batches"),
    (dict(max_pending=True), "max_pending"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataWaitProfiler(**kwargs)


def test_clock_must_be_callable():
    with pytest.raises(TypeError, match="clock"):
        DataWaitProfiler(clock=1.0)


class _SimulatedEvent:
    """A CUDA event stand-in on the fake clock: it completes once ``lag`` newer events were recorded.

    One stream: waiting for an event completes it and every event recorded before it.
    """

    clock: FakeClock
    recorded: list[_SimulatedEvent] = []
    blocking_waits = 0
    done_through = -1  # index in ``recorded`` of the newest event waited for
    lag = 2

    def __init__(self, enable_timing: bool = False) -> None:
        self.t: float | None = None

    def record(self) -> None:
        self.t = self.clock()
        self.recorded.append(self)

    def query(self) -> bool:
        i = self.recorded.index(self)
        return i <= self.done_through or len(self.recorded) - i > self.lag

    def synchronize(self) -> None:
        if not self.query():
            type(self).blocking_waits += 1
        type(self).done_through = max(self.done_through, self.recorded.index(self))

    def elapsed_time(self, end: _SimulatedEvent) -> float:
        return 1e3 * (end.t - self.t)


def _simulate_cuda(monkeypatch, clock: FakeClock, lag: int) -> None:
    """``torch.cuda.Event`` becomes :class:`_SimulatedEvent` on ``clock``, on a fresh stream."""
    _SimulatedEvent.clock, _SimulatedEvent.recorded, _SimulatedEvent.blocking_waits = clock, [], 0
    _SimulatedEvent.done_through, _SimulatedEvent.lag = -1, lag
    monkeypatch.setattr(torch.cuda, "Event", _SimulatedEvent)


class _OnDevice(DataWaitProfiler):
    """The profiler taking its GPU code path on a CPU Trainer (with :func:`_simulate_cuda`)."""

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        self._hot.cuda = True


def test_cuda_event_path_on_a_simulated_device(tmp_path, monkeypatch):
    """The GPU code path (lazy event reads, idle gap, gpu_idle_frac) with events on the fake clock."""
    clock = FakeClock()
    _simulate_cuda(monkeypatch, clock, lag=2)

    class OnDevice(_OnDevice):
        resolved_at_end: list[int] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            self.resolved_at_end.append(self._train.resolved)

    prof = OnDevice(clock=clock, print_report=False)
    logger = CSVLogger(str(tmp_path), name="sim")
    trainer = make_trainer(tmp_path, callbacks=[SpendBeforeBatch(Spend(OVERHEAD, clock)), prof], logger=logger,
                           log_every_n_steps=3)
    trainer.fit(SpendingModel(Spend(COMPUTE, clock), Spend(TRANSFER, clock)), loader(32, 4, Spend(FETCH, clock)))
    # Reads lag the steps (no per-step wait): after step k only the events of step k-1 are complete.
    assert prof.resolved_at_end == [0, 1, 2, 3, 4, 5, 6, 7]
    assert _SimulatedEvent.blocking_waits == 1  # one wait at epoch end, for the newest pending step
    train = prof.report()["stages"]["train"]
    wait = FETCH + TRANSFER
    assert train["compute_s"] == 8 * COMPUTE and train["data_wait_s"] == 8 * wait
    assert train["overhead_s"] == 8 * OVERHEAD
    idle = 7 * (wait + OVERHEAD)  # the first step of the epoch has no previous end
    assert train["gpu_idle_frac"] == pytest.approx(idle / (idle + 8 * COMPUTE))
    rows = [r for r in csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")) if r.get("fastdata/gpu_idle_frac")]
    assert len(rows) == 2  # steps 3 and 6 of 8, from the steps resolved by then
    assert float(rows[1]["fastdata/gpu_idle_frac"]) == pytest.approx((wait + OVERHEAD) / (wait + OVERHEAD + COMPUTE))


def test_a_device_far_behind_is_drained_with_one_wait(tmp_path, monkeypatch):
    """Three steps still running at epoch end: one wait for the newest, then the rest read without blocking."""
    clock = FakeClock()
    _simulate_cuda(monkeypatch, clock, lag=6)  # an event completes 3 steps later

    class OnDevice(_OnDevice):
        def on_train_epoch_end(self, trainer, pl_module):
            self.pending_at_end = len(self._train.pending)
            super().on_train_epoch_end(trainer, pl_module)

    prof = OnDevice(clock=clock, print_report=False)
    trainer = make_trainer(tmp_path, callbacks=[prof])
    trainer.fit(SpendingModel(Spend(COMPUTE, clock)), loader(32, 4, Spend(FETCH, clock)))
    assert prof.pending_at_end == 3
    assert _SimulatedEvent.blocking_waits == 1
    assert prof.report()["stages"]["train"]["compute_s"] == 8 * COMPUTE


def test_validate_alone_is_timed(tmp_path):
    clock = FakeClock()
    prof = DataWaitProfiler(clock=clock, print_report=False)
    model = SpendingModel(Spend(COMPUTE, clock), Spend(TRANSFER, clock), Spend(COMPUTE, clock))
    trainer = make_trainer(tmp_path, callbacks=[prof])
    trainer.validate(model, loader(12, 4, Spend(FETCH, clock)), verbose=False)
    val = prof.report()["stages"]["validate"]
    assert val["steps"] == 3 and prof.report()["steps"] == 0
    assert val["data_wait_s"] == 3 * (FETCH + TRANSFER) and val["compute_s"] == 3 * COMPUTE
    assert "batch_to_device" not in vars(trainer.strategy)


def test_a_second_profiler_stays_idle_with_a_warning(tmp_path):
    first, second = DataWaitProfiler(print_report=False), DataWaitProfiler(print_report=False)
    trainer = make_trainer(tmp_path, callbacks=[first, second])
    with pytest.warns(UserWarning, match="another DataWaitProfiler/FastDataCallback already times this Trainer"):
        trainer.fit(SpendingModel(Spend(0.0)), loader(16, 4, Spend(0.0)))
    assert first.report()["steps"] == 4 and second.report()["steps"] == 0
    assert "batch_to_device" not in vars(trainer.strategy)
    assert "_on_before_fetch" not in vars(trainer.fit_loop.epoch_loop)


class _HookCounter(L.Callback):
    """Counts the per-step hooks Lightning dispatches to the callbacks after it in the list."""

    def __init__(self, watched) -> None:
        self.watched = watched
        self.calls: dict[str, int] = {}

    def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
        for cb in self.watched:
            for name in ("on_before_backward", "on_after_backward", "on_before_optimizer_step",
                         "on_before_zero_grad"):
                self.calls[name] = self.calls.get(name, 0) + callable(getattr(cb, name))


def test_unused_per_step_hooks_are_not_dispatched_but_overrides_are(tmp_path):
    class Overrides(DataWaitProfiler):
        def __init__(self) -> None:
            super().__init__(print_report=False)
            self.zero_grads = 0

        def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
            self.zero_grads += 1

    plain, custom = DataWaitProfiler(print_report=False), Overrides()
    # Lightning skips a hook attribute that is not callable: no per-step hook reaches the profiler,
    # which times steps inside the loop's own calls.
    for name in ("on_train_batch_start", "on_train_batch_end", "on_validation_batch_start",
                 "on_validation_batch_end", "on_after_backward", "on_before_zero_grad"):
        assert getattr(plain, name) is None, name
    assert callable(custom.on_before_zero_grad) and custom.on_after_backward is None
    counter = _HookCounter([plain])
    make_trainer(tmp_path, callbacks=[counter, plain]).fit(SpendingModel(Spend(0.0)), loader(16, 4, Spend(0.0)))
    assert counter.calls == dict.fromkeys(counter.calls, 0) and counter.calls  # looked at, never callable
    assert plain.report()["steps"] == 4  # the timing hooks still run
    make_trainer(tmp_path, callbacks=[custom]).fit(SpendingModel(Spend(0.0)), loader(16, 4, Spend(0.0)))
    assert custom.zero_grads == 4 and custom.report()["steps"] == 4


@pytest.mark.parametrize("signature", ["batch", "batch_idx", "dataloader_idx"])
def test_every_validation_step_signature_is_timed_and_gets_its_arguments(tmp_path, signature):
    """Lightning passes validation_step only the arguments it declares; the timed step passes them on."""
    clock = FakeClock()
    seen: list[tuple] = []

    class Model(SpendingModel):
        if signature == "batch":
            def validation_step(self, batch):
                seen.append((len(batch[0]),))
                self.val_step()
        elif signature == "batch_idx":
            def validation_step(self, batch, batch_idx):
                seen.append((len(batch[0]), batch_idx))
                self.val_step()
        else:
            def validation_step(self, batch, batch_idx, dataloader_idx=0):
                seen.append((len(batch[0]), batch_idx, dataloader_idx))
                self.val_step()

    prof = DataWaitProfiler(clock=clock, print_report=False)
    model = Model(Spend(COMPUTE, clock), None, Spend(COMPUTE / 2, clock))
    loaders = [loader(8, 4, Spend(FETCH, clock))]
    if signature == "dataloader_idx":
        loaders.append(loader(4, 2, Spend(FETCH, clock)))
    trainer = make_trainer(tmp_path, max_epochs=1, callbacks=[prof], num_sanity_val_steps=0)
    trainer.validate(model, loaders, verbose=False)
    expected = {"batch": [(4,), (4,)], "batch_idx": [(4, 0), (4, 1)],
                "dataloader_idx": [(4, 0, 0), (4, 1, 0), (2, 0, 1), (2, 1, 1)]}[signature]
    assert seen == expected
    val = prof.report()["stages"]["validate"]
    assert val["steps"] == len(expected) and val["samples"] == sum(s[0] for s in expected)
    assert val["compute_s"] == len(expected) * COMPUTE / 2 and val["data_wait_s"] == len(expected) * FETCH


# ---------------------------------------------------------------------- fallback: public batch hooks


def _close_the_door(monkeypatch) -> None:
    """Lightning's loop internals 'moved': the door reports closed, as on an unknown version."""
    def closed(trainer):
        raise door.DoorClosed("_TrainingEpochLoop", "_on_before_fetch", "fetch start hook")

    monkeypatch.setattr(door, "timing_sites", closed)


def test_a_closed_door_falls_back_to_public_batch_hooks_with_one_warning(tmp_path, monkeypatch):
    _close_the_door(monkeypatch)
    clock = FakeClock()
    prof = DataWaitProfiler(clock=clock, print_report=False)
    model = SpendingModel(Spend(COMPUTE, clock), Spend(TRANSFER, clock), Spend(COMPUTE / 2, clock))
    trainer = make_trainer(tmp_path, max_epochs=2, callbacks=[prof])
    with pytest.warns(UserWarning, match=r"_on_before_fetch \(fetch start hook\) is missing in lightning .* "
                                         r"Timing each step with the public batch hooks instead") as caught:
        trainer.fit(model, loader(24, 4, Spend(FETCH, clock)), loader(8, 4, Spend(FETCH / 2, clock)))
    assert sum("public batch hooks" in str(w.message) for w in caught) == 1
    rep = prof.report()
    assert rep["timing"] == "hooks" and rep["steps"] == 12 and rep["samples"] == 48
    # Compute: batch start to batch end; wait: the previous batch's end to this one's start.
    assert rep["compute_s"] == 12 * COMPUTE and rep["overhead_s"] == 0.0
    assert rep["data_wait_s"] == 12 * (FETCH + TRANSFER)
    val = rep["stages"]["validate"]
    assert val["steps"] == 4 and val["compute_s"] == 4 * COMPUTE / 2
    assert "public batch hooks" in format_report(rep)
    # Nothing was wrapped, and the batch hooks are hidden from Lightning again.
    assert "batch_to_device" not in vars(trainer.strategy)
    assert prof.on_train_batch_start is None and prof.on_validation_batch_end is None


def test_the_fallback_logs_at_lightnings_steps(tmp_path, monkeypatch):
    _close_the_door(monkeypatch)
    logger = CSVLogger(str(tmp_path), name="csv")
    with pytest.warns(UserWarning, match="public batch hooks"):
        _fit_fake(tmp_path, epochs=1, logger=logger, log_every_n_steps=2)
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    assert [int(r["step"]) for r in rows if r.get("fastdata/data_wait_ms")] == [1, 3, 5]


# ---------------------------------------------------------------------- host-bound (pure)


def _gpu_summary(wait, compute, overhead, idle, context, transfer=0.0):
    rows = [[wait + compute + overhead, wait, wait - transfer, transfer, compute, overhead, idle, 1]]
    s = summarize(rows)
    s.update(verdict_of(s, context))
    return s


def _on_device():
    plan = Plan("device", store_nbytes=GB, resources=_resources())
    return {"plan": plan, "cores": 8, "device_type": "cuda", "loader": {"kind": "device"}}


def test_data_on_the_device_with_an_idle_gpu_is_host_bound_not_data_wait():
    ctx = _on_device()
    # The host launches the gather and augmentation (wait > compute): once "data-bound", now host-bound.
    s = _gpu_summary(wait=0.008, compute=0.006, overhead=0.002, idle=0.004, context=ctx, transfer=0.006)
    assert s["verdict"] == "host-bound" and s["share"] == pytest.approx((0.008 + 0.002) / 0.016)
    advice = advise(s, ctx)
    assert advice[0] == ("host-bound: the GPU is idle 40% of the time while the host launches work (the batch "
                         "gather and on-device augmentation take 8.0 ms a step (50%); framework overhead and the "
                         "model's own launches 12%): fewer, larger launches help: a larger batch, CUDA graphs, "
                         "torch.compile")
    assert not any("data wait is" in a or "data-bound" in a for a in advice)
    assert "verdict: host-bound (62%)" in format_report({"stages": {"train": {**s, "advice": advice}}})


def test_framework_overhead_that_idles_the_gpu_is_host_bound():
    ctx = {"plan": None, "cores": 8, "device_type": "cuda",
           "loader": {"kind": "dataloader", "num_workers": 4, "pin_memory": True}}
    s = _gpu_summary(wait=0.001, compute=0.004, overhead=0.005, idle=0.006, context=ctx)
    assert s["verdict"] == "host-bound" and s["share"] == pytest.approx(0.5)
    assert advise(s, ctx)[0].startswith("host-bound: the GPU is idle 60% of the time while the host launches "
                                        "work (framework overhead and the model's own launches 50%)")


@pytest.mark.parametrize("wait, compute, overhead, idle, kind, verdict", [
    (0.020, 0.005, 0.001, 0.020, "dataloader", "data-bound"),  # a real loader wait off the device
    (0.004, 0.020, 0.001, 0.001, "device", "compute-bound"),  # the GPU is busy: not host-bound
    (0.008, 0.006, 0.002, float("nan"), "device", "data-bound"),  # a CPU run: idle unknown, rule unchanged
])
def test_host_bound_needs_an_idle_gpu_explained_by_the_host(wait, compute, overhead, idle, kind, verdict):
    ctx = {"plan": None, "cores": 8, "device_type": "cuda", "loader": {"kind": kind}}
    assert _gpu_summary(wait, compute, overhead, idle, ctx)["verdict"] == verdict


# ---------------------------------------------------------------------- Chrome trace


class _NoModelHook(SpendingModel):
    """Leaves on_after_batch_transfer to the datamodule (Lightning runs only one of the two)."""

    on_after_batch_transfer = L.LightningModule.on_after_batch_transfer


class _AugmentingData(L.LightningDataModule):
    """A datamodule whose on_after_batch_transfer (the augmentation) spends a known time."""

    def __init__(self, fetch: Spend, augment: Spend) -> None:
        super().__init__()
        self.fetch, self.augment = fetch, augment

    def train_dataloader(self):
        return loader(24, 4, self.fetch)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.augment()
        return batch


AUGMENT = 2.0 ** -11


def _spans(trace):
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    by_step: dict[int, dict[str, list]] = {}
    for e in events:
        by_step.setdefault(e["args"]["step"], {}).setdefault(e["name"].split(" ")[0], []).append(e)
    return events, by_step


def test_trace_spans_tile_each_step_on_the_fake_clock(tmp_path):
    clock = FakeClock()
    path = tmp_path / "trace.json"
    prof = DataWaitProfiler(clock=clock, print_report=False, trace=path, trace_steps=(2, 5))
    dm = _AugmentingData(Spend(FETCH, clock), Spend(AUGMENT, clock))
    trainer = make_trainer(tmp_path, max_epochs=2, callbacks=[SpendBeforeBatch(Spend(OVERHEAD, clock)), prof])
    trainer.fit(_NoModelHook(Spend(COMPUTE, clock)), datamodule=dm)
    assert "on_after_batch_transfer" not in vars(dm)  # the timing wrapper is gone
    trace = json.load(open(path))
    events, by_step = _spans(trace)
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)
    assert sorted(by_step) == [2, 3, 4, 5, 6]  # across the epoch boundary (6 steps per epoch)
    us = 1e6
    for spans in by_step.values():
        (step,), (fetch,), (transfer,), (augment,), (compute,) = (spans[k] for k in ("step", "fetch", "transfer",
                                                                                       "augment", "compute"))
        assert (fetch["dur"], transfer["dur"], augment["dur"], compute["dur"]) == (FETCH * us, AUGMENT * us,
                                                                                  AUGMENT * us, COMPUTE * us)
        assert [o["dur"] for o in spans["overhead"]] == [OVERHEAD * us]  # the batch-start callback
        assert step["ts"] <= fetch["ts"] < transfer["ts"] <= augment["ts"] < compute["ts"]
        assert augment["ts"] + augment["dur"] <= transfer["ts"] + transfer["dur"]  # augment runs inside transfer
        parts = fetch["dur"] + transfer["dur"] + compute["dur"] + sum(o["dur"] for o in spans["overhead"])
        assert parts == pytest.approx(step["dur"], abs=1e-6)
    lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"step", "fetch", "transfer", "augment", "compute", "overhead"} <= set(lanes.values())
    assert {e["pid"] for e in trace["traceEvents"]} == {0}
    rep = prof.report()
    assert rep["trace"] == {"path": str(path), "first_step": 2, "last_step": 6}
    assert f"trace: {path} (training steps 2 to 6" in format_report(rep)


class _SpendingAugment:
    """An augmentation that spends a known time and changes nothing."""

    def __init__(self, spend: Spend) -> None:
        self.spend = spend

    def __call__(self, batch):
        self.spend()
        return batch


def test_trace_shows_the_augmentation_the_data_modules_loader_runs_in_its_fetch(tmp_path):
    # OptimizedDataModule's loaders augment as they gather (inside the fetch): the augment lane
    # timed only on_after_batch_transfer, which then returns the prepared batch in no time.
    from _helpers import TinyDataModule, TinyModel

    clock = FakeClock()
    path = tmp_path / "trace.json"
    prof = DataWaitProfiler(clock=clock, print_report=False, trace=path, trace_steps=(1, 3))
    dm = TinyDataModule(n=48, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", strategy="device",
                        val=False, train_augment=_SpendingAugment(Spend(AUGMENT, clock)))
    make_trainer(tmp_path, max_epochs=1, callbacks=[prof]).fit(TinyModel(), datamodule=dm)
    assert "_loader_augment" not in vars(dm)  # the timing wrapper is gone
    _, by_step = _spans(json.load(open(path)))
    assert sorted(by_step) == [1, 2, 3]
    for spans in by_step.values():
        (fetch,) = spans["fetch"]
        timed = [a for a in spans["augment"] if a["dur"] > 0]
        assert [a["dur"] for a in timed] == [AUGMENT * 1e6]
        assert fetch["ts"] <= timed[0]["ts"] and timed[0]["ts"] + timed[0]["dur"] <= fetch["ts"] + fetch["dur"]


def test_trace_is_written_atomically_and_a_failed_write_keeps_the_last_one(tmp_path, monkeypatch):
    from lightning_fastdata import _util, trace

    clock = FakeClock()
    path = tmp_path / "out" / "trace.json"
    writes = []
    real_fsync = _util.os.fsync

    def atomic_write_text(p, text, mode=0o644):
        writes.append(p)
        return _util.atomic_write_text(p, text, mode)

    def fsync(fd):  # the second write runs out of space half-way
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(trace, "atomic_write_text", atomic_write_text)
    monkeypatch.setattr(_util.os, "fsync", fsync)
    prof = DataWaitProfiler(clock=clock, print_report=False, trace=path, trace_steps=(4, 4))
    trainer = make_trainer(tmp_path, max_epochs=2, callbacks=[prof])
    with pytest.warns(UserWarning, match=r"could not write the trace to .*trace\.json: .*No space left"):
        trainer.fit(SpendingModel(Spend(COMPUTE, clock)), loader(24, 4, Spend(FETCH, clock)))
    assert writes == [path, path]  # once per epoch, the window spans both
    kept = json.load(open(path))  # the first epoch's trace (steps 4 and 5), whole
    assert kept["otherData"]["steps"] == [4, 5]
    assert sorted(p.name for p in path.parent.iterdir()) == ["trace.json"]  # no temporary left
    assert prof.report()["trace"]["last_step"] == 5


def test_trace_on_a_simulated_gpu_has_device_lanes(tmp_path, monkeypatch):
    clock = FakeClock()
    _simulate_cuda(monkeypatch, clock, lag=2)
    path = tmp_path / "gpu.json"
    prof = _OnDevice(clock=clock, print_report=False, trace=path, trace_steps=(0, 8))
    trainer = make_trainer(tmp_path, callbacks=[prof])
    trainer.fit(SpendingModel(Spend(COMPUTE, clock), Spend(TRANSFER, clock)), loader(32, 4, Spend(FETCH, clock)))
    events, by_step = _spans(json.load(open(path)))
    assert sorted(by_step) == list(range(8))
    for i, spans in by_step.items():
        assert [e["dur"] for e in spans["gpu"] if e["tid"] != 6] == [1e6 * COMPUTE]  # gpu compute
        idle = [e["dur"] for e in spans["gpu"] if e["tid"] == 6]
        assert idle == ([] if i == 0 else [pytest.approx(1e6 * (FETCH + TRANSFER))])


@pytest.mark.parametrize("kwargs, match", [
    (dict(trace=3), "trace must be a file path or None, got 3"),
    (dict(trace_steps=(0, 0)), r"trace_steps must be \(first, count\) .* got \(0, 0\)"),
    (dict(trace_steps=(-1, 5)), "trace_steps"),
])
def test_bad_trace_arguments_are_named(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        DataWaitProfiler(**kwargs)


def test_numpy_scalars_are_taken_as_plain_values():
    import numpy as np

    prof = DataWaitProfiler(replay_steps=np.int64(3), replay_batches=np.int64(2), replay_warmup=np.int64(1),
                            max_pending=np.int64(8), print_report=np.bool_(False),
                            trace_steps=[np.int64(0), np.int64(4)])
    got = (prof.replay_steps, prof.replay_batches, prof.replay_warmup, prof.max_pending, prof.print_report)
    assert got == (3, 2, 1, 8, False) and [type(v) for v in got] == [int] * 4 + [bool]
    assert prof.trace_steps == (0, 4) and all(type(v) is int for v in prof.trace_steps)
    with pytest.raises(ValueError, match=r"trace_steps must be .* got \(1.0, 2\)"):
        DataWaitProfiler(trace_steps=(1.0, 2))


def test_a_validation_inside_the_epoch_is_not_gpu_idle_of_the_next_step(tmp_path, monkeypatch):
    # The device is busy validating between two training steps: the idle before the next
    # step is measured from the validation's end, not from the last training step's event.
    def idle_per_step(val: bool) -> list[float]:
        clock = FakeClock()
        _simulate_cuda(monkeypatch, clock, lag=2)
        prof = _OnDevice(clock=clock, print_report=False)
        kw = dict(val_check_interval=4) if val else dict(limit_val_batches=0)
        t = make_trainer(tmp_path, callbacks=[prof], num_sanity_val_steps=0, **kw)
        model = SpendingModel(Spend(COMPUTE, clock), Spend(TRANSFER, clock), Spend(COMPUTE, clock))
        t.fit(model, loader(64, 4, Spend(FETCH, clock)), loader(32, 4, Spend(FETCH, clock)) if val else None)
        return [round(row[6], 6) for row in prof._train.history]

    plain, with_val = idle_per_step(False), idle_per_step(True)
    assert len(plain) == len(with_val) == 16
    assert max(with_val) <= max(plain)  # no step carries a validation run's device time


def test_gradient_accumulation_logs_once_per_optimizer_step(tmp_path):
    # Fetch i takes i ms: each logged mean shows which batches it averaged.
    clock = FakeClock()
    prof = DataWaitProfiler(clock=clock, print_report=False)
    logger = CSVLogger(str(tmp_path), name="csv")
    count = [0]

    def growing() -> None:
        count[0] += 1
        clock.advance(count[0] * 1e-3)

    t = make_trainer(tmp_path, callbacks=[prof], logger=logger, log_every_n_steps=2, accumulate_grad_batches=2,
                     num_sanity_val_steps=0)
    t.fit(SpendingModel(Spend(COMPUTE, clock)), loader(48, 4, growing))
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    ours = [(int(r["step"]), float(r["fastdata/data_wait_ms"])) for r in rows if r.get("fastdata/data_wait_ms")]
    lightning = [int(r["step"]) for r in rows if r.get("train_loss")]
    assert [s for s, _ in ours] == lightning == [1, 3, 5]  # one row per logged step, as Lightning's own
    # Each log: the mean of the 4 batches (2 optimizer steps of 2) since the last one.
    assert [w for _, w in ours] == pytest.approx([2.5, 6.5, 10.5])


def _chunked_advice(store, free, transfer):
    from lightning_fastdata.plan import decide

    res = Resources(physical_cores=8, logical_cores=8, ram_total=256 * GB, ram_available=200 * GB,
                    device_type="cuda", device_total=80 * GB, device_free=free, shm_free=64 * GB)
    plan = decide(store, res, {"strategy": "auto", "vram_fraction": 0.6, "batch_nbytes": 64 << 20})
    assert plan.strategy == "chunked"
    summary = _summary(0.06, 0.03, 0.01, transfer=transfer)
    return advise(summary, {"plan": plan, "vram_fraction": 0.6, "cores": 8, "device_type": "cuda",
                            "loader": {"kind": "chunked"}})


def test_advice_never_moves_a_store_to_a_device_without_the_free_memory():
    # 20 GB fits 60% of 80 GB but not the 12 GB free: the planner would refuse strategy=device.
    advice = _chunked_advice(20 * GB, 12 * GB, transfer=0.01)
    assert not any("set strategy=device" in a for a in advice)
    assert "not its free memory" in advice[0] and "stays on the host" in advice[0]


def test_advice_for_a_store_on_the_host_does_not_then_say_keep_it_on_the_device():
    advice = _chunked_advice(60 * GB, 80 * GB, transfer=0.05)
    assert "stays on the host" in advice[0]
    assert not any("strategy=device" in a for a in advice)
    assert any(a.endswith("wait: lighten the augmentation") for a in advice)


def test_ddp_reduction_keeps_whole_rows_of_the_rank_that_waited(monkeypatch):
    # Two ranks whose loaders stall in turn: each step, one rank waits 60 ms for data and the
    # other spends those 60 ms in the gradient all-reduce (its compute). Whole rows, never
    # column-wise maxima: a step's parts add up to its time and the verdict is data-bound.
    from lightning_fastdata import distributed as D
    from lightning_fastdata import rank_reduce

    nan, IDLE_COL = float("nan"), 6
    stalled, waiting = (0.070, 0.060, 0.060, 0.0, 0.010, 0.0, nan, 4), (0.070, 0.0, 0.0, 0.0, 0.070, 0.0, nan, 4)
    rank0 = [stalled if i % 2 == 0 else waiting for i in range(6)]
    rank1 = [waiting if i % 2 == 0 else stalled for i in range(6)]
    rows = rank_reduce.slowest_rows([rank0, rank1])
    assert len(rows) == 6 and all(r[:IDLE_COL] == list(stalled[:IDLE_COL]) for r in rows)

    monkeypatch.setattr(D, "world_size", lambda: 2)
    monkeypatch.setattr(D, "is_initialized", lambda: True)
    monkeypatch.setattr(D, "all_gather_object", lambda obj: [[list(r) for r in rank0], [list(r) for r in rank1]])
    count, step, wait, compute, overhead, idle = rank_reduce.interval_means(rank0)
    assert (count, step, wait, compute, overhead, idle) == pytest.approx((6, 0.070, 0.060, 0.010, 0.0, 0.0))
    epoch = rank_reduce.epoch_rows(rank0, cuda=False)
    s = summarize(epoch)
    assert s["data_wait_frac"] + s["compute_frac"] + s["overhead_frac"] == pytest.approx(1.0)
    assert verdict_of(s)["verdict"] == "data-bound"


# ---------------------------------------------------------------------- review fixes: trace tiling, CPU host-bound


class _IterAround(SpendingModel):
    """A ``dataloader_iter`` step that computes before and after it fetches (the fetch falls inside the call)."""

    def training_step(self, dataloader_iter):
        self.step()
        batch, _, _ = next(dataloader_iter)
        self.step()
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)


@pytest.mark.parametrize("cuda", [False, True])
def test_trace_of_a_dataloader_iter_step_tiles_it_without_overlap(tmp_path, monkeypatch, cuda):
    # The compute was drawn as one block from the call's start, over the fetch inside it, and the
    # gap filler then invented an overhead as long as the fetch: the spans summed to more than the step.
    clock = FakeClock()
    path = tmp_path / "trace.json"
    if cuda:
        _simulate_cuda(monkeypatch, clock, lag=2)
    cls = _OnDevice if cuda else DataWaitProfiler
    prof = cls(clock=clock, print_report=False, trace=path, trace_steps=(1, 3))
    trainer = make_trainer(tmp_path, callbacks=[SpendBeforeBatch(Spend(OVERHEAD, clock)), prof],
                           limit_train_batches=5)
    trainer.fit(_IterAround(Spend(COMPUTE / 2, clock)), loader(32, 4, Spend(FETCH, clock)))
    _, by_step = _spans(json.load(open(path)))
    assert sorted(by_step) == [1, 2, 3]
    us = 1e6
    for spans in by_step.values():
        (step,) = spans["step"]
        parts = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for k in ("fetch", "transfer", "compute", "overhead")
                       for e in spans.get(k, []))
        assert [name for _, _, name in parts] == ["overhead", "compute", "fetch", "compute"]
        for (_, end, _), (start, _, _) in zip(parts, parts[1:], strict=False):
            assert start == pytest.approx(end, abs=1e-6)  # back to back: no overlap, no gap
        assert parts[0][0] == pytest.approx(step["ts"]) and parts[-1][1] == pytest.approx(step["ts"] + step["dur"])
        assert [e["dur"] for e in spans["compute"]] == [COMPUTE / 2 * us] * 2
        assert [e["dur"] for e in spans["fetch"]] == [FETCH * us]
        assert [e["dur"] for e in spans["overhead"]] == [OVERHEAD * us]


def test_framework_overhead_larger_than_data_and_compute_is_host_bound_on_a_cpu(tmp_path):
    # A callback spending 4 ms per batch (84% of the step) was "compute-bound (11%)", with
    # "the input pipeline keeps up: speed now comes from the model".
    prof, _, _ = _fit_fake(tmp_path, overhead=8 * COMPUTE, epochs=1, val=False)
    rep = prof.report()
    assert rep["verdict"] == "host-bound" and rep["share"] == rep["overhead_frac"] > 0.5
    assert rep["advice"][0].startswith(f"host-bound: framework overhead is {rep['overhead_frac']:.0%} of the step")
    assert "log_every_n_steps" in rep["advice"][0] and "a larger batch" in rep["advice"][0]
    assert not any(a.startswith(("compute-bound", "framework overhead is")) for a in rep["advice"])
    assert f"verdict: host-bound ({rep['overhead_frac']:.0%})" in format_report(rep)
    # With a real data wait too (22%, overhead 70%): host-bound first, the loader advice after it.
    s = _summary(wait=0.0013, compute=0.0005, overhead=0.0042)
    assert s["verdict"] == "host-bound" and s["share"] == pytest.approx(0.7)
    advice = advise(s, {"cores": 2, "loader": {"kind": "dataloader", "num_workers": 0}})
    assert advice[0].startswith("host-bound: framework overhead is 70%") and "num_workers=1" in advice[1]
    # Restarting workers land in the overhead: their fix leads.
    restarting = advise(s, {"cores": 4, "loader": {"kind": "dataloader", "num_workers": 2}})
    assert "set persistent_workers=True" in restarting[0]
    # Below the overhead threshold, or not the largest part, the verdict is unchanged.
    assert _summary(0.0, 0.01, 0.01)["verdict"] == "compute-bound"
    assert _summary(0.03, 0.01, 0.02)["verdict"] == "data-bound"


# ---------------------------------------------------------------------- review fixes: trace lanes, samples, advice


def test_trace_keeps_the_augmentation_the_loader_runs_ahead_in_its_thread(tmp_path):
    # With augment_ahead the loader augments the next batch during the step: the trace dropped
    # every such span that began before the step it ended in (1 of 6 was left). Real sleeps: the
    # loader's thread runs beside the step.
    from _helpers import TinyDataModule, TinyModel

    path = tmp_path / "trace.json"
    prof = DataWaitProfiler(print_report=False, trace=path, trace_steps=(0, 6))
    dm = TinyDataModule(n=48, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", strategy="device",
                        val=False, augment_ahead=1, train_augment=_SpendingAugment(Spend(0.01)))
    make_trainer(tmp_path, max_epochs=1, callbacks=[prof]).fit(TinyModel(), datamodule=dm)
    trace = json.load(open(path))
    lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    ahead = [e for e in events if lanes[e["tid"]] == "augment (loader thread)"]
    assert len(ahead) == 6 and all(e["dur"] >= 0.01 * 1e6 for e in ahead)  # one per batch, each whole
    for tid in lanes:  # no two spans of a lane overlap: the loader thread's has its own
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == tid)
        assert all(end <= nxt + 1e-3 for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False)), lanes[tid]
    # The main thread's lanes still tile each step.
    _, by_step = _spans(trace)
    for spans in by_step.values():
        (step,) = spans["step"]
        parts = sum(e["dur"] for k in ("fetch", "transfer", "compute", "overhead") for e in spans.get(k, []))
        assert parts == pytest.approx(step["dur"], abs=1e-3)
    assert prof.report()["stages"]["train"]["augment_ms_mean"] >= 10.0


class _Named(torch.utils.data.Dataset):
    """Samples that start with their file name: ``(name, x, y)``, or a dict of the three."""

    def __init__(self, as_dict: bool) -> None:
        self.as_dict = as_dict

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        name, x, y = f"images/train/img_{i:06d}.jpg", torch.randn(8), i % 2
        return {"path": name, "x": x, "y": y} if self.as_dict else (name, x, y)


class _NamedModel(SpendingModel):
    def training_step(self, batch, batch_idx):
        x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch[1:]
        return torch.nn.functional.cross_entropy(self.net(x), y)


@pytest.mark.parametrize("as_dict", [False, True])
def test_samples_of_batches_that_start_with_file_names(tmp_path, as_dict):
    # A batch whose first field is a list of file names counted each name's characters: 4 batches
    # of 4 samples reported 108 samples (27 characters x 4).
    from torch.utils.data import DataLoader

    prof = DataWaitProfiler(print_report=False)
    make_trainer(tmp_path, callbacks=[prof]).fit(_NamedModel(Spend(0.0)), DataLoader(_Named(as_dict), batch_size=4))
    assert (prof.report()["steps"], prof.report()["samples"]) == (4, 16)


@pytest.mark.parametrize("batch,n", [
    ((7, torch.zeros(4, 3), torch.zeros(4)), 4),  # a task id before the arrays counted 3 (review 94)
    ((["a.jpg", "b.jpg"], torch.zeros(2, 3)), 2),
    ({"path": ["a.jpg", "b.jpg", "c.jpg"]}, 3),
    ([torch.zeros(5, 2), torch.zeros(5)], 5),
])
def test_the_samples_of_a_batch_are_its_first_arrays_rows(batch, n):
    from lightning_fastdata._util import batch_len

    assert batch_len(batch) == n


def test_validation_advice_describes_the_validation_loader(tmp_path):
    # The advice of a data-bound validation (a main-process loader) described the training
    # loader's settings: "workers are saturated: 1 workers + the main process on 2 cores".
    clock = FakeClock()
    prof = DataWaitProfiler(clock=clock, print_report=False)
    model = SpendingModel(Spend(COMPUTE, clock), None, Spend(COMPUTE / 4, clock))
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8), torch.zeros(8).long()),
                                        batch_size=4, num_workers=1, persistent_workers=True)
    make_trainer(tmp_path, callbacks=[prof]).fit(model, train, loader(8, 4, Spend(FETCH, clock)))
    val = prof.report()["stages"]["validate"]
    assert val["verdict"] == "data-bound"
    assert any("batches are loaded in the main process (num_workers=0)" in a for a in val["advice"]), val["advice"]
    assert not any("workers are saturated" in a or "1 workers" in a for a in val["advice"])


def test_validate_alone_gets_advice_on_its_loader(tmp_path):
    # trainer.validate alone printed a data-bound verdict with no advice: the loader was read at
    # the training start only.
    clock = FakeClock()
    prof = DataWaitProfiler(clock=clock, print_report=False)
    model = SpendingModel(Spend(COMPUTE, clock), None, Spend(COMPUTE / 4, clock))
    make_trainer(tmp_path, callbacks=[prof]).validate(model, loader(12, 4, Spend(FETCH, clock)), verbose=False)
    val = prof.report()["stages"]["validate"]
    assert val["verdict"] == "data-bound"
    assert any("(num_workers=0): set num_workers=" in a for a in val["advice"]), val["advice"]


def test_chunked_advice_names_the_augmentation_when_it_is_the_wait(tmp_path):
    # A chunked store's loader gathers and augments in its fetch: a wait that was all augmentation
    # got "the store fits ...: set strategy=device", which changed nothing.
    from _helpers import TinyDataModule, TinyModel

    clock = FakeClock()
    prof = DataWaitProfiler(clock=clock, print_report=False)
    dm = TinyDataModule(n=48, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", strategy="chunked",
                        val=False, augment_ahead=0, train_augment=_SpendingAugment(Spend(FETCH, clock)))
    make_trainer(tmp_path, callbacks=[SpendBeforeBatch(Spend(COMPUTE, clock)), prof]).fit(TinyModel(), datamodule=dm)
    rep = prof.report()
    assert rep["verdict"] == "data-bound"
    assert rep["advice"][0].startswith("data wait is 67% of the step: the loader's fetch (7.8 ms a step) gathers "
                                       "each batch from host memory and applies train_augment (7.8 ms a batch): "
                                       "use a lighter train_augment"), rep["advice"]
    assert not any("strategy=device" in a for a in rep["advice"])
    assert rep["stages"]["train"]["augment_ms_mean"] == 1e3 * FETCH


def test_chunked_advice_moves_the_store_when_the_gather_is_the_wait():
    plan = Plan("chunked", store_nbytes=int(1.4 * GB), resources=_resources())
    context = {"plan": plan, "vram_fraction": 0.6, "cores": 8, "device_type": "cuda",
               "loader": {"kind": "chunked", "ahead": 1, "augments": True}}
    gather = _summary(0.02, 0.01, 0.0)
    gather["augment_ms_mean"] = 1.0  # of a 20 ms fetch: the gather is the cost
    advice = advise(gather, context)
    assert advice[0] == "data wait is 67% of the step; the store (1.4 GB) fits 60% of this GPU's 80.0 GB: " \
                        "set strategy=device"
    both = _summary(0.02, 0.01, 0.0)
    both["augment_ms_mean"] = 10.0  # half of it: both are worth cutting
    advice = advise(both, context)
    assert "applies train_augment (10.0 ms a batch): use a lighter train_augment" in advice[0]
    assert any(a.endswith("set strategy=device") for a in advice[1:])
    # Not timed (the fallback timing): which part costs is unknown, both are said.
    advice = advise(_summary(0.02, 0.01, 0.0), context)
    assert advice[0].endswith("applies train_augment: use a lighter train_augment if it is the cost")
    assert any(a.endswith("set strategy=device") for a in advice[1:])
