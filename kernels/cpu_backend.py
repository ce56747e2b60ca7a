"""The `cpu` block backend: torch's fused flash-attention CPU op on tiles classified from metadata.

The key and query sequences are cut into tiles along the places where positions stop being
consecutive or the segment id changes (and every `tile` tokens inside long runs; runs shorter than
`min_tile` are pooled so that many tiny packed documents do not become many tiny op calls). Each
(query tile, key tile) pair is then classified from per-row min/max of positions and segments:

    skipped        the mask is provably all false (segment ranges disjoint, only padding keys,
                   or every key after every query under causal masking): no work at all;
    full           one segment on both sides and (non-causal, or every key at or before every
                   query): flash op, is_causal=False;
    aligned-causal both tiles are the same run of consecutive positions in one segment: flash op,
                   is_causal=True (its top-left triangle is then exactly the position rule);
    masked         anything else: flash op with an additive -inf mask built for this tile only
                   (measured ~2x faster than the exact torch tiles on CPU); rows of the tile with
                   no visible key are set to out = 0, lse = -inf afterwards.

In the zigzag ring layout every pair of chunks is full, aligned-causal or skipped unless packed
segments cut it, so the masked path only runs on tiles that straddle a document boundary.

Tiles are merged with the log-sum-exp rule in fp32 (fp64 for fp64 inputs). Half-precision inputs
are computed in fp32: the op's bf16 backward is ~9x slower than fp32 on CPUs without bf16 matrix
units, and fp32 tiles also round less. GQA needs no repeated heads: the op maps query head h to
key/value head h // (Hq // Hkv), as the reference does.

The backward takes the *global* out/lse (ring attention): the op recomputes P = exp(S - lse) and
D = rowsum(dO * O) from them, so each tile yields its exact share of dq, dk, dv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.reference import compute_dtype, visibility

_flash_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

SKIP, FULL, CAUSAL, MASKED = "skip", "full", "causal", "masked"


@dataclass(frozen=True)
class Tile:
    """A slice [start, stop) of a sequence plus per-batch-row statistics of its metadata."""

    start: int
    stop: int
    pure: bool
    """One segment and consecutive positions in every batch row (a single run)."""
    seg_min: Tensor  # (B,)
    seg_max: Tensor  # (B,)
    pos_min: Tensor  # (B,)
    pos_max: Tensor  # (B,)
    pos_first: Tensor  # (B,)


def _runs(pos: Tensor, seg: Tensor) -> list[tuple[int, int]]:
    """Maximal ranges where, in every batch row, the segment is constant and positions step by +1."""
    S = pos.shape[1]
    if S == 0:
        return []
    brk = ((pos[:, 1:] != pos[:, :-1] + 1) | (seg[:, 1:] != seg[:, :-1])).any(0)  # (S-1,)
    cuts = [0] + (brk.nonzero().flatten() + 1).tolist() + [S]
    return list(zip(cuts[:-1], cuts[1:]))


def make_tiles(pos: Tensor, seg: Tensor, tile: int, min_tile: int) -> list[Tile]:
    """Cut (B, S) metadata into tiles of at most `tile` tokens (see the module docstring)."""
    pieces: list[tuple[int, int, bool]] = []  # (start, stop, pure)
    for a, b in _runs(pos, seg):
        n = -(-(b - a) // tile)  # equal pieces of at most `tile` tokens
        edges = [a + (b - a) * i // n for i in range(n + 1)]
        pieces += [(edges[i], edges[i + 1], True) for i in range(n)]
    merged: list[tuple[int, int, bool]] = []
    for a, b, pure in pieces:
        if merged and b - a < min_tile:
            pa, pb, ppure = merged[-1]
            if pb - pa < min_tile and b - pa <= tile:  # pool consecutive short pieces
                merged[-1] = (pa, b, False)
                continue
        merged.append((a, b, pure))
    tiles = []
    for a, b, pure in merged:
        p, s = pos[:, a:b], seg[:, a:b]
        tiles.append(Tile(a, b, pure, s.amin(1), s.amax(1), p.amin(1), p.amax(1), p[:, 0]))
    return tiles


def classify(qt: Tile, kt: Tile, causal: bool) -> str:
    """SKIP, FULL, CAUSAL or MASKED for a (query tile, key tile) pair; every test holds per batch row."""
    disjoint = (kt.seg_max < 0) | (qt.seg_max < kt.seg_min) | (kt.seg_max < qt.seg_min)
    if causal:
        disjoint = disjoint | (kt.pos_min > qt.pos_max)
    if bool(disjoint.all()):
        return SKIP
    one_seg = (qt.seg_min == qt.seg_max) & (kt.seg_min == kt.seg_max) & (qt.seg_min == kt.seg_min) \
        & (qt.seg_min >= 0)
    if not bool(one_seg.all()):
        return MASKED
    if not causal or bool((kt.pos_max <= qt.pos_min).all()):
        return FULL
    if qt.pure and kt.pure and qt.stop - qt.start == kt.stop - kt.start \
            and bool((qt.pos_first == kt.pos_first).all()):
        return CAUSAL
    return MASKED


def lse_merge_(out: Tensor, lse: Tensor, blk_out: Tensor, blk_lse: Tensor) -> None:
    """Merge a partial attention result into a running one, in place, without overflow.

    out, blk_out (B, S, H, D); lse, blk_lse (B, H, S). out/lse are the accumulators (fp32 or fp64);
    blk_out may be in any dtype. lse_new = logaddexp(lse, blk_lse) and
    out_new = exp(lse - lse_new) * out + exp(blk_lse - lse_new) * blk_out; both weights are <= 1,
    so nothing overflows, and rows where both sides are empty (-inf) stay out = 0, lse = -inf.
    """
    new = torch.logaddexp(lse, blk_lse.to(lse.dtype))  # (B, H, S)
    empty = torch.isneginf(new)
    safe = torch.where(empty, torch.zeros_like(new), new)
    w_old = torch.exp(lse - safe).masked_fill_(empty, 0.0).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    w_blk = torch.exp(blk_lse.to(lse.dtype) - safe).masked_fill_(empty, 0.0).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).addcmul_(blk_out.to(out.dtype), w_blk)
    lse.copy_(new)


class CpuBackend:
    name = "cpu"

    def __init__(self, tile: int = 1024, min_tile: int = 128):
        self.tile = tile
        self.min_tile = min_tile

    def _plan(self, q_pos, k_pos, q_seg, k_seg, causal):
        qts = make_tiles(q_pos, q_seg, self.tile, self.min_tile)
        kts = make_tiles(k_pos, k_seg, self.tile, self.min_tile)
        plan = []
        for qt in qts:
            pairs = []
            for kt in kts:
                kind = classify(qt, kt, causal)
                if kind == MASKED:
                    vis = visibility(q_pos[:, qt.start:qt.stop], k_pos[:, kt.start:kt.stop],
                                     q_seg[:, qt.start:qt.stop], k_seg[:, kt.start:kt.stop], causal)
                    if not bool(vis.any()):
                        continue
                    pairs.append((kt, kind, vis))
                elif kind != SKIP:
                    pairs.append((kt, kind, None))
            plan.append((qt, pairs))
        return plan

    @staticmethod
    def _mask(vis: Tensor, dtype: torch.dtype) -> Tensor:
        """(B, tq, tk) bool -> additive (B, 1, tq, tk) mask in the op dtype."""
        return torch.zeros(vis.shape, dtype=dtype).masked_fill_(~vis, float("-inf")).unsqueeze(1)

    def forward(self, q, k, v, q_pos, k_pos, q_seg, k_seg, scale, causal):
        B, Sq, Hq, D = q.shape
        cdt = compute_dtype(q.dtype)
        qc, kc, vc = (x.to(cdt).transpose(1, 2) for x in (q, k, v))  # (B, H, S, D) views
        out = torch.zeros(B, Sq, Hq, D, dtype=cdt)
        lse = torch.full((B, Hq, Sq), float("-inf"), dtype=cdt)
        for qt, pairs in self._plan(q_pos, k_pos, q_seg, k_seg, causal):
            qs = slice(qt.start, qt.stop)
            for n, (kt, kind, vis) in enumerate(pairs):
                ks = slice(kt.start, kt.stop)
                mask = self._mask(vis, cdt) if kind == MASKED else None
                o, l = _flash_fwd(qc[:, :, qs], kc[:, :, ks], vc[:, :, ks], 0.0, kind == CAUSAL,
                                  attn_mask=mask, scale=scale)  # (B, H, tq, D), (B, H, tq)
                o = o.transpose(1, 2)  # (B, tq, H, D)
                if kind == MASKED:  # rows with no visible key in this tile: empty, not garbage
                    none = ~vis.any(-1)  # (B, tq)
                    o = o.masked_fill(none[:, :, None, None], 0.0)
                    l = l.masked_fill(none[:, None, :], float("-inf"))
                if n == 0:
                    out[:, qs] = o
                    lse[:, :, qs] = l
                else:
                    lse_merge_(out[:, qs], lse[:, :, qs], o, l)
        lse = lse if cdt == torch.float64 else lse.float()
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, scale, causal):
        B, Sq, Hq, D = q.shape
        cdt = compute_dtype(q.dtype)
        qc, kc, vc, doc, oc = (x.to(cdt).transpose(1, 2) for x in (q, k, v, dout, out))
        # Rows with no visible key anywhere (lse = -inf) get lse = +inf, so P = exp(S - lse) = 0.
        lse_c = lse.to(cdt).masked_fill(torch.isneginf(lse), float("inf"))
        dq = torch.zeros(B, Sq, Hq, D, dtype=cdt)
        dk = torch.zeros(k.shape, dtype=cdt)
        dv = torch.zeros(v.shape, dtype=cdt)
        for qt, pairs in self._plan(q_pos, k_pos, q_seg, k_seg, causal):
            qs = slice(qt.start, qt.stop)
            for kt, kind, vis in pairs:
                ks = slice(kt.start, kt.stop)
                mask = self._mask(vis, cdt) if kind == MASKED else None
                g = _flash_bwd(doc[:, :, qs], qc[:, :, qs], kc[:, :, ks], vc[:, :, ks], oc[:, :, qs],
                               lse_c[:, :, qs], 0.0, kind == CAUSAL, attn_mask=mask, scale=scale)
                dq[:, qs] += g[0].transpose(1, 2)
                dk[:, ks] += g[1].transpose(1, 2)
                dv[:, ks] += g[2].transpose(1, 2)
        if cdt != torch.float64:
            dq, dk, dv = dq.float(), dk.float(), dv.float()
        return dq, dk, dv
