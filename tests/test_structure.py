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
    (np.array("img_0001.png"), "strings", "return a Python str"),
    (np.array(b"abc"), "bytes strings", "return a Python str"),
    (np.array("2024-01-02", dtype="datetime64[D]"), "datetimes", "astype"),
    (np.array(5, dtype="timedelta64[s]"), "time deltas", "astype"),
    (np.zeros(2, dtype=[("x", "f4"), ("y", "i4")]), "a structured record", "each of its fields"),
])
def test_ndarrays_torch_cannot_hold_are_refused_naming_the_field_before_writing(cache_dir, value, what, fix):
    with pytest.raises(StoreError, match=rf"sample 0, field 'name' is an ndarray of dtype .*\({what}\).*{fix}"):
        build_store(Items(3, lambda i: {"image": torch.zeros(2), "name": value}), lambda s: s, cache_dir,
                    progress=False)
    assert not list(cache_dir.glob("train-*"))  # no cache that every later run would trip on


