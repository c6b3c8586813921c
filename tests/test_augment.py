"""The augmentation API: Batch and kinds, Compose/RandomApply keys, joint image+mask
augmentation (masks stay a pixelwise function of their image), and per-sample results that no
batch size or batch composition changes, for every op."""

from __future__ import annotations

import pytest
import torch
from _augment_util import (  # noqa: F401
    both_paths,
    images,
    keys,
    mirror_regimes,
    ragged,
    ragged_masks,
    within_binomial,
)

from lightning_fastdata import augment as A
from lightning_fastdata.keys import SampleKeys

# ----------------------------------------------------------------------------- every op


def _ops_2d():
    return [
        A.RandomCrop(12, padding=2),
        A.RandomHorizontalFlip(),
        A.RandomFlip(dims=(-2, -1)),
        A.RandomRot90(),
        A.RandomResizedCrop(12),
        A.RandomAffine(25, translate=(0.1, 0.1), scale=(0.9, 1.1), shear=5, interpolation="bilinear"),
        A.RandomRotation(30, interpolation="bilinear"),
        A.ColorJitter(0.4, 0.4, 0.4),
        A.RandomErasing(p=1.0),
        A.GaussianNoise(sigma=0.1),
        A.RandomApply([A.ColorJitter(0.5, 0.5)], p=0.5),
        A.RandomScaleIntensity(0.3),
        A.RandomShiftIntensity(0.3),
        A.RandomAdjustContrast(),
        A.Compose([A.RandomCrop(12, padding=2), A.RandomHorizontalFlip(), A.Normalize([0.5] * 3, [0.2] * 3)]),
    ]


def _ops_3d():
    return [
        A.RandomCrop((4, 6, 6), padding=1),
        A.RandomFlip(dims=(-3, -2, -1)),
        A.RandomRot90(dims=(-3, -1)),
        A.RandomAffine(30, translate=(0.1, 0.1, 0.1), scale=(0.9, 1.1), axes=(-3, -2), interpolation="bilinear"),
        A.RandomCropByLabel((4, 4, 4), label="label"),
        A.ScaleIntensityRange(-1000, 1000, clip=True),
        A.RandomScaleIntensity(0.2),
        A.RandomShiftIntensity(0.2),
        A.RandomAdjustContrast(),
        A.GaussianNoise(sigma=0.1, clip=False),
        A.RandomApply([A.RandomFlip(dims=(-3,)), A.GaussianNoise(clip=False)], p=0.5),
        A.Compose([A.RandomCropByLabel(6, label="label"), A.RandomFlip((-3, -2, -1)), A.RandomRot90(),
                   A.ScaleIntensityRange(-1000, 1000), A.RandomScaleIntensity(0.1)]),
    ]


def _name(op) -> str:
    return type(op).__name__


def _batch_2d(index: torch.Tensor, dtype=torch.float32) -> A.Batch:
    """Samples that depend only on their global index (so any batch can be rebuilt)."""
    img = torch.stack([images(1, shape=(3, 16, 16), dtype=dtype, seed=int(i))[0] for i in index])
    mask = (img[:, 0] > (128 if dtype == torch.uint8 else 0.5)).to(torch.int64)
    return A.Batch({"image": img, "mask": mask, "index": index.clone()}, {"image": "image", "mask": "mask"},
                   SampleKeys(7, 2, index))


def _batch_3d(index: torch.Tensor) -> A.Batch:
    vol = torch.stack([torch.randint(-1000, 1000, (1, 8, 8, 8), generator=torch.Generator().manual_seed(int(i)),
                                     dtype=torch.int16) for i in index])
    label = (vol > 600).to(torch.uint8)
    return A.Batch({"image": vol.float(), "label": label}, {"image": "image", "label": "mask"},
                   SampleKeys(7, 2, index))


@pytest.mark.parametrize("op, spatial_dims", [(o, 2) for o in _ops_2d()] + [(o, 3) for o in _ops_3d()],
                         ids=lambda v: _name(v) if not isinstance(v, int) else f"{v}d")
@pytest.mark.usefixtures("both_paths")
def test_a_sample_gets_the_same_pixels_whatever_its_batch(op, spatial_dims):
    """Batches of 8 and 16 in another order: each sample's output is bit-identical."""
    make = _batch_3d if spatial_dims == 3 else _batch_2d
    small_idx = torch.tensor([3, 17, 5, 40, 8, 2, 29, 11])
    big_idx = torch.tensor([29, 50, 11, 3, 61, 8, 44, 40, 2, 33, 5, 70, 17, 21, 9, 13])
    small, big = op(make(small_idx)), op(make(big_idx))
    pos = {int(v): i for i, v in enumerate(big_idx)}
    for i, idx in enumerate(small_idx.tolist()):
        for name in small.names("image", "mask"):
            a, b = small.fields[name][i], big.fields[name][pos[idx]]
            assert a.dtype == b.dtype and torch.equal(a, b), f"{_name(op)}: sample {idx}, field {name}"
    # and two different samples, or one sample in two epochs, differ
    assert not torch.equal(small.fields["image"][0], small.fields["image"][1])


@pytest.mark.parametrize("op", _ops_2d(), ids=_name)
def test_identical_images_come_out_varied_and_epochs_differ(op):
    x = images(1, dtype=torch.float32, shape=(3, 16, 16)).expand(32, -1, -1, -1).contiguous()
    if isinstance(op, A.Compose):
        return
    out = op(x, keys(32, seed=11))
    distinct = {tuple(o.flatten().tolist()) for o in out}
    possible = 2 if isinstance(op, A.RandomHorizontalFlip) else 4 if isinstance(op, (A.RandomFlip, A.RandomRot90)) \
        else 8
    assert len(distinct) >= possible, f"{op!r}: only {len(distinct)} distinct outputs out of 32"
    assert not torch.equal(out, op(x, keys(32, seed=11, epoch=1))), "two epochs gave the same batch"


@pytest.mark.parametrize("op", _ops_2d(), ids=_name)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_ops_are_pure_functions_of_the_keys_and_keep_formats(op, dtype):
    x = images(4, dtype=dtype, shape=(3, 16, 16)).contiguous(memory_format=torch.channels_last)
    if dtype == torch.uint8 and isinstance(op, (A.RandomScaleIntensity, A.RandomShiftIntensity,
                                               A.RandomAdjustContrast, A.Compose)):
        return  # intensity ops return floats; covered with float input
    before = x.clone()
    state = torch.get_rng_state()
    a, b = op(x, keys(4, seed=3)), op(x, keys(4, seed=3))
    assert torch.equal(torch.get_rng_state(), state), "the global generator was used"
    assert torch.equal(a, b), "same keys, different output"
    assert torch.equal(x, before), "the input was modified"
    assert a.dtype == dtype
    assert a.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("op", [o for o in _ops_2d() if not isinstance(o, (A.GaussianNoise, A.RandomErasing))],
                         ids=_name)
