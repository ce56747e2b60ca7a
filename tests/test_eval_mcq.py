"""Multiple-choice benchmarks: the release layouts, both answer modes, the scores, resuming, bad inputs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_infer_chat import tiny_pretrained

from longvideo.checkpoint import save_project_checkpoint
from longvideo.data.synthetic import COLOUR_NAMES, SyntheticSpec, make_sample
from longvideo.infer import cli
from longvideo.infer.benchmarks import read_benchmark, read_subtitles, subtitles_at
from longvideo.infer.chat import ChatSession
from longvideo.infer.generation import Generation
from longvideo.infer.mcq import evaluate_mcq, option_ids, parse_letter, question_text

REPO = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"
NEEDLE = "What colour was the flash frame?"
LAST = "What colour was the last shape?"


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Each test here runs on one torch thread (conftest.one_thread)."""


@pytest.fixture(scope="module")
def pre():
    return tiny_pretrained(max_seq_len=512)


# ----------------------------------------------------------------------------- release layouts


def clips(n=3, seed=11):
    """Real mp4 encodes of synthetic scenes with a one-second flash (answers known)."""
    spec = SyntheticSpec(
        size=32, fps=4, min_seconds=4, max_seconds=5, long_fraction=0.0, needle_fraction=1.0
    )
    return [make_sample(seed, i, spec) for i in range(n)]


def facts(s):
    """(question, options, index of the answer) about one clip: the flash colour, the last colour."""
    return [
        (NEEDLE, list(COLOUR_NAMES), COLOUR_NAMES.index(s.needle[1])),
        (LAST, list(COLOUR_NAMES), COLOUR_NAMES.index(s.scenes[-1][2].colour)),
    ]


def write_videomme(root: Path, samples):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for i, s in enumerate(samples):
        vid = f"yt{i:03d}abcXY"
        (root / "data").mkdir(parents=True, exist_ok=True)
        (root / "data" / f"{vid}.mp4").write_bytes(s.mp4())
        (root / "subtitle").mkdir(exist_ok=True)
        (root / "subtitle" / f"{vid}.srt").write_text(
            f'1\n00:00:00,000 --> 00:00:01,500\n<font color="white" size=".72c">hello {i}</font>\n\n'
            f'2\n00:00:02,000 --> 00:00:03,000\n<font color="white" size=".72c">the end</font>\n\n'
        )
        for k, (q, opts, a) in enumerate(facts(s)):
            rows.append(
                {
                    "video_id": f"{i + 1:03d}",
                    "duration": ("short", "medium")[i % 2],
                    "domain": "Knowledge",
                    "sub_category": "Astronomy",
                    "url": f"https://www.youtube.com/watch?v={vid}",
                    "videoID": vid,
                    "question_id": f"{i + 1:03d}-{k + 1}",
                    "task_type": ("Attribute Perception", "Counting Problem")[k],
                    "question": q,
                    "options": [f"{'ABCD'[j]}. {o}" for j, o in enumerate(opts)],
                    "answer": "ABCD"[a],
                }
            )
    rows.append(dict(rows[0], question_id="001-9", options=["A. red", "C. blue"]))  # malformed
    schema = pa.schema(
        [(k, pa.list_(pa.string()) if k == "options" else pa.string()) for k in rows[0]]
    )
    (root / "videomme").mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.Table.from_pylist(rows, schema=schema), root / "videomme" / "test-00000-of-00001.parquet"
    )
    return [r for r in rows[:-1]]


