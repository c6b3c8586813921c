"""Flips and quarter turns, 2-D and 3-D: each sample equals torch.flip / torch.rot90 at the
parameters the op reports; rates and independence of the draws."""

from __future__ import annotations

import pytest
import torch
from _augment_util import both_paths, keys, mirror_regimes, within_binomial  # noqa: F401
from torchvision.transforms.v2 import functional as TF

from lightning_fastdata import augment as A


def _data(shape, seed=0):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0])
@pytest.mark.usefixtures("both_paths")
def test_horizontal_flip_matches_per_sample_mirror(p):
    x = _data((20, 3, 5, 7), seed=3)
    op = A.RandomHorizontalFlip(p)
    out = op(x, keys(20, seed=4))
    flip = op.draw(x, keys(20, seed=4))["flip"]
    assert flip.shape == (20, 1)
    expected = torch.stack([TF.horizontal_flip(x[i]) if flip[i, 0] else x[i] for i in range(20)])
    assert torch.equal(out, expected)
    assert out.data_ptr() != x.data_ptr()  # a new tensor, never the input or a scratch buffer


def test_vertical_flip_is_a_flip_of_h():
    x = _data((8, 3, 5, 7))
    op = A.RandomVerticalFlip(0.5)
    flip = op.draw(x)["flip"][:, 0]
    assert torch.equal(op(x), torch.stack([TF.vertical_flip(x[i]) if flip[i] else x[i] for i in range(8)]))


@pytest.mark.parametrize("shape,dims", [((9, 2, 4, 5, 6), (-3, -2, -1)), ((9, 1, 4, 5, 6), (-3,)),
                                        ((9, 3, 5, 6), (-2, -1)), ((9, 1, 4, 5, 6), (-1,)),
                                        ((9, 1, 4, 5, 6), (-1, -3)), ((9, 2, 5, 6), (-2,))])
@pytest.mark.usefixtures("both_paths", "mirror_regimes")
def test_random_flip_equals_torch_flip_per_axis(shape, dims):
    """Whole-sample flips one axis at a time (small samples) or every axis in one pass, the
    rows read in mirrored order and the last axis mirrored in place (large samples)."""
    x = _data(shape, seed=1)
    mask = x[:, 0] > 128  # (N, *spatial) without a channel dim
    batch = A.Batch({"image": x, "mask": mask}, {"image": "image", "mask": "mask"}, keys(9, seed=2))
    op = A.RandomFlip(dims=dims, p=0.5)
    out = op(batch)
    flip = op.draw(batch)["flip"]
    assert flip.shape == (9, len(dims))
    for i in range(9):
        ref, ref_m = x[i], mask[i]
        axes = [d for j, d in enumerate(dims) if flip[i, j]]
        if axes:
            ref, ref_m = torch.flip(ref, axes), torch.flip(ref_m, axes)
        assert torch.equal(out.fields["image"][i], ref)
        assert torch.equal(out.fields["mask"][i], ref_m)


def test_flip_axes_are_independent_with_rate_p():
    n = 10_000
    flip = A.RandomFlip(dims=(-3, -2, -1), p=0.3).draw(torch.zeros(n, 1, 2, 2, 2), keys(n))["flip"]
    for j in range(3):
        assert within_binomial(int(flip[:, j].sum()), n, 0.3)
    both = (flip[:, 0] & flip[:, 1]).sum().item()
    assert within_binomial(both, n, 0.09)
    assert within_binomial(int(A.RandomHorizontalFlip(0.1).draw(torch.zeros(n, 1, 2, 2))["flip"].sum()), n, 0.1)


@pytest.mark.parametrize("shape,dims", [((10, 2, 6, 6), (-2, -1)), ((10, 1, 5, 4, 5), (-3, -1)),
                                        ((10, 2, 3, 4, 4), (-2, -1)), ((10, 1, 4, 4, 3), (-3, -2))])
