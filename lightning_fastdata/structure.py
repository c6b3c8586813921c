"""The structure of a sample: its leaves as named fields, and back.

A sample (a tensor, number, ndarray, or a tuple/list/dict of those) is flattened into
leaves in a fixed order; leaf ``k`` is field ``k``, named by its path ("0", "1" for tuple
positions, dict keys, "a.b" when nested). :class:`FieldInfo` describes a field (dtype,
per-sample shape, kind, ragged, encoding); :func:`check_like` says, naming the sample and
the field, why a sample does not fit the fields of the first.
"""

from __future__ import annotations

import collections
import importlib
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from lightning_fastdata._lightning import namedtuple_fields
from lightning_fastdata.ragged import RaggedArray

_TV_KINDS = {"Image": "image", "Video": "image", "Mask": "mask"}


class StoreError(ValueError):
    """Bad input while building a store (names the sample index and the fix)."""


class UnstorableSampleError(StoreError):
    """A sample holds a leaf that has no array form (str, None, ...).

    Attributes:
        path: The leaf's field name.
        got: What the leaf is, in words ("None", "a str").
    """

    def __init__(self, message: str, path: str = "", got: str = "") -> None:
        super().__init__(message)
        self.path, self.got = path, got


#: ndarray dtype kinds numpy stores but torch cannot hold: refused while the store is probed,
#: before anything is written (torch would refuse them only when the store is placed).
_AS_STR = ("to keep the cache, drop the field from static_transform's output, or map each value to an integer "
           "(e.g. an index into a list of names kept on the data module); a Python str instead is not stored, and "
           "the whole split is then loaded per sample, without the cache")
_NO_TENSOR = {  # dtype kind: (what it holds, the fix)
    "U": ("strings", _AS_STR),
    "S": ("bytes strings", _AS_STR),
    "M": ("datetimes", "return them as numbers, e.g. value.astype('datetime64[s]').astype(np.int64)"),
    "m": ("time deltas", "return them as numbers, e.g. value.astype('timedelta64[ms]').astype(np.int64)"),
    "V": ("a structured record", "return each of its fields as an array of its own (e.g. a dict of value[name] "
                                 "per name)"),
}


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
            raise UnstorableSampleError(f"{where} is an object-dtype ndarray", path, "an object-dtype ndarray")
        if value.dtype.kind in _NO_TENSOR:
            what, fix = _NO_TENSOR[value.dtype.kind]
            raise StoreError(f"{where} is an ndarray of dtype {value.dtype} ({what}), which no torch tensor "
                             f"holds; {fix}")
        if not value.dtype.isnative:
            # torch reads native byte order only (big-endian arrays come from FITS, some NIfTI
            # and .mat files): store the same numbers in it.
            return value.astype(value.dtype.newbyteorder("="))
        return value
    if isinstance(value, (bool, np.bool_)):
        return np.asarray(value, dtype=np.bool_)
    if isinstance(value, np.integer):
        return np.asarray(value)  # its own dtype, as numpy floats and DataLoader's collate keep it
    if isinstance(value, int):
        try:
            return np.asarray(value, dtype=np.int64)
        except OverflowError:
            raise StoreError(f"{where} is the int {value}, outside int64; return it as a float, or as an "
                             "ndarray of a dtype that holds it (e.g. np.uint64)") from None
    if isinstance(value, (float, np.floating)):
        return np.asarray(value, dtype=np.float64 if isinstance(value, float) else value.dtype)
    if type(value).__module__.startswith("PIL."):
        raise StoreError(
            f"{where} is a PIL image ({type(value).__name__}); convert it in static_transform, "
            "e.g. torchvision.transforms.functional.pil_to_tensor(image) for uint8 CHW"
        )
    got = "None" if value is None else f"a {type(value).__name__}"
    raise UnstorableSampleError(f"{where} is {got}; only tensors, ndarrays and numbers can be stored", path, got)


def _tv_kind(value: Any) -> str | None:
    """The field kind of a torchvision ``tv_tensors`` leaf (Image/Video: image, Mask: mask, others: other)."""
    for cls in type(value).__mro__:
        if cls.__module__.startswith("torchvision.tv_tensors"):
            return _TV_KINDS.get(cls.__name__, "other")
    return None


