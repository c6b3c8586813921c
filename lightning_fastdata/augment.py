"""Batched augmentation on the training device, with independent randomness per sample.

Each op takes a batch ``x`` of N samples, shape ``(N, ..., C, H, W)`` (leading dims such
as video frames share the sample's draw), and an explicit ``torch.Generator`` on the
batch's device; it draws N independent parameter sets from that generator and nothing
else, so a batch is reproducible from its seed. torchvision's v2 transforms applied to a
batch draw one decision for the whole batch; these do not.

Ops work on uint8 where they can (crop, flip): augment first, then convert and
normalise last (``Normalize`` accepts uint8 and converts in the same pass).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "uint8": torch.uint8,
}


def _pair(value: int | Sequence[int], name: str) -> tuple[int, int]:
    if isinstance(value, int):
        out = (value, value)
    else:
        out = tuple(int(v) for v in value)
        if len(out) != 2:
            raise ValueError(f"{name} must be an int or a pair (h, w), got {value!r}")
    if min(out) < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return out  # type: ignore[return-value]


def _check_batch(x: torch.Tensor, op: str) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim < 3:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{op} expects a batch (N, ..., C, H, W) tensor, got {shape}")


def _keep_format(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if like.ndim == 4 and not like.is_contiguous() and like.is_contiguous(memory_format=torch.channels_last):
        return out.contiguous(memory_format=torch.channels_last)
    return out


class BatchTransform:
    """Base class: ``op(x, generator)`` returns the transformed batch."""

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused flat work buffer of at least ``numel`` elements (never returned to callers).

    Fresh CPU memory of batch size is page-faulted in on every call (several times the cost
    of the copy itself for ImageNet-sized batches), so the padded source of a crop lives
    in one per-thread buffer that only grows.
    """
    if device.type != "cpu":
        # The CUDA caching allocator already recycles memory, and a buffer shared across
        # calls would need stream bookkeeping.
        return torch.empty(numel, dtype=dtype, device=device)
    key = (dtype, device)
    cache = _SCRATCH.__dict__.setdefault("buffers", {})
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        cache[key] = buf
    return buf[:numel]


_SCRATCH = threading.local()


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


def _window_crop(x: torch.Tensor, oy: torch.Tensor, ox: torch.Tensor, th: int, tw: int,
                 flip: torch.Tensor | None = None, padding: tuple[int, int] = (0, 0),
                 fill: float = 0) -> torch.Tensor:
    """Per-sample crop of ``pad(x)`` at (oy, ox), size (th, tw), optionally mirrored.

    Each output row of ``tw`` pixels is one contiguous run of the padded source, so the
    crop is a single ``index_select`` of ``n * C * th`` rows from an overlapping
    "every start offset" view of the source (a memcpy per row), instead of a per-pixel
    gather with an int64 index per output element (5-7x slower on CPU). Mirrored samples
    read from mirrored copies of their padded source at the mirrored column:
    ``flip(crop(p, oy, ox)) == crop(flip(p), oy, Wp - tw - ox)``. The output is
    bit-identical to padding with ``F.pad`` and gathering pixel by pixel.
    """
    n, h, w = x.shape[0], x.shape[-2], x.shape[-1]
    mid = x.shape[1:-2]
    m = math.prod(mid)
    py, px = padding
    hp, wp = h + 2 * py, w + 2 * px
    dev = x.device
    if n == 0:
        return x.new_empty((0, *mid, th, tw))
    src_n, fidx = n, None
    if flip is not None:
        if dev.type == "cpu":
            # Only the mirrored samples get a mirrored copy (nonzero would sync a GPU).
            fidx = flip.nonzero().view(-1)
            src_n = n + fidx.numel()
        else:
            src_n = 2 * n
    plain = x.reshape(n, m, h, w)
    if src_n == n and not (py or px) and plain.is_contiguous():
        src = plain  # nothing to pad or mirror: read the input in place
    else:
        src = _scratch(src_n * m * hp * wp, x.dtype, dev).view(src_n, m, hp, wp)
        if py or px:
            _fill_border(src, py, px, h, w, fill)
        src[:n, :, py:py + h, px:px + w].copy_(plain)
        if src_n > n:
            mirrored = plain if fidx is None else plain.index_select(0, fidx)
            src[n:, :, py:py + h, px:px + w].copy_(mirrored.flip(-1))
    if flip is None:
        sample, col = torch.arange(n, device=dev), ox
    else:
        if fidx is None:
            sample = torch.arange(n, device=dev) + flip.long() * n
        else:
            sample = torch.arange(n, device=dev)
            sample[fidx] = torch.arange(n, n + fidx.numel(), device=dev)
        col = torch.where(flip, (wp - tw) - ox, ox)
    plane = hp * wp
    starts = ((sample * (m * plane) + oy * wp + col).view(n, 1, 1)
              + (torch.arange(m, device=dev) * plane).view(1, m, 1)
              + (torch.arange(th, device=dev) * wp).view(1, 1, th))
    flat = src.reshape(-1)
    rows = flat.as_strided((flat.numel() - tw + 1, tw), (1, 1))
    out = torch.index_select(rows, 0, starts.view(-1))
    return out.view(n, *mid, th, tw)


