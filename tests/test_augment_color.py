"""Photometric ops: torchvision equality per sample (ToDtype for every integer dtype,
Normalize, ColorJitter, RandomErasing), torchvision's parameter distributions, and masks
and ``other`` fields left untouched."""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as TF
from _augment_util import both_paths, close, images, keys, ks_ok, tv_params, within_binomial  # noqa: F401

from lightning_fastdata import augment as A

INT_DTYPES = [torch.uint8, torch.int16, torch.uint16, torch.int32]


def _ints(dtype, shape=(4, 3, 6, 7)):
    top = {torch.uint8: 255, torch.int16: 32767, torch.uint16: 65535, torch.int32: 2**31 - 1}[dtype]
    low = -top - 1 if dtype.is_signed else 0
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 2**62, shape, dtype=torch.int64, generator=g) % (top - low + 1) + low
    x.view(-1)[:2] = torch.tensor([low, top])  # the extremes
    return x.to(dtype)


@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.parametrize("target", [torch.float32, torch.float64])
def test_to_dtype_scales_integers_by_their_maximum_as_torchvision(dtype, target):
    x = _ints(dtype)
    name = str(target).removeprefix("torch.")
    out = A.ToDtype(name, scale=True)(x)
    ref = TF.to_dtype(x, target, scale=True)
    assert out.dtype == target and torch.equal(out, ref)
    if dtype != torch.int32 or target == torch.float64:  # torchvision refuses float32 -> int32
        unit = ref.clamp(0, 1)
        back = A.ToDtype(str(dtype).removeprefix("torch."), scale=True)(unit)
        theirs = TF.to_dtype(unit, dtype, scale=True)
        if dtype == torch.uint16 and target == torch.float32:
            # float32(65535 + 1 - 1e-3) rounds to 65536: torchvision wraps 1.0 to 0; we clamp to 65535.
            theirs = torch.where(unit == 1.0, torch.tensor(65535, dtype=torch.int32), theirs.to(torch.int32))
            theirs = theirs.to(torch.uint16)
        assert torch.equal(back, theirs)


@pytest.mark.parametrize("src,dst", [(torch.uint8, torch.int16), (torch.int16, torch.uint8),
                                     (torch.uint16, torch.uint8), (torch.uint8, torch.uint16),
                                     (torch.int32, torch.int16)])
def test_to_dtype_between_integers_as_torchvision(src, dst):
    x = _ints(src).clamp(min=0) if src.is_signed else _ints(src)
    out = A.ToDtype(str(dst).removeprefix("torch."))(x)
    assert torch.equal(out, TF.to_dtype(x, dst, scale=True))


def test_to_dtype_clamps_out_of_range_floats_and_leaves_masks_alone():
    x = torch.tensor([-0.5, 0.0, 0.5, 1.0, 1.5]).view(1, 1, 1, 5)
    out = A.ToDtype("uint8")(x)
    assert out.view(-1).tolist() == [0, 0, 127, 255, 255]
    mask = torch.ones(1, 1, 5, dtype=torch.int64) * 3
    batch = A.Batch({"image": x, "mask": mask}, {"image": "image", "mask": "mask"})
    out = A.ToDtype("float16")(batch)
    assert out.fields["mask"] is mask and out.fields["image"].dtype == torch.float16
    with pytest.raises(ValueError, match="cannot convert"):
        A.ToDtype("int32")(torch.zeros(1, 1, 2, 2))
    with pytest.raises(ValueError, match="dtype must be one of"):
        A.ToDtype("int4")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.float32])
def test_normalize_equals_torchvision_and_scales_integers_by_their_maximum(dtype):
    x = images(4) if dtype != torch.int16 else (images(4).to(torch.int16) * 128)
    if dtype == torch.float32:
        x = x.float() / 255
    mean, std = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]
    out = A.Normalize(mean, std)(x)
    close(out, TF.normalize(TF.to_dtype(x, torch.float32, scale=True), mean, std))
    vol = torch.rand(2, 3, 4, 5, 6)
    ref = TF.normalize(vol.reshape(2, 3, 4, 30), mean, std).view(2, 3, 4, 5, 6)
    close(A.Normalize(mean, std)(vol), ref)
    with pytest.raises(ValueError, match="3 channel means, the batch has 2"):
        A.Normalize(mean, std)(torch.rand(2, 2, 4, 4))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_color_jitter_equals_torchvision(dtype):
    x = images(6, dtype=dtype)
    op = A.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4)
    p = op.draw(x, keys(6, seed=1))
    out = op.apply(x, **p)
    fns = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation]
    for i in range(6):
        ref = x[i]
        for k in p["order"][i].tolist():
            ref = fns[k](ref, float(p["factors"][i, k]))
        close(out[i], ref)


