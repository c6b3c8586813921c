"""FastDataCallback: set_epoch where Lightning does not, plan and memory logging, any data source, DDP."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from _helpers import TinyDataModule, TinyModel
from _helpers import trainer as make_trainer
from _jobs import free_port
from _timing import Spend, SpendingModel, Vectors, loader
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, IterableDataset

from lightning_fastdata import DataWaitProfiler, FastDataCallback
from lightning_fastdata import _lightning as door


class EpochStream(IterableDataset):
    """An iterable dataset that shuffles per epoch: only right if someone calls its set_epoch."""

    def __init__(self, n: int = 16) -> None:
        self.n, self.epoch, self.calls = n, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.calls.append(epoch)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.epoch)
        for i in torch.randperm(self.n, generator=g).tolist():
            yield torch.full((8,), float(i)), i % 2


class EpochBatchSampler:
    """A custom batch sampler with set_epoch and no ``.sampler``: Lightning does not reach it."""

    def __init__(self, n: int = 16, batch_size: int = 4) -> None:
        self.n, self.batch_size, self.epoch, self.calls = n, batch_size, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.calls.append(epoch)

    def __len__(self) -> int:
        return self.n // self.batch_size

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        for b in range(len(self)):
            yield order[b * self.batch_size:(b + 1) * self.batch_size]


class Recording(SpendingModel):
    def __init__(self) -> None:
        super().__init__(Spend(0.0))
        self.first_of_epoch: list[float] = []

    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.first_of_epoch.append(float(batch[0][0, 0]) if batch[0].ndim > 1 else float(batch[0][0]))
        return super().training_step(batch, batch_idx)


def test_set_epoch_reaches_an_iterable_dataset(tmp_path):
    stream = EpochStream()
    cb = FastDataCallback(print_report=False)
    model = Recording()
    make_trainer(tmp_path, max_epochs=3, callbacks=[cb]).fit(model, DataLoader(stream, batch_size=4))
    assert stream.calls == [0, 0, 1, 2]  # when Lightning sets the loader up (see the resume test), then per epoch
    assert ("loader[0].dataset", 2) in cb.set_epoch_calls
    assert len(set(model.first_of_epoch)) == 3  # a new order every epoch


def test_set_epoch_reaches_a_custom_batch_sampler_but_not_what_lightning_covers(tmp_path):
    sampler = EpochBatchSampler()
    cb = FastDataCallback(print_report=False)
    make_trainer(tmp_path, max_epochs=2, callbacks=[cb]).fit(
        SpendingModel(Spend(0.0)), DataLoader(Vectors(16), batch_sampler=sampler))
    assert sampler.calls == [0, 0, 1]  # when Lightning sets the loader up, then per epoch
    assert {where for where, _ in cb.set_epoch_calls} == {"loader[0].batch_sampler"}


def test_without_set_epoch_the_stream_repeats_its_order(tmp_path):
    stream = EpochStream()
    model = Recording()
    cb = FastDataCallback(print_report=False, set_epoch=False)
    make_trainer(tmp_path, max_epochs=2, callbacks=[cb]).fit(model, DataLoader(stream, batch_size=4))
    assert stream.calls == [] and len(set(model.first_of_epoch)) == 1


def test_plan_is_logged_once_and_memory_per_epoch(tmp_path, cache_dir):
    logger = CSVLogger(str(tmp_path), name="logs")
    dm = TinyDataModule(n=32, batch_size=8, cache_dir=str(cache_dir), device="cpu")
    cb = FastDataCallback(print_report=False)
    make_trainer(tmp_path, max_epochs=2, callbacks=[cb], logger=logger).fit(TinyModel(), dm)
    hparams = yaml.safe_load(open(Path(logger.log_dir) / "hparams.yaml"))
    assert hparams["fastdata_plan"]["strategy"] == dm.plan.strategy
    assert "strategy" in hparams["fastdata_plan"]["reasons"]
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    rss = [float(r["fastdata/host_rss_mb"]) for r in rows if r.get("fastdata/host_rss_mb")]
    assert len(rss) == 2 and all(v > 10 for v in rss)
    # Each epoch's at its last batch (steps 3 and 7 of 4 per epoch), as Lightning's epoch metrics.
    assert [int(r["step"]) for r in rows if r.get("fastdata/host_rss_mb")] == [3, 7]
    assert len(cb.memory) == 2
    rep = cb.report()
    assert rep["steps"] == 8 and rep["samples"] == 64
    assert rep["stages"]["validate"]["steps"] == 2 * 4


def test_plain_loaders_log_their_settings(tmp_path):
    logger = CSVLogger(str(tmp_path), name="logs")
    cb = FastDataCallback(print_report=False)
    make_trainer(tmp_path, callbacks=[cb], logger=logger).fit(SpendingModel(Spend(0.0)), loader(16, 4, Spend(0.0)))
    hparams = yaml.safe_load(open(Path(logger.log_dir) / "hparams.yaml"))
    assert hparams["fastdata_loader"] == {"kind": "dataloader", "num_workers": 0, "pin_memory": False,
                                          "persistent_workers": False}


def test_works_with_any_lightning_datamodule(tmp_path):
    class Plain(L.LightningDataModule):
        def train_dataloader(self):
            return loader(16, 4, Spend(0.0))

        def val_dataloader(self):
            return loader(8, 4, Spend(0.0))

    cb = FastDataCallback(print_report=False)
    make_trainer(tmp_path, callbacks=[cb]).fit(SpendingModel(Spend(0.0)), datamodule=Plain())
    rep = cb.report()
    assert rep["steps"] == 4 and rep["stages"]["validate"]["steps"] == 2
    assert rep["verdict"] in ("data-bound", "compute-bound")


def test_profile_off_records_and_wraps_nothing(tmp_path):
    cb = FastDataCallback(profile=False)
    trainer = make_trainer(tmp_path, callbacks=[cb])
    seen = {}
    orig = trainer.strategy.batch_to_device

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["wrapped"] = "batch_to_device" in vars(trainer.strategy)

    trainer.callbacks.append(Probe())
    trainer.fit(SpendingModel(Spend(0.0)), loader(16, 4, Spend(0.0)))
    assert seen == {"wrapped": False} and trainer.strategy.batch_to_device == orig
    assert cb.report()["steps"] == 0 and cb.report()["verdict"] == "no steps"
    assert len(cb.memory) == 1  # the rest of the callback still runs
    # Lightning does not even dispatch the per-step timing hooks (not callable: skipped).
    assert cb.on_train_batch_start is None and cb.on_train_batch_end is None
    assert cb.on_validation_batch_start is None and cb.on_validation_batch_end is None


def test_worker_seeding_hook_runs_before_the_loaders_exist(tmp_path):
    calls = []

    class Hooked(FastDataCallback):
        def _install_worker_seeding(self, trainer):
            calls.append(trainer.fit_loop._combined_loader)

    make_trainer(tmp_path, callbacks=[Hooked(print_report=False)]).fit(
        SpendingModel(Spend(0.0)), loader(8, 4, Spend(0.0)))
    assert calls == [None]


def test_the_report_is_printed_at_fit_end(tmp_path, caplog):
    cb = FastDataCallback()
    with caplog.at_level("INFO"):
        make_trainer(tmp_path, callbacks=[cb]).fit(SpendingModel(Spend(0.0)), loader(8, 4, Spend(0.0)))
    assert "lightning_fastdata profile" in caplog.text and "verdict:" in caplog.text


def test_composes_a_data_wait_profiler_with_the_demo_keys():
    cb = FastDataCallback(replay_steps=3, trace="t.json", trace_steps=(1, 2))
    assert isinstance(cb.profiler, DataWaitProfiler) and not isinstance(cb, DataWaitProfiler)
    assert (cb.profiler.replay_steps, cb.profiler.trace, cb.profiler.trace_steps) == (3, "t.json", (1, 2))
    assert {"data_wait_frac", "epoch_time_s", "samples", "steps", "data_wait_s", "compute_s"} <= set(cb.report())
    assert cb.report() == cb.profiler.report()


def test_falls_back_to_public_batch_hooks_when_the_door_is_closed(tmp_path, monkeypatch):
    def closed(trainer):
        raise door.DoorClosed("_TrainingEpochLoop", "_on_before_fetch", "fetch start hook")

    monkeypatch.setattr(door, "timing_sites", closed)
    cb = FastDataCallback(print_report=False)
    trainer = make_trainer(tmp_path, callbacks=[cb])
    with pytest.warns(UserWarning, match="public batch hooks"):
        trainer.fit(SpendingModel(Spend(0.0)), loader(16, 4, Spend(0.0)), loader(8, 4, Spend(0.0)))
    rep = cb.report()
    assert rep["timing"] == "hooks" and rep["steps"] == 4 and rep["samples"] == 16
    assert rep["stages"]["validate"]["steps"] == 2
    assert cb.on_train_batch_start is None and cb.on_train_batch_end is None  # hidden again after fit
    assert len(cb.memory) == 1


def test_trace_of_a_fit_with_a_sleeping_loader(tmp_path, caplog):
    path = tmp_path / "trace.json"
    cb = FastDataCallback(trace=path, trace_steps=(1, 3))
    with caplog.at_level("INFO"):
        make_trainer(tmp_path, callbacks=[cb]).fit(SpendingModel(Spend(0.002)), loader(24, 4, Spend(0.003)))
    with open(path) as f:
        trace = json.load(f)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["ts"] for e in spans] == sorted(e["ts"] for e in spans)
    for step in (1, 2, 3):
        mine = {e["name"]: e for e in spans if e["args"]["step"] == step and e["name"] != "overhead"}
        assert set(mine) == {f"step {step}", "fetch", "transfer", "compute"}
        fetch, transfer, compute = mine["fetch"], mine["transfer"], mine["compute"]
        assert fetch["ts"] + fetch["dur"] <= transfer["ts"] + 1e-3 and transfer["ts"] < compute["ts"]
        overhead = sum(e["dur"] for e in spans if e["args"]["step"] == step and e["name"] == "overhead")
        total = fetch["dur"] + transfer["dur"] + compute["dur"] + overhead
        assert total == pytest.approx(mine[f"step {step}"]["dur"], rel=1e-9, abs=1e-3)
    assert f"trace: {path} (training steps 1 to 3" in caplog.text


@pytest.mark.parametrize("kwargs, match", [
    (dict(profile="yes"), "profile must be True or False"),
    (dict(log_memory=1), "log_memory must be True or False"),
    (dict(replay_steps=-3), "replay_steps must be an int >= 0, got -3"),
    (dict(print_report="no"), "print_report must be True or False, got 'no'"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FastDataCallback(**kwargs)


def test_numpy_scalars_are_taken_as_plain_values(tmp_path):
    """replay_steps=np.int64(5) and trace_steps from numpy were refused; flags may be numpy bools."""
    cb = FastDataCallback(replay_steps=np.int64(5), replay_batches=np.int64(2), trace=tmp_path / "t.json",
                          trace_steps=(np.int64(1), np.int64(3)), profile=np.bool_(True), log_memory=np.bool_(False))
    prof = cb.profiler
    assert (prof.replay_steps, prof.replay_batches, prof.trace_steps) == (5, 2, (1, 3))
    assert type(prof.replay_steps) is int and all(type(v) is int for v in prof.trace_steps)
    assert cb.profile is True and cb.log_memory is False
    with pytest.raises(ValueError, match="replay_steps must be an int >= 0, got '5'"):
        FastDataCallback(replay_steps="5")


def test_a_trace_path_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"trace must be a file path, got .* an existing directory"):
        FastDataCallback(trace=tmp_path)


@pytest.mark.slow
def test_ddp_logs_the_slowest_ranks_wait(tmp_path, monkeypatch):
    """Rank 1's loader is 8x slower; the logged per-step wait is rank 1's, not rank 0's."""
    # ddp_spawn's rank 0 leaves an empty tempfile.mkdtemp() behind (Lightning's launcher removes
    # the checkpoint, not its directory): point the spawned processes' TMPDIR into tmp_path.
    (tmp_path / "spawn-tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "spawn-tmp"))
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # not Lightning's bind(0) port: see free_port
    logger = CSVLogger(str(tmp_path), name="ddp", version=0)
    cb = FastDataCallback(print_report=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, logger=logger,
                        log_every_n_steps=2, callbacks=[cb], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path))
    trainer.fit(SpendingModel(Spend(0.0)), loader(32, 4, Spend(0.005, per_rank={1: 0.04})))
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    waits = [float(r["fastdata/data_wait_ms"]) for r in rows if r.get("fastdata/data_wait_ms")]
    assert len(waits) == 2  # 4 steps per rank, every 2nd logged
    assert all(w > 30 for w in waits), waits
    epoch = [float(r["fastdata/epoch/data_wait_ms_p50"]) for r in rows if r.get("fastdata/epoch/data_wait_ms_p50")]
    assert len(epoch) == 1 and epoch[0] > 30


