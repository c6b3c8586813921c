"""Dispatched ops and CPU time per batch of the common augmentation pipelines, before and after.

For each pipeline (crop + flip; crop + flip + normalize; resized crop + flip + colour jitter +
normalize) on a CIFAR-sized batch (256 x 3x32x32 uint8) and, for the resized crop, a 128 px
one (64 x 3x128x128 -> 112), it counts the aten ops one augmentation call dispatches
(``torch.profiler`` on the CPU: ops called from Python, and every aten op including those
they call) and times the call (one torch thread; min and median over ``--repeats``). It does
so for this checkout and for earlier commits of the package (``--baseline LABEL=REV``, each
extracted with ``git archive`` into a temporary folder and run in its own process), side by
side. Commits from before the keyed randomness are called with a ``torch.Generator``.

Op counts are exact; the times come from whatever machine runs this, and on a shared one
they are noisy: the minimum is the figure least disturbed by other work.

    OMP_NUM_THREADS=1 python benchmarks/augment_ops.py            # writes benchmarks/results/augment_ops.json
    python benchmarks/augment_ops.py --quick --no-baselines --json /tmp/ops.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "augment_ops.json"
#: The commits compared by default: before this round (generator API), and the integration
#: branch this work started from.
BASELINES = {"pre-round": "5416fc8", "house": "11e2689"}
MEAN, STD = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]
#: (pipeline, data) -> (batch shape, output size of the crops)
CASES = {
    ("crop+flip", "cifar"): ((256, 3, 32, 32), 32),
    ("crop+flip+normalize", "cifar"): ((256, 3, 32, 32), 32),
    ("resized crop+flip+jitter+normalize", "cifar"): ((256, 3, 32, 32), 32),
    ("resized crop+flip+jitter+normalize", "128px"): ((64, 3, 128, 128), 112),
}


def _pipeline(A: Any, name: str, size: int) -> Any:
    if name == "crop+flip":
        return A.Compose([A.RandomCrop(size, padding=4), A.RandomHorizontalFlip()])
    if name == "crop+flip+normalize":
        return A.Compose([A.RandomCrop(size, padding=4), A.RandomHorizontalFlip(), A.Normalize(MEAN, STD)])
    return A.Compose([A.RandomResizedCrop(size), A.RandomHorizontalFlip(), A.ColorJitter(0.4, 0.4, 0.4),
                      A.Normalize(MEAN, STD)])


#: Ops that only make a new view or wrap memory (no pass over tensor data).
_METADATA = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::slice", "aten::select", "aten::as_strided",
             "aten::detach", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::expand",
             "aten::unsqueeze", "aten::squeeze", "aten::transpose", "aten::permute", "aten::alias", "aten::unbind",
             "aten::t", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::contiguous",
             "aten::numpy_T", "aten::split", "aten::chunk", "aten::unfold", "aten::expand_as", "aten::view_as",
             "aten::_unsafe_view", "aten::flatten", "aten::movedim", "aten::narrow"}


def _touches_data(event: Any) -> bool:
    """Whether an op reads or writes tensor data (``to``/``contiguous`` only when they copy)."""
    if event.name in ("aten::to", "aten::contiguous", "aten::reshape"):
        stack, seen = list(event.cpu_children), False
        while stack:
            e = stack.pop()
            seen |= e.name in ("aten::_to_copy", "aten::copy_", "aten::clone")
            stack.extend(e.cpu_children)
        return seen
    return event.name not in _METADATA


def _count_ops(call: Any) -> dict[str, int]:
    """Aten ops of one call: called from Python (``dispatched``), those of them that pass over
    tensor data (``kernels``: a kernel launch each on an accelerator), and every aten op."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return {"dispatched_ops": len(top), "kernels": sum(_touches_data(e) for e in top), "aten_ops": len(events)}


