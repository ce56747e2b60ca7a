"""Step time of the trainer under DeepSpeed ZeRO-1, 2 and 3 at dp = 2 on CPU: what sharding the
parameters costs a model whose parameters fit anywhere.

    python scripts/bench_zero.py                              # the two demo cases below, ~6 minutes
    python scripts/bench_zero.py --cases tiny:1024 --steps 100

Each case is a `longvideo train` run under torchrun (2 processes, one thread each, gloo, sp = 1, so
dp = 2 and one row a process a step) on generated tokens, once per ZeRO stage, with everything else
equal: fp32, AdamW, no activation checkpointing, the same seed. The figure is the median step time
(forward, backward, the stage's collectives and AdamW) after the first `--warmup` steps, and the
loss at the last step, which must agree between the stages (they compute the same update).

Cases (config:sequence length): `tiny:1024` is `make demo`'s 1K rungs (1.1M parameters) and
`hour:2048` the 2K rungs of `make demo-hour`. Writes docs/bench/zero.json and docs/bench/zero.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# ------------------------------------------------------------------------------------------- report
# Read by run_benchmarks.py to build docs/benchmarks.md: the title, what is measured, the detail docs
# under docs/ (the first that exists is linked), the targets (the summary rows while nothing is
# measured) and report(), which turns this script's JSON into a table, the targets met or not, and
# notes.

from benchreport import Section, Target, fmt_num, md_table, ratio, req_list, yes_no  # noqa: E402

TITLE = "ZeRO stages: step time of the demo's short rungs"
MEASURES = ("Median training-step time of `longvideo train` at dp = 2 on CPU under ZeRO-1, 2 and 3 (same model, "
            "data and seed), as ratios to ZeRO-3, for the demos' sp = 1 rungs.")
DOCS = ["training.md", "hour.md"]
TARGETS = [Target("zero: ZeRO-2 / ZeRO-3 step time at dp = 2, demo rungs",
                  "< 1 in every case (the stage the demos' sp = 1 rungs use is the cheaper)")]


def report(result: dict) -> Section:
    t = Target(TARGETS[0].what, TARGETS[0].goal)
    rows, body, ratios = req_list(result, "results"), [], {}
    by_case: dict[str, dict[int, dict]] = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[int(r["zero_stage"])] = r
    for case, stages in by_case.items():
        base = stages.get(3, {}).get("median_s")
        for z in sorted(stages):
            r = stages[z]
            body.append([case, f"ZeRO-{z}", fmt_num(r.get("median_s"), ".3f"),
                         fmt_num(ratio(r.get("median_s"), base), ".2f"), fmt_num(r.get("loss"), ".4f"),
                         r.get("error", "")[:80]])
        q = ratio(stages.get(2, {}).get("median_s"), base)
        if q is not None:
            ratios[case] = q
    if ratios:
        t.figure = ", ".join(f"{c} {q:.2f}x" for c, q in ratios.items())
        t.met = yes_no(all(q < 1 for q in ratios.values()))
    notes = [f"{result.get('steps', '?')} steps a run, the first {result.get('warmup', '?')} not counted; 2 "
             "processes with one thread each. The stages compute the same update: the last losses agree."]
    return Section(md_table(["case", "stage", "median step s", "/ ZeRO-3", "last loss", "error"], body), [t], notes)


def run_case(config: str, seq: int, stage: int, steps: int, warmup: int, out_dir: Path) -> dict:
    """One `longvideo train` run; its median step time and last loss from metrics.jsonl."""
    from longvideo.train.logging import read_metrics

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "longvideo", "train", "--config", config, f"data.seq_len={seq}", f"model.max_seq_len={seq}",
           "parallel.sp=1", f"train.zero_stage={stage}", f"train.steps={steps}", "train.warmup_steps=5",
           "train.micro_batch_size=1", "train.grad_accum=1", f"train.checkpoint_every={steps * 10}",
           "train.progress=false", "model.activation_checkpointing=false", f"train.out_dir={out_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
    row = dict(case=f"{config}:{seq}", zero_stage=stage)
    if r.returncode:
        return dict(row, error=(r.stderr or r.stdout)[-300:])
    m = [r for r in read_metrics(out_dir) if "step_time" in r]
    times = [x["step_time"] for x in m[warmup:]]
    return dict(row, median_s=statistics.median(times), mean_s=statistics.fmean(times), steps=len(times),
                loss=m[-1]["loss"])


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = list(dict.fromkeys(r["case"] for r in rows))
    stages = sorted({r["zero_stage"] for r in rows})
    fig, ax = plt.subplots(figsize=(6, 3.2))
    w = 0.8 / len(stages)
    for j, z in enumerate(stages):
        ys = [next((r.get("median_s", 0) for r in rows if r["case"] == c and r["zero_stage"] == z), 0) for c in cases]
        ax.bar([i + j * w for i in range(len(cases))], ys, w, label=f"ZeRO-{z}")
    ax.set_xticks([i + w * (len(stages) - 1) / 2 for i in range(len(cases))], cases)
    ax.set_ylabel("median step (s)")
    ax.set_title("training step at dp = 2 on CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="tiny:1024,hour:2048", help="config:sequence length, comma-separated")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="first steps not counted")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "zero.json")
    args = p.parse_args(argv)
    from longvideo.machine import describe, machine_info

    machine = machine_info()
    print(describe(machine), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            config, seq = case.rsplit(":", 1)
            for z in (int(s) for s in args.stages.split(",")):
                row = run_case(config, int(seq), z, args.steps, args.warmup, Path(tmp) / f"{config}-{seq}-z{z}")
                rows.append(row)
                print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    drawn = plot(rows, args.out.with_suffix(".png"))
    result = dict(benchmark="training step time under ZeRO-1/2/3 at dp = 2 on CPU", machine=describe(machine),
                  machine_info=machine, steps=args.steps, warmup=args.warmup, plot=drawn, results=rows)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