# --------------------------------------------------------------------------- worker seeding


class _Draws(torch.utils.data.Dataset):
    """Each sample is (numpy draw, torch draw, worker id): what a random augmentation would see."""

    def __init__(self, rng=None) -> None:
        self.rng = rng

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return torch.tensor([np.random.random(), torch.rand(()).item(), info.id if info else -1.0,
                             getattr(self, "user_ran", 0.0)])


class _DrawsModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.draws: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.draws.append(batch.clone())
        return (self.w * batch.sum()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _user_fn(worker_id: int) -> None:
    torch.utils.data.get_worker_info().dataset.user_ran = 1.0


def _fit_draws(tmp_path, persistent: bool, rng=None):

    class DM(L.LightningDataModule):
        seed = 7

        def train_dataloader(self):
            return torch.utils.data.DataLoader(_Draws(rng), batch_size=2, num_workers=2,
                                               persistent_workers=persistent, worker_init_fn=_user_fn)

    model = _DrawsModel()
    cb = FastDataCallback(print_report=False)
    L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[cb]).fit(model, DM())
    return torch.cat(model.draws), cb


@pytest.mark.parametrize("persistent", [False, True])
def test_callback_seeds_plain_dataloader_workers_per_epoch(tmp_path, persistent):
    a, cb = _fit_draws(tmp_path, persistent)
    b, _ = _fit_draws(tmp_path, persistent)
    assert cb.seeded_loaders == 1
    assert torch.equal(a, b)  # reproducible
    epoch0, epoch1 = a[:8], a[8:]
    for w in (0.0, 1.0):
        first0 = epoch0[epoch0[:, 2] == w][0, :2]
        first1 = epoch1[epoch1[:, 2] == w][0, :2]
        assert not torch.equal(first0, first1)  # epochs differ, persistent workers too
    w0, w1 = epoch0[epoch0[:, 2] == 0][0, :2], epoch0[epoch0[:, 2] == 1][0, :2]
    assert not torch.equal(w0, w1)  # workers differ


