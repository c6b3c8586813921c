"""Crops: RandomCrop (2-D, 3-D, fused with a flip) bit-identical to pad-then-slice and to
torchvision per sample; RandomCropByLabel's centres, windows and foreground share."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from _augment_util import (  # noqa: F401
    both_paths,
    images,
    keys,
    mirror_regimes,
    ragged,
    ragged_masks,
    within_binomial,
)
from torchvision.transforms.v2 import functional as TF

from lightning_fastdata import augment as A
from lightning_fastdata.augment_base import StoreRows
from lightning_fastdata.augment_crop import window_crop


def _batch(shape, dtype=torch.uint8, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, dtype=dtype, generator=g)
    if dtype in (torch.int16, torch.uint16):
        return torch.randint(0, 3000, shape, dtype=torch.int32, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def _tv_sides(padding):
    """torchvision's reading of a 2-D RandomCrop padding as ((top, bottom), (left, right))."""
    p = (padding,) if isinstance(padding, int) else tuple(padding)
    left, top, right, bottom = {1: p * 4, 2: (p[0], p[1], p[0], p[1]), 4: p}[len(p)]
    return (top, bottom), (left, right)


def _reference_crop(x, offset, size, padding, fill, flip=None):
    """F.pad, then one slice per sample (and a mirror): the plain, obviously right version.
    ``padding`` per spatial dim: an int (both sides) or a pair (before, after)."""
    sd = len(size)
    n = x.shape[0]
    lead = x.shape[1:x.ndim - sd]
    flat = x.reshape(n, -1, *x.shape[x.ndim - sd:])
    sides = [(p, p) if isinstance(p, int) else tuple(p) for p in padding]
    pads = [p for d in reversed(range(sd)) for p in sides[d]]
    if x.dtype == torch.uint16:
        xp = F.pad(flat.to(torch.int32), pads, value=fill).to(torch.uint16)
    else:
        xp = F.pad(flat, pads, value=fill)
    out = []
    for i in range(n):
        window = (slice(None), *(slice(int(offset[i, d]), int(offset[i, d]) + size[d]) for d in range(sd)))
        c = xp[i][window]
        out.append(c.flip(-1) if flip is not None and flip[i] else c)
    return torch.stack(out).view(n, *lead, *size)


@pytest.mark.usefixtures("both_paths")
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16, torch.int16, torch.uint16])
@pytest.mark.parametrize("shape", [(9, 3, 10, 12), (4, 1, 4, 4)])
@pytest.mark.parametrize("padding", [(0, 0), (2, 1), (3, 3), (1, 2, 3, 0), (0, 0, 2, 1)])
def test_random_crop_matches_pad_then_slice(dtype, shape, padding):
    x = _batch(shape, dtype)
    h, w = shape[-2], shape[-1]
    size = (h - 1, max(1, w - 2))
    crop = A.RandomCrop(size, padding=padding, fill=7)
    out = crop(x, keys(shape[0], seed=1))
    offset = crop.draw(x, keys(shape[0], seed=1))["offset"]
    assert out.dtype == x.dtype and offset.shape == (shape[0], 2)
    assert torch.equal(out, _reference_crop(x, offset, size, _tv_sides(padding), 7))


@pytest.mark.usefixtures("both_paths")
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.int16])
@pytest.mark.parametrize("padding", [0, (1, 0, 2), (2, 3, 1)])
def test_random_crop_3d_matches_pad_then_slice(dtype, padding):
    x = _batch((5, 2, 7, 9, 11), dtype)
    crop = A.RandomCrop((4, 6, 5), padding=padding, fill=3)
    out = crop(x, keys(5, seed=2))
    offset = crop.draw(x, keys(5, seed=2))["offset"]
    assert out.shape == (5, 2, 4, 6, 5) and offset.shape == (5, 3)
    pad = (padding,) * 3 if isinstance(padding, int) else padding
    assert torch.equal(out, _reference_crop(x, offset, (4, 6, 5), pad, 3))


@pytest.mark.usefixtures("both_paths")
@pytest.mark.parametrize("dtype, fill", [(torch.float32, float("nan")), (torch.float32, -0.0), (torch.int16, -3),
                                         (torch.float64, 2.5), (torch.bfloat16, 1e30), (torch.uint8, 255)])
def test_the_padding_holds_the_fill_bit_for_bit(dtype, fill):
    """NaN, -0.0 and out-of-range fills are written as F.pad writes them, and NaN or infinite
    pixels stay where they are (compared on the bits)."""
    x = _batch((7, 2, 9, 11), dtype, seed=5)
    if dtype.is_floating_point:
        x[:, :, 0, 0], x[:, :, -1, -1], x[:, :, 4, 0] = float("nan"), float("inf"), float("-inf")
    g = torch.Generator().manual_seed(3)
    padding, size = (3, 2), (10, 8)
    offset = torch.stack([torch.randint(0, 9 + 6 - 10 + 1, (7,), generator=g),
                          torch.randint(0, 11 + 4 - 8 + 1, (7,), generator=g)], 1)
    flip = torch.rand(7, generator=g) < 0.5
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    for f in (None, flip):
        out = window_crop(x, offset, size, 2, f, padding, fill)
        ref = _reference_crop(x, offset, size, padding, fill, f)
        assert torch.equal(out.view(bits), ref.view(bits))


def test_random_crop_cuts_masks_with_the_image_window_and_pads_them_with_zero():
    img = _batch((6, 3, 10, 10))
    mask = _batch((6, 10, 10), seed=1) % 5
    labels = torch.arange(6)
    batch = A.Batch({"image": img, "mask": mask, "y": labels}, {"image": "image", "mask": "mask"}, keys(6))
    crop = A.RandomCrop(8, padding=3, fill=9)
    out = crop(batch)
    offset = crop.draw(batch)["offset"]
    assert torch.equal(out.fields["image"], _reference_crop(img, offset, (8, 8), (3, 3), 9))
    assert torch.equal(out.fields["mask"], _reference_crop(mask, offset, (8, 8), (3, 3), 0))
    assert out.fields["y"] is labels


def test_random_crop_offsets_are_uniform():
    n = 10_000
    offset = A.RandomCrop(12, padding=2).draw(torch.zeros(n, 1, 16, 16), keys(n, seed=2))["offset"]
    for col in offset.T:
        counts = torch.bincount(col, minlength=9)
        assert counts.numel() == 9
        assert all(within_binomial(int(c), n, 1 / 9) for c in counts)
    assert abs(torch.corrcoef(offset.T.double())[0, 1].item()) < 5 / math.sqrt(n)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
@pytest.mark.parametrize("size,padding", [((32, 32), (4, 4)), ((6, 8), (0, 0)), ((10, 9), (2, 3)),
                                          ((10, 9), (3, 0, 1, 2))])
