"""OptimizedDataModule through Lightning: caching, placement, loaders, augmentation, resume."""

from __future__ import annotations

import collections
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import CountingDataset, TinyDataModule, TinyModel, trainer
from lightning.pytorch.callbacks import BasePredictionWriter, Callback, ModelCheckpoint

from lightning_fastdata import OptimizedDataModule
from lightning_fastdata import augment as A
from lightning_fastdata.loaders import FastBatch
from lightning_fastdata.store import StoreError


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
    (dict(eval_batch_size=True), "eval_batch_size must be an int > 0 or None, got True"),
    (dict(strategy="gpu"), "strategy must be one of"),
    (dict(num_workers=-2), "num_workers must be 'auto', 'measure' or an int >= 0, got -2"),
    (dict(shared_memory="yes"), "shared_memory"),
    (dict(train_augment=3), "train_augment must be a callable"),
    (dict(seed=-1), r"seed must be an int in \[0, 2\*\*64\), got -1"),
    (dict(seed=1 << 64), r"seed must be an int in \[0, 2\*\*64\), got 18446744073709551616"),
    # A string flag read as True: drop_last="False" dropped the last batch, shuffle="false" shuffled.
    (dict(drop_last="False"), "drop_last must be True or False, got 'False'"),
    (dict(shuffle="false"), "shuffle must be True or False, got 'false'"),
    (dict(store="no"), "store must be True or False, got 'no'"),
    (dict(progress=1), "progress must be True or False, got 1"),
    # Found at setup, after every cache was built, as torch's "Expected one of cpu, cuda, ...".
    (dict(device="gpu"), "device must be a torch device such as 'cpu', 'cuda' or 'cuda:1' .* got 'gpu'"),
    # A bool is no fraction (True read as 1.0), and a string is no number even when it spells one.
    (dict(vram_fraction=True), r"vram_fraction must be in \(0, 1\], got True"),
    (dict(batch_size="4"), "batch_size must be an int > 0, got '4'"),
    (dict(seed=np.float64(3.0)), r"seed must be an int in \[0, 2\*\*64\), got np.float64\(3.0\)"),
    # Found in setup otherwise, after the caches were built, as "unhashable type: 'list'".
    (dict(augment_field=["image"]), r"augment_field must be a field name .* got \['image'\]"),
    (dict(augment_field=1), "augment_field must be a field name .* got 1"),
    (dict(augment_field=""), "augment_field must be a field name such as 'image' .* got ''"),
])
def test_bad_config_names_the_parameter(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        TinyDataModule(**kwargs)


def test_numpy_scalars_work_and_are_kept_as_plain_python(cache_dir):
    """np.arange, pandas rows and sweeps give numpy scalars: they were refused ("must be an int > 0, got
    np.int64(64)"). They work as the plain values they equal, and hparams, repr and YAML show plain ones."""
    plain = dict(batch_size=4, eval_batch_size=8, num_workers=0, prefetch_factor=2, seed=7, augment_ahead=1,
                 jpeg_quality=80, max_side=64, vram_fraction=0.5, shuffle=False, drop_last=True, pin_memory=False,
                 persistent_workers=True, keep_freed_memory=False, cuda_graphs=True, store=True)
    numpy = {k: (np.bool_(v) if isinstance(v, bool) else np.int64(v) if isinstance(v, int) else np.float32(v))
             for k, v in plain.items()}
    batches = []
    for config in (plain, numpy):
        dm = TinyDataModule(n=12, cache_dir=str(cache_dir), device="cpu", val=False, strategy="device",
                            train_augment=_aug(), **config)
        for name, value in plain.items():
            assert type(dm.hparams[name]) is type(value) and dm.hparams[name] == value, name
            assert type(dm.hparams_initial[name]) is type(value), name
        assert type(dm.batch_size) is int and type(dm.seed) is int and type(dm.vram_fraction) is float
        assert type(dm.shuffle) is bool and type(dm.eval_batch_size) is int
        dm.eval_batch_size = config["eval_batch_size"]  # set again (by hand, or by a tuner): checked the same way
        assert type(dm.hparams["eval_batch_size"]) is int
        dm.prepare_data()
        dm.setup("fit")
        batches.append([dm.on_after_batch_transfer(b, 0) for b in dm.train_dataloader()])
        dm.teardown("fit")
    assert len(batches[0]) == len(batches[1]) == 3  # 12 samples, batch 4, drop_last
    for (x, y), (xn, yn) in zip(*batches, strict=True):
        assert torch.equal(x, xn) and torch.equal(y, yn)  # the same seed, the same augmentation


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
    out, _ = dm.augment_batch(FastBatch.of((x, torch.zeros(32)), torch.arange(32)), dm.train_augment)
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


def test_resuming_where_max_steps_stopped_mid_epoch_warns_what_is_never_seen(tmp_path):
    """Lightning goes on with the next epoch from such a checkpoint (numbering its batches from
    the stopped position): the rest of the stopped epoch is never seen. It warns for a plain
    DataLoader; for this loader, which restores its position, it said nothing."""
    cache = str(tmp_path / "c")

    def dm():
        return TinyDataModule(n=40, batch_size=8, cache_dir=cache, device="cpu", val=False)

    first = trainer(tmp_path, max_steps=3, max_epochs=-1)
    first.fit(TinyModel(), dm())
    first.save_checkpoint(tmp_path / "stopped.ckpt")
    with pytest.warns(UserWarning, match=r"the checkpoint's training loader stopped at batch 3 of 5 of epoch 0, but "
                                         r"the Trainer goes on with epoch 1, so batches 3 to 4 of epoch 0 and batches "
                                         r"2 to 4 of epoch 1 \(Lightning numbers its batches from 3 and ends it after "
                                         r"2\) are never seen \(Lightning does this on resuming from where max_steps "
                                         r"stopped"):
        trainer(tmp_path, max_steps=6, max_epochs=-1).fit(TinyModel(), dm(), ckpt_path=str(tmp_path / "stopped.ckpt"))


class _FailsOnce(TinyModel):
    """Raises in its first training step (as a crash or a preemption mid-step would end a run)."""

    def training_step(self, batch, batch_idx):
        raise RuntimeError("the step failed")


class _Hooked(TinyModel):
    """Has its own (identity) hook before the transfer: the data module runs it on the structure."""

    def on_before_batch_transfer(self, batch, dataloader_idx):
        return batch


class _HookedFailsOnce(_Hooked):
    def training_step(self, batch, batch_idx):
        raise RuntimeError("the step failed")


@pytest.mark.parametrize("strategy", ["device", "workers"])
@pytest.mark.parametrize("hooked", [False, True])
def test_a_checkpoint_saved_as_a_step_fails_resumes_at_that_batch(tmp_path, strategy, hooked):
    """OnExceptionCheckpoint saves while the step is in flight: its batch was transferred but never
    trained on, so the resume must replay it (as Lightning's own progress does), not skip it.
    With a model hook before the transfer, the batch rebuilt around the hook's output lost its
    loader, was not counted, and the resume skipped it."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    model, failing = (_Hooked, _HookedFailsOnce) if hooked else (TinyModel, _FailsOnce)

    cache = str(tmp_path / "c")

    def dm():
        return TinyDataModule(n=64, batch_size=8, cache_dir=cache, device="cpu", train_augment=_aug(), val=False,
                              strategy=strategy, num_workers=0)

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, filename="{step}")
    full = model(record=True)
    trainer(tmp_path, max_epochs=1, callbacks=[ckpt], enable_checkpointing=True).fit(full, dm())
    crash = OnExceptionCheckpoint(dirpath=tmp_path / "exc", filename="crash")
    with pytest.raises(RuntimeError, match="the step failed"):
        trainer(tmp_path, max_epochs=1, callbacks=[crash], enable_checkpointing=True).fit(
            failing(), dm(), ckpt_path=str(tmp_path / "ckpt" / "step=3.ckpt"))
    resumed = model(record=True)
    trainer(tmp_path, max_epochs=1).fit(resumed, dm(), ckpt_path=str(tmp_path / "exc" / "crash.ckpt"))
    assert len(resumed.seen) == 5
    for (x0, y0), (x1, y1) in zip(full.seen[3:], resumed.seen, strict=True):
        assert torch.equal(y0, y1) and torch.equal(x0, x1)


class _DictTrain(TinyDataModule):
    """Its training loader inside a dict: Lightning combines it."""

    def train_dataloader(self):
        return {"a": super().train_dataloader()}


class _Unwraps(TinyModel):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch["a"], batch_idx)


class _UnwrapsFailsOnce(_Unwraps):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("the step failed")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("strategy,ahead", [("device", 0), ("device", 1), ("workers", 0)])
def test_a_combined_training_loader_resumes_at_the_batch_whose_step_failed(tmp_path, strategy, ahead):
    """With the training loader in a dict (combined by Lightning), the batches were not counted
    as used: the position was the batches handed out, the in-flight one included, so the run
    resumed from a checkpoint saved as a step failed never trained on that batch (5 of 6)."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    cache = str(tmp_path / "c")

    def dm():
        return _DictTrain(n=48, batch_size=8, cache_dir=cache, device="cpu", train_augment=_aug(), val=False,
                          strategy=strategy, num_workers=0, augment_ahead=ahead)

    full = _Unwraps(record=True)
    trainer(tmp_path, max_epochs=1).fit(full, dm())
    crash = OnExceptionCheckpoint(dirpath=tmp_path / "exc", filename="crash")
    with pytest.raises(RuntimeError, match="the step failed"):
        trainer(tmp_path, max_epochs=1, callbacks=[crash], enable_checkpointing=True).fit(_UnwrapsFailsOnce(), dm())
    resumed = _Unwraps(record=True)
    trainer(tmp_path, max_epochs=1).fit(resumed, dm(), ckpt_path=str(tmp_path / "exc" / "crash.ckpt"))
    assert len(resumed.seen) == 4
    for (x0, y0), (x1, y1) in zip(full.seen[2:], resumed.seen, strict=True):
        assert torch.equal(y0, y1) and torch.equal(x0, x1)


@pytest.mark.parametrize("strategy", ["chunked", "workers"])
def test_a_fit_that_fails_leaves_no_loader_threads_or_workers(tmp_path, strategy):
    import threading

    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    dm = TinyDataModule(n=64, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False,
                        strategy=strategy, num_workers=2 if strategy == "workers" else 0, persistent_workers=False)
    with pytest.raises(RuntimeError, match="the step failed"):
        trainer(tmp_path, max_epochs=1).fit(_FailsOnce(), dm)
    names = [t.name for t in threading.enumerate() if t.name.startswith("lightning_fastdata")]
    assert names == []
    children = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not children or all(not psutil.pid_exists(p) for p in children)


def test_a_data_module_fitted_again_after_teardown_sees_its_data_as_it_is_now(tmp_path):
    # Active learning: fit, the source grows, fit the same module again. The second setup
    # must not serve the first fit's store (its fingerprint no longer matches the data).
    dm = TinyDataModule(n=64, batch_size=16, cache_dir=str(tmp_path / "c"), device="cpu", val=False)
    trainer(tmp_path, max_epochs=1).fit(TinyModel(), dm)
    assert len(dm.stores["train"]) == 64  # still inspectable after the fit
    dm.n = 128
    model = TinyModel(record=True)
    trainer(tmp_path, max_epochs=1).fit(model, dm)
    assert len(dm.stores["train"]) == 128 and len(model.seen) == 8


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


@pytest.mark.parametrize("strategy", ["device", "chunked", "workers"])
def test_a_loader_kept_past_its_teardown_says_so_and_a_new_one_reads(cache_dir, strategy):
    """The teardown frees a split's data; a loader kept from before it had no fields left
    and failed with "0 leaves for 2 field names" (device, workers) or an IndexError (chunked)."""
    dm = TinyDataModule(n=12, batch_size=4, cache_dir=str(cache_dir), device="cpu", strategy=strategy,
                        num_workers=0, val=False)
    dm.prepare_data()
    dm.setup("fit")
    kept = dm.train_dataloader()
    assert len(list(kept)) == 3
    dm.teardown("fit")
    with pytest.raises(RuntimeError, match=r"train loader's data was released by its data module's teardown"
                                           r".*setup\(stage\) again and call train_dataloader\(\)"):
        iter(kept)
    dm.setup("fit")
    assert len(list(dm.train_dataloader())) == 3


def test_setup_without_prepare_data_builds_the_cache(cache_dir):
    dm = TinyDataModule(n=12, batch_size=4, cache_dir=str(cache_dir), device="cpu", val=False)
    dm.setup("fit")  # e.g. a rank whose leader has not built it: no waiting, build it here
    assert len(dm.stores["train"]) == 12 and len(list(dm.train_dataloader())) == 3


class _Indexed(TinyDataModule):
    """Sample i: an image drawn from i, and i itself as the label (so a batch says which samples it holds)."""

    def static_transform(self, sample):
        return sample

    def source(self, split):
        if split != "train":
            return None

        class Ds(torch.utils.data.Dataset):
            def __len__(self):
                return 64

            def __getitem__(self, i):
                g = torch.Generator().manual_seed(i)
                return torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=g), i

        return Ds()