def _gather_crop(x: torch.Tensor, oy: torch.Tensor, ox: torch.Tensor, th: int, tw: int,
                 flip: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample crop at (oy, ox) of size (th, tw), optionally mirrored, in one gather pass."""
    return _window_crop(x, oy, ox, th, tw, flip)


class RandomHorizontalFlip(BatchTransform):
    """Mirror each sample left-right with probability ``p``, independently.

    Args:
        p: Probability of flipping a sample, in [0, 1].
    """

    def __init__(self, p: float = 0.5) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        self.p = p

    def draw(self, n: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
        """The per-sample flip decisions (bool, shape (n,))."""
        return torch.rand(n, generator=generator, device=device) < self.p

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        _check_batch(x, "RandomHorizontalFlip")
        flip = self.draw(x.shape[0], x.device, generator)
        if x.device.type != "cpu":
            # No host sync (nonzero would wait for the GPU); a mirrored pass is cheap there.
            return _keep_format(torch.where(flip.view(-1, *[1] * (x.ndim - 1)), x.flip(-1), x), x)
        # Mirror only the flipped samples, then pick each sample's version with one
        # whole-sample index_select (a memcpy per sample; index_copy_/index_put_ are
        # per-element on the CPU and 5x slower).
        n = x.shape[0]
        fidx = flip.nonzero().view(-1)
        xc = x.contiguous()
        if not fidx.numel():
            return _keep_format(xc.clone(), x)
        src = _scratch((n + fidx.numel()) * xc[0].numel(), x.dtype, x.device).view(-1, *x.shape[1:])
        src[:n].copy_(xc)
        src[n:].copy_(xc.index_select(0, fidx).flip(-1))
        pick = torch.arange(n, device=x.device)
        pick[fidx] = torch.arange(n, n + fidx.numel(), device=x.device)
        return _keep_format(torch.index_select(src, 0, pick), x)


class RandomCrop(BatchTransform):
    """Crop each sample at its own random position, after optional zero/constant padding.

    Args:
        size: Output (h, w), or an int for a square.
        padding: Pixels added on every side (int) or (vertical, horizontal) before cropping.
        fill: Constant for the padding.
    """

    def __init__(self, size: int | Sequence[int], padding: int | Sequence[int] = 0, fill: float = 0) -> None:
        self.size = _pair(size, "size")
        if min(self.size) <= 0:
            raise ValueError(f"size must be > 0, got {size!r}")
        self.padding = _pair(padding, "padding")
        self.fill = fill

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        py, px = self.padding
        if not (py or px):
            return x
        n, mid = x.shape[0], x.shape[1:-2]
        flat = x.reshape(n, -1, x.shape[-2], x.shape[-1])
        out = F.pad(flat, [px, px, py, py], value=self.fill)
        return out.view(n, *mid, out.shape[-2], out.shape[-1])

    def draw(self, x: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded batch's per-sample top-left corners ``(oy, ox)``."""
        th, tw = self.size
        h, w = x.shape[-2] + 2 * self.padding[0], x.shape[-1] + 2 * self.padding[1]
        if th > h or tw > w:
            raise ValueError(f"RandomCrop size {self.size} is larger than the padded input {(h, w)}")
        n, dev = x.shape[0], x.device
        oy = torch.randint(0, h - th + 1, (n,), generator=generator, device=dev)
        ox = torch.randint(0, w - tw + 1, (n,), generator=generator, device=dev)
        return oy, ox

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None,
                 flip: RandomHorizontalFlip | None = None) -> torch.Tensor:
        _check_batch(x, "RandomCrop")
        oy, ox = self.draw(x, generator)
        mask = flip.draw(x.shape[0], x.device, generator) if flip is not None else None
        # The padding is written into the crop's source buffer, not materialised by F.pad.
        return _keep_format(_window_crop(x, oy, ox, *self.size, mask, self.padding, self.fill), x)


class ToDtype(BatchTransform):
    """Convert the batch's dtype, scaling uint8 [0, 255] to [0, 1] floats when ``scale``.

    Args:
        dtype: "float32", "float16", "bfloat16", "float64" or "uint8".
        scale: Rescale between integer and float value ranges.
    """

    def __init__(self, dtype: str = "float32", scale: bool = True) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.dtype, self.scale = dtype, scale

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        target = _DTYPES[self.dtype]
        if x.dtype == target:
            return x
        if not self.scale:
            return x.to(target)
        if not x.is_floating_point() and target.is_floating_point:
            return x.to(target).mul_(1.0 / 255.0)
        if x.is_floating_point() and target == torch.uint8:
            return x.mul(255.0).round_().clamp_(0, 255).to(target)
        return x.to(target)


