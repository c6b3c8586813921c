"""Batched augmentation: torchvision equality per sample, independence, distributions, format."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as TF

from lightning_fastdata import augment as A


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _images(n: int = 6, shape=(3, 20, 24), dtype=torch.uint8, seed: int = 0) -> torch.Tensor:
    x = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=_gen(seed))
    return x if dtype == torch.uint8 else x.to(dtype) / 255


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """uint8 within 1 (torch's fixed-point uint8 kernels round differently), floats within 1e-5."""
    assert a.dtype == b.dtype and a.shape == b.shape
    tol = 1.0 if a.dtype == torch.uint8 else 1e-5
    assert (a.double() - b.double()).abs().max().item() <= tol


def _ks(a, b) -> float:
    """Two-sample Kolmogorov-Smirnov statistic."""
    a, b = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    grid = np.concatenate([a, b])
    return float(
        np.abs(
            np.searchsorted(a, grid, "right") / a.size - np.searchsorted(b, grid, "right") / b.size
        ).max()
    )


def _ks_ok(a, b) -> bool:
    # Critical value at alpha = 1e-4 (c = 2.15): a false alarm once in 10,000 runs.
    n, m = len(a), len(b)
    return _ks(a, b) < 2.15 * math.sqrt((n + m) / (n * m))


def _tv_params(transform, n: int, shape=(3, 20, 24), seed: int = 1) -> list[dict]:
    torch.manual_seed(seed)
    img = torch.zeros(shape, dtype=torch.uint8)
    return [transform.make_params([img]) for _ in range(n)]


def _within_binomial(count: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1


# ----------------------------------------------------------------------------- equality per sample


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
@pytest.mark.parametrize("antialias", [True, False])
def test_random_resized_crop_equals_torchvision(dtype, antialias):
    x = _images(4, dtype=dtype)
    op = A.RandomResizedCrop((16, 12), antialias=antialias)
    top, left = torch.tensor([0, 3, 5, 1]), torch.tensor([0, 2, 7, 10])
    h, w = torch.tensor([20, 10, 4, 19]), torch.tensor([24, 5, 17, 14])
    out = op.apply(x, top, left, h, w)
    for i in range(4):
        ref = TF.resized_crop(
            x[i], int(top[i]), int(left[i]), int(h[i]), int(w[i]), [16, 12], antialias=antialias
        )
        _close(out[i], ref)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
@pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
def test_random_affine_equals_torchvision(dtype, interpolation):
    x = _images(4, dtype=dtype)
    fill = [10.0, 20.0, 30.0] if dtype == torch.uint8 else [0.1, 0.2, 0.3]
    op = A.RandomAffine(
        30,
        translate=(0.2, 0.2),
        scale=(0.8, 1.2),
        shear=(-10, 10, -5, 5),
        interpolation=interpolation,
        fill=fill,
        center=(9.0, 8.0),
    )
    p = op.draw(4, 20, 24, x.device, _gen(3))
    out = op.apply(x, **p)
    for i in range(4):
        ref = TF.affine(
            x[i],
            angle=float(p["angle"][i]),
            translate=[float(p["tx"][i]), float(p["ty"][i])],
            scale=float(p["scale"][i]),
            shear=[float(p["shear_x"][i]), float(p["shear_y"][i])],
            interpolation=T.InterpolationMode(interpolation),
            fill=fill,
            center=[9.0, 8.0],
        )
        _close(out[i], ref)


@pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
def test_random_rotation_equals_torchvision(interpolation):
    x = _images(4, dtype=torch.float32)
    op = A.RandomRotation(40, interpolation=interpolation)
    angle = torch.tensor([12.5, -33.0, 7.25, 20.0], dtype=torch.float64)
    out = op.apply_angle(x, angle)
    for i in range(4):
        # The transform passes its fill (default 0) to F.rotate; the functional defaults to None.
        ref = TF.rotate(
            x[i], float(angle[i]), interpolation=T.InterpolationMode(interpolation), fill=0
        )
        _close(out[i], ref)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_color_jitter_equals_torchvision(dtype):
    x = _images(6, dtype=dtype)
    op = A.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4)
    order, factors = op.draw(6, x.device, _gen(1))
    out = op.apply(x, order, factors)
    fns = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation]
    for i in range(6):
        ref = x[i]
        for k in order[i].tolist():
            ref = fns[k](ref, float(factors[i, k]))
        _close(out[i], ref)


