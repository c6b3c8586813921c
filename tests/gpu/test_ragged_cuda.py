"""Ragged fields on CUDA: the device gather never makes the host wait; chunked and device agree.

Skipped without CUDA. Run on a GPU machine with:
    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_ragged_cuda.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _helpers import chunked_loader, device_loader

from lightning_fastdata.loaders import ShardedOrder
from lightning_fastdata.ragged import RaggedArray, RaggedBatch
from lightning_fastdata.store import Store

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _store(n: int = 300) -> Store:
    g = np.random.default_rng(0)
    images = RaggedArray.from_list([g.integers(0, 256, (3, 8 + i % 23, 5 + i % 17), dtype=np.uint8) for i in range(n)])
    vec = RaggedArray.from_list([g.normal(size=(i % 9,)).astype(np.float32) for i in range(n)])
    return Store.from_arrays({"image": images, "vec": vec, "label": np.arange(n, dtype=np.int64)})


def test_the_device_gather_of_ragged_fields_never_syncs_and_is_bit_equal():
    device = torch.device("cuda", torch.cuda.current_device())
    store = _store()
    loader = device_loader(store, ShardedOrder(300, 32, seed=1), device)
    it = iter(loader)
    next(it)  # warm-up: the order's copy and the allocator's first blocks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batches = list(it)
        views = [(b, b.leaves[0].tensors(), b.leaves[1].tensors()) for b in batches]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for batch, images, vecs in views:
        assert isinstance(batch.leaves[0], RaggedBatch) and batch.leaves[0].values.device == device
        for img, vec, i in zip(images, vecs, batch.indices.tolist(), strict=True):
            assert np.array_equal(img.cpu().numpy(), store.fields[0][i])
            assert np.array_equal(vec.cpu().numpy(), store.fields[1][i])


def test_chunked_on_cuda_serves_ragged_fields_like_the_device_source():
    device = torch.device("cuda", torch.cuda.current_device())
    store = _store()
    want = list(device_loader(store, ShardedOrder(300, 32, seed=2), device))
    loader = chunked_loader(store, ShardedOrder(300, 32, seed=2), chunk_bytes=3 * 32 * 16, device=device)
    got = list(loader)
    loader.close()
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.indices, w.indices) and torch.equal(g.leaves[2], w.leaves[2])
        for k in (0, 1):
            assert g.leaves[k].values.device == device
            assert torch.equal(g.leaves[k].values, w.leaves[k].values)
            assert torch.equal(g.leaves[k].offsets, w.leaves[k].offsets)


def test_jpeg_bytes_stay_on_the_host_and_decode_onto_the_gpu(tmp_path):
    """nvJPEG reads host memory: the device strategy keeps the bytes there and decodes onto the GPU."""
    from lightning_fastdata import OptimizedDataModule
    from lightning_fastdata.decode import decode_jpegs
    from lightning_fastdata.store import build_store

    class Photos(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return torch.randint(0, 256, (3, 40 + i, 60 - i // 2), dtype=torch.uint8, generator=g), i

    device = torch.device("cuda", torch.cuda.current_device())
    store = build_store(Photos(), lambda s: s, tmp_path / "cache", encode={"0": "jpeg"}, progress=False)
    loader = device_loader(store, ShardedOrder(40, 8, seed=3), device)
    for batch in loader:
        moved = batch.to(device)
        jpeg = moved.leaves[0]
        assert isinstance(jpeg, RaggedBatch) and jpeg.values.device.type == "cpu"
        images = OptimizedDataModule.unragged(moved)[0]
        assert all(img.device == device for img in images)
        ref = decode_jpegs(jpeg.tensors(), torch.device("cpu"))
        # nvJPEG's IDCT may round differently from libjpeg-turbo's by a few levels.
        assert all((a.cpu().int() - b.int()).abs().max() <= 8 for a, b in zip(images, ref, strict=True))


def test_list_fields_of_batches_prepared_ahead_are_recorded_on_the_consumers_stream(monkeypatch):
    """A ragged field a prepare leaves a list (no size-fixing op) is made on the ahead thread's
    side stream: each of its tensors must record the consumer's stream, as the others do, or
    the allocator may hand its memory to the next batch while the step still reads it."""
    device = torch.device("cuda", torch.cuda.current_device())
    store = _store(64)
    recorded: set[int] = set()
    real = torch.Tensor.record_stream

    def record(self, stream):
        recorded.add(self.data_ptr())
        return real(self, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", record)

    def as_lists(batch):
        from lightning_fastdata.loaders import FastBatch

        leaves = [leaf.tensors() if isinstance(leaf, RaggedBatch) else leaf for leaf in batch.leaves]
        return FastBatch(leaves, batch.spec, batch.names, batch.indices, batch.epoch, batch.index, prepared=True)

    loader = device_loader(store, ShardedOrder(64, 16, seed=4), device)
    loader.prepare, loader.ahead = as_lists, 2
    for batch in loader:
        for images in batch.leaves[:2]:
            assert isinstance(images, list)
            assert all(t.data_ptr() in recorded for t in images if t.numel())
