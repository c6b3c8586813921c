"""An ImageNet-like setup at toy scale: JPEG files of varying sizes in an ImageFolder, stored as
JPEG (longest side capped at 256), decoded in batches where the batch is used, and augmented
as ImageNet training is (RandomResizedCrop 224 + flip + normalize; resize 256 + center crop
224 for evaluation).

* :func:`write_photos` draws the dataset once: ``<root>/{train,val}/<class>/*.jpg``, sides of
  200 to 600 px, a few classes whose content a small CNN can learn (a blob whose hue and
  shape depend on the class, on a textured background of random colour);
* :class:`Photos` is the :class:`~lightning_fastdata.OptimizedDataModule`: its source reads
  each file's bytes (no decode at all when the file is within ``max_side``);
* :class:`SmallNet` is the model.

Run it with LightningCLI (see ``config.yaml`` beside this file)::

    python examples/imagenet_like/train.py fit --config examples/imagenet_like/config.yaml
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFilter
from torch import nn

from lightning_fastdata import OptimizedDataModule

#: ImageNet's channel statistics, as the usual recipes normalise with.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
_MARKER = "photos.json"


def draw_photo(label: int, classes: int, rng: np.random.Generator, sides: tuple[int, int]) -> Image.Image:
    """One photo of class ``label``: a blob whose hue (and, for odd classes, shape: a box
    instead of an ellipse) is the class's, at a random place and size, on a blurred noise
    background of a random dull colour. Width and height are drawn apart in ``sides``."""
    w, h = (int(v) for v in rng.integers(sides[0], sides[1] + 1, size=2))
    base = rng.integers(40, 120, size=3)
    small = rng.normal(0, 25, size=(max(h // 16, 2), max(w // 16, 2), 3)) + base
    bg = Image.fromarray(np.clip(small, 0, 255).astype(np.uint8)).resize((w, h), Image.BILINEAR)
    draw = ImageDraw.Draw(bg)
    hue = label / classes
    colour = tuple(int(255 * c) for c in _hsv(hue, 0.9, 0.95))
    r = rng.uniform(0.2, 0.4) * min(w, h)
    cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
    box = [cx - r, cy - r * rng.uniform(0.6, 1.0), cx + r, cy + r * rng.uniform(0.6, 1.0)]
    (draw.rectangle if label % 2 else draw.ellipse)(box, fill=colour)
    return bg.filter(ImageFilter.GaussianBlur(1))


def _hsv(h: float, s: float, v: float) -> tuple[float, float, float]:
    import colorsys

    return colorsys.hsv_to_rgb(h, s, v)


def _expected(per_split: dict[str, int], classes: int, sides: tuple[int, int], seed: int, quality: int) -> dict:
    return {"per_class": per_split, "classes": classes, "sides": list(sides), "seed": seed, "quality": quality}


def write_photos(root: str | os.PathLike, per_split: dict[str, int], classes: int = 4,
                 sides: tuple[int, int] = (200, 600), seed: int = 0, quality: int = 90) -> Path:
    """Write the photos once as ``<root>/<split>/class_<k>/<i>.jpg``; return ``root``.

    A folder whose marker matches these settings is reused as is; one drawn with other
    settings, or holding other files, is refused (never deleted). The files are written to a
    temporary folder beside ``root`` and published by one ``rename``.

    Args:
        root: The dataset folder.
        per_split: Photos per class in each split, e.g. ``{"train": 100, "val": 20}``.
        classes: Number of classes (2 or more).
        sides: Smallest and largest side in pixels (each side drawn apart).
        seed: Every photo is a function of (seed, split, class, index).
        quality: JPEG quality of the files.
    """
    root = Path(root)
    if classes < 2 or any(n < 1 for n in per_split.values()) or not 8 <= sides[0] <= sides[1]:
        raise ValueError(f"need classes >= 2, >= 1 photo per class and split, 8 <= sides[0] <= sides[1]; "
                         f"got classes={classes}, per_split={per_split}, sides={sides}")
    expected = _expected(dict(per_split), classes, tuple(sides), seed, quality)
    try:
        drawn = json.loads((root / _MARKER).read_text())
    except (OSError, ValueError):
        if root.exists() and any(root.iterdir()):
            raise ValueError(f"{root} exists and is not a photos dataset (no {_MARKER}); give an empty or new "
                             "folder as root") from None
    else:
        if drawn == expected:
            return root
        # Never replaced: the folder may hold more than the photos (the example's cache lives in it).
        raise ValueError(f"{root} holds photos drawn with {drawn}, not {expected}; pass another root, "
                         "or delete this folder to draw them again")
    tmp = root.parent / f".{root.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    try:
        for split_no, (split, n) in enumerate(per_split.items()):
            for label in range(classes):
                folder = tmp / split / f"class_{label}"
                folder.mkdir(parents=True)
                for i in range(n):
                    rng = np.random.default_rng([seed, split_no, label, i])
                    draw_photo(label, classes, rng, sides).save(folder / f"{i:05d}.jpg", quality=quality)
        (tmp / _MARKER).write_text(json.dumps(expected))
        os.rename(tmp, root)  # onto a missing or empty folder (checked above)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def read_bytes(path: str) -> torch.Tensor:
    """A file's bytes as a uint8 1-D tensor (what a JPEG field stores as is).

    An empty file gives an empty tensor, which the store refuses naming the sample and the
    file (``torch.frombuffer`` raised its own error on 0 bytes first)."""
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8))


class Photos(OptimizedDataModule):
    """The generated photos as an :class:`~lightning_fastdata.OptimizedDataModule`.

    Samples are ``{"image": JPEG bytes, "label": int}``; with ``encode={"image": "jpeg"}``
    the store keeps the files' bytes (re-encoding only photos larger than ``max_side``), and
    the batch reaches the augmentation as a list of decoded uint8 (3, H, W) images.

    Args:
        root: Dataset folder (written on first use, see :func:`write_photos`).
        train_per_class: Training photos per class.
        val_per_class: Validation photos per class.
        classes: Number of classes.
        data_seed: Seed the photos are drawn from.
        sides: Smallest and largest side of the photos in pixels.
        batch_size: Training batch size.
        **kwargs: Any other :class:`~lightning_fastdata.OptimizedDataModule` argument
            (``encode``, ``max_side``, ``train_augment``, ``eval_augment``, ``strategy``, ...).
    """

    def __init__(self, root: str = "imagenet_like_data", train_per_class: int = 200, val_per_class: int = 50,
                 classes: int = 4, data_seed: int = 0, sides: tuple[int, int] = (200, 600), batch_size: int = 64,
                 **kwargs: Any) -> None:
        super().__init__(batch_size=batch_size, **kwargs)
        self.root, self.classes, self.data_seed, self.sides = root, classes, data_seed, tuple(sides)
        self.per_split = {"train": train_per_class, "val": val_per_class}

    def source(self, split: str) -> Any:
        """ImageFolder over the split's JPEG files, each read as bytes; train and val only."""
        from torchvision.datasets import ImageFolder

        if split not in self.per_split:
            return None
        root = write_photos(self.root, self.per_split, self.classes, sides=self.sides, seed=self.data_seed)
        return ImageFolder(str(root / split), loader=read_bytes)

    def static_transform(self, sample: Any) -> dict[str, Any]:
        """(bytes, label) -> {"image": bytes, "label": label}."""
        data, label = sample
        return {"image": data, "label": label}


