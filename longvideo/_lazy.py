"""Lazy package surfaces: a package's public names are imported on first use, so that composing the
root config (which imports every component's package) never imports torch, decoders or DeepSpeed.

    __getattr__, __dir__ = lazy_exports(__name__, {"Transformer": "transformer", "X": "mod:Y", ...})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, table: dict[str, str]) -> tuple[Callable, Callable]:
    """(__getattr__, __dir__) for `package`: name -> "submodule" (relative to package) defining it
    under the same name, or "submodule:attribute"."""

    def __getattr__(name: str):
        if name in table:
            module, _, attr = table[name].partition(":")
            value = getattr(importlib.import_module(f"{package}.{module}"), attr or name)
            vars(sys.modules[package])[name] = value  # later lookups skip this function
            return value
        raise AttributeError(f"module '{package}' has no attribute '{name}'")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
