"""TrainConfig: optimisation, schedule, precision, checkpoints, failure handling and logging."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from longvideo.configtools import check, check_at_least, check_positive


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
    """AdamW weight decay (matrices only; norms are not decayed)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Gradient-norm clipping (0 = off); always written into the DeepSpeed config."""
    micro_batch_size: int = 1
    """Sequences per dp rank per micro step."""
    grad_accum: int = 1
    """Micro steps per optimizer step."""
    seed: int = 0
    """Random seed (weights, synthetic data)."""
    out_dir: str = "runs/train"
    """Where checkpoints, logs and plots go."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """auto = bf16 on GPU, fp32 on CPU."""
    zero_stage: int | None = None
    """DeepSpeed ZeRO stage 1, 2 or 3; null = the stage in deepspeed_config, else 3."""
    deepspeed_config: str = ""
    """Optional DeepSpeed JSON (relative to configs/ or a path) for tuning keys: buckets, overlap, offload."""
    data_source: Literal["auto", "shards", "synthetic"] = "auto"
    """shards: data.train_shards (required); synthetic: generated tokens; auto: shards if set, else synthetic."""
    tokenizer_dir: str = ""
    """Text tokenizer directory (needed with data.train_shards); copied into the run and its checkpoints."""
    vq_dir: str = ""
    """VQ tokenizer checkpoint directory; copied into the run and its checkpoints so chat finds it."""
    hf_model: str = ""
    """A transformers decoder directory (Llama, Mistral, Qwen2) trained instead of the project's own
    decoder (docs/hf.md); `model:` then only sets the vocabulary the data uses."""
    init_from: str = ""
    """Start from these model weights (a checkpoint dir or run dir); optimizer and step start fresh."""
    checkpoint_every: int = 500
    """Write a checkpoint every N steps (0 = only at the end); one is always written at exit."""
    keep_checkpoints: int = 2
    """Keep the newest N checkpoints (0 = keep all)."""
    save_weights: bool = True
    """Also write model.safetensors (full fp32) into each checkpoint; false: `longvideo consolidate` writes it."""
    max_bad_steps: int = 5
    """A NaN/inf loss or gradient norm skips the step; this many in a row stops the run."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device for MFU; 0 = look the GPU up by name (no MFU when unknown)."""
    log_every: int = 1
    """Write metrics every N steps."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""
    tensorboard: bool = True
    """Write TensorBoard events under out_dir/tb."""
    wandb: Literal["disabled", "offline", "online"] = "disabled"
    """Weights & Biases logging mode (offline needs no network)."""
    wandb_project: str = "longvideo"
    """Weights & Biases project name."""
    plot: bool = True
    """Write out_dir/loss.png at the end."""
    synthetic_vocab: int = 0
    """Synthetic data only: draw tokens from the first N ids (0 = the text vocabulary)."""

    def __post_init__(self):
        check_positive(self, "steps", "lr", "adam_eps")
        check_at_least(
            self, 0, "warmup_steps", "weight_decay", "grad_clip", "peak_flops", "synthetic_vocab"
        )
        check_at_least(self, 1, "micro_batch_size", "grad_accum", "max_bad_steps", "log_every")
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        check(0 <= self.adam_beta1 < 1, "adam_beta1", "must be in [0, 1)")
        check(0 <= self.adam_beta2 < 1, "adam_beta2", "must be in [0, 1)")
        check(
            self.zero_stage in (None, 1, 2, 3),
            "zero_stage",
            f"must be 1, 2 or 3, got {self.zero_stage}",
        )
        check(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0 (0 = only at the end)")
        check(self.keep_checkpoints >= 0, "keep_checkpoints", "must be >= 0 (0 = keep all)")
        check(bool(self.out_dir), "out_dir", "must not be empty")
