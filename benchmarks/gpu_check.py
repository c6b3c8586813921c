"""GPU check (under 5 minutes on one GPU): training speed per loader, streaming bandwidth, the demo.

Three sections, one JSON (``benchmarks/results/gpu_check_<gpu>.json``) and a printed table:

* ``training``: ResNet-18 on a CIFAR-sized store (50,000 x 3x32x32 uint8, RandomCrop(32,
  padding=4) + flip + normalize) and ResNet-50 on a 128 px ImageNet-sized store (10,000 x
  3x128x128 uint8, RandomResizedCrop(112) + flip + normalize), batch 256, through Lightning
  with ``precision="bf16-mixed"`` and channels_last. Four loaders each: a plain
  ``DataLoader`` (per-sample torchvision v2 transforms in its workers, pinned memory,
  normalized on the GPU) at its best ``num_workers`` (measured loader-only among 2, 4, 8 ...
  up to the cores) and at 2 workers (2 cores per GPU: a dense 8-GPU node's share), against
  ``OptimizedDataModule`` with the ``device`` and ``chunked`` strategies. Figures of the
  last epoch from ``FastDataCallback``'s report: steps/s, GPU idle share (CUDA events),
  data-wait share, verdict.
* ``bandwidth``: the chunked source alone (``benchmarks/chunked_bandwidth.py``) for 3 KB and
  150 KB rows: host gather, pinned host-to-device copy, end-to-end GB/s and its ratio to
  the copy.
* ``demo``: ``python -m lightning_fastdata.demo`` on this device (its JSON is embedded).

At the end it prints the issue's targets (GPU idle < 1% of the ResNet-18 step for device
and chunked; chunked >= 0.8 of the pinned copy for both row sizes; the demo's fastdata
data wait < 5%) with the measured figure and whether each is met.

    benchmarks/gpu_check.sh                             # the full check on CUDA
    python benchmarks/gpu_check.py --quick --device cpu # seconds-to-minutes smoke test on a CPU; no JSON
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
#: name -> (model, classes, store rows, sample shape, crop kind, crop size); quick variants are tiny.
CASES = {
    "resnet18-cifar": ("resnet18", 10, 50_000, (3, 32, 32), "crop", 32),
    "resnet50-128px": ("resnet50", 100, 10_000, (3, 128, 128), "resized", 112),
}
QUICK_CASES = {
    "resnet18-cifar": ("resnet18", 10, 384, (3, 32, 32), "crop", 32),
    "resnet50-128px": ("resnet50", 100, 96, (3, 40, 40), "resized", 32),
}
TARGETS = {"gpu_idle_frac": 0.01, "chunked_over_copy": 0.8, "demo_data_wait_frac": 0.05}


def slug(name: str) -> str:
    """``NVIDIA H200`` -> ``h200``: the file name part of a device name."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    return "-".join(words) or "gpu"


# --------------------------------------------------------------------------- training


