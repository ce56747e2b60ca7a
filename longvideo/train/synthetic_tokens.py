"""A generated token dataset for smoke runs and tests: deterministic by seed, resumable, packed.

Each sequence packs documents that are arithmetic progressions modulo `vocab` (the next token
follows from the previous two, so a tiny model's loss falls within a few steps), in the loader's
batch format, all (B, seq_len): input_ids, targets (already shifted), positions (0 per document),
segment_ids (-1 = padding), loss_weights (0 on a document's last token and on padding). Sample i
is a function of (seed, i); dp rank r takes samples r, r + dp_size, ...
"""

from __future__ import annotations

import torch

STRIDES = (1, 2, 3, 5)


class SyntheticTokens:
    """Infinite iterable of batches of packed arithmetic-progression documents."""

    def __init__(
        self,
        *,
        seq_len: int,
        batch_size: int,
        vocab: int,
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        min_doc: int | None = None,
        max_doc: int | None = None,
    ):
        if vocab < 2:
            raise ValueError(f"SyntheticTokens needs vocab >= 2, got {vocab}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        self.seq_len, self.batch_size, self.vocab, self.seed = seq_len, batch_size, vocab, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.min_doc = max(2, min_doc if min_doc is not None else seq_len // 8)
        self.max_doc = max(self.min_doc, max_doc if max_doc is not None else seq_len // 2)
        self.batches_done = 0

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """The packed sequence number `index` (global across dp ranks): dict of (seq_len,) tensors."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        S = self.seq_len
        ids = torch.zeros(S + 1, dtype=torch.long)
        pos = torch.zeros(S, dtype=torch.long)
        seg = torch.full((S,), -1, dtype=torch.long)
        w = torch.zeros(S, dtype=torch.float32)
        start, doc = 0, 0
        while start < S:
            n = min(
                int(torch.randint(self.min_doc, self.max_doc + 1, (1,), generator=g)), S - start
            )
            if n < 2 and doc > 0:  # too short to hold a prediction: leave it as padding
                break
            first = int(torch.randint(0, self.vocab, (1,), generator=g))
            stride = STRIDES[int(torch.randint(0, len(STRIDES), (1,), generator=g))]
            ids[start : start + n] = (first + stride * torch.arange(n)) % self.vocab
            pos[start : start + n] = torch.arange(n)
            seg[start : start + n] = doc
            w[start : start + n - 1] = 1.0  # the last token's target is not part of this document
            start, doc = start + n, doc + 1
        return {
            "input_ids": ids[:S].clone(),
            "targets": ids[1:].clone(),
            "positions": pos,
            "segment_ids": seg,
            "loss_weights": w,
        }

    def batch(self, batch_index: int) -> dict[str, torch.Tensor]:
        """Batch number `batch_index` of this dp rank: dict of (B, seq_len) tensors."""
        base = batch_index * self.batch_size * self.dp_size + self.dp_rank * self.batch_size
        samples = [self.sample(base + b) for b in range(self.batch_size)]
        return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}

    def __iter__(self):
        while True:
            out = self.batch(self.batches_done)
            self.batches_done += 1
            yield out

    def state_dict(self) -> dict:
        return {
            "batches_done": self.batches_done,
            "seed": self.seed,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
        }

    def load_state_dict(self, state: dict) -> None:
        if (state.get("dp_size"), state.get("seed")) != (self.dp_size, self.seed):
            raise ValueError(
                f"synthetic data state was saved with dp_size={state.get('dp_size')}, "
                f"seed={state.get('seed')}; this run has dp_size={self.dp_size}, seed={self.seed}"
            )
        self.batches_done = int(state["batches_done"])
