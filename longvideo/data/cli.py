"""``longvideo make-data synthetic ...`` and ``longvideo tokenize ...``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from longvideo.config import load_config
from longvideo.data.questions import QUESTION_TYPES
from longvideo.data.synthetic import SyntheticSpec, write_synthetic_shards
from longvideo.data.tokenize import TokenizeOptions, tokenize_shards


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in _names(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def make_data_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="longvideo make-data", description="Write raw video-text shards."
    )
    sub = p.add_subparsers(dest="kind", required=True)
    s = sub.add_parser(
        "synthetic",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="moving coloured shapes with captions, QA, timed segments and a needle task",
    )
    d = SyntheticSpec()
    s.add_argument("--out", required=True, help="output directory for shard-NNNNNN.tar")
    s.add_argument("--n", type=int, required=True, help="number of videos")
    s.add_argument(
        "--seed", type=int, default=0, help="dataset seed (sample i depends only on seed and i)"
    )
    s.add_argument("--size", type=int, default=d.size, help="frame side in pixels")
    s.add_argument("--fps", type=int, default=d.fps, help="frames per second of the written videos")
    s.add_argument("--min-seconds", type=int, default=d.min_seconds)
    s.add_argument("--max-seconds", type=int, default=d.max_seconds)
    s.add_argument(
        "--long-fraction", type=float, default=d.long_fraction, help="fraction of long videos"
    )
    s.add_argument(
        "--long-seconds", type=int, default=d.long_seconds, help="duration of a long video"
    )
    s.add_argument(
        "--needle-fraction",
        type=float,
        default=d.needle_fraction,
        help="fraction of videos with a flash frame and its question",
    )
    s.add_argument(
        "--flashes-per-minute",
        type=float,
        default=0.0,
        help="extra one-second flashes with no question (tokenizer training data)",
    )
    s.add_argument(
        "--needle-at",
        type=float,
        default=None,
        help="needle depth in [0, 1] (0 = first second, 1 = last; default: random)",
    )
    s.add_argument(
        "--needle-edge-fraction",
        type=float,
        default=d.needle_edge_fraction,
        help="fraction of the needles on the first or last second (half each; default: none)",
    )
    s.add_argument(
        "--max-flashes",
        type=int,
        default=d.max_flashes,
        help="a video with the needle carries 1 to this many flashes of distinct colours",
    )
    s.add_argument(
        "--ask-no-flash",
        action="store_true",
        help='ask the flash question of videos without a flash too, answered "none"',
    )
    s.add_argument(
        "--questions",
        type=_names,
        default=d.questions,
        help=f"question types asked, comma-separated (of {', '.join(QUESTION_TYPES)})",
    )
    s.add_argument(
        "--durations",
        type=_ints,
        default=d.durations,
        help="comma-separated seconds: video i lasts durations[i %% len] (default: drawn)",
    )
    s.add_argument(
        "--shape-scale",
        type=float,
        default=d.shape_scale,
        help="shapes' radii times this (1: 14-22 %% of the frame side)",
    )
    s.add_argument("--samples-per-shard", type=int, default=64)
    s.add_argument("--workers", type=int, default=1)
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    given = {
        f.name: getattr(a, f.name) for f in dataclasses.fields(SyntheticSpec) if hasattr(a, f.name)
    }
    try:
        spec = SyntheticSpec(**given)  # the flags named after SyntheticSpec's fields
    except ValueError as e:
        p.error(str(e))
    paths = write_synthetic_shards(
        a.out,
        a.n,
        seed=a.seed,
        spec=spec,
        samples_per_shard=a.samples_per_shard,
        workers=a.workers,
        progress=not a.quiet,
    )
    print(f"wrote {a.n} videos in {len(paths)} shards under {a.out}")
    return 0


def tokenize_main(argv: list[str]) -> int:
    d, fmt = TokenizeOptions(), argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(
        prog="longvideo tokenize",
        formatter_class=fmt,
        description="VQ-encode raw shards (video + json) into token shards (codes + "
        "timestamps + json). Resumable: finished shards are skipped.",
    )
    p.add_argument(
        "--vq", required=True, help="VQ checkpoint directory (longvideo train-vq output)"
    )
    p.add_argument(
        "--in",
        dest="inputs",
        required=True,
        nargs="+",
        help="raw shards: directories, globs, brace patterns, or URLs (http(s)://..., pipe:...; "
        "streamed, brace patterns allowed)",
    )
    p.add_argument("--out", required=True, help="output directory for token shards")
    p.add_argument(
        "--workers", type=int, default=1, help="worker processes (each loads the VQ once)"
    )
    p.add_argument(
        "--config",
        default=None,
        help="a root config; its data.fps/max_frames/max_resolution/"
        "video_backend/partial_videos/min_partial_fraction are the "
        "defaults",
    )
    p.add_argument(
        "--fps", type=float, default=None, help=f"frames per second to sample (default {d.fps})"
    )
    p.add_argument(
        "--max-frames", type=int, default=None, help=f"frame cap per video (default {d.max_frames})"
    )
    p.add_argument(
        "--max-resolution",
        type=int,
        default=None,
        help=f"longest frame side accepted (default {d.max_resolution})",
    )
    p.add_argument(
        "--batch-frames",
        type=int,
        default=None,
        help="frames per VQ forward (default: the config's infer.encode_batch_frames, else "
        f"{d.batch_frames})",
    )
    p.add_argument(
        "--backend",
        choices=["auto", "decord", "pyav"],
        default=None,
        help=f"video decoder (default {d.backend} = pyav; decord runs in a child process)",
    )
    p.add_argument(
        "--partial-videos",
        choices=["keep", "skip"],
        default=None,
        help=f"videos cut short or with frames lost to damage: keep what was read, or skip them "
        f"(default {d.partial_videos})",
    )
    p.add_argument(
        "--min-partial-fraction",
        type=float,
        default=None,
        help=f"least share of a partial video read for it to be kept (default "
        f"{d.min_partial_fraction})",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar, warnings only")
    a = p.parse_args(argv)
    logging.basicConfig(
        level=logging.ERROR if a.quiet else logging.WARNING, format="%(levelname)s %(message)s"
    )
    base = d
    if a.config:
        root = load_config(a.config)
        dc = root.data
        base = TokenizeOptions(
            fps=dc.fps,
            max_frames=dc.max_frames,
            max_resolution=dc.max_resolution,
            batch_frames=root.infer.encode_batch_frames,
            backend=dc.video_backend,
            partial_videos=dc.partial_videos,
            min_partial_fraction=dc.min_partial_fraction,
        )
    given = {
        f.name: getattr(a, f.name) for f in dataclasses.fields(TokenizeOptions)
    }  # the flags given
    opts = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
    if (
        opts.fps <= 0
        or (opts.max_frames is not None and opts.max_frames <= 0)
        or opts.batch_frames <= 0
    ):
        p.error("--fps, --max-frames and --batch-frames must be positive")
    if not 0.0 <= opts.min_partial_fraction <= 1.0:
        p.error("--min-partial-fraction must be in [0, 1]")
    try:
        stats = tokenize_shards(
            a.vq, a.inputs, a.out, opts, workers=a.workers, progress=not a.quiet
        )
    except FileNotFoundError as e:
        print(f"longvideo tokenize: {e}", file=sys.stderr)
        return 2
    print(json.dumps(stats, sort_keys=True))
    return 0
