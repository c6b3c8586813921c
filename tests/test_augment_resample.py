"""Resized crops and affine maps: torchvision equality per sample for images and masks (2-D),
torchvision's parameter distributions, and 3-D affine maps against per-slice torchvision and
torch.rot90."""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as TF
from _augment_util import both_paths, close, images, keys, ks_ok, ragged, ragged_masks, tv_params  # noqa: F401
from torchvision import tv_tensors

from lightning_fastdata import augment as A
from lightning_fastdata import augment_base
from lightning_fastdata.augment_resample import inverse_affine_3d


def _box(n=4):
    return {"top": torch.tensor([0, 3, 5, 1])[:n], "left": torch.tensor([0, 2, 7, 10])[:n],
            "height": torch.tensor([20, 10, 4, 19])[:n], "width": torch.tensor([24, 5, 17, 14])[:n]}


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
@pytest.mark.parametrize("antialias", [True, False])
@pytest.mark.usefixtures("both_paths")
def test_random_resized_crop_equals_torchvision(dtype, antialias):
    x = images(4, dtype=dtype)
    op = A.RandomResizedCrop((16, 12), antialias=antialias)
    b = _box()
    out = op.apply(x, **b)
    for i in range(4):
        ref = TF.resized_crop(x[i], int(b["top"][i]), int(b["left"][i]), int(b["height"][i]), int(b["width"][i]),
                              [16, 12], antialias=antialias)
        close(out[i], ref)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
@pytest.mark.usefixtures("both_paths")
def test_random_resized_crop_of_a_list_equals_torchvision_per_sample(dtype):
    """Variable-size images (a ragged batch) become one batch; each box is drawn from its
    own sample's size and resized as torchvision's resized_crop; masks follow, nearest."""
    xs, ms = ragged(dtype=dtype), ragged_masks()
    batch = A.Batch({"image": xs, "mask": ms}, {"image": "image", "mask": "mask"}, keys(len(xs), seed=9))
    op = A.RandomResizedCrop((16, 12))
    p = op.draw(batch)
    out = op.apply(batch, **p)
    assert out.fields["image"].shape == (len(xs), 3, 16, 12) and out.fields["mask"].shape == (len(xs), 16, 12)
    for i, x in enumerate(xs):
        box = [int(p[k][i]) for k in ("top", "left", "height", "width")]
        assert box[0] + box[2] <= x.shape[1] and box[1] + box[3] <= x.shape[2], (i, box)
        close(out.fields["image"][i], TF.resized_crop(x, *box, [16, 12], antialias=True))
        ref = TF.resized_crop(tv_tensors.Mask(ms[i]), *box, [16, 12]).as_subclass(torch.Tensor)
        assert torch.equal(out.fields["mask"][i], ref), i
    assert torch.equal(op(batch).fields["image"], out.fields["image"])


def test_random_resized_crop_draws_each_box_from_its_own_sample():
    """A sample's box in a list is the box it gets alone in a batch tensor (same keys), and
    the central fallback follows each sample's aspect ratio."""
    sizes = [(40, 30), (25, 61), (8, 90), (90, 8), (33, 33)]
    xs = ragged(sizes)
    k = keys(len(xs), seed=4)
    op = A.RandomResizedCrop(8, scale=(0.9, 1.0), ratio=(0.9, 1.1))  # thin samples fall back
    p = op.draw(xs, k)
    for i, x in enumerate(xs):
        alone = op.draw(x[None], k.take(torch.tensor([i])))
        assert all(int(alone[name][0]) == int(p[name][i]) for name in p), (i, alone, p)
    # torchvision's fallback, per sample: the central crop at the nearest allowed ratio
    assert [int(p[n][2]) for n in ("top", "left", "height", "width")] == [0, 40, 8, 9]
    assert [int(p[n][3]) for n in ("top", "left", "height", "width")] == [40, 0, 9, 8]
    # and equal sizes give what a batch tensor gives
    same = ragged([(20, 24)] * 4)
    a, b = op.draw(same, keys(4)), op.draw(torch.stack(same), keys(4))
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert torch.equal(op(same, keys(4)), op(torch.stack(same), keys(4)))


