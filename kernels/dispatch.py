"""The `auto` block backend: every block on the fastest exact kernel for its mask (docs/kernels.md,
"Per-block dispatch"). Once per AttentionPlan the block's metadata is read on the host and
`attention_math.dense_pieces` decides: dense pieces to cuDNN, then SDPA flash (CUDA) or the CPU
flash op; the rest to `triton` (CUDA) / `cpu` with the same plan; an empty block to no kernel.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch
from torch import Tensor

from .attention_math import Piece, accum_dtype, dense_pieces, lse_merge_
from .backends import Upstream, get_backend
from .meta import AttentionMeta, Side

T = TypeVar("T")

log = logging.getLogger(__name__)
DECODE_MAX_Q = (
    16  # fewer queries on CUDA: the triton decode kernel (split-K), no plan, no host read
)
_A = torch.ops.aten
_t = lambda x: x.transpose(1, 2)  # noqa: E731 - (B, S, H, D) <-> (B, H, S, D) views, as a model hands SDPA its heads
_repeat = lambda x, g: x if g == 1 else x.repeat_interleave(g, dim=2)  # noqa: E731 - kv head h // g serves head h
_pair = lambda side: (side.positions, side.segment_ids)  # noqa: E731


class DenseCall(NamedTuple):
    """How a dense kernel computes one piece: the softmax scale, and whether the piece is the
    aligned causal triangle (the kernel's is_causal) or a rectangle every query sees whole."""

    scale: float
    causal: bool


def _cpu_fwd(q, k, v, call: DenseCall):
    o, lse = _A._scaled_dot_product_flash_attention_for_cpu(
        _t(q), _t(k), _t(v), 0.0, call.causal, scale=call.scale
    )
    return _t(o), lse


def _cpu_bwd(dout, q, k, v, out, lse, call: DenseCall):
    return tuple(
        _t(x)
        for x in _A._scaled_dot_product_flash_attention_for_cpu_backward(
            _t(dout), _t(q), _t(k), _t(v), _t(out), lse, 0.0, call.causal, scale=call.scale
        )
    )


def _flash_fwd(q, k, v, call: DenseCall):
    r = _A._scaled_dot_product_flash_attention(
        _t(q), _t(k), _t(v), 0.0, call.causal, False, scale=call.scale
    )
    return _t(r[0]), r[1]


def _flash_bwd(dout, q, k, v, out, lse, call: DenseCall):
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
            call.causal,
            seed,
            offset,
            scale=call.scale,
        )
    )


def _cudnn_fwd(q, k, v, call: DenseCall):
    group = q.shape[2] // k.shape[2]
    r = _A._scaled_dot_product_cudnn_attention(
        _t(q),
        _t(_repeat(k, group)),
        _t(_repeat(v, group)),
        None,
        True,
        0.0,
        call.causal,
        False,
        scale=call.scale,
    )
    return _t(r[0]), r[1][..., 0]  # lse (B, H, Sq, 1) -> (B, H, Sq)


