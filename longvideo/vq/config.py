"""VQConfig: the video tokenizer's shape and training settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from longvideo.configtools import check


@dataclass(frozen=True, kw_only=True)
class VQConfig:
    mode: Literal["2d", "causal3d"] = "2d"
    """2d: each frame coded alone (LWM layout); causal3d: frames grouped in time, causally."""
    resolution: int = 256
    """Square frame side in pixels."""
    downsample: int = 16
    """Spatial factor f: a frame becomes (resolution/f)^2 codes."""
    temporal_downsample: int = 4
    """Causal-3D only: t frames per temporal group (the first frame is coded alone)."""
    codebook_size: int = 8192
    """Number of codes."""

    def __post_init__(self):
        check(self.resolution > 0, "resolution", "must be positive")
        check(self.downsample > 0 and self.resolution % self.downsample == 0, "downsample",
              f"must divide resolution={self.resolution}, got {self.downsample}")
        check(self.temporal_downsample >= 1, "temporal_downsample", "must be >= 1")
        check(self.codebook_size >= 2, "codebook_size", "must be >= 2")

    @property
    def codes_per_frame(self) -> int:
        return (self.resolution // self.downsample) ** 2
