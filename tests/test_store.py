"""Store: dataset -> cache -> arrays; fingerprint, reuse, validation, bad input."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from _helpers import CountingDataset

from lightning_fastdata.store import FORMAT_VERSION, Store, StoreError, build_store, open_store
from lightning_fastdata.structure import unflatten


def test_roundtrip_bit_equal_and_structure(cache_dir):
    ds = CountingDataset(20)
    store = build_store(ds, lambda s: {"image": s[0], "label": s[1]}, cache_dir, progress=False)
    assert len(store) == 20
    assert [i.name for i in store.infos] == ["image", "label"]
    for i in range(20):
        img, lab = ds[i]
        assert np.array_equal(store.fields[0][i], img.numpy())
        assert store.fields[1][i] == lab
    batch = unflatten(store.spec, [torch.from_numpy(np.asarray(a[:4])) for a in store.fields])
    assert set(batch) == {"image", "label"} and batch["image"].shape == (4, 3, 8, 8)


def test_reuse_does_not_rerun_transform(cache_dir):
    calls = []

    def t(s):
        calls.append(1)
        return s

    build_store(CountingDataset(30), t, cache_dir, progress=False)
    # every sample once, plus the fingerprint's 8 probes read twice (the second read checks for randomness)
    assert len(calls) == 30 + 2 * 8
    calls.clear()
    build_store(CountingDataset(30), t, cache_dir, progress=False)
    assert len(calls) == 8  # only the probes, read once


def test_changed_transform_rebuilds_with_warning(cache_dir):
    s1 = build_store(CountingDataset(10), lambda s: s, cache_dir, progress=False)
    with pytest.warns(UserWarning, match="fingerprint") as record:
        s2 = build_store(CountingDataset(10), lambda s: (s[0] // 2, s[1]), cache_dir, progress=False)
    assert "code changed" in str(record[0].message) and str(s1.path) in str(record[0].message)
    # the old cache is kept (a build never deletes another fingerprint's cache; prune does, when unused)
    assert sorted(p.name for p in cache_dir.glob("train-*")) == sorted([s1.path.name, s2.path.name])
    assert np.array_equal(s2.fields[0][3], CountingDataset(10)[3][0].numpy() // 2)


def test_truncated_file_is_rebuilt(cache_dir):
    s = build_store(CountingDataset(10), lambda s: s, cache_dir, progress=False)
    f = s.path / "field_0.npy"
    data = f.read_bytes()
    f.write_bytes(data[:-7])
    with pytest.warns(UserWarning, match="truncated"):
        s2 = build_store(CountingDataset(10), lambda s: s, cache_dir, progress=False)
    assert np.array_equal(s2.fields[0][9], CountingDataset(10)[9][0].numpy())


def test_an_invalid_cache_that_cannot_be_moved_aside_is_an_error_not_opened(cache_dir, monkeypatch):
    import os

    s = build_store(CountingDataset(10), lambda s: s, cache_dir, progress=False)
    f = s.path / "field_0.npy"
    f.write_bytes(f.read_bytes()[:-7])
    real = os.rename

    def refuse(src, dst, *a, **k):
        if str(src) == str(s.path):
            raise PermissionError(1, "Operation not permitted", str(src))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", refuse)
    with pytest.warns(UserWarning, match="truncated"), pytest.raises(
            StoreError, match=r"is invalid .* could not be moved aside to rebuild it: .*Operation not permitted"):
        build_store(CountingDataset(10), lambda s: s, cache_dir, progress=False)


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


def _builder(cache_dir, n=40, delay=0.0, namespace=""):
    """A process running ``build_store(CountingDataset(n), _store_job.slow, cache_dir)``.

    It prints the fingerprint and how many times the transform ran.
    """
    import os
    import subprocess
    import sys
    from pathlib import Path

    job = str(Path(__file__).parent / "_store_job.py")
    return subprocess.Popen([sys.executable, job, str(n), str(cache_dir), namespace], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "LFD_TEST_DELAY": str(delay)})


def test_writer_killed_mid_write_leaves_no_cache_and_is_swept(cache_dir):
    import signal
    import time

    proc = _builder(cache_dir, n=200, delay=0.02)
    deadline = time.monotonic() + 60
    while not list(cache_dir.glob(".tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # mid-write
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    proc.stderr.close()
    assert list(cache_dir.glob(".tmp-*")) and not list(cache_dir.glob("train-*"))
    store = build_store(CountingDataset(200), lambda s: s, cache_dir, progress=False)  # sweeps, rebuilds
    assert not list(cache_dir.glob(".tmp-*")) and len(store) == 200


_DAY = 24 * 3600


def _back_date(path, seconds=_DAY + 3600):
    import os
    import time

    then = time.time() - seconds
    os.utime(path, (then, then))


def _wait_for_temporary(cache_dir, timeout_s=60.0):
    """The build temporary in ``cache_dir`` once its fixed-shape files exist (nothing touches it after)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [p for p in cache_dir.glob(".tmp-*") if (p / "field_0.npy").exists()]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no build temporary appeared in {cache_dir}")


