"""Batched augmentation on the training device, with randomness keyed by the sample.

Ops take a batch, either a plain tensor (one image field: ``(N, C, H, W)`` images or
``(N, C, D, H, W)`` volumes) or an :class:`Batch` of named fields with kinds (``image``,
``mask``, ``other``), and return the same type::

    from lightning_fastdata import augment as A
    from lightning_fastdata.keys import SampleKeys

    aug = A.Compose([A.RandomCrop(32, padding=4), A.RandomHorizontalFlip(), A.Normalize(MEAN, STD)])
    out = aug(images)                                       # keys: samples 0..N-1, seed 0
    out = aug(images, SampleKeys(seed, epoch, indices))     # what the datamodule does
    batch = A.Batch({"image": ct, "label": seg}, {"image": "image", "label": "mask"},
                    SampleKeys(seed, epoch, indices))
    batch = A.Compose([A.RandomCropByLabel(96), A.RandomFlip(dims=(-3, -2, -1))])(batch)

Every random parameter comes from the batch's :class:`~lightning_fastdata.keys.SampleKeys`
only: a pure function of (seed, epoch, global sample index, op position, draw slot), so
a sample gets the same augmentation whatever the batch size, batch composition, world
size or resume point. ``Compose`` and ``RandomApply`` give the op at position i the keys
``keys.child(i)``.

Geometric ops (crops, flips, quarter turns, affine maps, resized crops) apply the same
per-sample parameters to every image and mask field (masks nearest-neighbour, padded
with 0); photometric and intensity ops (``ToDtype``, ``Normalize``, ``ColorJitter``,
``RandomErasing``, ``GaussianNoise``, the intensity ops) touch image fields only;
``other`` fields always pass through. Every op has ``draw(x, keys)`` (the per-sample
parameters) and ``apply(x, **params)``: ``op(x, keys) == op.apply(x, **op.draw(x, keys))``.
``Compose`` and ``RandomApply`` draw the keys their ops draw from (an inner op's parameters
depend on what the ops before it made, so they are drawn as the ops run).

Ops work on uint8 where they can (crop, flip): augment first, then convert and normalise
last (``Normalize`` accepts integers and converts in the same pass). No op makes the host
wait for the device.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from lightning_fastdata import augment_crop
from lightning_fastdata.augment_base import (
    Batch,
    BatchTransform,
    as_batch,
    bcast,
    host_shortcuts,
    keep_format,
    probability,
    replace_rows,
)
from lightning_fastdata.augment_color import ColorJitter, Normalize, RandomErasing, ToDtype
from lightning_fastdata.augment_crop import RandomCrop, RandomCropByLabel
from lightning_fastdata.augment_flip import RandomFlip, RandomHorizontalFlip, RandomRot90, RandomVerticalFlip
from lightning_fastdata.augment_intensity import (
    GaussianNoise,
    PointwiseIntensity,
    RandomAdjustContrast,
    RandomScaleIntensity,
    RandomShiftIntensity,
    ScaleIntensityRange,
    chain_steps,
    pointwise_windows,
    run_pointwise,
)
from lightning_fastdata.augment_resample import RandomAffine, RandomResizedCrop, RandomRotation
from lightning_fastdata.augment_resize import CenterCrop, Resize, resize_center_crop
from lightning_fastdata.keys import SampleKeys


def _check_ops(transforms: Iterable[Callable], owner: str) -> list[Callable]:
    """The ops as a list: a single op, or any iterable of them (a generator too)."""
    if callable(transforms) and not isinstance(transforms, (list, tuple)):
        return [transforms]
    if not isinstance(transforms, Iterable) or isinstance(transforms, (str, bytes)):
        raise TypeError(f"{owner} transforms must be a list of ops, got {transforms!r}")
    # Listed once, before the checks: checking a generator consumed it and left no op to run.
    ops = list(transforms)
    for i, t in enumerate(ops):
        if not callable(t):
            raise TypeError(f"{owner} item {i} is a {type(t).__name__}, not a transform")
    return ops


def _run(op: Callable, batch: Batch, keys: SampleKeys) -> Batch:
    """Run one op with ``keys``; a plain callable (not a BatchTransform) maps each image field
    (each image of a list field: it takes a tensor, never a list). The batch comes back with
    its own keys, not the op's: the next op of a sequence draws from the sequence's keys."""
    if isinstance(op, BatchTransform):
        return op.forward(batch.replace(keys=keys)).replace(keys=batch.keys)
    masks = batch.names("mask")
    if masks:
        _warn_images_only(op, masks)
    if batch.ragged:
        return batch.map(image=lambda xs: [op(x) for x in xs])
    return batch.map(image=op)


def _any_moves_pixels(ops: Sequence[Callable]) -> bool:
    return any(getattr(op, "moves_pixels", True) for op in ops)


def _keys_for(batch: Batch, keys: SampleKeys | None, op: str) -> SampleKeys:
    """The keys an ``apply`` runs its ops with: ``keys`` (from ``draw``), else the batch's."""
    if keys is None:
        return batch.keys
    if not isinstance(keys, SampleKeys):
        raise TypeError(f"{op}.apply keys must be the SampleKeys from {op}.draw, got {type(keys).__name__}")
    if len(keys) != len(batch):
        raise ValueError(f"{op}.apply got keys of {len(keys)} samples for a batch of {len(batch)}; pass the "
                         f"parameters {op}.draw returned for this batch")
    return keys