def test_color_jitter_skips_absent_adjustments():
    # Only brightness: float values above 1 survive the (absent) contrast/saturation clamps.
    x = torch.full((2, 3, 4, 4), 0.5)
    out = A.ColorJitter(brightness=(2.0, 2.0))(x)
    assert torch.allclose(out, TF.adjust_brightness(x, 2.0))


def test_color_jitter_parameters_match_torchvision():
    n = 6000
    p = A.ColorJitter(0.4, (0.5, 1.2), 0.8).draw(torch.zeros(n, 3, 2, 2), keys(n, seed=6))
    ref = tv_params(T.ColorJitter(0.4, (0.5, 1.2), 0.8), n)
    for k, key in enumerate(("brightness_factor", "contrast_factor", "saturation_factor")):
        assert ks_ok(p["factors"][:, k].numpy(), [r[key] for r in ref]), key
    # Every order of the three adjustments is equally likely (torchvision: randperm).
    codes = (p["order"] * torch.tensor([9, 3, 1])).sum(1)
    counts = torch.unique(codes, return_counts=True)[1]
    assert counts.numel() == 6 and all(within_binomial(int(c), n, 1 / 6) for c in counts)


@pytest.mark.parametrize("value", [0.0, (0.2, 0.4, 0.6), "random"])
def test_random_erasing_equals_torchvision(value):
    x = images(5, dtype=torch.float32)
    op = A.RandomErasing(p=1.0, value=value)
    p = op.draw(x, keys(5, seed=2))
    out = op.apply(x, **p)
    for i in range(5):
        box = [int(p[k][i]) for k in ("top", "left", "h", "w")]
        if value == "random":  # noise per pixel, keyed by the pixel: the box's share of it
            v = p["noise"]["image"][i, :, box[0]:box[0] + box[2], box[1]:box[1] + box[3]]
        else:
            v = torch.tensor([value] if isinstance(value, float) else value)[:, None, None]
        ref = TF.erase(x[i], *box, v) if p["erase"][i] else x[i]
        close(out[i], ref)


def test_random_erasing_parameters_match_torchvision():
    n = 4000
    p = A.RandomErasing(p=1.0).draw(torch.zeros(n, 3, 20, 24), keys(n, seed=7))
    ref = [r for r in tv_params(T.RandomErasing(p=1.0), n) if r["v"] is not None]
    sel = p["erase"].numpy()
    assert within_binomial(int(sel.sum()), n, len(ref) / n, sigmas=6)
    for ours, key in (("top", "i"), ("left", "j"), ("h", "h"), ("w", "w")):
        assert ks_ok(p[ours].numpy()[sel], [r[key] for r in ref]), key
    rate = int(A.RandomErasing(p=0.3).draw(torch.zeros(10_000, 3, 20, 24), keys(10_000, seed=8))["erase"].sum())
    assert within_binomial(rate, 10_000, 0.3 * sel.mean(), sigmas=6)


@pytest.mark.parametrize("op", [A.ToDtype("float32"), A.Normalize([0.5] * 3, [0.2] * 3),
                                A.ColorJitter(0.4, 0.4, 0.4), A.RandomErasing(p=1.0)],
                         ids=lambda o: type(o).__name__)
def test_photometric_ops_leave_masks_and_other_fields_untouched(op):
    x = images(4)
    mask = torch.randint(0, 3, (4, 20, 24))
    meta = [f"sample {i}" for i in range(4)]
    batch = A.Batch({"image": x, "mask": mask, "meta": meta}, {"image": "image", "mask": "mask"}, keys(4))
    out = op(batch)
    assert out.fields["mask"] is mask and out.fields["meta"] is meta
    assert not torch.equal(out.fields["image"].float(), x.float())