@pytest.mark.parametrize("seen_as", ["old", "another-pid-namespace"])
def test_a_live_builders_temporary_is_not_swept(cache_dir, monkeypatch, seen_as):
    """A build running for more than a day keeps its temporary through other builds and prunes;
    so does one in another PID namespace on this host (a container with the same hostname),
    whose pid here names another process (another start time): its live temporary was removed
    by the sweep of another build, and it died with FileNotFoundError."""
    from lightning_fastdata import store as S
    from lightning_fastdata.caches import prune_caches

    proc = _builder(cache_dir, n=200, delay=0.02)
    try:
        tmp = _wait_for_temporary(cache_dir)
        if seen_as == "old":
            _back_date(tmp)  # as if the build had started 25 h ago
        else:
            real = S._started
            monkeypatch.setattr(S, "_started", lambda pid: real(pid) + 1 if pid == proc.pid else real(pid))
        val = build_store(CountingDataset(5), lambda s: s, cache_dir, name="val", progress=False)  # sweeps
        prune_caches(cache_dir)  # `fastdata cache prune` sweeps too (it keeps `val`: open here)
        assert tmp.exists()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    fp, calls = out.split()
    assert int(calls) == 200 + 2 * 8  # it built the cache
    store = open_store(cache_dir / f"train-{fp[:16]}", verify=True)
    assert len(store) == 200 and len(val) == 5 and not list(cache_dir.glob(".tmp-*"))


def test_temporaries_of_exited_writers_are_swept_at_once(cache_dir):
    """This host's temporaries: swept when the pid runs no more or names a newer process, kept while it runs."""
    import os
    import shutil
    import subprocess
    import sys

    from lightning_fastdata import store as S

    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait(timeout=60)
    host = S._host()
    cache_dir.mkdir(parents=True)
    dead = [cache_dir / f".tmp-train~{host}~{gone.pid}~a", cache_dir / f".tmp-train~{host}~{gone.pid}.12345~b",
            cache_dir / f".tmp-trash~{host}~{gone.pid}~train-0123456789abcdef"]
    start = S._started(os.getpid())
    live = cache_dir / f".tmp-train~{S._writer_tag()}~d"
    if start is not None:  # a platform with /proc: a reused pid is told apart by its start time
        dead.append(cache_dir / f".tmp-train~{host}~{os.getpid()}.{start + 1}~c")
    for d in [*dead, live]:
        d.mkdir()
        (d / "field_0.npy").touch()
    _back_date(live)
    try:
        build_store(CountingDataset(5), lambda s: s, cache_dir, progress=False)
        assert [d for d in dead if d.exists()] == [] and live.exists()
    finally:
        shutil.rmtree(live, ignore_errors=True)


def test_another_hosts_temporary_is_judged_by_its_builders_heartbeat(cache_dir, monkeypatch):
    """A builder touches its temporary while it runs; one of another host is swept only when that stops."""
    import threading
    import time

    from lightning_fastdata import locks
    from lightning_fastdata.caches import prune_caches

    monkeypatch.setattr(locks, "HEARTBEAT_S", 0.02)
    gate, built, errors = threading.Event(), [], []

    def held(s):
        if list(cache_dir.glob(".tmp-*")):  # filling: wait until the test has seen the heartbeat
            gate.wait(timeout=60)
        return s

    def build():
        try:
            built.append(build_store(CountingDataset(10), held, cache_dir, progress=False, num_workers=0))
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=build)
    thread.start()
    try:
        tmp = _wait_for_temporary(cache_dir)
        _back_date(tmp)
        deadline = time.monotonic() + 30
        while time.time() - tmp.stat().st_mtime > 3600 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert time.time() - tmp.stat().st_mtime < 3600  # the builder touched it again
    finally:
        gate.set()
        thread.join(timeout=60)
    assert not thread.is_alive() and not errors and len(built[0]) == 10

    fresh, stale = cache_dir / ".tmp-val~another-host~1~a", cache_dir / ".tmp-val~another-host~1~b"
    for d in (fresh, stale):
        d.mkdir()
        (d / "field_0.npy").touch()
    _back_date(stale)
    prune_caches(cache_dir, older_than_s=_DAY)  # sweeps; keeps the cache, used just now
    assert fresh.exists() and not stale.exists()
    _back_date(fresh)  # its builder stopped beating a day ago
    prune_caches(cache_dir, older_than_s=_DAY)
    assert not fresh.exists() and built[0].path.exists()


