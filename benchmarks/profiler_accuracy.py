"""How close the profiler's figures are to known truths: a loader that sleeps a known time per batch.

Each case trains a one-layer model whose ``training_step`` sleeps ``compute_ms`` on a
main-process loader whose collate sleeps ``fetch_ms`` per batch, with ``DataWaitProfiler``
(and a CSV logger, ``log_every_n_steps=1``). Reported per case and repeat: the report's
median data wait and compute per step (``data_wait_ms_p50``, ``compute_ms_p50``), the
logged per-step figures' medians, and their errors relative to the sleeps. A sleep
oversleeps by the scheduler's latency, so on a busy machine the errors are positive; the
test suite checks the same arithmetic exactly on a fake clock and asserts no time.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/profiler_accuracy.py

Writes ``benchmarks/results/profiler_accuracy.json`` (``--out``); a ``--quick`` smoke run
writes nothing unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset, default_collate

from lightning_fastdata import DataWaitProfiler
from lightning_fastdata._util import atomic_write_text

#: (fetch_ms, compute_ms): compute-bound, data-bound, and a short step.
CASES = ((30.0, 40.0), (40.0, 10.0), (5.0, 5.0))


class SleepingCollate:
    """``default_collate`` after sleeping ``ms`` (runs in the main process: num_workers=0)."""

    def __init__(self, ms: float) -> None:
        self.s = ms / 1e3

    def __call__(self, items: list) -> object:
        time.sleep(self.s)
        return default_collate(items)


class SleepingModel(L.LightningModule):
    """One Linear layer whose training step sleeps ``ms`` first."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 2)
        self.s = ms / 1e3

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        time.sleep(self.s)
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run_case(fetch_ms: float, compute_ms: float, batches: int) -> dict:
    """One fit: the profiler's figures against the sleeps."""
    data = TensorDataset(torch.randn(4 * batches, 8), torch.randint(0, 2, (4 * batches,)))
    loader = DataLoader(data, batch_size=4, collate_fn=SleepingCollate(fetch_ms))
    prof = DataWaitProfiler(print_report=False)
    with tempfile.TemporaryDirectory() as root:
        logger = CSVLogger(root, name="accuracy")
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=logger, log_every_n_steps=1,
                            callbacks=[prof], enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root)
        trainer.fit(SleepingModel(compute_ms), loader)
        rows = [r for r in csv.DictReader(open(Path(logger.log_dir) / "metrics.csv"))
                if r.get("fastdata/data_wait_ms")]
    train = prof.report()["stages"]["train"]
    logged_wait = statistics.median(float(r["fastdata/data_wait_ms"]) for r in rows)
    logged_compute = statistics.median(float(r["fastdata/compute_ms"]) for r in rows)
    return {
        "steps": train["steps"], "verdict": train["verdict"],
        "data_wait_ms_p50": train["data_wait_ms_p50"], "compute_ms_p50": train["compute_ms_p50"],
        "logged_data_wait_ms_p50": logged_wait, "logged_compute_ms_p50": logged_compute,
        "data_wait_rel_error": train["data_wait_ms_p50"] / fetch_ms - 1,
        "compute_rel_error": train["compute_ms_p50"] / compute_ms - 1,
        "logged_data_wait_rel_error": logged_wait / fetch_ms - 1,
        "logged_compute_rel_error": logged_compute / compute_ms - 1,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20, help="Batches per fit.")
    parser.add_argument("--repeats", type=int, default=3, help="Fits per case.")
    parser.add_argument("--quick", action="store_true", help="One repeat of 5 batches per case (a smoke run).")
    parser.add_argument("--out", default=None,
                        help="Write the results here (default benchmarks/results/profiler_accuracy.json; with "
                             "--quick nowhere unless given, so a smoke run leaves the committed results alone).")
    args = parser.parse_args(argv)
    if args.out is None and not args.quick:
        args.out = str(Path(__file__).parent / "results" / "profiler_accuracy.json")
    batches, repeats = (5, 1) if args.quick else (args.batches, args.repeats)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    cases = []
    for fetch_ms, compute_ms in CASES:
        runs = [run_case(fetch_ms, compute_ms, batches) for _ in range(repeats)]
        worst = max(max(abs(r["data_wait_rel_error"]), abs(r["compute_rel_error"])) for r in runs)
        cases.append({"fetch_ms": fetch_ms, "compute_ms": compute_ms, "runs": runs, "worst_rel_error": worst})
        r = runs[len(runs) // 2]
        print(f"fetch {fetch_ms:5.1f} ms -> data wait p50 {r['data_wait_ms_p50']:6.2f} ms "
              f"({100 * r['data_wait_rel_error']:+.1f}%); compute {compute_ms:5.1f} ms -> "
              f"{r['compute_ms_p50']:6.2f} ms ({100 * r['compute_rel_error']:+.1f}%); verdict {r['verdict']}; "
              f"worst error over {repeats} fit(s) {100 * worst:.1f}%")
    result = {"meta": {"batches": batches, "repeats": repeats, "quick": args.quick, "python": platform.python_version(),
                       "torch": torch.__version__, "lightning": L.__version__, "machine": platform.machine()},
              "cases": cases}
    if args.out is None:
        print("no JSON written (--quick; --out PATH writes one)")
        return
    atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
