"""FastDataCallback's cost on a tiny model's training step, side by side with and without it.

Three arms train the same tiny model on an in-memory dataset, so that the step is as
short as Lightning allows (the worst case for a per-step profiler): without any added
callback, with a no-op ``Callback`` (what Lightning's hook dispatch costs any callback,
for scale) and with ``FastDataCallback``. Every run is a fresh process: a warm-up fit,
then ``--fits`` fits of ``--steps`` steps, and the median step of each (the median
filters the preemption spikes of a shared machine); arms alternate, in rotating order,
``--processes`` times.

Why fresh processes: on this machine a process's memory layout (randomised per process)
moves a 0.7 ms step by about +-1.5%, and arms compared inside one process inherit that
process's bias, so that variants doing strictly less work measured slower. Across
processes the bias is random and the median over processes cancels it. The headline
overhead is the median step with the callback over the median step without it, less 1,
with a bootstrap 95% interval over processes. Two figures free of that noise come with
it: the callback's own code per step in a tight loop (``hot_path``) and what Lightning's
dispatch of one hook to one callback costs (``dispatch``); ``callback_instructions.py``
counts instructions. Writes JSON to ``benchmarks/results/callback_overhead.json``.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/callback_overhead.py --processes 24
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import numpy as np
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


def child(arm: str, kind: str, steps: int, fits: int) -> None:
    """One process of one arm: a warm-up fit, then ``fits`` timed fits; prints (median, mean) step as JSON."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        run(max(20, steps // 4), arm, root, kind)  # imports, allocator, first-call costs
        runs = [run(steps, arm, root, kind) for _ in range(fits)]
    print(json.dumps({"step_s": statistics.median(r[0] for r in runs),
                      "mean_step_s": statistics.median(r[1] for r in runs)}))


