"""Store-time JPEG encoding: an image (or JPEG bytes) -> JPEG bytes within ``max_side``, and its decoded shape.

A field named in ``encode={"image": "jpeg"}`` is encoded once, when the store is built:
a uint8 ``(C, H, W)`` image (C = 1 or 3) from the static transform becomes JPEG bytes at
``jpeg_quality``, its longest side first capped at ``max_side`` by an antialiased resize
that keeps the aspect ratio. A sample that already is JPEG bytes (a uint8 1-D tensor
starting with the SOI marker ``FF D8``, as ``torchvision.io.read_file`` gives) is kept
as it is, unless it is larger than ``max_side``: then it is decoded, resized and
re-encoded. Each image's decoded ``(C, H, W)`` is read from the JPEG frame header, so
stored bytes need no decode to be measured; bytes cut short (no end-of-image marker, and
no decode) are refused, naming the sample; so are 1-D bytes of another format (PNG, GIF,
text...), named by their first bytes.

Channels: an image tensor the store encodes comes back with its own channels (1 or 3);
JPEG bytes from the source come back RGB, 3 channels, grayscale and CMYK files included
(as ``torchvision.datasets.ImageFolder``'s loader gives them), and are recorded so.

torchvision 0.29 deprecates its image codecs in favour of TorchCodec and warns at every
call (a ``DeprecationWarning``); the calls here silence that one warning
(:func:`quiet_codec_warnings`) so a build of a million images does not print a million
of them. This module imports nothing from the package.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator

import numpy as np
import torch

#: The encodings ``encode=`` accepts.
ENCODINGS = ("jpeg",)
#: The longest side libjpeg encodes or decodes (its JPEG_MAX_DIMENSION); torchvision's encoder
#: crashes the process (SIGSEGV) on a wider image instead of raising.
JPEG_MAX_SIDE = 65500
#: The first two bytes of every JPEG stream (start of image).
SOI = (0xFF, 0xD8)
# Start-of-frame markers (C0-CF without DHT C4, JPG C8 and DAC CC): they carry H, W, C.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD9)})  # TEM, RSTn, SOI: no length field
_CODEC_WARNING = r"The image decoding and encoding capabilities of TorchVision are deprecated"


@contextlib.contextmanager
def quiet_codec_warnings() -> Iterator[None]:
    """Silence torchvision's per-call deprecation warning of its image codecs (0.29+), nothing else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_CODEC_WARNING, category=DeprecationWarning)
        yield


def check_settings(encode: object, jpeg_quality: object, max_side: object) -> dict[str, str]:
    """Validate the ``encode``, ``jpeg_quality`` and ``max_side`` settings; returns ``encode`` as a dict.

    Raises:
        ValueError: naming the parameter, its bad value and what it accepts.
    """
    if encode is None:
        encode = {}
    if not isinstance(encode, dict):
        raise ValueError(f"encode must be a dict of field name -> 'jpeg', got {encode!r}")
    for name, how in encode.items():
        if not isinstance(name, str) or how not in ENCODINGS:
            raise ValueError(f"encode[{name!r}] is {how!r}; a field can be encoded as {ENCODINGS}")
    if isinstance(jpeg_quality, bool) or not isinstance(jpeg_quality, int) or not 1 <= jpeg_quality <= 100:
        raise ValueError(f"jpeg_quality must be an int in [1, 100], got {jpeg_quality!r}")
    if max_side is not None and (isinstance(max_side, bool) or not isinstance(max_side, int)
                                 or not 1 <= max_side <= JPEG_MAX_SIDE):
        raise ValueError(f"max_side must be None or an int in [1, {JPEG_MAX_SIDE}] (pixels of the longest side; "
                         f"JPEG holds at most {JPEG_MAX_SIDE}), got {max_side!r}")
    return dict(encode)


def is_jpeg(value: np.ndarray) -> bool:
    """A uint8 1-D array that starts with the JPEG start-of-image marker."""
    return (value.ndim == 1 and value.dtype == np.uint8 and value.shape[0] >= 2
            and int(value[0]) == SOI[0] and int(value[1]) == SOI[1])


