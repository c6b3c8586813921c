"""The one door to private Lightning and torch names: each is reached only through this module.

Every function here names the private attribute it touches and the versions it was
checked on, so an upgrade that moves a name fails here, loudly, instead of deep inside a fit.
"""

from __future__ import annotations

import warnings
from typing import Any


def shutdown_dataloader_workers(dataloader: Any) -> None:
    """Stop a ``torch.utils.data.DataLoader``'s worker processes now (persistent ones included).

    Touches ``DataLoader._iterator`` and its ``_shutdown_workers`` (torch 2.5 - 2.14).
    """
    it = getattr(dataloader, "_iterator", None)
    stop = getattr(it, "_shutdown_workers", None)
    if stop is not None:
        stop()
    if it is not None:
        dataloader._iterator = None


def quiet_shared_hook_warnings() -> None:
    """Silence Lightning's "overridden in both LightningModule and LightningDataModule" warning.

    ``OptimizedDataModule`` owns the batch hooks and calls the LightningModule's own ones
    itself, so the warning (``_DataHookSelector.get_instance``, Lightning 2.2 - 2.6) would
    claim a hook is skipped when it is not. Only the three batch hooks are silenced.
    """
    warnings.filterwarnings(
        "ignore",
        message=r"You have overridden `(on_before_batch_transfer|transfer_batch_to_device|on_after_batch_transfer)`"
                r" in both `LightningModule` and `LightningDataModule`",
    )
