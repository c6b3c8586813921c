"""examples/train.py: the LightningCLI example fits on the demo data from examples/config.yaml;
examples/imagenet_like/: generated JPEG photos of varying sizes fit through JPEG storage and the
size-fixing ops; examples/volumes/: generated NIfTI volumes load reoriented and resampled, cache compactly with their
field kinds, and the 3-D U-Net fits from its YAML and learns."""

from __future__ import annotations

import csv
import json
import os
import re
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
    (root / "cache").mkdir()  # the example's cache lives in the photos folder
    with pytest.raises(ValueError, match=r"drawn with .*'classes': 3.*not .*'classes': 2.*another root"):
        photos.write_photos(root, {"train": 3, "val": 1}, classes=2)
    assert (root / "cache").is_dir() and files[0].stat().st_mtime_ns == stamp
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a photos dataset"):
        photos.write_photos(tmp_path / "other", {"train": 1})
    assert (tmp_path / "other" / "keep.txt").exists()
    assert not list(tmp_path.glob(".*.tmp"))


def test_photos_an_empty_file_is_refused_by_the_store_naming_it(tmp_path):
    # read_bytes used torch.frombuffer, whose own "both buffer length (0) and count (-1) must not
    # be 0" came before the store's message that names the sample and the file.
    photos = _photos()
    root = photos.write_photos(tmp_path / "p", {"train": 2, "val": 1}, classes=2, sides=(40, 60))
    empty = sorted((root / "train").rglob("*.jpg"))[1]
    empty.write_bytes(b"")
    assert photos.read_bytes(str(empty)).shape == (0,)
    dm = photos.Photos(root=str(root), train_per_class=2, val_per_class=1, classes=2, sides=(40, 60),
                       cache_dir=str(tmp_path / "cache"), encode={"image": "jpeg"}, ragged=["image"], progress=False)
    with pytest.raises(Exception, match=r"(?s)empty.*" + re.escape(empty.name)):
        dm.prepare_data()
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.npy"))


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


def test_imagenet_like_refuses_a_model_with_another_number_of_classes(tmp_path):
    proc = _photos_cli(tmp_path, "--trainer.fast_dev_run=true", "--model.num_classes", "3")
    assert proc.returncode != 0
    assert "model.num_classes=3 but data.classes=2" in proc.stderr, proc.stderr[-2000:]


# --------------------------------------------------------------------------- examples/volumes

VOLUMES = ROOT / "examples" / "volumes"
sys.path.insert(0, str(VOLUMES))  # the example's modules import each other by name, as its train.py does

import make_volumes as MV  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from unet3d import UNet3D, soft_dice_loss  # noqa: E402
from volume_data import Volumes, load_case  # noqa: E402

try:
    import nibabel as nib
except ImportError:  # the example's extra: pip install .[volumes]
    nib = None
needs_nibabel = pytest.mark.skipif(nib is None, reason="the volumes example reads NIfTI with nibabel")

KINDS = {"image": "image", "label": "mask"}


