"""Replay mode: whatever the replayed steps touch is as it was once the fit returns."""

from __future__ import annotations

import random

import lightning as L
import numpy as np
import torch
from _helpers import trainer as make_trainer
from _timing import Spend, loader

from lightning_fastdata import DataWaitProfiler


class MixupManual(L.LightningModule):
    """A manually optimised step that draws from numpy and python random and steps its scheduler."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 2)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        lam = float(np.random.beta(0.4, 0.4)) * random.random()  # mixup-style host draws
        loss = torch.nn.functional.cross_entropy(self.net(x * lam), y)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.lr_schedulers().step()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)]


def _after_fit(tmp_path, replay_steps: int) -> tuple:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    prof = DataWaitProfiler(replay_steps=replay_steps, replay_warmup=1, print_report=False)
    trainer = make_trainer(tmp_path / f"replay{replay_steps}", callbacks=[prof])
    trainer.fit(MixupManual(), loader(16, 4, Spend(0.0)))
    if replay_steps:
        assert prof.report()["replay"]["steps"] == replay_steps
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    return (np.random.random(), random.random(), torch.rand(()).item(), scheduler.last_epoch,
            scheduler.get_last_lr(), trainer.optimizers[0].param_groups[0]["lr"])


def test_replay_restores_numpy_random_and_scheduler_states(tmp_path):
    # Replay used to restore only torch's RNG: numpy, python random and a scheduler stepped by
    # the replayed steps stayed advanced, so what ran after the fit (a test, a saved
    # checkpoint's scheduler) depended on whether replay was on.
    assert _after_fit(tmp_path, 4) == _after_fit(tmp_path, 0)
