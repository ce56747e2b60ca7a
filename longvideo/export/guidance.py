"""Text to video with transformers' `generate` on an exported directory (docs/generation.md, "With
transformers"): `VideoLogitsProcessor` runs the unconditional prompt beside generate's own forward
(its own KV cache), mixes the logits as `uncond + cfg * (cond - uncond)` and restricts each step to
what its slot allows (a code inside a frame, a forced id, <eof>/<eov>); `generate_video_hf` runs
it as `longvideo generate` does (LWM's two prompts for LWM models) and decodes the frames.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from longvideo.data.templates import (
    CODE_SLOT,
    END_SLOT,
    LWM_TOP_K_IMAGE,
    LWM_TOP_K_VIDEO,
    generation_prompts,
    video_slots,
)
from longvideo.vq import decode_codes


class VideoLogitsProcessor(LogitsProcessor):
    """For `model.generate` on one prompt: step i after `prompt_len` ids takes `slots[i]`
    (longvideo.data.templates.video_slots). With cfg_scale != 1 the unconditional prompt
    `uncond_ids` (1, U) and the ids generated so far are fed to `model` (its own KV cache, fed
    lazily: only before a sampled slot) and the scores mixed as uncond + cfg_scale * (cond -
    uncond)."""

    def __init__(
        self,
        model,
        uncond_ids: torch.Tensor | None,
        prompt_len: int,
        slots: Sequence[int],
        vocab,
        cfg_scale: float = 1.0,
    ):
        self.model, self.prompt_len, self.slots, self.vocab = model, prompt_len, list(slots), vocab
        self.cfg_scale, self.uncond = cfg_scale, uncond_ids
        self.guide = cfg_scale != 1.0 and uncond_ids is not None
        self.cache, self.fed = (
            None,
            -1,
        )  # generated ids the unconditional branch has seen (-1: none)

    def _uncond_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        from transformers import DynamicCache

        new = input_ids[:, self.prompt_len + max(self.fed, 0) :]
        if self.fed < 0:
            self.cache = DynamicCache()
            new = torch.cat([self.uncond.to(input_ids.device), new], dim=1)
        # the forward fills the cache in place; its keyword is `cache` in newer transformers
        params = inspect.signature(type(self.model).forward).parameters
        key = "cache" if "cache" in params else "past_key_values"
        out = self.model(input_ids=new, use_cache=True, **{key: self.cache})
        self.fed = input_ids.shape[1] - self.prompt_len
        return out.logits[:, -1].float()

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] != 1:
            raise ValueError("VideoLogitsProcessor generates one video at a time (batch 1)")
        step = input_ids.shape[1] - self.prompt_len
        slot = self.slots[min(step, len(self.slots) - 1)]
        if slot in (CODE_SLOT, END_SLOT) and self.guide:
            u = self._uncond_logits(input_ids)
            scores = u + self.cfg_scale * (scores.float() - u)
        keep = torch.zeros_like(scores, dtype=torch.bool)
        v = self.vocab
        if slot == CODE_SLOT:
            keep[:, v.vq_offset : v.vq_offset + v.codebook_size] = True
        elif slot == END_SLOT:
            keep[:, [v.eof, v.eov]] = True
        else:
            keep[:, slot] = True
        return scores.masked_fill(~keep, float("-inf"))


@dataclass
class HFGeneratedVideo:
    """codes int64 (G, h, w), frames uint8 (T, H, W, 3), ids: generate's ids after the prompt."""

    codes: np.ndarray
    frames: torch.Tensor
    ids: list[int]


def _generate(model, cond, uncond, slots, vocab, *, cfg_scale, top_k, top_p, temperature, stop):
    device = next(model.parameters()).device
    ids = torch.tensor([cond], dtype=torch.long, device=device)
    greedy = temperature == 0 or top_k == 1
    ends = dict(eos_token_id=[vocab.eov], pad_token_id=vocab.eov) if stop else {}
    sampling = (
        dict(do_sample=True, top_k=top_k or 0, top_p=top_p, temperature=temperature)
        if not greedy
        else dict(do_sample=False)
    )
    config = GenerationConfig(
        max_length=len(cond) + len(slots),
        min_new_tokens=0 if stop else len(slots),
        suppress_tokens=[],  # an LWM export suppresses its vision ids for text answers
        begin_suppress_tokens=[],
        **sampling,
        **ends,
    )
    proc = VideoLogitsProcessor(
        model,
        torch.tensor([uncond], dtype=torch.long),
        len(cond),
        slots,
        vocab,
        cfg_scale,
    )
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        generation_config=config,
        logits_processor=LogitsProcessorList([proc]),
    )
    return out[0, len(cond) :].tolist()


def generate_video_hf(
    model,
    processor,
    prompt: str,
    *,
    frames: int = 1,
    cfg_scale: float = 1.0,
    cfg_scale_video: float | None = None,
    top_k: int | None = None,
    top_p: float = 1.0,
    temperature: float = 1.0,
    seed: int = 0,
    model_ends: bool = False,
) -> HFGeneratedVideo:
    """`longvideo generate` with transformers: `model` an AutoModelForCausalLM of an exported
    directory, `processor` its LongVideoProcessor; the same prompts, slots and guidance, sampled by
    `model.generate` (its sampler and random stream: with top_k=1 the codes equal the command's)."""
    s, tok, vocab, vq = processor.settings, processor.tokenizer, processor.vocab, processor.vq
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    side = vq.cfg.resolution // vq.cfg.downsample
    per_group = side * side
    groups = len(vq.group_frame_index(frames))
    torch.manual_seed(seed)
    run = dict(top_p=top_p, temperature=temperature)
    if vocab.is_lwm:
        cond, uncond = generation_prompts(tok, vocab, prompt, template="lwm", video=False)
        slots = video_slots(tok, vocab, groups=1, codes_per_group=per_group)
        k = LWM_TOP_K_IMAGE if top_k is None else top_k
        ids = _generate(
            model, cond, uncond, slots, vocab, cfg_scale=cfg_scale, top_k=k, stop=False, **run
        )
        if groups > 1:
            cond, uncond = generation_prompts(tok, vocab, prompt, template="lwm", video=True)
            slots = video_slots(tok, vocab, groups=groups - 1, codes_per_group=per_group)
            ids = ids + _generate(
                model,
                cond + ids,
                uncond + ids,
                slots,
                vocab,
                cfg_scale=cfg_scale if cfg_scale_video is None else cfg_scale_video,
                top_k=LWM_TOP_K_VIDEO if top_k is None else top_k,
                stop=False,
                **run,
            )
    else:
        cond, uncond = generation_prompts(tok, vocab, prompt, template="qa")
        first = [g[0] for g in vq.group_frame_index(frames)]
        slots = video_slots(
            tok,
            vocab,
            groups=groups,
            codes_per_group=per_group,
            timestamps=[f / s.fps for f in first],
            timestamp_every=s.timestamp_every,
            model_ends=model_ends,
        )
        ids = _generate(
            model,
            cond,
            uncond,
            slots,
            vocab,
            cfg_scale=cfg_scale,
            top_k=top_k,
            stop=model_ends,
            **run,
        )
        if vocab.eov in ids:
            ids = ids[: ids.index(vocab.eov) + 1]
    lo, hi = vocab.vq_offset, vocab.vq_offset + vocab.codebook_size
    codes = np.asarray([i - lo for i in ids if lo <= i < hi], np.int64).reshape(-1, side, side)
    out = decode_codes(vq, codes)
    return HFGeneratedVideo(
        codes=codes, frames=out[:frames] if len(codes) == groups else out, ids=ids
    )
