"""The loader benchmark runs end to end in --quick mode and writes the documented JSON (no timing asserts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_loader_throughput_quick_writes_json(tmp_path):
    out = tmp_path / "loader_throughput.json"
    # torch creates its compile cache folder under TMPDIR unless told otherwise: keep it in
    # tmp_path. TMPDIR itself stays short: worker processes put Unix sockets there (108 chars).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "loader_throughput.py"), "--quick", "--threads", "1",
         "--workers", "0,1", "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| cifar | 1 |" in proc.stdout and "| imagenet | 1 |" in proc.stdout

    res = json.loads(out.read_text())
    assert res["meta"]["quick"] is True and res["meta"]["threads"] == [1]
    assert res["memcpy_gbps"] > 0
    assert set(res["shapes"]) == {"cifar", "imagenet"}
    for shape in res["shapes"].values():
        assert {"samples", "side", "batch_size", "sample_bytes", "memcpy", "by_threads"} <= set(shape)
        assert shape["memcpy"]["batch_gbps"] > 0
        r = shape["by_threads"]["1"]
        assert {"plain", "workers", "device", "raw_gather", "augment_us_per_sample",
                "speedup_device_vs_plain", "speedup_workers_vs_plain"} <= set(r)
        for key in ("plain", "workers"):
            assert set(r[key]["by_num_workers"]) == {"0", "1"}
            assert r[key]["best_num_workers"] in (0, 1)
        for key in ("plain", "workers", "device", "raw_gather"):
            assert r[key]["samples_per_s"] > 0 and len(r[key]["repeats"]) == res["meta"]["repeats"]
        assert {"gbps", "fraction_of_memcpy_store", "fraction_of_memcpy_batch"} <= set(r["raw_gather"])
    assert not list(tmp_path.glob(".tmp-*"))  # the JSON is published atomically


def test_loader_throughput_rejects_unknown_shape(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "loader_throughput.py"), "--shapes", "mnist"],
        env=dict(os.environ, PYTHONPATH=str(ROOT), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor")),
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and "unknown shape(s) ['mnist']" in proc.stderr
