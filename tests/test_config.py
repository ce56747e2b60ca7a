"""Config: YAML + dotted overrides, and errors that name the offending key."""

import dataclasses
from pathlib import Path

import pytest
from config_docs import OUT, render

from longvideo.config import CONFIG_DIR, Config, load_config
from longvideo.configtools import ConfigError


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_and_overrides(tmp_path):
    p = write(tmp_path, "model:\n  dim: 64\n  n_layers: 2\n  n_heads: 4\n  n_kv_heads: 2\n")
    cfg = load_config(p, ["model.n_layers=3", "train.lr=1e-3", "name=x"])
    assert cfg.model.n_layers == 3 and cfg.model.dim == 64 and cfg.model.head_dim == 16
    assert cfg.train.lr == 1e-3 and cfg.name == "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.dim = 3  # frozen


@pytest.mark.parametrize(
    "override,key,words",
    [
        (["model.n_layerz=3"], "model.n_layerz", "unknown key"),
        (["modle.dim=3"], "modle", "unknown key"),
        (["model.dim=abc"], "model.dim", "expected an integer"),
        (["model.n_heads=5"], "model.n_heads", "must divide dim"),
        (["model.n_kv_heads=3"], "model.n_kv_heads", "must divide n_heads"),
        (["model.tie_embeddings=maybe"], "model.tie_embeddings", "true or false"),
        (["parallel.backend=cuda"], "parallel.backend", "allowed"),
        (["runtime.ffn_chunk=-1"], "runtime.ffn_chunk", ">= 0"),
        (["train.lr=-1"], "train.lr", "positive"),
        (["model.codebook_size=100"], "model.codebook_size", "vq.codebook_size"),
        (["model.code_init=fsq", "vq.quantizer=vq"], "model.code_init", "vq.quantizer"),
        (["model.code_init=gaussian"], "model.code_init", "fsq"),
        (["model.dim"], "model.dim", "section.key=value"),
    ],
)
def test_bad_values_name_the_key(tmp_path, override, key, words):
    p = write(tmp_path, "model:\n  dim: 64\n  n_heads: 4\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, override)
    assert e.value.key == key, str(e.value)
    assert key in str(e.value) and words in str(e.value)


def test_every_shipped_config_loads():
    files = sorted(Path(CONFIG_DIR).rglob("*.yaml"))
    roots = [f for f in files if f.parent == CONFIG_DIR or f.parent.name == "stages"]
    assert roots, "configs/ holds no root configs"
    for f in roots:
        cfg = load_config(f)
        assert isinstance(cfg, Config)


def test_model_shapes_of_named_configs():
    llama = load_config("llama2-7b").model
    assert (llama.n_layers, llama.dim, llama.n_heads, llama.text_vocab_size) == (
        32,
        4096,
        32,
        32000,
    )
    assert llama.vocab_size == 32000 + 4 + llama.codebook_size
    smol = load_config("smol-135m").model
    assert (smol.n_layers, smol.dim, smol.n_heads, smol.n_kv_heads, smol.tie_embeddings) == (
        30,
        576,
        9,
        3,
        True,
    )


def test_configs_reference_is_fresh():
    """docs/configs.md lists every key of the dataclasses and every shipped config as they are now."""
    assert OUT.read_text() == render(), (
        "docs/configs.md is stale: run `python tests/config_docs.py`"
    )
