"""Masked flash attention with the Triton kernel (docs/kernels.md, "Using it"): the raw custom ops
`torch.ops.longvideo.flash_attn_fwd` / `flash_attn_bwd` (with fake implementations, so
torch.compile traces through them), `flash_attn` (differentiated by interface.py's
autograd.Function) and the `triton` block backend. Nothing on this path reads the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _flash_attn_triton as _tk
from .backends import Upstream
from .interface import attention
from .meta import AttentionMeta

__all__ = ["TritonBackend", "flash_attn", "flash_attn_bwd", "flash_attn_fwd"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, meta: AttentionMeta) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be (B, S, H, D); got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    B, Sq, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(
            f"k/v batch and head dim must match q: q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if k.shape[2] == 0 or Hq % k.shape[2]:
        raise ValueError(f"query heads {Hq} must be a multiple of key/value heads {k.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"triton flash attention supports fp16, bf16 and fp32 inputs, got {q.dtype}"
        )
    if not 1 <= D <= _tk.MAX_HEAD_DIM:
        raise ValueError(
            f"triton flash attention supports head dims 1..{_tk.MAX_HEAD_DIM}, got {D}; "
            f"use backend='torch' or 'cpu' for others"
        )
    meta.check(q, k)
    devices = {t.device for t in (q, k, v, *meta.tensors())}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if q.device.type != "cuda" and not (_tk.INTERPRET and q.device.type == "cpu"):
        raise ValueError(
            f"the triton backend needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 "
            f"set before import), got {q.device}"
        )


@torch.library.custom_op("longvideo::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    meta: list[Tensor],
    scale: float,
    causal: bool,
    plan: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """out (B, Sq, Hq, D) in q.dtype and lse (B, Hq, Sq) float32 (-inf on empty rows). meta: the
    metadata's tensors (AttentionMeta.tensors()); plan: the int32 tile plan of this shape's
    forward tiles (_flash_attn_triton.build_plan), or None."""
    attention_meta = AttentionMeta.from_tensors(meta, causal=causal, scale=scale)
    _check_inputs(q, k, v, attention_meta)
    if plan is not None:
        _tk.keep_plan(attention_meta, _tk.tile_config(q.shape[-1], q.dtype).fwd, False, plan)
    return _tk.flash_attn_forward(q, k, v, attention_meta)


@flash_attn_fwd.register_fake
def _flash_attn_fwd_fake(q, k, v, meta, scale, causal, plan=None):
    B, Sq, Hq, D = q.shape
    return q.new_empty(B, Sq, Hq, D), q.new_empty(B, Hq, Sq, dtype=torch.float32)


@torch.library.custom_op("longvideo::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    meta: list[Tensor],
    scale: float,
    causal: bool,
    kv_plan: Tensor | None = None,
    q_plan: Tensor | None = None,
    variant: str = "",
) -> tuple[Tensor, Tensor, Tensor]:
    """dq (B, Sq, Hq, D), dk and dv (B, Sk, Hkv, D), float32. out/lse may be global (ring).
    kv_plan / q_plan: tile plans (see _flash_attn_triton.flash_attn_backward) or None; variant:
    "fused", "split" or "" (the launch table's)."""
    attention_meta = AttentionMeta.from_tensors(meta, causal=causal, scale=scale)
    _check_inputs(q, k, v, attention_meta)
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(
            f"dout and out must have q's shape {tuple(q.shape)}, got {tuple(dout.shape)}, "
            f"{tuple(out.shape)}"
        )
    if tuple(lse.shape) != (q.shape[0], q.shape[2], q.shape[1]):
        raise ValueError(
            f"lse must be (B, Hq, Sq) = {(q.shape[0], q.shape[2], q.shape[1])}, got {tuple(lse.shape)}"
        )
    cfg = _tk.tile_config(q.shape[-1], q.dtype)
    for launch, transpose, plan in ((cfg.bwd, True, kv_plan), (cfg.dq, False, q_plan)):
        if plan is not None:
            _tk.keep_plan(attention_meta, launch, transpose, plan)
    return _tk.flash_attn_backward(Upstream(dout, out, lse), q, k, v, attention_meta, variant)


@flash_attn_bwd.register_fake
def _flash_attn_bwd_fake(
    dout, q, k, v, out, lse, meta, scale, causal, kv_plan=None, q_plan=None, variant=""
):
    f32 = torch.float32
    return (
        q.new_empty(q.shape, dtype=f32),
        k.new_empty(k.shape, dtype=f32),
        v.new_empty(v.shape, dtype=f32),
    )


def flash_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    meta: AttentionMeta | None = None,
    *,
    return_lse: bool = False,
):
    """Masked flash attention with the Triton kernel; differentiable in q, k, v. q: (B, Sq, Hq, D);
    k, v: (B, Sk, Hkv, D), Hq % Hkv == 0; fp16, bf16 or fp32; D from 1 to 256; meta as for
    `block_attention`. Returns out (B, Sq, Hq, D) in q.dtype, and with return_lse also lse
    (B, Hq, Sq) float32 (-inf on rows with no visible key, whose out is 0)."""
    out, lse = attention(q, k, v, meta, "triton")
    return (out, lse) if return_lse else out


class TritonBackend:
    """The `triton` block backend (backends.py) on the same ops. sync_free: no call reads a device
    value on the host, so callers must not either (the ring launches even an empty block)."""

    name = "triton"
    sync_free = True

    def forward(self, q, k, v, meta: AttentionMeta):
        """The forward op with its tile plan taken from (or built into) the metadata's store."""
        _check_inputs(q, k, v, meta)
        plan = None
        if not _tk.uses_decode(q.shape[1]) and q.shape[1] and k.shape[1] and q.shape[-1]:
            plan = _tk.kept_plan(meta, _tk.tile_config(q.shape[-1], q.dtype).fwd, False)
        scale = float(meta.scale_for(q.shape[-1]))
        return torch.ops.longvideo.flash_attn_fwd(
            q, k, v, meta.tensors(), scale, bool(meta.causal), plan
        )

    def backward(self, dout, q, k, v, out, lse, meta: AttentionMeta):
        """The backward op with its tile plans taken from (or built into) the metadata's store."""
        _check_inputs(q, k, v, meta)
        cfg, kv_plan, q_plan = _tk.tile_config(q.shape[-1], q.dtype), None, None
        if q.shape[1] and k.shape[1] and q.shape[-1]:
            kv_plan = _tk.kept_plan(meta, cfg.bwd, True)
            q_plan = _tk.kept_plan(meta, cfg.dq, False) if cfg.variant == "split" else None
        scale = float(meta.scale_for(q.shape[-1]))
        return torch.ops.longvideo.flash_attn_bwd(
            dout,
            q,
            k,
            v,
            out,
            lse,
            meta.tensors(),
            scale,
            bool(meta.causal),
            kv_plan,
            q_plan,
            cfg.variant,
        )
