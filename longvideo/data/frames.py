"""Training frames for the video tokenizer (longvideo.train.vq): videos read once into RAM, then
sampled as frames or clips.

Sources: a folder of videos, raw shards (a directory of .tar, a glob, a brace pattern, one .tar, or
URLs, streamed), one video file, or in-memory uint8 (T, H, W, 3) videos (or a list). Videos are read
at `cfg.fps` with `cfg.video_backend`, resized and centre-cropped to `cfg.train_size`; unreadable
ones are skipped and counted; the last video(s) are held out (a single video: its last fifth).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from longvideo.data.shards import SkipStats, iter_raw_samples
from longvideo.data.streams import expand_sources, is_url
from longvideo.data.synthetic import SyntheticSpec, make_sample
from longvideo.data.video import VIDEO_EXTS, VideoError, read_video, resize_crop
from longvideo.vq.config import VQConfig

log = logging.getLogger(__name__)

VIDEO_SUFFIXES = tuple(f".{e}" for e in VIDEO_EXTS)
Source = str | os.PathLike | torch.Tensor | np.ndarray | Sequence


@dataclass
class FrameSource:
    """Videos in RAM (uint8 (T, H, W, 3) each): `train` to sample from, `heldout` for evaluation."""

    train: list[torch.Tensor]
    heldout: list[torch.Tensor]
    skipped: dict[str, int] = field(default_factory=dict)
    """Videos that could not be read, by reason."""

    def __post_init__(self):
        if not self.train:
            raise ValueError(
                "no training frames: every video was empty or unreadable "
                f"(skipped: {self.skipped or 'none'})"
            )
        self._lengths = torch.tensor([v.shape[0] for v in self.train])
        self._offsets = torch.cumsum(self._lengths, 0) - self._lengths

    @property
    def num_frames(self) -> int:
        return int(self._lengths.sum())

    def sample_frames(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """n frames drawn uniformly from all training frames: uint8 (n, H, W, 3)."""
        flat = torch.randint(self.num_frames, (n,), generator=gen)
        vid = torch.searchsorted(self._offsets, flat, right=True) - 1
        return torch.stack(
            [self.train[v][f - self._offsets[v]] for v, f in zip(vid.tolist(), flat.tolist())]
        )

    def sample_clips(self, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
        """n clips of `length` consecutive frames, uint8 (n, length, H, W, 3), from videos drawn in
        proportion to their length; a short video repeats its last frame (as encoding pads a group)."""
        vids = torch.multinomial(self._lengths.double(), n, replacement=True, generator=gen)
        out = []
        for v in vids.tolist():
            video = self.train[v]
            start = int(torch.randint(max(video.shape[0] - length, 0) + 1, (1,), generator=gen))
            out.append(_pad_to(video[start : start + length], length))
        return torch.stack(out)

    def eval_frames(self, count: int) -> torch.Tensor:
        """`count` held-out frames spread evenly over the held-out videos: uint8 (N, H, W, 3)."""
        allf = torch.cat(self.heldout)
        idx = torch.linspace(0, allf.shape[0] - 1, min(count, allf.shape[0])).round().long()
        return allf[idx]

    def eval_clips(self, count: int, length: int) -> torch.Tensor:
        """ceil(count / length) held-out clips of `length` frames: uint8 (C, length, H, W, 3)."""
        n = max(1, -(-count // length))
        clips = []
        for i in range(n):
            video = self.heldout[i % len(self.heldout)]
            slots = max(video.shape[0] - length, 0)
            k, per = i // len(self.heldout), -(-n // len(self.heldout))
            start = round(slots * (k + 0.5) / per) if per > 1 else slots // 2
            clips.append(_pad_to(video[start : start + length], length))
        return torch.stack(clips)


def _pad_to(clip: torch.Tensor, length: int) -> torch.Tensor:
    if clip.shape[0] >= length:
        return clip[:length]
    return torch.cat([clip, clip[-1:].expand(length - clip.shape[0], -1, -1, -1)])


def _as_video(v, res: int) -> torch.Tensor:
    if isinstance(v, np.ndarray):
        v = torch.from_numpy(np.ascontiguousarray(v))
    if not isinstance(v, torch.Tensor) or v.dtype != torch.uint8 or v.ndim != 4 or v.shape[-1] != 3:
        got = f"{v.dtype} {tuple(v.shape)}" if hasattr(v, "shape") else type(v).__name__
        raise ValueError(f"expected videos as uint8 (T, H, W, 3), got {got}")
    if tuple(v.shape[1:3]) != (res, res):
        v = resize_crop(v, res)
    return v


def _iter_files(source: str, cfg: VQConfig, skipped: Counter) -> Iterator[torch.Tensor]:
    """Decoded videos from a path: a video file, a folder of videos, or raw shards."""

    def read(src, where) -> Iterator[torch.Tensor]:
        try:
            clip = read_video(
                src,
                fps=cfg.fps,
                max_frames=cfg.max_frames_per_video,
                size=cfg.train_size,
                backend=cfg.video_backend,
            )
        except VideoError as e:
            skipped[type(e).__name__] += 1
            log.warning("skipped %s: %s", where, e)
            return
        yield clip.frames

    path = Path(source)
    if is_url(source):
        files, shards = [], expand_sources(source)
    elif path.is_file() and path.suffix.lower() in VIDEO_SUFFIXES:
        files, shards = [path], []
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in VIDEO_SUFFIXES)
        shards = sorted(str(p) for p in path.rglob("*.tar"))
    else:
        files, shards = [], expand_sources(str(source))
    if not files and not shards:
        raise FileNotFoundError(
            f"no videos ({', '.join(VIDEO_SUFFIXES)}) or .tar shards found at {source}"
        )
    for f in files:
        yield from read(str(f), str(f))
    for shard in shards:
        stats = SkipStats()
        for sample in iter_raw_samples(shard, stats):
            yield from read(sample.video, f"{shard}:{sample.key}")
        skipped.update({reason: n for reason, n in stats.items() if reason != "ok"})


def build_frame_source(
    source: Source | FrameSource, cfg: VQConfig, *, progress: bool = False
) -> FrameSource:
    """Load training and held-out videos from `source` (see the module docstring)."""
    if isinstance(source, FrameSource):
        return source
    skipped: Counter = Counter()
    if isinstance(source, (str, os.PathLike)):
        videos_iter: Iterator = _iter_files(str(source), cfg, skipped)
    elif isinstance(source, (torch.Tensor, np.ndarray)):
        videos_iter = iter([source])
    else:
        videos_iter = iter(source)
    videos: list[torch.Tensor] = []
    total = 0
    # the held-out share is read on top of the training pool
    budget = cfg.pool_frames + max(cfg.eval_frames, 1 + cfg.frames_per_group * cfg.clip_groups)
    with tqdm(total=budget, unit="frame", desc="reading videos", disable=not progress) as bar:
        for v in videos_iter:
            v = _as_video(v, cfg.train_size)
            if v.shape[0] == 0:
                skipped["empty"] += 1
                continue
            v = v[: budget - total].clone()
            videos.append(v)
            total += v.shape[0]
            bar.update(v.shape[0])
            if total >= budget:
                break
        bar.total = total  # fewer frames than the budget: the bar ends full
        bar.refresh()
    return split_heldout(videos, cfg, skipped)


def split_heldout(
    videos: list[torch.Tensor], cfg: VQConfig, skipped: dict | None = None
) -> FrameSource:
    """Hold out trailing videos: at least eval_frames frames and, when there are 10 or more videos,
    a tenth of them (at most 8) so that the evaluation sees several scenes. One video: its last fifth."""
    skipped = dict(skipped or {})
    if not videos:
        return FrameSource([], [], skipped)
    if len(videos) == 1:
        v = videos[0]
        if v.shape[0] < 2:
            raise ValueError(
                "a single one-frame video cannot be split into training and held-out frames"
            )
        cut = max(1, min(v.shape[0] - 1, round(v.shape[0] * 0.8)))
        return FrameSource([v[:cut]], [_eval_size(v[cut:], cfg)], skipped)
    want_videos = min(8, max(1, len(videos) // 10))
    held: list[torch.Tensor] = []
    while len(videos) > 1 and (
        sum(v.shape[0] for v in held) < cfg.eval_frames or len(held) < want_videos
    ):
        held.insert(0, videos.pop())
    return FrameSource(videos, [_eval_size(v, cfg) for v in held], skipped)


def _eval_size(v: torch.Tensor, cfg: VQConfig) -> torch.Tensor:
    """Held-out frames at the tokenizer's resolution (training frames may be larger: crop_scale)."""
    return v if v.shape[1] == cfg.resolution else resize_crop(v, cfg.resolution)


def synthetic_videos(
    n: int, cfg: VQConfig, *, fps: float = 4.0, seed: int = 0
) -> list[torch.Tensor]:
    """n generated videos (longvideo.data.synthetic) at the tokenizer's resolution, about `fps` frames
    a second of the 8 fps renderings: uint8 (T, R, R, 3) each."""
    if n < 1:
        raise ValueError(f"need at least one synthetic video, got {n}")
    spec = SyntheticSpec(size=cfg.resolution, fps=8)
    stride = max(1, round(spec.fps / fps))
    return [
        torch.from_numpy(np.ascontiguousarray(make_sample(seed, i, spec).frames()[::stride]))
        for i in range(n)
    ]
