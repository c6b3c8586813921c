"""JPEG decoding of a batch, where the batch is used: one nvJPEG call on a CUDA device,
a pool of threads on the CPU.

This module is the one place that knows which library decodes JPEGs. Today that is
``torchvision.io.decode_jpeg``: it ships with torchvision (no new dependency), decodes a
list in one batched nvJPEG call on CUDA, and on the CPU (libjpeg-turbo) releases the GIL
while it decodes, so threads scale with cores. torchvision 0.29 deprecates its image
codecs in favour of TorchCodec and warns on every call (a ``DeprecationWarning``); the
warning is ignored here, around our own calls only. TorchCodec's ``decode_jpeg`` is used
when the installed torchvision no longer has a decoder, so nothing else changes when
torchvision drops it: same libjpeg-turbo, same speed (measured on 0.17). Unlike
torchvision's, it always applies the EXIF orientation (no option turns that off), which
would flip or transpose photos against the un-rotated shapes a store records: it is handed
a copy of each JPEG without its EXIF segments (:func:`_without_exif`, only for files that
have one), so it gives torchvision's pixels.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence

import torch

from lightning_fastdata._pool import default_threads, map_runs

#: The start of the warning torchvision >= 0.29 gives on every decode/encode call.
TORCHVISION_DEPRECATION = "The image decoding and encoding capabilities of TorchVision are deprecated"


def _torchvision_decoder() -> Callable[..., object] | None:
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError:
        return None

    def run(data: torch.Tensor | list[torch.Tensor], device: torch.device, gray: bool = False) -> object:
        return decode_jpeg(data, mode=ImageReadMode.GRAY if gray else ImageReadMode.RGB, device=device)

    return run


def _torchcodec_decoder() -> Callable[..., object] | None:
    try:
        from torchcodec.decoders import decode_jpeg
    except ImportError:
        return None

    def run(data: torch.Tensor | list[torch.Tensor], device: torch.device, gray: bool = False) -> object:
        # TorchCodec always rotates by the EXIF orientation; torchvision, PIL and the shapes a
        # store records do not: give it bytes with no orientation to apply.
        data = [_without_exif(t) for t in data] if isinstance(data, list) else _without_exif(data)
        return decode_jpeg(data, mode="GRAY" if gray else "RGB", device=device)

    return run


#: The identifier that opens an APP1 segment holding EXIF (TIFF) data, orientation included.
_EXIF = b"Exif\x00\x00"


def _without_exif(data: torch.Tensor) -> torch.Tensor:
    """A JPEG's bytes without its APP1 EXIF segments; ``data`` itself when it has none.

    Walks the markers from SOI to the first scan (SOS), skipping each segment by its length;
    the pixels are untouched. Bytes that are not a well-formed JPEG header are kept as they
    are, for the decoder to refuse.
    """
    b = data.numpy()
    n = b.shape[0]
    if n < 4 or b[0] != 0xFF or b[1] != 0xD8:
        return data
    cut: list[tuple[int, int]] = []
    i = 2
    while i + 3 < n and b[i] == 0xFF:
        marker = int(b[i + 1])
        if marker == 0xFF:  # fill byte before a marker
            i += 1
            continue
        if marker == 0xDA or marker == 0xD9:  # the scan (EXIF comes before it), or the end
            break
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        end = i + 2 + (int(b[i + 2]) << 8 | int(b[i + 3]))
        if end > n:
            break
        if marker == 0xE1 and b[i + 4:i + 10].tobytes() == _EXIF:
            cut.append((i, end))
        i = end
    if not cut:
        return data
    keep, start = [], 0
    for a, z in cut:
        keep.append(data[start:a])
        start = z
    keep.append(data[start:])
    return torch.cat(keep)


#: The chosen decoder, found on first use: (library name, function).
_DECODER: list[tuple[str, Callable[..., object]]] = []


def backend() -> str:
    """The library that decodes: ``"torchvision"`` or ``"torchcodec"``."""
    return _decoder()[0]


def _decoder() -> tuple[str, Callable[..., object]]:
    if not _DECODER:
        for name, make in (("torchvision", _torchvision_decoder), ("torchcodec", _torchcodec_decoder)):
            fn = make()
            if fn is not None:
                _DECODER.append((name, fn))
                break
        else:
            raise ImportError("decoding JPEG fields needs torchvision.io.decode_jpeg or torchcodec: "
                              "pip install torchvision (or torchcodec)")
    return _DECODER[0]


def _check(data: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(data, torch.Tensor) or not isinstance(data, Sequence):
        raise TypeError(f"decode_jpegs takes a list of 1-D uint8 tensors (one JPEG each), got {type(data).__name__}")
    out = list(data)
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.ndim != 1:
            what = f"a {t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else \
                f"a {type(t).__name__}"
            raise TypeError(f"decode_jpegs: sample {i} is {what}; each sample must be the JPEG file's bytes as a "
                            "1-D uint8 tensor")
    if any(t.device.type != "cpu" for t in out):
        # The decoders read host memory: one copy of all the bytes, not one per sample.
        lengths = [t.numel() for t in out]
        out = list(torch.cat(out).cpu().split(lengths))
    return out


def _bad(i: int, t: torch.Tensor, err: Exception, indices: Sequence[int] | torch.Tensor | None) -> ValueError:
    name = f"sample {i} of the batch" + (f" (dataset index {int(indices[i])})" if indices is not None else "")
    head = bytes(t[:4].tolist()).hex()
    # torchvision prefixes its C++ source location: keep the decoder's own words.
    why = re.sub(r"^.*?\.cpp:\d+, ", "", str(err).splitlines()[0] if str(err) else repr(err))
    return ValueError(f"decode_jpegs: {name} is not a decodable JPEG ({t.numel()} bytes, starting {head}): {why}; "
                      "rebuild the cache if the file changed, or check the source yields JPEG bytes")


def decode_jpegs(data: Sequence[torch.Tensor], device: torch.device | str = "cpu", threads: int | None = None,
                 indices: Sequence[int] | torch.Tensor | None = None,
                 channels: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Decode JPEG files' bytes into uint8 ``(C, H, W)`` images on ``device``.

    Every image comes out RGB (3 channels, grayscale and CMYK JPEGs included), except the
    samples ``channels`` marks 1: those come out grayscale ``(1, H, W)``. A store records 1
    for the 1-channel images it encoded itself, so they come back as they went in.

    On a CUDA device the whole list is one batched nvJPEG call (two when grayscale and RGB
    samples mix). On the CPU the list is split into ``threads`` runs of samples decoded in
    parallel (the decoder releases the GIL).

    Args:
        data: One 1-D uint8 tensor per sample (the file's bytes), on any device.
        device: Where the images are wanted (and decoded).
        threads: CPU decoding threads; default the calling thread's torch intra-op budget
            (``torch.get_num_threads()``: the cores, 1 in a DataLoader worker). 1 decodes
            in the calling thread.
        indices: The samples' dataset indices, named in errors (default: their positions);
            read only to report an error, so a device tensor costs no synchronisation.
        channels: Per sample, the channels wanted: 1 for grayscale, anything else for RGB
            (default: RGB for all).

    Returns:
        The images, in the order of ``data``.

    Raises:
        ValueError: A sample is not a decodable JPEG (the error names it).
    """
    device = torch.device(device)
    items = _check(data)
    if not items:
        return []
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"decode_jpegs threads must be an int >= 1 or None, got {threads!r}")
    if channels is not None and len(channels) != len(items):
        raise ValueError(f"decode_jpegs: channels has {len(channels)} entries for {len(items)} samples")
    gray = [int(c) == 1 for c in channels] if channels is not None else [False] * len(items)
    decode = _decoder()[1]
    with warnings.catch_warnings():
        # Entered once in the calling thread, around the pool's work too: the filter is in
        # place while the threads decode, and nowhere else.
        warnings.filterwarnings("ignore", message=TORCHVISION_DEPRECATION, category=DeprecationWarning)
        if device.type == "cuda":
            return _decode_cuda(decode, items, device, indices, gray)
        out = _decode_cpu(decode, items, threads, indices, gray)
    return out if device.type == "cpu" else [img.to(device, non_blocking=True) for img in out]


