"""The transformers decoder families the project's decoder computes, in one place (docs/models.md):
Llama (1-3.x, SmolLM2), Qwen2 / Qwen2.5, Qwen3 and Mistral. For each: how its `config.json` maps
onto ModelConfig (read whole: every key is mapped, known to change nothing the decoder computes, or
refused with an error naming it), the tensor names both ways, and the `config.json` an export
writes. Nothing outside this module branches on a family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from longvideo.configtools import ConfigError
from longvideo.model.config import ModelConfig, RopeScaling

# an export whose queries scale with the context (ModelConfig.attn_logn_base): Llama plus the
# transformers code of modeling_longvideo.py (docs/export.md)
LOGN_MODULE = "modeling_longvideo"
LOGN_MODEL_TYPE, LOGN_ARCH = "longvideo_llama", "LongVideoLlamaForCausalLM"


class FamilyError(ValueError):
    """A transformers config.json (or a checkpoint's tensors) the project's decoder cannot compute
    exactly; `key` names the config.json key (or tensor) at fault."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config.json: key '{key}': {message}")


# ----------------------------------------------------------------------------- config.json keys

IGNORED = frozenset(
    {
        # bookkeeping of transformers' PreTrainedConfig: nothing the forward computes
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "initializer_range",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "tokenizer_class",
        # the tokenizer's ids: the tokenizer directory carries them (an export writes them back)
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    }
)
"""Keys of any family's config.json that change nothing the decoder computes."""

COMMON = frozenset(
    {
        "architectures",
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "attention_dropout",
        "partial_rotary_factor",
    }
)
"""Keys every family maps (or checks)."""

ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta", "partial_rotary_factor"},
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "llama3": {
        "factor",
        "original_max_position_embeddings",
        "low_freq_factor",
        "high_freq_factor",
    },
}
"""The keys of transformers' rope_parameters the project reads, per rope type (its validators'
required and optional keys); `default`'s are allowed for every type."""

YARN_OPTIONAL = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")


@dataclass(frozen=True)
class Family:
    """One transformers architecture. `keys`: the config.json keys of this family beyond COMMON
    and IGNORED; `read(hf, get)` -> the ModelConfig fields those keys (and the family's fixed
    architecture) set, `write(cfg)` -> the family's config.json keys for cfg, `check(cfg)` -> the
    name of a field the family cannot express, with why (or None)."""

    name: str
    model_type: str
    architecture: str
    keys: frozenset
    defaults: Mapping[str, Any]
    read: Callable[[dict, Callable], dict]
    write: Callable[[ModelConfig], dict]
    check: Callable[[ModelConfig], tuple[str, str] | None]


def _head_dim(hf: dict, get) -> dict:
    """head_dim given apart from hidden_size / num_attention_heads (null when it is that)."""
    hd = get("head_dim")
    derived = hf["hidden_size"] // hf["num_attention_heads"]
    if hd is None or int(hd) == derived and hf["hidden_size"] % hf["num_attention_heads"] == 0:
        return {"attn_head_dim": None}
    return {"attn_head_dim": int(hd)}


def _biases(get, key: str = "attention_bias") -> dict:
    on = bool(get(key))
    return {"qkv_bias": on, "attn_out_bias": on}


def _qwen_window(hf: dict, get) -> dict:
    """Qwen2/Qwen3: a window only where use_sliding_window is true, on the layers from
    max_window_layers on (or as layer_types says); refused unless it covers the context."""
    window = get("sliding_window") if get("use_sliding_window") else None
    layer_types = get("layer_types")
    n = hf["num_hidden_layers"]
    if layer_types is None:
        max_window = get("max_window_layers")
        layer_types = [
            "sliding_attention" if window is not None and i >= max_window else "full_attention"
            for i in range(n)
        ]
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown or len(layer_types) != n:
        raise FamilyError(
            "layer_types", f"expected {n} of full_attention / sliding_attention, got {layer_types}"
        )
    if "sliding_attention" in layer_types:
        _check_window(window, hf, get, "use_sliding_window")
    return {}


def _check_window(window, hf: dict, get, key: str) -> None:
    context = int(get("max_position_embeddings"))
    if window is not None and int(window) < context:
        raise FamilyError(
            key,
            f"a sliding window of {window} tokens, shorter than the context of {context} "
            "(max_position_embeddings): the decoder attends to every earlier token, so it would "
            "compute another model past the window. Set sliding_window to null (or at least "
            "max_position_embeddings) in config.json if the model was trained without one",
        )


