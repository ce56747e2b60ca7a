"""Text tokenizer: vision tokens are single special ids right after the text ids; BOS once."""

import pytest

from longvideo.tokenizer import TextTokenizer, train_text_tokenizer
from longvideo.vocab import SPECIAL_TOKENS

TEXTS = [
    "a red circle moves to the left",
    "What colour was the flash frame? blue",
    "the green square bounces",
    "zwölf Äpfel, naïve café 🎬",
] * 5


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    return train_text_tokenizer(TEXTS, vocab_size=300, out_dir=d), d


def test_special_tokens_are_single_ids(tok):
    t, _ = tok
    v = t.vocab(codebook_size=64)
    for name, expected in zip(SPECIAL_TOKENS, (v.vision_start, v.vision_end, v.eof, v.eov)):
        assert t.encode(name) == [expected]
    assert t.encode("x<vision>y</vision>")[1:].count(v.vision_start) == 1
    assert v.vq_offset == len(t) and v.size == len(t) + 64


def test_round_trip_and_never_bos(tok):
    t, d = tok
    for s in TEXTS[:4] + ["", "  spaces  and\nnewlines\t"]:
        assert t.decode(t.encode(s)) == s
    ids = t.encode("hi <vision><eof><eov></vision> bye")
    assert t.bos_id is not None and t.bos_id not in ids and len(ids) > 4
    again = TextTokenizer.from_dir(d)
    assert again.text_size == t.text_size and again.encode("red <eof>") == t.encode("red <eof>")


def test_foreign_tokenizer_gets_the_tokens_appended(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    t = TextTokenizer(hf)
    assert t.text_size == 5 and t.encode("hello <eov>") == [3, 8]


def test_missing_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        TextTokenizer.from_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        TextTokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("model_type", ["longvideo_llama", "llama"])
def test_a_checkpoint_directory_loads_its_tokenizer_without_a_warning(tmp_path, tok, model_type):
    import json

    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging as hf_logging

    t, _ = tok
    t.save(tmp_path)  # beside the model's config.json, as an export writes it
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with CaptureLogger(hf_logging.get_logger("transformers")) as cap:
        again = TextTokenizer.from_dir(tmp_path)
    assert "model of type" not in cap.out
    for s in TEXTS[:4]:
        assert again.encode(s + " <eof>") == t.encode(s + " <eof>")
