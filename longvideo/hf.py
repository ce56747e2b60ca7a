"""Ring attention for transformers decoders, through transformers' own extension points.

    from longvideo.hf import enable_ring_attention, shard_batch

    enable_ring_attention(group)                                   # once per process
    # or enable_ring_attention(group, ulysses_size=4): heads all-to-all in groups of 4, ring across
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="ring")
    batch = shard_batch(batch, group)   # this rank's zigzag shard: ids, labels, positions, documents
    loss = model(**batch).loss           # this rank's share of the global token mean

`enable_ring_attention` registers an attention function named "ring" with
`transformers.AttentionInterface` and a mask function of the same name with
`transformers.AttentionMaskInterface`. No model code is patched. See docs/hf.md.

How the pieces meet inside transformers' forward:

* Documents. `shard_batch` derives document ids from the *global* position_ids before sharding
  (a document starts wherever a position is not the previous one + 1: transformers' rule for
  packed batches), marks padding with -1 and shards them with the zigzag layout. They reach the
  attention function as the extra keyword `ring_segment_ids`: transformers decoders forward unknown
  keywords of `model(**batch)` down to the attention function (checked for Llama, Mistral, Qwen2).
  The ring's causal rule uses the tokens' zigzag layout indices, which within one document differ
  from the position_ids by a constant, so no position_ids are needed by the attention itself.
* Masks. The registered mask function builds nothing: it returns a `DeferredMask` holding the
  arguments transformers would have built the mask from. The ring ignores it (apart from a 2D
  padding mask); the plain fallback materialises it with transformers' own sdpa mask function.
* Fallback. A call without `ring_segment_ids` (`generate`, a forward on unsharded inputs) runs
  transformers' sdpa attention on the local tensors, exactly as `attn_implementation="sdpa"`.
* Loss. `shard_batch` shifts the labels *before* sharding (a shard's next token can live on
  another rank) and passes them as `shift_labels`, which transformers' causal-LM loss uses as they
  are, together with `num_items_in_batch` = the global label count / the number of ranks whose
  gradients are averaged. Each rank's `loss` is then G x (its token-loss sum) / N: averaging the
  gradients over the G ranks gives exactly the gradient of the global token mean, and the mean
  of the G loss values is the global token mean (`global_loss`).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from longvideo.model.head import LMHead
from longvideo.parallel import RingAttentionSeam, layout_positions, shard_sequence, split_group

RING = "ring"
SEGMENT_KEY = "ring_segment_ids"
POSITIONS_KEY = "ring_positions"
IGNORE_INDEX = -100

# model types whose every cross-token interaction is attention with RoPE from position_ids, and
# which the tests run against transformers' own eager attention
TESTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# pad values of the sequence keys shard_batch knows
PAD_VALUES = {"input_ids": 0, "position_ids": 0, "labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX,
              SEGMENT_KEY: -1}


class RingAttentionUnsupported(ValueError):
    """The model (or this call) needs something ring attention does not compute exactly."""


# ---- groups ---------------------------------------------------------------------------------

def _size_rank(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialised")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


# ---- the mask function ----------------------------------------------------------------------

class DeferredMask:
    """What transformers' mask creation would have built the mask from, kept unbuilt.

    transformers hands the registered mask function the shapes, offsets, the composed mask
    function (causal, packed sequences, sliding window, overlays) and the 2D padding mask. The
    ring needs none of it but the padding; the sdpa fallback calls `materialize()`, which runs
    transformers' own sdpa mask function on exactly these arguments."""

    __slots__ = ("kwargs",)

    def __init__(self, kwargs: dict):
        self.kwargs = kwargs

    @property
    def padding(self) -> Optional[Tensor]:
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
        return (f"DeferredMask(q_length={self.kwargs.get('q_length')}, kv_length={self.kwargs.get('kv_length')}, "
                f"padding={'yes' if self.padding is not None else 'no'})")


