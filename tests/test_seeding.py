"""Worker seeding: distinct streams per (rank, worker, epoch), reproducible, chained, per epoch."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from _jobs import free_port
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    get_worker_info,
)

from lightning_fastdata import seeding as S

# Four workers on a two-core machine: torch warns; the test wants exactly that many.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class Draws(Dataset):
    """Each item: the worker id, then two draws each from torch, numpy and random (float64)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        return torch.tensor(
            [
                info.id if info else -1,
                *torch.rand(2, dtype=torch.float64).tolist(),
                *np.random.rand(2).tolist(),
                random.random(),
                random.random(),
            ],
            dtype=torch.float64,
        )


class IterDraws(IterableDataset):
    def __iter__(self):
        yield torch.tensor(
            [get_worker_info().id, torch.rand(1).item(), np.random.rand(), random.random()]
        )


def _loader(dataset, workers: int, persistent: bool, **kw) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=1,
        shuffle=False,
        num_workers=workers,
        persistent_workers=persistent,
        multiprocessing_context="fork",
        **kw,
    )


def _epoch_by_worker(dl: DataLoader) -> dict[int, torch.Tensor]:
    out = {}
    for batch in dl:
        for row in batch:
            out.setdefault(int(row[0]), row[1:])
    return out


def _grid(ranks: int = 4, workers: int = 4, epochs: int = 3, seed: int = 7) -> torch.Tensor:
    """(rank, worker, epoch, draw) from persistent workers; the epoch reaches them via set_epoch."""
    grid = torch.zeros(ranks, workers, epochs, 6, dtype=torch.float64)
    for r in range(ranks):
        dl = _loader(Draws(workers), workers, persistent=True)
        assert S.install_worker_seeding(dl, seed=seed, rank=r)
        for e in range(epochs):
            assert S.set_worker_epoch(dl, e)
            by_worker = _epoch_by_worker(dl)
            assert sorted(by_worker) == list(range(workers))
            for w, row in by_worker.items():
                grid[r, w, e] = row
        del dl  # shuts the persistent workers down
    return grid


def test_rank_worker_epoch_grid_is_distinct_and_reproducible():
    grid = _grid()
    for lib, cols in (("torch", slice(0, 2)), ("numpy", slice(2, 4)), ("random", slice(4, 6))):
        cells = {tuple(v.tolist()) for v in grid[..., cols].reshape(-1, 2)}
        assert len(cells) == 4 * 4 * 3, f"{lib}: only {len(cells)} distinct cells of 48"
    assert torch.equal(grid, _grid()), "a rerun drew different numbers"


def test_non_persistent_workers_reseed_per_epoch_and_reproduce():
    def run() -> torch.Tensor:
        dl = _loader(Draws(2), 2, persistent=False)
        S.install_worker_seeding(dl, seed=3, rank=1)
        rows = []
        for e in range(2):
            S.set_worker_epoch(dl, e)
            rows.append(torch.stack([v for _, v in sorted(_epoch_by_worker(dl).items())]))
        return torch.stack(rows)

    a = run()
    assert not torch.isin(a[0], a[1]).any(), "epoch 2 repeated draws of epoch 1"
    assert torch.equal(a, run())


def test_persistent_iterable_workers_draw_differently_each_epoch():
    dl = _loader(IterDraws(), 2, persistent=True)
    S.install_worker_seeding(dl, seed=0, rank=0)
    epochs = []
    for e in range(2):
        S.set_worker_epoch(dl, e)
        epochs.append(torch.cat([b for b in dl]))
    assert not torch.isin(epochs[0][:, 1:].contiguous(), epochs[1][:, 1:].contiguous()).any()


def test_without_an_epoch_workers_still_differ_per_epoch():
    # Nobody calls set_epoch: the fallback mixes in torch's per-iteration base seed.
    dl = _loader(Draws(2), 2, persistent=False)
    assert S.install_worker_seeding(dl, seed=3, rank=0)
    torch.manual_seed(0)
    a, b = _epoch_by_worker(dl), _epoch_by_worker(dl)
    assert not torch.isin(a[0], b[0]).any()


_USER_CALLS: list[int] = []


def _user_fn(worker_id: int) -> None:
    # Runs in the worker after the package's seeding: record the first random draw.
    os.environ["LFD_TEST_USER_DRAW"] = repr(random.random())


