"""What the benchmark scripts' report functions share: the target rows, the section they return, and
small helpers for reading a JSON result and writing figures, the process-memory readings several
scripts take and the launcher of their multi-process measurements.

Each `scripts/bench_<name>.py` defines, next to the code that measures, TITLE, MEASURES, DOCS,
TARGETS and `report(result) -> Section`; `scripts/run_benchmarks.py` runs the scripts and assembles
docs/benchmarks.md from those reports. This module imports nothing from the project (nor torch), so
it loads fast wherever the scripts are imported. A script that runs finds it next to itself
(`scripts/` is then on sys.path); the runner puts `scripts/` on sys.path before importing one.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import tempfile
from dataclasses import dataclass, field


class LayoutError(ValueError):
    """The JSON does not have the layout this benchmark's formatter reads."""


@dataclass
class Target:
    """One row of the summary: what is compared, the goal, the measured figure, and whether it is met."""

    what: str
    goal: str
    figure: str = "-"
    met: str = "not measured yet"


@dataclass
class Section:
    """What a benchmark's formatter reads out of its JSON."""

    table: str
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    images: list[tuple[str, str]] = field(default_factory=list)  # (alt text, file name in the bench dir)


def fmt_num(x, fmt: str = ".2f", unit: str = "") -> str:
    """x formatted with fmt and unit; '-' for None, 'unbounded' for infinity, LayoutError otherwise."""
    if x is None:
        return "-"
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        if isinstance(x, float) and math.isinf(x):
            return "unbounded"
        return f"{x:{fmt}}{unit}"
    raise LayoutError(f"expected a number, got {x!r}")


def req(d: dict, *keys):
    """d[k0][k1]...; LayoutError naming the path when a key is missing."""
    cur = d
    for k in keys:
        if not isinstance(cur, (dict, list)):
            raise LayoutError(f"no key {'.'.join(map(str, keys))}")
        try:
            cur = cur[k]
        except (KeyError, IndexError, TypeError):
            raise LayoutError(f"no key {'.'.join(map(str, keys))}") from None
    return cur


def req_list(d: dict, *keys) -> list:
    """req(d, *keys), which must be a non-empty list."""
    v = req(d, *keys)
    if not isinstance(v, list) or not v:
        raise LayoutError(f"{'.'.join(keys)} is not a non-empty list")
    return v


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def yes_no(ok: bool) -> str:
    """'yes', or a bold '**no**' that stands out in a table."""
    return "yes" if ok else "**no**"


def ratio(a, b):
    """a / b when both are numbers and b is not 0, else None."""
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def fmt_tokens(n) -> str:
    """A token count as 117.2K or 1.50M (binary K and M); '-' for None, 'unbounded' for infinity."""
    if n is None:
        return "-"
    if isinstance(n, float) and math.isinf(n):
        return "unbounded"
    if n >= 2**20:
        return f"{n / 2**20:,.2f}M"
    return f"{n / 1024:,.1f}K" if n >= 1024 else f"{n:,.0f}"


def status_mib(key: str) -> float:
    """A field of /proc/self/status (VmRSS, VmHWM, ...) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def spawn_ranks(target, world: int, *args, label: str) -> list[dict]:
    """Run target(rank, world, init_file, *args, queue) in `world` spawned processes; each puts one
    dict on the queue ({"rank", "error"} on failure). Returns the dicts; raises on any error."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "rendezvous")
        procs = [ctx.Process(target=target, args=(r, world, init, *args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        ranks = [queue.get() for _ in procs]
        for p in procs:
            p.join()
    for r in ranks:
        if "error" in r:
            raise RuntimeError(f"{label} rank {r['rank']} failed:\n{r['error']}")
    return ranks
