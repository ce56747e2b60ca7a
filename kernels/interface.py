"""Differentiable single-device masked attention over a block backend (docs/kernels.md)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .attention_math import fill_meta
from .backends import get_backend
from .plans import AttentionPlan


class _BlockAttention(torch.autograd.Function):
    """(out, lse) of one backend; gradients for q, k, v only."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, q_seg, k_seg, scale, causal, backend, plan):
        be = get_backend(backend)
        plan = plan if plan is not None else AttentionPlan()
        out, lse = be.forward(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, causal, plan=plan)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg)
        ctx.scale, ctx.causal, ctx.backend, ctx.plan = scale, causal, backend, plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg = ctx.saved_tensors
        be = get_backend(ctx.backend)
        dq, dk, dv = be.backward(
            dout.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            q_pos,
            k_pos,
            q_seg,
            k_seg,
            ctx.scale,
            ctx.causal,
            plan=ctx.plan,
        )
        return (
            dq.to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def attention(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, softmax_scale, backend, plan):
    """(out, lse (B, Hq, Sq)) of `block_attention`'s arguments, all positional (defaults filled here)."""
    q_pos, k_pos, q_seg, k_seg = fill_meta(q, k, q_pos, k_pos, q_seg, k_seg)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _BlockAttention.apply(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, causal, backend, plan)


def block_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Optional[Tensor] = None,
    k_pos: Optional[Tensor] = None,
    q_seg: Optional[Tensor] = None,
    k_seg: Optional[Tensor] = None,
    *,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    backend: str = "auto",
    plan: Optional[AttentionPlan] = None,
) -> Tensor:
    """Masked attention (the mask rule of attention_math.py); differentiable in q, k, v.

    q (B, Sq, Hq, D); k, v (B, Sk, Hkv, D); positions and segment ids (B, S), by default 0..S-1 and
    one segment. Returns out (B, Sq, Hq, D) in q.dtype."""
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"query heads {q.shape[2]} must be a multiple of key/value heads {k.shape[2]}"
        )
    return attention(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, softmax_scale, backend, plan)[0]
