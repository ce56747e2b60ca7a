"""longvideo.parallel.compile: compiled blocks with an opaque attention seam.

One graph per block and no graph break (torch._dynamo.explain), the seam in it as one custom op;
the compiled model's loss and gradients equal the eager model's; the layers of a compiled step
still share one tile plan; the ring seam is opaque as well (W = 2).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from longvideo.kernels import AttentionMeta
from longvideo.model import ModelConfig, Transformer
from longvideo.model.attention import LocalAttention
from longvideo.parallel import RingAttentionSeam, shard_batch
from longvideo.parallel.compile import OpaqueSeam, apply_compile


def _model(seed=0, layers=2):
    torch.manual_seed(seed)
    cfg = ModelConfig(
        text_vocab_size=40,
        codebook_size=20,
        dim=32,
        n_layers=layers,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=128,
        init_std=0.1,
    )
    model = Transformer(cfg).train()
    model.set_attention(LocalAttention("auto"))
    return model


def _batch(S=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 60, (2, S), generator=g)
    pos = torch.cat([torch.arange(S // 3), torch.arange(S - S // 3)]).expand(2, S)
    seg = (torch.arange(S) >= S // 3).long().expand(2, S)
    return ids, pos, seg


def _loss_and_grads(model, ids, pos, seg):
    model.zero_grad(set_to_none=True)
    loss = (
        model(ids, pos, seg).float().pow(2).mean()
    )  # hidden states: any loss of them reaches every block
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def test_one_graph_per_block_no_graph_break():
    model = _model()
    seam = OpaqueSeam(model.attention_fn)
    ids, pos, seg = _batch()
    x = model.tok_embeddings(ids)
    cos, sin = model.rope(pos, x.dtype)
    meta = AttentionMeta.self_attention(pos, seg)
    ex = torch._dynamo.explain(model.layers[0])(x, cos, sin, meta, seam)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
    targets = [str(n.target) for g in ex.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert sum("seam_attention" in t for t in targets) == 1, targets
    # the seam without the wrapper is not opaque: Dynamo traces into its host-side planning and breaks
    fresh = AttentionMeta.self_attention(pos, seg)  # its plans not built yet
    ex = torch._dynamo.explain(model.layers[0])(x, cos, sin, fresh, model.attention_fn)
    assert ex.graph_break_count > 0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_model_matches_eager(checkpointing):
    """aot_eager runs the same decompositions as inductor's front end without code generation:
    losses and gradients equal the eager model's (fp32, within rounding)."""
    eager, compiled = _model(), _model()
    for m in (
        (eager, compiled) if checkpointing else ()
    ):  # blocks wrapped from outside, as parallelize does
        for i, block in enumerate(m.layers):
            m.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    names = [n for n, _ in compiled.named_parameters()]
    apply_compile(compiled, backend="aot_eager")
    assert (
        isinstance(compiled.attention_fn, OpaqueSeam)
        and [n for n, _ in compiled.named_parameters()] == names
    )
    batch = _batch()
    for _ in range(2):  # the second step runs the cached graphs
        (le, ge), (lc, gc) = _loss_and_grads(eager, *batch), _loss_and_grads(compiled, *batch)
        torch.testing.assert_close(lc, le, rtol=1e-6, atol=1e-7)
        for n in ge:
            torch.testing.assert_close(gc[n], ge[n], rtol=1e-5, atol=1e-7, msg=n)
    built = [meta.plans.builds for meta in compiled.attention_fn.recent.values()]
    # one metadata object a step, one dispatch choice for every layer of it, forward and backward
    assert built == [1, 1], built


@pytest.mark.slow
def test_inductor_compiles_and_matches():
    eager, compiled = _model(layers=1), _model(layers=1)
    apply_compile(compiled)
    batch = _batch()
    (le, ge), (lc, gc) = _loss_and_grads(eager, *batch), _loss_and_grads(compiled, *batch)
    torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
    for n in ge:
        torch.testing.assert_close(gc[n], ge[n], rtol=1e-4, atol=1e-6, msg=n)


