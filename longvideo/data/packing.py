"""Masked sequence packing: documents share a fixed-length row but never see each other.

A row holds whole documents one after another, then padding; segment ids and restarted positions
make each document computed as if it were alone, and ``loss_norm`` sets how documents weigh in the
loss (docs/data.md, "Packing", draws a row). Documents longer than ``seq_len`` never reach the
packer: the layout drops whole frame groups until they fit (longvideo.data.templates.layout_doc).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")


def pack_row(
    docs: Sequence, seq_len: int, pad_id: int, loss_norm: str = "token"
) -> dict[str, np.ndarray]:
    """Pack documents (objects with ``ids`` int (L,) and ``weights`` float (L,)) into one row.

    Returns numpy arrays of shape (seq_len,): input_ids, targets, positions, segment_ids (int64) and
    loss_weights (float32).
    """
    if loss_norm not in ("token", "sample"):
        raise ValueError(f"loss_norm must be 'token' or 'sample', got {loss_norm!r}")
    input_ids = np.full(seq_len, pad_id, np.int64)
    targets = np.full(seq_len, pad_id, np.int64)
    positions = np.zeros(seq_len, np.int64)
    segment_ids = np.full(seq_len, -1, np.int64)
    loss_weights = np.zeros(seq_len, np.float32)
    at = 0
    for s, doc in enumerate(docs):
        n = len(doc.ids)
        if at + n > seq_len:
            raise ValueError(f"documents of {at + n} tokens do not fit a row of {seq_len}")
        w = np.asarray(doc.weights, np.float32)[1:]  # weight of predicting token j+1 from j
        if loss_norm == "sample" and w.sum() > 0:
            w = w / w.sum()
        input_ids[at : at + n] = doc.ids
        targets[at : at + n - 1] = doc.ids[1:]
        loss_weights[at : at + n - 1] = w
        positions[at : at + n] = np.arange(n)
        segment_ids[at : at + n] = s
        at += n
    return {
        "input_ids": input_ids,
        "targets": targets,
        "loss_weights": loss_weights,
        "positions": positions,
        "segment_ids": segment_ids,
    }


class Packer(Generic[T]):
    """First-fit packing of (item, length) pairs into at most ``bins`` open rows of ``seq_len``.

    ``add`` returns the rows that became final: the oldest row when an item fits no open row and
    all ``bins`` are open (so no document waits long), and a row that is exactly full. Items are
    opaque (the loader's sample references) and ``state_dict`` holds them as they are.
    """

    def __init__(self, seq_len: int, bins: int = 4):
        if seq_len <= 0 or bins <= 0:
            raise ValueError(f"seq_len and bins must be positive, got {seq_len}, {bins}")
        self.seq_len, self.bins = seq_len, bins
        self.open: list[list[tuple[T, int]]] = []

    @staticmethod
    def _fill(row: list[tuple[T, int]]) -> int:
        return sum(n for _, n in row)

    def add(self, item: T, length: int) -> list[list[T]]:
        if not 0 < length <= self.seq_len:
            raise ValueError(f"item length {length} outside (0, {self.seq_len}]")
        for i, row in enumerate(self.open):
            if self._fill(row) + length <= self.seq_len:
                row.append((item, length))
                return [self._close(i)] if self._fill(row) == self.seq_len else []
        closed = []
        if len(self.open) >= self.bins:  # a document waits for at most `bins` rows to be closed
            closed.append(self._close(0))
        self.open.append([(item, length)])
        if length == self.seq_len:
            closed.append(self._close(len(self.open) - 1))
        return closed

    def _close(self, i: int) -> list[T]:
        return [it for it, _ in self.open.pop(i)]

    def state_dict(self) -> dict:
        return {"open": [[[it, n] for it, n in row] for row in self.open]}

    def load_state_dict(self, state: dict) -> None:
        self.open = [[(_freeze(it), int(n)) for it, n in row] for row in state["open"]]


def _freeze(item) -> Hashable:
    """JSON round trips turn tuples into lists; refs are tuples again after loading."""
    return tuple(_freeze(x) for x in item) if isinstance(item, list) else item
