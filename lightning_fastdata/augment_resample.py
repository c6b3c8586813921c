"""Interpolating geometric ops: resized crops (2-D) and affine maps (2-D and 3-D).

Each op mirrors a torchvision v2 transform: ``make_params`` draws N parameter sets with
the distribution torchvision's ``make_params`` uses for one sample, and the apply runs
the torchvision functional op with those parameters on every sample at once. Images are
resampled (bilinear or nearest), masks always nearest-neighbour with the same
parameters; ``other`` fields pass through.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from lightning_fastdata._pool import default_threads, map_runs
from lightning_fastdata.augment_base import (
    Batch,
    BatchTransform,
    _float,
    chunk_rows,
    chunked,
    compute_dtype,
    const,
    fill_values,
    flag,
    float_range,
    float_seq,
    host_shortcuts,
    int_seq,
    keep_format,
    refuse_bool_images,
    refuse_unfit_fill,
    spatial_arg,
    to_input_dtype,
    volume_hint,
)
from lightning_fastdata.augment_crop import mirror_last_
from lightning_fastdata.augment_lists import canvas, groups, lead_shape, scatter, take


def _resample_taps(start: torch.Tensor, length: torch.Tensor, in_size: int, out_size: int, antialias: bool,
                   dtype: torch.dtype, target: torch.Tensor | None = None, first: torch.Tensor | None = None,
                   widest: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample bilinear resampling of the window [start, start+length) to ``out_size`` pixels.

    Returns ``(index, weight)``, each (N, out_size, K): output pixel i of sample n is
    ``sum_k weight[n, i, k] * input[index[n, i, k]]``. The weights are those of torch's
    ``_upsample_bilinear2d_aa`` (PIL's algorithm, behind torchvision's antialiased
    ``resize``) for an input of ``length`` pixels; without antialias the triangle is not
    widened, which is plain bilinear interpolation. K is a bound known on the host (no
    device sync); taps past a pixel's window get weight 0.

    ``target`` (N,) resizes each window to ``target[n]`` pixels (default ``out_size``) of
    which the ``out_size`` starting at ``first[n]`` (default 0) are computed: a crop of the
    resized window, pixel for pixel what resizing then cropping gives. Pixels past a
    sample's ``target`` get weight 0. ``widest`` bounds ``length / target`` (default
    ``in_size / out_size``).
    """
    dev = start.device
    if widest is None:
        widest = in_size / out_size
    widest = max(widest, 1.0) if antialias else 1.0
    k = math.ceil(2 * widest) + 1
    length = length.to(dtype).view(-1, 1)
    scale = length / (out_size if target is None else target.to(dtype).view(-1, 1))
    widen = (scale >= 1.0) if antialias else torch.zeros_like(scale, dtype=torch.bool)
    support = torch.where(widen, scale, torch.ones_like(scale))
    invscale = torch.where(widen, 1.0 / scale, torch.ones_like(scale))
    out_pos = torch.arange(out_size, device=dev, dtype=dtype).view(1, -1)
    if first is not None:
        out_pos = out_pos + first.to(dtype).view(-1, 1)
    center = scale * (out_pos + 0.5)
    xmin = torch.trunc(center - support + 0.5).clamp_(min=0)
    xmax = torch.minimum(torch.trunc(center + support + 0.5), length)
    pos = xmin.unsqueeze(-1) + torch.arange(k, device=dev, dtype=dtype)  # (N, out, K), local
    wts = (1.0 - ((pos - center.unsqueeze(-1) + 0.5) * invscale.unsqueeze(-1)).abs()).clamp_(min=0)
    wts = torch.where(pos < xmax.unsqueeze(-1), wts, torch.zeros_like(wts))
    # Only pixels past a sample's target (padding of a ragged batch) can sum to 0. Summed tap
    # by tap, in order: a pixel's taps with weight come first and the rest add exact zeros, so
    # the sum does not depend on K, which a ragged group's widest sample sets (``sum`` over the
    # last dim pairs the terms by K: a sample's pixels moved by 1 with its batch).
    total = wts[..., 0].clone()
    for t in range(1, k):
        total += wts[..., t]
    wts = wts / total.unsqueeze(-1).clamp_(min=1e-30)
    index = (pos + start.to(dtype).view(-1, 1, 1)).clamp_(max=in_size - 1).long()  # zero-weight taps clamp
    return index, wts


def _resample_rows(x: torch.Tensor, index: torch.Tensor, wts: torch.Tensor | None,
                   dtype: torch.dtype | None) -> torch.Tensor:
    """Resample rows (dim 2) of ``x`` (N, M, H, W) with per-sample taps (N, oh, K).

    Each tap copies whole rows with one ``index_select`` (contiguous memory), then adds
    them weighted: K row copies instead of a dense (oh x H) product per sample. Without
    weights (nearest), the one tap's rows are returned in ``x``'s dtype.
    """
    n, m, h, w = x.shape
    oh, k = index.shape[1], index.shape[2]
    rows = x.reshape(n * m * h, w)
    base = (torch.arange(n * m, device=x.device) * h).view(n, m, 1)
    out = None
    for t in range(k):
        sel = (base + index[:, :, t].view(n, 1, oh)).view(-1)
        picked = rows.index_select(0, sel).view(n, m, oh, w)
        if wts is None:
            return picked
        picked = picked.to(dtype)
        weight = wts[:, :, t].view(n, 1, oh, 1)
        out = picked.mul_(weight) if out is None else out.addcmul_(picked, weight)
    return out  # type: ignore[return-value]