def test_validation_workers_do_not_replay_the_training_workers_draws(tmp_path):
    class Both(_DrawsModel):
        def __init__(self) -> None:
            super().__init__()
            self.val_draws: list[torch.Tensor] = []

        def validation_step(self, batch, batch_idx):
            self.val_draws.append(batch.clone())

    class DM(L.LightningDataModule):
        seed = 7

        def train_dataloader(self):
            return torch.utils.data.DataLoader(_Draws(), batch_size=2, num_workers=1)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(_Draws(), batch_size=2, num_workers=1)

    model = Both()
    cb = FastDataCallback(print_report=False)
    L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path),
              callbacks=[cb]).fit(model, DM())
    assert cb.seeded_loaders == 2
    train, val = torch.cat(model.draws), torch.cat(model.val_draws)
    assert train.shape == val.shape == (8, 4)
    assert not torch.isin(val[:, :2], train[:, :2]).any()  # same worker, epoch and seed: other draws


def test_two_validation_loaders_draw_apart_and_the_same_at_every_validate(tmp_path):
    class TwoVal(_DrawsModel):
        def __init__(self) -> None:
            super().__init__()
            self.val_draws: dict[int, list[torch.Tensor]] = {0: [], 1: []}

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.val_draws[dataloader_idx].append(batch.clone())

    class DM(L.LightningDataModule):
        seed = 7

        def val_dataloader(self):
            return [torch.utils.data.DataLoader(_Draws(), batch_size=2, num_workers=1) for _ in range(2)]

    model, cb = TwoVal(), FastDataCallback(print_report=False)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), callbacks=[cb])
    runs = []
    for _ in range(2):
        trainer.validate(model, DM(), verbose=False)
        runs.append({k: torch.cat(v) for k, v in model.val_draws.items()})
        model.val_draws = {0: [], 1: []}
    assert cb.seeded_loaders == 4
    first, again = runs
    assert first[0].shape == first[1].shape == (8, 4)
    assert not torch.isin(first[1][:, :2], first[0][:, :2]).any()  # the second loader's workers: other draws
    assert all(torch.equal(first[k], again[k]) for k in (0, 1))  # and the same ones at every validate


