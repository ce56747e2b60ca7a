"""The `cpu` block backend against the float64 materialised reference (kernels.flash_attn_ref)."""

import math

import pytest
import torch
from attn_cases import assert_within, meta_of, packed_meta, reference
from longvideo.kernels.cpu_backend import CAUSAL, FULL, MASKED, CpuBackend, lse_merge_, make_tiles

from longvideo.kernels import AttentionMeta, Side, block_attention, get_backend

DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def _inputs(B, Sq, Sk, Hq, Hkv, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, Sk, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, Sk, Hkv, D, generator=g).to(dtype)
    dout = torch.randn(B, Sq, Hq, D, generator=g).to(dtype)
    return q, k, v, dout, g


def _meta(kind, B, S, g):
    if kind == "plain":
        return torch.arange(S).expand(B, S), torch.zeros(B, S, dtype=torch.long)
    if kind == "packed":  # documents shorter and longer than a tile, positions restarting, padding
        return packed_meta(B, S, g, min_len=1, max_len=50, restart=True, pad=5)
    if kind == "zigzag":  # two chunks of a 4-chunk sequence, as rank 0 of a 2-rank ring holds them
        c = S // 2
        pos = torch.cat([torch.arange(c), torch.arange(3 * c, 4 * c)]).expand(B, S)
        return pos, torch.zeros(B, S, dtype=torch.long)
    if kind == "shuffled":  # no consecutive runs at all: every tile goes through the masked path
        pos = torch.stack([torch.randperm(S, generator=g) for _ in range(B)])
        return pos, torch.randint(0, 2, (B, S), generator=g)
    raise ValueError(kind)


