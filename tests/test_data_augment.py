"""Needle recolouring (data.needle_recolour): the flash's codes and its answer change together, and
nothing else does."""

import re

import numpy as np
import pytest

from longvideo.config import ConfigError, load_config
from longvideo.data.augment import flash_code_table, flash_group, recolour_needle
from longvideo.data.config import DataConfig
from longvideo.data.loader import TokenLoader
from longvideo.data.shards import ShardWriter, SkipStats, iter_token_samples, token_sample_members
from longvideo.data.synthetic import SyntheticSpec, make_sample, text_corpus
from longvideo.tokenizer import train_text_tokenizer

K = 16
SPEC = SyntheticSpec(fps=1, min_seconds=4, max_seconds=12, long_fraction=0.0, needle_fraction=1.0)
FLASH = {  # each colour's flash group: codes no background frame holds (backgrounds use 0-11)
    "red": [[12, 13], [12, 12]],
    "green": [[13, 12], [13, 13]],
    "blue": [[14, 15], [14, 14]],
    "yellow": [[15, 14], [15, 15]],
}
NEEDLE_Q = "What colour was the flash frame?"


def _codes(sample, odd: bool = False) -> np.ndarray:
    index = int(sample.key.split("_")[1])
    codes = np.random.default_rng(index).integers(0, 12, (sample.duration, 2, 2))
    second, colour = sample.needle
    codes[second] = FLASH[colour]
    if odd:  # a flash coded otherwise once: the table keeps each colour's most frequent codes
        codes[second, 0, 0] = 11
    return codes


@pytest.fixture(scope="module")
def tok():
    return train_text_tokenizer(text_corpus(60, spec=SPEC), vocab_size=300)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """3 token shards of 8 one-flash samples; one sample's flash coded differently."""
    root = tmp_path_factory.mktemp("recolour")
    for s in range(3):
        with ShardWriter(root / f"part-{s:03d}.tar") as w:
            for i in range(s * 8, s * 8 + 8):
                sample = make_sample(5, i, SPEC)
                ts = np.arange(float(sample.duration))
                w.write(
                    sample.key,
                    token_sample_members(sample.key, _codes(sample, odd=i == 3), ts, sample.meta),
                )
    return root


def _samples(root):
    return [x for p in sorted(root.glob("*.tar")) for x in iter_token_samples(str(p), SkipStats())]


def test_flash_group_reads_group_start_times():
    assert flash_group(np.arange(10.0), 0.0) == 0
    assert flash_group(np.arange(10.0), 7.0) == 7
    assert flash_group(np.array([0.0, 0.5, 1.0, 1.5]), 1.2) == 2  # groups of half a second
    assert flash_group(np.array([0.0, 0.125, 0.625]), 0.5) == 1  # a causal first group of 1 frame


def test_table_holds_each_colours_most_frequent_flash_codes(shards):
    samples = _samples(shards)
    assert {x.meta["needle"]["colour"] for x in samples} == set(FLASH)
    table = flash_code_table(samples)
    assert {c: v.tolist() for c, v in table.items()} == FLASH


def test_recolour_changes_the_flash_group_and_its_answer_only(shards):
    samples = _samples(shards)
    table = flash_code_table(samples)
    rng = np.random.default_rng(0)
    drawn = []
    for x in samples * 4:
        codes, meta = recolour_needle(x.codes, x.timestamps, x.meta, table, rng)
        colour = meta["needle"]["colour"]
        drawn.append(colour)
        second = int(x.meta["needle"]["start"])
        assert codes[second].tolist() == FLASH[colour]
        rest = np.ones(len(codes), bool)
        rest[second] = False
        np.testing.assert_array_equal(codes[rest], x.codes[rest])
        for new, old in zip(meta["qa"], x.meta["qa"]):
            assert new["question"] == old["question"] and new["type"] == old["type"]
            assert new["answer"] == (colour if old["type"] == "needle" else old["answer"])
        assert x.meta["needle"]["colour"] == x.meta["qa"][0]["answer"]  # the input is not changed
    counts = {c: drawn.count(c) for c in FLASH}
    assert min(counts.values()) >= len(drawn) // 8, counts  # every colour, about as often


