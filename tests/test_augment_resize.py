"""Resize and CenterCrop: torchvision's functional ops per sample, on batch tensors and on
lists of images of varying sizes (ragged batches), images and masks, on the CPU's kernels and
on the accelerator's batched taps (within 1 on uint8, as torch's uint8 and float kernels
round differently); the fused Resize + CenterCrop equals the two ops in sequence."""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms.v2.functional as TF
from _augment_util import RAGGED_SIZES, both_paths, close, images, keys, ragged, ragged_masks  # noqa: F401
from torchvision import tv_tensors

from lightning_fastdata import augment as A
from lightning_fastdata.augment_resize import resize_center_crop


def _tv_mask(fn, mask, *args, **kwargs):
    return fn(tv_tensors.Mask(mask), *args, **kwargs).as_subclass(torch.Tensor)


@pytest.mark.parametrize("size", [24, 18, (20, 26), (40, 40)], ids=str)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
@pytest.mark.usefixtures("both_paths")
def test_resize_of_a_list_equals_torchvision_per_sample(size, dtype):
    xs, ms = ragged(dtype=dtype), ragged_masks()
    batch = A.Batch({"image": xs, "mask": ms}, {"image": "image", "mask": "mask"})
    out = A.Resize(size)(batch)
    # int: the shorter side, sizes still vary (a list); (h, w): one batch tensor.
    assert isinstance(out.fields["image"], list if isinstance(size, int) else torch.Tensor)
    for i in range(len(xs)):
        close(out.fields["image"][i], TF.resize(xs[i], size, antialias=True))
        assert torch.equal(out.fields["mask"][i], _tv_mask(TF.resize, ms[i], size)), i


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.int16])
@pytest.mark.parametrize("antialias", [True, False])
@pytest.mark.usefixtures("both_paths")
def test_resize_of_a_batch_tensor_equals_torchvision(dtype, antialias):
    x = images(4, shape=(3, 20, 30), dtype=torch.float32 if dtype == torch.float32 else torch.uint8).to(dtype)
    for size in (12, 26, (15, 9), 20):
        out = A.Resize(size, antialias=antialias)(x)
        for i in range(4):
            ref = TF.resize(x[i], size, antialias=antialias)
            assert out[i].dtype == dtype and out[i].shape == ref.shape
            tol = 1e-5 if dtype == torch.float32 else 1  # torch's uint8 kernel rounds its own way
            assert (out[i].double() - ref.double()).abs().max() <= tol


def test_resize_max_size_and_the_unchanged_input():
    x = images(2, shape=(3, 20, 60))
    out = A.Resize(10, max_size=24)(x)
    assert out.shape == (2, 3, 8, 24) and out.shape[2:] == TF.resize(x[0], 10, max_size=24).shape[1:]
    assert torch.equal(A.Resize(20)(x), x)


def test_center_crop_equals_torchvision_with_padding_and_odd_margins():
    sizes = [(40, 30), (25, 61), (33, 33), (18, 50), (23, 24)]
    xs, ms = ragged(sizes), ragged_masks(sizes)
    batch = A.Batch({"image": xs, "mask": ms}, {"image": "image", "mask": "mask"})
    for size in [(22, 24), (30, 45), 21]:
        out = A.CenterCrop(size)(batch)
        assert isinstance(out.fields["image"], torch.Tensor)
        for i in range(len(xs)):
            assert torch.equal(out.fields["image"][i], TF.center_crop(xs[i], size)), (size, i)
            assert torch.equal(out.fields["mask"][i], _tv_mask(TF.center_crop, ms[i], size)), (size, i)
    # a batch tensor, and a 3-D volume: the same rule per axis
    x = images(3, shape=(2, 19, 26))
    assert torch.equal(A.CenterCrop((10, 31))(x), torch.stack([TF.center_crop(v, [10, 31]) for v in x]))
    vol = torch.arange(2 * 7 * 9 * 10).view(2, 1, 7, 9, 10)
    assert torch.equal(A.CenterCrop((4, 9, 7))(vol), vol[..., 2:6, :, 2:9])


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
@pytest.mark.usefixtures("both_paths")
def test_resize_then_center_crop_of_a_list_equals_torchvision(dtype):
    xs = ragged(dtype=dtype)
    out = A.Compose([A.Resize(26), A.CenterCrop(24)])(xs)
    assert out.shape == (len(xs), 3, 24, 24) and out.dtype == dtype
    for i in range(len(xs)):
        close(out[i], TF.center_crop(TF.resize(xs[i], 26, antialias=True), [24, 24]))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_fused_resize_center_crop_equals_the_two_ops(dtype, monkeypatch):
    from lightning_fastdata import augment_base

    monkeypatch.setattr(augment_base, "HOST_SHORTCUTS", False)  # the fused form is the accelerators'
    xs = ragged(dtype=dtype) + ragged([(300, 20)], dtype=dtype)  # a very different size: its own group
    batch = A.Batch({"image": xs})
    fused = resize_center_crop(A.Resize(26), A.CenterCrop((24, 20)), batch)
    assert fused is not None
    apart = A.CenterCrop((24, 20))(A.Resize(26)(batch))
    assert torch.equal(fused.fields["image"], apart.fields["image"])
    assert resize_center_crop(A.Resize(26), A.CenterCrop(30), batch) is None  # a crop larger than a sample


def test_resize_and_center_crop_refuse_bad_arguments():
    with pytest.raises(ValueError, match="max_size"):
        A.Resize((10, 12), max_size=20)
    with pytest.raises(ValueError, match="max_size"):
        A.Resize(10, max_size=10)
    with pytest.raises(ValueError, match="size"):
        A.Resize((1, 2, 3))
    with pytest.raises(ValueError, match="2-D"):
        A.Resize(4)(torch.zeros(1, 1, 4, 4, 4))
    with pytest.raises(ValueError, match="3 values but the batch has 2"):
        A.CenterCrop((1, 2, 3))(torch.zeros(1, 1, 4, 4))
    with pytest.raises(ValueError, match="only the spatial size may vary"):
        A.CenterCrop(4)([torch.zeros(3, 8, 8), torch.zeros(1, 8, 8)])


def test_resize_of_a_ragged_list_gives_a_sample_the_same_pixels_alone_as_in_its_batch(monkeypatch):
    """On the accelerator path a ragged batch is resampled in groups whose widest sample sets the
    number of taps; the weights' normaliser, summed over the taps by ``sum``, paired its terms by
    that number, and a sample's pixels moved by 1 with the batch it came in (1 of 48 samples).
    Summed tap by tap, in order, it does not depend on the group."""
    from lightning_fastdata import augment_base

    monkeypatch.setattr(augment_base, "HOST_SHORTCUTS", False)
    g = torch.Generator().manual_seed(1)
    sizes = [tuple(int(v) for v in torch.randint(1, 400, (2,), generator=g)) for _ in range(48)]
    xs = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]
    op = A.Resize((40, 50))
    whole = op(A.Batch({"image": xs}, {"image": "image"}, keys(48))).fields["image"]
    for i in range(48):
        alone = op(A.Batch({"image": [xs[i]]}, {"image": "image"}, keys(1, start=i))).fields["image"]
        assert torch.equal(alone[0], whole[i]), (i, sizes[i])
