"""The crop/flip fast path on CUDA (no host sync branch): bit-equal to the CPU reference at the drawn parameters."""

from __future__ import annotations

import pytest
import torch

from lightning_fastdata import augment as A

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_cuda_crop_flip_matches_cpu_reference(dtype):
    x = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8).to(dtype)
    crop, flip = A.RandomCrop(32, padding=4), A.RandomHorizontalFlip()
    xc = x.cuda()
    out = A.Compose([crop, flip])(xc, torch.Generator(device="cuda").manual_seed(1))
    g = torch.Generator(device="cuda").manual_seed(1)
    oy, ox = crop.draw(xc, g)
    mask = flip.draw(64, xc.device, g)
    # the CPU path at the same parameters is tested against F.pad + slicing in test_augment_fastpath
    ref = A._window_crop(x, oy.cpu(), ox.cpu(), 32, 32, mask.cpu(), (4, 4), 0)
    assert out.is_cuda and torch.equal(out.cpu(), ref)
    flipped = flip(xc, torch.Generator(device="cuda").manual_seed(2))
    m = flip.draw(64, xc.device, torch.Generator(device="cuda").manual_seed(2)).cpu()
    assert torch.equal(flipped.cpu(), torch.stack([x[i].flip(-1) if m[i] else x[i] for i in range(64)]))
