"""The families the project's decoder computes (longvideo.model.families, docs/models.md) against
transformers itself.

Tiny random models of each family are made here by transformers (2 layers, width 32-54, never
downloaded), with every bias and norm weight random (zeros and ones would hide a missing term):
Llama 2 (default RoPE), Llama 3.x (`llama3` RoPE, head_dim apart from hidden / heads, tied), Llama
with `linear` and with `dynamic` scaling, SmolLM2 (Llama, 9 / 3 heads, tied, the keys its
config.json adds), Qwen2.5 (q/k/v biases, tied), Qwen2.5 with `yarn`, Qwen3 (q/k norm, explicit
head_dim) and Mistral (no window). Checked:

* RoPE: each scaling's inverse frequencies and attention factor equal transformers' own functions
  bit for bit (`dynamic` at lengths below and past the original context);
* import -> logits at twice the original context (positions past it) within 1e-4 of transformers
  in float32 and 1e-10 relative in float64 -> export -> transformers loads the family's own class
  with the same logits -> import of the export gives every tensor bit for bit;
* every refusal names its key;
* (slow, 3 gloo ranks) one training step per family on rings of 2 and 3 and the Ulysses hybrid:
  loss and every gradient equal one process in float64 to 1e-10 relative; transformers' own model
  through `train.hf_model`'s wrapper (longvideo.hf.HFCausalLM) on a ring of 3 in float64 equals the
  project's decoder to 1e-10 (float64 stays float64: transformers' norms cast to float32);
* (slow) `longvideo chat` on a real encoded clip with an imported Qwen2.5 (yarn) and Llama 3.x model
  answers as transformers' `generate` on the export does, on one process and on a ring of 2.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from longvideo.checkpoint import build_model, load_pretrained
from longvideo.configtools import ConfigError
from longvideo.export import export_hf, import_hf
from longvideo.hf import HFCausalLM, keep_float64
from longvideo.model import ModelConfig, Transformer
from longvideo.model.config import RopeScaling
from longvideo.model.families import (
    FAMILIES,
    FamilyError,
    architecture_fields,
    model_config_from_hf,
)
from longvideo.model.layers import rope_frequencies
from longvideo.tokenizer import train_text_tokenizer

TEXT = ["the red circle moves left", "what colour was the flash frame", "blue green yellow"] * 5
ORIGINAL = 32  # every case's pretrained context: positions up to 2 x ORIGINAL are tested
COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=ORIGINAL,
    rms_norm_eps=1e-5,
)
CASES = {
    # name: (transformers config class, its arguments, keys added to the saved config.json)
    "llama2": ("LlamaConfig", dict(num_key_value_heads=4, rope_theta=1e4), {}),
    "llama3": (
        "LlamaConfig",
        dict(
            head_dim=16,  # not hidden / heads = 8
            tie_word_embeddings=True,
            max_position_embeddings=4 * ORIGINAL,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=5e5,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=ORIGINAL,
            ),
        ),
        {},
    ),
    "llama_linear": (
        "LlamaConfig",
        dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0)),
        {},
    ),
    "llama_dynamic": (
        "LlamaConfig",
        dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)),
        {},
    ),
    "smollm2": (
        "LlamaConfig",
        dict(
            hidden_size=54,
            intermediate_size=96,
            num_attention_heads=9,
            num_key_value_heads=3,
            tie_word_embeddings=True,
            rope_theta=1e5,
        ),
        {"rope_interleaved": False, "is_llama_config": True, "transformers.js_config": {}},
    ),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6), {}),
    "qwen2_yarn": (
        "Qwen2Config",
        dict(
            max_position_embeddings=4 * ORIGINAL,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=1e6,
                factor=4.0,
                original_max_position_embeddings=ORIGINAL,
            ),
        ),
        {},
    ),
    "qwen3": ("Qwen3Config", dict(head_dim=16, rope_theta=1e6), {}),
    "mistral": ("MistralConfig", dict(sliding_window=None, rope_theta=1e6), {}),
}
FAMILY_OF = {
    "llama2": "llama",
    "llama3": "llama",
    "llama_linear": "llama",
    "llama_dynamic": "llama",
    "smollm2": "llama",
    "qwen2": "qwen2",
    "qwen2_yarn": "qwen2",
    "qwen3": "qwen3",
    "mistral": "mistral",
}


@pytest.fixture(scope="module")
def tok():
    return train_text_tokenizer(TEXT, vocab_size=280)


def hf_config(name: str, vocab: int, **over):
    import transformers

    cls, kw, _ = CASES[name]
    return getattr(transformers, cls)(vocab_size=vocab, **{**COMMON, **kw, **over})


def randomize_vectors(model: torch.nn.Module, seed: int = 0) -> None:
    """Every 1-D parameter random: norm weights around 1, biases around 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                centre = 0.0 if n.endswith(".bias") else 1.0
                p.copy_(centre + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))


