"""The root config: one sub-config per component, loaded from YAML plus dotted overrides.

    cfg = load_config("configs/tiny.yaml", ["model.n_layers=4", "train.lr=1e-3"])

Each component receives only its own sub-config (``cfg.model``, ``cfg.vq``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from longvideo.atomic import write_text_atomic
from longvideo.configtools import (
    CONFIG_DIR,
    ConfigError,
    apply_overrides,
    check,
    from_dict,
    load_yaml,
    resolve_config_path,
    to_dict,
)
from longvideo.data.config import DataConfig
from longvideo.infer.config import InferConfig
from longvideo.model.config import ModelConfig
from longvideo.parallel.config import ParallelConfig, RuntimeConfig
from longvideo.train.config import TrainConfig
from longvideo.vq.config import VQConfig


@dataclass(frozen=True, kw_only=True)
class Config:
    name: str = "unnamed"
    """A label for runs made with this config."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The decoder."""
    vq: VQConfig = field(default_factory=VQConfig)
    """The video tokenizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """Shards and sequence layout."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """dp x sp split, attention backend."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """How the model runs: activation checkpointing, chunk sizes."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation and checkpoints."""
    infer: InferConfig = field(default_factory=InferConfig)
    """Generation."""

    def __post_init__(self):
        check(
            self.model.codebook_size == self.vq.codebook_size,
            "model.codebook_size",
            f"must equal vq.codebook_size={self.vq.codebook_size}, got {self.model.codebook_size}",
        )
        check(
            self.model.code_init != "fsq" or self.vq.quantizer == "fsq",
            "model.code_init",
            f"fsq needs an FSQ tokenizer (vq.quantizer: fsq), got vq.quantizer={self.vq.quantizer}",
        )


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a root config from YAML (or defaults when path is None) and apply dotted overrides."""
    data = load_yaml(resolve_config_path(path)) if path is not None else {}
    return from_dict(Config, apply_overrides(data, overrides or []))


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the config as YAML (atomically: an interrupted write leaves the old file)."""
    write_text_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


__all__ = [
    "CONFIG_DIR",
    "Config",
    "ConfigError",
    "load_config",
    "save_config",
    "resolve_config_path",
    "to_dict",
]
