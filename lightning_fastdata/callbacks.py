"""``FastDataCallback``: the one callback users add to their ``Trainer``."""

from __future__ import annotations

from lightning_fastdata.profiler import DataWaitProfiler


class FastDataCallback(DataWaitProfiler):
    """Profiles data wait vs compute for every step (see :class:`DataWaitProfiler`)."""
