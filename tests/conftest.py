"""Shared fixtures; every test fails if it leaves a /dev/shm segment or a temporary file behind.

The package's shared-memory names start with ``$LIGHTNING_FASTDATA_SHM_PREFIX``; this
session sets a prefix of its own (and a private ``TMPDIR``) so that concurrent test
sessions on one machine cannot be blamed for each other's files.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

SHM = Path("/dev/shm")
os.environ.setdefault("LIGHTNING_FASTDATA_SHM_PREFIX", f"lfdt{os.getpid()}_")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
_TMP = Path(tempfile.mkdtemp(prefix=f"lfd-pytest-{os.getpid()}-"))
os.environ["TMPDIR"] = str(_TMP)
tempfile.tempdir = str(_TMP)
# Child processes started by tests import the package from this checkout.
_ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)


def _shm() -> set[str]:
    prefix = os.environ["LIGHTNING_FASTDATA_SHM_PREFIX"]
    return {p.name for p in SHM.glob(f"{prefix}*")} if SHM.is_dir() else set()


def _tmp() -> set[str]:
    # ompi.*: Open MPI's session files, made when Lightning probes for MPI through mpi4py (where it
    # is installed) and kept until the test process exits; not ours to clean.
    return {p.name for p in _TMP.iterdir() if not p.name.startswith(("pytest-of-", "ompi."))}


def _terminated_worker_dir(name: str) -> bool:
    """A pymp-* folder holding only multiprocessing's resource-sharer sockets (listener-*), still
    there after the wait: multiprocessing's own per-process folder, made when a process first
    hands a file descriptor to another (tensors sent to or from DataLoader workers). A worker
    terminated by torch's shutdown timeout (slow to exit with both cores busy) never removes
    its folder: removed here. This process's own stays until it exits: not the test's doing."""
    import multiprocessing

    p = _TMP / name
    if not name.startswith("pymp-") or not p.is_dir():
        return False
    entries = list(p.iterdir())
    if not entries or not all(e.name.startswith("listener-") for e in entries):
        return False
    own = multiprocessing.current_process()._config.get("tempdir")
    if own is not None and Path(own) == p:
        return True  # in use by this process until it exits (pytest_sessionfinish removes _TMP)
    for e in entries:
        e.unlink(missing_ok=True)
    p.rmdir()
    return True


def _leftover_temporaries(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return [str(p) for p in root.rglob(".tmp-*")]


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Fail the test if it leaves shared-memory segments, TMPDIR files or cache temporaries."""
    shm0, tmp0 = _shm(), _tmp()
    yield
    # Children may still be unwinding: a DataLoader worker removes its pymp-* folder as it exits,
    # which took over 5 s once with both cores busy. A clean test never waits.
    deadline = time.monotonic() + 20.0
    while True:
        shm, tmp = _shm() - shm0, _tmp() - tmp0
        tmp_path = request.node.funcargs.get("tmp_path")
        partial = _leftover_temporaries(tmp_path) if tmp_path is not None else []
        if not (shm or tmp or partial) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    tmp = {name for name in tmp if not _terminated_worker_dir(name)}
    problems = []
    if shm:
        problems.append(f"/dev/shm segments left behind: {sorted(shm)}")
    if tmp:
        problems.append(f"temporary files left behind in {_TMP}: {sorted(tmp)}")
    if partial:
        problems.append(f"cache temporaries left behind: {partial}")
    if problems:
        for name in shm:
            (SHM / name).unlink(missing_ok=True)
        pytest.fail("; ".join(problems), pytrace=False)


@pytest.fixture
def cache_dir(tmp_path) -> Path:
    """A fresh cache directory."""
    return tmp_path / "cache"


def pytest_sessionfinish(session, exitstatus):
    import shutil

    shutil.rmtree(_TMP, ignore_errors=True)
