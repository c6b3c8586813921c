"""SampleKeys: a pure function of (seed, stream, epoch, index, path, slot, counter), equal to a
pure-Python splitmix64 reference on both engines, uniform, independent, batch-independent."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_fastdata import keys as K
from lightning_fastdata.keys import SampleKeys

M64 = (1 << 64) - 1
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def ref_mix(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * MIX1) & M64
    z = ((z ^ (z >> 27)) * MIX2) & M64
    return z ^ (z >> 31)


def ref_bits(seed: int, stream: int, epoch: int, path: tuple[int, ...], slot: int, index: int, j: int) -> int:
    """The documented construction, written out with Python integers (no package code)."""
    h = 0
    for part in (seed, stream, epoch, len(path), *path, slot):
        h = ref_mix((h ^ (part & M64)) + GOLDEN)
    scrambled = ref_mix(index * GOLDEN + GOLDEN)
    return ref_mix(((scrambled ^ h) + (j + 1) * GOLDEN) & M64)


@pytest.fixture(params=["numpy", "torch"])
def engine(request, monkeypatch):
    """Both hash engines: numpy's (the CPU default) and int64 torch ops (every other device)."""
    monkeypatch.setattr(K, "USE_NUMPY_ON_CPU", request.param == "numpy")
    return request.param


INDICES = [0, 1, 5, 2**31 + 7, 2**40 - 3, 2**62 + 11, -1, -(2**63)]


@pytest.mark.parametrize("seed, stream, epoch", [(0, 0, 0), (42, 1, 7), (2**63 + 5, 3, 2**40),
                                                  (2**64 - 3, 2**64 - 1, 1)])
def test_bits_equal_the_python_reference(engine, seed, stream, epoch):
    keys = SampleKeys(seed, epoch, torch.tensor(INDICES), stream=stream)
    for path in [(), (3,), (0, 2, 1)]:
        k = keys
        for p in path:
            k = k.child(p)
        for slot in (0, 1, 9):
            got = k.bits(slot, 3)
            single = k.bits(slot)
            for n, idx in enumerate(INDICES):
                for j in range(3):
                    assert int(got[n, j]) & M64 == ref_bits(seed, stream, epoch, path, slot, idx, j)
                assert int(single[n]) & M64 == ref_bits(seed, stream, epoch, path, slot, idx, 0)


def test_conversions_equal_the_python_reference(engine):
    seed, epoch, slot = 11, 2, 4
    keys = SampleKeys(seed, epoch, torch.tensor(INDICES))
    u32 = keys.uniform(slot, 3)
    u64 = keys.uniform(slot, 3, dtype=torch.float64)
    z = keys.normal(slot, (3,))
    r = keys.randint(slot, 2, 9)
    r_t = keys.randint(slot, 0, torch.tensor([1, 2, 3, 50, 7, 1000, 3, 2**33]))
    highs = [3, 1, 2**40]
    ints = keys.integers(slot, highs)
    coins = keys.bernoulli(slot, 0.3, 3)
    coin = keys.bernoulli(slot, 0.6)
    for n, idx in enumerate(INDICES):
        for j in range(3):
            v = ref_bits(seed, 0, epoch, (), slot, idx, j)
            assert u32[n, j].item() == (v >> 40) / 2**24
            assert u32.dtype == torch.float32
            assert u64[n, j].item() == (v >> 11) / 2**53
            assert ints[n, j].item() == min(math.floor((v >> 11) / 2**53 * highs[j]), highs[j] - 1)
            assert coins[n, j].item() == ((v >> 11) / 2**53 < 0.3)
            hi, lo = v >> 32, v & 0xFFFFFFFF
            ref = math.sqrt(-2.0 * math.log((hi + 1) / 2**32)) * math.cos(2.0 * math.pi * lo / 2**32)
            assert abs(z[n, j].item() - ref) <= 1e-6 * max(1.0, abs(ref))
        v0 = ref_bits(seed, 0, epoch, (), slot, idx, 0)
        assert coin[n].item() == ((v0 >> 11) / 2**53 < 0.6)
        assert r[n].item() == 2 + math.floor((v0 >> 11) / 2**53 * 7)
        high = [1, 2, 3, 50, 7, 1000, 3, 2**33][n]
        assert r_t[n].item() == math.floor((v0 >> 11) / 2**53 * high)


