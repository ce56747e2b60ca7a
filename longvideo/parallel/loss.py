"""Loss normalisation over the whole dp x sp batch (docs/architecture.md, decision 6).

    scale, total = loss_scale(weight_of_all_my_micro_batches, mesh)   # one all-reduce per step
    for mb in micro_batches:
        (model(**mb)[0] * scale).backward()     # then gradients are reduced over all dp x sp ranks

`grad_reduction` says how the gradients will be reduced across the world: "mean" (DeepSpeed and
DDP average) multiplies by the world size to undo the average; "sum" leaves it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from longvideo.parallel.mesh import Mesh


def global_weight_total(weight_sum: Tensor, mesh: Mesh) -> Tensor:
    """The weight total over every dp x sp rank (collective; detached, float64)."""
    total = weight_sum.detach().to(torch.float64).reshape(())
    if mesh.world_size > 1:
        total = total.clone()
        dist.all_reduce(total, group=mesh.world_group)
    return total


def loss_scale(weight_sum: Tensor, mesh: Mesh, *, grad_reduction: str = "mean") -> tuple[float, float]:
    """(factor, global weight total): multiply every loss sum this rank back-propagates in the step
    by `factor`. `weight_sum` is this rank's weight total over all of the step's micro-batches
    (collective: one all-reduce)."""
    if grad_reduction not in ("mean", "sum"):
        raise ValueError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")
    total = float(global_weight_total(weight_sum, mesh))
    ranks = mesh.world_size if grad_reduction == "mean" else 1
    return ranks / max(total, 1e-12), total


def normalized_loss(loss_sum: Tensor, weight_sum: Tensor, mesh: Mesh, *,
                    grad_reduction: str = "mean") -> tuple[Tensor, float]:
    """(this rank's loss to back-propagate, global weight total) for a step of one micro-batch.

    The values of the returned losses summed over all ranks (divided by world size for "mean")
    equal the global loss."""
    factor, total = loss_scale(weight_sum, mesh, grad_reduction=grad_reduction)
    return loss_sum * factor, total
