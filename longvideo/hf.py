"""Ring attention for transformers decoders through transformers' own extension points, no model code
patched (docs/hf.md): `enable_ring_attention` registers it as an `attn_implementation`, `shard_batch`
cuts a batch into this rank's zigzag shard, and the loss divisor `num_items_in_batch` makes the
gradients those of the global token mean.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from longvideo.distributed import group_size_rank
from longvideo.kernels import AttentionMeta, default_scale
from longvideo.model.head import LMHead
from longvideo.parallel import RingAttentionSeam, layout_positions, shard_sequence, split_group
from longvideo.parallel.loss import check_reduction

RING = "ring"
SEGMENT_KEY = "ring_segment_ids"
POSITIONS_KEY = "ring_positions"
META_KEY = "ring_attention_meta"
IGNORE_INDEX = -100

# model types whose every cross-token interaction is attention with RoPE from position_ids, and
# which the tests run against transformers' own eager attention
TESTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# pad values of the sequence keys shard_batch knows
PAD_VALUES = {
    "input_ids": 0,
    "position_ids": 0,
    "labels": IGNORE_INDEX,
    "shift_labels": IGNORE_INDEX,
    SEGMENT_KEY: -1,
}


class RingAttentionUnsupported(ValueError):
    """The model (or this call) needs something ring attention does not compute exactly."""


def _group_size(group) -> int:
    if group is not None and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("a process group was given but torch.distributed is not initialised")
    return group_size_rank(group)[0]


def _sum_over(t: Tensor, group) -> int:
    """All-reduce (sum) `t` in place over `group` where torch.distributed runs; the group's size."""
    size = _group_size(group)
    if size > 1:
        dist.all_reduce(t, group=group)
    return size


class DeferredMask:
    """The arguments transformers would have built the mask from, kept unbuilt: the ring reads only
    the 2D padding; the sdpa fallback calls `materialize()` (transformers' own sdpa mask function)."""

    __slots__ = ("kwargs",)

    def __init__(self, kwargs: dict):
        self.kwargs = kwargs

    @property
    def padding(self) -> Tensor | None:
        """The 2D (B, kv_length) mask the user passed (True = real token), or None."""
        return self.kwargs.get("attention_mask")

    @property
    def has_overlay(self) -> bool:
        """True when the model composed extra mask functions (e.g. bidirectional image tokens)."""
        return bool(self.kwargs.get("use_vmap", False))

    def materialize(self):
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](**self.kwargs)

    def __repr__(self) -> str:
        return (
            f"DeferredMask(q_length={self.kwargs.get('q_length')}, kv_length={self.kwargs.get('kv_length')}, "
            f"padding={'yes' if self.padding is not None else 'no'})"
        )


def ring_mask(**kwargs) -> DeferredMask:
    """The mask function registered for "ring": builds no mask (O(1) work and memory)."""
    return DeferredMask(kwargs)


def _refuse(what: str) -> RingAttentionUnsupported:
    return RingAttentionUnsupported(
        f"ring attention cannot run this model exactly: {what}. Load it with attn_implementation='sdpa' "
        "instead (see docs/hf.md for what is supported)"
    )


