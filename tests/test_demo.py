"""The CI-sized demo: every stage of `make demo` runs through the real commands and leaves its
artefacts (shards, tokenizer, VQ, token shards, LM checkpoints, export, evaluations, chat)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(2400)  # 6.5 minutes on an idle 2-core machine; much longer when it is shared
def test_quick_demo_produces_every_artefact(tmp_path):
    out = tmp_path / "demo"
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    r = subprocess.run(
        [sys.executable, "-m", "longvideo.demo", "--quick", "--quiet", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=2300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    assert len(list((out / "data/train").glob("shard-*.tar"))) == 2
    assert (out / "tokenizer/tokenizer.json").is_file()
    assert (out / "vq/model.safetensors").is_file() and (out / "vq/config.json").is_file()
    assert list((out / "tokens/train").glob("*.tar")) and list((out / "tokens/test").glob("*.tar"))
    final = Path((out / "lm/final").read_text().strip())
    assert (final / "checkpoints/latest").is_file()
    latest = final / "checkpoints" / (final / "checkpoints/latest").read_text().strip()
    assert (latest / "model.safetensors").is_file()
    for stage in sorted((out / "lm").glob("stage*")):
        assert (stage / "loss.png").is_file(), stage
        losses = [
            json.loads(ln)["loss"]
            for ln in (stage / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in ln
        ]
        assert losses and all(l == l for l in losses)  # recorded, no NaN
    first = sorted((out / "lm").glob("stage*"))[0]
    losses = [
        json.loads(ln)["loss"]
        for ln in (first / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in ln
    ]
    assert min(losses[-5:]) < losses[0], losses  # the first stage learns

    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "processor_config.json",
        "vq/model.safetensors",
    ):
        assert (out / "hf" / f).is_file(), f
    qa = json.loads((out / "eval/qa/qa.json").read_text())
    needle = json.loads((out / "eval/video_niah/video_needle.json").read_text())
    for res in (qa, needle):
        assert 0.0 <= res["accuracy"] <= 1.0 and 0.0 < res["chance"] < 1.0
    # the model learnt something about videos it never saw: its answers beat guessing
    assert qa["accuracy"] > qa["chance"], {q: r["accuracy"] for q, r in qa["per_question"].items()}
    assert (out / "eval/qa/qa.png").is_file() and (
        out / "eval/video_niah/video_needle.png"
    ).is_file()
    chat = json.loads((out / "chat.json").read_text())
    assert chat["question"] and "answer" in chat
    summary = json.loads((out / "summary.json").read_text())
    assert summary["qa"]["chance"] == pytest.approx(qa["chance"])
    # text to video: the rung's checkpoint, videos generated from every held-out caption, read
    t2v_run = Path((out / "lm/t2v").read_text().strip())
    assert (t2v_run / "checkpoints/latest").is_file() and (t2v_run / "loss.png").is_file()
    t2v = json.loads((out / "eval/t2v/t2v.json").read_text())
    assert t2v["n"] == 8 and 0 <= t2v["accuracy"] <= 1 and 0 < t2v["chance"] < 1
    assert all(1 <= len(s["read"]) <= 4 for s in t2v["samples"])
    assert t2v["probe_on_real"]["frames"] > 0 and (out / "eval/t2v/t2v.png").is_file()
    assert summary["t2v"]["accuracy"] == pytest.approx(t2v["accuracy"])
    assert "text to video, colours in order" in r.stdout
    assert "held-out QA accuracy" in r.stdout and "chance" in r.stdout


def test_finished_step_reads_the_latest_complete_checkpoint(tmp_path):
    """A ladder stage counts as done only when its latest checkpoint reached the stage's last step;
    one stopped part-way (SIGTERM) is resumed, not skipped."""
    from longvideo.demo import finished_step
    from longvideo.train.run_state import STATE_FILE

    run = tmp_path / "stage0"
    assert finished_step(run) == 0
    ckpts = run / "checkpoints"
    for step in (40, 80):
        (ckpts / f"step_{step:06d}").mkdir(parents=True)
        (ckpts / f"step_{step:06d}" / STATE_FILE).write_text(json.dumps({"step": step}))
    (ckpts / "latest").write_text("step_000040\n")
    assert finished_step(run) == 40
    (ckpts / "latest").write_text("step_000080\n")
    assert finished_step(run) == 80


def test_hour_plan_fits_an_hour_in_its_last_stage():
    """The hour demo's plan: its longest videos fit the last rung of its ladder, which runs on the
    ring (sp = 2) with a raised RoPE theta; its configs exist and agree on the tokenizer's shape."""
    from longvideo.config import load_config
    from longvideo.demo import load_plan
    from longvideo.vq import load_vq_config

    HOUR = load_plan("demos/demo-hour")

    vq, root = load_vq_config(HOUR.vq_config), load_config(HOUR.lm_config)
    assert (vq.mode, vq.latent_size, vq.temporal_downsample, vq.codebook_size) == (
        root.vq.mode,
        root.vq.latent_size,
        root.vq.temporal_downsample,
        root.vq.codebook_size,
    )
    longest = max(v.max_seconds for v in HOUR.sets)
    groups = vq.num_groups(longest)  # 1 fps
    stamps = (
        -(-groups // root.data.timestamp_every) * 8
    )  # "[3599.0s]" and its neighbours: at most 8 ids each
    tokens = (
        groups * (vq.codes_per_frame + 1) + 2 + stamps + 32
    )  # + <vision> </vision> + the QA text
    last = HOUR.ladder[-1]
    assert longest == 3600 and tokens <= 20_000 and tokens <= last["seq_len"] and last["sp"] == 2, (
        tokens,
        last,
    )
    assert (
        load_config(HOUR.stages[-1].config).data.seq_len == last["seq_len"]
    )  # the stage config is the source
    assert [r["rope_theta"] for r in HOUR.ladder] == sorted(r["rope_theta"] for r in HOUR.ladder)
    assert max(HOUR.needle_lengths) == 3600 and HOUR.eval_sp == 2
    assert all(n >= 20 for T, n in zip(HOUR.needle_lengths, HOUR.needle_trials) if T <= 900)
    assert all(n >= 8 for n in HOUR.needle_trials)
    # the ring rungs shard the parameters too; the rungs without a ring shard gradients and optimizer
    # state only (what the stage configs say reaches the plan)
    assert [r["zero_stage"] for r in HOUR.ladder] == [3 if r["sp"] > 1 else 2 for r in HOUR.ladder]
    assert [load_config(s.config).train.zero_stage for s in HOUR.stages] == [
        r["zero_stage"] for r in HOUR.ladder
    ]


def test_the_hour_recipe_table_is_the_plans_ladder():
    """docs/hour.md's recipe table states each rung of `make demo-hour` as its configs resolve it:
    stage config, context, ring size, RoPE theta, steps and the lengths of the videos it reads."""
    import re

    from longvideo.demo import load_plan

    HOUR = load_plan("demos/demo-hour")
    sets = {v.name: v for v in HOUR.sets}
    text = (ROOT / "docs/hour.md").read_text()
    table = text[text.index("| rung | config |") :].split("\n\n")[0].splitlines()[2:]
    assert len(table) == len(HOUR.stages)
    for i, (row, st, rung) in enumerate(zip(table, HOUR.stages, HOUR.ladder)):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == str(i) and cells[1] == f"`{st.config}.yaml`", row
        assert int(cells[2].replace(",", "")) == rung["seq_len"], row
        assert int(re.search(r"sp = (\d+)", cells[3]).group(1)) == rung["sp"], row
        assert float(cells[4]) == rung["rope_theta"], row
        assert int(cells[5].replace(",", "")) == rung["steps"], row
        lo, hi, unit = re.fullmatch(r"(\d+)-(\d+) (seconds|minutes)", cells[6]).groups()
        scale = 60 if unit == "minutes" else 1
        read = [sets[name] for name in st.sets]
        assert int(lo) * scale == min(v.min_seconds for v in read), row
        assert int(hi) * scale == max(v.max_seconds for v in read), row


def test_hour_questions_plan_asks_every_type_and_holds_out_every_length():
    """The hour plan with questions: every set its ladder trains on carries 1-3 flashes and every
    question type; the held-out set has videos of each length the QA evaluation scores apart, from
    a seed no training set uses; its shapes are drawn larger (docs/hour.md)."""
    from longvideo.data.questions import HOUR_QUESTIONS
    from longvideo.demo import load_plan

    HOUR = load_plan("demos/demo-hour-questions")
    assert HOUR.shape_scale == 1.8 and load_plan("demos/demo-hour").shape_scale == 1.0
    sets = {v.name: v for v in HOUR.sets}
    trained = {name for st in HOUR.stages for name in st.sets}
    for name in trained | {HOUR.held_out}:
        assert sets[name].questions == HOUR_QUESTIONS and sets[name].max_flashes == 3
    test = sets[HOUR.held_out]
    assert HOUR.held_out not in trained and test.seed not in {sets[n].seed for n in trained}
    assert tuple(test.durations) == tuple(HOUR.qa_lengths) == (60, 300, 900, 1800, 3600)
    assert HOUR.eval_samples == test.n and test.n % len(test.durations) == 0


def test_sets_reach_make_data_as_the_plan_draws_them(tmp_path, monkeypatch):
    """The command line the demo writes for each set parses back to the SyntheticSpec the plan's
    VideoSet draws its videos with (questions, flashes, durations included)."""
    from dataclasses import replace

    from longvideo.data import cli as data_cli
    from longvideo.demo import Demo, load_plan

    hour = load_plan("demos/demo-hour")
    edged = replace(hour, sets=tuple(replace(v, needle_edge_fraction=0.2) for v in hour.sets))
    absent = replace(
        hour,
        sets=tuple(replace(v, needle_fraction=0.8, ask_no_flash=True) for v in hour.sets),
    )
    for name, plan in (
        ("demo-hour", hour),
        ("absent", absent),
        ("demo-hour-questions", load_plan("demos/demo-hour-questions")),
        ("demo-quick", load_plan("demos/demo-quick")),
        ("edged", edged),
    ):
        demo = Demo(tmp_path / name, plan)
        (demo.out / "data").mkdir(parents=True)
        cmds, specs = [], []
        monkeypatch.setattr(demo, "run", lambda cmd, threads=None: cmds.append(cmd))
        monkeypatch.setattr(
            data_cli, "write_synthetic_shards", lambda out, n, spec, **kw: specs.append(spec) or []
        )
        demo.make_data()
        for cmd in cmds:
            args = [str(a) for a in cmd]
            assert data_cli.make_data_main(args[args.index("make-data") + 1 :]) == 0
        assert specs == [
            v.spec(plan.source_fps, plan.needle_fraction, plan.shape_scale) for v in plan.sets
        ]


def test_a_run_directory_of_another_plan_is_refused_before_anything_runs(tmp_path):
    """Resuming a run directory under a changed plan (a newer ladder, other video sets) would mix
    the two runs silently: the demo stops with a clear error and leaves the directory as it was."""
    from dataclasses import replace

    from longvideo.demo import Demo, DemoError, load_plan

    QUICK = load_plan("demos/demo-quick")
    out = tmp_path / "demo"
    Demo(out, QUICK).check_plan()  # a new directory takes the plan
    recorded = (out / "plan.json").read_text()
    Demo(out, QUICK).check_plan()  # the same plan resumes
    other = replace(QUICK, stages=QUICK.stages[:1])
    with pytest.raises(DemoError, match="another plan"):
        Demo(out, other).check_plan()
    assert (out / "plan.json").read_text() == recorded and sorted(
        p.name for p in out.iterdir()
    ) == ["plan.json"]
    # a run finished before plan.json existed is recognised by its summary
    old = tmp_path / "old"
    old.mkdir()
    (old / "summary.json").write_text(json.dumps({"plan": json.loads(recorded)}))
    Demo(old, QUICK).check_plan()
    with pytest.raises(DemoError, match="--fresh"):
        Demo(old, other).check_plan()
    # a run recorded before a field existed (the plan's, a set's, a rung's) is this plan's while
    # the field keeps its default, and another plan's once the plan changes it
    record = json.loads(recorded)
    for s in record["sets"]:
        del s["needle_edge_fraction"]
    for st in record["stages"]:
        del st["overrides"]
    del record["shape_scale"]
    edged = replace(QUICK, sets=tuple(replace(v, needle_edge_fraction=0.2) for v in QUICK.sets))
    larger = replace(QUICK, shape_scale=1.8)
    tuned = replace(
        QUICK,
        stages=(replace(QUICK.stages[0], overrides=("train.lr=1e-4",)), *QUICK.stages[1:]),
    )
    older = tmp_path / "older"
    older.mkdir()
    for changed in (edged, larger, tuned):
        (older / "plan.json").write_text(json.dumps(record))
        with pytest.raises(DemoError, match="another plan"):
            Demo(older, changed).check_plan()
        assert json.loads((older / "plan.json").read_text()) == record  # left as it was
        Demo(older, QUICK).check_plan()


def test_a_run_records_the_machine_it_ran_on(monkeypatch):
    """summary.json carries the CPU, its vector units and a matmul rate: demo times from two machines
    are only comparable through them."""
    import types

    from longvideo import machine
    from longvideo.machine import describe, machine_info, matmul_gflops

    m = machine_info(probe_seconds=0.05)
    assert m["cores"] == os.cpu_count() and m["matmul_gflops"] > 0 and isinstance(m["vector"], list)
    text = describe(m)
    assert m["cpu"] in text and f"{m['cores']} cores" in text and "GFLOP/s" in text
    # the probe counts the work it did: on a clock that ticks 10 ms a read, 0.05 s hold 4 matmuls,
    # 2 n^3 flops each, whatever the machine's load
    for n in (32, 128):
        ticks = iter(range(100))
        monkeypatch.setattr(
            machine, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) * 0.01)
        )
        assert matmul_gflops(0.05, n=n) == pytest.approx(2 * n**3 * 4 / 0.05 / 1e9)
    from longvideo.demo import Demo, load_plan

    demo = Demo(Path("/nonexistent-demo-dir"), load_plan("demos/demo-quick"))
    demo.machine = m
    assert demo.summary(1.0)["machine"] == m


