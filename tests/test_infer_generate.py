"""KV-cache generation against full recomputation, chunked against one-shot prefill, sampling."""

import pytest
import torch

from longvideo.infer.generation import (
    decode_loop,
    generate,
    logits_of,
    new_cache,
    prefill,
    sample_token,
    trim_at_stop,
)
from longvideo.model import ModelConfig, Transformer


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Each test here runs on one torch thread (conftest.one_thread)."""


def tiny_model(dtype=torch.float64, seed=0, backend="torch", **kw):
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
    return Transformer(ModelConfig(**cfg), ffn_chunk=8, backend=backend).to(dtype).eval()


def recompute_greedy(model, ids, n):
    """Reference: every step runs the whole sequence without a cache."""
    seq = ids
    out, all_logits = [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model.logits(model(seq))[:, -1]
            tok = logits.argmax(-1)
            out.append(tok)
            all_logits.append(logits)
            seq = torch.cat([seq, tok[:, None]], dim=1)
    return torch.stack(out, 1), torch.stack(all_logits, 1)


@pytest.mark.parametrize("chunk", [1000, 5])
def test_kv_cache_generation_equals_recomputation(chunk):
    model = tiny_model()
    torch.manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 23))
    ref_tokens, ref_logits = recompute_greedy(model, ids, 12)
    got = generate(model, ids, max_new_tokens=12, prefill_chunk=chunk)
    assert torch.equal(got.tokens, ref_tokens)
    assert got.prompt_len == 23 and got.ttft_s > 0

    # the logits of every cached step, against the recomputed ones
    cache = new_cache(model, 2, 40)
    with torch.no_grad():
        logits = [logits_of(model, prefill(model, ids, cache, chunk=chunk))]
        for t in range(11):
            logits.append(logits_of(model, model(ref_tokens[:, t : t + 1], cache=cache)))
    torch.testing.assert_close(torch.stack(logits, 1), ref_logits.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_prefill_equals_one_shot(chunk):
    model = tiny_model()
    torch.manual_seed(2)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 37))
    one, many = new_cache(model, 2, 40), new_cache(model, 2, 40)
    with torch.no_grad():
        h_one = prefill(model, ids, one, chunk=10_000)
        h_many = prefill(model, ids, many, chunk=chunk)
        full = model(ids)  # no cache at all
    torch.testing.assert_close(h_many, h_one, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h_one, full[:, -1:], rtol=1e-10, atol=1e-10)
    assert one.length == many.length == 37
    for layer in range(model.cfg.n_layers):
        torch.testing.assert_close(many.k[layer], one.k[layer], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(many.v[layer], one.v[layer], rtol=1e-10, atol=1e-10)
    assert torch.equal(many.positions, one.positions)


def test_chunked_prefill_float32_greedy_tokens():
    model = tiny_model(dtype=torch.float32, backend="auto")
    torch.manual_seed(3)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 50))
    a = generate(model, ids, max_new_tokens=8, prefill_chunk=50)
    b = generate(model, ids, max_new_tokens=8, prefill_chunk=6)
    assert torch.equal(a.tokens, b.tokens)


def test_continue_cache_across_calls():
    """Prefill a prefix once, then a suffix: same answer as the whole prompt at once."""
    model = tiny_model()
    torch.manual_seed(4)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 30))
    whole = generate(model, ids, max_new_tokens=6)
    cache = new_cache(model, 1, 40)
    prefill(model, ids[:, :20], cache, chunk=8)
    rest = generate(model, ids[:, 20:], max_new_tokens=6, cache=cache)
    assert torch.equal(rest.tokens, whole.tokens)


def test_top_p_restricts_to_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].expand(20000, 4)
    g = torch.Generator().manual_seed(0)
    draws = sample_token(logits, temperature=1.0, top_p=0.7, generator=g)
    counts = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert counts[2] == 0 and counts[3] == 0
    torch.testing.assert_close(counts[:2], torch.tensor([0.625, 0.375]), atol=0.02, rtol=0)
    draws = sample_token(logits, temperature=1.0, top_p=1.0, generator=g)
    counts = torch.bincount(draws, minlength=4).float() / draws.numel()
    torch.testing.assert_close(counts, probs, atol=0.02, rtol=0)
    # a tiny top_p keeps only the most likely token, whatever the temperature
    assert bool((sample_token(logits[:50], temperature=5.0, top_p=1e-6, generator=g) == 0).all())
    assert torch.equal(sample_token(torch.tensor([[0.1, 2.0, -1.0]])), torch.tensor([1]))


def test_decode_loop_stops_per_row():
    script = iter(
        [torch.tensor([1, 7]), torch.tensor([9, 2]), torch.tensor([4, 4]), torch.tensor([9, 9])]
    )
    tokens = decode_loop(
        lambda tok: torch.zeros(2, 10),
        torch.zeros(2, 10),
        max_new_tokens=10,
        pick=lambda logits: next(script),
        stop_ids=[9],
    )
    assert tokens.tolist() == [[1, 9, 9, 9], [7, 2, 4, 9]]
    assert trim_at_stop(tokens[1].tolist(), [9]) == [7, 2, 4]


def test_engine_follow_up_questions_reuse_the_prefix():
    """Answers against a cached prefix equal fresh generation of prefix + question, question after question."""
    from longvideo.infer.generation import LocalEngine

    model = tiny_model()
    torch.manual_seed(5)
    prefix = torch.randint(0, model.cfg.vocab_size, (1, 33))
    engine = LocalEngine(model, prefill_chunk=8, spare=4)  # small spare: the cache must grow
    engine.set_prefix(prefix)
    for q_len in (3, 9, 1):
        question = torch.randint(0, model.cfg.vocab_size, (1, q_len))
        want = generate(model, torch.cat([prefix, question], 1), max_new_tokens=7)
        got = engine.generate(question, max_new_tokens=7)
        assert torch.equal(got.tokens, want.tokens)
        assert got.prompt_len == 33 + q_len
        assert engine.cache.length == 33 + q_len + 6  # the last token is sampled, never fed
