"""InferConfig: generation and prefill settings."""

from __future__ import annotations

from dataclasses import dataclass

from longvideo.configtools import check


@dataclass(frozen=True, kw_only=True)
class InferConfig:
    max_new_tokens: int = 64
    """Most tokens generated per answer."""
    temperature: float = 0.0
    """Sampling temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    prefill_chunk: int = 4096
    """Tokens per prefill chunk (peak memory = KV cache + one chunk's activations)."""
    encode_batch_frames: int = 16
    """Frames VQ-encoded per batch while a video streams in."""
    seed: int = 0
    """Seed of the sampling generator (same seed, same answer)."""

    def __post_init__(self):
        check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        check(self.temperature >= 0, "temperature", "must be >= 0")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(self.prefill_chunk >= 1, "prefill_chunk", "must be >= 1")
        check(self.encode_batch_frames >= 1, "encode_batch_frames", "must be >= 1")
