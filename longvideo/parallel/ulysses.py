"""Hybrid sequence parallelism: head-parallel all-to-all (DeepSpeed-Ulysses) inside groups of U
neighbouring ranks, ring attention across the sp / U groups (docs/hybrid.md: why the ordinary
zigzag shards work, the head split and padding, why not DeepSpeed's layer).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from longvideo.kernels import AttentionMeta
from longvideo.parallel.comm import CommStats
from longvideo.parallel.mesh import UlyssesGroups
from longvideo.parallel.ring import Ring, check_shard, layout_meta


def head_split(hq: int, hkv: int, ulysses: int, sp: int | None = None) -> tuple[int, Tensor]:
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


def _a2a(x: Tensor, group, to_heads: bool, stats: CommStats | None) -> Tensor:
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
    and re-forms the latter in the backward with one more all-to-all (scripts/bench_hybrid.py).
    meta: the Ulysses group's metadata; ring: the ring across the groups; heads: the group."""

    @staticmethod
    def forward(ctx, q, k, v, meta: AttentionMeta, ring: Ring, heads):
        out, lse = ring.forward(q, k, v, meta)
        out = _a2a(out, heads, False, ring.stats)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta, ctx.ring, ctx.heads = meta, ring, heads
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, heads = ctx.ring, ctx.heads
        dout, out = (_a2a(x.contiguous(), heads, True, ring.stats) for x in (dout, out))
        dq, dk, dv = ring.backward(dout, q, k, v, out, lse, ctx.meta)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def group_meta(
    meta: AttentionMeta, group: UlyssesGroups, stats: CommStats | None = None
) -> AttentionMeta:
    """The Ulysses group's metadata: every member's positions and segment ids (B, U * S) in member
    order, queries and keys alike, with this shard's causal and scale. Gathered once per metadata
    object (collective on first use) and kept in its plan store, so every layer of a step and the
    backward share it and its ring plans."""

    def gather() -> AttentionMeta:
        stacked = meta.queries.stacked().contiguous()
        parts = [torch.empty_like(stacked) for _ in range(group.size)]
        dist.all_gather(parts, stacked, group=group.group)
        if stats is not None:  # what a ring all-gather sends: U - 1 pieces
            stats.bytes_sent += stacked.numel() * stacked.element_size() * (len(parts) - 1)
        positions, segment_ids = torch.cat(parts, dim=-1)
        return AttentionMeta.self_attention(
            positions, segment_ids, causal=meta.causal, scale=meta.scale
        )

    return meta.plans.get(("ulysses", id(group.group)), gather)


def _layout_meta(q: Tensor, group: UlyssesGroups) -> AttentionMeta:
    """The default metadata of this rank's zigzag shard over the whole sp group: its rank there is
    ring position x U + member (longvideo.parallel.split_group)."""
    rings = dist.get_world_size(group.ring)
    sp_rank = dist.get_rank(group.ring) * group.size + dist.get_rank(group.group)
    return layout_meta(q, rings * group.size, sp_rank)


def hybrid_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    meta: AttentionMeta | None = None,
    *,
    group: UlyssesGroups,
    backend: str = "auto",
    comm_stats: CommStats | None = None,
) -> Tensor:
    """Exact attention of a sequence sharded over a Ulysses x ring split (collective over the sp
    group), with ring_attention's arguments: q (B, S, Hq, D); k, v (B, S, Hkv, D); meta this rank's
    shard (None: the zigzag layout's positions over the sp group, one segment, causal); group: the
    split (Mesh.ulysses_groups, split_group). Returns out (B, S, Hq, D) in q.dtype."""
    meta = meta if meta is not None else _layout_meta(q, group)
    check_shard(q, k, v, meta)
    Hq, U = q.shape[2], group.size
    qu, idx = head_split(Hq, k.shape[2], U, U * dist.get_world_size(group.ring))
    same = torch.equal(idx, torch.arange(k.shape[2]))

    def to_heads(x: Tensor) -> Tensor:
        """(B, S, U * h, D) -> (B, U * S, h, D); with B = 1 the receive buffer itself, no copy."""
        return _AllToAll.apply(x, group.group, True, comm_stats)

    qh = to_heads(F.pad(q, (0, 0, 0, U * qu - Hq)) if U * qu != Hq else q)  # (B, U*S, Qu, D)
    kh, vh = (
        to_heads(x if same else x.index_select(2, idx.to(x.device))) for x in (k, v)
    )  # (B, U*S, Hkv', D)
    ring = Ring(group.ring, backend, comm_stats)
    heads_meta = group_meta(meta, group, comm_stats)
    return _HeadsRing.apply(qh, kh, vh, heads_meta, ring, group.group)[:, :, :Hq]
