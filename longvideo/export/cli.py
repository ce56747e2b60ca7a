"""`longvideo import-hf`, `longvideo import-lwm` and `longvideo export`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from longvideo.export.hf import DEFAULT_MAX_SHARD_SIZE, DTYPES, export_hf, import_hf
from longvideo.export.lwm import import_lwm
from longvideo.safepickle import UnsafePickleError

ERRORS = (FileNotFoundError, ValueError)  # CheckpointError and the format errors are ValueErrors


def _parser(prog: str, description: str, out: str = "project checkpoint directory to write"):
    p = argparse.ArgumentParser(prog=f"longvideo {prog}", description=description)
    p.add_argument("--out", required=True, help=out)
    return p


def _run(
    prog: str,
    convert: Callable[[], Path],
    errors: tuple = ERRORS,
    done: str = "wrote project checkpoint",
) -> int:
    """convert(), then "{done} OUT"; an error of `errors` is one line and exit status 1."""
    try:
        out = convert()
    except errors as e:
        print(f"longvideo {prog}: error: {e}", file=sys.stderr)
        return 1
    print(f"{done} {out}")
    return 0


def import_main(argv: list[str]) -> int:
    p = _parser(
        "import-hf",
        "Read a local transformers decoder (Llama 1-3.x, SmolLM2, Qwen2/2.5, Qwen3, Mistral; "
        "docs/models.md) into a project checkpoint, extending its vocabulary with the vision "
        "tokens and VQ codes.",
    )
    p.add_argument("--hf", required=True, help="local Hugging Face model directory (safetensors)")
    p.add_argument("--config", default=None, help="root config to take the non-model sections from")
    p.add_argument(
        "--codebook-size", type=int, default=None, help="VQ codebook size (default: the config's)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    return _run(
        "import-hf",
        lambda: import_hf(
            a.hf,
            a.out,
            base_config=a.config,
            codebook_size=a.codebook_size,
            progress=False if a.quiet else None,
        ),
    )


def import_lwm_main(argv: list[str]) -> int:
    p = _parser(
        "import-lwm",
        "Convert LWM's released JAX checkpoints (LWM-Chat-32K/128K/1M: params, "
        "vqgan, tokenizer) into a project checkpoint for `longvideo chat` and `longvideo export`. "
        "See docs/lwm.md.",
    )
    p.add_argument("--params", required=True, help="LWM's params file (tux streaming checkpoint)")
    p.add_argument(
        "--vqgan",
        required=True,
        help="LWM's vqgan file (pickled flax parameters; read without running anything it names)",
    )
    p.add_argument(
        "--tokenizer",
        required=True,
        help="directory with LWM's tokenizer.model (LLaMA), or a Hugging Face tokenizer directory",
    )
    p.add_argument(
        "--config",
        default="lwm-chat-1m",
        help="what the files do not hold (RoPE theta, "
        "context): lwm-chat-32k, lwm-chat-128k, lwm-chat-1m (default) or a YAML path",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted config overrides, e.g. model.max_seq_len=65536",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    a = p.parse_intermixed_args(argv)
    say = (
        None if a.quiet else (lambda msg: print(f"import-lwm: {msg}", file=sys.stderr, flush=True))
    )
    return _run(
        "import-lwm",
        lambda: import_lwm(
            a.params,
            a.vqgan,
            a.tokenizer,
            a.out,
            config=a.config,
            overrides=a.overrides,
            progress=say,
        ),
        ERRORS + (UnsafePickleError, ImportError),
    )


EXPORT_EPILOG = """\
Loading the directory:
  AutoModelForCausalLM.from_pretrained(OUT)   a plain LlamaForCausalLM: no trust_remote_code.
    A model trained with model.attn_logn_base > 0 (the hour models) scales its queries with
    their position, which transformers' Llama cannot: it is written as LongVideoLlamaForCausalLM
    with its code (modeling_longvideo.py) and loads with trust_remote_code=True only.
  AutoProcessor.from_pretrained(OUT, trust_remote_code=True)   (with a VQ in the checkpoint)
    the processor is longvideo's own (processing_longvideo.py imports it: pip install longvideo);
    longvideo.export.LongVideoProcessor.from_pretrained(OUT) needs no remote code.
  AutoTokenizer.from_pretrained(OUT)   with the QA prompt as its chat template.
See docs/export.md."""


def export_main(argv: list[str]) -> int:
    p = _parser(
        "export",
        "Write a Hugging Face directory: config.json, safetensors weights (sharded with an index "
        "past --max-shard-size), tokenizer, generation config, VQ and processor.",
        "output directory",
    )
    p.epilog = EXPORT_EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument(
        "--ckpt",
        required=True,
        help="project checkpoint, training run directory or ZeRO checkpoint",
    )
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer directory (default: CKPT/tokenizer)"
    )
    p.add_argument(
        "--vq", default=None, help="VQ tokenizer directory (default: CKPT/vq if present)"
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="the weights' dtype in the files and config.json (default fp32)",
    )
    p.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help="largest weight file, e.g. 5GB, 500MB, 2GiB (default %(default)s); past it the "
        "weights are shards with model.safetensors.index.json",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    return _run(
        "export",
        lambda: export_hf(
            a.ckpt,
            a.out,
            tokenizer_dir=a.tokenizer,
            vq_dir=a.vq,
            dtype=a.dtype,
            max_shard_size=a.max_shard_size,
            progress=False if a.quiet else None,
        ),
        done="exported",
    )
