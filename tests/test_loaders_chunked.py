"""Chunked source: the device batches (global order), each sample once (block order), exact mid-chunk resume."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from _helpers import chunked_loader, device_loader

from lightning_fastdata.loaders import ShardedOrder
from lightning_fastdata.placement import ChunkBuffers, ChunkedSource, HostSource, inject_faults, staging_empty
from lightning_fastdata.store import Store

ROW = 3 * 4 * 4 + 8  # bytes per sample: uint8 image + int64 label


def make_store(n: int) -> Store:
    rng = np.random.default_rng(n)
    images = rng.integers(0, 256, (n, 3, 4, 4), dtype=np.uint8)
    return Store.from_arrays({"image": images, "label": np.arange(n, dtype=np.int64)})


def collect(loader, limit: int | None = None) -> list[dict]:
    # References only: a batch handed out never changes afterwards.
    return [batch.structure() for batch in itertools.islice(loader, limit)]


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)


@pytest.mark.parametrize("n, bs, world, drop_last, shuffle, chunk_batches", [
    (103, 8, 1, False, True, 3),    # partial last chunk, partial last batch
    (103, 8, 2, False, True, 1),    # one batch per chunk, padded shards
    (100, 7, 3, True, True, 2),     # truncated shards, last batch dropped
    (64, 16, 1, False, False, 10),  # one chunk bigger than the shard
    (50, 5, 2, True, True, 5),
])
def test_global_mode_yields_exactly_the_device_batches(n, bs, world, drop_last, shuffle, chunk_batches):
    store = make_store(n)
    for rank in range(world):
        for epoch in (0, 1):
            kw = dict(shuffle=shuffle, drop_last=drop_last, seed=7, rank=rank, world_size=world)
            ref_order, order = ShardedOrder(n, bs, **kw), ShardedOrder(n, bs, **kw)
            ref_order.set_epoch(epoch)
            order.set_epoch(epoch)
            loader = chunked_loader(store, order, chunk_bytes=chunk_batches * bs * ROW)
            assert loader.source.rows == min(chunk_batches, math.ceil(math.ceil(n / world) / bs)) * bs
            got, want = collect(loader), collect(device_loader(store, ref_order))
            assert len(got) == len(loader) == len(want) > 0
            assert same(got, want), (rank, epoch)


def test_block_mode_covers_every_sample_once_per_epoch_reads_locally():
    n, bs = 120, 6
    store = make_store(n)
    epochs = []
    for epoch in (0, 1):
        labels = []
        for rank in range(2):
            order = ShardedOrder(n, bs, seed=3, rank=rank, world_size=2)
            order.set_epoch(epoch)
            loader = chunked_loader(store, order, chunk_bytes=2 * bs * ROW, mode="block", window=2)
            batches = collect(loader)
            rank_labels = torch.cat([b["label"] for b in batches])
            assert len(batches) == len(loader) == 10
            for b in batches:  # images travel with their labels
                assert torch.equal(b["image"], torch.from_numpy(np.asarray(store.fields[0]))[b["label"]])
            assert torch.equal(rank_labels, loader.indices())
            # A window of 2 chunks (24 rows) reads only the 2 blocks of 12 rows it was cut from.
            for w in range(0, rank_labels.numel(), 24):
                assert len(set((rank_labels[w:w + 24] // 12).tolist())) <= 2
            labels.append(rank_labels)
        every = torch.cat(labels)
        assert sorted(every.tolist()) == list(range(n))  # each sample exactly once over both ranks
        epochs.append(every)
    assert not torch.equal(epochs[0], epochs[1])  # a new order every epoch
    again = chunked_loader(store, ShardedOrder(n, bs, seed=3, rank=0, world_size=2), chunk_bytes=2 * bs * ROW,
                           mode="block", window=2)
    assert torch.equal(again.indices(), epochs[0][:60])  # reproducible from the seed


@pytest.mark.parametrize("mode", ["global", "block"])
@pytest.mark.parametrize("stop", [1, 4, 5, 11])  # mid-chunk (chunks of 3 batches) and on a chunk edge
def test_resume_mid_chunk_is_exact(mode, stop):
    store = make_store(90)

    def fresh():
        order = ShardedOrder(90, 7, seed=11)
        order.set_epoch(2)
        return chunked_loader(store, order, chunk_bytes=3 * 7 * ROW, mode=mode)

    full = collect(fresh())
    first = fresh()
    head = collect(first, stop)
    state = first.state_dict()
    assert state["batch"] == stop and state["epoch"] == 2 and state["mode"] == mode
    resumed = fresh()
    resumed.set_epoch(0)
    resumed.load_state_dict(state)
    tail = collect(resumed)
    assert same(head + tail, full)
    assert same(collect(resumed), full)  # the following iteration starts from the beginning again


@pytest.mark.parametrize("chunk_batches", [1, 2, 3, 8])
def test_kept_batches_never_change_when_their_chunk_is_refilled(chunk_batches):
    # A user may keep every batch (a callback logging images): none may change afterwards.
    store = make_store(97)
    want = collect(device_loader(store, ShardedOrder(97, 4, seed=9)))
    loader = chunked_loader(store, ShardedOrder(97, 4, seed=9), chunk_bytes=chunk_batches * 4 * ROW)
    held = list(loader)
    assert len(held) == len(want)
    for old, ref in zip(held, want, strict=True):
        assert all(torch.equal(old[k], ref[k]) for k in ref)


def test_consumed_batches_are_counted_when_the_consumer_reports_them():
    loader = chunked_loader(make_store(40), ShardedOrder(40, 4, seed=1), chunk_bytes=2 * 4 * ROW)
    it = iter(loader)
    first, _, _ = next(it), next(it), next(it)  # a prefetcher pulled three batches
    loader.consumed(first)  # ... the consumer used one
    assert first.index == 0 and loader.state_dict()["batch"] == 1


def test_resume_refuses_another_mode_or_chunking():
    store = make_store(40)
    block = chunked_loader(store, ShardedOrder(40, 4), chunk_bytes=2 * 4 * ROW, mode="block")
    with pytest.raises(ValueError, match="checkpoint has mode='global'"):
        block.load_state_dict(chunked_loader(store, ShardedOrder(40, 4)).state_dict())
    other = chunked_loader(store, ShardedOrder(40, 4), chunk_bytes=4 * 4 * ROW, mode="block")
    with pytest.raises(ValueError, match=r"chunk_rows=16, the loader has chunk_rows=8; .*block mode the sample "
                                         r"order follows the chunk size.*free host memory"):
        block.load_state_dict(other.state_dict())


def test_buffers_are_allocated_once_and_reused():
    store = make_store(200)
    buffers = ChunkBuffers.for_store(store, "cpu", chunk_bytes=2 * 10 * ROW, batch_size=10)
    assert buffers.rows == 20 and len(buffers.slots) == 2 and buffers.staging is None
    assert buffers.nbytes == 2 * 20 * ROW
    ptrs = [t.data_ptr() for slot in buffers.slots for t in slot]
    loader = chunked_loader(store, ShardedOrder(200, 10, seed=5), buffers=buffers)
    with inject_faults(oom_at=1) as faults:  # any device allocation now would raise
        for epoch in range(3):
            loader.set_epoch(epoch)
            assert len(collect(loader)) == 20
        assert faults.count == 0
    assert [t.data_ptr() for slot in buffers.slots for t in slot] == ptrs


def test_stopping_early_then_iterating_again_is_clean():
    store = make_store(100)
    order = ShardedOrder(100, 5, seed=2)
    loader = chunked_loader(store, order, chunk_bytes=2 * 5 * ROW)
    it = iter(loader)
    next(it)
    it.close()  # the next chunk's load is in flight: it must finish before the buffers are reused
    assert same(collect(loader), collect(device_loader(store, ShardedOrder(100, 5, seed=2))))
    loader.close()
    assert len(collect(loader)) == 20  # a closed loader restarts its thread when iterated


def test_staging_falls_back_to_pageable_memory_with_a_warning():
    # Without a CUDA driver pinning fails for real; the injected failure covers GPU machines.
    with inject_faults(pin_fails=True), pytest.warns(RuntimeWarning, match=r"could not pin a 4.8 KB .*ulimit -l"):
        buf = staging_empty((100, 3, 4, 4), torch.uint8)
    assert buf.shape == (100, 3, 4, 4) and not buf.is_pinned()
    assert not staging_empty((4,), torch.uint8, pin=False).is_pinned()


def test_buffers_must_hold_whole_batches_of_the_same_fields():
    store = make_store(40)
    with pytest.raises(ValueError, match="rows must be a positive multiple of batch_size, got rows=10 batch_size=4"):
        ChunkBuffers([((3, 4, 4), torch.uint8)], 10, 4, "cpu")
    wrong = ChunkBuffers([((3, 4, 4), torch.uint8)], 8, 4, "cpu")
    with pytest.raises(ValueError, match="do not fit the source's fields"):
        ChunkedSource(HostSource(list(store.fields)), wrong)
    fields = [((3, 4, 4), torch.uint8), ((), torch.int64)]
    odd = ChunkedSource(HostSource(list(store.fields)), ChunkBuffers(fields, 9, 3, "cpu"))
    with pytest.raises(ValueError, match="chunks of 9 rows do not hold whole batches of 4"):
        next(odd.batches(torch.arange(40), 4))
    with pytest.raises(ValueError, match="window must be an int >= 1, got 0"):
        chunked_loader(store, ShardedOrder(40, 4), mode="block", window=0)


def test_trainer_resume_mid_chunk_is_exact(tmp_path):
    """Through Lightning: a run resumed from a mid-chunk checkpoint sees exactly the rest of the batches."""
    from _helpers import TinyDataModule, TinyModel, trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    cache = str(tmp_path / "c")

    def dm():
        return TinyDataModule(n=64, batch_size=8, cache_dir=cache, device="cpu", strategy="chunked", val=False)

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, filename="{step}")
    full, first = TinyModel(record=True), dm()
    trainer(tmp_path, max_epochs=2, callbacks=[ckpt], enable_checkpointing=True).fit(full, first)
    assert first.plan.strategy == "chunked"
    assert ChunkBuffers.for_store(first.stores["train"], "cpu", first.plan.chunk_bytes, 8).rows == 16  # 2 batches
    resumed = TinyModel(record=True)
    trainer(tmp_path, max_epochs=2).fit(resumed, dm(), ckpt_path=str(tmp_path / "ckpt" / "step=3.ckpt"))
    assert len(full.seen) == 16 and len(resumed.seen) == 13
    for (x0, y0), (x1, y1) in zip(full.seen[3:], resumed.seen, strict=True):
        assert torch.equal(y0, y1) and torch.equal(x0, x1)


@pytest.mark.parametrize("rechunk", [False, True], ids=["setup-in-inference-mode", "eval-batch-size-changed"])
def test_validate_and_predict_under_inference_mode(tmp_path, rechunk):
    """Buffers made under inference mode (an eval script's ``with torch.inference_mode():``, or
    the chunks remade inside Lightning's evaluation loop for a new eval batch size) were inference
    tensors: the fill thread's writes failed with "Inplace update to inference tensor outside
    InferenceMode is not allowed" (found by review 88)."""
    from _helpers import TinyDataModule, TinyModel, trainer

    dm = TinyDataModule(n=40, batch_size=4, cache_dir=str(tmp_path / "c"), device="cpu", strategy="chunked")
    if rechunk:
        dm.setup("validate")
        dm.eval_batch_size = 3  # not a divisor of the chunk's rows: remade in the validation loop
    with torch.inference_mode():
        (res,) = trainer(tmp_path).validate(TinyModel(), dm, verbose=False)
    assert dm.plan.strategy == "chunked" and res["val_loss"] > 0
    dm.teardown("validate")


@pytest.mark.parametrize("threads", [1, 3])
def test_chunks_filled_by_several_threads_hold_the_same_rows(threads):
    store = make_store(101)
    buffers = ChunkBuffers.for_store(store, "cpu", chunk_bytes=4 * 5 * ROW, batch_size=5)
    source = ChunkedSource(HostSource(list(store.fields)), buffers, fill_threads=threads)
    order = ShardedOrder(101, 5, seed=8)
    got = [b for b, _ in source.batches(order.indices(), 5)]
    want = [b for b, _ in HostSource(list(store.fields)).batches(order.indices(), 5)]
    assert len(got) == len(want) == 21
    assert all(torch.equal(a, b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    source.close()
    with pytest.raises(ValueError, match="fill_threads must be an int >= 1, got 0"):
        ChunkedSource(HostSource(list(store.fields)), buffers, fill_threads=0)


@pytest.mark.parametrize("ahead", [0, 2])
def test_an_older_live_iteration_stops_rather_than_read_the_newer_ones_rows(ahead):
    # Two live iterations of one split share its two chunk buffers (a callback iterating a
    # second train loader mid-epoch): the newer one is exact, the older one raises when
    # resumed instead of yielding rows the newer one loaded.
    store = make_store(100)
    ref = collect(device_loader(store, ShardedOrder(100, 5, seed=2)))
    loader = chunked_loader(store, ShardedOrder(100, 5, seed=2), chunk_bytes=2 * 5 * ROW)
    loader.ahead = ahead
    old = iter(loader)
    first = [next(old).structure() for _ in range(3)]
    assert same(first, ref[:3])
    assert same(collect(loader), ref)
    more = []
    with pytest.raises(RuntimeError, match=r"another iteration of the same split started while it was running"):
        for batch in old:  # batches made ahead before the newer iteration started are still right
            more.append(batch.structure())
    assert len(more) <= ahead + 1 and same(more, ref[3:3 + len(more)])  # queued + one being handed over
    old.close()
    assert same(collect(loader), ref)  # and the loader goes on working
