"""torch.compile of the decoder's non-attention work, with the attention seam opaque (docs/kernels.md,
"torch.compile of the blocks"): every block compiled in place (`nn.Module.compile`, parameter names
unchanged), the seam made `OpaqueSeam`, one custom op (`longvideo::seam_attention`, backward
`seam_attention_bwd`) that keeps the host-side planning, the dispatch's host read and the ring's
communication out of the graphs.
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict

import torch
from torch import Tensor, nn

from longvideo.configtools import ConfigError
from longvideo.kernels import AttentionMeta, accum_dtype, get_backend
from longvideo.model.attention import LocalAttention
from longvideo.parallel.ring import Ring
from longvideo.parallel.seam import RingAttentionSeam

_SEAMS: weakref.WeakValueDictionary[int, OpaqueSeam] = weakref.WeakValueDictionary()
"""The live OpaqueSeams by handle: how the custom ops (which take no Python objects) reach theirs."""
_HANDLES = itertools.count()


class OpaqueSeam:
    """An attention seam as one custom op. inner: a LocalAttention or RingAttentionSeam (the other
    seams serve decoding, which is not compiled). Called like the model's seam. The op takes the
    metadata's `handle` (a tensor: a compiled graph passes it through without specialising on it)
    and finds the object by it, so the plans it owns serve every layer and the backward; the seam
    keeps the metadata of its last `keep` forwards alive until their backward."""

    def __init__(self, inner, keep: int = 8):
        if not isinstance(inner, (LocalAttention, RingAttentionSeam)):
            raise TypeError(
                f"cannot make {type(inner).__name__} opaque: apply_compile takes a model whose seam "
                "is LocalAttention or RingAttentionSeam"
            )
        if getattr(inner, "ulysses", None) is not None:
            raise ConfigError(
                "runtime.compile",
                "the compiled seam covers the ring, not the Ulysses hybrid: set "
                "parallel.ulysses=1 or runtime.compile=false",
            )
        self.inner = inner
        ring = isinstance(inner, RingAttentionSeam)
        self.compute = Ring(inner.group, inner.backend) if ring else get_backend(inner.backend)
        """What computes a call: the ring, or the block backend (the same interface)."""
        self.keep, self.recent = keep, OrderedDict()
        self.handle = next(_HANDLES)
        _SEAMS[self.handle] = self

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMeta) -> Tensor:
        return torch.ops.longvideo.seam_attention(q, k, v, meta.handle, self.handle)[0]

    def meta(self, handle: Tensor) -> AttentionMeta:
        """The metadata object of `handle`, kept among the recent ones."""
        number = int(handle)  # a CPU tensor: no device sync
        meta = self.recent.pop(number, None) or AttentionMeta.find(handle)
        if meta is None:
            raise RuntimeError(
                f"the attention metadata of this call is gone: a compiled model keeps the "
                f"metadata of its last {self.keep} forwards alive for their backward"
            )
        self.recent[number] = meta
        while len(self.recent) > self.keep:
            self.recent.popitem(last=False)
        return meta


def _own(t: Tensor) -> Tensor:
    """t contiguous and in storage of its own (a custom op's outputs may alias nothing; the ring
    returns dK and dV as views of one buffer)."""
    return (
        t.clone(memory_format=torch.contiguous_format)
        if t._base is not None or not t.is_contiguous()
        else t
    )


@torch.library.custom_op("longvideo::seam_attention", mutates_args=())
def seam_attention(
    q: Tensor, k: Tensor, v: Tensor, meta: Tensor, seam: int
) -> tuple[Tensor, Tensor]:
    """out (B, Sq, Hq, D) in q.dtype and lse (B, Hq, Sq) (fp32; fp64 for fp64) of OpaqueSeam
    `seam` for the metadata whose handle is `meta`."""
    opaque = _SEAMS[seam]
    out, lse = opaque.compute.forward(q, k, v, opaque.meta(meta))
    return _own(out), _own(lse)


@seam_attention.register_fake
def _seam_attention_fake(q, k, v, meta, seam):
    lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=accum_dtype(q.dtype))


@torch.library.custom_op("longvideo::seam_attention_bwd", mutates_args=())
def seam_attention_bwd(
    q: Tensor, k: Tensor, v: Tensor, upstream: list[Tensor], meta: Tensor, seam: int
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv in the inputs' dtypes; upstream: [dout, the saved out, the saved lse]
    (kernels.Upstream's order)."""
    opaque = _SEAMS[seam]
    dout, out, lse = upstream
    grads = opaque.compute.backward(dout.contiguous(), q, k, v, out, lse, opaque.meta(meta))
    return tuple(_own(g.to(x.dtype)) for g, x in zip(grads, (q, k, v)))


@seam_attention_bwd.register_fake
def _seam_attention_bwd_fake(q, k, v, upstream, meta, seam):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, meta, seam = inputs
    ctx.save_for_backward(q, k, v, *output, meta)
    ctx.seam = seam
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, meta = ctx.saved_tensors
    dq, dk, dv = seam_attention_bwd(q, k, v, [dout, out, lse], meta, ctx.seam)
    return dq, dk, dv, None, None


seam_attention.register_autograd(_backward, setup_context=_setup)


def apply_compile(
    model: nn.Module, *, mode: str | None = None, backend: str = "inductor"
) -> nn.Module:
    """Compile every block of `model` (a Transformer) in place, its seam made opaque; returns it. Call
    it once the seam is final: a seam set afterwards (or passed to one forward) is traced and breaks
    `fullgraph`. mode / backend: torch.compile's (e.g. backend="aot_eager" for tests)."""
    if not hasattr(model, "set_attention") or not hasattr(model, "layers"):
        raise TypeError(
            f"{type(model).__name__} has no attention seam (set_attention) and layers to compile"
        )
    if not isinstance(model.attention_fn, OpaqueSeam):
        model.set_attention(OpaqueSeam(model.attention_fn))
    for block in (
        model.layers
    ):  # a checkpoint-wrapped block: its own module, so the recompute is compiled too
        getattr(block, "_checkpoint_wrapped_module", block).compile(
            fullgraph=True, mode=mode, backend=backend
        )
    return model
