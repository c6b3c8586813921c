"""examples/train.py: the LightningCLI example fits on the demo data from examples/config.yaml."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_fastdata.demo import dataset_dir, is_complete

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train.py"
CONFIG = ROOT / "examples" / "config.yaml"


def _cli(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [
        sys.executable,
        str(TRAIN),
        "fit",
        "--config",
        str(CONFIG),
        "--data.root",
        str(tmp_path / "data"),
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--data.train_per_class",
        "8",
        "--data.val_per_class",
        "4",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.enable_progress_bar=false",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_config_builds_the_augmentations_and_callback(tmp_path):
    proc = _cli(tmp_path, "--print_config")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for name in (
        "lightning_fastdata.demo.DemoImages",
        "lightning_fastdata.demo.DemoCNN",
        "lightning_fastdata.FastDataCallback",
        "lightning_fastdata.augment.Compose",
        "lightning_fastdata.augment.RandomCrop",
        "lightning_fastdata.augment.RandomHorizontalFlip",
        "lightning_fastdata.augment.Normalize",
    ):
        assert name in out, name
    assert "train_per_class: 8" in out


def test_config_rejects_a_bad_value(tmp_path):
    proc = _cli(tmp_path, "--data.vram_fraction", "1.5", "--trainer.fast_dev_run=true")
    assert proc.returncode != 0
    assert "vram_fraction" in proc.stderr


@pytest.mark.slow
def test_fast_dev_run_fits_on_demo_data(tmp_path):
    proc = _cli(tmp_path, "--trainer.fast_dev_run=true")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert is_complete(dataset_dir(tmp_path / "data", 8, 4), 8, 4)
    assert "strategy: device" in proc.stdout + proc.stderr
    assert any((tmp_path / "cache").iterdir())
