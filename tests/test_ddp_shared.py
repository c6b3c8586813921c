"""Shared memory across real processes: 2-rank gloo jobs, Lightning ``ddp`` fits, signals.

Ranks are launched as subprocesses with the environment torchrun would give them
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), in one
process group per job so a test can signal "the job" as a scheduler would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from _jobs import Launch, free_port, shm_names
from _shared_job import IndexedImages

from lightning_fastdata import shared
from lightning_fastdata.store import build_store

HERE = Path(__file__).parent
JOB = str(HERE / "_shared_job.py")
N = 4096  # 16 KiB samples: a 64 MiB store
STORE_BYTES = N * 4 * 64 * 64
pytestmark = pytest.mark.slow


class Job(Launch):
    """Two ranks of one job (RANK, LOCAL_RANK 0/1 of 2 on this node) in their own process group."""

    def __init__(self, out: Path, *args: str) -> None:
        port = str(free_port())
        super().__init__(out, [
            ([sys.executable, JOB, *args], {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                                            "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0", "MASTER_PORT": port})
            for rank in range(2)
        ])

    def result(self, rank: int) -> dict:
        return json.loads((self.out / f"rank{rank}.json").read_text())

    @classmethod
    def finished(cls, out: Path, *args: str, timeout: float = 180) -> Job:
        """A job run to its end (both ranks must exit 0), reaped; its logs and results stay."""
        job = cls(out, *args)
        try:
            assert job.wait(timeout) == [0, 0], job.log()
        finally:
            job.reap()
        return job


@pytest.fixture(scope="module")
def fit_cache(tmp_path_factory) -> str:
    """The 64 MiB training store, built once; the jobs only open it."""
    cache = tmp_path_factory.mktemp("fitcache") / "cache"
    build_store(IndexedImages(N), lambda s: s, cache, progress=False, num_workers=0)
    return str(cache)


def test_gloo_fingerprints_differ_then_attaching_rank_exits_first(tmp_path):
    job = Job.finished(tmp_path, "gloo-rank", str(tmp_path))
    r0, r1 = job.result(0), job.result(1)
    for r in (r0, r1):  # every rank gets the error, naming both fingerprints
        assert "0000000000000000" in r["error"] and "1111111111111111" in r["error"] and "'train'" in r["error"]
        assert not r["tracker_started"]
        assert "rank 1 has local rank 0 of 2" in r["launcher_error"]  # both ranks fail alike, none hangs
    # The attaching rank exited first: the leader still reads its data, no tracker, no warning.
    assert r0["crc"] == r1["crc"] == r0["crc_after_peer_exit"]
    assert "leaked" not in job.log() and "resource_tracker" not in job.log()
    assert shm_names() == set()


def _check_fit(job: Job) -> int:
    """Assertions on a normal 2-rank x 2-worker fit; returns the segment's inode."""
    r = [job.result(0), job.result(1)]
    # One copy: both ranks and all four workers map one and the same segment.
    maps = {tuple(m) for x in r for m in x["maps"]}
    maps |= {tuple(m) for x in r for w in x["worker_maps"] for m in w}
    assert len({inode for inode, _ in maps}) == 1, maps
    assert all(len(x["worker_maps"]) == 2 and all(x["worker_maps"]) for x in r)
    assert all(STORE_BYTES <= size < STORE_BYTES + (1 << 20) for _, size in maps)
    assert r[0]["segment"] == r[1]["segment"] and r[0]["segment"].startswith(shared.prefix())
    assert "shared_memory: on" in r[0]["plan"]
    # Unique memory grows by far less than the store: no rank and no worker holds a copy.
    # (A worker's USS does grow by the shared pages that it alone has read so far.)
    for x in r:
        assert x["uss_after_setup"] - x["uss_setup"] < STORE_BYTES / 8, (x["uss_setup"], x["uss_after_setup"])
        assert all(end - init < STORE_BYTES / 3 for end, init in x["worker_uss"]), x["worker_uss"]
    # Identical bytes on both ranks and equal to the source; shards disjoint and complete.
    assert r[0]["field_crcs"] == r[1]["field_crcs"]
    ds = IndexedImages(N)
    for x in r:
        for i, crc in list(zip(x["indices"], x["crcs"], strict=True))[::61]:
            assert zlib.crc32(ds[i][0].numpy().tobytes()) == crc
    assert not set(r[0]["indices"]) & set(r[1]["indices"])
    assert sorted(r[0]["indices"] + r[1]["indices"]) == list(range(N))
    return maps.pop()[0]


