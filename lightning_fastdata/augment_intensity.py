"""Intensity ops on image fields (medical and natural images, 2-D or 3-D): windowing,
random scale, shift and gamma contrast (MONAI's semantics), Gaussian noise (torchvision's).

They touch image fields only: masks keep their values and dtype, ``other`` fields pass
through. Integer images (int16 CT, uint16 MR) are converted to float32 (values kept, not
scaled) by the ops that need floats; ``ScaleIntensityRange`` is the usual first step.
Per-sample factors are drawn once per sample and shared by all its image fields.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_fastdata.augment_base import (
    DTYPES,
    Batch,
    BatchTransform,
    bcast,
    float_range,
    keep_format,
    probability,
)


def _float(x: torch.Tensor) -> torch.Tensor:
    """Floats stay; integers become float32 with their values."""
    return x if x.is_floating_point() else x.to(torch.float32)


class ScaleIntensityRange(BatchTransform):
    """Window intensities: ``(x - a_min) / (a_max - a_min) * (b_max - b_min) + b_min``, as
    MONAI's ``ScaleIntensityRange`` (e.g. CT Hounsfield units -1000..1000 to 0..1).

    Image fields of any dtype (int16, uint16, floats) become ``dtype``; masks and ``other``
    pass through.

    Args:
        a_min: Input intensity mapped to ``b_min``.
        a_max: Input intensity mapped to ``b_max`` (!= a_min).
        b_min: Output of ``a_min``.
        b_max: Output of ``a_max``.
        clip: Clamp the output to [b_min, b_max].
        dtype: Output dtype: "float32", "float16", "bfloat16" or "float64".
    """

    def __init__(self, a_min: float, a_max: float, b_min: float = 0.0, b_max: float = 1.0, clip: bool = False,
                 dtype: str = "float32") -> None:
        self.a_min, self.a_max, self.b_min, self.b_max = (float(v) for v in (a_min, a_max, b_min, b_max))
        if self.a_max == self.a_min:
            raise ValueError(f"a_min and a_max must differ, got a_min={a_min!r}, a_max={a_max!r}")
        if clip and self.b_min > self.b_max:
            raise ValueError(f"clip needs b_min <= b_max, got b_min={b_min!r}, b_max={b_max!r}")
        if dtype not in DTYPES or not DTYPES[dtype].is_floating_point:
            raise ValueError(f"dtype must be a float dtype name, got {dtype!r}")
        self.clip, self.dtype = bool(clip), dtype

    def apply_batch(self, batch: Batch) -> Batch:
        """Window every image field."""
        scale = (self.b_max - self.b_min) / (self.a_max - self.a_min)
        shift = self.b_min - self.a_min * scale
        target = DTYPES[self.dtype]

        def run(x: torch.Tensor) -> torch.Tensor:
            dt = torch.float64 if torch.float64 in (x.dtype, target) else torch.float32
            out = x.to(dt).mul(scale).add_(shift)  # mul, not mul_: .to may return the input itself
            if self.clip:
                out = out.clamp_(self.b_min, self.b_max)
            return keep_format(out.to(target), x)

        return batch.map(image=run)


def _signed_range(value: float | Sequence[float], name: str) -> tuple[float, float]:
    """A number v means (-v, v); a pair is (min, max)."""
    return float_range(value, name)


class _RandomFactor(BatchTransform):
    """Shared draw of the per-sample intensity ops: with probability ``p``, a value uniform
    in ``self.range``; otherwise the neutral value."""

    neutral = 0.0
    param = "factor"

    def __init__(self, value_range: tuple[float, float], p: float) -> None:
        self.p = probability(p)
        self._range = value_range

    def make_params(self, batch: Batch) -> dict[str, torch.Tensor]:
        u = batch.keys.uniform(0, 2, dtype=torch.float64)
        lo, hi = self._range
        value = lo + (hi - lo) * u[:, 1]
        return {self.param: torch.where(u[:, 0] < self.p, value, torch.full_like(value, self.neutral))}


class RandomScaleIntensity(_RandomFactor):
    """Scale each sample's intensities: ``x * (1 + f)``, f uniform in ``factors``, with
    probability ``p`` (MONAI's ``RandScaleIntensity``). Image fields only.

    Args:
        factors: f for (-f, f), or (min, max).
        p: Probability of scaling a sample.
    """

    def __init__(self, factors: float | Sequence[float], p: float = 1.0) -> None:
        super().__init__(_signed_range(factors, "factors"), p)
        self.factors = factors

    def make_params(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``factor``: float64 (N,), 0 for samples left alone."""
        return super().make_params(batch)

    def apply_batch(self, batch: Batch, factor: torch.Tensor) -> Batch:
        """``x * (1 + factor)`` per sample."""
        def run(x: torch.Tensor) -> torch.Tensor:
            y = _float(x)
            return keep_format(y * bcast((1.0 + factor).to(y.dtype), y.ndim), x)

        return batch.map(image=run)


class RandomShiftIntensity(_RandomFactor):
    """Shift each sample's intensities by an offset uniform in ``offsets``, with
    probability ``p`` (MONAI's ``RandShiftIntensity``). Image fields only.

    Args:
        offsets: o for (-o, o), or (min, max).
        p: Probability of shifting a sample.
    """

    param = "offset"

    def __init__(self, offsets: float | Sequence[float], p: float = 1.0) -> None:
        super().__init__(_signed_range(offsets, "offsets"), p)
        self.offsets = offsets

    def make_params(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``offset``: float64 (N,), 0 for samples left alone."""
        return super().make_params(batch)

    def apply_batch(self, batch: Batch, offset: torch.Tensor) -> Batch:
        """``x + offset`` per sample."""
        def run(x: torch.Tensor) -> torch.Tensor:
            y = _float(x)
            return keep_format(y + bcast(offset.to(y.dtype), y.ndim), x)

        return batch.map(image=run)


class RandomAdjustContrast(_RandomFactor):
    """Gamma contrast per sample, as MONAI's ``RandAdjustContrast``:
    ``((x - min) / (range + 1e-7)) ** gamma * range + min`` over each sample's image
    (min and range over all its channels), with gamma uniform in ``gamma``, with
    probability ``p``. Image fields only; computed in float64 and returned as float
    (integers become float32).

    Args:
        gamma: (min, max), both > 0; a number g > 0.5 means (0.5, g) as in MONAI.
        p: Probability of adjusting a sample.
    """

    neutral = 1.0
    param = "gamma"

    def __init__(self, gamma: float | Sequence[float] = (0.5, 4.5), p: float = 1.0) -> None:
        if isinstance(gamma, (int, float)) and not isinstance(gamma, bool):
            if gamma <= 0.5:
                raise ValueError(f"gamma as a single number must be > 0.5 (the range is (0.5, gamma)), got {gamma!r}")
            rng = (0.5, float(gamma))
        else:
            rng = float_range(gamma, "gamma", lower=0.0)
            if rng[0] <= 0:
                raise ValueError(f"gamma must be > 0, got {gamma!r}")
        super().__init__(rng, p)
        self.gamma = gamma

    def make_params(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``gamma``: float64 (N,), exactly 1.0 for samples left alone (they are not touched)."""
        return super().make_params(batch)

    def apply_batch(self, batch: Batch, gamma: torch.Tensor) -> Batch:
        """The gamma curve per sample, where ``gamma != 1``."""
        def run(x: torch.Tensor) -> torch.Tensor:
            y = _float(x)
            n = y.shape[0]
            flat = y.reshape(n, -1)
            lo = flat.amin(dim=1).to(torch.float64)
            span = flat.amax(dim=1).to(torch.float64) - lo
            # float64: the result of pow does not depend on where a sample sits in the batch.
            z = (y.to(torch.float64) - bcast(lo, y.ndim)) / bcast(span + 1e-7, y.ndim)
            z = z.pow(bcast(gamma, y.ndim)).mul_(bcast(span, y.ndim)).add_(bcast(lo, y.ndim)).to(y.dtype)
            return keep_format(torch.where(bcast(gamma != 1.0, y.ndim), z, y), x)

        return batch.map(image=run)


class GaussianNoise(BatchTransform):
    """Add independent Gaussian noise to every pixel (``torchvision.transforms.v2.GaussianNoise``).

    Float images are taken to be on the [0, 1] scale when ``clip`` (use ``clip=False`` for
    unbounded data such as windowed CT); uint8 images get noise scaled by 255, as
    torchvision does. Image fields only (each its own noise); masks and ``other`` pass
    through. The noise is keyed by the sample and the element.

    Args:
        mean: Mean of the noise.
        sigma: Standard deviation of the noise, >= 0.
        clip: Clamp the result to the valid range ([0, 1], or [0, 255] for uint8).
    """

    def __init__(self, mean: float = 0.0, sigma: float = 0.1, clip: bool = True) -> None:
        if sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {sigma}")
        self.mean, self.sigma, self.clip = float(mean), float(sigma), bool(clip)

    def make_params(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``noise``: image field name -> standard normal draws of the field's shape (float32)."""
        out = {}
        for i, name in enumerate(batch.names("image")):
            x = batch.fields[name]
            if not (x.is_floating_point() or x.dtype == torch.uint8):
                raise ValueError(f"GaussianNoise needs float or uint8 images, field {name!r} is {x.dtype}; "
                                 "convert first (ScaleIntensityRange or ToDtype)")
            out[name] = batch.keys.normal(i, x.shape[1:])
        return {"noise": out}  # type: ignore[dict-item]

    def apply_batch(self, batch: Batch, noise: dict[str, torch.Tensor]) -> Batch:  # type: ignore[override]
        """``x + mean + sigma * noise`` per element (clamped when ``clip``)."""
        out = {}
        for name in batch.names("image"):
            x = batch.fields[name]
            z = noise[name]
            if x.is_floating_point():
                y = x + (self.mean + z.to(x.dtype) * self.sigma)
                if self.clip:
                    y = y.clamp_(0, 1)
            elif x.dtype == torch.uint8:
                y = x + (self.mean * 255 + z * (self.sigma * 255)).to(torch.int16)
                if self.clip:
                    y = y.clamp_(0, 255)
                y = y.to(torch.uint8)
            else:
                raise ValueError(f"GaussianNoise needs float or uint8 images, field {name!r} is {x.dtype}; "
                                 "convert first (ScaleIntensityRange or ToDtype)")
            out[name] = keep_format(y, x)
        return batch.replace(out)


__all__ = ["GaussianNoise", "RandomAdjustContrast", "RandomScaleIntensity", "RandomShiftIntensity",
           "ScaleIntensityRange"]
