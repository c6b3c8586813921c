"""Loaders: order and sharding, device gather, worker reads, resume."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from _helpers import device_loader, names_of
from torch.utils.data import DistributedSampler

from lightning_fastdata.loaders import FastBatch, ShardedOrder, WorkerLoader
from lightning_fastdata.placement import HostSource
from lightning_fastdata.store import Store


def _store(n: int = 50) -> Store:
    x = np.arange(n * 2 * 3, dtype=np.uint8).reshape(n, 2, 3)
    return Store.from_arrays({"x": x, "i": np.arange(n, dtype=np.int64)})


@pytest.mark.parametrize("n,world,drop_last", [(50, 2, False), (51, 2, False), (51, 2, True), (7, 3, False)])
def test_order_matches_distributed_sampler(n, world, drop_last):
    for epoch in (0, 1):
        for rank in range(world):
            o = ShardedOrder(n, 4, shuffle=True, drop_last=drop_last, seed=5, rank=rank, world_size=world)
            o.set_epoch(epoch)
            ref = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=5,
                                     drop_last=drop_last)
            ref.set_epoch(epoch)
            mine = o.indices().tolist()
            expected = list(ref)
            if drop_last:
                expected = expected[: len(o) * 4]
            assert mine == expected


def test_two_ranks_disjoint_equal_cover_and_epoch_changes():
    n = 40
    shards = {}
    for epoch in (0, 1):
        for rank in (0, 1):
            o = ShardedOrder(n, 8, seed=3, rank=rank, world_size=2)
            o.set_epoch(epoch)
            shards[epoch, rank] = o.indices().tolist()
        a, b = shards[epoch, 0], shards[epoch, 1]
        assert len(a) == len(b) == 20
        assert not set(a) & set(b) and sorted(a + b) == list(range(n))
    assert shards[0, 0] != shards[1, 0]
    # every rank draws the same permutation: rank 0 takes its even positions
    o = ShardedOrder(n, 8, seed=3, rank=0, world_size=1)
    assert o.indices().tolist()[0::2] == shards[0, 0]


def test_device_loader_every_sample_once_structure_preserved():
    s = _store(50)
    loader = device_loader(s, ShardedOrder(50, 8, seed=1))
    seen = []
    for batch in loader:
        assert isinstance(batch, FastBatch) and set(batch.structure()) == {"x", "i"}
        assert torch.equal(batch.indices, batch["i"])  # the batch knows which samples it holds
        assert torch.equal(batch["x"], torch.from_numpy(s.fields[0][batch["i"].numpy()]))
        seen += batch["i"].tolist()
    assert sorted(seen) == list(range(50)) and len(loader) == 7


def test_kept_batches_are_never_overwritten():
    s = _store(64)
    loader = device_loader(s, ShardedOrder(64, 8, seed=4))
    kept = list(loader)  # references only, no copies
    for batch in kept:
        assert torch.equal(batch["x"], torch.from_numpy(s.fields[0][batch["i"].numpy()]))
    assert len({b["x"].data_ptr() for b in kept}) == len(kept)


@pytest.mark.parametrize("workers", [0, 2])
def test_worker_loader_matches_device_loader(workers):
    s = _store(50)
    order_args = dict(n=50, batch_size=8, seed=9, rank=1, world_size=2)
    dev = device_loader(s, ShardedOrder(**order_args))
    wrk = WorkerLoader(ShardedOrder(**order_args), source=HostSource(list(s.fields)), spec=s.spec,
                       names=names_of(s), num_workers=workers)
    for epoch in (0, 1):
        dev.set_epoch(epoch)
        wrk.sampler.set_epoch(epoch)  # the way Lightning reaches it
        a = [b["i"] for b in dev]
        b = list(wrk)
        assert len(a) == len(b) == len(wrk)
        assert all(torch.equal(x, y["i"]) and torch.equal(x, y.indices) for x, y in zip(a, b, strict=True))


def test_worker_loader_over_raw_source_collates():
    ds = [(torch.full((2,), i), i) for i in range(10)]
    wrk = WorkerLoader(ShardedOrder(10, 4, shuffle=False), dataset=ds)
    batches = list(wrk)
    assert [b[1].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [b.indices.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [(b.epoch, b.index) for b in batches] == [(0, 0), (0, 1), (0, 2)]


def test_resume_mid_epoch_yields_the_rest():
    s = _store(50)

    def loader():
        return device_loader(s, ShardedOrder(50, 8, seed=2))

    full = loader()
    full.set_epoch(1)
    ref = [b["i"] for b in full]
    part = loader()
    part.set_epoch(1)
    it = iter(part)
    for _ in range(3):
        part.consumed(next(it))
    next(it)  # prefetched, not consumed: must not count
    state = part.state_dict()
    assert state["batch"] == 3 and state["epoch"] == 1
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [b["i"] for b in resumed]
    assert len(rest) == len(ref) - 3
    assert all(torch.equal(x, y) for x, y in zip(rest, ref[3:], strict=True))
    # the next epoch starts from its beginning again
    resumed.set_epoch(2)
    assert len(list(resumed)) == len(ref)


def test_a_checkpoint_before_the_first_resumed_batch_keeps_the_checkpoints_position():
    # A resumed run saved again before it used a batch (an exception, a second preemption)
    # must not send the next resume back to the start of the epoch.
    s = _store(50)

    def loader():
        return device_loader(s, ShardedOrder(50, 8, seed=2))

    first = loader()
    first.set_epoch(1)
    it = iter(first)
    for _ in range(3):
        first.consumed(next(it))
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    again = resumed.state_dict()
    assert (again["epoch"], again["batch"]) == (1, 3)
    last = loader()
    last.load_state_dict(again)
    assert [b.index for b in last] == [3, 4, 5, 6]


def test_a_new_epoch_starts_at_batch_zero_before_its_first_batch():
    s = _store(40)
    ld = device_loader(s, ShardedOrder(40, 8, seed=1))
    for b in ld:
        ld.consumed(b)
    assert ld.state_dict()["batch"] == 5
    ld.sampler.set_epoch(1)  # as Lightning selects the next epoch: on the loader's sampler
    state = ld.state_dict()
    assert (state["epoch"], state["batch"]) == (1, 0)  # not (1, 5): that would skip epoch 1
    stale = next(iter(device_loader(s, ShardedOrder(40, 8, seed=1))))  # a batch of epoch 0
    ld.consumed(stale)
    assert ld.state_dict()["batch"] == 0


def test_batches_whose_step_did_not_run_are_not_counted():
    # The trainer's count of steps in flight comes off the transfers counted: a checkpoint
    # saved while a step runs (an exception in it) makes the resume replay that batch.
    s = _store(48)
    ld = device_loader(s, ShardedOrder(48, 8, seed=3))
    it = iter(ld)
    for _ in range(4):
        ld.consumed(next(it))
    assert ld.state_dict()["batch"] == 4
    ld.steps_in_flight = lambda: (0, 1)
    assert ld.state_dict()["batch"] == 3
    ld.steps_in_flight = lambda: (0, 0)  # saved at a step's end
    assert ld.state_dict()["batch"] == 4
    ld.steps_in_flight = lambda: (1, 1)  # another epoch's count says nothing of this one
    assert ld.state_dict()["batch"] == 4
    ld.steps_in_flight = lambda: None  # outside a fit
    assert ld.state_dict()["batch"] == 4


def test_resume_refuses_a_different_configuration():
    s = _store(50)
    a = device_loader(s, ShardedOrder(50, 8))
    b = device_loader(s, ShardedOrder(50, 10))
    with pytest.raises(ValueError, match="batch_size=8"):
        b.load_state_dict(a.state_dict())


def test_a_checkpoint_at_an_epochs_end_resumes_with_another_batch_size():
    # Nothing is left to replay: the identity a mid-epoch position needs does not apply.
    s = _store(40)
    a = device_loader(s, ShardedOrder(40, 8))
    for b in a:
        a.consumed(b)
    state = a.state_dict()
    assert (state["batch"], state["batches"]) == (5, 5)
    b = device_loader(s, ShardedOrder(40, 10))
    b.load_state_dict(state)
    b.set_epoch(1)
    assert len(list(b)) == 4
    old = {k: v for k, v in state.items() if k != "batches"}  # a checkpoint from before "batches" was saved
    with pytest.raises(ValueError, match="batch_size=8"):
        device_loader(s, ShardedOrder(40, 10)).load_state_dict(old)


def test_resuming_into_another_epoch_warns_about_the_batches_never_seen():
    s = _store(40)

    def stopped_at(epoch, batch):
        ld = device_loader(s, ShardedOrder(40, 8, seed=1))
        ld.set_epoch(epoch)
        it = iter(ld)
        for _ in range(batch):
            ld.consumed(next(it))
        resumed = device_loader(s, ShardedOrder(40, 8, seed=1))
        resumed.load_state_dict(ld.state_dict())
        return resumed

    ld = stopped_at(0, 3)
    ld.set_epoch(1)  # as Lightning does from a max_steps stop
    with pytest.warns(UserWarning, match=r"stopped at batch 3 of 5 of epoch 0, but the Trainer goes on with epoch 1, "
                                         r"so batches 3 to 4 of epoch 0 and batches 2 to 4 of epoch 1 \(Lightning "
                                         r"numbers its batches from 3 and ends it after 2\) are never seen"):
        assert len(list(ld)) == 5
    ld = stopped_at(0, 5)
    ld.set_epoch(2)
    with pytest.warns(UserWarning, match=r"so epoch 1 are never seen"):
        list(ld)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ld = stopped_at(0, 5)  # an epoch's end: the next epoch follows
        ld.set_epoch(1)
        list(ld)
        ld = stopped_at(0, 3)  # an epoch limited to 3 batches (limit_train_batches)
        ld.epoch_batches = lambda: 3
        ld.set_epoch(1)
        list(ld)
        ld = stopped_at(1, 2)  # a mid-epoch resume
        assert len(list(ld)) == 3


def test_a_seed_near_two_to_the_64_still_orders_every_epoch():
    # seed + epoch overflowed torch's seed: the fit died at epoch 1 ("Overflow when unpacking long long").
    top = ShardedOrder(10, 2, seed=2**64 - 1)
    assert torch.equal(top.indices(epoch=3), ShardedOrder(10, 2, seed=0).indices(epoch=2))


@pytest.mark.parametrize("shuffle", [False, True])
def test_unpadded_shards_give_every_sample_to_exactly_one_rank(shuffle):
    from lightning_fastdata.loaders import BlockOrder

    for n in range(1, 14):
        for world in range(1, 5):
            for cls, extra in ((ShardedOrder, {}), (BlockOrder, {"rows": 2})):
                shards = [cls(n, 3, shuffle=shuffle, rank=r, world_size=world, pad=False, **extra)
                          for r in range(world)]
                seen = [i for o in shards for b in o.batches() for i in b.tolist()]
                assert sorted(seen) == list(range(n)), (n, world)
                assert [len(o.indices()) for o in shards] == [n // world + (r < n % world) for r in range(world)]
    with pytest.raises(ValueError, match="pad=False keeps every sample once; it needs drop_last=False"):
        ShardedOrder(10, 2, drop_last=True, pad=False)


def test_order_validation():
    with pytest.raises(ValueError, match="batch_size"):
        ShardedOrder(10, 0)
    with pytest.raises(ValueError, match="rank=2"):
        ShardedOrder(10, 2, rank=2, world_size=2)


class _Tag:
    """A picklable prepare: marks every sample with its epoch and global index (in the worker)."""

    def __call__(self, batch: FastBatch) -> FastBatch:
        x, i = batch.leaves
        leaves = [x.to(torch.int64) * 0 + batch.epoch * 1000 + batch.indices.view(-1, 1, 1), i]
        return FastBatch(leaves, batch.spec, batch.names, batch.indices, batch.epoch, batch.index, prepared=True)


@pytest.mark.parametrize("workers,context", [(0, None), (2, "fork"), (1, "spawn")])
def test_worker_loader_prepares_batches_in_the_workers_keyed_by_their_samples(workers, context):
    s = _store(40)
    wrk = WorkerLoader(ShardedOrder(40, 8, seed=2), source=HostSource(list(s.fields)), spec=s.spec,
                       names=names_of(s), prepare=_Tag(), num_workers=workers, multiprocessing_context=context)
    for epoch in (0, 1):
        wrk.set_epoch(epoch)
        for k, batch in enumerate(wrk):
            assert batch.prepared and (batch.epoch, batch.index) == (epoch, k)
            assert torch.equal(batch["x"][:, 0, 0], epoch * 1000 + batch["i"])
    with pytest.raises(ValueError, match="prepare= needs source="):
        WorkerLoader(ShardedOrder(4, 2), dataset=[0, 1, 2, 3], prepare=_Tag())


def _double(batch: FastBatch) -> FastBatch:
    x, i = batch.leaves
    return FastBatch([x.to(torch.int16) * 2, i], batch.spec, batch.names, batch.indices, batch.epoch, batch.index,
                     prepared=True)


@pytest.mark.parametrize("ahead", [1, 2])
def test_batches_prepared_ahead_in_a_thread_equal_those_prepared_inline(ahead):
    import threading

    s = _store(50)
    inline = device_loader(s, ShardedOrder(50, 8, seed=3))
    inline.prepare = _double
    want = [b.structure() for b in inline]
    threaded = device_loader(s, ShardedOrder(50, 8, seed=3))
    threaded.prepare, threaded.ahead = _double, ahead
    got = list(threaded)
    assert [b.prepared for b in got] == [True] * len(want)
    assert all(torch.equal(g["x"], w["x"]) and torch.equal(g["i"], w["i"]) for g, w in zip(got, want, strict=True))
    # Stopping early stops the thread; a failure in it reaches the consumer.
    it = iter(threaded)
    first = next(it)
    threaded.consumed(first)
    it.close()
    assert threaded.state_dict()["batch"] == 1
    assert not any(t.name == "lightning_fastdata-ahead" for t in threading.enumerate())

    def boom(batch):
        raise RuntimeError("prepare failed on purpose")

    threaded.prepare = boom
    with pytest.raises(RuntimeError, match="prepare failed on purpose"):
        list(threaded)


def test_every_tensor_of_a_batch_made_ahead_is_found_for_the_consumers_stream():
    # On CUDA a batch made ahead on a side stream records the consumer's stream on each of its
    # tensors, so the allocator keeps their memory until the step is done with it. A ragged
    # field left a list by the augmentation (views of its values, or decoded JPEGs) was
    # skipped: the next batch could reuse its memory while the step still read it.
    # (tests/gpu/test_ragged_cuda.py checks the recording itself on a GPU.)
    from lightning_fastdata.loaders import _leaf_tensors
    from lightning_fastdata.ragged import RaggedBatch

    values = torch.arange(6)
    ragged = RaggedBatch(values, torch.tensor([0, 2, 6]), torch.tensor([[2], [4]]))
    parts = ragged.tensors()
    plain = torch.zeros(2)
    got = list(_leaf_tensors([plain, ragged, parts, (parts[0],), {"a": parts[1]}, 3, None]))
    want = [plain, values, parts[0], parts[1], parts[0], parts[1]]
    assert len(got) == len(want) and all(g is w for g, w in zip(got, want, strict=True))


def test_deferred_fields_reach_prepare_as_store_rows_and_never_leave_the_loader():
    from lightning_fastdata.augment_base import StoreRows
    from lightning_fastdata.loaders import IndexLoader
    from lightning_fastdata.placement import DeviceSource

    store = Store.from_arrays({"x": np.arange(10 * 6, dtype=np.float32).reshape(10, 1, 2, 3),
                               "y": np.arange(10, dtype=np.int64)})
    source = DeviceSource.from_arrays(list(store.fields), "cpu")
    seen = []

    def prepare(batch):  # hands the rows back untouched: the loader gathers them
        seen.append([type(v).__name__ for v in batch.leaves])
        return batch

    order = ShardedOrder(10, 4, shuffle=True, seed=1)
    loader = IndexLoader(source, order, store.spec, names_of(store), prepare=prepare, defer=frozenset({0}))
    plain = device_loader(store, ShardedOrder(10, 4, shuffle=True, seed=1))
    for got, want in zip(loader, plain, strict=True):
        assert all(isinstance(v, torch.Tensor) for v in got.leaves)
        assert torch.equal(got.leaves[0], want.leaves[0]) and torch.equal(got.leaves[1], want.leaves[1])
    assert seen == [["StoreRows", "Tensor"]] * 3
    assert isinstance(source.gather(torch.tensor([1]), defer=frozenset({0}))[0], StoreRows)
    with pytest.raises(ValueError, match="defer needs a prepare"):
        IndexLoader(source, order, store.spec, names_of(store), defer=frozenset({0}))
    with pytest.raises(ValueError, match=r"defer names fields \[2\] that this device source cannot hand out"):
        IndexLoader(source, order, store.spec, names_of(store), prepare=prepare, defer=frozenset({2}))


class _FailingInValidation(L.LightningModule):
    """Fails in its second validation step, while the validation loader is mid-iteration."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3 * 8 * 8, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x.float().flatten(1)), y)

    def validation_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("boom in validation_step")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("strategy,extra", [("device", {"augment_ahead": 2}),
                                            ("workers", {"num_workers": 1, "persistent_workers": False})])