def write_mlvu(root: Path, samples):
    (root / "json").mkdir(parents=True)
    (root / "video" / "2_needle").mkdir(parents=True)
    entries = []
    for i, s in enumerate(samples):
        (root / "video" / "2_needle" / f"needle_{i}.mp4").write_bytes(s.mp4())
        for q, opts, a in facts(s):
            entries.append(
                {
                    "video": f"needle_{i}.mp4",
                    "duration": s.duration,
                    "question": q,
                    "candidates": opts,
                    "answer": opts[a],
                    "question_type": "findNeedle",
                }
            )
    entries.append(dict(entries[0], answer="purple"))  # an answer that is no candidate
    (root / "json" / "2_needle.json").write_text(json.dumps(entries, indent=4))
    (root / "json" / "8_sub_scene.json").write_text(
        json.dumps(
            [
                {
                    "video": "subPlot_1.mp4",
                    "duration": 4,
                    "question": "Describe it.",
                    "answer": "a text",
                    "question_type": "subPlot",
                    "scoring_points": [],
                }
            ]
        )
    )
    return entries[:-1]


def write_longvideobench(root: Path, samples):
    (root / "videos").mkdir(parents=True)
    (root / "subtitles").mkdir()
    rows = []
    for i, s in enumerate(samples):
        (root / "videos" / f"clip{i}.mp4").write_bytes(s.mp4())
        subs = (
            [{"start": "00:00:10.000", "end": "00:00:11.500", "line": f"line {i}"}]
            if i % 2
            else [
                {"timestamp": [10.0, 11.5], "text": f"line {i}"},
                {"timestamp": [12.0, None], "text": "last"},
            ]
        )
        (root / "subtitles" / f"clip{i}_en.json").write_text(json.dumps(subs))
        for k, (q, opts, a) in enumerate(facts(s)):
            rows.append(
                {
                    "video_id": f"clip{i}",
                    "question": q,
                    "question_wo_referring_query": q,
                    "candidates": opts,
                    "correct_choice": a,
                    "position": [1],
                    "topic_category": "KS-Knowledge-STEM",
                    "question_category": ("S2A", "T3O")[k],
                    "level": "L1-Perception",
                    "id": f"clip{i}_{k}",
                    "video_path": f"clip{i}.mp4",
                    "subtitle_path": f"clip{i}_en.json",
                    "duration_group": 15,
                    "starting_timestamp_for_subtitles": 10.0,
                    "duration": float(s.duration),
                    "view_count": 7,
                }
            )
    rows.append(dict(rows[0], id="bad", candidates="red"))  # a string, not a list
    (root / "lvb_val.json").write_text(json.dumps(rows))
    return rows[:-1]


def write_egoschema(root: Path, samples):
    (root / "videos").mkdir(parents=True)
    rows, answers = [], {}
    for i, s in enumerate(samples):
        uid = f"{i:08x}-c59e-49cb-a127-6081e2fb8c8e"
        (root / "videos" / f"{uid}.mp4").write_bytes(s.mp4())
        q, opts, a = facts(s)[0]
        rows.append(
            {
                "q_uid": uid,
                "google_drive_id": f"drive{i}",
                "question": q,
                **{f"option {j}": o for j, o in enumerate(opts + ["none of them"])},
            }
        )
        if i < len(samples) - 1:  # the last one's answer is not published
            answers[uid] = a
    (root / "questions.json").write_text(json.dumps(rows))
    (root / "subset_answers.json").write_text(json.dumps(answers))
    return [r for r in rows if r["q_uid"] in answers]


