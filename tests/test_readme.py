"""README.md and docs/results.md against the JSON they are generated from, and the commands the README
and docs/*.md show against the real argument parsers.

- Every generated block of README.md (between `<!-- NAME:begin ... -->` and `<!-- NAME:end -->`) and the
  whole of docs/results.md equal what scripts/run_benchmarks.py renders from docs/bench/*.json now: a
  figure edited by hand, or a JSON changed without `make results`, fails.
- Every number outside those blocks that reads as a measurement (a percentage, minutes, seconds, a
  ratio such as 1.5x, GiB / MiB, tokens/s, TFLOP/s) appears in a generated block at the precision
  written, or is on NOT_MEASURED: the README quotes no figure its JSON does not hold.
- Every `longvideo ...`, `python -m longvideo...`, `torchrun / deepspeed ... -m longvideo ...`,
  `python scripts/...` and `make ...` line of the code blocks of README.md and docs/*.md (and the README's
  inline commands) names a command that exists and whose parser accepts the arguments shown (`train` and
  `train-vq` also load the config with the overrides shown); `--help` of every command and subcommand
  exits 0. They run in a child process in which argparse stops as soon as it has parsed: nothing runs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# Phrases of the README whose figures are no measurement of this project (hardware constants, plan
# parameters): a figure inside one of them, where the phrase appears, is not checked.
NOT_MEASURED = ["312 TFLOP/s", "~990 TFLOP/s"]
UNITS = {
    "%": "%",
    "percent": "%",
    "min": "min",
    "minute": "min",
    "minutes": "min",
    "s": "s",
    "sec": "s",
    "second": "s",
    "seconds": "s",
    "ms": "ms",
    "x": "x",
    "×": "x",
    "GiB": "GiB",
    "MiB": "MiB",
    "KiB": "KiB",
    "tokens/s": "tokens/s",
    "TFLOP/s": "TFLOP/s",
    "GFLOP/s": "GFLOP/s",
}
NUM = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(
    rf"(?<![\w.])((?:{NUM}\s*(?:/|-|–|to|and)\s*)*{NUM})(\s?)"
    rf"({'|'.join(sorted(map(re.escape, UNITS), key=len, reverse=True))})(?![\w/])"
)


def figures(text: str) -> list[tuple[str, str, str]]:
    """(number as written, unit, the match) for every measurement-like figure; '8 x W' is not one."""
    out = []
    for m in FIGURE.finditer(text):
        if UNITS[m.group(3)] == "x" and m.group(2):
            continue
        out += [
            (n.replace(",", ""), UNITS[m.group(3)], m.group(0)) for n in re.findall(NUM, m.group(1))
        ]
    return out


def test_generated_blocks_and_results_page_match_the_json(rb):
    pages, blocks = rb.render()
    readme = README.read_text()
    assert rb.BLOCK.search(readme), "README.md has no generated block"
    assert readme == rb.fill_blocks(readme, blocks), (
        "README.md's generated blocks differ from docs/bench/*.json: run `make results`"
    )
    assert (ROOT / "docs" / "results.md").read_text() == pages["results.md"], (
        "docs/results.md differs from docs/bench/*.json: run `make results`"
    )


def untraced(rb, readme: str) -> list[str]:
    """The measurement-like figures outside readme's generated blocks that no block holds."""
    generated = {}
    for m in rb.BLOCK.finditer(readme):
        for n, unit, _ in figures(m.group(3)):
            generated.setdefault(unit, set()).add(Decimal(n))
    bad = []
    for i, line in enumerate(
        rb.BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), readme).splitlines(), 1
    ):
        for n, unit, seen in figures(line):
            places = Decimal(1).scaleb(-len(n.partition(".")[2]))  # the precision written
            exempt = any(seen in phrase and phrase in line for phrase in NOT_MEASURED)
            if not exempt and not any(
                g.quantize(places) == Decimal(n) for g in generated.get(unit, ())
            ):
                bad.append(f"line {i}: {seen!r} ({n} {unit})")
    return bad


