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

from lightning_fastdata import autotune, host_memory
from lightning_fastdata import demo as demo_module
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
    measure_plain_workers,
    pick_workers,
    run_plain,
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
    # A result from before the last epoch's wait was kept shows its figure over every epoch, said so.
    assert "step time waiting for data (all epochs)" in table
    # A run that was not made is said so, not left out or guessed.
    table = format_table({**result, "fastdata_cached": None})
    assert "not measured" in next(line for line in table.splitlines() if line.startswith("whole fit, cache reused"))


def test_worker_counts_are_timed_in_turns_and_picked_by_median(tmp_path, monkeypatch):
    """Each candidate is timed 3 times, the candidates taking turns, and the pick is the highest
    median: one lucky timing (a quiet moment of a busy machine) no longer decides it."""
    path = make_dataset(tmp_path, 2, 1)
    # The rates the loader gets, call after call: 2 workers' first turn is a lucky spike.
    script = iter([1000.0, 1100.0, 2500.0, 1010.0, 1110.0, 900.0, 990.0, 1090.0, 950.0])
    monkeypatch.setattr(autotune, "time_loader", lambda *a, **k: autotune.LoaderTiming(next(script), 4, 1, 1))
    rates = measure_plain_workers(path, 4, [0, 1, 2])
    # Turns in rotation (0, 1, 2, 0, 1, 2, ...): a busy spell falls on every candidate, not on one.
    assert rates == {0: [1000.0, 1010.0, 990.0], 1: [1100.0, 1110.0, 1090.0], 2: [2500.0, 900.0, 950.0]}
    assert pick_workers(rates) == (1, None)  # the best single timing (2 workers' spike) would pick 2
    # Overlapping repeats are said to be within the noise, with the runner-up named.
    assert pick_workers({0: [1000.0, 1100.0, 1050.0], 1: [1080.0, 1120.0, 900.0], 2: [500.0]}) == (1, 0)
    with pytest.raises(ValueError, match="at least one repeat per candidate"):
        pick_workers({0: []})
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        measure_plain_workers(path, 4, [0], repeats=0)


def test_worker_measurement_times_real_loaders(tmp_path):
    path = make_dataset(tmp_path, 2, 1)
    rates = measure_plain_workers(path, 4, [0, 1], repeats=2)
    assert sorted(rates) == [0, 1] and all(len(v) == 2 and min(v) > 0 for v in rates.values())


def test_report_gives_medians_ranges_noise_and_load():
    result = {
        "epochs": 2,
        "cores": 2,
        "loadavg_before": [3.5, 2.0, 1.0],
        "loadavg_after": [1.25, 1.5, 1.0],
        "plain": _run(1.0, 3.0, data_wait_frac_last_epoch=0.05, measure_s=6.0,
                      workers_measured={"0": 1000.0, "1": 1100.0, "2": 700.0},
                      workers_repeats={"0": [900.0, 1000.0, 1200.0], "1": [1050.0, 1100.0, 1150.0],
                                       "2": [600.0, 700.0, 800.0]}),
        "fastdata": _run(0.5, 4.0, data_wait_frac_last_epoch=0.02, cache_build_s=2.5),
        "fastdata_cached": _run(0.5, 1.5, data_wait_frac_last_epoch=0.02),
    }
    table = format_table(result)
    assert ("median (range) of 3 turns taken in rotation: 0: 1,000 (900-1,200) / 1: 1,100 (1,050-1,150) / "
            "2: 700 (600-800); measured in 6.0 s") in table
    assert "1 and 0 workers are within the noise (their repeats overlap)" in table
    assert "load average (1/5/15 min): 3.50 2.00 1.00 before the demo, 1.25 1.50 1.00 after; busy" in table
    # The wait row is the last epoch's (as the epoch time), not the all-epochs figure.
    wait = next(line for line in table.splitlines() if line.startswith("step time waiting for data"))
    assert wait.split() == ["step", "time", "waiting", "for", "data", "(last", "epoch)", "5.0%", "2.0%"]
    # Repeats apart: no noise line; a quiet machine: no "busy".
    result["plain"]["workers_repeats"]["0"] = [900.0, 1000.0, 1040.0]
    table = format_table({**result, "loadavg_before": [0.5, 0.5, 0.5]})
    assert "within the noise" not in table and "busy" not in table


def test_wait_is_the_last_epochs(tmp_path, monkeypatch):
    """The wait figure shown next to the last epoch's time is that epoch's, not both epochs'."""
    profilers = []

    class Spy(demo_module.DataWaitProfiler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            profilers.append(self)

    monkeypatch.setattr(demo_module, "DataWaitProfiler", Spy)
    demo_module._quiet()
    out = run_plain(make_dataset(tmp_path, 2, 1), 2, 8, 0, tmp_path, 0)
    rep = profilers[0].report()
    epochs = rep["stages"]["train"]["epochs"]
    assert len(epochs) == 2
    assert out["data_wait_frac_last_epoch"] == epochs[-1]["data_wait_frac"]
    assert out["data_wait_frac"] == rep["data_wait_frac"]  # over every epoch, as earlier results had it


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
        assert 0.0 <= r["data_wait_frac"] < 1.0 and 0.0 <= r["data_wait_frac_last_epoch"] < 1.0
    assert "step time waiting for data (last epoch)" in proc.stdout
    # The plain run trains at the best median of the measured worker counts (3 turns each), and says which.
    plain = result["plain"]
    candidates = worker_candidates(cpu_count())
    repeats = {int(k): v for k, v in plain["workers_repeats"].items()}
    assert sorted(repeats) == candidates and all(len(v) == 3 for v in repeats.values())
    assert plain["workers_measured"] == {str(k): float(np.median(v)) for k, v in repeats.items()}
    best = str(pick_workers(repeats)[0])
    assert best == max(plain["workers_measured"], key=plain["workers_measured"].get)
    assert plain["num_workers"] == int(best) and plain["measure_s"] > 0
    assert "median (range) of 3 turns taken in rotation" in proc.stdout
    if hasattr(os, "getloadavg"):
        assert len(result["loadavg_before"]) == len(result["loadavg_after"]) == 3
        assert "load average (1/5/15 min): " in proc.stdout
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
