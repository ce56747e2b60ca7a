"""Reading a pickle of numpy arrays without running anything the pickle names (the one place the
project unpickles: LWM's released VQGAN weights).

    params = load_array_pickle("vqgan")      # nested dicts / lists of numpy arrays

A pickle is a program: each global it names (`os.system`, ...) is imported and may be called. This
reader admits only numpy's array reconstruction (`numpy.ndarray`, `numpy.dtype`, numpy scalars),
plain containers (`collections.OrderedDict`, flax's `FrozenDict` read as a dict) and protocol 2's
latin-1 bytes (`_codecs.encode`); any other global or a persistent id raises `UnsafePickleError`
before it is imported. Arrays of Python objects are refused after loading.
"""

from __future__ import annotations

import collections
import pickle
from pathlib import Path
from typing import Any

import numpy as np


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle names something other than numpy array reconstruction and plain containers."""


class _FrozenDict(dict):
    """Stands in for flax.core.frozen_dict.FrozenDict: a plain dict, whichever way it was pickled
    (FrozenDict(dict) through its __reduce__, or a new object and its slot state)."""

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (instance dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        inner = state.get("_dict") if isinstance(state, dict) else None
        if not isinstance(inner, dict):
            raise UnsafePickleError("a FrozenDict whose state holds no dict")
        self.update(inner)


def _latin1(text: str, encoding: str = "latin1", errors: str = "strict") -> bytes:
    """Stands in for _codecs.encode, which protocol-2 pickles use to spell bytes (as latin-1 text)."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1") or errors != "strict":
        raise UnsafePickleError(
            f"_codecs.encode with {encoding!r} / {errors!r}: only latin-1 bytes are read"
        )
    return text.encode("latin1")


_CORE = np._core if hasattr(np, "_core") else np.core  # numpy 2 moved numpy.core to numpy._core
_ALLOWED: dict[tuple[str, str], Any] = {
    ("_codecs", "encode"): _latin1,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("flax.core.frozen_dict", "FrozenDict"): _FrozenDict,
    # pickles of numpy 1 and numpy 2 name different modules; _frombuffer: protocol 5
    **{
        (f"{mod}.{sub}", name): getattr(getattr(_CORE, sub), name)
        for mod in ("numpy.core", "numpy._core")
        for sub, name in (
            ("multiarray", "_reconstruct"),
            ("multiarray", "scalar"),
            ("numeric", "_frombuffer"),
        )
    },
}
ALLOWED_GLOBALS: tuple[str, ...] = tuple(sorted(f"{m}.{n}" for m, n in _ALLOWED))


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = _ALLOWED.get((module, name))
        if found is None:
            raise UnsafePickleError(
                f"the pickle names {module}.{name}, which is not numpy array "
                f"reconstruction or a plain container; refusing to load it "
                f"(allowed: {', '.join(ALLOWED_GLOBALS)})"
            )
        return found

    def persistent_load(self, pid):
        raise UnsafePickleError(
            f"the pickle refers to a persistent object {pid!r}; refusing to load it"
        )


def _check_tree(obj: Any, where: str = "") -> Any:
    """Plain containers (dicts, lists, tuples) of arrays, numbers and strings; FrozenDicts become dicts."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise UnsafePickleError(f"key {k!r} at '{where}' is not a string or an integer")
            out[k] = _check_tree(v, f"{where}/{k}" if where else str(k))
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(_check_tree(v, f"{where}[{i}]") for i, v in enumerate(obj))
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise UnsafePickleError(f"the array at '{where}' holds Python objects")
        return obj
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, np.generic)):
        if isinstance(obj, np.generic) and obj.dtype.hasobject:
            raise UnsafePickleError(f"the scalar at '{where}' is a Python object")
        return obj
    raise UnsafePickleError(f"unexpected {type(obj).__name__} at '{where}'")


def load_array_pickle(path: str | Path) -> Any:
    """Read a pickle file of numpy arrays in plain containers; UnsafePickleError for anything else."""
    with open(path, "rb") as f:
        return _check_tree(_RestrictedUnpickler(f).load())
