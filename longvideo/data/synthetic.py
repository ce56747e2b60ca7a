"""Synthetic videos: moving coloured shapes, scene captions, QA pairs and a needle frame.

The embedded default dataset (docs/data.md, "The synthetic dataset"), small enough for a tiny model
to learn on a CPU in minutes. Everything is a pure function of a seed, so sample ``index`` is
reproduced exactly from ``(seed, index)``. Frames are uint8 ``(T, H, W, 3)``, rendered for any set
of frame indices, so an hour-long video is produced chunk by chunk without ever holding all of it.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
from collections.abc import Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from tqdm import tqdm

from longvideo.data.questions import (
    BASIC_QUESTIONS,
    QUESTION_TYPES,
    Story,
    ask,
    check_question_names,
)
from longvideo.data.shards import ShardWriter
from longvideo.data.templates import (
    ANSWER_PROMPT,
    ANSWER_TEXT,
    QUESTION_TEXT,
    SEGMENT_TEXT,
    TIMESTAMP_TEXT,
)

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 80, 235),
    "yellow": (235, 215, 40),
}
"""Shape and needle colours (RGB), far apart so that a small VQ keeps them apart."""
COLOUR_NAMES: tuple[str, ...] = tuple(COLOURS)
SHAPE_KINDS: tuple[str, ...] = ("square", "circle", "triangle")
NEEDLE_QUESTION = QUESTION_TYPES["needle"].text
FIRST_SHAPE_QUESTION = QUESTION_TYPES["first_shape"].text
LAST_COLOUR_QUESTION = QUESTION_TYPES["last_colour"].text
NEEDLE_CHOICES: tuple[str, ...] = COLOUR_NAMES
"""Answers of the needle question; chance level is 1 / len(NEEDLE_CHOICES)."""


@dataclass(frozen=True)
class Shape:
    """One shape moving in straight lines and bouncing off the frame edges (units: pixels/frame)."""

    kind: str
    colour: str
    x0: float
    y0: float
    vx: float
    vy: float
    radius: float

    def centre(self, t: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Centre (x, y) at frame offsets t (T,); bouncing is a triangle wave between the walls."""
        lo, hi = self.radius, size - 1 - self.radius

        def bounce(p0, v):
            span = max(hi - lo, 1e-6)
            u = np.mod(p0 - lo + v * t, 2 * span)
            return lo + np.where(u <= span, u, 2 * span - u)

        return bounce(self.x0, self.vx), bounce(self.y0, self.vy)


def random_shape(rng: np.random.Generator, size: int, scale: float = 1.0) -> Shape:
    """A shape with random kind, colour, start, velocity (about 1-3 % of the frame per frame) and
    a radius of 14-22 % of the frame, times `scale`."""
    kind = SHAPE_KINDS[rng.integers(len(SHAPE_KINDS))]
    colour = COLOUR_NAMES[rng.integers(len(COLOUR_NAMES))]
    radius = size * rng.uniform(0.14, 0.22) * scale
    speed = size * rng.uniform(0.01, 0.03)
    angle = rng.uniform(0, 2 * np.pi)
    return Shape(
        kind=kind,
        colour=colour,
        x0=rng.uniform(radius, size - 1 - radius),
        y0=rng.uniform(radius, size - 1 - radius),
        vx=speed * np.cos(angle),
        vy=speed * np.sin(angle),
        radius=radius,
    )


def _shape_mask(shape: Shape, cx: np.ndarray, cy: np.ndarray, size: int) -> np.ndarray:
    """(T, H, W) bool mask of the shape for centres cx, cy (T,)."""
    grid = np.arange(size, dtype=np.float32)
    dx = grid[None, None, :] - cx[:, None, None].astype(np.float32)  # (T, 1, W)
    dy = grid[None, :, None] - cy[:, None, None].astype(np.float32)  # (T, H, 1)
    r = np.float32(shape.radius)
    if shape.kind == "square":
        return (np.abs(dx) <= r * 0.85) & (np.abs(dy) <= r * 0.85)
    if shape.kind == "circle":
        return dx * dx + dy * dy <= r * r
    if shape.kind == "triangle":  # apex up: the half-width grows linearly from top to bottom
        return (dy >= -r) & (dy <= r) & (np.abs(dx) <= (dy + r) * 0.5)
    raise ValueError(f"unknown shape kind {shape.kind!r}; expected one of {SHAPE_KINDS}")


