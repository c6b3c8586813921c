"""Ragged fields: samples whose shape varies, kept end to end with offsets and per-sample shapes.

A ragged field of N samples is three arrays: ``values``, every sample's elements end to
end (1-D); ``offsets``, ``(N + 1,)`` int64 element offsets into ``values``; ``shapes``,
``(N, ndim)`` int64 per-sample shapes. A field stored as JPEG (``encoding="jpeg"``) is a
ragged uint8 field of bytes (``shapes`` is ``(N, 1)``, the byte counts) that also keeps
each image's decoded ``(C, H, W)``, so sizes are known without decoding.

* :class:`RaggedArray`: a whole field in host memory (numpy: memory maps of the cache, or
  a shared-memory segment).
* :class:`RaggedBatch`: a gathered batch of one field, as a leaf of a loader's batch: its
  values on the batch's device, its offsets and shapes always on the CPU, so the sizes of
  the samples are known without a device synchronisation.
* :class:`RaggedField`: a placed field (values on the device, offsets on the device and
  on the host) and its gather by sample index.

This module imports nothing from the package.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class RaggedArray:
    """A ragged field of N samples in host memory.

    Attributes:
        values: 1-D, every sample's elements end to end.
        offsets: ``(N + 1,)`` int64 element offsets into ``values`` (``offsets[0] == 0``).
        shapes: ``(N, ndim)`` int64 per-sample shapes.
        encoding: ``None``, or ``"jpeg"`` when ``values`` holds JPEG bytes.
        decoded: For an encoded field, ``(N, 3)`` int64 decoded ``(C, H, W)`` per sample.
    """

    values: np.ndarray
    offsets: np.ndarray
    shapes: np.ndarray
    encoding: str | None = None
    decoded: np.ndarray | None = None

    @classmethod
    def from_list(cls, samples: list[np.ndarray], encoding: str | None = None,
                  decoded: np.ndarray | None = None) -> RaggedArray:
        """A ragged array from per-sample arrays of one dtype and number of dimensions."""
        if not samples:
            raise ValueError("a ragged array needs at least one sample")
        arrays = [np.asarray(s) for s in samples]
        dtypes, ndims = {a.dtype.str for a in arrays}, {a.ndim for a in arrays}
        if len(dtypes) != 1 or len(ndims) != 1:
            raise ValueError(f"the samples of a ragged array need one dtype and one ndim, got dtypes "
                             f"{sorted(dtypes)} and ndims {sorted(ndims)}")
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([a.size for a in arrays], out=offsets[1:])
        values = np.concatenate([a.reshape(-1) for a in arrays]) if offsets[-1] else np.empty(0, arrays[0].dtype)
        shapes = np.array([a.shape for a in arrays], dtype=np.int64).reshape(len(arrays), arrays[0].ndim)
        return cls(values, offsets, shapes, encoding, decoded)

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i`` in its shape (a view of ``values``)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.values[a:b].reshape(tuple(int(s) for s in self.shapes[i]))

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    @property
    def ndim(self) -> int:
        """Dimensions of one sample."""
        return int(self.shapes.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of values, offsets and shapes (and decoded shapes)."""
        extra = self.decoded.nbytes if self.decoded is not None else 0
        return int(self.values.nbytes + self.offsets.nbytes + self.shapes.nbytes + extra)

    def parts(self) -> dict[str, np.ndarray]:
        """The arrays of the field by role: values, offsets, shapes (and decoded)."""
        out = {"values": self.values, "offsets": self.offsets, "shapes": self.shapes}
        if self.decoded is not None:
            out["decoded"] = self.decoded
        return out

    def problems(self) -> list[str]:
        """What is inconsistent between values, offsets and shapes (empty when all is well).

        Checks every sample (vectorised; a few milliseconds per million samples): offsets
        start at 0, never decrease, end at ``len(values)``, and each sample's element count
        is the product of its shape.
        """
        out: list[str] = []
        n = len(self)
        if self.values.ndim != 1:
            out.append(f"values has shape {self.values.shape}, not 1-D")
        if self.offsets.dtype != np.int64 or self.offsets.ndim != 1 or self.offsets.shape[0] < 1:
            out.append(f"offsets is {self.offsets.dtype} {self.offsets.shape}, not int64 (N+1,)")
            return out
        if self.shapes.dtype != np.int64 or self.shapes.ndim != 2 or self.shapes.shape[0] != n:
            out.append(f"shapes is {self.shapes.dtype} {self.shapes.shape}, not int64 ({n}, ndim)")
            return out
        if self.offsets[0] != 0:
            out.append("offsets do not start at 0")
        elif int(self.offsets[-1]) != self.values.shape[0]:
            out.append(f"offsets end at {int(self.offsets[-1])}, values has {self.values.shape[0]} elements")
        counts = np.diff(self.offsets)
        bad = np.flatnonzero((counts < 0) | (counts != np.prod(self.shapes, axis=1)) | (self.shapes < 0).any(axis=1))
        if bad.size:
            i = int(bad[0])
            out.append(f"sample {i} spans {int(counts[i])} elements by its offsets, its shape "
                       f"{tuple(int(s) for s in self.shapes[i])} says {int(np.prod(self.shapes[i]))} "
                       f"({bad.size} sample(s) disagree)")
        if self.decoded is not None and (self.decoded.shape != (n, 3) or self.decoded.dtype != np.int64
                                         or (self.decoded < 0).any()):
            out.append(f"decoded shapes are {self.decoded.dtype} {self.decoded.shape}, not int64 ({n}, 3) >= 0")
        return out


