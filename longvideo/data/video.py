"""Reading videos: sample at a target fps, seek to the needed frames, resize and centre-crop.

    clip = read_video("talk.mp4", fps=1.0, max_frames=3600, size=256)
    clip.frames      # uint8 (T, 256, 256, 3)
    clip.timestamps  # float64 (T,), seconds from the start of the video

Sampling: the frame shown at t = 0, 1/fps, 2/fps, ... (t < duration) is taken; when that gives
more than ``max_frames`` frames, ``max_frames`` frames spread uniformly over the whole video are
taken instead. Only those frames are decoded: decord seeks to the keyframe before each one. decord
cannot open some files (broken container metadata, some codecs); PyAV reads those, seeking by
time. Inputs are untrusted, so decoding is bounded: frames larger than ``max_resolution`` on their
long side are refused, and at most ``max_frames`` (or :data:`HARD_MAX_FRAMES`) frames are returned.

Every failure raises a :class:`VideoError` subclass, which the pipeline counts and skips.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

VideoSource = Union[str, os.PathLike, bytes, bytearray, memoryview]

HARD_MAX_FRAMES = 1 << 16
"""Bound on frames returned when the caller sets no max_frames (about 18 hours at 1 fps)."""
DEFAULT_MAX_RESOLUTION = 4096
"""Longest frame side accepted by default (pixels)."""
_CHUNK_BYTES = 64 << 20  # decoded bytes per chunk before resizing


class VideoError(Exception):
    """A video could not be read. ``source`` names it (a path or '<bytes>')."""

    def __init__(self, message: str, source: str = "<bytes>"):
        self.source = source
        super().__init__(f"{source}: {message}")


class EmptyVideoError(VideoError):
    """Zero bytes, or a container that holds no frames."""


class CorruptVideoError(VideoError):
    """Neither decoder can read the data (truncated file, damaged stream, not a video)."""


class UnsupportedVideoError(VideoError):
    """Readable container but no decodable video stream, or a frame larger than allowed."""


@dataclass(frozen=True)
class VideoInfo:
    """What a reader learnt from the container."""

    num_frames: int
    fps: float
    width: int
    height: int
    duration: float


@dataclass
class VideoClip:
    """Sampled frames (uint8 (T, H, W, 3)), their times (float64 (T,), seconds), source fps and duration."""

    frames: torch.Tensor
    timestamps: torch.Tensor
    fps: float
    duration: float

    def __len__(self) -> int:
        return int(self.frames.shape[0])


# ----------------------------------------------------------------------------- sampling

def sample_indices(num_frames: int, src_fps: float, fps: Optional[float] = 1.0,
                   max_frames: Optional[int] = None) -> np.ndarray:
    """Frame indices (int64, increasing) to take from a video of ``num_frames`` at ``src_fps``.

    fps=None takes every frame. Target times t_k = k / fps map to the frame on screen at t_k,
    floor(t_k * src_fps). When more than ``max_frames`` result, the video is split into
    ``max_frames`` equal bins and the middle frame of each is taken (uniform fallback).
    """
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


# ----------------------------------------------------------------------------- resizing

def resize_crop(frames: torch.Tensor, size: Optional[int]) -> torch.Tensor:
    """Resize the short side to ``size`` (antialiased bilinear) and centre-crop to size x size.

    frames: uint8 (T, H, W, 3) -> uint8 (T, size, size, 3); size=None returns frames unchanged.
    """
    if size is None or frames.shape[0] == 0:
        return frames
    t, h, w, _ = frames.shape
    scale = size / min(h, w)
    nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
    if (nh, nw) != (h, w):
        x = frames.permute(0, 3, 1, 2).float()  # (T, 3, H, W)
        x = F.interpolate(x, size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)
        frames = x.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    top, left = (nh - size) // 2, (nw - size) // 2
    return frames[:, top: top + size, left: left + size].contiguous()


# ----------------------------------------------------------------------------- backends

def _label(src: VideoSource) -> str:
    return "<bytes>" if isinstance(src, (bytes, bytearray, memoryview)) else str(src)


def _check_frame_size(width: int, height: int, max_resolution: int, label: str) -> None:
    if width <= 0 or height <= 0:
        raise CorruptVideoError(f"invalid frame size {width}x{height}", label)
    if max(width, height) > max_resolution:
        raise UnsupportedVideoError(
            f"frame size {width}x{height} exceeds max_resolution={max_resolution}", label)


class _DecordBackend:
    name = "decord"

    def __init__(self, src: VideoSource, label: str, max_resolution: int):
        import decord

        f = io.BytesIO(bytes(src)) if isinstance(src, (bytes, bytearray, memoryview)) else str(src)
        try:
            self.vr = decord.VideoReader(f, ctx=decord.cpu(0), num_threads=0)  # 0: FFmpeg picks (2x faster here)
            n, fps = len(self.vr), float(self.vr.get_avg_fps())
            h, w = self.vr[0].shape[:2] if n > 0 else (0, 0)
        except Exception as e:  # decord raises RuntimeError/DECORDError for anything it cannot open
            raise CorruptVideoError(f"decord cannot open it: {str(e).splitlines()[0][:200]}", label) from e
        if n <= 0:  # decord trusts the header's count; PyAV may still find frames
            raise CorruptVideoError("decord finds no frames", label)
        if not math.isfinite(fps) or fps <= 0:
            raise CorruptVideoError(f"bad frame rate {fps}", label)
        _check_frame_size(w, h, max_resolution, label)
        self.vr.seek(0)
        self.info = VideoInfo(num_frames=n, fps=fps, width=w, height=h, duration=n / fps)

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """uint8 (t, H, W, 3) frames and float64 (t,) start times of ``indices``."""
        frames = self.vr.get_batch(indices.tolist()).asnumpy()
        times = np.asarray(self.vr.get_frame_timestamp(indices.tolist()), np.float64).reshape(-1, 2)[:, 0]
        return frames, times


class _PyAVBackend:
    name = "pyav"

    def __init__(self, src: VideoSource, label: str, max_resolution: int):
        import av

        self._av = av
        self.label = label
        data = bytes(src) if isinstance(src, (bytes, bytearray, memoryview)) else None
        self._file = (lambda: io.BytesIO(data)) if data is not None else (lambda: str(src))
        self._seekable = True
        try:
            self.container = av.open(self._file(), mode="r")
        except Exception as e:
            raise CorruptVideoError(f"PyAV cannot open it: {str(e)[:200]}", label) from e
        if not self.container.streams.video:
            raise UnsupportedVideoError("no video stream", label)
        self.stream = s = self.container.streams.video[0]
        s.thread_type = "AUTO"
        w, h = s.codec_context.width, s.codec_context.height
        _check_frame_size(w, h, max_resolution, label)
        rate = s.average_rate or s.guessed_rate or s.base_rate
        fps = float(rate) if rate else 0.0
        if not math.isfinite(fps) or fps <= 0:
            raise CorruptVideoError(f"bad frame rate {rate}", label)
        self.start = float(s.start_time * s.time_base) if s.start_time is not None and s.time_base else 0.0
        # one pass over the packets (demuxing, no decoding) gives the exact frame count, the duration
        # and the keyframe times, so reads can seek exactly when a keyframe lies ahead
        n, duration, keys = self._scan()
        self.container.close()
        self.container = av.open(self._file(), mode="r")
        self.stream = self.container.streams.video[0]
        self.stream.thread_type = "AUTO"
        if n <= 0:
            raise EmptyVideoError("no frames", label)
        self.info = VideoInfo(num_frames=n, fps=fps, width=w, height=h,
                              duration=duration if duration > 0 else n / fps)
        self._keys = keys  # sorted keyframe times (seconds from the start)
        self._frames = None  # the live decode iterator
        self._last = None  # (time, frame) of the newest decoded frame
        self._end = None  # time of the last frame, once the stream has ended

    def _scan(self) -> tuple[int, float, np.ndarray]:
        """Frame count, duration and keyframe times from the packets."""
        count, end, keys = 0, 0.0, []
        try:
            for packet in self.container.demux(self.stream):
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
        return count, end, np.asarray(sorted(keys), np.float64)

    def _reopen(self) -> None:
        """Decode from the first frame (after a seek failed, or when seeking is off)."""
        self.container.close()
        self.container = self._av.open(self._file(), mode="r")
        self.stream = self.container.streams.video[0]
        self.stream.thread_type = "AUTO"
        self._frames = self.container.decode(self.stream)
        self._last = None

    def _restart(self, t: float) -> bool:
        """Position the decoder before time t (seconds from the start). Returns whether it sought."""
        if not self._seekable:
            if self._frames is None or (self._last is not None and self._last[0] > t + 0.5 / self.info.fps):
                self._reopen()  # streams that cannot seek are decoded from the start
            return False
        self.container.seek(int((t + self.start) / self.stream.time_base), stream=self.stream,
                            backward=True, any_frame=False)
        self._frames = self.container.decode(self.stream)
        self._last = None
        return True

    def _next(self):
        """The next decoded (time, frame), or None at the end of the stream."""
        try:
            frame = next(self._frames)
        except StopIteration:
            self._frames = None
            return None
        except Exception as e:
            raise CorruptVideoError(f"PyAV decode failed: {str(e)[:200]}", self.label) from e
        ft = float(frame.time if frame.time is not None else 0.0) - self.start
        return ft, frame

    def _keyframe_ahead(self, limit: float) -> bool:
        """Whether a keyframe lies after the newest decoded frame and at or before ``limit``."""
        j = int(np.searchsorted(self._keys, limit, side="right")) - 1
        return j >= 0 and self._keys[j] > self._last[0]

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """uint8 (t, H, W, 3) frames and float64 (t,) times of ``indices`` (t < len when the stream ends early)."""
        fps = self.info.fps
        out, times = [], []
        for i in indices.tolist():
            target = i / fps
            if self._end is not None and target > self._end + 1.0 / fps:
                break  # past the last frame that exists (the header over-counted)
            limit = target + 0.5 / fps  # tolerance for rounded timestamps
            # decode forward unless a keyframe lies between here and the target (or the target is behind)
            sought = False
            if self._frames is None or self._last is None or self._last[0] > limit \
                    or self._keyframe_ahead(limit):
                sought = self._restart(target)
            picked = self._last if self._last is not None and self._last[0] <= limit else None
            while True:
                nxt = self._next()
                if nxt is None and sought and picked is None and self._last is None:
                    # some containers (e.g. MPEG-TS without an index) cannot seek: decode linearly
                    self._seekable, sought = False, False
                    self._reopen()
                    continue
                if nxt is None:
                    self._end = picked[0] if picked is not None else target
                    break
                self._last = nxt
                if nxt[0] > limit and sought and picked is None:
                    # the seek overshot (imprecise index, e.g. MPEG-TS): decode linearly instead
                    self._seekable, sought = False, False
                    self._reopen()
                    continue
                sought = False
                if nxt[0] > limit:
                    break  # one frame too far: it stays as the newest decoded frame
                picked = nxt
            if picked is None:
                picked = self._last  # the seek landed after the target: the next frame is on screen
            if picked is None:
                break
            out.append(picked[1].to_ndarray(format="rgb24"))
            times.append(picked[0])
        if not out:
            return np.zeros((0, self.info.height, self.info.width, 3), np.uint8), np.zeros(0)
        return np.stack(out), np.asarray(times, np.float64)

    def close(self) -> None:
        self.container.close()


# ----------------------------------------------------------------------------- public API

def probe_video(src: VideoSource, *, max_resolution: int = DEFAULT_MAX_RESOLUTION) -> VideoInfo:
    """Frame count, fps, size and duration, without decoding frames."""
    reader = _open(src, _label(src), max_resolution)
    if hasattr(reader, "close"):
        reader.close()
    return reader.info


def _is_mpegts(src: VideoSource) -> bool:
    """MPEG-TS files start with 0x47 sync bytes every 188 bytes."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        head = bytes(src[:377])
    else:
        with open(src, "rb") as f:
            head = f.read(377)
    return len(head) == 377 and head[0] == head[188] == head[376] == 0x47


