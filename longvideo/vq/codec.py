"""uint8 frames <-> codes, batched and streaming (docs/vq.md, "Python API"). Encoding holds at most
`batch_frames` frames (plus the causal3d carries); in causal3d the video is cut after frame 0 and
then on group boundaries, so the codes are those of the whole video at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from itertools import chain, repeat

import numpy as np
import torch

from longvideo.vq.model import VQModel

Frames = torch.Tensor | np.ndarray | Iterable[torch.Tensor | np.ndarray]


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Run a block in eval mode, then restore the module's mode (encoding must make no EMA updates)."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def _check_frames(chunk, res: int) -> torch.Tensor:
    if isinstance(chunk, np.ndarray):
        chunk = torch.from_numpy(chunk)
    if not isinstance(chunk, torch.Tensor):
        raise ValueError(f"expected frames as a uint8 tensor or array, got {type(chunk).__name__}")
    if chunk.ndim == 3:  # one frame
        chunk = chunk.unsqueeze(0)
    if chunk.dtype != torch.uint8 or chunk.ndim != 4 or tuple(chunk.shape[1:]) != (res, res, 3):
        raise ValueError(
            f"expected uint8 frames (T, {res}, {res}, 3), got {chunk.dtype} {tuple(chunk.shape)}"
        )
    return chunk


def _chunks(frames: Frames, res: int) -> Iterator[torch.Tensor]:
    whole = isinstance(frames, (torch.Tensor, np.ndarray))
    return (_check_frames(chunk, res) for chunk in ([frames] if whole else frames))


def frames_to_input(frames: torch.Tensor, device, *, as_clip: bool) -> torch.Tensor:
    """uint8 (T, H, W, 3) -> float in [-1, 1]: (1, 3, T, H, W) as one clip, else (T, 3, 1, H, W);
    clips (B, L, H, W, 3) -> (B, 3, L, H, W)."""
    x = frames.to(device, non_blocking=True).float().div_(127.5).sub_(1.0)
    if as_clip:
        x = x.movedim(-1, -4)
        return x if x.ndim == 5 else x.unsqueeze(0)
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


def _piece_sizes(cfg, batch_frames: int) -> Iterator[int]:
    """Frames per encoder call: in causal3d, frame 0 plus whole groups, then whole groups (so the
    pieces cut the video on group boundaries, and the codes equal those of one whole-clip call)."""
    t = cfg.frames_per_group  # 1 in 2d: batch_frames each time
    return chain([1 + ((batch_frames - 1) // t) * t], repeat((batch_frames // t) * t))


def _encode_piece(vq: VQModel, piece: torch.Tensor, state: dict, is_first: bool) -> torch.Tensor:
    """Codes (g, h, w) of one piece (uint8 (n, H, W, 3)); causal3d carries its temporal context
    in `state` from piece to piece, and a video ending inside a group repeats its last frame."""
    device = next(vq.parameters()).device
    if vq.cfg.mode == "2d":
        _, codes, _ = vq.encode(frames_to_input(piece, device, as_clip=False))
        return vq.emit(codes[:, 0]).cpu()
    t = vq.cfg.frames_per_group
    short = (t - (piece.shape[0] - (1 if is_first else 0)) % t) % t
    if short:
        piece = torch.cat([piece, piece[-1:].expand(short, -1, -1, -1)])
    _, codes, _ = vq.encode(frames_to_input(piece, device, as_clip=True), state)
    return vq.emit(codes[0]).cpu()


def _check_batch(vq: VQModel, batch_frames: int) -> None:
    if batch_frames < 1:
        raise ValueError(f"batch_frames must be >= 1, got {batch_frames}")
    t = vq.cfg.frames_per_group
    if batch_frames < t:
        raise ValueError(
            f"batch_frames must be >= temporal_downsample={t} in causal3d mode, got {batch_frames}"
        )


def _empty_codes(vq: VQModel) -> torch.Tensor:
    h = vq.cfg.latent_size
    return torch.zeros(0, h, h, dtype=torch.long)


@torch.no_grad()
def encode_video(vq: VQModel, frames: Frames, *, batch_frames: int = 16) -> torch.Tensor:
    """Codes of a video, LongTensor (G, h, w) on the CPU, from uint8 frames (T, R, R, 3) or an
    iterable of such chunks: G = T in 2d, 1 + ceil((T - 1) / t) in causal3d (the last group padded by
    repeating the last frame). At most `batch_frames` (>= t in causal3d) are encoded at once."""
    _check_batch(vq, batch_frames)
    state: dict = {}
    # one buffer that doubles when full instead of a list of small per-piece tensors: thousands of
    # small blocks kept alive between the pieces' large temporaries fragment the heap, and the
    # process grows with the video's length though the codes themselves are a few KB a second
    codes, n = _empty_codes(vq), 0
    with eval_mode(vq):
        for i, piece in enumerate(
            _pieces(_chunks(frames, vq.cfg.resolution), _piece_sizes(vq.cfg, batch_frames))
        ):
            c = _encode_piece(vq, piece, state, i == 0)
            if n + c.shape[0] > codes.shape[0]:
                codes = torch.cat(
                    [codes[:n], codes.new_empty((max(n, 64, c.shape[0]),) + codes.shape[1:])]
                )
            codes[n : n + c.shape[0]] = c
            n += c.shape[0]
    return codes[:n].clone()


class SplicingEncoder:
    """Codes of one video with a few frames replaced, without encoding it all again (docs/vq.md,
    "Splicing"): `SplicingEncoder(vq, frames).codes_with({k: frame})` equals encode_video of the edited
    video bitwise. In causal3d, encoding resumes from the context saved before the first edited piece
    and stops where the context equals the original's again."""

    @torch.no_grad()
    def __init__(self, vq: VQModel, frames: torch.Tensor, *, batch_frames: int = 16):
        _check_batch(vq, batch_frames)
        self.vq, self.frames = vq, _check_frames(frames, vq.cfg.resolution)
        self.starts: list[int] = []  # first frame of each piece
        self.contexts: list[dict] = []  # the temporal context before each piece
        self.piece_codes: list[torch.Tensor] = []
        sizes, start, state = _piece_sizes(vq.cfg, batch_frames), 0, {}
        with eval_mode(vq):
            while start < self.frames.shape[0]:
                n = next(sizes)
                self.starts.append(start)
                self.contexts.append({k: v.clone() for k, v in state.items()})
                self.piece_codes.append(
                    _encode_piece(vq, self.frames[start : start + n], state, start == 0)
                )
                start += n
        self.starts.append(self.frames.shape[0])
        self.codes = torch.cat(self.piece_codes) if self.piece_codes else _empty_codes(vq)

    @torch.no_grad()
    def codes_with(self, replace: dict[int, torch.Tensor | np.ndarray]) -> torch.Tensor:
        """Codes (G, h, w) of the video with frames {index: uint8 (H, W, 3)} replaced."""
        if not replace:
            return self.codes.clone()
        T = self.frames.shape[0]
        bad = [k for k in replace if not 0 <= k < T]
        if bad:
            raise IndexError(f"frames {bad} are outside the video's {T} frames")
        edited = self.frames.clone()
        for k, frame in replace.items():
            edited[k] = torch.as_tensor(frame, dtype=torch.uint8)
        if self.vq.cfg.mode == "2d":
            keys = sorted(replace)
            codes = self.codes.clone()
            with eval_mode(self.vq):
                codes[keys] = _encode_piece(self.vq, edited[keys], {}, False)
            return codes
        first = min(replace)
        p = next(i for i in range(len(self.piece_codes)) if self.starts[i + 1] > first)
        state = {k: v.clone() for k, v in self.contexts[p].items()}
        parts = self.piece_codes[:p]
        last_edit = max(replace)
        with eval_mode(self.vq):
            while p < len(self.piece_codes):
                a, b = self.starts[p], self.starts[p + 1]
                parts.append(_encode_piece(self.vq, edited[a:b], state, a == 0))
                p += 1
                if (
                    b > last_edit
                    and p < len(self.piece_codes)
                    and _same_context(state, self.contexts[p])
                ):
                    parts += self.piece_codes[
                        p:
                    ]  # the edit no longer reaches: the rest is unchanged
                    break
        return torch.cat(parts)


