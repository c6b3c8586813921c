"""The fused crop/flip fast path: bit-identical to the unfused ops and to torchvision per sample."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchvision.transforms.v2 import functional as TF

from lightning_fastdata import augment as A


def _batch(shape, dtype=torch.uint8, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, dtype=dtype, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def _reference_crop(x, oy, ox, size, padding, fill, flip=None):
    """F.pad, then one slice per sample (and a mirror): the plain, obviously right version."""
    (th, tw), (py, px) = size, padding
    n, mid = x.shape[0], x.shape[1:-2]
    xp = F.pad(x.reshape(n, -1, x.shape[-2], x.shape[-1]), [px, px, py, py], value=fill)
    out = []
    for i in range(n):
        c = xp[i, :, oy[i]:oy[i] + th, ox[i]:ox[i] + tw]
        out.append(c.flip(-1) if flip is not None and flip[i] else c)
    return torch.stack(out).view(n, *mid, th, tw)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 3, 10, 12), (5, 2, 3, 6, 5), (4, 1, 4, 4)])
@pytest.mark.parametrize("padding", [(0, 0), (2, 1), (3, 3)])
def test_random_crop_matches_pad_then_slice(dtype, shape, padding):
    x = _batch(shape, dtype)
    h, w = shape[-2], shape[-1]
    size = (h - 1, max(1, w - 2))
    crop = A.RandomCrop(size, padding=padding, fill=7)
    g = torch.Generator().manual_seed(1)
    out = crop(x, g)
    oy, ox = crop.draw(x, torch.Generator().manual_seed(1))
    assert out.dtype == x.dtype
    assert torch.equal(out, _reference_crop(x, oy, ox, size, padding, 7))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
@pytest.mark.parametrize("size,padding", [((32, 32), (4, 4)), ((6, 8), (0, 0)), ((10, 9), (2, 3))])
def test_fused_crop_flip_equals_unfused_sequence(dtype, size, padding):
    """Compose fuses crop + flip; same generator, same draws, bit-equal output."""
    x = _batch((33, 3, 32, 32) if size == (32, 32) else (17, 2, 10, 11), dtype, seed=2)
    crop, flip = A.RandomCrop(size, padding=padding), A.RandomHorizontalFlip()
    fused = A.Compose([crop, flip])(x, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    unfused = flip(crop(x, g), g)
    assert torch.equal(fused, unfused)
    # and both equal the plain per-sample reference at the drawn parameters
    g = torch.Generator().manual_seed(5)
    oy, ox = crop.draw(x, g)
    mask = flip.draw(x.shape[0], x.device, g)
    assert torch.equal(fused, _reference_crop(x, oy, ox, size, padding, 0, mask))


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0])
def test_flip_matches_per_sample_mirror(p):
    x = _batch((20, 3, 5, 7), seed=3)
    out = A.RandomHorizontalFlip(p)(x, torch.Generator().manual_seed(4))
    mask = A.RandomHorizontalFlip(p).draw(20, x.device, torch.Generator().manual_seed(4))
    expected = torch.stack([x[i].flip(-1) if mask[i] else x[i] for i in range(20)])
    assert torch.equal(out, expected)
    assert out.data_ptr() != x.data_ptr()  # a new tensor, never the input or a scratch buffer


def test_crop_flip_equals_torchvision_functional_per_sample():
    """At fixed parameters, each sample equals torchvision v2 pad -> crop -> hflip."""
    x = _batch((16, 3, 32, 32), seed=6)
    g = torch.Generator().manual_seed(7)
    crop, flip = A.RandomCrop(32, padding=4), A.RandomHorizontalFlip()
    out = A.Compose([crop, flip])(x, g)
    g = torch.Generator().manual_seed(7)
    oy, ox = crop.draw(x, g)
    mask = flip.draw(16, x.device, g)
    for i in range(16):
        ref = TF.crop(TF.pad(x[i], [4], fill=0), int(oy[i]), int(ox[i]), 32, 32)
        if mask[i]:
            ref = TF.horizontal_flip(ref)
        assert torch.equal(out[i], ref), f"sample {i}"


def test_channels_last_input_keeps_format_and_values():
    x = _batch((6, 3, 9, 9), seed=8).contiguous(memory_format=torch.channels_last)
    aug = A.Compose([A.RandomCrop(8, padding=2), A.RandomHorizontalFlip()])
    out = aug(x, torch.Generator().manual_seed(9))
    ref = aug(x.contiguous(), torch.Generator().manual_seed(9))
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, ref)
    flipped = A.RandomHorizontalFlip()(x, torch.Generator().manual_seed(9))
    assert flipped.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(flipped, A.RandomHorizontalFlip()(x.contiguous(), torch.Generator().manual_seed(9)))


def test_outputs_survive_later_calls():
    """The padded source lives in a reused scratch buffer; returned batches must not alias it."""
    crop = A.RandomCrop(8, padding=3)
    x1, x2 = _batch((5, 3, 8, 8), seed=10), _batch((7, 3, 8, 8), seed=11)
    out1 = A.Compose([crop, A.RandomHorizontalFlip()])(x1, torch.Generator().manual_seed(1))
    keep = out1.clone()
    for seed in range(3):  # other shapes, dtypes and fills reuse and regrow the buffer
        A.RandomCrop(8, padding=3, fill=255)(x2, torch.Generator().manual_seed(seed))
        A.RandomCrop(4, padding=1)(x2.float(), torch.Generator().manual_seed(seed))
        A.RandomHorizontalFlip()(x2, torch.Generator().manual_seed(seed))
    assert torch.equal(out1, keep)
    again = A.Compose([crop, A.RandomHorizontalFlip()])(x1, torch.Generator().manual_seed(1))
    assert torch.equal(again, keep)


def test_gather_crop_on_prepadded_input_unchanged():
    x = _batch((4, 3, 6, 6), seed=12)
    oy, ox = torch.tensor([0, 1, 2, 0]), torch.tensor([1, 0, 1, 0])
    mask = torch.tensor([True, False, True, False])
    out = A._gather_crop(x, oy, ox, 4, 5, mask)
    assert torch.equal(out, _reference_crop(x, oy, ox, (4, 5), (0, 0), 0, mask))


@pytest.mark.parametrize("padding", [(4, 4), (0, 3), (2, 0), (1, 5)])
def test_wide_images_border_fill_matches_pad(padding):
    """Wide rows take the border-only fill path; the padding must still be exact, whatever was in the buffer."""
    x = _batch((3, 2, 5, 70), seed=13)
    for fill in (0, 9, 0):  # successive fills reuse the scratch buffer: no stale bytes may leak through
        crop = A.RandomCrop((5, 68), padding=padding, fill=fill)
        aug = A.Compose([crop, A.RandomHorizontalFlip()])
        out = aug(x, torch.Generator().manual_seed(fill))
        g = torch.Generator().manual_seed(fill)
        oy, ox = crop.draw(x, g)
        mask = A.RandomHorizontalFlip().draw(3, x.device, g)
        assert torch.equal(out, _reference_crop(x, oy, ox, (5, 68), padding, fill, mask))


def test_empty_batch_keeps_shape():
    x = torch.empty((0, 3, 8, 8), dtype=torch.uint8)
    aug = A.Compose([A.RandomCrop(6, padding=2), A.RandomHorizontalFlip()])
    assert aug(x, torch.Generator().manual_seed(0)).shape == (0, 3, 6, 6)
    assert A.RandomHorizontalFlip()(x, torch.Generator().manual_seed(0)).shape == (0, 3, 8, 8)