def test_callback_keeps_user_worker_init_fn_and_warns_on_held_generator(tmp_path):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        draws, _ = _fit_draws(tmp_path, False, rng=np.random.RandomState(0))
    assert (draws[:, 3] == 1.0).all()  # the user's worker_init_fn ran in every worker
    assert any("dataset.rng is a random generator object" in str(w.message) for w in caught)


def test_the_trainer_is_left_as_it_was_found(tmp_path):
    """Every wrapped call (timing and worker seeding) is gone after fit: the classes' methods show again."""
    trainer = make_trainer(tmp_path, callbacks=[FastDataCallback(print_report=False)])
    strategy, epoch_loop = trainer.strategy, trainer.fit_loop.epoch_loop
    watched = [(strategy, ("batch_to_device", "validation_step", "process_dataloader")),
               (epoch_loop, ("_on_before_fetch", "_on_after_fetch")),
               (epoch_loop.automatic_optimization, ("run",)), (epoch_loop.manual_optimization, ("run",))]
    before = {(id(obj), name): getattr(obj, name).__func__ for obj, names in watched for name in names}
    trainer.fit(SpendingModel(Spend(0.0)), loader(16, 4, Spend(0.0)), loader(8, 4, Spend(0.0)))
    for obj, names in watched:
        for name in names:
            assert name not in vars(obj), name
            assert getattr(obj, name).__func__ is before[id(obj), name]


def test_a_fit_that_raises_writes_its_trace_and_leaves_nothing_wrapped(tmp_path):
    from _timing import COMPUTE, FETCH, FakeClock

    clock = FakeClock()
    path = tmp_path / "trace.json"

    class DM(L.LightningDataModule):
        def train_dataloader(self):
            return loader(400, 4, Spend(FETCH, clock))

        def on_after_batch_transfer(self, batch, dataloader_idx):
            return batch

    class Crash(SpendingModel):
        def training_step(self, batch, batch_idx):
            if batch_idx == 30:
                raise RuntimeError("loss is NaN")
            return super().training_step(batch, batch_idx)

    dm = DM()
    cb = FastDataCallback(clock=clock, print_report=False, trace=path, trace_steps=(0, 5))
    t = make_trainer(tmp_path, callbacks=[cb], num_sanity_val_steps=0)
    with pytest.raises(RuntimeError, match="loss is NaN"):
        t.fit(Crash(Spend(COMPUTE, clock)), datamodule=dm)
    assert path.exists() and json.loads(path.read_text())["traceEvents"]  # the window was complete
    assert not any(k in vars(t.strategy) for k in ("batch_to_device", "validation_step", "process_dataloader"))
    assert "on_after_batch_transfer" not in vars(dm)