def _nearest_taps(start: torch.Tensor, length: torch.Tensor, out_size: int) -> torch.Tensor:
    """torch's ``interpolate(mode="nearest")`` source pixel per output pixel: (N, out_size, 1).

    ``min(floor(i * (length / out_size)), length - 1)`` in float32, as torch computes it.
    """
    scale = length.to(torch.float32).view(-1, 1) / out_size
    i = torch.arange(out_size, device=start.device, dtype=torch.float32).view(1, -1)
    src = torch.minimum(torch.floor(i * scale).long(), length.view(-1, 1) - 1)
    return (src + start.view(-1, 1)).unsqueeze(-1)


def resize_window(x: torch.Tensor, top: torch.Tensor, left: torch.Tensor, height: torch.Tensor,
                  width: torch.Tensor, size: Sequence[int], antialias: bool, target: torch.Tensor | None = None,
                  first: torch.Tensor | None = None, widest: Sequence[float] | None = None) -> torch.Tensor:
    """Each sample's window of ``x`` (N, ..., H, W) resized to ``size`` (oh, ow) as
    ``F.resized_crop`` does (bilinear, antialiased when downscaling if ``antialias``),
    all samples at once. ``target`` (N, 2) resizes window n to ``target[n]`` and keeps the
    ``size`` pixels from ``first[n]`` (N, 2) on: resize then crop; ``widest`` (2 floats)
    bounds ``window / target`` per axis."""
    n, h, w = x.shape[0], x.shape[-2], x.shape[-1]
    oh, ow = size
    dt = compute_dtype(x)

    def col(t: torch.Tensor | None, j: int) -> torch.Tensor | None:
        return None if t is None else t[:, j]

    rows = _resample_taps(top, height, h, oh, antialias, dt, col(target, 0), col(first, 0),
                          None if widest is None else widest[0])
    cols = _resample_taps(left, width, w, ow, antialias, dt, col(target, 1), col(first, 1),
                          None if widest is None else widest[1])
    flat = x.reshape(n, -1, h, w)
    # Rows, then columns through a transpose: both passes copy contiguous rows.
    tmp = _resample_rows(flat, *rows, dt).transpose(2, 3).contiguous()
    out = _resample_rows(tmp, *cols, dt).transpose(2, 3)
    return keep_format(to_input_dtype(out, x).reshape(*x.shape[:-2], oh, ow), x)


def interpolate_image(x: torch.Tensor, size: Sequence[int], antialias: bool) -> torch.Tensor:
    """One image (or a batch of one size) ``(..., C, H, W)`` resized to ``size`` as
    torchvision's ``resize`` does: ``F.interpolate`` (bilinear), uint8 natively on the CPU,
    other integers (and uint8 to 1x1) through float32 with rounding."""
    size = (int(size[0]), int(size[1]))
    if tuple(x.shape[-2:]) == size:
        return x  # torchvision returns the input unchanged too
    flat = x.reshape(-1, *x.shape[-3:])
    # torch's uint8 CPU kernel fails an internal assert for a 1x1 output (3 channels).
    native = x.dtype in (torch.float32, torch.float64) or (
        x.dtype == torch.uint8 and x.device.type == "cpu" and size != (1, 1))
    y = F.interpolate(flat if native else flat.to(torch.float32), size=size, mode="bilinear",
                      align_corners=False, antialias=antialias)
    if not native:
        y = to_input_dtype(y, x)
    return y.reshape(*x.shape[:-2], *size)


