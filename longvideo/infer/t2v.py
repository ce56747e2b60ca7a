"""Text to video: VQ codes sampled with classifier-free guidance, then decoded (docs/generation.md).

A conditional prompt (the caption) and an unconditional one run as the two rows of one batched
forward, each row its own KV cache (the shorter prompt left-padded with invisible slots, every row
at its own positions); a step's logits are mixed as ``uncond + cfg * (cond - uncond)``, restricted
to what the slot allows (a code inside a frame; <eof> or <eov> at its end, or a forced id), and
sampled with temperature, top-k and top-p. Under torchrun the rows are sequence-parallel: the
sequence so far is ring-prefilled and sharded, the new tokens replicated, and re-sharded as they
grow, so a long video's KV cache is spread over the ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from longvideo.data.synthetic import write_mp4
from longvideo.data.templates import (
    CODE_SLOT,
    END_SLOT,
    LWM_TOP_K_IMAGE,
    LWM_TOP_K_VIDEO,
    generation_prompts,
    video_slots,
)
from longvideo.infer.chat import load_model
from longvideo.infer.generation import grown, new_cache
from longvideo.infer.sp import MergedAttentionSeam, SequenceParallelEngine
from longvideo.model import KVCache, Transformer
from longvideo.parallel import shard_sequence
from longvideo.vq import decode_codes

OUTPUT_EXTS = (".mp4", ".gif", ".png")
PNG_COLUMNS = 8
"""Frames per row of a PNG of several frames (a grid, left to right, then top to bottom)."""


@dataclass(frozen=True)
class Sampling:
    """How one slot's token is drawn from the guided logits: cfg_scale 1 is no guidance (the
    unconditional row is not run); temperature 0 or top_k 1 is greedy; top_k None or 0: no cut."""

    cfg_scale: float = 1.0
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}"
            )
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no cut), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def guided(cond: Tensor, uncond: Tensor | None, scale: float) -> Tensor:
    """Classifier-free guidance of logits: uncond + scale * (cond - uncond) (cond alone without
    an unconditional row)."""
    return cond if uncond is None else uncond + scale * (cond - uncond)


def allowed_ids(slot: int, vocab) -> tuple[int, int] | list[int]:
    """What a slot may take: a [start, stop) range of ids (the codes), or a list of ids."""
    if slot == CODE_SLOT:
        return (vocab.vq_offset, vocab.vq_offset + vocab.codebook_size)
    if slot == END_SLOT:
        return [vocab.eof, vocab.eov]
    return [slot]


def draw(logits: Tensor, s: Sampling, generator: torch.Generator | None) -> int:
    """One index of logits (n,): the argmax when greedy, else a sample of softmax(logits / T) among
    the top_k most likely (ties with the k-th kept), then the smallest set whose mass reaches
    top_p."""
    if s.greedy or logits.numel() == 1:
        return int(logits.argmax())
    x = logits.double() / s.temperature
    if s.top_k and s.top_k < x.numel():
        kth = torch.topk(x, s.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if s.top_p < 1:
        sp, order = p.sort(descending=True)
        sp = sp.masked_fill((sp.cumsum(0) - sp) >= s.top_p, 0.0)
        return int(order[torch.multinomial(sp, 1, generator=generator)])
    return int(torch.multinomial(p, 1, generator=generator))


def pick(logits: Tensor, slot: int, vocab, s: Sampling, generator) -> int:
    """The id of a slot from the mixed logits (V,) of the whole vocabulary."""
    allowed = allowed_ids(slot, vocab)
    if isinstance(allowed, tuple):
        return allowed[0] + draw(logits[allowed[0] : allowed[1]], s, generator)
    if len(allowed) == 1:
        return allowed[0]
    return allowed[draw(logits[allowed], s, generator)]


def left_pad(prompts: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of different lengths as (ids, positions, segment ids) (B, P): each row's tokens at the
    end at positions 0..n-1, the slots before them invisible (segment id -1)."""
    P = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    pos = torch.zeros_like(ids)
    seg = torch.full_like(ids, -1)
    for r, p in enumerate(prompts):
        n = len(p)
        ids[r, P - n :] = torch.tensor(list(p), dtype=torch.long)
        pos[r, P - n :] = torch.arange(n)
        seg[r, P - n :] = 0
    return ids, pos, seg


