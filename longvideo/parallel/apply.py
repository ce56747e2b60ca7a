"""Apply sequence parallelism to a built model, in one place (docs/architecture.md, decision 5).

    mesh = Mesh.from_config(cfg.parallel)
    parallelize(model, mesh)              # ring attention over mesh.sp_group (+ checkpointing flag)
    engine = deepspeed.initialize(...)    # the trainer's job, not this function's

The model keeps its code; only its attention seam is swapped (`model.set_attention`). Inputs must
then be this rank's zigzag shard with explicit positions and segment ids (`shard_batch`), since a
shard's tokens are not at positions 0..S/W-1.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from longvideo.kernels import PlanCache, RingPlans
from longvideo.parallel.mesh import Mesh
from longvideo.parallel.ring import ring_attention


class RingAttentionSeam:
    """The model's attention seam implemented by ring attention over one process group.

    Called as fn(q, k, v, *, q_positions, k_positions, q_segment_ids, k_segment_ids, causal) with
    q (B, S, Hq, D) and k, v (B, S, Hkv, D) of the same local shard (training: no KV cache).

    The tile plans of every ring step are kept per (positions, segment ids) tensors, by identity
    (kernels.PlanCache): the layers of one model step, which all get the same tensors, and their
    backward share one set of plans.
    """

    def __init__(self, group, backend: str = "auto"):
        self.group, self.backend = group, backend
        self.plans = PlanCache(size=2, factory=RingPlans)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, q_positions: Tensor, k_positions: Tensor,
                 q_segment_ids: Tensor, k_segment_ids: Tensor, causal: bool = True) -> Tensor:
        if k.shape[1] != q.shape[1] or k_positions.shape != q_positions.shape:
            raise RuntimeError(f"ring attention needs queries and keys of the same shard (got {q.shape[1]} "
                               f"queries, {k.shape[1]} keys); decoding with a KV cache is served by "
                               "longvideo.infer.sp")
        return ring_attention(q, k, v, group=self.group, causal=causal, positions=q_positions,
                              segment_ids=q_segment_ids, backend=self.backend,
                              plans=self.plans.lookup(q_positions, q_segment_ids))


def parallelize(model, mesh: Mesh, *, backend: Optional[str] = None,
                activation_checkpointing: Optional[bool] = None):
    """Swap `model`'s attention for ring attention over `mesh.sp_group` (when sp > 1) and set its
    activation-checkpointing flag. Returns the same model.

    backend: block backend inside the ring; None takes the mesh's ParallelConfig.backend ("auto"
    when the mesh was built without a config). activation_checkpointing: None keeps the model's
    own setting. Does not wrap the model in an engine (the trainer calls deepspeed.initialize).
    """
    if activation_checkpointing is not None:
        if not hasattr(model, "activation_checkpointing"):
            raise TypeError(f"{type(model).__name__} has no activation_checkpointing switch")
        model.activation_checkpointing = bool(activation_checkpointing)
    if mesh.sp > 1:
        if not hasattr(model, "set_attention"):
            raise TypeError(f"{type(model).__name__} has no attention seam (set_attention)")
        if backend is None:
            backend = mesh.config.backend if mesh.config is not None else "auto"
        model.set_attention(RingAttentionSeam(mesh.sp_group, backend))
    return model
