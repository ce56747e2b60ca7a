"""Reading videos: sample at a target fps, seek to the needed frames, orient, resize and centre-crop.

    clip = read_video("talk.mp4", fps=1.0, max_frames=3600, size=256)
    clip.frames      # uint8 (T, 256, 256, 3), as a player shows them
    clip.timestamps  # float64 (T,), seconds from the start of the video
    clip.report      # what was kept: seconds read of those declared, gaps lost to bad packets

Sampling, seeking, orientation, damaged and partial videos, and the backends (PyAV in this process;
decord only in a child process, longvideo.data.isolate): docs/data.md, "Reading video". Inputs are
untrusted: decoding is bounded by ``max_resolution`` and ``max_frames`` (docs/data.md, "Errors and
bounds") and every failure raises a :class:`VideoError` subclass, counted under its ``reason``.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import av
import numpy as np
import torch
import torch.nn.functional as F

from longvideo.data.containers import SafeInput
from longvideo.data.isolate import IsolatedDecordBackend
from longvideo.data.video_base import (  # noqa: F401 (VIDEO_EXTS and the errors: re-exported public names)
    VIDEO_EXTS,
    CorruptVideoError,
    DisallowedContainerError,
    EmptyVideoError,
    Orientation,
    ReadReport,
    UnsupportedVideoError,
    VideoError,
    VideoInfo,
    VideoSource,
    check_fps,
    check_frame_size,
    display_matrix,
    frame_rate,
    stream_facts,
)

HARD_MAX_FRAMES = 1 << 16
"""Bound on frames returned when the caller sets no max_frames (about 18 hours at 1 fps)."""
DEFAULT_MAX_RESOLUTION = 4096
"""Longest frame side accepted by default (pixels)."""
_CHUNK_BYTES = 2 << 20
"""Decoded bytes per chunk; with malloc_trim after each, memory stays flat (docs/data.md, "Memory")."""

try:  # glibc's malloc_trim (absent elsewhere, where nothing is done)
    _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
except Exception:  # noqa: BLE001 - no C library that has it
    _MALLOC_TRIM = None

BACKENDS: tuple[str, ...] = ("auto", "pyav", "decord")
"""auto = pyav (in this process); decord runs in a child process (longvideo.data.isolate)."""


@dataclass
class VideoClip:
    """Sampled frames (uint8 (T, H, W, 3)), their times (float64 (T,), seconds), source fps and
    duration (seconds read), and the read's report (declared duration, gaps)."""

    frames: torch.Tensor
    timestamps: torch.Tensor
    fps: float
    duration: float
    report: ReadReport

    def __len__(self) -> int:
        return int(self.frames.shape[0])


def sample_indices(
    num_frames: int, src_fps: float, fps: float | None = 1.0, max_frames: int | None = None
) -> np.ndarray:
    """Frame indices (int64, increasing) to take from a video of ``num_frames`` at ``src_fps``: the
    frame on screen at t_k = k / fps (fps=None: every frame), or, when more than ``max_frames``
    result, the middle frame of each of ``max_frames`` equal bins (docs/data.md, "Reading video")."""
    if num_frames <= 0:
        return np.zeros(0, np.int64)
    cap = HARD_MAX_FRAMES if max_frames is None else min(int(max_frames), HARD_MAX_FRAMES)
    if cap <= 0:
        raise ValueError(f"max_frames must be positive, got {max_frames}")
    if fps is None or fps >= src_fps:
        idx = np.arange(num_frames, dtype=np.int64)
    else:
        duration = num_frames / src_fps
        count = int(math.ceil(duration * fps - 1e-9))
        # a small epsilon keeps exact grid points (t*src_fps integral) from rounding down a frame
        idx = np.floor(np.arange(count, dtype=np.float64) / fps * src_fps + 1e-6).astype(np.int64)
        idx = np.unique(np.clip(idx, 0, num_frames - 1))
    if len(idx) > cap:
        idx = np.floor((np.arange(cap, dtype=np.float64) + 0.5) * num_frames / cap).astype(np.int64)
        idx = np.clip(idx, 0, num_frames - 1)
    return idx


