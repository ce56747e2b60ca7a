"""DataConfig: where shards are and how samples become token sequences."""

from __future__ import annotations

from dataclasses import dataclass

from longvideo.configtools import check


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train_shards: str = ""
    """Token shards for training: a directory, a glob, or a brace pattern."""
    seq_len: int = 4096
    """Tokens per packed training sequence (the context length of the stage)."""
    fps: float = 1.0
    """Frames per second sampled from videos."""
    max_frames: int = 3600
    """Most frames taken from one video (uniform sampling when the cap binds)."""
    text_loss_weight: float = 0.5
    """Loss weight of text tokens (LWM: 0.5)."""
    vision_loss_weight: float = 0.5
    """Loss weight of vision tokens (LWM: 0.5)."""
    seed: int = 0
    """Shuffle seed."""

    def __post_init__(self):
        check(self.seq_len > 0, "seq_len", "must be positive")
        check(self.fps > 0, "fps", "must be positive")
        check(self.max_frames > 0, "max_frames", "must be positive")
        check(self.text_loss_weight >= 0, "text_loss_weight", "must be >= 0")
        check(self.vision_loss_weight >= 0, "vision_loss_weight", "must be >= 0")