@pytest.mark.usefixtures("both_paths")
def test_fused_crop_flip_equals_unfused_sequence(dtype, size, padding):
    """Compose fuses crop + flip: same keys, same draws, bit-equal output."""
    x = _batch((33, 3, 32, 32) if size == (32, 32) else (17, 2, 10, 11), dtype, seed=2)
    crop, flip = A.RandomCrop(size, padding=padding), A.RandomHorizontalFlip()
    k = keys(x.shape[0], seed=5)
    fused = A.Compose([crop, flip])(x, k)
    unfused = flip(crop(x, k.child(0)), k.child(1))
    assert torch.equal(fused, unfused)
    offset = crop.draw(x, k.child(0))["offset"]
    mask = flip.draw(x, k.child(1))["flip"][:, 0]
    assert torch.equal(fused, _reference_crop(x, offset, size, _tv_sides(padding), 0, mask))


@pytest.mark.usefixtures("both_paths")
def test_fused_crop_flip_3d_and_with_masks():
    vol = _batch((6, 1, 6, 8, 9), torch.float32)
    lab = (vol > 0.3).to(torch.uint8)
    batch = A.Batch({"image": vol, "label": lab}, {"image": "image", "label": "mask"}, keys(6, seed=3))
    aug = A.Compose([A.RandomCrop((4, 6, 7), padding=1), A.RandomHorizontalFlip()])
    out = aug(batch)
    seq = A.RandomHorizontalFlip()(A.RandomCrop((4, 6, 7), padding=1)(batch, batch.keys.child(0)), batch.keys.child(1))
    for name in ("image", "label"):
        assert torch.equal(out.fields[name], seq.fields[name])
    assert torch.equal(out.fields["label"], (out.fields["image"] > 0.3).to(torch.uint8))


def test_crop_flip_equals_torchvision_functional_per_sample():
    """At the drawn parameters, each sample equals torchvision v2 pad -> crop -> hflip."""
    x = _batch((16, 3, 32, 32), seed=6)
    crop, flip = A.RandomCrop(32, padding=4, fill=7), A.RandomHorizontalFlip()
    k = keys(16, seed=7)
    out = A.Compose([crop, flip])(x, k)
    offset = crop.draw(x, k.child(0))["offset"]
    mask = flip.draw(x, k.child(1))["flip"][:, 0]
    for i in range(16):
        ref = TF.crop(TF.pad(x[i], [4], fill=7), int(offset[i, 0]), int(offset[i, 1]), 32, 32)
        if mask[i]:
            ref = TF.horizontal_flip(ref)
        assert torch.equal(out[i], ref), f"sample {i}"


def test_channels_last_input_keeps_format_and_values():
    x = _batch((6, 3, 9, 9), seed=8).contiguous(memory_format=torch.channels_last)
    aug = A.Compose([A.RandomCrop(8, padding=2), A.RandomHorizontalFlip()])
    out = aug(x, keys(6, seed=9))
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, aug(x.contiguous(), keys(6, seed=9)))


def test_outputs_survive_later_calls():
    """The padded source lives in a reused scratch buffer; returned batches must not alias it."""
    crop = A.RandomCrop(8, padding=3)
    x1, x2 = _batch((5, 3, 8, 8), seed=10), _batch((7, 3, 8, 8), seed=11)
    out1 = A.Compose([crop, A.RandomHorizontalFlip()])(x1, keys(5, seed=1))
    keep = out1.clone()
    for seed in range(3):  # other shapes, dtypes and fills reuse and regrow the buffer
        A.RandomCrop(8, padding=3, fill=255)(x2, keys(7, seed=seed))
        A.RandomCrop(4, padding=1)(x2.float(), keys(7, seed=seed))
        A.RandomHorizontalFlip()(x2, keys(7, seed=seed))
        A.RandomCrop((2, 3, 3), padding=1)(x2.view(7, 1, 3, 8, 8), keys(7, seed=seed))
    assert torch.equal(out1, keep)
    assert torch.equal(A.Compose([crop, A.RandomHorizontalFlip()])(x1, keys(5, seed=1)), keep)


@pytest.mark.parametrize("dtype,fill", [(torch.uint8, 0), (torch.uint8, 255), (torch.int8, -128), (torch.int16, -3),
                                        (torch.int32, 7), (torch.int64, 0)])
@pytest.mark.parametrize("flipped", ["none", "some", "all"])
@pytest.mark.parametrize("from_store", [False, True])
def test_padded_integer_crops_equal_pad_then_slice_whatever_lies_next_to_each_sample(dtype, fill, flipped, from_store):
    """Integer images are cut without a padded copy: each window is read from the unpadded
    samples laid side by side, and what it reads past a sample's edge (its neighbour, or the
    work buffer's margin) is zeroed and filled. Neighbours at the dtype's extremes and a buffer
    left dirty by an earlier call must never show through."""
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(3)
    store = torch.randint(info.min, info.max, (40, 3, 10, 12), dtype=torch.int64, generator=g).to(dtype)
    store[::2] = info.max  # every other sample at the top of the range, the rest random
    rows = torch.tensor([5, 0, 39, 17, 2, 2, 38, 1, 20])
    x = store.index_select(0, rows)
    crop, flip = A.RandomCrop((9, 11), padding=(3, 0, 1, 2), fill=fill), A.RandomHorizontalFlip(
        p={"none": 0.0, "some": 0.5, "all": 1.0}[flipped])
    k = keys(9, seed=11)
    A.RandomCrop(12, padding=5, fill=info.max)(x, k)  # leaves the work buffer dirty
    if from_store:
        batch = A.Batch({"image": StoreRows(store, rows)}, keys=k)
        out = A.Compose([crop, flip])(batch).fields["image"]
    else:
        out = A.Compose([crop, flip])(x, k)
    offset = crop.draw(x, k.child(0))["offset"]
    mask = flip.draw(x, k.child(1))["flip"][:, 0]
    assert torch.equal(out, _reference_crop(x, offset, (9, 11), _tv_sides((3, 0, 1, 2)), fill, mask))
    # the padding holds the fill bit for bit: samples at the dtype's maximum, padded with
    # another value, show it exactly where the reference pads
    assert torch.equal(out == fill, _reference_crop(x, offset, (9, 11), _tv_sides((3, 0, 1, 2)), fill, mask) == fill)


@pytest.mark.parametrize("shape,size,padding", [((3, 2, 70, 75), (64, 80), (9, 12)),  # one table per axis
                                                ((4, 1, 5, 6, 7), (5, 6, 7), (1, 2, 3)),  # volumes
                                                ((5, 3, 4, 4), (10, 10), (3, 3))])  # windows past the sample
