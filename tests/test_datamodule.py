"""OptimizedDataModule through Lightning: caching, placement, loaders, augmentation, resume."""

from __future__ import annotations

import pytest
import torch
from _helpers import CountingDataset, TinyDataModule, TinyModel, trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fastdata import augment as A


def _aug():
    return A.Compose([A.RandomCrop(8, padding=2), A.RandomHorizontalFlip(), A.Normalize([0.5] * 3, [0.25] * 3)])


@pytest.mark.parametrize("strategy", ["auto", "workers"])
def test_every_sample_once_bit_equal(cache_dir, strategy):
    dm = TinyDataModule(n=30, batch_size=7, cache_dir=str(cache_dir), strategy=strategy, device="cpu",
                        num_workers=0)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.plan.strategy == ("device" if strategy == "auto" else "workers")
    ref = CountingDataset(30)
    seen = []
    for x, y in dm.train_dataloader():
        for img, label in zip(x, y, strict=True):
            match = [i for i in range(30) if torch.equal(ref[i][0], img)]
            assert len(match) == 1 and ref[match[0]][1] == label.item()
            seen += match
    assert sorted(seen) == list(range(30))


def test_second_setup_reuses_cache_without_rerunning_transform(cache_dir):
    dm = TinyDataModule(n=40, cache_dir=str(cache_dir), device="cpu", val=False)
    dm.prepare_data()
    assert dm.transform_calls == 40 + 2 * 8  # every sample, and the 8 probes read twice (randomness check)
    dm2 = TinyDataModule(n=40, cache_dir=str(cache_dir), device="cpu", val=False)
    dm2.prepare_data()
    dm2.setup("fit")
    # reuse: only the fingerprint's 8 probe samples are transformed, per call
    assert dm2.transform_calls == 2 * 8
    assert len(dm2.stores["train"]) == 40


def test_cache_key_and_loader_settings(cache_dir):
    a = TinyDataModule(n=10, cache_dir=str(cache_dir), device="cpu", val=False, batch_size=2, num_workers=0)
    a.prepare_data()
    b = TinyDataModule(n=10, cache_dir=str(cache_dir), device="cpu", val=False, batch_size=5,
                       strategy="workers", num_workers=1)
    b.prepare_data()
    assert b.transform_calls == 8  # batch size, strategy and workers do not change the fingerprint
    c = TinyDataModule(n=10, cache_dir=str(cache_dir), device="cpu", val=False, cache_key="v2")
    with pytest.warns(UserWarning, match="fingerprint"):
        c.prepare_data()
    assert c.transform_calls == 10 + 2 * 8


@pytest.mark.parametrize("kwargs,match", [
    (dict(vram_fraction=0.0), "vram_fraction must be in \\(0, 1\\], got 0.0"),
    (dict(vram_fraction=1.5), "vram_fraction must be in \\(0, 1\\], got 1.5"),
    (dict(batch_size=-1), "batch_size must be an int > 0, got -1"),
    (dict(strategy="gpu"), "strategy must be one of"),
    (dict(num_workers=-2), "num_workers must be 'auto', 'measure' or an int >= 0, got -2"),
    (dict(shared_memory="yes"), "shared_memory"),
    (dict(train_augment=3), "train_augment must be a callable"),
])
def test_bad_config_names_the_parameter(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        TinyDataModule(**kwargs)


def test_empty_source_is_a_clear_error(cache_dir):
    dm = TinyDataModule(n=0, cache_dir=str(cache_dir), device="cpu")
    with pytest.raises(ValueError, match="source\\('train'\\) returned an empty dataset"):
        dm.prepare_data()


def test_fit_with_augmentation_is_reproducible_and_per_sample(tmp_path):
    runs = []
    for _ in range(2):
        dm = TinyDataModule(n=32, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", train_augment=_aug(),
                            val=False)
        model = TinyModel(record=True)
        trainer(tmp_path, max_epochs=2).fit(model, dm)
        runs.append(model.seen)
    assert len(runs[0]) == 8
    for (x0, y0), (x1, y1) in zip(*runs, strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    assert runs[0][0][0].dtype == torch.float32  # normalised last
    # the two epochs see different augmentations
    assert not torch.equal(runs[0][0][0], runs[0][4][0])


def test_identical_images_are_augmented_independently(tmp_path):
    dm = TinyDataModule(n=4, cache_dir=str(tmp_path / "c"), device="cpu", val=False,
                        train_augment=A.Compose([A.RandomCrop(8, padding=3), A.RandomHorizontalFlip()]))
    x = torch.arange(64, dtype=torch.uint8).view(1, 1, 8, 8).repeat(32, 3, 1, 1)
    out, _ = dm.augment_batch((x, torch.zeros(32)), dm.train_augment, step=0)
    assert len({o.numpy().tobytes() for o in out}) > 16


def test_mid_epoch_checkpoint_resume_is_exact(tmp_path):
    """A run resumed from a mid-epoch checkpoint sees exactly the batches (indices and pixels) of the rest."""
    cache = str(tmp_path / "c")

    def dm():
        return TinyDataModule(n=64, batch_size=8, cache_dir=cache, device="cpu", train_augment=_aug(), val=False)

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1,
                           filename="{step}")
    full = TinyModel(record=True)
    trainer(tmp_path, max_epochs=2, callbacks=[ckpt], enable_checkpointing=True).fit(full, dm())
    assert len(full.seen) == 16
    path = tmp_path / "ckpt" / "step=3.ckpt"
    assert path.exists()
    resumed = TinyModel(record=True)
    trainer(tmp_path, max_epochs=2).fit(resumed, dm(), ckpt_path=str(path))
    assert len(resumed.seen) == 13
    for (x0, y0), (x1, y1) in zip(full.seen[3:], resumed.seen, strict=True):
        assert torch.equal(y0, y1) and torch.equal(x0, x1)


def test_unstorable_samples_fall_back_to_per_sample_workers(cache_dir):
    class WithNames(TinyDataModule):
        def static_transform(self, sample):
            return sample[0], f"name-{sample[1]}"

    dm = WithNames(n=10, batch_size=4, cache_dir=str(cache_dir), device="cpu", val=False, num_workers=0)
    with pytest.warns(UserWarning, match="cannot be stored"):
        dm.prepare_data()
    dm.setup("fit")
    assert dm.plan.strategy == "workers" and "cannot be stored" in dm.plan.reasons["strategy"]
    names = [n for _, batch_names in dm.train_dataloader() for n in batch_names]
    assert sorted(names) == sorted(f"name-{i % 4}" for i in range(10))


def test_persistent_workers_stop_at_teardown(tmp_path):
    import time

    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. a resource tracker
    dm = TinyDataModule(n=32, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", strategy="workers",
                        num_workers=2, persistent_workers=True, val=False)
    trainer(tmp_path, max_epochs=2).fit(TinyModel(), dm)
    deadline = time.monotonic() + 5
    while (left := {p.pid for p in psutil.Process().children(recursive=True)} - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left


def test_setup_without_prepare_data_builds_the_cache(cache_dir):
    dm = TinyDataModule(n=12, batch_size=4, cache_dir=str(cache_dir), device="cpu", val=False)
    dm.setup("fit")  # e.g. a rank whose leader has not built it: no waiting, build it here
    assert len(dm.stores["train"]) == 12 and len(list(dm.train_dataloader())) == 3
