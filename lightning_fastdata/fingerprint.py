"""What identifies a cache: the code, configuration, files and sample outputs that made it.

A :class:`Fingerprint` is a set of named components, each JSON-able and kept in the
store's manifest, so that when a cache is rebuilt the warning can say what changed:

``code``
    The bytecode and constants of the static transform, of the source's class
    (every method of its class and of its bases, except ``object``/``typing``/
    ``torch.utils.data`` ones) and, when the static transform is a method of the user's
    object (a data module), of that class's ``__init__`` and ``source`` (a constant
    edited there changes what is cached too), recursively for the user's functions and classes they
    reach by global name (in any module of the project: a helper in another file too,
    and what the code reads from a project module it imports whole), and for the methods
    of the transform's own class it reaches through ``self``. Installed code (site-packages,
    the standard library) enters by name and its package's version. Bytecode, not source
    text: an edit to a comment or a blank line does not rebuild a cache, and lambdas and
    functions without a source file are seen.
``config``
    The data module's init arguments that can change what is cached (not its loader
    settings, and the data module's ``hparams``), as canonical text. Values an ``__init__``
    keeps under other names are not read (they may differ per process or rank: a temporary
    directory, ``LOCAL_RANK``); a constant written in ``__init__`` is in the ``code``.
``files``
    Path, size and ``mtime_ns`` of every file the source reads (a hook's list, or paths
    discovered on the dataset: ``ImageFolder.samples`` and the like).
``source``
    The dataset's class, length and construction-time attributes (:data:`SOURCE_ATTRIBUTES`),
    and the samples it holds in memory (:data:`SOURCE_ARRAYS`: ``TensorDataset.tensors``,
    torchvision's ``data``/``targets``); the same for every dataset it wraps, at any depth
    (``Subset(Subset(ConcatDataset([...])))``, every member of a ``ConcatDataset``).
``probes``
    The bytes, dtypes and shapes of the static outputs of probe samples spread over
    the index range.
``cache_key``
    The user's escape hatch: any string.

Only immutable values (numbers, strings, tuples and named tuples, frozen dataclasses, numpy
scalars) and arrays or tensors up to :data:`MAX_GLOBAL_ARRAY` bytes (by content) enter
through module globals, closures and defaults; mutable ones (lists, dicts, objects, larger
arrays) enter by type only, because they often hold state (a memo, a counter) that would
change the fingerprint between two calls in one process. This module imports nothing from
the package but ``_util``.
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import functools
import hashlib
import json
import os
import re
import sys
import sysconfig
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

import numpy as np

from lightning_fastdata._util import fmt_bytes

#: Probe samples per fingerprint, spread over the index range (first and last included).
PROBES = 8
#: Components, in the order a "what changed" message lists them.
COMPONENTS = ("format", "cache_key", "code", "config", "files", "source", "probes")

_ATOMS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))
_MAX_DEPTH = 6
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_MAX_ARRAY_HASH = 256 << 20  # hash arrays up to this size whole; larger ones by 64 evenly spread slices
_DISPLAY = 120  # characters of a config value kept for the "what changed" message
_SKIP_BASES = ("builtins", "typing", "abc", "collections.abc")
#: This package: its classes (``OptimizedDataModule``) are never the user's data module code.
_PACKAGE = __name__.rpartition(".")[0]
#: Arrays and tensors read as module globals, closures or defaults are hashed by content up to
#: this size (a label remap table); larger ones enter by dtype and shape only.
MAX_GLOBAL_ARRAY = 1 << 20
#: Attributes of a source set at construction that decide what it returns (torchvision's
#: conventions, ``Subset.indices``). Other attributes are not hashed: datasets often open
#: handles lazily or memoise, which would change the fingerprint between two calls.
SOURCE_ATTRIBUTES = ("root", "split", "train", "transform", "target_transform", "transforms", "loader", "indices")
#: Attributes that hold a source's samples in memory (``TensorDataset.tensors``, torchvision's
#: ``.data``/``.targets``, SVHN's ``.labels``): hashed when they are arrays or tensors, tuples or
#: lists of them, or lists of plain values. A sample changed there, outside the probes, would
#: otherwise reuse a stale cache when the source loads them from a file it does not name.
SOURCE_ARRAYS = ("tensors", "data", "targets", "labels")


def probe_indices(n: int, probes: int = PROBES) -> list[int]:
    """Evenly spread sample indices, always including the first and the last."""
    if n <= probes:
        return list(range(n))
    return sorted({round(i * (n - 1) / max(probes - 1, 1)) for i in range(probes)})


def _sha(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\x00")
    return h.hexdigest()


@functools.cache
def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(sorted(os.path.realpath(r) + os.sep for r in roots if r))


@functools.lru_cache(maxsize=4096)
def _is_library(module_name: str) -> bool:
    """Installed (site-packages) or standard-library code: named with its version, not hashed.

    Everything else is the user's code and is hashed: a project checkout or an editable
    install, a script's ``__main__``, a notebook's cells (a module without a file).
    """
    if module_name in sys.builtin_module_names:
        return True
    file = getattr(sys.modules.get(module_name), "__file__", None)
    if not file:
        return False
    return os.path.realpath(file).startswith(_library_roots())


def _version(module_name: str) -> str:
    top = module_name.partition(".")[0]
    module = sys.modules.get(top)
    version = getattr(module, "__version__", None)
    return f"{top}=={version}" if isinstance(version, str) else top


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', None) or '?'}.{getattr(obj, '__qualname__', None) or type(obj).__qualname__}"


# --------------------------------------------------------------------------- canonical text


class Canon:
    """Deterministic text for values and digests for code, collecting the code it meets.

    Attributes:
        code: ``{qualified name: digest}`` of every function and class hashed so far.
    """

    def __init__(self) -> None:
        self.code: dict[str, str] = {}
        self._digests: dict[Any, str] = {}
        self._active: set[int] = set()
        self._keep: list[Any] = []  # keeps hashed objects alive so their ids are not reused
        # The object whose bound method is being hashed (``dm.static_transform``): its own
        # attributes that ``self.<name>`` reads (a helper object set in __init__) are reached too.
        self._instance: Any = None

    # ----------------------------------------------------------------- values

    def value(self, obj: Any, mutable: bool = True, depth: int = 0) -> str:
        """Canonical text of ``obj``; with ``mutable=False``, mutable containers and objects enter by type only."""
        t = type(obj)
        if t in _ATOMS:
            if t is bytes and len(obj) > 256:
                return f"bytes[{len(obj)}]:{_sha(obj)[:32]}"
            return repr(obj)
        if isinstance(obj, enum.Enum):
            return f"{_qualname(t)}.{obj.name}"
        if isinstance(obj, PurePath):
            return f"path:{str(obj)!r}"
        if depth > _MAX_DEPTH:
            return f"<{_qualname(t)} (nested too deep)>"
        if isinstance(obj, tuple) and t is not tuple and t.__module__ != "torch":  # a NamedTuple (names: its class)
            return self._record(obj, list(enumerate(obj)), mutable, depth)
        if t is tuple or t is frozenset or (mutable and isinstance(obj, (list, tuple, set, frozenset))):
            return self._sequence(obj, mutable, depth)
        if isinstance(obj, types.CodeType):
            return f"code:{self._code_digest(obj)}"
        if isinstance(obj, (types.FunctionType, types.MethodType, functools.partial, types.BuiltinFunctionType)):
            return f"fn:{self.callable(obj)}"
        if isinstance(obj, type):
            return f"class:{_qualname(obj)}" + (f"[{_version(obj.__module__)}]" if _is_library(obj.__module__) else
                                                f":{self.klass(obj)}")
        if isinstance(obj, types.ModuleType):
            return f"module:{obj.__name__}[{_version(obj.__name__)}]"
        name = _qualname(t)
        if t.__module__ == "torch" and t.__name__ in ("dtype", "device", "Size"):
            return f"{t.__name__}:{obj}"
        if isinstance(obj, np.dtype):
            return f"dtype:{obj.str}"
        if isinstance(obj, np.generic):  # a numpy scalar: immutable
            return f"{name}:{obj.dtype.str}:{obj.tobytes().hex()}"
        if not mutable:
            params = getattr(t, "__dataclass_params__", None)
            if params is not None and params.frozen and not isinstance(obj, type):
                return self._record(obj, [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)], mutable,
                                    depth)
            size = _array_nbytes(obj)
            if size is not None:  # a small table read as a global: by content; a larger one by dtype and shape
                head = f"{name}[{obj.dtype}{list(obj.shape)}]"
                array = _as_array(obj) if size <= MAX_GLOBAL_ARRAY else None
                return f"{head}:{_array_digest(array)}" if array is not None else f"<{head} not hashed>"
            return f"<{name}>"
        if isinstance(obj, Mapping):
            items = [(self.value(k, mutable, depth + 1), self.value(v, mutable, depth + 1)) for k, v in obj.items()]
            return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
        array = _as_array(obj)
        if array is not None:
            return f"{name}[{array.dtype.str}{list(array.shape)}]:{_array_digest(array)}"
        if _is_dataset(obj):  # as a source: never its lazily opened handles or counters
            return f"dataset:{name}[{_safe_len(obj)}]({self.value(_source_state(obj), True, depth + 1)})"
        return self._object(obj, name, depth)

    def _record(self, obj: Any, items: Iterable[tuple[Any, Any]], mutable: bool, depth: int) -> str:
        """A named tuple or frozen dataclass: its class and its fields (name or position, value), one by one."""
        t = type(obj)
        head = f"{_qualname(t)}[{_version(t.__module__)}]" if _is_library(t.__module__) else (
            f"{_qualname(t)}:{self.klass(t)}")
        return f"{head}(" + ", ".join(f"{k}={self.value(v, mutable, depth + 1)}" for k, v in items) + ")"

    def _sequence(self, obj: Any, mutable: bool, depth: int) -> str:
        kind = type(obj).__name__
        if isinstance(obj, (set, frozenset)):
            return f"{kind}{{" + ", ".join(sorted(self.value(v, mutable, depth + 1) for v in obj)) + "}"
        if _plain(obj):  # the common large case (ImageFolder.samples): repr at C speed is canonical
            return f"{kind}:{_sha(repr(obj))}" if len(obj) > 64 else f"{kind}{list(obj)!r}"
        return f"{kind}[" + ", ".join(self.value(v, mutable, depth + 1) for v in obj) + "]"

    def _object(self, obj: Any, name: str, depth: int) -> str:
        """An object: its class (code if the user's, else name and version) and its attributes."""
        key = id(obj)
        if key in self._active:
            return f"<{name} (cycle)>"
        self._active.add(key)
        try:
            module = type(obj).__module__
            head = f"{name}[{_version(module)}]" if _is_library(module) else f"{name}:{self.klass(type(obj))}"
            state = _state(obj)
            if state is not None:
                return f"{head}({self.value(state, True, depth + 1)})"
            text = repr(obj)  # a repr with an address would differ between processes (and ranks)
            return f"<{head}>" if _ADDRESS.search(text) else f"{head}({text})"
        finally:
            self._active.discard(key)

    # ----------------------------------------------------------------- code

    def callable(self, fn: Any) -> str:
        """Digest of a function, bound method, partial or callable object (registered in :attr:`code`)."""
        if isinstance(fn, types.MethodType):
            owner = fn.__self__ if not isinstance(fn.__self__, type) else None
            if owner is None:
                return self.function(fn.__func__, owner=fn.__self__)
            return self.bound(fn.__func__, owner)
        if isinstance(fn, functools.partial):
            args = self.value(fn.args, False) + self.value(fn.keywords, True)
            return _sha("partial", self.callable(fn.func), args)[:16]
        if isinstance(fn, types.FunctionType):
            return self.function(fn)
        if isinstance(fn, types.BuiltinFunctionType):
            return f"{_qualname(fn)}[{_version(getattr(fn, '__module__', '') or 'builtins')}]"
        # a callable object (e.g. a transform pipeline): its class's code and its state
        return _sha("object", self.klass(type(fn)), self.value(fn, True))[:16]

    def bound(self, fn: types.FunctionType, instance: Any) -> str:
        """Digest of ``fn`` as a method of ``instance``: ``self.<name>`` reaches its attributes."""
        outer, self._instance = self._instance, instance
        try:
            return self.function(fn, owner=type(instance))
        finally:
            self._instance = outer

    def function(self, fn: types.FunctionType, owner: type | None = None) -> str:
        """Digest of ``fn``'s code, defaults, closure and the same-module globals it reaches.

        A library function (installed or standard library) is its name and its package's
        version. ``owner``: the class of ``self`` for a method, so that ``self.helper()``
        reaches the helper's code.
        """
        module = fn.__module__ or ""
        if _is_library(module):
            return f"{_qualname(fn)}[{_version(module)}]"
        key = id(fn)
        # A method reads its instance's attributes: its digest is per (function, instance).
        cached = (key, id(self._instance)) if owner is not None and self._instance is not None else key
        if cached in self._digests:
            return self._digests[cached]
        name = _qualname(fn)
        if key in self._active:
            return f"recursive:{name}"
        self._active.add(key)
        self._keep.append(fn)
        try:
            parts = [name, self._code_digest(fn.__code__),
                     self.value(fn.__defaults__, False), self.value(fn.__kwdefaults__, False)]
            for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
                try:
                    contents = cell.cell_contents
                except ValueError:  # an empty cell
                    parts.append("<empty cell>")
                    continue
                if var == "__class__" and isinstance(contents, type):
                    # super()'s cell: the method's own class, by name (its other methods are not this code)
                    parts.append(f"__class__={_qualname(contents)}")
                else:
                    parts.append(self.value(contents, False))
            attrs = _attribute_names(fn.__code__)
            for gname in sorted(_global_names(fn.__code__)):
                if gname in fn.__globals__:
                    parts.append(f"{gname}={self._global(fn.__globals__[gname], module, attrs)}")
            if owner is not None:
                for aname in sorted(attrs):
                    parts.append(self._owner_attribute(owner, aname, module))
            digest = _sha(*parts)[:16]
        finally:
            self._active.discard(key)
        self._digests[cached] = digest
        self.code[name] = digest
        return digest

    def klass(self, cls: type) -> str:
        """Digest of the functions defined in ``cls`` and its bases; library classes by name and version.

        ``object`` and the ``typing``/``abc`` machinery are left out.
        """
        key = id(cls)
        if key in self._digests:
            return self._digests[key]
        name = _qualname(cls)
        if key in self._active:
            return f"recursive:{name}"
        self._active.add(key)
        self._keep.append(cls)
        try:
            parts = [name]
            for base in cls.__mro__:
                if base is object or base.__module__.startswith(_SKIP_BASES):
                    continue
                if _is_library(base.__module__):
                    parts.append(f"{_qualname(base)}[{_version(base.__module__)}]")
                    continue
                parts.append(_qualname(base))
                for attr, value in sorted(vars(base).items()):
                    for fn in _functions_of(value):
                        parts.append(f"{attr}:{self.function(fn, owner=cls)}")
            digest = _sha(*parts)[:16]
        finally:
            self._active.discard(key)
        self._digests[key] = digest
        if not _is_library(cls.__module__):
            self.code[name] = digest
        return digest

    def _code_digest(self, code: types.CodeType) -> str:
        parts: list[str | bytes] = [code.co_code, repr(code.co_names), repr(code.co_varnames),
                                    repr(code.co_freevars), repr(code.co_cellvars), str(code.co_flags)]
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                parts.append(self._code_digest(const))
            else:
                parts.append(self.value(const, False))
        return _sha(*parts)[:16]

    def _global(self, value: Any, home: str, attrs: Iterable[str] = ()) -> str:
        """A global reached by name: the user's code is hashed, whichever module holds it (a
        helper in another file of the project too); installed code is named and versioned.
        A user's module reached by name (``import helpers``) is hashed through what the code
        loads from it (``attrs``: the attribute names it reads)."""
        module = getattr(value, "__module__", None) if isinstance(value, (type, types.FunctionType)) else None
        if module == home or (module is not None and not _is_library(module)):
            return self.klass(value) if isinstance(value, type) else self.function(value)
        if isinstance(value, (type, types.FunctionType)):
            return f"{_qualname(value)}[{_version(module or '')}]"
        if isinstance(value, types.ModuleType) and not _is_library(value.__name__):
            return f"module:{value.__name__}:" + ",".join(
                f"{a}={self._global(getattr(value, a), value.__name__)}" for a in sorted(attrs) if hasattr(value, a))
        return self.value(value, False)

    def _owner_attribute(self, owner: type, name: str, home: str) -> str:
        """``self.<name>`` in a method: methods of the same module are hashed, immutable class values included."""
        try:
            value = next(vars(c)[name] for c in owner.__mro__ if name in vars(c))
        except StopIteration:
            return self._instance_attribute(owner, name)
        for fn in _functions_of(value):
            if fn.__module__ == home:
                return f".{name}:{self.function(fn, owner=owner)}"
            return f".{name}:{_qualname(fn)}"
        if isinstance(value, _ATOMS + (tuple, frozenset)):
            return f".{name}={self.value(value, False)}"
        return f".{name}"


    def _instance_attribute(self, owner: type, name: str) -> str:
        """``self.<name>`` set on the instance (not its class): a function's code, or the code
        of a project class's object (a helper set in ``__init__``; its state does not enter)."""
        instance = self._instance
        state = getattr(instance, "__dict__", None) if isinstance(instance, owner) else None
        if not state or name not in state:
            return f".{name}"
        value = state[name]
        if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
            return f".{name}:{self.callable(value)}"
        cls = type(value)
        if not _is_library(cls.__module__):
            return f".{name}:{self.klass(cls)}"
        return f".{name}"


def _plain(seq: Any) -> bool:
    """Every element an atom, or a tuple of atoms (checked in one pass)."""
    for x in seq:
        t = type(x)
        if t in _ATOMS:
            continue
        if t is tuple and all(type(y) in _ATOMS for y in x):
            continue
        return False
    return True


def _as_array(obj: Any) -> np.ndarray | None:
    if isinstance(obj, np.ndarray):
        return obj
    module = type(obj).__module__
    if module.startswith("torch") and hasattr(obj, "detach") and hasattr(obj, "numpy"):
        try:
            t = obj.detach()
            if str(t.dtype) == "torch.bfloat16":
                t = t.float()
            return t.cpu().numpy()
        except (RuntimeError, TypeError):
            return None
    return None


def _array_nbytes(obj: Any) -> int | None:
    """Bytes of an array or tensor without copying it; None for anything else."""
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if type(obj).__module__.startswith("torch") and hasattr(obj, "element_size") and hasattr(obj, "nelement"):
        try:
            return int(obj.element_size() * obj.nelement())
        except (RuntimeError, TypeError):
            return None
    return None


def _array_digest(a: np.ndarray) -> str:
    if a.dtype == object:
        return "object-array"
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8) if a.size else np.zeros(0, np.uint8)
    if flat.nbytes <= _MAX_ARRAY_HASH:
        return _sha(flat.tobytes())[:32]
    # A huge in-memory array: 64 evenly spread 1 MiB slices (its changes also show in the probes).
    step = flat.nbytes // 64
    return _sha(*(flat[i * step: i * step + (1 << 20)].tobytes() for i in range(64)), str(flat.nbytes))[:32]


