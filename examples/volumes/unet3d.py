"""A small 3-D U-Net for volume segmentation, trainable on a CPU.

Batches are dicts ``{"image": float (N, 1, D, H, W), "label": integer (N, 1, D, H, W)}``:
what ``volume_data.Volumes`` yields once ``ScaleIntensityRange`` has turned the int16
image into floats on the device.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

_NORMS = {
    "batch": lambda c: nn.BatchNorm3d(c),
    "instance": lambda c: nn.InstanceNorm3d(c, affine=True),
    "none": lambda c: nn.Identity(),
}


def _block(cin: int, cout: int, norm: str) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv3d(cin, cout, 3, padding=1, bias=norm == "none"), _NORMS[norm](cout), nn.LeakyReLU(0.01, True),
        nn.Conv3d(cout, cout, 3, padding=1, bias=norm == "none"), _NORMS[norm](cout), nn.LeakyReLU(0.01, True),
    )


def soft_dice_loss(logits: torch.Tensor, target: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """1 - the mean soft Dice of the foreground classes over the batch (target: class indices (N, ...))."""
    probs = logits.softmax(1)[:, 1:]
    onehot = F.one_hot(target, logits.shape[1]).movedim(-1, 1)[:, 1:].to(probs.dtype)
    dims = (0, *range(2, probs.ndim))
    inter = (probs * onehot).sum(dims)
    total = probs.sum(dims) + onehot.sum(dims)
    return 1.0 - ((2 * inter + eps) / (total + eps)).mean()


class UNet3D(L.LightningModule):
    """Encoder-decoder with skip connections: ``depth`` poolings, channels doubling per level.

    Trained with cross-entropy + soft Dice; logs ``train_loss``, ``val_loss`` and
    ``val_dice`` (the Dice of the foreground classes over the whole validation set, from
    the argmax prediction: 2|P and T| / (|P| + |T|), averaged over the classes).

    Args:
        num_classes: Output classes, background included (>= 2).
        width: Channels of the first level.
        depth: Poolings (>= 1); inputs are padded to a multiple of 2**depth.
        lr: Adam's initial learning rate, annealed to 0 by the last epoch (cosine).
        norm: Normalisation after each convolution. "batch" by default: instance norm, common
            for volumes, normalises each training crop by its own statistics, which differ
            from those of the whole volumes it is validated on (with this example's small
            crops it over-segments soft tissue at validation).
    """

    def __init__(self, num_classes: int = 2, width: int = 8, depth: int = 2, lr: float = 1e-2,
                 norm: Literal["batch", "instance", "none"] = "batch") -> None:
        super().__init__()
        if num_classes < 2 or width < 1 or depth < 1 or lr <= 0:
            raise ValueError(f"need num_classes >= 2, width >= 1, depth >= 1, lr > 0; "
                             f"got {num_classes}, {width}, {depth}, {lr}")
        if norm not in _NORMS:
            raise ValueError(f"norm must be one of {sorted(_NORMS)}, got {norm!r}")
        self.save_hyperparameters()
        chans = [width * 2 ** i for i in range(depth + 1)]
        self.down = nn.ModuleList([_block(1, chans[0], norm)]
                                  + [_block(chans[i], chans[i + 1], norm) for i in range(depth)])
        self.up = nn.ModuleList([nn.ConvTranspose3d(chans[i + 1], chans[i], 2, stride=2) for i in range(depth)])
        self.merge = nn.ModuleList([_block(2 * chans[i], chans[i], norm) for i in range(depth)])
        self.head = nn.Conv3d(chans[0], num_classes, 1)
        self.num_classes, self.depth, self.lr = num_classes, depth, lr
        self.val_dice = float("nan")
        self._inter = self._total = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (N, num_classes, D, H, W) of images (N, 1, D, H, W)."""
        size = x.shape[2:]
        m = 2 ** self.depth
        pad = [p for s in reversed(size) for p in (0, -s % m)]
        h = F.pad(x, pad) if any(pad) else x
        skips = []
        for i, block in enumerate(self.down):
            h = block(h if i == 0 else F.max_pool3d(h, 2))
            skips.append(h)
        for i in reversed(range(self.depth)):
            h = self.merge[i](torch.cat([self.up[i](h), skips[i]], 1))
        out = self.head(h)
        return out[(..., *(slice(0, s) for s in size))]

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = batch["image"], batch["label"][:, 0].long()
        logits = self(x.float())
        return F.cross_entropy(logits, y) + soft_dice_loss(logits, y), logits, y

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=len(batch["image"]))
        return loss

    def on_validation_epoch_start(self) -> None:
        self._inter = torch.zeros(self.num_classes - 1, device=self.device)
        self._total = torch.zeros(self.num_classes - 1, device=self.device)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, logits, y = self._loss(batch)
        pred = logits.argmax(1)
        for c in range(1, self.num_classes):
            p, t = pred == c, y == c
            self._inter[c - 1] += (p & t).sum()
            self._total[c - 1] += p.sum() + t.sum()
        self.log("val_loss", loss, prog_bar=True, batch_size=len(y))

    def on_validation_epoch_end(self) -> None:
        # Sums over every rank's share of the validation set (no-ops on one device).
        inter = self.trainer.strategy.reduce(self._inter, reduce_op="sum")
        total = self.trainer.strategy.reduce(self._total, reduce_op="sum")
        dice = (2 * inter / total.clamp(min=1)).mean()
        self.val_dice = float(dice)
        self.log("val_dice", dice, prog_bar=True)

    def configure_optimizers(self) -> Any:
        """Adam, its learning rate annealed to zero over the run (cosine, per epoch): a steady last epoch."""
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        epochs = self.trainer.max_epochs if self.trainer is not None and self.trainer.max_epochs else 0
        if epochs <= 0:
            return opt  # no known end (max_epochs=-1): a constant rate
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)}
