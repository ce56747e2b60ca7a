"""LWM's VQGAN behind the project's video-tokenizer interface (docs/lwm.md, "VQGAN"): it is exactly
diffusers' VQModel, so the flax weights are mapped onto that (`state_dict_from_flax`, which names every
flax path), not re-implemented. Inference only.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import torch

from longvideo.configtools import ConfigError
from longvideo.vq.config import VQConfig
from longvideo.vq.files import VideoTokenizer

GROUPS = 32
"""GroupNorm groups of LWM's VQGAN (flax's default) and of diffusers' VQModel."""


class LWMVQGANError(ValueError):
    """The VQGAN parameters do not have the structure of LWM's VQGAN."""


def diffusers_config(cfg: VQConfig) -> dict:
    """Keyword arguments of diffusers' VQModel for the VQGAN `cfg` describes."""
    widths = tuple(cfg.channels * m for m in cfg.channel_mult)
    return dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(widths),
        up_block_types=("UpDecoderBlock2D",) * len(widths),
        block_out_channels=widths,
        layers_per_block=cfg.num_res_blocks,
        act_fn="silu",
        latent_channels=cfg.codebook_dim,
        sample_size=cfg.resolution,
        num_vq_embeddings=cfg.codebook_size,
        norm_num_groups=GROUPS,
        vq_embed_dim=cfg.codebook_dim,
        mid_block_add_attention=False,
        lookup_from_codebook=True,
    )