def _mistral_window(hf: dict, get) -> dict:
    _check_window(get("sliding_window"), hf, get, "sliding_window")
    return {}


def _llama_read(hf: dict, get) -> dict:
    if get("mlp_bias"):
        raise FamilyError("mlp_bias", "biases in the feed-forward projections are not computed")
    if get("rope_interleaved"):
        raise FamilyError(
            "rope_interleaved",
            "true: transformers' Llama rotates half-split pairs whatever this key says, so the "
            "weights' convention is ambiguous; convert them to half-split and set it false",
        )
    return {**_head_dim(hf, get), **_biases(get)}


def _qwen2_read(hf: dict, get) -> dict:
    return {**_head_dim(hf, get), **_qwen_window(hf, get), "qkv_bias": True, "attn_out_bias": False}


def _qwen3_read(hf: dict, get) -> dict:
    return {**_head_dim(hf, get), **_qwen_window(hf, get), **_biases(get), "qk_norm": True}


def _mistral_read(hf: dict, get) -> dict:
    return {**_head_dim(hf, get), **_mistral_window(hf, get)}


def _no_window_qwen(cfg: ModelConfig) -> dict:
    return dict(
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=cfg.n_layers,
        layer_types=["full_attention"] * cfg.n_layers,
    )


def _need(cond: bool, key: str, why: str) -> tuple[str, str] | None:
    return None if cond else (key, why)


def _first(*problems) -> tuple[str, str] | None:
    return next((p for p in problems if p is not None), None)


def _llama_check(cfg: ModelConfig):
    return _first(
        _need(not cfg.qk_norm, "qk_norm", "Llama has no q/k norm (family qwen3 has)"),
        _need(
            cfg.qkv_bias == cfg.attn_out_bias,
            "attn_out_bias",
            "Llama's attention_bias sets the q/k/v and output biases together (family qwen2 "
            "has q/k/v biases only)",
        ),
        _need(
            cfg.dim % cfg.n_heads == 0,
            "n_heads",
            f"transformers' Llama needs n_heads to divide dim={cfg.dim} (family qwen3 does not)",
        ),
    )


def _qwen2_check(cfg: ModelConfig):
    return _first(
        _need(cfg.qkv_bias, "qkv_bias", "Qwen2 always has q/k/v biases"),
        _need(not cfg.attn_out_bias, "attn_out_bias", "Qwen2 has no output bias"),
        _need(not cfg.qk_norm, "qk_norm", "Qwen2 has no q/k norm (family qwen3 has)"),
    )


def _qwen3_check(cfg: ModelConfig):
    return _first(
        _need(cfg.qk_norm, "qk_norm", "Qwen3 always normalises q and k per head"),
        _need(
            cfg.qkv_bias == cfg.attn_out_bias,
            "attn_out_bias",
            "Qwen3's attention_bias sets the q/k/v and output biases together",
        ),
    )


