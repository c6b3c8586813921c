"""Ragged-batch helpers: grouping samples so that no canvas wastes more than MAX_WASTE, canvases
that hold each sample at its corner with the rest filled, and results put back in order."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_fastdata.augment_lists import MAX_WASTE, canvas, groups, lead_shape, scatter, take


def test_similar_sizes_make_one_group_in_order():
    sizes = [(256, 200), (190, 256), (256, 256), (230, 256)]
    assert groups(sizes) == [[0, 1, 2, 3]]


def test_one_large_sample_gets_its_own_group_and_every_group_stays_within_the_waste_bound():
    sizes = [(20, 30), (4000, 3000), (25, 25), (30, 20), (400, 300), (380, 320)]
    out = groups(sizes)
    assert sorted(i for g in out for i in g) == list(range(len(sizes)))
    assert [1] in out
    for g in out:
        extent = [max(sizes[i][d] for i in g) for d in range(2)]
        assert len(g) * math.prod(extent) <= MAX_WASTE * sum(math.prod(sizes[i]) for i in g) or len(g) == 1


def test_canvas_places_samples_at_their_corners_and_fills_the_rest():
    xs = [torch.full((2, 3, 4), 1), torch.full((2, 5, 2), 2)]
    c = canvas(xs, [1, 0], 2, fill=-1, place=[(0, 0), (1, 2)])
    assert c.shape == (2, 2, 6, 4)  # the extent holds sample 1 at (1, 2): rows 1..5, cols 2..3
    assert torch.equal(c[0, :, 1:6, 2:4], xs[1]) and (c[0, :, :1] == -1).all() and (c[0, :, :, :2] == -1).all()
    assert torch.equal(c[1, :, :3, :4], xs[0]) and (c[1, :, 3:] == -1).all()
    same = canvas([torch.ones(1, 2, 2), torch.zeros(1, 2, 2)], [0, 1], 2)
    assert torch.equal(same, torch.stack([torch.ones(1, 2, 2), torch.zeros(1, 2, 2)]))


def test_take_and_scatter_restore_the_sample_order():
    params = {"a": torch.arange(5) * 10}
    assert take(params, [0, 1, 2, 3, 4], 5) is params
    assert torch.equal(take(params, [3, 1], 5)["a"], torch.tensor([30, 10]))
    parts = [([3, 1], torch.tensor([[3], [1]])), ([0, 2, 4], torch.tensor([[0], [2], [4]]))]
    assert torch.equal(scatter(parts, 5), torch.arange(5).view(5, 1))


def test_lead_shape_names_the_odd_sample():
    assert lead_shape([torch.zeros(3, 4, 5), torch.zeros(3, 6, 2)], 2, "image") == (3,)
    # The fix is in the dataset (decoding has no mode to choose): the hint says so.
    with pytest.raises(ValueError, match=r"sample 1 has shape \(1, 6, 2\).*same channels in the dataset"):
        lead_shape([torch.zeros(3, 4, 5), torch.zeros(1, 6, 2)], 2, "image")


def test_lead_shape_names_dataset_indices_when_given():
    """Before: the error named the position in the batch ("sample 1"), which the user cannot find in the dataset."""
    xs = [torch.zeros(1, 4, 5), torch.zeros(3, 6, 2)]
    with pytest.raises(ValueError, match=r"field 'image': sample 41 \(batch position 1\) has shape \(3, 6, 2\) and "
                                         r"sample 7 \(batch position 0\) \(1, 4, 5\)"):
        lead_shape(xs, 2, "image", index=torch.tensor([7, 41]))
    with pytest.raises(ValueError, match=r"sample 41 \(batch position 1\)"):
        lead_shape(xs, 2, "image", index=[7, 41])


@pytest.mark.parametrize("op", ["RandomResizedCrop", "CenterCrop", "RandomCrop"])
def test_the_size_fixing_ops_name_the_dataset_index_of_a_sample_with_other_channels(op):
    from lightning_fastdata import augment as A
    from lightning_fastdata.augment import Batch
    from lightning_fastdata.keys import SampleKeys

    kwargs = {"pad_if_needed": True} if op == "RandomCrop" else {}
    xs = [torch.zeros(3, 10, 12, dtype=torch.uint8), torch.zeros(1, 9, 9, dtype=torch.uint8)]
    batch = Batch({"image": xs}, keys=SampleKeys(0, 0, torch.tensor([41, 7])))
    with pytest.raises(ValueError, match=r"sample 7 \(batch position 1\) has shape \(1, 9, 9\) and sample 41 "):
        getattr(A, op)(8, **kwargs)(batch)
