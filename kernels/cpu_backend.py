"""The `cpu` block backend: torch's fused flash-attention CPU op on tiles classified from metadata
(docs/ring_attention.md, "Block backends"): tiles follow runs of consecutive positions in one
segment (cut every `tile` tokens, runs shorter than `min_tile` pooled), each tile pair skipped,
full, aligned-causal or masked. 16-bit inputs compute in fp32 (the op's bf16 backward is ~9x
slower on CPUs without bf16 matrix units).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .attention_math import (
    FULL as _FULL,
)
from .attention_math import (
    SKIP as _SKIP,
)
from .attention_math import (
    accum_dtype,
    classify_tiles,
    lse_merge_,
    runs,
    tile_stats,
    visibility,
)
from .meta import AttentionMeta, Side

_flash_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

SKIP, FULL, CAUSAL, MASKED = "skip", "full", "causal", "masked"


@dataclass(frozen=True)
class Tile:
    """A slice [start, stop) of a sequence."""

    start: int
    stop: int
    pure: bool
    """One segment and consecutive positions in every batch row (a single run)."""


def make_tiles(side: Side, tile: int, min_tile: int) -> list[Tile]:
    """Cut one side's (B, S) metadata into tiles of at most `tile` tokens (module docstring)."""
    pieces: list[tuple[int, int, bool]] = []  # (start, stop, pure)
    for a, b in runs(side.positions, side.segment_ids, True, real_only=False):
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
    return [Tile(a, b, pure) for a, b, pure in merged]


def plan(
    meta: AttentionMeta, tile: int, min_tile: int
) -> list[tuple[Tile, list[tuple[Tile, str, Tensor | None]]]]:
    """Per query tile, the key tiles to compute with their kind (FULL, CAUSAL or MASKED; MASKED
    pairs carry their (B, tq, tk) visibility). Classes come from the shared tile bounds
    (attention_math.classify_tiles); a partial pair that is the same run of consecutive positions
    in one segment on both sides is CAUSAL: the op's top-left triangle is then exactly the rule."""
    queries, keys, causal = meta.queries, meta.keys, meta.causal
    (q_pos, q_seg), (k_pos, k_seg) = (
        (side.positions, side.segment_ids) for side in (queries, keys)
    )
    qts = make_tiles(queries, tile, min_tile)
    kts = make_tiles(keys, tile, min_tile)
    if not qts or not kts:
        return [(qt, []) for qt in qts]
    qs = tile_stats(q_pos, q_seg, [t.start for t in qts] + [qts[-1].stop])
    ks = tile_stats(k_pos, k_seg, [t.start for t in kts] + [kts[-1].stop])
    cls = classify_tiles(qs, ks, causal)  # (B, n_q, n_k)
    classes = cls.amin(0).tolist()  # a pair is FULL only when it is FULL in every batch row
    visit = (cls != _SKIP).any(0).tolist()  # and visited when some row may see something
    q_first, k_first = q_pos[:, [t.start for t in qts]], k_pos[:, [t.start for t in kts]]
    out = []
    for i, qt in enumerate(qts):
        pairs = []
        for j, kt in enumerate(kts):
            if not visit[i][j]:
                continue
            if classes[i][j] == _FULL:
                pairs.append((kt, FULL, None))
                continue
            one_run = qt.pure and kt.pure and qt.stop - qt.start == kt.stop - kt.start
            if (
                causal
                and one_run
                and bool((q_first[:, i] == k_first[:, j]).all())
                and bool((qs.seg_min[:, i] == ks.seg_min[:, j]).all())
                and bool((qs.seg_min[:, i] >= 0).all())
            ):
                pairs.append((kt, CAUSAL, None))
                continue
            vis = visibility(queries.span(qt.start, qt.stop), keys.span(kt.start, kt.stop), causal)
            if bool(vis.any()):
                pairs.append((kt, MASKED, vis))
        out.append((qt, pairs))
    return out


class CpuBackend:
    name = "cpu"
    sync_free = False  # plans on the host (tile lists), which is what a CPU backend can do

    def __init__(self, tile: int = 1024, min_tile: int = 128):
        self.tile = tile
        self.min_tile = min_tile

    def _plan(self, meta: AttentionMeta):
        """The tile plan, kept in the metadata's plan store."""
        key = ("cpu", self.tile, self.min_tile, meta.causal)
        return meta.plans.get(key, lambda: plan(meta, self.tile, self.min_tile))

    @staticmethod
    def _mask(vis: Tensor, dtype: torch.dtype) -> Tensor:
        """(B, tq, tk) bool -> additive (B, 1, tq, tk) mask in the op dtype."""
        return torch.zeros(vis.shape, dtype=dtype).masked_fill_(~vis, float("-inf")).unsqueeze(1)

    def forward(self, q, k, v, meta: AttentionMeta):
        B, Sq, Hq, D = q.shape
        scale = meta.scale_for(D)
        cdt = accum_dtype(q.dtype)
        qc, kc, vc = (x.to(cdt).transpose(1, 2) for x in (q, k, v))  # (B, H, S, D) views
        out = torch.zeros(B, Sq, Hq, D, dtype=cdt)
        lse = torch.full((B, Hq, Sq), float("-inf"), dtype=cdt)
        for qt, pairs in self._plan(meta):
            qs = slice(qt.start, qt.stop)
            for n, (kt, kind, vis) in enumerate(pairs):
                ks = slice(kt.start, kt.stop)
                mask = self._mask(vis, cdt) if kind == MASKED else None
                o, l = _flash_fwd(
                    qc[:, :, qs],
                    kc[:, :, ks],
                    vc[:, :, ks],
                    0.0,
                    kind == CAUSAL,
                    attn_mask=mask,
                    scale=scale,
                )  # (B, H, tq, D), (B, H, tq)
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

    def backward(self, dout, q, k, v, out, lse, meta: AttentionMeta):
        cdt, scale = accum_dtype(q.dtype), meta.scale_for(q.shape[-1])
        qc, kc, vc, doc, oc = (x.to(cdt).transpose(1, 2) for x in (q, k, v, dout, out))
        # Rows with no visible key anywhere (lse = -inf) get lse = +inf, so P = exp(S - lse) = 0.
        lse_c = lse.to(cdt).masked_fill(torch.isneginf(lse), float("inf"))
        dq, dk, dv = (torch.zeros(x.shape, dtype=cdt) for x in (q, k, v))
        for qt, pairs in self._plan(meta):
            qs = slice(qt.start, qt.stop)
            for kt, kind, vis in pairs:
                ks = slice(kt.start, kt.stop)
                mask = self._mask(vis, cdt) if kind == MASKED else None
                g = _flash_bwd(
                    doc[:, :, qs],
                    qc[:, :, qs],
                    kc[:, :, ks],
                    vc[:, :, ks],
                    oc[:, :, qs],
                    lse_c[:, :, qs],
                    0.0,
                    kind == CAUSAL,
                    attn_mask=mask,
                    scale=scale,
                )
                for x, sl, gx in zip((dq, dk, dv), (qs, ks, ks), g):
                    x[:, sl] += gx.transpose(1, 2)
        return (dq, dk, dv) if cdt == torch.float64 else (dq.float(), dk.float(), dv.float())
