"""Building blocks of the tokenizer, on video tensors (B, C, T, H, W) (docs/vq.md, "Two modes").

Spatial operations act on each frame alone; temporal ones are causal, frames before the first being
copies of it. Given a `state` dict, a temporal layer keeps there the last input frames its kernel
still needs and prepends them to the next chunk, so a chunked video gives the whole video's output.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Conv(nn.Module):
    """k x k spatial convolution with an optional causal temporal extent kt and temporal stride;
    weight (C_out, C_in, kt, k, k). kt == 1 on one frame runs conv2d (faster on CPU than conv3d)."""

    def __init__(
        self, c_in: int, c_out: int, k: int = 3, *, kt: int = 1, stride: int = 1, tstride: int = 1
    ):
        super().__init__()
        self.k, self.kt, self.stride, self.tstride = k, kt, stride, tstride
        self.weight = nn.Parameter(torch.empty(c_out, c_in, kt, k, k))
        self.bias = nn.Parameter(torch.empty(c_out))
        # PyTorch's default conv initialisation
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        bound = 1 / math.sqrt(c_in * kt * k * k)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        # x (B, C_in, T, H, W) -> (B, C_out, T', H / stride, W / stride)
        pad = self.k // 2
        if self.kt == 1 and self.tstride == 1:
            if x.shape[2] == 1:
                y = F.conv2d(x[:, :, 0], self.weight[:, :, 0], self.bias, self.stride, pad)
                return y.unsqueeze(2)
            return F.conv3d(x, self.weight, self.bias, (1, self.stride, self.stride), (0, pad, pad))
        if state is not None and self in state:
            prev = state[self]
        else:  # the first frame stands in for the frames before it
            prev = x[:, :, :1].expand(-1, -1, self.kt - 1, -1, -1)
        xp = torch.cat([prev, x], dim=2)  # (B, C, kt - 1 + T, H, W)
        if (xp.shape[2] - self.kt) % self.tstride:
            raise ValueError(
                f"temporal length {x.shape[2]} does not fit stride {self.tstride} "
                "(chunks must follow group boundaries)"
            )
        if state is not None:
            keep = max(self.kt - self.tstride, 0)
            state[self] = xp[:, :, xp.shape[2] - keep :].detach()
        return F.conv3d(
            xp, self.weight, self.bias, (self.tstride, self.stride, self.stride), (0, pad, pad)
        )


class FrameNorm(nn.GroupNorm):
    """GroupNorm over (C/g, H, W) of each frame: statistics never mix frames (causality)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        if t == 1:
            return super().forward(x[:, :, 0]).unsqueeze(2)
        y = super().forward(x.transpose(1, 2).reshape(b * t, c, h, w))
        return y.reshape(b, t, c, h, w).transpose(1, 2)


def norm(c: int) -> FrameNorm:
    """GroupNorm with >= 8 channels per group (at most 32 groups); one channel per group (InstanceNorm)
    would erase the colour of flat frames (docs/vq.md, "Two modes")."""
    groups = min(32, max(1, c // 8))
    while c % groups:
        groups -= 1
    return FrameNorm(groups, c, eps=1e-6)


class ResBlock(nn.Module):
    """norm -> SiLU -> conv -> norm -> SiLU -> conv, plus the input (1x1-projected if widths differ)."""

    def __init__(self, c_in: int, c_out: int, kt: int = 1):
        super().__init__()
        self.norm1, self.conv1 = norm(c_in), Conv(c_in, c_out, 3, kt=kt)
        self.norm2, self.conv2 = norm(c_out), Conv(c_out, c_out, 3, kt=kt)
        self.skip = Conv(c_in, c_out, 1) if c_in != c_out else None

    def forward(self, x: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)), state)
        h = self.conv2(F.silu(self.norm2(h)), state)
        return h + (self.skip(x) if self.skip is not None else x)


class Downsample(nn.Module):
    """Halve H and W with a stride-2 conv; with `temporal`, also 1 + 2n frames to 1 + n (frame 0
    alone to output 0, frames (2j - 2, 2j - 1, 2j) to output j)."""

    def __init__(self, c: int, temporal: bool):
        super().__init__()
        self.conv = Conv(c, c, 3, kt=3 if temporal else 1, stride=2, tstride=2 if temporal else 1)

    def forward(self, x: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        return self.conv(x, state)


class Upsample(nn.Module):
    """Double H and W (nearest, then conv); with `temporal`, also 1 + n frames to 1 + 2n: a causal
    conv emits two frames' channels per frame, laid out in time, and one frame for frame 0."""

    def __init__(self, c: int, temporal: bool):
        super().__init__()
        self.tconv = Conv(c, 2 * c, 3, kt=3) if temporal else None
        self.conv = Conv(c, c, 3)

    def forward(self, x: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        if self.tconv is not None:
            first = state is None or self.tconv not in state
            y = self.tconv(x, state)  # (B, 2C, T, H, W)
            b, c2, t, h, w = y.shape
            y = (
                y.view(b, 2, c2 // 2, t, h, w)
                .permute(0, 2, 3, 1, 4, 5)
                .reshape(b, c2 // 2, 2 * t, h, w)
            )
            x = y[:, :, 1:] if first else y
        if x.shape[2] == 1:
            x = F.interpolate(x[:, :, 0], scale_factor=2, mode="nearest").unsqueeze(2)
        else:
            x = F.interpolate(x, scale_factor=(1, 2, 2), mode="nearest")
        return self.conv(x, state)