class Normalize(BatchTransform):
    """Per-channel ``(x - mean) / std``; uint8 input is first scaled to [0, 1] floats, in one pass.

    Args:
        mean: One mean per channel (on the [0, 1] scale).
        std: One standard deviation per channel, all > 0.
        dtype: Output dtype for integer input ("float32", "float16", "bfloat16").
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], dtype: str = "float32") -> None:
        self.mean, self.std = [float(m) for m in mean], [float(s) for s in std]
        if len(self.mean) != len(self.std) or not self.mean:
            raise ValueError(f"mean and std need one value per channel, got {mean!r} and {std!r}")
        if min(self.std) <= 0:
            raise ValueError(f"std must be > 0, got {std!r}")
        if dtype not in _DTYPES or not _DTYPES[dtype].is_floating_point:
            raise ValueError(f"dtype must be a float dtype name, got {dtype!r}")
        self.dtype = dtype

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        _check_batch(x, "Normalize")
        c = x.shape[-3]
        if c != len(self.mean):
            raise ValueError(f"Normalize has {len(self.mean)} channel means, the batch has {c} channels")
        out_dtype = x.dtype if x.is_floating_point() else _DTYPES[self.dtype]
        mean = torch.tensor(self.mean, dtype=torch.float32, device=x.device).view(c, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32, device=x.device).view(c, 1, 1)
        in_scale = 1.0 if x.is_floating_point() else 1.0 / 255.0
        scale, shift = in_scale / std, -mean / std
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        torch.addcmul(shift.to(out_dtype), x.to(out_dtype), scale.to(out_dtype), out=out)
        return _keep_format(out, x)


class Compose(BatchTransform):
    """Apply ops in order with one generator; a crop followed by a flip runs as one pass.

    Args:
        transforms: The ops, applied first to last.
    """

    def __init__(self, transforms: Sequence[BatchTransform]) -> None:
        for i, t in enumerate(transforms):
            if not callable(t):
                raise TypeError(f"Compose item {i} is a {type(t).__name__}, not a transform")
        self.transforms = list(transforms)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        ops, i = self.transforms, 0
        while i < len(ops):
            op = ops[i]
            nxt = ops[i + 1] if i + 1 < len(ops) else None
            # Fused: the crop draws its corners, then the flip its mask, exactly as the two
            # ops would in sequence, so the output is identical, with one pass less.
            if type(op) is RandomCrop and type(nxt) is RandomHorizontalFlip:
                x = op(x, generator, flip=nxt)
                i += 2
                continue
            x = op(x, generator)
            i += 1
        return x


# ---------------------------------------------------------------------------------------
# The full augmentation set. Each op mirrors one torchvision v2 transform: ``draw`` samples
# N parameter sets with the distribution torchvision's ``make_params`` uses for one sample,
# ``apply`` runs the torchvision functional op with those parameters on every sample at
# once. Leading dims between N and C (video frames) share their sample's parameters.
# ---------------------------------------------------------------------------------------

_MAX_VALUE = {torch.uint8: 255.0}


def _float_range(
    value: float | Sequence[float],
    name: str,
    center: float | None = None,
    lower: float = float("-inf"),
    upper: float = float("inf"),
) -> tuple[float, float]:
    """``value`` as (lo, hi); a number means ``center -/+ value`` (or ``-/+ value``)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number or a pair (min, max), got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{name} as a single number must be >= 0, got {value!r}")
        c = 0.0 if center is None else center
        lo, hi = c - float(value), c + float(value)
        if center is not None:
            lo = max(lo, lower)
    else:
        pair = [float(v) for v in value]
        if len(pair) != 2:
            raise ValueError(f"{name} must be a number or a pair (min, max), got {value!r}")
        lo, hi = pair
    if not lower <= lo <= hi <= upper:
        raise ValueError(
            f"{name} must be an increasing pair within [{lower}, {upper}], got {value!r}"
        )
    return lo, hi


def _samples(x: torch.Tensor) -> torch.Tensor:
    """View ``(N, ..., C, H, W)`` as ``(N, L, C, H, W)``: L leading frames share a sample's draw."""
    n, c, h, w = x.shape[0], x.shape[-3], x.shape[-2], x.shape[-1]
    return x.reshape(n, -1, c, h, w)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # float64 stays float64; everything else (uint8, half types) is computed in float32.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _to_input_dtype(y: torch.Tensor, like: torch.Tensor, rounding: bool = True) -> torch.Tensor:
    if like.is_floating_point():
        return y.to(like.dtype)
    bound = _MAX_VALUE.get(like.dtype, float(torch.iinfo(like.dtype).max))
    if rounding:
        y = y.round()
    return y.clamp_(0, bound).to(like.dtype)


#: On the CPU, batches are processed in chunks of about this many elements: each op makes
#: several float passes over its input, and chunks that stay in cache run 3-5x faster than
#: whole-batch temporaries. On accelerators the whole batch is one launch.
_CPU_CHUNK_ELEMENTS = 1 << 19


