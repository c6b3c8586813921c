"""Node-local shared memory in one process: placement, verification, workers, space, cleanup.

Multi-process behaviour (DDP ranks, signals) is in ``test_ddp_shared.py``.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import mmap
import os
import pickle
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import TinyDataModule, child_result
from _shared_job import is_segment, shm_mappings

from lightning_fastdata import shared
from lightning_fastdata.loaders import ShardedOrder, WorkerLoader
from lightning_fastdata.placement import HostSource
from lightning_fastdata.shared import SharedArray, SharedMemoryError, share_stores
from lightning_fastdata.store import Store, build_store

HERE = Path(__file__).parent


def _shm_names() -> set[str]:
    return {n for n in os.listdir(shared.SHM_DIR) if n.startswith(shared.prefix())}


def _store(n: int = 64) -> Store:
    g = np.random.default_rng(0)
    images = g.integers(0, 256, (n, 3, 8, 8), dtype=np.uint8)
    return Store.from_arrays({"image": images, "label": np.arange(n, dtype=np.int64)}, fingerprint="f" * 64)


def _mapped_segments(pid: int | str = "self") -> set[str]:
    """Paths of this package's segments mapped into ``pid`` (unlinked ones end in ' (deleted)')."""
    out = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and is_segment(parts[5]):
                out.add(parts[5].strip())
    return out


def test_share_copies_bit_equal_unlinks_names_and_leaves_the_store_alone():
    store = _store()
    before = [a.copy() for a in store.fields]
    original = list(store.fields)
    segs = share_stores({"train": store})
    seg = segs["train"]
    assert seg.name.startswith(shared.prefix()) and str(os.getpid()) in seg.name
    assert _shm_names() == set()  # unlinked at once: the only local rank has attached
    assert all(p.endswith("(deleted)") for p in _mapped_segments())
    assert os.fstat(seg.fd).st_ino in {inode for inode, _ in shm_mappings()}
    arrays = seg.arrays()
    assert all(isinstance(a, SharedArray) and not a.flags.writeable and _backed_by_mmap(a) for a in arrays)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, before, strict=True))
    with pytest.raises(ValueError, match="read-only"):
        arrays[0][0, 0, 0, 0] = 1
    assert all(a is b for a, b in zip(store.fields, original, strict=True))  # the store is not modified
    seg.release()
    assert seg.closed


def test_memmapped_store_is_copied_by_file_reads(cache_dir):
    from _helpers import CountingDataset

    store = build_store(CountingDataset(50), lambda s: s, cache_dir, progress=False)
    expect = [np.array(a) for a in store.fields]
    seg = share_stores({"train": store})["train"]
    assert all(np.array_equal(a, b) for a, b in zip(seg.arrays(), expect, strict=True))


def test_segment_created_owner_only_exclusive_and_never_through_a_symlink(tmp_path):
    store = _store(4)
    layout = shared._layout(store)
    size = shared._segment_size(layout)
    name = f"{shared.prefix()}{os.getpid()}_symlinktest_train"
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    os.symlink(target, shared.SHM_DIR / name)
    try:
        with pytest.raises(FileExistsError):
            shared._create(name, size, "t" * 16, "f" * 64, layout, store)
        assert target.read_bytes() == b"keep"
        with pytest.raises(SharedMemoryError, match="cannot open"):
            shared._attach(name, size, "t" * 16, "f" * 64, layout)
    finally:
        os.unlink(shared.SHM_DIR / name)
    seg = shared._create(name, size, "t" * 16, "f" * 64, layout, store)
    try:
        assert os.stat(seg.path).st_mode & 0o777 == 0o600
    finally:
        seg.unlink()
        seg.release()


@pytest.mark.parametrize("tamper,match", [
    ((0, b"XXXXXXXX"), "magic"),
    ((12, b"\0\0\0\0"), "ready flag"),
    ((8, (9).to_bytes(4, "little")), "format version 9"),
])
def test_attach_verifies_header_before_reading(tamper, match):
    store = _store(4)
    layout = shared._layout(store)
    size = shared._segment_size(layout)
    seg = shared._create(f"{shared.prefix()}{os.getpid()}_verify_train", size, "t" * 16, "a" * 64, layout, store)
    try:
        # A second job (other token) or another dataset (other fingerprint) is refused.
        with pytest.raises(SharedMemoryError, match="another job"):
            shared._attach(seg.name, size, "u" * 16, "a" * 64, layout)
        with pytest.raises(SharedMemoryError, match=r"fingerprint aaaaaaaaaaaaaaaa is not this rank's bbbb"):
            shared._attach(seg.name, size, "t" * 16, "b" * 64, layout)
        os.pwrite(seg.fd, tamper[1], tamper[0])
        with pytest.raises(SharedMemoryError, match=match):
            shared._attach(seg.name, size, "t" * 16, "a" * 64, layout)
    finally:
        seg.unlink()
        seg.release()


