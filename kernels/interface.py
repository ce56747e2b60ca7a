"""Differentiable single-device masked attention over a block backend (docs/kernels.md)."""

from __future__ import annotations

import torch
from torch import Tensor

from .backends import get_backend
from .meta import AttentionMeta


class _BlockAttention(torch.autograd.Function):
    """(out, lse) of one backend; gradients for q, k, v only. The metadata object is kept for the
    backward, so its plans serve both directions."""

    @staticmethod
    def forward(ctx, q, k, v, meta: AttentionMeta, backend: str):
        out, lse = get_backend(backend).forward(q, k, v, meta)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta, ctx.backend = meta, backend
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        backend = get_backend(ctx.backend)
        dq, dk, dv = backend.backward(dout.contiguous(), q, k, v, out, lse, ctx.meta)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def attention(
    q: Tensor, k: Tensor, v: Tensor, meta: AttentionMeta | None, backend: str
) -> tuple[Tensor, Tensor]:
    """(out, lse (B, Hq, Sq)) of `block_attention`'s arguments; meta None: the default metadata."""
    meta = meta if meta is not None else AttentionMeta.default(q, k)
    return _BlockAttention.apply(q, k, v, meta, backend)


def block_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    meta: AttentionMeta | None = None,
    *,
    backend: str = "auto",
) -> Tensor:
    """Masked attention (the mask rule of attention_math.py); differentiable in q, k, v.

    q (B, Sq, Hq, D); k, v (B, Sk, Hkv, D); meta: the positions and segment ids of both sides,
    causal, scale and plans (None: positions 0..S-1, one segment, causal, 1/sqrt(D)). Returns out
    (B, Sq, Hq, D) in q.dtype."""
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"query heads {q.shape[2]} must be a multiple of key/value heads {k.shape[2]}"
        )
    return attention(q, k, v, meta, backend)[0]