def jpeg_shape(data: np.ndarray | bytes) -> tuple[int, int, int]:
    """The decoded ``(C, H, W)`` of a JPEG stream, read from its frame header (no decode).

    Raises:
        ValueError: when the bytes have no readable frame header before the scan.
    """
    b = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    n, i = len(b), 2
    if b[:2] != bytes(SOI):
        raise ValueError("does not start with the JPEG marker FF D8")
    while i + 4 <= n:
        if b[i] != 0xFF:
            raise ValueError(f"has no JPEG marker at byte {i}")
        marker = b[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image, or the scan, before any frame header
            break
        if marker in _SOF and i + 10 <= n:
            h, w, c = (b[i + 5] << 8) | b[i + 6], (b[i + 7] << 8) | b[i + 8], b[i + 9]
            if h and w and c:
                return c, h, w
            break
        i += 2 + ((b[i + 2] << 8) | b[i + 3])
    raise ValueError("has no readable JPEG frame header (truncated or not a JPEG)")


def capped_size(h: int, w: int, max_side: int | None) -> tuple[int, int]:
    """``(h, w)`` scaled so the longest side is ``max_side`` (aspect kept); unchanged if already within."""
    if max_side is None or max(h, w) <= max_side:
        return h, w
    s = max_side / max(h, w)
    return (max_side if h >= w else max(1, round(h * s))), (max_side if w > h else max(1, round(w * s)))


def source_size(value: np.ndarray) -> tuple[int, int] | None:
    """``(H, W)`` of a sample to encode (an image, or JPEG bytes by their frame header); ``None``
    for anything else (:func:`encode_jpeg_leaf` then names the problem)."""
    if is_jpeg(value):
        try:
            _, h, w = jpeg_shape(value)
        except ValueError:
            return None
        return h, w
    if value.dtype == np.uint8 and value.ndim == 3 and value.shape[0] in (1, 3):
        return int(value.shape[-2]), int(value.shape[-1])
    return None


def _resize(image: torch.Tensor, max_side: int | None) -> torch.Tensor:
    h, w = int(image.shape[-2]), int(image.shape[-1])
    size = capped_size(h, w, max_side)
    if size == (h, w):
        return image
    from torchvision.transforms.v2 import functional as TF

    return TF.resize(image, list(size), antialias=True)


def _decode(data: np.ndarray) -> torch.Tensor:
    """JPEG bytes as an RGB image: bytes from the source decode to RGB, whatever their channels."""
    from torchvision.io import ImageReadMode, decode_jpeg

    with quiet_codec_warnings():
        return decode_jpeg(torch.from_numpy(np.ascontiguousarray(data)), mode=ImageReadMode.RGB)


#: How far from the end of kept JPEG bytes the end-of-image marker may sit (some writers pad).
_EOI_TAIL = 64


def _check_complete(value: np.ndarray, where: str) -> None:
    """Refuse JPEG bytes cut short: no end-of-image marker near the end, and no full decode."""
    if b"\xff\xd9" in value[-_EOI_TAIL:].tobytes():
        return
    _decode_named(value, where)  # trailing data after the marker is legal: decode to tell it from a truncation


def _decode_named(value: np.ndarray, where: str) -> torch.Tensor:
    """``_decode``, or a ValueError naming ``where`` when the bytes do not decode."""
    try:
        return _decode(value)
    except RuntimeError as e:
        # torchvision prefixes its C++ source location: keep the decoder's own words.
        why = re.sub(r"^.*?\.cpp:\d+, ", "", str(e).splitlines()[0]) if str(e) else type(e).__name__
        raise ValueError(f"{where} is JPEG bytes ({value.size} bytes) that do not decode ({why}): the file is "
                         "truncated or corrupt; replace it, or leave it out of the source") from None


def encode_jpeg_leaf(value: np.ndarray, quality: int, max_side: int | None,
                     where: str) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One sample's field as stored JPEG bytes and its decoded ``(C, H, W)``.

    Args:
        value: A uint8 ``(C, H, W)`` image with C = 1 or 3, or JPEG bytes (uint8 1-D).
        quality: JPEG quality, 1-100.
        max_side: Longest side after store-time resizing, or ``None`` to keep the size.
        where: Names the sample and field in error messages ("sample 3, field 'image'").

    Raises:
        ValueError: for anything else, naming ``where`` and the fix.
    """
    if is_jpeg(value):
        try:
            c, h, w = jpeg_shape(value)
        except ValueError as e:
            raise ValueError(f"{where} starts like JPEG bytes but {e}; re-encode the file, or return it "
                             "decoded (uint8 C, H, W) from static_transform") from None
        _check_complete(value, where)
        _check_side(h, w, max_side, where)
        if capped_size(h, w, max_side) == (h, w):
            # Kept as they are; they decode to RGB (grayscale and CMYK files too), as recorded.
            return np.ascontiguousarray(value), (3, h, w)
        image = _decode_named(value, where)  # to resize: a corrupt middle fails here, named
    elif value.dtype == np.uint8 and value.ndim == 3 and value.shape[0] in (1, 3):
        image = torch.from_numpy(np.ascontiguousarray(value))
    elif value.dtype == np.uint8 and value.ndim == 1 and value.size == 0:
        raise ValueError(f"{where} is empty (0 bytes: an empty file?); replace it, or leave it out of the source")
    elif value.dtype == np.uint8 and value.ndim == 1:
        raise ValueError(
            f"{where} is not JPEG bytes: {_what_bytes(value)}; encode='jpeg' keeps JPEG files and encodes uint8 "
            "(C, H, W) images: decode other files in static_transform (e.g. "
            "torchvision.transforms.functional.pil_to_tensor(PIL.Image.open(io.BytesIO(data.numpy().tobytes()))"
            ".convert('RGB'))), or do not encode this field"
        )
    else:
        raise ValueError(
            f"{where} is {value.dtype} with shape {tuple(value.shape)}; encode='jpeg' needs a uint8 (C, H, W) "
            "image with 1 or 3 channels, or JPEG bytes (a uint8 1-D tensor starting with FF D8, as "
            "torchvision.io.read_file returns); convert it in static_transform, or do not encode this field"
        )
    if min(image.shape[-2:]) < 1:
        raise ValueError(f"{where} is an empty image {tuple(image.shape)}; JPEG needs at least 1x1 pixels")
    _check_side(int(image.shape[-2]), int(image.shape[-1]), max_side, where)
    image = _resize(image, max_side).contiguous()
    from torchvision.io import encode_jpeg

    with quiet_codec_warnings():
        data = encode_jpeg(image, quality=quality)
    c, h, w = (int(s) for s in image.shape)
    return data.numpy(), (c, h, w)


#: File signatures (magic numbers) of formats that arrive where JPEG bytes are expected.
_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "a PNG file"), (b"GIF87a", "a GIF file"), (b"GIF89a", "a GIF file"),
               (b"BM", "a BMP file"), (b"II*\x00", "a TIFF file"), (b"MM\x00*", "a TIFF file"),
               (b"\x00\x00\x00\x0cjP  ", "a JPEG 2000 file"), (b"\xff\x4f\xff\x51", "a JPEG 2000 codestream"))


def _what_bytes(value: np.ndarray) -> str:
    """What 1-D bytes that are not a JPEG look like, by their first bytes: "it starts with 89 50 4E 47 (a PNG file)"."""
    head = value[:16].tobytes()
    shown = f"it starts with {head[:8].hex(' ').upper()}"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return f"{shown} (a WebP file)"
    if head[:4] == b"RIFF":
        return f"{shown} (a RIFF file: audio or video?)"
    if head[4:8] == b"ftyp":
        return f"{shown} (an ISO media file: HEIC, AVIF or video)"
    for magic, name in _SIGNATURES:
        if head.startswith(magic):
            return f"{shown} ({name})"
    if all(32 <= c < 127 or c in b"\t\r\n" for c in head):
        return f"{shown} (text: {head.decode('ascii')!r})"
    return f"{shown} (no image format this library knows)"


def _check_side(h: int, w: int, max_side: int | None, where: str) -> None:
    """Refuse an image whose stored side would exceed what JPEG holds (checked before the encoder,
    which crashes the process on one)."""
    if max(capped_size(h, w, max_side)) > JPEG_MAX_SIDE:
        raise ValueError(f"{where} is {h}x{w} pixels; JPEG holds at most {JPEG_MAX_SIDE} per side: set max_side "
                         f"(<= {JPEG_MAX_SIDE}) to shrink it at store time, or do not encode this field")


def decoded_nbytes(shapes: np.ndarray) -> int:
    """Bytes of the decoded uint8 images of ``(N, 3)`` shapes."""
    return int(np.prod(np.asarray(shapes, dtype=np.int64).reshape(-1, 3), axis=1).sum())