class RaggedBatch:
    """One ragged field of a batch: values on the batch's device, offsets and shapes on the CPU.

    Attributes:
        values: 1-D, the batch's samples end to end, on the batch's device.
        offsets: ``(n + 1,)`` int64 batch-local element offsets, always on the CPU (the
            sizes are known without a device synchronisation).
        shapes: ``(n, ndim)`` int64 per-sample shapes, always on the CPU.
        encoding: ``"jpeg"`` for JPEG bytes, else ``None``.
        decoded_shapes: For an encoded field, ``(n, 3)`` int64 decoded ``(C, H, W)`` on the
            CPU, else ``None``.
    """

    __slots__ = ("values", "offsets", "shapes", "encoding", "decoded_shapes")

    def __init__(self, values: torch.Tensor, offsets: torch.Tensor, shapes: torch.Tensor,
                 encoding: str | None = None, decoded_shapes: torch.Tensor | None = None) -> None:
        if offsets.device.type != "cpu" or shapes.device.type != "cpu":
            raise ValueError("a RaggedBatch keeps its offsets and shapes on the CPU")
        if offsets.shape[0] != shapes.shape[0] + 1:
            raise ValueError(f"{offsets.shape[0]} offsets for {shapes.shape[0]} samples; need one more offset")
        self.values, self.offsets, self.shapes = values, offsets, shapes
        self.encoding, self.decoded_shapes = encoding, decoded_shapes

    def __len__(self) -> int:
        return int(self.shapes.shape[0])

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.offsets.nbytes + self.shapes.nbytes)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RaggedBatch:
        """The batch with its values on ``device``; offsets and shapes stay on the CPU.

        Encoded bytes (``encoding="jpeg"``) stay where they are: the decoders read them in
        host memory and write the decoded images to the device.
        """
        if self.encoding:
            return self
        return RaggedBatch(self.values.to(device, non_blocking=non_blocking), self.offsets, self.shapes,
                           self.encoding, self.decoded_shapes)

    def pin_memory(self) -> RaggedBatch:
        """Values in pinned memory (DataLoader's ``pin_memory=True`` calls this)."""
        return RaggedBatch(self.values.pin_memory(), self.offsets, self.shapes, self.encoding, self.decoded_shapes)

    def tensors(self) -> list[torch.Tensor]:
        """Per-sample views of ``values`` in their shapes (no copy, no device synchronisation)."""
        offsets, shapes = self.offsets.tolist(), self.shapes.tolist()
        return [self.values[offsets[k]:offsets[k + 1]].view(shapes[k]) for k in range(len(shapes))]

    def __repr__(self) -> str:
        enc = f", encoding={self.encoding!r}" if self.encoding else ""
        return (f"RaggedBatch(samples={len(self)}, {self.values.dtype}, {self.values.numel()} elements on "
                f"{self.values.device}{enc})")