def resize_crop(
    frames: torch.Tensor, size: int | None, shown: tuple[int, int] | None = None
) -> torch.Tensor:
    """Resize the short side to ``size`` (antialiased bilinear) and centre-crop to size x size.

    frames: uint8 (T, H, W, 3) -> uint8 (T, size, size, 3). ``shown``: the (height, width) the
    frames are shown at, when their pixels are not square (a sample aspect ratio), applied in the
    same resize; size=None returns the frames at that size (unchanged by default).
    """
    t, h, w, _ = frames.shape
    sh, sw = shown or (h, w)
    if t == 0 or (size is None and (sh, sw) == (h, w)):
        return frames.contiguous()
    scale = 1.0 if size is None else size / min(sh, sw)
    nh, nw = max(size or 1, round(sh * scale)), max(size or 1, round(sw * scale))
    if (nh, nw) != (h, w):
        x = frames.permute(0, 3, 1, 2).float()  # (T, 3, H, W)
        x = F.interpolate(x, size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)
        frames = x.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    top, left = ((nh - size) // 2, (nw - size) // 2) if size else (0, 0)
    return frames[:, top : top + (size or nh), left : left + (size or nw)].contiguous()


_GAP = "gap"  # stands for the frame before a frame decoded right after a loss


class _PyAVBackend:
    """Reader over PyAV. State between reads: the live decode run (``_frames``), its two newest
    frames (``_prev``, ``_last``; ``_prev`` None when ``_last`` is the run's first, ``_GAP`` when
    packets were lost before it) and the keyframe the run started from (``_run_key``)."""

    name = "pyav"

    def __init__(self, src: VideoSource, label: str, max_resolution: int):
        self.label = label
        self._src = bytes(src) if isinstance(src, (bytes, bytearray, memoryview)) else src
        self._input: SafeInput | None = None
        self._seekable = True
        # FFmpeg refuses larger frames before allocating them (docs/data.md, "What crashes decord")
        self._options = {"max_pixels": str(max_resolution * max_resolution)}
        self.container = None
        try:
            self._open_container()
            s = self.stream
            ctx = s.codec_context
            if ctx is None:
                codec = s.codec_tag or "unknown codec"
                raise UnsupportedVideoError(f"no decoder for the video stream ({codec})", label)
            w, h = ctx.width, ctx.height
            if w <= 0 or h <= 0:
                raise CorruptVideoError(
                    "no frame size: a damaged header, or frames over max_resolution^2 "
                    "pixels that FFmpeg refused to allocate",
                    label,
                )
            check_frame_size(w, h, max_resolution, label)
            fps = frame_rate(s)
            check_fps(fps, label)
            has_start = s.start_time is not None and s.time_base
            self.start = float(s.start_time * s.time_base) if has_start else 0.0
            n, duration, keys, matrix = self._scan()
            declared, tag, sar = stream_facts(self.container, s, fps)
            self._input.close()
            self._open_container()
        except VideoError:
            self.close()
            raise
        except Exception as e:  # anything else PyAV raises on damaged input is a corrupt video too
            self.close()
            raise CorruptVideoError(
                f"PyAV cannot read it: {type(e).__name__}: {str(e)[:200]}", label
            ) from e
        if n <= 0:
            self.close()
            raise EmptyVideoError("no frames", label)
        self.stored = (h, w)
        self.info = VideoInfo.of_stored(
            w,
            h,
            Orientation.from_container(matrix, tag, sar),
            num_frames=n,
            fps=fps,
            duration=duration if duration > 0 else n / fps,
            declared=declared,
        )
        self._keys = keys  # sorted keyframe times (seconds from the start)
        self._frames = None
        self._prev = self._last = None
        self._run_key = None
        self._lost = None  # time of a packet the decoder refused, until the next frame decodes
        self.end = None  # time of the last frame, once the decoder reached the end of the stream
        self.exhausted = False  # no later frame can be read
        self.gaps: list[tuple[float, float]] = []

    def _open_container(self) -> None:
        # only allowed containers, no protocol: longvideo.data.containers
        self._input = None  # until the open below succeeds
        self._input = SafeInput(self._src, self.label, self._options)
        self.container = self._input.container
        if not self.container.streams.video:
            raise UnsupportedVideoError("no video stream", self.label)
        self.stream = self.container.streams.video[0]
        # slice threads only: frame threads report a refused packet frames late (docs/data.md,
        # "Damaged and partial videos")
        self.stream.thread_type = "SLICE"
        if self.stream.codec_context is not None:
            self.stream.codec_context.options = dict(self._options)

    def _scan(self) -> tuple[int, float, np.ndarray, list[int] | None]:
        """Frame count, duration and keyframe times from one pass over the packets (demuxing only),
        and the display matrix, which travels on decoded frames: the first is decoded for it."""
        count, end, keys, matrix, probe = 0, 0.0, [], None, 64
        try:
            for packet in self.container.demux(self.stream):
                if probe:
                    probe -= 1
                    try:
                        for f in packet.decode():
                            matrix, probe = display_matrix(f), 0
                            break
                    except av.FFmpegError:
                        pass
                if packet.size == 0 or packet.pts is None:
                    continue
                count += 1
                if count > HARD_MAX_FRAMES * 1000:
                    raise UnsupportedVideoError("too many frames", self.label)
                t = float(packet.pts * packet.time_base) - self.start
                if packet.is_keyframe:
                    keys.append(t)
                end = max(end, t + float((packet.duration or 0) * packet.time_base))
        except VideoError:
            raise
        except Exception as e:
            raise CorruptVideoError(f"PyAV cannot demux it: {str(e)[:200]}", self.label) from e
        return count, end, np.asarray(sorted(keys), np.float64), matrix

    def _decode(self, wait_key: bool) -> Iterator[tuple[float, object]]:
        """(time, frame) from the demuxer's position on. Packets before the first keyframe are
        skipped when ``wait_key`` (after a seek); a packet the decoder refuses is noted in
        ``_lost`` and decoding resumes at the next keyframe; a container that cannot be demuxed
        further ends the stream there (what the decoder holds is flushed)."""
        wait_key, t, cut = wait_key and len(self._keys) > 0, None, False
        packets = self.container.demux(self.stream)
        while True:
            try:
                packet = next(packets, None)
            except av.FFmpegError:
                packet, cut = None, True
            if packet is not None and wait_key and packet.size and not packet.is_keyframe:
                continue
            try:
                frames = (
                    packet.decode()
                    if packet is not None
                    else self.stream.codec_context.decode(None)
                )
            except av.FFmpegError:
                if packet is None:
                    return
                if self._lost is None:
                    pts = packet.pts
                    self._lost = (
                        float(pts * packet.time_base) - self.start if pts is not None else t or 0.0
                    )
                wait_key = len(self._keys) > 0
                continue
            wait_key = wait_key and not (packet is not None and packet.size)
            for f in frames:
                t = (
                    float(f.time) - self.start
                    if f.time is not None
                    else (t or 0.0) + 1.0 / self.info.fps
                )
                yield t, f
            if packet is None:
                if cut:
                    self._lost = t or 0.0
                return

    def _next(self):
        """The run's next (time, frame), noting a gap when packets were lost before it; None at the end."""
        nxt = next(self._frames, None)
        if nxt is None:
            self._frames = None
            return None
        if self._lost is not None:
            gap = (self._last[0] if self._last is not None else self._lost, nxt[0])
            if not any(a <= gap[0] < b or a < gap[1] <= b for a, b in self.gaps):  # not met before
                self.gaps.append(gap)
            self._lost, self._prev = None, _GAP
        else:
            self._prev = self._last
        self._last = nxt
        return nxt

    def _seek(self, t: float) -> None:
        self.container.seek(
            round((t + self.start) / self.stream.time_base),
            stream=self.stream,
            backward=True,
            any_frame=False,
        )

    def _key_before(self, limit: float) -> int:
        """Index of the last keyframe at or before ``limit`` (-1: none)."""
        return int(np.searchsorted(self._keys, limit, side="right")) - 1

    def _position(self, limit: float) -> None:
        """Start a run that reaches ``limit``: at the keyframe before it, else the keyframe before
        that, else (an index that lands on data the decoder refuses) on from the last keyframe that
        worked, or the file's first frame. A seek that lands past the target (MPEG-TS's imprecise
        index) turns seeking off."""
        j = self._key_before(limit)
        for key in self._keys[max(j - 1, 0) : j + 1][::-1] if self._seekable and j >= 0 else ():
            self._seek(key)
            self._frames, self._lost, self._prev = self._decode(wait_key=True), None, None
            first = next(self._frames, None)
            if first is not None and self._lost is None and first[0] <= limit:
                self._last, self._run_key = first, key
                return
            if first is not None and self._lost is None:
                self._seekable = False  # overshot: decode linearly from here on
                break
        key = self._run_key if self._seekable else None
        if key is None:
            self._input.close()
            self._open_container()
        else:
            self._seek(key)
        self._frames, self._run_key = self._decode(wait_key=key is not None), key
        self._prev = self._last = self._lost = None

    def _keyframe_ahead(self, limit: float) -> bool:
        """Whether a keyframe lies after the newest decoded frame and at or before ``limit``."""
        j = self._key_before(limit)
        return j >= 0 and self._keys[j] > self._last[0]

    def _frame_at(self, target: float, limit: float):
        """The (time, frame) on screen at ``target`` (the newest at or before ``limit``), or None
        when it was lost in a gap."""
        if any(a + 1.0 / self.info.fps <= limit < b for a, b in self.gaps):
            return None  # known lost: not decoded again
        prev = self._prev if self._prev is not _GAP else None
        prev_fits = prev is not None and prev[0] <= limit
        behind = self._last is not None and self._last[0] > limit and not prev_fits
        # no frame yet means no run either (a call ends with the run done or past ``limit``)
        if (
            self._last is None
            or behind
            or (self._frames is not None and self._seekable and self._keyframe_ahead(limit))
        ):
            self._position(limit)
        while self._frames is not None and (self._last is None or self._last[0] <= limit):
            self._next()
        last, prev = self._last, self._prev
        if self._frames is None:
            self.end = last[0] if last is not None else target
        if last is None:
            return None
        if last[0] <= limit or prev is None:
            return last  # or the run's first frame, just after the target: the one on screen
        return prev if prev is not _GAP and prev[0] <= limit else None

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stored uint8 (t, H, W, 3) frames and float64 (t,) times of ``indices``: fewer when the
        stream ends early (then ``exhausted``) or a target's frame was lost (then in ``gaps``)."""
        fps, (h, w) = self.info.fps, self.stored
        out, times = [], []
        for i in indices.tolist():
            target = i / fps
            if self.end is not None and target > self.end + 1.0 / fps:
                self.exhausted = True  # past the last frame that exists (or that decodes)
                break
            got = self._frame_at(target, target + 0.5 / fps)
            if got is not None:
                f = got[1]  # a stream may change size mid-way: frames keep the first size
                out.append(
                    f.to_ndarray(format="rgb24")
                    if (f.height, f.width) == (h, w)
                    else f.to_ndarray(format="rgb24", width=w, height=h)
                )
                times.append(got[0])
        if not out:
            return np.zeros((0, h, w, 3), np.uint8), np.zeros(0)
        return np.stack(out), np.asarray(times, np.float64)

    def close(self) -> None:
        if self._input is not None:
            self._input.close()
            self._input = None


def _open(src: VideoSource, max_resolution: int, backend: str = "auto"):
    """A reader of ``src`` (labelled '<bytes>' or the path); a missing or empty source raises."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    is_bytes = isinstance(src, (bytes, bytearray, memoryview))
    label = "<bytes>" if is_bytes else str(src)
    if is_bytes:
        if len(src) == 0:
            raise EmptyVideoError("zero bytes", label)
    elif not os.path.isfile(src):
        raise VideoError("no such file", label)
    elif os.path.getsize(src) == 0:
        raise EmptyVideoError("zero bytes", label)
    if backend == "decord":
        return IsolatedDecordBackend(src, label, max_resolution)
    return _PyAVBackend(src, label, max_resolution)


def probe_video(
    src: VideoSource, *, max_resolution: int = DEFAULT_MAX_RESOLUTION, backend: str = "auto"
) -> VideoInfo:
    """Frame count, fps, displayed size, duration (read and declared) and orientation, without
    decoding frames (beyond the first)."""
    reader = _open(src, max_resolution, backend)
    reader.close()
    return reader.info


class VideoChunks:
    """``iter_video(src, ...)``: the sampled frames as chunks ``(frames uint8 (t, H, W, 3), timestamps
    float64 (t,))``, oriented and resized as :func:`read_video` returns them, about 2 MiB of decoded
    frames each (``chunk_frames`` to choose). ``info`` once opened; ``report`` (:class:`ReadReport`)
    once iterated to the end."""

    def __init__(
        self,
        src: VideoSource,
        *,
        fps: float | None = 1.0,
        max_frames: int | None = None,
        size: int | None = None,
        max_resolution: int = DEFAULT_MAX_RESOLUTION,
        chunk_frames: int | None = None,
        backend: str = "auto",
    ):
        self._reader = _open(src, max_resolution, backend)
        self.label, self.info = self._reader.label, self._reader.info
        self._indices = sample_indices(self.info.num_frames, self.info.fps, fps, max_frames)
        h, w = self._reader.stored
        self._chunk = chunk_frames or max(1, min(256, _CHUNK_BYTES // (w * h * 3)))
        self._size = size
        self.report: ReadReport | None = None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        reader, info, o = self._reader, self.info, self.info.orientation
        read = 0
        try:
            for start in range(0, len(self._indices), self._chunk):
                try:
                    frames, times = reader.read(self._indices[start : start + self._chunk])
                except VideoError:
                    raise
                except Exception as e:
                    why = f"{type(e).__name__}: {str(e)[:200]}"
                    raise CorruptVideoError(
                        f"{reader.name} decode failed: {why}", self.label
                    ) from e
                read += len(frames)
                if len(frames):
                    shown = torch.from_numpy(np.ascontiguousarray(o.apply(frames)))
                    yield (
                        resize_crop(shown, self._size, (info.height, info.width)),
                        torch.from_numpy(times),
                    )
                    del frames, shown
                    if _MALLOC_TRIM is not None:
                        _MALLOC_TRIM(0)
                if reader.exhausted:
                    break
            if not read:
                raise CorruptVideoError("no frame could be decoded", self.label)
            duration, declared = info.duration, info.declared
            if reader.end is not None and reader.end + 1.0 / info.fps < duration:
                # the decoder stopped before the packets did: the packets' duration was claimed
                declared, duration = max(declared or 0.0, duration), reader.end + 1.0 / info.fps
            self.report = ReadReport(
                duration=duration, declared=declared, gaps=list(reader.gaps), fps=info.fps
            )
        finally:
            reader.close()


iter_video = VideoChunks


def read_video(
    src: VideoSource,
    *,
    fps: float | None = 1.0,
    max_frames: int | None = None,
    size: int | None = None,
    max_resolution: int = DEFAULT_MAX_RESOLUTION,
    backend: str = "auto",
) -> VideoClip:
    """The frames sampled at ``fps`` (None: all), capped at ``max_frames``, resized to ``size``, as a
    player shows them; what cannot be read raises a VideoError (docs/data.md, "Errors and bounds")."""
    chunks = iter_video(
        src,
        fps=fps,
        max_frames=max_frames,
        size=size,
        max_resolution=max_resolution,
        backend=backend,
    )
    parts = list(chunks)
    return VideoClip(
        frames=torch.cat([p[0] for p in parts]),
        timestamps=torch.cat([p[1] for p in parts]),
        fps=chunks.info.fps,
        duration=chunks.report.duration,
        report=chunks.report,
    )
