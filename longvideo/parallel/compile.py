"""torch.compile of the decoder's non-attention work, with the attention seam opaque (docs/kernels.md,
"torch.compile of the blocks"): every block compiled in place (`nn.Module.compile`, parameter names
unchanged), the seam made `OpaqueSeam`, one custom op (`longvideo::seam_attention`, backward
`seam_attention_bwd`) that keeps the host-side planning, the dispatch's host read and the ring's
communication out of the graphs.
"""

from __future__ import annotations

import itertools
import math
import weakref

import torch
from torch import Tensor, nn

from longvideo.configtools import ConfigError
from longvideo.kernels import accum_dtype, get_backend
from longvideo.model.attention import LocalAttention
from longvideo.parallel.seam import RingAttentionSeam
from longvideo.parallel.ring import ring_backward, ring_forward

_SEAMS: "weakref.WeakValueDictionary[int, OpaqueSeam]" = weakref.WeakValueDictionary()
"""The live OpaqueSeams by handle: how the custom ops (which take no Python objects) reach theirs."""
_HANDLES = itertools.count()


class OpaqueSeam:
    """An attention seam as one custom op. inner: a LocalAttention or RingAttentionSeam (the other
    seams serve decoding, which is not compiled). Called like the model's seam."""

    def __init__(self, inner):
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
        self.handle = next(_HANDLES)
        _SEAMS[self.handle] = self

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        q_positions: Tensor,
        k_positions: Tensor,
        q_segment_ids: Tensor,
        k_segment_ids: Tensor,
        causal: bool = True,
    ) -> Tensor:
        return torch.ops.longvideo.seam_attention(
            q, k, v, q_positions, k_positions, q_segment_ids, k_segment_ids, causal, self.handle
        )[0]

    def forward(self, q, k, v, qp, kp, qs, ks, causal: bool) -> tuple[Tensor, Tensor]:
        s, scale = self.inner, 1.0 / math.sqrt(q.shape[-1])
        if isinstance(s, RingAttentionSeam):
            return ring_forward(
                q,
                k,
                v,
                qp.long(),
                qs.long(),
                s.group,
                causal,
                scale,
                s.backend,
                None,
                s.plans.lookup(qp, qs),
            )
        be = get_backend(s.backend)
        return be.forward(
            q, k, v, qp, kp, qs, ks, scale, causal, plan=s.plans.lookup(qp, kp, qs, ks)
        )

    def backward(
        self, dout, q, k, v, out, lse, qp, kp, qs, ks, causal: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        s, scale = self.inner, 1.0 / math.sqrt(q.shape[-1])
        if isinstance(s, RingAttentionSeam):
            return ring_backward(
                dout,
                q,
                k,
                v,
                out,
                lse,
                qp.long(),
                qs.long(),
                s.group,
                causal,
                scale,
                s.backend,
                None,
                s.plans.lookup(qp, qs),
            )
        be = get_backend(s.backend)
        return be.backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            qp,
            kp,
            qs,
            ks,
            scale,
            causal,
            plan=s.plans.lookup(qp, kp, qs, ks),
        )


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
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    q_seg: Tensor,
    k_seg: Tensor,
    causal: bool,
    handle: int,
) -> tuple[Tensor, Tensor]:
    """out (B, Sq, Hq, D) in q.dtype and lse (B, Hq, Sq) (fp32; fp64 for fp64) of seam `handle`."""
    out, lse = _SEAMS[handle].forward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal)
    return _own(out), _own(lse)


@seam_attention.register_fake
def _seam_attention_fake(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, handle):
    return q.new_empty(q.shape), q.new_empty(
        q.shape[0], q.shape[2], q.shape[1], dtype=accum_dtype(q.dtype)
    )


@torch.library.custom_op("longvideo::seam_attention_bwd", mutates_args=())
def seam_attention_bwd(
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
    causal: bool,
    handle: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv in the inputs' dtypes, from the saved out/lse."""
    grads = _SEAMS[handle].backward(
        dout.contiguous(), q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, causal
    )
    return tuple(_own(g.to(x.dtype)) for g, x in zip(grads, (q, k, v)))


@seam_attention_bwd.register_fake
def _seam_attention_bwd_fake(dout, q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, causal, handle):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, q_pos, k_pos, q_seg, k_seg, causal, handle = inputs
    ctx.save_for_backward(q, k, v, *output, q_pos, k_pos, q_seg, k_seg)
    ctx.causal, ctx.handle = causal, handle
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg = ctx.saved_tensors
    dq, dk, dv = seam_attention_bwd(
        dout, q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, ctx.causal, ctx.handle
    )
    return dq, dk, dv, None, None, None, None, None, None


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