@pytest.mark.parametrize("size", [(16, 12), (5, 7), (40, 48)])
def test_random_resized_crop_resizes_masks_nearest_as_torchvision(size):
    x = images(4)
    mask = (torch.arange(20 * 24).view(1, 20, 24) % 7).expand(4, 20, 24).contiguous()
    batch = A.Batch({"image": x, "mask": mask}, {"image": "image", "mask": "mask"})
    b = _box()
    out = A.RandomResizedCrop(size).apply(batch, **b)
    assert out.fields["mask"].dtype == mask.dtype
    for i in range(4):
        ref = TF.resized_crop(tv_tensors.Mask(mask[i]), int(b["top"][i]), int(b["left"][i]), int(b["height"][i]),
                              int(b["width"][i]), list(size))
        assert torch.equal(out.fields["mask"][i], ref.as_subclass(torch.Tensor)), i


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
@pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
def test_random_affine_equals_torchvision(dtype, interpolation):
    x = images(4, dtype=dtype)
    fill = [10.0, 20.0, 30.0] if dtype == torch.uint8 else [0.1, 0.2, 0.3]
    op = A.RandomAffine(30, translate=(0.2, 0.2), scale=(0.8, 1.2), shear=(-10, 10, -5, 5),
                        interpolation=interpolation, fill=fill, center=(9.0, 8.0))
    p = op.draw(x, keys(4, seed=3))
    out = op.apply(x, **p)
    for i in range(4):
        ref = TF.affine(x[i], angle=float(p["angle"][i]), translate=[float(p["tx"][i]), float(p["ty"][i])],
                        scale=float(p["scale"][i]), shear=[float(p["shear_x"][i]), float(p["shear_y"][i])],
                        interpolation=T.InterpolationMode(interpolation), fill=fill, center=[9.0, 8.0])
        close(out[i], ref)


@pytest.mark.parametrize("op", [A.RandomAffine(30, translate=(0.2, 0.2), scale=(0.8, 1.2), shear=8,
                                               interpolation="bilinear"),
                                A.RandomRotation(40, interpolation="bilinear")], ids=lambda o: type(o).__name__)
def test_affine_masks_are_nearest_with_zero_outside_as_torchvision(op):
    x = images(4, dtype=torch.float32)
    mask = (torch.arange(20 * 24).view(20, 24) % 5 + 1).expand(4, 1, 20, 24).to(torch.int64).contiguous()
    batch = A.Batch({"image": x, "mask": mask}, {"image": "image", "mask": "mask"}, keys(4, seed=5))
    p = op.draw(batch)
    out = op.apply(batch, **p)
    assert out.fields["mask"].dtype == torch.int64
    for i in range(4):
        if "tx" in p:
            ref = TF.affine(tv_tensors.Mask(mask[i]), angle=float(p["angle"][i]),
                            translate=[float(p["tx"][i]), float(p["ty"][i])], scale=float(p["scale"][i]),
                            shear=[float(p["shear_x"][i]), float(p["shear_y"][i])])
        else:
            ref = TF.rotate(tv_tensors.Mask(mask[i]), float(p["angle"][i]))
        assert torch.equal(out.fields["mask"][i], ref.as_subclass(torch.Tensor)), i


@pytest.mark.parametrize("image_dtype, mask_dtype, spatial", [
    (torch.uint8, torch.int64, (96, 96)), (torch.float64, torch.uint8, (96, 96)), (torch.uint8, torch.int32, (96, 96)),
    (torch.float32, torch.int16, (96, 96)), (torch.uint8, torch.int64, (24, 24, 24)),
    (torch.float64, torch.uint8, (24, 24, 24))], ids=str)
