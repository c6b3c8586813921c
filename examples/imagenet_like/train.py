"""Train the ImageNet-like example from its YAML config with LightningCLI.

    python examples/imagenet_like/train.py fit --config examples/imagenet_like/config.yaml

The config names the data module (``photos.Photos``: JPEG files of varying sizes, stored as
JPEG with ``max_side=256``, decoded in batches), its augmentations (RandomResizedCrop 224 +
flip + normalize for training, Resize 256 + CenterCrop 224 for evaluation), the model and
the callbacks. Override any value on the command line, e.g. ``--data.strategy workers``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so the config can name photos.Photos


def main(args: list[str] | None = None) -> None:
    """Run LightningCLI with any LightningModule and LightningDataModule named by class_path."""
    LightningCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                 save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