def _state(obj: Any) -> dict | None:
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        return state
    slots = [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ()) if isinstance(s, str)]
    if slots:
        return {s: getattr(obj, s) for s in slots if hasattr(obj, s)}
    return None


def _functions_of(value: Any) -> list[types.FunctionType]:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if isinstance(f, types.FunctionType)]
    if isinstance(value, functools.cached_property):
        value = value.func
    return [value] if isinstance(value, types.FunctionType) else []


def _instructions(code: types.CodeType) -> Iterable[tuple[dis.Instruction, types.CodeType]]:
    stack = [code]
    while stack:
        c = stack.pop()
        for ins in dis.get_instructions(c):
            yield ins, c
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))


def _global_names(code: types.CodeType) -> set[str]:
    return {ins.argval for ins, _ in _instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")
            and isinstance(ins.argval, str)}


def _attribute_names(code: types.CodeType) -> set[str]:
    return {ins.argval for ins, _ in _instructions(code) if ins.opname in ("LOAD_ATTR", "LOAD_METHOD")
            and isinstance(ins.argval, str)}


# --------------------------------------------------------------------------- files


def discover_files(source: Any) -> list[str]:
    """Paths a dataset reads, found on its attributes and on those of every dataset it wraps.

    An attribute counts when it is a list or tuple of path strings, or of tuples/lists
    whose first item is a path string (``ImageFolder.samples``, ``.imgs``), and its first
    path exists; or a single string naming an existing file. Datasets it wraps
    (``Subset.dataset``, ``ConcatDataset.datasets``) are searched too, at any depth.
    """
    seen_lists: set[int] = set()
    paths: dict[str, None] = {}
    for ds in _sources(source):
        for value in (_state(ds) or {}).values():
            if isinstance(value, (str, PurePath)):
                p = os.fspath(value)
                if os.path.isfile(p):
                    paths[p] = None
                continue
            if not isinstance(value, (list, tuple)) or not value or id(value) in seen_lists:
                continue
            seen_lists.add(id(value))
            first = value[0]
            if isinstance(first, (list, tuple)) and first and isinstance(first[0], (str, PurePath)):
                if os.path.exists(first[0]):
                    paths.update((os.fspath(v[0]), None) for v in value if isinstance(v, (list, tuple)) and v
                                 and isinstance(v[0], (str, PurePath)))
            elif isinstance(first, (str, PurePath)) and os.path.exists(first):
                paths.update((os.fspath(v), None) for v in value if isinstance(v, (str, PurePath)))
    return list(paths)