def _check_worker_maps_segment(worker_id: int) -> None:
    """worker_init_fn: the worker reads the segment's pages, it holds no copy of the store."""
    ds = torch.utils.data.get_worker_info().dataset
    mapped = _mapped_segments()
    assert mapped and all(p.endswith("(deleted)") for p in mapped), mapped
    parts = [p for a in ds.arrays for p in (a.parts().values() if hasattr(a, "parts") else [a])]
    assert all(_backed_by_mmap(p) for p in parts)


def _backed_by_mmap(a: np.ndarray) -> bool:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return isinstance(a.base, memoryview) and isinstance(a.base.obj, mmap.mmap)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_read_the_shared_pages(context):
    store = _store(64)
    expect = [a.copy() for a in store.fields]
    seg = share_stores({"train": store})["train"]
    order = ShardedOrder(64, 16, shuffle=True, seed=3)
    loader = WorkerLoader(order, source=HostSource(seg.arrays(), seg), spec=store.spec,
                          names=[i.name for i in store.infos], num_workers=1,
                          worker_init_fn=_check_worker_maps_segment, multiprocessing_context=context)
    seen = []
    for batch in loader:
        idx = batch["label"].numpy()
        assert np.array_equal(batch["image"].numpy(), expect[0][idx])
        seen += idx.tolist()
    assert sorted(seen) == list(range(64))


def test_pickle_outside_a_process_start_is_by_value():
    store = _store(8)
    field = share_stores({"train": store})["train"].arrays()[0]
    blob = pickle.dumps(field)
    back = pickle.loads(blob)
    assert len(blob) > field.nbytes and np.array_equal(back, field)
    assert type(back) is np.ndarray


def test_too_small_raises_with_size_and_fix(monkeypatch):
    monkeypatch.setattr(shared, "shm_free_bytes", lambda: 64 << 20)
    store = Store.from_arrays((np.zeros((100, 1 << 20), np.uint8),), fingerprint="z" * 64)
    with pytest.raises(SharedMemoryError) as e:
        share_stores({"train": store}, headroom=8 << 20)
    msg = str(e.value)
    assert "67.1 MB free" in msg and "needs 113.3 MB" in msg and "--shm-size=" in msg
    assert "shared_memory='auto'" in msg
    assert _shm_names() == set() and type(store.fields[0]) is np.ndarray


def test_too_small_falls_back_with_warning(monkeypatch):
    monkeypatch.setattr(shared, "shm_free_bytes", lambda: 1 << 20)
    store = _store()
    with pytest.warns(UserWarning, match="falling back to the memory-mapped disk cache"):
        assert share_stores({"train": store}, fallback=True) == {}
    assert type(store.fields[0]) is np.ndarray


def _no_space(*args):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where,refused", [
    ("reservation", r".* for .*train.*"),
    # A tmpfs out of inodes (nr_inodes) refuses the segment's file itself while bytes are free:
    # "auto" raised "creating a shared-memory segment failed" instead of falling back, and "on"
    # did not say why (found by a review helper).
    ("file", r" a new file .*train "),
])
def test_enospc_is_the_too_small_case_and_leaves_nothing(monkeypatch, where, refused):
    if where == "reservation":
        monkeypatch.setattr(os, "posix_fallocate", _no_space)
    else:
        monkeypatch.setattr(shared, "_open_locked", _no_space)
    store = _store()
    # The kernel's refusal leads (its free space alone read as a contradiction: "25 GB free ...
    # needs 17 MB"), with the likely limits, then the fixes.
    with pytest.raises(SharedMemoryError, match=f"the kernel refused{refused}" + r"\(No space left on device\), "
                                                r"although /dev/shm reports .* free: a size or inode limit.*"
                                                r"--shm-size=.*shared_memory='auto' to fall back"):
        share_stores({"train": store})
    assert _shm_names() == set()
    with pytest.warns(UserWarning, match="falling back") as caught:
        assert share_stores({"train": store}, fallback=True) == {}
    # The fallback's warning does not suggest the 'auto' it runs under.
    assert "shared_memory='auto'" not in str(caught[0].message)
    assert _shm_names() == set() and type(store.fields[0]) is np.ndarray


