"""The math every attention implementation shares: the mask rule, its tile bounds, the merge.

Mask rule (the one rule of the project): key j is visible to query i iff

    q_seg[i] == k_seg[j]  and  k_seg[j] >= 0  and  (not causal or k_pos[j] <= q_pos[i]).

Segment id -1 marks padding: such a token sees nothing and is seen by nothing. A query row with
no visible key has out = 0 and lse = -inf.

Everything that restates the rule in another form lives here too, so that the backends, the ring
and sequence-parallel inference cannot disagree:

* `visibility`: the rule as a boolean (B, Sq, Sk) mask (references and small masked tiles only);
* `tile_stats` / `classify_tiles`: the rule as bounds. From per-tile min/max of positions and
  segment ids over real tokens, a (query tile, key tile) pair is SKIP (provably nothing visible),
  FULL (provably everything visible and every slot real) or PARTIAL (needs the mask). The
  backends skip and fast-path tiles with it, the ring skips whole blocks with it;
* `lse_merge_` / `merge_partials`: combining attention over disjoint key sets exactly from their
  (out, lse) pairs (online softmax across blocks, ring steps or ranks);
* `accum_dtype`: merges, partial sums and gradients accumulate in fp32 (fp64 for fp64 inputs);
* `fill_meta`: default positions (0..S-1) and segment ids (one segment).

Nothing here synchronises with the device: tile statistics are reductions, classes are tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

SKIP, PARTIAL, FULL = 0, 1, 2
"""Tile classes returned by `classify_tiles` (int8)."""

_BIG = 2 ** 62  # beyond any position or segment id: the min of an empty tile, minus the max


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype merges and gradient sums accumulate in: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_meta(batch: int, length: int, device) -> tuple[Tensor, Tensor]:
    """Positions 0..length-1 and one segment (id 0), each (batch, length) int64."""
    pos = torch.arange(length, device=device).unsqueeze(0).expand(batch, length)
    seg = torch.zeros(batch, length, dtype=torch.long, device=device)
    return pos, seg


def fill_meta(q: Tensor, k: Tensor, q_pos: Optional[Tensor], k_pos: Optional[Tensor], q_seg: Optional[Tensor],
              k_seg: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q_pos, k_pos, q_seg, k_seg) with the defaults of `default_meta` where None was given.
    q (B, Sq, ...), k (B, Sk, ...)."""
    if q_pos is None or q_seg is None:
        dp, ds = default_meta(q.shape[0], q.shape[1], q.device)
        q_pos = dp if q_pos is None else q_pos
        q_seg = ds if q_seg is None else q_seg
    if k_pos is None or k_seg is None:
        dp, ds = default_meta(k.shape[0], k.shape[1], k.device)
        k_pos = dp if k_pos is None else k_pos
        k_seg = ds if k_seg is None else k_seg
    return q_pos, k_pos, q_seg, k_seg


def visibility(q_pos: Tensor, k_pos: Tensor, q_seg: Tensor, k_seg: Tensor, causal: bool) -> Tensor:
    """Boolean mask (B, Sq, Sk): True where the key is visible to the query."""
    vis = (q_seg[:, :, None] == k_seg[:, None, :]) & (k_seg[:, None, :] >= 0)
    if causal:
        vis = vis & (k_pos[:, None, :] <= q_pos[:, :, None])
    return vis


# ----------------------------------------------------------------------------- the rule as bounds


@dataclass(frozen=True)
class TileStats:
    """Per tile, per batch row, statistics of the real (segment >= 0) tokens; each (B, n) int64.

    An empty tile (padding only, or past the end) has min = +BIG and max = -BIG, so that it
    overlaps nothing. `complete` is True when every slot of the tile is in range and real.
    """

    pos_min: Tensor
    pos_max: Tensor
    seg_min: Tensor
    seg_max: Tensor
    complete: Tensor

    @property
    def num_tiles(self) -> int:
        return self.pos_min.shape[1]


