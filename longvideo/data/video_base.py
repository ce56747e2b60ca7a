"""What every video reader shares (the PyAV reader, the isolated decord reader and decord's child):
extensions, errors, orientation, container facts, the read report and the stream checks. A leaf
that imports numpy only, so decord's child can use it (PyAV's objects are passed in)."""

from __future__ import annotations

import itertools
import math
import os
import struct
from dataclasses import dataclass, field

import numpy as np

VideoSource = str | os.PathLike | bytes | bytearray | memoryview


VIDEO_EXTS: tuple[str, ...] = (
    "mp4",
    "m4v",
    "mov",
    "mkv",
    "webm",
    "avi",
    "ogv",
    "ogg",
    "mpg",
    "mpeg",
    "ts",
    "flv",
    "gif",
    "3gp",
)
"""Accepted video file extensions (lower case, no dot): the one list for shard members, folder scans
and ``chat --video``."""

TRUNCATED_TOLERANCE_S = 0.5
"""A video is truncated when it ends more than this many seconds (and two frames) before its
container says it does; audio tracks and rounded headers differ from the video by less."""


class VideoError(Exception):
    """A video could not be read; ``source`` names it (a path or '<bytes>'), ``reason`` is its counter."""

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


class DisallowedContainerError(UnsupportedVideoError):
    """FFmpeg detects a format outside the allow-list (longvideo.data.containers.ALLOWED_FORMATS):
    a concat script, a playlist, an image sequence, ...; ``format`` names it ("" when the probe
    that names it is unavailable). Nothing of it is opened."""

    reason = "video_disallowed_container"

    def __init__(self, format: str, source: str = "<bytes>"):
        self.format = format
        what = f"FFmpeg detects the format {format!r}" if format else "FFmpeg detects a format"
        super().__init__(
            f"{what}, which is not an allowed video container (allowed: mp4/mov, matroska/webm, "
            "avi, mpegts, ogg, flv, mpeg-ps, gif, raw video streams); it was not opened",
            source,
        )