def sample_name(dataset: Any, index: int) -> str:
    """``"sample 3"``, with the file the source reads for it when it lists one path per item
    (``ImageFolder``'s ``samples``/``imgs``, also through ``Subset``s): ``"sample 3 (/data/cat/x.jpg)"``.

    For error messages only: anything unexpected on the source just leaves the path out.
    """
    try:
        source, i = dataset, index
        while isinstance(source, torch.utils.data.Subset):  # random_split's halves: the inner dataset's item
            source, i = source.dataset, int(source.indices[i])
        for attr in ("samples", "imgs"):
            items = getattr(source, attr, None)
            # One entry per item, as discover_files reads them: a path, or a tuple whose first item is one.
            if isinstance(items, (list, tuple)) and len(items) == len(source):
                item = items[i]
                path = item[0] if isinstance(item, (list, tuple)) and item else item
                if isinstance(path, (str, os.PathLike)):
                    return f"sample {index} ({os.fspath(path)})"
    except Exception:  # noqa: BLE001 - naming the file must never replace the error being reported
        pass
    return f"sample {index}"


def read_sample(dataset: Any, transform: Callable[[Any], Any], index: int) -> Any:
    """``transform(dataset[index])``; an error raised there gets a note naming the sample (and its file)."""
    try:
        return transform(dataset[index])
    except Exception as e:
        # The user's own code raised: keep its exception (type and traceback), and say which
        # sample it was reading, which the traceback alone does not (workers lose the frame).
        e.add_note(f"lightning_fastdata: raised while caching {sample_name(dataset, index)} (the source's item "
                   f"{index}, then static_transform)")
        raise


def flatten(sample: Any, index: int = 0, like: dict | None = None) -> tuple[dict, list[tuple[str, np.ndarray]]]:
    """Flatten a sample into ``(spec, [(path, array), ...])`` in a fixed leaf order.

    A leaf that is a torchvision ``tv_tensors`` instance records its kind in the spec
    (``"tv": "image" | "mask" | "other"``), see :func:`field_kinds`. A
    :class:`~lightning_fastdata.ragged.RaggedArray` (a whole ragged field, as
    :meth:`Store.from_arrays` takes) is one leaf, kept as it is. ``like``, the spec of
    sample 0: a dict holding the same keys in another order is walked in ``like``'s order
    (as ``default_collate`` collates by the first sample's keys).
    """
    leaves: list[tuple[str, np.ndarray]] = []

    def walk(node: Any, path: str, like: dict | None) -> dict:
        if isinstance(node, (tuple, list)):
            kind = "tuple" if isinstance(node, tuple) else "list"
            fits = like is not None and like["kind"] in ("tuple", "list") and len(like["items"]) == len(node)
            subs = like["items"] if fits else [None] * len(node)  # type: ignore[index]
            items = [walk(v, f"{path}.{i}" if path else str(i), sub)
                     for i, (v, sub) in enumerate(zip(node, subs, strict=True))]
            return tuple_spec(node, {"kind": kind, "items": items})
        if isinstance(node, dict):
            keys = list(node)
            for k in keys:
                # str or int: a JSON list of keys in the manifest gives both back as they were
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise StoreError(f"sample {index} has the dict key {k!r} ({type(k).__name__}) at "
                                     f"{repr(path) if path else 'the top'}; a stored dict's keys must be str or int: "
                                     "convert them in static_transform (e.g. {str(k): v for k, v in d.items()})")
            subs = [None] * len(keys)
            if like is not None and like["kind"] == "dict" and set(like["keys"]) == set(keys):
                keys, subs = list(like["keys"]), like["items"]
            items = [walk(node[k], f"{path}.{k}" if path else str(k), sub) for k, sub in zip(keys, subs, strict=True)]
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

    spec = walk(sample, "", like)
    unique_names([p for p, _ in leaves], f"sample {index}")
    return spec, leaves


