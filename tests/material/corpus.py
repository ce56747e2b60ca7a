"""Small real encodes in every accepted container, and damaged copies of them.

Used by the robustness tests (docs/experiments.md records the survey of which inputs crash a
decoder). Every frame spells its own index (:func:`longvideo.data.synthetic.frame_index_video`)
over a little noise, so a reader's output can be checked frame by frame and the files are not
trivially small.

    good = encode_all()                  # {"mp4": bytes, "avi": bytes, ...}, one per CONTAINERS entry
    for name, data in damaged(good["avi"], "avi"): ...
"""

from __future__ import annotations

import io
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from longvideo.data.synthetic import frame_index_video


@dataclass(frozen=True)
class Encoding:
    """How one test file is made: PyAV muxer ``fmt`` with encoder ``codec`` into a ``.ext`` file."""

    name: str
    ext: str
    fmt: str
    codec: str
    fps: int = 8
    pix_fmt: str = "yuv420p"
    frames: int = 40
    size: int = 64


CONTAINERS: tuple[Encoding, ...] = (
    Encoding("mp4", "mp4", "mp4", "libx264"),
    Encoding("m4v", "m4v", "mp4", "mpeg4"),
    Encoding("mov", "mov", "mov", "libx264"),
    Encoding("mkv", "mkv", "matroska", "libx264"),
    Encoding("webm", "webm", "webm", "libvpx"),
    Encoding("webm_vp9", "webm", "webm", "libvpx-vp9"),
    Encoding("avi", "avi", "avi", "msmpeg4v3"),
    Encoding("avi_mpeg4", "avi", "avi", "mpeg4"),
    Encoding("ogv", "ogv", "ogg", "libvpx"),  # the bundled FFmpeg has no Theora encoder
    Encoding("ogg", "ogg", "ogg", "libvpx"),
    Encoding("mpg", "mpg", "mpeg", "mpeg1video", fps=25, frames=60),
    Encoding("mpeg", "mpeg", "mpeg", "mpeg2video", fps=25, frames=60),
    Encoding("ts", "ts", "mpegts", "libx264"),
    Encoding("flv", "flv", "flv", "flv"),
    Encoding("gif", "gif", "gif", "gif", fps=10, pix_fmt="rgb8", frames=30),
    Encoding("3gp", "3gp", "3gp", "libx264"),
)
"""One encoding per accepted container (two for webm and avi)."""


def corpus_frames(n: int, size: int = 64, seed: int = 0) -> np.ndarray:
    """uint8 (n, size, size, 3): the frame-index pattern with +-24 of noise (decodable after lossy coding)."""
    frames = frame_index_video(0, n, size).astype(np.int16)
    noise = np.random.default_rng(seed).integers(-24, 25, frames.shape, dtype=np.int16)
    return np.clip(frames + noise + np.where(frames > 127, -40, 40), 0, 255).astype(np.uint8)


def encode(enc: Encoding, frames: np.ndarray | None = None) -> bytes:
    """The bytes of ``frames`` (default: :func:`corpus_frames`) encoded as ``enc`` says (single-threaded).

    Not always the same bytes: now and then two encodings of the same frames differ by a rounding
    (seen in H.264 encodings made beside torch), so a test that compares what a pipeline made of
    a clip with a reference encodes the clip once and gives both the same bytes.
    """
    import av

    if frames is None:
        frames = corpus_frames(enc.frames, enc.size)
    buf = io.BytesIO()
    with av.open(buf, "w", format=enc.fmt) as c:
        s = c.add_stream(enc.codec, rate=Fraction(enc.fps))
        s.height, s.width = frames.shape[1:3]
        s.pix_fmt = enc.pix_fmt
        s.thread_count = 1
        if enc.codec == "libx264":
            s.options = {
                "x264-params": "threads=1:info=0:keyint=16:min-keyint=16",
                "preset": "veryfast",
            }
        else:
            s.codec_context.gop_size = 16
            s.bit_rate = 2_000_000  # files of tens of KB, like short real clips
        for img in frames:
            for p in s.encode(
                av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
            ):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return buf.getvalue()


def encode_all() -> dict[str, bytes]:
    """{encoding name: bytes} for every entry of :data:`CONTAINERS`."""
    return {e.name: encode(e) for e in CONTAINERS}


# ----------------------------------------------------------------------------- damage


def _flip(data: bytes, start: int, length: int, seed: int) -> bytes:
    out = bytearray(data)
    start = max(0, min(start, len(out) - 1))
    end = min(len(out), start + length)
    rng = np.random.default_rng(seed)
    out[start:end] = (
        np.frombuffer(bytes(out[start:end]), np.uint8)
        ^ rng.integers(1, 256, end - start, dtype=np.uint8)
    ).tobytes()
    return bytes(out)


def _patch_u(out: bytearray, pos: int, fmt: str, value: int) -> None:
    if 0 <= pos and pos + struct.calcsize(fmt) <= len(out):
        out[pos : pos + struct.calcsize(fmt)] = struct.pack(fmt, value)