@dataclass(frozen=True)
class Orientation:
    """How stored frames become what a player shows: a transpose and flips (the display matrix, or
    the legacy ``rotate`` tag), then the sample aspect ratio ``sar`` (a stored pixel's width over
    its height) stretching the stored width."""

    transpose: bool = False
    flip_rows: bool = False
    flip_cols: bool = False
    sar: float = 1.0

    @classmethod
    def from_container(
        cls,
        matrix: list[int] | None = None,
        rotate_tag: str | None = None,
        sar=None,
        flips: bool = True,
    ) -> Orientation:
        """``matrix``: FFmpeg's display matrix (9 ints, row-major), which maps a stored pixel
        (column x, row y) to (a x + c y, b x + d y); ``rotate_tag``: degrees clockwise, used when
        there is no matrix; ``sar``: a number, a Fraction or None. ``flips=False``: the turn
        alone, as readers that take only the matrix's rotation angle (atan2(b, a)) apply it."""
        a, b, c, d = 1.0, 0.0, 0.0, 1.0
        if matrix is not None and len(matrix) == 9 and any(matrix[i] for i in (0, 1, 3, 4)):
            a, b, c, d = matrix[0], matrix[1], matrix[3], matrix[4]
        elif rotate_tag is not None:
            try:
                theta = math.radians(float(rotate_tag))
                a, b, c, d = math.cos(theta), math.sin(theta), -math.sin(theta), math.cos(theta)
            except ValueError:
                pass  # a tag that is no number is ignored
        if not flips:
            c, d = -b, a
        try:
            s = float(sar) if sar else 1.0
        except (TypeError, ValueError, ZeroDivisionError):
            s = 1.0
        s = s if math.isfinite(s) and 0.01 < s < 100 else 1.0
        if abs(a) + abs(d) >= abs(b) + abs(
            c
        ):  # 0 or 180 degrees (rounded to a quarter turn), flips
            return cls(False, d < 0, a < 0, s)
        return cls(True, b < 0, c < 0, s)  # a quarter turn: (x, y) -> (c y, b x)

    def apply(self, frames: np.ndarray) -> np.ndarray:
        """Stored frames (..., H, W, C) turned as shown: a view (the sample aspect ratio is left
        to the resize, longvideo.data.video.resize_crop)."""
        if self.transpose:
            frames = np.swapaxes(frames, -3, -2)
        if self.flip_rows:
            frames = frames[..., ::-1, :, :]
        return frames[..., ::-1, :] if self.flip_cols else frames

    def after(self, done: Orientation) -> Orientation:
        """What is left to apply to frames that another reader already turned by ``done``."""
        probe = np.arange(6).reshape(2, 3, 1)
        want = self.apply(probe)
        return next(
            o
            for t, r, c in itertools.product((False, True), repeat=3)
            if np.array_equal((o := Orientation(t, r, c, self.sar)).apply(done.apply(probe)), want)
        )

    def shown(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) a player shows for stored frames of width x height."""
        w = max(1, round(width * self.sar))
        return (height, w) if self.transpose else (w, height)


def display_matrix(frame) -> list[int] | None:
    """The display matrix a decoded PyAV frame carries as side data, or None."""
    for sd in getattr(frame, "side_data", ()):
        if getattr(sd.type, "name", "") == "DISPLAYMATRIX" and sd.buffer_size == 36:
            return list(struct.unpack("<9i", bytes(memoryview(sd))))
    return None


def stream_facts(container, stream, fps: float) -> tuple[float | None, str | None, object]:
    """(declared duration in seconds or None, legacy rotate tag or None, sample aspect ratio) of a
    PyAV stream: only headers that state a duration declare one (docs/data.md, "Damaged and
    partial videos")."""
    fmt = set(container.format.name.split(","))
    declared = None
    if "avi" in fmt:
        declared = stream.frames / fps if stream.frames else None
    elif fmt & {"matroska", "mov", "flv"}:
        if stream.duration and stream.time_base:
            declared = float(stream.duration * stream.time_base)
        elif (
            container.duration
        ):  # Matroska's header holds the end time, not the length (AV_TIME_BASE units)
            declared = (container.duration - (container.start_time or 0)) / 1e6
    tag = next((str(v) for k, v in stream.metadata.items() if k.lower() == "rotate"), None)
    return declared, tag, stream.sample_aspect_ratio


@dataclass(frozen=True)
class VideoInfo:
    """What a reader learnt from the container; width and height are what a player shows."""

    num_frames: int
    fps: float
    width: int
    height: int
    duration: float
    """Seconds of frames in the file (from its packets)."""
    declared: float | None = None
    """Seconds the container's header claims (None where it claims nothing)."""
    orientation: Orientation = Orientation()

    @classmethod
    def of_stored(cls, width: int, height: int, orientation: Orientation, **kw) -> VideoInfo:
        """The info of frames stored at width x height, shown as ``orientation`` says."""
        shown_w, shown_h = orientation.shown(width, height)
        return cls(width=shown_w, height=shown_h, orientation=orientation, **kw)


@dataclass
class ReadReport:
    """What a read kept: ``duration`` seconds could be read of the ``declared`` ones (the header's
    claim, or the packets' when decoding stopped short of them; None: nothing claimed), and
    ``gaps``, the (start, end) seconds lost inside the video to packets the decoder refused."""

    duration: float
    declared: float | None = None
    gaps: list[tuple[float, float]] = field(default_factory=list)
    fps: float = 0.0

    @property
    def truncated(self) -> bool:
        tol = max(TRUNCATED_TOLERANCE_S, 2.0 / self.fps if self.fps > 0 else 0.0)
        return self.declared is not None and self.declared - self.duration > tol

    @property
    def lost_seconds(self) -> float:
        return sum(b - a for a, b in self.gaps)

    @property
    def fraction(self) -> float:
        """Share of the video that was read: seconds kept (less the gaps) over those declared."""
        whole = max(self.declared or 0.0, self.duration) if self.truncated else self.duration
        return max(0.0, self.duration - self.lost_seconds) / whole if whole > 0 else 1.0

    def describe(self) -> str:
        """What was lost, in a few words ("" when nothing was)."""
        out = []
        if self.truncated:
            out.append(f"cut short: {self.duration:.1f} of {self.declared:.1f} s could be read")
        if self.gaps:
            out.append(
                f"{len(self.gaps)} gap(s) ({self.lost_seconds:.1f} s) lost to packets the decoder "
                "refused"
            )
        return "; ".join(out)


def frame_rate(stream) -> float:
    """A PyAV stream's frame rate (0.0 when it states none)."""
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    return float(rate) if rate else 0.0


def check_fps(fps: float, label: str) -> None:
    if not math.isfinite(fps) or fps <= 0:
        raise CorruptVideoError(f"bad frame rate {fps}", label)


def check_frame_size(width: int, height: int, max_resolution: int, label: str) -> None:
    if width <= 0 or height <= 0:
        raise CorruptVideoError(f"invalid frame size {width}x{height}", label)
    if max(width, height) > max_resolution:
        raise UnsupportedVideoError(
            f"frame size {width}x{height} exceeds max_resolution={max_resolution}", label
        )
