"""Node-local shared memory: one copy of a store per node, read by every rank and worker.

The node's local rank 0 (the leader) creates one segment per store in ``/dev/shm``
(exclusively, owner-only, never through a symlink), reserves its size with
``posix_fallocate`` (so a full ``/dev/shm`` is an error up front, never a SIGBUS later),
copies the store in and sets a ready flag, all while the segment has no name
(``O_TMPFILE``): a leader killed while copying leaves nothing. Only then does it link
the names. The other local ranks attach read-only and verify the header (magic, format
version, job token, fingerprint, size, layout, ready). Once every local rank has
attached, the leader unlinks the names: the memory lives exactly as long as some process
maps it, so nothing outlives the job. DataLoader workers read the same pages: forked ones
inherit the mapping; spawned ones receive a duplicate of the file descriptor when the
dataset is pickled (:class:`SharedArray`). A segment left by a leader killed between
linking and unlinking (or while copying, where segments must be created by name: no
``O_TMPFILE``, no ``/proc``) is removed by the sweep at the next start. The leader holds a
shared ``flock`` on each segment from before its name exists, and the sweep removes only a
segment it can lock exclusively: the pid in a name means nothing to a job in another PID
namespace sharing ``/dev/shm`` (containers with ``--ipc=host``).

Python's ``multiprocessing.shared_memory`` is not used: its resource tracker unlinks a
segment when the first attaching process exits and warns about "leaked" segments.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import secrets
import signal
import stat
import struct
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_fastdata import _lightning as door
from lightning_fastdata import distributed as D
from lightning_fastdata._util import fmt_bytes, pid_alive
from lightning_fastdata.ragged import RaggedArray
from lightning_fastdata.store import Store

#: Where segments live (a tmpfs on Linux).
SHM_DIR = Path("/dev/shm")
MAGIC = b"LFDSHM\x00\x01"
#: 2: the layout lists parts (a ragged field's values, offsets, shapes), not fields.
VERSION = 2
#: Header: magic, version, ready, total size, owner pid, owner start time, token,
#: fingerprint, layout length; the JSON layout follows.
_HEAD = struct.Struct("<8sIIQQQ16s64sI")
_READY_OFFSET = 12
_ALIGN = 4096
_COPY_BLOCK = 32 << 20
#: Minimum free space kept beyond the store for DataLoader batches in flight.
MIN_HEADROOM = 16 << 20


class SharedMemoryError(RuntimeError):
    """Shared memory cannot hold the store, or a segment failed verification."""


def prefix() -> str:
    """The name prefix of this package's segments (``$LIGHTNING_FASTDATA_SHM_PREFIX``, ``lfd_``)."""
    return os.environ.get("LIGHTNING_FASTDATA_SHM_PREFIX", "lfd_")


