"""The output projection with a chunked, weighted cross-entropy: each chunk's gradients are computed
in the forward pass, so the (tokens x vocab) logits never exist. The loss is a weighted *sum*,
normalised by the caller with the same rule (`token_weights`; docs/architecture.md, decision 6).
Only weighted tokens reach the projection (docs/training.md, "The output head sees only the tokens
with a loss"): reading their count is one small host synchronisation per forward on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longvideo.kernels import accum_dtype


class _ChunkedWeightedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, loss_weights, chunk):
        # hidden (N, dim), weight (V, dim), targets (N,), loss_weights (N,) float
        N = hidden.shape[0]
        chunk = max(N, 1) if chunk <= 0 else chunk
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        acc = accum_dtype(hidden.dtype)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        d_hidden = torch.zeros_like(hidden) if need_grad else None
        d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_grad else None
        for s in range(0, N, chunk):
            h = hidden[s : s + chunk]
            w = loss_weights[s : s + chunk].to(acc)
            t = targets[s : s + chunk]
            logits = (h @ weight.t()).to(acc)  # (n, V) — the only vocab-sized tensor alive
            lse = torch.logsumexp(logits, dim=-1)
            tgt_logit = logits.gather(1, t[:, None]).squeeze(1)
            total += (w * (lse - tgt_logit)).sum()
            if need_grad:
                g = torch.softmax(logits, dim=-1)  # d loss_i / d logits = w_i (softmax - onehot)
                g[torch.arange(g.shape[0], device=g.device), t] -= 1.0
                g *= w[:, None]
                g = g.to(h.dtype)
                d_hidden[s : s + chunk] = g @ weight
                d_weight += (g.t() @ h).to(acc)
        if need_grad:
            ctx.save_for_backward(d_hidden, d_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        d_hidden, d_weight = ctx.saved_tensors
        gh = d_hidden * grad_total.to(d_hidden.dtype) if ctx.needs_input_grad[0] else None
        gw = (d_weight * grad_total).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None


def chunked_cross_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, loss_weights: Tensor, chunk: int
) -> Tensor:
    """sum_i loss_weights[i] * CE(hidden[i] @ weight.T, targets[i]); hidden (N, dim), weight (V, dim)."""
    return _ChunkedWeightedCE.apply(hidden, weight, targets, loss_weights, chunk)


def token_weights(targets: Tensor, loss_weights: Tensor | None = None) -> Tensor:
    """The float32 weight of each token's loss: `loss_weights` (default 1), and 0 where the target
    is negative (the -100 convention: no loss). The one rule the loss and its normaliser share."""
    if loss_weights is None:
        return (targets >= 0).float()
    return loss_weights.float() * (targets >= 0)


class LMHead(nn.Module):
    """Projection to the vocabulary. Called as a module so that parameter-sharding hooks fire."""

    def __init__(self, dim: int, vocab_size: int, loss_chunk: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))
        self.loss_chunk = loss_chunk
        self.skip_unweighted = True
        """Project only the tokens with a loss (False: all of them; the benchmark's baseline)."""

    def forward(
        self, hidden: Tensor, targets: Tensor | None = None, loss_weights: Tensor | None = None
    ):
        """Without targets: logits (B, S, V). With targets (B, S) and loss_weights (B, S): the
        weighted loss sum, a scalar (weights by `token_weights`: a negative target has no loss)."""
        if targets is None:
            return F.linear(hidden, self.weight)
        flat_weights = token_weights(targets, loss_weights).reshape(-1)
        dim = hidden.shape[-1]
        hidden, targets = hidden.reshape(-1, dim), targets.clamp_min(0).reshape(-1)
        if self.skip_unweighted:
            kept = flat_weights.nonzero().squeeze(1)  # the others add exactly 0
            if kept.numel() < flat_weights.numel():
                hidden, targets, flat_weights = (
                    hidden.index_select(0, kept),
                    targets[kept],
                    flat_weights[kept],
                )
        return chunked_cross_entropy(hidden, self.weight, targets, flat_weights, self.loss_chunk)