def _open(src: VideoSource, label: str, max_resolution: int, backend: str = "auto"):
    if isinstance(src, (bytes, bytearray, memoryview)):
        if len(src) == 0:
            raise EmptyVideoError("zero bytes", label)
    elif not os.path.isfile(src):
        raise VideoError("no such file", label)
    elif os.path.getsize(src) == 0:
        raise EmptyVideoError("zero bytes", label)
    if backend not in ("auto", "decord", "pyav"):
        raise ValueError(f"backend must be auto, decord or pyav, got {backend!r}")
    if backend == "auto" and _is_mpegts(src):
        backend = "pyav"  # decord returns frames shifted by one GOP on MPEG-TS (seen with decord 0.6)
    errors: list[VideoError] = []
    for cls in ((_DecordBackend, _PyAVBackend) if backend == "auto"
                else (_DecordBackend,) if backend == "decord" else (_PyAVBackend,)):
        try:
            return cls(src, label, max_resolution)
        except (UnsupportedVideoError, EmptyVideoError):
            raise  # the other decoder would not change these verdicts
        except VideoError as e:
            errors.append(e)
    raise errors[-1] if len(errors) == 1 else CorruptVideoError(
        "; ".join(str(e).split(": ", 1)[-1] for e in errors), label)


def _chunks(reader, src: VideoSource, label: str, *, fps, max_frames, size, max_resolution,
            chunk_frames, backend) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    info = reader.info
    indices = sample_indices(info.num_frames, info.fps, fps, max_frames)
    if chunk_frames is None:
        chunk_frames = max(1, min(256, _CHUNK_BYTES // (info.width * info.height * 3)))
    done = 0
    try:
        while done < len(indices):
            want = indices[done: done + chunk_frames]
            try:
                frames, times = reader.read(want)
            except VideoError:
                raise
            except Exception as e:
                if reader.name != "decord" or backend == "decord":
                    raise CorruptVideoError(f"{reader.name} decode failed: {str(e)[:200]}", label) from e
                reader = _open(src, label, max_resolution, "pyav")  # decord failed mid-stream
                continue
            if len(frames) == 0:
                break
            done += len(want)
            yield resize_crop(torch.from_numpy(frames), size), torch.from_numpy(times)
            if len(frames) < len(want):
                break  # the stream ended before the header said it would
    finally:
        if hasattr(reader, "close"):
            reader.close()


def iter_video(src: VideoSource, *, fps: Optional[float] = 1.0, max_frames: Optional[int] = None,
               size: Optional[int] = None, max_resolution: int = DEFAULT_MAX_RESOLUTION,
               chunk_frames: Optional[int] = None, backend: str = "auto",
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Stream the sampled frames as chunks ``(frames uint8 (t, H, W, 3), timestamps float64 (t,))``.

    Decoding memory is bounded by the chunk size (about 64 MiB of raw frames by default). When
    decord fails part-way, the remaining frames are read with PyAV. See :func:`read_video`.
    """
    label = _label(src)
    reader = _open(src, label, max_resolution, backend)
    yield from _chunks(reader, src, label, fps=fps, max_frames=max_frames, size=size,
                       max_resolution=max_resolution, chunk_frames=chunk_frames, backend=backend)


def read_video(src: VideoSource, *, fps: Optional[float] = 1.0, max_frames: Optional[int] = None,
               size: Optional[int] = None, max_resolution: int = DEFAULT_MAX_RESOLUTION,
               backend: str = "auto") -> VideoClip:
    """Decode the frames sampled at ``fps`` (None: all), capped at ``max_frames``, resized to ``size``.

    src: a path or the bytes of a video file (mp4, avi, webm, mkv, mov, ...).
    Returns a :class:`VideoClip` with frames uint8 (T, H, W, 3) (H = W = size when size is given)
    and timestamps float64 (T,). Raises :class:`VideoError` (a subclass) when the video is empty,
    corrupt, truncated, unsupported or larger than ``max_resolution``. ``backend``: auto (decord,
    PyAV when decord fails), decord or pyav.
    """
    label = _label(src)
    reader = _open(src, label, max_resolution, backend)
    info = reader.info
    chunks, stamps = [], []
    for frames, times in _chunks(reader, src, label, fps=fps, max_frames=max_frames, size=size,
                                 max_resolution=max_resolution, chunk_frames=None, backend=backend):
        chunks.append(frames)
        stamps.append(times)
    if not chunks:
        raise EmptyVideoError("no frame could be decoded", label)
    return VideoClip(frames=torch.cat(chunks), timestamps=torch.cat(stamps), fps=info.fps,
                     duration=info.duration)
