"""Attention kernels (docs/kernels.md): block-attention backends, their shared math and the
pure-PyTorch reference. Installed as `longvideo.kernels`; imports nothing else of the project.
"""

import os as _os

# The modules live beside this file in an installed wheel, and in the repository's top-level
# kernels/ folder in a checkout. That folder has no __init__.py: from a checkout's root it is at
# most a namespace portion, which Python ranks below any installed regular package, so a top-level
# `import kernels` there still finds Hugging Face's `kernels` (docs/architecture.md, "Packaging").
if not _os.path.isfile(_os.path.join(_os.path.dirname(__file__), "attention_math.py")):
    __path__.append(
        _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.dirname(__file__))), "kernels")
    )

from .attention_math import (
    FULL,
    PARTIAL,
    SKIP,
    TileStats,
    accum_dtype,
    block_class,
    classify_tiles,
    lse_merge_,
    merge_partials,
    merge_stacked,
    tile_stats,
    transposed,
    visibility,
    visit_ranges,
)
from .backends import BlockBackend, Upstream, available_backends, get_backend, register_backend
from .interface import block_attention
from .meta import AttentionMeta, Side, default_scale
from .plans import AttentionPlan
from .reference import flash_attn_ref

__all__ = [
    "accum_dtype",
    "AttentionMeta",
    "AttentionPlan",
    "available_backends",
    "block_attention",
    "block_class",
    "BlockBackend",
    "classify_tiles",
    "default_scale",
    "flash_attn_ref",
    "FULL",
    "get_backend",
    "lse_merge_",
    "merge_partials",
    "merge_stacked",
    "PARTIAL",
    "register_backend",
    "Side",
    "SKIP",
    "tile_stats",
    "TileStats",
    "transposed",
    "Upstream",
    "visibility",
    "visit_ranges",
]
