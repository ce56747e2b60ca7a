"""The sequence-parallel attention seam `apply_attention` gives a model (longvideo.hf and
longvideo.infer.sp reuse it)."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from longvideo.kernels import PlanCache, RingPlans
from longvideo.parallel.mesh import UlyssesGroups
from longvideo.parallel.ring import ring_attention
from longvideo.parallel.ulysses import gather_metadata, hybrid_attention


class RingAttentionSeam:
    """Ring attention over one process group, or the hybrid when `ulysses` splits it; q, k, v of the
    same local shard (training: no KV cache). Plans and the hybrid's gathered metadata are kept per
    metadata tensors (kernels.PlanCache), so the layers of a step and their backward share them."""

    def __init__(self, group, backend: str = "auto", ulysses: Optional[UlyssesGroups] = None):
        self.group, self.backend, self.ulysses = group, backend, ulysses
        self.plans = PlanCache(size=2, factory=RingPlans)
        self.metadata = PlanCache(size=2, factory=dict)

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        q_positions: Tensor,
        k_positions: Tensor,
        q_segment_ids: Tensor,
        k_segment_ids: Tensor,
        causal: bool = True,
    ) -> Tensor:
        if k.shape[1] != q.shape[1] or k_positions.shape != q_positions.shape:
            raise RuntimeError(
                f"ring attention needs queries and keys of the same shard (got {q.shape[1]} "
                f"queries, {k.shape[1]} keys); decoding with a KV cache is served by "
                "longvideo.infer.sp"
            )
        plans = self.plans.lookup(q_positions, q_segment_ids)
        if self.ulysses is None:
            return ring_attention(
                q,
                k,
                v,
                group=self.group,
                causal=causal,
                positions=q_positions,
                segment_ids=q_segment_ids,
                backend=self.backend,
                plans=plans,
            )
        kept = self.metadata.lookup(q_positions, q_segment_ids)
        if "meta" not in kept:
            kept["meta"] = gather_metadata(q_positions, q_segment_ids, self.ulysses.group)
        return hybrid_attention(
            q,
            k,
            v,
            groups=self.ulysses,
            positions=q_positions,
            segment_ids=q_segment_ids,
            causal=causal,
            backend=self.backend,
            plans=plans,
            group_meta=kept["meta"],
        )