_WARNED_CALLABLES: set[str] = set()


def _warn_images_only(op: Callable, masks: list[str]) -> None:
    """Once per kind of callable: it sees the image fields only, so a geometric one (a
    torchvision flip, crop or rotation) moves the images and not the masks, silently."""
    name = getattr(op, "__qualname__", None) or type(op).__qualname__
    if name in _WARNED_CALLABLES:
        return
    _WARNED_CALLABLES.add(name)
    warnings.warn(f"Compose applies {name}, a plain callable, to the image fields only: the mask fields {masks} do "
                  "not move with it. If it moves pixels (a torchvision flip, crop or rotation), each mask stops "
                  "matching its image, and a random one draws once per call, not per sample; use this package's "
                  "op instead (augment.RandomHorizontalFlip, RandomCrop, RandomRotation, ...)", stacklevel=4)


def _fusable_crop(op: Callable) -> bool:
    return type(op) in (RandomCrop, RandomCropByLabel)


def starts_with_crop(op: Any) -> bool:
    """Whether ``op`` (or the first op of a ``Compose``, nested or not) is a ``RandomCrop`` or
    ``RandomCropByLabel``: a pipeline that can cut its windows from the store's rows
    (:class:`~lightning_fastdata.augment_base.StoreRows`) without gathering whole samples."""
    while type(op) is Compose and op.transforms:
        op = op.transforms[0]
    return _fusable_crop(op)


def _fusable_flip(op: Callable) -> bool:
    # RandomFlip and its subclasses that only preset dims (horizontal, vertical).
    return (isinstance(op, RandomFlip) and type(op).make_params is RandomFlip.make_params
            and type(op).apply_batch is RandomFlip.apply_batch)


def _pointwise(op: Callable) -> bool:
    return isinstance(op, PointwiseIntensity) and type(op).apply_batch in (
        PointwiseIntensity.apply_batch, *(c.apply_batch for c in _POINTWISE))


_POINTWISE = (ScaleIntensityRange, RandomScaleIntensity, RandomShiftIntensity)


def _run_end(ops: Sequence[Callable], start: int, member: Callable[[Callable], bool]) -> int:
    """The end of the run of ops from ``start`` that are ``member``s (``start`` when none)."""
    end = start
    while end < len(ops) and member(ops[end]):
        end += 1
    return end


def _keyed(op: Callable) -> bool:
    # The built-in pointwise ops: their parameters depend on the keys only, so they can be
    # drawn before the crop they follow has cut anything.
    return type(op) in _POINTWISE


def _windows_into_chain(op: RandomCrop | RandomCropByLabel, batch: Batch) -> bool:
    """Whether ``op``'s image windows can be cut straight into a following intensity chain:
    on the CPU, unpadded windows, large enough that a loop over the samples pays."""
    if not host_shortcuts(batch.device):
        return False  # on accelerators the batched cut and chain launch few kernels already
    if type(op) is RandomCrop and (any(op.padding) or op.pad_if_needed):
        return False
    return math.prod(op.window_size(batch)) >= augment_crop.WINDOWS_FROM_ELEMENTS


def _crop_run(ops: Sequence[Callable], i: int, batch: Batch, keys: SampleKeys) -> tuple[Batch, int] | None:
    """The crop ``ops[i]`` with what it fuses with: a following ``RandomFlip`` (mirrored
    windows cut in one pass) and, on the CPU, a following chain of pointwise intensity ops
    (image windows read straight into the chain: ``pointwise_windows``); op j draws from
    ``keys.child(j)``, ``keys`` being the Compose's (not ``batch.keys``: after an op ran on
    its own, those are that op's). The batch after the run and the index of the next op;
    None when nothing follows that fuses."""
    op = ops[i]
    nxt = ops[i + 1] if i + 1 < len(ops) else None
    start = i + 2 if _fusable_flip(nxt) else i + 1
    end = _run_end(ops, start, _keyed)
    into_chain = end > start and _windows_into_chain(op, batch)  # type: ignore[arg-type]
    if start == i + 1 and not into_chain:
        return None
    extra: dict[str, Any] = {}
    if start == i + 2:
        extra = {"flip": nxt.make_params(batch.replace(keys=keys.child(i + 1)))["flip"],  # type: ignore[union-attr]
                 "flip_dims": nxt.dims}  # type: ignore[union-attr]
    if into_chain:
        # The chain's parameters depend on the keys only (not on the window's pixels).
        chain = [(ops[j], ops[j].make_params(batch.replace(keys=keys.child(j)))) for j in range(start, end)]
        extra["image_cut"] = lambda x, rows, offset, size, mirror: pointwise_windows(
            x, offset, size, mirror, chain_steps(chain, x.dtype), rows)  # type: ignore[arg-type]
    crop = op.make_params(batch.replace(keys=keys.child(i)))  # type: ignore[union-attr]
    return op.apply_batch(batch, **crop, **extra), end if into_chain else start  # type: ignore[union-attr]


