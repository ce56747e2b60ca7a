"""`make demo`: train a tiny long-video model on CPU from nothing and question it on unseen videos.

Every stage runs the command a user would type (docs/demo.md). What runs is a plan file
(configs/demos/*.yaml, or your own: --plan); stages whose outputs exist are skipped, so an
interrupted demo continues where it stopped.

    python -m longvideo.demo                 # configs/demos/demo.yaml (about half an hour on 2 cores)
    python -m longvideo.demo --quick         # configs/demos/demo-quick.yaml, the CI-sized version
    python -m longvideo.demo --hour          # configs/demos/demo-hour.yaml (make demo-hour)
    python -m longvideo.demo --seed 1 --inputs-from runs/demo --out runs/demo-seed1   # another LM seed
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from pathlib import Path

from longvideo.atomic import write_bytes_atomic, write_text_atomic
from longvideo.checkpoint import latest_checkpoint
from longvideo.config import load_config
from longvideo.configtools import (
    ConfigError,
    check,
    from_dict,
    load_yaml,
    resolve_config_path,
    to_dict,
)
from longvideo.data.questions import BASIC_QUESTIONS
from longvideo.data.synthetic import SyntheticSpec, make_sample, text_corpus
from longvideo.export import LongVideoProcessor
from longvideo.infer.scoring import length_label
from longvideo.machine import describe, machine_info
from longvideo.parallel.deepspeed_config import load_base, resolve_zero_stage
from longvideo.tokenizer import TextTokenizer
from longvideo.train.run_state import STATE_FILE
from longvideo.vq import load_vq_config
from longvideo.vq.files import CODES_FILE


def _named(key: str, load, *args):
    """load(*args), with its errors (a missing file too) under the plan's key."""
    try:
        return load(*args)
    except (ConfigError, FileNotFoundError) as e:
        raise ConfigError(key, str(e)) from None


