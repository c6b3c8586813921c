"""``fastdata bench`` and ``num_workers="measure"`` on a CUDA device: pinned copies, synchronised timing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cli_models import CliImages  # noqa: E402

from lightning_fastdata.autotune import shutdown_workers  # noqa: E402
from lightning_fastdata.cli import run_bench  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_bench_on_cuda_pins_worker_batches_and_recommends_the_fastest(tmp_path, capsys):
    dm = CliImages(n=512, batch_size=64, cache_dir=str(tmp_path / "cache"))
    report = run_bench(dm, torch.device("cuda"), 1, batches=4, warmup=1, repeats=2, progress=False)
    rows = {r["strategy"]: r for r in report["results"]}
    assert rows["device"]["samples_per_s"] > 0 and rows["workers"]["samples_per_s"] > 0
    assert rows["workers"]["pin_memory"] is True and rows["device"]["pin_memory"] is False
    measured = [r for r in report["results"] if r.get("samples_per_s")]
    assert report["recommendation"] == max(measured, key=lambda r: r["samples_per_s"])["strategy"]
    assert "recommendation:" in capsys.readouterr().out


def test_measure_on_cuda_keeps_a_candidate(tmp_path):
    dm = CliImages(n=512, batch_size=64, strategy="workers", num_workers="measure",
                   cache_dir=str(tmp_path / "cache"), device="cuda")
    dm.prepare_data()
    dm.setup("fit")
    assert dm.plan.num_workers in dm.plan.num_workers_candidates
    assert dm.plan.pin_memory is True and "measured fastest" in dm.plan.reasons["num_workers"]
    loader = dm.train_dataloader()
    batch = next(iter(loader))
    assert batch[0].is_pinned()
    shutdown_workers(loader)
