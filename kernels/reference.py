"""Pure-PyTorch attention with position/segment masks: the reference every backend is tested against.

Mask rule (the one rule of the project): key j is visible to query i iff
    q_seg[i] == k_seg[j]  and  k_seg[j] >= 0  and  (not causal or k_pos[j] <= q_pos[i]).
Segment id -1 marks padding: such a token sees nothing and is seen by nothing.
A query row with no visible key has out = 0 and lse = -inf.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def default_meta(x: Tensor, S: int, device) -> tuple[Tensor, Tensor]:
    """Default positions 0..S-1 and a single segment 0, shape (B, S)."""
    B = x.shape[0]
    pos = torch.arange(S, device=device).unsqueeze(0).expand(B, S)
    seg = torch.zeros(B, S, dtype=torch.long, device=device)
    return pos, seg


def visibility(q_pos: Tensor, k_pos: Tensor, q_seg: Tensor, k_seg: Tensor, causal: bool) -> Tensor:
    """Boolean mask (B, Sq, Sk): True where the key is visible to the query."""
    vis = (q_seg[:, :, None] == k_seg[:, None, :]) & (k_seg[:, None, :] >= 0)
    if causal:
        vis = vis & (k_pos[:, None, :] <= q_pos[:, :, None])
    return vis


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def flash_attn_ref(
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
    upcast: bool = True,
) -> tuple[Tensor, Tensor]:
    """Materialised masked attention.

    q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D) with Hq % Hkv == 0.
    q_pos, q_seg: (B, Sq); k_pos, k_seg: (B, Sk). Defaults: positions 0..S-1, one segment.
    upcast: compute in fp32 (fp64 stays fp64); otherwise in the input dtype, as a plain
    same-dtype PyTorch computation would (used to measure the dtype's own error).
    Returns out (B, Sq, Hq, D) in q.dtype and lse (B, Hq, Sq) in the compute dtype (fp32 / fp64).
    """
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    dev = q.device
    if q_pos is None or q_seg is None:
        dp, ds = default_meta(q, Sq, dev)
        q_pos = dp if q_pos is None else q_pos
        q_seg = ds if q_seg is None else q_seg
    if k_pos is None or k_seg is None:
        dp, ds = default_meta(k, Sk, dev)
        k_pos = dp if k_pos is None else k_pos
        k_seg = ds if k_seg is None else k_seg
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    cdt = compute_dtype(q.dtype) if upcast else q.dtype
    G = Hq // Hkv
    qh = q.to(cdt).permute(0, 2, 1, 3)  # (B, Hq, Sq, D)
    kh = k.to(cdt).permute(0, 2, 1, 3).repeat_interleave(G, dim=1)  # (B, Hq, Sk, D)
    vh = v.to(cdt).permute(0, 2, 1, 3).repeat_interleave(G, dim=1)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # (B, Hq, Sq, Sk)
    vis = visibility(q_pos, k_pos, q_seg, k_seg, causal)[:, None]  # (B, 1, Sq, Sk)
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s.float() if cdt != torch.float64 else s, dim=-1)  # (B, Hq, Sq)
    p = torch.exp(s - lse.to(cdt)[..., None]).nan_to_num(0.0)
    out = torch.matmul(p, vh).permute(0, 2, 1, 3)  # (B, Sq, Hq, D)
    return out.to(q.dtype), lse
