"""Evaluation harness: needle prompts, scoring, JSON + heatmap PNG on a tiny model."""

import json

import numpy as np
import pytest
import torch
from test_infer_chat import tiny_pretrained

from longvideo.checkpoint import save_project_checkpoint
from longvideo.data.shards import ShardWriter, token_sample_members
from longvideo.data.synthetic import COLOURS, SyntheticSpec, make_sample, read_frame
from longvideo.data.video import read_video
from longvideo.infer import cli
from longvideo.infer.config import InferConfig
from longvideo.infer.evals import (
    evaluate_qa,
    evaluate_text_needle,
    evaluate_video_needle,
    evaluate_vq_needle,
    exact_match,
    flash_frame,
    haystack_frames,
    haystack_story,
    miss_table,
    needle_index,
    substring_match,
    text_needle_prompt,
)
from longvideo.infer.generation import Generation
from longvideo.vq import encode_video
from longvideo.vq.codec import SplicingEncoder

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Each test here runs on one torch thread (conftest.one_thread)."""


@pytest.fixture(scope="module")
def pre():
    return tiny_pretrained(max_seq_len=512)


class ConstantEngine:
    """An engine that always answers the same text (checks the harness's scoring, not a model)."""

    def __init__(self, tokenizer, text):
        self.ids = tokenizer.encode(text) + [tokenizer.eos_id]
        self.prefix_len, self.prefix_s, self.prefixes = 0, 0.0, []

    def set_prefix(self, ids):
        self.prefixes.append(ids[0].tolist())
        self.prefix_len = ids.shape[1]

    def generate(
        self, ids, *, max_new_tokens, temperature=0.0, top_p=1.0, stop_ids=(), generator=None
    ):
        return Generation(
            tokens=torch.tensor([self.ids]),
            prompt_len=self.prefix_len + ids.shape[1],
            ttft_s=0.0,
            total_s=0.0,
        )


def recording(prompts: list, text: str):
    """An engine factory: a ConstantEngine answering `text` that appends each prefix it is given
    (token ids) to `prompts`."""

    class Recording(ConstantEngine):
        def set_prefix(self, ids):
            prompts.append(ids[0].tolist())
            super().set_prefix(ids)

    return lambda p: Recording(p.tokenizer, text)


def write_qa_shards(pre, tmp_path, n=3, **options):
    spec = SyntheticSpec(
        size=16,
        fps=2,
        min_seconds=3,
        max_seconds=6,
        long_fraction=0.0,
        needle_fraction=0.5,
        **options,
    )
    samples = [make_sample(7, i, spec) for i in range(n)]
    with ShardWriter(tmp_path / "tokens-000.tar") as w:
        for s in samples[:-1]:
            frames = torch.from_numpy(s.frames()[::2].copy())  # 1 fps
            codes = encode_video(pre.vq, frames).numpy()
            w.write(
                s.key,
                token_sample_members(s.key, codes, np.arange(len(codes), dtype=np.float64), s.meta),
            )
    with ShardWriter(tmp_path / "raw-000.tar") as w:
        import json as _json

        s = samples[-1]
        w.write(s.key, {"mp4": s.mp4(), "json": _json.dumps(s.meta).encode()})
    return samples


def test_scoring():
    assert exact_match(" Blue.\nmore text", "blue") and not exact_match("light blue", "blue")
    assert substring_match("it was light blue", "Blue") and not substring_match("red", "blue")
    assert not exact_match("", "") and not substring_match("x", "")


def test_text_needle_prompt_places_the_needle_at_its_depth(pre):
    for depth in (0.0, 0.3, 0.7, 1.0):
        ids, facts = text_needle_prompt(pre, 300, depth, "Lisbon", 1234567, seed=1)
        assert 300 - 30 <= len(ids) <= 300 and facts["tokens"] == len(ids)
        text = pre.tokenizer.decode(ids)
        needle = "The special magic Lisbon number is: 1234567."
        start, body = text.index(needle), text.index("What is the special magic Lisbon number?")
        hay_len = body - len(needle)
        assert abs(start / hay_len - depth) < 0.1, (depth, start / hay_len)
        assert text.count("1234567") == 1


def test_video_needle_splicing_equals_encoding_the_spliced_video(pre):
    hay = haystack_frames(6, 16, seed=0)
    assert hay.shape == (6, 16, 16, 3) and needle_index(6, 0.5) in (2, 3)
    frames = hay.copy()
    frames[4] = np.array([230, 40, 40], np.uint8)
    whole = encode_video(pre.vq, torch.from_numpy(frames))
    alone = encode_video(pre.vq, torch.from_numpy(frames[4:5]))
    assert torch.equal(whole[4], alone[0])


def test_scores_follow_the_answers_with_a_constant_engine(pre, tmp_path):
    factory = lambda p: ConstantEngine(p.tokenizer, " red")  # noqa: E731
    res = evaluate_video_needle(
        pre,
        lengths=(4, 6),
        depths=(0.0, 1.0),
        colours=("red", "blue"),
        engine_factory=factory,
        progress=False,
    )
    assert res["grid"] == [[0.5, 0.5], [0.5, 0.5]] and res["chance"] == 0.5
    assert all(c["needle_kept"] for c in res["cells"])
    causal = tiny_pretrained(
        max_seq_len=512, mode="causal3d"
    )  # re-encodes each cell instead of splicing
    res3 = evaluate_video_needle(
        causal,
        lengths=(5,),
        depths=(0.5,),
        colours=("blue", "red", "green"),
        engine_factory=factory,
        progress=False,
    )
    assert res3["accuracy"] == pytest.approx(1 / 3) and res3["vq_mode"] == "causal3d"
    samples = write_qa_shards(pre, tmp_path)
    qa = evaluate_qa(pre, str(tmp_path), engine_factory=factory, progress=False)
    answers = [x["answer"] for s in samples for x in s.meta["qa"]]
    assert qa["questions"] == len(answers) and qa["samples"] == len(samples)
    assert qa["accuracy"] == pytest.approx(np.mean([a == "red" for a in answers]))
    chance = np.mean([1 / len(x["choices"]) for s in samples for x in s.meta["qa"]])
    assert qa["chance"] == pytest.approx(chance)
    text = evaluate_text_needle(
        pre, lengths=(64,), depths=(0.5,), rounds=2, engine_factory=factory, progress=False
    )
    assert text["accuracy"] == 0.0
    number = str(text["cells"][0]["number"])
    right = evaluate_text_needle(
        pre,
        lengths=(64,),
        depths=(0.5,),
        rounds=1,
        engine_factory=lambda p: ConstantEngine(p.tokenizer, f" {number}"),
        progress=False,
    )
    assert right["accuracy"] == 1.0  # same seed: the same first needle


def test_qa_by_question_type_and_length_follows_the_answers(pre, tmp_path):
    """Every question type at two video lengths, answered "red" by a constant engine: each cell's
    accuracy is the share of its answers that are "red", and the type x length plot is written
    into a directory that did not exist."""
    from longvideo.data.questions import HOUR_QUESTIONS

    samples = write_qa_shards(
        pre, tmp_path / "shards", n=8, max_flashes=3, questions=HOUR_QUESTIONS, durations=(3, 6)
    )
    factory = lambda p: ConstantEngine(p.tokenizer, " red")  # noqa: E731
    out = tmp_path / "new" / "qa"
    qa = evaluate_qa(
        pre,
        str(tmp_path / "shards"),
        engine_factory=factory,
        lengths=(3, 6),
        out_dir=out,
        progress=False,
    )
    assert (out / "qa_lengths.png").read_bytes()[:8] == PNG_MAGIC
    assert json.loads((out / "qa.json").read_text())["per_type"] == qa["per_type"]
    for t, r in qa["per_type"].items():
        for length, cell in r["by_length"].items():
            asked = [
                x
                for s in samples
                for x in s.meta["qa"]
                if x["type"] == t and s.duration == int(float(length))
            ]
            assert cell["count"] == len(asked)
            if asked:
                assert cell["accuracy"] == pytest.approx(
                    np.mean([x["answer"] == "red" for x in asked])
                )
                assert cell["chance"] == pytest.approx(
                    np.mean([1 / len(x["choices"]) for x in asked])
                )
    assert set(qa["per_type"]) == {x["type"] for s in samples for x in s.meta["qa"]}


def test_eval_harness_on_a_tiny_model_writes_json_and_png(pre, tmp_path, capsys):
    write_qa_shards(pre, tmp_path / "shards", n=2)
    outs = {
        "qa": evaluate_qa(
            pre,
            str(tmp_path / "shards"),
            out_dir=tmp_path / "out",
            max_new_tokens=3,
            progress=False,
        ),
        "text_needle": evaluate_text_needle(
            pre,
            lengths=(48, 96),
            depths=(0.0, 1.0),
            rounds=1,
            max_new_tokens=3,
            out_dir=tmp_path / "out",
            progress=False,
        ),
        "video_needle": evaluate_video_needle(
            pre,
            lengths=(3, 5),
            depths=(0.0, 1.0),
            colours=("red", "blue"),
            max_new_tokens=3,
            out_dir=tmp_path / "out",
            progress=False,
        ),
    }
    for name, res in outs.items():
        data = json.loads((tmp_path / "out" / f"{name}.json").read_text())
        assert (tmp_path / "out" / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
        assert data["accuracy"] == pytest.approx(res["accuracy"]) and 0.0 <= data["accuracy"] <= 1.0
    for name, key in (("text_needle", "cells"), ("video_needle", "cells")):
        res = outs[name]
        grid = np.array(res["grid"])
        assert grid.shape == (len(res["depths"]), len(res["lengths"]))
        assert res["accuracy"] == pytest.approx(np.mean([c["correct"] for c in res[key]]))
    assert outs["qa"]["questions"] == sum(len(r) for r in [outs["qa"]["records"]])

    # the CLI on a saved checkpoint prints the accuracy with the chance level beside it
    ckpt = save_project_checkpoint(
        tmp_path / "ckpt", pre.model.state_dict(), pre.config, tokenizer=pre.tokenizer, vq=pre.vq
    )
    rc = cli.eval_main(
        [
            "video-niah",
            "--model",
            str(ckpt),
            "--out",
            str(tmp_path / "cli"),
            "--lengths",
            "3",
            "--depths",
            "0,1",
            "--colours",
            "red,blue",
            "--max-new-tokens",
            "2",
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "chance 0.500" in out and (tmp_path / "cli" / "video_needle.png").is_file()
    rc = cli.eval_main(
        [
            "qa",
            "--model",
            str(ckpt),
            "--out",
            str(tmp_path / "cli"),
            "--shards",
            str(tmp_path / "none*.tar"),
        ]
    )
    assert rc != 0 and "no shards match" in capsys.readouterr().err


def test_video_needle_trials_per_length_and_exact_splices(pre):
    """Trials cycle the colours over fresh backgrounds; each cell's prompt holds the codes of the
    edited haystack exactly as a full encode gives them (2d and causal3d)."""
    seen = []

    factory = recording(seen, " blue")
    res = evaluate_video_needle(
        pre,
        lengths=(4, 7),
        depths=(0.0, 0.5, 1.0),
        colours=("red", "blue"),
        trials=(3, 2),
        engine_factory=factory,
        progress=False,
    )
    assert res["trials"] == [3, 2] and len(res["cells"]) == 3 * 5
    assert [c["colour"] for c in res["cells"] if c["frames"] == 4][::3] == ["red", "blue", "red"]
    assert np.allclose(res["grid"], [[1 / 3, 1 / 2]] * 3)
    size = pre.vq.cfg.resolution
    for c in res["cells"]:  # each cell names the background it was asked over
        j = (4, 7).index(c["frames"])
        assert c["background"] == haystack_story(c["frames"], size, seed=1000 * j + c["trial"])
    # " blue" to every question: each red trial is missed at every depth, no blue one
    assert {k: v["trials_missed_at_every_depth"] for k, v in res["misses"].items()} == {
        "4": 2,
        "7": 1,
    }
    assert [v["wrong"] for v in res["misses"].values()] == [6, 3]
    assert res["misses"]["4"]["by_colour"] == {
        "red": {"right": 0, "asked": 6},
        "blue": {"right": 3, "asked": 3},
    }
    assert res["misses"]["7"]["by_colour"] == {
        "red": {"right": 0, "asked": 3},
        "blue": {"right": 3, "asked": 3},
    }
    causal = tiny_pretrained(max_seq_len=512, mode="causal3d")
    vocab, size = causal.model.cfg.vocab, causal.vq.cfg.resolution
    for decoded in (
        True,
        False,
    ):  # through the training videos' codec (the default) or exactly as drawn
        seen.clear()
        res3 = evaluate_video_needle(
            causal,
            lengths=(9,),
            depths=(0.5,),
            colours=("green",),
            trials=1,
            engine_factory=factory,
            progress=False,
            decoded=decoded,
        )
        cell = res3["cells"][0]
        assert res3["decoded"] is decoded
        frames = haystack_frames(9, size, seed=0, decoded=decoded)
        frames[cell["needle_frame"]] = (
            flash_frame("green", size, decoded=True).numpy()
            if decoded
            else np.array([40, 200, 60], np.uint8)
        )
        codes = encode_video(causal.vq, torch.from_numpy(frames)).numpy()
        got = [t - vocab.vq_offset for t in seen[0] if vocab.vq_offset <= t < vocab.size]
        assert got == codes.reshape(-1).tolist()


def test_edit_lookalikes_on_hand_made_codes():
    """scrub: outside the flash's group and the two after it, every code of the flash becomes its
    cell's most frequent other code (worked by hand); add: that share of the other groups gets
    one flash code in its own cell, the protected groups never change."""
    from longvideo.infer.evals import edit_lookalikes

    codes = np.array([[7, 1], [1, 1], [2, 8], [7, 8], [7, 8], [8, 8], [1, 2], [7, 7]])[:, None, :]
    rng = np.random.default_rng(0)
    scrubbed = edit_lookalikes(codes, 3, "scrub", rng)[:, 0, :]
    assert scrubbed.tolist() == [[1, 1], [1, 1], [2, 1], [7, 8], [7, 8], [8, 8], [1, 2], [1, 1]]
    assert (edit_lookalikes(codes, 3, "keep", rng) == codes).all()
    plain = np.array([[1, 2]] * 3 + [[7, 8]] + [[3, 4]] * 16)[:, None, :]  # no look-alike yet
    added = edit_lookalikes(plain, 3, "add", np.random.default_rng(1), share=0.25)[:, 0, :]
    changed = np.nonzero((added != plain[:, 0, :]).any(1))[0]
    assert len(changed) == round(0.25 * 17) and not set(changed) & {3, 4, 5}
    for g in changed:
        (k,) = np.nonzero(added[g] != plain[g, 0])[0]
        assert added[g, k] == (7, 8)[k]
    again = edit_lookalikes(plain, 3, "add", np.random.default_rng(1), share=0.25)[:, 0, :]
    assert (again == added).all()
    with pytest.raises(ValueError, match="lookalikes"):
        edit_lookalikes(codes, 3, "remove", rng)


def test_video_needle_scrubbed_prompts_hold_no_lookalike(pre):
    """With lookalikes="scrub" the prompt's codes are the encode's, except that no group outside
    the flash's and the two after it holds any of the flash's codes; the result records the edit."""
    seen = []

    causal = tiny_pretrained(max_seq_len=512, mode="causal3d")
    vocab, size = causal.model.cfg.vocab, causal.vq.cfg.resolution
    res = evaluate_video_needle(
        causal,
        lengths=(13,),
        depths=(0.5,),
        colours=("yellow",),
        trials=1,
        engine_factory=recording(seen, " blue"),
        progress=False,
        lookalikes="scrub",
    )
    cell = res["cells"][0]
    assert res["lookalikes"] == "scrub"
    frames = haystack_frames(13, size, seed=0, decoded=True)
    frames[cell["needle_frame"]] = flash_frame("yellow", size, decoded=True).numpy()
    codes = encode_video(causal.vq, torch.from_numpy(frames)).numpy()
    got = np.asarray([t - vocab.vq_offset for t in seen[0] if vocab.vq_offset <= t < vocab.size])
    got = got.reshape(len(codes), -1)
    g, flat = cell["needle_group"], codes.reshape(len(codes), -1)
    assert (got[g : g + 3] == flat[g : g + 3]).all()
    others = [k for k in range(len(codes)) if not g <= k < g + 3]
    assert not np.isin(got[others], flat[g]).any()
    kept = ~np.isin(flat[others], flat[g])
    assert (got[others][kept] == flat[others][kept]).all()  # nothing else changed


def test_haystack_story_is_what_the_background_shows():
    """The description of a generated background agrees with its pixels: each frame's shape has
    the colour of the scene it falls in, so the first frame shows the first scene's colour, the
    last frame the last's, and each colour's frames add up to its seconds on screen."""
    by_rgb = {tuple(v): k for k, v in COLOURS.items()}
    for seed, frames in ((0, 9), (3, 40), (11, 120)):
        story = haystack_story(frames, 32, seed)
        drawn = haystack_frames(frames, 32, seed)  # exactly as drawn
        shown = []
        for f in drawn:
            painted = {tuple(p) for p in f.reshape(-1, 3) if p.any()}
            assert len(painted) == 1  # one shape a frame, one colour
            shown.append(by_rgb[painted.pop()])
        assert story["seed"] == seed
        assert story["first"].split()[1] == shown[0] and story["last"].split()[1] == shown[-1]
        assert (story["first_colour"], story["last_colour"]) == (shown[0], shown[-1])
        assert story["colour_seconds"] == {c: shown.count(c) for c in set(shown)}
        counts = list(story["colour_seconds"].values())
        assert counts == sorted(counts, reverse=True) and sum(counts) == frames


def test_miss_table_counts_a_hand_made_grid():
    """Wrong answers sorted by what they name, against a grid written by hand: two trials of 60
    frames (one missed at every depth), one of 300 read right. bg1 is a story written before the
    scenes' colours had fields of their own: the table reads them from the words."""
    bg0 = {
        "first": "a red circle",
        "last": "a blue square",
        "first_colour": "red",
        "last_colour": "blue",
        "colour_seconds": {"green": 30, "red": 20, "blue": 10},
    }
    bg1 = {"first": "a yellow circle", "last": "a yellow square", "colour_seconds": {"yellow": 60}}
    cells = [
        # trial 0 (red flash): "green" the most-seen colour, "blue" its last scene's, "triangle"
        dict(frames=60, trial=0, colour="red", prediction="green", correct=False, background=bg0),
        dict(frames=60, trial=0, colour="red", prediction=" Blue.", correct=False, background=bg0),
        dict(
            frames=60, trial=0, colour="red", prediction="triangle", correct=False, background=bg0
        ),
        # trial 1 (blue flash): right once, "red" a colour the background never shows
        dict(frames=60, trial=1, colour="blue", prediction="blue", correct=True, background=bg1),
        dict(frames=60, trial=1, colour="blue", prediction="red", correct=False, background=bg1),
        dict(frames=60, trial=1, colour="blue", prediction="yellow", correct=False, background=bg1),
        dict(frames=300, trial=0, colour="red", prediction="red", correct=True, background=bg1),
    ]
    assert miss_table(cells) == {
        "60": {
            "wrong": 5,
            "trials": 2,
            "trials_missed_at_every_depth": 1,
            "by_colour": {"red": {"right": 0, "asked": 3}, "blue": {"right": 1, "asked": 3}},
            "wrong_answers_naming": {
                "most_seen": 2,
                "first_or_last": 1,
                "other_colour": 1,
                "no_colour": 1,
            },
        },
        "300": {
            "wrong": 0,
            "trials": 1,
            "trials_missed_at_every_depth": 0,
            "by_colour": {"red": {"right": 1, "asked": 1}},
            "wrong_answers_naming": {
                "most_seen": 0,
                "first_or_last": 0,
                "other_colour": 0,
                "no_colour": 0,
            },
        },
    }
    # a haystack video has no generated background to name
    assert "wrong_answers_naming" not in miss_table([{**cells[0], "background": None}])["60"]


@pytest.mark.parametrize("fps", [1, 8])
def test_decoded_needle_pixels_are_a_training_videos(fps):
    """The evaluation's decoded flash and background are, pixel for pixel, what a generated training
    video of that frame rate gives when its mp4 is read back at 1 fps; the exact colour is not."""
    for seed in range(3):
        spec = SyntheticSpec(
            size=16, fps=fps, min_seconds=12, max_seconds=12, long_fraction=0.0, needle_fraction=1.0
        )
        sample = make_sample(seed, 0, spec)
        sec, colour = sample.needle
        read = read_video(sample.mp4(), fps=1.0, size=16).frames.numpy()
        assert np.array_equal(read[sec], flash_frame(colour, 16, fps, decoded=True).numpy())
        assert not np.array_equal(read[sec], flash_frame(colour, 16, fps).numpy())
    hay = haystack_frames(12, 16, seed=5, source_fps=fps, decoded=True)
    spec = SyntheticSpec(
        size=16, fps=fps, min_seconds=12, max_seconds=12, long_fraction=0.0, needle_fraction=0.0
    )
    assert np.array_equal(
        hay, read_video(make_sample(5, 0, spec).mp4(), fps=1.0, size=16).frames.numpy()
    )


def _shared_encoding_body(rank, world):
    import torch.distributed as dist

    causal = tiny_pretrained(max_seq_len=512, mode="causal3d")
    prompts = []

    res = evaluate_video_needle(
        causal,
        lengths=(6, 9),
        depths=(0.0, 0.5, 1.0),
        colours=("green", "red"),
        trials=(3, 2),
        engine_factory=recording(prompts, " red"),
        progress=False,
        encode_group=dist.group.WORLD,
    )
    assert len(prompts) == len(res["cells"]) == 3 * 5
    vocab = causal.model.cfg.vocab
    for ids, cell in zip(prompts, res["cells"]):
        # the reference: this rank encodes the edited haystack whole, whichever rank encoded the trial
        j = (6, 9).index(cell["frames"])
        size = causal.vq.cfg.resolution
        frames = haystack_frames(cell["frames"], size, seed=1000 * j + cell["trial"], decoded=True)
        frames[cell["needle_frame"]] = flash_frame(cell["colour"], size, decoded=True).numpy()
        codes = encode_video(causal.vq, torch.from_numpy(frames)).numpy()
        assert [
            t - vocab.vq_offset for t in ids if vocab.vq_offset <= t < vocab.size
        ] == codes.reshape(-1).tolist()
    assert [c["colour"] for c in res["cells"]][::3] == ["green", "red", "green", "green", "red"]


@pytest.mark.distributed
def test_video_needle_ranks_share_the_encoding_and_see_the_same_prompts():
    """Under sequence-parallel prefill each rank encodes every second background and broadcasts it:
    on both ranks every cell's prompt holds the codes a whole encode of its edited haystack gives."""
    from distributed import run_ranks

    run_ranks(_shared_encoding_body, world=2, timeout=240)


def test_video_needle_counts_needles_the_context_dropped(pre, tmp_path, capsys):
    """A video longer than the model's context loses whole groups; a trial whose flash went with
    them is counted, and the CLI warns, so a heatmap of guesses is not read as a result."""
    factory = lambda p: ConstantEngine(p.tokenizer, " red")  # noqa: E731
    fits = evaluate_video_needle(
        pre,
        lengths=(6,),
        depths=(0.0, 0.5, 1.0),
        colours=("red",),
        trials=1,
        engine_factory=factory,
        progress=False,
    )
    assert fits["needles_dropped"] == 0 and all(c["needle_kept"] for c in fits["cells"])
    short = tiny_pretrained(max_seq_len=96)
    depths = tuple(np.linspace(0.0, 1.0, 9))
    prompts = []

    res = evaluate_video_needle(
        short,
        lengths=(40,),
        depths=depths,
        colours=("red",),
        trials=1,
        engine_factory=recording(prompts, " red"),
        progress=False,
    )
    # independent of the bookkeeping: one background, so every prompt without its flash is the same
    # prompt, and a prompt that shows its flash differs from it
    shown = [i for i, c in enumerate(res["cells"]) if c["needle_kept"]]
    blind = [prompts[i] for i, c in enumerate(res["cells"]) if not c["needle_kept"]]
    assert all(b == blind[0] for b in blind) and all(prompts[i] != blind[0] for i in shown)
    assert all(c["tokens"] <= 96 for c in res["cells"]) and all(
        c["groups"] < 40 for c in res["cells"]
    )
    assert 0 < res["needles_dropped"] == len(res["cells"]) - len(shown) < len(depths)
    assert res["context"] == 96
    ckpt = save_project_checkpoint(
        tmp_path / "ckpt",
        short.model.state_dict(),
        short.config,
        tokenizer=short.tokenizer,
        vq=short.vq,
    )
    rc = cli.eval_main(
        [
            "video-niah",
            "--model",
            str(ckpt),
            "--out",
            str(tmp_path / "cli"),
            "--lengths",
            "40",
            "--depths",
            ",".join(f"{d:g}" for d in depths),
            "--colours",
            "red",
            "--trials",
            "1",
            "--max-new-tokens",
            "8",
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and f"warning: {res['needles_dropped']} of 9 needles were dropped" in out


def test_lookalike_table_counts_a_hand_made_codebook():
    """Per colour: the most frequent flash tuple, each code's share of ordinary frames holding it
    in any cell, the share holding any, and the codes no ordinary frame holds; counted by hand."""
    from longvideo.infer.evals import lookalike_table

    red = [np.array([[5, 6], [7, 5]])] * 2 + [np.array([[5, 6], [7, 8]])]
    blue = [np.array([[1, 1], [2, 2]])]
    ordinary = np.array([[[1, 3], [3, 3]], [[3, 3], [3, 6]], [[0, 0], [0, 0]], [[2, 9], [9, 9]]])
    t = lookalike_table({"red": red, "blue": blue}, ordinary)
    assert t["red"] == {
        "codes": [5, 6, 7, 5],
        "tuples": 2,
        "share_per_code": [0.0, 0.25, 0.0, 0.0],
        "share_any": 0.25,
        "unique_codes": 2,
        "ordinary_frames": 4,
    }
    assert t["blue"]["share_per_code"] == [0.25] * 4
    assert t["blue"]["share_any"] == 0.5 and t["blue"]["unique_codes"] == 0
    empty = lookalike_table({"red": red}, np.zeros((0, 2, 2), np.int64))["red"]
    assert empty["share_any"] == 0.0 and empty["unique_codes"] == 3  # 5, 6 and 7


def test_vq_needle_lookalikes_read_the_plain_backgrounds(monkeypatch):
    """The evaluation's look-alike table takes each flash's own code group and every frame of the
    backgrounds encoded without it, both through the training videos' codec: a codec that codes a cell by its solid palette colour gives
    each flash a code no ordinary frame holds; one that also gives every ordinary frame's top
    left cell the red flash's code takes red's uniqueness away and leaves the others'."""
    from longvideo.data.synthetic import NEEDLE_CHOICES
    from longvideo.infer import evals

    palette = [np.asarray(COLOURS[c], np.uint8) for c in NEEDLE_CHOICES]

    def cells(frames):  # (T, 16, 16, 3) -> (T, 2, 2): palette index of a solid cell, else 4 or 5
        f = frames.numpy().reshape(len(frames), 2, 8, 2, 8, 3).transpose(0, 1, 3, 2, 4, 5)
        f = f.reshape(len(frames), 2, 2, 64, 3)
        codes = np.where((f.max(-1) > 0).any(-1), 4, 5)
        for i, rgb in enumerate(palette):  # within the codec's few units of the colour
            near = (np.abs(f.astype(int) - rgb.astype(int)) < 16).all(-1)
            codes[near.mean(-1) >= 0.9] = i
        return torch.from_numpy(codes)

    def decode(vq, codes):
        out = np.zeros((len(codes), 16, 16, 3), np.uint8)
        for t, y, x in zip(*np.nonzero(codes.numpy() < 4)):
            out[t, 8 * y : 8 * y + 8, 8 * x : 8 * x + 8] = palette[int(codes[t, y, x])]
        return torch.from_numpy(out)

    vq = tiny_pretrained(max_seq_len=512).vq
    monkeypatch.setattr(evals, "encode_video", lambda vq, frames, batch_frames: cells(frames))
    monkeypatch.setattr(evals, "decode_codes", decode)
    res = evaluate_vq_needle(vq, num_frames=13, trials=8, progress=False)
    assert res["rate"] == 1.0
    for i, colour in enumerate(NEEDLE_CHOICES):
        row = res["lookalikes"][colour]
        assert row["codes"] == [i] * 4 and row["tuples"] == 1 and row["unique_codes"] == 1
        assert row["share_any"] == 0.0 and row["ordinary_frames"] == 8 * 13
    assert [c["flash_codes"] for c in res["cells"]][:2] == [[0] * 4, [1] * 4]

    def red_corner(frames):
        codes = cells(frames)
        plain = ~(codes < 4).all(-1).all(-1)  # frames that are not a flash
        codes[plain, 0, 0] = 0
        return codes

    monkeypatch.setattr(evals, "encode_video", lambda vq, frames, batch_frames: red_corner(frames))
    res = evaluate_vq_needle(vq, num_frames=13, trials=8, progress=False)
    red = res["lookalikes"]["red"]
    assert (
        red["unique_codes"] == 0 and red["share_any"] == 1.0 and red["share_per_code"] == [1.0] * 4
    )
    assert all(res["lookalikes"][c]["unique_codes"] == 1 for c in NEEDLE_CHOICES[1:])


def test_vq_needle_scores_what_the_decoder_returns(pre, tmp_path, monkeypatch):
    """The flash is scored on the decoded frame at its own index, per offset in its group: a codec
    that returns the video unchanged scores 100 %, one that swaps red and blue 0 %."""
    from longvideo.infer import evals

    assert (
        evals.nearest_colour(np.full((4, 4, 3), (230, 40, 40), np.uint8), ["red", "blue"]) == "red"
    )
    causal = tiny_pretrained(max_seq_len=512, mode="causal3d")
    res = evaluate_vq_needle(causal.vq, num_frames=13, trials=6, progress=False, out_dir=tmp_path)
    t = causal.vq.cfg.frames_per_group
    assert set(res["rate_by_offset"]) <= {str(o) for o in range(t)} and 0.0 <= res["rate"] <= 1.0
    assert (tmp_path / "vq_needle.png").is_file() and (tmp_path / "vq_needle.json").is_file()
    monkeypatch.setattr(evals, "encode_video", lambda vq, frames, batch_frames: frames.clone())
    monkeypatch.setattr(evals, "decode_codes", lambda vq, codes: codes)
    same = evaluate_vq_needle(causal.vq, num_frames=13, trials=6, progress=False)
    assert same["rate"] == 1.0 and same["shape_frames"] > 0
    assert same["shape_colour_rate"] == 1.0 and same["shape_kind_rate"] == 1.0
    monkeypatch.setattr(
        evals, "decode_codes", lambda vq, codes: codes.flip(-1)
    )  # RGB -> BGR: red and blue swap (yellow reads blue, green stays green), shapes keep their kind
    swapped = evaluate_vq_needle(
        causal.vq, num_frames=13, trials=6, progress=False, colours=("red", "blue")
    )
    assert swapped["rate"] == 0.0 and swapped["shape_kind_rate"] == 1.0
    drawn = [
        read_frame(f)["colour"]
        for t in range(6)
        for f in evals.haystack_frames(13, causal.vq.cfg.resolution, 7919 * (t + 1))
        if read_frame(f)["kind"] == "shape"
    ]
    assert swapped["shape_colour_rate"] == pytest.approx(
        sum(c == "green" for c in drawn) / len(drawn), abs=0.1
    )
    # every shape's position blurred into the mean colour of its frame: no shape left to read
    monkeypatch.setattr(
        evals,
        "decode_codes",
        lambda vq, codes: codes.float().mean((1, 2), keepdim=True).expand_as(codes).to(codes.dtype),
    )
    flat = evaluate_vq_needle(causal.vq, num_frames=13, trials=6, progress=False)
    assert flat["shape_kind_rate"] == 0.0


def test_needle_lookalikes_script_summarises_each_edit_by_colour(tmp_path):
    """scripts/needle_lookalikes.py counts each edit's grid per length and flash colour (hand-made
    cells) and draws the figure from the grids alone (--skip-run)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "needle_lookalikes.py"
    spec = importlib.util.spec_from_file_location("needle_lookalikes", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def cell(frames, colour, correct):
        return {"frames": frames, "colour": colour, "correct": correct}

    keep = [cell(40, "red", True), cell(40, "green", False), cell(40, "green", False)]
    scrub = [cell(40, "red", True), cell(40, "green", True), cell(40, "green", False)]
    scrub += [cell(8, "red", False)]
    for edit, cells in (("keep", keep), ("scrub", scrub)):
        (tmp_path / edit).mkdir()
        (tmp_path / edit / "video_needle.json").write_text(json.dumps({"cells": cells}))
    assert script.main(["--out", str(tmp_path), "--skip-run", "--edits", "keep,scrub"]) == 0
    got = json.loads((tmp_path / "lookalikes.json").read_text())["by_edit"]
    assert got["keep"] == {
        "40": {
            "all": {"right": 1, "asked": 3},
            "red": {"right": 1, "asked": 1},
            "green": {"right": 0, "asked": 2},
        }
    }
    assert got["scrub"]["40"]["green"] == {"right": 1, "asked": 2}
    assert got["scrub"]["8"] == {"all": {"right": 0, "asked": 1}, "red": {"right": 0, "asked": 1}}
    assert (tmp_path / "lookalikes.png").stat().st_size > 1000
    with pytest.raises(SystemExit):
        script.main(["--out", str(tmp_path), "--skip-run", "--edits", "keep,add"])  # no add grid


def test_video_needle_control_tells_a_reading_from_a_default(pre):
    """The control asks each trial over its bare background. An engine that answers " red" only
    to the red trial's prompts with the flash in them (their codes, encoded here apart), " blue"
    to any other, reads every red flash; its right answers to blue flashes are the bare
    background's answer, so none is a reading. The control's prompt is the bare background's
    codes exactly, one a trial, after its depths."""
    lengths, depths, colours = (6,), (0.0, 0.5, 1.0), ("red", "blue")
    size, vocab = pre.vq.cfg.resolution, pre.model.cfg.vocab
    bare = haystack_frames(6, size, seed=0, decoded=True)
    # encoded as the evaluation encodes a trial (one SplicingEncoder, its batching): the tiny VQ's
    # random weights put a code at a near-tie now and then, which another batching can flip
    background = SplicingEncoder(pre.vq, bare, batch_frames=InferConfig().encode_batch_frames)
    bare_codes = background.codes_with({}).reshape(-1).tolist()
    red = flash_frame("red", size, decoded=True)
    with_red = [
        background.codes_with({needle_index(6, d): red}).reshape(-1).tolist() for d in depths
    ]
    assert bare_codes not in with_red, "the red flash leaves this background's codes unchanged"
    prompts = []

    def codes_of(ids):
        return [t - vocab.vq_offset for t in ids if vocab.vq_offset <= t < vocab.size]

    class Peeking(ConstantEngine):
        def set_prefix(self, ids):
            prompts.append(ids[0].tolist())
            answer = " red" if codes_of(prompts[-1]) in with_red else " blue"
            self.ids = pre.tokenizer.encode(answer) + [pre.tokenizer.eos_id]
            super().set_prefix(ids)

    res = evaluate_video_needle(
        pre,
        lengths=lengths,
        depths=depths,
        colours=colours,
        trials=2,
        control=True,
        engine_factory=lambda p: Peeking(p.tokenizer, " blue"),
        progress=False,
    )
    assert res["control"] is True and len(prompts) == 2 * (len(depths) + 1)
    assert codes_of(prompts[len(depths)]) == bare_codes  # trial 0's control: no flash
    red_cells = [c for c in res["cells"] if c["colour"] == "red"]
    blue_cells = [c for c in res["cells"] if c["colour"] == "blue"]
    assert all(c["correct"] and not c["default"] and c["control"] == "blue" for c in red_cells)
    assert all(c["correct"] and c["default"] for c in blue_cells)
    row = res["misses"]["6"]
    assert row["read"] == 3 and row["defaults"] == 3 and row["wrong"] == 0
    assert row["decidable"] == 3  # the blue trial's bare background is answered "blue" already
    assert row["by_colour"] == {
        "red": {"right": 3, "asked": 3, "read": 3, "decidable": 3},
        "blue": {"right": 3, "asked": 3, "read": 0, "decidable": 0},
    }
    plain = evaluate_video_needle(
        pre,
        lengths=lengths,
        depths=depths,
        colours=colours,
        trials=2,
        engine_factory=lambda p: ConstantEngine(p.tokenizer, " blue"),
        progress=False,
    )
    assert "default" not in plain["cells"][0] and "read" not in plain["misses"]["6"]


def test_miss_table_counts_readings_and_defaults_by_hand():
    """A hand-made controlled column: right and not the default is a reading; a wrong answer that
    is the default counts as a default, not a reading."""

    def cell(trial, colour, prediction, control):
        return dict(
            frames=60,
            trial=trial,
            colour=colour,
            prediction=prediction,
            correct=prediction == colour,
            default=prediction == control,
            control_right=control == colour,
        )

    cells = [
        cell(0, "red", "red", "blue"),  # read
        cell(0, "red", "blue", "blue"),  # a default, wrong
        cell(1, "blue", "blue", "blue"),  # a default that fits: not decidable
        cell(1, "blue", "blue", "green"),  # read
        cell(1, "blue", "red", "green"),  # wrong, not a default
    ]
    row = miss_table(cells)["60"]
    assert (row["read"], row["defaults"], row["wrong"], row["decidable"]) == (2, 2, 2, 4)
    assert row["by_colour"] == {
        "red": {"right": 1, "asked": 2, "read": 1, "decidable": 2},
        "blue": {"right": 2, "asked": 3, "read": 1, "decidable": 2},
    }


def test_needle_attention_script_records_the_attention_the_model_used(pre):
    """scripts/needle_attention.py's hook: the answer position's attention rows, recomputed in
    float64 from each layer's queries and keys, give that layer's attention output when applied to
    its values, sum to 1, and the hook leaves the model's output as it is."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "needle_attention.py"
    spec = importlib.util.spec_from_file_location("needle_attention", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    torch.manual_seed(0)
    ids = torch.randint(0, pre.model.cfg.vocab.size, (1, 48))
    flash = torch.tensor([5, 6, 7])
    with torch.no_grad():
        plain = pre.model(ids)
        hidden, shares, rows, gaps = script.flash_attention(pre.model, ids, flash)
    assert torch.equal(hidden, plain) and len(rows) == pre.model.cfg.n_layers
    assert max(gaps) < 1e-5
    for share, row in zip(shares, rows):
        assert torch.allclose(row.sum(-1), torch.ones(row.shape[0], dtype=row.dtype))
        assert torch.allclose(share, row[:, flash].sum(-1))
