"""The array store: a dataset's static outputs as one contiguous array per field.

A sample (a tensor, number, ndarray, or a tuple/list/dict of those) is flattened into
leaves; leaf ``k`` of every sample becomes row ``i`` of field array ``k``. On disk a
store is a directory of ``.npy`` files and a JSON manifest (format version, N, dtypes,
shapes, kinds, fingerprint and its components, per-file size and CRC32). It is written
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
import math
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
from lightning_fastdata._util import fmt_bytes, pid_alive

FORMAT = "lightning_fastdata.store"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
READERS = ".readers"
LAST_USED = "last_used"
_TMP_PREFIX = ".tmp-"
_LOCK_PREFIX = ".lock-"
_CRC_BLOCK = 16 << 20
_NPY_HEADER = 4096  # upper bound of one .npy header, for the space estimate
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
#: A cache directory's name: ``<split>-<fingerprint[:16]>``.
CACHE_NAME = re.compile(r"(?P<split>.+)-(?P<fp>[0-9a-f]{16})")
_TV_KINDS = {"Image": "image", "Video": "image", "Mask": "mask"}


class StoreError(ValueError):
    """Bad input while building a store (names the sample index and the fix)."""


class UnstorableSampleError(StoreError):
    """A sample holds a leaf that has no array form (str, None, ...)."""


class CacheInvalidError(RuntimeError):
    """An on-disk cache failed validation; the message says why."""


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=3)


# --------------------------------------------------------------------------- structure


def _leaf_array(value: Any, index: int, path: str) -> np.ndarray:
    """Convert one leaf of sample ``index`` to an ndarray, or explain why it cannot be."""
    where = f"sample {index}, field '{path}'"
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:
            raise StoreError(
                f"{where} is a bfloat16 tensor, which numpy cannot store; return float32 "
                "(or uint8) from static_transform and convert on the device with augment.ToDtype"
            )
        return value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise UnstorableSampleError(f"{where} is an object-dtype ndarray")
        return value
    if isinstance(value, (bool, np.bool_)):
        return np.asarray(value, dtype=np.bool_)
    if isinstance(value, (int, np.integer)):
        return np.asarray(value, dtype=np.int64)
    if isinstance(value, (float, np.floating)):
        return np.asarray(value, dtype=np.float64 if isinstance(value, float) else value.dtype)
    if type(value).__module__.startswith("PIL."):
        raise StoreError(
            f"{where} is a PIL image ({type(value).__name__}); convert it in static_transform, "
            "e.g. torchvision.transforms.functional.pil_to_tensor(image) for uint8 CHW"
        )
    raise UnstorableSampleError(
        f"{where} is a {type(value).__name__}; only tensors, ndarrays and numbers can be stored"
    )


def _tv_kind(value: Any) -> str | None:
    """The field kind of a torchvision ``tv_tensors`` leaf (Image/Video: image, Mask: mask, others: other)."""
    for cls in type(value).__mro__:
        if cls.__module__.startswith("torchvision.tv_tensors"):
            return _TV_KINDS.get(cls.__name__, "other")
    return None


def flatten(sample: Any, index: int = 0) -> tuple[dict, list[tuple[str, np.ndarray]]]:
    """Flatten a sample into ``(spec, [(path, array), ...])`` in a fixed leaf order.

    A leaf that is a torchvision ``tv_tensors`` instance records its kind in the spec
    (``"tv": "image" | "mask" | "other"``), see :func:`field_kinds`.
    """
    leaves: list[tuple[str, np.ndarray]] = []

    def walk(node: Any, path: str) -> dict:
        if isinstance(node, (tuple, list)):
            kind = "tuple" if isinstance(node, tuple) else "list"
            items = [walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(node)]
            return {"kind": kind, "items": items}
        if isinstance(node, dict):
            keys = list(node)
            for k in keys:
                if not isinstance(k, str):
                    raise StoreError(f"sample {index} has a dict key {k!r}; keys must be str")
            items = [walk(node[k], f"{path}.{k}" if path else k) for k in keys]
            return {"kind": "dict", "keys": keys, "items": items}
        kind = "tensor" if isinstance(node, torch.Tensor) else (
            "ndarray" if isinstance(node, np.ndarray) else "number"
        )
        leaves.append((path or "0", _leaf_array(node, index, path or "0")))
        leaf = {"kind": "leaf", "field": len(leaves) - 1, "type": kind}
        tv = _tv_kind(node)
        if tv is not None:
            leaf["tv"] = tv
        return leaf

    return walk(sample, ""), leaves


def field_kinds(spec: dict) -> list[str]:
    """Each field's kind, in field order: "image", "mask" or "other".

    From the ``tv_tensors`` types recorded by :func:`flatten` when any leaf has one (the
    others are "other"); else the first leaf is the image and the rest "other".
    """
    tv: dict[int, str | None] = {}

    def walk(node: dict) -> None:
        if node["kind"] == "leaf":
            tv[node["field"]] = node.get("tv")
        else:
            for item in node["items"]:
                walk(item)

    walk(spec)
    if not any(tv.values()):
        return ["image" if f == 0 else "other" for f in sorted(tv)]
    return [tv[f] or "other" for f in sorted(tv)]


def unflatten(spec: dict, leaves: Sequence[Any]) -> Any:
    """Rebuild a (batched) sample from its spec and one value per leaf."""
    kind = spec["kind"]
    if kind == "leaf":
        return leaves[spec["field"]]
    items = [unflatten(s, leaves) for s in spec["items"]]
    if kind == "tuple":
        return tuple(items)
    if kind == "list":
        return items
    return dict(zip(spec["keys"], items, strict=True))


@dataclass(frozen=True)
class FieldInfo:
    """One field of a store: its name (the leaf's path), dtype, per-sample shape and kind."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str = "other"

    @property
    def row_nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * math.prod(self.shape))


