"""No augmentation op makes the host wait for the device: every op, and a full pipeline, run
under ``torch.cuda.set_sync_debug_mode("error")`` (constants are cached on a first, warm-up call)."""

from __future__ import annotations

import pytest
import torch

from lightning_fastdata import augment as A
from lightning_fastdata.keys import SampleKeys

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _ops_2d():
    return [
        A.RandomCrop(24, padding=4), A.RandomHorizontalFlip(), A.RandomFlip((-2, -1)), A.RandomRot90(),
        A.RandomResizedCrop(20), A.RandomAffine(20, translate=(0.1, 0.1), scale=(0.9, 1.1), shear=5),
        A.RandomRotation(30, interpolation="bilinear"), A.ColorJitter(0.4, 0.4, 0.4), A.RandomErasing(p=0.5),
        A.RandomErasing(p=0.5, value="random"), A.GaussianNoise(), A.RandomApply([A.ColorJitter(0.5)], p=0.5),
        A.ToDtype("float32"), A.Normalize(MEAN, STD), A.ScaleIntensityRange(0, 255),
        A.RandomScaleIntensity(0.1, p=0.5), A.RandomShiftIntensity(0.1), A.RandomAdjustContrast(p=0.5),
        A.RandomCropByLabel(16, label="mask"),
        A.Compose([A.RandomResizedCrop(24), A.RandomHorizontalFlip(), A.ColorJitter(0.4, 0.4, 0.4),
                   A.Normalize(MEAN, STD)]),
        A.Compose([A.RandomCrop(24, padding=4), A.RandomHorizontalFlip(), A.Normalize(MEAN, STD)]),
    ]


def _ops_3d():
    return [
        A.RandomCrop((8, 12, 12), padding=2), A.RandomFlip((-3, -2, -1)), A.RandomRot90((-3, -1)),
        A.RandomAffine(20, translate=(0.1, 0.1, 0.1), scale=(0.9, 1.1), axes=(-3, -2, -1)),
        A.RandomCropByLabel((8, 8, 8), label="mask"),
        A.Compose([A.RandomCropByLabel(8, label="mask"), A.RandomFlip((-3, -2, -1)), A.RandomRot90(),
                   A.ScaleIntensityRange(-1000, 1000, clip=True), A.RandomScaleIntensity(0.1),
                   A.RandomShiftIntensity(0.1), A.RandomAdjustContrast(), A.GaussianNoise(clip=False),
                   A.RandomApply([A.RandomAffine(15)], p=0.5)]),
    ]


def _run_twice_second_strict(op, batch_fn):
    op(batch_fn(0))  # warm-up: per-(device, dtype) constants are made once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = op(batch_fn(1))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("op", _ops_2d(), ids=lambda o: type(o).__name__)
def test_2d_ops_never_sync(op):
    x = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8, device="cuda")
    mask = (x[:, 0] > 128).long()

    def batch(epoch):
        return A.Batch({"image": x, "mask": mask}, {"image": "image", "mask": "mask"},
                       SampleKeys(0, epoch, torch.arange(16, device="cuda")))

    out = _run_twice_second_strict(op, batch)
    assert out.fields["image"].is_cuda


@pytest.mark.parametrize("op", _ops_3d(), ids=lambda o: type(o).__name__)
def test_3d_ops_never_sync(op):
    vol = torch.randint(-1000, 1000, (2, 1, 16, 16, 16), dtype=torch.int16, device="cuda")
    lab = (vol > 300).to(torch.uint8)

    def batch(epoch):
        return A.Batch({"image": vol, "mask": lab}, {"image": "image", "mask": "mask"},
                       SampleKeys(0, epoch, torch.arange(2, device="cuda")))

    out = _run_twice_second_strict(op, batch)
    assert out.fields["image"].is_cuda