def test_a_fit_resumed_mid_epoch_times_and_sets_the_epoch_it_resumes(tmp_path):
    """Lightning skips on_train_epoch_start for the epoch it resumes inside: the callback starts it itself."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    ck = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=6, save_top_k=-1)
    first = make_trainer(tmp_path, callbacks=[FastDataCallback(print_report=False), ck], enable_checkpointing=True,
                         max_steps=6, max_epochs=3, num_sanity_val_steps=0)
    first.fit(SpendingModel(Spend(0.0)), DataLoader(EpochStream(16), batch_size=4))  # 4 steps a epoch
    path = sorted((tmp_path / "ck").glob("*.ckpt"))[-1]  # step 6: 2 steps into epoch 1

    stream, cb = EpochStream(16), FastDataCallback(print_report=False)
    t = make_trainer(tmp_path, callbacks=[cb], max_epochs=3, num_sanity_val_steps=0)
    t.fit(SpendingModel(Spend(0.0)), DataLoader(stream, batch_size=4), ckpt_path=str(path))
    # An IterableDataset has no position to restore: the resumed epoch 1 runs its 4 batches again.
    assert t.global_step == 6 + 4 + 4
    rep = cb.report()
    assert rep["steps"] == 8 and len(rep["stages"]["train"]["epochs"]) == 2  # epochs 1 and 2, every step
    assert stream.calls[0] == 1 and ("loader[0].dataset", 1) in cb.set_epoch_calls


def test_a_checkpoint_saved_after_a_mid_epoch_validation_is_not_step_overhead(tmp_path):
    """A callback after ours (ModelCheckpoint) working in on_validation_end: not the next training step's time."""
    from _timing import COMPUTE, FETCH, FakeClock

    clock = FakeClock()

    class SlowSave(L.Callback):
        def on_validation_end(self, trainer, pl_module):
            clock.advance(0.5)

    cb = FastDataCallback(clock=clock, print_report=False, log_memory=False)
    t = make_trainer(tmp_path, callbacks=[cb, SlowSave()], val_check_interval=10, num_sanity_val_steps=0)
    t.fit(SpendingModel(Spend(COMPUTE, clock)), loader(160, 4, Spend(FETCH, clock)), loader(8, 4, Spend(FETCH, clock)))
    rows = cb.profiler._train.history
    assert len(rows) == 40 and t.fit_loop.epoch_loop.val_loop.batch_progress.total.completed == 4 * 2
    assert max(row[5] for row in rows) == pytest.approx(0.0)  # overhead: the save is in no step
    assert not any("log_every_n_steps" in a for a in cb.report()["advice"])


def test_samples_of_several_training_loaders_add_up(tmp_path):
    class Two(SpendingModel):
        def training_step(self, batch, batch_idx):
            return sum(SpendingModel.training_step(self, b, batch_idx) for b in batch.values())

    cb = FastDataCallback(print_report=False)
    make_trainer(tmp_path, callbacks=[cb], num_sanity_val_steps=0).fit(
        Two(Spend(0.0)), {"a": DataLoader(Vectors(16), batch_size=2), "b": DataLoader(Vectors(64), batch_size=8)})
    rep = cb.report()
    assert rep["steps"] == 8 and rep["samples"] == 8 * 2 + 8 * 8


def test_a_second_fit_traces_its_own_window(tmp_path):
    from _timing import COMPUTE, FETCH, FakeClock

    clock = FakeClock()
    path = tmp_path / "trace.json"
    cb = FastDataCallback(clock=clock, print_report=False, trace=path, trace_steps=(1, 2))
    for phase in (1, 2):
        t = make_trainer(tmp_path, callbacks=[cb], num_sanity_val_steps=0)
        t.fit(SpendingModel(Spend(COMPUTE * phase, clock)), loader(16, 4, Spend(FETCH, clock)))
        trace = json.loads(path.read_text())
        computes = [e["dur"] for e in trace["traceEvents"] if e.get("name") == "compute"]
        assert computes == [pytest.approx(1e6 * COMPUTE * phase)] * 2, phase  # this fit's steps
        assert cb.report()["trace"] == {"path": str(path), "first_step": 1, "last_step": 2}


class _UserRandom(torch.utils.data.Dataset):
    """Samples drawn from the user's own randomness in the workers."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        import random

        return torch.tensor(random.random())


class _ValRecorder(L.LightningModule):
    def __init__(self, persistent: bool) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1))
        self.persistent, self.val = persistent, {}

    def training_step(self, batch, batch_idx):
        return self.p.sum()

    def validation_step(self, batch, batch_idx):
        self.val.setdefault(self.current_epoch, []).extend(batch.tolist())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def _loader(self) -> DataLoader:
        return DataLoader(_UserRandom(), batch_size=2, num_workers=1, persistent_workers=self.persistent)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()


def test_validation_workers_of_a_plain_loader_draw_the_same_in_every_epoch(tmp_path):
    """A plain validation loader's workers, persistent, carried on with no tie to the epoch (so a
    resumed run drew differently); then they followed the fit's epoch, while the data module's
    evaluation splits stay at epoch 0 (review 95). Every epoch's validation draws the same
    numbers, whether or not the workers persist (and validate after the fit: below)."""
    draws = {}
    for persistent in (False, True):
        model = _ValRecorder(persistent)
        make_trainer(tmp_path, max_epochs=3, num_sanity_val_steps=0,
                     callbacks=[FastDataCallback(print_report=False)]).fit(model)
        draws[persistent] = model.val
        del model
    assert draws[False] == draws[True]
    epochs = [tuple(draws[False][e]) for e in range(3)]
    assert len(epochs[0]) > 0 and len(set(epochs)) == 1, epochs


# --------------------------------------------------------------------------- found by the DDP/logging review


class EagerEpochBatchSampler(EpochBatchSampler):
    """Builds its epoch's batches when iterated, not lazily (a DataLoader's workers also read eagerly)."""

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        return iter([order[b * self.batch_size:(b + 1) * self.batch_size] for b in range(len(self))])


class _Orders(SpendingModel):
    """Records each step's (epoch, first feature of every sample)."""

    def __init__(self) -> None:
        super().__init__(Spend(0.0))
        self.orders: list[tuple[int, list[float]]] = []

    def training_step(self, batch, batch_idx):
        self.orders.append((self.current_epoch, [round(v, 5) for v in batch[0][:, 0].tolist()]))
        return super().training_step(batch, batch_idx)


