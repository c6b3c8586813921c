"""JPEG storage: encoded once at store time (or stored as read), small, decoded where the batch is used."""

from __future__ import annotations

import os
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as tnf
import torchvision.transforms.v2.functional as TF

from lightning_fastdata import OptimizedDataModule
from lightning_fastdata import augment as A
from lightning_fastdata.encode import capped_size, encode_jpeg_leaf, is_jpeg, jpeg_shape, quiet_codec_warnings
from lightning_fastdata.ragged import RaggedArray, RaggedBatch
from lightning_fastdata.store import StoreError, build_store

N = 24


def photo(i: int, low: int = 300, high: int = 500, channels: int = 3) -> torch.Tensor:
    """A smooth, slightly noisy uint8 (C, H, W) image with sides in [low, high] (photo-like for a JPEG coder)."""
    g = torch.Generator().manual_seed(i)
    h, w = (int(x) for x in torch.randint(low, high + 1, (2,), generator=g))
    img = tnf.interpolate(torch.rand(1, channels, 6, 6, generator=g), size=(h, w), mode="bicubic")[0]
    img = img + 0.02 * torch.randn(channels, h, w, generator=g)
    return (img.clamp(0, 1) * 255).round().to(torch.uint8)


def jpeg(image: torch.Tensor, quality: int = 90) -> torch.Tensor:
    from torchvision.io import encode_jpeg

    with quiet_codec_warnings():
        return encode_jpeg(image, quality=quality)


def decode(data: torch.Tensor) -> torch.Tensor:
    from torchvision.io import decode_jpeg

    with quiet_codec_warnings():
        return decode_jpeg(data)