def test_padded_integer_crops_of_large_windows_and_volumes_equal_pad_then_slice(shape, size, padding):
    x = _batch(shape, torch.int16, seed=4)
    sd = len(size)
    offset = torch.stack([torch.randint(0, s + 2 * p - w + 1, (shape[0],)) for s, p, w in
                          zip(shape[-sd:], padding, size, strict=True)], 1)
    flip = torch.arange(shape[0]) % 2 == 0
    out = window_crop(x, offset, size, sd, flip, padding, fill=-9)
    assert torch.equal(out, _reference_crop(x, offset, size, padding, -9, flip))
    rows = torch.arange(shape[0]).flip(0)
    out = window_crop(x, offset, size, sd, None, padding, fill=0, rows=rows)
    assert torch.equal(out, _reference_crop(x.index_select(0, rows), offset, size, padding, 0))


def test_window_crop_on_prepadded_input():
    x = _batch((4, 3, 6, 6), seed=12)
    offset = torch.tensor([[0, 1], [1, 0], [2, 1], [0, 0]])
    mask = torch.tensor([True, False, True, False])
    out = window_crop(x, offset, (4, 5), 2, mask)
    assert torch.equal(out, _reference_crop(x, offset, (4, 5), (0, 0), 0, mask))


@pytest.mark.parametrize("shape,size,padding", [((5, 2, 7, 9), (4, 6), (1, 2)), ((6, 1, 6, 7, 8), (3, 4, 5), (0, 0, 0)),
                                                ((4, 2, 3, 5, 6, 7), (5, 4, 3), (1, 0, 2))])
@pytest.mark.usefixtures("both_paths")
def test_window_crop_mirrors_rows_like_torch_flip(shape, size, padding):
    """``mirror_rows`` (and ``flip``) cut windows mirrored along any spatial axes: pad, slice, torch.flip."""
    x = _batch(shape, torch.int16, seed=13)
    n, sd = shape[0], len(size)
    g = torch.Generator().manual_seed(14)
    offset = torch.stack([torch.randint(0, s + 2 * p - c + 1, (n,), generator=g)
                          for s, p, c in zip(shape[-sd:], padding, size, strict=True)], 1)
    mirror = torch.rand(n, sd, generator=g) < 0.5
    mirror[0] = True
    mirror[1] = False
    out = window_crop(x, offset, size, sd, mirror[:, -1], padding, 7, mirror[:, :-1])
    ref = _reference_crop(x, offset, size, padding, 7)
    for i in range(n):
        axes = [d - sd for d in range(sd) if mirror[i, d]]
        assert torch.equal(out[i], ref[i].flip(axes) if axes else ref[i])


@pytest.mark.parametrize("dims", [(-1,), (-2,), (-3,), (-3, -1), (-2, -1), (-3, -2, -1), (-1, -3)])
@pytest.mark.parametrize("crop", ["random", "random-unpadded", "label"])
@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.float32])
@pytest.mark.usefixtures("both_paths", "mirror_regimes")
def test_fused_crop_and_flip_over_any_axes_equal_the_ops_in_sequence(dims, crop, dtype):
    """Compose cuts RandomCrop / RandomCropByLabel windows mirrored by the following RandomFlip
    in one pass: the same draws, a bit-identical image and mask to the ops one after the other,
    and to slicing + torch.flip at the drawn parameters."""
    n = 7
    vol = _batch((n, 2, 9, 10, 11), dtype, seed=15)
    lab = _labels(n, (9, 10, 11), fg_share=0.1, seed=16)
    batch = A.Batch({"image": vol, "label": lab}, {"image": "image", "label": "mask"}, keys(n, seed=17))
    first = {"random": A.RandomCrop((5, 6, 7), padding=(1, 0, 2), fill=3), "random-unpadded": A.RandomCrop((5, 6, 7)),
             "label": A.RandomCropByLabel((5, 6, 7), pos=1, neg=1, label="label")}[crop]
    flip = A.RandomFlip(dims=dims, p=0.5)
    fused = A.Compose([first, flip])(batch)
    seq = flip(first(batch, batch.keys.child(0)), batch.keys.child(1))
    offset = first.draw(batch, batch.keys.child(0))["offset"]
    mirror = flip.draw(batch, batch.keys.child(1))["flip"]
    assert bool(mirror.any()) and not bool(mirror.all())
    pad = (1, 0, 2) if crop == "random" else (0, 0, 0)
    for name, x, fill in (("image", vol, 3 if crop == "random" else 0), ("label", lab, 0)):
        assert fused.fields[name].dtype == x.dtype
        assert torch.equal(fused.fields[name], seq.fields[name])
        ref = _reference_crop(x, offset, (5, 6, 7), pad, fill)
        for i in range(n):
            axes = [d for j, d in enumerate(dims) if mirror[i, j]]
            assert torch.equal(fused.fields[name][i], ref[i].flip(axes) if axes else ref[i])


@pytest.mark.usefixtures("mirror_regimes")
def test_fused_crop_and_flip_in_2d_with_a_vertical_flip():
    x = _batch((9, 3, 12, 14), torch.uint8, seed=18)
    k = keys(9, seed=19)
    for flip in (A.RandomVerticalFlip(), A.RandomFlip(dims=(-2, -1))):
        aug = A.Compose([A.RandomCrop((8, 9), padding=2), flip])
        assert torch.equal(aug(x, k), flip(A.RandomCrop((8, 9), padding=2)(x, k.child(0)), k.child(1)))


@pytest.mark.parametrize("padding", [(4, 4), (0, 3), (2, 0), (1, 5), (0, 2, 5, 1)])
def test_wide_images_border_fill_matches_pad(padding):
    """Wide rows take the border-only fill path; the padding must be exact, whatever was in the buffer."""
    x = _batch((3, 2, 5, 70), seed=13)
    for fill in (0, 9, 0):  # successive fills reuse the scratch buffer: no stale bytes may leak through
        crop = A.RandomCrop((5, 68), padding=padding, fill=fill)
        k = keys(3, seed=fill)
        out = A.Compose([crop, A.RandomHorizontalFlip()])(x, k)
        offset = crop.draw(x, k.child(0))["offset"]
        mask = A.RandomHorizontalFlip().draw(x, k.child(1))["flip"][:, 0]
        assert torch.equal(out, _reference_crop(x, offset, (5, 68), _tv_sides(padding), fill, mask))


def test_empty_batch_keeps_shape():
    x = torch.empty((0, 3, 8, 8), dtype=torch.uint8)
    aug = A.Compose([A.RandomCrop(6, padding=2), A.RandomHorizontalFlip()])
    assert aug(x).shape == (0, 3, 6, 6)
    assert A.RandomHorizontalFlip()(x).shape == (0, 3, 8, 8)


