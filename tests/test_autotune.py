"""Auto-tuned loader parameters from injected resources, and ``num_workers="measure"``."""

from __future__ import annotations

import time

import pytest
from _helpers import TinyDataModule

from lightning_fastdata import autotune
from lightning_fastdata.autotune import measure_num_workers, shutdown_workers, time_loader
from lightning_fastdata.plan import Plan, Resources, decide

GB, MB = 1 << 30, 1 << 20


def res(**kw) -> Resources:
    """A CUDA node with plenty of everything unless told otherwise."""
    base = dict(physical_cores=2, logical_cores=2, ram_total=64 * GB, ram_available=48 * GB,
                device_type="cuda", device_total=80 * GB, device_free=79 * GB, shm_free=32 * GB,
                local_world_size=1)
    base.update(kw)
    return Resources(**base)


def workers_plan(r: Resources, **config) -> Plan:
    config.setdefault("strategy", "workers")
    return decide(100 * MB, r, config)


def test_two_cores_one_rank_leaves_one_core_to_the_main_process():
    p = workers_plan(res(physical_cores=2), batch_nbytes=1 * MB)
    assert p.num_workers == 1
    assert "2 physical cores / 1 local rank = 2 per rank, less one for the main process = 1" in p.reasons["num_workers"]
    assert p.pin_memory is True and "copied host-to-device" in p.reasons["pin_memory"]
    assert p.prefetch_factor == 2 and "2 batches in flight over 1 worker" in p.reasons["prefetch_factor"]
    assert p.persistent_workers is True and "across epochs" in p.reasons["persistent_workers"]


def test_64_cores_8_ranks_split_the_cores_between_ranks():
    node = res(physical_cores=64, logical_cores=128, local_world_size=8, ram_total=1024 * GB, ram_available=900 * GB)
    p = workers_plan(node, batch_nbytes=4 * MB)
    # Not the seed's 2-4 x 64 = 128-256 workers per rank (1024-2048 on the node).
    assert p.num_workers == 7
    assert "64 physical cores / 8 local ranks = 8 per rank" in p.reasons["num_workers"]
    assert p.prefetch_factor == 2 and p.persistent_workers is True


def test_one_core_loads_in_the_main_process():
    p = workers_plan(res(physical_cores=1, logical_cores=1))
    assert p.num_workers == 0 and p.prefetch_factor is None and p.persistent_workers is False
    assert "loaded in the main process" in p.reasons["num_workers"]
    assert "no worker processes" in p.reasons["prefetch_factor"]


def test_little_ram_caps_the_workers():
    # 2 GB available: half for workers = 1 GB; 512 MB + 2 x 64 MB = 640 MB per worker -> 1.
    p = workers_plan(res(physical_cores=64, ram_available=2 * GB), batch_nbytes=64 * MB)
    assert p.num_workers == 1
    assert "capped to 1 by RAM" in p.reasons["num_workers"]
    assert "640" in p.reasons["num_workers"] or "671" in p.reasons["num_workers"]  # the per-worker cost, in MB


def test_ram_is_shared_by_the_ranks_of_a_node():
    one = workers_plan(res(physical_cores=64, ram_available=16 * GB), batch_nbytes=64 * MB)
    eight = workers_plan(res(physical_cores=64, ram_available=16 * GB, local_world_size=8), batch_nbytes=64 * MB)
    # 8 GB for workers: 12 at two batches in flight (640 MB each), 14 at one (576 MB each).
    assert (one.num_workers, one.prefetch_factor) == (14, 1) and "by RAM" in one.reasons["num_workers"]
    assert eight.num_workers == 1 and "8 rank(s)" in eight.reasons["num_workers"]


def test_tiny_shm_means_no_workers_and_says_how_to_fix_it():
    # Docker's default 64 MB /dev/shm and an ImageNet-sized uint8 batch (256 x 3 x 224 x 224).
    p = workers_plan(res(physical_cores=8, shm_free=64 * MB), batch_nbytes=256 * 3 * 224 * 224)
    assert p.num_workers == 0
    why = p.reasons["num_workers"]
    assert "/dev/shm" in why and "--shm-size" in why and "bus error" in why
    assert p.prefetch_factor is None and p.persistent_workers is False


