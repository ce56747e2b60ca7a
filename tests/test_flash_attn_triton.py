"""The Triton flash-attention kernel against the float64 reference.

Without a GPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py), so shapes are tiny
(16-wide tiles there, so even these shapes span several tiles and every tile class). Tolerance:
error <= 2 x (error of the same-dtype PyTorch computation) + eps, for out, lse, dq, dk and dv.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from attn_cases import assert_within, max_err, meta_of, packed_meta, reference
from longvideo.kernels.flash_attn import TritonBackend, flash_attn
from sync_guard import HostSync, no_host_sync

from longvideo.kernels import (
    AttentionMeta,
    Side,
    block_attention,
    classify_tiles,
    flash_attn_ref,
    get_backend,
    tile_stats,
    transposed,
    visibility,
    visit_ranges,
)
from longvideo.kernels import _flash_attn_triton as tk

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or tk.INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1"
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = {
    torch.float32: 2e-6,
    torch.float16: 1e-4,
    torch.bfloat16: 1e-3,
}  # about one ulp of O(1) values


# ---- inputs ----------------------------------------------------------------------------------


def _blocks(layout: str, L: int, Sq: int, Sk: int, g: torch.Generator):
    """Index sets (query block, key block) into a global sequence of length L, as a ring sees them."""
    if layout == "self":
        return torch.arange(L), torch.arange(L)
    if (
        layout == "zigzag"
    ):  # W = 2: rank r holds chunks r and 3 - r; queries of one rank, keys of another
        c = L // 4
        rank = [
            torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((3 - r) * c, (4 - r) * c)])
            for r in (0, 1)
        ]
        r_q, r_k = (int(x) for x in torch.randint(0, 2, (2,), generator=g))
        return rank[r_q], rank[r_k]
    a = int(torch.randint(0, L - Sq + 1, (1,), generator=g))  # contiguous blocks at random offsets
    c = int(torch.randint(0, L - Sk + 1, (1,), generator=g))
    return torch.arange(a, a + Sq), torch.arange(c, c + Sk)


def make_case(seed, B, Sq, Sk, Hq, Hkv, D, dtype, layout, *, restart=True, pad=3, max_len=24):
    """q, k, v, dout and (q_pos, k_pos, q_seg, k_seg): blocks of one packed global sequence whose
    documents have random lengths and whose tail is padding (segment -1)."""
    g = torch.Generator().manual_seed(seed)
    L = max(Sq, Sk) + 8 if layout == "contig" else Sq
    pos, seg = packed_meta(B, L, g, min_len=3, max_len=max_len, restart=restart, pad=pad)
    qi, ki = _blocks(layout, L, Sq, Sk, g)
    q = torch.randn(B, len(qi), Hq, D, generator=g).to(dtype)
    k = torch.randn(B, len(ki), Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, len(ki), Hkv, D, generator=g).to(dtype)
    dout = torch.randn(B, len(qi), Hq, D, generator=g).to(dtype)
    meta = (pos[:, qi], pos[:, ki], seg[:, qi], seg[:, ki])
    return [x.to(DEV) for x in (q, k, v, dout)], [m.to(DEV) for m in meta]


def check_against_reference(q, k, v, dout, meta, causal, what=""):
    """Run the kernel through the functional API (forward + autograd backward) and compare every
    output with the float64 truth, allowing 2 x the same-dtype PyTorch error + eps."""
    dtype = q.dtype
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
    with no_host_sync():
        out, lse = flash_attn(qg, kg, vg, meta_of(*meta, causal), return_lse=True)
        out.backward(dout)
    truth = reference(q, k, v, meta_of(*meta, causal), dout, upcast=True)
    plain = reference(q, k, v, meta_of(*meta, causal), dout, upcast=False)
    _, lse_truth = flash_attn_ref(q.double(), k.double(), v.double(), meta_of(*meta, causal))
    _, lse_plain = flash_attn_ref(q, k, v, meta_of(*meta, causal), upcast=False)
    eps = EPS[dtype]
    for name, got, t, p in zip(
        ("out", "dq", "dk", "dv"), (out, qg.grad, kg.grad, vg.grad), truth, plain
    ):
        assert got.dtype == dtype, f"{what}: {name} dtype {got.dtype}"
        assert_within(f"{what}: {name}", got, t, p, eps=eps * (1 + t.abs().max().item()))
    empty = torch.isinf(lse_truth)  # rows with no visible key
    assert lse.dtype == torch.float32 and lse.shape == lse_truth.shape
    assert torch.equal(torch.isneginf(lse), empty), (
        f"{what}: -inf lse rows differ from the reference"
    )
    assert_within(f"{what}: lse", lse[~empty], lse_truth[~empty], lse_plain[~empty], eps=eps * 10)
    # the same-dtype lse is loose (scores rounded to the dtype); the kernel's scores are fp32 dots of
    # the same rounded inputs the float64 truth starts from, so its lse is fp32-accurate in any dtype
    if (~empty).any():
        err = max_err(lse[~empty], lse_truth[~empty])
        assert err <= 1e-5 * (1 + lse_truth[~empty].abs().max().item()), (
            f"{what}: lse error {err:.3g}"
        )
    rows = empty.transpose(1, 2)  # (B, Sq, Hq)
    assert (out[rows] == 0).all() and (qg.grad[rows] == 0).all(), f"{what}: empty rows not zero"
    return empty


# ---- forward and backward against the reference ------------------------------------------------

CASES = [  # seed, B, Sq, Sk, Hq, Hkv, D, dtype, causal, layout
    (1, 1, 37, 37, 2, 1, 32, torch.float32, True, "self"),
    (2, 2, 29, 45, 4, 2, 32, torch.float16, True, "contig"),
    (3, 1, 32, 32, 3, 1, 64, torch.bfloat16, True, "zigzag"),
    (4, 2, 50, 19, 2, 2, 32, torch.float32, False, "contig"),
    (5, 1, 41, 41, 4, 1, 64, torch.float16, False, "self"),
    (6, 2, 64, 33, 2, 1, 32, torch.bfloat16, True, "contig"),
    (13, 1, 24, 24, 2, 2, 64, torch.float32, True, "zigzag"),
    (8, 1, 17, 53, 2, 1, 32, torch.bfloat16, False, "contig"),
]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: (
        f"s{c[0]}-{c[2]}x{c[3]}-h{c[4]}/{c[5]}-d{c[6]}-"
        f"{str(c[7]).split('.')[1]}-{'causal' if c[8] else 'full'}-{c[9]}"
    ),
)
def test_matches_reference(case):
    seed, B, Sq, Sk, Hq, Hkv, D, dtype, causal, layout = case
    (q, k, v, dout), meta = make_case(
        seed, B, Sq, Sk, Hq, Hkv, D, dtype, layout, restart=seed % 2 == 1
    )
    queries, keys = Side(meta[0], meta[2]), Side(meta[1], meta[3])
    assert visibility(queries, keys, causal).any(), (
        "the case must have visible pairs to test anything"
    )
    check_against_reference(q, k, v, dout, meta, causal, what=str(case))


def test_head_dim_128():
    (q, k, v, dout), meta = make_case(11, 1, 40, 40, 2, 1, 128, torch.bfloat16, "self", max_len=30)
    check_against_reference(q, k, v, dout, meta, True, what="D=128")


def test_fully_masked_rows_and_tiles():
    """Keys all in the future of every query, all-padding query rows, and a block with disjoint
    segments: out = 0, lse = -inf, zero gradients, no NaN."""
    g = torch.Generator().manual_seed(5)
    B, S, H, D = 1, 20, 2, 32
    q, k, v, dout = (torch.randn(B, S, H, D, generator=g).to(DEV) for _ in range(4))
    pos = torch.arange(S, device=DEV)[None]
    seg = torch.zeros(B, S, dtype=torch.long, device=DEV)
    cases = {
        "future keys": (pos, pos + S, seg, seg),
        "padding queries": (pos, pos, torch.full_like(seg, -1), seg),
        "padding keys": (pos, pos, seg, torch.full_like(seg, -1)),
        "disjoint segments": (pos, pos, seg, seg + 1),
    }
    for name, meta in cases.items():
        empty = check_against_reference(q, k, v, dout, meta, True, what=name)
        assert empty.all(), name
    # a block where only the second query tile sees anything: tile skipping inside one call
    meta = (pos + 18, pos, torch.where(pos < 16, -1, 0), seg)
    empty = check_against_reference(q, k, v, dout, meta, True, what="first query tile empty")
    assert empty[..., :16].all() and not empty[..., 16:].any()


def test_backward_with_global_out_and_lse():
    """Ring attention calls the backend backward per key block with the GLOBAL out and lse: the
    blocks' gradients must add up to the gradients of attention over all keys."""
    (q, k, v, dout), tensors = make_case(21, 2, 24, 24, 4, 2, 32, torch.float32, "self")
    meta = meta_of(*tensors, True, 1 / math.sqrt(q.shape[-1]))
    truth = reference(q, k, v, meta, dout, upcast=True)
    plain = reference(q, k, v, meta, dout, upcast=False)
    triton = get_backend("triton")
    assert isinstance(triton, TritonBackend) and triton.name == "triton"
    out, lse = triton.forward(q, k, v, meta)  # global: all keys in one call
    dq = torch.zeros(q.shape, dtype=torch.float32, device=DEV)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=DEV)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=DEV)
    for sl in (slice(0, 9), slice(9, 24)):  # two key blocks of uneven length
        block = meta.with_keys(meta.keys.span(sl.start, sl.stop))
        gq, gk, gv = triton.backward(dout, q, k[:, sl], v[:, sl], out, lse, block)
        assert gq.dtype == gk.dtype == gv.dtype == torch.float32
        dq += gq
        dk[:, sl] += gk
        dv[:, sl] += gv
    for name, got, t, p in zip(("dq", "dk", "dv"), (dq, dk, dv), truth[1:], plain[1:]):
        assert_within(
            f"global lse: {name}", got, t, p, eps=EPS[torch.float32] * (1 + t.abs().max().item())
        )


