"""Sequence layout: how a sample becomes token ids and per-token loss weights. Defined only here.

    <bos> text <vision> [ts] codes <eof> ... [ts] codes <eov> </vision> text ... <eos>

A *group* is the unit the VQ codes (a frame in 2d mode, a temporal group in causal3d mode). The
templates (``caption``, ``qa``, ``segments``), the timestamp text and the loss weights of each part:
docs/data.md, "Sequence layout". :func:`build_prompt` is the inference prompt: the QA training
layout of one question, ending where the answer starts, or LWM's vision-chat prompt token for token
(``PromptOptions(template="lwm")``; docs/lwm.md explains its five BOS tokens).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from longvideo.data.config import TEMPLATES, DataConfig

QUESTION_TEXT = "Question: {question}\n"
ANSWER_PROMPT = "Answer:"
ANSWER_TEXT = " {answer}"
SEGMENT_TEXT = "{text}\n"
TIMESTAMP_TEXT = "[{t:.1f}s]"
PROMPT_TEMPLATES: tuple[str, ...] = ("qa", "lwm")
LWM_USER_TEXT = "You are a helpful assistant. USER: {question}\n"
LWM_VISION_START, LWM_VISION_END = "<vision>", "</vision>"
LWM_ASSISTANT_TEXT = " ASSISTANT:"
LWM_IMAGE_PROMPT = (
    "You are a helpful assistant. USER: Generate an image of {prompt} ASSISTANT: <vision>"
)
LWM_VIDEO_PROMPT = (
    "You are a helpful assistant. USER: Generate a video of {prompt} ASSISTANT: <vision>"
)
LWM_UNCONDITIONAL = "<vision>"
"""LWM's text-to-image and text-to-video prompts (its vision_generation.py), each read after a
literal <s> by a tokenizer that adds BOS too; the unconditional prompt is <s><vision>."""
LWM_TOP_K_IMAGE, LWM_TOP_K_VIDEO = 8192, 100
"""LWM's script's top-k defaults: of the first frame (an image) and of the frames after it."""
CODE_SLOT = -1
"""A slot of `video_slots` sampled among the VQ codes."""
END_SLOT = -2
"""A slot of `video_slots` sampled between <eof> and <eov>: the model may end the video there."""


@dataclass(frozen=True)
class Text:
    text: str
    loss: bool


@dataclass(frozen=True)
class Video:
    groups: tuple[int, ...]  # indices into the sample's code groups, increasing
    loss: bool


@dataclass(frozen=True)
class Bos:
    pass


@dataclass(frozen=True)
class Eos:
    loss: bool


def qa_parts(
    pairs: Sequence[tuple[str, str | None]],
    groups: Sequence[int],
    *,
    question_first: bool,
    vision_loss: bool,
) -> list:
    """The QA template. An answer of None ends the parts where that answer would start (a prompt)."""
    if not pairs:
        raise ValueError("qa_parts needs at least one question")
    parts: list = [Bos()]
    video = Video(tuple(groups), vision_loss)
    for i, (question, answer) in enumerate(pairs):
        q = QUESTION_TEXT.format(question=question.strip())
        if i == 0 and question_first:
            parts += [Text(q, False), video, Text(ANSWER_PROMPT, False)]
        else:
            if i == 0:
                parts.append(video)
            parts.append(Text(q + ANSWER_PROMPT, False))
        if answer is None:
            return parts
        parts += [Text(ANSWER_TEXT.format(answer=answer.strip()), True), Eos(True)]
    return parts


def lwm_parts(question: str, groups: Sequence[int]) -> list:
    """LWM's vision-chat prompt (see the module docstring): every text piece starts with BOS, the
    first one twice; the question is taken as given (LWM does not strip it)."""
    return [
        Bos(),
        Bos(),
        Text(LWM_USER_TEXT.format(question=question), False),
        Bos(),
        Text(LWM_VISION_START, False),
        Video(tuple(groups), False),
        Bos(),
        Text(LWM_VISION_END, False),
        Bos(),
        Text(LWM_ASSISTANT_TEXT, False),
    ]


def caption_parts(caption: str, groups: Sequence[int], *, caption_first: bool) -> list:
    video = Video(tuple(groups), True)
    body = (
        [Text(caption.strip(), True), video]
        if caption_first
        else [video, Text(caption.strip(), True)]
    )
    return [Bos(), *body, Eos(True)]


def segments_parts(segments: Sequence[dict], timestamps: np.ndarray, groups: Sequence[int]) -> list:
    """Each kept group joins the first segment that ends after its timestamp; the rest trail."""
    segs = sorted(segments, key=lambda s: (s["start"], s["end"]))
    buckets: list[list[int]] = [[] for _ in range(len(segs) + 1)]
    for g in groups:
        t = float(timestamps[g])
        j = next((j for j, s in enumerate(segs) if t < s["end"]), len(segs))
        buckets[j].append(g)
    parts: list = [Bos()]
    for seg, bucket in zip(segs, buckets):
        if bucket:
            parts.append(Video(tuple(bucket), True))
        parts.append(Text(SEGMENT_TEXT.format(text=seg["text"].strip()), True))
    if buckets[-1]:
        parts.append(Video(tuple(buckets[-1]), True))
    return parts + [Eos(True)]


def _render(
    parts: list,
    tok,
    vocab,
    codes: np.ndarray | None,
    timestamps: np.ndarray | None,
    text_w: float,
    vision_w: float,
    every: int,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Ids int64 (L,) and weights float32 (L,) of ``parts``, and the number of tokens up to the end
    of the last video part (0: no video). Text pieces are tokenized one by one (no BOS/EOS added)."""
    ids: list[int] = []
    weights: list[float] = []
    video_end = 0

    def add(new: Sequence[int], w: float) -> None:
        ids.extend(int(i) for i in new)
        weights.extend([w] * len(new))

    for p in parts:
        if isinstance(p, (Bos, Eos)):
            name, token = ("BOS", tok.bos_id) if isinstance(p, Bos) else ("EOS", tok.eos_id)
            if token is None:
                raise ValueError(f"the text tokenizer has no {name} token")
            add([token], text_w if isinstance(p, Eos) and p.loss else 0.0)
        elif isinstance(p, Text):
            if p.text:
                add(tok.encode(p.text), text_w if p.loss else 0.0)
        elif isinstance(p, Video):
            if not p.groups:
                continue
            vw, tw, v = (vision_w if p.loss else 0.0), (text_w if p.loss else 0.0), vocab
            if v.vision_start is not None:  # text around the video in the lwm layout
                add([v.vision_start], vw)
            flat = codes.reshape(codes.shape[0], -1)  # (G, h*w)
            for i, g in enumerate(p.groups):
                if every and i % every == 0:
                    add(tok.encode(TIMESTAMP_TEXT.format(t=float(timestamps[g]))), tw)
                add((flat[g] + v.vq_offset).tolist(), vw)
                add([v.eov if i == len(p.groups) - 1 else v.eof], vw)
            if v.vision_end is not None:
                add([v.vision_end], vw)
            video_end = len(ids)
        else:
            raise TypeError(f"unknown part {p!r}")
    return np.asarray(ids, np.int64), np.asarray(weights, np.float32), video_end