def test_the_summary_keeps_the_needle_misses_and_the_report_prints_them(tmp_path, capsys):
    """The needle evaluation's miss table and the tokenizer's look-alike table reach summary.json,
    and the report prints the look-alikes and names, per length,
    the trials missed at every depth and, at the longest length, each flash colour's rate (printed
    only when something was missed)."""
    from longvideo.demo import Demo, load_plan

    demo = Demo(tmp_path / "run", load_plan("demos/demo-quick"))
    demo.machine = None
    (demo.out / "eval/video_niah").mkdir(parents=True)
    misses = {
        "8": {"wrong": 0, "trials": 4, "trials_missed_at_every_depth": 0},
        "40": {
            "wrong": 5,
            "trials": 4,
            "trials_missed_at_every_depth": 1,
            "by_colour": {"red": {"right": 7, "asked": 8}, "blue": {"right": 0, "asked": 4}},
        },
    }
    grid = [[1.0, 0.25]] * 3
    niah = {"accuracy": 0.75, "chance": 0.25, "lengths": [8, 40], "grid": grid, "misses": misses}
    (demo.out / "eval/video_niah/video_needle.json").write_text(json.dumps({**niah, "cells": []}))
    (demo.out / "eval/vq_needle").mkdir(parents=True)
    row = {"codes": [3] * 4, "tuples": 1, "share_per_code": [0.0] * 4, "unique_codes": 1}
    lookalikes = {"red": {**row, "share_any": 0.0}, "blue": {**row, "share_any": 0.125}}
    lookalikes["blue"]["unique_codes"] = 0
    vq = {"rate": 1.0, "rate_by_offset": {"0": 1.0}, "lookalikes": lookalikes}
    (demo.out / "eval/vq_needle/vq_needle.json").write_text(json.dumps({**vq, "cells": []}))
    s = demo.summary(1.0)
    assert s["video_niah"] == niah and s["vq_needle"]["lookalikes"] == lookalikes
    demo.report(s)
    out = capsys.readouterr().out
    assert "flash's code: red 0.0% (1 of its own), blue 12.5% (0 of its own)" in out
    assert "trials missed at every depth (one background, one colour): 0 of 4, 1 of 4" in out
    assert "by flash colour at 40 frames: red 7/8, blue 0/4" in out
    assert "read (the answer" not in out and "codes kept" not in out  # no control, no pruning
    for m in misses.values():
        m.update(wrong=0, trials_missed_at_every_depth=0)
    demo.report({**s, "video_niah": niah})
    assert "missed at every depth" not in capsys.readouterr().out
    # with the control and a pruned tokenizer: reads of the decidable per length, the codes kept
    misses["8"].update(read=10, defaults=2, decidable=10)
    misses["40"].update(read=6, defaults=5, decidable=9)
    (demo.out / "eval/video_niah/video_needle.json").write_text(json.dumps({**niah, "cells": []}))
    info = {"min_count": 20, "codes_held": 875, "codes_kept": 754, "codes_pruned": 121}
    (demo.out / "vq").mkdir()
    (demo.out / "vq/codes.json").write_text(
        json.dumps({**info, "share_pruned": 0.0017, "counts": [1] * 3, "map": [0, 1, 2]})
    )
    s = demo.summary(1.0)
    assert s["prune"] == {**info, "share_pruned": 0.0017}  # no map, no counts
    demo.report(s)
    out = capsys.readouterr().out
    assert "of the decidable: 8 frames 10/10, 40 frames 6/9" in out
    assert "codes kept (held >= 20 times): 754 of 875 held; 0.17% of the training codes" in out


