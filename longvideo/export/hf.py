"""Hugging Face Llama <-> project checkpoints.

A *project checkpoint* is a directory with `config.yaml` (the root Config), `model.safetensors`
(the model's own parameter names, unsharded) and optionally `tokenizer/` and `vq/`.
An *exported directory* is what `transformers.AutoModelForCausalLM.from_pretrained` loads with no
custom code: a plain LlamaForCausalLM whose vocabulary is the unified one (text, the four vision
tokens, the VQ codes), plus `longvideo.yaml` (the root Config), `vq/` and a processor config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from longvideo.config import Config, load_config, save_config
from longvideo.configtools import from_dict, load_yaml
from longvideo.model import ModelConfig, Transformer

PROJECT_CONFIG = "config.yaml"
WEIGHTS = "model.safetensors"
EXPORT_CONFIG = "longvideo.yaml"

_LAYER_MAP = {  # ours -> transformers, per layer
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn.w_gate.weight": "mlp.gate_proj.weight",
    "ffn.w_up.weight": "mlp.up_proj.weight",
    "ffn.w_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_MAP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "head.weight": "lm_head.weight"}


class CheckpointError(ValueError):
    pass


def to_hf_names(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in sd.items():
        if name in _TOP_MAP:
            if name == "head.weight" and cfg.tie_embeddings:
                continue  # transformers re-ties lm_head to the embedding
            out[_TOP_MAP[name]] = t
            continue
        parts = name.split(".", 2)
        if parts[0] != "layers" or parts[2] not in _LAYER_MAP:
            raise CheckpointError(f"unexpected parameter '{name}'")
        out[f"model.layers.{parts[1]}.{_LAYER_MAP[parts[2]]}"] = t
    return out


def from_hf_names(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    inv_top = {v: k for k, v in _TOP_MAP.items()}
    inv_layer = {v: k for k, v in _LAYER_MAP.items()}
    out = {}
    for name, t in sd.items():
        if name in inv_top:
            out[inv_top[name]] = t
        elif name.startswith("model.layers."):
            _, _, idx, rest = name.split(".", 3)
            if rest not in inv_layer:
                if "rotary_emb" in rest:
                    continue
                raise CheckpointError(f"unexpected tensor '{name}' in the Hugging Face checkpoint")
            out[f"layers.{idx}.{inv_layer[rest]}"] = t
        elif "rotary_emb" in name:
            continue
        else:
            raise CheckpointError(f"unexpected tensor '{name}' in the Hugging Face checkpoint")
    if cfg.tie_embeddings:
        out.pop("head.weight", None)
        out["head.weight"] = out["tok_embeddings.weight"]
    elif "head.weight" not in out:
        raise CheckpointError("the checkpoint has no lm_head.weight but tie_word_embeddings is false")
    return out


def check_shapes(sd: dict[str, torch.Tensor], model: Transformer, source: str) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(sd))
    if missing:
        raise CheckpointError(f"{source}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    extra = sorted(set(sd) - set(expected))
    if extra:
        raise CheckpointError(f"{source}: unexpected tensors {extra[:5]}")
    for k, t in expected.items():
        if tuple(sd[k].shape) != tuple(t.shape):
            raise CheckpointError(f"{source}: tensor '{k}' has shape {tuple(sd[k].shape)}, "
                                  f"the config expects {tuple(t.shape)}")


# ---- reading transformers' config.json ------------------------------------------------------------

def rope_theta_of(hf_cfg: dict) -> float:
    """Read RoPE theta from either spelling transformers writes (rope_theta or rope_parameters)."""
    params = hf_cfg.get("rope_parameters") or hf_cfg.get("rope_scaling") or {}
    if isinstance(params, dict):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in (None, "default"):
            raise CheckpointError(f"config.json: rope type '{rope_type}' is not supported (only default RoPE)")
        if "rope_theta" in params:
            return float(params["rope_theta"])
    if "rope_theta" in hf_cfg:
        return float(hf_cfg["rope_theta"])
    return 10000.0


def model_config_from_hf(hf_cfg: dict, text_vocab_size: int, codebook_size: int) -> ModelConfig:
    archs = hf_cfg.get("architectures") or []
    if hf_cfg.get("model_type") != "llama" or (archs and "LlamaForCausalLM" not in archs):
        raise CheckpointError(f"config.json: expected a LlamaForCausalLM (model_type llama), got "
                              f"model_type={hf_cfg.get('model_type')!r} architectures={archs}")
    dim, heads = hf_cfg["hidden_size"], hf_cfg["num_attention_heads"]
    if hf_cfg.get("head_dim") not in (None, dim // heads):
        raise CheckpointError(f"config.json: head_dim {hf_cfg['head_dim']} != hidden_size/num_attention_heads")
    if hf_cfg.get("attention_bias") or hf_cfg.get("mlp_bias"):
        raise CheckpointError("config.json: attention or MLP biases are not supported")
    return ModelConfig(
        text_vocab_size=text_vocab_size, codebook_size=codebook_size, dim=dim,
        n_layers=hf_cfg["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf_cfg.get("num_key_value_heads", heads), ffn_dim=hf_cfg["intermediate_size"],
        norm_eps=float(hf_cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta_of(hf_cfg),
        max_seq_len=int(hf_cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(hf_cfg.get("tie_word_embeddings", False)),
    )


def hf_config_dict(cfg: ModelConfig, tokenizer=None) -> dict:
    """config.json for LlamaForCausalLM; RoPE written in both spellings transformers reads."""
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if tokenizer is not None:
        d.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    return d


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or the shards listed in model.safetensors.index.json."""
    single = path / WEIGHTS
    if single.is_file():
        return load_file(str(single))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        sd = {}
        for f in files:
            if not (path / f).is_file():
                raise FileNotFoundError(f"shard listed in {index} is missing: {path / f}")
            sd.update(load_file(str(path / f)))
        return sd
    raise FileNotFoundError(f"no {WEIGHTS} (or model.safetensors.index.json) in {path}")


