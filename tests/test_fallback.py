"""Out-of-memory fallback: device -> chunked -> workers, partial tensors freed, all ranks agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import TinyDataModule, TinyModel, trainer
from _jobs import free_port

import lightning_fastdata.placement as placement_module
from lightning_fastdata._util import fmt_bytes
from lightning_fastdata.placement import ChunkBuffers, ChunkedSource, HostSource, inject_faults, place
from lightning_fastdata.plan import Resources, decide, fall_back
from lightning_fastdata.store import Store

MB = 10**6


def stores() -> dict[str, Store]:
    rng = np.random.default_rng(0)
    return {split: Store.from_arrays((rng.integers(0, 256, (n, 3, 8, 8), dtype=np.uint8), np.arange(n)))
            for split, n in (("train", 100), ("val", 40))}


def device_plan(config: dict):
    res = Resources(2, 2, 10**9, 10**9, "cpu", 10**9, 10**9, 10**9, 1)
    return decide(sum(s.nbytes for s in stores().values()), res, config)


@pytest.fixture
def tracked(monkeypatch):
    """Weak references to every tensor the placement allocates."""
    refs: list[weakref.ref] = []
    real = placement_module.device_empty

    def tracking(*args, **kwargs):
        t = real(*args, **kwargs)
        refs.append(weakref.ref(t))
        return t

    monkeypatch.setattr(placement_module, "device_empty", tracking)
    return refs


def test_oom_midway_frees_the_partial_copies_and_falls_back_to_chunked(tracked):
    config = {"strategy": "auto", "batch_nbytes": 8 * 200}
    plan = device_plan(config)
    assert plan.strategy == "device"
    # Allocations: train image, train label, val image (fails) ...
    with inject_faults(oom_at=3) as faults, pytest.warns(RuntimeWarning) as warned:
        placement = place(stores(), plan, "cpu", config, {"train": 8, "val": 8})
        allocations = faults.count
    message = str(warned[0].message)
    assert "out of device memory placing device (needs 28.0 KB, 20.0 KB in complete splits" in message
    assert "falling back to strategy 'chunked' on every rank" in message
    assert placement.plan.strategy == "chunked"
    assert all(isinstance(s, ChunkedSource) for s in placement.sources.values())
    # 3 device allocations (the third failed), then 2 slots x 2 fields x 2 splits of chunk buffers
    assert set(placement.sources) == {"train", "val"} and allocations == 3 + 2 * 2 * 2
    device_copies = tracked[:2]  # the two complete train fields of the failed level
    assert all(ref() is None for ref in device_copies), "partial device copies are still alive"
    assert "needs 28.0 KB" in placement.plan.reasons["fallback"]
    assert placement.plan.reasons["strategy"] == "chunked: fallback from device"


def test_oom_on_both_levels_ends_on_workers(tracked):
    config = {"strategy": "auto", "batch_nbytes": 8 * 200}
    with inject_faults(oom_at={1, 4}), pytest.warns(RuntimeWarning) as warned:  # device 1st, chunked 3rd
        placement = place(stores(), device_plan(config), "cpu", config, {"train": 8, "val": 8})
    assert [str(w.message).split("; falling back to strategy ")[1][:9] for w in warned] == ["'chunked'", "'workers'"]
    # The chunked level's "needs" is what its buffers take (whole batches, at most a shard),
    # not two full chunks per split (the val split's chunks are smaller).
    chunk_bytes = fall_back(device_plan(config), "chunked", "test", config).chunk_bytes
    buffers = sum(ChunkBuffers.for_store(st, "cpu", chunk_bytes, 8).nbytes for st in stores().values())
    assert f"placing chunked (needs {fmt_bytes(buffers)}, " in str(warned[1].message)
    assert placement.plan.strategy == "workers"
    assert all(isinstance(s, HostSource) for s in placement.sources.values())
    assert all(ref() is None for ref in tracked)


def test_a_non_memory_error_is_raised_unchanged(tracked):
    config = {"strategy": "auto"}
    error = OSError(5, "Input/output error")
    with inject_faults(oom_at=2, error=error), pytest.raises(OSError) as raised:
        place(stores(), device_plan(config), "cpu", config, {"train": 8, "val": 8})
    assert raised.value is error


def test_fit_completes_after_an_injected_oom_with_the_same_batches(tmp_path):
    def run(**faults):
        dm = TinyDataModule(n=60, batch_size=8, strategy="device", cache_dir=str(tmp_path / "cache"), device="cpu")
        model = TinyModel(record=True)
        with inject_faults(**faults):
            trainer(tmp_path, max_epochs=2).fit(model, dm)
        return dm, model

    ref_dm, ref = run()
    with pytest.warns(RuntimeWarning, match="out of device memory placing device"):
        dm, model = run(oom_at=1)
    assert ref_dm.plan.strategy == "device" and dm.plan.strategy == "chunked"
    assert "fallback" in dm.plan.reasons and "fallback" in str(dm.plan)
    assert len(model.seen) == len(ref.seen) == 2 * 8
    for (x, y), (rx, ry) in zip(model.seen, ref.seen, strict=True):  # switching level keeps the data
        assert torch.equal(x, rx) and torch.equal(y, ry)


_RANK = textwrap.dedent("""
    import json, os, sys, warnings
    from datetime import timedelta
    import torch.distributed as dist
    from _helpers import TinyDataModule
    from lightning_fastdata.placement import inject_faults

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    dm = TinyDataModule(n=50, batch_size=8, cache_dir=sys.argv[1], device="cpu")
    with warnings.catch_warnings(record=True) as caught, inject_faults(oom_at=1 if rank == 1 else ()):
        warnings.simplefilter("always")
        dm.setup("fit")
    loader = dm.train_dataloader()
    labels = [int(v) for batch in loader for v in batch[1]]
    print(json.dumps({"strategy": dm.plan.strategy, "batches": len(loader), "labels": labels,
                      "warnings": [str(w.message) for w in caught if "falling back" in str(w.message)]}))
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_two_ranks_agree_when_one_runs_out_of_memory(tmp_path):
    cache = str(tmp_path / "cache")
    TinyDataModule(n=50, cache_dir=cache).prepare_data()  # one build, as Lightning does per node
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, cache], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert [r["strategy"] for r in results] == ["chunked", "chunked"]
    assert results[0]["batches"] == results[1]["batches"] == 4
    assert "rank 1: out of device memory placing device" in results[1]["warnings"][0]
    assert "rank 0: placed device, but another rank ran out of device memory" in results[0]["warnings"][0]
    assert len(results[0]["labels"]) == len(results[1]["labels"]) == 25  # equal shards of the 50
