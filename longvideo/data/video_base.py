"""What every video reader shares: the source type, the accepted extensions, the errors (each
with the skip counter it is filed under), what a reader learns from a container, and the frame-size
bound applied before anything is decoded. A leaf: the in-process reader (longvideo.data.video) and
the isolated decord reader (longvideo.data.isolate) both build on it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Union

VideoSource = Union[str, os.PathLike, bytes, bytearray, memoryview]


VIDEO_EXTS: tuple[str, ...] = ("mp4", "m4v", "mov", "mkv", "webm", "avi", "ogv", "ogg", "mpg", "mpeg", "ts",
                               "flv", "gif", "3gp")
"""Accepted video file extensions (lower case, no dot): in shards, folders and ``chat --video``.
The one list; shard members, folder scans and messages all use it."""


class VideoError(Exception):
    """A video could not be read. ``source`` names it (a path or '<bytes>'); ``reason`` is the skip counter."""

    reason = "video_error"

    def __init__(self, message: str, source: str = "<bytes>"):
        self.source = source
        super().__init__(f"{source}: {message}")


class EmptyVideoError(VideoError):
    """Zero bytes, or a container that holds no frames."""

    reason = "video_empty"


class CorruptVideoError(VideoError):
    """The decoder cannot read the data (truncated file, damaged stream, not a video)."""

    reason = "video_corrupt"


class UnsupportedVideoError(VideoError):
    """Readable container but no decodable video stream, or a frame larger than allowed."""

    reason = "video_unsupported"


@dataclass(frozen=True)
class VideoInfo:
    """What a reader learnt from the container."""

    num_frames: int
    fps: float
    width: int
    height: int
    duration: float


def check_frame_size(width: int, height: int, max_resolution: int, label: str) -> None:
    if width <= 0 or height <= 0:
        raise CorruptVideoError(f"invalid frame size {width}x{height}", label)
    if max(width, height) > max_resolution:
        raise UnsupportedVideoError(
            f"frame size {width}x{height} exceeds max_resolution={max_resolution}", label)
