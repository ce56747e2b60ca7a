"""Answering questions about a video: read -> VQ-encode (streaming) -> prompt -> prefill -> generate
(docs/inference.md, "Chat" and "Python API").
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from longvideo.checkpoint import Pretrained, load_pretrained
from longvideo.data.codes import video_to_codes
from longvideo.data.templates import Prompt, PromptOptions, build_prompt, uniform_keep
from longvideo.data.video import EmptyVideoError, probe_video, sample_indices
from longvideo.distributed import broadcast_array
from longvideo.infer.config import InferConfig
from longvideo.infer.generation import Engine, Generation, LocalEngine, trim_at_stop

QUESTION_RESERVE = 64
"""Tokens kept free for a question when the video is fitted to the context before one is known."""


class ContextWarning(UserWarning):
    """The video was sampled at a lower fps than asked so that it fits the model's context."""


@dataclass
class EncodedVideo:
    """A video as the language model sees it: codes int64 (G, h, w), timestamps float64 (G,) (the
    seconds of each group's first frame), the frames read, the video's duration in seconds, and the
    fps actually sampled (lower than asked when the context forced it)."""

    codes: np.ndarray
    timestamps: np.ndarray
    num_frames: int
    duration: float
    fps: float


def load_model(model, device: str | torch.device = "cpu") -> Pretrained:
    """A `Pretrained` (model, config, tokenizer, vq) from itself or a directory (longvideo.checkpoint)."""
    if isinstance(model, (str, Path)):
        return load_pretrained(model, device=device)
    return model


def _require(pretrained, what: str):
    obj = getattr(pretrained, what, None)
    if obj is None:
        name = "VQ video tokenizer (vq/)" if what == "vq" else "text tokenizer"
        where = getattr(pretrained, "path", None) or "the model"
        raise ValueError(f"{where} has no {name}; it cannot answer questions about videos")
    return obj


def prompt_of(
    pretrained,
    codes: np.ndarray,
    timestamps: np.ndarray,
    question: str,
    history: Sequence[tuple[str, str]] = (),
) -> Prompt:
    """The QA prompt (training template) for one question after the earlier turns `history`,
    ending where the answer starts."""
    tok = _require(pretrained, "tokenizer")
    return build_prompt(
        tok,
        pretrained.model.cfg.vocab,
        codes,
        timestamps,
        question,
        PromptOptions.from_config(pretrained.config.data),
        history,
    )


def groups_that_fit(length_of: Callable[[int], int], num_groups: int, budget: int) -> int:
    """Largest g <= num_groups with length_of(g) <= budget (length_of increases with g); 0 if none."""
    if length_of(num_groups) <= budget:  # the common case: one prompt built, not log2(G)
        return num_groups
    return max(0, bisect.bisect_right(range(num_groups), budget, key=length_of) - 1)


def fit_frames(
    pretrained,
    num_frames: int,
    question: str | None,
    max_new_tokens: int,
    duration: float = 0.0,
    history: Sequence[tuple[str, str]] = (),
) -> int:
    """How many of `num_frames` frames (spread over `duration` seconds) fit the context with the
    question after `history` (QUESTION_RESERVE tokens when it is not known yet) and the answer."""
    vq = _require(pretrained, "vq")
    side = vq.cfg.resolution // vq.cfg.downsample
    reserve = QUESTION_RESERVE if question is None else 0

    def length(n: int) -> int:
        g = len(vq.group_frame_index(n))
        dummy = np.zeros((g, side, side), np.int64)
        times = np.linspace(
            0.0, max(duration, float(g)), g, endpoint=False
        )  # timestamp text grows with t
        return len(prompt_of(pretrained, dummy, times, question or "", history).ids) + reserve

    return groups_that_fit(length, num_frames, pretrained.model.cfg.max_seq_len - max_new_tokens)


