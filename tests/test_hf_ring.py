"""Ring attention inside transformers models (longvideo.hf) against transformers' own eager attention.

Tiny random LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and MistralForCausalLM (2 layers,
hidden 48, GQA 4/2 heads) built from configs. One spawned world of 3 gloo ranks runs rings of
W = 1, 2, 3, and the head-parallel split of W = 3 (ulysses_size=3: heads not a multiple of 3, fewer
key/value heads than ranks), on a batch of packed documents of random lengths (one longer than a shard, several shorter than a
zigzag chunk; one row padded through attention_mask; a length that is not a multiple of 2W).
Every rank computes the single-process reference itself: the same weights with
attn_implementation="eager" on the unsharded batch, with an explicit 4D mask (same document,
causal, key not padding). Checked:

* float64 (Llama, Qwen2, Qwen3): logits (reassembled), the global loss and the gradient of every
  parameter (averaged over the ring) within 1e-9 of the reference, relative to each tensor's largest value; the same
  with gradient checkpointing on;
* float32: the error against the float64 reference within 2x the error of the same-dtype eager
  run, plus 1e-6 relative to each tensor's largest value;
* a DeepSpeed ZeRO-3 step (W = 3, fp32, gradient clipping active) equals one single-process AdamW
  step with the same clipping;
* the HF Trainer recipe of docs/hf.md (W = 2, DDP, gradient accumulation) updates by exactly the
  whole batch's gradient;
* single-process pieces: shard_batch, the deferred mask, generate's fallback to sdpa, and the
  named refusals.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks

from longvideo.hf import (
    DeferredMask,
    RingAttentionUnsupported,
    check_model,
    document_ids,
    enable_ring_attention,
    global_loss,
    keep_float64,
    num_items_in_batch,
    ring_loss,
    shard_batch,
)
from longvideo.parallel import unshard_sequence

VOCAB = 96
S = 37  # not a multiple of 2W for W = 2, 3: the shards are padded
PAD_TAIL = 3  # row 1 ends with this many attention_mask = 0 tokens


def _config(kind: str, **over):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    common.update(over)
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    if kind == "qwen3":  # per-head q/k norms, head_dim apart from hidden / heads
        return Qwen3Config(use_sliding_window=False, head_dim=16, **common)
    if kind == "mistral":
        return MistralConfig(**{"sliding_window": 64, **common})  # a window the sequence fits in
    raise ValueError(kind)


def _model(kind: str, attn: str, dtype, **over):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind, **over), attn_implementation=attn).to(
        dtype
    )
    model.train()
    return model


def _causal_lm_loss_keep_dtype(
    logits,
    labels,
    vocab_size,
    num_items_in_batch=None,
    ignore_index=-100,
    shift_labels=None,
    **kwargs,
):
    """transformers' ForCausalLMLoss without its cast to float32, for the float64 comparisons (the
    same shift_labels / num_items_in_batch semantics)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(
        logits.reshape(-1, vocab_size),
        shift_labels.reshape(-1).to(logits.device),
        ignore_index=ignore_index,
        reduction=reduction,
    )
    return loss / num_items_in_batch.to(loss.device) if num_items_in_batch is not None else loss


def _use_model_dtype_loss(model):
    """For float64 models: the loss and every RMSNorm in float64. transformers computes both in
    float32 whatever the model's dtype, so a float64 model's gradients are rounded to float32 at
    every norm, on the reference as on the ring; rounding the same values differently by one float32
    ulp would then be indistinguishable from an error of the ring. Set on the instances (reference
    and ring alike; the norms by longvideo.hf.keep_float64); the attention path under test is
    untouched."""
    if next(model.parameters()).dtype == torch.float64:
        model.loss_function = _causal_lm_loss_keep_dtype
        keep_float64(model)
    return model


