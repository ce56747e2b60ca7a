"""Hugging Face import/export: transformers loads the export with no custom code, same logits;
import -> export keeps every weight bit for bit; bad inputs name the file or tensor."""

import inspect
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from longvideo.checkpoint import CheckpointError, load_pretrained, save_project_checkpoint
from longvideo.config import Config
from longvideo.export import export_hf, import_hf
from longvideo.model import ModelConfig, Transformer
from longvideo.model.families import FamilyError
from longvideo.tokenizer import TextTokenizer, train_text_tokenizer
from longvideo.vq.config import VQConfig

TEXT = ["the red circle moves left", "what colour was the flash frame", "blue green yellow"] * 5


@pytest.fixture(scope="module")
def tok():
    return train_text_tokenizer(TEXT, vocab_size=280)


def foreign_llama(path, vocab, tie, kv_heads, rope_theta=2e4):
    """A plain transformers Llama checkpoint, as a user would bring one."""
    torch.manual_seed(0)
    hc = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tie,
        rope_theta=rope_theta,
    )
    m = LlamaForCausalLM(hc)
    m.save_pretrained(path)
    return m


@pytest.mark.parametrize("tie,kv", [(False, 4), (True, 2)])
def test_import_extends_vocab_and_export_round_trips(tmp_path, tok, tie, kv):
    hf_dir = tmp_path / "hf"
    src = foreign_llama(hf_dir, vocab=tok.text_size, tie=tie, kv_heads=kv)
    tok.save(hf_dir)
    import_hf(hf_dir, tmp_path / "ckpt", codebook_size=16)
    p = load_pretrained(tmp_path / "ckpt")
    assert p.config.model.rope_theta == 2e4 and p.config.model.n_kv_heads == kv
    assert p.config.model.vocab_size == tok.text_size + 4 + 16
    emb = p.model.tok_embeddings.weight.detach()
    orig = src.model.embed_tokens.weight.detach()
    assert torch.equal(emb[: tok.text_size], orig)
    torch.testing.assert_close(emb[tok.text_size :], orig.mean(0, keepdim=True).expand(20, -1))

    # text-only inputs give the original model's logits on the text rows
    ids = torch.randint(0, tok.text_size, (2, 11))
    ours = p.model.logits(p.model(ids))[..., : tok.text_size]
    torch.testing.assert_close(ours, src(ids).logits, atol=1e-4, rtol=0)

    export_hf(tmp_path / "ckpt", tmp_path / "out")
    a = load_file(str(hf_dir / "model.safetensors"))
    b = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, t in a.items():
        u = b[name]
        if "embed_tokens" in name or "lm_head" in name:
            u = u[: t.shape[0]]
        assert torch.equal(t, u), name

    # and importing our own export changes nothing at all
    import_hf(tmp_path / "out", tmp_path / "ckpt2")
    export_hf(tmp_path / "ckpt2", tmp_path / "out2")
    c = load_file(str(tmp_path / "out2" / "model.safetensors"))
    assert b.keys() == c.keys() and all(torch.equal(b[k], c[k]) for k in b)


def test_an_export_whose_config_json_disagrees_with_its_own_config_is_refused(tmp_path, tok):
    """load_pretrained reads an export's longvideo.yaml, transformers its config.json: a value that
    changes the model, edited in config.json only, is refused naming the key; a key config.json
    leaves out, or one that does not change the model, is not."""
    hf_dir = tmp_path / "hf"
    foreign_llama(hf_dir, vocab=tok.text_size, tie=False, kv_heads=2, rope_theta=2e4)
    tok.save(hf_dir)
    import_hf(hf_dir, tmp_path / "ckpt", codebook_size=16)
    out = export_hf(tmp_path / "ckpt", tmp_path / "out")
    ref = load_pretrained(out)
    assert ref.config.model.rope_theta == 2e4
    exported = json.loads((out / "config.json").read_text())
    for key, value in (("rope_theta", 1e6), ("num_key_value_heads", 4)):
        (out / "config.json").write_text(json.dumps({**exported, key: value}))
        with pytest.raises(CheckpointError, match=f"disagree on {key} \\(config.json {value}"):
            load_pretrained(out)
    loose = {k: v for k, v in exported.items() if k != "rms_norm_eps"}
    (out / "config.json").write_text(json.dumps({**loose, "transformers_version": "0"}))
    ids = torch.randint(0, tok.text_size, (1, 7))
    torch.testing.assert_close(load_pretrained(out).model(ids), ref.model(ids), atol=0, rtol=0)