def flatten_like(spec: dict, infos: list[FieldInfo], sample: Any, index: int) -> list[tuple[str, np.ndarray]]:
    """The leaves of a later sample, checked against sample 0's ``spec`` and fields (see :func:`check_like`).

    Sample 0 was storable, so a leaf here that cannot be stored (None, a str) contradicts it: a
    :class:`StoreError`, not a reason to load the split per sample, which would fail only
    mid-epoch, in collate, naming no sample.
    """
    try:
        _, leaves = flatten(sample, index, like=spec)
    except UnstorableSampleError as e:
        raise StoreError(
            f"sample {index}, field '{e.path}' is {e.got}, sample 0 has {_described(spec, infos, e.path)} there; "
            "make static_transform return the same structure, with a tensor, ndarray or number of one dtype at each "
            "field, for every sample (e.g. -1 for a missing label, or drop the field)"
        ) from None
    check_like(infos, leaves, index)
    return leaves


def _described(spec: dict, infos: list[FieldInfo], path: str) -> str:
    """What sample 0 holds at field ``path``, in words."""
    kinds = {"tensor": "a tensor", "ndarray": "an ndarray", "number": "a number", "ragged": "a ragged array"}
    types: dict[int, str] = {}

    def walk(node: dict) -> None:
        if node["kind"] == "leaf":
            types[node["field"]] = kinds.get(node.get("type", ""), "a value")
        else:
            for item in node["items"]:
                walk(item)

    walk(spec)
    for k, info in enumerate(infos):
        if info.name == path:
            shape = ", ragged" if info.ragged else "" if types.get(k) == "a number" else f", shape {info.shape}"
            return f"{types.get(k, 'a value')} (dtype {np.dtype(info.dtype)}{shape})"
    if path in container_paths(spec):
        return "a list, tuple or dict"
    return "no such field"


def tuple_spec(node: tuple | list, spec: dict) -> dict:
    """``spec`` of a tuple or list, with the class of a namedtuple recorded (module, name,
    fields) so that :func:`unflatten` rebuilds it, as ``default_collate`` keeps it."""
    fields = namedtuple_fields(type(node))
    if isinstance(node, tuple) and fields is not None:
        spec["namedtuple"] = {"module": type(node).__module__, "name": type(node).__qualname__,
                              "fields": list(fields)}
    return spec