def test_a_seed_reaches_every_lm_stage_and_another_seed_reuses_the_inputs(tmp_path, monkeypatch):
    """`--seed` sets train.seed on every rung (shipped stage configs too); `--inputs-from` links a
    finished run's videos, tokenizers and token shards into a new run of the same plan up to the
    seed, and refuses a run of another plan or one that has not tokenized yet."""
    from dataclasses import replace

    from longvideo.demo import Demo, DemoError, load_plan

    QUICK, HOUR = load_plan("demos/demo-quick"), load_plan("demos/demo-hour")
    for plan, seed in ((QUICK, 3), (HOUR, 5), (QUICK, None)):
        demo = Demo(tmp_path / f"seed{seed}", replace(plan, lm_seed=seed))
        (demo.out / "lm").mkdir(parents=True)
        cmds = []
        monkeypatch.setattr(demo, "run", lambda cmd, threads=None: cmds.append(cmd))
        monkeypatch.setattr(demo, "text_size", lambda: 300)
        demo.train_lm()
        assert len(cmds) == len(plan.stages)
        if seed is None:  # no seed given: the configs' own
            assert not any(str(a).startswith("train.seed=") for c in cmds for a in c)
        else:
            assert all(f"train.seed={seed}" in c for c in cmds)
            assert all(c.count("train.seed=" + str(seed)) == 1 for c in cmds)

    first = tmp_path / "first"
    Demo(first, QUICK).check_plan()
    for name in Demo.INPUTS:
        (first / name).mkdir()
    second = Demo(tmp_path / "second", replace(QUICK, lm_seed=1))
    second.check_plan()
    with pytest.raises(DemoError, match="no finished tokens"):
        second.link_inputs(first)
    (first / "tokens/.done").touch()
    (first / "vq/model.safetensors").write_bytes(b"weights")
    (first / "vq/.done").touch()
    second.link_inputs(first)
    second.link_inputs(first)  # linked already: nothing to do
    assert all((second.out / n).is_symlink() for n in Demo.INPUTS)
    assert (second.out / "vq/model.safetensors").read_bytes() == b"weights"
    assert (second.out / "vq/.done").exists()  # the VQ stage is done there
    # another recipe on the same inputs: rung overrides, every rung's overrides, the evaluations
    recipe = replace(
        QUICK,
        lm_overrides=("data.needle_recolour=1.0",),
        stages=(replace(QUICK.stages[0], overrides=("train.steps=7",)), *QUICK.stages[1:]),
        eval_samples=QUICK.eval_samples + 1,
    )
    # `--vq-seed 0` names the VQ config's own seed: the first run's VQ
    for name, plan in (("third", recipe), ("fourth", replace(QUICK, vq_seed=0))):
        demo = Demo(tmp_path / name, plan)
        demo.check_plan()
        demo.link_inputs(first)
        assert all((demo.out / n).is_symlink() for n in Demo.INPUTS)
    # other videos, another VQ, or a set the first run never tokenized: refused, nothing linked
    held = next(v for v in QUICK.sets if v.name == QUICK.held_out)
    hour = tmp_path / "hour"  # the hour plan's VQ set is only the VQ's: never tokenized
    Demo(hour, HOUR).check_plan()
    for name in Demo.INPUTS:
        (hour / name).mkdir()
    (hour / "tokens/.done").touch()
    others = {
        "sets": (
            first,
            replace(
                QUICK,
                sets=tuple(replace(v, seed=v.seed + 1) if v is held else v for v in QUICK.sets),
            ),
        ),
        "vq_seed": (first, replace(QUICK, vq_seed=7)),
        "vq_set": (hour, replace(HOUR, vq_set=HOUR.held_out)),
        "missing": (
            hour,
            replace(
                HOUR, stages=(*HOUR.stages[:-1], replace(HOUR.stages[-1], sets=(HOUR.vq_set,)))
            ),
        ),
    }
    for key, (run, plan) in others.items():
        other = Demo(tmp_path / f"other-{key}", plan)
        other.check_plan()
        with pytest.raises(DemoError, match=f"another plan .*{key}"):
            other.link_inputs(run)
        assert not any(p.is_symlink() for p in other.out.iterdir())


