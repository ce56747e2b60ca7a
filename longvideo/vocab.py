"""The unified token space, defined here and nowhere else.

Two layouts exist. The project's own (``layout="longvideo"``, the default):

    [0, text_size)                          text tokens of the text tokenizer
    text_size + 0                           <vision>   opens a video
    text_size + 1                           </vision>  closes a video
    text_size + 2                           <eof>      ends a frame (or a temporal group in causal-3D mode)
    text_size + 3                           <eov>      ends the last frame of a video
    [text_size + 4, text_size + 4 + K)      VQ codes 0..K-1 (K = codebook size)

The four special tokens are added to the Hugging Face tokenizer as *special* tokens, so each is a
single id and the exported checkpoint is a plain LlamaForCausalLM whose tokenizer knows them.

LWM's (``layout="lwm"``), the vocabulary of the released LWM-Chat checkpoints: their text
vocabulary followed by their vision vocabulary of ``vision_size`` ids (8448 = 8192 codes + 256):

    [0, text_size)                          text tokens (LWM's text ids; rows of its wte / lm_head)
    [text_size, text_size + K)              VQ codes 0..K-1 (LWM's vision ids 0..K-1)
    text_size + K                           <eof>      (LWM's vision id K = 8192)
    text_size + K + 1                       <eov>      (LWM's vision id K + 1 = 8193)
    [text_size + K + 2, text_size + vision_size)   unused vision ids

``<vision>`` and ``</vision>`` are plain text there (the tokenizer splits them into text pieces),
so they have no id of their own, and nothing is added to the tokenizer. LWM's model embeds a
vision id with its vision table and predicts it with its vision head; in this layout both tables
are simply stacked after the text ones, so LWM's logits are its text logits followed by its
vision logits, and its answers (text) are sampled from ids below ``text_size``
(:attr:`Vocab.answer_limit`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # the token space is plain integers: no torch needed to compose a config
    import torch

SPECIAL_TOKENS: tuple[str, ...] = ("<vision>", "</vision>", "<eof>", "<eov>")
VISION_START, VISION_END, END_OF_FRAME, END_OF_VIDEO = SPECIAL_TOKENS
LAYOUTS: tuple[str, ...] = ("longvideo", "lwm")
LWM_EXTRA_VISION_IDS = 256
"""LWM's vision vocabulary holds this many ids beyond the codebook (<eof>, <eov> and unused ones)."""


@dataclass(frozen=True)
class Vocab:
    """Id arithmetic of the unified vocabulary.

    text_size: number of ids the text tokenizer uses (before the four special tokens are added, in
    the longvideo layout). codebook_size: number of VQ codes. layout: "longvideo" or "lwm".
    vision_size: lwm layout only, ids of the vision vocabulary (default codebook_size + 256).
    """

    text_size: int
    codebook_size: int
    layout: str = "longvideo"
    vision_size: Optional[int] = None

    def __post_init__(self):
        if self.text_size <= 0 or self.codebook_size <= 0:
            raise ValueError(f"Vocab needs positive sizes, got {self}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"Vocab layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "longvideo" and self.vision_size is not None:
            raise ValueError("vision_size belongs to the lwm layout only")
        if self.layout == "lwm":
            if self.vision_size is None:
                object.__setattr__(self, "vision_size", self.codebook_size + LWM_EXTRA_VISION_IDS)
            if self.vision_size < self.codebook_size + 2:
                raise ValueError(f"the lwm layout needs vision_size >= codebook_size + 2 (codes, <eof>, <eov>), "
                                 f"got {self.vision_size} for codebook_size {self.codebook_size}")

    @property
    def is_lwm(self) -> bool:
        return self.layout == "lwm"

    @property
    def vision_start(self) -> Optional[int]:
        """The id of <vision>; None in the lwm layout, where it is text."""
        return None if self.is_lwm else self.text_size

    @property
    def vision_end(self) -> Optional[int]:
        """The id of </vision>; None in the lwm layout, where it is text."""
        return None if self.is_lwm else self.text_size + 1

    @property
    def eof(self) -> int:
        return self.text_size + (self.codebook_size if self.is_lwm else 2)

    @property
    def eov(self) -> int:
        return self.text_size + (self.codebook_size + 1 if self.is_lwm else 3)

    @property
    def special_ids(self) -> dict[str, int]:
        """The special tokens that have an id of their own, by name."""
        if self.is_lwm:
            return {END_OF_FRAME: self.eof, END_OF_VIDEO: self.eov}
        return {tok: self.text_size + i for i, tok in enumerate(SPECIAL_TOKENS)}

    @property
    def added_tokens(self) -> tuple[str, ...]:
        """The special tokens the text tokenizer gets (after its own ids): none in the lwm layout."""
        return () if self.is_lwm else SPECIAL_TOKENS

    @property
    def vq_offset(self) -> int:
        return self.text_size if self.is_lwm else self.text_size + len(SPECIAL_TOKENS)

    @property
    def size(self) -> int:
        """Total number of ids (the LM's vocabulary size)."""
        if self.is_lwm:
            return self.text_size + self.vision_size
        return self.vq_offset + self.codebook_size

    @property
    def video_end(self) -> int:
        """The last id of a video in a prompt, where the part worth caching ends: </vision>, or
        <eov> in the lwm layout (whose </vision> is text)."""
        return self.eov if self.is_lwm else self.text_size + 1

    @property
    def answer_limit(self) -> Optional[int]:
        """Answers are sampled from the ids below this one; None: from the whole vocabulary. LWM
        samples its answers from its text head alone, so in the lwm layout this is text_size."""
        return self.text_size if self.is_lwm else None

    def codes_to_ids(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.long() + self.vq_offset

    def ids_to_codes(self, ids: torch.Tensor) -> torch.Tensor:
        if not bool(self.is_code(ids).all()):
            raise ValueError("ids_to_codes got ids outside the VQ range")
        return ids.long() - self.vq_offset

    def is_code(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids >= self.vq_offset) & (ids < self.vq_offset + self.codebook_size)

    def is_text(self, ids: torch.Tensor) -> torch.Tensor:
        return ids < self.text_size

    def is_vision(self, ids: torch.Tensor) -> torch.Tensor:
        """Tokens that belong to the vision modality: codes, <eof> and <eov> (in the lwm layout,
        every id of the vision vocabulary: what LWM's vision mask marks)."""
        if self.is_lwm:
            return (ids >= self.text_size) & (ids < self.size)
        return self.is_code(ids) | (ids == self.eof) | (ids == self.eov)
