"""The batch the augmentation ops work on (named fields, their kinds, the samples' keys) and
the ops' base class, with the helpers the op modules share.

A field is an ``image`` (``(N, *lead, C, *spatial)``: photometric and geometric ops), a
``mask`` (``(N, *lead, *spatial)``: geometric ops only, nearest-neighbour) or ``other``
(passed through untouched). ``spatial`` is 2 dims (H, W) or 3 (D, H, W); leading dims
between N and C (video frames) share their sample's draw.
"""

from __future__ import annotations

import functools
import math
import operator
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lightning_fastdata._util import as_flag
from lightning_fastdata.keys import BoundedCache, SampleKeys

KINDS = ("image", "mask", "other")

#: Integer dtypes images may have, with the maximum value ``ToDtype(scale=True)`` maps to 1.0.
INT_MAX = {
    torch.uint8: 255,
    torch.int8: 127,
    torch.int16: 32767,
    torch.uint16: 65535,
    torch.int32: 2**31 - 1,
    torch.int64: 2**63 - 1,
}

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "uint16": torch.uint16,
    "int32": torch.int32,
    "int64": torch.int64,
}


class StoreRows:
    """Rows of a whole field, not yet gathered: sample i of the batch is ``tensor[rows[i]]``.

    The ``device`` loader hands a pipeline that starts with a crop its image and mask
    fields this way, so the crop cuts its windows from the store directly (a 96^3 window
    of a 128^3 volume reads 42% of the volume, and nothing is copied twice). Any other
    reader of :attr:`Batch.fields` gets the rows gathered first: correctness never depends
    on who reads.

    Args:
        tensor: The whole field, ``(rows, *sample_shape)``.
        rows: The batch's rows of ``tensor``, int64 (N,) on its device.
    """

    __slots__ = ("tensor", "rows")

    def __init__(self, tensor: torch.Tensor, rows: torch.Tensor) -> None:
        if rows.ndim != 1 or rows.device != tensor.device:
            raise ValueError(f"StoreRows needs 1-D rows on the tensor's device ({tensor.device}), got shape "
                             f"{tuple(rows.shape)} on {rows.device}")
        self.tensor, self.rows = tensor, rows

    @property
    def shape(self) -> torch.Size:
        """The gathered shape, ``(N, *sample_shape)``."""
        return torch.Size((self.rows.numel(), *self.tensor.shape[1:]))

    @property
    def ndim(self) -> int:
        return self.tensor.ndim

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def gather(self) -> torch.Tensor:
        """The rows as one new tensor."""
        return torch.index_select(self.tensor, 0, self.rows)