def test_small_shm_trades_prefetch_for_workers():
    # 64 MB, 8 MB batches, 2 of them held by the rank besides its workers' (the batch in use,
    # the next epoch's first): two in flight (x2 slack) allow 1 worker, one in flight allows 3.
    p = workers_plan(res(physical_cores=8, shm_free=64 * MB), batch_nbytes=8 * MB)
    assert (p.num_workers, p.prefetch_factor) == (3, 1)
    assert "one batch in flight per worker" in p.reasons["num_workers"]
    assert p.reasons["prefetch_factor"].startswith("1: /dev/shm")


def test_unknown_batch_size_is_assumed_and_said():
    p = workers_plan(res(physical_cores=8, shm_free=100 * MB))
    assert "assumed: batch size unknown" in p.reasons["num_workers"]


def test_no_gpu_means_no_pinned_memory():
    cpu = dict(device_type="cpu", device_total=64 * GB, device_free=48 * GB)
    p = workers_plan(res(physical_cores=4, **cpu), batch_nbytes=MB)
    assert p.num_workers == 3
    assert p.pin_memory is False and "training runs on the CPU" in p.reasons["pin_memory"]
    auto = decide(100 * MB, res(**cpu), {})
    assert auto.strategy == "device" and auto.pin_memory is False and auto.num_workers == 0


def test_device_resident_store_needs_no_pinning_nor_workers():
    p = decide(100 * MB, res(physical_cores=64), {})
    assert p.strategy == "device"
    assert p.pin_memory is False and "never cross the host-to-device link" in p.reasons["pin_memory"]
    assert p.num_workers == 0 and "main process" in p.reasons["num_workers"]


def test_chunked_on_cuda_pins_its_staging():
    p = decide(100 * MB, res(), {"strategy": "chunked"})
    assert p.pin_memory is True and p.num_workers == 0


def test_configured_values_win_and_the_reason_shows_the_auto_value():
    p = workers_plan(res(physical_cores=2), num_workers=6, pin_memory=False, prefetch_factor=4,
                     persistent_workers=False)
    assert (p.num_workers, p.pin_memory, p.prefetch_factor, p.persistent_workers) == (6, False, 4, False)
    assert p.reasons["num_workers"].startswith("6: set by configuration (auto would pick 1")
    assert p.reasons["pin_memory"] == "False: set by configuration"
    zero = workers_plan(res(), num_workers=0, persistent_workers=True)
    assert zero.persistent_workers is False and "has no effect" in zero.reasons["persistent_workers"]


def test_measure_proposes_candidates_up_to_the_auto_value():
    p = workers_plan(res(physical_cores=64, local_world_size=8, ram_available=900 * GB), num_workers="measure",
                     batch_nbytes=MB)
    assert p.num_workers_candidates == [0, 1, 3, 7] and p.num_workers == 7
    assert "until measured" in p.reasons["num_workers"]
    dev = decide(100 * MB, res(), {"num_workers": "measure"})
    assert dev.strategy == "device" and dev.num_workers_candidates == [] and dev.num_workers == 0


class _Sleepy:
    """A loader of ``n`` batches of 4 that sleeps ``delay`` seconds per batch."""

    def __init__(self, delay: float, n: int = 6) -> None:
        self.delay, self.n = delay, n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        import torch

        for _ in range(self.n):
            time.sleep(self.delay)
            yield torch.zeros(4, 2), torch.zeros(4)


def test_measure_keeps_the_fastest_candidate():
    r = res(physical_cores=8, device_type="cpu")
    config = {"strategy": "workers", "num_workers": "measure", "batch_nbytes": MB}
    plan = decide(100 * MB, r, config)
    assert plan.num_workers_candidates == [0, 1, 3, 7]
    delays = {0: 0.04, 1: 0.02, 3: 0.004, 7: 0.03}  # 3 workers is 5x faster than the next best
    seen = []

    def make(trial: Plan):
        seen.append((trial.num_workers, trial.persistent_workers))
        return _Sleepy(delays[trial.num_workers])

    rates = measure_num_workers(plan, r, config, make, batches=3, warmup=1)
    assert [nw for nw, _ in seen] == [0, 1, 3, 7]
    assert all(persistent is False for _, persistent in seen)  # trial workers do not linger
    assert set(rates) == {0, 1, 3, 7} and max(rates, key=rates.get) == 3
    assert plan.num_workers == 3 and plan.prefetch_factor == 2 and plan.persistent_workers is True
    assert plan.reasons["num_workers"].startswith("3: measured fastest")