def test_block_attention_and_auto_backend():
    """The kernel serves kernels.block_attention as the `triton` backend, and `auto` sends it the
    blocks that need the element mask (on CUDA; tests/test_dispatch.py covers the other routes)."""
    assert get_backend("auto").name == "auto"
    if DEV == "cuda":  # shuffled positions: no dense piece, so the triton kernel, bit for bit
        (q, k, v, _), _ = make_case(32, 1, 40, 40, 2, 1, 32, torch.bfloat16, "self")
        pos = torch.randperm(40, device=DEV)[None]
        seg = torch.zeros_like(pos)
        torch.testing.assert_close(
            block_attention(q, k, v, AttentionMeta.self_attention(pos, seg), backend="auto"),
            flash_attn(q, k, v, AttentionMeta.self_attention(pos, seg)),
            rtol=0,
            atol=0,
        )
    (q, k, v, dout), meta = make_case(31, 1, 20, 20, 2, 1, 32, torch.float32, "self")
    qa, ka, va = (x.clone().requires_grad_(True) for x in (q, k, v))
    qb, kb, vb = (x.clone().requires_grad_(True) for x in (q, k, v))
    oa = block_attention(qa, ka, va, meta_of(*meta), backend="triton")
    ob = flash_attn(qb, kb, vb, meta_of(*meta))
    oa.backward(dout)
    ob.backward(dout)
    for a, b in ((oa, ob), (qa.grad, qb.grad), (ka.grad, kb.grad), (va.grad, vb.grad)):
        assert torch.equal(a, b)  # the same kernel behind both entry points