class Photos(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return photo(i), i


class JpegFiles(torch.utils.data.Dataset):
    """Reads JPEG files as bytes, as ``torchvision.io.read_file`` gives them."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        from torchvision.io import read_file

        with quiet_codec_warnings():  # the user's call: torchvision 0.29 warns at every one
            return read_file(self.paths[i]), i


@pytest.fixture(scope="module")
def jpeg_files(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("jpegs")
    paths = []
    for i in range(N):
        p = root / f"{i:03d}.jpg"
        p.write_bytes(jpeg(photo(i)).numpy().tobytes())
        paths.append(str(p))
    return paths


def _disk_bytes(path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


# --------------------------------------------------------------------------- the codec pieces


def test_the_frame_header_gives_the_decoded_shape_without_decoding():
    for image in (photo(1, 20, 40), photo(2, 20, 40, channels=1)):
        data = jpeg(image).numpy()
        assert is_jpeg(data) and jpeg_shape(data) == tuple(decode(torch.from_numpy(data)).shape) == tuple(image.shape)
    with pytest.raises(ValueError, match="no readable JPEG frame header"):
        jpeg_shape(jpeg(photo(3, 20, 40)).numpy()[:20])
    assert capped_size(300, 500, 256) == (154, 256) and capped_size(500, 300, 256) == (256, 154)
    assert capped_size(100, 80, 256) == (100, 80) and capped_size(100, 80, None) == (100, 80)


def test_bad_samples_for_jpeg_name_the_sample_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"sample 4, field 'x' is float32 with shape \(3, 8, 8\); encode='jpeg' needs"):
        encode_jpeg_leaf(np.zeros((3, 8, 8), np.float32), 90, None, "sample 4, field 'x'")

    class NotJpeg(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 5

        def __getitem__(self, i: int):
            return torch.zeros(16, dtype=torch.uint8) if i == 3 else photo(i, 8, 16), i

    with pytest.raises(StoreError, match=r"sample 3, field '0' is not JPEG bytes: it starts with 00 00 00 00"):
        build_store(NotJpeg(), lambda s: s, tmp_path / "cache", encode={"0": "jpeg"}, progress=False, probes=2)
    assert not list((tmp_path / "cache").rglob("field_*"))


# --------------------------------------------------------------------------- the store


def test_encoded_store_is_close_to_the_jpeg_bytes_and_5x_smaller_than_decoded(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = build_store(Photos(), lambda s: s, tmp_path / "cache", encode={"0": "jpeg"}, jpeg_quality=90,
                            progress=False)
    assert not [w for w in caught if "TorchVision are deprecated" in str(w.message)]  # caught where we call it
    info, field = store.infos[0], store.fields[0]
    assert info.ragged and info.encoding == "jpeg" and info.kind == "image"
    assert isinstance(field, RaggedArray) and field.encoding == "jpeg"
    encoded = int(field.values.nbytes)
    decoded = int(np.prod(field.decoded, axis=1).sum())
    on_disk = _disk_bytes(store.path)
    assert encoded <= on_disk <= 1.10 * encoded, (on_disk, encoded)  # offsets, shapes, labels, manifest
    assert decoded >= 5 * on_disk, (decoded, on_disk)
    for i in (0, 7, N - 1):
        assert tuple(field.decoded[i]) == tuple(photo(i).shape)
        assert tuple(field.decoded[i]) == jpeg_shape(field[i])
        assert torch.equal(torch.from_numpy(field[i].copy()), jpeg(photo(i)))  # the encoder's bytes, as stored


def test_pre_encoded_bytes_are_stored_as_they_are(tmp_path, jpeg_files):
    store = build_store(JpegFiles(jpeg_files), lambda s: s, tmp_path / "cache", encode={"0": "jpeg"},
                        num_workers=2, progress=False)
    field = store.fields[0]
    files = [open(p, "rb").read() for p in jpeg_files]
    for i, raw in enumerate(files):
        assert field[i].tobytes() == raw  # bit-equal
    total = sum(len(raw) for raw in files)
    assert total <= _disk_bytes(store.path) <= 1.10 * total
    assert int(np.prod(field.decoded, axis=1).sum()) >= 5 * _disk_bytes(store.path)


def test_max_side_caps_the_longest_side_and_keeps_the_aspect(tmp_path, jpeg_files):
    store = build_store(JpegFiles(jpeg_files[:6]), lambda s: s, tmp_path / "cache", encode={"0": "jpeg"},
                        max_side=256, progress=False)
    field = store.fields[0]
    for i in range(6):
        c, h, w = (int(x) for x in field.decoded[i])
        h0, w0 = photo(i).shape[1:]
        assert max(h, w) == 256 and (h, w) == capped_size(h0, w0, 256) and c == 3
        assert tuple(decode(torch.from_numpy(field[i].copy())).shape) == (c, h, w)
    # bytes already within max_side are kept as they are
    small = build_store(JpegFiles(jpeg_files[:3]), lambda s: s, tmp_path / "cache", name="big", encode={"0": "jpeg"},
                        max_side=1000, progress=False)
    assert small.fields[0][1].tobytes() == open(jpeg_files[1], "rb").read()


def test_jpeg_settings_are_part_of_the_fingerprint_only_with_encode(tmp_path):
    def build(**kw):
        return build_store(Photos(), lambda s: (s[0][:, :32, :32].contiguous(), s[1]), tmp_path / "cache",
                           progress=False, warn=lambda m: None, **kw).path

    plain = build()
    assert build(jpeg_quality=50) == plain  # not encoding: the quality changes nothing stored
    q90 = build(encode={"0": "jpeg"})
    assert q90 != plain and build(encode={"0": "jpeg"}, jpeg_quality=50) != q90
    assert build(encode={"0": "jpeg"}, max_side=16) != q90
    assert build(ragged=["0"]) not in (plain, q90)


# --------------------------------------------------------------------------- loading


class PhotoModule(OptimizedDataModule):
    def __init__(self, paths: list[str], **kwargs) -> None:
        kwargs.setdefault("progress", False)
        super().__init__(**kwargs)
        self.paths = paths

    def source(self, split: str):
        return JpegFiles(self.paths) if split == "train" else None


@pytest.mark.parametrize("strategy,workers", [("device", 0), ("workers", 2)])
def test_a_jpeg_field_reaches_the_user_decoded_as_a_list(tmp_path, jpeg_files, strategy, workers):
    dm = PhotoModule(jpeg_files, batch_size=5, cache_dir=str(tmp_path / "cache"), encode={"0": "jpeg"},
                     device="cpu", strategy=strategy, num_workers=workers)
    dm.setup("fit")
    try:
        seen = 0
        for batch in dm.train_dataloader():
            leaf = batch.leaves[0]
            assert isinstance(leaf, RaggedBatch) and leaf.encoding == "jpeg"
            assert leaf.decoded_shapes is not None and leaf.decoded_shapes.shape == (len(batch), 3)
            images, labels = dm.on_after_batch_transfer(batch, 0)
            assert isinstance(images, list) and len(images) == len(batch)
            for img, i in zip(images, batch.indices.tolist(), strict=True):
                raw = torch.from_numpy(np.fromfile(jpeg_files[i], dtype=np.uint8))
                assert img.dtype == torch.uint8 and torch.equal(img, decode(raw))
            seen += len(batch)
        assert seen == N
    finally:
        dm.teardown("fit")
    assert os.path.isdir(tmp_path / "cache")


class _RecordedResizedCrop(A.RandomResizedCrop):
    """RandomResizedCrop that keeps the boxes it drew, to rebuild each crop with torchvision."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.boxes: list[dict[str, torch.Tensor]] = []

    def apply_batch(self, batch, **params):
        self.boxes.append({k: v.clone() for k, v in params.items()})
        return super().apply_batch(batch, **params)


def test_resized_crops_from_the_stored_jpegs_equal_torchvision_on_the_same_bytes(tmp_path, jpeg_files):
    """The whole path (stored bytes, batched decode, RandomResizedCrop of the list) against
    torchvision's decode_jpeg + resized_crop of each file's bytes at the same box: within 1
    on uint8 (torch's fixed-point antialiased uint8 kernel rounds differently)."""
    op = _RecordedResizedCrop(64)
    dm = PhotoModule(jpeg_files, batch_size=8, cache_dir=str(tmp_path / "cache"), encode={"0": "jpeg"},
                     device="cpu", strategy="device", train_augment=op)
    dm.setup("fit")
    try:
        checked = 0
        for batch in dm.train_dataloader():
            images, _ = dm.on_after_batch_transfer(batch, 0)
            assert images.shape == (len(batch), 3, 64, 64) and images.dtype == torch.uint8
            box = op.boxes[-1]
            for row, i in enumerate(batch.indices.tolist()):
                raw = torch.from_numpy(np.fromfile(jpeg_files[i], dtype=np.uint8))
                t, lft, h, w = (int(box[k][row]) for k in ("top", "left", "height", "width"))
                ref = TF.resized_crop(decode(raw), t, lft, h, w, [64, 64], antialias=True)
                assert (images[row].int() - ref.int()).abs().max().item() <= 1, (i, t, lft, h, w)
                checked += 1
        assert checked == N
    finally:
        dm.teardown("fit")


class Images(torch.utils.data.Dataset):
    """Sample i is ``items[i]`` and its index."""

    def __init__(self, items: list[torch.Tensor]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i], i


class ImagesModule(OptimizedDataModule):
    def __init__(self, items: list[torch.Tensor], **kwargs) -> None:
        kwargs.setdefault("progress", False)
        super().__init__(**kwargs)
        self.items = items

    def source(self, split: str):
        return Images(self.items) if split == "train" else None


def _pil_jpeg(mode: str, i: int) -> torch.Tensor:
    import io

    from PIL import Image

    bands = {"L": 1, "RGB": 3, "CMYK": 4}[mode]
    arr = photo(i, 30, 50, channels=bands).permute(1, 2, 0).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr[..., 0] if bands == 1 else arr, mode=mode).save(buf, "JPEG", quality=90)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


