"""Fused masked flash attention in Triton, in three layers, plus the `triton` block backend.

    out = flash_attn(q, k, v, q_pos, k_pos, q_seg, k_seg, causal=True)           # differentiable
    out, lse = flash_attn(..., return_lse=True)

q (B, Sq, Hq, D); k, v (B, Sk, Hkv, D) with Hq % Hkv == 0 (GQA: each query head reads kv head
h // (Hq // Hkv); K/V are never repeated); positions and segment ids (B, S) integers.
Mask rule (kernels/attention_math.py): key j is visible to query i iff q_seg[i] == k_seg[j], k_seg[j] >= 0
and, when causal, k_pos[j] <= q_pos[i]. A row with no visible key gets out = 0 and lse = -inf.
Inputs fp16, bf16 or fp32 with fp32 accumulation; any head dim up to 256; any lengths,
Sq != Sk allowed.

Layers (as in flash-attention's interface):
1. raw ops `torch.ops.longvideo.flash_attn_fwd` / `flash_attn_bwd` (`torch.library.custom_op`
   with fake implementations, so torch.compile can trace through them);
2. `FlashAttnFunc`, the `autograd.Function` wiring them together;
3. `flash_attn`, the functional API.
`TritonBackend` serves the same ops to ring attention through the block-backend interface
(backends.py); its backward accepts the global out/lse of a ring.

Tile plans: every entry point takes an optional `plan` (kernels/plans.py AttentionPlan) kept by
the caller for calls sharing positions and segment ids; without one each call builds its own (kept
for its backward). Nothing on this path reads a device value on the host. `flash_attn_ref`
(reference.py) is the materialised pure-PyTorch reference.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import _flash_attn_triton as _tk
from .attention_math import fill_meta
from .plans import AttentionPlan
from .reference import flash_attn_ref

__all__ = ["FlashAttnFunc", "TritonBackend", "flash_attn", "flash_attn_bwd", "flash_attn_fwd", "flash_attn_ref"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, q_seg: Tensor,
                  k_seg: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (B, S, H, D); got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, Sq, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k/v batch and head dim must match q: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if k.shape[2] == 0 or Hq % k.shape[2]:
        raise ValueError(f"query heads {Hq} must be a multiple of key/value heads {k.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"triton flash attention supports fp16, bf16 and fp32 inputs, got {q.dtype}")
    if not 1 <= D <= _tk.MAX_HEAD_DIM:
        raise ValueError(f"triton flash attention supports head dims 1..{_tk.MAX_HEAD_DIM}, got {D}; "
                         f"use backend='torch' or 'cpu' for others")
    for name, t, S in (("q_pos", q_pos, Sq), ("q_seg", q_seg, Sq), ("k_pos", k_pos, k.shape[1]),
                       ("k_seg", k_seg, k.shape[1])):
        if tuple(t.shape) != (B, S):
            raise ValueError(f"{name} must have shape {(B, S)}, got {tuple(t.shape)}")
        if t.is_floating_point() or t.is_complex():
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    devices = {t.device for t in (q, k, v, q_pos, k_pos, q_seg, k_seg)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if q.device.type != "cuda" and not (_tk.INTERPRET and q.device.type == "cpu"):
        raise ValueError(f"the triton backend needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 "
                         f"set before import), got {q.device}")


# ----------------------------------------------------------------------------- layer 1: raw ops


@torch.library.custom_op("longvideo::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, q_seg: Tensor, k_seg: Tensor,
                   scale: float, causal: bool, plan: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """out (B, Sq, Hq, D) in q.dtype and lse (B, Hq, Sq) float32 (-inf on empty rows).
    plan: the int32 tile plan of this shape's forward tiles (_flash_attn_triton.build_plan), or None."""
    _check_inputs(q, k, v, q_pos, k_pos, q_seg, k_seg)
    return _tk.flash_attn_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, causal, plan)


@flash_attn_fwd.register_fake
def _flash_attn_fwd_fake(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, causal, plan=None):
    B, Sq, Hq, D = q.shape
    return q.new_empty(B, Sq, Hq, D), q.new_empty(B, Hq, Sq, dtype=torch.float32)


@torch.library.custom_op("longvideo::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_pos: Tensor,
                   k_pos: Tensor, q_seg: Tensor, k_seg: Tensor, scale: float, causal: bool,
                   kv_plan: Optional[Tensor] = None, q_plan: Optional[Tensor] = None,
                   variant: str = "") -> tuple[Tensor, Tensor, Tensor]:
    """dq (B, Sq, Hq, D), dk and dv (B, Sk, Hkv, D), float32. out/lse may be global (ring).
    kv_plan / q_plan: tile plans (see _flash_attn_triton.flash_attn_backward) or None; variant:
    "fused", "split" or "" (the launch table's)."""
    _check_inputs(q, k, v, q_pos, k_pos, q_seg, k_seg)
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"dout and out must have q's shape {tuple(q.shape)}, got {tuple(dout.shape)}, "
                         f"{tuple(out.shape)}")
    if tuple(lse.shape) != (q.shape[0], q.shape[2], q.shape[1]):
        raise ValueError(f"lse must be (B, Hq, Sq) = {(q.shape[0], q.shape[2], q.shape[1])}, got {tuple(lse.shape)}")
    return _tk.flash_attn_backward(dout, q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, scale, causal,
                                   kv_plan, q_plan, variant)


