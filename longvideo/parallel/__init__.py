"""Sequence parallelism: the dp x sp mesh, the zigzag layout, ring attention, and `parallelize`.

    mesh = Mesh.from_config(cfg.parallel)                   # dp x sp process groups (x ulysses)
    engine = parallelize(model, mesh, cfg, optimizer=opt)   # ring seam, checkpointing, ZeRO
    local = shard_batch(batch, mesh.sp_group)               # this rank's zigzag shard of a batch
    scale, total = loss_scale(token_weights(...).sum(), mesh)   # the global batch's weight total
    engine.backward(engine(**local) * scale)

See docs/ring_attention.md. Names load lazily (longvideo._lazy).
"""

from longvideo._lazy import lazy_exports

_EXPORTS = {
    "CommStats": "comm",
    "DoubleBuffer": "comm",
    "RingComm": "comm",
    "Engine": "engine",
    "consolidate_zero_checkpoint": "engine",
    "build_deepspeed_config": "deepspeed_config",
    "BATCH_PAD_VALUES": "zigzag",
    "layout_positions": "zigzag",
    "padded_length": "zigzag",
    "shard_batch": "zigzag",
    "shard_sequence": "zigzag",
    "unshard_sequence": "zigzag",
    "zigzag_indices": "zigzag",
    "global_weight_total": "loss",
    "loss_scale": "loss",
    "normalized_loss": "loss",
    "Mesh": "mesh",
    "UlyssesGroups": "mesh",
    "split_group": "mesh",
    "head_split": "ulysses",
    "hybrid_attention": "ulysses",
    "ParallelConfig": "config",
    "RuntimeConfig": "config",
    "RingAttentionSeam": "seam",
    "apply_activation_checkpointing": "apply",
    "apply_attention": "apply",
    "parallelize": "apply",
    "block_is_empty": "ring",
    "ring_attention": "ring",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
