"""Sequence parallelism (docs/ring_attention.md, "Using it in the model"): the dp x sp mesh, the
zigzag layout, ring attention and `parallelize`; names load lazily (longvideo._lazy)."""

from longvideo._lazy import lazy_exports

_EXPORTS = {
    name: module
    for module, names in {
        "comm": ("CommStats", "DoubleBuffer", "RingComm"),
        "engine": ("Engine", "consolidate_zero_checkpoint"),
        "deepspeed_config": ("build_deepspeed_config",),
        "zigzag": (
            "BATCH_PAD_VALUES",
            "layout_positions",
            "padded_length",
            "shard_batch",
            "shard_sequence",
            "unshard_sequence",
            "zigzag_indices",
        ),
        "loss": ("loss_scale", "normalized_loss"),
        "mesh": ("Mesh", "UlyssesGroups", "split_group"),
        "ulysses": ("head_split", "hybrid_attention"),
        "config": ("ParallelConfig", "RuntimeConfig"),
        "seam": ("RingAttentionSeam",),
        "apply": ("apply_activation_checkpointing", "apply_attention", "parallelize"),
        "ring": ("Ring", "block_is_empty", "ring_attention"),
    }.items()
    for name in names
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