def fit_codes(
    pretrained, codes: np.ndarray, timestamps: np.ndarray, question: str, max_new_tokens: int
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Drop code groups uniformly over the video until the prompt fits the context.
    Returns the kept codes, their timestamps and the kept group indices."""
    G = codes.shape[0]

    def length(g: int) -> int:
        keep = uniform_keep(G, g)
        return len(prompt_of(pretrained, codes[keep], timestamps[keep], question).ids)

    g = groups_that_fit(length, G, pretrained.model.cfg.max_seq_len - max_new_tokens)
    if g == 0:
        raise ValueError(
            f"the question alone does not fit the context of {pretrained.model.cfg.max_seq_len} "
            f"tokens"
        )
    keep = uniform_keep(G, g)
    return codes[keep], timestamps[keep], keep


def encode_video_file(
    pretrained,
    video,
    *,
    fps: float = 1.0,
    max_frames: int | None = None,
    question: str | None = None,
    max_new_tokens: int = 64,
    batch_frames: int = 16,
    progress: bool = True,
    history: Sequence[tuple[str, str]] = (),
    on_frames: Callable | None = None,
) -> EncodedVideo:
    """Decode `video` (path or bytes) at `fps`, fitted to the context (with the question after
    `history`), and VQ-encode it in batches; on_frames sees the frames (longvideo.data.codes).
    Raises longvideo.data.video.VideoError (or a subclass) for a missing or unreadable video."""
    vq = _require(pretrained, "vq")
    info = probe_video(video)
    wanted = len(sample_indices(info.num_frames, info.fps, fps, max_frames))
    if wanted == 0:
        where = "<bytes>" if isinstance(video, (bytes, bytearray)) else str(video)
        raise EmptyVideoError("no frames to read", where)
    duration = info.duration if info.duration > 0 else info.num_frames / max(info.fps, 1e-9)
    n = fit_frames(pretrained, wanted, question, max_new_tokens, duration, history)
    if n == 0:
        raise ValueError(
            f"not even one frame fits the context of {pretrained.model.cfg.max_seq_len} tokens"
        )
    # max_frames or the context may thin the sampling out: report the rate actually taken
    full = len(sample_indices(info.num_frames, info.fps, fps, None))
    effective = min(fps, info.fps) if n == full else n / duration
    if n < wanted:
        warnings.warn(
            f"the video ({duration:.1f} s) at {fps:g} fps gives {wanted} frames, more than the "
            f"context of {pretrained.model.cfg.max_seq_len} tokens holds with the question and "
            f"{max_new_tokens} answer tokens; sampling {n} frames over the whole video instead "
            f"(effective fps {effective:.4g})",
            ContextWarning,
            stacklevel=2,
        )
    vc = video_to_codes(
        vq,
        video,
        fps=fps,
        max_frames=n,
        batch_frames=batch_frames,
        progress=progress,
        total_frames=n,
        on_frames=on_frames,
    )
    if vc.report.describe():
        warnings.warn(
            f"the video is partly unreadable ({vc.report.describe()}); answering about what was "
            f"read",
            stacklevel=2,
        )
    return EncodedVideo(
        codes=vc.codes,
        timestamps=vc.timestamps,
        num_frames=vc.num_frames,
        duration=float(duration),
        fps=float(effective),
    )


def share_video(video: EncodedVideo | None, group=None) -> EncodedVideo:
    """The encoded video of `group`'s rank 0 on every rank of it (tensors, no pickling); collective."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    parts = (
        (None,) * 3
        if video is None
        else (
            video.codes,
            video.timestamps,
            np.asarray([video.num_frames, video.duration, video.fps]),
        )
    )
    codes, stamps, meta = (broadcast_array(x, src=src, group=group) for x in parts)
    return EncodedVideo(
        codes=codes,
        timestamps=stamps,
        num_frames=int(meta[0]),
        duration=float(meta[1]),
        fps=float(meta[2]),
    )


def generate_answer(
    pretrained,
    engine: Engine,
    ids: Sequence[int],
    infer: InferConfig,
    generator: torch.Generator | None = None,
) -> tuple[str, Generation]:
    """Generate after the engine's prefix and `ids` up to the end of sequence; the answer's text.
    Only LWM's layout restricts the answer's ids (Vocab.answer_limit): other engines need not know it."""
    tok, limit = _require(pretrained, "tokenizer"), pretrained.model.cfg.vocab.answer_limit
    stop = [tok.eos_id] if tok.eos_id is not None else []
    device = next(pretrained.model.parameters()).device
    gen = engine.generate(
        torch.tensor([list(ids)], dtype=torch.long, device=device),
        max_new_tokens=infer.max_new_tokens,
        temperature=infer.temperature,
        top_p=infer.top_p,
        stop_ids=stop,
        generator=generator,
        **({} if limit is None else {"vocab_limit": limit}),
    )
    return tok.decode(trim_at_stop(gen.tokens[0].tolist(), stop)).strip(), gen


