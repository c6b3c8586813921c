"""Loaders and models that spend known times, for the profiler and callback tests.

Each one either advances a :class:`FakeClock` (exact figures) or sleeps (real figures).
Everything is module-level so ``ddp_spawn`` can pickle it.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

# Dyadic durations: their sums are exact in binary floating point, so tests compare with ==.
FETCH = 2.0 ** -7
TRANSFER = 2.0 ** -9
COMPUTE = 2.0 ** -8
OVERHEAD = 2.0 ** -10


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class Spend:
    """Spend ``seconds``: advance ``clock`` if given, else sleep. ``per_rank`` overrides by rank."""

    def __init__(self, seconds: float, clock: FakeClock | None = None,
                 per_rank: dict[int, float] | None = None) -> None:
        self.seconds, self.clock, self.per_rank = seconds, clock, per_rank or {}

    def __call__(self) -> None:
        s = self.seconds
        if self.per_rank and torch.distributed.is_available() and torch.distributed.is_initialized():
            s = self.per_rank.get(torch.distributed.get_rank(), s)
        if not s:
            return
        if self.clock is not None:
            self.clock.advance(s)
        else:
            time.sleep(s)


class Vectors(Dataset):
    """``n`` samples of 8 floats with a 2-class label."""

    def __init__(self, n: int = 32) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), i % 2


class VectorStream(IterableDataset):
    """:class:`Vectors` as a stream: a loader without a length (Lightning prefetches its first batch)."""

    def __init__(self, n: int = 32) -> None:
        self.vectors = Vectors(n)

    def __iter__(self):
        return (self.vectors[i] for i in range(len(self.vectors)))


class SpendingCollate:
    """``default_collate`` that first spends a known time (runs in the main process: num_workers=0)."""

    def __init__(self, spend: Spend) -> None:
        self.spend = spend

    def __call__(self, items: list[Any]) -> Any:
        self.spend()
        return default_collate(items)


def loader(n: int, batch_size: int, spend: Spend, stream: bool = False) -> DataLoader:
    """A main-process DataLoader whose every batch costs ``spend`` (``stream``: over an IterableDataset)."""
    data = VectorStream(n) if stream else Vectors(n)
    return DataLoader(data, batch_size=batch_size, shuffle=False if not stream else None,
                      collate_fn=SpendingCollate(spend))


class SpendingModel(L.LightningModule):
    """A linear model whose steps and batch transfers spend known times."""

    def __init__(self, step: Spend, transfer: Spend | None = None, val_step: Spend | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 2)
        self.step, self.transfer, self.val_step = step, transfer, val_step

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.transfer is not None:
            self.transfer()
        return batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.step()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.val_step is not None:
            self.val_step()
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SpendBeforeBatch(L.Callback):
    """Spends a known time in ``on_train_batch_start`` (framework overhead, as any callback)."""

    def __init__(self, spend: Spend) -> None:
        self.spend = spend

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.spend()
