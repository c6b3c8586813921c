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


# ----------------------------------------------------------------------------- examples/imagenet_like

PHOTOS_DIR = ROOT / "examples" / "imagenet_like"


def _photos():
    sys.path.insert(0, str(PHOTOS_DIR))
    try:
        import photos
    finally:
        sys.path.remove(str(PHOTOS_DIR))
    return photos


def test_photos_are_jpegs_of_varying_sizes_written_once(tmp_path):
    from PIL import Image

    photos = _photos()
    root = photos.write_photos(tmp_path / "p", {"train": 3, "val": 1}, classes=3, sides=(200, 600))
    files = sorted(root.rglob("*.jpg"))
    assert len(files) == 3 * 4 and {f.parent.name for f in files} == {"class_0", "class_1", "class_2"}
    sizes = {Image.open(f).size for f in files}
    assert len(sizes) > 6 and all(200 <= s <= 600 for wh in sizes for s in wh)
    stamp = files[0].stat().st_mtime_ns
    assert photos.write_photos(root, {"train": 3, "val": 1}, classes=3) == root  # reused as is
    assert files[0].stat().st_mtime_ns == stamp
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a photos dataset"):
        photos.write_photos(tmp_path / "other", {"train": 1})
    assert (tmp_path / "other" / "keep.txt").exists()
    assert not list(tmp_path.glob(".*.tmp"))


def _photos_cli(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [
        sys.executable, str(PHOTOS_DIR / "train.py"), "fit", "--config", str(PHOTOS_DIR / "config.yaml"),
        "--data.root", str(tmp_path / "photos"), "--data.cache_dir", str(tmp_path / "cache"),
        "--data.train_per_class", "3", "--data.val_per_class", "2", "--data.classes", "2",
        "--data.batch_size", "4", "--model.num_classes", "2", "--model.width", "4",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar=false", *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_imagenet_like_config_names_the_jpeg_pipeline(tmp_path):
    proc = _photos_cli(tmp_path, "--print_config")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("photos.Photos", "photos.SmallNet", "lightning_fastdata.augment.RandomResizedCrop",
                 "lightning_fastdata.augment.Resize", "lightning_fastdata.augment.CenterCrop",
                 "max_side: 256", "image: jpeg"):
        assert name in proc.stdout, name


@pytest.mark.slow
def test_imagenet_like_fast_dev_run_fits_from_jpegs(tmp_path):
    proc = _photos_cli(tmp_path, "--trainer.fast_dev_run=true")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(list((tmp_path / "photos").rglob("*.jpg"))) == 2 * (3 + 2)
    assert any((tmp_path / "cache").iterdir())
