"""What the benchmark scripts share. Each `scripts/bench_<name>.py` has, next to the code that measures,
a docstring (what and how: its page shows it without the command lines), TITLE, DOCS (pages under
docs/), TARGETS (the first is its headline, shown in the README) and `report(result) -> Section`;
`scripts/run_benchmarks.py` runs the scripts and renders the pages from their JSON. This module imports
nothing of the project; of torch only torch.distributed (spawn_ranks' gloo groups), of matplotlib its Figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(
    0, str(ROOT)
)  # the scripts import this checkout's longvideo, whatever else is installed
BENCH_DIR = ROOT / "docs" / "bench"


class LayoutError(ValueError):
    """The JSON does not have the layout the report reads."""


@dataclass
class Target:
    """One row of the summary: what is compared, the goal, the measured figure, and whether it is met."""

    what: str
    goal: str
    figure: str = "-"
    met: str = "not measured yet"


@dataclass
class Section:
    """What a report reads out of its JSON."""

    table: str
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    images: list[tuple[str, str]] = field(
        default_factory=list
    )  # (alt text, file name in the bench dir)


def fmt_num(x, fmt: str = ".2f", unit: str = "") -> str:
    """x formatted with fmt and unit; '-' for None, 'unbounded' for infinity, LayoutError otherwise."""
    if x is None:
        return "-"
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return "unbounded" if isinstance(x, float) and math.isinf(x) else f"{x:{fmt}}{unit}"
    raise LayoutError(f"expected a number, got {x!r}")


def req(d: dict, *keys):
    """d[k0][k1]...; LayoutError naming the path when a key is missing."""
    for k in keys:
        try:
            d = d[k]
        except (KeyError, IndexError, TypeError):
            raise LayoutError(f"no key {'.'.join(map(str, keys))}") from None
    return d


def req_list(d: dict, *keys) -> list:
    """req(d, *keys), which must be a non-empty list."""
    v = req(d, *keys)
    if not isinstance(v, list) or not v:
        raise LayoutError(f"{'.'.join(map(str, keys))} is not a non-empty list")
    return v


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def yes_no(ok: bool) -> str:
    """'yes', or a bold '**no**' that stands out in a table."""
    return "yes" if ok else "**no**"


def ratio(a, b):
    """a / b when both are numbers and b is not 0, else None."""
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def fmt_tokens(n) -> str:
    """A token count as 117.2K or 1.50M (binary K and M); '-' for None, 'unbounded' for infinity."""
    if n is None or (isinstance(n, float) and math.isinf(n)):
        return "-" if n is None else "unbounded"
    return f"{n / 2**20:,.2f}M" if n >= 2**20 else f"{n / 1024:,.1f}K" if n >= 1024 else f"{n:,.0f}"


def status_mib(key: str) -> float:
    """A field of /proc/self/status (VmRSS, VmHWM, ...) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def arg_parser(doc: str, name: str) -> argparse.ArgumentParser:
    """A script's parser: described by its docstring's first paragraph, with --out (its JSON)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument(
        "--out", default=str(BENCH_DIR / f"{name}.json"), help="the JSON; a plot goes beside it"
    )
    return p


def settings(args: argparse.Namespace) -> dict:
    """A run's settings for its JSON: the parsed arguments without --out, which names a path on the
    machine that ran it."""
    return {k: v for k, v in vars(args).items() if k != "out"}


def _rank_main(queue, target, rank, world, init_file, gloo_timeout_s, *args):
    try:
        if gloo_timeout_s is not None:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=gloo_timeout_s),
            )
        result = dict(target(rank, world, *args), rank=rank)
        if gloo_timeout_s is not None:
            dist.destroy_process_group()
        queue.put(result)
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        queue.put({"rank": rank, "error": f"{e!r}\n{traceback.format_exc()}"})


def spawn_ranks(
    target, world: int, *args, label: str, gloo_timeout_s: float | None = 1800.0
) -> list[dict]:
    """Run target(rank, world, *args) -> dict in `world` spawned processes of one gloo group (none with
    gloo_timeout_s=None). The dicts (each with its "rank") in rank order; raises when a rank raised."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(queue, target, r, world, f"{d}/rdzv", gloo_timeout_s, *args),
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        ranks = sorted((queue.get() for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join()
    for r in ranks:
        if "error" in r:
            raise RuntimeError(f"{label} rank {r['rank']} failed:\n{r['error']}")
    return ranks


def subplots(*args, figsize=None, **kwargs):
    """matplotlib's subplots on a bare Figure: drawn to files, never to a window."""
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(*args, **kwargs)


def save(result: dict, out, plot=None, report=None) -> Path:
    """Write result as JSON at `out` (stamped with today's date unless it has one) and, with plot,
    the figure plot(result) returns next to it as a PNG (every panel gridded, with a legend where it
    has labels); with report, print report(result)'s table and targets first. Returns the JSON's path."""
    if report is not None:
        sec = report(result)
        print(
            sec.table,
            *(f"{t.what}: {t.figure} (target {t.goal}): {t.met}" for t in sec.targets),
            sep="\n",
        )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result.setdefault("date", datetime.date.today().isoformat())
    out.write_text(json.dumps(result, indent=1) + "\n")
    if plot is not None:
        fig = plot(result)
        for ax in fig.axes:
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[1]:
                ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out}" + (f" and {out.with_suffix('.png')}" if plot else ""))
    return out
