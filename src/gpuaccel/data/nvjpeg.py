"""nvJPEG's batch decoder called directly: the streaming loader's GPU decoder on GPUs with
hardware JPEG engines (data-centre GPUs since the Ampere generation); images it cannot take, and GPUs without engines, go through
torchvision's ``decode_jpeg``. (nvJPEG's CUDA-kernel backend was measured slower than the
engines and is not used.)

Why: ``torchvision.io.decode_jpeg(..., device="cuda")`` uses the same hardware decoder but
synchronises its stream before and after every call and returns a tensor per image. Called
directly, a batch blocks the calling thread for less time, and the images land in one buffer
that the resampler reads through a table (:class:`crops.ImageTable`), with no tensor per image:
a faster streaming pipeline, and a faster end-to-end ResNet-50 from a JPEG folder
(docs/results.md).

nvJPEG's hardware path writes its output when it is called, not in stream order, so every
decode first waits for the stream's queued work (:func:`drain_before_decoding`). Before
that wait, training runs that decoded this way had NaN losses and hung inside
nvjpegDecodeBatched (three of five); with it, eleven runs did neither. What is known of
the hardware path (torch.profiler): per image it copies the bitstream and converts the
engine's output on its own 14 internal streams of normal priority, with an event
synchronisation per image, so the stream passed in does not set the priority of its work,
and beside busy GPU work every image waits behind it.

The library is the libnvjpeg that torchvision loaded (found in /proc/self/maps), or one in
the NVIDIA wheels, or the system's.

:func:`frame` reads a JPEG's frame header in pure Python; the reader processes run it, so
the training process learns each image's size and whether the hardware can decode it
without a call per image.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import site
import sys
import threading
from typing import NamedTuple

import numpy as np
import torch

# nvjpegBackend_t by kind: the JPEG engines (hardware)
_BACKENDS = {"direct": 3}
_OUTPUT_RGB = 3  # nvjpegOutputFormat_t: three planes
_MAX_COMPONENTS = 4  # NVJPEG_MAX_COMPONENT: nvjpegImage_t holds 4 channel pointers, then 4 pitches

# start-of-frame markers: 0xC0-0xCF except DHT (C4), JPG (C8) and DAC (CC)
_FRAME_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_BASELINE = 0xC0
# luma (horizontal, vertical) sampling with both chroma planes at (1, 1): 4:4:4, 4:2:2, 4:2:0
_HARDWARE_SAMPLING = {(1, 1), (2, 1), (2, 2)}


def drain_before_decoding(device: torch.device) -> None:
    """Waits on the host until the current stream of ``device`` has run its queued work; call
    it before any nvJPEG decode (direct or through torchvision) on that stream.

    Why: nvJPEG's hardware decoder writes its output when it is called, not in the order of
    the stream it is given (meta-pytorch/torchcodec#1634, pytorch/vision#9606). The output
    comes from PyTorch's caching allocator, which hands out a block as soon as it is freed on
    the stream that owns it, while kernels queued on that stream may still read it, so the
    pixels could overwrite the pipeline's previous, still queued batch. With nothing queued,
    no freed block is still in use."""
    torch.cuda.current_stream(device).synchronize()


def torchvision_decode(data, mode, device):
    """``torchvision.io.decode_jpeg(data, mode=mode, device=device)`` on a GPU, after
    :func:`drain_before_decoding`: the one way this package calls it."""
    from torchvision.io import decode_jpeg

    drain_before_decoding(torch.device(device))
    return decode_jpeg(data, mode=mode, device=device)


class Frame(NamedTuple):
    height: int
    width: int
    hardware: bool  # baseline, 8-bit, grey or 4:4:4 / 4:2:2 / 4:2:0 colour
    # EXIF orientation, 1-8 (1: stored upright). nvJPEG ignores it; an image with another
    # orientation is decoded by Pillow, which turns it upright as image viewers do
    orientation: int = 1


def exif_orientation(segment) -> int:
    """The orientation tag of an APP1 segment's payload (``Exif\\0\\0`` and a TIFF header), 1 where
    it has none or it cannot be read."""
    if len(segment) < 14 or bytes(segment[:6]) != b"Exif\x00\x00":
        return 1
    tiff = segment[6:]
    order = {b"II": "little", b"MM": "big"}.get(bytes(tiff[:2]))
    if order is None:
        return 1

    def number(at: int, size: int) -> int:
        return int.from_bytes(bytes(tiff[at:at + size]), order)

    directory = number(4, 4)  # the first image file directory: a count, then 12-byte entries
    if directory + 2 > len(tiff):
        return 1
    for entry in range(directory + 2, min(directory + 2 + 12 * number(directory, 2), len(tiff) - 11), 12):
        if number(entry, 2) == 0x0112:  # Orientation: a SHORT, held in the entry's value field
            value = number(entry + 8, 2)
            return value if 1 <= value <= 8 else 1
    return 1


def frame(data) -> Frame | None:
    """The frame header of the JPEG in ``data`` (bytes-like), with the EXIF orientation of an
    APP1 segment before it, or None where there is none before the image data (not a JPEG,
    or cut short)."""
    view = memoryview(data)
    if len(view) < 4 or view[0] != 0xFF or view[1] != 0xD8:
        return None
    at, orientation = 2, 1
    while at + 4 <= len(view):
        if view[at] != 0xFF:
            return None
        marker = view[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # no length field
            at += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image, or image data before any frame header
            return None
        length = view[at + 2] << 8 | view[at + 3]
        if marker == 0xE1 and orientation == 1:  # APP1: EXIF (or XMP, which exif_orientation passes over)
            orientation = exif_orientation(view[at + 4:at + 2 + length])
        if marker in _FRAME_MARKERS:
            header = view[at + 4:at + 2 + length]
            if length < 8 or len(header) < 6:
                return None
            precision, height, width, components = header[0], header[1] << 8 | header[2], \
                header[3] << 8 | header[4], header[5]
            if height == 0 or width == 0 or len(header) < 6 + 3 * components:
                return None
            sampling = [(header[7 + 3 * c] >> 4, header[7 + 3 * c] & 15) for c in range(components)]
            colour = components == 3 and sampling[0] in _HARDWARE_SAMPLING and sampling[1:] == [(1, 1), (1, 1)]
            return Frame(height, width, marker == _BASELINE and precision == 8 and (components == 1 or colour),
                         orientation)
        at += 2 + length
    return None


def _library_candidates() -> list[str]:
    found = []
    try:
        with open("/proc/self/maps") as maps:  # the copy torchvision's image extension loaded
            found += [line.split()[-1] for line in maps if "libnvjpeg" in line]
    except OSError:
        pass
    roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    for root in roots:
        for pattern in ("torchvision.libs/libnvjpeg*.so*", "torchvision/libnvjpeg*.so*", "nvidia/*/lib/libnvjpeg.so*",
                        "nvidia/*/*/lib/libnvjpeg.so*"):
            found += sorted(glob.glob(os.path.join(root, pattern)))
    system = ctypes.util.find_library("nvjpeg")
    return [path for path in dict.fromkeys(found + ([system] if system else [])) if "libnvjpeg" in path]


# one decoder per device, kind and process, as torchvision keeps one per device
_shared: dict[tuple[int, str], "BatchDecoder | None"] = {}
_shared_lock = threading.Lock()


class BatchDecoder:
    """Baseline JPEGs -> planar RGB uint8 on the GPU, one nvjpegDecodeBatched call per batch,
    on the JPEG engines (``kind`` "direct"). One per device is shared by every loader of the
    process (:meth:`open`, as torchvision keeps one); calls from several threads run side by side, each with a decoding state of its own."""

    def __init__(self, library: ctypes.CDLL, device: torch.device, kind: str = "direct"):
        self.device = device
        self.kind = kind
        self._lib = library
        void_p, p_void_p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        library.nvjpegCreateEx.argtypes = [ctypes.c_int, void_p, void_p, ctypes.c_uint, p_void_p]
        library.nvjpegJpegStateCreate.argtypes = [void_p, p_void_p]
        library.nvjpegDecodeBatchedInitialize.argtypes = [void_p, void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        library.nvjpegDecodeBatched.argtypes = [void_p, void_p, void_p, void_p, void_p, void_p]
        self._handle = void_p()
        with torch.cuda.device(device):  # nvJPEG works on the current device
            self._check("nvjpegCreateEx", library.nvjpegCreateEx(_BACKENDS[kind], None, None, 0,
                                                                  ctypes.byref(self._handle)))
        # nvJPEG's threading rule: one handle for all, a decoding state per concurrent call.
        # States not in use wait here with the batch size they were initialised for.
        self._idle_states: list[list] = [[self._new_state(), None]]
        self._lock = threading.Lock()

    def _new_state(self) -> ctypes.c_void_p:
        state = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            self._check("nvjpegJpegStateCreate", self._lib.nvjpegJpegStateCreate(self._handle, ctypes.byref(state)))
        return state

    @classmethod
    def open(cls, device: torch.device, kind: str = "direct") -> "BatchDecoder | None":
        """The decoder of ``kind`` for ``device``: ``direct``, the JPEG engines (found on data-centre
        GPUs since the Ampere generation); None where the device is not a GPU or no nvJPEG library loads."""
        if kind not in _BACKENDS:
            raise ValueError(f"kind must be one of {', '.join(_BACKENDS)}; got {kind!r}")
        if device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        with _shared_lock:
            if (index, kind) not in _shared:
                _shared[index, kind] = cls._first_that_loads(torch.device("cuda", index), kind)
            return _shared[index, kind]

    @classmethod
    def _first_that_loads(cls, device: torch.device, kind: str) -> "BatchDecoder | None":
        try:
            import torchvision.io.image  # noqa: F401  (loads torchvision's libnvjpeg, the first candidate)
        except ImportError:
            pass
        for path in _library_candidates():
            try:
                return cls(ctypes.CDLL(path), device, kind)
            except (OSError, AttributeError, RuntimeError):
                continue
        return None

    def _check(self, name: str, status: int) -> None:
        if status != 0:
            raise RuntimeError(f"{name} failed with nvjpegStatus {status}")

    def decode(self, data: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray, heights: np.ndarray,
               widths: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """Decodes image k of ``data`` (host uint8; pinned, so the copy is asynchronous), its
        ``lengths[k]`` bytes from ``offsets[k]``, on the current stream. Returns the planes,
        one image after another, and each image's offset in them. ``data`` must stay alive
        until the stream is past this work; a RuntimeError means nothing usable was decoded."""
        n = len(offsets)
        planes = 3 * heights.astype(np.int64) * widths
        starts = np.concatenate([[0], np.cumsum(planes)[:-1]]).astype(np.int64)
        out = torch.empty(int(planes.sum()), dtype=torch.uint8, device=self.device)
        images = np.zeros((n, 2 * _MAX_COMPONENTS), dtype=np.uint64)  # nvjpegImage_t: pointers, then pitches
        first = out.data_ptr() + starts
        for c in range(3):
            images[:, c] = first + c * heights * widths
            images[:, _MAX_COMPONENTS + c] = widths
        sources = (data.data_ptr() + offsets).astype(np.uint64)
        sizes = lengths.astype(np.uint64)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        drain_before_decoding(self.device)  # after allocating ``out``: nvJPEG writes it at once
        with self._lock:  # an idle state, one initialised for this batch size if there is one
            idle = self._idle_states
            slot = idle.pop(next((k for k, s in enumerate(idle) if s[1] == n), -1)) if idle else \
                [self._new_state(), None]
        try:
            state, size = slot
            if size != n:
                slot[1] = None
                self._check("nvjpegDecodeBatchedInitialize",
                            self._lib.nvjpegDecodeBatchedInitialize(self._handle, state, n, 1, _OUTPUT_RGB))
                slot[1] = n
            status = self._lib.nvjpegDecodeBatched(self._handle, state, sources.ctypes.data, sizes.ctypes.data,
                                                   images.ctypes.data, stream)
            if status != 0:
                slot[1] = None  # initialise again before its next batch
                self._check("nvjpegDecodeBatched", status)
        finally:
            with self._lock:
                self._idle_states.append(slot)
        return out, starts
