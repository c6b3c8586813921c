"""Writing a store's files: the layout of its fields, the space they need, and the parallel fill.

Fixed-shape fields are preallocated ``.npy`` memmaps (reserved with ``posix_fallocate``,
so that a full disk is an error up front, never a SIGBUS) that every chunk of samples
fills in place; a ragged field's chunks write part files that are joined at the end.
Everything here works inside the private temporary directory that
:func:`~lightning_fastdata.store.build_store` publishes with one rename.
"""

from __future__ import annotations

import contextlib
import errno
import io
import math
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_fastdata import encode as E
from lightning_fastdata._lightning import shutdown_dataloader_workers
from lightning_fastdata._util import fmt_bytes
from lightning_fastdata.structure import (
    FieldInfo,
    StoreError,
    container_paths,
    flatten_like,
    ragged_info,
    read_sample,
    sample_name,
)

_NPY_HEADER = 4096  # upper bound of one .npy header, for the space estimate
_COPY_BLOCK = 16 << 20


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
            # jpeg_channels: what a decode gives (source bytes RGB, encoded images their own
            # channels); caches built under the earlier rule (always RGB) are rebuilt.
            out.update(encode=dict(self.encode), jpeg_quality=self.jpeg_quality, max_side=self.max_side,
                       jpeg_channels="images-kept-bytes-rgb")
        return {"store_layout": out} if out else {}

    def apply(self, infos: list[FieldInfo], spec: dict | None = None) -> list[FieldInfo]:
        """The stored form of the probe's fields (``spec``: their structure); unknown names are a
        :class:`StoreError`."""
        names = [i.name for i in infos]
        containers = container_paths(spec) if spec is not None else set()
        for what, named in (("ragged", self.ragged), ("encode", [n for n, _ in self.encode])):
            for name in named:
                inner = [n for n in names if n.startswith(name + ".")]
                if name not in names and (inner or name in containers):
                    # A list, tuple or dict is a structure: each of its elements became a field.
                    listed = (", ".join(map(repr, inner[:4])) + (", ..." if len(inner) > 4 else "")
                              if inner else "none here: it is empty")
                    field = "a ragged field" if what == "ragged" else "an encoded field"
                    raise StoreError(f"{what} names {name!r}, which the samples hold as a list, tuple or dict, so "
                                     f"each element is a field of its own ({listed}); {field} is one tensor or "
                                     "ndarray: make static_transform return it as one (e.g. torch.as_tensor(boxes) "
                                     "for a list of boxes)")
                if name not in names:
                    raise StoreError(f"{what} names a field {name!r} that the samples do not have; their fields "
                                     f"are {names} (dict keys, or positions '0', '1' for tuples)")
        return [ragged_info(i, encoding=self.encoding(i.name)) if self.is_ragged(i.name) else i for i in infos]

    def check_aligned(self, infos: Sequence[FieldInfo], leaves: Sequence[tuple[str, np.ndarray]], index: int) -> None:
        """Refuse a sample whose encoded image ``max_side`` would shrink while a field of its size is kept.

        ``max_side`` resizes the encoded field only: a mask (or any field) stored at the
        image's ``(H, W)`` would silently stop lining up with it, so that is an error.
        """
        if self.max_side is None or not self.encode:
            return
        for info, (_, value) in zip(infos, leaves, strict=True):
            size = E.source_size(value) if info.encoding is not None else None
            if size is None or E.capped_size(*size, self.max_side) == size:
                continue
            for other, (_, kept) in zip(infos, leaves, strict=True):
                if other.encoding is None and kept.ndim >= 2 and tuple(kept.shape[-2:]) == size:
                    h, w = E.capped_size(*size, self.max_side)
                    raise StoreError(
                        f"sample {index}: max_side={self.max_side} shrinks the encoded field '{info.name}' from "
                        f"{size[0]}x{size[1]} to {h}x{w}, but field '{other.name}' {tuple(kept.shape)} has its size "
                        "and is stored as it is, so the two would no longer line up; resize both in "
                        "static_transform (a mask with nearest interpolation) and set max_side=None"
                    )

    def unscaled_note(self, infos: Sequence[FieldInfo]) -> str | None:
        """A warning when ``max_side`` may shrink encoded images while other array fields are kept
        as they are: pixel coordinates in them (boxes, keypoints) would no longer match."""
        if self.max_side is None or not self.encode:
            return None
        encoded = [i.name for i in infos if i.encoding is not None]
        kept = [i.name for i in infos if i.encoding is None and (i.ragged or len(i.shape) >= 1)]
        if not kept:
            return None
        return (f"lightning_fastdata: max_side={self.max_side} shrinks the encoded field(s) {encoded} of larger "
                f"samples, but the field(s) {kept} are stored as they are: if they hold pixel coordinates (boxes, "
                "keypoints), they no longer match the stored image. Scale them in static_transform (resize the "
                "image there too and set max_side=None), or hold coordinates relative to the image size (0 to 1).")

    def stored(self, info: FieldInfo, value: np.ndarray, index: int,
               dataset: Any = None) -> tuple[np.ndarray, tuple[int, ...] | None]:
        """A sample's value as stored, and its decoded shape when encoded (``None`` otherwise).

        ``dataset``, the source, only names the sample's file in an error (see :func:`sample_name`).
        """
        if info.encoding is None:
            return value, None
        try:
            return E.encode_jpeg_leaf(value, self.jpeg_quality, self.max_side,
                                      f"{sample_name(dataset, index)}, field '{info.name}'")
        except ValueError as e:
            raise StoreError(str(e)) from None




