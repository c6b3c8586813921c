"""The batched augmentations on CUDA: same results as on the CPU for the same parameters."""

from __future__ import annotations

import pytest
import torch

from lightning_fastdata import augment as A

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _batch(dtype: torch.dtype) -> torch.Tensor:
    x = torch.randint(
        0, 256, (6, 3, 24, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    return x if dtype == torch.uint8 else x.to(dtype) / 255


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_fixed_parameters_give_the_cpu_result(dtype):
    x = _batch(dtype)
    xc = x.cuda().contiguous(memory_format=torch.channels_last)
    tol = 1.0 if dtype == torch.uint8 else 1e-4
    rrc = A.RandomResizedCrop(16)
    box = rrc.draw(6, 24, 24, torch.device("cpu"), torch.Generator().manual_seed(1))
    out = rrc.apply(xc, *(b.cuda() for b in box))
    assert (
        out.is_cuda and out.dtype == dtype and out.is_contiguous(memory_format=torch.channels_last)
    )
    assert (out.cpu().double() - rrc.apply(x, *box).double()).abs().max() <= tol
    aff = A.RandomAffine(
        30, translate=(0.1, 0.1), scale=(0.8, 1.2), shear=8, interpolation="bilinear"
    )
    p = aff.draw(6, 24, 24, torch.device("cpu"), torch.Generator().manual_seed(2))
    out = aff.apply(xc, **{k: v.cuda() for k, v in p.items()})
    assert (out.cpu().double() - aff.apply(x, **p).double()).abs().max() <= tol
    cj = A.ColorJitter(0.4, 0.4, 0.4)
    order, factors = cj.draw(6, torch.device("cpu"), torch.Generator().manual_seed(3))
    out = cj.apply(xc, order.cuda(), factors.cuda())
    assert (out.cpu().double() - cj.apply(x, order, factors).double()).abs().max() <= tol


@pytest.mark.parametrize(
    "op",
    [
        A.RandomResizedCrop(16),
        A.RandomAffine(20),
        A.RandomRotation(20),
        A.ColorJitter(0.4, 0.4, 0.4),
        A.RandomErasing(p=1.0),
        A.GaussianNoise(),
        A.RandomApply([A.ColorJitter(0.5)], p=0.5),
    ],
    ids=lambda o: type(o).__name__,
)
def test_ops_run_on_cuda_from_a_cuda_generator(op):
    x = _batch(torch.uint8).cuda()
    state = torch.cuda.get_rng_state()
    a = op(x, torch.Generator(device="cuda").manual_seed(4))
    b = op(x, torch.Generator(device="cuda").manual_seed(4))
    assert a.is_cuda and torch.equal(a, b)
    assert torch.equal(torch.cuda.get_rng_state(), state)
