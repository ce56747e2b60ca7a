"""The questions the synthetic videos answer, one type each, and what each type's answer is.

A synthetic video is a run of scenes (one moving shape each) and zero or more flash frames (a
second of one full-frame colour). Each question type reads one thing of that story; the answer is
computed here from the scenes and flashes alone, so a sample's questions and the evaluation's
answer key come from one place. Every asked question records its `type` and its `choices`: chance
is 1 / len(choices) of that question (docs/hour.md, "Questions over the hour").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

COUNT_WORDS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five")
"""Answers of the counting question, by count."""
NO_FLASH = "none"
"""The flash question's answer for a video without a flash, where it is asked (Story.ask_no_flash)."""


@dataclass(frozen=True)
class Story:
    """What a synthetic video shows, in time order: scenes as (start, end, kind, colour) and flash
    frames as (second, colour)."""

    scenes: Sequence[tuple[int, int, str, str]]
    flashes: Sequence[tuple[int, str]]
    colours: Sequence[str]
    kinds: Sequence[str]
    max_flashes: int = 1
    ask_no_flash: bool = False
    """The flash question is also asked of a video without a flash, answered NO_FLASH, and every
    flash question's choices hold NO_FLASH: no colour is right by default (docs/hour.md)."""


@dataclass(frozen=True)
class QuestionType:
    """One kind of question: its name, how it is worded, and when it can be asked."""

    name: str
    text: str
    """The question, with {a} and {b} for the two events it names (order, between)."""
    flashes: tuple[int, int] = (0, 99)
    """The inclusive range of flash counts for which the question is asked (and well-defined)."""
    what: str = ""
    """What the question tests, as the docs and the evaluation's table say it."""


QUESTION_TYPES: dict[str, QuestionType] = {
    q.name: q
    for q in (
        QuestionType("needle", "What colour was the flash frame?", (1, 1), "one flash, anywhere"),
        QuestionType("first_shape", "What shape came first?", what="the first scene's shape"),
        QuestionType("first_colour", "What colour was the first shape?", what="its colour"),
        QuestionType("last_shape", "What shape came last?", what="the last scene's shape"),
        QuestionType("last_colour", "What colour was the last shape?", what="its colour"),
        QuestionType("count", "How many flash frames were there?", (1, 99), "count the flashes"),
        QuestionType(
            "order",
            "Which flash came first, the {a} one or the {b} one?",
            (2, 99),
            "which of two flashes came first",
        ),
        QuestionType(
            "between",
            "What colour was the flash between the {a} one and the {b} one?",
            (3, 3),
            "the flash between two others",
        ),
    )
}
"""Every question type, by name."""

BASIC_QUESTIONS: tuple[str, ...] = ("needle", "first_shape", "last_colour")
"""The questions of the synthetic dataset's default (and of `make demo`)."""
HOUR_QUESTIONS: tuple[str, ...] = tuple(QUESTION_TYPES)
"""Every type: the questions `make demo-hour` trains and scores over the hour."""


def check_question_names(names: Sequence[str]) -> None:
    unknown = [n for n in names if n not in QUESTION_TYPES]
    if unknown or not names:
        raise ValueError(
            f"unknown question types {unknown or '(none given)'}; expected some of "
            f"{list(QUESTION_TYPES)}"
        )


def ask(story: Story, names: Sequence[str], rng: np.random.Generator) -> list[dict]:
    """The QA items of `story` for the question types `names` (in that order), those that are
    well-defined for its flash count: {"question", "answer", "choices", "type"}. `rng` picks the
    two flashes of an order question and their order in its wording."""
    check_question_names(names)
    flashes = sorted(story.flashes)
    if len({c for _, c in flashes}) != len(flashes):
        raise ValueError(f"flashes must have distinct colours to be named, got {flashes}")
    first, last = story.scenes[0], story.scenes[-1]
    out = []
    for name in names:
        q = QUESTION_TYPES[name]
        absent = name == "needle" and not flashes and story.ask_no_flash
        if not (q.flashes[0] <= len(flashes) <= q.flashes[1] or absent):
            continue
        text = q.text
        if name == "needle":
            answer = flashes[0][1] if flashes else NO_FLASH
            choices = [*story.colours, *([NO_FLASH] if story.ask_no_flash else [])]
        elif name in ("first_shape", "last_shape"):
            answer, choices = (first if name == "first_shape" else last)[2], list(story.kinds)
        elif name in ("first_colour", "last_colour"):
            answer, choices = (first if name == "first_colour" else last)[3], list(story.colours)
        elif name == "count":
            answer = COUNT_WORDS[len(flashes)]
            choices = list(COUNT_WORDS[1 : story.max_flashes + 1])
        elif name == "order":
            i, j = sorted(rng.choice(len(flashes), size=2, replace=False).tolist())
            answer = flashes[i][1]
            a, b = (flashes[i][1], flashes[j][1])[:: 1 if rng.random() < 0.5 else -1]
            text, choices = q.text.format(a=a, b=b), [a, b]
        else:  # between: the first and the last of three named, the middle one asked
            a, b = flashes[0][1], flashes[-1][1]
            answer = flashes[1][1]
            text = q.text.format(a=a, b=b)
            choices = [c for c in story.colours if c not in (a, b)]
        out.append({"question": text, "answer": answer, "choices": choices, "type": name})
    return out


def question_type(item: dict) -> str:
    """The type of a QA item: its `type`, or (items written before types were recorded) the type
    whose wording it has, or else the question itself."""
    if item.get("type"):
        return str(item["type"])
    for q in QUESTION_TYPES.values():
        if "{" not in q.text and q.text == item.get("question"):
            return q.name
    return str(item.get("question", ""))
