"""LongVideoProcessor: (video, question) -> input_ids for `AutoModelForCausalLM.generate`, and back
(docs/lwm.md shows its use). The prompt is the template the model was trained with
(longvideo.data.templates; LWM's vision-chat prompt for an imported LWM model), with positions
0..L-1 and one segment: the model needs no custom code. An export's processor_config.json names
it for `AutoProcessor.from_pretrained(path, trust_remote_code=True)`, through the two-line
processing_longvideo.py written beside it (which imports this class: the longvideo package must be
installed); `LongVideoProcessor.from_pretrained(path)` is the same without remote code.
`chat_template` is the text side's prompt as a Jinja template for the tokenizer.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from longvideo.atomic import write_text_atomic
from longvideo.config import Config
from longvideo.data.codes import video_to_codes
from longvideo.data.templates import PromptOptions, build_prompt, parse_answer
from longvideo.export.guidance import HFGeneratedVideo, generate_video_hf
from longvideo.tokenizer import TextTokenizer
from longvideo.vq import VQModel, load_vq

PROCESSOR_CONFIG = "processor_config.json"
PROCESSOR_MODULE = "processing_longvideo"  # the file AutoProcessor's auto_map names
_PROCESSOR_CODE = f'''"""The processor of an exported longvideo model, for
AutoProcessor.from_pretrained(path, trust_remote_code=True). It is longvideo's LongVideoProcessor
(pip install longvideo): it VQ-encodes videos and lays out the prompt the model was trained with."""

from {__name__} import LongVideoProcessor  # noqa: F401
'''
# the text side of the QA template (longvideo.data.templates.qa_parts) for apply_chat_template:
# BOS, then per user turn "Question: ...\nAnswer:", per assistant turn " ..." and EOS
QA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ 'Question: ' + message['content'] | trim + '\\nAnswer:' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] | trim + eos_token }}"
    "{% else %}"
    "{{ raise_exception('the QA template has user and assistant turns only, not '"
    " + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
)


def chat_template(settings: ProcessorSettings) -> str | None:
    """The tokenizer's chat template for a model's text side: the QA template's; None for LWM's
    prompt, whose pieces are tokenized one by one (LWM's BOS tokens and SentencePiece word-boundary
    markers), which no template string reproduces: use LongVideoProcessor there."""
    return QA_CHAT_TEMPLATE if settings.prompt_template == "qa" else None


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
    vision_vocab_size: int | None = None
    """lwm layout only: ids of LWM's vision vocabulary."""

    @classmethod
    def from_config(cls, cfg: Config) -> ProcessorSettings:
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


# what AutoProcessor.from_pretrained passes on to a processor class, besides the path
_HUB_KEYWORDS = {
    "trust_remote_code",
    "cache_dir",
    "force_download",
    "local_files_only",
    "proxies",
    "revision",
    "subfolder",
    "token",
    "code_revision",
    "_from_auto",
}


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
    def from_pretrained(cls, path: str | Path, **kwargs) -> LongVideoProcessor:
        """The processor of an exported directory (local). Accepts, and ignores, the keywords
        AutoProcessor passes on (trust_remote_code, cache and hub options); others raise."""
        unknown = sorted(set(kwargs) - _HUB_KEYWORDS)
        if unknown:
            raise TypeError(f"LongVideoProcessor.from_pretrained: unexpected keywords {unknown}")
        path = Path(path)
        cfg_file = path / PROCESSOR_CONFIG
        if not cfg_file.is_file():
            raise FileNotFoundError(f"no {PROCESSOR_CONFIG} in {path}")
        raw = json.loads(cfg_file.read_text())
        known = set(ProcessorSettings.__dataclass_fields__)
        unknown = sorted(set(raw) - known - {"processor_class", "auto_map"})
        if unknown:
            raise ValueError(f"{cfg_file}: unknown keys {unknown}; allowed: {sorted(known)}")
        settings = ProcessorSettings(**{k: v for k, v in raw.items() if k in known})
        return cls(
            TextTokenizer.from_dir(path, settings.vocab_layout), load_vq(path / "vq"), settings
        )

    @classmethod
    def register_for_auto_class(cls, auto_class: str = "AutoProcessor") -> None:
        """Called by AutoProcessor on a class it loaded as remote code; nothing to register."""

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = {
            "processor_class": "LongVideoProcessor",
            "auto_map": {"AutoProcessor": f"{PROCESSOR_MODULE}.LongVideoProcessor"},
            **asdict(self.settings),
        }
        write_text_atomic(path / f"{PROCESSOR_MODULE}.py", _PROCESSOR_CODE)
        self.tokenizer.save(path)
        self.vq.save(path / "vq")
        write_text_atomic(path / PROCESSOR_CONFIG, json.dumps(cfg, indent=2))  # last

    def encode_video(self, video, fps: float | None = None, max_frames: int | None = None):
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
                f"the video is partly unreadable ({vc.report.describe()}); encoding what was read",
                stacklevel=2,
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
        fps: float | None = None,
        max_frames: int | None = None,
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
