"""Sequence layout: single-id special tokens, template structure, loss weights, frame dropping, prompts."""

import numpy as np
import pytest
from vision_ids import is_vision

from longvideo.data.synthetic import make_sample, text_corpus
from longvideo.data.templates import (
    LayoutOptions,
    PromptOptions,
    build_docs,
    build_prompt,
    layout_doc,
    parse_answer,
    sample_rng,
    uniform_keep,
)
from longvideo.tokenizer import train_text_tokenizer
from longvideo.vocab import SPECIAL_TOKENS

H = W = 2
K = 32  # codebook


@pytest.fixture(scope="module")
def tok():
    return train_text_tokenizer(text_corpus(60), vocab_size=320)


@pytest.fixture(scope="module")
def vocab(tok):
    return tok.vocab(K)


def _codes(g, seed=0):
    return np.random.default_rng(seed).integers(0, K, (g, H, W))


def test_special_tokens_are_single_ids(tok, vocab):
    for name, want in zip(
        SPECIAL_TOKENS, (vocab.vision_start, vocab.vision_end, vocab.eof, vocab.eov)
    ):
        assert tok.encode(name) == [want]
        assert tok.encode(f"a {name} b").count(want) == 1
    # a laid-out video uses exactly those ids, with codes above the text range
    meta = {"caption": "a red circle."}
    doc = layout_doc(
        tok, vocab, _codes(3), np.arange(3.0), meta, "caption", False, LayoutOptions(), 10_000
    )
    ids = doc.ids.tolist()
    assert ids.count(vocab.vision_start) == ids.count(vocab.vision_end) == 1
    assert ids.count(vocab.eof) == 2 and ids.count(vocab.eov) == 1
    assert sum(vocab.vq_offset <= i < vocab.size for i in ids) == 3 * H * W


def _spans(doc, vocab):
    """Token ids split into (kind, ids, weights) runs: text / vision."""
    ids, w = doc.ids, doc.weights
    vis = ids >= vocab.vision_start
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or vis[i] != vis[start]:
            out.append(
                ("vision" if vis[start] else "text", ids[start:i].tolist(), w[start:i].tolist())
            )
            start = i
    return out


def test_caption_layout_and_weights(tok, vocab):
    codes, ts = _codes(2), np.array([0.0, 1.0])
    opts = LayoutOptions(text_loss_weight=0.3, vision_loss_weight=0.7)
    doc = layout_doc(
        tok, vocab, codes, ts, {"caption": "a red circle."}, "caption", False, opts, 10_000
    )
    c = (codes.reshape(2, -1) + vocab.vq_offset).tolist()
    caption = tok.encode("a red circle.")
    want = [
        tok.bos_id,
        vocab.vision_start,
        *c[0],
        vocab.eof,
        *c[1],
        vocab.eov,
        vocab.vision_end,
        *caption,
        tok.eos_id,
    ]
    assert doc.ids.tolist() == want
    want_w = [0.0] + [0.7] * (2 * H * W + 4) + [0.3] * (len(caption) + 1)
    np.testing.assert_allclose(doc.weights, want_w, rtol=0, atol=1e-7)
    # text first (text to video): the caption comes before <vision>
    doc2 = layout_doc(
        tok, vocab, codes, ts, {"caption": "a red circle."}, "caption", True, opts, 10_000
    )
    assert doc2.ids.tolist()[1 : 1 + len(caption)] == caption


