"""A 3-D segmentation data module: NIfTI volumes and masks in a Medical Segmentation Decathlon layout.

The static transform (once per case, cached) loads a case with nibabel, reorients it to
RAS, resamples it to a fixed spacing (trilinear for the image, nearest for the mask),
pads or crops it to a fixed size and clips Hounsfield units to a range. The store keeps
compact dtypes: the image as int16 (1, D, H, W), the mask as uint8 (1, D, H, W), with
D the superior-inferior axis (slices), H anterior-posterior, W left-right. Everything
random (label-centred crops, flips, intensity changes) and the conversion to float
(``ScaleIntensityRange``) run batched on the training device, from ``train_augment``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from lightning_fastdata import OptimizedDataModule


def load_case(image_path: str | os.PathLike, label_path: str | os.PathLike,
              spacing: Sequence[float] = (1.5, 1.5, 1.5), size: Sequence[int] = (64, 64, 64),
              hu_range: Sequence[int] = (-1000, 1000)) -> dict[str, torch.Tensor]:
    """Load one case: reorient to RAS, resample to ``spacing``, pad/crop to ``size``, clip to ``hu_range``.

    Args:
        image_path: The image's NIfTI file (one channel, Hounsfield units).
        label_path: The mask's NIfTI file (integer labels, 0 background), on the image's grid.
        spacing: Target voxel spacing in mm along (x, y, z) = (left-right, posterior-anterior,
            inferior-superior).
        size: Output voxels along (D, H, W) = (z, y, x); the resampled volume is centred,
            padded with air (the low end of ``hu_range``) and background, or cropped.
        hu_range: (low, high) Hounsfield units the image is clipped to.

    Returns:
        ``{"image": int16 (1, D, H, W), "label": uint8 (1, D, H, W)}``.

    Raises:
        ValueError: when a file is not a one-channel 3-D volume, or the image and the mask do
            not share a grid; the message names the file.
    """
    import nibabel as nib

    img = nib.as_closest_canonical(nib.load(str(image_path)))
    lab = nib.as_closest_canonical(nib.load(str(label_path)))
    for path, vol in ((image_path, img), (label_path, lab)):
        if len(vol.shape) < 3 or any(s != 1 for s in vol.shape[3:]):
            raise ValueError(f"{path} has shape {vol.shape}; this loader reads one-channel 3-D volumes "
                             "(split multi-channel images, e.g. MRI sequences, into one file per channel)")
    if img.shape[:3] != lab.shape[:3] or not _same_affine(img.affine, lab.affine):
        raise ValueError(f"{label_path} (shape {lab.shape}) is not on the grid of {image_path} "
                         f"(shape {img.shape}); a mask must share its image's shape and affine")
    zooms = img.header.get_zooms()[:3]
    out = [max(1, round(n * z / s)) for n, z, s in zip(img.shape[:3], zooms, spacing, strict=True)]
    # (x, y, z) arrays -> (1, 1, x, y, z) for interpolate; nibabel's scaled data as float32.
    image = torch.from_numpy(img.get_fdata(dtype="float32").reshape(img.shape[:3]).copy())[None, None]
    label = torch.from_numpy(lab.get_fdata(dtype="float32").reshape(lab.shape[:3]).copy())[None, None]
    image = F.interpolate(image, size=out, mode="trilinear", align_corners=False)
    # nearest-exact samples at voxel centres, as trilinear with align_corners=False does:
    # the mask stays aligned with the image.
    label = F.interpolate(label, size=out, mode="nearest-exact")
    lo, hi = hu_range
    image = image[0].round_().clamp_(lo, hi).permute(0, 3, 2, 1)  # (1, z, y, x)
    label = label[0].permute(0, 3, 2, 1)
    image = _fit(image, size, float(lo)).to(torch.int16)
    label = _fit(label, size, 0.0).to(torch.uint8)
    return {"image": image.contiguous(), "label": label.contiguous()}


def _same_affine(a: Any, b: Any, atol: float = 1e-3) -> bool:
    return bool(abs(a - b).max() <= atol)


def _fit(x: torch.Tensor, size: Sequence[int], fill: float) -> torch.Tensor:
    """Centre-pad with ``fill`` or centre-crop the spatial dims of (C, D, H, W) to ``size``."""
    pads: list[int] = []
    for n, want in zip(reversed(x.shape[1:]), reversed(list(size)), strict=True):
        before = (want - n) // 2
        pads += [before, want - n - before]  # negative pads crop
    return F.pad(x, pads, value=fill)


class Cases(Dataset):
    """(image path, label path) of each case; loading is the static transform's job."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> tuple[str, str]:
        return self.pairs[i]


