"""Synthetic data: deterministic in the seed, and its answers are visible in the decoded video."""

import numpy as np
import pytest
from material.shapes import moving_shapes_video

from longvideo.data.shards import SkipStats, iter_raw_samples
from longvideo.data.synthetic import (
    COLOURS,
    NEEDLE_CHOICES,
    NEEDLE_QUESTION,
    SyntheticSpec,
    make_sample,
    write_synthetic_shards,
)
from longvideo.data.video import read_video


def test_moving_shapes_video():
    a = moving_shapes_video(12, 64, seed=3)
    assert a.shape == (12, 64, 64, 3) and a.dtype == np.uint8
    np.testing.assert_array_equal(a, moving_shapes_video(12, 64, seed=3))
    assert not np.array_equal(a, moving_shapes_video(12, 64, seed=4))
    assert not np.array_equal(a[0], a[-1])  # the shapes move
    # only the background and palette colours appear
    palette = {(0, 0, 0)} | set(COLOURS.values())
    assert {tuple(c) for c in a.reshape(-1, 3)} <= palette


def test_shards_reproducible_from_seed(tmp_path):
    spec = SyntheticSpec(size=32, fps=4, min_seconds=2, max_seconds=3, long_fraction=0.0)
    a = write_synthetic_shards(
        tmp_path / "a", 4, seed=7, spec=spec, samples_per_shard=2, progress=False
    )
    b = write_synthetic_shards(
        tmp_path / "b", 4, seed=7, spec=spec, samples_per_shard=2, progress=False
    )
    c = write_synthetic_shards(
        tmp_path / "c", 4, seed=8, spec=spec, samples_per_shard=2, progress=False
    )
    read = lambda p: open(p, "rb").read()  # noqa: E731
    assert [read(p) for p in a] == [read(p) for p in b]
    assert [read(p) for p in a] != [read(p) for p in c]


@pytest.mark.parametrize("index", range(6))
def test_needle_and_scenes_visible_at_one_fps(index):
    spec = SyntheticSpec(
        size=32, fps=8, min_seconds=3, max_seconds=8, long_fraction=0.0, needle_fraction=1.0
    )
    s = make_sample(11, index, spec)
    meta = s.meta
    qa = {q["question"]: q for q in meta["qa"]}
    needle = qa[NEEDLE_QUESTION]
    assert needle["answer"] in needle["choices"] and needle["choices"] == list(NEEDLE_CHOICES)
    clip = read_video(s.mp4(), fps=1.0)
    assert len(clip) == s.duration
    frames = clip.frames.numpy().astype(int)
    target = np.array(COLOURS[needle["answer"]])
    flat = np.abs(frames - target).max(axis=-1).mean(axis=(1, 2)) < 12  # a full-frame solid colour
    assert np.flatnonzero(flat).tolist() == [int(meta["needle"]["start"])]
    # every other second shows its scene's shape colour on black
    for t, frame in enumerate(frames):
        if flat[t]:
            continue
        seg = next(g for g in meta["segments"] if g["start"] <= t < g["end"])
        colour = np.array(COLOURS[seg["text"].split()[1]])
        assert (np.abs(frame - colour).max(-1) < 40).mean() > 0.02


def test_answer_sets_give_known_chance():
    spec = SyntheticSpec(long_fraction=0.0, needle_fraction=0.5)
    metas = [make_sample(0, i, spec).meta for i in range(200)]
    assert 60 < sum(m["task"] == "needle" for m in metas) < 140
    for m in metas:
        for q in m["qa"]:
            assert q["answer"] in q["choices"] and 2 <= len(q["choices"]) <= 4
    answers = [q["answer"] for m in metas for q in m["qa"] if q["question"] == NEEDLE_QUESTION]
    counts = np.array([answers.count(c) for c in NEEDLE_CHOICES])
    assert counts.min() > 0.5 * counts.mean()  # balanced, so chance is 1 / len(choices)


def test_long_videos_and_raw_reading(tmp_path):
    spec = SyntheticSpec(size=32, fps=4, long_fraction=1.0, long_seconds=30)
    (path,) = write_synthetic_shards(tmp_path, 1, seed=1, spec=spec, progress=False)
    stats = SkipStats()
    (sample,) = list(iter_raw_samples(path, stats))
    assert not stats and sample.meta["duration"] == 30.0  # nothing skipped
    assert len(read_video(sample.video, fps=1.0)) == 30


