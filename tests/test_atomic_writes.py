"""VQ, export and demo writes are atomic: an interrupted write never leaves a file that passes for
a finished one, and the demo never resumes from one.

Interrupted for real: a child process that dies (os._exit, as a kill would) in the middle of a VQ
save; by an exception: an export, an import and a tokenizer save that fail half-way. And the
demo's resume markers, given what an interrupted run leaves (a truncated model.safetensors, a VQ
saved part-way through training, an export without config.json, an evaluation without its JSON),
take none of it as done.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from longvideo import checkpoint
from longvideo.atomic import TMP_PREFIX, atomic_dir
from longvideo.checkpoint import save_project_checkpoint
from longvideo.config import load_config
from longvideo.export import export_hf
from longvideo.tokenizer import TextTokenizer, train_text_tokenizer
from longvideo.vq import VQConfig, VQModel, load_vq

TINY = [
    "model.text_vocab_size=280",
    "model.codebook_size=16",
    "vq.codebook_size=16",
    "model.dim=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.multiple_of=16",
]
TEXT = ["the red circle moves left", "what colour was the flash frame", "blue green yellow"] * 5
VQ = dict(
    mode="2d",
    resolution=16,
    downsample=4,
    channels=8,
    channel_mult=(1, 1, 1),
    num_res_blocks=0,
    codebook_size=16,
)


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(TMP_PREFIX)]


def test_atomic_dir_moves_the_marker_last_and_keeps_the_old_set_on_failure(tmp_path, monkeypatch):
    out = tmp_path / "out"
    with atomic_dir(out, marker="config.json") as d:
        (d / "config.json").write_text("1")
        (d / "weights").write_text("1")
        (d / "sub").mkdir()
        (d / "sub" / "a").write_text("1")
    assert {p.name for p in out.iterdir()} == {"config.json", "weights", "sub"}
    with pytest.raises(RuntimeError):
        with atomic_dir(out, marker="config.json") as d:
            (d / "weights").write_text("2 (half")
            raise RuntimeError("interrupted")
    assert (out / "weights").read_text() == "1" and _leftovers(tmp_path) == []
    import os

    order, real = [], os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (order.append(Path(b).name), real(a, b)))
    with atomic_dir(out, marker="config.json") as d:
        for name in ("config.json", "weights", "z"):
            (d / name).write_text("3")
        (d / "sub").mkdir()
        (d / "sub" / "b").write_text("3")
    assert order[-1] == "config.json" and set(order) == {"config.json", "weights", "z", "sub"}
    assert not (out / "sub" / "a").exists()  # a directory is replaced whole
    assert (out / "weights").read_text() == "3"


KILLED_SAVE = """
import os, sys, torch
from longvideo import atomic
from longvideo.vq import VQConfig, VQModel
torch.manual_seed(1)
model = VQModel(VQConfig(**{vq}))
real = os.fsync
def die(fd):  # the weights are in their temporary file, not yet renamed: the process dies here
    if ".tmp_model.safetensors." in os.readlink("/proc/self/fd/%d" % fd):
        os._exit(9)
    real(fd)
