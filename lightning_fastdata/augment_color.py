"""Photometric ops on image fields: dtype conversion, normalisation, colour jitter, erasing.

They touch image fields only: mask fields keep their values and dtype, ``other`` fields
pass through.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_fastdata.augment_base import (
    DTYPES,
    INT_MAX,
    Batch,
    BatchTransform,
    channel_dim,
    chunked,
    compute_dtype,
    const,
    fill_values,
    flag,
    float_range,
    float_seq,
    host_shortcuts,
    keep_format,
    probability,
    refuse_bool_images,
    refuse_unfit_fill,
    samples_view,
)
from lightning_fastdata.augment_resample import box_attempts, first_valid_box
from lightning_fastdata.keys import BoundedCache


def _require_2d(batch: Batch, op: str) -> None:
    if batch.spatial_dims != 2:
        raise ValueError(f"{op} works on 2-D images (N, C, H, W); the batch has {batch.spatial_dims} spatial dims")


def _round_once(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``y`` (float64) as float16/bfloat16, each value the nearest. torch converts through
    float32, and where that rounding lands on a tie of ``dtype`` the second rounding can go
    the wrong way (int16 32759 / 32767 became 1.0, not 0.99951); rounding to odd in float32
    first (an inexact value takes its odd neighbour) keeps it off every tie."""
    f = y.to(torch.float32)
    exact = f.to(torch.float64)
    even = f.view(torch.int32).bitwise_and(1) == 0
    toward_y = torch.where(exact < y, float("inf"), float("-inf")).to(torch.float32)
    return torch.where((exact != y) & even, torch.nextafter(f, toward_y), f).to(dtype)


def to_dtype(x: torch.Tensor, dtype: torch.dtype, scale: bool) -> torch.Tensor:
    """``torchvision.transforms.v2.functional.to_dtype(x, dtype, scale)`` for images.

    Integers scale by their dtype's maximum (uint8 255, int16 32767, uint16 65535, ...).
    Float -> integer multiplies by ``max + 1 - 1e-3`` and truncates as torchvision does, but
    clamps to the integer range first (torchvision wraps values outside [0, 1]).
    Integer -> float16/bfloat16 scales in a wider dtype and rounds once, so every value is
    the nearest of the target dtype; torchvision casts first, which makes uint16 >= 65520 and
    int32 >= 2**20 inf in float16 and is a bit off for int16 and uint16 (uint8 and int8
    results are the same).
    """
    if x.dtype == dtype:
        return x
    if not scale:
        return x.to(dtype)
    if x.is_floating_point():
        if dtype.is_floating_point:
            return x.to(dtype)
        top = INT_MAX[dtype]
        if (x.dtype == torch.float32 and dtype in (torch.int32, torch.int64)) or \
                (x.dtype == torch.float64 and dtype == torch.int64):
            raise ValueError(f"ToDtype cannot convert {x.dtype} to {dtype} with scale=True exactly (as torchvision); "
                             "convert to float64 first, or to a narrower integer")
        low = -top - 1 if dtype.is_signed else 0
        return x.mul(top + 1.0 - 1e-3).clamp_(low, top).to(dtype)
    if dtype.is_floating_point:
        top = INT_MAX[x.dtype]
        if dtype in (torch.float16, torch.bfloat16):
            # Scaled in a wider dtype, rounded once: cast first, uint16 65520+ and int32 2**20+
            # became inf in float16, and the factor itself was rounded. From 8 bits float32
            # gives the nearest value of every input (checked exhaustively), the same as before.
            if top <= 255:
                return x.to(torch.float32).mul_(1.0 / top).to(dtype)
            return _round_once(x.to(torch.float64).div_(top), dtype)
        return x.to(dtype).mul_(1.0 / top)
    # integer -> integer: shift by the difference in value bits, as torchvision.
    bits_in, bits_out = (INT_MAX[d].bit_length() for d in (x.dtype, dtype))
    if bits_in > bits_out:
        if x.dtype == torch.uint16:
            return (x / 2 ** (bits_in - bits_out)).to(dtype)
        return x.bitwise_right_shift(bits_in - bits_out).to(dtype)
    if dtype == torch.uint16:
        return x.to(dtype) * 2 ** (bits_out - bits_in)
    return x.to(dtype).bitwise_left_shift_(bits_out - bits_in)


