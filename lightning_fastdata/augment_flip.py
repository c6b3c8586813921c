"""Per-sample flips and quarter turns of 2-D images and 3-D volumes (exact: copies only).

The same decision is applied to every image and mask field of the batch; ``other``
fields pass through.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_fastdata import augment_crop
from lightning_fastdata.augment_base import (
    Batch,
    BatchTransform,
    bcast,
    host_shortcuts,
    int_seq,
    keep_format,
    probability,
    replace_rows,
    volume_hint,
)
from lightning_fastdata.augment_crop import flip_window, mirror_last_


def _spatial_dims_arg(dims: int | Sequence[int], name: str, op: str) -> tuple[int, ...]:
    out = int_seq(dims, f"{op} {name}", "spatial axes among -3 (D), -2 (H), -1 (W)")
    if not out or len(set(out)) != len(out) or not all(d in (-3, -2, -1) for d in out):
        raise ValueError(f"{op} {name} must be distinct spatial axes among -3 (D), -2 (H), -1 (W), got {dims!r}")
    return out


def _check_axes(dims: tuple[int, ...], batch: Batch, op: str) -> None:
    if min(dims) < -batch.spatial_dims:
        raise ValueError(f"{op} dims={dims} names axis {min(dims)}, but the batch has {batch.spatial_dims} "
                         "spatial dims (-2 is H, -1 is W; -3 is D for volumes)" + volume_hint(3, batch.spatial_dims))


def flip_samples(x: torch.Tensor, flag: torch.Tensor, dim: int) -> torch.Tensor:
    """A new tensor: the samples of ``x`` where ``flag`` (bool (N,)) mirrored along ``dim``."""
    if not host_shortcuts(x.device):
        # No host sync (nonzero would wait for the device); a mirrored pass is cheap there.
        return torch.where(bcast(flag, x.ndim), x.flip(dim), x)
    # Mirror only the flipped samples, then pick each sample's version with one
    # whole-sample index_select.
    rows = flag.nonzero().view(-1)
    return replace_rows(x, rows, x.index_select(0, rows).flip(dim))


class RandomFlip(BatchTransform):
    """Mirror each sample along each of ``dims`` independently, with probability ``p`` per axis.

    Images (N, C, H, W) and volumes (N, C, D, H, W); every image and mask field of a sample
    gets the same flips; ``other`` fields pass through.

    Args:
        dims: Spatial axes: -1 (W), -2 (H), -3 (D, volumes).
        p: Probability of flipping a sample along one axis, in [0, 1].
    """

    def __init__(self, dims: int | Sequence[int] = (-1,), p: float = 0.5) -> None:
        self.dims = _spatial_dims_arg(dims, "dims", type(self).__name__)
        self.p = probability(p)

    def make_params(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``flip``: bool (N, len(dims)), whether each sample is mirrored along each axis."""
        _check_axes(self.dims, batch, type(self).__name__)
        return {"flip": batch.keys.bernoulli(0, self.p, len(self.dims))}

    def apply_batch(self, batch: Batch, flip: torch.Tensor) -> Batch:
        """Mirror each sample along the axes where ``flip`` is set, every axis in one pass."""
        _check_axes(self.dims, batch, type(self).__name__)
        sd, spatial = batch.spatial_dims, batch.spatial_size
        corner = torch.zeros(len(batch), sd, dtype=torch.int64, device=batch.device)

        def run(x: torch.Tensor) -> torch.Tensor:
            if math.prod(x.shape[1:]) < augment_crop.MIRROR_AFTER_ELEMENTS:
                # Small samples (short rows): whole-sample flips, one axis at a time, cost less.
                out = x.contiguous()
                for i, d in enumerate(self.dims):
                    out = flip_samples(out, flip[:, i], d)
                return keep_format(out, x)
            if self.dims != (-1,):
                # A window of the whole sample whose rows are read in mirrored order along the
                # mirrored axes (the last axis mirrored after): one copy, whatever the axes.
                return keep_format(flip_window(x, corner, spatial, sd, flip, self.dims), x)
            if host_shortcuts(x.device):
                # Only the last axis: a copy, then the mirrored samples reversed in place.
                return keep_format(mirror_last_(x.clone(memory_format=torch.contiguous_format), flip[:, 0]), x)
            return keep_format(flip_samples(x.contiguous(), flip[:, 0], -1), x)

        return batch.map(image=run, mask=run)


