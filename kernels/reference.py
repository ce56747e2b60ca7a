"""Pure-PyTorch attention with position/segment masks: the reference every backend is tested against.
It materialises the (B, Sq, Sk) mask and scores, affordable at test sizes only."""

from __future__ import annotations

import torch
from torch import Tensor

from .attention_math import accum_dtype, visibility
from .meta import AttentionMeta


def flash_attn_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    meta: AttentionMeta | None = None,
    *,
    upcast: bool = True,
) -> tuple[Tensor, Tensor]:
    """Materialised masked attention: q (B, Sq, Hq, D); k, v (B, Sk, Hkv, D) with Hq % Hkv == 0;
    meta as for `block_attention` (None: positions 0..S-1, one segment, causal). upcast: compute in
    fp32 (fp64 stays fp64); else in the input dtype, as a plain same-dtype PyTorch computation
    would (to measure that dtype's own error). Returns out (B, Sq, Hq, D) in q.dtype and lse
    (B, Hq, Sq) in the compute dtype (fp32 / fp64).
    """
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    meta = meta if meta is not None else AttentionMeta.default(q, k)
    cdt = accum_dtype(q.dtype) if upcast else q.dtype
    G = Hq // Hkv
    qh = q.to(cdt).permute(0, 2, 1, 3)  # (B, Hq, Sq, D)
    kh = k.to(cdt).permute(0, 2, 1, 3).repeat_interleave(G, dim=1)  # (B, Hq, Sk, D)
    vh = v.to(cdt).permute(0, 2, 1, 3).repeat_interleave(G, dim=1)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * meta.scale_for(D)  # (B, Hq, Sq, Sk)
    vis = visibility(meta.queries, meta.keys, meta.causal)[:, None]  # (B, 1, Sq, Sk)
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s.float() if cdt != torch.float64 else s, dim=-1)  # (B, Hq, Sq)
    p = torch.exp(s - lse.to(cdt)[..., None]).nan_to_num(0.0)
    out = torch.matmul(p, vh).permute(0, 2, 1, 3)  # (B, Sq, Hq, D)
    return out.to(q.dtype), lse
