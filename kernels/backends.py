"""Block-attention backends behind one interface, `BlockBackend` (docs/architecture.md, decision 4;
docs/kernels.md). Every call takes the block's AttentionMeta (meta.py), whose plan store keeps
what the backend builds from it. sync_free: no call reads a device value on the host once its
plan is built, so callers must not either. Names: "torch" (exact reference), "cpu", "triton"
(CUDA, or CPU under TRITON_INTERPRET=1) and "auto" (dispatch.py, the default); `register_backend`
serves a name with another object (tests record calls that way).
"""

from __future__ import annotations

import importlib
from typing import NamedTuple, Protocol

from torch import Tensor

from .meta import AttentionMeta


class Upstream(NamedTuple):
    """What a backward receives besides q, k, v and the metadata: the gradient of the output, and
    the forward's out and lse (a ring's global ones)."""

    dout: Tensor
    out: Tensor
    lse: Tensor


class BlockBackend(Protocol):
    """q (B, Sq, Hq, D); k, v (B, Sk, Hkv, D); meta: the AttentionMeta of this block (queries
    (B, Sq), keys (B, Sk), causal, scale; its `plans` keep what the backend builds). forward: out
    (B, Sq, Hq, D) in q.dtype, lse (B, Hq, Sq) float32 (-inf on rows with no visible key).
    backward: dq, dk, dv in float32; `out`/`lse` may be a ring's global ones, the result then this
    block's exact share of the global gradients (P = exp(S - lse), D = rowsum(dout * out))."""

    name: str
    sync_free: bool

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMeta
    ) -> tuple[Tensor, Tensor]: ...

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        meta: AttentionMeta,
    ) -> tuple[Tensor, Tensor, Tensor]: ...


_REGISTRY: dict[str, str] = {  # module:class, the module relative to this package
    "torch": ".torch_backend:TorchBackend",
    "cpu": ".cpu_backend:CpuBackend",
    "triton": ".flash_attn:TritonBackend",
    "auto": ".dispatch:DispatchBackend",
}
_INSTANCES: dict[str, BlockBackend] = {}


def available_backends() -> list[str]:
    return sorted(set(_REGISTRY) | set(_INSTANCES))


def get_backend(name: str = "auto") -> BlockBackend:
    """The backend object for `name` (one for every device: "auto" chooses per block and device)."""
    if name not in _INSTANCES:
        if name not in _REGISTRY:
            raise ValueError(
                f"unknown attention backend '{name}'; choose from {', '.join(available_backends())}"
            )
        module, cls = _REGISTRY[name].split(":")
        _INSTANCES[name] = getattr(importlib.import_module(module, __package__), cls)()
    return _INSTANCES[name]


def register_backend(name: str, backend: BlockBackend | None) -> BlockBackend | None:
    """Serve `name` with `backend` (a new name, or in place of a built-in one: every caller of
    get_backend(name), the dispatch's routes included, then gets it); None restores the built-in
    (or removes a new name). Returns the object it replaces, if one was made."""
    old = _INSTANCES.pop(name, None)
    if backend is not None:
        _INSTANCES[name] = backend
    return old