def _held_deleted_segments() -> list[str]:
    """Targets of this process's descriptors that point at an unlinked segment of this package."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if is_segment(target) and target.endswith(" (deleted)"):
                out.append(target)
    return out


def _enospc_on_call(monkeypatch, n: int) -> None:
    real, calls = os.posix_fallocate, [0]

    def flaky(fd, offset, length):
        calls[0] += 1
        if calls[0] == n:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", flaky)


def _two_splits() -> dict[str, Store]:
    return {"train": Store.from_arrays((np.ones((256, 4096), np.uint8),), fingerprint="a" * 64),
            "val": Store.from_arrays((np.full((8, 16), 2, np.uint8),), fingerprint="b" * 64)}


def test_fallback_after_a_later_split_fails_releases_the_earlier_segments(monkeypatch):
    """train is created, val's reservation hits ENOSPC: train's unlinked pages must not stay held."""
    _enospc_on_call(monkeypatch, 2)
    before = set(_held_deleted_segments())  # earlier tests' segments may await the collector
    with pytest.warns(UserWarning, match="falling back"):
        assert share_stores(_two_splits(), fallback=True) == {}
    assert _shm_names() == set()
    assert set(_held_deleted_segments()) - before == set()


def test_an_error_after_creation_releases_the_segments(monkeypatch):
    """Whatever is raised between creating the segments and returning them, none stays held."""
    real, calls = shared.D.all_gather_object, [0]

    def broken(obj):
        calls[0] += 1
        if calls[0] == 2:  # the leader's outcome, after every segment was created
            raise RuntimeError("collective failed")
        return real(obj)

    monkeypatch.setattr(shared.D, "all_gather_object", broken)
    before = set(_held_deleted_segments())
    with pytest.raises(RuntimeError, match="collective failed"):
        share_stores(_two_splits(), fallback=True)
    assert _shm_names() == set()
    assert set(_held_deleted_segments()) - before == set()


def _read_two_splits(train: np.ndarray, val: np.ndarray, queue) -> None:
    queue.put([(np.asarray(a).ravel()[:4].tolist(), np.asarray(a).shape) for a in (train, val)])


def test_a_spawned_process_maps_each_split_onto_its_own_segment():
    """All splits of one call share the job token; a spawned process must not mix their segments."""
    segs = share_stores({"train": Store.from_arrays((np.full((64, 16), 1, np.uint8),), fingerprint="t" * 64),
                         "val": Store.from_arrays((np.full((8, 16), 2, np.uint8),), fingerprint="v" * 64)})
    train, val = segs["train"].arrays()[0], segs["val"].arrays()[0]
    try:
        got, exitcode = child_result("spawn", _read_two_splits, (train, val), timeout=120)
    finally:
        for seg in segs.values():
            seg.release()
    assert exitcode == 0
    assert got == [([1, 1, 1, 1], (64, 16)), ([2, 2, 2, 2], (8, 16))]


def _stalled_leaders(mode: str) -> dict[int, subprocess.Popen]:
    """A leader per signal, each stopped at the point of ``_shared_job.py`` ``mode``."""
    return {sig: subprocess.Popen([sys.executable, str(HERE / "_shared_job.py"), mode],
                                  stdout=subprocess.PIPE, text=True)
            for sig in (signal.SIGTERM, signal.SIGKILL)}


def _reap(children: dict[int, subprocess.Popen]) -> None:
    for child in children.values():
        child.kill()
        child.wait(timeout=30)
        child.stdout.close()


def _open_segments(pid: int) -> list[int]:
    """Sizes of the segments ``pid`` holds open, named or not."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if is_segment(os.readlink(f"/proc/{pid}/fd/{fd}")):
                out.append(os.stat(f"/proc/{pid}/fd/{fd}").st_size)
    return out


