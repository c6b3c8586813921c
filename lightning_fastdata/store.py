"""The array store: a dataset's static outputs as one contiguous array per field.

A sample (a tensor, number, ndarray, or a tuple/list/dict of those) is flattened into
leaves; leaf ``k`` of every sample becomes row ``i`` of field array ``k``. On disk a
store is a directory of ``.npy`` files and a JSON manifest (format version, N, dtypes,
shapes, fingerprint, per-file size and CRC32). It is written into a private temporary
directory and published by one atomic ``rename``, so readers never see a partial cache,
and it is opened as read-only memory maps with ``allow_pickle=False``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import socket
import stat
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_fastdata._util import pid_alive

FORMAT = "lightning_fastdata.store"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_TMP_PREFIX = ".tmp-"
_CRC_BLOCK = 16 << 20


class StoreError(ValueError):
    """Bad input while building a store (names the sample index and the fix)."""


class UnstorableSampleError(StoreError):
    """A sample holds a leaf that has no array form (str, None, ...)."""


class CacheInvalidError(RuntimeError):
    """An on-disk cache failed validation; the message says why."""


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


def flatten(sample: Any, index: int = 0) -> tuple[dict, list[tuple[str, np.ndarray]]]:
    """Flatten a sample into ``(spec, [(path, array), ...])`` in a fixed leaf order."""
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
        return {"kind": "leaf", "field": len(leaves) - 1, "type": kind}

    return walk(sample, ""), leaves


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
    """One field of a store: its name (the leaf's path), dtype and per-sample shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def row_nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * math.prod(self.shape))


def _signature(leaves: list[tuple[str, np.ndarray]]) -> list[FieldInfo]:
    return [FieldInfo(p, a.dtype.str, tuple(a.shape)) for p, a in leaves]


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
        infos: Name, dtype and per-sample shape of each field.
        spec: The sample structure (see :func:`flatten`).
        fingerprint: Hex digest identifying source + static transform.
        path: The cache directory, or ``None`` for an in-memory store.
    """

    fields: list[np.ndarray]
    infos: list[FieldInfo]
    spec: dict
    fingerprint: str = ""
    path: Path | None = None
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.fields[0].shape[0])

    @property
    def nbytes(self) -> int:
        """Total bytes of all field arrays."""
        return int(sum(a.nbytes for a in self.fields))

    def batch(self, leaves: Sequence[Any]) -> Any:
        """Rebuild the sample structure around batched leaves."""
        return unflatten(self.spec, leaves)

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
        return cls(fields, infos, spec, fingerprint)


# --------------------------------------------------------------------------- fingerprint


def probe_indices(n: int, probes: int) -> list[int]:
    """Evenly spread sample indices, always including the first and the last."""
    if n <= probes:
        return list(range(n))
    return sorted({round(i * (n - 1) / max(probes - 1, 1)) for i in range(probes)})


def fingerprint(
    dataset: Any,
    transform: Callable[[Any], Any],
    cache_key: str | None = None,
    probes: int = 3,
) -> tuple[str, dict, list[FieldInfo], float]:
    """Identify a (source, static transform) pair from the static outputs of probe samples.

    Covers the source's class and length, the ``cache_key`` and the bytes, dtypes and
    shapes of ``transform(dataset[i])`` for a few probe indices; loader settings never
    enter it. Returns ``(hex digest, spec, field infos, seconds per probe sample)``.
    """
    n = len(dataset)
    cls = type(dataset)
    h = hashlib.sha256()
    head = {"v": FORMAT_VERSION, "cls": f"{cls.__module__}.{cls.__qualname__}", "n": n, "key": cache_key}
    h.update(json.dumps(head, sort_keys=True).encode())
    spec: dict = {}
    infos: list[FieldInfo] = []
    t0 = time.perf_counter()
    idx = probe_indices(n, probes)
    for i in idx:
        s, leaves = flatten(transform(dataset[i]), i)
        if not infos:
            spec, infos = s, _signature(leaves)
            h.update(json.dumps(spec, sort_keys=True).encode())
        else:
            _check_like(infos, leaves, i)
        for path, a in leaves:
            h.update(f"{i}:{path}:{a.dtype.str}:{a.shape}".encode())
            h.update(np.ascontiguousarray(a).tobytes())
    per_sample = (time.perf_counter() - t0) / max(len(idx), 1)
    return h.hexdigest(), spec, infos, per_sample


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


def _read_manifest(path: Path) -> dict:
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
    if manifest.get("version") != FORMAT_VERSION:
        raise CacheInvalidError(
            f"{path} has store format version {manifest.get('version')}, this release reads "
            f"version {FORMAT_VERSION}"
        )
    if manifest.get("manifest_crc32") != _manifest_crc(manifest):
        raise CacheInvalidError(f"{path / MANIFEST} was modified after it was written (checksum mismatch)")
    return manifest


def open_store(path: str | os.PathLike, verify: bool = True, expect_fingerprint: str | None = None) -> Store:
    """Open a published store as read-only memory maps.

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
    manifest = _read_manifest(path)
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
        info = FieldInfo(entry["name"], entry["dtype"], tuple(entry["shape"]))
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


def build_store(
    dataset: Any,
    transform: Callable[[Any], Any],
    cache_dir: str | os.PathLike,
    name: str = "train",
    cache_key: str | None = None,
    probes: int = 3,
    num_workers: int | None = None,
    progress: bool = True,
    parallel_threshold_s: float = 2.0,
) -> Store:
    """Materialise ``transform(dataset[i])`` for every ``i`` into a cached store, or reuse it.

    The cache is ``cache_dir/<name>-<fingerprint[:16]>``. A valid cache with the same
    fingerprint is reused (every file's checksum verified); an invalid one is rebuilt
    with a warning that says why; caches of ``name`` with another fingerprint are
    removed with a warning. Building runs in parallel over the CPU cores when the
    transform is slow enough for it to pay (``parallel_threshold_s`` of estimated
    work).

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

    Raises:
        StoreError: for an empty dataset or samples that cannot form one store; the
            message names the sample index and the fix. Nothing half-written is left.
    """
    try:
        n = len(dataset)
    except TypeError as e:
        raise StoreError(f"source for '{name}' has no len(); a map-style Dataset is required") from e
    if n == 0:
        raise StoreError(
            f"source('{name}') returned an empty dataset ({type(dataset).__name__} of length 0); "
            "check the data path, or return None from source() to skip this split"
        )
    root = ensure_cache_dir(cache_dir)
    sweep_temporaries(root)
    fp, spec, infos, per_sample_s = fingerprint(dataset, transform, cache_key, probes)
    final = root / f"{name}-{fp[:16]}"
    _refuse_symlink(final, "cache directory")

    if final.exists():
        try:
            return open_store(final, verify=True, expect_fingerprint=fp)
        except CacheInvalidError as e:
            rank_zero_warn(f"lightning_fastdata: rebuilding the '{name}' cache: {e}")
            _remove_dir(final)
    for old in root.glob(f"{name}-*"):
        if old == final or old.is_symlink() or not (old / MANIFEST).exists():
            continue
        with contextlib.suppress(CacheInvalidError, KeyError):
            was = _read_manifest(old)["fingerprint"]
            rank_zero_warn(
                f"lightning_fastdata: the '{name}' cache at {old} has fingerprint {was[:16]}, the "
                f"source and static transform now give {fp[:16]} (source or transform changed); "
                "rebuilding and removing the old cache"
            )
            _remove_dir(old)

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
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = num_workers if num_workers is not None else (
            min(cores, 8) if per_sample_s * n > parallel_threshold_s and cores > 1 else 0
        )
        _fill(dataset, transform, files, infos, n, workers, f"fastdata: caching '{name}'", progress)
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "name": name,
            "n": n,
            "fingerprint": fp,
            "spec": spec,
            "fields": [
                {"name": i.name, "file": f.name, "dtype": i.dtype, "shape": list(i.shape),
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
        try:
            os.rename(tmp, final)
        except OSError:
            # Another writer published the same fingerprint first: theirs is as good as ours.
            if not (final / MANIFEST).exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return open_store(final, verify=False, expect_fingerprint=fp)


def _remove_dir(path: Path) -> None:
    """Move aside then delete, so a concurrent reader never sees a half-deleted store."""
    trash = path.with_name(f"{_TMP_PREFIX}trash~{socket.gethostname()}~{os.getpid()}~{path.name}")
    try:
        os.rename(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def store_dir(cache_dir: str | os.PathLike, name: str, fp: str) -> Path:
    """Where :func:`build_store` publishes the store of ``name`` with fingerprint ``fp``."""
    return Path(cache_dir) / f"{name}-{fp[:16]}"