def plan_commands(demo) -> list[list[str]]:
    """Every command a demo would run, in order, with nothing run: each stage's method is called
    with `run` recording instead (paths under the run directory written as OUT)."""
    cmds = []
    demo.run = lambda cmd, threads=None: cmds.append(
        [str(a).replace(str(demo.out), "OUT") for a in cmd]
    )
    demo.text_size = lambda: 300
    demo.transformers_answer = lambda *a: None
    for d in ("data", "tokens", "lm"):
        (demo.out / d).mkdir(parents=True, exist_ok=True)
    for stage in (
        demo.make_data,
        demo.tokenizer,
        demo.train_vq,
        demo.tokenize,
        demo.train_lm,
        *([demo.train_t2v] if demo.plan.t2v_stage is not None else []),
        demo.export,
        demo.evaluate,
        *([demo.evaluate_t2v] if demo.plan.t2v_stage is not None else []),
        demo.chat,
    ):
        stage()
    return [["python" if a == sys.executable else a for a in c] for c in cmds]


def test_every_plan_file_runs_commands_bounded_by_steps(tmp_path):
    """Each shipped plan, dry: its stage configs resolve to the rungs it records, every rung reads
    sets that are tokenized, and no stage stops on a clock (the VQ stops at its steps)."""
    from longvideo.config import load_config
    from longvideo.demo import Demo, load_plan

    names = sorted(f.stem for f in (ROOT / "configs/demos").glob("*.yaml"))
    assert names == ["demo", "demo-hour", "demo-hour-questions", "demo-quick"]
    for name in names:
        plan = load_plan(f"demos/{name}")
        cmds = plan_commands(Demo(tmp_path / name, plan))
        assert not any("--time-budget" in c for c in cmds)
        (vq,) = [c for c in cmds if "train-vq" in c]
        assert vq[vq.index("--steps") + 1] == str(plan.vq_steps)
        tokenized = {Path(c[c.index("--out") + 1]).name for c in cmds if "tokenize" in c}
        (niah,) = [c for c in cmds if "video-niah" in c]
        assert ("--control" in niah) == plan.needle_control
        train = [c for c in cmds if "train" in c and "torch.distributed.run" in c]
        stages = [*plan.stages, *([plan.t2v_stage] if plan.t2v_stage else [])]
        rungs = [*plan.ladder, *([plan.t2v_rung] if plan.t2v_rung else [])]
        assert len(train) == len(stages) and tokenized >= {s for st in stages for s in st.sets}
        for cmd, rung in zip(train, rungs):
            i = cmd.index("--config")
            j = next((k for k in range(i + 2, len(cmd)) if cmd[k].startswith("--")), len(cmd))
            cfg = load_config(cmd[i + 1], cmd[i + 2 : j])
            assert (cfg.data.seq_len, cfg.train.steps, cfg.parallel.sp, cfg.train.lr) == (
                rung["seq_len"],
                rung["steps"],
                rung["sp"],
                rung["lr"],
            ), (name, cmd[i + 1])