class Batch:
    """Named fields of one batch, their kinds, and the keys of its samples.

    Args:
        fields: Field name -> tensor with the samples along dim 0, or a list of per-sample
            tensors of varying spatial size (a ragged field, e.g. decoded JPEGs: ``(C, H, W)``
            images, ``(H, W)`` or ``(1, H, W)`` masks); ``other`` fields may be anything.
        kinds: Field name -> ``"image"``, ``"mask"`` or ``"other"``; fields not named are
            ``other``. Default: the first field is the image, the rest ``other``.
        keys: The samples' random keys; default ``SampleKeys.for_batch(N)`` on the first
            image's device (samples numbered 0 .. N-1 with seed 0).
        spatial_dims: 2 for ``(..., H, W)``, 3 for ``(..., D, H, W)``; default from the
            first image field: 4-D is 2-D images, 5-D is volumes (video needs an explicit 2).

    Every image and mask field must have the same spatial size (crops and rotations
    keep them aligned) and the same number of samples. Image and mask fields are either all
    tensors or all lists (then sample i of every field has one spatial size). Size-fixing ops
    (``RandomResizedCrop``, ``Resize((h, w))``, ``CenterCrop``, ``RandomCrop``,
    ``RandomCropByLabel``) turn lists into batch tensors; other ops run once per sample on a list (and keep it a list).
    """

    __slots__ = ("_held", "kinds", "keys", "spatial_dims")

    def __init__(self, fields: Mapping[str, Any], kinds: Mapping[str, str] | None = None,
                 keys: SampleKeys | None = None, spatial_dims: int | None = None) -> None:
        fields = dict(fields)
        if not fields:
            raise ValueError("Batch needs at least one field")
        if kinds is None:
            first = next(iter(fields))
            kinds = {first: "image"}
        kinds = {name: kinds.get(name, "other") for name in fields} | {
            k: v for k, v in kinds.items() if k not in fields}
        for name, kind in kinds.items():
            if name not in fields:
                raise ValueError(f"Batch kinds name the field {name!r}, which is not among the fields "
                                 f"{sorted(fields)}")
            if kind not in KINDS:
                raise ValueError(f"Batch field {name!r} has kind {kind!r}; kinds are {KINDS}")
        self._held, self.kinds = fields, kinds
        self.spatial_dims = _infer_spatial_dims(fields, kinds) if spatial_dims is None else spatial_dims
        if self.spatial_dims not in (2, 3):
            raise ValueError(f"Batch spatial_dims must be 2 (H, W) or 3 (D, H, W), got {self.spatial_dims!r}")
        n, device = self._check_fields()
        if keys is None:
            keys = SampleKeys.for_batch(n, device)
        elif len(keys) != n:
            raise ValueError(f"Batch has {n} samples but its keys have {len(keys)} indices")
        self.keys = keys

    def _check_fields(self) -> tuple[int, torch.device]:
        names = self.names("image", "mask")
        if not names:
            raise ValueError(f"Batch has no image or mask field to augment (kinds: {self.kinds})")
        lists = [name for name in names if isinstance(self._held[name], (list, tuple))]
        if lists:
            if len(lists) != len(names):
                tensors = sorted(set(names) - set(lists))
                raise TypeError(f"Batch fields {lists} are lists of samples but {tensors} are tensors; image and "
                                "mask fields must be all tensors or all lists (one tensor per sample)")
            return self._check_lists(names)
        sd = self.spatial_dims
        ref: tuple[str, torch.Tensor] | None = None
        for name in names:
            x = self._held[name]
            kind = self.kinds[name]
            if not isinstance(x, (torch.Tensor, StoreRows)):
                raise TypeError(f"Batch field {name!r} ({kind}) is a {type(x).__name__}; image and mask fields "
                                "must be tensors with the samples along dim 0, or lists of per-sample tensors")
            _check_ndim(name, kind, x.shape, sd, batched=True)
            if ref is None:
                ref = (name, x)
                continue
            rname, r = ref
            if x.shape[0] != r.shape[0]:
                raise ValueError(f"Batch fields {rname!r} and {name!r} have {r.shape[0]} and {x.shape[0]} "
                                 "samples; every image and mask field needs one row per sample")
            if x.shape[-sd:] != r.shape[-sd:]:
                raise ValueError(f"Batch fields {rname!r} and {name!r} have spatial sizes {tuple(r.shape[-sd:])} "
                                 f"and {tuple(x.shape[-sd:])}; image and mask fields must be aligned (same "
                                 "spatial size) to be augmented together")
            if x.device != r.device:
                raise ValueError(f"Batch fields {rname!r} and {name!r} are on {r.device} and {x.device}")
        assert ref is not None
        return ref[1].shape[0], ref[1].device

    def _check_lists(self, names: list[str]) -> tuple[int, torch.device]:
        """Lists of per-sample tensors: same count in every field, sample i aligned across fields."""
        sd = self.spatial_dims
        for name in names:
            if not isinstance(self.fields[name], list):
                self.fields[name] = list(self.fields[name])
        first = self.fields[names[0]]
        if not first:
            raise ValueError(f"Batch field {names[0]!r} is an empty list; a list field needs one tensor per sample")
        device = first[0].device if isinstance(first[0], torch.Tensor) else None
        for name in names:
            xs, kind = self.fields[name], self.kinds[name]
            if len(xs) != len(first):
                raise ValueError(f"Batch fields {names[0]!r} and {name!r} have {len(first)} and {len(xs)} samples; "
                                 "every image and mask field needs one tensor per sample")
            for i, x in enumerate(xs):
                if not isinstance(x, torch.Tensor):
                    raise TypeError(f"Batch field {name!r} ({kind}) sample {i} is a {type(x).__name__}, not a tensor")
                _check_ndim(f"{name}[{i}]", kind, x.shape, sd, batched=False)
                if x.device != device:
                    raise ValueError(f"Batch field {name!r} sample {i} is on {x.device}, sample 0 of "
                                     f"{names[0]!r} on {device}; a batch lives on one device")
                if name != names[0] and x.shape[-sd:] != first[i].shape[-sd:]:
                    raise ValueError(f"Batch fields {names[0]!r} and {name!r} have spatial sizes "
                                     f"{tuple(first[i].shape[-sd:])} and {tuple(x.shape[-sd:])} at sample {i}; image "
                                     "and mask fields must be aligned (same spatial size) to be augmented together")
        return len(first), device  # type: ignore[return-value]

    @property
    def fields(self) -> dict[str, Any]:
        """Field name -> value; rows not yet gathered (:class:`StoreRows`) are gathered first."""
        f = self._held
        if any(type(v) is StoreRows for v in f.values()):
            for name, v in f.items():
                if type(v) is StoreRows:
                    f[name] = v.gather()
        return f

    @fields.setter
    def fields(self, value: dict[str, Any]) -> None:
        self._held = value

    def stored_rows(self) -> torch.Tensor | None:
        """The rows every image and mask field is still to be gathered at (see :class:`StoreRows`),
        or None when any of them is a plain value."""
        rows = None
        for name in self.names("image", "mask"):
            v = self._held[name]
            if type(v) is not StoreRows or (rows is not None and v.rows is not rows):
                return None
            rows = v.rows
        return rows

    def whole(self, name: str) -> torch.Tensor:
        """The whole field ``name`` that the batch's rows (:meth:`stored_rows`) index."""
        v = self._held[name]
        if type(v) is not StoreRows:
            raise ValueError(f"Batch field {name!r} is not stored rows (see Batch.stored_rows)")
        return v.tensor

    def map_rows(self, image: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
                 mask: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None) -> Batch:
        """``map`` for ops that can read a batch's rows from the whole field: each function gets
        ``(x, rows)``, the whole field and the batch's rows of it (see :meth:`stored_rows`),
        or the batch's tensor and None."""
        rows = self.stored_rows()
        out = {}
        for name in self.names("image", "mask"):
            fn = image if self.kinds[name] == "image" else mask
            if fn is None:
                continue
            out[name] = fn(self._held[name].tensor, rows) if rows is not None else fn(self.fields[name], None)
        return self.replace(out)

    def field_dtype(self, name: str) -> torch.dtype:
        """The dtype of field ``name`` (its first sample's, for a list), without gathering stored rows."""
        v = self._held[name]
        return v[0].dtype if isinstance(v, (list, tuple)) else v.dtype

    def names(self, *kinds: str) -> list[str]:
        """The names of the fields of the given kinds, in field order."""
        return [name for name in self._held if self.kinds[name] in kinds]

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def ragged(self) -> bool:
        """Whether the image and mask fields are lists of per-sample tensors (sizes may vary)."""
        return isinstance(self._held[self.names("image", "mask")[0]], list)

    @property
    def spatial_size(self) -> Any:
        """(H, W) or (D, H, W) of the image and mask fields; for a ragged batch, a list with
        each sample's."""
        first = self._held[self.names("image", "mask")[0]]
        if isinstance(first, list):
            return [tuple(x.shape[-self.spatial_dims:]) for x in first]
        return tuple(first.shape[-self.spatial_dims:])

    @property
    def device(self) -> torch.device:
        """The device of the image and mask fields."""
        first = self._held[self.names("image", "mask")[0]]
        return first[0].device if isinstance(first, list) else first.device

    def sample(self, i: int, rows: torch.Tensor | None = None) -> Batch:
        """Sample ``i`` of a ragged batch as a batch of one (tensors ``(1, ...)``; ``other``
        fields left out); ``rows`` is ``arange(N)`` on the keys' device, if at hand."""
        names = self.names("image", "mask")
        if rows is None:
            rows = torch.arange(len(self), device=self.keys.device)
        out = Batch.__new__(Batch)
        out.kinds = {k: self.kinds[k] for k in names}
        out.spatial_dims = self.spatial_dims
        out.fields = {k: self.fields[k][i].unsqueeze(0) for k in names}
        out.keys = self.keys.take(rows[i:i + 1])
        return out

    def replace(self, fields: Mapping[str, Any] | None = None, keys: SampleKeys | None = None) -> Batch:
        """A new batch with some fields (same names) and/or the keys replaced."""
        out = Batch.__new__(Batch)
        out.kinds, out.spatial_dims, out.keys = self.kinds, self.spatial_dims, self.keys
        out.fields = dict(self._held)  # rows still to gather stay so (see StoreRows)
        if fields:
            unknown = set(fields) - set(self._held)
            if unknown:
                raise ValueError(f"Batch.replace got fields {sorted(unknown)} that the batch does not have")
            out._held.update(fields)
            n = out._check_fields()[0]
        else:
            n = len(self.keys)
        if keys is not None:
            if len(keys) != n:
                raise ValueError(f"Batch has {n} samples but its keys have {len(keys)} indices")
            out.keys = keys
        return out

    def map(self, image: Callable[[torch.Tensor], torch.Tensor] | None = None,
            mask: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Batch:
        """Apply ``image`` to every image field and ``mask`` to every mask field (None: keep)."""
        out = {}
        for name in self.names("image", "mask"):
            fn = image if self.kinds[name] == "image" else mask
            if fn is not None:
                out[name] = fn(self.fields[name])
        return self.replace(out)

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{name}: {self.kinds[name]} {_describe(v)}"
            for name, v in self._held.items())
        return f"Batch({parts}; spatial_dims={self.spatial_dims}, keys={self.keys!r})"