def _safe_len(obj: Any) -> int | str:
    try:
        return len(obj)
    except Exception:  # noqa: BLE001 - any failure means "no length" here
        return "?"


def _is_dataset(obj: Any) -> bool:
    # _array_nbytes first: it tells a tensor without copying it off its device
    return hasattr(type(obj), "__getitem__") and hasattr(type(obj), "__len__") and not isinstance(
        obj, (str, bytes, list, tuple, dict, np.ndarray)) and _array_nbytes(obj) is None and _as_array(obj) is None


def files_component(paths: Sequence[str | os.PathLike]) -> dict[str, Any]:
    """Count, total bytes, newest modification and a digest of (path, size, mtime_ns) of every file.

    A file that does not exist enters with size and mtime -1 (the source will fail on it
    anyway, with its own message).
    """
    h = hashlib.sha256()
    total, newest, missing = 0, 0, 0
    for p in paths:
        path = os.fspath(p)
        try:
            st = os.stat(path)
            size, mtime = st.st_size, st.st_mtime_ns
        except OSError:
            size, mtime, missing = -1, -1, missing + 1
        total += max(size, 0)
        newest = max(newest, mtime)
        h.update(f"{path}\x00{size}\x00{mtime}\n".encode())
    return {"count": len(paths), "bytes": total, "newest_mtime_ns": newest, "missing": missing,
            "digest": h.hexdigest()[:32]}