def make_hf_model(name: str, path: Path, vocab: int, tok=None, seed: int = 0, **over):
    """A random transformers model of case `name` (config arguments `over` replaced), saved (as a
    user brings one) into `path`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(name, vocab, **over)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    randomize_vectors(model, seed)
    model.save_pretrained(path)
    extra = CASES[name][2]
    if extra:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **extra}, indent=2))
    if tok is not None:
        tok.save(path)
    return model.eval()


def transformers_model(path, dtype):
    """transformers' model of `path`: eager in float32; in float64 sdpa (eager's softmax is float32)
    with float64 norms (transformers' cast them to float32: longvideo.hf.keep_float64)."""
    from transformers import AutoModelForCausalLM

    if dtype == torch.float32:
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    m = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float64)
    return keep_float64(m).eval()


def at_context(model: Transformer, max_seq_len: int) -> Transformer:
    """The same weights with the context raised to max_seq_len (as `model.max_seq_len=` does)."""
    cfg = replace(model.cfg, max_seq_len=max_seq_len)
    out = Transformer(cfg)
    out.load_state_dict(model.state_dict())
    return out.to(next(model.parameters()).dtype).eval()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


# ----------------------------------------------------------------------------- RoPE


def _hf_rope(cfg_dict: dict, seq_len=None):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c = LlamaConfig(**cfg_dict)
    rope_type = c.rope_parameters["rope_type"]
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(c)
    return ROPE_INIT_FUNCTIONS[rope_type](c, None, seq_len=seq_len)


@pytest.mark.parametrize(
    "params",
    [
        dict(rope_type="default"),
        dict(rope_type="linear", factor=2.0),
        dict(rope_type="linear", factor=3.7),
        dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=2.0,
            high_freq_factor=8.0,
            original_max_position_embeddings=512,
        ),
        dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096),
        dict(
            rope_type="yarn",
            factor=8.0,
            original_max_position_embeddings=2048,
            beta_fast=16.0,
            beta_slow=2.0,
            mscale=1.0,
            mscale_all_dim=0.7,
            truncate=False,
        ),
        dict(
            rope_type="yarn",
            factor=2.0,
            original_max_position_embeddings=1024,
            attention_factor=1.3,
        ),
    ],
)
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_rope_frequencies_are_transformers_bit_for_bit(params, head_dim):
    theta = 5e5
    hf = dict(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=4 * params.get("original_max_position_embeddings", 2048),
        rope_parameters={**params, "rope_theta": theta},
    )
    want, want_factor = _hf_rope(hf)
    mc = model_config_from_hf(
        {
            "model_type": "llama",
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            **hf,
        },
        ModelConfig(),
        text_vocab_size=10,
        codebook_size=4,
    )
    got, factor = rope_frequencies(mc.head_dim, mc.rope_theta, mc.rope_scaling, mc.max_seq_len)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert factor == want_factor


