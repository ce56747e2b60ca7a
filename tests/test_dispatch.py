"""The `auto` block backend (kernels/dispatch.py): every route against the float64 reference.

Dense blocks (one rectangle, the aligned causal triangle, each zigzag ring step's block, several
pieces) go to the CPU flash op on CPU; packed documents, padding and shuffled metadata go to the
general backend. The CUDA kernels' call signatures are checked on meta tensors; on a GPU
`scripts/gpu_check.py` checks them against float64. Tolerance: 2 x the same-dtype error + eps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from attn_cases import assert_within, meta_of, packed_meta, reference
from distributed import run_ranks
from longvideo.kernels.attention_math import dense_pieces

from longvideo.kernels import AttentionMeta, Side, block_attention, get_backend
from longvideo.kernels import dispatch as dp
from longvideo.parallel import ring_attention, shard_sequence, zigzag_indices


@pytest.fixture
def be():
    """A fresh dispatch backend in the registry's place (its route counts start at zero)."""
    from longvideo.kernels import backends

    fresh = dp.DispatchBackend()
    old = backends._INSTANCES.get("auto")
    backends._INSTANCES["auto"] = fresh
    yield fresh
    if old is None:
        backends._INSTANCES.pop("auto")
    else:
        backends._INSTANCES["auto"] = old


def _zigzag(S, W, r):
    return zigzag_indices(S, W, r)[None]


