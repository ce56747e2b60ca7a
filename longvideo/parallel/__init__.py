"""Sequence parallelism: the dp x sp mesh, the zigzag layout, ring attention, and `parallelize`.

    mesh = Mesh.from_config(cfg.parallel)                  # dp x sp process groups
    parallelize(model, mesh)                               # ring attention over mesh.sp_group
    local = shard_batch(batch, mesh.sp_group)              # this rank's zigzag shard of a batch
    loss, total = normalized_loss(*model(**local), mesh)   # loss over the whole global batch

See docs/ring_attention.md.
"""

from longvideo.parallel.comm import CommStats, DoubleBuffer, RingComm
from longvideo.parallel.layout import (
    BATCH_PAD_VALUES,
    layout_positions,
    padded_length,
    shard_batch,
    shard_sequence,
    unshard_sequence,
    zigzag_indices,
)
from longvideo.parallel.loss import global_weight_total, normalized_loss
from longvideo.parallel.mesh import Mesh
from longvideo.parallel.parallelize import RingAttentionSeam, parallelize
from longvideo.parallel.ring import block_is_empty, ring_attention

__all__ = [
    "BATCH_PAD_VALUES",
    "CommStats",
    "DoubleBuffer",
    "Mesh",
    "RingAttentionSeam",
    "RingComm",
    "block_is_empty",
    "global_weight_total",
    "layout_positions",
    "normalized_loss",
    "padded_length",
    "parallelize",
    "ring_attention",
    "shard_batch",
    "shard_sequence",
    "unshard_sequence",
    "zigzag_indices",
]
