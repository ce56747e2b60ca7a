"""Building blocks of the LLaMA decoder: RMSNorm, rotary embeddings (with the RoPE scalings of
transformers' `modeling_rope_utils`), SwiGLU (blockwise)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from longvideo.model.config import RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # normalise in fp32 at least, as LLaMA does for 16-bit activations; fp64 stays fp64
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None, max_seq_len: int = 0
) -> tuple[Tensor, float]:
    """(inverse frequencies float32 (head_dim/2,) on the CPU, attention factor) of RoPE with
    `scaling`, in the arithmetic of transformers' `modeling_rope_utils` (the same float32 and
    Python-float operations in the same order, so the same bits). `dynamic` is fixed at the context
    `max_seq_len` (docs/models.md, "RoPE scaling"): the frequencies transformers computes for a
    forward whose longest position is max_seq_len - 1."""
    s = scaling or RopeScaling()
    dim, base = head_dim, float(theta)
    with torch.device("cpu"):
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
        if s.type == "default":
            return 1.0 / (base**exponents), 1.0
        if s.type == "linear":
            inv_freq = 1.0 / (base**exponents)
            inv_freq /= s.factor
            return inv_freq, 1.0
        if s.type == "dynamic":
            orig = s.original_max_seq_len
            if (
                max_seq_len > orig
            ):  # transformers' growth path: seq_len a tensor, float32 arithmetic
                seq_len = torch.tensor(max_seq_len, dtype=torch.int64)
                seq_len = torch.maximum(seq_len, torch.tensor(orig, dtype=seq_len.dtype))
            else:  # its initial frequencies: seq_len = max_position_embeddings, Python floats
                seq_len = orig
            base = base * ((s.factor * seq_len / orig) - (s.factor - 1)) ** (dim / (dim - 2))
            return 1.0 / (base**exponents), 1.0
        if s.type == "llama3":
            inv_freq = 1.0 / (base**exponents)
            old = s.original_max_seq_len
            low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
            smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
            smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled), 1.0
        if s.type == "yarn":
            factor = s.factor
            if s.attention_factor is not None:
                attention_factor = s.attention_factor
            elif s.mscale and s.mscale_all_dim:
                attention_factor = float(
                    _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
                )
            else:
                attention_factor = _yarn_mscale(factor)
            beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1
            orig = s.original_max_seq_len

            def correction_dim(rotations):
                return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

            low, high = correction_dim(beta_fast), correction_dim(beta_slow)
            if s.truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            if low == high:
                high += 0.001  # transformers' guard against a zero-width ramp
            ramp = torch.clamp(
                (torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
            )
            pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
            extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
            keep = 1 - ramp.to(dtype=torch.float)
            return interpolation * (1 - keep) + extrapolation * keep, attention_factor
    raise ValueError(f"unknown RoPE scaling type {s.type!r}")


def rope_cos_sin(
    positions: Tensor, inv_freq: Tensor, dtype: torch.dtype, attention_factor: float = 1.0
) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (B, S, 1, head_dim) for integer positions (B, S): explicit, so that packed
    documents restart at 0 and sequence shards carry their global positions. Computed in float32
    (as transformers does, whatever the model's dtype), times the scaling's attention factor, then
    cast to `dtype`."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # (B, S, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # (B, S, 1, head_dim)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


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