class _Keeper(TinyModel):
    """Keeps a reference to every training batch it is given: no copy."""

    def __init__(self):
        super().__init__(classes=64)
        self.kept = []

    def training_step(self, batch, batch_idx):
        self.kept.append((batch, batch[1].tolist()))  # the batch itself, and which samples it held then
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("strategy", ["device", "chunked", "workers"])
def test_batches_the_user_keeps_never_change(tmp_path, strategy):
    dm = _Indexed(batch_size=6, cache_dir=str(tmp_path / "c"), device="cpu", strategy=strategy, num_workers=0)
    model = _Keeper()
    trainer(tmp_path, max_epochs=1, limit_train_batches=10).fit(model, dm)
    ref = dm.source("train")
    assert len(model.kept) == 10
    for (x, y), held in model.kept:  # checked after the epoch, against the source
        assert y.tolist() == held, f"{strategy}: a kept batch's labels changed after it was handed out"
        for img, i in zip(x, held, strict=True):
            assert torch.equal(img, ref[i][0]), f"{strategy}: sample {i} changed after it was handed out"


class _HookedModel(TinyModel):
    """Overrides the three batch hooks; records what each saw."""

    def __init__(self):
        super().__init__(record=True)
        self.calls = []

    def on_before_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        self.calls.append(("before", x.dtype))
        return x, y + 100

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.calls.append(("transfer", type(batch).__name__))
        x, y = batch
        return x.to(device), y.to(device)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        self.calls.append(("after", x.dtype))
        return x * 0 + 7, y - 100  # the model's own batch code: must run, after the augmentation


def test_the_models_own_batch_hooks_run_around_the_augmentation(tmp_path):
    dm = TinyDataModule(n=16, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False,
                        train_augment=A.Normalize([0.5] * 3, [0.25] * 3))
    model = _HookedModel()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "overridden in both ... uses the DataModule's" warning
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec|across ranks is zero).*")
        trainer(tmp_path, max_epochs=1).fit(model, dm)
    assert [c[0] for c in model.calls[:3]] == ["before", "transfer", "after"]
    assert ("before", torch.uint8) in model.calls and ("transfer", "tuple") in model.calls
    assert ("after", torch.float32) in model.calls  # it saw the augmented (normalised) batch
    for x, y in model.seen:
        assert torch.all(x == 7) and y.max() < 4  # its output reached training_step


def test_a_model_hook_that_changes_the_structure_before_augmentation_is_named(tmp_path):
    class Reshaping(TinyModel):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            return {"x": batch[0], "y": batch[1]}

    dm = TinyDataModule(n=16, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False)
    with pytest.raises(RuntimeError, match=r"Reshaping.on_before_batch_transfer returned a batch with fields "
                                           r"\['x', 'y'\].*move it to on_after_batch_transfer"):
        trainer(tmp_path, max_epochs=1).fit(Reshaping(), dm)


@pytest.mark.parametrize("augment", [None, A.RandomHorizontalFlip()])
def test_a_model_hook_that_drops_samples_before_augmentation_is_named(tmp_path, augment):
    """Without an augmentation a hook may filter samples; with one it is named (the keys
    follow the samples' indices), not 'Batch has 2 samples but its keys have 4 indices'."""
    class Filtering(TinyModel):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            x, y = batch
            keep = y % 2 == 0
            return x[keep], y[keep]

    dm = TinyDataModule(n=16, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False,
                        train_augment=augment)
    model = Filtering(record=True)
    if augment is None:
        trainer(tmp_path, max_epochs=1).fit(model, dm)
        assert [len(y) for _, y in model.seen] == [4, 4] and all(int(v) % 2 == 0 for _, y in model.seen for v in y)
        return
    with pytest.raises(RuntimeError, match=r"Filtering.on_before_batch_transfer returned field '0' with 4 samples, "
                                           r"the batch has 8: .*move it to on_after_batch_transfer"):
        trainer(tmp_path, max_epochs=1).fit(model, dm)


Point = collections.namedtuple("Point", ["image", "label"])


