"""Intensity ops: MONAI's formulas per sample at the reported parameters (int16/uint16
volumes included), torchvision's Gaussian noise, rates and ranges of the draws."""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms.v2.functional as TF
from _augment_util import both_paths, close, images, keys, ks_ok, mirror_regimes, within_binomial  # noqa: F401

from lightning_fastdata import augment as A
from lightning_fastdata.augment_base import StoreRows


def _ct(n=3, shape=(1, 5, 6, 7), dtype=torch.int16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo = -1200 if dtype == torch.int16 else 0
    return torch.randint(lo, 2000, (n, *shape), generator=g, dtype=torch.int32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint16, torch.float32])
@pytest.mark.parametrize("clip", [False, True])
def test_scale_intensity_range_is_monai_windowing(dtype, clip):
    x = _ct(dtype=dtype)
    op = A.ScaleIntensityRange(a_min=-1000, a_max=1000, b_min=0.0, b_max=1.0, clip=clip)
    out = op(x)
    ref = (x.double() - -1000) / 2000 * (1.0 - 0.0) + 0.0
    if clip:
        ref = ref.clamp(0, 1)
    assert out.dtype == torch.float32
    close(out, ref.float())
    assert A.ScaleIntensityRange(0, 1, dtype="float64")(x).dtype == torch.float64
    with pytest.raises(ValueError, match="must differ"):
        A.ScaleIntensityRange(5, 5)


@pytest.mark.parametrize("window", [(-175, 250, 0.0, 1.0), (-1000, 1000, 0.0, 1.0), (-57, 164, -1.0, 1.0),
                                    (-160, 240, 0.5, 3.0)])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.usefixtures("mirror_regimes")
def test_scale_intensity_range_maps_a_min_and_a_max_exactly_as_monai(window, clip):
    """MONAI's float32 operations in its order, bit for bit: a voxel at a_min is b_min and one
    at a_max is b_max exactly (``x * scale + shift`` put a_min 3e-8 off b_min); alone and
    fused in a chain with a crop and other intensity ops."""
    a_min, a_max, b_min, b_max = window
    x = torch.arange(-1200, 1200, dtype=torch.int16).view(1, 1, 1, 24, 100)
    op = A.ScaleIntensityRange(a_min, a_max, b_min, b_max, clip=clip)
    out = op(x)
    xf = x.float()
    ref = (xf - a_min) / (a_max - a_min) * (b_max - b_min) + b_min  # MONAI's ScaleIntensityRange
    if clip:
        ref = ref.clamp(b_min, b_max)
    assert torch.equal(out, ref)
    flat = out.flatten()
    assert flat[a_min + 1200].item() == b_min and flat[a_max + 1200].item() == b_max
    k = keys(1)
    pipe = [A.RandomCrop((1, 24, 100)), A.RandomFlip((-3,)), op, A.RandomScaleIntensity(0.1)]
    fused = A.Compose(pipe)(x, k)
    factor = pipe[3].draw(x, k.child(3))["factor"]
    assert torch.equal(fused, ref * (1.0 + factor.float()).view(-1, 1, 1, 1, 1))


def test_random_scale_and_shift_follow_the_reported_parameters():
    x = _ct(8).float()
    scale = A.RandomScaleIntensity(0.2, p=0.5)
    p = scale.draw(x, keys(8, seed=1))
    out = scale.apply(x, **p)
    for i in range(8):
        close(out[i], x[i] * (1 + float(p["factor"][i])))
    shift = A.RandomShiftIntensity((-5, 10), p=1.0)
    p = shift.draw(x, keys(8, seed=2))
    out = shift.apply(x, **p)
    for i in range(8):
        close(out[i], x[i] + float(p["offset"][i]))
    ints = _ct(2)
    assert A.RandomScaleIntensity(0.1)(ints).dtype == torch.float32  # int16 converted, values kept


