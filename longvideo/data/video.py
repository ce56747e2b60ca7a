"""Reading videos: sample at a target fps, seek to the needed frames, resize and centre-crop.

    clip = read_video("talk.mp4", fps=1.0, max_frames=3600, size=256)
    clip.frames      # uint8 (T, 256, 256, 3)
    clip.timestamps  # float64 (T,), seconds from the start of the video

Sampling: the frame shown at t = 0, 1/fps, 2/fps, ... (t < duration) is taken; when that gives
more than ``max_frames`` frames, ``max_frames`` frames spread uniformly over the whole video are
taken instead. Only those frames are decoded, from the keyframe before each one.

Backends: PyAV (the default, ``backend="auto"`` or ``"pyav"``), in this process: it demuxes the
file once to learn the exact frame count and keyframe times, then seeks only where a keyframe lies
ahead. decord (``backend="decord"``) only runs in a child process
(:mod:`longvideo.data.isolate`): decord 0.6 crashes the interpreter on some damaged files, and
there a crash or hang costs one sample (:class:`DecoderCrashError`), not the process.

Inputs are untrusted, so decoding is bounded: FFmpeg refuses frames of more than
``max_resolution``^2 pixels before allocating them, frames larger than ``max_resolution`` on their
long side are refused, and at most ``max_frames`` (or :data:`HARD_MAX_FRAMES`) frames are
returned. Every failure raises a :class:`VideoError` subclass, which the pipeline counts under its
``reason`` and skips.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F

from longvideo.data.isolate import IsolatedDecordBackend
from longvideo.data.video_base import (VIDEO_EXTS, CorruptVideoError, EmptyVideoError,  # noqa: F401 (re-exported:
                                      UnsupportedVideoError, VideoError, VideoInfo,  # the reader's public names)
                                      VideoSource, check_frame_size)

HARD_MAX_FRAMES = 1 << 16
"""Bound on frames returned when the caller sets no max_frames (about 18 hours at 1 fps)."""
DEFAULT_MAX_RESOLUTION = 4096
"""Longest frame side accepted by default (pixels)."""
_CHUNK_BYTES = 64 << 20  # decoded bytes per chunk before resizing

BACKENDS: tuple[str, ...] = ("auto", "pyav", "decord")
"""auto = pyav (in this process); decord runs in a child process (longvideo.data.isolate)."""


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


class _PyAVBackend:
    name = "pyav"

    def __init__(self, src: VideoSource, label: str, max_resolution: int):
        import av

        self._av = av
        self.label = label
        data = bytes(src) if isinstance(src, (bytes, bytearray, memoryview)) else None
        self._file = (lambda: io.BytesIO(data)) if data is not None else (lambda: str(src))
        self._seekable = True
        # FFmpeg refuses larger frames before allocating them (a damaged header can declare
        # 15000 x 15000 for a codec that takes its size from the container, e.g. MS-MPEG4 in AVI)
        self._options = {"max_pixels": str(max_resolution * max_resolution)}
        self.container = None
        try:
            self._open_container()
            s = self.stream
            ctx = s.codec_context
            if ctx is None:
                raise UnsupportedVideoError(f"no decoder for the video stream ({s.codec_tag or 'unknown codec'})",
                                            label)
            w, h = ctx.width, ctx.height
            if w <= 0 or h <= 0:
                raise CorruptVideoError("no frame size: a damaged header, or frames over max_resolution^2 pixels "
                                        "that FFmpeg refused to allocate", label)
            check_frame_size(w, h, max_resolution, label)
            rate = s.average_rate or s.guessed_rate or s.base_rate
            fps = float(rate) if rate else 0.0
            if not math.isfinite(fps) or fps <= 0:
                raise CorruptVideoError(f"bad frame rate {rate}", label)
            self.start = float(s.start_time * s.time_base) if s.start_time is not None and s.time_base else 0.0
            # one pass over the packets (demuxing, no decoding) gives the exact frame count, the
            # duration and the keyframe times, so reads can seek exactly when a keyframe lies ahead
            n, duration, keys = self._scan()
            self.container.close()
            self._open_container()
        except VideoError:
            self.close()
            raise
        except Exception as e:  # anything else PyAV raises on damaged input is a corrupt video too
            self.close()
            raise CorruptVideoError(f"PyAV cannot read it: {type(e).__name__}: {str(e)[:200]}", label) from e
        if n <= 0:
            self.close()
            raise EmptyVideoError("no frames", label)
        self.info = VideoInfo(num_frames=n, fps=fps, width=w, height=h,
                              duration=duration if duration > 0 else n / fps)
        self._keys = keys  # sorted keyframe times (seconds from the start)
        self._frames = None  # the live decode iterator
        self._last = None  # (time, frame) of the newest decoded frame
        self._end = None  # time of the last frame, once the stream has ended

    def _open_container(self) -> None:
        try:
            self.container = self._av.open(self._file(), mode="r", options=self._options)
        except Exception as e:
            raise CorruptVideoError(f"PyAV cannot open it: {str(e)[:200]}", self.label) from e
        if not self.container.streams.video:
            raise UnsupportedVideoError("no video stream", self.label)
        self.stream = self.container.streams.video[0]
        self.stream.thread_type = "AUTO"
        if self.stream.codec_context is not None:
            self.stream.codec_context.options = dict(self._options)

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
        self._open_container()
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
        if self.container is not None:
            self.container.close()


# ----------------------------------------------------------------------------- public API

def probe_video(src: VideoSource, *, max_resolution: int = DEFAULT_MAX_RESOLUTION,
                backend: str = "auto") -> VideoInfo:
    """Frame count, fps, size and duration, without decoding frames (beyond what opening takes)."""
    reader = _open(src, _label(src), max_resolution, backend)
    reader.close()
    return reader.info


def _open(src: VideoSource, label: str, max_resolution: int, backend: str = "auto"):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if isinstance(src, (bytes, bytearray, memoryview)):
        if len(src) == 0:
            raise EmptyVideoError("zero bytes", label)
    elif not os.path.isfile(src):
        raise VideoError("no such file", label)
    elif os.path.getsize(src) == 0:
        raise EmptyVideoError("zero bytes", label)
    if backend == "decord":
        return IsolatedDecordBackend(src, label, max_resolution)
    return _PyAVBackend(src, label, max_resolution)


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
                raise CorruptVideoError(f"{reader.name} decode failed: {type(e).__name__}: {str(e)[:200]}",
                                        label) from e
            if len(frames) == 0:
                break
            done += len(want)
            yield resize_crop(torch.from_numpy(frames), size), torch.from_numpy(times)
            if len(frames) < len(want):
                break  # the stream ended before the header said it would
    finally:
        reader.close()


def iter_video(src: VideoSource, *, fps: Optional[float] = 1.0, max_frames: Optional[int] = None,
               size: Optional[int] = None, max_resolution: int = DEFAULT_MAX_RESOLUTION,
               chunk_frames: Optional[int] = None, backend: str = "auto",
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Stream the sampled frames as chunks ``(frames uint8 (t, H, W, 3), timestamps float64 (t,))``.

    Decoding memory is bounded by the chunk size (about 64 MiB of raw frames by default). See
    :func:`read_video`.
    """
    label = _label(src)
    reader = _open(src, label, max_resolution, backend)
    yield from _chunks(reader, src, label, fps=fps, max_frames=max_frames, size=size,
                       max_resolution=max_resolution, chunk_frames=chunk_frames, backend=backend)


def read_video(src: VideoSource, *, fps: Optional[float] = 1.0, max_frames: Optional[int] = None,
               size: Optional[int] = None, max_resolution: int = DEFAULT_MAX_RESOLUTION,
               backend: str = "auto") -> VideoClip:
    """Decode the frames sampled at ``fps`` (None: all), capped at ``max_frames``, resized to ``size``.

    src: a path or the bytes of a video file (any of :data:`VIDEO_EXTS`; FFmpeg looks at the content).
    Returns a :class:`VideoClip` with frames uint8 (T, H, W, 3) (H = W = size when size is given)
    and timestamps float64 (T,). Raises :class:`VideoError` (a subclass) when the video is empty,
    corrupt, truncated, unsupported or larger than ``max_resolution``; with ``backend="decord"``
    also :class:`~longvideo.data.isolate.DecoderCrashError` when decord's process died on it.
    ``backend``: auto (= pyav) or pyav, in this process, or decord, in a child process.
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
