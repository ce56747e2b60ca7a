"""The Triton kernels of masked flash attention, their tile plans, launch shapes and launchers
(docs/kernels.md, "How the kernel works" and "Launch shapes").

Layouts: q, out, dout (B, Sq, Hq, D); k, v (B, Sk, Hkv, D), any strides with a unit last stride;
positions and segment ids int32 (B, S); lse (B, Hq, Sq) float32. Any head dim 1..256: tiles are
HEAD_DIM_PAD = max(16, next power of two) wide, loads and stores masked past D.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from .attention_math import merge_stacked, tile_stats, transposed, visit_ranges
from .backends import Upstream
from .meta import AttentionMeta

# Triton's interpreter computes tl.dot on bf16 wrongly: under it every dot takes fp32 operands
# (docs/kernels.md, "Under the interpreter"). Read at import, when triton.jit reads it too.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
DECODE_MAX_Q = 16  # forward calls with at most this many queries take the decode kernel (no plan)
DECODE_MAX_ROWS = 64  # rows (queries x heads of a group) of one decode program
ROW = 9  # int32 fields per row tile in a plan (attention_math.ROW_FIELDS)
COL = 4  # int32 fields per entry (attention_math.COL_FIELDS)
VARIANTS = ("fused", "split")


def head_dim_pad(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


# ----------------------------------------------------------------------------- kernels
# Every dot is tl.dot(a.to(DOT), b.to(DOT), input_precision=PREC): DOT is the input dtype on a GPU
# and fp32 under the interpreter; PREC is "tf32x3" for fp32 inputs on a GPU ("Precision"), "ieee"
# under the interpreter, else "tf32" (which 16-bit dots ignore).


@triton.jit
def _online_softmax_step(s, v, acc, l_i, m_i, DOT: tl.constexpr, PREC: tl.constexpr):
    """Fold one key tile into the running (acc, l, m): scores s in log2 units, -inf where hidden."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row with nothing visible yet keeps m = -inf: shift by 0 there so exp2 never sees inf - inf
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(DOT), v.to(DOT), input_precision=PREC)
    return acc, l_i, m_new


