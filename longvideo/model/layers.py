"""Building blocks of the LLaMA decoder: RMSNorm, rotary embeddings, SwiGLU (blockwise)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # normalise in fp32 whatever the activation dtype, as LLaMA does
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (B, S, 1, head_dim) for integer positions (B, S): explicit, so that packed
    documents restart at 0 and sequence shards carry their global positions."""
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq  # (B, S, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # (B, S, 1, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, S, H, D) by the half-split convention (first half paired with second half)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def logn_scale(positions: Tensor, base: int, dtype: torch.dtype) -> Tensor:
    """max(1, ln(p + 1) / ln(base)) for positions p (B, S), shaped (B, S, 1, 1) to scale queries;
    computed in float64, so every position below the base gets exactly 1."""
    return (
        (torch.log1p(positions.double()) / math.log(base))
        .clamp(min=1.0)
        .to(dtype)[:, :, None, None]
    )


class FeedForward(nn.Module):
    """SwiGLU, applied blockwise over the sequence: with `chunk` > 0 and gradients enabled, each chunk
    is recomputed in the backward pass, so the (tokens x ffn_dim) intermediates of only one chunk
    ever exist (the feed-forward half of Blockwise Parallel Transformers)."""

    def __init__(self, dim: int, hidden: int, chunk: int):
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)
        self.chunk = chunk

    def _ffn(self, x: Tensor) -> Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))

    def forward(self, x: Tensor) -> Tensor:  # (B, S, dim)
        S = x.shape[1]
        if self.chunk <= 0 or S <= self.chunk:
            return self._ffn(x)
        recompute = torch.is_grad_enabled() and x.requires_grad
        return torch.cat(
            [
                checkpoint(self._ffn, xc, use_reentrant=False) if recompute else self._ffn(xc)
                for xc in x.split(self.chunk, dim=1)
            ],
            dim=1,
        )
