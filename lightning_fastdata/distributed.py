"""Rank discovery and collectives over ``torch.distributed``; no-ops without a process group.

Everything here works before and without Lightning: ranks come from the process group
when one is initialised, else from the launcher's environment (torchrun, SLURM,
Lightning's own launcher), else the process is rank 0 of 1.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

_RANK_VARS = ("RANK", "SLURM_PROCID")
_WORLD_VARS = ("WORLD_SIZE", "SLURM_NTASKS")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID")
_LOCAL_WORLD_VARS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")


def _env_int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value:
            try:
                # SLURM_NTASKS_PER_NODE may read "4(x2)"; the leading number is ours.
                return int(value.split("(")[0])
            except ValueError:
                continue
    return default


def is_initialized() -> bool:
    """Whether a default ``torch.distributed`` process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank of this process (0 without distribution)."""
    return dist.get_rank() if is_initialized() else _env_int(_RANK_VARS, 0)


def world_size() -> int:
    """Number of processes in the job (1 without distribution)."""
    return dist.get_world_size() if is_initialized() else _env_int(_WORLD_VARS, 1)


def local_rank() -> int:
    """Rank of this process on its node.

    Without LOCAL_RANK or SLURM_LOCALID, a process group's ranks are taken to share one node
    (as :func:`local_world_size` takes them): the local rank is the global one (a group set up
    by ``mp.spawn`` + ``init_process_group`` made every rank local rank 0 of 2 before).
    """
    return _env_int(_LOCAL_RANK_VARS, rank() if world_size() == 1 or is_initialized() else 0)


def _slurm_tasks_here() -> int | None:
    """This node's task count from SLURM_TASKS_PER_NODE ("4(x2)", "3,2", "2(x3),1"), which Slurm
    always sets (SLURM_NTASKS_PER_NODE only with --ntasks-per-node); None without it."""
    value = os.environ.get("SLURM_TASKS_PER_NODE")
    if not value:
        return None
    counts: list[int] = []
    try:
        for part in value.split(","):
            count, _, times = part.partition("(x")
            counts += [int(count)] * (int(times.rstrip(")")) if times else 1)
        node = int(os.environ.get("SLURM_NODEID", "0") or 0)
    except ValueError:
        return None
    return counts[node] if 0 <= node < len(counts) else None


def local_world_size() -> int:
    """Number of processes of the job on this node."""
    if not is_initialized():
        return _env_int(_LOCAL_WORLD_VARS, 1)
    return _env_int(_LOCAL_WORLD_VARS, _slurm_tasks_here() or world_size())


def barrier() -> None:
    """Wait for every rank; a no-op without a process group."""
    if is_initialized() and world_size() > 1:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Return rank ``src``'s ``obj`` on every rank (picklable objects of trusted peers only)."""
    if not is_initialized() or world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    if not is_initialized() or world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_min(value: int) -> int:
    """The smallest ``value`` over all ranks (used so every rank agrees on a fallback level)."""
    if not is_initialized() or world_size() == 1:
        return int(value)
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def all_reduce_max(value: float) -> float:
    """The largest ``value`` over all ranks (the slowest rank gates a step)."""
    if not is_initialized() or world_size() == 1:
        return float(value)
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_reduce_max_list(values: list[float]) -> list[float]:
    """Element-wise largest ``values`` over all ranks, in one collective (same length on every rank)."""
    if not is_initialized() or world_size() == 1:
        return [float(v) for v in values]
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]
