"""The `torch` block backend: exact, tiled, pure PyTorch (memory O(tile^2) per batch and head), the
readable statement of the algorithm: an online softmax over key tiles, and the recomputation form
of the backward (P = exp(S - lse), dS = P * (dP - rowsum(dO * O))). All-masked tiles are skipped.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention_math import accum_dtype, visibility
from .meta import AttentionMeta


def _heads_first(q: Tensor, k: Tensor, v: Tensor, cdt: torch.dtype):
    """(B, S, H, D) -> q (B, Hkv, G, Sq, D), k and v (B, Hkv, 1, Sk, D) in the compute dtype `cdt`."""
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    qh = q.to(cdt).view(B, Sq, Hkv, Hq // Hkv, D).permute(0, 2, 3, 1, 4)
    kh = k.to(cdt).permute(0, 2, 1, 3).unsqueeze(2)
    vh = v.to(cdt).permute(0, 2, 1, 3).unsqueeze(2)
    return qh, kh, vh


def _tile_visibility(meta: AttentionMeta, i: int, j: int, T: int) -> Tensor:
    """(B, 1, 1, tq, tk) visibility of query tile [i, i + T) against key tile [j, j + T)."""
    vis = visibility(meta.queries.span(i, i + T), meta.keys.span(j, j + T), meta.causal)
    return vis[:, None, None]


class TorchBackend:
    name = "torch"
    sync_free = False  # skips empty tiles with a host test

    def __init__(self, tile: int = 512):
        self.tile = tile

    def forward(self, q, k, v, meta: AttentionMeta):
        cdt, scale = accum_dtype(q.dtype), meta.scale_for(q.shape[-1])
        qh, kh, vh = _heads_first(q, k, v, cdt)
        (B, Hkv, G, Sq, D), Sk = qh.shape, k.shape[1]
        out = torch.zeros(B, Hkv, G, Sq, D, dtype=cdt, device=q.device)
        lse = torch.full((B, Hkv, G, Sq), float("-inf"), dtype=cdt, device=q.device)
        T = self.tile
        for i in range(0, Sq, T):
            qi = qh[:, :, :, i : i + T]
            m = torch.full(qi.shape[:-1], float("-inf"), dtype=cdt, device=q.device)  # running max
            l = torch.zeros_like(m)  # running sum of exp(s - m)
            acc = torch.zeros_like(qi)
            for j in range(0, Sk, T):
                vis = _tile_visibility(meta, i, j, T)
                if not bool(vis.any()):
                    continue  # the whole tile is masked: skip it
                s = torch.matmul(qi, kh[:, :, :, j : j + T].transpose(-1, -2)) * scale
                s = s.masked_fill(~vis, float("-inf"))
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                p = torch.exp(s - m_safe[..., None])
                alpha = torch.exp(m - m_safe)
                l = l * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + torch.matmul(p, vh[:, :, :, j : j + T])
                m = m_new
            has = l > 0
            out[:, :, :, i : i + T] = torch.where(
                has[..., None], acc / l.clamp_min(1e-300)[..., None], 0.0
            )
            lse[:, :, :, i : i + T] = torch.where(
                has, m + torch.log(l.clamp_min(1e-300)), float("-inf")
            )
        out = out.permute(0, 3, 1, 2, 4).reshape(B, Sq, -1, D).to(q.dtype)
        lse = lse.reshape(B, -1, Sq)
        return out, (lse if cdt == torch.float64 else lse.float())

    def backward(self, dout, q, k, v, out, lse, meta: AttentionMeta):
        cdt, scale = accum_dtype(q.dtype), meta.scale_for(q.shape[-1])
        qh, kh, vh = _heads_first(q, k, v, cdt)
        (B, Hkv, G, Sq, D), Sk = qh.shape, k.shape[1]
        doh, oh = (_heads_first(x, k, v, cdt)[0] for x in (dout, out))  # (B, Hkv, G, Sq, D)
        lse_h = lse.to(cdt).view(B, Hkv, G, Sq)
        delta = (doh * oh).sum(-1)  # (B, Hkv, G, Sq)
        dq = torch.zeros_like(qh)
        dk, dv = (torch.zeros(B, Hkv, Sk, D, dtype=cdt, device=q.device) for _ in range(2))
        T = self.tile
        for i in range(0, Sq, T):
            qi, doi = qh[:, :, :, i : i + T], doh[:, :, :, i : i + T]
            li = lse_h[:, :, :, i : i + T]
            li = torch.where(
                torch.isinf(li), torch.full_like(li, float("inf")), li
            )  # empty rows: P = 0
            di = delta[:, :, :, i : i + T]
            for j in range(0, Sk, T):
                vis = _tile_visibility(meta, i, j, T)
                if not bool(vis.any()):
                    continue
                kj, vj = kh[:, :, :, j : j + T], vh[:, :, :, j : j + T]
                s = torch.matmul(qi, kj.transpose(-1, -2)) * scale
                p = torch.exp(s - li[..., None]).masked_fill(~vis, 0.0)  # (B, Hkv, G, tq, tk)
                dv[:, :, j : j + T] += torch.matmul(p.transpose(-1, -2), doi).sum(2)
                dp = torch.matmul(doi, vj.transpose(-1, -2))
                ds = p * (dp - di[..., None])
                dq[:, :, :, i : i + T] += torch.matmul(ds, kj) * scale
                dk[:, :, j : j + T] += torch.matmul(ds.transpose(-1, -2), qi).sum(2) * scale
        dq = dq.permute(0, 3, 1, 2, 4).reshape(B, Sq, -1, D)
        dk, dv = dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)
        return (dq, dk, dv) if cdt == torch.float64 else (dq.float(), dk.float(), dv.float())