def _mistral_check(cfg: ModelConfig):
    return _first(
        _need(not (cfg.qkv_bias or cfg.attn_out_bias), "qkv_bias", "Mistral has no biases"),
        _need(not cfg.qk_norm, "qk_norm", "Mistral has no q/k norm"),
    )


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name="llama",
            model_type="llama",
            architecture="LlamaForCausalLM",
            keys=frozenset(
                {
                    "head_dim",
                    "attention_bias",
                    "mlp_bias",
                    # transformers 4 split these matmuls in pretraining_tp pieces: the same sum
                    "pretraining_tp",
                    # Llama 1 conversions write it beside max_position_embeddings; transformers
                    # never reads it
                    "max_sequence_length",
                    "rope_interleaved",  # SmolLM2 writes false (refused when true)
                    "is_llama_config",  # SmolLM2's marker
                    "transformers.js_config",  # SmolLM2's settings for transformers.js
                }
            ),
            defaults={"max_position_embeddings": 2048, "num_key_value_heads": None},
            read=_llama_read,
            write=lambda cfg: dict(
                head_dim=cfg.head_dim, attention_bias=cfg.qkv_bias, mlp_bias=False
            ),
            check=_llama_check,
        ),
        Family(
            name="qwen2",
            model_type="qwen2",
            architecture="Qwen2ForCausalLM",
            keys=frozenset(
                {
                    "head_dim",
                    "use_sliding_window",
                    "sliding_window",
                    "max_window_layers",
                    "layer_types",
                }
            ),
            defaults={
                "max_position_embeddings": 32768,
                "num_key_value_heads": 32,
                "use_sliding_window": False,
                "sliding_window": 4096,
                "max_window_layers": 28,
            },
            read=_qwen2_read,
            write=lambda cfg: dict(head_dim=cfg.head_dim, **_no_window_qwen(cfg)),
            check=_qwen2_check,
        ),
        Family(
            name="qwen3",
            model_type="qwen3",
            architecture="Qwen3ForCausalLM",
            keys=frozenset(
                {
                    "head_dim",
                    "attention_bias",
                    "use_sliding_window",
                    "sliding_window",
                    "max_window_layers",
                    "layer_types",
                }
            ),
            defaults={
                "max_position_embeddings": 32768,
                "num_key_value_heads": 32,
                "head_dim": 128,
                "use_sliding_window": False,
                "sliding_window": 4096,
                "max_window_layers": 28,
            },
            read=_qwen3_read,
            write=lambda cfg: dict(
                head_dim=cfg.head_dim, attention_bias=cfg.qkv_bias, **_no_window_qwen(cfg)
            ),
            check=_qwen3_check,
        ),
        Family(
            name="mistral",
            model_type="mistral",
            architecture="MistralForCausalLM",
            keys=frozenset({"head_dim", "sliding_window"}),
            defaults={
                "max_position_embeddings": 131072,
                "num_key_value_heads": 8,
                "sliding_window": 4096,
            },
            read=_mistral_read,
            write=lambda cfg: dict(head_dim=cfg.head_dim, sliding_window=None),
            check=_mistral_check,
        ),
    )
}

DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "rope_theta": 10000.0,
}
"""transformers' defaults of the COMMON keys a config.json may leave out (per family too:
`Family.defaults`)."""

NULLABLE = frozenset({"sliding_window", "head_dim", "num_key_value_heads", "layer_types"})
"""Keys whose null is a value (no window, derived head_dim, MHA, layer types from the window)."""

REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def family_of(hf: dict) -> tuple[Family, bool]:
    """(the family of a config.json, whether it is the project's own query-scaling export)."""
    mt, archs = hf.get("model_type"), hf.get("architectures") or []
    if mt == LOGN_MODEL_TYPE:
        if archs and archs != [LOGN_ARCH]:
            raise FamilyError(
                "architectures", f"{LOGN_MODEL_TYPE} needs {[LOGN_ARCH]}, got {archs}"
            )
        return FAMILIES["llama"], True
    by_type = {f.model_type: f for f in FAMILIES.values()}
    if mt not in by_type:
        names = ", ".join(f"{f.architecture} ({f.model_type})" for f in FAMILIES.values())
        raise FamilyError(
            "model_type",
            f"{mt!r} (architectures {archs}) is not a family the decoder computes; "
            f"supported: {names}",
        )
    fam = by_type[mt]
    if archs and archs != [fam.architecture]:
        raise FamilyError(
            "architectures", f"a {mt} config.json names {archs}, expected [{fam.architecture!r}]"
        )
    return fam, False


