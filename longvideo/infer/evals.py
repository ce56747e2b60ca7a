"""Evaluations: QA accuracy on shards, text and video needle-in-a-haystack, a flash through the VQ;
each returns a dict, written as OUT/NAME.json and a heatmap OUT/NAME.png when its settings name an
`out_dir` (docs/inference.md, "Evaluations"; one's own haystack and needle: docs/evaluation.md).

Each evaluation is a class run in named steps, told what to do by frozen settings (QASettings,
TextNeedleSettings, VideoNeedleSettings, VQNeedleSettings) and how to run by a Runtime (the
engine, the ranks, the progress bar); `evaluate_qa`, `evaluate_text_needle`,
`evaluate_video_needle` and `evaluate_vq_needle` build both from keywords and run it. What crosses
ranks is a typed record (TrialCodes, longvideo.distributed.broadcast_record), and ranks agree on
failures with longvideo.distributed.fail_together.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from tqdm.auto import tqdm

from longvideo.atomic import write_text_atomic
from longvideo.data.codes import video_to_codes
from longvideo.data.questions import question_type
from longvideo.data.shards import index_tar, iter_raw_samples, iter_token_samples
from longvideo.data.streams import ShardError, SkipStats, expand_shards
from longvideo.data.synthetic import (
    COLOUR_NAMES,
    COLOURS,
    NEEDLE_CHOICES,
    NEEDLE_QUESTION,
    SHAPE_KINDS,
    SyntheticSample,
    SyntheticSpec,
    make_sample,
    read_frame,
    write_mp4,
)
from longvideo.data.templates import build_prompt
from longvideo.data.video import VideoError, read_video, resize_crop
from longvideo.distributed import broadcast_record, fail_together, together
from longvideo.infer.chat import (
    ChatSession,
    EncodedVideo,
    fit_codes,
    generate_answer,
    infer_config,
    load_model,
)
from longvideo.infer.generation import Engine, LocalEngine
from longvideo.infer.scoring import (
    exact_match,
    length_label,
    normalise,
    score_answers,
    substring_match,
)
from longvideo.vq.codec import SplicingEncoder, decode_codes, encode_video

EngineFactory = Callable[[object], Engine]
"""Builds the engine for a loaded model (default: a LocalEngine with the config's prefill chunk)."""
S = TypeVar("S")


@dataclass(frozen=True)
class Runtime:
    """How an evaluation runs in this process, beside what it is told (its settings)."""

    engine_factory: EngineFactory | None = None
    """Builds the engine for the loaded model (None: a LocalEngine)."""
    group: Any = None
    """The process group every rank of which runs the same evaluation (None: one process)."""
    progress: bool = True
    """Show a progress bar."""

    def size_rank(self) -> tuple[int, int]:
        """(W, r) of the group; (1, 0) without one."""
        if self.group is None:
            return 1, 0
        return dist.get_world_size(self.group), dist.get_rank(self.group)

    def agree(self, error: BaseException | None) -> None:
        """Every rank of the group passes its own error or None: all return, or all raise
        (longvideo.distributed.fail_together). Without a group, only re-raises `error`."""
        if self.group is not None:
            fail_together(error, self.group)
        elif error is not None:
            raise error


RUNTIME_FIELDS = tuple(f.name for f in dataclasses.fields(Runtime))
OLD_NAMES = {"encode_group": "group"}
"""Keywords the evaluate_* functions still take under their older name."""


def settings_and_runtime(
    kind: type[S], settings: S | None, options: dict, caller: str
) -> tuple[S, Runtime]:
    """`kind` settings (from `settings` with `options` replacing fields, or from `options`) and the
    Runtime that `options`' engine_factory, group (or encode_group) and progress give; TypeError
    naming any other keyword."""
    options = dict(options)
    for old, new in OLD_NAMES.items():
        if old in options:
            if new in options:
                raise TypeError(f"{caller}() got both {old}= and {new}= (the same thing)")
            options[new] = options.pop(old)
    run = {k: options.pop(k) for k in RUNTIME_FIELDS if k in options}
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"{caller}() got unexpected keywords {unknown}; {kind.__name__} has "
            f"{sorted(known)}, Runtime has {list(RUNTIME_FIELDS)}"
        )
    if settings is not None and not isinstance(settings, kind):
        raise TypeError(f"{caller}() takes a {kind.__name__}, got {type(settings).__name__}")
    built = kind(**options) if settings is None else dataclasses.replace(settings, **options)
    return built, Runtime(**run)