class _Points(TinyDataModule):
    """Samples as a namedtuple, optionally with a str field (the per-sample path)."""

    def __init__(self, text: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.text = text

    def static_transform(self, sample):
        x, y = sample
        return (Point(x, y), f"s{y}") if self.text else Point(x, y)


class _PointModel(TinyModel):
    def training_step(self, batch, batch_idx):
        point = batch[0] if isinstance(batch, list) else batch  # the str field: a list, as default_collate
        self.seen.append(type(point))
        return torch.nn.functional.cross_entropy(self.net(point.image.float().flatten(1)), point.label)


@pytest.mark.parametrize("strategy,text", [("device", False), ("workers", False), ("workers", True)])
def test_a_namedtuple_sample_reaches_the_step_as_that_namedtuple(tmp_path, strategy, text):
    """As ``default_collate`` keeps it: ``batch.image`` works, under every strategy."""
    dm = _Points(text=text, n=16, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False,
                 strategy=strategy, num_workers=0, train_augment=A.RandomHorizontalFlip())
    model = _PointModel()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(tmp_path, max_epochs=1).fit(model, dm)
    assert model.seen == [Point, Point]


def test_a_namedtuple_whose_class_is_gone_comes_back_with_its_fields():
    from lightning_fastdata.structure import flatten, unflatten

    local = collections.namedtuple("Local", ["a", "b"])  # <locals>: cannot be imported back
    spec, leaves = flatten(local(np.zeros(2), 3))
    out = unflatten(json.loads(json.dumps(spec)), [v for _, v in leaves])  # as read from the manifest
    assert type(out).__name__ == "Local" and out._fields == ("a", "b") and out.b == 3


class _ThreeSplits(TinyDataModule):
    def source(self, split: str):
        return CountingDataset(self.n, self.shape) if split in ("train", "val", "test") else None


class _PlacedSeer(TinyModel):
    """Records which splits are placed while each stage runs."""

    def __init__(self):
        super().__init__()
        self.placed: dict[str, list[str]] = {}

    def _note(self, stage: str) -> None:
        self.placed.setdefault(stage, sorted(self.trainer.datamodule.placement.sources))

    def training_step(self, batch, batch_idx):
        self._note("fit")
        return super().training_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        self._note("test")


@pytest.mark.parametrize("strategy", ["device", "chunked"])
def test_a_test_after_a_fit_places_only_the_test_split(tmp_path, strategy):
    """The fit's teardown released train and val; the test must not put them back (on a GPU,
    two more whole copies kept on the device until the next fit) nor count them in its budget."""
    dm = _ThreeSplits(n=32, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", strategy=strategy)
    model = _PlacedSeer()
    t = trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    t.fit(model, dm)
    t.test(model, dm)
    assert model.placed == {"fit": ["train", "val"], "test": ["test"]}
    assert dm.placement.sources == {}  # the test's teardown released what it placed


class _IterStep(TinyModel):
    """A ``training_step(dataloader_iter)`` that follows the warning's advice."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def training_step(self, dataloader_iter):
        batch, _, _ = next(dataloader_iter)
        x, y = self.trainer.datamodule.augment_batch(batch.to(self.device))
        self.seen.append((x.clone(), y.clone()))
        return torch.nn.functional.cross_entropy(self.net(x.float().flatten(1)), y)


@pytest.mark.parametrize("strategy,workers", [("device", 0), ("workers", 0), ("workers", 1)])
def test_a_dataloader_iter_step_is_told_how_to_get_the_augmented_batches(tmp_path, strategy, workers):
    """Lightning runs no transfer hook for such a step: the loader augmented the batches under
    some strategies only (workers with 0 workers handed them out raw, silently). The warning's
    recipe gives the same augmented batches under every strategy."""
    dm = TinyDataModule(n=16, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False,
                        strategy=strategy, num_workers=workers, shuffle=False,
                        train_augment=A.Compose([A.RandomHorizontalFlip(), A.Normalize([0.5] * 3, [0.25] * 3)]))
    model = _IterStep()
    with pytest.warns(UserWarning, match=r"_IterStep.training_step takes a dataloader_iter: .*augment_batch\("):
        trainer(tmp_path, max_epochs=1).fit(model, dm)
    ref = TinyDataModule(n=16, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False,
                         strategy="device", shuffle=False, train_augment=dm.train_augment)
    plain = TinyModel(record=True)
    trainer(tmp_path, max_epochs=1).fit(plain, ref)
    assert len(model.seen) == len(plain.seen) == 2
    for (x, y), (rx, ry) in zip(model.seen, plain.seen, strict=True):
        assert x.dtype == torch.float32 and torch.equal(x, rx) and torch.equal(y, ry)


def test_the_chunked_strategy_follows_a_batch_size_changed_after_setup(tmp_path):
    """Lightning's ``Tuner.scale_batch_size`` sets ``batch_size`` after setup: chunks sized in
    batches of 5 failed with "chunks of 50 rows do not hold whole batches of 4"; now they are
    cut again, and every sample comes once, in the batches the device strategy makes."""
    def epoch(strategy: str) -> dict[int, list[list[int]]]:
        dm = TinyDataModule(n=200, batch_size=5, cache_dir=str(tmp_path / "c"), device="cpu", strategy=strategy)
        dm.setup("fit")
        out = {}
        for bs in (2, 4, 64):
            dm.batch_size = bs
            out[bs] = [b.indices.tolist() for b in dm.train_dataloader()]
        dm.teardown("fit")
        return out

    chunked, device = epoch("chunked"), epoch("device")
    assert chunked == device
    for batches in chunked.values():
        assert sorted(i for b in batches for i in b) == list(range(200))


def test_load_from_checkpoint_asks_for_the_augmentations_again(tmp_path):
    """A checkpoint keeps the augmentations as their repr: loading failed on that text with
    "train_augment must be a callable transform, got str" (under LightningCLI, a long
    parser dump); now it says to pass them, and with them the module loads."""
    flip = A.RandomHorizontalFlip()
    dm = TinyDataModule(n=16, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False, seed=5,
                        train_augment=flip)
    t = trainer(tmp_path, max_epochs=1, enable_checkpointing=True)
    t.fit(TinyModel(), dm)
    path = t.checkpoint_callback.best_model_path
    with pytest.raises(TypeError, match=r"TinyDataModule.load_from_checkpoint: the checkpoint keeps train_augment as "
                                        r"text .*load_from_checkpoint\(path, train_augment=...\)"):
        TinyDataModule.load_from_checkpoint(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = TinyDataModule.load_from_checkpoint(path, train_augment=flip)
    assert again.train_augment is flip and again.seed == 5 and again.batch_size == 8


class _OwnAugment(TinyDataModule):
    """Sets its augmentation itself, from an argument of its own."""

    def __init__(self, strength: int = 1, **kwargs) -> None:
        super().__init__(train_augment=A.Compose([A.RandomHorizontalFlip()] * strength),
                         eval_augment=A.RandomVerticalFlip(), **kwargs)
        self.strength = strength


class _ExtendsAugment(TinyDataModule):
    """Takes the caller's augmentation out of its kwargs and builds on it."""

    def __init__(self, **kwargs) -> None:
        user = kwargs.pop("train_augment", None)
        super().__init__(train_augment=A.Compose([user, A.RandomVerticalFlip()]), **kwargs)


class _OwnAugmentDropsText(_OwnAugment):
    """Does what the error says: its own arguments rebuild the augmentations it sets."""

    def __init__(self, strength: int = 1, **kwargs) -> None:
        super().__init__(strength=strength, **kwargs)
        del self.hparams["train_augment"], self.hparams["eval_augment"]


def test_a_module_that_sets_its_own_augmentation_is_told_how_to_load_from_its_checkpoint(tmp_path):
    """A subclass that passes ``train_augment`` itself failed to load with Python's bare "got
    multiple values for keyword argument 'train_augment'" (the checkpoint passes its text back
    next to the subclass's own): the error says why and the one line that fixes it, and with
    that line the module loads. One that builds on the caller's augmentation is told to pass
    it again, and loads with it."""
    def fitted(cls, root, **kw):
        dm = cls(n=16, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False, seed=5, **kw)
        t = trainer(tmp_path / root, max_epochs=1, enable_checkpointing=True)
        t.fit(TinyModel(), dm)
        return dm, t.checkpoint_callback.best_model_path

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, path = fitted(_OwnAugment, "own", strength=2)
        with pytest.raises(TypeError, match=r"_OwnAugment.load_from_checkpoint: _OwnAugment passes train_augment to "
                                            r"OptimizedDataModule.__init__ itself, .* "
                                            r"del self.hparams\[.train_augment.\]"):
            _OwnAugment.load_from_checkpoint(path)
        dm, path = fitted(_OwnAugmentDropsText, "drops", strength=2)
        again = _OwnAugmentDropsText.load_from_checkpoint(path)
        assert type(again) is _OwnAugmentDropsText and again.strength == 2 and again.seed == 5
        assert repr(again.train_augment) == repr(dm.train_augment) and repr(again.eval_augment) == repr(dm.eval_augment)
        crop = A.RandomCrop(8, padding=1)
        ext, path = fitted(_ExtendsAugment, "ext", train_augment=crop)
        with pytest.raises(TypeError, match="Compose item 0 is a str"):  # its own words; never a silent load
            _ExtendsAugment.load_from_checkpoint(path)
        again = _ExtendsAugment.load_from_checkpoint(path, train_augment=crop)
    assert repr(again.train_augment) == repr(ext.train_augment)


def test_a_measured_num_workers_is_measured_again_on_a_test_after_a_fit(tmp_path):
    """``num_workers="measure"`` timed the first open split: after the fit released train, a
    test failed with KeyError: 'train'. It times a split of the stage now."""
    dm = _ThreeSplits(n=32, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", strategy="workers",
                      num_workers="measure")
    model = _PlacedSeer()
    t = trainer(tmp_path, max_epochs=1, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0)
    t.fit(model, dm)
    t.test(model, dm)
    assert model.placed["test"] == ["test"]


def test_a_loader_of_a_split_the_stage_did_not_set_up_names_the_setup_to_run(tmp_path):
    """A ``val_dataloader`` that adds ``self.test_dataloader()`` in a fit: the test split was
    silently an empty loader (its samples never validated), or, opened by hand, a KeyError."""
    class ValAndTest(_ThreeSplits):
        def val_dataloader(self):
            return [super().val_dataloader(), self.test_dataloader()]

    dm = ValAndTest(n=16, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu")
    with pytest.raises(RuntimeError, match=r"ValAndTest.test_dataloader\(\): the 'test' split is not set up for "
                                           r"this stage .*call self.setup\('test'\)"):
        trainer(tmp_path, max_epochs=1, limit_train_batches=1).fit(_PlacedSeer(), dm)


@pytest.mark.parametrize("strategy", ["device", "workers"])
def test_overfit_batches_trains_on_the_same_batches_every_epoch(tmp_path, strategy):
    """Lightning turns a DataLoader's shuffling off for ``overfit_batches`` ("We are turning off
    the train dataloader shuffling for you") but cannot reach these loaders: each epoch
    trained on other samples."""
    dm = TinyDataModule(n=32, batch_size=4, cache_dir=str(tmp_path / "c"), device="cpu", val=False,
                        strategy=strategy, num_workers=0)
    model = TinyModel(record=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(tmp_path, max_epochs=3, overfit_batches=2).fit(model, dm)
    epochs = [torch.cat([x for x, _ in model.seen[e * 2:(e + 1) * 2]]) for e in range(3)]
    assert len(model.seen) == 6 and all(torch.equal(epochs[0], e) for e in epochs[1:])


def test_reloaded_loaders_do_not_pile_up_worker_processes(tmp_path):
    """``reload_dataloaders_every_n_epochs=1`` with persistent workers: each epoch's new
    loaders left the old ones' workers alive (2, 4, 6 ... 12 processes over 8 epochs, 10
    left after the fit); two validation loaders of one split left one behind."""
    import psutil

    class TwoVal(TinyDataModule):
        def val_dataloader(self):
            return [super().val_dataloader(), super().val_dataloader()]

    class Counting(TinyModel):
        def __init__(self):
            super().__init__()
            self.procs: list[int] = []

        def on_train_epoch_end(self):
            self.procs.append(len(psutil.Process().children(recursive=True)))

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            super().validation_step(batch, batch_idx)

    before = set(psutil.Process().children(recursive=True))  # e.g. a resource tracker another test started
    dm = TwoVal(n=16, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", strategy="workers",
                num_workers=1, persistent_workers=True)
    model = Counting()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(tmp_path, max_epochs=6, reload_dataloaders_every_n_epochs=1).fit(model, dm)
    assert max(model.procs) <= model.procs[1] + 1 and model.procs[-1] <= len(before) + 2 * 3  # bounded
    assert set(psutil.Process().children(recursive=True)) <= before  # every loader's workers gone with the fit


@pytest.mark.parametrize("strategy", ["device", "workers"])
def test_several_training_loaders_of_this_module_are_each_augmented(tmp_path, strategy):
    """``train_dataloader`` returning ``{"a": ..., "b": ...}``: the combined batch failed with
    "reached on_after_batch_transfer without its sample indices ... did not come from this
    data module's loaders", though both did."""
    class Two(TinyDataModule):
        def train_dataloader(self):
            return {"a": super().train_dataloader(), "b": super().train_dataloader()}

    class Model(TinyModel):
        def training_step(self, batch, batch_idx):
            self.seen.append({k: (x.clone(), y.clone()) for k, (x, y) in batch.items()})
            return sum(super(Model, self).training_step(b, batch_idx) for b in batch.values())

    dm = Two(n=16, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False, strategy=strategy,
             num_workers=0, shuffle=False, train_augment=A.Compose([A.RandomHorizontalFlip(p=1.0), A.ToDtype()]))
    model = Model()
    trainer(tmp_path, max_epochs=1).fit(model, dm)
    source = CountingDataset(16)
    for step, batches in enumerate(model.seen):
        for x, y in batches.values():
            want = torch.stack([source[step * 8 + i][0].flip(-1) for i in range(8)]).float() / 255
            assert x.dtype == torch.float32 and torch.allclose(x, want)
            assert y.tolist() == [source[step * 8 + i][1] for i in range(8)]


def test_unpacking_a_batch_before_its_augmentation_warns(tmp_path):
    """A model whose own ``train_dataloader`` returns the module's loader, fitted without the
    module: the ``workers`` loader's batches reached the step unaugmented, silently (the
    ``device`` loader augments them itself). Unpacking such a batch warns now; a fit with the
    module attached does not."""
    import lightning_fastdata.loaders as loaders_module

    flip = A.RandomHorizontalFlip(p=1.0)
    dm = TinyDataModule(n=16, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False,
                        strategy="workers", num_workers=0, train_augment=flip)
    dm.setup("fit")
    loaders_module._WARNED_PENDING = False
    with pytest.warns(UserWarning, match=r"unpacked before its augmentation ran.*augment_batch"):
        x, _ = next(iter(dm.train_dataloader()))
    x_aug, _ = dm.augment_batch(next(iter(dm.train_dataloader())))
    assert torch.equal(x_aug, x.flip(-1))  # what it held: the samples unflipped
    dm.teardown("fit")
    loaders_module._WARNED_PENDING = False
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*unpacked before its augmentation.*")
        trainer(tmp_path, max_epochs=1).fit(TinyModel(), TinyDataModule(
            n=16, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False, strategy="workers",
            num_workers=0, train_augment=flip))


def test_loaders_made_outside_a_trainer_and_dropped_do_not_keep_their_workers(tmp_path):
    import psutil

    dm = TinyDataModule(n=16, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False,
                        strategy="workers", num_workers=1, persistent_workers=True)
    before = set(psutil.Process().children(recursive=True))
    dm.setup("fit")
    alive = []
    for _ in range(4):
        for _ in dm.train_dataloader():
            pass
        alive.append(len(set(psutil.Process().children(recursive=True)) - before))
    dm.teardown("fit")
    assert alive == [1, 1, 1, 1] and set(psutil.Process().children(recursive=True)) <= before


@pytest.mark.parametrize("strategy", ["device", "workers"])
def test_a_val_loader_among_the_training_loaders_gets_the_eval_augmentation(tmp_path, strategy):
    """``{"lab": train loader, "unlab": val loader}``: the device loader augments the val
    batches with ``eval_augment`` itself; the workers path gave them ``train_augment``."""
    class Mixed(TinyDataModule):
        def train_dataloader(self):
            return {"lab": super().train_dataloader(), "unlab": self.val_dataloader()}

    class Model(TinyModel):
        def training_step(self, batch, batch_idx):
            self.seen.append(batch["unlab"][0].clone())
            return super().training_step(batch["lab"], batch_idx)

    dm = Mixed(n=16, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", strategy=strategy, num_workers=0,
               shuffle=False, train_augment=A.RandomHorizontalFlip(p=1.0), eval_augment=A.RandomVerticalFlip(p=1.0))
    model = Model()
    trainer(tmp_path, max_epochs=1, limit_val_batches=0).fit(model, dm)
    source = CountingDataset(16)
    assert torch.equal(model.seen[0], torch.stack([source[i][0].flip(-2) for i in range(8)]))


def test_a_batch_without_sample_indices_cannot_be_augmented(tmp_path):
    class PlainLoader(TinyDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(CountingDataset(16), batch_size=8)

    dm = PlainLoader(n=16, cache_dir=str(tmp_path / "c"), device="cpu", val=False, train_augment=_aug())
    with pytest.raises(RuntimeError, match="without its sample indices.*return the loaders of PlainLoader"):
        trainer(tmp_path, max_epochs=1).fit(TinyModel(), dm)


def test_hparams_show_the_configuration(tmp_path):
    dm = TinyDataModule(n=16, batch_size=8, cache_dir=str(tmp_path / "c"), seed=3, train_augment=_aug())
    assert dm.hparams["n"] == 16 and dm.hparams["batch_size"] == 8 and dm.hparams["seed"] == 3
    assert dm.hparams["train_augment"].startswith("Compose(") and dm.hparams["eval_augment"] is None


class _SavesItsOwn(TinyDataModule):
    """Lightning's idiom: ``self.save_hyperparameters()`` after ``super().__init__``."""

    def __init__(self, n: int = 32, **kwargs) -> None:
        super().__init__(n=n, **kwargs)
        self.save_hyperparameters()


def test_a_subclass_that_saves_its_own_hyperparameters_writes_checkpoints_that_load(tmp_path):
    # Its save_hyperparameters() put the Compose object back into hparams: the checkpoint could
    # neither resume a fit (torch's weights_only load refused the class) nor be loaded.
    dm = _SavesItsOwn(batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False, train_augment=_aug())
    assert dm.hparams["train_augment"].startswith("Compose(")
    assert dm.hparams_initial["train_augment"].startswith("Compose(")  # what loggers record
    plain = TinyDataModule(n=8, cache_dir=str(tmp_path / "c"), train_augment=_aug())
    assert plain.hparams_initial["train_augment"].startswith("Compose(")
    fit = trainer(tmp_path, max_epochs=1, limit_train_batches=2)
    fit.fit(TinyModel(), dm)
    path = tmp_path / "x.ckpt"
    fit.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["datamodule_hyper_parameters"]
    assert isinstance(saved["train_augment"], str)
    again = _SavesItsOwn(batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False, train_augment=_aug())
    trainer(tmp_path, max_epochs=2, limit_train_batches=2).fit(TinyModel(), again, ckpt_path=str(path))
    loaded = _SavesItsOwn.load_from_checkpoint(path, train_augment=_aug())
    assert loaded.n == 32 and repr(loaded.train_augment) == repr(_aug())


def test_an_unset_eval_batch_size_follows_batch_size_after_load_from_checkpoint(tmp_path):
    # hparams gave the followed value as a number, which the checkpoint kept: a module loaded
    # with batch_size=16 evaluated in batches of the old 8 (found by review 95).
    dm = TinyDataModule(n=32, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False)
    fit = trainer(tmp_path, limit_train_batches=1)
    fit.fit(TinyModel(), dm)
    fit.save_checkpoint(tmp_path / "x.ckpt")
    assert "eval_batch_size" not in torch.load(tmp_path / "x.ckpt", weights_only=True)["datamodule_hyper_parameters"]
    loaded = TinyDataModule.load_from_checkpoint(tmp_path / "x.ckpt", batch_size=16)
    assert loaded.eval_batch_size == 16
    loaded.eval_batch_size = 4  # set (by hand, or by the tuner): saved
    assert loaded.hparams["eval_batch_size"] == 4
    loaded.eval_batch_size = None  # follows batch_size again: not saved (review 96)
    assert loaded.eval_batch_size == 16 and "eval_batch_size" not in loaded.hparams


def test_an_augmentation_that_cannot_be_deep_copied_is_accepted(tmp_path):
    # hparams deep-copied the augmentation objects: one holding a lock failed the constructor
    # with "cannot pickle '_thread.lock' object" (found by review 95).
    import threading

    from lightning_fastdata.augment import BatchTransform

    class Locked(BatchTransform):
        def __init__(self) -> None:
            self.lock = threading.Lock()

        def apply_batch(self, batch):
            return batch

    dm = TinyDataModule(n=8, cache_dir=str(tmp_path / "c"), train_augment=Locked())
    assert dm.hparams["train_augment"].startswith("<") or "Locked" in dm.hparams["train_augment"]


@pytest.mark.parametrize("arg", ["batch_size", "eval_batch_size"])
def test_the_batch_size_tuner_scales_the_validation_batches(tmp_path, arg):
    # eval_batch_size was fixed at init to batch_size: tuning batch_size for validation changed
    # the training batch size only (every validation batch stayed 4), and tuning
    # eval_batch_size failed on an assertion (hparams held None) (found by review 88).
    from lightning.pytorch.tuner import Tuner

    seen: list[int] = []

    class Sizes(TinyModel):
        def validation_step(self, batch, batch_idx):
            seen.append(len(batch[1]))

    dm = TinyDataModule(n=64, batch_size=4, cache_dir=str(tmp_path / "c"), device="cpu")
    new = Tuner(trainer(tmp_path)).scale_batch_size(Sizes(), datamodule=dm, method="validate", batch_arg_name=arg,
                                                    max_trials=3, steps_per_trial=1)  # 2, 4, 8
    # (Lightning 2.4 ends on the size after its last trial, 16, untried; 2.6 on the last tried, 8.)
    assert new in (8, 16) and dm.eval_batch_size == new and max(seen) == 8
    assert dm.batch_size == (new if arg == "batch_size" else 4)


@pytest.mark.parametrize("strategy", ["device", "workers"])
def test_a_random_eval_augment_is_the_same_in_every_fit_epoch_and_in_validate(tmp_path, strategy):
    # It was keyed by the fit's epoch: with weights that never change, val_loss moved from epoch
    # to epoch, and trainer.validate after the fit matched epoch 0 only (found by review 88).
    class Frozen(TinyModel):
        def __init__(self) -> None:
            super().__init__()
            self.losses: list[float] = []

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x.float().flatten(1)), y))

        def on_validation_epoch_end(self):
            self.losses.append(float(self.trainer.callback_metrics["val_loss"]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    dm = TinyDataModule(n=32, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", strategy=strategy,
                        num_workers=0, eval_augment=A.Compose([A.RandomCrop(8, padding=2), A.RandomHorizontalFlip()]))
    model = Frozen()
    fit = trainer(tmp_path, max_epochs=3, num_sanity_val_steps=0)
    fit.fit(model, dm)
    fit.validate(model, dm, verbose=False)
    assert len(model.losses) == 4 and len(set(model.losses)) == 1, model.losses


class _Samples(OptimizedDataModule):
    """Train split: sample i is ``make(i)``; ``files`` names each sample as ImageFolder does."""

    def __init__(self, make=None, n: int = 5, files: list[str] | None = None, **kwargs) -> None:
        kwargs.setdefault("progress", False)
        super().__init__(**kwargs)
        self.make, self.n, self.files = make, n, files

    def source(self, split):
        if split != "train":
            return None
        make, n, files = self.make, self.n, self.files

        class Ds(torch.utils.data.Dataset):
            samples = [(f, 0) for f in files] if files else None

            def __len__(self):
                return n

            def __getitem__(self, i):
                return make(i)

        return Ds()


def _photo(channels):
    return lambda i: {"image": torch.full((channels[i], 5 + i, 7), 9 * i, dtype=torch.uint8), "label": i}


@pytest.mark.parametrize("encode", [None, {"image": "jpeg"}])
def test_a_ragged_image_field_whose_channels_change_is_refused_at_setup_naming_the_first_file(tmp_path, encode):
    """Before: a source keeping each file's channels (PIL without convert('RGB'), decode_image) built
    a ragged=["image"] store; training then failed on the first batch mixing 1 and 3 channels, naming
    a batch position ("sample 1"), not a dataset index, and no file (found by review 81)."""
    files = [str(tmp_path / f"img{i}.jpg") for i in range(5)]
    dm = _Samples(_photo([3, 3, 1, 3, 1]), files=files, cache_dir=str(tmp_path / "c"), device="cpu",
                  ragged=["image"], encode=encode, train_augment=A.RandomResizedCrop(4))
    with pytest.raises(StoreError) as err:
        dm.setup("fit")
    decoded = " (decoded)" if encode else ""
    assert str(err.value).startswith(
        f"sample 2 ({files[2]}), image field 'image' has shape (1, 7, 7){decoded}, sample 0 ({files[0]}) has "
        "(3, 5, 7): the samples of a ragged image field may differ in their spatial size (the last 2 dims) only, "
        "not in their channels (dim 0)")
    assert "image.convert('RGB') before pil_to_tensor" in str(err.value)
    assert "field_kinds={'image': 'other'}" in str(err.value)
    # With no augmentation to batch them, the samples come as a list, as they are.
    plain = _Samples(_photo([3, 3, 1, 3, 1]), cache_dir=str(tmp_path / "c"), device="cpu", ragged=["image"],
                     encode=encode, shuffle=False, batch_size=5)
    plain.setup("fit")
    batch = plain.on_after_batch_transfer(next(iter(plain.train_dataloader())), 0)
    assert [x.shape[0] for x in batch["image"]] == [3, 3, 1, 3, 1]
    plain.teardown("fit")


def test_ragged_fields_that_may_change_every_dim_are_not_refused(tmp_path):
    """Only the channels of fields this module treats as images or masks are held: boxes (K, 4) of
    varying K, volumes (1, D, H, W) with (D, H, W) masks of varying D, a field declared 'other'
    (a sequence the default kinds would take for an image: review 94)."""
    flip = A.RandomFlip(dims=(-1,))
    vols = _Samples(lambda i: {"vol": torch.zeros(1, 2 + i, 3, 4), "seg": torch.zeros(2 + i, 3, 4, dtype=torch.uint8),
                               "boxes": torch.zeros(i, 4)}, n=4, cache_dir=str(tmp_path / "c"), device="cpu",
                    ragged=["vol", "seg", "boxes"], field_kinds={"seg": "mask"}, train_augment=flip)
    vols.setup("fit")
    vols.teardown("fit")
    seqs = _Samples(lambda i: {"seq": torch.zeros(1 + i, 3, 5), "y": i}, n=4, cache_dir=str(tmp_path / "c"),
                    device="cpu", ragged=["seq"], field_kinds={"seq": "other"}, train_augment=flip)
    seqs.setup("fit")
    seqs.teardown("fit")
    masks = _Samples(lambda i: {"image": torch.zeros(3, 2 + i, 4), "seg": torch.zeros(1 + i % 2, 2 + i, 4)}, n=3,
                     cache_dir=str(tmp_path / "c"), device="cpu", ragged=["image", "seg"],
                     field_kinds={"seg": "mask"}, train_augment=flip)
    with pytest.raises(StoreError, match=r"sample 1, mask field 'seg' has shape \(2, 3, 4\), sample 0 has "
                                         r"\(1, 2, 4\).*give every mask the same channels"):
        masks.setup("fit")


def test_checkpoint_carries_the_data_plan_and_a_changed_plan_warns_with_both(tmp_path):
    cache = str(tmp_path / "c")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    dm = TinyDataModule(n=32, batch_size=8, cache_dir=cache, device="cpu", val=False, strategy="device")
    trainer(tmp_path, max_epochs=1, callbacks=[ckpt], enable_checkpointing=True).fit(TinyModel(), dm)
    path = tmp_path / "ckpt" / "step=2.ckpt"
    saved = torch.load(path, weights_only=False)["TinyDataModule"]["data_plan"]
    assert saved["strategy"] == "device" and saved["seed"] == 0 and saved["batch_size"] == 8
    assert saved["fingerprints"] == {"train": dm.stores["train"].fingerprint}

    same = TinyDataModule(n=32, batch_size=8, cache_dir=cache, device="cpu", val=False, strategy="device")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec|across ranks is zero|"
                                                  "callbacks used to create the checkpoint).*")
        trainer(tmp_path, max_epochs=1).fit(TinyModel(), same, ckpt_path=str(path))

    other = TinyDataModule(n=32, batch_size=8, cache_dir=cache, device="cpu", val=False, strategy="workers",
                           num_workers=0, seed=5)
    with pytest.warns(UserWarning, match=r"resuming with a different data plan \(strategy, seed changed\): the "
                                         r"remaining batches will differ.*checkpoint: strategy='device', seed=0; "
                                         r"this run: strategy='workers', seed=5"):
        trainer(tmp_path, max_epochs=1).fit(TinyModel(), other, ckpt_path=str(path))


class _FourSplits(TinyDataModule):
    def source(self, split: str):
        return CountingDataset(self.n, self.shape)


class _Predicts(TinyModel):
    def test_step(self, batch, batch_idx):
        return None

    def predict_step(self, batch, batch_idx):
        return batch[1]


def test_a_test_or_predict_from_a_checkpoint_does_not_warn_of_a_changed_plan(tmp_path):
    """``trainer.test(ckpt_path=...)`` (and predict, and LightningCLI's ``test --ckpt_path``)
    warned "resuming with a different data plan (fingerprints changed): the remaining batches
    will differ": the checkpoint held the train split's fingerprint, the run opened the test
    split, and nothing was resumed."""
    cache = str(tmp_path / "c")
    def dm():
        return _FourSplits(n=32, batch_size=8, cache_dir=cache, device="cpu")

    t = trainer(tmp_path, max_epochs=1, enable_checkpointing=True)
    t.fit(_Predicts(), dm())
    path = t.checkpoint_callback.best_model_path
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*different data plan.*")
        trainer(tmp_path).test(_Predicts(), dm(), ckpt_path=path)
        trainer(tmp_path).predict(_Predicts(), dm(), ckpt_path=path)
        trainer(tmp_path, max_epochs=2).fit(_Predicts(), dm(), ckpt_path=path)


@pytest.mark.slow
def test_a_samples_augmentation_is_the_same_whatever_the_batch_rank_strategy_or_resume(tmp_path):
    """Every sample's augmented pixels, bit for bit, across batch sizes, world sizes, strategies and a resume."""
    import os
    import sys

    from _jobs import Launch, free_port
    from _keyed_job import N, run

    cache = str(tmp_path / "cache")
    ref = run(str(tmp_path / "ref"), cache)
    assert len(ref) == 2 * N
    runs = {
        "batch 16": run(str(tmp_path / "b16"), cache, batch_size=16),
        "chunked": run(str(tmp_path / "chunked"), cache, strategy="chunked"),
        "workers, 0": run(str(tmp_path / "w0"), cache, strategy="workers"),
        "workers, 2": run(str(tmp_path / "w2"), cache, strategy="workers", num_workers=2),
    }
    # A mid-epoch resume continues with exactly the augmentations of the uninterrupted run.
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    run(str(tmp_path / "first"), cache, callbacks=[ckpt])
    runs["resumed"] = run(str(tmp_path / "resumed"), cache, ckpt_path=str(tmp_path / "ckpt" / "step=2.ckpt"))
    assert len(runs["resumed"]) == 2 * N - 2 * 8  # the first two batches are not replayed
    # Two ranks (gloo): each sees half the samples, augmented as on one rank.
    port = str(free_port())
    script = str(Path(__file__).parent / "_keyed_job.py")
    out = str(tmp_path / "ddp")
    job = Launch(tmp_path / "ddp-logs", [
        ([sys.executable, script, str(tmp_path / "ddp-root"), cache, out],
         dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", NODE_RANK="0",
              MASTER_PORT=port, PYTHONPATH=os.environ["PYTHONPATH"]))
        for r in range(2)])
    try:
        assert job.wait(300) == [0, 0], job.log()
    finally:
        job.reap()
    ranks = [torch.load(f"{out}.rank{r}.pt") for r in range(2)]
    assert not set(ranks[0]) & set(ranks[1])
    runs["2 ranks"] = {**ranks[0], **ranks[1]}
    for name, got in runs.items():
        assert set(got) <= set(ref) and (len(got) == len(ref) or name == "resumed"), name
        for key, img in got.items():
            assert torch.equal(img, ref[key]), f"{name}: {key} differs from the reference run"
    # The same image: what differs is the augmentation, per sample and per epoch.
    assert len({ref[f"e0_i{i}"].numpy().tobytes() for i in range(N)}) > N * 0.9
    assert all(not torch.equal(ref[f"e0_i{i}"], ref[f"e1_i{i}"]) for i in range(N))


def test_training_on_the_cpu_with_workers_augments_in_the_workers(tmp_path):
    dm = TinyDataModule(n=32, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False,
                        strategy="workers", num_workers=2, persistent_workers=False, train_augment=_aug())
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) == 4 and all(b.prepared for b in batches)  # augmented before they left the workers
    x, _ = dm.augment_batch(batches[0])  # a prepared batch is not augmented again
    assert x.dtype == torch.float32 and torch.equal(x, batches[0][0])


def test_augmenting_ahead_in_a_thread_trains_on_the_same_batches(tmp_path):
    runs = []
    for ahead in (0, 1):
        dm = TinyDataModule(n=32, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False,
                            train_augment=_aug(), augment_ahead=ahead)
        model = TinyModel(record=True)
        trainer(tmp_path, max_epochs=2).fit(model, dm)
        runs.append(model.seen)
    assert len(runs[0]) == len(runs[1]) == 8
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(*runs, strict=True))
    with pytest.raises(ValueError, match="augment_ahead must be 'auto' or an int in \\[0, 4\\], got 9"):
        TinyDataModule(augment_ahead=9)