def test_figures_outside_the_blocks_are_generated_ones(rb):
    bad = untraced(rb, README.read_text())
    assert not bad, (
        "figures in README.md that no generated block holds (generate them, or drop them):\n"
        + "\n".join(bad)
    )


def test_the_figure_check_finds_figures_no_block_holds(rb):
    text = (
        "It took **29.4 minutes** (2 cores, 8 x W), 1.08-1.16x of SDPA and 312 TFLOP/s a GPU.\n"
        "<!-- x:begin -->\n| `make demo` | 29.43 min | 1.08x | 98.9 % |\n<!-- x:end -->\nneedle 98.9 / 97 %\n"
    )
    assert untraced(rb, text) == ["line 1: '1.08-1.16x' (1.16 x)", "line 5: '98.9 / 97 %' (97 %)"]


# ---- the commands --------------------------------------------------------------------------------


def code_lines(text: str, inline: bool) -> list[str]:
    """Shell lines of the fenced code blocks (continuations joined) and, with `inline`, the inline code
    spans that read as whole commands (`make X`, or a command with an option)."""
    out = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if lang in ("", "bash", "sh", "shell", "console"):
            out += [ln.strip().removeprefix("$ ") for ln in body.replace("\\\n", " ").splitlines()]
    spans = re.findall(
        r"(?<!`)`((?:longvideo|make|torchrun|(?:\.venv/bin/)?python3? (?:-m|scripts/))[^`]*)`", text
    )
    return out + [s for s in spans if inline and (s.startswith("make ") or " --" in s)]


def command(line: str):
    """(kind, target, args) of a line the test checks, or None: kind is 'module', 'script' or 'make'.
    Lines with placeholders ('...') or arrows ('->', a diagram) are not commands."""
    if "..." in line or "->" in line:
        return None
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # environment assignments
        words = words[1:]
    if not words:
        return None
    head = words[0]
    if head == "make":
        return "make", "", words[1:]
    if head == "longvideo":
        return "module", "longvideo", words[1:]
    if head in ("torchrun", "deepspeed", "accelerate") or re.fullmatch(r"(\S*/)?python3?", head):
        for i, w in enumerate(words[1:-1], 1):  # a launcher's own options end at -m / --module
            if w in ("-m", "--module"):
                return (
                    ("module", words[i + 1], words[i + 2 :])
                    if words[i + 1].startswith("longvideo")
                    else None
                )
        if head.endswith(("python", "python3")) and words[1:2] and words[1].startswith("scripts/"):
            return "script", words[1], words[2:]
    return None


def documented(paths, inline: bool = False) -> list[tuple[str, tuple]]:
    return [
        (f"{p.relative_to(ROOT)}: {ln}", c)
        for p in paths
        for ln in code_lines(p.read_text(), inline)
        if (c := command(ln)) is not None
    ]