def _floats(values) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


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
    """values (len(ylabels), len(xlabels)) in [0, 1] as a red-to-green grid with the numbers
    written in, at `path` (its directory created when missing)."""
    from matplotlib.figure import Figure  # here: only the plots pay for matplotlib's import

    values = np.asarray(values, dtype=float)
    fig = Figure(figsize=(1.2 + 0.9 * len(xlabels), 1.2 + 0.55 * len(ylabels)))
    ax = fig.subplots()
    image = ax.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(xlabels)), [str(x) for x in xlabels])
    ax.set_yticks(range(len(ylabels)), [str(y) for y in ylabels])
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    for (i, j), v in np.ndenumerate(values):
        if np.isfinite(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(
        path, dpi=120, bbox_inches="tight"
    )  # long question labels: grow the canvas, not squeeze


def _write(
    result: dict,
    out_dir: str | Path | None,
    name: str,
    values,
    xlabels: Sequence,
    ylabels: Sequence,
    **labels,
) -> dict:
    """`result` as OUT/NAME.json and `values` as the heatmap OUT/NAME.png (save_heatmap's
    labels)."""
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


def open_session(pretrained, video: EncodedVideo, infer, engine_factory: EngineFactory | None):
    """A ChatSession on the factory's engine (default: the session's LocalEngine)."""
    engine = engine_factory(pretrained) if engine_factory is not None else None
    return ChatSession(pretrained, video, infer=infer, engine=engine)


def _qa_samples(
    pretrained, shards, *, fps: float, max_frames: int | None, batch_frames: int, stats
) -> Iterator[tuple[str, np.ndarray, np.ndarray, dict]]:
    """(key, codes, timestamps, meta) of token shards, or of raw shards encoded with the model's
    VQ."""
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
                video_codes = video_to_codes(
                    pretrained.vq,
                    raw.video,
                    fps=fps,
                    max_frames=max_frames,
                    batch_frames=batch_frames,
                )
            except VideoError as e:
                stats.skip("video_error", f"{path}:{raw.key}", str(e))
                continue
            yield raw.key, video_codes.codes, video_codes.timestamps, raw.meta


def _mean(records: list[dict], key: str) -> float | None:
    """The mean of the records' `key`, those that are None left out; None when all are."""
    values = [r[key] for r in records if r[key] is not None]
    return float(np.mean(values)) if values else None


@dataclass(frozen=True)
class QASettings:
    """What `eval qa` is told (docs/inference.md, "Evaluations")."""

    shards: str | Path | Sequence[str]
    """Token shards, or raw shards the model's VQ encodes: a directory, glob, pattern or list."""
    out_dir: str | Path | None = None
    """Where qa.json and qa.png are written (None: nowhere)."""
    max_samples: int | None = None
    """Most samples read (None: all)."""
    max_new_tokens: int = 16
    """Most answer tokens."""
    fps: float = 1.0
    """Raw shards: frames per second read."""
    max_frames: int | None = 3600
    """Raw shards: most frames read per video."""
    lengths: tuple[float, ...] = ()
    """Video lengths (seconds, ascending) to score apart: a video counts at the shortest length it
    does not exceed; per question type and length in qa.json and qa_lengths.png. Empty: the
    records' own durations in three bins of equal counts."""


class QAEvaluation:
    """`eval qa` in named steps: `samples` (the shards' samples, the ranks agreeing after each),
    `ask` (one session per sample, every question), `summarise` (accuracy per question and length
    bin), `write`. The group's ranks read the samples each and agree after every one."""

    name = "qa"

    def __init__(self, model, settings: QASettings, runtime: Runtime):
        self.settings, self.runtime = settings, runtime
        self.pretrained, self.infer = greedy(model, settings.max_new_tokens)
        self.stats = SkipStats()

    def samples(self) -> Iterator[tuple[str, np.ndarray, np.ndarray, dict]]:
        """(key, codes, timestamps, meta) of every sample up to max_samples."""
        s = self.settings
        samples = _qa_samples(
            self.pretrained,
            s.shards,
            fps=s.fps,
            max_frames=s.max_frames,
            batch_frames=self.infer.encode_batch_frames,
            stats=self.stats,
        )
        for n, sample in enumerate(together(samples, self.runtime.group)):
            if s.max_samples is not None and n >= s.max_samples:
                break
            yield sample

    def ask(self, key: str, codes: np.ndarray, stamps: np.ndarray, meta: dict) -> list[dict]:
        """One record per question of the sample (none when it has no QA)."""
        qa = [
            x
            for x in meta.get("qa", [])
            if isinstance(x, dict) and "question" in x and "answer" in x
        ]
        if not qa:
            self.stats.skip("no_qa", key)
            return []
        duration = float(meta.get("duration", stamps[-1] if len(stamps) else 0.0))
        longest = max(qa, key=lambda x: len(x["question"]))["question"]
        kept_codes, kept_stamps, _ = fit_codes(
            self.pretrained, codes, stamps, longest, self.infer.max_new_tokens
        )
        video = EncodedVideo(
            codes=kept_codes,
            timestamps=kept_stamps,
            num_frames=len(kept_stamps),
            duration=duration,
            fps=len(kept_stamps) / max(duration, 1e-9),
        )
        # the video is prefilled once
        session = open_session(self.pretrained, video, self.infer, self.runtime.engine_factory)
        records = []
        for x in qa:
            pred = session.ask(x["question"])
            choices = x.get("choices")
            records.append(
                {
                    "key": key,
                    "question": x["question"],
                    "type": question_type(x),
                    "choices": list(choices) if choices else None,
                    "answer": str(x["answer"]),
                    "prediction": pred,
                    "exact": exact_match(pred, str(x["answer"])),
                    "substring": substring_match(pred, str(x["answer"])),
                    "chance": 1.0 / len(choices) if choices else None,
                    "duration": duration,
                    "groups": int(kept_codes.shape[0]),
                    "groups_dropped": int(codes.shape[0] - kept_codes.shape[0]),
                }
            )
        return records

    def summarise(self, records: list[dict], seconds: float) -> tuple[dict, np.ndarray, list]:
        """The result, its grid (question x duration bin; nan: no record) and the bins."""
        if not records:
            raise ValueError(
                f"no QA samples found in {self.settings.shards!r} (skipped: {dict(self.stats)})"
            )
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
        # [a, b), the last [a, b]
        col = np.searchsorted([b for _, b in bins[:-1]], durations, side="right")
        grid = np.array(
            [
                [
                    _mean(
                        [r for r, c in zip(records, col) if r["question"] == q and c == j], "exact"
                    )
                    for j in range(len(bins))
                ]
                for q in questions
            ],
            dtype=float,
        )
        per_question = {
            q: {
                "accuracy": _mean(asked, "exact"),
                "count": len(asked),
                "chance": _mean(asked, "chance"),
            }
            for q, asked in by_question.items()
        }
        typed = score_answers(records, self.settings.lengths)
        result = {
            "task": "qa",
            "accuracy": _mean(records, "exact"),
            "substring_accuracy": _mean(records, "substring"),
            "chance": _mean(records, "chance"),
            "questions": len(records),
            "samples": len({r["key"] for r in records}),
            "per_question": per_question,
            "per_type": typed["per_type"],
            "lengths": typed["lengths"],
            "type_grid": typed["grid"],
            "chance_grid": typed["chance_grid"],
            "beyond_lengths": typed["beyond"],
            "duration_bins": bins,
            "grid": [[None if not np.isfinite(v) else float(v) for v in row] for row in grid],
            "skipped": {k: v for k, v in self.stats.items() if k != "ok"},
            "seconds": round(seconds, 2),
            "records": records,
        }
        return result, grid, bins

    def write(self, result: dict, grid: np.ndarray, bins: list) -> dict:
        xlabels = [f"{a:.0f}-{b:.0f}s" for a, b in bins]
        if self.settings.out_dir is not None and result["lengths"]:
            save_heatmap(  # question type x video length, chance beside each type
                np.array(result["type_grid"], dtype=float),
                [length_label(x) for x in result["lengths"]],
                [
                    f"{t} (chance {r['chance']:.2f})" if r["chance"] is not None else t
                    for t, r in result["per_type"].items()
                ],
                Path(self.settings.out_dir) / "qa_lengths.png",
                title=f"QA accuracy by question type and video length ({result['samples']} videos)",
                xlabel="video length",
                ylabel="question type",
            )
        return _write(
            result,
            self.settings.out_dir,
            "qa",
            grid,
            xlabels,
            sorted(result["per_question"]),
            xlabel="video length",
            ylabel="question",
            title=f"QA accuracy (chance {result['chance'] or float('nan'):.2f})",
        )

    def run(self) -> dict:
        t0 = time.time()
        records = []
        bar = tqdm(desc="QA eval", unit="sample", disable=not self.runtime.progress)
        for sample in self.samples():
            records += self.ask(*sample)
            bar.update(1)
        bar.close()
        return self.write(*self.summarise(records, time.time() - t0))


def evaluate_qa(model, shards, /, **options) -> dict:
    """Accuracy over every question of the samples in `shards` (token shards, or raw shards that
    the model's VQ encodes); `shards` may be a QASettings. options: QASettings fields (out_dir,
    max_samples, max_new_tokens, fps, max_frames) and Runtime fields (engine_factory, group: the
    ranks of a sequence-parallel prefill, which read the samples each and agree after every one;
    progress)."""
    if isinstance(shards, QASettings):
        settings, runtime = settings_and_runtime(QASettings, shards, options, "evaluate_qa")
    else:
        if "shards" in options:
            raise TypeError("evaluate_qa() got the shards twice")
        settings, runtime = settings_and_runtime(
            QASettings, None, {"shards": shards, **options}, "evaluate_qa"
        )
    return QAEvaluation(model, settings, runtime).run()


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
    insert_at = int(np.argmin(np.abs(offsets - depth * offsets[-1])))
    ids = render(hay[:insert_at] + [needle] + hay[insert_at:])
    depth_at = float(offsets[insert_at] / max(offsets[-1], 1))
    return ids, {"tokens": len(ids), "needle_depth": depth_at}


@dataclass(frozen=True)
class TextNeedleSettings:
    """What `eval text-niah` is told (docs/inference.md, "Evaluations")."""

    lengths: tuple[int, ...] = (256, 512, 1024)
    """Context lengths in tokens (the grid's columns)."""
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    """Needle depths in [0, 1] (the grid's rows)."""
    rounds: int = 2
    """Needles per cell."""
    seed: int = 0
    """Seed of the needles and the haystacks."""
    max_new_tokens: int = 16
    """Most answer tokens."""
    out_dir: str | Path | None = None
    """Where text_needle.json and text_needle.png are written (None: nowhere)."""

    def __post_init__(self):
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
        object.__setattr__(self, "depths", _floats(self.depths))


class TextNeedleEvaluation:
    """LWM's needle retrieval in named steps: per cell of the length x depth grid `needle` (a city
    and a 7-digit number), `prompt` (the haystack with the needle at the depth), `ask` (a fresh
    engine), then `result` and `write`."""

    def __init__(self, model, settings: TextNeedleSettings, runtime: Runtime):
        self.settings, self.runtime = settings, runtime
        self.pretrained, self.infer = greedy(
            model, settings.max_new_tokens, ("tokenizer",), "the text needle evaluation"
        )
        self.rng = np.random.default_rng(settings.seed)
        self.device = next(self.pretrained.model.parameters()).device

    def needle(self) -> tuple[str, int]:
        """The next round's city and number (7 digits, as in LWM)."""
        city = CITIES[int(self.rng.integers(len(CITIES)))]
        return city, int(self.rng.integers(1_000_000, 10_000_000))

    def engine(self) -> Engine:
        if self.runtime.engine_factory:
            return self.runtime.engine_factory(self.pretrained)
        return LocalEngine(self.pretrained.model, prefill_chunk=self.infer.prefill_chunk)

    def ask(self, column: int, depth: float, round_: int) -> dict:
        """One needle of the cell (column's length, depth), asked on a fresh engine."""
        length = self.settings.lengths[column]
        city, number = self.needle()
        ids, facts = text_needle_prompt(
            self.pretrained,
            length,
            depth,
            city,
            number,
            seed=self.settings.seed + 1000 * column + round_,
        )
        engine = self.engine()
        engine.set_prefix(torch.tensor([ids[:-1]], device=self.device))
        pred, gen = generate_answer(self.pretrained, engine, ids[-1:], self.infer)
        return {
            "context": length,
            "depth": float(depth),
            "round": round_,
            "number": number,
            "city": city,
            "prediction": pred,
            "correct": str(number) in pred,
            "tokens": facts["tokens"],
            "needle_depth": facts["needle_depth"],
            "ttft_s": round(engine.prefix_s + gen.ttft_s, 4),
        }

    def write(self, cells: list[dict], grid: np.ndarray) -> dict:
        s = self.settings
        result = {
            "task": "text_needle",
            "protocol": "LWM needle retrieval (substring match of the number)",
            "lengths": list(s.lengths),
            "depths": [float(d) for d in s.depths],
            "rounds": s.rounds,
            "accuracy": float(grid.mean()),
            "chance": 0.0,
            "grid": grid.tolist(),
            "cells": cells,
        }
        return _write(
            result,
            s.out_dir,
            "text_needle",
            grid,
            list(s.lengths),
            [f"{d:.2f}" for d in s.depths],
            title="Text needle retrieval",
            xlabel="context length (tokens)",
            ylabel="needle depth",
        )

    def run(self) -> dict:
        s = self.settings
        grid = np.zeros((len(s.depths), len(s.lengths)))
        cells = []
        bar = tqdm(
            total=len(s.depths) * len(s.lengths) * s.rounds,
            desc="text needle",
            disable=not self.runtime.progress,
        )
        for j in range(len(s.lengths)):
            for i, depth in enumerate(s.depths):
                hits = []
                for round_ in range(s.rounds):
                    cells.append(self.ask(j, depth, round_))
                    hits.append(cells[-1]["correct"])
                    bar.update(1)
                grid[i, j] = float(np.mean(hits))
        bar.close()
        return self.write(cells, grid)


def evaluate_text_needle(model, settings: TextNeedleSettings | None = None, /, **options) -> dict:
    """LWM's needle retrieval over a context-length x depth grid; a cell's score is the fraction of
    its `rounds` needles whose number appears in the answer. options: TextNeedleSettings fields
    (replacing those of `settings`) and Runtime fields (engine_factory, progress)."""
    settings, runtime = settings_and_runtime(
        TextNeedleSettings, settings, options, "evaluate_text_needle"
    )
    return TextNeedleEvaluation(model, settings, runtime).run()


def haystack_frames(
    num_frames: int,
    size: int,
    seed: int,
    source_fps: int = 8,
    *,
    decoded: bool = False,
    shape_scale: float = 1.0,
) -> np.ndarray:
    """A moving-shapes video of `num_frames` seconds at 1 fps (uint8 (T, size, size, 3)), rendered
    at `source_fps`; decoded: through the training videos' writer and read back, else exactly as
    drawn."""
    sample = _haystack_sample(num_frames, size, seed, source_fps, shape_scale)
    if decoded:
        return read_video(sample.mp4(), fps=1.0, size=size).frames.numpy()[:num_frames].copy()
    return sample.frames_at(np.arange(num_frames) * source_fps)


def _haystack_sample(
    num_frames: int, size: int, seed: int, source_fps: int, shape_scale: float
) -> SyntheticSample:
    spec = SyntheticSpec(
        size=size,
        fps=source_fps,
        min_seconds=num_frames,
        max_seconds=num_frames,
        long_fraction=0.0,
        needle_fraction=0.0,
        shape_scale=shape_scale,
    )
    return make_sample(seed, 0, spec)


def haystack_story(
    num_frames: int, size: int, seed: int, source_fps: int = 8, *, shape_scale: float = 1.0
) -> dict:
    """What the background haystack_frames draws shows, for reading a needle grid's misses: its
    seed, its first and last scene ("a red circle") and their colours, and the seconds each colour
    is on screen, most first (a wrong answer that names one of them may have read the background
    rather than the flash; miss_table counts them)."""
    sample = _haystack_sample(num_frames, size, seed, source_fps, shape_scale)
    seconds: dict[str, int] = {}
    for a, b, shape in sample.scenes:
        seconds[shape.colour] = seconds.get(shape.colour, 0) + b - a
    first, last = sample.scenes[0][2], sample.scenes[-1][2]
    return {
        "seed": seed,
        "first": f"a {first.colour} {first.kind}",
        "last": f"a {last.colour} {last.kind}",
        "first_colour": first.colour,
        "last_colour": last.colour,
        "colour_seconds": dict(sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def flash_frame(
    colour: str, size: int, source_fps: int = 8, *, decoded: bool = False
) -> torch.Tensor:
    """A full-frame flash of a needle colour, uint8 (size, size, 3); decoded: as a training video
    carries it, through the codec (docs/inference.md, "Evaluations")."""
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
    """Where trial `trial` of `trials` cuts `length` frames from a haystack of `frames`: spread
    evenly."""
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


@dataclass(frozen=True)
class VideoNeedleSettings:
    """What `eval video-niah` is told (docs/inference.md, "Evaluations"; one's own haystack and
    needle: docs/evaluation.md)."""

    lengths: tuple[int, ...] = (16, 32, 64)
    """Video lengths in frames at 1 fps (the grid's columns)."""
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    """Needle depths in [0, 1] (the grid's rows)."""
    colours: tuple[str, ...] | None = None
    """Needle colours, taken in turn by the trials (None: every colour the needle question asks)."""
    trials: None | int | tuple[int, ...] = None
    """Trials per cell: one number, one per length, or None for one per colour."""
    seed: int = 0
    """Seed of the generated backgrounds."""
    source_fps: int = 8
    """Frame rate the backgrounds and flashes are rendered at before 1 fps sampling."""
    max_new_tokens: int = 8
    """Most answer tokens."""
    out_dir: str | Path | None = None
    """Where video_needle.json, video_needle.png and the needle frames go (None: nowhere)."""
    haystack: str | Path | None = None
    """A video the backgrounds are cut from (read at 1 fps; None: generated moving shapes)."""
    needle: str | Path | None = None
    """An image inserted instead of the colour flashes (needs question and answer)."""
    question: str | None = None
    """The question about the needle image (None: the colour flash question)."""
    answer: str | None = None
    """The needle image's answer (exact match)."""
    decoded: bool = True
    """Generated backgrounds and flashes pass through the training videos' codec first."""
    shape_scale: float = 1.0
    """Generated backgrounds: the shapes' radii times this (as the training videos')."""
    lookalikes: str = "keep"
    """A diagnostic: "scrub" the flash's codes from every other frame, or "add" 3 % more frames
    holding one (edit_lookalikes); "keep": the codes as encoded."""
    control: bool = False
    """Also ask each trial's question over its background with no needle (one more prompt a
    trial): a cell answered as the bare background is answered is a default, not a reading
    (`control` and `default` in each cell; `read` and `defaults` in `misses`)."""

    def __post_init__(self):
        if self.lookalikes not in LOOKALIKE_EDITS:
            raise ValueError(
                f"lookalikes must be one of {LOOKALIKE_EDITS}, got {self.lookalikes!r}"
            )
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
        object.__setattr__(self, "depths", _floats(self.depths))
        if self.colours is not None:
            object.__setattr__(self, "colours", tuple(self.colours))
        if self.trials is not None and not isinstance(self.trials, (int, np.integer)):
            object.__setattr__(self, "trials", tuple(self.trials))
        unknown = [c for c in self.colour_names() if c not in COLOURS]
        if unknown:
            raise ValueError(f"unknown needle colours {unknown}; choose from {list(COLOURS)}")
        self.trials_per_length()
        given = (self.needle is None, self.question is None, self.answer is None)
        if len(set(given)) > 1:
            raise ValueError(
                "a needle image needs its question and answer (needle=, question=, answer=)"
            )

    def colour_names(self) -> list[str]:
        return list(self.colours or NEEDLE_CHOICES)

    def trials_per_length(self) -> list[int]:
        trials = len(self.colour_names()) if self.trials is None else self.trials
        return trials_per_length(self.lengths, trials)


@dataclass(frozen=True)
class TrialCodes:
    """What the rank that encoded a trial sends the others (broadcast_record): the codes of the
    trial's background with its needle spliced in at every depth."""

    length: int
    """The trial's video length in frames (checked on receipt: the ranks walk the grid in step)."""
    trial: int
    """The trial's index among the trials of its length."""
    codes: np.ndarray
    """int64 (depths, G, h, w); with the control, one more row last: the bare background."""


@dataclass(frozen=True)
class Column:
    """One video length of the needle grid."""

    index: int
    """Its column in the grid."""
    frames: int
    """Video length in frames at 1 fps."""
    trials: int
    """Trials of this length."""
    groups: list
    """The VQ's code groups: the frame indices of each."""
    stamps: np.ndarray
    """Each group's timestamp (1 fps: the second of its first frame)."""


class VideoNeedleEvaluation:
    """Needle-frame retrieval in named steps: on construction the model, the needles and the
    haystack video; per length its `column`; per trial `encode` (the background with the needle
    spliced in at every depth), shared between the group's ranks by `shared_trials` (each rank
    encodes trials r, r + W, ... and sends them as TrialCodes); per depth `ask`; then `result`
    and `write`."""

    def __init__(self, model, settings: VideoNeedleSettings, runtime: Runtime):
        self.settings, self.runtime = settings, runtime
        self.pretrained, self.infer = greedy(
            model, settings.max_new_tokens, ("vq", "tokenizer"), "the video needle evaluation"
        )
        self.vq = self.pretrained.vq
        self.size = self.vq.cfg.resolution
        self.per_length = settings.trials_per_length()
        self.needles = self.load_needles()
        self.hay = self.read_haystack()
        self.stories: dict[tuple[int, int], dict] = {}  # (column, trial) -> haystack_story
        self.question = settings.question or NEEDLE_QUESTION

    def load_needles(self) -> list[tuple[str, torch.Tensor]]:
        """(answer, uint8 frame at the VQ's resolution) of the needle image, or of each colour."""
        s = self.settings
        if s.needle is not None:
            img = torch.from_numpy(np.asarray(Image.open(s.needle).convert("RGB")).copy())
            return [(s.answer, resize_crop(img[None], self.size)[0])]
        return [
            (c, flash_frame(c, self.size, s.source_fps, decoded=s.decoded))
            for c in s.colour_names()
        ]

    def read_haystack(self) -> np.ndarray | None:
        """The haystack video's frames at 1 fps (None: generated backgrounds)."""
        s = self.settings
        if s.haystack is None:
            return None
        hay = read_video(str(s.haystack), fps=1.0, size=self.size).frames.numpy()
        if max(s.lengths) > len(hay):
            raise ValueError(
                f"{s.haystack} gives {len(hay)} frames at 1 fps, fewer than the longest length "
                f"{max(s.lengths)}"
            )
        return hay

    def column(self, index: int) -> Column:
        frames = self.settings.lengths[index]
        groups = self.vq.group_frame_index(frames)
        stamps = np.asarray([float(g[0]) for g in groups])
        return Column(index, frames, self.per_length[index], groups, stamps)

    def window(self, column: Column, trial: int) -> int:
        """Where the trial's background starts in the haystack video (0 for generated ones)."""
        if self.hay is None:
            return 0
        return window_start(len(self.hay), column.frames, trial, column.trials)

    def background_seed(self, column: Column, trial: int) -> int:
        """The seed of a trial's generated background."""
        return self.settings.seed + 1000 * column.index + trial

    def background(self, column: Column, trial: int) -> dict | None:
        """What the trial's generated background shows (haystack_story); None for a haystack video."""
        if self.hay is not None:
            return None
        key, s = (column.index, trial), self.settings
        if key not in self.stories:  # asked once per depth: drawn once per trial
            self.stories[key] = haystack_story(
                column.frames,
                self.size,
                self.background_seed(column, trial),
                s.source_fps,
                shape_scale=s.shape_scale,
            )
        return self.stories[key]

    def encode(self, column: Column, trial: int) -> np.ndarray:
        """(depths, G, h, w) codes of the trial's background with its needle at each depth (and,
        with the control, the bare background's codes as one more row)."""
        s = self.settings
        if self.hay is None:
            seed = self.background_seed(column, trial)
            frames = haystack_frames(
                column.frames,
                self.size,
                seed,
                s.source_fps,
                decoded=s.decoded,
                shape_scale=s.shape_scale,
            )
        else:
            frames = self.hay[self.window(column, trial) :][: column.frames]
        background = SplicingEncoder(self.vq, frames, batch_frames=self.infer.encode_batch_frames)
        needle = self.needles[trial % len(self.needles)][1]
        splices = [{needle_index(column.frames, d): needle} for d in s.depths]
        if s.control:
            splices.append({})
        return np.stack([background.codes_with(x).numpy().astype(np.int64) for x in splices])

    def shared_trials(self, column: Column) -> Iterator[np.ndarray]:
        """Every trial's codes in turn. With several ranks, each encodes its trials (t % W == r)
        at once, all agree on any failure first, then each trial's codes go from its rank to all
        as TrialCodes; one process encodes each trial when it comes."""
        world, rank = self.runtime.size_rank()
        if world == 1:
            for trial in range(column.trials):
                yield self.encode(column, trial)
            return
        group, mine, error = self.runtime.group, {}, None
        try:
            mine = {t: self.encode(column, t) for t in range(column.trials) if t % world == rank}
        except Exception as e:  # noqa: BLE001 - raised on every rank by fail_together
            error = e
        self.runtime.agree(error)
        for trial in range(column.trials):
            sent = TrialCodes(column.frames, trial, mine.pop(trial)) if trial in mine else None
            src = dist.get_global_rank(group, trial % world)
            got = broadcast_record(sent, TrialCodes, src=src, group=group)
            if (got.length, got.trial) != (column.frames, trial):
                raise RuntimeError(
                    f"rank {src} sent trial {got.trial} of length {got.length} where trial "
                    f"{trial} of length {column.frames} was due: the ranks' settings differ"
                )
            yield got.codes

    def ask(self, column: Column, trial: int, depth_index: int, codes: np.ndarray) -> dict:
        """The cell record of one trial at one depth (codes: that depth's)."""
        depth = self.settings.depths[depth_index]
        answer = self.needles[trial % len(self.needles)][0]
        frame = needle_index(column.frames, depth)
        group = next(g for g, members in enumerate(column.groups) if frame in members)
        if self.settings.lookalikes != "keep":
            rng = np.random.default_rng([self.settings.seed, column.index, trial, depth_index])
            codes = edit_lookalikes(codes, group, self.settings.lookalikes, rng)
        pred, kept, keep, prompt_len = self.answer(column, codes)
        return {
            "frames": column.frames,
            "depth": float(depth),
            "trial": trial,
            "needle_frame": frame,
            "needle_group": group,
            "frame_in_group": column.groups[group].index(frame),
            "colour": answer,
            "prediction": pred,
            "correct": exact_match(pred, answer),
            "substring": substring_match(pred, answer),
            "groups": int(kept.shape[0]),
            "needle_kept": group in set(keep),
            "window_start": self.window(column, trial),
            "tokens": prompt_len,
            "background": self.background(column, trial),
        }

    def answer(self, column: Column, codes: np.ndarray) -> tuple[str, np.ndarray, list[int], int]:
        """The model's answer to the question over `codes` (G, h, w), cut to fit the context:
        (answer, kept codes, kept group indices, prompt tokens)."""
        kept, stamps, keep = fit_codes(
            self.pretrained, codes, column.stamps, self.question, self.infer.max_new_tokens
        )
        video = EncodedVideo(
            codes=kept,
            timestamps=stamps,
            num_frames=column.frames,
            duration=float(column.frames),
            fps=1.0,
        )
        session = open_session(self.pretrained, video, self.infer, self.runtime.engine_factory)
        pred = session.ask(self.question)
        return pred, kept, keep, session.last.prompt_len

    def control(self, trial_cells: list[dict], codes: np.ndarray, column: Column) -> None:
        """The control of one trial: the answer over its bare background (`codes`) goes into
        each of its cells as `control`; `default` says whether the cell's answer is the same
        (after the scorer's normalisation): such a cell, right or wrong, did not need the needle;
        `control_right` whether the bare background's answer is the needle's (then a right answer
        cannot tell a reading from the default)."""
        bare = self.answer(column, codes)[0]
        for cell in trial_cells:
            cell["control"] = bare
            cell["default"] = normalise(cell["prediction"]) == normalise(bare)
            cell["control_right"] = exact_match(bare, cell["colour"])

    def result(self, cells: list[dict], hits: np.ndarray) -> dict:
        s = self.settings
        per_length = np.asarray(self.per_length)
        return {
            "task": "video_needle",
            "lengths": list(s.lengths),
            "depths": [float(d) for d in s.depths],
            "colours": [a for a, _ in self.needles],
            "trials": self.per_length,
            "accuracy": float(hits.sum() / (len(s.depths) * sum(self.per_length))),
            "chance": 1.0 / len(s.colour_names()) if s.needle is None else 0.0,
            "grid": (hits / per_length[None, :]).tolist(),
            "needles_dropped": sum(not c["needle_kept"] for c in cells),
            "context": self.pretrained.model.cfg.max_seq_len,
            "cells": cells,
            "vq_mode": self.vq.cfg.mode,
            "question": self.question,
            "decoded": s.decoded,
            "lookalikes": s.lookalikes,
            "control": s.control,
            "haystack": None if s.haystack is None else str(s.haystack),
            "haystack_frames": None if self.hay is None else len(self.hay),
            "misses": miss_table(cells),
        }

    def write(self, result: dict) -> dict:
        s = self.settings
        if s.out_dir is not None:  # the exact frames inserted, at the tokenizer's resolution
            frames_dir = Path(s.out_dir) / "video_needle_frames"
            frames_dir.mkdir(parents=True, exist_ok=True)
            result["needle_frames"] = {
                a: str(frames_dir / f"needle_{k}.png") for k, (a, _) in enumerate(self.needles)
            }
            for a, frame in self.needles:
                Image.fromarray(frame.numpy()).save(result["needle_frames"][a])
        return _write(
            result,
            s.out_dir,
            "video_needle",
            np.asarray(result["grid"]),
            list(s.lengths),
            [f"{d:.2f}" for d in s.depths],
            title=f"Video needle retrieval (chance {result['chance']:.2f})",
            xlabel="video length (frames at 1 fps)",
            ylabel="needle depth",
        )

    def run(self) -> dict:
        depths = self.settings.depths
        hits = np.zeros((len(depths), len(self.per_length)))
        cells = []
        bar = tqdm(
            total=len(depths) * sum(self.per_length),
            desc="video needle",
            disable=not self.runtime.progress,
        )
        for j in range(len(self.per_length)):
            column = self.column(j)
            for trial, codes in enumerate(self.shared_trials(column)):
                for i in range(len(depths)):
                    cells.append(self.ask(column, trial, i, codes[i]))
                    hits[i, j] += cells[-1]["correct"]
                    bar.update(1)
                if self.settings.control:
                    self.control(cells[-len(depths) :], codes[len(depths)], column)
        bar.close()
        return self.write(self.result(cells, hits))


def _scene_colour(story: dict, end: str) -> str:
    """The colour of a background story's first or last scene; stories written before the colour
    had a field of its own carry it only in the scene's words ("a red circle")."""
    return story.get(f"{end}_colour") or story[end].split()[1]


def miss_table(cells: list[dict]) -> dict:
    """How a needle grid's wrong answers fall: per length, the trials (backgrounds) missed at every
    depth, and the wrong answers that name the background's most-seen colour, the colour of its
    first or last scene, another colour, or no colour at all (a shape word, an empty answer). A
    model that read the flash misses at random depths and colours; one that read the background
    misses whole trials, naming what the background shows. Each trial has one flash colour, so a
    trial missed at every depth is the background's doing or the colour's: `by_colour` (per length,
    each colour's flashes named right of those asked) tells the two apart. With the control
    (cells holding `default`), `defaults` counts the cells answered as their bare background is,
    `read` the right answers that are not (the needle changed the answer), and `decidable` the
    cells whose bare background's answer is not the needle's (only there can a right answer be
    told from a default: read / decidable is the reading rate); each colour of `by_colour` gets
    its own `read` and `decidable`. A right answer that is the background's default is a guess
    that happened to fit."""
    out = {}
    for frames in sorted({c["frames"] for c in cells}):
        mine = [c for c in cells if c["frames"] == frames]
        trials: dict[int, list[bool]] = {}
        for c in mine:
            trials.setdefault(c["trial"], []).append(bool(c["correct"]))
        controlled = all("default" in c for c in mine)

        def read(c) -> bool:
            return bool(c["correct"]) and not c["default"]

        row = {
            "wrong": sum(not c["correct"] for c in mine),
            "trials": len(trials),
            "trials_missed_at_every_depth": sum(not any(v) for v in trials.values()),
            "by_colour": {
                colour: {
                    "right": sum(bool(c["correct"]) for c in mine if c["colour"] == colour),
                    "asked": sum(c["colour"] == colour for c in mine),
                    **(
                        {
                            "read": sum(read(c) for c in mine if c["colour"] == colour),
                            "decidable": sum(
                                not c["control_right"] for c in mine if c["colour"] == colour
                            ),
                        }
                        if controlled
                        else {}
                    ),
                }
                for colour in dict.fromkeys(c["colour"] for c in mine)
            },
        }
        if controlled:
            row["read"] = sum(read(c) for c in mine)
            row["defaults"] = sum(bool(c["default"]) for c in mine)
            row["decidable"] = sum(not c["control_right"] for c in mine)
        if all(c.get("background") for c in mine):
            kinds = dict.fromkeys(("most_seen", "first_or_last", "other_colour", "no_colour"), 0)
            for c in mine:
                if c["correct"]:
                    continue
                said = c["prediction"].strip().lower().rstrip(".")
                bg = c["background"]
                ends = {_scene_colour(bg, "first"), _scene_colour(bg, "last")}
                if said not in COLOUR_NAMES:
                    kinds["no_colour"] += 1
                elif said == next(iter(bg["colour_seconds"])):
                    kinds["most_seen"] += 1
                elif said in ends:
                    kinds["first_or_last"] += 1
                else:
                    kinds["other_colour"] += 1
            row["wrong_answers_naming"] = kinds
        out[str(frames)] = row
    return out


def evaluate_video_needle(model, settings: VideoNeedleSettings | None = None, /, **options) -> dict:
    """Needle-frame retrieval over a video-length (frames at 1 fps) x depth grid: per cell, the
    fraction of its trials whose needle is named (exact match). options: VideoNeedleSettings
    fields (replacing those of `settings`: lengths, depths, colours, trials, seed, source_fps,
    max_new_tokens, out_dir, haystack, needle, question, answer, decoded) and Runtime fields
    (engine_factory; group, or its older name encode_group: the ranks that all run the call and
    share the encoding; progress). docs/inference.md, "Evaluations"."""
    settings, runtime = settings_and_runtime(
        VideoNeedleSettings, settings, options, "evaluate_video_needle"
    )
    return VideoNeedleEvaluation(model, settings, runtime).run()


def nearest_colour(frame: np.ndarray, colours: Sequence[str]) -> str:
    """The needle colour closest (RGB distance) to a frame's mean colour."""
    mean = frame.reshape(-1, 3).astype(np.float64).mean(0)
    return min(
        colours, key=lambda c: float(((mean - np.asarray(COLOURS[c], np.float64)) ** 2).sum())
    )


def lookalike_table(flashes: dict[str, list], ordinary) -> dict:
    """How alike each colour's flash is, in codes, to frames without a flash. `flashes`: colour ->
    the code groups (any shape) of its flash frames; `ordinary`: the code groups of frames with no
    flash, (N, ...). Per colour: `codes`, its flash's most frequent code tuple (`tuples`: how many
    tuples its flashes had); `share_per_code`, for each of those codes the share of ordinary frames
    that hold it in any cell (a language model's code embedding does not know the cell);
    `share_any`, the share holding at least one of them; `unique_codes`, how many of them no
    ordinary frame holds: a flash with one is found by that code alone (docs/hour.md, "Look-alike
    codes")."""
    ordinary = np.asarray(ordinary)
    flat = ordinary.reshape(len(ordinary), int(np.prod(ordinary.shape[1:])))
    table = {}
    for colour, groups in flashes.items():
        tuples: dict[tuple, int] = {}
        for g in groups:
            key = tuple(int(c) for c in np.asarray(g).reshape(-1))
            tuples[key] = tuples.get(key, 0) + 1
        codes = max(tuples, key=tuples.get)
        held = {c: (flat == c).any(1) for c in set(codes)}  # per distinct code: which frames
        anywhere = np.logical_or.reduce(list(held.values()))
        table[colour] = {
            "codes": list(codes),
            "tuples": len(tuples),
            "share_per_code": [float(held[c].mean()) if len(flat) else 0.0 for c in codes],
            "share_any": float(anywhere.mean()) if len(flat) else 0.0,
            "unique_codes": sum(not h.any() for h in held.values()),
            "ordinary_frames": len(flat),
        }
    return table


LOOKALIKE_EDITS: tuple[str, ...] = ("keep", "scrub", "add")
"""What `VideoNeedleSettings.lookalikes` may do to a trial's codes (edit_lookalikes)."""


def edit_lookalikes(
    codes: np.ndarray,
    group: int,
    mode: str,
    rng: np.random.Generator,
    share: float = 0.03,
    reach: int = 3,
) -> np.ndarray:
    """A diagnostic edit of a needle trial's codes (G, h, w), the flash at group `group`. The
    flash's own group and the `reach - 1` after it (which a causal tokenizer computes with the
    flash in view) are never touched. "keep": unchanged. "scrub": in every other group, each code
    that is one of the flash's codes becomes its cell's most frequent code that is not (no
    ordinary frame then matches the flash in any code; a cell with no other code takes the most
    frequent other code of any cell). "add": `share` of the other groups, drawn
    at random, get one of the flash's codes in its own cell (look-alikes beyond those the
    background has). docs/hour.md, "Look-alike codes"."""
    if mode not in LOOKALIKE_EDITS:
        raise ValueError(f"lookalikes must be one of {LOOKALIKE_EDITS}, got {mode!r}")
    out = np.array(codes, copy=True)
    if mode == "keep":
        return out
    flash = out[group].reshape(-1).copy()
    others = np.setdiff1d(np.arange(len(out)), np.arange(group, group + reach))
    cells = out.reshape(len(out), -1)  # a view: edits land in `out`
    if mode == "scrub":

        def most_frequent_other(values) -> int:
            values, counts = np.unique(values, return_counts=True)
            keep = ~np.isin(values, flash)
            return int(values[keep][np.argmax(counts[keep])]) if keep.any() else -1

        anywhere = most_frequent_other(cells[others])
        if anywhere < 0:  # every code of every other group is the flash's: the lowest one not
            anywhere = min(set(range(int(flash.max()) + 2)) - set(flash.tolist()))
        for k in range(cells.shape[1]):
            fill = most_frequent_other(cells[others, k])
            fill = anywhere if fill < 0 else fill  # the cell holds only flash codes
            col = cells[others, k]
            cells[others, k] = np.where(np.isin(col, flash), fill, col)
        return out
    n = int(round(share * len(others)))
    chosen = rng.choice(others, size=n, replace=False)
    where = rng.integers(0, cells.shape[1], size=n)
    cells[chosen, where] = flash[where]
    return out


@dataclass(frozen=True)
class VQNeedleSettings:
    """What `eval vq-needle` is told (docs/hour.md, "The needle through the tokenizer")."""

    num_frames: int = 120
    """Video length in frames (1 fps)."""
    trials: int = 32
    """Flashes, one per video."""
    seed: int = 0
    """Seed of the backgrounds and of the flash positions."""
    source_fps: int = 8
    """Frame rate the backgrounds are rendered at before 1 fps sampling."""
    shape_scale: float = 1.0
    """The backgrounds' shapes: radii times this (as the training videos')."""
    colours: tuple[str, ...] | None = None
    """Flash colours, taken in turn (None: every colour the needle question asks)."""
    batch_frames: int = 64
    """Frames the VQ encodes per call."""
    out_dir: str | Path | None = None
    """Where vq_needle.json and vq_needle.png are written (None: nowhere)."""

    def __post_init__(self):
        if self.colours is not None:
            object.__setattr__(self, "colours", tuple(self.colours))


class VQNeedleEvaluation:
    """Does a one-frame flash survive the video tokenizer? In named steps: per trial `flash` (a
    background with one frame a solid colour, through the VQ and back, and the colour nearest
    the decoded frame), then `result` (the rate overall and per position in the code group) and
    `write`."""

    def __init__(self, vq, settings: VQNeedleSettings, runtime: Runtime):
        self.vq = load_model(vq).vq if isinstance(vq, (str, Path)) else vq
        self.settings, self.runtime = settings, runtime
        self.colours = list(settings.colours or NEEDLE_CHOICES)
        self.rng = np.random.default_rng(settings.seed)
        groups = self.vq.group_frame_index(settings.num_frames)
        self.offset_of = {k: g.index(k) for g in groups for k in g}
        self.group_of = {k: i for i, g in enumerate(groups) for k in g}
        self.flash_codes: dict[str, list[np.ndarray]] = {}  # colour -> its flash groups' codes
        self.ordinary: list[np.ndarray] = []  # the plain backgrounds' code groups

    def background_seed(self, trial: int) -> int:
        return self.settings.seed + 7919 * (trial + 1)

    def lookalike_codes(self, trial: int, frame: int, colour: str) -> np.ndarray:
        """The trial's background and flash as a training video carries them (through the codec,
        as `eval video-niah` splices them): its plain codes join `ordinary`, and the flash's code
        group, returned, joins `flash_codes[colour]` (the look-alike table)."""
        s, size = self.settings, self.vq.cfg.resolution
        frames = haystack_frames(
            s.num_frames,
            size,
            self.background_seed(trial),
            s.source_fps,
            decoded=True,
            shape_scale=s.shape_scale,
        )
        plain = encode_video(self.vq, torch.from_numpy(frames.copy()), batch_frames=s.batch_frames)
        self.ordinary.append(plain.numpy())
        frames[frame] = flash_frame(colour, size, s.source_fps, decoded=True).numpy()
        codes = encode_video(self.vq, torch.from_numpy(frames), batch_frames=s.batch_frames)
        group = codes[self.group_of[frame]].numpy()
        self.flash_codes.setdefault(colour, []).append(group)
        return group

    def flash(self, trial: int) -> dict:
        s, size = self.settings, self.vq.cfg.resolution
        frames = haystack_frames(
            s.num_frames, size, self.background_seed(trial), s.source_fps, shape_scale=s.shape_scale
        )
        # frame 0 of causal3d is a group of its own: counted apart
        frame = int(self.rng.integers(1, s.num_frames))
        colour = self.colours[trial % len(self.colours)]
        group = self.lookalike_codes(trial, frame, colour)
        frames[frame] = np.asarray(COLOURS[colour], np.uint8)
        codes = encode_video(self.vq, torch.from_numpy(frames), batch_frames=s.batch_frames)
        decoded = decode_codes(self.vq, codes)[: s.num_frames].numpy()
        got = nearest_colour(decoded[frame], self.colours)
        # the other frames' shapes, read from the drawn and the decoded frame: what the questions
        # about shapes need the codes to keep (docs/hour.md, "What the tokenizer keeps")
        read = [(read_frame(frames[t]), read_frame(decoded[t])) for t in range(s.num_frames)]
        shapes = [(a, b) for t, (a, b) in enumerate(read) if t != frame and a["kind"] == "shape"]
        return {
            "trial": trial,
            "frame": frame,
            "offset_in_group": self.offset_of[frame],
            "colour": colour,
            "flash_codes": [int(c) for c in group.reshape(-1)],  # through the codec
            "decoded": got,
            "correct": got == colour,
            "shape_frames": len(shapes),
            "shape_colour": sum(a["colour"] == b["colour"] for a, b in shapes),
            "shape_kind": sum(b["kind"] == "shape" and a["shape"] == b["shape"] for a, b in shapes),
        }

    def result(self, cells: list[dict]) -> dict:
        offsets = sorted({x["offset_in_group"] for x in cells})
        per = {
            o: float(np.mean([x["correct"] for x in cells if x["offset_in_group"] == o]))
            for o in offsets
        }
        shapes = sum(x["shape_frames"] for x in cells)
        return {
            "task": "vq_needle",
            "frames": self.settings.num_frames,
            "trials": self.settings.trials,
            "vq_mode": self.vq.cfg.mode,
            "frames_per_group": self.vq.cfg.frames_per_group,
            "rate": float(np.mean([x["correct"] for x in cells])),
            "rate_by_offset": {str(o): r for o, r in per.items()},
            "shape_frames": shapes,
            "shape_colour_rate": sum(x["shape_colour"] for x in cells) / max(shapes, 1),
            "shape_colour_chance": 1.0 / len(COLOUR_NAMES),
            "shape_kind_rate": sum(x["shape_kind"] for x in cells) / max(shapes, 1),
            "shape_kind_chance": 1.0 / len(SHAPE_KINDS),
            "lookalikes": lookalike_table(
                self.flash_codes,
                np.concatenate(self.ordinary) if self.ordinary else np.zeros((0, 1), np.int64),
            ),
            "cells": cells,
        }

    def write(self, result: dict) -> dict:
        by_offset = result["rate_by_offset"]
        return _write(
            result,
            self.settings.out_dir,
            "vq_needle",
            [list(by_offset.values())],
            list(by_offset),
            ["decoded"],
            title=f"Flash colour after the tokenizer ({result['rate']:.1%} of {result['trials']}); "
            f"shapes: colour {result['shape_colour_rate']:.0%}, kind {result['shape_kind_rate']:.0%}",
            xlabel="flash frame's position in its code group",
            ylabel="",
        )

    def run(self) -> dict:
        trials = range(self.settings.trials)
        progress = self.runtime.progress
        cells = [
            self.flash(t) for t in tqdm(trials, desc="needle through the VQ", disable=not progress)
        ]
        return self.write(self.result(cells))


def evaluate_vq_needle(vq, settings: VQNeedleSettings | None = None, /, **options) -> dict:
    """Does a one-frame flash survive the video tokenizer? The rate of flashes decoded nearest
    their colour, overall and per position in the code group (docs/hour.md, "The needle through
    the tokenizer"). vq: a VQModel, or a model directory whose vq/ is used. options:
    VQNeedleSettings fields (replacing those of `settings`) and progress."""
    settings, runtime = settings_and_runtime(
        VQNeedleSettings, settings, options, "evaluate_vq_needle"
    )
    return VQNeedleEvaluation(vq, settings, runtime).run()