def test_color_jitter_skips_absent_adjustments():
    # Only brightness: float values above 1 survive the (absent) contrast/saturation clamps.
    x = torch.full((2, 3, 4, 4), 0.5)
    op = A.ColorJitter(brightness=(2.0, 2.0))
    out = op(x, _gen())
    assert torch.allclose(out, TF.adjust_brightness(x, 2.0))


@pytest.mark.parametrize("value", [0.0, (0.2, 0.4, 0.6)])
def test_random_erasing_equals_torchvision(value):
    x = _images(5, dtype=torch.float32)
    op = A.RandomErasing(p=1.0, value=value)
    erase, top, left, h, w = op.draw(5, 20, 24, x.device, _gen(2))
    out = op.apply(x, erase, top, left, h, w)
    v = torch.tensor([value] if isinstance(value, float) else value)[:, None, None]
    for i in range(5):
        ref = (
            TF.erase(x[i], int(top[i]), int(left[i]), int(h[i]), int(w[i]), v) if erase[i] else x[i]
        )
        _close(out[i], ref)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_gaussian_noise_equals_torchvision(dtype):
    x = _images(1, dtype=dtype)
    out = A.GaussianNoise(mean=0.05, sigma=0.2)(x, _gen(9))
    torch.manual_seed(9)  # torchvision draws from the global generator
    ref = TF.gaussian_noise(x[0], mean=0.05, sigma=0.2)
    _close(out[0], ref)


def test_crop_flip_normalize_equal_torchvision():
    x = _images(4)
    crop = A.RandomCrop(16, padding=2, fill=7)
    oy, ox = crop.draw(x, _gen(4))
    out = crop(x, _gen(4))
    for i in range(4):
        padded = TF.pad(x[i], [2], fill=7)
        _close(out[i], TF.crop(padded, int(oy[i]), int(ox[i]), 16, 16))
    flip = A.RandomHorizontalFlip(p=0.5)
    mask = flip.draw(4, x.device, _gen(5))
    out = flip(x, _gen(5))
    for i in range(4):
        _close(out[i], TF.horizontal_flip(x[i]) if mask[i] else x[i])
    mean, std = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]
    out = A.Normalize(mean, std)(x)
    _close(out, TF.normalize(x.float() / 255, mean, std))
    _close(A.ToDtype("float32")(x), TF.to_dtype(x, torch.float32, scale=True))


def test_compose_fused_crop_flip_equals_the_ops_in_sequence():
    x = _images(8)
    crop, flip = A.RandomCrop(16, padding=2), A.RandomHorizontalFlip()
    fused = A.Compose([crop, flip])(x, _gen(6))
    g = _gen(6)
    oy, ox = crop.draw(x, g)
    mask = flip.draw(8, x.device, g)
    for i in range(8):
        ref = TF.crop(TF.pad(x[i], [2]), int(oy[i]), int(ox[i]), 16, 16)
        _close(fused[i], TF.horizontal_flip(ref) if mask[i] else ref)


# ----------------------------------------------------------------------------- batch properties


