"""`eval mcq`: answer every question of a benchmark, score them, and write OUT/predictions.jsonl (a
killed run resumes), OUT/summary.json and OUT/summary.png (docs/evaluation.md).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch.distributed as dist
from tqdm.auto import tqdm

from longvideo.atomic import write_json_atomic
from longvideo.data.templates import ANSWER_TEXT, parse_answer
from longvideo.data.video import VideoError, probe_video, sample_indices
from longvideo.distributed import broadcast_text
from longvideo.infer.benchmarks import (
    LETTERS,
    Question,
    read_benchmark,
    read_subtitles,
    subtitles_at,
)
from longvideo.infer.chat import encode_video_file, share_video
from longvideo.infer.evals import greedy, open_session

MODES: tuple[str, ...] = ("likelihood", "generate")
LETTER_PROMPT = "Answer with the option's letter from the given choices directly."
SUBTITLE_PROMPT = "This video's subtitles are listed below:\n{subtitles}\n"
BOOTSTRAP_RESAMPLES = 1000
SETTINGS = ("benchmark", "mode", "subtitles", "fps", "max_frames", "model")
"""run.json keys a resumed run must share with the run it continues."""


def question_text(q: Question, mode: str, subtitles: str = "") -> str:
    """What is asked: the question alone (likelihood) or with its lettered options (generate)."""
    head = SUBTITLE_PROMPT.format(subtitles=subtitles) if subtitles else ""
    if mode == "likelihood":
        return head + q.question
    opts = "\n".join(f"({LETTERS[i]}) {o}" for i, o in enumerate(q.options))
    return f"{head}{q.question}\n{opts}\n{LETTER_PROMPT}"


def parse_letter(text: str, options) -> Optional[str]:
    """The option letter an answer names: a leading letter ("B", "(B) ...", "B."), an option's
    exact text, or "answer is B" anywhere; None when it names none."""
    s, letters = parse_answer(text), LETTERS[: len(options)]
    m = re.match(r"^\(?([A-J])\)?(?:$|[\s.:)])", s)
    if m and m.group(1) in letters:
        return m.group(1)
    exact = [L for L, o in zip(letters, options) if s.lower() == o.lower().rstrip(".")]
    if exact:
        return exact[0]
    m = re.search(r"\b(?:answer|option) is:?\s*\(?([A-J])\b", s, re.I)
    return m.group(1) if m and m.group(1) in letters else None


def option_ids(tokenizer, option: str) -> list[int]:
    """An option's tokens as the QA template writes an answer (a text piece of its own)."""
    return tokenizer.encode(ANSWER_TEXT.format(answer=option.strip()))


