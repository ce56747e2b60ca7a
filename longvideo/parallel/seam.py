"""The sequence-parallel attention seam `apply_attention` gives a model (longvideo.hf and
longvideo.infer.sp reuse it)."""

from __future__ import annotations

from torch import Tensor

from longvideo.kernels import AttentionMeta
from longvideo.parallel.mesh import UlyssesGroups
from longvideo.parallel.ring import ring_attention
from longvideo.parallel.ulysses import hybrid_attention


class RingAttentionSeam:
    """Ring attention over one process group, or the hybrid when `ulysses` splits it; q, k, v of the
    same local shard (training: no KV cache). The plans, and the hybrid's gathered metadata, live in
    the metadata object the model builds once per step, so its layers and their backward share
    them."""

    def __init__(self, group, backend: str = "auto", ulysses: UlyssesGroups | None = None):
        self.group, self.backend, self.ulysses = group, backend, ulysses

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMeta) -> Tensor:
        if k.shape[1] != q.shape[1] or meta.keys.length != meta.queries.length:
            raise RuntimeError(
                f"ring attention needs queries and keys of the same shard (got {q.shape[1]} "
                f"queries, {k.shape[1]} keys); decoding with a KV cache is served by "
                "longvideo.infer.sp"
            )
        if self.ulysses is None:
            return ring_attention(q, k, v, meta, group=self.group, backend=self.backend)
        return hybrid_attention(q, k, v, meta, group=self.ulysses, backend=self.backend)