def ring_mask(**kwargs) -> DeferredMask:
    """The mask function registered for "ring": builds no mask (O(1) work and memory)."""
    return DeferredMask(kwargs)


# ---- the attention function ------------------------------------------------------------------

def _refuse(what: str) -> RingAttentionUnsupported:
    return RingAttentionUnsupported(
        f"ring attention cannot run this model exactly: {what}. Load it with attn_implementation='sdpa' "
        "instead (see docs/hf.md for what is supported)")


def _plain_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, with the mask transformers' sdpa mask function builds."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if isinstance(attention_mask, DeferredMask):
        attention_mask = attention_mask.materialize()
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def _check_call(module, query, key, value, attention_mask, seg, world, dropout, sliding_window, kwargs) -> None:
    """Raise RingAttentionUnsupported for anything the ring would not compute exactly. Every check
    uses only values that are the same on every rank of the ring, so all ranks raise together."""
    B, Hq, S, D = query.shape
    if kwargs.get("softcap") is not None:
        raise _refuse(f"attention logit soft-capping (softcap={kwargs['softcap']})")
    for name in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise _refuse(f"the attention function receives '{name}' (attention sinks or biases)")
    if dropout:
        raise _refuse(f"attention dropout {dropout} in training (set config.attention_dropout = 0)")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if not is_causal:
        raise _refuse("non-causal attention")
    if key.shape[2] != S:
        raise _refuse(f"{S} queries against {key.shape[2]} keys (a KV cache); the ring needs a shard's own "
                      "keys: pass use_cache=False with sharded batches")
    if value.shape[-1] != D:
        raise _refuse(f"value head dim {value.shape[-1]} differs from the query head dim {D}")
    if Hq % key.shape[1]:
        raise _refuse(f"{Hq} query heads are not a multiple of {key.shape[1]} key/value heads")
    if tuple(seg.shape) != (B, S):
        raise ValueError(f"{SEGMENT_KEY} has shape {tuple(seg.shape)}; this rank's shard is (B, S) = ({B}, {S}). "
                         "Make batches with longvideo.hf.shard_batch")
    if sliding_window is not None:
        if S * world > sliding_window:
            raise _refuse(f"a sliding window of {sliding_window} tokens, which would mask keys of a "
                          f"{S * world}-token sequence (ring attention is exact with a window only while the "
                          "whole sequence fits in it)")
    padding = attention_mask
    if isinstance(attention_mask, DeferredMask):
        if attention_mask.has_overlay:
            raise _refuse("the model adds its own mask functions (e.g. bidirectional image tokens)")
        padding = attention_mask.padding
    if padding is not None and not (padding.dim() == 2 and tuple(padding.shape) == (B, S)):
        raise _refuse(f"a custom attention mask of shape {tuple(padding.shape)} (only a 2D padding mask "
                      "of the shard is supported)")


