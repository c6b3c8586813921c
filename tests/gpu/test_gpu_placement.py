"""GPU-only paths of the placement: side-stream copies, pinned staging, record_stream, real device OOM handling.

Skipped without CUDA. Run on a GPU machine with:
    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from _helpers import chunked_loader, device_loader

from lightning_fastdata.loaders import ShardedOrder
from lightning_fastdata.placement import ChunkBuffers, ChunkedSource, inject_faults, place
from lightning_fastdata.plan import Resources, decide
from lightning_fastdata.store import Store

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
ROW = 3 * 16 * 16 + 8


@pytest.fixture
def cuda():
    device = torch.device("cuda", torch.cuda.current_device())
    yield device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def make_store(n: int) -> Store:
    rng = np.random.default_rng(n)
    return Store.from_arrays((rng.integers(0, 256, (n, 3, 16, 16), dtype=np.uint8), np.arange(n, dtype=np.int64)))


def reference(store: Store, order: ShardedOrder, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(b) for b in device_loader(store, order, device)]


def test_chunked_on_cuda_matches_the_device_loader_with_pinned_staging(cuda):
    store = make_store(1000)
    for epoch in range(2):
        ref_order, order = ShardedOrder(1000, 32, seed=4), ShardedOrder(1000, 32, seed=4)
        ref_order.set_epoch(epoch)
        order.set_epoch(epoch)
        loader = chunked_loader(store, order, device=cuda, chunk_bytes=3 * 32 * ROW)
        buffers = loader.source.buffers
        assert buffers.pinned and buffers.slots[0][0].device == cuda
        assert loader.source._stream != torch.cuda.current_stream(cuda)  # copies run on a side stream
        got = [tuple(b) for b in loader]
        want = reference(store, ref_order, cuda)
        assert len(got) == len(want) == 32
        for g, w in zip(got, want, strict=True):
            assert g[0].device == cuda and all(torch.equal(a, b) for a, b in zip(g, w, strict=True))
        loader.close()


def test_a_slow_consumer_never_sees_a_slot_overwritten(cuda):
    # The consumer's stream is kept busy, so its reads of a chunk run long after they are
    # enqueued; the side stream must wait for them (event) before refilling the slot.
    store = make_store(600)
    loader = chunked_loader(store, ShardedOrder(600, 20, seed=1), device=cuda, chunk_bytes=2 * 20 * ROW)
    got = []
    for batch in loader:
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time before the next batch's reads
        got.append(tuple(batch))  # kept as handed out: a batch never changes afterwards
    want = reference(store, ShardedOrder(600, 20, seed=1), cuda)
    assert all(torch.equal(a, b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))


def test_resume_mid_chunk_on_cuda(cuda):
    store = make_store(500)

    def fresh():
        return chunked_loader(store, ShardedOrder(500, 16, seed=2), device=cuda, chunk_bytes=4 * 16 * ROW)

    full = [tuple(b) for b in fresh()]
    first = fresh()
    head = [tuple(b) for b in itertools.islice(first, 6)]
    resumed = fresh()
    resumed.load_state_dict(first.state_dict())
    tail = [tuple(b) for b in resumed]
    assert len(head) + len(tail) == len(full)
    assert all(torch.equal(a, b) for g, w in zip(head + tail, full, strict=True) for a, b in zip(g, w, strict=True))


def test_pinning_failure_falls_back_to_pageable_and_stays_correct(cuda):
    store = make_store(300)
    with inject_faults(pin_fails=True), pytest.warns(RuntimeWarning, match="could not pin"):
        loader = chunked_loader(store, ShardedOrder(300, 10, seed=3), device=cuda, chunk_bytes=3 * 10 * ROW)
    assert loader.source.buffers.staging is not None and not loader.source.buffers.pinned
    got = [tuple(b) for b in loader]
    want = reference(store, ShardedOrder(300, 10, seed=3), cuda)
    assert all(torch.equal(a, b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))


def test_dropping_a_loader_mid_epoch_is_safe(cuda):
    # Buffers written on the side stream are record_stream'ed: freeing them mid-copy must
    # not hand their memory to a new tensor before the copy finished.
    store = make_store(2000)
    for _ in range(3):
        loader = chunked_loader(store, ShardedOrder(2000, 50, seed=5), device=cuda, chunk_bytes=4 * 50 * ROW)
        it = iter(loader)
        next(it)
        it.close()
        loader.close()
        del loader, it
        filler = torch.full((2, 4 * 50, 3, 16, 16), 7, dtype=torch.uint8, device=cuda)
        torch.cuda.synchronize(cuda)
        assert bool((filler == 7).all())
        del filler


def test_oom_fallback_on_cuda_frees_the_partial_preload(cuda):
    stores = {"train": make_store(4000), "val": make_store(1000)}
    nbytes = sum(s.nbytes for s in stores.values())
    free, total = torch.cuda.mem_get_info(cuda)
    res = Resources(8, 16, 10**11, 10**11, "cuda", total, free, 10**9, 1)
    config = {"strategy": "auto", "batch_nbytes": 32 * ROW}
    plan = decide(nbytes, res, config)
    assert plan.strategy == "device"
    torch.cuda.synchronize(cuda)
    before = torch.cuda.memory_allocated(cuda)
    with inject_faults(oom_at=3), pytest.warns(RuntimeWarning, match=r"out of device memory placing device"):
        placement = place(stores, plan, cuda, config, {"train": 32, "val": 32})
    assert placement.plan.strategy == "chunked"
    held = torch.cuda.memory_allocated(cuda) - before
    sources = placement.sources.values()
    assert all(isinstance(s, ChunkedSource) for s in sources)
    buffers = sum(s.buffers.nbytes for s in sources)
    # No partial preload left behind: only the chunk buffers (8 tensors, blocks rounded to 512 B).
    assert buffers <= held <= buffers + 8 * 512
    assert all(s.buffers.pinned for s in sources)


def test_chunk_buffers_report_device_bytes(cuda):
    buffers = ChunkBuffers([((3, 16, 16), torch.uint8), ((), torch.int64)], 64, 32, cuda)
    assert buffers.nbytes == 2 * 64 * ROW and buffers.pinned
    assert all(t.device == cuda for slot in buffers.slots for t in slot)


def _fit(tmp_path, strategy: str):
    import lightning as L
    from _helpers import TinyDataModule, TinyModel

    class Loaders(L.Callback):
        """The training loader that the Trainer iterates (the chunk buffers are freed at teardown)."""

        def on_train_start(self, trainer, pl_module):
            self.train = trainer.train_dataloader

    dm = TinyDataModule(n=200, batch_size=16, strategy=strategy, cache_dir=str(tmp_path / "cache"))
    model, seen = TinyModel(record=True), Loaders()
    L.Trainer(accelerator="gpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
              callbacks=[seen]).fit(model, dm)
    return dm, model, seen.train


def test_fit_on_gpu_chunked_equals_device(tmp_path, cuda):
    dm_dev, dev, _ = _fit(tmp_path, "device")
    dm_chk, chk, loader = _fit(tmp_path, "chunked")
    assert dm_dev.plan.strategy == "device" and dm_chk.plan.strategy == "chunked"
    assert isinstance(loader.source, ChunkedSource) and loader.source.buffers.pinned
    assert len(dev.seen) == len(chk.seen) == 2 * 13
    for (x, y), (rx, ry) in zip(chk.seen, dev.seen, strict=True):
        assert x.is_cuda and torch.equal(x, rx) and torch.equal(y, ry)
