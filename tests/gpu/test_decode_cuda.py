"""JPEG decoding and the size-fixing ops on CUDA: one nvJPEG call per batch, and the ragged
(list) ops' batched accelerator path against the CPU's at the same keys."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_fastdata import augment as A
from lightning_fastdata.decode import decode_jpegs
from lightning_fastdata.keys import SampleKeys

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _jpegs(n: int = 6) -> list[torch.Tensor]:
    out = []
    for i in range(n):
        rng = np.random.default_rng(i)
        arr = rng.integers(0, 256, (30 + 11 * i, 70 - 5 * i, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, "JPEG", quality=90)
        out.append(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    return out


def test_nvjpeg_decodes_what_the_cpu_decodes():
    data = _jpegs()
    gpu, cpu = decode_jpegs(data, "cuda"), decode_jpegs(data, "cpu")
    for a, b in zip(gpu, cpu, strict=True):
        assert a.is_cuda and a.shape == b.shape
        assert (a.cpu().int() - b.int()).abs().float().mean() < 1.0  # IDCTs differ by a level here and there


@pytest.mark.parametrize("op", [A.RandomResizedCrop(24), A.Compose([A.Resize(28), A.CenterCrop(24)]),
                                A.RandomCrop(48, pad_if_needed=True), A.Resize((20, 30))],
                         ids=lambda o: type(o).__name__)
def test_list_ops_on_cuda_give_the_cpu_result(op):
    cpu = decode_jpegs(_jpegs(), "cpu")
    gpu = [x.cuda() for x in cpu]
    index = torch.arange(100, 106)
    a = op(cpu, SampleKeys(1, 2, index))
    b = op(gpu, SampleKeys(1, 2, index.cuda()))
    assert b.is_cuda and a.shape == b.shape
    assert (a.int() - b.cpu().int()).abs().max() <= 1