def test_engines_agree_bit_for_bit(monkeypatch):
    keys = SampleKeys(5, 3, torch.arange(1000) * 977)
    out = {}
    for use_numpy in (True, False):
        monkeypatch.setattr(K, "USE_NUMPY_ON_CPU", use_numpy)
        k = SampleKeys(5, 3, keys.index).child(2)
        out[use_numpy] = (k.bits(1, 5), k.uniform(2, 4), k.uniform(3, dtype=torch.float64), k.normal(4, (2, 3)),
                          k.randint(5, -3, torch.arange(1000) % 17 + 1), k.bernoulli(6, 0.3),
                          k.bernoulli(7, 0.7, 3), k.integers(8, [5, 1, 2**33]))
    for a, b in zip(out[True], out[False], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _ks_uniform(u: np.ndarray) -> float:
    u = np.sort(u)
    n = u.size
    return float(max((np.arange(1, n + 1) / n - u).max(), (u - np.arange(n) / n).max()))


def _ks_normal(z: np.ndarray) -> float:
    cdf = np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) for v in np.sort(z)])
    return _ks_uniform(cdf)


def test_uniforms_and_normals_have_the_right_distribution():
    n = 20_000
    keys = SampleKeys(1, 0, torch.arange(n))
    crit = 1.95 / math.sqrt(n)  # alpha = 0.1% one-sample KS
    for dtype in (torch.float32, torch.float64):
        u = keys.uniform(0, dtype=dtype)
        assert u.dtype == dtype and 0.0 <= u.min().item() and u.max().item() < 1.0
        assert _ks_uniform(u.numpy()) < crit
    assert _ks_uniform(keys.uniform(1, 7)[:, 6].numpy()) < crit  # a later counter, too
    z = keys.normal(2, (2,))
    assert z.shape == (n, 2)
    assert _ks_normal(z[:, 0].numpy()) < crit and _ks_normal(z[:, 1].numpy()) < crit
    assert abs(z.mean().item()) < 0.03 and abs(z.std().item() - 1) < 0.03
    big = SampleKeys(1, 0, torch.arange(4)).normal(3, (3, 64, 64))
    assert abs(big.mean().item()) < 0.03 and abs(big.std().item() - 1) < 0.03


def _independent(a: torch.Tensor, b: torch.Tensor) -> None:
    """Correlation near 0 and a flat joint histogram (4 x 4 cells, chi-square)."""
    a, b = a.double().flatten(), b.double().flatten()
    n = a.numel()
    r = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(r) < 5 / math.sqrt(n), r
    cells = (torch.floor(a * 4) * 4 + torch.floor(b * 4)).long()
    counts = torch.bincount(cells, minlength=16).double()
    chi2 = ((counts - n / 16) ** 2 / (n / 16)).sum().item()
    assert chi2 < 45, chi2  # 15 degrees of freedom: p ~ 1e-4


def test_draws_are_independent_across_every_key_part():
    n = 20_000
    idx = torch.arange(n)
    base = SampleKeys(7, 3, idx)
    u = base.uniform(0)
    _independent(u, base.uniform(1))                          # slots
    _independent(u, base.child(0).uniform(0))                 # op positions
    _independent(base.child(0).uniform(0), base.child(1).uniform(0))
    _independent(base.child(0).child(1).uniform(0), base.child(1).child(0).uniform(0))
    _independent(u, SampleKeys(7, 4, idx).uniform(0))         # epochs
    _independent(u, SampleKeys(8, 3, idx).uniform(0))         # seeds
    _independent(u, SampleKeys(7, 3, idx, stream=1).uniform(0))  # streams
    _independent(u, SampleKeys(7, 3, idx + 1).uniform(0))     # neighbouring samples
    pair = base.uniform(2, 2)
    _independent(pair[:, 0], pair[:, 1])                      # counters
    z = base.normal(3, (2,))
    assert abs(torch.corrcoef(z.T)[0, 1].item()) < 5 / math.sqrt(n)