def _packed_batch(seed: int = 0):
    """B = 2 rows of S tokens: packed documents, positions restarting at 0 (the 24-token one is longer
    than a shard at W = 2 and 3, the 16-token one at W = 3; 1, 2 and 4 tokens are shorter than a
    zigzag chunk); row 1 ends with PAD_TAIL padding tokens (attention_mask 0, label -100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, S), generator=g)
    labels = ids.clone()
    labels[torch.rand(2, S, generator=g) < 0.2] = -100
    pos = torch.zeros(2, S, dtype=torch.long)
    mask = torch.ones(2, S, dtype=torch.long)
    for b, lengths in enumerate(
        ([16, 2, 1, 5, 13], [3, 1, 24, 4, 2])
    ):  # row 1: 34 tokens + padding
        pos[b, : sum(lengths)] = torch.cat([torch.arange(n) for n in lengths])
    mask[1, S - PAD_TAIL :] = 0
    labels[1, S - PAD_TAIL :] = -100
    pos[1, S - PAD_TAIL :] = 0
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "attention_mask": mask}


def _reference_mask(batch, dtype):
    """The 4D additive mask of the reference: same document, causal, key not padding."""
    seg = torch.where(batch["attention_mask"].bool(), document_ids(batch["position_ids"]), -1)
    idx = torch.arange(S)
    vis = (
        (seg[:, :, None] == seg[:, None, :])
        & (seg[:, None, :] >= 0)
        & (idx[None, None, :] <= idx[None, :, None])
    )
    vis = vis | torch.eye(
        S, dtype=torch.bool
    )  # padded queries see themselves (their rows are ignored)
    if dtype is None:
        return vis[:, None]  # boolean, for sdpa
    return torch.zeros(2, 1, S, S, dtype=dtype).masked_fill(~vis[:, None], torch.finfo(dtype).min)


def _reference(kind, dtype, batch):
    """Single process, the whole batch: (logits, loss, grads). float32: transformers' eager
    attention. float64: sdpa (the math kernel computes in float64; eager takes its softmax in
    float32 whatever the model's dtype, which would make it a float32 reference)."""
    attn = "sdpa" if dtype == torch.float64 else "eager"
    model = _use_model_dtype_loss(_model(kind, attn, dtype))
    mask = _reference_mask(batch, None if attn == "sdpa" else dtype)
    out = model(
        input_ids=batch["input_ids"],
        labels=batch["labels"],
        position_ids=batch["position_ids"],
        attention_mask=mask,
        use_cache=False,
    )
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


def _ring(kind, dtype, batch, group, *, checkpointing=False, use_cache=False):
    """The ring over `group`: (reassembled logits, global loss, grads averaged over the ring)."""
    model = _use_model_dtype_loss(_model(kind, "ring", dtype))
    if checkpointing:
        model.gradient_checkpointing_enable()
    local = shard_batch(batch, group, grad_group=group)
    kw = {"use_cache": False} if not use_cache else {}
    out = model(**local, **kw)
    out.loss.backward()
    W = dist.get_world_size(group)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=group)
        grads[n] = g / W
    logits = unshard_sequence(out.logits.detach(), group, dim=1, length=S)
    return logits, torch.tensor(global_loss(out.loss, grad_group=group), dtype=torch.float64), grads


def _real(batch):
    return batch["attention_mask"].bool()  # logits are compared on real tokens


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _assert_fp64(what, got, ref, batch, tol=1e-9):
    logits, loss, grads = got
    rl, rloss, rgrads = ref
    real = _real(batch)
    scale = rl[real].abs().max().item()
    assert _max_err(logits[real], rl[real]) <= tol * scale, (
        f"{what}: logits {_max_err(logits[real], rl[real]):.3g}"
    )
    assert abs(float(loss) - float(rloss)) <= tol * abs(float(rloss)), (
        f"{what}: loss {float(loss)} vs {float(rloss)}"
    )
    assert set(grads) == set(rgrads)
    for n, g in rgrads.items():
        err, scale = _max_err(grads[n], g), g.abs().max().item()
        assert err <= tol * scale, f"{what}: grad {n} error {err:.3g} > {tol:g} x {scale:.3g}"


