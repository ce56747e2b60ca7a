"""The dp x sp mesh (docs/ring_attention.md, "Using it in the model"): ranks r = dp_rank * sp + sp_rank,
so an sp group is `sp` neighbouring ranks and a dp group the ranks with the same sp_rank; with
ulysses > 1 an sp group splits further (`UlyssesGroups`, docs/hybrid.md). Created once
(`Mesh.from_config(cfg.parallel)`) and passed to whatever needs process groups; no module globals.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from longvideo.configtools import ConfigError


@dataclass(frozen=True)
class UlyssesGroups:
    """How one sequence-parallel group splits for hybrid attention (longvideo.parallel.ulysses)."""

    size: int  # U: ranks of one Ulysses group (query heads are split U ways among them)
    group: Any  # the U neighbouring ranks this rank exchanges heads with (all-to-all)
    ring: Any  # the sp / U ranks at this rank's place in every Ulysses group: the ring across them


def split_group(group, ulysses: int, timeout_s: float | None = None) -> UlyssesGroups | None:
    """This rank's UlyssesGroups of its sp `group` (None: the world), or None for ulysses = 1. Every
    rank of the world calls it, each with its own sp group of the same size (groups made with
    local synchronisation keep torch's group names in step only while every rank makes as many).
    Group rank i is member i % U of Ulysses group i // U and position i // U of ring i % U."""
    if ulysses == 1:
        return None
    ranks = (
        sorted(dist.get_process_group_ranks(group))
        if group is not None
        else list(range(dist.get_world_size()))
    )
    if len(ranks) % ulysses:
        raise ConfigError("parallel.ulysses", f"ulysses={ulysses} does not divide sp={len(ranks)}")
    kw = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    i = ranks.index(dist.get_rank())
    # every member makes its Ulysses group first, then its ring: no member waits on a later one
    heads = dist.new_group(
        ranks[i - i % ulysses : i - i % ulysses + ulysses], use_local_synchronization=True, **kw
    )
    ring = dist.new_group(ranks[i % ulysses :: ulysses], use_local_synchronization=True, **kw)
    return UlyssesGroups(size=ulysses, group=heads, ring=ring)


@dataclass(frozen=True)
class Mesh:
    world_size: int  # dp * sp
    rank: int  # this process's global rank
    dp: int
    sp: int
    dp_rank: int  # index of this rank's sp group (which slice of the batch it reads)
    sp_rank: int  # position of this rank in its sp group (which zigzag chunks it holds)
    ulysses: int = 1  # head-parallel size inside the sp group (1: one ring over the sp group)
    ulysses_groups: UlyssesGroups | None = (
        None  # this rank's Ulysses group and ring when ulysses > 1
    )
    sp_group: Any = None  # this rank's ring (None when the world is a single process)
    dp_group: Any = None  # the ranks holding the same sequence chunks in other sp groups
    world_group: Any = None  # all dp x sp ranks: the loss normaliser and ZeRO partition over it

    @classmethod
    def build(
        cls, dp: int = -1, sp: int = 1, timeout_s: float | None = None, ulysses: int = 1
    ) -> Mesh:
        """Create the groups (collective: every rank calls it with the same arguments). Without an
        initialised process group only dp * sp == 1 is allowed (a single process)."""
        if sp < 1:
            raise ConfigError("parallel.sp", f"must be >= 1, got {sp}")
        if ulysses < 1 or sp % ulysses:
            raise ConfigError("parallel.ulysses", f"must be >= 1 and divide sp={sp}, got {ulysses}")
        if not dist.is_available() or not dist.is_initialized():
            dp_ = 1 if dp == -1 else dp
            if dp_ * sp != 1:
                raise ConfigError(
                    "parallel",
                    f"dp={dp} x sp={sp} needs {dp_ * sp} ranks, but torch.distributed "
                    "is not initialised (a world of one process); launch with torchrun",
                )
            return cls(world_size=1, rank=0, dp=1, sp=1, dp_rank=0, sp_rank=0)
        world, rank = dist.get_world_size(), dist.get_rank()
        if dp == -1:
            if world % sp:
                raise ConfigError("parallel.sp", f"sp={sp} does not divide the world size {world}")
            dp = world // sp
        if dp < 1 or dp * sp != world:
            raise ConfigError(
                "parallel", f"dp={dp} x sp={sp} = {dp * sp} does not match the world size {world}"
            )
        kw = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        # new_group is collective over the whole world: every rank creates every group, in order
        sp_groups = [dist.new_group(list(range(i * sp, (i + 1) * sp)), **kw) for i in range(dp)]
        dp_groups = [dist.new_group(list(range(j, world, sp)), **kw) for j in range(sp)]
        sp_group, dp_group = sp_groups[rank // sp], dp_groups[rank % sp]
        split = split_group(sp_group, ulysses, timeout_s)
        return cls(
            world_size=world,
            rank=rank,
            dp=dp,
            sp=sp,
            dp_rank=rank // sp,
            sp_rank=rank % sp,
            ulysses=ulysses,
            ulysses_groups=split,
            sp_group=sp_group,
            dp_group=dp_group,
            world_group=dist.group.WORLD,
        )

    @classmethod
    def from_config(cls, cfg) -> Mesh:
        """From a ParallelConfig (dp, sp, ulysses, timeout_s)."""
        return cls.build(dp=cfg.dp, sp=cfg.sp, timeout_s=cfg.timeout_s, ulysses=cfg.ulysses)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def __repr__(self) -> str:
        return (
            f"Mesh(world={self.world_size}, rank={self.rank}, dp={self.dp}[{self.dp_rank}], "
            f"sp={self.sp}[{self.sp_rank}]"
            + (f", ulysses={self.ulysses}" if self.ulysses > 1 else "")
            + ")"
        )
