"""The cache directory as a whole: list every cache, prune the unused ones.

``cache_dir`` holds one directory per namespace (a data module's ``module.QualName``)
and, in it, one directory per cache, ``<split>-<fingerprint[:16]>`` (see
:mod:`lightning_fastdata.store`). A cache is *in use* while a process has it open (its
reader lease, :mod:`lightning_fastdata.locks`) or holds its build lock; pruning never
removes one in use, and never touches a build in progress (its temporary directory).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from lightning_fastdata import locks
from lightning_fastdata import store as S


@dataclass
class CacheInfo:
    """One cache directory as :func:`list_caches` sees it."""

    path: Path
    namespace: str
    split: str
    fingerprint: str
    samples: int | None
    nbytes: int
    created: str
    last_used: float
    in_use: bool
    problem: str = ""


def _dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for nm in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, nm)).st_size
    return total


def _cache_dirs(root: Path) -> list[tuple[str, Path]]:
    """(namespace, cache dir) for every cache in ``root`` and in its namespace directories."""
    out: list[tuple[str, Path]] = []

    def scan(d: Path, ns: str) -> list[Path]:
        subdirs = []
        with contextlib.suppress(OSError):
            for p in sorted(d.iterdir()):
                if p.name.startswith(".") or p.is_symlink() or not p.is_dir():
                    continue
                if S.CACHE_NAME.fullmatch(p.name) and (p / S.MANIFEST).exists():
                    out.append((ns, p))
                else:
                    subdirs.append(p)
        return subdirs

    for sub in scan(root, ""):
        scan(sub, sub.name)
    return out


def _namespace_dirs(root: Path) -> list[Path]:
    """``root`` and the namespaces in it: the directories holding a cache, a build lock (a
    killed first build leaves its lock beside its temporary) or one of this package's
    temporaries (a removal that failed midway leaves its trash, with no lock). Any other
    directory (a user's own, kept in the cache dir) is not ours to sweep."""
    out = [root]
    with contextlib.suppress(OSError):
        for p in sorted(root.iterdir()):
            if p.name.startswith(".") or p.is_symlink() or not p.is_dir() or _is_cache(p):
                continue
            with contextlib.suppress(OSError):
                if any(q.name.startswith(S.LOCK_PREFIX) or S.is_build_temporary(q.name) or _is_cache(q)
                       for q in p.iterdir()):
                    out.append(p)
    return out


def _is_cache(p: Path) -> bool:
    return bool(S.CACHE_NAME.fullmatch(p.name)) and (p / S.MANIFEST).exists()


def build_temporaries(cache_dir: str | os.PathLike) -> list[tuple[Path, int]]:
    """The temporary directories of builds (and removals) under ``cache_dir``, with their bytes:
    builds in progress, and those a killed build left (``prune`` removes these)."""
    root = Path(cache_dir)
    if not root.is_dir() or root.is_symlink():
        return []
    return [(p, _dir_bytes(p)) for d in _namespace_dirs(root) for p in sorted(d.glob(f"{S.TMP_PREFIX}*"))
            if S.is_build_temporary(p.name) and p.is_dir() and not p.is_symlink()]


def list_caches(cache_dir: str | os.PathLike) -> list[CacheInfo]:
    """Every cache under ``cache_dir``: namespace, split, fingerprint, samples, bytes, created, last used, in use."""
    root = Path(cache_dir)
    if not root.is_dir() or root.is_symlink():
        return []
    out = []
    for ns, path in _cache_dirs(root):
        m = S.CACHE_NAME.fullmatch(path.name)
        assert m is not None
        problem, samples, created = "", None, ""
        try:
            manifest = S.read_manifest(path, check_version=False)
            samples, created = int(manifest.get("n", 0)), str(manifest.get("created", ""))
            if manifest.get("version") != S.FORMAT_VERSION:
                problem = f"store format version {manifest.get('version')}: this release cannot read it"
        except S.CacheInvalidError as e:
            problem = str(e)
        out.append(CacheInfo(path, ns, m["split"], m["fp"], samples, _dir_bytes(path), created, S.last_used(path),
                             locks.busy(path / S.READERS) or locks.busy(S.lock_path(path)), problem))
    return out


@dataclass
class PruneResult:
    """What :func:`prune_caches` did (or would do) with one cache."""

    cache: CacheInfo
    removed: bool
    reason: str
    #: Why a removal that was attempted failed (the OSError's text); empty otherwise.
    error: str = ""


def prune_caches(cache_dir: str | os.PathLike, older_than_s: float | None = None, keep_latest: bool = False,
                 dry_run: bool = False, now: float | None = None) -> list[PruneResult]:
    """Remove caches nobody uses: not open by any process, not being built, optionally old.

    Args:
        cache_dir: The cache directory (all namespaces in it).
        older_than_s: Only caches last used more than this many seconds ago.
        keep_latest: Keep the most recently used cache of every (namespace, split).
        dry_run: Say what would be removed, remove nothing.
        now: The current time (``time.time()``), for tests.

    Returns:
        One result per cache found, removed or kept with the reason; a cache whose
        removal failed is kept, with ``error`` set.
    """
    now = time.time() if now is None else now
    caches = list_caches(cache_dir)
    latest: dict[tuple[str, str], CacheInfo] = {}
    for c in caches:
        key = (c.namespace, c.split)
        if key not in latest or c.last_used > latest[key].last_used:
            latest[key] = c
    results = []
    for c in caches:
        if keep_latest and latest[(c.namespace, c.split)] is c:
            results.append(PruneResult(c, False, "kept: the latest of its namespace and split"))
        elif older_than_s is not None and now - c.last_used <= older_than_s:
            results.append(PruneResult(c, False, f"kept: used {_age(now - c.last_used)} ago"))
        elif dry_run:
            reason = "kept: in use" if c.in_use else "would be removed"
            results.append(PruneResult(c, False, reason))
        else:
            try:
                why = _remove_if_unused(c.path)
            except OSError as e:  # it stays: say so, never count it as removed
                results.append(PruneResult(c, False, f"kept: could not remove it ({e.strerror or e})", str(e)))
            else:
                results.append(PruneResult(c, why is None, why or "removed"))
    root = Path(cache_dir)
    if not dry_run and root.is_dir() and not root.is_symlink():
        # Every namespace, not only those holding a cache: a first build killed midway leaves
        # its temporary (preallocated to the store's full size) in a namespace with no cache.
        for d in _namespace_dirs(root):
            S.sweep_temporaries(d)
    return results


def _remove_if_unused(path: Path) -> str | None:
    """Remove ``path`` unless a process reads or builds it; ``None`` when removed, else why not.

    Raises:
        OSError: the cache could not be locked or removed (it is still there).
    """
    lock = locks.try_lock(S.lock_path(path))
    if lock is None:
        return "kept: in use (being built or validated)"
    try:
        with locks.exclusive(path / S.READERS) as free:
            if not free:
                return "kept: in use (a process has it open)"
            error = S.remove_cache(path)  # a reader opening it meanwhile finds it gone, and rebuilds
            if error is not None:
                raise error
        with contextlib.suppress(OSError):
            os.unlink(S.lock_path(path))
        return None
    finally:
        lock.release()


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"