def test_samples_without_exactly_one_flash_come_back_unchanged():
    spec = SyntheticSpec(
        fps=1,
        min_seconds=30,
        max_seconds=40,
        needle_fraction=1.0,
        max_flashes=3,
        questions=("needle", "count", "order", "between"),
    )
    table = {c: np.asarray(v) for c, v in FLASH.items()}
    rng = np.random.default_rng(0)
    seen = set()
    for i in range(12):
        meta = make_sample(2, i, spec).meta
        codes = np.zeros((40, 2, 2), np.int64)
        out_codes, out_meta = recolour_needle(codes, np.arange(40.0), meta, table, rng)
        flashes = len(meta.get("events", [])) or 1
        seen.add(flashes)
        if flashes > 1:  # count, order and between name the colours: left alone
            assert out_codes is codes and out_meta is meta
        else:
            assert out_meta["qa"][0]["answer"] == out_meta["needle"]["colour"]
    assert seen >= {1, 2, 3}
    plain = {
        "qa": [{"question": "What shape came first?", "answer": "circle", "type": "first_shape"}]
    }
    assert recolour_needle(codes, np.arange(40.0), plain, table, rng)[1] is plain


def _docs(loader, epoch):
    """(key, answer to the needle question, the flash codes laid out) of every sample's doc."""
    out = []
    off = loader.vocab.vq_offset
    for s in range(len(loader.paths)):
        for i in range(loader._len(s)):
            (doc,) = loader._sample_docs(s, i, epoch, count=False)
            text = loader.tokenizer.decode(
                [t for t in doc.ids.tolist() if t < loader.tokenizer.text_size]
            )
            answer = re.search(
                re.escape(NEEDLE_Q) + r"\nAnswer: (red|green|blue|yellow)", text
            ).group(1)
            codes = np.array([t - off for t in doc.ids.tolist() if off <= t < off + K])
            flash = [g.tolist() for g in codes.reshape(-1, 2, 2) if g.min() >= 12]
            out.append(
                (doc.key, answer, flash, text.replace(f"{NEEDLE_Q}\nAnswer: {answer}", NEEDLE_Q))
            )
    return out


def test_loader_lays_out_recoloured_flashes_with_their_answers(shards, tok):
    def loader(p):
        cfg = DataConfig(seq_len=512, shuffle_buffer=4, needle_recolour=p, template_mode="first")
        return TokenLoader(str(shards), tok, tok.vocab(K), cfg, batch_size=1)

    plain, recoloured = loader(0.0), loader(1.0)
    assert plain.flash_codes == {} and set(recoloured.flash_codes) == set(FLASH)
    truth = {x.key: x.meta["needle"]["colour"] for x in _samples(shards)}
    changed, by_key = 0, {}
    for epoch in range(3):
        for (key, a0, f0, t0), (key1, a1, f1, t1) in zip(
            _docs(plain, epoch), _docs(recoloured, epoch)
        ):
            assert key == key1
            assert a0 == truth[key] and (key == "0005_00000003" or f0 == [FLASH[a0]])
            assert f1 == [FLASH[a1]]  # the flash laid out is the colour answered
            assert t0 == t1  # everything else (template, question order, other answers) as without
            changed += a1 != a0
            by_key.setdefault(key, set()).add(a1)
    n = 3 * len(truth)
    assert n // 2 < changed < n  # a colour drawn afresh: about three in four change
    assert max(len(v) for v in by_key.values()) >= 2  # one video, several answers over epochs
    again = _docs(loader(1.0), 2)
    assert again == _docs(recoloured, 2)  # the draw is a function of (seed, epoch, key)


def test_needle_recolour_is_checked():
    assert load_config("tiny", ["data.needle_recolour=0.5"]).data.needle_recolour == 0.5
    with pytest.raises(ConfigError, match="data.needle_recolour"):
        load_config("tiny", ["data.needle_recolour=1.5"])
