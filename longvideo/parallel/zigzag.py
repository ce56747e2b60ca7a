"""The zigzag sequence layout of the ring and the helpers that shard a batch with it
(docs/ring_attention.md, "The zigzag layout"): a sequence padded to a multiple of 2W (padding
marked with segment id -1) is cut into 2W chunks, rank r holding chunks r and 2W-1-r.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from longvideo.distributed import group_size_rank

# pad values of the training batch keys: padding is token 0 with zero loss weight, segment -1
BATCH_PAD_VALUES = {
    "input_ids": 0,
    "targets": 0,
    "loss_weights": 0,
    "positions": 0,
    "segment_ids": -1,
}


def padded_length(length: int, world: int) -> int:
    """The smallest multiple of 2 * world that is >= length."""
    m = 2 * world
    return -(-length // m) * m


def zigzag_indices(length: int, world: int, rank: int, device=None) -> Tensor:
    """Global indices (length // world,) of the tokens `rank` holds; length must divide by 2*world."""
    if length % (2 * world):
        raise ValueError(f"sequence length {length} is not a multiple of 2 x world = {2 * world}")
    c = length // (2 * world)
    return torch.cat(
        [
            torch.arange(rank * c, (rank + 1) * c, device=device),
            torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c, device=device),
        ]
    )


def layout_positions(local_len: int, group, device=None) -> Tensor:
    """Global positions (local_len,) of this rank's shard of a zigzag-sharded sequence."""
    return shard_positions(local_len, *group_size_rank(group), device=device)


def shard_positions(local_len: int, world: int, rank: int, device=None) -> Tensor:
    """Global positions (local_len,) of shard `rank` of `world` in the zigzag layout."""
    if local_len % 2 and world > 1:
        raise ValueError(
            f"a zigzag shard holds two equal chunks, but its length is {local_len} (odd); "
            "shard the sequence with shard_sequence"
        )
    return zigzag_indices(local_len * world, world, rank, device=device)


def shard_sequence(x: Tensor, group, dim: int = 1, pad_value: float | None = None) -> Tensor:
    """This rank's zigzag shard of x along `dim` (length S -> padded_length(S, W) / W), differentiable.
    Without pad_value S must be a multiple of 2W; with it, x is first padded at the end along dim."""
    W, r = group_size_rank(group)
    dim = dim % x.dim()
    S = x.shape[dim]
    P = padded_length(S, W)
    if P != S:
        if pad_value is None:
            raise ValueError(
                f"sequence length {S} along dim {dim} is not a multiple of 2 x sp = {2 * W}; "
                f"pass pad_value (and mark the padding with segment id -1)"
            )
        pad_shape = list(x.shape)
        pad_shape[dim] = P - S
        x = torch.cat([x, x.new_full(pad_shape, pad_value)], dim=dim)
    return x.index_select(dim, zigzag_indices(P, W, r, device=x.device))


def unshard_sequence(x: Tensor, group, dim: int = 1, length: int | None = None) -> Tensor:
    """The whole sequence from every rank's shard (collective over `group`; not differentiable).
    length: drop padding beyond it (the S given to shard_sequence)."""
    W, _ = group_size_rank(group)
    dim = dim % x.dim()
    if W == 1:
        full = x
    else:
        if x.shape[dim] % 2:
            raise ValueError(
                f"a zigzag shard holds two equal chunks, but its length is {x.shape[dim]} (odd)"
            )
        parts = [torch.empty_like(x) for _ in range(W)]
        dist.all_gather(parts, x.contiguous(), group=group)
        order = torch.cat(
            [zigzag_indices(x.shape[dim] * W, W, r, device=x.device) for r in range(W)]
        )
        full = torch.cat(parts, dim=dim).index_select(
            dim, order.argsort()
        )  # every token at its index
    return full if length is None else full.narrow(dim, 0, length)


def shard_batch(
    batch: dict[str, Tensor], group, pad_values: dict[str, float] | None = None
) -> dict[str, Tensor]:
    """Shard every (B, S, ...) tensor of a training batch along dim 1 with the zigzag layout, padded
    by key (BATCH_PAD_VALUES, updated by pad_values). Positions (0..S-1) and one segment are added
    when missing: a shard's tokens are not at positions 0..S/W-1, so the model must be told."""
    pads = {**BATCH_PAD_VALUES, **(pad_values or {})}
    if not batch:
        raise ValueError("shard_batch got an empty batch")
    ref_key = next(iter(batch))
    B, S = batch[ref_key].shape[:2]
    for key, t in batch.items():
        if t.dim() < 2 or tuple(t.shape[:2]) != (B, S):
            raise ValueError(
                f"batch['{key}'] has shape {tuple(t.shape)}; expected (B, S, ...) = ({B}, {S}, ...) "
                f"like batch['{ref_key}']"
            )
        if key not in pads:
            raise ValueError(
                f"no pad value for batch key '{key}'; pass pad_values={{'{key}': ...}}"
            )
    dev = batch[ref_key].device
    full = dict(batch)
    if "positions" not in full:
        full["positions"] = torch.arange(S, device=dev).expand(B, S)
    if "segment_ids" not in full:
        full["segment_ids"] = torch.zeros(B, S, dtype=torch.long, device=dev)
    return {k: shard_sequence(t, group, dim=1, pad_value=pads[k]) for k, t in full.items()}
