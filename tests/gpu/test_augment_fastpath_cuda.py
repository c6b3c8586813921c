"""The crop/flip fast path on CUDA (no host sync branch): bit-equal to the CPU at the same keys."""

from __future__ import annotations

import pytest
import torch

from lightning_fastdata import augment as A
from lightning_fastdata.keys import SampleKeys

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_cuda_crop_flip_matches_cpu(dtype):
    x = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8).to(dtype)
    aug = A.Compose([A.RandomCrop(32, padding=4), A.RandomHorizontalFlip()])
    idx = torch.randperm(1000)[:64]
    out = aug(x.cuda(), SampleKeys(1, 0, idx.cuda()))
    assert out.is_cuda and torch.equal(out.cpu(), aug(x, SampleKeys(1, 0, idx)))
    flip = A.RandomHorizontalFlip()
    assert torch.equal(flip(x.cuda(), SampleKeys(2, 0, idx.cuda())).cpu(), flip(x, SampleKeys(2, 0, idx)))