def seam_attention(seam, group=None):
    """A transformers attention function (signature below) that computes attention through one of
    the project's seams (longvideo.parallel.RingAttentionSeam over `group`, or the single-device
    LocalAttention), for calls that carry `ring_segment_ids` (a shard from `shard_batch`, or
    HFCausalLM's forward); other calls run transformers' sdpa attention.

    fn(module, query, key, value, attention_mask, *, dropout, scaling, sliding_window=None,
    softcap=None, **kwargs) with query (B, Hq, S, D) and key, value (B, Hkv, S, D); returns
    (out (B, S, Hq, D), None). Positions: `ring_positions` when given, else the zigzag layout's."""

    world = _size_rank(group)[0] if hasattr(seam, "group") else 1  # a seam without a group is one rank

    def attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float = 0.0,
                  scaling: Optional[float] = None, sliding_window: Optional[int] = None, **kwargs):
        seg = kwargs.pop(SEGMENT_KEY, None)
        pos = kwargs.pop(POSITIONS_KEY, None)
        if seg is None:  # not a ring shard: generate, or a forward on whole sequences
            return _plain_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                    sliding_window=sliding_window, **kwargs)
        _check_call(module, query, key, value, attention_mask, seg, world, dropout, sliding_window, kwargs)
        padding = attention_mask.padding if isinstance(attention_mask, DeferredMask) else attention_mask
        B, _, S, D = query.shape
        seg = seg.to(query.device, torch.long)
        if padding is not None:
            seg = torch.where(padding.to(query.device).bool(), seg, -1)
        pos = layout_positions(S, group, device=query.device).expand(B, S) if pos is None else pos.to(query.device)
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if scaling is not None and abs(scaling * math.sqrt(D) - 1.0) > 1e-12:
            q = q * (scaling * math.sqrt(D))  # the seams scale by 1/sqrt(D)
        out = seam(q, k, v, q_positions=pos, k_positions=pos, q_segment_ids=seg, k_segment_ids=seg, causal=True)
        return out, None

    attention.seam, attention.group = seam, group
    return attention


def make_ring_attention(group, backend: str = "auto", ulysses_size: int = 1):
    """The attention function registered as "ring": ring attention over `group` with `backend`'s
    block kernels, or the Ulysses x ring hybrid for ulysses_size > 1 (see seam_attention)."""
    return seam_attention(RingAttentionSeam(group, backend, split_group(group, ulysses_size)), group)


def enable_ring_attention(group, *, backend: str = "auto", name: str = RING, ulysses_size: int = 1) -> str:
    """Register ring attention over `group` as `attn_implementation=name` (once per process, before
    the model runs; registering again replaces the group). Returns the name.

    group: the ring's process group (every rank of it runs the same forward on its own shard);
    None is the default group, or a world of one without torch.distributed.
    backend: the ring's block backend ("auto": triton on CUDA, cpu otherwise; "torch", "cpu").
    ulysses_size: U > 1 splits the group into rings across groups of U neighbouring ranks that
    exchange heads by all-to-all (docs/hybrid.md); every rank of the world then calls this, each
    with its own group. Batches are sharded as for the ring (shard_batch).
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    _size_rank(group)  # a group without an initialised process group is an error here
    AttentionInterface.register(name, make_ring_attention(group, backend, ulysses_size))
    AttentionMaskInterface.register(name, ring_mask)
    return name


def check_model(model_or_config, *, seq_len: Optional[int] = None, training: bool = True,
                allow_untested: bool = False) -> None:
    """Raise RingAttentionUnsupported, before any step, for a model the ring would not compute exactly.

    The attention function checks every call as well (soft-capping, sinks, dropout, non-causal,
    sliding windows against the actual length); this catches the configuration early.
    seq_len: the global training length (a sliding window shorter than it is refused).
    allow_untested: accept model types outside TESTED_MODEL_TYPES (their attention calls are still
    checked; anything else that mixes tokens, e.g. convolutions or recurrences, would be wrong)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    mt = getattr(cfg, "model_type", None)
    if mt not in TESTED_MODEL_TYPES and not allow_untested:
        raise _refuse(f"model type '{mt}' is not one of the tested types {', '.join(TESTED_MODEL_TYPES)} "
                      "(pass allow_untested=True to try it)")
    for key in ("attn_logit_softcapping",):
        if getattr(cfg, key, None) is not None:
            raise _refuse(f"attention logit soft-capping ({key}={getattr(cfg, key)})")
    if training and float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0:
        raise _refuse(f"attention dropout {cfg.attention_dropout} in training (set config.attention_dropout = 0)")
    if getattr(cfg, "is_causal", True) is False:
        raise _refuse("non-causal attention (config.is_causal = False)")
    window = _active_window(cfg)
    if window is not None and (seq_len is None or seq_len > window):
        raise _refuse(f"a sliding window of {window} tokens" + (f" with sequences of {seq_len}" if seq_len else "")
                      + " (exact only while the whole sequence fits in the window; pass seq_len)")


