"""The quick demo on a CUDA device: the store is placed on the GPU and both runs learn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_quick_demo_on_cuda(tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_fastdata.demo",
            "--quick",
            "--data-dir",
            str(tmp_path / "data"),
            "--json-out",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["device"] == "cuda"
    assert result["fastdata"]["name"] == "fastdata (device)"
    for run in ("plain", "fastdata"):
        assert result[run]["val_acc"] > 0.25, result[run]
