"""FastDataCallback's cost per training step in CPU instructions: a figure free of wall-clock noise.

Wall-clock side-by-side runs of a 0.7 ms step carry about 1% of noise on a shared
machine, as large as the effect being measured (``callback_overhead.py``). Instruction
counts do not: each arm trains the tiny model of ``callback_overhead.py`` under
valgrind's callgrind, once for ``--short`` and once for ``--long`` steps, and the
difference divided by the extra steps is the instructions one training step executes
(start-up, imports and the first steps cancel out). The overhead of an arm is its
per-step count less that of the run without any callback, as a share of the latter.
Arms: no callback, a no-op ``Callback`` (what Lightning's hook dispatch costs any
callback), ``FastDataCallback()`` and ``FastDataCallback(profile=False)``.

Needs ``valgrind``; each arm takes about 2 minutes, two at a time. Writes JSON to
``benchmarks/results/callback_instructions.json``.

    PYTHONPATH=$PWD python benchmarks/callback_instructions.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ARMS = ("without", "noop_callback", "fastdata", "fastdata_no_profile")


def child(arm: str, steps: int) -> None:
    """Train the tiny Linear model for ``steps`` steps with ``arm``'s callbacks (run under callgrind)."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from callback_overhead import fit

    torch.set_num_threads(1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        fit(steps, arm, root)


def count(arm: str, steps: int, workdir: str) -> int:
    """Instructions callgrind counts for one whole child run."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    cmd = ["valgrind", "--tool=callgrind", "--cache-sim=no", "--branch-sim=no",
           f"--callgrind-out-file={workdir}/cg.{arm}.{steps}", sys.executable, __file__, "--child", arm, str(steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    found = re.findall(r"Collected : (\d+)", proc.stderr)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"callgrind run {arm}/{steps} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return int(found[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", type=int, default=50, help="steps of the short run")
    parser.add_argument("--long", type=int, default=550, help="steps of the long run")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "callback_instructions.json"))
    parser.add_argument("--child", nargs=2, metavar=("ARM", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    if shutil.which("valgrind") is None:
        sys.exit("callback_instructions.py needs valgrind (apt install valgrind)")
    if args.long <= args.short:
        sys.exit(f"--long ({args.long}) must be larger than --short ({args.short})")
    arms = ["without", *[a for a in args.arms if a != "without"]]
    with tempfile.TemporaryDirectory() as workdir, ThreadPoolExecutor(args.jobs) as pool:
        runs = {(a, s): pool.submit(count, a, s, workdir) for a in arms for s in (args.short, args.long)}
        totals = {key: fut.result() for key, fut in runs.items()}
    extra = args.long - args.short
    per_step = {a: (totals[a, args.long] - totals[a, args.short]) / extra for a in arms}
    base = per_step["without"]
    result = {"benchmark": "callback_instructions", "model": "linear", "short_steps": args.short,
              "long_steps": args.long, "instructions_per_step": per_step,
              "overhead_instructions_per_step": {a: per_step[a] - base for a in arms if a != "without"},
              "overhead_frac": {a: (per_step[a] - base) / base for a in arms if a != "without"},
              "totals": {f"{a}/{s}": n for (a, s), n in totals.items()},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version()}}
    print(f"instructions per training step without a callback: {base:,.0f}")
    for a in arms[1:]:
        print(f"  {a:>20}: {per_step[a] - base:+10,.0f} per step ({100 * result['overhead_frac'][a]:+.2f}%)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
