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
    per sample, in a ``DataLoader`` at its best ``num_workers`` among 0..cores, on the
    photos as written;
  * ``plain_256``: the same loader on the same photos shrunk once to ``max_side=256``
    (each file re-encoded exactly as the ``max_side=256`` store keeps it), so the 256 rows
    compare like for like: a plain loader reading 300-500 px files decodes more pixels
    than a store of 256 px ones;
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

Each throughput is measured over whole epochs after a warm-up batch (``--epochs``). Every
fastdata pipeline also records ``setup_s`` (the run that found no cache paid its build:
``cache_build_s/<side>``), and :func:`compare` turns the figures into per-epoch and
whole-run ratios (plain's ``--epochs`` epochs against fastdata's cache build plus its
epochs; the shrinking of ``plain_256``'s files counts as its build). The JSON goes to
``benchmarks/results/jpeg.json`` (``--out``). On a shared machine
expect noise: compare figures from one run only.

Usage::

    python benchmarks/jpeg.py                  # the full run on the CPU
    python benchmarks/jpeg.py --device cuda    # the same on a GPU (DALI too, if installed)
    python benchmarks/jpeg.py --quick          # a smoke test of a few seconds; no JSON unless --out
"""

from __future__ import annotations

import argparse
import gc
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
#: The stores' JPEG quality (OptimizedDataModule's default), also used to shrink plain_256's files.
QUALITY = 90
#: The store-time cap of the second store, and of plain_256's files.
SMALL_SIDE = 256


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


def shrink_folder(src: Path, dst: Path, max_side: int, quality: int = QUALITY) -> float:
    """Copy the ImageFolder ``src`` to ``dst`` with every JPEG capped at ``max_side``; return the seconds.

    Each file goes through the store's own encoder (:func:`lightning_fastdata.encode.encode_jpeg_leaf`),
    so the plain loader reads the very bytes the ``max_side`` store holds: files within
    ``max_side`` are copied as they are, the others resized (antialiased) and re-encoded.
    The files are shared among one thread per CPU (the codecs and the resize release the
    GIL), as a user would shrink them once before training.
    """
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from lightning_fastdata.encode import encode_jpeg_leaf

    def one(f: Path) -> None:
        data, _ = encode_jpeg_leaf(np.fromfile(f, dtype=np.uint8), quality, max_side, str(f))
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        data.tofile(out)

    files = sorted(src.rglob("*.jpg"))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, cpu_count())) as pool:
        list(pool.map(one, files))
    return time.perf_counter() - t0


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


def run_plain(root: Path, args: argparse.Namespace, name: str = "plain") -> dict[str, Any]:
    per: dict[str, float] = {}
    for w in args.workers:
        loader = plain_loader(root, args.batch_size, w)
        per[str(w)] = round(images_per_s(lambda loader=loader: loader, args.epochs, lambda b: len(b[0])), 1)
        del loader
        print(f"  {name} num_workers={w}: {per[str(w)]:.0f} images/s", flush=True)
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
                  encode={"image": "jpeg"}, jpeg_quality=QUALITY, max_side=max_side, strategy=strategy,
                  device=args.device,
                  cache_dir=str(cache), train_augment=augment(), eval_augment=None, seed=0, progress=False)


def fastdata_batches(dm: Photos, device: torch.device) -> Callable[[], Any]:
    # One loader for every epoch, as Lightning holds one per fit: a `workers` loader starts
    # its persistent workers once, as the plain loader's do (a new loader per epoch would
    # time a worker start-up in each epoch after the first).
    loader = dm.train_dataloader()

    def batches() -> Any:
        for batch in loader:
            batch = dm.transfer_batch_to_device(batch, device, 0)
            yield batch.structure() if batch.prepared else dm.augment_batch(batch, split="train")
    return batches


def run_fastdata(root: Path, work: Path, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for max_side in (None, SMALL_SIDE):
        for strategy in ("workers", "device"):
            name = f"{strategy}/{max_side or 'none'}"
            cache = work / f"cache-{max_side or 'none'}"
            dm = datamodule(root, cache, strategy, max_side, args)
            # The first run at a side finds no cache and builds it; the next one reuses it. (With
            # --data-dir a cache from an earlier invocation is found: then no run here paid the build.)
            builds = not (cache.exists() and any(cache.iterdir()))
            t0 = time.perf_counter()
            dm.setup("fit")
            built = time.perf_counter() - t0
            rate = images_per_s(fastdata_batches(dm, device), args.epochs, lambda b: len(b["label"]), sync)
            out[name] = {"images_per_s": round(rate, 1), "setup_s": round(built, 2), "built_cache": builds,
                         "strategy": getattr(dm.plan, "strategy", strategy),
                         "num_workers": getattr(dm.plan, "num_workers", None)}
            if builds:
                out[f"cache_build_s/{max_side or 'none'}"] = round(built, 2)
            print(f"  {name}: {rate:.0f} images/s (setup {built:.1f} s{', cache built' if builds else ''})",
                  flush=True)
            if strategy == "device" and max_side == SMALL_SIDE:
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
            # Its workers are shut down here, not by a later fork's child collecting the loader
            # (torch then prints "AssertionError: can only test a child process").
            del dm
            gc.collect()
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


def _side(name: str) -> str:
    """The store side of a fastdata figure: ``"none"`` or ``"256"`` (``kernels_256`` -> ``"256"``)."""
    return name.rsplit("/", 1)[1] if "/" in name else name.rsplit("_", 1)[1]


def compare(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each fastdata figure against the plain loader that read the same files, per epoch and per run.

    A ``max_side=256`` figure is compared with ``plain_256`` (the same photos shrunk once to
    256 px) when the result has it; a result from before that side existed compares it with
    ``plain`` on the full-size files, and says so (``like_for_like`` False): that plain
    loader decodes more pixels per image than the store holds.

    The whole run is ``meta.epochs`` epochs of ``sizes.images`` at each side's images/s (the
    warm-up batch left out on both sides) plus its one-time work: fastdata's cache build
    (paid by the first pipeline at that side, ``built_cache``; in results from before that
    was recorded, the first listed) and its own set-up when it found the cache; for
    ``plain_256``, shrinking the files. The plain loader's worker start-up is in neither.

    Returns:
        figure name -> ``images_per_s``, ``baseline`` (``"plain"`` or ``"plain_256"``),
        ``like_for_like``, ``per_epoch`` (the images/s ratio), and, for the loader
        pipelines, ``cache_build_s``, ``built_cache`` (this pipeline paid it), ``plain_run_s``,
        ``fastdata_run_s`` and ``whole_run`` (plain's seconds over fastdata's).
    """
    fast, n, epochs = results["fastdata"], results["sizes"]["images"], results["meta"]["epochs"]
    pipelines = [k for k, v in fast.items() if isinstance(v, dict) and "/" in k and "images_per_s" in v]
    out: dict[str, dict[str, Any]] = {}
    for name, v in fast.items():
        if not (isinstance(v, dict) and "images_per_s" in v):
            continue
        side = _side(name)
        small = side != "none" and bool(results.get("plain_256"))
        base = results["plain_256" if small else "plain"]
        row: dict[str, Any] = {"images_per_s": v["images_per_s"], "baseline": "plain_256" if small else "plain",
                               "like_for_like": side == "none" or small,
                               "per_epoch": round(v["images_per_s"] / base["images_per_s"], 2)}
        if name in pipelines:
            same = [k for k in pipelines if _side(k) == side]
            builder = next((k for k in same if fast[k].get("built_cache")), None)
            if builder is None and not any("built_cache" in fast[k] for k in same):
                builder = same[0]  # an older result: the first pipeline at a side built its cache
            build = fast[builder]["setup_s"] if builder else None
            own = 0.0 if name == builder else v["setup_s"]
            fastdata_s = (build or 0.0) + own + epochs * n / v["images_per_s"]
            plain_s = base.get("shrink_s", 0.0) + epochs * n / base["images_per_s"]
            row.update(cache_build_s=build, built_cache=name == builder, plain_run_s=round(plain_s, 2),
                       fastdata_run_s=round(fastdata_s, 2), whole_run=round(plain_s / fastdata_s, 2))
        out[name] = row
    return out


def ratios(results: dict[str, Any]) -> dict[str, float]:
    """Per-epoch images/s ratios against each figure's baseline (see :func:`compare`)."""
    return {name: c["per_epoch"] for name, c in compare(results).items()}


def table(results: dict[str, Any]) -> str:
    """The markdown table of a result, printed at the end of a run (docs/jpeg.md's is benchmarks/tables.py's)."""
    s = results["sizes"]
    mb = 1e6
    epochs = results["meta"]["epochs"]
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
    small = results.get("plain_256")
    if small:
        lines.append(f"| JPEG files shrunk to {SMALL_SIDE} px (plain_256) | {small['jpeg_files'] / mb:.1f} | "
                     f"{small['jpeg_files'] / s['jpeg_files']:.2f} |")
    for key in ("none", "256"):
        b = results["fastdata"].get(f"store_bytes/{key}")
        if b is not None:
            lines.append(f"| store, max_side={key} | {b / mb:.1f} | {b / s['jpeg_files']:.2f} |")
    lines += ["", f"| pipeline (224x224 uint8 out) | images/s | vs its plain, per epoch | cache build s | "
                  f"whole {epochs}-epoch run vs its plain |", "|---|---:|---:|---:|---:|"]
    p = results["plain"]
    lines.append(f"| plain DataLoader, PIL + torchvision per sample, full-size files (best num_workers="
                 f"{p['best_workers']}) | {p['images_per_s']:.0f} | 1.00 | | |")
    if small:
        lines.append(f"| plain_256: the same on the files shrunk to {SMALL_SIDE} px (best num_workers="
                     f"{small['best_workers']}) | {small['images_per_s']:.0f} | 1.00 | {small['shrink_s']:.2f} "
                     "(shrinking) | |")
    for name, c in compare(results).items():
        label = (f"fastdata {name.replace('/', ', max_side=')}" if "/" in name else
                 f"ceiling: the decode + resize kernels alone, max_side=256, "
                 f"{results['fastdata'][name]['threads']} thread(s) (no flip, no framework)")
        vs = f"{c['per_epoch']:.2f}" + ("" if c["like_for_like"] else " (vs full-size plain: not like for like)")
        build = "" if c.get("cache_build_s") is None else f"{c['cache_build_s']:.2f}"
        whole = "" if "whole_run" not in c else f"{c['whole_run']:.2f}"
        lines.append(f"| {label} | {c['images_per_s']:.0f} | {vs} | {build} | {whole} |")
    if results.get("dali"):
        d = results["dali"]["images_per_s"]
        lines.append(f"| DALI (GPU decode + crop) | {d:.0f} | {d / p['images_per_s']:.2f} | | |")
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
        # The same photos shrunk once to the small store's side, for a like-for-like 256 comparison.
        small = work / f"photos-{SMALL_SIDE}"
        shrink_s = shrink_folder(photos / "train", small, SMALL_SIDE)
        print(f"plain DataLoader on the photos shrunk to {SMALL_SIDE} px (shrinking {shrink_s:.1f} s):", flush=True)
        results["plain_256"] = {**run_plain(small, args, name="plain_256"), "shrink_s": round(shrink_s, 2),
                                "jpeg_files": folder_bytes(small)}
        print("fastdata:", flush=True)
        results["fastdata"] = run_fastdata(work / "photos", work, args, device)
        results["ratios"] = ratios(results)
        results["compare"] = compare(results)
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
