"""The unified token space, defined here and nowhere else (docs/vocabulary.md).

layout "longvideo": text ids, then <vision>, </vision>, <eof>, <eov> (added to the text tokenizer as
special tokens), then the K VQ codes. layout "lwm" (LWM-Chat's): text ids, then LWM's vision
vocabulary (K codes, <eof>, <eov>, unused ids); <vision> and </vision> are text there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the token space is plain integers: no torch needed to compose a config
    import torch

SPECIAL_TOKENS: tuple[str, ...] = ("<vision>", "</vision>", "<eof>", "<eov>")
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
    vision_size: int | None = None

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
                raise ValueError(
                    f"the lwm layout needs vision_size >= codebook_size + 2 (codes, <eof>, <eov>), "
                    f"got {self.vision_size} for codebook_size {self.codebook_size}"
                )

    @property
    def is_lwm(self) -> bool:
        return self.layout == "lwm"

    @property
    def vision_start(self) -> int | None:
        """The id of <vision>; None in the lwm layout, where it is text."""
        return None if self.is_lwm else self.text_size

    @property
    def vision_end(self) -> int | None:
        """The id of </vision>; None in the lwm layout, where it is text."""
        return None if self.is_lwm else self.text_size + 1

    @property
    def eof(self) -> int:
        return self.text_size + (self.codebook_size if self.is_lwm else 2)

    @property
    def eov(self) -> int:
        return self.text_size + (self.codebook_size + 1 if self.is_lwm else 3)

    @property
    def vq_offset(self) -> int:
        return self.text_size if self.is_lwm else self.text_size + len(SPECIAL_TOKENS)

    @property
    def size(self) -> int:
        """Total number of ids (the LM's vocabulary size)."""
        return (
            self.text_size + self.vision_size
            if self.is_lwm
            else self.vq_offset + self.codebook_size
        )

    @property
    def video_end(self) -> int:
        """The last id of a video in a prompt, where the part worth caching ends: </vision>, or
        <eov> in the lwm layout (whose </vision> is text)."""
        return self.eov if self.is_lwm else self.text_size + 1

    @property
    def answer_limit(self) -> int | None:
        """Answers are sampled from the ids below this one; None: from the whole vocabulary. LWM
        samples its answers from its text head alone, so in the lwm layout this is text_size."""
        return self.text_size if self.is_lwm else None

    def codes_to_ids(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.long() + self.vq_offset
