#!/usr/bin/env python
"""Run the benchmark scripts, then render the result pages from their JSON alone.

    python scripts/run_benchmarks.py                      # every scripts/bench_*.py, then the pages (make bench)
    python scripts/run_benchmarks.py --only ring infer    # some of them (names as in bench_<name>.py)
    python scripts/run_benchmarks.py --skip-run           # only the pages (make results)

Each script runs in its own subprocess and session, one after the other, its output streamed through; a
failure or timeout (which stops what it spawned too) is printed with the tail of its stderr, written into
docs/benchmarks.md, and the next one runs. The JSON under docs/bench/ alone renders docs/benchmarks.md
(each script's section from its report(), see scripts/benchreport.py; gpu_check.py's own section is
kept), docs/results.md (the demos' summary.json, copied to docs/bench/demo.json and demo-hour.json, and
every target) and the README's blocks between `<!-- NAME:begin ... -->` and `<!-- NAME:end -->`; a
missing or unreadable JSON renders as "not measured yet" and why. tests/test_readme.py checks the README
and docs/results.md against a fresh render. The exit status is 1 when a script failed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS_DIR, BENCH_DIR, DOCS_DIR, README = (
    ROOT / "scripts",
    ROOT / "docs" / "bench",
    ROOT / "docs",
    ROOT / "README.md",
)
sys.path.insert(0, str(SCRIPTS_DIR))

from benchreport import LayoutError, Section, Target, md_table  # noqa: E402
from tqdm import tqdm  # noqa: E402

from longvideo.machine import describe  # noqa: E402

ORDER = [
    "context",
    "ring",
    "infer",
    "vq",
    "data",
]  # the summary's order; other scripts follow by name
GPU_BEGIN, GPU_END = (
    "<!-- gpu-check:begin",
    "<!-- gpu-check:end -->",
)  # scripts/gpu_check.py's own section
NOT_BENCHMARKS = (
    "gpu_check",
    "gpu_tune",
    "demo",
    "suite",
)  # JSON under docs/bench/ that no bench_*.py writes
DEMOS = {"make demo": "demo", "make demo-hour": "demo-hour"}  # command: docs/bench/<name>.json
SUITES = {
    "make test": "suite-test",
    "make check": "suite-check",
}  # tests/conftest.py's LONGVIDEO_SUITE_JSON
BLOCK = re.compile(r"(<!-- ([\w-]+):begin[^>]*-->\n)(.*?)(<!-- \2:end -->)", re.S)
NOT_YET = "not measured yet"


@dataclasses.dataclass
class RunResult:
    """How one script's run went: status is 'ok', 'failed' or 'timeout'."""

    name: str
    status: str
    returncode: int | None
    seconds: float
    stderr_tail: str = ""


def discover(scripts_dir: Path = SCRIPTS_DIR) -> dict[str, Path]:
    """{name: path} of every scripts_dir/bench_<name>.py, in the summary's order."""
    found = {p.stem[len("bench_") :]: p for p in scripts_dir.glob("bench_*.py")}
    return {
        n: found[n]
        for n in sorted(found, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))
    }


def run_script(
    name: str, path: Path, timeout: float | None, cwd: Path = ROOT, err=None
) -> RunResult:
    """Run one script to completion or timeout; its stdout goes to ours, its stderr to `err` (and is kept)."""
    t0, keep, err = time.perf_counter(), collections.deque(maxlen=16), err or sys.stderr.buffer
    proc = subprocess.Popen(
        [sys.executable, str(path)],
        cwd=cwd,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stderr=subprocess.PIPE,
        start_new_session=True,
    )

    def pump():  # chunks, so that progress bars' '\r' pass through
        while chunk := os.read(proc.stderr.fileno(), 4096):
            err.write(chunk)
            err.flush()
            keep.append(chunk)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    status = "ok"
    try:
        proc.wait(timeout=timeout or None)
    except BaseException as e:  # a timeout, or Ctrl-C: leave no benchmark processes behind
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(
                ProcessLookupError, subprocess.TimeoutExpired
            ):  # gone, or deaf to TERM
                os.killpg(proc.pid, sig)
                proc.wait(timeout=10)
                break
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        status = "timeout"
    reader.join(timeout=10)
    tail = [
        ln.rstrip()
        for ln in b"".join(keep).decode("utf-8", "replace").replace("\r", "\n").splitlines()
        if ln.strip()
    ][-25:]
    if status == "timeout":
        tail.append(f"[stopped after the {timeout:g} s timeout]")
    elif proc.returncode != 0:
        status = "failed"
    return RunResult(name, status, proc.returncode, time.perf_counter() - t0, "\n".join(tail))


