"""The quick demo on a CUDA device: the store is placed on the GPU and both runs learn."""

from __future__ import annotations

import json

import pytest
import torch
from _helpers import run_demo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_quick_demo_on_cuda(tmp_path):
    out = tmp_path / "result.json"
    proc = run_demo(tmp_path, "--quick", "--data-dir", str(tmp_path / "data"), "--json-out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["device"] == "cuda"
    assert result["fastdata"]["name"] == "fastdata (device)"
    for run in ("plain", "fastdata"):
        assert result[run]["val_acc"] > 0.25, result[run]
