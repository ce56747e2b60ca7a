"""A preallocated key/value cache for generation: per layer K and V (B, max_len, Hkv, D), for all
layers the cached tokens' positions and segment ids (B, max_len). The model calls `begin`, then
`layer(i).update(k, v)` in each layer, then `commit(S)`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from longvideo.model.config import ModelConfig


class _LayerCache:
    def __init__(self, parent: "KVCache", idx: int):
        self.parent, self.idx = parent, idx

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Write k, v (B, S, Hkv, D) after the cached tokens; return everything cached so far."""
        c = self.parent
        start, end = c.length, c.length + k.shape[1]
        c.k[self.idx][:, start:end] = k
        c.v[self.idx][:, start:end] = v
        return c.k[self.idx][:, :end], c.v[self.idx][:, :end], c.positions[:, :end], c.segment_ids[:, :end]


class KVCache:
    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        shape = (batch, max_len, cfg.n_kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.positions = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.segment_ids = torch.full((batch, max_len), -1, dtype=torch.long, device=device)
        self.max_len = max_len
        self.length = 0

    def begin(self, positions: Tensor, segment_ids: Tensor) -> None:
        S = positions.shape[1]
        if self.length + S > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length} cached + {S} new > max_len {self.max_len}")
        self.positions[:, self.length:self.length + S] = positions
        self.segment_ids[:, self.length:self.length + S] = segment_ids

    def layer(self, idx: int) -> _LayerCache:
        return _LayerCache(self, idx)

    def commit(self, n: int) -> None:
        self.length += n

    def next_position(self) -> Tensor:
        """Position of the next token for each batch row (B,)."""
        if self.length == 0:
            return torch.zeros(self.positions.shape[0], dtype=torch.long, device=self.positions.device)
        return self.positions[:, self.length - 1] + 1

    def crop(self, length: int) -> None:
        """Forget everything after the first `length` tokens (e.g. to ask a new question)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} tokens to {length}")
        self.segment_ids[:, length:self.length] = -1
        self.length = length
