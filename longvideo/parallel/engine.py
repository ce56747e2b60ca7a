"""The engine a parallelized model trains in: DeepSpeed ZeRO over all dp x sp ranks (no `mpu`;
docs/architecture.md, decision 6) behind a small interface, the one place besides `parallelize`
that imports DeepSpeed. Every state it returns or writes keeps the model's own parameter names.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from torch import nn

CHECKPOINT_WRAPPER_PREFIX = "_checkpoint_wrapped_module."
"""What torch's checkpoint_wrapper inserts into parameter names (longvideo.parallel.apply)."""


def own_name(name: str) -> str:
    """A parameter name as the unwrapped model spells it."""
    return name.replace(CHECKPOINT_WRAPPER_PREFIX, "")


def _deepspeed():
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
    import deepspeed  # heavy: imported once a run has been checked

    # DeepSpeed 0.19 calls collectives torch 2.14 renamed: one warning per call, every step
    warnings.filterwarnings(
        "ignore",
        category=FutureWarning,
        message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)",
    )
    return deepspeed


class Engine:
    """A DeepSpeed engine around `model` and `optimizer`, configured by `ds_config`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, ds_config: dict):
        ds = _deepspeed()
        self.ds, _, _, _ = ds.initialize(
            model=model, optimizer=optimizer, config=ds_config, dist_init_required=False
        )

    @property
    def module(self) -> nn.Module:
        return self.ds.module

    @property
    def device(self) -> torch.device:
        return self.ds.device

    def __call__(self, *args, **kwargs):
        return self.ds(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate `loss` as given (the caller has scaled it; no division by accumulation)."""
        self.ds.backward(loss, scale_wrt_gas=False)

    def step(self) -> None:
        """An engine step: accumulates inside a gradient-accumulation window, updates at its end."""
        self.ds.step()

    def was_step_applied(self) -> bool:
        return bool(self.ds.was_step_applied())

    def grad_norm(self) -> float:
        norm = self.ds.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def step_grad_norm(self) -> float | None:
        """The global gradient norm (over every rank) of the step being taken, as DeepSpeed's
        ZeRO optimizer computed it before it runs the wrapped optimizer (which may read it then)
        and as the engine itself reads it afterwards; None when it computed none."""
        norm = getattr(self.ds.optimizer, "_global_grad_norm", None)
        return None if norm is None else float(norm)

    def full_state(self, keep: bool) -> dict[str, torch.Tensor]:
        """Full fp32 weights under the model's own names, from ZeRO's fp32 master copy when it holds
        one. Collective under ZeRO: one full parameter gathered at a time; only ranks with `keep`
        collect them on the CPU. Tied parameters appear once, under their first name."""
        from deepspeed.utils import safe_get_full_fp32_param

        module, out = self.module, {}
        for name, p in module.named_parameters():
            full = safe_get_full_fp32_param(p)
            if full is None:  # not managed by a ZeRO optimizer: the parameter is already whole
                full = p.detach()
            if keep:
                out[own_name(name)] = full.detach().to("cpu", torch.float32).clone()
        if keep:
            params = {own_name(n) for n, _ in module.named_parameters(remove_duplicate=False)}
            for name, t in module.state_dict().items():
                if own_name(name) not in params and torch.is_tensor(t):  # persistent buffers
                    out[own_name(name)] = t.detach().cpu().clone()
        return out

    def save(self, directory: Path, tag: str) -> None:
        """The engine's own files (module, ZeRO-partitioned optimizer; each rank its partition)."""
        self.ds.save_checkpoint(str(directory), tag=tag, client_state={}, save_latest=False)

    def load(self, directory: Path, tag: str) -> None:
        path, _ = self.ds.load_checkpoint(
            str(directory), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise RuntimeError(
                f"DeepSpeed could not load the engine state from {Path(directory) / tag}"
            )


class _WeightsOnlyTorch:
    """torch as DeepSpeed's zero_to_fp32 sees it while consolidating: ``torch.load`` is torch's
    weights-only unpickler (tensors, containers and the few DeepSpeed records ZeRO files hold;
    nothing that runs code), whatever DeepSpeed asks for."""

    def __init__(self, safe: list):
        self._safe = safe

    def __getattr__(self, name):
        return getattr(torch, name)

    def load(self, *args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(self._safe):
            return torch.load(*args, **kwargs)


def consolidate_zero_checkpoint(
    checkpoints: Path, tag: str, *, trust_pickle: bool = False
) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a checkpoint written without model.safetensors, from its ZeRO shards
    (DeepSpeed's zero_to_fp32 utility). The shards are torch pickles: they are read with torch's
    weights-only unpickler, which refuses anything that would run code
    (``pickle.UnpicklingError``); ``trust_pickle=True`` reads them as DeepSpeed does, with the
    full unpickler: only for runs you wrote."""
    _deepspeed()
    from deepspeed.utils import zero_to_fp32

    if trust_pickle:
        sd = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(checkpoints), tag=tag)
    else:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        safe = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
        saved, zero_to_fp32.torch = zero_to_fp32.torch, _WeightsOnlyTorch(safe)
        try:
            sd = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(checkpoints), tag=tag)
        finally:
            zero_to_fp32.torch = saved
    return {own_name(k): v.float() for k, v in sd.items()}