def test_strided_inputs_match_contiguous():
    """q, k, v as views of one packed (B, S, 3, H, D) tensor give the same bits as contiguous copies."""
    g = torch.Generator().manual_seed(41)
    qkv = torch.randn(1, 21, 3, 2, 32, generator=g).to(DEV)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    out_s, lse_s = flash_attn(q, k, v, return_lse=True)
    out_c, lse_c = flash_attn(q.contiguous(), k.contiguous(), v.contiguous(), return_lse=True)
    assert torch.equal(out_s, out_c) and torch.equal(lse_s, lse_c)


def test_raw_ops_schema_and_fake():
    """The custom ops' fake implementations agree with the real ones (torch.compile traces them)."""
    (q, k, v, dout), meta = make_case(51, 1, 16, 16, 2, 1, 16, torch.float32, "self")
    scale = 0.25
    meta = list(meta)  # the ops take AttentionMeta.tensors(): q_pos, k_pos, q_seg, k_seg
    out, lse = torch.ops.longvideo.flash_attn_fwd(q, k, v, meta, scale, True)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(
        torch.ops.longvideo.flash_attn_fwd.default, (q, k, v, meta, scale, True), test_utils=tests
    )
    torch.library.opcheck(
        torch.ops.longvideo.flash_attn_bwd.default,
        (dout, q, k, v, out, lse, meta, scale, True),
        test_utils=tests,
    )
    cfg = tk.tile_config(16, q.dtype)  # with plans passed in, and the split variant
    whole = meta_of(*meta)
    fwd = tk.build_plan(whole, cfg.fwd.block_m, cfg.fwd.block_n)
    kv = tk.build_plan(whole, cfg.bwd.block_m, cfg.bwd.block_n, transpose=True)
    dq = tk.build_plan(whole, cfg.dq.block_m, cfg.dq.block_n)
    torch.library.opcheck(
        torch.ops.longvideo.flash_attn_fwd.default,
        (q, k, v, meta, scale, True, fwd),
        test_utils=tests,
    )
    torch.library.opcheck(
        torch.ops.longvideo.flash_attn_bwd.default,
        (dout, q, k, v, out, lse, meta, scale, True, kv, dq, "split"),
        test_utils=tests,
    )
    one = q[:, :3]  # the decode path (few queries, no plan)
    torch.library.opcheck(
        torch.ops.longvideo.flash_attn_fwd.default,
        (one, k, v, [meta[0][:, :3], meta[1], meta[2][:, :3], meta[3]], scale, True),
        test_utils=tests,
    )


