"""The decoder against transformers' Llama, and its memory-saving parts against plain computations."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from longvideo.checkpoint import to_hf_names
from longvideo.model import KVCache, ModelConfig, Transformer, chunked_cross_entropy, token_weights
from longvideo.parallel import apply_activation_checkpointing


def tiny_cfg(**kw):
    base = dict(
        text_vocab_size=90,
        codebook_size=10,
        dim=48,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=80,
        rope_theta=1000.0,
    )
    base.update(kw)
    return ModelConfig(**base)


def hf_twin(model: Transformer) -> LlamaForCausalLM:
    c = model.cfg
    hc = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.dim,
        intermediate_size=c.ffn_dim,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings,
        max_position_embeddings=c.max_seq_len,
    )
    hc._attn_implementation = "eager"
    hf = LlamaForCausalLM(hc)
    sd = {k: v.detach().clone() for k, v in to_hf_names(model.state_dict(), c).items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all(m == "lm_head.weight" for m in missing)
    if c.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf


@pytest.mark.parametrize("n_kv_heads,tie", [(4, False), (2, False), (2, True), (1, True)])
def test_logits_and_grads_match_transformers(n_kv_heads, tie):
    torch.manual_seed(0)
    model = Transformer(tiny_cfg(n_kv_heads=n_kv_heads, tie_embeddings=tie))
    hf = hf_twin(model)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 23))
    ours = model.logits(model(ids))
    ref = hf(ids).logits
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)

    targets = torch.randint(0, model.cfg.vocab_size, (2, 23))
    loss_sum = model(ids, targets=targets)
    (loss_sum / token_weights(targets).sum()).backward()
    F.cross_entropy(ref.reshape(-1, ref.shape[-1]), targets.reshape(-1)).backward()
    hf_params = dict(hf.named_parameters())
    for name, g in to_hf_names({n: p.grad for n, p in model.named_parameters()}, model.cfg).items():
        torch.testing.assert_close(g, hf_params[name].grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("logn_base", [0, 4])
def test_packed_documents_equal_separate_runs(logn_base):
    torch.manual_seed(1)
    model = Transformer(tiny_cfg(attn_logn_base=logn_base)).double()
    a = torch.randint(0, 100, (1, 9))
    b = torch.randint(0, 100, (1, 14))
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(9), torch.arange(14)])[None]
    segments = torch.cat([torch.zeros(9), torch.ones(14)]).long()[None]
    out = model.logits(model(packed, positions, segments))
    torch.testing.assert_close(out[:, :9], model.logits(model(a)), atol=1e-10, rtol=0)
    torch.testing.assert_close(out[:, 9:], model.logits(model(b)), atol=1e-10, rtol=0)


def test_blockwise_ffn_and_checkpointing_equal_plain():
    """Feed-forward and loss in chunks, every block checkpointed from outside (the wrapper keeps the
    blocks' parameter names): the same loss and gradients as the plain model."""
    torch.manual_seed(2)
    plain = Transformer(tiny_cfg(), loss_chunk=0).double()
    chunked = Transformer(tiny_cfg(), ffn_chunk=5, loss_chunk=7).double()
    apply_activation_checkpointing(chunked)
    assert chunked.state_dict().keys() == plain.state_dict().keys()
    chunked.load_state_dict(plain.state_dict())
    chunked.train()
    ids = torch.randint(0, 100, (2, 31))
    targets = torch.randint(0, 100, (2, 31))
    weights = torch.rand(2, 31, dtype=torch.float64)
    losses = []
    for m in (plain, chunked):
        s = m(ids, targets=targets, loss_weights=weights)
        s.backward()
        losses.append(s.detach())
    torch.testing.assert_close(losses[0], losses[1], atol=1e-10, rtol=0)
    for (n, p), q in zip(plain.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-10, rtol=0, msg=n)


@pytest.mark.parametrize("chunk", [0, 1, 6, 64])
def test_chunked_cross_entropy_equals_plain(chunk):
    torch.manual_seed(3)
    h = torch.randn(29, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (29,))
    lw = torch.rand(29, dtype=torch.float64)
    ours = chunked_cross_entropy(h, w, t, lw, chunk)
    ref = (F.cross_entropy(h @ w.t(), t, reduction="none") * lw).sum()
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0)
    g = torch.tensor(0.7, dtype=torch.float64)
    gh, gw = torch.autograd.grad(ours, (h, w), g)
    rh, rw = torch.autograd.grad(ref, (h, w), g)
    torch.testing.assert_close(gh, rh, atol=1e-10, rtol=0)
    torch.testing.assert_close(gw, rw, atol=1e-10, rtol=0)


