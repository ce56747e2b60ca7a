"""Which token ids belong to the vision modality; only tests ask (the library lays ids out, it
never classifies them)."""

import torch

from longvideo.vocab import Vocab


def is_vision(vocab: Vocab, ids: torch.Tensor) -> torch.Tensor:
    """Codes, <eof> and <eov> (in the lwm layout, every id of the vision vocabulary: what LWM's
    vision mask marks)."""
    if vocab.is_lwm:
        return (ids >= vocab.text_size) & (ids < vocab.size)
    codes = (ids >= vocab.vq_offset) & (ids < vocab.vq_offset + vocab.codebook_size)
    return codes | (ids == vocab.eof) | (ids == vocab.eov)