@flash_attn_bwd.register_fake
def _flash_attn_bwd_fake(dout, q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, scale, causal, kv_plan=None,
                         q_plan=None, variant=""):
    f32 = torch.float32
    return q.new_empty(q.shape, dtype=f32), k.new_empty(k.shape, dtype=f32), v.new_empty(v.shape, dtype=f32)


# ----------------------------------------------------------------------------- layer 2: autograd


class FlashAttnFunc(torch.autograd.Function):
    """(q, k, v, positions, segments, scale, causal, plan) -> (out, lse); gradients for q, k, v only.
    plan: an AttentionPlan (or None: one is made for this call and its backward)."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, q_seg, k_seg, scale: float, causal: bool, plan=None):
        plan = plan if plan is not None else AttentionPlan()
        out, lse = _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, causal, plan)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg)
        ctx.scale, ctx.causal, ctx.plan = scale, causal, plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, ctx.scale,
                               ctx.causal, ctx.plan)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


def _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, causal, plan: Optional[AttentionPlan]):
    """The forward op with its tile plan taken from (or built into) `plan`."""
    tensor = None
    if plan is not None and not _tk.uses_decode(q.shape[1]) and q.shape[1] and k.shape[1] and q.shape[-1]:
        key = _tk.forward_plan_key(q.shape[-1], q.dtype, causal)
        tensor = plan.get(key, lambda: _tk.plan_for_key(key, q_pos, k_pos, q_seg, k_seg))
    return torch.ops.longvideo.flash_attn_fwd(q, k, v, q_pos, k_pos, q_seg, k_seg, float(scale), bool(causal), tensor)


def _backward(dout, q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, scale, causal, plan: Optional[AttentionPlan]):
    """The backward op with its tile plans taken from (or built into) `plan`."""
    kv_plan = q_plan = None
    if plan is not None and q.shape[1] and k.shape[1] and q.shape[-1]:
        kv_key, q_key = _tk.backward_plan_keys(q.shape[-1], q.dtype, causal)
        kv_plan = plan.get(kv_key, lambda: _tk.plan_for_key(kv_key, q_pos, k_pos, q_seg, k_seg))
        if q_key is not None:
            q_plan = plan.get(q_key, lambda: _tk.plan_for_key(q_key, q_pos, k_pos, q_seg, k_seg))
    variant = _tk.tile_config(q.shape[-1], q.dtype).variant
    return torch.ops.longvideo.flash_attn_bwd(dout, q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, float(scale),
                                              bool(causal), kv_plan, q_plan, variant)


# ----------------------------------------------------------------------------- layer 3: functional


def flash_attn(
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
    return_lse: bool = False,
    plan: Optional[AttentionPlan] = None,
):
    """Masked flash attention with the Triton kernel.

    q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D), Hq % Hkv == 0; fp16, bf16 or fp32; D from 1 to 256.
    q_pos, q_seg: (B, Sq); k_pos, k_seg: (B, Sk) integers. Defaults: positions 0..S-1, one segment.
    softmax_scale: default 1 / sqrt(D).
    plan: an AttentionPlan to keep tile plans in across calls with the same metadata.
    Returns out (B, Sq, Hq, D) in q.dtype, and with return_lse also lse (B, Hq, Sq) float32
    (-inf on rows with no visible key, whose out is 0). Differentiable in q, k, v.
    """
    q_pos, k_pos, q_seg, k_seg = fill_meta(q, k, q_pos, k_pos, q_seg, k_seg)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = FlashAttnFunc.apply(q, k, v, q_pos, k_pos, q_seg, k_seg, float(scale), bool(causal), plan)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- block backend


class TritonBackend:
    """The `triton` block backend (backends.py): same ops, block-backend signatures."""

    name = "triton"
    sync_free = True
    """No call reads a device value on the host: callers must not either (the ring launches every
    block, even one with nothing visible, instead of testing it on the host)."""

    def forward(self, q, k, v, q_pos, k_pos, q_seg, k_seg, scale, causal, plan=None):
        _check_inputs(q, k, v, q_pos, k_pos, q_seg, k_seg)
        return _forward(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, causal, plan)

    def backward(self, dout, q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, scale, causal, plan=None):
        # out/lse may be the global ring values: P = exp(S - lse_global) and rowsum(dO * O_global)
        # then give this block's exact share of the global gradients.
        _check_inputs(q, k, v, q_pos, k_pos, q_seg, k_seg)
        return _backward(dout, q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, scale, causal, plan)
