"""Sequence-parallel serving: the prefix (the video part) ring-prefilled and sharded, everything after
it replicated and merged exactly over the shards (docs/inference.md, "Sequence-parallel serving").
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor

from longvideo.infer.generation import CachedEngine, Generation, logits_of, new_cache
from longvideo.kernels import AttentionMeta, Side, get_backend, merge_partials
from longvideo.model import KVCache, Transformer
from longvideo.parallel import RingAttentionSeam, UlyssesGroups, shard_sequence


class MergedAttentionSeam:
    """The attention seam for tokens every rank holds: the partial (out, lse) over this rank's part
    of the cache, gathered and merged in rank order (bitwise the same on every rank). The keys of the
    replicated tokens (positions >= `shared_from`) count on the `owner` rank only: each key once."""

    def __init__(self, group, backend: str, *, shared_from: int, owner: bool):
        self.group, self.backend, self.shared_from, self.owner = group, backend, shared_from, owner

    def _own_keys(self, meta: AttentionMeta) -> AttentionMeta:
        """The metadata with the replicated keys made padding on every rank but the owner; made
        once per forward (kept in the metadata's plan store) and shared by its layers."""
        if self.owner:
            return meta

        def mask() -> AttentionMeta:
            keys = meta.keys
            shared = keys.positions >= self.shared_from
            return meta.with_keys(Side(keys.positions, keys.segment_ids.masked_fill(shared, -1)))

        return meta.plans.get(("replicated keys on the owner", self.shared_from), mask)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMeta) -> Tensor:
        out, lse = get_backend(self.backend).forward(q, k, v, self._own_keys(meta))
        W = dist.get_world_size(self.group)
        if W == 1:
            return out
        outs = [torch.empty_like(out) for _ in range(W)]
        lses = [torch.empty_like(lse) for _ in range(W)]
        dist.all_gather(outs, out.contiguous(), group=self.group)
        dist.all_gather(lses, lse.contiguous(), group=self.group)
        return merge_partials(outs, lses)[0].to(q.dtype)


class SequenceParallelEngine(CachedEngine):
    """The `Engine` interface over a sequence-parallel group; collective: every rank of `group` calls
    the same methods with the same ids. ulysses: the group's split (longvideo.parallel.split_group,
    made once and shared by every engine) to prefill with the Ulysses x ring hybrid; None: one ring."""

    def __init__(
        self,
        model: Transformer,
        group=None,
        *,
        backend: str = "auto",
        spare: int = 256,
        ulysses: UlyssesGroups | None = None,
    ):
        self.model, self.group, self.spare, self.backend = model, group, spare, backend
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.owner = self.world - 1  # holds the keys of the replicated tokens
        self.ring = RingAttentionSeam(group, backend, ulysses)
        self.merged: MergedAttentionSeam | None = (
            None  # built for each prefix (it knows its length)
        )
        self.cache: KVCache | None = None

    @torch.no_grad()
    def set_prefix(self, ids: Tensor) -> None:
        """Shard ids (B, P) over the group with the zigzag layout and prefill them with ring attention."""
        B, P = ids.shape
        t0 = time.perf_counter()
        pos = torch.arange(P, device=ids.device)[None].expand(B, P)
        seg = torch.zeros(B, P, dtype=torch.long, device=ids.device)
        if P:
            ids, pos = (shard_sequence(t, self.group, dim=1, pad_value=0) for t in (ids, pos))
            seg = shard_sequence(seg, self.group, dim=1, pad_value=-1)
        n = ids.shape[1]
        self.cache = new_cache(self.model, B, n + self.spare)
        if n:  # the cache is empty: queries and keys are this rank's shard, as the ring needs
            self.model(ids, pos, seg, cache=self.cache, attention_fn=self.ring)
        self.prefix_len, self.local_prefix_len, self.sharded = P, n, P
        self.merged = MergedAttentionSeam(
            self.group, self.backend, shared_from=P, owner=self.rank == self.owner
        )
        self.prefix_s = time.perf_counter() - t0

    def _hidden(self, ids: Tensor, start: int) -> Tensor:
        """Feed ids (B, n) every rank holds at positions start..; their hidden states (B, n, dim)."""
        pos = start + torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape)
        return self.model(
            ids, pos, torch.zeros_like(ids), cache=self.cache, attention_fn=self.merged
        )

    def _logits(self, ids: Tensor, start: int) -> Tensor:
        if ids.shape[1] < 1:
            raise ValueError("generate needs at least one token after the prefix")
        return logits_of(self.model, self._hidden(ids, start))

    def _pick(self, tok: Tensor) -> Tensor:
        tok = tok.contiguous()
        if self.world > 1:
            dist.broadcast(
                tok,
                src=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                group=self.group,
            )
        return tok


@torch.no_grad()
def sp_generate(
    model: Transformer,
    ids: Tensor,
    group=None,
    *,
    tail: int = 1,
    backend: str = "auto",
    ulysses: UlyssesGroups | None = None,
    **sampling,
) -> Generation:
    """Sequence-parallel `generate`: ring prefill of ids[:, :S-tail], replicated rest, sharded
    decoding. Collective over `group` (default: the world) with the same ids (B, S); ttft_s includes
    the prefix. sampling: the engine's `generate` keywords (max_new_tokens, default 64;
    temperature, top_p, stop_ids, generator)."""
    S = ids.shape[1]
    tail = max(1, min(tail, S))
    engine = SequenceParallelEngine(model, group, backend=backend, ulysses=ulysses)
    engine.set_prefix(ids[:, : S - tail])
    out = engine.generate(ids[:, S - tail :], **{"max_new_tokens": 64, **sampling})
    out.ttft_s += engine.prefix_s
    out.total_s += engine.prefix_s
    return out
