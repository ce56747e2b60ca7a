"""Loss normalisation over the whole dp x sp batch (docs/architecture.md, decision 6): every loss
sum a rank back-propagates in a step is scaled by `loss_scale` (one all-reduce per step).
`grad_reduction`: "mean" (DeepSpeed and DDP average the gradients over the world) multiplies by the
world size to undo the average; "sum" leaves it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from longvideo.parallel.mesh import Mesh


def check_reduction(grad_reduction: str) -> None:
    if grad_reduction not in ("mean", "sum"):
        raise ValueError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")


def loss_scale(
    weight_sum: Tensor, mesh: Mesh, *, grad_reduction: str = "mean"
) -> tuple[float, float]:
    """(factor, global weight total): multiply every loss sum this rank back-propagates in the step
    by `factor`. `weight_sum` is this rank's weight total over all of the step's micro-batches
    (collective: one all-reduce)."""
    check_reduction(grad_reduction)
    total = weight_sum.detach().to(torch.float64).reshape(()).clone()  # over every dp x sp rank
    if mesh.world_size > 1:
        dist.all_reduce(total, group=mesh.world_group)
    total = float(total)
    ranks = mesh.world_size if grad_reduction == "mean" else 1
    return ranks / max(total, 1e-12), total


def normalized_loss(
    loss_sum: Tensor, weight_sum: Tensor, mesh: Mesh, *, grad_reduction: str = "mean"
) -> tuple[Tensor, float]:
    """(this rank's loss to back-propagate, global weight total) for a step of one micro-batch; the
    losses summed over all ranks (divided by world size for "mean") equal the global loss."""
    factor, total = loss_scale(weight_sum, mesh, grad_reduction=grad_reduction)
    return loss_sum * factor, total
