#!/usr/bin/env python
"""Why a needle colour is missed: a trained model's video needle grid with the flash's look-alike
codes kept, scrubbed and added (docs/hour.md, "Look-alike codes").

    python scripts/needle_lookalikes.py --model runs/demo-hour/hf --out runs/lookalikes
    python scripts/needle_lookalikes.py --out runs/lookalikes --skip-run   # only the summary

Runs `longvideo eval video-niah` once per edit (`--lookalikes keep`, `scrub`, `add`) on the same
backgrounds, flashes and depths, over `--nproc` processes (ring prefill, as the demo evaluates),
each into OUT/<edit>/; then writes OUT/lookalikes.json (per edit, length and flash colour: right of
asked) and OUT/lookalikes.png (one panel a length, a bar per colour and edit). The edits know where
the flash is: the scores say what the look-alikes cost, not how well the model finds a needle.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

EDITS = ("keep", "scrub", "add")


def summarise(grids: dict[str, dict]) -> dict:
    """{edit: video_needle.json} -> per edit: per length (as a string) the right and asked of
    every flash colour and of all of them."""
    out = {}
    for edit, grid in grids.items():
        per_length: dict[str, dict] = {}
        for cell in grid["cells"]:
            row = per_length.setdefault(str(cell["frames"]), {"all": {"right": 0, "asked": 0}})
            for key in ("all", cell["colour"]):
                slot = row.setdefault(key, {"right": 0, "asked": 0})
                slot["right"] += bool(cell["correct"])
                slot["asked"] += 1
        out[edit] = per_length
    return out


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edits = list(summary)
    lengths = sorted({n for per in summary.values() for n in per}, key=int)
    colours = sorted({c for per in summary.values() for row in per.values() for c in row} - {"all"})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.4), squeeze=False)
    width = 0.8 / len(edits)
    for ax, n in zip(axes[0], lengths):
        for k, edit in enumerate(edits):
            row = summary[edit].get(n, {})
            rates = [
                row[c]["right"] / row[c]["asked"] if c in row else float("nan") for c in colours
            ]
            xs = [i + (k - (len(edits) - 1) / 2) * width for i in range(len(colours))]
            ax.bar(xs, rates, width, label=edit)
        ax.set_xticks(range(len(colours)), colours)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{int(n) / 60:g} minutes ({n} frames)")
        ax.set_ylabel("flashes named right")
    axes[0][0].legend(title="look-alike codes", fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="a Hugging Face export or checkpoint of the hour model")
    p.add_argument("--out", required=True, help="where each edit's grid and the summary go")
    p.add_argument("--lengths", default="1800,3600", help="video lengths in frames at 1 fps")
    p.add_argument("--depths", default="0.0,0.25,0.5,0.75,1.0")
    p.add_argument("--trials", default="8", help="trials a length (the colours in turn)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated backgrounds")
    p.add_argument("--nproc", type=int, default=2, help="processes (the demo's evaluation: 2)")
    p.add_argument("--edits", default=",".join(EDITS), help=f"of {', '.join(EDITS)}")
    p.add_argument("--skip-run", action="store_true", help="summarise the grids already in --out")
    a = p.parse_args(argv)
    out, edits = Path(a.out), [e.strip() for e in a.edits.split(",")]
    unknown = sorted(set(edits) - set(EDITS))
    if unknown:
        p.error(f"unknown edits {unknown}; choose from {list(EDITS)}")
    if not a.skip_run:
        if not a.model:
            p.error("--model is needed unless --skip-run")
        env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
        env.setdefault("OMP_NUM_THREADS", "1")
        for edit in edits:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={a.nproc}",
                "-m",
                "longvideo",
                "eval",
                "video-niah",
                "--model",
                a.model,
                "--out",
                str(out / edit),
                "--lengths",
                a.lengths,
                "--depths",
                a.depths,
                "--trials",
                a.trials,
                "--seed",
                str(a.seed),
                "--source-fps",
                "1",
                "--lookalikes",
                edit,
                "--quiet",
            ]
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, env=env)
    grids = {}
    for edit in edits:
        path = out / edit / "video_needle.json"
        if not path.is_file():
            p.error(f"{path} is missing: run without --skip-run first")
        grids[edit] = json.loads(path.read_text())
    summary = summarise(grids)
    record = {
        "model": a.model,
        "lengths": a.lengths,
        "depths": a.depths,
        "trials": a.trials,
        "seed": a.seed,
        "by_edit": summary,
    }
    (out / "lookalikes.json").write_text(json.dumps(record, indent=2) + "\n")
    plot(summary, out / "lookalikes.png")
    for edit, per in summary.items():
        for n, row in per.items():
            cells = ", ".join(
                f"{c} {r['right']}/{r['asked']}" for c, r in sorted(row.items()) if c != "all"
            )
            print(f"{edit:<6} {n:>5} frames: {row['all']['right']}/{row['all']['asked']} ({cells})")
    print(f"wrote {out / 'lookalikes.json'} and {out / 'lookalikes.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
