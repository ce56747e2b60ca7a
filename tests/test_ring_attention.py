"""Ring attention against the float64 single-process reference on the unsharded sequence.

One spawned world of 4 gloo ranks runs every case: rings of W = 1, 2, 4 (dp x sp meshes) and W = 3
(a group of ranks 0-2). Inputs are made on rank 0 and broadcast; each rank computes the reference
on the whole sequence and slices it with the production layout function (shard_sequence); out, dq,
dk, dv must be within 2 x the error of the same-dtype single-process computation + 1e-6.
"""

import time

import pytest
import torch
import torch.distributed as dist
from attn_cases import assert_within, max_err, meta_of, reference
from distributed import run_ranks

from longvideo.configtools import ConfigError
from longvideo.kernels import AttentionMeta, Side, visibility
from longvideo.parallel import (
    CommStats,
    Mesh,
    block_is_empty,
    layout_positions,
    ring_attention,
    shard_batch,
    shard_sequence,
    unshard_sequence,
    zigzag_indices,
)

# ---- single-process pieces ------------------------------------------------------------------


def test_zigzag_indices_cover_the_sequence_once():
    for W in (1, 2, 3, 4):
        idx = torch.cat([zigzag_indices(8 * W, W, r) for r in range(W)])
        assert sorted(idx.tolist()) == list(range(8 * W))
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]


def test_world_of_one_layout_and_errors():
    x = torch.arange(10)[None]
    assert torch.equal(shard_sequence(x, None, dim=1), x)  # W = 1 without distributed: identity
    assert torch.equal(unshard_sequence(x, None, dim=1, length=7), x[:, :7])
    assert torch.equal(
        shard_sequence(torch.arange(5)[None], None, pad_value=-1),
        torch.tensor([[0, 1, 2, 3, 4, -1]]),
    )
    with pytest.raises(ValueError, match="not a multiple of 2 x sp = 2; pass pad_value"):
        shard_sequence(torch.arange(5)[None], None)
    assert layout_positions(6, None).tolist() == list(range(6))


def test_mesh_without_distributed():
    m = Mesh.build()
    assert (m.world_size, m.dp, m.sp, m.sp_rank) == (1, 1, 1, 0)
    with pytest.raises(ConfigError, match="dp=1 x sp=2 needs 2 ranks"):
        Mesh.build(dp=1, sp=2)
    with pytest.raises(ConfigError, match="must be >= 1"):
        Mesh.build(sp=0)


def test_shard_batch_pads_and_adds_metadata():
    batch = {
        "input_ids": torch.arange(1, 6)[None],
        "targets": torch.arange(2, 7)[None],
        "loss_weights": torch.ones(1, 5),
    }
    out = shard_batch(batch, None)  # world of one: pad 5 -> 6
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0]]
    assert out["loss_weights"].tolist() == [[1, 1, 1, 1, 1, 0]]
    assert out["segment_ids"].tolist() == [[0, 0, 0, 0, 0, -1]]
    assert out["positions"].tolist() == [[0, 1, 2, 3, 4, 0]]
    with pytest.raises(ValueError, match="no pad value for batch key 'extra'"):
        shard_batch({**batch, "extra": torch.zeros(1, 5)}, None)
    with pytest.raises(ValueError, match="expected \\(B, S, ...\\)"):
        shard_batch({**batch, "targets": torch.zeros(1, 4)}, None)


def test_block_is_empty_never_skips_visible_pairs():
    g = torch.Generator().manual_seed(0)
    skipped = 0
    for _ in range(300):

        def meta():  # a block of shuffled positions after a random offset, two adjacent segments
            base = torch.randint(0, 16, (2, 1), generator=g)
            pos = base + torch.stack([torch.randperm(8, generator=g) for _ in range(2)])
            seg = torch.randint(-1, 3, (2, 1), generator=g) + torch.randint(
                0, 2, (2, 8), generator=g
            )
            return pos, seg

        (qp, qs), (kp, ks) = meta(), meta()
        causal = bool(torch.randint(0, 2, (1,), generator=g))
        if block_is_empty(meta_of(qp, kp, qs, ks, causal)):
            skipped += 1
            assert not visibility(Side(qp, qs), Side(kp, ks), causal).any()
    assert skipped > 0
    pos = torch.arange(8)[None]
    seg = torch.zeros(1, 8, dtype=torch.long)
    assert block_is_empty(meta_of(pos, pos + 8, seg, seg)) and not block_is_empty(
        meta_of(pos + 8, pos, seg, seg)
    )
    assert block_is_empty(meta_of(pos, pos, seg, seg - 1, False))  # keys are all padding