def _assert_fp32(what, got, same_dtype, truth, batch, eps=1e-6):
    """got (ring, fp32) as close to the fp64 truth as 2x the fp32 eager run, plus eps x scale."""
    real = _real(batch)

    def check(name, a, b, t):
        err, base, scale = _max_err(a, t), _max_err(b, t), t.abs().max().item()
        assert err <= 2 * base + eps * scale, (
            f"{what}: {name} error {err:.3g} > 2 x {base:.3g} + {eps:g} x {scale:.3g}"
        )

    check("logits", got[0][real], same_dtype[0][real], truth[0][real])
    check("loss", got[1].reshape(1), same_dtype[1].reshape(1), truth[1].reshape(1))
    for n in truth[2]:
        check(f"grad {n}", got[2][n], same_dtype[2][n], truth[2][n])


# ---- the distributed cases ------------------------------------------------------------------


def _deepspeed_step(rank, world, batch, truth_step, refs):
    """ZeRO-3 over the whole world (= the ring), fp32: the loss and the gradients DeepSpeed reduces
    (averaged over the ranks) are those of the whole batch's token mean, and the parameters after
    one step with clipping at 0.05 (active) equal one single-process AdamW step with the same
    clipping. (Clipping and Adam are blind to a constant factor on the gradients; the gradient
    check is what pins the loss normalisation.)"""
    os.environ.setdefault("LOCAL_RANK", str(rank))  # one node: what a launcher would set
    import deepspeed

    lr, clip = 1e-2, 0.05
    model = _model("llama", "ring", torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=opt, config=cfg, dist_init_required=False
    )
    local = shard_batch(
        batch, None
    )  # grad_group None: every process, which DeepSpeed averages over
    out = engine(**local, use_cache=False)
    engine.backward(out.loss)
    from deepspeed.utils import safe_get_full_grad

    grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
    loss = torch.tensor(global_loss(out.loss))
    logits = unshard_sequence(out.logits.detach(), None, dim=1, length=S)
    _assert_fp32(
        "ZeRO-3",
        (logits, loss, grads),
        refs["llama", torch.float32],
        refs["llama", torch.float64],
        batch,
    )
    engine.step()
    names = [n for n, _ in engine.module.named_parameters()]
    params = list(engine.module.parameters())
    truth_params, truth_grads = truth_step
    counts = [0, 0]  # weights checked to 1e-3 lr, all weights
    with deepspeed.zero.GatheredParameters(params):
        for n, p in zip(names, params):
            err = (p.detach().double() - truth_params[n].double()).abs()
            # Adam's first step moves a weight by lr * g / (|g| + 1e-8): about lr wherever the
            # clipped gradient g is well above 1e-8, and fp32 rounding of g may only perturb that by
            # a small fraction of lr. Where |g| is within 100x of 1e-8 the step is a sign function
            # of the rounding itself; there it may only stay within one step of the truth.
            settled = truth_grads[n].abs() > 1e-6
            counts[0] += int(settled.sum())
            counts[1] += settled.numel()
            worst = err[settled].max().item() if settled.any() else 0.0
            assert worst <= 1e-3 * lr, (
                f"ZeRO-3 step: {n} differs by {worst:.3g} from the single-process step"
            )
            assert err.max().item() <= 2 * lr, (
                f"ZeRO-3 step: {n} moved by more than an Adam step from the truth"
            )
    # (the rows of tokens the batch does not hold have no gradient at all)
    assert counts[0] > 0.5 * counts[1], (
        f"only {counts[0]} of {counts[1]} gradients away from zero: the check is thin"
    )