def test_a_pruning_plan_counts_the_training_sets_and_tokenizes_the_held_out_set_after(tmp_path):
    """With prune_min_count, the tokenize stage tokenizes the sets the rungs read, prunes their
    shards (and only theirs), then tokenizes the held-out set with the pruned tokenizer; a stage
    interrupted after writing the code map counts the raw codes again. Without it, one pass."""
    from dataclasses import replace

    from longvideo.demo import INPUT_KEYS, Demo, load_plan

    HOUR = load_plan("demos/demo-hour")
    assert HOUR.prune_min_count == 20 and "prune_min_count" in INPUT_KEYS
    demo = Demo(tmp_path / "hour", HOUR)
    for d in ("vq", "tokens"):
        (demo.out / d).mkdir(parents=True)
    (demo.out / "vq/codes.json").write_text("{}")  # left by an interrupted stage
    cmds = []
    demo.run = lambda cmd, threads=None: cmds.append([str(a) for a in cmd])
    demo.tokenize()
    assert not (demo.out / "vq/codes.json").exists()
    steps = [
        ("prune", c) if "prune-codes" in c else (Path(c[c.index("--out") + 1]).name, c)
        for c in cmds
    ]
    trained = ["brief", "short", "mid", "long"]
    assert [n for n, _ in steps] == [*trained, "prune", HOUR.held_out]
    prune = steps[4][1]
    i = prune.index("--tokens")
    assert [Path(t).name for t in prune[i + 1 : prune.index("--min-count")]] == trained
    assert prune[prune.index("--min-count") + 1] == "20"
    assert prune[prune.index("--vq") + 1] == str(demo.out / "vq")

    plain = Demo(tmp_path / "plain", replace(HOUR, prune_min_count=0))
    (plain.out / "tokens").mkdir(parents=True)
    cmds.clear()
    plain.run = lambda cmd, threads=None: cmds.append([str(a) for a in cmd])
    plain.tokenize()
    assert not any("prune-codes" in c for c in cmds) and len(cmds) == 5


