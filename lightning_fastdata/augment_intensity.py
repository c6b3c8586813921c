"""Intensity ops on image fields (medical and natural images, 2-D or 3-D): windowing,
random scale, shift and gamma contrast (MONAI's semantics), Gaussian noise (torchvision's).

They touch image fields only: masks keep their values and dtype, ``other`` fields pass
through. Integer images (int16 CT, uint16 MR) are converted to float32 (values kept, not
scaled) by the ops that need floats; ``ScaleIntensityRange`` is the usual first step.
Per-sample factors are drawn once per sample and shared by all its image fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_fastdata.augment_base import (
    DTYPES,
    Batch,
    BatchTransform,
    bcast,
    finite_float,
    flag,
    float_range,
    float_seq,
    keep_format,
    plain_number,
    probability,
    scratch,
)
from lightning_fastdata.augment_base import _float as _scalar  # this module's _float converts tensors
from lightning_fastdata.augment_crop import cut_windows


def _float(x: torch.Tensor) -> torch.Tensor:
    """Floats stay; integers become float32 with their values."""
    return x if x.is_floating_point() else x.to(torch.float32)


def _float_dtype(dtype: torch.dtype) -> torch.dtype:
    """``_float``'s output dtype."""
    return dtype if dtype.is_floating_point else torch.float32


#: One elementwise step: ("cast", dtype), ("mul", v), ("div", v), ("add", v) or ("clamp",
#: (lo, hi)); v is a Python float (every element) or a (N,) tensor (one value per sample).
Step = tuple[str, Any]

#: On the CPU a chain of steps runs over chunks of about this many elements: a chunk stays in
#: cache between its steps, so the chain costs about one pass over memory (smaller chunks
#: lose more to per-op dispatch than they gain: measured on 4 x 96^3 volumes).
POINTWISE_CHUNK = 1 << 19


class PointwiseIntensity(BatchTransform):
    """An intensity op that is, per sample, a chain of elementwise steps (casts, multiplications
    and additions by a number or a per-sample value, clamps), each one ``torch`` op.

    Subclasses define ``steps(dtype, **params)``; ``Compose`` runs the steps of consecutive
    such ops as one chain (:func:`run_pointwise`): the same ``torch`` ops in the same order
    on the same values, so the output is bit-identical to running the ops one by one.
    """

    moves_pixels = False

    def steps(self, dtype: torch.dtype, **params: Any) -> list[Step]:
        """The steps on an image field of ``dtype``, at the drawn parameters."""
        raise NotImplementedError

    def apply_batch(self, batch: Batch, **params: Any) -> Batch:
        """The steps on every image field."""
        return run_pointwise(batch, [(self, params)])


def run_pointwise(batch: Batch, chain: Sequence[tuple[PointwiseIntensity, dict[str, Any]]]) -> Batch:
    """Run ops (each with its drawn parameters) on every image field as one chain of steps."""
    return batch.map(image=lambda x: _run_steps(x, chain_steps(chain, x.dtype)))


def chain_steps(chain: Sequence[tuple[PointwiseIntensity, dict[str, Any]]], dtype: torch.dtype) -> list[Step]:
    """The steps of ``chain`` (ops with their drawn parameters) on an image field of ``dtype``."""
    steps: list[Step] = []
    for op, params in chain:
        for step in op.steps(dtype, **params):
            if step[0] == "cast":
                dtype = step[1]
            steps.append(step)
    return steps


def _work_steps(steps: list[Step], dtype: torch.dtype) -> tuple[list[Step], torch.dtype]:
    """``steps`` on an input of ``dtype`` as run, and the dtype they end in: starting with a
    copy into a working buffer (a cast to ``dtype`` if need be), casts that keep the dtype
    dropped; the last cast writes into the output."""
    work: list[Step] = [steps[0] if steps and steps[0][0] == "cast" else ("cast", dtype)]
    dtype = work[0][1]
    for kind, value in steps[1:] if steps and steps[0][0] == "cast" else steps:
        if kind == "cast":
            if value == dtype:
                continue
            dtype = value
        work.append((kind, value))
    return work, dtype


