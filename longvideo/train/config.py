"""TrainConfig: optimisation, schedule, checkpoints and logging."""

from __future__ import annotations

from dataclasses import dataclass

from longvideo.configtools import check


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 1000
    """Optimizer steps."""
    lr: float = 3e-4
    """Peak learning rate."""
    warmup_steps: int = 100
    """Linear warm-up steps before the cosine decay."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clipping (0 = off)."""
    micro_batch_size: int = 1
    """Sequences per dp rank per micro step."""
    grad_accum: int = 1
    """Micro steps per optimizer step."""
    seed: int = 0
    """Random seed."""
    out_dir: str = "runs/train"
    """Where checkpoints, logs and plots go."""

    def __post_init__(self):
        check(self.steps > 0, "steps", "must be positive")
        check(self.lr > 0, "lr", "must be positive")
        check(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        check(self.grad_clip >= 0, "grad_clip", "must be >= 0")
        check(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
        check(self.grad_accum >= 1, "grad_accum", "must be >= 1")
