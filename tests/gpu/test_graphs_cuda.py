"""CUDA graphs of the augmentation: replay equals eager bit for bit over batches and epochs, the
capture and replays never make the host wait, and a whole training epoch of each strategy with
the full augmentation set runs under ``torch.cuda.set_sync_debug_mode("error")``.

Skipped without CUDA. Run on a GPU machine with:
    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_graphs_cuda.py
"""

from __future__ import annotations

import threading

import lightning as L
import pytest
import torch
from _helpers import TinyDataModule, TinyModel

from lightning_fastdata import augment as A
from lightning_fastdata.graphs import GraphedAugment
from lightning_fastdata.keys import SampleKeys

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _pipelines():
    return {
        "crop+flip+normalize": A.Compose([A.RandomCrop(32, padding=4), A.RandomHorizontalFlip(),
                                          A.Normalize(MEAN, STD)]),
        "resized crop+flip+jitter+normalize": A.Compose([A.RandomResizedCrop(24), A.RandomHorizontalFlip(),
                                                         A.ColorJitter(0.4, 0.4, 0.4), A.Normalize(MEAN, STD)]),
        "apply, affine, erasing, noise": A.Compose([
            A.RandomApply([A.ColorJitter(0.5)], p=0.5), A.RandomAffine(15, translate=(0.1, 0.1)),
            A.ToDtype("float32"), A.RandomErasing(p=0.5, value="random"), A.GaussianNoise()]),
    }


def _batch(x, indices, epoch):
    return A.Batch({"image": x, "label": indices % 10}, {"image": "image", "label": "other"},
                   SampleKeys(5, epoch, indices, stream=0))


@pytest.mark.parametrize("name", list(_pipelines()))
def test_replay_equals_eager_bit_for_bit_over_batches_and_two_epochs(name):
    aug = _pipelines()[name]
    graphed = GraphedAugment(aug)
    g = torch.Generator().manual_seed(0)
    for epoch in (0, 1):
        for _ in range(4):
            x = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, generator=g).cuda()
            idx = torch.randperm(50000, generator=g)[:64].cuda()
            out = graphed(_batch(x, idx, epoch)).fields["image"]
            ref = aug(_batch(x, idx, epoch)).fields["image"]
            assert out.is_cuda and out.dtype == ref.dtype and torch.equal(out, ref), (name, epoch)
    assert graphed.counts == {"replayed": 8, "eager": 0, "captured": 1}


def test_volumes_with_masks_replay_equal_eager():
    aug = A.Compose([A.RandomCropByLabel(8, label="mask"), A.RandomFlip((-3, -2, -1)), A.RandomRot90(),
                     A.ScaleIntensityRange(-1000, 1000, clip=True), A.RandomShiftIntensity(0.1)])
    graphed = GraphedAugment(aug)
    for epoch in range(3):
        vol = torch.randint(-1000, 1000, (4, 1, 16, 16, 16), dtype=torch.int16, device="cuda")
        lab = (vol > 300).to(torch.uint8)

        def batch(vol=vol, lab=lab, epoch=epoch):
            return A.Batch({"image": vol, "mask": lab}, {"image": "image", "mask": "mask"},
                           SampleKeys(0, epoch, torch.arange(4, device="cuda") + 4 * epoch))

        out, ref = graphed(batch()), aug(batch())
        for k in ("image", "mask"):
            assert torch.equal(out.fields[k], ref.fields[k]), (epoch, k)
    assert graphed.counts["captured"] == 1


def test_outputs_are_fresh_and_the_partial_batch_has_its_own_graph():
    aug = _pipelines()["crop+flip+normalize"]
    graphed = GraphedAugment(aug)
    x = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, device="cuda")
    first = graphed(_batch(x, torch.arange(64, device="cuda"), 0)).fields["image"]
    kept = first.clone()
    graphed(_batch(x.flip(0), torch.arange(64, 128, device="cuda"), 1))
    assert torch.equal(first, kept)
    tail = graphed(_batch(x[:10], torch.arange(10, device="cuda"), 0)).fields["image"]
    assert torch.equal(tail, first[:10])  # the same samples and keys: the same pixels
    assert graphed.counts["captured"] == 2


def test_capture_and_replays_never_sync():
    aug = _pipelines()["resized crop+flip+jitter+normalize"]
    graphed = GraphedAugment(aug)
    x = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, device="cuda")
    idx = torch.arange(64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [graphed(_batch(x, idx, epoch)).fields["image"] for epoch in range(3)]  # capture, then replays
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert graphed.counts == {"replayed": 3, "eager": 0, "captured": 1}
    assert torch.equal(outs[2], aug(_batch(x, idx, 2)).fields["image"])


def test_a_capture_in_a_background_thread_while_the_main_thread_computes():
    """The data module captures in its augment-ahead thread while the training step runs."""
    aug = _pipelines()["crop+flip+normalize"]
    graphed = GraphedAugment(aug)
    x = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, device="cuda")
    idx = torch.arange(64, device="cuda")
    result = {}

    def work():
        with torch.cuda.stream(torch.cuda.Stream()):
            result["out"] = graphed(_batch(x, idx, 1)).fields["image"]
            torch.cuda.current_stream().synchronize()

    a = torch.randn(2048, 2048, device="cuda")
    thread = threading.Thread(target=work)
    thread.start()
    for _ in range(20):
        a = (a @ a).tanh_()  # allocations and launches on the main thread meanwhile
    thread.join()
    assert torch.equal(result["out"], aug(_batch(x, idx, 1)).fields["image"])


def _augment_set():
    return A.Compose([A.RandomCrop(8, padding=2), A.RandomHorizontalFlip(), A.ColorJitter(0.4, 0.4, 0.4),
                      A.RandomErasing(p=0.5), A.Normalize([0.5] * 3, [0.25] * 3)])


class _StrictEpoch(L.Callback):
    """Every host-device synchronisation raises during the second epoch (the first warms up Lightning)."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")

    def on_train_epoch_end(self, trainer, pl_module):
        torch.cuda.set_sync_debug_mode("default")


def _fit(tmp_path, strategy, cuda_graphs, callbacks=()):
    dm = TinyDataModule(n=200, batch_size=16, strategy=strategy, cache_dir=str(tmp_path / "cache"),
                        train_augment=_augment_set(), val=False, cuda_graphs=cuda_graphs, num_workers=2)
    model = TinyModel(record=True)
    try:
        L.Trainer(accelerator="gpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                  limit_val_batches=0, callbacks=list(callbacks)).fit(model, dm)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return dm, model


@pytest.mark.parametrize("strategy", ["device", "chunked", "workers"])
def test_a_training_epoch_never_syncs(tmp_path, strategy):
    dm, model = _fit(tmp_path, strategy, cuda_graphs=True, callbacks=[_StrictEpoch()])
    assert dm.plan.strategy == strategy and len(model.seen) == 2 * 13
    counts = [g.counts for g in dm._graphed.values()]
    assert counts and counts[0]["captured"] >= 1 and counts[0]["replayed"] >= 24


@pytest.mark.parametrize("strategy", ["device", "chunked"])
def test_training_sees_the_same_batches_with_and_without_graphs(tmp_path, strategy):
    _, graphed = _fit(tmp_path, strategy, cuda_graphs=True)
    _, eager = _fit(tmp_path, strategy, cuda_graphs=False)
    assert len(graphed.seen) == len(eager.seen) == 2 * 13
    for (x, y), (rx, ry) in zip(graphed.seen, eager.seen, strict=True):
        assert x.is_cuda and torch.equal(x, rx) and torch.equal(y, ry)