def _cudnn_bwd(dout, q, k, v, out, lse, call: DenseCall):
    B, Sk, Hkv, D = k.shape
    group = q.shape[2] // Hkv
    seed = torch.empty((), dtype=torch.int64, device=q.device)  # read with dropout only
    dq, dk, dv = _A._scaled_dot_product_cudnn_attention_backward(
        _t(dout),
        _t(q),
        _t(_repeat(k, group)),
        _t(_repeat(v, group)),
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
        call.causal,
        scale=call.scale,
    )
    return (
        _t(dq),
        *(_t(x).float().reshape(B, Sk, Hkv, group, D).sum(3) for x in (dk, dv)),
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

    def _pieces(self, q: Tensor, meta: AttentionMeta) -> list[Piece] | None:
        """The block's dense pieces (None: it needs the mask), kept in the metadata's plans."""
        if q.device.type == "cuda" and q.shape[1] <= DECODE_MAX_Q:
            return None

        def build():
            queries, keys = meta.queries, meta.keys
            host = torch.cat([t.long() for t in (*_pair(queries), *_pair(keys))], 1).cpu()
            q_pos, q_seg, k_pos, k_seg = host.split([queries.length] * 2 + [keys.length] * 2, 1)
            return dense_pieces(Side(q_pos, q_seg), Side(k_pos, k_seg), meta.causal)

        return meta.plans.get(("auto", meta.causal), build)

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

    def _try(self, q: Tensor, pieces, run: Callable[[DenseRoute], T]) -> tuple[str, T] | None:
        """(kernel name, run(route)) on the first dense kernel that takes the pieces, else None."""
        for name in self._kernels(q) if pieces else ():
            try:
                return name, run(DenseRoute(name, pieces))
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

    def forward(self, q, k, v, meta: AttentionMeta):
        pieces = self._pieces(q, meta)
        if pieces == []:
            self._note(q, pieces, "skip")
            B, Sq, Hq, _ = q.shape
            return q.new_zeros(q.shape), q.new_full(
                (B, Hq, Sq), float("-inf"), dtype=accum_dtype(q.dtype)
            )
        scale = meta.scale_for(q.shape[-1])
        done = self._try(q, pieces, lambda route: route.forward(q, k, v, scale))
        if done is not None:
            self._note(q, pieces, done[0])
            return done[1]
        general = _general(q)
        self._note(q, pieces, general.name)
        return general.forward(q, k, v, meta)

    def backward(self, dout, q, k, v, out, lse, meta: AttentionMeta):
        pieces = self._pieces(q, meta)
        if pieces == []:
            return tuple(
                torch.zeros(x.shape, dtype=accum_dtype(q.dtype), device=x.device) for x in (q, k, v)
            )
        scale = meta.scale_for(q.shape[-1])
        upstream = Upstream(dout, out, lse)
        done = self._try(q, pieces, lambda route: route.backward(upstream, q, k, v, scale))
        if done is not None:
            return done[1]
        return _general(q).backward(dout, q, k, v, out, lse, meta)


@dataclass(frozen=True)
class DenseRoute:
    """A block's dense pieces on one dense kernel (KERNELS' name). The CPU op computes in fp32 for
    16-bit inputs (its bf16 backward is ~9x slower on CPUs without bf16 matrix units)."""

    kernel: str
    pieces: list[Piece]

    def _inputs(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        compute = accum_dtype(q.dtype) if q.device.type == "cpu" else q.dtype
        return tuple(x.to(compute) for x in (q, k, v))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """out in q.dtype and lse in the accumulation dtype."""
        fn, pieces, acc = KERNELS[self.kernel][0], self.pieces, accum_dtype(q.dtype)
        qc, kc, vc = self._inputs(q, k, v)
        B, Sq, Hq, D = q.shape
        if len(pieces) == 1 and pieces[0][:2] == (0, Sq):  # one call covers every query: no copies
            q0, q1, k0, k1, causal = pieces[0]
            o, lse = fn(qc, kc[:, k0:k1], vc[:, k0:k1], DenseCall(scale, causal))
            return o.to(q.dtype), lse.to(acc)
        overlap = any(
            b[0] < a[1] for a, b in zip(pieces, pieces[1:])
        )  # pieces sharing query rows merge in fp32
        out = q.new_zeros(q.shape, dtype=acc if overlap else q.dtype)
        lse = q.new_full((B, Hq, Sq), float("-inf"), dtype=acc)
        for q0, q1, k0, k1, causal in pieces:
            o, piece_lse = fn(qc[:, q0:q1], kc[:, k0:k1], vc[:, k0:k1], DenseCall(scale, causal))
            if overlap:  # merging into zeros / -inf rows is exact
                lse_merge_(out[:, q0:q1], lse[:, :, q0:q1], o, piece_lse)
            else:
                out[:, q0:q1], lse[:, :, q0:q1] = o, piece_lse
        return out.to(q.dtype), lse

    def backward(
        self, upstream: Upstream, q: Tensor, k: Tensor, v: Tensor, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """dq, dk, dv in the accumulation dtype."""
        fn, pieces, acc = KERNELS[self.kernel][1], self.pieces, accum_dtype(q.dtype)
        qc, kc, vc = self._inputs(q, k, v)
        compute = qc.dtype
        doc, oc = upstream.dout.to(compute), upstream.out.to(compute)
        lse = upstream.lse.to(torch.float32 if q.device.type == "cuda" else compute)
        Sq = q.shape[1]
        if pieces == [(0, Sq, 0, k.shape[1], pieces[0][4])]:
            call = DenseCall(scale, pieces[0][4])
            return tuple(g.to(acc) for g in fn(doc, qc, kc, vc, oc, lse, call))
        grads = tuple(torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
        for q0, q1, k0, k1, causal in pieces:
            piece = fn(
                doc[:, q0:q1],
                qc[:, q0:q1],
                kc[:, k0:k1],
                vc[:, k0:k1],
                oc[:, q0:q1],
                lse[:, :, q0:q1],
                DenseCall(scale, causal),
            )
            for x, rows, gx in zip(grads, (slice(q0, q1), slice(k0, k1), slice(k0, k1)), piece):
                x[:, rows] += gx
        return grads