def test_a_resumed_fit_gives_a_batch_sampler_its_epoch_before_the_first_iteration(tmp_path):
    # Lightning creates the iterator while it sets the loader up and, on a resume, not again:
    # set_epoch in the epoch hooks came too late, and the resumed epoch replayed epoch 0's order.
    def fit(epochs, ckpt=None):
        model = _Orders()
        t = make_trainer(tmp_path, max_epochs=epochs, num_sanity_val_steps=0,
                         callbacks=[FastDataCallback(print_report=False, log_memory=False)])
        t.fit(model, DataLoader(Vectors(16), batch_sampler=EagerEpochBatchSampler()), ckpt_path=ckpt)
        return t, model

    _, whole = fit(3)
    first, _ = fit(2)
    first.save_checkpoint(tmp_path / "end.ckpt")
    _, resumed = fit(3, str(tmp_path / "end.ckpt"))
    assert [o for e, o in resumed.orders] == [o for e, o in whole.orders if e == 2]
    assert [o for e, o in whole.orders if e == 2] != [o for e, o in whole.orders if e == 0]


def test_persistent_workers_of_an_iterable_dataset_get_each_epoch(tmp_path):
    # set_epoch reached the main process's copy of the dataset only: persistent workers kept
    # their epoch-0 copy and yielded the same order every epoch.
    model = Recording()
    loader = DataLoader(EpochStream(16), batch_size=4, num_workers=2, persistent_workers=True)
    make_trainer(tmp_path, max_epochs=3, num_sanity_val_steps=0,
                 callbacks=[FastDataCallback(print_report=False, log_memory=False)]).fit(model, loader)
    firsts = model.first_of_epoch
    assert len(firsts) == 3
    expected = [float(torch.randperm(16, generator=torch.Generator().manual_seed(e))[0]) for e in range(3)]
    assert firsts == expected


class _EpochFetch(L.Callback):
    """Makes every fetch of epoch e spend (1 + 2e) units of the fake clock."""

    def __init__(self, spend: Spend, unit: float) -> None:
        self.spend, self.unit = spend, unit

    def on_train_epoch_start(self, trainer, pl_module):
        self.spend.seconds = self.unit * (1 + 2 * trainer.current_epoch)


def test_a_logging_interval_across_an_epochs_end_averages_all_its_steps(tmp_path):
    # Steps after an epoch's last log were dropped at its end: the interval logged at step 7
    # averaged steps 6-7 only (and an epoch shorter than the interval was missing altogether).
    from _timing import FETCH, FakeClock

    clock = FakeClock()
    spend = Spend(FETCH, clock)
    logger = CSVLogger(str(tmp_path), name="interval", version=0)
    cb = FastDataCallback(clock=clock, print_report=False, log_memory=False)
    t = make_trainer(tmp_path, max_epochs=2, logger=logger, log_every_n_steps=4, num_sanity_val_steps=0,
                     callbacks=[_EpochFetch(spend, FETCH), cb])
    t.fit(SpendingModel(Spend(0.0)), loader(24, 4, spend))  # 6 steps an epoch
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    waits = {int(r["step"]): float(r["fastdata/data_wait_ms"]) for r in rows if r.get("fastdata/data_wait_ms")}
    ms = 1e3 * FETCH
    assert waits == {3: ms, 7: 2 * ms, 11: 3 * ms}  # steps 0-3, 4-7 (two of each epoch), 8-11


def test_a_callback_reused_for_a_second_fit_reports_that_fit(tmp_path):
    cb = FastDataCallback(print_report=False, log_memory=False)
    make_trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, callbacks=[cb]).fit(
        SpendingModel(Spend(0.0)), loader(16, 4, Spend(0.0)))
    logger = CSVLogger(str(tmp_path), name="second", version=0)
    make_trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0, callbacks=[cb], logger=logger).fit(
        SpendingModel(Spend(0.0)), loader(16, 4, Spend(0.0)))
    rep = cb.report()
    assert rep["steps"] == 4 and len(rep["stages"]["train"]["epochs"]) == 1  # not 12 steps over 3 epochs
    hparams = yaml.safe_load(open(Path(logger.log_dir) / "hparams.yaml"))
    assert hparams and any(k.startswith("fastdata") for k in hparams)  # the second fit's logger got the plan


