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
import io
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

from lightning_fastdata import encode as E
from lightning_fastdata import fingerprint as F
from lightning_fastdata import locks
from lightning_fastdata._util import fmt_bytes, pid_alive
from lightning_fastdata.ragged import RaggedArray

FORMAT = "lightning_fastdata.store"
#: 3: ragged fields (values, offsets, shapes files) and JPEG-encoded fields.
FORMAT_VERSION = 3
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
    (``"tv": "image" | "mask" | "other"``), see :func:`field_kinds`. A
    :class:`~lightning_fastdata.ragged.RaggedArray` (a whole ragged field, as
    :meth:`Store.from_arrays` takes) is one leaf, kept as it is.
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
        if isinstance(node, RaggedArray):
            leaves.append((path or "0", node))  # type: ignore[arg-type]
            return {"kind": "leaf", "field": len(leaves) - 1, "type": "ragged"}
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
    """One field of a store: its name (the leaf's path), dtype, per-sample shape and kind.

    A ragged field (``ragged=True``) has ``-1`` for every dimension of ``shape`` (each
    sample has its own, see :class:`~lightning_fastdata.ragged.RaggedArray`), and
    ``mean_nbytes``, its bytes per sample on average (estimated from the probe samples
    while building, exact once stored). A field stored as JPEG has ``encoding="jpeg"``:
    its values are bytes (``dtype`` uint8, ``shape`` ``(-1,)``).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str = "other"
    ragged: bool = False
    encoding: str | None = None
    mean_nbytes: int = 0

    @property
    def row_nbytes(self) -> int:
        """Bytes per sample (the mean for a ragged field)."""
        if self.ragged:
            return int(self.mean_nbytes)
        return int(np.dtype(self.dtype).itemsize * math.prod(self.shape))


def _signature(leaves: list[tuple[str, np.ndarray]]) -> list[FieldInfo]:
    return [FieldInfo(p, a.dtype.str, tuple(a.shape)) for p, a in leaves]


def _ragged_info(info: FieldInfo, kind: str | None = None, encoding: str | None = None) -> FieldInfo:
    """``info`` as a ragged field: -1 per dimension (stored JPEG bytes: one dimension, uint8)."""
    if encoding is not None:
        return replace(info, dtype=np.dtype(np.uint8).str, shape=(-1,), ragged=True, encoding=encoding,
                       kind=kind or info.kind)
    return replace(info, shape=(-1,) * len(info.shape), ragged=True, kind=kind or info.kind)


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
        if e.encoding is not None:
            continue  # the encoder checks each sample: a uint8 image or JPEG bytes
        if e.ragged:
            if len(e.shape) != len(g.shape) or e.dtype != g.dtype:
                raise StoreError(
                    f"sample {index}, ragged field '{g.name}' has {len(g.shape)} dimension(s) {g.shape} dtype "
                    f"{np.dtype(g.dtype)}, sample 0 has {len(e.shape)} dimension(s) dtype {np.dtype(e.dtype)}; "
                    "a ragged field may change its shape from sample to sample, not its number of dimensions "
                    "or its dtype: make static_transform return one of each"
                )
            continue
        if e.shape != g.shape or e.dtype != g.dtype:
            hint = (f"; name it in ragged=[{g.name!r}] if its shape varies by design"
                    if e.shape != g.shape and e.dtype == g.dtype else "")
            raise StoreError(
                f"sample {index}, field '{g.name}' has shape {g.shape} dtype {np.dtype(g.dtype)}, "
                f"sample 0 has shape {e.shape} dtype {np.dtype(e.dtype)}; make static_transform "
                "return one shape and dtype for every sample (e.g. resize to a fixed size), "
                "or pass store=False to load samples one by one through DataLoader workers" + hint
            )


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
        return cls(fields, _with_kinds(infos, spec), spec, fingerprint)


# --------------------------------------------------------------------------- probing


probe_indices = F.probe_indices


@dataclass(frozen=True)
class Layout:
    """How a store keeps its fields: which are ragged, which are encoded as JPEG, and how.

    Attributes:
        ragged: Fields whose shape may vary from sample to sample.
        encode: Field -> "jpeg" (an encoded field is ragged too).
        jpeg_quality: JPEG quality of store-time encoding, 1-100.
        max_side: Longest image side after store-time resizing, ``None`` to keep sizes.
    """

    ragged: tuple[str, ...] = ()
    encode: tuple[tuple[str, str], ...] = ()
    jpeg_quality: int = 90
    max_side: int | None = None

    @classmethod
    def of(cls, ragged: Sequence[str] | None = None, encode: Mapping[str, str] | None = None,
           jpeg_quality: int = 90, max_side: int | None = None) -> Layout:
        """A checked layout; raises :class:`StoreError` naming the bad setting."""
        if ragged is None:
            ragged = ()
        if isinstance(ragged, str) or not isinstance(ragged, (list, tuple, set, frozenset)) or not all(
                isinstance(r, str) for r in ragged):
            raise StoreError(f"ragged must be a list of field names, got {ragged!r}")
        try:
            enc = E.check_settings(encode, jpeg_quality, max_side)
        except ValueError as e:
            raise StoreError(str(e)) from None
        return cls(tuple(sorted(set(ragged))), tuple(sorted(enc.items())), jpeg_quality, max_side)

    def encoding(self, name: str) -> str | None:
        return dict(self.encode).get(name)

    def is_ragged(self, name: str) -> bool:
        return name in self.ragged or self.encoding(name) is not None

    def config(self) -> dict[str, Any]:
        """What enters the fingerprint (nothing for a store without ragged or encoded fields)."""
        out: dict[str, Any] = {}
        if self.ragged:
            out["ragged"] = list(self.ragged)
        if self.encode:
            out.update(encode=dict(self.encode), jpeg_quality=self.jpeg_quality, max_side=self.max_side)
        return {"store_layout": out} if out else {}

    def apply(self, infos: list[FieldInfo]) -> list[FieldInfo]:
        """The stored form of the probe's fields; unknown names are a :class:`StoreError`."""
        names = [i.name for i in infos]
        for what, named in (("ragged", self.ragged), ("encode", [n for n, _ in self.encode])):
            for name in named:
                if name not in names:
                    raise StoreError(f"{what} names a field {name!r} that the samples do not have; their fields "
                                     f"are {names} (dict keys, or positions '0', '1' for tuples)")
        return [_ragged_info(i, encoding=self.encoding(i.name)) if self.is_ragged(i.name) else i for i in infos]

    def stored(self, info: FieldInfo, value: np.ndarray, index: int) -> tuple[np.ndarray, tuple[int, ...] | None]:
        """A sample's value as stored, and its decoded shape when encoded (``None`` otherwise)."""
        if info.encoding is None:
            return value, None
        try:
            return E.encode_jpeg_leaf(value, self.jpeg_quality, self.max_side, f"sample {index}, field '{info.name}'")
        except ValueError as e:
            raise StoreError(str(e)) from None


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
        s, leaves = flatten(transform(dataset[i]), i)
        if not infos:
            spec, infos = s, layout.apply(_with_kinds(_signature(leaves), s))
        else:
            _check_like(infos, leaves, i)
        digests[i] = F.leaf_digests(leaves)
        for k, (info, (_, value)) in enumerate(zip(infos, leaves, strict=True)):
            if info.ragged:
                sizes.setdefault(k, []).append(int(layout.stored(info, value, i)[0].nbytes))
    infos = [replace(info, mean_nbytes=-(-sum(sizes[k]) // len(sizes[k]))) if k in sizes else info
             for k, info in enumerate(infos)]
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


def _field_nbytes(n: int, info: FieldInfo) -> int:
    """Bytes one field's files will take (a ragged field's values estimated from the probe samples)."""
    if not info.ragged:
        return n * info.row_nbytes + _NPY_HEADER
    index = 8 * ((n + 1) + n * len(info.shape) + (3 * n if info.encoding else 0))
    return n * info.mean_nbytes + index + 4 * _NPY_HEADER


def _estimate_nbytes(n: int, infos: Sequence[FieldInfo]) -> int:
    """Bytes the store will take: each field's rows, its .npy headers, and room for the manifest."""
    return sum(_field_nbytes(n, i) for i in infos) + (64 << 10)


def _no_room(name: str, root: Path, free: int, n: int, infos: Sequence[FieldInfo]) -> StoreError:
    row = sum(i.row_nbytes for i in infos)
    per = "on average, estimated from the probe samples" if any(i.ragged for i in infos) else ""
    return StoreError(
        f"caching '{name}' needs {fmt_bytes(_estimate_nbytes(n, infos))} ({n} samples x {fmt_bytes(row)}"
        f"{', ' + per if per else ''}) in cache_dir {root}, which has {fmt_bytes(free)} free; set cache_dir to a "
        "filesystem with more room (or free space there)"
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
#
# Fixed-shape fields are preallocated ``.npy`` memmaps (reserved with posix_fallocate)
# that every chunk fills in place. A ragged field's size is known only once every sample
# is transformed, so while filling, chunk c writes its samples' values end to end into
# its own part file ``field_<k>.part<c>`` (plain writes: a full disk is ENOSPC, never a
# SIGBUS) and each sample's element count and shape into preallocated memmaps. After the
# fill, the counts become offsets (a cumulative sum) and the parts are appended in chunk
# order into ``field_<k>.values.npy`` (copy_file_range: in-kernel, each part deleted once
# copied, so the peak is the values plus one part). All of it happens in the private
# temporary directory that is published by one rename, or removed on any failure.

_NO_ROOM = "NoRoom"


def _field_files(k: int, info: FieldInfo) -> dict[str, str]:
    """The file of each role of field ``k``: ``data`` for a fixed field; values, offsets, shapes (decoded)."""
    if not info.ragged:
        return {"data": f"field_{k}.npy"}
    roles = ("values", "offsets", "shapes", "decoded") if info.encoding else ("values", "offsets", "shapes")
    return {role: f"field_{k}.{role}.npy" for role in roles}


def _part_file(k: int, chunk: int) -> str:
    return f"field_{k}.part{chunk:08d}"


def _create_fixed_files(tmp: Path, n: int, infos: list[FieldInfo]) -> list[Path]:
    """Create every file whose size is known before filling (all but the ragged values)."""
    made = []
    for k, info in enumerate(infos):
        files = _field_files(k, info)
        if info.ragged:
            ndim = len(info.shape)
            shapes = {"offsets": ((n + 1,), np.int64), "shapes": ((n, ndim), np.int64), "decoded": ((n, 3), np.int64)}
            todo = [(files[r], *shapes[r]) for r in files if r != "values"]
        else:
            todo = [(files["data"], (n, *info.shape), np.dtype(info.dtype))]
        for fname, shape, dtype in todo:
            f = tmp / fname
            arr = np.lib.format.open_memmap(f, mode="w+", dtype=dtype, shape=shape)
            del arr
            os.chmod(f, 0o600)
            made.append(f)
    return made


class _FillChunks(torch.utils.data.Dataset):
    """Runs the static transform over index ranges and writes rows straight into the files.

    Used in-process or inside DataLoader workers: each worker opens the temporary
    ``.npy`` files read-write and fills its own rows (a ragged field: its own part file,
    see above), so no sample crosses a pipe.
    """

    def __init__(self, dataset: Any, transform: Callable, tmp: Path, infos: list[FieldInfo],
                 chunks: list[tuple[int, int]], layout: Layout) -> None:
        self.dataset, self.transform, self.tmp, self.infos = dataset, transform, tmp, infos
        self.chunks, self.layout = chunks, layout
        self._arrays: list[dict[str, np.ndarray]] | None = None

    def __len__(self) -> int:
        return len(self.chunks)

    def _open(self) -> list[dict[str, np.ndarray]]:
        return [{role: np.load(self.tmp / f, mmap_mode="r+", allow_pickle=False)
                 for role, f in _field_files(k, info).items() if role != "values"}
                for k, info in enumerate(self.infos)]

    def __getitem__(self, c: int) -> int | str:
        """Fill chunk ``c``; returns the rows written, or the message of a bad sample or a full disk.

        Bad input comes back as a value rather than an exception, so a worker's message
        reaches the user as it is, not inside DataLoader's worker traceback.
        """
        if self._arrays is None:
            self._arrays = self._open()
        a, b = self.chunks[c]
        parts: dict[int, Any] = {}
        try:
            for k, info in enumerate(self.infos):
                if info.ragged:
                    fd = os.open(self.tmp / _part_file(k, c), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, 0o600)
                    parts[k] = os.fdopen(fd, "wb")
            for i in range(a, b):
                _, leaves = flatten(self.transform(self.dataset[i]), i)
                _check_like(self.infos, leaves, i)
                for k, (info, (_, value)) in enumerate(zip(self.infos, leaves, strict=True)):
                    arrays = self._arrays[k]
                    if not info.ragged:
                        arrays["data"][i] = value
                        continue
                    stored, decoded = self.layout.stored(info, value, i)
                    arrays["offsets"][i + 1] = stored.size
                    arrays["shapes"][i] = stored.shape
                    if decoded is not None:
                        arrays["decoded"][i] = decoded
                    parts[k].write(memoryview(np.ascontiguousarray(stored).reshape(-1).view(np.uint8)))
            for k in list(parts):
                parts.pop(k).close()  # flushes: a full disk shows here at the latest
        except StoreError as e:
            return f"{type(e).__name__}:{e}"
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                return f"{_NO_ROOM}:{e}"
            raise
        finally:
            for fh in parts.values():
                with contextlib.suppress(OSError):
                    fh.close()
        for arrays in self._arrays:
            for arr in arrays.values():
                arr.flush()
        return b - a


def _fill(dataset: Any, transform: Callable, tmp: Path, infos: list[FieldInfo], n: int, layout: Layout,
          workers: int, desc: str, progress: bool, no_room: Callable[[], StoreError]) -> int:
    """Fill every row; returns the number of chunks (a ragged field has one part file per chunk)."""
    from tqdm.auto import tqdm

    chunk = max(1, min(256, math.ceil(n / max(1, workers * 8))))
    chunks = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
    filler = _FillChunks(dataset, transform, tmp, infos, chunks, layout)
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
                if kind == _NO_ROOM:
                    raise no_room()
                raise (UnstorableSampleError if kind == UnstorableSampleError.__name__ else StoreError)(message)
            bar.update(int(done))
    return len(chunks)


def _copy_into(dst: int, src: Path) -> None:
    """Append the file ``src`` to the descriptor ``dst`` (in the kernel where it can)."""
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        left = os.fstat(fd).st_size
        while left > 0:
            try:
                done = os.copy_file_range(fd, dst, left) if hasattr(os, "copy_file_range") else 0
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                done = 0
            if done == 0:  # no in-kernel copy here: read and write
                block = os.read(fd, min(left, _CRC_BLOCK))
                if not block:
                    break
                view = memoryview(block)
                while len(view):
                    view = view[os.write(dst, view):]
                done = len(block)
            left -= done
    finally:
        os.close(fd)


def _join_ragged(tmp: Path, k: int, info: FieldInfo, chunks: int) -> None:
    """Counts -> offsets, and the chunks' part files -> ``values`` (see the note above ``_FillChunks``)."""
    files = _field_files(k, info)
    offsets = np.load(tmp / files["offsets"], mmap_mode="r+", allow_pickle=False)
    offsets[0] = 0
    np.cumsum(offsets[1:], out=offsets[1:])
    offsets.flush()
    total = int(offsets[-1])
    del offsets
    dtype = np.dtype(info.dtype)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (total,)})
    path = tmp / files["values"]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(header.getvalue())
        while len(view):
            view = view[os.write(fd, view):]
        for c in range(chunks):
            part = tmp / _part_file(k, c)
            _copy_into(fd, part)
            os.unlink(part)
    finally:
        os.close(fd)
    expected = len(header.getvalue()) + total * dtype.itemsize
    if os.stat(path).st_size != expected:  # a bug, not bad input: never publish it
        raise RuntimeError(f"lightning_fastdata: joining the values of field '{info.name}' gave "
                           f"{os.stat(path).st_size} bytes, expected {expected}")


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
        ragged: Fields whose shape may change from sample to sample (the number of
            dimensions and the dtype may not): stored end to end with offsets and
            per-sample shapes (a :class:`~lightning_fastdata.ragged.RaggedArray`).
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
    """
    warn = warn or _warn
    layout = Layout.of(ragged, encode, jpeg_quality, max_side)
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
                      for role, f in _field_files(k, info).items()}
    return entry


def _build(dataset: Any, transform: Callable, root: Path, final: Path, name: str, n: int, namespace: str,
           fp: F.Fingerprint, probe: _Probe, num_workers: int | None, progress: bool,
           parallel_threshold_s: float, layout: Layout) -> None:
    """Write the store into a temporary directory and publish it by one rename; leave nothing on failure."""
    infos = probe.infos
    _check_space(name, root, n, infos)
    free = shutil.disk_usage(root).free  # for the message, should the disk fill up while writing
    host = socket.gethostname().replace("~", "-")
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{name}~{host}~{os.getpid()}~", dir=root))
    try:
        _reserve(_create_fixed_files(tmp, n, infos), name, root, n, infos)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = num_workers if num_workers is not None else (
            min(cores, 8) if probe.per_sample_s * n > parallel_threshold_s and cores > 1 else 0
        )
        chunks = _fill(dataset, transform, tmp, infos, n, layout, workers, f"fastdata: caching '{name}'", progress,
                       lambda: _no_room(name, root, free, n, infos))
        try:
            for k, info in enumerate(infos):
                if info.ragged:
                    _join_ragged(tmp, k, info, chunks)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _no_room(name, root, free, n, infos) from e
            raise
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
        try:
            os.rename(tmp, final)
        except OSError:
            # Another writer published the same fingerprint first: theirs is as good as ours.
            if not (final / MANIFEST).exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