class RandomHorizontalFlip(RandomFlip):
    """Mirror each sample left-right with probability ``p``: ``RandomFlip(dims=(-1,), p)``.

    Args:
        p: Probability of flipping a sample, in [0, 1].
    """

    def __init__(self, p: float = 0.5) -> None:
        super().__init__(dims=(-1,), p=p)

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p!r})"


class RandomVerticalFlip(RandomFlip):
    """Mirror each sample top-bottom with probability ``p``: ``RandomFlip(dims=(-2,), p)``.

    Args:
        p: Probability of flipping a sample, in [0, 1].
    """

    def __init__(self, p: float = 0.5) -> None:
        super().__init__(dims=(-2,), p=p)

    def __repr__(self) -> str:
        return f"RandomVerticalFlip(p={self.p!r})"


class RandomRot90(BatchTransform):
    """Rotate each sample by k quarter turns in the plane ``dims``, as ``torch.rot90(sample, k, dims)``.

    With probability ``p`` a sample gets k uniform in {1, 2, 3}, else k = 0; the default
    ``p=0.75`` makes k uniform in {0, 1, 2, 3}. The plane must be square (an odd k would
    change the shape of some samples only); crop to a square first. Every image and mask
    field of a sample is rotated alike; ``other`` fields pass through.

    Args:
        dims: The plane: two spatial axes among -3 (D), -2 (H), -1 (W).
        p: Probability of a non-zero rotation, in [0, 1].
    """

    def __init__(self, dims: Sequence[int] = (-2, -1), p: float = 0.75) -> None:
        self.dims = _spatial_dims_arg(dims, "dims", "RandomRot90")
        if len(self.dims) != 2:
            raise ValueError(f"RandomRot90 dims must be a plane of two spatial axes, got {dims!r}")
        self.p = probability(p)

    def _check(self, batch: Batch) -> None:
        _check_axes(self.dims, batch, "RandomRot90")
        a, b = (batch.spatial_size[d] for d in self.dims)
        if a != b:
            raise ValueError(f"RandomRot90 in plane dims={self.dims} needs equal sizes there, got {a} x {b}; "
                             "crop to a square first (RandomCrop) or rotate in a square plane")

    def make_params(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``k``: int64 (N,), each sample's number of quarter turns in 0..3."""
        self._check(batch)
        u = batch.keys.uniform(0, 2)
        turns = torch.floor(u[:, 1] * 3).long().clamp_(max=2) + 1
        return {"k": torch.where(u[:, 0] < self.p, turns, torch.zeros_like(turns))}

    def apply_batch(self, batch: Batch, k: torch.Tensor) -> Batch:
        """Rotate each sample by its ``k`` quarter turns."""
        self._check(batch)

        def run(x: torch.Tensor) -> torch.Tensor:
            xc = x.contiguous()
            if host_shortcuts(x.device):
                out = xc
                for turns in (1, 2, 3):
                    rows = (k == turns).nonzero().view(-1)
                    if rows.numel():
                        out = replace_rows(out, rows, torch.rot90(xc.index_select(0, rows), turns, self.dims))
                return keep_format(out if out is not xc else xc.clone(), x)
            out = xc
            for turns in (1, 2, 3):
                out = torch.where(bcast(k == turns, x.ndim), torch.rot90(xc, turns, self.dims), out)
            return keep_format(out if out is not xc else xc.clone(), x)

        return batch.map(image=run, mask=run)
