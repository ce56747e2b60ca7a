"""Loss normalisation over the whole dp x sp batch (DESIGN.md decision 6).

Each rank's model returns a weighted loss *sum* over its tokens and their weight total. The loss
of the step is the sum over all ranks divided by the global weight total, so that sharding the
sequence (sp) or the batch (dp) gives the gradients of one unsharded batch:

    loss, total = normalized_loss(loss_sum, weight_sum, mesh)
    loss.backward()      # then reduce gradients over all dp x sp ranks

`grad_reduction` says how the gradients will be reduced across the world: "mean" (DeepSpeed and
DDP average) multiplies the loss by the world size to undo the average; "sum" leaves it.
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


def normalized_loss(loss_sum: Tensor, weight_sum: Tensor, mesh: Mesh, *,
                    grad_reduction: str = "mean") -> tuple[Tensor, Tensor]:
    """(this rank's loss to back-propagate, global weight total).

    The values of the returned losses summed over all ranks (divided by world size for "mean")
    equal the global loss."""
    if grad_reduction not in ("mean", "sum"):
        raise ValueError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")
    total = global_weight_total(weight_sum, mesh)
    factor = mesh.world_size if grad_reduction == "mean" else 1
    denom = total.clamp_min(1e-12).to(loss_sum.dtype)
    return loss_sum * factor / denom, total
