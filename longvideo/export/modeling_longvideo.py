"""transformers code for an exported longvideo model whose attention scales its queries with the
context (`model.attn_logn_base` > 0): Llama, plus one multiplication; it imports only torch and
transformers. The query at position p (position_ids) is multiplied by max(1, ln(p + 1) /
ln(attn_logn_base)); RoPE is a rotation, so scaling q_proj's output is the same, and two hooks do
it with any attention implementation. longvideo's docs/export.md, "Models whose queries scale with
the context"."""

import math

import torch
from transformers import LlamaConfig, LlamaForCausalLM


class LongVideoLlamaConfig(LlamaConfig):
    model_type = "longvideo_llama"

    def __init__(self, attn_logn_base: int = 0, **kwargs):
        self.attn_logn_base = attn_logn_base
        super().__init__(**kwargs)


class LongVideoLlamaForCausalLM(LlamaForCausalLM):
    config_class = LongVideoLlamaConfig

    def __init__(self, config: LongVideoLlamaConfig):
        super().__init__(config)
        if config.attn_logn_base:
            self._logn = _QueryScale(config.attn_logn_base)
            self.model.rotary_emb.register_forward_pre_hook(
                self._logn.read_positions, with_kwargs=True
            )
            for layer in self.model.layers:
                layer.self_attn.q_proj.register_forward_hook(self._logn.scale)


class _QueryScale:
    def __init__(self, base: int):
        self.log_base = math.log(base)
        self.factor = None

    def read_positions(self, module, args, kwargs):
        positions = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
        self.factor = (torch.log1p(positions.double()) / self.log_base).clamp(min=1.0)[
            ..., None
        ]  # (B, S, 1)

    def scale(self, module, args, output):
        return output * self.factor.to(output.dtype)