class Volumes(OptimizedDataModule):
    """CT-like volumes and masks from an MSD-style folder, generated on first use.

    ``root`` holds ``dataset.json`` and the ``imagesTr``/``labelsTr`` folders (a Medical
    Segmentation Decathlon task, e.g. Task09_Spleen, works too). Without a dataset.json
    and with ``generate``, a synthetic set is written there first (see
    ``make_volumes.py``). The last ``val_cases`` cases are the validation split.

    Pass ``field_kinds={"image": "image", "label": "mask"}`` so the geometric
    augmentations move the mask with the image and the photometric ones leave it alone.

    Args:
        root: The dataset folder.
        generate: Write the synthetic set into ``root`` when it has no dataset.json.
        cases: Cases to generate.
        val_cases: Cases held out for validation (the last ones), >= 1.
        size: Voxels per side after resampling (D = H = W), and of the generated cases at 1.5 mm.
        spacing: Target spacing (x, y, z) in mm.
        hu_range: Hounsfield units kept (clipped to), (low, high).
        data_seed: Seed of the generated set.
        batch_size: Training batch size.
        **kwargs: Any other :class:`~lightning_fastdata.OptimizedDataModule` argument
            (``field_kinds``, ``train_augment``, ``eval_augment``, ``cache_dir``, ``strategy``, ...).
    """

    def __init__(
        self,
        root: str = "volumes_data",
        generate: bool = True,
        cases: int = 24,
        val_cases: int = 4,
        size: int = 64,
        spacing: tuple[float, float, float] = (1.5, 1.5, 1.5),
        hu_range: tuple[int, int] = (-1000, 1000),
        data_seed: int = 0,
        batch_size: int = 2,
        **kwargs: Any,
    ) -> None:
        super().__init__(batch_size=batch_size, **kwargs)
        if isinstance(val_cases, bool) or not isinstance(val_cases, int) or val_cases < 1:
            raise ValueError(f"val_cases must be an int >= 1, got {val_cases!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 8:
            raise ValueError(f"size must be an int >= 8, got {size!r}")
        if len(spacing) != 3 or any(s <= 0 for s in spacing):
            raise ValueError(f"spacing must be three positive mm values (x, y, z), got {spacing!r}")
        if len(hu_range) != 2 or not -32768 <= hu_range[0] < hu_range[1] <= 32767:
            raise ValueError(f"hu_range must be (low, high) in the int16 range with low < high, got {hu_range!r}")
        if generate and (isinstance(cases, bool) or not isinstance(cases, int) or cases <= val_cases):
            raise ValueError(f"cases must be an int > val_cases ({val_cases}), got {cases!r}")
        self.root, self.generate, self.cases, self.val_cases = root, generate, cases, val_cases
        self.size, self.spacing, self.hu_range, self.data_seed = size, tuple(spacing), tuple(hu_range), data_seed

    def dataset_path(self) -> Path:
        """``root``, with the synthetic set written first when it has no dataset.json and ``generate``.

        With ``generate``, a set this example generated earlier must have been drawn with
        this module's ``cases``, ``size`` and ``data_seed``, else ``ValueError`` says which
        differ: otherwise ``--data.cases 48`` on a folder of 24 generated cases would train
        on the 24 without a word. A folder that the generator did not write (an MSD task)
        is used as it is.
        """
        root = Path(self.root)
        meta = root / "dataset.json"
        if not self.generate:
            if not meta.is_file():
                raise FileNotFoundError(f"{meta} does not exist; point root at an MSD-style "
                                        "folder, or pass generate=True to write a synthetic set there")
            return root
        from make_volumes import GENERATOR, make_volumes

        if meta.is_file() and json.loads(meta.read_text()).get("generator") != GENERATOR:
            return root  # an MSD task: used as it is
        # Also for a complete generated set: make_volumes checks it was drawn with these parameters.
        return make_volumes(root, self.cases, self.size, self.data_seed, verbose=True)

    def _pairs(self, split: str) -> list[tuple[str, str]]:
        root = self.dataset_path()
        listed = json.loads((root / "dataset.json").read_text())["training"]
        pairs = sorted((str(root / c["image"]), str(root / c["label"])) for c in listed)
        if len(pairs) <= self.val_cases:
            raise ValueError(f"{root} has {len(pairs)} cases; val_cases={self.val_cases} leaves none to train on")
        return pairs[:-self.val_cases] if split == "train" else pairs[-self.val_cases:]

    def source(self, split: str) -> Cases | None:
        """The cases of "train" or "val" (the last ``val_cases``); no test or predict split."""
        if split not in ("train", "val"):
            return None
        return Cases(self._pairs(split))

    def source_files(self, split: str) -> list[str] | None:
        """Every file the split is read from, so the cache's fingerprint sees them change."""
        if split not in ("train", "val"):
            return None
        return [f for pair in self._pairs(split) for f in pair]

    def static_transform(self, sample: tuple[str, str]) -> dict[str, torch.Tensor]:
        """(image path, label path) -> ``{"image": int16 (1, D, H, W), "label": uint8 (1, D, H, W)}``."""
        image, label = sample
        return load_case(image, label, self.spacing, (self.size,) * 3, self.hu_range)
