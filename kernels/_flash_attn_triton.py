"""Raw Triton kernels of masked flash attention and their launchers.

Layouts: q, out, dout (B, Sq, Hq, D); k, v (B, Sk, Hkv, D), any strides with a unit last stride;
positions and segment ids int32 (B, S); lse (B, Hq, Sq) float32.

Masks are never materialised. A *tile plan* (built here in PyTorch, O(B * tiles^2) integers)
classifies every (query tile, key tile) pair from per-tile min/max of positions and segment ids
(attention_math.classify_tiles, the same bounds every backend and the ring use):

    skip     no pair in the tile can be visible (disjoint segment ranges, all keys in the future,
             only padding)                                    -> never visited
    full     every pair is visible and every row/column is in range -> no mask arithmetic at all
    partial  anything else                                    -> mask from the position/segment vectors

and lists, per query tile (and per key tile for the dK/dV kernel), the tiles to visit, full ones
first. The kernels loop over those lists, so the inner loops hold no data-dependent branch and the
compiler can software-pipeline the loads; the loop bounds come from memory, so no host sync.

Softmax runs in base 2: s2 = (q . k) * scale * log2(e), lse2 = lse * log2(e).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .attention_math import classify_tiles, tile_stats

# Triton's interpreter computes tl.dot on bf16 operands wrongly; under it every dot upcasts its
# operands to fp32 (values already rounded to the input dtype, so the result matches a GPU dot
# with fp32 accumulation). Read once, at import, the moment triton.jit reads it too.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

LOG2E = 1.4426950408889634
HEAD_DIMS = (16, 32, 64, 128)  # tl.arange needs a power of two; tl.dot needs >= 16


# ----------------------------------------------------------------------------- kernels
# Every dot is tl.dot(a.to(DOT), b.to(DOT), input_precision=PREC). On a GPU, DOT is the input dtype
# (the casts are no-ops); under the interpreter it is fp32 (see INTERPRET). PREC is "tf32x3" for
# fp32 inputs on a GPU (three TF32 products: fp32-level error on tensor cores, where exact "ieee"
# dots spill heavily), "ieee" under the interpreter, and "tf32" otherwise (unused by 16-bit dots).
# Helpers are inlined by hand in the loops: the interpreter re-patches the language on every call
# of a jit function, which would dominate its run time.


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, q_pos, q_seg, K_base, V_base, KPOS_b, KSEG_b, PLAN_row, t_start, t_end,
               Sk, stride_ks, stride_vs, qk_scale, offs_n0, offs_d,
               BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT: tl.constexpr,
               PREC: tl.constexpr):
    """Online softmax over the key tiles PLAN_row[t_start:t_end] (all full, or all partial)."""
    for t in range(t_start, t_end):
        nb = tl.load(PLAN_row + t)
        offs_n = nb * BLOCK_N + offs_n0
        kt_ptrs = K_base + nb.to(tl.int64) * BLOCK_N * stride_ks + offs_n0[None, :] * stride_ks + offs_d[:, None]
        v_ptrs = V_base + nb.to(tl.int64) * BLOCK_N * stride_vs + offs_n0[:, None] * stride_vs + offs_d[None, :]
        if MASKED:  # the last tile may run past Sk: read zeros there, never garbage that could be nan
            kt = tl.load(kt_ptrs, mask=offs_n[None, :] < Sk, other=0.0)  # (D, BLOCK_N)
            v = tl.load(v_ptrs, mask=offs_n[:, None] < Sk, other=0.0)  # (BLOCK_N, D)
        else:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, kt.to(DOT), input_precision=PREC) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASKED:
            k_seg = tl.load(KSEG_b + offs_n, mask=offs_n < Sk, other=-1)
            vis = (q_seg[:, None] == k_seg[None, :]) & (k_seg[None, :] >= 0)
            if CAUSAL:
                k_pos = tl.load(KPOS_b + offs_n, mask=offs_n < Sk, other=0)
                vis = vis & (k_pos[None, :] <= q_pos[:, None])
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with nothing visible yet keeps m = -inf: shift by 0 there so exp2 never sees inf - inf
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(DOT), v.to(DOT), input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, QPOS, KPOS, QSEG, KSEG, PLAN, NFULL, NPART,
                stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                Hq, GROUP, Sq, Sk, N_M_TILES, N_N_TILES, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """One query tile of one (batch, query head): out and lse."""
    pid_m = N_M_TILES - 1 - tl.program_id(0)  # under a causal mask late tiles have most work: start them first
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP  # GQA: the kv head this query head reads; K/V are never copied
    b64 = b.to(tl.int64)
    start_m = pid_m.to(tl.int64) * BLOCK_M  # int64 tile origins: B*S*H*D may pass 2**31

    offs_m0 = tl.arange(0, BLOCK_M)
    offs_m = pid_m * BLOCK_M + offs_m0
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq

    Q_base = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + start_m * stride_qs
    q = tl.load(Q_base + offs_m0[:, None] * stride_qs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    q = q.to(DOT)  # (BLOCK_M, D)
    q_pos = tl.load(QPOS + b64 * Sq + offs_m, mask=row_ok, other=0)
    q_seg = tl.load(QSEG + b64 * Sq + offs_m, mask=row_ok, other=-1)

    tile = b * N_M_TILES + pid_m
    n_full = tl.load(NFULL + tile)
    n_part = tl.load(NPART + tile)
    PLAN_row = PLAN + tile.to(tl.int64) * N_N_TILES
    K_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    V_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, q_pos, q_seg, K_base, V_base, KPOS + b64 * Sk, KSEG + b64 * Sk,
                               PLAN_row, 0, n_full, Sk, stride_ks, stride_vs, qk_scale, offs_n0, offs_d,
                               BLOCK_N, CAUSAL, False, DOT, PREC)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, q_pos, q_seg, K_base, V_base, KPOS + b64 * Sk, KSEG + b64 * Sk,
                               PLAN_row, n_full, n_full + n_part, Sk, stride_ks, stride_vs, qk_scale, offs_n0,
                               offs_d, BLOCK_N, CAUSAL, True, DOT, PREC)

    has = l_i > 0.0  # rows with no visible key: out = 0, lse = -inf
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # back to base e

    O_base = O + b64 * stride_ob + h.to(tl.int64) * stride_oh + start_m * stride_os
    tl.store(O_base + offs_m0[:, None] * stride_os + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(LSE + pid_bh.to(tl.int64) * Sq + offs_m, lse, mask=row_ok)


@triton.jit
def _bwd_preprocess(O, DO, LSE, DELTA, LSE2,
                    stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh,
                    Hq, Sq, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O) in fp32, and lse in log2 units with -inf -> +inf (P = 0 on empty rows)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None].to(tl.int64) * stride_os + offs_d[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None].to(tl.int64) * stride_dos
                 + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    row = pid_bh.to(tl.int64) * Sq + offs_m
    tl.store(DELTA + row, tl.sum(o * do, 1), mask=row_ok)
    lse = tl.load(LSE + row, mask=row_ok, other=0.0)
    tl.store(LSE2 + row, tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634), mask=row_ok)


@triton.jit
def _dkdv_inner(dk, dv, k, v, k_pos, k_seg, Q_base, DO_base, LSE2_row, DELTA_row, QPOS_b, QSEG_b, PLAN_row,
                t_start, t_end, Sq, stride_qs, stride_dos, qk_scale, offs_m0, offs_d,
                BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT: tl.constexpr,
                PREC: tl.constexpr):
    """dK, dV of one key tile from the query tiles PLAN_row[t_start:t_end] of one query head.
    Scores are kept transposed, (BLOCK_N, BLOCK_M), so the key tile is the row operand throughout."""
    for t in range(t_start, t_end):
        mb = tl.load(PLAN_row + t)
        offs_m = mb * BLOCK_M + offs_m0
        q_ptrs = Q_base + mb.to(tl.int64) * BLOCK_M * stride_qs + offs_m0[:, None] * stride_qs + offs_d[None, :]
        do_ptrs = DO_base + mb.to(tl.int64) * BLOCK_M * stride_dos + offs_m0[:, None] * stride_dos + offs_d[None, :]
        if MASKED:
            row_ok = offs_m < Sq
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # (BLOCK_M, D)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(LSE2_row + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA_row + offs_m, mask=row_ok, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse2 = tl.load(LSE2_row + offs_m)
            delta = tl.load(DELTA_row + offs_m)
        st = tl.dot(k, tl.trans(q.to(DOT)), input_precision=PREC) * qk_scale  # (BLOCK_N, BLOCK_M)
        pt = tl.math.exp2(st - lse2[None, :])
        if MASKED:
            q_seg = tl.load(QSEG_b + offs_m, mask=row_ok, other=-1)
            vis = (k_seg[:, None] == q_seg[None, :]) & (k_seg[:, None] >= 0)
            if CAUSAL:
                q_pos = tl.load(QPOS_b + offs_m, mask=row_ok, other=0)
                vis = vis & (k_pos[:, None] <= q_pos[None, :])
            pt = tl.where(vis, pt, 0.0)
        dv += tl.dot(pt.to(do.dtype).to(DOT), do.to(DOT), input_precision=PREC)
        dpt = tl.dot(v, tl.trans(do.to(DOT)), input_precision=PREC)  # (BLOCK_N, BLOCK_M)
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(q.dtype).to(DOT), q.to(DOT), input_precision=PREC)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE2, DELTA, DK, DV, QPOS, KPOS, QSEG, KSEG, PLAN, NFULL, NPART,
                     stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                     stride_dkb, stride_dks, stride_dkh,
                     Hq, Hkv, GROUP, Sq, Sk, N_M_TILES, N_N_TILES, qk_scale, sm_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """One key tile of one (batch, kv head). It loops over every query head of its GQA group, so
    dK/dV accumulate in registers and are written once: no atomics, no K/V copies."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    b64 = b.to(tl.int64)
    start_n = pid_n.to(tl.int64) * BLOCK_N

    offs_n0 = tl.arange(0, BLOCK_N)
    offs_n = pid_n * BLOCK_N + offs_n0
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < Sk

    k = tl.load(K + b64 * stride_kb + hk.to(tl.int64) * stride_kh + start_n * stride_ks
                + offs_n0[:, None] * stride_ks + offs_d[None, :], mask=col_ok[:, None], other=0.0).to(DOT)
    v = tl.load(V + b64 * stride_vb + hk.to(tl.int64) * stride_vh + start_n * stride_vs
                + offs_n0[:, None] * stride_vs + offs_d[None, :], mask=col_ok[:, None], other=0.0).to(DOT)
    k_pos = tl.load(KPOS + b64 * Sk + offs_n, mask=col_ok, other=0)
    k_seg = tl.load(KSEG + b64 * Sk + offs_n, mask=col_ok, other=-1)

    tile = b * N_N_TILES + pid_n
    n_full = tl.load(NFULL + tile)
    n_part = tl.load(NPART + tile)
    PLAN_row = PLAN + tile.to(tl.int64) * N_M_TILES

    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for g in range(0, GROUP):
        h = (hk * GROUP + g).to(tl.int64)
        Q_base = Q + b64 * stride_qb + h * stride_qh
        DO_base = DO + b64 * stride_dob + h * stride_doh
        row = (b64 * Hq + h) * Sq
        dk, dv = _dkdv_inner(dk, dv, k, v, k_pos, k_seg, Q_base, DO_base, LSE2 + row, DELTA + row,
                             QPOS + b64 * Sq, QSEG + b64 * Sq, PLAN_row, 0, n_full, Sq, stride_qs, stride_dos,
                             qk_scale, offs_m0, offs_d, BLOCK_M, CAUSAL, False, DOT, PREC)
        dk, dv = _dkdv_inner(dk, dv, k, v, k_pos, k_seg, Q_base, DO_base, LSE2 + row, DELTA + row,
                             QPOS + b64 * Sq, QSEG + b64 * Sq, PLAN_row, n_full, n_full + n_part, Sq, stride_qs,
                             stride_dos, qk_scale, offs_m0, offs_d, BLOCK_M, CAUSAL, True, DOT, PREC)

    ptrs = b64 * stride_dkb + hk.to(tl.int64) * stride_dkh + start_n * stride_dks \
        + offs_n0[:, None] * stride_dks + offs_d[None, :]
    tl.store(DK + ptrs, dk * sm_scale, mask=col_ok[:, None])
    tl.store(DV + ptrs, dv, mask=col_ok[:, None])


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, q_pos, q_seg, K_base, V_base, KPOS_b, KSEG_b, PLAN_row, t_start, t_end,
              Sk, stride_ks, stride_vs, qk_scale, offs_n0, offs_d,
              BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT: tl.constexpr,
              PREC: tl.constexpr):
    """dQ of one query tile from the key tiles PLAN_row[t_start:t_end]."""
    for t in range(t_start, t_end):
        nb = tl.load(PLAN_row + t)
        offs_n = nb * BLOCK_N + offs_n0
        k_ptrs = K_base + nb.to(tl.int64) * BLOCK_N * stride_ks + offs_n0[:, None] * stride_ks + offs_d[None, :]
        v_ptrs = V_base + nb.to(tl.int64) * BLOCK_N * stride_vs + offs_n0[:, None] * stride_vs + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=offs_n[:, None] < Sk, other=0.0)  # (BLOCK_N, D)
            v = tl.load(v_ptrs, mask=offs_n[:, None] < Sk, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, tl.trans(k.to(DOT)), input_precision=PREC) * qk_scale  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            k_seg = tl.load(KSEG_b + offs_n, mask=offs_n < Sk, other=-1)
            vis = (q_seg[:, None] == k_seg[None, :]) & (k_seg[None, :] >= 0)
            if CAUSAL:
                k_pos = tl.load(KPOS_b + offs_n, mask=offs_n < Sk, other=0)
                vis = vis & (k_pos[None, :] <= q_pos[:, None])
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, tl.trans(v.to(DOT)), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype).to(DOT), k.to(DOT), input_precision=PREC)
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE2, DELTA, DQ, QPOS, KPOS, QSEG, KSEG, PLAN, NFULL, NPART,
                   stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                   stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                   stride_dqb, stride_dqs, stride_dqh,
                   Hq, GROUP, Sq, Sk, N_M_TILES, N_N_TILES, qk_scale, sm_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """One query tile of one (batch, query head): dQ."""
    pid_m = N_M_TILES - 1 - tl.program_id(0)  # late tiles first, as in the forward
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP
    b64 = b.to(tl.int64)
    start_m = pid_m.to(tl.int64) * BLOCK_M

    offs_m0 = tl.arange(0, BLOCK_M)
    offs_m = pid_m * BLOCK_M + offs_m0
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq

    q = tl.load(Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + start_m * stride_qs
                + offs_m0[:, None] * stride_qs + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(DOT)
    do = tl.load(DO + b64 * stride_dob + h.to(tl.int64) * stride_doh + start_m * stride_dos
                 + offs_m0[:, None] * stride_dos + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(DOT)
    row = pid_bh.to(tl.int64) * Sq + offs_m
    lse2 = tl.load(LSE2 + row, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    q_pos = tl.load(QPOS + b64 * Sq + offs_m, mask=row_ok, other=0)
    q_seg = tl.load(QSEG + b64 * Sq + offs_m, mask=row_ok, other=-1)

    tile = b * N_M_TILES + pid_m
    n_full = tl.load(NFULL + tile)
    n_part = tl.load(NPART + tile)
    PLAN_row = PLAN + tile.to(tl.int64) * N_N_TILES
    K_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    V_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh

    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    dq = _dq_inner(dq, q, do, lse2, delta, q_pos, q_seg, K_base, V_base, KPOS + b64 * Sk, KSEG + b64 * Sk,
                   PLAN_row, 0, n_full, Sk, stride_ks, stride_vs, qk_scale, offs_n0, offs_d,
                   BLOCK_N, CAUSAL, False, DOT, PREC)
    dq = _dq_inner(dq, q, do, lse2, delta, q_pos, q_seg, K_base, V_base, KPOS + b64 * Sk, KSEG + b64 * Sk,
                   PLAN_row, n_full, n_full + n_part, Sk, stride_ks, stride_vs, qk_scale, offs_n0, offs_d,
                   BLOCK_N, CAUSAL, True, DOT, PREC)
    tl.store(DQ + b64 * stride_dqb + h.to(tl.int64) * stride_dqh + start_m * stride_dqs
             + offs_m0[:, None] * stride_dqs + offs_d[None, :], dq * sm_scale, mask=row_ok[:, None])


# ----------------------------------------------------------------------------- tile plan (torch)


@dataclass(frozen=True)
class TilePlan:
    """Per row tile: the column tiles to visit (full ones first) and how many of each kind.

    order (B, n_rows, n_cols) int32; n_full, n_part (B, n_rows) int32.
    """

    order: Tensor
    n_full: Tensor
    n_part: Tensor


def tile_classes(q_pos: Tensor, k_pos: Tensor, q_seg: Tensor, k_seg: Tensor, causal: bool,
                 block_m: int, block_n: int) -> Tensor:
    """(B, n_m, n_n) int8: SKIP 0, PARTIAL 1 (needs the mask), FULL 2 (every pair visible)."""
    return classify_tiles(tile_stats(q_pos, q_seg, block_m), tile_stats(k_pos, k_seg, block_n), causal)


def plan_from_classes(cls: Tensor) -> TilePlan:
    """Visit lists along the last dim of a (B, rows, cols) class tensor."""
    order = torch.argsort(cls, dim=-1, descending=True, stable=True).to(torch.int32)
    n_full = (cls == 2).sum(-1, dtype=torch.int32)
    n_part = (cls == 1).sum(-1, dtype=torch.int32)
    return TilePlan(order.contiguous(), n_full.contiguous(), n_part.contiguous())


# ----------------------------------------------------------------------------- launch configs


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _configs(head_dim: int, dtype: torch.dtype) -> tuple[LaunchConfig, LaunchConfig, LaunchConfig]:
    """(forward, dK/dV, dQ) tile shapes.

    GPU shapes were chosen for Hopper from ptxas reports (no register spills with 16-byte aligned
    strides, which Triton specialises on): see docs/kernels.md. fp32 (three TF32 dots each) gets
    smaller tiles. Under the interpreter the cost is per tile op, and 16-wide tiles let tiny test
    shapes span several tiles.
    """
    if INTERPRET:
        c = LaunchConfig(16, 16, 4, 1)
        return c, c, c
    if dtype == torch.float32:  # a correctness path: three dots each, small tiles to fit shared memory
        c = LaunchConfig(32, 32, 4, 2)
        return c, c, c
    if head_dim <= 64:
        return LaunchConfig(128, 64, 4, 3), LaunchConfig(64, 128, 8, 3), LaunchConfig(128, 64, 8, 3)
    return LaunchConfig(128, 64, 8, 3), LaunchConfig(32, 128, 8, 3), LaunchConfig(128, 64, 8, 3)


def _meta(x: Tensor) -> Tensor:
    return x.to(torch.int32).contiguous()


def _unit_last(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _flags(dtype: torch.dtype) -> dict:
    """Dot operand dtype and precision (see the note above the kernels)."""
    if INTERPRET:
        return dict(DOT=tl.float32, PREC="ieee")
    return dict(DOT=_TL_DTYPES[dtype], PREC="tf32x3" if dtype == torch.float32 else "tf32")


# ----------------------------------------------------------------------------- launchers


def flash_attn_forward(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, q_seg: Tensor,
                       k_seg: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """out (B, Sq, Hq, D) in q.dtype, lse (B, Hq, Sq) float32."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    q_pos, k_pos, q_seg, k_seg = _meta(q_pos), _meta(k_pos), _meta(q_seg), _meta(k_seg)
    out = torch.empty(B, Sq, Hq, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    if Sk == 0:  # nothing to attend to: every row is empty
        out.zero_()
        lse.fill_(float("-inf"))
    if Sq == 0 or Sk == 0 or B * Hq == 0:
        return out, lse
    cfg, _, _ = _configs(D, q.dtype)
    n_m, n_n = triton.cdiv(Sq, cfg.block_m), triton.cdiv(Sk, cfg.block_n)
    plan = plan_from_classes(tile_classes(q_pos, k_pos, q_seg, k_seg, causal, cfg.block_m, cfg.block_n))
    _fwd_kernel[(n_m, B * Hq)](
        q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, plan.order, plan.n_full, plan.n_part,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        Hq, Hq // Hkv, Sq, Sk, n_m, n_n, scale * LOG2E,
        HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_flags(q.dtype))
    return out, lse


def flash_attn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        q_pos: Tensor, k_pos: Tensor, q_seg: Tensor, k_seg: Tensor, scale: float,
                        causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """dq (B, Sq, Hq, D), dk, dv (B, Sk, Hkv, D), all float32. `out`/`lse` may be global ones."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    # delta = rowsum(dO * O) reads dout/out as given (a ring passes fp32 ones); the dots read dout
    # in the input dtype, like every other operand
    dout, out = _unit_last(dout), _unit_last(out)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    q_pos, k_pos, q_seg, k_seg = _meta(q_pos), _meta(k_pos), _meta(q_seg), _meta(k_seg)
    lse = lse.to(torch.float32).contiguous()
    dq = torch.zeros(B, Sq, Hq, D, dtype=torch.float32, device=q.device)
    dk = torch.zeros(B, Sk, Hkv, D, dtype=torch.float32, device=q.device)
    dv = torch.zeros(B, Sk, Hkv, D, dtype=torch.float32, device=q.device)
    if Sq == 0 or Sk == 0 or B * Hq == 0:
        return dq, dk, dv
    _, ckv, cq = _configs(D, q.dtype)
    flags = _flags(q.dtype)

    delta = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    pre_m = 64 if not INTERPRET else 16
    _bwd_preprocess[(triton.cdiv(Sq, pre_m), B * Hq)](
        out, dout, lse, delta, lse2, out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2), Hq, Sq, HEAD_DIM=D, BLOCK_M=pre_m)

    dout = dout.to(q.dtype)
    n_m, n_n = triton.cdiv(Sq, ckv.block_m), triton.cdiv(Sk, ckv.block_n)
    cls = tile_classes(q_pos, k_pos, q_seg, k_seg, causal, ckv.block_m, ckv.block_n)
    plan_t = plan_from_classes(cls.transpose(1, 2))
    _bwd_dkdv_kernel[(n_n, B * Hkv)](
        q, k, v, dout, lse2, delta, dk, dv, q_pos, k_pos, q_seg, k_seg, plan_t.order, plan_t.n_full, plan_t.n_part,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        Hq, Hkv, G, Sq, Sk, n_m, n_n, scale * LOG2E, scale,
        HEAD_DIM=D, BLOCK_M=ckv.block_m, BLOCK_N=ckv.block_n, CAUSAL=causal,
        num_warps=ckv.num_warps, num_stages=ckv.num_stages, **flags)

    if (cq.block_m, cq.block_n) != (ckv.block_m, ckv.block_n):
        cls = tile_classes(q_pos, k_pos, q_seg, k_seg, causal, cq.block_m, cq.block_n)
    plan = plan_from_classes(cls)
    n_m, n_n = triton.cdiv(Sq, cq.block_m), triton.cdiv(Sk, cq.block_n)
    _bwd_dq_kernel[(n_m, B * Hq)](
        q, k, v, dout, lse2, delta, dq, q_pos, k_pos, q_seg, k_seg, plan.order, plan.n_full, plan.n_part,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        Hq, G, Sq, Sk, n_m, n_n, scale * LOG2E, scale,
        HEAD_DIM=D, BLOCK_M=cq.block_m, BLOCK_N=cq.block_n, CAUSAL=causal,
        num_warps=cq.num_warps, num_stages=cq.num_stages, **flags)
    return dq, dk, dv
