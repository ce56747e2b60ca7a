"""Block-attention backends behind one interface, `BlockBackend` (docs/architecture.md, decision 4;
docs/kernels.md). plan: an optional AttentionPlan (plans.py) shared by calls with the same
metadata. sync_free: no call reads a device value on the host once its plan is built, so callers
must not either. Names: "torch" (exact reference), "cpu", "triton" (CUDA, or CPU under
TRITON_INTERPRET=1) and "auto" (dispatch.py, the default).
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch
from torch import Tensor


class BlockBackend(Protocol):
    """q (B, Sq, Hq, D); k, v (B, Sk, Hkv, D); q_pos, q_seg (B, Sq); k_pos, k_seg (B, Sk). forward:
    out (B, Sq, Hq, D) in q.dtype, lse (B, Hq, Sq) float32 (-inf on rows with no visible key).
    backward: dq, dk, dv in float32; `out`/`lse` may be a ring's global ones, the result then this
    block's exact share of the global gradients (P = exp(S - lse), D = rowsum(dout * out))."""

    name: str
    sync_free: bool

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_pos: Tensor,
        k_pos: Tensor,
        q_seg: Tensor,
        k_seg: Tensor,
        scale: float,
        causal: bool,
        plan=None,
    ) -> tuple[Tensor, Tensor]: ...

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        q_pos: Tensor,
        k_pos: Tensor,
        q_seg: Tensor,
        k_seg: Tensor,
        scale: float,
        causal: bool,
        plan=None,
    ) -> tuple[Tensor, Tensor, Tensor]: ...


_REGISTRY: dict[str, str] = {  # module:class, the module relative to this package
    "torch": ".torch_backend:TorchBackend",
    "cpu": ".cpu_backend:CpuBackend",
    "triton": ".flash_attn:TritonBackend",
    "auto": ".dispatch:DispatchBackend",
}
_INSTANCES: dict[str, BlockBackend] = {}


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str = "auto") -> BlockBackend:
    """The backend object for `name` (one for every device: "auto" chooses per block and device)."""
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown attention backend '{name}'; choose from {', '.join(available_backends())}"
        )
    if name not in _INSTANCES:
        module, cls = _REGISTRY[name].split(":")
        _INSTANCES[name] = getattr(importlib.import_module(module, __package__), cls)()
    return _INSTANCES[name]