def test_random_crop_refuses_bad_sizes():
    with pytest.raises(ValueError, match="larger than the padded input"):
        A.RandomCrop(12)(torch.zeros(2, 1, 8, 8))
    with pytest.raises(ValueError, match="3 values but the batch has 2 spatial dims"):
        A.RandomCrop((4, 4, 4))(torch.zeros(2, 1, 8, 8))
    with pytest.raises(ValueError, match="size"):
        A.RandomCrop(0)


def _tv_random_crop(x, offset, size, padding, fill):
    """torchvision's RandomCrop(size, padding, pad_if_needed=True) at a given corner in the padded input."""
    h, w = x.shape[-2:]
    ph = padding + max(0, size[0] - (h + 2 * padding))
    pw = padding + max(0, size[1] - (w + 2 * padding))
    padded = TF.pad(x, [pw, ph, pw, ph], fill=fill)
    return TF.crop(padded, int(offset[0]), int(offset[1]), size[0], size[1])


@pytest.mark.parametrize("padding", [0, 3])
@pytest.mark.usefixtures("both_paths")
def test_random_crop_pad_if_needed_of_a_list_equals_torchvision(padding):
    """Each sample is padded as it needs (torchvision adds the shortfall on both sides) and
    cropped at its own offset; masks follow with 0 padding; the list becomes a batch."""
    from torchvision import tv_tensors

    xs, ms = ragged(), ragged_masks()
    batch = A.Batch({"image": xs, "mask": ms}, {"image": "image", "mask": "mask"}, keys(len(xs), seed=2))
    op = A.RandomCrop((30, 36), padding=padding, fill=7, pad_if_needed=True)
    p = op.draw(batch)
    out = op.apply(batch, **p)
    assert out.fields["image"].shape == (len(xs), 3, 30, 36) and out.fields["mask"].shape == (len(xs), 30, 36)
    for i, x in enumerate(xs):
        spans = zip(x.shape[1:], (30, 36), strict=True)
        high = [s + 2 * padding + 2 * max(0, c - s - 2 * padding) - c for s, c in spans]
        assert 0 <= p["offset"][i, 0] <= high[0] and 0 <= p["offset"][i, 1] <= high[1]
        assert torch.equal(out.fields["image"][i], _tv_random_crop(x, p["offset"][i], (30, 36), padding, 7)), i
        ref = _tv_random_crop(tv_tensors.Mask(ms[i]), p["offset"][i], (30, 36), padding, 0)
        assert torch.equal(out.fields["mask"][i], ref.as_subclass(torch.Tensor)), i
    assert torch.equal(op(batch).fields["image"], out.fields["image"])


def _padded_lines(out):
    """Per sample of an all-ones image cropped with zero padding: (all-zero rows, all-zero columns)."""
    z = out[:, 0] == 0
    return z.all(2).sum(1), z.all(1).sum(1)


@pytest.mark.parametrize("size,padding", [((4, 6), (4, 0)), ((6, 6), (0, 2))])
@pytest.mark.usefixtures("both_paths")
def test_random_crop_padding_pair_reads_as_torchvision_left_right_then_top_bottom(size, padding):
    """A 2-D pair is (left/right, top/bottom) as torchvision's: (4, 0) pads columns only,
    (0, 2) rows only, with the same distribution of padded rows and columns per sample."""
    import torchvision.transforms.v2 as T

    n = 2000
    x = torch.ones(n, 1, 4, 6)
    tv_op = T.RandomCrop(size, padding=padding)
    torch.manual_seed(0)
    tv = torch.stack([tv_op(x[i]) for i in range(n)])
    ours = A.RandomCrop(size, padding=padding)(x, keys(n, seed=3))
    assert ours.shape == tv.shape == (n, 1, *size)
    (tv_rows, tv_cols), (rows, cols) = _padded_lines(tv), _padded_lines(ours)
    if padding[1] == 0:
        assert int(tv_rows.max()) == int(rows.max()) == 0  # no row is ever padded
    if padding[0] == 0:
        assert int(tv_cols.max()) == int(cols.max()) == 0  # no column is ever padded
    for tv_lines, lines in ((tv_rows, rows), (tv_cols, cols)):
        for v in range(max(int(tv_lines.max()), int(lines.max())) + 1):
            a, b = int((tv_lines == v).sum()), int((lines == v).sum())
            share = (a + b) / (2 * n)
            assert abs(a - b) <= 5 * math.sqrt(2 * n * share * (1 - share)) + 2, (v, a, b)


@pytest.mark.parametrize("pad_if_needed", [False, True])
@pytest.mark.usefixtures("both_paths")
def test_random_crop_four_padding_values_equal_torchvision_left_top_right_bottom(pad_if_needed):
    """(left, top, right, bottom), uneven sides included, as torchvision pads: every sample of
    a batch tensor and of a list equals TF.pad then TF.crop at its drawn corner, whose range
    is the unevenly padded input's."""
    padding, size, fill = (1, 0, 3, 2), (12, 16), 7
    op = A.RandomCrop(size, padding=padding, fill=fill, pad_if_needed=pad_if_needed)

    def reference(x, corner):
        h, w = x.shape[-2:]
        dh = max(0, size[0] - (h + 2)) if pad_if_needed else 0  # torchvision: the shortfall on both sides
        dw = max(0, size[1] - (w + 4)) if pad_if_needed else 0
        padded = TF.pad(x, [1 + dw, dh, 3 + dw, 2 + dh], fill=fill)
        return TF.crop(padded, int(corner[0]), int(corner[1]), *size)

    n = 400
    x = images(n, shape=(2, 11, 14))
    p = op.draw(x, keys(n, seed=4))
    out = op.apply(x, **p)
    h_pad, w_pad = 11 + 2, 14 + 4
    if pad_if_needed:
        h_pad, w_pad = h_pad + 2 * max(0, 12 - h_pad), w_pad + 2 * max(0, 16 - w_pad)
    # Every corner of the padded input is drawn, none past it.
    assert sorted(p["offset"][:, 0].unique().tolist()) == list(range(h_pad - 12 + 1))
    assert sorted(p["offset"][:, 1].unique().tolist()) == list(range(w_pad - 16 + 1))
    for i in range(n):
        assert torch.equal(out[i], reference(x[i], p["offset"][i])), i
    xs = ragged([(12, 15), (10, 20), (13, 13)]) if pad_if_needed else ragged([(12, 15), (11, 20), (13, 13)])
    p = op.draw(xs, keys(3, seed=5))
    out = op.apply(xs, **p)
    for i, xi in enumerate(xs):
        assert torch.equal(out[i], reference(xi, p["offset"][i])), i


