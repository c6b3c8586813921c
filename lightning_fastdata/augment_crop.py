"""Per-sample crops of 2-D images and 3-D volumes: random windows and label-centred windows.

Each crop is a copy of contiguous rows (no per-pixel index), applied with the same window
to every image and mask field of the batch; ``other`` fields pass through.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from lightning_fastdata._lightning import tensor_version
from lightning_fastdata.augment_base import (
    Batch,
    BatchTransform,
    const,
    finite_float,
    flag,
    host_shortcuts,
    int_seq,
    keep_format,
    per_dim,
    plain_number,
    refuse_unfit_fill,
    scratch,
    spatial_arg,
    volume_hint,
)
from lightning_fastdata.augment_lists import canvas, groups, lead_shape, scatter, take
from lightning_fastdata.keys import BoundedCache


def _fill_border(src: torch.Tensor, py: int, px: int, h: int, w: int, fill: float) -> None:
    """Set the padding of every plane of ``src`` (shape (s, m, h + 2py, w + 2px)) to ``fill``.

    Narrow images: one contiguous memset of everything (the border is a large share, and
    filling strips row by row costs more). Wide images: only the border, as three views of
    the flat planes: the head (top rows and the first left margin), the gaps (each row's
    right margin with the next row's left margin, contiguous in memory) and the tail.
    """
    if w < 64:
        src.fill_(fill)
        return
    s, m, hp, wp = src.shape
    plane = hp * wp
    planes = src.view(s * m, plane)
    planes[:, :py * wp + px].fill_(fill)
    planes[:, (py + h - 1) * wp + px + w:].fill_(fill)
    if h > 1 and px:
        gaps = planes.as_strided((s * m, h - 1, 2 * px), (plane, wp, 1),
                                 planes.storage_offset() + py * wp + px + w)
        gaps.fill_(fill)


#: Row grids per window geometry (one per input size of a ragged list): emptied past 64, the
#: ones a CUDA graph captured kept (see ``BoundedCache``).
_GRIDS: BoundedCache = BoundedCache(64)


def _row_grid(m: int, plane: int, size: tuple[int, ...], strides: list[int], device: torch.device) -> torch.Tensor:
    """Offsets of a window's rows from its corner: (m, *size) int64, cached per geometry."""
    key = (m, plane, size, tuple(strides), str(device))
    grid = _GRIDS.get(key)
    if grid is not None:
        if device.type == "cuda":
            _GRIDS.pin(key, grid)
        return grid
    grid = (torch.arange(m, device=device) * plane).view(m, *[1] * len(size))
    for d, (extent, stride) in enumerate(zip(size, strides, strict=True)):
        shape = [1] * (len(size) + 1)
        shape[d + 1] = extent
        grid = grid + (torch.arange(extent, device=device) * stride).view(shape)
    return _GRIDS.put(key, grid)


def window_crop(x: torch.Tensor, offset: torch.Tensor, size: Sequence[int], sd: int,
                flip: torch.Tensor | None = None, padding: Sequence[int] | None = None,
                fill: float = 0, mirror_rows: torch.Tensor | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample crop of ``pad(x)`` at ``offset`` (N, sd), of ``size``, optionally mirrored
    along the last axis (``flip``, bool (N,)) and along the other spatial axes
    (``mirror_rows``, bool (N, sd - 1)); ``x`` is ``(N, ..., *spatial)`` with ``sd`` spatial dims,
    or, with ``rows`` (int64 (N,)), a whole field whose row ``rows[i]`` is sample i.

    Each output row of the last axis is one contiguous run of the padded source, so the
    crop is a single ``index_select`` of rows from an overlapping "every start offset" view
    of the source (a memcpy per row), instead of a per-pixel gather with an int64 index per
    output element (5-7x slower on the CPU). Mirrored samples read from mirrored copies of
    their padded source at the mirrored column: ``flip(crop(p, o)) == crop(flip(p), W - w - o)``.
    Mirroring along another axis only reverses the order in which that axis's rows are
    read: their start offsets change, the pass is the same. The output is bit-identical
    to ``F.pad``, slicing and ``torch.flip``. With ``rows``, an unpadded, unmirrored cut reads
    the windows from ``x`` in place (no gather of whole samples); otherwise the rows are
    gathered first. Padded integer images on the CPU take ``_masked_cut`` (no padded copy).
    """
    if _masks_the_margin(x, padding, mirror_rows):
        return _masked_cut(x, rows, offset, tuple(size), sd, flip, tuple(padding), fill)  # type: ignore[arg-type]
    if rows is not None:
        if flip is None and not (padding is not None and any(padding)) and x.is_contiguous():
            return _cut(x, offset, tuple(size), sd, rows, mirror_rows)
        x = torch.index_select(x, 0, rows)
    n = x.shape[0]
    spatial = tuple(x.shape[x.ndim - sd:])
    mid = x.shape[1:x.ndim - sd]
    m = math.prod(mid)
    pad = tuple(padding) if padding is not None else (0,) * sd
    padded = tuple(s + 2 * p for s, p in zip(spatial, pad, strict=True))
    size = tuple(size)
    dev = x.device
    if n == 0:
        return x.new_empty((0, *mid, *size))
    src_n, fidx = n, None
    if flip is not None:
        if host_shortcuts(dev):
            # Only the mirrored samples get a mirrored copy.
            fidx = flip.nonzero().view(-1)
            src_n = n + fidx.numel()
        else:
            src_n = 2 * n  # no nonzero: it would make the host wait for the device
    plain = x.reshape(n, m, *spatial)
    inner = (slice(None), slice(None), *(slice(p, p + s) for p, s in zip(pad, spatial, strict=True)))
    if src_n == n and not any(pad) and plain.is_contiguous():
        src = plain  # nothing to pad or mirror: read the input in place
    else:
        src = scratch(src_n * m * math.prod(padded), x.dtype, dev).view(src_n, m, *padded)
        if any(pad):
            if sd == 2:
                _fill_border(src, pad[0], pad[1], spatial[0], spatial[1], fill)
            else:
                src.fill_(fill)
        src[:n][inner].copy_(plain)
        if src_n > n:
            mirrored = plain if fidx is None else plain.index_select(0, fidx)
            src[n:][inner].copy_(mirrored.flip(-1))
    sample = torch.arange(n, device=dev)
    last = offset[:, -1]
    if flip is not None:
        if fidx is None:
            sample = sample + flip.long() * n
        else:
            sample[fidx] = torch.arange(n, n + fidx.numel(), device=dev)
        last = torch.where(flip, (padded[-1] - size[-1]) - last, last)
    out = _cut(src, torch.cat([offset[:, :-1], last.view(n, 1)], 1), size, sd, sample, mirror_rows)
    return out.view(n, *mid, *size)


#: Integer dtypes the masked cut multiplies in place (``mul_`` is vectorised for them on the
#: CPU; uint16/uint32 lack it, and a float's stray NaN or inf read past a sample's edge would
#: survive a multiplication by 0).
_MASKED_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

#: A 2-D geometry's margins are one table of every pair of offsets up to this size (a lookup
#: per batch); larger ones, and volumes, multiply one table per axis.
_PAIR_TABLE_BYTES = 1 << 22


def _masks_the_margin(x: torch.Tensor, padding: Sequence[int] | None, mirror_rows: torch.Tensor | None) -> bool:
    """Whether ``window_crop`` cuts padded windows with the masked cut: on the CPU, integer
    images, no mirrored rows, no autograd (the gather writes into a work buffer)."""
    return (padding is not None and any(padding) and mirror_rows is None and x.dtype in _MASKED_DTYPES
            and host_shortcuts(x.device) and not x.requires_grad)


def _axis_keep(choices: int, size: int, pad: int, extent: int, dtype: torch.dtype) -> torch.Tensor:
    """Per window offset along one axis (``choices`` of them, in padded coordinates), 1 where
    the window's element lies inside the ``extent`` of the input and 0 in the padding:
    (choices, size) of ``dtype``."""
    pos = torch.arange(choices).view(-1, 1) - pad + torch.arange(size).view(1, -1)
    return ((pos >= 0) & (pos < extent)).to(dtype)


class _CutGeometry:
    """What the masked cut of one (sample shape, window, padding, dtype) needs, made once:
    numbers, the window view's shape and strides, and the margin tables (see ``margins``)."""

    __slots__ = ("mid", "numel", "strides", "margin", "extent", "view_size", "view_strides", "tables", "pair")

    def __init__(self, sample_shape: tuple[int, ...], size: tuple[int, ...], pad: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        sd = len(size)
        spatial = sample_shape[len(sample_shape) - sd:]
        self.mid = sample_shape[:len(sample_shape) - sd]
        plane = math.prod(spatial)
        self.numel = math.prod(self.mid) * plane
        self.strides = np.array([math.prod(spatial[d + 1:]) for d in range(sd)], dtype=np.int64)
        self.margin = int(np.dot(np.array(pad, dtype=np.int64), self.strides))
        # Elements from a window's first to its last, over the folded channels and every axis.
        self.extent = (self.numel - plane) + int(np.dot(np.array(size, dtype=np.int64) - 1, self.strides)) + 1
        self.view_size, self.view_strides = (math.prod(self.mid), *size), (plane, *self.strides.tolist())
        choices = [s + 2 * p - w + 1 for s, p, w in zip(spatial, pad, size, strict=True)]
        axes = [_axis_keep(c, w, p, s, dtype) for c, w, p, s in zip(choices, size, pad, spatial, strict=True)]
        # 2-D: one table of every pair of offsets (one lookup per batch) while small; larger
        # ones and volumes multiply one table per axis per batch.
        pair_bytes = math.prod(choices) * math.prod(size) * axes[0].element_size()
        self.pair = choices[1] if sd == 2 and pair_bytes <= _PAIR_TABLE_BYTES else 0
        if self.pair:
            both = axes[0].view(-1, 1, size[0], 1) * axes[1].view(1, -1, 1, size[1])
            self.tables = [both.view(-1, math.prod(size))]
        else:
            self.tables = axes

    def margins(self, corner: np.ndarray) -> torch.Tensor:
        """Per sample, (N, 1, *size): 1 where its window at ``corner`` (int64 (N, sd), padded
        coordinates) lies inside the input, 0 in the padding."""
        n, sd = corner.shape[0], len(self.view_size) - 1
        if self.pair:
            pick = torch.from_numpy(corner[:, 0] * self.pair + corner[:, 1])
            return self.tables[0].index_select(0, pick).view(n, 1, *self.view_size[1:])
        keep = None
        for d, table in enumerate(self.tables):
            shape = [n, 1] + [1] * sd
            shape[2 + d] = self.view_size[1 + d]
            k = table.index_select(0, torch.from_numpy(np.ascontiguousarray(corner[:, d]))).view(shape)
            keep = k if keep is None else keep * k
        return keep  # type: ignore[return-value]


def _cut_geometry(sample_shape: tuple[int, ...], size: tuple[int, ...], pad: tuple[int, ...],
              dtype: torch.dtype) -> _CutGeometry:
    key = (sample_shape, size, pad, dtype)
    geo = _GEOMETRIES.get(key)
    if geo is None:
        geo = _CutGeometry(sample_shape, size, pad, dtype)
        held = sum(t.nbytes for g in _GEOMETRIES.values() for t in g.tables)
        if len(_GEOMETRIES) >= 64 or held + sum(t.nbytes for t in geo.tables) > _GEOMETRY_BYTES:
            _GEOMETRIES.clear()  # many input sizes (e.g. a ragged list's): bounded
        _GEOMETRIES[key] = geo
    return geo


#: Masked-cut geometries (CPU only), per (sample shape, window, padding, dtype); their
#: tables are emptied past this many bytes in all.
_GEOMETRIES: dict[tuple, _CutGeometry] = {}
_GEOMETRY_BYTES = 1 << 26


def _masked_cut(x: torch.Tensor, rows: torch.Tensor | None, offset: torch.Tensor, size: tuple[int, ...], sd: int,
                flip: torch.Tensor | None, pad: tuple[int, ...], fill: float) -> torch.Tensor:
    """``window_crop`` of padded windows, without a padded copy of the batch (on the CPU).

    The samples (gathered at ``rows``, or ``x``) and mirrored copies of the flipped ones lie
    side by side in a work buffer with a margin at both ends; each window is cut from the
    unpadded sample as if the padding were there (one ``index_select`` of whole windows from
    an overlapping "every start offset" view: a window may start before its sample, in the
    neighbour or the margin), then multiplied by 0 where it lies in the padding (and ``fill``
    added there). Four passes over the batch instead of seven, the geometry made once and the
    index arithmetic in numpy (microseconds where torch ops on 256 numbers cost tens).
    Bit-identical to ``F.pad``, slicing and ``torch.flip``.
    """
    n = rows.numel() if rows is not None else x.shape[0]
    sample_shape = tuple(x.shape[1:])
    geo = _cut_geometry(sample_shape, size, pad, x.dtype)
    if n == 0:
        return x.new_empty((0, *geo.mid, *size))
    numel, margin = geo.numel, geo.margin
    corner = offset.numpy().astype(np.int64)  # a copy: the mirrored columns are rewritten below
    sample = np.arange(n, dtype=np.int64)
    flips = np.flatnonzero(flip.numpy()) if flip is not None else sample[:0]
    k = flips.size
    buf = scratch(2 * margin + (n + k) * numel, x.dtype, x.device)
    body = buf[margin:margin + n * numel].view(n, *sample_shape)
    if rows is not None:
        torch.index_select(x, 0, rows, out=body)
    else:
        body.copy_(x)
    if k:
        buf[margin + n * numel:margin + (n + k) * numel].view(k, *sample_shape).copy_(
            body.index_select(0, torch.from_numpy(flips)).flip(-1))
        sample[flips] = np.arange(n, n + k)
        # flip(crop(p, o)) == crop(flip(p), W - w - o), p padded alike on both sides
        corner[flips, -1] = (x.shape[-1] + 2 * pad[-1] - size[-1]) - corner[flips, -1]
    # The window's first element, from the buffer's start: margin + the sample's start +
    # (corner - pad) . strides; the margin and the pad cancel.
    start = torch.from_numpy(sample * numel + corner @ geo.strides)
    windows = buf.as_strided((buf.numel() - geo.extent + 1, *geo.view_size), (1, *geo.view_strides))
    out = windows.index_select(0, start)
    keep = geo.margins(corner)
    out.mul_(keep)
    if fill:
        out.add_((1 - keep) * int(fill))  # fill is a whole number in the dtype's range (_check_fill)
    return out.view(n, *geo.mid, *size)


def _cut(src: torch.Tensor, offset: torch.Tensor, size: tuple[int, ...], sd: int, sample: torch.Tensor,
         mirror_rows: torch.Tensor | None) -> torch.Tensor:
    """The windows at ``offset`` (N, sd) of rows ``sample`` (N,) of the contiguous ``src``
    ``(rows, ..., *spatial)``: one ``index_select`` of contiguous runs (see ``window_crop``)."""
    n, dev = sample.numel(), src.device
    spatial = tuple(src.shape[src.ndim - sd:])
    mid = src.shape[1:src.ndim - sd]
    m = math.prod(mid)
    # Start of every output row: the sample's window corner plus a fixed grid over the folded
    # lead/channel dim and every spatial dim but the last.
    strides = [math.prod(spatial[d + 1:]) for d in range(sd)]
    plane = math.prod(spatial)
    corner = sample * (m * plane) + offset[:, -1]
    for d in range(sd - 1):
        corner = corner + offset[:, d] * strides[d]
    starts = corner.view(n, 1) + _row_grid(m, plane, size[:-1], strides[:-1], dev).view(1, -1)
    if mirror_rows is not None:
        starts = starts + _mirror_shift(mirror_rows, m, size, strides)
    flat = src.reshape(-1)
    runs = flat.as_strided((flat.numel() - size[-1] + 1, size[-1]), (1, 1))
    out = torch.index_select(runs, 0, starts.reshape(-1))
    return out.view(n, *mid, *size)


def _mirror_shift(mirror: torch.Tensor, m: int, size: tuple[int, ...], strides: list[int]) -> torch.Tensor:
    """Per sample, what mirroring along the axes before the last adds to each row's start:
    (N, m * prod(size[:-1])) int64. Row i of a mirrored axis d reads row size[d] - 1 - i,
    a shift of (size[d] - 1 - 2 i) * strides[d]."""
    n, k = mirror.shape[0], len(size) - 1
    total = torch.zeros((n, 1, *[1] * k), dtype=torch.int64, device=mirror.device)
    for d in range(k):
        step = (size[d] - 1 - 2 * torch.arange(size[d], device=mirror.device)) * strides[d]
        shape = [n, 1, *[1] * k]
        shape[d + 2] = size[d]
        total = total + (mirror[:, d].long().view(n, 1) * step.view(1, -1)).view(shape)
    return total.expand(n, m, *size[:-1]).reshape(n, -1)


#: On the CPU, windows of at least this many spatial elements are cut sample by sample,
#: a slab at a time (:func:`cut_windows`), when they run into a chain of intensity steps
#: (``Compose``), or, for volumes, when they are mirrored (``flip_window``); smaller ones
#: as one batch of rows. Measured on 2 cores: the loop over the samples costs more than it
#: saves on smaller windows (crop + flip + chain on 2-D crops of 32^2 to 128^2: 1.6-12x
#: slower), and less on larger ones (32^3 to 128^3 volume windows: 10-58% faster; a 2-D
#: 192^2 crop + chain 2.4x faster). A 2-D mirrored cut alone keeps the batched form
#: (per sample it was 1.2-2x slower on 192^2 and 224^2 crops).
WINDOWS_FROM_ELEMENTS = 1 << 15


def cut_windows(x: torch.Tensor, offset: torch.Tensor, size: Sequence[int], mirror: torch.Tensor | None = None,
                rows: torch.Tensor | None = None, dtype: torch.dtype | None = None, slab: int = 1 << 19,
                write: Callable[[torch.Tensor, torch.Tensor, int], Any] | None = None) -> torch.Tensor:
    """Each sample's window of ``x`` at ``offset`` (N, sd), of ``size``, mirrored along the
    spatial axes where ``mirror`` (bool (N, sd), or None) is set: a new (N, ..., *size)
    tensor of ``dtype`` (default ``x``'s), bit-identical to slicing and ``torch.flip``.

    ``x`` is (N, ..., *spatial), or, with ``rows`` (int64 (N,)), a whole field whose row
    ``rows[i]`` is sample i. Per sample, on the host: the window is a view of ``x``, read
    in slabs of about ``slab`` elements along its first spatial axis; a mirrored slab is
    flipped into a slab-sized copy that stays in cache. ``write(part, dst, i)`` puts
    sample i's slab ``part`` into ``dst``, its place in the output (default: a copy); a
    chain of elementwise steps can run there while the slab is in cache.
    """
    size = tuple(size)
    sd, n = len(size), offset.shape[0]
    lead = tuple(x.shape[1:x.ndim - sd])
    out = torch.empty((n, *lead, *size), dtype=dtype or x.dtype, device=x.device)
    axis = len(lead)  # the first spatial axis, in a sample
    step = max(1, slab // max(1, math.prod(lead) * math.prod(size[1:])))
    corners = offset.tolist()
    flips = mirror.tolist() if mirror is not None else [[False] * sd] * n
    src_rows = rows.tolist() if rows is not None else range(n)
    # Views made with as_strided from their storage offsets: a slab is two calls instead of
    # the half dozen of indexing and narrowing (about 0.02 ms less per sample and field).
    xs, os_ = x.stride(), out.stride()
    spatial_strides = xs[x.ndim - sd:]
    along = spatial_strides[0]
    for i in range(n):
        corner = x.storage_offset() + src_rows[i] * xs[0] + sum(
            c * st for c, st in zip(corners[i], spatial_strides, strict=True))
        dims = [axis + d for d in range(sd) if flips[i][d]]
        for a in range(0, size[0], step):
            b = min(size[0], a + step)
            shape = (*lead, b - a, *size[1:])
            # Mirrored along the first axis, output slab [a, b) is window slab [size - b, size - a).
            part = x.as_strided(shape, xs[1:], corner + (size[0] - b if flips[i][0] else a) * along)
            if dims:
                part = part.flip(dims)
            dst = out.as_strided(shape, os_[1:], out.storage_offset() + i * os_[0] + a * os_[1 + axis])
            if write is None:
                dst.copy_(part)
            else:
                write(part, dst, i)
    return out


#: What makes a crop's image fields in place of the plain cut: ``image_cut(x, rows, offset,
#: size, mirror)`` with ``x`` and ``rows`` as ``window_crop`` takes them, the windows'
#: corners ``offset`` (N, sd), their ``size`` and ``mirror`` (bool (N, sd): the spatial axes
#: each sample is mirrored along, or None). ``Compose`` runs a chain of intensity steps
#: straight from the windows this way (``augment_intensity.pointwise_windows``).
ImageCut = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, tuple[int, ...], "torch.Tensor | None"],
                    torch.Tensor]


def _flip_columns(flip: torch.Tensor | None) -> torch.Tensor | None:
    """A flip's coins as (N, axes): a (N,) flag of one axis becomes one column."""
    return flip.view(-1, 1) if flip is not None and flip.ndim == 1 else flip


def mirror_axes(flip: torch.Tensor, dims: Sequence[int], sd: int) -> torch.Tensor:
    """bool (N, sd): per sample, whether it is mirrored along each spatial axis, from ``flip``
    (bool (N, len(dims))) over the negative spatial axes ``dims``."""
    dims = tuple(dims)
    cols = [flip[:, dims.index(d - sd)] if d - sd in dims else torch.zeros_like(flip[:, 0]) for d in range(sd)]
    return torch.stack(cols, 1)


def _cut_images(image_cut: ImageCut | None, offset: torch.Tensor, size: tuple[int, ...], sd: int,
                flip: torch.Tensor | None, dims: Sequence[int]) -> Callable | None:
    """A ``map_rows`` function for image fields through ``image_cut``; None without one."""
    if image_cut is None:
        return None
    mirror = None if flip is None else mirror_axes(flip, dims, sd)
    return lambda x, rows: keep_format(image_cut(x, rows, offset, size, mirror), x)


def _padding_arg(value: int | Sequence[int]) -> tuple[int, ...]:
    """``RandomCrop``'s padding as given: 1, 2 or 4 ints (images, as torchvision) or 3
    (volumes), each >= 0; what they mean depends on the batch (``_padding_sides``)."""
    out = int_seq(value, "padding", "an int or a sequence of ints")
    if len(out) not in (1, 2, 3, 4):
        raise ValueError(f"RandomCrop padding must be an int, (left/right, top/bottom) or (left, top, right, "
                         f"bottom) for images, or (d, h, w) for volumes; got {value!r}")
    if min(out) < 0:
        raise ValueError(f"RandomCrop padding must be >= 0, got {value!r}")
    return out


def _padding_sides(padding: tuple[int, ...], sd: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per spatial dim, the padding before and after: torchvision's reading for images (a
    pair is (left/right, top/bottom), four are (left, top, right, bottom)), one value per
    dim (d, h, w) for volumes."""
    if len(padding) == 1:
        return padding * sd, padding * sd
    if sd == 2 and len(padding) == 2:
        lr, tb = padding
        return (tb, lr), (tb, lr)
    if sd == 2 and len(padding) == 4:
        left, top, right, bottom = padding
        return (top, left), (bottom, right)
    if sd == 3 and len(padding) == 3:
        return padding, padding
    if sd == 2:
        raise ValueError(f"RandomCrop padding={padding} has {len(padding)} values but the batch has 2 spatial dims; "
                         "give an int, (left/right, top/bottom) or (left, top, right, bottom), as torchvision"
                         + volume_hint(len(padding), sd))
    raise ValueError(f"RandomCrop padding={padding} has {len(padding)} values but the batch has {sd} spatial dims; "
                     "give an int or (d, h, w), each padded on both sides of its axis")


def _refuse_offsets_outside(op: str, offset: torch.Tensor, size: Sequence[int], inputs: Sequence[Sequence[int]],
                           what: str) -> None:
    """Refuse window corners ``offset`` (N, sd) given to ``op.apply`` that put a ``size``
    window past sample i's input of spatial size ``inputs[i]`` (on the CPU): the cut reads
    runs of the flat batch and would silently take the next row's or sample's pixels."""
    highs = torch.tensor([[p - s for p, s in zip(full, size, strict=True)] for full in inputs], dtype=torch.int64)
    if offset.shape != highs.shape:
        raise ValueError(f"{op}.apply: offset has shape {tuple(offset.shape)}, expected {tuple(highs.shape)} "
                         "(one corner per sample and spatial dim)")
    bad = ((offset < 0) | (offset > highs)).any(1).nonzero().view(-1)
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"{op}.apply: sample {i}'s offset {offset[i].tolist()} puts its {list(size)} window past "
                         f"{what} (offsets 0 to {highs[i].tolist()}); draw the parameters for this batch: "
                         "op.draw(x, keys)")


class RandomCrop(BatchTransform):
    """Crop each sample at its own random position, after optional constant padding.

    Works on images (N, C, H, W) and volumes (N, C, D, H, W). The same window is cut from
    every image and mask field; masks are padded with 0, images with ``fill``; ``other``
    fields pass through. With ``pad_if_needed`` a sample smaller than ``size`` (after
    ``padding``) along an axis is padded on both sides by the difference first, as
    torchvision's ``RandomCrop(pad_if_needed=True)`` does; a list of samples of varying
    sizes (a ragged batch) then becomes one batch tensor, each sample padded as it needs.

    ``padding`` reads as torchvision's for images: an int pads every side, a pair is
    (left/right, top/bottom), i.e. (w, h), and four values are (left, top, right, bottom);
    so ``padding=(4, 0)`` pads columns only, as ``T.RandomCrop(size, padding=(4, 0))``
    does. ``size`` stays (h, w), as torchvision's. For volumes an int pads every side and
    three values are (d, h, w), each on both sides of its axis.

    Args:
        size: Output size: an int for every spatial dim, (h, w) or (d, h, w).
        padding: Images: int, (left/right, top/bottom) or (left, top, right, bottom);
            volumes: int or (d, h, w).
        fill: Constant for the images' padding.
        pad_if_needed: Pad samples smaller than ``size`` instead of refusing them.
    """

    lists = True

    def __init__(self, size: int | Sequence[int], padding: int | Sequence[int] = 0, fill: float = 0,
                 pad_if_needed: bool = False) -> None:
        self.size = spatial_arg(size, "size", lowest=1)
        self.padding = _padding_arg(padding)
        # Finite (nan padded float images with NaN without a word); a numpy scalar or 0-d
        # tensor too, stored as a plain number.
        self.fill = plain_number(fill, "fill")
        self.pad_if_needed = flag(pad_if_needed, "pad_if_needed")

    def _pads(self, sd: int, spatial: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...],
                                                              tuple[int, ...]]:
        """(size, padding before, padding after, padded size) per dim for one input size."""
        size = per_dim(self.size, sd, "size", "RandomCrop")
        lo, hi = _padding_sides(self.padding, sd)
        if self.pad_if_needed:
            # torchvision adds the shortfall on BOTH sides (the crop then starts anywhere in it).
            need = [max(0, c - (s + a + b)) for c, s, a, b in zip(size, spatial, lo, hi, strict=True)]
            lo = tuple(a + e for a, e in zip(lo, need, strict=True))
            hi = tuple(b + e for b, e in zip(hi, need, strict=True))
        padded = tuple(s + a + b for s, a, b in zip(spatial, lo, hi, strict=True))
        return size, lo, hi, padded

    def _geometry(self, batch: Batch) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        size, lo, hi, padded = self._pads(batch.spatial_dims, batch.spatial_size)
        if any(c > s for c, s in zip(size, padded, strict=True)):
            raise ValueError(f"RandomCrop size {size} is larger than the padded input {padded}; "
                             "lower size, add padding or set pad_if_needed=True")
        return size, lo, hi, padded

    def window_size(self, batch: Batch) -> tuple[int, ...]:
        """The window's size, one entry per spatial dim of ``batch`` (a batch tensor)."""
        return self._geometry(batch)[0]

    def _check_fill(self, batch: Batch) -> None:
        """Refuse a ``fill`` an integer image cannot hold: torch's ``fill_`` turns -1 into 255 on
        uint8 (65535 on uint16) where torchvision's pad refuses it, and a value past the range
        failed inside torch without naming ``fill``."""
        if not any(self.padding) and not self.pad_if_needed:
            return  # nothing is padded: the fill is never written
        refuse_unfit_fill(batch, [self.fill], "RandomCrop", self.fill, truncated=True)  # torch truncates a fraction

    def _list_geometry(self, batch: Batch) -> tuple[tuple[int, ...], list[tuple[int, ...]], list[tuple[int, ...]]]:
        """A ragged batch: the size, and each sample's padding before and padded size."""
        sd = batch.spatial_dims
        pads, padded = [], []
        for i, spatial in enumerate(batch.spatial_size):
            size, lo, _, full = self._pads(sd, spatial)
            if any(c > s for c, s in zip(size, full, strict=True)):
                raise ValueError(f"RandomCrop size {size} is larger than sample {i} padded, {full}; lower size, "
                                 "add padding or set pad_if_needed=True")
            pads.append(lo)  # the sample's corner on its canvas; the canvas's fill covers the far side
            padded.append(full)
        return size, pads, padded

    def make_params(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``offset``: each sample's window corner in its padded input, int64 (N, spatial dims)."""
        if batch.ragged:
            size, _, padded = self._list_geometry(batch)
            # As ``keys.integers`` draws for a batch tensor, with each sample's own range.
            u = batch.keys.uniform(0, batch.spatial_dims, dtype=torch.float64)
            highs = torch.tensor([[p - s + 1 for p, s in zip(full, size, strict=True)] for full in padded],
                                 dtype=torch.float64).to(u.device, non_blocking=True)
            return {"offset": torch.minimum(torch.floor(u * highs), highs - 1).long()}
        size, _, _, padded = self._geometry(batch)
        return {"offset": batch.keys.integers(0, [p - s + 1 for p, s in zip(padded, size, strict=True)])}

    def check_params(self, batch: Batch, params: dict[str, Any]) -> None:
        """Each window inside its padded input: 0 <= offset <= padded - size per axis (CPU)."""
        super().check_params(batch, params)
        offset = params.get("offset")
        if not isinstance(offset, torch.Tensor) or not host_shortcuts(offset.device) or not len(batch):
            return
        if batch.ragged:
            size, _, padded = self._list_geometry(batch)
        else:
            size, _, _, full = self._geometry(batch)
            padded = [full] * len(batch)
        _refuse_offsets_outside("RandomCrop", offset, size, padded, "its padded input")

    def apply_batch(self, batch: Batch, offset: torch.Tensor, flip: torch.Tensor | None = None,
                    flip_dims: Sequence[int] = (-1,), image_cut: ImageCut | None = None) -> Batch:
        """Cut the windows at ``offset``; ``flip`` (bool (N,) or (N, len(flip_dims))) also
        mirrors each sample along ``flip_dims`` in the same pass (``Compose`` fuses a
        following ``RandomFlip`` this way); ``image_cut`` (see :data:`ImageCut`) makes the
        image fields instead, from unpadded windows only."""
        sd = batch.spatial_dims
        self._check_fill(batch)
        if batch.ragged:
            if image_cut is not None:
                raise ValueError("RandomCrop image_cut needs a batch tensor, not a list of samples")
            return self._apply_list(batch, offset, flip)
        size, lo, hi, _ = self._geometry(batch)
        if image_cut is not None and any(lo + hi):
            raise ValueError(f"RandomCrop image_cut reads unpadded windows, but the crop pads by {self.padding}")
        # The cut pads both sides of an axis alike: uneven padding is cut from the input padded
        # by the larger side, the window moved by the difference (the extra margin is never read).
        pad = tuple(max(a, b) for a, b in zip(lo, hi, strict=True))
        if pad != lo:
            offset = offset + const([p - a for p, a in zip(pad, lo, strict=True)], offset.device, offset.dtype)
        flip = _flip_columns(flip)

        def crop(fill: float):
            # The padding is written into the crop's source buffer, not materialised by F.pad.
            if flip is None:
                return lambda x, rows: keep_format(window_crop(x, offset, size, sd, None, pad, fill, rows=rows), x)
            return lambda x, rows: keep_format(
                flip_window(x, offset, size, sd, flip, flip_dims, pad, fill, rows=rows), x)

        return batch.map_rows(image=_cut_images(image_cut, offset, size, sd, flip, flip_dims) or crop(self.fill),
                              mask=crop(0))

    def _apply_list(self, batch: Batch, offset: torch.Tensor, flip: torch.Tensor | None) -> Batch:
        """Each group of samples is placed, padded, on one canvas; the windows are cut from it."""
        size, pads, padded = self._list_geometry(batch)
        sd, n = batch.spatial_dims, len(batch)
        out = {}
        for name in batch.names("image", "mask"):
            xs = batch.fields[name]
            lead_shape(xs, sd, name, batch.keys.index)
            fill = self.fill if batch.kinds[name] == "image" else 0
            parts = []
            for rows in groups(padded):
                src = canvas(xs, rows, sd, fill, place=pads,
                             extent=[max(padded[r][d] for r in rows) for d in range(sd)])
                sub = take({"offset": offset} | ({} if flip is None else {"flip": flip}), rows, n)
                parts.append((rows, window_crop(src, sub["offset"], size, sd, sub.get("flip"))))
            out[name] = scatter(parts, n)
        return batch.replace(out)


class RandomCropByLabel(BatchTransform):
    """Crop windows centred on foreground (label > 0) with probability pos / (pos + neg),
    else on background, as MONAI's ``RandCropByPosNegLabeld`` (``num_samples=1``).

    Per sample, the centre is a voxel drawn uniformly among the label's foreground voxels
    (any channel > 0) or among its background voxels, on the device: the k-th voxel of the
    chosen set, with k drawn per sample, found in two levels (voxels counted per block of
    1024, a running count over the blocks, then one block scanned); no host sync and no
    loop over samples. A sample without foreground (or without background) takes its
    centre from the other set. The window is then shifted to lie inside the input (MONAI's
    centre correction), so the drawn voxel stays inside the window but is not always its
    centre. The same window is cut from every image and mask field; ``other`` passes through.

    A list of samples of varying sizes (a ragged batch, e.g. CT volumes) becomes one batch
    tensor of windows: each sample's centre and window are drawn and cut as in a batch
    tensor of samples of its size (its own keys), so later ops run on one batch.

    Where MONAI differs (``RandCropByPosNegLabeld`` with its defaults): it counts a voxel as
    foreground where the label is non-zero, so negative values (an ignore label of -1) are
    foreground there and background here; and for a label of several channels it drops
    channel 0 first (taken to be a one-hot background), where this op uses every channel.
    Give a one-hot label without its background channel (``label[:, 1:]``), or as class
    indices in one channel, to get MONAI's centres. MONAI also raises on a label with
    neither set (impossible here: every voxel is in one) and warns when it falls back to the
    other set; this op falls back silently (no host sync), as ``foreground`` reports.

    From the ``device`` loader, whose store is whole on the device, the windows are cut from
    the store (no whole sample is copied), and the label's per-block counts are computed
    once per store, at the first batch (one pass over every label), then kept: each batch
    then reads one block of 1024 voxels per sample of its label, not the whole label.

    Args:
        size: Window size: an int for every spatial dim, (h, w) or (d, h, w); at most the
            input's size.
        pos: Weight of foreground centres, >= 0.
        neg: Weight of background centres, >= 0 (pos + neg > 0).
        label: The field whose voxels > 0 are foreground (usually the mask).
    """

    lists = True

    def __init__(self, size: int | Sequence[int], pos: float = 1.0, neg: float = 1.0, label: str = "label") -> None:
        self.size = spatial_arg(size, "size", lowest=1)
        # Finite numbers only: pos=inf made the foreground share inf / inf = nan, and every
        # sample was then cut around the background.
        pos, neg = finite_float(pos, "pos"), finite_float(neg, "neg")
        if pos < 0 or neg < 0 or pos + neg <= 0:
            raise ValueError(f"pos and neg must be >= 0 with pos + neg > 0, got pos={pos!r}, neg={neg!r}")
        self.pos, self.neg = float(pos), float(neg)
        if not isinstance(label, str) or not label:
            raise ValueError(f"label must name the label field, got {label!r}")
        self.label = label
        # Per store label (by identity, checked through a weak reference and its version):
        # the foreground voxels per block of every row. Never pickled (see __getstate__).
        self._counts: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_counts"] = {}  # weak references do not pickle; a copy recounts on first use
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_counts", {})

    def _store_counts(self, whole: torch.Tensor, voxels: int) -> torch.Tensor:
        """(rows, blocks) foreground voxels per block of every row of the store label ``whole``,
        computed once (in slices of about 64 MB) and kept while ``whole`` lives unchanged."""
        hit = self._counts.get(id(whole))
        if hit is not None and hit[0]() is whole and hit[1] == tensor_version(whole):
            return hit[2]
        step = max(1, (64 << 20) // max(1, whole[:1].numel()))
        # int16 (a block holds at most _BLOCK = 1024 voxels): 2 bytes per 1024 voxels kept,
        # e.g. 100 MB for 1,000 CT volumes of 512 x 512 x 200.
        counts = torch.cat([_block_counts(_pad_blocks(_foreground(whole[a:a + step], voxels))).to(torch.int16)
                            for a in range(0, whole.shape[0], step)])
        live = {k: v for k, v in self._counts.items() if v[0]() is not None}
        if len(live) >= 4:  # a few stores at most (train, a re-setup): drop the oldest
            live.pop(next(iter(live)))
        live[id(whole)] = (weakref.ref(whole), tensor_version(whole), counts)
        self._counts = live
        return counts

    def window_size(self, batch: Batch) -> tuple[int, ...]:
        """The window's size, one entry per spatial dim of ``batch``; every sample of a
        ragged batch must hold it."""
        size = per_dim(self.size, batch.spatial_dims, "size", "RandomCropByLabel")
        for spatial in batch.spatial_size if batch.ragged else [batch.spatial_size]:
            if any(c > s for c, s in zip(size, spatial, strict=True)):
                raise ValueError(f"RandomCropByLabel size {size} is larger than the input {spatial}; "
                                 "lower size, or pad first (RandomCrop with padding)")
        return size

    def make_params(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``center`` (the drawn voxel), ``offset`` (the window's corner), both int64
        (N, spatial dims), and ``foreground`` (bool (N,): the centre is a foreground voxel)."""
        if batch.kinds.get(self.label, "other") == "other":
            raise ValueError(f"RandomCropByLabel(label={self.label!r}) needs an image or mask field of that name; "
                             f"the batch has {batch.kinds}")
        size = self.window_size(batch)
        if not len(batch):
            empty = torch.zeros((0, batch.spatial_dims), dtype=torch.int64, device=batch.keys.device)
            return {"center": empty, "offset": empty.clone(),
                    "foreground": torch.zeros(0, dtype=torch.bool, device=batch.keys.device)}
        if batch.ragged:
            # Each sample as a batch of one with its own keys: the draw is per sample, so this
            # is the centre and window it gets in a batch tensor of samples of its size.
            rows = torch.arange(len(batch), device=batch.keys.device)
            each = [self.make_params(batch.sample(i, rows)) for i in range(len(batch))]
            return {k: torch.cat([p[k] for p in each]) for k in each[0]}
        spatial = batch.spatial_size
        voxels, p_fg = math.prod(spatial), self.pos / (self.pos + self.neg)
        u = batch.keys.uniform(0, 2, dtype=torch.float64)
        rows = batch.stored_rows()
        host = host_shortcuts(u.device)
        if rows is None:
            fg = _foreground(batch.fields[self.label], voxels)
            if host:
                flat, use_fg = _draw_host(_block_counts(_pad_blocks(fg)), voxels, u, p_fg,
                                          lambda i, blk: fg[i, blk * _BLOCK:(blk + 1) * _BLOCK].numpy())
            else:
                flat, use_fg = draw_voxels(fg, u, p_fg)
        else:
            # From the store: the kept block counts, and one block of each sample's label.
            whole = batch.whole(self.label)
            counts = self._store_counts(whole, voxels).index_select(0, rows)
            if host:
                flat, use_fg = _draw_host(counts, voxels, u, p_fg, _host_block(whole, rows, voxels))
            else:
                flat, use_fg = _draw(counts.long(), voxels, u, p_fg, lambda blk: _store_block(whole, rows, blk, voxels))
        half = [s // 2 for s in size]
        top = [s - c for s, c in zip(spatial, size, strict=True)]
        if host:
            # The same integer arithmetic in numpy: a few calls instead of a dozen torch dispatches.
            at = np.stack(np.unravel_index(flat.numpy(), spatial), 1).astype(np.int64, copy=False)
            corner = np.minimum(np.maximum(at - np.asarray(half, np.int64), 0), np.asarray(top, np.int64))
            return {"center": torch.from_numpy(at), "offset": torch.from_numpy(corner), "foreground": use_fg}
        center = _unravel(flat, spatial)
        offset = torch.minimum((center - const(half, flat.device, torch.int64)).clamp_(min=0),
                               const(top, flat.device, torch.int64))
        return {"center": center, "offset": offset, "foreground": use_fg}

    def check_params(self, batch: Batch, params: dict[str, Any]) -> None:
        """Each window inside its input: 0 <= offset <= input - size per axis (CPU)."""
        super().check_params(batch, params)
        offset = params.get("offset")
        if not isinstance(offset, torch.Tensor) or not host_shortcuts(offset.device) or not len(batch):
            return
        spatial = batch.spatial_size if batch.ragged else [batch.spatial_size] * len(batch)
        _refuse_offsets_outside("RandomCropByLabel", offset, self.window_size(batch), spatial, "its input")

    def apply_batch(self, batch: Batch, offset: torch.Tensor, flip: torch.Tensor | None = None,
                    flip_dims: Sequence[int] = (-1,), image_cut: ImageCut | None = None,
                    **_: torch.Tensor) -> Batch:
        """Cut the windows at ``offset`` from every image and mask field; ``flip`` (bool (N,)
        or (N, len(flip_dims))) also mirrors each sample along ``flip_dims`` in the same pass
        (``Compose`` fuses a following ``RandomFlip`` this way); ``image_cut`` (see
        :data:`ImageCut`) makes the image fields instead. A ragged batch (lists) becomes one
        batch tensor of windows."""
        if batch.ragged:
            if image_cut is not None:
                raise ValueError("RandomCropByLabel image_cut needs a batch tensor, not a list of samples")
            return self._apply_list(batch, offset, flip, flip_dims)
        size, sd = self.window_size(batch), batch.spatial_dims
        flips = _flip_columns(flip)
        if flips is None:
            crop = lambda x, rows: keep_format(window_crop(x, offset, size, sd, rows=rows), x)  # noqa: E731
        else:
            crop = lambda x, rows: keep_format(  # noqa: E731
                flip_window(x, offset, size, sd, flips, flip_dims, rows=rows), x)
        return batch.map_rows(image=_cut_images(image_cut, offset, size, sd, flips, flip_dims) or crop, mask=crop)

    def _apply_list(self, batch: Batch, offset: torch.Tensor, flip: torch.Tensor | None,
                    flip_dims: Sequence[int]) -> Batch:
        """Each sample's window cut as in a batch of one (the cut a batch tensor gives it,
        from the sample itself: no padded canvas of whole volumes), joined into one tensor."""
        self.window_size(batch)  # the clear error for a sample smaller than the window
        names = batch.names("image", "mask")
        for name in names:
            lead_shape(batch.fields[name], batch.spatial_dims, name, batch.keys.index)
        rows = torch.arange(len(batch), device=batch.keys.device)
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        for i in range(len(batch)):
            one = self.apply_batch(batch.sample(i, rows), offset[i:i + 1],
                                   None if flip is None else flip[i:i + 1], flip_dims)
            for name in names:
                parts[name].append(one.fields[name])
        return batch.replace({name: torch.cat(xs) for name, xs in parts.items()})


#: Windows of at least this many elements per sample are mirrored along the last axis after
#: the cut, in place, sample by sample; smaller ones in the cut, from mirrored copies of their
#: source (``window_crop``'s ``flip``). After the cut costs a pass over the mirrored windows
#: (and a Python call per mirrored sample on the CPU); in the cut, a copy of every sample's
#: whole source: several times more bytes for volumes (a 96^3 window of a 128^3 volume).
MIRROR_AFTER_ELEMENTS = 1 << 16


def mirror_last_(x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """Mirror the samples of ``x`` where ``flag`` (bool (N,)) along the last axis; in place on
    the CPU (``x`` must be a tensor the caller owns), a new tensor on accelerators."""
    if host_shortcuts(x.device):
        for i in flag.nonzero().view(-1).tolist():
            x[i].copy_(x[i].flip(-1))
        return x
    # No host sync (nonzero would wait for the device): every sample mirrored, the flagged kept.
    return torch.where(flag.view(-1, *[1] * (x.ndim - 1)), x.flip(-1), x)


def flip_window(x: torch.Tensor, offset: torch.Tensor, size: Sequence[int], sd: int, flip: torch.Tensor,
                dims: Sequence[int], padding: Sequence[int] | None = None, fill: float = 0,
                rows: torch.Tensor | None = None) -> torch.Tensor:
    """``window_crop`` with each sample mirrored along ``dims`` (negative spatial axes) where
    ``flip`` (bool (N, len(dims))) is set: bit-identical to the crop, then ``torch.flip``;
    ``rows`` as in ``window_crop``.

    Mirroring along an axis before the last only reverses the order the window's rows are
    read in (the same pass); the last axis is mirrored in the cut for small windows and
    after it for large ones (``MIRROR_AFTER_ELEMENTS``).
    """
    dims = tuple(dims)
    if (sd == 3 and host_shortcuts(x.device) and not (padding is not None and any(padding))
            and math.prod(size) >= WINDOWS_FROM_ELEMENTS):
        return cut_windows(x, offset, size, mirror_axes(flip, dims, sd), rows)
    mirror = None
    if any(d != -1 for d in dims):
        mirror = mirror_axes(flip, dims, sd)[:, :-1]  # every spatial axis but the last
    last = flip[:, dims.index(-1)] if -1 in dims else None
    per_sample = math.prod(x.shape[1:x.ndim - sd]) * math.prod(size)
    if last is None or per_sample < MIRROR_AFTER_ELEMENTS:
        return window_crop(x, offset, size, sd, last, padding, fill, mirror, rows=rows)
    out = window_crop(x, offset, size, sd, None, padding, fill, mirror, rows=rows)
    if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        out = out.clone()  # mirrored in place below: never the caller's input
    return mirror_last_(out, last)


#: Voxels per block of the label draw: a multiple of 8, and at most 8 * 255, so that 0/1
#: bytes summed 8 at a time as int64 words never carry from one byte into the next.
_BLOCK = 1024


def _foreground(lab: torch.Tensor, voxels: int) -> torch.Tensor:
    """(N, voxels) bool: where any channel of the label ``(N, ..., *spatial)`` is > 0."""
    flat = lab.reshape(lab.shape[0], -1, voxels)
    if lab.is_floating_point() or lab.is_complex() or lab.dtype.is_signed:
        pos = flat > 0
    else:
        # Unsigned (and bool): > 0 is != 0, and the cast to bool is a vectorised copy on the
        # CPU, about 10x faster than the comparison.
        pos = flat.bool()
    return pos[:, 0] if pos.shape[1] == 1 else pos.any(1)


def _block_counts(fg: torch.Tensor) -> torch.Tensor:
    """(N, nb * _BLOCK) bool -> the True voxels per block, int64 (N, nb).

    The 0/1 bytes are summed 8 at a time as int64 words (each byte lane of a block sums at
    most _BLOCK / 8 ones, so no carry), then the 8 lanes of each block's total are added:
    about 40x faster on the CPU than ``sum`` over bools, which converts every element.
    """
    n = fg.shape[0]
    words = fg.view(torch.uint8).view(n, -1, _BLOCK // 8, 8).view(torch.int64)  # (N, nb, _BLOCK / 8, 1)
    return words.sum((-2, -1)).view(torch.uint8).view(n, -1, 8).sum(-1)


def draw_voxels(fg: torch.Tensor, u: torch.Tensor, p_fg: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample, a voxel drawn uniformly among its foreground (with probability ``p_fg``)
    or its background voxels: ``(flat voxel index (N,), foreground (N,) bool)``.

    ``fg`` is (N, V) bool; ``u`` (N, 2) float64 uniforms: ``u[:, 0] < p_fg`` picks the set
    (a sample without foreground, or without background, takes the other set), and the
    voxel is the k-th of its set, ``k = floor(u[:, 1] * count)``. The k-th is found in two
    levels: the running count of the set's voxels over blocks of ``_BLOCK`` finds the block
    that holds it, a running count inside that block finds the voxel. The result equals a
    running count over every voxel (the plain way, with V-long cumulative sums per sample,
    30-50x slower on the CPU). On the device, no host sync, no loop over samples.
    """
    n, voxels = fg.shape
    fg = _pad_blocks(fg).contiguous()  # viewed as blocks below (a label strided over samples is not)
    nb = fg.shape[1] // _BLOCK
    counts = _block_counts(fg)  # (N, nb) foreground voxels per block
    rows = torch.arange(n, device=fg.device) * nb
    return _draw(counts, voxels, u, p_fg, lambda blk: fg.view(n * nb, _BLOCK).index_select(0, rows + blk))


def _pad_blocks(fg: torch.Tensor) -> torch.Tensor:
    """(N, V) bool padded with False to whole blocks: (N, nb * _BLOCK)."""
    pad = -fg.shape[1] % _BLOCK
    return torch.nn.functional.pad(fg, (0, pad)) if pad else fg  # padding counts as neither set (see _draw)


def _store_block(whole: torch.Tensor, rows: torch.Tensor, blk: torch.Tensor, voxels: int) -> torch.Tensor:
    """(N, _BLOCK) bool: block ``blk[i]`` of the foreground of row ``rows[i]`` of the store label
    ``whole`` (voxels past the last are False, as ``_pad_blocks`` pads)."""
    n = rows.numel()
    flat = whole.reshape(whole.shape[0], -1, voxels)
    vox = blk.view(n, 1) * _BLOCK + torch.arange(_BLOCK, device=blk.device).view(1, _BLOCK)
    channels = torch.arange(flat.shape[1], device=blk.device).view(1, -1, 1)
    vals = flat[rows.view(n, 1, 1), channels, vox.clamp(max=voxels - 1).view(n, 1, _BLOCK)]
    return _foreground(vals, _BLOCK) & (vox < voxels)


def _draw(counts: torch.Tensor, voxels: int, u: torch.Tensor, p_fg: float,
          block: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``draw_voxels`` from the per-block foreground counts (N, nb) of ``voxels`` voxels per
    sample; ``block(blk)`` gives block ``blk[i]`` of sample i's foreground, (N, _BLOCK) bool."""
    n, nb = counts.shape
    pad = nb * _BLOCK - voxels
    count_fg = counts.sum(1)
    count_bg = voxels - count_fg
    want_fg = u[:, 0] < p_fg
    use_fg = torch.where(count_fg == 0, False, torch.where(count_bg == 0, True, want_fg))
    count = torch.where(use_fg, count_fg, count_bg)
    k = torch.minimum(torch.floor(u[:, 1] * count.to(torch.float64)).long(), count - 1)
    background = _BLOCK - counts
    if pad:
        background[:, -1] -= pad  # the padding is not background
    per_block = torch.where(use_fg.view(n, 1), counts, background)
    running = torch.cumsum(per_block, 1)
    # The block holding the k-th voxel (0-based): the first whose running count exceeds k.
    blk = torch.searchsorted(running, (k + 1).view(n, 1))
    before = (running.gather(1, blk) - per_block.gather(1, blk)).view(n)
    blk = blk.view(n)
    chosen = block(blk) == use_fg.view(n, 1)
    # Within the block, the (k - before)-th chosen voxel. A background draw in the last block
    # never reaches its padding: the padding sits after the block's real voxels, and
    # k - before is below their count.
    inside = torch.cumsum(chosen, 1, dtype=torch.int32)
    pos = torch.searchsorted(inside, (k - before + 1).to(torch.int32).view(n, 1)).view(n)
    return blk * _BLOCK + pos, use_fg


def _draw_host(counts: torch.Tensor, voxels: int, u: torch.Tensor, p_fg: float,
               block: Callable[[int, int], Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``_draw`` on the CPU, in numpy, sample by sample: the same integer and float64
    arithmetic, so the same voxels; a few numpy calls per sample cost less than the two dozen
    torch dispatches of the batched form (measured: about 4x less for a batch of 4 volumes).
    ``block(i, blk)`` gives block ``blk`` of sample i's foreground, bool (at most ``_BLOCK``,
    the voxels past the last one left out)."""
    c = counts.numpy().astype(np.int64)
    uu = u.numpy()
    n, nb = c.shape
    pad = nb * _BLOCK - voxels
    count_fg = c.sum(1)
    count_bg = voxels - count_fg
    use_fg = np.where(count_fg == 0, False, np.where(count_bg == 0, True, uu[:, 0] < p_fg))
    count = np.where(use_fg, count_fg, count_bg)
    k = np.minimum(np.floor(uu[:, 1] * count.astype(np.float64)).astype(np.int64), count - 1)
    background = _BLOCK - c
    background[:, -1] -= pad  # the padding is not background
    per_block = np.where(use_fg[:, None], c, background)
    running = np.cumsum(per_block, 1)
    flat = np.empty(n, np.int64)
    for i in range(n):
        blk = int(np.searchsorted(running[i], k[i] + 1))  # the first block whose running count exceeds k
        before = int(running[i, blk] - per_block[i, blk])
        inside = np.cumsum(block(i, blk) == use_fg[i])
        flat[i] = blk * _BLOCK + int(np.searchsorted(inside, k[i] - before + 1))
    return torch.from_numpy(flat), torch.from_numpy(use_fg)


def _host_block(whole: torch.Tensor, rows: torch.Tensor, voxels: int) -> Callable[[int, int], Any]:
    """``block(i, blk)`` for ``_draw_host``: block ``blk`` of the foreground of row ``rows[i]``
    of the store label ``whole``, read on the host."""
    flat = whole.reshape(whole.shape[0], -1, voxels)
    at = rows.tolist()
    if whole.dtype in _NUMPY_LABELS:
        # A numpy view: a block is then three numpy calls instead of five torch dispatches.
        lab = flat.numpy()
        signed = whole.is_floating_point() or whole.dtype.is_signed

        def block_np(i: int, blk: int) -> Any:
            vals = lab[at[i], :, blk * _BLOCK:(blk + 1) * _BLOCK]
            return ((vals > 0) if signed else (vals != 0)).any(0)

        return block_np

    def block(i: int, blk: int) -> Any:
        vals = flat[at[i]:at[i] + 1, :, blk * _BLOCK:(blk + 1) * _BLOCK]
        return _foreground(vals, vals.shape[-1])[0].numpy()

    return block


#: Label dtypes read through numpy on the host (``_host_block``); others (bfloat16, complex)
#: through torch.
_NUMPY_LABELS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
                 torch.uint32, torch.float16, torch.float32, torch.float64)


def _unravel(flat: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Flat indices (N,) into coordinates (N, len(shape)) of a C-ordered ``shape``."""
    coords = []
    rest = flat
    for s in reversed(shape):
        coords.append(torch.remainder(rest, s))
        rest = torch.div(rest, s, rounding_mode="floor")
    return torch.stack(coords[::-1], dim=1)


__all__ = ["WINDOWS_FROM_ELEMENTS", "ImageCut", "RandomCrop", "RandomCropByLabel", "cut_windows", "draw_voxels",
           "flip_window", "mirror_axes", "mirror_last_", "window_crop"]