def test_measure_prefers_fewer_workers_within_noise(monkeypatch):
    r = res(physical_cores=8, device_type="cpu")
    config = {"strategy": "workers", "num_workers": "measure"}
    plan = decide(100 * MB, r, config)
    fake = {0: 50.0, 1: 98.0, 3: 100.0, 7: 99.0}
    monkeypatch.setattr(autotune, "time_loader", lambda loader, *a, **k: (fake[loader], 1))
    measure_num_workers(plan, r, config, lambda trial: trial.num_workers)
    assert plan.num_workers == 1  # within 5% of the top: the fewest processes win


def test_time_loader_counts_samples_after_warmup():
    rate, samples, _, _ = time_loader(_Sleepy(0.001, n=10), batches=5, warmup=2)
    assert samples == 20 and rate > 0
    short_rate, short, _, _ = time_loader(_Sleepy(0.001, n=2), batches=5, warmup=3)
    assert short == 4 and short_rate > 0  # a short loader keeps one batch to time
    with pytest.raises(ValueError, match="could not time"):
        time_loader([], batches=2)


def test_time_loader_cycles_a_short_loader_to_time_the_batches_asked_for():
    """A 2-batch loader asked for 3 warm-up + 5 timed batches: without cycle one batch is timed
    (and the result says so); with cycle it is drawn over 4 passes and all 5 are timed."""
    short = time_loader(_Sleepy(0.0, n=2), batches=5, warmup=3)
    assert (short.batches, short.samples, short.passes) == (1, 4, 1)
    timing = time_loader(_Sleepy(0.0, n=2), batches=5, warmup=3, cycle=True)
    assert (timing.batches, timing.samples, timing.passes) == (5, 20, 4) and timing.samples_per_s > 0
    with pytest.raises(ValueError, match="could not time"):
        time_loader([], batches=2, cycle=True)  # an empty loader stops, it does not spin


def test_datamodule_measures_in_setup(cache_dir):
    dm = TinyDataModule(n=128, batch_size=16, strategy="workers", num_workers="measure",
                        cache_dir=str(cache_dir), device="cpu")
    dm.prepare_data()
    dm.setup("fit")
    assert dm.plan.num_workers in dm.plan.num_workers_candidates
    assert "measured fastest" in dm.plan.reasons["num_workers"]
    for nw in dm.plan.num_workers_candidates:
        assert f"{nw}: " in dm.plan.reasons["num_workers"]
    loader = dm.train_dataloader()
    assert sum(len(b[1]) for b in loader) == 128
    shutdown_workers(loader)


def test_datamodule_rejects_other_strings_for_num_workers():
    with pytest.raises(ValueError, match="num_workers must be 'auto', 'measure' or an int >= 0, got 'fast'"):
        TinyDataModule(num_workers="fast")
    with pytest.raises(ValueError, match="got -1"):
        TinyDataModule(num_workers=-1)


def test_a_dev_shm_of_two_batches_gets_no_worker():
    # Docker's 64 MB /dev/shm and 25 MB batches: the plan allowed 1 worker at prefetch 1 (2
    # batches); at the peak 4 sat there (the batch in use, the next epoch's first), and the
    # worker ran out of space in epoch 2, a hang.
    p = workers_plan(res(physical_cores=8, shm_free=64 * MB), batch_nbytes=25 * MB)
    assert p.num_workers == 0
    assert "less 2 x 26.2 MB (the batch in use, the next epoch's first)" in p.reasons["num_workers"]


def test_fewer_cores_than_ranks_and_an_unused_prefetch_are_said_as_they_are():
    p = workers_plan(res(physical_cores=3, local_world_size=8), batch_nbytes=MB)
    assert p.num_workers == 0
    assert p.reasons["num_workers"].startswith("0: 3 physical cores / 8 local ranks = 0.38 (fewer than one) per rank")
    q = workers_plan(res(physical_cores=1), batch_nbytes=MB, prefetch_factor=4)
    assert q.reasons["prefetch_factor"] == ("None: no worker processes (PyTorch requires None then) (the configured 4 "
                                            "has no effect)")
