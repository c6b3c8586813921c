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


_BUILD = """
import sys, time
sys.path.insert(0, {tests!r})
from _helpers import CountingDataset
from lightning_fastdata.store import build_store

def slow(s):
    time.sleep({delay})
    return s

print(build_store(CountingDataset({n}), slow, {cache!r}, progress=False, num_workers=0).fingerprint, flush=True)
"""


def _builder(cache_dir, n=40, delay=0.0):
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = _BUILD.format(tests=str(Path(__file__).parent), delay=delay, n=n, cache=str(cache_dir))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


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


def test_two_writers_at_once_publish_one_complete_cache(cache_dir):
    procs = [_builder(cache_dir, n=60, delay=0.002) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out.strip())
    assert outs[0] == outs[1]
    assert [p.name for p in cache_dir.iterdir() if not p.name.startswith(".")] == [f"train-{outs[0][:16]}"]
    s = open_store(cache_dir / f"train-{outs[0][:16]}", verify=True)
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
    with pytest.warns(UserWarning, match="format version 0, this release reads version 2"):
        s2 = build_store(CountingDataset(8), lambda s: s, cache_dir, progress=False)
    assert json.loads((s2.path / "manifest.json").read_text())["version"] == 2


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
