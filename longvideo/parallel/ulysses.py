"""Hybrid sequence parallelism: head-parallel all-to-all (DeepSpeed-Ulysses) inside groups of U
neighbouring ranks, ring attention across the sp / U groups (docs/hybrid.md: why the ordinary
zigzag shards work, the head split and padding, why not DeepSpeed's layer).
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from longvideo.kernels import RingPlans
from longvideo.parallel.comm import CommStats
from longvideo.parallel.mesh import UlyssesGroups
from longvideo.parallel.ring import ring_backward, ring_forward


def head_split(hq: int, hkv: int, ulysses: int, sp: Optional[int] = None) -> tuple[int, Tensor]:
    """(query heads per member Qu, the key/value head index (U * Hkv',) each member's slot reads).
    Query heads are padded to U * Qu; member u's query heads u * Qu .. read its key/value slots
    u * Hkv' .. in groups of Qu / Hkv'. Raises ValueError when U > Hq (a member without a head)."""
    if ulysses > hq:
        fits = [u for u in range(1, (sp or ulysses) + 1) if (sp or ulysses) % u == 0 and u <= hq]
        raise ValueError(
            f"ulysses={ulysses} exceeds the model's {hq} query heads ({hkv} key/value heads); "
            f"use ulysses in {fits}" + (f" (dividing sp={sp})" if sp else "")
        )
    qu = -(-hq // ulysses)
    group = hq // hkv
    d = math.gcd(qu, group)
    idx = [min((u * qu + j * d) // group, hkv - 1) for u in range(ulysses) for j in range(qu // d)]
    return qu, torch.tensor(idx)


def _a2a(x: Tensor, group, to_heads: bool, stats: Optional[CommStats]) -> Tensor:
    """(..., S, U*h, D) -> (..., U*S, h, D) when to_heads (the group's tokens, in member order, for
    this member's h heads), else the inverse."""
    U = dist.get_world_size(group)
    *lead, S, H, D = x.shape
    L = math.prod(lead)
    if to_heads:
        send = x.reshape(L, S, U, H // U, D).permute(
            2, 0, 1, 3, 4
        )  # (U, L, S, h, D): piece j to member j
    else:
        send = x.reshape(L, U, S // U, H, D).permute(
            1, 0, 2, 3, 4
        )  # (U, L, S/U, H, D): tokens of member j
    send = send.contiguous()
    recv = torch.empty_like(send)
    t0 = time.perf_counter()
    dist.all_to_all_single(recv, send, group=group)
    if stats is not None:
        stats.exposed_s += time.perf_counter() - t0
        stats.bytes_sent += send.numel() * send.element_size() * (U - 1) // U
    if to_heads:  # recv[i]: member i's tokens, my heads
        return recv.permute(1, 0, 2, 3, 4).reshape(*lead, U * S, H // U, D)
    return recv.permute(1, 2, 0, 3, 4).reshape(
        *lead, S // U, U * H, D
    )  # recv[i]: my tokens, member i's heads


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, to_heads, stats):
        ctx.group, ctx.to_heads, ctx.stats = group, to_heads, stats
        return _a2a(x, group, to_heads, stats)

    @staticmethod
    def backward(ctx, grad):
        return _a2a(grad.contiguous(), ctx.group, not ctx.to_heads, ctx.stats), None, None, None


class _HeadsRing(torch.autograd.Function):
    """Ring attention over the head-split tensors, returning the output in the sequence layout. It
    saves that output (which the output projection keeps anyway), not the ring's head-layout copy,
    and re-forms the latter in the backward with one more all-to-all (scripts/bench_hybrid.py)."""

    @staticmethod
    def forward(ctx, q, k, v, pos, seg, groups, causal, backend, stats, plans):
        plans = plans if plans is not None else RingPlans()
        scale = 1.0 / math.sqrt(q.shape[-1])
        out, lse = ring_forward(
            q, k, v, pos, seg, groups.ring, causal, scale, backend, stats, plans
        )
        out = _a2a(out, groups.group, False, stats)
        ctx.save_for_backward(q, k, v, out, lse, pos, seg)
        ctx.args = (groups, causal, scale, backend, stats, plans)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, pos, seg = ctx.saved_tensors
        groups, causal, scale, backend, stats, plans = ctx.args
        dout, out = (_a2a(x.contiguous(), groups.group, True, stats) for x in (dout, out))
        dq, dk, dv = ring_backward(
            dout, q, k, v, out, lse, pos, seg, groups.ring, causal, scale, backend, stats, plans
        )
        return (
            dq.to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def gather_metadata(
    positions: Tensor, segment_ids: Tensor, group, stats: Optional[CommStats] = None
) -> tuple[Tensor, Tensor]:
    """The Ulysses group's positions and segment ids (B, U * S), in member order (collective)."""
    meta = torch.stack([positions, segment_ids]).long().contiguous()
    parts = [torch.empty_like(meta) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, meta, group=group)
    if stats is not None:  # what a ring all-gather sends: U - 1 pieces
        stats.bytes_sent += meta.numel() * meta.element_size() * (len(parts) - 1)
    pos, seg = torch.cat(parts, dim=-1)
    return pos, seg


def hybrid_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    groups: UlyssesGroups,
    positions: Tensor,
    segment_ids: Tensor,
    causal: bool = True,
    backend: str = "auto",
    comm_stats: Optional[CommStats] = None,
    plans: Optional[RingPlans] = None,
    group_meta: Optional[tuple[Tensor, Tensor]] = None,
) -> Tensor:
    """Exact attention of a sequence sharded over a Ulysses x ring split (collective over the sp group).
    q (B, S, Hq, D); k, v (B, S, Hkv, D); positions, segment_ids (B, S): this rank's shard, as for
    ring_attention. group_meta: gather_metadata's result when the caller keeps it across layers.
    plans: RingPlans for the ring over the group's metadata. Returns out (B, S, Hq, D) in q.dtype."""
    Hq, U = q.shape[2], groups.size
    qu, idx = head_split(Hq, k.shape[2], U, U * dist.get_world_size(groups.ring))
    same = torch.equal(idx, torch.arange(k.shape[2]))

    def to_heads(
        x: Tensor,
    ) -> Tensor:  # (B, S, U * h, D) -> (B, U * S, h, D); with B = 1 the result is
        return _AllToAll.apply(
            x, groups.group, True, comm_stats
        )  # the receive buffer itself, no copy

    qh = to_heads(F.pad(q, (0, 0, 0, U * qu - Hq)) if U * qu != Hq else q)  # (B, U*S, Qu, D)
    kh, vh = (
        to_heads(x if same else x.index_select(2, idx.to(x.device))) for x in (k, v)
    )  # (B, U*S, Hkv', D)
    pos, seg = (
        group_meta
        if group_meta is not None
        else gather_metadata(positions, segment_ids, groups.group, comm_stats)
    )
    return _HeadsRing.apply(qh, kh, vh, pos, seg, groups, causal, backend, comm_stats, plans)[
        :, :, :Hq
    ]
