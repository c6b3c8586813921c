"""The augmentation of fixed-shape CUDA batches, captured once in a CUDA graph and replayed.

A pipeline such as crop + flip + normalize launches dozens of small kernels per batch
(the keyed draws alone are integer hashing); replayed from a CUDA graph they cost one
launch. The graph's inputs are static buffers: every image and mask field, the samples'
global indices and the epoch (a 0-d device tensor, folded into the keys on the device,
see :mod:`lightning_fastdata.keys`), so a replay with a new batch, new indices and a new
epoch gives exactly the eager result. ``other`` fields never enter the graph (the ops pass
them through). Each replay's outputs are cloned: a batch handed out never changes when
the graph runs again.

A graph is captured per signature (field shapes, dtypes, strides and kinds, index shape,
seed, stream, op path, device), at most ``max_graphs`` of them. Eager instead: not on
CUDA; a field that is not a tensor (a ragged field's list); a shape seen after the limit
(e.g. the last, partial batch when several splits are captured); an op tree that is not
capturable (an op outside this package, unless its class says ``graph_safe = True``); a
capture that failed (warned once, then that signature runs eagerly).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from lightning_fastdata.augment import Batch, BatchTransform, Compose, RandomApply
from lightning_fastdata.keys import SampleKeys


def capturable(op: Any) -> bool:
    """Whether ``op`` can run inside a CUDA graph: this package's ops (no host sync, no host
    copies, randomness from the keys only), composed by ``Compose``/``RandomApply``; another
    ``BatchTransform`` only when its class sets ``graph_safe = True``."""
    if isinstance(op, (Compose, RandomApply)):
        return all(capturable(t) for t in op.transforms)
    if not isinstance(op, BatchTransform):
        return False
    flag = getattr(op, "graph_safe", None)
    if flag is not None:
        return bool(flag)
    return type(op).__module__.startswith("lightning_fastdata.")


class CudaBackend:
    """Capture and replay with ``torch.cuda`` (the production backend; tests on the CPU
    substitute one that runs the function again instead of replaying)."""

    def accepts(self, device: torch.device) -> bool:
        """Whether batches on ``device`` can be captured."""
        return device.type == "cuda"

    def capture(self, fn: Callable[[], Any], device: torch.device, warmup: int) -> tuple[Any, Any]:
        """Run ``fn`` ``warmup`` times, then capture it; returns ``(graph, fn's captured result)``.

        Warm-up and capture run on a side stream that first waits for the current one
        (where the static inputs were written); the current stream then waits for it. No
        step makes the host wait for the device: the capture is ``thread_local`` (the
        training thread may keep launching work meanwhile) and nothing synchronises.
        """
        with torch.cuda.device(device):
            current = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    fn()  # lazy state (constants, grids, library handles) exists before capture
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out = fn()
                except BaseException:
                    try:
                        graph.capture_end()
                    except Exception:  # noqa: BLE001 - the capture is invalid anyway; report fn's error
                        pass
                    raise
                graph.capture_end()
            current.wait_stream(side)
        return graph, out

    def replay(self, graph: Any) -> None:
        """Launch ``graph`` on the current stream."""
        graph.replay()


class _Graph:
    """One captured signature: static inputs, the graph, and its output tensors."""

    def __init__(self, augment: Callable[[Batch], Batch], batch: Batch, backend: CudaBackend, warmup: int) -> None:
        keys = batch.keys
        self.names = batch.names("image", "mask")
        # Same sizes and strides as the batch: channels_last inputs stay channels_last.
        self.inputs = {n: torch.empty_strided(batch.fields[n].size(), batch.fields[n].stride(),
                                              dtype=batch.fields[n].dtype, device=batch.fields[n].device)
                       for n in self.names}
        self.index = torch.empty_like(keys.index)
        self.epoch = torch.zeros((), dtype=torch.int64, device=keys.index.device)
        self._load(batch)
        kinds = {n: batch.kinds[n] for n in self.names}

        def run() -> dict[str, torch.Tensor]:
            # New keys on every run: they cache per-batch state (the scrambled indices, the
            # folded epoch) that the capture must compute from the static buffers, not reuse.
            static_keys = SampleKeys(keys.seed, self.epoch, self.index, keys.stream, keys.path)
            out = augment(Batch(self.inputs, kinds, static_keys, batch.spatial_dims))
            return {n: out.fields[n] for n in self.names}

        self.backend = backend
        self.graph, self.outputs = backend.capture(run, batch.device, warmup)

    def _load(self, batch: Batch) -> None:
        for n in self.names:
            self.inputs[n].copy_(batch.fields[n])
        self.index.copy_(batch.keys.index)
        epoch = batch.keys.epoch
        if isinstance(epoch, torch.Tensor):
            self.epoch.copy_(epoch.reshape(()))
        else:
            self.epoch.fill_(epoch)  # a kernel argument: no host-to-device copy

    def __call__(self, batch: Batch) -> Batch:
        self._load(batch)
        self.backend.replay(self.graph)
        # The next replay rewrites the outputs: hand out copies.
        return batch.replace({n: self.outputs[n].clone() for n in self.names})


class GraphedAugment:
    """Run ``augment`` on a :class:`~lightning_fastdata.augment.Batch` from CUDA graphs where it can.

    ``graphed(batch)`` returns what ``augment(batch)`` returns, bit for bit: replayed from
    a graph captured for the batch's signature, or eagerly (see the module's docstring for
    when). Safe to call from several threads (calls are serialised).

    Args:
        augment: The batch transform.
        max_graphs: Signatures captured at most; later ones run eagerly.
        warmup: Eager runs before each capture.
        warn: Called once per signature whose capture failed, with the reason.
        backend: Capture/replay implementation (default: CUDA).
    """

    def __init__(self, augment: Callable[[Batch], Batch], max_graphs: int = 4, warmup: int = 2,
                 warn: Callable[[str], Any] | None = None, backend: CudaBackend | None = None) -> None:
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 0:
            raise ValueError(f"max_graphs must be an int >= 0, got {max_graphs!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be an int >= 1 (lazy constants must exist before a capture), got {warmup!r}")
        self.augment, self.max_graphs, self.warmup = augment, max_graphs, warmup
        self.capturable = capturable(augment)
        self.backend = backend or CudaBackend()
        self._warn = warn or (lambda message: warnings.warn(message, stacklevel=3))
        self._graphs: dict[tuple, _Graph] = {}
        self._failed: set[tuple] = set()
        self._lock = threading.Lock()
        #: How many batches were replayed, run eagerly, and how many signatures were captured.
        self.counts = {"replayed": 0, "eager": 0, "captured": 0}

    def signature(self, batch: Batch) -> tuple | None:
        """What a graph is captured for, or None when ``batch`` must run eagerly."""
        if not self.capturable or not self.backend.accepts(batch.device):
            return None
        keys = batch.keys
        fields = []
        for name in batch.names("image", "mask"):
            x = batch.fields[name]
            if not isinstance(x, torch.Tensor):
                return None  # a ragged field's list: its shapes vary
            fields.append((name, batch.kinds[name], tuple(x.shape), x.stride(), x.dtype))
        if keys.index.device != batch.device:
            return None
        return (str(batch.device), batch.spatial_dims, keys.seed, keys.stream, keys.path,
                tuple(keys.index.shape), tuple(fields))

    def __call__(self, batch: Batch) -> Batch:
        key = self.signature(batch)
        with self._lock:
            graph = None if key is None else self._graphs.get(key)
            if graph is None and key is not None and key not in self._failed \
                    and len(self._graphs) < self.max_graphs:
                graph = self._capture(key, batch)
            if graph is None:
                self.counts["eager"] += 1
                return self.augment(batch)
            self.counts["replayed"] += 1
            return graph(batch)

    def _capture(self, key: tuple, batch: Batch) -> _Graph | None:
        try:
            graph = _Graph(self.augment, batch, self.backend, self.warmup)
        except Exception as e:  # noqa: BLE001 - any failure means: run this signature eagerly
            self._failed.add(key)
            self._warn(f"lightning_fastdata: the augmentation of batches shaped {[f[2] for f in key[-1]]} could not "
                       f"be captured in a CUDA graph ({type(e).__name__}: {e}); it runs eagerly. Pass "
                       "cuda_graphs=False to the data module to silence this.")
            return None
        self._graphs[key] = graph
        self.counts["captured"] += 1
        return graph

    def clear(self) -> None:
        """Drop every captured graph (and its memory)."""
        with self._lock:
            self._graphs.clear()
            self._failed.clear()


__all__ = ["CudaBackend", "GraphedAugment", "capturable"]
