"""The array store: a dataset's static outputs as one contiguous array per field.

A sample (a tensor, number, ndarray, or a tuple/list/dict of those) is flattened into
leaves; leaf ``k`` of every sample becomes row ``i`` of field array ``k``. A field named
in ``ragged`` may change shape from sample to sample: it is kept end to end as a
:class:`~lightning_fastdata.ragged.RaggedArray` (values, offsets, shapes); a field named
in ``encode`` is stored as JPEG bytes, a ragged uint8 field that also records each
image's decoded shape (:mod:`lightning_fastdata.encode`). On disk a store is a directory
of ``.npy`` files and a JSON manifest (format version, N, dtypes, shapes, kinds, ragged
layout and encoding, fingerprint and its components, per-file size and CRC32). It is written
into a private temporary directory and published by one atomic ``rename``, so readers
never see a partial cache, and it is opened as read-only memory maps with
``allow_pickle=False``.

Layout: ``cache_dir/<namespace>/<split>-<fingerprint[:16]>/`` where the namespace is the
data module's qualified class name, so two projects never share (or evict) a cache.
Beside each cache, ``.lock-<split>-<fingerprint[:16]>`` is the build lock: one process
builds while the others wait and reuse; its ``.owner`` file names the holder and is
touched every few seconds, so a waiter can tell a dead holder from a slow one. Inside a
cache, ``.readers`` is locked shared by every process that has the cache open, and
``last_used`` is touched on every open; :func:`lightning_fastdata.caches.prune_caches`
removes only caches whose ``.readers`` it can lock exclusively and whose build lock is
free (:mod:`lightning_fastdata.locks`). A build never deletes a cache with another
fingerprint.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_fastdata import fingerprint as F
from lightning_fastdata import locks
from lightning_fastdata._util import cpu_count, pid_alive
from lightning_fastdata.fill import (
    Layout,
    check_space,
    create_fixed_files,
    field_files,
    fill,
    join_ragged,
    no_room,
    reserve,
)
from lightning_fastdata.ragged import RaggedArray
from lightning_fastdata.structure import (  # the sample structure; its public names stay reachable here
    FieldInfo,
    StoreError,
    UnstorableSampleError,  # noqa: F401
    flatten,
    flatten_like,
    read_sample,
    signature,
    unflatten,  # noqa: F401
    with_kinds,
)

FORMAT = "lightning_fastdata.store"
#: 3: ragged fields (values, offsets, shapes files) and JPEG-encoded fields.
FORMAT_VERSION = 3
MANIFEST = "manifest.json"
READERS = ".readers"
LAST_USED = "last_used"
#: Names of the temporary directories of builds and removals (swept once their writer is gone).
TMP_PREFIX = ".tmp-"
#: Inside a build's temporary directory: locked by the builder while it runs (see :func:`sweep_temporaries`).
BUILDING = ".building"
#: Ends the writer field of a build temporary that holds :data:`BUILDING` (an older release's
#: sweep reads such a field as malformed and judges the directory by its age, never its pid).
_LOCKED = "+lock"
#: Names of the build locks beside the caches of a namespace (left by a killed build too).
LOCK_PREFIX = ".lock-"
_CRC_BLOCK = 16 << 20
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
#: A cache directory's name: ``<split>-<fingerprint[:16]>``.
CACHE_NAME = re.compile(r"(?P<split>.+)-(?P<fp>[0-9a-f]{16})")
_TV_KINDS = {"Image": "image", "Video": "image", "Mask": "mask"}


class CacheInvalidError(RuntimeError):
    """An on-disk cache failed validation; the message says why."""


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=3)


# --------------------------------------------------------------------------- the store


@dataclass
class Store:
    """Field arrays of N samples plus the spec that rebuilds a sample's structure.

    Attributes:
        fields: One array per leaf, shape ``(N, *sample_shape)``, or a
            :class:`~lightning_fastdata.ragged.RaggedArray` for a ragged field; read-only
            memmaps when opened from disk.
        infos: Name, dtype, per-sample shape and kind of each field, and whether it is
            ragged (and encoded).
        spec: The sample structure (see :func:`flatten`).
        fingerprint: Hex digest identifying source + static transform + config + files.
        path: The cache directory, or ``None`` for an in-memory store.
        meta: The manifest of an on-disk store.
    """

    fields: list[np.ndarray | RaggedArray]
    infos: list[FieldInfo]
    spec: dict
    fingerprint: str = ""
    path: Path | None = None
    meta: dict = field(default_factory=dict)
    #: Shared lock on the cache's ``.readers`` while this store is alive (prune skips it).
    lease: Any = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.fields[0])

    @property
    def nbytes(self) -> int:
        """Total bytes of all field arrays (a ragged field's values, offsets and shapes)."""
        return int(sum(a.nbytes for a in self.fields))

    @property
    def kinds(self) -> dict[str, str]:
        """Field name -> kind ("image", "mask" or "other"), as recorded in the manifest."""
        return {i.name: i.kind for i in self.infos}

    def close(self) -> None:
        """Give up the reader lease (the arrays stay readable); prune may then remove the cache."""
        if self.lease is not None:
            self.lease.close()

    @classmethod
    def from_arrays(cls, arrays: Any, fingerprint: str = "memory") -> Store:
        """An in-memory store from batched arrays in a sample's structure.

        Args:
            arrays: e.g. ``(images[N, 3, 32, 32], labels[N])`` or a dict of such arrays;
                a ragged field as a :class:`~lightning_fastdata.ragged.RaggedArray`.
            fingerprint: Identifier recorded on the store.
        """
        spec, leaves = flatten(arrays)
        fields: list[np.ndarray | RaggedArray] = [
            a if isinstance(a, RaggedArray) else np.ascontiguousarray(a) for _, a in leaves]
        n = {len(a) if isinstance(a, RaggedArray) else a.shape[0] if a.ndim else -1 for a in fields}
        if len(n) != 1 or -1 in n:
            raise StoreError(f"from_arrays needs arrays of equal first dimension, got {sorted(n)}")
        infos = []
        for (p, _), a in zip(leaves, fields, strict=True):
            if isinstance(a, RaggedArray):
                infos.append(FieldInfo(p, a.dtype.str, (-1,) * a.ndim, ragged=True, encoding=a.encoding,
                                       mean_nbytes=-(-a.values.nbytes // max(1, len(a)))))
            else:
                infos.append(FieldInfo(p, a.dtype.str, tuple(a.shape[1:])))
        return cls(fields, with_kinds(infos, spec), spec, fingerprint)


# --------------------------------------------------------------------------- probing


probe_indices = F.probe_indices


@dataclass
class _Probe:
    """What the probe samples gave: structure, fields, per-leaf digests, and the time per sample."""

    spec: dict
    infos: list[FieldInfo]
    digests: dict[int, list[str]]
    per_sample_s: float


def _probe(dataset: Any, transform: Callable[[Any], Any], n: int, probes: int, layout: Layout | None = None) -> _Probe:
    """Read the probe samples: structure, stored fields (ragged sizes estimated from them), digests."""
    layout = layout or Layout()
    spec: dict = {}
    infos: list[FieldInfo] = []
    digests: dict[int, list[str]] = {}
    sizes: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    idx = F.probe_indices(n, probes)
    for i in idx:
        if infos:  # a later sample: unstorable or unlike sample 0 is an error (see flatten_like)
            leaves = flatten_like(spec, infos, read_sample(dataset, transform, i), i)
        else:  # sample 0: unstorable means the split is loaded per sample (UnstorableSampleError)
            s, leaves = flatten(read_sample(dataset, transform, i), i)
            if not leaves:
                raise StoreError(f"sample {i} has nothing to store (got {s!r}): the source, or static_transform, must "
                                 "return a tensor, an ndarray, a number, or a tuple/list/dict holding at least one")
            spec, infos = s, layout.apply(with_kinds(signature(leaves), s), s)
        layout.check_aligned(infos, leaves, i)
        digests[i] = F.leaf_digests(leaves)
        for k, (info, (_, value)) in enumerate(zip(infos, leaves, strict=True)):
            if info.ragged:
                sizes.setdefault(k, []).append(int(layout.stored(info, value, i, dataset)[0].nbytes))
    infos = [replace(info, mean_nbytes=-(-sum(sizes[k]) // len(sizes[k]))) if k in sizes else info
             for k, info in enumerate(infos)]
    return _Probe(spec, infos, digests, (time.perf_counter() - t0) / max(len(idx), 1))


def _check_deterministic(dataset: Any, transform: Callable[[Any], Any], probe: _Probe,
                         warn: Callable[[str], None]) -> None:
    """Read every probe index a second time; warn once if any field's bytes differ."""
    names = [i.name for i in probe.infos]
    for i, first in probe.digests.items():
        # In sample 0's dict key order, as the probe read it (a random order is no randomness of values)
        _, leaves = flatten(read_sample(dataset, transform, i), i, like=probe.spec)
        second = F.leaf_digests(leaves)
        for k, (a, b) in enumerate(zip(first, second, strict=False)):
            if a != b:
                warn(
                    f"lightning_fastdata: field '{names[k] if k < len(names) else k}' of sample {i} differs between "
                    "two reads of the same index: the source or static_transform is random; its randomness would "
                    "be frozen into the cache (and every run would build a new one); move it to train_augment, "
                    "or pass store=False"
                )
                return
        if len(first) != len(second):
            warn(f"lightning_fastdata: sample {i} has {len(second)} fields on a second read, {len(first)} on the "
                 "first: the source or static_transform is random; move the randomness to train_augment, or pass "
                 "store=False")
            return


def _fingerprint(dataset: Any, transform: Callable[[Any], Any], n: int, probe: _Probe, cache_key: str | None,
                 config: Mapping[str, Any] | None, files: Sequence[str]) -> F.Fingerprint:
    return F.make_fingerprint(transform, dataset, n, format_version=FORMAT_VERSION, cache_key=cache_key,
                              config=config, files=files, spec=probe.spec, samples=probe.digests)


def fingerprint(
    dataset: Any,
    transform: Callable[[Any], Any],
    cache_key: str | None = None,
    probes: int = F.PROBES,
    *,
    config: Mapping[str, Any] | None = None,
    files: Sequence[str] | None = None,
    layout: Layout | None = None,
) -> tuple[str, dict, list[FieldInfo], float]:
    """Identify a (source, static transform, config, files) combination; see :mod:`lightning_fastdata.fingerprint`.

    Returns ``(hex digest, spec, field infos, seconds per probe sample)``; loader
    settings never enter it. ``files=None`` discovers them on the dataset. ``layout``
    (ragged and encoded fields, see :class:`Layout`) enters it as part of the config.
    """
    n = len(dataset)
    layout = layout or Layout()
    probe = _probe(dataset, transform, n, probes, layout)
    listed = F.discover_files(dataset) if files is None else [os.fspath(f) for f in files]
    fp = _fingerprint(dataset, transform, n, probe, cache_key, {**(config or {}), **layout.config()}, listed)
    return fp.digest, probe.spec, probe.infos, probe.per_sample_s


# --------------------------------------------------------------------------- disk format


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while block := f.read(_CRC_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def _manifest_crc(manifest: dict) -> int:
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def _refuse_symlink(path: Path, what: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise CacheInvalidError(f"{what} {path} is a symbolic link; refusing to follow it. Remove it.")


def _written(tmp: Path) -> int:
    """Bytes a build's temporary directory holds on disk now (for the full-disk message)."""
    total = 0
    for f in tmp.iterdir():
        with contextlib.suppress(OSError):
            total += f.lstat().st_blocks * 512
    return total


def ensure_cache_dir(cache_dir: str | os.PathLike) -> Path:
    """Create ``cache_dir`` owner-only if missing (``~`` expanded); refuse a symlink, a
    non-directory, or a directory this process cannot write."""
    path = Path(os.path.expanduser(os.fspath(cache_dir)))
    if path.is_symlink():
        raise StoreError(f"cache_dir {path} is a symbolic link; pass the real directory instead")
    if path.exists() and not path.is_dir():
        raise StoreError(f"cache_dir {path} exists and is not a directory; set cache_dir to a directory")
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(f"cache_dir {path} cannot be created ({e.strerror or e}); set cache_dir to a writable "
                         "directory") from e
    return path


def read_manifest(path: Path, check_version: bool = True) -> dict:
    """The manifest of the cache at ``path``, checked (format, version unless told not to, checksum).

    Raises:
        CacheInvalidError: with the reason.
    """
    try:
        fd = os.open(path / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError as e:
        raise CacheInvalidError(f"{path / MANIFEST} is missing") from e
    except OSError as e:
        raise CacheInvalidError(f"cannot open {path / MANIFEST} ({e}); a symlink is refused") from e
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read()
    except OSError as e:  # a directory in its place (EISDIR), an I/O error
        raise CacheInvalidError(f"{path / MANIFEST} cannot be read ({e.strerror or e})") from e
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise CacheInvalidError(f"{path / MANIFEST} is not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CacheInvalidError(f"{path / MANIFEST} is not a {FORMAT} manifest")
    if check_version and manifest.get("version") != FORMAT_VERSION:
        raise CacheInvalidError(
            f"{path} has store format version {manifest.get('version')}, this release reads "
            f"version {FORMAT_VERSION}"
        )
    if manifest.get("manifest_crc32") != _manifest_crc(manifest):
        raise CacheInvalidError(f"{path / MANIFEST} was modified after it was written (checksum mismatch)")
    return manifest


def _touch_last_used(path: Path) -> None:
    """Stamp the cache as used now (a file's mtime: independent of the filesystem's atime policy)."""
    with contextlib.suppress(OSError):
        fd = os.open(path / LAST_USED, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.utime(fd)
        finally:
            os.close(fd)


def last_used(path: Path) -> float:
    """When the cache at ``path`` was last opened (its ``last_used`` stamp, else its manifest's mtime)."""
    for p in (path / LAST_USED, path / MANIFEST, path):
        with contextlib.suppress(OSError):
            return os.stat(p).st_mtime
    return 0.0


def open_store(path: str | os.PathLike, verify: bool = True, expect_fingerprint: str | None = None) -> Store:
    """Open a published store as read-only memory maps.

    The returned store holds a reader lease on the cache (so ``fastdata cache prune``
    leaves it alone) until it is garbage-collected or :meth:`Store.close` is called,
    and the cache's ``last_used`` stamp is updated.

    Args:
        path: The store directory.
        verify: Also check every file's CRC32 (reads the whole store once); sizes,
            dtypes and shapes are always checked.
        expect_fingerprint: Fail unless the manifest carries this fingerprint.

    Raises:
        CacheInvalidError: with the reason, when anything does not match.
    """
    path = Path(path)
    _refuse_symlink(path, "cache directory")
    if not path.is_dir():
        raise CacheInvalidError(f"{path} does not exist")
    try:
        lease = locks.take_lease(path / READERS)
    except locks.LeaseGone as e:
        raise CacheInvalidError(f"{path} was removed (pruned) while being opened") from e
    try:
        store = _open_fields(path, verify, expect_fingerprint)
    except BaseException:
        lease.close()
        raise
    store.lease = lease
    _touch_last_used(path)
    return store


def _load_checked(path: Path, entry: Mapping[str, Any], verify: bool) -> np.ndarray:
    """One file of a cache as a read-only memmap, after its size (and CRC32 when ``verify``) check."""
    file = path / entry["file"]
    if Path(entry["file"]).name != entry["file"]:
        raise CacheInvalidError(f"{path / MANIFEST} names a file {entry['file']!r} outside the cache")
    try:
        st = os.lstat(file)
    except FileNotFoundError as e:
        raise CacheInvalidError(f"{file} is missing") from e
    if not stat.S_ISREG(st.st_mode):
        raise CacheInvalidError(f"{file} is not a regular file (symlinks are refused)")
    if st.st_size != entry["bytes"]:
        raise CacheInvalidError(f"{file} has {st.st_size} bytes, the manifest says {entry['bytes']} (truncated?)")
    if verify and _crc32(file) != entry["crc32"]:
        raise CacheInvalidError(f"{file} fails its checksum (corrupted on disk)")
    try:
        return np.load(file, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise CacheInvalidError(f"{file} is not a valid .npy file ({e})") from e


def _open_field(path: Path, entry: Mapping[str, Any], n: int, verify: bool) -> tuple[np.ndarray | RaggedArray,
                                                                                      FieldInfo]:
    info = FieldInfo(entry["name"], entry["dtype"], tuple(entry["shape"]), entry.get("kind", "other"),
                     ragged=bool(entry.get("ragged", False)), encoding=entry.get("encoding"))
    files = entry["files"]
    arrays = {role: _load_checked(path, spec, verify) for role, spec in files.items()}
    where = f"{path}: field '{info.name}'"
    if not info.ragged:
        arr = arrays["data"]
        if arr.dtype.str != info.dtype or arr.shape != (n, *info.shape):
            raise CacheInvalidError(f"{path / files['data']['file']} holds {arr.dtype} {arr.shape}, the manifest says "
                                    f"{np.dtype(info.dtype)} {(n, *info.shape)}")
        return arr, info
    roles = {"values", "offsets", "shapes"} | ({"decoded"} if info.encoding else set())
    if set(arrays) != roles:
        raise CacheInvalidError(f"{where} has files {sorted(arrays)}, a ragged field needs {sorted(roles)}")
    field = RaggedArray(arrays["values"], arrays["offsets"], arrays["shapes"], info.encoding, arrays.get("decoded"))
    if field.values.dtype.str != info.dtype or len(field) != n or field.ndim != len(info.shape):
        raise CacheInvalidError(f"{where} holds {len(field)} samples of {field.values.dtype} with {field.ndim} "
                                f"dimension(s), the manifest says {n} of {np.dtype(info.dtype)} with "
                                f"{len(info.shape)}")
    problems = field.problems()
    if problems:
        raise CacheInvalidError(f"{where}: {'; '.join(problems)} (offsets or shapes edited or corrupted)")
    return field, replace(info, mean_nbytes=-(-field.values.nbytes // max(1, n)))


def _open_fields(path: Path, verify: bool, expect_fingerprint: str | None) -> Store:
    manifest = read_manifest(path)
    if expect_fingerprint is not None and manifest["fingerprint"] != expect_fingerprint:
        raise CacheInvalidError(
            f"{path} holds fingerprint {manifest['fingerprint'][:16]}, expected {expect_fingerprint[:16]}"
        )
    fields, infos = [], []
    n = int(manifest["n"])
    for entry in manifest["fields"]:
        try:
            field, info = _open_field(path, entry, n, verify)
        except (KeyError, TypeError, AttributeError) as e:
            raise CacheInvalidError(f"{path / MANIFEST} has a malformed field entry ({type(e).__name__}: {e})") from e
        fields.append(field)
        infos.append(info)
    return Store(fields, infos, manifest["spec"], manifest["fingerprint"], path, manifest)


def _host() -> str:
    """This host's name as temporary directories carry it (``~`` separates the parts of their names)."""
    return socket.gethostname().replace("~", "-")


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, from Linux ``/proc``); ``None`` where unknown.

    A pid is reused once its process has exited; the pid with its start time names one process.
    """
    try:
        # the command name, in parentheses, may hold spaces: count the fields after it (starttime is the 22nd)
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _writer_tag() -> str:
    """``host~pid[.start]``: this process, in the name of a temporary directory it writes."""
    pid = os.getpid()
    start = _started(pid)
    return f"{_host()}~{pid}" if start is None else f"{_host()}~{pid}.{start}"


def _writer_alive(field: str) -> bool | None:
    """Whether the process a ``pid[.start]`` name field names runs on this host; ``None`` for a malformed field.

    A name without a start time (an older release's, or a platform without ``/proc``) is
    judged by its pid alone.
    """
    text, _, start = field.partition(".")
    try:
        pid, recorded = int(text), (int(start) if start else None)
    except ValueError:
        return None
    if pid <= 0:  # kill() would probe a process group, not a process
        return None
    if not pid_alive(pid):
        return False
    now = _started(pid) if recorded is not None else None
    return recorded is None or now is None or now == recorded


def _temporary_alive(p: Path, host: str) -> bool | None:
    """Whether the writer of the temporary directory ``p`` may still run; ``None``: judge it by its age."""
    parts = p.name[len(TMP_PREFIX):].split("~")
    here = len(parts) >= 3 and parts[1] == host
    writer = parts[2] if len(parts) >= 3 else ""
    held = locks.held(p / BUILDING)
    if held:  # its builder runs, in whatever PID namespace (or on a host whose flock we see)
        return True
    if here and held is False:  # the lock is free, and it exists only while held: the builder is gone
        return False
    if here and (not writer.endswith(_LOCKED) or os.path.lexists(p / BUILDING)):
        # An older release's temporary, a removal's, or a filesystem whose flock cannot tell:
        # the pid and its start time (wrong for a builder in another PID namespace, so only here).
        return _writer_alive(writer.removesuffix(_LOCKED))
    # Another host's (its flock may be local to it, as on some NFS mounts), or a build
    # between creating its directory and locking it: its last heartbeat decides.
    return None


_OURS = re.compile(r"[A-Za-z0-9_.-]+~[^~/]+~\d+(\.\d+)?(\+lock)?~.+")


def is_build_temporary(name: str) -> bool:
    """Whether ``name`` is a build's or a removal's temporary: ``.tmp-<split|trash>~<host>~<pid[.start]>~...``."""
    return name.startswith(TMP_PREFIX) and bool(_OURS.fullmatch(name[len(TMP_PREFIX):]))


def sweep_temporaries(cache_dir: Path, max_age_s: float = 24 * 3600) -> list[Path]:
    """Remove the temporary directories of builds (and removals) whose writer is gone.

    A build holds a ``flock`` on :data:`BUILDING` inside its directory while it runs: a
    directory whose lock is held is never removed, whatever host or PID namespace its
    builder runs in. Otherwise one written on this host is removed as soon as its writer
    has exited (its lock is free; or, for one without the lock file, from an older release
    or a removal, its pid runs no more or names a process started at another time). One
    written on another host, whose lock may be invisible here (``flock`` on some network
    filesystems is local to a host), is removed when it was last modified more than
    ``max_age_s`` ago: a builder touches its directory every few seconds
    (:class:`~lightning_fastdata.locks.Heartbeat`), so that is the time since its last
    sign of life, not since its build began.

    Args:
        cache_dir: The directory holding the temporaries.
        max_age_s: Seconds without a heartbeat after which another host's temporary is abandoned.

    Returns:
        The directories removed.
    """
    removed = []
    host = _host()
    for p in cache_dir.glob(f"{TMP_PREFIX}*"):
        if not is_build_temporary(p.name):
            continue  # a directory of someone else's that happens to start so: never removed
        alive = _temporary_alive(p, host)
        if alive is None:
            try:
                alive = time.time() - os.lstat(p).st_mtime <= max_age_s
            except OSError:  # gone meanwhile
                continue
        if not alive and p.is_dir() and not p.is_symlink():
            # A removal's directory swept while its remover still deletes it: both delete, harmlessly.
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def remove_cache(path: Path) -> OSError | None:
    """Move aside then delete, so a concurrent reader never sees a half-deleted store.

    Processes that have the store's files mapped keep reading them: unlinking a file
    does not take its pages from a mapping.

    Returns:
        ``None`` once the cache is gone from ``path``; the ``OSError`` that kept it there
        otherwise (a read-only or immutable directory, say). Returned, not raised, so a
        caller for which a failed removal is no error may ignore it; one that reports a
        removal (``fastdata cache prune``) must check it.
    """
    trash = path.with_name(f"{TMP_PREFIX}trash~{_writer_tag()}~{path.name}")
    try:
        os.rename(path, trash)
    except OSError as e:
        return e
    # Once renamed, no reader finds it; what rmtree leaves, sweep_temporaries removes later.
    shutil.rmtree(trash, ignore_errors=True)
    return None


def store_dir(cache_dir: str | os.PathLike, name: str, fp: str, namespace: str = "") -> Path:
    """Where :func:`build_store` publishes the store of ``name`` with fingerprint ``fp``."""
    ns = F.sanitise_namespace(namespace) if namespace else ""
    return Path(cache_dir, ns) / f"{name}-{fp[:16]}" if ns else Path(cache_dir) / f"{name}-{fp[:16]}"


def lock_path(cache: Path) -> Path:
    """The build lock of the cache directory ``cache`` (beside it, so pruning the cache keeps the lock)."""
    return cache.with_name(f"{LOCK_PREFIX}{cache.name}")


def _dir_for(root: Path, namespace: str) -> Path:
    if not namespace:
        return root
    ns = F.sanitise_namespace(namespace)
    if not ns:
        raise StoreError(f"namespace {namespace!r} has no usable characters for a directory name")
    return ensure_cache_dir(root / ns)


def build_store(
    dataset: Any,
    transform: Callable[[Any], Any],
    cache_dir: str | os.PathLike,
    name: str = "train",
    cache_key: str | None = None,
    probes: int = F.PROBES,
    num_workers: int | None = None,
    progress: bool = True,
    parallel_threshold_s: float = 2.0,
    *,
    namespace: str = "",
    config: Mapping[str, Any] | None = None,
    files: Sequence[str | os.PathLike] | None = None,
    verify: bool = True,
    warn: Callable[[str], None] | None = None,
    lock_timeout_s: float | None = None,
    field_kinds: Mapping[str, str] | None = None,
    ragged: Sequence[str] | None = None,
    encode: Mapping[str, str] | None = None,
    jpeg_quality: int = 90,
    max_side: int | None = None,
) -> Store:
    """Materialise ``transform(dataset[i])`` for every ``i`` into a cached store, or reuse it.

    The cache is ``cache_dir/<namespace>/<name>-<fingerprint[:16]>``; the fingerprint
    covers the code of ``transform`` and of the dataset's class, ``config``, the path,
    size and mtime of every file in ``files``, the dataset's class and length, the
    static outputs of ``probes`` samples spread over the index range, and ``cache_key``
    (see :mod:`lightning_fastdata.fingerprint`). A valid cache with the same fingerprint
    is reused; an invalid one is rebuilt with a warning that says why. A cache with
    another fingerprint is never deleted: when a new one is built, the warning says what
    changed since the last one used, which is kept (``fastdata cache prune`` removes
    unused caches).

    The build runs under a file lock per cache, so processes and nodes sharing a
    filesystem build once: the others wait, then reuse. Free space is checked before
    writing and the files are allocated up front. Building runs in parallel over the CPU
    cores when the transform is slow enough for it to pay (``parallel_threshold_s`` of
    estimated work).

    Args:
        dataset: A map-style dataset (``__len__`` and ``__getitem__``; an IterableDataset is refused).
        transform: The static, deterministic per-sample transform.
        cache_dir: Directory for caches (created 0700 if missing; never a symlink).
        name: The split's name, part of the cache's directory name.
        cache_key: Extra user key mixed into the fingerprint (bump it to force a rebuild).
        probes: Number of probe samples in the fingerprint.
        num_workers: Worker processes for building; ``None`` picks from the CPU count.
        progress: Show a tqdm progress bar.
        parallel_threshold_s: Estimated sequential seconds above which workers are used.
        namespace: Directory under ``cache_dir`` for this project's caches (a data
            module's ``module.QualName``); ``""`` puts caches in ``cache_dir`` itself.
        config: Settings that change what is cached (JSON-able or canonicalisable values).
        files: The files the dataset reads; ``None`` discovers them on the dataset
            (``ImageFolder.samples`` and any attribute listing existing paths).
        verify: Check every file's CRC32 when reusing a cache (sizes are always checked).
        warn: Called with each warning's text (default: ``warnings.warn``).
        lock_timeout_s: Longest wait for another process's build, ``None`` for as long
            as it shows signs of life.
        field_kinds: Field name -> "image" | "mask" | "other", over the kinds found from
            ``tv_tensors`` types (see :func:`field_kinds`); recorded in the manifest and
            part of the fingerprint.
        ragged: Fields whose shape may change from sample to sample (the number of
            dimensions and the dtype may not, nor an image or mask field's channels: only
            its spatial size): stored end to end with offsets and per-sample shapes (a
            :class:`~lightning_fastdata.ragged.RaggedArray`).
        encode: Field -> "jpeg": the field (a uint8 ``(C, H, W)`` image, or JPEG bytes
            as a uint8 1-D tensor) is stored as JPEG bytes, a ragged field that also
            records each image's decoded shape (see :mod:`lightning_fastdata.encode`).
        jpeg_quality: Quality of store-time JPEG encoding, 1-100.
        max_side: Longest side of an encoded image, after an antialiased resize that
            keeps the aspect ratio; ``None`` keeps the size. ``ragged``, ``encode``,
            ``jpeg_quality`` and ``max_side`` are part of the fingerprint (the last two
            only with ``encode``).

    Raises:
        StoreError: for an empty dataset, samples that cannot form one store, a full
            disk, or a dead lock holder; the message names the culprit and the fix.
            Nothing half-written is left.
        UnstorableSampleError: (a StoreError) when sample 0 holds a leaf with no array
            form (a str, None): the caller may load the split per sample. The same in a
            later sample only is a plain StoreError.
    """
    warn = warn or _warn
    layout = Layout.of(ragged, encode, jpeg_quality, max_side)
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.startswith("."):
        raise StoreError(f"split name {name!r} must be letters, digits, '_', '-' or '.' (it names a directory)")
    if isinstance(dataset, torch.utils.data.IterableDataset):
        # Its __len__ (if any) says nothing of indexing: dataset[0] would fail inside the probe,
        # in torch's words, naming no split.
        raise StoreError(f"source('{name}') returned {type(dataset).__name__}, an IterableDataset; a store reads "
                         "samples by index, so a map-style Dataset (__len__ and __getitem__) is required: return "
                         "one from source(), e.g. a Dataset indexing the files or records the stream reads (or the "
                         "stream's samples in a list, when they fit in memory)")
    try:
        n = len(dataset)
    except TypeError as e:
        raise StoreError(f"source for '{name}' has no len(); a map-style Dataset is required") from e
    if n == 0:
        raise StoreError(
            f"source('{name}') returned an empty dataset ({type(dataset).__name__} of length 0); "
            "check the data path, or return None from source() to skip this split"
        )
    base = ensure_cache_dir(cache_dir)
    root = _dir_for(base, namespace)
    sweep_temporaries(root)
    probe = _probe(dataset, transform, n, probes, layout)
    if field_kinds:
        probe.infos = _override_kinds(probe.infos, field_kinds)
        config = {**(config or {}), "field_kinds": dict(field_kinds)}
    if layout.config():
        config = {**(config or {}), **layout.config()}
    listed = F.discover_files(dataset) if files is None else [os.fspath(f) for f in files]
    fp = _fingerprint(dataset, transform, n, probe, cache_key, config, listed)
    digest = fp.digest
    final = root / f"{name}-{digest[:16]}"
    _refuse_symlink(final, "cache directory")

    reason = None
    if final.exists():
        try:
            return open_store(final, verify=verify, expect_fingerprint=digest)
        except CacheInvalidError as e:
            reason = e
    what = f"the '{name}' cache {final}"
    if not os.access(root, os.W_OK):
        raise StoreError(f"{what} must be built ({reason or 'there is none yet'}), but {root} is not writable "
                         "(a read-only filesystem, or another user's directory); set cache_dir to a writable "
                         "directory")
    with _build_lock(lock_path(final), what, lock_timeout_s):
        if final.exists():  # another process may have built or repaired it while we waited
            try:
                return open_store(final, verify=verify, expect_fingerprint=digest)
            except CacheInvalidError as e:
                reason = e
            warn(f"lightning_fastdata: rebuilding the '{name}' cache: {reason}")
            failed = remove_cache(final)
            if failed is not None:
                # The new build could not be published over it, and the invalid one would be
                # opened unchecked below: stop here, with what to do.
                raise StoreError(f"the '{name}' cache {final} is invalid ({reason}) and could not be moved aside "
                                 f"to rebuild it: {failed}; remove it by hand (or check the directory's "
                                 "permissions), then run again") from failed
        else:
            _warn_what_changed(root, name, final, fp, warn)
        _check_deterministic(dataset, transform, probe, warn)
        note = layout.unscaled_note(probe.infos)
        if note is not None:
            warn(note)
        _build(dataset, transform, root, final, name, n, namespace, fp, probe, num_workers, progress,
               parallel_threshold_s, layout)
    return open_store(final, verify=False, expect_fingerprint=digest)


def _override_kinds(infos: list[FieldInfo], kinds: Mapping[str, str]) -> list[FieldInfo]:
    names = [i.name for i in infos]
    for name, kind in kinds.items():
        if name not in names:
            raise StoreError(f"field_kinds names a field {name!r} that the samples do not have; their fields are "
                             f"{names}")
        if kind not in ("image", "mask", "other"):
            raise StoreError(f"field_kinds[{name!r}] is {kind!r}; a kind is 'image', 'mask' or 'other'")
    return [replace(i, kind=kinds.get(i.name, i.kind)) for i in infos]


@contextlib.contextmanager
def _build_lock(path: Path, what: str, timeout_s: float | None) -> Iterator[None]:
    """:class:`~lightning_fastdata.locks.BuildLock`, its timeout raised as a :class:`StoreError`."""
    lock = locks.BuildLock(path, what, timeout_s)
    try:
        lock.__enter__()
    except locks.LockTimeout as e:
        raise StoreError(str(e)) from None
    try:
        yield
    except BaseException:
        # Nothing of a failed build stays behind, its lock file included. A process that
        # opened the old lock file meanwhile may build concurrently with one that creates
        # a new one: harmless, publishing is one atomic rename.
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        lock.__exit__(None, None, None)


def _previous(root: Path, name: str, exclude: Path) -> Path | None:
    """The most recently used other cache of ``name`` in ``root``."""
    found = []
    for p in root.glob(f"{name}-*"):
        m = CACHE_NAME.fullmatch(p.name)
        if p == exclude or m is None or m["split"] != name or p.is_symlink() or not (p / MANIFEST).is_file():
            continue
        found.append((last_used(p), p.name, p))
    return max(found)[2] if found else None


def _warn_what_changed(root: Path, name: str, final: Path, fp: F.Fingerprint, warn: Callable[[str], None]) -> None:
    old = _previous(root, name, final)
    if old is None:
        return
    try:
        manifest = read_manifest(old, check_version=False)
    except CacheInvalidError as e:
        why = f"the previous cache cannot be read ({e})"
    else:
        comps = manifest.get("fingerprint_components")
        if manifest.get("version") != FORMAT_VERSION or not isinstance(comps, dict):
            why = (f"the previous cache was written by another release (store format version "
                   f"{manifest.get('version')}, this release writes {FORMAT_VERSION})")
        else:
            why = "; ".join(fp.changes(comps)) or "its fingerprint components are equal (a hash collision?)"
        old_fp = str(manifest.get("fingerprint", ""))[:16]
        why = f"{why} (fingerprint {fp.digest[:16]}, was {old_fp})"
    warn(
        f"lightning_fastdata: building a new '{name}' cache, its fingerprint differs from the last one used at "
        f"{old}: {why}. The old cache is kept; `fastdata cache prune` removes caches that are no longer used."
    )


def _manifest_field(tmp: Path, k: int, info: FieldInfo) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": info.name, "kind": info.kind, "dtype": info.dtype, "shape": list(info.shape),
                             "ragged": info.ragged}
    if info.ragged:
        entry["encoding"] = info.encoding
    entry["files"] = {role: {"file": f, "bytes": (tmp / f).stat().st_size, "crc32": _crc32(tmp / f)}
                      for role, f in field_files(k, info).items()}
    return entry


@contextlib.contextmanager
def _full_disk(name: str, root: Path, free: int, n: int, infos: list[FieldInfo], tmp: Path) -> Iterator[None]:
    """Turn ENOSPC/EDQUOT from this build's own writes into the full-disk :class:`StoreError`."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise no_room(name, root, free, n, infos, written=_written(tmp)) from e
        raise


def _build(dataset: Any, transform: Callable, root: Path, final: Path, name: str, n: int, namespace: str,
           fp: F.Fingerprint, probe: _Probe, num_workers: int | None, progress: bool,
           parallel_threshold_s: float, layout: Layout) -> None:
    """Write the store into a temporary directory and publish it by one rename; leave nothing on failure."""
    infos = probe.infos
    check_space(name, root, n, infos)
    free = shutil.disk_usage(root).free  # for the message, should the disk fill up while writing
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}~{_writer_tag()}{_LOCKED}~", dir=root))
    # Touched while we build: another host's sweep judges the directory by its age, and
    # nothing else refreshes it once a fixed-shape store's files are created.
    beat = locks.Heartbeat(tmp)
    guard = None
    try:
        beat.start()
        with _full_disk(name, root, free, n, infos, tmp):
            # Locked for the whole build: a sweep never removes the directory of a live builder,
            # whatever PID namespace it runs in (pids in the name would be another process's).
            guard = locks.hold(tmp / BUILDING)
            files = create_fixed_files(tmp, n, infos)
        reserve(files, name, root, n, infos)
        cores = cpu_count()
        workers = num_workers if num_workers is not None else (
            min(cores, 8) if probe.per_sample_s * n > parallel_threshold_s and cores > 1 else 0
        )
        # Not inside _full_disk: the static transform's own ENOSPC (its scratch file) is the
        # user's error, reported as such; fill converts only its own writes.
        chunks = fill(dataset, transform, tmp, probe.spec, infos, n, layout, workers, f"fastdata: caching '{name}'",
                      progress, lambda: no_room(name, root, free, n, infos, written=_written(tmp)), split=name)
        with _full_disk(name, root, free, n, infos, tmp):
            for k, info in enumerate(infos):
                if info.ragged:
                    join_ragged(tmp, k, info, chunks)
            manifest = {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "namespace": namespace,
                "name": name,
                "n": n,
                "fingerprint": fp.digest,
                "fingerprint_components": fp.components,
                "spec": probe.spec,
                "fields": [_manifest_field(tmp, k, info) for k, info in enumerate(infos)],
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            manifest["manifest_crc32"] = _manifest_crc(manifest)
            fd = os.open(tmp / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump(manifest, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            os.close(os.open(tmp / READERS, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        # Not published with the cache; without it the named directory is judged by its age until
        # the rename (still locked: we keep the descriptor).
        os.unlink(tmp / BUILDING)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another writer published the same fingerprint first: theirs is as good as ours.
            if not (final / MANIFEST).exists():
                raise
    finally:
        beat.stop()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if guard is not None:
            os.close(guard)  # after the removal: no sweep races ours
