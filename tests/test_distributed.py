"""Rank discovery from the process group and the launchers' environments."""

from __future__ import annotations

import pytest
import torch
from _helpers import TinyDataModule

from lightning_fastdata import distributed as D

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
                  "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NODEID")


@pytest.fixture
def env(monkeypatch):
    """A clean launcher environment, to be filled by the test."""
    for name in _LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _group(monkeypatch, rank: int, world: int) -> None:
    """As if ``init_process_group`` had run (``mp.spawn``: no LOCAL_* variables)."""
    monkeypatch.setattr(D, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: rank)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: world)


def test_a_spawned_group_without_local_variables_is_one_node_of_distinct_local_ranks(env):
    # Every rank said local rank 0 of 2: the shared-memory set-up then refused, naming
    # LOCAL_RANK and LOCAL_WORLD_SIZE, which the user never set.
    for rank in (0, 1):
        _group(env, rank, 2)
        assert (D.local_rank(), D.local_world_size()) == (rank, 2)


@pytest.mark.parametrize("tasks,node,expected", [("4(x2)", "1", 4), ("3,2", "1", 2), ("2(x3),1", "3", 1),
                                                 ("2(x3),1", "0", 2)])
def test_slurm_tasks_per_node_gives_the_local_world_without_ntasks_per_node(env, tasks, node, expected):
    # srun --nodes=2 --ntasks=8 sets SLURM_TASKS_PER_NODE="4(x2)", not SLURM_NTASKS_PER_NODE:
    # each node was taken for one rank (or for the whole job).
    _group(env, 1, 8)
    env.setenv("SLURM_TASKS_PER_NODE", tasks)
    env.setenv("SLURM_NODEID", node)
    assert D.local_world_size() == expected
    env.setenv("LOCAL_WORLD_SIZE", "3")  # a launcher's own variable wins
    assert D.local_world_size() == 3


def test_a_single_process_in_a_slurm_allocation_reads_every_sample_and_is_told(env, tmp_path):
    # An sbatch -n4 batch step runs this one process with SLURM_NTASKS=4, SLURM_PROCID=0: with
    # neither a process group nor a Trainer it took rank 0's quarter of the data, silently.
    env.setenv("SLURM_NTASKS", "4")
    env.setenv("SLURM_PROCID", "0")
    dm = TinyDataModule(n=64, batch_size=8, cache_dir=str(tmp_path / "c"), device="cpu", val=False)
    try:
        with pytest.warns(UserWarning, match=r"the environment says this is rank 0 of 4 .* but no process group is "
                                             r"initialised and no Trainer is attached: these loaders read every "
                                             r"sample"):
            dm.setup("fit")
            loader = dm.train_dataloader()
        assert sorted(i for b in loader for i in b.indices.tolist()) == list(range(64))
    finally:
        dm.teardown("fit")