class _PlainImages(torch.utils.data.Dataset):
    """What a user writes: uint8 arrays, a torchvision v2 transform per sample in the workers."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform: Any) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.transform(torch.from_numpy(self.images[i])), int(self.labels[i])


def _transforms(kind: str, size: int) -> tuple[Any, Any]:
    """(the plain loader's per-sample torchvision v2 transform, the on-device augment)."""
    import torchvision.transforms.v2 as T

    from lightning_fastdata import augment as A

    if kind == "crop":
        return (T.Compose([T.RandomCrop(size, padding=4), T.RandomHorizontalFlip()]),
                A.Compose([A.RandomCrop(size, padding=4), A.RandomHorizontalFlip(), A.Normalize(MEAN, STD)]))
    return (T.Compose([T.RandomResizedCrop(size, antialias=True), T.RandomHorizontalFlip()]),
            A.Compose([A.RandomResizedCrop(size), A.RandomHorizontalFlip(), A.Normalize(MEAN, STD)]))


def _modules(arch: str, classes: int) -> tuple[Any, Any]:
    """The LightningModule and OptimizedDataModule classes (Lightning imported only when training)."""
    import lightning as L
    import torchvision

    from lightning_fastdata import OptimizedDataModule

    class Classifier(L.LightningModule):
        """A torchvision ResNet in channels_last; uint8 batches are normalized on the device."""

        def __init__(self) -> None:
            super().__init__()
            self.net = getattr(torchvision.models, arch)(num_classes=classes).to(memory_format=torch.channels_last)
            self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1) * 255, persistent=False)
            self.register_buffer("std", torch.tensor(STD).view(1, 3, 1, 1) * 255, persistent=False)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if x.dtype == torch.uint8:
                x = (x.float() - self.mean) / self.std
            x = x.contiguous(memory_format=torch.channels_last)
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    class Store(OptimizedDataModule):
        """The same arrays as the plain loader, cached once and placed by the strategy."""

        def __init__(self, images: np.ndarray, labels: np.ndarray, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.images, self.labels = images, labels

        def source(self, split: str) -> Any:
            if split != "train":
                return None
            return torch.utils.data.TensorDataset(torch.from_numpy(self.images), torch.from_numpy(self.labels))

    return Classifier, Store


def _fit(model: Any, device: torch.device, steps: int, loader: Any = None, datamodule: Any = None) -> dict[str, Any]:
    """Two epochs of ``steps`` steps; the second epoch's figures from FastDataCallback."""
    import lightning as L

    from lightning_fastdata import FastDataCallback

    cb = FastDataCallback(print_report=False, log_memory=False)
    cuda = device.type == "cuda"
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, precision="bf16-mixed" if cuda else "32-true",
                        max_epochs=2, limit_train_batches=steps, limit_val_batches=0, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, benchmark=cuda, callbacks=[cb])
    t0 = time.perf_counter()
    trainer.fit(model, train_dataloaders=loader, datamodule=datamodule)
    fit_s = time.perf_counter() - t0
    train = cb.report()["stages"]["train"]
    last = train["epochs"][-1]
    return {"steps_s": 1e3 / last["step_ms_mean"], "step_ms": last["step_ms_mean"],
            "gpu_idle_frac": last.get("gpu_idle_frac"), "data_wait_frac": last["data_wait_frac"],
            "overhead_frac": last["overhead_frac"], "verdict": train["verdict"], "fit_s": fit_s,
            "steps_per_epoch": last["steps"]}


def _plain_loader(ds: _PlainImages, batch: int, workers: int, device: torch.device) -> Any:
    return torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, drop_last=True, num_workers=workers,
                                       pin_memory=device.type == "cuda", persistent_workers=workers > 0)