def _single_process_adamw_step(batch):
    lr, clip = 1e-2, 0.05
    model = _model("llama", "eager", torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    out = model(
        input_ids=batch["input_ids"],
        labels=batch["labels"],
        position_ids=batch["position_ids"],
        attention_mask=_reference_mask(batch, torch.float32),
        use_cache=False,
    )
    out.loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    assert norm > 2 * clip, (
        f"gradient norm {float(norm):.3g}: clipping at {clip} would not be exercised"
    )
    clipped = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, clipped


def _body(rank, world):
    enable_ring_attention(None)  # replaced per group below; registration is per process
    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: dist.group.WORLD}
    batch = _packed_batch()
    refs = {}
    for kind in ("llama", "qwen2", "qwen3"):
        refs[kind, torch.float64] = _reference(kind, torch.float64, batch)
    refs["llama", torch.float32] = _reference("llama", torch.float32, batch)
    refs["mistral", torch.float64] = _reference("mistral", torch.float64, batch)
    timings = {}
    for W, group in groups.items():
        t0 = time.perf_counter()
        if rank < W:
            enable_ring_attention(group, backend="torch" if W == 2 else "cpu")
            for kind in ("llama", "qwen2", "qwen3"):
                got = _ring(kind, torch.float64, batch, group, use_cache=kind == "qwen2")
                _assert_fp64(f"W={W} {kind} fp64", got, refs[kind, torch.float64], batch)
            got = _ring("llama", torch.float64, batch, group, checkpointing=True)
            _assert_fp64(
                f"W={W} llama fp64 checkpointing", got, refs["llama", torch.float64], batch
            )
            got = _ring("llama", torch.float32, batch, group)
            _assert_fp32(
                f"W={W} llama fp32",
                got,
                refs["llama", torch.float32],
                refs["llama", torch.float64],
                batch,
            )
            if W == 3:
                got = _ring("mistral", torch.float64, batch, group, checkpointing=True)
                _assert_fp64(
                    f"W={W} mistral fp64 checkpointing", got, refs["mistral", torch.float64], batch
                )
                # generate falls back to sdpa on each rank: the same tokens as an sdpa model
                _generate_matches_sdpa()
                # heads all-to-all over the 3 ranks (4 query heads padded to 6; 2 key/value heads, replicated)
                enable_ring_attention(group, backend="cpu", ulysses_size=3)
                for kind in ("llama", "qwen2"):
                    got = _ring(kind, torch.float64, batch, group, checkpointing=kind == "qwen2")
                    _assert_fp64(
                        f"W={W} ulysses=3 {kind} fp64", got, refs[kind, torch.float64], batch
                    )
                got = _ring("llama", torch.float32, batch, group)
                _assert_fp32(
                    f"W={W} ulysses=3 llama fp32",
                    got,
                    refs["llama", torch.float32],
                    refs["llama", torch.float64],
                    batch,
                )
        dist.barrier()
        timings[W] = time.perf_counter() - t0
    enable_ring_attention(dist.group.WORLD)
    t0 = time.perf_counter()
    _deepspeed_step(rank, world, batch, _single_process_adamw_step(batch), refs)
    timings["zero3"] = time.perf_counter() - t0
    if rank == 0:
        print("timings (s):", {k: round(v, 1) for k, v in timings.items()}, flush=True)


@pytest.mark.slow
@pytest.mark.distributed
def test_hf_models_on_rings_of_1_2_3_match_one_process():
    run_ranks(_body, world=3, timeout=400)


def _trainer_body(rank, world):
    """The HF Trainer recipe of docs/hf.md on a ring of 2 (the whole world): a collator that shards
    with count=False, a dataloader that gives both ranks the same rows, DDP (the Trainer's wrapper),
    gradient accumulation over 2 micro-batches of different token counts. SGD with lr 1 and no
    clipping makes the update the gradient itself: it must be the float64 gradient of the whole
    batch's token mean."""
    # what a launcher would set; the process group exists already (the port is never used)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",
    )
    import tempfile

    from torch.utils.data import DataLoader
    from transformers import Trainer, TrainingArguments

    group = dist.group.WORLD
    enable_ring_attention(group)
    batch = _packed_batch()
    rows = [{k: v[i] for k, v in batch.items()} for i in range(2)]

    def collate(rs):
        return shard_batch({k: torch.stack([r[k] for r in rs]) for k in rs[0]}, group, count=False)

    class RingTrainer(Trainer):
        def get_train_dataloader(self):  # every rank of the ring reads the same rows
            return DataLoader(rows, batch_size=1, shuffle=False, collate_fn=collate)

    model = _use_model_dtype_loss(_model("llama", "ring", torch.float64))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with tempfile.TemporaryDirectory() as d:
        args = TrainingArguments(
            output_dir=d,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=2,
            max_steps=1,
            learning_rate=1.0,
            optim="sgd",
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=0.0,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
        )
        trainer = RingTrainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    ref = _reference("llama", torch.float64, batch)
    for n, p in model.named_parameters():
        g, want = before[n] - p.detach(), ref[2][n]
        err, scale = _max_err(g, want), want.abs().max().item()
        assert err <= 1e-9 * scale, (
            f"Trainer: update of {n} differs from the gradient by {err:.3g} (x {scale:.3g})"
        )


