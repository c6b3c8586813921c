"""FastDataCallback's cost on a tiny model's training step, side by side with and without it.

Three arms train the same tiny model on an in-memory dataset, so that the step is as
short as Lightning allows (the worst case for a per-step profiler): without any added
callback, with a no-op ``Callback`` (what Lightning's hook dispatch costs any callback,
for scale) and with ``FastDataCallback``. Models: ``linear`` (one Linear layer, the
shortest step Lightning runs) and ``cnn`` (two small convolutions, a tiny but real model).

Every process is fresh and runs every arm: a warm-up fit per arm, then ``--rounds``
rounds of one fit per arm (order reversed every round, first arm rotated between
processes); each fit's figure is its median step (the median filters the preemption
spikes of a shared machine). Per process, the overhead is the arm's median over its fits
against the no-callback arm's, less 1; the headline is the median of that ratio over
``--processes`` processes, with a bootstrap 95% interval.

Why this design: a process's memory layout (randomised per process) moves a 0.7 ms step
by about +-1.5%, and the machine drifts over minutes (the small CNN's step moved between
3.3 and 6.0 ms across processes). Both cancel inside a process, where the arms run within
seconds of each other; the arm-specific part of the layout bias is random across
processes and the median over processes averages it out. Comparing arms run in separate
processes, as earlier versions did, left a +-1% interval on the 0.7 ms step. Two figures
free of that noise come with it: the callback's own code per step in a tight loop
(``hot_path``) and what Lightning's dispatch of one hook to one callback costs
(``dispatch``); ``callback_instructions.py`` counts instructions. Writes JSON to
``benchmarks/results/callback_overhead.json``.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/callback_overhead.py --processes 40
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
from collections.abc import Callable, Sequence
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
#: Steps per fit: about 0.3 s of steps for either model.
STEPS = {"linear": 400, "cnn": 200}


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


#: The callbacks each arm adds (``fastdata_no_profile`` is counted by ``callback_instructions.py`` only).
ARM_CALLBACKS: dict[str, Callable[[], list[L.Callback]]] = {
    "without": lambda: [],
    "noop_callback": lambda: [L.Callback()],
    "fastdata": lambda: [FastDataCallback(print_report=False)],
    "fastdata_no_profile": lambda: [FastDataCallback(print_report=False, profile=False)],
}


def fit(steps: int, arm: str, root: str, kind: str = "linear", extra: Sequence[L.Callback] = ()) -> None:
    """One fit of the tiny ``kind`` model for ``steps`` steps with ``arm``'s callbacks, then ``extra``."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * 64, *SHAPES[kind], generator=g),
                         torch.randint(0, 10, (steps * 64,), generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=CSVLogger(root), log_every_n_steps=50,
                        callbacks=[*ARM_CALLBACKS[arm](), *extra], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.fit(Tiny(kind), DataLoader(data, batch_size=64, shuffle=True))


def run(steps: int, arm: str, root: str, kind: str = "linear") -> tuple[float, float]:
    """One timed fit of ``steps`` steps: (median step, mean step) in seconds."""
    timer = StepTimer()
    fit(steps, arm, root, kind, extra=[timer])
    return timer.step_s, timer.mean_step_s


def child(order: list[str], kind: str, steps: int, rounds: int) -> None:
    """One process, every arm: a warm-up fit per arm, then ``rounds`` rounds of one fit per arm.

    The arm order reverses every round (ABC CBA ABC ...), so that a drift within the process
    falls on every arm alike. Prints each arm's (median step, mean step) per fit as JSON.
    """
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out: dict[str, dict[str, list[float]]] = {arm: {"step_s": [], "mean_step_s": []} for arm in order}
    with tempfile.TemporaryDirectory() as root:
        for arm in order:
            run(max(20, steps // 4), arm, root, kind)  # imports, allocator, first-call costs
        for r in range(rounds):
            for arm in order if r % 2 == 0 else order[::-1]:
                median_s, mean_s = run(steps, arm, root, kind)
                out[arm]["step_s"].append(median_s)
                out[arm]["mean_step_s"].append(mean_s)
    print(json.dumps(out))


def _spawn(order: list[str], kind: str, steps: int, rounds: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--child", ",".join(order), kind, str(steps), str(rounds)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} run {order} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median_interval(values: list[float], draws: int = 4000) -> tuple[float, float]:
    """Bootstrap 95% interval of the median of ``values`` (one per process), resampling processes."""
    rng = np.random.default_rng(0)
    a = np.asarray(values)
    lo, hi = np.percentile(np.median(rng.choice(a, (draws, a.size)), axis=1), [2.5, 97.5])
    return float(lo), float(hi)


def measure(kind: str, steps: int, rounds: int, processes: int) -> dict:
    """Per process, each arm's median step over its fits and its ratio to the arm without a callback.

    The headline is the median over processes of that within-process ratio, less 1: each
    process's layout bias (about +-1.5% of the step, see the module docstring) moves both
    sides of the ratio and cancels, while the per-arm part of it is random across processes.
    """
    steps_by_arm: dict[str, list[float]] = {arm: [] for arm in ARMS}
    means_by_arm: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for p in range(processes):
        order = list(ARMS[p % len(ARMS):] + ARMS[:p % len(ARMS)])  # no arm always runs first
        out = _spawn(order, kind, steps, rounds)
        for arm in ARMS:
            steps_by_arm[arm].append(statistics.median(out[arm]["step_s"]))
            means_by_arm[arm].append(statistics.median(out[arm]["mean_step_s"]))

    def paired(by_arm: dict[str, list[float]], arm: str) -> list[float]:
        return [w / b - 1 for w, b in zip(by_arm[arm], by_arm["without"], strict=True)]

    ratios, noop_ratios, mean_ratios = (paired(steps_by_arm, "fastdata"), paired(steps_by_arm, "noop_callback"),
                                        paired(means_by_arm, "fastdata"))
    base, noop, prof = (statistics.median(steps_by_arm[a]) for a in ARMS)
    overhead = statistics.median(ratios)
    return {
        "steps": steps, "rounds_per_process": rounds, "processes": processes,
        "step_ms_without": 1e3 * base, "step_ms_noop_callback": 1e3 * noop, "step_ms_with": 1e3 * prof,
        "overhead_frac": overhead, "overhead_frac_ci95": list(_median_interval(ratios)),
        "overhead_us_per_step": 1e6 * overhead * base,
        "processes_over_1pct": sum(r >= 0.01 for r in ratios),
        "lightning_dispatch_frac": statistics.median(noop_ratios),
        "lightning_dispatch_frac_ci95": list(_median_interval(noop_ratios)),
        "mean_overhead_frac": statistics.median(mean_ratios),
        "mean_overhead_frac_ci95": list(_median_interval(mean_ratios)),
        "unpaired_overhead_frac": prof / base - 1,
        "runs_step_ms": {a: [1e3 * v for v in steps_by_arm[a]] for a in ARMS},
        "runs_mean_step_ms": {a: [1e3 * v for v in means_by_arm[a]] for a in ARMS},
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
        batch = (torch.zeros(64, 32), torch.zeros(64, dtype=torch.long))
        kwargs = {"batch": batch, "batch_idx": 0}

        def empty_run(optimizer: object, batch_idx: int, kwargs: dict) -> None:
            return None

        # setup() wraps what automatic_optimization.run is: here the empty run.
        loop.automatic_optimization.run = empty_run
        cb.setup(trainer, model, "fit")
        timed_run = loop.automatic_optimization.run

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
        del loop.automatic_optimization.run
    plain_us, wrapped_us = (1e6 * statistics.median(out[k]) for k in ("plain", "wrapped"))
    return {"calls": calls, "repeats": repeats, "plain_us": plain_us, "wrapped_us": wrapped_us,
            "added_us_per_step": wrapped_us - plain_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps per fit (default: {', '.join(f'{k} {v}' for k, v in STEPS.items())})")
    parser.add_argument("--rounds", type=int, default=3, help="timed fits per arm per process")
    parser.add_argument("--processes", type=int, default=40, help="fresh processes, each running every arm")
    parser.add_argument("--models", nargs="+", default=["linear", "cnn"], choices=sorted(SHAPES))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "callback_overhead.json"))
    parser.add_argument("--child", nargs=4, metavar=("ARMS", "MODEL", "STEPS", "ROUNDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        arms, kind, steps, rounds = args.child
        child(arms.split(","), kind, int(steps), int(rounds))
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
        r = result["models"][kind] = measure(kind, args.steps or STEPS[kind], args.rounds, args.processes)
        r["hot_path_frac"] = hot["added_us_per_step"] / (1e3 * r["step_ms_without"])
        lo, hi = r["overhead_frac_ci95"]
        print(f"{kind}: step {r['step_ms_without']:.3f} ms without, {r['step_ms_with']:.3f} ms with "
              f"FastDataCallback: overhead {100 * r['overhead_frac']:+.2f}% of the step "
              f"(95% interval {100 * lo:+.2f}% to {100 * hi:+.2f}%; {r['overhead_us_per_step']:+.1f} us; every step "
              f"counted, logging ones included: {100 * r['mean_overhead_frac']:+.2f}%), median over "
              f"{r['processes']} processes of the within-process ratio ({r['rounds_per_process']} fits of "
              f"{r['steps']} steps per arm each); {r['processes_over_1pct']} processes at or over 1%")
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
