"""`eval mcq`: answer every question of a benchmark, score them, and write OUT/predictions.jsonl (a
killed run resumes), OUT/summary.json and OUT/summary.png (docs/evaluation.md). MCQEvaluation runs
it in named steps from frozen MCQSettings; under a sequence-parallel group rank 0 reads and sends
typed records (PendingQuestions, VideoMessage) and the ranks agree on every step's failure.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.distributed as dist
from tqdm.auto import tqdm

from longvideo.atomic import write_json_atomic
from longvideo.data.templates import ANSWER_TEXT, parse_answer
from longvideo.data.video import VideoError, probe_video, sample_indices
from longvideo.distributed import broadcast_record
from longvideo.infer.benchmarks import (
    LETTERS,
    Question,
    read_benchmark,
    read_subtitles,
    subtitles_at,
)
from longvideo.infer.chat import EncodedVideo, encode_video_file
from longvideo.infer.evals import Runtime, greedy, open_session, settings_and_runtime

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


def parse_letter(text: str, options) -> str | None:
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
        interval = np.array([g["ci95"] for g in groups.values()]).reshape(-1, 2)
        ax.bar(
            range(len(acc)),
            acc,
            yerr=[acc - interval[:, 0], interval[:, 1] - acc],
            capsize=3,
            color="tab:blue",
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


@dataclass(frozen=True)
class MCQSettings:
    """What `eval mcq` is told (docs/evaluation.md)."""

    benchmark: str
    """The benchmark's name (longvideo.infer.benchmarks.BENCHMARKS)."""
    data: str | Path
    """The benchmark's folder as released (generic: a .jsonl)."""
    out_dir: str | Path
    """Where predictions.jsonl, run.json, summary.json and summary.png go (a rerun resumes)."""
    mode: str = "likelihood"
    """likelihood: score each option's text; generate: parse the letter the model writes."""
    subtitles: bool = False
    """Put the subtitles at the sampled frames before the question."""
    fps: float = 1.0
    """Frames per second read from each video."""
    max_frames: int | None = None
    """Most frames read per video, spread over all of it (None: no limit)."""
    max_new_tokens: int = 16
    """Most answer tokens (generate mode)."""
    limit: int | None = None
    """Ask the first N questions only (None: all)."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


@dataclass(frozen=True)
class PendingQuestions:
    """Rank 0 to the others, once: the questions its predictions file does not answer yet."""

    todo: tuple[str, ...]
    """Their question ids."""


@dataclass(frozen=True)
class VideoMessage:
    """Rank 0 to the others, once per video: its encoding, or why its questions are skipped."""

    video: str
    """The video's path (checked on receipt: the ranks walk the videos in step)."""
    skip_reason: str = ""
    """missing_video, unreadable_video or does_not_fit ("": encoded)."""
    skip_detail: str = ""
    """What went wrong, for summary.json."""
    codes: np.ndarray | None = None
    """int64 (G, h, w) codes of the video fitted to the context."""
    timestamps: np.ndarray | None = None
    """float64 (G,) seconds of each group's first frame."""
    num_frames: int = 0
    """Frames read."""
    duration: float = 0.0
    """The video's duration in seconds."""
    fps: float = 0.0
    """The frame rate actually sampled."""
    subtitles: tuple[tuple[str, str], ...] = ()
    """(question id, subtitle lines at the sampled frames) of the video's questions."""

    @classmethod
    def of(cls, video: str, encoded: EncodedVideo, subtitles: dict) -> VideoMessage:
        return cls(
            video=video,
            codes=np.asarray(encoded.codes),
            timestamps=np.asarray(encoded.timestamps),
            num_frames=int(encoded.num_frames),
            duration=float(encoded.duration),
            fps=float(encoded.fps),
            subtitles=tuple(subtitles.items()),
        )

    def encoded(self) -> EncodedVideo | None:
        """The encoded video (None when its questions are skipped)."""
        if self.skip_reason:
            return None
        return EncodedVideo(self.codes, self.timestamps, self.num_frames, self.duration, self.fps)