def _signature(leaves: list[tuple[str, np.ndarray]]) -> list[FieldInfo]:
    return [FieldInfo(p, a.dtype.str, tuple(a.shape)) for p, a in leaves]


def _with_kinds(infos: list[FieldInfo], spec: dict) -> list[FieldInfo]:
    return [replace(i, kind=k) for i, k in zip(infos, field_kinds(spec), strict=True)]


def _check_like(expected: list[FieldInfo], leaves: list[tuple[str, np.ndarray]], index: int) -> None:
    got = _signature(leaves)
    if [f.name for f in got] != [f.name for f in expected]:
        raise StoreError(
            f"sample {index} has fields {[f.name for f in got]}, sample 0 has "
            f"{[f.name for f in expected]}; static_transform must return one structure for all samples"
        )
    for e, g in zip(expected, got, strict=True):
        if e.shape != g.shape or e.dtype != g.dtype:
            raise StoreError(
                f"sample {index}, field '{g.name}' has shape {g.shape} dtype {np.dtype(g.dtype)}, "
                f"sample 0 has shape {e.shape} dtype {np.dtype(e.dtype)}; make static_transform "
                "return one shape and dtype for every sample (e.g. resize to a fixed size), "
                "or pass store=False to load samples one by one through DataLoader workers"
            )


# --------------------------------------------------------------------------- the store


@dataclass
class Store:
    """Field arrays of N samples plus the spec that rebuilds a sample's structure.

    Attributes:
        fields: One array per leaf, shape ``(N, *sample_shape)``; read-only memmaps when
            opened from disk.
        infos: Name, dtype, per-sample shape and kind of each field.
        spec: The sample structure (see :func:`flatten`).
        fingerprint: Hex digest identifying source + static transform + config + files.
        path: The cache directory, or ``None`` for an in-memory store.
        meta: The manifest of an on-disk store.
    """

    fields: list[np.ndarray]
    infos: list[FieldInfo]
    spec: dict
    fingerprint: str = ""
    path: Path | None = None
    meta: dict = field(default_factory=dict)
    #: Shared lock on the cache's ``.readers`` while this store is alive (prune skips it).
    lease: Any = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return int(self.fields[0].shape[0])

    @property
    def nbytes(self) -> int:
        """Total bytes of all field arrays."""
        return int(sum(a.nbytes for a in self.fields))

    @property
    def kinds(self) -> dict[str, str]:
        """Field name -> kind ("image", "mask" or "other"), as recorded in the manifest."""
        return {i.name: i.kind for i in self.infos}

    def batch(self, leaves: Sequence[Any]) -> Any:
        """Rebuild the sample structure around batched leaves."""
        return unflatten(self.spec, leaves)

    def close(self) -> None:
        """Give up the reader lease (the arrays stay readable); prune may then remove the cache."""
        if self.lease is not None:
            self.lease.close()

    @classmethod
    def from_arrays(cls, arrays: Any, fingerprint: str = "memory") -> Store:
        """An in-memory store from batched arrays in a sample's structure.

        Args:
            arrays: e.g. ``(images[N, 3, 32, 32], labels[N])`` or a dict of such arrays.
            fingerprint: Identifier recorded on the store.
        """
        spec, leaves = flatten(arrays)
        fields = [np.ascontiguousarray(a) for _, a in leaves]
        n = {a.shape[0] if a.ndim else -1 for a in fields}
        if len(n) != 1 or -1 in n:
            raise StoreError(f"from_arrays needs arrays of equal first dimension, got {sorted(n)}")
        infos = [FieldInfo(p, a.dtype.str, tuple(a.shape[1:])) for (p, _), a in zip(leaves, fields, strict=True)]
        return cls(fields, _with_kinds(infos, spec), spec, fingerprint)