@dataclass
class Doc:
    """One laid-out sample: ids int64 (L,), weights float32 (L,) (weight of predicting token j)."""

    ids: np.ndarray
    weights: np.ndarray
    template: str
    groups_kept: int
    groups_dropped: int
    key: str = ""

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def uniform_keep(num_groups: int, keep: int) -> list[int]:
    """``keep`` group indices spread evenly over ``num_groups``, increasing. With two or more kept,
    the first and the last are among them (a question about how a video starts or ends keeps its
    evidence); one kept group is the middle one."""
    if keep >= num_groups:
        return list(range(num_groups))
    if keep <= 0:
        return []
    if keep == 1:
        return [num_groups // 2]
    step = (num_groups - 1) / (keep - 1)  # > 1, so rounding keeps the indices distinct
    return [int(i * step + 0.5) for i in range(keep)]


@dataclass(frozen=True)
class LayoutOptions:
    """The DataConfig fields the layout reads (see longvideo/data/config.py)."""

    text_loss_weight: float = 0.5
    vision_loss_weight: float = 0.5
    timestamp_every: int = 0
    qa_vision_loss: bool = True
    templates: tuple[str, ...] = TEMPLATES
    template_mode: str = "first"
    question_position: str = "after"
    caption_position: str = "after"
    qa_order: str = "shuffle"
    qa_types: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, cfg: DataConfig) -> LayoutOptions:
        return cls(**{k: getattr(cfg, k) for k in cls.__dataclass_fields__})


def choose_templates(
    meta: dict, opts: LayoutOptions, rng: np.random.Generator
) -> list[tuple[str, bool]]:
    """(template, text_first) pairs to lay out for a sample, following template_mode."""
    caption = meta.get("caption")
    have = {
        "qa": bool(meta.get("qa")),
        "segments": bool(meta.get("segments")),
        "caption": isinstance(caption, str) and bool(caption.strip()),
    }
    avail = [t for t in opts.templates if have[t]]
    if not avail:
        return []
    if opts.template_mode == "first":
        chosen = avail[:1]
    elif opts.template_mode == "random":
        chosen = [avail[int(rng.integers(len(avail)))]]
    else:
        chosen = avail
    out = []
    for t in chosen:
        pos = (
            opts.question_position
            if t == "qa"
            else opts.caption_position
            if t == "caption"
            else "after"
        )
        first = pos == "before" or (pos == "random" and bool(rng.integers(2)))
        out.append((t, first))
    return out