def run_all(
    scripts: dict[str, Path], timeout: float | None, cwd: Path = ROOT, err=None
) -> dict[str, RunResult]:
    """Run the scripts one after the other; a failure or timeout is recorded and the next one runs."""
    runs, bar = {}, tqdm(list(scripts.items()), desc="benchmarks", unit="script")
    for name, path in bar:
        bar.set_postfix_str(name)
        runs[name] = r = run_script(name, path, timeout, cwd=cwd, err=err)
        bar.write(
            f"<== {path.name}: {r.status} in {r.seconds:.0f} s"
            + (
                ""
                if r.status == "ok"
                else f" (exit {r.returncode})\n    " + r.stderr_tail.replace("\n", "\n    ")
            )
        )
    return runs


def load_bench(name: str, path: Path | None):
    """The module of scripts/bench_<name>.py (its main() runs only as __main__), or why it cannot be imported."""
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(
        spec
    )  # dataclasses look their module up
    sys.path.insert(0, str(path.parent))  # where the script imports benchreport from
    try:
        spec.loader.exec_module(mod)
        return mod
    except (Exception, SystemExit) as e:  # whatever stops the import is said on the page
        sys.modules.pop(spec.name)
        return " ".join(f"{type(e).__name__}: {e}".split())
    finally:
        sys.path.remove(str(path.parent))


def read_json(path: Path) -> tuple[dict | None, str | None]:
    """(the JSON object, None) or (None, why not)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"no {path.name}"
    except (OSError, ValueError) as e:
        return None, f"{path.name} is not readable JSON: {type(e).__name__}"
    return (data, None) if isinstance(data, dict) else (None, f"{path.name} is not a JSON object")


@dataclasses.dataclass
class Result:
    """One benchmark: its script's module (or why it could not be imported), its JSON and its section."""

    name: str
    mod: object
    data: dict | None
    section: Section | None
    why: str | None

    def attr(self, key: str, default):
        return (
            getattr(self.mod, key, default)
            if not isinstance(self.mod, (str, type(None)))
            else default
        )

    def measures(self) -> str:
        """The script's docstring without its command lines: what it measures and how, for the page."""
        doc = "\n".join(
            ln
            for ln in (self.attr("__doc__", None) or "").splitlines()
            if not ln.startswith("    ")
        )
        return " ".join(" ".join(p.split()) for p in doc.split("\n\n") if p.strip())

    def targets(self) -> list[Target]:
        if self.section is None:
            return [Target(t.what, t.goal) for t in self.attr("TARGETS", [])] or [
                Target(self.name, "-")
            ]
        return self.section.targets or [Target(self.name, "-", "see its section", "n/a")]