def test_extra_flashes_leave_the_rest_of_the_sample_unchanged():
    """flashes_per_minute paints one-second full-frame flashes (tokenizer training data) from a random
    stream of its own: the scenes, the needle, the QA and every other frame are those without them."""
    import dataclasses

    plain = SyntheticSpec(
        fps=2, min_seconds=90, max_seconds=90, long_fraction=0.0, needle_fraction=1.0
    )
    a = make_sample(4, 2, plain)
    b = make_sample(4, 2, dataclasses.replace(plain, flashes_per_minute=12))
    assert {k: v for k, v in b.meta.items() if k != "flashes"} == a.meta and len(b.flashes) > 5
    fa, fb = a.frames(), b.frames()
    changed = sorted({int(i) // 2 for i in np.nonzero((fa != fb).reshape(len(fa), -1).any(1))[0]})
    assert changed == sorted(t for t, _ in b.flashes)  # every flash second, nothing else
    for t, c in b.flashes:
        assert (fb[2 * t] == np.asarray(COLOURS[c], np.uint8)).all()
    assert (b.frames_at(np.arange(len(fb))) == fb).all()


def test_edge_needles_move_only_the_needle_to_the_first_or_last_second():
    """needle_edge_fraction puts that share of the needles on a video's first or last second, as
    often each, from a random stream of its own: the scenes and the needle's colour are unchanged,
    and the frames show the needle where its meta says."""
    import dataclasses

    plain = SyntheticSpec(
        fps=1, min_seconds=20, max_seconds=60, long_fraction=0.0, needle_fraction=1.0
    )
    edged = dataclasses.replace(plain, needle_edge_fraction=0.5)
    first = last = 0
    n = 400
    for i in range(n):
        a, b = make_sample(6, i, plain), make_sample(6, i, edged)
        assert (
            b.scenes == a.scenes
            and b.needle[1] == a.needle[1]
            and b.meta["qa"][0]["answer"] == a.meta["qa"][0]["answer"]
        )
        t = b.needle[0]
        assert b.meta["needle"]["start"] == t
        assert (b.frames(t, t + 1)[0] == np.asarray(COLOURS[b.needle[1]], np.uint8)).all()
        if b.needle != a.needle:
            assert t in (0, b.duration - 1)
        first += t == 0
        last += t == b.duration - 1
    # 0.5 * 0.5 of the needles on each edge, plus the uniform draws that land there (1/20-1/60)
    for k in (first, last):
        assert 0.2 * n <= k <= 0.34 * n, (first, last)
    assert (
        make_sample(6, 3, dataclasses.replace(plain, needle_edge_fraction=0.0)).meta
        == make_sample(6, 3, plain).meta
    )
    with pytest.raises(ValueError, match="needle_edge_fraction"):
        SyntheticSpec(needle_edge_fraction=1.5)


def test_no_flash_answer_leaves_the_videos_and_every_other_question_unchanged():
    """ask_no_flash asks the flash question of a video without a flash too, answered "none", and
    gives every flash question "none" among its choices; the videos (scenes, flashes, frames) and
    the other questions are those drawn without it, and a flashless video shows no flash colour."""
    import dataclasses

    from longvideo.data.questions import NO_FLASH

    plain = SyntheticSpec(
        fps=1, min_seconds=8, max_seconds=20, long_fraction=0.0, needle_fraction=0.5
    )
    absent = dataclasses.replace(plain, ask_no_flash=True)
    kinds = {True: 0, False: 0}
    for i in range(40):
        a, b = make_sample(3, i, plain), make_sample(3, i, absent)
        assert (b.scenes, b.needle, b.duration) == (a.scenes, a.needle, a.duration)
        needle_b = [x for x in b.meta["qa"] if x["type"] == "needle"]
        others_a = [x for x in a.meta["qa"] if x["type"] != "needle"]
        assert [x for x in b.meta["qa"] if x["type"] != "needle"] == others_a
        assert len(needle_b) == 1 and needle_b[0]["choices"] == [*NEEDLE_CHOICES, NO_FLASH]
        if a.needle is None:
            assert not [x for x in a.meta["qa"] if x["type"] == "needle"]
            assert needle_b[0]["answer"] == NO_FLASH
            frames = b.frames()
            for c in NEEDLE_CHOICES:  # no frame is one flat flash colour
                flat = (frames == np.asarray(COLOURS[c], np.uint8)).all(axis=(1, 2, 3))
                assert not flat.any()
        else:
            assert needle_b[0]["answer"] == a.needle[1] == b.meta["needle"]["colour"]
            assert (b.frames() == a.frames()).all()
        kinds[a.needle is None] += 1
    assert kinds[True] >= 8 and kinds[False] >= 8, kinds