def shm_free_bytes() -> int:
    """Free bytes in ``/dev/shm`` for this user (0 when there is none)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return int(st.f_bavail * st.f_frsize)


def worker_headroom(batch_nbytes: int, num_workers: int, prefetch_factor: int | None,
                    local_world_size: int) -> int:
    """Space DataLoader workers need in ``/dev/shm`` for the batches they send to their rank."""
    if num_workers <= 0:
        return MIN_HEADROOM
    ranks = max(1, local_world_size)
    in_flight = num_workers * (prefetch_factor or 2) * ranks
    # Each rank also holds the batch in use and the next epoch's first (plan.SHM_EXTRA_BATCHES).
    return MIN_HEADROOM + (2 * in_flight + 2 * ranks) * max(0, batch_nbytes)


def too_small_message(needed: int, free: int, store_nbytes: int, refused: str | None = None,
                      falling_back: bool = False) -> str:
    """The error text for a ``/dev/shm`` that cannot hold the stores; ``refused``: the kernel's
    reason when it refused space that ``/dev/shm`` reports free (a tmpfs size or inode limit, a
    quota, a container's memory limit); ``falling_back``: the caller falls back to the disk
    cache already (``shared_memory='auto'``), so the text does not suggest it."""
    if refused is not None:
        head = (f"lightning_fastdata: the kernel refused {refused}, although /dev/shm reports "
                f"{fmt_bytes(free)} free: a size or inode limit of the tmpfs, a quota or the container's "
                f"memory limit caps it below that. One shared copy of the stores needs {fmt_bytes(needed)} "
                f"({fmt_bytes(store_nbytes)} of data plus {fmt_bytes(needed - store_nbytes)} of headroom). ")
    else:
        head = (f"lightning_fastdata: /dev/shm has {fmt_bytes(free)} free, one shared copy of the stores "
                f"needs {fmt_bytes(needed)} ({fmt_bytes(store_nbytes)} of data plus "
                f"{fmt_bytes(needed - store_nbytes)} of headroom for batches in flight). ")
    fix = (f"Enlarge /dev/shm (Docker: --shm-size={_suggest(needed)}; Kubernetes: an emptyDir volume "
           "with medium: Memory mounted at /dev/shm)")
    if falling_back:
        return head + fix + ", or pass shared_memory='off' to go without this attempt"
    return (head + fix + ", or pass shared_memory='auto' to fall back to the memory-mapped disk cache, "
            "or shared_memory='off'")


def _suggest(needed: int) -> str:
    gib = 1 << 30
    return f"{-(-needed // gib)}g" if needed >= gib else f"{-(-needed // (1 << 20)) + 64}m"


# --------------------------------------------------------------------------- process identity


def _start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (0 if unknown): tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return 0
    # The command name may contain spaces and parentheses: fields start after the last ')'.
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return 0


def _alive(pid: int, start: int) -> bool:
    """Alive and the same process: a reused pid has another start time."""
    return pid_alive(pid) and (not start or _start_time(pid) in (0, start))


# --------------------------------------------------------------------------- layout


def _parts(store: Store) -> list[tuple[int, str, str | None, np.ndarray]]:
    """``(field, role, encoding, array)`` of every array of the store: a fixed field is one
    (role ``data``), a ragged field three or four (values, offsets, shapes, decoded)."""
    out: list[tuple[int, str, str | None, np.ndarray]] = []
    for k, f in enumerate(store.fields):
        if isinstance(f, RaggedArray):
            out.extend((k, role, f.encoding, arr) for role, arr in f.parts().items())
        else:
            out.append((k, "data", None, f))
    return out


def _layout(store: Store) -> list[dict[str, Any]]:
    """Where each part of ``store`` lives in its segment: after the header, page-aligned.

    The header holds the layout itself (about 100 bytes a part), so its region grows with
    the number of fields: one page, or as many as the layout takes (found in a few rounds,
    as the offsets' digits lengthen the layout they are written in).
    """
    parts = _parts(store)
    start = _ALIGN
    while True:
        out, offset = [], start
        for k, role, encoding, arr in parts:
            nbytes = int(arr.nbytes)
            entry = {"field": k, "role": role, "dtype": arr.dtype.str, "shape": list(arr.shape), "offset": offset,
                     "nbytes": nbytes}
            if role != "data":
                entry["encoding"] = encoding
            out.append(entry)
            offset += -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        need = _HEAD.size + len(json.dumps(out, sort_keys=True).encode())
        if need <= start:
            return out
        start = -(-need // _ALIGN) * _ALIGN


def _segment_size(layout: list[dict[str, Any]]) -> int:
    last = layout[-1]
    return last["offset"] + -(-max(last["nbytes"], 1) // _ALIGN) * _ALIGN



# --------------------------------------------------------------------------- the segment


class SharedArray(np.ndarray):
    """A field array backed by a shared segment; pickled for a spawned process as a file descriptor.

    Only the array :class:`Segment` creates carries the segment: anything derived from it
    (slices, gathered batches) is an ordinary array and pickles by value.
    """

    _lfd_segment: Segment | None = None
    _lfd_index: int = -1

    def __array_finalize__(self, obj: Any) -> None:
        self._lfd_segment = None
        self._lfd_index = -1

    def __reduce_ex__(self, protocol: Any) -> Any:
        seg = self._lfd_segment
        if seg is None or seg.closed or not door.pickling_for_process_start():
            # Not a process start (e.g. torch.save): keep ndarray's by-value pickling.
            return np.asarray(self).__reduce_ex__(protocol)
        return _field, (seg.handle, self._lfd_index)


class _Handle:
    """What a spawned process receives for a segment: a duplicated descriptor and the header's facts.

    All fields of a segment share one handle object, so pickle memoises it and the
    descriptor crosses once per process start. It copies the segment's facts rather than
    pointing back at it: a cycle would keep the mapping (the whole store) until a garbage
    collection.
    """

    def __init__(self, seg: Segment) -> None:
        self.facts = (seg.fd, seg.name, seg.size, seg.token, seg.fingerprint, seg.layout)

    def __reduce__(self) -> Any:
        from multiprocessing.reduction import DupFd

        fd, *rest = self.facts
        return _attach_handle, (DupFd(fd), *rest)


def _field(mm: mmap.mmap, index: int) -> np.ndarray:
    return _view(mm, json.loads(bytes(mm[_HEAD.size:_HEAD.size + _HEAD.unpack_from(mm, 0)[-1]]))[index])


#: Segments attached by spawned processes, by segment name: one mapping per segment and
#: process, not per field. Not by token: every split of one job shares its token.
_ATTACHED: dict[str, mmap.mmap] = {}
_ATTACHED_LOCK = threading.Lock()


def _attach_handle(dupfd: Any, name: str, size: int, token: str, fp: str,
                   layout: list[dict[str, Any]]) -> mmap.mmap:
    """Map a segment in a spawned process from a duplicated descriptor (no copy of the data)."""
    fd = dupfd.detach()
    where = f"segment {name} in a spawned process"
    try:
        with _ATTACHED_LOCK:
            mm = _ATTACHED.get(name)
            if mm is None:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                try:
                    _verify(mm, size, token, fp, layout, where=where)
                except BaseException:
                    mm.close()
                    raise
                _ATTACHED[name] = mm
            else:
                # A cached mapping is checked against this handle too: reading another
                # segment's bytes as this store must fail loudly, never return wrong data.
                _verify(mm, size, token, fp, layout, where=where)
    finally:
        os.close(fd)
    return mm


def _view(mm: mmap.mmap, entry: dict[str, Any]) -> np.ndarray:
    arr = np.frombuffer(mm, dtype=np.dtype(entry["dtype"]), count=int(np.prod(entry["shape"], dtype=np.int64)),
                        offset=entry["offset"]).reshape(entry["shape"])
    arr.flags.writeable = False
    return arr


def _header(size: int, token: str, fp: str, layout: list[dict[str, Any]], ready: int) -> bytes:
    body = json.dumps(layout, sort_keys=True).encode()
    head = _HEAD.pack(MAGIC, VERSION, ready, size, os.getpid(), _start_time(os.getpid()),
                      token.encode(), fp.encode()[:64], len(body))
    if len(head) + len(body) > layout[0]["offset"]:  # _layout sizes the header region: never here
        raise SharedMemoryError(f"the layout of {len(layout)} parts does not fit the segment's header region")
    return head + body


def _verify(mm: mmap.mmap, size: int, token: str, fp: str, layout: list[dict[str, Any]], where: str) -> None:
    """Check the header before any data is read; the message says what differs."""
    if len(mm) < _HEAD.size:
        raise SharedMemoryError(f"{where}: {len(mm)} bytes, too small for a header")
    magic, version, ready, total, _pid, _start, tok, seg_fp, n = _HEAD.unpack_from(mm, 0)
    problems = []
    if magic != MAGIC:
        problems.append(f"magic {magic!r} is not {MAGIC!r}")
    elif version != VERSION:
        problems.append(f"format version {version}, this release reads {VERSION}")
    else:
        if tok.rstrip(b"\0").decode(errors="replace") != token:
            problems.append("it belongs to another job")
        if seg_fp.rstrip(b"\0").decode(errors="replace") != fp[:64]:
            theirs = seg_fp.rstrip(b"\0").decode(errors="replace")
            problems.append(f"fingerprint {theirs[:16]} is not this rank's {fp[:16]}")
        if total != size or len(mm) != size:
            problems.append(f"size {total} (mapped {len(mm)}), expected {size}")
        got = bytes(mm[_HEAD.size:_HEAD.size + n])
        if got != json.dumps(layout, sort_keys=True).encode():
            problems.append(f"layout {got[:200]!r} differs from this rank's store")
        if ready != 1:
            problems.append("the leader has not finished writing it (ready flag unset)")
    if problems:
        raise SharedMemoryError(f"{where} failed verification: " + "; ".join(problems))


@dataclass
class Segment:
    """One store's shared mapping in this process.

    Attributes:
        name: File name under ``/dev/shm`` (unlinked once every local rank attached).
        fd: Open descriptor of the segment, kept for spawned DataLoader workers.
        size: Segment bytes, header included.
        token: The job's random token (also in the header).
        fingerprint: The store's fingerprint.
        layout: Per array (a field, or one part of a ragged field): field, role, dtype, shape, offset, size.
        named: This process gave the segment its name (the leader), so :meth:`unlink` may remove it.
    """

    name: str
    fd: int
    mm: mmap.mmap
    size: int
    token: str
    fingerprint: str
    layout: list[dict[str, Any]]
    closed: bool = False
    named: bool = False

    def __post_init__(self) -> None:
        self.handle = _Handle(self)
        # A backstop for a segment dropped without release() (a caller that never tears down):
        # its descriptor would hold the whole store in RAM until the process ends.
        self._closer = weakref.finalize(self, _close_fd, self.fd)

    @property
    def path(self) -> Path:
        return SHM_DIR / self.name

    def arrays(self) -> list[np.ndarray | RaggedArray]:
        """Read-only field views of the mapping, pickled as descriptors for spawned workers.

        A ragged field is a :class:`~lightning_fastdata.ragged.RaggedArray` of such views.
        """
        fields: dict[int, dict[str, np.ndarray]] = {}
        encodings: dict[int, str | None] = {}
        for k, entry in enumerate(self.layout):
            arr = _view(self.mm, entry).view(SharedArray)
            arr._lfd_segment, arr._lfd_index = self, k
            fields.setdefault(entry.get("field", k), {})[entry.get("role", "data")] = arr
            encodings[entry.get("field", k)] = entry.get("encoding")
        out: list[np.ndarray | RaggedArray] = []
        for f in sorted(fields):
            parts = fields[f]
            if "data" in parts:
                out.append(parts["data"])
            else:
                out.append(RaggedArray(parts["values"], parts["offsets"], parts["shapes"], encodings[f],
                                       parts.get("decoded")))
        return out

    def publish(self) -> None:
        """Link a nameless segment (filled and ready) to its name, for the other local ranks.

        Raises:
            FileExistsError: the name exists (never followed, never replaced).
        """
        if not self.named:
            _link(self.fd, self.path)
            self.named = True

    def unlink(self) -> None:
        """Remove the name this process gave (the memory stays while mapped); idempotent."""
        if self.named:
            self.named = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def release(self) -> None:
        """Close the descriptor, and the mapping unless a view of :meth:`arrays` still holds it
        (the pages then go with the last view)."""
        if not self.closed:
            self.closed = True
            self._closer()  # closes once: the finalizer is spent
            with contextlib.suppress(BufferError):
                self.mm.close()


def _link(fd: int, path: Path) -> None:
    """Give the nameless file ``fd`` the name ``path``, through its ``/proc/self/fd`` link.

    ``linkat`` must follow that link: ``os.link`` without a directory descriptor calls
    ``link``, which links the ``/proc`` entry itself and fails (EXDEV), so a directory
    descriptor is passed.
    """
    d = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=d, follow_symlinks=True)
    finally:
        os.close(d)


def _close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _segment_name(token: str, split: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-." else "-" for c in split)[:40]
    return f"{prefix()}{os.getpid()}_{token}_{safe}"


def _fill(fd: int, store: Store, layout: list[dict[str, Any]]) -> None:
    """Write the fields into the segment with ``pwrite``.

    The leader never maps the pages it writes, so they count against no process until
    someone reads them; a memmapped field is read with file reads for the same reason.
    """
    for (_, _, _, arr), entry in zip(_parts(store), layout, strict=True):
        off, nbytes = entry["offset"], entry["nbytes"]
        filename = getattr(arr, "filename", None)
        src_off = getattr(arr, "offset", None)
        if filename is not None and src_off is not None and arr.flags.c_contiguous:
            base = src_off + _memmap_view_offset(arr)
            buf = bytearray(min(nbytes, _COPY_BLOCK))
            with open(filename, "rb", buffering=0) as f:
                done = 0
                while done < nbytes:
                    want = min(len(buf), nbytes - done)
                    got = os.preadv(f.fileno(), [memoryview(buf)[:want]], base + done)
                    if not got:
                        raise SharedMemoryError(f"{filename} ended early while copying it to shared memory")
                    _pwrite_all(fd, memoryview(buf)[:got], off + done)
                    done += got
            continue
        flat = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
        for a in range(0, nbytes, _COPY_BLOCK):
            _pwrite_all(fd, flat[a:a + _COPY_BLOCK], off + a)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _memmap_view_offset(arr: np.ndarray) -> int:
    base = arr
    while isinstance(base.base, np.ndarray):
        base = base.base
    return int(arr.__array_interface__["data"][0] - base.__array_interface__["data"][0])


def _open_locked(path: Path) -> tuple[int, bool]:
    """Create the file of segment ``path`` owner-only, holding a shared ``flock`` on it.

    The lock tells :func:`sweep_stale` in any PID namespace that the segment's owner lives
    (the kernel drops it with the owner's last descriptor). Where the kernel allows, the
    file is nameless (``O_TMPFILE``) until :meth:`Segment.publish` links it, filled, to its
    name: a creator killed before then leaves nothing, and no sweep can find it unlocked;
    ``link`` fails on an existing name, symlinks included. Elsewhere it is created by name,
    exclusively.

    Returns:
        The descriptor, and whether ``path`` names the file already.

    Raises:
        FileExistsError: ``path`` exists (when created by name).
    """
    try:
        fd = os.open(path.parent, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except (AttributeError, OSError):
        fd = -1  # no O_TMPFILE here (old kernel, another filesystem): create by name below
    if fd >= 0:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            _probe_link(path)
            return fd, False
        except BaseException as e:
            os.close(fd)
            if not isinstance(e, OSError):
                raise
            # Nameless files cannot be linked here (no /proc, a sandbox's rules): create by
            # name below; the sweep's pid check covers the instant between create and lock
            # in this PID namespace.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)
        raise
    return fd, True


def _probe_link(path: Path) -> None:
    """Link and unlink an empty nameless file beside ``path``: the segment is linked only once
    filled, and a failure must show before that (an empty name a kill leaves goes at a sweep).

    Raises:
        OSError: nameless files cannot be linked here (no ``/proc``, a sandbox's rules).
    """
    fd = os.open(path.parent, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    probe = path.with_name(path.name + "-probe")
    try:
        _link(fd, probe)
        os.unlink(probe)
    finally:
        os.close(fd)


def _create(name: str, size: int, token: str, fp: str, layout: list[dict[str, Any]],
            store: Store, falling_back: bool = False, publish: bool = True) -> Segment:
    """Create, reserve and fill one segment (leader only); nothing is left on any error.

    The descriptor keeps the shared lock of :func:`_open_locked` for the segment's life.
    ``publish=False`` leaves a nameless segment nameless (:meth:`Segment.publish` names it).
    """
    path = SHM_DIR / name
    try:
        fd, named = _open_locked(path)
    except OSError as e:
        # A tmpfs out of inodes (nr_inodes) or a quota refuses the file itself, with bytes free.
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SharedMemoryError(too_small_message(
                size + MIN_HEADROOM, shm_free_bytes(), store.nbytes, refused=f"a new file {name} ({e.strerror})",
                falling_back=falling_back)) from e
        raise
    mm = None
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
                raise SharedMemoryError(too_small_message(
                    size + MIN_HEADROOM, shm_free_bytes(), store.nbytes,
                    refused=f"{fmt_bytes(size)} for {name} ({e.strerror})", falling_back=falling_back)) from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, size)  # a filesystem without fallocate: size only, checked up front
        _pwrite_all(fd, memoryview(_header(size, token, fp, layout, ready=0)), 0)
        _fill(fd, store, layout)
        _pwrite_all(fd, memoryview(struct.pack("<I", 1)), _READY_OFFSET)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        seg = Segment(name, fd, mm, size, token, fp, layout, named=named)
    except BaseException:
        if named:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if mm is not None:
            mm.close()
        os.close(fd)
        raise
    if publish:
        try:
            seg.publish()
        except BaseException:
            seg.release()  # a FileExistsError: the name is another's, so it stays
            raise
    return seg


def _attach(name: str, size: int, token: str, fp: str, layout: list[dict[str, Any]]) -> Segment:
    """Open a leader's segment read-only and verify it (non-leader local ranks)."""
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise SharedMemoryError(f"cannot open the leader's segment {path}: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise SharedMemoryError(
                f"{path} is not a private regular file of this user (mode {oct(st.st_mode)}, "
                f"uid {st.st_uid}); refusing to read it"
            )
        if st.st_size != size:
            raise SharedMemoryError(f"{path} has {st.st_size} bytes, expected {size}")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        try:
            _verify(mm, size, token, fp, layout, where=str(path))
        except BaseException:
            mm.close()
            raise
        return Segment(name, fd, mm, size, token, fp, layout)
    except BaseException:
        os.close(fd)
        raise


# --------------------------------------------------------------------------- sweep


def _lock_exclusive(fd: int) -> bool:
    """Whether ``fd``'s file can be locked exclusively now, i.e. no process holds its shared lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held (EWOULDBLOCK), or locks unsupported: keep the file
    return True


def sweep_stale(directory: Path | None = None) -> list[str]:
    """Remove this package's segments (this prefix, this user) whose creating process is dead.

    A segment goes only when no process holds its lock (see :func:`_open_locked`), which
    holds across PID namespaces, and the pid in its name is not alive here either. The pid
    alone never suffices: another container's live leader has a pid meaningless here.
    """
    directory = directory or SHM_DIR
    removed: list[str] = []
    p = prefix()
    try:
        names = [n for n in os.listdir(directory) if n.startswith(p)]
    except OSError:
        return removed
    for name in names:
        path = directory / name
        pid_part = name[len(p):].split("_", 1)[0]
        if not pid_part.isdigit():
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or not _lock_exclusive(fd):
                continue
            raw = os.pread(fd, _HEAD.size, 0)
            start = 0
            if len(raw) == _HEAD.size and raw[:8] == MAGIC:
                start = _HEAD.unpack(raw)[5]
            # Unlocked but its pid lives here: a creator between create and lock (no
            # O_TMPFILE), or one of a release without locks; both keep their segment.
            if _alive(int(pid_part), start):
                continue
            # Unlink only the file that was locked (unlinking while holding the lock).
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            removed.append(name)
        finally:
            os.close(fd)
    return removed


# --------------------------------------------------------------------------- the collective


@contextlib.contextmanager
def _unlink_on_sigterm(paths: list[Path]) -> Any:
    """While names exist, SIGTERM unlinks them, then terminates as the signal would have."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _discard(segments: Iterable[Segment]) -> None:
    """Close the descriptors and mappings of segments that no caller receives."""
    for seg in segments:
        seg.release()  # no view of it was handed out: its mapping closes too


def _node_ranks(rank: int, local_rank: int, local_world_size: int) -> tuple[int, list[int]]:
    """The node's leader and members, assuming launchers number a node's ranks contiguously."""
    leader = rank - local_rank
    return leader, list(range(leader, leader + local_world_size))


#: What the host-read strategies read when /dev/shm cannot hold a store.
_DISK_CACHE = "the memory-mapped disk cache (one page-cache copy per node)"


def share_stores(
    stores: Mapping[str, Store],
    *,
    headroom: int = MIN_HEADROOM,
    fallback: bool = False,
    warn: Callable[[str], None] | None = None,
    rank: int | None = None,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    fallback_to: str | None = None,
) -> dict[str, Segment]:
    """Put one copy of each store in node-local shared memory; collective over all ranks.

    Every rank calls this with its own stores (same splits, same fingerprints); the stores
    are not modified. On return, each segment's :meth:`Segment.arrays` are read-only views
    of one copy of the store's fields, and the names are gone from ``/dev/shm``.

    Args:
        stores: Stores by split name.
        headroom: Extra free bytes ``/dev/shm`` must keep (DataLoader batches in flight,
            see :func:`worker_headroom`).
        fallback: When ``/dev/shm`` is too small, warn and return ``{}`` (the stores keep
            their disk memory maps) instead of raising.
        warn: Receives the fallback warning (default ``warnings.warn``).
        fallback_to: What the caller reads instead after a fallback, for the warning
            (default: the memory-mapped disk cache).
        rank, local_rank, local_world_size: This process's place (default: from
            :mod:`~lightning_fastdata.distributed`).

    Raises:
        SharedMemoryError: on every rank, when the fingerprints of the ranks differ, when
            ``/dev/shm`` is too small (without ``fallback``) or when a segment fails
            verification; nothing is left in ``/dev/shm``.
    """
    rank = D.rank() if rank is None else rank
    local_rank = D.local_rank() if local_rank is None else local_rank
    local_world_size = D.local_world_size() if local_world_size is None else local_world_size
    splits = sorted(stores)
    fps = {s: stores[s].fingerprint for s in splits}

    # 1. Every rank must hold the same data: compare fingerprints before touching memory.
    mine = {"fps": fps, "local_rank": local_rank, "local_world_size": local_world_size, "pid": os.getpid()}
    everyone = D.all_gather_object(mine)
    for r, other in enumerate(everyone):
        if other["fps"] != fps:
            for s in sorted(set(fps) | set(other["fps"])):
                a, b = fps.get(s), other["fps"].get(s)
                if a != b:
                    raise SharedMemoryError(
                        f"rank {rank} and rank {r} hold different '{s}' data: fingerprints "
                        f"{(a or 'none')[:16]} and {(b or 'none')[:16]}; every rank must build the "
                        "store from the same source, static_transform and cache_key"
                    )
    # Every rank checks every rank's placement, so a bad launcher setting fails all ranks
    # with the same message instead of leaving the good ones waiting in a collective.
    for r, other in enumerate(everyone):
        lr, lws = other["local_rank"], other.get("local_world_size", local_world_size)
        lead, mem = _node_ranks(r, lr, lws)
        if lead < 0 or mem[-1] >= len(everyone) or everyone[lead]["local_rank"] != 0:
            raise SharedMemoryError(
                f"rank {r} has local rank {lr} of {lws}, which does not match the ranks the launcher "
                "started; set LOCAL_RANK and LOCAL_WORLD_SIZE consistently"
            )
    leader, members = _node_ranks(rank, local_rank, local_world_size)
    layouts = {s: _layout(stores[s]) for s in splits}
    sizes = {s: _segment_size(layouts[s]) for s in splits}
    total = sum(sizes.values())

    # 2. The leader checks the space, creates, reserves, fills and names; names stay until step 4.
    segments: dict[str, Segment] = {}
    kept = False
    try:
        outcome: dict[str, Any] = {"error": None, "short": False, "names": {}, "token": None}
        leading = local_rank == 0
        guard = contextlib.ExitStack()
        try:
            if leading:
                sweep_stale()
                free = shm_free_bytes()
                needed = total + headroom
                data = sum(s.nbytes for s in stores.values())
                if needed > free:
                    outcome.update(error=too_small_message(needed, free, data, falling_back=fallback), short=True)
                else:
                    token = secrets.token_hex(8)
                    outcome["token"] = token
                    names = {s: _segment_name(token, s) for s in splits}
                    guard.enter_context(_unlink_on_sigterm([SHM_DIR / n for n in names.values()]))
                    try:
                        # Every split is filled before any is named: a leader killed while
                        # copying a later split leaves no earlier one behind either.
                        for s in splits:
                            segments[s] = _create(names[s], sizes[s], token, fps[s], layouts[s], stores[s],
                                                  falling_back=fallback, publish=False)
                        for s in splits:
                            segments[s].publish()
                            outcome["names"][s] = names[s]
                    except SharedMemoryError as e:
                        outcome.update(error=str(e), short=True)
                    except OSError as e:
                        outcome.update(error=f"lightning_fastdata: creating a shared-memory segment failed: {e}")
            outcomes = D.all_gather_object(outcome)
            mine_out = outcomes[leader]
            if mine_out["error"] is None and not leading:
                try:
                    for s in splits:
                        segments[s] = _attach(mine_out["names"][s], sizes[s], mine_out["token"], fps[s], layouts[s])
                except (SharedMemoryError, OSError) as e:
                    outcome = {"error": f"rank {rank}: {e}", "short": False}
            # 3. All ranks learn every failure, so nobody waits for a peer that gave up.
            status = D.all_gather_object({"error": outcome["error"] if not leading else None})
        finally:
            # 4. Every local rank has attached (or failed): the names go now, whatever happened.
            for seg in segments.values():
                if leading:
                    seg.unlink()
            guard.close()

        node_error = mine_out["error"] or next((x["error"] for x in status[members[0]:members[-1] + 1]
                                                if x["error"]), None)
        failures = [o for o in outcomes if o["error"]] + [x for x in status if x["error"]]
        fatal = [o["error"] for o in failures if not o.get("short")]
        if fatal or (failures and not fallback):
            raise SharedMemoryError((fatal or [f["error"] for f in failures])[0])
        if node_error:
            # Too little space on this node: the disk cache's memory maps stay in place.
            msg = f"{node_error}; falling back to {fallback_to or _DISK_CACHE}"
            if warn is None:
                import warnings

                warnings.warn(msg, stacklevel=2)
            else:
                warn(msg)
            return {}
        # Another node may have fallen back; this one keeps its segments.
        kept = True
        return segments
    finally:
        if not kept:
            # A fallback, an error or an interrupt: the caller gets no segment, so none may
            # stay held here (an unlinked segment's pages live while a descriptor or a
            # mapping of it does, i.e. until exit).
            _discard(segments.values())