class _Rank0Logger(L.Callback):
    """Keeps the loggers on rank 0 only, as people do to avoid duplicate runs in a tracker."""

    def setup(self, trainer, pl_module, stage):
        if trainer.global_rank != 0:
            trainer.loggers = []


@pytest.mark.slow
def test_ddp_with_a_logger_on_rank_0_only_does_not_hang(tmp_path, monkeypatch):
    # Only ranks with a logger took part in the per-interval reduction (a collective): the
    # ranks' collectives stopped matching and the fit hung until the process group's timeout.
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    (tmp_path / "spawn-tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "spawn-tmp"))
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    logger = CSVLogger(str(tmp_path), name="ddp", version=0)
    strategy = DDPStrategy(start_method="spawn", process_group_backend="gloo", timeout=timedelta(seconds=60))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=logger,
                        log_every_n_steps=2, callbacks=[_Rank0Logger(), FastDataCallback(print_report=False)],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=str(tmp_path))
    trainer.fit(SpendingModel(Spend(0.0)), loader(32, 4, Spend(0.0)))
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    assert len([r for r in rows if r.get("fastdata/data_wait_ms")]) == 2  # 4 steps per rank, every 2nd logged


# --------------------------------------------------------------------------- found by review 46


class _Runs(L.LightningModule):
    """Records the samples of every validation run (sanity check included), one list per run."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1))
        self.runs: list[list[float]] = []

    def training_step(self, batch, batch_idx):
        return self.p.sum()

    def on_validation_epoch_start(self) -> None:
        self.runs.append([])

    def validation_step(self, batch, batch_idx):
        self.runs[-1].extend(batch.tolist())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _Loaders(L.LightningDataModule):
    """Hands out the same loader objects at every call, as a user's module that builds them once may."""

    seed = 7

    def __init__(self, val: DataLoader, train: DataLoader | None = None) -> None:
        super().__init__()
        self.train, self.val = train, val

    def train_dataloader(self) -> DataLoader:
        return self.train

    def val_dataloader(self) -> DataLoader:
        return self.val


@pytest.mark.parametrize("sampler", ["sequential", "distributed"])
def test_a_validate_after_a_fit_draws_what_a_validate_on_a_fresh_trainer_draws(tmp_path, sampler):
    # The workers were seeded for the epoch the fit had reached (and, with a DistributedSampler,
    # followed the fit's progress that Lightning sets on it outside a fit), so a validate after
    # a fit drew other numbers than one on a fresh Trainer: docs/seeding.md promises the same.
    def val_loader() -> DataLoader:
        ds = _UserRandom()
        distributed = torch.utils.data.DistributedSampler(ds, 1, 0, shuffle=False)
        kw = {"sampler": distributed} if sampler == "distributed" else {}
        return DataLoader(ds, batch_size=2, num_workers=1, **kw)

    def fresh_validate() -> list[float]:
        model = _Runs()
        make_trainer(tmp_path, callbacks=[FastDataCallback(print_report=False)]).validate(
            model, _Loaders(val_loader()), verbose=False)
        return model.runs[-1]

    fresh = fresh_validate()
    assert fresh == fresh_validate()
    model, loaders = _Runs(), _Loaders(val_loader(), DataLoader(_UserRandom(), batch_size=2, num_workers=1))
    t = make_trainer(tmp_path, max_epochs=3, num_sanity_val_steps=0, callbacks=[FastDataCallback(print_report=False)])
    t.fit(model, loaders)
    assert model.runs[-1] == fresh  # evaluation stays at epoch 0 in a fit too
    t.validate(model, loaders, verbose=False)  # the fit's very loader objects
    assert model.runs[-1] == fresh
    t.validate(model, _Loaders(val_loader()), verbose=False)  # a new loader
    assert model.runs[-1] == fresh


def test_persistent_validation_workers_draw_the_same_at_every_run_of_an_epoch(tmp_path):
    # A persistent worker reseeded only when the epoch changed: the second validation run of an
    # epoch (and the first after a sanity check) continued its stream instead of drawing anew.
    def runs(persistent: bool, sanity: int) -> list[list[float]]:
        def loader() -> DataLoader:
            return DataLoader(_UserRandom(), batch_size=2, num_workers=1, persistent_workers=persistent)

        model = _Runs()
        make_trainer(tmp_path, max_epochs=2, val_check_interval=0.5, num_sanity_val_steps=sanity,
                     callbacks=[FastDataCallback(print_report=False)]).fit(model, _Loaders(loader(), loader()))
        return model.runs[1:] if sanity else model.runs

    reference = runs(False, 0)
    assert len(reference) == 4 and all(run == reference[0] for run in reference)  # every run, every epoch
    assert runs(True, 2) == reference


