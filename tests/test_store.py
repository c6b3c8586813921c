"""Store: dataset -> cache -> arrays; fingerprint, reuse, validation, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _helpers import CountingDataset

from lightning_fastdata.store import Store, StoreError, build_store, open_store


def test_roundtrip_bit_equal_and_structure(cache_dir):
    ds = CountingDataset(20)
    store = build_store(ds, lambda s: {"image": s[0], "label": s[1]}, cache_dir, progress=False)
    assert len(store) == 20
    assert [i.name for i in store.infos] == ["image", "label"]
    for i in range(20):
        img, lab = ds[i]
        assert np.array_equal(store.fields[0][i], img.numpy())
        assert store.fields[1][i] == lab
    batch = store.batch([torch.from_numpy(np.asarray(a[:4])) for a in store.fields])
    assert set(batch) == {"image", "label"} and batch["image"].shape == (4, 3, 8, 8)


def test_reuse_does_not_rerun_transform(cache_dir):
    calls = []

    def t(s):
        calls.append(1)
        return s

    build_store(CountingDataset(30), t, cache_dir, progress=False)
    assert len(calls) == 30 + 3  # every sample once, plus the fingerprint's 3 probes
    calls.clear()
    build_store(CountingDataset(30), t, cache_dir, progress=False)
    assert len(calls) == 3  # only the probes


def test_changed_transform_rebuilds_with_warning(cache_dir):
    build_store(CountingDataset(10), lambda s: s, cache_dir, progress=False)
    with pytest.warns(UserWarning, match="fingerprint"):
        s2 = build_store(CountingDataset(10), lambda s: (s[0] // 2, s[1]), cache_dir, progress=False)
    assert len(list(cache_dir.glob("train-*"))) == 1
    assert np.array_equal(s2.fields[0][3], CountingDataset(10)[3][0].numpy() // 2)


def test_truncated_file_is_rebuilt(cache_dir):
    s = build_store(CountingDataset(10), lambda s: s, cache_dir, progress=False)
    f = s.path / "field_0.npy"
    data = f.read_bytes()
    f.write_bytes(data[:-7])
    with pytest.warns(UserWarning, match="truncated"):
        s2 = build_store(CountingDataset(10), lambda s: s, cache_dir, progress=False)
    assert np.array_equal(s2.fields[0][9], CountingDataset(10)[9][0].numpy())


def test_flipped_byte_and_edited_manifest_detected(cache_dir):
    s = build_store(CountingDataset(10), lambda s: s, cache_dir, progress=False)
    f = s.path / "field_0.npy"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match="checksum"):
        build_store(CountingDataset(10), lambda s: s, cache_dir, progress=False)
    m = s.path / "manifest.json"
    doc = json.loads(m.read_text())
    doc["n"] = 9
    m.write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match="modified"):
        build_store(CountingDataset(10), lambda s: s, cache_dir, progress=False)


def test_bad_samples_name_the_index(cache_dir):
    class Ragged(CountingDataset):
        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return (x[:, :7] if i == 5 else x), y

    with pytest.raises(StoreError, match="sample 5"):
        build_store(Ragged(10), lambda s: s, cache_dir, progress=False, probes=2)
    assert not list(cache_dir.glob("train-*")) and not list(cache_dir.glob(".tmp-*"))
    with pytest.raises(StoreError, match="empty"):
        build_store(CountingDataset(0), lambda s: s, cache_dir, progress=False)
    from PIL import Image

    with pytest.raises(StoreError, match="PIL image.*pil_to_tensor"):
        build_store(CountingDataset(4), lambda s: (Image.new("RGB", (4, 4)), s[1]), cache_dir, progress=False)


def test_from_arrays_and_open_store(cache_dir):
    s = Store.from_arrays((np.zeros((5, 2), np.uint8), np.arange(5)))
    assert len(s) == 5 and s.nbytes == 10 + 40
    built = build_store(CountingDataset(6), lambda s: s, cache_dir, progress=False)
    again = open_store(built.path)
    assert again.fingerprint == built.fingerprint