def test_video_frames_share_the_sample_draw(op):
    """(N, T, C, H, W) with spatial_dims=2: every frame of a sample gets its parameters."""
    frame = images(3, dtype=torch.float32, shape=(3, 16, 16))
    video = torch.stack([frame, frame], dim=1)
    out = op(A.Batch({"video": video}, {"video": "image"}, keys(3, seed=5), spatial_dims=2)).fields["video"]
    assert out.shape[:2] == (3, 2)
    assert torch.equal(out[:, 0], out[:, 1]), "frames of one sample got different parameters"
    assert torch.allclose(out[:, 0], op(frame, keys(3, seed=5)), atol=1e-6)


# ----------------------------------------------------------------------------- joint image + mask


def _exact_geometric_2d():
    return [A.RandomCrop(10, padding=3), A.RandomHorizontalFlip(), A.RandomFlip((-2, -1)), A.RandomRot90(),
            A.RandomCropByLabel(8, pos=1, neg=1, label="mask"), A.RandomAffine(40, translate=(0.2, 0.2)),
            A.RandomRotation(60)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.usefixtures("both_paths")
def test_mask_stays_a_pixelwise_function_of_the_image_2d(seed):
    """mask = image > t before; after any composition of crops, flips, quarter turns and label
    crops (and nearest affine maps, fill 0), still mask == augmented image > t, every sample."""
    g = torch.Generator().manual_seed(seed)
    img = torch.randint(0, 256, (16, 2, 14, 14), dtype=torch.uint8, generator=g)
    mask = (img[:, :1] > 150).to(torch.int64)
    ops = _exact_geometric_2d()
    pick = torch.randperm(len(ops), generator=g)[:4].tolist()
    pipeline = A.Compose([ops[i] for i in pick])
    if not any(isinstance(ops[i], (A.RandomCropByLabel,)) for i in pick):
        pipeline = A.Compose([A.RandomCropByLabel(10, label="mask"), pipeline])
    batch = A.Batch({"image": img, "mask": mask}, {"image": "image", "mask": "mask"}, keys(16, seed=seed))
    out = pipeline(batch)
    assert torch.equal(out.fields["mask"], (out.fields["image"][:, :1] > 150).to(torch.int64)), pipeline


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.usefixtures("both_paths")
def test_mask_stays_a_voxelwise_function_of_the_volume_3d(seed):
    g = torch.Generator().manual_seed(seed)
    vol = torch.randint(-1000, 1000, (6, 1, 9, 10, 10), dtype=torch.int16, generator=g)
    label = (vol > 700).to(torch.uint8)
    ops = [A.RandomCrop((8, 8, 8), padding=(1, 2, 0)), A.RandomFlip((-3, -2, -1)), A.RandomRot90((-2, -1)),
           A.RandomRot90((-3, -2)), A.RandomCropByLabel(6, pos=3, neg=1), A.RandomHorizontalFlip(),
           A.RandomAffine(90, axes=(-3, -1))]
    pick = torch.randperm(len(ops), generator=g)[:4].tolist()
    pipeline = A.Compose([A.RandomCrop(8)] + [ops[i] for i in pick])
    batch = A.Batch({"image": vol, "label": label}, {"image": "image", "label": "mask"}, keys(6, seed=seed))
    out = pipeline(batch)
    assert torch.equal(out.fields["label"], (out.fields["image"] > 700).to(torch.uint8)), pipeline


@pytest.mark.parametrize("op", [A.RandomCrop(10, padding=2), A.RandomFlip((-2, -1)), A.RandomRot90(),
                                A.RandomAffine(30, translate=(0.2, 0.1), scale=(0.8, 1.2), shear=10),
                                A.RandomRotation(45), A.RandomResizedCrop(12)], ids=_name)
def test_geometric_ops_give_masks_the_image_parameters(op):
    """An integer mask equal to the image's first channel moves exactly as the image does
    (nearest-neighbour images; RandomResizedCrop resizes images bilinearly, so compare with its
    nearest resize of the image)."""
    img = torch.randint(0, 200, (8, 3, 14, 14), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    batch = A.Batch({"image": img, "mask": img[:, 0].long(), "y": torch.arange(8)},
                    {"image": "image", "mask": "mask"}, keys(8, seed=2))
    out = op(batch)
    assert out.fields["y"] is batch.fields["y"]
    if isinstance(op, A.RandomResizedCrop):
        again = op.apply(A.Batch({"m": img[:, 0].long()}, {"m": "mask"}, spatial_dims=2), **op.draw(batch))
        assert torch.equal(out.fields["mask"], again.fields["m"])
        return
    assert torch.equal(out.fields["mask"], out.fields["image"][:, 0].long())


def test_fields_must_be_aligned_and_batches_well_formed():
    img, mask = torch.zeros(2, 3, 8, 8), torch.zeros(2, 8, 9)
    with pytest.raises(ValueError, match="'image' and 'mask' have spatial sizes"):
        A.Batch({"image": img, "mask": mask}, {"image": "image", "mask": "mask"})
    with pytest.raises(ValueError, match="2 and 3 samples"):
        A.Batch({"image": img, "mask": torch.zeros(3, 8, 8)}, {"image": "image", "mask": "mask"})
    with pytest.raises(ValueError, match="kinds are"):
        A.Batch({"image": img}, {"image": "picture"})
    with pytest.raises(ValueError, match="not among the fields"):
        A.Batch({"image": img}, {"image": "image", "label": "mask"})
    with pytest.raises(ValueError, match="keys have 5"):
        A.Batch({"image": img}, keys=keys(5))
    with pytest.raises(ValueError, match="give spatial_dims"):
        A.Batch({"image": torch.zeros(2, 2, 3, 8, 8, 8)})
    two = [torch.zeros(3, 8, 8), torch.zeros(3, 6, 9)]
    with pytest.raises(TypeError, match="all tensors or all lists"):
        A.Batch({"image": two, "mask": torch.zeros(2, 8, 8)}, {"image": "image", "mask": "mask"})
    with pytest.raises(ValueError, match="at sample 1"):
        A.Batch({"image": two, "mask": [torch.zeros(8, 8), torch.zeros(9, 6)]}, {"image": "image", "mask": "mask"})
    with pytest.raises(ValueError, match=r"image\[1\]' \(image\) has shape \(6, 9\)"):
        A.Batch({"image": [torch.zeros(3, 8, 8), torch.zeros(6, 9)]})
    with pytest.raises(ValueError, match="empty list"):
        A.Batch({"image": []}, spatial_dims=2)
    with pytest.raises(ValueError, match="spatial_dims=2"):
        A.RandomCrop(4)(torch.zeros(2, 8, 8))
    with pytest.raises(TypeError, match="SampleKeys, not a torch.Generator"):
        A.RandomCrop(4)(torch.zeros(2, 1, 8, 8), torch.Generator())
    b = A.Batch({"image": img, "label": torch.zeros(2, 8, 8)}, {"label": "mask", "image": "image"})
    assert b.spatial_dims == 2 and b.spatial_size == (8, 8) and b.names("mask") == ["label"]
    assert torch.equal(b.keys.index, torch.arange(2)) and "label: mask" in repr(b)
    r = A.Batch({"image": two, "label": [torch.zeros(8, 8), torch.zeros(6, 9)]}, {"label": "mask", "image": "image"})
    assert r.ragged and not b.ragged and r.spatial_dims == 2 and r.spatial_size == [(8, 8), (6, 9)]
    assert "image: image list of 2 (3-D)" in repr(r) and len(r) == 2


# ----------------------------------------------------------------------------- ragged batches (lists)


@pytest.mark.parametrize("op", [A.RandomHorizontalFlip(), A.ColorJitter(0.4, 0.4, 0.4), A.RandomRotation(20),
                                A.RandomApply([A.RandomErasing(p=1.0)], p=0.5)], ids=_name)
def test_ops_without_a_list_form_run_per_sample_with_the_sample_keys(op, monkeypatch):
    """On a list, an op that keeps sizes runs once per sample (a batch of one with that sample's
    keys): each sample gets the pixels it would get in any batch tensor; the list stays a list,
    and a warning (once per op) says to move the op after the size-fixing one."""
    from lightning_fastdata import augment_base

    monkeypatch.setattr(augment_base, "_WARNED", set())
    xs = ragged(dtype=torch.float32)
    k = SampleKeys(3, 1, torch.arange(10, 10 + len(xs)))
    with pytest.warns(UserWarning, match=f"{_name(op)} runs once per sample"):
        out = op(xs, k)
    assert isinstance(out, list) and len(out) == len(xs)
    for i, x in enumerate(xs):
        alone = op(x[None], k.take(torch.tensor([i])))
        assert torch.equal(out[i], alone[0]), i
    again = op.apply(A.Batch({"image": xs}, keys=k), **op.draw(xs, k))
    assert all(torch.equal(a, b) for a, b in zip(again.fields["image"], out, strict=True))


@pytest.mark.parametrize("op", [A.GaussianNoise(sigma=0.2), A.RandomErasing(p=1.0, value="random"),
                                A.RandomErasing(p=1.0, value=0.5)], ids=_name)
@pytest.mark.filterwarnings("ignore:.*runs once per sample")
def test_draw_then_apply_on_a_list_of_images_with_per_field_noise(op):
    """Parameters that hold one noise tensor per image field (a dict) work on lists of images
    of varying sizes: draw keeps each sample's noise (its own size), apply uses it."""
    xs = ragged(dtype=torch.float32)
    k = keys(len(xs), seed=6)
    out = op(xs, k)
    params = op.draw(xs, k)
    again = op.apply(xs, **params)
    assert isinstance(again, list) and all(torch.equal(a, b) for a, b in zip(again, out, strict=True))
    batch = A.Batch({"image": xs, "mask": ragged_masks()}, {"image": "image", "mask": "mask"}, k)
    assert all(torch.equal(a, b) for a, b in zip(op.apply(batch, **op.draw(batch)).fields["image"], out, strict=True))


def test_compose_fixes_the_size_then_runs_batched():
    xs, ms = ragged(), ragged_masks()
    batch = A.Batch({"image": xs, "mask": ms, "label": torch.arange(len(xs))},
                    {"image": "image", "mask": "mask"}, keys(len(xs), seed=1))
    aug = A.Compose([A.RandomResizedCrop(16), A.RandomHorizontalFlip(), A.Normalize([0.5] * 3, [0.2] * 3)])
    out = aug(batch)
    assert out.fields["image"].shape == (len(xs), 3, 16, 16) and out.fields["image"].dtype == torch.float32
    assert out.fields["mask"].shape == (len(xs), 16, 16) and out.fields["label"] is batch.fields["label"]
    # the same ops one after the other, with each op's child keys
    step = A.RandomResizedCrop(16)(batch, batch.keys.child(0))
    step = A.RandomHorizontalFlip()(step, batch.keys.child(1))
    assert torch.equal(out.fields["mask"], step.fields["mask"])
    # RandomCrop + flip fuse on batch tensors only; on a list they run in sequence, same result
    fused = A.Compose([A.RandomCrop(20, pad_if_needed=True), A.RandomHorizontalFlip()])(xs, keys(len(xs)))
    crop = A.RandomCrop(20, pad_if_needed=True)(xs, keys(len(xs)).child(0))
    assert torch.equal(fused, A.RandomHorizontalFlip()(crop, keys(len(xs)).child(1)))
    # eval: Resize(int) keeps a list, CenterCrop makes the batch
    ev = A.Compose([A.Resize(20), A.CenterCrop(18)])(xs)
    assert ev.shape == (len(xs), 3, 18, 18)


# ----------------------------------------------------------------------------- Compose and RandomApply


def test_compose_gives_each_op_its_child_keys():
    x = images(6, dtype=torch.float32)
    k = keys(6, seed=4)
    ops = [A.RandomAffine(20), A.ColorJitter(0.4, 0.4, 0.4), A.RandomErasing(p=1.0)]
    out = A.Compose(ops)(x, k)
    ref = x
    for i, op in enumerate(ops):
        ref = op(ref, k.child(i))
    assert torch.equal(out, ref)
    # an op's draws depend on its position, not on the ops before it
    a = A.Compose([A.RandomHorizontalFlip(), A.RandomAffine(20)]).transforms[1].draw(x, k.child(1))
    b = A.Compose([A.ColorJitter(0.1), A.RandomAffine(20)]).transforms[1].draw(x, k.child(1))
    assert all(torch.equal(a[name], b[name]) for name in a)
    nested = A.Compose([A.Compose([A.RandomAffine(20)])])(x, k)
    assert torch.equal(nested, A.RandomAffine(20)(x, k.child(0).child(0)))


@pytest.mark.parametrize("lead", [A.ScaleIntensityRange(-1000, 1000, clip=True), A.RandomFlip(dims=(-2,))],
                         ids=["window-first", "flip-first"])
@pytest.mark.parametrize("crop", [A.RandomCropByLabel((5, 6, 7)), A.RandomCrop((5, 6, 7))], ids=["label", "random"])
@pytest.mark.parametrize("tail", ["flip", "chain", "flip+chain"])
@pytest.mark.usefixtures("both_paths", "mirror_regimes")
def test_a_crop_fused_after_another_op_draws_from_its_own_keys(lead, crop, tail):
    """A crop that Compose fuses with what follows it (a flip, an intensity chain) drew from
    the keys of the op before it (``keys.child(0).child(i)``): with MONAI's usual order, the
    window first, the crops, flips and factors were not those of the ops one by one, and as
    whether a crop fuses depends on the device and the window size, a CPU run and a CUDA run
    cropped the same sample differently. Every op of the run now draws from the Compose's
    ``keys.child(i)``."""
    g = torch.Generator().manual_seed(3)
    img = torch.randint(-1200, 1200, (4, 1, 9, 10, 11), generator=g).to(torch.int16)
    lab = (img > 300).to(torch.uint8)
    kinds = {"image": "image", "label": "mask"}
    k = keys(4, seed=9)
    ops = [lead, crop, *([A.RandomFlip(dims=(-3, -2, -1))] if "flip" in tail else []),
           *([A.RandomScaleIntensity(0.1), A.RandomShiftIntensity(0.05)] if "chain" in tail else [])]
    fused = A.Compose(ops)(A.Batch({"image": img, "label": lab}, kinds, k))
    seq = A.Batch({"image": img, "label": lab}, kinds, k)
    for i, op in enumerate(ops):
        seq = op(seq, k.child(i))
    for name in kinds:
        assert fused.fields[name].dtype == seq.fields[name].dtype
        assert torch.equal(fused.fields[name], seq.fields[name]), name


@pytest.mark.usefixtures("both_paths")
def test_random_apply_gives_each_transform_its_child_keys():
    """RandomApply's second transform drew from ``keys.child(0).child(1)`` (the first one's keys
    leaked into the batch), not the documented ``keys.child(1)``."""
    x = images(6, dtype=torch.float32)
    k = keys(6, seed=2)
    inner = [A.RandomShiftIntensity(0.3), A.RandomScaleIntensity(0.3), A.GaussianNoise(clip=False)]
    op = A.RandomApply(inner, p=1.0)
    ref = x
    for i, t in enumerate(inner):
        ref = t(ref, op.draw(x, k)["keys"].child(i))
    assert torch.equal(op(x, k), ref)


@pytest.mark.filterwarnings("ignore:Compose applies")
def test_compose_applies_plain_callables_to_image_fields():
    x = images(2, dtype=torch.float32)
    mask = torch.ones(2, 20, 24, dtype=torch.int64)
    out = A.Compose([lambda t: t * 2])(A.Batch({"image": x, "mask": mask}, {"image": "image", "mask": "mask"}))
    assert torch.equal(out.fields["image"], x * 2) and out.fields["mask"] is mask


def test_a_plain_callable_next_to_mask_fields_warns_once_that_masks_do_not_move(monkeypatch, recwarn):
    """A torchvision flip given as a plain callable flipped the images and left the masks: each
    mask silently stopped matching its image. It still runs (a pointwise callable is fine), with
    a warning, once per kind of callable, naming the mask fields and the package's op to use."""
    import torchvision.transforms.v2 as T

    from lightning_fastdata import augment

    monkeypatch.setattr(augment, "_WARNED_CALLABLES", set())
    x = images(2, dtype=torch.float32)
    mask = torch.arange(2 * 20 * 24).view(2, 20, 24)
    batch = A.Batch({"image": x, "label": mask}, {"image": "image", "label": "mask"})
    aug = A.Compose([T.RandomHorizontalFlip(p=1.0)])
    with pytest.warns(UserWarning, match=r"Compose applies RandomHorizontalFlip, a plain callable, to the image "
                                         r"fields only: the mask fields \['label'\] do not move with it.*"
                                         r"augment.RandomHorizontalFlip"):
        out = aug(batch)
    assert torch.equal(out.fields["image"], x.flip(-1)) and out.fields["label"] is mask
    recwarn.clear()
    aug(batch)  # once per kind of callable
    A.Compose([T.RandomHorizontalFlip(p=1.0)])(x)  # no mask field: nothing to say
    assert not [w for w in recwarn if "Compose applies" in str(w.message)]


@pytest.mark.filterwarnings("ignore:Compose applies")
def test_compose_applies_plain_callables_to_each_image_of_a_list():
    xs, k = ragged(), keys(6, seed=3)
    out = A.Compose([lambda t: t.float() / 255, A.RandomResizedCrop(8)])(xs, k)
    assert out.shape == (6, 3, 8, 8) and out.dtype == torch.float32
    assert torch.equal(out, A.RandomResizedCrop(8)([x.float() / 255 for x in xs], k.child(1)))
    ms = ragged_masks()
    batch = A.Batch({"image": xs, "mask": ms}, {"image": "image", "mask": "mask"}, k)
    out = A.Compose([lambda t: t[:1]])(batch)
    assert [tuple(x.shape) for x in out.fields["image"]] == [(1, *x.shape[1:]) for x in xs]
    assert out.fields["mask"] is batch.fields["mask"]


@pytest.mark.usefixtures("both_paths")
def test_random_apply_rate_and_untouched_samples():
    n = 10_000
    op = A.RandomApply([A.GaussianNoise(sigma=0.1, clip=False)], p=0.25)
    x = torch.full((n, 1, 2, 2), 0.5)
    out = op(x, keys(n, seed=10))
    changed = (out != x).flatten(1).any(1)
    assert within_binomial(int(changed.sum()), n, 0.25)
    assert torch.equal(out[~changed], x[~changed])
    assert torch.equal(changed, op.draw(x, keys(n, seed=10))["apply"])


@pytest.mark.usefixtures("both_paths")
def test_random_apply_chosen_samples_get_their_own_parameters():
    x = images(12, dtype=torch.float32)
    mask = (x[:, 0] > 0.5).long()
    batch = A.Batch({"image": x, "mask": mask}, {"image": "image", "mask": "mask"}, keys(12, seed=1))
    inner = [A.RandomAffine(30), A.ColorJitter(0.5, 0.5)]
    op = A.RandomApply(inner, p=0.5)
    out = op(batch)
    chosen = op.draw(batch)["apply"]
    full = A.Compose(inner)(batch)  # every sample transformed with the same child keys
    for name in ("image", "mask"):
        ref = torch.where(chosen.view(-1, *[1] * (x.ndim - 1 if name == "image" else mask.ndim - 1)),
                          full.fields[name], batch.fields[name])
        assert torch.equal(out.fields[name], ref)


def _composites():
    return [
        A.RandomApply([A.RandomFlip((-2, -1)), A.ColorJitter(0.5, 0.5)], p=0.5),
        A.RandomApply([A.RandomAffine(30), A.GaussianNoise(clip=False)], p=1.0),
        A.Compose([A.RandomCrop(12), A.RandomHorizontalFlip(), A.ColorJitter(0.3, 0.3)]),
        A.Compose([A.RandomResizedCrop(10), A.RandomHorizontalFlip(), A.RandomScaleIntensity(0.2),
                   A.RandomShiftIntensity(0.2)]),
        A.Compose([A.Resize(14), A.CenterCrop(12), A.RandomApply([A.RandomErasing(p=1.0)], p=0.5)]),
    ]


def _same(a, b) -> bool:
    """Equal batch tensors, or equal lists of tensors."""
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and all(
            torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b)


@pytest.mark.parametrize("op", _composites(), ids=_name)
@pytest.mark.parametrize("as_list", [False, True], ids=["tensor", "list"])
@pytest.mark.usefixtures("both_paths")
@pytest.mark.filterwarnings("ignore:.*runs once per sample")
def test_draw_then_apply_equals_the_op_for_ops_that_run_ops(op, as_list):
    """op(x, keys) == op.apply(x, **op.draw(x, keys)) for Compose and RandomApply too: their draw
    gives the keys the inner ops draw from (and RandomApply's coins)."""
    xs = ragged(dtype=torch.float32) if as_list else images(6, dtype=torch.float32)
    k = SampleKeys(123, 4, torch.arange(100, 100 + len(xs)))
    direct = op(xs, k)
    params = op.draw(xs, k)
    assert _same(op.apply(xs, **params), direct)
    # the keys in the parameters decide, not the batch's
    assert _same(op.apply(A.Batch({"image": xs}, keys=keys(len(xs))), **params).fields["image"], direct)
    with pytest.raises(ValueError, match="keys of 3 samples for a batch of"):
        op.apply(xs, **{**params, "keys": keys(3)})


def test_random_apply_keeps_channels_last_3d():
    x = torch.rand(4, 2, 4, 5, 6).contiguous(memory_format=torch.channels_last_3d)
    out = A.RandomApply([A.RandomFlip((-3, -1))], p=0.5)(x, keys(4, seed=1))
    assert out.is_contiguous(memory_format=torch.channels_last_3d)
    assert torch.equal(out, A.RandomApply([A.RandomFlip((-3, -1))], p=0.5)(x.contiguous(), keys(4, seed=1)))


def test_random_apply_refuses_shape_changes():
    with pytest.raises(ValueError, match="shape- and dtype-preserving"):
        A.RandomApply([A.RandomResizedCrop(4)], p=1.0)(torch.rand(2, 3, 8, 8))


@pytest.mark.parametrize("make, match", [
    (lambda: A.RandomResizedCrop(0), "size"),
    (lambda: A.RandomResizedCrop(8, scale=(0.5, 0.1)), "scale"),
    (lambda: A.RandomResizedCrop(8, ratio=(0, 1)), "ratio"),
    (lambda: A.RandomAffine(10, translate=(1.5, 0)), "translate"),
    (lambda: A.RandomAffine(10, scale=(0, 1)), "scale"),
    (lambda: A.RandomAffine(10, shear=(1, 2, 3)), "shear"),
    (lambda: A.RandomAffine(10, interpolation="bicubic"), "interpolation"),
    (lambda: A.RandomAffine(10, axes=(0,)), "axes"),
    (lambda: A.RandomRotation(-5), "degrees"),
    (lambda: A.ColorJitter(brightness=-0.1), "brightness"),
    (lambda: A.ColorJitter(contrast=(1.5, 0.5)), "contrast"),
    (lambda: A.RandomErasing(p=2), "p"),
    (lambda: A.GaussianNoise(sigma=-1), "sigma"),
    (lambda: A.RandomApply([A.GaussianNoise()], p=-0.1), "p"),
    (lambda: A.RandomScaleIntensity(0.1, p=3), "p"),
    (lambda: A.Compose([A.GaussianNoise(), 3]), "item 1"),
    # strings, fractions and single numbers where ints or sequences go: named, with the value
    (lambda: A.RandomCrop("32"), "size must be .*got '32'"),
    (lambda: A.RandomCrop(32.5), "size must be .*got 32.5"),
    (lambda: A.RandomCrop((8, "8")), r"size must be .*got \(8, '8'\)"),
    (lambda: A.RandomCrop(8, padding="2"), "padding must be .*got '2'"),
    (lambda: A.RandomCrop(8, fill="0"), "fill must be a number, got '0'"),
    (lambda: A.CenterCrop("16"), "size must be .*got '16'"),
    (lambda: A.Resize(7.5), "size must be .*got 7.5"),
    (lambda: A.RandomResizedCrop("24"), "size must be .*got '24'"),
    (lambda: A.RandomCropByLabel("4"), "size must be .*got '4'"),
    (lambda: A.RandomResizedCrop(8, scale="01"), "scale must be .*got '01'"),
    (lambda: A.RandomAffine(10, translate=0.1), "translate must be .*got 0.1"),
    (lambda: A.RandomAffine(10, translate="0.1"), "translate must be .*got '0.1'"),
    (lambda: A.RandomAffine(10, center=5), "center must be .*got 5"),
    (lambda: A.RandomAffine(10, shear="12"), "shear must be .*got '12'"),
    (lambda: A.RandomAffine(10, axes="-3"), "axes must be .*got '-3'"),
    (lambda: A.RandomAffine("10"), "degrees must be .*got '10'"),
    (lambda: A.Normalize(0.5, 0.2), "mean must be .*got 0.5"),
    (lambda: A.Normalize([0.5], 0.2), "std must be .*got 0.2"),
    (lambda: A.RandomFlip("12"), "dims must be .*got '12'"),
    (lambda: A.RandomRot90((-2, -1.5)), r"dims must be .*got \(-2, -1.5\)"),
    (lambda: A.RandomErasing(value=[0.5, "1"]), "value must be .*got"),
    (lambda: A.ColorJitter(brightness="0.5"), "brightness must be .*got '0.5'"),
])
def test_bad_arguments_name_the_parameter(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_integral_floats_are_ints_and_ints_are_single_axes():
    """Configs may give 32.0 for 32; a single axis may be given as an int."""
    assert A.RandomCrop(32.0).size == (32,) and A.CenterCrop((16.0, 8)).size == (16, 8)
    assert A.RandomAffine(10, axes=-2).axes == (-2,) and A.RandomFlip(-2).dims == (-2,)
    assert A.Normalize((0.5, 0.4), [1, 2]).mean == [0.5, 0.4]


@pytest.mark.parametrize("op", [A.ToDtype("float32"), A.Normalize([0.5] * 3, [0.2] * 3), A.RandomResizedCrop(8),
                                A.RandomAffine(10, interpolation="bilinear"), A.RandomAffine(10), A.RandomRotation(10),
                                A.Resize(8), A.Resize((8, 6)), A.ColorJitter(0.5, 0.5)], ids=_name)
@pytest.mark.parametrize("as_list", [False, True], ids=["tensor", "list"])
@pytest.mark.filterwarnings("ignore:.*runs once per sample")
def test_bool_images_are_refused_with_what_to_do(op, as_list):
    """A bool image has no value range to scale or resample into: a ValueError names the op,
    the field and the dtype, and says to mark it a mask or convert it (not a bare KeyError)."""
    x = torch.rand(2, 3, 10, 10, generator=torch.Generator().manual_seed(0)) > 0.5
    batch = A.Batch({"seg": list(x) if as_list else x}, {"seg": "image"})
    with pytest.raises(ValueError, match=rf"{_name(op)}: image field 'seg' is torch.bool.*'mask'.*ToDtype"):
        op(batch)
    assert A.ToDtype("float32", scale=False)(x).dtype == torch.float32  # the suggested conversion works


def test_ops_build_from_a_lightning_cli_config():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--augment", type=A.BatchTransform)

    def op(name, **init_args):
        return {"class_path": f"lightning_fastdata.augment.{name}", "init_args": init_args}

    config = op("Compose", transforms=[
        op("RandomCropByLabel", size=[4, 6, 6], pos=2, neg=1, label="label"),
        op("RandomFlip", dims=[-3, -2, -1]),
        op("RandomRot90", dims=[-2, -1]),
        op("RandomAffine", degrees=10, translate=[0.1, 0.1, 0.1], axes=[-3]),
        op("ScaleIntensityRange", a_min=-1000, a_max=1000, b_min=0.0, b_max=1.0, clip=True),
        op("RandomScaleIntensity", factors=0.1, p=0.5),
        op("RandomShiftIntensity", offsets=0.1),
        op("RandomAdjustContrast", gamma=[0.7, 1.5]),
        op("RandomApply", p=0.3, transforms=[op("GaussianNoise", sigma=0.05, clip=False)]),
    ])
    cfg = parser.parse_object({"augment": config})
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    aug = instantiate(cfg).augment
    assert [type(t).__name__ for t in aug.transforms][:3] == ["RandomCropByLabel", "RandomFlip", "RandomRot90"]
    batch = _batch_3d(torch.arange(3))
    out = aug(batch)
    assert out.fields["image"].shape == (3, 1, 4, 6, 6) and out.fields["label"].shape == (3, 1, 4, 6, 6)
    cfg2 = parser.parse_object({"augment": op("Compose", transforms=[
        op("RandomResizedCrop", size=12, scale=[0.2, 1.0]), op("ColorJitter", brightness=0.3, saturation=[0.5, 1.5]),
        op("RandomErasing", value="random"), op("Normalize", mean=[0.5] * 3, std=[0.2] * 3)])})
    assert instantiate(cfg2).augment(torch.rand(4, 3, 16, 16)).shape == (4, 3, 12, 12)
    assert "RandomCropByLabel(size=(4, 6, 6), pos=2.0, neg=1.0, label='label')" in repr(aug)


@pytest.mark.usefixtures("mirror_regimes")
def test_the_accelerator_path_never_reads_device_values_on_the_host(monkeypatch):
    """A CPU stand-in for the CUDA sync test: with the host shortcuts off (as on any accelerator)
    no op calls nonzero, item, tolist, numpy or bool() on a tensor, any of which would make the
    host wait for the device."""
    from lightning_fastdata import augment_base
    from lightning_fastdata import keys as K

    monkeypatch.setattr(augment_base, "HOST_SHORTCUTS", False)
    monkeypatch.setattr(K, "USE_NUMPY_ON_CPU", False)
    b2, b3 = _batch_2d(torch.arange(6), torch.uint8), _batch_3d(torch.arange(3))
    x2 = b2.replace({"image": b2.fields["image"].float()})
    ops = [(o, b2 if isinstance(o, (A.RandomCrop, A.RandomFlip, A.RandomRot90)) else x2) for o in _ops_2d()]
    ops += [(o, b3) for o in _ops_3d()] + [(A.RandomErasing(value="random"), x2), (A.ToDtype("float32"), b2),
                                           (A.Normalize([0.5] * 3, [0.2] * 3), b2)]
    xs = A.Batch({"image": ragged(), "mask": ragged_masks()}, {"image": "image", "mask": "mask"}, keys(6))
    ops += [(A.RandomResizedCrop(12), xs), (A.RandomCrop(24, pad_if_needed=True), xs), (A.Resize(14), xs),
            (A.Resize((14, 12)), xs), (A.CenterCrop(20), xs), (A.Compose([A.Resize(14), A.CenterCrop(12)]),
                                                              A.Batch({"image": ragged()}, keys=keys(6)))]
    for op, _ in ops:  # warm-up: constants are made once per (values, device, dtype)
        op(_)

    def refuse(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"{name} reads a device value on the host")
        return fail

    for name in ("nonzero", "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    monkeypatch.setattr(torch, "nonzero", refuse("torch.nonzero"))
    for op, batch in ops:
        op(batch.replace(keys=SampleKeys(1, 1, batch.keys.index)))


@pytest.mark.parametrize("op, spatial_dims", [(o, 2) for o in _ops_2d()] + [(o, 3) for o in _ops_3d()] +
                         [(A.Normalize([0.5], [0.2]), 3), (A.ToDtype("float32"), 3), (A.CenterCrop(4), 3)],
                         ids=lambda v: _name(v) if not isinstance(v, int) else f"{v}d")
@pytest.mark.usefixtures("both_paths")
def test_an_empty_batch_comes_out_empty(op, spatial_dims):
    """A batch of 0 samples (N = 0) keeps its other dims, as RandomCrop always did; label crops,
    affine maps, Normalize and the contrast op used to fail on ``reshape(0, -1, ...)`` or
    ``x[0]`` with an IndexError or "cannot reshape tensor of 0 elements"."""
    batch = _batch_2d(torch.arange(2)) if spatial_dims == 2 else _batch_3d(torch.arange(2))
    rows = torch.arange(0)
    empty = A.Batch({k: v[:0] for k, v in batch.fields.items()}, batch.kinds, batch.keys.take(rows))
    full = op(batch)
    out = op(empty)
    for name in ("image", "mask" if spatial_dims == 2 else "label"):
        assert out.fields[name].shape == (0, *full.fields[name].shape[1:]), name
        assert out.fields[name].dtype == full.fields[name].dtype, name


@pytest.mark.parametrize("op", [A.RandomFlip(dims=(-3, -2, -1)), A.RandomCrop((8, 8, 8)), A.CenterCrop((8, 8, 8)),
                                A.Compose([A.RandomCropByLabel((8, 8, 8), label="label"), A.RandomFlip(dims=(-3,))]),
                                A.RandomRot90(dims=(-3, -1)), A.RandomAffine(10, translate=(0.1, 0.1, 0.1))],
                         ids=_name)
def test_a_3d_op_on_volumes_without_a_channel_axis_says_how_to_add_it(op):
    """Volumes stored as (D, H, W) batch as (N, D, H, W): 2-D images of D channels. A 3-D op
    used to fail naming only the spatial dims; the error now says to add the channel axis."""
    vol = torch.randint(0, 100, (3, 10, 12, 12), dtype=torch.int16)
    batch = A.Batch({"image": vol, "label": (vol > 50).to(torch.uint8)}, {"image": "image", "label": "mask"}, keys(3))
    with pytest.raises(ValueError, match=r"volumes stored without a channel axis, \(D, H, W\).*x\[None\]"):
        op(batch)


def test_2d_ops_on_volumes_without_a_channel_axis_equal_the_3d_ops_on_those_axes():
    """What runs without the error: a 2-D op on (D, H, W) samples moves every slice alike, which
    is the 3-D op over (H, W) of the volume with its channel axis."""
    vol = torch.randint(0, 100, (5, 6, 12, 12), dtype=torch.int16)
    k = keys(5)
    for op in (A.RandomFlip(dims=(-2, -1)), A.RandomRot90(dims=(-2, -1)), A.RandomAffine(30)):
        assert torch.equal(op(vol, k), op(vol[:, None], k)[:, 0]), op


@pytest.mark.parametrize("make,message", [
    (lambda: A.RandomRot90(p=1.5), r"^RandomRot90: p must be in \[0, 1\], got 1.5$"),
    (lambda: A.CenterCrop(0), r"^CenterCrop: size must be >= 1, got 0$"),
    (lambda: A.Normalize([0.5, 0.5], [0.2, 0.0]), r"^Normalize: std must be > 0"),
    # RandomRotation's init calls RandomAffine's: the op built is named, once.
    (lambda: A.RandomRotation(degrees="x"), r"^RandomRotation: degrees must be a number or a pair"),
    (lambda: A.Compose([A.RandomHorizontalFlip(), A.RandomVerticalFlip(p=-1)]),
     r"^RandomVerticalFlip: p must be in \[0, 1\], got -1$"),
])
def test_a_bad_argument_names_the_op_it_was_given_to(make, message):
    """In a Compose of a YAML config, "p must be in [0, 1], got 1.5" did not say which op."""
    with pytest.raises((ValueError, TypeError), match=message):
        make()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_apply_refuses_parameters_that_do_not_fit_the_batch(dtype):
    """``apply`` took any parameters: a crop offset past the range cut a window wrapped into
    the next row or another sample's pixels (no error), parameters drawn for 3 samples
    applied to 2 failed with numpy's broadcast error, and a resized-crop box past the image
    gave different pixels on the CPU and accelerator paths. Each is refused, naming the op."""
    x = torch.arange(72).view(2, 1, 6, 6).to(dtype)
    crop = A.RandomCrop(4, padding=1)  # offsets 0 .. 4 on each axis
    for offset in ([[0, 5], [0, 0]], [[0, 0], [-1, 2]], [[5, 0], [0, 0]]):
        with pytest.raises(ValueError, match=r"RandomCrop.apply: sample \d's offset .* past its padded input "
                                             r"\(offsets 0 to \[4, 4\]\)"):
            crop.apply(x, offset=torch.tensor(offset))
    three = crop.draw(torch.zeros(3, 1, 6, 6, dtype=dtype), keys(3))
    with pytest.raises(ValueError, match=r"RandomCrop.apply: parameter 'offset' has 3 rows for a batch of 2 samples"):
        crop.apply(x, **three)
    assert crop.apply(x, offset=torch.tensor([[0, 4], [4, 0]])).shape == (2, 1, 4, 4)  # in range: accepted
    by_label = A.RandomCropByLabel(4, label="image")  # offsets 0 .. 2 on each axis of the 6x6 input
    with pytest.raises(ValueError, match=r"RandomCropByLabel.apply: sample 0's offset \[0, 5\] puts its \[4, 4\] "
                                         r"window past its input \(offsets 0 to \[2, 2\]\)"):
        by_label.apply(x, offset=torch.tensor([[0, 5], [0, 0]]))
    with pytest.raises(ValueError, match=r"RandomCropByLabel.apply: sample 1's offset \[-1, 0\]"):
        by_label.apply(x, offset=torch.tensor([[0, 0], [-1, 0]]))
    rrc = A.RandomResizedCrop(4)
    box = dict(top=torch.tensor([3, 0]), left=torch.tensor([0, 0]), height=torch.tensor([6, 6]),
               width=torch.tensor([6, 6]))
    with pytest.raises(ValueError, match=r"RandomResizedCrop.apply: sample 0's box \(top=3, left=0, height=6, "
                                         r"width=6\) is not inside its \(6, 6\) image"):
        rrc.apply(x, **box)
    assert rrc.apply(x, **rrc.draw(x, keys(2))).shape == (2, 1, 4, 4)


@pytest.mark.parametrize("op", [A.ColorJitter(0.3, 0.3, 0.3), A.Normalize([0.5] * 3, [0.2] * 3), A.RandomResizedCrop(6),
                                A.RandomRotation(20), A.RandomErasing(p=1.0), A.RandomCrop(6, padding=2),
                                A.RandomCropByLabel(4, label="image")],
                         ids=lambda op: type(op).__name__)
def test_draw_then_apply_on_a_batch_of_no_samples_equals_the_op(op):
    """``op(x, keys)`` took a batch of 0 samples; ``op.apply(x, **op.draw(x, keys))`` failed for
    several ops (IndexError, "cannot reshape tensor of 0 elements")."""
    x = torch.zeros(0, 3, 8, 9, dtype=torch.uint8)
    k = SampleKeys(0, 0, torch.arange(0))
    want = op(x, k)
    got = op.apply(x, **op.draw(x, k))
    assert got.shape == want.shape and got.dtype == want.dtype


@pytest.mark.parametrize("make, name", [
    (lambda v: A.RandomRotation(10, interpolation="bilinear", fill=v), "RandomRotation: fill"),
    (lambda v: A.RandomAffine(10, fill=[0.0, v, 0.0]), "RandomAffine: fill"),
    (lambda v: A.RandomErasing(p=1.0, value=v), "RandomErasing: value"),
    (lambda v: A.RandomCrop(8, padding=2, fill=v), "RandomCrop: fill"),
])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_fill_that_is_not_finite_is_refused_at_construction(make, name, value):
    """A NaN or infinite fill was accepted: a bilinear rotation's blend ``(img - fill) * w + fill``
    made every pixel NaN, erasing and crop padding wrote NaN, all without a word."""
    with pytest.raises(ValueError, match=rf"{name} must be finite, got {value}"):
        make(value)


@pytest.mark.parametrize("make", [
    lambda v: A.ColorJitter(brightness=v, contrast=v, saturation=v),
    lambda v: A.RandomRotation(v),
    lambda v: A.RandomAffine(v, shear=v),
    lambda v: A.RandomRotation(10, fill=v),
    lambda v: A.RandomErasing(value=v),
], ids=["ColorJitter", "RandomRotation", "RandomAffine", "RandomRotation-fill", "RandomErasing-value"])
def test_range_and_fill_arguments_take_numpy_scalars_and_0d_tensors(make):
    """``ColorJitter(brightness=np.float32(0.4))`` raised "brightness must be a number or a pair
    (min, max), got np.float32(0.4)" (as did np.int64, a 0-d tensor, RandomRotation(np.float32(10)),
    shear=np.float32(5)), while np.float64 and RandomHorizontalFlip(np.float32(0.5)) were taken."""
    np = pytest.importorskip("numpy")
    want = repr(make(0.5))
    for v in (np.float32(0.5), np.float64(0.5), torch.tensor(0.5), torch.tensor(0.5, dtype=torch.float64)):
        assert repr(make(v)) == want, type(v)
    assert repr(make(np.int64(1))) == repr(make(1))
    with pytest.raises(TypeError, match="must be"):
        make(True)  # a bool stays refused


@pytest.mark.parametrize("make", [
    lambda ops: A.Compose(ops),
    lambda ops: A.RandomApply(ops, p=1.0),
], ids=["Compose", "RandomApply"])
@pytest.mark.parametrize("one_shot", [lambda ops: (op for op in ops), iter], ids=["generator", "iterator"])
def test_ops_given_as_a_generator_are_all_run(make, one_shot):
    """``Compose(op for op in ops)`` became ``Compose(transforms=[])``: the check of the ops
    consumed the generator, and the output equalled the input without a word."""
    ops = [A.RandomHorizontalFlip(p=1.0), A.Normalize([0.5] * 3, [0.25] * 3)]
    x = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    op = make(one_shot(ops))
    assert op.transforms == ops
    assert torch.equal(op(x, keys(4)), make(ops)(x, keys(4)))
    with pytest.raises(TypeError, match=r"^Compose transforms must be a list of ops, got 3$"):
        A.Compose(3)


@pytest.mark.parametrize("make, values", [
    (lambda v: A.RandomScaleIntensity(v()), (-0.2, 0.3)),
    (lambda v: A.RandomShiftIntensity(v()), (-0.2, 0.3)),
    (lambda v: A.RandomAdjustContrast(v()), (0.7, 1.5)),
    (lambda v: A.Normalize(v(), v()), (0.5, 0.4, 0.3)),
    (lambda v: A.RandomCrop(v(), padding=v()), (4, 5)),
    (lambda v: A.RandomFlip(v()), (-2, -1)),
    (lambda v: A.RandomAffine(v(), translate=v(), scale=v(), center=v()), (0.5, 0.9)),
    (lambda v: A.RandomResizedCrop(8, scale=v(), ratio=v()), (0.5, 0.9)),
    (lambda v: A.ColorJitter(v(), v(), v()), (0.5, 0.9)),
    (lambda v: A.RandomErasing(value=v()), (0.1, 0.2, 0.3)),
], ids=["RandomScaleIntensity", "RandomShiftIntensity", "RandomAdjustContrast", "Normalize", "RandomCrop",
        "RandomFlip", "RandomAffine", "RandomResizedCrop", "ColorJitter", "RandomErasing"])
def test_sequence_arguments_may_be_one_shot_iterables(make, values):
    """The intensity ops checked their range, then kept the argument as given: a generator was
    kept exhausted (its repr and saved hyperparameters said nothing of the range)."""
    want = repr(make(lambda: list(values)))
    assert repr(make(lambda: iter(values))) == repr(make(lambda: (v for v in values))) == want


_FLAGS = [
    (lambda v: A.ToDtype("float32", scale=v), "ToDtype", "scale"),
    (lambda v: A.RandomCrop(16, pad_if_needed=v), "RandomCrop", "pad_if_needed"),
    (lambda v: A.ScaleIntensityRange(0, 1, clip=v), "ScaleIntensityRange", "clip"),
    (lambda v: A.GaussianNoise(clip=v), "GaussianNoise", "clip"),
    (lambda v: A.Resize(6, antialias=v), "Resize", "antialias"),
    (lambda v: A.RandomResizedCrop(6, antialias=v), "RandomResizedCrop", "antialias"),
]


@pytest.mark.parametrize("make, op, param", _FLAGS, ids=[f"{o}-{p}" for _, o, p in _FLAGS])
def test_boolean_flags_refuse_strings_and_numbers(make, op, param):
    """``bool()`` read the string "False" (argparse, an environment variable, a hand-made config)
    as True: ``ToDtype(scale="False")`` scaled uint8 200 to 0.78, ``RandomCrop(16,
    pad_if_needed="False")`` padded an 8x8 image instead of refusing it."""
    np = pytest.importorskip("numpy")
    for bad in ("False", "True", 0, 1, None):
        with pytest.raises(TypeError, match=rf"^{op}: {param} must be True or False, got {bad!r}"):
            make(bad)
    for value in (False, True, np.False_, np.True_):
        got = getattr(make(value), param)
        assert type(got) is bool and got == bool(value)
    u = torch.full((2, 3, 4, 4), 200, dtype=torch.uint8)
    assert A.ToDtype("float32", scale=np.False_)(u)[0, 0, 0, 0].item() == 200.0


@pytest.mark.parametrize("make", [
    lambda v: A.Resize(6, max_size=v * 5),
    lambda v: A.RandomCrop(8, padding=2, fill=v),
    lambda v: A.RandomScaleIntensity(v),
    lambda v: A.RandomShiftIntensity(v),
    lambda v: A.RandomAdjustContrast(v * 2),
], ids=["Resize-max_size", "RandomCrop-fill", "RandomScaleIntensity", "RandomShiftIntensity", "RandomAdjustContrast"])
def test_number_arguments_take_numpy_scalars_and_0d_tensors_kept_plain(make):
    """``Resize(6, max_size=np.int64(10))`` and ``RandomCrop(fill=torch.tensor(0.5))`` were
    refused; ``RandomCrop(fill=np.float32(0.5))`` and the intensity ops kept the numpy scalar,
    which showed as ``np.float32(0.5)`` in the repr and saved hyperparameters."""
    np = pytest.importorskip("numpy")
    for v in (np.int64(2), torch.tensor(2)):
        assert repr(make(v)) == repr(make(2)), type(v)
    ints = [A.Resize(6, max_size=np.int64(10)).max_size, A.RandomCrop(8, fill=torch.tensor(3)).fill]
    assert all(type(i) is int for i in ints) and ints == [10, 3]
    if "max_size" in repr(make(2)):
        return  # max_size is an int
    for v in (np.float32(0.5), np.float64(0.5), torch.tensor(0.5)):
        assert repr(make(v)) == repr(make(0.5)), type(v)
