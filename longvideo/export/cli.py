"""`longvideo import-hf` and `longvideo export`."""

from __future__ import annotations

import argparse
import sys

from longvideo.checkpoint import CheckpointError
from longvideo.export.hf import export_hf, import_hf


def import_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="longvideo import-hf",
                                description="Read a local Hugging Face LlamaForCausalLM into a project checkpoint, "
                                            "extending its vocabulary with the vision tokens and VQ codes.")
    p.add_argument("--hf", required=True, help="local Hugging Face model directory (safetensors)")
    p.add_argument("--out", required=True, help="project checkpoint directory to write")
    p.add_argument("--config", default=None, help="root config to take the non-model sections from")
    p.add_argument("--codebook-size", type=int, default=None, help="VQ codebook size (default: the config's)")
    a = p.parse_args(argv)
    try:
        out = import_hf(a.hf, a.out, base_config=a.config, codebook_size=a.codebook_size)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"longvideo import-hf: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote project checkpoint {out}")
    return 0


def export_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="longvideo export",
                                description="Write a Hugging Face directory that transformers loads with no custom code.")
    p.add_argument("--ckpt", required=True, help="project checkpoint, training run directory or ZeRO checkpoint")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: CKPT/tokenizer)")
    p.add_argument("--vq", default=None, help="VQ tokenizer directory (default: CKPT/vq if present)")
    a = p.parse_args(argv)
    try:
        out = export_hf(a.ckpt, a.out, tokenizer_dir=a.tokenizer, vq_dir=a.vq)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"longvideo export: error: {e}", file=sys.stderr)
        return 1
    print(f"exported {out}")
    return 0