class ToDtype(BatchTransform):
    """Convert image fields' dtype as ``torchvision.transforms.v2.functional.to_dtype``.

    With ``scale``, integers map to [0, 1] floats by their dtype's maximum (uint8 255,
    int16 32767, uint16 65535, int32 2**31 - 1) and back. Mask fields keep their dtype and
    values; ``other`` fields pass through. Unlike torchvision, integers -> float16/bfloat16
    give the nearest value of the target dtype (torchvision casts before scaling: uint16
    >= 65520 and int32 >= 2**20 became inf in float16); uint8 and int8 results are the same.

    Args:
        dtype: "float32", "float16", "bfloat16", "float64", "uint8", "int16", "uint16",
            "int32" or "int64".
        scale: Rescale between integer and float value ranges.
    """

    moves_pixels = False

    def __init__(self, dtype: str = "float32", scale: bool = True) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.dtype, self.scale = dtype, flag(scale, "scale")

    def apply_batch(self, batch: Batch) -> Batch:
        """Convert every image field."""
        target = DTYPES[self.dtype]
        if self.scale:
            refuse_bool_images(batch, "ToDtype", "with scale=True scales by the input dtype's maximum, which bool "
                                                 "lacks (scale=False maps it to 0/1)")
        return batch.map(image=lambda x: to_dtype(x, target, self.scale))


class Normalize(BatchTransform):
    """Per-channel ``(x - mean) / std`` on image fields; integer images are first scaled to
    [0, 1] by their dtype's maximum, in the same pass. Masks and ``other`` pass through.

    Args:
        mean: One mean per channel (on the [0, 1] scale).
        std: One standard deviation per channel, all > 0.
        dtype: Output dtype for integer input ("float32", "float16", "bfloat16", "float64").
    """

    moves_pixels = False

    def __init__(self, mean: Sequence[float], std: Sequence[float], dtype: str = "float32") -> None:
        self.mean = list(float_seq(mean, "mean", "one number per channel (a sequence)"))
        self.std = list(float_seq(std, "std", "one number per channel (a sequence)"))
        for name, given, values in (("mean", mean, self.mean), ("std", std, self.std)):
            if not all(math.isfinite(v) for v in values):  # NaN or inf would make every pixel NaN or inf
                raise ValueError(f"{name} must be finite, got {given!r}")
        if len(self.mean) != len(self.std) or not self.mean:
            raise ValueError(f"mean and std need one value per channel, got {mean!r} and {std!r}")
        if min(self.std) <= 0:
            raise ValueError(f"std must be > 0, got {std!r}")
        if dtype not in DTYPES or not DTYPES[dtype].is_floating_point:
            raise ValueError(f"dtype must be a float dtype name, got {dtype!r}")
        self.dtype = dtype

    def apply_batch(self, batch: Batch) -> Batch:
        """Normalise every image field: one ``addcmul`` pass, the integer conversion included."""
        refuse_bool_images(batch, "Normalize", "scales integer images by their dtype's maximum, which bool lacks")
        cdim, sd = channel_dim(batch), batch.spatial_dims

        def run(x: torch.Tensor) -> torch.Tensor:
            c = x.shape[cdim]
            if c != len(self.mean):
                raise ValueError(f"Normalize has {len(self.mean)} channel means, the batch has {c} channels")
            out_dtype = x.dtype if x.is_floating_point() else DTYPES[self.dtype]
            in_scale = 1.0 if x.is_floating_point() else 1.0 / INT_MAX[x.dtype]
            scale = [in_scale / s for s in self.std]
            shift = [-m / s for m, s in zip(self.mean, self.std, strict=True)]
            return normalize(x, scale, shift, out_dtype, sd)

        return batch.map(image=run)


#: Whole-plane constants per (values, plane size): one per image size of a ragged stream, a
#: plane as large as an image (3 x 500 x 500 float32 is 3 MB), so bounded in bytes too.
_PLANES: BoundedCache = BoundedCache(32, nbytes=64 << 20)


