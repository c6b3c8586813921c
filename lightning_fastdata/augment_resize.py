"""Deterministic size changes: ``Resize`` (shorter side, or an exact size) and ``CenterCrop``.

Both follow ``torchvision.transforms.v2`` (``Resize``, ``CenterCrop``) pixel for pixel on
batch tensors and on lists of images of varying sizes (ragged batches, e.g. decoded JPEGs):
``Resize(int)`` keeps a list a list (sizes still vary), ``Resize((h, w))`` and
``CenterCrop`` make one batch tensor of it. Masks are resized nearest-neighbour and
padded with 0, as torchvision treats a ``Mask``; ``other`` fields pass through.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lightning_fastdata._pool import default_threads, map_runs
from lightning_fastdata.augment_base import (
    Batch,
    BatchTransform,
    _int,
    flag,
    host_shortcuts,
    keep_format,
    refuse_bool_images,
    spatial_arg,
    volume_hint,
)
from lightning_fastdata.augment_lists import canvas, groups, lead_shape, scatter
from lightning_fastdata.augment_resample import interpolate_image, nearest_resize, resize_window


def resized_size(height: int, width: int, size: tuple[int, ...], max_size: int | None) -> tuple[int, int]:
    """torchvision's output size of ``resize``: (h, w) as given, or the shorter side set to
    ``size[0]`` with the longer one scaled (truncated) and capped at ``max_size``."""
    if len(size) == 2:
        return size[0], size[1]
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size[0], int(size[0] * long / short)
    if max_size is not None and new_long > max_size:
        new_short, new_long = int(max_size * new_short / new_long), max_size
    return (new_long, new_short) if width <= height else (new_short, new_long)


def _require_2d(batch: Batch, op: str) -> None:
    if batch.spatial_dims != 2:
        raise ValueError(f"{op} works on 2-D images (N, C, H, W); the batch has {batch.spatial_dims} spatial dims")


class Resize(BatchTransform):
    """Resize every sample as ``torchvision.transforms.v2.Resize`` (bilinear).

    An int sets the shorter side (the longer one keeps the aspect ratio, as torchvision:
    truncated), so on a list of images of varying sizes the sizes still vary and the
    result is a list; follow it with ``CenterCrop`` to make a batch. (h, w) resizes to
    exactly that: a list becomes one batch tensor.

    Args:
        size: The shorter side (int), or the output (h, w).
        max_size: With an int ``size``: the longest side allowed (the shorter one shrinks).
        antialias: Antialias when downscaling, as torchvision's default.
    """

    lists = True

    def __init__(self, size: int | Sequence[int], max_size: int | None = None, antialias: bool = True) -> None:
        size = spatial_arg(size, "size", lowest=1)
        if len(size) == 3:
            raise ValueError(f"Resize size is an int (the shorter side) or (h, w), got {size!r}")
        self.size = size
        if max_size is not None:
            if len(size) != 1:
                raise ValueError(f"Resize max_size goes with an int size (the shorter side), got size={size!r}")
            top = _int(max_size)  # numpy and 0-d tensor integers too, stored as a plain int
            if top is None or top <= size[0]:
                raise ValueError(f"Resize max_size must be an int > size={size[0]}, got {max_size!r}")
            max_size = top
        self.max_size = max_size
        self.antialias = flag(antialias, "antialias")

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """The (h, w) an input of (height, width) is resized to."""
        return resized_size(height, width, self.size, self.max_size)

    def apply_batch(self, batch: Batch) -> Batch:
        """Resize every image (bilinear) and mask (nearest) field."""
        _require_2d(batch, "Resize")
        refuse_bool_images(batch, "Resize", "resamples pixel values into the image's dtype")
        if batch.ragged:
            return self._apply_list(batch)
        size = self.output_size(*batch.spatial_size)
        return batch.map(image=lambda x: keep_format(interpolate_image(x, size, self.antialias), x),
                         mask=lambda x: keep_format(nearest_resize(x, size), x))

    def _apply_list(self, batch: Batch) -> Batch:
        sizes = [self.output_size(h, w) for h, w in batch.spatial_size]
        stack = len(self.size) == 2
        out: dict[str, torch.Tensor | list[torch.Tensor]] = {}
        for name in batch.names("image", "mask"):
            xs = batch.fields[name]
            lead_shape(xs, 2, name, batch.keys.index)
            if batch.kinds[name] == "mask":
                ys = [nearest_resize(x, s) for x, s in zip(xs, sizes, strict=True)]
            elif host_shortcuts(xs[0].device):
                # torch's own kernel per image (uint8 natively on the CPU): faster there than batched
                # taps; the images shared among the CPU pool's threads.
                ys = map_runs(lambda rows, xs=xs: [interpolate_image(xs[i], sizes[i], self.antialias) for i in rows],
                              [h * w for h, w in sizes], default_threads())
            else:
                ys = self._batched(xs, sizes)
            out[name] = torch.stack(ys) if stack else ys
        return batch.replace(out)

    def _batched(self, xs: list[torch.Tensor], sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Accelerators: groups of samples on padded canvases, resampled at once with each
        sample's own scale (no per-sample kernels); the results are views of the group's output."""
        out: list[torch.Tensor | None] = [None] * len(xs)
        for rows in groups([tuple(x.shape[-2:]) for x in xs]):
            src = canvas(xs, rows, 2)
            dev = src.device
            hw = torch.tensor([list(xs[r].shape[-2:]) for r in rows]).to(dev, non_blocking=True)
            target = torch.tensor([sizes[r] for r in rows]).to(dev, non_blocking=True)
            extent = [max(sizes[r][d] for r in rows) for d in range(2)]
            widest = [max(xs[r].shape[-2 + d] / sizes[r][d] for r in rows) for d in range(2)]
            zero = torch.zeros_like(hw[:, 0])
            res = resize_window(src, zero, zero, hw[:, 0], hw[:, 1], extent, self.antialias, target=target,
                                widest=widest)
            for j, r in enumerate(rows):
                out[r] = res[j, ..., :sizes[r][0], :sizes[r][1]]
        return out  # type: ignore[return-value]


