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

Every figure is the minimum over ``--repeats`` runs (the least disturbed one on a shared
machine). Usage::

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


def best_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Minimum wall time of ``fn`` over ``repeats`` runs after one warm-up, in ms."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def fastdata_ops(images: torch.Tensor, labels: torch.Tensor, crop: int, batch: int, repeats: int,
                 bv: Any) -> dict[str, float]:
    """ms of the gather, of each op's draw and apply alone, and of the whole Compose."""
    idx = torch.arange(batch) * 3 % images.shape[0]
    out = {"gather": best_ms(lambda: [torch.index_select(t, 0, idx) for t in (images, labels)], repeats)}
    fields = {"image": images.index_select(0, idx), "label": labels.index_select(0, idx)}
    kinds = {"image": "image", "label": "mask"}
    keys = SampleKeys(0, 0, idx)
    aug = bv.fastdata_augment(crop)
    b = A.Batch(fields, kinds, keys)
    for i, op in enumerate(aug.transforms):
        bb = b.replace(keys=keys.child(i))
        params = op.make_params(bb)
        name = type(op).__name__
        out[f"{name} draw"] = best_ms(lambda op=op, bb=bb: op.make_params(bb), repeats)
        out[f"{name} apply"] = best_ms(lambda op=op, bb=bb, p=params: op.apply_batch(bb, **p), repeats)
        b = op.apply_batch(bb, **params)
    out["ops alone, total"] = sum(v for k, v in out.items() if k != "gather")
    whole = A.Batch(fields, kinds, keys)
    out["Compose (fused)"] = best_ms(lambda: aug(whole), repeats)
    return out


def monai_ops(images: torch.Tensor, labels: torch.Tensor, crop: int, batch: int, repeats: int,
              bv: Any) -> dict[str, float]:
    """ms of MONAI's random transforms on ``batch`` cached samples, one by one, and their collation."""
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

    out = {"random transforms, per sample": best_ms(run, repeats)}
    # RandCropByPosNegLabeld returns a list of num_samples (here 1) dicts per input.
    firsts = [s[0] if isinstance(s, list) else s for s in samples]
    keep = [{k: s[k] for k in ("image", "label")} for s in firsts]
    out["collate"] = best_ms(lambda: list_data_collate(keep), repeats)
    out["total"] = out["random transforms, per sample"] + out["collate"]
    return out


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
    report: dict[str, Any] = {"side": args.side, "crop": args.crop, "batch_size": args.batch_size,
                              "threads": args.threads, "repeats": args.repeats,
                              "fastdata_ms": fastdata_ops(images, labels, args.crop, args.batch_size, args.repeats, bv)}
    if not args.no_monai:
        report["monai_ms"] = monai_ops(images, labels, args.crop, args.batch_size, args.repeats, bv)
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
