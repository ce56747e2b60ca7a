"""Hugging Face decoders <-> project checkpoints: `longvideo import-hf` and `longvideo export`.

The formats (project checkpoints, exported directories) are longvideo.checkpoint's, the families
(config.json and tensor names of Llama, Qwen2, Qwen3, Mistral) longvideo.model.families'; this
module converts between them. docs/export.md, docs/models.md.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from longvideo.atomic import atomic_dir, write_bytes_atomic
from longvideo.checkpoint import (
    CONFIG_FILE,
    EXPORT_CONFIG,
    TOKENIZER_DIR,
    VQ_DIR,
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    CheckpointError,
    check_shapes,
    from_hf_names,
    load_project_state,
    read_safetensors_dir,
    save_project_checkpoint,
    streaming_weights,
    tie,
    to_hf_names,
)
from longvideo.config import Config, load_config, save_config
from longvideo.export.processor import LongVideoProcessor, ProcessorSettings, chat_template
from longvideo.model import ModelConfig, families
from longvideo.model.families import LOGN_MODULE
from longvideo.tokenizer import TextTokenizer
from longvideo.vocab import SPECIAL_TOKENS
from longvideo.vq import load_vq


def model_config_from_hf(
    hf_cfg: dict, base: ModelConfig, text_vocab_size: int, codebook_size: int
) -> ModelConfig:
    """`base` with the architecture of a transformers config.json of a supported family
    (longvideo.model.families; FamilyError, a ValueError, naming the key otherwise)."""
    return families.model_config_from_hf(
        hf_cfg, base, text_vocab_size=text_vocab_size, codebook_size=codebook_size
    )


def hf_config_dict(cfg: ModelConfig, tokenizer=None) -> dict:
    """config.json of the model's family (longvideo.model.families.hf_config), with the tokenizer's
    special ids. A model whose queries scale with the context is a LongVideoLlamaForCausalLM
    (docs/export.md, "Models whose queries scale with the context")."""
    d = families.hf_config(cfg)
    d.update(torch_dtype="float32", dtype="float32")
    if tokenizer is not None:
        d.update(
            bos_token_id=tokenizer.bos_id,
            eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.pad_id,
        )
    return d


def generation_config(cfg: ModelConfig, tokenizer) -> dict:
    """generation_config.json: greedy decoding, the tokenizer's special ids and, where the vocabulary
    says answers are text only (LWM's layout), every other id suppressed, as `longvideo chat` does."""
    gen = {
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
        "do_sample": False,
        "max_length": cfg.max_seq_len,
    }
    limit = cfg.vocab.answer_limit
    if limit is not None:
        gen["suppress_tokens"] = list(range(limit, cfg.vocab_size))
    return gen


# export's --dtype: the weights' dtype on disk and config.json's
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_MAX_SHARD_SIZE = "5GB"  # as transformers' save_pretrained
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: str | int) -> int:
    """Bytes of a size such as 5GB, 500MB, 2GiB or 1000000 (transformers' spelling)."""
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(f"max shard size: expected e.g. 5GB, 500MB or 2GiB, got {size!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"max shard size must be positive, got {size!r}")
    return n


def shard_names(
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], max_bytes: int
) -> list[list[str]]:
    """Tensor names per shard, in order, each shard at most `max_bytes` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, (dtype, shape) in specs.items():
        n = dtype.itemsize * int(torch.Size(shape).numel())
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_hf_weights(
    out: Path,
    hf_sd: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = parse_size(DEFAULT_MAX_SHARD_SIZE),
    progress: bool | None = None,
) -> list[str]:
    """model.safetensors, or shards model-0000i-of-0000n.safetensors with
    model.safetensors.index.json once the weights pass `max_shard_bytes`, as transformers writes
    them; one tensor at a time (a bf16 checkpoint is never held twice in fp32). The file names."""
    specs = {k: (dtype, tuple(v.shape)) for k, v in hf_sd.items()}
    shards = shard_names(specs, max_shard_bytes)
    n = len(shards)
    files = (
        [WEIGHTS_FILE]
        if n == 1
        else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    total = sum(dtype.itemsize * int(torch.Size(s).numel()) for _, s in specs.values())
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="export", disable=_quiet(progress)
    ) as bar:
        for file, names in zip(files, shards):
            with streaming_weights(
                out / file, {k: specs[k] for k in names}, metadata={"format": "pt"}
            ) as w:
                for k in names:
                    w.write(k, hf_sd[k].to(dtype))
                    bar.update(dtype.itemsize * hf_sd[k].numel())
    if n > 1:
        weight_map = {k: f for f, names in zip(files, shards) for k in names}
        doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_bytes_atomic(out / WEIGHTS_INDEX, json.dumps(doc, indent=2).encode())
    return files


def _quiet(progress: bool | None) -> bool | None:
    """tqdm's `disable`: progress True shows a bar, False hides it, None shows it on a terminal."""
    return None if progress is None else not progress