def test_a_leader_killed_while_copying_the_store_leaves_nothing_in_dev_shm():
    """The segment has no name until it is filled: a SIGKILL (an OOM kill, say) while the leader
    copied left a full-size segment in /dev/shm (RAM) that only the next shared-memory run on
    the node removed (found by a review helper)."""
    children = _stalled_leaders("stall-in-fill")
    try:
        for child in children.values():
            assert child.stdout.readline().strip() == "filling"
            assert _open_segments(child.pid) == [4096 + 16 * 1024]  # reserved, being written...
        assert _shm_names() == set()  # ...and nameless
        for sig, child in children.items():
            child.send_signal(sig)
            assert child.wait(timeout=30) == -sig
    finally:
        _reap(children)
    assert _shm_names() == set()


def test_leader_killed_between_naming_and_unlinking():
    """SIGTERM in the window unlinks and exits with the signal; SIGKILL leaves a name the next start sweeps."""
    children = _stalled_leaders("stall-named")
    try:
        for child in children.values():
            assert child.stdout.readline().strip() == "named"
        assert len(_shm_names()) == 2
        for sig, child in children.items():
            child.send_signal(sig)
            assert child.wait(timeout=30) == -sig
    finally:
        _reap(children)
    (left,) = _shm_names()  # SIGTERM's segment is gone; SIGKILL's stays until the next start
    assert str(children[signal.SIGKILL].pid) in left
    store = _store(4)
    share_stores({"train": store})
    assert _shm_names() == set()


def test_sweep_spares_live_owners_and_other_prefixes():
    live = shared.SHM_DIR / f"{shared.prefix()}{os.getpid()}_live_train"
    other = shared.SHM_DIR / f"{shared.prefix()}x{os.getpid()}_train"
    for p in (live, other):
        os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    try:
        assert shared.sweep_stale() == []
        assert live.exists() and other.exists()
    finally:
        live.unlink()
        other.unlink()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    return child.pid


