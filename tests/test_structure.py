"""Sample structure: how leaves become stored arrays, and errors that name the sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from lightning_fastdata.store import StoreError, build_store


class Items(Dataset):
    """Sample i is ``make(i)``."""

    def __init__(self, n: int, make) -> None:
        self.n, self.make = n, make

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.make(i)


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32, np.uint64, np.bool_])
def test_numpy_scalars_keep_their_dtype_and_value(cache_dir, dtype):
    # As numpy float scalars (and DataLoader's collate) keep theirs; uint64 values past
    # int64 come back exactly, not wrapped to negative numbers.
    top = np.iinfo(dtype).max if dtype is not np.bool_ else True
    values = [dtype(top), dtype(1), dtype(0), dtype(top)]
    store = build_store(Items(4, lambda i: (torch.zeros(2), values[i])), lambda s: s, cache_dir, progress=False)
    label = store.fields[1]
    assert label.dtype == np.dtype(dtype)
    assert [label[i] for i in range(4)] == values


def test_python_ints_are_int64_and_one_past_it_names_the_sample(cache_dir):
    store = build_store(Items(3, lambda i: (torch.zeros(2), i - 1)), lambda s: s, cache_dir, progress=False)
    assert store.fields[1].dtype == np.int64 and list(store.fields[1]) == [-1, 0, 1]
    big = Items(20, lambda i: (torch.zeros(2), 2**63 if i == 13 else i))
    with pytest.raises(StoreError, match=r"sample 13, field '1' is the int 9223372036854775808, outside int64"):
        build_store(big, lambda s: s, cache_dir / "big", progress=False)
    assert not any((cache_dir / "big").rglob("*.npy"))  # nothing half-written


@pytest.mark.parametrize("empty", [{}, (), []])
def test_a_sample_with_nothing_to_store_is_refused_before_any_cache_exists(cache_dir, empty):
    with pytest.raises(StoreError, match=r"sample 0 has nothing to store .*at least one"):
        build_store(Items(5, lambda i: empty), lambda s: s, cache_dir, progress=False)
    assert not list(cache_dir.glob("train-*"))  # no unusable cache published


def _fails_at_37(i: int):
    if i == 37:
        raise KeyError("missing key 'x'")
    return torch.full((2,), i)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_in_the_users_code_names_the_sample_it_was_reading(cache_dir, workers):
    with pytest.raises(Exception, match=r"missing key") as info:
        build_store(Items(64, _fails_at_37), lambda s: s, cache_dir, num_workers=workers, progress=False)
    # In this process the user's exception itself, with a note; from a worker, DataLoader's
    # re-raise, whose message carries the worker's traceback and the note.
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert "raised while caching sample 37" in text
    assert not list(cache_dir.glob("train-*"))


def test_big_endian_arrays_are_stored_in_native_byte_order(tmp_path):
    # torch reads native byte order only: big-endian arrays (FITS, some NIfTI and .mat files)
    # used to build a cache that setup then failed on with torch's byte-order error.
    from lightning_fastdata import OptimizedDataModule

    def make(i: int):
        return {"pts": np.arange(3 * (i % 3), dtype=">i4").reshape(-1, 3), "x": np.full(2, i / 3, dtype=">f8")}

    class BigEndian(OptimizedDataModule):
        def source(self, split: str):
            return Items(7, make) if split == "train" else None

    for strategy in ("device", "workers"):
        dm = BigEndian(batch_size=3, cache_dir=str(tmp_path / "cache"), ragged=["pts"], device="cpu",
                       strategy=strategy, num_workers=0, progress=False)
        dm.setup("fit")
        try:
            seen = []
            for batch in dm.train_dataloader():
                out = dm.augment_batch(batch)
                for j, i in enumerate(batch.indices.tolist()):
                    assert out["pts"][j].dtype == torch.int32 and out["x"].dtype == torch.float64
                    assert np.array_equal(out["pts"][j].numpy(), make(i)["pts"])
                    assert np.array_equal(out["x"][j].numpy(), make(i)["x"])
                    seen.append(i)
            assert sorted(seen) == list(range(7))
        finally:
            dm.teardown("fit")


def test_a_dotted_dict_key_that_names_a_nested_field_is_refused(cache_dir):
    """``{"meta": {"id": i}, "meta.id": j}``: both fields would be named 'meta.id', and one
    would silently stand for the other in the augmented batch."""
    def sample(i):
        return {"image": torch.zeros(3, 4, 4, dtype=torch.uint8), "meta": {"id": i}, "meta.id": 1000 + i}

    with pytest.raises(StoreError, match=r"sample 0 has two fields named 'meta.id': a dict key containing '.'"):
        build_store(Items(4, sample), lambda s: s, cache_dir, progress=False)
    assert not list(cache_dir.glob("train-*"))


@pytest.mark.parametrize("value,what,fix", [
    (np.array("img_0001.png"), "strings", "drop the field"),
    (np.array(b"abc"), "bytes strings", "drop the field"),
    (np.array("2024-01-02", dtype="datetime64[D]"), "datetimes", "astype"),
    (np.array(5, dtype="timedelta64[s]"), "time deltas", "astype"),
    (np.zeros(2, dtype=[("x", "f4"), ("y", "i4")]), "a structured record", "each of its fields"),
])
def test_ndarrays_torch_cannot_hold_are_refused_naming_the_field_before_writing(cache_dir, value, what, fix):
    with pytest.raises(StoreError, match=rf"sample 0, field 'name' is an ndarray of dtype .*\({what}\).*{fix}"):
        build_store(Items(3, lambda i: {"image": torch.zeros(2), "name": value}), lambda s: s, cache_dir,
                    progress=False)
    assert not list(cache_dir.glob("train-*"))  # no cache that every later run would trip on




def test_the_advice_for_a_numpy_string_field_says_a_str_loses_the_cache_and_how_to_keep_it(cache_dir):
    """It said "return a Python str instead (such a field is kept per sample, not stored)": doing
    that sent the whole split to per-sample loading, without the cache."""
    with pytest.raises(StoreError) as err:
        build_store(Items(3, lambda i: {"image": torch.zeros(2), "name": np.array(f"img_{i}.png")}), lambda s: s,
                    cache_dir, progress=False)
    msg = str(err.value)
    assert "kept per sample, not stored" not in msg
    assert "the whole split is then loaded per sample, without the cache" in msg
    assert "drop the field from static_transform's output" in msg and "map each value to an integer" in msg


class _Late(Dataset):
    """300 samples ``(image, label)``; sample 151's label is ``late``."""

    def __init__(self, late) -> None:
        self.late = late

    def __len__(self) -> int:
        return 300

    def __getitem__(self, i: int):
        return torch.full((3, 4, 4), i % 256, dtype=torch.uint8), (self.late if i == 151 else i)