def test_augment_ahead_auto_prepares_between_steps_on_a_cpu_run(tmp_path):
    # On a CPU run a background thread competes with the step for the cores and the GIL.
    dm = TinyDataModule(n=16, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False,
                        train_augment=_aug())
    dm.setup("fit")
    assert dm.augment_ahead == "auto" and dm.train_dataloader().ahead == 0
    dm = TinyDataModule(n=16, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False,
                        train_augment=_aug(), augment_ahead=2)
    dm.setup("fit")
    assert dm.train_dataloader().ahead == 2


class _Segmentation(TinyDataModule):
    """Images with a mask (the pixels > 127 of their first channel)."""

    def static_transform(self, sample):
        x, y = sample
        return {"image": x, "mask": (x[:1] > 127).to(torch.uint8), "label": y}


def test_a_crop_first_pipeline_cuts_from_the_device_store_with_the_same_pixels(tmp_path):
    """With the store whole on the device and a pipeline that starts with a crop, the loader hands
    the image and mask as rows of the store (not gathered): every sample comes out as the
    workers strategy (gathered, then augmented) makes it."""
    aug = A.Compose([A.RandomCropByLabel(5, pos=2, neg=1, label="mask"), A.RandomFlip(dims=(-2, -1)),
                     A.Normalize([0.5] * 3, [0.25] * 3)])
    out = {}
    for strategy in ("device", "workers"):
        dm = _Segmentation(n=24, batch_size=5, cache_dir=str(tmp_path / "c"), strategy=strategy, device="cpu",
                           num_workers=0, val=False, field_kinds={"image": "image", "mask": "mask"},
                           train_augment=aug)
        dm.setup("fit")
        loader = dm.train_dataloader()
        if strategy == "device":
            assert loader.defer == frozenset({0, 1})  # image and mask; the label is gathered
        for epoch in range(2):
            loader.set_epoch(epoch)
            for batch in loader:
                b = dm.augment_batch(batch)
                for k, i in enumerate(batch.indices.tolist()):
                    out.setdefault(strategy, {})[(epoch, i)] = (b["image"][k], b["mask"][k], b["label"][k])
        dm.teardown("fit")
    assert len(out["device"]) == 2 * 24 and out["device"].keys() == out["workers"].keys()
    for key, (img, mask, label) in out["device"].items():
        ref = out["workers"][key]
        assert img.shape == (3, 5, 5) and torch.equal(img, ref[0]) and torch.equal(mask, ref[1]), key
        assert label == ref[2]