# --------------------------------------------------------------------------- the fingerprint


def _sources(source: Any) -> list[Any]:
    """The source and every dataset it wraps, at any depth, each once, depth first in attribute order.

    Wrapped datasets are attributes that are datasets, or lists, tuples or dict values of them
    (``Subset.dataset``, ``ConcatDataset.datasets``). Every member counts: the samples a 17th shard
    or a third wrapper holds in memory decide what is cached as much as the first one's. Iterative,
    with a visited set: a deep or shared (diamond) graph costs one visit per dataset.
    """
    out: list[Any] = []
    seen: set[int] = set()
    stack = [source]
    while stack:
        ds = stack.pop()
        if id(ds) in seen:
            continue
        seen.add(id(ds))
        out.append(ds)
        inner: list[Any] = []
        for value in (_state(ds) or {}).values():
            items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else (
                value,)
            kinds = _dataset_kinds(items)  # by type first: Subset.indices may hold millions of ints
            if kinds:
                inner += [v for v in items if type(v) in kinds and _is_dataset(v)]
        stack += reversed(inner)  # popped in attribute order
    return out


def _dataset_kinds(items: Iterable[Any]) -> set[type]:
    """The types among ``items`` whose instances may be datasets: sized and indexable, not a
    container, an array or a tensor (``set(map(type, ...))`` runs at C speed)."""
    return {k for k in set(map(type, items)) if hasattr(k, "__getitem__") and hasattr(k, "__len__")
            and not issubclass(k, (str, bytes, list, tuple, dict, np.ndarray))
            and not (k.__module__.startswith("torch") and hasattr(k, "element_size"))}