class SmallNet(L.LightningModule):
    """A small CNN for 224x224 RGB: four strided conv blocks, global pooling, a linear head.

    Args:
        num_classes: Output classes.
        width: Channels of the first block (doubled in each next one).
        lr: Adam learning rate.
    """

    def __init__(self, num_classes: int = 4, width: int = 16, lr: float = 3e-3) -> None:
        super().__init__()
        if width < 1 or num_classes < 2 or lr <= 0:
            raise ValueError(f"need width >= 1, num_classes >= 2, lr > 0; got {width}, {num_classes}, {lr}")
        self.save_hyperparameters()

        def block(cin: int, cout: int, stride: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

        self.net = nn.Sequential(block(3, width, 4), block(width, 2 * width, 2), block(2 * width, 4 * width, 2),
                                 block(4 * width, 4 * width, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(4 * width, num_classes))
        self.lr = lr

    def on_fit_start(self) -> None:
        """Refuse a data module with another number of classes (else cross-entropy fails on a label)."""
        classes = getattr(self.trainer.datamodule, "classes", None)
        if classes is not None and classes != self.hparams.num_classes:
            raise ValueError(f"model.num_classes={self.hparams.num_classes} but data.classes={classes}: "
                             "set both to the same number")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch["image"]), batch["label"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch["image"])
        self.log("val_loss", F.cross_entropy(logits, batch["label"]), prog_bar=True)
        self.log("val_acc", (logits.argmax(1) == batch["label"]).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)
