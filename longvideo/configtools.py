"""Typed, frozen configuration: one keyword-only dataclass per component, built from YAML dicts and
dotted overrides. Unknown keys, wrong types and inconsistent values (each ``__post_init__``) raise
:class:`ConfigError` naming the dotted key, before anything runs (docs/configs.md)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or inconsistent; names the key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key '{key}': {message}")


def check(condition: bool, key: str, message: str) -> None:
    """Raise ConfigError(key, message) unless condition holds. For use in __post_init__."""
    if not condition:
        raise ConfigError(key, message)


def check_positive(cfg, *keys: str) -> None:
    """check() that each named field of cfg is > 0 ("must be positive")."""
    for key in keys:
        check(getattr(cfg, key) > 0, key, "must be positive")


def check_at_least(cfg, low: int, *keys: str) -> None:
    """check() that each named field of cfg is >= low ("must be >= 0", "must be >= 1")."""
    for key in keys:
        check(getattr(cfg, key) >= low, key, f"must be >= {low}")


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    if origin in (tuple, list):
        args = get_args(tp)
        return f"list of {_type_name(args[0])}" if args else "list"
    return getattr(tp, "__name__", str(tp))


_PLAIN = {bool: "true or false", str: "a string", dict: "a mapping"}
"""Annotations whose values are taken as they are, and what a wrong value's error expects."""


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against annotation `tp`; return it (tuples for sequences). Raise ConfigError."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(key, f"got {value!r}; allowed: {_type_name(tp)}")
    if origin in (Union, types.UnionType):
        for arg in get_args(tp):
            with contextlib.suppress(ConfigError):
                return _coerce(value, arg, key)
        raise ConfigError(key, f"got {value!r}; expected {_type_name(tp)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(key, f"got {value!r}; expected null")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"got {value!r}; expected {_type_name(tp)}")
        args = get_args(tp)
        inner = args[0] if args else Any
        return tuple(_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(key, f"got {value!r}; expected a mapping for {tp.__name__}")
        return from_dict(tp, value, prefix=key)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(key, f"got {value!r}; expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            with contextlib.suppress(ValueError):
                return float(value)
        raise ConfigError(key, f"got {value!r}; expected a number")
    plain = dict if origin is dict else tp
    if plain in _PLAIN:
        if isinstance(value, plain):
            return value
        raise ConfigError(key, f"got {value!r}; expected {_PLAIN[plain]}")
    raise ConfigError(key, f"unsupported annotation {tp!r}")


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass `cls` from `data`, recursively; unknown keys and bad types raise ConfigError."""
    if data is None:
        data = {}
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            raise ConfigError(dotted, f"unknown key; allowed keys: {', '.join(sorted(fields))}")
        kwargs[key] = _coerce(value, hints[key], dotted)
    for name, f in fields.items():
        if (
            name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            raise ConfigError(
                f"{prefix}.{name}" if prefix else name, "missing (the key has no default)"
            )
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if prefix and not e.key.startswith(prefix + "."):
            raise ConfigError(f"{prefix}.{e.key}", str(e).split(": ", 1)[1]) from None
        raise


def to_dict(cfg) -> Any:
    """Plain nested dict (tuples as lists) of a config dataclass, suitable for YAML/JSON."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(x) for x in cfg]
    return cfg


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set dotted keys ('model.n_layers=4', the value parsed as YAML) in a nested dict (copying it).
    Type checks happen later, in from_dict."""
    data = copy.deepcopy(data)
    for text in overrides:
        if "=" not in text:
            raise ConfigError(text, "an override must look like 'section.key=value'")
        key, raw = text.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(text, "empty key in override")
        path, node = key.split("."), data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(key, f"'{part}' is not a section")
            node = child
        node[path[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return data


CONFIG_DIR = Path(__file__).resolve().parent / "configs"
"""The shipped configs: `longvideo/configs/` in a wheel (pyproject.toml installs the top-level configs/
there), else the checkout's configs/ (source tree and editable installs)."""
if not CONFIG_DIR.is_dir():
    CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def resolve_config_path(path: str | Path, suffixes: tuple[str, ...] = (".yaml",)) -> Path:
    """A path as given, or else relative to the shipped configs (CONFIG_DIR), with or without a
    suffix: `tiny`, `stages/tiny-1k`, `vq/tiny.yaml`, `deepspeed/zero3.json`."""
    p = Path(path)
    if p.is_file():
        return p
    for candidate in (CONFIG_DIR / p, *(CONFIG_DIR / f"{p}{s}" for s in suffixes)):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"config file not found: {path} (also looked in {CONFIG_DIR})")


def load_yaml(path) -> dict:
    """Read a YAML mapping. Supports `base: other.yaml` (relative path) for inheritance."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), "a config file must hold a mapping")
    base = data.pop("base", None)
    return data if base is None else deep_merge(load_yaml(path.parent / base), data)


def deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = (
            deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out
