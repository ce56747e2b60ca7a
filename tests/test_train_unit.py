"""Training pieces that need no process group: schedule, DeepSpeed config, configs and the stage
ladders, CLI configuration errors, synthetic data, checkpoint files, metrics and the loss plot."""

from __future__ import annotations

import json
import math

import pytest
import torch

from longvideo import checkpoint as fmt
from longvideo.atomic import write_text_atomic
from longvideo.config import CONFIG_DIR, load_config
from longvideo.configtools import ConfigError
from longvideo.parallel.deepspeed_config import build_deepspeed_config
from longvideo.train import run_state as ck
from longvideo.train.config import TrainConfig
from longvideo.train.logging import RunLogger, plot_losses, read_metrics
from longvideo.train.schedule import WarmupCosine, lr_at
from longvideo.train.synthetic_tokens import SyntheticTokens

# ---- schedule -----------------------------------------------------------------------------------


def test_warmup_then_cosine_matches_closed_form():
    kw = dict(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert [lr_at(s, **kw) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    for s in (10, 35, 60, 85, 110, 200):
        p = min(1.0, (s - 10) / 100)
        assert lr_at(s, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
    decay = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert lr_at(10_000, **kw) == pytest.approx(0.1)


def test_schedule_state_restores_the_rate():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    a = WarmupCosine(opt, lr=2.0, warmup_steps=3, total_steps=20, min_lr_ratio=0.0)
    for _ in range(7):
        a.step()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    b = WarmupCosine(opt2, lr=2.0, warmup_steps=3, total_steps=20, min_lr_ratio=0.0)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert (
        opt2.param_groups[0]["lr"]
        == opt.param_groups[0]["lr"]
        == pytest.approx(lr_at(7, lr=2.0, warmup_steps=3, total_steps=20, min_lr_ratio=0.0))
    )


# ---- DeepSpeed config ---------------------------------------------------------------------------


def test_deepspeed_config_owned_keys_and_explicit_clipping():
    cfg = build_deepspeed_config(
        TrainConfig(micro_batch_size=2, grad_accum=3, grad_clip=0.0), world_size=4, bf16=False
    )
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_accumulation_steps"] == 3
    assert cfg["train_batch_size"] == 2 * 3 * 4
    assert cfg["gradient_clipping"] == 0.0  # DeepSpeed's default would be 1.0
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["bf16"]["enabled"] is False
    assert (
        build_deepspeed_config(TrainConfig(grad_clip=0.5), world_size=1, bf16=True)[
            "gradient_clipping"
        ]
        == 0.5
    )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shipped_deepspeed_json_gives_its_stage(stage):
    tc = TrainConfig(deepspeed_config=f"deepspeed/zero{stage}.json", grad_clip=0.3)
    cfg = build_deepspeed_config(tc, world_size=2, bf16=True)
    assert cfg["zero_optimization"]["stage"] == stage
    assert cfg["gradient_clipping"] == 0.3 and cfg["bf16"]["enabled"] is True
    assert "optimizer" not in cfg and "scheduler" not in cfg


def test_deepspeed_config_conflicts_are_errors(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    with pytest.raises(ConfigError, match="train.zero_stage"):
        build_deepspeed_config(
            TrainConfig(deepspeed_config=str(f), zero_stage=3), world_size=1, bf16=False
        )
    f.write_text(json.dumps({"gradient_clipping": 5.0}))
    with pytest.raises(ConfigError, match="gradient_clipping"):
        build_deepspeed_config(
            TrainConfig(deepspeed_config=str(f), grad_clip=1.0), world_size=1, bf16=False
        )
    f.write_text(json.dumps({"optimizer": {"type": "Adam"}}))
    with pytest.raises(ConfigError, match="optimizer"):
        build_deepspeed_config(TrainConfig(deepspeed_config=str(f)), world_size=1, bf16=False)
    with pytest.raises(ConfigError, match="not found"):
        build_deepspeed_config(
            TrainConfig(deepspeed_config=str(tmp_path / "missing.json")), world_size=1, bf16=False
        )


# ---- configs and ladders --------------------------------------------------------------------------


def test_every_shipped_config_loads():
    files = sorted(CONFIG_DIR.glob("*.yaml")) + sorted((CONFIG_DIR / "stages").glob("*.yaml"))
    assert len(files) >= 16
    for f in files:
        load_config(f)


def test_7b_text_ladder_follows_lwm():
    seq = {"32k": 2**15, "128k": 2**17, "256k": 2**18, "512k": 2**19, "1m": 2**20}
    theta = {"32k": 1e6, "128k": 1e7, "256k": 1e7, "512k": 2.5e7, "1m": 5e7}
    prev = None
    for name in seq:
        c = load_config(f"stages/lwm-text-{name}.yaml")
        assert (c.model.dim, c.model.n_layers, c.model.n_heads) == (4096, 32, 32)
        assert (
            c.data.seq_len == c.model.max_seq_len == seq[name] and c.model.rope_theta == theta[name]
        )
        assert c.train.data_source == "shards"
        if prev is not None:
            assert (
                c.train.init_from == prev.train.out_dir
            )  # each stage starts from the previous one
        prev = c
    for name in ("1k", "8k", "32k", "128k", "1m"):
        c = load_config(f"stages/lwm-vl-{name}.yaml")
        assert (
            c.model.rope_theta == 5e7
            and c.data.text_loss_weight == c.data.vision_loss_weight == 0.5
        )


def test_tiny_ladder_has_the_same_form():
    stages = [load_config(f"stages/tiny-{n}.yaml") for n in ("1k", "4k", "16k")]
    assert [c.data.seq_len for c in stages] == [1024, 4096, 16384]
    thetas = [c.model.rope_theta for c in stages]
    assert thetas == sorted(thetas) and len(set(thetas)) == 3
    assert stages[1].train.init_from == stages[0].train.out_dir
    assert stages[2].train.init_from == stages[1].train.out_dir


def test_cli_reports_config_errors_before_any_work(capsys):
    from longvideo.train.cli import main

    assert main(["--config", "tiny.yaml", "train.bogus=1"]) == 2
    assert "train.bogus" in capsys.readouterr().err
    assert main(["--config", "tiny.yaml", "train.lr=-1"]) == 2
    assert "train.lr" in capsys.readouterr().err
    assert main(["--config", "tiny.yaml", "train.zero_stage=4"]) == 2
    assert "train.zero_stage" in capsys.readouterr().err
    assert main(["--config", "no-such-config.yaml"]) == 2
    assert "not found" in capsys.readouterr().err


# ---- synthetic data -------------------------------------------------------------------------------


def test_synthetic_batches_follow_the_loader_format():
    d = SyntheticTokens(seq_len=100, batch_size=3, vocab=50, seed=1, min_doc=7, max_doc=30)
    b = next(iter(d))
    assert set(b) == {"input_ids", "targets", "positions", "segment_ids", "loss_weights"}
    assert all(v.shape == (3, 100) for v in b.values())
    for r in range(3):
        ids, tgt, pos, seg, w = (
            b[k][r] for k in ("input_ids", "targets", "positions", "segment_ids", "loss_weights")
        )
        for s in seg.unique().tolist():
            idx = (seg == s).nonzero().flatten()
            if s < 0:
                assert (w[idx] == 0).all()
                continue
            assert (pos[idx] == torch.arange(len(idx))).all()  # positions restart per document
            assert w[idx[-1]] == 0 and (w[idx[:-1]] == 1).all()  # no loss across documents
            assert (tgt[idx[:-1]] == ids[idx[1:]]).all()  # targets are the next tokens
            step = (ids[idx[1]] - ids[idx[0]]) % 50
            assert ((ids[idx[1:]] - ids[idx[:-1]]) % 50 == step).all()  # an arithmetic progression


def test_synthetic_is_deterministic_resumable_and_dp_disjoint():
    a = SyntheticTokens(seq_len=64, batch_size=2, vocab=40, seed=3)
    it = iter(a)
    first = [next(it) for _ in range(3)]
    state = a.state_dict()
    nxt = next(it)
    b = SyntheticTokens(seq_len=64, batch_size=2, vocab=40, seed=3)
    b.load_state_dict(json.loads(json.dumps(state)))
    assert torch.equal(next(iter(b))["input_ids"], nxt["input_ids"])
    again = SyntheticTokens(seq_len=64, batch_size=2, vocab=40, seed=3)
    assert torch.equal(next(iter(again))["input_ids"], first[0]["input_ids"])
    r0 = SyntheticTokens(seq_len=64, batch_size=2, vocab=40, seed=3, dp_rank=0, dp_size=2)
    r1 = SyntheticTokens(seq_len=64, batch_size=2, vocab=40, seed=3, dp_rank=1, dp_size=2)
    rows0 = {tuple(x.tolist()) for i in range(4) for x in r0.batch(i)["input_ids"]}
    rows1 = {tuple(x.tolist()) for i in range(4) for x in r1.batch(i)["input_ids"]}
    assert not rows0 & rows1 and len(rows0) == len(rows1) == 8
    with pytest.raises(ValueError, match="dp_size"):
        r1.load_state_dict(a.state_dict())


# ---- checkpoint files -----------------------------------------------------------------------------


def test_latest_pointer_stale_cleanup_and_pruning(tmp_path):
    ckpts = tmp_path / fmt.CHECKPOINTS
    for s in (5, 10, 15):
        (ckpts / ck.checkpoint_name(s)).mkdir(parents=True)
    (ckpts / ".tmp_step_000020").mkdir()  # a write killed halfway
    assert fmt.latest_checkpoint(tmp_path) is None
    write_text_atomic(ckpts / fmt.LATEST, ck.checkpoint_name(15))
    assert fmt.latest_checkpoint(tmp_path).name == "step_000015"
    assert fmt.latest_checkpoint(ckpts).name == "step_000015"
    assert [p.name for p in ck.clean_stale(tmp_path)] == [".tmp_step_000020"]
    assert not (ckpts / ".tmp_step_000020").exists()
    ck.prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000010", "step_000015"]
    write_text_atomic(ckpts / fmt.LATEST, "step_000099")
    with pytest.raises(FileNotFoundError, match="step_000099"):
        fmt.latest_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither a checkpoint"):
        fmt.resolve_checkpoint(tmp_path / fmt.CHECKPOINTS / "step_000010")


def test_load_project_state_reads_a_project_checkpoint(tmp_path):
    from longvideo.model import Transformer

    cfg = load_config(
        None,
        [
            "model.text_vocab_size=64",
            "model.codebook_size=16",
            "vq.codebook_size=16",
            "model.dim=32",
            "model.n_layers=1",
            "model.n_heads=2",
            "model.tie_embeddings=true",
        ],
    )
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    fmt.save_project_checkpoint(tmp_path / "p", dict(model.named_parameters()), cfg)
    sd, cfg2 = fmt.load_project_state(tmp_path / "p")
    assert cfg2 == cfg
    fresh = Transformer(cfg.model)
    fresh.load_state_dict(sd)  # strict: every name present, tied head restored
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), n


def test_rng_state_round_trip():
    import random

    import numpy as np

    meta, tensors = ck.rng_state()
    meta = json.loads(json.dumps(meta))
    expect = (random.random(), float(np.random.rand()), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(5)
    ck.set_rng_state(meta, tensors)
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[0] == expect[0] and got[1] == expect[1] and torch.equal(got[2], expect[2])


# ---- logging --------------------------------------------------------------------------------------


def test_metrics_keep_bad_steps_visible_and_truncate_on_resume(tmp_path):
    log = RunLogger(tmp_path, enabled=True, total_steps=4, progress=False, tensorboard=True)
    for s, loss in enumerate([3.0, float("nan"), 2.0, 1.5], start=1):
        log.log(s, {"loss": loss, "tokens_per_s": 10.0, "skipped": not math.isfinite(loss)})
    png = log.close(plot=True)
    rows = read_metrics(tmp_path)
    assert [r["loss"] for r in rows] == [3.0, "nan", 2.0, 1.5] and rows[1]["skipped"] is True
    assert png is not None and png.stat().st_size > 1000
    assert any((tmp_path / "tb").iterdir())
    RunLogger(
        tmp_path, enabled=True, total_steps=4, start_step=2, progress=False, tensorboard=False
    ).close(plot=False)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert plot_losses(tmp_path / "nothing-here") is None


def test_disabled_logger_writes_nothing(tmp_path):
    log = RunLogger(tmp_path / "x", enabled=False, total_steps=3)
    log.log(1, {"loss": 1.0})
    log.write("hello")
    assert log.close() is None and not (tmp_path / "x").exists()


def test_world_size_mismatch_is_a_clear_error_before_work(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, DS_ACCELERATOR="cpu")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "longvideo",
            "train",
            "--config",
            "tiny.yaml",
            "parallel.sp=2",
            "--out",
            str(tmp_path / "run"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "parallel.sp" in proc.stderr and "world size 1" in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing was started


def test_tiny_root_config_carries_the_tiny_vq_shape():
    from longvideo.configtools import from_dict, load_yaml
    from longvideo.vq.config import VQConfig

    vq = from_dict(VQConfig, load_yaml(CONFIG_DIR / "vq" / "tiny.yaml"))
    root = load_config("tiny.yaml").vq
    for f in (
        "mode",
        "resolution",
        "downsample",
        "codebook_size",
        "patch_size",
        "channels",
        "channel_mult",
        "num_res_blocks",
        "quantizer",
        "codes_per_frame",
    ):
        assert getattr(root, f) == getattr(vq, f), f


# ---- a non-finite gradient norm skips the step ------------------------------------------------


def test_skippable_adamw_skips_on_a_non_finite_gradient_norm():
    """The optimizer the trainer hands DeepSpeed: with an inf in a gradient (so an inf global norm)
    nothing moves, neither the weights nor AdamW's moments; with a finite norm it steps."""
    from longvideo.train.trainer import SkippableAdamW

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = SkippableAdamW([w], lr=0.1, weight_decay=0.01)
    w.grad = torch.ones_like(w)
    opt.step()  # a normal step first: AdamW's moments exist
    w.grad = torch.ones_like(w)
    w.grad[1, 2] = float("inf")
    opt.grad_norm = lambda: float(torch.linalg.vector_norm(w.grad))
    before, moments = w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items()}
    opt.step()
    assert torch.equal(w, before)
    assert all(torch.equal(opt.state[w][k], v) for k, v in moments.items())
    for bad in (float("nan"), float("-inf")):
        opt.grad_norm = lambda: bad
        opt.step()
        assert torch.equal(w, before)
    w.grad = torch.ones_like(w)
    opt.grad_norm = lambda: float(torch.linalg.vector_norm(w.grad))
    opt.step()
    assert not torch.equal(w, before) and torch.isfinite(w).all()
    opt.grad_norm = lambda: None  # DeepSpeed computed no norm: nothing to judge, it steps
    after = w.detach().clone()
    opt.step()
    assert not torch.equal(w, after)


def _inf_gradient(rank, world, out, stages, deepspeed_checks):
    """One process: a tiny model under ZeRO `stages`; a hook puts an inf into one gradient of the
    first step. With `deepspeed_checks=False` DeepSpeed's own overflow test is switched off (as in
    versions and precisions without one), so the trainer's check alone must skip the step."""
    import deepspeed.runtime.zero.stage3 as z3
    import deepspeed.runtime.zero.stage_1_and_2 as z12
    from test_train_distributed import TINY

    from longvideo.train.trainer import Trainer

    if not deepspeed_checks:
        z12.is_invalid_grad_norm = z3.is_invalid_grad_norm = lambda norm: False
        z12.DeepSpeedZeroOptimizer.check_overflow = lambda self, *a, **k: None
    for stage in stages:
        overrides = ["parallel.sp=1", f"train.zero_stage={stage}", "train.steps=4"]
        t = Trainer(load_config(None, TINY + overrides + [f"train.out_dir={out}/z{stage}"]))
        before = t.engine.full_state(keep=True)
        param = next(p for n, p in t.model.named_parameters() if "w_up" in n)

        def poison(g):
            g = g.clone()
            g.view(-1)[0] = float("inf")
            return g

        hook = param.register_hook(poison)
        stats = t.forward_backward(t.next_micro_batches())
        hook.remove()
        m = t.optimizer_step(stats)
        assert math.isfinite(m["loss"]) and not math.isfinite(m["grad_norm"]), m
        assert m["skipped"] and t.bad_in_a_row == 1, m
        after = t.engine.full_state(keep=True)
        assert all(torch.equal(before[k], after[k]) for k in before), stage
        m = t.train_step()  # the next, ordinary step is applied
        assert not m["skipped"] and math.isfinite(m["grad_norm"]) and t.bad_in_a_row == 0
        moved = t.engine.full_state(keep=True)
        assert any(not torch.equal(before[k], moved[k]) for k in before)
        assert all(torch.isfinite(v).all() for v in moved.values())


@pytest.mark.slow
@pytest.mark.parametrize("deepspeed_checks", [True, False])
def test_an_inf_gradient_skips_the_step_under_every_zero_stage(tmp_path, deepspeed_checks):
    from distributed import run_ranks

    run_ranks(
        _inf_gradient, world=1, args=(str(tmp_path), (1, 2, 3), deepspeed_checks), timeout=900
    )