def _user_classes(cls: type) -> list[type]:
    """The classes of ``cls``'s MRO that are the user's: not installed code, not this package's."""
    return [c for c in cls.__mro__ if c is not object and not _is_library(c.__module__)
            and c.__module__ != _PACKAGE and not c.__module__.startswith(_PACKAGE + ".")]


def _user_instance(transform: Any) -> Any:
    """The object whose method ``transform`` is (the data module), when its class is the user's; else None."""
    owner = getattr(transform, "__self__", None) if isinstance(transform, types.MethodType) else None
    return owner if owner is not None and not isinstance(owner, type) and _user_classes(type(owner)) else None


def code_component(transform: Callable[[Any], Any], source: Any, canon: Canon) -> dict[str, str]:
    """Digests of the static transform and the source's classes (roots), then every user function they reach.

    When ``transform`` is a method of the user's object (``dm.static_transform``), the
    ``__init__`` and ``source`` of its classes are hashed too: a constant edited there
    (``Src(clip=500)`` in ``source``, ``self.clip = 500`` in ``__init__``) changes what is cached.
    Call it after the other components that use ``canon``: it also lists the code those met.
    """
    roots = {"static_transform": canon.callable(transform)}
    owner = _user_instance(transform)
    if owner is not None:
        for cls in _user_classes(type(owner)):
            for name in ("__init__", "source"):
                for fn in _functions_of(vars(cls).get(name)):
                    canon.bound(fn, owner)  # listed in canon.code under its qualified name
    classes: set[type] = set()
    for k, ds in enumerate(_sources(source)):
        if type(ds) not in classes:  # one root per class: 1,000 shards of one class are one code
            classes.add(type(ds))
            roots[f"source class {_qualname(type(ds))}" + (f" #{k}" if k else "")] = canon.klass(type(ds))
    return {**roots, **dict(sorted(canon.code.items()))}


