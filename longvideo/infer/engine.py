"""Answering many questions against one long prefix: prefill the prefix once, keep its KV cache.

    engine = LocalEngine(model, prefill_chunk=2048)
    engine.set_prefix(video_ids)                   # (B, P): <bos> <vision> ... </vision>
    out = engine.generate(question_ids, max_new_tokens=32, stop_ids=[eos])   # (B, Q) -> Generation

Each `generate` forgets what the previous question appended (the cache is cropped back to the
prefix) and prefills only the question. `longvideo.infer.sp.SequenceParallelEngine` has the same
interface with the prefix sharded over the ranks of a sequence-parallel group.
"""

from __future__ import annotations

import time
from typing import Optional, Protocol, Sequence

import torch
from torch import Tensor

from longvideo.infer.generate import Generation, decode_loop, logits_of, new_cache, prefill, sample_token
from longvideo.model import KVCache, Transformer


class Engine(Protocol):
    prefix_len: int
    prefix_s: float

    def set_prefix(self, ids: Tensor) -> None: ...

    def generate(self, ids: Tensor, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 stop_ids: Sequence[int] = (), generator: Optional[torch.Generator] = None) -> Generation: ...


def copy_cache(src: KVCache, dst: KVCache) -> KVCache:
    """Copy the cached tokens of `src` into the (larger, empty) cache `dst`; return dst."""
    n = src.length
    if n > dst.max_len:
        raise ValueError(f"cannot copy {n} cached tokens into a cache of {dst.max_len}")
    for i in range(len(src.k)):
        dst.k[i][:, :n] = src.k[i][:, :n]
        dst.v[i][:, :n] = src.v[i][:, :n]
    dst.positions[:, :n] = src.positions[:, :n]
    dst.segment_ids[:, :n] = src.segment_ids[:, :n]
    dst.length = n
    return dst


class LocalEngine:
    """Single-process engine: chunked prefill of the prefix into one KV cache."""

    def __init__(self, model: Transformer, *, prefill_chunk: int = 4096, spare: int = 256):
        self.model, self.prefill_chunk, self.spare = model, prefill_chunk, spare
        self.cache: Optional[KVCache] = None
        self.prefix_len = 0
        self.prefix_s = 0.0

    @torch.no_grad()
    def set_prefix(self, ids: Tensor) -> None:
        """Prefill ids (B, P) (P may be 0) into a fresh cache sized P + `spare`."""
        B, P = ids.shape
        t0 = time.perf_counter()
        self.cache = new_cache(self.model, B, P + self.spare)
        if P:
            prefill(self.model, ids, self.cache, chunk=self.prefill_chunk)
        self.prefix_len, self.prefix_s = P, time.perf_counter() - t0

    @torch.no_grad()
    def generate(self, ids: Tensor, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 stop_ids: Sequence[int] = (), generator: Optional[torch.Generator] = None) -> Generation:
        """Prefill ids (B, Q >= 1) after the prefix and decode; the cache returns to the prefix after."""
        if self.cache is None:
            raise RuntimeError("set_prefix must be called before generate")
        self.cache.crop(self.prefix_len)  # forget the previous question and answer
        need = self.prefix_len + ids.shape[1] + max_new_tokens
        if need > self.cache.max_len:
            self.cache = copy_cache(self.cache, new_cache(self.model, ids.shape[0], need + self.spare))
        model, cache = self.model, self.cache
        t0 = time.perf_counter()
        first = logits_of(model, prefill(model, ids, cache, chunk=self.prefill_chunk))
        ttft = time.perf_counter() - t0

        def step(tok: Tensor) -> Tensor:
            return logits_of(model, model(tok[:, None], cache=cache))

        def pick(logits: Tensor) -> Tensor:
            return sample_token(logits, temperature, top_p, generator)

        tokens = decode_loop(step, first, max_new_tokens=max_new_tokens, pick=pick, stop_ids=stop_ids)
        return Generation(tokens=tokens, prompt_len=self.prefix_len + ids.shape[1], ttft_s=ttft,
                          total_s=time.perf_counter() - t0)