def _logits(model: Transformer, hidden: Tensor) -> Tensor:
    """The last position's logits (B, V), float32 (float64 for a float64 model)."""
    out = model.logits(hidden[:, -1:])[:, -1]
    return out.double() if out.dtype == torch.float64 else out.float()


class LocalRows:
    """The prompts as rows of one batched forward on this process, one KV cache row each."""

    def __init__(self, model: Transformer, *, prefill_chunk: int = 4096):
        self.model, self.chunk = model, prefill_chunk
        self.cache: KVCache | None = None

    @torch.no_grad()
    def start(self, prompts: Sequence[Sequence[int]], room: int) -> Tensor:
        """Prefill the rows (room: tokens fed after them); their last logits (B, V)."""
        dev = next(self.model.parameters()).device
        ids, pos, seg = (t.to(dev) for t in left_pad(prompts))
        self.cache = new_cache(self.model, ids.shape[0], ids.shape[1] + room)
        for s in range(0, ids.shape[1], self.chunk):
            h = self.model(
                ids[:, s : s + self.chunk],
                pos[:, s : s + self.chunk],
                seg[:, s : s + self.chunk],
                cache=self.cache,
            )
        return _logits(self.model, h)

    @torch.no_grad()
    def feed(self, ids: Tensor) -> Tensor:
        """ids (B, n) after the rows, each row at its own next positions; the last logits (B, V)."""
        ids = ids.to(next(self.model.parameters()).device)
        self.cache = grown(self.model, self.cache, self.cache.length + ids.shape[1], 256)
        return _logits(self.model, self.model(ids, cache=self.cache))

    def agree(self, tokens: Tensor) -> Tensor:
        return tokens


