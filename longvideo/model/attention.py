"""Multi-head attention with GQA, RoPE, optional q/k/v/output biases and per-head q/k RMSNorm (the
terms the imported families need, docs/models.md), calling the attention seam (docs/architecture.md,
decision 2): `attention_fn(q, k, v, meta)`, q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D), meta the step's
AttentionMeta (built once per forward by the Transformer) -> out (B, Sq, Hq, D).
`LocalAttention` is the single-device implementation; ring attention is swapped in by
`longvideo.parallel.apply`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from longvideo.kernels import AttentionMeta, block_attention
from longvideo.model.config import ModelConfig
from longvideo.model.layers import RMSNorm, apply_rope, logn_scale

AttentionFn = Callable[[Tensor, Tensor, Tensor, AttentionMeta], Tensor]


class LocalAttention:
    """Single-device masked attention over the block-attention backends (kernels/), as a seam
    object. Every layer of a step gets the same metadata object, so the first layer's plan (and the
    first backward's) serves all of them: the plans live in that object."""

    def __init__(self, backend: str = "auto"):
        self.backend = backend

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMeta) -> Tensor:
        return block_attention(q, k, v, meta, backend=self.backend)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.logn_base = cfg.attn_logn_base
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.attn_out_bias)
        if cfg.qk_norm:  # over each head's D features, before RoPE (Qwen3)
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        meta: AttentionMeta,
        attention_fn: AttentionFn,
        cache_update=None,
    ) -> Tensor:
        """x (B, S, dim); cos, sin the RoPE tables of its positions; meta: the step's metadata (the
        queries are x's tokens, the keys those of the cache when there is one); cache_update(k, v):
        append this step's keys and values and return every cached one."""
        B, S, _ = x.shape
        # local head counts come from the weights, so a sharded projection needs no change here
        q = self.wq(x).view(B, S, -1, self.head_dim)  # (B, S, Hq, D)
        k = self.wk(x).view(B, S, -1, self.head_dim)  # (B, S, Hkv, D)
        v = self.wv(x).view(B, S, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.logn_base:  # sharper attention past logn_base keys (ModelConfig.attn_logn_base)
            q = q * logn_scale(meta.queries.positions, self.logn_base, q.dtype)
        if cache_update is not None:  # append this step's keys and attend over everything cached
            k, v = cache_update(k, v)
        out = attention_fn(q, k, v, meta)
        return self.wo(out.reshape(B, S, -1))