def _plain_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, with the mask transformers' sdpa mask function builds."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if isinstance(attention_mask, DeferredMask):
        attention_mask = attention_mask.materialize()
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def _check_call(module, qkv: tuple[Tensor, Tensor, Tensor], seg: Tensor, world: int, call: dict):
    """Raise RingAttentionUnsupported for anything the ring would not compute exactly. qkv: the
    call's (B, H, S, D) query, key and value; seg: the shard's segment ids; call: the call's other
    keywords (attention_mask, dropout, sliding_window, ...). Every check uses only values that are
    the same on every rank of the ring, so all ranks raise together."""
    query, key, value = qkv
    B, Hq, S, D = query.shape
    if call.get("softcap") is not None:
        raise _refuse(f"attention logit soft-capping (softcap={call['softcap']})")
    for name in ("s_aux", "sinks", "position_bias"):
        if call.get(name) is not None:
            raise _refuse(f"the attention function receives '{name}' (attention sinks or biases)")
    dropout = call.get("dropout")
    if dropout:
        raise _refuse(f"attention dropout {dropout} in training (set config.attention_dropout = 0)")
    is_causal = call.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if not is_causal:
        raise _refuse("non-causal attention")
    if key.shape[2] != S:
        raise _refuse(
            f"{S} queries against {key.shape[2]} keys (a KV cache); the ring needs a shard's own "
            "keys: pass use_cache=False with sharded batches"
        )
    if value.shape[-1] != D:
        raise _refuse(f"value head dim {value.shape[-1]} differs from the query head dim {D}")
    if Hq % key.shape[1]:
        raise _refuse(f"{Hq} query heads are not a multiple of {key.shape[1]} key/value heads")
    if tuple(seg.shape) != (B, S):
        raise ValueError(
            f"{SEGMENT_KEY} has shape {tuple(seg.shape)}; this rank's shard is (B, S) = ({B}, {S}). "
            "Make batches with longvideo.hf.shard_batch"
        )
    sliding_window = call.get("sliding_window")
    if sliding_window is not None and S * world > sliding_window:
        raise _refuse(
            f"a sliding window of {sliding_window} tokens, which would mask keys of a "
            f"{S * world}-token sequence (ring attention is exact with a window only while the "
            "whole sequence fits in it)"
        )
    padding = call.get("attention_mask")
    if isinstance(padding, DeferredMask):
        if padding.has_overlay:
            raise _refuse("the model adds its own mask functions (e.g. bidirectional image tokens)")
        padding = padding.padding
    if padding is not None and not (padding.dim() == 2 and tuple(padding.shape) == (B, S)):
        raise _refuse(
            f"a custom attention mask of shape {tuple(padding.shape)} (only a 2D padding mask "
            "of the shard is supported)"
        )


def attention_meta(positions: Tensor, segment_ids: Tensor) -> AttentionMeta:
    """The attention metadata of a shard from `shard_batch` (its `position_ids` and
    `ring_segment_ids`), to pass as `ring_attention_meta=`: every layer of the forward then shares
    one object and its plans (without it each layer plans its own blocks; exact either way)."""
    return AttentionMeta.self_attention(positions, segment_ids.long())


def _shard_meta(query: Tensor, call: dict, group) -> AttentionMeta:
    """The call's metadata: `ring_attention_meta` when given, else one made from `ring_positions`
    (or the zigzag layout's) and `ring_segment_ids` with the call's padding as segment -1."""
    meta = call.pop(META_KEY, None)
    seg, pos = call.pop(SEGMENT_KEY, None), call.pop(POSITIONS_KEY, None)
    padding = call.get("attention_mask")
    padding = padding.padding if isinstance(padding, DeferredMask) else padding
    if meta is not None:
        if padding is not None:
            raise ValueError(
                f"{META_KEY} comes with an attention_mask: mark the padding in its segment ids (-1)"
            )
        return meta
    B, _, S, _ = query.shape
    seg = seg.to(query.device, torch.long)
    if padding is not None:
        seg = torch.where(padding.to(query.device).bool(), seg, -1)
    pos = (
        layout_positions(S, group, device=query.device).expand(B, S)
        if pos is None
        else pos.to(query.device)
    )
    return AttentionMeta.self_attention(pos, seg)


def seam_attention(seam, group=None):
    """A transformers attention function computing through a project seam (RingAttentionSeam over
    `group`, or LocalAttention) for calls that carry `ring_attention_meta` or `ring_segment_ids`;
    others run sdpa (docs/hf.md, "What happens inside the forward": shapes, positions, scaling)."""
    world = (
        _group_size(group) if hasattr(seam, "group") else 1
    )  # a seam without a group is one rank

    def attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
        call = dict(kwargs, attention_mask=attention_mask)
        if call.get(META_KEY) is None and call.get(SEGMENT_KEY) is None:
            # not a ring shard: generate, or a forward on whole sequences
            for name in (META_KEY, SEGMENT_KEY, POSITIONS_KEY):
                kwargs.pop(name, None)
            return _plain_attention(module, query, key, value, attention_mask, **kwargs)
        given = call.get(META_KEY)
        seg = given.queries.segment_ids if given is not None else call[SEGMENT_KEY]
        _check_call(module, (query, key, value), seg, world, call)
        meta = _shard_meta(query, call, group)
        D = query.shape[-1]
        scaling = call.get("scaling")
        if scaling is not None and not math.isclose(scaling, default_scale(D), rel_tol=1e-12):
            meta = meta.with_scale(scaling)  # the same plans; the kernels scale by it
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        return seam(q, k, v, meta), None

    attention.seam, attention.group = seam, group
    return attention