class ShardedRows(SequenceParallelEngine):
    """The rows over a sequence-parallel group (collective; every rank calls with the same ids): the
    sequence so far ring-prefilled and sharded (zigzag), the tokens after it replicated and merged
    exactly over the shards (longvideo.infer.sp), and sharded again when those exceed
    max(reshard_min, prefix / W) tokens, so that each rank holds about 2/W of the KV cache."""

    def __init__(self, model: Transformer, group=None, *, reshard_min: int = 1024, **kw):
        super().__init__(model, group, **kw)
        self.reshard_min = reshard_min
        self.rows: list[list[int]] = []
        self.reshards = 0

    def _shard(self) -> None:
        """Ring-prefill self.rows (the caller feeds at least one token after them)."""
        ids, pos, seg = (t.to(self._device) for t in left_pad(self.rows))
        B, P = ids.shape
        ids, pos = (shard_sequence(t, self.group, dim=1, pad_value=0) for t in (ids, pos))
        seg = shard_sequence(seg, self.group, dim=1, pad_value=-1)
        self.cache = new_cache(self.model, B, ids.shape[1] + self.spare)
        self.model(ids, pos, seg, cache=self.cache, attention_fn=self.ring)
        lengths = torch.tensor([len(r) for r in self.rows], device=self._device)
        self.next_pos = lengths.clone()
        # per row, the keys at positions >= its length are replicated: each counts on one rank only
        self.merged = MergedAttentionSeam(
            self.group, self.backend, shared_from=lengths[:, None], owner=self.rank == self.owner
        )
        self.prefix_len, self.local_prefix_len, self.sharded = P, ids.shape[1], P
        self.tail = 0

    @torch.no_grad()
    def start(self, prompts: Sequence[Sequence[int]], room: int) -> Tensor:
        self._device = next(self.model.parameters()).device
        self.spare = min(room, max(self.reshard_min, 256)) + 64
        self.rows = [list(p[:-1]) for p in prompts]
        self._shard()  # all but each row's last token, which is fed replicated
        last = torch.tensor([[p[-1]] for p in prompts], dtype=torch.long)
        return self.feed(last, reshard=False)

    @torch.no_grad()
    def feed(self, ids: Tensor, *, reshard: bool = True) -> Tensor:
        n = ids.shape[1]
        if reshard and self.tail + n > max(self.reshard_min, self.prefix_len // self.world):
            self._shard()  # the replicated tokens so far join the sharded prefix
            self.reshards += 1
        ids = ids.to(self._device)
        pos = self.next_pos[:, None] + torch.arange(n, device=self._device)
        self.cache = grown(self.model, self.cache, self.cache.length + n, self.spare)
        h = self.model(ids, pos, torch.zeros_like(ids), cache=self.cache, attention_fn=self.merged)
        self.next_pos += n
        self.tail += n
        for r, new in zip(self.rows, ids.tolist()):
            r.extend(new)
        return _logits(self.model, h)

    def agree(self, tokens: Tensor) -> Tensor:
        """Rank 0's tokens on every rank."""
        return self._pick(tokens.to(self._device)).cpu()


def sample_slots(
    rows,
    prompts: Sequence[Sequence[int]],
    slots: Sequence[int],
    vocab,
    s: Sampling,
    generators: Sequence[torch.Generator],
    *,
    on_token: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """The ids of `slots` (video_slots) for each of V = len(generators) videos, sampled after the
    prompts: the V conditional ones, then (guided: 2V prompts) the V unconditional ones. Each
    video's sampled ids are fed back, with the forced ones, before the next sampled slot; video v
    draws from generators[v] alone, so a batch samples what its videos would one by one. A video
    ends after an <eov> sampled at an END_SLOT."""
    V = len(generators)
    if len(prompts) not in (V, 2 * V):
        raise ValueError(f"{len(prompts)} prompts for {V} videos: give V or 2V")
    guide = len(prompts) == 2 * V
    logits = rows.start(prompts, room=len(slots))
    out: list[list[int]] = [[] for _ in range(V)]
    done = torch.zeros(V, dtype=torch.bool)
    pending: list[Tensor] = []
    for slot in slots:
        if slot >= 0:
            tokens = torch.full((V,), slot, dtype=torch.long)
        else:
            if pending:
                fed = torch.stack(pending, 1)
                logits = rows.feed(torch.cat([fed, fed]) if guide else fed)
                pending = []
            mixed = guided(logits[:V], logits[V:] if guide else None, s.cfg_scale)
            tokens = torch.tensor(
                [pick(mixed[v], slot, vocab, s, generators[v]) for v in range(V)], dtype=torch.long
            )
            tokens = rows.agree(tokens)
            if on_token is not None:
                on_token(int((~done).sum()))
        for v in range(V):
            if not done[v]:
                out[v].append(int(tokens[v]))
        pending.append(tokens)
        if slot == END_SLOT:
            done |= tokens == vocab.eov
            if bool(done.all()):
                break
    return out


@dataclass
class GeneratedVideo:
    """codes int64 (G, h, w); frames uint8 (T, H, W, 3) (None when not decoded); ids: every
    generated id after the conditional prompt (forced ones too); prompt_ids: the conditional and the
    unconditional prompt (of the last phase: LWM's video prompt after its first frame's); seconds:
    the sampling time of the call that made it, which sampled `batch` videos together."""

    codes: np.ndarray
    frames: torch.Tensor | None
    ids: list[int]
    prompt_ids: tuple[list[int], list[int]]
    seconds: float
    fps: float
    batch: int = 1
    reshards: int = 0
    """Sequence-parallel only: how often the replicated tokens were sharded again."""

    @property
    def tokens_per_s(self) -> float:
        """Generated ids a second over the call (all of its `batch` videos)."""
        return self.batch * len(self.ids) / max(self.seconds, 1e-9)


def codes_of(ids: Sequence[int], vocab, codes_per_group: int, side: int) -> np.ndarray:
    """The codes (G, side, side) in generated ids: runs of codes_per_group code ids."""
    lo, hi = vocab.vq_offset, vocab.vq_offset + vocab.codebook_size
    codes = [i - lo for i in ids if lo <= i < hi]
    if len(codes) % codes_per_group:
        raise ValueError(f"{len(codes)} codes are not whole groups of {codes_per_group}")
    return np.asarray(codes, np.int64).reshape(-1, side, side)


@torch.no_grad()
def generate_video(model, prompt: str, **settings) -> GeneratedVideo:
    """Sample one video from `prompt` (generate_videos' settings; its seed is this video's)."""
    return generate_videos(model, [prompt], **settings)[0]


@torch.no_grad()
def generate_videos(
    model,
    prompts: Sequence[str],
    *,
    frames: int = 1,
    cfg_scale: float = 1.0,
    cfg_scale_video: float | None = None,
    top_k: int | None = None,
    top_p: float = 1.0,
    temperature: float = 1.0,
    seed: int | Sequence[int] = 0,
    model_ends: bool = False,
    decode: bool = True,
    group=None,
    reshard_min: int = 1024,
    backend: str = "auto",
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> list[GeneratedVideo]:
    """Sample a video of `frames` frames from each prompt, all in one batched forward (video i with
    seed + i, or with seed[i] given a list: the same video as alone with that seed;
    docs/generation.md). model: a `Pretrained` or
    a directory. A model of LWM's layout follows LWM's script: the first frame from its image prompt
    (top_k default 8192), the others after its video prompt and the first frame's tokens
    (cfg_scale_video, default cfg_scale; top_k default 100), every frame ending with <eof>; other
    models put the caption before the video as the caption template does (top_k default: none),
    frames ending with <eof> and the last with <eov> (model_ends: the model may end it earlier).
    cfg_scale 1 runs no unconditional row. group: a process group to sample sequence-parallel over
    (every rank calls alike)."""
    pre = load_model(model, device)
    if pre.tokenizer is None:
        raise ValueError(f"{pre.path or 'the model'} has no text tokenizer (tokenizer/)")
    if pre.vq is None and decode:
        raise ValueError(f"{pre.path or 'the model'} has no video tokenizer (vq/) to decode frames")
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    if not prompts:
        raise ValueError("no prompts")
    net, vocab, tok, cfg = pre.model, pre.model.cfg.vocab, pre.tokenizer, pre.config
    vq_cfg = pre.vq.cfg if pre.vq is not None else cfg.vq
    side = vq_cfg.resolution // vq_cfg.downsample
    per_group = side * side
    if vocab.codebook_size != vq_cfg.codebook_size:
        raise ValueError(
            f"the model has {vocab.codebook_size} codes, its VQ {vq_cfg.codebook_size}"
        )
    groups = _num_groups(vq_cfg, frames)
    lwm = vocab.is_lwm
    fps = 4.0 if lwm else cfg.data.fps  # LWM's script writes 4 fps; ours: a group per 1/fps s
    seeds = [seed + i for i in range(len(prompts))] if isinstance(seed, int) else list(seed)
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    engines: list = []

    def run(pairs, slots, samp: Sampling) -> list[list[int]]:
        rows = (
            LocalRows(net, prefill_chunk=cfg.infer.prefill_chunk)
            if group is None
            else ShardedRows(net, group, reshard_min=reshard_min, backend=backend)
        )
        engines.append(rows)
        conds = [c for c, _ in pairs]
        guide = samp.cfg_scale != 1.0
        return sample_slots(
            rows,
            conds + ([u for _, u in pairs] if guide else []),
            slots,
            vocab,
            samp,
            gens,
            on_token=bar.update,
        )

    bar = tqdm(
        total=len(prompts) * groups * per_group, unit="code", desc="generate", disable=not progress
    )
    t0 = time.perf_counter()
    if lwm:
        pairs = [generation_prompts(tok, vocab, p, template="lwm", video=False) for p in prompts]
        k = LWM_TOP_K_IMAGE if top_k is None else top_k
        first = video_slots(tok, vocab, groups=1, codes_per_group=per_group)
        ids = run(pairs, first, Sampling(cfg_scale, temperature, k, top_p))
        if groups > 1:  # the other frames after LWM's video prompt and the first frame
            video = [generation_prompts(tok, vocab, p, template="lwm", video=True) for p in prompts]
            pairs = [(c + i, u + i) for (c, u), i in zip(video, ids)]
            samp = Sampling(
                cfg_scale if cfg_scale_video is None else cfg_scale_video,
                temperature,
                LWM_TOP_K_VIDEO if top_k is None else top_k,
                top_p,
            )
            rest = video_slots(tok, vocab, groups=groups - 1, codes_per_group=per_group)
            ids = [a + b for a, b in zip(ids, run(pairs, rest, samp))]
    else:
        pairs = [generation_prompts(tok, vocab, p, template="qa") for p in prompts]
        stamps = [g[0] / fps for g in _group_frames(vq_cfg, frames)]
        slots = video_slots(
            tok,
            vocab,
            groups=groups,
            codes_per_group=per_group,
            timestamps=stamps,
            timestamp_every=cfg.data.timestamp_every,
            model_ends=model_ends,
        )
        ids = run(pairs, slots, Sampling(cfg_scale, temperature, top_k, top_p))
    seconds = time.perf_counter() - t0
    bar.close()
    out = []
    for (cond, uncond), got in zip(pairs, ids):
        codes = codes_of(got, vocab, per_group, side)
        video = None
        if decode:
            video = decode_codes(pre.vq, codes)
            if len(codes) == groups:  # causal3d: the last group's padding frames dropped
                video = video[:frames]
        out.append(
            GeneratedVideo(
                codes=codes,
                frames=video,
                ids=got,
                prompt_ids=(list(cond), list(uncond)),
                seconds=seconds,
                fps=fps,
                batch=len(prompts),
                reshards=sum(getattr(e, "reshards", 0) for e in engines),
            )
        )
    return out


def _group_frames(vq_cfg, frames: int) -> list[list[int]]:
    """The frames each code group covers: one each in 2d mode; causal3d: frame 0, then t a group."""
    if vq_cfg.mode == "2d":
        return [[i] for i in range(frames)]
    t = vq_cfg.frames_per_group
    return [[0], *[list(range(s, min(s + t, frames))) for s in range(1, frames, t)]]


def _num_groups(vq_cfg, frames: int) -> int:
    return len(_group_frames(vq_cfg, frames))


# ----------------------------------------------------------------------------- files


def frame_grid(frames: np.ndarray, columns: int = PNG_COLUMNS) -> np.ndarray:
    """Frames (T, H, W, 3) as one image: up to `columns` a row, left to right, then top to bottom,
    no gaps; the empty places of the last row black."""
    T, H, W, _ = frames.shape
    cols = min(T, columns)
    rows = -(-T // cols)
    grid = np.zeros((rows * H, cols * W, 3), np.uint8)
    for i, f in enumerate(frames):
        r, c = divmod(i, cols)
        grid[r * H : (r + 1) * H, c * W : (c + 1) * W] = f
    return grid


def write_frames(frames, path: str | Path, fps: float) -> Path:
    """Frames uint8 (T, H, W, 3) to an mp4 (H.264, PyAV), a GIF (Pillow, looping) or a PNG (one
    frame as it is; several as a grid, `frame_grid`), by the path's extension."""
    from PIL import Image

    path = Path(path)
    arr = np.asarray(frames.cpu() if hasattr(frames, "cpu") else frames)
    if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[-1] != 3 or not len(arr):
        raise ValueError(f"frames must be uint8 (T, H, W, 3), got {arr.dtype} {arr.shape}")
    ext = path.suffix.lower()
    if ext not in OUTPUT_EXTS:
        raise ValueError(f"--out must end with one of {', '.join(OUTPUT_EXTS)}, got {path.name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if ext == ".mp4":
        write_mp4([arr], fps, path)
    elif ext == ".gif":
        images = [Image.fromarray(f) for f in arr]
        images[0].save(
            path,
            save_all=True,
            append_images=images[1:],
            duration=max(1, int(round(1000 / fps))),
            loop=0,
        )
    else:
        Image.fromarray(arr[0] if len(arr) == 1 else frame_grid(arr)).save(path)
    return path
