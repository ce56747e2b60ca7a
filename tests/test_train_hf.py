"""`longvideo train` on a transformers model directory (train.hf_model): ring attention over sp = 2 with
ZeRO-3, packed documents; the first step's loss and every gradient equal transformers' own forward
run document by document in float64; checkpoints hold a transformers directory that every tool
reads (load_pretrained: chat, eval, serve, sequence-parallel inference; export) with transformers'
logits; models no tool could read, or the ring could not compute, are named errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from safetensors.torch import load_file, save_file

from longvideo.config import load_config
from longvideo.configtools import ConfigError

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _overrides(path: Path, out: Path) -> list[str]:
    return [
        f"train.hf_model={path}",
        "model.text_vocab_size=48",
        "model.codebook_size=16",
        "vq.codebook_size=16",
        "runtime.activation_checkpointing=true",
        "runtime.loss_chunk=40",
        "data.seq_len=94",
        "train.synthetic_vocab=48",
        "train.lr=1e-3",
        "train.warmup_steps=1",
        "train.steps=2",
        "train.micro_batch_size=1",
        "train.grad_accum=2",
        "train.zero_stage=3",
        "train.checkpoint_every=2",
        "parallel.sp=2",
        "parallel.timeout_s=60",
        "parallel.backend=torch",
        "train.progress=false",
        "train.tensorboard=false",
        "train.plot=false",
        f"train.out_dir={out}",
    ]


def _tiny_llama(path: Path, vocab_size: int = 50, **kw) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        **kw,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(path))


def _train(rank, world, path, out):
    from deepspeed.utils import safe_get_full_grad

    from longvideo.train.trainer import Trainer

    t = Trainer(load_config(None, _overrides(Path(path), Path(out))))
    assert (t.mesh.sp, t.zero_stage) == (2, 3)
    stats = t.forward_backward(t.next_micro_batches())
    grads = {n: safe_get_full_grad(p).detach().cpu().clone() for n, p in t.model.named_parameters()}
    first = t.optimizer_step(stats)
    result = t.run()
    if rank == 0:
        save_file(grads, f"{out}/grads.safetensors")
        Path(f"{out}/loss.txt").write_text(repr(first["loss"]))
    assert result.step == 2


def _reference(path: Path, cfg) -> tuple[float, dict[str, torch.Tensor]]:
    """float64, one process, transformers' own forward on each packed document alone."""
    from transformers import AutoModelForCausalLM

    from longvideo.train.synthetic_tokens import SyntheticTokens

    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").double()
    data = SyntheticTokens(
        seq_len=cfg.data.seq_len, batch_size=1, vocab=cfg.train.synthetic_vocab, seed=cfg.train.seed
    )
    total, weight = 0.0, 0.0
    for i in range(cfg.train.grad_accum):
        b = {k: v[0] for k, v in data.batch(i).items()}
        for doc in b["segment_ids"].unique().tolist():
            if doc < 0:
                continue
            sel = b["segment_ids"] == doc
            logits = model(b["input_ids"][sel][None], use_cache=False).logits[0]
            ce = torch.nn.functional.cross_entropy(logits, b["targets"][sel], reduction="none")
            total = total + (ce * b["loss_weights"][sel].double()).sum()
            weight += float(b["loss_weights"][sel].sum())
    loss = total / weight
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def test_transformers_model_trains_on_the_ring_with_exact_gradients(tmp_path):
    from longvideo.tokenizer import train_text_tokenizer

    path, out = tmp_path / "llama", tmp_path / "run"
    tok = train_text_tokenizer(["the red circle moves", "blue green"] * 5, vocab_size=260)
    tok.save(tmp_path / "tok")
    # its text ids, then as many as the run's vision tokens and codes (as an exported import has)
    _tiny_llama(path, vocab_size=tok.text_size + 4 + 16)
    run_ranks(_train, world=2, args=(str(path), str(out)), timeout=600)
    cfg = load_config(None, _overrides(path, out))
    ref_loss, ref = _reference(path, cfg)
    assert float((out / "loss.txt").read_text()) == pytest.approx(ref_loss, rel=1e-5)
    got = {k[len("model.") :]: v for k, v in load_file(str(out / "grads.safetensors")).items()}
    assert set(got) == set(ref)
    for name, g in ref.items():
        err = float((got[name].double() - g).norm() / g.norm())
        assert err < 1e-5, f"{name}: relative error {err:.2e}"
    # the checkpoint's weights are a transformers directory that transformers loads as it is
    from transformers import AutoModelForCausalLM

    latest = out / "checkpoints" / (out / "checkpoints/latest").read_text().strip()
    trained = AutoModelForCausalLM.from_pretrained(str(latest / "hf"))
    before = AutoModelForCausalLM.from_pretrained(str(path))
    assert not torch.equal(
        trained.model.layers[0].self_attn.q_proj.weight,
        before.model.layers[0].self_attn.q_proj.weight,
    )
    _every_tool_reads_the_run(out, trained, tmp_path, tok.text_size)


