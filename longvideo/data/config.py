"""DataConfig: where shards are and how samples become token sequences."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from longvideo.configtools import check

TEMPLATES: tuple[str, ...] = ("qa", "segments", "caption")
QUESTION_NAMES: tuple[str, ...] = (
    "needle",
    "first_shape",
    "first_colour",
    "last_shape",
    "last_colour",
    "count",
    "order",
    "between",
)
"""The question types `qa_types` may name: those of longvideo/data/questions.py (a test checks they
agree; this module stays below it)."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train_shards: str = ""
    """Token shards for training: a directory, a glob, a brace pattern, or URLs (http(s)://, pipe:; streamed)."""
    seq_len: int = 4096
    """Tokens per packed training sequence (the context length of the stage)."""
    fps: float = 1.0
    """Frames per second sampled from videos."""
    max_frames: int = 3600
    """Most frames taken from one video (uniform sampling when the cap binds)."""
    max_resolution: int = 4096
    """Longest frame side accepted when decoding (larger videos are skipped as unsupported)."""
    video_backend: Literal["auto", "decord", "pyav"] = "auto"
    """Video decoder: auto = pyav (in this process); decord runs in a child process (a crash skips the video)."""
    partial_videos: Literal["keep", "skip"] = "keep"
    """Videos cut short or with frames lost to damage: keep what was read (when at least min_partial_fraction), or skip."""
    min_partial_fraction: float = 0.5
    """Least share of a partial video's declared duration that must have been read for it to be kept."""
    text_loss_weight: float = 0.5
    """Loss weight of text tokens (LWM: 0.5)."""
    vision_loss_weight: float = 0.5
    """Loss weight of vision tokens (LWM: 0.5)."""
    qa_vision_loss: bool = True
    """Whether the video of a QA sample carries vision loss (else it is prompt only)."""
    timestamp_every: int = 0
    """Write the time as text ('[12.0s]') before every k-th frame group (0 = never)."""
    templates: tuple[str, ...] = TEMPLATES
    """Templates to use, in order of preference: qa, segments, caption."""
    template_mode: Literal["first", "random", "all"] = "first"
    """Per sample: the first available template, a random one, or one document per template."""
    question_position: Literal["after", "before", "random"] = "after"
    """QA: the first question after the video, before it, or either at random."""
    caption_position: Literal["after", "before", "random"] = "after"
    """Caption: after the video (captioning), before it (text to video), or either at random."""
    qa_order: Literal["shuffle", "given"] = "shuffle"
    """QA pairs of a sample in a new random order per epoch, or in the order the json gives them."""
    qa_types: tuple[str, ...] = ()
    """QA: only the pairs of these question types (longvideo/data/questions.py; a pair without a
    type is dropped); a sample left with none has no qa template. Empty: every pair."""
    needle_recolour: float = 0.0
    """Share of one-flash samples whose flash gets a colour drawn afresh each epoch: that colour's
    flash codes (the most frequent in these shards) over its group and in the needle answer, so the
    answer cannot be learnt from which video it is (docs/data.md, "Needle recolouring"). 0: never."""
    prompt_template: Literal["qa", "lwm"] = "qa"
    """Inference prompt: the QA template above, or LWM's vision-chat prompt (imported LWM models)."""
    loss_norm: Literal["token", "sample"] = "token"
    """token: every weighted token counts alike; sample: each document's weights sum to 1."""
    shuffle_buffer: int = 256
    """Samples held in the loader's shuffle buffer."""
    pack_bins: int = 4
    """Partly filled sequences the packer keeps open (first fit)."""
    seed: int = 0
    """Shuffle seed."""

    def __post_init__(self):
        check(self.seq_len > 0, "seq_len", "must be positive")
        check(self.fps > 0, "fps", "must be positive")
        check(self.max_frames > 0, "max_frames", "must be positive")
        check(self.max_resolution > 0, "max_resolution", "must be positive")
        check(0.0 <= self.min_partial_fraction <= 1.0, "min_partial_fraction", "must be in [0, 1]")
        check(self.text_loss_weight >= 0, "text_loss_weight", "must be >= 0")
        check(self.vision_loss_weight >= 0, "vision_loss_weight", "must be >= 0")
        check(self.timestamp_every >= 0, "timestamp_every", "must be >= 0")
        check(
            len(self.templates) > 0 and all(t in TEMPLATES for t in self.templates),
            "templates",
            f"must be a non-empty list of {', '.join(TEMPLATES)}; got {list(self.templates)}",
        )
        unknown = [t for t in self.qa_types if t not in QUESTION_NAMES]
        check(
            not unknown,
            "qa_types",
            f"unknown question types {unknown}; expected some of {list(QUESTION_NAMES)}",
        )
        check(0.0 <= self.needle_recolour <= 1.0, "needle_recolour", "must be in [0, 1]")
        check(self.shuffle_buffer >= 1, "shuffle_buffer", "must be >= 1")
        check(self.pack_bins >= 1, "pack_bins", "must be >= 1")
