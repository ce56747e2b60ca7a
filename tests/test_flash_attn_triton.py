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
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from attn_cases import assert_within, max_err, packed_meta, reference
from longvideo.kernels import _flash_attn_triton as tk
from longvideo.kernels import block_attention, flash_attn_ref, get_backend, visibility
from longvideo.kernels.backends import resolve_backend_name
from longvideo.kernels.flash_attn import TritonBackend, flash_attn

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or tk.INTERPRET),
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = {torch.float32: 2e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}  # about one ulp of O(1) values


# ---- inputs ----------------------------------------------------------------------------------

def _blocks(layout: str, L: int, Sq: int, Sk: int, g: torch.Generator):
    """Index sets (query block, key block) into a global sequence of length L, as a ring sees them."""
    if layout == "self":
        return torch.arange(L), torch.arange(L)
    if layout == "zigzag":  # W = 2: rank r holds chunks r and 3 - r; queries of one rank, keys of another
        c = L // 4
        rank = [torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((3 - r) * c, (4 - r) * c)]) for r in (0, 1)]
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
    out, lse = flash_attn(qg, kg, vg, *meta, causal=causal, return_lse=True)
    out.backward(dout)
    truth = reference(q, k, v, *meta, causal, dout, upcast=True)
    plain = reference(q, k, v, *meta, causal, dout, upcast=False)
    _, lse_truth = flash_attn_ref(q.double(), k.double(), v.double(), *meta, causal=causal)
    _, lse_plain = flash_attn_ref(q, k, v, *meta, causal=causal, upcast=False)
    eps = EPS[dtype]
    for name, got, t, p in zip(("out", "dq", "dk", "dv"), (out, qg.grad, kg.grad, vg.grad), truth, plain):
        assert got.dtype == dtype, f"{what}: {name} dtype {got.dtype}"
        assert_within(f"{what}: {name}", got, t, p, eps=eps * (1 + t.abs().max().item()))
    empty = torch.isinf(lse_truth)  # rows with no visible key
    assert lse.dtype == torch.float32 and lse.shape == lse_truth.shape
    assert torch.equal(torch.isneginf(lse), empty), f"{what}: -inf lse rows differ from the reference"
    assert_within(f"{what}: lse", lse[~empty], lse_truth[~empty], lse_plain[~empty], eps=eps * 10)
    # the same-dtype lse is loose (scores rounded to the dtype); the kernel's scores are fp32 dots of
    # the same rounded inputs the float64 truth starts from, so its lse is fp32-accurate in any dtype
    if (~empty).any():
        err = max_err(lse[~empty], lse_truth[~empty])
        assert err <= 1e-5 * (1 + lse_truth[~empty].abs().max().item()), f"{what}: lse error {err:.3g}"
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


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"s{c[0]}-{c[2]}x{c[3]}-h{c[4]}/{c[5]}-d{c[6]}-"
                         f"{str(c[7]).split('.')[1]}-{'causal' if c[8] else 'full'}-{c[9]}")
def test_matches_reference(case):
    seed, B, Sq, Sk, Hq, Hkv, D, dtype, causal, layout = case
    (q, k, v, dout), meta = make_case(seed, B, Sq, Sk, Hq, Hkv, D, dtype, layout, restart=seed % 2 == 1)
    assert visibility(*meta, causal).any(), "the case must have visible pairs to test anything"
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
    (q, k, v, dout), (qp, kp, qs, ks) = make_case(21, 2, 24, 24, 4, 2, 32, torch.float32, "self")
    truth = reference(q, k, v, qp, kp, qs, ks, True, dout, upcast=True)
    plain = reference(q, k, v, qp, kp, qs, ks, True, dout, upcast=False)
    be = get_backend("triton", DEV)
    assert isinstance(be, TritonBackend) and be.name == "triton"
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = be.forward(q, k, v, qp, kp, qs, ks, scale, True)  # global: all keys in one call
    dq = torch.zeros(q.shape, dtype=torch.float32, device=DEV)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=DEV)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=DEV)
    for sl in (slice(0, 9), slice(9, 24)):  # two key blocks of uneven length
        gq, gk, gv = be.backward(dout, q, k[:, sl], v[:, sl], out, lse, qp, kp[:, sl], qs, ks[:, sl], scale, True)
        assert gq.dtype == gk.dtype == gv.dtype == torch.float32
        dq += gq
        dk[:, sl] += gk
        dv[:, sl] += gv
    for name, got, t, p in zip(("dq", "dk", "dv"), (dq, dk, dv), truth[1:], plain[1:]):
        assert_within(f"global lse: {name}", got, t, p, eps=EPS[torch.float32] * (1 + t.abs().max().item()))