def enable_ring_attention(
    group, *, backend: str = "auto", name: str = RING, ulysses_size: int = 1
) -> str:
    """Register ring attention over `group` (None: the default group, or a world of one) as
    `attn_implementation=name`, once per process (again: replaces the group). Returns the name.

    backend: the block backend ("auto": the fastest exact kernel per block; "torch", "cpu").
    ulysses_size U > 1: heads all-to-all in groups of U neighbouring ranks, a ring across them
    (docs/hybrid.md); batches are sharded as for the ring."""
    _group_size(group)  # a group without an initialised process group is an error here
    return _register(
        name, RingAttentionSeam(group, backend, split_group(group, ulysses_size)), group
    )


def _register(name: str, seam, group) -> str:
    """Register `seam_attention(seam, group)` and `ring_mask` with transformers under `name`."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, seam_attention(seam, group))
    AttentionMaskInterface.register(name, ring_mask)
    return name


def check_model(
    model_or_config,
    *,
    seq_len: int | None = None,
    training: bool = True,
    allow_untested: bool = False,
) -> None:
    """Raise RingAttentionUnsupported, before any step, for a model the ring would not compute exactly
    (every attention call is checked as well). seq_len: the global training length (a shorter sliding
    window is refused). allow_untested: accept model types outside TESTED_MODEL_TYPES (what mixes
    tokens outside attention, e.g. convolutions or recurrences, would then be wrong)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    mt = getattr(cfg, "model_type", None)
    if mt not in TESTED_MODEL_TYPES and not allow_untested:
        raise _refuse(
            f"model type '{mt}' is not one of the tested types {', '.join(TESTED_MODEL_TYPES)} "
            "(pass allow_untested=True to try it)"
        )
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        raise _refuse(
            f"attention logit soft-capping (attn_logit_softcapping={cfg.attn_logit_softcapping})"
        )
    if training and float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0:
        raise _refuse(
            f"attention dropout {cfg.attention_dropout} in training (set config.attention_dropout = 0)"
        )
    if getattr(cfg, "is_causal", True) is False:
        raise _refuse("non-causal attention (config.is_causal = False)")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type == "dynamic":
        raise _refuse(
            "dynamic RoPE scaling (its frequencies follow the longest position of each forward, "
            "which a shard does not see, so every rank of a ring would rotate differently)"
        )
    window = _active_window(cfg)
    if window is not None and (seq_len is None or seq_len > window):
        raise _refuse(
            f"a sliding window of {window} tokens"
            + (f" with sequences of {seq_len}" if seq_len else "")
            + " (exact only while the whole sequence fits in the window; pass seq_len)"
        )


def _active_window(cfg) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    return None if getattr(cfg, "use_sliding_window", None) is False else int(window)