def config_component(config: Mapping[str, Any] | None, canon: Canon) -> dict[str, str]:
    """``{name: canonical text}``, long values shortened to a prefix and a digest of the whole."""
    out: dict[str, str] = {}
    for key in sorted(config or {}):
        text = canon.value(config[key])
        out[str(key)] = text if len(text) <= _DISPLAY else f"{text[:60]}... sha256:{_sha(text)[:16]}"
    return out


def source_component(source: Any, n: int, canon: Canon) -> dict[str, Any]:
    """The dataset's class and length, and its construction-time attributes (:data:`SOURCE_ATTRIBUTES`)."""
    attrs = {}
    for k, ds in enumerate(_sources(source)):
        for name, value in _source_state(ds).items():
            attrs[f"{k}.{name}"] = value
    return {"class": _qualname(type(source)), "len": n, "attributes": _sha(canon.value(attrs))[:32]}


def _source_state(ds: Any) -> dict[str, Any]:
    """What of a dataset's state enters its fingerprint: :data:`SOURCE_ATTRIBUTES`, and
    :data:`SOURCE_ARRAYS` holding in-memory samples."""
    state = _state(ds) or {}
    out = {k: state[k] for k in SOURCE_ATTRIBUTES if k in state}
    for k in SOURCE_ARRAYS:
        if k in state:
            held = _samples_in_memory(state[k])
            if held is not None:
                out[k] = held
    return out


