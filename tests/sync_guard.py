"""A CPU stand-in for `torch.cuda.set_sync_debug_mode("error")`: fail when code reads a tensor's
value on the host, which on a GPU waits for the device.

    with no_host_sync():
        out = flash_attn(q, k, v)        # raises HostSync if anything on the path calls .item(), bool(t), ...

Patched for the duration: the Tensor methods that turn a tensor into Python values (item, tolist,
__bool__, __int__, __float__, __index__, numpy, cpu) and the ops whose output size depends on
values (nonzero, unique, masked_select, argwhere, boolean-mask indexing). Triton's interpreter
(TRITON_INTERPRET=1) reads kernel arguments through none of these (checked: it passes with no
exclusion), so no frame is exempted.
"""

from __future__ import annotations

import contextlib

import torch

_METHODS = (
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "numpy",
    "cpu",
    "nonzero",
    "unique",
    "masked_select",
    "argwhere",
)
_FUNCTIONS = ("nonzero", "unique", "masked_select", "argwhere")


class HostSync(AssertionError):
    pass


def _has_bool_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@contextlib.contextmanager
def no_host_sync():
    saved = []

    def patch(owner, name, guard):
        saved.append((owner, name, owner.__dict__.get(name, None), getattr(owner, name)))
        setattr(owner, name, guard)

    def refuse(name):
        def guard(*args, **kwargs):
            raise HostSync(f"host sync on the attention path: {name}")

        return guard

    for name in _METHODS:
        patch(torch.Tensor, name, refuse(f"Tensor.{name}"))
    for name in _FUNCTIONS:
        patch(torch, name, refuse(f"torch.{name}"))
    getitem = torch.Tensor.__getitem__

    def guarded_getitem(self, index):
        if _has_bool_mask(index):
            raise HostSync("host sync on the attention path: boolean-mask indexing")
        return getitem(self, index)

    patch(torch.Tensor, "__getitem__", guarded_getitem)
    try:
        yield
    finally:
        for owner, name, own, _ in reversed(saved):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