def test_rejects_what_it_cannot_make_opaque():
    with pytest.raises(TypeError, match="cannot make"):
        OpaqueSeam(lambda *a, **k: None)
    with pytest.raises(TypeError, match="no attention seam"):
        apply_compile(torch.nn.Linear(2, 2))


def _ring_body(rank, world):
    group = dist.group.WORLD
    eager, compiled = _model(), _model()
    for m in (eager, compiled):
        m.set_attention(RingAttentionSeam(group, "auto"))
    apply_compile(compiled, backend="aot_eager")
    ids, pos, seg = _batch(S=40)
    local = shard_batch({"input_ids": ids, "positions": pos, "segment_ids": seg}, group)
    for model in (eager, compiled):
        _loss_and_grads(model, local["input_ids"], local["positions"], local["segment_ids"])
    for (n, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=f"rank {rank} {n}")


@pytest.mark.distributed
def test_ring_seam_is_opaque_too():
    run_ranks(_ring_body, world=2, timeout=240)


def _trainer_body(rank, world, tmp):
    import json
    from pathlib import Path

    from longvideo.config import load_config
    from longvideo.train.trainer import Trainer

    overrides = [
        "model.text_vocab_size=64",
        "model.codebook_size=16",
        "vq.codebook_size=16",
        "model.dim=32",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.multiple_of=16",
        "runtime.ffn_chunk=0",
        "runtime.loss_chunk=0",
        "data.seq_len=62",
        "train.synthetic_vocab=32",
        "train.lr=3e-3",
        "train.warmup_steps=1",
        "train.steps=3",
        "train.micro_batch_size=1",
        "train.grad_accum=1",
        "train.zero_stage=2",
        "train.checkpoint_every=100",
        "parallel.sp=2",
        "parallel.timeout_s=120",
        "parallel.backend=cpu",
        "train.progress=false",
        "train.tensorboard=false",
        "train.plot=false",
    ]
    losses = {}
    for flag in ("false", "true"):
        t = Trainer(
            load_config(
                None, overrides + [f"runtime.compile={flag}", f"train.out_dir={tmp}/{flag}"]
            )
        )
        assert isinstance(t.model.attention_fn, OpaqueSeam) == (flag == "true")
        losses[flag] = t.run().losses
    if rank == 0:
        Path(f"{tmp}/losses.json").write_text(json.dumps(losses))


@pytest.mark.slow
@pytest.mark.distributed
def test_runtime_compile_through_the_trainer_trains_the_same_losses(tmp_path):
    """runtime.compile=true: parallelize compiles the blocks (inductor) under ZeRO-2 over a ring of
    2; three optimizer steps give the eager run's losses."""
    import json

    run_ranks(_trainer_body, world=2, args=(str(tmp_path),), timeout=600)
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert len(losses["true"]) == 3
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-4), losses


def test_compile_refuses_the_ulysses_hybrid():
    from longvideo.configtools import ConfigError

    model = _model()
    seam = RingAttentionSeam(None, "cpu", ulysses=object())
    with pytest.raises(ConfigError, match="runtime.compile"):
        OpaqueSeam(seam)
    assert isinstance(model.attention_fn, LocalAttention)


def test_runtime_compile_refuses_zero3_by_name():
    from types import SimpleNamespace

    from longvideo.configtools import ConfigError
    from longvideo.parallel import parallelize

    cfg = SimpleNamespace(
        parallel=SimpleNamespace(backend="cpu"),
        runtime=SimpleNamespace(activation_checkpointing=False, compile=True),
    )
    mesh = SimpleNamespace(sp=1, ulysses=1, sp_group=None, ulysses_groups=None, world_size=1)
    with pytest.raises(ConfigError, match="runtime.compile.*ZeRO-3"):
        parallelize(
            _model(), mesh, cfg, optimizer=None, ds_config={"zero_optimization": {"stage": 3}}
        )
