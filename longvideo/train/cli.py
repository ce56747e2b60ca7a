"""`longvideo train --config CONFIG [section.key=value ...] [--resume] [--init-from DIR]`, run by every
rank under torchrun, deepspeed or accelerate (docs/training.md). Exit codes: 0 done (or stopped by
SIGTERM/SIGINT after a checkpoint), 1 the run failed, 2 a configuration error, before any work."""

from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist

from longvideo.config import load_config
from longvideo.configtools import ConfigError
from longvideo.train.trainer import TrainingError, train


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="longvideo train",
        description="Train the language model (ring "
        "attention over the sp axis, DeepSpeed ZeRO over all ranks).",
    )
    p.add_argument("--config", required=True, help="YAML config (a path, or relative to configs/)")
    p.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4 parallel.sp=2"
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from OUT/checkpoints/latest if there is one"
    )
    p.add_argument(
        "--init-from", default=None, help="start from these model weights (previous stage)"
    )
    p.add_argument("--out", default=None, help="run directory (same as train.out_dir=...)")
    p.add_argument(
        "--deepspeed", default=None, help="DeepSpeed JSON with tuning keys (train.deepspeed_config)"
    )
    # the deepspeed launcher passes --local_rank unless told --no_local_rank; LOCAL_RANK is in the env
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_intermixed_args(argv)  # overrides may follow options
    overrides = list(args.overrides)
    if args.out:
        overrides.append(f"train.out_dir={args.out}")
    ds_file = args.deepspeed or os.environ.get(
        "ACCELERATE_DEEPSPEED_CONFIG_FILE"
    )  # accelerate's DeepSpeed plugin
    if ds_file:
        overrides.append(f"train.deepspeed_config={ds_file}")
    try:
        cfg = load_config(args.config, overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"longvideo train: {e}", file=sys.stderr)
        return 2

    code = 0
    try:
        result = train(cfg, resume=args.resume, init_from=args.init_from)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(
                f"{result.status} at step {result.step}; checkpoint {result.checkpoint or '-'}",
                flush=True,
            )
    except (ConfigError, TrainingError) as e:
        print(f"longvideo train: {e}", file=sys.stderr, flush=True)
        code = 2 if isinstance(e, ConfigError) else 1
    except RuntimeError as e:  # a collective failed: usually another rank died or timed out
        rank = os.environ.get("RANK", "?")
        print(
            f"longvideo train (rank {rank}): {type(e).__name__}: {e}\n"
            f"(a collective failed; another rank has probably died or hung)",
            file=sys.stderr,
            flush=True,
        )
        code = 1
    if code != 0 and dist.is_initialized() and dist.get_world_size() > 1:
        # peers may be gone: tearing the group down could block, so leave at once
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(code)
    if dist.is_initialized():
        dist.destroy_process_group()
    return code