def _check(be, q, k, v, dout, qp, kp, qs, ks, causal):
    """Forward, and backward through the differentiable op, within the dtype tolerance."""
    meta = meta_of(qp, kp, qs, ks, causal)
    truth = reference(q, k, v, meta, dout, upcast=True)
    plain = reference(q, k, v, meta, dout, upcast=False)
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = block_attention(qq, kk, vv, meta, backend=be)
    out.backward(dout)
    eps = 1e-12 if q.dtype == torch.float64 else 1e-6
    for name, got, t, p in zip(
        ("out", "dq", "dk", "dv"), (out, qq.grad, kk.grad, vv.grad), truth, plain
    ):
        assert got.dtype == q.dtype, f"{name} dtype {got.dtype}"
        assert_within(name, got, t, p, eps)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tiles are dominated by thread-pool hand-offs on a busy 2-core machine: use one thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 16 tokens (pool below 4) so tiny tests cross many tile boundaries."""
    from longvideo.kernels import backends

    be = CpuBackend(tile=16, min_tile=4)
    monkeypatch.setitem(backends._INSTANCES, "cpu", be)
    return be


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kind", ["plain", "packed", "zigzag", "shuffled"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_matches_reference(small_tiles, dtype, causal, kind, heads):
    B, S, D = 2, 72, 16
    q, k, v, dout, g = _inputs(B, S, S, heads[0], heads[1], D, dtype, seed=len(kind) * 2 + causal)
    pos, seg = _meta(kind, B, S, g)
    _check("cpu", q, k, v, dout, pos, pos, seg, seg, causal)


@pytest.mark.parametrize("causal", [True, False])
def test_different_query_and_key_lengths(small_tiles, causal):
    """Sq != Sk with keys of another document/position range (a visiting ring block)."""
    q, k, v, dout, g = _inputs(1, 40, 56, 4, 2, 8, torch.float32, seed=3)
    qp, qs = packed_meta(1, 40, g, min_len=5, max_len=30, restart=False)
    kp, ks = packed_meta(1, 56, g, min_len=5, max_len=30, restart=False)
    _check("cpu", q, k, v, dout, qp + 20, kp, qs, ks, causal)


def test_global_out_lse_gives_partial_grads(small_tiles):
    """Backward of each key half with the GLOBAL out/lse sums to the full gradients (ring use)."""
    B, Sq, Sk, H, D = 1, 48, 64, 4, 8
    q, k, v, dout, g = _inputs(B, Sq, Sk, H, 2, D, torch.float64, seed=5)
    qp, qs = packed_meta(B, Sq, g, min_len=3, max_len=40, restart=False, pad=3)
    kp, ks = packed_meta(B, Sk, g, min_len=3, max_len=40, restart=False, pad=2)
    meta = meta_of(qp, kp, qs, ks, True, 1 / math.sqrt(D))
    out, lse = small_tiles.forward(q, k, v, meta)
    full = small_tiles.backward(dout, q, k, v, out, lse, meta)
    h = Sk // 2
    parts = [
        small_tiles.backward(
            dout, q, k[:, a:b], v[:, a:b], out, lse, meta.with_keys(meta.keys.span(a, b))
        )
        for a, b in ((0, h), (h, Sk))
    ]
    torch.testing.assert_close(parts[0][0] + parts[1][0], full[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(
        torch.cat([parts[0][1], parts[1][1]], 1), full[1], rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        torch.cat([parts[0][2], parts[1][2]], 1), full[2], rtol=0, atol=1e-12
    )
    truth = reference(q, k, v, meta, dout, upcast=True)
    for got, t in zip(full, truth[1:]):
        torch.testing.assert_close(got, t, rtol=0, atol=1e-10)


def test_fully_masked_rows_are_empty(small_tiles):
    """Padding queries and queries whose only keys are elsewhere: out = 0, lse = -inf, zero grads."""
    q, k, v, dout, _ = _inputs(1, 32, 32, 2, 2, 8, torch.float32, seed=7)
    pos = torch.arange(32)[None]
    seg = torch.zeros(1, 32, dtype=torch.long)
    seg[:, 20:] = -1  # padding
    meta = AttentionMeta.self_attention(pos, seg, scale=0.3)
    out, lse = small_tiles.forward(q, k, v, meta)
    assert (out[:, 20:] == 0).all() and torch.isneginf(lse[:, :, 20:]).all()
    assert torch.isfinite(lse[:, :, :20]).all()
    dq, dk, dv = small_tiles.backward(dout, q, k, v, out, lse, meta)
    assert (dq[:, 20:] == 0).all() and (dk[:, 20:] == 0).all() and (dv[:, 20:] == 0).all()
    assert dq[:, :20].abs().sum() > 0


def test_zigzag_chunk_pairs_take_fast_paths():
    """In the ring layout every chunk pair is full, aligned-causal or skipped: no masked tiles."""
    be = CpuBackend(tile=16, min_tile=4)
    c = 24  # chunk length; rank 0 of 2 holds chunks 0 and 3, rank 1 holds chunks 1 and 2
    r0 = torch.cat([torch.arange(0, c), torch.arange(3 * c, 4 * c)])[None]
    r1 = torch.cat([torch.arange(c, 2 * c), torch.arange(2 * c, 3 * c)])[None]
    seg = torch.zeros(1, 2 * c, dtype=torch.long)
    kinds = []
    for qp, kp in ((r0, r0), (r0, r1), (r1, r0), (r1, r1)):
        meta = meta_of(qp, kp, seg, seg)
        kinds += [kind for _, pairs in be._plan(meta) for _, kind, _ in pairs]
    assert MASKED not in kinds and CAUSAL in kinds and FULL in kinds
    # rank 1's chunks 1 and 2 are consecutive, so they form one run: the local block is one causal tile
    assert len(make_tiles(Side(r1, seg), 1024, 4)) == 1


def test_short_runs_are_pooled():
    pos, seg = packed_meta(1, 200, torch.Generator().manual_seed(0), min_len=1, max_len=3)
    tiles = make_tiles(Side(pos, seg), tile=64, min_tile=16)
    assert len(tiles) <= 200 // 16 + 2
    assert [t.start for t in tiles][0] == 0 and tiles[-1].stop == 200
    assert all(a.stop == b.start for a, b in zip(tiles, tiles[1:]))


def test_lse_merge_matches_joint_softmax():
    """Merging two halves' (out, lse) equals attention over all keys; empty rows stay empty."""
    q, k, v, _, _ = _inputs(1, 16, 32, 2, 2, 8, torch.float64, seed=11)
    be = get_backend("torch")
    pos_q, seg_q = torch.arange(100, 116)[None], torch.zeros(1, 16, dtype=torch.long)
    seg_q[:, -2:] = -1
    kp, ks = torch.arange(32)[None], torch.zeros(1, 32, dtype=torch.long)
    meta = meta_of(pos_q, kp, seg_q, ks, False, 0.5)
    full_o, full_l = be.forward(q, k, v, meta)
    o, l = be.forward(q, k[:, :16], v[:, :16], meta.with_keys(meta.keys.span(0, 16)))
    o2, l2 = be.forward(q, k[:, 16:], v[:, 16:], meta.with_keys(meta.keys.span(16, 32)))
    lse_merge_(o, l, o2, l2)
    torch.testing.assert_close(o, full_o, rtol=0, atol=1e-13)
    torch.testing.assert_close(l, full_l, rtol=0, atol=1e-13)
    big = l + 1e4  # a huge lse must not overflow: the weights are exp(x - max) <= 1
    o3 = o.clone()
    lse_merge_(o3, big.clone(), o, big)
    torch.testing.assert_close(o3, o, rtol=0, atol=1e-10)


def test_plan_kept_in_an_attention_plan(small_tiles):
    """The host tile plan is built once per metadata object for every call with it (forward and
    backward, several layers), and the results are the same bits as with a fresh object a call."""
    q, k, v, dout, g = _inputs(1, 40, 40, 4, 2, 8, torch.float32, seed=13)
    pos, seg = packed_meta(1, 40, g, min_len=3, max_len=20, restart=True, pad=2)
    meta = AttentionMeta.self_attention(pos, seg, scale=0.3)
    for _ in range(2):
        out, lse = small_tiles.forward(q, k, v, meta)
        grads = small_tiles.backward(dout, q, k, v, out, lse, meta)
    assert meta.plans.builds == 1
    fresh = lambda: AttentionMeta.self_attention(pos, seg, scale=0.3)  # noqa: E731
    out0, lse0 = small_tiles.forward(q, k, v, fresh())
    grads0 = small_tiles.backward(dout, q, k, v, out0, lse0, fresh())
    assert torch.equal(out, out0) and all(torch.equal(a, b) for a, b in zip(grads, grads0))
