"""VQConfig: the video tokenizer's shape, quantizer, losses and training settings."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal

from longvideo.configtools import (
    apply_overrides,
    check,
    check_at_least,
    check_positive,
    from_dict,
    load_yaml,
    resolve_config_path,
)


def _is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def fsq_levels_for(codebook_size: int) -> tuple[int, ...] | None:
    """Balanced FSQ levels (each 2..8) whose product is exactly `codebook_size`, or None.

    Uses as few dimensions as 8 levels per dimension allow, then the most even split:
    256 -> (8, 8, 4), 1024 -> (8, 8, 4, 4), 8192 -> (8, 8, 8, 4, 4).
    """
    if codebook_size < 2:
        return None
    dims = max(1, math.ceil(math.log(codebook_size) / math.log(8) - 1e-9))
    for d in range(dims, dims + 3):  # a prime factor > 8 makes any split impossible
        splits = [
            lv
            for lv in itertools.combinations_with_replacement(range(8, 1, -1), d)
            if math.prod(lv) == codebook_size
        ]
        if splits:  # the most even; of those the first, largest levels first
            return min(splits, key=lambda lv: max(lv) - min(lv))
    return None


@dataclass(frozen=True, kw_only=True)
class VQConfig:
    arch: Literal["longvideo", "lwm-vqgan"] = "longvideo"
    """Implementation: the project's tokenizer, or LWM's VQGAN (inference only, docs/lwm.md)."""
    mode: Literal["2d", "causal3d"] = "2d"
    """2d: each frame coded alone (LWM layout); causal3d: frames grouped in time, causally."""
    resolution: int = 256
    """Square frame side in pixels."""
    downsample: int = 16
    """Spatial factor f (a power of 2): a frame becomes (resolution/f)^2 codes."""
    temporal_downsample: int = 4
    """Causal-3D only: t frames per temporal group (a power of 2; the first frame is coded alone)."""
    codebook_size: int = 8192
    """Number of codes."""
    patch_size: int = 1
    """Pixels folded into channels (space-to-depth) before the first conv; a power of 2 <= f."""
    channels: int = 128
    """Width of the first encoder level (last decoder level)."""
    channel_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    """Width multiplier per level; log2(downsample / patch_size) + 1 entries."""
    num_res_blocks: int = 2
    """Residual blocks per level in the encoder and the decoder."""
    temporal_kernel: int = 3
    """Causal-3D only: temporal size of the residual convolutions' kernels."""
    quantizer: Literal["fsq", "vq"] = "fsq"
    """fsq: finite scalar quantisation; vq: l2-normalised codebook with EMA updates and restarts."""
    fsq_levels: tuple[int, ...] = ()
    """FSQ levels per latent channel, product = codebook_size; empty chooses balanced ones."""
    codebook_dim: int = 8
    """VQ only: width of the l2-normalised code vectors."""
    ema_decay: float = 0.99
    """VQ only: decay of the codebook's moving averages."""
    dead_code_threshold: float = 0.05
    """VQ only: a code whose EMA assignments per step drop below this restarts on an encoder output."""
    l1_weight: float = 1.0
    """Weight of the L1 reconstruction loss (pixels in [-1, 1])."""
    l2_weight: float = 1.0
    """Weight of the L2 reconstruction loss."""
    commit_weight: float = 0.25
    """VQ only: weight of the commitment loss pulling encoder outputs to their codes."""
    disc_weight: float = 0.0
    """Weight of the patch-discriminator (hinge GAN) loss; 0 turns the discriminator off."""
    disc_start: int = 5000
    """Step from which the discriminator trains and its loss reaches the generator."""
    disc_channels: int = 64
    """Width of the patch discriminator's first layer."""
    steps: int = 20000
    """Optimizer steps."""
    lr: float = 2e-4
    """Peak learning rate (AdamW), reached after warmup_steps, cosine decay to 10 %."""
    warmup_steps: int = 200
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clipping (0 = off)."""
    batch_size: int = 16
    """Frames (2d) or clips (causal3d) per step."""
    clip_groups: int = 3
    """Causal-3D only: code groups per training clip (1 + t * (clip_groups - 1) frames)."""
    eval_every: int = 500
    """Steps between evaluations (held-out PSNR, codebook usage, PNG grid)."""
    eval_frames: int = 32
    """Held-out frames (2d) or frames across held-out clips (causal3d) used by evaluations."""
    log_every: int = 20
    """Steps between TensorBoard training scalars."""
    save_every: int = 1000
    """Steps between resumable checkpoints (one is always written at the end)."""
    seed: int = 0
    """Random seed of initialisation and frame sampling."""
    fps: float = 1.0
    """Frames per second sampled from training videos."""
    max_frames_per_video: int = 512
    """Most frames read from one training video."""
    video_backend: Literal["auto", "decord", "pyav"] = "auto"
    """Video decoder: auto = pyav (in this process); decord runs in a child process (docs/data.md)."""
    pool_frames: int = 4096
    """Most training frames kept in memory (videos are read once, then sampled from RAM)."""
    crop_scale: float = 1.0
    """Training frames kept at crop_scale x resolution, for random crops (docs/vq.md); 1 = whole frames."""

    def __post_init__(self):
        check(self.arch in ("longvideo", "lwm-vqgan"), "arch", "must be longvideo or lwm-vqgan")
        if self.arch == "lwm-vqgan":  # a taming-style VQGAN: frames alone, a codebook, no patching
            check(self.mode == "2d", "mode", "must be 2d for arch lwm-vqgan")
            check(
                self.quantizer == "vq",
                "quantizer",
                "must be vq for arch lwm-vqgan (codebook_dim = its embedding width)",
            )
            check(self.patch_size == 1, "patch_size", "must be 1 for arch lwm-vqgan")
            check(
                self.channels % 32 == 0,
                "channels",  # then so is every level's (channels x a multiple)
                "arch lwm-vqgan normalises in 32 groups: every level's width must be a multiple of 32",
            )
        check_positive(
            self, "resolution", "channels", "codebook_dim", "disc_channels", "steps", "lr", "fps"
        )
        check_at_least(
            self,
            0,
            "num_res_blocks",
            "dead_code_threshold",
            "l1_weight",
            "l2_weight",
            "commit_weight",
            "disc_weight",
            "disc_start",
            "warmup_steps",
            "grad_clip",
        )
        check_at_least(
            self,
            1,
            "temporal_downsample",
            "batch_size",
            "clip_groups",
            "eval_every",
            "eval_frames",
            "log_every",
            "save_every",
            "max_frames_per_video",
            "pool_frames",
        )
        check(
            _is_pow2(self.downsample) and self.downsample >= 2,
            "downsample",
            f"must be a power of 2 >= 2, got {self.downsample}",
        )
        check(
            self.resolution % self.downsample == 0,
            "downsample",
            f"must divide resolution={self.resolution}, got {self.downsample}",
        )
        check(
            _is_pow2(self.patch_size) and self.patch_size <= self.downsample,
            "patch_size",
            f"must be a power of 2 <= downsample = {self.downsample}, got {self.patch_size}",
        )
        if self.mode == "causal3d":
            check(
                _is_pow2(self.temporal_downsample),
                "temporal_downsample",
                f"must be a power of 2, got {self.temporal_downsample}",
            )
            check(
                self.temporal_downsample <= self.downsample // self.patch_size,
                "temporal_downsample",
                f"must be <= downsample / patch_size = {self.downsample // self.patch_size} "
                "(one halving per level)",
            )
            check(self.temporal_kernel >= 1, "temporal_kernel", "must be >= 1")
        check(self.codebook_size >= 2, "codebook_size", "must be >= 2")
        levels = int(math.log2(self.downsample // self.patch_size)) + 1
        check(
            len(self.channel_mult) == levels and all(m >= 1 for m in self.channel_mult),
            "channel_mult",
            f"needs log2(downsample / patch_size) + 1 = {levels} positive entries, "
            f"got {list(self.channel_mult)}",
        )
        if self.quantizer == "fsq":
            if self.fsq_levels:
                check(
                    all(lv >= 2 for lv in self.fsq_levels), "fsq_levels", "each level must be >= 2"
                )
                check(
                    math.prod(self.fsq_levels) == self.codebook_size,
                    "fsq_levels",
                    f"product {math.prod(self.fsq_levels)} must equal codebook_size={self.codebook_size}",
                )
            else:
                check(
                    fsq_levels_for(self.codebook_size) is not None,
                    "codebook_size",
                    f"{self.codebook_size} has no split into FSQ levels 2..8; set fsq_levels "
                    "or use quantizer: vq",
                )
        check(0 < self.ema_decay < 1, "ema_decay", "must be in (0, 1)")
        check(self.l1_weight + self.l2_weight > 0, "l1_weight", "l1_weight + l2_weight must be > 0")
        check(
            1.0 <= self.crop_scale <= 4.0, "crop_scale", f"must be in [1, 4], got {self.crop_scale}"
        )

    @property
    def train_size(self) -> int:
        """Side of the training frames kept in memory: round(crop_scale x resolution)."""
        return max(self.resolution, round(self.crop_scale * self.resolution))

    @property
    def latent_size(self) -> int:
        """Codes per side of a frame: resolution / downsample."""
        return self.resolution // self.downsample

    @property
    def codes_per_frame(self) -> int:
        """Codes per code group (one frame in 2d, t frames in causal3d): (resolution / f)^2."""
        return self.latent_size**2

    @property
    def frames_per_group(self) -> int:
        """Source frames per code group after the first: 1 in 2d, t in causal3d."""
        return self.temporal_downsample if self.mode == "causal3d" else 1

    @property
    def levels(self) -> tuple[int, ...]:
        """FSQ levels in use (given or derived from codebook_size)."""
        return tuple(self.fsq_levels) or fsq_levels_for(self.codebook_size) or ()

    @property
    def latent_dim(self) -> int:
        """Channels the encoder emits into the quantizer."""
        return len(self.levels) if self.quantizer == "fsq" else self.codebook_dim

    def num_groups(self, num_frames: int) -> int:
        """Code groups for a video of num_frames frames: T in 2d, 1 + ceil((T - 1) / t) in causal3d."""
        return 0 if num_frames <= 0 else 1 + -(-(num_frames - 1) // self.frames_per_group)

    def tokens_per_hour(self, fps: float = 1.0) -> int:
        """VQ codes for one hour of video sampled at `fps` (no special tokens)."""
        return self.num_groups(round(3600 * fps)) * self.codes_per_frame


def load_vq_config(path: str | None, overrides: list[str] = ()) -> VQConfig:
    """A VQConfig from a flat VQ yaml (configs/vq/*.yaml) or a root config's `vq:` section, plus
    `key=value` overrides (a `vq.` prefix is accepted). `path` may be a name such as `vq/tiny`."""
    data = load_yaml(resolve_config_path(path)) if path else {}
    if isinstance(data.get("vq"), dict):
        data = data["vq"]
    return from_dict(VQConfig, apply_overrides(data, [o.removeprefix("vq.") for o in overrides]))
