"""keep_freed_memory: freed batch buffers are reused, not page-faulted in afresh (glibc only).

The setting is process-wide and cannot be undone, so everything that checks its effect
runs in a child process; the test process itself is left as it was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_fastdata import host_memory
from tests._helpers import TinyDataModule

ROOT = Path(__file__).resolve().parents[1]
GLIBC = host_memory._glibc() is not None
needs_glibc = pytest.mark.skipif(not GLIBC, reason="mallopt's thresholds are glibc's")


def _huge_pages_always() -> bool:
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def _child(code: str, tmp_path: Path) -> dict:
    """Run ``code`` in a fresh interpreter (one torch thread); it prints one JSON line last."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_glibc
@pytest.mark.skipif(_huge_pages_always(), reason="transparent huge pages 'always': a fresh mapping faults in 2 MiB "
                    "pages, too few to count")
def test_a_freed_batch_buffer_is_reused_instead_of_page_faulted_in_again(tmp_path):
    # 48 MiB is above the 32 MiB up to which glibc raises its own threshold: by default every
    # such buffer is a fresh mapping, 12,288 pages faulted in as the batch is written.
    out = _child("""
        import json, resource, torch
        from lightning_fastdata.host_memory import keep_freed_memory, freed_memory_kept

        def faults_per_batch():
            for _ in range(3):
                torch.ones(48 << 20, dtype=torch.uint8)  # warm up
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(10):
                torch.ones(48 << 20, dtype=torch.uint8)
            return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10

        default = faults_per_batch()
        was = freed_memory_kept()
        ok = keep_freed_memory()
        print(json.dumps({"default": default, "kept": faults_per_batch(), "ok": ok, "was": was,
                          "now": freed_memory_kept(), "again": keep_freed_memory()}))
    """, tmp_path)
    assert out["was"] is False and out["ok"] is True and out["now"] is True and out["again"] is True
    assert out["default"] > 10_000, out  # a page fault per 4 KiB of every batch
    assert out["kept"] < 100, out  # the same memory, reused


def test_thresholds_out_of_range_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"mmap_threshold .* got 5"):
        host_memory.keep_freed_memory(mmap_threshold=5)
    with pytest.raises(ValueError, match=r"trim_threshold .* got 4294967296"):
        host_memory.keep_freed_memory(trim_threshold=1 << 32)
    with pytest.raises(ValueError, match=r"trim_threshold .* got True"):
        host_memory.keep_freed_memory(trim_threshold=True)


def test_keep_freed_memory_argument_is_checked_at_construction(cache_dir):
    with pytest.raises(ValueError, match=r"keep_freed_memory must be 'auto', True or False, got 'yes'"):
        TinyDataModule(cache_dir=str(cache_dir), keep_freed_memory="yes")


def test_not_glibc_changes_nothing(monkeypatch):
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    monkeypatch.setattr(host_memory, "_STATE", {})
    assert host_memory.keep_freed_memory() is False
    assert host_memory.freed_memory_kept() is False
    assert "glibc's defaults" in host_memory.describe()


@needs_glibc
def test_the_plan_keeps_freed_memory_only_where_this_process_builds_the_batches(tmp_path):
    # In order, since the setting cannot be undone: False, then workers (auto), then the
    # device strategy on the CPU (auto), then a second module after it.
    out = _child(f"""
        import json, logging
        logging.disable(logging.INFO)
        from tests._helpers import TinyDataModule
        from lightning_fastdata.host_memory import freed_memory_kept

        def plan(**kw):
            dm = TinyDataModule(n=16, cache_dir={str(tmp_path / "cache")!r}, device="cpu", **kw)
            dm.setup("fit")
            why = dm.plan.reasons["host_memory"]
            dm.teardown("fit")
            return [why, freed_memory_kept()]

        # make_plan (as `fastdata plan` shows it) says what setup will do, and does nothing.
        ahead = TinyDataModule(n=16, cache_dir={str(tmp_path / "cache")!r}, device="cpu", strategy="device")
        ahead.prepare_data()
        ahead.open_splits(["train"])
        said = [ahead.make_plan().reasons["host_memory"], freed_memory_kept()]
        out = {{"said": said,
                "off": plan(strategy="device", keep_freed_memory=False),
                "workers": plan(strategy="workers", num_workers=1),
                "auto": plan(strategy="device"),
                "after": plan(strategy="device", keep_freed_memory=False)}}
        print(json.dumps(out))
    """, tmp_path)
    assert out["said"][1] is False and out["said"][0].startswith("kept for reuse from setup on: this process builds")
    assert out["off"][1] is False and "left alone by configuration" in out["off"][0]
    assert out["workers"][1] is False and "DataLoader workers" in out["workers"][0]
    assert out["auto"][1] is True
    assert out["auto"][0].startswith("freed memory kept for reuse") and "builds every batch" in out["auto"][0]
    # Process-wide: a later module says the setting is in force, whatever it asked for.
    assert out["after"][1] is True and out["after"][0].startswith("freed memory kept for reuse")
