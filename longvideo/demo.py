"""`make demo`: train a tiny long-video model on CPU from nothing and question it on unseen videos.

Every stage runs the same command a user would type, so the demo is also a tour of the CLI:

  1. make-data      synthetic mp4 shards (train and held-out) with captions, QA and a needle frame
  2. tokenizer      a small byte-level BPE trained on the dataset's own text
  3. train-vq       the tiny VQ video tokenizer
  4. tokenize       raw shards -> token shards (training never decodes video)
  5. train          the tiny LM through a context ladder (each stage starts from the previous one's
                    weights): short rungs two rows a step (dp = 2, ZeRO-2), long rungs with ring
                    attention over 2 processes (sp = 2, ZeRO-3)
  6. eval           QA accuracy and video needle retrieval on held-out videos (JSON + PNG, chance)
  7. export         a Hugging Face directory, reloaded with transformers
  8. chat           one question about a held-out video, through `longvideo chat`

Stages whose outputs exist are skipped, so an interrupted demo continues where it stopped.

    python -m longvideo.demo                 # the full demo (about 26 minutes on an idle 2-core CPU)
    python -m longvideo.demo --quick         # the CI-sized version (about 6.5 minutes)
    python -m longvideo.demo --seed 1 --inputs-from runs/demo --out runs/demo-seed1
                                             # the language model again with another seed, on the
                                             # first run's videos, tokenizers and token shards
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

from longvideo.checkpoint import latest_checkpoint
from longvideo.config import load_config
from longvideo.data.synthetic import SyntheticSpec, make_sample, text_corpus
from longvideo.export import LongVideoProcessor
from longvideo.machine import describe, machine_info
from longvideo.tokenizer import TextTokenizer
from longvideo.train.run_state import STATE_FILE
from longvideo.parallel.deepspeed_config import load_base, resolve_zero_stage


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class Stage:
    """One rung of the context ladder: every stage starts from the previous one's weights."""

    seq_len: int
    """Tokens per training row."""
    steps: int
    """Optimizer steps."""
    rope_theta: float
    """RoPE base of this stage (raised with the context)."""
    sets: tuple[str, ...]
    """VideoSet names whose token shards the stage reads."""
    sp: int = 2
    """Ring size: the row is sharded over sp processes (the rest of the processes is dp)."""
    lr: float = 1e-3
    """Peak learning rate."""
    zero_stage: int = 3
    """DeepSpeed ZeRO stage. The ring rungs shard parameters too (ZeRO-3); a rung with no ring
    (sp = 1, dp = 2) shards gradients and optimizer state (ZeRO-2): at the demos' sizes gathering
    the parameters costs a quarter of a step (scripts/bench_zero.py) and saves no memory that
    matters."""
    config: str = ""
    """A stage config (configs/stages/*.yaml) the run starts from; the fields above then come from it."""

    @classmethod
    def from_config(cls, config: str, sets: tuple[str, ...]) -> "Stage":
        """A rung as a shipped stage config describes it (the config stays the one source)."""
        c = load_config(config)
        zero = resolve_zero_stage(c.train, load_base(c.train.deepspeed_config))
        return cls(c.data.seq_len, c.train.steps, c.model.rope_theta, sets, c.parallel.sp, c.train.lr, zero, config)


