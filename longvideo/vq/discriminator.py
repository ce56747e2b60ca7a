"""Patch discriminator (PatchGAN, Isola et al. 2017) on single frames for the optional adversarial loss,
with the hinge loss and VQGAN's adaptive weight (Esser et al. 2021); trained from scratch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PatchDiscriminator(nn.Module):
    """(N, 3, H, W) in [-1, 1] -> patch logits (N, 1, H/4 - 2, W/4 - 2)."""

    def __init__(self, channels: int = 64):
        super().__init__()
        c = channels
        self.net = nn.Sequential(
            nn.Conv2d(3, c, 4, 2, 1),
            nn.LeakyReLU(0.2),
            nn.Conv2d(c, 2 * c, 4, 2, 1),
            nn.GroupNorm(min(32, 2 * c), 2 * c),
            nn.LeakyReLU(0.2),
            nn.Conv2d(2 * c, 4 * c, 4, 1, 1),
            nn.GroupNorm(min(32, 4 * c), 4 * c),
            nn.LeakyReLU(0.2),
            nn.Conv2d(4 * c, 1, 4, 1, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def hinge_d_loss(real_logits: torch.Tensor, fake_logits: torch.Tensor) -> torch.Tensor:
    return 0.5 * (F.relu(1 - real_logits).mean() + F.relu(1 + fake_logits).mean())


def adaptive_weight(
    rec_loss: torch.Tensor, gan_loss: torch.Tensor, last_weight: torch.Tensor
) -> torch.Tensor:
    """||d rec / d w|| / ||d gan / d w|| at the decoder's last layer: balances the two gradients."""
    g_rec = torch.autograd.grad(rec_loss, last_weight, retain_graph=True)[0]
    g_gan = torch.autograd.grad(gan_loss, last_weight, retain_graph=True)[0]
    return (g_rec.norm() / (g_gan.norm() + 1e-4)).clamp(0, 1e4).detach()
