"""The demo: its generated PNG dataset (written once, atomically) and the end-to-end quick run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _helpers import run_demo
from PIL import Image

from lightning_fastdata import host_memory
from lightning_fastdata._util import cpu_count
from lightning_fastdata.demo import (
    CLASSES,
    SIZES,
    DemoCNN,
    DemoImages,
    dataset_dir,
    draw_image,
    format_table,
    is_complete,
    make_dataset,
    speedups,
    worker_candidates,
)

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def test_dataset_is_real_pngs_in_imagefolder_layout(tmp_path):
    path = make_dataset(tmp_path, train_per_class=3, val_per_class=2)
    assert path == dataset_dir(tmp_path, 3, 2)
    for split, per_class in (("train", 3), ("val", 2)):
        assert sorted(p.name for p in (path / split).iterdir()) == sorted(CLASSES)
        for name in CLASSES:
            files = sorted((path / split / name).glob("*.png"))
            assert len(files) == per_class
            for f in files:
                assert f.read_bytes()[:8] == PNG_MAGIC
                with Image.open(f) as im:
                    assert im.format == "PNG" and im.mode == "RGB" and im.size == (32, 32)
                    im.load()
    assert is_complete(path, 3, 2)


def test_dataset_is_reused_and_deterministic(tmp_path):
    path = make_dataset(tmp_path / "a", 2, 1)
    stamp = {p: p.stat().st_mtime_ns for p in path.rglob("*.png")}
    assert make_dataset(tmp_path / "a", 2, 1) == path
    assert {p: p.stat().st_mtime_ns for p in path.rglob("*.png")} == stamp  # not rewritten
    other = make_dataset(tmp_path / "b", 2, 1)
    for p in path.rglob("*.png"):
        q = other / p.relative_to(path)
        assert np.array_equal(np.asarray(Image.open(p)), np.asarray(Image.open(q)))


def test_incomplete_dataset_is_rebuilt(tmp_path):
    path = make_dataset(tmp_path, 2, 1)
    victim = path / "train" / CLASSES[3] / "00001.png"
    victim.unlink()
    assert not is_complete(path, 2, 1)
    assert make_dataset(tmp_path, 2, 1) == path
    assert victim.is_file() and is_complete(path, 2, 1)
    # A folder without the completion marker is never taken as complete.
    (path / "demo_dataset.json").unlink()
    assert not is_complete(path, 2, 1)


def test_classes_differ_and_drawing_is_seeded():
    a = np.asarray(draw_image(0, np.random.default_rng(1)))
    assert np.array_equal(a, np.asarray(draw_image(0, np.random.default_rng(1))))
    assert not np.array_equal(a, np.asarray(draw_image(1, np.random.default_rng(1))))
    with pytest.raises(ValueError, match="label must be in"):
        draw_image(len(CLASSES), np.random.default_rng(0))


def test_bad_sizes_name_the_parameter(tmp_path):
    with pytest.raises(ValueError, match="train_per_class"):
        make_dataset(tmp_path, 0, 1)
    with pytest.raises(ValueError, match="val_per_class"):
        DemoImages(root=str(tmp_path), val_per_class=-1)
    with pytest.raises(ValueError, match="width"):
        DemoCNN(width=0)


def test_worker_candidates_span_zero_to_cores():
    assert worker_candidates(0) == [0]
    assert worker_candidates(1) == [0, 1]
    assert worker_candidates(2) == [0, 1, 2]
    assert worker_candidates(6) == [0, 1, 2, 4, 6]
    assert worker_candidates(16) == [0, 1, 2, 4, 8, 16]
    with pytest.raises(ValueError, match="cores must be >= 0, got -1"):
        worker_candidates(-1)


def _run(epoch_s: float, whole_s: float, **extra) -> dict:
    return {"name": "x", "epoch_time_s": epoch_s, "samples_per_s": 1000 / epoch_s, "data_wait_frac": 0.1,
            "val_acc": 0.5, "whole_fit_s": whole_s, **extra}


def test_table_says_losses_as_plainly_as_wins():
    result = {
        "epochs": 2,
        "plain": _run(1.0, 3.0, workers_measured={"0": 900.0, "1": 1200.0, "2": 1100.0}, measure_s=1.5),
        "fastdata": _run(0.5, 4.0, cache_build_s=2.5),  # faster epochs, slower first whole fit
        "fastdata_cached": _run(0.5, 1.5),
    }
    assert speedups(result) == pytest.approx({"epoch_time": 2.0, "samples_per_s": 2.0,
                                              "whole_fit_first_run": 0.75, "whole_fit_cache_reused": 2.0})
    table = format_table(result)
    rows = {line.strip().split("  ")[0]: line for line in table.splitlines()}
    assert rows["epoch time (last, train+val)"].endswith("2.00x")
    assert rows["whole fit, first run"].endswith("0.75x (slower)")
    assert "2.500 s" in rows["of which prepare_data (cache build)"]
    assert rows["whole fit, cache reused"].endswith("2.00x")
    assert "0: 900 / 1: 1,200 / 2: 1,100; measured in 1.5 s" in table
    # A run that was not made is said so, not left out or guessed.
    table = format_table({**result, "fastdata_cached": None})
    assert "not measured" in next(line for line in table.splitlines() if line.startswith("whole fit, cache reused"))


@pytest.mark.slow
def test_killed_writer_leaves_no_complete_dataset(tmp_path):
    code = (
        "import sys; from lightning_fastdata.demo import make_dataset; "
        "make_dataset(sys.argv[1], 400, 100)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=_child_env())
    try:
        deadline = time.monotonic() + 60
        while not any(p.suffix == ".png" for p in tmp_path.rglob("*.png")):
            assert proc.poll() is None, "the writer finished before it could be killed"
            assert time.monotonic() < deadline, "the writer never started writing"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    final = dataset_dir(tmp_path, 400, 100)
    assert not final.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    # The next run sweeps the dead writer's temporary and writes a complete dataset.
    small = make_dataset(tmp_path, 2, 1)
    assert is_complete(small, 2, 1)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path):
    out = tmp_path / "result.json"
    data = tmp_path / "data"
    proc = run_demo(tmp_path, "--quick", "--data-dir", str(data), "--json-out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in ("epoch time", "samples/s", "waiting for data", "val accuracy", "speed-up",
                "whole fit, first run", "of which prepare_data (cache build)", "whole fit, cache reused"):
        assert row in proc.stdout, proc.stdout
    result = json.loads(out.read_text())
    chance = 1 / len(CLASSES)
    train_n = len(CLASSES) * SIZES["quick"][0]
    for run in ("plain", "fastdata", "fastdata_cached"):
        r = result[run]
        assert r["val_acc"] > 2.5 * chance, (run, r)
        assert r["samples"] == 2 * train_n
        assert r["epoch_time_s"] > 0 and r["samples_per_s"] > 0 and r["whole_fit_s"] > 0
        assert 0.0 <= r["data_wait_frac"] < 1.0
    # The plain run trains at the fastest of the measured worker counts, and says which.
    plain = result["plain"]
    candidates = worker_candidates(cpu_count())
    assert sorted(int(k) for k in plain["workers_measured"]) == candidates
    best = max(plain["workers_measured"], key=plain["workers_measured"].get)
    assert plain["num_workers"] == int(best) and plain["measure_s"] > 0
    assert f"best of {'/'.join(map(str, candidates))} workers: {best}" in plain["name"] in proc.stdout
    # The first fastdata run builds its cache inside its timed fit; the second reuses it.
    fast, cached = result["fastdata"], result["fastdata_cached"]
    assert fast["name"].startswith("fastdata") and fast["cache_built"] is True and not cached["cache_built"]
    assert 0 < fast["cache_build_s"] < fast["whole_fit_s"]
    assert result["speedups"]["whole_fit_first_run"] == pytest.approx(plain["whole_fit_s"] / fast["whole_fit_s"])
    assert result["speedups"]["whole_fit_cache_reused"] == pytest.approx(plain["whole_fit_s"] / cached["whole_fit_s"])
    assert result["quick"] is True and result["format"] == 2
    if result["device"] == "cpu" and host_memory._glibc() is not None:
        # Set before the plain run: every run has the same malloc (fastdata's setup sets it on a CPU run).
        assert result["host_memory"].startswith("freed memory kept for reuse"), result["host_memory"]
        assert f"every run with host memory: {result['host_memory']}" in proc.stdout
    assert list((data / "cache").iterdir()) == []  # the demo's cache folder is removed at exit
    png = next((dataset_dir(data, *SIZES["quick"]) / "val").rglob("*.png"))
    with Image.open(png) as im:
        assert im.format == "PNG"
    # The second demo reuses the dataset; --num-workers skips the measurement.
    proc = run_demo(tmp_path, "--quick", "--epochs", "3", "--num-workers", "0", "--data-dir", str(data))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "writing the demo dataset" not in proc.stdout
    assert "measuring the plain DataLoader" not in proc.stdout
    assert "plain DataLoader (0 workers, set by --num-workers)" in proc.stdout
    assert "val accuracy after 3 epochs" in proc.stdout


@pytest.mark.parametrize("epochs", ["1", "0"])
def test_fewer_than_two_epochs_are_refused(tmp_path, epochs):
    """With --epochs 1 the "last" epoch timed is the first: the plain side's worker start-up is in
    it and fastdata's set-up is not, so the comparison is refused before any run."""
    proc = run_demo(tmp_path, "--quick", "--epochs", epochs, "--data-dir", str(tmp_path / "data"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--epochs must be >= 2, got {epochs}: the epoch time reported is the last epoch's" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "data").exists()  # refused before any run


def test_bad_num_workers_is_refused(tmp_path):
    proc = run_demo(tmp_path, "--quick", "--num-workers", "-1", "--data-dir", str(tmp_path / "data"))
    assert proc.returncode == 2 and "--num-workers must be >= 0, got -1" in proc.stderr


def test_unusable_paths_are_refused_before_any_run(tmp_path):
    """A path the demo cannot write is an error naming its option at once, not a traceback
    (or, for --json-out, a failure after every run was made)."""
    (tmp_path / "afile").write_text("")
    for args, said in (
        (("--data-dir", "afile"), "--data-dir afile is a file, not a folder"),
        (("--json-out", "."), "--json-out . is a folder; give a file name"),
        (("--json-out", "afile/result.json"), "--json-out afile is a file, not a folder"),
    ):
        proc = run_demo(tmp_path, "--quick", *args)
        assert proc.returncode == 2 and said in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # no dataset written, no run made