def test_rejects_bad_inputs():
    q = torch.randn(1, 8, 4, 32, device=DEV)
    k = torch.randn(1, 8, 2, 32, device=DEV)
    with pytest.raises(ValueError, match="head dims"):
        flash_attn(
            torch.randn(1, 8, 2, 264, device=DEV),
            torch.randn(1, 8, 2, 264, device=DEV),
            torch.randn(1, 8, 2, 264, device=DEV),
        )
    with pytest.raises(
        ValueError, match="plan must be an int32 tensor"
    ):  # a plan built for other tiles
        x = torch.randn(1, 20, 2, 32, device=DEV)  # more queries than the decode path takes
        torch.ops.longvideo.flash_attn_fwd(
            x,
            x,
            x,
            [torch.zeros(1, 20, dtype=torch.long, device=DEV)] * 4,
            0.1,
            True,
            torch.zeros(1, 5, dtype=torch.int32, device=DEV),
        )
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        flash_attn(q, torch.randn(1, 8, 3, 32, device=DEV), torch.randn(1, 8, 3, 32, device=DEV))
    with pytest.raises(ValueError, match="dtypes differ"):
        flash_attn(q, k.half(), k.half())
    with pytest.raises(ValueError, match="supports fp16, bf16 and fp32"):
        flash_attn(q.double(), k.double(), k.double())
    good = AttentionMeta.default(q, k)
    short = Side(torch.zeros(1, 7, dtype=torch.long, device=DEV), good.keys.segment_ids)
    with pytest.raises(ValueError, match="keys.positions must have shape"):
        flash_attn(q, k, k, good.with_keys(short))
    floats = Side(good.queries.positions, torch.zeros(1, 8, device=DEV))
    with pytest.raises(ValueError, match="queries.segment_ids must be an integer tensor"):
        flash_attn(q, k, k, AttentionMeta(floats, good.keys))


# ---- head dims, decode, backward variants, plans, host syncs ------------------------------------


@pytest.mark.parametrize(
    "D,dtype",
    [
        (48, torch.float16),
        (80, torch.bfloat16),
        (96, torch.float32),
        (256, torch.bfloat16),
        (8, torch.float32),
    ],
)
def test_any_head_dim(D, dtype):
    """Head dims that are not powers of two (padded tiles, masked loads and stores), and 256."""
    (q, k, v, dout), meta = make_case(90 + D, 1, 35, 35, 4, 2, D, dtype, "self", max_len=20)
    check_against_reference(q, k, v, dout, meta, True, what=f"D={D}")