def _all_ops():
    return [
        A.RandomResizedCrop(12),
        A.RandomAffine(
            25, translate=(0.1, 0.1), scale=(0.9, 1.1), shear=5, interpolation="bilinear"
        ),
        A.RandomRotation(30, interpolation="bilinear"),
        A.ColorJitter(0.4, 0.4, 0.4),
        A.RandomErasing(p=1.0),
        A.GaussianNoise(sigma=0.1),
        A.RandomApply([A.ColorJitter(0.5, 0.5)], p=0.5),
        A.RandomCrop(12, padding=2),
        A.RandomHorizontalFlip(),
    ]


@pytest.mark.parametrize("op", _all_ops(), ids=lambda o: type(o).__name__)
def test_identical_images_come_out_varied(op):
    x = _images(1, dtype=torch.float32, shape=(3, 16, 16)).expand(32, -1, -1, -1).contiguous()
    out = op(x, _gen(11))
    distinct = {tuple(o.flatten().tolist()) for o in out}
    possible = 2 if isinstance(op, A.RandomHorizontalFlip) else 8  # a flip has two outcomes
    assert len(distinct) >= possible, f"{op!r}: only {len(distinct)} distinct outputs out of 32"


@pytest.mark.parametrize("op", _all_ops(), ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_only_the_given_generator_is_used_and_formats_are_kept(op, dtype):
    x = _images(4, dtype=dtype, shape=(3, 16, 16)).contiguous(memory_format=torch.channels_last)
    state = torch.get_rng_state()
    a, b = op(x, _gen(3)), op(x, _gen(3))
    assert torch.equal(torch.get_rng_state(), state), "the global generator was used"
    assert torch.equal(a, b), "same generator seed, different output"
    assert a.dtype == dtype
    assert a.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(
    # GaussianNoise is left out: its noise is drawn per pixel, frames included, by definition.
    "op",
    [o for o in _all_ops() if not isinstance(o, A.GaussianNoise)],
    ids=lambda o: type(o).__name__,
)
def test_leading_dims_share_the_sample_draw(op):
    frame = _images(3, dtype=torch.float32, shape=(3, 16, 16))
    video = torch.stack([frame, frame], dim=1)  # (N, T=2, C, H, W): two identical frames
    out = op(video, _gen(5))
    assert out.shape[:2] == (3, 2)
    assert torch.equal(out[:, 0], out[:, 1]), "frames of one sample got different parameters"
    assert torch.allclose(out[:, 0], op(frame, _gen(5)), atol=1e-6)


@pytest.mark.parametrize(
    "op",
    [
        A.RandomResizedCrop(12),
        A.RandomAffine(20, interpolation="bilinear"),
        A.ColorJitter(0.4, 0.4, 0.4),
    ],
    ids=lambda o: type(o).__name__,
)
def test_cpu_chunking_changes_nothing(op, monkeypatch):
    x = _images(7, shape=(3, 16, 16)).contiguous(memory_format=torch.channels_last)
    whole = op(x, _gen(12))
    monkeypatch.setattr(A, "_CPU_CHUNK_ELEMENTS", 2 * x[0].numel())  # chunks of 2 samples
    chunked = op(x, _gen(12))
    assert torch.equal(whole, chunked)
    assert chunked.is_contiguous(memory_format=torch.channels_last)


# ----------------------------------------------------------------------------- distributions


def test_flip_rate_within_binomial_bounds():
    n = 10_000
    for p in (0.5, 0.1):
        flips = int(A.RandomHorizontalFlip(p).draw(n, torch.device("cpu"), _gen(1)).sum())
        assert _within_binomial(flips, n, p)


def test_random_crop_offsets_are_uniform():
    n = 10_000
    oy, ox = A.RandomCrop(12, padding=2).draw(torch.zeros(n, 1, 16, 16), _gen(2))
    for offs in (oy, ox):
        counts = torch.bincount(offs, minlength=9)
        assert counts.numel() == 9
        assert all(_within_binomial(int(c), n, 1 / 9) for c in counts)


def test_random_resized_crop_parameters_match_torchvision():
    n = 4000
    for shape in ((3, 20, 24), (3, 10, 40)):  # the second often falls back to the central crop
        top, left, h, w = A.RandomResizedCrop(8).draw(
            n, shape[1], shape[2], torch.device("cpu"), _gen(3)
        )
        ref = _tv_params(T.RandomResizedCrop(8), n, shape)
        for ours, key in ((top, "top"), (left, "left"), (h, "height"), (w, "width")):
            assert _ks_ok(ours.numpy(), [r[key] for r in ref]), (shape, key)


def test_random_affine_parameters_match_torchvision():
    n = 4000
    kw = dict(degrees=(-20, 35), translate=(0.2, 0.1), scale=(0.7, 1.3), shear=(-10, 10, -4, 6))
    p = A.RandomAffine(**kw).draw(n, 20, 24, torch.device("cpu"), _gen(4))
    ref = _tv_params(T.RandomAffine(**kw), n)
    cols = {
        "angle": [r["angle"] for r in ref],
        "tx": [r["translate"][0] for r in ref],
        "ty": [r["translate"][1] for r in ref],
        "scale": [r["scale"] for r in ref],
        "shear_x": [r["shear"][0] for r in ref],
        "shear_y": [r["shear"][1] for r in ref],
    }
    for key, theirs in cols.items():
        assert _ks_ok(p[key].numpy(), theirs), key
    assert set(p["tx"].tolist()) <= set(range(-5, 6)), (
        "translations are whole pixels as in torchvision"
    )
    angle = A.RandomRotation((-10, 50)).draw(n, 20, 24, torch.device("cpu"), _gen(5))["angle"]
    assert _ks_ok(angle.numpy(), [r["angle"] for r in _tv_params(T.RandomRotation((-10, 50)), n)])


def test_color_jitter_parameters_match_torchvision():
    n = 6000
    order, factors = A.ColorJitter(0.4, (0.5, 1.2), 0.8).draw(n, torch.device("cpu"), _gen(6))
    ref = _tv_params(T.ColorJitter(0.4, (0.5, 1.2), 0.8), n)
    for k, key in enumerate(("brightness_factor", "contrast_factor", "saturation_factor")):
        assert _ks_ok(factors[:, k].numpy(), [r[key] for r in ref]), key
    # Every order of the three adjustments is equally likely (torchvision: randperm).
    codes = (order * torch.tensor([9, 3, 1])).sum(1)
    counts = torch.unique(codes, return_counts=True)[1]
    assert counts.numel() == 6 and all(_within_binomial(int(c), n, 1 / 6) for c in counts)


def test_random_erasing_parameters_match_torchvision():
    n = 4000
    erase, top, left, h, w = A.RandomErasing(p=1.0).draw(n, 20, 24, torch.device("cpu"), _gen(7))
    ref = [r for r in _tv_params(T.RandomErasing(p=1.0), n) if r["v"] is not None]
    sel = erase.numpy()
    assert _within_binomial(int(sel.sum()), n, len(ref) / n, sigmas=6)
    for ours, key in ((top, "i"), (left, "j"), (h, "h"), (w, "w")):
        assert _ks_ok(ours.numpy()[sel], [r[key] for r in ref]), key
    rate = int(A.RandomErasing(p=0.3).draw(10_000, 20, 24, torch.device("cpu"), _gen(8))[0].sum())
    assert _within_binomial(rate, 10_000, 0.3 * sel.mean(), sigmas=6)


def test_gaussian_noise_moments():
    x = torch.full((100, 3, 10, 10), 0.5)
    noise = A.GaussianNoise(mean=0.02, sigma=0.05, clip=False)(x, _gen(9)) - 0.5
    assert abs(noise.mean().item() - 0.02) < 0.002 and abs(noise.std().item() - 0.05) < 0.002


def test_random_apply_rate_and_untouched_samples():
    n = 10_000
    op = A.RandomApply([A.GaussianNoise(sigma=0.1, clip=False)], p=0.25)
    x = torch.full((n, 1, 2, 2), 0.5)
    out = op(x, _gen(10))
    changed = (out != x).flatten(1).any(1)
    assert _within_binomial(int(changed.sum()), n, 0.25)
    assert torch.equal(out[~changed], x[~changed])


# ----------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: A.RandomResizedCrop(0), "size"),
        (lambda: A.RandomResizedCrop(8, scale=(0.5, 0.1)), "scale"),
        (lambda: A.RandomResizedCrop(8, ratio=(0, 1)), "ratio"),
        (lambda: A.RandomAffine(10, translate=(1.5, 0)), "translate"),
        (lambda: A.RandomAffine(10, scale=(0, 1)), "scale"),
        (lambda: A.RandomAffine(10, shear=(1, 2, 3)), "shear"),
        (lambda: A.RandomAffine(10, interpolation="bicubic"), "interpolation"),
        (lambda: A.RandomRotation(-5), "degrees"),
        (lambda: A.ColorJitter(brightness=-0.1), "brightness"),
        (lambda: A.ColorJitter(contrast=(1.5, 0.5)), "contrast"),
        (lambda: A.RandomErasing(p=2), "p"),
        (lambda: A.RandomErasing(value="noise"), "value"),
        (lambda: A.GaussianNoise(sigma=-1), "sigma"),
        (lambda: A.RandomApply([A.GaussianNoise()], p=-0.1), "p"),
    ],
)
def test_bad_arguments_name_the_parameter(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_batches_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="channels"):
        A.ColorJitter(0.2)(torch.rand(2, 4, 8, 8), _gen())
    with pytest.raises(ValueError, match="fill"):
        A.RandomRotation(10, fill=[1.0, 2.0])(torch.rand(2, 3, 8, 8), _gen())
    with pytest.raises(ValueError, match="float batch"):
        A.RandomErasing(p=1.0, value="random")(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), _gen())
    with pytest.raises(ValueError, match="shape"):
        A.RandomApply([A.RandomResizedCrop(4)], p=1.0)(torch.rand(2, 3, 8, 8), _gen())