def test_random_intensity_draws_have_the_right_range_and_rate():
    n = 10_000
    z = torch.zeros(n, 1, 2, 2)
    f = A.RandomScaleIntensity(0.3, p=0.4).draw(z, keys(n))["factor"]
    on = f != 0
    assert within_binomial(int(on.sum()), n, 0.4)
    ref = torch.rand(n, generator=torch.Generator().manual_seed(0)) * 0.6 - 0.3
    assert ks_ok(f[on].numpy(), ref.numpy())
    g = A.RandomAdjustContrast(p=1.0).draw(z, keys(n))["gamma"]
    assert ks_ok(g.numpy(), (torch.rand(n, generator=torch.Generator().manual_seed(1)) * 4 + 0.5).numpy())
    assert A.RandomAdjustContrast(2.0).draw(z, keys(n))["gamma"].max() <= 2.0
    untouched = A.RandomScaleIntensity(0.3, p=0.4)(z + 1)
    assert torch.equal(untouched[~on], (z + 1)[~on])


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16])
def test_random_adjust_contrast_is_monai_gamma_per_sample(dtype):
    x = _ct(6, dtype=dtype, seed=3)
    x = x.float() / 1000 if dtype == torch.float32 else x
    op = A.RandomAdjustContrast(gamma=(0.5, 2.5), p=0.7)
    p = op.draw(x, keys(6, seed=4))
    out = op.apply(x, **p)
    assert out.dtype == torch.float32
    for i in range(6):
        img = x[i].double()
        g = float(p["gamma"][i])
        if g == 1.0:
            assert torch.equal(out[i], x[i].float())
            continue
        lo, span = img.min(), img.max() - img.min()
        ref = ((img - lo) / (span + 1e-7)) ** g * span + lo   # MONAI RandAdjustContrast
        close(out[i], ref.float())
    with pytest.raises(ValueError, match="> 0.5"):
        A.RandomAdjustContrast(0.4)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_gaussian_noise_equals_torchvision_at_the_drawn_noise(dtype, monkeypatch):
    x = images(2, dtype=dtype)
    op = A.GaussianNoise(mean=0.05, sigma=0.2)
    p = op.draw(x, keys(2, seed=9))
    out = op.apply(x, **p)
    for i in range(2):
        noise = p["noise"]["image"][i]
        monkeypatch.setattr(torch, "randn_like", lambda t, dtype=None, _z=noise: _z.to(dtype or t.dtype))
        close(out[i], TF.gaussian_noise(x[i], mean=0.05, sigma=0.2))


def test_gaussian_noise_on_unclipped_volumes_and_its_moments():
    x = torch.full((50, 1, 6, 10, 10), 300.0)
    out = A.GaussianNoise(mean=2.0, sigma=5.0, clip=False)(x) - 300.0
    assert out.shape == x.shape
    assert abs(out.mean().item() - 2.0) < 0.2 and abs(out.std().item() - 5.0) < 0.2
    with pytest.raises(ValueError, match="ScaleIntensityRange or ToDtype"):
        A.GaussianNoise()(_ct(2))


def test_gaussian_noise_gives_each_image_field_its_own_noise():
    x = torch.zeros(4, 1, 8, 8)
    batch = A.Batch({"a": x, "b": x, "m": torch.zeros(4, 8, 8)}, {"a": "image", "b": "image", "m": "mask"})
    out = A.GaussianNoise(clip=False)(batch)
    assert not torch.equal(out.fields["a"], out.fields["b"])
    assert out.fields["m"] is batch.fields["m"]


@pytest.mark.parametrize("op", [A.ScaleIntensityRange(-1000, 1000), A.RandomScaleIntensity(0.5),
                                A.RandomShiftIntensity(0.5), A.RandomAdjustContrast(), A.GaussianNoise(clip=False)],
                         ids=lambda o: type(o).__name__)
def test_intensity_ops_leave_masks_untouched(op):
    img = _ct(3).float()
    lab = (img > 0).to(torch.uint8)
    batch = A.Batch({"image": img, "label": lab}, {"image": "image", "label": "mask"}, keys(3))
    out = op(batch)
    assert out.fields["label"] is lab
    assert not torch.equal(out.fields["image"], img)


def _one_by_one(x, op, params):
    """The intensity ops as plain tensor formulas, one op at a time (each a full pass)."""
    if isinstance(op, A.ScaleIntensityRange):
        target = getattr(torch, op.dtype)
        dt = torch.float64 if torch.float64 in (x.dtype, target) else torch.float32
        out = (x.to(dt) - op.a_min) / (op.a_max - op.a_min) * (op.b_max - op.b_min) + op.b_min
        return (out.clamp_(op.b_min, op.b_max) if op.clip else out).to(target)
    y = x if x.is_floating_point() else x.to(torch.float32)
    per = (1.0 + params["factor"] if "factor" in params else params["offset"]).to(y.dtype)
    per = per.view(-1, *[1] * (y.ndim - 1))
    return y * per if "factor" in params else y + per


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint16, torch.uint8, torch.float16, torch.bfloat16,
                                   torch.float32, torch.float64])