def test_block_attention_and_auto_backend():
    """The kernel serves kernels.block_attention as the `triton` backend; `auto` picks it on CUDA."""
    assert resolve_backend_name("auto", torch.device("cuda")) == "triton"
    (q, k, v, dout), meta = make_case(31, 1, 20, 20, 2, 1, 32, torch.float32, "self")
    qa, ka, va = (x.clone().requires_grad_(True) for x in (q, k, v))
    qb, kb, vb = (x.clone().requires_grad_(True) for x in (q, k, v))
    oa = block_attention(qa, ka, va, *meta, backend="triton")
    ob = flash_attn(qb, kb, vb, *meta)
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
    out, lse = torch.ops.longvideo.flash_attn_fwd(q, k, v, *meta, scale, True)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.longvideo.flash_attn_fwd.default, (q, k, v, *meta, scale, True), test_utils=tests)
    torch.library.opcheck(torch.ops.longvideo.flash_attn_bwd.default, (dout, q, k, v, out, lse, *meta, scale, True),
                          test_utils=tests)


def test_rejects_bad_inputs():
    q = torch.randn(1, 8, 4, 32, device=DEV)
    k = torch.randn(1, 8, 2, 32, device=DEV)
    with pytest.raises(ValueError, match="head dims"):
        flash_attn(torch.randn(1, 8, 2, 48, device=DEV), torch.randn(1, 8, 2, 48, device=DEV),
                   torch.randn(1, 8, 2, 48, device=DEV))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        flash_attn(q, torch.randn(1, 8, 3, 32, device=DEV), torch.randn(1, 8, 3, 32, device=DEV))
    with pytest.raises(ValueError, match="dtypes differ"):
        flash_attn(q, k.half(), k.half())
    with pytest.raises(ValueError, match="supports fp16, bf16 and fp32"):
        flash_attn(q.double(), k.double(), k.double())
    with pytest.raises(ValueError, match="k_pos must have shape"):
        flash_attn(q, k, k, k_pos=torch.zeros(1, 7, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="must be an integer tensor"):
        flash_attn(q, k, k, q_seg=torch.zeros(1, 8, device=DEV))


# ---- the tile plan (pure PyTorch, no kernel) ---------------------------------------------------

def test_tile_plan_is_sound_and_skips():
    """skip => no visible pair; full => every pair visible and every row/column in range; and on a
    plain causal block the plan is exactly: below the diagonal full, above skipped."""
    g = torch.Generator().manual_seed(61)
    T = 4
    for trial in range(40):
        B, Sq, Sk = 2, int(torch.randint(1, 30, (1,), generator=g)), int(torch.randint(1, 30, (1,), generator=g))
        qp, qs = packed_meta(B, Sq, g, min_len=1, max_len=12, restart=trial % 2 == 0, pad=trial % 3)
        kp, ks = packed_meta(B, Sk, g, min_len=1, max_len=12, restart=trial % 2 == 0, pad=trial % 4)
        kp = kp + int(torch.randint(-4, 5, (1,), generator=g))
        causal = trial % 5 != 0
        cls = tk.tile_classes(qp, kp, qs, ks, causal, T, T)
        vis = visibility(qp, kp, qs, ks, causal)
        nq, nk = cls.shape[1:]
        padded = torch.zeros(B, nq * T, nk * T, dtype=torch.bool)
        padded[:, :Sq, :Sk] = vis
        in_range = torch.zeros_like(padded)
        in_range[:, :Sq, :Sk] = True
        tiles = padded.view(B, nq, T, nk, T).transpose(2, 3)  # (B, nq, nk, T, T)
        ranged = in_range.view(B, nq, T, nk, T).transpose(2, 3)
        assert not tiles[cls == 0].any(), "a skipped tile holds a visible pair"
        assert tiles[cls == 2].all() and ranged[cls == 2].all(), "a full tile holds a masked pair"
        plan = tk.plan_from_classes(cls)
        for b in range(B):
            for i in range(nq):
                nf, npart = int(plan.n_full[b, i]), int(plan.n_part[b, i])
                listed = plan.order[b, i, :nf + npart].tolist()
                assert sorted(listed) == sorted(torch.nonzero(cls[b, i]).flatten().tolist())
                assert all(cls[b, i, j] == 2 for j in listed[:nf])
    pos = torch.arange(64)[None]
    seg = torch.zeros(1, 64, dtype=torch.long)
    cls = tk.tile_classes(pos, pos, seg, seg, True, 16, 16)[0]
    expect = torch.tril(torch.full((4, 4), 2, dtype=torch.int8), -1) + torch.eye(4, dtype=torch.int8)
    assert torch.equal(cls, expect)


# ---- the GPU build ------------------------------------------------------------------------------

_COMPILE_SCRIPT = textwrap.dedent("""
    import os, subprocess, sys, tempfile
    os.environ.pop("TRITON_INTERPRET", None)
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from longvideo.kernels import _flash_attn_triton as k
    D, dt = int(sys.argv[1]), sys.argv[2]
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    fwd, kv, dq = k._configs(D, tdt)
    flags = k._flags(tdt)
    meta = {n: "*i32" for n in ("QPOS", "KPOS", "QSEG", "KSEG", "PLAN", "NFULL", "NPART")}
    T = "*" + dt
    jobs = [
        (k._fwd_kernel, dict(meta, Q=T, K=T, V=T, O=T, LSE="*fp32"), fwd),
        (k._bwd_dkdv_kernel, dict(meta, Q=T, K=T, V=T, DO=T, LSE2="*fp32", DELTA="*fp32", DK="*fp32",
                                  DV="*fp32"), kv),
        (k._bwd_dq_kernel, dict(meta, Q=T, K=T, V=T, DO=T, LSE2="*fp32", DELTA="*fp32", DQ="*fp32"), dq),
    ]
    for fn, ptrs, cfg in jobs:
        const = dict(HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=True, **flags)
        sig = {n: ptrs.get(n, "constexpr" if n in const else "fp32" if n.endswith("scale") else "i32")
               for n in fn.arg_names}
        # what the launcher specialises on at run time: 16-aligned pointers and strides
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if sig[n].startswith("*") or n.startswith("stride_")}
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(n),): v for n, v in const.items()},
                        attrs=attrs)
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ck.asm["ptx"])
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                           capture_output=True, text=True, check=True)
        os.unlink(f.name)
        spills = [l for l in r.stderr.splitlines() if "spill" in l]
        print(fn.__name__, cfg, ck.metadata.shared, *spills)
        assert ck.metadata.shared <= 227 * 1024, f"{fn.__name__}: {ck.metadata.shared} B of shared memory"
        assert all(" 0 bytes spill stores" in l for l in spills), f"{fn.__name__} spills registers: {spills}"
""")


@pytest.mark.slow
def test_kernels_compile_for_hopper_without_spills(tmp_path):
    """The GPU path (which the interpreter does not exercise) compiles for sm_90 with the bf16
    D=128 tile shapes, fits shared memory and spills no registers. Needs no GPU: Triton's own
    compiler and ptxas run on the CPU."""
    ptxas = Path(tk.triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's bundled ptxas is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, never from a cache
    r = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, "128", "bf16"], env=env, capture_output=True,
                       text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]


