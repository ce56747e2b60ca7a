"""The LLaMA-style decoder: embeddings -> n x (RMSNorm, attention, RMSNorm, SwiGLU) -> RMSNorm ->
head, with the optional terms of the families it imports (docs/models.md).
No distributed code lives here: the seam, activation checkpointing and the engine are applied from
outside (`longvideo.parallel.apply`; docs/architecture.md, decision 5).
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import Tensor, nn

from longvideo.kernels import AttentionMeta, Side
from longvideo.model.attention import Attention, AttentionFn, LocalAttention
from longvideo.model.cache import KVCache
from longvideo.model.config import ModelConfig
from longvideo.model.head import LMHead
from longvideo.model.layers import FeedForward, RMSNorm, rope_cos_sin, rope_frequencies


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ffn_chunk: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = FeedForward(cfg.dim, cfg.ffn_dim, ffn_chunk)

    def forward(self, x, cos, sin, meta: AttentionMeta, attention_fn, cache_update=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, meta, attention_fn, cache_update)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    """The decoder of `cfg`. ffn_chunk: tokens per feed-forward block (0: all at once); loss_chunk:
    tokens per cross-entropy chunk; backend: the default single-device seam's block backend (a run
    sets all three from its RuntimeConfig / ParallelConfig, longvideo.checkpoint.build_model)."""

    def __init__(
        self, cfg: ModelConfig, *, ffn_chunk: int = 0, loss_chunk: int = 4096, backend: str = "auto"
    ):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, ffn_chunk) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = LMHead(cfg.dim, cfg.vocab_size, loss_chunk)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_embeddings.weight
        self.attention_fn: AttentionFn = LocalAttention(backend)
        # RoPE's frequencies, float32 on the CPU (a plain attribute, not a buffer: no dtype cast or
        # ZeRO partitioning reaches it), copied once to each device a forward runs on
        self._inv_freq, self._rope_factor = rope_frequencies(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_seq_len
        )
        self._inv_freq_on: dict[torch.device, Tensor] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)  # norm weights
            elif name.endswith(("wo.weight", "w_down.weight")):
                # residual projections scaled down with depth, as GPT-2 does
                nn.init.normal_(p, std=std / math.sqrt(2 * self.cfg.n_layers))
            else:
                nn.init.normal_(p, std=std)

    @torch.no_grad()
    def init_code_embeddings(self, latents: Tensor, noise: float = 0.1) -> None:
        """Start the VQ codes' embedding rows from the tokenizer's geometry: code c gets
        ``latents[c] @ R`` (R a random Gaussian projection from the global RNG) scaled to ``init_std``,
        plus ``noise`` times as much Gaussian noise, so codes with close latents start close.
        latents: (codebook_size, D), e.g. `longvideo.vq.quantizer.fsq_codebook(levels)`."""
        vocab = self.cfg.vocab
        if latents.ndim != 2 or latents.shape[0] != vocab.codebook_size:
            raise ValueError(
                f"latents must be ({vocab.codebook_size}, D), got {tuple(latents.shape)}"
            )
        w = self.tok_embeddings.weight
        proj = latents.to(w.device, torch.float32) @ torch.randn(latents.shape[1], self.cfg.dim).to(
            w.device
        )
        proj = proj / proj.pow(2).mean().sqrt()  # unit variance per coordinate
        rows = proj + noise * torch.randn(proj.shape).to(w.device)
        w[vocab.vq_offset : vocab.vq_offset + vocab.codebook_size] = (self.cfg.init_std * rows).to(
            w.dtype
        )

    def set_attention(self, fn: AttentionFn) -> None:
        """Swap the attention implementation (the seam); see longvideo.model.attention."""
        self.attention_fn = fn

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        segment_ids: Tensor | None = None,
        targets: Tensor | None = None,
        loss_weights: Tensor | None = None,
        cache: KVCache | None = None,
        attention_fn: AttentionFn | None = None,
    ):
        """input_ids (B, S). positions / segment_ids (B, S) default to 0..S-1 (after the cache) and
        one segment. Without targets: hidden states (B, S, dim) after the final norm. With targets
        (B, S): the weighted loss sum (longvideo.model.head; its normaliser is `token_weights`).
        attention_fn: the seam for this call only (default: the model's own, see set_attention)."""
        B, S = input_ids.shape
        if positions is None:
            start = cache.next_position()[:, None] if cache is not None else 0
            positions = start + torch.arange(S, device=input_ids.device)[None, :].expand(B, S)
        if segment_ids is None:
            segment_ids = torch.zeros(B, S, dtype=torch.long, device=input_ids.device)
        x = self.tok_embeddings(input_ids)  # (B, S, dim)
        cos, sin = self.rope(positions, x.dtype)
        queries = Side(positions, segment_ids)
        keys = cache.begin(queries) if cache is not None else queries
        meta = AttentionMeta(queries, keys, causal=True)  # one per forward: every layer's plans
        attn = attention_fn or self.attention_fn
        for i, layer in enumerate(self.layers):
            update = partial(cache.update, i) if cache is not None else None
            x = layer(x, cos, sin, meta, attn, update)
        if cache is not None:
            cache.commit(S)
        hidden = self.norm(x)
        return hidden if targets is None else self.head(hidden, targets, loss_weights)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin (B, S, 1, head_dim) of the model's RoPE (with its scaling) at `positions`."""
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on[positions.device] = self._inv_freq.to(positions.device)
        return rope_cos_sin(positions, inv_freq, dtype, self._rope_factor)

    def logits(self, hidden: Tensor) -> Tensor:
        """(B, S, dim) -> (B, S, V). Only for short spans (generation); training passes targets."""
        return self.head(hidden)
