"""Data: video reading, shards, tokenization, sequence layout, packing and the training loader.

Raw shards (video + json) -> ``longvideo tokenize`` -> token shards (VQ codes + timestamps + json)
-> :class:`TokenLoader` (layout, packing) -> batches. See docs/data.md. Names load lazily
(longvideo._lazy).
"""

from longvideo._lazy import lazy_exports

_EXPORTS = {
    "VideoCodes": "codes",
    "frames_to_codes": "codes",
    "video_to_codes": "codes",
    "DataConfig": "config",
    "FrameSource": "frames",
    "build_frame_source": "frames",
    "synthetic_videos": "frames",
    "LayoutOptions": "templates",
    "PromptOptions": "templates",
    "build_docs": "templates",
    "Prompt": "templates",
    "build_prompt": "templates",
    "parse_answer": "templates",
    "TokenLoader": "loader",
    "make_loader": "loader",
    "Packer": "packing",
    "pack_row": "packing",
    "ShardError": "streams",
    "SkipStats": "streams",
    "TokenShard": "shards",
    "expand_shards": "streams",
    "expand_sources": "streams",
    "moving_shapes_video": "synthetic",
    "write_synthetic_shards": "synthetic",
    "CorruptVideoError": "video",
    "EmptyVideoError": "video",
    "UnsupportedVideoError": "video",
    "VideoClip": "video",
    "VideoError": "video",
    "VideoInfo": "video",
    "iter_video": "video",
    "probe_video": "video",
    "read_video": "video",
    "sample_indices": "video",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
