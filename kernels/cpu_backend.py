"""The `cpu` block backend (placeholder until the fast path lands): the exact tiled torch backend."""

from kernels.torch_backend import TorchBackend


class CpuBackend(TorchBackend):
    name = "cpu"