class UserDraw(Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(
            [get_worker_info().id, float(os.environ.get("LFD_TEST_USER_DRAW", "nan"))],
            dtype=torch.float64,
        )


def _split_draws(split: str | None, seed: int = 4, epoch: int = 2) -> torch.Tensor:
    dl = _loader(Draws(2), 2, persistent=False)
    kw = {} if split is None else {"split": split}
    assert S.install_worker_seeding(dl, seed=seed, rank=0, **kw)
    S.set_worker_epoch(dl, epoch)
    return torch.stack([v for _, v in sorted(_epoch_by_worker(dl).items())])


def test_train_and_validation_workers_draw_different_streams():
    # The same seed, rank, worker ids and epoch: only the split tells the loaders apart.
    # Without it a dataset that generates its samples (or noise) from the RNG validates on
    # exactly the samples it trained on.
    train, val = _split_draws("train"), _split_draws("val")
    assert not torch.isin(train, val).any(), "validation workers replayed the training draws"
    assert not torch.isin(val, _split_draws("val/1")).any(), "two validation loaders drew the same"
    assert torch.equal(val, _split_draws("val")), "a rerun of the validation loader drew differently"
    # The training loader (the default split) keeps its seeds.
    assert torch.equal(train, _split_draws(None))
    seeding = S.WorkerSeeding(4, split="val")
    assert seeding.worker_seed(0, 2) != S.WorkerSeeding(4).worker_seed(0, 2)
    assert "split='val'" in repr(seeding)


def test_user_worker_init_fn_still_runs_after_the_seeding():
    dl = _loader(UserDraw(), 2, persistent=False, worker_init_fn=_user_fn)
    assert S.install_worker_seeding(dl, seed=5, rank=2)
    assert dl.worker_init_fn.user_fn is _user_fn
    S.set_worker_epoch(dl, 4)
    rows = torch.cat(list(dl))
    seeding = dl.worker_init_fn
    for wid, value in rows.tolist():
        S.seed_libraries(seeding.worker_seed(int(wid), 4))
        assert value == random.random(), (
            "the user's function did not run, or ran before the seeding"
        )


def test_install_only_where_useful_and_only_once():
    assert not S.install_worker_seeding(DataLoader(Draws(2), num_workers=0), 0, 0)
    assert not S.install_worker_seeding([1, 2, 3], 0, 0)
    dl = DataLoader(Draws(2), num_workers=2)
    assert S.install_worker_seeding(dl, 0, 0)
    assert not S.install_worker_seeding(dl, 0, 0)
    assert not S.set_worker_epoch(DataLoader(Draws(2)), 1)


def test_seeding_follows_a_distributed_sampler():
    ds = Draws(8)
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=0)
    dl = DataLoader(ds, sampler=sampler, num_workers=1)
    S.install_worker_seeding(dl, seed=0, rank=1)
    sampler.set_epoch(6)  # what Lightning does every epoch
    assert dl.worker_init_fn.epoch == 6 and sampler.epoch == 6


def test_seeding_rejects_bad_values():
    with pytest.raises(ValueError, match="seed"):
        S.WorkerSeeding(-1)
    with pytest.raises(ValueError, match="rank"):
        S.WorkerSeeding(0, rank=-2)
    with pytest.raises(ValueError, match="epoch"):
        S.WorkerSeeding(0).set_epoch(-1)
    with pytest.raises(TypeError, match="set_epoch"):
        S.WorkerSeeding(0).follow(object())
    # The initial epoch is checked as set_epoch checks it: -1 used to mean "unset" silently,
    # and -2 only failed inside a worker.
    for bad in (-1, -2, True):
        with pytest.raises(ValueError, match=f"epoch must be an int >= 0, got {bad!r}"):
            S.WorkerSeeding(0, epoch=bad)
    assert S.WorkerSeeding(0, epoch=3).epoch == 3 and S.WorkerSeeding(0).epoch is None
    for bad in ("", None, 1):
        with pytest.raises(ValueError, match=f"split must be a non-empty str .*got {bad!r}"):
            S.WorkerSeeding(0, split=bad)


class HoldsRng(Dataset):
    def __init__(self) -> None:
        self.transform = [lambda x: x, np.random.default_rng(0)]

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        return i


def test_randomness_repeats_names_the_cause(monkeypatch):
    assert S.randomness_repeats(DataLoader(HoldsRng(), num_workers=0)) is None
    reason = S.randomness_repeats(DataLoader(HoldsRng(), num_workers=2))
    assert reason and "dataset.transform[1]" in reason
    dl = DataLoader(Draws(4), num_workers=2)
    assert S.randomness_repeats(dl) is None
    from lightning_fastdata import distributed as D

    monkeypatch.setattr(D, "world_size", lambda: 2)
    monkeypatch.setenv("PL_GLOBAL_SEED", "42")
    reason = S.randomness_repeats(dl)
    assert reason and "rank" in reason
    S.install_worker_seeding(dl, seed=42, rank=1)
    assert S.randomness_repeats(dl) is None