class _LabelFirst(torch.utils.data.Dataset):
    """Dict samples whose first field is the label, then a JPEG-encoded image of varying size."""

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int):
        return {"label": i, "image": torch.full((3, 10 + i, 12), 40 * i, dtype=torch.uint8)}


class _LabelFirstModule(TinyDataModule):
    def source(self, split: str):
        return _LabelFirst() if split == "train" else None


def test_a_label_taken_as_the_image_by_default_is_named_at_setup_with_field_kinds(cache_dir):
    # Without field_kinds the first field is the image: here the label. The augmentation used to
    # fail on the first batch asking for spatial_dims, which a data module cannot be given.
    kw = dict(batch_size=4, cache_dir=str(cache_dir), device="cpu", encode={"image": "jpeg"},
              train_augment=A.Compose([A.RandomResizedCrop(8), A.RandomHorizontalFlip()]))
    dm = _LabelFirstModule(**kw)
    with pytest.raises(ValueError, match=r"train_augment gets the 'train' field 'label' as an image \(kinds: .*\), "
                                         r"but its samples have 0 dimension\(s\) \(\); .* field_kinds"):
        dm.setup("fit")
    dm = _LabelFirstModule(field_kinds={"image": "image", "label": "other"}, **kw)
    dm.setup("fit")
    try:
        out = dm.augment_batch(next(iter(dm.train_dataloader())))
        assert out["image"].shape == (4, 3, 8, 8) and out["label"].shape == (4,)
    finally:
        dm.teardown("fit")


