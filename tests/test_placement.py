"""Placement: huge-page fields on the CPU, sources that gather fresh batches, chunk buffers."""

from __future__ import annotations

import gc

import numpy as np
import torch
from _shared_job import device_plan, jpeg_store

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



def _ragged_store(n: int = 60) -> Store:
    from lightning_fastdata.ragged import RaggedArray

    g = np.random.default_rng(2)
    images = RaggedArray.from_list([g.integers(0, 256, (3, 1 + i % 7, 1 + i % 4), dtype=np.uint8) for i in range(n)])
    return Store.from_arrays({"x": images, "f": g.standard_normal((n, 5)).astype(np.float32),
                              "y": np.arange(n, dtype=np.int64)})


def test_every_source_serves_ragged_fields_the_same():
    from _helpers import chunked_loader, device_loader

    from lightning_fastdata.placement import ChunkBuffers, HostSource
    from lightning_fastdata.ragged import RaggedBatch, RaggedField

    store = _ragged_store()
    # chunks hold the fixed-shape fields only (5 floats + 1 int64 per row), ragged rows are copied per batch
    buffers = ChunkBuffers.for_store(store, "cpu", 28 * 20, 10)
    assert buffers.infos == [((5,), torch.float32), ((), torch.int64)] and buffers.rows == 20
    source = DeviceSource.from_arrays(list(store.fields), "cpu")
    assert isinstance(source.fields[0], RaggedField) and source.nbytes == store.fields[0].values.nbytes + 60 * 28
    loaders = {"device": device_loader(store, ShardedOrder(60, 10, seed=5)),
               "chunked": chunked_loader(store, ShardedOrder(60, 10, seed=5), buffers=buffers)}
    host = HostSource(list(store.fields))
    assert host.fixed == [1, 2] and len(host.tensors) == 2
    results = {}
    for name, loader in loaders.items():
        results[name] = list(loader)
        loader.close()
    for a, b in zip(results["device"], results["chunked"], strict=True):
        assert torch.equal(a.indices, b.indices)
        for batch in (a, b):
            x = batch.leaves[0]
            assert isinstance(x, RaggedBatch) and x.offsets.device.type == "cpu"
            want = host.gather(batch.indices)
            assert torch.equal(batch.leaves[1], want[1]) and torch.equal(batch.leaves[2], want[2])
            for got, i in zip(x.tensors(), batch.indices.tolist(), strict=True):
                assert np.array_equal(got.numpy(), store.fields[0][i])
    # a gathered batch is fresh memory: the user may keep it
    kept = results["device"][0].leaves[0].values
    assert kept.data_ptr() != results["device"][1].leaves[0].values.data_ptr()


def test_placing_a_ragged_store_counts_its_bytes_and_falls_back_on_oom():
    import warnings

    from lightning_fastdata.placement import ChunkedSource, inject_faults, place
    from lightning_fastdata.plan import Resources, decide

    store = _ragged_store()
    res = Resources(device_type="cuda", device_total=16 << 30, device_free=16 << 30, ram_total=8 << 30,
                    ram_available=8 << 30, physical_cores=2, logical_cores=2, shm_free=1 << 30)
    config = {"strategy": "device"}
    plan = decide(store.nbytes, res, config)
    assert plan.store_nbytes == store.nbytes
    with inject_faults(oom_at=2), warnings.catch_warnings(record=True):  # the fixed field after the ragged one
        placement = place({"train": store}, plan, "cpu", config, {"train": 10})
    assert placement.plan.strategy == "chunked" and isinstance(placement.sources["train"], ChunkedSource)


def test_ranks_agree_on_the_chunk_mode_so_their_shards_stay_disjoint(monkeypatch):
    # Each rank picks block or global from its own free RAM; block deals contiguous shards,
    # global strided ones. A rank that planned global must follow one that planned block.
    import lightning_fastdata.distributed as D
    from lightning_fastdata.placement import place
    from lightning_fastdata.plan import Resources, decide

    store = Store.from_arrays({"x": np.zeros((64, 3, 8, 8), np.uint8), "y": np.arange(64)})
    res = Resources(device_type="cpu", device_total=1 << 30, device_free=1 << 30, ram_total=1 << 30,
                    ram_available=1 << 30, physical_cores=2, logical_cores=2, shm_free=1 << 30)
    config = {"strategy": "chunked", "batch_nbytes": 8 * 200}
    plan = decide(store.nbytes, res, config)
    assert plan.strategy == "chunked" and plan.chunk_mode == "global"
    calls = []

    def other_rank_planned_block(value: float) -> float:
        calls.append(value)
        return 1.0 if len(calls) == 1 else value  # the chunk-mode vote; later votes as this rank's

    monkeypatch.setattr(D, "all_reduce_max", other_rank_planned_block)
    placement = place({"train": store}, plan, "cpu", config, {"train": 8})
    assert calls[0] == 0.0 and placement.plan.chunk_mode == "block" and not placement.segments
    assert "another rank" in placement.plan.reasons["chunk_mode"]
    for source in placement.sources.values():
        source.close()


def test_the_device_strategy_keeps_encoded_bytes_once_per_node_in_shared_memory():
    """A ``device`` placement keeps JPEG bytes in host memory (the decoders read them there).
    Read by several local ranks (here: ``shared_memory="on"``) they are one copy in /dev/shm,
    viewed by every rank, not a private copy per rank; alone, a private copy (not the disk
    cache's memory map). The bytes served are the store's either way."""
    from lightning_fastdata.placement import Sharing, place
    from lightning_fastdata.ragged import RaggedBatch

    store = jpeg_store()
    for mode in ("on", "auto"):
        plan = device_plan(store)
        placement = place({"train": store}, plan, "cpu", {"strategy": "device"}, {"train": 4},
                          sharing=Sharing(mode=mode))
        try:
            source = placement.sources["train"]
            assert source.encoded() == [0]
            values = source.fields[0].values
            assert values.device.type == "cpu" and values.data_ptr() != store.fields[0].values.ctypes.data
            if mode == "on":
                seg = placement.segments["train"]
                assert source.segment is seg and values.data_ptr() == seg.arrays()[0].values.ctypes.data
                assert placement.plan.reasons["shared_memory"].startswith("on: one copy of the encoded bytes of train")
            else:
                assert not placement.segments and source.segment is None
            batch = source.gather(torch.tensor([5, 0, 11]))
            assert isinstance(batch[0], RaggedBatch) and batch[1].tolist() == [5, 0, 11]
            for got, i in zip(batch[0].tensors(), (5, 0, 11), strict=True):
                assert np.array_equal(got.numpy(), store.fields[0][i])
        finally:
            placement.release("train")
