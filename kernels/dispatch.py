"""The `auto` block backend: every block on the fastest exact kernel for its mask.

Once per AttentionPlan (so once per ring step and model step, not per layer) a block's metadata is
copied to the host, the backend's one device read, and `attention_math.dense_pieces` decides:

    dense    the visible pairs are a few rectangles visible everywhere, or the aligned causal
             triangle: one document and no padding cut by the block, i.e. the local block of every
             zigzag ring step (one causal call) and every visiting block (one rectangle: all
             queries x the first key chunk, or the second query chunk x all keys). A dense kernel
             that returns the log-sum-exp and whose backward takes an external out/lse computes
             them: on CUDA, for fp16/bf16 and more than DECODE_MAX_Q queries, cuDNN
             (`aten._scaled_dot_product_cudnn_attention`, K/V heads repeated for GQA: its dense
             path takes one head count) and then SDPA's flash (`_scaled_dot_product_flash_attention`,
             GQA native); on CPU `_scaled_dot_product_flash_attention_for_cpu` (GQA native), in fp32
             for 16-bit inputs as the `cpu` backend does. Pieces that share query rows are merged
             in fp32 with the log-sum-exp rule.
    general  anything else (documents cut by the block, padding, shuffled positions), fp32 or
             decode on CUDA, and any shape a dense kernel refused: the `triton` backend on CUDA,
             `cpu` on CPU, with the same plan.
    skip     nothing visible: out = 0, lse = -inf, zero gradients, no kernel.

Every route is exact: the dense kernels' natural-log lse is the one the ring merges, and their
backward recomputes P = exp(S - lse) and rowsum(dO * O) from the global out/lse the ring passes,
so a block's gradients are its exact share. A dense kernel that raises for a (dtype, head dim) is
not asked again (logged once); the next one, or the general route, serves the block. Which block
kinds went where is logged once per run (`longvideo.kernels.dispatch`) and counted in `routes`.

The flash-attn package is not a route: its backward with an external out/lse is private API, and
`_scaled_dot_product_flash_attention` is its FlashAttention-2 kernel. The speed of each route on a
GPU is what `scripts/gpu_check.py` measures (docs/kernels.md).

sync_free: True: after a block's plan is built no call reads the device, so the ring launches
every block instead of testing it on the host; building the plan reads it once.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from .attention_math import Piece, accum_dtype, dense_pieces, lse_merge_
from .backends import get_backend

log = logging.getLogger(__name__)
DECODE_MAX_Q = 16  # fewer queries on CUDA: the triton decode kernel (split-K), no plan, no host read
_A = torch.ops.aten


def _t(x: Tensor) -> Tensor:
    return x.transpose(1, 2)  # (B, S, H, D) <-> (B, H, S, D) views, as a model hands SDPA its heads


def _repeat(x: Tensor, group: int) -> Tensor:
    return x if group == 1 else x.repeat_interleave(group, dim=2)  # kv head h // group serves query head h


def _cpu_fwd(q, k, v, scale, causal):
    o, lse = _A._scaled_dot_product_flash_attention_for_cpu(_t(q), _t(k), _t(v), 0.0, causal, scale=scale)
    return _t(o), lse


def _cpu_bwd(dout, q, k, v, out, lse, scale, causal):
    g = _A._scaled_dot_product_flash_attention_for_cpu_backward(_t(dout), _t(q), _t(k), _t(v), _t(out), lse, 0.0,
                                                                causal, scale=scale)
    return tuple(_t(x) for x in g)


def _flash_fwd(q, k, v, scale, causal):
    r = _A._scaled_dot_product_flash_attention(_t(q), _t(k), _t(v), 0.0, causal, False, scale=scale)
    return _t(r[0]), r[1]


def _flash_bwd(dout, q, k, v, out, lse, scale, causal):
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)  # read only with dropout
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    g = _A._scaled_dot_product_flash_attention_backward(_t(dout), _t(q), _t(k), _t(v), _t(out), lse.contiguous(),
                                                        None, None, q.shape[1], k.shape[1], 0.0, causal, seed,
                                                        offset, scale=scale)
    return tuple(_t(x) for x in g)


def _cudnn_fwd(q, k, v, scale, causal):
    G = q.shape[2] // k.shape[2]
    r = _A._scaled_dot_product_cudnn_attention(_t(q), _t(_repeat(k, G)), _t(_repeat(v, G)), None, True, 0.0, causal,
                                               False, scale=scale)
    return _t(r[0]), r[1][..., 0]  # lse (B, H, Sq, 1) -> (B, H, Sq)


def _cudnn_bwd(dout, q, k, v, out, lse, scale, causal):
    B, Sk, Hkv, D = k.shape
    G = q.shape[2] // Hkv
    seed = torch.empty((), dtype=torch.int64, device=q.device)  # read only with dropout
    dq, dk, dv = _A._scaled_dot_product_cudnn_attention_backward(
        _t(dout), _t(q), _t(_repeat(k, G)), _t(_repeat(v, G)), _t(out), lse.contiguous().unsqueeze(-1), seed, seed,
        None, None, None, q.shape[1], Sk, 0.0, causal, scale=scale)
    dk, dv = (_t(x).float().reshape(B, Sk, Hkv, G, D).sum(3) for x in (dk, dv))  # each kv head: its group's sum
    return _t(dq), dk, dv


KERNELS: dict[str, tuple[Callable, Callable]] = {
    "cudnn": (_cudnn_fwd, _cudnn_bwd),
    "flash": (_flash_fwd, _flash_bwd),
    "cpu-flash": (_cpu_fwd, _cpu_bwd),
}
"""The dense kernels: (forward -> (out, lse), backward with an external out/lse -> (dq, dk, dv))."""


class DispatchBackend:
    """The `auto` block backend (module docstring).

    dense: the CUDA dense kernels to try, in order (names of KERNELS; () sends every CUDA block to
    the triton backend). The instance `get_backend("auto")` returns tries cuDNN, then flash.
    """

    name = "auto"
    sync_free = True

    def __init__(self, dense: Sequence[str] = ("cudnn", "flash")):
        unknown = [d for d in dense if d not in KERNELS]
        if unknown:
            raise ValueError(f"unknown dense kernels {unknown}; choose from {sorted(KERNELS)}")
        self.dense = tuple(dense)
        self.routes: Counter = Counter()
        """Forward calls per (block kind, implementation): kinds causal, dense (one rectangle), pieces,
        empty, masked (needs the element mask), decode; e.g. ("causal", "cudnn"), ("masked", "triton")."""
        self._refused: set = set()

    # ---- choosing

    def _pieces(self, q, q_pos, k_pos, q_seg, k_seg, causal, plan) -> Optional[list[Piece]]:
        """The block's dense pieces (None: needs the mask), kept in the plan (one host read)."""
        if q.device.type == "cuda" and q.shape[1] <= DECODE_MAX_Q:
            return None

        def build():
            n = (q_pos.shape[1], k_pos.shape[1], q_seg.shape[1])
            meta = torch.cat([x.long() for x in (q_pos, k_pos, q_seg, k_seg)], 1).cpu().split(
                [n[0], n[1], n[2], k_seg.shape[1]], 1)
            return dense_pieces(*meta, causal)

        return build() if plan is None else plan.get(("auto", causal), build)

    def _kernels(self, q: Tensor) -> list[str]:
        if q.device.type == "cpu":
            names = ["cpu-flash"]
        elif q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
            names = list(self.dense)
        else:
            names = []
        return [n for n in names if (n, q.dtype, q.shape[-1]) not in self._refused]

    def _general(self, q: Tensor):
        return get_backend("triton" if q.device.type == "cuda" else "cpu", q.device)

    def _note(self, q: Tensor, pieces, impl: str) -> None:
        kind = ("decode" if q.device.type == "cuda" and q.shape[1] <= DECODE_MAX_Q else "masked" if pieces is None
                else "empty" if not pieces else "causal" if pieces[0][4] and len(pieces) == 1
                else "dense" if len(pieces) == 1 else "pieces")
        self.routes[(kind, impl)] += 1
        if self.routes[(kind, impl)] == 1:
            log.info("attention dispatch: %s blocks -> %s", kind, impl)

    def _refuse(self, name: str, q: Tensor, err: Exception) -> None:
        self._refused.add((name, q.dtype, q.shape[-1]))
        log.warning("attention dispatch: %s refused %s head dim %d (%s); using the next kernel", name, q.dtype,
                    q.shape[-1], str(err).splitlines()[0][:200])

    # ---- the backend interface (backends.py)

    def forward(self, q, k, v, q_pos, k_pos, q_seg, k_seg, scale, causal, plan=None):
        pieces = self._pieces(q, q_pos, k_pos, q_seg, k_seg, causal, plan)
        if pieces == []:
            self._note(q, pieces, "skip")
            lse_dt = accum_dtype(q.dtype)
            return (q.new_zeros(q.shape), q.new_full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"),
                                                     dtype=lse_dt))
        for name in self._kernels(q) if pieces is not None else ():
            try:
                result = self._dense_forward(KERNELS[name][0], q, k, v, pieces, scale)
            except RuntimeError as e:
                self._refuse(name, q, e)
                continue
            self._note(q, pieces, name)
            return result
        be = self._general(q)
        self._note(q, pieces, be.name)
        return be.forward(q, k, v, q_pos, k_pos, q_seg, k_seg, scale, causal, plan=plan)

    def backward(self, dout, q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, scale, causal, plan=None):
        pieces = self._pieces(q, q_pos, k_pos, q_seg, k_seg, causal, plan)
        acc = accum_dtype(q.dtype)
        if pieces == []:
            return tuple(torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
        for name in self._kernels(q) if pieces is not None else ():
            try:
                return self._dense_backward(KERNELS[name][1], dout, q, k, v, out, lse, pieces, scale)
            except RuntimeError as e:
                self._refuse(name, q, e)
        return self._general(q).backward(dout, q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, scale, causal,
                                         plan=plan)

    # ---- dense pieces

    @staticmethod
    def _compute_dtype(q: Tensor) -> torch.dtype:
        # the CPU op's 16-bit backward is ~9x slower than fp32 on CPUs without bf16 matrix units
        return accum_dtype(q.dtype) if q.device.type == "cpu" else q.dtype

    def _dense_forward(self, fwd, q, k, v, pieces, scale):
        B, Sq, Hq, D = q.shape
        cdt, lse_dt = self._compute_dtype(q), accum_dtype(q.dtype)
        qc, kc, vc = (x.to(cdt) for x in (q, k, v))
        if len(pieces) == 1 and pieces[0][:2] == (0, Sq):  # one call covers every query: no copies
            _, _, k0, k1, c = pieces[0]
            o, lse = fwd(qc, kc[:, k0:k1], vc[:, k0:k1], scale, c)
            return o.to(q.dtype), lse.to(lse_dt)
        overlap = any(b[0] < a[1] for a, b in zip(pieces, pieces[1:]))  # pieces sharing query rows
        out = q.new_zeros(q.shape, dtype=accum_dtype(q.dtype) if overlap else q.dtype)
        lse = q.new_full((B, Hq, Sq), float("-inf"), dtype=lse_dt)
        for q0, q1, k0, k1, c in pieces:
            o, l = fwd(qc[:, q0:q1], kc[:, k0:k1], vc[:, k0:k1], scale, c)
            if overlap:  # merging into zeros / -inf rows is exact
                lse_merge_(out[:, q0:q1], lse[:, :, q0:q1], o, l)
            else:
                out[:, q0:q1] = o
                lse[:, :, q0:q1] = l
        return out.to(q.dtype), lse

    def _dense_backward(self, bwd, dout, q, k, v, out, lse, pieces, scale):
        cdt, acc = self._compute_dtype(q), accum_dtype(q.dtype)
        qc, kc, vc, doc, oc = (x.to(cdt) for x in (q, k, v, dout, out))
        lse = lse.to(torch.float32 if q.device.type == "cuda" else cdt)
        if pieces == [(0, q.shape[1], 0, k.shape[1], pieces[0][4])]:
            return tuple(g.to(acc) for g in bwd(doc, qc, kc, vc, oc, lse, scale, pieces[0][4]))
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
        for q0, q1, k0, k1, c in pieces:
            g = bwd(doc[:, q0:q1], qc[:, q0:q1], kc[:, k0:k1], vc[:, k0:k1], oc[:, q0:q1], lse[:, :, q0:q1], scale, c)
            dq[:, q0:q1] += g[0]
            dk[:, k0:k1] += g[1]
            dv[:, k0:k1] += g[2]
        return dq, dk, dv
