"""FastDataCallback's cost on a tiny model's training step, side by side with and without it.

Each repeat trains the same tiny model for ``--steps`` steps three times: with only a
timing callback, with a no-op ``Callback`` added (what Lightning's hook dispatch costs
any callback), and with ``FastDataCallback`` added (the arm order rotates between
repeats), on an in-memory dataset so that the step is as short as Lightning allows: the
worst case for a per-step profiler. The figure is the median over repeats of the
per-step median of each arm; the overhead is their relative difference. Writes JSON to
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
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(32, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


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


ARMS = ("without", "noop_callback", "fastdata")


def run(steps: int, arm: str, root: str) -> float:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * 64, 32, generator=g), torch.randint(0, 10, (steps * 64,), generator=g))
    timer = StepTimer()
    extra = {"without": [], "noop_callback": [L.Callback()], "fastdata": [FastDataCallback(print_report=False)]}
    callbacks = extra[arm]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=CSVLogger(root), log_every_n_steps=50,
                        callbacks=[*callbacks, timer], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root)
    trainer.fit(Tiny(), DataLoader(data, batch_size=64, shuffle=True))
    return timer.step_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "callback_overhead.json"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as root:
        run(args.steps // 4, "fastdata", root)  # warm-up: imports, allocator, first-call costs
        for r in range(args.repeats):
            order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]  # rotate, so no arm always runs first
            for arm in order:
                times[arm].append(run(args.steps, arm, root))
    base, noop, prof = (statistics.median(times[a]) for a in ARMS)
    # Paired differences (same repeat) cancel slow drifts of a shared machine better than two medians.
    paired = statistics.median((b - a) / a for a, b in zip(times["without"], times["fastdata"], strict=True))
    result = {
        "benchmark": "callback_overhead",
        "steps": args.steps,
        "repeats": args.repeats,
        "step_ms_without": 1e3 * base,
        "step_ms_noop_callback": 1e3 * noop,
        "step_ms_with": 1e3 * prof,
        "overhead_frac": (prof - base) / base,
        "overhead_frac_paired_median": paired,
        "overhead_us_per_step": 1e6 * (prof - base),
        "lightning_dispatch_frac": (noop - base) / base,
        "runs_step_ms": {a: [1e3 * v for v in times[a]] for a in ARMS},
        "machine": {"cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "lightning": L.__version__},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"step without {result['step_ms_without']:.3f} ms, with a no-op callback {1e3 * noop:.3f} ms, "
          f"with FastDataCallback {result['step_ms_with']:.3f} ms: "
          f"overhead {100 * result['overhead_frac']:+.2f}% (paired median {100 * paired:+.2f}%, "
          f"{result['overhead_us_per_step']:+.1f} us/step) -> {args.out}")


if __name__ == "__main__":
    main()