def test_ddp_without_workers_warns_that_every_rank_draws_alike(monkeypatch, tmp_path):
    """With num_workers=0 (what the planner picks for 2 ranks on 2 cores) the dataset draws in
    each rank's main process, seeded alike on every rank by seed_everything: different samples
    got the same random numbers on every rank, with no warning. The store's own gather (no
    random draws) is not named."""
    from _helpers import TinyDataModule

    from lightning_fastdata import distributed as D

    dl = DataLoader(Draws(4), num_workers=0)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)  # an earlier test's seed_everything sets it
    assert S.randomness_repeats(dl) is None  # one process
    monkeypatch.setattr(D, "world_size", lambda: 2)
    assert S.randomness_repeats(dl) is None  # not seeded by seed_everything
    monkeypatch.setenv("PL_GLOBAL_SEED", "42")
    reason = S.randomness_repeats(dl)
    assert reason and "num_workers=0" in reason and "every rank draws the same ones" in reason
    dm = TinyDataModule(n=8, strategy="workers", num_workers=0, batch_size=4, cache_dir=str(tmp_path / "cache"))
    dm.setup("fit")
    try:
        assert S.randomness_repeats(dm.train_dataloader()) is None  # batches gathered from the store
    finally:
        dm.teardown("fit")


def test_derive_seed_streams_are_distinct_and_stable():
    keys = [(r, w, e) for r in range(4) for w in range(4) for e in range(4)]
    seeds = {S.derive_seed(1, stream="worker", rank=r, worker=w, epoch=e) for r, w, e in keys}
    assert len(seeds) == len(keys)
    assert S.derive_seed(1, rank=1) == S.derive_seed(1, rank=1) != S.derive_seed(2, rank=1)


# ----------------------------------------------------------------------------- the datamodule


class RandomSource(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return torch.tensor([torch.rand(1).item(), np.random.rand(), random.random()]), i


def _datamodule_epochs(tmp_path: Path) -> list[torch.Tensor]:
    from _helpers import TinyDataModule

    class DM(TinyDataModule):
        def source(self, split):
            return RandomSource() if split == "train" else None

    dm = DM(
        store=False,
        strategy="workers",
        num_workers=2,
        persistent_workers=True,
        batch_size=2,
        seed=9,
        shuffle=False,
        cache_dir=str(tmp_path / "cache"),
    )
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader.dataloader.worker_init_fn, S.WorkerSeeding)
    assert loader.dataloader.persistent_workers
    out = []
    for e in range(2):
        loader.sampler.set_epoch(e)  # as Lightning does
        out.append(torch.cat([x for x, _ in loader]))
    # Shut the persistent workers down now, so they remove their temporary files within the test.
    loader.close()
    return out


def test_datamodule_train_and_val_workers_are_seeded_apart(tmp_path):
    from _helpers import TinyDataModule

    dm = TinyDataModule(n=8, store=False, strategy="workers", num_workers=1, batch_size=4,
                        cache_dir=str(tmp_path / "cache"))
    dm.setup("fit")
    train, val = dm.train_dataloader().dataloader.worker_init_fn, dm.val_dataloader().dataloader.worker_init_fn
    assert (train.split, val.split) == ("train", "val")
    assert train.worker_seed(0, epoch=0) != val.worker_seed(0, epoch=0)


def test_datamodule_worker_loader_seeds_per_epoch(tmp_path):
    a = _datamodule_epochs(tmp_path)
    assert not torch.isin(a[0], a[1]).any(), "persistent workers repeated epoch 1 in epoch 2"
    assert all(torch.equal(x, y) for x, y in zip(a, _datamodule_epochs(tmp_path), strict=True))


def test_persistent_workers_draw_the_same_at_every_pass_of_an_epoch():
    # A persistent worker reseeded only when the epoch changed: a second pass in the same epoch
    # (a second validation run) continued its stream, and so did a pass after an abandoned one.
    def passes(persistent: bool, dataset: Dataset) -> list[torch.Tensor]:
        dl = _loader(dataset, 2, persistent=persistent)
        S.install_worker_seeding(dl, seed=5, rank=0, split="val")
        S.set_worker_epoch(dl, 1)
        out = [torch.cat(list(dl))]
        next(iter(dl))  # a pass cut short, as a sanity check is
        out += [torch.cat(list(dl)), torch.cat(list(dl))]
        del dl  # shuts persistent workers down
        return out

    for dataset in (Draws(4), IterDraws()):
        reference = passes(False, dataset)
        assert all(torch.equal(p, reference[0]) for p in reference)
        assert all(torch.equal(p, reference[0]) for p in passes(True, dataset)), type(dataset).__name__


