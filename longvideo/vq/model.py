"""VQModel: convolutional encoder -> quantizer -> decoder (VQGAN-style, no attention; docs/vq.md).
Pixels enter and leave as floats in [-1, 1] laid out (B, 3, T, H, W)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from longvideo.configtools import ConfigError
from longvideo.vq.config import VQConfig
from longvideo.vq.files import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    VideoTokenizer,
    load_weights_into,
    read_code_map,
    read_vq_config,
)
from longvideo.vq.layers import Conv, Downsample, ResBlock, Upsample, norm
from longvideo.vq.quantizer import build_quantizer
from longvideo.vq.vqgan import LWMVQGAN

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "VQModel", "build_vq", "load_vq"]


class Head(nn.Module):
    """norm -> SiLU -> 3x3 conv: the last layer of the encoder and of the decoder."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.norm, self.conv = norm(c_in), Conv(c_in, c_out, 3)

    def forward(self, x: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        return self.conv(F.silu(self.norm(x)))


def _plan(cfg: VQConfig) -> tuple[list[int], list[int], list[bool]]:
    """Widths per level, temporal kernel size per level, and which halvings also halve time: the
    deepest ones, where tensors and carries are smallest. Residual blocks mix time from the first
    such level down; the full-resolution levels work per frame, keeping causal3d's cost near 2d's."""
    widths = [cfg.channels * m for m in cfg.channel_mult]
    levels = len(widths) - 1
    t_levels = int(math.log2(cfg.temporal_downsample)) if cfg.mode == "causal3d" else 0
    temporal = [i >= levels - t_levels for i in range(levels)]
    first = levels - t_levels if t_levels else len(widths)
    kts = [cfg.temporal_kernel if i >= first else 1 for i in range(len(widths))]
    return widths, kts, temporal


def _per_frame(op, x: torch.Tensor, p: int) -> torch.Tensor:
    """F.pixel_unshuffle ((B, C, T, H, W) -> (B, C p^2, T, H/p, W/p)) or F.pixel_shuffle (the
    inverse) on every frame."""
    if p == 1:
        return x
    if x.shape[2] == 1:
        return op(x[:, :, 0], p).unsqueeze(2)
    return op(x.transpose(1, 2), p).transpose(1, 2)


class Encoder(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        widths, kts, temporal = _plan(cfg)
        self.patch = cfg.patch_size
        layers: list[nn.Module] = [Conv(3 * self.patch**2, widths[0], 3)]
        c = widths[0]
        for i, w in enumerate(widths):
            for _ in range(cfg.num_res_blocks):
                layers.append(ResBlock(c, w, kts[i]))
                c = w
            if i < len(widths) - 1:
                layers.append(Downsample(c, temporal[i]))
        layers += [ResBlock(c, c, kts[-1]), Head(c, cfg.latent_dim)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        # (B, 3, T, H, W) -> (B, D, T', H/f, W/f)
        x = _per_frame(F.pixel_unshuffle, x, self.patch)
        for layer in self.layers:
            x = layer(x, state)
        return x


class Decoder(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        widths, kts, temporal = _plan(cfg)
        c = widths[-1]
        layers: list[nn.Module] = [Conv(cfg.latent_dim, c, 3), ResBlock(c, c, kts[-1])]
        for i in reversed(range(len(widths))):
            for _ in range(cfg.num_res_blocks):
                layers.append(ResBlock(c, widths[i], kts[i]))
                c = widths[i]
            if i > 0:
                layers.append(Upsample(c, temporal[i - 1]))
        self.patch = cfg.patch_size
        layers.append(Head(c, 3 * self.patch**2))
        self.layers = nn.ModuleList(layers)

    def forward(self, z: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        # (B, D, T', h, w) -> (B, 3, T, h*f, w*f)
        for layer in self.layers:
            z = layer(z, state)
        return _per_frame(F.pixel_shuffle, z, self.patch)


class VQModel(VideoTokenizer):
    """The video tokenizer. See `encode_video` / `decode_codes` for uint8 frames in and out."""

    def __init__(self, cfg: VQConfig):
        super().__init__()
        if cfg.arch != "longvideo":
            raise ConfigError(
                "arch",
                f"VQModel implements arch longvideo, got {cfg.arch!r} (build_vq builds either)",
            )
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.quantizer = build_quantizer(cfg)
        self.decoder = Decoder(cfg)

    def encode(self, x: torch.Tensor, state: dict | None = None):
        """(B, 3, T, H, W) -> latents zq (B, D, G, h, w), codes (B, G, h, w), auxiliary loss."""
        z = self.encoder(x, state)
        zq, codes, aux = self.quantizer(z.movedim(1, -1))
        return zq.movedim(-1, 1), codes, aux

    def decode(self, zq: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        """(B, D, G, h, w) -> (B, 3, T, H, W); T = G in 2d, 1 + t (G - 1) in causal3d."""
        return self.decoder(zq, state)

    def _lookup(self, codes: torch.Tensor) -> torch.Tensor:
        return self.quantizer.lookup(codes)

    def group_frame_index(self, num_frames: int) -> list[list[int]]:
        """The source frames each code group covers (padding frames excluded): frame 0, then t at a time."""
        t = self.cfg.frames_per_group
        rest = [list(range(start, min(start + t, num_frames))) for start in range(1, num_frames, t)]
        return [[0], *rest] if num_frames > 0 else []


def build_vq(cfg: VQConfig) -> nn.Module:
    """A randomly initialised tokenizer of the implementation `cfg.arch` names."""
    return LWMVQGAN(cfg) if cfg.arch == "lwm-vqgan" else VQModel(cfg)


def load_vq(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """Load a tokenizer saved by `.save` (eval mode): a VQModel, or the LWM VQGAN adapter."""
    model = build_vq(read_vq_config(path))
    load_weights_into(model, path)
    found = read_code_map(path, model.cfg.codebook_size)
    if found is not None:
        model.code_map, model.code_info = found
    return model.to(device).eval()