def _every_tool_reads_the_run(out: Path, trained, tmp_path: Path, text: int) -> None:
    """The run's checkpoints are read as the project's decoder (load_pretrained: chat, eval, serve
    and sequence-parallel inference; load_project_state: export and init_from), with
    transformers' logits; the export is the same family again, with the same logits."""
    from transformers import AutoModelForCausalLM

    from longvideo.checkpoint import load_pretrained
    from longvideo.export import export_hf

    pre = load_pretrained(out)  # the run directory: its latest checkpoint
    mc = pre.config.model
    assert (mc.family, mc.dim, mc.n_kv_heads) == ("llama", 32, 2)
    assert (mc.text_vocab_size, mc.vocab_size) == (text, text + 20)
    assert mc.max_seq_len == 256  # the model's context (data.seq_len is shorter)
    ids = torch.randint(0, text + 20, (2, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained(ids).logits
        torch.testing.assert_close(pre.model.logits(pre.model(ids)), want, atol=1e-4, rtol=0)
    tok_dir = tmp_path / "tok"
    exported = AutoModelForCausalLM.from_pretrained(
        export_hf(out, tmp_path / "exported", tokenizer_dir=tok_dir)
    )
    assert type(exported).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, want, atol=1e-4, rtol=0)


def _refuse(rank, world, path, out, key):
    from longvideo.train.trainer import Trainer

    with pytest.raises(ConfigError) as e:
        Trainer(load_config(None, _overrides(Path(path), Path(out)) + ["parallel.sp=1"]))
    assert e.value.key == key, e.value


def test_models_the_ring_cannot_run_exactly_are_named_errors(tmp_path):
    small = tmp_path / "small"
    _tiny_llama(small, attention_dropout=0.1)  # dropout in training is not exact on a ring
    run_ranks(
        _refuse, world=1, args=(str(small), str(tmp_path / "a"), "train.hf_model"), timeout=300
    )
    # frequencies that follow each forward's longest position: a shard does not see it
    dyn = tmp_path / "dynamic"
    _tiny_llama(dyn, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    run_ranks(_refuse, world=1, args=(str(dyn), str(tmp_path / "c"), "train.hf_model"), timeout=300)
    # a model the project's decoder could not read back (feed-forward biases) is refused too
    mlp = tmp_path / "mlp_bias"
    _tiny_llama(mlp, mlp_bias=True)
    run_ranks(_refuse, world=1, args=(str(mlp), str(tmp_path / "d"), "train.hf_model"), timeout=300)
    too_few = tmp_path / "vocab"
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=20,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).save_pretrained(str(too_few))
    run_ranks(
        _refuse, world=1, args=(str(too_few), str(tmp_path / "b"), "train.hf_model"), timeout=300
    )