class _Named(torch.utils.data.Dataset):
    """Images of varying size with their file name (a str, which cannot be stored)."""

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int):
        return {"image": torch.full((3, 8 + i, 8), i, dtype=torch.uint8), "name": f"{i}.jpg"}


class _NamedModule(TinyDataModule):
    def source(self, split: str):
        return _Named() if split == "train" else None


@pytest.mark.parametrize("layout", [dict(ragged=["image"]), dict(encode={"image": "jpeg"})])
def test_an_unstorable_split_with_ragged_or_encode_is_refused_not_loaded_per_sample(cache_dir, layout):
    # The per-sample fallback ignores ragged/encode: its collate failed on the first batch
    # ("stack expects each tensor to be equal size"), and JPEG fields went unencoded.
    from lightning_fastdata.store import StoreError

    dm = _NamedModule(batch_size=2, cache_dir=str(cache_dir), device="cpu", num_workers=0, **layout)
    with pytest.raises(StoreError, match=r"the 'train' split cannot be stored \(sample 0, field 'name' is a str; .*\), "
                                         r"and ragged=.*, encode=.* need it stored: make static_transform return only"):
        dm.setup("fit")


class _Failing(TinyModel):
    def training_step(self, batch, batch_idx):
        raise RuntimeError("boom in training_step")


def _held_segments() -> list[str]:
    """This process's open descriptors on the package's /dev/shm segments."""
    import os

    from lightning_fastdata import shared

    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if Path(target.removesuffix(" (deleted)")).name.startswith(shared.prefix()):
            out.append(target)
    return out


def test_a_failed_fit_releases_its_shared_memory_and_a_second_fit_works(tmp_path, cache_dir):
    """Lightning skips ``teardown`` when a fit fails, and ``on_exception`` only closed the
    loaders: each failed fit kept its stores' /dev/shm segments open even once the data module
    was dropped (19.7 MB per trial in a reviewer's loop of failing fits). It releases what
    teardown would (the pages go with the last view); setup places the stores again."""
    import gc

    gc.collect()
    before = set(_held_segments())  # other tests' data modules this process still holds
    for _ in range(2):
        dm = TinyDataModule(n=32, batch_size=8, cache_dir=str(cache_dir), device="cpu", strategy="workers",
                            num_workers=0, shared_memory="on")
        with pytest.raises(RuntimeError, match="boom in training_step"):
            trainer(tmp_path).fit(_Failing(), dm)
        assert dm.placement is not None and not dm.placement.segments
        del dm
        gc.collect()
        assert set(_held_segments()) <= before
    dm = TinyDataModule(n=32, batch_size=8, cache_dir=str(cache_dir), device="cpu", strategy="workers",
                        num_workers=0, shared_memory="on")
    with pytest.raises(RuntimeError, match="boom in training_step"):
        trainer(tmp_path).fit(_Failing(), dm)
    model = TinyModel(record=True)
    trainer(tmp_path).fit(model, dm)  # the same data module, placed again
    assert len(model.seen) == 4  # (Lightning's teardown then released the new segments)
    del dm, model  # the model's trainer holds the data module, whose stores view the segments
    gc.collect()
    assert set(_held_segments()) <= before


class _Predicting(TinyDataModule):
    """Training and prediction splits whose label is the sample's index."""

    def source(self, split: str):
        return CountingDataset(self.n, self.shape, classes=self.n) if split in ("train", "predict") else None


