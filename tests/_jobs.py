"""Multi-process jobs for the tests: each in its own process group, reaped with a timeout."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from lightning_fastdata import shared

#: Launcher variables a child must not inherit from the test process.
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
             "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_PROCID")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_names() -> set[str]:
    """This test session's segments in /dev/shm."""
    return {n for n in os.listdir(shared.SHM_DIR) if n.startswith(shared.prefix())}


class Launch:
    """Processes of one job in their own process group (led by an idle anchor), logs in ``out``."""

    def __init__(self, out: Path, commands: list[tuple[list[str], dict[str, str]]]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        # A short private TMPDIR: AF_UNIX paths (gloo, multiprocessing) are limited to 107 bytes.
        self.tmp = tempfile.mkdtemp(prefix="lfdl-", dir="/tmp")
        self.anchor = subprocess.Popen(["sleep", "900"], process_group=0)
        self.pgid = self.anchor.pid
        base = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
        base.update(TMPDIR=self.tmp, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
        self.procs: list[subprocess.Popen] = []
        for k, (argv, env) in enumerate(commands):
            with open(out / f"proc{k}.log", "w") as log:
                self.procs.append(subprocess.Popen(argv, env=dict(base, **env), stdout=log, stderr=subprocess.STDOUT,
                                                   process_group=self.pgid))

    def wait(self, timeout: float) -> list[int]:
        """Exit codes; raises ``TimeoutExpired`` past ``timeout`` (then :meth:`reap` kills the rest)."""
        deadline = time.monotonic() + timeout
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.procs]

    def _members(self) -> list[int]:
        out = []
        for p in psutil.process_iter(["pid", "status"]):
            try:
                if p.pid != self.pgid and os.getpgid(p.pid) == self.pgid and p.info["status"] != "zombie":
                    out.append(p.pid)
            except (ProcessLookupError, psutil.Error):
                continue
        return out

    def reap(self, grace: float = 20.0) -> None:
        """Give stragglers (workers, spawned ranks) ``grace`` seconds, kill the group, clean up."""
        deadline = time.monotonic() + grace
        while self._members() and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(self.pgid, signal.SIGKILL)  # the unreaped anchor keeps this group id ours until now
        for p in (*self.procs, self.anchor):
            p.wait(timeout=30)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def log(self) -> str:
        return "\n".join((self.out / f"proc{k}.log").read_text()[-4000:] for k in range(len(self.procs)))