def check(cmds: list[tuple[str, tuple]]) -> None:
    """Run the checks in one child (see _child) and assert every command passed."""
    targets = set(re.findall(r"^([\w.-]+):(?!=)", (ROOT / "Makefile").read_text(), re.M))
    bad = [
        f"{where}: no make target {args[0] if args else '(none)'!r}"
        for where, (kind, _, args) in cmds
        if kind == "make" and (not args or args[0] not in targets)
    ]
    todo = [(where, c) for where, c in cmds if c[0] != "make"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    res = subprocess.run(
        [sys.executable, __file__],
        input=json.dumps([c for _, c in todo]),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    bad += [f"{where}: {err}" for (where, _), err in zip(todo, results) if err]
    assert not bad, "documented commands that their parsers refuse:\n" + "\n".join(bad)


def test_readme_commands_parse():
    cmds = documented([README], inline=True)
    assert sum(c[1] == "longvideo" for _, c in cmds) >= 3, (
        cmds
    )  # the extraction found the README's commands
    from longvideo.cli import COMMANDS

    check(
        cmds
        + [(f"longvideo {name} --help", ("help", "longvideo", [name])) for name in COMMANDS]
        + [("python -m longvideo.demo --help", ("help", "longvideo.demo", []))]
    )


def test_the_command_check_refuses_what_the_parsers_refuse():
    cmds = [
        (ln, command(ln))
        for ln in (
            "longvideo train --config tiny --no-such-option",
            "longvideo chat --video v.mp4",
            "longvideo train --config tiny model.no_such_key=1",
            "longvideo no-such-command",
            "python scripts/no_such.py",
            "make no-such-target",
            "torchrun --nproc_per_node 2 -m longvideo eval nope",
        )
    ]
    with pytest.raises(AssertionError) as e:
        check(cmds)
    assert all(f"{ln}: " in str(e.value) for ln, _ in cmds), str(e.value)
    assert "unrecognized arguments: --no-such-option" in str(e.value) and "no_such_key" in str(
        e.value
    )


def test_docs_commands_parse():
    check(documented(sorted((ROOT / "docs").glob("*.md"))))


# ---- the child: argparse stops after parsing -------------------------------------------------------


class Parsed(Exception):
    def __init__(self, namespace):
        self.namespace = namespace


def _stop_after_parsing() -> list:
    """Patch ArgumentParser so that its outermost parse raises Parsed; returns [the last parser used]."""
    depth, last = [0], [None]
    for name in (
        "parse_args",
        "parse_known_args",
        "parse_intermixed_args",
        "parse_known_intermixed_args",
    ):

        def wrapped(self, *a, _orig=getattr(argparse.ArgumentParser, name), **k):  # noqa: B008
            depth[0] += 1
            last[0] = last[0] if depth[0] > 1 else self
            try:
                ns = _orig(self, *a, **k)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise Parsed(ns)
            return ns

        setattr(argparse.ArgumentParser, name, wrapped)
    return last


def _invoke(target: str, args: list[str]) -> None:
    if target == "longvideo":
        from longvideo.cli import main

        sys.exit(main(args))
    sys.argv = [target, *args]
    if target.startswith("scripts/"):
        sys.path.insert(0, str((ROOT / target).parent))  # as `python scripts/x.py` has it
        runpy.run_path(str(ROOT / target), run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


def _one(kind: str, target: str, args: list[str], last: list, subcommands: bool = True) -> str:
    """'' when the command parses (or its help exits 0, and its subcommands' too), else why not."""
    if kind == "script" and not (ROOT / target).is_file():
        return f"no such script {target}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            _invoke(target, args + ["--help"] if kind == "help" else args)
    except Parsed as p:
        if kind == "help":
            return "--help did not exit"
        ns = vars(p.namespace)
        if target == "longvideo" and args[0] in ("train", "train-vq") and ns.get("config"):
            from longvideo.config import load_config
            from longvideo.vq.config import load_vq_config

            try:
                (load_config if args[0] == "train" else load_vq_config)(
                    ns["config"], list(ns.get("overrides") or [])
                )
            except Exception as e:  # noqa: BLE001 - the message is the point
                return f"the config does not load: {type(e).__name__}: {e}"
        return ""
    except SystemExit as e:
        if kind == "help" and e.code in (0, None):
            subs = [
                a
                for a in getattr(last[0], "_actions", [])
                if isinstance(a, argparse._SubParsersAction)
            ]
            return "; ".join(
                x
                for s in subs
                if subcommands
                for c in s.choices
                if (x := _one("help", target, args + [c], last, False))
            )
        said = [ln for ln in err.getvalue().splitlines() if "error" in ln] or [
            err.getvalue().strip()[-300:]
        ]
        return "" if e.code in (0, None) else f"exit {e.code}: {' '.join(said)}"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "" if kind != "help" else "--help returned without exiting"


if __name__ == "__main__":  # the child of check(): a JSON list of (kind, target, args) on stdin
    cmds, last = json.loads(sys.stdin.read()), _stop_after_parsing()
    argv0 = list(sys.argv)
    out = [_one(kind, target, args, last) for kind, target, args in cmds]
    sys.argv = argv0
    print(json.dumps(out))
