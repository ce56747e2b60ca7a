"""Tile plans built once and reused: the objects callers own and pass to the block backends
(docs/kernels.md, "Who keeps the plans"). A plan builds on first use from that call's metadata, so
a caller must never pass one object with different metadata; `PlanCache` finds such objects by the
identity and version of the metadata tensors, never by their contents (a host sync).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Optional, TypeVar

from torch import Tensor

T = TypeVar("T")


class AttentionPlan:
    """The plans of one (query metadata, key metadata) pair, built on first use and kept; `builds`
    counts the plans built (not found)."""

    __slots__ = ("_plans", "builds")

    def __init__(self):
        self._plans: dict = {}
        self.builds = 0

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = build()
            self.builds += 1
        return plan

    def __len__(self) -> int:
        return len(self._plans)


class RingPlans:
    """One AttentionPlan per ring step (per visiting key block), for one ring call and its backward,
    or for every layer of a model step when a seam keeps it."""

    __slots__ = ("steps",)

    def __init__(self):
        self.steps: dict[int, AttentionPlan] = {}

    def step(self, i: int) -> AttentionPlan:
        plan = self.steps.get(i)
        if plan is None:
            plan = self.steps[i] = AttentionPlan()
        return plan

    @property
    def builds(self) -> int:
        return sum(p.builds for p in self.steps.values())


def _version(t: Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


class PlanCache:
    """Plan objects keyed by the identity and version of metadata tensors, the `size` most recent:
    `lookup(*tensors)` returns the same object while called with the same tensors, unmodified (held,
    so no other tensor can take their id). Inference tensors (no version) get a fresh object."""

    def __init__(self, size: int = 2, factory: Callable[[], object] = AttentionPlan):
        self.size, self.factory = size, factory
        self._entries: OrderedDict = OrderedDict()

    def lookup(self, *tensors: Tensor):
        versions = [_version(t) for t in tensors]
        if any(v is None for v in versions):
            return self.factory()
        key = tuple((id(t), v) for t, v in zip(tensors, versions))
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            return hit[1]
        plan = self.factory()
        self._entries[key] = (tensors, plan)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return plan
