"""Attention kernels: block-attention backends (torch, cpu, triton) and their pure-PyTorch reference."""

from kernels.backends import BlockBackend, available_backends, get_backend, register_backend
from kernels.interface import block_attention
from kernels.reference import flash_attn_ref, visibility

__all__ = [
    "BlockBackend",
    "available_backends",
    "block_attention",
    "flash_attn_ref",
    "get_backend",
    "register_backend",
    "visibility",
]