def tile_stats(pos: Tensor, seg: Tensor, tile: int | Sequence[int]) -> TileStats:
    """Statistics of (B, S) positions / segment ids cut into tiles.

    tile: an int T (tiles [0, T), [T, 2T), ...; the last one may run past S) or the boundaries
    [0, b1, ..., S] of tiles of any sizes.
    """
    B, S = pos.shape
    pos, seg = pos.long(), seg.long()
    real = seg >= 0
    lo_pos = pos.masked_fill(~real, _BIG)
    hi_pos = pos.masked_fill(~real, -_BIG)
    lo_seg = seg.masked_fill(~real, _BIG)
    hi_seg = seg.masked_fill(~real, -_BIG)
    if isinstance(tile, int):
        n = -(-S // tile)
        pad = n * tile - S
        if pad:  # slots past the end are empty

            def padded(x, fill):
                return torch.cat([x, x.new_full((B, pad), fill)], 1)

            lo_pos, hi_pos = padded(lo_pos, _BIG), padded(hi_pos, -_BIG)
            lo_seg, hi_seg = padded(lo_seg, _BIG), padded(hi_seg, -_BIG)
            real = torch.cat([real, real.new_zeros(B, pad)], 1)
        shape = (B, n, tile)
        return TileStats(lo_pos.view(shape).amin(-1), hi_pos.view(shape).amax(-1), lo_seg.view(shape).amin(-1),
                         hi_seg.view(shape).amax(-1), real.view(shape).all(-1))
    bounds = list(tile)
    starts = torch.tensor(bounds[:-1], device=pos.device)

    def reduce(x: Tensor, op: str) -> Tensor:  # amin / amax over each tile's range
        return _segment(x, starts, S, op)

    return TileStats(reduce(lo_pos, "amin"), reduce(hi_pos, "amax"), reduce(lo_seg, "amin"), reduce(hi_seg, "amax"),
                     _segment(real.long(), starts, S, "amin").bool())


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
    """(B, n_q, n_k) int8 classes SKIP / PARTIAL / FULL of every (query tile, key tile) pair.

    SKIP: segment ranges disjoint (an empty tile overlaps nothing) or, causal, every key after
    every query. FULL: both tiles complete, one segment on both sides, and (causal) every key at
    or before every query. PARTIAL: anything else.
    """
    Q = lambda x: x[:, :, None]  # noqa: E731 - (B, n_q, 1)
    K = lambda x: x[:, None, :]  # noqa: E731 - (B, 1, n_k)
    visit = (Q(q.seg_min) <= K(k.seg_max)) & (K(k.seg_min) <= Q(q.seg_max))
    full = visit & Q(q.complete) & K(k.complete) & Q(q.seg_min == q.seg_max) & K(k.seg_min == k.seg_max) \
        & (Q(q.seg_min) == K(k.seg_min))
    if causal:
        visit = visit & (K(k.pos_min) <= Q(q.pos_max))
        full = full & (K(k.pos_max) <= Q(q.pos_min))
    return visit.to(torch.int8) + full.to(torch.int8)


def block_class(q_pos: Tensor, k_pos: Tensor, q_seg: Tensor, k_seg: Tensor, causal: bool) -> Tensor:
    """(B,) int8 class of a whole query block against a whole key block (one tile each)."""
    q = tile_stats(q_pos, q_seg, max(1, q_pos.shape[1]))
    k = tile_stats(k_pos, k_seg, max(1, k_pos.shape[1]))
    return classify_tiles(q, k, causal)[:, 0, 0]


# ----------------------------------------------------------------------------- merging partial results


def lse_merge_(out: Tensor, lse: Tensor, blk_out: Tensor, blk_lse: Tensor) -> None:
    """Merge a partial attention result into a running one, in place, without overflow.

    out, blk_out (B, S, H, D); lse, blk_lse (B, H, S). out/lse are the accumulators (fp32 or fp64);
    blk_out may be in any dtype. lse_new = logaddexp(lse, blk_lse) and
    out_new = exp(lse - lse_new) * out + exp(blk_lse - lse_new) * blk_out; both weights are <= 1,
    so nothing overflows, and rows where both sides are empty (-inf) stay out = 0, lse = -inf.
    """
    blk_lse = blk_lse.to(lse.dtype)
    new = torch.logaddexp(lse, blk_lse)  # (B, H, S)
    empty = torch.isneginf(new)
    safe = new.masked_fill(empty, 0.0)
    w_old = torch.exp(lse - safe).masked_fill_(empty, 0.0).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    w_blk = torch.exp(blk_lse - safe).masked_fill_(empty, 0.0).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).addcmul_(blk_out.to(out.dtype), w_blk)
    lse.copy_(new)


def merge_partials(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Exact attention over the union of disjoint key sets from the partials of each set.

    outs: tensors (B, S, H, D); lses: tensors (B, H, S), -inf where a set had no visible key.
    Returns (out, lse) in the accumulation dtype; rows with no visible key anywhere are 0 / -inf.
    The partials are merged in the order given, so equal inputs give bitwise equal results.
    """
    acc = accum_dtype(lses[0].dtype)
    out = outs[0].to(acc).clone()
    lse = lses[0].to(acc).clone()
    for o, l in zip(outs[1:], lses[1:]):
        lse_merge_(out, lse, o, l)
    return out, lse