class MCQEvaluation:
    """`eval mcq` in named steps: `resume` (rank 0 checks run.json and reads the predictions so
    far; the questions still to ask go to every rank as PendingQuestions), per video `encode`
    (rank 0 reads, fits and VQ-encodes it, or says why its questions are skipped: a VideoMessage
    to every rank) and `answer` (each question scored or generated on every rank, its record
    appended by rank 0), then `summarise` (rank 0: summary.json and summary.png). The ranks agree
    on every step's failure (longvideo.distributed.fail_together)."""

    def __init__(self, model, settings: MCQSettings, runtime: Runtime):
        self.settings, self.runtime = settings, runtime
        self.pretrained, self.infer = greedy(
            model, settings.max_new_tokens, ("vq", "tokenizer"), "multiple-choice evaluation"
        )
        self.tokenizer, self.t0 = self.pretrained.tokenizer, time.time()
        group = runtime.group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        self.questions = read_benchmark(settings.benchmark, settings.data)[: settings.limit]
        self.out = Path(settings.out_dir)
        name = model if isinstance(model, (str, Path)) else self.pretrained.path or ""
        self.run_json = {
            "benchmark": settings.benchmark,
            "mode": settings.mode,
            "subtitles": settings.subtitles,
            "fps": settings.fps,
            "max_frames": settings.max_frames,
            "model": str(name),
            "data": str(settings.data),
        }
        self.skipped: dict[str, list[dict]] = {}
        self.encoded = 0

    def skip(self, q: Question, reason: str, detail: str) -> None:
        self.skipped.setdefault(reason, []).append(
            {"question_id": q.qid, "video": q.video, "detail": detail}
        )

    def resume(self) -> set[str]:
        """The ids of the questions still to ask (a new run: all)."""
        pending, error = None, None
        if self.rank == 0:
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                _check_settings(self.out, self.run_json)
                done = {r["question_id"] for r in read_predictions(self.out / "predictions.jsonl")}
                pending = PendingQuestions(
                    tuple(q.qid for q in self.questions if q.qid not in done)
                )
            except Exception as e:  # noqa: BLE001 - raised on every rank by fail_together
                error = e
        self.runtime.agree(error)
        if self.runtime.group is not None:
            pending = broadcast_record(
                pending, PendingQuestions, src=self.src, group=self.runtime.group
            )
        return set(pending.todo)

    def read_video(self, video: str, questions: list[Question]) -> VideoMessage:
        """Rank 0: the video fitted to the longest of its questions and encoded, or the reason
        its questions are skipped."""
        s, subs = self.settings, {}
        try:
            if not Path(video).is_file():
                raise FileNotFoundError(video)
            if s.subtitles:
                subs = {q.qid: _subtitles(q, s.fps, s.max_frames) for q in questions}
            texts = [question_text(q, s.mode, subs.get(q.qid, "")) for q in questions]
            room = (
                self.infer.max_new_tokens
                if s.mode == "generate"
                else max(len(option_ids(self.tokenizer, o)) for q in questions for o in q.options)
            )
            encoded = fit_and_encode(
                self.pretrained,
                video,
                texts,
                room,
                s.fps,
                s.max_frames,
                self.infer.encode_batch_frames,
            )
        except FileNotFoundError:
            return VideoMessage(video, "missing_video", f"no such file: {video}")
        except VideoError as e:
            return VideoMessage(video, "unreadable_video", f"{e.reason}: {e}")
        except ValueError as e:  # not one frame fits the context with the question
            return VideoMessage(video, "does_not_fit", str(e))
        self.encoded += 1
        return VideoMessage.of(video, encoded, subs)

    def encode(self, video: str, questions: list[Question]) -> VideoMessage:
        """Rank 0's VideoMessage about `video` on every rank; any other error of rank 0's stops
        every rank."""
        message, error = None, None
        if self.rank == 0:
            try:
                message = self.read_video(video, questions)
            except Exception as e:  # noqa: BLE001 - raised on every rank by fail_together
                error = e
        self.runtime.agree(error)
        if self.runtime.group is None:
            return message
        message = broadcast_record(message, VideoMessage, src=self.src, group=self.runtime.group)
        if message.video != video:
            raise RuntimeError(
                f"rank 0 sent {message.video} where {video} was due: the ranks read different "
                "benchmarks"
            )
        return message

    def answer(self, session, q: Question, message: VideoMessage) -> dict:
        """The prediction record of one question about the message's video."""
        mode = self.settings.mode
        text = question_text(q, mode, dict(message.subtitles).get(q.qid, ""))
        record = {
            "question_id": q.qid,
            "answer": q.answer,
            "options": len(q.options),
            "video": message.video,
            "groups": q.groups,
            "frames": int(message.codes.shape[0]),
        }
        if mode == "likelihood":
            scored = session.score(text, [option_ids(self.tokenizer, o) for o in q.options])
            norm = [score / len(o) for (score, _, _), o in zip(scored, q.options)]
            record.update(
                prediction=LETTERS[int(np.argmax(norm))],
                scores=norm,
                logprobs=[score for score, _, _ in scored],
                tokens=[n for _, n, _ in scored],
            )
        else:
            record["response"] = session.ask(text)
            record.update(prediction=parse_letter(record["response"], q.options), scores=None)
        record["correct"] = record["prediction"] == q.answer
        return record

    def write(self, record: dict) -> None:
        """Rank 0 appends the record; the ranks agree on its failure."""
        error = None
        if self.rank == 0:
            try:
                append_line(self.out / "predictions.jsonl", record)
            except Exception as e:  # noqa: BLE001 - raised on every rank by fail_together
                error = e
        self.runtime.agree(error)

    def summarise(self) -> dict:
        """Rank 0: the summary of every prediction of this benchmark's questions, written as
        summary.json and summary.png."""
        s, out = self.settings, self.out
        asked = {q.qid for q in self.questions}
        records = [
            r for r in read_predictions(out / "predictions.jsonl") if r["question_id"] in asked
        ]
        if not records:
            raise ValueError(
                f"no question of {s.benchmark} under {s.data} could be asked "
                f"(skipped: { {k: len(v) for k, v in self.skipped.items()} })"
            )
        summary = {
            "benchmark": s.benchmark,
            "mode": s.mode,
            **summarise(records),
            "settings": self.run_json,
            "skipped": {k: {"count": len(v), "questions": v} for k, v in self.skipped.items()},
            "bootstrap": {"resamples": BOOTSTRAP_RESAMPLES, "seed": 0, "unit": "video"},
            "seconds_this_run": round(time.time() - self.t0, 2),
            "videos_encoded": self.encoded,
            "json": str(out / "summary.json"),
            "png": str(out / "summary.png"),
        }
        save_bars(
            summary,
            out / "summary.png",
            f"{s.benchmark} ({s.mode}): {summary['accuracy']:.1%} of {summary['questions']} "
            "questions",
        )
        write_json_atomic(out / "summary.json", summary, indent=1)
        return summary

    def run(self) -> dict:
        todo = self.resume()
        by_video: dict[str, list[Question]] = {}
        for q in self.questions:
            if q.problem and q.qid in todo:
                self.skip(q, "malformed_options", q.problem)
            elif not q.problem:
                by_video.setdefault(q.video, []).append(q)
        bar = tqdm(
            total=len(todo),
            desc=f"{self.settings.benchmark} ({self.settings.mode})",
            unit="question",
            disable=not self.runtime.progress or self.rank != 0,
        )
        for video, questions in by_video.items():
            ask = [q for q in questions if q.qid in todo]
            if not ask:
                continue
            message = self.encode(video, questions)
            if message.skip_reason:
                for q in ask:
                    self.skip(q, message.skip_reason, message.skip_detail)
                bar.update(len(ask))
                continue
            session = open_session(
                self.pretrained, message.encoded(), self.infer, self.runtime.engine_factory
            )
            for q in ask:
                self.write(self.answer(session, q, message))
                bar.update(1)
        bar.close()
        return self.summarise() if self.rank == 0 else {}


