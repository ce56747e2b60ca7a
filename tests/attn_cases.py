"""Shared pieces of the attention tests: random metadata, the float64 reference with gradients, and
the dtype-derived tolerance (error <= 2 x the same-dtype PyTorch computation's error + eps)."""

from __future__ import annotations

import torch
from torch import Tensor

from longvideo.kernels import AttentionMeta, Side, flash_attn_ref


def meta_of(q_pos, k_pos, q_seg, k_seg, causal=True, scale=None) -> AttentionMeta:
    """The AttentionMeta of the four metadata tensors in the order the cases list them."""
    return AttentionMeta(Side(q_pos, q_seg), Side(k_pos, k_seg), causal, scale)


def packed_meta(
    B: int,
    S: int,
    gen: torch.Generator,
    *,
    min_len: int = 1,
    max_len: int = 40,
    restart: bool = True,
    pad: int = 0,
) -> tuple[Tensor, Tensor]:
    """Packed documents of random lengths in [min_len, max_len], then `pad` padding tokens (segment
    -1, position 0). Positions restart at 0 per document when `restart`, else run 0..S-1."""
    pos = torch.zeros(B, S, dtype=torch.long)
    seg = torch.full((B, S), -1, dtype=torch.long)
    for b in range(B):
        i, s = 0, 0
        while i < S - pad:
            n = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
            n = min(n, S - pad - i)
            seg[b, i : i + n] = s
            pos[b, i : i + n] = torch.arange(n) if restart else torch.arange(i, i + n)
            i, s = i + n, s + 1
    return pos, seg


def reference(q, k, v, meta: AttentionMeta, dout, *, upcast):
    """Materialised attention and its autograd gradients: upcast=True in float64 (the truth),
    upcast=False in the inputs' dtype (what a plain same-dtype computation gets wrong)."""
    dt = torch.float64 if upcast else q.dtype
    q, k, v = (x.detach().to(dt).requires_grad_(True) for x in (q, k, v))
    out, _ = flash_attn_ref(q, k, v, meta, upcast=False)
    out.backward(dout.to(dt))
    return out.detach(), q.grad, k.grad, v.grad


def max_err(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_within(name: str, got: Tensor, truth: Tensor, same_dtype: Tensor, eps: float = 1e-6):
    """got must be as close to truth as 2x the plain same-dtype result, plus eps."""
    assert got.shape == truth.shape, f"{name}: shape {tuple(got.shape)} != {tuple(truth.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err, base = max_err(got, truth), max_err(same_dtype, truth)
    assert err <= 2 * base + eps, f"{name}: error {err:.3g} > 2 x {base:.3g} + {eps:g}"
