"""Attention kernels: block-attention backends (torch, cpu, triton), their shared math and the
pure-PyTorch reference. Installed as `longvideo.kernels`; imports nothing else of the project.

    from longvideo.kernels import block_attention, flash_attn_ref, get_backend
"""

from .attention_math import (FULL, PARTIAL, SKIP, TileStats, accum_dtype, block_class, classify_tiles,
                             default_meta, fill_meta, lse_merge_, merge_partials, merge_stacked, tile_stats,
                             transposed, visibility, visit_ranges)
from .backends import BlockBackend, available_backends, get_backend, register_backend, resolve_backend_name
from .interface import block_attention
from .plans import AttentionPlan, PlanCache, RingPlans
from .reference import flash_attn_ref

__all__ = [
    "AttentionPlan",
    "BlockBackend",
    "FULL",
    "PARTIAL",
    "SKIP",
    "TileStats",
    "accum_dtype",
    "available_backends",
    "block_attention",
    "block_class",
    "classify_tiles",
    "default_meta",
    "fill_meta",
    "flash_attn_ref",
    "get_backend",
    "lse_merge_",
    "merge_partials",
    "merge_stacked",
    "PlanCache",
    "register_backend",
    "resolve_backend_name",
    "RingPlans",
    "tile_stats",
    "transposed",
    "visibility",
    "visit_ranges",
]
