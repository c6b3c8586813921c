"""Plan: the 60% VRAM rule, chunked vs device vs workers, forced strategies, fallback plans."""

from __future__ import annotations

import re

import numpy as np
import pytest
from _helpers import TinyDataModule

import lightning_fastdata.datamodule as dm_module
from lightning_fastdata.plan import (
    CHUNK_CAP_BYTES,
    VRAM_MARGIN_BYTES,
    PlanError,
    Resources,
    decide,
    fall_back,
    probe_resources,
)

GB = 10**9


def gpu(total: int = 80 * GB, free: int | None = None, ram: int = 512 * GB, cores: int = 16) -> Resources:
    """A CUDA rank with ``total`` bytes of VRAM (``free`` of them free, default all)."""
    return Resources(cores, 2 * cores, ram, ram, "cuda", total, total if free is None else free, 64 * GB, 1)


def cfg(**kw):
    return {"strategy": "auto", "vram_fraction": 0.6, "batch_nbytes": 256 * 3 * 32 * 32, **kw}


def test_small_vram_streams_in_chunks_large_vram_preloads():
    store = 20 * GB
    small, large = decide(store, gpu(total=16 * GB), cfg()), decide(store, gpu(total=80 * GB), cfg())
    assert small.strategy == "chunked" and large.strategy == "device"
    assert small.chunk_bytes == min(CHUNK_CAP_BYTES, int(0.6 * 16 * GB) // 4)
    assert "exceeds the budget 9.6 GB" in small.reasons["strategy"]
    assert "fits the budget 48.0 GB" in large.reasons["strategy"]
    assert small.chunk_mode == "global" and "global" in small.reasons["chunk_mode"]
    assert small.num_workers == 0 and large.num_workers == 0


@pytest.mark.parametrize("total", [16 * GB, 24 * GB + 7, 80 * GB])
def test_sixty_percent_rule_at_its_edge(total):
    edge = int(0.6 * total)
    assert decide(edge, gpu(total), cfg()).strategy == "device"
    assert decide(edge + 1, gpu(total), cfg()).strategy == "chunked"
    # The fraction is the user's: at 0.9 the same store fits again.
    assert decide(edge + 1, gpu(total), cfg(vram_fraction=0.9)).strategy == "device"


def test_budget_is_bounded_by_free_memory_less_a_margin():
    total, free = 80 * GB, 10 * GB  # another process holds most of the device
    edge = free - VRAM_MARGIN_BYTES
    plan = decide(edge, gpu(total, free), cfg())
    assert plan.strategy == "device"
    over = decide(edge + 1, gpu(total, free), cfg())
    assert over.strategy == "chunked"
    assert "free 10.0 GB less a 1.1 GB margin" in over.reasons["strategy"]


def test_a_chunk_holds_at_least_one_batch_and_a_store_is_at_least_four_chunks():
    big_batch = 512 * 3 * 224 * 224  # 77 MB, above the usual chunk cap
    plan = decide(100 * GB, gpu(total=80 * GB), cfg(batch_nbytes=big_batch))
    assert plan.strategy == "chunked" and plan.chunk_bytes == big_batch
    small = decide(40 * 10**6, gpu(total=80 * GB), cfg())  # fits: device, with a fallback chunk size kept
    assert small.strategy == "device" and small.chunk_bytes == 10**7


def test_workers_when_nothing_can_be_stored_or_a_chunk_cannot_hold_a_batch():
    plan = decide(None, gpu(), cfg())
    assert plan.strategy == "workers" and "cannot be stored" in plan.reasons["strategy"]
    # 2 GB of VRAM, all but the margin in use: the budget is 0.
    tiny = decide(10 * GB, gpu(total=2 * GB, free=VRAM_MARGIN_BYTES), cfg())
    assert tiny.strategy == "workers" and "cannot hold one batch" in tiny.reasons["strategy"]
    assert tiny.num_workers == 15  # 16 physical cores, one kept for the main process


@pytest.mark.parametrize("config, match", [
    # Each went through unchecked: -3 workers into the Plan, a ZeroDivisionError, "cannot convert float NaN
    # to integer", a fraction of 5, and a misspelled key silently ignored (the auto worker count used).
    (dict(strategy="workers", num_workers=-3), "num_workers must be 'auto', 'measure' or an int >= 0, got -3"),
    (dict(strategy="workers", num_workers=2, prefetch_factor=0),
     "prefetch_factor must be 'auto' or an int >= 1, got 0"),
    (dict(vram_fraction=float("nan")), r"vram_fraction must be in \(0, 1\], got nan"),
    (dict(vram_fraction=5), r"vram_fraction must be in \(0, 1\], got 5"),
    (dict(vram_fraction=True), r"vram_fraction must be in \(0, 1\], got True"),
    (dict(pin_memory="False"), "pin_memory must be 'auto', True or False, got 'False'"),
    (dict(num_workers="4"), "num_workers must be .* got '4'"),
    (dict(batch_nbytes=-1), "batch_nbytes must be None or an int >= 0"),
    (dict(strategy="workers", num_worker=4),
     r"unknown plan setting 'num_worker' \(did you mean 'num_workers'\?\); the settings are strategy, "
     r"vram_fraction, num_workers, pin_memory, prefetch_factor, persistent_workers, store, batch_nbytes"),
])
def test_decide_checks_its_config_and_names_the_setting(config, match):
    with pytest.raises(PlanError, match=match):
        decide(GB, cpu(), config)


def test_decide_takes_numpy_scalars_as_plain_values():
    config = dict(strategy="workers", vram_fraction=np.float32(0.5), num_workers=np.int64(1),
                  prefetch_factor=np.int64(3), pin_memory=np.bool_(False), persistent_workers=np.bool_(True),
                  batch_nbytes=np.int64(MiB))
    plan = decide(GB, cpu(), config)
    assert (plan.num_workers, plan.prefetch_factor, plan.persistent_workers) == (1, 3, True)
    assert type(plan.num_workers) is int and type(plan.prefetch_factor) is int and type(plan.pin_memory) is bool


def test_forced_strategies_that_cannot_work_give_numbers_and_fix():
    with pytest.raises(PlanError, match=r"needs 20.0 GB on the device, the budget is 9.6 GB .*raise vram_fraction"):
        decide(20 * GB, gpu(total=16 * GB), cfg(strategy="device"))
    with pytest.raises(PlanError, match=r"2 x 1.0 GB.*can only get 1.0 MB.*lower batch_size"):
        decide(20 * GB, gpu(total=2 * GB, free=VRAM_MARGIN_BYTES + (4 << 20)), cfg(strategy="chunked",
                                                                                  batch_nbytes=GB))
    with pytest.raises(PlanError, match="needs a stored dataset"):
        decide(None, gpu(), cfg(strategy="chunked"))
    with pytest.raises(PlanError, match="strategy must be one of"):
        decide(GB, gpu(), cfg(strategy="gpu"))
    forced = decide(GB, gpu(), cfg(strategy="chunked"))
    assert forced.strategy == "chunked" and forced.reasons["strategy"].startswith("forced")


def test_block_mode_when_the_store_exceeds_available_ram():
    r = Resources(8, 16, 64 * GB, 32 * GB, "cuda", 16 * GB, 16 * GB, GB, 1)
    assert decide(31 * GB, r, cfg()).chunk_mode == "global"
    plan = decide(33 * GB, r, cfg())
    assert plan.strategy == "chunked" and plan.chunk_mode == "block"
    assert "exceeds the 32.0 GB of RAM available" in plan.reasons["chunk_mode"]


def test_fall_back_lowers_one_level_keeps_the_numbers():
    c = cfg()
    plan = decide(5 * GB, gpu(total=16 * GB), c)
    assert plan.strategy == "device" and plan.chunk_bytes > 0
    chunked = fall_back(plan, "chunked", "out of memory (needs 5.0 GB)", c)
    assert chunked.strategy == "chunked" and chunked.chunk_bytes == plan.chunk_bytes
    assert chunked.reasons["fallback"] == "out of memory (needs 5.0 GB)"
    assert "fits the budget" in chunked.reasons["planned (device)"]
    workers = fall_back(chunked, "workers", "out of memory again", c)
    assert workers.strategy == "workers" and workers.num_workers == 15 and workers.chunk_bytes == 0
    with pytest.raises(ValueError, match="cannot fall back"):
        fall_back(workers, "device", "x", c)


@pytest.mark.parametrize("ram_total, expected", [(10**6, "chunked"), (10**9, "device")])
def test_datamodule_plan_uses_the_probe_and_prints_reasons_with_sizes(cache_dir, monkeypatch, ram_total, expected):
    # On a CPU run the "device" is RAM: inject a small or a large one through the probe.
    res = Resources(2, 2, ram_total, ram_total, "cpu", ram_total, ram_total, 10**9, 1)
    monkeypatch.setattr(dm_module, "probe_resources", lambda device, local_world_size=1: res)
    dm = TinyDataModule(n=4000, batch_size=100, cache_dir=str(cache_dir), device="cpu")  # 776 KB store
    dm.setup("fit")
    text = str(dm.plan)
    assert dm.plan.strategy == expected
    assert text.startswith(f"strategy: {expected}")
    assert re.search(r"store \d+\.\d [KM]B", text) and "60% of" in text
    if expected == "chunked":
        assert "chunk_bytes: " in text
        assert {s: type(src).__name__ for s, src in dm.placement.sources.items()} == {
            "train": "ChunkedSource", "val": "ChunkedSource"}
        assert type(dm.train_dataloader().source).__name__ == "ChunkedSource"
    else:
        assert {s: type(src).__name__ for s, src in dm.placement.sources.items()} == {
            "train": "DeviceSource", "val": "DeviceSource"}


def cpu(ram: int = 64 * GB, ranks: int = 1, cores: int = 16, shm: int = 64 * GB) -> Resources:
    """A CPU rank on a node with ``ram`` bytes of RAM shared by ``ranks`` local ranks."""
    return Resources(cores, 2 * cores, ram, ram, "cpu", ram, ram, shm, ranks)


def test_cpu_ranks_each_keep_a_copy_so_each_gets_its_share_of_the_budget():
    store = 20 * GB
    one, four = decide(store, cpu(ranks=1), cfg()), decide(store, cpu(ranks=4), cfg())
    assert one.strategy == "device"  # 20 GB within 60% of 64 GB
    assert four.strategy != "device"  # four copies of 20 GB do not fit 64 GB
    assert "/ 4 local ranks (each keeps its own copy)" in four.reasons["strategy"]
    # A GPU is one per rank: its budget is not divided.
    assert decide(store, Resources(16, 32, 512 * GB, 512 * GB, "cuda", 80 * GB, 80 * GB, 64 * GB, 4),
                  cfg()).strategy == "device"


@pytest.mark.parametrize("strategy", ["device", "chunked"])
def test_worker_settings_are_not_reported_in_force_where_no_worker_runs(strategy):
    store = 20 * GB if strategy == "device" else 60 * GB
    plan = decide(store, gpu(), cfg(strategy=strategy, num_workers=3, pin_memory=True, persistent_workers=True))
    assert plan.strategy == strategy
    assert plan.num_workers == 0 and "(the configured 3 has no effect)" in plan.reasons["num_workers"]
    assert plan.prefetch_factor is None and plan.persistent_workers is False
    if strategy == "device":
        assert plan.pin_memory is False and "no effect" in plan.reasons["pin_memory"]
    else:  # the chunked staging buffers are pinned
        assert plan.pin_memory is True


def test_a_configured_worker_count_gets_the_prefetch_its_own_count_affords():
    batch = 256 * 3 * 224 * 224  # 38.5 MB
    # /dev/shm holds 2 x 2 batches for 4 workers at one batch in flight each (plus the 2 a
    # rank holds besides): the auto count (15 workers by cores) needs one in flight, the
    # configured 2 workers afford two.
    r = cpu(shm=(4 * 2 + 2) * batch + 1)
    auto = decide(None, r, cfg(strategy="workers", batch_nbytes=batch))
    assert auto.prefetch_factor == 1
    two = decide(None, r, cfg(strategy="workers", num_workers=2, batch_nbytes=batch))
    assert two.num_workers == 2 and two.prefetch_factor == 2
    four = decide(None, r, cfg(strategy="workers", num_workers=4, batch_nbytes=batch))
    assert four.prefetch_factor == 1 and "one batch in flight" in four.reasons["prefetch_factor"]


def _cgroup_tree(tmp_path, proc: str, files: dict[str, str], monkeypatch) -> None:
    """A fake /proc/self/cgroup and cgroup hierarchy for the CPU quota."""
    from lightning_fastdata import _util

    (tmp_path / "proc").write_text(proc)
    for rel, text in files.items():
        (tmp_path / "cg" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "cg" / rel).write_text(text)
    monkeypatch.setattr(_util, "PROC_CGROUP", str(tmp_path / "proc"))
    monkeypatch.setattr(_util, "CGROUP_ROOT", str(tmp_path / "cg"))


@pytest.mark.parametrize("proc,files,cores", [
    ("0::/job\n", {"job/cpu.max": "50000 100000\n"}, 1),  # v2, a container's --cpus=0.5
    ("0::/job/step\n", {"job/cpu.max": "100000 100000\n", "job/step/cpu.max": "max 100000\n"}, 1),  # the parent's
    ("0::/job\n", {"job/cpu.max": "max 100000\n"}, None),  # no quota: the affinity mask
    ("4:cpu,cpuacct:/job\n", {"cpu,cpuacct/job/cpu.cfs_quota_us": "50000\n",
                               "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"}, 1),  # v1
    ("4:cpu,cpuacct:/job\n", {"cpu,cpuacct/job/cpu.cfs_quota_us": "-1\n",
                               "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"}, None),
])
def test_the_cores_a_plan_counts_respect_a_cgroup_cpu_quota(tmp_path, monkeypatch, proc, files, cores):
    # Only the affinity mask was read: a 64-core host running a --cpus=4 container got 63 workers.
    import os

    _cgroup_tree(tmp_path, proc, files, monkeypatch)
    allowed = len(os.sched_getaffinity(0))
    r = probe_resources("cpu")
    assert r.logical_cores == (cores if cores is not None else allowed)
    assert r.physical_cores <= r.logical_cores


def test_hyperthread_siblings_count_as_one_physical_core(tmp_path, monkeypatch):
    # psutil's node-wide physical count, capped by the logical CPUs of the mask, never removed
    # siblings: 8 cores x 2 threads in the mask gave 15 workers instead of 7.
    import os

    from lightning_fastdata import _util

    allowed = sorted(os.sched_getaffinity(0))
    for k, cpu in enumerate(allowed):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{k // 2}\n")  # pairs of siblings
    monkeypatch.setattr(_util, "CPU_TOPOLOGY", str(tmp_path))
    monkeypatch.setattr(_util, "PROC_CGROUP", str(tmp_path / "none"))
    assert probe_resources("cpu").physical_cores == (len(allowed) + 1) // 2


MiB = 1 << 20


@pytest.mark.parametrize("proc,files,limit,available", [
    # v2, docker --memory=1g: 300 MiB in use, 100 MiB of it inactive page cache (reclaimable).
    ("0::/job\n", {"job/memory.max": f"{1024 * MiB}\n", "job/memory.current": f"{300 * MiB}\n",
                   "job/memory.stat": f"anon {200 * MiB}\ninactive_file {100 * MiB}\n"}, 1024 * MiB, 824 * MiB),
    # The tightest on the path: the parent's limit binds, the step's own is "max".
    ("0::/job/step\n", {"job/memory.max": f"{512 * MiB}\n", "job/memory.current": f"{12 * MiB}\n",
                        "job/step/memory.max": "max\n", "job/step/memory.current": f"{2 * MiB}\n"},
     512 * MiB, 500 * MiB),
    # v1: memory.limit_in_bytes less memory.usage_in_bytes in the memory controller's mount.
    ("5:memory:/job\n", {"memory/job/memory.limit_in_bytes": f"{768 * MiB}\n",
                         "memory/job/memory.usage_in_bytes": f"{68 * MiB}\n"}, 768 * MiB, 700 * MiB),
])
def test_ram_is_capped_by_the_containers_memory_limit(tmp_path, monkeypatch, proc, files, limit, available):
    # Only the host's /proc/meminfo was read: a --memory=1g container on a 25 GB host planned an
    # 8.6 GB store into "RAM" (strategy device on the CPU), which the kernel's OOM killer ends.
    _cgroup_tree(tmp_path, proc, files, monkeypatch)
    r = probe_resources("cpu")
    assert (r.ram_total, r.ram_available) == (limit, available)
    assert (r.device_total, r.device_free) == (limit, available)  # on the CPU the device is that RAM
    assert r.ram_limit == limit
    plan = decide(8 << 30, r, cfg(batch_nbytes=MiB))
    assert plan.strategy == "chunked"
    assert "RAM (the container's memory limit)" in plan.reasons["strategy"]


@pytest.mark.parametrize("proc,files", [
    ("0::/job\n", {"job/memory.max": "max\n", "job/memory.current": f"{300 * MiB}\n"}),
    ("5:memory:/job\n", {"memory/job/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
                         "memory/job/memory.usage_in_bytes": f"{68 * MiB}\n"}),
])
def test_no_container_memory_limit_leaves_the_nodes_ram(tmp_path, monkeypatch, proc, files):
    import psutil

    _cgroup_tree(tmp_path, proc, files, monkeypatch)
    r = probe_resources("cpu")
    assert r.ram_limit == 0 and r.ram_total == psutil.virtual_memory().total


@pytest.mark.parametrize("strategy", ["chunked", "workers"])
def test_a_configured_pin_memory_has_no_effect_on_a_cpu_run_and_the_plan_says_so(strategy):
    # The plan said "True: set by configuration" while nothing was pinned (the chunked loader pins
    # only for CUDA); the workers' DataLoader then pinned batches for a CPU model.
    plan = decide(60 * GB, cpu(ram=64 * GB), cfg(strategy=strategy, pin_memory=True))
    assert plan.strategy == strategy and plan.pin_memory is False
    assert plan.reasons["pin_memory"].startswith("False:")
    assert "(the configured True has no effect: training runs on the CPU)" in plan.reasons["pin_memory"]
    assert decide(60 * GB, gpu(total=16 * GB), cfg(strategy=strategy, pin_memory=True)).pin_memory is True


def test_a_cpu_workers_plan_reaches_the_dataloader_unpinned(cache_dir):
    dm = TinyDataModule(n=64, batch_size=16, cache_dir=str(cache_dir), device="cpu", strategy="workers",
                        num_workers=0, pin_memory=True)
    dm.setup("fit")
    try:
        assert dm.plan.pin_memory is False
        assert dm.train_dataloader().dataloader.pin_memory is False  # the torch DataLoader inside
    finally:
        dm.teardown("fit")


def test_store_false_is_told_apart_from_samples_that_cannot_be_stored():
    # Both read "samples cannot be stored", which sent a user who chose store=False hunting for
    # a bad sample.
    assert decide(None, cpu(), cfg(store=False)).reasons["strategy"] == (
        "store=False: per-sample loading in DataLoader workers")
    assert decide(None, cpu(), cfg()).reasons["strategy"].startswith("samples cannot be stored")
    with pytest.raises(PlanError, match="store=False; set store=True or use strategy='workers'"):
        decide(None, cpu(), cfg(strategy="device", store=False))