@dataclass(frozen=True)
class DemoPlan:
    """Sizes of one demo run."""

    sets: tuple[VideoSet, ...]
    """Training and held-out video sets."""
    held_out: str
    """The VideoSet scored by the QA evaluation (never trained on)."""
    stages: tuple[Stage, ...]
    """The context ladder."""
    source_fps: int = 8
    """Frame rate of the written videos (all are read at 1 fps)."""
    needle_fraction: float = 1.0
    """Fraction of videos with a flash frame and its question. Every video carries one: a tiny model
    learns to find the needle from a few hundred examples, not from half as many (measured: held-out
    needle answers 59 % right after 800 steps at 0.5, 100 % at 1.0)."""
    tokenizer_vocab: int = 384
    """Text ids of the BPE tokenizer."""
    lm_config: str = "tiny"
    """The root config of the language model (its `vq:` section has the shape of vq_config)."""
    vq_config: str = "vq/tiny.yaml"
    """The video tokenizer's config."""
    vq_set: str = "train"
    """The VideoSet the VQ trains on."""
    vq_seconds: float = 200.0
    """Most training time of the VQ tokenizer."""
    vq_steps: int = 1500
    """Most VQ steps (whichever comes first). A run stopped by its step count is reproducible (the
    same weights, bit for bit, on one machine); one stopped by the clock is not: its learning rate
    follows the elapsed time, so each run's codes differ, and the language model's answers with them."""
    eval_samples: int = 64
    """Held-out QA samples scored."""
    needle_lengths: tuple[int, ...] = (8, 16, 40)
    """Video lengths (frames at 1 fps) of the video needle grid."""
    needle_depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    """Needle depths of the video needle grid."""
    needle_trials: tuple[int, ...] = ()
    """Trials per length of the needle grid (empty: one per needle colour)."""
    eval_sp: int = 1
    """Processes of the needle evaluation (> 1: prefill by ring attention over them)."""
    vq_needle_trials: int = 0
    """Trials of `eval vq-needle` (does a flash survive the tokenizer?); 0: not run."""
    chat_seconds: int = 12
    """Length of the held-out video `longvideo chat` answers about."""
    nproc: int = 2
    """Processes of the language-model training."""
    training: tuple[str, ...] = ("data.template_mode=first", "data.qa_vision_loss=false",
                                 "model.activation_checkpointing=false")
    """Overrides of every LM stage. By default a tiny budget goes to what the demo asks: answers.
    QA documents only, and their video is prompt (no vision loss), so every loss token is an
    answer token. Nothing is recomputed in the backward: the tiny model's activations at 1-4K tokens
    are a few tens of MB (peak 1.18 GB a process at 4K without checkpointing, 1.13 GB with it at 1K),
    and 1K-token steps take 0.26 s instead of 0.37 s."""
    lm_seed: Optional[int] = None
    """`train.seed` of every LM stage (initial weights and data order); None keeps the configs' (0).
    The videos and the VQ do not depend on it, so runs of several seeds (`--seed`, `--inputs-from`)
    compare the language model alone."""

    def video_set(self, name: str) -> VideoSet:
        return next(v for v in self.sets if v.name == name)


def _classic(train: int, test: int, max_seconds: int, long_seconds: int, stages, *, clips: int = 0,
             **kw) -> DemoPlan:
    sets = (VideoSet("train", train, 0, 4, max_seconds, 0.1, long_seconds),
            VideoSet("test", test, 1, 4, max_seconds, 0.1, long_seconds))
    if clips:  # 2-4 second clips, one or two scenes: a shape label every ~200 tokens
        sets = (VideoSet("clips", clips, 2, 2, 4),) + sets
    return DemoPlan(sets=sets, held_out="test", stages=stages, chat_seconds=max_seconds, **kw)


FULL = _classic(600, 256, 12, 40, (Stage(1024, 2000, 1e4, ("clips",), sp=1, zero_stage=2),
                                  Stage(1024, 1500, 1e4, ("train",), sp=1, zero_stage=2),
                                  Stage(2048, 150, 1e5, ("train",), lr=1e-3 / 3), Stage(4096, 60, 1e5, ("train",), lr=1e-3 / 3)),
                clips=12000, needle_trials=(20, 20, 20), eval_samples=256, vq_seconds=480.0)