def _batch_offsets(starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(starts.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(ends - starts, 0, out=offsets[1:])
    return offsets


def _copy_slices(values: torch.Tensor, starts: list[int], ends: list[int], total: int) -> torch.Tensor:
    """Samples ``values[starts[k]:ends[k]]`` end to end: one memcpy per sample (host memory)."""
    if not starts or not total:
        return values[:0].clone()
    return torch.cat([values[a:b] for a, b in zip(starts, ends, strict=True)])


def gather_host(field: RaggedArray, indices: np.ndarray | torch.Tensor) -> RaggedBatch:
    """Samples ``indices`` of a host-resident field as a CPU :class:`RaggedBatch` (fresh memory).

    On the host a batch is one memcpy per sample: faster than an element-wise gather,
    whose index would be 8 bytes per element.
    """
    idx = indices.numpy() if isinstance(indices, torch.Tensor) else np.asarray(indices, dtype=np.int64)
    starts, ends = field.offsets[idx], field.offsets[idx + 1]
    offsets = np.zeros(idx.shape[0] + 1, dtype=np.int64)
    np.cumsum(ends - starts, out=offsets[1:])
    values = np.empty(int(offsets[-1]), dtype=field.values.dtype)
    if idx.shape[0] and values.size:
        np.concatenate([field.values[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)], out=values)
    decoded = torch.from_numpy(np.ascontiguousarray(field.decoded[idx])) if field.decoded is not None else None
    return RaggedBatch(torch.from_numpy(values), torch.from_numpy(offsets),
                       torch.from_numpy(np.ascontiguousarray(field.shapes[idx])), field.encoding, decoded)


def gather_values(values: torch.Tensor, offsets: torch.Tensor, indices: torch.Tensor, total: int) -> torch.Tensor:
    """Samples ``indices`` of a ragged field's values, end to end, by one element-wise gather.

    Everything runs on the device of its inputs, without a Python loop per sample and
    without a host synchronisation: ``total`` (the batch's element count) comes from the
    caller, who knows it from host copies of the offsets and indices, and is passed to
    ``repeat_interleave`` as ``output_size`` so it need not read the lengths back.

    Args:
        values: The field's 1-D values.
        offsets: Its ``(N + 1,)`` offsets, on the same device.
        indices: The samples, int64, on the same device.
        total: The sum of the samples' element counts.
    """
    starts = offsets[indices]
    lengths = offsets[indices + 1] - starts
    # Element j of sample k sits at starts[k] + j in the field and at excl[k] + j in the batch
    # (excl: exclusive cumulative sum of lengths), so its source is its batch position plus a
    # per-sample shift, spread over the sample's elements.
    shift = starts - (torch.cumsum(lengths, 0) - lengths)
    source = torch.arange(total, device=values.device) + torch.repeat_interleave(shift, lengths, output_size=total)
    return torch.index_select(values, 0, source)


@dataclass
class RaggedField:
    """A placed ragged field: values where batches are made, offsets there and on the host.

    Attributes:
        values: 1-D values on the device batches are gathered on.
        offsets: ``(N + 1,)`` int64 offsets on the same device as ``values``.
        host_offsets: The same offsets on the CPU (batch sizes without a device sync).
        shapes: ``(N, ndim)`` int64 shapes on the CPU.
        encoding: ``None`` or ``"jpeg"``.
        decoded: ``(N, 3)`` decoded shapes on the CPU for an encoded field.
    """

    values: torch.Tensor
    offsets: torch.Tensor
    host_offsets: torch.Tensor
    shapes: torch.Tensor
    encoding: str | None = None
    decoded: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.host_offsets.shape[0]) - 1

    @property
    def nbytes(self) -> int:
        """Bytes on the values' device (values, plus the offsets when that is not the CPU)."""
        if self.values.device.type == "cpu":
            return int(self.values.nbytes)
        return int(self.values.nbytes + self.offsets.nbytes)

    def gather(self, indices: torch.Tensor, on_device: torch.Tensor | None = None) -> RaggedBatch:
        """Samples ``indices`` (CPU int64) as a :class:`RaggedBatch` on the values' device.

        The batch's offsets and total length come from the host offsets and the host
        indices. Off the CPU, the element index is built on the device from the device
        offsets and ``on_device`` (the same indices already there): each element's source
        position is its batch position plus its sample's shift, the shifts spread by
        ``repeat_interleave`` with ``output_size`` given, so nothing waits for the device
        and no Python loop runs per sample.
        """
        idx = indices if indices.device.type == "cpu" else indices.cpu()
        starts, ends = self.host_offsets[idx], self.host_offsets[idx + 1]
        offsets = _batch_offsets(starts, ends)
        total = int(offsets[-1])
        shapes = self.shapes[idx]
        decoded = self.decoded[idx] if self.decoded is not None else None
        device = self.values.device
        if device.type == "cpu":
            values = _copy_slices(self.values, starts.tolist(), ends.tolist(), total)
            return RaggedBatch(values, offsets, shapes, self.encoding, decoded)
        d = on_device if on_device is not None else idx.to(device, non_blocking=True)
        values = gather_values(self.values, self.offsets, d, total)
        return RaggedBatch(values, offsets, shapes, self.encoding, decoded)
