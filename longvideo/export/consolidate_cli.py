"""`longvideo consolidate`: write model.safetensors into a checkpoint that holds only DeepSpeed's
ZeRO shards (train.save_weights=false), so that chat, serve, eval, export and --init-from read
safetensors only (docs/security.md, "Checkpoints")."""

from __future__ import annotations

import argparse
import sys

from longvideo.checkpoint import consolidate_checkpoint


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="longvideo consolidate",
        description="Consolidate a checkpoint's ZeRO shards (torch pickles) into model.safetensors "
        "beside them, read with torch's weights-only unpickler: tensors only, nothing in the "
        "files runs.",
    )
    p.add_argument("--ckpt", required=True, help="a checkpoint directory or a run directory")
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="read the shards with the full unpickler, which runs whatever they name: only for "
        "a run you wrote yourself, when the weights-only unpickler refuses it",
    )
    a = p.parse_args(argv)
    try:
        out = consolidate_checkpoint(a.ckpt, trust_pickle=a.trust_pickle)
    except (FileNotFoundError, ValueError) as e:  # CheckpointError is a ValueError
        print(f"longvideo consolidate: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