def huge_frame_size(data: bytes, ext: str, side: int = 30000) -> bytes | None:
    """The file with its declared frame width and height patched to about ``side`` (None: no known field).

    Patched: MP4/MOV/3GP track header and visual sample entry, AVI main header and bitmap header,
    VP8 keyframe headers (WebM, Ogg; 14-bit fields, so 16383), MPEG-1/2 sequence headers (12-bit,
    4095), GIF screen and image descriptors, FLV metadata.
    """
    out = bytearray(data)
    hit = False
    if ext in ("mp4", "m4v", "mov", "3gp"):
        for m in re.finditer(rb"tkhd", data):
            p = m.start() + 4  # after the type: version(1) flags(3) ...
            if data[p] == 0:  # version 0: width, height at 76, 80 bytes after the version byte
                _patch_u(out, p + 76, ">I", side << 16)
                _patch_u(out, p + 80, ">I", side << 16)
                hit = True
        for m in re.finditer(rb"avc1|mp4v|s263|hvc1", data):
            p = m.start() + 4 + 6 + 2 + 16  # reserved, data reference index, pre-defined/reserved
            _patch_u(out, p, ">H", min(side, 0xFFFF))
            _patch_u(out, p + 2, ">H", min(side, 0xFFFF))
            hit = True
    elif ext == "avi":
        m = data.find(b"avih")
        if m >= 0:
            _patch_u(out, m + 8 + 32, "<I", side)
            _patch_u(out, m + 8 + 36, "<I", side)
            hit = True
        m = data.find(b"strf")
        if m >= 0:
            _patch_u(out, m + 8 + 4, "<i", side)
            _patch_u(out, m + 8 + 8, "<i", side)
            hit = True
    elif ext in ("webm", "ogv", "ogg", "mkv"):
        for m in re.finditer(
            rb"\x9d\x01\x2a", data
        ):  # VP8 keyframe start code, then 14-bit width/height
            _patch_u(out, m.end(), "<H", 0x3FFF)
            _patch_u(out, m.end() + 2, "<H", 0x3FFF)
            hit = True
    elif ext in ("mpg", "mpeg"):
        for m in re.finditer(
            rb"\x00\x00\x01\xb3", data
        ):  # sequence header: 12-bit width, 12-bit height
            out[m.end() : m.end() + 3] = b"\xff\xff\xff"[: max(0, len(out) - m.end())]
            hit = True
    elif ext == "gif":
        _patch_u(out, 6, "<H", 0xFFFF)
        _patch_u(out, 8, "<H", 0xFFFF)
        for m in re.finditer(rb"\x2c\x00\x00\x00\x00", data):  # image descriptors at (0, 0)
            _patch_u(out, m.start() + 5, "<H", 0xFFFF)
            _patch_u(out, m.start() + 7, "<H", 0xFFFF)
        hit = True
    elif ext == "flv":
        for key in (b"width", b"height"):
            m = data.find(key + b"\x00")
            if m >= 0:
                out[m + len(key) + 1 : m + len(key) + 9] = struct.pack(">d", float(side))
                hit = True
    return bytes(out) if hit else None


def damaged(data: bytes, ext: str, seed: int = 0) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of damaged copies of a good file: truncations, flipped bytes, a huge frame size."""
    n = len(data)
    for frac in (0.02, 0.1, 0.3, 0.5, 0.7, 0.9, 0.98):
        yield f"cut{int(frac * 100):02d}", data[: int(n * frac)]
    if n > 20 << 10:
        yield "cut20k", data[: 20 << 10]
    yield "cut_header", data[:64]
    yield "flip_header", _flip(data, 8, 48, seed)
    yield "flip_header_wide", _flip(data, 0, 512, seed + 1)
    yield "flip_middle", _flip(data, n // 2, 256, seed + 2)
    yield "flip_sprinkle", bytes(b ^ (0x10 if i % 97 == 13 else 0) for i, b in enumerate(data))
    yield "flip_tail", _flip(data, n - 256, 256, seed + 3)
    yield "zero_middle", data[: n // 3] + bytes(n // 3) + data[2 * (n // 3) :]
    yield "shuffled_halves", data[n // 2 :] + data[: n // 2]
    big = huge_frame_size(data, ext)
    if big is not None:
        yield "huge_size", big
    big = huge_frame_size(data, ext, side=65535)
    if big is not None and ext in ("mp4", "m4v", "mov", "3gp", "avi", "flv"):
        yield "huge_size_64k", big


def not_videos() -> Iterator[tuple[str, str, bytes]]:
    """(name, ext, bytes) of inputs that are no video at all."""
    yield "empty", "mp4", b""
    yield "text", "mp4", b"this is a text file, not a video\n" * 40
    yield "random", "mkv", np.random.default_rng(7).integers(0, 256, 8192, dtype=np.uint8).tobytes()
    yield "json", "webm", b'{"caption": "not a video"}'
    yield "one_byte", "avi", b"\x00"
    yield "png", "gif", b"\x89PNG\r\n\x1a\n" + bytes(200)
