"""decode_jpegs: the pixels torchvision's decoder gives, in order, on any number of threads;
grayscale and CMYK come out RGB; a corrupt sample is named; the deprecation warning of
torchvision >= 0.29 is silenced around our calls only."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_fastdata.decode import TORCHVISION_DEPRECATION, backend, decode_jpegs


def _jpeg(mode: str = "RGB", size=(40, 30), seed: int = 0, quality: int = 90) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    bands = {"RGB": 3, "L": 1, "CMYK": 4}[mode]
    arr = rng.integers(0, 256, (size[1], size[0], bands), dtype=np.uint8)
    img = Image.fromarray(arr[..., 0] if bands == 1 else arr, mode=mode)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _pil_rgb(data: torch.Tensor) -> torch.Tensor:
    img = Image.open(io.BytesIO(data.numpy().tobytes())).convert("RGB")
    return torch.from_numpy(np.array(img)).permute(2, 0, 1)


@pytest.mark.parametrize("threads", [1, 2, 3, None])
def test_decodes_in_order_the_pixels_pil_decodes(threads):
    data = [_jpeg(size=(20 + 7 * i, 41 - 3 * i), seed=i) for i in range(7)]
    out = decode_jpegs(data, "cpu", threads=threads)
    assert len(out) == 7
    for d, img in zip(data, out, strict=True):
        assert img.dtype == torch.uint8 and img.shape[0] == 3
        assert torch.equal(img, _pil_rgb(d))  # both libjpeg-turbo, same IDCT: bit-equal


def test_grayscale_and_cmyk_come_out_rgb():
    data = [_jpeg("L"), _jpeg("CMYK", seed=1), _jpeg("RGB", seed=2)]
    out = decode_jpegs(data, "cpu")
    assert [tuple(o.shape) for o in out] == [(3, 30, 40)] * 3
    assert torch.equal(out[0][0], out[0][1]) and torch.equal(out[0][1], out[0][2])
    assert torch.equal(out[1], _pil_rgb(data[1]))


@pytest.mark.parametrize("threads", [1, 2])
def test_samples_asked_for_one_channel_come_out_grayscale_the_others_rgb(threads):
    data = [_jpeg("L"), _jpeg("RGB", seed=1), _jpeg("L", seed=2), _jpeg("CMYK", seed=3)]
    out = decode_jpegs(data, "cpu", threads=threads, channels=[1, 3, 1, 3])
    assert [tuple(o.shape) for o in out] == [(1, 30, 40), (3, 30, 40), (1, 30, 40), (3, 30, 40)]
    for d, img in zip(data, out, strict=True):
        pil = Image.open(io.BytesIO(d.numpy().tobytes()))
        rgb = np.array(pil.convert("RGB")).transpose(2, 0, 1)
        want = np.array(pil.convert("L"))[None] if img.shape[0] == 1 else rgb
        if pil.mode == "L":  # the decoder's own grayscale: libjpeg-turbo, as PIL: bit-equal
            assert np.array_equal(img.numpy(), want)
    with pytest.raises(ValueError, match=r"channels has 2 entries for 4 samples"):
        decode_jpegs(data, "cpu", channels=[1, 3])


@pytest.mark.parametrize("threads", [1, 2])
def test_a_corrupt_sample_is_named(threads):
    good = _jpeg()
    data = [good, good, good[: good.numel() // 3], good]
    with pytest.raises(ValueError, match=r"sample 2 of the batch .*not a decodable JPEG"):
        decode_jpegs(data, "cpu", threads=threads)
    with pytest.raises(ValueError, match=r"sample 1 of the batch \(dataset index 71\).*starting 00000000"):
        decode_jpegs([good, torch.zeros(64, dtype=torch.uint8)], "cpu", threads=threads, indices=[70, 71])


def test_bad_inputs_are_refused_with_the_fix():
    with pytest.raises(TypeError, match="list of 1-D uint8 tensors"):
        decode_jpegs(_jpeg(), "cpu")
    with pytest.raises(TypeError, match="sample 1 is a torch.int64 tensor"):
        decode_jpegs([_jpeg(), torch.zeros(5, dtype=torch.int64)], "cpu")
    with pytest.raises(ValueError, match="threads"):
        decode_jpegs([_jpeg()], "cpu", threads=0)
    assert decode_jpegs([], "cpu") == []


def test_the_deprecation_warning_is_silenced_for_our_calls_only():
    from torchvision.io import decode_jpeg

    assert backend() in ("torchvision", "torchcodec")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning from our call would raise here
        decode_jpegs([_jpeg(), _jpeg(seed=1)], "cpu", threads=2)
        decode_jpegs([_jpeg()], "cpu", threads=1)
    if backend() == "torchvision":
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            decode_jpeg(_jpeg())  # outside our call, torchvision's warning still shows
        assert any(TORCHVISION_DEPRECATION in str(w.message) for w in seen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (nvJPEG)")
def test_cuda_decodes_the_batch_in_one_call_to_the_cpu_pixels():
    data = [_jpeg(size=(64 + 8 * i, 48), seed=i) for i in range(5)]
    out = decode_jpegs(data, "cuda")
    cpu = decode_jpegs(data, "cpu")
    for a, b in zip(out, cpu, strict=True):
        assert a.device.type == "cuda" and a.shape == b.shape
        assert (a.cpu().int() - b.int()).abs().max() <= 3  # nvJPEG's IDCT differs from libjpeg-turbo's


def test_the_frame_header_names_cmyk_jpegs_for_the_cpu_decoder():
    """nvJPEG (torchvision's CUDA path) does not decode 4-component JPEGs; the header scan that
    sends them to libjpeg-turbo instead reads the component count past EXIF, ICC and
    progressive headers, and gives None (the decoder then says why) for what is not a JPEG."""
    from lightning_fastdata.decode import _components

    exif = Image.Exif()
    exif[0x0112] = 6
    for mode, want in (("L", 1), ("RGB", 3), ("CMYK", 4)):
        arr = np.zeros((30, 40, want), dtype=np.uint8)
        for kwargs in ({}, {"progressive": True}, {"exif": exif.tobytes()}, {"icc_profile": b"x" * 70000}):
            buf = io.BytesIO()
            Image.fromarray(arr[..., 0] if want == 1 else arr, mode=mode).save(buf, "JPEG", **kwargs)
            assert _components(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)) == want
    assert _components(torch.zeros(64, dtype=torch.uint8)) is None
    assert _components(_jpeg()[:20]) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (nvJPEG)")
def test_cuda_decodes_a_batch_with_a_cmyk_jpeg_in_order():
    data = [_jpeg(seed=0), _jpeg("CMYK", seed=1), _jpeg("L", seed=2), _jpeg(seed=3)]
    out = decode_jpegs(data, "cuda", indices=[10, 11, 12, 13])
    cpu = decode_jpegs(data, "cpu")
    for a, b in zip(out, cpu, strict=True):
        assert a.device.type == "cuda" and a.shape == b.shape
        assert (a.cpu().int() - b.int()).abs().max() <= 3
    assert torch.equal(out[1].cpu(), _pil_rgb(data[1]))  # libjpeg-turbo decoded it: bit-equal to PIL


def _exif_jpeg(orientation: int | None, progressive: bool = False, mode: str = "RGB") -> torch.Tensor:
    """A 64x40 (W x H) photo-like JPEG, written by PIL with an EXIF orientation tag (None: no EXIF)."""
    rng = np.random.default_rng(orientation or 0)
    arr = np.asarray(Image.fromarray(rng.integers(0, 256, (5, 8, 3), dtype=np.uint8)).resize((64, 40)))
    img = Image.fromarray(arr).convert(mode)
    kwargs: dict = {"quality": 90, "progressive": progressive}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kwargs["exif"] = exif.tobytes()
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kwargs)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def test_exif_is_cut_from_a_jpeg_keeping_its_pixels_and_jpegs_without_exif_pass_as_they_are():
    from lightning_fastdata.decode import _without_exif

    for orientation in range(1, 9):
        for progressive, mode in ((False, "RGB"), (True, "RGB"), (False, "L")):
            data = _exif_jpeg(orientation, progressive, mode)
            assert Image.open(io.BytesIO(data.numpy().tobytes())).getexif().get(0x0112) == orientation
            out = _without_exif(data)
            assert out.numel() < data.numel()
            assert Image.open(io.BytesIO(out.numpy().tobytes())).getexif().get(0x0112) is None
            assert torch.equal(decode_jpegs([out], "cpu")[0], decode_jpegs([data], "cpu")[0])
    plain = _exif_jpeg(None)
    not_jpeg = torch.zeros(64, dtype=torch.uint8)
    assert _without_exif(plain) is plain and _without_exif(not_jpeg) is not_jpeg
    short = data[:3]
    assert _without_exif(short) is short  # too short to walk: kept, for the decoder to refuse


def test_the_torchcodec_backend_gives_the_unrotated_pixels_of_exif_oriented_jpegs(monkeypatch):
    """TorchCodec (decode.py's backend when torchvision has no JPEG decoder) always applies the
    EXIF orientation: orientations 2-8 came out flipped or transposed ((3, 64, 40) for a store
    that recorded (3, 40, 64)). Simulated with a stand-in that rotates as TorchCodec does."""
    import sys
    import types

    from PIL import ImageOps

    import lightning_fastdata.decode as D

    def decode_jpeg(source, mode="RGB", device="cpu"):
        def one(t: torch.Tensor) -> torch.Tensor:
            img = ImageOps.exif_transpose(Image.open(io.BytesIO(t.numpy().tobytes())))  # as TorchCodec: always
            arr = np.array(img.convert("L" if mode == "GRAY" else "RGB"))
            return torch.from_numpy(arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1).copy())

        return [one(t) for t in source] if isinstance(source, list) else one(source)

    decoders = types.ModuleType("torchcodec.decoders")
    decoders.decode_jpeg = decode_jpeg
    package = types.ModuleType("torchcodec")
    package.decoders = decoders
    monkeypatch.setitem(sys.modules, "torchcodec", package)
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", decoders)
    monkeypatch.setattr(D, "_torchvision_decoder", lambda: None)  # an installed torchvision without decoder
    monkeypatch.setattr(D, "_DECODER", [])
    assert backend() == "torchcodec"
    data = [_exif_jpeg(k, progressive=k == 6) for k in range(1, 9)] + [_exif_jpeg(6, mode="L"), _exif_jpeg(None)]
    assert tuple(decode_jpeg(data[5]).shape) == (3, 64, 40)  # the stand-in rotates orientation 6, as TorchCodec
    for threads in (1, 2):
        out = decode_jpegs(data, "cpu", threads=threads, channels=[3] * 8 + [1, 3])
        for k, (d, img) in enumerate(zip(data, out, strict=True)):
            pil = Image.open(io.BytesIO(d.numpy().tobytes()))  # ImageFolder's loader: not rotated
            want = np.array(pil.convert("L"))[None] if k == 8 else np.array(pil.convert("RGB")).transpose(2, 0, 1)
            assert img.shape == want.shape and np.array_equal(img.numpy(), want), f"sample {k}"