def test_ring_attention_rejects_bad_shapes():
    q = torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        ring_attention(q, torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8), group=None)
    with pytest.raises(ValueError, match="needs Sq == Sk"):
        ring_attention(q, torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8), group=None)
    short = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="positions must have shape"):
        ring_attention(q, q, q, AttentionMeta.self_attention(short, short), group=None)


# ---- the distributed cases ------------------------------------------------------------------


def _broadcast(t, group):
    """Rank 0 of the ring makes the inputs; every rank of the ring uses its copy."""
    dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
    return t


def _make_case(group, kind, S, W, Hq, Hkv, dtype, seed, D=8):
    """Full-sequence inputs, broadcast from rank 0. Returns q, k, v, dout, positions, segments
    (metadata None where the ring's defaults are meant to be used)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (
        _broadcast(torch.randn(1, S, h, D, generator=g), group).to(dtype)
        for h in (Hq, Hkv, Hkv, Hq)
    )
    q, k, v, dout = (torch.stack([x[0], x[0].flip(0)]) for x in (q, k, v, dout))  # B = 2
    if kind == "plain":
        return q, k, v, dout, None, None
    if kind == "uneven":  # default positions, explicit single segment (padding added by sharding)
        return q, k, v, dout, None, torch.zeros(2, S, dtype=torch.long)
    # packed documents: one longer than a shard, others shorter than a chunk, positions restarting
    shard = -(-S // W)
    lengths = [shard + 3, 1, 2]
    while sum(lengths) < S:
        lengths.append(int(torch.randint(1, max(2, S // (2 * W)), (1,), generator=g)))
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[:S]
    pos = torch.cat([torch.arange(n) for n in lengths])[:S]
    seg2 = torch.cat([torch.full((n,), i) for i, n in enumerate(reversed(lengths))])[:S]
    pos2 = torch.cat([torch.arange(n) for n in reversed(lengths)])[:S]
    seg, pos = (
        _broadcast(torch.stack([seg, seg2]), group),
        _broadcast(torch.stack([pos, pos2]), group),
    )
    return q, k, v, dout, pos, seg


def _run_case(group, W, kind, causal, heads, dtype, backend, seed, D=8):
    S = {"plain": 8 * W, "uneven": 8 * W + 3, "packed": 9 * W + 5}[kind]
    q, k, v, dout, pos, seg = _make_case(group, kind, S, W, heads[0], heads[1], dtype, seed, D)
    whole = AttentionMeta.self_attention(
        torch.arange(S).expand(2, S) if pos is None else pos,
        torch.zeros(2, S, dtype=torch.long) if seg is None else seg,
        causal=causal,
    )
    truth = reference(q, k, v, whole, dout, upcast=True)
    plain = reference(q, k, v, whole, dout, upcast=False)

    def local(x, pad=0):
        return None if x is None else shard_sequence(x, group, dim=1, pad_value=pad)

    local_q, local_k, local_v = (local(x).requires_grad_(True) for x in (q, k, v))
    S_local = local_q.shape[1]
    if pos is None and seg is None and causal:
        shard = None  # the ring's defaults: the layout's positions, one segment, causal
    else:
        shard = AttentionMeta.self_attention(
            layout_positions(S_local, group).expand(2, S_local) if pos is None else local(pos),
            torch.zeros(2, S_local, dtype=torch.long) if seg is None else local(seg, pad=-1),
            causal=causal,
        )
    stats = CommStats()
    out = ring_attention(
        local_q, local_k, local_v, shard, group=group, backend=backend, comm_stats=stats
    )
    out.backward(local(dout))
    what = f"W={W} {kind} causal={causal} heads={heads} {dtype} {backend}"
    real = local(torch.ones(2, S)).bool()  # (B, S_local): False on padding
    grads = (local_q.grad, local_k.grad, local_v.grad)
    for name, got, t, p in zip(("out", "dq", "dk", "dv"), (out, *grads), truth, plain):
        assert got.dtype == dtype, f"{what}: {name} dtype {got.dtype}"
        assert_within(f"{what}: {name}", got, local(t), local(p))
        assert (got[~real] == 0).all(), f"{what}: {name} is non-zero on padding"
    # the full tensors, reassembled, agree as well
    full = unshard_sequence(out.detach(), group, dim=1, length=S)
    assert max_err(full, truth[0]) <= 2 * max_err(plain[0], truth[0]) + 1e-6, what
    hops = 0 if W == 1 else (W - 1) + (W - 1) + W  # kv forward, kv backward, dkv home
    assert stats.hops == hops, f"{what}: {stats.hops} hops"


def _check_meshes(rank, world):
    m = Mesh.build(dp=2, sp=2)
    peers = [torch.zeros(1, dtype=torch.long) for _ in range(2)]
    dist.all_gather(peers, torch.tensor([rank]), group=m.sp_group)
    assert [int(p) for p in peers] == [rank // 2 * 2, rank // 2 * 2 + 1]  # neighbouring ranks
    dist.all_gather(peers, torch.tensor([rank]), group=m.dp_group)
    assert [int(p) for p in peers] == [rank % 2, rank % 2 + 2]
    assert (m.dp_rank, m.sp_rank) == (rank // 2, rank % 2)
    try:
        Mesh.build(dp=3, sp=2)
    except ConfigError as e:
        assert "does not match the world size 4" in str(e)
    else:
        raise AssertionError("dp x sp != world did not raise")
    try:
        Mesh.build(sp=3)
    except ConfigError as e:
        assert "does not divide the world size 4" in str(e)
    else:
        raise AssertionError("sp not dividing the world did not raise")
    return m


def _contiguous_layout_skips_blocks(group, W, rank):
    """Any layout works when positions travel with the blocks; causal contiguous shards let rank 0
    skip every visiting block (all its keys come later)."""
    g = torch.Generator().manual_seed(1)
    S = 6 * W
    q, k, v = (
        _broadcast(torch.randn(1, S, 2, 8, generator=g, dtype=torch.float64), group)
        for _ in range(3)
    )
    whole = AttentionMeta.default(q, k)
    truth, _ = reference(q, k, v, whole, torch.ones_like(q), upcast=True)[:2]
    n = S // W
    sl = slice(rank * n, (rank + 1) * n)
    stats = CommStats()
    shard = AttentionMeta.self_attention(
        torch.arange(S)[None, sl], torch.zeros(1, n, dtype=torch.long)
    )
    out = ring_attention(
        q[:, sl], k[:, sl], v[:, sl], shard, group=group, backend="cpu", comm_stats=stats
    )
    assert max_err(out, truth[:, sl]) < 1e-12
    assert stats.skipped == W - 1 - rank and stats.blocks == rank + 1


def _body(rank, world, backends):
    torch.manual_seed(0)
    mesh22 = _check_meshes(rank, world)
    mesh14 = Mesh.build(dp=1, sp=4)
    mesh41 = Mesh.build(dp=4, sp=1)
    ring3 = dist.new_group([0, 1, 2])  # collective: every rank creates it
    groups = [
        (1, mesh41.sp_group),
        (2, mesh22.sp_group),
        (3, ring3 if rank < 3 else None),
        (4, mesh14.sp_group),
    ]
    seed = 0
    for W, group in groups:
        if group is None:
            dist.barrier()
            continue
        t0 = time.perf_counter()
        assert dist.get_world_size(group) == W
        for kind in ("plain", "uneven", "packed"):
            for causal in (True, False):
                for heads in ((4, 4), (4, 2)):
                    for dtype in (torch.float32, torch.bfloat16):
                        seed += 1
                        _run_case(group, W, kind, causal, heads, dtype, backends[seed % 2], seed)
        if W > 1:
            _contiguous_layout_skips_blocks(group, W, dist.get_rank(group))
        # extra backends (e.g. the Triton kernel under the interpreter) on one small case each
        for be in backends[1:] if W == 2 else ():
            _run_case(group, W, "packed", True, (4, 2), torch.float32, be, 99, D=16)
        if rank == 0:
            print(f"W={W}: {time.perf_counter() - t0:.1f} s", flush=True)
        dist.barrier()  # rank 3 waits out the W = 3 ring


def _backends():
    found = ["cpu", "torch"]
    try:
        from longvideo.kernels import get_backend

        get_backend("triton")
        found.append("triton")
    except Exception:  # noqa: BLE001 - the kernel is optional on CPU-only installs
        pass
    return found


@pytest.mark.slow
@pytest.mark.distributed
def test_ring_attention_matches_unsharded_reference():
    run_ranks(_body, world=4, args=(_backends(),), timeout=240)