@pytest.mark.usefixtures("both_paths")
def test_random_crop_padding_of_volumes_stays_per_dim():
    """Volumes keep one value per axis, (d, h, w), each on both sides; the image readings
    (a pair, four values) and a triple on images are refused, naming the reading to use."""
    n = 300
    vol = torch.ones(n, 1, 4, 5, 6)
    out = A.RandomCrop((4, 5, 6), padding=(2, 0, 0))(vol, keys(n, seed=6))
    z = out[:, 0] == 0
    planes = z.flatten(2).all(2).sum(1)  # all-zero depth slices
    assert int(planes.max()) == 2 and int(planes.min()) == 0
    assert int(z.all(1).all(2).sum()) == 0 and int(z.all(1).all(1).sum()) == 0  # no h row or w column padded
    assert torch.equal(out.sum((1, 2, 3, 4)), (4 - planes) * 30.0)
    with pytest.raises(ValueError, match=r"padding=\(4, 0\) has 2 values but the batch has 3 spatial.*\(d, h, w\)"):
        A.RandomCrop(4, padding=(4, 0))(vol[:2])
    with pytest.raises(ValueError, match=r"4 values but the batch has 3 spatial dims"):
        A.RandomCrop(4, padding=(1, 2, 3, 4))(vol[:2])
    with pytest.raises(ValueError, match=r"3 values but the batch has 2 spatial dims.*\(left/right, top/bottom\)"):
        A.RandomCrop(4, padding=(1, 2, 3))(torch.ones(2, 1, 8, 8))
    with pytest.raises(ValueError, match=r"padding must be an int.*got \(1, 2, 3, 4, 5\)"):
        A.RandomCrop(4, padding=(1, 2, 3, 4, 5))
    with pytest.raises(ValueError, match=r"padding must be >= 0, got \(1, -1\)"):
        A.RandomCrop(4, padding=(1, -1))


def test_random_crop_of_a_list_draws_as_a_batch_tensor():
    same = ragged([(20, 24)] * 5)
    op = A.RandomCrop(12, padding=2)
    assert torch.equal(op.draw(same, keys(5))["offset"], op.draw(torch.stack(same), keys(5))["offset"])
    assert torch.equal(op(same, keys(5)), op(torch.stack(same), keys(5)))
    # 3-D volumes of varying sizes, padded where needed
    sizes = [(5, 6, 7), (3, 9, 4), (8, 8, 8)]
    vols = [torch.randn(1, d, h, w, generator=torch.Generator().manual_seed(d)) for d, h, w in sizes]
    out = A.RandomCrop(6, pad_if_needed=True)(vols)
    assert out.shape == (3, 1, 6, 6, 6)
    with pytest.raises(ValueError, match=r"sample 0 padded, \(5, 6, 7\)"):
        A.RandomCrop(6)(vols)


def test_random_crop_pad_if_needed_on_a_batch_tensor_equals_torchvision():
    import torchvision.transforms.v2 as T

    x = images(4, shape=(3, 10, 30))
    op = A.RandomCrop((16, 20), pad_if_needed=True, fill=3)
    p = op.draw(x, keys(4, seed=6))
    out = op.apply(x, **p)
    for i in range(4):
        assert torch.equal(out[i], _tv_random_crop(x[i], p["offset"][i], (16, 20), 0, 3))
    torch.manual_seed(0)
    tv = T.RandomCrop((16, 20), pad_if_needed=True).make_params([x[0]])
    assert tv["padding"] == [0, 6, 0, 6] and op.draw(x, keys(4))["offset"][:, 0].max() <= 12


# ----------------------------------------------------------------------------- RandomCropByLabel


def _labels(n, spatial, fg_share=0.1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand((n, 1, *spatial), generator=g) < fg_share).to(torch.uint8)


@pytest.mark.parametrize("spatial,size", [((9, 11), (4, 5)), ((6, 7, 8), (3, 4, 5))])
@pytest.mark.usefixtures("both_paths")
def test_crop_by_label_equals_slicing_at_the_reported_window(spatial, size):
    n = 12
    lab = _labels(n, spatial, seed=1)
    img = torch.randn(n, 2, *spatial)
    batch = A.Batch({"image": img, "label": lab}, {"image": "image", "label": "mask"}, keys(n, seed=4))
    op = A.RandomCropByLabel(size, pos=1, neg=1, label="label")
    p = op.draw(batch)
    out = op(batch)
    for name, x in (("image", img), ("label", lab)):
        assert torch.equal(out.fields[name], _reference_crop(x, p["offset"], size, (0,) * len(spatial), 0))
    for i in range(n):
        c, o = p["center"][i], p["offset"][i]
        assert bool(lab[i].flatten(1).any(0).view(spatial)[tuple(c)] > 0) == bool(p["foreground"][i])
        for d in range(len(spatial)):
            assert 0 <= o[d] <= spatial[d] - size[d]
            assert o[d] <= c[d] < o[d] + size[d]  # the drawn voxel is inside its window
            if size[d] // 2 <= c[d] <= spatial[d] - size[d] + size[d] // 2:
                assert o[d] == c[d] - size[d] // 2  # centred unless the border is in the way


@pytest.mark.parametrize("pos,neg", [(1, 1), (1, 3), (2, 1)])
def test_crop_by_label_foreground_share_is_pos_over_pos_plus_neg(pos, neg):
    """Over 10,000 crops the share centred on foreground is within 3 sigma of pos / (pos + neg)."""
    n = 10_000
    lab = _labels(n, (6, 6, 6), fg_share=0.05, seed=2)
    has_both = lab.flatten(1).any(1) & ~lab.flatten(1).all(1)
    assert bool(has_both.all())
    batch = A.Batch({"label": lab}, {"label": "mask"}, keys(n, seed=pos * 10 + neg), spatial_dims=3)
    p = A.RandomCropByLabel(3, pos=pos, neg=neg).draw(batch)
    on_fg = torch.stack([lab[i, 0][tuple(p["center"][i])] for i in range(n)]) > 0
    assert torch.equal(on_fg, p["foreground"])
    share = pos / (pos + neg)
    assert abs(on_fg.sum().item() - n * share) <= 3 * math.sqrt(n * share * (1 - share))


def test_crop_by_label_centres_are_uniform_over_the_chosen_voxels():
    n = 6000
    lab = torch.zeros(n, 1, 4, 5, dtype=torch.int64)
    fg = [(0, 0), (1, 3), (2, 2), (3, 4)]
    for y, x in fg:
        lab[:, 0, y, x] = 2
    batch = A.Batch({"label": lab}, {"label": "mask"}, keys(n, seed=3), spatial_dims=2)
    p = A.RandomCropByLabel(1, pos=1, neg=0).draw(batch)
    assert bool(p["foreground"].all())
    flat = p["center"][:, 0] * 5 + p["center"][:, 1]
    counts = torch.bincount(flat, minlength=20)
    assert set(counts.nonzero().view(-1).tolist()) == {y * 5 + x for y, x in fg}
    assert all(within_binomial(int(counts[y * 5 + x]), n, 0.25) for y, x in fg)
    bg = A.RandomCropByLabel(1, pos=0, neg=1).draw(batch)
    assert not bg["foreground"].any()
    counts = torch.bincount(bg["center"][:, 0] * 5 + bg["center"][:, 1], minlength=20)
    assert all(counts[y * 5 + x] == 0 for y, x in fg)
    assert all(within_binomial(int(c), n, 1 / 16) for i, c in enumerate(counts.tolist()) if i not in
               {y * 5 + x for y, x in fg})