def _rope(hf: dict, get) -> tuple[float, RopeScaling]:
    """(theta, scaling) from rope_scaling / rope_parameters (transformers reads rope_scaling first)
    and rope_theta; every key of the dict is read or refused."""
    spelling = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(spelling) or {}
    other = "rope_parameters" if spelling == "rope_scaling" else None
    if not isinstance(params, dict):
        raise FamilyError(spelling, f"expected a mapping, got {params!r}")
    if other and hf.get(other):  # both spellings (the project's exports write both): they agree
        for k, v in params.items():
            if hf[other].get(k, v) != v:
                raise FamilyError(
                    f"{other}.{k}", f"{hf[other][k]!r} contradicts {spelling}.{k} = {v!r}"
                )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_KEYS:
        raise FamilyError(
            f"{spelling}.rope_type",
            f"{rope_type!r} is not computed; supported: {', '.join(ROPE_KEYS)}",
        )
    allowed = ROPE_KEYS["default"] | ROPE_KEYS[rope_type]
    for k in params:
        if k not in allowed:
            raise FamilyError(
                f"{spelling}.{k}", f"not a key of {rope_type} RoPE; allowed: {sorted(allowed)}"
            )
    for where, value in (
        (f"{spelling}.partial_rotary_factor", params.get("partial_rotary_factor")),
        ("partial_rotary_factor", hf.get("partial_rotary_factor")),
    ):
        if value not in (None, 1, 1.0):
            raise FamilyError(where, f"{value}: RoPE on part of each head is not computed")
    theta = float(params.get("rope_theta", get("rope_theta")))
    if rope_type == "default":
        return theta, RopeScaling()
    context = int(get("max_position_embeddings"))
    original = params.get("original_max_position_embeddings") or context
    factor = params.get("factor")
    if factor is None and rope_type == "yarn":
        factor = context / original  # transformers' fallback
    if factor is None:
        raise FamilyError(f"{spelling}.factor", f"{rope_type} RoPE needs a factor")
    kw: dict[str, Any] = {"type": rope_type, "factor": float(factor)}
    if rope_type == "dynamic":
        kw["original_max_seq_len"] = context  # transformers scales past max_position_embeddings
    if rope_type in ("yarn", "llama3"):
        kw["original_max_seq_len"] = int(original)
    if rope_type == "llama3":
        for k in ("low_freq_factor", "high_freq_factor"):
            if params.get(k) is None:
                raise FamilyError(f"{spelling}.{k}", "llama3 RoPE needs it")
            kw[k] = float(params[k])
    if rope_type == "yarn":
        kw.update({k: float(params[k]) for k in YARN_OPTIONAL if params.get(k) is not None})
        kw["truncate"] = bool(params.get("truncate", True))
    try:
        return theta, RopeScaling(**kw)
    except ConfigError as e:
        raise FamilyError(f"{spelling}.{e.key}", str(e).split(": ", 1)[1]) from None


def model_config_from_hf(
    hf: dict, base: ModelConfig, *, text_vocab_size: int, codebook_size: int
) -> ModelConfig:
    """`base` (its vocabulary layout, initialisation) with the architecture of a transformers
    config.json of a supported family; FamilyError naming the key for anything else."""
    fam, logn = family_of(hf)
    known = IGNORED | COMMON | fam.keys | ({"attn_logn_base", "auto_map"} if logn else set())
    for key in hf:
        if key not in known:
            raise FamilyError(
                key,
                f"not a key of {fam.architecture} the project knows; it would be dropped, so the "
                "model is refused (docs/models.md lists what each family reads)",
            )
    missing = [k for k in REQUIRED if hf.get(k) is None]
    if missing:
        raise FamilyError(missing[0], "required")
    defaults = {**DEFAULTS, **fam.defaults}

    def get(
        key: str,
    ):  # what the config.json sets (null where null means something), else the default
        if key in hf and (hf[key] is not None or key in NULLABLE):
            return hf[key]
        return defaults.get(key)

    act = get("hidden_act")
    if act not in ("silu", "swish"):
        raise FamilyError("hidden_act", f"{act!r}: the decoder's feed-forward is SwiGLU (silu)")
    dropout = float(get("attention_dropout") or 0.0)
    if dropout:
        raise FamilyError(
            "attention_dropout",
            f"{dropout}: the decoder has no attention dropout, so training would differ (set 0.0)",
        )
    heads = int(hf["num_attention_heads"])
    kv = get("num_key_value_heads")
    theta, scaling = _rope(hf, get)
    fields_ = fam.read(hf, get)
    try:
        return replace(
            base,
            text_vocab_size=text_vocab_size,
            codebook_size=codebook_size,
            family=fam.name,
            dim=int(hf["hidden_size"]),
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=heads if kv is None else int(kv),
            ffn_dim=int(hf["intermediate_size"]),
            norm_eps=float(get("rms_norm_eps")),
            rope_theta=theta,
            rope_scaling=scaling,
            max_seq_len=int(get("max_position_embeddings")),
            tie_embeddings=bool(get("tie_word_embeddings")),
            attn_logn_base=int(hf.get("attn_logn_base") or 0) if logn else 0,
            **{
                "attn_head_dim": None,
                "qkv_bias": False,
                "attn_out_bias": False,
                "qk_norm": False,
                **fields_,
            },
        )
    except ConfigError as e:
        raise FamilyError(e.key, str(e).split(": ", 1)[1]) from None


