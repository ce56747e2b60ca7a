"""Multiple-choice video benchmarks, read in the layout of their own releases (docs/evaluation.md,
"The benchmarks"), with their own breakdown labels. A question whose options or answer cannot be
read comes back with `problem` set; missing question files raise FileNotFoundError.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

LETTERS = "ABCDEFGHIJ"


@dataclass
class Question:
    """One multiple-choice question about one video."""

    qid: str
    video: str
    """Path of the video file (it may not exist: the caller counts that)."""
    question: str
    options: tuple[str, ...]
    """Option texts, without their letters."""
    answer: str
    """The correct option's letter."""
    groups: dict = field(default_factory=dict)
    """Breakdown name -> label (or a list of labels: the question counts in each)."""
    subtitles: str | None = None
    """Path of the subtitle file (.srt or LongVideoBench's .json)."""
    subtitle_offset: float = 0.0
    """Seconds subtracted from subtitle times (LongVideoBench clips cut from longer videos)."""
    problem: str = ""
    """Why the question cannot be asked (empty: it can)."""


def answer_letter(answer, options: Sequence[str]) -> str:
    """The letter of `answer`: an index, a letter, or one option's text."""
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(options):
        return LETTERS[answer]
    if (
        isinstance(answer, str)
        and len(answer.strip()) == 1
        and answer.strip() in LETTERS[: len(options)]
    ):
        return answer.strip()
    if isinstance(answer, str) and answer.strip() in options:
        return LETTERS[options.index(answer.strip())]
    raise ValueError(f"answer {answer!r} is none of the {len(options)} options")


def make_question(qid, video, question, options, answer, groups=None, **kw) -> Question:
    """A Question, its options and answer checked (2-10 non-empty options; else `problem` says why)."""
    try:
        if isinstance(options, str) or not all(isinstance(o, str) for o in options):
            raise TypeError(f"options must be a list of texts, got {options!r}")
        opts = tuple(o.strip() for o in options)
        if not 2 <= len(opts) <= len(LETTERS) or not all(opts):
            raise ValueError(f"{len(opts)} options (need 2-{len(LETTERS)}, none empty)")
        letter = answer_letter(answer, opts)
        if not isinstance(question, str) or not question.strip():
            raise ValueError("no question text")
    except (TypeError, ValueError, AttributeError) as e:
        return Question(
            str(qid), str(video), str(question), (), "", dict(groups or {}), problem=str(e)
        )
    return Question(str(qid), str(video), question.strip(), opts, letter, dict(groups or {}), **kw)


def _each(rows: Iterable, one: Callable, qid_of: Callable) -> list[Question]:
    """one(row) for every row; a row that lacks a field becomes a Question with its problem."""
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(one(row))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            try:
                qid = str(qid_of(row))
            except Exception:
                qid = f"row{i}"
            out.append(Question(qid, "", "", (), "", {}, problem=f"{type(e).__name__}: {e}"))
    return out


def _need(path: Path, what: str) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found ({what})")
    return path


def _video(
    root: Path, dirs: Sequence[str], stem: str, exts: Sequence[str] = (".mp4", ".MP4", ".mkv")
) -> str:
    """The first existing DIR/d/stem.ext; the first candidate when none exists (reported missing later)."""
    cands = [root / d / f"{stem}{e}" for d in dirs for e in exts]
    return str(next((c for c in cands if c.is_file()), cands[0]))


def split_lettered(options: Sequence[str]) -> list[str]:
    """["A. red", "B. blue"] -> ["red", "blue"] (Video-MME's options); letters must run A, B, ..."""
    out = []
    for i, o in enumerate(options):
        m = re.match(r"^\s*\(?([A-J])\)?[.:)]?\s+(.*)$", o, re.S)
        if not m or m.group(1) != LETTERS[i]:
            raise ValueError(f"option {i} {o!r} does not start with {LETTERS[i]}.")
        out.append(m.group(2))
    return out


