"""File locks around the on-disk cache: one builder per cache, and leases held by its readers.

:class:`BuildLock`
    An exclusive lock (``filelock``) on building one cache, shared by every process and
    node that sees the lock file. The holder writes an owner file (host, pid, what,
    since) beside it and touches it every :data:`HEARTBEAT_S`; a waiter that sees the
    owner file unchanged for :data:`STALE_S`, by its own clock (no comparison of clocks
    across hosts), takes the holder for dead and fails with a message naming the lock
    file and the holder. On a local filesystem the kernel releases a dead holder's lock
    at once (the waiter then builds); a stale lock is a hung process, or a dead node
    holding a lock on a network filesystem.
:class:`ReaderLease`
    A shared ``flock`` on a cache's ``.readers`` file, held while the cache is open.
    ``flock`` locks belong to the open file: forked DataLoader workers share the
    parent's, and the kernel drops it when the last process holding it exits, however it
    exits, so a lease is never stale and needs no pid bookkeeping. Pruning takes the
    same lock exclusively and without waiting: it fails while any reader holds a lease.
:func:`hold` / :func:`held`
    A build's temporary directory holds a file locked by its builder for the whole
    build; a sweep removes the directory only when it can take that lock. The lock is
    the kernel's, so it tells a live builder from a dead one whatever PID namespace
    either runs in (a pid in a name cannot: containers sharing a hostname reuse pids).
:class:`Heartbeat`
    Touches a path every :data:`HEARTBEAT_S` from a daemon thread: the build lock's owner
    file, and a build's temporary directory (whose age the sweep of other hosts judges).

This module imports nothing from the package but ``_util``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from lightning_fastdata._util import pid_alive

#: Seconds a waiter polls the build lock between checks on its holder.
POLL_S = 0.5
#: Seconds between touches of the owner file by the lock's holder.
HEARTBEAT_S = 5.0
#: Seconds without a touch after which a waiter declares the holder dead.
STALE_S = 120.0


class LockTimeout(RuntimeError):
    """The build lock stayed held by a process that shows no sign of life, or longer than allowed."""


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def read_owner(owner: Path) -> dict[str, Any]:
    """The holder's record (host, pid, what, since), or ``{}``."""
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads(owner.read_text())
        if isinstance(doc, dict):
            return doc
    return {}