class LWMVQGAN(VideoTokenizer):
    """LWM's VQGAN (a diffusers VQModel in `.net`) with the interface of longvideo.vq.VQModel: pixels
    in [-1, 1] laid out (B, 3, T, H, W), every frame coded alone (a code group is one frame)."""

    def __init__(self, cfg: VQConfig):
        super().__init__()
        if cfg.arch != "lwm-vqgan":
            raise ConfigError("arch", f"LWMVQGAN implements arch lwm-vqgan, got {cfg.arch!r}")
        try:  # a heavy import, needed only here
            from diffusers import VQModel as DiffusersVQModel
        except ImportError as e:
            raise ImportError(
                "LWM's VQGAN runs on diffusers' VQModel, in the lwm extra: "
                "pip install 'longvideo[lwm]'"
            ) from e

        self.cfg = cfg
        self.net = DiffusersVQModel(**diffusers_config(cfg))

    @property
    def codebook(self) -> torch.Tensor:
        return self.net.quantize.embedding.weight

    def encode(self, x: torch.Tensor, state: dict | None = None):
        """(B, 3, T, H, W) -> latents zq (B, D, T, h, w), codes (B, T, h, w), auxiliary loss (0): the
        nearest codebook entries of the encoder's output, as LWM's quantizer picks them."""
        B, C, T, H, W = x.shape
        frames = x.movedim(2, 1).reshape(B * T, C, H, W).to(self.codebook.dtype)
        z = self.net.encode(frames).latents  # (B T, D, h, w): encoder, then quant_conv
        D, h, w = z.shape[1:]
        flat = z.movedim(1, -1).reshape(-1, D)
        codes = torch.cdist(flat, self.codebook).argmin(dim=1)  # what diffusers' quantizer picks
        zq = self.codebook[codes].reshape(B, T, h, w, D).permute(0, 4, 1, 2, 3)
        return zq, codes.reshape(B, T, h, w), torch.zeros((), device=x.device)

    def decode(self, zq: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        """(B, D, G, h, w) -> (B, 3, G, H, W) in [-1, 1] (post_quant_conv, then the decoder)."""
        B, D, G, h, w = zq.shape
        z = zq.movedim(2, 1).reshape(B * G, D, h, w)
        out = self.net.decoder(self.net.post_quant_conv(z)).clamp(-1, 1)
        return out.reshape(B, G, *out.shape[1:]).movedim(1, 2)

    def _lookup(self, codes: torch.Tensor) -> torch.Tensor:
        return self.codebook[codes.long()]

    def group_frame_index(self, num_frames: int) -> list[list[int]]:
        """The source frames each code group covers: one frame each."""
        return [[i] for i in range(num_frames)]


def flatten(tree: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """'a/b/c' -> array of a nested dict of arrays."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def _levels(flat: dict[str, np.ndarray], pattern: str) -> list[int]:
    return sorted({int(m.group(1)) for k in flat if (m := re.match(pattern, k))})


def vq_config_from_flax(params: dict, base: VQConfig | None = None) -> VQConfig:
    """The VQConfig of LWM's VQGAN parameters: widths, levels, residual blocks and codebook read
    from the arrays; the frame resolution (which the weights do not hold) from `base` (256)."""
    flat = flatten(params)
    for need in (
        "encoder/Conv_0/kernel",
        "quantize/embeddings",
        "quant_conv/kernel",
        "decoder/Conv_0/kernel",
    ):
        if need not in flat:
            raise LWMVQGANError(
                f"no '{need}': not the parameters of LWM's VQGAN (top level: {sorted(params)[:8]})"
            )
    attn = sorted(k for k in flat if "AttnBlock" in k)
    if attn:
        raise LWMVQGANError(f"VQGANs with attention blocks are not supported (found {attn[0]})")
    levels = _levels(flat, r"encoder/DownsamplingBlock_(\d+)/")
    if not levels or levels != list(range(len(levels))):
        raise LWMVQGANError(f"encoder levels {levels} are not 0..n-1")
    channels = int(flat["encoder/Conv_0/kernel"].shape[-1])
    widths = [
        int(flat[f"encoder/DownsamplingBlock_{i}/ResnetBlock_0/Conv_0/kernel"].shape[-1])
        for i in levels
    ]
    if any(w % channels for w in widths):
        raise LWMVQGANError(
            f"level widths {widths} are not multiples of the first conv's {channels}"
        )
    blocks = len(_levels(flat, r"encoder/DownsamplingBlock_0/ResnetBlock_(\d+)/"))
    codebook_size, dim = (int(n) for n in flat["quantize/embeddings"].shape)
    z = int(flat["encoder/Conv_1/kernel"].shape[-1])
    if z != dim:
        raise LWMVQGANError(
            f"the encoder emits {z} channels but the codebook is {dim} wide; only VQGANs "
            f"with z_channels == quantized_embed_dim (as LWM's) are supported"
        )
    return dataclasses.replace(
        base or VQConfig(),
        arch="lwm-vqgan",
        mode="2d",
        quantizer="vq",
        patch_size=1,
        downsample=2 ** (len(levels) - 1),
        channels=channels,
        channel_mult=tuple(w // channels for w in widths),
        num_res_blocks=blocks,
        codebook_size=codebook_size,
        codebook_dim=dim,
    )


def _conv(flat, src: str) -> dict[str, torch.Tensor]:
    """A flax conv (kernel (kh, kw, in, out)) as torch's weight (out, in, kh, kw) and bias."""
    k = np.asarray(flat[f"{src}/kernel"])
    return {
        "weight": torch.from_numpy(np.ascontiguousarray(k.transpose(3, 2, 0, 1))),
        "bias": torch.from_numpy(np.asarray(flat[f"{src}/bias"])),
    }


def _norm(flat, src: str) -> dict[str, torch.Tensor]:
    """A flax GroupNorm (scale, bias) as torch's (weight, bias)."""
    return {
        "weight": torch.from_numpy(np.asarray(flat[f"{src}/scale"])),
        "bias": torch.from_numpy(np.asarray(flat[f"{src}/bias"])),
    }


def _resnet(flat, src: str) -> dict[str, dict[str, torch.Tensor]]:
    out = {
        "norm1": _norm(flat, f"{src}/GroupNorm_0"),
        "conv1": _conv(flat, f"{src}/Conv_0"),
        "norm2": _norm(flat, f"{src}/GroupNorm_1"),
        "conv2": _conv(flat, f"{src}/Conv_1"),
    }
    if f"{src}/Conv_2/kernel" in flat:  # 1x1 shortcut where the width changes
        out["conv_shortcut"] = _conv(flat, f"{src}/Conv_2")
    return out


def state_dict_from_flax(params: dict, cfg: VQConfig) -> dict[str, torch.Tensor]:
    """LWM's flax VQGAN parameters -> the state dict of `LWMVQGAN(cfg)` (names under `net.`).

    Every array of `params` must be used exactly once; LWMVQGANError names what is missing or left."""
    flat = flatten(params)
    n = len(cfg.channel_mult)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    try:
        for side in ("encoder", "decoder"):  # what the two halves share: stem, middle, output
            parts[f"{side}.conv_in"] = _conv(flat, f"{side}/Conv_0")
            for j in range(2):
                for sub, t in _resnet(flat, f"{side}/MidBlock_0/ResnetBlock_{j}").items():
                    parts[f"{side}.mid_block.resnets.{j}.{sub}"] = t
            parts[f"{side}.conv_norm_out"] = _norm(flat, f"{side}/GroupNorm_0")
            parts[f"{side}.conv_out"] = _conv(flat, f"{side}/Conv_1")
        for i in range(n):
            for j in range(cfg.num_res_blocks):
                for sub, t in _resnet(
                    flat, f"encoder/DownsamplingBlock_{i}/ResnetBlock_{j}"
                ).items():
                    parts[f"encoder.down_blocks.{i}.resnets.{j}.{sub}"] = t
            if i < n - 1:
                parts[f"encoder.down_blocks.{i}.downsamplers.0.conv"] = _conv(
                    flat, f"encoder/DownsamplingBlock_{i}/Downsample_0/Conv_0"
                )
        parts["quant_conv"] = _conv(flat, "quant_conv")
        parts["quantize.embedding"] = {
            "weight": torch.from_numpy(np.asarray(flat["quantize/embeddings"]))
        }
        parts["post_quant_conv"] = _conv(flat, "post_quant_conv")
        # flax names compact submodules by class and creation order: UpsamplingBlock_k is created
        # first for the deepest level, as diffusers' up_blocks.k
        for k in range(n):
            for j in range(cfg.num_res_blocks + 1):
                for sub, t in _resnet(flat, f"decoder/UpsamplingBlock_{k}/ResnetBlock_{j}").items():
                    parts[f"decoder.up_blocks.{k}.resnets.{j}.{sub}"] = t
            if k < n - 1:
                parts[f"decoder.up_blocks.{k}.upsamplers.0.conv"] = _conv(
                    flat, f"decoder/UpsamplingBlock_{k}/Upsample_0/Conv_0"
                )
    except KeyError as e:
        raise LWMVQGANError(f"LWM VQGAN parameters: missing {e.args[0]}") from None
    sd = {
        f"net.{name}.{p}": t.float() for name, tensors in parts.items() for p, t in tensors.items()
    }
    used = sum(len(t) for t in parts.values())
    if used != len(flat):
        raise LWMVQGANError(
            f"LWM VQGAN parameters: {len(flat) - used} arrays left unused "
            f"(the structure does not match the config read from them)"
        )
    return sd


def vqgan_from_flax(params: dict, base: VQConfig | None = None) -> LWMVQGAN:
    """An LWMVQGAN (eval mode, fp32) holding LWM's flax VQGAN parameters."""
    cfg = vq_config_from_flax(params, base)
    model = LWMVQGAN(cfg)
    sd = state_dict_from_flax(params, cfg)
    expected = model.state_dict()
    bad = sorted(set(expected) ^ set(sd))
    if bad:
        raise LWMVQGANError(f"LWM VQGAN parameters do not fill the model: {bad[:5]}")
    for k, t in sd.items():
        if tuple(t.shape) != tuple(expected[k].shape):
            raise LWMVQGANError(
                f"LWM VQGAN parameter for {k} has shape {tuple(t.shape)}, "
                f"expected {tuple(expected[k].shape)}"
            )
    model.load_state_dict(sd)
    return model.eval()