def test_a_sample_draws_the_same_whatever_its_batch(engine):
    alone = SampleKeys(3, 1, torch.tensor([5])).child(2)
    inside = SampleKeys(3, 1, torch.tensor([9, 5, 2])).child(2)
    assert torch.equal(alone.bits(0, 4)[0], inside.bits(0, 4)[1])
    assert torch.equal(alone.uniform(1, 3)[0], inside.uniform(1, 3)[1])
    assert torch.equal(alone.uniform(1, dtype=torch.float64)[0], inside.uniform(1, dtype=torch.float64)[1])
    assert torch.equal(alone.normal(2, (3, 5))[0], inside.normal(2, (3, 5))[1])
    assert torch.equal(alone.randint(3, 0, torch.tensor([77]))[0], inside.randint(3, 0, torch.tensor([4, 77, 9]))[1])
    assert torch.equal(alone.bernoulli(4, 0.5)[0], inside.bernoulli(4, 0.5)[1])
    # a subset keeps its rows' draws, scrambled indices computed before or after
    full = SampleKeys(3, 1, torch.tensor([9, 5, 2]))
    full.uniform(0)
    rows = torch.tensor([2, 1])
    assert torch.equal(full.take(rows).child(2).uniform(1, 3), inside.uniform(1, 3)[rows])
    assert torch.equal(SampleKeys(3, 1, torch.tensor([9, 5, 2])).take(rows).uniform(0), full.uniform(0)[rows])


def test_randint_is_uniform_and_respects_per_sample_bounds():
    n = 30_000
    keys = SampleKeys(0, 0, torch.arange(n))
    r = keys.randint(0, 3, 9)
    counts = torch.bincount(r - 3, minlength=6)
    assert r.dtype == torch.int64 and counts.numel() == 6
    assert all(abs(c - n / 6) < 5 * math.sqrt(n / 6) for c in counts.tolist())
    high = torch.arange(n) % 5 + 1
    rt = keys.randint(1, 0, high)
    assert bool((rt >= 0).all()) and bool((rt < high).all())
    assert torch.equal(keys.randint(2, 4, torch.full((n,), 4)), torch.full((n,), 4))  # empty range: low
    coins = keys.bernoulli(3, 0.3)
    assert coins.dtype == torch.bool and abs(coins.sum().item() - 0.3 * n) < 5 * math.sqrt(n * 0.21)
    assert not keys.bernoulli(4, 0.0).any() and keys.bernoulli(4, 1.0).all()
    cols = keys.integers(5, [4, 7, 0])
    assert cols.shape == (n, 3) and cols.dtype == torch.int64 and not cols[:, 2].any()
    for j, high in enumerate((4, 7)):
        counts = torch.bincount(cols[:, j], minlength=high)
        assert counts.numel() == high and all(abs(c - n / high) < 5 * math.sqrt(n / high) for c in counts.tolist())