def _same_context(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _check_codes(vq: VQModel, codes) -> torch.Tensor:
    if isinstance(codes, np.ndarray):
        codes = torch.from_numpy(codes)
    h = vq.cfg.latent_size
    if (
        not isinstance(codes, torch.Tensor)
        or codes.ndim != 3
        or tuple(codes.shape[1:]) != (h, h)
        or codes.dtype.is_floating_point
        or codes.dtype == torch.bool
    ):
        got = (
            f"{codes.dtype} {tuple(codes.shape)}"
            if hasattr(codes, "shape")
            else type(codes).__name__
        )
        raise ValueError(f"expected integer codes (G, {h}, {h}), got {got}")
    return codes.long()


@torch.no_grad()
def iter_decode(vq: VQModel, codes, *, batch_groups: int = 16) -> Iterator[torch.Tensor]:
    """Decode codes (G, h, w) chunk by chunk; yields uint8 frame chunks (n, H, W, 3) on the CPU."""
    if batch_groups < 1:
        raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
    codes = _check_codes(vq, codes)
    device = next(vq.parameters()).device
    state: dict = {}
    with eval_mode(vq):
        for g in range(0, codes.shape[0], batch_groups):
            part = codes[g : g + batch_groups].to(device)
            # 2d: n one-group clips (n, D, 1, h, w), which keep no state; causal3d: one clip (1, D, n, h, w)
            z = vq.codes_to_latents(part.unsqueeze(1 if vq.cfg.mode == "2d" else 0))
            yield output_to_frames(vq.decode(z, state))


def decode_codes(vq: VQModel, codes, *, batch_groups: int = 16) -> torch.Tensor:
    """Frames of codes (G, h, w): uint8 (T', H, W, 3); T' = G in 2d, 1 + t (G - 1) in causal3d, a
    padded last group included (`vq.group_frame_index(T)` trims to a known source length)."""
    parts = list(iter_decode(vq, codes, batch_groups=batch_groups))
    if not parts:
        r = vq.cfg.resolution
        return torch.zeros(0, r, r, 3, dtype=torch.uint8)
    return torch.cat(parts)