# ---------------------------------------------------------------------- review fixes: trace paths and windows


def test_a_fit_that_runs_no_step_of_the_trace_window_warns_and_leaves_no_older_trace(tmp_path):
    # A fit shorter than the window's start wrote nothing and said nothing, and a second fit left
    # the first one's trace.json in place while report()["trace"] was None.
    from _timing import COMPUTE, FETCH, FakeClock

    clock = FakeClock()
    path = tmp_path / "trace.json"
    cb = FastDataCallback(clock=clock, print_report=False, trace=path, trace_steps=(2, 3))
    make_trainer(tmp_path, callbacks=[cb]).fit(SpendingModel(Spend(COMPUTE, clock)), loader(40, 4, Spend(FETCH, clock)))
    assert json.loads(path.read_text())["otherData"]["steps"] == [2, 4]
    with pytest.warns(UserWarning, match=r"no training step in 2\.\.4 \(trace_steps=\(2, 3\)\) ran: this fit ran 2 "
                                         r"training steps; the trace was not written to .*trace\.json"):
        make_trainer(tmp_path, callbacks=[cb]).fit(SpendingModel(Spend(COMPUTE, clock)),
                                                   loader(8, 4, Spend(FETCH, clock)))
    assert not path.exists()  # the first fit's trace is not left to be taken for this one's
    assert cb.report()["trace"] is None and cb.report()["steps"] == 2


def test_a_trace_without_profiling_is_refused():
    with pytest.raises(ValueError, match=r"trace='t\.json' needs profile=True"):
        FastDataCallback(profile=False, trace="t.json")


@pytest.mark.parametrize("name, match", [
    ("", r"trace must be a file path, got '' \(an empty path\)"),
    ("traces/", r"trace must be a file path, got '.*traces/', which ends in a separator"),
    ("a_file/trace.json", r"trace='.*a_file/trace\.json' cannot be written: .*a_file is a file, not a directory"),
    ("a_file/deeper/trace.json", r"cannot be written: .*a_file is a file, not a directory"),
])
def test_a_trace_path_that_cannot_be_written_is_refused_at_construction(tmp_path, name, match):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match=match):
        FastDataCallback(trace=f"{tmp_path}/{name}" if name else "")


def test_a_trace_path_in_a_directory_this_process_cannot_write_is_refused(tmp_path, monkeypatch):
    import os

    # Faked: these tests may run as root, who may write anywhere.
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    with pytest.raises(ValueError, match=r"may not write in the directory .*; choose a writable location"):
        FastDataCallback(trace=tmp_path / "new" / "trace.json")


def test_a_trace_path_under_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # where a literal "~" folder was made
    cb = FastDataCallback(trace="~/traces/t.json", trace_steps=(0, 2), print_report=False)
    make_trainer(tmp_path, callbacks=[cb]).fit(SpendingModel(Spend(0.0)), loader(8, 4, Spend(0.0)))
    assert (tmp_path / "traces" / "t.json").exists() and not (tmp_path / "~").exists()
    assert cb.report()["trace"]["path"] == str(tmp_path / "traces" / "t.json")


def test_a_rank_above_zero_that_cannot_write_its_trace_says_so(tmp_path, monkeypatch):
    # Rank 1's trace.rank1.json could not be written, and its warning went through rank_zero_warn:
    # dropped on that rank, nobody was told. The rank is faked: this process plays rank 1.
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    monkeypatch.setattr(L.Trainer, "global_rank", property(lambda self: 1))
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    (tmp_path / "trace.rank1.json").mkdir()  # stands in for any write failure of that rank
    cb = FastDataCallback(trace=tmp_path / "trace.json", trace_steps=(0, 2), print_report=False)
    with pytest.warns(UserWarning, match=r"rank 1 could not write the trace to .*trace\.rank1\.json: "
                                         r".*training goes on without it"):
        make_trainer(tmp_path, callbacks=[cb]).fit(SpendingModel(Spend(0.0)), loader(8, 4, Spend(0.0)))
    assert not (tmp_path / "trace.json").exists()


@pytest.mark.parametrize("limits, ran", [
    (dict(limit_train_batches=0), 0), (dict(max_epochs=0), 0), (dict(max_steps=0), 0),
    (dict(limit_train_batches=2), 2),
])
def test_a_fit_that_trains_no_step_at_all_still_warns_that_no_trace_was_written(tmp_path, limits, ran):
    # Lightning skips on_train_end when the fit trains nothing: the warning, given there, was
    # never given (limit_train_batches=0, max_epochs=0, max_steps=0). Once, also where it was.
    import warnings

    path = tmp_path / "trace.json"
    cb = FastDataCallback(print_report=False, trace=path, trace_steps=(5, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, callbacks=[cb], **limits).fit(SpendingModel(Spend(0.0)), loader(12, 4, Spend(0.0)))
    said = [str(w.message) for w in caught if "no training step in 5..7" in str(w.message)]
    assert len(said) == 1, said
    assert f"this fit ran {ran} training steps; the trace was not written to {path}" in said[0]
    assert not path.exists() and cb.report()["trace"] is None

