"""What `longvideo export` writes for the Hugging Face tools: the weights in the dtype asked for,
sharded with an index past the size asked for, the tokenizer's chat template, a processor
`AutoProcessor` loads, progress bars; read back by transformers' Auto classes (docs/export.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from test_infer_chat import tiny_pretrained, write_video
from transformers import AutoModelForCausalLM, AutoProcessor, AutoTokenizer

from longvideo import cli
from longvideo.checkpoint import load_pretrained, save_project_checkpoint, to_hf_names
from longvideo.data.templates import build_prompt
from longvideo.data.video import read_video
from longvideo.export import export_hf, import_hf
from longvideo.export.hf import parse_size, shard_names
from longvideo.vq import encode_video

QUESTION = "What colour was the flash frame?"


@pytest.fixture(scope="module")
def pre():
    return tiny_pretrained(max_seq_len=256)


@pytest.fixture(scope="module")
def ckpt(pre, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    return save_project_checkpoint(
        path, pre.model.state_dict(), pre.config, tokenizer=pre.tokenizer, vq=pre.vq
    )


def _file_tensors(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_dtype_and_shards_as_asked_load_in_transformers(pre, ckpt, tmp_path, dtype, torch_dtype):
    out = tmp_path / "hf"
    assert (
        cli.main(
            ["export", "--ckpt", str(ckpt), "--out", str(out), "--dtype", dtype]
            + ["--max-shard-size", "20KB", "--quiet"]
        )
        == 0
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (out / "model.safetensors").exists()
    assert files == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    want = {
        k: v.to(torch_dtype) for k, v in to_hf_names(pre.model.state_dict(), pre.model.cfg).items()
    }
    got = {}
    for f in files:
        part = _file_tensors(out / f)
        size = sum(t.numel() * t.element_size() for t in part.values())
        assert size <= 20_000 or len(part) == 1, (f, size)  # a larger tensor goes alone
        assert all(index["weight_map"][k] == f for k in part)
        got.update(part)
    assert got.keys() == want.keys() and index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in got.values()
    )
    for k in want:  # every tensor is the model's, rounded to the dtype asked for
        assert got[k].dtype == torch_dtype and torch.equal(got[k], want[k]), k
    conf = json.loads((out / "config.json").read_text())
    assert conf["torch_dtype"] == conf["dtype"] == str(torch_dtype).removeprefix("torch.")

    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.dtype == torch_dtype
    ids = torch.randint(0, pre.model.cfg.vocab_size, (1, 17))
    with torch.no_grad():
        ref = pre.model.logits(pre.model(ids))
        logits = hf(ids).logits.float()
    scale = ref.abs().max()
    assert (logits - ref).abs().max() <= 0.05 * scale  # half-precision weights and arithmetic

    # the project reads the shards too, and importing them back keeps every rounded weight
    back = load_pretrained(out)
    assert torch.equal(back.model.tok_embeddings.weight, want["model.embed_tokens.weight"].float())
    import_hf(out, tmp_path / "again", progress=False)
    assert load_pretrained(tmp_path / "again").config.model == pre.model.cfg


def test_one_file_below_the_size_and_a_new_export_replaces_the_shards(ckpt, tmp_path):
    out = tmp_path / "hf"
    export_hf(ckpt, out, max_shard_size="20KB", progress=False)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 2
    export_hf(ckpt, out, progress=False)  # default 5GB: one file, as transformers writes it
    assert (out / "model.safetensors").is_file()
    assert not list(out.glob("model-*-of-*.safetensors"))
    assert not (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.float32


def test_auto_processor_gives_the_prompt_the_model_was_trained_with(pre, ckpt, tmp_path):
    out = tmp_path / "hf"
    export_hf(ckpt, out, progress=False)
    proc = AutoProcessor.from_pretrained(out, trust_remote_code=True)
    assert type(proc).__name__ == "LongVideoProcessor"
    clip = tmp_path / "clip.mp4"
    write_video(clip)
    got = proc(str(clip), QUESTION)["input_ids"][0].tolist()
    # independently: every frame at 1 fps, encoded at once, laid out by the QA template
    video = read_video(str(clip), fps=1.0, size=pre.vq.cfg.resolution)
    codes = encode_video(pre.vq, video.frames)
    vocab = pre.model.cfg.vocab
    want = build_prompt(pre.tokenizer, vocab, codes, video.timestamps, QUESTION).ids
    assert got == want and any(i >= vocab.vq_offset for i in got)
    with pytest.raises(TypeError, match="unexpected keywords"):
        AutoProcessor.from_pretrained(out, trust_remote_code=True, fps=3)


def test_chat_template_is_the_text_side_of_the_qa_prompt(pre, ckpt, tmp_path):
    out = tmp_path / "hf"
    export_hf(ckpt, out, progress=False)
    assert "Question: " in json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    tok = AutoTokenizer.from_pretrained(out)
    vocab = pre.model.cfg.vocab
    none = np.zeros((0, 1, 1), np.int64), np.zeros(0)

    def ids(messages):
        got = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(got["input_ids"] if hasattr(got, "keys") else got)

    q1, a1, q2 = " what colour was the flash frame ", "red", "and the last shape?"
    assert (
        ids([{"role": "user", "content": q1}]) == build_prompt(pre.tokenizer, vocab, *none, q1).ids
    )
    two = [
        {"role": "user", "content": q1},
        {"role": "assistant", "content": a1},
        {"role": "user", "content": q2},
    ]
    assert ids(two) == build_prompt(pre.tokenizer, vocab, *none, q2, history=[(q1, a1)]).ids
    with pytest.raises(Exception, match="user and assistant turns only"):
        ids([{"role": "system", "content": "be brief"}, {"role": "user", "content": q1}])


def test_progress_bars_on_export_and_import(ckpt, tmp_path, capsys):
    export_hf(ckpt, tmp_path / "hf", progress=True)
    err = capsys.readouterr().err
    assert "export" in err and "100%" in err
    import_hf(tmp_path / "hf", tmp_path / "back", progress=True)
    err = capsys.readouterr().err
    assert "import-hf: read" in err and "import-hf: write" in err and "100%" in err


def test_sizes_and_shards():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("500 MB") == 5 * 10**8 and parse_size(1000) == 1000
    for bad in ("5 parsecs", "-1GB", "0", ""):
        with pytest.raises(ValueError, match="shard size"):
            parse_size(bad)
    f32 = torch.float32
    specs = {"a": (f32, (10,)), "b": (f32, (10,)), "c": (f32, (100,)), "d": (f32, (5,))}
    assert shard_names(specs, 80) == [["a", "b"], ["c"], ["d"]]  # 40 + 40; 400 alone; 20
    assert shard_names(specs, 10**9) == [["a", "b", "c", "d"]]


def test_export_help_says_which_models_need_remote_code(capsys):
    with pytest.raises(SystemExit):
        cli.main(["export", "--help"])
    text = capsys.readouterr().out
    assert "trust_remote_code=True" in text and "attn_logn_base" in text
    assert "--dtype" in text and "--max-shard-size" in text