# ---- project checkpoints ----------------------------------------------------------------------

def save_project_checkpoint(out_dir: str | Path, state_dict: dict[str, torch.Tensor], cfg: Config,
                            tokenizer=None, vq=None) -> Path:
    """Write config.yaml + model.safetensors (+ tokenizer/, vq/) into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    if cfg.model.tie_embeddings:
        sd.pop("head.weight", None)  # safetensors refuses shared storage; re-tied on load
    save_file(sd, str(out / WEIGHTS))
    save_config(cfg, out / PROJECT_CONFIG)
    if tokenizer is not None:
        tokenizer.save(out / "tokenizer")
    if vq is not None:
        vq.save(out / "vq")
    return out


def load_project_state(path: str | Path) -> tuple[dict[str, torch.Tensor], Config]:
    """(state dict, Config) of a project checkpoint, or of the latest checkpoint of a training run."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if (path / PROJECT_CONFIG).is_file() and (path / WEIGHTS).is_file():
        cfg = load_config(path / PROJECT_CONFIG)
        sd = load_file(str(path / WEIGHTS))
    else:
        try:  # a training run directory or a ZeRO checkpoint: the trainer knows how to consolidate
            from longvideo.train.checkpoint import load_model_state
        except ImportError as e:
            raise FileNotFoundError(f"{path} holds no {PROJECT_CONFIG} + {WEIGHTS}") from e
        sd, cfg = load_model_state(path)
    if cfg.model.tie_embeddings:
        sd["head.weight"] = sd["tok_embeddings.weight"]
    return sd, cfg


@dataclass
class Pretrained:
    """A loaded model with what it needs to read videos and text."""

    model: Transformer
    config: Config
    tokenizer: object = None
    vq: object = None
    path: Optional[Path] = None


def _find(path: Path, *names: str) -> Optional[Path]:
    for n in names:
        if (path / n).exists():
            return path / n
    return None


def load_pretrained(path: str | Path, device: str | torch.device = "cpu") -> Pretrained:
    """Load a project checkpoint, a training run, or an exported Hugging Face directory (eval mode)."""
    from longvideo.tokenizer import TextTokenizer

    path = Path(path)
    if (path / EXPORT_CONFIG).is_file() and (path / "config.json").is_file():
        cfg = load_config(path / EXPORT_CONFIG)
        sd = from_hf_names(read_safetensors_dir(path), cfg.model)
        tok_dir = path
    else:
        sd, cfg = load_project_state(path)
        tok_dir = _find(path, "tokenizer")
    model = Transformer(cfg.model)
    check_shapes(sd, model, str(path))
    model.load_state_dict(sd)
    model.to(device).eval()
    tokenizer = TextTokenizer.from_dir(tok_dir) if tok_dir is not None and _find(tok_dir, "tokenizer.json", "tokenizer.model") else None
    vq = None
    vq_dir = _find(path, "vq")
    if vq_dir is not None:
        from longvideo.vq import load_vq

        vq = load_vq(vq_dir)
    return Pretrained(model=model, config=cfg, tokenizer=tokenizer, vq=vq, path=path)


# ---- import / export ----------------------------------------------------------------------------