def test_builders_sharing_a_filesystem_build_once_the_others_wait_and_reuse(cache_dir):
    """Ranks of several nodes on one shared filesystem, no cache yet: one build under the lock."""
    procs = [_builder(cache_dir, n=60, delay=0.01, namespace="proj.Images") for _ in range(3)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        outs.append(out.split())
    assert len({fp for fp, _ in outs}) == 1
    assert sorted(int(calls) for _, calls in outs) == [8, 8, 60 + 2 * 8]  # one built, two reused
    fp = outs[0][0]
    ns = cache_dir / "proj.Images"
    assert [p.name for p in ns.iterdir() if not p.name.startswith(".")] == [f"train-{fp[:16]}"]
    assert not list(ns.glob(".tmp-*")) and not list(ns.glob(".lock-*.owner"))
    s = open_store(ns / f"train-{fp[:16]}", verify=True)
    assert np.array_equal(s.fields[0][59], CountingDataset(60)[59][0].numpy())


def test_symlinks_are_refused(cache_dir, tmp_path):
    from lightning_fastdata.store import CacheInvalidError, fingerprint, store_dir

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    with pytest.raises(StoreError, match="symbolic link"):
        build_store(CountingDataset(4), lambda s: s, link, progress=False)
    cache_dir.mkdir()
    fp = fingerprint(CountingDataset(4), lambda s: s)[0]
    store_dir(cache_dir, "train", fp).symlink_to(elsewhere)
    with pytest.raises(CacheInvalidError, match="symbolic link"):
        build_store(CountingDataset(4), lambda s: s, cache_dir, progress=False)
    assert not list(elsewhere.iterdir())  # nothing written through the link


def test_old_format_version_is_rejected_then_rebuilt(cache_dir):
    from lightning_fastdata.store import _manifest_crc

    s = build_store(CountingDataset(8), lambda s: s, cache_dir, progress=False)
    m = s.path / "manifest.json"
    doc = json.loads(m.read_text())
    doc["version"] = 0
    doc["manifest_crc32"] = _manifest_crc(doc)
    m.write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match=f"format version 0, this release reads version {FORMAT_VERSION}"):
        s2 = build_store(CountingDataset(8), lambda s: s, cache_dir, progress=False)
    assert json.loads((s2.path / "manifest.json").read_text())["version"] == FORMAT_VERSION


def test_parallel_build_matches_sequential(cache_dir, tmp_path):
    seq = build_store(CountingDataset(50), lambda s: s, cache_dir, progress=False, num_workers=0)
    # parallel_threshold_s=0: the transform counts as slow, so the build fans out over the cores
    par = build_store(CountingDataset(50), lambda s: s, tmp_path / "par", progress=False, parallel_threshold_s=0.0)
    assert par.fingerprint == seq.fingerprint
    assert all(np.array_equal(a, b) for a, b in zip(par.fields, seq.fields, strict=True))
    ragged = CountingDataset(50)
    with pytest.raises(StoreError, match=r"^sample (3|7), field '0' has shape \(3, 7, 8\)"):
        build_store(ragged, lambda s: (s[0][:, : 8 - (s[1] == 3 and 1)], s[1]), tmp_path / "bad", progress=False,
                    num_workers=2, probes=1)
    assert not list((tmp_path / "bad").glob(".tmp-*"))


# --------------------------------------------------------------------------- caches are never deleted behind a reader


def test_a_reader_keeps_its_cache_while_another_job_builds_another_fingerprint(cache_dir):
    import time
    import zlib

    reader = build_store(CountingDataset(40), lambda s: s, cache_dir, progress=False)
    crcs = [zlib.crc32(np.ascontiguousarray(a).tobytes()) for a in reader.fields]
    inodes = {f.name: f.stat().st_ino for f in reader.path.iterdir()}
    other = _builder(cache_dir, n=40, delay=0.005)  # another job: another transform, so another fingerprint
    while other.poll() is None:  # the reader keeps reading while the other job builds
        assert [zlib.crc32(np.ascontiguousarray(a).tobytes()) for a in reader.fields] == crcs
        time.sleep(0.01)
    out, err = other.communicate()
    assert other.returncode == 0, err
    assert out.split()[0][:16] != reader.fingerprint[:16]
    assert {f.name: f.stat().st_ino for f in reader.path.iterdir()} == inodes
    again = open_store(reader.path, verify=True)  # every checksum still holds
    assert [zlib.crc32(np.ascontiguousarray(a).tobytes()) for a in again.fields] == crcs