def _infer_spatial_dims(fields: Mapping[str, Any], kinds: Mapping[str, str]) -> int:
    for name, kind in kinds.items():
        value = fields[name]
        if kind == "image" and isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            ndim = value[0].ndim
            if ndim in (3, 4):
                return ndim - 1
            raise ValueError(f"Batch field {name!r} is a list of {ndim}-D tensors: give spatial_dims (2 for "
                             "images (C, H, W), 3 for volumes (C, D, H, W))")
        if kind == "image" and isinstance(value, (torch.Tensor, StoreRows)):
            ndim = value.ndim
            if ndim in (4, 5):
                return ndim - 2
            raise ValueError(f"Batch field {name!r} has {ndim} dims: give spatial_dims (2 for images "
                             "(N, ..., C, H, W), 3 for volumes (N, ..., C, D, H, W)); a plain tensor is 4-D "
                             "(N, C, H, W) or 5-D (N, C, D, H, W)")
    raise ValueError("Batch has no image field to infer spatial_dims from; pass spatial_dims=2 or 3")


def _check_ndim(name: str, kind: str, shape: torch.Size, sd: int, batched: bool) -> None:
    ndim = len(shape)
    least = sd + (2 if kind == "image" else 1) - (0 if batched else 1)
    if ndim >= least:
        return
    if kind == "mask":
        layout = "(D, H, W) or (1, D, H, W)" if sd == 3 else "(H, W) or (1, H, W)"
    else:
        layout = "(C, D, H, W)" if sd == 3 else "(C, H, W)"
    if batched:
        layout = "(N, " + layout[1:].replace(" or (", " or (N, ")
    raise ValueError(f"Batch field {name!r} ({kind}) has shape {tuple(shape)}; with spatial_dims={sd} it "
                     f"needs {layout}")


