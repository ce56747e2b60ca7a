"""Data: video reading, shards, tokenization, sequence layout, packing and the training loader.

Raw shards (video + json) -> ``longvideo tokenize`` -> token shards (VQ codes + timestamps + json)
-> :class:`TokenLoader` (layout, packing) -> batches. See docs/data.md. Names load lazily
(longvideo._lazy).
"""

from longvideo._lazy import lazy_exports

_MODULES = {
    "codes": ("VideoCodes", "frames_to_codes", "video_to_codes"),
    "config": ("DataConfig",),
    "frames": ("FrameSource", "build_frame_source", "synthetic_videos"),
    "loader": ("TokenLoader",),
    "packing": ("Packer", "pack_row"),
    "shards": ("TokenShard",),
    "streams": ("ShardError", "SkipStats", "expand_shards", "expand_sources"),
    "synthetic": ("write_synthetic_shards",),
    "templates": (
        "LayoutOptions",
        "Prompt",
        "PromptOptions",
        "build_docs",
        "build_prompt",
        "parse_answer",
    ),
    "video": (
        "CorruptVideoError",
        "DisallowedContainerError",
        "EmptyVideoError",
        "UnsupportedVideoError",
        "VideoClip",
        "VideoError",
        "VideoInfo",
        "iter_video",
        "probe_video",
        "read_video",
        "sample_indices",
    ),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