def center_crop_geometry(spatial: Sequence[int], size: Sequence[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """torchvision's ``center_crop``: per dim the zero padding (before, after) when the crop is
    larger than the input, and the crop's corner in the padded input."""
    pads = [((c - s) // 2, (c - s + 1) // 2) if c > s else (0, 0) for s, c in zip(spatial, size, strict=True)]
    padded = [s + a + b for s, (a, b) in zip(spatial, pads, strict=True)]
    corner = [int(round((s - c) / 2.0)) for s, c in zip(padded, size, strict=True)]
    return pads, corner


def _center_crop(x: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """The centre window of ``x`` (..., *spatial), zero-padded where the crop is larger; a view
    unless padded."""
    sd = len(size)
    pads, corner = center_crop_geometry(x.shape[-sd:], size)
    if any(a or b for a, b in pads):
        x = F.pad(x, [p for pair in reversed(pads) for p in pair], value=0.0)
    return x[(Ellipsis, *(slice(c, c + s) for c, s in zip(corner, size, strict=True)))]


class CenterCrop(BatchTransform):
    """Cut the centre of every sample as ``torchvision.transforms.v2.CenterCrop``.

    Where the crop is larger than a sample it is zero-padded first (images and masks, as
    torchvision). The corner is ``round((size_in - size_out) / 2)`` per axis, Python's
    rounding (half to even) as torchvision. Works on 2-D images and 3-D volumes; a list of
    samples of varying sizes becomes one batch tensor.

    Args:
        size: Output size: an int for every spatial dim, (h, w) or (d, h, w).
    """

    lists = True

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = spatial_arg(size, "size", lowest=1)

    def window_size(self, batch: Batch) -> tuple[int, ...]:
        """The window's size, one entry per spatial dim of ``batch``."""
        sd = batch.spatial_dims
        if len(self.size) == 1:
            return self.size * sd
        if len(self.size) != sd:
            raise ValueError(f"CenterCrop size={self.size} has {len(self.size)} values but the batch has {sd} "
                             f"spatial dims; give an int or {sd} values" + volume_hint(len(self.size), sd))
        return self.size

    def apply_batch(self, batch: Batch) -> Batch:
        """Cut the centre window of every image and mask field."""
        size = self.window_size(batch)
        if batch.ragged:
            out = {}
            for name in batch.names("image", "mask"):
                xs = batch.fields[name]
                lead_shape(xs, len(size), name, batch.keys.index)
                # One stack of per-sample windows (views): a single copy kernel for the batch.
                out[name] = torch.stack([_center_crop(x, size) for x in xs])
            return batch.replace(out)
        return batch.map(image=lambda x: keep_format(_center_crop(x, size).contiguous(), x),
                         mask=lambda x: keep_format(_center_crop(x, size).contiguous(), x))


def resize_center_crop(resize: Resize, crop: CenterCrop, batch: Batch) -> Batch | None:
    """``Resize(int)`` then ``CenterCrop`` of a ragged batch on an accelerator, fused: each
    group's canvas is resampled straight to the crop window of its resized samples (the same
    taps as resizing then cropping, without the intermediate images). None where the fused
    form does not apply (the CPU, a crop larger than a resized sample, masks)."""
    if not batch.ragged or batch.spatial_dims != 2 or host_shortcuts(batch.device) or batch.names("mask"):
        return None
    refuse_bool_images(batch, "Resize", "resamples pixel values into the image's dtype")
    size = crop.window_size(batch)
    sizes = [resize.output_size(h, w) for h, w in batch.spatial_size]
    if any(c > s for hw in sizes for c, s in zip(size, hw, strict=True)):
        return None
    corners = [center_crop_geometry(hw, size)[1] for hw in sizes]
    out = {}
    n = len(batch)
    for name in batch.names("image"):
        xs = batch.fields[name]
        lead_shape(xs, 2, name, batch.keys.index)
        parts = []
        for rows in groups([tuple(x.shape[-2:]) for x in xs]):
            src = canvas(xs, rows, 2)
            dev = src.device
            hw = torch.tensor([list(xs[r].shape[-2:]) for r in rows]).to(dev, non_blocking=True)
            target = torch.tensor([sizes[r] for r in rows]).to(dev, non_blocking=True)
            first = torch.tensor([corners[r] for r in rows]).to(dev, non_blocking=True)
            widest = [max(xs[r].shape[-2 + d] / sizes[r][d] for r in rows) for d in range(2)]
            zero = torch.zeros_like(hw[:, 0])
            parts.append((rows, resize_window(src, zero, zero, hw[:, 0], hw[:, 1], size, resize.antialias,
                                              target=target, first=first, widest=widest)))
        out[name] = scatter(parts, n)
    return batch.replace(out)


__all__ = ["CenterCrop", "Resize", "center_crop_geometry", "resize_center_crop", "resized_size"]
