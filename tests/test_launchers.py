"""One copy per node under every launcher: Lightning's ``ddp_spawn``, torchrun, and several nodes.

Each test runs a real 2-rank CPU fit (gloo on 127.0.0.1) of ``tests/_launcher_job.py``
with the ``workers`` strategy and one DataLoader worker per rank, then reads what every
rank recorded: the plan's shared-memory reason, the segment (inode) that the rank and
its worker mapped, and checksums of what they read. Two nodes are simulated on this
host by two ranks with LOCAL_RANK=0, LOCAL_WORLD_SIZE=1 and NODE_RANK 0 and 1: each
must lead and map a segment of its own.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import _jobs
import pytest
from _jobs import free_port, shm_names
from _shared_job import IndexedImages

from lightning_fastdata import shared
from lightning_fastdata.store import build_store

JOB = str(Path(__file__).parent / "_launcher_job.py")
N = 1024  # 16 KiB samples: a 16 MiB store
STORE_BYTES = N * 4 * 64 * 64
TIMEOUT = 240  # seconds per job, generous for a busy 2-core machine; a job takes ~30 s
pytestmark = pytest.mark.slow


class Launch(_jobs.Launch):
    """A launcher job whose ranks record what they mapped and read."""

    def run(self, timeout: float = TIMEOUT) -> list[dict]:
        """Wait for a clean exit; the two ranks' records, with their workers' mappings."""
        try:
            codes = self.wait(timeout)
        finally:
            self.reap()
        assert codes == [0] * len(codes), self.log()
        records = []
        for rank in range(2):
            rec = json.loads((self.out / f"rank{rank}.json").read_text())
            rec["worker_maps"] = [json.loads(p.read_text()) for p in self.out.glob(f"rank{rank}.worker*.json")]
            records.append(rec)
        return records


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """The 16 MiB training store, built once; the jobs only open it."""
    path = tmp_path_factory.mktemp("launchcache") / "cache"
    build_store(IndexedImages(N), lambda s: s, path, progress=False, num_workers=0)
    return str(path)


def _inodes(rec: dict) -> set[int]:
    """Segments mapped by a rank (at setup and at epoch end) and by its DataLoader workers."""
    maps = [*rec["setup_maps"], *rec["maps"], *(m for w in rec["worker_maps"] for m in w)]
    assert all(STORE_BYTES <= size < STORE_BYTES + (1 << 20) for _, size in maps), maps
    return {inode for inode, _ in maps}


def _led_by(rec: dict, segment: str) -> str:
    """``segment`` if the rank of ``rec`` created it (a segment's name carries its leader's pid)."""
    assert segment.startswith(f"{shared.prefix()}{rec['pid']}_"), (segment, rec["pid"])
    return segment


def _check_common(r: list[dict], local_ranks: int) -> None:
    """Shared memory on for every rank; workers mapped it; identical, correct and disjoint reads."""
    assert [x["global_rank"] for x in r] == [0, 1] and all(x["world_size"] == 2 for x in r)
    for x in r:
        assert x["reason"].startswith("on: one copy of train") and f"{local_ranks} local rank(s)" in x["reason"], x
        assert x["segment"].startswith(shared.prefix()), x["segment"]
        assert x["setup_maps"] and x["maps"], x  # the rank itself reads the segment
        assert len(x["worker_maps"]) == 1 and x["worker_maps"][0], x["worker_maps"]  # and so does its worker
    assert r[0]["field_crcs"] == r[1]["field_crcs"]
    ds = IndexedImages(N)
    for x in r:
        for i, crc in list(zip(x["indices"], x["crcs"], strict=True))[::37]:
            assert zlib.crc32(ds[i][0].numpy().tobytes()) == crc, i
    assert not set(r[0]["indices"]) & set(r[1]["indices"])
    assert sorted(r[0]["indices"] + r[1]["indices"]) == list(range(N))
    assert shm_names() == set()


def test_ddp_spawn_one_copy(tmp_path, cache):
    """``Trainer(strategy="ddp_spawn", devices=2)``: the spawned ranks and their workers share one segment."""
    job = Launch(tmp_path, [([sys.executable, JOB, "spawn", str(tmp_path), cache, str(N)],
                             {"MASTER_PORT": str(free_port())})])
    r = job.run()
    _check_common(r, local_ranks=2)
    assert {x["local_rank"] for x in r} == {0, 1} and all(x["node_rank"] == 0 for x in r)
    assert job.procs[0].pid not in {x["pid"] for x in r}  # the ranks really were spawned
    assert len(_inodes(r[0]) | _inodes(r[1])) == 1
    assert r[0]["segment"] == r[1]["segment"] == _led_by(r[0], r[0]["segment"])  # local rank 0 led


def test_torchrun_one_copy(tmp_path, cache):
    """``torchrun --nproc_per_node=2`` with ``Trainer(strategy="ddp", devices=2)``: one segment."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", JOB, "ddp", str(tmp_path), cache, str(N)]
    job = Launch(tmp_path, [(argv, {})])
    r = job.run()
    _check_common(r, local_ranks=2)
    assert {x["local_rank"] for x in r} == {0, 1} and all(x["node_rank"] == 0 for x in r)
    assert len(_inodes(r[0]) | _inodes(r[1])) == 1
    assert r[0]["segment"] == r[1]["segment"] == _led_by(r[0], r[0]["segment"])  # local rank 0 led


def test_two_nodes_each_lead_their_own_segment(tmp_path, cache):
    """Two simulated nodes of one rank each: both are local rank 0, lead, and map only their own segment."""
    port = str(free_port())
    commands = [([sys.executable, JOB, "nodes", str(tmp_path), cache, str(N)],
                 {"RANK": str(node), "WORLD_SIZE": "2", "NODE_RANK": str(node), "LOCAL_RANK": "0",
                  "LOCAL_WORLD_SIZE": "1", "MASTER_PORT": port}) for node in (0, 1)]
    r = Launch(tmp_path, commands).run()
    _check_common(r, local_ranks=1)
    assert [(x["node_rank"], x["local_rank"]) for x in r] == [(0, 0), (1, 0)]
    mine = [_inodes(x) for x in r]
    assert all(len(m) == 1 for m in mine) and not mine[0] & mine[1], mine
    assert all(x["segment"] == _led_by(x, x["segment"]) for x in r)  # each node's local rank 0 led