# ---- ring attention over W = 2 ranks with this backend ----------------------------------------

def _ring_case(group, seed, S, causal, dtype, heads, D):
    """Full-sequence inputs made on rank 0 and broadcast; the float64 reference on the whole
    sequence, sliced with the production layout (shard_sequence), against ring_attention."""
    from longvideo.parallel.layout import shard_sequence, unshard_sequence
    from longvideo.parallel.ring import ring_attention

    g = torch.Generator().manual_seed(seed)
    Hq, Hkv = heads
    q, k, v, dout = (torch.randn(2, S, h, D, generator=g) for h in (Hq, Hkv, Hkv, Hq))
    pos, seg = packed_meta(2, S, g, min_len=2, max_len=S // 2, restart=True, pad=2)
    for t in (q, k, v, dout, pos, seg):
        dist.broadcast(t, src=0, group=group)
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    truth = reference(q, k, v, pos, pos, seg, seg, causal, dout, upcast=True)
    plain = reference(q, k, v, pos, pos, seg, seg, causal, dout, upcast=False)

    def local(x, pad=0):
        return shard_sequence(x, group, dim=1, pad_value=pad)

    lq, lk, lv = (local(x).requires_grad_(True) for x in (q, k, v))
    out = ring_attention(lq, lk, lv, group=group, causal=causal, positions=local(pos), segment_ids=local(seg, -1),
                         backend="triton")
    out.backward(local(dout))
    what = f"ring W=2 S={S} causal={causal} {dtype} heads={heads} D={D}"
    eps = EPS[dtype]
    for name, got, t, p in zip(("out", "dq", "dk", "dv"), (out, lq.grad, lk.grad, lv.grad), truth, plain):
        assert got.dtype == dtype, f"{what}: {name} dtype {got.dtype}"
        assert_within(f"{what}: {name}", got, local(t), local(p), eps=eps * (1 + t.abs().max().item()))
    full = unshard_sequence(out.detach(), group, dim=1, length=S)
    assert max_err(full, truth[0]) <= 2 * max_err(plain[0], truth[0]) + eps * (1 + truth[0].abs().max().item())


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
