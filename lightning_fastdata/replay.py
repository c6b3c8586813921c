"""Replay mode: the compute-only step time, on batches captured on the device, with no loader involved.

After training, the first few training batches (as the step received them: on the device,
augmented) are replayed for a number of optimisation steps; the model, optimizer, LR
scheduler and RNG (torch, CUDA, numpy, python ``random``) states are restored afterwards,
so the trained model, and whatever runs after the fit, are unchanged.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
import numpy as np
import torch

from lightning_fastdata import _lightning as door


class Replay:
    """Captures batches during training and replays them.

    Args:
        steps: Timed replay steps (0: off).
        batches: How many training batches are captured (the first ones).
        warmup: Untimed replay steps first (allocator, kernel caches).
    """

    def __init__(self, steps: int, batches: int, warmup: int) -> None:
        self.steps, self.batches, self.warmup = steps, batches, warmup
        self.captured: list[Any] = []

    def wants_more(self) -> bool:
        """Whether training batches are still to be captured."""
        return bool(self.steps) and len(self.captured) < self.batches

    def capture(self, batch: Any) -> bool:
        """Keep ``batch``; returns whether more are wanted."""
        self.captured.append(batch)
        return len(self.captured) < self.batches

    def run(self, trainer: L.Trainer, pl_module: L.LightningModule, clock: Callable[[], float], cuda: bool,
            real: Mapping[str, Any] | None) -> dict[str, Any]:
        """Optimise on the captured batches only; restore every state it touched.

        Args:
            trainer: The Trainer that trained ``pl_module``.
            pl_module: The model.
            clock: Time source in seconds.
            cuda: Whether the model runs on a GPU (per-step host times then mean nothing: the total is used).
            real: The training summary of the real run (``step_ms_p50``, ``compute_ms_p50``), or None.
        """
        optimizers = list(trainer.optimizers)
        model_state = copy.deepcopy(pl_module.state_dict())
        opt_states = [copy.deepcopy(o.state_dict()) for o in optimizers]
        # A manually optimised step may step its schedulers itself: without this, a checkpoint
        # saved after the fit would resume with the scheduler ahead of the optimizer's lr.
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs
                      if callable(getattr(config.scheduler, "load_state_dict", None))]
        scheduler_states = [copy.deepcopy(s.state_dict()) for s in schedulers]
        cpu_rng = torch.get_rng_state()
        # A step may draw from numpy or python random too (mixup's np.random.beta).
        np_rng, py_rng = np.random.get_state(), random.getstate()
        cuda_rng = torch.cuda.get_rng_state_all() if cuda else None
        patched = {name: getattr(pl_module, name) for name in ("log", "log_dict")}
        # self.log outside the loop has no result collection to write to; replay logs nothing.
        object.__setattr__(pl_module, "log", _no_log)
        object.__setattr__(pl_module, "log_dict", _no_log)
        times: list[float] = []
        try:
            for i in range(self.warmup):
                self._step(trainer, pl_module, optimizers, i)
            _sync(cuda)
            t_all = clock()
            for i in range(self.steps):
                t0 = clock()
                self._step(trainer, pl_module, optimizers, i)
                times.append(clock() - t0)
            _sync(cuda)
            total = clock() - t_all
        finally:
            for name, old in patched.items():
                if getattr(old, "__self__", None) is pl_module:
                    object.__delattr__(pl_module, name)  # it came from the class
                else:
                    object.__setattr__(pl_module, name, old)
            pl_module.load_state_dict(model_state)
            for opt, state in zip(optimizers, opt_states, strict=True):
                opt.load_state_dict(state)
                opt.zero_grad(set_to_none=True)
            for scheduler, state in zip(schedulers, scheduler_states, strict=True):
                scheduler.load_state_dict(state)
            torch.set_rng_state(cpu_rng)
            np.random.set_state(np_rng)
            random.setstate(py_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        step_s = total / self.steps if cuda else float(np.median(times))
        out: dict[str, Any] = {"steps": self.steps, "batches": len(self.captured), "step_ms": 1e3 * step_s}
        if real is not None and real["steps"]:
            real_ms = real["step_ms_p50"]
            out.update(real_step_ms=real_ms, real_compute_ms=real["compute_ms_p50"],
                       slowdown=real_ms / (1e3 * step_s) if step_s > 0 else math.inf,
                       loader_cost_ms=real_ms - 1e3 * step_s)
        return out

    def _step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizers: list[Any], i: int) -> None:
        batch = self.captured[i % len(self.captured)]
        try:
            args = door.training_step_args(trainer, batch, i)
        except door.DoorClosed:
            args = (batch, i)
        out = trainer.strategy.training_step(*args)
        if not pl_module.automatic_optimization:
            return  # the step optimised itself
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor) or not optimizers:
            return
        trainer.strategy.backward(loss, optimizers[0])
        optimizers[0].step()
        optimizers[0].zero_grad(set_to_none=True)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None
