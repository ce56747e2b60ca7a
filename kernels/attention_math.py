"""The math every attention implementation shares: the mask rule and every restatement of it, so
the backends, the ring and sequence-parallel inference cannot disagree (docs/kernels.md).

Mask rule (the one rule of the project): key j is visible to query i iff

    q_seg[i] == k_seg[j]  and  k_seg[j] >= 0  and  (not causal or k_pos[j] <= q_pos[i]).

Segment id -1 marks padding: it sees nothing and is seen by nothing. A query row with no visible
key has out = 0 and lse = -inf. Only `dense_pieces` reads device values on the host (host copies).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .meta import Side

SKIP, PARTIAL, FULL = 0, 1, 2
"""Tile classes returned by `classify_tiles` (int8)."""

_BIG = 2**62  # beyond any position or segment id: the min of an empty tile, minus the max


def _tensors(side: Side) -> tuple[Tensor, Tensor]:
    return side.positions, side.segment_ids


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype merges and gradient sums accumulate in: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def visibility(queries: Side, keys: Side, causal: bool) -> Tensor:
    """Boolean mask (B, Sq, Sk): True where the key is visible to the query."""
    q_pos, q_seg, k_pos, k_seg = (*_tensors(queries), *_tensors(keys))
    vis = (q_seg[:, :, None] == k_seg[:, None, :]) & (k_seg[:, None, :] >= 0)
    if causal:
        vis = vis & (k_pos[:, None, :] <= q_pos[:, :, None])
    return vis


@dataclass(frozen=True)
class TileStats:
    """Per tile, per batch row, statistics of the real (segment >= 0) tokens; each (B, n) int64. An
    empty tile (padding only, or past the end) has min = +BIG and max = -BIG, so it overlaps nothing.
    `complete`: every slot of the tile is in range and real."""

    pos_min: Tensor
    pos_max: Tensor
    seg_min: Tensor
    seg_max: Tensor
    complete: Tensor


def tile_stats(pos: Tensor, seg: Tensor, tile: int | Sequence[int]) -> TileStats:
    """Statistics of (B, S) positions / segment ids cut into tiles: an int T (tiles [0, T), [T, 2T),
    ...; the last one may run past S) or the boundaries [0, b1, ..., S] of tiles of any sizes."""
    B, S = pos.shape
    pos, seg = pos.long(), seg.long()
    if isinstance(tile, int):  # slots past the end are padding (segment -1): empty
        n = -(-S // tile)
        pos, seg = F.pad(pos, (0, n * tile - S)), F.pad(seg, (0, n * tile - S), value=-1)
    real = seg >= 0
    lo_pos, hi_pos = pos.masked_fill(~real, _BIG), pos.masked_fill(~real, -_BIG)
    lo_seg, hi_seg = seg.masked_fill(~real, _BIG), seg.masked_fill(~real, -_BIG)
    starts = None if isinstance(tile, int) else torch.tensor(list(tile)[:-1], device=pos.device)

    def reduce(x: Tensor, op: str) -> Tensor:  # amin / amax over each tile
        return getattr(x.view(B, n, tile), op)(-1) if starts is None else _segment(x, starts, S, op)

    return TileStats(
        reduce(lo_pos, "amin"),
        reduce(hi_pos, "amax"),
        reduce(lo_seg, "amin"),
        reduce(hi_seg, "amax"),
        reduce(real.long(), "amin").bool(),
    )


def _segment(x: Tensor, starts: Tensor, S: int, op: str) -> Tensor:
    """amin / amax of x (B, S) over the ranges [starts[i], starts[i+1]) (the last one ends at S)."""
    B = x.shape[0]
    n = starts.numel()
    idx = torch.zeros(S, dtype=torch.long, device=x.device)
    if n > 1:
        idx.index_add_(0, starts[1:], torch.ones(n - 1, dtype=torch.long, device=x.device))
    idx = idx.cumsum(0).unsqueeze(0).expand(B, S)  # tile of each token
    fill = _BIG if op == "amin" else -_BIG
    out = x.new_full((B, n), fill)
    return out.scatter_reduce(1, idx, x, reduce=op, include_self=True)


def classify_tiles(q: TileStats, k: TileStats, causal: bool) -> Tensor:
    """(B, n_q, n_k) int8 classes SKIP / PARTIAL / FULL of every (query tile, key tile) pair
    (docs/kernels.md, "The tile plan"). An empty tile overlaps nothing."""
    Q = lambda x: x[:, :, None]  # noqa: E731 - (B, n_q, 1)
    K = lambda x: x[:, None, :]  # noqa: E731 - (B, 1, n_k)
    visit = (Q(q.seg_min) <= K(k.seg_max)) & (K(k.seg_min) <= Q(q.seg_max))
    full = (
        visit
        & Q(q.complete)
        & K(k.complete)
        & Q(q.seg_min == q.seg_max)
        & K(k.seg_min == k.seg_max)
        & (Q(q.seg_min) == K(k.seg_min))
    )
    if causal:
        visit = visit & (K(k.pos_min) <= Q(q.pos_max))
        full = full & (K(k.pos_max) <= Q(q.pos_min))
    return visit.to(torch.int8) + full.to(torch.int8)


def block_class(queries: Side, keys: Side, causal: bool) -> Tensor:
    """(B,) int8 class of a whole query block against a whole key block (one tile each)."""
    q = tile_stats(*_tensors(queries), max(1, queries.length))
    k = tile_stats(*_tensors(keys), max(1, keys.length))
    return classify_tiles(q, k, causal)[:, 0, 0]


Piece = tuple[int, int, int, int, bool]
"""(q_start, q_stop, k_start, k_stop, causal) of `dense_pieces`."""


def runs(pos: Tensor, seg: Tensor, causal: bool, real_only: bool = True) -> list[tuple[int, int]]:
    """Maximal [start, stop) where, in every row, the segment is constant and (causal) positions step
    by +1: over real tokens only (a run of padding is one run whatever its positions), or with
    real_only=False over every token. Host tensors (B, S)."""
    S = pos.shape[1]
    if S == 0:
        return []
    brk = seg[:, 1:] != seg[:, :-1]
    if causal:
        step = pos[:, 1:] != pos[:, :-1] + 1
        brk = brk | ((seg[:, 1:] >= 0) & step if real_only else step)
    cuts = [0] + (brk.any(0).nonzero().flatten() + 1).tolist() + [S]
    return list(zip(cuts[:-1], cuts[1:]))


def _merge_pieces(pieces: list[Piece]) -> list[Piece]:
    """Join full pieces that share one side and touch on the other (fewer, larger kernel calls)."""
    for a, b in itertools.permutations(pieces, 2):
        if a[4] or b[4]:
            continue
        if a[2:4] == b[2:4] and a[1] == b[0]:  # the same keys, the queries continue
            new = (a[0], b[1], a[2], a[3], False)
        elif a[:2] == b[:2] and a[3] == b[2]:  # the same queries, the keys continue
            new = (a[0], a[1], a[2], b[3], False)
        else:
            continue
        return _merge_pieces([p for p in pieces if p != a and p != b] + [new])
    return sorted(pieces)


def dense_pieces(
    queries: Side, keys: Side, causal: bool, max_pieces: int = 4
) -> list[Piece] | None:
    """The block's visible pairs as at most `max_pieces` rectangles a dense kernel computes exactly,
    or None when the block needs the element mask. Host tensors (B, S); reads their values.

    (q0, q1, k0, k1, False): every pair of the rectangle visible in every row; (..., True): the
    aligned causal triangle (key j visible to query i iff j <= i, a dense kernel's is_causal). Every
    visible pair lies in one piece, every query row of a piece sees a key there; [] means nothing is
    visible. Both sides are cut into `runs`, run pairs classified with the tile bounds, and
    pieces sharing a side joined (a visiting zigzag block: one rectangle)."""
    q_pos, q_seg, k_pos, k_seg = (*_tensors(queries), *_tensors(keys))
    Sq, Sk = q_pos.shape[1], k_pos.shape[1]
    if Sq == 0 or Sk == 0:
        return []
    one_seg = bool((q_seg >= 0).all()) and bool((q_seg == q_seg[:, :1]).all())
    if (
        causal
        and Sq == Sk
        and one_seg
        and torch.equal(q_pos, k_pos)
        and torch.equal(q_seg, k_seg)
        and bool((q_pos[:, 1:] > q_pos[:, :-1]).all())
    ):
        return [(0, Sq, 0, Sk, True)]
    qr, kr = runs(q_pos, q_seg, causal), runs(k_pos, k_seg, causal)
    if len(qr) * len(kr) > 4 * max_pieces**2:
        return None
    qs = tile_stats(q_pos, q_seg, [a for a, _ in qr] + [Sq])
    ks = tile_stats(k_pos, k_seg, [a for a, _ in kr] + [Sk])
    cls = classify_tiles(qs, ks, causal)
    lo, hi = cls.amin(0).tolist(), cls.amax(0).tolist()
    pieces: list[Piece] = []
    for i, (qa, qb) in enumerate(qr):
        for j, (ka, kb) in enumerate(kr):
            if hi[i][j] == SKIP:
                continue
            if lo[i][j] == FULL:
                pieces.append((qa, qb, ka, kb, False))
            elif (
                causal
                and qb - qa == kb - ka
                and bool((q_pos[:, qa] == k_pos[:, ka]).all())
                and bool((q_seg[:, qa] == k_seg[:, ka]).all())
                and bool((q_seg[:, qa] >= 0).all())
            ):
                pieces.append(
                    (qa, qb, ka, kb, True)
                )  # one real run on both sides, the same positions
            else:
                return None
    pieces = _merge_pieces(pieces)
    return pieces if len(pieces) <= max_pieces else None


_SHIFT = 2**32  # composite keys seg * 2**32 + (pos + 2**31): ordered by segment, then position
_OFF = 2**31
_TOP = 2**32 - 1  # the offset of the largest position: (seg, TOP) is above every (seg, pos)
_I64_MAX = torch.iinfo(torch.int64).max

ROW_FIELDS = (
    "full_lo",
    "full_hi",
    "pure_lo",
    "pure_hi",
    "mixed_lo",
    "mixed_hi",
    "seg_lo",
    "seg_hi",
    "pos_hi",
)
COL_FIELDS = ("tile", "seg_min", "seg_max", "pos_min")


def _key(seg: Tensor, pos: Tensor) -> Tensor:
    return seg * _SHIFT + (pos + _OFF)


def transposed(stats: TileStats) -> TileStats:
    """The stats with positions negated (min and max swapped): 'k_pos <= q_pos' read from the key side
    is '-q_pos <= -k_pos', so `visit_ranges(transposed(k), transposed(q), causal)` lists per key tile
    the query tiles to visit."""
    return TileStats(-stats.pos_max, -stats.pos_min, stats.seg_min, stats.seg_max, stats.complete)


def visit_ranges(rows: TileStats, cols: TileStats, causal: bool) -> tuple[Tensor, Tensor]:
    """Per row tile, the column tiles to visit, as index ranges into one sorted column order: the
    classes of `classify_tiles(rows, cols, causal)` without its (rows x cols) table, no host sync
    (docs/kernels.md, "The tile plan"). Positions and segment ids must fit in int32, |pos| < 2**31 - 1.

    Returns int64 `ranges` (B, n_rows, 9) of ROW_FIELDS and `order` (B, 2 * n_cols, 4) of
    COL_FIELDS: the pure column tiles, then from index n_cols the mixed ones. A candidate of the
    pure and mixed ranges is visited iff seg_min <= seg_hi, seg_max >= seg_lo and (causal)
    pos_min <= pos_hi (the SKIP test of `classify_tiles`).
    """
    B, n_c = cols.pos_min.shape
    c_real = cols.seg_min <= cols.seg_max  # empty tiles have min = +BIG > max = -BIG
    c_pure = cols.complete & (cols.seg_min == cols.seg_max)
    c_mixed = c_real & ~c_pure
    cs_min, cs_max = cols.seg_min.where(c_real, 0), cols.seg_max.where(c_real, 0)
    cp_min, cp_max = cols.pos_min.where(c_real, 0), cols.pos_max.where(c_real, 0)

    key_p = _key(cs_min, cp_max).masked_fill(~c_pure, _I64_MAX)
    sorted_p, order_p = torch.sort(key_p, dim=-1, stable=True)
    n_pure = c_pure.sum(-1, keepdim=True)
    suf_min = _key(cs_min, cp_min).masked_fill(~c_pure, _I64_MAX).gather(-1, order_p)
    suf_min = suf_min.flip(-1).cummin(-1).values.flip(-1).contiguous()

    key_m = _key(cs_min, cp_min).masked_fill(~c_mixed, _I64_MAX)
    sorted_m, order_m = torch.sort(key_m, dim=-1, stable=True)
    n_mixed = c_mixed.sum(-1, keepdim=True)
    pre_max = cs_max.gather(-1, order_m).cummax(-1).values.contiguous()

    r_real = rows.seg_min <= rows.seg_max
    r_pure = rows.complete & (rows.seg_min == rows.seg_max)
    a, b = rows.seg_min.where(r_real, 0), rows.seg_max.where(r_real, 0)
    p_min, p_max = rows.pos_min.where(r_real, 0), rows.pos_max.where(r_real, 0)

    def find(seq: Tensor, values: Tensor, right: bool) -> Tensor:
        return torch.searchsorted(seq, values.contiguous(), right=right)

    start = find(sorted_p, a * _SHIFT, False)
    if causal:
        full_hi = find(sorted_p, _key(a, p_min), True)
        pure_end = find(suf_min, _key(b, p_max), True)
        mixed_end = find(sorted_m, _key(b, p_max), True)
    else:
        full_hi = find(sorted_p, a * _SHIFT + _TOP, True)
        pure_end = find(sorted_p, b * _SHIFT + _TOP, True)
        mixed_end = find(sorted_m, b * _SHIFT + _TOP, True)
    full_lo = torch.minimum(start, n_pure)
    full_hi = torch.minimum(full_hi, n_pure).where(r_pure, full_lo)
    pure_lo = full_hi.where(r_pure, full_lo)
    pure_hi = torch.maximum(torch.minimum(pure_end, n_pure), pure_lo)
    mixed_lo = torch.minimum(find(pre_max, a, False), n_mixed)
    mixed_hi = torch.maximum(torch.minimum(mixed_end, n_mixed), mixed_lo)
    ranges = torch.stack(
        [full_lo, full_hi, pure_lo, pure_hi, mixed_lo + n_c, mixed_hi + n_c, a, b, p_max], -1
    )
    ranges = ranges.masked_fill(~r_real[..., None], 0)  # an empty row visits nothing

    order = torch.cat([order_p, order_m], -1)  # (B, 2 n_c)
    bounds = [x.gather(-1, order) for x in (cs_min, cs_max, cp_min)]
    return ranges, torch.stack([order, *bounds], -1)


def lse_merge_(out: Tensor, lse: Tensor, blk_out: Tensor, blk_lse: Tensor) -> None:
    """Merge a partial attention result into a running one, in place, without overflow
    (docs/ring_attention.md, "Forward"): out, blk_out (B, S, H, D); lse, blk_lse (B, H, S); out/lse
    the fp32 or fp64 accumulators. Rows empty on both sides stay out = 0, lse = -inf."""
    blk_lse = blk_lse.to(lse.dtype)
    new = torch.logaddexp(lse, blk_lse)  # (B, H, S)
    empty = torch.isneginf(new)
    safe = new.masked_fill(empty, 0.0)
    w_old = (
        torch.exp(lse - safe).masked_fill_(empty, 0.0).transpose(1, 2).unsqueeze(-1)
    )  # (B, S, H, 1)
    w_blk = torch.exp(blk_lse - safe).masked_fill_(empty, 0.0).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).addcmul_(blk_out.to(out.dtype), w_blk)
    lse.copy_(new)


def merge_partials(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Exact attention over the union of disjoint key sets from the partials of each set: outs
    (B, S, H, D), lses (B, H, S), -inf where a set had no visible key. Returns (out, lse) in the
    accumulation dtype, merged in the order given (equal inputs give bitwise equal results)."""
    acc = accum_dtype(lses[0].dtype)
    out = outs[0].to(acc).clone()
    lse = lses[0].to(acc).clone()
    for o, l in zip(outs[1:], lses[1:]):
        lse_merge_(out, lse, o, l)
    return out, lse


def merge_stacked(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """`merge_partials` of partials stacked along dim 0, in one pass: outs (N, ..., S, D) with lses
    (N, ..., S) (any layout where lse indexes out without its last dim). Empty rows stay 0 / -inf."""
    acc = accum_dtype(lses.dtype)
    lses = lses.to(acc)
    top = lses.amax(0)
    empty = torch.isneginf(top)
    top = top.masked_fill(empty, 0.0)
    w = torch.exp(lses - top)  # (N, ...): 0 where a partial is empty
    total = w.sum(0)
    out = (w.unsqueeze(-1) * outs.to(acc)).sum(0) / total.masked_fill(empty, 1.0).unsqueeze(-1)
    lse = (top + torch.log(total.masked_fill(empty, 1.0))).masked_fill(empty, float("-inf"))
    return out, lse