#: numpy kinds of values that are samples' data: booleans, numbers, strings.
_DATA_KINDS = frozenset("biufcUS")


def _samples_in_memory(value: Any) -> Any:
    """``value`` as it enters the fingerprint when it holds samples in memory, else None: an
    array or tensor, a tuple or list of them, or of plain values (labels); numpy scalars and
    nested lists (multi-label targets) as numpy arrays."""
    if _as_array(value) is not None:
        return value
    if not isinstance(value, (tuple, list)) or not value:
        return None
    if all(_as_array(v) is not None for v in value) or _plain(value):
        return value
    try:
        whole = np.asarray(value)
    except (ValueError, TypeError):  # ragged: lists of different lengths
        whole = None
    if whole is not None:
        return whole if whole.dtype.kind in _DATA_KINDS else None
    parts = []
    for v in value:
        try:
            part = np.asarray(v)
        except (ValueError, TypeError):
            return None
        if part.dtype.kind not in _DATA_KINDS:
            return None
        parts.append(part)
    return parts


def leaf_digests(leaves: Sequence[tuple[str, np.ndarray]]) -> list[str]:
    """One digest per leaf of a static output: its path, dtype, shape and bytes."""
    out = []
    for path, a in leaves:
        out.append(_sha(f"{path}:{a.dtype.str}:{a.shape}", np.ascontiguousarray(a).tobytes())[:32])
    return out


def probes_component(spec: Mapping[str, Any], samples: Mapping[int, Sequence[str]]) -> dict[str, Any]:
    """The sample structure and, per probe index, one digest over its leaves' digests."""
    return {"spec": _sha(json.dumps(spec, sort_keys=True))[:16],
            "samples": {str(i): _sha(*d)[:16] for i, d in sorted(samples.items())}}