@pytest.mark.parametrize(
    "Sq,heads,causal",
    [(1, (8, 2), True), (5, (4, 1), True), (16, (6, 3), False), (3, (32, 2), True)],
)
def test_decode_path(Sq, heads, causal):
    """Few queries take the plan-free split-K decode kernel (rows = a GQA group's heads x queries,
    several key splits merged); the backward of such a call still uses plans."""
    assert tk.uses_decode(Sq)
    (q, k, v, dout), (qp, kp, qs, ks) = make_case(
        100 + Sq, 2, 48, 70, heads[0], heads[1], 32, torch.bfloat16, "contig", max_len=30
    )
    meta = (qp[:, -Sq:] + 30, kp, qs[:, -Sq:], ks)  # the last queries of a prompt after its keys
    check_against_reference(q[:, -Sq:], k, v, dout[:, -Sq:], meta, causal, what=f"decode Sq={Sq}")
    cfg = tk.tile_config(32, q.dtype)
    qq = q[:, -Sq:].contiguous()
    one = tk._decode(qq, k, v, meta_of(*meta, causal, 0.2), cfg.decode, splits=1)
    many = tk._decode(qq, k, v, meta_of(*meta, causal, 0.2), cfg.decode, splits=4)
    torch.testing.assert_close(one[0].float(), many[0].float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(one[1], many[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "variant,per_head,kv_smem",
    [
        ("fused", True, False),
        ("fused", False, False),
        ("split", False, False),
        ("split", True, True),
        ("fused", True, True),
    ],
)
def test_backward_variants(variant, per_head, kv_smem):
    """Both backward structures (dQ by atomics in the dK/dV kernel, or a second pass), both GQA
    layouts (a program per query head adding dK/dV by atomics, or per kv head) and both places of
    the K/V operands (registers, or the shared-memory side of each dot) match the truth; the split
    variant without atomics is bitwise deterministic."""
    tk.set_backward(variant, per_head, kv_smem)
    try:
        (q, k, v, dout), meta = make_case(
            120, 2, 40, 40, 6, 2, 32, torch.bfloat16, "zigzag", max_len=25
        )
        check_against_reference(
            q, k, v, dout, meta, True, what=f"{variant} per_head={per_head} kv_smem={kv_smem}"
        )
        if variant == "split" and not per_head:
            grads = []
            for _ in range(2):
                qg = q.clone().requires_grad_(True)
                flash_attn(qg, k, v, meta_of(*meta)).backward(dout)
                grads.append(qg.grad)
            assert torch.equal(*grads)
    finally:
        tk.set_backward(None)


def test_split_backward_means_no_atomics():
    """Asking for the deterministic (split) backward also rules out the per-query-head GQA layout,
    whose dK/dV atomics made gradients differ between runs on an H200; an explicit per_head wins."""
    try:
        tk.set_backward("split")
        cfg = tk.tile_config(64, torch.bfloat16)
        assert cfg.variant == "split" and cfg.per_head is False
        tk.set_backward("split", per_head=True)
        assert tk.tile_config(64, torch.bfloat16).per_head is True
    finally:
        tk.set_backward(None)


def test_plans_are_built_once_and_reused():
    """A metadata object passed to every call with the same metadata builds its plans once per
    kind: the forward plan by the first forward, the backward's by the first backward."""
    (q, k, v, dout), tensors = make_case(130, 1, 40, 40, 4, 2, 32, torch.float32, "self")
    meta = meta_of(*tensors)
    outs = []
    for _ in range(3):  # three "layers"
        qg = q.clone().requires_grad_(True)
        out = flash_attn(qg, k, v, meta)
        out.backward(dout)
        outs.append((out, qg.grad))
    n_bwd = 1 if tk.tile_config(32, q.dtype).variant == "fused" else 2
    assert meta.plans.builds == 1 + n_bwd and len(meta.plans) == 1 + n_bwd
    ref_out = flash_attn(q, k, v, meta_of(*tensors))
    assert all(torch.equal(o, ref_out) for o, _ in outs)
    assert (
        all(torch.equal(g, outs[0][1]) for _, g in outs[1:])
        or tk.tile_config(32, q.dtype).variant == "fused"
    )
    # the block-attention entry point and the model seam share plans the same way
    meta2 = meta_of(*tensors)
    for _ in range(2):
        block_attention(
            q.clone().requires_grad_(True), k, v, meta2, backend="triton"
        ).sum().backward()
    assert meta2.plans.builds == 1 + n_bwd


def test_model_seam_builds_one_plan_per_step():
    """The model builds one metadata object per forward and hands it to every layer's seam
    (LocalAttention): a 3-layer step builds one forward and one backward plan, in that object."""
    from longvideo.model import ModelConfig, Transformer

    cfg = ModelConfig(
        text_vocab_size=50,
        codebook_size=14,
        dim=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
    )
    model = Transformer(cfg, backend="triton")
    seam, seen = model.attention_fn, []

    def recording(q, k, v, meta):
        seen.append(meta)
        return seam(q, k, v, meta)

    model.set_attention(recording)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 60, (1, 40), generator=g)
    pos, seg = packed_meta(1, 40, g, min_len=5, max_len=20)
    loss = model(ids, pos, seg, targets=ids)
    loss.backward()
    assert len(seen) == 3 and all(m is seen[0] for m in seen)  # one object for every layer
    n_bwd = 1 if tk.tile_config(16, torch.float32).variant == "fused" else 2
    assert seen[0].plans.builds == 1 + n_bwd
    model(ids, pos, seg)  # the next forward: a new object with plans of its own
    assert seen[-1] is not seen[0] and seen[-1].plans.builds == 1


def test_launch_table_round_trips_through_json(tmp_path):
    """The table `gpu_check.py --tune` writes is what LONGVIDEO_FLASH_TABLE loads."""
    assert tk.table_from_json(tk.table_to_json(tk.DEFAULT_TABLE)) == tk.DEFAULT_TABLE
    assert all(c.variant in tk.VARIANTS for c in tk.DEFAULT_TABLE.values())


def test_no_host_sync_on_the_triton_path():
    """Nothing on the kernel path, nor a ring step with this backend, reads a tensor on the host
    (what would wait for the GPU): every conversion to a Python value raises inside no_host_sync.
    Covers functional and block-backend calls with and without plans, the decode path, and the
    ring's step functions on a block with visible keys and on one with none (launched, merged)."""
    from longvideo.parallel.ring import Ring, block_is_empty

    (q, k, v, dout), (qp, kp, qs, ks) = make_case(140, 1, 40, 40, 4, 2, 32, torch.bfloat16, "self")
    triton = get_backend("triton")
    ring = Ring(None, "triton")  # its step methods, as each rank of a ring runs them
    with no_host_sync():
        qg = q.clone().requires_grad_(True)
        flash_attn(qg, k, v, meta_of(qp, kp, qs, ks)).backward(dout)
        flash_attn(q[:, :2], k, v, meta_of(qp[:, :2], kp, qs[:, :2], ks))  # decode
        meta = meta_of(qp, kp, qs, ks, True, 1 / math.sqrt(q.shape[-1]))
        o, l = triton.forward(q, k, v, meta)
        triton.backward(dout, q, k, v, o, l, meta)
        out = torch.zeros(q.shape, dtype=torch.float32)
        lse = torch.full(l.shape, float("-inf"))
        future = kp + 1000  # a block whose keys all come later: nothing visible, launched anyway
        views = [
            meta.visiting(Side(key_pos, ks), step) for step, key_pos in enumerate((kp, future))
        ]
        for view in views:
            ring.forward_step(q, k, v, view, out, lse)
        for view in views:
            grads = ring.backward_step(dout, q, k, v, out, lse, view)
            assert grads is not None
    assert torch.equal(grads[0], torch.zeros_like(grads[0]))  # the empty block adds nothing
    torch.testing.assert_close(out.to(q.dtype), o, atol=0, rtol=0)
    with pytest.raises(HostSync), no_host_sync():  # the guard does catch a host test
        block_is_empty(meta)


# ---- the tile plan (pure PyTorch, no kernel) ---------------------------------------------------


def ranges_visit(ranges: torch.Tensor, order: torch.Tensor, causal: bool) -> list:
    """The (column tile, full?) pairs the ranges of `visit_ranges` make a walker visit, per batch row
    and row tile, in visiting order: lists [b][row tile] of (tile, full) pairs."""
    out = []
    for rb, ob in zip(ranges.tolist(), order.tolist()):
        rows = []
        for f_lo, f_hi, p_lo, p_hi, m_lo, m_hi, a, b, p_max in rb:
            seen = [(ob[t][0], True) for t in range(f_lo, f_hi)]
            for t in list(range(p_lo, p_hi)) + list(range(m_lo, m_hi)):
                tile, s_min, s_max, q_min = ob[t]
                if s_min <= b and s_max >= a and (not causal or q_min <= p_max):
                    seen.append((tile, False))
            rows.append(seen)
        out.append(rows)
    return out


def test_visit_ranges_match_tile_classes():
    """The ranges list exactly the tiles classify_tiles does not skip (each once), the full ranges
    exactly its FULL tiles, in both directions (the backward walks them per key tile), for packed,
    restarting, offset, padded and shuffled metadata."""
    g = torch.Generator().manual_seed(61)
    for trial in range(60):
        B, Sq, Sk = (
            2,
            int(torch.randint(1, 40, (1,), generator=g)),
            int(torch.randint(1, 40, (1,), generator=g)),
        )
        if trial % 6 == 5:  # no order at all
            qp = torch.stack([torch.randperm(Sq, generator=g) for _ in range(B)])
            kp = torch.stack([torch.randperm(Sk, generator=g) for _ in range(B)])
            qs, ks = (
                torch.randint(-1, 3, (B, Sq), generator=g),
                torch.randint(-1, 3, (B, Sk), generator=g),
            )
        else:
            qp, qs = packed_meta(
                B, Sq, g, min_len=1, max_len=12, restart=trial % 2 == 0, pad=trial % 3
            )
            kp, ks = packed_meta(
                B, Sk, g, min_len=1, max_len=12, restart=trial % 2 == 0, pad=trial % 4
            )
            kp = kp + int(torch.randint(-4, 5, (1,), generator=g))
        causal = trial % 5 != 0
        T, U = (int(x) for x in torch.randint(1, 7, (2,), generator=g))
        qt, kt = tile_stats(qp, qs, T), tile_stats(kp, ks, U)
        cls = classify_tiles(qt, kt, causal)
        for rows, cols, c in ((qt, kt, cls), (transposed(kt), transposed(qt), cls.transpose(1, 2))):
            visits = ranges_visit(*visit_ranges(rows, cols, causal), causal)
            for b in range(B):
                for i, seen in enumerate(visits[b]):
                    tiles = [t for t, _ in seen]
                    assert sorted(tiles) == torch.nonzero(c[b, i]).flatten().tolist(), (trial, b, i)
                    assert (
                        sorted(t for t, full in seen if full)
                        == torch.nonzero(c[b, i] == 2).flatten().tolist()
                    )
    # plain causal attention: the lower triangle, its diagonal masked
    pos = torch.arange(64)[None]
    seg = torch.zeros(1, 64, dtype=torch.long)
    visits = ranges_visit(
        *visit_ranges(tile_stats(pos, seg, 16), tile_stats(pos, seg, 16), True), True
    )[0]
    assert [sorted(v) for v in visits] == [[(j, j < i) for j in range(i + 1)] for i in range(4)]


def _layout(layout: str, S: int):
    """(q_pos, k_pos, seg) of a causal single document, 300 packed documents with restarting positions
    and trailing padding, or a zigzag ring step (rank 1's block of a 4-way ring against rank 2's keys)."""
    if layout == "causal":
        pos = torch.arange(S)[None]
        return pos, pos, torch.zeros(1, S, dtype=torch.long)
    if layout == "packed":
        g = torch.Generator().manual_seed(0)
        cuts = torch.sort(torch.randint(1, S - S // 64, (299,), generator=g)).values
        starts = torch.cat([torch.zeros(1, dtype=torch.long), cuts])
        seg = torch.zeros(S, dtype=torch.long)
        seg[cuts] = 1
        seg = seg.cumsum(0)
        pos = torch.arange(S) - starts[seg]
        seg[-(S // 64) :] = -1
        return pos[None], pos[None], seg[None]
    W, c = 4, S // 8

    def rank(r):
        return torch.cat(
            [torch.arange(r * c, (r + 1) * c), torch.arange((2 * W - 1 - r) * c, (2 * W - r) * c)]
        )[None]

    return rank(1), rank(2), torch.zeros(1, 2 * c, dtype=torch.long)


@pytest.mark.parametrize("layout", ["causal", "packed", "zigzag"])
def test_plan_cost_is_linear(layout):
    """A plan is O(tiles) integers (the old one was a query tiles x key tiles table plus an argsort):
    at S = 1M with the bf16 D = 128 tiles the forward and backward plans take well under a second
    of CPU. The kernels' walk (candidate tiles) exceeds the tiles that hold visible pairs by at most
    two per row tile (checked at 64K, against classify_tiles)."""
    import time

    bm, bn = 128, 64
    qp, kp, seg = _layout(layout, 1 << 20)
    t0 = time.process_time()
    plan = tk.build_plan(meta_of(qp, kp, seg, seg), bm, bn)
    tk.build_plan(meta_of(qp, kp, seg, seg), 32, 128, transpose=True)
    cpu_s = time.process_time() - t0
    n_m, n_n = -(-qp.shape[1] // bm), -(-kp.shape[1] // bn)
    assert plan.numel() == n_m * 9 + 2 * n_n * 4
    assert cpu_s < 5.0, f"plans at 1M took {cpu_s:.1f} s of CPU"
    qp, kp, seg = _layout(layout, 1 << 16)
    n_m = -(-qp.shape[1] // bm)
    ranges = tk.build_plan(meta_of(qp, kp, seg, seg), bm, bn)[:, : n_m * 9].view(1, n_m, 9).long()
    walked = int(
        (
            ranges[..., 1]
            - ranges[..., 0]
            + ranges[..., 3]
            - ranges[..., 2]
            + ranges[..., 5]
            - ranges[..., 4]
        ).sum()
    )
    real = int((classify_tiles(tile_stats(qp, seg, bm), tile_stats(kp, seg, bn), True) > 0).sum())
    assert real <= walked <= real + 2 * n_m, (walked, real)


# ---- the GPU build ------------------------------------------------------------------------------


@pytest.mark.slow
def test_kernels_compile_for_hopper(tmp_path):
    """The GPU path (which the interpreter does not exercise) compiles for sm_90 with the bf16 launch
    shapes of head dims 64, 80 (padded to 128, masked), 128 and 256, for every kernel (forward,
    decode, both backward variants, the dQ pass), fits shared memory, and spills no registers
    except in the rows whose shapes were timed on a GPU (GPU_TIMED).
    Needs no GPU: Triton's own compiler and ptxas run on the CPU (tests/ptxas_report.py)."""
    ptxas = Path(tk.triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's bundled ptxas is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, never from a cache
    root = Path(__file__).resolve().parents[1]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(root / "tests" / "ptxas_report.py"),
                "--head-dims",
                *dims,
                "--json",
                str(tmp_path / f"{i}.json"),
            ],
            env=env,
            cwd=root,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i, dims in enumerate((["128", "64"], ["256", "80"]))
    ]  # two processes: two cores
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    print("".join(outs))


# ---- ring attention over W = 2 ranks with this backend ----------------------------------------


def _ring_case(group, seed, S, causal, dtype, heads, D):
    """Full-sequence inputs made on rank 0 and broadcast; the float64 reference on the whole
    sequence, sliced with the production layout (shard_sequence), against ring_attention."""
    from longvideo.parallel.ring import ring_attention
    from longvideo.parallel.zigzag import shard_sequence, unshard_sequence

    g = torch.Generator().manual_seed(seed)
    Hq, Hkv = heads
    q, k, v, dout = (torch.randn(2, S, h, D, generator=g) for h in (Hq, Hkv, Hkv, Hq))
    pos, seg = packed_meta(2, S, g, min_len=2, max_len=S // 2, restart=True, pad=2)
    for t in (q, k, v, dout, pos, seg):
        dist.broadcast(t, src=0, group=group)
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    whole = AttentionMeta.self_attention(pos, seg, causal=causal)
    truth = reference(q, k, v, whole, dout, upcast=True)
    plain = reference(q, k, v, whole, dout, upcast=False)

    def local(x, pad=0):
        return shard_sequence(x, group, dim=1, pad_value=pad)

    local_q, local_k, local_v = (local(x).requires_grad_(True) for x in (q, k, v))
    local_dout = local(dout)
    shard = AttentionMeta.self_attention(local(pos), local(seg, -1), causal=causal)
    with no_host_sync():  # no step of the ring reads a device value on the host with this backend
        out = ring_attention(local_q, local_k, local_v, shard, group=group, backend="triton")
        out.backward(local_dout)
    # per step one forward plan (none on the decode path) and one backward plan (two with the split
    # variant), reused by a second layer
    per_step = (0 if tk.uses_decode(local_q.shape[1]) else 1) + (
        1 if tk.tile_config(D, dtype).variant == "fused" else 2
    )
    assert shard.plans.builds == 2 * per_step, shard.plans.builds
    again = ring_attention(local_q, local_k, local_v, shard, group=group, backend="triton")
    again.backward(local_dout)
    assert shard.plans.builds == 2 * per_step and torch.equal(again, out)
    local_q.grad = local_k.grad = local_v.grad = None
    fresh = AttentionMeta.self_attention(local(pos), local(seg, -1), causal=causal)
    out = ring_attention(local_q, local_k, local_v, fresh, group=group, backend="triton")
    out.backward(local_dout)
    what = f"ring W=2 S={S} causal={causal} {dtype} heads={heads} D={D}"
    eps = EPS[dtype]
    grads = (local_q.grad, local_k.grad, local_v.grad)
    for name, got, t, p in zip(("out", "dq", "dk", "dv"), (out, *grads), truth, plain):
        assert got.dtype == dtype, f"{what}: {name} dtype {got.dtype}"
        assert_within(
            f"{what}: {name}", got, local(t), local(p), eps=eps * (1 + t.abs().max().item())
        )
    full = unshard_sequence(out.detach(), group, dim=1, length=S)
    assert max_err(full, truth[0]) <= 2 * max_err(plain[0], truth[0]) + eps * (
        1 + truth[0].abs().max().item()
    )


def _ring_body(rank, world):
    assert os.environ.get("TRITON_INTERPRET") or torch.cuda.is_available()
    group = dist.group.WORLD
    _ring_case(group, 71, 37, True, torch.bfloat16, (4, 2), 32)  # packed documents, padding, GQA
    _ring_case(group, 72, 22, False, torch.float32, (2, 1), 32)


@pytest.mark.slow
@pytest.mark.distributed
def test_ring_attention_with_triton_backend():
    from distributed import run_ranks

    run_ranks(_ring_body, world=2, timeout=300)
