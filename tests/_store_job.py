"""A builder process for the store tests: ``python _store_job.py N CACHE_DIR [NAMESPACE]``.

Prints the fingerprint and how many times the static transform ran (N + 16 when this
process built the cache, 8 when it reused one). The transform sleeps
``$LFD_TEST_DELAY`` seconds per sample; the delay is read at run time, so it does not
enter the fingerprint and the test process computes the same one.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

CALLS = [0]


def slow(sample):
    CALLS[0] += 1
    time.sleep(float(os.environ.get("LFD_TEST_DELAY", "0")))
    return sample


if __name__ == "__main__":
    import torch
    from _helpers import CountingDataset
    from _store_job import CALLS as calls
    from _store_job import slow as transform  # the module's function, as the test process sees it

    from lightning_fastdata.store import build_store

    torch.set_num_threads(1)
    n, cache = int(sys.argv[1]), sys.argv[2]
    namespace = sys.argv[3] if len(sys.argv) > 3 else ""
    store = build_store(CountingDataset(n), transform, cache, progress=False, num_workers=0, namespace=namespace)
    print(store.fingerprint, calls[0], flush=True)
