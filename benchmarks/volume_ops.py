"""Where a batch of ``benchmarks/volumes.py`` spends its time: per op, against MONAI's per-sample chain.

One batch of ``--batch-size`` 1 x S^3 int16 volumes with uint8 masks (the data of
``benchmarks/volumes.py``), on the CPU (or ``--device``), one torch thread by default:

- ``gather``: the ``device`` strategy's ``index_select`` of the batch's whole volumes from
  the store's tensors (``--volumes`` held);
- each op of ``volumes.fastdata_augment`` run alone, in sequence: its draw (``make_params``)
  and its apply, and the ``Compose`` of them all (which fuses crop + flip and the intensity
  ops: the figure the loader pays);
- MONAI's random transforms of the same recipe (``RandCropByPosNegLabeld`` with cached
  foreground/background indices, ``RandFlipd`` x 3, ``RandScaleIntensityd``) on as many
  cached samples, one by one, and the collation of their outputs into a batch.

Every figure is the minimum over ``--repeats`` rounds (the least disturbed one on a shared
machine), the parts taking turns within each round. Usage::

    python benchmarks/volume_ops.py                       # 4 x 128^3, 96^3 crops
    python benchmarks/volume_ops.py --side 64 --crop 48   # the quick run's geometry
    python benchmarks/volume_ops.py --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_fastdata import augment as A
from lightning_fastdata.keys import SampleKeys


def _volumes_module() -> Any:
    spec = importlib.util.spec_from_file_location("_bench_volumes", Path(__file__).with_name("volumes.py"))
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def best_ms(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Minimum wall time of each function over ``repeats`` rounds after one warm-up, in ms.

    The functions take turns within each round, so a load that comes and goes on a shared
    machine disturbs them alike.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: min(t) * 1e3 for name, t in times.items()}


def fastdata_ops(images: torch.Tensor, labels: torch.Tensor, crop: int, batch: int,
                 bv: Any) -> dict[str, Callable[[], Any]]:
    """The gather, each op's draw and apply alone (on the previous op's output), and the whole Compose."""
    idx = torch.arange(batch) * 3 % images.shape[0]
    fns: dict[str, Callable[[], Any]] = {
        "gather": lambda: [torch.index_select(t, 0, idx) for t in (images, labels)]}
    fields = {"image": images.index_select(0, idx), "label": labels.index_select(0, idx)}
    kinds = {"image": "image", "label": "mask"}
    keys = SampleKeys(0, 0, idx)
    aug = bv.fastdata_augment(crop)
    b = A.Batch(fields, kinds, keys)
    for i, op in enumerate(aug.transforms):
        bb = b.replace(keys=keys.child(i))
        params = op.make_params(bb)
        name = type(op).__name__
        fns[f"{name} draw"] = lambda op=op, bb=bb: op.make_params(bb)
        fns[f"{name} apply"] = lambda op=op, bb=bb, p=params: op.apply_batch(bb, **p)
        b = op.apply_batch(bb, **params)
    whole = A.Batch(fields, kinds, keys)
    fns["Compose (fused)"] = lambda: aug(whole)
    return fns


def monai_ops(images: torch.Tensor, labels: torch.Tensor, crop: int, batch: int,
              bv: Any) -> dict[str, Callable[[], Any]]:
    """MONAI's random transforms on ``batch`` cached samples, one by one, and their collation."""
    from monai.data import CacheDataset, list_data_collate, set_track_meta
    from monai.transforms import Compose

    set_track_meta(False)
    cached, rand = bv._monai_transforms(crop, None)
    data = [{"image": images[i].numpy(), "label": labels[i].numpy()} for i in range(batch)]
    ds = CacheDataset(data, transform=Compose(cached), cache_rate=1.0, num_workers=None, progress=False,
                      copy_cache=False)
    items = [ds[i] for i in range(batch)]
    chain = Compose(rand)
    samples: list[Any] = []

    def run() -> None:
        samples[:] = [chain(item) for item in items]

    run()
    # RandCropByPosNegLabeld returns a list of num_samples (here 1) dicts per input.
    firsts = [s[0] if isinstance(s, list) else s for s in samples]
    keep = [{k: s[k] for k in ("image", "label")} for s in firsts]
    return {"random transforms, per sample": run, "collate": lambda: list_data_collate(keep)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--volumes", type=int, default=16, help="volumes held (the store)")
    p.add_argument("--side", type=int, default=128)
    p.add_argument("--crop", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--no-monai", action="store_true", help="skip MONAI's side")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    bv = _volumes_module()
    im, lb = bv.make_volumes(args.volumes, args.side)
    images, labels = torch.from_numpy(im), torch.from_numpy(lb)
    ours = fastdata_ops(images, labels, args.crop, args.batch_size, bv)
    theirs = {} if args.no_monai else monai_ops(images, labels, args.crop, args.batch_size, bv)
    ms = best_ms({**ours, **{f"monai {k}": f for k, f in theirs.items()}}, args.repeats)
    report: dict[str, Any] = {"side": args.side, "crop": args.crop, "batch_size": args.batch_size,
                              "threads": args.threads, "repeats": args.repeats,
                              "fastdata_ms": {k: ms[k] for k in ours}}
    report["fastdata_ms"]["ops alone, total"] = sum(
        v for k, v in report["fastdata_ms"].items() if k not in ("gather", "Compose (fused)"))
    if theirs:
        report["monai_ms"] = {k: ms[f"monai {k}"] for k in theirs}
        report["monai_ms"]["total"] = sum(report["monai_ms"].values())
    print(f"batch of {args.batch_size} x 1x{args.side}^3 int16 + uint8 masks, {args.crop}^3 crops, "
          f"{args.threads} torch thread(s), min of {args.repeats} (ms)")
    for side in ("fastdata_ms", "monai_ms"):
        for name, ms in report.get(side, {}).items():
            print(f"  {side[:-3]:9s} {name:34s} {ms:8.2f}")
    if "monai_ms" in report:
        ours = report["fastdata_ms"]["gather"] + report["fastdata_ms"]["Compose (fused)"]
        report["ratio_monai_over_fastdata"] = report["monai_ms"]["total"] / ours
        print(f"  gather + Compose {ours:.2f} ms vs MONAI {report['monai_ms']['total']:.2f} ms: "
              f"{report['ratio_monai_over_fastdata']:.2f}x MONAI's speed")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    sys.exit(main() and 0)