def _rms_norm_in_input_dtype(self, hidden_states: Tensor) -> Tensor:
    """transformers' RMSNorm (x * rsqrt(mean(x^2) + eps) * weight) in float32 at least, the input's
    dtype when wider: for 16-bit and float32 inputs the same operations as transformers'."""
    dtype = hidden_states.dtype
    h = hidden_states.to(torch.promote_types(dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(dtype)


def keep_float64(model: nn.Module) -> nn.Module:
    """Make float64 stay float64 through `model`'s RMSNorms: transformers' Llama, Qwen2, Qwen3 and
    Mistral norms cast to float32 whatever the dtype, so a float64 model is float32-accurate, and
    the attention's last-bit differences between one process and a ring (another summation order)
    come out as float32 roundings (~1e-7) after the next norm. Replaces `forward` on each RMSNorm
    instance (the classes are untouched) by the same computation in max(float32, input dtype): for
    float32 and 16-bit models the very same operations. `HFCausalLM` does it; use it on a model you
    run with attn_implementation="ring" in float64 (and `ring_loss`, which keeps float64, for the
    loss: transformers' own casts the logits to float32). Returns the model."""
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon"):
            m.forward = _rms_norm_in_input_dtype.__get__(m)
    return model


def document_ids(position_ids: Tensor) -> Tensor:
    """(B, S) document index per token: a document starts at token 0 and wherever a position is
    not the previous position + 1 (transformers' rule for packed batches)."""
    new = torch.ones_like(position_ids, dtype=torch.bool)
    new[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return new.long().cumsum(1) - 1


def shard_batch(
    batch: Mapping[str, Any],
    group,
    *,
    count: bool = True,
    grad_group=None,
    grad_reduction: str = "mean",
    pad_values: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """This rank's zigzag shard of an HF-style batch of whole sequences (B, S), the same batch on
    every rank of the ring (docs/hf.md, "The batch").

    Reads input_ids and optionally labels or shift_labels, position_ids, attention_mask,
    segment_ids; other (B, S, ...) keys need a pad value in `pad_values`. Returns input_ids,
    position_ids, ring_segment_ids and, with labels, shift_labels (also as `labels`) and, with
    `count` (collective over `grad_group`), num_items_in_batch."""
    check_reduction(grad_reduction)
    pads = {**PAD_VALUES, **(pad_values or {})}
    batch = dict(batch)
    if "input_ids" not in batch:
        raise ValueError("shard_batch needs input_ids")
    ids = batch.pop("input_ids")
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, S); got {tuple(ids.shape)}")
    B, S = ids.shape
    seqs = {}
    for key, t in batch.items():
        if key == "num_items_in_batch" or not torch.is_tensor(t) or t.dim() == 0:
            continue  # recomputed below / not a sequence
        if t.dim() < 2 or tuple(t.shape[:2]) not in (
            (B, S),
            (1 if key == "position_ids" else B, S),
        ):
            raise ValueError(
                f"batch['{key}'] has shape {tuple(t.shape)}; expected (B, S, ...) = ({B}, {S}, ...) "
                "like input_ids"
            )
        if key not in pads and key not in ("segment_ids", "attention_mask"):
            raise ValueError(
                f"no pad value for batch key '{key}'; pass pad_values={{'{key}': ...}}"
            )
        seqs[key] = t
    pos = seqs.pop("position_ids", None)
    pos = torch.arange(S, device=ids.device).expand(B, S) if pos is None else pos.expand(B, S)
    seg = seqs.pop("segment_ids", None)
    seg = document_ids(pos) if seg is None else seg.long()
    mask = seqs.pop("attention_mask", None)
    if mask is not None:
        seg = torch.where(mask.bool(), seg, -1)
    labels, shifted = seqs.pop("labels", None), seqs.pop("shift_labels", None)
    if shifted is None and labels is not None:  # labels[:, i + 1] at i, -100 at the end
        shifted = torch.cat([labels[:, 1:], labels.new_full((B, 1), IGNORE_INDEX)], dim=1)
    full = {"input_ids": ids, "position_ids": pos, SEGMENT_KEY: seg}
    if shifted is not None:
        full["shift_labels"] = torch.where(
            seg >= 0, shifted, IGNORE_INDEX
        )  # padding predicts nothing
    full.update(seqs)
    out = {k: shard_sequence(t, group, dim=1, pad_value=pads[k]) for k, t in full.items()}
    if "shift_labels" in out:
        out["labels"] = out["shift_labels"]
        if count:
            out["num_items_in_batch"] = num_items_in_batch(
                [out["shift_labels"]], grad_group=grad_group, grad_reduction=grad_reduction
            )
    return out


def num_items_in_batch(
    shift_labels: Iterable[Tensor],
    *,
    grad_group=None,
    grad_reduction: str = "mean",
    accumulation_steps: int = 1,
) -> Tensor:
    """The divisor that makes transformers' loss this rank's share of the global token mean: the
    label tokens of `shift_labels` (this rank's, every micro-batch of the step) summed over
    `grad_group` (collective; None: every process), / its size for "mean", / accumulation_steps
    (which the engine's backward divides by: the two cancel). A float64 scalar, at least
    1 / size, so a step without labels gives a zero loss, not NaN (docs/hf.md, "The loss")."""
    check_reduction(grad_reduction)
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
    labels = list(shift_labels)
    if not labels:
        raise ValueError("num_items_in_batch needs at least one label tensor")
    total = torch.tensor(
        float(sum(int((t != IGNORE_INDEX).sum()) for t in labels)), dtype=torch.float64
    )
    size = _sum_over(total, grad_group)
    total = total.clamp_min(1.0)
    # float64: total / size is not exact in float32 (a uniform ~1e-7 scale on the loss)
    total = total / size if grad_reduction == "mean" else total
    return (total / accumulation_steps).to(labels[0].device)


def ring_loss(
    logits_or_outputs,
    shift_labels: Tensor,
    *,
    num_items: Tensor | None = None,
    grad_group=None,
    grad_reduction: str = "mean",
) -> Tensor:
    """This rank's share of the global token-mean cross entropy, from its logits (or a model output
    with .logits) and its sharded `shift_labels`; the same value as `model(**batch).loss` for a
    batch from shard_batch. num_items: a precomputed num_items_in_batch (else counted here, a
    collective over grad_group)."""
    logits = getattr(logits_or_outputs, "logits", logits_or_outputs)
    if num_items is None:
        num_items = num_items_in_batch(
            [shift_labels], grad_group=grad_group, grad_reduction=grad_reduction
        )
    logits = logits.to(
        torch.promote_types(logits.dtype, torch.float32)
    )  # fp32 at least, fp64 stays
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        shift_labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return total / num_items.to(total.device, total.dtype)


def global_loss(loss: Tensor, *, grad_group=None, grad_reduction: str = "mean") -> float:
    """The global token-mean loss from every rank's `loss` (collective over grad_group, for logging):
    their mean for grad_reduction="mean", their sum for "sum"."""
    value = loss.detach().double().reshape(()).clone()
    size = _sum_over(value, grad_group)
    return float(value / size) if grad_reduction == "mean" else float(value)


class HFCausalLM(nn.Module):
    """A transformers causal LM behind the project decoder's training contract (`train.hf_model`,
    docs/hf.md): `loss_sum = lm(input_ids, positions, segment_ids, targets=t, loss_weights=w)` on
    this rank's zigzag shard. `parallelize` sets its seam (`set_attention`) and checkpointing; the
    loss is the project's chunked weighted cross-entropy on the decoder's hidden states and the
    model's own output projection, so no (tokens x vocab) logits are built."""

    _names = itertools.count()

    def __init__(self, model: nn.Module, *, loss_chunk: int = 4096):
        super().__init__()
        self.model = keep_float64(model)
        out = model.get_output_embeddings()
        # a module of its own around the same Parameter (as a tied head): ZeRO-3 gathers a module's
        # parameters when the module is called, and the chunked loss needs the whole weight
        self.loss_head = LMHead(out.weight.shape[1], out.weight.shape[0], loss_chunk)
        self.loss_head.weight = out.weight

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        seq_len: int | None = None,
        loss_chunk: int = 4096,
        dtype: torch.dtype = torch.float32,
    ) -> HFCausalLM:
        """Load a local transformers decoder for training; RingAttentionUnsupported when the ring could
        not compute it exactly. Its attention is sdpa until `set_attention`."""
        from transformers import AutoConfig, AutoModelForCausalLM

        check_model(AutoConfig.from_pretrained(path, local_files_only=True), seq_len=seq_len)
        model = AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="sdpa", dtype=dtype, local_files_only=True
        )
        model.config.use_cache = False  # training: no per-layer copy of the keys and values
        return cls(model, loss_chunk=loss_chunk)

    def set_attention(self, seam) -> None:
        """Compute the decoder's attention with `seam` (a project seam: ring or single-device)."""
        self.model.set_attn_implementation(
            _register(f"{RING}_seam_{next(self._names)}", seam, getattr(seam, "group", None))
        )

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.model.gradient_checkpointing_enable(**kwargs)

    @property
    def vocab_size(self) -> int:
        return int(self.loss_head.weight.shape[0])

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        segment_ids: Tensor,
        targets: Tensor,
        loss_weights: Tensor | None = None,
    ):
        decoder = self.model.get_decoder()
        out = decoder(
            input_ids=input_ids,
            position_ids=positions,
            use_cache=False,
            **{META_KEY: attention_meta(positions, segment_ids)},
        )
        return self.loss_head(out.last_hidden_state, targets, loss_weights)

    def save_hf(self, out_dir, state: dict[str, Tensor]) -> None:
        """Write a transformers directory from full weights under this module's names (the model's
        own names behind "model."; the loss head is the output projection, stored once)."""
        prefix = "model."
        own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        self.model.save_pretrained(str(out_dir), state_dict=own, safe_serialization=True)


__all__ = [
    "IGNORE_INDEX",
    "META_KEY",
    "PAD_VALUES",
    "RING",
    "SEGMENT_KEY",
    "TESTED_MODEL_TYPES",
    "DeferredMask",
    "attention_meta",
    "HFCausalLM",
    "RingAttentionUnsupported",
    "check_model",
    "document_ids",
    "enable_ring_attention",
    "global_loss",
    "keep_float64",
    "seam_attention",
    "num_items_in_batch",
    "ring_loss",
    "ring_mask",
    "shard_batch",
]
