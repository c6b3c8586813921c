"""Counter-based randomness keyed by the sample: no generator state, no host sync.

Every random number an augmentation draws is a pure function of
``(seed, stream, epoch, global sample index, op path, slot, element counter)``:

- the scalar parts (seed, stream, epoch, the op's path inside ``Compose``/``RandomApply``,
  the draw slot) are folded on the host, in Python integers, into one 64-bit constant ``H``;
- each sample's index is scrambled once per batch on the device: ``I = mix(index * G + G)``;
- element ``j`` of a draw is ``mix((I ^ H) + (j + 1) * G)``: a splitmix64 sequence started
  at ``I ^ H``.

``mix`` is the splitmix64 finaliser and ``G`` its golden-ratio increment. On accelerators
it is int64 tensor arithmetic (multiplication and addition wrap modulo 2**64, logical
right shifts are arithmetic shifts with the sign bits masked off), so it runs on the
device with no host round trip; on the CPU the same bits come from numpy's uint64 ops
(fewer, faster dispatches). A sample gets the same numbers whatever batch it sits in,
whatever the batch size, world size, strategy or resume point. ``H`` folds
``(seed, stream, epoch, len(path), *path, slot)`` in that order.

The epoch may also be a 0-d integer tensor on the index's device (a CUDA graph's input:
a captured graph replays with whatever epoch the tensor holds). Then the fold continues
on the device from ``epoch`` on, with the same integer hashing, and every draw takes the
torch path: the bits equal the host-folded ones exactly.

Conversions: uniforms take the top 24 bits (float32) or 53 bits (float64); normals use
Box-Muller on the two 32-bit halves of one value, in float64 (tails to 6.6 sigma);
``randint`` is ``floor(u * (high - low)) + low`` with a float64 ``u``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch

from lightning_fastdata._util import as_int

_MASK64 = (1 << 64) - 1
#: splitmix64 constants, as unsigned integers (the reference) and as int64 (the tensors).
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB


def _signed(v: int) -> int:
    """The int64 with the same 64 bits as the unsigned ``v``."""
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


_GOLDEN_S, _MIX1_S, _MIX2_S = _signed(GOLDEN), _signed(MIX1), _signed(MIX2)


def mix64(z: int) -> int:
    """splitmix64's finaliser on a Python integer (the reference the tensors must equal)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * MIX2) & _MASK64
    return z ^ (z >> 31)


def fold(*parts: int) -> int:
    """Fold integers (each taken modulo 2**64) into one 64-bit value, order-sensitive."""
    h = 0
    for p in parts:
        h = mix64((h ^ (p & _MASK64)) + GOLDEN)
    return h


@functools.lru_cache(maxsize=4096)
def _fold_cached(parts: tuple[int, ...]) -> int:
    # Every batch asks for the same few (seed, stream, epoch, path) prefixes.
    return fold(*parts)


def _xorshift_(z: torch.Tensor, s: int) -> torch.Tensor:
    """``z ^= z >>> s`` (logical shift) in place on int64."""
    return z.bitwise_xor_(torch.bitwise_right_shift(z, s).bitwise_and_((1 << (64 - s)) - 1))