def test_ops_build_from_a_lightning_cli_config():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--augment", type=A.BatchTransform)
    config = {
        "class_path": "lightning_fastdata.augment.Compose",
        "init_args": {
            "transforms": [
                {
                    "class_path": "lightning_fastdata.augment.RandomResizedCrop",
                    "init_args": {"size": 12, "scale": [0.2, 1.0]},
                },
                {
                    "class_path": "lightning_fastdata.augment.RandomAffine",
                    "init_args": {"degrees": 10, "translate": [0.1, 0.1], "shear": [-5, 5, -2, 2]},
                },
                {
                    "class_path": "lightning_fastdata.augment.RandomRotation",
                    "init_args": {"degrees": 15},
                },
                {
                    "class_path": "lightning_fastdata.augment.ColorJitter",
                    "init_args": {"brightness": 0.3, "saturation": [0.5, 1.5]},
                },
                {
                    "class_path": "lightning_fastdata.augment.RandomApply",
                    "init_args": {
                        "p": 0.3,
                        "transforms": [
                            {
                                "class_path": "lightning_fastdata.augment.GaussianNoise",
                                "init_args": {"sigma": 0.05},
                            }
                        ],
                    },
                },
                {
                    "class_path": "lightning_fastdata.augment.RandomErasing",
                    "init_args": {"value": "random"},
                },
            ]
        },
    }
    cfg = parser.parse_object({"augment": config})
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    aug = instantiate(cfg).augment
    assert [type(t).__name__ for t in aug.transforms] == [
        "RandomResizedCrop",
        "RandomAffine",
        "RandomRotation",
        "ColorJitter",
        "RandomApply",
        "RandomErasing",
    ]
    out = aug(torch.rand(4, 3, 16, 16), _gen())
    assert out.shape == (4, 3, 12, 12)