_INDEX_BITS = 16


def frame_index_video(start: int, stop: int, size: int = 64) -> np.ndarray:
    """Frames whose pixels spell their own index in binary (4 x 4 grid of black/white cells).

    Lossy codecs keep such large flat cells, so :func:`decode_frame_index` recovers the index of a
    decoded frame exactly; used to check which frames a sampler returned. uint8 (T, size, size, 3).
    """
    if size % 4:
        raise ValueError(f"size must be a multiple of 4, got {size}")
    idx = np.arange(start, stop, dtype=np.int64)
    bits = (idx[:, None] >> np.arange(_INDEX_BITS)) & 1  # (T, 16)
    cells = bits.reshape(-1, 4, 4).astype(np.uint8) * 255  # (T, 4, 4)
    cell = size // 4
    img = np.repeat(np.repeat(cells, cell, axis=1), cell, axis=2)  # (T, size, size)
    return np.repeat(img[..., None], 3, axis=-1)


def decode_frame_index(frame: np.ndarray) -> int:
    """Inverse of :func:`frame_index_video` for one (H, W, 3) frame (any square size)."""
    h, w = frame.shape[:2]
    g = frame.astype(np.float32).mean(-1)  # (H, W)
    ch, cw = h // 4, w // 4
    value = 0
    for b in range(_INDEX_BITS):
        r, c = divmod(b, 4)
        centre = g[
            r * ch + ch // 4 : (r + 1) * ch - ch // 4, c * cw + cw // 4 : (c + 1) * cw - cw // 4
        ]
        value |= int(centre.mean() > 127) << b
    return value


FOREGROUND_LEVEL = 96
"""A pixel whose brightest channel exceeds this is drawn (shape or flash); the background is
black."""
FLASH_COVERAGE = 0.6
"""A frame drawn over more than this fraction is a flash (a full-frame colour), not a shape."""
SQUARE_FILL = 1.0
"""A drawn shape that fills more than this of its box (its pixels' 1st to 99th percentiles along
each axis, so more than all of it) is a square (about 1.09 when drawn); a disc fills about
0.88."""
TRIANGLE_DROP = 0.56
"""A drawn shape whose mass centre lies lower than this share of its box's height is a triangle
(apex up: about 0.63); a square or a disc has it in the middle (0.5)."""


def nearest_colour(rgb, colours: Iterable[str] = COLOUR_NAMES) -> str:
    """The colour of COLOURS closest (RGB distance) to `rgb`."""
    rgb = np.asarray(rgb, np.float64)
    return min(
        colours, key=lambda c: float(((rgb - np.asarray(COLOURS[c], np.float64)) ** 2).sum())
    )


def read_frame(frame: np.ndarray) -> dict:
    """What a frame of the synthetic videos shows, read from its pixels (uint8 (H, W, 3)), the
    inverse of the renderer: {"kind": "shape" | "flash" | "empty", "colour", "shape", "coverage"}.
    The colour is the palette colour nearest the drawn pixels' mean (as the needle evaluation reads
    a flash); the shape from where its mass lies in its box (TRIANGLE_DROP) and how much of the box
    it fills (SQUARE_FILL)."""
    frame = np.asarray(frame)
    drawn = frame.max(-1) > FOREGROUND_LEVEL
    coverage = float(drawn.mean())
    if coverage < 0.005:
        return {"kind": "empty", "colour": None, "shape": None, "coverage": coverage}
    if coverage > FLASH_COVERAGE:
        colour = nearest_colour(frame.reshape(-1, 3).mean(0))
        return {"kind": "flash", "colour": colour, "shape": None, "coverage": coverage}
    colour = nearest_colour(frame[drawn].mean(0))
    # robust to the stray pixels of a decoded frame: the box of the drawn pixels' 1st to 99th
    # percentiles, the share of it they fill and where their mass centre lies in it
    ys, xs = np.nonzero(drawn)
    (y0, y1), (x0, x1) = np.percentile(ys, [1, 99]), np.percentile(xs, [1, 99])
    height, width = max(y1 - y0, 1.0), max(x1 - x0, 1.0)
    fill = 0.98 * len(ys) / (height * width)
    drop = (ys.mean() - y0) / height
    shape = "triangle" if drop > TRIANGLE_DROP else "square" if fill > SQUARE_FILL else "circle"
    return {
        "kind": "shape",
        "colour": colour,
        "shape": shape,
        "coverage": coverage,
        "fill": fill,
        "drop": float(drop),
    }


