"""A checkpoint whose weights are only torch pickles is never unpickled without an explicit opt-in.

The material is a checkpoint directory laid out as DeepSpeed writes one with
train.save_weights=false (config.yaml and ZeRO shard files, no model.safetensors) whose pickles
run code when read: they write a marker file. A control shows they do. Then load_pretrained,
load_project_state, `longvideo export`, `longvideo consolidate` and the opt-in itself (which reads
with torch's weights-only unpickler) are each refused, the error says what to run, and the
marker is never written. tests/test_train_distributed.py consolidates a real ZeRO-3 run to the
same weights as the gathered file.
"""

import pytest
import torch

from longvideo.checkpoint import (
    PickleRefusedError,
    load_pretrained,
    load_project_state,
    save_project_checkpoint,
)
from longvideo.cli import main as cli
from longvideo.config import load_config, save_config

TINY = [
    "model.text_vocab_size=64",
    "model.codebook_size=16",
    "vq.codebook_size=16",
    "model.dim=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.multiple_of=16",
]
SHARDS = ("zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")


class RunsCode:
    """Pickles as a call of exec that writes ``marker``: what a crafted checkpoint could run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def pickle_only_checkpoint(root, marker):
    """root/checkpoints/step_000001 (config.yaml + two ZeRO shard files that run code) and
    root/checkpoints/latest naming it."""
    ckpt = root / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    save_config(load_config(None, TINY), ckpt / "config.yaml")
    for name in SHARDS:
        torch.save(
            {"module": RunsCode(marker), "optimizer_state_dict": RunsCode(marker)}, ckpt / name
        )
    (root / "checkpoints" / "latest").write_text(ckpt.name)
    return ckpt


@pytest.fixture
def crafted(tmp_path):
    marker = tmp_path / "marker"
    return pickle_only_checkpoint(tmp_path / "run", marker), marker


def test_the_crafted_pickle_runs_code_when_unpickled(tmp_path):
    control = tmp_path / "control"
    ckpt = pickle_only_checkpoint(tmp_path / "run", control)
    torch.load(ckpt / SHARDS[0], weights_only=False)
    assert control.read_text() == "ran"


def test_load_pretrained_refuses_without_opt_in_and_names_the_command(crafted):
    ckpt, marker = crafted
    for path in (ckpt, ckpt.parent.parent):  # the checkpoint, and its run directory
        for load in (load_pretrained, load_project_state):
            with pytest.raises(PickleRefusedError) as e:
                load(path)
            assert f"`longvideo consolidate --ckpt {ckpt}`" in str(e.value)
            assert "model.safetensors" in str(e.value)
    assert not marker.exists()


def test_opt_in_reads_with_the_weights_only_unpickler(crafted):
    ckpt, marker = crafted
    with pytest.raises(PickleRefusedError) as e:
        load_pretrained(ckpt, allow_pickle=True)
    assert "weights-only" in str(e.value) and "--trust-pickle" in str(e.value)
    assert not marker.exists()


def test_commands_refuse_and_say_what_to_run(crafted, tmp_path, capsys):
    ckpt, marker = crafted
    assert cli(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 1
    assert f"longvideo consolidate --ckpt {ckpt}" in capsys.readouterr().err
    assert cli(["consolidate", "--ckpt", str(ckpt.parent.parent)]) == 1
    err = capsys.readouterr().err
    assert "weights-only unpickler refused" in err and "Nothing was run" in err
    assert not marker.exists() and not (ckpt / "model.safetensors").exists()
    assert not (tmp_path / "hf").exists()


def test_safetensors_checkpoint_loads_as_before(tmp_path):
    cfg = load_config(None, TINY)
    from longvideo.checkpoint import build_model

    torch.manual_seed(0)
    sd = build_model(cfg).state_dict()
    save_project_checkpoint(tmp_path / "ckpt", sd, cfg)
    p = load_pretrained(tmp_path / "ckpt")
    for k, v in p.model.state_dict().items():
        assert torch.equal(v, sd[k]), k
    assert cli(["consolidate", "--ckpt", str(tmp_path / "ckpt")]) == 0  # nothing to do