def _decode_one(decode: Callable[..., object], items: list[torch.Tensor], i: int,
                indices: Sequence[int] | torch.Tensor | None, gray: list[bool]) -> torch.Tensor:
    try:
        return decode(items[i], torch.device("cpu"), gray[i])  # type: ignore[return-value]
    except RuntimeError as err:
        raise _bad(i, items[i], err, indices) from err


def _decode_cpu(decode: Callable[..., object], items: list[torch.Tensor], threads: int | None,
                indices: Sequence[int] | torch.Tensor | None, gray: list[bool]) -> list[torch.Tensor]:
    # Contiguous runs of about equal bytes, one per thread: one task each, not one per image.
    return map_runs(lambda run: [_decode_one(decode, items, i, indices, gray) for i in run],
                    [t.numel() for t in items], default_threads() if threads is None else threads)


#: SOF markers (start of frame: baseline, progressive, lossless, arithmetic); C4, C8 and CC
#: are other segments in the same range.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _components(data: torch.Tensor) -> int | None:
    """The number of colour components a JPEG's frame header declares (1 gray, 3 YCbCr/RGB,
    4 CMYK/YCCK), or None where the header cannot be read (the decoder then says why).

    Reads only the markers before the frame header, skipping each segment by its length.
    """
    b = data.numpy()
    n = b.shape[0]
    if n < 4 or b[0] != 0xFF or b[1] != 0xD8:
        return None
    i = 2
    while i + 3 < n:
        if b[i] != 0xFF:
            return None
        marker = int(b[i + 1])
        if marker == 0xFF:  # fill byte before a marker
            i += 1
            continue
        if marker in _SOF:
            return int(b[i + 9]) if i + 9 < n else None
        if marker == 0xDA or marker == 0xD9:  # scan or end before any frame header
            return None
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        i += 2 + (int(b[i + 2]) << 8 | int(b[i + 3]))
    return None


