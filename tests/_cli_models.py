"""A tiny LightningModule and OptimizedDataModule that ``fastdata`` configs in tests name by class_path."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import Dataset

from lightning_fastdata import OptimizedDataModule


class SyntheticImages(Dataset):
    """``n`` deterministic uint8 images (3, size, size) with labels in [0, classes)."""

    def __init__(self, n: int = 96, size: int = 8, classes: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
        self.labels = torch.arange(n) % classes

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], int(self.labels[i])


class CliImages(OptimizedDataModule):
    """Synthetic images for the CLI tests.

    Args:
        n: Training samples (validation and test get half as many).
        size: Image height and width.
    """

    def __init__(self, n: int = 96, size: int = 8, **kwargs) -> None:
        kwargs.setdefault("progress", False)
        super().__init__(**kwargs)
        self.n, self.size = n, size

    def source(self, split: str):
        if split == "train":
            return SyntheticImages(self.n, self.size, seed=0)
        if split in ("val", "test"):
            return SyntheticImages(max(1, self.n // 2), self.size, seed=1)
        return None


class CliModel(L.LightningModule):
    """A linear classifier over uint8 or float images.

    Args:
        size: Image height and width.
        classes: Number of classes.
        lr: SGD learning rate.
    """

    def __init__(self, size: int = 8, classes: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3 * size * size, classes)
        self.lr = lr
        self.steps = 0

    def _loss(self, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x.float().flatten(1)), y)

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)
