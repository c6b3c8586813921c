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


def _gather_crop(x: torch.Tensor, oy: torch.Tensor, ox: torch.Tensor, th: int, tw: int,
                 flip: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample crop at (oy, ox) of size (th, tw), optionally mirrored, in one gather pass."""
    n, h, w = x.shape[0], x.shape[-2], x.shape[-1]
    mid = x.shape[1:-2]
    dev = x.device
    rows = oy.view(n, 1) + torch.arange(th, device=dev).view(1, th)
    j = torch.arange(tw, device=dev).view(1, tw)
    if flip is not None:
        j = torch.where(flip.view(n, 1), tw - 1 - j, j)
    cols = ox.view(n, 1) + j
    lin = (rows.view(n, th, 1) * w + cols.view(n, 1, tw)).view(n, 1, th * tw)
    flat = x.reshape(n, -1, h * w)
    out = flat.gather(2, lin.expand(n, flat.shape[1], th * tw))
    return out.view(n, *mid, th, tw)


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
        zero = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        return _keep_format(_gather_crop(x, zero, zero, x.shape[-2], x.shape[-1], flip), x)


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
        return _keep_format(_gather_crop(self._pad(x), oy, ox, *self.size, mask), x)


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