def _spawn(arm: str, kind: str, steps: int, fits: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--child", arm, kind, str(steps), str(fits)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{arm}/{kind} run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ratio_interval(with_: list[float], without: list[float], draws: int = 4000) -> tuple[float, float]:
    """Bootstrap 95% interval of median(with) / median(without) - 1, resampling processes."""
    rng = np.random.default_rng(0)
    a, b = np.asarray(with_), np.asarray(without)
    ratios = [np.median(rng.choice(a, a.size)) / np.median(rng.choice(b, b.size)) - 1 for _ in range(draws)]
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(lo), float(hi)


def measure(kind: str, steps: int, fits: int, processes: int) -> dict:
    """Median step of each arm over ``processes`` fresh processes, arms in rotating order."""
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    means: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for p in range(processes):
        for arm in ARMS[p % len(ARMS):] + ARMS[:p % len(ARMS)]:
            out = _spawn(arm, kind, steps, fits)
            times[arm].append(out["step_s"])
            means[arm].append(out["mean_step_s"])
    base, noop, prof = (statistics.median(times[a]) for a in ARMS)
    mean_base, mean_prof = statistics.median(means["without"]), statistics.median(means["fastdata"])
    lo, hi = _ratio_interval(times["fastdata"], times["without"])
    noop_lo, noop_hi = _ratio_interval(times["noop_callback"], times["without"])
    return {
        "steps": steps, "fits_per_process": fits, "processes": processes,
        "step_ms_without": 1e3 * base, "step_ms_noop_callback": 1e3 * noop, "step_ms_with": 1e3 * prof,
        "overhead_frac": (prof - base) / base, "overhead_frac_ci95": [lo, hi],
        "overhead_us_per_step": 1e6 * (prof - base),
        "lightning_dispatch_frac": (noop - base) / base, "lightning_dispatch_frac_ci95": [noop_lo, noop_hi],
        "mean_step_ms_without": 1e3 * mean_base, "mean_step_ms_with": 1e3 * mean_prof,
        "mean_overhead_frac": (mean_prof - mean_base) / mean_base,
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

    One "step" is what the training loop does per batch that the callback touches: the two
    fetch hooks, ``batch_to_device`` and the optimisation run (here an empty one, so that
    only the wrapper's cost remains; the logging interval included). Free of the
    step-to-step noise of a shared machine, unlike the side-by-side runs.
    """
    cb = FastDataCallback(print_report=False)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=CSVLogger(root), log_every_n_steps=50,
                            enable_progress_bar=False, enable_model_summary=False)
        model = Tiny()
        trainer.strategy.connect(model)
        loop, strategy = trainer.fit_loop.epoch_loop, trainer.strategy
        plain_before, plain_after = loop._on_before_fetch, loop._on_after_fetch
        cb.setup(trainer, model, "fit")
        batch = (torch.zeros(64, 32), torch.zeros(64, dtype=torch.long))
        kwargs = {"batch": batch, "batch_idx": 0}

        def empty_run(optimizer: object, batch_idx: int, kwargs: dict) -> None:
            return None

        timed_run = cb._wrap_step(empty_run, trainer, cb._train)  # what setup() puts on automatic_optimization.run

        def wrapped() -> None:
            loop._on_before_fetch()
            loop._on_after_fetch()
            strategy.batch_to_device(batch, dataloader_idx=0)
            timed_run(None, 0, kwargs)
            loop._batches_that_stepped += 1

        def plain() -> None:
            plain_before()
            plain_after()
            type(strategy).batch_to_device(strategy, batch, dataloader_idx=0)
            empty_run(None, 0, kwargs)
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
    parser.add_argument("--fits", type=int, default=2, help="timed fits per process")
    parser.add_argument("--processes", type=int, default=24, help="fresh processes per arm")
    parser.add_argument("--models", nargs="+", default=["linear", "cnn"], choices=sorted(SHAPES))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "callback_overhead.json"))
    parser.add_argument("--child", nargs=4, metavar=("ARM", "MODEL", "STEPS", "FITS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        arm, kind, steps, fits = args.child
        child(arm, kind, int(steps), int(fits))
        return
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    result: dict = {"benchmark": "callback_overhead", "models": {}}
    hot = result["hot_path"] = hot_path_us()
    print(f"hot path: {hot['added_us_per_step']:.2f} us added per step "
          f"({hot['plain_us']:.2f} -> {hot['wrapped_us']:.2f} us for the calls it touches)")
    disp = result["dispatch"] = dispatch_us()
    print(f"Lightning's dispatch: {disp['us_per_hook_per_callback']:.2f} us per hook per callback; per training "
          f"step a no-op Callback receives {len(disp['noop_callback_step_hooks'])} hooks, FastDataCallback "
          f"{len(disp['fastdata_step_hooks'])} ({', '.join(disp['fastdata_step_hooks']) or 'none'})")
    for kind in args.models:
        r = result["models"][kind] = measure(kind, args.steps, args.fits, args.processes)
        r["hot_path_frac"] = hot["added_us_per_step"] / (1e3 * r["step_ms_without"])
        lo, hi = r["overhead_frac_ci95"]
        print(f"{kind}: step {r['step_ms_without']:.3f} ms without, {r['step_ms_with']:.3f} ms with "
              f"FastDataCallback: overhead {100 * r['overhead_frac']:+.2f}% of the step "
              f"(95% interval {100 * lo:+.2f}% to {100 * hi:+.2f}%; {r['overhead_us_per_step']:+.1f} us; every step "
              f"counted, logging ones included: {100 * r['mean_overhead_frac']:+.2f}%), medians over "
              f"{r['processes']} processes x {r['fits_per_process']} fits of {r['steps']} steps")
        nlo, nhi = r["lightning_dispatch_frac_ci95"]
        print(f"    for scale: a no-op Callback costs {100 * r['lightning_dispatch_frac']:+.2f}% "
              f"({100 * nlo:+.2f}% to {100 * nhi:+.2f}%; Lightning's hook dispatch); FastDataCallback's own code "
              f"is {100 * r['hot_path_frac']:.2f}% of the step in a tight loop")
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