@pytest.mark.parametrize("strategy,workers", [("device", 0), ("workers", 2)])
def test_encoded_images_keep_their_channels_and_source_bytes_decode_rgb_as_recorded(tmp_path, strategy, workers):
    # Grayscale tensors the store encodes come back grayscale (as unencoded storage gives them);
    # JPEG files' bytes come back RGB whatever their own channels (as ImageFolder's loader), and
    # the recorded decoded shapes say what the decode gives. One field holds one channel count
    # (a mix is refused at the build: tests/test_structure.py), so each kind has its own store.
    gray = [photo(0, 30, 50, channels=1), photo(1, 30, 50, channels=1), photo(5, 30, 50, channels=1)]
    files = [_pil_jpeg("L", 2), _pil_jpeg("CMYK", 3), _pil_jpeg("RGB", 4)]
    for name, items, channels in (("gray", gray, 1), ("files", files, 3)):
        dm = ImagesModule(items, batch_size=3, cache_dir=str(tmp_path / name), encode={"0": "jpeg"}, device="cpu",
                          strategy=strategy, num_workers=workers, shuffle=False)
        dm.setup("fit")
        try:
            batch = next(iter(dm.train_dataloader()))
            assert batch.leaves[0].decoded_shapes[:, 0].tolist() == [channels] * 3
            images, _ = dm.on_after_batch_transfer(batch, 0)
            for img, i in zip(images, batch.indices.tolist(), strict=True):
                assert img.shape[0] == channels, f"{name} sample {i}"
                if items is gray:  # within JPEG's loss of the grayscale original
                    assert (img.int() - items[i].int()).abs().float().mean() < 3
        finally:
            dm.teardown("fit")