def evaluate_mcq(model, benchmark, data=None, out_dir=None, /, **options) -> dict:
    """Answer and score benchmark `benchmark` released under `data`; rank 0 writes the files into
    `out_dir` and returns the summary (the other ranks {}). `benchmark` may be an MCQSettings
    (then without data and out_dir). options: MCQSettings fields (mode, subtitles, fps,
    max_frames, max_new_tokens, limit) and Runtime fields (engine_factory; group: the
    sequence-parallel group every rank of which runs this call, with an engine_factory that builds
    a SequenceParallelEngine; progress)."""
    if isinstance(benchmark, MCQSettings):
        if data is not None or out_dir is not None:
            raise TypeError("evaluate_mcq() takes data and out_dir in its MCQSettings")
        settings, runtime = settings_and_runtime(MCQSettings, benchmark, options, "evaluate_mcq")
    else:
        given = {"benchmark": benchmark, "data": data, "out_dir": out_dir}
        given = {k: v for k, v in given.items() if v is not None}
        twice = sorted(set(given) & set(options))
        if twice:
            raise TypeError(f"evaluate_mcq() got {twice} twice")
        settings, runtime = settings_and_runtime(
            MCQSettings, None, {**given, **options}, "evaluate_mcq"
        )
    return MCQEvaluation(model, settings, runtime).run()