def _planes(values: Sequence[float], numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Per-channel constants repeated over a whole plane: (C, numel), cached (CPU)."""
    key = (tuple(values), numel, str(device), dtype)
    out = _PLANES.get(key)
    if out is None:
        out = _PLANES.put(key, const(values, device, dtype).view(-1, 1).expand(len(values), numel).contiguous())
    return out


def normalize(x: torch.Tensor, scale: Sequence[float], shift: Sequence[float], out_dtype: torch.dtype,
              sd: int) -> torch.Tensor:
    """``shift + x * scale`` per channel of ``x`` (N, *lead, C, *spatial), a new tensor of
    ``out_dtype`` in ``x``'s memory format: one fused ``addcmul`` pass (integers are
    converted inside it).

    On the CPU the constants span whole planes: a per-channel constant broadcast along the
    innermost loop takes ``addcmul`` off its vectorised path (3-5x slower). The formula,
    hence every output bit, is the same either way.
    """
    out = torch.empty_like(x, dtype=out_dtype)  # same strides as x (channels_last stays)
    xs, os_ = (samples_view(t, sd) for t in (x, out))
    n, lead, c = xs.shape[:3]
    xs, os_ = xs.reshape(n, lead, c, -1), os_.reshape(n, lead, c, -1)
    # float16/bfloat16 output: constants and arithmetic in float32, one rounding at the write
    # (constants rounded to bfloat16 first had errors up to 3x the output's own rounding).
    work = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
    if x.device.type == "cpu":
        plane = xs.shape[-1]
        sh, sc = _planes(shift, plane, x.device, work), _planes(scale, plane, x.device, work)
    else:
        sh = const(shift, x.device, work).view(c, 1)
        sc = const(scale, x.device, work).view(c, 1)
    if os_.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
        torch.addcmul(sh, xs, sc, out=os_)  # a view of out: written in place
    else:  # strides no view can flatten: compute contiguous, then copy
        out.copy_(torch.addcmul(sh, xs, sc).view(x.shape))
    return out


def _gray(y: torch.Tensor) -> torch.Tensor:
    """torchvision's ``_rgb_to_grayscale_image`` weights, one channel kept: (..., 1, H, W)."""
    r, g, b = y.unbind(dim=-3)
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).unsqueeze(-3)