def _dice(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(bool), b.astype(bool)
    return 2 * float((a & b).sum()) / max(1, int(a.sum() + b.sum()))


def _truth(seed: int, case: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The exact HU and mask of a generated case on the 1.5 mm grid, as (z, y, x) arrays."""
    g = (np.arange(size) + 0.5) * MV.NOMINAL_SPACING
    z, y, x = np.meshgrid(g, g, g, indexing="ij")
    return MV.render(MV.case_shapes(seed, case, size), x, y, z)


@needs_nibabel
def test_volumes_generator_writes_an_msd_layout(tmp_path):
    root = MV.make_volumes(tmp_path / "set", cases=3, size=16, seed=1)
    meta = json.loads((root / "dataset.json").read_text())
    assert meta["numTraining"] == 3 and len(meta["training"]) == 3
    for case in meta["training"]:
        img, lab = nib.load(root / case["image"]), nib.load(root / case["label"])
        assert img.get_data_dtype() == np.int16 and lab.get_data_dtype() == np.uint8
        assert nib.aff2axcodes(img.affine) == ("L", "P", "S")  # stored as scanners write it, not RAS
        zooms = img.header.get_zooms()
        assert zooms[2] >= 2.0 and zooms[0] < 1.0  # anisotropic, not the 1.5 mm of the target grid
        assert np.array_equal(img.affine, lab.affine) and img.shape == lab.shape
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]  # no temporary folder left
    MV.make_volumes(root, cases=3, size=16, seed=1)  # a complete set with the same parameters is kept
    with pytest.raises(ValueError, match="drawn with"):
        MV.make_volumes(root, cases=4, size=16, seed=1)
    with pytest.raises(ValueError, match="cases must be"):
        MV.make_volumes(tmp_path / "other", cases=1)


@needs_nibabel
def test_volumes_generator_never_writes_over_folders_it_did_not_leave(tmp_path):
    # root pointed at the user's own MSD-style data that lacks a dataset.json: their scans stay.
    root = tmp_path / "mine"
    for folder in ("imagesTr", "labelsTr"):
        (root / folder).mkdir(parents=True)
        (root / folder / "patient_7.nii.gz").write_bytes(b"the user's scan")
    with pytest.raises(ValueError, match="holds imagesTr and labelsTr but no dataset.json"):
        MV.make_volumes(root, cases=2, size=16)
    assert all((root / f / "patient_7.nii.gz").read_bytes() == b"the user's scan" for f in ("imagesTr", "labelsTr"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # refused before writing anything
    # Folders an interrupted run of the generator left (its marker beside them) are replaced.
    (root / MV.PARTIAL).touch()
    MV.make_volumes(root, cases=2, size=16)
    assert MV.is_complete(root) and not (root / MV.PARTIAL).exists()
    assert sorted(p.name for p in (root / "imagesTr").iterdir()) == ["case_000.nii.gz", "case_001.nii.gz"]


@needs_nibabel
def test_volumes_datamodule_refuses_a_generated_set_drawn_with_other_parameters(tmp_path):
    root = str(tmp_path / "set")
    assert len(Volumes(root=root, cases=3, val_cases=1, size=16).source("train")) == 2
    # --data.cases 4 on the folder of 3 generated cases: an error that says so, not 2 training cases.
    with pytest.raises(ValueError, match=r"drawn with \{'cases': 3, 'size': 16, 'seed': 0\}, not \{'cases': 4"):
        Volumes(root=root, cases=4, val_cases=1, size=16).source("train")
    with pytest.raises(ValueError, match="drawn with"):
        Volumes(root=root, cases=3, val_cases=1, size=16, data_seed=1).source("train")
    # generate=False takes the folder as it is; so does generate=True for a set it did not draw (an MSD task).
    assert len(Volumes(root=root, generate=False, cases=9, val_cases=1, size=16).source("train")) == 2
    meta = json.loads((tmp_path / "set" / "dataset.json").read_text())
    del meta["generator"], meta["parameters"]
    (tmp_path / "set" / "dataset.json").write_text(json.dumps(meta))
    assert len(Volumes(root=root, cases=9, val_cases=1, size=16).source("train")) == 2


@needs_nibabel
def test_volumes_static_transform_reorients_resamples_and_clips(tmp_path):
    size = 32
    root = MV.make_volumes(tmp_path / "set", cases=3, size=size, seed=0)
    for case in range(3):
        name = f"case_{case:03d}.nii.gz"
        out = load_case(root / "imagesTr" / name, root / "labelsTr" / name, size=(size,) * 3, hu_range=(-500, 500))
        assert out["image"].dtype == torch.int16 and out["label"].dtype == torch.uint8
        assert out["image"].shape == out["label"].shape == (1, size, size, size)
        assert int(out["image"].min()) >= -500 and int(out["image"].max()) <= 500
        hu, mask = _truth(0, case, size)
        got = out["label"][0].numpy()
        # On the exact grid: the mask lands where the lesions are (resampling blurs only the edges) ...
        assert _dice(got, mask) > 0.85, case
        # ... which it would not without the reorientation (the stored axes run right-to-left, front-to-back).
        assert _dice(got[:, ::-1, ::-1], mask) < 0.3, case
        assert np.corrcoef(out["image"][0].numpy().ravel(), np.clip(hu, -500, 500).ravel())[0, 1] > 0.9


@needs_nibabel
def test_volumes_static_transform_rejects_a_mask_off_the_grid_and_several_channels(tmp_path):
    root = MV.make_volumes(tmp_path / "set", cases=2, size=16)
    image = root / "imagesTr" / "case_000.nii.gz"
    lab = nib.load(root / "labelsTr" / "case_000.nii.gz")
    moved = tmp_path / "moved.nii.gz"
    nib.save(nib.Nifti1Image(np.asarray(lab.dataobj), lab.affine * np.diag([2.0, 1.0, 1.0, 1.0])), moved)
    with pytest.raises(ValueError, match="moved.nii.gz"):
        load_case(image, moved, size=(16,) * 3)
    two = tmp_path / "two_channels.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((*lab.shape, 2), np.int16), lab.affine), two)
    with pytest.raises(ValueError, match="two_channels.nii.gz has shape"):
        load_case(two, root / "labelsTr" / "case_000.nii.gz", size=(16,) * 3)


@needs_nibabel
def test_volumes_datamodule_caches_compact_fields_with_their_kinds(tmp_path):
    dm = Volumes(root=str(tmp_path / "set"), cases=5, val_cases=2, size=16, batch_size=2,
                 cache_dir=str(tmp_path / "cache"), field_kinds=KINDS, device="cpu", progress=False)
    dm.prepare_data()
    dm.setup("fit")
    for split, n in (("train", 3), ("val", 2)):
        store = dm.stores[split]
        assert len(store) == n
        assert [(i.name, np.dtype(i.dtype), i.shape) for i in store.infos] == [
            ("image", np.int16, (1, 16, 16, 16)), ("label", np.uint8, (1, 16, 16, 16))]
        assert dm.kinds(split) == KINDS
        files = dm.source_files(split)
        assert len(files) == 2 * n and all(Path(f).is_file() for f in files)
    assert set(dm.source_files("train")).isdisjoint(dm.source_files("val"))
    # The cache's fingerprint sees the NIfTI files: a changed training case rebuilds "train" only.
    before = {s: st.fingerprint for s, st in dm.stores.items()}
    dm.teardown("fit")
    touched = dm.source_files("train")[0]
    os.utime(touched, ns=(os.stat(touched).st_atime_ns, os.stat(touched).st_mtime_ns + 10**9))
    again = Volumes(root=str(tmp_path / "set"), cases=5, val_cases=2, size=16, batch_size=2,
                    cache_dir=str(tmp_path / "cache"), field_kinds=KINDS, device="cpu", progress=False)
    with pytest.warns(UserWarning, match="source files changed"):
        again.prepare_data()
    again.setup("fit")
    assert again.stores["train"].fingerprint != before["train"]
    assert again.stores["val"].fingerprint == before["val"]
    again.teardown("fit")
    assert dm.source("test") is None and dm.source_files("test") is None
    with pytest.raises(ValueError, match="val_cases"):
        Volumes(root=str(tmp_path / "set"), val_cases=0)
    missing = Volumes(root=str(tmp_path / "none"), generate=False)
    with pytest.raises(FileNotFoundError, match="dataset.json"):
        missing.source("train")


def test_unet3d_keeps_any_input_size_and_its_dice_loss_is_zero_when_exact():
    model = UNet3D(width=2, depth=2)
    assert model(torch.zeros(2, 1, 10, 12, 14)).shape == (2, 2, 10, 12, 14)
    target = torch.zeros(1, 4, 4, 4, dtype=torch.long)
    target[0, 1:3, 1:3, 1:3] = 1
    exact = torch.nn.functional.one_hot(target, 2).movedim(-1, 1).float() * 100
    assert float(soft_dice_loss(exact, target)) < 1e-3
    assert float(soft_dice_loss(-exact, target)) > 0.99
    with pytest.raises(ValueError, match="norm must be"):
        UNet3D(norm="group")


def _volumes_cli(tmp_path: Path, *extra: str, config: Path = VOLUMES / "config.yaml") -> subprocess.CompletedProcess:
    args = [sys.executable, str(VOLUMES / "train.py"), "fit", "--config", str(config),
            "--data.root", str(tmp_path / "data"), "--data.cache_dir", str(tmp_path / "cache"),
            "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar=false", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@needs_nibabel
def test_volumes_config_builds_kinds_augmentations_and_model(tmp_path):
    proc = _volumes_cli(tmp_path, "--print_config")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    conf = yaml.safe_load(proc.stdout)
    data = conf["data"]["init_args"]
    assert conf["data"]["class_path"] == "volume_data.Volumes" and conf["model"]["class_path"] == "unet3d.UNet3D"
    assert data["field_kinds"] == KINDS
    ops = [t["class_path"].rsplit(".", 1)[1] for t in data["train_augment"]["init_args"]["transforms"]]
    assert ops[0] == "RandomCropByLabel" and {"RandomFlip", "RandomRot90", "ScaleIntensityRange"} <= set(ops)
    assert not (tmp_path / "data").exists()  # printing the config writes no data


@pytest.mark.slow
@needs_nibabel
def test_volumes_fast_dev_run_fits(tmp_path):
    proc = _volumes_cli(tmp_path, "--data.cases", "4", "--data.val_cases", "1", "--data.size", "32",
                        "--trainer.fast_dev_run=true")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert MV.is_complete(tmp_path / "data")
    assert any((tmp_path / "cache").iterdir())


@pytest.mark.slow
@needs_nibabel
def test_volumes_example_learns_far_above_chance_on_the_cpu(tmp_path):
    """A few CPU epochs on tiny volumes: validation Dice far above chance (about the foreground share)."""
    conf = yaml.safe_load((VOLUMES / "config.yaml").read_text())
    crop = conf["data"]["init_args"]["train_augment"]["init_args"]["transforms"][0]
    assert crop["class_path"].endswith("RandomCropByLabel")
    crop["init_args"]["size"] = [24, 24, 24]  # of 32^3 volumes: keeps each step well under a second
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(conf))
    proc = _volumes_cli(tmp_path, "--data.cases", "18", "--data.val_cases", "2", "--data.size", "32",
                        "--data.batch_size", "4", "--trainer.max_epochs", "12",
                        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
                        "--trainer.logger.save_dir", str(tmp_path / "logs"), config=config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (metrics,) = (tmp_path / "logs").rglob("metrics.csv")
    with metrics.open() as f:
        dice = [float(r["val_dice"]) for r in csv.DictReader(f) if r.get("val_dice")]
    labels = [np.asarray(nib.load(f).dataobj) for f in sorted((tmp_path / "data" / "labelsTr").glob("*.nii.gz"))]
    chance = float(np.mean([lab.mean() for lab in labels]))  # Dice of a random guess at the foreground rate
    assert chance < 0.05
    assert len(dice) == 12 and dice[-1] > 0.5, (dice, chance)
