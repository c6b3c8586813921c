"""Multi-process jobs for the tests: each in its own process group, reaped with a timeout."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import random
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
    """A TCP port free on 127.0.0.1 right now, below the kernel's ephemeral range.

    Between this choice and rank 0 binding its store, a port from ``bind(0)`` can be handed
    to anyone else's ``bind(0)`` (the gloo listeners of a job running beside it, say), and
    a ``connect()`` can draw it as its source port. Neither ever draws a port below the range.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(low, 10001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free TCP port between 10000 and {low} on 127.0.0.1")


def shm_names() -> set[str]:
    """This test session's segments in /dev/shm."""
    return {n for n in os.listdir(shared.SHM_DIR) if n.startswith(shared.prefix())}


class JobTimeout(subprocess.TimeoutExpired):
    """A job ran past its timeout; the message holds its processes' logs and thread stacks."""

    def __init__(self, cmd: list[str], timeout: float, logs: str) -> None:
        super().__init__(cmd, timeout)
        self.logs = logs

    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.logs}"


def dump_stacks_on_signal() -> None:
    """In a job's process: dump every thread's stack to stderr on SIGUSR1 (forked workers inherit it)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


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

    def wait(self, timeout: float, grace: float = 30.0) -> list[int | None]:
        """Exit codes, ``None`` for a process still running ``grace`` seconds after another one failed.

        A rank whose peer died blocks in its next collective until the process-group timeout
        (minutes): waiting for it would only turn a crash into a timeout that hides the crash.
        Past ``timeout`` every process dumps its threads' stacks into its log (SIGUSR1, see
        :func:`dump_stacks_on_signal`) and :class:`JobTimeout` carries the logs.
        :meth:`reap` then kills what is left.
        """
        deadline = time.monotonic() + timeout
        failed_at = None
        while True:
            codes = [p.poll() for p in self.procs]
            now = time.monotonic()
            if all(c is not None for c in codes):
                return codes
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if failed_at is not None and now - failed_at > grace:
                self._dump_stacks()  # where the survivors are stuck, for the failure's log
                return codes
            if now > deadline:
                self._dump_stacks()
                raise JobTimeout(self.procs[0].args, timeout, self.log(8000))
            time.sleep(0.1)

    def _dump_stacks(self) -> None:
        """SIGUSR1 to every live process of the job, then a moment for the stacks to reach the logs."""
        for pid in self._members():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(3.0)

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

    def log(self, tail: int = 4000) -> str:
        """The last ``tail`` characters of each process's output."""
        return "\n".join(f"--- process {k} ---\n" + (self.out / f"proc{k}.log").read_text(errors="replace")[-tail:]
                         for k in range(len(self.procs)))
