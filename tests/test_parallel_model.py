"""The whole decoder under dp=2 x sp=2 gives the loss and parameter gradients of one process on the
whole batch (docs/architecture.md, decision 6): ring attention over the sp pair, zigzag-sharded inputs, and the
loss normalised by the global weight total."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from longvideo.model import LocalAttention, ModelConfig, Transformer, token_weights
from longvideo.parallel import (
    Mesh,
    RingAttentionSeam,
    apply_activation_checkpointing,
    apply_attention,
    normalized_loss,
    shard_batch,
)
from longvideo.parallel.engine import own_name

CFG = dict(
    text_vocab_size=60,
    codebook_size=16,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    multiple_of=16,
    max_seq_len=64,
    attn_logn_base=8,
)  # queries past position 7 scaled: the ring gets each shard's global positions


def _batch(B, S, group):
    """Packed rows (documents of random length, positions restarting, padding at the end), made on
    rank 0 and broadcast."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 80, (B, S), generator=g)
    targets = torch.randint(0, 80, (B, S), generator=g)
    weights = torch.randint(0, 3, (B, S), generator=g).float() / 2  # 0, 0.5, 1
    seg = torch.full((B, S), -1)
    pos = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        i, s = 0, 0
        while i < S - 3:  # 3 padding tokens
            n = min(int(torch.randint(2, 20, (1,), generator=g)), S - 3 - i)
            seg[b, i : i + n], pos[b, i : i + n] = s, torch.arange(n)
            i, s = i + n, s + 1
    weights[seg < 0] = 0
    batch = dict(
        input_ids=ids, targets=targets, loss_weights=weights, positions=pos, segment_ids=seg
    )
    for t in batch.values():
        dist.broadcast(t, src=0, group=group)
    return batch


def _model(dtype):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CFG), ffn_chunk=8, loss_chunk=16).to(dtype)
    model.train()
    return model


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _reference(batch, dtype):
    """One process, the whole (B, S) batch, loss normalised by its weight total."""
    model = _model(dtype)
    loss_sum = model(
        batch["input_ids"],
        batch["positions"],
        batch["segment_ids"],
        targets=batch["targets"],
        loss_weights=batch["loss_weights"],
    )
    loss = loss_sum / token_weights(batch["targets"], batch["loss_weights"]).sum()
    loss.backward()
    return loss.detach().double(), _grads(model)


def _sharded(mesh, batch, dtype, checkpointing):
    """dp rank d takes row d, shards it over its sp ring; gradients summed over all ranks."""
    model = _model(dtype)
    apply_attention(model, mesh, "cpu")
    if checkpointing:
        apply_activation_checkpointing(model)
    assert isinstance(model.attention_fn, RingAttentionSeam)
    row = {k: v[mesh.dp_rank : mesh.dp_rank + 1] for k, v in batch.items()}
    local = shard_batch(row, mesh.sp_group)
    assert local["input_ids"].shape[1] == -(-batch["input_ids"].shape[1] // 4) * 4 // 2
    loss_sum = model(
        local["input_ids"],
        local["positions"],
        local["segment_ids"],
        targets=local["targets"],
        loss_weights=local["loss_weights"],
    )
    weight = token_weights(local["targets"], local["loss_weights"]).sum()
    loss, total = normalized_loss(loss_sum, weight, mesh, grad_reduction="sum")
    loss.backward()
    grads = {own_name(n): g for n, g in _grads(model).items()}
    for g in grads.values():
        dist.all_reduce(g, group=mesh.world_group)
    value = loss.detach().double().clone()
    dist.all_reduce(value, group=mesh.world_group)
    assert float(total) == float(batch["loss_weights"].sum())
    return value, grads


def _body(rank, world):
    mesh = Mesh.build(dp=2, sp=2)
    batch = _batch(2, 37, dist.group.WORLD)  # 37: not a multiple of 2 x sp, so rows get padded
    ref64 = _reference(batch, torch.float64)
    ref32 = _reference(batch, torch.float32)
    for checkpointing in (False, True):
        loss, grads = _sharded(mesh, batch, torch.float64, checkpointing)
        torch.testing.assert_close(loss, ref64[0], rtol=1e-12, atol=0)
        for n, g in grads.items():
            torch.testing.assert_close(
                g, ref64[1][n], rtol=1e-9, atol=1e-13, msg=lambda m: f"{n}: {m}"
            )
    # fp32: as close to the float64 truth as 2x the single-process fp32 run, plus a small eps
    loss, grads = _sharded(mesh, batch, torch.float32, False)
    assert abs(float(loss) - float(ref64[0])) <= 2 * abs(float(ref32[0]) - float(ref64[0])) + 1e-6
    for n, g in grads.items():
        err = (g.double() - ref64[1][n]).abs().max().item()
        base = (ref32[1][n].double() - ref64[1][n]).abs().max().item()
        assert err <= 2 * base + 1e-6, f"{n}: fp32 error {err:.3g} > 2 x {base:.3g} + 1e-6"


def test_one_rank_gets_the_local_seam_and_wrapped_blocks():
    model = _model(torch.float32)
    apply_attention(model, Mesh.build(), "torch")
    assert isinstance(model.attention_fn, LocalAttention) and model.attention_fn.backend == "torch"
    names = model.state_dict().keys()
    apply_activation_checkpointing(model)
    apply_activation_checkpointing(model)  # once is enough: blocks are not wrapped twice
    assert all(
        type(b).__name__ == "CheckpointWrapper"
        and not hasattr(b._checkpoint_wrapped_module, "_checkpoint_wrapped_module")
        for b in model.layers
    )
    assert model.state_dict().keys() == names


@pytest.mark.slow
@pytest.mark.distributed
def test_decoder_dp2_sp2_matches_one_process():
    run_ranks(_body, world=4, timeout=240)