def make_fingerprint(transform: Callable[[Any], Any], source: Any, n: int, *, format_version: int,
                     cache_key: str | None, config: Mapping[str, Any] | None, files: Sequence[str],
                     spec: Mapping[str, Any], samples: Mapping[int, Sequence[str]]) -> Fingerprint:
    """All components of a fingerprint (see the module docstring)."""
    canon = Canon()
    components: dict[str, Any] = {
        "format": format_version,
        "cache_key": cache_key,
        "config": config_component(config, canon),
        "files": files_component(files),
        "source": source_component(source, n, canon),
        "probes": probes_component(spec, samples),
    }
    components["code"] = code_component(transform, source, canon)  # last: it lists the code the others met
    return Fingerprint(components)


@dataclass
class Fingerprint:
    """Named, JSON-able components; :attr:`digest` is the hash of all of them.

    Attributes:
        components: ``{"format", "cache_key", "code", "config", "files", "source", "probes"}``
            (see the module docstring).
    """

    components: dict[str, Any] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        """The hex digest that names the cache."""
        return hashlib.sha256(json.dumps(self.components, sort_keys=True, default=str).encode()).hexdigest()

    def changes(self, old: Mapping[str, Any]) -> list[str]:
        """What differs from an older fingerprint's components, one phrase per component."""
        out = []
        for name in COMPONENTS:
            a, b = old.get(name), self.components.get(name)
            if a != b:
                out.append(_describe(name, a, b))
        return out


def _describe(name: str, old: Any, new: Any) -> str:
    if name == "format":
        return f"store format version changed ({old} -> {new})"
    if name == "cache_key":
        return f"cache_key changed ({old!r} -> {new!r})"
    if name in ("code", "config") and isinstance(old, dict) and isinstance(new, dict):
        changed = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
        added, removed = sorted(new.keys() - old.keys()), sorted(old.keys() - new.keys())
        if name == "code":
            parts = ([f"changed: {', '.join(changed[:6])}{' ...' if len(changed) > 6 else ''}"] if changed else []) + (
                [f"new: {', '.join(added[:6])}"] if added else []) + (
                [f"gone: {', '.join(removed[:6])}"] if removed else [])
            return "code changed (" + "; ".join(parts) + ")"
        parts = [f"{k}: {old[k]} -> {new[k]}" for k in changed] + [f"{k} added ({new[k]})" for k in added] + [
            f"{k} removed (was {old[k]})" for k in removed]
        return "config changed (" + "; ".join(parts) + ")"
    if name == "files" and isinstance(old, dict) and isinstance(new, dict):
        bits = []
        if old.get("count") != new.get("count"):
            bits.append(f"{new.get('count')} files listed, was {old.get('count')}")
        if old.get("bytes") != new.get("bytes"):
            bits.append(f"{fmt_bytes(new.get('bytes', 0))} in total, was {fmt_bytes(old.get('bytes', 0))}")
        if old.get("newest_mtime_ns") != new.get("newest_mtime_ns"):
            bits.append("a file was modified (newest modification time "
                        f"{_when(new.get('newest_mtime_ns'))}, was {_when(old.get('newest_mtime_ns'))})")
        if not bits:
            bits.append("a path, size or modification time of a listed file differs")
        return "source files changed (" + "; ".join(bits) + ")"
    if name == "source" and isinstance(old, dict) and isinstance(new, dict):
        bits = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in ("class", "len") if old.get(k) != new.get(k)]
        return "source changed (" + ("; ".join(bits) or "its attributes differ") + ")"
    if name == "probes" and isinstance(old, dict) and isinstance(new, dict):
        a, b = old.get("samples", {}), new.get("samples", {})
        diff = sorted(int(k) for k in a.keys() & b.keys() if a[k] != b[k])
        if diff:
            return f"static outputs of probe samples {', '.join(map(str, diff))} changed"
        if old.get("spec") == new.get("spec") and a.keys() != b.keys():
            # Probes are spread over the length: a new length samples other indices, which says
            # nothing about the outputs (the source's phrase gives the length).
            return "the probe samples moved to other indices (those probed both times are unchanged)"
        return "static outputs of the probe samples changed (structure, dtype or shape)"
    return f"{name} changed"


def _when(ns: Any) -> str:
    import time

    if not isinstance(ns, int) or ns <= 0:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9)) + f".{ns % 10**9:09d}"[:4]


def sanitise_namespace(namespace: str) -> str:
    """A safe directory name for ``namespace`` (a data module's ``module.QualName``)."""
    text = re.sub(r"[^A-Za-z0-9._-]+", "_", namespace).lstrip(".")  # never a hidden name
    if len(text) > 160:
        text = f"{text[:140]}-{_sha(namespace)[:16]}"
    return text
