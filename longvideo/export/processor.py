"""LongVideoProcessor: (video, question) -> input_ids for `AutoModelForCausalLM.generate`, and back
(docs/lwm.md shows its use). The prompt is the template the model was trained with
(longvideo.data.templates; LWM's vision-chat prompt for an imported LWM model), with positions
0..L-1 and one segment: no custom code is needed.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from longvideo.config import Config
from longvideo.data.codes import video_to_codes
from longvideo.data.templates import PromptOptions, build_prompt, parse_answer
from longvideo.export.guidance import HFGeneratedVideo, generate_video_hf
from longvideo.tokenizer import TextTokenizer
from longvideo.vq import VQModel, load_vq

PROCESSOR_CONFIG = "processor_config.json"


@dataclass(frozen=True)
class ProcessorSettings:
    fps: float = 1.0
    """Frames per second sampled from the video."""
    max_frames: int = 3600
    """Most frames read (uniform sampling when the cap binds)."""
    max_resolution: int = 4096
    """Longest frame side accepted from a video file."""
    timestamp_every: int = 0
    """Timestamp text before every k-th frame (0 = none), as in training."""
    question_first: bool = False
    """Question before the video instead of after it."""
    batch_frames: int = 16
    """Frames VQ-encoded at once (bounds memory on long videos)."""
    prompt_template: str = "qa"
    """qa: the QA training template; lwm: LWM's vision-chat prompt."""
    vocab_layout: str = "longvideo"
    """The model's token space (longvideo.vocab): longvideo, or lwm for imported LWM models."""
    vision_vocab_size: Optional[int] = None
    """lwm layout only: ids of LWM's vision vocabulary."""

    @classmethod
    def from_config(cls, cfg: Config) -> "ProcessorSettings":
        """What a model trained with `cfg` expects (its data section, its vocabulary)."""
        d = cfg.data
        prompt = PromptOptions.from_config(d)
        return cls(
            fps=d.fps,
            max_frames=d.max_frames,
            max_resolution=d.max_resolution,
            timestamp_every=prompt.timestamp_every,
            question_first=prompt.question_first,
            batch_frames=cfg.infer.encode_batch_frames,
            prompt_template=prompt.template,
            vocab_layout=cfg.model.vocab_layout,
            vision_vocab_size=cfg.model.vision_vocab_size,
        )

    @property
    def prompt(self) -> PromptOptions:
        return PromptOptions(
            timestamp_every=self.timestamp_every,
            question_first=self.question_first,
            template=self.prompt_template,
        )


class LongVideoProcessor:
    def __init__(
        self,
        tokenizer: TextTokenizer,
        vq: VQModel,
        settings: ProcessorSettings = ProcessorSettings(),
    ):
        self.tokenizer, self.vq, self.settings = tokenizer, vq, settings
        if tokenizer.layout != settings.vocab_layout:
            raise ValueError(
                f"the tokenizer is of the {tokenizer.layout} layout, the settings say "
                f"{settings.vocab_layout}"
            )
        self.vocab = tokenizer.vocab(vq.cfg.codebook_size, settings.vision_vocab_size)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "LongVideoProcessor":
        path = Path(path)
        cfg_file = path / PROCESSOR_CONFIG
        if not cfg_file.is_file():
            raise FileNotFoundError(f"no {PROCESSOR_CONFIG} in {path}")
        raw = json.loads(cfg_file.read_text())
        known = set(ProcessorSettings.__dataclass_fields__)
        unknown = sorted(set(raw) - known - {"processor_class"})
        if unknown:
            raise ValueError(f"{cfg_file}: unknown keys {unknown}; allowed: {sorted(known)}")
        settings = ProcessorSettings(**{k: v for k, v in raw.items() if k in known})
        return cls(
            TextTokenizer.from_dir(path, settings.vocab_layout), load_vq(path / "vq"), settings
        )

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = {"processor_class": "LongVideoProcessor", **asdict(self.settings)}
        (path / PROCESSOR_CONFIG).write_text(json.dumps(cfg, indent=2))
        self.tokenizer.save(path)
        self.vq.save(path / "vq")

    def encode_video(self, video, fps: Optional[float] = None, max_frames: Optional[int] = None):
        """codes (G, h, w) and per-group timestamps (G,) of a video path or bytes."""
        s = self.settings
        vc = video_to_codes(
            self.vq,
            video,
            fps=fps or s.fps,
            max_frames=max_frames or s.max_frames,
            max_resolution=s.max_resolution,
            batch_frames=s.batch_frames,
        )
        if vc.report.describe():
            warnings.warn(
                f"the video is partly unreadable ({vc.report.describe()}); encoding what was read"
            )
        return vc.codes, vc.timestamps

    def prompt_ids(self, codes, timestamps, question: str) -> list[int]:
        return build_prompt(
            self.tokenizer, self.vocab, codes, timestamps, question, self.settings.prompt
        ).ids

    def __call__(
        self,
        video,
        question: str,
        fps: Optional[float] = None,
        max_frames: Optional[int] = None,
        return_tensors: str = "pt",
    ) -> dict:
        if isinstance(video, (str, Path)) and not Path(video).is_file():
            raise FileNotFoundError(f"video not found: {video}")
        codes, stamps = self.encode_video(video, fps, max_frames)
        ids = self.prompt_ids(codes, stamps, question)
        if return_tensors != "pt":
            return {"input_ids": [ids], "attention_mask": [[1] * len(ids)]}
        t = torch.tensor([ids], dtype=torch.long)
        return {"input_ids": t, "attention_mask": torch.ones_like(t)}

    def decode(self, ids, prompt_length: int = 0) -> str:
        """The answer text of generated ids (after the prompt, up to EOS): for the QA template its
        first line (parse_answer); for LWM's prompt all of it, as `longvideo chat` prints it."""
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)][prompt_length:]
        if self.tokenizer.eos_id in ids:
            ids = ids[: ids.index(self.tokenizer.eos_id)]
        text = self.tokenizer.decode(ids)
        return text.strip() if self.settings.prompt_template == "lwm" else parse_answer(text)

    def generate_video(self, model, prompt: str, **settings) -> HFGeneratedVideo:
        """Text to video through `model.generate` (an AutoModelForCausalLM of this directory) with
        the prompts, slots and classifier-free guidance of `longvideo generate`; settings as
        longvideo.export.guidance.generate_video_hf takes them (docs/generation.md)."""
        return generate_video_hf(model, self, prompt, **settings)
