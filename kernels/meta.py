"""The attention metadata: one object from the model's attention call to the kernels' launch
(docs/architecture.md, "The attention metadata").

`AttentionMeta` holds where the queries and the keys sit (a `Side` each: positions and segment
ids), whether the mask is causal, the softmax scale and the plan store it owns. The model builds
one per batch; the seam, the ring, the Ulysses hybrid, the per-block dispatch and every backend
pass it on unchanged. Two views are made from it, never a copy of its tensors:

- `visiting(keys, step)`: ring step `step`, these queries against a visiting key block, whose
  plans live in this object's store (every layer and the backward reuse them);
- `with_scale(scale)`: another softmax scale, the same plans (scale does not change a plan).

The default scale is `default_scale(head_dim)`, defined here only. The mask rule itself is
attention_math.py's.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .plans import AttentionPlan

_LIVE: weakref.WeakValueDictionary[int, AttentionMeta] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def default_scale(head_dim: int) -> float:
    """The softmax scale when none is given: 1 / sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)


@dataclass(frozen=True, eq=False)
class Side:
    """Where the tokens of one side of attention (its queries, or its keys) sit: `positions` and
    `segment_ids`, (B, S) integer tensors on the inputs' device. Segment -1 is padding: it sees
    nothing and is seen by nothing."""

    positions: Tensor
    segment_ids: Tensor

    @classmethod
    def default(cls, x: Tensor) -> Side:
        """Positions 0..S-1 and one segment (id 0) for x (B, S, ...), int64."""
        B, S = x.shape[:2]
        positions = torch.arange(S, device=x.device).expand(B, S)
        return cls(positions, torch.zeros(B, S, dtype=torch.long, device=x.device))

    @property
    def length(self) -> int:
        return self.positions.shape[1]

    def span(self, start: int, stop: int) -> Side:
        """The tokens [start, stop) (views)."""
        return Side(self.positions[:, start:stop], self.segment_ids[:, start:stop])

    def to(self, device) -> Side:
        return Side(self.positions.to(device), self.segment_ids.to(device))

    def stacked(self) -> Tensor:
        """(2, B, S) int64: positions and segment ids as one tensor (one message around a ring)."""
        return torch.stack([self.positions, self.segment_ids]).long()

    def check(self, name: str, batch: int, length: int) -> None:
        """ValueError naming `name.positions` / `name.segment_ids` unless both are (batch, length)
        integer tensors."""
        for field_name, t in (("positions", self.positions), ("segment_ids", self.segment_ids)):
            if tuple(t.shape) != (batch, length):
                raise ValueError(
                    f"{name}.{field_name} must have shape {(batch, length)}, got {tuple(t.shape)}"
                )
            if t.is_floating_point() or t.is_complex():
                raise ValueError(f"{name}.{field_name} must be an integer tensor, got {t.dtype}")


@dataclass(frozen=True, eq=False)
class AttentionMeta:
    """The metadata of one attention call (module docstring). queries (B, Sq) and keys (B, Sk);
    scale None means `default_scale` of the head dim. `plans`: the store every backend keeps its
    plans in (made with the object; a view shares its owner's). `handle`: a 0-d int64 CPU tensor
    naming this object to `find`, how a custom op (which takes tensors only) reaches it."""

    queries: Side
    keys: Side
    causal: bool = True
    scale: float | None = None
    plans: AttentionPlan = field(default_factory=AttentionPlan, repr=False)
    handle: Tensor = field(init=False, repr=False)

    def __post_init__(self):
        number = next(_HANDLES)
        object.__setattr__(self, "handle", torch.tensor(number, device="cpu"))
        _LIVE[number] = self

    @classmethod
    def self_attention(
        cls,
        positions: Tensor,
        segment_ids: Tensor,
        *,
        causal: bool = True,
        scale: float | None = None,
    ) -> AttentionMeta:
        """Queries and keys are the same tokens (training, a prefill, a ring shard)."""
        side = Side(positions, segment_ids)
        return cls(side, side, causal, scale)

    @classmethod
    def default(
        cls, q: Tensor, k: Tensor, *, causal: bool = True, scale: float | None = None
    ) -> AttentionMeta:
        """Positions 0..S-1 and one segment on both sides of q (B, Sq, ...) and k (B, Sk, ...)."""
        return cls(Side.default(q), Side.default(k), causal, scale)

    def scale_for(self, head_dim: int) -> float:
        """The softmax scale of this call for `head_dim`."""
        return self.scale if self.scale is not None else default_scale(head_dim)

    def visiting(self, keys: Side, step: int) -> AttentionMeta:
        """Ring step `step`: these queries against a visiting key block, with that step's plans
        (kept in this object's store; a ring's step i always brings the same block)."""
        return AttentionMeta(
            self.queries, keys, self.causal, self.scale, self.plans.nested(("ring step", step))
        )

    def with_scale(self, scale: float | None) -> AttentionMeta:
        """The same metadata and plans with another softmax scale."""
        if scale == self.scale:
            return self
        return AttentionMeta(self.queries, self.keys, self.causal, scale, self.plans)

    def with_keys(self, keys: Side) -> AttentionMeta:
        """These queries against other keys, with a store of their own."""
        return AttentionMeta(self.queries, keys, self.causal, self.scale)

    def check(self, q: Tensor, k: Tensor) -> None:
        """ValueError naming the field unless queries are (B, Sq) and keys (B, Sk) integers, for q
        (B, Sq, ...) and k (B, Sk, ...)."""
        self.queries.check("queries", q.shape[0], q.shape[1])
        self.keys.check("keys", k.shape[0], k.shape[1])

    def tensors(self) -> list[Tensor]:
        """[query positions, key positions, query segment ids, key segment ids]: the order in which
        the custom ops take the metadata (`from_tensors` reverses it)."""
        return [
            self.queries.positions,
            self.keys.positions,
            self.queries.segment_ids,
            self.keys.segment_ids,
        ]

    @classmethod
    def from_tensors(
        cls, tensors: Sequence[Tensor], *, causal: bool, scale: float | None = None
    ) -> AttentionMeta:
        """The metadata of `tensors()` (inside a custom op), with a store of its own."""
        q_positions, k_positions, q_segment_ids, k_segment_ids = tensors
        return cls(
            Side(q_positions, q_segment_ids), Side(k_positions, k_segment_ids), causal, scale
        )

    @staticmethod
    def find(handle: Tensor) -> AttentionMeta | None:
        """The live object whose `handle` this is, else None (a CPU read, no device sync)."""
        return _LIVE.get(int(handle))