def split_inline(question: str) -> tuple[str, list[str]]:
    """LVBench's "stem\\n(A) x\\n(B) y" -> ("stem", ["x", "y"])."""
    stem, opts = [], []
    for line in question.split("\n"):
        m = re.match(r"^\s*\(([A-J])\)\s*(.*)$", line)
        if m:
            if m.group(1) != LETTERS[len(opts)]:
                raise ValueError(f"option ({m.group(1)}) out of order")
            opts.append(m.group(2))
        elif opts:
            opts[-1] += "\n" + line
        else:
            stem.append(line)
    return "\n".join(stem).strip(), opts


def _videomme(root: Path) -> list[Question]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(
            "Video-MME's questions are a parquet file, read with pyarrow, in the videomme extra: "
            "pip install 'longvideo[videomme]'"
        ) from e

    files = sorted(root.glob("**/*.parquet"))
    if not files:
        raise FileNotFoundError(
            f"no Video-MME parquet under {root} (the release: videomme/test-00000-of-00001.parquet)"
        )

    def one(r):
        vid = r["videoID"]
        return make_question(
            r["question_id"],
            _video(root, ("videos", "data"), vid),
            r["question"],
            split_lettered(r["options"]),
            r["answer"],
            {k: r[k] for k in ("duration", "domain", "task_type")},
            subtitles=str(root / "subtitle" / f"{vid}.srt"),
        )

    return _each(
        (r for f in files for r in pq.read_table(f).to_pylist()), one, lambda r: r["question_id"]
    )


def _mlvu(root: Path) -> list[Question]:
    files = sorted((root / "json").glob("*.json"))
    if not files:
        raise FileNotFoundError(
            f"no MLVU json under {root / 'json'} (the release: json/1_plotQA.json ...)"
        )
    out = []
    for f in files:
        if f.stem in ("8_sub_scene", "9_summary"):
            continue
        task = f.stem.split("_", 1)[-1]
        out += _each(
            enumerate(json.loads(f.read_text())),
            lambda x, f=f, task=task: make_question(
                f"{task}_{x[0]}",
                root / "video" / f.stem / x[1]["video"],
                x[1]["question"],
                x[1]["candidates"],
                x[1]["answer"],
                {"task": task},
            ),
            lambda x, task=task: f"{task}_{x[0]}",
        )
    return out


def _longvideobench(root: Path) -> list[Question]:
    rows = json.loads(
        _need(root / "lvb_val.json", "LongVideoBench's validation questions").read_text()
    )

    def one(r):
        return make_question(
            r["id"],
            root / "videos" / r["video_path"],
            r["question"],
            r["candidates"],
            int(r["correct_choice"]),
            {
                "duration_group": str(r["duration_group"]),
                "question_category": r["question_category"],
            },
            subtitles=str(root / "subtitles" / r["subtitle_path"]),
            subtitle_offset=float(r.get("starting_timestamp_for_subtitles") or 0.0),
        )

    return _each(rows, one, lambda r: r["id"])


def _egoschema(root: Path) -> list[Question]:
    rows = json.loads(_need(root / "questions.json", "EgoSchema's questions").read_text())
    answers = json.loads(
        _need(root / "subset_answers.json", "EgoSchema's published answers").read_text()
    )
    rows = [r for r in rows if isinstance(r, dict) and r.get("q_uid") in answers]
    return _each(
        rows,
        lambda r: make_question(
            r["q_uid"],
            _video(root, ("videos",), r["q_uid"]),
            r["question"],
            [r[f"option {i}"] for i in range(5)],
            answers[r["q_uid"]],
        ),
        lambda r: r["q_uid"],
    )