class _Predictor(TinyModel):
    def predict_step(self, batch, batch_idx):
        x, y = batch
        return x, y


class _Writer(BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__("batch")
        self.rows: list[tuple[list[int], list[int]]] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.rows.append((list(batch_indices), prediction[1].tolist()))


@pytest.mark.parametrize("strategy", ["device", "workers"])
def test_prediction_writers_get_each_batchs_sample_indices(tmp_path, strategy):
    # Lightning hands writers batch_indices from the loader's batch sampler: they were [] here
    # (with "Couldn't infer the batch indices"), so predictions could not be mapped to samples.
    dm = _Predicting(n=11, batch_size=4, cache_dir=str(tmp_path / "c"), device="cpu", strategy=strategy)
    writer = _Writer()
    trainer(tmp_path, callbacks=[writer]).predict(_Predictor(), datamodule=dm, return_predictions=False)
    assert [rows for rows, _ in writer.rows] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert all(rows == labels for rows, labels in writer.rows)


def test_prediction_under_ddp_gives_every_sample_to_one_rank(tmp_path, monkeypatch):
    # Padded like DistributedSampler (as training must be), 11 samples over 2 ranks predicted
    # sample 0 twice; Lightning's own prediction sampler does not pad.
    dm = _Predicting(n=11, batch_size=4, cache_dir=str(tmp_path / "c"), device="cpu")
    dm.setup("predict")
    try:
        seen = []
        for rank in (0, 1):
            monkeypatch.setattr(dm, "_rank_world", lambda rank=rank: (rank, 2))
            seen += [i for b in dm.build_loader("predict") for i in b.indices.tolist()]
        assert sorted(seen) == list(range(11))
    finally:
        dm.teardown("predict")


def test_prediction_with_fewer_samples_than_ranks_is_refused_naming_both(tmp_path, monkeypatch):
    # 2 samples over 3 ranks left rank 2 an empty loader: Lightning stopped with its generic
    # zero-length message, naming neither the split's size nor the ranks.
    dm = _Predicting(n=2, batch_size=4, cache_dir=str(tmp_path / "c"), device="cpu")
    dm.setup("predict")
    try:
        for rank in (0, 2):  # every rank refuses: none is left waiting for the others
            monkeypatch.setattr(dm, "_rank_world", lambda rank=rank: (rank, 3))
            with pytest.raises(ValueError, match=r"predict split has 2 sample\(s\) for 3 ranks.*devices=2"):
                dm.build_loader("predict")
        monkeypatch.setattr(dm, "_rank_world", lambda: (1, 2))
        assert [b.indices.tolist() for b in dm.build_loader("predict")] == [[1]]
    finally:
        dm.teardown("predict")


def test_a_random_eval_augment_outside_fit_does_not_depend_on_the_epochs_fitted_before(tmp_path):
    # Lightning sets its fit progress as the epoch of test/predict loaders too: the flips of a
    # prediction right after a 3-epoch fit differed from those of a fresh Trainer.
    def dm():
        return _Predicting(n=16, batch_size=4, cache_dir=str(tmp_path / "c"), device="cpu",
                           eval_augment=A.RandomHorizontalFlip())

    model = _Predictor(classes=16)
    fitted = trainer(tmp_path, max_epochs=3)
    fitted.fit(model, dm())
    after_fit = fitted.predict(model, datamodule=dm())
    fresh = trainer(tmp_path).predict(model, datamodule=dm())
    assert all(torch.equal(a[0], b[0]) for a, b in zip(after_fit, fresh, strict=True))


@pytest.mark.parametrize("chosen", [0, 1])
def test_measured_workers_keep_a_shared_copy_only_when_a_worker_reads_it(tmp_path, monkeypatch, chosen):
    # The placement shared the store for the candidate workers before measuring; with 0
    # workers chosen, one process held a /dev/shm copy nothing else read (the store's size).
    from lightning_fastdata import autotune

    def measure(plan, resources, config, build, device):
        plan.num_workers = chosen
        plan.reasons["num_workers"] = f"{chosen}: measured fastest (test)"

    monkeypatch.setattr(autotune, "measure_num_workers", measure)
    dm = TinyDataModule(n=64, batch_size=8, strategy="workers", num_workers="measure", shared_memory="auto",
                        cache_dir=str(tmp_path / "c"), device="cpu", val=False)
    dm.setup("fit")
    try:
        assert bool(dm.placement.segments) == bool(chosen)
        assert dm.plan.reasons["shared_memory"].startswith("on: " if chosen else "not used: ")
        loader = dm.train_dataloader()
        assert sorted(i for b in loader for i in b.indices.tolist()) == list(range(64))
        _close_loader(loader)
    finally:
        dm.teardown("fit")


def _close_loader(loader) -> None:
    close = getattr(loader, "close", None)
    if close is not None:
        close()


@pytest.mark.parametrize("strategy", ["device", "workers"])
def test_a_validation_run_cut_short_frees_its_iteration_once_training_goes_on(tmp_path, strategy):
    """The sanity check (2 batches) left the val loader's iteration open, which Lightning keeps
    until the next validation run: its background thread and the batches it made ahead
    (device memory on a GPU), or its workers, lived through the training epoch after it."""
    import threading

    seen = {}

    class Probe(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                seen["threads"] = sum(t.name == "lightning_fastdata-ahead" for t in threading.enumerate())
                seen["open"] = [loader.active for _, loader in trainer.datamodule._made.get("val", [])]

    dm = TinyDataModule(n=96, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", strategy=strategy,
                        augment_ahead=1 if strategy == "device" else 0, num_workers=0 if strategy == "device" else 1,
                        persistent_workers=False, train_augment=_aug(), eval_augment=_aug())
    t = trainer(tmp_path, max_steps=4, num_sanity_val_steps=2, limit_val_batches=3, callbacks=[Probe()])
    t.fit(TinyModel(), dm)
    assert seen["open"] and not any(seen["open"])
    if strategy == "device":
        assert seen["threads"] == 1  # the training loader's


class _ValAmongTrain(TinyDataModule):
    """Trains on a labelled loader and the val loader side by side (a semi-supervised set-up)."""

    def train_dataloader(self):
        return {"lab": super().train_dataloader(), "unlab": self.val_dataloader()}


class _SeesUnlabelled(TinyModel):
    def __init__(self) -> None:
        super().__init__()
        self.unlab: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.unlab.append(batch["unlab"][0].clone())
        return super().training_step(batch["lab"], batch_idx)


@pytest.mark.parametrize("strategy,ahead", [("device", 0), ("device", 1), ("workers", 0)])
def test_a_val_loader_among_the_training_loaders_is_never_cut_by_the_training(tmp_path, strategy, ahead):
    """Closing what a cut-short validation run left open closed every open iteration of the val
    loader at each training batch, also the one the training itself was reading: its batch 0
    came back at every step (8 of 8 steps). Only iterations a validation run started are closed."""
    dm = _ValAmongTrain(n=64, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", strategy=strategy,
                        augment_ahead=ahead, num_workers=0, shuffle=False)
    model = _SeesUnlabelled()
    trainer(tmp_path, max_epochs=1, num_sanity_val_steps=2, limit_val_batches=2).fit(model, dm)
    dm.setup("validate")
    want = [b[0] for b in (dm.on_after_batch_transfer(dm.transfer_batch_to_device(b, torch.device("cpu"), 0), 0)
                           for b in dm.val_dataloader())]
    assert len(model.unlab) == 8
    for got, expected in zip(model.unlab, want, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("strategy", ["device", "chunked", "workers"])
def test_a_val_loader_among_the_training_loaders_is_not_closed_before_its_first_batch(tmp_path, strategy):
    """Without a sanity check, the val loop asks for its loader after the training loop took an
    iterator of the one among its loaders, not yet started: that iterator was closed as idle,
    so epoch 0 trained no step in min_size mode (and its validation never ran), silently."""
    from lightning.pytorch.utilities import CombinedLoader

    class MinSize(_ValAmongTrain):
        def train_dataloader(self):
            return CombinedLoader(super().train_dataloader(), "min_size")

    class Counting(_SeesUnlabelled):
        def __init__(self) -> None:
            super().__init__()
            self.epochs: list[int] = []
            self.validated: list[int] = []

        def training_step(self, batch, batch_idx):
            self.epochs.append(self.current_epoch)
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            self.validated.append(self.current_epoch)

    dm = MinSize(n=32, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", strategy=strategy, num_workers=0,
                 shuffle=False)
    model = Counting()
    trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0).fit(model, dm)
    assert model.epochs == [0] * 4 + [1] * 4 and model.validated == [0] * 4 + [1] * 4


def test_a_test_on_several_ranks_says_which_samples_it_counts_twice(tmp_path, monkeypatch):
    """Under DDP, ``trainer.test`` pads the test split so that every rank gets as many batches
    (as DistributedSampler does), so a sample or two enter the metrics twice: Lightning warns
    for the sampler it puts in a plain loader, but puts none in these, and nothing was said."""
    import lightning as L
    from lightning.pytorch.utilities.warnings import PossibleUserWarning

    monkeypatch.setattr(L.Trainer, "world_size", property(lambda self: 2))  # rank 0 of 2, in one process

    def test(n):
        dm = _FourSplits(n=n, batch_size=4, cache_dir=str(tmp_path / f"c{n}"), device="cpu")
        trainer(tmp_path).test(_Predicts(), dm)

    with pytest.warns(PossibleUserWarning, match=r"trainer.test\(\) on 2 ranks: the test split's 15 samples are "
                                                 r"padded to 16 with 1 repeated .* Trainer\(devices=1, num_nodes=1\)"):
        test(15)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*counted twice.*")
        test(16)  # nothing repeated


@pytest.mark.parametrize("callback", [False, True])
def test_store_false_workers_start_under_the_spawn_start_method(tmp_path, callback):
    """``store=False`` hands its workers ``static_transform`` bound to the data module; under the
    "spawn" start method (``ddp_spawn``'s ranks, macOS's default) that pickled the whole module,
    its Trainer and loaders with it, and no worker started: "Can't pickle local object
    'WorkerSeeding.follow.<locals>.set_epoch'" (with FastDataCallback, its process_dataloader)."""
    import multiprocessing as mp
    import pickle

    from lightning_fastdata import FastDataCallback

    dm = TinyDataModule(n=16, batch_size=4, cache_dir=str(tmp_path / "c"), device="cpu", store=False,
                        strategy="workers", num_workers=1, val=False)
    model = TinyModel(record=True)
    before = mp.get_start_method(allow_none=True)
    mp.set_start_method("spawn", force=True)
    try:
        callbacks = [FastDataCallback(print_report=False)] if callback else []
        trainer(tmp_path, callbacks=callbacks).fit(model, dm)
    finally:
        mp.set_start_method(before, force=True)
    assert sorted(y for _, ys in model.seen for y in ys.tolist()) == sorted(i % 4 for i in range(16))
    # A copy is the configuration without the run: a fresh module whose setup opens its data again.
    copy = pickle.loads(pickle.dumps(dm))
    assert copy.trainer is None and copy.placement is None and not copy._loaders and copy.batch_size == 4
    assert copy.static_transform((1, 2)) == (1, 2)


class _VolumeAndLabel(torch.utils.data.Dataset):
    """A volume with a per-voxel label of the same shape, in a dict."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return {"image": torch.randint(-1000, 2000, (1, 6, 6, 6), dtype=torch.int16, generator=g),
                "label": torch.randint(0, 3, (1, 6, 6, 6), dtype=torch.uint8, generator=g)}


class _VolumeAndLabelModule(TinyDataModule):
    def source(self, split: str):
        return _VolumeAndLabel() if split == "train" else None


def test_a_field_shaped_like_the_image_left_other_by_default_is_named_at_setup(cache_dir):
    """Without field_kinds every field after the first is 'other', which no op moves: a label
    volume stayed as it was while its image was flipped, and nothing said so."""
    flip = A.Compose([A.RandomFlip(dims=(-3, -2, -1), p=1.0)])

    def setup(**kw):
        dm = _VolumeAndLabelModule(batch_size=4, cache_dir=str(cache_dir), device="cpu", num_workers=0, **kw)
        dm.setup("fit")
        dm.teardown("fit")
        return dm

    with pytest.warns(UserWarning, match=r"train_augment moves the 'train' image field 'image' and not the field "
                                         r"'label', .* field_kinds=\{'label': 'mask'\} .* field_kinds=\{'label': "
                                         r"'other'\} to silence"):
        dm = setup(train_augment=flip)
    assert dm.kinds("train") == {"image": "image", "label": "other"}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*not the field.*")
        for kw in (dict(field_kinds={"label": "mask"}), dict(field_kinds={"label": "other"}),
                   dict(augment_field="image"),
                   dict(train_augment=A.Compose([A.ToDtype("float32"), A.RandomScaleIntensity(0.1)]))):
            setup(**{"train_augment": flip, **kw})


def test_the_plan_says_store_false_was_the_users_choice(cache_dir):
    """A ``store=False`` data module's plan read "samples cannot be stored", which sent its user
    hunting for a sample that could not (found by a review helper)."""
    dm = TinyDataModule(n=8, batch_size=4, cache_dir=str(cache_dir), device="cpu", store=False, val=False)
    dm.setup("fit")
    assert dm.plan.reasons["strategy"] == "store=False: per-sample loading in DataLoader workers"


class _ValAndTest(TinyDataModule):
    """A fit's validation also runs the test split (set up first, as the error without it says)."""

    def source(self, split: str):
        return CountingDataset(self.n, self.shape) if split in ("train", "val", "test") else None

    def val_dataloader(self):
        self.setup("test")
        return [super().val_dataloader(), self.test_dataloader()]


class _TwoValLoaders(TinyModel):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        pass


def test_a_test_loader_a_fit_asked_for_ends_with_the_fit(tmp_path, cache_dir):
    """The fit's teardown released the train and val splits only: a test loader its
    ``val_dataloader`` returned kept its persistent workers (and the placed test store) after
    ``trainer.fit`` returned, until a ``teardown("test")`` nobody calls (found by a review helper)."""
    import time

    import psutil

    def children() -> set[int]:
        return {c.pid for c in psutil.Process().children(recursive=True)
                if c.is_running() and c.status() != psutil.STATUS_ZOMBIE}

    before = children()
    dm = _ValAndTest(n=16, batch_size=4, cache_dir=str(cache_dir), device="cpu", strategy="workers", num_workers=1,
                     persistent_workers=True)
    trainer(tmp_path, num_sanity_val_steps=0).fit(_TwoValLoaders(), dm)
    deadline = time.monotonic() + 10
    while children() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sorted(children() - before) == []
    assert "test" not in dm.placement.sources and not dm._made


def test_the_batch_bytes_workers_send_count_their_augmentation_on_a_cpu_run(cache_dir):
    """On a CPU run the workers augment and send the augmented batch through /dev/shm; its size
    was taken from the stored uint8 row, 4x too small under a float32 ``Normalize``, so the
    /dev/shm headroom and the workers' caps let a small /dev/shm overflow and the fit hang
    (found by a review helper). Chunks hold stored rows: their size does not follow, and a crop
    that keeps the size and dtype changes nothing."""
    import random

    from lightning_fastdata import augment as A

    row = 3 * 8 * 8 + 8  # uint8 image, int64 label
    normalize = A.Normalize([0.5] * 3, [0.2] * 3)
    dm = TinyDataModule(n=16, batch_size=4, cache_dir=str(cache_dir), device="cpu", val=False,
                        train_augment=normalize)
    dm.setup("fit")
    state = torch.random.get_rng_state(), random.getstate()
    assert dm.plan_config()["sent_batch_nbytes"] == 4 * (4 * 3 * 8 * 8 + 8)
    assert dm.plan_config()["batch_nbytes"] == 4 * row  # what a chunk must hold
    assert torch.equal(torch.random.get_rng_state(), state[0]) and random.getstate() == state[1]
    same = TinyDataModule(n=16, batch_size=4, cache_dir=str(cache_dir), device="cpu", val=False,
                          train_augment=A.RandomCrop(8, padding=2))
    same.setup("fit")
    assert same.plan_config()["sent_batch_nbytes"] == 4 * row
    chunked = TinyDataModule(n=16, batch_size=4, cache_dir=str(cache_dir), device="cpu", val=False,
                             train_augment=normalize, strategy="chunked")
    chunked.setup("fit")
    assert chunked.plan.strategy == "chunked" and chunked.plan_config()["sent_batch_nbytes"] == 4 * row


class _Ragged(TinyDataModule):
    """Sample 0 is 2x2, the others 8x8: a ragged image field."""

    def source(self, split: str):
        return [(torch.full((3, 2, 2) if i == 0 else (3, 8, 8), i, dtype=torch.uint8), i) for i in range(self.n)]


def test_the_batch_bytes_workers_send_follow_a_ragged_fields_largest_sample(cache_dir):
    """A ragged field's bytes once augmented: sample 0 alone (here 2x2 of mostly 8x8) hid the 4x
    growth of the rest under ``Normalize``, and scaling the mean row by sample 0's growth made a
    resize to a fixed size 14x too large (both found by review helpers)."""
    from lightning_fastdata import augment as A

    normalize = A.Normalize([0.5] * 3, [0.2] * 3)
    for augment, image in ((normalize, 3 * 8 * 8 * 4), (A.Compose([A.Resize((4, 4)), normalize]), 3 * 4 * 4 * 4)):
        dm = _Ragged(n=8, batch_size=4, cache_dir=str(cache_dir), device="cpu", val=False, ragged=["0"],
                     train_augment=augment)
        dm.setup("fit")
        assert dm.plan_config()["sent_batch_nbytes"] == 4 * (image + 8)


@pytest.mark.parametrize("second,skipped", [
    # Lightning counts a max_steps-ended epoch as done: it restored nothing and said nothing.
    (dict(max_epochs=2), "batches 5 to 7 of epoch 0 are never seen"),
    # It restores the loader into epoch 1 but numbers that epoch's batches from 5: 3 of 8 run.
    (dict(max_steps=12, max_epochs=-1), "batches 5 to 7 of epoch 0 and batches 3 to 7 of epoch 1"),
])
def test_resuming_where_max_steps_stopped_says_which_batches_are_never_seen(tmp_path, cache_dir, second, skipped):
    """A fit stopped by ``max_steps`` inside an epoch and continued from its checkpoint: under
    ``max_epochs`` the rest of the epoch was skipped without a word, under ``max_steps`` the
    warning left out the next epoch that Lightning cuts short (found by a review helper)."""
    import warnings

    def dm() -> TinyDataModule:
        return TinyDataModule(n=32, batch_size=4, cache_dir=str(cache_dir), device="cpu", val=False)

    first = trainer(tmp_path, max_steps=5, max_epochs=-1)
    first.fit(TinyModel(), dm())
    ckpt = str(tmp_path / "stopped.ckpt")
    first.save_checkpoint(ckpt)
    with pytest.warns(UserWarning, match=f"stopped at batch 5 of 8 of epoch 0, .* so {skipped}"):
        trainer(tmp_path, **second).fit(TinyModel(), dm(), ckpt_path=ckpt)
    # From an epoch's end nothing is skipped, and nothing is said.
    done = trainer(tmp_path, max_epochs=1)
    done.fit(TinyModel(), dm())
    done.save_checkpoint(ckpt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, max_epochs=2).fit(TinyModel(), dm(), ckpt_path=ckpt)
    assert not [w for w in caught if "never seen" in str(w.message)]