def _time(call: Any, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


def measure(repeats: int) -> dict[str, Any]:
    """Every case with the ``lightning_fastdata`` importable in this process."""
    import torch

    torch.set_num_threads(1)
    from lightning_fastdata import augment as A

    # Before keyed randomness (no augment.SampleKeys) ops take a torch.Generator.
    SampleKeys = getattr(A, "SampleKeys", None)  # noqa: N806
    out: dict[str, Any] = {"api": "generator" if SampleKeys is None else "keys", "cases": {}, "memcpy_ms": {}}
    g = torch.Generator().manual_seed(0)
    for (pipeline, data), (shape, size) in CASES.items():
        x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        idx = torch.randperm(50_000, generator=g)[:shape[0]]
        aug = _pipeline(A, pipeline, size)
        if SampleKeys is None:
            def call(aug=aug, x=x):
                return aug(x, torch.Generator().manual_seed(1))
        else:
            def call(aug=aug, x=x, idx=idx):
                return aug(x, SampleKeys(0, 1, idx))
        for _ in range(3):
            call()  # warm-up: caches, constants, allocator
        counts = _count_ops(call)
        times = _time(call, repeats)
        result = {**counts, "ms_min": 1e3 * min(times), "ms_median": 1e3 * statistics.median(times),
                  "times_ms": [1e3 * t for t in times]}
        accelerator = _accelerator_path()
        if accelerator is not None:
            with accelerator:
                for _ in range(2):
                    call()
                result["accelerator"] = _count_ops(call)
        out["cases"][f"{pipeline} | {data}"] = result
        out["memcpy_ms"][data] = 1e3 * min(_time(lambda x=x: x.clone(), repeats))
    return out


class _Switch:
    """Set module attributes for the duration of a ``with`` block."""

    def __init__(self, *settings: tuple[Any, str, Any]) -> None:
        self.settings, self.saved = settings, []

    def __enter__(self) -> None:
        self.saved = [(m, k, getattr(m, k)) for m, k, _ in self.settings]
        for m, k, v in self.settings:
            setattr(m, k, v)

    def __exit__(self, *exc: Any) -> None:
        for m, k, v in self.saved:
            setattr(m, k, v)


def _accelerator_path() -> _Switch | None:
    """The code that runs on accelerators (no host shortcuts, draws in torch), run on the CPU to
    count what it launches; None for versions without the switches."""
    import lightning_fastdata

    here = Path(lightning_fastdata.__file__).parent
    if not (here / "augment_base.py").is_file() or not (here / "keys.py").is_file():
        return None  # (an installed copy elsewhere may provide the modules: not this version's)
    from lightning_fastdata import augment_base, keys

    if not hasattr(augment_base, "HOST_SHORTCUTS") or not hasattr(keys, "USE_NUMPY_ON_CPU"):
        return None
    return _Switch((augment_base, "HOST_SHORTCUTS", False), (keys, "USE_NUMPY_ON_CPU", False))


def _tree(rev: str, into: Path) -> Path:
    """The package at git revision ``rev``, extracted under ``into``."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def _run_worker(tree: Path, repeats: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", "--repeats", str(repeats)],
                          env=env, cwd=str(tree), capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One version's rounds as one result: the first round's counts, every round's times."""
    out = dict(runs[0])
    out["cases"] = {}
    for key, first in runs[0]["cases"].items():
        times = [t for r in runs for t in r["cases"][key]["times_ms"]]
        out["cases"][key] = {**first, "ms_min": min(times), "ms_median": statistics.median(times), "times_ms": times}
    out["memcpy_ms"] = {d: min(r["memcpy_ms"][d] for r in runs) for d in runs[0]["memcpy_ms"]}
    return out


def table(versions: list[dict[str, Any]]) -> str:
    """Markdown: per case and version, ops dispatched (data-touching ones), the accelerator path's
    data-touching ops, and the CPU ms (min, median)."""
    labels = [v["label"] for v in versions]
    lines = ["| pipeline | data | " + " | ".join(labels) + " |", "|---|---|" + "---:|" * len(labels)]
    for pipeline, data in CASES:
        key = f"{pipeline} | {data}"
        cells = []
        for v in versions:
            r = v["results"]["cases"].get(key)
            if r is None:
                cells.append("n/a")
                continue
            acc = r.get("accelerator")
            cells.append(f"{r['dispatched_ops']} ops ({r['kernels']} touch data); "
                         + (f"accelerator path {acc['kernels']} kernels; " if acc else "one path on every device; ")
                         + f"{r['ms_min']:.2f} ms min, {r['ms_median']:.2f} median")
        lines.append(f"| {pipeline} | {data} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=None, help="timed calls per case (default 30, --quick 5)")
    p.add_argument("--quick", action="store_true", help="few repeats: a smoke test")
    p.add_argument("--rounds", type=int, default=None,
                   help="versions take turns this many times, repeats split among the turns (default 3, --quick 1)")
    p.add_argument("--baseline", action="append", default=None, metavar="LABEL=REV",
                   help=f"an earlier commit to compare (repeatable; default {BASELINES})")
    p.add_argument("--no-baselines", action="store_true", help="measure this checkout only")
    p.add_argument("--json", default=None, help="where to write the results (default "
                   "benchmarks/results/augment_ops.json; with --quick nowhere unless given, "
                   "so a smoke test leaves the committed results alone; '' for nowhere)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 30)
    if args.worker:
        print(json.dumps(measure(repeats)))
        return 0
    baselines = {} if args.no_baselines else (
        dict(b.split("=", 1) for b in args.baseline) if args.baseline else dict(BASELINES))
    load_before = os.getloadavg()[0]
    rounds = args.rounds or (1 if args.quick else 3)
    trees: dict[str, tuple[str | None, Path]] = {}
    with tempfile.TemporaryDirectory(prefix="augment-ops-") as tmp:
        for label, rev in baselines.items():
            try:
                trees[label] = (rev, _tree(rev, Path(tmp) / label))
            except (subprocess.CalledProcessError, OSError) as e:
                print(f"{label} ({rev}): not measured, {e}", file=sys.stderr)
        trees["this checkout"] = (None, ROOT)
        # Versions take turns, round after round: a busy spell of the machine hits them alike.
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
        for _ in range(rounds):
            for label, (_, tree) in trees.items():
                runs[label].append(_run_worker(tree, max(1, repeats // rounds)))
    versions = [{"label": label, "rev": rev, "results": _merge(runs[label])} for label, (rev, _) in trees.items()]
    import torch

    out = {
        "meta": {"torch": torch.__version__, "torch_threads": 1, "repeats": repeats, "rounds": rounds,
                 "quick": args.quick,
                 "cpus": len(os.sched_getaffinity(0)), "load_before": load_before, "load_after": os.getloadavg()[0],
                 "note": "dispatched_ops: aten ops called from Python in one augmentation call (exact); ms: "
                         "min and median wall time of one call over the repeats, on a machine that may be "
                         "shared and busy (noisy; the minimum is the least disturbed figure)"},
        "cases": {f"{pl} | {d}": {"batch": list(shape), "size": size} for (pl, d), (shape, size) in CASES.items()},
        "versions": versions,
    }
    print(table(versions))
    print("\nmemcpy of the batch (ms): " + ", ".join(
        f"{d} {ms:.3f}" for d, ms in versions[-1]["results"]["memcpy_ms"].items()))
    print(f"load average {load_before:.2f} before, {out['meta']['load_after']:.2f} after; "
          f"{repeats} repeats, 1 torch thread")
    # A --quick run's figures are not results: the committed file is kept unless a path is given.
    path = args.json if args.json is not None else "" if args.quick else str(RESULTS)
    if not path:
        print("no JSON written" + (" (--quick; --json PATH writes one)" if args.quick else ""))
    else:
        sys.path.insert(0, str(ROOT))
        from lightning_fastdata._util import atomic_write_text

        atomic_write_text(path, json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
