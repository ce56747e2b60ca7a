"""`longvideo train-vq`: train the video tokenizer from a config.

    longvideo train-vq --config configs/vq/tiny.yaml --data data/raw --out runs/vq-tiny
    longvideo train-vq --config configs/vq/tiny.yaml --synthetic 200 --out runs/vq-tiny --time-budget 180
    longvideo train-vq --config configs/tiny.yaml --data 'shards/shard-{000000..000009}.tar' --out runs/vq steps=5000

The config is a VQ file (configs/vq/*.yaml, flat keys) or a root config (its `vq:` section).
Trailing `key=value` arguments override config keys (`vq.` prefixes are accepted).
Rerunning with the same --out resumes from the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys

from longvideo.data.frames import synthetic_videos
from longvideo.train.vq import VQTrainer, VQTrainSettings
from longvideo.vq.config import load_vq_config


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="longvideo train-vq",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="VQ yaml (configs/vq/*.yaml) or a root config")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--data",
        help="folder of videos, a video file, or raw shards (dir, glob, {a..b} pattern, "
        "or URLs: http(s)://..., pipe:...)",
    )
    src.add_argument(
        "--synthetic",
        type=int,
        metavar="N",
        help="train on N generated moving-shapes videos instead (no files needed)",
    )
    p.add_argument(
        "--synthetic-fps", type=float, default=4.0, help="frame rate of --synthetic videos"
    )
    p.add_argument(
        "--out", required=True, help="output directory (model.safetensors, config.json, logs)"
    )
    p.add_argument("--steps", type=int, help="override the config's steps")
    p.add_argument(
        "--time-budget",
        type=float,
        metavar="SECONDS",
        help="also stop after this much training time",
    )
    p.add_argument(
        "--no-resume", action="store_true", help="start over even if --out holds a checkpoint"
    )
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--no-tensorboard", action="store_true", help="do not write TensorBoard logs")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides, e.g. lr=1e-3"
    )
    a = p.parse_args(argv)
    settings = VQTrainSettings(
        out_dir=a.out,
        steps=a.steps,
        time_budget_s=a.time_budget,
        resume=not a.no_resume,
        device=a.device,
        progress=not a.quiet,
        tensorboard=not a.no_tensorboard,
    )
    try:  # a config error (ConfigError is a ValueError) or unusable data: one line, exit status 2
        cfg = load_vq_config(a.config, a.overrides)
        source = (
            a.data
            if not a.synthetic
            else synthetic_videos(a.synthetic, cfg, fps=a.synthetic_fps, seed=cfg.seed)
        )
        result = VQTrainer(cfg, settings).run(source)
    except (FileNotFoundError, ValueError) as e:
        print(f"train-vq: {e}", file=sys.stderr)
        return 2
    print(
        json.dumps(
            {
                "out": str(result.out_dir),
                "step": result.step,
                "seconds": round(result.seconds, 1),
                **{
                    k: round(v, 4) if isinstance(v, float) else v for k, v in result.metrics.items()
                },
            }
        )
    )
    return 0