@pytest.mark.parametrize("tie,kv", [(False, 2), (True, 4)])
def test_transformers_loads_export_with_same_logits(tmp_path, tok, tie, kv):
    mc = ModelConfig(
        text_vocab_size=tok.text_size,
        codebook_size=16,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=kv,
        ffn_dim=64,
        tie_embeddings=tie,
        rope_theta=3e4,
        max_seq_len=128,
    )
    cfg = Config(model=mc, vq=VQConfig(codebook_size=16))
    torch.manual_seed(1)
    model = Transformer(mc)
    save_project_checkpoint(tmp_path / "ckpt", model.state_dict(), cfg, tokenizer=tok)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids = torch.randint(0, mc.vocab_size, (2, 19))
    torch.testing.assert_close(hf(ids).logits, model.logits(model(ids)), atol=1e-4, rtol=0)
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["max_position_embeddings"] == 128 and conf["rope_theta"] == 3e4
    t = TextTokenizer.from_dir(tmp_path / "hf")
    assert t.encode("<vision>") == [tok.text_size]


def test_export_of_a_logn_model_loads_only_as_itself_with_same_logits(tmp_path, tok):
    """attn_logn_base > 0: the export carries its transformers code (modeling_longvideo.py); with
    trust_remote_code it gives the project's logits past the base, also when decoding from a cache;
    without it transformers refuses the directory instead of loading a plain Llama."""
    mc = ModelConfig(
        text_vocab_size=tok.text_size,
        codebook_size=16,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        rope_theta=3e4,
        max_seq_len=128,
        attn_logn_base=4,
        init_std=0.3,
    )  # attention logits large enough for their scale to show
    torch.manual_seed(2)
    model = Transformer(mc)
    save_project_checkpoint(
        tmp_path / "ckpt",
        model.state_dict(),
        Config(model=mc, vq=VQConfig(codebook_size=16)),
        tokenizer=tok,
    )
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    assert type(hf).__name__ == "LongVideoLlamaForCausalLM"
    ids = torch.randint(0, mc.vocab_size, (2, 19))
    ours = model.logits(model(ids))
    torch.testing.assert_close(hf(ids).logits, ours, atol=1e-4, rtol=0)
    plain = Transformer(replace(mc, attn_logn_base=0))
    plain.load_state_dict(model.state_dict())
    assert (
        plain.logits(plain(ids)) - ours
    ).abs().max() > 1e-2  # the scale matters at these positions
    with torch.no_grad():
        first = hf(ids[:, :12], use_cache=True)
        # transformers 5 renamed the cache argument and output `cache` (the old name goes in 5.40)
        name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
        step = hf(ids[:, 12:13], **{name: getattr(first, name)}, use_cache=True)
    torch.testing.assert_close(step.logits[:, 0], ours[:, 12], atol=1e-4, rtol=0)
    # reading its tokenizer (as LongVideoProcessor does) never asks whether to run the model code
    import builtins

    asked = []
    real_input, builtins.input = builtins.input, lambda *a: asked.append(a) or "n"
    try:
        assert TextTokenizer.from_dir(tmp_path / "hf").text_size == tok.text_size
    finally:
        builtins.input = real_input
    assert not asked
    # and importing it back keeps the scale
    import_hf(tmp_path / "hf", tmp_path / "ckpt2")
    assert load_pretrained(tmp_path / "ckpt2").config.model.attn_logn_base == 4


def test_rope_theta_both_spellings():
    from longvideo.model.families import model_config_from_hf

    def theta(**kw):
        hf = dict(
            model_type="llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            **kw,
        )
        return model_config_from_hf(
            hf, ModelConfig(), text_vocab_size=10, codebook_size=4
        ).rope_theta

    assert theta(rope_theta=5e5) == 5e5
    assert theta(rope_parameters={"rope_type": "default", "rope_theta": 1e6}) == 1e6
    with pytest.raises(FamilyError, match="rope_parameters.rope_type"):
        theta(rope_parameters={"rope_type": "longrope", "rope_theta": 1e6})


def test_bad_checkpoints_are_named(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="config.json"):
        import_hf(tmp_path / "nothing", tmp_path / "o")
    d = tmp_path / "gpt"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(d / "model.safetensors"))
    with pytest.raises(FamilyError, match="model_type.*gpt2.*LlamaForCausalLM"):
        import_hf(d, tmp_path / "o")
    hf_dir = tmp_path / "hf"
    foreign_llama(hf_dir, vocab=tok.text_size, tie=False, kv_heads=4)
    sd = load_file(str(hf_dir / "model.safetensors"))
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(sd, str(hf_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.1|layers.1.ffn.w_up"):
        import_hf(hf_dir, tmp_path / "o")
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        import_hf(hf_dir, tmp_path / "o")