def mix64_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on an int64 tensor, in place (wrapping arithmetic), any device."""
    _xorshift_(z, 30).mul_(_MIX1_S)
    _xorshift_(z, 27).mul_(_MIX2_S)
    return _xorshift_(z, 31)


def mix64_np_(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array, in place (numpy's shifts are logical)."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(MIX1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(MIX2)
    z ^= z >> np.uint64(31)
    return z


class BoundedCache(dict):
    """A dict of small constants (tensors or arrays) made once per key, emptied when a new
    entry would take it past ``entries`` keys or ``nbytes`` bytes.

    Keys that hold an input size (one per image size of a ragged list) would otherwise pile
    up without end; a few fixed sizes never reach the bound, and a hit stays a plain
    ``dict.get``. Entries read or made while a CUDA graph is being captured (``pin``) are
    kept across the emptying: the graph reads their memory at every replay, and freed it
    could be handed to another tensor.
    """

    def __init__(self, entries: int, nbytes: int = 1 << 62) -> None:
        super().__init__()
        self.entries, self.nbytes = int(entries), int(nbytes)
        self.held = 0  # bytes of the entries
        self._pinned: dict = {}

    def put(self, key: object, value: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        """Store ``value`` under ``key``, first emptying the cache (but its pinned entries)
        if it is full; returns ``value``."""
        size = _nbytes(value)
        if len(self) >= self.entries or self.held + size > self.nbytes:
            self.clear()
            self.update(self._pinned)
            self.held = sum(_nbytes(v) for v in self._pinned.values())
        self[key] = value
        self.held += size
        self.pin(key, value)
        return value

    def pin(self, key: object, value: torch.Tensor | np.ndarray) -> None:
        """Keep ``key`` for good if a CUDA graph is being captured on the current stream
        (cheap to call on every hit: one attribute read for a host value)."""
        if _in_capture(value):
            self._pinned[key] = value


def _in_capture(value: object) -> bool:
    """Whether ``value`` is a CUDA tensor used while a CUDA graph is captured on the current stream."""
    return isinstance(value, torch.Tensor) and value.is_cuda and torch.cuda.is_current_stream_capturing()


def _nbytes(value: torch.Tensor | np.ndarray) -> int:
    return value.nbytes if isinstance(value, np.ndarray) else value.numel() * value.element_size()


#: On the CPU the hash runs in numpy: unsigned 64-bit ops, a third of the dispatches and
#: several times faster per element than int64 torch ops. Both give the same bits.
USE_NUMPY_ON_CPU = True


def _numpy_engine(device: torch.device) -> bool:
    return USE_NUMPY_ON_CPU and device.type == "cpu"


def scramble(index: torch.Tensor) -> torch.Tensor:
    """``mix(index * G + G)``: the per-sample part of every key, int64 on the index's device."""
    if _numpy_engine(index.device):
        z = index.numpy().view(np.uint64) * np.uint64(GOLDEN)  # a new array: the index is never written
        z += np.uint64(GOLDEN)
        return torch.from_numpy(mix64_np_(z).view(np.int64))
    return mix64_(index.mul(_GOLDEN_S).add_(_GOLDEN_S))


#: Counter arrays for k up to this many elements are cached (32 KiB each at most); caches of
#: them and of other per-size constants are bounded: k is one image's element count for
#: ``normal``, so a ragged list brings a new k with every new size.
_COUNTERS_MAX_K = 4096
_COUNTERS: BoundedCache = BoundedCache(64, 1 << 20)


def _counters(k: int, device: torch.device) -> torch.Tensor:
    """``(j + 1) * GOLDEN`` for j < k, int64 (cached for small k: one tensor per (k, device))."""
    key = (k, str(device))
    out = _COUNTERS.get(key)
    if out is None:
        out = torch.arange(1, k + 1, dtype=torch.int64, device=device).mul_(_GOLDEN_S)
        if k <= _COUNTERS_MAX_K:
            _COUNTERS.put(key, out)
    elif device.type == "cuda":
        _COUNTERS.pin(key, out)
    return out


_COUNTERS_NP: BoundedCache = BoundedCache(64, 1 << 20)


def _counters_np(k: int) -> np.ndarray:
    """``(j + 1) * GOLDEN`` for j < k as uint64 (cached for small k)."""
    out = _COUNTERS_NP.get(k)
    if out is None:
        out = np.arange(1, k + 1, dtype=np.uint64) * np.uint64(GOLDEN)
        if k <= _COUNTERS_MAX_K:
            _COUNTERS_NP.put(k, out)
    return out


def _hash_np(scrambled: torch.Tensor, h: int, k: int | None) -> np.ndarray:
    """``hash_bits`` in numpy: a uint64 array (N,) or (N, k)."""
    z = scrambled.numpy().view(np.uint64) ^ np.uint64(h & _MASK64)
    if k is None:
        z += np.uint64(GOLDEN)
    else:
        z = z[:, None] + _counters_np(int(k))
    return mix64_np_(z)


#: ``integers``' highs hold the input size (a crop's offset range): bounded as the counters.
_HOST_CONSTANTS: BoundedCache = BoundedCache(256)


