"""The `auto` block backend: every block on the fastest exact kernel for its mask (docs/kernels.md,
"Per-block dispatch"). Once per AttentionPlan the block's metadata is read on the host and
`attention_math.dense_pieces` decides: dense pieces to cuDNN, then SDPA flash (CUDA) or the CPU
flash op; the rest to `triton` (CUDA) / `cpu` with the same plan; an empty block to no kernel.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Optional, Sequence

import torch
from torch import Tensor

from .attention_math import Piece, accum_dtype, dense_pieces, lse_merge_
from .backends import get_backend

log = logging.getLogger(__name__)
DECODE_MAX_Q = (
    16  # fewer queries on CUDA: the triton decode kernel (split-K), no plan, no host read
)
_A = torch.ops.aten
_t = lambda x: x.transpose(1, 2)  # noqa: E731 - (B, S, H, D) <-> (B, H, S, D) views, as a model hands SDPA its heads
_repeat = lambda x, g: x if g == 1 else x.repeat_interleave(g, dim=2)  # noqa: E731 - kv head h // g serves head h


def _cpu_fwd(q, k, v, scale, causal):
    o, lse = _A._scaled_dot_product_flash_attention_for_cpu(
        _t(q), _t(k), _t(v), 0.0, causal, scale=scale
    )
    return _t(o), lse


def _cpu_bwd(dout, q, k, v, out, lse, scale, causal):
    return tuple(
        _t(x)
        for x in _A._scaled_dot_product_flash_attention_for_cpu_backward(
            _t(dout), _t(q), _t(k), _t(v), _t(out), lse, 0.0, causal, scale=scale
        )
    )


def _flash_fwd(q, k, v, scale, causal):
    r = _A._scaled_dot_product_flash_attention(_t(q), _t(k), _t(v), 0.0, causal, False, scale=scale)
    return _t(r[0]), r[1]


def _flash_bwd(dout, q, k, v, out, lse, scale, causal):
    seed, offset = (
        torch.empty(s, dtype=torch.uint64, device=q.device) for s in ((2,), ())
    )  # read with dropout only
    return tuple(
        _t(x)
        for x in _A._scaled_dot_product_flash_attention_backward(
            _t(dout),
            _t(q),
            _t(k),
            _t(v),
            _t(out),
            lse.contiguous(),
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )
    )


def _cudnn_fwd(q, k, v, scale, causal):
    G = q.shape[2] // k.shape[2]
    r = _A._scaled_dot_product_cudnn_attention(
        _t(q), _t(_repeat(k, G)), _t(_repeat(v, G)), None, True, 0.0, causal, False, scale=scale
    )
    return _t(r[0]), r[1][..., 0]  # lse (B, H, Sq, 1) -> (B, H, Sq)


def _cudnn_bwd(dout, q, k, v, out, lse, scale, causal):
    B, Sk, Hkv, D = k.shape
    G, seed = (
        q.shape[2] // Hkv,
        torch.empty((), dtype=torch.int64, device=q.device),
    )  # read with dropout only
    dq, dk, dv = _A._scaled_dot_product_cudnn_attention_backward(
        _t(dout),
        _t(q),
        _t(_repeat(k, G)),
        _t(_repeat(v, G)),
        _t(out),
        lse.contiguous().unsqueeze(-1),
        seed,
        seed,
        None,
        None,
        None,
        q.shape[1],
        Sk,
        0.0,
        causal,
        scale=scale,
    )
    return (
        _t(dq),
        *(_t(x).float().reshape(B, Sk, Hkv, G, D).sum(3) for x in (dk, dv)),
    )  # a kv head: its group's sum


def _general(q: Tensor):
    """The backend of blocks that need the element mask."""
    return get_backend("triton" if q.device.type == "cuda" else "cpu")


KERNELS = {
    "cudnn": (_cudnn_fwd, _cudnn_bwd),
    "flash": (_flash_fwd, _flash_bwd),
    "cpu-flash": (_cpu_fwd, _cpu_bwd),
}
"""The dense kernels: (forward -> (out, lse), backward with an external out/lse -> (dq, dk, dv))."""


class DispatchBackend:
    """The `auto` block backend. dense: the CUDA dense kernels to try, in order (KERNELS' names; ()
    sends every CUDA block to triton); `get_backend("auto")` tries cuDNN, then flash."""

    name = "auto"
    sync_free = True

    def __init__(self, dense: Sequence[str] = ("cudnn", "flash")):
        if set(dense) - set(KERNELS):
            raise ValueError(
                f"unknown dense kernels {sorted(set(dense) - set(KERNELS))}; choose from {sorted(KERNELS)}"
            )
        self.dense, self._refused = tuple(dense), set()
        self.routes: Counter = Counter()
        """Forward calls per (block kind, implementation): kinds causal, dense (one rectangle), pieces,
        empty, masked (needs the element mask), decode; e.g. ("causal", "cudnn"), ("masked", "triton")."""

    def _pieces(self, q, q_pos, k_pos, q_seg, k_seg, causal, plan) -> Optional[list[Piece]]:
        """The block's dense pieces (None: it needs the mask), kept in the plan."""
        if q.device.type == "cuda" and q.shape[1] <= DECODE_MAX_Q:
            return None
        sizes = [t.shape[1] for t in (q_pos, k_pos, q_seg, k_seg)]
        build = lambda: dense_pieces(
            *torch.cat([t.long() for t in (q_pos, k_pos, q_seg, k_seg)], 1).cpu().split(sizes, 1),  # noqa: E731
            causal,
        )
        return build() if plan is None else plan.get(("auto", causal), build)

    def _kernels(self, q: Tensor) -> list[str]:
        names = (
            ["cpu-flash"]
            if q.device.type == "cpu"
            else list(self.dense)
            if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            else []
        )
        return [n for n in names if (n, q.dtype, q.shape[-1]) not in self._refused]

    def _note(self, q: Tensor, pieces, impl: str) -> None:
        kind = (
            "decode"
            if q.device.type == "cuda" and q.shape[1] <= DECODE_MAX_Q
            else "masked"
            if pieces is None
            else "empty"
            if not pieces
            else "causal"
            if pieces[0][4] and len(pieces) == 1
            else "dense"
            if len(pieces) == 1
            else "pieces"
        )
        self.routes[(kind, impl)] += 1
        if self.routes[(kind, impl)] == 1:
            log.info("attention dispatch: %s blocks -> %s", kind, impl)

    def _try(self, i: int, q, pieces, *args):
        """The dense route (i = 0 forward, 1 backward) on the first kernel that takes it, else None."""
        for name in self._kernels(q) if pieces else ():
            try:
                return name, self._dense(i, KERNELS[name][i], q, pieces, *args)
            except RuntimeError as e:
                self._refused.add((name, q.dtype, q.shape[-1]))
                log.warning(
                    "attention dispatch: %s refused %s head dim %d (%s); trying the next kernel",
                    name,
                    q.dtype,
                    q.shape[-1],
                    str(e).splitlines()[0][:200],
                )
        return None

    def forward(self, q, k, v, q_pos, k_pos, q_seg, k_seg, scale, causal, plan=None):
        pieces = self._pieces(q, q_pos, k_pos, q_seg, k_seg, causal, plan)
        if pieces == []:
            self._note(q, pieces, "skip")
            B, Sq, Hq, _ = q.shape
            return q.new_zeros(q.shape), q.new_full(
                (B, Hq, Sq), float("-inf"), dtype=accum_dtype(q.dtype)
            )
        done = self._try(0, q, pieces, k, v, scale)
        be = None if done else _general(q)
        self._note(q, pieces, done[0] if done else be.name)
        return (
            done[1]
            if done
            else be.forward(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, causal, plan=plan)
        )

    def backward(
        self, dout, q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, scale, causal, plan=None
    ):
        pieces = self._pieces(q, q_pos, k_pos, q_seg, k_seg, causal, plan)
        if pieces == []:
            return tuple(
                torch.zeros(x.shape, dtype=accum_dtype(q.dtype), device=x.device) for x in (q, k, v)
            )
        done = self._try(1, q, pieces, k, v, scale, dout, out, lse)
        return (
            done[1]
            if done
            else _general(q).backward(
                dout, q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, scale, causal, plan=plan
            )
        )

    @staticmethod
    def _dense(i: int, fn, q, pieces, k, v, scale, dout=None, out=None, lse=None):
        """Forward (i = 0: out in q.dtype, lse) or backward (i = 1: fp32 grads) of the dense pieces. The
        CPU op computes in fp32 for 16-bit inputs (its bf16 backward is ~9x slower on CPUs without bf16
        matrix units)."""
        acc = accum_dtype(q.dtype)
        cdt = acc if q.device.type == "cpu" else q.dtype
        qc, kc, vc = (x.to(cdt) for x in (q, k, v))
        B, Sq, Hq, D = q.shape
        if i == 1:
            doc, oc, lse = (
                dout.to(cdt),
                out.to(cdt),
                lse.to(torch.float32 if q.device.type == "cuda" else cdt),
            )
            if pieces == [(0, Sq, 0, k.shape[1], pieces[0][4])]:
                return tuple(g.to(acc) for g in fn(doc, qc, kc, vc, oc, lse, scale, pieces[0][4]))
            grads = tuple(torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
            for q0, q1, k0, k1, c in pieces:
                g = fn(
                    doc[:, q0:q1],
                    qc[:, q0:q1],
                    kc[:, k0:k1],
                    vc[:, k0:k1],
                    oc[:, q0:q1],
                    lse[:, :, q0:q1],
                    scale,
                    c,
                )
                for x, sl, gx in zip(grads, (slice(q0, q1), slice(k0, k1), slice(k0, k1)), g):
                    x[:, sl] += gx
            return grads
        if len(pieces) == 1 and pieces[0][:2] == (0, Sq):  # one call covers every query: no copies
            o, lse = fn(
                qc,
                kc[:, pieces[0][2] : pieces[0][3]],
                vc[:, pieces[0][2] : pieces[0][3]],
                scale,
                pieces[0][4],
            )
            return o.to(q.dtype), lse.to(acc)
        overlap = any(
            b[0] < a[1] for a, b in zip(pieces, pieces[1:])
        )  # pieces sharing query rows merge in fp32
        out = q.new_zeros(q.shape, dtype=acc if overlap else q.dtype)
        lse = q.new_full((B, Hq, Sq), float("-inf"), dtype=acc)
        for q0, q1, k0, k1, c in pieces:
            o, l = fn(qc[:, q0:q1], kc[:, k0:k1], vc[:, k0:k1], scale, c)
            if overlap:  # merging into zeros / -inf rows is exact
                lse_merge_(out[:, q0:q1], lse[:, :, q0:q1], o, l)
            else:
                out[:, q0:q1], lse[:, :, q0:q1] = o, l
        return out.to(q.dtype), lse