@pytest.mark.parametrize("target", ["float32", "float16", "float64"])
@pytest.mark.parametrize("chunk", [1 << 19, 500, 37], ids=["whole-samples", "samples-per-chunk", "pieces"])
def test_compose_chains_intensity_ops_bit_identical_to_one_by_one(dtype, target, chunk, monkeypatch):
    """Consecutive ScaleIntensityRange / RandomScaleIntensity / RandomShiftIntensity run as one
    chain of elementwise steps over cache-sized chunks: the same draws and the same bits as the
    ops one after the other, and as their plain formulas; masks untouched."""
    from lightning_fastdata import augment, augment_intensity

    monkeypatch.setattr(augment_intensity, "POINTWISE_CHUNK", chunk)
    chains = []
    real = augment.run_pointwise
    monkeypatch.setattr(augment, "run_pointwise", lambda b, chain: chains.append(len(chain)) or real(b, chain))
    x = _ct(5, (2, 6, 7, 8), dtype, seed=3)
    if dtype.is_floating_point:
        x = (x.double() * 0.37).to(dtype)
    second = x[:, :1].to(torch.float32) * 2  # another image field, another dtype
    lab = (second[:, 0] > 0).to(torch.uint8)
    batch = A.Batch({"image": x, "second": second, "label": lab},
                    {"image": "image", "second": "image", "label": "mask"}, keys(5, seed=4))
    ops = [A.ScaleIntensityRange(-1000, 1000, -1.0, 1.0, clip=True, dtype=target), A.RandomScaleIntensity(0.1, p=0.7),
           A.RandomShiftIntensity(0.05, p=0.7), A.RandomScaleIntensity((-0.2, 0.3)), A.RandomAdjustContrast(),
           A.RandomShiftIntensity(0.5)]
    fused = A.Compose(ops)(batch)
    assert chains == [4]  # the contrast op ends the chain; the last op runs alone
    seq = batch
    for i, op in enumerate(ops):
        seq = op(seq, batch.keys.child(i))
    for name in ("image", "second"):
        plain = batch.fields[name]
        for i, op in enumerate(ops[:4]):
            plain = _one_by_one(plain, op, op.draw(batch, batch.keys.child(i)))
        partial = A.Compose(ops[:4])(batch).fields[name]
        assert partial.dtype == plain.dtype and torch.equal(partial, plain)
        assert fused.fields[name].dtype == seq.fields[name].dtype
        assert torch.equal(fused.fields[name], seq.fields[name])
    assert fused.fields["label"] is lab


class _MyWindow(A.ScaleIntensityRange):
    """A user's subclass: its parameters might depend on the pixels, so it is never drawn
    before the crop it follows has cut anything (it runs after the cut, as one by one)."""


@pytest.mark.parametrize("crop", ["label", "random", "random-padded", "subclass"])
@pytest.mark.parametrize("flip_dims", [None, (-1,), (-2,), (-3, -2, -1)], ids=["no-flip", "W", "H", "DHW"])
@pytest.mark.parametrize("from_rows", [False, True], ids=["batch", "store-rows"])
@pytest.mark.parametrize("chunk", [1 << 19, 150], ids=["whole-windows", "slabs-of-planes"])
@pytest.mark.usefixtures("both_paths", "mirror_regimes")
def test_crop_flip_and_intensity_chain_fused_equal_the_ops_one_by_one(crop, flip_dims, from_rows, chunk, monkeypatch):
    """On the CPU, Compose cuts a crop's image windows (mirrored by a following flip) straight
    into the intensity chain after it, a slab at a time (``pointwise_windows``): the same draws
    and the same bits as the ops one after the other, for int16 (two channels), float32 and uint8
    image fields, from a batch or from the store's rows (repeated rows too); masks cut alike, and
    ``other`` fields untouched. Padded crops and a user's subclass take the unfused path."""
    from lightning_fastdata import augment, augment_base, augment_crop, augment_intensity

    monkeypatch.setattr(augment_intensity, "POINTWISE_CHUNK", chunk)
    calls = []
    real = augment.pointwise_windows
    monkeypatch.setattr(augment, "pointwise_windows", lambda *a: calls.append(a[0].dtype) or real(*a))
    store = _ct(9, (2, 9, 10, 11), seed=5)
    second = store[:, :1].to(torch.float32) * 0.5 + 3  # another image field, another dtype
    third = (store[:, :1] % 251).to(torch.uint8)  # and a third
    lab = (store[:, :1] > 500).to(torch.uint8)
    rows = torch.tensor([4, 0, 8, 4, 2, 7])
    k = A.SampleKeys(1, 2, rows)
    kinds = {"image": "image", "second": "image", "third": "image", "label": "mask", "id": "other"}
    ident = torch.arange(6) * 10
    if from_rows:
        fields = {"image": StoreRows(store, rows), "second": StoreRows(second, rows), "third": StoreRows(third, rows),
                  "label": StoreRows(lab, rows)}
    else:
        fields = {"image": store[rows], "second": second[rows], "third": third[rows], "label": lab[rows]}
    batch = A.Batch({**fields, "id": ident}, kinds, k)
    first = {"label": A.RandomCropByLabel((5, 6, 7)), "random": A.RandomCrop((5, 6, 7)),
             "random-padded": A.RandomCrop((5, 6, 7), padding=1), "subclass": A.RandomCropByLabel((5, 6, 7))}[crop]
    window = (_MyWindow if crop == "subclass" else A.ScaleIntensityRange)(-1000, 1000, clip=True)
    ops = [first, *([A.RandomFlip(dims=flip_dims)] if flip_dims else []), window,
           A.RandomScaleIntensity(0.1, p=0.7), A.RandomShiftIntensity(0.05), A.RandomAdjustContrast()]
    fused = A.Compose(ops)(batch)
    seq = A.Batch({"image": store[rows], "second": second[rows], "third": third[rows], "label": lab[rows],
                   "id": ident}, kinds, k)
    for i, op in enumerate(ops):
        seq = op(seq, k.child(i))
    for name in kinds:
        assert fused.fields[name].dtype == seq.fields[name].dtype, name
        assert torch.equal(fused.fields[name], seq.fields[name]), name
    assert fused.fields["id"] is ident
    windows = augment_base.HOST_SHORTCUTS and augment_crop.WINDOWS_FROM_ELEMENTS == 0 and crop in ("label", "random")
    assert calls == ([torch.int16, torch.float32, torch.uint8] if windows else [])


