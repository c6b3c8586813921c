"""Seed derivation: one 63-bit seed per (seed, stream, rank, worker, epoch, step).

Every random stream of the package comes from :func:`derive_seed`, built on numpy's
``SeedSequence`` so nearby keys (rank 0 vs 1, epoch 3 vs 4) give statistically
independent streams, not shifted copies of one another.
"""

from __future__ import annotations

import zlib

import numpy as np

#: Stream tags keep the augmentation, shuffling and worker streams apart even when
#: their other keys coincide.
STREAMS = {"augment": 1, "worker": 2, "order": 3, "block": 4}


def derive_seed(
    seed: int,
    *,
    stream: str = "augment",
    rank: int = 0,
    worker: int = 0,
    epoch: int = 0,
    step: int = 0,
) -> int:
    """Derive a reproducible 63-bit seed from a base seed and the position of a stream.

    Args:
        seed: The user's base seed (any non-negative int).
        stream: What the seed is for; one of :data:`STREAMS` or any other name.
        rank: Global rank of the process.
        worker: DataLoader worker id (0 in the main process).
        epoch: Epoch number.
        step: Batch index within the epoch.

    Returns:
        An int in ``[0, 2**63)``, identical for identical arguments on every machine.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    tag = STREAMS.get(stream)
    if tag is None:
        tag = 1000 + zlib.crc32(stream.encode())
    keys = [tag, rank, worker, epoch, step]
    if min(keys) < 0:
        raise ValueError(f"seed keys must be >= 0, got rank={rank} worker={worker} epoch={epoch} step={step}")
    state = np.random.SeedSequence(entropy=seed, spawn_key=keys).generate_state(2, np.uint64)
    return int(state[0] >> np.uint64(1))