class ChatSession:
    """Questions about one encoded video; the video's KV cache is kept between questions. `engine`:
    a LocalEngine by default, or a SequenceParallelEngine (every rank then asks the same questions)."""

    def __init__(
        self,
        pretrained,
        video: EncodedVideo,
        *,
        infer: InferConfig | None = None,
        engine: Engine | None = None,
    ):
        self.pretrained, self.video = pretrained, video
        self.infer = infer or pretrained.config.infer
        self.tokenizer = _require(pretrained, "tokenizer")
        self.device = next(pretrained.model.parameters()).device
        self.engine = engine or LocalEngine(
            pretrained.model, prefill_chunk=self.infer.prefill_chunk
        )
        self.generator = torch.Generator(device=self.device).manual_seed(self.infer.seed)
        self._prefix: list[int] | None = None
        self.last: Generation | None = None  # the last answer's, for timings

    @classmethod
    def from_video(
        cls,
        pretrained,
        video,
        *,
        fps: float = 1.0,
        max_frames: int | None = None,
        question: str | None = None,
        infer: InferConfig | None = None,
        engine: Engine | None = None,
        progress: bool = True,
    ) -> ChatSession:
        infer = infer or pretrained.config.infer
        enc = encode_video_file(
            pretrained,
            video,
            fps=fps,
            max_frames=max_frames,
            question=question,
            max_new_tokens=infer.max_new_tokens,
            batch_frames=infer.encode_batch_frames,
            progress=progress,
        )
        return cls(pretrained, enc, infer=infer, engine=engine)

    def prompt(self, question: str) -> Prompt:
        return prompt_of(self.pretrained, self.video.codes, self.video.timestamps, question)

    def _after_video(self, prompt: Prompt) -> list[int]:
        """Prefill the prompt up to the video's end (the same for every question) unless it is
        cached; the ids after it. A template that puts the question first prefills it each time."""
        cut = min(prompt.video_end, len(prompt.ids) - 1)
        if prompt.ids[:cut] != self._prefix:
            self.engine.set_prefix(
                torch.tensor([prompt.ids[:cut]], dtype=torch.long, device=self.device)
            )
            self._prefix = prompt.ids[:cut]
        return prompt.ids[cut:]

    @torch.no_grad()
    def score(
        self, question: str, continuations: Sequence[Sequence[int]]
    ) -> list[tuple[float, int, bool]]:
        """Each continuation's (answer ids') summed log-probability after `question`, its length, and
        whether greedy decoding gives exactly it; over the ids an answer may use, as in `ask`. The
        question is fed once after the cached video, each continuation (but its last id) after it."""
        rest = self._after_video(self.prompt(question))
        model, device = self.pretrained.model, self.device
        limit = model.cfg.vocab.answer_limit
        last = self.engine.extend(torch.tensor([rest], device=device))[:, -1:]  # (1, 1, dim)
        out = []
        for cont in continuations:
            if not cont or (limit is not None and max(cont) >= limit):
                raise ValueError(f"a continuation needs 1 or more answer ids, got {list(cont)}")
            h = (
                last
                if len(cont) == 1
                else torch.cat(
                    [
                        last,
                        self.engine.extend(
                            torch.tensor([cont[:-1]], device=device), keep=len(rest)
                        ),
                    ],
                    1,
                )
            )
            logp = torch.log_softmax(model.logits(h)[0].float()[:, :limit], -1)  # (len(cont), V)
            target = torch.tensor(cont, device=device)
            out.append(
                (
                    float(logp.gather(1, target[:, None]).sum()),
                    len(cont),
                    bool((logp.argmax(-1) == target).all()),
                )
            )
        return out

    def ask(self, question: str) -> str:
        """The model's answer to `question` about the video (text up to the end of sequence)."""
        if not question.strip():
            raise ValueError("the question is empty")
        prompt = self.prompt(question)
        n, limit = len(prompt.ids), self.pretrained.model.cfg.max_seq_len
        if n + self.infer.max_new_tokens > limit:
            warnings.warn(
                f"prompt of {n} tokens plus {self.infer.max_new_tokens} answer tokens exceeds "
                f"the model's context of {limit}",
                ContextWarning,
                stacklevel=2,
            )
        text, self.last = generate_answer(
            self.pretrained, self.engine, self._after_video(prompt), self.infer, self.generator
        )
        return text


def infer_config(pretrained, **overrides) -> InferConfig:
    """The model's InferConfig with the given fields replaced (None values are ignored)."""
    base = getattr(getattr(pretrained, "config", None), "infer", None) or InferConfig()
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def answer(
    model,
    video,
    question: str,
    *,
    fps: float = 1.0,
    max_frames: int | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    prefill_chunk: int | None = None,
    seed: int | None = None,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> str:
    """Answer one question about one video. model: a `Pretrained` or a directory (load_model);
    video: a path or the file's bytes; generation settings default to the model's `infer` config."""
    pretrained = load_model(model, device)
    cfg = infer_config(
        pretrained,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        prefill_chunk=prefill_chunk,
        seed=seed,
    )
    session = ChatSession.from_video(
        pretrained,
        video,
        fps=fps,
        max_frames=max_frames,
        question=question,
        infer=cfg,
        progress=progress,
    )
    return session.ask(question)