@pytest.mark.slow
@pytest.mark.distributed
def test_hf_trainer_recipe_on_a_ring_of_2_gives_the_whole_batch_gradient():
    run_ranks(_trainer_body, world=2, timeout=300)


# ---- single-process pieces ------------------------------------------------------------------


def _generate_matches_sdpa():
    ring = _model("llama", "ring", torch.float32).eval()
    sdpa = _model("llama", "sdpa", torch.float32).eval()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the fallback must apply transformers' own padding mask
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    a = ring.generate(ids, attention_mask=mask, **kw)
    b = sdpa.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(a, b), f"generate: {a.tolist()} != {b.tolist()}"
    la = ring(input_ids=ids, attention_mask=mask).logits
    lb = sdpa(input_ids=ids, attention_mask=mask).logits
    assert _max_err(la, lb) == 0.0


def test_generate_and_unsharded_forward_fall_back_to_sdpa():
    enable_ring_attention(None)
    _generate_matches_sdpa()


def test_shard_batch_shifts_before_sharding_pads_and_marks_documents():
    ids = torch.arange(10, 17)[None]  # S = 7, W = 1: padded to 8
    labels = ids.clone()
    labels[0, 4] = -100
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    out = shard_batch(
        {"input_ids": ids, "labels": labels, "position_ids": pos, "attention_mask": mask}, None
    )
    assert set(out) == {
        "input_ids",
        "position_ids",
        "ring_segment_ids",
        "labels",
        "shift_labels",
        "num_items_in_batch",
    }
    assert out["input_ids"].tolist() == [[10, 11, 12, 13, 14, 15, 16, 0]]
    assert out["ring_segment_ids"].tolist() == [[0, 0, 0, 1, 1, 2, -1, -1]]
    # label of token i + 1 at i; -100 where the query is padding and at the end
    assert out["shift_labels"].tolist() == [[11, 12, 13, -100, 15, 16, -100, -100]]
    assert out["labels"] is out["shift_labels"]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 0]]
    assert float(out["num_items_in_batch"]) == 5.0
    assert "num_items_in_batch" not in shard_batch(
        {"input_ids": ids, "labels": labels}, None, count=False
    )
    assert document_ids(torch.tensor([[0, 1, 5, 6, 0, 0]])).tolist() == [[0, 0, 1, 1, 2, 3]]
    # already shifted labels and explicit documents (e.g. from a packing loader) pass through as given
    docs = torch.tensor([[0, 0, 1, 1, 1, -1, 2]])
    given = shard_batch(
        {"input_ids": ids, "shift_labels": labels, "segment_ids": docs}, None, count=False
    )
    assert given["shift_labels"].tolist() == [[10, 11, 12, 13, -100, -100, 16, -100]]
    assert given["ring_segment_ids"].tolist() == [[0, 0, 1, 1, 1, -1, 2, -1]]
    with pytest.raises(ValueError, match="no pad value for batch key 'extra'"):
        shard_batch({"input_ids": ids, "extra": torch.zeros(1, 7)}, None)
    with pytest.raises(ValueError, match="expected \\(B, S, ...\\)"):
        shard_batch({"input_ids": ids, "labels": labels[:, :5]}, None)


def test_loss_helpers_on_one_rank():
    logits = torch.randn(1, 6, 5, dtype=torch.float64)
    shifted = torch.tensor([[1, 2, -100, 3, 4, -100]])
    n = num_items_in_batch([shifted])
    assert float(n) == 4.0
    want = F.cross_entropy(logits[0], shifted[0], ignore_index=-100)
    assert torch.allclose(ring_loss(logits, shifted), want)
    assert (
        float(num_items_in_batch([torch.full((1, 3), -100)])) == 1.0
    )  # no tokens: loss 0, not NaN
    assert float(num_items_in_batch([shifted, shifted], accumulation_steps=2)) == 4.0
    assert global_loss(want) == float(want)


