"""Everything distributed is applied to a built model here, in one fixed order (docs/architecture.md,
decision 5). Inputs must then be this rank's zigzag shard with explicit positions and segment ids
(`shard_batch`). A model is parallelizable when it offers `set_attention(seam)` and either `layers`
(the project's decoder) or `gradient_checkpointing_enable` (a transformers decoder behind
longvideo.hf.HFCausalLM).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from longvideo.configtools import ConfigError
from longvideo.model import LocalAttention
from longvideo.parallel.compile import apply_compile
from longvideo.parallel.deepspeed_config import build_deepspeed_config
from longvideo.parallel.engine import Engine
from longvideo.parallel.mesh import Mesh
from longvideo.parallel.seam import RingAttentionSeam
from longvideo.parallel.ulysses import head_split


def apply_attention(model: nn.Module, mesh: Mesh, backend: str = "auto") -> None:
    """The sequence-parallel seam: ring (or hybrid, mesh.ulysses > 1) attention over mesh.sp_group
    when sp > 1, else the single-device seam, all over `backend`'s block kernels."""
    if not hasattr(model, "set_attention"):
        raise TypeError(f"{type(model).__name__} has no attention seam (set_attention)")
    cfg = getattr(model, "cfg", None) or getattr(
        getattr(model, "model", None), "config", None
    )  # ours, or HF's
    hq = getattr(cfg, "n_heads", None) or getattr(cfg, "num_attention_heads", None)
    if mesh.ulysses > 1 and hq:  # refuse a split the model's heads cannot take before any step
        try:
            head_split(
                hq,
                getattr(cfg, "n_kv_heads", None) or getattr(cfg, "num_key_value_heads", None) or hq,
                mesh.ulysses,
                mesh.sp,
            )
        except ValueError as e:
            raise ConfigError("parallel.ulysses", str(e)) from None
    seam = (
        RingAttentionSeam(mesh.sp_group, backend, mesh.ulysses_groups)
        if mesh.sp > 1
        else LocalAttention(backend)
    )
    model.set_attention(seam)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every decoder block in the backward pass: the project's blocks wrapped with torch's
    non-reentrant checkpoint_wrapper (the engine strips it from parameter names), a transformers
    decoder by its own switch."""
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__} has neither decoder `layers` nor gradient_checkpointing_enable"
        )
    for i, block in enumerate(layers):
        if not hasattr(block, "_checkpoint_wrapped_module"):
            layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    cfg,
    *,
    optimizer,
    ds_config: dict | None = None,
    bf16: bool = False,
) -> Engine:
    """Apply the seam, activation checkpointing, torch.compile and ZeRO to `model` (module docstring)
    and return the engine that trains it (collective: every rank calls it with the same config).
    cfg: the root Config (its parallel, runtime and train sections). optimizer: over the model's
    parameters. ds_config: the DeepSpeed config when the caller built (and checked) it, else built
    here from cfg.train for the mesh's world at `bf16`."""
    apply_attention(model, mesh, cfg.parallel.backend)
    if cfg.runtime.activation_checkpointing:
        apply_activation_checkpointing(model)
    if ds_config is None:
        ds_config = build_deepspeed_config(cfg.train, world_size=mesh.world_size, bf16=bf16)
    if cfg.runtime.compile:
        if ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
            raise ConfigError(
                "runtime.compile",
                "ZeRO-3 gathers parameters in module hooks that the compiled "
                "blocks cannot trace: use train.zero_stage <= 2, or runtime.compile=false",
            )
        apply_compile(model)
    return Engine(model, optimizer, ds_config)
