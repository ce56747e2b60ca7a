"""Learning-rate schedule: linear warm-up, then cosine decay to lr * min_lr_ratio.

The schedule is a pure function of the optimizer step, so a resumed run (which restores the step)
continues on exactly the same curve; `WarmupCosine` wraps it with a state dict for the checkpoint.
"""

from __future__ import annotations

import math


def lr_at(
    step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> float:
    """Learning rate for optimizer step `step` (0-based: the rate used by the (step+1)-th update)."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)


class WarmupCosine:
    """Sets the learning rate of an optimizer's param groups from the step count."""

    def __init__(
        self, optimizer, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float
    ):
        self.optimizer = optimizer
        self.kw = dict(
            lr=lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio
        )
        self.step_count = 0
        self.apply()

    def current(self) -> float:
        return lr_at(self.step_count, **self.kw)

    def apply(self) -> float:
        value = self.current()
        for group in self.optimizer.param_groups:
            group["lr"] = value
        return value

    def step(self) -> float:
        """Advance one optimizer step and set the next rate."""
        self.step_count += 1
        return self.apply()

    def state_dict(self) -> dict:
        return {"step_count": self.step_count, **self.kw}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
        self.apply()
