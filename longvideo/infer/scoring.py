"""Scoring answers by question type and video length, with chance beside every figure.

A pure function of answer sheets (one record per question asked: its type, the true answer, the
model's answer, its choices and the video's duration), so what the QA evaluation reports is tested
against sheets written by hand (tests/test_scoring.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from longvideo.data.questions import question_type
from longvideo.data.templates import parse_answer


def normalise(text: str) -> str:
    """The answer parsed out of a reply (data/templates.py), lower case, runs of spaces as one."""
    return re.sub(r"\s+", " ", parse_answer(text).lower()).strip()


def exact_match(prediction: str, reference: str) -> bool:
    """The parsed answer equals the reference (case- and whitespace-insensitive)."""
    return normalise(prediction) == normalise(reference) and normalise(reference) != ""


def substring_match(prediction: str, reference: str) -> bool:
    """The reference occurs in the prediction (case-insensitive)."""
    ref = reference.strip().lower()
    return bool(ref) and ref in prediction.lower()


def chance_of(record: dict) -> float | None:
    """1 / the number of choices of the question (None: an open question)."""
    choices = record.get("choices")
    if record.get("chance") is not None:
        return float(record["chance"])
    return 1.0 / len(choices) if choices else None


def length_label(seconds: float) -> str:
    """60 -> "1 min", 3600 -> "60 min", 45 -> "45 s"."""
    return f"{seconds / 60:g} min" if seconds >= 60 and seconds % 60 == 0 else f"{seconds:g} s"


def length_bin(duration: float, lengths: Sequence[float]) -> int | None:
    """The index of the first of `lengths` (ascending, seconds) that `duration` does not exceed
    by more than half a second (a video of 3,600 s read as 3,599.5 belongs to the hour); None when
    it is longer than every one."""
    for i, length in enumerate(lengths):
        if duration <= length + 0.5:
            return i
    return None


def _cell(records: list[dict]) -> dict:
    chances = [c for c in (chance_of(r) for r in records) if c is not None]
    return {
        "accuracy": float(np.mean([r["correct"] for r in records])) if records else None,
        "count": len(records),
        "chance": float(np.mean(chances)) if chances else None,
    }


def score_answers(records: Sequence[dict], lengths: Sequence[float] = ()) -> dict:
    """Accuracy (exact match after `normalise`) of every record, per question type, and per type
    and video length when `lengths` (seconds, ascending) are given: a record belongs to the
    shortest length its duration does not exceed (longer ones are counted apart, `beyond`).
    Chance is each question's 1 / len(choices), averaged like the accuracy it sits beside.

    Returns {"accuracy", "chance", "count", "per_type": {type: {"accuracy", "count", "chance",
    "by_length": {length: cell}}}, "lengths", "grid" (type x length accuracies, None where no
    record), "chance_grid", "types", "beyond"}."""
    lengths = [float(x) for x in lengths]
    if list(lengths) != sorted(set(lengths)):
        raise ValueError(f"lengths must be ascending and distinct, got {lengths}")
    scored = [
        dict(r, type=question_type(r), correct=exact_match(r["prediction"], r["answer"]))
        for r in records
    ]
    types = sorted({r["type"] for r in scored})
    per_type, grid, chance_grid, beyond = {}, [], [], 0
    for t in types:
        mine = [r for r in scored if r["type"] == t]
        cell = _cell(mine)
        if lengths:
            cols: list[list[dict]] = [[] for _ in lengths]
            for r in mine:
                j = length_bin(float(r.get("duration", 0.0)), lengths)
                if j is None:
                    beyond += 1
                else:
                    cols[j].append(r)
            cells = [_cell(c) for c in cols]
            cell["by_length"] = {f"{length:g}": c for length, c in zip(lengths, cells)}
            grid.append([c["accuracy"] for c in cells])
            chance_grid.append([c["chance"] for c in cells])
        per_type[t] = cell
    total = _cell(scored)
    return {
        "accuracy": total["accuracy"],
        "chance": total["chance"],
        "count": total["count"],
        "per_type": per_type,
        "types": types,
        "lengths": lengths,
        "grid": grid,
        "chance_grid": chance_grid,
        "beyond": beyond,
    }
