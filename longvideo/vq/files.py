"""What every video-tokenizer implementation (`VQConfig.arch`) shares: its files, `config.json` (its
VQConfig) and `model.safetensors`, and the `VideoTokenizer` base class; `longvideo.vq.load_vq`
builds the implementation the config names."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from longvideo.atomic import write_bytes_atomic, write_text_atomic
from longvideo.configtools import ConfigError, from_dict, to_dict
from longvideo.vq.config import VQConfig

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class VideoTokenizer(nn.Module):
    """Pixels in [-1, 1] laid out (B, 3, T, H, W) <-> codes (B, G, h, w). A subclass sets `cfg` and
    gives encode, decode, group_frame_index and `_lookup` (codes (...) -> latents (..., D))."""

    cfg: VQConfig

    def codes_to_latents(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, G, h, w) long -> (B, D, G, h, w)."""
        if codes.min() < 0 or codes.max() >= self.cfg.codebook_size:
            raise ValueError(
                f"codes must lie in [0, {self.cfg.codebook_size}), got "
                f"[{int(codes.min())}, {int(codes.max())}]"
            )
        return self._lookup(codes).movedim(-1, 1)

    def forward(self, x: torch.Tensor):
        """Reconstruction of a clip: (B, 3, T, H, W) -> (recon, codes, auxiliary loss)."""
        zq, codes, aux = self.encode(x)
        return self.decode(zq), codes, aux

    def save(self, out_dir: str | Path) -> None:
        """Write `config.json` (cfg) and then `model.safetensors` (the state dict) into out_dir,
        each atomically (longvideo.atomic): an interrupted save leaves the old file or none,
        never a partial one."""
        from safetensors.torch import save

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        write_text_atomic(out / CONFIG_FILE, json.dumps(to_dict(self.cfg), indent=2) + "\n")
        write_bytes_atomic(out / WEIGHTS_FILE, save(tensors, metadata={"format": "pt"}))


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
        raise KeyError(
            f"VQ checkpoint {path / WEIGHTS_FILE} does not match its config: "
            f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}"
        )
    for k, v in state.items():
        if v.shape != expected[k].shape:
            raise ValueError(
                f"VQ checkpoint {path / WEIGHTS_FILE}: key '{k}' has shape "
                f"{tuple(v.shape)}, the config implies {tuple(expected[k].shape)}"
            )
    with torch.no_grad():
        model.load_state_dict(state)