def test_affine_masks_take_the_image_grid_whatever_the_dtypes(image_dtype, mask_dtype, spatial):
    """A mask equal to the image (values 0..255) is still equal to it after a rotation, for
    every pair of dtypes: the mask is resampled on the image field's grid (its dtype, its CPU
    chunks), so no pick near a pixel boundary comes from the neighbour pixel. 64 x 96^2 is
    more than one CPU chunk of the image."""
    n = 64 if len(spatial) == 2 else 16
    img = torch.randint(0, 256, (n, 1, *spatial), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    batch = A.Batch({"image": img.to(image_dtype), "mask": img[:, 0].to(mask_dtype)},
                    {"image": "image", "mask": "mask"}, keys(n))
    op = A.RandomRotation(180) if len(spatial) == 2 else A.RandomAffine(180, scale=(0.7, 1.3), axes=(-3, -2, -1))
    out = op(batch)
    assert out.fields["mask"].dtype == mask_dtype
    assert torch.equal(out.fields["mask"].long(), out.fields["image"][:, 0].long())


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.uint16, torch.int64, torch.float16])
def test_affine_masks_keep_every_label_exactly(dtype, monkeypatch):
    """Labels are gathered, not interpolated: extreme values of every dtype survive, 0 fills the
    outside; samples of 2**24 pixels or more (two index maps) pick the same pixels."""
    from lightning_fastdata import augment_resample

    top = {torch.bool: True, torch.uint8: 255, torch.uint16: 65535, torch.int64: 2**62 + 1, torch.float16: 65504.0}
    mask = torch.full((3, 20, 24), top[dtype], dtype=dtype)
    mask[:, ::3] = 0 if dtype == torch.bool else 1
    batch = A.Batch({"image": images(3), "mask": mask}, {"image": "image", "mask": "mask"}, keys(3, seed=2))
    op = A.RandomAffine(40, translate=(0.2, 0.2), scale=(0.7, 1.2))
    out = op(batch).fields["mask"]
    assert out.dtype == dtype and set(out.unique().tolist()) == set(mask.unique().tolist()) | {0}
    monkeypatch.setattr(augment_resample, "_EXACT_FLOAT32", 16)
    assert torch.equal(op(batch).fields["mask"], out)


@pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
def test_random_rotation_equals_torchvision(interpolation):
    x = images(4, dtype=torch.float32)
    op = A.RandomRotation(40, interpolation=interpolation)
    angle = torch.tensor([12.5, -33.0, 7.25, 20.0], dtype=torch.float64)
    out = op.apply(x, angle=angle)
    for i in range(4):
        # The transform passes its fill (default 0) to F.rotate; the functional defaults to None.
        ref = TF.rotate(x[i], float(angle[i]), interpolation=T.InterpolationMode(interpolation), fill=0)
        close(out[i], ref)


def test_random_resized_crop_parameters_match_torchvision():
    n = 4000
    for shape in ((3, 20, 24), (3, 10, 40)):  # the second often falls back to the central crop
        p = A.RandomResizedCrop(8).draw(torch.zeros(n, *shape), keys(n, seed=3))
        ref = tv_params(T.RandomResizedCrop(8), n, shape)
        for key in ("top", "left", "height", "width"):
            assert ks_ok(p[key].numpy(), [r[key] for r in ref]), (shape, key)


def test_random_affine_parameters_match_torchvision():
    n = 4000
    kw = dict(degrees=(-20, 35), translate=(0.2, 0.1), scale=(0.7, 1.3), shear=(-10, 10, -4, 6))
    p = A.RandomAffine(**kw).draw(torch.zeros(n, 3, 20, 24), keys(n, seed=4))
    ref = tv_params(T.RandomAffine(**kw), n)
    cols = {"angle": [r["angle"] for r in ref], "tx": [r["translate"][0] for r in ref],
            "ty": [r["translate"][1] for r in ref], "scale": [r["scale"] for r in ref],
            "shear_x": [r["shear"][0] for r in ref], "shear_y": [r["shear"][1] for r in ref]}
    for key, theirs in cols.items():
        assert ks_ok(p[key].numpy(), theirs), key
    assert set(p["tx"].tolist()) <= set(range(-5, 6)), "translations are whole pixels as in torchvision"
    angle = A.RandomRotation((-10, 50)).draw(torch.zeros(n, 3, 20, 24), keys(n, seed=5))["angle"]
    assert ks_ok(angle.numpy(), [r["angle"] for r in tv_params(T.RandomRotation((-10, 50)), n)])


@pytest.mark.parametrize("op", [A.RandomResizedCrop(12), A.RandomAffine(20, interpolation="bilinear")],
                         ids=lambda o: type(o).__name__)