"""`make demo`. Its first rung reads 12,000 clips of 2-4 seconds (one or two scenes, about five to a
1,024-token row) for 2,000 steps: "What shape came first?" needs thousands of examples of shapes
(measured: a classifier over one frame's 64 codes reads the shape 68 % right from 600 frames, 82 %
from 2,000, 91 % from 8,000) and the 600 training videos give 600, each among 4-12 seconds of other
scenes. The clips' rung is where the first shape is learnt, and it was short of steps, not of a
better signal (first shape on 128 held-out clips after the clips' rung alone: 1,000 steps 64.8 %,
training clips 74.2 %; 2,000 steps 74.2 %, training clips 82.0 %; lr 2e-3 instead of 1e-3 56.2 %;
the timed-segment captions beside the questions 68.8 %; one-scene clips of 1-2 seconds 37.5 %).
The rung on the 600 videos then runs dp = 2 (two rows a step): the scene questions need about
three times the rows the needle does (1,000 rows give the needle 100 % but the last shape's colour
28 %; 3,000 rows give 98 % and 88 %). RoPE theta rises once, at 2K, and stays at 1e5 for 4K: each
switch costs the scene questions (last colour 90.6 % after the 1K rungs, 84.4 % after 2K, 75.0 %
after a 4K rung at 1e6), and 1e4 throughout kept the last colour (90.6 %) but not the first shape
(56.2 %). Whole runs on 2 cores (needle / last colour / first shape): this plan, 256 held-out
videos, 100 / 94.1 / 81.2 % in 25.6 minutes (a second run 97.2 / 93.4 / 78.1 %); the same plan with
no flash frame in the clips (a flash hides one of a clip's 2-4 shape frames, and first-shape errors
are circle-square confusions, more of them when fewer first-scene frames are visible), on a slower
AVX2-only machine, 98.9 / 78.5 / 80.1 % in 38.1 minutes: the first shape did not move and the last
colour fell, so the clips keep their flashes; this plan with its 1K rungs under ZeRO-2, on that
AVX2-only machine, 97.2 / 90.6 / 69.9 % in 32.6 minutes and 98.9 / 88.7 / 73.4 % in 33.6; there, with the output
head on weighted tokens only and the loader's shard indexes kept (a 1K step 0.24 s instead of 0.31 s), a VQ
stopped by the clock at 1,427 steps gave 98.9 / 84.4 / 39.5 % in 30.4 minutes, and the VQ stopped by its
1,500 steps (the same weights, bit for bit, as the 73.4 % run's) 98.9 / 89.8 / 82.8 % in 29.4: the VQ moves
the first shape most, the language model's run-to-run spread (summation order) still about ten points; 1,000 clip steps on 6,000 clips with activation
checkpointing, 64 videos, 97.8 / 92.2 / 65.6 % in 20.8; the plan before the clips 99.4 / 60.9 /
35.9 % in 15.8. Before the clips, more first-rung steps (2,500), theta 1e4 on every rung, a wider
model (dim 192), timestamps, lr 2e-3 or captions beside the questions left the first shape at
31-52 %."""
HOUR = DemoPlan(
    sets=(VideoSet("brief", 800, 15, 10, 40), VideoSet("short", 320, 10, 60, 240), VideoSet("mid", 48, 11, 300, 900), VideoSet("long", 16, 12, 1800, 3600),
          VideoSet("test", 32, 13, 60, 240), VideoSet("vq", 240, 14, 60, 240, flashes_per_minute=10.0)),
    held_out="test", source_fps=1, lm_config="hour", vq_config="vq/causal3d-hour.yaml", vq_set="vq",
    vq_seconds=480.0, vq_steps=3000, tokenizer_vocab=384,
    stages=(Stage.from_config("stages/hour-brief", ("brief",)), Stage.from_config("stages/hour-2k", ("short",)), Stage.from_config("stages/hour-4k", ("short", "mid")),
            Stage.from_config("stages/hour-20k", ("mid", "long"))),
    eval_samples=32, needle_lengths=(60, 300, 900, 1800, 3600), needle_depths=(0.0, 0.25, 0.5, 0.75, 1.0),
    needle_trials=(20, 20, 20, 8, 8), eval_sp=2, chat_seconds=3600, vq_needle_trials=64)
"""`make demo-hour`: hour-long videos in one context (about 18.4K tokens per hour)."""
QUICK = _classic(96, 12, 8, 16, (Stage(512, 400, 1e4, ("train",)), Stage(1024, 20, 1e5, ("train",), lr=1e-3 / 3)),
                 tokenizer_vocab=320, vq_seconds=40.0, vq_steps=150, eval_samples=12, needle_lengths=(8, 16),
                 needle_depths=(0.0, 1.0))

ROOT = Path(__file__).resolve().parent.parent