@pytest.mark.parametrize(
    "text, key",
    [
        ("sets: []\nheld_out: test\nstages: []\n", "held_out"),
        ("{base}sets:\n - {{name: test, n: 1, min_seconds: 4, max_seconds: 8}}\n", "sets[0].seed"),
        (
            "{base}sets:\n - {{name: test, n: 1, seed: 0, min_seconds: 9, max_seconds: 8}}\n",
            "sets[0].max_seconds",
        ),
        ("{base}vq_sett: train\n", "vq_sett"),
        ("{base}stages:\n - {{config: stages/demo-quick-512, sets: [clips]}}\n", "stages[0].sets"),
        ("{base}stages:\n - {{config: stages/no-such-rung, sets: [train]}}\n", "stages[0].config"),
        (
            "{base}stages:\n - {{config: stages/demo-quick-512, sets: [train], overrides: [train.stepz=3]}}\n",
            "stages[0].config",
        ),
        ("{base}vq_config: vq/no-such-vq\n", "vq_config"),
        ("{base}needle_trials: [1, 2, 3]\n", "needle_trials"),
        ("{base}prune_min_count: -1\n", "prune_min_count"),
        ("{base}t2v_held_out: nowhere\n", "t2v_held_out"),
        ("{base}t2v_stage: {{config: stages/demo-quick-512, sets: [t2v]}}\n", "t2v_stage.config"),
        ("{base}t2v_stage: {{config: stages/demo-quick-t2v, sets: [t3v]}}\n", "t2v_stage.sets"),
    ],
)
def test_a_bad_plan_file_names_its_key_before_anything_runs(tmp_path, capsys, text, key):
    from longvideo.configtools import ConfigError
    from longvideo.demo import load_plan, main

    plan = tmp_path / "plan.yaml"
    plan.write_text(text.format(base=f"base: {ROOT / 'configs/demos/demo-quick.yaml'}\n"))
    with pytest.raises(ConfigError) as e:
        load_plan(plan)
    assert e.value.key == key, str(e.value)
    assert main(["--plan", str(plan), "--out", str(tmp_path / "run")]) == 2
    assert f"'{key}'" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_a_users_plan_and_stage_config_are_found_from_its_directory(tmp_path, monkeypatch):
    """A plan of one's own names its stage configs as paths; the commands, run from the checkout,
    get them by their absolute paths, and the rung's own overrides reach its command."""
    from longvideo.demo import Demo, load_plan

    monkeypatch.chdir(tmp_path)
    Path("rung.yaml").write_text(
        f"base: {ROOT / 'configs/stages/demo-quick-512.yaml'}\ntrain:\n  steps: 7\n"
    )
    Path("plan.yaml").write_text(
        f"base: {ROOT / 'configs/demos/demo-quick.yaml'}\n"
        "stages:\n - {config: rung.yaml, sets: [train], overrides: [train.lr=0.002]}\n"
    )
    plan = load_plan("plan.yaml")
    assert (plan.ladder[0]["steps"], plan.ladder[0]["lr"]) == (7, 0.002)
    (cmd,) = [
        c
        for c in plan_commands(Demo(tmp_path / "out", plan))
        if "torch.distributed.run" in c and str(tmp_path / "rung.yaml") in c
    ]
    assert cmd[cmd.index("--config") + 1] == str(tmp_path / "rung.yaml") and "train.lr=0.002" in cmd