def test_mask_function_builds_no_mask():
    from transformers.masking_utils import create_causal_mask

    enable_ring_attention(None)
    cfg = _config("llama")
    cfg._attn_implementation = "ring"
    emb = torch.zeros(2, 4096, 8)
    pos = torch.arange(4096)[None].expand(2, -1)
    mask = create_causal_mask(
        config=cfg, inputs_embeds=emb, attention_mask=None, cache=None, position_ids=pos
    )
    assert isinstance(mask, DeferredMask) and mask.padding is None and not mask.has_overlay
    assert mask.kwargs["q_length"] == 4096  # the arguments are kept; nothing S x S was built


def _sharded_toy_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (1, 12), generator=g)
    return shard_batch({"input_ids": ids, "labels": ids}, None)


def test_refusals_name_the_reason():
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaForCausalLM

    enable_ring_attention(None)
    batch = _sharded_toy_batch()
    # soft-capping (Gemma 2): at check_model and at the first call
    gcfg = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=4096,
    )
    gemma = Gemma2ForCausalLM._from_config(gcfg, attn_implementation="ring")
    with pytest.raises(RingAttentionUnsupported, match="not one of the tested types"):
        check_model(gemma)
    with pytest.raises(RingAttentionUnsupported, match="soft-capping"):
        check_model(gemma, allow_untested=True)
    with pytest.raises(RingAttentionUnsupported, match="soft-capping"):
        gemma(**batch)
    # a sliding window shorter than the sequence
    mistral = _model("mistral", "ring", torch.float32, sliding_window=8)
    with pytest.raises(RingAttentionUnsupported, match="sliding window of 8"):
        check_model(mistral, seq_len=12)
    check_model(mistral, seq_len=8)
    with pytest.raises(
        RingAttentionUnsupported, match="sliding window of 8 tokens, which would mask"
    ):
        mistral(**batch, use_cache=False)
    # attention dropout while training (evaluation is fine)
    drop = _model("llama", "ring", torch.float32, attention_dropout=0.1)
    with pytest.raises(RingAttentionUnsupported, match="attention dropout 0.1"):
        check_model(drop)
    with pytest.raises(RingAttentionUnsupported, match="attention dropout 0.1"):
        drop(**batch, use_cache=False)
    drop.eval()
    drop(**batch, use_cache=False)
    # non-causal
    llama = _model("llama", "ring", torch.float32)
    with pytest.raises(RingAttentionUnsupported, match="non-causal"):
        llama(**batch, use_cache=False, is_causal=False)
    # a sharded batch against a KV cache
    from transformers import DynamicCache

    cache = DynamicCache(config=llama.config)
    llama.eval()
    with torch.no_grad():
        llama(input_ids=batch["input_ids"][:, :4], cache=cache, use_cache=True)
        with pytest.raises(RingAttentionUnsupported, match="KV cache"):
            llama(
                **{
                    k: v[:, 4:] if torch.is_tensor(v) and v.dim() == 2 else v
                    for k, v in batch.items()
                },
                cache=cache,
                use_cache=True,
            )
    assert isinstance(llama, LlamaForCausalLM)
    check_model(llama)
    check_model(_model("qwen2", "ring", torch.float32))


def test_from_pretrained_directory_with_attn_implementation_ring(tmp_path):
    from transformers import AutoModelForCausalLM

    enable_ring_attention(None)
    _model("qwen2", "sdpa", torch.float32).save_pretrained(tmp_path)
    ring = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="ring")
    sdpa = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert ring.config._attn_implementation == "ring"
    check_model(ring, seq_len=S)
    batch = _packed_batch()
    got = ring(**shard_batch(batch, None), use_cache=False).logits[:, :S]
    # transformers' own packed-sequence path: no attention_mask, positions restarting, no cache
    want = sdpa(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
    ).logits
    real = _real(batch)
    assert _max_err(got[real], want[real]) <= 1e-5 * want.abs().max().item()
