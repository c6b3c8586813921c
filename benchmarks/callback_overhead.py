"""FastDataCallback's cost on a tiny model's training step, side by side with and without it.

Each repeat trains the same tiny model for ``--steps`` steps three times: with only a
timing callback, with a no-op ``Callback`` added (what Lightning's hook dispatch costs
any callback), and with ``FastDataCallback`` added (the arm order rotates between
repeats), on an in-memory dataset so that the step is as short as Lightning allows: the
worst case for a per-step profiler. The headline figure is the median over repeats of
the per-step median of each arm; the overhead is their relative difference, as a share
of the step time without the callback. The mean step (every step, the logging-interval
ones included) is reported too, as are two figures free of the shared machine's noise:
the callback's own code per step in a tight loop (``hot_path``) and what Lightning's
dispatch of one hook to one callback costs (``dispatch``). Writes JSON to
``benchmarks/results/callback_overhead.json``.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/callback_overhead.py --steps 400 --repeats 9
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastdata import FastDataCallback


class Tiny(L.LightningModule):
    """``linear``: one Linear layer on 32 features (the shortest step Lightning can run);
    ``cnn``: two 3x3 convolutions on 3x16x16 images (a small but real model)."""

    def __init__(self, kind: str = "linear") -> None:
        super().__init__()
        if kind == "linear":
            self.net = torch.nn.Linear(32, 10)
        else:
            self.net = torch.nn.Sequential(
                torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                torch.nn.Flatten(), torch.nn.Linear(32, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


SHAPES = {"linear": (32,), "cnn": (3, 16, 16)}


class StepTimer(L.Callback):
    """Median wall time between consecutive ``on_train_batch_end`` calls (last callback: includes the others).

    A median per run filters the preemption spikes of a shared machine; the per-epoch work
    of the profiler (summaries, epoch logging) is reported apart as ``epoch_end_ms``.
    """

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.epoch_end_s = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())

    def on_train_epoch_end(self, trainer, pl_module):
        self.epoch_end_s = time.perf_counter() - self.ends[-1]

    @property
    def step_s(self) -> float:
        return statistics.median(b - a for a, b in zip(self.ends, self.ends[1:], strict=False))

    @property
    def mean_step_s(self) -> float:
        """Every step counted, the logging-interval ones included (amortised per-interval work)."""
        return (self.ends[-1] - self.ends[0]) / (len(self.ends) - 1)


ARMS = ("without", "noop_callback", "fastdata")


def run(steps: int, arm: str, root: str, kind: str = "linear") -> tuple[float, float]:
    """One fit of ``steps`` steps: (median step, mean step) in seconds."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * 64, *SHAPES[kind], generator=g),
                         torch.randint(0, 10, (steps * 64,), generator=g))
    timer = StepTimer()
    extra = {"without": [], "noop_callback": [L.Callback()], "fastdata": [FastDataCallback(print_report=False)]}
    callbacks = extra[arm]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=CSVLogger(root), log_every_n_steps=50,
                        callbacks=[*callbacks, timer], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root)
    trainer.fit(Tiny(kind), DataLoader(data, batch_size=64, shuffle=True))
    return timer.step_s, timer.mean_step_s


def measure(kind: str, steps: int, repeats: int, root: str) -> dict:
    """Median per-step time of each arm over ``repeats`` rotated repeats."""
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    means: dict[str, list[float]] = {arm: [] for arm in ARMS}
    run(max(20, steps // 4), "fastdata", root, kind)  # warm-up: imports, allocator, first-call costs
    for r in range(repeats):
        order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]  # rotate, so no arm always runs first
        for arm in order:
            median_s, mean_s = run(steps, arm, root, kind)
            times[arm].append(median_s)
            means[arm].append(mean_s)
    base, noop, prof = (statistics.median(times[a]) for a in ARMS)
    mean_base, mean_noop, mean_prof = (statistics.median(means[a]) for a in ARMS)

    def paired(runs: dict[str, list[float]], arm: str) -> float:
        # Paired differences (same repeat) cancel slow drifts of a shared machine better than two medians.
        return statistics.median((b - a) / a for a, b in zip(runs["without"], runs[arm], strict=True))

    return {
        "steps": steps,
        "repeats": repeats,
        "step_ms_without": 1e3 * base,
        "step_ms_noop_callback": 1e3 * noop,
        "step_ms_with": 1e3 * prof,
        "overhead_frac": (prof - base) / base,
        "overhead_frac_paired_median": paired(times, "fastdata"),
        "overhead_us_per_step": 1e6 * (prof - base),
        "lightning_dispatch_frac": (noop - base) / base,
        "lightning_dispatch_frac_paired_median": paired(times, "noop_callback"),
        "overhead_vs_noop_callback_frac": (prof - noop) / noop,
        "mean_step_ms_without": 1e3 * mean_base,
        "mean_step_ms_noop_callback": 1e3 * mean_noop,
        "mean_step_ms_with": 1e3 * mean_prof,
        "mean_overhead_frac": (mean_prof - mean_base) / mean_base,
        "mean_overhead_frac_paired_median": paired(means, "fastdata"),
        "runs_step_ms": {a: [1e3 * v for v in times[a]] for a in ARMS},
        "runs_mean_step_ms": {a: [1e3 * v for v in means[a]] for a in ARMS},
    }


def dispatch_us(calls: int = 20000, repeats: int = 7) -> dict:
    """What Lightning's dispatch of one per-step hook costs per callback, and which hooks reach each.

    Times ``_call_callback_hooks`` for ``on_before_zero_grad`` with no callback, with a
    no-op ``Callback`` and with ``FastDataCallback`` (which keeps the per-step hooks it does
    not use out of the dispatch), and lists the per-step training hooks each one receives.
    """
    from lightning.pytorch.trainer import call

    hooks = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
             "on_before_zero_grad", "on_train_batch_end")
    out: dict = {"calls": calls, "repeats": repeats}
    arms = (("none", None), ("noop_callback", L.Callback()), ("fastdata", FastDataCallback(print_report=False)))
    for name, cb in arms:
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[cb] if cb else [],
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.strategy.connect(Tiny())
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                call._call_callback_hooks(trainer, "on_before_zero_grad", None)
            runs.append((time.perf_counter() - t0) / calls)
        out[f"{name}_us"] = 1e6 * statistics.median(runs)
        if cb is not None:
            out[f"{name}_step_hooks"] = [h for h in hooks if callable(getattr(cb, h))]
    out["us_per_hook_per_callback"] = out["noop_callback_us"] - out["none_us"]
    return out