def test_cpu_chunking_changes_nothing(op, monkeypatch):
    x = images(7, shape=(3, 16, 16)).contiguous(memory_format=torch.channels_last)
    whole = op(x, keys(7, seed=12))
    monkeypatch.setattr(augment_base, "CPU_CHUNK_ELEMENTS", 2 * x[0].numel())  # chunks of 2 samples
    chunked = op(x, keys(7, seed=12))
    assert torch.equal(whole, chunked)
    assert chunked.is_contiguous(memory_format=torch.channels_last)


# ----------------------------------------------------------------------------- 3-D


def _per_slice(vol, axis, angle, t_cols, t_rows, scale, interpolation):
    """Reference: torchvision's 2-D F.affine on every slice across ``axis`` of a (C, D, H, W) volume."""
    perm = {-3: (1, 0, 2, 3), -2: (2, 0, 1, 3), -1: (3, 0, 1, 2)}[axis]
    slices = vol.permute(*perm)  # (S, C, rows, cols)
    out = torch.stack([TF.affine(s, angle=angle, translate=[t_cols, t_rows], scale=scale, shear=[0.0, 0.0],
                                 interpolation=T.InterpolationMode(interpolation), fill=0) for s in slices])
    inv = [perm.index(i) for i in range(4)]
    return out.permute(*inv)


@pytest.mark.parametrize("axis", [-3, -2, -1])
@pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
def test_affine_3d_about_one_axis_equals_torchvision_on_every_slice(axis, interpolation):
    vol = torch.rand(3, 2, 7, 9, 8, generator=torch.Generator().manual_seed(1))
    op = A.RandomAffine(45, interpolation=interpolation, axes=(axis,))
    angles = torch.tensor([[17.0], [-33.5], [90.0]], dtype=torch.float64)
    # translate (tx, ty, tz) in (w, h, d) voxels: only the two axes of the rotated plane move.
    shifts = {-3: [(2, -1, 0), (0, 3, 0), (-1, 0, 0)], -2: [(2, 0, 1), (0, 0, -2), (1, 0, 0)],
              -1: [(0, 2, 1), (0, -1, 0), (0, 1, 2)]}[axis]
    translate = torch.tensor(shifts, dtype=torch.float64)
    out = op.apply(vol, angles=angles, translate=translate, scale=torch.ones(3, dtype=torch.float64))
    for i in range(3):
        tx, ty, tz = shifts[i]
        cols, rows = {-3: (tx, ty), -2: (tx, tz), -1: (ty, tz)}[axis]
        ref = _per_slice(vol[i], axis, float(angles[i, 0]), cols, rows, 1.0, interpolation)
        close(out[i], ref)


@pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
def test_affine_3d_scale_equals_torch_affine_grid(interpolation):
    """Isotropic scale of a cube: torch's own affine_grid (normalised coordinates) is the reference."""
    vol = torch.rand(2, 2, 6, 6, 6, generator=torch.Generator().manual_seed(3))
    scale = torch.tensor([0.8, 1.3], dtype=torch.float64)
    out = A.RandomAffine(0, scale=(0.5, 2), interpolation=interpolation).apply(
        vol, angles=torch.zeros(2, 1, dtype=torch.float64), translate=torch.zeros(2, 3, dtype=torch.float64),
        scale=scale)
    theta = torch.zeros(2, 3, 4)
    for i in range(3):
        theta[:, i, i] = (1 / scale).float()
    grid = torch.nn.functional.affine_grid(theta, list(vol.shape), align_corners=False)
    ref = torch.nn.functional.grid_sample(vol, grid, mode=interpolation, align_corners=False)
    if interpolation == "bilinear":
        # torchvision's fill convention (2-D F.affine), kept in 3-D: blend toward the fill (0)
        # by the share of the sample's footprint that falls inside the input.
        ref = ref * torch.nn.functional.grid_sample(torch.ones_like(vol[:, :1]), grid, align_corners=False)
    close(out, ref)