def layout_doc(
    tokenizer,
    vocab,
    codes: np.ndarray,
    timestamps: np.ndarray,
    meta: dict,
    template: str,
    text_first: bool,
    opts: LayoutOptions,
    max_len: int,
) -> Doc | None:
    """Lay out one template, dropping whole groups uniformly until it fits ``max_len``; None when
    even one group does not fit (the text alone is too long)."""
    num_groups = int(codes.shape[0])

    def parts_for(groups: list[int]) -> list:
        if template == "qa":
            pairs = [(x["question"], x["answer"]) for x in meta["qa"]]
            return qa_parts(
                pairs, groups, question_first=text_first, vision_loss=opts.qa_vision_loss
            )
        if template == "caption":
            return caption_parts(meta["caption"], groups, caption_first=text_first)
        if template == "segments":
            return segments_parts(meta["segments"], timestamps, groups)
        raise ValueError(f"unknown template {template!r}; expected one of {TEMPLATES}")

    def render(keep: int) -> tuple[np.ndarray, np.ndarray]:
        parts = parts_for(uniform_keep(num_groups, keep))
        return _render(
            parts,
            tokenizer,
            vocab,
            codes,
            timestamps,
            opts.text_loss_weight,
            opts.vision_loss_weight,
            opts.timestamp_every,
        )[:2]

    keep = num_groups
    ids, w = render(keep)
    while len(ids) > max_len:
        if keep <= 1:
            return None
        base_ids, _ = render(0)  # the text alone
        per_group = (len(ids) - len(base_ids)) / keep
        fit = int((max_len - len(base_ids)) // max(per_group, 1e-9))
        keep = max(0, min(keep - 1, fit))
        if keep == 0:
            return None
        ids, w = render(keep)
    return Doc(
        ids=ids, weights=w, template=template, groups_kept=keep, groups_dropped=num_groups - keep
    )


def sample_rng(seed: int, epoch: int, key: str) -> np.random.Generator:
    """Per-sample randomness (template choice) that depends only on seed, epoch and key."""
    return np.random.default_rng([seed, epoch, zlib.crc32(key.encode())])


def build_docs(
    tokenizer,
    vocab,
    codes: np.ndarray,
    timestamps: np.ndarray,
    meta: dict,
    opts: LayoutOptions,
    max_len: int,
    rng: np.random.Generator,
    key: str = "",
) -> tuple[list[Doc], int]:
    """All documents of one sample; returns (docs, number of templates that did not fit)."""
    docs, too_long = [], 0
    if opts.qa_types and meta.get("qa"):  # a rung trained on some questions only
        meta = dict(meta, qa=[x for x in meta["qa"] if x.get("type") in opts.qa_types])
    for template, first in choose_templates(meta, opts, rng):
        m = meta
        if template == "qa" and opts.qa_order == "shuffle" and len(meta["qa"]) > 1:
            # a fixed order lets a model learn each answer from its place (the first answer after
            # the video is always the needle's colour) instead of from its question
            m = dict(meta, qa=[meta["qa"][k] for k in rng.permutation(len(meta["qa"]))])
        doc = layout_doc(tokenizer, vocab, codes, timestamps, m, template, first, opts, max_len)
        if doc is None:
            too_long += 1
        else:
            doc.key = key
            docs.append(doc)
    return docs, too_long


@dataclass(frozen=True)
class PromptOptions:
    """How a question about a video is laid out at inference: the QA training template's settings."""

    timestamp_every: int = (
        0  # timestamp text before every k-th code group (0: none), as in training
    )
    question_first: bool = False  # the question before the video instead of after it
    template: str = (
        "qa"  # qa: the QA training template; lwm: LWM's vision-chat prompt (no other options)
    )

    def __post_init__(self):
        if self.template not in PROMPT_TEMPLATES:
            raise ValueError(
                f"prompt template must be one of {PROMPT_TEMPLATES}, got {self.template!r}"
            )

    @classmethod
    def from_config(cls, data: DataConfig) -> PromptOptions:
        """The options a model trained with `data` expects (a 'random' question position trained
        both orders; the prompt then asks after the video)."""
        return cls(
            timestamp_every=data.timestamp_every,
            question_first=data.question_position == "before",
            template=data.prompt_template,
        )


@dataclass(frozen=True)
class Prompt:
    """A question's prompt: its ids, ending where the answer starts, and where its video ends."""

    ids: list[int]
    video_end: int
    """Length of the prefix that ends with the video (``</vision>``, or ``<eov>`` in LWM's layout):
    the same for every question asked after the same video, so a KV cache of it is kept."""


def build_prompt(
    tokenizer,
    vocab,
    codes,
    timestamps,
    question: str,
    options: PromptOptions = PromptOptions(),
    history: Sequence[tuple[str, str]] = (),
) -> Prompt:
    """The prompt for one question, ending exactly where the answer starts (the module docstring).
    codes: integer (G, h, w) (numpy or torch); timestamps: (G,) seconds; history: earlier (question,
    answer) turns about the same video (docs/data.md, "Sequence layout", Inference)."""
    codes = np.asarray(codes.cpu() if hasattr(codes, "cpu") else codes).astype(np.int64)
    timestamps = np.asarray(
        timestamps.cpu() if hasattr(timestamps, "cpu") else timestamps, np.float64
    )
    if codes.ndim != 3 or timestamps.shape != codes.shape[:1]:
        raise ValueError(
            f"codes must be (G, h, w) and timestamps (G,), got {codes.shape}, {timestamps.shape}"
        )
    if options.template == "lwm":
        if history:
            raise ValueError(
                "LWM's vision-chat prompt holds one question; follow-ups need the qa template"
            )
        parts = lwm_parts(question, range(codes.shape[0]))
    else:
        parts = qa_parts(
            [*history, (question, None)],
            range(codes.shape[0]),
            question_first=options.question_first,
            vision_loss=False,
        )
    ids, _, video_end = _render(
        parts, tokenizer, vocab, codes, timestamps, 0.0, 0.0, options.timestamp_every
    )
    return Prompt(ids=ids.tolist(), video_end=video_end)


def generation_prompts(
    tokenizer, vocab, caption: str, *, template: str = "qa", video: bool = True
) -> tuple[list[int], list[int]]:
    """The (conditional, unconditional) prompts after which a video's first code is sampled
    (docs/generation.md). template qa (the project's layout): the caption template with the
    caption first, up to its <vision>, against <s><vision>; lwm: LWM's prompt of an image
    (video=False) or of a video, <s> and BOS before it, against <s><vision>, as LWM's script
    tokenizes them."""
    if template == "lwm":
        text = (LWM_VIDEO_PROMPT if video else LWM_IMAGE_PROMPT).format(prompt=caption)
        cond, uncond = (
            [Bos(), Bos(), Text(text, False)],
            [Bos(), Bos(), Text(LWM_UNCONDITIONAL, False)],
        )
        tail: list[int] = []
    elif template in PROMPT_TEMPLATES:
        if not caption.strip():
            raise ValueError("the caption is empty")
        cond, uncond, tail = [Bos(), Text(caption.strip(), False)], [Bos()], [vocab.vision_start]
    else:
        raise ValueError(f"prompt template must be one of {PROMPT_TEMPLATES}, got {template!r}")
    if (template == "lwm") != vocab.is_lwm:
        need = "lwm" if template == "lwm" else "longvideo"
        raise ValueError(f"the {template} template needs the {need} layout")
    out = []
    for parts in (cond, uncond):
        ids, _, _ = _render(parts, tokenizer, vocab, None, None, 0.0, 0.0, 0)
        out.append(ids.tolist() + tail)
    return out[0], out[1]


def video_slots(
    tokenizer,
    vocab,
    *,
    groups: int,
    codes_per_group: int,
    timestamps: Sequence[float] | None = None,
    timestamp_every: int = 0,
    model_ends: bool = False,
) -> list[int]:
    """The tokens of a generated video after its prompt, one slot each: CODE_SLOT (a code is
    sampled), END_SLOT (<eof> or <eov> is sampled), or a forced id. The project's layout: each
    group's timestamp text when due (as `_render` lays it out), its codes, then <eof> (<eov> after
    the last; model_ends: sampled between the two, the last still <eov>). The lwm layout: codes
    then <eof>, every group, as LWM's script forces it."""
    if groups < 1 or codes_per_group < 1:
        raise ValueError(
            f"need groups >= 1 and codes_per_group >= 1, got {groups}, {codes_per_group}"
        )
    slots: list[int] = []
    for i in range(groups):
        if vocab.is_lwm:
            slots += [CODE_SLOT] * codes_per_group + [vocab.eof]
            continue
        if timestamp_every and i % timestamp_every == 0:
            if timestamps is None or len(timestamps) < groups:
                raise ValueError("timestamp text needs each group's timestamp")
            slots += tokenizer.encode(TIMESTAMP_TEXT.format(t=float(timestamps[i])))
        last = i == groups - 1
        slots += [CODE_SLOT] * codes_per_group
        slots.append(vocab.eov if last else END_SLOT if model_ends else vocab.eof)
    return slots


def parse_answer(text: str) -> str:
    """The answer in generated text: its first line, without surrounding spaces or a final period."""
    return text.strip().split("\n", 1)[0].strip().rstrip(".").strip()