def test_intensity_chain_keeps_channels_last_and_the_input():
    x = _ct(3, (1, 4, 5, 6)).float().contiguous(memory_format=torch.channels_last_3d)
    keep = x.clone()
    ops = [A.ScaleIntensityRange(-1000, 1000), A.RandomScaleIntensity(0.2)]
    out = A.Compose(ops)(x, keys(3))
    assert out.is_contiguous(memory_format=torch.channels_last_3d)
    assert torch.equal(out, ops[1](ops[0](x, keys(3).child(0)), keys(3).child(1)))
    assert torch.equal(x, keep)


@pytest.mark.parametrize("make, error, match", [
    (lambda: A.ScaleIntensityRange("x", 1000), TypeError, "a_min must be a number, got 'x'"),
    (lambda: A.ScaleIntensityRange(-1000, None), TypeError, "a_max must be a number, got None"),
    (lambda: A.ScaleIntensityRange(float("nan"), 1000), ValueError, "a_min must be finite, got nan"),
    (lambda: A.ScaleIntensityRange(-1000, float("inf")), ValueError, "a_max must be finite, got inf"),
    (lambda: A.ScaleIntensityRange(-1000, 1000, b_max=float("inf")), ValueError, "b_max must be finite, got inf"),
    (lambda: A.GaussianNoise(sigma="0.1"), TypeError, "sigma must be a number, got '0.1'"),
    (lambda: A.GaussianNoise(sigma=float("nan")), ValueError, "sigma must be finite, got nan"),
    (lambda: A.GaussianNoise(mean=float("inf")), ValueError, "mean must be finite, got inf"),
    (lambda: A.RandomAdjustContrast(float("nan")), ValueError, "gamma must be finite, got nan"),
    (lambda: A.RandomAdjustContrast(float("inf")), ValueError, "gamma must be finite, got inf"),
    (lambda: A.RandomScaleIntensity((0.0, float("inf"))), ValueError, "factors must be finite"),
    (lambda: A.RandomShiftIntensity(float("inf")), ValueError, "offsets must be finite"),
])
def test_intensity_ops_refuse_parameters_that_are_not_finite_numbers(make, error, match):
    """NaN or infinite parameters used to be accepted and turned every voxel into NaN (or inf);
    strings failed on float() or a comparison without naming the parameter."""
    with pytest.raises(error, match=match):
        make()


def test_random_adjust_contrast_takes_a_single_gamma_as_a_numpy_scalar_or_0d_tensor():
    """``RandomAdjustContrast(gamma=np.float32(2.0))`` (or np.int64(2), torch.tensor(2.0)) was read
    as a pair and refused with "gamma must be an increasing pair within [0.0, inf]", while 2.0
    was taken as the range (0.5, 2.0)."""
    np = pytest.importorskip("numpy")
    x = torch.rand(64, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    want = A.RandomAdjustContrast(2.0).draw(x, keys(64))["gamma"]
    for g in (np.float32(2.0), np.float64(2.0), np.int64(2), torch.tensor(2.0), torch.tensor(2)):
        op = A.RandomAdjustContrast(g)
        assert torch.equal(op.draw(x, keys(64))["gamma"], want), type(g)
        assert repr(op) in ("RandomAdjustContrast(p=1.0, gamma=2.0)", "RandomAdjustContrast(p=1.0, gamma=2)")
    with pytest.raises(ValueError, match=r"gamma as a single number must be > 0.5 \(the range is \(0.5, gamma\)\)"):
        A.RandomAdjustContrast(np.float32(0.4))
