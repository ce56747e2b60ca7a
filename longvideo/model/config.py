"""ModelConfig: the LLaMA decoder's architecture (shape, vocabulary, RoPE and its scaling, the
optional terms of the families it imports from transformers, initialisation).

How a model runs (attention backend, activation checkpointing, chunk sizes) is not here: see
longvideo.parallel.config.RuntimeConfig, applied from outside the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from longvideo.configtools import check, check_positive
from longvideo.vocab import LAYOUTS, Vocab

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
FAMILY_NAMES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling, computed as transformers computes it (docs/models.md, "RoPE
    scaling").
    The keys are those of transformers' `rope_parameters` of the same type."""

    type: Literal["default", "linear", "dynamic", "yarn", "llama3"] = "default"
    """default: plain RoPE; linear: positions / factor; dynamic: NTK base at max_seq_len;
    yarn: YaRN ramp and attention factor; llama3: Llama 3.1's band-wise scaling."""
    factor: float = 1.0
    """The scaling factor (linear, dynamic, yarn, llama3)."""
    original_max_seq_len: int = 0
    """The context the model was pretrained at (transformers' original_max_position_embeddings;
    for dynamic, its max_position_embeddings); used by dynamic, yarn and llama3."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_seq_len / low_freq_factor are divided by factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_seq_len / high_freq_factor are kept."""
    beta_fast: float | None = None
    """yarn: rotations where the ramp starts extrapolating (null = transformers' 32)."""
    beta_slow: float | None = None
    """yarn: rotations where the ramp ends (null = transformers' 1)."""
    attention_factor: float | None = None
    """yarn: multiplies cos and sin (null = 0.1 ln(factor) + 1, or the mscale ratio)."""
    mscale: float | None = None
    """yarn: with mscale_all_dim, the attention factor's numerator scale (transformers' key)."""
    mscale_all_dim: float | None = None
    """yarn: with mscale, the attention factor's denominator scale (transformers' key)."""
    truncate: bool = True
    """yarn: round the ramp's bounds to whole dimensions (transformers' default)."""

    def __post_init__(self):
        check(self.type in ROPE_TYPES, "type", f"must be one of {ROPE_TYPES}")
        if self.type == "default":
            return
        check(self.factor >= 1.0, "factor", f"must be >= 1 for {self.type}, got {self.factor}")
        if self.type in ("dynamic", "yarn", "llama3"):
            check(
                self.original_max_seq_len > 0,
                "original_max_seq_len",
                f"{self.type} scaling needs the pretrained context, got {self.original_max_seq_len}",
            )
        if self.type == "llama3":
            check(
                self.high_freq_factor > self.low_freq_factor,
                "high_freq_factor",
                f"must exceed low_freq_factor={self.low_freq_factor}, got {self.high_freq_factor}",
            )


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    text_vocab_size: int = 32000
    """Ids used by the text tokenizer before the four special tokens are added."""
    codebook_size: int = 8192
    """VQ codebook size; codes follow the special tokens in the unified vocabulary."""
    vocab_layout: Literal["longvideo", "lwm"] = "longvideo"
    """Token space (longvideo/vocab.py): the project's, or LWM's (text ids, then its vision vocabulary)."""
    vision_vocab_size: int | None = None
    """lwm layout only: ids of LWM's vision vocabulary (docs/vocabulary.md); null = codebook_size + 256."""
    dim: int = 4096
    """Hidden size."""
    n_layers: int = 32
    """Number of decoder layers."""
    n_heads: int = 32
    """Query heads; must divide dim unless attn_head_dim is set."""
    n_kv_heads: int | None = None
    """Key/value heads (GQA); must divide n_heads. null means n_heads (MHA)."""
    ffn_dim: int | None = None
    """SwiGLU hidden size; null derives LLaMA's int(8*dim/3) rounded up to multiple_of."""
    multiple_of: int = 256
    """Rounding of the derived ffn_dim."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base; LWM raises it with the context stage (1e6 at 32K ... 5e7 at 1M)."""
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    """RoPE frequency scaling of an imported model (linear, dynamic, yarn, llama3; models.md)."""
    attn_head_dim: int | None = None
    """Width of each attention head where it is not dim / n_heads (Qwen3); null = dim // n_heads."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2; Llama's attention_bias)."""
    attn_out_bias: bool = False
    """A bias on the attention output projection (Llama's and Qwen3's attention_bias)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3)."""
    family: Literal["llama", "qwen2", "qwen3", "mistral"] = "llama"
    """The transformers architecture the model is imported from and exported as (docs/models.md)."""
    attn_logn_base: int = 0
    """Queries scaled with the context (why: docs/hour.md): > 0 multiplies the query at position p (in
    its document) by max(1, ln(p + 1) / ln(attn_logn_base)); 0 = off, plain LLaMA attention."""
    max_seq_len: int = 4096
    """Longest sequence the model is meant for (exported as max_position_embeddings)."""
    tie_embeddings: bool = False
    """Share the input embedding and the output projection."""
    init_std: float = 0.02
    """Standard deviation of the weight initialisation."""
    code_init: Literal["normal", "fsq"] = "normal"
    """Initial VQ code embeddings: normal (random) or fsq (projected FSQ latents; docs/training.md)."""
    head_dim: int = field(init=False)
    """Derived: attn_head_dim, else dim // n_heads."""

    def __post_init__(self):
        for key in ("dim", "n_layers", "n_heads"):
            check(getattr(self, key) > 0, key, f"must be positive, got {getattr(self, key)}")
        check(
            self.attn_head_dim is not None or self.dim % self.n_heads == 0,
            "n_heads",
            f"must divide dim={self.dim}, got {self.n_heads}",
        )
        check(
            self.attn_head_dim is None or self.attn_head_dim > 0,
            "attn_head_dim",
            f"must be positive or null, got {self.attn_head_dim}",
        )
        check(self.family in FAMILY_NAMES, "family", f"must be one of {FAMILY_NAMES}")
        kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        check(
            kv > 0 and self.n_heads % kv == 0,
            "n_kv_heads",
            f"must divide n_heads={self.n_heads}, got {self.n_kv_heads}",
        )
        object.__setattr__(self, "n_kv_heads", kv)
        object.__setattr__(self, "head_dim", self.attn_head_dim or self.dim // self.n_heads)
        check(
            self.head_dim % 2 == 0,
            "attn_head_dim" if self.attn_head_dim else "n_heads",
            f"head_dim {self.head_dim} must be even for RoPE",
        )
        check_positive(self, "text_vocab_size", "codebook_size", "multiple_of")
        check(self.vocab_layout in LAYOUTS, "vocab_layout", f"must be one of {LAYOUTS}")
        check(
            self.vision_vocab_size is None or self.vocab_layout == "lwm",
            "vision_vocab_size",
            "is set only in the lwm vocabulary layout",
        )
        check(
            self.vision_vocab_size is None or self.vision_vocab_size >= self.codebook_size + 2,
            "vision_vocab_size",
            f"must hold the codes, <eof> and <eov>: >= codebook_size + 2 = "
            f"{self.codebook_size + 2}, got {self.vision_vocab_size}",
        )
        if self.ffn_dim is None:
            hidden = int(2 * (4 * self.dim) / 3)
            hidden = self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)
            object.__setattr__(self, "ffn_dim", hidden)
        check_positive(self, "ffn_dim", "norm_eps", "rope_theta", "max_seq_len")
        check(
            self.attn_logn_base == 0 or self.attn_logn_base >= 2,
            "attn_logn_base",
            f"must be 0 (off) or a context length >= 2, got {self.attn_logn_base}",
        )

    @property
    def vocab(self) -> Vocab:
        return Vocab(
            text_size=self.text_vocab_size,
            codebook_size=self.codebook_size,
            layout=self.vocab_layout,
            vision_size=self.vision_vocab_size,
        )

    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    def num_params(self) -> int:
        """Parameter count (embeddings included; tied output counted once)."""
        d, v, f = self.dim, self.vocab_size, self.ffn_dim
        qd, kvd = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        layer = d * qd * 2 + d * kvd * 2 + 3 * d * f + 2 * d
        layer += (qd + 2 * kvd) * self.qkv_bias + d * self.attn_out_bias
        layer += 2 * self.head_dim * self.qk_norm
        return v * d * (1 if self.tie_embeddings else 2) + self.n_layers * layer + d

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (fwd+bwd = 3x fwd), including causal attention."""
        n = self.num_params() - self.vocab_size * self.dim  # input embedding costs no FLOPs
        # QK^T and PV over every query head, causal halves it
        attn = 2 * 2 * self.n_layers * self.n_heads * self.head_dim * seq_len / 2
        return 3 * (2 * n + attn)
