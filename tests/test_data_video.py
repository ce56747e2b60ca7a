"""Video reading: which frames are sampled, resizing, the PyAV fallback and typed errors.

The reference is the video itself: every frame spells its own index in large black/white cells,
so the index of each decoded frame is read back from its pixels and compared with the frame on
screen at each target time, computed here independently.
"""

import io
import math

import av
import numpy as np
import pytest
import torch

from longvideo.data.synthetic import decode_frame_index, frame_index_video, write_mp4
from longvideo.data.video import (
    CorruptVideoError,
    EmptyVideoError,
    UnsupportedVideoError,
    VideoError,
    iter_video,
    probe_video,
    read_video,
)


def _index_mp4(n, fps, gop=None, size=64):
    return write_mp4([frame_index_video(0, n, size)], fps, crf=28, gop=gop)


def _expected(n, src_fps, fps, cap):
    """Frame on screen at t = k / fps for every t < duration; bin centres when over the cap."""
    if fps is None:
        idx = list(range(n))
    else:
        idx, k = [], 0
        while k / fps < n / src_fps - 1e-9:
            i = min(int(math.floor(k / fps * src_fps + 1e-6)), n - 1)
            if not idx or idx[-1] != i:
                idx.append(i)
            k += 1
    if cap is not None and len(idx) > cap:
        idx = [min(int((j + 0.5) * n / cap), n - 1) for j in range(cap)]
    return idx


@pytest.fixture(scope="module")
def videos():
    return {
        (8, 8): _index_mp4(100, 8, gop=8),
        (25, 50): _index_mp4(130, 25, gop=50),
        (30, None): _index_mp4(95, 30),
    }


@pytest.mark.parametrize("backend", ["decord", "pyav"])
@pytest.mark.parametrize("fps,cap", [(1.0, None), (0.7, None), (3.0, None), (2.0, 4), (None, None)])
def test_sampled_frames_and_timestamps(videos, backend, fps, cap):
    for (src_fps, _), data in videos.items():
        n = probe_video(data).num_frames
        clip = read_video(data, fps=fps, max_frames=cap, backend=backend)
        got = [decode_frame_index(f.numpy()) for f in clip.frames]
        want = _expected(n, src_fps, fps, cap)
        assert got == want, (src_fps, backend)
        assert clip.timestamps.dtype == torch.float64
        np.testing.assert_allclose(clip.timestamps.numpy(), np.array(want) / src_fps, atol=1e-3)
        assert clip.fps == pytest.approx(src_fps) and clip.duration == pytest.approx(n / src_fps)


def test_cap_spreads_over_whole_video(videos):
    data = videos[(25, 50)]  # 130 frames, 5.2 s
    clip = read_video(data, fps=25.0, max_frames=10)
    got = [decode_frame_index(f.numpy()) for f in clip.frames]
    assert len(got) == 10 and got == sorted(set(got))
    assert got[0] < 13 and got[-1] >= 117  # first and last tenth of the video are both represented


def test_stream_chunks_equal_one_read(videos):
    data = videos[(8, 8)]
    whole = read_video(data, fps=2.0, size=32)
    parts = list(iter_video(data, fps=2.0, size=32, chunk_frames=3))
    assert len(parts) == math.ceil(len(whole) / 3)
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), whole.frames, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), whole.timestamps, rtol=0, atol=0)


def test_resize_short_side_and_centre_crop():
    # 64 x 96 (H x W): a 16-pixel red band at each side of a green middle; the square crop keeps the middle
    frame = np.zeros((64, 96, 3), np.uint8)
    frame[:, :16] = (255, 0, 0)
    frame[:, -16:] = (255, 0, 0)
    frame[:, 16:-16] = (0, 255, 0)
    data = write_mp4([np.repeat(frame[None], 8, 0)], 8, crf=10)
    clip = read_video(data, fps=None, size=32)
    assert clip.frames.shape == (8, 32, 32, 3) and clip.frames.dtype == torch.uint8
    mean = clip.frames.float().mean(dim=(0, 1, 2))
    assert mean[1] > 200 and mean[0] < 30  # green only: the red bands were cropped away


def _streamed(fmt, codec, n=40, fps=8):
    """A container written to a pipe-like sink: no duration, no index (what decord cannot open)."""

    class Sink(io.RawIOBase):
        def __init__(self):
            self.data = bytearray()

        def writable(self):
            return True

        def seekable(self):
            return False

        def write(self, b):
            self.data += bytes(b)
            return len(b)

    sink = Sink()
    with av.open(sink, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=fps)
        s.width = s.height = 64
        s.pix_fmt = "yuv420p"
        for f in frame_index_video(0, n, 64):
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return bytes(sink.data)


def test_pyav_fallback_reads_what_decord_cannot():
    data = _streamed("webm", "libvpx-vp9")
    with pytest.raises(VideoError):
        read_video(data, backend="decord")
    clip = read_video(data, fps=2.0)  # auto = PyAV, which reads it
    assert [decode_frame_index(f.numpy()) for f in clip.frames] == _expected(40, 8, 2.0, None)


@pytest.mark.parametrize(
    "fmt,codec",
    [("avi", "mpeg4"), ("matroska", "libx264"), ("mov", "libx264"), ("mpegts", "libx264")],
)
def test_other_containers(tmp_path, fmt, codec):
    n = 48
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=8)
        s.width = s.height = 64
        s.pix_fmt = "yuv420p"
        s.codec_context.gop_size = 12
        for f in frame_index_video(0, n, 64):
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    path = tmp_path / f"v.{fmt}"
    path.write_bytes(buf.getvalue())
    clip = read_video(str(path), fps=1.0)
    assert [decode_frame_index(f.numpy()) for f in clip.frames] == _expected(n, 8, 1.0, None)


def test_typed_errors(tmp_path, videos):
    good = videos[(8, 8)]
    with pytest.raises(EmptyVideoError):
        read_video(b"")
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(EmptyVideoError):
        read_video(str(empty))
    with pytest.raises(CorruptVideoError):
        read_video(good[: len(good) // 2])  # truncated: the index (moov) is at the end
    with pytest.raises(CorruptVideoError):
        read_video(b"not a video at all " * 50)
    with pytest.raises(UnsupportedVideoError):
        read_video(good, max_resolution=32)  # 64 x 64 frames exceed the bound
    with pytest.raises(VideoError):
        read_video(str(tmp_path / "missing.mp4"))
    assert issubclass(CorruptVideoError, VideoError) and issubclass(EmptyVideoError, VideoError)