# --------------------------------------------------------------------------- probing


probe_indices = F.probe_indices


@dataclass
class _Probe:
    """What the probe samples gave: structure, fields, per-leaf digests, and the time per sample."""

    spec: dict
    infos: list[FieldInfo]
    digests: dict[int, list[str]]
    per_sample_s: float


def _probe(dataset: Any, transform: Callable[[Any], Any], n: int, probes: int) -> _Probe:
    spec: dict = {}
    infos: list[FieldInfo] = []
    digests: dict[int, list[str]] = {}
    t0 = time.perf_counter()
    idx = F.probe_indices(n, probes)
    for i in idx:
        s, leaves = flatten(transform(dataset[i]), i)
        if not infos:
            spec, infos = s, _with_kinds(_signature(leaves), s)
        else:
            _check_like(infos, leaves, i)
        digests[i] = F.leaf_digests(leaves)
    return _Probe(spec, infos, digests, (time.perf_counter() - t0) / max(len(idx), 1))


def _check_deterministic(dataset: Any, transform: Callable[[Any], Any], probe: _Probe,
                         warn: Callable[[str], None]) -> None:
    """Read every probe index a second time; warn once if any field's bytes differ."""
    names = [i.name for i in probe.infos]
    for i, first in probe.digests.items():
        _, leaves = flatten(transform(dataset[i]), i)
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
) -> tuple[str, dict, list[FieldInfo], float]:
    """Identify a (source, static transform, config, files) combination; see :mod:`lightning_fastdata.fingerprint`.

    Returns ``(hex digest, spec, field infos, seconds per probe sample)``; loader
    settings never enter it. ``files=None`` discovers them on the dataset.
    """
    n = len(dataset)
    probe = _probe(dataset, transform, n, probes)
    listed = F.discover_files(dataset) if files is None else [os.fspath(f) for f in files]
    fp = _fingerprint(dataset, transform, n, probe, cache_key, config, listed)
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


def ensure_cache_dir(cache_dir: str | os.PathLike) -> Path:
    """Create ``cache_dir`` owner-only if missing; refuse a symlink or a non-directory."""
    path = Path(cache_dir)
    if path.is_symlink():
        raise StoreError(f"cache_dir {path} is a symbolic link; pass the real directory instead")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.is_dir():
        raise StoreError(f"cache_dir {path} exists and is not a directory")
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
    with os.fdopen(fd, "rb") as f:
        raw = f.read()
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


