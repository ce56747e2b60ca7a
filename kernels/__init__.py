"""Attention kernels (docs/kernels.md): block-attention backends, their shared math and the
pure-PyTorch reference. Installed as `longvideo.kernels`; imports nothing else of the project.
"""

import os as _os
import sys as _sys
from importlib.machinery import PathFinder as _PathFinder

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
_OTHER = None
if __name__ == "kernels":  # found as a top-level name: a checkout's root is on sys.path
    # (`python -m ...` or pytest started there). This folder is `longvideo.kernels`; a top-level
    # `import kernels` means Hugging Face's package (transformers >= 5.25 requires and imports it):
    # where the rest of sys.path holds one, the name goes to it; where none is installed, this
    # module stays what the import found (transformers then reads it as no `kernels` at all).
    _OTHER = _PathFinder.find_spec(
        "kernels", [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _ROOT]
    )

if _OTHER is not None:
    import importlib.util as _util

    _module = _util.module_from_spec(_OTHER)
    _sys.modules["kernels"] = _module
    _OTHER.loader.exec_module(_module)
else:
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
