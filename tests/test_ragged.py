"""Ragged fields: the arrays, their gathers, and a round trip through every strategy of the data module."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from lightning_fastdata import OptimizedDataModule
from lightning_fastdata.ragged import RaggedArray, RaggedBatch, RaggedField, gather_host, gather_values

FIELDS = ("img", "pts", "vec")


def ragged_sample(i: int) -> dict:
    """Sample ``i``: uint8, int16 and float32 fields whose shapes vary per sample, and a label."""
    g = np.random.default_rng(i)
    h, w = (int(x) for x in g.integers(1, 9, 2))
    return {"img": torch.from_numpy(g.integers(0, 256, (3, h, w)).astype(np.uint8)),
            "pts": torch.from_numpy(g.integers(-30000, 30000, (w, 2)).astype(np.int16)),
            "vec": torch.from_numpy(g.normal(size=(h * w - 1,)).astype(np.float32)),  # empty when 1x1
            "label": i}


class RaggedSource(torch.utils.data.Dataset):
    def __init__(self, n: int = 37) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return ragged_sample(i)


class RaggedModule(OptimizedDataModule):
    """Counts static_transform calls, so a test can tell a reused cache from a rebuilt one."""

    def __init__(self, n: int = 37, **kwargs) -> None:
        kwargs.setdefault("progress", False)
        super().__init__(**kwargs)
        self.n = n
        self.calls = 0

    def source(self, split: str):
        return RaggedSource(self.n) if split == "train" else None

    def static_transform(self, sample):
        self.calls += 1
        return sample


def sample_array(n: int = 9, seed: int = 0) -> RaggedArray:
    g = np.random.default_rng(seed)
    return RaggedArray.from_list([g.integers(0, 100, (int(g.integers(0, 4)), 2)).astype(np.int16) for _ in range(n)])


# --------------------------------------------------------------------------- the arrays


def test_ragged_array_views_samples_and_reports_inconsistencies():
    a = sample_array()
    assert len(a) == 9 and a.ndim == 2 and a.dtype == np.int16
    assert a.nbytes == a.values.nbytes + a.offsets.nbytes + a.shapes.nbytes
    for i in range(9):
        assert a[i].shape == tuple(a.shapes[i]) and a[i].base is not None  # a view of the values
    assert a.problems() == []
    edited = RaggedArray(a.values, a.offsets.copy(), a.shapes)
    edited.offsets[4] += 1
    assert "sample 3 spans" in edited.problems()[0]
    short = RaggedArray(a.values[:-1], a.offsets, a.shapes)
    assert "offsets end at" in short.problems()[0]
    with pytest.raises(ValueError, match="one dtype and one ndim"):
        RaggedArray.from_list([np.zeros(2, np.int16), np.zeros(2, np.int32)])


def test_ragged_batch_keeps_sizes_on_the_cpu_and_views_its_values():
    batch = gather_host(sample_array(), np.array([5, 0, 5, 8]))
    assert len(batch) == 4 and batch.offsets.device.type == "cpu"
    views = batch.tensors()
    assert all(v.data_ptr() == batch.values[int(o):].data_ptr() or v.numel() == 0
               for v, o in zip(views, batch.offsets[:-1], strict=True))
    moved = batch.to("meta")  # the values move; offsets and shapes stay on the CPU
    assert moved.values.device.type == "meta" and moved.offsets is batch.offsets and moved.shapes is batch.shapes
    with pytest.raises(ValueError, match="on the CPU"):
        RaggedBatch(batch.values, batch.offsets.to("meta"), batch.shapes)


def test_the_device_gather_builds_its_element_index_without_a_loop_and_equals_the_host_gather():
    a = sample_array(50, seed=3)
    values, offsets = torch.from_numpy(a.values), torch.from_numpy(a.offsets)
    for idx in ([3, 3, 0, 49, 17], list(range(50)), [7]):
        want = gather_host(a, np.array(idx))
        total = int(want.offsets[-1])
        got = gather_values(values, offsets, torch.tensor(idx), total)
        assert torch.equal(got, want.values)
    # a placed field gathers the same on whichever device holds it
    field = RaggedField(values, offsets, offsets, torch.from_numpy(a.shapes))
    got = field.gather(torch.tensor([9, 2, 2]))
    want = gather_host(a, np.array([9, 2, 2]))
    assert all(torch.equal(x, y) for x, y in zip(got.tensors(), want.tensors(), strict=True))


# --------------------------------------------------------------------------- through the data module

STRATEGIES = [
    dict(strategy="device"),
    dict(strategy="chunked"),
    dict(strategy="workers", num_workers=0),
    dict(strategy="workers", num_workers=2),
    dict(strategy="workers", num_workers=2, shared_memory="on"),
    dict(strategy="chunked", shared_memory="on"),
]


def _check_epoch(dm: RaggedModule, n: int) -> None:
    seen = []
    for batch in dm.train_dataloader():
        names = batch.names
        for name in FIELDS:
            leaf = batch.leaves[names.index(name)]
            assert isinstance(leaf, RaggedBatch) and leaf.offsets.device.type == "cpu"
        out = dm.on_after_batch_transfer(batch, 0)  # ragged fields become lists of tensors
        for j, i in enumerate(batch.indices.tolist()):
            want = ragged_sample(i)
            for name in FIELDS:
                got = out[name][j]
                assert got.dtype == want[name].dtype and got.shape == want[name].shape
                assert torch.equal(got, want[name]), (name, i)
            assert int(out["label"][j]) == i
            seen.append(i)
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("config", STRATEGIES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_ragged_fields_round_trip_bit_equal_through_every_strategy(tmp_path, config):
    kw = dict(batch_size=8, cache_dir=str(tmp_path / "cache"), ragged=list(FIELDS), device="cpu", **config)
    for attempt in range(2):  # the second setup reuses the cache
        dm = RaggedModule(**kw)
        dm.setup("fit")
        try:
            assert dm.plan.strategy == config["strategy"]
            store = dm.stores["train"]
            assert [i.ragged for i in store.infos] == [True, True, True, False]
            assert all(isinstance(store.fields[k], RaggedArray) for k in range(3))
            if config.get("shared_memory") == "on":
                assert dm.placement.segments
            _check_epoch(dm, 37)
        finally:
            dm.teardown("fit")
        if attempt == 0:
            assert dm.calls > 37  # built: every sample, plus the probes
        else:
            assert dm.calls <= 8  # reused: the probes only


def test_a_ragged_other_field_passes_through_the_augmentation_as_a_list(tmp_path):
    from lightning_fastdata import augment as A

    class Fixed(RaggedModule):
        def static_transform(self, sample):
            return {"image": torch.full((3, 4, 4), sample["label"] % 256, dtype=torch.uint8), "pts": sample["pts"]}

    dm = Fixed(batch_size=5, cache_dir=str(tmp_path / "cache"), ragged=["pts"], device="cpu", strategy="device",
               field_kinds={"image": "image", "pts": "other"}, train_augment=A.RandomHorizontalFlip(p=1.0))
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    out = batch.structure() if batch.prepared else dm.on_after_batch_transfer(batch, 0)
    assert isinstance(out["pts"], list) and len(out["pts"]) == len(batch)
    for j, i in enumerate(batch.indices.tolist()):
        assert torch.equal(out["pts"][j], ragged_sample(i)["pts"])
    dm.teardown("fit")


def test_ragged_and_encode_are_checked_at_construction():
    with pytest.raises(ValueError, match="ragged must be a list of field names, got 'img'"):
        RaggedModule(ragged="img")
    with pytest.raises(ValueError, match=r"encode\['img'\] is 'png'"):
        RaggedModule(encode={"img": "png"})
    with pytest.raises(ValueError, match="jpeg_quality must be an int in \\[1, 100\\], got 0"):
        RaggedModule(jpeg_quality=0)
    with pytest.raises(ValueError, match=r"max_side must be None or an int in \[1, 65500\]"):
        RaggedModule(max_side=-3)
    with pytest.raises(ValueError, match="need store=True"):
        RaggedModule(ragged=["img"], store=False)


def test_max_side_without_encode_warns_that_it_caps_nothing():
    # It caps encoded images only: ragged=["img"], max_side=64 stored full-size images silently.
    with pytest.warns(UserWarning, match=r"max_side=64 caps the longest side of encoded images only, and encode "
                                         r"names no field: the images are stored at their own size"):
        RaggedModule(ragged=["img"], max_side=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RaggedModule(ragged=["img"], encode={"img": "jpeg"}, max_side=64)
        RaggedModule(ragged=["img"])


def test_an_unknown_ragged_field_is_named_with_the_fields_at_setup(tmp_path):
    from lightning_fastdata.store import StoreError

    dm = RaggedModule(cache_dir=str(tmp_path / "cache"), ragged=["image"], device="cpu")
    with pytest.raises(StoreError, match=r"ragged names a field 'image' that the samples do not have; their "
                                         r"fields are \['img', 'pts', 'vec', 'label'\]"):
        dm.setup("fit")


@pytest.mark.parametrize("first", [1, 0], ids=["boxes", "no-box-in-sample-0"])
def test_a_ragged_field_held_as_a_python_list_is_named_with_the_fix(tmp_path, first):
    # A list is a structure (each element its own field, none when empty): the error used to
    # say the samples have no field 'boxes' at all.
    from lightning_fastdata.store import StoreError

    class Boxes(RaggedModule):
        def static_transform(self, sample):
            return {"image": sample["img"], "boxes": [[0, 0, 2, 2]] * (sample["label"] % 3 + first)}

    dm = Boxes(cache_dir=str(tmp_path / "cache"), ragged=["image", "boxes"], device="cpu")
    listed = r"'boxes.0.0', " if first else r"none here: it is empty"
    with pytest.raises(StoreError, match=r"ragged names 'boxes', which the samples hold as a list, tuple or dict, so "
                                         rf"each element is a field of its own \({listed}.*torch.as_tensor"):
        dm.setup("fit")
    assert not list((tmp_path / "cache").rglob("field_*"))


def test_a_model_trains_on_ragged_fields_as_lists(tmp_path):
    import lightning as L
    from _helpers import trainer

    class ListModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen: list[int] = []

        def training_step(self, batch, batch_idx):
            assert all(isinstance(batch[name], list) for name in FIELDS)
            self.seen += batch["label"].tolist()
            return self.w * sum(x.float().mean() for x in batch["img"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = ListModel()
    dm = RaggedModule(batch_size=8, cache_dir=str(tmp_path / "cache"), ragged=list(FIELDS), strategy="device")
    trainer(tmp_path, max_epochs=1).fit(model, dm)
    assert sorted(model.seen) == list(range(37))
