"""Needle recolouring: a one-flash sample's flash given another colour in its codes and its answer.

A small set trained for many epochs lets a model answer "What colour was the flash frame?" from
which video it is reading rather than from the flash: sixteen hour-long videos are told apart by
their first frames. With ``data.needle_recolour`` the loader draws the flash's colour afresh for
each sample and epoch, writes that colour's flash codes over the flash's group and that colour into
the needle answer, so the only way to the answer is the flash itself (docs/data.md, "Needle
recolouring"; docs/hour.md). The flash codes of each colour are read from the training shards
themselves (:func:`flash_code_table`), so they are the codes the tokenizer gives a flash in those
videos, through their codec.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np


def flash_group(timestamps: np.ndarray, start: float) -> int:
    """The index of the code group holding second ``start`` (the last group starting at or
    before it)."""
    g = int(np.searchsorted(np.asarray(timestamps, np.float64), start + 1e-6, side="right")) - 1
    return max(g, 0)


def one_needle(meta: dict) -> dict | None:
    """The sample's needle record when it has exactly one flash and a needle question, else None."""
    needle = meta.get("needle")
    if not isinstance(needle, dict) or "events" in meta or "colour" not in needle:
        return None
    if not any(x.get("type") == "needle" for x in meta.get("qa") or []):
        return None
    return needle


def flash_code_table(samples: Iterable) -> dict[str, np.ndarray]:
    """Per flash colour, the codes (h, w) its flash group has most often over the one-needle
    samples of ``samples`` (objects with codes, timestamps and meta, as token shards give them)."""
    seen: dict[str, Counter] = {}
    shapes: dict[bytes, tuple] = {}
    for s in samples:
        needle = one_needle(s.meta)
        if needle is None:
            continue
        g = flash_group(s.timestamps, float(needle["start"]))
        if g >= len(s.codes):
            continue
        codes = np.ascontiguousarray(s.codes[g], np.int64)
        key = codes.tobytes() + repr(codes.shape).encode()
        shapes[key] = codes
        seen.setdefault(str(needle["colour"]), Counter())[key] += 1
    return {c: shapes[n.most_common(1)[0][0]].copy() for c, n in sorted(seen.items())}


def recolour_needle(
    codes: np.ndarray,
    timestamps: np.ndarray,
    meta: dict,
    table: dict[str, np.ndarray],
    rng: np.random.Generator,
) -> tuple[np.ndarray, dict]:
    """``(codes, meta)`` with the flash in a colour drawn uniformly from ``table`` (its own colour
    too): that colour's codes over the flash's group, that colour in the needle answer. Samples
    without exactly one flash, or whose group shape differs from the table's, come back as they
    were (the same objects)."""
    needle = one_needle(meta)
    if needle is None or not table:
        return codes, meta
    names = sorted(table)
    colour = names[int(rng.integers(len(names)))]
    g = flash_group(timestamps, float(needle["start"]))
    if g >= len(codes) or table[colour].shape != codes.shape[1:]:
        return codes, meta
    out = np.array(codes, copy=True)
    out[g] = table[colour]
    qa = [dict(x, answer=colour) if x.get("type") == "needle" else x for x in meta["qa"]]
    return out, dict(meta, qa=qa, needle=dict(needle, colour=colour))