def test_negative_targets_carry_no_loss():
    torch.manual_seed(4)
    model = Transformer(tiny_cfg())
    ids = torch.randint(0, 100, (1, 10))
    t = torch.randint(0, 100, (1, 10))
    t_masked = t.clone()
    t_masked[0, :4] = -100
    w = torch.ones(1, 10)
    w[0, :4] = 0
    s1 = model(ids, targets=t_masked)
    s2 = model(ids, targets=t, loss_weights=w)
    torch.testing.assert_close(s1, s2)
    assert token_weights(t_masked).sum().item() == token_weights(t, w).sum().item() == 6


@pytest.mark.parametrize("kept", [0, 3, 24])
def test_head_on_weighted_tokens_only_equals_every_token(kept):
    """Only tokens with a loss reach the head; loss and gradients equal a float64 model that projects
    every token through a plain cross-entropy (none, some, all tokens weighted; chunk smaller than N)."""
    torch.manual_seed(6)
    model = Transformer(tiny_cfg(), loss_chunk=5).double()
    ids, t = torch.randint(0, 100, (2, 12)), torch.randint(0, 100, (2, 12))
    w = torch.zeros(2, 12, dtype=torch.float64)
    # weights exact in float32 (the head reads them as float32)
    w.view(-1)[torch.randperm(24)[:kept]] = torch.randint(1, 5, (kept,), dtype=torch.float64) / 4
    loss = model(ids, targets=t, loss_weights=w)
    loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model.logits(model(ids))
    ref = (
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1), reduction="none")
        * w.reshape(-1)
    ).sum()
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-12, rtol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, atol=1e-12, rtol=0, msg=n)
    if kept == 0:
        assert loss.item() == 0 and all(g.abs().max() == 0 for g in ours.values())


def test_head_skips_unweighted_tokens(monkeypatch):
    """The head projects as many tokens as carry a loss (the point of skipping: answer-only rows)."""
    import longvideo.model.head as head_mod

    torch.manual_seed(7)
    model = Transformer(tiny_cfg())
    rows, real = [], head_mod.chunked_cross_entropy
    monkeypatch.setattr(
        head_mod, "chunked_cross_entropy", lambda h, *a: rows.append(h.shape[0]) or real(h, *a)
    )
    w = torch.zeros(1, 10)
    w[0, [2, 7]] = 1
    ids, t = torch.randint(0, 100, (1, 10)), torch.randint(0, 100, (1, 10))
    skipped = model(ids, targets=t, loss_weights=w)
    model.head.skip_unweighted = False
    every = model(ids, targets=t, loss_weights=w)
    assert rows == [2, 10]
    torch.testing.assert_close(skipped, every)


@pytest.mark.parametrize("logn_base", [0, 4])
def test_kv_cache_matches_full_forward(logn_base):
    torch.manual_seed(5)
    model = Transformer(tiny_cfg(attn_logn_base=logn_base)).double().eval()
    ids = torch.randint(0, 100, (2, 17))
    full = model.logits(model(ids))
    cache = KVCache(model.cfg, batch=2, max_len=32, dtype=torch.float64)
    steps = [model.logits(model(ids[:, :8], cache=cache))]
    for t in range(8, 17):
        steps.append(model.logits(model(ids[:, t : t + 1], cache=cache)))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-10, rtol=0)
    assert cache.length == 17


