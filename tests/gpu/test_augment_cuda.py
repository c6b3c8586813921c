"""The batched augmentations on CUDA: the same keys give the CPU's draws, and at the same
parameters the CPU's output (integer ops bit for bit, interpolating ops within rounding)."""

from __future__ import annotations

import pytest
import torch

from lightning_fastdata import augment as A
from lightning_fastdata.keys import SampleKeys

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _batch(dtype: torch.dtype) -> torch.Tensor:
    x = torch.randint(0, 256, (6, 3, 24, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    return x if dtype == torch.uint8 else x.to(dtype) / 255


def _keys(device: str) -> SampleKeys:
    return SampleKeys(3, 1, torch.tensor([5, 900, 2, 77, 13, 2**40], device=device))


def test_keys_draw_the_same_numbers_on_cuda_and_cpu():
    cpu, cuda = _keys("cpu"), _keys("cuda")
    assert torch.equal(cuda.bits(2, 5).cpu(), cpu.bits(2, 5))
    assert torch.equal(cuda.child(1).uniform(0, 3).cpu(), cpu.child(1).uniform(0, 3))
    assert torch.equal(cuda.uniform(4, dtype=torch.float64).cpu(), cpu.uniform(4, dtype=torch.float64))
    assert torch.equal(cuda.randint(5, 0, torch.full((6,), 17, device="cuda")).cpu(),
                       cpu.randint(5, 0, torch.full((6,), 17)))
    assert torch.allclose(cuda.normal(6, (4, 4)).cpu(), cpu.normal(6, (4, 4)), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_fixed_parameters_give_the_cpu_result(dtype):
    x = _batch(dtype)
    xc = x.cuda().contiguous(memory_format=torch.channels_last)
    tol = 1.0 if dtype == torch.uint8 else 1e-4
    for op in (A.RandomResizedCrop(16),
               A.RandomAffine(30, translate=(0.1, 0.1), scale=(0.8, 1.2), shear=8, interpolation="bilinear"),
               A.ColorJitter(0.4, 0.4, 0.4)):
        p = op.draw(x, _keys("cpu"))
        pc = op.draw(xc, _keys("cuda"))
        for k, v in p.items():
            assert torch.allclose(pc[k].cpu().double(), v.double()), (op, k)
        out = op.apply(xc, **pc)
        assert out.is_cuda and out.dtype == dtype and out.is_contiguous(memory_format=torch.channels_last)
        assert (out.cpu().double() - op.apply(x, **p).double()).abs().max() <= tol, op


@pytest.mark.parametrize("op", [A.RandomCrop(16, padding=2), A.RandomFlip((-2, -1)), A.RandomRot90(),
                                A.RandomCropByLabel(12, label="mask")], ids=lambda o: type(o).__name__)
def test_exact_ops_equal_the_cpu_bit_for_bit(op):
    x = _batch(torch.uint8)
    mask = (x[:, 0] > 128).long()
    cpu = A.Batch({"image": x, "mask": mask}, {"image": "image", "mask": "mask"}, _keys("cpu"))
    cuda = A.Batch({"image": x.cuda(), "mask": mask.cuda()}, {"image": "image", "mask": "mask"}, _keys("cuda"))
    a, b = op(cpu), op(cuda)
    for name in ("image", "mask"):
        assert torch.equal(b.fields[name].cpu(), a.fields[name]), (op, name)


def test_volumes_on_cuda():
    vol = torch.randint(-1000, 1000, (2, 1, 16, 16, 16), dtype=torch.int16).cuda()
    lab = (vol > 500).to(torch.uint8)
    batch = A.Batch({"image": vol, "label": lab}, {"image": "image", "label": "mask"},
                    SampleKeys(0, 0, torch.arange(2, device="cuda")))
    aug = A.Compose([A.RandomCropByLabel(8), A.RandomFlip((-3, -2, -1)), A.RandomRot90(),
                     A.RandomAffine(90, axes=(-3,)), A.ScaleIntensityRange(-1000, 1000, clip=True),
                     A.RandomScaleIntensity(0.1), A.RandomAdjustContrast(), A.GaussianNoise(clip=False)])
    out = aug(batch)
    assert out.fields["image"].is_cuda and out.fields["image"].shape == (2, 1, 8, 8, 8)
    assert out.fields["label"].dtype == torch.uint8
