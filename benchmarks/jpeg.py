"""JPEG storage and loader-only throughput on photos of varying sizes (issue 15).

Generates ``--images`` JPEG photos (default 5,000) with sides drawn in 300..500 px
(``examples/imagenet_like/photos.py``: a blob on a textured background, 10 classes) and
reports:

- sizes: the sum of the JPEG files, their decoded size (3 x H x W bytes each) and the
  bytes of this package's store (``encode={"image": "jpeg"}``) at ``max_side`` None and
  256 (files within ``max_side`` are stored as they are, the others re-encoded);
- loader-only images/s, every pipeline ending in uint8 224x224 crops (RandomResizedCrop
  224 + horizontal flip, no model):

  * ``plain``: ``torchvision.datasets.ImageFolder`` (PIL decode in ``__getitem__``) with
    torchvision v2 ``RandomResizedCrop(224)`` + ``RandomHorizontalFlip`` + ``PILToTensor``
    per sample, in a ``DataLoader`` at its best ``num_workers`` among 0..cores;
  * ``workers`` and ``device``: :class:`~lightning_fastdata.OptimizedDataModule` with
    ``strategy="workers"`` or ``"device"``, ``max_side`` None and 256; batches decoded
    with :func:`lightning_fastdata.decode.decode_jpegs` (CPU threads, or one nvJPEG call
    on CUDA) and augmented by ``Compose([RandomResizedCrop(224), RandomHorizontalFlip()])``
    as ``OptimizedDataModule.augment_batch`` does;
  * ``dali`` (``--device cuda`` only, when ``nvidia.dali`` imports): a DALI pipeline
    reading the same files (``fn.decoders.image_random_crop`` on the GPU, resize, flip).

- a profile of the ``device`` strategy at ``max_side=256``: the share of time spent
  gathering, decoding and augmenting;
- on the CPU, the ceiling of the kernels: the same batches decoded and their crop boxes
  resized by the pool's threads with nothing else (no flip, no loader, boxes drawn
  beforehand), what any in-process pipeline on these two kernels could reach.

Each throughput is measured over whole epochs after a warm-up batch (``--epochs``), and
the JSON goes to ``benchmarks/results/jpeg.json`` (``--out``). On a shared machine
expect noise: compare figures from one run only.

Usage::

    python benchmarks/jpeg.py                  # the full run on the CPU
    python benchmarks/jpeg.py --device cuda    # the same on a GPU (DALI too, if installed)
    python benchmarks/jpeg.py --quick          # a smoke test of a few seconds; no JSON unless --out
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_fastdata import augment as A
from lightning_fastdata._util import atomic_write_text, cpu_count
from lightning_fastdata.decode import backend, decode_jpegs
from lightning_fastdata.demo import worker_candidates

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "examples" / "imagenet_like"))
from photos import Photos, write_photos  # noqa: E402

OUT_SIZE = 224
CLASSES = 10


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=5000, help="photos to generate (default 5000)")
    p.add_argument("--sides", type=int, nargs=2, default=(300, 500), help="smallest and largest side, px")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs per pipeline")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads of the main process (default: torch's default, the cores)")
    p.add_argument("--device", default="cpu", help="cpu or cuda: where batches are decoded and augmented")
    p.add_argument("--workers", type=int, nargs="*", default=None,
                   help="plain DataLoader num_workers to try (default 0, 1, 2, 4, ... cores)")
    p.add_argument("--data-dir", type=Path, default=None, help="keep the photos and stores here (default: a "
                   "temporary folder, removed at the end)")
    p.add_argument("--quick", action="store_true", help="a few batches of small photos: a smoke test")
    p.add_argument("--out", type=Path, default=None, help="write the results here (default "
                   "benchmarks/results/jpeg.json; "
                   "with --quick nowhere unless given, so a smoke test leaves the committed results alone)")
    args = p.parse_args(argv)
    if args.out is None and not args.quick:
        args.out = HERE / "results" / "jpeg.json"
    if args.quick:
        args.images, args.batch_size, args.epochs = min(args.images, 160), min(args.batch_size, 32), 1
    return args


# --------------------------------------------------------------------------- sizes


def jpeg_sizes(root: Path) -> dict[str, int]:
    """The files' bytes and their decoded bytes (3 x H x W each, from the JPEG headers)."""
    from PIL import Image

    files, decoded, count = 0, 0, 0
    for f in sorted(root.rglob("*.jpg")):
        files += f.stat().st_size
        with Image.open(f) as im:
            w, h = im.size
        decoded += 3 * h * w
        count += 1
    return {"images": count, "jpeg_files": files, "decoded": decoded}


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# --------------------------------------------------------------------------- plain DataLoader