atomic.os.fsync = die
model.save(sys.argv[1])
"""


def test_a_vq_save_killed_half_way_leaves_the_old_weights(tmp_path):
    torch.manual_seed(0)
    old = VQModel(VQConfig(**VQ))
    old.save(tmp_path / "vq")
    before = (tmp_path / "vq" / "model.safetensors").read_bytes()
    script = KILLED_SAVE.format(vq=repr(VQ))
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(tmp_path / "vq")])
    assert res.returncode == 9
    assert (tmp_path / "vq" / "model.safetensors").read_bytes() == before
    assert _leftovers(tmp_path / "vq")  # the killed writer's temporary file, under another name
    loaded = load_vq(tmp_path / "vq")
    for k, v in old.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(tmp_path / "new")])
    assert res.returncode == 9 and not (tmp_path / "new" / "model.safetensors").exists()


@pytest.fixture(scope="module")
def tok():
    return train_text_tokenizer(TEXT, vocab_size=280)


@pytest.fixture
def ckpt(tmp_path, tok):
    cfg = load_config(None, TINY)
    torch.manual_seed(0)
    sd = checkpoint.build_model(cfg).state_dict()
    torch.manual_seed(0)
    return save_project_checkpoint(tmp_path / "ckpt", sd, cfg, tokenizer=tok, vq=VQModel(cfg.vq))


def test_an_interrupted_export_leaves_no_config_json_or_the_old_export(tmp_path, ckpt, monkeypatch):
    out = tmp_path / "hf"
    real = checkpoint.StreamingWeights.write
    calls = []

    def write_then_fail(self, name, tensor, at=0):
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the weights
        return real(self, name, tensor, at)

    monkeypatch.setattr(checkpoint.StreamingWeights, "write", write_then_fail)
    with pytest.raises(KeyboardInterrupt):
        export_hf(ckpt, out)
    assert not (out / "config.json").exists() and _leftovers(tmp_path) == []
    monkeypatch.setattr(checkpoint.StreamingWeights, "write", real)
    export_hf(ckpt, out)
    whole = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    calls.clear()
    monkeypatch.setattr(checkpoint.StreamingWeights, "write", write_then_fail)
    with pytest.raises(KeyboardInterrupt):
        export_hf(ckpt, out)  # over the finished export: it stays as it was
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == whole
    assert json.loads((out / "config.json").read_text())["architectures"]


def test_an_interrupted_import_or_tokenizer_save_is_not_a_checkpoint(
    tmp_path, ckpt, tok, monkeypatch
):
    from longvideo.export import import_hf

    export_hf(ckpt, tmp_path / "hf")

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(TextTokenizer, "save", fail)  # after the weights, before config.yaml
    with pytest.raises(OSError):
        import_hf(tmp_path / "hf", tmp_path / "imported")
    assert not (tmp_path / "imported" / "config.yaml").exists()
    monkeypatch.undo()

    def save_half(self, folder, **kw):  # one file written, then the failure
        Path(folder, "tokenizer_config.json").write_text("{}")
        fail()

    monkeypatch.setattr(type(tok.hf), "save_pretrained", save_half)
    with pytest.raises(OSError):
        tok.save(tmp_path / "tok")
    assert not (tmp_path / "tok" / "tokenizer.json").exists() and _leftovers(tmp_path) == []


def test_the_demo_resumes_no_stage_from_a_partial_file(tmp_path, tok, monkeypatch):
    """What an interrupted run leaves behind, stage by stage: each stage is still to run."""
    from longvideo import demo as demo_mod
    from longvideo.demo import Demo, load_plan

    out = tmp_path / "run"
    d = Demo(out, load_plan("demos/demo-quick"))
    d.check_plan()
    (out / "data").mkdir()
    (out / "data/.done").touch()
    tok.save(out / "tokenizer")  # finished
    torch.manual_seed(0)
    VQModel(VQConfig(**VQ)).save(out / "vq")  # a periodic save of a VQ still training
    weights = (out / "vq/model.safetensors").read_bytes()
    (out / "vq/model.safetensors").write_bytes(weights[: len(weights) // 2])  # and cut short
    (out / "tokens").mkdir()
    (out / "lm").mkdir()
    (out / "hf").mkdir()  # an export that stopped in its weights
    (out / "hf/model.safetensors").write_bytes(weights[:100])
    (out / "eval/video_niah").mkdir(parents=True)  # an evaluation that stopped before its JSON
    (out / "eval/video_niah/video_needle.png").write_bytes(b"png")

    stages = []
    monkeypatch.setattr(d, "stage", lambda name, done, fn: stages.append((name, done.exists())))
    monkeypatch.setattr(demo_mod, "machine_info", lambda: {})
    monkeypatch.setattr(demo_mod, "describe", lambda m: "")
    monkeypatch.setattr(d, "summary", lambda seconds: {})
    monkeypatch.setattr(d, "report", lambda s: None)
    d.main()
    # keyed by what each stage does, so a plan with more rungs (text to video) keeps its meaning
    done = {name.split(" ", 1)[1].split(" (")[0]: ok for name, ok in stages}
    assert done == {
        "make-data: synthetic shards": True,
        "text tokenizer": True,
        "train-vq": False,  # model.safetensors without vq/.done
        "tokenize": False,
        "train the LM": False,
        "train text to video": False,
        "export a Hugging Face directory": False,  # hf/ without config.json
        "evaluate on held-out videos": False,  # eval/video_niah without its JSON
        "generate videos from held-out captions": False,
        "chat": False,
    }, stages
    (out / "vq/.done").touch()
    stages.clear()
    d.main()
    assert dict((n.split(" ", 1)[1], ok) for n, ok in stages)["train-vq"]