def nearest_resize(x: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """``x`` (..., H, W) resized nearest-neighbour as ``interpolate(mode="nearest")`` picks
    pixels (exact for any dtype, as torchvision resizes a ``Mask``)."""
    h, w = x.shape[-2], x.shape[-1]
    zero = torch.zeros(1, dtype=torch.long, device=x.device)
    rows = _nearest_taps(zero, torch.full_like(zero, h), int(size[0])).view(-1)
    cols = _nearest_taps(zero, torch.full_like(zero, w), int(size[1])).view(-1)
    return x.index_select(-2, rows).index_select(-1, cols)


def _ratio_range(ratio: Sequence[float]) -> tuple[float, float]:
    """An aspect-ratio range ``0 < min <= max``."""
    out = float_range(ratio, "ratio", lower=0.0)
    if out[0] <= 0:
        raise ValueError(f"ratio must be > 0, got {ratio!r}")
    return out


def box_attempts(u: torch.Tensor, area: int | torch.Tensor, scale: Sequence[float], ratio: Sequence[float]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """torchvision's 10 box attempts per sample from float64 uniforms ``u`` (n, 10, >=2).

    Returns ``(round(sqrt(target * aspect)), round(sqrt(target / aspect)))`` for a target
    area uniform in ``scale`` x ``area`` and an aspect ratio log-uniform in ``ratio``; which
    of the two is the height is the caller's (torchvision differs between ops).
    """
    target = (float(area) if isinstance(area, int) else area) * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(lo + (hi - lo) * u[..., 1])
    return torch.round(torch.sqrt(target * aspect)), torch.round(torch.sqrt(target / aspect))


def first_valid_box(u: torch.Tensor, ok: torch.Tensor, h: torch.Tensor, w: torch.Tensor, height: int | torch.Tensor,
                    width: int | torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each sample's first valid attempt and its position from ``u[..., 2:4]``: (top, left, h, w, any valid);
    ``height`` and ``width`` are the input's, or each sample's as (N,) tensors."""
    first = torch.argmax(ok.to(torch.uint8), dim=1, keepdim=True)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.gather(1, first).squeeze(1)

    h, w, ui, uj = pick(h), pick(w), pick(u[..., 2]), pick(u[..., 3])
    top = torch.floor(ui * (height - h + 1)).clamp_(max=height - h)
    left = torch.floor(uj * (width - w + 1)).clamp_(max=width - w)
    return top, left, h, w, ok.any(dim=1)


def _require_2d(batch: Batch, op: str) -> None:
    if batch.spatial_dims != 2:
        raise ValueError(f"{op} works on 2-D images (N, C, H, W); the batch has {batch.spatial_dims} spatial dims")


def _sizes(batch: Batch, device: torch.device) -> tuple[int | torch.Tensor, int | torch.Tensor]:
    """(height, width) of a 2-D batch: ints, or per sample float64 (N,) tensors for a ragged one."""
    if not batch.ragged:
        return batch.spatial_size
    hw = torch.tensor(batch.spatial_size, dtype=torch.float64).to(device, non_blocking=True)
    return hw[:, 0], hw[:, 1]


class RandomResizedCrop(BatchTransform):
    """Crop a random area and aspect ratio of each sample and resize it to ``size`` (2-D).

    Parameters follow ``torchvision.transforms.v2.RandomResizedCrop`` (10 attempts, then a
    central crop), drawn from each sample's own size; images are resized as
    ``F.resized_crop`` with bilinear interpolation, masks with nearest-neighbour (as
    torchvision resizes a ``Mask``), with the same box. A list of images of varying sizes
    (a ragged batch) becomes one batch tensor.

    Args:
        size: Output (h, w), or an int for a square.
        scale: Range of the crop's area as a fraction of the input's, 0 < min <= max <= 1.
        ratio: Range of the crop's aspect ratio (w / h), 0 < min <= max.
        antialias: Antialias images when downscaling, as torchvision's default.
    """

    lists = True

    def __init__(self, size: int | Sequence[int], scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3.0 / 4.0, 4.0 / 3.0), antialias: bool = True) -> None:
        size = spatial_arg(size, "size", lowest=1)
        if len(size) == 3:
            raise ValueError(f"RandomResizedCrop size is (h, w) or an int, got {size!r}")
        self.size = size * 2 if len(size) == 1 else size
        self.scale = float_range(scale, "scale", lower=0.0, upper=1.0)
        if self.scale[1] <= 0:
            raise ValueError(f"scale must have max > 0, got {scale!r}")
        self.ratio = _ratio_range(ratio)
        self.antialias = flag(antialias, "antialias")

    def make_params(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-sample crop boxes ``top``, ``left``, ``height``, ``width``: int64 (N,)."""
        _require_2d(batch, "RandomResizedCrop")
        u = batch.keys.uniform(0, 40, dtype=torch.float64).view(-1, 10, 4)
        height, width = _sizes(batch, u.device)
        area = height * width
        w, h = box_attempts(u, area if isinstance(area, int) else area.view(-1, 1), self.scale, self.ratio)
        hh, ww = (height, width) if isinstance(height, int) else (height.view(-1, 1), width.view(-1, 1))
        ok = (w > 0) & (w <= ww) & (h > 0) & (h <= hh)
        top, left, h, w, any_ok = first_valid_box(u, ok, h, w, height, width)
        fh, fw = self._fallback(height, width)
        h = torch.where(any_ok, h, fh)
        w = torch.where(any_ok, w, fw)
        if isinstance(height, int):
            ftop, fleft = (height - int(fh)) // 2, (width - int(fw)) // 2
        else:
            ftop = torch.div(height - fh, 2, rounding_mode="floor")
            fleft = torch.div(width - fw, 2, rounding_mode="floor")
        top = torch.where(any_ok, top, ftop)
        left = torch.where(any_ok, left, fleft)
        return {"top": top.long(), "left": left.long(), "height": h.long(), "width": w.long()}

    def _fallback(self, height: int | torch.Tensor, width: int | torch.Tensor) -> tuple[Any, Any]:
        """torchvision's box after 10 failed attempts: the central crop of clamped ratio (h, w),
        at least one pixel on each side (a 1-pixel-wide image at ratio >= 2 rounds its height to
        0, where torchvision fails and an empty box would resample to zeros)."""
        lo, hi = self.ratio
        if isinstance(height, int):
            in_ratio = width / height
            if in_ratio < lo:
                return float(max(1, round(width / lo))), float(width)
            if in_ratio > hi:
                return float(height), float(max(1, round(height * hi)))
            return float(height), float(width)
        in_ratio = width / height
        fh = torch.where(in_ratio < lo, torch.round(width / lo).clamp(min=1), height)
        fw = torch.where(in_ratio > hi, torch.round(height * hi).clamp(min=1), width)
        return fh, fw

    def check_params(self, batch: Batch, params: dict[str, Any]) -> None:
        """Each box inside its sample (CPU): top, left >= 0, height, width >= 1, and
        top + height <= H, left + width <= W (the CPU and accelerator paths would read
        different pixels past the edge)."""
        super().check_params(batch, params)
        box = [params.get(k) for k in ("top", "left", "height", "width")]
        if not all(isinstance(b, torch.Tensor) for b in box) or not host_shortcuts(box[0].device) or not len(batch):
            return
        sizes = batch.spatial_size if batch.ragged else [batch.spatial_size] * len(batch)
        hw = torch.tensor(sizes, dtype=torch.int64)
        top, left, height, width = (b.reshape(-1).long() for b in box)
        bad = ((top < 0) | (left < 0) | (height < 1) | (width < 1) | (top + height > hw[:, 0])
               | (left + width > hw[:, 1])).nonzero().view(-1)
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"RandomResizedCrop.apply: sample {i}'s box (top={int(top[i])}, left={int(left[i])}, "
                             f"height={int(height[i])}, width={int(width[i])}) is not inside its {tuple(sizes[i])} "
                             "image; draw the parameters for this batch: op.draw(x, keys)")

    def apply_batch(self, batch: Batch, top: torch.Tensor, left: torch.Tensor, height: torch.Tensor,
                    width: torch.Tensor, flip: torch.Tensor | None = None) -> Batch:
        """``F.resized_crop`` of each sample with its own box, all at once; ``flip`` (bool (N,))
        also mirrors each flagged sample's crop along the last axis (``Compose`` fuses a
        following horizontal flip this way: on the CPU each thread mirrors its own crops as
        it writes them, elsewhere the new crops are mirrored in place)."""
        _require_2d(batch, "RandomResizedCrop")
        refuse_bool_images(batch, "RandomResizedCrop", "resamples pixel values into the image's dtype")
        if batch.ragged:
            return self._apply_list(batch, top, left, height, width, flip)

        def image(x: torch.Tensor) -> torch.Tensor:
            if host_shortcuts(x.device):
                return keep_format(self._image_loop(x, top, left, height, width, flip), x)
            return keep_format(_mirrored(chunked(self._image, x, top, left, height, width), flip), x)

        def mask(x: torch.Tensor) -> torch.Tensor:
            return keep_format(_mirrored(self._mask(x, top, left, height, width), flip), x)

        return batch.map(image=image, mask=mask)

    def _mask(self, x: torch.Tensor, top: torch.Tensor, left: torch.Tensor, height: torch.Tensor,
              width: torch.Tensor) -> torch.Tensor:
        rows = _nearest_taps(top, height, self.size[0])
        cols = _nearest_taps(left, width, self.size[1])
        flat = x.reshape(x.shape[0], -1, *x.shape[-2:])
        tmp = _resample_rows(flat, rows, None, None).transpose(2, 3).contiguous()
        out = _resample_rows(tmp, cols, None, None).transpose(2, 3)
        return keep_format(out.reshape(*x.shape[:-2], *self.size), x)

    def _image(self, x: torch.Tensor, top: torch.Tensor, left: torch.Tensor, height: torch.Tensor,
               width: torch.Tensor) -> torch.Tensor:
        return resize_window(x, top, left, height, width, self.size, self.antialias)

    def _apply_list(self, batch: Batch, top: torch.Tensor, left: torch.Tensor, height: torch.Tensor,
                    width: torch.Tensor, flip: torch.Tensor | None = None) -> Batch:
        """A ragged batch: one batch tensor (N, ..., oh, ow) per image and mask field.

        On the CPU each image's box is resized by torch's own kernel, as for a batch tensor;
        elsewhere the samples are grouped onto padded canvases and resampled together, with
        the boxes on the device (no sync).
        """
        n = len(batch)
        params = {"top": top, "left": left, "height": height, "width": width}
        groups_ = groups(batch.spatial_size)
        out = {}
        for name in batch.names("image", "mask"):
            xs = batch.fields[name]
            lead_shape(xs, 2, name, batch.keys.index)
            if batch.kinds[name] == "image" and host_shortcuts(xs[0].device):
                out[name] = self._image_loop(xs, top, left, height, width, flip)
                continue
            fn = self._image if batch.kinds[name] == "image" else self._mask
            parts = [(rows, fn(canvas(xs, rows, 2), **take(params, rows, n))) for rows in groups_]
            out[name] = _mirrored(scatter(parts, n), flip)
        return batch.replace(out)

    def _image_loop(self, xs: Sequence[torch.Tensor], top: torch.Tensor, left: torch.Tensor, height: torch.Tensor,
                    width: torch.Tensor, flip: torch.Tensor | None = None) -> torch.Tensor:
        """The CPU: each box resized by torch's kernel, as torchvision resizes (uint8 natively),
        one image at a time: measured 4.5x (uint8) and 1.8x (float32) faster there than the
        batched taps for 128 boxes of 256^2 images to 224^2. The images are shared among the
        CPU pool's threads (torch's budget, ``torch.get_num_threads()``); a flagged sample's
        crop is written mirrored by the thread that made it (the same values as mirroring the
        batch afterwards, without a pass over it in the calling thread)."""
        boxes = torch.stack([top, left, height, width], 1).tolist()  # CPU values: no sync
        mirror = flip.tolist() if flip is not None else [False] * len(boxes)
        out = xs[0].new_empty((len(xs), *xs[0].shape[:-2], *self.size))

        def run(rows: range) -> list[None]:
            for i in rows:
                t, lft, h, w = boxes[i]
                y = interpolate_image(xs[i][..., t:t + h, lft:lft + w], self.size, self.antialias)
                out[i] = y.flip(-1) if mirror[i] else y
            return []

        map_runs(run, [h * w for _, _, h, w in boxes], default_threads())
        return out


def _mirrored(x: torch.Tensor, flip: torch.Tensor | None) -> torch.Tensor:
    """``x``'s samples mirrored along the last axis where ``flip`` is set (``x`` is a new tensor,
    owned here: in place on the CPU)."""
    return x if flip is None else mirror_last_(x, flip)


def _inverse_affine(angle: torch.Tensor, tx: torch.Tensor, ty: torch.Tensor, scale: torch.Tensor,
                    shx: torch.Tensor, shy: torch.Tensor, cx: float, cy: float) -> torch.Tensor:
    """Batched ``torchvision ... _get_inverse_affine_matrix`` (inverted=True): (N, 2, 3)."""
    rot, sx, sy = torch.deg2rad(angle), torch.deg2rad(shx), torch.deg2rad(shy)
    cos_sy, tan_sx = torch.cos(sy), torch.tan(sx)
    a = torch.cos(rot - sy) / cos_sy
    b = -(a * tan_sx + torch.sin(rot))
    c = torch.sin(rot - sy) / cos_sy
    d = torch.cos(rot) - c * tan_sx
    m0, m1, m3, m4 = d / scale, -b / scale, -c / scale, a / scale
    cxt, cyt = cx + tx, cy + ty
    m2 = cx - m0 * cxt - m1 * cyt
    m5 = cy - m3 * cxt - m4 * cyt
    return torch.stack([m0, m1, m2, m3, m4, m5], dim=1).view(-1, 2, 3)


#: Spatial axis -> (row axis, column axis) of the plane it rotates, in (D, H, W) positions.
_PLANES = {-3: (1, 2), -2: (0, 2), -1: (0, 1)}


def inverse_affine_3d(angles: torch.Tensor, axes: Sequence[int], translate: torch.Tensor,
                      scale: torch.Tensor) -> torch.Tensor:
    """Inverse map (N, 3, 4) over centred (d, h, w) voxel coordinates.

    The forward map rotates by ``angles[:, i]`` degrees about ``axes[i]`` (the last axis
    first), scales by ``scale`` and translates by ``translate`` ((N, 3) as (tx, ty, tz) =
    (w, h, d) voxels). Rotation about an axis acts on the plane of the two other axes as
    torchvision's 2-D ``F.affine(angle)`` acts on (rows, columns) of an image.
    """
    n = angles.shape[0]
    dt = angles.dtype
    inv = torch.eye(3, dtype=dt, device=angles.device).expand(n, 3, 3)
    for i, axis in enumerate(axes):
        r, c = _PLANES[axis]
        rad = torch.deg2rad(angles[:, i])
        cos, sin = torch.cos(rad), torch.sin(rad)
        one = torch.zeros(n, 3, 3, dtype=dt, device=angles.device)
        one[:, 3 - r - c, 3 - r - c] = 1.0
        # 2-D inverse rotation of torchvision's F.affine in (x=column, y=row) coordinates:
        # x_in = cos x + sin y, y_in = -sin x + cos y.
        one[:, c, c], one[:, c, r] = cos, sin
        one[:, r, c], one[:, r, r] = -sin, cos
        # Forward R = R_0 R_1 ... R_k (R_k applied first): inverse R_k^-1 ... R_1^-1 R_0^-1.
        inv = one @ inv
    inv = inv / scale.view(n, 1, 1)
    t_dhw = translate.flip(-1).to(dt).view(n, 3, 1)
    return torch.cat([inv, -(inv @ t_dhw)], dim=2)


def _affine_grid(matrix: torch.Tensor, spatial: Sequence[int], dt: torch.dtype) -> torch.Tensor:
    """Sampling grid (N, *spatial, sd) for ``grid_sample`` from an inverse map over centred
    pixel coordinates: (N, 2, 3) over (x, y) for 2-D (torchvision's ``_affine_grid``),
    (N, 3, 4) over (d, h, w) for 3-D."""
    n, dev, sd = matrix.shape[0], matrix.device, len(spatial)
    axes = [torch.linspace((1.0 - s) * 0.5, (s - 1.0) * 0.5, steps=s, device=dev, dtype=dt) for s in spatial]
    base = torch.empty(1, *spatial, sd + 1, dtype=dt, device=dev)
    # The columns of ``base``: (x, y, 1) for 2-D as torchvision, (d, h, w, 1) for 3-D.
    order = [1, 0] if sd == 2 else [0, 1, 2]
    for col, axis in enumerate(order):
        view = [1] * sd
        view[axis] = spatial[axis]
        base[..., col].copy_(axes[axis].view(view).expand(spatial))
    base[..., sd].fill_(1)
    # Output coordinates normalised to [-1, 1] in the matrix, as torchvision does (same rounding).
    halves = [0.5 * s for s in (reversed(spatial) if sd == 2 else spatial)]
    theta = matrix.to(dt).transpose(1, 2) / const(halves, dev, dt)  # (N, sd + 1, sd)
    grid = base.view(1, -1, sd + 1).expand(n, -1, -1).bmm(theta).view(n, *spatial, sd)
    return grid.flip(-1) if sd == 3 else grid  # grid_sample reads (x, y, z) = (w, h, d)


def _affine_image(x: torch.Tensor, matrix: torch.Tensor, sd: int, interpolation: str,
                  fill: list[float]) -> torch.Tensor:
    """torchvision's ``_affine_grid`` + ``_apply_grid_transform``, one matrix per sample."""
    n, spatial, c = x.shape[0], tuple(x.shape[-sd:]), x.shape[-sd - 1]
    dt = compute_dtype(x)
    dev = x.device
    grid = _affine_grid(matrix, spatial, dt)
    flat = x.reshape(n, -1, *spatial).to(dt)
    # torchvision appends a channel of ones and samples it too: where it falls outside the
    # image the fill shows, blended with the same weights as the pixels.
    flat = torch.cat([flat, torch.ones(n, 1, *spatial, dtype=dt, device=dev)], dim=1)
    out = F.grid_sample(flat, grid, mode=interpolation, padding_mode="zeros", align_corners=False)
    img, weight = out[:, :-1], out[:, -1:]
    if len(fill) not in (1, c):
        raise ValueError(f"fill has {len(fill)} values, the batch has {c} channels; give 1 or {c}")
    ones = [1] * sd
    fill_t = const(fill, dev, dt).view(1, 1, -1, *ones)
    img_s = img.view(n, -1, c, *spatial)
    weight_s = weight.view(n, 1, 1, *spatial)
    if interpolation == "nearest":
        img_s = torch.where(weight_s < 0.5, fill_t.expand_as(img_s), img_s)
    else:
        img_s = (img_s - fill_t) * weight_s + fill_t
    return keep_format(to_input_dtype(img_s, x).view(x.shape), x)


#: A float32 map of pixel indices is exact below 2**24 pixels per sample; larger samples
#: sample two maps (the index's high and low part) with the same grid.
_EXACT_FLOAT32 = 1 << 24
_LOW_BITS = 12

#: Unsigned dtypes gathered through their signed twin (same bits; masked_fill lacks them).
_SAME_BITS = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def _affine_mask(x: torch.Tensor, matrix: torch.Tensor, sd: int, dt: torch.dtype) -> torch.Tensor:
    """Nearest-neighbour resampling of a mask (any dtype), 0 outside the input, on the grid an
    image field gets: the grid in ``dt`` (the image's compute dtype) from the same matrices.

    The labels are not resampled as floats (each dtype would need its own grid dtype, and a
    pick near a pixel boundary could then differ from the image's): a map of pixel indices
    (+1, so that 0 marks the outside) is sampled with the image's grid and the labels are
    gathered by index, exactly, for every dtype.
    """
    n, spatial = x.shape[0], tuple(x.shape[-sd:])
    pixels = math.prod(spatial)
    dev = x.device
    grid = _affine_grid(matrix, spatial, dt)
    index = torch.arange(1, pixels + 1, device=dev)
    if dt == torch.float32 and pixels >= _EXACT_FLOAT32:
        parts = torch.stack([index >> _LOW_BITS, index & ((1 << _LOW_BITS) - 1)])
    else:
        parts = index.view(1, -1)
    source = parts.to(dt).view(1, -1, *spatial).expand(n, -1, *spatial)
    picked = F.grid_sample(source, grid, mode="nearest", padding_mode="zeros", align_corners=False).long()
    if picked.shape[1] == 2:
        picked = (picked[:, 0] << _LOW_BITS) | picked[:, 1]
    picked = picked.reshape(n, 1, -1)  # 1 + the source pixel, 0 outside
    flat = x.reshape(n, -1, pixels)
    flat = flat.view(_SAME_BITS.get(x.dtype, x.dtype))
    out = flat.gather(2, (picked - 1).clamp_(min=0).expand(-1, flat.shape[1], -1))
    out = out.masked_fill_(picked == 0, 0).view(x.dtype)
    return keep_format(out.view(x.shape), x)


_INTERPOLATIONS = ("nearest", "bilinear")


class RandomAffine(BatchTransform):
    """Random rotation, translation, scale (and, in 2-D, shear) per sample: one batched ``grid_sample``.

    2-D parameters and output follow ``torchvision.transforms.v2.RandomAffine`` / ``F.affine``
    (translations are whole pixels, as torchvision rounds them). Volumes (N, C, D, H, W) are
    rotated about each of ``axes`` by its own angle drawn from ``degrees`` (about -3, the
    depth axis, each D-slice turns as the 2-D op turns an image), scaled isotropically and
    translated by whole voxels; shear and ``center`` are 2-D only. Masks are resampled
    nearest-neighbour with the same map and 0 outside; ``other`` fields pass through.

    Args:
        degrees: Rotation range (min, max), or d for (-d, d).
        translate: Maximum shift as a fraction of (width, height[, depth]), each in [0, 1].
        scale: Scale range (min, max), both > 0.
        shear: Shear range in degrees (2-D): s for x in (-s, s), (min, max) for x, or
            (xmin, xmax, ymin, ymax).
        interpolation: Images: "nearest" (torchvision's default) or "bilinear" (trilinear in 3-D).
        fill: Images: value (or one per channel) of the area outside the input.
        center: Rotation center (x, y) in pixels (2-D); default the image center.
        axes: Volumes: the axes rotated about, among -3 (D), -2 (H), -1 (W); the last
            listed is applied first. Images (2-D batches) refuse any other than (-3,).
    """

    def __init__(self, degrees: float | Sequence[float], translate: Sequence[float] | None = None,
                 scale: Sequence[float] | None = None, shear: float | Sequence[float] | None = None,
                 interpolation: str = "nearest", fill: float | Sequence[float] = 0.0,
                 center: Sequence[float] | None = None, axes: Sequence[int] = (-3,)) -> None:
        self.degrees = float_range(degrees, "degrees")
        if translate is not None:
            translate = float_seq(translate, "translate", "(fx, fy) or (fx, fy, fz), fractions in [0, 1]")
            if len(translate) not in (2, 3) or not all(0.0 <= t <= 1.0 for t in translate):
                raise ValueError(f"translate must be (fx, fy) or (fx, fy, fz) with values in [0, 1], got {translate!r}")
        self.translate = translate
        if scale is not None:
            scale = float_range(scale, "scale", lower=0.0)
            if scale[0] <= 0:
                raise ValueError(f"scale values must be > 0, got {scale!r}")
        self.scale = scale
        if shear is not None:
            if _float(shear) is not None:  # numpy scalars and 0-d tensors too
                shear = float_range(shear, "shear")
            else:
                vals = float_seq(shear, "shear", "a number, or 2 or 4 numbers")
                if len(vals) not in (2, 4):
                    raise ValueError(f"shear must be a number, or 2 or 4 numbers, got {shear!r}")
                float_range(vals[:2], "shear (x)")
                if len(vals) == 4:
                    float_range(vals[2:], "shear (y)")
                shear = vals
        self.shear = shear
        if interpolation not in _INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {_INTERPOLATIONS}, got {interpolation!r}")
        self.interpolation = interpolation
        self.fill = fill_values(fill, "fill")
        if center is not None:
            center = float_seq(center, "center", "a pair (x, y)")
            if len(center) != 2:
                raise ValueError(f"center must be a pair (x, y), got {center!r}")
        self.center = center
        axes = int_seq(axes, "axes", "spatial axes among -3 (D), -2 (H), -1 (W)")
        if not axes or len(set(axes)) != len(axes) or not all(a in _PLANES for a in axes):
            raise ValueError(f"axes must be distinct spatial axes among -3 (D), -2 (H), -1 (W), got {axes!r}")
        self.axes = axes

    def _check_2d(self, batch: Batch) -> None:
        if self.axes != (-3,):  # about D is the H-W plane: the only turn an image has
            name = type(self).__name__
            raise ValueError(f"{name} axes={self.axes} turns volumes about those axes, but the batch has 2 "
                             "spatial dims (images turn in the H-W plane: leave axes at (-3,))" + volume_hint(3, 2))

    def _check_3d(self, batch: Batch) -> None:
        name = type(self).__name__
        if self.shear is not None or self.center is not None:
            raise ValueError(f"{name} shear and center are 2-D only; the batch has 3 spatial dims")
        if self.translate is not None and len(self.translate) != 3:
            raise ValueError(f"{name} translate={self.translate} needs 3 fractions (fx, fy, fz) for volumes")

    def make_params(self, batch: Batch) -> dict[str, torch.Tensor]:
        """2-D: ``angle``, ``tx``, ``ty``, ``scale``, ``shear_x``, ``shear_y``, each float64 (N,).
        3-D: ``angles`` (N, len(axes)) degrees, ``translate`` (N, 3) voxels (x, y, z), ``scale`` (N,)."""
        if batch.spatial_dims == 3:
            self._check_3d(batch)
            return self._params_3d(batch)
        self._check_2d(batch)
        if self.translate is not None and len(self.translate) != 2:
            raise ValueError(f"{type(self).__name__} translate={self.translate} needs 2 fractions (fx, fy) for images"
                             + volume_hint(len(self.translate), 2))
        height, width = batch.spatial_size
        u = batch.keys.uniform(0, 6, dtype=torch.float64).T

        def lerp(lo: float, hi: float, v: torch.Tensor) -> torch.Tensor:
            return lo + (hi - lo) * v

        out = {"angle": lerp(*self.degrees, u[0])}
        zero, one = torch.zeros_like(u[0]), torch.ones_like(u[0])
        if self.translate is not None:
            mx, my = float(self.translate[0] * width), float(self.translate[1] * height)
            out["tx"], out["ty"] = torch.round(lerp(-mx, mx, u[1])), torch.round(lerp(-my, my, u[2]))
        else:
            out["tx"], out["ty"] = zero, zero
        out["scale"] = lerp(*self.scale, u[3]) if self.scale is not None else one
        out["shear_x"] = lerp(self.shear[0], self.shear[1], u[4]) if self.shear is not None else zero
        out["shear_y"] = (lerp(self.shear[2], self.shear[3], u[5])
                          if self.shear is not None and len(self.shear) == 4 else zero)
        return out

    def _params_3d(self, batch: Batch) -> dict[str, torch.Tensor]:
        k = len(self.axes)
        u = batch.keys.uniform(0, k + 4, dtype=torch.float64)
        lo, hi = self.degrees
        angles = lo + (hi - lo) * u[:, :k]
        if self.translate is not None:
            d, h, w = batch.spatial_size
            most = const([f * s for f, s in zip(self.translate, (w, h, d), strict=True)], u.device, torch.float64)
            translate = torch.round((2.0 * u[:, k:k + 3] - 1.0) * most)
        else:
            translate = torch.zeros_like(u[:, k:k + 3])
        scale = self.scale[0] + (self.scale[1] - self.scale[0]) * u[:, k + 3] if self.scale is not None \
            else torch.ones_like(u[:, 0])
        return {"angles": angles, "translate": translate, "scale": scale}

    def _center(self, height: int, width: int) -> tuple[float, float]:
        if self.center is None:
            return 0.0, 0.0
        return self.center[0] - width * 0.5, self.center[1] - height * 0.5

    def _check_fill(self, batch: Batch) -> None:
        """Refuse a ``fill`` an integer image cannot hold: it was clamped into the dtype's
        range without a word (uint8 ``fill=-1`` filled 0, ``fill=300`` filled 255), where
        ``RandomCrop`` refuses the same fill."""
        shown = self.fill[0] if len(self.fill) == 1 else self.fill
        refuse_unfit_fill(batch, self.fill, type(self).__name__, shown, truncated=False)

    def matrix(self, batch: Batch, **params: torch.Tensor) -> torch.Tensor:
        """The per-sample inverse maps at ``params``: (N, 2, 3) over (x, y), or (N, 3, 4) over (d, h, w)."""
        if batch.spatial_dims == 3:
            self._check_3d(batch)
            return inverse_affine_3d(params["angles"], self.axes, params["translate"], params["scale"])
        self._check_2d(batch)
        cx, cy = self._center(*batch.spatial_size)
        return _inverse_affine(params["angle"], params["tx"], params["ty"], params["scale"],
                               params["shear_x"], params["shear_y"], cx, cy)

    def apply_batch(self, batch: Batch, **params: torch.Tensor) -> Batch:
        """``F.affine`` of each sample with its own parameters, all at once."""
        refuse_bool_images(batch, type(self).__name__, "resamples pixel values into the image's dtype")
        self._check_fill(batch)
        m = self.matrix(batch, **params)
        sd = batch.spatial_dims
        # Masks get the first image field's grid: its dtype and its CPU chunks (the grid of a
        # chunk is computed from that chunk's matrices), so a mask equal to a function of the
        # image stays that function of it, pixel for pixel.
        images = batch.names("image")
        first = batch.fields[images[0]] if images else None
        grid_dt = torch.float32 if first is None else compute_dtype(first)

        def image(x: torch.Tensor) -> torch.Tensor:
            fn = lambda xs, ms: _affine_image(xs, ms, sd, self.interpolation, self.fill)  # noqa: E731
            return keep_format(chunked(fn, x, m), x)

        def mask(x: torch.Tensor) -> torch.Tensor:
            fn = lambda xs, ms: _affine_mask(xs, ms, sd, grid_dt)  # noqa: E731
            return keep_format(chunked(fn, x, m, rows=chunk_rows(first if first is not None else x)), x)

        return batch.map(image=image, mask=mask)


class RandomRotation(RandomAffine):
    """Rotate each sample by its own random angle (``torchvision.transforms.v2.RandomRotation``).

    The output keeps the input size (torchvision's ``expand=False``); masks turn alike,
    nearest-neighbour. Volumes turn about each of ``axes`` (the last listed first), each
    D-slice as this op turns an image: a positive angle about an axis turns its plane as
    ``torch.rot90(k=1)`` on the two other axes, in (D, H, W) order. That is the opposite
    sense to ``RandomAffine``, which follows ``F.affine`` (clockwise).

    Args:
        degrees: Angle range (min, max), or d for (-d, d); counter-clockwise.
        interpolation: Images: "nearest" (torchvision's default) or "bilinear".
        fill: Images: value (or one per channel) of the area outside the input.
        center: Rotation center (x, y) in pixels (2-D); default the image center.
        axes: Volumes: the axes rotated about, among -3 (D), -2 (H), -1 (W). Images
            (2-D batches) refuse any other than (-3,).
    """

    def __init__(self, degrees: float | Sequence[float], interpolation: str = "nearest",
                 fill: float | Sequence[float] = 0.0, center: Sequence[float] | None = None,
                 axes: Sequence[int] = (-3,)) -> None:
        super().__init__(degrees, interpolation=interpolation, fill=fill, center=center, axes=axes)

    def make_params(self, batch: Batch) -> dict[str, torch.Tensor]:
        """2-D: ``angle`` float64 (N,), degrees counter-clockwise. 3-D: ``angles``,
        ``translate`` and ``scale`` as ``RandomAffine`` (translate 0, scale 1), with
        ``angles`` counter-clockwise."""
        p = super().make_params(batch)
        return p if batch.spatial_dims == 3 else {"angle": p["angle"]}

    def apply_batch(self, batch: Batch, **params: torch.Tensor) -> Batch:
        """``F.rotate`` of each sample by its own angle."""
        if batch.spatial_dims == 3:
            # RandomAffine turns each plane as F.affine does (clockwise for a positive angle);
            # negate as in 2-D so a volume turns the way this op turns an image (rot90 k=+1
            # on the plane of the two other axes at 90 degrees).
            return super().apply_batch(batch, **{**params, "angles": -params["angles"]})
        angle = params["angle"]
        zero, one = torch.zeros_like(angle), torch.ones_like(angle)
        # torchvision's rotate passes -angle to the same inverse matrix as affine.
        return super().apply_batch(batch, angle=-angle, tx=zero, ty=zero, scale=one, shear_x=zero, shear_y=zero)


__all__ = ["RandomAffine", "RandomResizedCrop", "RandomRotation", "interpolate_image", "nearest_resize",
           "resize_window"]
