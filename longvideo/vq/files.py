"""The files of a saved video tokenizer, for every implementation (`VQConfig.arch`): `config.json` (its
VQConfig) and `model.safetensors`; `longvideo.vq.load_vq` builds the one the config names."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from longvideo.configtools import ConfigError, from_dict, to_dict
from longvideo.vq.config import VQConfig

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def save_vq(model: nn.Module, cfg: VQConfig, out_dir: str | Path) -> None:
    """Write `model.safetensors` (the module's state dict) and `config.json` (cfg) into out_dir."""
    from safetensors.torch import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(to_dict(cfg), indent=2) + "\n")


def read_vq_config(path: str | Path) -> VQConfig:
    """The VQConfig of a saved tokenizer directory; errors name the file."""
    path = Path(path)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise FileNotFoundError(f"VQ checkpoint {path}: missing {name}")
    try:
        data = json.loads((path / CONFIG_FILE).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"VQ checkpoint {path}: {CONFIG_FILE} is not valid JSON ({e})") from None
    try:
        return from_dict(VQConfig, data)
    except ConfigError as e:
        raise ConfigError(e.key, f"in {path / CONFIG_FILE}: {str(e).split(': ', 1)[1]}") from None


def load_weights_into(model: nn.Module, path: str | Path) -> None:
    """Load `path/model.safetensors` into `model`, which must expect exactly its tensors and shapes."""
    from safetensors.torch import load_file
    path = Path(path)
    state = load_file(str(path / WEIGHTS_FILE))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise KeyError(f"VQ checkpoint {path / WEIGHTS_FILE} does not match its config: "
                       f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    for k, v in state.items():
        if v.shape != expected[k].shape:
            raise ValueError(f"VQ checkpoint {path / WEIGHTS_FILE}: key '{k}' has shape "
                             f"{tuple(v.shape)}, the config implies {tuple(expected[k].shape)}")
    with torch.no_grad():
        model.load_state_dict(state)