@pytest.mark.usefixtures("both_paths")
def test_crop_by_label_falls_back_when_a_sample_lacks_foreground_or_background():
    lab = torch.zeros(4, 1, 5, 5, dtype=torch.uint8)
    lab[1] = 1                      # all foreground
    lab[2, 0, 4, 4] = 1             # one foreground voxel
    lab[3, 0, 0, 0] = 1
    batch = A.Batch({"label": lab}, {"label": "mask"}, keys(4), spatial_dims=2)
    p = A.RandomCropByLabel(3, pos=1, neg=0).draw(batch)
    assert p["foreground"].tolist() == [False, True, True, True]  # sample 0 has none: background
    assert p["center"][2].tolist() == [4, 4] and p["offset"][2].tolist() == [2, 2]
    p = A.RandomCropByLabel(3, pos=0, neg=1).draw(batch)
    assert p["foreground"].tolist() == [False, True, False, False]  # sample 1 has no background


def _plain_draw(lab, u, p_fg):
    """The straightforward draw: a running count over every voxel of the chosen set, then
    the first voxel whose count exceeds k (flat indices (N,), foreground (N,))."""
    n = lab.shape[0]
    fg = (lab.to(torch.float64) > 0).reshape(n, -1, math.prod(lab.shape[2:])).any(1)
    count_fg = fg.sum(1)
    count_bg = fg.shape[1] - count_fg
    use_fg = torch.where(count_fg == 0, False, torch.where(count_bg == 0, True, u[:, 0] < p_fg))
    chosen = torch.where(use_fg.view(n, 1), fg, ~fg)
    count = torch.where(use_fg, count_fg, count_bg)
    k = torch.minimum(torch.floor(u[:, 1] * count.double()).long(), count - 1)
    flat = torch.searchsorted(torch.cumsum(chosen, 1), (k + 1).view(n, 1)).view(n)
    return flat, use_fg


@pytest.mark.parametrize("shape", [(6, 1, 9, 11), (5, 1, 64, 48), (5, 1, 37, 41, 29), (4, 3, 6, 7, 8),
                                   (4, 1, 32, 32, 32), (4, 2, 30, 50)])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.float32, torch.bool, torch.uint16])
@pytest.mark.parametrize("pos,neg", [(1, 1), (1, 0), (0, 1), (1, 3)])
@pytest.mark.usefixtures("both_paths")
def test_crop_by_label_draw_equals_a_running_count_over_every_voxel(shape, dtype, pos, neg):
    """The two-level draw (counts per block of voxels, then one block) gives the centres of a
    running count over every voxel: 2-D and 3-D, several label channels and values, sizes
    that are and are not a multiple of the block, an all-background and an all-foreground
    sample, label values <= 0 as background."""
    g = torch.Generator().manual_seed(sum(shape))
    lab = (torch.rand(shape, generator=g) < 0.05).to(torch.int16) * torch.randint(1, 4, shape, generator=g,
                                                                                    dtype=torch.int16)
    if dtype.is_signed or dtype.is_floating_point:
        lab = lab - (torch.rand(shape, generator=g) < 0.05).to(torch.int16)  # negatives are background
    lab[0] = 0  # no foreground
    lab[1] = 2  # no background
    lab = lab.to(torch.int32).to(dtype) if dtype != torch.bool else lab > 0
    n, sd = shape[0], len(shape) - 2
    batch = A.Batch({"label": lab}, {"label": "mask"}, keys(n, seed=7, start=40), spatial_dims=sd)
    p = A.RandomCropByLabel(1, pos=pos, neg=neg).draw(batch)
    flat, use_fg = _plain_draw(lab, batch.keys.uniform(0, 2, dtype=torch.float64), pos / (pos + neg))
    strides = torch.tensor([math.prod(shape[2 + d + 1:]) for d in range(sd)])
    assert torch.equal((p["center"] * strides).sum(1), flat)
    assert torch.equal(p["foreground"], use_fg)
    assert p["foreground"][:2].tolist() == [False, True]


def test_crop_by_label_refuses_bad_setups():
    with pytest.raises(ValueError, match="pos and neg"):
        A.RandomCropByLabel(4, pos=0, neg=0)
    img = torch.zeros(2, 1, 8, 8)
    with pytest.raises(ValueError, match="label='label'"):
        A.RandomCropByLabel(4)(img)
    batch = A.Batch({"image": img, "label": torch.zeros(2, 8, 8)}, {"image": "image", "label": "mask"})
    with pytest.raises(ValueError, match="larger than the input"):
        A.RandomCropByLabel(9)(batch)