def _lvbench(root: Path) -> list[Question]:
    lines = _need(root / "video_info.meta.jsonl", "LVBench's questions").read_text().splitlines()
    out = []
    for line in filter(str.strip, lines):
        v = json.loads(line)

        def one(qa, v=v):
            stem, opts = split_inline(qa["question"])
            types = qa["question_type"]
            groups = {
                "question_type": list(types) if isinstance(types, list) else [types],
                "type": v.get("type", ""),
            }
            return make_question(
                qa["uid"],
                _video(root, ("videos", "all_videos", "."), v["key"]),
                stem,
                opts,
                qa["answer"],
                groups,
            )

        out += _each(v.get("qa", []), one, lambda qa: qa["uid"])
    return out


def _generic(root: Path) -> list[Question]:
    path = (
        root
        if root.is_file()
        else _need(root / "questions.jsonl", "the generic format's questions")
    )
    base = path.parent

    def one(r):
        subs = r.get("subtitles")
        return make_question(
            r["question_id"],
            base / r["video"],
            r["question"],
            r["options"],
            r["answer"],
            r.get("groups") or {},
            subtitles=str(base / subs) if subs else None,
        )

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return _each(rows, one, lambda r: r["question_id"])


READERS = {
    "videomme": _videomme,
    "mlvu": _mlvu,
    "longvideobench": _longvideobench,
    "egoschema": _egoschema,
    "lvbench": _lvbench,
    "generic": _generic,
}
BENCHMARKS: tuple[str, ...] = tuple(READERS)


def read_benchmark(name: str, data: str | Path) -> list[Question]:
    """Every question of benchmark `name` (one of BENCHMARKS) released under `data`."""
    if name not in READERS:
        raise ValueError(f"unknown benchmark {name!r}; expected one of {', '.join(BENCHMARKS)}")
    root = Path(data)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist (the {name} release's folder)")
    qs = READERS[name](root)
    seen: set[str] = set()
    for q in qs:
        if q.qid in seen and not q.problem:
            q.problem = f"question_id {q.qid!r} appears twice"
        seen.add(q.qid)
    return qs


def _seconds(stamp: str) -> float:
    h, m, s = stamp.strip().replace(",", ".").split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def read_subtitles(path: str | Path, offset: float = 0.0) -> list[tuple[float, float, str]]:
    """(start, end, text) lines of an .srt file (markup removed) or of LongVideoBench's .json
    ({start, end, line} with "HH:MM:SS.mmm" times, or {timestamp: [start, end or null], text}),
    shifted by -offset seconds."""
    path = Path(path)
    raw = path.read_text(encoding="utf-8", errors="replace")
    out = []
    if path.suffix.lower() == ".json":
        for s in json.loads(raw):
            if "timestamp" in s:
                a, b = s["timestamp"]
                a, b, text = (
                    float(a),
                    float(b) if isinstance(b, (int, float)) else float("inf"),
                    s["text"],
                )
            else:
                a, b, text = _seconds(s["start"]), _seconds(s["end"]), s["line"]
            out.append((a - offset, b - offset, str(text).strip()))
        return out
    for block in re.split(r"\n\s*\n", raw.replace("\r\n", "\n")):
        lines = block.strip().split("\n")
        at = next((i for i, x in enumerate(lines) if "-->" in x), None)
        if at is None:
            continue
        a, b = lines[at].split("-->")
        text = re.sub(r"<[^>]+>", "", " ".join(lines[at + 1 :])).strip()
        if text:
            out.append((_seconds(a) - offset, _seconds(b) - offset, text))
    return out


def subtitles_at(lines: Sequence[tuple[float, float, str]], times: Sequence[float]) -> str:
    """The subtitle lines on screen at any of the sampled frame times (a line shorter than a
    second counts for the second around its middle), in order, repeats dropped."""
    kept: list[str] = []
    for a, b, text in lines:
        if b - a < 1.0:
            a, b = (a + b) / 2 - 0.5, (a + b) / 2 + 0.5
        if any(a <= t < b for t in times) and (not kept or kept[-1] != text):
            kept.append(text)
    return "\n".join(kept)
