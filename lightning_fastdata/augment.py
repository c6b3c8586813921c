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
from collections.abc import Sequence

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
            return torch.where(flip.view(-1, *[1] * (x.ndim - 1)), x.flip(-1), x)
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