def hot_path_us(calls: int = 20000, repeats: int = 7) -> dict:
    """The callback's own cost per step, in a tight loop: the loop's per-step calls with and without it.

    One "step" is what the training loop does per batch that the callback touches: the
    fetch hooks, ``batch_to_device`` and the two batch hooks (logging interval included).
    Free of the step-to-step noise of a shared machine, unlike the side-by-side runs.
    """
    cb = FastDataCallback(print_report=False)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=CSVLogger(root), log_every_n_steps=50,
                            enable_progress_bar=False, enable_model_summary=False)
        model = Tiny()
        trainer.strategy.connect(model)
        cb.setup(trainer, model, "fit")
        loop, strategy = trainer.fit_loop.epoch_loop, trainer.strategy
        batch = (torch.zeros(64, 32), torch.zeros(64, dtype=torch.long))
        noop = L.Callback()

        def wrapped() -> None:
            loop._on_before_fetch()
            loop._on_after_fetch()
            strategy.batch_to_device(batch, dataloader_idx=0)
            cb.on_train_batch_start(trainer, model, batch, 0)
            cb.on_train_batch_end(trainer, model, None, batch, 0)
            loop._batches_that_stepped += 1

        def plain() -> None:
            type(loop)._on_before_fetch(loop)
            type(loop)._on_after_fetch(loop)
            type(strategy).batch_to_device(strategy, batch, dataloader_idx=0)
            noop.on_train_batch_start(trainer, model, batch, 0)
            noop.on_train_batch_end(trainer, model, None, batch, 0)
            loop._batches_that_stepped += 1

        out: dict[str, list[float]] = {"plain": [], "wrapped": []}
        for _ in range(repeats):
            for name, fn in (("plain", plain), ("wrapped", wrapped)):
                cb.on_train_epoch_start(trainer, model)
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                out[name].append((time.perf_counter() - t0) / calls)
        cb.teardown(trainer, model, "fit")
    plain_us, wrapped_us = (1e6 * statistics.median(out[k]) for k in ("plain", "wrapped"))
    return {"calls": calls, "repeats": repeats, "plain_us": plain_us, "wrapped_us": wrapped_us,
            "added_us_per_step": wrapped_us - plain_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--models", nargs="+", default=["linear", "cnn"], choices=sorted(SHAPES))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "callback_overhead.json"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    result: dict = {"benchmark": "callback_overhead", "models": {}}
    hot = result["hot_path"] = hot_path_us()
    print(f"hot path: {hot['added_us_per_step']:.2f} us added per step "
          f"({hot['plain_us']:.2f} -> {hot['wrapped_us']:.2f} us for the calls it touches)")
    disp = result["dispatch"] = dispatch_us()
    print(f"Lightning's dispatch: {disp['us_per_hook_per_callback']:.2f} us per hook per callback; per training "
          f"step a no-op Callback receives {len(disp['noop_callback_step_hooks'])} hooks, FastDataCallback "
          f"{len(disp['fastdata_step_hooks'])} ({', '.join(disp['fastdata_step_hooks'])})")
    with tempfile.TemporaryDirectory() as root:
        for kind in args.models:
            r = result["models"][kind] = measure(kind, args.steps, args.repeats, root)
            r["hot_path_frac"] = hot["added_us_per_step"] / (1e3 * r["step_ms_without"])
            r["dispatch_frac"] = (len(disp["fastdata_step_hooks"]) * disp["us_per_hook_per_callback"]
                                  / (1e3 * r["step_ms_without"]))
            n_hooks = len(disp["fastdata_step_hooks"])
            print(f"{kind}: step {r['step_ms_without']:.3f} ms without, {r['step_ms_with']:.3f} ms with "
                  f"FastDataCallback: overhead {100 * r['overhead_frac']:+.2f}% of the step "
                  f"({r['overhead_us_per_step']:+.1f} us; paired median "
                  f"{100 * r['overhead_frac_paired_median']:+.2f}%; every step counted, logging ones included: "
                  f"{100 * r['mean_overhead_frac_paired_median']:+.2f}%), median over {r['repeats']} repeats of "
                  f"{r['steps']} steps")
            print(f"    for scale: a no-op Callback costs {100 * r['lightning_dispatch_frac']:+.2f}% "
                  f"(paired {100 * r['lightning_dispatch_frac_paired_median']:+.2f}%; Lightning's hook dispatch); "
                  f"of FastDataCallback's cost, its own code is {100 * r['hot_path_frac']:.2f}% of the step and "
                  f"Lightning's dispatch of its {n_hooks} hooks {100 * r['dispatch_frac']:.2f}%")
    result["machine"] = {
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "lightning": L.__version__,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