def test_ddp_fit_one_copy_per_node_and_two_jobs_apart(tmp_path, fit_cache):
    """Two 2-rank jobs x 2 workers per rank on the same dataset at once; the second raises in training_step."""
    ok = Job(tmp_path / "ok", "fit-rank", fit_cache, str(tmp_path / "ok"), "normal", str(N))
    boom = Job(tmp_path / "boom", "fit-rank", fit_cache, str(tmp_path / "boom"), "raise", str(N))
    try:
        assert ok.wait(300) == [0, 0], ok.log()
        codes = boom.wait(300)
    finally:
        for job in (ok, boom):
            job.reap()
    assert all(c != 0 for c in codes) and "boom in training_step" in boom.log(), (codes, boom.log())
    assert shm_names() == set()
    inode = _check_fit(ok)
    theirs = {m[0] for r in range(2) for m in boom.result(r)["setup_maps"]}
    assert len(theirs) == 1 and inode not in theirs  # separate segments...
    assert ok.result(0)["segment"] != boom.result(0)["segment"]  # ...named apart


def test_ddp_sigterm_of_the_job_and_sigkill_of_a_rank_mid_epoch(tmp_path, fit_cache):
    jobs = {how: Job(tmp_path / how, "fit-rank", fit_cache, str(tmp_path / how), "slow", str(N))
            for how in ("sigterm", "sigkill")}
    try:
        deadline = time.monotonic() + 240
        for how, job in jobs.items():
            while not all((job.out / f"rank{r}.mid").exists() for r in range(2)):
                assert time.monotonic() < deadline and all(p.poll() is None for p in job.procs), job.log()
                time.sleep(0.1)
            if how == "sigterm":
                os.killpg(job.pgid, signal.SIGTERM)
            else:
                job.procs[1].send_signal(signal.SIGKILL)
        assert jobs["sigkill"].procs[1].wait(timeout=30) == -signal.SIGKILL
        for job in jobs.values():
            try:
                job.wait(60)
            except subprocess.TimeoutExpired:
                pass  # a rank blocked on its dead peer: killed below, as a scheduler would
    finally:
        for job in jobs.values():
            job.reap(grace=5)
    assert shm_names() == set()


def test_device_strategy_ranks_share_one_copy_of_the_encoded_bytes(tmp_path):
    """Two local ranks placing a JPEG store with the ``device`` strategy: the encoded bytes, which
    stay in host memory for the decoders, are one segment in /dev/shm mapped by both ranks (not
    a private copy each); both read the store's bytes, and nothing is left in /dev/shm."""
    job = Job.finished(tmp_path, "device-jpeg-rank", str(tmp_path))
    r0, r1 = job.result(0), job.result(1)
    for r in (r0, r1):
        assert r["segments"] == ["train"] and not r["private"], r
        assert r["reason"].startswith("on: one copy of the encoded bytes of train") and "2 local rank(s)" in r["reason"]
        assert r["crc"] == r["want"]
    inodes = {inode for inode, _ in r0["maps"]}
    assert inodes and inodes == {inode for inode, _ in r1["maps"]}  # the same segment in both ranks
    assert not shm_names()


def test_device_strategy_ranks_too_big_for_dev_shm_keep_private_copies_and_say_so(tmp_path):
    """Where /dev/shm cannot hold the encoded bytes, every rank keeps a private copy (not the
    disk cache, as for the host-read strategies): the plan and the warning say that."""
    job = Job.finished(tmp_path, "device-jpeg-rank", str(tmp_path), "tiny")
    r0, r1 = job.result(0), job.result(1)
    for r in (r0, r1):
        assert r["segments"] == [] and r["private"] and r["crc"] == r["want"], r
        assert r["reason"].startswith("fallback to a private copy of the encoded bytes per rank: "), r["reason"]
    assert any("falling back to a private copy of the encoded bytes per rank" in w for w in r0["warnings"])
    assert not shm_names()
