"""The text tokenizer: any local Hugging Face tokenizer (`TextTokenizer.from_dir`) or an offline
byte-level BPE (`train_text_tokenizer`), plus the four vision special tokens, which follow the text
ids as special tokens (docs/vocabulary.md); `encode` never adds BOS (the sequence builder does). The
lwm layout adds nothing and encodes as LWM's SentencePiece tokenizer did (docs/lwm.md).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

from longvideo.atomic import atomic_dir
from longvideo.vocab import LAYOUTS, SPECIAL_TOKENS, Vocab


class TokenizerError(ValueError):
    """A tokenizer that cannot carry the vocabulary layout, or a token it does not have."""


SP_SPACE = "\u2581"
"""SentencePiece's word-boundary marker, which stands for a space."""


def _sentencepiece_model(hf):
    """The model of a SentencePiece-style (LLaMA) tokenizer backend, else None: one that marks word
    boundaries with "▁" (a Metaspace pre-tokenizer, or a normalizer that prepends "▁")."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return None
    if "Metaspace(" in repr(backend.pre_tokenizer) or f'Prepend(prepend="{SP_SPACE}")' in repr(
        backend.normalizer
    ):
        return backend.model
    return None


def _config_kwargs(path: Path) -> dict:
    """{"config": an empty config} when the directory's config.json names a model type transformers
    does not know (an export's `longvideo_llama`): the tokenizer needs no model config, and loading
    that one would only warn that it is of another type."""
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return {}
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        return {"config": PretrainedConfig()}
    return {}


class TextTokenizer:
    def __init__(self, hf_tokenizer, layout: str = "longvideo"):
        from tokenizers import AddedToken

        self.hf = hf_tokenizer
        if layout not in LAYOUTS:
            raise TokenizerError(f"unknown vocabulary layout {layout!r}; expected one of {LAYOUTS}")
        self.layout = layout
        if layout == "lwm":
            self._init_lwm()
            return
        missing = [t for t in SPECIAL_TOKENS if t not in self.hf.get_vocab()]
        if missing and len(missing) != len(SPECIAL_TOKENS):
            raise TokenizerError(f"tokenizer has only some of the vision tokens; missing {missing}")
        if missing:
            self.hf.add_tokens(
                [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
                special_tokens=True,
            )
        ids = [self.hf.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
        self.text_size = ids[0]
        if ids != list(range(self.text_size, self.text_size + len(SPECIAL_TOKENS))):
            raise TokenizerError(
                f"vision tokens must have consecutive ids, got {dict(zip(SPECIAL_TOKENS, ids))}"
            )
        if len(self.hf) != self.text_size + len(SPECIAL_TOKENS):
            raise TokenizerError(
                f"the vision tokens must be the last ids of the tokenizer "
                f"(len {len(self.hf)}, <vision> at {self.text_size})"
            )
        for t in SPECIAL_TOKENS:  # each must survive encoding as exactly one id
            enc = self.hf.encode(t, add_special_tokens=False)
            if enc != [self.hf.convert_tokens_to_ids(t)]:
                raise TokenizerError(f"{t} encodes to {enc}, expected one id")

    def _init_lwm(self) -> None:
        """LWM's text tokenizer: its own ids only; the vision vocabulary follows them in the model."""
        present = [t for t in SPECIAL_TOKENS if t in self.hf.get_vocab()]
        if present:
            raise TokenizerError(
                f"an lwm-layout tokenizer has no vision tokens of its own (they are text or "
                f"vision ids), but this one has {present}"
            )
        self.text_size = len(self.hf)
        self._sp_model = _sentencepiece_model(self.hf)

    @classmethod
    def from_dir(cls, path: str | Path, layout: str = "longvideo") -> TextTokenizer:
        """Load a local tokenizer directory: tokenizer.json, or only a LLaMA `tokenizer.model` (as LWM's
        releases ship it; converting it needs the `sentencepiece` package)."""
        from transformers import AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {path}")
        if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
            raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {path}")
        if any(
            (path / f).is_file() for f in ("tokenizer_config.json", "tokenizer.json", "config.json")
        ):
            # the tokenizer never needs a directory's model code (an export with attn_logn_base has
            # some): without this transformers would stop and ask whether to run it
            hf = AutoTokenizer.from_pretrained(
                str(path),
                local_files_only=True,
                use_fast=True,
                trust_remote_code=False,
                **_config_kwargs(path),
            )
        else:
            from transformers import LlamaTokenizer

            try:
                hf = LlamaTokenizer.from_pretrained(str(path), local_files_only=True)
            except ImportError as e:
                raise TokenizerError(
                    f"{path} holds only a SentencePiece tokenizer.model; reading it needs the "
                    f"sentencepiece package (pip install sentencepiece): {e}"
                ) from None
        return cls(hf, layout)

    def save(self, path: str | Path) -> None:
        """transformers' files into `path`, moved in one rename each with tokenizer.json last
        (longvideo.atomic.atomic_dir): a tokenizer.json is never beside a partial save. A chat
        template goes into tokenizer_config.json, where every transformers reads it."""
        with atomic_dir(path, marker="tokenizer.json") as tmp:
            self.hf.save_pretrained(str(tmp), save_jinja_files=False)

    @property
    def bos_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def pad_id(self) -> int:
        pid = self.hf.pad_token_id
        return pid if pid is not None else (self.eos_id or 0)

    def vocab(self, codebook_size: int, vision_size: int | None = None) -> Vocab:
        """The unified vocabulary of this tokenizer's layout (vision_size: lwm layout only)."""
        return Vocab(
            text_size=self.text_size,
            codebook_size=codebook_size,
            layout=self.layout,
            vision_size=vision_size,
        )

    def encode(self, text: str) -> list[int]:
        """The text's ids, never with BOS (the sequence builder adds it)."""
        sp = getattr(self, "_sp_model", None)
        # lwm layout: SentencePiece's encoding, a word-boundary marker in front even of a leading space
        # (transformers 5's Metaspace pre-tokenizer skips it there; LWM's tokenizer did not)
        if sp is not None:
            return (
                [t.id for t in sp.tokenize(SP_SPACE + text.replace(" ", SP_SPACE))] if text else []
            )
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        known = self.text_size + (0 if self.layout == "lwm" else len(SPECIAL_TOKENS))
        ids = [int(i) for i in ids if int(i) < known]  # drop VQ codes (and LWM's vision ids)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return len(self.hf)


def train_text_tokenizer(
    texts: Iterable[str], vocab_size: int = 1024, out_dir: str | Path | None = None
) -> TextTokenizer:
    """Train a byte-level BPE on `texts` (offline); round trips any string exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    base_specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=base_specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )
    out = TextTokenizer(hf)
    if out_dir is not None:
        out.save(out_dir)
    return out


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="longvideo train-tokenizer",
        description="Train a byte-level BPE text tokenizer on local text files.",
    )
    p.add_argument("--texts", nargs="+", required=True, help="text files, one document per line")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--out", required=True, help="output tokenizer directory")
    a = p.parse_args(argv)
    lines = [ln for f in a.texts for ln in Path(f).read_text().splitlines() if ln.strip()]
    if not lines:
        raise SystemExit("longvideo train-tokenizer: the text files are empty")
    tok = train_text_tokenizer(lines, a.vocab_size, a.out)
    print(f"wrote {a.out}: {tok.text_size} text ids + {len(SPECIAL_TOKENS)} vision tokens")
    return 0
