"""Evaluations: QA accuracy on shards, text and video needle-in-a-haystack, a flash through the VQ;
each returns a dict, written as OUT/NAME.json and a heatmap OUT/NAME.png when `out_dir` is given
(docs/inference.md, "Evaluations"; one's own haystack and needle: docs/evaluation.md).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from tqdm.auto import tqdm

from longvideo.atomic import write_text_atomic
from longvideo.data.codes import video_to_codes
from longvideo.data.templates import build_prompt, parse_answer
from longvideo.data.shards import index_tar, iter_raw_samples, iter_token_samples
from longvideo.data.streams import ShardError, SkipStats, expand_shards
from longvideo.data.synthetic import (
    COLOURS,
    NEEDLE_CHOICES,
    NEEDLE_QUESTION,
    SyntheticSpec,
    make_sample,
    write_mp4,
)
from longvideo.data.video import VideoError, read_video, resize_crop
from longvideo.distributed import broadcast_array, fail_together, together
from longvideo.infer.chat import (
    ChatSession,
    EncodedVideo,
    fit_codes,
    generate_answer,
    infer_config,
    load_model,
)
from longvideo.infer.generation import Engine, LocalEngine
from longvideo.vq.codec import SplicingEncoder, decode_codes, encode_video

EngineFactory = Callable[[object], Engine]
"""Builds the engine for a loaded model (default: a LocalEngine with the config's prefill chunk)."""


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", parse_answer(text).lower()).strip()


def exact_match(prediction: str, reference: str) -> bool:
    """The parsed answer equals the reference (case- and whitespace-insensitive)."""
    return normalise(prediction) == normalise(reference) and normalise(reference) != ""


def substring_match(prediction: str, reference: str) -> bool:
    """The reference occurs in the prediction (case-insensitive)."""
    ref = reference.strip().lower()
    return bool(ref) and ref in prediction.lower()


def save_heatmap(
    values: np.ndarray,
    xlabels: Sequence,
    ylabels: Sequence,
    path: str | Path,
    *,
    title: str,
    xlabel: str,
    ylabel: str,
) -> None:
    """values (len(ylabels), len(xlabels)) in [0, 1] as a red-to-green grid with the numbers written in."""
    from matplotlib.figure import Figure  # here: only the plots pay for matplotlib's import

    values = np.asarray(values, dtype=float)
    fig = Figure(figsize=(1.2 + 0.9 * len(xlabels), 1.2 + 0.55 * len(ylabels)))
    ax = fig.subplots()
    im = ax.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(xlabels)), [str(x) for x in xlabels])
    ax.set_yticks(range(len(ylabels)), [str(y) for y in ylabels])
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    for (i, j), v in np.ndenumerate(values):
        if np.isfinite(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.savefig(
        path, dpi=120, bbox_inches="tight"
    )  # long question labels: grow the canvas, not squeeze


def _write(
    result: dict,
    out_dir: Optional[str | Path],
    name: str,
    values,
    xlabels: Sequence,
    ylabels: Sequence,
    **labels,
) -> dict:
    """`result` as OUT/NAME.json and `values` as the heatmap OUT/NAME.png (save_heatmap's labels)."""
    if out_dir is None:
        return result
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result["json"], result["png"] = str(out / f"{name}.json"), str(out / f"{name}.png")
    save_heatmap(values, xlabels, ylabels, out / f"{name}.png", **labels)
    write_text_atomic(out / f"{name}.json", json.dumps(result, indent=2) + "\n")  # last
    return result


def greedy(model, max_new_tokens: int, needs: Sequence[str] = (), what: str = ""):
    """The loaded model and its greedy InferConfig; ValueError "{what} needs the model's ..." when
    it lacks one of `needs` ("vq", "tokenizer")."""
    pretrained = load_model(model)
    if any(getattr(pretrained, n) is None for n in needs):
        parts = {"vq": "VQ", "tokenizer": "text tokenizer"}
        raise ValueError(f"{what} needs the model's {' and '.join(parts[n] for n in needs)}")
    return pretrained, infer_config(pretrained, max_new_tokens=max_new_tokens, temperature=0.0)


def open_session(pretrained, video: EncodedVideo, infer, engine_factory: Optional[EngineFactory]):
    """A ChatSession on the factory's engine (default: the session's LocalEngine)."""
    engine = engine_factory(pretrained) if engine_factory is not None else None
    return ChatSession(pretrained, video, infer=infer, engine=engine)


def _qa_samples(
    pretrained, shards, *, fps: float, max_frames: Optional[int], batch_frames: int, stats
) -> Iterator[tuple[str, np.ndarray, np.ndarray, dict]]:
    """(key, codes, timestamps, meta) of token shards, or of raw shards encoded with the model's VQ."""
    paths = expand_shards(shards)
    if not paths:
        raise FileNotFoundError(f"no shards match {shards!r}")
    codebook = pretrained.model.cfg.codebook_size
    for path in paths:
        try:
            is_tokens = any(m.ext == "codes.npy" for m in index_tar(path))
        except ShardError as e:
            stats.skip(e.reason, path, str(e))
            continue
        if is_tokens:
            for s in iter_token_samples(path, stats, codebook):
                yield s.key, s.codes, s.timestamps, s.meta
            continue
        if pretrained.vq is None:
            raise ValueError(
                f"{path} is a raw shard (videos): evaluating it needs the model's VQ (vq/)"
            )
        for raw in iter_raw_samples(path, stats):
            try:
                vc = video_to_codes(
                    pretrained.vq,
                    raw.video,
                    fps=fps,
                    max_frames=max_frames,
                    batch_frames=batch_frames,
                )
            except VideoError as e:
                stats.skip("video_error", f"{path}:{raw.key}", str(e))
                continue
            yield raw.key, vc.codes, vc.timestamps, raw.meta


def _mean(records: list[dict], key: str) -> Optional[float]:
    """The mean of the records' `key`, those that are None left out; None when all are."""
    values = [r[key] for r in records if r[key] is not None]
    return float(np.mean(values)) if values else None


def evaluate_qa(
    model,
    shards,
    *,
    out_dir: Optional[str | Path] = None,
    max_samples: Optional[int] = None,
    max_new_tokens: int = 16,
    fps: float = 1.0,
    max_frames: Optional[int] = 3600,
    engine_factory: Optional[EngineFactory] = None,
    progress: bool = True,
    encode_group=None,
) -> dict:
    """Accuracy over every question of the samples in `shards` (token shards, or raw shards that the
    model's VQ encodes). encode_group: the ranks of a sequence-parallel prefill; they read the
    samples each and agree after every one (longvideo.distributed.together)."""
    pretrained, infer = greedy(model, max_new_tokens)
    stats = SkipStats()
    records = []
    t0 = time.time()
    bar = tqdm(desc="QA eval", unit="sample", disable=not progress)
    for n, (key, codes, stamps, meta) in enumerate(
        together(
            _qa_samples(
                pretrained,
                shards,
                fps=fps,
                max_frames=max_frames,
                batch_frames=infer.encode_batch_frames,
                stats=stats,
            ),
            encode_group,
        )
    ):
        if max_samples is not None and n >= max_samples:
            break
        qa = [
            x
            for x in meta.get("qa", [])
            if isinstance(x, dict) and "question" in x and "answer" in x
        ]
        if not qa:
            stats.skip("no_qa", key)
            continue
        duration = float(meta.get("duration", stamps[-1] if len(stamps) else 0.0))
        longest = max(qa, key=lambda x: len(x["question"]))["question"]
        fc, ft, _ = fit_codes(pretrained, codes, stamps, longest, infer.max_new_tokens)
        video = EncodedVideo(
            codes=fc,
            timestamps=ft,
            num_frames=len(ft),
            duration=duration,
            fps=len(ft) / max(duration, 1e-9),
        )
        session = open_session(
            pretrained, video, infer, engine_factory
        )  # the video is prefilled once
        for x in qa:
            pred = session.ask(x["question"])
            choices = x.get("choices")
            records.append(
                {
                    "key": key,
                    "question": x["question"],
                    "answer": str(x["answer"]),
                    "prediction": pred,
                    "exact": exact_match(pred, str(x["answer"])),
                    "substring": substring_match(pred, str(x["answer"])),
                    "chance": 1.0 / len(choices) if choices else None,
                    "duration": duration,
                    "groups": int(fc.shape[0]),
                    "groups_dropped": int(codes.shape[0] - fc.shape[0]),
                }
            )
        bar.update(1)
    bar.close()
    if not records:
        raise ValueError(f"no QA samples found in {shards!r} (skipped: {dict(stats)})")
    questions = sorted({r["question"] for r in records})
    by_question = {q: [r for r in records if r["question"] == q] for q in questions}
    durations = np.array([r["duration"] for r in records])
    edges = (
        np.unique(np.quantile(durations, [0, 1 / 3, 2 / 3, 1]))
        if len(records) > 1
        else durations[:1]
    )
    bins = [(float(a), float(b)) for a, b in zip(edges[:-1], edges[1:])] or [
        (float(durations[0]),) * 2
    ]
    col = np.searchsorted(
        [b for _, b in bins[:-1]], durations, side="right"
    )  # [a, b), the last [a, b]
    grid = np.array(
        [
            [
                _mean([r for r, c in zip(records, col) if r["question"] == q and c == j], "exact")
                for j in range(len(bins))
            ]
            for q in questions
        ],
        dtype=float,
    )  # nan: no record
    per_question = {
        q: {"accuracy": _mean(rs, "exact"), "count": len(rs), "chance": _mean(rs, "chance")}
        for q, rs in by_question.items()
    }
    result = {
        "task": "qa",
        "accuracy": _mean(records, "exact"),
        "substring_accuracy": _mean(records, "substring"),
        "chance": _mean(records, "chance"),
        "questions": len(records),
        "samples": len({r["key"] for r in records}),
        "per_question": per_question,
        "duration_bins": bins,
        "grid": [[None if not np.isfinite(v) else float(v) for v in row] for row in grid],
        "skipped": {k: v for k, v in stats.items() if k != "ok"},
        "seconds": round(time.time() - t0, 2),
        "records": records,
    }
    xl = [f"{a:.0f}-{b:.0f}s" for a, b in bins]
    return _write(
        result,
        out_dir,
        "qa",
        grid,
        xl,
        questions,
        xlabel="video length",
        ylabel="question",
        title=f"QA accuracy (chance {result['chance'] or float('nan'):.2f})",
    )


CITIES: tuple[str, ...] = (
    "Chicago",
    "Lisbon",
    "Nairobi",
    "Osaka",
    "Quito",
    "Tallinn",
    "Perth",
    "Dakar",
    "Hanoi",
    "Lima",
    "Oslo",
    "Cairo",
)
_SUBJECTS = (
    "The river",
    "A small boat",
    "The old library",
    "Every morning the market",
    "The mountain path",
    "A quiet garden",
    "The city council",
    "The winter wind",
    "Our neighbour",
    "The long train",
)
_VERBS = (
    "passes",
    "waits near",
    "turns toward",
    "leans on",
    "drifts past",
    "looks over",
    "returns to",
    "rests beside",
)
_OBJECTS = (
    "the bridge",
    "a stone wall",
    "the harbour",
    "an open field",
    "the clock tower",
    "a wooden fence",
    "the hills",
    "a narrow street",
    "the lake",
    "a row of houses",
)
_ENDINGS = (
    "before noon",
    "in the rain",
    "after a while",
    "as usual",
    "without a sound",
    "for an hour",
    "at dusk",
    "once again",
)


def filler_sentences(rng: np.random.Generator) -> Iterator[str]:
    """Endless plain sentences for the haystack (deterministic in rng)."""
    while True:
        yield (
            f"{_SUBJECTS[rng.integers(len(_SUBJECTS))]} {_VERBS[rng.integers(len(_VERBS))]} "
            f"{_OBJECTS[rng.integers(len(_OBJECTS))]} {_ENDINGS[rng.integers(len(_ENDINGS))]}."
        )


def text_needle_prompt(
    pretrained, context_len: int, depth: float, city: str, number: int, seed: int = 0
) -> tuple[list[int], dict]:
    """Prompt ids of about `context_len` tokens with the needle at `depth` (0 = start, 1 = end) of
    the haystack, inserted at the sentence boundary nearest to that depth; its tokens and depth."""
    tok = pretrained.tokenizer
    vocab = pretrained.model.cfg.vocab
    needle = f"The special magic {city} number is: {number}."
    question = f"What is the special magic {city} number?"
    empty_codes, empty_ts = np.zeros((0, 1, 1), np.int64), np.zeros(0)

    def render(sentences: list[str]) -> list[int]:
        return build_prompt(
            tok, vocab, empty_codes, empty_ts, " ".join(sentences) + "\n" + question
        ).ids

    overhead = len(render([needle]))
    rng = np.random.default_rng(seed)
    hay: list[str] = []
    counts: list[int] = []
    for s in filler_sentences(rng):
        n = len(tok.encode(" " + s))
        if overhead + sum(counts) + n > context_len and hay:
            break
        hay.append(s)
        counts.append(n)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    at = int(np.argmin(np.abs(offsets - depth * offsets[-1])))
    ids = render(hay[:at] + [needle] + hay[at:])
    return ids, {"tokens": len(ids), "needle_depth": float(offsets[at] / max(offsets[-1], 1))}


def evaluate_text_needle(
    model,
    *,
    lengths: Sequence[int] = (256, 512, 1024),
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    rounds: int = 2,
    seed: int = 0,
    max_new_tokens: int = 16,
    out_dir: Optional[str | Path] = None,
    engine_factory: Optional[EngineFactory] = None,
    progress: bool = True,
) -> dict:
    """LWM's needle retrieval over a context-length x depth grid; a cell's score is the fraction of
    its `rounds` needles whose number appears in the answer."""
    pretrained, infer = greedy(model, max_new_tokens, ("tokenizer",), "the text needle evaluation")
    rng = np.random.default_rng(seed)
    device = next(pretrained.model.parameters()).device
    grid = np.zeros((len(depths), len(lengths)))
    cells = []
    bar = tqdm(total=len(depths) * len(lengths) * rounds, desc="text needle", disable=not progress)
    for j, L in enumerate(lengths):
        for i, d in enumerate(depths):
            hits = []
            for r in range(rounds):
                city = CITIES[int(rng.integers(len(CITIES)))]
                number = int(rng.integers(1_000_000, 10_000_000))  # 7 digits, as in LWM
                ids, facts = text_needle_prompt(
                    pretrained, L, d, city, number, seed=seed + 1000 * j + r
                )
                engine = (
                    engine_factory(pretrained)
                    if engine_factory
                    else LocalEngine(pretrained.model, prefill_chunk=infer.prefill_chunk)
                )
                engine.set_prefix(torch.tensor([ids[:-1]], device=device))
                pred, gen = generate_answer(pretrained, engine, ids[-1:], infer)
                ok = str(number) in pred
                hits.append(ok)
                cells.append(
                    {
                        "context": L,
                        "depth": float(d),
                        "round": r,
                        "number": number,
                        "city": city,
                        "prediction": pred,
                        "correct": ok,
                        "tokens": facts["tokens"],
                        "needle_depth": facts["needle_depth"],
                        "ttft_s": round(engine.prefix_s + gen.ttft_s, 4),
                    }
                )
                bar.update(1)
            grid[i, j] = float(np.mean(hits))
    bar.close()
    result = {
        "task": "text_needle",
        "protocol": "LWM needle retrieval (substring match of the number)",
        "lengths": list(lengths),
        "depths": [float(d) for d in depths],
        "rounds": rounds,
        "accuracy": float(grid.mean()),
        "chance": 0.0,
        "grid": grid.tolist(),
        "cells": cells,
    }
    return _write(
        result,
        out_dir,
        "text_needle",
        grid,
        list(lengths),
        [f"{d:.2f}" for d in depths],
        title="Text needle retrieval",
        xlabel="context length (tokens)",
        ylabel="needle depth",
    )


def haystack_frames(
    num_frames: int, size: int, seed: int, source_fps: int = 8, *, decoded: bool = False
) -> np.ndarray:
    """A moving-shapes video of `num_frames` seconds at 1 fps (uint8 (T, size, size, 3)), rendered at
    `source_fps`; decoded: through the training videos' writer and read back, else exactly as drawn."""
    spec = SyntheticSpec(
        size=size,
        fps=source_fps,
        min_seconds=num_frames,
        max_seconds=num_frames,
        long_fraction=0.0,
        needle_fraction=0.0,
    )
    sample = make_sample(seed, 0, spec)
    if decoded:
        return read_video(sample.mp4(), fps=1.0, size=size).frames.numpy()[:num_frames].copy()
    return sample.frames_at(np.arange(num_frames) * source_fps)


def flash_frame(
    colour: str, size: int, source_fps: int = 8, *, decoded: bool = False
) -> torch.Tensor:
    """A full-frame flash of a needle colour, uint8 (size, size, 3); decoded: as a training video carries
    it, through the codec (docs/inference.md, "Evaluations")."""
    if not decoded:
        return torch.tensor(COLOURS[colour], dtype=torch.uint8).expand(size, size, 3).clone()
    src = np.zeros((2 * source_fps, size, size, 3), np.uint8)
    src[source_fps:] = COLOURS[colour]
    gop = max(
        1, int(round(SyntheticSpec.gop_seconds * source_fps))
    )  # the training videos' keyframes
    return read_video(write_mp4([src], source_fps, gop=gop), fps=1.0, size=size).frames[1].clone()


def needle_index(num_frames: int, depth: float) -> int:
    return int(round(depth * (num_frames - 1)))


def window_start(frames: int, length: int, trial: int, trials: int) -> int:
    """Where trial `trial` of `trials` cuts `length` frames from a haystack of `frames`: spread evenly."""
    return int(round(trial * (frames - length) / max(trials - 1, 1)))


def trials_per_length(lengths: Sequence[int], trials) -> list[int]:
    """Trials of each length: one int for all, or one per length."""
    per = (
        [int(trials)] * len(lengths)
        if isinstance(trials, (int, np.integer))
        else [int(t) for t in trials]
    )
    if len(per) != len(lengths) or min(per) < 1:
        raise ValueError(
            f"trials must be a positive int or one per length ({len(lengths)}), got {trials}"
        )
    return per


def evaluate_video_needle(
    model,
    *,
    lengths: Sequence[int] = (16, 32, 64),
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    colours: Optional[Sequence[str]] = None,
    trials=None,
    seed: int = 0,
    source_fps: int = 8,
    max_new_tokens: int = 8,
    out_dir: Optional[str | Path] = None,
    engine_factory: Optional[EngineFactory] = None,
    progress: bool = True,
    encode_group=None,
    haystack=None,
    needle=None,
    question: Optional[str] = None,
    answer: Optional[str] = None,
    decoded: bool = True,
) -> dict:
    """Needle-frame retrieval over a video-length (frames at 1 fps) x depth grid: per cell, the fraction
    of its trials whose needle is named (exact match). The trials, encode_group, haystack, needle and
    decoded: docs/inference.md, "Evaluations" (one's own media: docs/evaluation.md)."""
    pretrained, infer = greedy(
        model, max_new_tokens, ("vq", "tokenizer"), "the video needle evaluation"
    )
    vq = pretrained.vq
    colours = list(colours or NEEDLE_CHOICES)
    unknown = [c for c in colours if c not in COLOURS]
    if unknown:
        raise ValueError(f"unknown needle colours {unknown}; choose from {list(COLOURS)}")
    per_length = trials_per_length(lengths, len(colours) if trials is None else trials)
    size = vq.cfg.resolution
    if (needle is None) != (question is None) or (needle is None) != (answer is None):
        raise ValueError(
            "a needle image needs its question and answer (needle=, question=, answer=)"
        )
    if needle is not None:
        img = torch.from_numpy(np.asarray(Image.open(needle).convert("RGB")).copy())
        needles = [(answer, resize_crop(img[None], size)[0])]
    else:
        needles = [(c, flash_frame(c, size, source_fps, decoded=decoded)) for c in colours]
    hay = (
        read_video(str(haystack), fps=1.0, size=size).frames.numpy()
        if haystack is not None
        else None
    )
    if hay is not None and max(lengths) > len(hay):
        raise ValueError(
            f"{haystack} gives {len(hay)} frames at 1 fps, fewer than the longest length "
            f"{max(lengths)}"
        )
    question = question or NEEDLE_QUESTION
    hits = np.zeros((len(depths), len(lengths)))
    cells = []
    world, rank = (
        (1, 0)
        if encode_group is None
        else (dist.get_world_size(encode_group), dist.get_rank(encode_group))
    )
    bar = tqdm(total=len(depths) * sum(per_length), desc="video needle", disable=not progress)
    for j, (T, n_trials) in enumerate(zip(lengths, per_length)):
        groups = vq.group_frame_index(T)
        stamps_all = np.asarray(
            [float(g[0]) for g in groups]
        )  # 1 fps: a group's first frame's second

        def depth_codes(trial: int) -> np.ndarray:
            """(depths, G, h, w) codes of the trial's background with its flash at each depth."""
            frames = (
                haystack_frames(T, size, seed + 1000 * j + trial, source_fps, decoded=decoded)
                if hay is None
                else hay[window_start(len(hay), T, trial, n_trials) :][:T]
            )
            background = SplicingEncoder(vq, frames, batch_frames=infer.encode_batch_frames)
            frame = needles[trial % len(needles)][1]
            return np.stack(
                [
                    background.codes_with({needle_index(T, d): frame}).numpy().astype(np.int64)
                    for d in depths
                ]
            )

        # every rank encodes its trials of this length at once, and all learn of any failure first
        mine, error = {}, None
        if world > 1:
            try:
                mine = {t: depth_codes(t) for t in range(n_trials) if t % world == rank}
            except Exception as e:  # noqa: BLE001 - raised on every rank by fail_together
                error = e
            fail_together(error, encode_group)
        for trial in range(n_trials):
            c = needles[trial % len(needles)][0]
            start = 0 if hay is None else window_start(len(hay), T, trial, n_trials)
            if world > 1:
                src = dist.get_global_rank(encode_group, trial % world)
                trial_codes = broadcast_array(mine.pop(trial, None), src=src, group=encode_group)
            else:
                trial_codes = depth_codes(trial)
            for i, d in enumerate(depths):
                k = needle_index(T, d)
                kept, stamps, keep = fit_codes(
                    pretrained, trial_codes[i], stamps_all, question, infer.max_new_tokens
                )
                video = EncodedVideo(
                    codes=kept, timestamps=stamps, num_frames=T, duration=float(T), fps=1.0
                )
                session = open_session(pretrained, video, infer, engine_factory)
                pred = session.ask(question)
                ok = exact_match(pred, c)
                hits[i, j] += ok
                group = next(g for g, members in enumerate(groups) if k in members)
                cells.append(
                    {
                        "frames": T,
                        "depth": float(d),
                        "trial": trial,
                        "needle_frame": k,
                        "needle_group": group,
                        "frame_in_group": groups[group].index(k),
                        "colour": c,
                        "prediction": pred,
                        "correct": ok,
                        "substring": substring_match(pred, c),
                        "groups": int(kept.shape[0]),
                        "needle_kept": group in set(keep),
                        "window_start": start,
                        "tokens": session.last.prompt_len,
                    }
                )
                bar.update(1)
    bar.close()
    grid = hits / np.asarray(per_length)[None, :]
    dropped = sum(not c["needle_kept"] for c in cells)
    result = {
        "task": "video_needle",
        "lengths": list(lengths),
        "depths": [float(d) for d in depths],
        "colours": [a for a, _ in needles],
        "trials": per_length,
        "accuracy": float(hits.sum() / (len(depths) * sum(per_length))),
        "chance": 1.0 / len(colours) if needle is None else 0.0,
        "grid": grid.tolist(),
        "needles_dropped": dropped,
        "context": pretrained.model.cfg.max_seq_len,
        "cells": cells,
        "vq_mode": vq.cfg.mode,
        "question": question,
        "decoded": decoded,
        "haystack": None if haystack is None else str(haystack),
        "haystack_frames": None if hay is None else len(hay),
    }
    if out_dir is not None:  # the exact frames inserted, at the tokenizer's resolution
        frames_dir = Path(out_dir) / "video_needle_frames"
        frames_dir.mkdir(parents=True, exist_ok=True)
        result["needle_frames"] = {
            a: str(frames_dir / f"needle_{k}.png") for k, (a, _) in enumerate(needles)
        }
        for a, frame in needles:
            Image.fromarray(frame.numpy()).save(result["needle_frames"][a])
    return _write(
        result,
        out_dir,
        "video_needle",
        grid,
        list(lengths),
        [f"{d:.2f}" for d in depths],
        title=f"Video needle retrieval (chance {result['chance']:.2f})",
        xlabel="video length (frames at 1 fps)",
        ylabel="needle depth",
    )


def nearest_colour(frame: np.ndarray, colours: Sequence[str]) -> str:
    """The needle colour closest (RGB distance) to a frame's mean colour."""
    mean = frame.reshape(-1, 3).astype(np.float64).mean(0)
    return min(
        colours, key=lambda c: float(((mean - np.asarray(COLOURS[c], np.float64)) ** 2).sum())
    )


def evaluate_vq_needle(
    vq,
    *,
    num_frames: int = 120,
    trials: int = 32,
    seed: int = 0,
    source_fps: int = 8,
    colours: Optional[Sequence[str]] = None,
    batch_frames: int = 64,
    out_dir: Optional[str | Path] = None,
    progress: bool = True,
) -> dict:
    """Does a one-frame flash survive the video tokenizer? The rate of flashes decoded nearest their
    colour, overall and per position in the code group (docs/hour.md, "The needle through the
    tokenizer"). vq: a VQModel, or a model directory whose vq/ is used."""
    if isinstance(vq, (str, Path)):
        vq = load_model(vq).vq
    colours = list(colours or NEEDLE_CHOICES)
    size, rng = vq.cfg.resolution, np.random.default_rng(seed)
    groups = vq.group_frame_index(num_frames)
    offset_of = {k: g.index(k) for g in groups for k in g}
    cells = []
    for trial in tqdm(range(trials), desc="needle through the VQ", disable=not progress):
        frames = haystack_frames(num_frames, size, seed + 7919 * (trial + 1), source_fps)
        k = int(
            rng.integers(1, num_frames)
        )  # frame 0 of causal3d is a group of its own: counted apart
        c = colours[trial % len(colours)]
        frames[k] = np.asarray(COLOURS[c], np.uint8)
        codes = encode_video(vq, torch.from_numpy(frames), batch_frames=batch_frames)
        decoded = decode_codes(vq, codes)[:num_frames].numpy()
        got = nearest_colour(decoded[k], colours)
        cells.append(
            {
                "trial": trial,
                "frame": k,
                "offset_in_group": offset_of[k],
                "colour": c,
                "decoded": got,
                "correct": got == c,
            }
        )
    offsets = sorted({x["offset_in_group"] for x in cells})
    per = {
        o: float(np.mean([x["correct"] for x in cells if x["offset_in_group"] == o]))
        for o in offsets
    }
    result = {
        "task": "vq_needle",
        "frames": num_frames,
        "trials": trials,
        "vq_mode": vq.cfg.mode,
        "frames_per_group": vq.cfg.frames_per_group,
        "rate": float(np.mean([x["correct"] for x in cells])),
        "rate_by_offset": {str(o): r for o, r in per.items()},
        "cells": cells,
    }
    return _write(
        result,
        out_dir,
        "vq_needle",
        [[per[o] for o in offsets]],
        [str(o) for o in offsets],
        ["decoded"],
        title=f"Flash colour after the tokenizer ({result['rate']:.1%} of {trials})",
        xlabel="flash frame's position in its code group",
        ylabel="",
    )