def _describe(v: Any) -> str:
    if isinstance(v, (torch.Tensor, StoreRows)):
        return str(tuple(v.shape))
    if isinstance(v, list) and v and isinstance(v[0], torch.Tensor):
        return f"list of {len(v)} ({v[0].ndim}-D)"
    return type(v).__name__


def as_batch(x: torch.Tensor | Batch, keys: SampleKeys | None) -> tuple[Batch, str | None]:
    """``x`` as a Batch, and the name of the field to return when ``x`` was a plain tensor."""
    if isinstance(keys, torch.Generator):
        raise TypeError("augment ops draw from SampleKeys, not a torch.Generator: call op(x) or "
                        "op(x, SampleKeys(seed, epoch, sample_indices)); see docs/seeding.md")
    if keys is not None and not isinstance(keys, SampleKeys):
        raise TypeError(f"keys must be a SampleKeys, got {type(keys).__name__}")
    if isinstance(x, Batch):
        return (x if keys is None else x.replace(keys=keys)), None
    if isinstance(x, (list, tuple)):
        return Batch({"image": list(x)}, {"image": "image"}, keys), "image"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"augment ops take a tensor, a list of (C, H, W) tensors or an augment.Batch, got "
                        f"{type(x).__name__}")
    if x.ndim not in (4, 5):
        raise ValueError(f"a plain tensor batch must be (N, C, H, W) or (N, C, D, H, W), got shape "
                         f"{tuple(x.shape)}; for video or other layouts use augment.Batch(..., spatial_dims=2)")
    return Batch({"image": x}, {"image": "image"}, keys, x.ndim - 2), "image"