def write_lvbench(root: Path, samples):
    (root / "videos").mkdir(parents=True)
    lines = []
    for i, s in enumerate(samples):
        key = f"key{i}XYZ"
        (root / "videos" / f"{key}.mp4").write_bytes(s.mp4())
        qa = [
            {
                "uid": 100 * i + k,
                "question": q + "".join(f"\n({'ABCD'[j]}) {o}" for j, o in enumerate(opts)),
                "answer": "ABCD"[a],
                "question_type": ["key information retrieval", "entity recognition"][: k + 1],
                "time_reference": "00:01-00:02",
            }
            for k, (q, opts, a) in enumerate(facts(s))
        ]
        lines.append(
            {
                "key": key,
                "type": "cartoon",
                "video_info": {"duration_minutes": s.duration / 60, "fps": 4.0},
                "qa": qa,
            }
        )
    lines[0]["qa"].append(
        {
            "uid": 999,
            "question": "Odd?\n(B) x\n(A) y",
            "answer": "A",
            "question_type": ["reasoning"],
        }
    )
    (root / "video_info.meta.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return [qa for x in lines for qa in x["qa"][:2]]


def write_generic(root: Path, samples, *, broken=True, letters=True):
    """The documented generic JSONL (answers as letters and as indices, or indices only); with
    `broken`, plus a missing video, an unreadable one and malformed options (each must be counted,
    not crash the run)."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, s in enumerate(samples):
        (root / f"v{i}.mp4").write_bytes(s.mp4())
        for k, (q, opts, a) in enumerate(facts(s)):
            rows.append(
                {
                    "question_id": f"v{i}-{k}",
                    "video": f"v{i}.mp4",
                    "question": q,
                    "options": opts,
                    "answer": "ABCD"[a] if letters and not k else a,
                    "groups": {"kind": ("flash", "last")[k]},
                }
            )
    if broken:
        (root / "broken.mp4").write_bytes(samples[0].mp4()[:300])
        rows += [
            {
                "question_id": "gone",
                "video": "nowhere.mp4",
                "question": NEEDLE,
                "options": ["a", "b"],
                "answer": "A",
            },
            {
                "question_id": "torn",
                "video": "broken.mp4",
                "question": NEEDLE,
                "options": ["a", "b"],
                "answer": "B",
            },
            {
                "question_id": "one-option",
                "video": "v0.mp4",
                "question": NEEDLE,
                "options": ["red"],
                "answer": "A",
            },
        ]
    (root / "questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


WRITERS = {
    "videomme": write_videomme,
    "mlvu": write_mlvu,
    "longvideobench": write_longvideobench,
    "egoschema": write_egoschema,
    "lvbench": write_lvbench,
    "generic": write_generic,
}


@pytest.fixture(scope="module")
def samples():
    return clips()


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_readers_read_each_release_layout(name, samples, tmp_path):
    rows = WRITERS[name](tmp_path, samples)
    qs = read_benchmark(name, tmp_path)
    good, bad = [q for q in qs if not q.problem], [q for q in qs if q.problem]
    assert len(bad) == {"egoschema": 0}.get(name, 1) and all(q.qid and q.problem for q in bad)
    assert all(Path(q.video).is_file() for q in good if q.qid not in ("gone", "torn"))
    expect = {
        "videomme": lambda r: (r["question_id"], r["question"], r["answer"]),
        "mlvu": lambda r: (None, r["question"], "ABCD"[r["candidates"].index(r["answer"])]),
        "longvideobench": lambda r: (r["id"], r["question"], "ABCD"[r["correct_choice"]]),
        "egoschema": lambda r: (r["q_uid"], r["question"], None),
        "lvbench": lambda r: (str(r["uid"]), r["question"].split("\n")[0], r["answer"]),
        "generic": lambda r: (r["question_id"], r["question"], None),
    }[name]
    want = [expect(r) for r in rows if r.get("question_id") != "one-option"]
    assert [
        (q.qid if w[0] else None, q.question, q.answer if w[2] else None)
        for q, w in zip(good, want)
    ] == want
    assert len(good) == len(want)
    flash = [q for q in good if q.question == NEEDLE and q.qid not in ("gone", "torn")]
    assert flash and all(
        q.options[:4] == COLOUR_NAMES for q in flash
    )  # letters and periods taken off
    assert [q.answer for q in flash] == ["ABCD"[COLOUR_NAMES.index(s.needle[1])] for s in samples][
        : len(flash)
    ]
    groups = {
        "videomme": {"duration", "domain", "task_type"},
        "mlvu": {"task"},
        "longvideobench": {"duration_group", "question_category"},
        "egoschema": set(),
        "lvbench": {"question_type", "type"},
        "generic": {"kind"},
    }[name]
    assert all(set(q.groups) == groups for q in good if q.qid not in ("gone", "torn"))
    if name in ("videomme", "longvideobench"):
        assert all(Path(q.subtitles).is_file() for q in good)


def test_subtitles_at_the_sampled_frames(tmp_path, samples):
    write_videomme(tmp_path / "vm", samples[:1])
    lines = read_subtitles(tmp_path / "vm" / "subtitle" / "yt000abcXY.srt")
    assert lines == [(0.0, 1.5, "hello 0"), (2.0, 3.0, "the end")]  # the <font> markup removed
    assert subtitles_at(lines, [0.0, 1.0]) == "hello 0" and subtitles_at(lines, [1.6, 3.5]) == ""
    write_longvideobench(tmp_path / "lvb", samples[:2])
    shifted = read_subtitles(tmp_path / "lvb" / "subtitles" / "clip1_en.json", offset=10.0)
    assert shifted == [(0.0, 1.5, "line 1")]
    open_end = read_subtitles(tmp_path / "lvb" / "subtitles" / "clip0_en.json", offset=10.0)
    assert open_end[1][:2] == (2.0, float("inf")) and subtitles_at(open_end, [3.0]) == "last"


def test_letters_are_parsed_from_answers():
    opts = ("red", "green", "blue", "yellow")
    for text, want in [
        ("B", "B"),
        (" (C) blue", "C"),
        ("D. yellow", "D"),
        ("blue.", "C"),
        ("Green", "B"),
        ("The answer is A", "A"),
        ("purple", None),
        ("E", None),
        ("", None),
        ("Because", None),
    ]:
        assert parse_letter(text, opts) == want, text


# ----------------------------------------------------------------------------- scoring


def reference_logprob(pre, session, question, cont):
    """Independent: the whole prompt plus the continuation in one forward, no cache, float64 softmax."""
    ids = session.prompt(question).ids
    with torch.no_grad():
        logits = pre.model.logits(pre.model(torch.tensor([ids + cont])))[0].double()
    logp = torch.log_softmax(logits[len(ids) - 1 : -1], -1)
    target = torch.tensor(cont)
    return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


def test_likelihood_scores_equal_a_full_forward(pre, samples, tmp_path):
    (tmp_path / "c.mp4").write_bytes(samples[0].mp4())
    session = ChatSession.from_video(pre, str(tmp_path / "c.mp4"), progress=False)
    conts = [option_ids(pre.tokenizer, o) for o in ("red", "green blue yellow", "a")]
    assert len(conts[1]) > 1
    for _ in range(2):  # a second call reuses the video's cache
        got = session.score(NEEDLE, conts)
        for cont, (s, n, greedy) in zip(conts, got):
            want, want_greedy = reference_logprob(pre, session, NEEDLE, cont)
            assert s == pytest.approx(want, abs=1e-4) and n == len(cont) and greedy == want_greedy
        session.ask(LAST)
    assert session.score(LAST, conts[:1])[0][0] == pytest.approx(
        reference_logprob(pre, session, LAST, conts[0])[0], abs=1e-4
    )


def recompute(records):
    """An independent recomputation of summary.json from predictions.jsonl (loops, no numpy help)."""

    def acc_ci(rs):
        videos = sorted({r["video"] for r in rs})
        per = {v: [r["prediction"] == r["answer"] for r in rs if r["video"] == v] for v in videos}
        draws = np.random.default_rng(0).integers(0, len(videos), (1000, len(videos)))
        accs = [
            sum(sum(per[videos[j]]) for j in d) / sum(len(per[videos[j]]) for j in d) for d in draws
        ]
        return sum(r["prediction"] == r["answer"] for r in rs) / len(rs), list(
            np.percentile(accs, [2.5, 97.5])
        )

    out = {"all": acc_ci(records)}
    for r in records:
        for name, lab in r["groups"].items():
            for x in lab if isinstance(lab, list) else [lab]:
                out.setdefault((name, str(x)), [])
                out[(name, str(x))].append(r)
    return {k: (v if k == "all" else acc_ci(v)) for k, v in out.items()}


def check_summary(out: Path):
    records = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    ref = recompute(records)
    assert summary["accuracy"] == pytest.approx(ref["all"][0]) and summary["questions"] == len(
        records
    )
    assert summary["ci95"] == pytest.approx(ref["all"][1])
    for (name, label), (acc, ci) in ((k, v) for k, v in ref.items() if k != "all"):
        got = summary["breakdowns"][name]["labels"][label]
        assert got["accuracy"] == pytest.approx(acc) and got["ci95"] == pytest.approx(ci)
    assert summary["chance"] == pytest.approx(np.mean([1 / r["options"] for r in records]))
    assert (out / "summary.png").read_bytes()[:8] == PNG
    return summary, records


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_every_format_end_to_end_in_likelihood_mode(name, pre, samples, tmp_path):
    """Every question of every layout answered once, each prediction the option of best mean log-likelihood."""
    rows = WRITERS[name](tmp_path / "data", samples[:2])
    res = evaluate_mcq(
        pre, name, tmp_path / "data", tmp_path / "out", progress=False, subtitles=True
    )
    summary, records = check_summary(tmp_path / "out")
    good = [
        q
        for q in read_benchmark(name, tmp_path / "data")
        if not q.problem and q.qid not in ("gone", "torn")
    ]
    assert sorted(r["question_id"] for r in records) == sorted(q.qid for q in good) and rows
    options = {q.qid: q.options for q in good}
    for r in records:  # the best log-likelihood per character of the option's text
        assert r["prediction"] == "ABCDE"[int(np.argmax(r["scores"]))]
        assert r["scores"] == pytest.approx(
            [s / len(o) for s, o in zip(r["logprobs"], options[r["question_id"]])]
        )
    assert res["accuracy"] == summary["accuracy"] and res["videos_encoded"] == len(
        {q.video for q in good}
    )


def test_generate_mode_parses_letters_and_counts_unparseable(pre, samples, tmp_path):
    class Says:
        """An engine that answers each prompt with a fixed text (tests the harness, not a model)."""

        def __init__(self, tok, texts):
            self.tok, self.texts, self.n, self.prefix_len, self.prefix_s = tok, texts, 0, 0, 0.0

        def set_prefix(self, ids):
            self.prefix_len = ids.shape[1]

        def generate(self, ids, *, max_new_tokens, **kw):
            text = self.texts[self.n % len(self.texts)]
            self.n += 1
            return Generation(
                tokens=torch.tensor([self.tok.encode(text) + [self.tok.eos_id]]),
                prompt_len=0,
                ttft_s=0.0,
                total_s=0.0,
            )

    write_generic(tmp_path / "data", samples, broken=False)
    res = evaluate_mcq(
        pre,
        "generic",
        tmp_path / "data",
        tmp_path / "out",
        mode="generate",
        progress=False,
        engine_factory=lambda p: Says(p.tokenizer, [" (B) green", " I do not know"]),
    )
    summary, records = check_summary(tmp_path / "out")
    assert [r["prediction"] for r in records] == ["B", None] * len(samples)
    assert res["unparseable"] == len(samples)
    assert [r["correct"] for r in records] == [
        r["answer"] == "B" and i % 2 == 0 for i, r in enumerate(records)
    ]
    # the prompt carries the lettered options and the instruction
    q = read_benchmark("generic", tmp_path / "data")[0]
    assert (
        question_text(q, "generate").endswith(
            "(D) yellow\nAnswer with the option's letter from the given choices directly."
        )
        and question_text(q, "likelihood") == NEEDLE
    )


def test_generate_mode_on_a_real_tiny_model_answers_like_chat(pre, samples, tmp_path):
    write_generic(tmp_path / "data", samples[:1], broken=False)
    evaluate_mcq(
        pre,
        "generic",
        tmp_path / "data",
        tmp_path / "out",
        mode="generate",
        max_new_tokens=4,
        progress=False,
    )
    records = [
        json.loads(x) for x in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()
    ]
    session = ChatSession.from_video(
        pre,
        str(tmp_path / "data" / "v0.mp4"),
        progress=False,
        infer=pre.config.infer.__class__(max_new_tokens=4),
    )
    qs = read_benchmark("generic", tmp_path / "data")
    assert [r["response"] for r in records] == [
        session.ask(question_text(q, "generate")) for q in qs
    ]


def test_bad_inputs_are_skipped_and_counted_by_name(pre, samples, tmp_path, monkeypatch):
    write_generic(tmp_path / "data", samples[:2])
    from longvideo.infer import mcq

    calls = []
    real = mcq.encode_video_file
    monkeypatch.setattr(
        mcq, "encode_video_file", lambda *a, **k: calls.append(a[1]) or real(*a, **k)
    )
    res = evaluate_mcq(pre, "generic", tmp_path / "data", tmp_path / "out", progress=False)
    assert sorted(Path(c).name for c in calls) == ["broken.mp4", "v0.mp4", "v1.mp4"]  # once a video
    skipped = {k: [x["question_id"] for x in v["questions"]] for k, v in res["skipped"].items()}
    assert skipped == {
        "missing_video": ["gone"],
        "unreadable_video": ["torn"],
        "malformed_options": ["one-option"],
    }
    assert (
        res["questions"] == 4
        and json.loads((tmp_path / "out" / "summary.json").read_text())["skipped"] == res["skipped"]
    )


def test_a_resumed_run_asks_only_the_rest_and_refuses_other_settings(pre, samples, tmp_path):
    write_generic(tmp_path / "data", samples, broken=False)
    full = tmp_path / "full"
    evaluate_mcq(pre, "generic", tmp_path / "data", full, progress=False)
    lines = (full / "predictions.jsonl").read_bytes().splitlines(keepends=True)
    part = tmp_path / "part"
    part.mkdir()
    (part / "run.json").write_bytes((full / "run.json").read_bytes())
    (part / "predictions.jsonl").write_bytes(
        b"".join(lines[:3]) + lines[3][:17]
    )  # killed inside a line
    asked = []
    real = ChatSession.score

    def counting(self, question, conts):
        asked.append(question)
        return real(self, question, conts)

    ChatSession.score = counting
    try:
        evaluate_mcq(pre, "generic", tmp_path / "data", part, progress=False)
    finally:
        ChatSession.score = real
    assert len(asked) == len(lines) - 3
    assert (part / "predictions.jsonl").read_bytes() == b"".join(lines)
    with pytest.raises(ValueError, match="mode='likelihood', this one has mode='generate'"):
        evaluate_mcq(pre, "generic", tmp_path / "data", part, mode="generate", progress=False)


def test_the_cli_continues_a_run_killed_mid_way(pre, samples, tmp_path):
    ckpt = save_project_checkpoint(
        tmp_path / "ckpt", pre.model.state_dict(), pre.config, tokenizer=pre.tokenizer, vq=pre.vq
    )
    write_generic(tmp_path / "data", clips(8, seed=5), broken=False)
    args = [
        "mcq",
        "--benchmark",
        "generic",
        "--data",
        str(tmp_path / "data"),
        "--model",
        str(ckpt),
        "--quiet",
    ]
    preds = tmp_path / "out" / "predictions.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "longvideo", "eval", *args, "--out", str(tmp_path / "out")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while time.time() < deadline and (not preds.is_file() or not preds.read_bytes().count(b"\n")):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = preds.read_bytes().count(b"\n")
    assert 0 < first < 16  # killed mid-way
    assert cli.eval_main([*args, "--out", str(tmp_path / "out")]) == 0
    assert cli.eval_main([*args, "--out", str(tmp_path / "whole")]) == 0
    got = [json.loads(x) for x in preds.read_text().splitlines()]
    want = [
        json.loads(x) for x in (tmp_path / "whole" / "predictions.jsonl").read_text().splitlines()
    ]
    assert sorted(r["question_id"] for r in got) == sorted(
        r["question_id"] for r in want
    )  # each once
    key = lambda r: r["question_id"]  # noqa: E731
    for a, b in zip(sorted(got, key=key), sorted(want, key=key)):
        assert a["prediction"] == b["prediction"] and a["scores"] == pytest.approx(
            b["scores"], abs=1e-5
        )


def _sequence_parallel_body(rank, world, data, out, reference):
    import torch.distributed as dist

    from longvideo.infer.sp import SequenceParallelEngine

    pre = tiny_pretrained(max_seq_len=512)
    for mode in ("likelihood", "generate"):
        evaluate_mcq(
            pre,
            "generic",
            data,
            f"{out}/{mode}",
            mode=mode,
            max_new_tokens=4,
            progress=False,
            engine_factory=lambda p: SequenceParallelEngine(p.model, backend="torch"),
            group=dist.group.WORLD,
        )
        if rank == 0:
            got = [
                json.loads(x)
                for x in Path(f"{out}/{mode}/predictions.jsonl").read_text().splitlines()
            ]
            want = reference[mode]
            assert [r["question_id"] for r in got] == [r["question_id"] for r in want]
            for a, b in zip(got, want):
                assert a["prediction"] == b["prediction"] and a.get("response") == b.get("response")
                if mode == "likelihood":
                    assert a["scores"] == pytest.approx(b["scores"], abs=1e-4)


@pytest.mark.distributed
def test_sequence_parallel_prefill_gives_the_single_process_answers(pre, samples, tmp_path):
    """On 2 gloo ranks (rank 0 encodes, ring prefill, merged attention for the questions and the
    options) every question gets the single process's prediction and scores, in both modes."""
    from distributed import run_ranks

    write_generic(tmp_path / "data", samples[:2])
    reference = {}
    for mode in ("likelihood", "generate"):
        evaluate_mcq(
            pre,
            "generic",
            tmp_path / "data",
            tmp_path / "one" / mode,
            mode=mode,
            max_new_tokens=4,
            progress=False,
        )
        reference[mode] = [
            json.loads(x)
            for x in (tmp_path / "one" / mode / "predictions.jsonl").read_text().splitlines()
        ]
    run_ranks(
        _sequence_parallel_body,
        world=2,
        args=(str(tmp_path / "data"), str(tmp_path / "sp"), reference),
        timeout=300,
    )


def _refused_resume_body(rank, world, data, out):
    import torch.distributed as dist

    from longvideo.distributed import RankFailedError

    pre = tiny_pretrained(max_seq_len=512)
    t0 = time.time()
    with pytest.raises(ValueError if rank == 0 else RankFailedError) as e:
        evaluate_mcq(
            pre, "generic", data, out, mode="generate", progress=False, group=dist.group.WORLD
        )
    assert "continue it with the same settings" in str(e.value) and time.time() - t0 < 60


@pytest.mark.distributed
def test_a_resume_refused_on_rank_0_stops_every_rank(samples, tmp_path):
    """Rank 0 alone reads OUT/run.json; when it refuses to continue a run of other settings, the
    other ranks raise too instead of waiting for rank 0's list of questions."""
    from distributed import run_ranks

    write_generic(tmp_path / "data", samples[:1])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "run.json").write_text(json.dumps({"benchmark": "generic"}))
    run_ranks(
        _refused_resume_body,
        world=2,
        args=(str(tmp_path / "data"), str(tmp_path / "out")),
        timeout=120,
    )