@pytest.mark.parametrize("context", [1000, 2048, 2049, 3000, 8192])
def test_dynamic_rope_is_transformers_at_the_context(context):
    """dynamic: the frequencies transformers uses for a forward whose longest position is
    context - 1 (its initial ones up to max_position_embeddings, which is the original)."""
    original, head_dim = 2048, 64
    hf = dict(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=original,
        rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0),
    )
    if context > original:  # the growth path: seq_len = max(position_ids) + 1, a tensor
        want, _ = _hf_rope(hf, seq_len=torch.tensor(context))
    else:
        want, _ = _hf_rope(hf)
    mc = model_config_from_hf(
        {"model_type": "llama", "intermediate_size": 8, "num_hidden_layers": 1, **hf},
        ModelConfig(),
        text_vocab_size=10,
        codebook_size=4,
    )
    assert mc.rope_scaling.original_max_seq_len == original and mc.max_seq_len == original
    got, _ = rope_frequencies(head_dim, mc.rope_theta, mc.rope_scaling, context)
    assert torch.equal(got, want)
    if context > original:
        assert not torch.equal(got, rope_frequencies(head_dim, 1e4)[0])


def test_dynamic_at_a_context_is_default_rope_with_a_larger_theta():
    """What docs/models.md says to freeze a dynamic model: at context L its frequencies are the
    default RoPE's with rope_theta = theta ((factor L / original) - (factor - 1))^(d / (d - 2)),
    computed in float32 as transformers does, bit for bit."""
    s = RopeScaling(type="dynamic", factor=2.0, original_max_seq_len=2048)
    for L in (3000, 8192, 100000):
        base = 1e4 * ((2.0 * torch.tensor(L) / 2048) - (2.0 - 1)) ** (64 / 62)
        assert torch.equal(rope_frequencies(64, 1e4, s, L)[0], rope_frequencies(64, float(base))[0])


# ----------------------------------------------------------------------------- import / export


