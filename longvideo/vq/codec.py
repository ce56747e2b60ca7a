"""uint8 frames <-> codes, batched and streaming.

    codes = encode_video(vq, frames)           # frames uint8 (T, H, W, 3) or an iterable of chunks
    frames = decode_codes(vq, codes)           # codes (G, h, w) -> uint8 (T', H, W, 3)

Memory: encoding holds at most `batch_frames` input frames (plus, in causal3d, the few frames of
carry each temporal convolution keeps) whatever the video's length; only the codes accumulate.
In causal3d the video is cut after frame 0 and then on group boundaries (multiples of t), so the
codes are those of the whole video encoded at once. Encoding runs the model in eval mode under
no_grad and is deterministic.
"""

from __future__ import annotations

from itertools import chain, repeat
from typing import Iterable, Iterator, Union

import numpy as np
import torch

from longvideo.vq.model import VQModel

Frames = Union[torch.Tensor, np.ndarray, Iterable[Union[torch.Tensor, np.ndarray]]]


class _EvalMode:
    """Run a block in eval mode, then restore the module's mode (training must not see EMA updates)."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.was_training = module, module.training

    def __enter__(self):
        self.module.eval()

    def __exit__(self, *exc):
        self.module.train(self.was_training)


def _device(vq: VQModel) -> torch.device:
    return next(vq.parameters()).device


def _check_frames(chunk, res: int) -> torch.Tensor:
    if isinstance(chunk, np.ndarray):
        chunk = torch.from_numpy(chunk)
    if not isinstance(chunk, torch.Tensor):
        raise ValueError(f"expected frames as a uint8 tensor or array, got {type(chunk).__name__}")
    if chunk.ndim == 3:  # one frame
        chunk = chunk.unsqueeze(0)
    if chunk.dtype != torch.uint8 or chunk.ndim != 4 or tuple(chunk.shape[1:]) != (res, res, 3):
        raise ValueError(f"expected uint8 frames (T, {res}, {res}, 3), got {chunk.dtype} "
                         f"{tuple(chunk.shape)}")
    return chunk


def _chunks(frames: Frames, res: int) -> Iterator[torch.Tensor]:
    if isinstance(frames, (torch.Tensor, np.ndarray)):
        yield _check_frames(frames, res)
        return
    for chunk in frames:
        yield _check_frames(chunk, res)


def frames_to_input(frames: torch.Tensor, device, *, as_clip: bool) -> torch.Tensor:
    """uint8 (T, H, W, 3) -> float in [-1, 1]: (1, 3, T, H, W) as one clip, else (T, 3, 1, H, W)."""
    x = frames.to(device, non_blocking=True).float().div_(127.5).sub_(1.0)
    if as_clip:
        return x.permute(3, 0, 1, 2).unsqueeze(0)
    return x.permute(0, 3, 1, 2).unsqueeze(2)


def output_to_frames(x: torch.Tensor) -> torch.Tensor:
    """float (B, 3, T, H, W) in [-1, 1] -> uint8 (B * T, H, W, 3) on the CPU."""
    x = x.clamp(-1, 1).add(1).mul(127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 4, 1).reshape(-1, *x.shape[3:], 3).cpu()


def _pieces(chunks: Iterator[torch.Tensor], sizes: Iterator[int]) -> Iterator[torch.Tensor]:
    """Regroup a stream of frame chunks into pieces of the requested sizes (the last may be short)."""
    buf: list[torch.Tensor] = []
    have = 0
    need = next(sizes)
    for chunk in chunks:
        while chunk.shape[0]:
            take = min(need - have, chunk.shape[0])
            buf.append(chunk[:take])
            have += take
            chunk = chunk[take:]
            if have == need:
                yield torch.cat(buf) if len(buf) > 1 else buf[0]
                buf, have, need = [], 0, next(sizes)
    if have:
        yield torch.cat(buf) if len(buf) > 1 else buf[0]


@torch.no_grad()
def encode_video(vq: VQModel, frames: Frames, *, batch_frames: int = 16) -> torch.Tensor:
    """Codes of a video: LongTensor (G, h, w) on the CPU.

    frames: uint8 (T, H, W, 3) with H = W = vq.cfg.resolution, or an iterable of such chunks
    (any chunk lengths). G = T in 2d mode; in causal3d G = 1 + ceil((T - 1) / t), the last
    group padded by repeating the last frame. At most `batch_frames` frames are encoded at once
    (causal3d needs batch_frames >= t).
    """
    cfg = vq.cfg
    if batch_frames < 1:
        raise ValueError(f"batch_frames must be >= 1, got {batch_frames}")
    t = cfg.frames_per_group
    if batch_frames < t:
        raise ValueError(f"batch_frames must be >= temporal_downsample={t} in causal3d mode, "
                         f"got {batch_frames}")
    device = _device(vq)
    stream = _chunks(frames, cfg.resolution)
    out: list[torch.Tensor] = []
    with _EvalMode(vq):
        if cfg.mode == "2d":
            for piece in _pieces(stream, repeat(batch_frames)):
                _, codes, _ = vq.encode(frames_to_input(piece, device, as_clip=False))
                out.append(codes[:, 0].cpu())  # (n, h, w)
        else:
            state: dict = {}
            # frame 0 plus whole groups, then whole groups
            sizes = chain([1 + ((batch_frames - 1) // t) * t], repeat((batch_frames // t) * t))
            is_first = True
            for piece in _pieces(stream, sizes):
                n = piece.shape[0]
                short = (t - (n - (1 if is_first else 0)) % t) % t
                if short:  # the video ended inside a group: repeat its last frame
                    piece = torch.cat([piece, piece[-1:].expand(short, -1, -1, -1)])
                _, codes, _ = vq.encode(frames_to_input(piece, device, as_clip=True), state)
                out.append(codes[0].cpu())  # (g, h, w)
                is_first = False
    if not out:
        return torch.zeros(0, cfg.latent_size, cfg.latent_size, dtype=torch.long)
    return torch.cat(out)


def _check_codes(vq: VQModel, codes) -> torch.Tensor:
    if isinstance(codes, np.ndarray):
        codes = torch.from_numpy(codes)
    h = vq.cfg.latent_size
    if (not isinstance(codes, torch.Tensor) or codes.ndim != 3 or tuple(codes.shape[1:]) != (h, h)
            or codes.dtype.is_floating_point or codes.dtype == torch.bool):
        got = f"{codes.dtype} {tuple(codes.shape)}" if hasattr(codes, "shape") else type(codes).__name__
        raise ValueError(f"expected integer codes (G, {h}, {h}), got {got}")
    return codes.long()


@torch.no_grad()
def iter_decode(vq: VQModel, codes, *, batch_groups: int = 16) -> Iterator[torch.Tensor]:
    """Decode codes (G, h, w) chunk by chunk; yields uint8 frame chunks (n, H, W, 3) on the CPU."""
    if batch_groups < 1:
        raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
    codes = _check_codes(vq, codes)
    device = _device(vq)
    state: dict = {}
    with _EvalMode(vq):
        for g in range(0, codes.shape[0], batch_groups):
            part = codes[g: g + batch_groups].to(device)
            if vq.cfg.mode == "2d":
                z = vq.codes_to_latents(part.unsqueeze(1))  # (n, D, 1, h, w)
                yield output_to_frames(vq.decode(z))
            else:
                z = vq.codes_to_latents(part.unsqueeze(0))  # (1, D, n, h, w)
                yield output_to_frames(vq.decode(z, state))


def decode_codes(vq: VQModel, codes, *, batch_groups: int = 16) -> torch.Tensor:
    """Frames of codes (G, h, w): uint8 (T', H, W, 3); T' = G in 2d, 1 + t (G - 1) in causal3d.

    In causal3d the frames of a padded last group are included; trim to the source length with
    `vq.group_frame_index(T)` when it is known.
    """
    parts = list(iter_decode(vq, codes, batch_groups=batch_groups))
    if not parts:
        r = vq.cfg.resolution
        return torch.zeros(0, r, r, 3, dtype=torch.uint8)
    return torch.cat(parts)