class DemoError(RuntimeError):
    pass


def finished_step(run_dir: Path) -> int:
    """The step of the run's latest complete checkpoint (0 when it has none)."""
    ckpt = latest_checkpoint(run_dir)
    return int(json.loads((ckpt / STATE_FILE).read_text())["step"]) if ckpt is not None else 0


class Demo:
    def __init__(self, out: Path, plan: DemoPlan, quiet: bool = False):
        self.out, self.plan, self.quiet = out, plan, quiet
        self.timings: dict[str, float] = {}
        self.machine: dict | None = None
        self.env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
                        TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                        PYTHONUNBUFFERED="1")

    # ---- helpers ----------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        print(f"\n=== {msg}", flush=True)

    def run(self, args: list[str], *, threads: int | None = None) -> None:
        env = dict(self.env)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        cmd = [str(a) for a in args]
        print("$ " + " ".join(cmd if cmd[0] != sys.executable else ["python"] + cmd[1:]), flush=True)
        r = subprocess.run(cmd, env=env, cwd=str(ROOT))
        if r.returncode != 0:
            raise DemoError(f"command failed with exit code {r.returncode}: {' '.join(cmd)}")

    def lv(self, *args, threads: int | None = None) -> None:
        self.run([sys.executable, "-m", "longvideo", *args], threads=threads)

    def stage(self, name: str, done: Path, fn) -> None:
        if done.exists():
            print(f"=== {name}: done already ({done.relative_to(self.out)}), skipped", flush=True)
            return
        self.say(name)
        t0 = time.time()
        fn()
        self.timings[name] = round(time.time() - t0, 1)
        print(f"--- {name}: {self.timings[name]:.0f} s", flush=True)

    # ---- stages ---------------------------------------------------------------------------------
    def spec(self, v: VideoSet, **kw) -> SyntheticSpec:
        return SyntheticSpec(fps=self.plan.source_fps, min_seconds=v.min_seconds, max_seconds=v.max_seconds,
                             long_fraction=v.long_fraction, long_seconds=v.long_seconds,
                             needle_fraction=self.plan.needle_fraction, **kw)

    def make_data(self) -> None:
        for v in self.plan.sets:
            self.lv("make-data", "synthetic", "--out", self.out / "data" / v.name, "--n", v.n, "--seed", v.seed,
                    "--fps", self.plan.source_fps, "--min-seconds", v.min_seconds, "--max-seconds", v.max_seconds,
                    "--long-fraction", v.long_fraction, "--long-seconds", v.long_seconds,
                    "--needle-fraction", self.plan.needle_fraction, "--flashes-per-minute", v.flashes_per_minute,
                    "--samples-per-shard", 64, "--workers", 2,
                    *(["--quiet"] if self.quiet else []))
        (self.out / "data/.done").touch()

    def tokenizer(self) -> None:
        texts = []
        for v in self.plan.sets:
            texts += text_corpus(n=400 // len(self.plan.sets) + 1, seed=v.seed, spec=self.spec(v))
        corpus = self.out / "tokenizer_corpus.txt"
        corpus.write_text("\n".join(texts) + "\n")
        self.lv("train-tokenizer", "--texts", corpus, "--vocab-size", self.plan.tokenizer_vocab,
                "--out", self.out / "tokenizer")

    def train_vq(self) -> None:
        self.lv("train-vq", "--config", self.plan.vq_config, "--data", self.out / "data" / self.plan.vq_set,
                "--out", self.out / "vq", "--steps", self.plan.vq_steps, "--time-budget", self.plan.vq_seconds,
                "--no-tensorboard", *(["--quiet"] if self.quiet else []))

    def tokenize(self) -> None:
        used = {name for st in self.plan.stages for name in st.sets} | {self.plan.held_out}
        for v in (v for v in self.plan.sets if v.name in used):  # a set only the VQ trains on is not tokenized
            self.lv("tokenize", "--vq", self.out / "vq", "--in", self.out / "data" / v.name,
                    "--out", self.out / "tokens" / v.name, "--config", self.plan.lm_config, "--workers", 2,
                    *(["--quiet"] if self.quiet else []))
        (self.out / "tokens/.done").touch()

    def text_size(self) -> int:
        return TextTokenizer.from_dir(self.out / "tokenizer").text_size

    def train_lm(self) -> None:
        p = self.plan
        prev = None
        for i, st in enumerate(p.stages):
            run_dir = self.out / f"lm/stage{i}-{st.seq_len}"
            reached = finished_step(run_dir)
            if reached >= st.steps:
                print(f"stage {st.seq_len}: done already (step {reached})", flush=True)
                prev = run_dir
                continue
            names = st.sets[0] if len(st.sets) == 1 else "{" + ",".join(st.sets) + "}"
            shards = self.out / "tokens" / names
            ladder = [] if st.config else [  # a stage config holds these itself
                f"model.max_seq_len={st.seq_len}", f"model.rope_theta={st.rope_theta}", f"data.seq_len={st.seq_len}",
                f"parallel.sp={st.sp}", f"train.steps={st.steps}", f"train.warmup_steps={max(1, st.steps // 10)}",
                f"train.lr={st.lr}", f"train.checkpoint_every={st.steps}", f"train.zero_stage={st.zero_stage}",
                "train.micro_batch_size=1", *p.training]
            seed = [] if p.lm_seed is None else [f"train.seed={p.lm_seed}"]
            overrides = [
                f"model.text_vocab_size={self.text_size()}", f"data.train_shards={shards}", *ladder, *seed,
                f"train.tokenizer_dir={self.out / 'tokenizer'}", f"train.vq_dir={self.out / 'vq'}",
                f"train.out_dir={run_dir}",
            ]
            if self.quiet:
                overrides.append("train.progress=false")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={p.nproc}",
                   "-m", "longvideo", "train", "--config", st.config or p.lm_config, *overrides]
            if reached > 0:  # stopped part-way (SIGTERM, a crash): continue from its last checkpoint
                cmd.append("--resume")
            elif prev is not None:
                cmd += ["--init-from", prev]
            print(f"--- stage {i + 1}/{len(p.stages)}: context {st.seq_len}, sp {st.sp}, ZeRO-{st.zero_stage}, "
                  f"RoPE theta {st.rope_theta:g}, {st.steps} steps", flush=True)
            self.run(cmd, threads=1)
            prev = run_dir
        (self.out / "lm/final").write_text(str(prev))

    def final_lm(self) -> Path:
        return Path((self.out / "lm/final").read_text().strip())

    def export(self) -> None:
        self.lv("export", "--ckpt", self.final_lm(), "--out", self.out / "hf")

    def evaluate(self) -> None:
        p = self.plan
        quiet = ["--quiet"] if self.quiet else []
        self.lv("eval", "qa", "--model", self.out / "hf", "--shards", self.out / "tokens" / p.held_out,
                "--max-samples", p.eval_samples, "--out", self.out / "eval/qa", *quiet)
        needle = ["eval", "video-niah", "--model", self.out / "hf", "--out", self.out / "eval/video_niah",
                  "--lengths", ",".join(map(str, p.needle_lengths)), "--depths", ",".join(map(str, p.needle_depths)),
                  "--source-fps", p.source_fps, *quiet]
        if p.vq_needle_trials:
            self.lv("eval", "vq-needle", "--model", self.out / "vq", "--out", self.out / "eval/vq_needle",
                    "--frames", 120, "--trials", p.vq_needle_trials, *quiet)
        if p.needle_trials:
            needle += ["--trials", ",".join(map(str, p.needle_trials))]
        if p.eval_sp > 1:  # every prompt's video prefilled by ring attention over eval_sp processes
            self.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={p.eval_sp}",
                      "-m", "longvideo", *needle], threads=1)
        else:
            self.lv(*needle)

    def held_out_video(self) -> tuple[Path, dict]:
        """One held-out needle video, written as a plain mp4 file (what a user would bring)."""
        spec = SyntheticSpec(fps=self.plan.source_fps, min_seconds=self.plan.chat_seconds,
                             max_seconds=self.plan.chat_seconds, needle_fraction=1.0, long_fraction=0.0)
        sample = make_sample(seed=7, index=0, spec=spec)
        path = self.out / "held_out.mp4"
        path.write_bytes(sample.mp4())
        return path, sample.meta

    def chat(self) -> None:
        video, meta = self.held_out_video()
        question = meta["qa"][0]["question"]
        self.lv("chat", "--model", self.out / "hf", "--video", video, "--fps", 1, "--question", question,
                "--max-new-tokens", 8, *(["--quiet"] if self.quiet else []))
        print(f"(the true answer: {meta['qa'][0]['answer']})", flush=True)
        self.transformers_answer(video, question, meta["qa"][0]["answer"])

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
        print(f"transformers.AutoModelForCausalLM + LongVideoProcessor: Q: {question}  A: {answer}  "
              f"(truth: {truth})", flush=True)
        (self.out / "chat.json").write_text(json.dumps({"question": question, "answer": answer, "truth": truth}))

    # ---- driver -------------------------------------------------------------------------------
    def plan_record(self) -> dict:
        """The plan as plan.json records it (tuples as lists)."""
        return json.loads(json.dumps(asdict(self.plan)))

    def check_plan(self) -> None:
        """A run directory belongs to one plan: resuming it under another (a newer ladder, other
        video sets) would mix the two silently, so that stops here, before anything runs."""
        plan = self.plan_record()
        marker, summary = self.out / "plan.json", self.out / "summary.json"
        before = json.loads(marker.read_text()) if marker.exists() else \
            json.loads(summary.read_text()).get("plan") if summary.exists() else None
        if before is not None:
            before.setdefault("lm_seed", None)  # recorded before plans had a seed: the configs' seed
        if before is not None and before != plan:
            raise DemoError(f"{self.out} holds a run of another plan (its videos, ladder or sizes differ); "
                            "pass --fresh to start it again, or --out for a new directory")
        self.out.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps(plan, indent=2))

    INPUTS = ("data", "tokenizer", "vq", "tokens")
    """What a run shares with a run of another LM seed: the videos, both tokenizers, the token shards."""

    def link_inputs(self, run: Path) -> None:
        """Link a finished run's inputs (INPUTS) into this one, whose LM stages then start at once.
        The run must be of this plan up to the LM seed, and have tokenized everything."""
        run = run.resolve()
        marker = run / "plan.json"
        if not (run / "tokens/.done").exists() or not marker.exists():
            raise DemoError(f"{run} has no finished tokens (tokens/.done) and plan.json to take inputs from")
        mine, theirs = self.plan_record(), json.loads(marker.read_text())
        for record in (mine, theirs):
            record.pop("lm_seed", None)
        if mine != theirs:
            raise DemoError(f"{run} is a run of another plan (its videos, tokenizers or sizes differ): "
                            "its inputs are not this plan's")
        for name in self.INPUTS:
            dst = self.out / name
            if dst.is_symlink() and dst.resolve() == (run / name).resolve():
                continue
            if dst.exists() or dst.is_symlink():
                raise DemoError(f"{dst} exists already: --inputs-from takes a new --out")
            dst.symlink_to(run / name, target_is_directory=True)
        print(f"inputs (data, tokenizers, token shards) linked from {run}", flush=True)

    def main(self, inputs_from: Optional[Path] = None) -> dict:
        t0 = time.time()
        self.check_plan()
        if inputs_from is not None:
            self.link_inputs(inputs_from)
        self.machine = machine_info()  # measured idle, before the run: what its times are relative to
        print(f"machine: {describe(self.machine)}", flush=True)
        self.stage("1/8 make-data: synthetic shards", self.out / "data/.done", self.make_data)
        self.stage("2/8 text tokenizer", self.out / "tokenizer/tokenizer.json", self.tokenizer)
        self.stage("3/8 train-vq", self.out / "vq/model.safetensors", self.train_vq)
        self.stage("4/8 tokenize", self.out / "tokens/.done", self.tokenize)
        zero = " and ".join(f"ZeRO-{z}" for z in sorted({st.zero_stage for st in self.plan.stages}))
        self.stage(f"5/8 train the LM (ring attention over up to {max(st.sp for st in self.plan.stages)} processes, "
                   f"{zero})", self.out / "lm/final", self.train_lm)
        self.stage("6/8 export a Hugging Face directory", self.out / "hf/config.json", self.export)
        self.stage("7/8 evaluate on held-out videos", self.out / "eval/video_niah", self.evaluate)
        self.stage("8/8 chat", self.out / "chat.json", self.chat)
        summary = self.summary(time.time() - t0)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        self.report(summary)
        return summary

    def summary(self, seconds: float) -> dict:
        def load(name):
            files = sorted((self.out / "eval" / name).glob("*.json"))
            return json.loads(files[0].read_text()) if files else {}

        qa, niah, vq_needle = load("qa"), load("video_niah"), load("vq_needle")
        chat = json.loads((self.out / "chat.json").read_text()) if (self.out / "chat.json").exists() else {}
        return {"plan": asdict(self.plan), "machine": self.machine, "seconds": round(seconds, 1),
                "stage_seconds": self.timings,
                "qa": {k: qa.get(k) for k in ("accuracy", "chance", "n", "per_question") if k in qa},
                "video_niah": {k: niah.get(k) for k in ("accuracy", "chance", "n", "lengths", "grid", "needles_dropped")
                               if k in niah},
                "vq_needle": {k: vq_needle.get(k) for k in ("rate", "rate_by_offset") if k in vq_needle},
                "chat": chat}

    def report(self, s: dict) -> None:
        self.say("results")
        qa, niah, vq_needle = s["qa"], s["video_niah"], s.get("vq_needle")
        if vq_needle:
            print(f"flash colour after the tokenizer: {vq_needle['rate']:.1%}")
        if qa:
            print(f"held-out QA accuracy:          {qa.get('accuracy', float('nan')):.1%}   (chance {qa.get('chance', float('nan')):.1%})")
            for q, r in (qa.get("per_question") or {}).items():
                print(f"    {q:<40} {r.get('accuracy', float('nan')):.1%}   (chance {r.get('chance', float('nan')):.1%})")
        if niah:
            print(f"video needle retrieval:        {niah.get('accuracy', float('nan')):.1%}   (chance {niah.get('chance', float('nan')):.1%})")
            if niah.get("grid") and niah.get("lengths"):  # grid[depth][length]: one column per length
                cols = zip(niah["lengths"], zip(*niah["grid"]))
                print("    by length: " + ", ".join(f"{n} frames {sum(c) / len(c):.0%}" for n, c in cols))
            if niah.get("needles_dropped"):
                print(f"    warning: {niah['needles_dropped']} needles did not fit the model's context (guesses)")
        print(f"artefacts under {self.out}: eval/*/ (JSON + PNG), hf/ (Hugging Face export), lm/ (checkpoints, loss curves)")
        print(f"demo time: {s['seconds'] / 60:.1f} min" + (f" on {describe(s['machine'])}" if s.get("machine") else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m longvideo.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="where everything goes (default runs/demo, runs/demo-hour)")
    ap.add_argument("--quick", action="store_true", help="the CI-sized version")
    ap.add_argument("--hour", action="store_true", help="the hour demo: hour-long videos in one context (make demo-hour)")
    ap.add_argument("--fresh", action="store_true", help="delete --out first")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--seed", type=int, default=None,
                    help="the language model's seed (train.seed of every stage; the videos and VQ keep theirs)")
    ap.add_argument("--inputs-from", type=Path, default=None, metavar="RUN",
                    help="link a finished run's videos, tokenizers and token shards instead of making them "
                         "(a run of the same plan, e.g. another --seed); --out must be new")
    a = ap.parse_args(argv)
    out = Path(a.out or ("runs/demo-hour" if a.hour else "runs/demo")).resolve()
    if a.fresh and out.exists():
        shutil.rmtree(out)
    plan = HOUR if a.hour else QUICK if a.quick else FULL
    if a.seed is not None:
        plan = replace(plan, lm_seed=a.seed)
    try:
        Demo(out, plan, quiet=a.quiet).main(inputs_from=a.inputs_from)
    except DemoError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