def test_prune_skips_a_cache_that_is_open_and_removes_it_once_closed(cache_dir):
    from lightning_fastdata.caches import list_caches, prune_caches

    kept = build_store(CountingDataset(10), lambda s: s, cache_dir, progress=False)
    with pytest.warns(UserWarning, match="fingerprint"):
        build_store(CountingDataset(10), lambda s: (s[0] // 2, s[1]), cache_dir, progress=False).close()
    assert {c.in_use for c in list_caches(cache_dir)} == {True, False}
    results = {r.cache.path: r for r in prune_caches(cache_dir)}
    assert not results[kept.path].removed and "in use" in results[kept.path].reason and kept.path.exists()
    (gone,) = [r for r in results.values() if r.removed]
    assert not gone.cache.path.exists() and not (cache_dir / f".lock-{gone.cache.path.name}").exists()
    kept.close()
    assert [r.removed for r in prune_caches(cache_dir)] == [True]
    assert not [p for p in cache_dir.iterdir() if not p.name.startswith(".lock-")]


def test_a_dead_lock_holder_is_a_clear_error_then_the_next_build_takes_over(cache_dir, monkeypatch):
    import signal
    import socket
    import time

    from _store_job import slow

    from lightning_fastdata import locks

    holder = _builder(cache_dir, n=300, delay=0.05)
    deadline = time.monotonic() + 120
    while not list(cache_dir.glob(".tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    holder.send_signal(signal.SIGSTOP)  # a hung holder (or a dead node on a network filesystem)
    try:
        monkeypatch.setattr(locks, "STALE_S", 1.0)
        with pytest.raises(StoreError) as err:
            build_store(CountingDataset(300), slow, cache_dir, progress=False)
        msg = str(err.value)
        (lock,) = [p for p in cache_dir.glob(".lock-train-*") if not p.name.endswith(".owner")]
        assert str(lock) in msg and f"pid {holder.pid} on host {socket.gethostname()}" in msg
        assert "no sign of life" in msg and "delete" in msg
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.send_signal(signal.SIGCONT)
        holder.communicate(timeout=60)
    # the kernel released the dead holder's lock: the next build takes over, sweeping its temporaries
    store = build_store(CountingDataset(300), slow, cache_dir, progress=False)
    assert len(store) == 300 and not list(cache_dir.glob(".tmp-*"))


# --------------------------------------------------------------------------- a full disk


def _nothing_left(cache_dir) -> None:
    assert not [p.name for p in cache_dir.iterdir()], list(cache_dir.iterdir())


def test_too_little_free_space_is_a_clear_error_before_writing(cache_dir, monkeypatch):
    import collections

    from lightning_fastdata import store as S

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(S.shutil, "disk_usage", lambda path: usage(10_000_000, 9_000_000, 1_000_000))
    with pytest.raises(StoreError) as err:
        build_store(CountingDataset(400, shape=(3, 32, 32)), lambda s: s, cache_dir, progress=False)
    msg = str(err.value)
    assert msg.startswith("caching 'train' needs 1.3 MB (400 samples x 3.1 KB)")
    assert f"in cache_dir {cache_dir}, which has 1.0 MB free; set cache_dir to a filesystem with more room" in msg
    _nothing_left(cache_dir)


def test_enospc_while_allocating_is_the_same_clear_error(cache_dir, monkeypatch):
    import errno

    from lightning_fastdata import store as S

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(S.os, "posix_fallocate", full)
    with pytest.raises(StoreError, match="needs .* free; set cache_dir to a filesystem with more room"):
        build_store(CountingDataset(50), lambda s: s, cache_dir, progress=False)
    _nothing_left(cache_dir)


def test_a_small_tmpfs_cache_dir_fails_before_writing_and_at_allocation(tmp_path, monkeypatch):
    """A real 10 MB filesystem and a 15 MB store (issue 12 item 12); needs root to mount."""
    import collections
    import shutil
    import subprocess

    from lightning_fastdata import store as S

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        ds = CountingDataset(1200, shape=(3, 64, 64))  # 1200 x 12.3 KB = 14.8 MB
        with pytest.raises(StoreError, match=r"needs 14\.8 MB .* which has 10\.\d MB free"):
            build_store(ds, lambda s: s, mnt / "cache", progress=False)
        _nothing_left(mnt / "cache")
        # space that vanishes between the check and the write: reserved up front, ENOSPC, not SIGBUS
        real, calls = shutil.disk_usage, []
        usage = collections.namedtuple("usage", "total used free")

        def lying_once(path):  # the check before writing sees room; the allocation then meets the real disk
            calls.append(path)
            return usage(1 << 40, 0, 1 << 40) if len(calls) == 1 else real(path)

        monkeypatch.setattr(S.shutil, "disk_usage", lying_once)
        with pytest.raises(StoreError, match=r"needs 14\.8 MB .* which has 10\.\d MB free; set cache_dir"):
            build_store(ds, lambda s: s, mnt / "cache", progress=False)
        _nothing_left(mnt / "cache")
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# --------------------------------------------------------------------------- field kinds


def test_field_kinds_from_tv_tensors_and_the_default_rule(cache_dir):
    from torchvision import tv_tensors

    def segmentation(sample):
        image, label = sample
        return {"image": tv_tensors.Image(image), "mask": tv_tensors.Mask(image[:1] > 127), "label": label}

    s = build_store(CountingDataset(6), segmentation, cache_dir, progress=False)
    assert s.kinds == {"image": "image", "mask": "mask", "label": "other"}
    assert [f["kind"] for f in open_store(s.path).meta["fields"]] == ["image", "mask", "other"]
    assert open_store(s.path).kinds == s.kinds
    video = build_store(CountingDataset(4), lambda t: (t[1], {"clip": tv_tensors.Video(t[0][None])}), cache_dir,
                        name="val", progress=False)
    assert video.kinds == {"0": "other", "1.clip": "image"}
    plain = build_store(CountingDataset(4), lambda s: s, cache_dir, name="test", progress=False)
    assert plain.kinds == {"0": "image", "1": "other"}  # no tv_tensors: first leaf image, the rest other
    assert Store.from_arrays({"x": np.zeros((3, 2)), "y": np.zeros(3)}).kinds == {"x": "image", "y": "other"}
    over = build_store(CountingDataset(4), lambda s: s, cache_dir, name="predict", progress=False,
                       field_kinds={"1": "mask"})
    assert over.kinds == {"0": "image", "1": "mask"} and over.fingerprint != plain.fingerprint
    with pytest.raises(StoreError, match=r"field_kinds names a field 'label' .* their fields are \['0', '1'\]"):
        build_store(CountingDataset(4), lambda s: s, cache_dir, progress=False, field_kinds={"label": "mask"})


# --------------------------------------------------------------------------- ragged fields


class VaryingDataset(CountingDataset):
    """Sample ``i``: a uint8 image of width 2 + i % 5, a float32 vector of i % 4 elements, an int16 matrix, a label."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        g = np.random.default_rng(i)
        return {"image": x[:, :, : 2 + i % 5], "vec": g.normal(size=(i % 4,)).astype(np.float32),
                "mat": g.integers(-900, 900, (1 + i % 3, 2 + i % 2)).astype(np.int16), "label": y}


def _check_varying(store, n):
    ref = VaryingDataset(n)
    for i in range(n):
        want = ref[i]
        for k, name in enumerate(("image", "vec", "mat")):
            got = store.fields[k][i]
            w = np.asarray(want[name])
            assert got.dtype == w.dtype and got.shape == w.shape and np.array_equal(got, w), (name, i)
        assert store.fields[3][i] == want["label"]


def test_ragged_fields_are_stored_end_to_end_and_built_in_parallel_the_same(cache_dir, tmp_path):
    from lightning_fastdata.ragged import RaggedArray

    kw = dict(ragged=["image", "vec", "mat"], progress=False)
    seq = build_store(VaryingDataset(40), lambda s: s, cache_dir, num_workers=0, **kw)
    par = build_store(VaryingDataset(40), lambda s: s, tmp_path / "par", parallel_threshold_s=0.0, **kw)
    assert par.fingerprint == seq.fingerprint
    for store in (seq, par, open_store(seq.path)):
        assert [i.ragged for i in store.infos] == [True, True, True, False]
        assert store.infos[0].shape == (-1, -1, -1) and store.infos[1].shape == (-1,)
        assert all(isinstance(f, RaggedArray) for f in store.fields[:3])
        _check_varying(store, 40)
        assert store.nbytes == sum(f.values.nbytes + f.offsets.nbytes + f.shapes.nbytes for f in store.fields[:3]) \
            + store.fields[3].nbytes
    for a, b in zip(seq.fields[:3], par.fields[:3], strict=True):
        assert all(np.array_equal(x, y) for x, y in zip(a.parts().values(), b.parts().values(), strict=True))
    entry = json.loads((seq.path / "manifest.json").read_text())["fields"][0]
    assert entry["ragged"] is True and entry["encoding"] is None
    assert sorted(entry["files"]) == ["offsets", "shapes", "values"]
    assert all(set(f) == {"file", "bytes", "crc32"} for f in entry["files"].values())
    assert not list(seq.path.glob("*.part*"))  # the chunks' parts were joined and removed
    # an in-memory store takes ragged arrays too
    mem = Store.from_arrays({"x": RaggedArray.from_list([np.zeros((2, 3), np.uint8), np.ones((1, 1), np.uint8)])})
    assert len(mem) == 2 and mem.infos[0].ragged and mem.nbytes == 7 + 24 + 32


def test_a_truncated_values_file_or_edited_offsets_are_detected_and_rebuilt(cache_dir):
    kw = dict(ragged=["image", "vec", "mat"], progress=False)
    store = build_store(VaryingDataset(20), lambda s: s, cache_dir, **kw)
    values = store.path / "field_0.values.npy"
    values.write_bytes(values.read_bytes()[:-5])
    with pytest.warns(UserWarning, match=r"rebuilding the 'train' cache: .*field_0\.values\.npy has \d+ bytes, the "
                                         r"manifest says \d+ \(truncated\?\)"):
        rebuilt = build_store(VaryingDataset(20), lambda s: s, cache_dir, verify=False, **kw)
    _check_varying(rebuilt, 20)
    # edited offsets: the checksum sees it, and so does the consistency check when checksums are skipped
    offsets = np.load(rebuilt.path / "field_2.offsets.npy", mmap_mode="r+")
    offsets[4] += 1
    offsets.flush()
    del offsets
    with pytest.raises(Exception, match=r"field 'mat': sample 3 spans \d+ elements by its offsets, its shape "
                                        r"\(\d, \d\) says \d+"):
        open_store(rebuilt.path, verify=False)
    with pytest.warns(UserWarning, match="rebuilding the 'train' cache: .*sample 3 spans .* edited or corrupted"):
        again = build_store(VaryingDataset(20), lambda s: s, cache_dir, verify=False, **kw)
    _check_varying(again, 20)
    offsets = np.load(again.path / "field_1.offsets.npy", mmap_mode="r+")
    offsets[2] += 1
    offsets.flush()
    del offsets
    with pytest.warns(UserWarning, match="field_1.offsets.npy fails its checksum"):
        build_store(VaryingDataset(20), lambda s: s, cache_dir, **kw)


def test_a_varying_field_not_named_ragged_gets_the_shape_error_with_the_hint(cache_dir):
    with pytest.raises(StoreError) as err:
        build_store(VaryingDataset(10), lambda s: s, cache_dir, ragged=["image", "vec"], progress=False, probes=2)
    msg = str(err.value)
    # sample 9 is a probe, so it is the first seen
    assert msg.startswith("sample 9, field 'mat' has shape (1, 3) dtype int16, sample 0 has shape (1, 2) dtype int16")
    assert msg.endswith("name it in ragged=['mat'] if its shape varies by design")
    # a ragged field still keeps its number of dimensions and its dtype
    with pytest.raises(StoreError, match=r"sample 3, ragged field 'image' has 2 dimension\(s\) .* not its number of "
                                         r"dimensions or its dtype"):
        build_store(VaryingDataset(10), lambda s: {**s, "image": s["image"][0] if s["label"] == 3 else s["image"]},
                    cache_dir, ragged=["image", "vec", "mat"], progress=False, probes=2)
    with pytest.raises(StoreError, match=r"ragged names a field 'img' that the samples do not have; their fields are "
                                         r"\['image', 'vec', 'mat', 'label'\]"):
        build_store(VaryingDataset(10), lambda s: s, cache_dir, ragged=["img"], progress=False)
    assert not list(cache_dir.glob("train-*")) and not list(cache_dir.glob(".tmp-*"))


def test_a_full_disk_while_writing_ragged_values_is_the_clear_error(cache_dir, monkeypatch):
    import errno
    import os

    from lightning_fastdata import store as S

    real_fdopen = os.fdopen

    class Full:
        def __init__(self, fh):
            self.fh = fh

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.fh.close()

    def fdopen(fd, mode="r", *args, **kwargs):
        fh = real_fdopen(fd, mode, *args, **kwargs)
        return Full(fh) if mode == "wb" else fh  # the chunks' part files

    kw = dict(ragged=["image", "vec", "mat"], progress=False)
    monkeypatch.setattr(S.os, "fdopen", fdopen)
    # Not the up-front message ("needs 183.5 KB ... which has 4.2 MB free"), which the full disk
    # contradicted; less than the estimate was written, so something else took the space.
    with pytest.raises(StoreError, match=r"the disk of cache_dir .* filled up while caching 'train', after .* written "
                                         r"of an estimated .* \(the free space fell during the build: another "
                                         r"process wrote to that filesystem\); .* were free at the start\. Set "
                                         r"cache_dir to a filesystem with more room"):
        build_store(VaryingDataset(20), lambda s: s, cache_dir, **kw)
    _nothing_left(cache_dir)
    monkeypatch.setattr(S.os, "fdopen", real_fdopen)

    def no_room(*args, **kwargs):  # the join of the parts into the values file meets a full disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(S.os, "copy_file_range", no_room, raising=False)
    with pytest.raises(StoreError, match="filled up while caching 'train'.* Set cache_dir to a filesystem with more"):
        build_store(VaryingDataset(20), lambda s: s, cache_dir, **kw)
    _nothing_left(cache_dir)


def test_cache_dir_with_a_tilde_a_file_or_no_write_access_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    store = build_store(CountingDataset(8), lambda s: s, "~/caches", progress=False)
    assert str(store.path).startswith(str(tmp_path / "home" / "caches"))  # not ./~/caches
    (tmp_path / "afile").write_text("")
    with pytest.raises(StoreError, match=r"cache_dir .*afile exists and is not a directory; set cache_dir to a "
                                         r"directory"):
        build_store(CountingDataset(8), lambda s: s, tmp_path / "afile", progress=False)
    from lightning_fastdata import store as S

    real_access = S.os.access
    monkeypatch.setattr(S.os, "access", lambda p, mode: mode != os.W_OK and real_access(p, mode))
    with pytest.raises(StoreError, match=r"the 'train' cache .* must be built \(there is none yet\), but .* is not "
                                         r"writable \(a read-only filesystem, or another user's directory\); set "
                                         r"cache_dir to a writable directory"):
        build_store(CountingDataset(9), lambda s: s, tmp_path / "home" / "caches", progress=False)
    assert build_store(CountingDataset(8), lambda s: s, "~/caches", progress=False).path == store.path  # reused


def test_an_error_reading_a_sample_names_its_file_when_the_source_lists_paths(tmp_path):
    """Before: a zero-byte file the user's loader refused got only the note "raised while caching
    sample 1", though the source (an ImageFolder) lists every item's path in ``samples``."""
    from torchvision.datasets import ImageFolder

    (tmp_path / "photos" / "cls").mkdir(parents=True)
    for name, data in (("a.jpg", b"\xff\xd8 one"), ("b.jpg", b""), ("c.jpg", b"\xff\xd8 two")):
        (tmp_path / "photos" / "cls" / name).write_bytes(data)
    source = ImageFolder(str(tmp_path / "photos"), is_valid_file=lambda p: True,
                         loader=lambda p: torch.frombuffer(bytearray(open(p, "rb").read()), dtype=torch.uint8))
    path = str(tmp_path / "photos" / "cls" / "b.jpg")
    for probes in (2, 8):  # the fill meets it, or the probe
        with pytest.raises(ValueError, match="must not be 0") as raised:  # torch.frombuffer's own error, kept
            build_store(source, lambda s: s, tmp_path / "cache", progress=False, probes=probes)
        assert raised.value.__notes__ == [f"lightning_fastdata: raised while caching sample 1 ({path}) (the source's "
                                          "item 1, then static_transform)"]
        assert not list((tmp_path / "cache").rglob("field_*"))


class _FailsAt(CountingDataset):
    """CountingDataset whose sample ``bad`` raises, as a corrupt file does in the user's loader."""

    def __init__(self, n: int, bad: int | None) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i):
        if i == self.bad:
            raise OSError(f"cannot identify image file {i}")
        return super().__getitem__(i)


def test_a_failed_parallel_build_stops_its_workers_and_a_retry_is_quiet(cache_dir, capfd):
    """Before: the fill's DataLoader iterator, abandoned by the exception, was kept alive by its
    traceback, and so were its two workers (mapping the deleted temporary files) until a gc cycle;
    a retry in the same process (a notebook) printed "Exception ignored in
    _MultiProcessingDataLoaderIter.__del__ ... can only test a child process"."""
    import multiprocessing

    before = set(multiprocessing.active_children())
    with pytest.raises(OSError, match="cannot identify image file 17") as failed:
        build_store(_FailsAt(40, 17), lambda s: s, cache_dir, num_workers=2, probes=2, progress=False)
    assert failed.value is not None  # the traceback is still held here, as in a notebook's last error
    assert set(multiprocessing.active_children()) == before
    store = build_store(_FailsAt(40, None), lambda s: s, cache_dir, num_workers=2, probes=2, progress=False)
    assert len(store) == 40 and set(multiprocessing.active_children()) == before
    assert "Exception ignored" not in capfd.readouterr().err


def test_a_full_disk_blames_the_probe_estimate_only_when_the_build_wrote_more_than_it(cache_dir, monkeypatch):
    """Before: any full disk after a ragged field's write said "the other samples are larger than
    the probe samples", also when another process had filled the disk (less written than estimated)."""
    import errno

    from lightning_fastdata import store as S

    real_fdopen = os.fdopen

    class FullAfter:  # the disk fills once 1 MB of part files is written
        written = 0

        def __init__(self, fh):
            self.fh = fh

        def write(self, data):
            if FullAfter.written > 1 << 20:
                raise OSError(errno.ENOSPC, "No space left on device")
            FullAfter.written += len(data)
            return self.fh.write(data)

        def close(self):
            self.fh.close()

    monkeypatch.setattr(S.os, "fdopen", lambda fd, mode="r", *a, **kw: (
        FullAfter(real_fdopen(fd, mode, *a, **kw)) if mode == "wb" else real_fdopen(fd, mode, *a, **kw)))
    class SmallProbes(torch.utils.data.Dataset):  # probes 0 and 39 hold 1 value, the others 20000
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return np.arange(1 if i in (0, 39) else 20000)

    with pytest.raises(StoreError, match=r"filled up while caching 'train', after .* written of an estimated .* "
                                         r"\(the other samples are larger than the probe samples"):
        build_store(SmallProbes(), lambda s: s, cache_dir, ragged=["0"], probes=2, progress=False)
    _nothing_left(cache_dir)


@pytest.mark.parametrize("where", ["manifest", "npy_headers"])
def test_a_full_disk_outside_the_fill_is_the_clear_error(cache_dir, monkeypatch, where):
    """Before: ENOSPC flushing the manifest, or writing the .npy headers before the space is
    reserved, was a bare ``OSError: [Errno 28]`` with no cache_dir, size or fix."""
    import errno

    import numpy.lib.format as npf

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "manifest":
        monkeypatch.setattr(os, "fsync", full)
    else:
        monkeypatch.setattr(npf, "open_memmap", full)
    with pytest.raises(StoreError, match=rf"the disk of cache_dir {cache_dir} filled up while caching 'train', after "
                                         r".* written of an estimated .*; .* were free at the start\. Set cache_dir "
                                         r"to a filesystem with more room"):
        build_store(CountingDataset(20), lambda s: s, cache_dir, progress=False)
    _nothing_left(cache_dir)


def test_a_static_transforms_own_enospc_is_its_error_not_a_full_cache_dir(cache_dir):
    """Before: an ENOSPC the transform met on its own scratch file was reported as "the disk of
    cache_dir filled up", losing the file, the sample and the traceback."""
    import errno

    def transform(sample):
        if sample[1] == 1 and int(sample[0][0, 0, 0]) == int(CountingDataset(40)[5][0][0, 0, 0]):
            raise OSError(errno.ENOSPC, "No space left on device", "/scratch/decode_tmp/frame.png")
        return sample

    with pytest.raises(OSError) as raised:
        build_store(CountingDataset(40), transform, cache_dir, probes=2, num_workers=0, progress=False)
    assert type(raised.value) is OSError and raised.value.filename == "/scratch/decode_tmp/frame.png"
    assert raised.value.__notes__ == ["lightning_fastdata: raised while caching sample 5 (the source's item 5, then "
                                      "static_transform)"]
    assert not list(cache_dir.rglob("field_*"))


def _kill_own_worker_at_sample_20(sample):
    if torch.utils.data.get_worker_info() is not None and int(sample[0][0, 0, 0]) == _SAMPLE_20:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer does
    return sample


_SAMPLE_20 = int(CountingDataset(64)[20][0][0, 0, 0])


def test_a_build_worker_killed_by_a_signal_names_the_split_the_samples_and_the_fix(cache_dir):
    """Before: only torch's "DataLoader worker (pid(s) N) exited unexpectedly", no split, samples or fix."""
    with pytest.raises(StoreError) as raised:
        build_store(CountingDataset(64), _kill_own_worker_at_sample_20, cache_dir, num_workers=2, probes=2,
                    progress=False)
    msg = str(raised.value)
    assert msg.startswith("building the 'train' cache failed: a build worker process died (DataLoader worker (pid")
    first, last = map(int, msg.split("while caching samples ")[1].split(" of 64")[0].split("-"))
    assert first <= 20 <= last
    assert "out-of-memory killer" in msg and "build_store(num_workers=...)" in msg and "0 builds in this" in msg
    assert not list(cache_dir.rglob("field_*")) and not list(cache_dir.rglob(".tmp-*"))


def test_a_manifest_that_is_a_directory_is_an_invalid_cache_and_rebuilt(cache_dir):
    """Before: ``IsADirectoryError: [Errno 21] Is a directory: 5``, no path, no rebuild."""
    from lightning_fastdata.store import CacheInvalidError

    built = build_store(CountingDataset(10), lambda s: s, cache_dir, progress=False)
    (built.path / "manifest.json").unlink()
    (built.path / "manifest.json").mkdir()
    with pytest.raises(CacheInvalidError, match=rf"{built.path / 'manifest.json'} cannot be read"):
        open_store(built.path)
    with pytest.warns(UserWarning, match=r"rebuilding the 'train' cache: .*manifest\.json cannot be read"):
        again = build_store(CountingDataset(10), lambda s: s, cache_dir, progress=False)
    assert again.path == built.path and len(open_store(again.path, verify=True)) == 10


class _Stream(torch.utils.data.IterableDataset):
    """An IterableDataset that also has a length."""

    def __len__(self) -> int:
        return 5

    def __iter__(self):
        return iter(torch.zeros(5, 2))


def test_an_iterable_dataset_with_a_len_is_refused_up_front_naming_the_split(cache_dir):
    """It passed the len() check and failed in torch's words ("Subclasses of Dataset should
    implement __getitem__"), noted "raised while caching sample 0"."""
    from lightning_fastdata import OptimizedDataModule

    class DM(OptimizedDataModule):
        def source(self, split: str):
            return _Stream() if split == "val" else None

    want = r"source\('val'\) returned _Stream, an IterableDataset; .*a map-style Dataset .* is required: return one"
    with pytest.raises(StoreError, match=want):
        DM(cache_dir=str(cache_dir), device="cpu", progress=False).prepare_data()
    with pytest.raises(StoreError, match=want):
        build_store(_Stream(), lambda s: s, cache_dir / "direct", name="val", progress=False)
    assert not [p for p in cache_dir.rglob("*") if p.is_file()]