def read_result(name: str, mod, bench_dir: Path) -> Result:
    """A benchmark's result; never raises on a bad or missing file, nor on a script that cannot be imported."""
    data, why = read_json(bench_dir / f"{name}.json")
    r = Result(name, mod, data, None, why)
    report = r.attr("report", None)
    if isinstance(mod, str):
        r.why = f"its script could not be loaded: {mod}"
    elif data is not None and not callable(report):
        r.section = Section("", [], ["No report for this benchmark yet; see the JSON."])
    elif data is not None:
        try:
            r.section = report(data)
        except (LayoutError, KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            r.why = f"{name}.json has a layout its report does not read: {e}"
        except Exception as e:  # a bug in one report must not take the pages down
            r.why = f"the report of bench_{name}.py failed: {type(e).__name__}: {e}"
    return r


def read_all(bench_dir: Path, scripts_dir: Path) -> list[Result]:
    """Every benchmark with a script or a JSON result, in the summary's order."""
    scripts = discover(scripts_dir)
    extra = sorted(
        {p.stem for p in bench_dir.glob("*.json") if not p.stem.startswith(NOT_BENCHMARKS)}
        - set(scripts)
    )
    return [read_result(n, load_bench(n, scripts.get(n)), bench_dir) for n in [*scripts, *extra]]


def machine_line(d: dict) -> str:
    """'AMD EPYC, 2-core CPU, torch X; load average (1/5/15 min) 1.0/1.0/1.0 (before)' from what the JSON has."""
    m = d.get("machine")
    if isinstance(m, str):
        return m
    m = m if isinstance(m, dict) else {}
    cores = m.get("cpus") or m.get("cpu_count") or m.get("cores")
    parts = [str(m[k]) for k in ("gpu", "cpu") if m.get(k)] + (
        [f"{cores}-core CPU"] if cores else []
    )
    parts += [f"torch {m['torch']}"] if m.get("torch") else []
    loads = [
        f"{'/'.join(f'{x:.1f}' for x in v)}" + (f" ({k[8:].replace('_', ' ')})" if k[8:] else "")
        for src in (m, d)
        for k, v in src.items()
        if k.startswith("loadavg")
        and isinstance(v, list)
        and all(isinstance(x, (int, float)) for x in v)
    ]
    return (", ".join(parts) or "not recorded") + (
        "; load average (1/5/15 min) " + ", ".join(loads) if loads else ""
    )


def gpu_targets(bench_dir: Path) -> list[Target]:
    """The targets scripts/gpu_check.py records in gpu_check.json (its own layout)."""
    rows = (read_json(bench_dir / "gpu_check.json")[0] or {}).get("targets")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        return [Target("gpu-check", "see its section")]
    return [
        Target(
            f"gpu-check: {r.get('target')}", *(str(r.get(k)) for k in ("goal", "measured", "met"))
        )
        for r in rows
    ]


def target_table(rows: list[tuple[str, Target]], link: str) -> str:
    return md_table(
        ["benchmark", "measured", "target", "met"],
        [
            [f"[{t.what}]({link}#{anchor})", t.figure.replace("|", "\\|"), t.goal, t.met]
            for anchor, t in rows
        ],
    )


def _pct(x) -> str:
    return f"{100 * x:.1f} %" if isinstance(x, (int, float)) else "-"


def _time_row(cmd: str, s: dict | None, why: str | None, tests: bool = False) -> list[str]:
    """[command, its run's time (or why there is none), the machine] from a demo's or the suite's JSON."""
    s, n = s or {}, (s or {}).get("tests") or {}
    took = (
        f"{s['seconds'] / 60:.1f} min"
        + (f" ({n.get('passed', '?'):,} tests passed)" if tests else "")
        if isinstance(s.get("seconds"), (int, float))
        else f"{NOT_YET} ({why or 'no seconds'})"
    )
    return [f"`{cmd}`", took, describe(s["machine"]) if isinstance(s.get("machine"), dict) else "-"]


def demo_blocks(bench_dir: Path) -> dict[str, str]:
    """The demos' times and results from docs/bench/demo.json and demo-hour.json, and the test
    suite's times from suite-test.json and suite-check.json."""
    runs = {cmd: read_json(bench_dir / f"{name}.json") for cmd, name in DEMOS.items()}
    times, rows = [], {}
    for cmd, (s, why) in runs.items():
        times.append(_time_row(cmd, s, why))
        niah, qa, vq = ((s or {}).get(k) or {} for k in ("video_niah", "qa", "vq_needle"))
        found = [
            ("video needle, every length and depth", _pct(niah.get("accuracy")), niah.get("chance"))
        ]
        if niah.get("grid") and niah.get("lengths"):
            col = [row[-1] for row in niah["grid"]]
            found.append(
                (
                    "video needle, the longest videos",
                    f"{_pct(sum(col) / len(col))} ({niah['lengths'][-1]:,} frames)",
                    niah.get("chance"),
                )
            )
        misses = niah.get("misses") or {}
        if misses and all("read" in m for m in misses.values()):  # the needle's control ran
            read, told = (sum(m[k] for m in misses.values()) for k in ("read", "decidable"))
            longest = misses[max(misses, key=int)]
            found.append(
                (
                    "video needle, read (the answer is not the bare background's), of the "
                    "decidable: all · the longest",
                    f"{read:,} of {told:,} · {longest['read']} of {longest['decidable']}",
                    None,
                )
            )
        if qa.get("lengths"):  # per question type, its accuracy at each video length
            found += [
                (
                    f"QA: {t}, by video length",
                    " · ".join(
                        f"{_pct(c['accuracy'])} ({float(k) / 60:g} min)"
                        for k, c in r["by_length"].items()
                    ),
                    r.get("chance"),
                )
                for t, r in qa["per_type"].items()
            ]
        else:
            found += [
                (f'QA: "{q}"', _pct(r.get("accuracy")), r.get("chance"))
                for q, r in (qa.get("per_question") or {}).items()
            ]
        found += (
            [("VQ alone: flash colour kept through encode + decode", _pct(vq.get("rate")), None)]
            if vq
            else []
        )
        found += [
            (f"VQ alone: a shape's {what} kept", _pct(vq[f"shape_{what}_rate"]), vq[key])
            for what, key in (("colour", "shape_colour_chance"), ("kind", "shape_kind_chance"))
            if vq.get(f"shape_{what}_rate") is not None
        ]
        t2v = (s or {}).get("t2v") or {}
        found += (
            [
                (
                    "text to video: the captioned colours in order",
                    _pct(t2v.get("accuracy")),
                    t2v["chance"],
                )
            ]
            if t2v.get("chance") is not None
            else []
        )
        for task, value, chance in found:
            if value != "-":
                row = rows.setdefault(task, {"chance": set()})
                row[cmd] = value
                row["chance"] |= {_pct(chance)} if chance is not None else set()
    times += [
        _time_row(cmd, *read_json(bench_dir / f"{name}.json"), True) for cmd, name in SUITES.items()
    ]
    body = [
        [
            task,
            *[r.get(c, "-" if runs[c][0] else NOT_YET) for c in DEMOS],
            " / ".join(sorted(r["chance"])) or "-",
        ]
        for task, r in rows.items()
    ] or [["video needle and QA", *[NOT_YET] * len(DEMOS), "-"]]
    return {
        "demo-times": md_table(["command", "measured time", "machine"], times),
        "demo-results": md_table(["task", *[f"`{c}`" for c in DEMOS], "chance"], body),
    }


def section_md(
    r: Result, run: RunResult | None, bench_dir: Path, docs_dir: Path, out_dir: Path
) -> str:
    rel = lambda p: Path(os.path.relpath(p, out_dir)).as_posix()  # noqa: E731
    lines = [
        f'<a id="{r.name}"></a>',
        f"## {r.attr('TITLE', r.name)} (`scripts/bench_{r.name}.py`)",
        "",
    ]
    lines += [measures, ""] if (measures := r.measures()) else []
    if run is not None and run.status != "ok":
        lines += [
            f"**The last run of `scripts/bench_{r.name}.py` "
            + (
                f"timed out after {run.seconds:.0f} s.**"
                if run.status == "timeout"
                else f"failed (exit {run.returncode}) after {run.seconds:.0f} s.**"
            )
            + (" The figures below come from the JSON that was already there." if r.data else ""),
            "",
        ]
        lines += ["```", run.stderr_tail, "```", ""] if run.stderr_tail else []
    s = r.section
    if s is None:
        lines += [f"_Not measured yet ({r.why}): run `python scripts/bench_{r.name}.py`._", ""]
    else:
        lines += [s.table, ""] if s.table else []
        met = [
            f"- **{t.what}** (target: {t.goal}): {t.figure}. Met: {t.met}."
            for t in s.targets
            if t.met != "n/a"
        ]
        lines += met + [""] * bool(met) + [x for note in s.notes for x in (note, "")]
        lines += (
            [
                f"Machine: {machine_line(r.data)}."
                + (f" Recorded {r.data['date']}." if r.data.get("date") else ""),
                "",
            ]
            if "machine" in r.data
            else []
        )
        lines += [
            f"![{alt}]({rel(bench_dir / f)})\n"
            for alt, f in [(r.attr("TITLE", r.name), f"{r.name}.png"), *s.images]
            if (bench_dir / f).exists()
        ]
    docs = r.attr("DOCS", None) or [f"{r.name}.md"]
    doc, data = (
        next((d for d in docs if (docs_dir / d).exists()), docs[0]),
        rel(bench_dir / f"{r.name}.json"),
    )
    details = f"Details: [{doc}]({rel(docs_dir / doc)})." + (
        f" Data: [{data}]({data})." if r.data else ""
    )
    return "\n".join(lines + [details + f" Reproduce: `python scripts/bench_{r.name}.py`.", ""])


def render(
    bench_dir: Path = BENCH_DIR,
    docs_dir: Path = DOCS_DIR,
    scripts_dir: Path = SCRIPTS_DIR,
    runs: dict[str, RunResult] | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """({page name: text}, {README block name: text}) from the JSON alone; `runs`' failures go on
    docs/benchmarks.md only."""
    results, runs, gpu = read_all(bench_dir, scripts_dir), runs or {}, gpu_targets(bench_dir)
    rows = [(r.name, t) for r in results for t in r.targets()] + [("gpu-check", t) for t in gpu]
    failed = {
        n: "timed out" if r.status == "timeout" else "failed"
        for n, r in runs.items()
        if r.status != "ok"
    }
    marked = [
        (n, dataclasses.replace(t, met=f"{t.met} (last run {failed[n]})") if n in failed else t)
        for n, t in rows
    ]
    old = (docs_dir / "benchmarks.md").read_text() if (docs_dir / "benchmarks.md").exists() else ""
    gpu_md = (
        GPU_BEGIN + old.split(GPU_BEGIN, 1)[1].split(GPU_END, 1)[0] + GPU_END + "\n"
        if GPU_BEGIN in old
        else ""
    )
    bench_md = (
        "\n".join(
            [
                "# Benchmarks",
                "",
                "Generated by `python scripts/run_benchmarks.py` (`make bench`; `make results` renders the pages alone) from "
                "the JSON each `scripts/bench_*.py` writes under `docs/bench/`. Every script runs its baseline side by side in "
                "the same run and records the machine: figures from the shared 2-core CPU machine are noisy. Headline "
                "results: [results.md](results.md); what was tried on the way: [experiments.md](experiments.md).",
                "",
                target_table([x for x in marked if x[0] != "gpu-check"], ""),
                "",
                *[section_md(r, runs.get(r.name), bench_dir, docs_dir, docs_dir) for r in results],
            ]
        ).rstrip()
        + "\n"
    )
    demos = demo_blocks(bench_dir)
    results_md = "\n".join(
        [
            "# Results",
            "",
            "Generated by `python scripts/run_benchmarks.py --skip-run` (`make results`) from the JSON under "
            "`docs/bench/`: do not edit by hand (tests/test_readme.py checks it). The demos' figures are their runs' "
            "`summary.json`, copied to `docs/bench/demo.json` and `demo-hour.json`; how each benchmark measures: "
            "[benchmarks.md](benchmarks.md); what was tried on the way: [experiments.md](experiments.md).",
            "",
            "## The demos",
            "",
            demos["demo-times"],
            "",
            demos["demo-results"],
            "",
            "## Benchmarks",
            "",
            target_table(rows, "benchmarks.md"),
            "",
        ]
    )
    head = [(r.name, r.targets()[0]) for r in results] + [
        ("gpu-check", gpu[0])
    ]  # each one's headline target
    return (
        {"benchmarks.md": bench_md + ("\n" + gpu_md if gpu_md else ""), "results.md": results_md},
        {"benchmarks": target_table(head, "docs/benchmarks.md"), **demos},
    )


def fill_blocks(text: str, blocks: dict[str, str]) -> str:
    """text with every generated block (between its markers) rendered anew; ValueError for an unknown one."""

    def one(m):
        if m.group(2) not in blocks:
            raise ValueError(
                f"no generated block named {m.group(2)!r} (known: {', '.join(blocks)})"
            )
        return m.group(1) + blocks[m.group(2)] + "\n" + m.group(4)

    return BLOCK.sub(one, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="run only these (context, ring, ... or bench_ring.py)",
    )
    p.add_argument(
        "--skip-run", action="store_true", help="only render the pages from the existing JSON"
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds a script; 0 for no limit")
    p.add_argument(
        "--scripts-dir", type=Path, default=SCRIPTS_DIR, help="where the bench_*.py scripts are"
    )
    p.add_argument("--bench-dir", type=Path, default=BENCH_DIR, help="where their JSON and PNG are")
    p.add_argument("--docs-dir", type=Path, default=DOCS_DIR, help="where the pages are written")
    p.add_argument(
        "--readme",
        type=Path,
        default=README,
        help="the README whose generated blocks are rewritten",
    )
    args = p.parse_args(argv)
    runs: dict[str, RunResult] = {}
    if not args.skip_run:
        scripts = discover(args.scripts_dir)
        want = [n.removesuffix(".py").removeprefix("bench_") for n in args.only or scripts]
        if unknown := [n for n in want if n not in scripts]:
            p.error(f"no scripts/bench_<name>.py for {unknown}; available: {', '.join(scripts)}")
        runs = run_all({n: scripts[n] for n in want}, args.timeout or None)
    pages, blocks = render(args.bench_dir, args.docs_dir, args.scripts_dir, runs)
    for name, text in pages.items():
        (args.docs_dir / name).write_text(text)
    if args.readme.exists():
        args.readme.write_text(fill_blocks(args.readme.read_text(), blocks))
    print(
        f"wrote {', '.join(pages)} under {args.docs_dir} and the generated blocks of {args.readme}"
    )
    return 1 if any(r.status != "ok" for r in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
