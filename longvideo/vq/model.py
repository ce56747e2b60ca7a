"""VQModel: convolutional encoder -> quantizer -> decoder (VQGAN-style, no attention).

2d mode: frames are coded one by one; a (H, W) frame becomes (H/f, W/f) codes.
causal3d mode: the same network with causal temporal kernels and log2(t) temporal halvings in
the deepest levels; frame 0 becomes code group 0 alone, then each t frames become one group.
Pixels enter and leave as floats in [-1, 1] laid out (B, 3, T, H, W).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from longvideo.configtools import ConfigError, from_dict, to_dict
from longvideo.vq.config import VQConfig
from longvideo.vq.layers import Conv, Downsample, ResBlock, Upsample, norm
from longvideo.vq.quantizer import build_quantizer

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class Head(nn.Module):
    """norm -> SiLU -> 3x3 conv: the last layer of the encoder and of the decoder."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.norm, self.conv = norm(c_in), Conv(c_in, c_out, 3)

    def forward(self, x: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        return self.conv(F.silu(self.norm(x)))


def _plan(cfg: VQConfig) -> tuple[list[int], list[int], list[bool]]:
    """Widths per level, temporal kernel size per level, and which halvings also halve time.

    Time is halved in the deepest levels, where tensors (and streaming carries) are smallest.
    Residual blocks mix time (kernel kt > 1) from the first level that halves time downwards;
    shallower, full-resolution levels work on each frame alone, which keeps the causal 3D model's
    cost near the 2D one's (a 3 x 3 x 3 kernel at 256 x 256 costs three 2D convolutions).
    """
    widths = [cfg.channels * m for m in cfg.channel_mult]
    levels = len(widths) - 1
    t_levels = int(math.log2(cfg.temporal_downsample)) if cfg.mode == "causal3d" else 0
    temporal = [i >= levels - t_levels for i in range(levels)]
    first = levels - t_levels if t_levels else len(widths)
    kts = [cfg.temporal_kernel if i >= first else 1 for i in range(len(widths))]
    return widths, kts, temporal


def space_to_depth(x: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, T, H, W) -> (B, C p^2, T, H/p, W/p)."""
    if p == 1:
        return x
    if x.shape[2] == 1:
        return F.pixel_unshuffle(x[:, :, 0], p).unsqueeze(2)
    return F.pixel_unshuffle(x.transpose(1, 2), p).transpose(1, 2)


def depth_to_space(x: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C p^2, T, H, W) -> (B, C, T, H p, W p)."""
    if p == 1:
        return x
    if x.shape[2] == 1:
        return F.pixel_shuffle(x[:, :, 0], p).unsqueeze(2)
    return F.pixel_shuffle(x.transpose(1, 2), p).transpose(1, 2)


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
        x = space_to_depth(x, self.patch)
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
        return depth_to_space(z, self.patch)


class VQModel(nn.Module):
    """The video tokenizer. See `encode_video` / `decode_codes` for uint8 frames in and out."""

    def __init__(self, cfg: VQConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.quantizer = build_quantizer(cfg)
        self.decoder = Decoder(cfg)

    # --- tensors in [-1, 1] ---
    def encode(self, x: torch.Tensor, state: dict | None = None):
        """(B, 3, T, H, W) -> latents zq (B, D, G, h, w), codes (B, G, h, w), auxiliary loss."""
        z = self.encoder(x, state)
        zq, codes, aux = self.quantizer(z.movedim(1, -1))
        return zq.movedim(-1, 1), codes, aux

    def decode(self, zq: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        """(B, D, G, h, w) -> (B, 3, T, H, W); T = G in 2d, 1 + t (G - 1) in causal3d."""
        return self.decoder(zq, state)

    def codes_to_latents(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, G, h, w) long -> (B, D, G, h, w)."""
        if codes.min() < 0 or codes.max() >= self.cfg.codebook_size:
            raise ValueError(f"codes must lie in [0, {self.cfg.codebook_size}), got "
                             f"[{int(codes.min())}, {int(codes.max())}]")
        return self.quantizer.lookup(codes).movedim(-1, 1)

    def forward(self, x: torch.Tensor):
        """Reconstruction of a clip: (B, 3, T, H, W) -> (recon, codes, auxiliary loss)."""
        zq, codes, aux = self.encode(x)
        return self.decode(zq), codes, aux

    # --- layout ---
    def group_frame_index(self, num_frames: int) -> list[list[int]]:
        """The source frames each code group covers (padding frames excluded)."""
        if self.cfg.mode == "2d":
            return [[i] for i in range(num_frames)]
        t = self.cfg.temporal_downsample
        out = [[0]] if num_frames > 0 else []
        for start in range(1, num_frames, t):
            out.append(list(range(start, min(start + t, num_frames))))
        return out

    # --- files ---
    def save(self, out_dir: str | Path) -> None:
        """Write `model.safetensors` and `config.json` into out_dir."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        (out / CONFIG_FILE).write_text(json.dumps(to_dict(self.cfg), indent=2) + "\n")


def load_vq(path: str | Path, device: str | torch.device = "cpu") -> VQModel:
    """Load a VQModel saved by `VQModel.save` (eval mode)."""
    from safetensors.torch import load_file

    path = Path(path)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise FileNotFoundError(f"VQ checkpoint {path}: missing {name}")
    try:
        data = json.loads((path / CONFIG_FILE).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"VQ checkpoint {path}: {CONFIG_FILE} is not valid JSON ({e})") from None
    try:
        cfg = from_dict(VQConfig, data)
    except ConfigError as e:
        raise ConfigError(e.key, f"in {path / CONFIG_FILE}: {str(e).split(': ', 1)[1]}") from None
    model = VQModel(cfg)
    state = load_file(str(path / WEIGHTS_FILE))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise KeyError(f"VQ checkpoint {path / WEIGHTS_FILE} does not match its config: "
                       f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    for k, v in state.items():
        if v.shape != expected[k].shape:
            raise ValueError(f"VQ checkpoint {path / WEIGHTS_FILE}: key '{k}' has shape "
                             f"{tuple(v.shape)}, the config implies {tuple(expected[k].shape)}")
    model.load_state_dict(state)
    return model.to(device).eval()