@dataclass(frozen=True, kw_only=True)
class VideoSet:
    """One set of synthetic videos written by `make-data synthetic` (durations in whole seconds)."""

    name: str
    """Directory under data/ and tokens/."""
    n: int
    """Videos."""
    seed: int
    """Dataset seed (held-out sets use other seeds: never seen in training)."""
    min_seconds: int
    max_seconds: int
    long_fraction: float = 0.0
    """Fraction of the videos that last long_seconds instead."""
    long_seconds: int = 60
    flashes_per_minute: float = 0.0
    """Extra flashes with no question (a set the video tokenizer trains on)."""
    needle_fraction: float | None = None
    """This set's fraction of videos with a flash frame; None: the plan's (text to video trains on
    videos whose captions say everything they show: 0)."""
    max_flashes: int = 1
    """A video with the needle carries 1 to this many flashes of distinct colours."""
    needle_edge_fraction: float = 0.0
    """Fraction of its needles on the video's first or last second (the rest at a uniform second)."""
    questions: tuple[str, ...] = BASIC_QUESTIONS
    """The question types its videos carry (longvideo/data/questions.py)."""
    durations: tuple[int, ...] = ()
    """Video i lasts durations[i % len] seconds (a held-out set at fixed lengths); empty: drawn
    between min_seconds and max_seconds."""
    ask_no_flash: bool = False
    """Its videos without a flash are asked the flash question too, answered "none" (with
    needle_fraction < 1): a model that can say so has no colour to fall back on."""

    def spec(self, fps: int, needle_fraction: float, shape_scale: float = 1.0) -> SyntheticSpec:
        """The SyntheticSpec its videos are drawn with (its fields checked there)."""
        return SyntheticSpec(
            fps=fps,
            min_seconds=self.min_seconds,
            max_seconds=self.max_seconds,
            long_fraction=self.long_fraction,
            long_seconds=self.long_seconds,
            needle_fraction=needle_fraction
            if self.needle_fraction is None
            else self.needle_fraction,
            flashes_per_minute=self.flashes_per_minute,
            max_flashes=self.max_flashes,
            needle_edge_fraction=self.needle_edge_fraction,
            questions=self.questions,
            durations=self.durations,
            shape_scale=shape_scale,
            ask_no_flash=self.ask_no_flash,
        )

    def __post_init__(self):
        check(self.n >= 1, "n", f"a set needs videos, got {self.n}")
        check(
            1 <= self.min_seconds <= self.max_seconds,
            "max_seconds",
            f"need 1 <= min_seconds <= max_seconds, got {self.min_seconds} and {self.max_seconds}",
        )
        try:
            self.spec(1, 1.0)
        except ValueError as e:
            raise ConfigError(f"sets[{self.name}]", str(e)) from None


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One rung of the context ladder: a stage config (configs/stages/*.yaml), which holds the rung's
    context, RoPE theta, ring size, steps, learning rate and ZeRO stage, and the sets it reads."""

    config: str
    """The stage config the rung trains with (it also runs by hand: `longvideo train --config ...`)."""
    sets: tuple[str, ...]
    """VideoSet names whose token shards the rung reads."""
    overrides: tuple[str, ...] = ()
    """Dotted overrides of this rung's config."""


@dataclass(frozen=True, kw_only=True)
class DemoPlan:
    """One demo run, as a plan file (configs/demos/*.yaml) lists it."""

    sets: tuple[VideoSet, ...]
    """Training and held-out video sets."""
    held_out: str
    """The VideoSet scored by the QA evaluation (never trained on)."""
    stages: tuple[Stage, ...]
    """The context ladder."""
    source_fps: int = 8
    """Frame rate of the written videos (all are read at 1 fps)."""
    shape_scale: float = 1.0
    """Every video's shapes (the sets', the needle evaluations' backgrounds, chat's): radii times
    this; larger shapes keep their kind through a tokenizer of few codes per frame."""
    needle_fraction: float = 1.0
    """Fraction of videos with a flash frame and its question."""
    tokenizer_vocab: int = 384
    """Text ids of the BPE tokenizer."""
    lm_config: str = "tiny"
    """The root config of the language model (its `vq:` section has the shape of vq_config)."""
    vq_config: str = "vq/tiny.yaml"
    """The video tokenizer's config."""
    vq_set: str = "train"
    """The VideoSet the VQ trains on."""
    vq_steps: int = 1500
    """VQ steps, where it stops: never on a clock, whose learning rate would follow the machine's load
    (docs/experiments.md, "make demo: the VQ stops at its steps, not on the clock")."""
    vq_seed: int | None = None
    """The VQ's seed (initial weights and frame sampling); None keeps the VQ config's (0)."""
    vq_warn_seconds: float = 0.0
    """A VQ stage longer than this (wall time) warns: the machine is slower or busier than the plan
    assumes. It never stops the VQ. 0: no warning."""
    prune_min_count: int = 0
    """> 0: after the training sets are tokenized, `longvideo prune-codes` maps every code their
    shards hold fewer than this many times to its nearest kept code, rewrites those shards, and the
    held-out sets are tokenized with the pruned tokenizer (docs/hour.md, "Rare codes"); 0: no
    pruning."""
    eval_samples: int = 64
    """Held-out QA samples scored."""
    qa_lengths: tuple[int, ...] = ()
    """Video lengths (seconds) the QA evaluation scores apart, per question type (the held-out
    set's `durations`); empty: three bins of its own durations."""
    needle_lengths: tuple[int, ...] = (8, 16, 40)
    """Video lengths (frames at 1 fps) of the video needle grid."""
    needle_depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    """Needle depths of the video needle grid."""
    needle_trials: tuple[int, ...] = ()
    """Trials per length of the needle grid (empty: one per needle colour)."""
    eval_sp: int = 1
    """Processes of the needle evaluation (> 1: prefill by ring attention over them)."""
    needle_control: bool = False
    """The needle evaluation also asks each trial over its bare background (`--control`): its
    misses then count the right answers the flash changed (`read`) of those a bare background
    would not have got right anyway (`decidable`), per length and colour (docs/inference.md)."""
    vq_needle_trials: int = 0
    """Trials of `eval vq-needle` (does a flash survive the tokenizer?); 0: not run."""
    chat_seconds: int = 12
    """Length of the held-out video `longvideo chat` answers about."""
    nproc: int = 2
    """Processes of the language-model training."""
    lm_overrides: tuple[str, ...] = ()
    """Dotted overrides of every rung's config (the plan's runtime choices)."""
    lm_seed: int | None = None
    """`train.seed` of every rung; None keeps the configs' (0). The videos and the VQ do not depend
    on it, so runs of several seeds (`--seed`, `--inputs-from`) compare the language model alone."""
    t2v_stage: Stage | None = None
    """Text to video: a rung trained from freshly initialised weights on its sets'
    caption-before-video documents (its stage config lays them out so: templates [caption],
    caption_position before), a model beside the ladder's, which the QA and needle evaluations
    keep; None: none. (Started from the ladder's weights instead, it learnt far less in the same
    steps: docs/experiments.md, "make demo: text to video".)"""
    t2v_held_out: str | None = None
    """The VideoSet whose captions the text-to-video evaluation generates from (never trained
    on)."""
    t2v_samples: int = 32
    """Held-out captions generated from."""
    t2v_max_frames: int = 8
    """Most frames of a generated video (a caption's video length at 1 fps, capped)."""
    t2v_cfg_scale: float = 3.0
    """Classifier-free guidance scale of the evaluation."""
    t2v_top_k: int | None = None
    """Top-k of the evaluation's sampling (None: every code)."""
    t2v_temperature: float = 1.0
    """Sampling temperature of the evaluation."""
    ladder: tuple[dict, ...] = field(init=False, repr=False, compare=False)
    """Per rung, what its config resolves to: seq_len, steps, rope_theta, sp, lr, zero_stage."""
    t2v_rung: dict | None = field(default=None, init=False, repr=False, compare=False)
    """The same of the text-to-video rung."""

    def __post_init__(self):
        names = [v.name for v in self.sets]
        check(len(set(names)) == len(names), "sets", f"set names repeat: {names}")
        if self.t2v_stage is not None:
            check(
                self.t2v_held_out in names,
                "t2v_held_out",
                f"the t2v stage needs a held-out set; no set named {self.t2v_held_out!r}: {names}",
            )
        for key in ("held_out", "vq_set"):
            check(
                getattr(self, key) in names,
                key,
                f"no set named {getattr(self, key)!r}; sets: {names}",
            )
        check(len(self.stages) > 0, "stages", "the ladder needs a rung")
        check(
            self.prune_min_count >= 0,
            "prune_min_count",
            f"a count (0: no pruning), got {self.prune_min_count}",
        )
        check(
            not self.needle_trials or len(self.needle_trials) == len(self.needle_lengths),
            "needle_trials",
            f"one count per needle length ({len(self.needle_lengths)}), got {list(self.needle_trials)}",
        )
        _named("lm_config", load_config, self.lm_config)
        _named("vq_config", load_vq_config, self.vq_config)
        ladder = []
        rungs = [(f"stages[{i}]", st) for i, st in enumerate(self.stages)]
        if self.t2v_stage is not None:
            rungs.append(("t2v_stage", self.t2v_stage))
        for key, st in rungs:
            unknown = [s for s in st.sets if s not in names]
            check(
                bool(st.sets) and not unknown,
                f"{key}.sets",
                f"no set named {unknown}; sets: {names}",
            )
            c = _named(f"{key}.config", load_config, st.config, [*self.lm_overrides, *st.overrides])
            if key == "t2v_stage":
                check(
                    c.data.templates == ("caption",) and c.data.caption_position == "before",
                    "t2v_stage.config",
                    f"{st.config} must lay out caption-before-video documents only "
                    f"(data.templates: [caption], data.caption_position: before)",
                )
            zero = resolve_zero_stage(c.train, load_base(c.train.deepspeed_config))
            ladder.append(
                dict(
                    seq_len=c.data.seq_len,
                    steps=c.train.steps,
                    rope_theta=c.model.rope_theta,
                    sp=c.parallel.sp,
                    lr=c.train.lr,
                    zero_stage=zero,
                )
            )
        if self.t2v_stage is not None:
            object.__setattr__(self, "t2v_rung", ladder.pop())
        object.__setattr__(self, "ladder", tuple(ladder))

    def record(self) -> dict:
        """The plan as plan.json and summary.json record it: the plan file's keys, each rung with
        what its config resolves to (a changed stage config is another plan)."""
        rec = to_dict(self)
        for st, rung in zip(rec["stages"], self.ladder):
            st.update(rung)
        if self.t2v_rung is not None:
            rec["t2v_stage"].update(self.t2v_rung)
        rec.pop("t2v_rung", None)
        return rec


def _defaults(cls) -> dict:
    """The JSON form of a plan dataclass's field defaults (fields without one are left out)."""
    return {
        f.name: json.loads(json.dumps(to_dict(f.default) if is_dataclass(f.default) else f.default))
        for f in fields(cls)
        if f.init and f.default is not MISSING
    }


INPUT_KEYS = (
    "sets",
    "source_fps",
    "shape_scale",
    "needle_fraction",
    "tokenizer_vocab",
    "lm_config",
    "vq_config",
    "vq_set",
    "vq_steps",
    "vq_seed",
    "prune_min_count",
)
"""The plan keys a run's inputs (videos, both tokenizers, token shards) depend on; the others (the
rungs' overrides and steps, `lm_overrides`, `lm_seed`, the evaluations) train or score a language
model on them."""


def _trained(record: dict) -> set[str]:
    """The sets a recorded plan trains its language models on: those a rung reads."""
    t2v = record.get("t2v_stage") or {}
    return {name for st in record["stages"] for name in st["sets"]} | set(t2v.get("sets", ()))


def _tokenized(record: dict) -> set[str]:
    """The sets a recorded plan tokenizes: those a rung, the QA evaluation or text to video reads."""
    t2v = record.get("t2v_stage") or {}
    return _trained(record) | {record["held_out"]} | ({record["t2v_held_out"]} if t2v else set())


def _inputs_of(record: dict) -> dict:
    """Of a recorded plan: the values of INPUT_KEYS, the VQ's seed resolved (None is the VQ
    config's own, so `--vq-seed 0` names the default's VQ)."""
    keys = {k: record[k] for k in INPUT_KEYS}
    if keys["vq_seed"] is None:
        keys["vq_seed"] = load_vq_config(config_arg(record["vq_config"])).seed
    return keys


def _with_defaults(record: dict) -> dict:
    """A recorded plan with every field it predates at its default: the plan's own, each set's and
    each rung's. A field added since, left at its default, draws the same videos and trains the
    same ladder, so an older run stays this plan's."""
    if not isinstance(record, dict):
        return record

    def each(items, cls):
        if not isinstance(items, list):
            return items
        defaults = _defaults(cls)
        return [{**defaults, **x} if isinstance(x, dict) else x for x in items]

    record = {**_defaults(DemoPlan), **record}
    record["sets"] = each(record.get("sets"), VideoSet)
    record["stages"] = each(record.get("stages"), Stage)
    if isinstance(record.get("t2v_stage"), dict):
        record["t2v_stage"] = {**_defaults(Stage), **record["t2v_stage"]}
    return record


def load_plan(path: str | Path) -> DemoPlan:
    """A plan file: a path, or one under configs/ (`demos/demo`). Errors name the key."""
    return from_dict(DemoPlan, load_yaml(resolve_config_path(path)))


def config_arg(name: str) -> str:
    """A config as the commands, run from the checkout, find it: a user's file by its absolute path,
    a shipped one by its name."""
    return str(Path(name).resolve()) if Path(name).is_file() else name


ROOT = Path(__file__).resolve().parent.parent


class DemoError(RuntimeError):
    """A demo that cannot go on (a command failed, a run directory of another plan)."""


def finished_step(run_dir: Path) -> int:
    """The step of the run's latest complete checkpoint (0 when it has none)."""
    ckpt = latest_checkpoint(run_dir)
    return int(json.loads((ckpt / STATE_FILE).read_text())["step"]) if ckpt is not None else 0


class Demo:
    def __init__(self, out: Path, plan: DemoPlan, quiet: bool = False):
        self.out, self.plan, self.quiet = out, plan, quiet
        self.q = ["--quiet"] if quiet else []  # every command's progress bars off
        # the shapes' size, for every command that draws videos (none when the default)
        self.scale = ["--shape-scale", plan.shape_scale] if plan.shape_scale != 1.0 else []
        self.timings: dict[str, float] = {}
        self.machine: dict | None = None
        self.env = dict(
            os.environ,
            DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONUNBUFFERED="1",
        )

    def run(self, args: list[str], *, threads: int | None = None) -> None:
        env = dict(self.env)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        cmd = [str(a) for a in args]
        print(
            "$ " + " ".join(cmd if cmd[0] != sys.executable else ["python"] + cmd[1:]), flush=True
        )
        r = subprocess.run(cmd, env=env, cwd=str(ROOT))
        if r.returncode != 0:
            raise DemoError(f"command failed with exit code {r.returncode}: {' '.join(cmd)}")

    def lv(self, *args) -> None:
        self.run([sys.executable, "-m", "longvideo", *args])

    def torchrun(self, nproc: int, *args) -> None:
        """`longvideo ARGS` in nproc processes of one thread each."""
        self.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={nproc}",
                "-m",
                "longvideo",
                *args,
            ],
            threads=1,
        )

    def stage(self, name: str, done: Path, fn) -> None:
        if done.exists():
            print(f"=== {name}: done already ({done.relative_to(self.out)}), skipped", flush=True)
            return
        print(f"\n=== {name}", flush=True)
        t0 = time.time()
        fn()
        self.timings[name] = round(time.time() - t0, 1)
        print(f"--- {name}: {self.timings[name]:.0f} s", flush=True)

    def make_data(self) -> None:
        for v in self.plan.sets:
            spec = v.spec(self.plan.source_fps, self.plan.needle_fraction, self.plan.shape_scale)
            self.lv(
                "make-data",
                "synthetic",
                "--out",
                self.out / "data" / v.name,
                "--n",
                v.n,
                "--seed",
                v.seed,
                "--fps",
                spec.fps,
                "--min-seconds",
                spec.min_seconds,
                "--max-seconds",
                spec.max_seconds,
                "--long-fraction",
                spec.long_fraction,
                "--long-seconds",
                spec.long_seconds,
                "--needle-fraction",
                spec.needle_fraction,
                "--flashes-per-minute",
                spec.flashes_per_minute,
                *(["--max-flashes", spec.max_flashes] if spec.max_flashes > 1 else []),
                *(
                    ["--needle-edge-fraction", spec.needle_edge_fraction]
                    if spec.needle_edge_fraction
                    else []
                ),
                *(
                    ["--questions", ",".join(spec.questions)]
                    if spec.questions != BASIC_QUESTIONS
                    else []
                ),
                *(["--durations", ",".join(map(str, spec.durations))] if spec.durations else []),
                *(["--ask-no-flash"] if spec.ask_no_flash else []),
                *self.scale,
                "--samples-per-shard",
                64,
                "--workers",
                2,
                *self.q,
            )
        (self.out / "data/.done").touch()

    def tokenizer(self) -> None:
        p, texts = self.plan, []
        for v in p.sets:
            spec = v.spec(p.source_fps, p.needle_fraction, p.shape_scale)
            texts += text_corpus(n=400 // len(p.sets) + 1, seed=v.seed, spec=spec)
        corpus = self.out / "tokenizer_corpus.txt"
        write_text_atomic(corpus, "\n".join(texts) + "\n")
        self.lv(
            "train-tokenizer",
            "--texts",
            corpus,
            "--vocab-size",
            self.plan.tokenizer_vocab,
            "--out",
            self.out / "tokenizer",
        )

    def train_vq(self) -> None:
        p, t0 = self.plan, time.time()
        self.lv(
            "train-vq",
            "--config",
            config_arg(p.vq_config),
            "--data",
            self.out / "data" / p.vq_set,
            "--out",
            self.out / "vq",
            "--steps",
            p.vq_steps,
            "--no-tensorboard",
            *self.q,
            *([] if p.vq_seed is None else [f"seed={p.vq_seed}"]),
        )
        (self.out / "vq").mkdir(parents=True, exist_ok=True)
        (self.out / "vq/.done").touch()  # train-vq finished its steps (a rerun resumes it)
        if p.vq_warn_seconds and time.time() - t0 > p.vq_warn_seconds:
            print(
                f"warning: the VQ's {p.vq_steps} steps took {time.time() - t0:.0f} s, more than the plan's "
                f"{p.vq_warn_seconds:g} s: this machine is slower or busier than the plan assumes (the VQ is "
                "the same, the demo takes longer)",
                flush=True,
            )

    def tokenize(self) -> None:
        """Tokenize every set the plan reads. With prune_min_count, the training sets first, then
        `prune-codes` counts their codes, writes the VQ's code map and rewrites their shards, then
        the held-out sets are tokenized by the pruned tokenizer (their codes never counted)."""
        record, prune = self.plan.record(), self.plan.prune_min_count
        used, trained = _tokenized(record), _trained(record)
        codes = self.out / "vq" / CODES_FILE
        if prune and codes.exists():  # an interrupted stage: count the raw codes again
            codes.unlink()

        def tokenize(names):
            for v in (v for v in self.plan.sets if v.name in names):  # the VQ's own set: not read
                self.lv(
                    "tokenize",
                    "--vq",
                    self.out / "vq",
                    "--in",
                    self.out / "data" / v.name,
                    "--out",
                    self.out / "tokens" / v.name,
                    "--config",
                    config_arg(self.plan.lm_config),
                    "--workers",
                    2,
                    *self.q,
                )

        if not prune:
            tokenize(used)
        else:
            tokenize(trained)
            self.lv(
                "prune-codes",
                "--vq",
                self.out / "vq",
                "--tokens",
                *(self.out / "tokens" / v.name for v in self.plan.sets if v.name in trained),
                "--min-count",
                prune,
                *self.q,
            )
            tokenize(used - trained)
        (self.out / "tokens/.done").touch()

    def text_size(self) -> int:
        return TextTokenizer.from_dir(self.out / "tokenizer").text_size

    def train_lm(self) -> None:
        p, prev = self.plan, None
        for i, (st, rung) in enumerate(zip(p.stages, p.ladder)):
            run_dir = self.out / f"lm/stage{i}-{rung['seq_len']}"
            reached = finished_step(run_dir)
            if reached >= rung["steps"]:
                print(f"stage {rung['seq_len']}: done already (step {reached})", flush=True)
                prev = run_dir
                continue
            names = st.sets[0] if len(st.sets) == 1 else "{" + ",".join(st.sets) + "}"
            overrides = [
                f"model.text_vocab_size={self.text_size()}",
                f"data.train_shards={self.out / 'tokens' / names}",
                *p.lm_overrides,
                *st.overrides,
                *([] if p.lm_seed is None else [f"train.seed={p.lm_seed}"]),
                f"train.tokenizer_dir={self.out / 'tokenizer'}",
                f"train.vq_dir={self.out / 'vq'}",
                f"train.out_dir={run_dir}",
                *(["train.progress=false"] if self.quiet else []),
            ]
            if (
                reached > 0
            ):  # stopped part-way (SIGTERM, a crash): continue from its last checkpoint
                overrides.append("--resume")
            elif prev is not None:
                overrides += ["--init-from", prev]
            print(
                f"--- stage {i + 1}/{len(p.stages)}: context {rung['seq_len']}, sp {rung['sp']}, "
                f"ZeRO-{rung['zero_stage']}, RoPE theta {rung['rope_theta']:g}, {rung['steps']} steps",
                flush=True,
            )
            self.torchrun(p.nproc, "train", "--config", config_arg(st.config), *overrides)
            prev = run_dir
        write_text_atomic(self.out / "lm/final", str(prev))

    def train_t2v(self) -> None:
        """The text-to-video rung: from freshly initialised weights (the plan's seed), on
        caption-before-video documents."""
        p, rung = self.plan, self.plan.t2v_rung
        st = p.t2v_stage
        run_dir = self.out / f"lm/t2v-{rung['seq_len']}"
        reached = finished_step(run_dir)
        if reached < rung["steps"]:
            names = st.sets[0] if len(st.sets) == 1 else "{" + ",".join(st.sets) + "}"
            overrides = [
                f"model.text_vocab_size={self.text_size()}",
                f"data.train_shards={self.out / 'tokens' / names}",
                *p.lm_overrides,
                *st.overrides,
                *([] if p.lm_seed is None else [f"train.seed={p.lm_seed}"]),
                f"train.tokenizer_dir={self.out / 'tokenizer'}",
                f"train.vq_dir={self.out / 'vq'}",
                f"train.out_dir={run_dir}",
                *(["train.progress=false"] if self.quiet else []),
            ]
            if reached > 0:
                overrides.append("--resume")
            print(
                f"--- text to video: context {rung['seq_len']}, {rung['steps']} steps from "
                f"fresh weights on caption-before-video documents",
                flush=True,
            )
            self.torchrun(p.nproc, "train", "--config", config_arg(st.config), *overrides)
        (self.out / "lm/t2v").write_text(str(run_dir))

    def evaluate_t2v(self) -> None:
        """Videos generated from held-out captions, each frame's colour and shape read (eval
        t2v)."""
        p = self.plan
        self.run(  # one thread: sampling is many small forwards, which threads only slow down
            [
                sys.executable,
                "-m",
                "longvideo",
                "eval",
                "t2v",
                "--model",
                (self.out / "lm/t2v").read_text().strip(),
                "--shards",
                self.out / "tokens" / p.t2v_held_out,
                "--out",
                self.out / "eval/t2v",
                "--samples",
                p.t2v_samples,
                "--max-frames",
                p.t2v_max_frames,
                "--cfg-scale",
                p.t2v_cfg_scale,
                "--temperature",
                p.t2v_temperature,
                *([] if p.t2v_top_k is None else ["--top-k", p.t2v_top_k]),
                *self.q,
            ],
            threads=1,
        )

    def export(self) -> None:
        self.lv(
            "export",
            "--ckpt",
            (self.out / "lm/final").read_text().strip(),
            "--out",
            self.out / "hf",
        )

    def evaluate(self) -> None:
        p, quiet = self.plan, self.q
        self.lv(
            "eval",
            "qa",
            "--model",
            self.out / "hf",
            "--shards",
            self.out / "tokens" / p.held_out,
            "--max-samples",
            p.eval_samples,
            "--out",
            self.out / "eval/qa",
            *(["--lengths", ",".join(map(str, p.qa_lengths))] if p.qa_lengths else []),
            *quiet,
        )
        needle = [
            "eval",
            "video-niah",
            "--model",
            self.out / "hf",
            "--out",
            self.out / "eval/video_niah",
            "--lengths",
            ",".join(map(str, p.needle_lengths)),
            "--depths",
            ",".join(map(str, p.needle_depths)),
            "--source-fps",
            p.source_fps,
            *self.scale,
            *quiet,
        ]
        if p.vq_needle_trials:
            self.lv(
                "eval",
                "vq-needle",
                "--model",
                self.out / "vq",
                "--out",
                self.out / "eval/vq_needle",
                "--frames",
                120,
                "--trials",
                p.vq_needle_trials,
                "--source-fps",
                p.source_fps,
                *self.scale,
                *quiet,
            )
        if p.needle_trials:
            needle += ["--trials", ",".join(map(str, p.needle_trials))]
        if p.needle_control:
            needle.append("--control")
        if p.eval_sp > 1:  # every prompt's video prefilled by ring attention over eval_sp processes
            self.torchrun(p.eval_sp, *needle)
        else:
            self.lv(*needle)

    def chat(self) -> None:
        """A held-out needle video, as a plain mp4 file (what a user would bring), questioned through
        `longvideo chat` and through plain transformers."""
        spec = SyntheticSpec(
            fps=self.plan.source_fps,
            min_seconds=self.plan.chat_seconds,
            max_seconds=self.plan.chat_seconds,
            needle_fraction=1.0,
            long_fraction=0.0,
            shape_scale=self.plan.shape_scale,
        )
        sample = make_sample(seed=7, index=0, spec=spec)
        video, qa = self.out / "held_out.mp4", sample.meta["qa"][0]
        write_bytes_atomic(video, sample.mp4())
        self.lv(
            "chat",
            "--model",
            self.out / "hf",
            "--video",
            video,
            "--fps",
            1,
            "--question",
            qa["question"],
            "--max-new-tokens",
            8,
            *self.q,
        )
        print(f"(the true answer: {qa['answer']})", flush=True)
        self.transformers_answer(video, qa["question"], qa["answer"])

    def transformers_answer(self, video: Path, question: str, truth: str) -> None:
        """Reload the export with plain transformers and answer through LongVideoProcessor."""
        import torch
        from transformers import AutoModelForCausalLM

        # an export with its own transformers code (attn_logn_base) names it in config.json's auto_map
        remote = "auto_map" in json.loads((self.out / "hf/config.json").read_text())
        model = AutoModelForCausalLM.from_pretrained(self.out / "hf", trust_remote_code=remote)
        proc = LongVideoProcessor.from_pretrained(self.out / "hf")
        inputs = proc(video=video, question=question)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        answer = proc.decode(out[0], prompt_length=inputs["input_ids"].shape[1])
        print(
            f"transformers.AutoModelForCausalLM + LongVideoProcessor: Q: {question}  A: {answer}  "
            f"(truth: {truth})",
            flush=True,
        )
        write_text_atomic(
            self.out / "chat.json",
            json.dumps({"question": question, "answer": answer, "truth": truth}),
        )

    def check_plan(self) -> None:
        """A run directory belongs to one plan: resuming it under another (a newer ladder, other
        video sets) would mix the two silently, so that stops here, before anything runs."""
        plan = self.plan.record()
        marker, summary = self.out / "plan.json", self.out / "summary.json"
        before = (
            json.loads(marker.read_text())
            if marker.exists()
            else json.loads(summary.read_text()).get("plan")
            if summary.exists()
            else None
        )
        if before is not None and _with_defaults(before) != plan:
            raise DemoError(
                f"{self.out} holds a run of another plan (its videos, ladder or sizes differ); "
                "pass --fresh to start it again, or --out for a new directory"
            )
        self.out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(marker, json.dumps(plan, indent=2))

    INPUTS = ("data", "tokenizer", "vq", "tokens")
    """What a run shares with a run of another LM seed: the videos, both tokenizers, the token shards."""

    def link_inputs(self, run: Path) -> None:
        """Link a finished run's inputs (INPUTS) into this one, whose LM stages then start at once.
        The run must agree with this plan in every key the inputs depend on (INPUT_KEYS) and have
        tokenized every set this plan reads; the ladder's recipe and the evaluations may differ."""
        run = run.resolve()
        marker = run / "plan.json"
        if not (run / "tokens/.done").exists() or not marker.exists():
            raise DemoError(
                f"{run} has no finished tokens (tokens/.done) and plan.json to take inputs from"
            )
        ours, before = self.plan.record(), _with_defaults(json.loads(marker.read_text()))
        mine, theirs = _inputs_of(ours), _inputs_of(before)
        needed, made = _tokenized(ours), _tokenized(before)
        differ = [k for k in INPUT_KEYS if mine[k] != theirs[k]]
        if differ or not needed <= made:
            what = ", ".join(differ) or f"sets tokenized: {sorted(needed - made)} missing"
            raise DemoError(
                f"{run} is a run of another plan (its videos, tokenizers or token shards differ: "
                f"{what}): its inputs are not this plan's"
            )
        for name in self.INPUTS:
            dst = self.out / name
            if dst.is_symlink() and dst.resolve() == (run / name).resolve():
                continue
            if dst.exists() or dst.is_symlink():
                raise DemoError(f"{dst} exists already: --inputs-from takes a new --out")
            dst.symlink_to(run / name, target_is_directory=True)
        print(f"inputs (data, tokenizers, token shards) linked from {run}", flush=True)

    def main(self, inputs_from: Path | None = None) -> dict:
        t0 = time.time()
        self.check_plan()
        if inputs_from is not None:
            self.link_inputs(inputs_from)
        self.machine = (
            machine_info()
        )  # measured idle, before the run: what its times are relative to
        print(f"machine: {describe(self.machine)}", flush=True)
        zero = " and ".join(
            f"ZeRO-{z}" for z in sorted({r["zero_stage"] for r in self.plan.ladder})
        )
        t2v = self.plan.t2v_stage is not None
        stages = [
            ("make-data: synthetic shards", self.out / "data/.done", self.make_data),
            ("text tokenizer", self.out / "tokenizer/tokenizer.json", self.tokenizer),
            # the VQ's files are written at every periodic save: only .done says training finished
            ("train-vq", self.out / "vq/.done", self.train_vq),
            ("tokenize", self.out / "tokens/.done", self.tokenize),
            (
                f"train the LM (ring attention over up to "
                f"{max(r['sp'] for r in self.plan.ladder)} processes, {zero})",
                self.out / "lm/final",
                self.train_lm,
            ),
            *(
                [
                    (
                        "train text to video (caption before video)",
                        self.out / "lm/t2v",
                        self.train_t2v,
                    )
                ]
                if t2v
                else []
            ),
            ("export a Hugging Face directory", self.out / "hf/config.json", self.export),
            (  # the needle evaluation's JSON, written last (atomically)
                "evaluate on held-out videos",
                self.out / "eval/video_niah/video_needle.json",
                self.evaluate,
            ),
            *(
                [
                    (
                        "generate videos from held-out captions",
                        self.out / "eval/t2v/t2v.json",
                        self.evaluate_t2v,
                    )
                ]
                if t2v
                else []
            ),
            ("chat", self.out / "chat.json", self.chat),
        ]
        for i, (name, done, fn) in enumerate(stages):
            self.stage(f"{i + 1}/{len(stages)} {name}", done, fn)
        summary = self.summary(time.time() - t0)
        write_text_atomic(self.out / "summary.json", json.dumps(summary, indent=2))
        self.report(summary)
        return summary

    def summary(self, seconds: float) -> dict:
        def load(name: str, *keys: str) -> dict:  # those of `keys` the evaluation's JSON holds
            files = sorted((self.out / "eval" / name).glob("*.json"))
            result = json.loads(files[0].read_text()) if files else {}
            return {k: result[k] for k in keys if k in result}

        chat = (
            json.loads((self.out / "chat.json").read_text())
            if (self.out / "chat.json").exists()
            else {}
        )
        codes = self.out / "vq" / CODES_FILE
        prune = (
            {k: v for k, v in json.loads(codes.read_text()).items() if k not in ("map", "counts")}
            if codes.exists()
            else {}
        )
        return {
            "plan": self.plan.record(),
            "machine": self.machine,
            "seconds": round(seconds, 1),
            "stage_seconds": self.timings,
            "qa": load(
                "qa",
                "accuracy",
                "chance",
                "n",
                "per_question",
                "per_type",
                "lengths",
                "type_grid",
                "chance_grid",
            ),
            "video_niah": load(
                "video_niah",
                "accuracy",
                "chance",
                "n",
                "lengths",
                "grid",
                "needles_dropped",
                "misses",
            ),
            "vq_needle": load(
                "vq_needle",
                "rate",
                "rate_by_offset",
                "shape_colour_rate",
                "shape_colour_chance",
                "shape_kind_rate",
                "shape_kind_chance",
                "lookalikes",
            ),
            "t2v": load(
                "t2v",
                "accuracy",
                "chance",
                "n",
                "shapes_in_order",
                "chance_shapes",
                "first_scene",
                "probe_on_real",
                "settings",
                "tokens_per_s",
            ),
            "chat": chat,
            "prune": prune,
        }

    def report(self, s: dict) -> None:
        def score(r: dict) -> str:
            return f"{r.get('accuracy', float('nan')):.1%}   (chance {r.get('chance', float('nan')):.1%})"

        print("\n=== results", flush=True)
        qa, niah, vq_needle = s["qa"], s["video_niah"], s.get("vq_needle")
        if s.get("prune"):  # docs/hour.md, "Rare codes"
            p = s["prune"]
            print(
                f"codes kept (held >= {p['min_count']} times): {p['codes_kept']} of {p['codes_held']} "
                f"held; {p['share_pruned']:.2%} of the training codes mapped to a kept one"
            )
        if vq_needle:
            print(f"flash colour after the tokenizer: {vq_needle['rate']:.1%}")
            if "shape_kind_rate" in vq_needle:
                print(
                    f"shapes after the tokenizer:      colour {vq_needle['shape_colour_rate']:.1%} "
                    f"(chance {vq_needle['shape_colour_chance']:.1%}), kind "
                    f"{vq_needle['shape_kind_rate']:.1%} (chance {vq_needle['shape_kind_chance']:.1%})"
                )
            if vq_needle.get("lookalikes"):  # docs/hour.md, "Look-alike codes"
                print(
                    "ordinary frames holding a flash's code: "
                    + ", ".join(
                        f"{c} {r['share_any']:.1%} ({r['unique_codes']} of its own)"
                        for c, r in vq_needle["lookalikes"].items()
                    )
                )
        if qa:
            print(f"held-out QA accuracy:          {score(qa)}")
            if qa.get("lengths"):  # per question type and video length, chance beside each
                print("    " + " " * 14 + "".join(f"{length_label(x):>10}" for x in qa["lengths"]))
                for t, r in qa["per_type"].items():
                    cells = [c["accuracy"] for c in r["by_length"].values()]
                    print(
                        f"    {t:<14}"
                        + "".join("         -" if c is None else f"{c:>10.1%}" for c in cells)
                        + f"   (chance {r['chance']:.1%})"
                    )
            else:
                for q, r in (qa.get("per_question") or {}).items():
                    print(f"    {q:<40} {score(r)}")
        if niah:
            print(f"video needle retrieval:        {score(niah)}")
            if niah.get("grid") and niah.get(
                "lengths"
            ):  # grid[depth][length]: one column per length
                cols = zip(niah["lengths"], zip(*niah["grid"]))
                print(
                    "    by length: "
                    + ", ".join(f"{n} frames {sum(c) / len(c):.0%}" for n, c in cols)
                )
            misses = niah.get("misses")
            if misses and any(m["wrong"] for m in misses.values()):
                print(
                    "    trials missed at every depth (one background, one colour): "
                    + ", ".join(
                        f"{m['trials_missed_at_every_depth']} of {m['trials']}"
                        for m in misses.values()
                    )
                )
                longest = max(misses, key=int)
                if by_colour := misses[longest].get("by_colour"):
                    print(
                        f"    by flash colour at {longest} frames: "
                        + ", ".join(f"{c} {v['right']}/{v['asked']}" for c, v in by_colour.items())
                    )
            if misses and all("read" in m for m in misses.values()):  # the control ran
                print(
                    "    read (the answer differs from the bare background's), of the decidable: "
                    + ", ".join(
                        f"{n} frames {m['read']}/{m['decidable']}" for n, m in misses.items()
                    )
                )
            if niah.get("needles_dropped"):
                print(
                    f"    warning: {niah['needles_dropped']} needles did not fit the model's context (guesses)"
                )
        t2v = s.get("t2v")
        if t2v:
            print(
                f"text to video, colours in order: {t2v['accuracy']:.1%}   (chance "
                f"{t2v['chance']:.1%}) over {t2v['n']} held-out captions; colours and shapes in "
                f"order {t2v['shapes_in_order']:.1%} (chance {t2v['chance_shapes']:.1%}); grid: "
                "eval/t2v/t2v.png"
            )
        print(
            f"artefacts under {self.out}: eval/*/ (JSON + PNG), hf/ (Hugging Face export), "
            "lm/ (checkpoints, loss curves)"
        )
        on = f" on {describe(s['machine'])}" if s.get("machine") else ""
        print(f"demo time: {s['seconds'] / 60:.1f} min{on}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m longvideo.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = ap.add_mutually_exclusive_group()
    which.add_argument(
        "--quick", action="store_true", help="the CI-sized version (configs/demos/demo-quick.yaml)"
    )
    which.add_argument(
        "--hour",
        action="store_true",
        help="the hour demo: hour-long videos in one context "
        "(make demo-hour, configs/demos/demo-hour.yaml)",
    )
    which.add_argument(
        "--plan", metavar="FILE", help="a plan file of your own (see configs/demos/demo.yaml)"
    )
    ap.add_argument(
        "--out",
        default=None,
        help="where everything goes (default runs/<plan name>: runs/demo, "
        "runs/demo-hour, runs/demo-quick)",
    )
    ap.add_argument("--fresh", action="store_true", help="delete --out first")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the language model's seed (train.seed of every stage; the videos and VQ keep theirs)",
    )
    ap.add_argument(
        "--vq-seed",
        type=int,
        default=None,
        help="the VQ's seed (its initial weights and frame sampling; recorded in the plan)",
    )
    ap.add_argument(
        "--inputs-from",
        type=Path,
        default=None,
        metavar="RUN",
        help="link a finished run's videos, tokenizers and token shards instead of making them "
        "(a run of the same videos and tokenizers: another --seed, other rung overrides); "
        "--out must be new",
    )
    a = ap.parse_args(argv)
    path = a.plan or f"demos/demo{'-hour' if a.hour else '-quick' if a.quick else ''}"
    try:
        plan = load_plan(path)
        plan = replace(
            plan,
            **{k: v for k, v in (("lm_seed", a.seed), ("vq_seed", a.vq_seed)) if v is not None},
        )
    except (ConfigError, FileNotFoundError) as e:
        print(f"demo: plan {path}: {e}", file=sys.stderr)
        return 2
    out = Path(a.out or f"runs/{Path(path).stem}").resolve()
    if a.fresh and out.exists():
        shutil.rmtree(out)
    try:
        Demo(out, plan, quiet=a.quiet).main(inputs_from=a.inputs_from)
    except DemoError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