@triton.jit
def _fwd_tiles(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    q_seg,
    K_base,
    V_base,
    KPOS_b,
    KSEG_b,
    COLS,
    t_start,
    t_end,
    Sk,
    stride_ks,
    stride_vs,
    qk_scale,
    offs_n0,
    offs_d,
    d_ok,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT: tl.constexpr,
    PREC: tl.constexpr,
):
    """Online softmax over the plan entries [t_start, t_end): all full, or all candidates. The
    next entry's key tile index is loaded one iteration ahead."""
    nb_next = tl.load(COLS + t_start * 4, mask=t_start < t_end, other=0)
    for t in range(t_start, t_end):
        nb = nb_next
        nb_next = tl.load(COLS + (t + 1) * 4, mask=t + 1 < t_end, other=0)
        offs_n = nb * BLOCK_N + offs_n0
        kt_ptrs = (
            K_base
            + nb.to(tl.int64) * BLOCK_N * stride_ks
            + offs_n0[None, :] * stride_ks
            + offs_d[:, None]
        )
        v_ptrs = (
            V_base
            + nb.to(tl.int64) * BLOCK_N * stride_vs
            + offs_n0[:, None] * stride_vs
            + offs_d[None, :]
        )
        if (
            MASKED
        ):  # the last tile may run past Sk: read zeros there, never garbage that could be nan
            n_ok = offs_n < Sk
            kt = tl.load(kt_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # (D, BLOCK_N)
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_N, D)
        elif EVEN_D:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
        else:
            kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        s = tl.dot(q, kt.to(DOT), input_precision=PREC) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASKED:
            k_seg = tl.load(KSEG_b + offs_n, mask=offs_n < Sk, other=-1)
            vis = (q_seg[:, None] == k_seg[None, :]) & (k_seg[None, :] >= 0)
            if CAUSAL:
                k_pos = tl.load(KPOS_b + offs_n, mask=offs_n < Sk, other=0)
                vis = vis & (k_pos[None, :] <= q_pos[:, None])
            s = tl.where(vis, s, float("-inf"))
        acc, l_i, m_i = _online_softmax_step(s, v, acc, l_i, m_i, DOT, PREC)
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    QPOS,
    KPOS,
    QSEG,
    KSEG,
    PLAN,
    stride_plan,
    cols_off,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_os,
    stride_oh,
    Hq,
    GROUP,
    Sq,
    Sk,
    N_M_TILES,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT: tl.constexpr,
    PREC: tl.constexpr,
):
    """One query tile of one (batch, query head): out and lse."""
    pid_m = (
        N_M_TILES - 1 - tl.program_id(0)
    )  # under a causal mask late tiles have most work: start them first
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP  # GQA: the kv head this query head reads; K/V are never copied
    b64 = b.to(tl.int64)
    start_m = pid_m.to(tl.int64) * BLOCK_M  # int64 tile origins: B*S*H*D may pass 2**31

    offs_m0 = tl.arange(0, BLOCK_M)
    offs_m = pid_m * BLOCK_M + offs_m0
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < Sq

    Q_base = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + start_m * stride_qs
    q = tl.load(
        Q_base + offs_m0[:, None] * stride_qs + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q = q.to(DOT)  # (BLOCK_M, D)
    q_pos = tl.load(QPOS + b64 * Sq + offs_m, mask=row_ok, other=0)
    q_seg = tl.load(QSEG + b64 * Sq + offs_m, mask=row_ok, other=-1)

    ROWP = PLAN + b64 * stride_plan + pid_m * 9
    COLS = PLAN + b64 * stride_plan + cols_off
    K_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    V_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    KPOS_b = KPOS + b64 * Sk
    KSEG_b = KSEG + b64 * Sk

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for j in tl.static_range(
        3
    ):  # unrolled: the plan's full entries, then its two kinds of candidates
        acc, l_i, m_i = _fwd_tiles(
            acc,
            l_i,
            m_i,
            q,
            q_pos,
            q_seg,
            K_base,
            V_base,
            KPOS_b,
            KSEG_b,
            COLS,
            tl.load(ROWP + 2 * j),
            tl.load(ROWP + 2 * j + 1),
            Sk,
            stride_ks,
            stride_vs,
            qk_scale,
            offs_n0,
            offs_d,
            d_ok,
            BLOCK_N,
            CAUSAL,
            j > 0,
            EVEN_D,
            DOT,
            PREC,
        )

    has = l_i > 0.0  # rows with no visible key: out = 0, lse = -inf
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(
        has, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf")
    )  # back to base e

    O_base = O + b64 * stride_ob + h.to(tl.int64) * stride_oh + start_m * stride_os
    tl.store(
        O_base + offs_m0[:, None] * stride_os + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(LSE + pid_bh.to(tl.int64) * Sq + offs_m, lse, mask=row_ok)


@triton.jit
def _decode_kernel(
    Q,
    K,
    V,
    OP,
    LP,
    QPOS,
    KPOS,
    QSEG,
    KSEG,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    B,
    Hq,
    Hkv,
    GROUP,
    HEADS_PER_PROG,
    N_CHUNKS,
    Sq,
    Sk,
    TILES_PER_SPLIT,
    N_N_TILES,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT: tl.constexpr,
    PREC: tl.constexpr,
):
    """Few queries: one key range (split) of one (batch, kv head, chunk of its query heads).
    Rows are (head, query) pairs; writes fp32 partial out and lse of the split."""
    split = tl.program_id(0)
    pid = tl.program_id(1)
    c = pid % N_CHUNKS
    hk = (pid // N_CHUNKS) % Hkv
    b = pid // (N_CHUNKS * Hkv)
    b64 = b.to(tl.int64)

    offs_r = tl.arange(0, BLOCK_M)
    g = c * HEADS_PER_PROG + offs_r // Sq
    i = offs_r % Sq
    row_ok = (offs_r < HEADS_PER_PROG * Sq) & (g < GROUP)
    h = (hk * GROUP + g).to(tl.int64)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM

    q = tl.load(
        Q
        + b64 * stride_qb
        + h[:, None] * stride_qh
        + i[:, None].to(tl.int64) * stride_qs
        + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(DOT)
    q_pos = tl.load(QPOS + b64 * Sq + i, mask=row_ok, other=0)
    q_seg = tl.load(QSEG + b64 * Sq + i, mask=row_ok, other=-1)
    K_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    V_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    t_start = split * TILES_PER_SPLIT
    t_end = tl.minimum(t_start + TILES_PER_SPLIT, N_N_TILES)
    for nb in range(t_start, t_end):
        offs_n = nb * BLOCK_N + offs_n0
        n_ok = offs_n < Sk
        kt = tl.load(
            K_base + offs_n[None, :].to(tl.int64) * stride_ks + offs_d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            V_base + offs_n[:, None].to(tl.int64) * stride_vs + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        s = tl.dot(q, kt.to(DOT), input_precision=PREC) * qk_scale
        k_seg = tl.load(KSEG + b64 * Sk + offs_n, mask=n_ok, other=-1)
        vis = (q_seg[:, None] == k_seg[None, :]) & (k_seg[None, :] >= 0)
        if CAUSAL:
            k_pos = tl.load(KPOS + b64 * Sk + offs_n, mask=n_ok, other=0)
            vis = vis & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(vis, s, float("-inf"))
        acc, l_i, m_i = _online_softmax_step(s, v, acc, l_i, m_i, DOT, PREC)

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    row = ((split.to(tl.int64) * B + b64) * Hq + h) * Sq + i  # partials (n_split, B, Hq, Sq, [D])
    tl.store(
        OP + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None] & d_ok[None, :]
    )
    tl.store(LP + row, lse, mask=row_ok)


@triton.jit
def _bwd_preprocess(
    O,
    DO,
    LSE,
    DELTA,
    LSE2,
    stride_ob,
    stride_os,
    stride_oh,
    stride_dob,
    stride_dos,
    stride_doh,
    Hq,
    Sq,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """delta = rowsum(dO * O) in fp32, and lse in log2 units with -inf -> +inf (P = 0 on empty rows)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row_ok = offs_m < Sq
    ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(
        O
        + b * stride_ob
        + h * stride_oh
        + offs_m[:, None].to(tl.int64) * stride_os
        + offs_d[None, :],
        mask=ok,
        other=0.0,
    ).to(tl.float32)
    do = tl.load(
        DO
        + b * stride_dob
        + h * stride_doh
        + offs_m[:, None].to(tl.int64) * stride_dos
        + offs_d[None, :],
        mask=ok,
        other=0.0,
    ).to(tl.float32)
    row = pid_bh.to(tl.int64) * Sq + offs_m
    tl.store(DELTA + row, tl.sum(o * do, 1), mask=row_ok)
    lse = tl.load(LSE + row, mask=row_ok, other=0.0)
    tl.store(
        LSE2 + row,
        tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634),
        mask=row_ok,
    )


@triton.jit
def _bwd_tiles(
    dk,
    dv,
    k,
    v,
    k_pos,
    k_seg,
    Q_base,
    DO_base,
    DQ_base,
    LSE2_row,
    DELTA_row,
    QPOS_b,
    QSEG_b,
    COLS,
    t_start,
    t_end,
    Sq,
    stride_qs,
    stride_dos,
    stride_dqs,
    qk_scale,
    sm_scale,
    offs_m0,
    offs_d,
    d_ok,
    BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    FUSED_DQ: tl.constexpr,
    KV_SMEM: tl.constexpr,
    DOT: tl.constexpr,
    PREC: tl.constexpr,
):
    """dK, dV of one key tile (and with FUSED_DQ the dQ share of each query tile) from the plan entries
    [t_start, t_end) of the transposed plan. KV_SMEM: scores (BLOCK_M, BLOCK_N), K and V only ever the
    column operand of their dots (docs/kernels.md, "Backward"); else scores transposed."""
    mb_next = tl.load(COLS + t_start * 4, mask=t_start < t_end, other=0)
    for t in range(t_start, t_end):
        mb = mb_next
        mb_next = tl.load(COLS + (t + 1) * 4, mask=t + 1 < t_end, other=0)
        offs_m = mb * BLOCK_M + offs_m0
        start = mb.to(tl.int64) * BLOCK_M
        q_ptrs = Q_base + start * stride_qs + offs_m0[:, None] * stride_qs + offs_d[None, :]
        do_ptrs = DO_base + start * stride_dos + offs_m0[:, None] * stride_dos + offs_d[None, :]
        row_ok = offs_m < Sq
        if MASKED:
            ok = row_ok[:, None] & d_ok[None, :]
            q = tl.load(q_ptrs, mask=ok, other=0.0)  # (BLOCK_M, D)
            do = tl.load(do_ptrs, mask=ok, other=0.0)
            lse2 = tl.load(LSE2_row + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA_row + offs_m, mask=row_ok, other=0.0)
        else:
            if EVEN_D:
                q = tl.load(q_ptrs)
                do = tl.load(do_ptrs)
            else:
                q = tl.load(q_ptrs, mask=d_ok[None, :], other=0.0)
                do = tl.load(do_ptrs, mask=d_ok[None, :], other=0.0)
            lse2 = tl.load(LSE2_row + offs_m)
            delta = tl.load(DELTA_row + offs_m)
        if KV_SMEM:
            s = (
                tl.dot(q.to(DOT), tl.trans(k), input_precision=PREC) * qk_scale
            )  # (BLOCK_M, BLOCK_N)
            p = tl.math.exp2(s - lse2[:, None])
            if MASKED:
                q_seg = tl.load(QSEG_b + offs_m, mask=row_ok, other=-1)
                vis = (q_seg[:, None] == k_seg[None, :]) & (k_seg[None, :] >= 0)
                if CAUSAL:
                    q_pos = tl.load(QPOS_b + offs_m, mask=row_ok, other=0)
                    vis = vis & (k_pos[None, :] <= q_pos[:, None])
                p = tl.where(vis, p, 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)).to(DOT), do.to(DOT), input_precision=PREC)
            dp = tl.dot(do.to(DOT), tl.trans(v), input_precision=PREC)
            ds = (p * (dp - delta[:, None])).to(q.dtype).to(DOT)  # (BLOCK_M, BLOCK_N)
            dk += tl.dot(tl.trans(ds), q.to(DOT), input_precision=PREC)
            if FUSED_DQ:
                dq = tl.dot(ds, k, input_precision=PREC) * sm_scale  # (BLOCK_M, D)
        else:
            st = (
                tl.dot(k, tl.trans(q.to(DOT)), input_precision=PREC) * qk_scale
            )  # (BLOCK_N, BLOCK_M)
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
            dst = (pt * (dpt - delta[None, :])).to(q.dtype).to(DOT)
            dk += tl.dot(dst, q.to(DOT), input_precision=PREC)
            if FUSED_DQ:
                dq = tl.dot(tl.trans(dst), k, input_precision=PREC) * sm_scale  # (BLOCK_M, D)
        if FUSED_DQ:
            dq_ptrs = DQ_base + start * stride_dqs + offs_m0[:, None] * stride_dqs + offs_d[None, :]
            if MASKED:
                tl.atomic_add(dq_ptrs, dq, mask=row_ok[:, None] & d_ok[None, :], sem="relaxed")
            elif EVEN_D:
                tl.atomic_add(dq_ptrs, dq, sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dq, mask=d_ok[None, :], sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_kernel(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DQ,
    DK,
    DV,
    QPOS,
    KPOS,
    QSEG,
    KSEG,
    PLAN,
    stride_plan,
    cols_off,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    stride_dkb,
    stride_dks,
    stride_dkh,
    Hq,
    Hkv,
    GROUP,
    Sq,
    Sk,
    qk_scale,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PER_HEAD: tl.constexpr,
    ATOMIC_KV: tl.constexpr,
    FUSED_DQ: tl.constexpr,
    KV_SMEM: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT: tl.constexpr,
    PREC: tl.constexpr,
):
    """One key tile of one (batch, query head) [PER_HEAD] or (batch, kv head) [the group in a loop]."""
    pid_n = tl.program_id(0)  # under a causal mask early key tiles have most work: they start first
    pid_bh = tl.program_id(1)
    if PER_HEAD:
        b = pid_bh // Hq
        h0 = pid_bh % Hq
        hk = h0 // GROUP
        n_heads = 1
    else:
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        h0 = hk * GROUP
        n_heads = GROUP
    b64 = b.to(tl.int64)
    start_n = pid_n.to(tl.int64) * BLOCK_N

    offs_n0 = tl.arange(0, BLOCK_N)
    offs_n = pid_n * BLOCK_N + offs_n0
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    col_ok = offs_n < Sk
    kv_ok = col_ok[:, None] & d_ok[None, :]

    k = tl.load(
        K
        + b64 * stride_kb
        + hk.to(tl.int64) * stride_kh
        + start_n * stride_ks
        + offs_n0[:, None] * stride_ks
        + offs_d[None, :],
        mask=kv_ok,
        other=0.0,
    ).to(DOT)
    v = tl.load(
        V
        + b64 * stride_vb
        + hk.to(tl.int64) * stride_vh
        + start_n * stride_vs
        + offs_n0[:, None] * stride_vs
        + offs_d[None, :],
        mask=kv_ok,
        other=0.0,
    ).to(DOT)
    k_pos = tl.load(KPOS + b64 * Sk + offs_n, mask=col_ok, other=0)
    k_seg = tl.load(KSEG + b64 * Sk + offs_n, mask=col_ok, other=-1)

    ROWP = PLAN + b64 * stride_plan + pid_n * 9
    COLS = PLAN + b64 * stride_plan + cols_off
    f_lo = tl.load(ROWP)
    f_hi = tl.load(ROWP + 1)
    p_lo = tl.load(ROWP + 2)
    p_hi = tl.load(ROWP + 3)
    x_lo = tl.load(ROWP + 4)
    x_hi = tl.load(ROWP + 5)
    QPOS_b = QPOS + b64 * Sq
    QSEG_b = QSEG + b64 * Sq

    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)
    for g in range(0, n_heads):
        h = (h0 + g).to(tl.int64)
        Q_base = Q + b64 * stride_qb + h * stride_qh
        DO_base = DO + b64 * stride_dob + h * stride_doh
        DQ_base = DQ + b64 * stride_dqb + h * stride_dqh
        row = (b64 * Hq + h) * Sq
        dk, dv = _bwd_tiles(
            dk,
            dv,
            k,
            v,
            k_pos,
            k_seg,
            Q_base,
            DO_base,
            DQ_base,
            LSE2 + row,
            DELTA + row,
            QPOS_b,
            QSEG_b,
            COLS,
            f_lo,
            f_hi,
            Sq,
            stride_qs,
            stride_dos,
            stride_dqs,
            qk_scale,
            sm_scale,
            offs_m0,
            offs_d,
            d_ok,
            BLOCK_M,
            CAUSAL,
            False,
            EVEN_D,
            FUSED_DQ,
            KV_SMEM,
            DOT,
            PREC,
        )
        dk, dv = _bwd_tiles(
            dk,
            dv,
            k,
            v,
            k_pos,
            k_seg,
            Q_base,
            DO_base,
            DQ_base,
            LSE2 + row,
            DELTA + row,
            QPOS_b,
            QSEG_b,
            COLS,
            p_lo,
            p_hi,
            Sq,
            stride_qs,
            stride_dos,
            stride_dqs,
            qk_scale,
            sm_scale,
            offs_m0,
            offs_d,
            d_ok,
            BLOCK_M,
            CAUSAL,
            True,
            EVEN_D,
            FUSED_DQ,
            KV_SMEM,
            DOT,
            PREC,
        )
        dk, dv = _bwd_tiles(
            dk,
            dv,
            k,
            v,
            k_pos,
            k_seg,
            Q_base,
            DO_base,
            DQ_base,
            LSE2 + row,
            DELTA + row,
            QPOS_b,
            QSEG_b,
            COLS,
            x_lo,
            x_hi,
            Sq,
            stride_qs,
            stride_dos,
            stride_dqs,
            qk_scale,
            sm_scale,
            offs_m0,
            offs_d,
            d_ok,
            BLOCK_M,
            CAUSAL,
            True,
            EVEN_D,
            FUSED_DQ,
            KV_SMEM,
            DOT,
            PREC,
        )

    ptrs = (
        b64 * stride_dkb
        + hk.to(tl.int64) * stride_dkh
        + start_n * stride_dks
        + offs_n0[:, None] * stride_dks
        + offs_d[None, :]
    )
    if ATOMIC_KV:  # several programs (the query heads of one GQA group) add into one dK/dV tile
        tl.atomic_add(DK + ptrs, dk * sm_scale, mask=kv_ok, sem="relaxed")
        tl.atomic_add(DV + ptrs, dv, mask=kv_ok, sem="relaxed")
    else:
        tl.store(DK + ptrs, dk * sm_scale, mask=kv_ok)
        tl.store(DV + ptrs, dv, mask=kv_ok)


@triton.jit
def _dq_tiles(
    dq,
    q,
    do,
    lse2,
    delta,
    q_pos,
    q_seg,
    K_base,
    V_base,
    KPOS_b,
    KSEG_b,
    COLS,
    t_start,
    t_end,
    Sk,
    stride_ks,
    stride_vs,
    qk_scale,
    offs_n0,
    offs_d,
    d_ok,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT: tl.constexpr,
    PREC: tl.constexpr,
):
    """dQ of one query tile from the plan entries [t_start, t_end), the next index loaded ahead."""
    nb_next = tl.load(COLS + t_start * 4, mask=t_start < t_end, other=0)
    for t in range(t_start, t_end):
        nb = nb_next
        nb_next = tl.load(COLS + (t + 1) * 4, mask=t + 1 < t_end, other=0)
        offs_n = nb * BLOCK_N + offs_n0
        k_ptrs = (
            K_base
            + nb.to(tl.int64) * BLOCK_N * stride_ks
            + offs_n0[:, None] * stride_ks
            + offs_d[None, :]
        )
        v_ptrs = (
            V_base
            + nb.to(tl.int64) * BLOCK_N * stride_vs
            + offs_n0[:, None] * stride_vs
            + offs_d[None, :]
        )
        if MASKED:
            ok = (offs_n < Sk)[:, None] & d_ok[None, :]
            k = tl.load(k_ptrs, mask=ok, other=0.0)  # (BLOCK_N, D)
            v = tl.load(v_ptrs, mask=ok, other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
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
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DQ,
    QPOS,
    KPOS,
    QSEG,
    KSEG,
    PLAN,
    stride_plan,
    cols_off,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    Hq,
    GROUP,
    Sq,
    Sk,
    N_M_TILES,
    qk_scale,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT: tl.constexpr,
    PREC: tl.constexpr,
):
    """One query tile of one (batch, query head): dQ (the split variant's second pass)."""
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
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < Sq
    ok = row_ok[:, None] & d_ok[None, :]

    q = tl.load(
        Q
        + b64 * stride_qb
        + h.to(tl.int64) * stride_qh
        + start_m * stride_qs
        + offs_m0[:, None] * stride_qs
        + offs_d[None, :],
        mask=ok,
        other=0.0,
    ).to(DOT)
    do = tl.load(
        DO
        + b64 * stride_dob
        + h.to(tl.int64) * stride_doh
        + start_m * stride_dos
        + offs_m0[:, None] * stride_dos
        + offs_d[None, :],
        mask=ok,
        other=0.0,
    ).to(DOT)
    row = pid_bh.to(tl.int64) * Sq + offs_m
    lse2 = tl.load(LSE2 + row, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    q_pos = tl.load(QPOS + b64 * Sq + offs_m, mask=row_ok, other=0)
    q_seg = tl.load(QSEG + b64 * Sq + offs_m, mask=row_ok, other=-1)

    ROWP = PLAN + b64 * stride_plan + pid_m * 9
    COLS = PLAN + b64 * stride_plan + cols_off
    K_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    V_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    KPOS_b = KPOS + b64 * Sk
    KSEG_b = KSEG + b64 * Sk

    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for j in tl.static_range(3):  # as in the forward
        dq = _dq_tiles(
            dq,
            q,
            do,
            lse2,
            delta,
            q_pos,
            q_seg,
            K_base,
            V_base,
            KPOS_b,
            KSEG_b,
            COLS,
            tl.load(ROWP + 2 * j),
            tl.load(ROWP + 2 * j + 1),
            Sk,
            stride_ks,
            stride_vs,
            qk_scale,
            offs_n0,
            offs_d,
            d_ok,
            BLOCK_N,
            CAUSAL,
            j > 0,
            EVEN_D,
            DOT,
            PREC,
        )
    tl.store(
        DQ
        + b64 * stride_dqb
        + h.to(tl.int64) * stride_dqh
        + start_m * stride_dqs
        + offs_m0[:, None] * stride_dqs
        + offs_d[None, :],
        dq * sm_scale,
        mask=ok,
    )


# ----------------------------------------------------------------------------- tile plans (torch)


def build_plan(meta: AttentionMeta, block_m: int, block_n: int, transpose: bool = False) -> Tensor:
    """The plan of a (query tiles of block_m) x (key tiles of block_n) grid as one int32 tensor
    (B, n_rows * 9 + 2 * n_cols * 4): per query tile the key tiles to visit, or with `transpose`
    per key tile the query tiles. No host sync; O((n_q + n_k) log) time and O(n_q + n_k) memory."""
    queries, keys = meta.queries, meta.keys
    qs = tile_stats(queries.positions, queries.segment_ids, block_m)
    ks = tile_stats(keys.positions, keys.segment_ids, block_n)
    if transpose:
        ranges, order = visit_ranges(transposed(ks), transposed(qs), meta.causal)
    else:
        ranges, order = visit_ranges(qs, ks, meta.causal)
    B = ranges.shape[0]
    return torch.cat([ranges.reshape(B, -1), order.reshape(B, -1)], 1).to(torch.int32).contiguous()


def _plan_geometry(plan: Tensor, B: int, n_rows: int, n_cols: int, what: str) -> int:
    """Checks a plan's shape (host metadata only) and returns the offset of its entries."""
    want = (B, n_rows * ROW + 2 * n_cols * COL)
    if tuple(plan.shape) != want or plan.dtype != torch.int32 or plan.stride(-1) != 1:
        raise ValueError(
            f"{what} plan must be an int32 tensor of shape {want} (built for these tile shapes), "
            f"got {plan.dtype} {tuple(plan.shape)}"
        )
    return n_rows * ROW


# ----------------------------------------------------------------------------- launch shapes


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class TileConfig:
    """Tile shapes of every kernel for one (padded head dim, dtype kind). bwd: (query tile, key
    tile) of `_bwd_kernel`; dq: the split variant's dQ kernel; decode: block_n is its key tile.
    variant, per_head, kv_smem: the backward's options (docs/kernels.md, "Backward")."""

    fwd: LaunchConfig
    bwd: LaunchConfig
    dq: LaunchConfig
    decode: LaunchConfig
    variant: str = "fused"
    per_head: bool = True
    kv_smem: bool = False


_lc = LaunchConfig
# Hopper shapes from sm_90a ptxas reports, not GPU timings (docs/kernels.md, "Launch shapes"):
# every 16-bit build fits shared memory and spills nothing; fp32's backward spills at any shape.
DEFAULT_TABLE: dict[tuple[int, str], TileConfig] = {
    (16, "16bit"): TileConfig(
        _lc(128, 64, 8, 3), _lc(64, 128, 8, 2), _lc(128, 64, 8, 3), _lc(16, 64, 4, 3)
    ),
    (32, "16bit"): TileConfig(
        _lc(128, 64, 8, 3), _lc(64, 128, 8, 2), _lc(128, 64, 8, 3), _lc(16, 64, 4, 3)
    ),
    (64, "16bit"): TileConfig(
        _lc(64, 64, 4, 3),
        _lc(32, 128, 8, 3),
        _lc(128, 64, 8, 3),
        _lc(16, 64, 4, 3),
        variant="split",
    ),
    (128, "16bit"): TileConfig(
        _lc(128, 128, 8, 2),
        _lc(16, 128, 8, 3),
        _lc(128, 64, 8, 3),
        _lc(16, 64, 4, 3),
        variant="split",
    ),
    (256, "16bit"): TileConfig(
        _lc(64, 64, 8, 2), _lc(32, 32, 8, 2), _lc(32, 64, 8, 2), _lc(16, 32, 4, 2)
    ),
    (16, "fp32"): TileConfig(
        _lc(32, 32, 8, 2), _lc(16, 16, 4, 2), _lc(32, 32, 8, 2), _lc(16, 32, 4, 2)
    ),
    (32, "fp32"): TileConfig(
        _lc(32, 32, 8, 2), _lc(16, 16, 4, 2), _lc(32, 32, 8, 2), _lc(16, 32, 4, 2)
    ),
    (64, "fp32"): TileConfig(
        _lc(32, 32, 8, 2), _lc(16, 16, 4, 2), _lc(32, 32, 8, 2), _lc(16, 32, 4, 2)
    ),
    (128, "fp32"): TileConfig(
        _lc(32, 32, 8, 2), _lc(16, 16, 4, 2), _lc(32, 32, 8, 2), _lc(16, 32, 4, 2)
    ),
    (256, "fp32"): TileConfig(
        _lc(16, 32, 4, 1), _lc(16, 16, 4, 1), _lc(16, 32, 4, 1), _lc(16, 32, 4, 1)
    ),
}
# Rows that are GPU timings (a `--tune` result), allowed to spill: the ptxas check tests only their smem.
GPU_TIMED: frozenset[tuple[int, str]] = frozenset()
_INTERPRET_CONFIG = TileConfig(
    _lc(16, 16, 4, 1), _lc(16, 16, 4, 1), _lc(16, 16, 4, 1), _lc(16, 16, 4, 1)
)
_table: dict[tuple[int, str], TileConfig] = dict(DEFAULT_TABLE)
_override: dict = {}


def table_to_json(table: dict[tuple[int, str], TileConfig]) -> list[dict]:
    return [dict(head_dim_pad=d, kind=k, **asdict(c)) for (d, k), c in sorted(table.items())]


def table_from_json(rows: list[dict]) -> dict[tuple[int, str], TileConfig]:
    out = {}
    for r in rows:
        cfg = {k: LaunchConfig(**r[k]) for k in ("fwd", "bwd", "dq", "decode")}
        out[(int(r["head_dim_pad"]), r["kind"])] = TileConfig(
            **cfg,
            variant=r.get("variant", "fused"),
            per_head=bool(r.get("per_head", True)),
            kv_smem=bool(r.get("kv_smem", False)),
        )
    return out


def set_tile_table(table: dict[tuple[int, str], TileConfig] | None = None) -> None:
    """Replace the launch-shape table entries given (None: back to DEFAULT_TABLE)."""
    _table.clear()
    _table.update(DEFAULT_TABLE)
    if table:
        _table.update(table)


def set_backward(
    variant: str | None = None, per_head: bool | None = None, kv_smem: bool | None = None
) -> None:
    """Force a backward variant ("fused" / "split"), GQA program layout and K/V operand placement
    for every shape (None: each table entry's own). "split" implies per_head=False unless given, so
    every gradient is deterministic. `LONGVIDEO_FLASH_BWD=split` at import does the same."""
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"backward variant must be one of {VARIANTS}, got {variant!r}")
    if variant == "split" and per_head is None:
        per_head = False
    _override.clear()
    _override.update(
        {
            k: v
            for k, v in dict(variant=variant, per_head=per_head, kv_smem=kv_smem).items()
            if v is not None
        }
    )


if os.environ.get("LONGVIDEO_FLASH_TABLE"):  # a table written by `scripts/gpu_check.py --tune`
    with open(os.environ["LONGVIDEO_FLASH_TABLE"]) as _f:
        set_tile_table(table_from_json(json.load(_f)["table"]))
if os.environ.get("LONGVIDEO_FLASH_BWD"):
    set_backward(os.environ["LONGVIDEO_FLASH_BWD"])


def tile_config(head_dim: int, dtype: torch.dtype) -> TileConfig:
    """The launch shapes for this head dim and dtype (16-wide tiles under the interpreter)."""
    kind = "fp32" if dtype == torch.float32 else "16bit"
    cfg = _INTERPRET_CONFIG if INTERPRET else _table[(head_dim_pad(head_dim), kind)]
    return replace(cfg, **_override) if _override else cfg


def _int32(meta: AttentionMeta) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q_pos, k_pos, q_seg, k_seg) as the kernels read them: int32, contiguous."""
    return tuple(x.to(torch.int32).contiguous() for x in meta.tensors())


def _unit_last(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _flags(dtype: torch.dtype) -> dict:
    """Dot operand dtype and precision (see the note above the kernels)."""
    if INTERPRET:
        return dict(DOT=tl.float32, PREC="ieee")
    return dict(DOT=_TL_DTYPES[dtype], PREC="tf32x3" if dtype == torch.float32 else "tf32")


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def uses_decode(Sq: int) -> bool:
    """Whether a forward of Sq queries takes the decode kernel (and needs no plan)."""
    return 0 < Sq <= DECODE_MAX_Q


def _plan_key(launch: LaunchConfig, transpose: bool, causal: bool) -> tuple:
    return ("triton-bwd" if transpose else "triton-fwd", launch.block_m, launch.block_n, causal)


def kept_plan(meta: AttentionMeta, launch: LaunchConfig, transpose: bool) -> Tensor:
    """The tile plan of launch shape `launch` from the metadata's plan store, built there on first
    use: per query tile (a forward or dQ kernel), or with `transpose` per key tile (dK/dV)."""
    return meta.plans.get(
        _plan_key(launch, transpose, meta.causal),
        lambda: build_plan(meta, launch.block_m, launch.block_n, transpose),
    )


def keep_plan(meta: AttentionMeta, launch: LaunchConfig, transpose: bool, plan: Tensor) -> None:
    """Store a plan built elsewhere (a custom op's argument) where `kept_plan` finds it."""
    meta.plans.get(_plan_key(launch, transpose, meta.causal), lambda: plan)


# ----------------------------------------------------------------------------- launchers


def flash_attn_forward(
    q: Tensor, k: Tensor, v: Tensor, meta: AttentionMeta
) -> tuple[Tensor, Tensor]:
    """out (B, Sq, Hq, D) in q.dtype, lse (B, Hq, Sq) float32. The tile plan of this shape's forward
    tiles comes from the metadata's store (`kept_plan`, built there when missing); the decode path
    uses none."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    out = torch.empty(B, Sq, Hq, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    if Sk == 0:  # nothing to attend to: every row is empty
        out.zero_()
        lse.fill_(float("-inf"))
    if Sq == 0 or Sk == 0 or B * Hq == 0:
        return out, lse
    cfg = tile_config(D, q.dtype)
    if uses_decode(Sq):
        return _decode(q, k, v, meta, cfg.decode)
    q_pos, k_pos, q_seg, k_seg = _int32(meta)
    scale, causal = meta.scale_for(D), meta.causal
    flags = _flags(q.dtype)
    pad = head_dim_pad(D)
    c = cfg.fwd
    n_m, n_n = triton.cdiv(Sq, c.block_m), triton.cdiv(Sk, c.block_n)
    plan = kept_plan(meta, c, False)
    cols_off = _plan_geometry(plan, B, n_m, n_n, "forward")
    _fwd_kernel[(n_m, B * Hq)](
        q,
        k,
        v,
        out,
        lse,
        q_pos,
        k_pos,
        q_seg,
        k_seg,
        plan,
        plan.stride(0),
        cols_off,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *out.stride()[:3],
        Hq,
        Hq // Hkv,
        Sq,
        Sk,
        n_m,
        scale * LOG2E,
        HEAD_DIM=D,
        HEAD_DIM_PAD=pad,
        EVEN_D=D == pad,
        BLOCK_M=c.block_m,
        BLOCK_N=c.block_n,
        CAUSAL=causal,
        num_warps=c.num_warps,
        num_stages=c.num_stages,
        **flags,
    )
    return out, lse


def _decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    meta: AttentionMeta,
    c: LaunchConfig,
    splits: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The decode kernel (split-K over `splits` programs per head group, merged); no plan."""
    q_pos, k_pos, q_seg, k_seg = _int32(meta)
    scale, causal, flags = meta.scale_for(q.shape[-1]), meta.causal, _flags(q.dtype)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    heads = max(1, min(G, DECODE_MAX_ROWS // Sq))  # query heads of a group per program
    chunks = triton.cdiv(G, heads)
    block_m = max(16, triton.next_power_of_2(heads * Sq))
    n_n = triton.cdiv(Sk, c.block_n)
    if splits is None:  # enough programs to fill the device, each with a run of key tiles
        splits = (
            max(1, triton.cdiv(2 * _num_sms(q.device), B * Hkv * chunks)) if not INTERPRET else 2
        )
    per = triton.cdiv(n_n, min(splits, n_n))
    splits = triton.cdiv(n_n, per)
    part_o = torch.empty(splits, B, Hq, Sq, D, dtype=torch.float32, device=q.device)
    part_l = torch.empty(splits, B, Hq, Sq, dtype=torch.float32, device=q.device)
    _decode_kernel[(splits, B * Hkv * chunks)](
        q,
        k,
        v,
        part_o,
        part_l,
        q_pos,
        k_pos,
        q_seg,
        k_seg,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        B,
        Hq,
        Hkv,
        G,
        heads,
        chunks,
        Sq,
        Sk,
        per,
        n_n,
        scale * LOG2E,
        HEAD_DIM=D,
        HEAD_DIM_PAD=head_dim_pad(D),
        BLOCK_M=block_m,
        BLOCK_N=c.block_n,
        CAUSAL=causal,
        num_warps=c.num_warps,
        num_stages=c.num_stages,
        **flags,
    )
    out, lse = (
        (part_o[0], part_l[0]) if splits == 1 else merge_stacked(part_o, part_l)
    )  # (B, Hq, Sq, [D])
    return out.transpose(1, 2).to(q.dtype).contiguous(), lse.contiguous()


def flash_attn_backward(
    upstream: Upstream, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMeta, variant: str = ""
) -> tuple[Tensor, Tensor, Tensor]:
    """dq (B, Sq, Hq, D), dk, dv (B, Sk, Hkv, D), all float32. upstream: dout and the forward's
    out/lse, which may be global ones. The plans (the transposed plan of the bwd tiles; the
    forward plan of the dq tiles, split variant only) come from the metadata's store (`kept_plan`,
    built there when missing). variant: "fused" / "split" / "" (the table's)."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    # delta = rowsum(dO * O) reads dout/out as given (a ring passes fp32 ones); the dots read dout
    # in the input dtype, like every other operand
    dout, out, lse = _unit_last(upstream.dout), _unit_last(upstream.out), upstream.lse
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    cfg = tile_config(D, q.dtype)
    variant = variant or cfg.variant
    if variant not in VARIANTS:
        raise ValueError(f"backward variant must be one of {VARIANTS}, got {variant!r}")
    per_head = (
        cfg.per_head and G > 1
    )  # then the programs of a GQA group add into dK/dV with atomics
    f32 = dict(dtype=torch.float32, device=q.device)
    dq = (torch.zeros if variant == "fused" else torch.empty)(B, Sq, Hq, D, **f32)
    dk, dv = ((torch.zeros if per_head else torch.empty)(B, Sk, Hkv, D, **f32) for _ in range(2))
    if Sq == 0 or Sk == 0 or B * Hq == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    q_pos, k_pos, q_seg, k_seg = _int32(meta)
    scale, causal = meta.scale_for(D), meta.causal
    lse = lse.to(torch.float32).contiguous()
    flags = _flags(q.dtype)
    pad = head_dim_pad(D)
    shape = dict(HEAD_DIM=D, HEAD_DIM_PAD=pad, EVEN_D=D == pad)

    delta = torch.empty(B, Hq, Sq, **f32)
    lse2 = torch.empty_like(delta)
    pre_m = 64 if not INTERPRET else 16
    _bwd_preprocess[(triton.cdiv(Sq, pre_m), B * Hq)](
        out,
        dout,
        lse,
        delta,
        lse2,
        *out.stride()[:3],
        *dout.stride()[:3],
        Hq,
        Sq,
        HEAD_DIM=D,
        HEAD_DIM_PAD=pad,
        BLOCK_M=pre_m,
    )

    dout = dout.to(q.dtype)
    c = cfg.bwd
    n_m, n_n = triton.cdiv(Sq, c.block_m), triton.cdiv(Sk, c.block_n)
    kv_plan = kept_plan(meta, c, True)
    cols_off = _plan_geometry(kv_plan, B, n_n, n_m, "backward (dK/dV)")
    _bwd_kernel[(n_n, B * (Hq if per_head else Hkv))](
        q,
        k,
        v,
        dout,
        lse2,
        delta,
        dq,
        dk,
        dv,
        q_pos,
        k_pos,
        q_seg,
        k_seg,
        kv_plan,
        kv_plan.stride(0),
        cols_off,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *dout.stride()[:3],
        *dq.stride()[:3],
        *dk.stride()[:3],
        Hq,
        Hkv,
        G,
        Sq,
        Sk,
        scale * LOG2E,
        scale,
        **shape,
        BLOCK_M=c.block_m,
        BLOCK_N=c.block_n,
        PER_HEAD=per_head,
        ATOMIC_KV=per_head,
        FUSED_DQ=variant == "fused",
        KV_SMEM=cfg.kv_smem,
        CAUSAL=causal,
        num_warps=c.num_warps,
        num_stages=c.num_stages,
        **flags,
    )

    if variant == "split":
        c = cfg.dq
        n_m, n_n = triton.cdiv(Sq, c.block_m), triton.cdiv(Sk, c.block_n)
        q_plan = kept_plan(meta, c, False)
        cols_off = _plan_geometry(q_plan, B, n_m, n_n, "backward (dQ)")
        _bwd_dq_kernel[(n_m, B * Hq)](
            q,
            k,
            v,
            dout,
            lse2,
            delta,
            dq,
            q_pos,
            k_pos,
            q_seg,
            k_seg,
            q_plan,
            q_plan.stride(0),
            cols_off,
            *q.stride()[:3],
            *k.stride()[:3],
            *v.stride()[:3],
            *dout.stride()[:3],
            *dq.stride()[:3],
            Hq,
            G,
            Sq,
            Sk,
            n_m,
            scale * LOG2E,
            scale,
            **shape,
            BLOCK_M=c.block_m,
            BLOCK_N=c.block_n,
            CAUSAL=causal,
            num_warps=c.num_warps,
            num_stages=c.num_stages,
            **flags,
        )
    return dq, dk, dv
