"""Hybrid sequence parallelism (Ulysses all-to-all inside groups of U ranks, the ring across them)
against single-process float64 references.

Two spawned worlds of 4 gloo ranks:

* attention: the (U, ring) splits 2x2 and 4x1 of W = 4 and 3x1 of W = 3 (1xW is the ring,
  tests/test_ring_attention.py) on plain, padded and packed sequences, causal and not, with heads
  4/4, 4/1 (key/value heads fewer than U), 6/2 and 5/5 (query heads not a multiple of U), float32
  and bfloat16: out, dq, dk, dv within 2x the error of the same-dtype single-process computation
  (+ 1e-6 x the tensor's largest value);
* the trainer (`longvideo train` through parallelize) under ZeRO-3 at sp = 4: the project decoder
  with 6/2 heads at ulysses = 2 and 4 gives the float64 single-process gradients of the first step
  and the losses of the pure ring; a transformers Qwen2 with SmolLM2's 9/3 heads trains to the
  same losses at ulysses = 1, 2 and 4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from attn_cases import assert_within, reference
from distributed import run_ranks
from safetensors.torch import load_file, save_file
from test_ring_attention import _make_case
from test_train_distributed import TINY, assert_grads_match, full_grads, reference_grads

from longvideo.config import load_config
from longvideo.configtools import ConfigError
from longvideo.kernels import AttentionMeta
from longvideo.model import ModelConfig, Transformer
from longvideo.parallel import (
    CommStats,
    Mesh,
    apply_attention,
    head_split,
    hybrid_attention,
    shard_sequence,
    split_group,
)


def test_head_split_pads_queries_replicates_kv_and_names_what_fits():
    assert head_split(8, 4, 2)[0] == 4 and head_split(8, 4, 2)[1].tolist() == [
        0,
        1,
        2,
        3,
    ]  # nothing to do
    qu, idx = head_split(
        12, 2, 4
    )  # Qwen2-1.5B: 3 queries a member, each member reads 1 replicated head
    assert qu == 3 and idx.tolist() == [0, 0, 1, 1]
    qu, idx = head_split(
        9, 3, 2
    )  # SmolLM2: 9 -> 10 queries; 5 a member, reading kv heads 0 0 0 1 1 | 1 2 2 2 2
    assert qu == 5 and idx.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    for hq, hkv, u in ((9, 3, 2), (9, 3, 4), (12, 2, 4), (6, 2, 4), (4, 1, 4), (5, 5, 2)):
        qu, idx = head_split(hq, hkv, u)
        per = idx.numel() // u
        for h in range(hq):  # every real query head reads its own key/value head
            m, j = divmod(h, qu)
            assert idx[m * per + j * per // qu].item() == h // (hq // hkv), (hq, hkv, u, h)
    with pytest.raises(
        ValueError,
        match=r"ulysses=8 exceeds the model's 4 query heads \(2 key/value heads\); "
        r"use ulysses in \[1, 2, 4\]",
    ):
        head_split(4, 2, 8, sp=8)


def _run_split(groups, sp_group, kind, causal, heads, dtype, backend, seed):
    W = dist.get_world_size(sp_group)
    S = {"plain": 8 * W, "uneven": 8 * W + 3, "packed": 9 * W + 5}[kind]
    q, k, v, dout, pos, seg = _make_case(sp_group, kind, S, W, heads[0], heads[1], dtype, seed)
    pos = torch.arange(S).expand(2, S) if pos is None else pos
    seg = torch.zeros(2, S, dtype=torch.long) if seg is None else seg
    whole = AttentionMeta.self_attention(pos, seg, causal=causal)
    truth = reference(q, k, v, whole, dout, upcast=True)
    plain = reference(q, k, v, whole, dout, upcast=False)

    def local(x, pad=0):  # the ordinary zigzag shard over the whole sp group
        return shard_sequence(x, sp_group, dim=1, pad_value=pad)

    local_q, local_k, local_v = (local(x).requires_grad_(True) for x in (q, k, v))
    shard = AttentionMeta.self_attention(local(pos), local(seg, -1), causal=causal)
    if kind == "plain" and causal:
        shard = None  # the hybrid's defaults: the layout's positions over the sp group, as above
    stats = CommStats()
    out = hybrid_attention(
        local_q, local_k, local_v, shard, group=groups, backend=backend, comm_stats=stats
    )
    out.backward(local(dout))
    what = f"U={groups.size} x ring {W // groups.size} {kind} causal={causal} heads={heads} {dtype} {backend}"
    real = local(torch.ones(2, S)).bool()
    grads = (local_q.grad, local_k.grad, local_v.grad)
    for name, got, t, p in zip(("out", "dq", "dk", "dv"), (out, *grads), truth, plain):
        assert got.dtype == dtype, f"{what}: {name} dtype {got.dtype}"
        # eps relative to the tensor's size, as in test_hf_ring: the single-device kernels on the whole
        # sequence are themselves 1.55e-6 off (|dk| 3.8, 2 x base + 1e-6 = 1.54e-6) on one of these cases
        assert_within(
            f"{what}: {name}", got, local(t), local(p), eps=1e-6 * max(1.0, t.abs().max().item())
        )
        assert (got[~real] == 0).all(), f"{what}: {name} is non-zero on padding"
    R = W // groups.size
    assert stats.hops == (0 if R == 1 else 3 * R - 2), f"{what}: {stats.hops} ring hops"


def _attention_body(rank, world):
    mesh22, mesh41 = Mesh.build(sp=4, ulysses=2), Mesh.build(sp=4, ulysses=4)
    assert mesh22.ulysses_groups.size == 2 and "ulysses=2" in repr(mesh22)
    peers = [torch.zeros(1, dtype=torch.long) for _ in range(2)]
    dist.all_gather(peers, torch.tensor([rank]), group=mesh22.ulysses_groups.group)
    assert [int(p) for p in peers] == [
        rank // 2 * 2,
        rank // 2 * 2 + 1,
    ]  # neighbouring ranks exchange heads
    dist.all_gather(peers, torch.tensor([rank]), group=mesh22.ulysses_groups.ring)
    assert [int(p) for p in peers] == [
        rank % 2,
        rank % 2 + 2,
    ]  # the ring joins the same member of each group
    with pytest.raises(ConfigError, match="ulysses"):
        Mesh.build(sp=4, ulysses=3)
    two_heads = Transformer(
        ModelConfig(
            text_vocab_size=8,
            codebook_size=8,
            dim=16,
            n_layers=1,
            n_heads=2,
            n_kv_heads=1,
            multiple_of=16,
            max_seq_len=16,
        )
    )
    with pytest.raises(
        ConfigError,
        match=r"parallel.ulysses.*2 query heads \(1 key/value heads\); use ulysses in \[1, 2\]",
    ):
        apply_attention(two_heads, mesh41)  # before any step
    # W = 3: only ranks 0-2 make and use its groups, so it runs last (no world-wide group after it)
    ring3 = dist.new_group([0, 1, 2])
    splits = [(mesh22.ulysses_groups, mesh22.sp_group), (mesh41.ulysses_groups, mesh41.sp_group)]
    if rank < 3:
        splits.append((split_group(ring3, 3), ring3))
    seed = 0
    for groups, sp_group in splits:
        for kind in ("plain", "uneven", "packed"):
            for causal in (True, False) if kind == "packed" else (True,):
                for heads in ((4, 4), (4, 1), (6, 2), (5, 5)):
                    for dtype in (torch.float32, torch.bfloat16):
                        seed += 1
                        _run_split(
                            groups,
                            sp_group,
                            kind,
                            causal,
                            heads,
                            dtype,
                            ("cpu", "torch")[seed % 2],
                            seed,
                        )


@pytest.mark.slow
@pytest.mark.distributed
def test_hybrid_splits_of_4_and_3_match_float64_reference():
    run_ranks(_attention_body, world=4, timeout=300)


# ---- the trainer ------------------------------------------------------------------------------

DECODER = [o for o in TINY if not o.startswith(("model.dim", "model.n_heads"))] + [
    "model.dim=48",
    "model.n_heads=6",
    "parallel.sp=4",
    "parallel.timeout_s=60",
    "train.zero_stage=3",
    "train.grad_accum=2",
    "train.steps=3",
    "train.checkpoint_every=100",
]


def _hf_overrides(path: str) -> list[str]:
    return [
        f"train.hf_model={path}",
        "model.text_vocab_size=48",
        "model.codebook_size=16",
        "vq.codebook_size=16",
        "runtime.loss_chunk=40",
        "data.seq_len=94",
        "train.synthetic_vocab=48",
        "train.lr=1e-3",
        "train.warmup_steps=1",
        "train.steps=3",
        "train.micro_batch_size=1",
        "train.grad_accum=2",
        "train.zero_stage=3",
        "train.checkpoint_every=100",
        "parallel.sp=4",
        "parallel.timeout_s=60",
        "parallel.backend=cpu",
        "train.progress=false",
        "train.tensorboard=false",
        "train.plot=false",
    ]


def _train(overrides, u, out, grads=False):
    from longvideo.train.trainer import Trainer

    t = Trainer(load_config(None, overrides + [f"parallel.ulysses={u}", f"train.out_dir={out}"]))
    assert (t.mesh.sp, t.mesh.ulysses, t.zero_stage) == (4, u, 3)
    assert (t.mesh.ulysses_groups is None) == (u == 1)
    stats = t.forward_backward(t.next_micro_batches())
    g = full_grads(t) if grads else None
    first = t.optimizer_step(stats)
    result = t.run()
    assert result.step == 3
    return [first["loss"]] + result.losses, g


def _trainer_body(rank, world, tmp, hf_path):
    report = {}
    for u in (1, 2, 4):
        losses, grads = _train(DECODER, u, f"{tmp}/decoder{u}", grads=u > 1)
        report[f"decoder{u}"] = losses
        if grads is not None and rank == 0:
            save_file(grads, f"{tmp}/grads{u}.safetensors")
        report[f"hf{u}"] = _train(_hf_overrides(hf_path), u, f"{tmp}/hf{u}")[0]
    if rank == 0:
        Path(f"{tmp}/losses.json").write_text(json.dumps(report))


@pytest.mark.slow
@pytest.mark.distributed
def test_trainer_under_zero3_at_ulysses_2_and_4_matches_one_process_and_the_ring(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = tmp_path / "qwen2_9_heads"  # SmolLM2's heads: 9 queries, 3 key/value heads
    Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=50,
            hidden_size=72,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=256,
            use_sliding_window=False,
        )
    ).save_pretrained(str(hf))
    run_ranks(_trainer_body, world=4, args=(str(tmp_path), str(hf)), timeout=600)
    losses = json.loads((tmp_path / "losses.json").read_text())
    ref_loss, ref = reference_grads(DECODER, dp=1)
    for u in (2, 4):
        assert losses[f"decoder{u}"][0] == pytest.approx(ref_loss, rel=1e-6)
        assert_grads_match(load_file(str(tmp_path / f"grads{u}.safetensors")), ref)
        for kind in ("decoder", "hf"):
            assert losses[f"{kind}{u}"] == pytest.approx(losses[f"{kind}1"], rel=1e-5), (
                kind,
                u,
                losses,
            )
    assert losses["hf1"][-1] < losses["hf1"][0]  # it trains
