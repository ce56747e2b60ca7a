"""The unified token space, defined here and nowhere else.

    [0, text_size)                          text tokens of the text tokenizer
    text_size + 0                           <vision>   opens a video
    text_size + 1                           </vision>  closes a video
    text_size + 2                           <eof>      ends a frame (or a temporal group in causal-3D mode)
    text_size + 3                           <eov>      ends the last frame of a video
    [text_size + 4, text_size + 4 + K)      VQ codes 0..K-1 (K = codebook size)

The four special tokens are added to the Hugging Face tokenizer as *special* tokens, so each is a
single id and the exported checkpoint is a plain LlamaForCausalLM whose tokenizer knows them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the token space is plain integers: no torch needed to compose a config
    import torch

SPECIAL_TOKENS: tuple[str, ...] = ("<vision>", "</vision>", "<eof>", "<eov>")
VISION_START, VISION_END, END_OF_FRAME, END_OF_VIDEO = SPECIAL_TOKENS


@dataclass(frozen=True)
class Vocab:
    """Id arithmetic of the unified vocabulary.

    text_size: number of ids the text tokenizer uses before the four special tokens are added.
    codebook_size: number of VQ codes.
    """

    text_size: int
    codebook_size: int

    def __post_init__(self):
        if self.text_size <= 0 or self.codebook_size <= 0:
            raise ValueError(f"Vocab needs positive sizes, got {self}")

    @property
    def vision_start(self) -> int:
        return self.text_size

    @property
    def vision_end(self) -> int:
        return self.text_size + 1

    @property
    def eof(self) -> int:
        return self.text_size + 2

    @property
    def eov(self) -> int:
        return self.text_size + 3

    @property
    def special_ids(self) -> dict[str, int]:
        return {tok: self.text_size + i for i, tok in enumerate(SPECIAL_TOKENS)}

    @property
    def vq_offset(self) -> int:
        return self.text_size + len(SPECIAL_TOKENS)

    @property
    def size(self) -> int:
        """Total number of ids (the LM's vocabulary size)."""
        return self.vq_offset + self.codebook_size

    def codes_to_ids(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.long() + self.vq_offset

    def ids_to_codes(self, ids: torch.Tensor) -> torch.Tensor:
        if not bool(self.is_code(ids).all()):
            raise ValueError("ids_to_codes got ids outside the VQ range")
        return ids.long() - self.vq_offset

    def is_code(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids >= self.vq_offset) & (ids < self.size)

    def is_text(self, ids: torch.Tensor) -> torch.Tensor:
        return ids < self.text_size

    def is_vision(self, ids: torch.Tensor) -> torch.Tensor:
        """Tokens that belong to the vision modality: codes, <eof> and <eov>."""
        return self.is_code(ids) | (ids == self.eof) | (ids == self.eov)