# --------------------------------------------------------------------------- space


def _field_nbytes(n: int, info: FieldInfo) -> int:
    """Bytes one field's files will take (a ragged field's values estimated from the probe samples)."""
    if not info.ragged:
        return n * info.row_nbytes + _NPY_HEADER
    index = 8 * ((n + 1) + n * len(info.shape) + (3 * n if info.encoding else 0))
    return n * info.mean_nbytes + index + 4 * _NPY_HEADER


def estimate_nbytes(n: int, infos: Sequence[FieldInfo]) -> int:
    """Bytes the store will take: each field's rows, its .npy headers, and room for the manifest."""
    return sum(_field_nbytes(n, i) for i in infos) + (64 << 10)


def no_room(name: str, root: Path, free: int, n: int, infos: Sequence[FieldInfo],
            written: int | None = None) -> StoreError:
    """The error for a cache that does not fit: refused up front, or (``written``: the bytes the
    build had written) the disk filled up while writing, beyond the estimate."""
    row = sum(i.row_nbytes for i in infos)
    per = "on average, estimated from the probe samples" if any(i.ragged for i in infos) else ""
    if written is not None:
        estimate = estimate_nbytes(n, infos)
        if written > estimate:
            why = (" (the other samples are larger than the probe samples, from which it was estimated)" if per
                   else "")
        else:  # within the estimate, and it fitted at the start: something else took the space meanwhile
            why = " (the free space fell during the build: another process wrote to that filesystem)"
        return StoreError(
            f"the disk of cache_dir {root} filled up while caching '{name}', after {fmt_bytes(written)} written "
            f"of an estimated {fmt_bytes(estimate)}{why}; {fmt_bytes(free)} were free at the "
            "start. Set cache_dir to a filesystem with more room (or free space there); nothing of this build "
            "is kept"
        )
    return StoreError(
        f"caching '{name}' needs {fmt_bytes(estimate_nbytes(n, infos))} ({n} samples x {fmt_bytes(row)}"
        f"{', ' + per if per else ''}) in cache_dir {root}, which has {fmt_bytes(free)} free; set cache_dir to a "
        "filesystem with more room (or free space there)"
    )


def check_space(name: str, root: Path, n: int, infos: Sequence[FieldInfo]) -> None:
    free = shutil.disk_usage(root).free
    if free < estimate_nbytes(n, infos):
        raise no_room(name, root, free, n, infos)


def reserve(files: Sequence[Path], name: str, root: Path, n: int, infos: Sequence[FieldInfo]) -> None:
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
                raise no_room(name, root, free, n, infos) from e
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


class _NoRoom(Exception):
    """ENOSPC/EDQUOT from the build's own writes (not from the user's transform)."""


