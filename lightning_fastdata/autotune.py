"""``num_workers="measure"``: time a few batches per candidate worker count and keep the best.

The plan (:func:`~lightning_fastdata.plan.decide`) proposes the candidates, none above
the auto value, so measuring never exceeds the core, RAM and /dev/shm caps; this module
only times them. Rates are loader-only: batches fetched and moved to the training device.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch

from lightning_fastdata import _lightning as door
from lightning_fastdata import distributed as D
from lightning_fastdata._util import batch_len
from lightning_fastdata.plan import Plan, Resources, loader_params

#: Batches drawn before timing starts: worker start-up and the first page faults.
WARMUP_BATCHES = 2
#: Batches timed per candidate.
TIMED_BATCHES = 8


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor of a (nested) batch to ``device``, asynchronously from pinned memory."""
    if isinstance(batch, torch.Tensor) or callable(getattr(batch, "to", None)):
        return batch.to(device, non_blocking=True)  # a tensor, or a batch that moves itself
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        out = [to_device(v, device) for v in batch]
        return type(batch)(out) if isinstance(batch, tuple) else out
    return batch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class LoaderTiming(NamedTuple):
    """What :func:`time_loader` measured: the rate and what it was measured over."""

    #: Samples per second over the timed batches.
    samples_per_s: float
    #: Samples in the timed batches (a partial last batch counts what it holds).
    samples: int
    #: Batches timed, warm-up excluded.
    batches: int
    #: Passes over the loader begun, warm-up included (more than 1 only with ``cycle``).
    passes: int


def time_loader(loader: Iterable[Any], device: torch.device | str = "cpu", batches: int = TIMED_BATCHES,
                warmup: int = WARMUP_BATCHES, consume: Callable[[Any], Any] | None = None,
                cycle: bool = False) -> LoaderTiming:
    """Samples per second of ``loader`` over ``batches`` batches after ``warmup`` untimed ones.

    Each batch is moved to ``device`` and passed to ``consume`` (e.g. the augmentation)
    before the next is drawn. With ``cycle``, a loader shorter than ``warmup + batches``
    is iterated again (epoch after epoch, the epoch boundaries timed as in training) until
    that many batches are drawn; without, it is timed over what follows its warm-up (at
    least one batch), and the result says how few batches that was.

    Returns:
        A :class:`LoaderTiming`: ``(samples_per_s, samples, batches, passes)``.

    Raises:
        ValueError: No batch could be timed (an empty loader, or one batch without ``cycle``).
    """
    device = torch.device(device)
    # A short loader keeps at least one batch to time; cycling makes it long enough.
    w = warmup if cycle else max(0, min(warmup, _len_or(loader, warmup + batches) - 1))
    passes = [0]
    it = _passes(loader, passes) if cycle else iter(loader)
    samples, drawn = 0, 0
    start = time.perf_counter() if w == 0 else None
    try:
        for drawn, batch in enumerate(it, 1):
            out = to_device(batch, device)
            if consume is not None:
                consume(out)
            if drawn <= w:
                if drawn == w:
                    _sync(device)
                    start = time.perf_counter()
                continue
            samples += batch_len(batch)
            if drawn >= w + batches:
                break
        _sync(device)
        elapsed = time.perf_counter() - start if start is not None else 0.0
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()  # a generator's close() shuts its DataLoader's workers down now
        del it
    if samples == 0 or elapsed <= 0:
        raise ValueError(f"could not time the loader: {drawn} batch(es) drawn, need at least 2")
    return LoaderTiming(samples / elapsed, samples, max(0, drawn - w), max(1, passes[0]))


def _passes(loader: Iterable[Any], count: list[int]) -> Iterator[Any]:
    """Batches of ``loader``, pass after pass, counting the passes in ``count[0]``; stops at an empty pass."""
    while True:
        count[0] += 1
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:  # an empty loader would otherwise spin here forever
            return


def shutdown_workers(loader: Any) -> None:
    """Stop the worker processes a loader keeps (persistent workers), now rather than at exit."""
    close = getattr(loader, "close", None)
    if callable(close):
        close()
        return
    if isinstance(loader, torch.utils.data.DataLoader):
        door.shutdown_dataloader_workers(loader)


def _len_or(loader: Any, default: int) -> int:
    try:
        return len(loader)
    except TypeError:
        return default


def measure_num_workers(plan: Plan, resources: Resources, config: dict[str, Any],
                        make_loader: Callable[[Plan], Iterable[Any]], device: torch.device | str = "cpu",
                        batches: int = TIMED_BATCHES, warmup: int = WARMUP_BATCHES) -> dict[int, float]:
    """Time every candidate in ``plan.num_workers_candidates``; set the fastest on ``plan``.

    Each candidate's loader is built by ``make_loader`` from a copy of ``plan`` carrying
    that worker count (with its own prefetch and pinning, workers not persistent) and
    shut down after timing. Ties go to fewer workers. Under DDP every rank adopts rank
    0's choice. The reason for ``num_workers`` records every rate.

    Returns:
        Samples per second by worker count.
    """
    rates: dict[int, float] = {}
    for nw in plan.num_workers_candidates:
        trial = copy.copy(plan)
        trial.reasons = dict(plan.reasons)
        loader_params(trial, resources, {**config, "num_workers": nw, "persistent_workers": False})
        rates[nw] = time_loader(make_loader(trial), device, batches=batches, warmup=warmup)[0]
    # Within 5% is noise: prefer fewer processes (less RAM, less contention with neighbours).
    top = max(rates.values())
    best = min(nw for nw, r in rates.items() if r >= 0.95 * top)
    best = int(D.broadcast_object(best))
    candidates = plan.num_workers_candidates
    loader_params(plan, resources, {**config, "num_workers": best})
    plan.num_workers_candidates = candidates
    measured = ", ".join(f"{nw}: {r:,.0f}" for nw, r in sorted(rates.items()))
    plan.reasons["num_workers"] = (f"{best}: measured fastest (samples/s by workers {{{measured}}}; "
                                   "within 5% of the top, fewer workers win)")
    return rates