def unique_names(names: Sequence[str], where: str) -> None:
    """Refuse two fields of one name: a dict key with a dot (``{"a.b": x}``) is named as the
    nested ``{"a": {"b": y}}`` is (an int key as the same str key), and one field would
    silently stand for both."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise StoreError(
                f"{where} has two fields named '{name}': a dict key containing '.' is named like a nested "
                f"path, and an int key like the same str key (fields are named by their path, parts joined by "
                f"'.'); rename the key (e.g. with '_')")
        seen.add(name)


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


def container_paths(spec: dict, path: str = "") -> set[str]:
    """The paths of the lists, tuples and dicts of a sample's structure, named as :func:`flatten`
    names fields (an empty one holds no field, so only these paths say it is there)."""
    if spec["kind"] == "leaf":
        return set()
    keys = spec["keys"] if spec["kind"] == "dict" else range(len(spec["items"]))
    out = {path} if path else set()
    for key, item in zip(keys, spec["items"], strict=True):
        out |= container_paths(item, f"{path}.{key}" if path else str(key))
    return out


def unflatten(spec: dict, leaves: Sequence[Any]) -> Any:
    """Rebuild a (batched) sample from its spec and one value per leaf."""
    kind = spec["kind"]
    if kind == "leaf":
        return leaves[spec["field"]]
    items = [unflatten(s, leaves) for s in spec["items"]]
    if kind == "tuple":
        named = spec.get("namedtuple")
        return _namedtuple(named)(*items) if named else tuple(items)
    if kind == "list":
        return items
    return dict(zip(spec["keys"], items, strict=True))


_NAMEDTUPLES: dict[tuple, type] = {}


def _namedtuple(named: dict) -> type:
    """The namedtuple class ``named`` records: the user's own when it imports with the same
    fields, else a namedtuple of that name and fields (a store read where the class is gone)."""
    key = (named["module"], named["name"], tuple(named["fields"]))
    cls = _NAMEDTUPLES.get(key)
    if cls is None:
        cls = _import_class(named["module"], named["name"])
        if not (isinstance(cls, type) and namedtuple_fields(cls) == key[2]):
            cls = collections.namedtuple(named["name"].rpartition(".")[2], key[2])  # type: ignore[misc]
        cls = _NAMEDTUPLES[key] = cls
    return cls


def _import_class(module: str, qualname: str) -> Any:
    """``module.qualname`` if it imports, else None."""
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception:  # gone, renamed, defined in a function (<locals>): rebuilt by its fields
        return None
    return obj


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


def signature(leaves: list[tuple[str, np.ndarray]]) -> list[FieldInfo]:
    return [FieldInfo(p, a.dtype.str, tuple(a.shape)) for p, a in leaves]


def ragged_info(info: FieldInfo, kind: str | None = None, encoding: str | None = None) -> FieldInfo:
    """``info`` as a ragged field: -1 per dimension (stored JPEG bytes: one dimension, uint8)."""
    if encoding is not None:
        return replace(info, dtype=np.dtype(np.uint8).str, shape=(-1,), ragged=True, encoding=encoding,
                       kind=kind or info.kind)
    return replace(info, shape=(-1,) * len(info.shape), ragged=True, kind=kind or info.kind)


def with_kinds(infos: list[FieldInfo], spec: dict) -> list[FieldInfo]:
    return [replace(i, kind=k) for i, k in zip(infos, field_kinds(spec), strict=True)]


def fixed_leads(infos: Sequence[FieldInfo]) -> dict[int, int]:
    """Field index -> how many leading dims of each sample must equal sample 0's, for the ragged
    image and mask fields: all but the spatial dims the augmentations read from the image field
    (2 for ``(C, H, W)``, 3 for ``(C, D, H, W)``, as :class:`~lightning_fastdata.augment.Batch`
    infers them for a list of samples). Ragged ``other`` fields (boxes, token lists) may vary in
    every dim; a store without a 3-D or 4-D image field has nothing to check.
    """
    def ndim(info: FieldInfo) -> int:
        return 3 if info.encoding else len(info.shape)  # an encoded field decodes to (C, H, W)

    image = next((i for i in infos if i.kind == "image"), None)
    if image is None or ndim(image) not in (3, 4):
        return {}
    spatial = ndim(image) - 1
    return {k: ndim(i) - spatial for k, i in enumerate(infos)
            if i.ragged and i.kind in ("image", "mask") and ndim(i) > spatial}


def lead_error(info: FieldInfo, lead: int, sample: str, shape: Sequence[int], first: str,
               first_shape: Sequence[int]) -> StoreError:
    """The error for ``sample`` of a ragged image or mask field whose first ``lead`` dims
    (channels) differ from sample 0's (``first``), see :func:`fixed_leads`."""
    shape, first_shape = tuple(int(s) for s in shape), tuple(int(s) for s in first_shape)
    decoded = " (decoded)" if info.encoding else ""
    if info.kind == "image":
        fix = ("give every image the same channels, e.g. image.convert('RGB') before pil_to_tensor, "
               "torchvision.io.decode_image(path, mode=ImageReadMode.RGB), or x.expand(3, -1, -1) for a "
               "1-channel tensor")
    else:
        fix = "give every mask the same channels (e.g. one: mask[:1])"
    return StoreError(
        f"{sample}, {info.kind} field '{info.name}' has shape {shape}{decoded}, {first} has {first_shape}: the "
        f"samples of a ragged {info.kind} field may differ in their spatial size (the last {len(shape) - lead} dims) "
        f"only, not in their channels ({'dim 0' if lead == 1 else f'dims 0 to {lead - 1}'}), which the augmentations "
        f"batch together; in static_transform, {fix}; or, if '{info.name}' is not an {info.kind}, say so: "
        f"field_kinds={{'{info.name}': 'other'}}"
    )


def check_like(expected: list[FieldInfo], leaves: list[tuple[str, np.ndarray]], index: int) -> None:
    got = signature(leaves)
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