def write_mp4(
    chunks: Iterable[np.ndarray],
    fps: float,
    dst=None,
    *,
    codec: str = "libx264",
    crf: int = 18,
    gop: int | None = None,
    preset: str = "veryfast",
) -> bytes | None:
    """Encode uint8 frame chunks (T, H, W, 3) (or single (H, W, 3) frames) to mp4 with PyAV.

    dst: a path to write, or None to return the bytes. Encoding is single-threaded so that the same
    frames always give the same bytes. ``gop``: keyframe interval in frames (None = encoder default).
    """
    sink = io.BytesIO() if dst is None else str(dst)
    rate = Fraction(fps).limit_denominator(1000)
    with av.open(sink, mode="w", format="mp4") as container:
        stream = None
        for chunk in chunks:
            chunk = np.asarray(chunk)
            if chunk.ndim == 3:
                chunk = chunk[None]
            if chunk.dtype != np.uint8 or chunk.ndim != 4 or chunk.shape[-1] != 3:
                raise ValueError(
                    f"write_mp4 needs uint8 (T, H, W, 3) chunks, got {chunk.dtype} {chunk.shape}"
                )
            if stream is None:
                h, w = chunk.shape[1:3]
                if h % 2 or w % 2:
                    raise ValueError(f"yuv420p needs even frame sides, got {h}x{w}")
                stream = container.add_stream(codec, rate=rate)
                stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
                stream.thread_count = 1
                if codec == "libx264":
                    # x264 otherwise writes its build string, which differs between machines
                    params = "threads=1:info=0" + (f":keyint={gop}:min-keyint={gop}" if gop else "")
                    stream.options = {"crf": str(crf), "preset": preset, "x264-params": params}
                elif gop:
                    stream.codec_context.gop_size = gop
            for img in chunk:
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
                for packet in stream.encode(frame):
                    container.mux(packet)
        if stream is None:
            raise ValueError("write_mp4 got no frames")
        for packet in stream.encode(None):
            container.mux(packet)
    return sink.getvalue() if dst is None else None