def test_a_pass_counting_sampler_pickles_as_the_users_own_and_lightning_can_wrap_it():
    """The persistent loader's batch sampler counts passes through a subclass of its class:
    pickled (a ``ddp_spawn`` fit after a first run) it failed ("not the same object as
    BatchSampler"), and Lightning's predict wrapper, whose ``__iter__`` returns itself,
    recursed without end."""
    import copy
    import pickle

    from torch.utils.data import BatchSampler

    dl = DataLoader(Draws(6), batch_size=2, num_workers=1, persistent_workers=True, multiprocessing_context="fork")
    S.install_worker_seeding(dl, seed=5, rank=0, split="predict")
    S.set_worker_epoch(dl, 0)
    for again in (pickle.loads(pickle.dumps(dl.batch_sampler)), copy.deepcopy(dl.batch_sampler)):
        assert type(again) is BatchSampler and list(again) == [[0, 1], [2, 3], [4, 5]]
    pickle.dumps(dl)  # the whole loader too

    class SelfIterating:
        """As Lightning's _IndexBatchSamplerWrapper: ``__iter__`` returns itself."""

        def __init__(self, inner) -> None:
            self.inner, self.seen = inner, []

        def __iter__(self):
            self._it = iter(self.inner)
            return self

        def __next__(self):
            batch = next(self._it)
            self.seen.append(batch)
            return batch

        def __len__(self) -> int:
            return len(self.inner)

    wrapped = DataLoader(Draws(6), batch_sampler=SelfIterating(BatchSampler(range(6), 2, False)), num_workers=1,
                         persistent_workers=True, multiprocessing_context="fork")
    S.install_worker_seeding(wrapped, seed=5, rank=0, split="predict")
    S.set_worker_epoch(wrapped, 0)
    first, second = torch.cat(list(wrapped)), torch.cat(list(wrapped))
    assert torch.equal(first, second) and wrapped.batch_sampler.seen[-1] == [4, 5]
    del dl, wrapped


def _random_validation(tmp_path: Path, persistent: bool):
    """A data module whose dataset draws from torch, numpy and random, and a model recording
    every validation run's samples (one list per run, the sanity check's included)."""
    import lightning as L
    from _helpers import TinyDataModule

    class DM(TinyDataModule):
        def source(self, split):
            return RandomSource() if split in ("train", "val") else None

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(1))
            self.runs: list[list[float]] = []

        def training_step(self, batch, batch_idx):
            return (self.p * batch[0].sum()).sum()

        def on_validation_epoch_start(self) -> None:
            self.runs.append([])

        def validation_step(self, batch, batch_idx):
            self.runs[-1].extend(batch[0].flatten().tolist())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def dm() -> DM:
        return DM(store=False, strategy="workers", num_workers=1, persistent_workers=persistent, batch_size=4,
                  seed=3, cache_dir=str(tmp_path / "cache"))

    return dm, Model


def test_datamodule_validation_runs_of_an_epoch_draw_alike_whatever_ran_before(tmp_path):
    # A persistent worker reseeded only when the epoch changed: the second validation run of an
    # epoch, or the first after a sanity check, continued the worker's stream.
    from _helpers import trainer as make_trainer

    def runs(persistent: bool, sanity: int) -> list[list[float]]:
        dm, Model = _random_validation(tmp_path, persistent)
        model = Model()
        make_trainer(tmp_path, val_check_interval=0.5, num_sanity_val_steps=sanity).fit(model, dm())
        return model.runs[1:] if sanity else model.runs

    reference = runs(persistent=False, sanity=0)
    assert len(reference) == 2 and len(reference[0]) == 8 * 3 and reference[0] == reference[1]
    assert runs(persistent=True, sanity=0) == reference
    assert runs(persistent=True, sanity=2) == reference