def _host_constant(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """float64 constants on an accelerator, made once with fills (no blocking host copy)."""
    key = (tuple(values), str(device))
    out = _HOST_CONSTANTS.get(key)
    if out is not None:
        if device.type == "cuda":
            _HOST_CONSTANTS.pin(key, out)
        return out
    if device.type == "cpu":
        out = torch.tensor(values, dtype=torch.float64)
    else:
        out = torch.empty(len(values), dtype=torch.float64, device=device)
        for i, v in enumerate(values):
            out[i].fill_(float(v))
    return _HOST_CONSTANTS.put(key, out)


def hash_bits(scrambled: torch.Tensor, h: int | torch.Tensor, k: int | None) -> torch.Tensor:
    """``mix((scrambled ^ h) + (j + 1) * G)``: (N,) for ``k=None`` (j = 0), else (N, k); int64.

    ``h`` is a Python integer, or a 0-d int64 tensor on ``scrambled``'s device (always the
    torch path then)."""
    if isinstance(h, torch.Tensor):
        state = scrambled.bitwise_xor(h)
    elif _numpy_engine(scrambled.device):
        return torch.from_numpy(_hash_np(scrambled, h, k).view(np.int64))
    else:
        state = scrambled.bitwise_xor(_signed(h))
    if k is None:
        return mix64_(state.add_(_GOLDEN_S))
    return mix64_(state.view(-1, 1) + _counters(int(k), state.device))


def fold_tensor(h: int | torch.Tensor, *parts: int | torch.Tensor) -> torch.Tensor:
    """``fold`` continued on a device: from the 64-bit state ``h`` (a Python integer or a 0-d
    int64 tensor), fold ``parts`` (integers or 0-d integer tensors) in order. The result is
    a 0-d int64 tensor with the bits ``fold`` gives (as a signed int64)."""
    device = next((p.device for p in (h, *parts) if isinstance(p, torch.Tensor)), torch.device("cpu"))
    z = h.to(torch.int64) if isinstance(h, torch.Tensor) else torch.full((), _signed(h), dtype=torch.int64,
                                                                           device=device)
    for p in parts:
        z = z.bitwise_xor(p.to(torch.int64) if isinstance(p, torch.Tensor) else _signed(p))
        z = mix64_(z.add_(_GOLDEN_S))
    return z.reshape(())


def _check_epoch(epoch: int | torch.Tensor, index: torch.Tensor) -> int | torch.Tensor:
    """``epoch`` as a plain int (numpy integers too) or the 0-d integer tensor it is on the index's device."""
    if isinstance(epoch, torch.Tensor):
        if epoch.numel() != 1 or epoch.is_floating_point() or epoch.is_complex() or epoch.dtype == torch.bool:
            raise TypeError(f"SampleKeys epoch as a tensor must hold one integer, got a {epoch.dtype} tensor of "
                            f"shape {tuple(epoch.shape)}")
        if epoch.device != index.device:
            raise ValueError(f"SampleKeys epoch tensor is on {epoch.device}, the index on {index.device}; "
                             "put both on the batch's device")
        return epoch
    number = as_int(epoch)
    if number is None:
        raise TypeError(f"SampleKeys epoch must be an int or a 0-d integer tensor, got {epoch!r}")
    return number


class SampleKeys:
    """The random keys of the samples of one batch.

    Args:
        seed: The run's seed, in [0, 2**64).
        epoch: The epoch the batch belongs to: an int, or a 0-d integer tensor on the
            index's device (folded on the device: what a CUDA graph takes as an input).
        index: Global sample indices, one per row of the batch (an integer tensor on the
            batch's device).
        stream: Separates independent uses of one seed (e.g. training vs evaluation), in [0, 2**64).
        path: Position of the op inside nested ``Compose``/``RandomApply`` (set by them).
    """

    def __init__(self, seed: int, epoch: int | torch.Tensor, index: torch.Tensor, stream: int = 0,
                 path: tuple[int, ...] = ()) -> None:
        if not isinstance(index, torch.Tensor) or index.ndim != 1 or index.is_floating_point() \
                or index.is_complex() or index.dtype == torch.bool:
            what = f"{index.dtype} tensor of shape {tuple(index.shape)}" if isinstance(index, torch.Tensor) \
                else type(index).__name__
            raise TypeError(f"SampleKeys index must be a 1-D integer tensor (one global index per sample), got {what}")
        plain = {}
        for name, value in (("seed", seed), ("stream", stream)):
            plain[name] = as_int(value)  # numpy integers too, folded as plain ones
            if plain[name] is None:
                raise TypeError(f"SampleKeys {name} must be an int, got {value!r}")
            if not 0 <= plain[name] < 1 << 64:  # folded modulo 2**64: a wider one would repeat a smaller one's draws
                raise ValueError(f"SampleKeys {name} must be in [0, 2**64), got {value}")
        seed, stream = plain["seed"], plain["stream"]
        epoch = _check_epoch(epoch, index)
        self.seed, self.epoch, self.stream = seed, epoch, stream
        self.path = tuple(int(p) for p in path)
        self.index = index.long()
        # The scrambled indices, computed once and shared by every child (same rows).
        self._scrambled: list[torch.Tensor | None] = [None]
        # With an epoch tensor: the state after (seed, stream, epoch), folded once on the device.
        self._epoch_state = None if not isinstance(epoch, torch.Tensor) else \
            fold_tensor(_fold_cached((seed, stream)), epoch)
        self._salt = self._fold_path(self.path)

    def _fold_path(self, path: tuple[int, ...]) -> int | torch.Tensor:
        """The salt ``H`` without the slot: a Python integer, or a 0-d device tensor with an epoch tensor."""
        if self._epoch_state is None:
            return _fold_cached((self.seed, self.stream, self.epoch, len(path), *path))
        return fold_tensor(self._epoch_state, len(path), *path)

    @property
    def _numpy(self) -> bool:
        """Whether draws finish in numpy (the CPU with a host-folded salt)."""
        return self._epoch_state is None and _numpy_engine(self.index.device)

    @classmethod
    def for_batch(cls, n: int, device: torch.device | str | None = None, seed: int = 0,
                  epoch: int = 0) -> SampleKeys:
        """Keys for a batch whose rows are samples ``0 .. n-1`` (a standalone call)."""
        return cls(seed, epoch, torch.arange(n, device=device))

    def __len__(self) -> int:
        return self.index.shape[0]

    @property
    def device(self) -> torch.device:
        """The device the draws are computed on."""
        return self.index.device

    def __repr__(self) -> str:
        return (f"SampleKeys(seed={self.seed}, epoch={self.epoch}, stream={self.stream}, "
                f"path={self.path}, n={len(self)}, device={self.device})")

    def _derived(self, index: torch.Tensor, scrambled: list[torch.Tensor | None],
                 path: tuple[int, ...]) -> SampleKeys:
        out = SampleKeys.__new__(SampleKeys)
        out.seed, out.epoch, out.stream, out.path = self.seed, self.epoch, self.stream, path
        out.index, out._scrambled, out._epoch_state = index, scrambled, self._epoch_state
        out._salt = out._fold_path(path)
        return out

    def child(self, position: int) -> SampleKeys:
        """The keys of the op at ``position`` inside this op (same samples, a longer path)."""
        return self._derived(self.index, self._scrambled, (*self.path, int(position)))

    def take(self, rows: torch.Tensor) -> SampleKeys:
        """The keys of a subset of the rows (same draws for the same samples)."""
        have = self._scrambled[0]
        scrambled = [None if have is None else have.index_select(0, rows)]
        return self._derived(self.index.index_select(0, rows), scrambled, self.path)

    def _sample_state(self) -> torch.Tensor:
        """The scrambled indices ``I`` (computed once per batch, shared by the children)."""
        scrambled = self._scrambled[0]
        if scrambled is None:
            scrambled = self._scrambled[0] = scramble(self.index)
        return scrambled

    def _slot_key(self, slot: int) -> int | torch.Tensor:
        if isinstance(self._salt, torch.Tensor):
            return fold_tensor(self._salt, int(slot))
        return mix64((self._salt ^ (int(slot) & _MASK64)) + GOLDEN)

    def bits(self, slot: int, k: int | None = None) -> torch.Tensor:
        """Raw 64-bit draws as int64: (N,) or (N, k) (element counter 0 .. k-1)."""
        return hash_bits(self._sample_state(), self._slot_key(slot), k)

    def uniform(self, slot: int, k: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Uniform draws in [0, 1): (N,) or (N, k), float32 (24 bits) or float64 (53 bits)."""
        return _to_uniform(self.bits(slot, k), dtype)

    def _uniform64(self, slot: int, k: int | None) -> np.ndarray | torch.Tensor:
        """float64 uniforms, as a numpy array on the numpy engine (callers finish there: a few
        numpy ops cost less than torch dispatches on small per-sample draws)."""
        state = self._sample_state()
        if self._numpy:
            z = _hash_np(state, self._slot_key(slot), k)
            return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
        return _to_uniform(hash_bits(state, self._slot_key(slot), k), torch.float64)

    def integers(self, slot: int, highs: Sequence[int]) -> torch.Tensor:
        """Integers per sample and column: (N, len(highs)) int64, column j uniform in [0, highs[j])
        (0 where ``highs[j] <= 0``)."""
        highs = [max(int(h), 1) for h in highs]
        u = self._uniform64(slot, len(highs))
        if isinstance(u, np.ndarray):
            top = np.asarray(highs, dtype=np.float64)
            return torch.from_numpy(np.minimum(np.floor(u * top), top - 1).astype(np.int64))
        top = _host_constant(highs, u.device)
        return torch.minimum(torch.floor(u * top), top - 1).long()

    def normal(self, slot: int, shape: Sequence[int] = (), dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Standard normal draws, one per element: (N, *shape), computed in float64 (Box-Muller)."""
        shape = tuple(int(s) for s in shape)
        numel = math.prod(shape)
        hi, lo = _halves(self.bits(slot, numel))  # (N, numel) each, float64 in [0, 2**32)
        # r from (hi + 1) / 2**32 in (0, 1]: log is finite; theta uniform in [0, 2 pi). float64,
        # so that a one-ulp difference between a kernel's vector body and its scalar tail
        # (where a sample's elements land depends on the batch) vanishes in the rounding.
        r = hi.add_(1.0).mul_(2.0 ** -32).log_().mul_(-2.0).sqrt_()
        z = lo.mul_(2.0 * math.pi * 2.0 ** -32).cos_().mul_(r)
        return z.to(dtype).view(len(self), *shape)

    def randint(self, slot: int, low: int | torch.Tensor, high: int | torch.Tensor) -> torch.Tensor:
        """Integers uniform in [low, high) per sample, int64 (N,); ``high`` may be a (N,) tensor.

        Where ``high <= low`` the result is ``low``.
        """
        u = self.uniform(slot, dtype=torch.float64)
        span = high - low
        if isinstance(span, torch.Tensor):
            # Clamped below too, as the int path is: where span < 0, floor(u * span) is negative
            # and would land the draw below ``low`` instead of on it.
            out = torch.floor(u * span.to(torch.float64)).long().clamp_(min=0)
            return torch.minimum(out, (span - 1).clamp_(min=0).long()).add_(low)
        out = torch.floor(u * float(span)).long()
        return out.clamp_(min=0, max=max(int(span) - 1, 0)).add_(low)

    def bernoulli(self, slot: int, p: float, k: int | None = None) -> torch.Tensor:
        """Coins, True with probability ``p`` (a 53-bit uniform below ``p``): bool (N,) or (N, k)."""
        u = self._uniform64(slot, k)
        if isinstance(u, np.ndarray):
            return torch.from_numpy(u < float(p))
        return u < float(p)


def _halves(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32 bits of ``v`` as float64 tensors."""
    if _numpy_engine(v.device):
        a = v.numpy().view(np.uint64)
        return (torch.from_numpy((a >> np.uint64(32)).astype(np.float64)),
                torch.from_numpy((a & np.uint64(0xFFFFFFFF)).astype(np.float64)))
    hi = torch.bitwise_right_shift(v, 32).bitwise_and_(0xFFFFFFFF).to(torch.float64)
    return hi, v.bitwise_and(0xFFFFFFFF).to(torch.float64)


def _to_uniform(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Top 24 (float32) or 53 (float64) bits of ``v`` as a uniform in [0, 1) (exact conversions)."""
    if dtype not in (torch.float32, torch.float64):
        # Narrower floats would round values near 1 up to 1.0.
        raise ValueError(f"uniform dtype must be torch.float32 or torch.float64, got {dtype}")
    keep = 24 if dtype == torch.float32 else 53
    if _numpy_engine(v.device):
        u = (v.numpy().view(np.uint64) >> np.uint64(64 - keep)).astype(np.float32 if keep == 24 else np.float64)
        u *= 2.0 ** -keep
        return torch.from_numpy(u)
    return torch.bitwise_right_shift(v, 64 - keep).bitwise_and_((1 << keep) - 1).to(dtype).mul_(2.0 ** -keep)
