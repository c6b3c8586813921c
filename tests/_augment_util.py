"""Shared helpers of the augmentation tests: batches, keys, tolerances and distribution checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_fastdata import augment_base
from lightning_fastdata.keys import SampleKeys


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def images(n: int = 6, shape=(3, 20, 24), dtype=torch.uint8, seed: int = 0) -> torch.Tensor:
    """Random uint8 images, or the same as floats in [0, 1]."""
    x = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=gen(seed))
    return x if dtype == torch.uint8 else x.to(dtype) / 255


def keys(n: int, seed: int = 0, epoch: int = 0, start: int = 0) -> SampleKeys:
    """Keys of samples ``start .. start + n - 1``."""
    return SampleKeys(seed, epoch, torch.arange(start, start + n))


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """uint8 within 1 (torch's fixed-point uint8 kernels round differently), floats within 1e-5."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    tol = 1.0 if a.dtype == torch.uint8 else 1e-5
    assert (a.double() - b.double()).abs().max().item() <= tol


def ks(a, b) -> float:
    """Two-sample Kolmogorov-Smirnov statistic."""
    a, b = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    grid = np.concatenate([a, b])
    return float(np.abs(np.searchsorted(a, grid, "right") / a.size - np.searchsorted(b, grid, "right") / b.size).max())


def ks_ok(a, b) -> bool:
    # Critical value at alpha = 1e-4 (c = 2.15): a false alarm once in 10,000 runs.
    n, m = len(a), len(b)
    return ks(a, b) < 2.15 * math.sqrt((n + m) / (n * m))


def tv_params(transform, n: int, shape=(3, 20, 24), seed: int = 1) -> list[dict]:
    """torchvision's own parameter draws for ``n`` samples."""
    torch.manual_seed(seed)
    img = torch.zeros(shape, dtype=torch.uint8)
    return [transform.make_params([img]) for _ in range(n)]


def within_binomial(count: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1


@pytest.fixture(params=["cpu-shortcuts", "accelerator-path"])
def both_paths(request, monkeypatch):
    """Run a test on the CPU's host shortcuts (nonzero) and on the sync-free accelerator code."""
    monkeypatch.setattr(augment_base, "HOST_SHORTCUTS", request.param == "cpu-shortcuts")
    return request.param


#: Sample sizes of the ragged-batch tests: portrait, landscape, square, tiny and wide.
RAGGED_SIZES = [(40, 30), (25, 61), (33, 33), (80, 20), (18, 50), (21, 22)]


def ragged(sizes=RAGGED_SIZES, dtype=torch.uint8, channels: int = 3, seed: int = 0) -> list[torch.Tensor]:
    """Images of varying sizes (a ragged batch, as decoded JPEGs come)."""
    out = []
    for i, (h, w) in enumerate(sizes):
        x = images(1, shape=(channels, h, w), seed=seed + i)[0]
        out.append(x if dtype == torch.uint8 else x.to(dtype) / 255)
    return out


def ragged_masks(sizes=RAGGED_SIZES) -> list[torch.Tensor]:
    """Label maps (H, W) aligned with ``ragged(sizes)``, int64 with values 0..6."""
    return [(torch.arange(h * w).view(h, w) * 7 // 5) % 7 for h, w in sizes]


@pytest.fixture(params=["mirror-in-cut", "mirror-after-cut", "per-sample-windows"])
def mirror_regimes(request, monkeypatch):
    """Run a test with every window mirrored along the last axis inside the cut (mirrored
    sources, as for small windows), after it (in place, as for large windows), and, on the
    CPU, with every unpadded mirrored volume window, or window run into an intensity chain,
    cut sample by sample in slabs (``cut_windows``, as for large volume windows)."""
    from lightning_fastdata import augment_crop

    monkeypatch.setattr(augment_crop, "MIRROR_AFTER_ELEMENTS", 1 << 62 if request.param == "mirror-in-cut" else 0)
    monkeypatch.setattr(augment_crop, "WINDOWS_FROM_ELEMENTS", 0 if request.param == "per-sample-windows" else 1 << 62)
    return request.param