def _left(cache_dir) -> list[str]:
    """What a failed build left in cache_dir: anything but the empty namespace directories."""
    return [str(p) for p in cache_dir.rglob("*") if not p.is_dir() or any(p.iterdir())]


@pytest.mark.parametrize("late,got", [(None, "None"), ("x", "a str"), (np.array([object()]), "an object-dtype")])
def test_a_later_sample_that_cannot_be_stored_is_an_error_not_a_per_sample_fallback(cache_dir, late, got):
    """Sample 0 stored, sample 151 None: the split used to be loaded per sample ("cannot be
    stored"), which crashed mid-epoch in collate ("Could not infer dtype of NoneType")."""
    from lightning_fastdata import OptimizedDataModule

    class DM(OptimizedDataModule):
        def source(self, split: str):
            return _Late(late) if split == "train" else None

    dm = DM(batch_size=16, cache_dir=str(cache_dir), device="cpu", num_workers=0, progress=False)
    want = rf"sample 151, field '1' is {got}.*, sample 0 has a number \(dtype int64\) there; make static_transform "
    with pytest.raises(StoreError, match=want):
        dm.prepare_data()
    assert dm.stores == {} and _left(cache_dir) == []  # nothing half-written, no lock file
    with pytest.raises(StoreError, match=want):  # the same from build workers
        build_store(_Late(late), lambda s: s, cache_dir / "w", num_workers=2, progress=False)
    assert _left(cache_dir) == []


def _keyed(i: int) -> dict:
    image = torch.full((3, 2, 2), i, dtype=torch.uint8)
    return {"image": image, "label": i} if i % 3 else {"label": i, "image": image}


@pytest.mark.parametrize("strategy", ["device", "workers"])
def test_dicts_with_the_same_keys_in_another_order_are_stored_in_sample_0s_order(cache_dir, strategy):
    """default_collate accepts them; the store refused them ("sample 1 has fields ['image',
    'label'], sample 0 has ['label', 'image']")."""
    from lightning_fastdata import OptimizedDataModule

    class DM(OptimizedDataModule):
        def source(self, split: str):
            return Items(10, _keyed) if split == "train" else None

    for _ in range(2):  # built, then reopened from the cache
        dm = DM(batch_size=4, cache_dir=str(cache_dir), device="cpu", strategy=strategy, num_workers=0,
                shuffle=False, progress=False)
        dm.setup("fit")
        try:
            batches = [dm.augment_batch(b) for b in dm.train_dataloader()]
        finally:
            dm.teardown("fit")
        assert all(list(b) == ["label", "image"] for b in batches)
        assert torch.equal(torch.cat([b["label"] for b in batches]), torch.arange(10))
        assert torch.equal(torch.cat([b["image"][:, 0, 0, 0] for b in batches]), torch.arange(10, dtype=torch.uint8))


def test_int_dict_keys_are_stored_and_come_back_as_ints(cache_dir):
    """``{0: image, 1: label}`` was refused with "keys must be str", naming no fix."""
    from lightning_fastdata import OptimizedDataModule

    class DM(OptimizedDataModule):
        def source(self, split: str):
            return Items(6, lambda i: {0: torch.full((2,), i), 1: i}) if split == "train" else None

    for _ in range(2):  # built, then reopened from the cache (the keys come back from its manifest)
        dm = DM(batch_size=3, cache_dir=str(cache_dir), device="cpu", num_workers=0, shuffle=False, progress=False)
        dm.setup("fit")
        try:
            batches = [dm.augment_batch(b) for b in dm.train_dataloader()]
        finally:
            dm.teardown("fit")
        assert [list(b) for b in batches] == [[0, 1], [0, 1]]
        assert torch.equal(torch.cat([b[1] for b in batches]), torch.arange(6))
    with pytest.raises(StoreError, match=r"sample 0 has the dict key \('a', 1\) \(tuple\) at the top; a stored "
                                         r"dict's keys must be str or int: convert them in static_transform"):
        build_store(Items(3, lambda i: {("a", 1): torch.zeros(2)}), lambda s: s, cache_dir / "t", progress=False)