def test_qa_layout_no_loss_on_prompt(tok, vocab):
    meta = {
        "qa": [
            {"question": "What colour was the flash frame?", "answer": "red"},
            {"question": "What shape came first?", "answer": "circle"},
        ]
    }
    codes, ts = _codes(3), np.arange(3.0)
    for question_first in (False, True):
        for qa_vision_loss in (True, False):
            opts = LayoutOptions(
                qa_vision_loss=qa_vision_loss, text_loss_weight=0.5, vision_loss_weight=0.25
            )
            doc = layout_doc(tok, vocab, codes, ts, meta, "qa", question_first, opts, 10_000)
            text = tok.decode(doc.ids.tolist(), skip_special_tokens=False)
            if question_first:
                assert text.startswith("<s>Question: What colour was the flash frame?\n<vision>")
                assert (
                    "</vision>Answer: red</s>Question: What shape came first?\nAnswer: circle</s>"
                    in text
                )
            else:
                assert text.startswith("<s><vision>")
                assert text.endswith(
                    "</vision>Question: What colour was the flash frame?\nAnswer: red</s>"
                    "Question: What shape came first?\nAnswer: circle</s>"
                )
            # loss only on the answers (+ their EOS) and, if enabled, on the video
            learnt = [
                i
                for i, w in zip(doc.ids.tolist(), doc.weights.tolist())
                if w > 0
                and not is_vision(vocab, np.array(i))
                and i not in (vocab.vision_start, vocab.vision_end)
            ]
            assert tok.decode(learnt, skip_special_tokens=False) == " red</s> circle</s>"
            vis = np.isin(doc.ids, [vocab.vision_start, vocab.vision_end]) | (doc.ids >= vocab.eof)
            assert np.all(doc.weights[vis] == (0.25 if qa_vision_loss else 0.0))
            assert np.all(doc.weights[~vis & (doc.weights > 0)] == 0.5)


def test_prompt_is_the_training_prefix(tok, vocab):
    meta = {"qa": [{"question": "What colour was the flash frame?", "answer": "blue"}]}
    codes, ts = _codes(4), np.arange(4.0) * 2
    for question_first in (False, True):
        for every in (0, 2):
            opts = LayoutOptions(timestamp_every=every)
            doc = layout_doc(tok, vocab, codes, ts, meta, "qa", question_first, opts, 10_000)
            built = build_prompt(
                tok,
                vocab,
                codes,
                ts,
                "What colour was the flash frame?",
                PromptOptions(question_first=question_first, timestamp_every=every),
            )
            prompt = built.ids
            assert doc.ids.tolist()[: len(prompt)] == prompt
            answer = doc.ids.tolist()[len(prompt) :]
            assert tok.decode(answer) == " blue" and doc.weights[len(prompt)] > 0
            lo, hi = prompt.index(vocab.vision_start), prompt.index(vocab.vision_end)
            assert built.video_end == hi + 1  # the cached prefix ends with </vision>
            outside = np.r_[
                0:lo, hi + 1 : len(prompt)
            ]  # the question and "Answer:" (timestamps are video)
            assert doc.weights[outside].sum() == 0
    assert parse_answer(" blue.\nQuestion: x") == "blue"


def test_timestamps_every_k(tok, vocab):
    codes, ts = _codes(5), np.array([0.0, 1.0, 2.0, 3.0, 4.5])
    opts = LayoutOptions(timestamp_every=2)
    doc = layout_doc(tok, vocab, codes, ts, {"caption": "x"}, "caption", False, opts, 10_000)
    text = tok.decode(doc.ids.tolist(), skip_special_tokens=False)
    assert text.count("[0.0s]") == 1 and text.count("[2.0s]") == 1 and text.count("[4.5s]") == 1
    assert "[1.0s]" not in text and "[3.0s]" not in text
    # a timestamp comes right before its frame's codes
    i = doc.ids.tolist().index(vocab.vision_start)
    assert tok.decode(doc.ids[i + 1 : i + 1 + len(tok.encode("[0.0s]"))].tolist()) == "[0.0s]"


def test_segments_interleave_with_their_frames(tok, vocab):
    meta = {
        "segments": [
            {"start": 0.0, "end": 2.0, "text": "a red circle"},
            {"start": 2.0, "end": 5.0, "text": "a blue square"},
        ]
    }
    codes, ts = _codes(5), np.arange(5.0)
    doc = layout_doc(tok, vocab, codes, ts, meta, "segments", False, LayoutOptions(), 10_000)
    spans = _spans(doc, vocab)
    kinds = [k for k, _, _ in spans]
    assert kinds == ["text", "vision", "text", "vision", "text"]
    assert spans[1][1].count(vocab.eof) + spans[1][1].count(vocab.eov) == 2  # frames at t=0, 1
    assert spans[3][1].count(vocab.eof) + spans[3][1].count(vocab.eov) == 3  # frames at t=2, 3, 4
    assert tok.decode(spans[2][1]) == "a red circle\n"
    assert tok.decode(spans[4][1], skip_special_tokens=False) == "a blue square\n</s>"