def _loader_rate(ds: _PlainImages, batch: int, workers: int, device: torch.device, batches: int) -> float:
    """Loader-only samples/s of the plain DataLoader (after two warm-up batches)."""
    loader = _plain_loader(ds, batch, workers, device)
    it = iter(loader)
    for _ in range(2):
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        x, _ = next(it)
        x.to(device, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    rate = batches * batch / (time.perf_counter() - t0)
    del it, loader
    return rate


def worker_candidates(cores: int, quick: bool) -> list[int]:
    """2, 4, 8, ... up to the cores, and the cores (0 and 1 in a quick run)."""
    if quick:
        return [0, 1]
    out, w = [], 2
    while w < cores:
        out.append(w)
        w *= 2
    return sorted({*out, max(2, cores)})


def training(device: torch.device, quick: bool, cache_dir: str) -> dict[str, Any]:
    """Every case with every loader; prints a line per run."""
    cases = QUICK_CASES if quick else CASES
    batch = 16 if quick else 256
    steps = 3 if quick else {"resnet18-cifar": 60, "resnet50-128px": 30}
    cores = len(os.sched_getaffinity(0))
    out: dict[str, Any] = {"batch_size": batch, "cores": cores, "cases": {}}
    for name, (arch, classes, n, shape, kind, size) in cases.items():
        case_steps = steps if isinstance(steps, int) else steps[name]
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
        labels = rng.integers(0, classes, n, dtype=np.int64)
        per_sample, on_device = _transforms(kind, size)
        Classifier, Store = _modules(arch, classes)  # noqa: N806
        ds = _PlainImages(images, labels, per_sample)
        measured = {w: _loader_rate(ds, batch, w, device, 4 if quick else 30)
                    for w in worker_candidates(cores, quick)}
        best = max(measured, key=measured.get)
        share = 1 if quick else 2
        runs: dict[str, Any] = {}
        print(f"{name}: {n} x {shape} uint8, batch {batch}, {case_steps} steps x 2 epochs; plain DataLoader "
              f"loader-only samples/s by workers: " + ", ".join(f"{w}: {r:,.0f}" for w, r in measured.items()))
        arms = [(f"DataLoader, best workers ({best})", best),
                (f"DataLoader, {share} worker{'s' if share > 1 else ''}" + ("" if quick else " (2 cores per GPU)"),
                 share)]
        for label, workers in arms:
            torch.manual_seed(0)
            runs[label] = {"num_workers": workers, **_fit(Classifier(), device, case_steps,
                                                          loader=_plain_loader(ds, batch, workers, device))}
        for strategy in ("device", "chunked"):
            torch.manual_seed(0)
            dm = Store(images, labels, batch_size=batch, strategy=strategy, drop_last=True, train_augment=on_device,
                       cache_dir=cache_dir, device=str(device) if device.type == "cpu" else None, progress=False)
            dm.prepare_data()  # the cache is built outside the timed fit
            runs[f"fastdata {strategy}"] = {"strategy": strategy, **_fit(Classifier(), device, case_steps,
                                                                          datamodule=dm)}
        for label, r in runs.items():
            idle = "n/a" if r["gpu_idle_frac"] is None else f"{r['gpu_idle_frac']:.1%}"
            print(f"  {label:44s} {r['steps_s']:8.1f} steps/s  GPU idle {idle:>6s}  data wait "
                  f"{r['data_wait_frac']:6.1%}  {r['verdict']}")
        out["cases"][name] = {"model": arch, "store_rows": n, "sample_shape": list(shape),
                              "augment": f"{kind} {size}", "steps_per_epoch": case_steps,
                              "workers_measured": {str(w): r for w, r in measured.items()},
                              "best_num_workers": best, "runs": runs}
        del images, ds
    return out


# --------------------------------------------------------------------------- bandwidth and demo


def bandwidth(device: torch.device, quick: bool) -> dict[str, Any]:
    """The chunked source alone, per row size (see chunked_bandwidth.py)."""
    import chunked_bandwidth

    return chunked_bandwidth.run(device, quick, [1, 2, 4], 3 if quick else 5)


def demo(device: torch.device, quick: bool, work: Path) -> dict[str, Any] | None:
    """``python -m lightning_fastdata.demo`` on this machine; its JSON, or None if it failed."""
    out = work / "demo.json"
    cmd = [sys.executable, "-m", "lightning_fastdata.demo", "--data-dir", str(work / "demo_data"),
           "--json-out", str(out)]
    if quick:
        cmd += ["--quick", "--epochs", "2", "--num-workers", "0"]  # the demo times the last of >= 2 epochs
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    if device.type == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    print(proc.stdout[-3000:])
    if proc.returncode:
        print(f"the demo failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(out.read_text())


# --------------------------------------------------------------------------- report


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's GPU targets, each with the measured figure and whether it is met (None: not measured)."""
    rows = []
    cifar = result.get("training", {}).get("cases", {}).get("resnet18-cifar", {}).get("runs", {})
    for strategy in ("device", "chunked"):
        r = cifar.get(f"fastdata {strategy}")
        value = None if r is None else r["gpu_idle_frac"]
        rows.append({"target": f"ResNet-18 GPU idle with {strategy} < {TARGETS['gpu_idle_frac']:.0%}",
                     "value": value, "met": None if value is None else value < TARGETS["gpu_idle_frac"]})
    for r in result.get("bandwidth", {}).get("results", []):
        value = r.get("end_to_end_over_h2d")
        rows.append({"target": f"chunked >= {TARGETS['chunked_over_copy']:.0%} of the pinned copy, {r['rows']}",
                     "value": value, "met": None if value is None else value >= TARGETS["chunked_over_copy"]})
    d = result.get("demo")
    # The last epoch's wait (the first one's includes set-up); older demo results hold all epochs'.
    value = None if not d else d["fastdata"].get("data_wait_frac_last_epoch", d["fastdata"]["data_wait_frac"])
    rows.append({"target": f"demo's fastdata data wait < {TARGETS['demo_data_wait_frac']:.0%}", "value": value,
                 "met": None if value is None or result["device"] == "cpu" else
                 value < TARGETS["demo_data_wait_frac"]})
    return rows


def table(result: dict[str, Any]) -> str:
    """The training figures as a markdown table, then the bandwidth and the targets."""
    lines = ["| model | loader | steps/s | GPU idle | data wait | verdict |", "|---|---|---:|---:|---:|---|"]
    for name, case in result.get("training", {}).get("cases", {}).items():
        for label, r in case["runs"].items():
            idle = "n/a" if r["gpu_idle_frac"] is None else f"{r['gpu_idle_frac']:.1%}"
            lines.append(f"| {name} | {label} | {r['steps_s']:.1f} | {idle} | {r['data_wait_frac']:.1%} | "
                         f"{r['verdict']} |")
    bw = result.get("bandwidth", {}).get("results", [])
    if bw:
        lines += ["", "| rows | gather 1 / 2 / 4 threads GB/s | H2D GB/s | chunked end to end GB/s (best) | "
                      "chunked / copy |", "|---|---:|---:|---:|---:|"]
        for r in bw:
            g = " / ".join(f"{v:.1f}" for v in r["gather_GBps"].values())
            h2d = f"{r['h2d_GBps']:.1f}" if "h2d_GBps" in r else "n/a (no CUDA)"
            ratio = f"{r['end_to_end_over_h2d']:.0%}" if "end_to_end_over_h2d" in r else "n/a"
            lines.append(f"| {r['rows']} | {g} | {h2d} | {max(r['end_to_end_GBps'].values()):.1f} | {ratio} |")
    lines += ["", "| target | measured | met |", "|---|---:|---|"]
    for t in result.get("targets", []):
        v = t["value"]
        shown = "not measured" if v is None else f"{v:.1%}"
        lines.append(f"| {t['target']} | {shown} | {'-' if t['met'] is None else 'yes' if t['met'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--quick", action="store_true", help="tiny stores and models: a smoke test (any device)")
    p.add_argument("--sections", default="training,bandwidth,demo", help="comma-separated: training, bandwidth, demo")
    p.add_argument("--json", default=None, help="where to write the results (default "
                   "benchmarks/results/gpu_check_<gpu>.json; with --quick nowhere unless given, so a "
                   "smoke test leaves the committed results alone; '' for nowhere)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - {"training", "bandwidth", "demo"}
    if unknown:
        p.error(f"unknown section(s) {sorted(unknown)}; choose among training, bandwidth, demo")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({len(os.sched_getaffinity(0))} cores)"
    print(f"device: {device} ({name}), torch {torch.__version__}{', quick' if args.quick else ''}")
    result: dict[str, Any] = {"format": 2, "device": device.type, "name": name, "quick": args.quick,
                              "torch": torch.__version__, "cores": len(os.sched_getaffinity(0)),
                              "load_before": os.getloadavg()[0], "sections": sections}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        if "bandwidth" in sections:
            result["bandwidth"] = bandwidth(device, args.quick)
        if "training" in sections:
            result["training"] = training(device, args.quick, str(Path(tmp) / "cache"))
        if "demo" in sections:
            result["demo"] = demo(device, args.quick, Path(tmp))
    # A section asked for that produced nothing is a failure, not a "not measured" row.
    result["failed"] = [s for s in sections if s == "demo" and result.get("demo") is None]
    result["targets"] = targets(result)
    result["total_s"] = time.perf_counter() - t0
    result["load_after"] = os.getloadavg()[0]
    print(table(result))
    print(f"total {result['total_s']:.0f} s" + ("" if result["total_s"] < 300 or args.quick else
                                               " (over the 5-minute budget)"))
    # A --quick run's figures are not results: the committed file is kept unless a path is given.
    path = args.json if args.json is not None else "" if args.quick else str(
        ROOT / "benchmarks" / "results" / f"gpu_check_{slug(name) if device.type == 'cuda' else 'cpu'}.json")
    if not path:
        print("no JSON written" + (" (--quick; --json PATH writes one)" if args.quick else ""))
    else:
        sys.path.insert(0, str(ROOT))
        from lightning_fastdata._util import atomic_write_text

        atomic_write_text(path, json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")
    if result["failed"]:
        print(f"gpu_check: the section(s) {result['failed']} failed (see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