def bootstrap_ci(
    correct, videos, *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> list[float]:
    """95 % interval of the accuracy, resampling videos (docs/evaluation.md gives the procedure)."""
    ids, inv = np.unique(np.asarray(videos, dtype=str), return_inverse=True)
    hits = np.bincount(inv, weights=np.asarray(correct, dtype=float), minlength=len(ids))
    count = np.bincount(inv, minlength=len(ids))
    pick = np.random.default_rng(seed).integers(0, len(ids), (resamples, len(ids)))
    return [float(x) for x in np.percentile(hits[pick].sum(1) / count[pick].sum(1), [2.5, 97.5])]


def _score(records: list[dict]) -> dict:
    correct = [r["correct"] for r in records]
    return {
        "accuracy": float(np.mean(correct)),
        "ci95": bootstrap_ci(correct, [r["video"] for r in records]),
        "questions": len(records),
    }


def summarise(records: list[dict]) -> dict:
    """Accuracy, interval, chance and per-breakdown scores of prediction records."""
    out = {
        **_score(records),
        "chance": float(np.mean([1.0 / r["options"] for r in records])),
        "unparseable": sum(r["prediction"] is None for r in records),
        "breakdowns": {},
    }
    for name in sorted({k for r in records for k in r["groups"]}):
        labels: dict[str, list[dict]] = {}
        for r in records:
            lab = r["groups"].get(name)
            for x in lab if isinstance(lab, list) else [] if lab is None else [lab]:
                labels.setdefault(str(x), []).append(r)
        groups = {k: _score(v) for k, v in sorted(labels.items())}
        out["breakdowns"][name] = {
            "mean_accuracy": float(np.mean([g["accuracy"] for g in groups.values()])),
            "labels": groups,
        }
    return out


def save_bars(summary: dict, path: str | Path, title: str) -> None:
    """Accuracy with its 95 % interval: overall, then one panel per breakdown; chance dashed."""
    from matplotlib.figure import Figure  # here: only the plots pay for matplotlib's import

    panels = [("overall", {"all": summary})] + [
        (k, b["labels"]) for k, b in summary["breakdowns"].items()
    ]
    fig = Figure(figsize=(2 + 0.45 * sum(len(g) for _, g in panels), 4))
    axes = fig.subplots(
        1,
        len(panels),
        sharey=True,
        squeeze=False,
        gridspec_kw={"width_ratios": [len(g) for _, g in panels]},
    )
    for ax, (name, groups) in zip(axes[0], panels):
        acc = np.array([g["accuracy"] for g in groups.values()])
        ci = np.array([g["ci95"] for g in groups.values()]).reshape(-1, 2)
        ax.bar(
            range(len(acc)), acc, yerr=[acc - ci[:, 0], ci[:, 1] - acc], capsize=3, color="tab:blue"
        )
        ax.axhline(summary["chance"], color="grey", ls="--", lw=1)
        ax.set_xticks(
            range(len(acc)),
            [f"{k} ({g['questions']})" for k, g in groups.items()],
            rotation=60,
            ha="right",
            fontsize=7,
        )
        ax.set_title(name, fontsize=9)
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("accuracy (95 % interval)")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def append_line(path: Path, record: dict) -> None:
    """One JSON line, written whole and fsynced (a kill leaves at most a torn last line)."""
    with open(path, "ab") as f:
        f.write((json.dumps(record) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def read_predictions(path: Path) -> list[dict]:
    """The complete lines of a predictions file; a torn last line is cut off the file."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    return [json.loads(line) for line in data[:end].decode().splitlines() if line.strip()]


def _check_settings(out: Path, settings: dict) -> None:
    if not (out / "run.json").is_file():
        return write_json_atomic(out / "run.json", settings)
    old = json.loads((out / "run.json").read_text())
    for k in (k for k in SETTINGS if old.get(k) != settings.get(k)):
        raise ValueError(
            f"{out} holds a run with {k}={old.get(k)!r}, this one has {k}={settings.get(k)!r}: "
            f"continue it with the same settings or choose another --out"
        )


def fit_and_encode(
    pretrained, video, texts: list[str], room: int, fps: float, max_frames, batch: int
):
    """The video read at fps (at most max_frames) and fitted to the longest of `texts` asked about
    it plus `room` answer tokens, VQ-encoded; raises VideoError."""
    tok = pretrained.tokenizer
    longest = max(texts, key=lambda t: len(tok.encode(t)))
    return encode_video_file(
        pretrained,
        video,
        fps=fps,
        max_frames=max_frames,
        question=longest,
        max_new_tokens=room,
        batch_frames=batch,
        progress=False,
    )


def _subtitles(q: Question, fps: float, max_frames) -> str:
    """The subtitle lines at the frames `fps` / `max_frames` sample ("" without a subtitle file)."""
    if not q.subtitles or not Path(q.subtitles).is_file():
        return ""
    info = probe_video(q.video)
    times = sample_indices(info.num_frames, info.fps, fps, max_frames) / info.fps
    return subtitles_at(read_subtitles(q.subtitles, q.subtitle_offset), times)


def evaluate_mcq(
    model,
    benchmark: str,
    data,
    out_dir,
    *,
    mode: str = "likelihood",
    subtitles: bool = False,
    fps: float = 1.0,
    max_frames: Optional[int] = None,
    max_new_tokens: int = 16,
    limit: Optional[int] = None,
    engine_factory: Optional[Callable] = None,
    group=None,
    progress: bool = True,
) -> dict:
    """Answer and score benchmark `benchmark` released under `data`; rank 0 writes the files and
    returns the summary. group: the sequence-parallel group every rank of which runs this call (with
    an engine_factory that builds a SequenceParallelEngine); None: one process."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    pretrained, infer = greedy(
        model, max_new_tokens, ("vq", "tokenizer"), "multiple-choice evaluation"
    )
    tok, t0 = pretrained.tokenizer, time.time()
    rank, src = (
        (dist.get_rank(group), dist.get_global_rank(group, 0)) if group is not None else (0, 0)
    )
    questions = read_benchmark(benchmark, data)[:limit]
    out = Path(out_dir)
    name = model if isinstance(model, (str, Path)) else pretrained.path or ""
    settings = {
        "benchmark": benchmark,
        "mode": mode,
        "subtitles": subtitles,
        "fps": fps,
        "max_frames": max_frames,
        "model": str(name),
        "data": str(data),
    }
    pending = ""
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        _check_settings(out, settings)
        done = {r["question_id"] for r in read_predictions(out / "predictions.jsonl")}
        pending = json.dumps([q.qid for q in questions if q.qid not in done])
    if group is not None:
        pending = broadcast_text(pending, src=src, group=group)
    todo, skipped, encoded = set(json.loads(pending)), {}, 0

    def skip(q: Question, reason: str, detail: str) -> None:
        skipped.setdefault(reason, []).append(
            {"question_id": q.qid, "video": q.video, "detail": detail}
        )

    by_video: dict[str, list[Question]] = {}
    for q in questions:
        if q.problem and q.qid in todo:
            skip(q, "malformed_options", q.problem)
        elif not q.problem:
            by_video.setdefault(q.video, []).append(q)
    bar = tqdm(
        total=len(todo),
        desc=f"{benchmark} ({mode})",
        unit="question",
        disable=not progress or rank != 0,
    )
    for video, qs in by_video.items():
        ask = [q for q in qs if q.qid in todo]
        if not ask:
            continue
        enc, error, subs = None, "", {}
        if rank == 0:
            try:
                if not Path(video).is_file():
                    raise FileNotFoundError(video)
                subs = {q.qid: _subtitles(q, fps, max_frames) for q in qs} if subtitles else {}
                texts = [question_text(q, mode, subs.get(q.qid, "")) for q in qs]
                room = (
                    infer.max_new_tokens
                    if mode == "generate"
                    else max(len(option_ids(tok, o)) for q in qs for o in q.options)
                )
                enc = fit_and_encode(
                    pretrained, video, texts, room, fps, max_frames, infer.encode_batch_frames
                )
                encoded += 1
            except FileNotFoundError:
                error = f"missing_video\tno such file: {video}"
            except VideoError as e:
                error = f"unreadable_video\t{e.reason}: {e}"
            except ValueError as e:  # not one frame fits the context with the question
                error = f"does_not_fit\t{e}"
        if group is not None:  # rank 0's encoding, or its error, on every rank
            error = broadcast_text(error, src=src, group=group)
            enc = None if error else share_video(enc, group)
            subs = json.loads(broadcast_text(json.dumps(subs), src=src, group=group))
        if error:
            for q in ask:
                skip(q, *error.split("\t", 1))
            bar.update(len(ask))
            continue
        session = open_session(pretrained, enc, infer, engine_factory)
        for q in ask:
            text = question_text(q, mode, subs.get(q.qid, ""))
            rec = {
                "question_id": q.qid,
                "answer": q.answer,
                "options": len(q.options),
                "video": video,
                "groups": q.groups,
                "frames": int(enc.codes.shape[0]),
            }
            if mode == "likelihood":
                scored = session.score(text, [option_ids(tok, o) for o in q.options])
                norm = [s / len(o) for (s, _, _), o in zip(scored, q.options)]
                rec.update(
                    prediction=LETTERS[int(np.argmax(norm))],
                    scores=norm,
                    logprobs=[s for s, _, _ in scored],
                    tokens=[n for _, n, _ in scored],
                )
            else:
                rec["response"] = session.ask(text)
                rec.update(prediction=parse_letter(rec["response"], q.options), scores=None)
            rec["correct"] = rec["prediction"] == q.answer
            if rank == 0:
                append_line(out / "predictions.jsonl", rec)
            bar.update(1)
    bar.close()
    if rank != 0:
        return {}
    asked = {q.qid for q in questions}
    records = [r for r in read_predictions(out / "predictions.jsonl") if r["question_id"] in asked]
    if not records:
        raise ValueError(
            f"no question of {benchmark} under {data} could be asked "
            f"(skipped: { {k: len(v) for k, v in skipped.items()} })"
        )
    summary = {
        "benchmark": benchmark,
        "mode": mode,
        **summarise(records),
        "settings": settings,
        "skipped": {k: {"count": len(v), "questions": v} for k, v in skipped.items()},
        "bootstrap": {"resamples": BOOTSTRAP_RESAMPLES, "seed": 0, "unit": "video"},
        "seconds_this_run": round(time.time() - t0, 2),
        "videos_encoded": encoded,
        "json": str(out / "summary.json"),
        "png": str(out / "summary.png"),
    }
    save_bars(
        summary,
        out / "summary.png",
        f"{benchmark} ({mode}): {summary['accuracy']:.1%} of {summary['questions']} questions",
    )
    write_json_atomic(out / "summary.json", summary, indent=1)
    return summary