def test_logn_scales_each_querys_logits_by_the_log_of_its_position():
    """attn_logn_base: the attention layer against a float64 softmax written out here, RoPE as a
    complex rotation, every query's logits multiplied by max(1, ln(p + 1) / ln(base))."""
    from longvideo.kernels import AttentionMeta
    from longvideo.model.attention import Attention, LocalAttention
    from longvideo.model.layers import rope_cos_sin, rope_frequencies

    torch.manual_seed(6)
    base, S = 4, 13
    cfg = tiny_cfg(attn_logn_base=base)
    attn = Attention(cfg).double()
    x = torch.randn(1, S, cfg.dim, dtype=torch.float64)
    pos, seg = torch.arange(S)[None], torch.zeros(1, S, dtype=torch.long)
    cos, sin = rope_cos_sin(pos, rope_frequencies(cfg.head_dim, cfg.rope_theta)[0], torch.float64)
    ours = attn(x, cos, sin, AttentionMeta.self_attention(pos, seg), LocalAttention())

    D, H, Hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    angle = torch.arange(S, dtype=torch.float64)[:, None] / cfg.rope_theta ** (
        torch.arange(0, D, 2) / D
    )

    def rotate(t):  # (S, heads, D), half-split pairs (t[i], t[i + D/2]) as complex numbers
        z = (
            torch.complex(t[..., : D // 2], t[..., D // 2 :])
            * torch.polar(torch.ones_like(angle), angle)[:, None]
        )
        return torch.cat([z.real, z.imag], dim=-1)

    q = rotate((x[0] @ attn.wq.weight.T).view(S, H, D))
    k = rotate((x[0] @ attn.wk.weight.T).view(S, Hkv, D)).repeat_interleave(H // Hkv, dim=1)
    v = (x[0] @ attn.wv.weight.T).view(S, Hkv, D).repeat_interleave(H // Hkv, dim=1)
    scale = torch.tensor(
        [max(1.0, math.log(p + 1) / math.log(base)) for p in range(S)], dtype=torch.float64
    )
    logits = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D) * scale[None, :, None]
    logits = logits.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", logits.softmax(-1), v).reshape(S, H * D) @ attn.wo.weight.T
    torch.testing.assert_close(
        ours[0], ref, atol=1e-7, rtol=0
    )  # the model computes RoPE angles in fp32
    assert scale[-1] > 1.8  # the last queries are scaled, so ignoring the scale would fail above


def test_logn_scale_is_exactly_one_below_its_base():
    """The hour ladder's short rungs (attn_logn_base 4096, contexts <= 4096) compute what a model
    without the scale computes, bit for bit."""
    from longvideo.model.layers import logn_scale

    s = logn_scale(torch.arange(8192)[None], 4096, torch.float32).flatten()
    assert torch.equal(s[:4096], torch.ones(4096))
    assert (s[4096:] > 1).all() and abs(float(s[-1]) - math.log(8192) / math.log(4096)) < 1e-6


def test_fsq_code_init_gives_code_rows_the_tokenizers_geometry():
    from longvideo.vq.quantizer import fsq_codebook

    levels = (4, 3, 3)  # 36 codes in a 3-d latent
    cfg = tiny_cfg(codebook_size=36, code_init="fsq")
    torch.manual_seed(0)
    model = Transformer(cfg)
    before = model.tok_embeddings.weight.detach().clone()
    latents = fsq_codebook(levels)
    model.init_code_embeddings(latents, noise=0.0)
    w = model.tok_embeddings.weight.detach()
    off = cfg.vocab.vq_offset
    codes = w[off : off + 36]
    other = torch.cat([w[:off], w[off + 36 :]])
    assert torch.equal(
        other, torch.cat([before[:off], before[off + 36 :]])
    )  # text and specials untouched
    assert abs(codes.std().item() - cfg.init_std) < 0.3 * cfg.init_std
    # without noise the rows are a linear image of the latents: rank 3, and their pairwise distances
    # order like the latents' (a projection to 48 dimensions nearly keeps distances)
    assert torch.linalg.matrix_rank(codes.double(), rtol=1e-6) == 3
    dz = torch.cdist(latents.double(), latents.double()).flatten()
    de = torch.cdist(codes.double(), codes.double()).flatten()
    assert torch.corrcoef(torch.stack([dz, de]))[0, 1] > 0.9
    # with the default noise the geometry still dominates, and the rows are no longer degenerate
    model.init_code_embeddings(latents)
    noisy = model.tok_embeddings.weight.detach()[off : off + 36].double()
    assert torch.linalg.matrix_rank(noisy) == 36
    assert torch.corrcoef(torch.stack([dz, torch.cdist(noisy, noisy).flatten()]))[0, 1] > 0.8
    with pytest.raises(ValueError, match="latents"):
        model.init_code_embeddings(latents[:10])