def _ragged_volumes(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    imgs = [torch.randint(-1000, 1000, (1, *s), generator=g).to(torch.int16) for s in sizes]
    # sample 1 has no foreground: its centre falls back to the background
    labs = [(torch.rand((1, *s), generator=g) < (0.0 if i == 1 else 0.05)).to(torch.uint8) * 2
            for i, s in enumerate(sizes)]
    return imgs, labs


@pytest.mark.usefixtures("both_paths")
def test_crop_by_label_of_a_ragged_list_is_one_batch_cut_as_each_sample_alone():
    """Volumes of different sizes (a list, the usual CT case) become one batch tensor of
    windows, each sample's window and mask cut as it is cut alone in a batch tensor; no op
    after it runs per sample (it stayed a list, and every later op warned)."""
    sizes = [(20, 24, 22), (12, 30, 40), (9, 9, 33), (12, 30, 40)]
    imgs, labs = _ragged_volumes(sizes)
    kinds = {"image": "image", "label": "mask"}
    k = keys(len(sizes), seed=2)
    batch = A.Batch({"image": imgs, "label": labs, "id": torch.arange(4)}, kinds | {"id": "other"}, k)
    op = A.RandomCropByLabel((8, 6, 7), pos=3, neg=1)
    p = op.draw(batch)
    out = op(batch)
    assert out.fields["image"].shape == (4, 1, 8, 6, 7) and out.fields["label"].shape == (4, 1, 8, 6, 7)
    assert out.fields["image"].dtype == torch.int16 and out.fields["label"].dtype == torch.uint8
    assert torch.equal(out.fields["id"], torch.arange(4))
    for i in range(4):
        alone = A.Batch({"image": imgs[i][None], "label": labs[i][None]}, kinds, k.take(torch.tensor([i])))
        pa = op.draw(alone)
        assert all(torch.equal(pa[name][0], p[name][i]) for name in pa), i
        one = op(alone)
        assert torch.equal(out.fields["image"][i], one.fields["image"][0]), i
        assert torch.equal(out.fields["label"][i], one.fields["label"][0]), i
        window = (slice(None), *(slice(o, o + s) for o, s in zip(p["offset"][i].tolist(), (8, 6, 7), strict=True)))
        assert torch.equal(out.fields["label"][i], labs[i][window]), i
        assert bool(labs[i][(0, *p["center"][i].tolist())] > 0) == bool(p["foreground"][i]), i
    assert not p["foreground"][1]  # no foreground: a background centre
    # samples of one size: the list cuts what the batch tensor cuts
    same = A.Batch({"image": imgs[1::2], "label": labs[1::2]}, kinds, k.take(torch.tensor([1, 3])))
    stacked = A.Batch({"image": torch.stack(imgs[1::2]), "label": torch.stack(labs[1::2])}, kinds,
                      k.take(torch.tensor([1, 3])))
    assert all(torch.equal(op(same).fields[n], op(stacked).fields[n]) for n in kinds)
    # mirrored in the cut (as Compose passes a following flip) as cut, then flipped
    flip = torch.tensor([[True, False], [False, True], [True, True], [False, False]])
    mirrored = op.apply(batch, **p, flip=flip, flip_dims=(-3, -1))
    for i in range(4):
        dims = [d for d, f in zip((-3, -1), flip[i].tolist(), strict=True) if f]
        want = out.fields["label"][i].flip(dims) if dims else out.fields["label"][i]
        assert torch.equal(mirrored.fields["label"][i], want), i
    # a sample smaller than the window: the error of a batch tensor, naming its size
    with pytest.raises(ValueError, match=r"size \(10, 6, 7\) is larger than the input \(9, 9, 33\)"):
        A.RandomCropByLabel((10, 6, 7))(batch)


def test_compose_starting_with_crop_by_label_on_a_ragged_list_runs_on_one_batch():
    """Crop, flip and the intensity chain on a list: each sample as it comes out of the same
    pipeline alone in a batch tensor, without a per-sample warning."""
    import warnings

    sizes = [(20, 24, 22), (12, 30, 40), (9, 9, 33)]
    imgs, labs = _ragged_volumes(sizes, seed=5)
    kinds = {"image": "image", "label": "mask"}
    k = keys(3, seed=8)
    pipe = A.Compose([A.RandomCropByLabel((8, 8, 8)), A.RandomFlip((-3, -2, -1)),
                      A.ScaleIntensityRange(-200, 300, clip=True), A.RandomScaleIntensity(0.1)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = pipe(A.Batch({"image": imgs, "label": labs}, kinds, k))
    assert out.fields["image"].shape == (3, 1, 8, 8, 8) and out.fields["image"].dtype == torch.float32
    for i in range(3):
        one = pipe(A.Batch({"image": imgs[i][None], "label": labs[i][None]}, kinds, k.take(torch.tensor([i]))))
        assert torch.equal(out.fields["image"][i], one.fields["image"][0]), i
        assert torch.equal(out.fields["label"][i], one.fields["label"][0]), i


@pytest.mark.parametrize("kw, error, match", [
    ({"pos": "1"}, TypeError, "pos must be a number, got '1'"),
    ({"neg": None}, TypeError, "neg must be a number, got None"),
    ({"pos": float("inf")}, ValueError, "pos must be finite, got inf"),
    ({"pos": float("nan")}, ValueError, "pos must be finite, got nan"),
    ({"neg": float("inf")}, ValueError, "neg must be finite, got inf"),
])
def test_crop_by_label_refuses_pos_and_neg_that_are_not_finite_numbers(kw, error, match):
    """pos=inf made the foreground share inf / inf = nan, so every sample was silently cut around
    the background; a string failed on a bare comparison that named nothing."""
    with pytest.raises(error, match=match):
        A.RandomCropByLabel(4, **kw)



@pytest.mark.parametrize("dtype, fill", [(torch.uint8, -1), (torch.uint8, 256), (torch.uint8, -0.5),
                                         (torch.int16, -40000), (torch.uint16, -1)])
@pytest.mark.parametrize("as_list", [False, True])
def test_random_crop_refuses_a_fill_outside_the_image_dtype(dtype, fill, as_list):
    """fill=-1 on uint8 (or uint16) images silently padded with 255 (65535), where torchvision's
    pad refuses it; a fill past the range failed inside torch without naming fill."""
    x = torch.full((2, 1, 5, 6), 9, dtype=dtype)
    with pytest.raises(ValueError, match=rf"RandomCrop fill={fill} does not fit the image field 'image'"):
        A.RandomCrop(6, padding=1, fill=fill)(list(x) if as_list else x)


@pytest.mark.parametrize("dtype, fill", [(torch.uint8, 255), (torch.uint8, 0.7), (torch.int16, -1024),
                                         (torch.int16, -32768), (torch.uint16, 65535)])
def test_random_crop_pads_with_any_fill_the_image_dtype_holds(dtype, fill):
    x = torch.full((2, 1, 5, 6), 9, dtype=dtype)
    out = A.RandomCrop((7, 8), padding=1, fill=fill)(x)
    assert torch.equal(out, F.pad(x.float(), (1, 1, 1, 1), value=float(int(fill))).to(dtype))


# ----------------------------------------------------------------------------- windows cut from the store


def _label_store(rows, channels, spatial, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lab = (torch.rand((rows, channels, *spatial), generator=g) < 0.03).to(dtype)
    lab[0] = 0  # no foreground: its centre comes from the background
    lab[1] = 1  # no background
    return lab


@pytest.mark.parametrize("spatial,channels,dtype", [((37, 41, 23), 1, torch.uint8), ((20, 30, 40), 2, torch.int16),
                                                    ((33, 17), 3, torch.float32)])
@pytest.mark.usefixtures("both_paths", "mirror_regimes")
def test_windows_cut_from_store_rows_equal_those_of_the_gathered_batch(spatial, channels, dtype, monkeypatch):
    """The device loader hands a crop-first pipeline the store's rows (StoreRows): the windows cut
    from the store, and the centres drawn from the kept label counts, are those of the gathered batch.
    Voxel counts that are not whole blocks, multi-channel labels, rows without foreground or
    background, repeated rows, and ops that cannot read rows (they get them gathered)."""
    store_rows = 7
    img = _batch((store_rows, 2, *spatial), torch.float32, seed=1)
    lab = _label_store(store_rows, channels, spatial, dtype, seed=2)
    size = tuple(max(1, s // 2) for s in spatial)
    axes = tuple(range(-len(spatial), 0))
    pipelines = [
        A.RandomCropByLabel(size, pos=1, neg=1),
        A.Compose([A.RandomCropByLabel(size, pos=3, neg=1), A.RandomFlip(dims=axes)]),
        A.Compose([A.RandomCrop(size), A.RandomFlip(dims=(-1,))]),
        A.Compose([A.RandomCrop(size, padding=2), A.RandomFlip(dims=axes)]),  # padded: gathered first
        A.Compose([A.RandomFlip(dims=axes), A.RandomCropByLabel(size)]),  # the flip reads them gathered
    ]
    kinds = {"image": "image", "label": "mask"}
    g = torch.Generator().manual_seed(3)
    gathered = []
    real_gather = StoreRows.gather
    monkeypatch.setattr(StoreRows, "gather", lambda self: gathered.append(1) or real_gather(self))
    for p, pipeline in enumerate(pipelines):
        for epoch in range(4):
            rows = torch.randint(0, store_rows, (6,), generator=g)
            k = A.SampleKeys(1, epoch, rows)
            deferred = A.Batch({"image": StoreRows(img, rows), "label": StoreRows(lab, rows)}, kinds, k)
            assert deferred.stored_rows() is rows
            gathered.clear()
            out = pipeline(deferred)
            if p < 3:  # these cut from the store: no whole sample is copied
                assert not gathered, pipeline
            ref = pipeline(A.Batch({"image": img[rows], "label": lab[rows]}, kinds, k))
            for name in kinds:
                assert torch.equal(out.fields[name], ref.fields[name]), (pipeline, epoch, name)


@pytest.mark.parametrize("spatial,channels,dtype", [((37, 41, 23), 1, torch.uint8), ((20, 30, 40), 2, torch.int16),
                                                    ((33, 17), 3, torch.float32), ((16, 16, 8), 1, torch.bool),
                                                    ((9, 70, 5), 2, torch.bfloat16), ((12, 11, 10), 1, torch.uint16)])
@pytest.mark.parametrize("pos, neg", [(1, 1), (3, 1), (0, 1), (1, 0)])
def test_the_cpu_draws_the_same_centres_as_the_accelerator_path(spatial, channels, dtype, pos, neg, monkeypatch):
    """On the CPU, RandomCropByLabel draws its centres with numpy, sample by sample; on
    accelerators with batched torch ops and no host sync. For every label dtype, channel count,
    voxel count (whole blocks or not), rows without foreground or background, from the store's
    rows and from a batch tensor, both give the same centres, windows and foreground flags."""
    from lightning_fastdata import augment_base

    lab = _label_store(6, channels, spatial, dtype, seed=11)
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 2, 0, 1])
    op = A.RandomCropByLabel(tuple(max(1, s // 3) for s in spatial), pos=pos, neg=neg)
    draws = {}
    for host in (True, False):
        monkeypatch.setattr(augment_base, "HOST_SHORTCUTS", host)
        for epoch in range(3):
            k = A.SampleKeys(5, epoch, rows)
            for form, field in (("rows", StoreRows(lab, rows)), ("batch", lab[rows])):
                draws[host, epoch, form] = op.draw(A.Batch({"label": field}, {"label": "mask"}, k,
                                                           spatial_dims=len(spatial)), k)
    for epoch in range(3):
        ref = draws[False, epoch, "batch"]
        for host, form in ((True, "rows"), (True, "batch"), (False, "rows")):
            got = draws[host, epoch, form]
            for name in ("center", "offset", "foreground"):
                assert got[name].dtype == ref[name].dtype and torch.equal(got[name], ref[name]), (host, form, name)
    assert not bool(draws[True, 0, "rows"]["foreground"][0]) and bool(draws[True, 0, "rows"]["foreground"][1])


@pytest.mark.usefixtures("both_paths")
def test_a_label_strided_over_its_samples_draws_as_its_contiguous_copy():
    """A label that is a strided view over samples (``lab[::2]``) crashed the accelerator path's
    block view ("view size is not compatible"); it draws the centres of its contiguous copy."""
    lab = torch.rand(8, 1, 16, 16, 8, generator=torch.Generator().manual_seed(3)) > 0.7
    k = A.SampleKeys(0, 0, torch.arange(4))
    op = A.RandomCropByLabel(4)
    got = op.draw(A.Batch({"label": lab[::2]}, {"label": "mask"}, k, spatial_dims=3), k)
    want = op.draw(A.Batch({"label": lab[::2].contiguous()}, {"label": "mask"}, k, spatial_dims=3), k)
    for name in ("center", "offset", "foreground"):
        assert torch.equal(got[name], want[name])


def test_the_kept_label_counts_follow_the_store_label():
    """The per-block counts kept for a store label are recomputed when that label changes in
    place, are not reused for another label, and are not pickled."""
    lab = torch.zeros(3, 1, 30, 40, dtype=torch.uint8)
    lab[:, 0, 5, 7] = 1
    rows = torch.tensor([0, 1, 2])
    op = A.RandomCropByLabel(3, pos=1, neg=0)
    kinds = {"label": "mask"}

    def centres(store):
        batch = A.Batch({"label": StoreRows(store, rows)}, kinds, A.SampleKeys(0, 0, rows), spatial_dims=2)
        return op.draw(batch)["center"].tolist()

    assert centres(lab) == [[5, 7]] * 3
    lab[1, 0, 5, 7] = 0
    lab[1, 0, 20, 33] = 1  # edited in place: the kept counts are stale
    assert centres(lab) == [[5, 7], [20, 33], [5, 7]]
    other = torch.zeros_like(lab)
    other[:, 0, 29, 39] = 1
    assert centres(other) == [[29, 39]] * 3
    copy = pickle.loads(pickle.dumps(op))
    assert copy._counts == {} and repr(copy) == repr(op)
    assert copy.draw(A.Batch({"label": StoreRows(lab, rows)}, kinds, A.SampleKeys(0, 0, rows),
                             spatial_dims=2))["center"].tolist() == [[5, 7], [20, 33], [5, 7]]


def test_reading_a_batchs_fields_gathers_its_store_rows():
    store = torch.arange(5 * 1 * 4 * 4, dtype=torch.float32).view(5, 1, 4, 4)
    rows = torch.tensor([4, 0, 4])
    batch = A.Batch({"image": StoreRows(store, rows)}, {"image": "image"}, A.SampleKeys(0, 0, rows))
    assert batch.spatial_size == (4, 4) and len(batch) == 3 and "StoreRows" not in repr(batch)
    assert torch.equal(batch.fields["image"], store[rows]) and batch.stored_rows() is None
    with pytest.raises(ValueError, match=r"StoreRows needs 1-D rows on the tensor's device"):
        StoreRows(store, rows.view(3, 1))
