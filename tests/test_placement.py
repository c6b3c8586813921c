"""Placement: huge-page fields on the CPU, sources that gather fresh batches, chunk buffers."""

from __future__ import annotations

import gc

import numpy as np
import torch

from lightning_fastdata.loaders import IndexLoader, ShardedOrder
from lightning_fastdata.placement import DeviceSource, place_fields
from lightning_fastdata.store import Store


def test_large_fields_placed_bit_equal_and_independent():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(1200, 3, 32, 32), dtype=np.uint8)  # 11 MiB: huge-page path
    feats = rng.standard_normal((1200, 1100)).astype(np.float32)  # 5 MiB, another dtype
    labels = np.arange(1200, dtype=np.int64)  # small: plain torch.empty
    store = Store.from_arrays({"x": images, "f": feats, "y": labels})
    fields, spec = place_fields(list(store.fields), "cpu"), store.spec
    del store
    gc.collect()
    got = {k: f for k, f in zip(("x", "f", "y"), fields, strict=True)}
    assert got["x"].dtype == torch.uint8 and got["f"].dtype == torch.float32 and got["y"].dtype == torch.int64
    assert np.array_equal(got["x"].numpy(), images)
    assert np.array_equal(got["f"].numpy(), feats)
    assert np.array_equal(got["y"].numpy(), labels)
    got["x"][0].fill_(7)  # writable, and a copy: the source arrays are untouched
    assert images[0].max() != 7 or images[0].min() != 7

    order = ShardedOrder(1200, 100, shuffle=True, seed=3)
    loader = IndexLoader(DeviceSource(fields), order, spec, ["x", "f", "y"])
    seen = []
    for batch in loader:
        idx = batch["y"]
        assert torch.equal(batch["x"], got["x"][idx]) and torch.equal(batch["f"], got["f"][idx])
        seen.append(idx)
    assert sorted(torch.cat(seen).tolist()) == list(range(1200))