def _chunked(
    fn: Callable[..., torch.Tensor], x: torch.Tensor, *per_sample: torch.Tensor
) -> torch.Tensor:
    """``fn(x, *per_sample)`` over sample chunks on the CPU (per-sample tensors sliced alike)."""
    n = x.shape[0]
    rows = max(1, _CPU_CHUNK_ELEMENTS // max(1, x[0].numel()))
    if x.device.type != "cpu" or n <= rows:
        return fn(x, *per_sample)
    parts = [fn(x[a : a + rows], *(p[a : a + rows] for p in per_sample)) for a in range(0, n, rows)]
    return torch.cat(parts)


def _resample_taps(
    start: torch.Tensor,
    length: torch.Tensor,
    in_size: int,
    out_size: int,
    antialias: bool,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample bilinear resampling of the window [start, start+length) to ``out_size`` pixels.

    Returns ``(index, weight)``, each (N, out_size, K): output pixel i of sample n is
    ``sum_k weight[n, i, k] * input[index[n, i, k]]``. The weights are those of torch's
    ``_upsample_bilinear2d_aa`` (PIL's algorithm, behind torchvision's antialiased
    ``resize``) for an input of ``length`` pixels; without antialias the triangle is not
    widened, which is plain bilinear interpolation. K is a bound known on the host (no
    device sync); taps past a pixel's window get weight 0.
    """
    dev = start.device
    widest = max(in_size / out_size, 1.0) if antialias else 1.0
    k = math.ceil(2 * widest) + 1
    length = length.to(dtype).view(-1, 1)
    scale = length / out_size
    widen = (scale >= 1.0) if antialias else torch.zeros_like(scale, dtype=torch.bool)
    support = torch.where(widen, scale, torch.ones_like(scale))
    invscale = torch.where(widen, 1.0 / scale, torch.ones_like(scale))
    center = scale * (torch.arange(out_size, device=dev, dtype=dtype).view(1, -1) + 0.5)
    xmin = torch.trunc(center - support + 0.5).clamp_(min=0)
    xmax = torch.minimum(torch.trunc(center + support + 0.5), length)
    pos = xmin.unsqueeze(-1) + torch.arange(k, device=dev, dtype=dtype)  # (N, out, K), local
    wts = (1.0 - ((pos - center.unsqueeze(-1) + 0.5) * invscale.unsqueeze(-1)).abs()).clamp_(min=0)
    wts = torch.where(pos < xmax.unsqueeze(-1), wts, torch.zeros_like(wts))
    wts = wts / wts.sum(-1, keepdim=True)
    index = (
        (pos + start.to(dtype).view(-1, 1, 1)).clamp_(max=in_size - 1).long()
    )  # zero-weight taps clamp
    return index, wts


def _resample_rows(
    x: torch.Tensor, index: torch.Tensor, wts: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Resample rows (dim 2) of ``x`` (N, M, H, W) with per-sample taps (N, oh, K).

    Each tap copies whole rows with one ``index_select`` (contiguous memory), then adds
    them weighted: K row copies instead of a dense (oh x H) product per sample.
    """
    n, m, h, w = x.shape
    oh, k = index.shape[1], index.shape[2]
    rows = x.reshape(n * m * h, w)
    base = (torch.arange(n * m, device=x.device) * h).view(n, m, 1)
    out = None
    for t in range(k):
        sel = (base + index[:, :, t].view(n, 1, oh)).view(-1)
        picked = rows.index_select(0, sel).view(n, m, oh, w).to(dtype)
        weight = wts[:, :, t].view(n, 1, oh, 1)
        out = picked.mul_(weight) if out is None else out.addcmul_(picked, weight)
    return out  # type: ignore[return-value]


def _ratio_range(ratio: Sequence[float]) -> tuple[float, float]:
    """An aspect-ratio range ``0 < min <= max``."""
    out = _float_range(ratio, "ratio", lower=0.0)
    if out[0] <= 0:
        raise ValueError(f"ratio must be > 0, got {ratio!r}")
    return out


def _box_attempts(u: torch.Tensor, area: int, scale: Sequence[float], ratio: Sequence[float]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """torchvision's 10 box attempts per sample from uniforms ``u`` (n, 10, >=2).

    Returns ``(round(sqrt(target * aspect)), round(sqrt(target / aspect)))`` for a target
    area uniform in ``scale`` x ``area`` and an aspect ratio log-uniform in ``ratio``; which
    of the two is the height is the caller's (torchvision differs between ops).
    """
    target = float(area) * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    lr = torch.log(torch.tensor(ratio, device=u.device))
    aspect = torch.exp(lr[0] + (lr[1] - lr[0]) * u[..., 1])
    return torch.round(torch.sqrt(target * aspect)), torch.round(torch.sqrt(target / aspect))


def _first_valid_box(u: torch.Tensor, ok: torch.Tensor, h: torch.Tensor, w: torch.Tensor, height: int,
                     width: int) -> tuple[torch.Tensor, ...]:
    """Each sample's first valid attempt and its position from ``u[..., 2:4]``: (top, left, h, w, any valid)."""
    first = torch.argmax(ok.to(torch.uint8), dim=1, keepdim=True)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.gather(1, first).squeeze(1)

    h, w, ui, uj = pick(h), pick(w), pick(u[..., 2]), pick(u[..., 3])
    top = torch.floor(ui * (height - h + 1)).clamp_(max=height - h)
    left = torch.floor(uj * (width - w + 1)).clamp_(max=width - w)
    return top, left, h, w, ok.any(dim=1)


class RandomResizedCrop(BatchTransform):
    """Crop a random area and aspect ratio of each sample and resize it to ``size`` (bilinear).

    Parameters follow ``torchvision.transforms.v2.RandomResizedCrop`` (10 attempts, then a
    central crop); the resize is ``F.resized_crop`` with bilinear interpolation, done for the
    whole batch as two batched matrix products.

    Args:
        size: Output (h, w), or an int for a square.
        scale: Range of the crop's area as a fraction of the input's, 0 < min <= max <= 1.
        ratio: Range of the crop's aspect ratio (w / h), 0 < min <= max.
        antialias: Antialias when downscaling, as torchvision's default.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = (3.0 / 4.0, 4.0 / 3.0),
        antialias: bool = True,
    ) -> None:
        self.size = _pair(size, "size")
        if min(self.size) <= 0:
            raise ValueError(f"size must be > 0, got {size!r}")
        self.scale = _float_range(scale, "scale", lower=0.0, upper=1.0)
        if self.scale[1] <= 0:
            raise ValueError(f"scale must have max > 0, got {scale!r}")
        self.ratio = _ratio_range(ratio)
        self.antialias = bool(antialias)

    def draw(
        self,
        n: int,
        height: int,
        width: int,
        device: torch.device,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, ...]:
        """Per-sample crop boxes ``(top, left, height, width)``, int64 tensors of shape (n,)."""
        u = torch.rand(n, 10, 4, generator=generator, device=device)
        w, h = _box_attempts(u, height * width, self.scale, self.ratio)
        ok = (w > 0) & (w <= width) & (h > 0) & (h <= height)
        top, left, h, w, any_ok = _first_valid_box(u, ok, h, w, height, width)
        # torchvision's fallback after 10 failed attempts: the central crop of clamped ratio.
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            fw, fh = width, int(round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            fw, fh = int(round(height * self.ratio[1])), height
        else:
            fw, fh = width, height
        h = torch.where(any_ok, h, torch.full_like(h, fh))
        w = torch.where(any_ok, w, torch.full_like(w, fw))
        top = torch.where(any_ok, top, torch.full_like(top, (height - fh) // 2))
        left = torch.where(any_ok, left, torch.full_like(left, (width - fw) // 2))
        return top.long(), left.long(), h.long(), w.long()

    def apply(
        self,
        x: torch.Tensor,
        top: torch.Tensor,
        left: torch.Tensor,
        height: torch.Tensor,
        width: torch.Tensor,
    ) -> torch.Tensor:
        """``F.resized_crop`` of each sample with its own box, all at once."""
        _check_batch(x, "RandomResizedCrop")
        return _keep_format(_chunked(self._apply, x, top, left, height, width), x)

    def _apply(
        self,
        x: torch.Tensor,
        top: torch.Tensor,
        left: torch.Tensor,
        height: torch.Tensor,
        width: torch.Tensor,
    ) -> torch.Tensor:
        n, h, w = x.shape[0], x.shape[-2], x.shape[-1]
        oh, ow = self.size
        dt = _compute_dtype(x)
        rows = _resample_taps(top, height, h, oh, self.antialias, dt)
        cols = _resample_taps(left, width, w, ow, self.antialias, dt)
        flat = x.reshape(n, -1, h, w)
        # Rows, then columns through a transpose: both passes copy contiguous rows.
        tmp = _resample_rows(flat, *rows, dt).transpose(2, 3).contiguous()
        out = _resample_rows(tmp, *cols, dt).transpose(2, 3)
        out = _to_input_dtype(out, x).reshape(*x.shape[:-2], oh, ow)
        return _keep_format(out, x)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        _check_batch(x, "RandomResizedCrop")
        box = self.draw(x.shape[0], x.shape[-2], x.shape[-1], x.device, generator)
        return self.apply(x, *box)


def _inverse_affine(
    angle: torch.Tensor,
    tx: torch.Tensor,
    ty: torch.Tensor,
    scale: torch.Tensor,
    shx: torch.Tensor,
    shy: torch.Tensor,
    cx: float,
    cy: float,
) -> torch.Tensor:
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


def _fill_values(fill: float | Sequence[float], name: str) -> list[float]:
    if isinstance(fill, bool):
        raise TypeError(f"{name} must be a number or one number per channel, got {fill!r}")
    values = [float(fill)] if isinstance(fill, (int, float)) else [float(v) for v in fill]
    if not values:
        raise ValueError(f"{name} must be a number or one number per channel, got {fill!r}")
    return values


def _affine_batch(
    x: torch.Tensor, matrix: torch.Tensor, interpolation: str, fill: list[float]
) -> torch.Tensor:
    """torchvision's ``_affine_grid`` + ``_apply_grid_transform``, one matrix per sample."""
    n, h, w = x.shape[0], x.shape[-2], x.shape[-1]
    c = x.shape[-3]
    dt = _compute_dtype(x)
    dev = x.device
    base = torch.empty(1, h, w, 3, dtype=dt, device=dev)
    base[..., 0].copy_(
        torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, steps=w, device=dev, dtype=dt)
    )
    base[..., 1].copy_(
        torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, steps=h, device=dev, dtype=dt).unsqueeze(
            -1
        )
    )
    base[..., 2].fill_(1)
    theta = matrix.to(dt).transpose(1, 2) / torch.tensor([0.5 * w, 0.5 * h], dtype=dt, device=dev)
    grid = base.view(1, h * w, 3).expand(n, -1, -1).bmm(theta).view(n, h, w, 2)
    flat = x.reshape(n, -1, h, w).to(dt)
    # torchvision appends a channel of ones and samples it too: where it falls outside the
    # image the fill shows, blended with the same weights as the pixels.
    flat = torch.cat([flat, torch.ones(n, 1, h, w, dtype=dt, device=dev)], dim=1)
    out = F.grid_sample(flat, grid, mode=interpolation, padding_mode="zeros", align_corners=False)
    img, mask = out[:, :-1], out[:, -1:]
    if len(fill) not in (1, c):
        raise ValueError(f"fill has {len(fill)} values, the batch has {c} channels; give 1 or {c}")
    fill_t = torch.tensor(fill, dtype=dt, device=dev).view(1, 1, -1, 1, 1)
    img5 = img.view(n, -1, c, h, w)
    mask5 = mask.view(n, 1, 1, h, w)
    if interpolation == "nearest":
        img5 = torch.where(mask5 < 0.5, fill_t.expand_as(img5), img5)
    else:
        img5 = (img5 - fill_t) * mask5 + fill_t
    out = _to_input_dtype(img5, x).view(x.shape)
    return _keep_format(out, x)


_INTERPOLATIONS = ("nearest", "bilinear")


class RandomAffine(BatchTransform):
    """Random rotation, translation, scale and shear per sample: one batched ``grid_sample``.

    Parameters and output follow ``torchvision.transforms.v2.RandomAffine`` / ``F.affine``
    (translations are whole pixels, as torchvision rounds them).

    Args:
        degrees: Rotation range (min, max), or d for (-d, d).
        translate: Maximum shift as a fraction of (width, height), each in [0, 1].
        scale: Scale range (min, max), both > 0.
        shear: Shear range in degrees: s for x in (-s, s), (min, max) for x, or
            (xmin, xmax, ymin, ymax).
        interpolation: "nearest" (torchvision's default) or "bilinear".
        fill: Value (or one per channel) of the area outside the image.
        center: Rotation center (x, y) in pixels; default the image center.
    """

    def __init__(
        self,
        degrees: float | Sequence[float],
        translate: Sequence[float] | None = None,
        scale: Sequence[float] | None = None,
        shear: float | Sequence[float] | None = None,
        interpolation: str = "nearest",
        fill: float | Sequence[float] = 0.0,
        center: Sequence[float] | None = None,
    ) -> None:
        self.degrees = _float_range(degrees, "degrees")
        if translate is not None:
            translate = tuple(float(t) for t in translate)
            if len(translate) != 2 or not all(0.0 <= t <= 1.0 for t in translate):
                raise ValueError(
                    f"translate must be a pair (fx, fy) with values in [0, 1], got {translate!r}"
                )
        self.translate = translate
        if scale is not None:
            scale = _float_range(scale, "scale", lower=0.0)
            if scale[0] <= 0:
                raise ValueError(f"scale values must be > 0, got {scale!r}")
        self.scale = scale
        if shear is not None:
            if isinstance(shear, (int, float)):
                shear = _float_range(shear, "shear")
            else:
                vals = tuple(float(s) for s in shear)
                if len(vals) not in (2, 4):
                    raise ValueError(f"shear must be a number, or 2 or 4 numbers, got {shear!r}")
                _float_range(vals[:2], "shear (x)")
                if len(vals) == 4:
                    _float_range(vals[2:], "shear (y)")
                shear = vals
        self.shear = shear
        if interpolation not in _INTERPOLATIONS:
            raise ValueError(
                f"interpolation must be one of {_INTERPOLATIONS}, got {interpolation!r}"
            )
        self.interpolation = interpolation
        self.fill = _fill_values(fill, "fill")
        if center is not None:
            center = tuple(float(c) for c in center)
            if len(center) != 2:
                raise ValueError(f"center must be a pair (x, y), got {center!r}")
        self.center = center

    def draw(
        self,
        n: int,
        height: int,
        width: int,
        device: torch.device,
        generator: torch.Generator | None,
    ) -> dict[str, torch.Tensor]:
        """Per-sample ``angle``, ``tx``, ``ty``, ``scale``, ``shear_x``, ``shear_y``, each (n,)."""
        u = torch.rand(
            6,
            n,
            generator=generator,
            device=device,
            dtype=torch.float64 if device.type != "mps" else torch.float32,
        )
        lerp = lambda lo, hi, v: lo + (hi - lo) * v  # noqa: E731
        out = {"angle": lerp(*self.degrees, u[0])}
        zero, one = torch.zeros_like(u[0]), torch.ones_like(u[0])
        if self.translate is not None:
            mx, my = float(self.translate[0] * width), float(self.translate[1] * height)
            out["tx"], out["ty"] = (
                torch.round(lerp(-mx, mx, u[1])),
                torch.round(lerp(-my, my, u[2])),
            )
        else:
            out["tx"], out["ty"] = zero, zero
        out["scale"] = lerp(*self.scale, u[3]) if self.scale is not None else one
        out["shear_x"] = (
            lerp(self.shear[0], self.shear[1], u[4]) if self.shear is not None else zero
        )
        out["shear_y"] = (
            lerp(self.shear[2], self.shear[3], u[5])
            if self.shear is not None and len(self.shear) == 4
            else zero
        )
        return out

    def _center(self, height: int, width: int) -> tuple[float, float]:
        if self.center is None:
            return 0.0, 0.0
        return self.center[0] - width * 0.5, self.center[1] - height * 0.5

    def apply(
        self,
        x: torch.Tensor,
        angle: torch.Tensor,
        tx: torch.Tensor,
        ty: torch.Tensor,
        scale: torch.Tensor,
        shear_x: torch.Tensor,
        shear_y: torch.Tensor,
    ) -> torch.Tensor:
        """``F.affine`` of each sample with its own parameters, all at once."""
        _check_batch(x, type(self).__name__)
        cx, cy = self._center(x.shape[-2], x.shape[-1])
        m = _inverse_affine(angle, tx, ty, scale, shear_x, shear_y, cx, cy)
        apply = lambda xs, ms: _affine_batch(xs, ms, self.interpolation, self.fill)  # noqa: E731
        return _keep_format(_chunked(apply, x, m), x)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        _check_batch(x, type(self).__name__)
        return self.apply(x, **self.draw(x.shape[0], x.shape[-2], x.shape[-1], x.device, generator))


class RandomRotation(RandomAffine):
    """Rotate each sample by its own random angle (``torchvision.transforms.v2.RandomRotation``).

    The output keeps the input size (torchvision's ``expand=False``).

    Args:
        degrees: Angle range (min, max), or d for (-d, d); counter-clockwise.
        interpolation: "nearest" (torchvision's default) or "bilinear".
        fill: Value (or one per channel) of the area outside the image.
        center: Rotation center (x, y) in pixels; default the image center.
    """

    def __init__(
        self,
        degrees: float | Sequence[float],
        interpolation: str = "nearest",
        fill: float | Sequence[float] = 0.0,
        center: Sequence[float] | None = None,
    ) -> None:
        super().__init__(degrees, interpolation=interpolation, fill=fill, center=center)

    def apply_angle(self, x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
        """``F.rotate`` of each sample by its own angle (degrees, counter-clockwise)."""
        zero, one = torch.zeros_like(angle), torch.ones_like(angle)
        # torchvision's rotate passes -angle to the same inverse matrix as affine.
        return self.apply(x, -angle, zero, zero, one, zero, zero)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        _check_batch(x, "RandomRotation")
        p = self.draw(x.shape[0], x.shape[-2], x.shape[-1], x.device, generator)
        return self.apply_angle(x, p["angle"])


class ColorJitter(BatchTransform):
    """Random brightness, contrast and saturation per sample, in a random order per sample.

    Follows ``torchvision.transforms.v2.ColorJitter`` (without hue): each factor is drawn
    uniformly from its range and the present adjustments run in a random order.

    Args:
        brightness: b for [max(0, 1 - b), 1 + b], or (min, max); None or 0 to skip.
        contrast: As ``brightness``.
        saturation: As ``brightness``.
    """

    _NAMES = ("brightness", "contrast", "saturation")

    def __init__(
        self,
        brightness: float | Sequence[float] | None = None,
        contrast: float | Sequence[float] | None = None,
        saturation: float | Sequence[float] | None = None,
    ) -> None:
        ranges = []
        for name, value in zip(self._NAMES, (brightness, contrast, saturation), strict=True):
            r = None if value is None else _float_range(value, name, center=1.0, lower=0.0)
            ranges.append(None if r == (1.0, 1.0) else r)
        self.brightness, self.contrast, self.saturation = ranges

    def draw(
        self, n: int, device: torch.device, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample ``(order, factors)``: order (n, 3) a permutation of 0..2 (brightness,
        contrast, saturation), factors (n, 3) float32, 1.0 for adjustments that are off."""
        u = torch.rand(n, 6, generator=generator, device=device)
        order = torch.argsort(u[:, :3], dim=1)
        factors = torch.ones(n, 3, device=device)
        for k, r in enumerate((self.brightness, self.contrast, self.saturation)):
            if r is not None:
                factors[:, k] = r[0] + (r[1] - r[0]) * u[:, 3 + k]
        return order, factors

    def apply(self, x: torch.Tensor, order: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
        """``F.adjust_brightness/contrast/saturation`` per sample, in each sample's order."""
        _check_batch(x, "ColorJitter")
        return _keep_format(_chunked(self._apply, x, order, factors), x)

    def _apply(self, x: torch.Tensor, order: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
        c = x.shape[-3]
        if c not in (1, 3):
            raise ValueError(f"ColorJitter needs 1 or 3 channels, the batch has {c}")
        active = torch.tensor(
            [r is not None for r in (self.brightness, self.contrast, self.saturation)],
            device=x.device,
        )
        fp = x.is_floating_point()
        bound = 1.0 if fp else _MAX_VALUE.get(x.dtype, float(torch.iinfo(x.dtype).max))
        dt = _compute_dtype(x)
        y = _samples(x).to(dt)
        n = y.shape[0]
        view = (n, 1, 1, 1, 1)
        inf = torch.tensor(float("inf"), dtype=dt, device=x.device)
        # Decided on the host from the configuration: no device sync inside the loop.
        use_contrast = self.contrast is not None
        use_saturation = self.saturation is not None and c == 3
        for step in range(3):
            op = order[:, step]
            on = active[op]
            if c == 1:
                # torchvision leaves 1-channel images alone in adjust_saturation.
                on = on & (op != 2)
            # Every adjustment is a blend y * r + other * (1 - r): other is 0 (brightness),
            # the mean of the grayscale image (contrast) or the grayscale image (saturation).
            # Per sample that is y * a + gray * g + mean * m: fused passes for the whole batch.
            ratio = factors.gather(1, op.view(-1, 1)).view(-1)
            rest = (1.0 - ratio.double()).to(dt)
            ratio = ratio.to(dt)
            zero = torch.zeros_like(rest)
            out = y * torch.where(on, ratio, torch.ones_like(ratio)).view(view)
            if use_contrast or use_saturation:
                gray = _gray(y) if c == 3 else y
                if not fp:
                    gray = gray.floor()
                if use_saturation:
                    out.addcmul_(gray, torch.where(on & (op == 2), rest, zero).view(view))
                if use_contrast:
                    mean = gray.mean(dim=(-3, -2, -1), keepdim=True)
                    out.addcmul_(mean, torch.where(on & (op == 1), rest, zero).view(view))
            # Clamp (and truncate, for integer images) only the samples adjusted at this step.
            lo = torch.where(on, zero, -inf).view(view)
            hi = torch.where(on, torch.full_like(ratio, bound), inf).view(view)
            y = torch.clamp(out, lo, hi)
            if not fp:
                y = y.trunc_()
        out = y.view(x.shape).to(x.dtype)
        return _keep_format(out, x)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        _check_batch(x, "ColorJitter")
        return self.apply(x, *self.draw(x.shape[0], x.device, generator))


def _gray(y: torch.Tensor) -> torch.Tensor:
    """torchvision's ``_rgb_to_grayscale_image`` weights, one channel kept: (..., 1, H, W)."""
    r, g, b = y.unbind(dim=-3)
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).unsqueeze(-3)


class RandomErasing(BatchTransform):
    """Erase a random rectangle of each sample with probability ``p`` (as torchvision).

    Args:
        p: Probability of erasing a sample, in [0, 1].
        scale: Range of the erased area as a fraction of the image's.
        ratio: Range of the erased rectangle's aspect ratio (h / w, as torchvision).
        value: Fill: a number, one number per channel, or "random" for standard normal
            noise per pixel (float batches only).
    """

    def __init__(
        self,
        p: float = 0.5,
        scale: Sequence[float] = (0.02, 0.33),
        ratio: Sequence[float] = (0.3, 3.3),
        value: float | Sequence[float] | str = 0.0,
    ) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        self.p = p
        self.scale = _float_range(scale, "scale", lower=0.0, upper=1.0)
        self.ratio = _ratio_range(ratio)
        if isinstance(value, str):
            if value != "random":
                raise ValueError(
                    f"value must be a number, one per channel, or 'random', got {value!r}"
                )
            self.value: list[float] | str = value
        else:
            self.value = _fill_values(value, "value")

    def draw(
        self,
        n: int,
        height: int,
        width: int,
        device: torch.device,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, ...]:
        """Per-sample ``(erase, top, left, h, w)``: erase is bool (n,), the box int64 (n,)."""
        u = torch.rand(n, 10, 4, generator=generator, device=device)
        coin = torch.rand(n, generator=generator, device=device) < self.p
        h, w = _box_attempts(u, height * width, self.scale, self.ratio)
        ok = (h < height) & (w < width)
        top, left, h, w, any_ok = _first_valid_box(u, ok, h, w, height, width)
        return coin & any_ok, top.long(), left.long(), h.long(), w.long()

    def apply(
        self,
        x: torch.Tensor,
        erase: torch.Tensor,
        top: torch.Tensor,
        left: torch.Tensor,
        h: torch.Tensor,
        w: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """``F.erase`` of each sample's box (where ``erase``), all at once."""
        _check_batch(x, "RandomErasing")
        n, c, hh, ww = x.shape[0], x.shape[-3], x.shape[-2], x.shape[-1]
        dev = x.device
        rows = torch.arange(hh, device=dev).view(1, -1)
        cols = torch.arange(ww, device=dev).view(1, -1)
        in_r = (rows >= top.view(-1, 1)) & (rows < (top + h).view(-1, 1))
        in_c = (cols >= left.view(-1, 1)) & (cols < (left + w).view(-1, 1))
        box = (in_r.view(n, hh, 1) & in_c.view(n, 1, ww) & erase.view(n, 1, 1)).view(
            n, 1, 1, hh, ww
        )
        xs = _samples(x)
        if self.value == "random":
            if not x.is_floating_point():
                raise ValueError(
                    "RandomErasing(value='random') needs a float batch; convert with ToDtype first"
                )
            fill = torch.randn((n, 1, c, hh, ww), generator=generator, device=dev).to(x.dtype)
        else:
            if len(self.value) not in (1, c):
                raise ValueError(
                    f"value has {len(self.value)} numbers, the batch has {c} channels; "
                    f"give 1 or {c}"
                )
            fill = torch.tensor(self.value, device=dev).view(1, 1, -1, 1, 1).to(x.dtype)
        out = torch.where(box, fill, xs).view(x.shape)
        return _keep_format(out, x)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        _check_batch(x, "RandomErasing")
        params = self.draw(x.shape[0], x.shape[-2], x.shape[-1], x.device, generator)
        return self.apply(x, *params, generator=generator)


class GaussianNoise(BatchTransform):
    """Add independent Gaussian noise to every pixel (``torchvision.transforms.v2.GaussianNoise``).

    Float batches are taken to be on the [0, 1] scale; uint8 batches get noise scaled by 255,
    as torchvision does.

    Args:
        mean: Mean of the noise.
        sigma: Standard deviation of the noise, >= 0.
        clip: Clamp the result to the valid range ([0, 1], or [0, 255] for uint8).
    """

    def __init__(self, mean: float = 0.0, sigma: float = 0.1, clip: bool = True) -> None:
        if sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {sigma}")
        self.mean, self.sigma, self.clip = float(mean), float(sigma), bool(clip)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        _check_batch(x, "GaussianNoise")
        noise = torch.randn(
            x.shape,
            generator=generator,
            device=x.device,
            dtype=x.dtype if x.is_floating_point() else torch.float32,
        )
        if x.is_floating_point():
            out = x + (self.mean + noise * self.sigma)
            if self.clip:
                out = out.clamp_(0, 1)
        elif x.dtype == torch.uint8:
            out = x + (self.mean * 255 + noise * (self.sigma * 255)).to(torch.int16)
            if self.clip:
                out = out.clamp_(0, 255)
            out = out.to(torch.uint8)
        else:
            raise ValueError(f"GaussianNoise needs a float or uint8 batch, got {x.dtype}")
        return _keep_format(out, x)


class RandomApply(BatchTransform):
    """Apply ``transforms`` (in order) to each sample with probability ``p``, independently.

    The chosen samples are gathered, transformed as one smaller batch, and put back; the
    transforms must keep the shape.

    Args:
        transforms: The ops to apply to the chosen samples.
        p: Probability of choosing a sample, in [0, 1].
    """

    def __init__(self, transforms: Sequence[BatchTransform], p: float = 0.5) -> None:
        if callable(transforms) and not isinstance(transforms, (list, tuple)):
            transforms = [transforms]  # type: ignore[list-item]
        for i, t in enumerate(transforms):
            if not callable(t):
                raise TypeError(f"RandomApply item {i} is a {type(t).__name__}, not a transform")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        self.transforms, self.p = list(transforms), p

    def draw(self, n: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
        """Per-sample decisions (bool, shape (n,))."""
        return torch.rand(n, generator=generator, device=device) < self.p

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        _check_batch(x, "RandomApply")
        idx = torch.nonzero(self.draw(x.shape[0], x.device, generator)).view(-1)
        if idx.numel() == 0:
            return x
        sub = x.index_select(0, idx)
        for t in self.transforms:
            sub = t(sub, generator)
        if sub.shape[1:] != x.shape[1:] or sub.dtype != x.dtype:
            raise ValueError(
                f"RandomApply needs shape- and dtype-preserving transforms: got "
                f"{tuple(sub.shape[1:])} {sub.dtype} from {tuple(x.shape[1:])} {x.dtype}; "
                "put resizing ops outside RandomApply"
            )
        return x.clone().index_copy_(0, idx, sub)  # clone keeps channels_last
