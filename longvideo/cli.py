"""`longvideo <command> ...`: one entry point. Commands are imported lazily (`--help` stays fast);
each target is a function `main(argv: list[str]) -> int`."""

from __future__ import annotations

import importlib
import sys

from longvideo import __version__

COMMANDS: dict[str, tuple[str, str]] = {
    "make-data": ("longvideo.data.cli:make_data_main", "write synthetic video-text shards"),
    "tokenize": ("longvideo.data.cli:tokenize_main", "VQ-encode raw shards into token shards"),
    "train-vq": ("longvideo.train.vq_cli:main", "train the VQ video tokenizer"),
    "prune-codes": (
        "longvideo.data.prune:main",
        "map a tokenizer's rare codes to their nearest kept code (and its token shards)",
    ),
    "train": (
        "longvideo.train.cli:main",
        "train the language model (torchrun/deepspeed/accelerate)",
    ),
    "chat": ("longvideo.infer.cli:chat_main", "answer questions about a video"),
    "generate": (
        "longvideo.infer.cli:generate_main",
        "generate a video or an image from text (classifier-free guidance)",
    ),
    "serve": (
        "longvideo.infer.serve_cli:main",
        "an OpenAI-compatible chat server about videos, with a web page",
    ),
    "eval": ("longvideo.infer.cli:eval_main", "QA accuracy and needle-in-a-haystack evaluations"),
    "import-hf": ("longvideo.export.cli:import_main", "read a Hugging Face Llama checkpoint"),
    "import-lwm": (
        "longvideo.export.cli:import_lwm_main",
        "convert LWM's released JAX chat checkpoints",
    ),
    "export": ("longvideo.export.cli:export_main", "write a Hugging Face checkpoint"),
    "consolidate": (
        "longvideo.export.consolidate_cli:main",
        "write model.safetensors from a checkpoint's ZeRO shards (no code in them runs)",
    ),
    "train-tokenizer": ("longvideo.tokenizer:cli_main", "train a small BPE text tokenizer"),
}


def usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: longvideo <command> [options]", "       longvideo --version", "", "commands:"]
    lines += [f"  {name:<{width}}  {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "`longvideo <command> --help` describes a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # the deepspeed launcher (without --no_local_rank) puts --local_rank=N before the command
    while argv and argv[0].split("=")[0] in ("--local_rank", "--local-rank"):
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"longvideo {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"longvideo: unknown command '{name}'\n\n{usage()}", file=sys.stderr)
        return 2
    module, func = COMMANDS[name][0].split(":")
    fn = getattr(importlib.import_module(module), func)
    return int(fn(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