def _run_steps(x: torch.Tensor, steps: list[Step]) -> torch.Tensor:
    """A new tensor: ``steps`` on ``x``, in chunks that stay in cache on the CPU."""
    work, dtype = _work_steps(steps, x.dtype)
    out = torch.empty_like(x, dtype=dtype)
    n = x.shape[0]
    if x.device.type != "cpu" or not x.is_contiguous() or not out.is_contiguous() or not x.numel():
        _run_chunk(x, out, work, lambda v: bcast(v, x.ndim))
        return out
    src, dst = x.view(n, -1), out.view(n, -1)
    size = src.shape[1]
    if size <= POINTWISE_CHUNK:
        rows = POINTWISE_CHUNK // size
        for a in range(0, n, rows):
            _run_chunk(src[a:a + rows], dst[a:a + rows], work, lambda v, a=a: v[a:a + rows].view(-1, 1))
        return out
    for i in range(n):
        for c in range(0, size, POINTWISE_CHUNK):
            _run_chunk(src[i, c:c + POINTWISE_CHUNK], dst[i, c:c + POINTWISE_CHUNK], work,
                       lambda v, i=i: v[i:i + 1])
    return out


def pointwise_windows(x: torch.Tensor, offset: torch.Tensor, size: Sequence[int], mirror: torch.Tensor | None,
                      steps: list[Step], rows: torch.Tensor | None = None) -> torch.Tensor:
    """On the CPU, each sample's window of ``x`` at ``offset`` (N, sd), of ``size``, mirrored
    along the spatial axes where ``mirror`` (bool (N, sd), or None) is set, run through
    ``steps`` and written straight into a new tensor: bit-identical to cutting the windows,
    flipping them, then running the steps (each step is elementwise), without the cut
    batch in between, which costs a write and a read of every window.

    ``x`` is (N, ..., *spatial), or, with ``rows`` (int64 (N,)), a whole field whose row
    ``rows[i]`` is sample i. Windows are read in slabs of about ``POINTWISE_CHUNK``
    elements (:func:`~lightning_fastdata.augment_crop.cut_windows`), so each slab stays in
    cache through the steps.
    """
    work, dtype = _work_steps(steps, x.dtype)
    return cut_windows(x, offset, size, mirror, rows, dtype, POINTWISE_CHUNK,
                       lambda part, dst, i: _run_chunk(part, dst, work, lambda v: v[i:i + 1]))


def _run_chunk(src: torch.Tensor, dst: torch.Tensor, steps: list[Step], per_sample: Any) -> None:
    """``steps`` (starting with a cast) from ``src`` into ``dst``, in place on work buffers."""
    last_cast = max(i for i, (kind, _) in enumerate(steps) if kind == "cast")
    cur, pending = src, None
    for i, (kind, value) in enumerate(steps):
        if kind == "cast":
            buf = dst if i == last_cast else scratch(src.numel(), value, src.device).view(src.shape)
            if value == cur.dtype and i + 1 < len(steps) and steps[i + 1][0] != "cast":
                # No conversion: the next step reads ``cur`` and writes the buffer (no copy).
                cur, pending = buf, cur
                continue
            cur = buf.copy_(cur)
            continue
        if isinstance(value, torch.Tensor):
            value = per_sample(value)
        read, pending = (cur if pending is None else pending), None
        if kind == "mul":
            torch.mul(read, value, out=cur)
        elif kind == "div":
            torch.div(read, value, out=cur)
        elif kind == "add":
            torch.add(read, value, out=cur)
        else:
            torch.clamp(read, *value, out=cur)


class ScaleIntensityRange(PointwiseIntensity):
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
        self.a_min, self.a_max, self.b_min, self.b_max = (
            finite_float(v, name) for v, name in ((a_min, "a_min"), (a_max, "a_max"), (b_min, "b_min"),
                                                  (b_max, "b_max")))
        if self.a_max == self.a_min:
            raise ValueError(f"a_min and a_max must differ, got a_min={a_min!r}, a_max={a_max!r}")
        clip = flag(clip, "clip")
        if clip and self.b_min > self.b_max:
            raise ValueError(f"clip needs b_min <= b_max, got b_min={b_min!r}, b_max={b_max!r}")
        if dtype not in DTYPES or not DTYPES[dtype].is_floating_point:
            raise ValueError(f"dtype must be a float dtype name, got {dtype!r}")
        self.clip, self.dtype = clip, dtype

    def steps(self, dtype: torch.dtype) -> list[Step]:  # type: ignore[override]
        """In float64 if the input or output is float64, else float32: MONAI's
        ``(x - a_min) / (a_max - a_min) * (b_max - b_min) + b_min`` (a multiplication by 1
        and an addition of 0 left out), clamped if ``clip``, cast to ``dtype``."""
        target = DTYPES[self.dtype]
        dt = torch.float64 if torch.float64 in (dtype, target) else torch.float32
        # MONAI's operations in its order, not a precomputed ``x * scale + shift``, which put
        # a voxel at a_min (a_max) a rounding off b_min (b_max); a_min and a_max now land
        # exactly, and for b in [0, 1] it is as many steps.
        out: list[Step] = [("cast", dt), ("add", -self.a_min), ("div", self.a_max - self.a_min)]
        if self.b_max - self.b_min != 1.0:
            out.append(("mul", self.b_max - self.b_min))
        if self.b_min != 0.0:
            out.append(("add", self.b_min))
        if self.clip:
            out.append(("clamp", (self.b_min, self.b_max)))
        return [*out, ("cast", target)]

    def apply_batch(self, batch: Batch) -> Batch:  # type: ignore[override]
        """Window every image field."""
        return super().apply_batch(batch)


