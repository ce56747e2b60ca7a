"""Ring attention (Liu et al., 2024): exact attention over a sequence sharded across a process group
(docs/ring_attention.md: the forward, the backward's travelling dK/dV sums, block skipping).
`Ring` is the block-backend interface over a whole ring; the key side of the metadata travels with
K and V, and each step sees `meta.visiting(keys, step)`: the local queries against the visiting
keys, with that step's plans kept in the metadata object for every layer and the backward.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from longvideo.kernels import (
    SKIP,
    AttentionMeta,
    Side,
    accum_dtype,
    block_class,
    get_backend,
    lse_merge_,
)
from longvideo.parallel.comm import CommStats, DoubleBuffer, RingComm
from longvideo.parallel.zigzag import shard_positions


def block_is_empty(meta: AttentionMeta) -> bool:
    """True when no key of the block can be visible to any query: its tile class (kernels.block_class,
    the bounds every backend uses) is SKIP in every batch row. Never True when some pair is visible."""
    return bool((block_class(meta.queries, meta.keys, meta.causal) == SKIP).all())


class Ring:
    """Attention over a whole ring with one block backend, in the block backend's own interface:
    `forward(q, k, v, meta) -> (out, lse)` and `backward(dout, q, k, v, out, lse, meta) -> (dq,
    dk, dv)` in the accumulation dtype. q, k, v and meta are this rank's shard (queries and keys
    the same tokens); stats: an optional CommStats the calls add to. Collective: every rank of
    `group` calls the same methods in the same order."""

    def __init__(self, group, backend: str = "auto", stats: CommStats | None = None):
        self.comm = RingComm(group)
        self.backend = get_backend(backend)
        self.stats = stats

    def _computes(self, meta: AttentionMeta) -> bool:
        """Whether a step computes its block (counted in stats as computed or skipped): not when a
        host-planning backend finds it provably empty; always for a sync-free one (no host sync)."""
        skip = not getattr(self.backend, "sync_free", False) and block_is_empty(meta)
        if self.stats is not None:
            self.stats.skipped += skip
            self.stats.blocks += not skip
        return not skip

    def _whole(self, compute, *args):
        """A ring of one: the backend on the shard itself, timed."""
        t0 = time.perf_counter()
        result = compute(*args)
        if self.stats is not None:
            self.stats.compute_s += time.perf_counter() - t0
            self.stats.blocks += 1
        return result

    def forward_step(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMeta, out, lse) -> None:
        """One step: the local queries against one key block (meta: the step's view), merged into
        the running (out, lse) in place unless skipped."""
        if self._computes(meta):
            block_out, block_lse = self.backend.forward(q, k, v, meta)  # (B, S, Hq, D), (B, Hq, S)
            lse_merge_(out, lse, block_out, block_lse)

    def backward_step(self, dout, q, k, v, out, lse, meta: AttentionMeta):
        """One step of the backward: (dq, dk, dv) shares of one key block, or None when skipped."""
        if self._computes(meta):
            return self.backend.backward(dout, q, k, v, out, lse, meta)
        return None

    def _blocks(self, k: Tensor, v: Tensor, keys: Side) -> DoubleBuffer:
        """The travelling block: (2, B, S, Hkv, D) keys and values and (2, B, S) key metadata, one
        message each per hop, in fresh tensors the buffer owns."""
        return DoubleBuffer([torch.stack([k, v]), keys.stacked()])

    def forward(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMeta):
        """(out in q.dtype, lse (B, Hq, S) in fp32/fp64) of attention over the whole ring."""
        if self.comm.size == 1:  # plain attention: no buffers, no merge
            return self._whole(self.backend.forward, q, k, v, meta)
        B, S, Hq, D = q.shape
        acc = accum_dtype(q.dtype)
        out = torch.zeros(B, S, Hq, D, dtype=acc, device=q.device)
        lse = torch.full((B, Hq, S), float("-inf"), dtype=acc, device=q.device)
        blocks = self._blocks(k, v, meta.keys)
        for step in range(self.comm.size):
            last = step == self.comm.size - 1
            pending = (
                None if last else self.comm.exchange(blocks.current, blocks.incoming, self.stats)
            )
            (block_k, block_v), (key_positions, key_segments) = blocks.current
            t0 = time.perf_counter()
            view = meta.visiting(Side(key_positions, key_segments), step)
            self.forward_step(q, block_k, block_v, view, out, lse)
            if self.stats is not None:
                self.stats.compute_s += time.perf_counter() - t0
            if pending is not None:
                pending.wait()
                blocks.swap()
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, meta: AttentionMeta):
        """(dq, dk, dv) in the accumulation dtype (fp32, or fp64 for fp64 inputs) for this rank's
        shard; meta: the forward's (step i sees the same key block in both directions)."""
        if self.comm.size == 1:
            return self._whole(self.backend.backward, dout, q, k, v, out, lse, meta)
        acc = accum_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        blocks = self._blocks(k, v, meta.keys)
        # the travelling partial sums of dK and dV for the block currently held
        dkv = DoubleBuffer([torch.zeros((2,) + tuple(k.shape), dtype=acc, device=k.device)])
        dkv_pending = None
        for step in range(self.comm.size):
            last = step == self.comm.size - 1
            kv_pending = (
                None if last else self.comm.exchange(blocks.current, blocks.incoming, self.stats)
            )
            (block_k, block_v), (key_positions, key_segments) = blocks.current
            t0 = time.perf_counter()
            view = meta.visiting(Side(key_positions, key_segments), step)
            grads = self.backward_step(dout, q, block_k, block_v, out, lse, view)
            if grads is not None:
                dq += grads[0]
            if self.stats is not None:
                self.stats.compute_s += time.perf_counter() - t0
            if dkv_pending is not None:  # the partial sum for the block we now hold has arrived
                dkv_pending.wait()
                dkv.swap()
            if grads is not None:
                dkv.current[0][0] += grads[1]
                dkv.current[0][1] += grads[2]
            # the W-th hop brings it home
            dkv_pending = self.comm.exchange(dkv.current, dkv.incoming, self.stats, tag=2)
            if kv_pending is not None:
                kv_pending.wait()
                blocks.swap()
        dkv_pending.wait()
        dkv.swap()
        dk, dv = dkv.current[0]
        return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    """Differentiable ring attention; the metadata object is kept for the backward, so its plans
    (one per step) serve both directions."""

    @staticmethod
    def forward(ctx, q, k, v, meta: AttentionMeta, ring: Ring):
        out, lse = ring.forward(q, k, v, meta)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta, ctx.ring = meta, ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.ring.backward(dout.contiguous(), q, k, v, out, lse, ctx.meta)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def check_shard(q: Tensor, k: Tensor, v: Tensor, meta: AttentionMeta) -> None:
    """ValueError unless q (B, S, Hq, D), k and v (B, S, Hkv, D) and the metadata's two sides
    (B, S) are one local shard (the ring and the hybrid need Sq == Sk)."""
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
    meta.check(q, k)


def layout_meta(q: Tensor, world: int, rank: int) -> AttentionMeta:
    """The default metadata of a zigzag shard q (B, S, ...): shard `rank` of `world` in the layout
    (its global positions), one segment, causal."""
    B, S = q.shape[:2]
    positions = shard_positions(S, world, rank, device=q.device).expand(B, S)
    return AttentionMeta.self_attention(
        positions, torch.zeros(B, S, dtype=torch.long, device=q.device)
    )


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    meta: AttentionMeta | None = None,
    *,
    group,
    backend: str = "auto",
    comm_stats: CommStats | None = None,
) -> Tensor:
    """Exact masked attention of a sequence sharded over `group` (collective: every rank calls it);
    the arguments as in docs/ring_attention.md. q (B, S, Hq, D); k, v (B, S, Hkv, D), S the same on
    every rank; meta: this shard's metadata (None: the zigzag layout's positions, one segment,
    causal), kept across calls with the same metadata so its plans are built once. Returns out
    (B, S, Hq, D) in q.dtype; differentiable in q, k, v."""
    ring = Ring(group, backend, comm_stats)
    meta = meta if meta is not None else layout_meta(q, ring.comm.size, ring.comm.rank)
    check_shard(q, k, v, meta)
    return _RingAttention.apply(q, k, v, meta, ring)