def test_affine_3d_quarter_turns_nearest_equal_torch_rot90():
    vol = torch.randint(0, 256, (2, 1, 5, 5, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    lab = (vol > 128).to(torch.int64)
    batch = A.Batch({"image": vol, "label": lab}, {"image": "image", "label": "mask"})
    zero, one = torch.zeros(2, 3, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    # A quarter turn about one axis is a rot90 in the plane of the two others.
    for axis, plane in ((-3, (-2, -1)), (-2, (-3, -1)), (-1, (-3, -2))):
        op = A.RandomAffine(90, axes=(axis,))
        out = op.apply(batch, angles=torch.full((2, 1), 90.0, dtype=torch.float64), translate=zero, scale=one)
        # F.affine's sense: a positive angle turns clockwise, rot90 k=-1.
        for i in range(2):
            assert torch.equal(out.fields["image"][i], torch.rot90(vol[i], -1, plane)), axis
            assert torch.equal(out.fields["label"][i], torch.rot90(lab[i], -1, plane)), axis
    # Two axes: the last listed turns first.
    op = A.RandomAffine(90, axes=(-3, -1))
    out = op.apply(vol, angles=torch.tensor([[90.0, 180.0], [0.0, 90.0]], dtype=torch.float64),
                   translate=zero, scale=one)
    first = A.RandomAffine(90, axes=(-1,)).apply(vol, angles=torch.tensor([[180.0], [90.0]], dtype=torch.float64),
                                                 translate=zero, scale=one)
    both = A.RandomAffine(90, axes=(-3,)).apply(first, angles=torch.tensor([[90.0], [0.0]], dtype=torch.float64),
                                                translate=zero, scale=one)
    assert torch.equal(out, both)


@pytest.mark.parametrize("degrees,k", [(90, 1), (-90, -1)])
def test_rotation_3d_quarter_turns_equal_torch_rot90_counter_clockwise(degrees, k):
    """RandomRotation turns volumes in its documented (torchvision rotate's) sense on every
    axis: a positive quarter turn is rot90 k=+1 on the plane of the two other axes, image
    and mask alike, as the 2-D op turns an image (it turned the other way)."""
    vol = torch.randint(0, 256, (2, 1, 5, 5, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    lab = (vol > 100).to(torch.uint8) + (vol > 200).to(torch.uint8)
    batch = A.Batch({"image": vol, "label": lab}, {"image": "image", "label": "mask"}, keys(2))
    for axis, plane in ((-3, (-2, -1)), (-2, (-3, -1)), (-1, (-3, -2))):
        out = A.RandomRotation((degrees, degrees), axes=(axis,))(batch)
        assert torch.equal(out.fields["image"], torch.rot90(vol, k, plane)), axis
        assert torch.equal(out.fields["label"], torch.rot90(lab, k, plane)), axis
    # Two axes, the last listed first: a quarter turn about W, then one about D.
    out = A.RandomRotation((degrees, degrees), axes=(-3, -1))(vol, keys(2))
    assert torch.equal(out, torch.rot90(torch.rot90(vol, k, (-3, -2)), k, (-2, -1)))


def test_rotation_3d_about_depth_turns_each_slice_as_the_2d_op():
    vol = torch.rand(3, 1, 4, 9, 9, generator=torch.Generator().manual_seed(5))
    op = A.RandomRotation(50, interpolation="bilinear", axes=(-3,))
    p = op.draw(vol, keys(3))
    out = op.apply(vol, **p)
    for i in range(3):
        angle = p["angles"][i, 0].expand(4)
        close(out[i, 0], A.RandomRotation(50, interpolation="bilinear").apply(vol[i, 0, :, None], angle=angle)[:, 0])


def test_affine_3d_matrix_composes_the_single_axis_maps():
    angles = torch.tensor([[10.0, -25.0, 40.0]], dtype=torch.float64)
    zero, one = torch.zeros(1, 3, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    whole = inverse_affine_3d(angles, (-3, -2, -1), zero, one)[0, :, :3]
    parts = [inverse_affine_3d(angles[:, i:i + 1], (a,), zero, one)[0, :, :3] for i, a in enumerate((-3, -2, -1))]
    # forward R = R_d R_h R_w (the last listed first), so the inverse is R_w^-1 R_h^-1 R_d^-1
    assert torch.allclose(whole, parts[2] @ parts[1] @ parts[0])
    assert torch.allclose(whole @ whole.T, torch.eye(3, dtype=torch.float64))


def test_affine_3d_parameters():
    n = 4000
    op = A.RandomAffine((-10, 30), translate=(0.1, 0.2, 0.25), scale=(0.9, 1.1), axes=(-3, -1))
    p = op.draw(torch.zeros(n, 1, 8, 10, 20), keys(n))
    assert p["angles"].shape == (n, 2) and p["translate"].shape == (n, 3) and p["scale"].shape == (n,)
    assert -10 <= p["angles"].min() and p["angles"].max() <= 30
    assert set(p["translate"][:, 0].tolist()) == set(range(-2, 3))   # 0.1 * W=20
    assert set(p["translate"][:, 1].tolist()) == set(range(-2, 3))   # 0.2 * H=10
    assert set(p["translate"][:, 2].tolist()) == set(range(-2, 3))   # 0.25 * D=8
    assert abs(torch.corrcoef(p["angles"].T)[0, 1].item()) < 0.08
    with pytest.raises(ValueError, match="2-D only"):
        A.RandomAffine(10, shear=5)(torch.zeros(2, 1, 4, 4, 4))
    with pytest.raises(ValueError, match="3 fractions"):
        A.RandomAffine(10, translate=(0.1, 0.1))(torch.zeros(2, 1, 4, 4, 4))
    with pytest.raises(ValueError, match="2-D images"):
        A.RandomResizedCrop(4)(torch.zeros(2, 1, 4, 4, 4))


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint16])
def test_resampling_keeps_the_range_of_wide_integer_images(dtype):
    """int16 CT keeps its negative values; uint16 its values above 255."""
    base = torch.arange(-1000, 1000, 2000 / 576, dtype=torch.float64)[:576].view(1, 1, 24, 24).round()
    x = (base if dtype == torch.int16 else base + 1000 * 30).to(torch.int32).to(dtype).expand(2, 1, 24, 24)
    zero = torch.zeros(2, dtype=torch.float64)
    out = A.RandomAffine(0, interpolation="bilinear").apply(
        x, angle=zero, tx=zero, ty=zero, scale=torch.ones(2, dtype=torch.float64), shear_x=zero, shear_y=zero)
    assert out.dtype == dtype and torch.equal(out.to(torch.int32), x.to(torch.int32))
    full = {"top": torch.zeros(2, dtype=torch.long), "left": torch.zeros(2, dtype=torch.long),
            "height": torch.full((2,), 24), "width": torch.full((2,), 24)}
    same = A.RandomResizedCrop(24).apply(x, **full)
    assert torch.equal(same.to(torch.int32), x.to(torch.int32))


@pytest.mark.parametrize("as_list", [True, False])
@pytest.mark.usefixtures("both_paths")
def test_resized_crop_then_flip_in_compose_equals_the_ops_one_by_one(as_list):
    """Compose mirrors the new crops in place: the same pixels as the two ops in sequence, for
    image and mask fields, and the caller's tensors untouched."""
    if as_list:
        xs, ms = ragged(), ragged_masks()
    else:
        xs, ms = images(5), (images(5)[:, 0] > 128).to(torch.int64)
    before = ([x.clone() for x in xs], [m.clone() for m in ms])
    batch = A.Batch({"image": xs, "mask": ms}, {"image": "image", "mask": "mask"}, keys(len(xs), seed=4))
    ops = [A.RandomResizedCrop((16, 12)), A.RandomHorizontalFlip()]
    out = A.Compose(ops)(batch)
    seq = ops[1](ops[0](batch, batch.keys.child(0)), batch.keys.child(1))
    flipped = A.RandomHorizontalFlip().draw(seq, batch.keys.child(1))["flip"]
    assert 0 < int(flipped.sum()) < len(xs)  # some samples mirrored, some not
    for name in ("image", "mask"):
        assert torch.equal(out.fields[name], seq.fields[name]), name
    assert all(torch.equal(a, b) for a, b in zip([*xs, *ms], [*before[0], *before[1]], strict=True))


@pytest.mark.parametrize("make, match", [
    (lambda: A.RandomAffine(float("inf")), "degrees must be finite, got inf"),
    (lambda: A.RandomAffine((0, float("inf"))), "degrees must be finite"),
    (lambda: A.RandomAffine(10, scale=(0.9, float("inf"))), "scale must be finite"),
    (lambda: A.RandomAffine(10, shear=float("inf")), "shear must be finite"),
    (lambda: A.RandomRotation(float("inf")), "degrees must be finite"),
    (lambda: A.RandomResizedCrop(8, ratio=(0.5, float("inf"))), "ratio must be finite"),
])
def test_ranges_refuse_infinite_bounds(make, match):
    """An infinite bound was accepted and drew inf/nan angles, scales or ratios: every sample
    came out filled (or as NaN) without an error."""
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("make", [lambda f: A.RandomAffine(30, fill=f), lambda f: A.RandomRotation(30, fill=f)],
                         ids=["affine", "rotation"])
@pytest.mark.parametrize("dtype, fill, shown", [(torch.uint8, -1, "-1.0"), (torch.uint8, 256, "256.0"),
                                                (torch.uint8, [0, 300, 0], r"\[0.0, 300.0, 0.0\]"),
                                                (torch.uint8, 255.5, "255.5"), (torch.uint8, -0.6, "-0.6"),
                                                (torch.int16, -40000, "-40000.0"), (torch.uint16, 70000, "70000.0")])
def test_resampling_ops_refuse_a_fill_outside_the_image_dtype(make, dtype, fill, shown):
    """fill=-1 on a uint8 image was clamped to 0 without a word (300 to 255), where RandomCrop
    refuses the same fill; refused with the field, the dtype's range and the fix."""
    x = torch.full((2, 3, 9, 9), 7, dtype=dtype)
    match = rf"fill={shown} does not fit the image field 'image' \({dtype}, values "
    with pytest.raises(ValueError, match=match):
        make(fill)(x, keys(2))
    vol = torch.full((2, 3, 5, 9, 9), 7, dtype=dtype)
    with pytest.raises(ValueError, match="does not fit the image field"):
        make(fill)(vol, keys(2))


def test_resampling_ops_fill_with_the_extremes_an_integer_image_holds():
    x = torch.full((4, 1, 9, 9), 7, dtype=torch.uint8)
    out = A.RandomRotation((40, 50), fill=255)(x, keys(4))
    assert int(out.max()) == 255 and int(out.min()) == 7  # corners filled with 255, the middle kept
    # a fraction is rounded (half to even) like the pixels: 255.4 and -0.3 fit uint8, 255.5 does not
    assert int(A.RandomRotation((40, 50), fill=255.4)(x, keys(4)).max()) == 255
    assert int(A.RandomRotation((40, 50), fill=-0.3)(x, keys(4)).min()) == 0
    out = A.RandomAffine(0, translate=(0.5, 0.5), fill=0)(torch.full((4, 1, 9, 9), -32768, dtype=torch.int16),
                                                          keys(4))
    assert out.dtype == torch.int16 and int(out.min()) == -32768


@pytest.mark.parametrize("shape", [(1, 1), (5, 1), (1, 5)])
def test_random_resized_crop_fallback_box_is_at_least_one_pixel(shape, monkeypatch):
    """A 1-pixel-wide image at a ratio of 3-4 rounds the central fallback box's height to 0:
    the CPU path raised a reshape error and the accelerator path returned a black image (the
    empty box resampled to zeros). The box is clamped to one pixel: both paths give the pixel."""
    x = torch.full((2, 3, *shape), 200, dtype=torch.uint8)
    op = A.RandomResizedCrop(4, scale=(0.5, 1.0), ratio=(3.0, 4.0) if shape[1] == 1 else (0.25, 1 / 3))
    box = op.draw(x, keys(2))
    assert bool((box["height"] >= 1).all() and (box["width"] >= 1).all())
    outs = []
    for host in (True, False):
        monkeypatch.setattr(augment_base, "HOST_SHORTCUTS", host)
        outs.append(op(x, keys(2)))
    assert all(o.shape == (2, 3, 4, 4) and bool((o == 200).all()) for o in outs)


@pytest.mark.filterwarnings("ignore:.*runs once per sample")
def test_per_size_constants_stay_bounded_over_many_sizes():
    """The affine grid's half extents, a crop's offset ranges and row grids are cached per
    input size: over a ragged stream of ~800 sizes the caches stay within their bounds, and
    the outputs for a few sizes are bit-identical before and after they were emptied."""
    from lightning_fastdata import augment_color, augment_crop
    from lightning_fastdata import keys as K

    ops = [A.RandomRotation(10), A.RandomAffine(5, translate=(0.1, 0.1)), A.RandomErasing(p=1.0, value="random"),
           A.RandomCrop(8, padding=(1, 0, 3, 2), fill=4), A.Normalize([0.5, 0.4, 0.3], [0.2, 0.3, 0.4])]
    few = [torch.rand(3, 9, 12, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    k = keys(3, seed=8)
    before = [[op(few, k), op(torch.stack(few), k)] for op in ops]
    for h in range(8, 37):
        xs = [torch.rand(3, h, w) for w in range(8, 37)]
        for op in ops:
            op(xs, keys(len(xs), seed=h))
            op(xs[0][None], keys(1, seed=h))
    assert len(augment_base._CONSTANTS) <= 256
    assert len(augment_crop._GRIDS) <= 64 and len(K._COUNTERS_NP) <= 64
    assert len(augment_color._PLANES) <= 32 and augment_color._PLANES.held <= 64 << 20
    for op, (ragged_out, batch_out) in zip(ops, before, strict=True):
        again = op(few, k)
        assert all(map(torch.equal, again, ragged_out)) and len(again) == len(ragged_out)
        assert torch.equal(op(torch.stack(few), k), batch_out)


@pytest.mark.parametrize("antialias", [True, False])
def test_resize_of_uint8_to_one_pixel_equals_torchvision_in_float(antialias):
    """``Resize((1, 1))`` of a 3-channel uint8 batch (or ``Resize(1)`` of a list) raised torch's
    "num_channels == unpacked_output.size(0) INTERNAL ASSERT FAILED ... please report a bug to
    PyTorch": its uint8 CPU kernel fails for a 1x1 output. uint8 to 1x1 goes through float32,
    rounded back: torchvision's float result, rounded."""
    x = images(3, shape=(3, 7, 5), seed=2)
    ref = TF.resize(x.float(), [1, 1], antialias=antialias).round().to(torch.uint8)
    out = A.Resize((1, 1), antialias=antialias)(x)
    assert out.dtype == torch.uint8 and torch.equal(out, ref)
    listed = A.Resize(1, antialias=antialias)(list(x))
    assert all(torch.equal(o, r) for o, r in zip(listed, ref, strict=True))


@pytest.mark.parametrize("op", [A.RandomRotation((90, 90), axes=(-1,)), A.RandomAffine(30, axes=(-2,)),
                                A.RandomRotation(30, axes=(-3, -1))], ids=lambda op: f"{type(op).__name__}{op.axes}")
def test_rotation_axes_on_a_batch_of_images_are_refused_with_the_volume_hint(op):
    """A volume stored without its channel axis, (N, D, H, W), batches as 2-D images of D channels:
    ``RandomRotation((90, 90), axes=(-1,))`` (about W, the D-H plane) turned it in the H-W plane,
    silently, where RandomFlip(dims=(-3,)) refuses with the hint to add the channel."""
    vol = torch.rand(2, 8, 16, 16)
    hint = r"batch has 2 spatial dims.*add the channel in static_transform \(x\[None\]\)"
    with pytest.raises(ValueError, match=rf"{type(op).__name__} axes=\(.*\) turns volumes .*{hint}"):
        op(vol, keys(2))
    params = A.RandomRotation(30).draw(vol, keys(2))
    with pytest.raises(ValueError, match=hint):
        op.apply(vol, **params)
    # The default, or an explicit (-3,) (about D is the H-W plane), turns images as before.
    k = keys(2)
    assert torch.equal(A.RandomRotation(30, axes=(-3,))(vol, k), A.RandomRotation(30)(vol, k))
    assert op(vol[:, None], keys(2)).shape == (2, 1, 8, 16, 16)  # with the channel: a volume
