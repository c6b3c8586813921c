"""Train from a YAML config with LightningCLI.

    python examples/train.py fit --config examples/config.yaml

The config names the data module (``lightning_fastdata.demo.DemoImages``, which writes
the demo PNG dataset on first use), its on-device augmentations, the model and the
Trainer's callbacks (``lightning_fastdata.FastDataCallback``). Any value can be
overridden on the command line, e.g. ``--data.batch_size 256 --trainer.max_epochs 5``;
``--print_config`` shows the full, validated configuration.
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