@pytest.mark.usefixtures("both_paths")
def test_rot90_equals_torch_rot90_at_the_reported_k(shape, dims):
    x = _data(shape, seed=5)
    lab = (x[:, :1] // 64).long()
    batch = A.Batch({"image": x, "label": lab}, {"image": "image", "label": "mask"}, keys(10, seed=6))
    op = A.RandomRot90(dims=dims)
    out = op(batch)
    k = op.draw(batch)["k"]
    assert k.dtype == torch.int64 and set(k.tolist()) <= {0, 1, 2, 3}
    for i in range(10):
        assert torch.equal(out.fields["image"][i], torch.rot90(x[i], int(k[i]), dims))
        assert torch.equal(out.fields["label"][i], torch.rot90(lab[i], int(k[i]), dims))
    assert out.fields["image"].data_ptr() != x.data_ptr()


def test_rot90_turns_are_uniform_and_p_controls_the_rate():
    n = 12_000
    k = A.RandomRot90().draw(torch.zeros(n, 1, 3, 3), keys(n))["k"]
    counts = torch.bincount(k, minlength=4)
    assert all(within_binomial(int(c), n, 0.25) for c in counts)
    k = A.RandomRot90(p=0.2).draw(torch.zeros(n, 1, 3, 3), keys(n))["k"]
    assert within_binomial(int((k == 0).sum()), n, 0.8)


def test_rot90_refuses_non_square_planes_and_bad_dims():
    with pytest.raises(ValueError, match="needs equal sizes there, got 4 x 6"):
        A.RandomRot90()(torch.zeros(2, 1, 4, 6))
    with pytest.raises(ValueError, match="plane of two"):
        A.RandomRot90(dims=(-1,))
    with pytest.raises(ValueError, match="2 spatial dims"):
        A.RandomRot90(dims=(-3, -1))(torch.zeros(2, 1, 4, 4))
    with pytest.raises(ValueError, match="spatial axes"):
        A.RandomFlip(dims=(1,))
    with pytest.raises(ValueError, match="p must be in"):
        A.RandomFlip(p=1.5)
    for bad in (float("nan"), "0.5", None, True):
        with pytest.raises(ValueError, match=r"p must be in \[0, 1\], got"):
            A.RandomFlip(p=bad)


def test_a_numpy_probability_is_a_probability():
    """p read from a numpy config (np.float32, a 0-d array) flips as the same Python float does."""
    import numpy as np

    x = _data((16, 1, 4, 4))
    k = keys(16)
    want = A.RandomHorizontalFlip(p=0.5)(A.Batch({"image": x}, {"image": "image"}, k)).fields["image"]
    for p in (np.float32(0.5), np.array(0.5)):
        got = A.RandomHorizontalFlip(p=p)(A.Batch({"image": x}, {"image": "image"}, k)).fields["image"]
        assert torch.equal(got, want)


def test_flips_keep_channels_last():
    x = _data((6, 3, 8, 8)).contiguous(memory_format=torch.channels_last)
    for op in (A.RandomHorizontalFlip(), A.RandomFlip((-2, -1)), A.RandomRot90()):
        out = op(x, keys(6, seed=9))
        assert out.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(out, op(x.contiguous(), keys(6, seed=9)))
    v = _data((4, 2, 4, 4, 4)).contiguous(memory_format=torch.channels_last_3d)
    assert A.RandomFlip((-3, -1))(v).is_contiguous(memory_format=torch.channels_last_3d)


def test_a_flip_under_inference_mode_leaves_later_training_unharmed():
    """Lightning validates under ``torch.inference_mode``: a flip there made the reused CPU
    scratch buffer an inference tensor, and every later flip outside it (the fit after a
    ``trainer.validate``) failed with "Inplace update to inference tensor outside
    InferenceMode". In a thread of its own: the buffer is per thread, so this one is made here."""
    import threading

    x = torch.arange(40 * 3 * 8 * 8, dtype=torch.uint8).view(40, 3, 8, 8)  # small samples: the reused buffer
    op = A.RandomHorizontalFlip(p=0.5)
    out: dict[str, torch.Tensor | BaseException] = {}

    def run() -> None:
        try:
            with torch.inference_mode():
                out["inside"] = op(x, keys(40, seed=3))
            out["outside"] = op(x, keys(40, seed=3))
        except BaseException as e:  # raised again in the test's thread
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=60)
    if "error" in out:
        raise out["error"]
    assert torch.equal(out["inside"], out["outside"]) and not out["outside"].is_inference()