def import_hf(hf_dir: str | Path, out_dir: str | Path, base_config: Optional[str] = None,
              codebook_size: Optional[int] = None) -> Path:
    """Read a local LlamaForCausalLM (safetensors) into a project checkpoint, extending the
    vocabulary by the vision tokens and the VQ codes (new rows = mean of the existing rows)."""
    from longvideo.tokenizer import TextTokenizer

    hf_dir = Path(hf_dir)
    cfg_file = hf_dir / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in {hf_dir}")
    hf_cfg = json.loads(cfg_file.read_text())
    root = load_config(base_config) if base_config else Config()
    if (hf_dir / EXPORT_CONFIG).is_file():  # one of ours: the vocabulary is already unified
        root = load_config(hf_dir / EXPORT_CONFIG)
        return save_project_checkpoint(out_dir, from_hf_names(read_safetensors_dir(hf_dir), root.model), root,
                                       tokenizer=TextTokenizer.from_dir(hf_dir), vq=_maybe_vq(hf_dir))
    K = codebook_size or root.vq.codebook_size
    sd_hf = read_safetensors_dir(hf_dir)
    emb_key = "model.embed_tokens.weight"
    if emb_key not in sd_hf:
        raise CheckpointError(f"{hf_dir}: no tensor '{emb_key}'")
    v0 = sd_hf[emb_key].shape[0]
    tokenizer = None
    if _find(hf_dir, "tokenizer.json", "tokenizer.model"):
        from transformers import AutoTokenizer

        from longvideo.vocab import SPECIAL_TOKENS

        hf_tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True, use_fast=True)
        has_vision = SPECIAL_TOKENS[0] in hf_tok.get_vocab()
        if not has_vision and len(hf_tok) < v0:
            # a padded embedding: name the unused rows so that the vision tokens follow them
            hf_tok.add_tokens([f"<longvideo_unused_{i}>" for i in range(v0 - len(hf_tok))])
        tokenizer = TextTokenizer(hf_tok)
        if tokenizer.text_size != v0:
            raise CheckpointError(f"{hf_dir}: the tokenizer has {tokenizer.text_size} text ids but "
                                  f"model.embed_tokens.weight has {v0} rows")
    mcfg = model_config_from_hf(hf_cfg, text_vocab_size=v0, codebook_size=K)
    mcfg = replace(root.model, **{f: getattr(mcfg, f) for f in (
        "text_vocab_size", "codebook_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
        "norm_eps", "rope_theta", "max_seq_len", "tie_embeddings")})
    vq_cfg = replace(root.vq, codebook_size=K)
    root = replace(root, model=mcfg, vq=vq_cfg)
    sd_hf = dict(sd_hf)
    if mcfg.tie_embeddings:
        sd_hf.pop("lm_head.weight", None)
    sd = from_hf_names(sd_hf, mcfg)
    extra = mcfg.vocab_size - v0
    for key in ("tok_embeddings.weight", "head.weight"):
        if key == "head.weight" and mcfg.tie_embeddings:
            continue
        w = sd[key]
        sd[key] = torch.cat([w, w.float().mean(0, keepdim=True).to(w.dtype).expand(extra, -1)], dim=0)
    if mcfg.tie_embeddings:
        sd["head.weight"] = sd["tok_embeddings.weight"]
    check_shapes(sd, meta_model(mcfg), str(hf_dir))
    return save_project_checkpoint(out_dir, sd, root, tokenizer=tokenizer)


def meta_model(cfg: ModelConfig) -> Transformer:
    """A model on the meta device: shapes without memory."""
    with torch.device("meta"):
        return Transformer(cfg)


def _maybe_vq(path: Path):
    if (path / "vq").is_dir():
        from longvideo.vq import load_vq

        return load_vq(path / "vq")
    return None


def export_hf(ckpt: str | Path, out_dir: str | Path, tokenizer_dir: Optional[str | Path] = None,
              vq_dir: Optional[str | Path] = None) -> Path:
    """Write a Hugging Face directory (config.json, model.safetensors, tokenizer, generation config,
    longvideo.yaml, vq/ and the processor config) from a project checkpoint or training run."""
    from longvideo.tokenizer import TextTokenizer

    ckpt = Path(ckpt)
    sd, cfg = load_project_state(ckpt)
    check_shapes(sd, meta_model(cfg.model), str(ckpt))
    tok_src = Path(tokenizer_dir) if tokenizer_dir else _find(ckpt, "tokenizer")
    if tok_src is None:
        raise FileNotFoundError(f"{ckpt} has no tokenizer/ directory; pass --tokenizer DIR")
    tokenizer = TextTokenizer.from_dir(tok_src)
    if tokenizer.text_size != cfg.model.text_vocab_size:
        raise CheckpointError(f"tokenizer {tok_src} has {tokenizer.text_size} text ids, the model "
                              f"{cfg.model.text_vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_sd = {k: v.detach().float().contiguous() for k, v in to_hf_names(sd, cfg.model).items()}
    save_file(hf_sd, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg.model, tokenizer), indent=2))
    gen = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
           "pad_token_id": tokenizer.pad_id, "do_sample": False, "max_length": cfg.model.max_seq_len}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tokenizer.save(out)
    save_config(cfg, out / EXPORT_CONFIG)
    vq_src = Path(vq_dir) if vq_dir else _find(ckpt, "vq")
    if vq_src is not None:  # with a video tokenizer the directory also serves LongVideoProcessor
        from longvideo.export.processor import LongVideoProcessor
        from longvideo.vq import load_vq

        LongVideoProcessor.from_config(cfg, tokenizer, load_vq(vq_src)).save_pretrained(out)
    return out