def plain_loader(root: Path, batch_size: int, workers: int) -> DataLoader:
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    transform = v2.Compose([v2.RandomResizedCrop(OUT_SIZE), v2.RandomHorizontalFlip(), v2.PILToTensor()])
    return DataLoader(ImageFolder(str(root), transform=transform), batch_size=batch_size, shuffle=True,
                      num_workers=workers, persistent_workers=workers > 0, drop_last=False)


def images_per_s(batches: Callable[[], Any], epochs: int, count: Callable[[Any], int],
                 sync: Callable[[], None] = lambda: None) -> float:
    """Images/s over ``epochs`` passes of ``batches()`` (the first without its first batch: a
    warm-up that starts the workers and fills caches)."""
    it = iter(batches())
    next(it)
    sync()
    n, t0 = 0, time.perf_counter()
    for b in it:
        n += count(b)
    for _ in range(epochs - 1):
        for b in batches():
            n += count(b)
    sync()
    return n / (time.perf_counter() - t0)


def run_plain(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    per: dict[str, float] = {}
    for w in args.workers:
        loader = plain_loader(root, args.batch_size, w)
        per[str(w)] = round(images_per_s(lambda loader=loader: loader, args.epochs, lambda b: len(b[0])), 1)
        del loader
        print(f"  plain num_workers={w}: {per[str(w)]:.0f} images/s", flush=True)
    best = max(per, key=per.get)  # type: ignore[arg-type]
    return {"images_per_s": per[best], "best_workers": int(best), "per_workers": per}


# --------------------------------------------------------------------------- this package


def augment() -> A.Compose:
    return A.Compose([A.RandomResizedCrop(OUT_SIZE), A.RandomHorizontalFlip()])


def datamodule(root: Path, cache: Path, strategy: str, max_side: int | None, args: argparse.Namespace) -> Photos:
    n = args.images // CLASSES
    # The same photos the plain loader reads: the sides they were written with.
    return Photos(root=str(root), train_per_class=n, val_per_class=1, classes=CLASSES, sides=tuple(args.sides),
                  batch_size=args.batch_size,
                  encode={"image": "jpeg"}, max_side=max_side, strategy=strategy, device=args.device,
                  cache_dir=str(cache), train_augment=augment(), eval_augment=None, seed=0, progress=False)


def fastdata_batches(dm: Photos, device: torch.device) -> Callable[[], Any]:
    def batches() -> Any:
        for batch in dm.train_dataloader():
            batch = dm.transfer_batch_to_device(batch, device, 0)
            yield batch.structure() if batch.prepared else dm.augment_batch(batch, split="train")
    return batches


def run_fastdata(root: Path, work: Path, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for max_side in (None, 256):
        for strategy in ("workers", "device"):
            name = f"{strategy}/{max_side or 'none'}"
            cache = work / f"cache-{max_side or 'none'}"
            dm = datamodule(root, cache, strategy, max_side, args)
            t0 = time.perf_counter()
            dm.setup("fit")
            built = time.perf_counter() - t0
            rate = images_per_s(fastdata_batches(dm, device), args.epochs, lambda b: len(b["label"]), sync)
            out[name] = {"images_per_s": round(rate, 1), "setup_s": round(built, 2),
                         "strategy": getattr(dm.plan, "strategy", strategy),
                         "num_workers": getattr(dm.plan, "num_workers", None)}
            print(f"  {name}: {rate:.0f} images/s (setup {built:.1f} s)", flush=True)
            if strategy == "device" and max_side == 256:
                out["profile_device_256"] = profile(dm, device, sync)
                if device.type == "cpu":
                    out["kernels_256"] = kernels_ceiling(dm, args.epochs)
                    print(f"  decode + resize kernels alone: {out['kernels_256']['images_per_s']:.0f} images/s",
                          flush=True)
            if strategy == "device":
                # The training split's cache folder: its .npy files and manifest, as on disk.
                store = dm.stores["train"]
                out[f"store_bytes/{max_side or 'none'}"] = folder_bytes(store.path) if store.path else store.nbytes
            dm.teardown("fit")
    return out


def profile(dm: Photos, device: torch.device, sync: Callable[[], None]) -> dict[str, float]:
    """One epoch of the device strategy split into gather (the loader), decode and augment."""
    from lightning_fastdata.keys import SampleKeys

    gather = decode = aug = 0.0
    names = None
    op = augment()
    loader = dm.train_dataloader()
    loader.prepare, loader.ahead = None, 0  # raw batches, gathered in this thread
    it = iter(loader)
    t = time.perf_counter()
    for batch in it:
        sync()
        t1 = time.perf_counter()
        gather += t1 - t
        names = batch.names
        leaves = dict(zip(names, batch.leaves, strict=True))
        images = decode_jpegs(leaves["image"].tensors(), device)
        sync()
        t2 = time.perf_counter()
        decode += t2 - t1
        op(A.Batch({"image": images}, keys=SampleKeys(0, batch.epoch, batch.indices)))
        sync()
        t = time.perf_counter()
        aug += t - t2
    total = gather + decode + aug
    return {"gather": round(gather / total, 3), "decode": round(decode / total, 3), "augment": round(aug / total, 3),
            "seconds": round(total, 3)}


def kernels_ceiling(dm: Photos, epochs: int) -> dict[str, Any]:
    """The decode and resize kernels alone, on the CPU, over the device strategy's batches.

    Each of ``torch.get_num_threads()`` threads decodes its share of a batch
    (``torchvision.io.decode_jpeg``) and resizes each image's crop box to 224^2 straight into
    the output batch (``F.interpolate``, antialiased bilinear, as ``RandomResizedCrop`` does
    on the CPU), at the boxes the pipeline draws (drawn beforehand, untimed). No flip, no
    parameter drawing, no loader: an upper bound for any in-process pipeline built on these
    two kernels on this machine.
    """
    import torch.nn.functional as F
    from torchvision.io import ImageReadMode, decode_jpeg

    from lightning_fastdata._pool import map_runs
    from lightning_fastdata.keys import SampleKeys

    loader = dm.train_dataloader()
    loader.prepare, loader.ahead = None, 0
    crop = A.RandomResizedCrop(OUT_SIZE)
    work = []
    for batch in loader:  # untimed: the bytes and the boxes of every batch
        data = dict(zip(batch.names, batch.leaves, strict=True))["image"].tensors()
        images = decode_jpegs(data, "cpu")
        p = crop.draw(images, SampleKeys(0, batch.epoch, batch.indices))
        boxes = torch.stack([p["top"], p["left"], p["height"], p["width"]], 1).tolist()
        work.append(([d.contiguous() for d in data], boxes))
    threads = torch.get_num_threads()

    def one(data: list[torch.Tensor], boxes: list[list[int]]) -> torch.Tensor:
        out = torch.empty(len(data), 3, OUT_SIZE, OUT_SIZE, dtype=torch.uint8)

        def run(rows: range) -> list[None]:
            for i in rows:
                t, left, h, w = boxes[i]
                img = decode_jpeg(data[i], mode=ImageReadMode.RGB)
                out[i] = F.interpolate(img[None, :, t:t + h, left:left + w], size=(OUT_SIZE, OUT_SIZE),
                                       mode="bilinear", align_corners=False, antialias=True)[0]
            return []

        map_runs(run, [d.numel() for d in data], threads)
        return out

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        one(*work[0])  # warm-up: the pool's threads start
        n, t0 = 0, time.perf_counter()
        for _ in range(epochs):
            for data, boxes in work:
                n += len(one(data, boxes))
        rate = n / (time.perf_counter() - t0)
    return {"images_per_s": round(rate, 1), "threads": threads}


# --------------------------------------------------------------------------- DALI (GPU peer, optional)


def run_dali(root: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    """DALI's GPU pipeline on the same files, when ``nvidia.dali`` imports (``nvidia-dali-cuda130``)."""
    try:
        from nvidia.dali import fn, pipeline_def, types
    except ImportError:
        return None

    @pipeline_def(batch_size=args.batch_size, num_threads=max(1, cpu_count()), device_id=0)
    def pipe():  # type: ignore[no-untyped-def]
        jpegs, labels = fn.readers.file(file_root=str(root), random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB)
        images = fn.resize(images, resize_x=OUT_SIZE, resize_y=OUT_SIZE)
        images = fn.flip(images, horizontal=fn.random.coin_flip())
        return images, labels

    p = pipe()
    p.build()
    per_epoch = (p.epoch_size("reader") + args.batch_size - 1) // args.batch_size

    def batches() -> Any:
        for _ in range(per_epoch):
            yield p.run()

    rate = images_per_s(batches, args.epochs, lambda b: len(b[1]), lambda: torch.cuda.synchronize())
    return {"images_per_s": round(rate, 1)}


# --------------------------------------------------------------------------- report


def ratios(results: dict[str, Any]) -> dict[str, float]:
    plain = results["plain"]["images_per_s"]
    return {name: round(v["images_per_s"] / plain, 2) for name, v in results["fastdata"].items()
            if isinstance(v, dict) and "images_per_s" in v}


def table(results: dict[str, Any]) -> str:
    """The markdown table of a result (also rendered into docs/jpeg.md by benchmarks/tables.py)."""
    s = results["sizes"]
    mb = 1e6
    lines = [
        f"{s['images']} JPEG photos, sides {results['meta']['sides'][0]}-{results['meta']['sides'][1]} px, "
        f"on {results['meta']['device']} ({results['meta']['device_name']}, {results['meta']['cpu_count']} CPUs), "
        f"batch {results['meta']['batch_size']}, decoder: {results['meta']['decoder']}",
        "",
        "| bytes | MB | vs JPEG files |",
        "|---|---:|---:|",
        f"| JPEG files | {s['jpeg_files'] / mb:.1f} | 1.00 |",
        f"| decoded (3 x H x W) | {s['decoded'] / mb:.1f} | {s['decoded'] / s['jpeg_files']:.2f} |",
    ]
    for key in ("none", "256"):
        b = results["fastdata"].get(f"store_bytes/{key}")
        if b is not None:
            lines.append(f"| store, max_side={key} | {b / mb:.1f} | {b / s['jpeg_files']:.2f} |")
    lines += ["", "| pipeline (224x224 uint8 out) | images/s | vs plain |", "|---|---:|---:|"]
    p = results["plain"]
    lines.append(f"| plain DataLoader, PIL + torchvision per sample (best num_workers={p['best_workers']}) | "
                 f"{p['images_per_s']:.0f} | 1.00 |")
    r = ratios(results)
    for name, v in results["fastdata"].items():
        if isinstance(v, dict) and "images_per_s" in v and "/" in name:
            strategy, side = name.split("/")
            lines.append(f"| fastdata {strategy}, max_side={side} | {v['images_per_s']:.0f} | {r[name]:.2f} |")
    kern = results["fastdata"].get("kernels_256")
    if kern:
        lines.append(f"| ceiling: the decode + resize kernels alone, max_side=256, {kern['threads']} thread(s) "
                     f"(no flip, no framework) | {kern['images_per_s']:.0f} | {r['kernels_256']:.2f} |")
    if results.get("dali"):
        d = results["dali"]["images_per_s"]
        lines.append(f"| DALI (GPU decode + crop) | {d:.0f} | {d / p['images_per_s']:.2f} |")
    prof = results["fastdata"].get("profile_device_256")
    if prof:
        lines += ["", f"device strategy, max_side=256, time split: gather {prof['gather']:.0%}, "
                      f"decode {prof['decode']:.0%}, augment {prof['augment']:.0%}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch.cuda.is_available() is False")
    if args.workers is None:
        args.workers = worker_candidates(cpu_count())
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # torchvision 0.29's codec notice (plain)
    work = args.data_dir or Path(tempfile.mkdtemp(prefix="fastdata-jpeg-"))
    started = time.time()
    results: dict[str, Any] = {"meta": {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
        else (platform.processor() or platform.machine()),
        "cpu_count": cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
        "decoder": backend(), "quick": args.quick, "torch_threads": torch.get_num_threads(),
        "batch_size": args.batch_size, "epochs": args.epochs,
        "sides": list(args.sides), "loadavg_before": [round(v, 2) for v in os.getloadavg()],
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }}
    try:
        print(f"writing {args.images} photos ...", flush=True)
        photos = write_photos(work / "photos", {"train": args.images // CLASSES, "val": 1}, classes=CLASSES,
                              sides=tuple(args.sides))
        results["sizes"] = jpeg_sizes(photos / "train")
        print("plain DataLoader:", flush=True)
        results["plain"] = run_plain(photos / "train", args)
        print("fastdata:", flush=True)
        results["fastdata"] = run_fastdata(work / "photos", work, args, device)
        results["ratios"] = ratios(results)
        results["dali"] = run_dali(photos / "train", args) if device.type == "cuda" else None
    finally:
        if args.data_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    results["meta"]["loadavg_after"] = [round(v, 2) for v in os.getloadavg()]
    results["meta"]["seconds"] = round(time.time() - started, 1)
    if args.out is not None:
        atomic_write_text(args.out, json.dumps(results, indent=2))
    print(table(results))
    print(f"\nJSON: {args.out}" if args.out is not None else "\nno JSON written (--quick; --out PATH writes one)")
    return results


if __name__ == "__main__":
    main()