class ColorJitter(BatchTransform):
    """Random brightness, contrast and saturation per sample, in a random order per sample.

    Follows ``torchvision.transforms.v2.ColorJitter`` (without hue): each factor is drawn
    uniformly from its range and the present adjustments run in a random order. 2-D image
    fields with 1 or 3 channels; masks and ``other`` pass through.

    Args:
        brightness: b for [max(0, 1 - b), 1 + b], or (min, max); None or 0 to skip.
        contrast: As ``brightness``.
        saturation: As ``brightness``.
    """

    moves_pixels = False

    _NAMES = ("brightness", "contrast", "saturation")

    def __init__(self, brightness: float | Sequence[float] | None = None,
                 contrast: float | Sequence[float] | None = None,
                 saturation: float | Sequence[float] | None = None) -> None:
        ranges = []
        for name, value in zip(self._NAMES, (brightness, contrast, saturation), strict=True):
            r = None if value is None else float_range(value, name, center=1.0, lower=0.0)
            ranges.append(None if r == (1.0, 1.0) else r)
        self.brightness, self.contrast, self.saturation = ranges

    def make_params(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``order`` (N, 3) int64, a permutation of 0..2 (brightness, contrast, saturation),
        and ``factors`` (N, 3) float32, 1.0 for adjustments that are off."""
        _require_2d(batch, "ColorJitter")
        u = batch.keys.uniform(0, 6)
        order = torch.argsort(u[:, :3], dim=1)
        cols = []
        for k, r in enumerate((self.brightness, self.contrast, self.saturation)):
            cols.append(torch.ones_like(u[:, 0]) if r is None else r[0] + (r[1] - r[0]) * u[:, 3 + k])
        return {"order": order, "factors": torch.stack(cols, dim=1)}

    def apply_batch(self, batch: Batch, order: torch.Tensor, factors: torch.Tensor) -> Batch:
        """``F.adjust_brightness/contrast/saturation`` per sample, in each sample's order."""
        _require_2d(batch, "ColorJitter")
        refuse_bool_images(batch, "ColorJitter", "clamps to the image dtype's value range, which bool lacks")

        def run(x: torch.Tensor) -> torch.Tensor:
            c = x.shape[-3]
            if c not in (1, 3):
                raise ValueError(f"ColorJitter needs 1 or 3 channels, the batch has {c}")
            coef = self._coefficients(order, factors, c, compute_dtype(x),
                                      1.0 if x.is_floating_point() else float(INT_MAX[x.dtype]))
            # On the CPU, whether every sample is adjusted at a step (then the clamp takes
            # scalar bounds): read once per batch from the host.
            every = (coef[:, 3] == 0).all(0).tolist() if host_shortcuts(x.device) else [False] * 3
            return keep_format(chunked(lambda xs, cs: self._run(xs, cs, every), x, coef), x)

        return batch.map(image=run)

    def _coefficients(self, order: torch.Tensor, factors: torch.Tensor, c: int, dt: torch.dtype,
                      bound: float) -> torch.Tensor:
        """Per sample and step (N, 5, 3): the factor of the image, of its grayscale, of the mean
        grayscale, and the clamp bounds (-inf/inf where the step leaves the sample alone).

        Every adjustment is a blend ``y * r + other * (1 - r)``: other is 0 (brightness), the
        mean of the grayscale image (contrast) or the grayscale image (saturation). Computed
        once per batch for the three steps (a few small ops, not a few per step and chunk).
        """
        active = const([r is not None for r in (self.brightness, self.contrast, self.saturation)],
                       order.device, torch.bool)
        on = active[order]
        if c == 1:
            on = on & (order != 2)  # torchvision leaves 1-channel images alone in adjust_saturation
        ratio = factors.gather(1, order)
        rest = (1.0 - ratio.double()).to(dt)
        ratio = ratio.to(dt)
        zero = torch.zeros_like(rest)
        return torch.stack([torch.where(on, ratio, torch.ones_like(ratio)),
                            torch.where(on & (order == 2), rest, zero),
                            torch.where(on & (order == 1), rest, zero),
                            torch.where(on, zero, float("-inf")),
                            torch.where(on, torch.full_like(rest, bound), float("inf"))], dim=1)

    def _run(self, x: torch.Tensor, coef: torch.Tensor, every: list[bool]) -> torch.Tensor:
        c = x.shape[-3]
        fp = x.is_floating_point()
        bound = 1.0 if fp else float(INT_MAX[x.dtype])
        host = host_shortcuts(x.device)
        y = samples_view(x, 2).to(coef.dtype)
        n = y.shape[0]
        view = (n, 1, 1, 1, 1)
        # Decided on the host from the configuration: no device sync inside the loop.
        use_contrast = self.contrast is not None
        use_saturation = self.saturation is not None and c == 3
        for step in range(3):
            scale, sat, con, lo, hi = (coef[:, k, step].view(view) for k in range(5))
            # Per sample y * a + gray * g + mean * m: fused passes for the whole batch.
            out = y * scale
            if use_contrast or use_saturation:
                gray = _gray(y) if c == 3 else y
                if not fp:
                    gray = gray.floor_()
                if use_saturation:
                    out.addcmul_(gray, sat)
                if use_contrast:
                    # Accumulated in float64: a float32 sum's order (so its last bit) depends on
                    # the batch size and the thread count, and a sample's output must not.
                    mean = gray.mean(dim=(-3, -2, -1), keepdim=True, dtype=torch.float64).to(gray.dtype)
                    if host:
                        # Two per-sample factors broadcast along the innermost loop take addcmul off
                        # its vectorised path (5-10x slower on the CPU); a plane of the mean keeps it
                        # on, with the same arithmetic.
                        mean = mean.expand_as(gray).contiguous()
                    out.addcmul_(mean, con)
            # Clamp (and truncate, for integer images) only the samples adjusted at this step.
            y = out.clamp_(0.0, bound) if every[step] else out.clamp_(lo, hi)
            if not fp:
                # floor == trunc here (adjusted values are >= 0, the others already integers);
                # floor is vectorised on the CPU, trunc is not (10x slower).
                y = y.floor_()
        return keep_format(y.view(x.shape).to(x.dtype), x)


class RandomErasing(BatchTransform):
    """Erase a random rectangle of each sample with probability ``p`` (as torchvision), 2-D.

    A photometric op: image fields are erased (every image field of a sample in the same
    box); masks keep their values and ``other`` fields pass through.

    Args:
        p: Probability of erasing a sample, in [0, 1].
        scale: Range of the erased area as a fraction of the image's.
        ratio: Range of the erased rectangle's aspect ratio (h / w, as torchvision).
        value: Fill: a number, one number per channel, or "random" for standard normal
            noise per pixel (float images only).
    """

    moves_pixels = False

    def __init__(self, p: float = 0.5, scale: Sequence[float] = (0.02, 0.33),
                 ratio: Sequence[float] = (0.3, 3.3), value: float | Sequence[float] | str = 0.0) -> None:
        self.p = probability(p)
        self.scale = float_range(scale, "scale", lower=0.0, upper=1.0)
        self.ratio = float_range(ratio, "ratio", lower=0.0)
        if self.ratio[0] <= 0:
            raise ValueError(f"ratio must be > 0, got {ratio!r}")
        if isinstance(value, str):
            if value != "random":
                raise ValueError(f"value must be a number, one per channel, or 'random', got {value!r}")
            self.value: list[float] | str = value
        else:
            self.value = fill_values(value, "value")

    def make_params(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``erase`` bool (N,), the box ``top``, ``left``, ``h``, ``w`` int64 (N,), and with
        ``value="random"`` ``noise``: image field name -> standard normal (N, C, H, W)."""
        _require_2d(batch, "RandomErasing")
        height, width = batch.spatial_size
        u = batch.keys.uniform(0, 41, dtype=torch.float64)
        attempts = u[:, :40].view(-1, 10, 4)
        h, w = box_attempts(attempts, height * width, self.scale, self.ratio)
        ok = (h < height) & (w < width)
        top, left, h, w, any_ok = first_valid_box(attempts, ok, h, w, height, width)
        out = {"erase": (u[:, 40] < self.p) & any_ok, "top": top.long(), "left": left.long(),
               "h": h.long(), "w": w.long()}
        if self.value == "random":
            out["noise"] = {  # type: ignore[assignment]
                name: batch.keys.normal(1 + i, (batch.fields[name].shape[-3], height, width))
                for i, name in enumerate(batch.names("image"))}
        return out

    def apply_batch(self, batch: Batch, erase: torch.Tensor, top: torch.Tensor, left: torch.Tensor,
                    h: torch.Tensor, w: torch.Tensor, noise: dict[str, torch.Tensor] | None = None) -> Batch:
        """``F.erase`` of each sample's box (where ``erase``), all at once."""
        _require_2d(batch, "RandomErasing")
        hh, ww = batch.spatial_size
        dev = batch.device
        n = len(batch)
        rows = torch.arange(hh, device=dev).view(1, -1)
        cols = torch.arange(ww, device=dev).view(1, -1)
        in_r = (rows >= top.view(-1, 1)) & (rows < (top + h).view(-1, 1))
        in_c = (cols >= left.view(-1, 1)) & (cols < (left + w).view(-1, 1))
        box = (in_r.view(n, hh, 1) & in_c.view(n, 1, ww) & erase.view(n, 1, 1)).view(n, 1, 1, hh, ww)
        if self.value != "random":
            # Cast to an integer image, -1 became 255 and 300 became 44 (uint8), silently.
            refuse_unfit_fill(batch, self.value, "RandomErasing", self.value, truncated=True, param="value")
        out = {}
        for name in batch.names("image"):
            x = batch.fields[name]
            c = x.shape[-3]
            if self.value == "random":
                if not x.is_floating_point():
                    raise ValueError("RandomErasing(value='random') needs a float batch; convert with ToDtype first")
                if noise is None or name not in noise:
                    raise ValueError(f"RandomErasing(value='random') needs noise for field {name!r} (from draw)")
                fill = noise[name].view(n, 1, c, hh, ww).to(x.dtype)
            else:
                if len(self.value) not in (1, c):
                    raise ValueError(f"value has {len(self.value)} numbers, the batch has {c} channels; "
                                     f"give 1 or {c}")
                fill = const(self.value, dev, x.dtype if x.is_floating_point() else torch.float64)
                fill = fill.to(x.dtype).view(1, 1, -1, 1, 1)
            out[name] = keep_format(torch.where(box, fill, samples_view(x, 2)).view(x.shape), x)
        return batch.replace(out)


__all__ = ["ColorJitter", "Normalize", "RandomErasing", "ToDtype", "to_dtype"]
