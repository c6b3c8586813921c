"""Train a 3-D U-Net on CT-like volumes from a YAML config with LightningCLI.

    python examples/volumes/train.py fit --config examples/volumes/config.yaml

The config names the data module (``volume_data.Volumes``: NIfTI cases in a Medical
Segmentation Decathlon layout, a synthetic set written into ``data.root`` on first use),
its field kinds (the label is a mask), the augmentations run batched on the device
(label-centred crops, flips, quarter turns, intensity window and jitter), the model
(``unet3d.UNet3D``) and the Trainer's callbacks. Any value can be overridden on the
command line, e.g. ``--data.root volumes_96 --data.cases 48 --data.size 96 --trainer.max_epochs 30``
(a new root: a generated set is never redrawn in place, and one drawn with other
``cases``/``size``/``data_seed`` is an error); ``--print_config`` shows the full, validated
configuration. The modules next to this script are importable by their names because
Python puts this folder on ``sys.path``.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.cli import LightningCLI


def main(args: list[str] | None = None) -> None:
    """Run LightningCLI with any LightningModule and any LightningDataModule named by class_path."""
    LightningCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
