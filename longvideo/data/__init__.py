"""Data: video reading, shards, tokenization, sequence layout, packing and the training loader.

Raw shards (video + json) -> ``longvideo tokenize`` -> token shards (VQ codes + timestamps + json)
-> :class:`TokenLoader` (layout, packing) -> batches. See docs/data.md.
"""

from longvideo.data.config import DataConfig
from longvideo.data.layout import LayoutOptions, build_docs, build_prompt_ids, parse_answer
from longvideo.data.loader import TokenLoader, make_loader
from longvideo.data.packing import Packer, pack_row
from longvideo.data.shards import ShardError, SkipStats, TokenShard, expand_shards
from longvideo.data.synthetic import moving_shapes_video, write_synthetic_shards
from longvideo.data.video import (CorruptVideoError, EmptyVideoError, UnsupportedVideoError, VideoClip,
                                  VideoError, VideoInfo, iter_video, probe_video, read_video, sample_indices)

__all__ = [
    "DataConfig", "LayoutOptions", "build_docs", "build_prompt_ids", "parse_answer", "TokenLoader",
    "make_loader", "Packer", "pack_row", "ShardError", "SkipStats", "TokenShard", "expand_shards",
    "moving_shapes_video", "write_synthetic_shards", "CorruptVideoError", "EmptyVideoError",
    "UnsupportedVideoError", "VideoClip", "VideoError", "VideoInfo", "iter_video", "probe_video", "read_video",
    "sample_indices",
]
