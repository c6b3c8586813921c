"""lightning_fastdata: keep accelerators fed in PyTorch Lightning training."""

from lightning_fastdata import augment
from lightning_fastdata.callbacks import FastDataCallback
from lightning_fastdata.datamodule import OptimizedDataModule
from lightning_fastdata.plan import Plan, Resources, decide, probe_resources
from lightning_fastdata.profiler import DataWaitProfiler
from lightning_fastdata.ragged import RaggedArray, RaggedBatch
from lightning_fastdata.store import Store, build_store, open_store

__all__ = [
    "DataWaitProfiler",
    "FastDataCallback",
    "OptimizedDataModule",
    "Plan",
    "RaggedArray",
    "RaggedBatch",
    "Resources",
    "Store",
    "augment",
    "build_store",
    "decide",
    "open_store",
    "probe_resources",
]
__version__ = "0.1.0"
