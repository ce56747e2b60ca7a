"""The DeepSpeed config a run uses (docs/training.md): generated from TrainConfig, which owns batch
sizes, clipping, precision and the ZeRO stage, plus tuning keys from an optional JSON, where an
owned key must be absent, "auto" or equal to the generated value (else a ConfigError).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from longvideo.configtools import ConfigError, resolve_config_path
from longvideo.train.config import TrainConfig


def load_base(path: str) -> dict:
    """The JSON at `path` as given, else relative to the shipped configs ('deepspeed/zero3.json')."""
    if not path:
        return {}
    try:
        file = resolve_config_path(path, suffixes=(".json",))
        data = json.loads(file.read_text())
    except FileNotFoundError as e:
        raise ConfigError("train.deepspeed_config", str(e)) from None
    except json.JSONDecodeError as e:
        raise ConfigError("train.deepspeed_config", f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError("train.deepspeed_config", f"{file} must hold a JSON object")
    for key in ("optimizer", "scheduler"):
        if key in data:
            raise ConfigError(
                "train.deepspeed_config",
                f"'{key}' in {file}: the trainer builds AdamW and the warm-up + cosine "
                f"schedule from TrainConfig; remove it and set train.lr etc. instead",
            )
    return data


def resolve_zero_stage(train: TrainConfig, base: dict) -> int:
    """train.zero_stage, else the JSON's zero_optimization.stage, else 3; they must agree."""
    file_stage = base.get("zero_optimization", {}).get("stage")
    if file_stage == "auto":
        file_stage = None
    if (
        train.zero_stage is not None
        and file_stage is not None
        and int(file_stage) != train.zero_stage
    ):
        raise ConfigError(
            "train.zero_stage",
            f"is {train.zero_stage} but {train.deepspeed_config} "
            f"sets zero_optimization.stage={file_stage}",
        )
    stage = (
        train.zero_stage
        if train.zero_stage is not None
        else (file_stage if file_stage is not None else 3)
    )
    if stage not in (1, 2, 3):
        raise ConfigError("train.zero_stage", f"must be 1, 2 or 3, got {stage}")
    return int(stage)


def _set_owned(cfg: dict, path: tuple[str, ...], value: Any, source: str) -> None:
    node = cfg
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError("train.deepspeed_config", f"'{part}' in {source} must be an object")
    key = path[-1]
    old = node.get(key, "auto")
    if old != "auto" and old != value:
        raise ConfigError(
            "train.deepspeed_config",
            f"{source} sets {'.'.join(path)}={old!r} but the run needs {value!r} "
            f'(set it through the longvideo config, or write "auto")',
        )
    node[key] = value


def build_deepspeed_config(
    train: TrainConfig, *, world_size: int, bf16: bool, base: dict | None = None
) -> dict:
    """The dict handed to deepspeed.initialize. `world_size` = dp x sp (DeepSpeed's dp world)."""
    base = load_base(train.deepspeed_config) if base is None else base
    source = train.deepspeed_config or "the DeepSpeed config"
    stage = resolve_zero_stage(train, base)
    cfg = copy.deepcopy(base)
    owned = {
        ("train_micro_batch_size_per_gpu",): train.micro_batch_size,
        ("gradient_accumulation_steps",): train.grad_accum,
        ("train_batch_size",): train.micro_batch_size * train.grad_accum * world_size,
        # DeepSpeed's default is 1.0, not off: always write the configured value
        ("gradient_clipping",): float(train.grad_clip),
        ("bf16", "enabled"): bool(bf16),
        ("fp16", "enabled"): False,
        ("zero_optimization", "stage"): stage,
    }
    for path, value in owned.items():
        _set_owned(cfg, path, value, source)
    # a client AdamW (torch) is used so that steps can be skipped on a NaN loss
    cfg.setdefault("zero_allow_untested_optimizer", True)
    cfg.setdefault("steps_per_print", 10**9)  # the trainer logs; keep DeepSpeed quiet
    cfg.setdefault("wall_clock_breakdown", False)
    zero = cfg["zero_optimization"]
    if stage == 3:
        # model.safetensors is written from the fp32 master weights, not 16-bit copies
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", False)
    return cfg