@dataclass(frozen=True)
class SyntheticSpec:
    """How synthetic samples are drawn. Durations are whole seconds."""

    size: int = 64  # frame side in pixels
    fps: int = 8  # frames per second of the written video
    min_seconds: int = 4  # shortest ordinary video
    max_seconds: int = 12  # longest ordinary video
    long_fraction: float = 0.1  # fraction of samples that are long videos ...
    long_seconds: int = 60  # ... of this duration
    needle_fraction: float = 0.5  # fraction of samples that carry the needle (flash frame) question
    scene_seconds: tuple[int, int] = (2, 4)  # inclusive range of a scene's duration
    gop_seconds: float = 1.0  # keyframe interval of the written mp4
    needle_at: float | None = (
        None  # depth of the needle in [0, 1] (0 = first second); None: at random
    )
    # fraction of the needles put on the video's first or last second (as often each), the rest at
    # a uniform second: a flash on the last frame is otherwise about 1 in `duration` (docs/hour.md)
    needle_edge_fraction: float = 0.0
    # extra one-second flashes of random colours, with no question about them (tokenizer training
    # data: a tokenizer that rarely sees a flash learns to drop it)
    flashes_per_minute: float = 0.0
    # a video with the needle carries 1 to max_flashes flash frames of distinct colours (as many
    # equally often), each a second of its own; the questions about them (count, order, between)
    # are those of `questions` that are defined for that many
    max_flashes: int = 1
    questions: tuple[str, ...] = BASIC_QUESTIONS  # question types asked (data/questions.py)
    durations: tuple[int, ...] = ()  # sample i lasts durations[i % len] seconds (empty: drawn)
    shape_scale: float = 1.0  # shapes' radii times this (1: 14-22 % of the frame side)
    # a video without the needle is asked the flash question too, answered "none" (and the flash
    # question's choices hold "none"): a model can say there was none, so no colour is right by
    # default over a background (data/questions.py, Story.ask_no_flash)
    ask_no_flash: bool = False

    def __post_init__(self):
        if self.size <= 0 or self.size % 2:
            raise ValueError(f"size must be positive and even, got {self.size}")
        if self.fps <= 0:
            raise ValueError(f"fps must be positive, got {self.fps}")
        if not 1 <= self.min_seconds <= self.max_seconds:
            raise ValueError(
                f"need 1 <= min_seconds <= max_seconds, got {self.min_seconds}, {self.max_seconds}"
            )
        if self.long_seconds < 1:
            raise ValueError(f"long_seconds must be >= 1, got {self.long_seconds}")
        lo, hi = self.scene_seconds
        if not 1 <= lo <= hi:
            raise ValueError(f"scene_seconds must satisfy 1 <= lo <= hi, got {self.scene_seconds}")
        if self.needle_at is not None and not 0.0 <= self.needle_at <= 1.0:
            raise ValueError(f"needle_at must be in [0, 1], got {self.needle_at}")
        if self.flashes_per_minute < 0:
            raise ValueError(f"flashes_per_minute must be >= 0, got {self.flashes_per_minute}")
        if not 1 <= self.max_flashes <= len(COLOUR_NAMES) - 1:
            raise ValueError(
                f"max_flashes must be in [1, {len(COLOUR_NAMES) - 1}] (flashes of distinct "
                f"colours), got {self.max_flashes}"
            )
        object.__setattr__(self, "questions", tuple(self.questions))
        object.__setattr__(self, "durations", tuple(int(d) for d in self.durations))
        check_question_names(self.questions)
        if not 0.25 <= self.shape_scale <= 2.2:
            raise ValueError(f"shape_scale must be in [0.25, 2.2], got {self.shape_scale}")
        if any(d < 1 for d in self.durations):
            raise ValueError(f"durations must be whole seconds >= 1, got {list(self.durations)}")
        counting = {"count", "order", "between"} & set(self.questions)
        if counting and self.flashes_per_minute > 0:
            raise ValueError(
                f"questions {sorted(counting)} count the flashes: they cannot be asked with "
                f"flashes_per_minute > 0 (unasked flashes), got {self.flashes_per_minute}"
            )
        for name in ("long_fraction", "needle_fraction", "needle_edge_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


@dataclass
class SyntheticSample:
    """Scenes, optional needle and the json metadata of one synthetic video."""

    key: str
    spec: SyntheticSpec
    duration: int
    scenes: list[tuple[int, int, Shape]]  # (start second, end second, shape)
    needle: tuple[int, str] | None  # (second, colour)
    meta: dict = field(default_factory=dict)
    flashes: list[tuple[int, str]] = field(
        default_factory=list
    )  # extra (second, colour), no question

    @property
    def num_frames(self) -> int:
        return self.duration * self.spec.fps

    def frames(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Frames [start, stop) as uint8 (T, H, W, 3)."""
        stop = self.num_frames if stop is None else min(stop, self.num_frames)
        return self.frames_at(np.arange(start, stop))

    def frames_at(self, indices) -> np.ndarray:
        """The frames at the given indices (any order, any stride) as uint8 (len, H, W, 3): e.g.
        one frame per second of an hour without rendering the other frames."""
        fps, size = self.spec.fps, self.spec.size
        idx = np.asarray(indices, dtype=np.int64)
        out = np.zeros((len(idx), size, size, 3), np.uint8)
        for s0, s1, shape in self.scenes:
            sel = np.nonzero((idx >= s0 * fps) & (idx < s1 * fps))[0]
            if len(sel):  # the scene's shape moves from the scene's first frame
                cx, cy = shape.centre((idx[sel] - s0 * fps).astype(np.float64), size)
                mask = _shape_mask(shape, cx, cy, size)
                part = out[sel]
                part[mask] = np.asarray(COLOURS[shape.colour], np.uint8)
                out[sel] = part
        painted = self.flashes + (
            [self.needle] if self.needle is not None else []
        )  # the needle wins
        for sec, colour in painted:
            out[(idx >= sec * fps) & (idx < (sec + 1) * fps)] = np.asarray(
                COLOURS[colour], np.uint8
            )
        return out

    def mp4(self) -> bytes:
        gop = max(1, int(round(self.spec.gop_seconds * self.spec.fps)))
        chunks = (self.frames(a, a + 256) for a in range(0, self.num_frames, 256))
        return write_mp4(chunks, self.spec.fps, gop=gop)


def make_sample(seed: int, index: int, spec: SyntheticSpec = SyntheticSpec()) -> SyntheticSample:
    """Draw sample ``index`` of the dataset with ``seed`` (independent of every other index)."""
    rng = np.random.default_rng([seed, index])
    long = rng.random() < spec.long_fraction
    duration = (
        spec.long_seconds if long else int(rng.integers(spec.min_seconds, spec.max_seconds + 1))
    )
    if spec.durations:
        duration = spec.durations[index % len(spec.durations)]
    scenes: list[tuple[int, int, Shape]] = []
    t = 0
    prev = None
    while t < duration:
        length = min(
            int(rng.integers(spec.scene_seconds[0], spec.scene_seconds[1] + 1)), duration - t
        )
        shape = random_shape(rng, spec.size, spec.shape_scale)
        while prev is not None and (shape.kind, shape.colour) == (prev.kind, prev.colour):
            shape = random_shape(
                rng, spec.size, spec.shape_scale
            )  # consecutive scenes differ, so cuts are visible
        scenes.append((t, t + length, shape))
        prev, t = shape, t + length
    needle = None
    if rng.random() < spec.needle_fraction:
        second = int(rng.integers(0, duration))
        if spec.needle_at is not None:
            second = int(round(spec.needle_at * (duration - 1)))
        elif spec.needle_edge_fraction > 0:  # a stream of its own: the rest is unchanged
            edge = np.random.default_rng([seed, index, 4])
            if edge.random() < spec.needle_edge_fraction:
                second = 0 if edge.random() < 0.5 else duration - 1
        needle = (second, NEEDLE_CHOICES[rng.integers(len(NEEDLE_CHOICES))])
    events = [needle] if needle is not None else []
    if needle is not None and spec.max_flashes > 1:  # a stream of its own: the rest is unchanged
        erng = np.random.default_rng([seed, index, 2])
        extra = int(erng.integers(0, spec.max_flashes)) if duration > 1 else 0
        free = np.setdiff1d(np.arange(duration), [needle[0]])
        seconds = erng.choice(free, size=min(extra, len(free)), replace=False).tolist()
        colours = erng.permutation([c for c in NEEDLE_CHOICES if c != needle[1]]).tolist()
        events += [(int(t), str(c)) for t, c in zip(seconds, colours)]
        events.sort()

    segments = [
        {"start": float(a), "end": float(b), "text": f"a {s.colour} {s.kind}"} for a, b, s in scenes
    ]
    story = Story(
        scenes=[(a, b, sh.kind, sh.colour) for a, b, sh in scenes],
        flashes=events,
        colours=NEEDLE_CHOICES,
        kinds=SHAPE_KINDS,
        max_flashes=spec.max_flashes,
        ask_no_flash=spec.ask_no_flash,
    )
    qa = ask(story, spec.questions, np.random.default_rng([seed, index, 3]))
    key = f"{seed:04d}_{index:08d}"
    meta = {
        "caption": ", then ".join(seg["text"] for seg in segments) + ".",
        "qa": qa,
        "segments": segments,
        "fps": float(spec.fps),
        "source": "synthetic",
        "task": "needle" if needle is not None else "scenes",
        "duration": float(duration),
    }
    if len(events) > 1:
        meta["events"] = [{"start": float(t), "end": float(t + 1), "colour": c} for t, c in events]
    if needle is not None and len(events) == 1:
        meta["needle"] = {
            "start": float(needle[0]),
            "end": float(needle[0] + 1),
            "colour": needle[1],
            "depth": needle[0] / duration,
        }
    flashes = []
    if (
        spec.flashes_per_minute > 0
    ):  # a stream of its own: the rest of the sample is as without flashes
        frng = np.random.default_rng([seed, index, 1])
        n = int(frng.poisson(spec.flashes_per_minute * duration / 60))
        seconds = sorted(
            {int(x) for x in frng.integers(0, duration, n)} - ({needle[0]} if needle else set())
        )
        flashes = [(t, NEEDLE_CHOICES[int(frng.integers(len(NEEDLE_CHOICES)))]) for t in seconds]
        meta["flashes"] = [
            {"start": float(t), "end": float(t + 1), "colour": c} for t, c in flashes
        ]
    return SyntheticSample(
        key=key,
        spec=spec,
        duration=duration,
        scenes=scenes,
        needle=needle,
        meta=meta,
        flashes=flashes + [e for e in events if e != needle],  # painted like the needle
    )


def _write_shard(args) -> tuple[str, int]:
    path, seed, indices, spec = args
    with ShardWriter(path) as w:
        for i in indices:
            sample = make_sample(seed, i, spec)
            meta = json.dumps(sample.meta, sort_keys=True).encode()
            w.write(sample.key, {"mp4": sample.mp4(), "json": meta})
    return str(path), len(indices)


def write_synthetic_shards(
    out_dir,
    n: int,
    *,
    seed: int = 0,
    spec: SyntheticSpec = SyntheticSpec(),
    samples_per_shard: int = 64,
    workers: int = 1,
    progress: bool = True,
) -> list[str]:
    """Write samples 0..n-1 of the dataset with ``seed`` as raw shards ``shard-NNNNNN.tar``.

    Each shard is written atomically; shards that already exist are kept (a rerun completes a
    partial dataset). Returns the shard paths.
    """
    if n <= 0 or samples_per_shard <= 0:
        raise ValueError(f"n and samples_per_shard must be positive, got {n}, {samples_per_shard}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs, paths = [], []
    for s, start in enumerate(range(0, n, samples_per_shard)):
        path = out / f"shard-{s:06d}.tar"
        paths.append(str(path))
        if not path.exists():
            jobs.append((path, seed, list(range(start, min(start + samples_per_shard, n))), spec))
    bar = tqdm(
        total=sum(len(j[2]) for j in jobs), unit="video", desc="make-data", disable=not progress
    )
    if workers > 1 and len(jobs) > 1:
        with mp.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
            for _, count in pool.imap_unordered(_write_shard, jobs):
                bar.update(count)
    else:
        for job in jobs:
            bar.update(_write_shard(job)[1])
    bar.close()
    return paths


def text_corpus(n: int = 200, seed: int = 0, spec: SyntheticSpec = SyntheticSpec()) -> list[str]:
    """Texts of the synthetic dataset (captions, segments, QA with the layout's wording, timestamps),
    for training a small text tokenizer that covers it. Cheap: renders no video."""
    texts = []
    for i in range(n):
        meta = make_sample(seed, i, spec).meta
        texts.append(meta["caption"])
        texts += [SEGMENT_TEXT.format(text=s["text"]) for s in meta["segments"]]
        texts += [
            QUESTION_TEXT.format(question=q["question"])
            + ANSWER_PROMPT
            + ANSWER_TEXT.format(answer=q["answer"])
            for q in meta["qa"]
        ]
    texts += [TIMESTAMP_TEXT.format(t=float(t)) for t in range(0, 120)]
    return texts