def test_a_vq_seed_reaches_the_vq_and_the_plan(tmp_path):
    """`--vq-seed` sets the VQ's seed (a train-vq override) and is recorded, so a run of another VQ
    seed is another plan and shares no inputs; without it the command has no seed."""
    from dataclasses import replace

    from longvideo.demo import Demo, load_plan
    from longvideo.vq import load_vq_config

    plan = load_plan("demos/demo-hour")
    for seed in (None, 4):
        demo = Demo(tmp_path / f"vq{seed}", replace(plan, vq_seed=seed))
        cmds = []
        demo.run = lambda cmd, threads=None: cmds.append([str(a) for a in cmd])
        demo.train_vq()
        (cmd,) = cmds
        overrides = [a for a in cmd if "=" in a]
        assert overrides == ([] if seed is None else [f"seed={seed}"])
        assert load_vq_config(cmd[cmd.index("--config") + 1], overrides).seed == (
            0 if seed is None else seed
        )
        assert demo.plan.record()["vq_seed"] == seed and "--time-budget" not in cmd


def test_text_to_video_rungs_train_on_caption_first_videos_and_evaluate_held_out_captions(tmp_path):
    """make demo's (and the quick demo's) text-to-video branch: a rung from fresh weights (the
    ladder's last RoPE theta) on caption-before-video documents of flash-free sets, evaluated on
    held-out captions of another flash-free set with one thread, its figures in summary.json."""
    from longvideo.config import load_config
    from longvideo.demo import Demo, load_plan

    for name in ("demo", "demo-quick"):
        plan = load_plan(f"demos/{name}")
        cfg = load_config(plan.t2v_stage.config)
        assert cfg.data.templates == ("caption",) and cfg.data.caption_position == "before"
        assert plan.t2v_rung["rope_theta"] == plan.ladder[-1]["rope_theta"]
        assert plan.t2v_rung["seq_len"] == cfg.data.seq_len and plan.t2v_rung["sp"] == 1
        sets = {v.name: v for v in plan.sets}
        flash_free = [*plan.t2v_stage.sets, plan.t2v_held_out]
        assert all(sets[s].needle_fraction == 0.0 for s in flash_free)
        trained = {s for st in [*plan.stages, plan.t2v_stage] for s in st.sets}
        assert plan.t2v_held_out not in trained
        # a document of the longest t2v video fits the rung's rows
        longest = max(sets[s].max_seconds for s in plan.t2v_stage.sets)
        assert longest * (8 * 8 + 1) + 40 <= cfg.data.seq_len
        demo = Demo(tmp_path / name, plan)
        cmds = []
        demo.run = lambda cmd, threads=None: cmds.append((cmd, threads))
        demo.text_size = lambda: 300
        (demo.out / "lm").mkdir(parents=True)
        (demo.out / "lm/final").write_text(str(tmp_path / "ladder"))
        demo.train_t2v()
        demo.evaluate_t2v()
        (train, _), (ev, threads) = cmds
        train = [str(a) for a in train]
        assert "--init-from" not in train and "--resume" not in train  # fresh weights
        assert f"train.out_dir={demo.out / f'lm/t2v-{cfg.data.seq_len}'}" in train
        ev = [str(a) for a in ev]
        assert ev[ev.index("--model") + 1] == str(demo.out / f"lm/t2v-{cfg.data.seq_len}")
        assert ev[ev.index("--shards") + 1] == str(demo.out / "tokens" / plan.t2v_held_out)
        assert threads == 1 and ev[ev.index("--samples") + 1] == str(plan.t2v_samples)
        assert "summary" not in plan.record() and plan.record()["t2v_stage"]["steps"] > 0
        (demo.out / "eval/t2v").mkdir(parents=True)
        (demo.out / "eval/t2v/t2v.json").write_text(
            json.dumps({"accuracy": 0.9, "chance": 0.04, "n": 48, "samples": []})
        )
        t2v = demo.summary(1.0)["t2v"]
        assert t2v == {"accuracy": 0.9, "chance": 0.04, "n": 48}


