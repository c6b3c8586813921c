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

from lightning_fastdata.demo import (
    CLASSES,
    SIZES,
    DemoCNN,
    DemoImages,
    dataset_dir,
    draw_image,
    is_complete,
    make_dataset,
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
    proc = run_demo(tmp_path, "--quick", "--data-dir", str(tmp_path / "data"), "--json-out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in ("epoch time", "samples/s", "waiting for data", "val accuracy", "speed-up"):
        assert row in proc.stdout, proc.stdout
    result = json.loads(out.read_text())
    chance = 1 / len(CLASSES)
    train_n = len(CLASSES) * SIZES["quick"][0]
    for run in ("plain", "fastdata"):
        r = result[run]
        assert r["val_acc"] > 2.5 * chance, (run, r)
        assert r["samples"] == 2 * train_n
        assert r["epoch_time_s"] > 0 and r["samples_per_s"] > 0
        assert 0.0 <= r["data_wait_frac"] < 1.0
    assert result["fastdata"]["name"].startswith("fastdata")
    png = next((dataset_dir(tmp_path / "data", *SIZES["quick"]) / "val").rglob("*.png"))
    with Image.open(png) as im:
        assert im.format == "PNG"
    # The second run reuses the dataset and the cache: nothing is written again.
    proc = run_demo(tmp_path, "--quick", "--epochs", "1", "--data-dir", str(tmp_path / "data"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "writing the demo dataset" not in proc.stdout
    assert "val accuracy after 1 epochs" in proc.stdout
