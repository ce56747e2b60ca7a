"""Asynchronous point-to-point exchange around a ring of ranks, with buffers allocated once
(docs/ring_attention.md, "Forward"): `RingComm.exchange` posts the sends and receives of a hop
before the compute, `Pending.wait` after it; the wait is recorded in `CommStats.exposed_s`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from longvideo.distributed import group_size_rank


@dataclass
class CommStats:
    """Per-rank accounting of ring calls (accumulates until reset)."""

    exposed_s: float = (
        0.0  # seconds blocked waiting for transfers: communication compute did not hide
    )
    compute_s: float = 0.0  # seconds in block-attention compute and merges
    bytes_sent: int = 0
    hops: int = 0  # exchanges posted
    blocks: int = 0  # blocks computed
    skipped: int = 0  # blocks skipped as provably empty
    timeline: list | None = field(default=None)
    """Set to a list to record (posted, wait started, wait ended) perf_counter times per exchange, in
    the same order on every rank (the ring benchmark tells transfer time from a late neighbour)."""

    def reset(self) -> None:
        self.exposed_s = self.compute_s = 0.0
        self.bytes_sent = self.hops = self.blocks = self.skipped = 0
        if self.timeline is not None:
            self.timeline.clear()


class Pending:
    """Posted sends and receives of one hop."""

    def __init__(self, works: list, stats: CommStats | None):
        self.works, self.stats = works, stats
        self.posted = time.perf_counter()

    def wait(self) -> None:
        t0 = time.perf_counter()
        for w in self.works:
            w.wait()
        self.works = []
        if self.stats is not None:
            t1 = time.perf_counter()
            self.stats.exposed_s += t1 - t0
            if self.stats.timeline is not None:
                self.stats.timeline.append((self.posted, t0, t1))


class RingComm:
    """Send to the next rank of `group`, receive from the previous one (ring order = group rank)."""

    def __init__(self, group):
        self.group = group
        self.size, self.rank = group_size_rank(group)
        if self.size > 1:
            rank = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
            self.next, self.prev = (
                rank((self.rank + 1) % self.size),
                rank((self.rank - 1) % self.size),
            )

    def exchange(
        self,
        send: Sequence[Tensor],
        recv: Sequence[Tensor],
        stats: CommStats | None = None,
        tag: int = 0,
    ) -> Pending:
        """Post send[i] -> next and prev -> recv[i] for every i (tags tag + i keep them apart)."""
        if self.size == 1:
            raise RuntimeError("a ring of one rank has no one to exchange with")
        ops = []
        for i, (s, r) in enumerate(zip(send, recv)):
            ops.append(dist.P2POp(dist.isend, s, self.next, self.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group, tag + i))
        works = dist.batch_isend_irecv(ops)
        if stats is not None:
            stats.hops += 1
            stats.bytes_sent += sum(s.numel() * s.element_size() for s in send)
        return Pending(works, stats)


class DoubleBuffer:
    """A set of tensors being computed on / sent (`current`) and a same-shaped set being received
    into (`incoming`), both allocated once; `swap` exchanges the roles. The buffer owns the tensors
    it is given (they are received into after the first swap): pass fresh ones."""

    def __init__(self, current: Sequence[Tensor]):
        if not all(t.is_contiguous() for t in current):
            raise ValueError("DoubleBuffer tensors must be contiguous (they are sent as they are)")
        self.current = list(current)
        self.incoming = [torch.empty_like(t) for t in self.current]

    def swap(self) -> None:
        self.current, self.incoming = self.incoming, self.current