def check_family(cfg: ModelConfig) -> None:
    """ConfigError naming the model field its family cannot express (a from-scratch config that
    sets `model.family`); an imported model always passes."""
    problem = FAMILIES[cfg.family].check(cfg)
    if problem is None and cfg.attn_logn_base and cfg.family != "llama":
        problem = ("attn_logn_base", "query scaling exports only as Llama (family llama)")
    if problem is not None:
        raise ConfigError(f"model.{problem[0]}", f"{problem[1]} (model.family={cfg.family})")


def rope_parameters(cfg: ModelConfig) -> dict:
    """transformers' rope_parameters for cfg's RoPE."""
    s = cfg.rope_scaling
    params: dict[str, Any] = {"rope_type": s.type, "rope_theta": cfg.rope_theta}
    if s.type == "default":
        return params
    params["factor"] = s.factor
    if s.type in ("yarn", "llama3"):
        params["original_max_position_embeddings"] = s.original_max_seq_len
    if s.type == "llama3":
        params.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
    if s.type == "yarn":
        params.update({k: getattr(s, k) for k in YARN_OPTIONAL if getattr(s, k) is not None})
        if not s.truncate:
            params["truncate"] = False
    return params


def hf_config(cfg: ModelConfig) -> dict:
    """The config.json of cfg's family (without the tokenizer's ids). RoPE in both spellings: 5.x
    reads rope_parameters, 4.x rope_theta and (scaled) rope_scaling. `dynamic` writes its original
    context as
    max_position_embeddings, which transformers scales past (docs/models.md)."""
    check_family(cfg)
    fam = FAMILIES[cfg.family]
    s = cfg.rope_scaling
    params = rope_parameters(cfg)
    d = dict(
        architectures=[fam.architecture],
        model_type=fam.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        hidden_act="silu",
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        rope_parameters=params,
        max_position_embeddings=s.original_max_seq_len if s.type == "dynamic" else cfg.max_seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_dropout=0.0,
        **fam.write(cfg),
    )
    if s.type != "default":  # transformers 4 reads scaling only from here (5 warns, reads the same)
        d["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    if cfg.attn_logn_base:
        d.update(
            architectures=[LOGN_ARCH],
            model_type=LOGN_MODEL_TYPE,
            attn_logn_base=cfg.attn_logn_base,
            auto_map={
                "AutoConfig": f"{LOGN_MODULE}.LongVideoLlamaConfig",
                "AutoModelForCausalLM": f"{LOGN_MODULE}.{LOGN_ARCH}",
            },
        )
    return d


def architecture_fields(cfg: ModelConfig) -> dict:
    """The ModelConfig fields a config.json determines (for comparing two configs' architecture)."""
    skip = {"text_vocab_size", "codebook_size", "vocab_layout", "vision_vocab_size", "init_std"}
    skip |= {"code_init", "multiple_of"}
    return {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.init and f.name not in skip}


# ----------------------------------------------------------------------------- tensor names

LAYER_NAMES = {  # ours -> transformers', per layer; the same in every family
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.wq.bias": "self_attn.q_proj.bias",
    "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.bias": "self_attn.v_proj.bias",
    "attn.wo.bias": "self_attn.o_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "ffn.w_gate.weight": "mlp.gate_proj.weight",
    "ffn.w_up.weight": "mlp.up_proj.weight",
    "ffn.w_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    """transformers' name of one of our parameters; KeyError for a name no family has."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".", 2)
    if parts[0] != "layers" or len(parts) < 3 or parts[2] not in LAYER_NAMES:
        raise KeyError(name)
    return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"


_INV_TOP = {v: k for k, v in TOP_NAMES.items()}
_INV_LAYER = {v: k for k, v in LAYER_NAMES.items()}


def own_name(name: str) -> str | None:
    """Our name of a transformers tensor; None for buffers some versions save (rotary_emb);
    KeyError for a name no family has."""
    if "rotary_emb" in name:
        return None
    if name in _INV_TOP:
        return _INV_TOP[name]
    parts = name.split(".", 3)  # model.layers.N.rest
    if parts[:2] == ["model", "layers"] and len(parts) == 4 and parts[3] in _INV_LAYER:
        return f"layers.{parts[2]}.{_INV_LAYER[parts[3]]}"
    raise KeyError(name)