def test_a_fit_failing_in_validation_leaves_no_thread_or_worker(tmp_path, cache_dir, strategy, extra):
    """A fit that failed in ``validation_step`` kept the validation loader's iteration that
    Lightning's fetcher still held: its ``ahead`` thread (with its ready batches) or, for a
    non-persistent loader, its worker processes outlived the fit (found by a review helper)."""
    import threading
    import time

    import psutil
    from _helpers import TinyDataModule, trainer

    from lightning_fastdata import augment as A

    def children() -> set[int]:
        return {c.pid for c in psutil.Process().children(recursive=True)
                if c.is_running() and c.status() != psutil.STATUS_ZOMBIE}

    before = children()  # e.g. multiprocessing's resource tracker, started by an earlier test
    dm = TinyDataModule(n=32, batch_size=4, cache_dir=str(cache_dir), device="cpu", strategy=strategy,
                        eval_augment=A.RandomHorizontalFlip(), **extra)
    with pytest.raises(RuntimeError, match="boom in validation_step"):
        trainer(tmp_path, num_sanity_val_steps=0, limit_train_batches=2).fit(_FailingInValidation(), dm)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        threads = [t.name for t in threading.enumerate() if t.name.startswith("lightning_fastdata-ahead")]
        workers = sorted(children() - before)
        if not threads and not workers:
            break
        time.sleep(0.1)
    assert threads == [] and workers == []
