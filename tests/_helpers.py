"""Small datasets and models shared by the tests (imported by conftest and test modules)."""

from __future__ import annotations

from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_fastdata import OptimizedDataModule


class CountingDataset(Dataset):
    """``n`` deterministic uint8 images with int labels; counts ``__getitem__`` calls."""

    def __init__(self, n: int = 64, shape: tuple[int, ...] = (3, 8, 8), classes: int = 4) -> None:
        self.n, self.shape, self.classes = n, shape, classes
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.calls += 1
        g = torch.Generator().manual_seed(1000 + i)
        return torch.randint(0, 256, self.shape, dtype=torch.uint8, generator=g), i % self.classes


class TinyDataModule(OptimizedDataModule):
    """An OptimizedDataModule over :class:`CountingDataset`; counts static_transform calls."""

    def __init__(self, n: int = 64, shape: tuple[int, ...] = (3, 8, 8), val: bool = True, **kwargs) -> None:
        kwargs.setdefault("progress", False)
        super().__init__(**kwargs)
        self.n, self.shape, self.val = n, shape, val
        self.transform_calls = 0

    def source(self, split: str):
        if split == "train" or (split == "val" and self.val):
            return CountingDataset(self.n, self.shape)
        return None

    def static_transform(self, sample):
        self.transform_calls += 1
        return sample


class TinyModel(L.LightningModule):
    """A linear classifier over flattened images; records the batches it saw when asked."""

    def __init__(self, in_features: int = 3 * 8 * 8, classes: int = 4, record: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Linear(in_features, classes)
        self.record = record
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.record:
            self.seen.append((x.detach().clone(), y.detach().clone()))
        return torch.nn.functional.cross_entropy(self.net(x.float().flatten(1)), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x.float().flatten(1)), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(tmp_path, **kwargs) -> L.Trainer:
    """A quiet CPU Trainer rooted in ``tmp_path``."""
    opts = dict(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    opts.update(kwargs)
    return L.Trainer(**opts)


def as_numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def ddp_exit_in_order(linger_s: float = 1.0) -> None:
    """End a child DDP rank so rank 0, which hosts the TCPStore, leaves last.

    Lightning destroys the process group at exit; if rank 0's store goes first, another
    rank's gloo threads can abort ("terminate called without an active exception").
    """
    import time

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank == 0:
            time.sleep(linger_s)


def child_result(method: str, target: Any, args: tuple = (), timeout: float = 60) -> tuple[Any, int | None]:
    """Run ``target(*args, queue)`` in a child process started by ``method``; return (the one
    value it puts on the queue, its exit code). The child is always joined, and killed if it
    outlives ``timeout`` (a hang fails the test instead of stalling the suite)."""
    import multiprocessing as mp

    ctx = mp.get_context(method)
    queue = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, queue))
    child.start()
    try:
        got = queue.get(timeout=timeout)
    finally:
        child.join(timeout=timeout)
        if child.is_alive():
            child.kill()
            child.join(timeout=30)
        queue.close()
    return got, child.exitcode


def run_demo(cwd, *args: str) -> Any:
    """``python -m lightning_fastdata.demo *args`` in ``cwd``, one thread, this checkout first on the path."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-m", "lightning_fastdata.demo", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def names_of(store) -> list[str]:
    """Field names of a store, in leaf order."""
    return [i.name for i in store.infos]


def device_loader(store, order, device="cpu"):
    """An IndexLoader over ``store``'s fields placed on ``device`` (the ``device`` strategy)."""
    from lightning_fastdata.loaders import IndexLoader
    from lightning_fastdata.placement import DeviceSource

    return IndexLoader(DeviceSource.from_arrays(list(store.fields), device), order, store.spec, names_of(store))


def chunked_loader(store, order, chunk_bytes: int = 64 << 20, mode: str = "global", window: int = 4,
                   buffers=None, device="cpu"):
    """An IndexLoader streaming ``store`` through chunk buffers to ``device`` (the ``chunked`` strategy)."""
    from lightning_fastdata.loaders import BlockOrder, IndexLoader
    from lightning_fastdata.placement import ChunkBuffers, ChunkedSource, HostSource

    if buffers is None:
        buffers = ChunkBuffers.for_store(store, device, chunk_bytes, order.batch_size, world_size=order.world_size)
    if mode == "block":
        o = order
        order = BlockOrder(o.n, o.batch_size, rows=buffers.rows, window=window, shuffle=o.shuffle,
                           drop_last=o.drop_last, seed=o.seed, rank=o.rank, world_size=o.world_size)
        order.set_epoch(o.epoch)
    elif mode != "global":
        raise ValueError(f"mode must be 'global' or 'block', got {mode!r}")
    return IndexLoader(ChunkedSource(HostSource(list(store.fields)), buffers), order, store.spec, names_of(store))
