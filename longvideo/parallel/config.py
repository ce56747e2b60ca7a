"""ParallelConfig: how the world is split into data-parallel x sequence-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from longvideo.configtools import check


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    dp: int = -1
    """Data-parallel size; -1 means world_size // sp."""
    sp: int = 1
    """Sequence-parallel (ring) size; neighbouring ranks form one ring."""
    backend: Literal["auto", "torch", "cpu", "triton"] = "auto"
    """Block-attention backend used inside the ring."""
    timeout_s: float = 600.0
    """Collective timeout: a dead rank makes the others fail after this many seconds."""

    def __post_init__(self):
        check(self.sp >= 1, "sp", f"must be >= 1, got {self.sp}")
        check(self.dp == -1 or self.dp >= 1, "dp", f"must be >= 1 or -1 (derive), got {self.dp}")
        check(self.timeout_s > 0, "timeout_s", "must be positive")
