"""Quantizers: latent vectors (..., D) -> codes (...) and back, without codebook collapse (docs/vq.md,
"Quantizers"): FSQ (Mentzer et al. 2023; an implicit codebook of prod L_i codes, no parameters) and
EMAVectorQuantizer (l2-normalised, as in ViT-VQGAN; EMA updates, restarts of unused entries). Both
return the straight-through quantised latents, the integer codes and an auxiliary loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from longvideo.vq.config import VQConfig


def fsq_codebook(levels: tuple[int, ...]) -> torch.Tensor:
    """Every FSQ code's latent, float32 (prod(levels), len(levels)) in [-1, 1]: what `FSQ(levels).lookup`
    returns for codes 0, 1, ... (code = mixed-radix number of the levels, the first level fastest),
    the table the language model's code embeddings start from."""
    return FSQ(levels).lookup(torch.arange(math.prod(levels)))


class FSQ(nn.Module):
    """Finite scalar quantisation with `levels` (L_1, ..., L_D); codes in [0, prod L_i)."""

    def __init__(self, levels: tuple[int, ...], eps: float = 1e-3):
        super().__init__()
        lv = torch.tensor(levels, dtype=torch.long)
        self.register_buffer("levels", lv, persistent=False)
        basis = torch.cumprod(torch.cat([torch.ones(1, dtype=torch.long), lv[:-1]]), 0)
        self.register_buffer("basis", basis, persistent=False)
        half = (lv.double() - 1) * (1 + eps) / 2
        offset = (lv % 2 == 0).double() * 0.5  # even L: the levels sit at half-integers around 0
        self.register_buffer("half_range", half.float(), persistent=False)
        self.register_buffer("offset", offset.float(), persistent=False)
        self.register_buffer("shift", torch.atanh(offset / half).float(), persistent=False)
        self.register_buffer("radius", (lv // 2).float(), persistent=False)
        self.codebook_size = math.prod(levels)
        self.dim = len(levels)

    def forward(self, z: torch.Tensor):
        # z (..., D) -> zq (..., D) in [-1, 1], codes (...) long, aux loss (scalar 0)
        bounded = torch.tanh(z + self.shift) * self.half_range - self.offset
        q = bounded + (torch.round(bounded) - bounded).detach()  # straight-through rounding
        digits = (torch.round(bounded.detach()) + self.radius).long()  # (..., D) in [0, L_i)
        codes = (digits * self.basis).sum(-1)
        return q / self.radius, codes, z.new_zeros(())

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        # codes (...) -> zq (..., D)
        digits = (codes.unsqueeze(-1) // self.basis) % self.levels
        return (digits.float() - self.radius) / self.radius


class EMAVectorQuantizer(nn.Module):
    """Nearest code by cosine similarity; EMA codebook updates; restarts of unused codes.

    Buffers (saved with the model): `embed` (K, D) unit code vectors used for lookup,
    `ema_sum` (K, D) moving sum of assigned vectors, `ema_count` (K,) moving assignment count.
    """

    def __init__(
        self,
        codebook_size: int,
        dim: int,
        decay: float = 0.99,
        dead_threshold: float = 0.5,
        commit_weight: float = 0.25,
    ):
        super().__init__()
        self.codebook_size, self.dim = codebook_size, dim
        self.decay, self.dead_threshold, self.commit_weight = decay, dead_threshold, commit_weight
        embed = F.normalize(torch.randn(codebook_size, dim), dim=-1)
        self.register_buffer("embed", embed)
        self.register_buffer("ema_sum", embed.clone())
        # zero counts: every code starts "dead" and is placed on real encoder outputs at step 1
        self.register_buffer("ema_count", torch.zeros(codebook_size))

    def _nearest(self, flat: torch.Tensor) -> torch.Tensor:
        # flat (N, D) unit vectors -> (N,) codes; chunked to bound the (N, K) similarity matrix
        parts = flat.split(max(1, (1 << 24) // self.codebook_size))
        return torch.cat([(part @ self.embed.t()).argmax(-1) for part in parts])

    def forward(self, z: torch.Tensor):
        # z (..., D) -> zq (..., D) unit vectors, codes (...) long, commitment loss (scalar)
        shape = z.shape[:-1]
        flat = F.normalize(z.reshape(-1, self.dim).float(), dim=-1)  # (N, D)
        codes = self._nearest(flat.detach())
        if self.training:
            self._update(flat.detach(), codes)
            codes = self._nearest(flat.detach())  # restarted codes may now fit better
        q = self.embed[codes]
        commit = F.mse_loss(flat, q.detach()) * self.commit_weight
        zq = flat + (q - flat).detach()
        return zq.view(*shape, self.dim).to(z.dtype), codes.view(shape), commit

    @torch.no_grad()
    def _update(self, flat: torch.Tensor, codes: torch.Tensor) -> None:
        k = self.codebook_size
        count = torch.bincount(codes, minlength=k).float()
        total = torch.zeros_like(self.ema_sum).index_add_(0, codes, flat)
        self.ema_count.mul_(self.decay).add_(count, alpha=1 - self.decay)
        self.ema_sum.mul_(self.decay).add_(total, alpha=1 - self.decay)
        dead = (self.ema_count < self.dead_threshold).nonzero().squeeze(-1)
        if dead.numel():
            # restart from the encoder outputs the current codebook fits worst
            fit = (flat * self.embed[codes]).sum(-1)
            order = fit.argsort()
            pick = order[torch.arange(dead.numel(), device=flat.device) % order.numel()]
            new = flat[pick]
            if dead.numel() > order.numel():  # more dead codes than vectors: jitter the repeats
                new = F.normalize(new + 0.01 * torch.randn_like(new), dim=-1)
            self.ema_sum[dead] = new
            self.ema_count[dead] = 1.0
        self.embed.copy_(F.normalize(self.ema_sum, dim=-1))

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        # codes (...) -> (..., D)
        return self.embed[codes]


def build_quantizer(cfg: VQConfig) -> nn.Module:
    if cfg.quantizer == "fsq":
        return FSQ(cfg.levels)
    return EMAVectorQuantizer(
        cfg.codebook_size,
        cfg.codebook_dim,
        cfg.ema_decay,
        cfg.dead_code_threshold,
        cfg.commit_weight,
    )


def codebook_usage(codes: torch.Tensor, codebook_size: int) -> dict[str, float]:
    """Fraction of the codebook used by `codes` (and how many), and the perplexity exp(H) of their
    histogram (the codebook size when all are used equally often, 1 under collapse)."""
    hist = torch.bincount(codes.reshape(-1).long().cpu(), minlength=codebook_size).double()
    p = hist / hist.sum().clamp_min(1)
    entropy = -(p[p > 0] * p[p > 0].log()).sum().item()
    return {
        "usage": (hist > 0).double().mean().item(),
        "perplexity": math.exp(entropy),
        "codes_used": int((hist > 0).sum().item()),
    }
