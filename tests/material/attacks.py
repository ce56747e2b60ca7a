"""Inputs that make FFmpeg read files other than the one it was given, and the real files they name.

FFmpeg picks its demuxer from the content: a concat script decodes the files it lists, an HLS
playlist its segments, an image-sequence pattern the numbered images. ``plant(folder)`` writes real
clips and images into ``folder`` (a test makes it the working directory, the place a relative name
resolves to) and returns the attack payloads that name them; every clip's frames spell their own
index (``longvideo.data.synthetic.frame_index_video``), so a test can tell whether a frame of the
named file came out.

    files = plant(tmp_path)      # writes clip.avi, seg.ts, img000.png .. img002.png
    files.concat                 # b"ffconcat version 1.0\\nfile clip.avi\\n" (35 bytes)
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

from material.corpus import CONTAINERS, encode

CONCAT = b"ffconcat version 1.0\nfile clip.avi\n"
"""The 35-byte concat script of the report: it names ``clip.avi`` beside the process."""


def hls_playlist(segment: str = "seg.ts") -> bytes:
    """An HLS media playlist of one 5-second segment."""
    return (
        "#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:5\n#EXT-X-MEDIA-SEQUENCE:0\n"
        f"#EXTINF:5.0,\n{segment}\n#EXT-X-ENDLIST\n"
    ).encode()


def png(value: int, size: int = 32) -> bytes:
    """One grey PNG image, encoded by FFmpeg's PNG encoder."""
    ctx = av.CodecContext.create("png", "w")
    ctx.width = ctx.height = size
    ctx.pix_fmt = "rgb24"
    frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), value, np.uint8), format="rgb24")
    return b"".join(bytes(p) for p in ctx.encode(frame) + ctx.encode(None))


@dataclass(frozen=True)
class Planted:
    folder: Path
    clip: bytes  # clip.avi: 40 frames, MPEG-4 part 2 in AVI
    segment: bytes  # seg.ts: 40 frames, H.264 in MPEG-TS
    concat: bytes = CONCAT
    hls: bytes = hls_playlist()
    pattern: str = "img%03d.png"  # the image2 pattern naming img000.png .. img002.png

    @property
    def pngs(self) -> bytes:
        """The three images back to back: what FFmpeg's png_pipe demuxer reads as a video."""
        return b"".join((self.folder / (self.pattern % i)).read_bytes() for i in range(3))


def plant(folder: Path) -> Planted:
    """Write the files the payloads name into ``folder``."""
    by_name = {e.name: e for e in CONTAINERS}
    clip, segment = encode(by_name["avi_mpeg4"]), encode(by_name["ts"])
    (folder / "clip.avi").write_bytes(clip)
    (folder / "seg.ts").write_bytes(segment)
    planted = Planted(folder, clip, segment)
    for i in range(3):
        (folder / (planted.pattern % i)).write_bytes(png(40 + 80 * i))
    return planted


def frames_via_ffmpeg(data: bytes, options: dict | None = None, name: str = "") -> int:
    """Frames PyAV decodes from ``data`` opened with ``options`` (FFmpeg's defaults: every
    demuxer and protocol), or -1 when it refuses to open it. ``name``: the file name FFmpeg sees."""
    f = io.BytesIO(data)
    f.name = name or "<bytes>"
    try:
        with av.open(f, options=options or {}) as c:
            return sum(1 for _ in c.decode(video=0))
    except av.FFmpegError:
        return -1