def _naming_errors(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` whose ValueError or TypeError names the op built: a bad argument in a
    ``Compose`` of a YAML config said "p must be in [0, 1], got 1.5", not which of its ops."""

    @functools.wraps(init)
    def named(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except (ValueError, TypeError) as e:
            op = type(self).__name__
            text = str(e.args[0]) if len(e.args) == 1 and isinstance(e.args[0], str) else None
            if text is not None and not text.startswith(op) and not getattr(e, "_lfd_named", False):
                e.args = (f"{op}: {text}",)
            e._lfd_named = True  # type: ignore[attr-defined]  # a subclass's init calling its base's
            raise

    return named


class BatchTransform:
    """Base class of the ops: ``op(x)`` or ``op(x, keys)`` returns the transformed batch.

    ``x`` is a tensor (one image field), a list of per-sample image tensors, or a
    :class:`Batch`; the result has the same type, except that size-fixing ops turn lists
    into batch tensors. Subclasses define ``make_params(batch)`` (the per-sample
    parameters, drawn from ``batch.keys`` only) and ``apply_batch(batch, **params)``;
    ``draw`` and ``apply`` are their public faces, so ``op(x, keys) == op.apply(x, **op.draw(x, keys))``
    for every op. Ops that run other ops (``Compose``, ``RandomApply``) draw the keys the
    inner ops draw from (their parameters depend on what the ops before them made).

    A parameter is a tensor with one row per sample, a dict of parameters (e.g. one noise
    tensor per image field), a list with one tensor per sample (without the batch dim: a
    ragged batch's per-sample draws whose shapes differ), or a ``SampleKeys``.
    An op whose ``lists`` is False runs once per sample on a ragged batch, each sample a
    batch of one with its own keys (the same pixels it would get in a batch tensor).
    """

    #: Whether ``make_params`` and ``apply_batch`` take ragged batches (lists of samples).
    lists = False
    #: Whether the op may move pixels (crop, flip, resample), which mask fields follow; the
    #: photometric ops, which only change values, say False (the data module warns at setup
    #: of a mask-shaped field left ``other`` only under an augmentation that moves pixels).
    moves_pixels = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None:
            cls.__init__ = _naming_errors(init)  # type: ignore[method-assign]

    def __call__(self, x: torch.Tensor | list[torch.Tensor] | Batch,
                 keys: SampleKeys | None = None) -> torch.Tensor | list[torch.Tensor] | Batch:
        batch, name = as_batch(x, keys)
        out = self.forward(batch)
        return out if name is None else out.fields[name]

    def forward(self, batch: Batch) -> Batch:
        """Draw and apply on a Batch (overridden by ops that run other ops)."""
        if batch.ragged and not self.lists:
            return per_sample(self, batch)
        if not batch.ragged and len(batch) == 0:
            return run_empty(self, batch)
        return self.apply_batch(batch, **self.make_params(batch))

    def make_params(self, batch: Batch) -> dict[str, Any]:
        """Per-sample parameters from ``batch.keys`` (deterministic ops: none)."""
        return {}

    def apply_batch(self, batch: Batch, **params: Any) -> Batch:
        """The op at the given parameters."""
        raise NotImplementedError

    def draw(self, x: torch.Tensor | list[torch.Tensor] | Batch,
             keys: SampleKeys | None = None) -> dict[str, Any]:
        """The per-sample parameters this op would use on ``x`` with ``keys``."""
        batch = as_batch(x, keys)[0]
        if batch.ragged and not self.lists:
            rows = torch.arange(len(batch), device=batch.keys.device)
            each = [self.make_params(batch.sample(i, rows)) for i in range(len(batch))]
            return {k: join_rows([p[k] for p in each], f"{type(self).__name__} parameter {k!r}") for k in each[0]}
        return self.make_params(batch)

    def apply(self, x: torch.Tensor | list[torch.Tensor] | Batch,
              **params: Any) -> torch.Tensor | list[torch.Tensor] | Batch:
        """The op on ``x`` at the given per-sample parameters (as returned by ``draw``).

        Raises:
            ValueError: a parameter with another number of rows than ``x`` has samples, or,
                on the CPU, outside the range the op draws from (a crop's window past the
                input): the cut would read other samples' pixels, silently.
        """
        batch, name = as_batch(x, None)
        self.check_params(batch, params)
        if batch.ragged and not self.lists:
            out = per_sample(self, batch, params)
        elif not batch.ragged and len(batch) == 0:
            out = run_empty(self, batch)  # as the op itself does: no sample, nothing to apply
        else:
            out = self.apply_batch(batch, **params)
        return out if name is None else out.fields[name]

    def check_params(self, batch: Batch, params: dict[str, Any]) -> None:
        """Refuse parameters given to ``apply`` that do not fit ``batch``: a tensor of another
        number of rows than samples. Ops whose parameters have a range check it too, on the
        CPU only (on an accelerator the check would make the host wait for the device)."""
        n = len(batch)
        for k, v in params.items():
            if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] != n:
                raise ValueError(f"{type(self).__name__}.apply: parameter {k!r} has {v.shape[0]} rows for a batch of "
                                 f"{n} samples; draw the parameters for this batch: op.draw(x, keys)")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


_WARNED: set[str] = set()


def per_sample(op: BatchTransform, batch: Batch, params: dict[str, Any] | None = None) -> Batch:
    """``op`` on each sample of a ragged batch as a batch of one (drawn with that sample's
    keys, or at row i of ``params``); the fields stay lists."""
    name = type(op).__name__
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"{name} runs once per sample on a list of variable-size images (a ragged field); put it "
                      "after a size-fixing op (RandomResizedCrop, Resize((h, w)), CenterCrop, RandomCrop, "
                      "RandomCropByLabel) to run it on one batch tensor", stacklevel=4)
    names = batch.names("image", "mask")
    rows = torch.arange(len(batch), device=batch.keys.device)
    outs: dict[str, list[torch.Tensor]] = {k: [] for k in names}
    for i in range(len(batch)):
        one = batch.sample(i, rows)
        if params is None:
            res = op.forward(one)
        else:
            res = op.apply_batch(one, **{k: take_row(v, i, rows) for k, v in params.items()})
        for k in names:
            outs[k].append(res.fields[k][0])
    return batch.replace(outs)


def run_empty(op: BatchTransform, batch: Batch) -> Batch:
    """``op`` on a batch of 0 samples: the rows of its output on one zero sample of the same
    shapes, none of them kept (the output's shapes and dtypes, which a crop or a conversion
    changes). The ops' per-sample code would otherwise trip on ``reshape(0, -1, ...)`` or
    ``x[0]``."""
    names = batch.names("image", "mask")
    one = Batch({k: batch.fields[k].new_zeros((1, *batch.fields[k].shape[1:])) for k in names},
                {k: batch.kinds[k] for k in names}, SampleKeys.for_batch(1, batch.keys.device), batch.spatial_dims)
    out = op.apply_batch(one, **op.make_params(one))
    return batch.replace({k: out.fields[k][:0] for k in names})


def join_rows(values: list[Any], what: str) -> Any:
    """One parameter of a ragged batch from its samples' draws (each for a batch of one).

    Tensors are concatenated along the samples, or kept as a list of per-sample tensors
    (batch dim dropped) where their shapes differ (noise of each image's size); dicts are
    joined per entry; lists (one tensor per sample already) are concatenated.
    """
    first = values[0]
    if isinstance(first, torch.Tensor):
        if all(isinstance(v, torch.Tensor) and v.shape[1:] == first.shape[1:] for v in values):
            return torch.cat(values)
        return [v[0] for v in values]
    if isinstance(first, Mapping):
        return {k: join_rows([v[k] for v in values], f"{what}[{k!r}]") for k in first}
    if isinstance(first, list):
        return [e for v in values for e in v]
    raise TypeError(f"{what} is a {type(first).__name__}; per-sample draws of a ragged batch can only join "
                    "tensors, dicts and lists of them (give the op a draw of its own)")


def take_row(value: Any, i: int, rows: torch.Tensor) -> Any:
    """Sample ``i``'s part of a parameter, as a parameter of a batch of one (``rows`` is
    ``arange(N)`` on the keys' device)."""
    if isinstance(value, torch.Tensor):
        return value[i:i + 1]
    if isinstance(value, Mapping):
        return {k: take_row(v, i, rows) for k, v in value.items()}
    if isinstance(value, SampleKeys):
        if len(value) != len(rows):
            raise ValueError(f"got keys of {len(value)} samples for a batch of {len(rows)}; pass the parameters "
                             "draw returned for this batch")
        return value.take(rows[i:i + 1])
    if isinstance(value, list):
        entry = value[i]
        return entry.unsqueeze(0) if isinstance(entry, torch.Tensor) else entry
    return value  # not per sample (None, a number): the same for every sample


# --------------------------------------------------------------------------- shared helpers


#: Where the CPU may take host-side shortcuts (``nonzero`` to touch only the chosen samples).
#: Accelerators never do: the host would wait for the device. Tests switch this off to run
#: the accelerator code on the CPU.
HOST_SHORTCUTS = True


def host_shortcuts(device: torch.device) -> bool:
    """Whether data-dependent shapes (``nonzero``) may be used on ``device`` without a sync."""
    return HOST_SHORTCUTS and device.type == "cpu"


#: Past this many constants the cache is emptied: some hold an input size (the affine grid's
#: half extents, a crop's offset range), one per size of a ragged list; a fixed pipeline
#: needs a few dozen.
_CONSTANTS_MAX = 256
_CONSTANTS: BoundedCache = BoundedCache(_CONSTANTS_MAX)


def const(values: Sequence[float], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A small constant tensor, made once per (values, device, dtype) (while cached).

    ``torch.tensor(list, device=cuda)`` copies from pageable host memory and blocks the
    host; this builds the tensor with fills (kernel launches only), once.
    """
    key = (tuple(float(v) for v in values), str(device), dtype)
    out = _CONSTANTS.get(key)
    if out is not None:
        if device.type == "cuda":
            _CONSTANTS.pin(key, out)  # a CUDA graph being captured reads it at every replay
        return out
    if device.type == "cpu":
        out = torch.tensor(key[0], dtype=dtype)
    else:
        out = torch.empty(len(key[0]), dtype=dtype, device=device)
        for i, v in enumerate(key[0]):
            out[i].fill_(v)
    return _CONSTANTS.put(key, out)


def _int(value: Any) -> int | None:
    """``value`` as an int if it is one (integral floats too, as configs give 32.0), else None."""
    if isinstance(value, (bool, str, bytes)):
        return None
    try:
        return operator.index(value)  # ints, numpy and 0-d tensor integers
    except TypeError:
        pass
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return int(f) if math.isfinite(f) and f.is_integer() else None


def _float(value: Any) -> float | None:
    """``value`` as a float if it is a number (not a bool or a string), else None."""
    if isinstance(value, (bool, str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _items(value: Any) -> list[Any] | None:
    """The items of a sequence argument; None for a string or a single value."""
    if isinstance(value, (str, bytes)) or _float(value) is not None:
        return None
    try:
        return list(value)
    except TypeError:
        return None


def flag(value: Any, name: str) -> bool:
    """A boolean flag as a plain bool: True, False or a numpy bool; anything else is a TypeError
    naming ``name`` (``bool()`` read the string "False", from argparse or a hand-made config, as True)."""
    plain = as_flag(value)
    if plain is not None:
        return plain
    raise TypeError(f"{name} must be True or False, got {value!r}; a string such as 'False' would read as True")


def plain_number(value: Any, name: str) -> int | float:
    """A finite number as a plain int (ints, numpy and 0-d tensor integers) or float (other
    reals): a numpy scalar or 0-d tensor kept as given showed as ``np.float32(0.5)`` or
    ``tensor(0.5)`` in the op's repr and saved hyperparameters. TypeError/ValueError as
    :func:`finite_float`."""
    out = finite_float(value, name)
    try:
        return operator.index(value)
    except TypeError:
        return out


def finite_float(value: Any, name: str) -> float:
    """``value`` as a finite float: a TypeError naming ``name`` for a non-number (a string, None,
    a bool), a ValueError for NaN or an infinity (either turns an op's output into NaN or inf)."""
    out = _float(value)
    if out is None:
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return out


def float_seq(value: Any, name: str, what: str = "a sequence of numbers") -> tuple[float, ...]:
    """A sequence of numbers as floats; a single number, a string or a non-number is refused
    with a TypeError naming ``name`` (``what`` says what it should be)."""
    items = _items(value)
    out = None if items is None else [_float(v) for v in items]
    if out is None or None in out:
        raise TypeError(f"{name} must be {what}, got {value!r}")
    return tuple(out)  # type: ignore[arg-type]


def int_seq(value: Any, name: str, what: str = "an int or a sequence of ints") -> tuple[int, ...]:
    """An int or a sequence of ints (integral floats accepted) as a tuple; strings,
    fractions and other values are refused with a TypeError naming ``name``."""
    single = _int(value)
    items = [single] if single is not None else _items(value)
    out = None if items is None else [_int(v) for v in items]
    if out is None or None in out:
        raise TypeError(f"{name} must be {what}, got {value!r}")
    return tuple(out)  # type: ignore[arg-type]


def spatial_arg(value: int | Sequence[int], name: str, lowest: int = 0) -> tuple[int, ...]:
    """An int (every spatial dim) or one int per spatial dim (2 or 3), each >= ``lowest``."""
    out = int_seq(value, name, "an int or 2 or 3 ints")
    if len(out) not in (1, 2, 3):
        raise ValueError(f"{name} must be an int, a pair (h, w) or a triple (d, h, w), got {value!r}")
    if min(out) < lowest:
        raise ValueError(f"{name} must be >= {lowest}, got {value!r}")
    return out


def volume_hint(wanted: int, sd: int) -> str:
    """What to add to an error where an op wants ``wanted`` spatial dims of a batch with ``sd``:
    a volume stored without its channel axis, (D, H, W), batches as 2-D images with D channels."""
    if wanted == 3 and sd == 2:
        return ("; if the samples are volumes stored without a channel axis, (D, H, W), they batch as 2-D images "
                "of D channels: add the channel in static_transform (x[None]), volumes are (C, D, H, W)")
    return ""


def per_dim(value: tuple[int, ...], sd: int, name: str, op: str) -> tuple[int, ...]:
    """``spatial_arg`` output for a batch with ``sd`` spatial dims."""
    if len(value) == 1:
        return value * sd
    if len(value) != sd:
        raise ValueError(f"{op} {name}={value} has {len(value)} values but the batch has {sd} spatial dims; "
                         f"give an int or {sd} values" + volume_hint(len(value), sd))
    return value


def float_range(value: float | Sequence[float], name: str, center: float | None = None,
                lower: float = float("-inf"), upper: float = float("inf")) -> tuple[float, float]:
    """``value`` as (lo, hi); a number means ``center -/+ value`` (or ``-/+ value``)."""
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{name} must be a number or a pair (min, max), got {value!r}")
    single = _float(value)  # numpy scalars and 0-d tensors too, not only int and float
    if single is not None:
        if single < 0:
            raise ValueError(f"{name} as a single number must be >= 0, got {value!r}")
        c = 0.0 if center is None else center
        lo, hi = c - single, c + single
        if center is not None:
            lo = max(lo, lower)
    else:
        pair = float_seq(value, name, "a number or a pair (min, max)")
        if len(pair) != 2:
            raise ValueError(f"{name} must be a number or a pair (min, max), got {value!r}")
        lo, hi = pair
    if not (math.isfinite(lo) and math.isfinite(hi)):
        # An infinite bound draws inf or nan angles, scales, factors: NaN or filled outputs.
        raise ValueError(f"{name} must be finite, got {value!r}")
    if not lower <= lo <= hi <= upper:
        raise ValueError(f"{name} must be an increasing pair within [{lower}, {upper}], got {value!r}")
    return lo, hi


def probability(p: float, name: str = "p") -> float:
    """``p`` checked to lie in [0, 1] (any real number: a numpy float or a 0-d array too)."""
    value = _float(p)
    if value is None or not 0.0 <= value <= 1.0:  # NaN fails the comparison
        raise ValueError(f"{name} must be in [0, 1], got {p!r}")
    return value


def refuse_unfit_fill(batch: Batch, values: Sequence[float], op: str, shown: Any, truncated: bool,
                      param: str = "fill") -> None:
    """A ValueError naming the first integer image field of ``batch`` that cannot hold one of
    the fill ``values`` (``shown`` as given to ``op``'s ``param``): a fill past the dtype's range
    was wrapped or clamped by torch without a word. ``truncated``: the fill is truncated toward
    zero (so ``top + 0.5`` still fits); else it is rounded half to even, as the pixels are, then
    must fit."""
    for name in batch.names("image"):
        dtype = batch.field_dtype(name)
        if dtype not in INT_MAX:
            continue
        top = INT_MAX[dtype]
        low = -top - 1 if dtype.is_signed else 0
        if any(not (low <= v < top + 1 if truncated else low <= round(v) <= top) for v in values):
            raise ValueError(f"{op} {param}={shown!r} does not fit the image field {name!r} ({dtype}, values "
                             f"{low}..{top}); give a {param} in that range, or convert the image first")


def fill_values(fill: float | Sequence[float], name: str) -> list[float]:
    """A fill: one finite number (a numpy scalar or 0-d tensor too), or one per channel."""
    what = "a number or one number per channel"
    if isinstance(fill, bool):
        raise TypeError(f"{name} must be {what}, got {fill!r}")
    single = _float(fill)
    values = [single] if single is not None else list(float_seq(fill, name, what))
    if not values:
        raise ValueError(f"{name} must be a number or one number per channel, got {fill!r}")
    # NaN or inf turned a bilinear resample's every pixel NaN ((img - fill) * w + fill).
    return [finite_float(v, name) for v in values]


def refuse_bool_images(batch: Batch, op: str, reason: str) -> None:
    """A ValueError naming the first bool image field of ``batch``: ``op`` ``reason`` (why it
    needs numbers with a value range), and what to do instead."""
    for name in batch.names("image"):
        x = batch.fields[name]
        dtype = x[0].dtype if isinstance(x, list) else x.dtype
        if dtype == torch.bool:
            raise ValueError(f"{op}: image field {name!r} is torch.bool, and {op} {reason}; give a binary map "
                             "the kind 'mask' (moved nearest-neighbour, never scaled), or convert the image "
                             "first, e.g. ToDtype('uint8', scale=False) or ToDtype('float32', scale=False) (0/1)")


def keep_format(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``out`` in ``like``'s memory format (channels_last / channels_last_3d are kept)."""
    if like.ndim in (4, 5) and not like.is_contiguous():
        fmt = torch.channels_last if like.ndim == 4 else torch.channels_last_3d
        if like.is_contiguous(memory_format=fmt):
            return out.contiguous(memory_format=fmt)
    return out


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64; everything else (integers, half types) is computed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def to_input_dtype(y: torch.Tensor, like: torch.Tensor, rounding: bool = True) -> torch.Tensor:
    """``y`` (float) back to ``like``'s dtype: integers rounded and clamped to the dtype's range."""
    if like.is_floating_point():
        return y.to(like.dtype)
    if rounding:
        y = y.round()
    top = INT_MAX[like.dtype]
    return y.clamp_(-top - 1 if like.dtype.is_signed else 0, float(top)).to(like.dtype)


def channel_dim(batch: Batch) -> int:
    """The (negative) channel dim of the batch's image fields."""
    return -(batch.spatial_dims + 1)


def samples_view(x: torch.Tensor, sd: int, channels: bool = True) -> torch.Tensor:
    """View an image ``(N, *lead, C, *spatial)`` as ``(N, L, C, *spatial)`` (``channels=False``:
    ``(N, M, *spatial)``, every non-spatial dim folded)."""
    n, spatial = x.shape[0], x.shape[x.ndim - sd:]
    if channels:
        return x.reshape(n, -1, x.shape[-sd - 1], *spatial)
    return x.reshape(n, -1, *spatial)


def bcast(v: torch.Tensor, ndim: int) -> torch.Tensor:
    """A per-sample (N,) tensor viewed to broadcast against an ``ndim``-dim batch."""
    return v.view(-1, *[1] * (ndim - 1))


#: On the CPU, batches are processed in chunks of about this many elements: each op makes
#: several float passes over its input, and chunks that stay in cache run 3-5x faster than
#: whole-batch temporaries. On accelerators the whole batch is one launch.
CPU_CHUNK_ELEMENTS = 1 << 19


def chunk_rows(x: torch.Tensor) -> int:
    """The samples per chunk ``chunked`` cuts ``x`` into (all of them off the CPU)."""
    if x.device.type != "cpu":
        return max(1, x.shape[0])
    return max(1, CPU_CHUNK_ELEMENTS // max(1, x[0].numel()))


def chunked(fn: Callable[..., torch.Tensor], x: torch.Tensor, *per_sample: torch.Tensor,
            rows: int | None = None) -> torch.Tensor:
    """``fn(x, *per_sample)`` over sample chunks on the CPU (per-sample tensors sliced alike);
    ``rows`` (default ``chunk_rows(x)``) cuts the chunks of another field alike."""
    n = x.shape[0]
    if rows is None:
        rows = chunk_rows(x)
    if n <= rows:
        return fn(x, *per_sample)
    parts = [fn(x[a:a + rows], *(p[a:a + rows] for p in per_sample)) for a in range(0, n, rows)]
    return torch.cat(parts)


def scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused flat work buffer of at least ``numel`` elements (never returned to callers).

    Fresh CPU memory of batch size is page-faulted in on every call (several times the cost
    of the copy itself for ImageNet-sized batches), so work buffers live in one per-thread
    buffer per dtype that only grows.
    """
    if device.type != "cpu":
        # The CUDA caching allocator already recycles memory, and a buffer shared across
        # calls would need stream bookkeeping.
        return torch.empty(numel, dtype=dtype, device=device)
    cache = _SCRATCH.__dict__.setdefault("buffers", {})
    buf = cache.get(dtype)
    if buf is None or buf.numel() < numel:
        # Never an inference tensor: made under inference_mode (a validate before any fit:
        # Lightning evaluates in it), the buffer refused every in-place write after it.
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=dtype, device=device)
        cache[dtype] = buf
    return buf[:numel]


_SCRATCH = threading.local()


def replace_rows(x: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A new tensor: ``x`` with sample ``rows[i]`` replaced by ``values[i]`` (CPU, host indices).

    One whole-sample ``index_select`` from ``x`` and ``values`` side by side (a memcpy per
    sample; ``index_copy_`` is per element on the CPU and missing for uint16).
    """
    n = x.shape[0]
    xc = x.contiguous()
    if not rows.numel():
        return xc.clone()
    src = scratch((n + rows.numel()) * math.prod(x.shape[1:]), x.dtype, x.device).view(-1, *x.shape[1:])
    src[:n].copy_(xc)
    src[n:].copy_(values)
    pick = torch.arange(n, device=x.device)
    pick[rows] = torch.arange(n, n + rows.numel(), device=x.device)
    return torch.index_select(src, 0, pick)
