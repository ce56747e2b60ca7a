"""A preallocated key/value cache for generation: per layer K and V (B, max_len, Hkv, D), for all
layers the cached tokens' positions and segment ids (B, max_len). The model calls `begin`, then
`update(i, k, v)` in each layer i, then `commit(S)`; `begin` returns the keys' side of the step's
attention metadata (every cached token and the new ones), which all layers share.
"""

from __future__ import annotations

import torch
from torch import Tensor

from longvideo.kernels import Side
from longvideo.model.config import ModelConfig


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        batch: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (batch, max_len, cfg.n_kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.positions = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.segment_ids = torch.full((batch, max_len), -1, dtype=torch.long, device=device)
        self.max_len = max_len
        self.length = 0

    def begin(self, new: Side) -> Side:
        """Record the new tokens' positions and segment ids; return those of every key of the step
        (the cached tokens and the new ones)."""
        positions, segment_ids = new.positions, new.segment_ids
        S = positions.shape[1]
        if self.length + S > self.max_len:
            raise ValueError(
                f"KV cache overflow: {self.length} cached + {S} new > max_len {self.max_len}"
            )
        self.positions[:, self.length : self.length + S] = positions
        self.segment_ids[:, self.length : self.length + S] = segment_ids
        end = self.length + S
        return Side(self.positions[:, :end], self.segment_ids[:, :end])

    def update(self, idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write layer idx's k, v (B, S, Hkv, D) after the cached tokens; return all it caches so far."""
        start, end = self.length, self.length + k.shape[1]
        self.k[idx][:, start:end], self.v[idx][:, start:end] = k, v
        return self.k[idx][:, :end], self.v[idx][:, :end]

    def commit(self, n: int) -> None:
        self.length += n

    def next_position(self) -> Tensor:
        """Position of the next token for each batch row (B,)."""
        if self.length == 0:
            return torch.zeros(
                self.positions.shape[0], dtype=torch.long, device=self.positions.device
            )
        return self.positions[:, self.length - 1] + 1

    def crop(self, length: int) -> None:
        """Forget everything after the first `length` tokens (e.g. to ask a new question)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} tokens to {length}")
        self.segment_ids[:, length : self.length] = -1
        self.length = length
