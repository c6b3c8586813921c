"""Generate a small 3-D segmentation dataset: CT-like volumes with lesions, and their masks, as NIfTI.

    python examples/volumes/make_volumes.py volumes_data --cases 24 --size 64

The layout is the Medical Segmentation Decathlon's::

    volumes_data/
      imagesTr/case_000.nii.gz   int16 Hounsfield units, one channel
      labelsTr/case_000.nii.gz   uint8: 0 background, 1 lesion
      dataset.json               the list of cases; written last, so its presence says "complete"

Each case is a body (an ellipsoid of soft tissue, about 40 HU) in air (-1000 HU), with
a spine-like cylinder of bone (about 700 HU, not labelled) and 1 to 3 lesions
(ellipsoids of 130-200 HU with semi-axes of 9-17% of the field of view, labelled 1),
plus Gaussian noise. Cases are stored the way scanners write them, not the way a
network wants them: each with its own voxel spacing (in-plane 0.7-1.0 mm, slices
2-3 mm) and in LPS orientation (the first two axes flipped against RAS, as DICOM
converters write them), so a loader has to reorient and resample them. ``size`` is
the side of a case in voxels once resampled to 1.5 mm: the field of view is
``size * 1.5`` mm on every axis.

The geometry is drawn per case from ``(seed, case)``, so any case can be drawn again on
any grid (:func:`case_shapes`, :func:`render`): the tests compare the example's loading
against the exact masks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: The spacing, in mm, at which a case is ``size`` voxels per side.
NOMINAL_SPACING = 1.5
AIR_HU, TISSUE_HU, BONE_HU = -1000, 40, 700
NOISE_HU = 20.0
#: Marks a dataset.json written by this generator (a real MSD task has none).
GENERATOR = "lightning_fastdata examples/volumes/make_volumes.py v1"
#: In ``root`` while this generator moves its folders in: they are its own, safe to replace.
PARTIAL = ".make_volumes-partial"


@dataclass(frozen=True)
class Ellipsoid:
    """An axis-aligned ellipsoid in world (RAS) millimetres."""

    center: tuple[float, float, float]
    radii: tuple[float, float, float]
    hu: float

    def inside(self, x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
        """Whether each point (x, y, z) lies inside."""
        (cx, cy, cz), (rx, ry, rz) = self.center, self.radii
        return ((x - cx) / rx) ** 2 + ((y - cy) / ry) ** 2 + ((z - cz) / rz) ** 2 <= 1.0


@dataclass(frozen=True)
class Case:
    """One case's geometry and how it is stored."""

    fov: float                              # mm, the same on every axis; the volume is [0, fov]^3 in RAS
    spacing: tuple[float, float, float]     # stored voxel spacing (x, y, z), mm
    body: Ellipsoid
    spine: tuple[float, float, float]       # (x, y, radius) of a cylinder along z, mm
    lesions: tuple[Ellipsoid, ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        """Stored voxels along (i, j, k)."""
        return tuple(int(round(self.fov / s)) for s in self.spacing)  # type: ignore[return-value]

    @property
    def affine(self) -> np.ndarray:
        """LPS voxel-to-world (RAS mm) map: i runs right-to-left, j anterior-to-posterior, k up."""
        (sx, sy, sz), (nx, ny, _) = self.spacing, self.shape
        return np.array([[-sx, 0, 0, (nx - 0.5) * sx],
                         [0, -sy, 0, (ny - 0.5) * sy],
                         [0, 0, sz, 0.5 * sz],
                         [0, 0, 0, 1]], dtype=np.float64)


def case_shapes(seed: int, case: int, size: int) -> Case:
    """The geometry of case ``case`` of the dataset drawn from ``seed`` (a pure function)."""
    rng = np.random.default_rng([seed, case])
    fov = size * NOMINAL_SPACING
    inplane = float(rng.uniform(0.7, 1.0))
    spacing = (inplane, inplane, float(rng.choice([2.0, 2.5, 3.0])))
    c = fov / 2
    body = Ellipsoid((c, c, c), (0.44 * fov, 0.38 * fov, 0.47 * fov), TISSUE_HU)
    spine = (c, c - 0.22 * fov, 0.07 * fov)  # posterior (low y in RAS)
    lesions = []
    for _ in range(int(rng.integers(1, 4))):
        radii = tuple(float(r) for r in rng.uniform(0.09, 0.17, 3) * fov)
        # Centres well inside the body, off the spine.
        while True:
            u = rng.uniform(-0.5, 0.5, 3)
            center = (c + u[0] * 0.5 * fov, c + 0.05 * fov + u[1] * 0.3 * fov, c + u[2] * 0.5 * fov)
            if np.hypot(center[0] - spine[0], center[1] - spine[1]) > spine[2] + max(radii[:2]):
                break
        lesions.append(Ellipsoid(center, radii, float(rng.uniform(130, 200))))  # type: ignore[arg-type]
    return Case(fov, spacing, body, spine, tuple(lesions))


def render(case: Case, x: np.ndarray, y: np.ndarray, z: np.ndarray,
           noise: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Hounsfield units (int16) and the lesion mask (uint8) of ``case`` at world points (x, y, z), mm."""
    x, y, z = np.broadcast_arrays(x, y, z)
    hu = np.full(x.shape, AIR_HU, dtype=np.float32)
    hu[case.body.inside(x, y, z)] = case.body.hu
    sx, sy, sr = case.spine
    hu[((x - sx) ** 2 + (y - sy) ** 2 <= sr ** 2) & case.body.inside(x, y, z)] = BONE_HU
    label = np.zeros(x.shape, dtype=np.uint8)
    for lesion in case.lesions:
        inside = lesion.inside(x, y, z)
        hu[inside] = lesion.hu
        label[inside] = 1
    if noise is not None:
        hu += noise.normal(0.0, NOISE_HU, hu.shape).astype(np.float32)
    return np.clip(np.rint(hu), -32768, 32767).astype(np.int16), label


def stored_grid(case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """World coordinates (mm) of the stored voxel centres, each broadcastable to ``case.shape``."""
    nx, ny, nz = case.shape
    a = case.affine
    i, j, k = np.arange(nx)[:, None, None], np.arange(ny)[None, :, None], np.arange(nz)[None, None, :]
    return a[0, 0] * i + a[0, 3], a[1, 1] * j + a[1, 3], a[2, 2] * k + a[2, 3]


def is_complete(root: str | os.PathLike) -> bool:
    """Whether ``root`` holds a complete dataset (its dataset.json exists)."""
    return (Path(root) / "dataset.json").is_file()


def make_volumes(root: str | os.PathLike, cases: int = 24, size: int = 64, seed: int = 0,
                 verbose: bool = False) -> Path:
    """Write the dataset into ``root`` (imagesTr/, labelsTr/, dataset.json); return ``root``.

    The files are written into a temporary folder next to ``root`` and moved into place
    with the dataset.json last, so an interrupted run never leaves a set that looks
    complete. A complete set already in ``root`` is kept if it was drawn with the same
    parameters; with other parameters it is an error (it is never overwritten). Nor is an
    ``imagesTr``/``labelsTr`` folder without a dataset.json, unless an interrupted run of
    this generator left it (its ``.make_volumes-partial`` file says so): it may hold the
    user's own scans.

    Args:
        root: The dataset folder.
        cases: Number of cases (>= 2).
        size: Voxels per side once resampled to 1.5 mm (>= 16).
        seed: Seed of the geometry and the noise.
        verbose: Print a line when writing.

    Raises:
        ValueError: for a bad ``cases`` or ``size``, a complete set drawn otherwise, or
            ``imagesTr``/``labelsTr`` folders this generator did not leave.
    """
    import nibabel as nib

    if isinstance(cases, bool) or not isinstance(cases, int) or cases < 2:
        raise ValueError(f"cases must be an int >= 2, got {cases!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 16:
        raise ValueError(f"size must be an int >= 16, got {size!r}")
    root = Path(root)
    params = {"cases": cases, "size": size, "seed": seed}
    if is_complete(root):
        meta = json.loads((root / "dataset.json").read_text())
        drawn = meta.get("parameters")
        if meta.get("generator") == GENERATOR and drawn != params:
            raise ValueError(f"{root} holds a generated set drawn with {drawn}, not {params}; "
                             "pass another folder, or delete this one")
        return root
    partial = root / PARTIAL
    ours = [f for f in ("imagesTr", "labelsTr") if (root / f).exists()]
    if ours and not partial.exists():
        # Without dataset.json these may be the user's own scans (root pointed at their
        # data): replacing them would delete them. Only an interrupted run of ours is swept.
        raise ValueError(f"{root} holds {' and '.join(ours)} but no dataset.json, and they were not left by this "
                         "generator: not writing over them. Add their dataset.json (MSD layout), or give an "
                         "empty or new folder to generate into")
    root.parent.mkdir(parents=True, exist_ok=True)
    if verbose:
        print(f"writing {cases} generated cases ({size}^3 at 1.5 mm) into {root}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        (tmp / "imagesTr").mkdir()
        (tmp / "labelsTr").mkdir()
        training = []
        for n in range(cases):
            case = case_shapes(seed, n, size)
            hu, label = render(case, *stored_grid(case), noise=np.random.default_rng([seed, n, 1]))
            name = f"case_{n:03d}.nii.gz"
            for folder, data in (("imagesTr", hu), ("labelsTr", label)):
                img = nib.Nifti1Image(data, case.affine)
                img.header.set_xyzt_units("mm")
                nib.save(img, tmp / folder / name)
            training.append({"image": f"./imagesTr/{name}", "label": f"./labelsTr/{name}"})
        root.mkdir(exist_ok=True)
        # Marks the folders below as ours until dataset.json is in place, so that a run
        # interrupted between the moves is swept by the next one instead of refused.
        partial.touch()
        for folder in ("imagesTr", "labelsTr"):
            if (root / folder).exists():
                shutil.rmtree(root / folder)  # an interrupted earlier run's files (no dataset.json)
            os.replace(tmp / folder, root / folder)
        meta = {"name": "GeneratedLesions", "description": "Generated CT-like volumes with lesions",
                "modality": {"0": "CT"}, "labels": {"0": "background", "1": "lesion"},
                "numTraining": cases, "numTest": 0, "training": training, "test": [],
                "generator": GENERATOR, "parameters": params}
        (tmp / "dataset.json").write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp / "dataset.json", root / "dataset.json")
        partial.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="dataset folder (imagesTr/, labelsTr/, dataset.json)")
    p.add_argument("--cases", type=int, default=24)
    p.add_argument("--size", type=int, default=64, help="voxels per side at 1.5 mm")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    make_volumes(args.root, args.cases, args.size, args.seed, verbose=True)


if __name__ == "__main__":
    main()