@contextlib.contextmanager
def _own_writes() -> Iterator[None]:
    """Mark a full disk in the package's own writes as :class:`_NoRoom`."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _NoRoom(str(e)) from e
        raise


def field_files(k: int, info: FieldInfo) -> dict[str, str]:
    """The file of each role of field ``k``: ``data`` for a fixed field; values, offsets, shapes (decoded)."""
    if not info.ragged:
        return {"data": f"field_{k}.npy"}
    roles = ("values", "offsets", "shapes", "decoded") if info.encoding else ("values", "offsets", "shapes")
    return {role: f"field_{k}.{role}.npy" for role in roles}


def _part_file(k: int, chunk: int) -> str:
    return f"field_{k}.part{chunk:08d}"


def create_fixed_files(tmp: Path, n: int, infos: list[FieldInfo]) -> list[Path]:
    """Create every file whose size is known before filling (all but the ragged values)."""
    made = []
    for k, info in enumerate(infos):
        files = field_files(k, info)
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

    def __init__(self, dataset: Any, transform: Callable, tmp: Path, spec: dict, infos: list[FieldInfo],
                 chunks: list[tuple[int, int]], layout: Layout) -> None:
        self.dataset, self.transform, self.tmp, self.spec, self.infos = dataset, transform, tmp, spec, infos
        self.chunks, self.layout = chunks, layout
        self._arrays: list[dict[str, np.ndarray]] | None = None

    def __len__(self) -> int:
        return len(self.chunks)

    def _open(self) -> list[dict[str, np.ndarray]]:
        return [{role: np.load(self.tmp / f, mmap_mode="r+", allow_pickle=False)
                 for role, f in field_files(k, info).items() if role != "values"}
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
            with _own_writes():
                for k, info in enumerate(self.infos):
                    if info.ragged:
                        fd = os.open(self.tmp / _part_file(k, c), os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                                     | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                        parts[k] = os.fdopen(fd, "wb")
            for i in range(a, b):
                # The user's code: its errors (an ENOSPC on its own scratch file too) propagate as
                # they are, with a note naming the sample.
                leaves = flatten_like(self.spec, self.infos, read_sample(self.dataset, self.transform, i), i)
                self.layout.check_aligned(self.infos, leaves, i)
                for k, (info, (_, value)) in enumerate(zip(self.infos, leaves, strict=True)):
                    arrays = self._arrays[k]
                    if not info.ragged:
                        arrays["data"][i] = value
                        continue
                    stored, decoded = self.layout.stored(info, value, i, self.dataset)
                    arrays["offsets"][i + 1] = stored.size
                    arrays["shapes"][i] = stored.shape
                    if decoded is not None:
                        arrays["decoded"][i] = decoded
                    with _own_writes():
                        parts[k].write(memoryview(np.ascontiguousarray(stored).reshape(-1).view(np.uint8)))
            with _own_writes():
                for k in list(parts):
                    parts.pop(k).close()  # flushes: a full disk shows here at the latest
                for arrays in self._arrays:
                    for arr in arrays.values():
                        arr.flush()
        except StoreError as e:
            return f"{type(e).__name__}:{e}"
        except _NoRoom as e:
            return f"{_NO_ROOM}:{e}"
        finally:
            for fh in parts.values():
                with contextlib.suppress(OSError):
                    fh.close()
        return b - a


def fill(dataset: Any, transform: Callable, tmp: Path, spec: dict, infos: list[FieldInfo], n: int, layout: Layout,
          workers: int, desc: str, progress: bool, no_room: Callable[[], StoreError], split: str = "") -> int:
    """Fill every row; returns the number of chunks (a ragged field has one part file per chunk).

    ``spec`` and ``infos`` are sample 0's structure and fields, which every sample must match.

    A build worker that dies (the out-of-memory killer) is a :class:`StoreError` naming
    ``split``, the samples in flight and the fix.
    """
    from tqdm.auto import tqdm

    chunk = max(1, min(256, math.ceil(n / max(1, workers * 8))))
    chunks = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
    filler = _FillChunks(dataset, transform, tmp, spec, infos, chunks, layout)
    loader = None
    try:
        with tqdm(total=n, desc=desc, unit="sample", disable=not progress, leave=False) as bar:
            if workers <= 1:
                results: Any = (filler[k] for k in range(len(chunks)))
            else:
                # Persistent, so the loader holds its iterator and `finally` can stop the workers:
                # an iterator abandoned by an exception is kept alive by its traceback, and so are
                # its workers (a retry in the same process then forks them, printing spurious errors).
                loader = torch.utils.data.DataLoader(
                    filler, batch_size=None, num_workers=workers, shuffle=False, persistent_workers=True,
                    worker_init_fn=_single_thread_worker,
                )
                results = iter(loader)
            c = 0
            try:
                for done in results:
                    if isinstance(done, str):
                        kind, _, message = done.partition(":")
                        if kind == _NO_ROOM:
                            raise no_room()
                        # Sample 0 was stored, so no later sample makes the split unstorable by design
                        # (see flatten_like): every refusal is a StoreError.
                        raise StoreError(message)
                    bar.update(int(done))
                    c += 1
            except RuntimeError as e:
                # torch's words for a worker that exited (SIGKILL, a segfault): it says nothing of the build
                if loader is None or not str(e).startswith("DataLoader worker (pid"):
                    raise
                # in flight: the chunks after the last one received, up to the loader's prefetch
                last = chunks[min(len(chunks), c + workers * (loader.prefetch_factor or 2)) - 1][1] - 1
                raise StoreError(_worker_died(split, str(e), chunks[c][0], last, n, workers)) from e
    finally:
        if loader is not None:
            shutdown_dataloader_workers(loader)
    return len(chunks)


def _worker_died(split: str, what: str, first: int, last: int, n: int, workers: int) -> str:
    what_cache = f"the '{split}' cache" if split else "the cache"
    return (f"building {what_cache} failed: a build worker process died ({what}) while caching samples {first}-{last} "
            f"of {n}. A worker killed by a signal was most often killed by the out-of-memory killer: the static "
            f"transform's memory, times {workers} build workers, exceeded what this job may use. Build with fewer "
            "workers: build_store(num_workers=...) sets them (0 builds in this process); a data module builds on "
            "min(8, the CPUs this process may use) workers, so run it under fewer (taskset -c 0-1, or the job's "
            "CPU count); or give the job more memory. Nothing of this build is kept")


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
                block = os.read(fd, min(left, _COPY_BLOCK))
                if not block:
                    break
                view = memoryview(block)
                while len(view):
                    view = view[os.write(dst, view):]
                done = len(block)
            left -= done
    finally:
        os.close(fd)


def join_ragged(tmp: Path, k: int, info: FieldInfo, chunks: int) -> None:
    """Counts -> offsets, and the chunks' part files -> ``values`` (see the note above ``_FillChunks``)."""
    files = field_files(k, info)
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
