"""Generation with a KV cache: chunked prefill, nucleus sampling, the decoding loop, and the engines
that both run it (docs/inference.md, "Python API" and "Chunked prefill").
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from longvideo.model import KVCache, Transformer

GREEDY_BELOW = 1e-5
"""A temperature below this is greedy decoding (vLLM's `_SAMPLING_EPS`)."""
MIN_TEMPERATURE = 1e-2
"""A sampling temperature is at least this (vLLM's `_MAX_TEMP`): lower ones are raised to it."""


def clamp_temperature(temperature: float) -> float:
    """The temperature sampling uses: 0 (greedy) below GREEDY_BELOW, else at least
    MIN_TEMPERATURE."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    return 0.0 if temperature < GREEDY_BELOW else max(temperature, MIN_TEMPERATURE)


def sample_token(
    logits: Tensor,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    top_k: int = 0,
) -> Tensor:
    """One token per row of logits (B, V) -> (B,) long: the argmax when greedy, else a sample of
    softmax(logits / temperature) over the `top_k` most likely tokens (0: all) and, of those, the
    smallest set whose mass reaches top_p.

    Clamped as vLLM does: a temperature below 1e-5 is greedy, one below 1e-2 is raised to 1e-2.
    The sampling never sees NaN or infinity: NaN logits count as -inf, +inf ones are the only
    candidates of their row, and the logits are shifted by their row's maximum before dividing by
    the temperature. A row with no finite logit at all raises ValueError (a broken model)."""
    if not 0 < top_p <= 1:
        raise ValueError(f"need 0 < top_p <= 1, got {top_p}")
    if top_k < 0:
        raise ValueError(f"need top_k >= 0 (0: every token), got {top_k}")
    temperature = clamp_temperature(temperature)
    x = torch.nan_to_num(logits.float(), nan=-math.inf)  # (B, V)
    top = x.amax(dim=-1, keepdim=True)
    if bool(torch.isneginf(top).any()):
        raise ValueError("the model gave a row of logits with no finite value (NaN or -inf)")
    inf_rows = torch.isposinf(top)
    # a row with +inf logits: those tokens alone, equally likely; else shift by the row's maximum
    x = torch.where(inf_rows, torch.where(torch.isposinf(x), 0.0, -math.inf), x - top)
    if temperature == 0:
        return x.argmax(dim=-1)
    x = x / temperature  # <= 0 everywhere, 0 at the maximum: softmax is finite
    if 0 < top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    probs = torch.softmax(x, dim=-1)
    if top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token when the tokens ranked above it already carry top_p: the first token stays
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_p, 1, generator=generator)  # multinomial renormalises
        return order.gather(-1, choice).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def new_cache(model: Transformer, batch: int, max_len: int) -> KVCache:
    """An empty KV cache in the model's dtype and device."""
    p = next(model.parameters())
    return KVCache(model.cfg, batch, max_len, dtype=p.dtype, device=p.device)


@torch.no_grad()
def prefill(model: Transformer, ids: Tensor, cache: KVCache, *, chunk: int) -> Tensor:
    """Append ids (B, S) to `cache` (positions continuing after it, one segment), `chunk` tokens per
    forward; return the last hidden (B, 1, dim)."""
    S = ids.shape[1]
    if S == 0:
        raise ValueError("prefill needs at least one token")
    if chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
    last = None
    for s in range(0, S, chunk):
        hidden = model(
            ids[:, s : s + chunk], cache=cache
        )  # (B, c, dim); the model continues the positions
        last = hidden[:, -1:]
        del hidden  # only the last token's state is needed; free the chunk before the next one
    return last


def decode_loop(
    step: Callable[[Tensor], Tensor],
    first_logits: Tensor,
    *,
    max_new_tokens: int,
    pick: Callable[[Tensor], Tensor],
    stop_ids: Sequence[int] = (),
) -> Tensor:
    """Up to max_new_tokens tokens (B, n) long. first_logits (B, V) are the prompt's last logits;
    step(tokens (B,)) feeds one token per row and returns the next logits (B, V). A row stops at
    its first stop id and then repeats it; the loop ends when every row has stopped."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    B = first_logits.shape[0]
    stops = torch.tensor(list(stop_ids), dtype=torch.long, device=first_logits.device)
    done = torch.zeros(B, dtype=torch.bool, device=first_logits.device)
    filler = stops[:1].expand(B) if len(stops) else None
    tokens: list[Tensor] = []
    logits = first_logits
    for t in range(max_new_tokens):
        tok = pick(logits)
        if filler is not None:
            tok = torch.where(done, filler, tok)
            done = done | torch.isin(tok, stops)
        tokens.append(tok)
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        logits = step(tok)
    return torch.stack(tokens, dim=1)


def trim_at_stop(tokens: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """Tokens before the first stop id."""
    return [int(t) for t in itertools.takewhile(lambda t: t not in stop_ids, tokens)]


@dataclass
class Generation:
    """tokens (B, n): the generated ids (a row that stopped repeats its stop id); prompt_len: the
    tokens prefilled; ttft_s: seconds from the start of prefill to the first token; total_s: to the last."""

    tokens: Tensor
    prompt_len: int
    ttft_s: float
    total_s: float


def logits_of(model: Transformer, hidden: Tensor) -> Tensor:
    """Last-position logits (B, V) in fp32 from hidden (B, S, dim)."""
    return model.logits(hidden[:, -1:])[:, -1].float()


def grown(model: Transformer, cache: KVCache, need: int, spare: int) -> KVCache:
    """`cache` when it holds `need` tokens, else a copy of its tokens in a new one of need + spare."""
    if need <= cache.max_len:
        return cache
    dst, n = new_cache(model, cache.positions.shape[0], need + spare), cache.length
    for src_t, dst_t in zip(
        [*cache.k, *cache.v, cache.positions, cache.segment_ids],
        [*dst.k, *dst.v, dst.positions, dst.segment_ids],
    ):
        dst_t[:, :n] = src_t[:, :n]
    dst.length = n
    return dst


class CachedEngine:
    """The `Engine` interface and what both engines share: a KV cache holding the prefix, grown on
    demand, and one generate and extend path; a subclass sets model, spare, cache and gives set_prefix,
    _hidden(ids, start), _logits(ids, start) and _pick (docs/inference.md, "Python API")."""

    prefix_len = local_prefix_len = 0
    prefix_s = 0.0
    sharded: int | None = None
    """The first held tokens `keep` may not drop (the sequence-parallel engine's ring-sharded prefix)."""

    @property
    def held(self) -> int:
        """Tokens the cache holds: the prefix, then the last generate's ids and the answer fed back."""
        return (
            self.prefix_len + self.cache.length - self.local_prefix_len
            if self.cache is not None
            else 0
        )

    def keep(self, n: int) -> None:
        """The first n held tokens become the prefix of the next generate (a conversation's next
        turn extends the cache instead of prefilling everything again)."""
        if self.sharded is not None and not self.sharded <= n <= self.held:
            raise ValueError(
                f"can keep {self.sharded} to {self.held} tokens, not {n}: the first "
                f"{self.sharded} are sharded"
            )
        local = self.local_prefix_len + n - self.prefix_len
        self.cache.crop(local)
        self.prefix_len, self.local_prefix_len = n, local

    def _pick(self, tokens: Tensor) -> Tensor:
        return tokens

    @torch.no_grad()
    def generate(
        self,
        ids: Tensor,
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_ids: Sequence[int] = (),
        generator: torch.Generator | None = None,
        vocab_limit: int | None = None,
        top_k: int = 0,
    ) -> Generation:
        """Prefill ids (B, Q >= 1) after the prefix and decode (collective for the sequence-parallel
        engine); the cache returns to the prefix after. vocab_limit: sample only ids below it; top_k:
        only the k most likely (0: all; `sample_token`)."""
        if self.cache is None:
            raise RuntimeError("set_prefix must be called before generate")
        Q = ids.shape[1]
        self.cache.crop(self.local_prefix_len)  # forget the previous question and answer
        self.cache = grown(
            self.model, self.cache, self.local_prefix_len + Q + max_new_tokens, self.spare
        )
        t0 = time.perf_counter()
        first = self._logits(ids, self.prefix_len)
        ttft = time.perf_counter() - t0
        positions = itertools.count(self.prefix_len + Q)

        def pick(logits: Tensor) -> Tensor:
            return self._pick(
                sample_token(logits[..., :vocab_limit], temperature, top_p, generator, top_k)
            )

        tokens = decode_loop(
            lambda tok: self._logits(tok[:, None], next(positions)),
            first,
            max_new_tokens=max_new_tokens,
            stop_ids=stop_ids,
            pick=pick,
        )
        return Generation(
            tokens=tokens,
            prompt_len=self.prefix_len + Q,
            ttft_s=ttft,
            total_s=time.perf_counter() - t0,
        )

    @torch.no_grad()
    def extend(self, ids: Tensor, *, keep: int = 0) -> Tensor:
        """Feed ids (B, n) after the prefix and the first `keep` tokens cached after it (the rest of
        the cache is dropped); return their hidden states (B, n, dim), e.g. to score a continuation
        (collective for the sequence-parallel engine, with the same ids on every rank)."""
        if self.cache is None:
            raise RuntimeError("set_prefix must be called before extend")
        self.cache.crop(self.local_prefix_len + keep)
        self.cache = grown(self.model, self.cache, self.cache.length + ids.shape[1], self.spare)
        return self._hidden(ids, self.prefix_len + keep)


Engine = CachedEngine
"""What chat, the evaluations and the server drive; an engine of one's own gives the same methods."""


class LocalEngine(CachedEngine):
    """Single-process engine: chunked prefill of the prefix into one KV cache. cache: start from an
    existing cache (its tokens are the prefix) instead of calling set_prefix."""

    def __init__(
        self,
        model: Transformer,
        *,
        prefill_chunk: int = 4096,
        spare: int = 256,
        cache: KVCache | None = None,
    ):
        self.model, self.prefill_chunk, self.spare, self.cache = model, prefill_chunk, spare, cache
        self.prefix_len = self.local_prefix_len = cache.length if cache is not None else 0

    @torch.no_grad()
    def set_prefix(self, ids: Tensor) -> None:
        """Prefill ids (B, P) (P may be 0) into a fresh cache sized P + `spare`."""
        B, P = ids.shape
        t0 = time.perf_counter()
        self.cache = new_cache(self.model, B, P + self.spare)
        if P:
            prefill(self.model, ids, self.cache, chunk=self.prefill_chunk)
        self.prefix_len = self.local_prefix_len = P
        self.prefix_s = time.perf_counter() - t0

    def _logits(self, ids: Tensor, start: int) -> Tensor:
        """Chunked prefill (one forward for a decoding step); the positions continue after the cache's
        tokens, which is `start` here."""
        return logits_of(self.model, prefill(self.model, ids, self.cache, chunk=self.prefill_chunk))

    def _hidden(self, ids: Tensor, start: int) -> Tensor:
        """One forward; the positions continue after the cache's tokens, which is `start` here."""
        return self.model(ids, cache=self.cache)


@torch.no_grad()
def generate(
    model: Transformer,
    ids: Tensor,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] = (),
    prefill_chunk: int = 4096,
    generator: torch.Generator | None = None,
    cache: KVCache | None = None,
) -> Generation:
    """Prefill ids (B, S) in chunks into a KV cache, then decode with the cache. `cache`: continue an
    existing cache (its tokens precede ids); by default a fresh one of S + max_new_tokens."""
    B, S = ids.shape
    engine = LocalEngine(
        model,
        prefill_chunk=prefill_chunk,
        spare=0,
        cache=cache if cache is not None else new_cache(model, B, S + max_new_tokens),
    )
    return engine.generate(
        ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        stop_ids=stop_ids,
        generator=generator,
    )