def _meta(kind, B, Sq, Sk, g):
    """(q_pos, k_pos, q_seg, k_seg) of a block kind, and the route it must take."""
    z = lambda n: torch.zeros(B, n, dtype=torch.long)  # noqa: E731
    if kind == "causal":
        p = torch.arange(Sq).expand(B, Sq)
        return (p, p, z(Sq), z(Sq)), "causal"
    if kind == "dense":  # keys of an earlier block, all visible
        return (
            torch.arange(Sk, Sk + Sq).expand(B, Sq),
            torch.arange(Sk).expand(B, Sk),
            z(Sq),
            z(Sk),
        ), "dense"
    if kind.startswith("zigzag"):  # W = 3, S = 6 Sq / 2: rank 1's queries against rank r's keys
        r = int(kind[-1])
        qp, kp = _zigzag(3 * Sq, 3, 1).expand(B, Sq), _zigzag(3 * Sq, 3, r).expand(B, Sq)
        return (qp, kp, z(Sq), z(Sq)), "causal" if r == 1 else "dense"
    if kind == "two-docs":  # two documents, positions restarting: one causal piece each
        p = torch.cat([torch.arange(Sq // 3), torch.arange(Sq - Sq // 3)]).expand(B, Sq)
        s = (torch.arange(Sq) >= Sq // 3).long().expand(B, Sq)
        return (p, p, s, s), "pieces"
    if kind == "packed":
        p, s = packed_meta(B, Sq, g, min_len=3, max_len=12, restart=True, pad=3)
        return (p, p, s, s), "masked"
    if kind == "padded":  # one document, padding in one batch row only
        p = torch.arange(Sq).expand(B, Sq)
        s = z(Sq)
        s[-1, -5:] = -1
        return (p, p, s, s), "masked"
    if kind == "shuffled":
        p = torch.stack([torch.randperm(Sq, generator=g) for _ in range(B)])
        return (p, p, z(Sq), z(Sq)), "masked"
    raise ValueError(kind)


def _inputs(B, Sq, Sk, Hq, Hkv, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (
        torch.randn(B, n, h, D, generator=g).to(dtype)
        for n, h in ((Sq, Hq), (Sk, Hkv), (Sk, Hkv), (Sq, Hq))
    )
    return q, k, v, dout, g


def _check(q, k, v, dout, tensors, causal, what):
    meta = meta_of(*tensors, causal)
    truth = reference(q, k, v, meta, dout, upcast=True)
    plain = reference(q, k, v, meta, dout, upcast=False)
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = block_attention(qq, kk, vv, meta, backend="auto")
    out.backward(dout)
    eps = 1e-12 if q.dtype == torch.float64 else 1e-6 if q.dtype == torch.float32 else 1e-3
    for name, got, t, p in zip(
        ("out", "dq", "dk", "dv"), (out, qq.grad, kk.grad, vv.grad), truth, plain
    ):
        assert got.dtype == q.dtype, f"{what}: {name} dtype {got.dtype}"
        assert_within(f"{what}: {name}", got, t, p, eps * (1 + t.abs().max().item()))


KINDS = [
    "causal",
    "dense",
    "zigzag0",
    "zigzag1",
    "zigzag2",
    "two-docs",
    "packed",
    "padded",
    "shuffled",
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_route_matches_float64(be, one_thread, kind, dtype):
    B, S = 2, 48
    q, k, v, dout, g = _inputs(B, S, S, 4, 2, 16, dtype, seed=KINDS.index(kind))
    meta, route = _meta(kind, B, S, S, g)
    _check(q, k, v, dout, meta, True, f"{kind} {dtype}")
    impl = "cpu" if route == "masked" else "cpu-flash"
    assert dict(be.routes) == {(route, impl): 1}, be.routes


@pytest.mark.parametrize("D", [64, 80, 128])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["gqa", "mha"])
def test_head_dims_and_gqa(be, one_thread, D, heads):
    for i, kind in enumerate(("causal", "zigzag2", "packed")):
        q, k, v, dout, g = _inputs(1, 24, 24, *heads, D, torch.float32, seed=D + i)
        meta, _ = _meta(kind, 1, 24, 24, g)
        _check(q, k, v, dout, meta, True, f"{kind} D={D} heads={heads}")


@pytest.mark.parametrize("causal", [True, False])
def test_different_lengths_and_non_causal(be, one_thread, causal):
    q, k, v, dout, g = _inputs(2, 20, 36, 4, 2, 16, torch.float32, seed=3)
    meta, _ = _meta("dense", 2, 20, 36, g)
    _check(q, k, v, dout, meta, causal, f"Sq != Sk causal={causal}")
    p, s = packed_meta(
        2, 36, g, min_len=5, max_len=20, restart=False
    )  # non-causal packed: per-document pieces
    _check(*_inputs(2, 36, 36, 4, 2, 16, torch.float32, seed=4)[:4], (p, p, s, s), causal, "packed")


def test_pieces_and_their_merge():
    """Zigzag steps are one call each; pieces that share a side are joined; masks give None."""
    z = torch.zeros(1, 16, dtype=torch.long)

    def pieces(q_pos, k_pos, q_seg, k_seg, causal):
        return dense_pieces(Side(q_pos, q_seg), Side(k_pos, k_seg), causal)

    for r, want in (
        (0, [(0, 16, 0, 8, False)]),
        (1, [(0, 16, 0, 16, True)]),
        (2, [(8, 16, 0, 16, False)]),
    ):
        assert pieces(_zigzag(48, 3, 1), _zigzag(48, 3, r), z, z, True) == want
    p = torch.arange(16)[None]
    assert pieces(p + 16, p, z, z, True) == [(0, 16, 0, 16, False)]
    assert pieces(p, p + 16, z, z, True) == []  # every key in the future
    s = (p >= 10).long()
    assert pieces(p, p, s, s, False) == [(0, 10, 0, 10, False), (10, 16, 10, 16, False)]
    assert pieces(p, p, s, 1 - s, True) == [(10, 16, 0, 10, False)]
    assert pieces(p, p, z, (p >= 5).long(), True) is None  # keys of two documents cut the triangle
    assert pieces(p, p, z - 1, z - 1, True) == []  # padding only


def test_plan_keeps_the_choice_and_skips_empty_blocks(be):
    """The host read happens once per plan; an empty block costs no kernel and gives exact zeros."""
    q, k, v, dout, _ = _inputs(1, 32, 32, 2, 2, 8, torch.float32, seed=5)
    p = torch.arange(32)[None]
    z = torch.zeros(1, 32, dtype=torch.long)
    meta = AttentionMeta.self_attention(p, z, scale=0.3)
    for _ in range(3):
        out, lse = be.forward(q, k, v, meta)
        be.backward(dout, q, k, v, out, lse, meta)
    assert meta.plans.builds == 1 and be.routes[("causal", "cpu-flash")] == 3
    future = meta_of(p, p + 100, z, z, True, 0.3)
    out, lse = be.forward(q, k, v, future)
    assert (out == 0).all() and torch.isneginf(lse).all() and be.routes[("empty", "skip")] == 1
    assert all((g == 0).all() for g in be.backward(dout, q, k, v, out, lse, future))


def test_a_refusing_kernel_falls_back(be, monkeypatch, caplog):
    """A dense kernel that raises is logged once, not asked again, and the block is still exact."""
    calls = []

    def refuse(*a):
        calls.append(1)
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setitem(dp.KERNELS, "cpu-flash", (refuse, refuse))
    q, k, v, dout, g = _inputs(1, 24, 24, 4, 2, 16, torch.float32, seed=6)
    meta, _ = _meta("causal", 1, 24, 24, g)
    with caplog.at_level("WARNING", logger="longvideo.kernels.dispatch"):
        _check(q, k, v, dout, meta, True, "refused")
        _check(q, k, v, dout, meta, True, "refused again")
    assert len(calls) == 1 and sum("refused" in r.message for r in caplog.records) == 1
    assert be.routes == {("causal", "cpu"): 2}


def test_cuda_kernels_signatures_on_meta_tensors():
    """The cuDNN and flash calls, with GQA and causal, run on meta tensors (argument order and
    types, output shapes); their numbers are the GPU check's to verify."""
    B, Sq, Sk, Hq, Hkv, D = 2, 40, 24, 9, 3, 64
    q, dout = (torch.empty(B, Sq, Hq, D, device="meta", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.empty(B, Sk, Hkv, D, device="meta", dtype=torch.bfloat16) for _ in range(2))
    for name, (fwd, bwd) in dp.KERNELS.items():
        if name == "cpu-flash":
            continue
        for causal, kk, vv in (
            (False, k, v),
            (True, k.new_empty(B, Sq, Hkv, D), v.new_empty(B, Sq, Hkv, D)),
        ):
            out, lse = fwd(q, kk, vv, dp.DenseCall(0.125, causal))
            assert (
                out.shape == q.shape and lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32
            ), name
            dq, dk, dv = bwd(dout, q, kk, vv, out, lse, dp.DenseCall(0.125, causal))
            assert dq.shape == q.shape and dk.shape == kk.shape and dv.shape == vv.shape, name


def test_auto_is_the_dispatch_and_routes_by_device():
    assert isinstance(get_backend("auto"), dp.DispatchBackend) and get_backend("auto").sync_free
    be = dp.DispatchBackend(dense=("flash",))
    cuda_like = torch.empty(1, 4, 2, 16, device="meta", dtype=torch.bfloat16)
    assert be._kernels(torch.empty(1, 4, 2, 16)) == ["cpu-flash"] and be._kernels(cuda_like) == []
    with pytest.raises(ValueError, match="unknown dense kernels"):
        dp.DispatchBackend(dense=("fa3",))


# ---- ring attention over the dispatch, W = 2 --------------------------------------------------


def _ring_body(rank, world):
    g = torch.Generator().manual_seed(0)
    group = dist.group.WORLD
    be = get_backend("auto")
    for kind, dtype, heads in (
        ("one document", torch.float32, (4, 2)),
        ("one document", torch.bfloat16, (9, 3)),
        ("packed", torch.float32, (4, 2)),
    ):
        if (
            kind == "packed"
        ):  # the one-document blocks never needed the element mask: one dense call a step
            assert dict(be.routes) == {("causal", "cpu-flash"): 2, ("dense", "cpu-flash"): 2}, (
                be.routes
            )
        S = 48
        q, k, v, dout = (
            torch.randn(1, S, h, 16, generator=g).to(dtype)
            for h in (heads[0], heads[1], heads[1], heads[0])
        )
        pos = torch.arange(S)[None]
        seg = torch.zeros(1, S, dtype=torch.long)
        if kind == "packed":
            pos, seg = packed_meta(1, S, g, min_len=5, max_len=20, restart=True)
        truth = reference(q, k, v, AttentionMeta.self_attention(pos, seg), dout, upcast=True)
        plain = reference(q, k, v, AttentionMeta.self_attention(pos, seg), dout, upcast=False)
        local = lambda x: shard_sequence(x, group, dim=1)  # noqa: E731
        local_q, local_k, local_v = (local(x).requires_grad_(True) for x in (q, k, v))
        shard = AttentionMeta.self_attention(local(pos), local(seg))
        out = ring_attention(local_q, local_k, local_v, shard, group=group, backend="auto")
        out.backward(local(dout))
        grads = (local_q.grad, local_k.grad, local_v.grad)
        for name, got, t, p in zip(("out", "dq", "dk", "dv"), (out, *grads), truth, plain):
            assert_within(
                f"rank {rank} {kind} {dtype}: {name}",
                got,
                local(t),
                local(p),
                (1e-6 if dtype == torch.float32 else 1e-3) * (1 + t.abs().max().item()),
            )


@pytest.mark.distributed
def test_ring_over_the_dispatch_matches_float64():
    run_ranks(_ring_body, world=2, timeout=120)


def test_scale_default_matches_sdpa(be):
    """block_attention's default scale on the dense route is SDPA's (1 / sqrt(D))."""
    q, k, v, _, _ = _inputs(1, 16, 16, 2, 2, 32, torch.float32, seed=8)
    ours = block_attention(q, k, v, backend="auto")
    theirs = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