def test_randint_with_an_empty_range_gives_low_for_tensor_bounds_too(engine):
    # Documented: where high <= low the result is low. A tensor bound below low (an empty
    # range, e.g. a window larger than its image) used to give values below low.
    n = 1000
    keys = SampleKeys(0, 0, torch.arange(n))
    low = torch.full((n,), 5)
    for got in (keys.randint(0, 5, torch.full((n,), 2)), keys.randint(0, low, 2), keys.randint(0, low, low - 3)):
        assert torch.equal(got, low), (got.min().item(), got.max().item())
    mixed = keys.randint(1, 0, torch.tensor([-4, 0, 1, 3] * (n // 4)))
    assert bool((mixed[0::4] == 0).all() and (mixed[1::4] == 0).all() and (mixed[2::4] == 0).all())
    assert bool(((mixed[3::4] >= 0) & (mixed[3::4] < 3)).all())


def test_for_batch_and_children():
    k = SampleKeys.for_batch(4, "cpu", seed=2, epoch=1)
    assert torch.equal(k.index, torch.arange(4)) and len(k) == 4 and k.device.type == "cpu"
    assert k.child(1).path == (1,) and k.child(1).child(0).path == (1, 0)
    assert not torch.equal(k.uniform(0), k.child(0).uniform(0))
    assert torch.equal(k.child(1).uniform(0), SampleKeys(2, 1, torch.arange(4), path=(1,)).uniform(0))
    assert "seed=2" in repr(k)


@pytest.mark.parametrize("make, match", [
    (lambda: SampleKeys(0, 0, torch.rand(3)), "integer tensor"),
    (lambda: SampleKeys(0, 0, torch.zeros(2, 2, dtype=torch.long)), "1-D"),
    (lambda: SampleKeys(0, 0, [1, 2]), "1-D integer tensor"),
    (lambda: SampleKeys(True, 0, torch.arange(2)), "seed"),
    (lambda: SampleKeys(1 << 64, 0, torch.arange(2)), r"seed must be in \[0, 2\*\*64\), got 18446744073709551616"),
    (lambda: SampleKeys(0, 0, torch.arange(2), stream=-1), r"stream must be in \[0, 2\*\*64\), got -1"),
    (lambda: SampleKeys(0, 1.5, torch.arange(2)), "epoch"),
    (lambda: SampleKeys.for_batch(2).uniform(0, dtype=torch.float16), "float32 or torch.float64"),
])
def test_bad_arguments_are_refused(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make()


def test_numpy_integers_key_as_the_ints_they_equal():
    """np.int64 seeds (a sweep's, np.arange's) were refused; they draw what the plain ints draw."""
    index = torch.arange(5)
    k = SampleKeys(np.int64(7), np.int64(1), index, stream=np.uint64(2))
    assert (k.seed, k.epoch, k.stream) == (7, 1, 2) and {type(k.seed), type(k.epoch), type(k.stream)} == {int}
    assert torch.equal(k.uniform(0), SampleKeys(7, 1, index, stream=2).uniform(0))
    with pytest.raises(TypeError, match="seed must be an int, got np.True_"):
        SampleKeys(np.bool_(True), 0, index)


def test_counter_caches_stay_bounded_over_many_sizes(engine):
    """One element count per image size (``normal`` over a ragged list's sizes) and one range
    per size (``integers``) no longer pile up: the caches stay within their entries and bytes,
    and draws after the caches were emptied many times equal the Python reference."""
    keys = SampleKeys(3, 1, torch.tensor([0, 7, 2**40]))
    few = [(3, 8, 9), (1, 31, 17), (3, 36, 36)]
    before = [keys.normal(2, shape) for shape in few]
    for h in range(8, 37):
        for w in range(8, 37):
            keys.normal(2, (3, h, w))
            keys.integers(4, [h, w])
    for cache in (K._COUNTERS_NP, K._COUNTERS):
        assert len(cache) <= 64 and cache.entries == 64
        assert cache.held == sum(K._nbytes(v) for v in cache.values()) <= cache.nbytes == 1 << 20
    assert len(K._HOST_CONSTANTS) <= 256
    for shape, first in zip(few, before, strict=True):
        assert torch.equal(keys.normal(2, shape), first)
    bits = keys.bits(5, 3 * 36 * 36)
    for j in (0, 1, 3887):
        assert int(bits[2, j]) & M64 == ref_bits(3, 0, 1, (), 5, 2**40, j)


def test_bounded_cache_keeps_what_a_cuda_graph_captured(monkeypatch):
    """Past its entries or bytes the cache empties, but entries read during a CUDA graph
    capture stay: the graph reads their memory at every replay (faked here on the CPU)."""
    cache = K.BoundedCache(4, nbytes=100)
    kept = torch.zeros(2)
    monkeypatch.setattr(K, "_in_capture", lambda value: value is kept)
    cache.put("kept", kept)
    for i in range(10):
        cache.put(i, torch.zeros(3))
        assert len(cache) <= 4 and cache.held <= 100 and cache["kept"] is kept
    assert set(cache) == {"kept", 9} and cache.held == 20
    cache.put("big", torch.zeros(21))  # 84 bytes: past the budget with the 20 held
    assert set(cache) == {"kept", "big"} and cache.held == 92