class Heartbeat:
    """Touch ``path`` every :data:`HEARTBEAT_S` from a daemon thread, between :meth:`start` and :meth:`stop`.

    Another process, one that cannot see whether the toucher is alive (it runs on another
    host), reads the path's modification time as its last sign of life. A touch that
    fails (the path is gone or renamed) is ignored: the next one tries again.

    Args:
        path: The file or directory to touch.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        """Start touching; returns ``self``."""
        self._thread = threading.Thread(target=self._run, name="fastdata-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def stop(self) -> None:
        """Stop touching, and wait for the thread (at most one touch in flight)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class BuildLock:
    """Context manager: hold the build lock at ``path`` (see the module docstring).

    Args:
        path: The lock file.
        what: What is built, for the owner file and messages.
        timeout_s: Longest wait, ``None`` for as long as the holder shows signs of life.
    """

    def __init__(self, path: Path, what: str, timeout_s: float | None = None) -> None:
        import filelock

        self.path, self.what, self.timeout_s = Path(path), what, timeout_s
        self.owner = self.path.with_name(self.path.name + ".owner")
        self._lock = filelock.FileLock(str(self.path))
        self._timeout_type = filelock.Timeout
        self._beat: Heartbeat | None = None

    def __enter__(self) -> BuildLock:
        start = last_change = time.monotonic()
        seen = _stamp(self.owner)
        while True:
            try:
                self._lock.acquire(timeout=POLL_S)
                break
            except self._timeout_type:
                pass
            now = time.monotonic()
            stamp = _stamp(self.owner)
            if stamp != seen:
                seen, last_change = stamp, now
            elif now - last_change > STALE_S:
                raise LockTimeout(self._holder_message(
                    f"no sign of life from the holder for {now - last_change:.0f} s (its owner file was not touched)"))
            if self.timeout_s is not None and now - start > self.timeout_s:
                raise LockTimeout(self._holder_message(f"still held after {now - start:.0f} s"))
        try:
            self._write_owner()
            self._beat = Heartbeat(self.owner).start()
        except BaseException:
            self._lock.release()
            raise
        return self

    def _write_owner(self) -> None:
        doc = {"host": socket.gethostname(), "pid": os.getpid(), "what": self.what,
               "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        with contextlib.suppress(OSError):  # without it waiters only lose the holder's name
            fd = os.open(self.owner, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)

    def __exit__(self, *exc: Any) -> None:
        if self._beat is not None:
            self._beat.stop()
        with contextlib.suppress(OSError):
            os.unlink(self.owner)
        self._lock.release()

    def _holder_message(self, why: str) -> str:
        doc = read_owner(self.owner)
        if doc:
            holder = (f"pid {doc.get('pid')} on host {doc.get('host')} (building {doc.get('what')} "
                      f"since {doc.get('since')})")
            if doc.get("host") == socket.gethostname() and isinstance(doc.get("pid"), int):
                holder += ", which is " + ("still running" if pid_alive(doc["pid"]) else "not running any more")
        else:
            holder = "an unknown process (no owner file)"
        return (f"timed out waiting to build {self.what}: the build lock {self.path} is held by {holder}; {why}. "
                f"If that process is gone (a dead node holding a lock on a network filesystem), delete {self.path} "
                f"and {self.owner} and rerun.")


def try_lock(path: Path) -> Any:
    """The build lock at ``path`` if it is free now (a ``filelock`` object to release), else ``None``."""
    import filelock

    lock = filelock.FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        return None
    return lock


class ReaderLease:
    """A shared lock on a cache's readers file, released by :meth:`close` or garbage collection.

    It pickles as an empty lease: a spawned process holds none (its parent does).
    """

    def __init__(self, fd: int | None = None) -> None:
        self.fd = fd

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        self.close()

    def __reduce__(self) -> Any:
        return (ReaderLease, ())


class LeaseGone(RuntimeError):
    """The readers file was removed (its cache pruned) while a lease was being taken."""


def take_lease(file: Path) -> ReaderLease:
    """Lock ``file`` shared (created 0600 if missing).

    An unlockable file (a read-only cache of another user, a filesystem without
    ``flock``) gives an empty lease: the cache is still read, pruning just cannot see it.

    Raises:
        LeaseGone: ``file`` was unlinked meanwhile (a prune removed the cache).
    """
    try:
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        try:
            fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return ReaderLease()
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a prune holds it exclusively only for one rename
        same = os.path.samestat(os.fstat(fd), os.lstat(file))
    except FileNotFoundError:
        same = False
    except OSError:
        os.close(fd)
        return ReaderLease()
    if not same:
        os.close(fd)
        raise LeaseGone(f"{file} was removed while a lease was being taken")
    return ReaderLease(fd)


def busy(file: Path) -> bool:
    """Whether some process holds a lock on ``file`` (probed with a non-blocking exclusive lock)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def hold(file: Path) -> int:
    """Create ``file`` owner-only, locked exclusively from before its name exists; returns the descriptor.

    The lock lasts while the descriptor is open (and in forked children that inherit it).
    The file is locked under a staging name and renamed into place, so no process ever
    finds ``file`` unlocked while its holder runs. Where ``flock`` is unsupported the file
    is still created; :func:`held` then cannot tell, and the caller falls back to other signs.
    """
    staged = file.with_name(file.name + ".new")
    fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with contextlib.suppress(OSError):  # no flock here (ENOLCK, EOPNOTSUPP): see above
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(staged, file)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise
    return fd


def held(file: Path) -> bool | None:
    """Whether a live process holds a lock on ``file``; ``None`` when there is no such file or
    ``flock`` cannot tell (a filesystem without it)."""
    try:
        # read-write where we can: NFS emulates flock with byte-range locks, whose exclusive
        # form needs a descriptor open for writing
        fd = os.open(file, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        try:
            fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)
    return False


@contextlib.contextmanager
def exclusive(file: Path) -> Any:
    """Yield True while holding ``file`` exclusively (created if missing), False if a reader holds it."""
    fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
