#!/usr/bin/env python
"""Several `make demo-hour` runs side by side: the video needle by length, one line per run.

    python scripts/needle_by_length.py --run "as shipped=runs/demo-hour" --run "recoloured=runs/r" \\
        --what "VQ seed 4, ..." --json docs/data/hour-recolour-vq4.json --png docs/hour_needle_recolour.png
    python scripts/needle_by_length.py --replot docs/data/hour-recolour-vq4.json --png out.png

Each --run is LABEL=PATH, PATH a run directory (its summary.json, and its rungs' metrics.jsonl) or a
summary JSON (docs/bench/demo-hour*.json). The JSON keeps, per run, the needle grid (rows: depths,
columns: lengths), the accuracy by length, the misses by colour, the QA per question type and, for a
run directory, each rung's steps, mean loss of its last 20 steps and median step time; --replot draws
the figure from that JSON alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def rung_losses(run: Path) -> dict:
    out = {}
    for stage in sorted((run / "lm").glob("stage*")):
        rows = [json.loads(line) for line in open(stage / "metrics.jsonl")]
        rows = [r for r in rows if "loss" in r]
        if rows:
            out[stage.name] = {
                "steps": len(rows),
                "loss_last_20": round(statistics.mean(r["loss"] for r in rows[-20:]), 4),
                "median_step_seconds": round(statistics.median(r["step_time"] for r in rows), 2),
            }
    return out


def record(path: Path) -> dict:
    """One run's figures, from its directory or its summary JSON."""
    summary = path / "summary.json" if path.is_dir() else path
    d = json.loads(summary.read_text())
    v = d["video_niah"]
    columns = list(zip(*v["grid"]))  # the grid's rows are depths, its columns lengths
    rec = {
        "source": str(path),
        "accuracy": v["accuracy"],
        "lengths": v["lengths"],
        "grid": v["grid"],
        "by_length": [round(sum(c) / len(c), 4) for c in columns],
        "qa": {k: x["accuracy"] for k, x in d.get("qa", {}).get("per_type", {}).items()},
    }
    if "misses" in v:
        rec["by_colour"] = {
            length: {c: f"{x['right']}/{x['asked']}" for c, x in m["by_colour"].items()}
            for length, m in v["misses"].items()
        }
        rec["missed_at_every_depth"] = {
            length: m["trials_missed_at_every_depth"] for length, m in v["misses"].items()
        }
    if path.is_dir():
        rec["rungs"] = rung_losses(path)
        rec["stage_minutes"] = {k: round(s / 60, 1) for k, s in d["stage_seconds"].items()}
    return rec


def plot(data: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ticks = set()
    for label, rec in data["variants"].items():
        minutes = [n / 60 for n in rec["lengths"]]
        ticks.update(minutes)
        ax.plot(minutes, [100 * x for x in rec["by_length"]], marker="o", label=label)
    ax.axhline(90, color="grey", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_xticks(sorted(ticks))
    ax.set_xticklabels([f"{t:g}" for t in sorted(ticks)])
    ax.set_xlabel("video length (minutes)")
    ax.set_ylabel("flash colour named (%)")
    ax.set_ylim(0, 102)
    ax.set_title(data.get("title", "video needle by length"), fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="append", default=[], metavar="LABEL=PATH")
    ap.add_argument("--what", default="", help="what the runs are (kept in the JSON)")
    ap.add_argument("--title", default="video needle by length")
    ap.add_argument("--json", type=Path, help="write the runs' figures here")
    ap.add_argument("--replot", type=Path, help="draw from this JSON instead of runs")
    ap.add_argument("--png", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.replot:
        data = json.loads(a.replot.read_text())
    else:
        if not a.run:
            ap.error("give --run LABEL=PATH (one or more) or --replot JSON")
        variants = {}
        for item in a.run:
            label, sep, path = item.partition("=")
            if not sep or not label or not path:
                ap.error(f"--run takes LABEL=PATH, got {item!r}")
            variants[label] = record(Path(path))
        data = {"what": a.what, "title": a.title, "variants": variants}
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(data, indent=1) + "\n")
    plot(data, a.png)
    for label, rec in data["variants"].items():
        by_length = " / ".join(f"{100 * x:.0f}" for x in rec["by_length"])
        print(f"{label}: {100 * rec['accuracy']:.1f} %, by length {by_length} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