@pytest.mark.parametrize("name", list(CASES))
def test_import_logits_export_and_back(tmp_path, tok, name):
    """import -> the project's logits past the original context equal transformers' (fp32 1e-4,
    fp64 1e-10 relative) -> export is the same family, loaded by transformers without remote code
    and equal again -> the export imports back bit for bit."""
    from transformers import AutoModelForCausalLM

    V = tok.text_size
    src = tmp_path / "hf"
    make_hf_model(name, src, V, tok)
    import_hf(src, tmp_path / "ckpt", codebook_size=16)
    pre = load_pretrained(tmp_path / "ckpt")
    mc = pre.config.model
    assert mc.family == FAMILY_OF[name] and mc.vocab_size == V + 4 + 16
    S = 2 * ORIGINAL  # positions past the original context
    model = pre.model if mc.max_seq_len >= S else at_context(pre.model, S)  # dynamic: extend
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(1))
    errors = {}
    with torch.no_grad():
        for dtype, tol in ((torch.float32, 1e-4), (torch.float64, 1e-10)):
            ours = model.to(dtype)
            got = ours.logits(ours(ids))[..., :V]
            want = transformers_model(src, dtype)(ids).logits
            err = (got - want).abs().max().item() if dtype == torch.float32 else rel(got, want)
            errors[dtype] = err
            assert err <= tol, f"{name} {dtype}: {err:.3g}"
    model.float()

    export_hf(tmp_path / "ckpt", tmp_path / "out")
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    fam = FAMILIES[FAMILY_OF[name]]
    assert (conf["model_type"], conf["architectures"]) == (fam.model_type, [fam.architecture])
    assert conf["rope_parameters"]["rope_type"] == mc.rope_scaling.type
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert type(exported).__name__ == fam.architecture
    all_ids = torch.randint(0, mc.vocab_size, (2, S), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.logits(model(all_ids))
        torch.testing.assert_close(exported(all_ids).logits, want, atol=1e-4, rtol=0)
        errors["export fp32"] = (exported(all_ids).logits - want).abs().max().item()
        ex64 = transformers_model(tmp_path / "out", torch.float64)
        m64 = model.double()
        errors["export fp64"] = rel(ex64(all_ids).logits, m64.logits(m64(all_ids)))
        assert errors["export fp64"] <= 1e-10
    # the text rows and every other tensor of the source, bit for bit
    a, b = (
        load_file(str(src / "model.safetensors")),
        load_file(str(tmp_path / "out" / "model.safetensors")),
    )
    for k, t in a.items():
        u = b[k][: t.shape[0]] if k.endswith(("embed_tokens.weight", "lm_head.weight")) else b[k]
        assert torch.equal(t, u), k
    # the family reader reads the export's config.json as the same architecture
    back = model_config_from_hf(
        conf, ModelConfig(), text_vocab_size=mc.text_vocab_size, codebook_size=16
    )
    assert architecture_fields(back) == architecture_fields(mc)
    # and importing the export reproduces every tensor
    import_hf(tmp_path / "out", tmp_path / "ckpt2")
    x, y = (
        load_file(str(tmp_path / "ckpt" / "model.safetensors")),
        load_file(str(tmp_path / "ckpt2" / "model.safetensors")),
    )
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    print(
        f"{name}: fp32 max abs {errors[torch.float32]:.2e}, fp64 rel {errors[torch.float64]:.2e}; "
        f"export: fp32 {errors['export fp32']:.2e}, fp64 rel {errors['export fp64']:.2e}"
    )


def _hf_dict(name: str, **over) -> dict:
    d = {k: v for k, v in hf_config(name, 64).to_dict().items()}
    d.update(over)
    return d


def _refused(hf: dict, key: str) -> None:
    with pytest.raises(FamilyError) as e:
        model_config_from_hf(hf, ModelConfig(), text_vocab_size=64, codebook_size=4)
    assert e.value.key == key, e.value
    assert f"'{key}'" in str(e.value)


def test_what_is_not_computed_is_refused_naming_the_key():
    from longvideo.model.config import FAMILY_NAMES

    assert tuple(FAMILIES) == FAMILY_NAMES  # model.family's values are the families' names
    for name in CASES:  # what transformers itself writes is read whole
        model_config_from_hf(_hf_dict(name), ModelConfig(), text_vocab_size=64, codebook_size=4)
    _refused(_hf_dict("llama2", quantization_config={"bits": 4}), "quantization_config")
    _refused(_hf_dict("llama2", some_new_key=1), "some_new_key")
    _refused(_hf_dict("llama2", mlp_bias=True), "mlp_bias")
    _refused(_hf_dict("smollm2", rope_interleaved=True), "rope_interleaved")
    _refused(_hf_dict("llama2", hidden_act="gelu"), "hidden_act")
    _refused(_hf_dict("llama2", attention_dropout=0.1), "attention_dropout")
    _refused(_hf_dict("llama2", partial_rotary_factor=0.5), "partial_rotary_factor")
    _refused(_hf_dict("llama2", model_type="gemma2"), "model_type")
    _refused(_hf_dict("llama2", architectures=["MistralForCausalLM"]), "architectures")
    _refused(
        _hf_dict("llama2", rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
        "rope_parameters.rope_type",
    )
    _refused(
        _hf_dict(
            "llama2", rope_parameters={"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1}
        ),
        "rope_parameters.low_freq_factor",
    )
    _refused(
        _hf_dict("llama2", rope_parameters={"rope_type": "linear", "factor": 0.5}),
        "rope_parameters.factor",
    )
    _refused(_hf_dict("llama2", rope_parameters={"rope_type": "dynamic"}), "rope_parameters.factor")
    # windows: refused unless they cover the context
    _refused(_hf_dict("mistral", sliding_window=16), "sliding_window")
    model_config_from_hf(
        _hf_dict("mistral", sliding_window=ORIGINAL),
        ModelConfig(),
        text_vocab_size=64,
        codebook_size=4,
    )
    qwen = _hf_dict("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    qwen.pop("layer_types")
    _refused(qwen, "use_sliding_window")
    qwen["max_window_layers"] = 2  # no layer uses the window
    model_config_from_hf(qwen, ModelConfig(), text_vocab_size=64, codebook_size=4)
    _refused(_hf_dict("qwen3", layer_types=["full_attention"]), "layer_types")


def test_configs_a_family_cannot_express_are_refused_before_a_run(tmp_path, tok):
    from longvideo.config import Config
    from longvideo.vq.config import VQConfig

    base = dict(text_vocab_size=20, codebook_size=4, dim=32, n_layers=1, n_heads=4)
    for bad, key in (
        (dict(family="qwen2"), "model.qkv_bias"),
        (dict(family="qwen3"), "model.qk_norm"),
        (dict(family="llama", qkv_bias=True), "model.attn_out_bias"),
        (dict(family="mistral", qkv_bias=True, attn_out_bias=True), "model.qkv_bias"),
        (dict(family="qwen2", qkv_bias=True, attn_logn_base=8), "model.attn_logn_base"),
    ):
        with pytest.raises(ConfigError) as e:
            build_model(Config(model=ModelConfig(**base, **bad), vq=VQConfig(codebook_size=4)))
        assert e.value.key == key, (bad, e.value)
    # a vocab_size that is not the embedding's rows
    src = tmp_path / "hf"
    make_hf_model("qwen2", src, tok.text_size, tok)
    conf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**conf, "vocab_size": tok.text_size + 1}))
    with pytest.raises(FamilyError, match="vocab_size"):
        import_hf(src, tmp_path / "ckpt")


def test_hf_causal_lm_keeps_float64_in_float64(tmp_path, tok):
    """transformers' RMSNorm casts to float32 whatever the dtype: through longvideo.hf.HFCausalLM
    (train.hf_model) a float64 model stays float64 and equals the project's decoder to 1e-12; the
    model as transformers has it is only float32-accurate (so the check has teeth)."""
    from transformers import AutoModelForCausalLM

    src = tmp_path / "hf"
    make_hf_model("smollm2", src, tok.text_size, tok)
    import_hf(src, tmp_path / "ckpt", codebook_size=16)
    ours = load_pretrained(tmp_path / "ckpt").model.double()
    ids = torch.randint(0, tok.text_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours.logits(ours(ids))[..., : tok.text_size]
        plain = AutoModelForCausalLM.from_pretrained(src, attn_implementation="sdpa").double()
        assert rel(plain(ids).logits, want) > 1e-9  # float32 norms
        lm = HFCausalLM(plain)
        hidden = lm.model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        assert rel(lm.model.lm_head(hidden), want) <= 1e-12


# ----------------------------------------------------------------------------- rings (slow)


def _packed_batch(vocab: int) -> dict:
    """2 rows of S = 2 x ORIGINAL + 5 tokens (not a multiple of 2W for W = 2, 3): row 0 one
    document of 2 x ORIGINAL + 2 tokens (positions past the original context) and padding; row 1
    packed documents of 40, 3, 1, 20 and 5 tokens, the last zero-weighted."""
    S = 2 * ORIGINAL + 5
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, S), generator=g)
    targets = torch.randint(0, vocab, (2, S), generator=g)
    weights = torch.randint(1, 3, (2, S), generator=g).double() / 2  # 0.5, 1
    seg = torch.full((2, S), -1)
    pos = torch.zeros(2, S, dtype=torch.long)
    n0 = 2 * ORIGINAL + 2
    seg[0, :n0], pos[0, :n0] = 0, torch.arange(n0)
    i = 0
    for d, n in enumerate((40, 3, 1, 20, 5)):
        seg[1, i : i + n], pos[1, i : i + n] = d, torch.arange(n)
        i += n
    weights[1, i - 5 : i] = 0
    weights[seg < 0] = 0
    return dict(
        input_ids=ids, targets=targets, loss_weights=weights, positions=pos, segment_ids=seg
    )