def test_bad_batches_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="channels"):
        A.ColorJitter(0.2)(torch.rand(2, 4, 8, 8))
    with pytest.raises(ValueError, match="float batch"):
        A.RandomErasing(p=1.0, value="random")(torch.zeros(2, 3, 8, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="2-D images"):
        A.ColorJitter(0.2)(torch.rand(2, 3, 4, 8, 8))
    with pytest.raises(ValueError, match="value"):
        A.RandomErasing(value="noise")


@pytest.mark.parametrize("make, match", [
    (lambda: A.Normalize([0.5], [float("nan")]), "std must be finite"),
    (lambda: A.Normalize([float("inf")], [0.2]), "mean must be finite"),
    (lambda: A.ColorJitter(brightness=float("inf")), "brightness must be finite"),
])
def test_photometric_ops_refuse_parameters_that_are_not_finite(make, match):
    """A NaN std or an infinite mean was accepted and made every pixel NaN or inf."""
    with pytest.raises(ValueError, match=match):
        make()


def test_contrast_of_a_float_sample_does_not_depend_on_its_batch_with_several_threads():
    """ColorJitter's contrast takes each sample's mean gray: summed in float32 over two threads,
    its last bit depended on how many samples the batch had (up to 1.2e-7 on 200k pixels of a
    224^2 sample); accumulated in float64, a sample alone and in a batch of 12 agree."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = images(12, shape=(3, 224, 224), dtype=torch.float32, seed=8)
        op = A.ColorJitter(contrast=0.6)
        k = keys(12, seed=3)
        whole = op(x, k)
        for i in (0, 5, 11):
            assert torch.equal(op(x[i:i + 1], k.take(torch.tensor([i]))), whole[i:i + 1]), i
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("value", [-1, 300, [0, 128, 256], 256.0])
def test_random_erasing_refuses_a_value_an_integer_image_cannot_hold(value):
    """uint8 images erased with -1 got 255, with 300 got 44, silently (the cast wraps), where the
    crops and resampling ops refuse such fills. 255.9 truncates to 255 and fits."""
    x = images(4)
    with pytest.raises(ValueError, match=r"RandomErasing value=.* does not fit the image field 'image' "
                                         r"\(torch.uint8, values 0..255\); give a value in that range"):
        A.RandomErasing(p=1.0, value=value)(x, keys(4))
    out = A.RandomErasing(p=1.0, value=255.9)(x, keys(4))
    assert out.dtype == torch.uint8 and int(out.max()) == 255


@pytest.mark.usefixtures("both_paths")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_normalize_to_half_precision_rounds_once(dtype):
    """Normalize(dtype=bfloat16) on uint8 computed with constants rounded to bfloat16: 72% of the
    pixels differed from the float32 result rounded once, by up to 3x bfloat16's own rounding."""
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    x = images(3, seed=4)
    out = A.Normalize(mean, std, dtype=dtype)(x)
    ref = ((x.double() / 255 - torch.tensor(mean, dtype=torch.float64).view(3, 1, 1))
           / torch.tensor(std, dtype=torch.float64).view(3, 1, 1))
    exact32 = A.Normalize(mean, std, dtype="float32")(x)
    assert out.dtype == getattr(torch, dtype)
    assert torch.equal(out, exact32.to(out.dtype))
    err = (out.double() - ref).abs().max()
    assert err <= (ref.abs().max() * (2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -11)).item()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.uint16, torch.int32])
@pytest.mark.parametrize("target", [torch.float16, torch.bfloat16])
def test_to_dtype_to_half_precision_gives_the_nearest_value(dtype, target):
    """ToDtype("float16") cast before scaling (as torchvision): uint16 65520..65535 and int32
    >= 2**20 became inf, int32 1 became 0, int16 and uint16 were up to a unit off. Now each value
    is the nearest of the target dtype; uint8 results stay torchvision's, bit for bit."""
    top = {torch.uint8: 255, torch.int16: 32767, torch.uint16: 65535, torch.int32: 2**31 - 1}[dtype]
    if dtype == torch.int32:
        g = torch.Generator().manual_seed(0)
        v = torch.cat([torch.tensor([0, 1, 2**20, top]), torch.randint(0, top, (20000,), generator=g),
                       torch.arange(top - 5000, top)])
    else:  # every value of the dtype
        v = torch.arange(-top - 1 if dtype.is_signed else 0, top + 1)
    x = v.to(dtype).view(1, 1, 1, -1)
    out = A.ToDtype(str(target).removeprefix("torch."))(x)
    assert out.dtype == target and bool(out.isfinite().all())
    # The nearest target value of each exact quotient, from every finite value of the target.
    grid = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(target).double()
    grid = grid[grid.isfinite()].unique()
    q = v.double() / top
    i = torch.searchsorted(grid, q).clamp(1, len(grid) - 1)
    lo, hi = grid[i - 1], grid[i]
    nearest = torch.where((hi - q).abs() < (q - lo).abs(), hi, lo)
    assert torch.equal(out.view(-1).double(), nearest)
    if dtype == torch.uint8:
        assert torch.equal(out, TF.to_dtype(x, target, scale=True))