def import_hf(
    hf_dir: str | Path,
    out_dir: str | Path,
    base_config: str | None = None,
    codebook_size: int | None = None,
    progress: bool | None = None,
) -> Path:
    """Read a local transformers decoder of a supported family (safetensors) into a project
    checkpoint, extending the vocabulary by the vision tokens and the VQ codes (new rows = mean of
    the existing rows). progress: bars for reading and writing the weights (None: on a terminal
    only)."""
    hf_dir = Path(hf_dir)
    cfg_file = hf_dir / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in {hf_dir}")
    hf_cfg = json.loads(cfg_file.read_text())
    root = load_config(base_config) if base_config else Config()
    if (hf_dir / EXPORT_CONFIG).is_file():  # one of ours: the vocabulary is already unified
        root = load_config(hf_dir / EXPORT_CONFIG)
        with atomic_dir(out_dir, marker=CONFIG_FILE) as tmp:  # config.yaml last: then it is whole
            save_project_checkpoint(
                tmp,
                from_hf_names(
                    read_safetensors_dir(hf_dir, progress=_bar("read", progress)), root.model
                ),
                root,
                tokenizer=TextTokenizer.from_dir(hf_dir, root.model.vocab_layout),
                vq=load_vq(hf_dir / VQ_DIR) if (hf_dir / VQ_DIR).is_dir() else None,
                progress=_bar("write", progress),
            )
        return Path(out_dir)
    K = codebook_size or root.vq.codebook_size
    sd_hf = read_safetensors_dir(hf_dir, progress=_bar("read", progress))
    emb_key = "model.embed_tokens.weight"
    if emb_key not in sd_hf:
        raise CheckpointError(f"{hf_dir}: no tensor '{emb_key}'")
    v0 = sd_hf[emb_key].shape[0]
    if hf_cfg.get("vocab_size") not in (None, v0):
        raise families.FamilyError(
            "vocab_size", f"{hf_cfg['vocab_size']}, but {emb_key} has {v0} rows"
        )
    tokenizer = None
    if any((hf_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        hf_tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True, use_fast=True)
        has_vision = SPECIAL_TOKENS[0] in hf_tok.get_vocab()
        if not has_vision and len(hf_tok) < v0:
            # a padded embedding: name the unused rows so that the vision tokens follow them
            hf_tok.add_tokens([f"<longvideo_unused_{i}>" for i in range(v0 - len(hf_tok))])
        tokenizer = TextTokenizer(hf_tok)
        if tokenizer.text_size != v0:
            raise CheckpointError(
                f"{hf_dir}: the tokenizer has {tokenizer.text_size} text ids but "
                f"model.embed_tokens.weight has {v0} rows"
            )
    mcfg = model_config_from_hf(hf_cfg, root.model, text_vocab_size=v0, codebook_size=K)
    root = replace(root, model=mcfg, vq=replace(root.vq, codebook_size=K))
    if mcfg.tie_embeddings:
        sd_hf.pop("lm_head.weight", None)
    sd = from_hf_names(sd_hf, mcfg)
    extra = mcfg.vocab_size - v0
    for key in ("tok_embeddings.weight",) + (() if mcfg.tie_embeddings else ("head.weight",)):
        w = sd[key]
        sd[key] = torch.cat(
            [w, w.float().mean(0, keepdim=True).to(w.dtype).expand(extra, -1)], dim=0
        )
    sd = tie(sd, mcfg)
    check_shapes(sd, mcfg, str(hf_dir))
    with atomic_dir(out_dir, marker=CONFIG_FILE) as tmp:  # config.yaml last: then it is whole
        save_project_checkpoint(
            tmp, sd, root, tokenizer=tokenizer, progress=_bar("write", progress)
        )
    return Path(out_dir)


def _bar(what: str, progress: bool | None) -> tqdm:
    return tqdm(unit="B", unit_scale=True, desc=f"import-hf: {what}", disable=_quiet(progress))


def export_hf(
    ckpt: str | Path,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    vq_dir: str | Path | None = None,
    dtype: str = "fp32",
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    progress: bool | None = None,
) -> Path:
    """Write a Hugging Face directory (config.json, the weights in `dtype` (bf16, fp16 or fp32),
    sharded past `max_shard_size`, the tokenizer with its chat template, generation config,
    longvideo.yaml, vq/ and the processor) from a project checkpoint or training run. Atomic
    (longvideo.atomic.atomic_dir): the files are written beside `out_dir` and moved in with
    config.json last, so a directory with config.json holds a whole export."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    weights = WeightsFormat(DTYPES[dtype], parse_size(max_shard_size), progress)
    # an earlier export's weights go with its config.json: one file and shards never mix
    stale = (WEIGHTS_FILE, WEIGHTS_INDEX, "model-*-of-*.safetensors")
    with atomic_dir(out_dir, marker="config.json", clear=stale) as tmp:
        _export_into(ckpt, tmp, tokenizer_dir, vq_dir, weights)
    return Path(out_dir)


@dataclass(frozen=True)
class WeightsFormat:
    """How an export writes its weights: their dtype, the largest shard (bytes), progress bars."""

    dtype: torch.dtype
    max_shard_bytes: int
    progress: bool | None


def _export_into(
    ckpt: str | Path,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None,
    vq_dir: str | Path | None,
    weights: WeightsFormat,
) -> Path:
    ckpt = Path(ckpt)
    sd, cfg = load_project_state(ckpt)
    check_shapes(sd, cfg.model, str(ckpt))
    tok_src = Path(tokenizer_dir) if tokenizer_dir else ckpt / TOKENIZER_DIR
    if not tok_src.is_dir():
        raise FileNotFoundError(f"{ckpt} has no {TOKENIZER_DIR}/ directory; pass --tokenizer DIR")
    tokenizer = TextTokenizer.from_dir(tok_src, cfg.model.vocab_layout)
    if tokenizer.text_size != cfg.model.text_vocab_size:
        raise CheckpointError(
            f"tokenizer {tok_src} has {tokenizer.text_size} text ids, the model "
            f"{cfg.model.text_vocab_size}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_sd = to_hf_names(sd, cfg.model)
    write_hf_weights(out, hf_sd, weights.dtype, weights.max_shard_bytes, weights.progress)
    hf_cfg = hf_config_dict(cfg.model, tokenizer)
    name = str(weights.dtype).removeprefix("torch.")
    hf_cfg.update(torch_dtype=name, dtype=name)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    if cfg.model.attn_logn_base:
        shutil.copyfile(Path(__file__).with_name(f"{LOGN_MODULE}.py"), out / f"{LOGN_MODULE}.py")
    (out / "generation_config.json").write_text(
        json.dumps(generation_config(cfg.model, tokenizer), indent=2)
    )
    settings = ProcessorSettings.from_config(cfg)
    template = chat_template(settings)
    if template is not None:  # the text side's prompt, for tokenizer.apply_chat_template
        tokenizer.hf.chat_template = template
    tokenizer.save(out)
    save_config(cfg, out / EXPORT_CONFIG)
    vq_src = Path(vq_dir) if vq_dir else ckpt / VQ_DIR
    if vq_src.is_dir():  # with a video tokenizer the directory also serves LongVideoProcessor
        processor = LongVideoProcessor(tokenizer, load_vq(vq_src), settings)
        processor.save_pretrained(out)
    return out
