"""Asynchronous point-to-point exchange around a ring of ranks, with reusable buffers.

    ring = RingComm(group)
    buf = DoubleBuffer([k_and_v, pos_and_seg])     # the current block + one receive set, made once
    pending = ring.exchange(buf.current, buf.incoming)   # post: send current to next, receive from prev
    ... compute on buf.current ...
    pending.wait(); buf.swap()                     # received block becomes current; no new tensors

Every hop posts its sends and receives before the compute on the current block and waits after it,
so the transfer hides behind the compute (the Ring Attention overlap). Waiting time is recorded in
`CommStats.exposed_s`: it is the communication the compute did not hide.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from longvideo.parallel.zigzag import group_size_rank


@dataclass
class CommStats:
    """Per-rank accounting of ring calls (accumulates until reset)."""

    exposed_s: float = 0.0
    """Seconds spent blocked waiting for transfers (communication not hidden by compute)."""
    compute_s: float = 0.0
    """Seconds spent in block-attention compute and merges."""
    bytes_sent: int = 0
    """Bytes this rank sent."""
    hops: int = 0
    """Exchanges posted."""
    blocks: int = 0
    """Blocks computed."""
    skipped: int = 0
    """Blocks skipped because their mask was entirely false."""
    timeline: Optional[list] = field(default=None)
    """Set to a list to record (posted, wait started, wait ended) perf_counter times per exchange, in
    order; every rank of a ring makes the same exchanges in the same order, so the lists of
    neighbours can be matched (benchmarks use this to tell transfer time from a late neighbour)."""

    def reset(self) -> None:
        self.exposed_s = self.compute_s = 0.0
        self.bytes_sent = self.hops = self.blocks = self.skipped = 0
        if self.timeline is not None:
            self.timeline.clear()


class Pending:
    """Posted sends and receives of one hop."""

    def __init__(self, works: list, stats: Optional[CommStats]):
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
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size) if group is not None \
                else (self.rank + 1) % self.size
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size) if group is not None \
                else (self.rank - 1) % self.size

    def exchange(self, send: Sequence[Tensor], recv: Sequence[Tensor], stats: Optional[CommStats] = None,
                 tag: int = 0) -> Pending:
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
    into (`incoming`). Both are allocated once; `swap` only exchanges the roles.

    The buffer owns the tensors it is given: they are received into after the first swap, so pass
    fresh ones (not a caller's inputs)."""

    def __init__(self, current: Sequence[Tensor]):
        if not all(t.is_contiguous() for t in current):
            raise ValueError("DoubleBuffer tensors must be contiguous (they are sent as they are)")
        self.current = list(current)
        self.incoming = [torch.empty_like(t) for t in self.current]

    def swap(self) -> None:
        self.current, self.incoming = self.incoming, self.current
