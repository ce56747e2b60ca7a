"""Sequence-parallel serving: exact partial merge, and W = 2 answers equal to W = 1, with the ring
prefill and with the head-parallel one (ulysses = 2)."""

import itertools
import math

import pytest
import torch
from distributed import run_ranks

from longvideo.kernels import AttentionMeta, Side, flash_attn_ref, get_backend, merge_partials


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Each test here runs on one torch thread (conftest.one_thread)."""


@pytest.mark.parametrize("sq", [1, 5])
def test_merge_partials_equals_attention_over_all_keys(sq):
    torch.manual_seed(0)
    B, Sk, Hq, Hkv, D = 2, 40, 4, 2, 8
    q = torch.randn(B, sq, Hq, D, dtype=torch.float64)
    k = torch.randn(B, Sk, Hkv, D, dtype=torch.float64)
    v = torch.randn(B, Sk, Hkv, D, dtype=torch.float64)
    q_pos = torch.arange(Sk - sq, Sk)[None].expand(B, sq)
    k_pos = torch.arange(Sk)[None].expand(B, Sk)
    q_seg = torch.zeros(B, sq, dtype=torch.long)
    k_seg = torch.zeros(B, Sk, dtype=torch.long)
    k_seg[:, 3:6] = -1  # padding inside a shard
    meta = AttentionMeta(Side(q_pos, q_seg), Side(k_pos, k_seg), True, 1 / math.sqrt(D))
    want, _ = flash_attn_ref(q, k, v, meta)
    exact = get_backend("torch")
    # three uneven key sets, one of them entirely invisible (only padding)
    cuts = [(0, 3), (3, 6), (6, 17), (17, Sk)]
    outs, lses = [], []
    for a, b in cuts:
        o, l = exact.forward(q, k[:, a:b], v[:, a:b], meta.with_keys(meta.keys.span(a, b)))
        outs.append(o)
        lses.append(l)
    assert bool(torch.isinf(lses[1]).all())
    got, lse = merge_partials(outs, lses)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # no visible key anywhere: zeros, not nan
    empty, empty_lse = merge_partials([outs[1]], [lses[1]])
    assert torch.equal(empty, torch.zeros_like(empty)) and bool(torch.isneginf(empty_lse).all())


def tiny_model(dtype, seed=0, backend="auto", **kw):
    from longvideo.model import ModelConfig, Transformer

    cfg = dict(
        text_vocab_size=40,
        codebook_size=20,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=256,
        init_std=0.1,
    )
    cfg.update(kw)
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**cfg), ffn_chunk=16, backend=backend).to(dtype).eval()


def single_process_reference():
    """Greedy tokens and first logits of the single-process path (chunked prefill, KV cache)."""
    from longvideo.infer.generation import generate, logits_of, new_cache, prefill

    out = {}
    for name, dtype, backend in (("f64", torch.float64, "torch"), ("f32", torch.float32, "auto")):
        model = tiny_model(dtype, backend=backend)
        torch.manual_seed(1)
        prefix = torch.randint(
            0, model.cfg.vocab_size, (2, 45)
        )  # not a multiple of 2W: padded shards
        questions = [torch.randint(0, model.cfg.vocab_size, (2, n)) for n in (4, 1)]
        runs = []
        for q in questions:
            ids = torch.cat([prefix, q], 1)
            cache = new_cache(model, 2, ids.shape[1])
            with torch.no_grad():
                logits = logits_of(model, prefill(model, ids, cache, chunk=16))
            runs.append((generate(model, ids, max_new_tokens=10, prefill_chunk=16).tokens, logits))
        out[name] = (prefix, questions, runs)
    return out


def _sp_body(rank, world, ref, chat_case):
    import contextlib
    import io

    from longvideo.distributed import broadcast_text
    from longvideo.infer.sp import SequenceParallelEngine, sp_generate
    from longvideo.parallel import split_group

    heads = split_group(None, 2)
    for (name, dtype, backend), ulysses in itertools.product(
        (("f64", torch.float64, "torch"), ("f32", torch.float32, "auto")), (None, heads)
    ):
        prefix, questions, runs = ref[name]
        model = tiny_model(dtype, backend=backend)
        own = model.attention_fn
        engine = SequenceParallelEngine(model, backend=backend, ulysses=ulysses)
        engine.set_prefix(prefix)
        assert (
            engine.cache.length == 48 // world
        )  # 45 tokens padded to 48, this rank's zigzag shard
        for q, (want_tokens, want_logits) in zip(
            questions, runs
        ):  # follow-ups reuse the sharded prefix
            start = engine.prefix_len
            engine.cache.crop(engine.local_prefix_len)
            with torch.no_grad():
                logits = engine._logits(q, start)
            tol = 1e-10 if dtype == torch.float64 else 2e-5
            torch.testing.assert_close(logits, want_logits, rtol=tol, atol=tol)
            got = engine.generate(q, max_new_tokens=10)
            assert torch.equal(got.tokens, want_tokens), (name, ulysses, got.tokens, want_tokens)
        # the one-call API, with the question replicated (tail) and the prefix ring-prefilled
        ids = torch.cat([prefix, questions[0]], 1)
        got = sp_generate(
            model,
            ids,
            max_new_tokens=10,
            tail=questions[0].shape[1],
            backend=backend,
            ulysses=ulysses,
        )
        assert torch.equal(got.tokens, runs[0][0])
        assert (
            model.attention_fn is own
        )  # the engine passes its seams per call; the model is never changed
    assert broadcast_text("héllo" if rank == 0 else None) == "héllo"

    # `longvideo chat` under torchrun: rank 0 prints what the single process printed
    from longvideo.infer import cli

    ckpt, video, question, expected = chat_case
    for ulysses in ("1", "2"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = cli._chat(
                cli.chat_parser().parse_args(
                    [
                        "--model",
                        ckpt,
                        "--video",
                        video,
                        "--question",
                        question,
                        "--quiet",
                        "--device",
                        "cpu",
                        "--ulysses",
                        ulysses,
                    ]
                )
            )
        assert rc == 0
        assert buf.getvalue().splitlines() == ([expected] if rank == 0 else []), ulysses


@pytest.mark.slow
@pytest.mark.distributed
def test_sequence_parallel_w2_equals_single_process(tmp_path):
    """W = 2 (ring or head-parallel prefill, sharded KV cache, merged decoding) gives the single-process
    tokens, and `longvideo chat --ulysses 2` the single-process answer."""
    from test_infer_chat import tiny_pretrained, write_video

    from longvideo.checkpoint import save_project_checkpoint
    from longvideo.data.synthetic import NEEDLE_QUESTION
    from longvideo.infer.chat import answer

    pre = tiny_pretrained(max_seq_len=1024)
    ckpt = save_project_checkpoint(
        tmp_path / "ckpt", pre.model.state_dict(), pre.config, tokenizer=pre.tokenizer, vq=pre.vq
    )
    write_video(tmp_path / "clip.mp4")
    expected = answer(pre, str(tmp_path / "clip.mp4"), NEEDLE_QUESTION)
    chat_case = (str(ckpt), str(tmp_path / "clip.mp4"), NEEDLE_QUESTION, expected)
    run_ranks(_sp_body, world=2, args=(single_process_reference(), chat_case), timeout=240)
