"""One run of the keyed-augmentation job: every sample's augmented pixels, by (epoch, sample index).

Run in-process by ``tests/test_datamodule.py`` (world size 1) and as two DDP ranks (gloo)
by the same test: the samples are all one image, so what differs is the augmentation only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _helpers import TinyDataModule, TinyModel, ddp_exit_in_order, trainer  # noqa: E402

from lightning_fastdata import augment as A  # noqa: E402

N = 36


def augment() -> A.Compose:
    return A.Compose([A.RandomCrop(8, padding=2), A.RandomFlip(dims=(-2, -1)), A.RandomRot90(),
                      A.ColorJitter(0.3, 0.3, 0.3), A.Normalize([0.5] * 3, [0.25] * 3)])


class Same(torch.utils.data.Dataset):
    """Sample i: the same image for every i, and i as its label."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=g), i


class Keyed(TinyDataModule):
    def source(self, split):
        return Same() if split == "train" else None


class Recorder(TinyModel):
    """Records each augmented sample under (epoch, index)."""

    def __init__(self) -> None:
        super().__init__(classes=N)
        self.by_sample: dict[str, torch.Tensor] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        for img, i in zip(x, y.tolist(), strict=True):
            self.by_sample[f"e{self.current_epoch}_i{i}"] = img.detach().clone()
        return super().training_step(batch, batch_idx)


def run(root: str, cache: str, strategy: str = "device", batch_size: int = 8, num_workers: int = 0,
        devices: int = 1, ckpt_path: str | None = None, callbacks: list | None = None) -> dict[str, torch.Tensor]:
    dm = Keyed(batch_size=batch_size, strategy=strategy, num_workers=num_workers, persistent_workers=False,
               device="cpu", cache_dir=cache, seed=7, train_augment=augment())
    model = Recorder()
    kwargs = dict(max_epochs=2, num_sanity_val_steps=0, callbacks=callbacks or [])
    if devices > 1:
        kwargs.update(devices=devices, strategy="ddp")
    if callbacks:
        kwargs["enable_checkpointing"] = True
    trainer(root, **kwargs).fit(model, dm, ckpt_path=ckpt_path)
    return model.by_sample


if __name__ == "__main__":
    root, cache, out = sys.argv[1:4]
    import torch.distributed as dist

    samples = run(root, cache, devices=2)
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(samples, f"{out}.rank{rank}.pt")
    ddp_exit_in_order()