def _decode_cuda(decode: Callable[..., object], items: list[torch.Tensor], device: torch.device,
                 indices: Sequence[int] | torch.Tensor | None, gray: list[bool]) -> list[torch.Tensor]:
    out: list[torch.Tensor | None] = [None] * len(items)
    # torchvision's nvJPEG path does not decode 4-component (CMYK/YCCK) JPEGs (its own tests
    # mark them xfail): one in a batch would fail the whole batched call, or give wrong colours.
    # Those few (about 22 of ImageNet's 1.28M) go to libjpeg-turbo, which converts them to RGB
    # as PIL does, and are copied to the device.
    rest = []
    for i, t in enumerate(items):
        if _components(t) == 4:
            out[i] = _decode_one(decode, items, i, indices, gray).to(device, non_blocking=True)
        else:
            rest.append(i)
    try:
        for mode in sorted({gray[i] for i in rest}):  # one batched call per mode
            rows = [i for i in rest if gray[i] == mode]
            for i, image in zip(rows, decode([items[i] for i in rows], device, mode), strict=True):  # type: ignore[call-overload]
                out[i] = image
    except RuntimeError as err:
        # nvJPEG fails the whole batch: find the sample on the CPU decoder, which checks each.
        for i in range(len(items)):
            _decode_one(decode, items, i, indices, gray)
        raise RuntimeError(f"decode_jpegs: nvJPEG failed on a batch of {len(items)} JPEGs that the CPU decoder "
                           f"reads: {err}") from err
    return out  # type: ignore[return-value]


__all__ = ["TORCHVISION_DEPRECATION", "backend", "decode_jpegs"]
