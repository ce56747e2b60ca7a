"""ParallelConfig: how the world is split into data-parallel x sequence-parallel ranks, and
RuntimeConfig: how the model runs on them (activation checkpointing, chunk sizes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from longvideo.configtools import check


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    dp: int = -1
    """Data-parallel size; -1 means world_size // sp."""
    sp: int = 1
    """Sequence-parallel size; neighbouring ranks share one sequence."""
    ulysses: int = 1
    """Head-parallel (Ulysses) size inside each sp group: sp / ulysses ring positions of `ulysses`
    neighbouring ranks, an all-to-all inside each, the ring across them (docs/hybrid.md).
    1 = a ring over all sp ranks; sp = heads only. Must divide sp."""
    backend: Literal["auto", "torch", "cpu", "triton"] = "auto"
    """Block-attention backend, in the ring and on one device: auto = per-block dispatch (docs/kernels.md)."""
    timeout_s: float = 600.0
    """Collective timeout: a dead rank makes the others fail after this many seconds."""

    def __post_init__(self):
        check(self.sp >= 1, "sp", f"must be >= 1, got {self.sp}")
        check(
            self.ulysses >= 1 and self.sp % self.ulysses == 0,
            "ulysses",
            f"must be >= 1 and divide sp={self.sp}, got {self.ulysses}",
        )
        check(self.dp == -1 or self.dp >= 1, "dp", f"must be >= 1 or -1 (derive), got {self.dp}")
        check(self.timeout_s > 0, "timeout_s", "must be positive")


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """How a built model runs: choices that change memory and speed, never the architecture.
    `longvideo.checkpoint.build_model` and `longvideo.parallel.apply` apply them."""

    activation_checkpointing: bool = False
    """Recompute each decoder block in the backward pass instead of storing its activations."""
    ffn_chunk: int = 4096
    """Blockwise feed-forward: tokens per chunk (0 = whole sequence at once); each chunk is
    recomputed in the backward pass. Larger chunks cost fewer launches on a GPU (smol-135m uses
    16384; docs/experiments.md, "feed-forward chunks on the GPU")."""
    loss_chunk: int = 4096
    """Chunked cross-entropy: tokens per chunk; full (tokens x vocab) logits never exist."""
    compile: bool = False
    """torch.compile every decoder block with the attention seam as one opaque op
    (longvideo.parallel.compile; the ring, not the Ulysses hybrid; ZeRO stages 0-2). Off by
    default: not yet measured faster on a GPU (docs/kernels.md)."""

    def __post_init__(self):
        check(self.ffn_chunk >= 0, "ffn_chunk", "must be >= 0 (0 = no chunking)")
        check(self.loss_chunk >= 0, "loss_chunk", "must be >= 0 (0 = no chunking)")
