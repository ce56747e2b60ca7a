"""The plan store an `AttentionMeta` owns (meta.py; docs/kernels.md, "Who keeps the plans"): plans
built on first use from that object's metadata and kept as long as it lives, so the layers of a
model step, their backward and the steps of a ring share them. The store is keyed by what the plan
is (kind, tile shape); which metadata it belongs to is the store's owner, never tensor ids.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


class AttentionPlan:
    """The plans of one (query metadata, key metadata) pair, built on first use and kept. `builds`
    counts the plans built (not found) here and in the stores nested in it (a ring's steps)."""

    __slots__ = ("_plans", "_nested", "_builds")

    def __init__(self):
        self._plans: dict = {}
        self._nested: dict[Hashable, AttentionPlan] = {}
        self._builds = 0

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = build()
            self._builds += 1
        return plan

    def nested(self, key: Hashable) -> AttentionPlan:
        """The store of a part of this metadata (a ring step: these queries against one visiting
        key block), made on first use; its builds count here too."""
        store = self._nested.get(key)
        if store is None:
            store = self._nested[key] = AttentionPlan()
        return store

    @property
    def builds(self) -> int:
        return self._builds + sum(store.builds for store in self._nested.values())

    def __len__(self) -> int:
        return len(self._plans) + sum(len(store) for store in self._nested.values())
