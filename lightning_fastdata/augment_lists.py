"""Ragged batches (lists of per-sample tensors of varying spatial size): grouping samples of
similar size and placing each group on one padded canvas, so that batched code runs on it.

The size-fixing ops (``RandomResizedCrop``, ``Resize``, ``CenterCrop``, ``RandomCrop``)
use these; every size a list op needs is read from the tensors' shapes (host values, no
device sync).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: A group's canvas may hold at most this many times the elements of its samples; samples
#: of very different sizes go to different groups, so one large image never makes every
#: sample of the batch as large.
MAX_WASTE = 2.0


def lead_shape(xs: Sequence[torch.Tensor], sd: int, field: str,
               index: torch.Tensor | Sequence[int] | None = None) -> tuple[int, ...]:
    """The non-spatial shape (channels, frames) every sample of ``field`` shares.

    Args:
        xs: The field's samples, ``(*lead, *spatial)`` each.
        sd: The number of spatial dims.
        field: The field's name, for the error.
        index: The samples' dataset indices (``batch.keys.index``), named by the error;
            without them it names positions in the list.
    """
    lead = tuple(xs[0].shape[:-sd])
    for i, x in enumerate(xs):
        if tuple(x.shape[:-sd]) != lead:
            if index is None:
                odd, first = f"sample {i}", "sample 0"
            else:  # read from the device only here, on the way to the error
                ids = index.tolist() if isinstance(index, torch.Tensor) else list(index)
                odd, first = f"sample {ids[i]} (batch position {i})", f"sample {ids[0]} (batch position 0)"
            raise ValueError(f"field {field!r}: {odd} has shape {tuple(x.shape)} and {first} "
                             f"{tuple(xs[0].shape)}; only the spatial size may vary within a list field (give "
                             "every sample the same channels in the dataset, e.g. x.expand(3, -1, -1) for a "
                             "grayscale image: JPEG fields keep the 1 or 3 channels of the tensors stored)")
    return lead


def groups(extents: Sequence[Sequence[int]], waste: float = MAX_WASTE) -> list[list[int]]:
    """Sample positions grouped so that each group's bounding canvas (the elementwise max of
    its extents, times its size) holds at most ``waste`` times its samples' elements.

    One group (all samples, in order) when that already holds, else greedy groups of
    samples sorted by size.
    """
    n = len(extents)
    order = list(range(n))

    def fits(rows: list[int], top: list[int], total: int) -> bool:
        return len(rows) * math.prod(top) <= waste * total

    every = [max(e[d] for e in extents) for d in range(len(extents[0]))]
    if fits(order, every, sum(math.prod(e) for e in extents)):
        return [order]
    order.sort(key=lambda i: (math.prod(extents[i]), tuple(extents[i])))
    out: list[list[int]] = []
    rows: list[int] = []
    top: list[int] = []
    total = 0
    for i in order:
        e = list(extents[i])
        grown = [max(a, b) for a, b in zip(top, e, strict=True)] if rows else e
        if rows and not fits(rows + [i], grown, total + math.prod(e)):
            out.append(rows)
            rows, grown, total = [], e, 0
        rows.append(i)
        top = grown
        total += math.prod(e)
    out.append(rows)
    return out


def canvas(xs: Sequence[torch.Tensor], rows: Sequence[int], sd: int, fill: float = 0.0,
           place: Sequence[Sequence[int]] | None = None, extent: Sequence[int] | None = None) -> torch.Tensor:
    """Samples ``xs[r]`` (``(*lead, *spatial)``) for ``r`` in ``rows`` on one tensor
    ``(len(rows), *lead, *extent)`` filled with ``fill``, sample ``r`` at corner ``place[r]``
    (default the origin); ``extent`` defaults to the smallest that holds every sample."""
    first = xs[rows[0]]
    lead = tuple(first.shape[:-sd])
    corners = [tuple(place[r]) if place is not None else (0,) * sd for r in rows]
    if extent is None:
        extent = [max(c[d] + xs[r].shape[-sd + d] for r, c in zip(rows, corners, strict=True)) for d in range(sd)]
    out = torch.empty((len(rows), *lead, *extent), dtype=first.dtype, device=first.device)
    full = all(tuple(xs[r].shape[-sd:]) == tuple(extent) for r in rows) and not any(map(any, corners))
    if not full:
        out.fill_(fill)  # only where some sample leaves a margin
    for j, (r, c) in enumerate(zip(rows, corners, strict=True)):
        x = xs[r]
        window = (j, Ellipsis, *(slice(c[d], c[d] + x.shape[-sd + d]) for d in range(sd)))
        out[window].copy_(x)
    return out


def take(values: dict[str, torch.Tensor], rows: Sequence[int], n: int) -> dict[str, torch.Tensor]:
    """Per-sample parameters (N rows) restricted to ``rows`` (all of them: unchanged)."""
    if len(rows) == n and list(rows) == list(range(n)):
        return values
    out = {}
    for k, v in values.items():
        index = torch.as_tensor(list(rows), dtype=torch.long).to(v.device, non_blocking=True)
        out[k] = v.index_select(0, index)
    return out


def scatter(parts: Sequence[tuple[Sequence[int], torch.Tensor]], n: int) -> torch.Tensor:
    """One batch from per-group outputs: group ``rows`` -> its tensor, back in sample order."""
    if len(parts) == 1:
        return parts[0][1]
    first = parts[0][1]
    out = first.new_empty((n, *first.shape[1:]))
    for rows, part in parts:  # several groups are the rare case: a copy per sample is fine
        for j, r in enumerate(rows):
            out[r].copy_(part[j])
    return out


__all__ = ["MAX_WASTE", "canvas", "groups", "lead_shape", "scatter", "take"]
