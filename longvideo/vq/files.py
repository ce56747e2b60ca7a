"""What every video-tokenizer implementation (`VQConfig.arch`) shares: its files, `config.json` (its
VQConfig), `model.safetensors` and, once its rare codes are pruned, `codes.json`, and the
`VideoTokenizer` base class; `longvideo.vq.load_vq` builds the implementation the config names."""

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
CODES_FILE = "codes.json"
"""The codes the tokenizer emits (longvideo.data.prune): absent, every code is emitted as itself."""


class VideoTokenizer(nn.Module):
    """Pixels in [-1, 1] laid out (B, 3, T, H, W) <-> codes (B, G, h, w). A subclass sets `cfg` and
    gives encode, decode, group_frame_index and `_lookup` (codes (...) -> latents (..., D))."""

    cfg: VQConfig
    code_map: torch.Tensor | None = None
    """int64 (codebook_size,): quantised code c is emitted as code_map[c] (CODES_FILE, written by
    longvideo.data.prune: a code too rare in the training data becomes its nearest kept code);
    None: every code as itself. Training and `encode` see the raw codes; `emit` maps them."""
    code_info: dict | None = None
    """What CODES_FILE says beside the map (the counts and the threshold it was made from)."""

    def emit(self, codes: torch.Tensor) -> torch.Tensor:
        """The codes the tokenizer emits for quantised `codes` (any shape): code_map applied."""
        if self.code_map is None:
            return codes
        return self.code_map.to(codes.device)[codes]

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
        if self.code_map is not None:
            write_code_map(out, self.code_map, self.code_info or {})
        elif (out / CODES_FILE).is_file():  # the weights written are not those it was made for
            (out / CODES_FILE).unlink()


def write_code_map(path: str | Path, code_map, info: dict) -> None:
    """Write `path/codes.json` atomically: {"map": [...], **info}."""
    body = {**info, "map": [int(c) for c in code_map]}
    write_text_atomic(Path(path) / CODES_FILE, json.dumps(body) + "\n")


def read_code_map(path: str | Path, codebook_size: int) -> tuple[torch.Tensor, dict] | None:
    """The code map of a saved tokenizer directory and the rest of its CODES_FILE (None without
    one), checked: one entry per code, each a code, and every code it emits emitted as itself."""
    file = Path(path) / CODES_FILE
    if not file.is_file():
        return None
    try:
        body = json.loads(file.read_text())
        values = body.pop("map")
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError) as e:
        raise ValueError(f"{file}: not a code map ({e})") from None
    if not isinstance(values, list) or len(values) != codebook_size:
        raise ValueError(f"{file}: the map needs {codebook_size} entries, one per code")
    if not all(isinstance(c, int) and 0 <= c < codebook_size for c in values):
        raise ValueError(f"{file}: every entry must be a code in [0, {codebook_size})")
    code_map = torch.tensor(values, dtype=torch.long)
    if not torch.equal(code_map[code_map], code_map):
        raise ValueError(f"{file}: a code the map emits must be emitted as itself")
    return code_map, body


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
