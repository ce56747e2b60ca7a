"""Ranks that fail together: a rank whose own I/O raised never leaves the others waiting at the
collective that follows (until the process group's timeout, 30 minutes or a day for chat).

    codes, error = None, None
    try:
        codes = encode_my_part()
    except Exception as e:
        error = e
    fail_together(error, group)  # raises e on its rank and RankFailedError("rank 1 failed ...") on the others
    broadcast(codes)
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist

_MESSAGE_BYTES = 2048


class RankFailedError(RuntimeError):
    """Another rank's I/O raised; the message names that rank and its error."""


def comm_device(group=None) -> torch.device:
    """Where tensors for collectives must live: the current GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fail_together(error: Optional[BaseException], group=None) -> None:
    """Every rank of ``group`` (None: the default group) calls this with its own error (or None).
    Returns when none failed; otherwise re-raises this rank's error, or raises RankFailedError with
    the first failing rank's message on the others. Two collectives on failure, one otherwise.
    Without a process group (one process) there is no one to tell: it only re-raises ``error``."""
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    dev, world, me = comm_device(group), dist.get_world_size(group), dist.get_rank(group)
    first = torch.tensor([me if error is not None else world], dtype=torch.long, device=dev)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    src = int(first)
    if src == world:
        return
    text = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8, device=dev)
    if me == src:
        raw = f"{type(error).__name__}: {error}".encode("utf-8", "replace")[:_MESSAGE_BYTES]
        text[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dev)
    dist.broadcast(
        text, src=dist.get_global_rank(group, src) if group is not None else src, group=group
    )
    if error is not None:
        raise error
    message = bytes(text.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace")
    raise RankFailedError(f"rank {src} failed, so every rank stops: {message}")


def together(items: Iterable, group=None) -> Iterator:
    """The items of a per-rank iterator, the ranks agreeing after each step: one rank's error
    stops every rank at that step (:func:`fail_together`), and so does one rank running out of
    items while the others go on. ``group=None``: no ranks to agree with, the items unchanged."""
    if group is None:
        yield from items
        return
    it = iter(items)
    while True:
        item, error, done = None, None, False
        try:
            item = next(it)
        except StopIteration:
            done = True
        except Exception as e:  # noqa: BLE001 - raised on every rank by fail_together
            error = e
        fail_together(error, group)
        left = torch.tensor([int(done)], dtype=torch.long, device=comm_device(group))
        dist.all_reduce(left, group=group)
        if 0 < int(left) < dist.get_world_size(group):
            raise RankFailedError(
                f"{int(left)} of {dist.get_world_size(group)} ranks ran out of items while "
                "the others went on (their inputs differ)"
            )
        if done:
            return
        yield item