# ----------------------------------------------------------------------------- the visual needle on the user's media


def test_video_needle_on_a_user_haystack_and_needle_image_writes_what_it_inserted(
    pre, tmp_path, capsys
):
    """Any haystack video and needle image: each cell's prompt holds exactly the codes of the
    haystack's window (read at 1 fps) with the written needle PNG at its depth."""
    from material.photo_videos import pan_zoom_video
    from PIL import Image

    from longvideo.data.synthetic import write_mp4
    from longvideo.data.video import read_video
    from longvideo.infer.evals import evaluate_video_needle
    from longvideo.vq import encode_video

    photo = np.asarray(Image.new("RGB", (96, 80), (30, 90, 160)))
    photo = photo.copy()
    photo[::7] = 250  # stripes: some texture to pan over
    write_mp4(
        pan_zoom_video(photo, 24, size=32, seed=3), 2.0, tmp_path / "hay.mp4"
    )  # 12 s: 12 frames at 1 fps
    needle = np.zeros((40, 40, 3), np.uint8)
    needle[:, :20] = (250, 200, 0)
    Image.fromarray(needle).save(tmp_path / "needle.png")
    prompts = []

    class Recording:
        def __init__(self, tok):
            self.tok, self.prefix_len, self.prefix_s = tok, 0, 0.0

        def set_prefix(self, ids):
            prompts.append(ids[0].tolist())

        def generate(self, ids, **kw):
            return Generation(
                tokens=torch.tensor([self.tok.encode(" a flag") + [self.tok.eos_id]]),
                prompt_len=0,
                ttft_s=0.0,
                total_s=0.0,
            )

    res = evaluate_video_needle(
        pre,
        lengths=(5, 9),
        depths=(0.0, 1.0),
        trials=2,
        haystack=tmp_path / "hay.mp4",
        needle=tmp_path / "needle.png",
        question="What was on the inserted frame?",
        answer="a flag",
        out_dir=tmp_path / "out",
        progress=False,
        engine_factory=lambda p: Recording(p.tokenizer),
    )
    assert res["accuracy"] == 1.0 and res["haystack_frames"] == 12 and len(res["cells"]) == 8
    inserted = torch.from_numpy(np.array(Image.open(res["needle_frames"]["a flag"])))
    hay = read_video(str(tmp_path / "hay.mp4"), fps=1.0, size=pre.vq.cfg.resolution).frames
    vocab = pre.model.cfg.vocab
    for ids, cell in zip(prompts, res["cells"]):
        frames = hay[cell["window_start"] : cell["window_start"] + cell["frames"]].clone()
        frames[cell["needle_frame"]] = inserted
        want = encode_video(pre.vq, frames).reshape(-1).tolist()
        assert [t - vocab.vq_offset for t in ids if vocab.vq_offset <= t < vocab.size] == want
    assert {c["window_start"] for c in res["cells"] if c["frames"] == 5} == {
        0,
        7,
    }  # windows spread over it
    saved = json.loads((tmp_path / "out" / "video_needle.json").read_text())
    assert (
        saved["question"] == "What was on the inserted frame?"
        and (tmp_path / "out" / "video_needle.png").is_file()
    )
    with pytest.raises(ValueError, match="question and answer"):
        evaluate_video_needle(pre, lengths=(5,), needle=tmp_path / "needle.png", progress=False)
    with pytest.raises(ValueError, match="12 frames at 1 fps"):
        evaluate_video_needle(pre, lengths=(13,), haystack=tmp_path / "hay.mp4", progress=False)
    # the CLI: the user's haystack with the colour flashes, then with the needle image
    ckpt = save_project_checkpoint(
        tmp_path / "ckpt", pre.model.state_dict(), pre.config, tokenizer=pre.tokenizer, vq=pre.vq
    )
    base = [
        "video-niah",
        "--model",
        str(ckpt),
        "--lengths",
        "4",
        "--depths",
        "0.5",
        "--haystack",
        str(tmp_path / "hay.mp4"),
        "--max-new-tokens",
        "2",
        "--quiet",
    ]
    assert cli.eval_main(base + ["--out", str(tmp_path / "cli1"), "--colours", "red,blue"]) == 0
    assert sorted(p.name for p in (tmp_path / "cli1" / "video_needle_frames").iterdir()) == [
        "needle_0.png",
        "needle_1.png",
    ]
    assert (
        cli.eval_main(
            base
            + [
                "--out",
                str(tmp_path / "cli2"),
                "--needle",
                str(tmp_path / "needle.png"),
                "--question",
                "What was it?",
                "--answer",
                "a flag",
            ]
        )
        == 0
    )
    assert "over 4 needles" in capsys.readouterr().out