def _open_fields(path: Path, verify: bool, expect_fingerprint: str | None) -> Store:
    manifest = read_manifest(path)
    if expect_fingerprint is not None and manifest["fingerprint"] != expect_fingerprint:
        raise CacheInvalidError(
            f"{path} holds fingerprint {manifest['fingerprint'][:16]}, expected {expect_fingerprint[:16]}"
        )
    fields, infos = [], []
    n = int(manifest["n"])
    for entry in manifest["fields"]:
        file = path / entry["file"]
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
            arr = np.load(file, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise CacheInvalidError(f"{file} is not a valid .npy file ({e})") from e
        info = FieldInfo(entry["name"], entry["dtype"], tuple(entry["shape"]), entry.get("kind", "other"))
        if arr.dtype.str != info.dtype or arr.shape != (n, *info.shape):
            raise CacheInvalidError(
                f"{file} holds {arr.dtype} {arr.shape}, the manifest says {np.dtype(info.dtype)} {(n, *info.shape)}"
            )
        fields.append(arr)
        infos.append(info)
    return Store(fields, infos, manifest["spec"], manifest["fingerprint"], path, manifest)


def sweep_temporaries(cache_dir: Path, max_age_s: float = 24 * 3600) -> list[Path]:
    """Remove temporary build directories left by dead writers (this host) or old ones (any host)."""
    removed = []
    host = socket.gethostname()
    for p in cache_dir.glob(f"{_TMP_PREFIX}*"):
        parts = p.name[len(_TMP_PREFIX):].split("~")
        dead = False
        if len(parts) >= 3 and parts[1] == host:
            with contextlib.suppress(ValueError):
                dead = not pid_alive(int(parts[2]))
        with contextlib.suppress(OSError):
            dead = dead or time.time() - os.lstat(p).st_mtime > max_age_s
        if dead and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def remove_cache(path: Path) -> None:
    """Move aside then delete, so a concurrent reader never sees a half-deleted store.

    Processes that have the store's files mapped keep reading them: unlinking a file
    does not take its pages from a mapping.
    """
    trash = path.with_name(f"{_TMP_PREFIX}trash~{socket.gethostname()}~{os.getpid()}~{path.name}")
    try:
        os.rename(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def store_dir(cache_dir: str | os.PathLike, name: str, fp: str, namespace: str = "") -> Path:
    """Where :func:`build_store` publishes the store of ``name`` with fingerprint ``fp``."""
    ns = F.sanitise_namespace(namespace) if namespace else ""
    return Path(cache_dir, ns) / f"{name}-{fp[:16]}" if ns else Path(cache_dir) / f"{name}-{fp[:16]}"


def lock_path(cache: Path) -> Path:
    """The build lock of the cache directory ``cache`` (beside it, so pruning the cache keeps the lock)."""
    return cache.with_name(f"{_LOCK_PREFIX}{cache.name}")


# --------------------------------------------------------------------------- space


def _estimate_nbytes(n: int, infos: Sequence[FieldInfo]) -> int:
    """Bytes the store will take: each field's rows, its .npy header, and room for the manifest."""
    return sum(n * i.row_nbytes + _NPY_HEADER for i in infos) + (64 << 10)


def _no_room(name: str, root: Path, free: int, n: int, infos: Sequence[FieldInfo]) -> StoreError:
    row = sum(i.row_nbytes for i in infos)
    return StoreError(
        f"caching '{name}' needs {fmt_bytes(_estimate_nbytes(n, infos))} ({n} samples x {fmt_bytes(row)}) in "
        f"cache_dir {root}, which has {fmt_bytes(free)} free; set cache_dir to a filesystem with more room "
        "(or free space there)"
    )


def _check_space(name: str, root: Path, n: int, infos: Sequence[FieldInfo]) -> None:
    free = shutil.disk_usage(root).free
    if free < _estimate_nbytes(n, infos):
        raise _no_room(name, root, free, n, infos)


def _reserve(files: Sequence[Path], name: str, root: Path, n: int, infos: Sequence[FieldInfo]) -> None:
    """Allocate every file's blocks now, so a full disk is ENOSPC here and never a SIGBUS while filling."""
    if not hasattr(os, "posix_fallocate"):
        return
    free = shutil.disk_usage(root).free  # before this build's own allocations, for the message
    for f in files:
        fd = os.open(f, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _no_room(name, root, free, n, infos) from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            return  # the filesystem cannot reserve space: fill as before
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- building


class _FillChunks(torch.utils.data.Dataset):
    """Runs the static transform over index ranges and writes rows straight into the memmaps.

    Used in-process or inside DataLoader workers: each worker opens the temporary
    ``.npy`` files read-write and fills its own rows, so no sample crosses a pipe.
    """

    def __init__(self, dataset: Any, transform: Callable, files: list[Path], infos: list[FieldInfo],
                 chunks: list[tuple[int, int]]) -> None:
        self.dataset, self.transform, self.files, self.infos, self.chunks = dataset, transform, files, infos, chunks
        self._arrays: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, k: int) -> int | str:
        """Fill chunk ``k``; returns the rows written, or the message of a bad sample.

        Bad input comes back as a value rather than an exception, so a worker's message
        reaches the user as it is, not inside DataLoader's worker traceback.
        """
        if self._arrays is None:
            self._arrays = [np.load(f, mmap_mode="r+", allow_pickle=False) for f in self.files]
        a, b = self.chunks[k]
        try:
            for i in range(a, b):
                _, leaves = flatten(self.transform(self.dataset[i]), i)
                _check_like(self.infos, leaves, i)
                for arr, (_, value) in zip(self._arrays, leaves, strict=True):
                    arr[i] = value
        except StoreError as e:
            return f"{type(e).__name__}:{e}"
        for arr in self._arrays:
            arr.flush()
        return b - a


def _fill(dataset: Any, transform: Callable, files: list[Path], infos: list[FieldInfo], n: int,
          workers: int, desc: str, progress: bool) -> None:
    from tqdm.auto import tqdm

    chunk = max(1, min(256, math.ceil(n / max(1, workers * 8))))
    chunks = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
    filler = _FillChunks(dataset, transform, files, infos, chunks)
    with tqdm(total=n, desc=desc, unit="sample", disable=not progress, leave=False) as bar:
        if workers <= 1:
            results: Any = (filler[k] for k in range(len(chunks)))
        else:
            results = torch.utils.data.DataLoader(
                filler, batch_size=None, num_workers=workers, shuffle=False,
                worker_init_fn=_single_thread_worker,
            )
        for done in results:
            if isinstance(done, str):
                kind, _, message = done.partition(":")
                raise (UnstorableSampleError if kind == UnstorableSampleError.__name__ else StoreError)(message)
            bar.update(int(done))


def _single_thread_worker(_: int) -> None:
    torch.set_num_threads(1)


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
        dataset: A map-style dataset (``__len__`` and ``__getitem__``).
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

    Raises:
        StoreError: for an empty dataset, samples that cannot form one store, a full
            disk, or a dead lock holder; the message names the culprit and the fix.
            Nothing half-written is left.
    """
    warn = warn or _warn
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.startswith("."):
        raise StoreError(f"split name {name!r} must be letters, digits, '_', '-' or '.' (it names a directory)")
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
    probe = _probe(dataset, transform, n, probes)
    if field_kinds:
        probe.infos = _override_kinds(probe.infos, field_kinds)
        config = {**(config or {}), "field_kinds": dict(field_kinds)}
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
    with _build_lock(lock_path(final), what, lock_timeout_s):
        if final.exists():  # another process may have built or repaired it while we waited
            try:
                return open_store(final, verify=verify, expect_fingerprint=digest)
            except CacheInvalidError as e:
                reason = e
            warn(f"lightning_fastdata: rebuilding the '{name}' cache: {reason}")
            remove_cache(final)
        else:
            _warn_what_changed(root, name, final, fp, warn)
        _check_deterministic(dataset, transform, probe, warn)
        _build(dataset, transform, root, final, name, n, namespace, fp, probe, num_workers, progress,
               parallel_threshold_s)
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


def _build(dataset: Any, transform: Callable, root: Path, final: Path, name: str, n: int, namespace: str,
           fp: F.Fingerprint, probe: _Probe, num_workers: int | None, progress: bool,
           parallel_threshold_s: float) -> None:
    """Write the store into a temporary directory and publish it by one rename; leave nothing on failure."""
    infos = probe.infos
    _check_space(name, root, n, infos)
    host = socket.gethostname().replace("~", "-")
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{name}~{host}~{os.getpid()}~", dir=root))
    try:
        files = []
        for k, info in enumerate(infos):
            f = tmp / f"field_{k}.npy"
            arr = np.lib.format.open_memmap(f, mode="w+", dtype=np.dtype(info.dtype), shape=(n, *info.shape))
            del arr
            os.chmod(f, 0o600)
            files.append(f)
        _reserve(files, name, root, n, infos)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = num_workers if num_workers is not None else (
            min(cores, 8) if probe.per_sample_s * n > parallel_threshold_s and cores > 1 else 0
        )
        _fill(dataset, transform, files, infos, n, workers, f"fastdata: caching '{name}'", progress)
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "namespace": namespace,
            "name": name,
            "n": n,
            "fingerprint": fp.digest,
            "fingerprint_components": fp.components,
            "spec": probe.spec,
            "fields": [
                {"name": i.name, "kind": i.kind, "file": f.name, "dtype": i.dtype, "shape": list(i.shape),
                 "bytes": f.stat().st_size, "crc32": _crc32(f)}
                for i, f in zip(infos, files, strict=True)
            ],
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        manifest["manifest_crc32"] = _manifest_crc(manifest)
        fd = os.open(tmp / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.close(os.open(tmp / READERS, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        try:
            os.rename(tmp, final)
        except OSError:
            # Another writer published the same fingerprint first: theirs is as good as ours.
            if not (final / MANIFEST).exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