def _active_window(cfg) -> Optional[int]:
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if getattr(cfg, "use_sliding_window", None) is False:
        return None
    return int(window)


# ---- batches --------------------------------------------------------------------------------

def document_ids(position_ids: Tensor) -> Tensor:
    """(B, S) document index per token: a document starts at token 0 and wherever a position is
    not the previous position + 1 (transformers' rule for packed batches)."""
    new = torch.ones_like(position_ids, dtype=torch.bool)
    new[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return new.long().cumsum(1) - 1


def shift_labels_of(labels: Tensor) -> Tensor:
    """labels[:, i + 1] at position i and -100 at the end: what transformers' loss shifts to."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


def shard_batch(batch: Mapping[str, Any], group, *, count: bool = True, grad_group=None,
                grad_reduction: str = "mean", pad_values: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """This rank's zigzag shard of an HF-style batch of whole sequences (B, S); every rank of the
    ring passes the same batch.

    Reads input_ids, and optionally labels (unshifted, as given to a transformers causal LM) or
    shift_labels (already shifted), position_ids (default 0..S-1 per row; restarts mark packed
    documents), attention_mask (0 = padding), segment_ids (explicit documents, -1 = padding; else
    derived from position_ids). Other (B, S, ...) keys need a pad value in `pad_values`.
    Returns input_ids, position_ids, ring_segment_ids, and when there are labels: `shift_labels`
    (pre-shifted, -100 on padding; `labels` is the same tensor, so that transformers computes a
    loss and never shifts again) and, with `count`, num_items_in_batch.

    The sequence is padded to a multiple of 2W (ids 0, positions 0, labels -100, document -1: the
    padding sees nothing and is seen by nothing). count=True is collective over `grad_group` (the
    ranks whose gradients are averaged or summed; None: every process): num_items_in_batch is the
    number of label tokens over all of them, divided by their number for grad_reduction="mean"
    (DeepSpeed, DDP and accelerate average), so each rank's loss is its share of the global mean.
    count=False (e.g. in a data collator; the HF Trainer counts `shift_labels` itself) adds none.
    """
    if grad_reduction not in ("mean", "sum"):
        raise ValueError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")
    pads = {**PAD_VALUES, **(pad_values or {})}
    batch = dict(batch)
    if "input_ids" not in batch:
        raise ValueError("shard_batch needs input_ids")
    ids = batch.pop("input_ids")
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, S); got {tuple(ids.shape)}")
    B, S = ids.shape
    dev = ids.device
    for key, t in batch.items():
        if torch.is_tensor(t) and t.dim() > 0 and key != "num_items_in_batch" and (
                t.dim() < 2 or tuple(t.shape[:2]) not in ((B, S), (1, S) if key == "position_ids" else (B, S))):
            raise ValueError(f"batch['{key}'] has shape {tuple(t.shape)}; expected (B, S, ...) = ({B}, {S}, ...) "
                             "like input_ids")
    pos = batch.pop("position_ids", None)
    pos = torch.arange(S, device=dev).expand(B, S) if pos is None else pos.expand(B, S) if pos.shape[0] == 1 else pos
    seg = batch.pop("segment_ids", None)
    seg = document_ids(pos) if seg is None else seg.long()
    mask = batch.pop("attention_mask", None)
    if mask is not None:
        seg = torch.where(mask.bool(), seg, -1)
    labels, shifted = batch.pop("labels", None), batch.pop("shift_labels", None)
    if shifted is None and labels is not None:
        shifted = shift_labels_of(labels)
    full = {"input_ids": ids, "position_ids": pos, SEGMENT_KEY: seg}
    if shifted is not None:
        full["shift_labels"] = torch.where(seg >= 0, shifted, IGNORE_INDEX)  # padding predicts nothing
    for key, t in batch.items():
        if key == "num_items_in_batch" or not torch.is_tensor(t) or t.dim() == 0:
            continue  # recomputed below / not a sequence
        if key not in pads:
            raise ValueError(f"no pad value for batch key '{key}'; pass pad_values={{'{key}': ...}}")
        full[key] = t
    out = {k: shard_sequence(t, group, dim=1, pad_value=pads[k]) for k, t in full.items()}
    if "shift_labels" in out:
        out["labels"] = out["shift_labels"]
        if count:
            out["num_items_in_batch"] = num_items_in_batch([out["shift_labels"]], grad_group=grad_group,
                                                           grad_reduction=grad_reduction)
    return out


def num_items_in_batch(shift_labels: Iterable[Tensor], *, grad_group=None, grad_reduction: str = "mean",
                       accumulation_steps: int = 1) -> Tensor:
    """The divisor that makes transformers' loss this rank's share of the global token mean.

    shift_labels: this rank's sharded label tensors of every micro-batch of one optimizer step.
    The label tokens (!= -100) are summed over them and over `grad_group` (collective; None: every
    process); for grad_reduction="mean" the total is divided by the group's size.
    accumulation_steps: what the engine divides each micro-batch's loss by (accelerate's and
    DeepSpeed's backward divide by the gradient accumulation steps); the divisor is divided by it
    too, so that the two cancel. Pass the same value to every micro-batch of the step.
    A float64 scalar (the loss it divides comes out in float64); never below 1 / size, so a step
    without label tokens gives a zero loss, not NaN."""
    if grad_reduction not in ("mean", "sum"):
        raise ValueError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
    labels = list(shift_labels)
    if not labels:
        raise ValueError("num_items_in_batch needs at least one label tensor")
    total = sum(int((t != IGNORE_INDEX).sum()) for t in labels)
    total = torch.tensor(float(total), dtype=torch.float64)
    size = 1
    if dist.is_available() and dist.is_initialized():
        size = dist.get_world_size(grad_group)
        if size > 1:
            dist.all_reduce(total, group=grad_group)
    total = total.clamp_min(1.0)
    # float64: total / size is not exact in float32 (a uniform ~1e-7 scale on the loss)
    total = total / size if grad_reduction == "mean" else total
    return (total / accumulation_steps).to(labels[0].device)


def ring_loss(logits_or_outputs, shift_labels: Tensor, *, num_items: Optional[Tensor] = None, grad_group=None,
              grad_reduction: str = "mean") -> Tensor:
    """This rank's share of the global token-mean cross entropy, from its logits (or a model output
    with .logits) and its sharded `shift_labels`; the same value as `model(**batch).loss` for a
    batch from shard_batch. num_items: a precomputed num_items_in_batch (else counted here, a
    collective over grad_group)."""
    logits = getattr(logits_or_outputs, "logits", logits_or_outputs)
    if num_items is None:
        num_items = num_items_in_batch([shift_labels], grad_group=grad_group, grad_reduction=grad_reduction)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least, fp64 stays
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1).to(logits.device),
                            ignore_index=IGNORE_INDEX, reduction="sum")
    return total / num_items.to(total.device, total.dtype)


def global_loss(loss: Tensor, *, grad_group=None, grad_reduction: str = "mean") -> float:
    """The global token-mean loss from every rank's `loss` (collective over grad_group, for logging):
    their mean for grad_reduction="mean", their sum for "sum"."""
    value = loss.detach().double().reshape(()).clone()
    size = 1
    if dist.is_available() and dist.is_initialized():
        size = dist.get_world_size(grad_group)
        if size > 1:
            dist.all_reduce(value, group=grad_group)
    return float(value / size) if grad_reduction == "mean" else float(value)


# ---- the project trainer's view of a transformers model -------------------------------------------

class HFCausalLM(nn.Module):
    """A transformers causal LM behind the project model's training contract, so that `longvideo
    train` trains it (`train.hf_model=DIR`) with the same data, loss normalisation, ZeRO and
    checkpoints as its own decoder:

        loss_sum = lm(input_ids, positions, segment_ids, targets=t, loss_weights=w)

    The inputs are this rank's zigzag shard (longvideo.parallel.shard_batch). `parallelize` gives it
    its attention seam (`set_attention`: ring attention over the sp group, registered with
    transformers' AttentionInterface; positions and segment ids travel as `ring_positions` and
    `ring_segment_ids`) and activation checkpointing (transformers' own switch). The loss is the
    project's chunked weighted cross-entropy on the decoder's hidden states and the model's own
    output projection, so loss weights of any value work and no (tokens x vocab) logits are built.
    """

    _names = itertools.count()

    def __init__(self, model: nn.Module, *, loss_chunk: int = 4096):
        super().__init__()
        self.model = model
        out = model.get_output_embeddings()
        # a module of its own around the same Parameter (as a tied head): ZeRO-3 gathers a module's
        # parameters when the module is called, and the chunked loss needs the whole weight
        self.loss_head = LMHead(out.weight.shape[1], out.weight.shape[0], loss_chunk)
        self.loss_head.weight = out.weight

    @classmethod
    def from_pretrained(cls, path: str, *, seq_len: Optional[int] = None, loss_chunk: int = 4096,
                        dtype: torch.dtype = torch.float32) -> "HFCausalLM":
        """Load a local transformers decoder for training; RingAttentionUnsupported when the ring could
        not compute it exactly. Its attention is sdpa until `set_attention`."""
        from transformers import AutoConfig, AutoModelForCausalLM

        check_model(AutoConfig.from_pretrained(path, local_files_only=True), seq_len=seq_len)
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=dtype,
                                                     local_files_only=True)
        model.config.use_cache = False  # training: no per-layer copy of the keys and values
        return cls(model, loss_chunk=loss_chunk)

    def set_attention(self, seam) -> None:
        """Compute the decoder's attention with `seam` (a project seam: ring or single-device)."""
        from transformers import AttentionInterface, AttentionMaskInterface

        name = f"{RING}_seam_{next(self._names)}"
        AttentionInterface.register(name, seam_attention(seam, getattr(seam, "group", None)))
        AttentionMaskInterface.register(name, ring_mask)
        self.model.set_attn_implementation(name)

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.model.gradient_checkpointing_enable(**kwargs)

    @property
    def vocab_size(self) -> int:
        return int(self.loss_head.weight.shape[0])

    def forward(self, input_ids: Tensor, positions: Tensor, segment_ids: Tensor, targets: Tensor,
                loss_weights: Optional[Tensor] = None):
        decoder = self.model.get_decoder()
        out = decoder(input_ids=input_ids, position_ids=positions, use_cache=False,
                      **{SEGMENT_KEY: segment_ids, POSITIONS_KEY: positions})
        return self.loss_head(out.last_hidden_state, targets, loss_weights)

    def save_hf(self, out_dir, state: dict[str, Tensor]) -> None:
        """Write a transformers directory from full weights under this module's names (the model's
        own names behind "model."; the loss head is the output projection, stored once)."""
        prefix = "model."
        own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        self.model.save_pretrained(str(out_dir), state_dict=own, safe_serialization=True)


__all__ = [
    "IGNORE_INDEX",
    "PAD_VALUES",
    "RING",
    "SEGMENT_KEY",
    "TESTED_MODEL_TYPES",
    "DeferredMask",
    "HFCausalLM",
    "RingAttentionUnsupported",
    "check_model",
    "document_ids",
    "enable_ring_attention",
    "global_loss",
    "make_ring_attention",
    "seam_attention",
    "num_items_in_batch",
    "ring_loss",
    "ring_mask",
    "shard_batch",
    "shift_labels_of",
]