def _as_given(value: float | Sequence[float], name: str) -> int | float | tuple[float, ...]:
    """A range argument as plain numbers, to check and to keep for the op's repr and saved
    hyperparameters: a number stays one (a numpy scalar or 0-d tensor becomes an int or a
    float), a sequence becomes a tuple (read once: a generator checked, then kept, was kept empty)."""
    if _scalar(value) is not None:
        return plain_number(value, name)
    return float_seq(value, name, "a number or a pair (min, max)")


def _signed_range(value: float | Sequence[float], name: str) -> tuple[float, float]:
    """A number v means (-v, v); a pair is (min, max)."""
    return float_range(value, name)


class _RandomFactor(BatchTransform):
    """Shared draw of the per-sample intensity ops: with probability ``p``, a value uniform
    in ``self.range``; otherwise the neutral value."""

    moves_pixels = False

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


class RandomScaleIntensity(_RandomFactor, PointwiseIntensity):
    """Scale each sample's intensities: ``x * (1 + f)``, f uniform in ``factors``, with
    probability ``p`` (MONAI's ``RandScaleIntensity``). Image fields only.

    Args:
        factors: f for (-f, f), or (min, max).
        p: Probability of scaling a sample.
    """

    def __init__(self, factors: float | Sequence[float], p: float = 1.0) -> None:
        factors = _as_given(factors, "factors")
        super().__init__(_signed_range(factors, "factors"), p)
        self.factors = factors

    def make_params(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``factor``: float64 (N,), 0 for samples left alone."""
        return super().make_params(batch)

    def steps(self, dtype: torch.dtype, factor: torch.Tensor) -> list[Step]:  # type: ignore[override]
        """Integers to float32, then ``x * (1 + factor)`` in that dtype."""
        dt = _float_dtype(dtype)
        return [("cast", dt), ("mul", (1.0 + factor).to(dt))]

    def apply_batch(self, batch: Batch, factor: torch.Tensor) -> Batch:  # type: ignore[override]
        """``x * (1 + factor)`` per sample."""
        return super().apply_batch(batch, factor=factor)


class RandomShiftIntensity(_RandomFactor, PointwiseIntensity):
    """Shift each sample's intensities by an offset uniform in ``offsets``, with
    probability ``p`` (MONAI's ``RandShiftIntensity``). Image fields only.

    Args:
        offsets: o for (-o, o), or (min, max).
        p: Probability of shifting a sample.
    """

    param = "offset"

    def __init__(self, offsets: float | Sequence[float], p: float = 1.0) -> None:
        offsets = _as_given(offsets, "offsets")
        super().__init__(_signed_range(offsets, "offsets"), p)
        self.offsets = offsets

    def make_params(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``offset``: float64 (N,), 0 for samples left alone."""
        return super().make_params(batch)

    def steps(self, dtype: torch.dtype, offset: torch.Tensor) -> list[Step]:  # type: ignore[override]
        """Integers to float32, then ``x + offset`` in that dtype."""
        dt = _float_dtype(dtype)
        return [("cast", dt), ("add", offset.to(dt))]

    def apply_batch(self, batch: Batch, offset: torch.Tensor) -> Batch:  # type: ignore[override]
        """``x + offset`` per sample."""
        return super().apply_batch(batch, offset=offset)


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
        gamma = _as_given(gamma, "gamma")  # a numpy scalar or 0-d tensor too: a number, not read as a pair
        if not isinstance(gamma, tuple):
            top = float(gamma)  # finite (plain_number): nan passed the check below and gave NaN images
            if top <= 0.5:
                raise ValueError(f"gamma as a single number must be > 0.5 (the range is (0.5, gamma)), got {gamma!r}")
            rng = (0.5, top)
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

    moves_pixels = False

    def __init__(self, mean: float = 0.0, sigma: float = 0.1, clip: bool = True) -> None:
        mean, sigma = finite_float(mean, "mean"), finite_float(sigma, "sigma")
        if sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {sigma}")
        self.mean, self.sigma, self.clip = mean, sigma, flag(clip, "clip")

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
