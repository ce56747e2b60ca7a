"""Ring attention (Liu et al., 2024): exact attention over a sequence sharded across a process group
(docs/ring_attention.md: the forward, the backward's travelling dK/dV sums, block skipping).
`RingPlans` keeps one tile plan per step for the forward, its backward and, through the seam,
every layer of a model step.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch
from torch import Tensor

from longvideo.kernels import SKIP, RingPlans, accum_dtype, block_class, get_backend, lse_merge_
from longvideo.parallel.comm import CommStats, DoubleBuffer, RingComm
from longvideo.parallel.zigzag import layout_positions


def block_is_empty(
    q_pos: Tensor, q_seg: Tensor, k_pos: Tensor, k_seg: Tensor, causal: bool
) -> bool:
    """True when no key of the block can be visible to any query: its tile class (kernels.block_class,
    the bounds every backend uses) is SKIP in every batch row. Never True when some pair is visible."""
    return bool((block_class(q_pos, k_pos, q_seg, k_seg, causal) == SKIP).all())


def _timed(stats: Optional[CommStats], fn, *args):
    t0 = time.perf_counter()
    result = fn(*args)
    if stats is not None:
        stats.compute_s += time.perf_counter() - t0
        stats.blocks += 1
    return result


def _counted(be, pos, seg, kp, ks, causal, stats: Optional[CommStats]) -> bool:
    """Whether the step computes its block (counted in `stats` as computed or skipped): not when a
    host-planning backend finds it provably empty; always for a sync-free one (no host sync)."""
    skip = not getattr(be, "sync_free", False) and block_is_empty(pos, seg, kp, ks, causal)
    if stats is not None:
        stats.skipped += skip
        stats.blocks += not skip
    return not skip


def forward_step(
    be,
    q,
    kk,
    vv,
    pos,
    kp,
    seg,
    ks,
    causal,
    scale,
    plan,
    out,
    lse,
    stats: Optional[CommStats] = None,
):
    """One ring step of the forward: attention of the local queries to one key block, merged into
    (out, lse) in place (unless skipped)."""
    if _counted(be, pos, seg, kp, ks, causal, stats):
        o, l = be.forward(
            q, kk, vv, pos, kp, seg, ks, scale, causal, plan=plan
        )  # (B, S, Hq, D), (B, Hq, S)
        lse_merge_(out, lse, o, l)


def backward_step(
    be,
    dout,
    q,
    kk,
    vv,
    out,
    lse,
    pos,
    kp,
    seg,
    ks,
    causal,
    scale,
    plan,
    stats: Optional[CommStats] = None,
):
    """One ring step of the backward: (dq, dk, dv) shares of one key block, or None when skipped."""
    if _counted(be, pos, seg, kp, ks, causal, stats):
        return be.backward(dout, q, kk, vv, out, lse, pos, kp, seg, ks, scale, causal, plan=plan)
    return None


def ring_forward(
    q,
    k,
    v,
    pos,
    seg,
    group,
    causal,
    scale,
    backend,
    stats: Optional[CommStats] = None,
    plans: Optional[RingPlans] = None,
):
    """(out in q.dtype, lse (B, Hq, S) in fp32/fp64) of attention over the whole ring.
    plans: tile plans per step (RingPlans), filled on first use; None makes a new one."""
    be = get_backend(backend)
    plans = plans if plans is not None else RingPlans()
    ring = RingComm(group)
    if ring.size == 1:  # plain attention: no buffers, no merge
        return _timed(stats, be.forward, q, k, v, pos, pos, seg, seg, scale, causal, plans.step(0))
    B, S, Hq, D = q.shape
    acc = accum_dtype(q.dtype)
    out = torch.zeros(B, S, Hq, D, dtype=acc, device=q.device)
    lse = torch.full((B, Hq, S), float("-inf"), dtype=acc, device=q.device)
    # (2, B, S, Hkv, D) and (2, B, S): one message each per hop; fresh tensors the buffer may own
    kv = DoubleBuffer([torch.stack([k, v]), torch.stack([pos, seg]).long()])
    for step in range(ring.size):
        pending = ring.exchange(kv.current, kv.incoming, stats) if step < ring.size - 1 else None
        (kk, vv), (kp, ks) = kv.current
        t0 = time.perf_counter()
        forward_step(
            be, q, kk, vv, pos, kp, seg, ks, causal, scale, plans.step(step), out, lse, stats
        )
        if stats is not None:
            stats.compute_s += time.perf_counter() - t0
        if pending is not None:
            pending.wait()
            kv.swap()
    return out.to(q.dtype), lse


def ring_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    pos,
    seg,
    group,
    causal,
    scale,
    backend,
    stats: Optional[CommStats] = None,
    plans: Optional[RingPlans] = None,
):
    """(dq, dk, dv) in the accumulation dtype (fp32, or fp64 for fp64 inputs) for this rank's shard.
    plans: the forward's RingPlans (step i sees the same key block in both directions)."""
    be = get_backend(backend)
    plans = plans if plans is not None else RingPlans()
    ring = RingComm(group)
    if ring.size == 1:
        return _timed(
            stats,
            be.backward,
            dout,
            q,
            k,
            v,
            out,
            lse,
            pos,
            pos,
            seg,
            seg,
            scale,
            causal,
            plans.step(0),
        )
    acc = accum_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = DoubleBuffer([torch.stack([k, v]), torch.stack([pos, seg]).long()])
    # the travelling partial sums of dK and dV for the block currently held
    dkv = DoubleBuffer([torch.zeros((2,) + tuple(k.shape), dtype=acc, device=k.device)])
    dkv_pending = None
    for step in range(ring.size):
        kv_pending = ring.exchange(kv.current, kv.incoming, stats) if step < ring.size - 1 else None
        (kk, vv), (kp, ks) = kv.current
        t0 = time.perf_counter()
        grads = backward_step(
            be, dout, q, kk, vv, out, lse, pos, kp, seg, ks, causal, scale, plans.step(step), stats
        )
        if grads is not None:
            dq += grads[0]
        if stats is not None:
            stats.compute_s += time.perf_counter() - t0
        if dkv_pending is not None:  # the partial sum for the block we now hold has arrived
            dkv_pending.wait()
            dkv.swap()
        if grads is not None:
            dkv.current[0][0] += grads[1]
            dkv.current[0][1] += grads[2]
        dkv_pending = ring.exchange(
            dkv.current, dkv.incoming, stats, tag=2
        )  # the W-th hop brings it home
        if kv_pending is not None:
            kv_pending.wait()
            kv.swap()
    dkv_pending.wait()
    dkv.swap()
    dk, dv = dkv.current[0]
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pos, seg, group, causal, scale, backend, stats, plans):
        plans = plans if plans is not None else RingPlans()  # this call's, kept for its backward
        out, lse = ring_forward(q, k, v, pos, seg, group, causal, scale, backend, stats, plans)
        ctx.save_for_backward(q, k, v, out, lse, pos, seg)
        ctx.args = (group, causal, scale, backend, stats, plans)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, pos, seg = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, pos, seg, *ctx.args)
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
            None,
        )


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group,
    causal: bool = True,
    positions: Optional[Tensor] = None,
    segment_ids: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    backend: str = "auto",
    comm_stats: Optional[CommStats] = None,
    plans: Optional[RingPlans] = None,
) -> Tensor:
    """Exact masked attention of a sequence sharded over `group` (collective: every rank calls it);
    the arguments as in docs/ring_attention.md. q (B, S, Hq, D); k, v (B, S, Hkv, D), S the same on
    every rank. plans: a RingPlans kept across calls with the same metadata (else one per call and
    its backward). Returns out (B, S, Hq, D) in q.dtype; differentiable in q, k, v."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be (B, S, H, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, S, Hq, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[1] != S or k.shape[3] != D:
        raise ValueError(
            f"k and v must be (B, S, Hkv, D) = ({B}, {S}, Hkv, {D}) like q's local shard; "
            f"got {tuple(k.shape)}, {tuple(v.shape)} (ring attention needs Sq == Sk)"
        )
    if Hq % k.shape[2]:
        raise ValueError(f"query heads {Hq} must be a multiple of key/value heads {k.shape[2]}")
    if positions is None:
        positions = layout_positions(S, group, device=q.device).expand(B, S)
    if segment_ids is None:
        segment_ids = torch.zeros(B, S, dtype=torch.long, device=q.device)
    for name, t in (("positions", positions), ("segment_ids", segment_ids)):
        if tuple(t.shape) != (B, S):
            raise ValueError(f"{name} must be (B, S) = ({B}, {S}); got {tuple(t.shape)}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    return _RingAttention.apply(
        q,
        k,
        v,
        positions.long(),
        segment_ids.long(),
        group,
        causal,
        scale,
        backend,
        comm_stats,
        plans,
    )