class Compose(BatchTransform):
    """Apply ops in order; the op at position i draws from ``keys.child(i)``.

    Some runs of ops are fused into fewer passes over the batch, with the same draws and a
    bit-identical output to the ops in sequence:

    - a ``RandomCrop`` or ``RandomCropByLabel`` followed by a ``RandomFlip`` (any axes;
      ``RandomHorizontalFlip``, ``RandomVerticalFlip``) cuts mirrored windows in one pass;
    - consecutive ``ScaleIntensityRange``, ``RandomScaleIntensity`` and
      ``RandomShiftIntensity`` run as one chain of elementwise steps (the same float
      operations in the same order, over cache-sized chunks on the CPU);
    - on the CPU, such a chain right after a crop (and its flip) reads the image windows
      straight from the input, a slab at a time, into the chain (no cut batch in between),
      for windows of at least ``augment_crop.WINDOWS_FROM_ELEMENTS`` voxels;
    - a ``RandomResizedCrop`` followed by ``RandomHorizontalFlip`` (or ``RandomFlip`` of the
      last axis) mirrors the new crops in place (no copy of the batch for the flip);
    - ``Resize(int)`` followed by ``CenterCrop`` on a list of images, on an accelerator,
      resamples straight to the crop (within float rounding of the two ops in sequence).

    Callables that are not augment ops are applied to each image field's tensor (to each
    image's tensor, on a list of images).

    ``draw`` gives the keys the ops draw from (``keys``; op i draws from ``keys.child(i)``
    when it runs, as its parameters depend on what the ops before it made) and
    ``apply(x, keys=keys)`` runs the ops with them.

    Args:
        transforms: The ops, applied first to last.
    """

    #: Lists are handled op by op (size-fixing ops turn them into batch tensors), never per sample.
    lists = True

    def __init__(self, transforms: Sequence[BatchTransform]) -> None:
        self.transforms = _check_ops(transforms, "Compose")

    @property
    def moves_pixels(self) -> bool:  # type: ignore[override]
        """Whether any of its ops may move pixels (a plain callable may)."""
        return _any_moves_pixels(self.transforms)

    def make_params(self, batch: Batch) -> dict[str, Any]:
        """``keys``: the batch's keys, which the ops draw from (op i from ``keys.child(i)``)."""
        return {"keys": batch.keys}

    def apply_batch(self, batch: Batch, keys: SampleKeys | None = None) -> Batch:
        """Run the ops with ``keys`` (default: the batch's)."""
        return self.forward(batch.replace(keys=_keys_for(batch, keys, "Compose")))

    def forward(self, batch: Batch) -> Batch:
        """Run the ops on a Batch."""
        keys, ops, i = batch.keys, self.transforms, 0
        if not batch.ragged and len(batch) == 0:
            # Fused runs (crop + flip, ...) read samples; each op on its own handles 0 of them.
            for j, op in enumerate(ops):
                batch = _run(op, batch, keys.child(j))
            return batch.replace(keys=keys)
        while i < len(ops):
            op = ops[i]
            nxt = ops[i + 1] if i + 1 < len(ops) else None
            if _fusable_crop(op) and not batch.ragged:
                fused = _crop_run(ops, i, batch, keys)
                if fused is not None:
                    batch, i = fused
                    continue
            if type(op) is RandomResizedCrop and _fusable_flip(nxt) and nxt.dims == (-1,):  # type: ignore[union-attr]
                # The flip's coins depend on the keys only: drawn first, the resized crops are
                # written mirrored (by the CPU pool's threads) or mirrored in place, never copied
                # again for the flip.
                box = op.make_params(batch.replace(keys=keys.child(i)))
                flip = nxt.make_params(batch.replace(keys=keys.child(i + 1)))["flip"][:, 0]  # type: ignore[union-attr]
                batch = op.apply_batch(batch.replace(keys=keys.child(i)), **box, flip=flip)
                i += 2
                continue
            if type(op) is Resize and len(op.size) == 1 and type(nxt) is CenterCrop:
                fused = resize_center_crop(op, nxt, batch)
                if fused is not None:
                    batch = fused
                    i += 2
                    continue
            end = _run_end(ops, i, _pointwise)
            if end - i > 1 and not batch.ragged:
                chain = [(ops[j], ops[j].make_params(batch.replace(keys=keys.child(j)))) for j in range(i, end)]
                batch = run_pointwise(batch, chain)  # type: ignore[arg-type]
                i = end
                continue
            batch = _run(op, batch, keys.child(i))
            i += 1
        return batch.replace(keys=keys)


