"""Video files in the shapes real footage comes in, made on the spot with the encoders PyAV bundles.

Each entry says how its frames are shown (a quarter turn, a flip, a pixel aspect ratio), so a
test can check a reader against an independent decode turned the way the file says, and what a
reader must report for it (``ok``, ``truncated`` or ``corrupt``):

    for f in footage():          # Footage(name, ext, data, expect, turns, flip, sar, note)
        ...
    hour = bad_packet_hour()     # one hour of VP8 with one corrupt packet every 10 minutes

Frames show a scene as a player would (:func:`scene`): the frame-index pattern of
``longvideo.data.synthetic`` in the top-left square, a red bar on the rest of a portrait frame,
a white corner dot. A file that stores its frames turned stores the scene turned back; a reader
that shows it the right way up returns the scene. :func:`ffmpeg_footage` adds files made with the
``ffmpeg`` command where it is installed (none where it is not).
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from longvideo.data.synthetic import frame_index_video


@dataclass(frozen=True)
class Footage:
    """One file: ``turns`` quarter turns counterclockwise (np.rot90) and then ``flip`` (columns
    reversed) take a stored frame to the shown one, whose width is stretched by ``sar``."""

    name: str
    ext: str
    data: bytes
    expect: str = "ok"
    turns: int = 0
    flip: bool = False
    sar: Fraction = Fraction(1)
    note: str = ""


def scene(n: int, width: int, height: int, start: int = 0) -> np.ndarray:
    """uint8 (n, height, width, 3) frames as shown: the index pattern in the top-left square
    (side min(width, height), a multiple of 4), a red bar over the rest, a white dot in the corner."""
    side = min(width, height) // 4 * 4
    out = np.zeros((n, height, width, 3), np.uint8)
    out[..., 0] = 200  # the red bar (and, under the pattern, nothing)
    out[:, :side, :side] = frame_index_video(start, start + n, side)
    out[:, :side, :side] = np.where(
        out[:, :side, :side] > 127, 230, 25
    )  # away from the clipping ends
    dot = max(2, side // 8)
    out[:, side : side + dot, :dot] = 255 if height > side else out[:, side : side + dot, :dot]
    return out


def stored(shown: np.ndarray, turns: int = 0, flip: bool = False) -> np.ndarray:
    """The frames a file holds for ``shown`` frames, given how it says they are shown."""
    if flip:
        shown = shown[:, :, ::-1]
    return np.ascontiguousarray(np.rot90(shown, -turns, axes=(1, 2)))


def encode(
    frames: np.ndarray,
    *,
    fmt: str,
    codec: str,
    times: Sequence[float],
    pix_fmt: str = "yuv420p",
    options: dict | None = None,
    mux_options: dict | None = None,
    rotation: float | None = None,
    hflip: bool = False,
    rotate_tag: str | None = None,
    sar: Fraction | None = None,
    keys: set | None = None,
    fake_keys: Sequence[int] = (),
    rate: Fraction = Fraction(25),
    tb: Fraction | None = None,
) -> bytes:
    """Encode uint8 (T, H, W, 3) frames shown at ``times`` (seconds), single-threaded.

    rotation / hflip: the display matrix (PyAV's ``set_display_rotation``: degrees counterclockwise);
    rotate_tag: the legacy ``rotate`` metadata; sar: the sample aspect ratio; keys: frame numbers
    forced to be keyframes (the encoder makes no others); fake_keys: inter frames the container
    marks as keyframes (its index then points at them, as some screen recorders write); tb: the
    codec's time base (default 1 / rate; finer for a variable frame rate).
    """
    tb = tb or 1 / Fraction(rate)
    buf = io.BytesIO()
    fake = {round(times[i] / tb) for i in fake_keys}
    with av.open(buf, "w", format=fmt, options=mux_options or {}) as c:
        s = c.add_stream(codec, rate=rate)
        s.height, s.width = frames.shape[1:3]
        s.pix_fmt, s.thread_count = pix_fmt, 1
        s.codec_context.time_base = tb
        if options:
            s.options = dict(options)
        if keys is not None:
            s.codec_context.gop_size = 100000
        if sar is not None:
            s.codec_context.sample_aspect_ratio = sar
        if rotation is not None:
            s.set_display_rotation(rotation, hflip=hflip)
        if rotate_tag is not None:
            s.metadata["rotate"] = rotate_tag

        def mux(packets):
            for p in packets:
                if p.pts is not None and round(p.pts * p.time_base / tb) in fake:
                    p.is_keyframe = True
                c.mux(p)

        for i, img in enumerate(frames):
            f = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
            f.pts, f.time_base = round(times[i] / tb), tb
            if keys is not None:
                f.pict_type = (
                    av.video.frame.PictureType.I if i in keys else av.video.frame.PictureType.NONE
                )
            mux(s.encode(f))
        mux(s.encode(None))
    return buf.getvalue()


def _x264(keyint: int) -> dict:
    return {
        "x264-params": f"threads=1:info=0:keyint={keyint}:min-keyint={keyint}:scenecut=0",
        "preset": "veryfast",
    }


def _grid(n: int, fps: float, start: float = 0.0) -> list[float]:
    return [start + i / fps for i in range(n)]


def footage() -> list[Footage]:
    """The corpus (about 1 MB, a few seconds to make on one core)."""
    out = []
    # a phone held upright: portrait scene stored landscape, a display matrix turning it a quarter clockwise
    frames = scene(48, 64, 96)  # widths decord 0.6 copies (it fails on some, e.g. 48)
    out.append(
        Footage(
            "phone_portrait",
            "mp4",
            encode(
                stored(frames, -1),
                fmt="mp4",
                codec="libx264",
                times=_grid(48, 12),
                options=_x264(12),
                rotation=-90,
                rate=Fraction(12),
            ),
            turns=-1,
            note="H.264 MP4, display matrix -90 (portrait phone clip)",
        )
    )
    out.append(
        Footage(
            "upside_down",
            "mov",
            encode(
                stored(frames, 2),
                fmt="mov",
                codec="libx264",
                times=_grid(48, 12),
                options=_x264(12),
                rotation=180,
                rate=Fraction(12),
            ),
            turns=2,
            note="H.264 MOV, display matrix 180",
        )
    )
    out.append(
        Footage(
            "mirrored",
            "mp4",
            encode(
                stored(frames, 1, flip=True),
                fmt="mp4",
                codec="libx264",
                times=_grid(48, 12),
                options=_x264(12),
                rotation=90,
                hflip=True,
                rate=Fraction(12),
            ),
            turns=1,
            flip=True,
            note="H.264 MP4, display matrix 90 with a horizontal flip (front camera)",
        )
    )
    out.append(
        Footage(
            "rotate_tag",
            "mkv",
            encode(
                stored(frames, -1),
                fmt="matroska",
                codec="libx264",
                times=_grid(48, 12),
                options=_x264(12),
                rotate_tag="90",
                rate=Fraction(12),
            ),
            turns=-1,
            note="H.264 Matroska with only the legacy rotate=90 tag",
        )
    )
    # anamorphic: 64 stored columns shown as 96 (SAR 3:2)
    wide = scene(36, 96, 96)
    thin = np.ascontiguousarray(wide[:, :, ::3][:, :, :32].repeat(2, axis=2))  # 96 x 64 stored
    out.append(
        Footage(
            "anamorphic",
            "mp4",
            encode(
                thin,
                fmt="mp4",
                codec="libx264",
                times=_grid(36, 12),
                options=_x264(12),
                sar=Fraction(3, 2),
                rate=Fraction(12),
            ),
            sar=Fraction(3, 2),
            note="H.264 MP4, 64x96 stored with sample aspect ratio 3:2",
        )
    )
    # variable frame rate: bursts at 30 fps, stills held for up to 1.5 s
    steps = [1 / 30] * 20 + [0.5, 1.5, 0.25] + [1 / 30] * 15 + [0.7] + [1 / 10] * 10
    times = np.concatenate([[0.0], np.cumsum(steps)]).tolist()
    out.append(
        Footage(
            "vfr",
            "mp4",
            encode(
                scene(len(times), 64, 64),
                fmt="mp4",
                codec="libx264",
                times=times,
                options=_x264(15),
                rate=Fraction(30),
                tb=Fraction(1, 1000),
            ),
            note="H.264 MP4, variable frame rate (30 fps bursts, stills)",
        )
    )
    out.append(
        Footage(
            "hevc_10bit",
            "mp4",
            encode(
                scene(30, 64, 64),
                fmt="mp4",
                codec="libx265",
                times=_grid(30, 10),
                pix_fmt="yuv420p10le",
                options={"x265-params": "log-level=none:pools=1:frame-threads=1:keyint=10"},
                rate=Fraction(10),
            ),
            note="HEVC Main 10 (yuv420p10le) in MP4",
        )
    )
    odd = scene(30, 67, 45)
    out.append(
        Footage(
            "odd_vp9",
            "webm",
            encode(
                odd,
                fmt="webm",
                codec="libvpx-vp9",
                times=_grid(30, 10),
                options={"b": "400k", "g": "10"},
                rate=Fraction(10),
            ),
            note="VP9 WebM, 67x45 (odd sides)",
        )
    )
    out.append(
        Footage(
            "interlaced_ts",
            "ts",
            encode(
                scene(50, 64, 48),
                fmt="mpegts",
                codec="mpeg2video",
                times=_grid(50, 25),
                options={"flags": "+ildct+ilme", "top": "1", "g": "12", "b": "2M"},
                tb=Fraction(1, 25),
            ),
            note="interlaced MPEG-2 (top field first) in MPEG-TS",
        )
    )
    out.append(
        Footage(
            "late_start",
            "mkv",
            encode(
                scene(40, 64, 64),
                fmt="matroska",
                codec="libx264",
                times=_grid(40, 8, start=10.0),
                options=_x264(8),
                rate=Fraction(8),
            ),
            note="H.264 Matroska whose timestamps start at 10 s",
        )
    )
    # screen recordings: 15 fps, keyframes at irregular times, the index pointing at an inter frame
    # between the last keyframe and a seek near the end (the decoder refuses it when a seek lands there)
    for codec, name in (("libvpx", "screencast_vp8"), ("libvpx-vp9", "screencast_vp9")):
        out.append(
            Footage(
                name,
                "webm",
                encode(
                    scene(557, 64, 64),
                    fmt="webm",
                    codec=codec,
                    times=_grid(557, 15),
                    options={"b": "300k"},
                    keys={0, 40, 47, 200, 410, 535},
                    fake_keys=(537,),
                    rate=Fraction(15),
                ),
                note=f"{codec} WebM, 37 s at 15 fps, sparse keyframes, "
                "an index entry on an inter frame at 35.8 s",
            )
        )
    whole = encode(
        scene(80, 64, 64),
        fmt="matroska",
        codec="libx264",
        times=_grid(80, 8),
        options=_x264(8),
        rate=Fraction(8),
    )
    out.append(
        Footage(
            "cut_mkv",
            "mkv",
            whole[: len(whole) * 7 // 10],
            expect="truncated",
            note="H.264 Matroska (10 s declared) cut after 70 % of its bytes (6 s of frames)",
        )
    )
    mp4 = encode(
        scene(40, 64, 64),
        fmt="mp4",
        codec="libx264",
        times=_grid(40, 8),
        options=_x264(8),
        rate=Fraction(8),
    )
    out.append(
        Footage(
            "mp4_no_index",
            "mp4",
            mp4[: mp4.rfind(b"moov") - 4],
            expect="corrupt",
            note="H.264 MP4 whose index (moov) was never written",
        )
    )
    return out


def ffmpeg_footage() -> list[Footage]:
    """Files made by the ``ffmpeg`` command, when it is installed: a legacy ``rotate`` tag given to
    ffmpeg's MP4 muxer, which writes it as a display matrix. Empty without ffmpeg."""
    exe = shutil.which("ffmpeg")
    if exe is None:
        return []
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "in.mkv", Path(d) / "out.mp4"
        src.write_bytes(
            encode(
                stored(scene(24, 64, 96), -1),
                fmt="matroska",
                codec="libx264",
                times=_grid(24, 12),
                options=_x264(12),
                rate=Fraction(12),
            )
        )
        done = subprocess.run(
            [
                exe,
                "-v",
                "error",
                "-y",
                "-i",
                str(src),
                "-c",
                "copy",
                "-metadata:s:v:0",
                "rotate=90",
                str(dst),
            ],
            capture_output=True,
        )
        if done.returncode != 0 or not dst.is_file():
            return []
        return [
            Footage(
                "ffmpeg_rotate",
                "mp4",
                dst.read_bytes(),
                turns=-1,
                note="H.264 MP4 given rotate=90 by the ffmpeg command",
            )
        ]


def bad_packet_hour(
    minutes: int = 60, every_minutes: int = 10, fps: int = 2, keyint_s: int = 30, size: int = 16
) -> tuple[bytes, list[float]]:
    """A ``minutes``-long VP8 WebM (fps frames a second, a keyframe every keyint_s seconds) with
    the frame tag of one inter-frame packet in every ``every_minutes`` overwritten; returns the file
    and the damaged packets' times (seconds). VP8's decoder refuses such a packet."""
    n = minutes * 60 * fps
    data = bytearray(
        encode(
            scene(n, size, size),
            fmt="webm",
            codec="libvpx",
            times=_grid(n, fps),
            options={"b": "50k", "deadline": "realtime", "cpu-used": "8"},
            keys=set(range(0, n, keyint_s * fps)),
            rate=Fraction(fps),
        )
    )
    want = [60.0 * every_minutes * (k + 0.5) for k in range(minutes // every_minutes)]
    hit = []
    with av.open(io.BytesIO(bytes(data))) as c:
        for p in c.demux(video=0):
            if p.pts is None or p.pos is None or p.size < 16 or p.is_keyframe:
                continue
            t = float(p.pts * p.time_base)
            if len(hit) < len(want) and t >= want[len(hit)]:
                at = bytes(data).find(bytes(p), p.pos)
                data[at : at + 3] = (
                    b"\xff\xff\xff"  # VP8's frame tag: a first partition longer than the frame
                )
                hit.append(t)
    return bytes(data), hit


_PEAK = """
import sys
import av, torch
sys.path.insert(0, sys.argv[4])
from memwatch import growth
from longvideo.data.tokenize import TokenizeOptions, load_vq, tokenize_shard
torch.set_num_threads(1)
vq = load_vq(sys.argv[1])
mib, stats = growth(lambda: tokenize_shard(vq, sys.argv[2], sys.argv[3], TokenizeOptions()))
assert stats.get("ok") == 1, stats
print(mib)
"""


def tokenize_peak_mib(
    seconds: int,
    folder,
    size: int = 256,
    src_fps: int = 4,
    vq_config: str = "vq/causal3d-hour.yaml",
) -> float:
    """Peak resident memory (MiB above the start, PyAV and torch already imported) of
    ``tokenize_shard`` over one raw sample: a ``seconds``-long size x size mp4 of moving shapes
    (src_fps frames a second, a keyframe every 2 s), sampled at 1 fps and encoded by a random VQ
    of ``vq_config`` (default: the hour tokenizer, 64 x 64). Runs in a fresh process; files are
    kept in ``folder`` (the video is made once)."""
    import json
    import os
    import sys
    import tarfile

    import torch

    from longvideo.configtools import from_dict, load_yaml, resolve_config_path
    from longvideo.data.synthetic import write_mp4
    from longvideo.vq import VQConfig, VQModel
    from material.shapes import moving_shapes_video

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = folder / f"raw-{seconds}s-{size}.tar"
    if not raw.exists():
        video = write_mp4(
            (moving_shapes_video(10 * src_fps, size, seed=s) for s in range(0, seconds, 10)),
            src_fps,
            gop=2 * src_fps,
        )
        with tarfile.open(raw, "w") as tf:
            for name, blob in (
                ("clip.mp4", video),
                ("clip.json", json.dumps({"caption": "shapes"}).encode()),
            ):
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tf.addfile(info, io.BytesIO(blob))
    vq_dir = folder / "vq"
    if not (vq_dir / "config.json").exists():
        torch.manual_seed(0)
        VQModel(from_dict(VQConfig, load_yaml(resolve_config_path(vq_config)))).save(vq_dir)
    out = folder / f"tok-{seconds}s-{size}.tar"
    out.unlink(missing_ok=True)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _PEAK,
            str(vq_dir),
            str(raw),
            str(out),
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    if done.returncode != 0:
        raise RuntimeError(f"the memory probe failed: {done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])