@pytest.mark.parametrize("creation", ["nameless-then-linked", "by-name"])
def test_sweep_spares_a_locked_segment_even_when_its_pid_is_dead_here(creation, monkeypatch):
    """The pid in a name means nothing in another PID namespace; a held lock says the owner lives."""
    if creation == "by-name":  # a kernel without O_TMPFILE
        monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    dead = _dead_pid()
    store = _store(4)
    layout = shared._layout(store)
    size = shared._segment_size(layout)
    held = f"{shared.prefix()}{dead}_lockedbycreator_train"
    stale = shared.SHM_DIR / f"{shared.prefix()}{dead}_stale_train"
    other = shared.SHM_DIR / f"{shared.prefix()}{dead}_lockedbyother_train"
    seg = shared._create(held, size, "t" * 16, "f" * 64, layout, store)  # the creator holds it
    try:
        for p in (stale, other):
            os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        # Another process holds ``other`` (as a leader in another container would).
        holder = subprocess.Popen(
            [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
             "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); sys.stdin.read()", str(other)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            assert shared.sweep_stale() == [stale.name]
            assert seg.path.exists() and other.exists() and not stale.exists()
        finally:
            holder.stdin.close()
            holder.wait(timeout=30)
            holder.stdout.close()
        assert shared.sweep_stale() == [other.name]  # its holder is gone and its pid is dead
        assert seg.path.exists()
    finally:
        seg.unlink()
        seg.release()
        for p in (stale, other):
            p.unlink(missing_ok=True)


# --------------------------------------------------------------------------- datamodule


def _dm(cache_dir, **kwargs) -> TinyDataModule:
    # Persistent workers killed at shutdown leave multiprocessing's pymp-* temporary behind.
    kwargs.setdefault("persistent_workers", False)
    kwargs.setdefault("strategy", "workers")
    kwargs.setdefault("num_workers", 2)
    dm = TinyDataModule(n=48, cache_dir=str(cache_dir), device="cpu", val=False, **kwargs)
    dm.prepare_data()
    return dm


def test_datamodule_auto_shares_when_workers_read(cache_dir):
    dm = _dm(cache_dir)
    dm.setup("fit")
    assert isinstance(dm.placement.sources["train"].arrays[0], SharedArray)
    assert "train" in dm.placement.segments
    assert dm.plan.reasons["shared_memory"].startswith("on: one copy of train")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape[1:] == (3, 8, 8) and y.dtype == torch.int64
    dm.teardown("fit")
    gc.collect()  # persistent workers end with their DataLoader (a reference cycle)
    assert "train" not in dm.placement.sources and "train" not in dm.placement.segments
    assert isinstance(dm.stores["train"].fields[0], np.memmap)


@pytest.mark.parametrize("kwargs,used,reason", [
    (dict(num_workers=0), False, "not used"),          # one process reads: nothing to share
    (dict(shared_memory="off"), False, "off"),
    (dict(shared_memory="on"), True, "on:"),
    # The device holds its own copy: a segment beside it would only take RAM.
    (dict(strategy="device", num_workers=0, shared_memory="on"), False, "on, but nothing to share"),
])
def test_datamodule_when_to_share(cache_dir, kwargs, used, reason):
    dm = _dm(cache_dir, **kwargs)
    dm.setup("fit")
    assert ("train" in dm.placement.segments) == used
    assert dm.plan.reasons["shared_memory"].startswith(reason)


def test_datamodule_too_small_auto_falls_back_on_raises(cache_dir, monkeypatch):
    monkeypatch.setattr(shared, "shm_free_bytes", lambda: 4096)
    dm = _dm(cache_dir)
    with pytest.warns(UserWarning, match="--shm-size"):
        dm.setup("fit")
    assert isinstance(dm.placement.sources["train"].arrays[0], np.memmap) and not dm.placement.segments
    assert dm.plan.reasons["shared_memory"].startswith("fallback to the disk cache")
    assert next(iter(dm.train_dataloader()))[0].shape[1:] == (3, 8, 8)
    dm.teardown("fit")
    gc.collect()
    dm2 = _dm(cache_dir, shared_memory="on")
    with warnings.catch_warnings(), pytest.raises(SharedMemoryError, match="--shm-size"):
        dm2.setup("fit")
    assert _shm_names() == set()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_teardown_frees_the_segment_without_waiting_for_the_garbage_collector(cache_dir, num_workers):
    """The segment and its handle for spawned workers pointed at each other: teardown closed the
    descriptor, but the mapping (the whole store in /dev/shm) stayed until a cyclic collection
    ran, or forever in a process that disables it (found by a review helper)."""
    dm = _dm(cache_dir, shared_memory="on", num_workers=num_workers)
    gc.collect()
    gc.disable()  # only reference counting frees memory from here on
    try:
        before_maps, before_fds = _mapped_segments(), set(_held_deleted_segments())
        dm.setup("fit")
        assert dm.placement.segments and _mapped_segments() - before_maps
        assert sum(len(b[1]) for b in dm.train_dataloader()) == 48
        dm.teardown("fit")
        assert _mapped_segments() - before_maps == set()
        assert set(_held_deleted_segments()) - before_fds == set()
    finally:
        gc.enable()


def test_many_fields_one_segment_and_a_constant_number_of_fds():
    def share(n_fields: int) -> int:
        fields = {f"f{i}": np.full((32, 16), i, dtype=np.int32) for i in range(n_fields)}
        stores = {split: Store.from_arrays(dict(fields), fingerprint="d" * 64) for split in ("train", "val")}
        gc.collect()  # the previous call's mappings go first
        before = len(os.listdir("/proc/self/fd"))
        segs = share_stores(stores)
        opened = len(os.listdir("/proc/self/fd")) - before
        assert len(segs) == 2 and len(_mapped_segments()) == 2  # one segment per split, not per field
        arrays = segs["train"].arrays()
        assert all(np.array_equal(arrays[i], fields[f"f{i}"]) for i in range(n_fields))
        del arrays
        for seg in segs.values():
            seg.release()
        return opened

    few, many = share(2), share(40)
    assert few == many <= 2 * 2  # not growing with the fields: per segment, one descriptor + the mapping's


@pytest.mark.parametrize("n_fields", [40, 300])
def test_a_layout_longer_than_a_page_gets_a_larger_header_region(n_fields):
    """The header holds the layout (about 100 bytes a part): 40 fields of (1000, 16) took more
    than its one page and could not be shared at all ("does not fit the segment header")."""
    fields = {f"f{i}": np.full((1000, 16), i, dtype=np.float32) for i in range(n_fields)}
    seg = share_stores({"train": Store.from_arrays(fields, fingerprint="h" * 64)})["train"]
    try:
        assert seg.layout[0]["offset"] % 4096 == 0 and seg.layout[0]["offset"] > 4096
        arrays = seg.arrays()
        assert all(np.array_equal(arrays[i], fields[f"f{i}"]) for i in range(n_fields))
        del arrays
    finally:
        seg.release()


def _ragged_store(n: int = 40) -> Store:
    from lightning_fastdata.ragged import RaggedArray

    g = np.random.default_rng(1)
    images = RaggedArray.from_list([g.integers(0, 256, (3, 1 + i % 5, 2 + i % 3), dtype=np.uint8) for i in range(n)])
    vectors = RaggedArray.from_list([g.normal(size=(i % 4,)).astype(np.float32) for i in range(n)])
    return Store.from_arrays({"image": images, "vec": vectors, "label": np.arange(n, dtype=np.int64)},
                             fingerprint="r" * 64)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_ragged_store_shares_its_values_offsets_and_shapes(context):
    from lightning_fastdata.ragged import RaggedArray, RaggedBatch

    store = _ragged_store()
    seg = share_stores({"train": store})["train"]
    assert [(e["field"], e["role"]) for e in seg.layout] == [
        (0, "values"), (0, "offsets"), (0, "shapes"), (1, "values"), (1, "offsets"), (1, "shapes"), (2, "data")]
    arrays = seg.arrays()
    for got, want in zip(arrays[:2], store.fields[:2], strict=True):
        assert isinstance(got, RaggedArray)
        for role, part in got.parts().items():
            assert isinstance(part, SharedArray) and _backed_by_mmap(part) and not part.flags.writeable
            assert np.array_equal(part, want.parts()[role])
    order = ShardedOrder(40, 8, shuffle=True, seed=3)
    loader = WorkerLoader(order, source=HostSource(arrays, seg), spec=store.spec, names=[i.name for i in store.infos],
                          num_workers=1, worker_init_fn=_check_worker_maps_segment, multiprocessing_context=context)
    seen = []
    for batch in loader:
        image, vec = batch.leaves[0], batch.leaves[1]
        assert isinstance(image, RaggedBatch) and isinstance(vec, RaggedBatch)
        for j, i in enumerate(batch["label"].tolist()):
            assert np.array_equal(image.tensors()[j].numpy(), store.fields[0][i])
            assert np.array_equal(vec.tensors()[j].numpy(), store.fields[1][i])
            seen.append(i)
    assert sorted(seen) == list(range(40))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("kwargs", [dict(strategy="workers", num_workers=2), dict(strategy="chunked")],
                        ids=["workers", "chunked"])
def test_a_finished_fit_leaves_no_segment_mapped_while_the_trainer_lives(tmp_path, kwargs):
    """The fit's teardown released the segment, but the Trainer keeps its loaders (and they
    the segment's views): the pages stayed in /dev/shm, a whole store per fit, until the
    Trainer went (a second fit could then find no room)."""
    from _helpers import TinyModel, trainer

    dm = TinyDataModule(n=64, cache_dir=str(tmp_path / "c"), batch_size=8, val=False, device="cpu",
                        shared_memory="on", persistent_workers=False, **kwargs)
    t = trainer(tmp_path, max_epochs=1, limit_train_batches=3)
    t.fit(TinyModel(), dm)
    gc.collect()
    assert t.train_dataloader is not None  # the Trainer still holds the loader
    assert _mapped_segments() == set()


def test_a_data_module_set_up_with_shared_memory_pickles_as_if_just_made(cache_dir):
    """``ddp_spawn`` pickles the data module into each rank: one set up first (to print its
    plan, say) with a shared-memory segment failed on "cannot pickle 'mmap.mmap' object".
    The copy leaves the run's state behind and sets up again (found by a review helper)."""
    dm = _dm(cache_dir, shared_memory="on")
    dm.setup("fit")
    assert dm.placement.segments
    copy = pickle.loads(pickle.dumps(dm))
    assert copy.plan is None and copy.placement is None and copy.trainer is None
    try:
        copy.setup("fit")
        want = {int(i): x for b in dm.train_dataloader() for x, i in zip(b[0], b[1].tolist(), strict=True)}
        got = {int(i): x for b in copy.train_dataloader() for x, i in zip(b[0], b[1].tolist(), strict=True)}
        assert want.keys() == got.keys() and all(torch.equal(want[i], got[i]) for i in want)
    finally:
        copy.teardown("fit")
        dm.teardown("fit")