class RandomApply(BatchTransform):
    """Apply ``transforms`` (in order) to each sample with probability ``p``, independently.

    The coin comes from this op's keys; the op at position i inside draws from
    ``keys.child(i)``, so a chosen sample gets the parameters it would get in any batch.
    On the CPU the chosen samples are transformed as one smaller batch; on accelerators
    every sample is transformed and the chosen ones kept (no host sync). The transforms
    must keep the shape and dtype of image and mask fields. ``draw`` gives the coins
    (``apply``) and the keys the transforms draw from (``keys``).

    Args:
        transforms: The ops to apply to the chosen samples.
        p: Probability of choosing a sample, in [0, 1].
    """

    def __init__(self, transforms: Sequence[BatchTransform], p: float = 0.5) -> None:
        self.transforms = _check_ops(transforms, "RandomApply")
        self.p = probability(p)

    @property
    def moves_pixels(self) -> bool:  # type: ignore[override]
        """Whether any of its ops may move pixels (a plain callable may)."""
        return _any_moves_pixels(self.transforms)

    def make_params(self, batch: Batch) -> dict[str, Any]:
        """``apply``: bool (N,), the samples that are transformed; ``keys``: the batch's keys,
        which the transforms draw from (transform i from ``keys.child(i)``)."""
        return {"apply": batch.keys.bernoulli(0, self.p), "keys": batch.keys}

    def draw(self, x: torch.Tensor | list[torch.Tensor] | Batch,
             keys: SampleKeys | None = None) -> dict[str, Any]:
        """The coins and keys this op would use on ``x`` with ``keys``."""
        # Both depend on the keys only: drawn for a whole list of images too (not per sample).
        return self.make_params(as_batch(x, keys)[0])

    def apply_batch(self, batch: Batch, apply: torch.Tensor, keys: SampleKeys | None = None) -> Batch:
        """Run the transforms (drawing from ``keys``, default the batch's) on the samples where ``apply``."""
        names = batch.names("image", "mask")
        keys = _keys_for(batch, keys, "RandomApply")
        if host_shortcuts(batch.device):
            rows = apply.nonzero().view(-1)
            if not rows.numel():
                return batch
            sub = Batch({k: batch.fields[k].index_select(0, rows) for k in names},
                        {k: batch.kinds[k] for k in names}, keys.take(rows), batch.spatial_dims)
        else:
            sub = Batch({k: batch.fields[k] for k in names}, {k: batch.kinds[k] for k in names}, keys,
                        batch.spatial_dims)
        for i, t in enumerate(self.transforms):
            sub = _run(t, sub, sub.keys.child(i) if isinstance(t, BatchTransform) else sub.keys)
        out = {}
        for k in names:
            x, y = batch.fields[k], sub.fields[k]
            if y.shape[1:] != x.shape[1:] or y.dtype != x.dtype:
                raise ValueError(f"RandomApply needs shape- and dtype-preserving transforms: field {k!r} became "
                                 f"{tuple(y.shape[1:])} {y.dtype} from {tuple(x.shape[1:])} {x.dtype}; "
                                 "put resizing and converting ops outside RandomApply")
            if host_shortcuts(batch.device):
                out[k] = keep_format(replace_rows(x, rows, y.contiguous()), x)
            else:
                out[k] = keep_format(torch.where(bcast(apply, x.ndim), y, x), x)
        return batch.replace(out)


__all__ = [
    "Batch",
    "BatchTransform",
    "CenterCrop",
    "ColorJitter",
    "Compose",
    "GaussianNoise",
    "Normalize",
    "RandomAdjustContrast",
    "RandomAffine",
    "RandomApply",
    "RandomCrop",
    "RandomCropByLabel",
    "RandomErasing",
    "RandomFlip",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "RandomRot90",
    "RandomRotation",
    "RandomScaleIntensity",
    "RandomShiftIntensity",
    "RandomVerticalFlip",
    "Resize",
    "SampleKeys",
    "ScaleIntensityRange",
    "ToDtype",
]