def test_datamodule_validate_after_a_fit_draws_what_a_fresh_trainer_draws(tmp_path):
    # The held order kept epoch 0 outside a fit, but the worker seeding following it took
    # Lightning's set_epoch (the fit's progress) anyway: the validate drew the fit's last epoch.
    from _helpers import trainer as make_trainer

    dm, Model = _random_validation(tmp_path, persistent=False)

    def fresh() -> list[float]:
        model = Model()
        make_trainer(tmp_path).validate(model, dm(), verbose=False)
        return model.runs[-1]

    first = fresh()
    assert len(first) == 8 * 3 and first == fresh()
    model = Model()
    t = make_trainer(tmp_path, max_epochs=3, num_sanity_val_steps=0)
    t.fit(model, dm())
    # Evaluation stays at epoch 0 in a fit too: every epoch's validation draws what validate draws.
    assert len(model.runs) == 3 and all(run == first for run in model.runs)
    t.validate(model, dm(), verbose=False)
    assert model.runs[-1] == first


# ----------------------------------------------------------------------------- DDP, device strategy

_DDP_SCRIPT = textwrap.dedent('''
    import sys, torch
    sys.path.insert(0, {tests!r})
    from _helpers import TinyDataModule, TinyModel, ddp_exit_in_order, trainer
    from lightning_fastdata import augment as A

    class Same(torch.utils.data.Dataset):
        """Every sample is the same image: differences come from the augmentation only."""
        def __len__(self): return 16
        def __getitem__(self, i):
            g = torch.Generator().manual_seed(0)
            return torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8, generator=g), 0

    class DM(TinyDataModule):
        def source(self, split):
            return Same() if split == "train" else None

    aug = A.Compose([A.RandomResizedCrop(12), A.RandomHorizontalFlip(),
                     A.ColorJitter(0.4, 0.4, 0.4),
                     A.Normalize([0.5] * 3, [0.25] * 3)])
    dm = DM(strategy="device", device="cpu", batch_size=4, seed=11, train_augment=aug,
            cache_dir={cache!r})
    model = TinyModel(in_features=3 * 12 * 12, classes=4, record=True)
    t = trainer({root!r}, devices=2, strategy="ddp", max_epochs=2, num_sanity_val_steps=0)
    t.fit(model, dm)
    torch.save(torch.stack([x for x, _ in model.seen]), {out!r}.format(t.global_rank))
    ddp_exit_in_order()
''')


def _ddp_run(tmp_path: Path, tag: str) -> list[torch.Tensor]:
    out = str(tmp_path / f"{tag}-rank{{}}.pt")
    script = tmp_path / f"{tag}.py"
    script.write_text(
        _DDP_SCRIPT.format(
            tests=str(Path(__file__).parent),
            cache=str(tmp_path / f"cache-{tag}"),
            root=str(tmp_path / tag),
            out=out,
        )
    )
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE="2",
            NODE_RANK="0",
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE="2",
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    for p, log in zip(procs, logs, strict=False):
        assert p.returncode == 0, log[-3000:]
    return [torch.load(out.format(r)) for r in range(2)]


@pytest.mark.slow
def test_ddp_ranks_augment_differently_and_reproducibly(tmp_path):
    first = _ddp_run(tmp_path, "a")
    r0, r1 = first
    assert r0.shape == r1.shape == (4, 4, 3, 12, 12)  # 2 epochs x 2 batches per rank
    for b in range(r0.shape[0]):
        for i in range(r0.shape[1]):
            assert not torch.equal(r0[b, i], r1[b, i]), (
                f"ranks augmented batch {b} sample {i} identically"
            )
    assert not torch.equal(r0[:2], r0[2:]), "epoch 2 repeated epoch 1"
    second = _ddp_run(tmp_path, "b")
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_a_followed_sampler_pickles_and_its_copy_follows_its_own_seeding():
    """``follow`` replaced the sampler's ``set_epoch`` with a closure: a followed sampler (and its
    loader) could not be pickled ("Can't pickle local object 'WorkerSeeding.follow.<locals>.
    set_epoch'": a ``ddp_spawn`` fit, a "spawn" worker), and a deep copy's ``set_epoch`` moved the
    original sampler instead of the copy."""
    import copy
    import pickle

    ds = Draws(8)
    dl = DataLoader(ds, sampler=DistributedSampler(ds, num_replicas=2, rank=1, seed=0), num_workers=1)
    S.install_worker_seeding(dl, seed=0, rank=1)
    dl.sampler.set_epoch(2)
    for again in (pickle.loads(pickle.dumps(dl)), copy.deepcopy(dl)):
        again.sampler.set_epoch(5)
        assert again.sampler.epoch == 5 and again.worker_init_fn.epoch == 5
        assert dl.sampler.epoch == 2 and dl.worker_init_fn.epoch == 2
        again.sampler.set_epoch(6)  # a copy pickles again
        assert pickle.loads(pickle.dumps(again.sampler)).epoch == 6
