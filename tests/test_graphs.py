"""GraphedAugment's logic on the CPU: a fake backend "captures" by running the function on the
static buffers and "replays" by running it again into the captured outputs, so everything but
the CUDA calls runs: static inputs, the epoch as a device tensor, the signature cache and the
eager fallbacks. (tests/gpu/test_graphs_cuda.py replays real CUDA graphs.)"""

from __future__ import annotations

import pytest
import torch
from _augment_util import images
from _helpers import TinyDataModule, TinyModel, trainer

from lightning_fastdata import augment as A
from lightning_fastdata import graphs
from lightning_fastdata.graphs import CudaBackend, GraphedAugment, capturable
from lightning_fastdata.keys import SampleKeys

MEAN, STD = [0.49, 0.48, 0.45], [0.25, 0.24, 0.26]


class FakeBackend(CudaBackend):
    """Captures on the CPU: the "graph" is the function and the outputs it first returned."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.captures, self.replays = fail, 0, 0

    def accepts(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def capture(self, fn, device, warmup):
        for _ in range(warmup):
            fn()
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        out = fn()
        return (fn, out), out

    def replay(self, graph) -> None:
        # A replay rewrites the captured outputs in place, as a CUDA graph does.
        self.replays += 1
        fn, out = graph
        for name, t in fn().items():
            out[name].copy_(t)


def _pipelines():
    return {
        "crop+flip+normalize": A.Compose([A.RandomCrop(20, padding=4), A.RandomHorizontalFlip(),
                                          A.Normalize(MEAN, STD)]),
        "resized crop+flip+jitter+normalize": A.Compose([A.RandomResizedCrop(16), A.RandomHorizontalFlip(),
                                                         A.ColorJitter(0.4, 0.4, 0.4), A.Normalize(MEAN, STD)]),
        "random apply, erasing, noise": A.Compose([A.RandomApply([A.ColorJitter(0.5)], p=0.5), A.ToDtype("float32"),
                                                   A.RandomErasing(p=0.5, value="random"), A.GaussianNoise()]),
    }


def _batch(x, indices, epoch, seed=3, label=None):
    fields = {"image": x, "label": torch.arange(len(indices)) if label is None else label}
    return A.Batch(fields, {"image": "image", "label": "other"}, SampleKeys(seed, epoch, indices, stream=1))


@pytest.mark.parametrize("name", list(_pipelines()))
def test_replay_equals_eager_bit_for_bit_over_batches_and_epochs(name):
    aug = _pipelines()[name]
    backend = FakeBackend()
    graphed = GraphedAugment(aug, backend=backend)
    g = torch.Generator().manual_seed(0)
    for epoch in (0, 1):
        for step in range(3):
            x = images(8, shape=(3, 20, 24), seed=10 * epoch + step)
            idx = torch.randperm(1000, generator=g)[:8]
            ref = aug(_batch(x, idx, epoch))
            out = graphed(_batch(x, idx, epoch))
            assert torch.equal(out.fields["image"], ref.fields["image"]), (epoch, step)
            assert out.fields["image"].dtype == ref.fields["image"].dtype
    assert backend.captures == 1 and graphed.counts == {"replayed": 6, "eager": 0, "captured": 1}


def test_batches_handed_out_never_change_and_other_fields_pass_through():
    aug = _pipelines()["crop+flip+normalize"]
    graphed = GraphedAugment(aug, backend=FakeBackend())
    label = torch.arange(8) * 10
    first = graphed(_batch(images(8, seed=1), torch.arange(8), 0, label=label))
    kept = first.fields["image"].clone()
    for epoch in range(1, 4):
        graphed(_batch(images(8, seed=epoch + 1), torch.arange(8, 16), epoch))
    assert torch.equal(first.fields["image"], kept)  # a clone, not the graph's static output
    assert first.fields["label"] is label  # never copied into the graph
    assert first.keys.epoch == 0  # the caller's keys, not the graph's tensor epoch


def test_a_new_signature_is_captured_up_to_the_limit_then_eager():
    aug = _pipelines()["crop+flip+normalize"]
    backend = FakeBackend()
    graphed = GraphedAugment(aug, max_graphs=2, backend=backend)
    for n in (8, 8, 5, 5, 3, 3, 8):  # full batches, a partial one, then a third shape over the limit
        x = images(n, seed=n)
        out = graphed(_batch(x, torch.arange(n), 2))
        assert torch.equal(out.fields["image"], aug(_batch(x, torch.arange(n), 2)).fields["image"])
    assert backend.captures == 2
    assert graphed.counts == {"replayed": 5, "eager": 2, "captured": 2}
    # channels_last input is another signature (strides), kept in the output.
    graphed = GraphedAugment(A.Compose([A.RandomCrop(20, padding=2), A.RandomHorizontalFlip()]), backend=FakeBackend())
    x = images(4).contiguous(memory_format=torch.channels_last)
    out = graphed(_batch(x, torch.arange(4), 0)).fields["image"]
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, graphed.augment(_batch(x, torch.arange(4), 0)).fields["image"])


def test_eager_for_other_devices_and_foreign_ops():
    aug = _pipelines()["crop+flip+normalize"]
    # The real CUDA backend never takes a CPU batch: nothing is captured.
    graphed = GraphedAugment(aug)
    graphed(_batch(images(4), torch.arange(4), 0))
    assert graphed.counts == {"replayed": 0, "eager": 1, "captured": 0}

    class Mine(A.BatchTransform):
        def apply_batch(self, batch):
            return batch.map(image=lambda x: x + 1)

    assert not capturable(Mine()) and not capturable(A.Compose([A.RandomHorizontalFlip(), Mine()]))
    assert not capturable(lambda b: b)
    assert capturable(A.Compose([A.RandomApply([A.RandomHorizontalFlip()]), A.Normalize(MEAN, STD)]))
    graphed = GraphedAugment(A.Compose([A.RandomHorizontalFlip(), Mine()]), backend=FakeBackend())
    graphed(_batch(images(4), torch.arange(4), 0))
    assert graphed.counts["eager"] == 1
    Mine.graph_safe = True  # the op's author vouches for it
    assert capturable(Mine())
    graphed = GraphedAugment(A.Compose([A.RandomHorizontalFlip(), Mine()]), backend=FakeBackend())
    out = graphed(_batch(images(4), torch.arange(4), 0))
    assert graphed.counts["captured"] == 1
    assert torch.equal(out.fields["image"], graphed.augment(_batch(images(4), torch.arange(4), 0)).fields["image"])


def test_a_ragged_image_field_runs_eagerly():
    graphed = GraphedAugment(A.Compose([A.RandomHorizontalFlip()]), backend=FakeBackend())
    batch = A.Batch({"image": images(2), "extra": images(2)}, {"image": "image", "extra": "mask"},
                    SampleKeys(0, 0, torch.arange(2)))
    assert graphed.signature(batch) is not None
    batch.fields["extra"] = [images(1)[0], images(1)[0]]  # what a ragged field's leaf becomes
    assert graphed.signature(batch) is None


def test_a_failed_capture_warns_once_and_runs_eagerly():
    aug = _pipelines()["crop+flip+normalize"]
    warned = []
    graphed = GraphedAugment(aug, backend=FakeBackend(fail=True), warn=warned.append)
    for epoch in range(3):
        x = images(6, seed=epoch)
        out = graphed(_batch(x, torch.arange(6), epoch))
        assert torch.equal(out.fields["image"], aug(_batch(x, torch.arange(6), epoch)).fields["image"])
    assert len(warned) == 1 and "could not be captured in a CUDA graph" in warned[0]
    assert "RuntimeError" in warned[0] and "cuda_graphs=False" in warned[0]
    assert graphed.counts == {"replayed": 0, "eager": 3, "captured": 0}


@pytest.mark.parametrize("kwargs, match", [(dict(max_graphs=-1), "max_graphs"), (dict(warmup=0), "warmup")])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GraphedAugment(A.RandomHorizontalFlip(), **kwargs)


def test_the_data_module_replays_graphs_and_sees_what_eager_sees(tmp_path, monkeypatch):
    """Through Trainer.fit: with cuda_graphs on (the CPU standing in for CUDA through the fake
    backend), every batch the model sees equals the eager run's."""
    backend = FakeBackend()
    monkeypatch.setattr(graphs, "CudaBackend", lambda: backend)

    def aug():
        return A.Compose([A.RandomCrop(8, padding=2), A.RandomHorizontalFlip(), A.Normalize([0.5] * 3, [0.25] * 3)])

    seen = {}
    for flag in (False, True):
        dm = TinyDataModule(n=30, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", train_augment=aug(),
                            val=False, cuda_graphs=flag)
        model = TinyModel(record=True)
        trainer(tmp_path, max_epochs=2).fit(model, dm)
        seen[flag] = model.seen
    assert len(seen[True]) == 8
    for (x0, y0), (x1, y1) in zip(seen[False], seen[True], strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    # One graph for the full batches of 8; the last batch of each epoch (6) has its own.
    assert backend.captures == 2 and backend.replays == 8


def test_cuda_graphs_must_be_a_bool():
    with pytest.raises(TypeError, match="cuda_graphs must be True or False, got 'yes'"):
        TinyDataModule(cuda_graphs="yes")