def _project_step(cfg: ModelConfig, batch: dict, seam=None, group=None, weights=None):
    """(loss, grads) of one float64 step of the project's decoder (random weights, or `weights`)
    on `batch` (the whole batch, or this rank's zigzag shard over `group` with `seam`), the loss
    normalised by the whole batch's weight total and the gradients summed over the group."""
    import torch.distributed as dist

    from longvideo.parallel import shard_batch

    torch.manual_seed(0)
    model = Transformer(cfg, ffn_chunk=16, loss_chunk=24).double().train()
    randomize_vectors(model)
    if weights is not None:
        model.load_state_dict(weights)
    total = float(batch["loss_weights"].sum())
    if seam is not None:
        model.set_attention(seam)
        batch = shard_batch(batch, group)
    loss = (
        model(
            batch["input_ids"],
            batch["positions"],
            batch["segment_ids"],
            targets=batch["targets"],
            loss_weights=batch["loss_weights"],
        )
        / total
    )
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    value = loss.detach().clone()
    if group is not None or seam is not None:
        dist.all_reduce(value, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
    return value, grads


def _assert_same(what, got, ref, tol=1e-10):
    (loss, grads), (rloss, rgrads) = got, ref
    assert abs(float(loss - rloss)) <= tol * abs(float(rloss)), f"{what}: loss {loss} vs {rloss}"
    assert grads.keys() == rgrads.keys(), sorted(set(grads) ^ set(rgrads))
    worst = 0.0
    for n, g in rgrads.items():
        err = rel(grads[n], g)
        worst = max(worst, err)
        assert err <= tol, f"{what}: gradient {n} relative error {err:.3g}"
    return worst


def _rings_body(rank, world, configs, smol):
    import torch.distributed as dist

    from longvideo.parallel import RingAttentionSeam, split_group

    two = dist.new_group([0, 1])
    hybrid = split_group(dist.group.WORLD, 3)  # collective: every rank
    worst = {}
    for name, cfg in configs.items():
        batch = _packed_batch(cfg.text_vocab_size)
        ref = _project_step(cfg, batch)
        seams = [("ring of 3", RingAttentionSeam(None, "torch"), None)]
        seams.append(("Ulysses 3 x ring 1", RingAttentionSeam(None, "cpu", hybrid), None))
        if rank < 2:
            seams.insert(0, ("ring of 2", RingAttentionSeam(two, "cpu"), two))
        for what, seam, group in seams:
            err = _assert_same(f"{name}, {what}", _project_step(cfg, batch, seam, group), ref)
            worst[name] = max(worst.get(name, 0.0), err)
        dist.barrier()
    # transformers' SmolLM2-shaped model through train.hf_model's wrapper, float64, ring of 3
    src, mcfg, weights = smol
    batch = _packed_batch(mcfg.vocab_size)
    ref = _project_step(mcfg, batch, weights=weights)
    got = _hf_step(src, batch, RingAttentionSeam(None, "auto"))
    worst["smollm2 HFCausalLM ring of 3"] = _assert_same("HFCausalLM ring of 3", got, ref)
    if rank == 0:
        print("largest relative gradient error:", {k: f"{v:.1e}" for k, v in worst.items()})


def _hf_step(src, batch, seam):
    """(loss, grads under the project's names) of HFCausalLM (train.hf_model's wrapper around
    transformers' own model, float64) on this rank's shard, as _project_step."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from longvideo.model.families import own_name
    from longvideo.parallel import shard_batch

    model = AutoModelForCausalLM.from_pretrained(src, attn_implementation="sdpa")
    lm = HFCausalLM(model.double().train(), loss_chunk=24)
    lm.set_attention(seam)
    total = float(batch["loss_weights"].sum())
    local = shard_batch(batch, None)
    loss = (
        lm(
            local["input_ids"],
            local["positions"],
            local["segment_ids"],
            local["targets"],
            local["loss_weights"],
        )
        / total
    )
    loss.backward()
    grads = {}
    for n, p in lm.model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g)
        grads[own_name(n)] = g
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value, grads


@pytest.mark.slow
@pytest.mark.distributed
def test_each_family_trains_on_rings_as_one_process(tmp_path, tok):
    """One float64 training step per family on a ring of 2, a ring of 3 and the Ulysses hybrid
    (3 ranks, heads all-to-all): the loss and every gradient equal one process to 1e-10 relative;
    transformers' own SmolLM2-shaped model through HFCausalLM on a ring of 3 equals the project's
    decoder one process (float64 stays float64 on every route)."""
    from distributed import run_ranks

    from longvideo.checkpoint import from_hf_names, read_safetensors_dir

    configs = {}
    for name in CASES:
        mc = model_config_from_hf(
            hf_config(name, 64).to_dict(), ModelConfig(), text_vocab_size=44, codebook_size=16
        )
        configs[name] = mc if mc.max_seq_len >= 2 * ORIGINAL else replace(mc, max_seq_len=80)
    src = tmp_path / "smol"
    make_hf_model("smollm2", src, 64)
    hf = json.loads((src / "config.json").read_text())
    mcfg = model_config_from_hf(hf, ModelConfig(), text_vocab_size=44, codebook_size=16)
    sd = {k: v.double() for k, v in from_hf_names(read_safetensors_dir(src), mcfg).items()}
    run_ranks(_rings_body, world=3, args=(configs, (str(src), mcfg, sd)), timeout=600)


# ----------------------------------------------------------------------------- chat (slow)

QUESTION = "what colour was the flash frame"


def _chat_checkpoint(name: str, tmp_path: Path, tok) -> Path:
    """An imported model of case `name` (context 256, its original context still ORIGINAL) with a
    random tiny VQ: a checkpoint `longvideo chat` reads."""
    from longvideo.config import load_config, save_config
    from longvideo.vq import VQConfig, VQModel

    src = tmp_path / f"{name}_hf"
    make_hf_model(name, src, tok.text_size, tok, max_position_embeddings=256)
    ckpt = import_hf(src, tmp_path / f"{name}_ckpt", codebook_size=16)
    vq_cfg = VQConfig(
        mode="2d",
        resolution=16,
        downsample=4,
        temporal_downsample=2,
        codebook_size=16,
        channels=8,
        channel_mult=(1, 1, 1),
        num_res_blocks=1,
    )
    torch.manual_seed(1)
    VQModel(vq_cfg).eval().save(ckpt / "vq")
    cfg = load_config(ckpt / "config.yaml")
    save_config(replace(cfg, vq=vq_cfg), ckpt / "config.yaml")
    return ckpt


def _chat_ring_body(rank, world, cases):
    from distributed import chat_lines

    for ckpt, clip, expected in cases:
        lines = chat_lines(ckpt, clip, QUESTION)
        assert lines == ([expected] if rank == 0 else []), ckpt


@pytest.mark.slow
@pytest.mark.distributed
def test_chat_on_imported_models_answers_as_transformers_generate(tmp_path, tok, one_thread):
    """`longvideo chat` on a real encoded clip (tests/material: an H.264 mp4) with an imported
    Qwen2.5 (yarn) and Llama 3.x model: its greedy answer ids are transformers' `generate` on the
    export with the same prompt ids (which the export's processor also builds), and a ring of 2
    prints the same answer."""
    from distributed import run_ranks
    from material.corpus import CONTAINERS, encode
    from transformers import AutoModelForCausalLM

    from longvideo.export import LongVideoProcessor
    from longvideo.infer.chat import ChatSession, infer_config

    clip = tmp_path / "clip.mp4"
    clip.write_bytes(encode(CONTAINERS[0]))
    ring_cases = []
    for name in ("qwen2_yarn", "llama3"):
        ckpt = _chat_checkpoint(name, tmp_path, tok)
        pre = load_pretrained(ckpt)
        assert pre.config.model.rope_scaling.type in ("yarn", "llama3")
        session = ChatSession.from_video(
            pre, str(clip), infer=infer_config(pre, max_new_tokens=8), progress=False
        )
        text = session.ask(QUESTION)
        prompt = session.prompt(QUESTION).ids
        assert len(prompt) > 2 * ORIGINAL  # positions past the original context
        generated = session.last.tokens[0].tolist()

        out = export_hf(ckpt, tmp_path / f"{name}_out")
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(model).__name__ == FAMILIES[FAMILY_OF[name]].architecture
        proc = LongVideoProcessor.from_pretrained(out)
        inputs = proc(str(clip), QUESTION)
        assert inputs["input_ids"][0].tolist() == prompt
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        answer = ids[0, len(prompt) :].tolist()
        eos = pre.tokenizer.eos_id
        stop = generated.index(eos) + 1 if eos in generated else len(generated)
        assert stop >= 2 and answer[:stop] == generated[:stop], (name, answer, generated)
        ring_cases.append((str(ckpt), str(clip), text))
    run_ranks(_chat_ring_body, world=2, args=(ring_cases,), timeout=400)


# ----------------------------------------------------------------------------- released models

PUBLISHED = {
    # the config.json keys and values these releases publish (no weights are read)
    "llama-7b (Llama 1, converted)": {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 11008,
        "max_position_embeddings": 2048,
        "max_sequence_length": 2048,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.28.0.dev0",
        "use_cache": True,
        "vocab_size": 32000,
    },
    "Llama-2-7b-hf": {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 11008,
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.31.0.dev0",
        "use_cache": True,
        "vocab_size": 32000,
    },
    "Llama-3.2-1B": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0",
        "use_cache": True,
        "vocab_size": 128256,
    },
    "SmolLM2-135M": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "hidden_act": "silu",
        "hidden_size": 576,
        "initializer_range": 0.041666666666666664,
        "intermediate_size": 1536,
        "is_llama_config": True,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 9,
        "num_hidden_layers": 30,
        "num_key_value_heads": 3,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_interleaved": False,
        "rope_scaling": None,
        "rope_theta": 100000,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}},
        "transformers_version": "4.42.3",
        "use_cache": True,
        "vocab_size": 49152,
    },
    "Qwen2.5-0.5B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "hidden_size": 896,
        "initializer_range": 0.02,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "max_window_layers": 21,
        "model_type": "qwen2",
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "Mistral-7B-v0.3": {
        "architectures": ["MistralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.42.0.dev0",
        "use_cache": True,
        "vocab_size": 32768,
    },
}


def test_published_configs_are_read_whole():
    """The config.json of each family's releases maps onto the decoder (no key refused); Qwen2.5's
    documented YaRN setting for 128K too; Mistral 7B v0.1's 4K window under a 32K context is
    refused; the shipped configs/llama3.2-1b.yaml is Llama 3.2 1B as import-hf reads it, and its
    ladder changes only the scaling factor and the context."""
    from longvideo.config import load_config

    got = {
        name: model_config_from_hf(hf, ModelConfig(), text_vocab_size=100, codebook_size=16)
        for name, hf in PUBLISHED.items()
    }
    assert got["Qwen3-0.6B"].head_dim == 128 and got["Qwen3-0.6B"].qk_norm
    assert got["Qwen2.5-0.5B-Instruct"].qkv_bias and got["Qwen2.5-0.5B-Instruct"].tie_embeddings
    assert got["Mistral-7B-v0.3"].family == "mistral"
    assert got["SmolLM2-135M"].n_kv_heads == 3 and got["SmolLM2-135M"].rope_theta == 1e5
    yarn = dict(
        PUBLISHED["Qwen2.5-0.5B-Instruct"],
        rope_scaling={"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
    )
    scaled = model_config_from_hf(yarn, ModelConfig(), text_vocab_size=100, codebook_size=16)
    assert (scaled.rope_scaling.type, scaled.rope_scaling.factor) == ("yarn", 4.0)
    v01 = dict(PUBLISHED["Mistral-7B-v0.3"], sliding_window=4096, vocab_size=32000)
    _refused(v01, "sliding_window")

    shipped = load_config("llama3.2-1b").model
    llama = model_config_from_hf(
        PUBLISHED["Llama-3.2-1B"],
        shipped,
        text_vocab_size=shipped.text_vocab_size,
        codebook_size=shipped.codebook_size,
    )
    assert llama == shipped
    for stage, factor, context in (
        ("llama3-text-256k", 64.0, 262144),
        ("llama3-text-1m", 256.0, 2**20),
    ):
        m = load_config(f"stages/{stage}").model
        assert m == replace(
            shipped, rope_scaling=replace(shipped.rope_scaling, factor=factor), max_seq_len=context
        )