def test_needle_by_length_script_reads_runs_and_replots_from_its_json(tmp_path, capsys):
    """scripts/needle_by_length.py: each run's accuracy by length is its grid's column mean (the
    grid's rows are depths), a run directory adds its rungs' losses, and --replot draws from the
    JSON alone. Real summaries: two shipped hour runs' (docs/bench)."""
    import importlib.util

    path = ROOT / "scripts" / "needle_by_length.py"
    spec = importlib.util.spec_from_file_location("needle_by_length", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    shipped = ROOT / "docs/bench/demo-hour-vq4.json"
    run = tmp_path / "run"
    (run / "lm/stage0-2048").mkdir(parents=True)
    (run / "summary.json").write_text((ROOT / "docs/bench/demo-hour-vq0-avx2.json").read_text())
    losses = [0.9, 0.5] + [0.1] * 19 + [0.3]
    with open(run / "lm/stage0-2048/metrics.jsonl", "w") as f:
        f.write(json.dumps({"event": "start"}) + "\n")  # lines without a loss are passed over
        for i, x in enumerate(losses):
            f.write(json.dumps({"step": i + 1, "loss": x, "step_time": 1.0 + i % 2}) + "\n")
    out_json, png = tmp_path / "runs.json", tmp_path / "runs.png"
    argv = ["--run", f"seed 4={shipped}", "--run", f"seed 0={run}", "--json", str(out_json)]
    assert script.main([*argv, "--png", str(png), "--what", "two runs"]) == 0
    data = json.loads(out_json.read_text())
    assert data["what"] == "two runs" and list(data["variants"]) == ["seed 4", "seed 0"]
    grid = json.loads(shipped.read_text())["video_niah"]["grid"]
    four = data["variants"]["seed 4"]
    for j, x in enumerate(four["by_length"]):
        assert x == pytest.approx(sum(row[j] for row in grid) / len(grid), abs=1e-4)
    assert four["by_length"][-1] == pytest.approx(0.875)  # 35 of 40 at 60 minutes
    assert "rungs" not in four and four["qa"]["needle"] == 1.0
    zero = data["variants"]["seed 0"]
    assert zero["rungs"] == {
        "stage0-2048": {"steps": 22, "loss_last_20": 0.11, "median_step_seconds": 1.5}
    }
    assert zero["by_colour"]["3600"]["blue"] == "10/10"
    printed = capsys.readouterr().out
    assert png.stat().st_size > 1000
    png.unlink()
    assert script.main(["--replot", str(out_json), "--png", str(png)]) == 0
    assert png.stat().st_size > 1000 and capsys.readouterr().out == printed
    with pytest.raises(SystemExit):
        script.main(["--run", "no label", "--png", str(png)])