def test_long_sample_drops_whole_frames_uniformly(tok, vocab):
    g = 40
    codes, ts = _codes(g), np.arange(float(g))
    meta = {"caption": "a red circle, then a blue square."}
    opts = LayoutOptions()
    full = layout_doc(tok, vocab, codes, ts, meta, "caption", False, opts, 10_000)
    per_frame = H * W + 1
    for max_len in (len(full) - 1, len(full) // 2, len(full) // 5):
        doc = layout_doc(tok, vocab, codes, ts, meta, "caption", False, opts, max_len)
        assert len(doc) <= max_len
        kept = doc.groups_kept
        assert doc.groups_dropped == g - kept > 0
        assert len(full) - len(doc) == (g - kept) * per_frame  # whole frames only
        assert len(doc) + per_frame > max_len  # and no more than needed
        # the kept frames are the uniform choice: compare codes group by group
        ids = doc.ids.tolist()
        body = ids[ids.index(vocab.vision_start) + 1 : ids.index(vocab.vision_end)]
        frames = np.array(body).reshape(kept, per_frame)[:, :-1] - vocab.vq_offset
        np.testing.assert_array_equal(frames, codes.reshape(g, -1)[uniform_keep(g, kept)])
    assert uniform_keep(10, 5) == [0, 2, 5, 7, 9]
    # text alone longer than the limit: no document
    assert (
        layout_doc(tok, vocab, codes, ts, {"caption": "word " * 200}, "caption", False, opts, 50)
        is None
    )


def test_templates_chosen_per_mode(tok, vocab):
    meta = make_sample(0, 1).meta
    codes, ts = _codes(3), np.arange(3.0)
    first, _ = build_docs(
        tok, vocab, codes, ts, meta, LayoutOptions(), 10_000, sample_rng(0, 0, "k")
    )
    assert [d.template for d in first] == ["qa"]
    every, _ = build_docs(
        tok,
        vocab,
        codes,
        ts,
        meta,
        LayoutOptions(template_mode="all"),
        10_000,
        sample_rng(0, 0, "k"),
    )
    assert [d.template for d in every] == ["qa", "segments", "caption"]
    only_caption = {"caption": meta["caption"]}
    docs, _ = build_docs(
        tok, vocab, codes, ts, only_caption, LayoutOptions(), 10_000, sample_rng(0, 0, "k")
    )
    assert [d.template for d in docs] == ["caption"]
    picks = {
        build_docs(
            tok,
            vocab,
            codes,
            ts,
            meta,
            LayoutOptions(template_mode="random"),
            10_000,
            sample_rng(0, e, "k"),
        )[0][0].template
        for e in range(20)
    }
    assert picks == {"qa", "segments", "caption"}


def test_qa_pairs_shuffled_per_epoch_unless_given_order(tok, vocab):
    """Each epoch lays the pairs out in a new order (so no answer can be learnt from its place),
    every pair exactly once with its own answer; qa_order='given' keeps the json's order."""
    meta = {
        "qa": [
            {"question": "What colour was the flash frame?", "answer": "red"},
            {"question": "What shape came first?", "answer": "circle"},
            {"question": "What colour was the last shape?", "answer": "blue"},
        ]
    }
    codes, ts = _codes(2), np.arange(2.0)

    def order(opts, epoch):
        doc = build_docs(tok, vocab, codes, ts, meta, opts, 10_000, sample_rng(0, epoch, "k"))[0][0]
        text = tok.decode([i for i in doc.ids.tolist() if i < tok.text_size])
        found = sorted(
            (text.index(f"Question: {x['question']}\nAnswer: {x['answer']}"), x["answer"])
            for x in meta["qa"]
        )  # ValueError if a pair is missing or split
        return tuple(a for _, a in found)

    shuffled = {order(LayoutOptions(), e) for e in range(12)}
    assert len(shuffled) >= 3 and all(sorted(o) == ["blue", "circle", "red"] for o in shuffled)
    assert order(LayoutOptions(), 5) == order(
        LayoutOptions(), 5
    )  # deterministic per (seed, epoch, key)
    assert {order(LayoutOptions(qa_order="given"), e) for e in range(6)} == {
        ("red", "circle", "blue")
    }


def test_qa_types_keep_only_those_questions(tok, vocab):
    """qa_types lays out only the pairs of the named types (each once, with its answer); a sample
    left with none falls to its next template; a pair with no type is dropped; an unknown name
    is refused naming the key."""
    from longvideo.config import ConfigError, load_config
    from longvideo.data.config import QUESTION_NAMES
    from longvideo.data.questions import HOUR_QUESTIONS, QUESTION_TYPES
    from longvideo.data.synthetic import SyntheticSpec

    assert QUESTION_NAMES == tuple(QUESTION_TYPES)  # what a config may name is what is asked

    spec = SyntheticSpec(
        fps=1,
        min_seconds=30,
        max_seconds=40,
        needle_fraction=1.0,
        max_flashes=3,
        questions=HOUR_QUESTIONS,
    )
    metas = [make_sample(7, i, spec).meta for i in range(12)]
    assert {len(m["qa"]) for m in metas} >= {6, 7}  # one flash: needle; two or three: order
    codes, ts = _codes(2), np.arange(2.0)

    def pairs(meta, opts):
        docs, _ = build_docs(tok, vocab, codes, ts, meta, opts, 10_000, sample_rng(0, 0, "k"))
        doc = docs[0]
        text = tok.decode([i for i in doc.ids.tolist() if i < tok.text_size])
        return doc.template, text

    for m in metas:
        every = {x["type"]: x for x in m["qa"]}
        for keep in (("needle",), ("count", "last_colour"), ("order", "between")):
            template, text = pairs(m, LayoutOptions(qa_types=keep))
            kept = [every[t] for t in keep if t in every]
            if not kept:  # no such question for this video: the segments template instead
                assert template == "segments" and "Question:" not in text
                continue
            assert template == "qa" and text.count("Question:") == len(kept)
            for x in kept:
                assert f"Question: {x['question']}\nAnswer: {x['answer']}" in text
        template, text = pairs(m, LayoutOptions())
        assert text.count("Question:") == len(m["qa"])  # empty: every pair
    untyped = {"qa": [{"question": "What colour was the flash frame?", "answer": "red"}]}
    assert (
        build_docs(
            tok,
            vocab,
            codes,
            ts,
            untyped,
            LayoutOptions(qa_types=("needle",)),
            10_000,
            sample_rng(0, 0, "k"),
        )[0]
        == []
    )
    assert load_config("tiny", ["data.qa_types=[needle,count]"]).data.qa_types == (
        "needle",
        "count",
    )
    with pytest.raises(ConfigError, match="data.qa_types.*needl"):
        load_config("tiny", ["data.qa_types=[needl]"])


def test_uniform_keep_spreads_evenly_and_keeps_both_ends():
    for n in range(1, 70):
        assert uniform_keep(n, n) == list(range(n)) == uniform_keep(n, n + 3)
        assert uniform_keep(n, 0) == []
        assert uniform_keep(n, 1) == [n // 2]
        for keep in range(2, n):
            idx = uniform_keep(n, keep)
            assert len(idx) == keep and idx[0] == 0 and idx[-1] == n - 1, (n, keep, idx)
            gaps = np.diff(idx)
            assert gaps.min() >= 1 and gaps.max() - gaps.min() <= 1, (
                n,
                keep,
                idx,
            )  # strictly increasing, even