def test_jpeg_bytes_cut_short_are_refused_naming_the_sample(tmp_path, jpeg_files):
    good = [torch.from_numpy(np.fromfile(p, dtype=np.uint8)) for p in jpeg_files[:6]]
    padded = torch.cat([good[1], torch.zeros(500, dtype=torch.uint8)])  # data after the end marker: legal
    items = [good[0], padded, good[2], good[3][: good[3].numel() * 2 // 3], good[4]]
    with pytest.raises(StoreError, match=r"sample 3, field '0' is JPEG bytes \(\d+ bytes\) that do not decode "
                                         r"\(.*\): the file is truncated or corrupt"):
        build_store(Images(items), lambda s: s, tmp_path / "cache", encode={"0": "jpeg"}, progress=False)
    assert not list((tmp_path / "cache").glob("train-*"))
    store = build_store(Images(items[:3]), lambda s: s, tmp_path / "cache", encode={"0": "jpeg"}, progress=False)
    assert len(store) == 3  # trailing bytes after the end-of-image marker are kept, as read


def test_jpeg_bytes_corrupt_in_the_middle_are_refused_naming_the_sample_when_resized(tmp_path, jpeg_files):
    """Bytes with their end-of-image marker but a broken middle pass the completeness check; where
    ``max_side`` makes the store decode them to resize, torchvision's raw RuntimeError ("decode_jpeg,
    .../decode_jpeg.cpp:171, Unsupported marker type") stopped the build naming nothing."""
    good = [torch.from_numpy(np.fromfile(p, dtype=np.uint8)) for p in jpeg_files[:3]]
    broken = good[1].clone()
    mid = broken.numel() // 2
    broken[mid:mid + 40] = 0xFF
    broken[mid + 40] = 0x0E  # fill bytes, then a marker no JPEG has
    items = [good[0], broken, good[2]]
    with pytest.raises(StoreError, match=r"sample 1, field '0' is JPEG bytes \(\d+ bytes\) that do not decode "
                                         r"\(.*marker.*\): the file is truncated or corrupt"):
        build_store(Images(items), lambda s: s, tmp_path / "cache", encode={"0": "jpeg"}, max_side=8,
                    progress=False)
    assert not list((tmp_path / "cache").glob("train-*"))


def test_an_image_wider_than_jpeg_holds_is_refused_naming_the_sample(tmp_path):
    """torchvision's encoder crashed the process (SIGSEGV, no message) on a side over 65,500
    pixels, leaving the build's temporary directory behind."""
    items = [photo(i, 8, 12) for i in range(6)]
    items[4] = torch.full((3, 2, 70000), 100, dtype=torch.uint8)  # a panorama
    with pytest.raises(StoreError, match=r"sample 4, field '0' is 2x70000 pixels; JPEG holds at most 65500 per "
                                         r"side: set max_side \(<= 65500\) to shrink it at store time, or do not "
                                         r"encode this field"):
        build_store(Images(items), lambda s: s, tmp_path / "cache", encode={"0": "jpeg"}, progress=False)
    assert not list((tmp_path / "cache").rglob("*/*"))
    store = build_store(Images(items), lambda s: s, tmp_path / "cache", encode={"0": "jpeg"}, max_side=1024,
                        progress=False)
    assert tuple(store.fields[0].decoded[4]) == (3, 1, 1024)
    with pytest.raises(ValueError, match=r"max_side must be None or an int in \[1, 65500\] .* got 70000"):
        OptimizedDataModule(encode={"image": "jpeg"}, max_side=70000)


def test_an_empty_image_is_refused_naming_the_sample_also_with_max_side(tmp_path):
    items = [photo(i, 8, 12) for i in range(6)]
    items[3] = torch.zeros((3, 0, 500), dtype=torch.uint8)
    for max_side in (None, 256):  # with max_side, the resize failed first with a bare reshape error
        with pytest.raises(StoreError, match=r"sample 3, field '0' is an empty image \(3, 0, 500\); JPEG needs"):
            build_store(Images(items), lambda s: s, tmp_path / "cache", encode={"0": "jpeg"}, max_side=max_side,
                        progress=False)


def test_a_mask_field_is_never_encoded():
    # JPEG is lossy: a stored mask came back with labels it never had (257 of 5,120 pixels changed).
    with pytest.raises(ValueError, match=r"encode=\{'image': 'jpeg', 'mask': 'jpeg'\} names the mask field 'mask' "
                                         r"\(field_kinds\): JPEG is lossy .* ragged=\['mask'\]"):
        OptimizedDataModule(encode={"image": "jpeg", "mask": "jpeg"}, field_kinds={"image": "image", "mask": "mask"})


class Detection(torch.utils.data.Dataset):
    """An image and its boxes in pixels (sample 2 larger than the rest)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        image = photo(i, 20, 30) if i != 2 else photo(i, 60, 80)
        return {"image": image, "boxes": torch.tensor([[2.0, 2.0, 10.0, 12.0]] * (i + 1)), "label": i}


def test_max_side_warns_that_other_array_fields_are_not_scaled(tmp_path):
    # The store shrinks the image only: boxes in pixels silently stopped matching it.
    said: list[str] = []
    kw = dict(encode={"image": "jpeg"}, ragged=["boxes"], progress=False, warn=said.append)
    build_store(Detection(), lambda s: s, tmp_path / "a", **kw)  # no max_side: nothing shrinks
    assert said == []
    build_store(Detection(), lambda s: s, tmp_path / "b", max_side=40, **kw)
    assert len(said) == 1 and said[0].startswith(
        "lightning_fastdata: max_side=40 shrinks the encoded field(s) ['image'] of larger samples, but the field(s) "
        "['boxes'] are stored as they are: if they hold pixel coordinates")
    build_store(Detection(), lambda s: s, tmp_path / "b", max_side=40, **kw)  # reused: said once, at the build
    assert len(said) == 1


def test_a_jpeg_that_fails_mid_training_names_its_dataset_index(tmp_path, jpeg_files):
    dm = PhotoModule(jpeg_files, batch_size=4, cache_dir=str(tmp_path / "cache"), encode={"0": "jpeg"},
                     device="cpu", shuffle=False)
    dm.setup("fit")
    try:
        batches = iter(dm.train_dataloader())
        next(batches), next(batches)
        batch = next(batches)  # samples 8..11
        leaf = batch.leaves[0]
        leaf.values[int(leaf.offsets[1]):int(leaf.offsets[1]) + 200] = 0  # sample 9's bytes, in this batch only
        with pytest.raises(ValueError, match=r"sample 1 of the batch \(dataset index 9\) is not a decodable JPEG"):
            dm.on_after_batch_transfer(batch, 0)
    finally:
        dm.teardown("fit")


class Segmentation(torch.utils.data.Dataset):
    """An image and its mask of the same size (sample 2 larger than the rest)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        image = photo(i, 20, 30) if i != 2 else photo(i, 60, 80)
        return {"image": image, "mask": (image[:1] > 128).to(torch.uint8)}


class SegmentationModule(OptimizedDataModule):
    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("progress", False)
        super().__init__(**kwargs)

    def source(self, split: str):
        return Segmentation() if split == "train" else None


def test_max_side_refuses_to_shrink_an_image_away_from_its_mask(tmp_path):
    # max_side resizes the encoded field only: the mask kept at the image's old size would no
    # longer line up with it (silently, without an augmentation), so that is an error naming both.
    kw = dict(batch_size=4, cache_dir=str(tmp_path / "cache"), ragged=["mask"], encode={"image": "jpeg"},
              field_kinds={"image": "image", "mask": "mask"}, device="cpu", shuffle=False)
    dm = SegmentationModule(max_side=40, **kw)
    with pytest.raises(StoreError, match=r"sample 2: max_side=40 shrinks the encoded field 'image' from \d+x\d+ "
                                         r"to \d+x\d+, but field 'mask' \(1, \d+, \d+\) has its size .* max_side=None"):
        dm.setup("fit")
    assert not list((tmp_path / "cache").rglob("field_*"))
    for max_side in (None, 80):  # nothing shrinks: stored and loaded aligned
        dm = SegmentationModule(max_side=max_side, **kw)
        dm.setup("fit")
        try:
            out = dm.augment_batch(next(iter(dm.train_dataloader())))
            assert [im.shape[1:] for im in out["image"]] == [m.shape[1:] for m in out["mask"]]
        finally:
            dm.teardown("fit")


def test_bytes_of_another_format_are_named_by_their_signature_with_the_fix():
    """Before: every 1-D uint8 value that is not a JPEG (a PNG named .jpg, a GIF, a text file) got
    "is uint8 with shape (1019,); encode='jpeg' needs a uint8 (C, H, W) image", naming no format."""
    import io

    from PIL import Image

    def saved(fmt: str, mode: str = "RGB") -> np.ndarray:
        buf = io.BytesIO()
        Image.new(mode, (30, 20), 128).save(buf, fmt)
        return np.frombuffer(buf.getvalue(), dtype=np.uint8)

    cases = [(saved("PNG", "RGBA"), r"89 50 4E 47 0D 0A 1A 0A \(a PNG file\)"),
             (saved("PNG", "I;16"), r"\(a PNG file\)"), (saved("GIF", "P"), r"47 49 46 38 .*\(a GIF file\)"),
             (saved("BMP"), r"42 4D .*\(a BMP file\)"), (saved("WEBP"), r"52 49 46 46 .*\(a WebP file\)"),
             (saved("TIFF"), r"\(a TIFF file\)"),
             (np.frombuffer(b"hello, this is not an image\n" * 3, np.uint8), r"\(text: 'hello, this is n'\)"),
             (np.arange(7, 27, dtype=np.uint8), r"07 08 09 0A 0B 0C 0D 0E \(no image format this library knows\)")]
    for value, what in cases:
        with pytest.raises(ValueError, match=rf"^sample 4, field 'x' is not JPEG bytes: it starts with .*{what}; "
                                             r"encode='jpeg' keeps JPEG files .* decode other files in "
                                             r"static_transform \(e.g\. .*pil_to_tensor"):
            encode_jpeg_leaf(value, 90, None, "sample 4, field 'x'")
    with pytest.raises(ValueError, match=r"sample 4, field 'x' is empty \(0 bytes: an empty file\?\); replace it"):
        encode_jpeg_leaf(np.zeros(0, np.uint8), 90, 16, "sample 4, field 'x'")


def _image_folder(root, files: dict[str, bytes], loader=None):
    """A torchvision ImageFolder of one class over ``files`` (sorted by name: that is the index order)."""
    from torchvision.datasets import ImageFolder

    (root / "cls").mkdir(parents=True)
    for name, data in files.items():
        (root / "cls" / name).write_bytes(data)
    return ImageFolder(str(root), loader=loader or (lambda p: torch.from_numpy(np.fromfile(p, dtype=np.uint8))),
                       is_valid_file=lambda p: True)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_bad_file_in_an_image_folder_is_named_by_its_path(tmp_path, jpeg_files, workers):
    """Before: "sample 1, field '0' is uint8 with shape (1019,)" or "sample 1, field '0' is JPEG bytes
    (934 bytes) that do not decode", naming no file, though ImageFolder.samples lists each one's path."""
    import io

    from PIL import Image

    good = [open(p, "rb").read() for p in jpeg_files[:4]]
    png = io.BytesIO()
    Image.new("RGB", (30, 20), 7).save(png, "PNG")
    bad = {"png": png.getvalue(), "truncated": good[1][: len(good[1]) * 2 // 3], "empty": b""}
    want = {"png": r"is not JPEG bytes: it starts with 89 50 4E 47 0D 0A 1A 0A \(a PNG file\)",
            "truncated": r"is JPEG bytes \(\d+ bytes\) that do not decode \(.*\): the file is truncated or corrupt",
            "empty": r"is empty \(0 bytes: an empty file\?\)"}
    for kind, data in bad.items():
        root = tmp_path / kind
        # Index 1 is not among the 2 probes (the first and the last): the parallel fill meets it.
        source = _image_folder(root, {"a.jpg": good[0], "b.jpg": data, "c.jpg": good[2], "d.jpg": good[3]})
        path = str(root / "cls" / "b.jpg")
        for max_side in (None, 16):
            with pytest.raises(StoreError, match=rf"^sample 1 \({re.escape(path)}\), field '0' {want[kind]}"):
                build_store(source, lambda s: s, tmp_path / "cache", encode={"0": "jpeg"}, max_side=max_side,
                            progress=False, probes=2, num_workers=workers)
            assert not list((tmp_path / "cache").rglob("field_*"))
    # A bad file among the probes (read before the fill: every file of a small folder) too.
    with pytest.raises(StoreError, match=rf"^sample 1 \({re.escape(path)}\), field '0' is empty"):
        build_store(source, lambda s: s, tmp_path / "cache", encode={"0": "jpeg"}, progress=False, probes=8,
                    num_workers=workers)
    # Through random_split's Subset, the inner dataset's file is named.
    subset = torch.utils.data.Subset(source, [2, 0, 1, 3])
    with pytest.raises(StoreError, match=rf"^sample 2 \({re.escape(path)}\), field '0' is empty"):
        build_store(subset, lambda s: s, tmp_path / "cache", encode={"0": "jpeg"}, progress=False, probes=2)
