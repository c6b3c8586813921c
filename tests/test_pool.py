"""The CPU pool: work split in order into runs of about equal weight, its threads running torch
single-threaded while the caller's intra-op threads stay as they were, and the per-sample ops
giving the same pixels on any number of threads."""

from __future__ import annotations

import threading

import torch
from _augment_util import keys, ragged
from _helpers import child_result

from lightning_fastdata import augment as A
from lightning_fastdata._pool import map_runs, pool, runs


def test_runs_are_contiguous_in_order_and_balanced():
    assert runs([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert runs([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 11)]
    assert runs([0, 0, 0], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert [i for r in runs([3, 5, 2, 7, 1], 3) for i in r] == [0, 1, 2, 3, 4]


def test_map_runs_keeps_the_order_and_uses_the_pool_threads():
    seen = set()

    def fn(rows):
        seen.add(threading.current_thread().name)
        return [i * i for i in rows]

    assert map_runs(fn, [1] * 9, 3) == [i * i for i in range(9)]
    assert any(name.startswith("fastdata-cpu3") for name in seen)
    assert map_runs(fn, [1, 1], 1) == [0, 1]  # one thread: the caller's


def test_shorter_lists_use_the_one_pool_of_the_threads_asked_for():
    """A list shorter than the threads asked for (a last partial batch, small eval batches)
    made a pool of its own length: decoding lists of 2 .. 16 images on 16 threads left 15
    idle pools (136 threads). The list is cut into fewer runs on the one pool."""
    def pools():
        return {t.name.split("_")[0] for t in threading.enumerate() if t.name.startswith("fastdata-cpu")}

    before = pools()
    for n in range(2, 8):
        assert map_runs(lambda rows: list(rows), [1] * n, 7) == list(range(n))
    assert pools() - before <= {"fastdata-cpu7"}
    assert "fastdata-cpu7" in pools()


def test_pool_threads_run_torch_single_threaded_and_the_caller_keeps_its_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ex = pool(2)
        assert ex.submit(torch.get_num_threads).result() == 1
        assert torch.get_num_threads() == 2
        # a thread started after the pool gets the caller's default, not the pool's 1
        got = []
        t = threading.Thread(target=lambda: got.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert got == [2]
    finally:
        torch.set_num_threads(before)


def test_list_ops_give_the_same_pixels_on_one_or_two_threads():
    xs = ragged()
    ops = [A.RandomResizedCrop(16), A.Resize(20), A.Compose([A.RandomResizedCrop(18), A.RandomHorizontalFlip()])]
    before = torch.get_num_threads()
    try:
        for op in ops:
            torch.set_num_threads(1)
            one = op(xs, keys(len(xs), seed=3))
            torch.set_num_threads(2)
            two = op(xs, keys(len(xs), seed=3))
            if isinstance(one, list):
                assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
            else:
                assert torch.equal(one, two)
    finally:
        torch.set_num_threads(before)


def _names_of_threads(part: range) -> list[str]:
    return [threading.current_thread().name for _ in part]


def _use_the_pool_in_a_child(out) -> None:
    out.put(map_runs(_names_of_threads, [1, 1], threads=2))


def test_a_forked_child_gets_pools_of_its_own():
    """The parent's pool threads do not exist in a forked child (Lightning's ddp_fork, a
    notebook): the child's first use makes its own pool instead of waiting forever."""
    map_runs(_names_of_threads, [1, 1], threads=2)  # the parent's pool exists now
    names, exitcode = child_result("fork", _use_the_pool_in_a_child, timeout=30)
    assert exitcode == 0 and len(names) == 2 and all(n.startswith("fastdata-cpu2") for n in names)
