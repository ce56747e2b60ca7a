#!/usr/bin/env python
"""Run every benchmark script and assemble docs/benchmarks.md from their JSON results.

    python scripts/run_benchmarks.py                      # every scripts/bench_*.py, then the markdown
    python scripts/run_benchmarks.py --only ring infer    # a subset (names as in bench_<name>.py)
    python scripts/run_benchmarks.py --skip-run           # only rebuild the markdown from docs/bench/*.json
    python scripts/run_benchmarks.py --timeout 1800       # seconds per script (0: no limit)

Each script runs in its own subprocess with its default arguments, one after the other, its output
streamed through. A script that fails or runs past the timeout is reported (with the tail of its
stderr) in the output and in the markdown, and the others still run. The markdown is rebuilt from
every `docs/bench/<name>.json` present, whether or not this run refreshed it: each benchmark has a
small formatting function that reads its JSON layout, and a missing JSON, or one whose layout the
function does not understand, gives a "not measured yet" line instead of a table.

`make bench` runs this script with no arguments. The exit status is 1 when a script failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS_DIR = ROOT / "scripts"
DOCS_DIR = ROOT / "docs"
BENCH_DIR = DOCS_DIR / "bench"
OUT_PATH = DOCS_DIR / "benchmarks.md"

STDERR_TAIL_LINES = 25
STDERR_KEEP_BYTES = 64 * 1024


class LayoutError(ValueError):
    """The JSON does not have the layout this benchmark's formatter reads."""


# ------------------------------------------------------------------------------------------- running

@dataclass
class RunResult:
    """How one script's run went: status is 'ok', 'failed' or 'timeout'."""

    name: str
    status: str
    returncode: int | None
    seconds: float
    stderr_tail: str = ""


def discover(scripts_dir: Path = SCRIPTS_DIR) -> dict[str, Path]:
    """{name: path} of every scripts_dir/bench_<name>.py, in the summary's order, then the rest by name."""
    found = {p.stem[len("bench_"):]: p for p in sorted(scripts_dir.glob("bench_*.py"))}
    order = [n for n in BENCHES if n in found] + [n for n in found if n not in BENCHES]
    return {n: found[n] for n in order}


def _pump(src, sink, keep: collections.deque | None) -> None:
    """Copy a child's pipe to our stream as it arrives (chunks, so progress bars' '\\r' pass through)."""
    while True:
        chunk = os.read(src.fileno(), 4096)
        if not chunk:
            break
        sink.write(chunk)
        sink.flush()
        if keep is not None:
            keep.append(chunk)
            while sum(len(c) for c in keep) > STDERR_KEEP_BYTES and len(keep) > 1:
                keep.popleft()


def _tail(chunks: collections.deque, lines: int = STDERR_TAIL_LINES) -> str:
    text = b"".join(chunks).decode("utf-8", "replace").replace("\r", "\n")
    kept = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    return "\n".join(kept[-lines:])


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the child and everything it spawned (it leads its own session), TERM first, then KILL."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_script(name: str, path: Path, timeout: float | None, cwd: Path = ROOT,
               out=None, err=None) -> RunResult:
    """Run one benchmark script to completion (or timeout), streaming its stdout/stderr to out/err."""
    out = out or sys.stdout.buffer
    err = err or sys.stderr.buffer
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(path)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    keep: collections.deque = collections.deque()
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, out, None), daemon=True),
             threading.Thread(target=_pump, args=(proc.stderr, err, keep), daemon=True)]
    for t in pumps:
        t.start()
    status = "ok"
    try:
        proc.wait(timeout=timeout or None)
    except subprocess.TimeoutExpired:
        status = "timeout"
        _kill_group(proc)
    except BaseException:  # Ctrl-C: leave no benchmark processes behind
        _kill_group(proc)
        raise
    for t in pumps:
        t.join(timeout=10)
    rc = proc.returncode
    if status == "ok" and rc != 0:
        status = "failed"
    tail = _tail(keep)
    if status == "timeout":
        tail = (tail + "\n" if tail else "") + f"[stopped after the {timeout:g} s timeout]"
    return RunResult(name, status, rc, time.perf_counter() - t0, tail)


def run_all(scripts: dict[str, Path], timeout: float | None, cwd: Path = ROOT,
            out=None, err=None) -> dict[str, RunResult]:
    """Run the scripts one after the other; a failure or timeout is recorded and the next one runs."""
    from tqdm import tqdm

    results = {}
    bar = tqdm(list(scripts.items()), desc="benchmarks", unit="script")
    for name, path in bar:
        bar.set_postfix_str(name)
        bar.write(f"==> {path.name} (timeout {timeout:g} s)" if timeout else f"==> {path.name}")
        r = run_script(name, path, timeout, cwd=cwd, out=out, err=err)
        results[name] = r
        line = f"<== {path.name}: {r.status} in {r.seconds:.0f} s"
        if r.status != "ok":
            line += (f" (exit {r.returncode})" if r.status == "failed" else "") + "\n"
            line += "\n".join("    " + ln for ln in r.stderr_tail.splitlines())
        bar.write(line)
    bar.close()
    return results


# ------------------------------------------------------------------------------------------- formatting

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


@dataclass
class Bench:
    title: str
    measures: str
    docs: list[str]  # candidate detail docs under docs/, the first that exists is linked
    fmt: Callable[[dict], Section]
    targets: list[Target]  # the summary rows when nothing could be read


def _num(x, fmt: str = ".2f", unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        if isinstance(x, float) and math.isinf(x):
            return "unbounded"
        return f"{x:{fmt}}{unit}"
    raise LayoutError(f"expected a number, got {x!r}")


def _req(d: dict, *keys):
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


def _list(d: dict, *keys) -> list:
    v = _req(d, *keys)
    if not isinstance(v, list) or not v:
        raise LayoutError(f"{'.'.join(keys)} is not a non-empty list")
    return v


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def _tokens(n) -> str:
    if n is None:
        return "-"
    if isinstance(n, float) and math.isinf(n):
        return "unbounded"
    if n >= 2**20:
        return f"{n / 2**20:,.2f}M"
    return f"{n / 1024:,.1f}K" if n >= 1024 else f"{n:,.0f}"


# model ------------------------------------------------------------------------------------------------

MODEL_TARGETS = [Target("model: peak memory at 16K", "<= 1/4 of transformers'"),
                 Target("model: step time at 4K", "no slower than transformers")]


def fmt_model(d: dict) -> Section:
    rows = _list(d, "table")
    body, by = [], {}
    for r in rows:
        S = _req(r, "seq_len")
        by[S] = r
        speed = _ratio(r.get("hf_s"), r.get("ours_s"))
        mem = _ratio(r.get("ours_gib"), r.get("hf_gib"))
        body.append([f"{S:,}", _num(r.get("ours_s")), _num(r.get("hf_s")), _num(speed, ".2f", "x"),
                     _num(r.get("ours_gib")), _num(r.get("hf_gib")), _num(mem, ".3f")])
    errors = {(e.get("impl"), e.get("seq_len")): e["error"] for e in d.get("results", [])
              if isinstance(e, dict) and "error" in e}

    def missing(S):
        errs = [f"{impl} at {s:,}: {msg}" for (impl, s), msg in errors.items() if s == S]
        return "; ".join(errs) if errs else f"no complete run at {S:,} tokens"

    mem_t, speed_t = (Target(t.what, t.goal) for t in MODEL_TARGETS)
    r16 = by.get(16384, {})
    mem = _ratio(r16.get("ours_gib"), r16.get("hf_gib"))
    if mem is None:
        mem_t.figure, mem_t.met = missing(16384), "unknown"
    else:
        mem_t.figure = f"{mem:.3f}x ({r16['ours_gib']:.2f} vs {r16['hf_gib']:.2f} GiB)"
        mem_t.met = _yes(mem <= 0.25)
    r4 = by.get(4096, {})
    speed = _ratio(r4.get("hf_s"), r4.get("ours_s"))
    if speed is None:
        speed_t.figure, speed_t.met = missing(4096), "unknown"
    else:
        speed_t.figure = f"{speed:.2f}x transformers' speed ({r4['ours_s']:.2f} vs {r4['hf_s']:.2f} s)"
        speed_t.met = _yes(speed >= 1.0)
    notes = []
    cfg = d.get("config") or {}
    if cfg:
        notes.append(f"Model: dim {cfg.get('dim')}, {cfg.get('layers')} layers, {cfg.get('heads')} heads / "
                     f"{cfg.get('kv_heads')} key-value heads, vocabulary {cfg.get('vocab')}, fp32; "
                     f"{cfg.get('threads')} threads, best of {cfg.get('repeats')} timed step(s) after a warm-up.")
    fits = d.get("max_len_fit") or {}
    if fits:
        ours, hf = fits.get("longvideo"), fits.get("transformers")
        line = (f"Longest context under {cfg.get('budget_gib', '?')} GiB (a linear fit of peak memory against "
                f"length, an extrapolation): longvideo {_tokens(ours)}, transformers {_tokens(hf)}")
        r = _ratio(ours, hf)
        notes.append(line + (f" ({r:.1f}x)." if r else "."))
    for (impl, s), msg in errors.items():
        notes.append(f"{impl} at {s:,} tokens did not complete: {msg}")
    headers = ["S", "longvideo s", "transformers s", "speed-up (hf s / ours s)", "longvideo peak GiB",
               "transformers peak GiB", "memory (ours / hf)"]
    return Section(md_table(headers, body), [mem_t, speed_t], notes)


# ring -------------------------------------------------------------------------------------------------

RING_TARGETS = [Target("ring: per-rank activation memory", "within 1.2x of single / W"),
                Target("ring: exposed communication", "< 10 % of the step at S_local >= 8K"),
                Target("ring: zigzag balance", "slowest rank within 10 % of the mean")]


def fmt_ring(d: dict) -> Section:
    rows = _list(d, "rows")
    body = []
    for r in rows:
        body.append([str(_req(r, "world")), _req(r, "layout"), f"{_req(r, 's_local'):,}",
                     _num(_req(r, "step_s")), _num(r.get("ideal_ratio"), ".2f"),
                     _num(r.get("ideal_ratio_cpu"), ".2f"), _num(100 * _req(r, "exposed_frac_max"), ".1f", " %"),
                     _num(r.get("exposed_transfer_frac_max") and 100 * r["exposed_transfer_frac_max"], ".1f", " %"),
                     _num(r.get("serial_comm_frac") and 100 * r["serial_comm_frac"], ".1f", " %"),
                     _num(_req(r, "balance_slowest_over_mean"), ".3f"),
                     _num(r.get("saved_mem_over_single_div_w"), ".2f", "x"),
                     _num(r.get("peak_mem_over_single_div_w"), ".2f", "x")])
    zig = [r for r in rows if r["world"] > 1 and r["layout"] == "zigzag"]
    mem_t, comm_t, bal_t = (Target(t.what, t.goal) for t in RING_TARGETS)
    if not zig:
        for t in (mem_t, comm_t, bal_t):
            t.figure, t.met = "no zigzag run with W > 1", "unknown"
        return Section(md_table(RING_HEADERS, body), [mem_t, comm_t, bal_t], [])
    saved = [(r["world"], r["saved_mem_over_single_div_w"]) for r in zig if r.get("saved_mem_over_single_div_w")]
    peak = [r["peak_mem_over_single_div_w"] for r in zig if r.get("peak_mem_over_single_div_w")]
    if saved:
        worst = max(v for _, v in saved)
        mem_t.figure = (f"saved for backward: {worst:.2f}x (worst of W = {', '.join(str(w) for w, _ in saved)})"
                        + (f"; whole-step peak {max(peak):.2f}x" if peak else ""))
        mem_t.met = (f"saved for backward: {_yes(worst <= 1.2)}; whole-step peak: {_yes(max(peak) <= 1.2)}"
                     if peak else _yes(worst <= 1.2))
    else:
        mem_t.figure, mem_t.met = "no memory figures in the JSON", "unknown"
    big = [r for r in zig if r["s_local"] >= 8192]
    if big:
        ws = ", ".join(str(r["world"]) for r in big)
        wait = max(r["exposed_frac_max"] for r in big)
        own = [r["exposed_transfer_frac_max"] for r in big
               if isinstance(r.get("exposed_transfer_frac_max"), (int, float))]
        serial = [r["serial_comm_frac"] for r in big if isinstance(r.get("serial_comm_frac"), (int, float))]
        if own:  # judged on the transfer's own exposed time; waiting on a late neighbour is shown beside it
            comm_t.figure = (f"transfer's own exposed time {100 * max(own):.1f} % (worst rank, W = {ws}); all "
                             f"time blocked in wait {100 * wait:.1f} %")
            comm_t.met = _yes(max(own) < 0.10)
        else:
            comm_t.figure = f"{100 * wait:.1f} % blocked in wait (worst rank, W = {ws}, S_local >= 8K)"
            comm_t.met = _yes(wait < 0.10)
        if serial:
            comm_t.figure += f"; the transfers alone, unoverlapped, {100 * max(serial):.1f} % of the step"
    else:
        comm_t.figure = f"no zigzag run with S_local >= 8K (largest {max(r['s_local'] for r in zig):,})"
        comm_t.met = "unknown"
    worst = max(r["balance_slowest_over_mean"] for r in zig)
    bal_t.figure = f"slowest / mean CPU s = {worst:.3f} (worst of W = {', '.join(str(r['world']) for r in zig)})"
    bal_t.met = _yes(worst <= 1.10)
    notes = []
    a = d.get("args") or {}
    if a:
        notes.append(f"Causal attention forward + backward, total S = {a.get('seq'):,}, {a.get('heads')} heads / "
                     f"{a.get('kv_heads')} key-value heads of dim {a.get('head_dim')}, {a.get('dtype')}, backend "
                     f"`{a.get('backend')}`, {a.get('threads')} thread(s) per rank, median of {a.get('iters')} steps.")
    notes.append("\"ideal\" is T_single / (W x T_ring): 1.0 means W ranks did the one-process work W times faster; "
                 "the wall-clock figure needs W free cores, the CPU-seconds figure does not. \"Blocked in wait\" "
                 "is all the time a rank spent in `wait()`, including waiting on a neighbour that was late "
                 "(on an oversubscribed machine, descheduled); the transfer's own exposed time is the part after "
                 "both neighbours had posted their side of the hop, and the exposed-communication target is "
                 "judged on it where the JSON has it (on the whole wait otherwise). \"Serial transfers\" is one "
                 "bare hop times the 3W-2 hops of a step, over the step: the cost if nothing overlapped. Memory is shown two ways: the activations each "
                 "rank saves for backward (what grows with depth), and the whole-step peak of one attention "
                 "call, which also counts the ring's per-call workspace (K/V blocks in flight, partial "
                 "gradients); see the detailed doc.")
    contig = [r for r in rows if r["world"] > 1 and r["layout"] == "contiguous"]
    if contig:
        notes.append("Contiguous rows (no zigzag) show the imbalance the zigzag layout removes: slowest / mean "
                     + ", ".join(f"{r['balance_slowest_over_mean']:.2f} at W = {r['world']}" for r in contig) + ".")
    return Section(md_table(RING_HEADERS, body), [mem_t, comm_t, bal_t], notes)


RING_HEADERS = ["W", "layout", "S_local", "step s (slowest rank)", "ideal (wall)", "ideal (CPU s)",
                "blocked in wait (worst rank)", "transfer's own exposed time (worst rank)",
                "serial transfers / step", "slowest / mean CPU s", "saved for backward / (single / W)",
                "step peak / (single / W)"]


# kernels ----------------------------------------------------------------------------------------------

KERNEL_TARGETS = [Target("kernels: Triton flash attention fwd+bwd", ">= 90 % of SDPA-flash throughput (GPU)")]


def fmt_kernels(d: dict) -> Section:
    t = Target(KERNEL_TARGETS[0].what, KERNEL_TARGETS[0].goal)
    if _req(d, "skipped"):
        t.figure, t.met = "-", "not measurable here"
        return Section("", [t], [f"Skipped: {d.get('reason', 'no reason recorded')}. Run "
                                 "`python scripts/bench_kernels.py` on a CUDA machine."])
    goal = (d.get("config") or {}).get("target", 0.9)
    t.goal = f">= {goal:.0%} of SDPA-flash throughput (GPU)"
    body, ratios = [], []
    for r in _list(d, "results"):
        rf = _ratio(r.get("ours_fwd_tflops"), r.get("sdpa_fwd_tflops"))
        rb = _ratio(r.get("ours_fwdbwd_tflops"), r.get("sdpa_fwdbwd_tflops"))
        if rb is not None:
            ratios.append((r["seqlen"], rb))
        diff = r.get("max_abs_diff_vs_sdpa")
        body.append([f"{_req(r, 'seqlen'):,}", str(r.get("batch", "-")), _num(r.get("ours_fwd_tflops"), ".1f"),
                     _num(r.get("sdpa_fwd_tflops"), ".1f"), _num(rf, ".2f"), _num(r.get("ours_fwdbwd_tflops"), ".1f"),
                     _num(r.get("sdpa_fwdbwd_tflops"), ".1f"), _num(rb, ".2f"),
                     _num(r.get("ours_fwdbwd_frac_peak") and 100 * r["ours_fwdbwd_frac_peak"], ".0f", " %"),
                     diff if isinstance(diff, str) else _num(diff, ".2g")])
    if ratios:
        S, worst = min(ratios, key=lambda x: x[1])
        t.figure = f"{worst:.0%} of SDPA flash (worst, at S = {S:,})"
        t.met = _yes(worst >= goal)
    else:
        t.figure, t.met = "no length measured on both sides", "unknown"
    cfg = d.get("config") or {}
    notes = [f"Causal, {cfg.get('dtype')}, {cfg.get('heads')} heads"
             + (f" / {cfg['kv_heads']} key-value heads" if cfg.get("kv_heads") else "")
             + f", head dim {cfg.get('head_dim')}, {cfg.get('docs', 1)} document(s) per sequence, "
             f"{cfg.get('tokens', '?')} tokens per batch; median of {cfg.get('reps')} timed calls. "
             f"FLOPs: {d.get('flops', 'see the script')}."]
    for r in d["results"]:
        errs = [f"{k[:-6]}: {v}" for k, v in r.items() if k.endswith("_error")]
        if errs:
            notes.append(f"S = {r['seqlen']:,} failed in part: " + "; ".join(errs))
    headers = ["S", "batch", "ours fwd TFLOP/s", "SDPA fwd TFLOP/s", "fwd ratio", "ours fwd+bwd TFLOP/s",
               "SDPA fwd+bwd TFLOP/s", "fwd+bwd ratio", "ours fwd+bwd % of peak", "max abs diff vs SDPA"]
    return Section(md_table(headers, body), [t], notes)


# train ------------------------------------------------------------------------------------------------

TRAIN_TARGETS = [Target("train: our sp=1 context vs transformers (eager)", ">= 16x"),
                 Target("train: our sp=1 context vs transformers (sdpa)", ">= 16x"),
                 Target("train: our sp=W context", ">= 0.9 x W x our sp=1")]


def _train_shape(part: dict, goals: dict, label: str) -> tuple[str, list[Target], list[str]]:
    """Table, target rows and notes for one model shape of bench_train's JSON."""
    systems = _list(part, "systems")
    seqs = sorted({s for sy in systems for s in _req(sy, "seqs")})
    by = {}
    body = []
    for sy in systems:
        name = _req(sy, "system")
        by[name] = sy
        peaks = dict(zip(sy["seqs"], _req(sy, "peak_mib_per_rank")))
        body.append([name, str(_req(sy, "ranks"))] + [_num(peaks.get(S), ",.0f") for S in seqs]
                    + [f"{_num(_req(sy, 'fit', 'kib_per_token'), ',.1f')} ({sy['fit'].get('form', '?')})",
                       _tokens(_req(sy, "context_at_budget")),
                       _num(_req(sy, "throughput", "tokens_per_s"), ",.0f")])
    hf_goal = goals.get("ours_sp1_over_transformers", 16.0)
    w_goal = goals.get("ours_spW_over_Wx_sp1", 0.9)
    eager_t, sdpa_t, w_t = (Target(t.what.replace("train:", label), t.goal) for t in TRAIN_TARGETS)
    eager_t.goal = sdpa_t.goal = f">= {hf_goal:g}x"
    w_t.goal = f">= {w_goal:g} x W x our sp=1"
    ours1 = by.get("ours sp=1")
    for t, attn in ((eager_t, "eager"), (sdpa_t, "sdpa")):
        hf = by.get(f"transformers {attn}")
        r = _ratio(ours1 and ours1["context_at_budget"], hf and hf["context_at_budget"])
        if r is None:
            t.figure, t.met = f"needs 'ours sp=1' and 'transformers {attn}' in the JSON", "unknown"
        else:
            t.figure = (f"{r:,.1f}x ({_tokens(ours1['context_at_budget'])} vs "
                        f"{_tokens(hf['context_at_budget'])} tokens)")
            t.met = _yes(r >= hf_goal)
    parts, oks = [], []
    for sy in systems:
        if sy["system"].startswith("ours sp=") and sy["ranks"] > 1 and ours1:
            r = _ratio(sy["context_at_budget"], sy["ranks"] * ours1["context_at_budget"])
            if r is not None:
                parts.append(f"sp={sy['ranks']}: {r:.2f} ({_tokens(sy['context_at_budget'])})")
                oks.append(r >= w_goal)
    targets = [eager_t, sdpa_t]
    if parts:
        w_t.figure, w_t.met = "; ".join(parts), _yes(all(oks))
        targets.append(w_t)
    elif label == "train:":  # the main shape must have the sp = W runs; a deeper one may be sp = 1 only
        w_t.figure, w_t.met = "needs 'ours sp=1' and an 'ours sp=W' run with W > 1", "unknown"
        targets.append(w_t)
    notes = [f"Model: {part.get('model', '?')}; a full training step (forward, backward, AdamW), fp32. Context "
             f"column: the longest S whose fitted per-rank peak fits {part.get('budget_gb', '?')} GiB "
             f"(an extrapolation from the measured lengths)."]
    flat = [f"{sy['system']} {max(sy['peak_mib_per_rank']) - min(sy['peak_mib_per_rank']):,.0f} MiB over "
            f"{min(sy['peak_mib_per_rank']):,.0f}" for sy in systems
            if max(sy["peak_mib_per_rank"]) - min(sy["peak_mib_per_rank"]) < 0.1 * min(sy["peak_mib_per_rank"])]
    if flat:
        notes.append("Caution: across the measured lengths the peak rose only a little above the fixed cost ("
                     + "; ".join(flat) + "), so those slopes, and the contexts extrapolated from them, carry "
                     "the measurement noise; longer `--mem-seqs` (or a deeper model) tighten them.")
    tp = [(sy["ranks"], sy["throughput"]["tokens_per_s"]) for sy in systems if sy["system"].startswith("ours sp=")]
    if ours1 and len(tp) > 1:
        base = ours1["throughput"]["tokens_per_s"]
        notes.append(f"Throughput at S = {part.get('seq', '?'):,} relative to our sp=1: "
                     + ", ".join(f"sp={w}: {v / base:.2f}x" for w, v in tp if w > 1)
                     + " (the ranks share the machine's cores).")
    headers = (["system", "ranks"] + [f"peak MiB/rank at {S:,}" for S in seqs]
               + ["KiB per token (fit)", f"context within {part.get('budget_gb', '?')} GiB", "tokens/s"])
    return md_table(headers, body), targets, notes


def fmt_train(d: dict) -> Section:
    goals = d.get("targets") or {}
    table, targets, notes = _train_shape(d, goals, "train:")
    deep = d.get("deeper_model")
    if isinstance(deep, dict):
        m = re.search(r"(\d+) layers", str(deep.get("model", "")))
        label = f"train ({m.group(1)} layers):" if m else "train (deeper model):"
        t2, g2, n2 = _train_shape(deep, goals, label)
        table += f"\n\n**{label[:-1].capitalize()}**\n\n" + t2
        targets += g2
        notes += [f"{label[:-1].capitalize()}: {n}" for n in n2]
    return Section(table, targets, notes)


# infer ------------------------------------------------------------------------------------------------

INFER_TARGETS = [Target("infer: TTFT and peak memory vs context", "no numeric target", met="n/a")]


def fmt_infer(d: dict) -> Section:
    lengths = _list(d, "lengths")
    modes = _req(d, "modes")
    one, chunk, sp = (_list(modes, m) for m in ("one_shot", "chunked", "sp2"))
    kv = d.get("kv_cache_bytes") or [None] * len(lengths)
    if not len(one) == len(chunk) == len(sp) == len(lengths):
        raise LayoutError("modes and lengths differ in length")
    body = []
    for S, o, c, s, k in zip(lengths, one, chunk, sp, kv):
        po, pc, ps = (_req(x, "peak_mb") for x in (o, c, s))
        body.append([f"{S:,}", _num(k and k / 2**20, ".0f"),
                     f"{_num(_req(o, 'ttft_s'))} s / {_num(po, '.1f')} MiB",
                     f"{_num(_req(c, 'ttft_s'))} s / {_num(pc, '.1f')} MiB ({_num(_ratio(pc, po), '.2f')}x)",
                     f"{_num(_req(s, 'ttft_s'))} s / {_num(ps, '.1f')} MiB ({_num(_ratio(ps, po), '.2f')}x)"])
    S, o, c, s = lengths[-1], one[-1], chunk[-1], sp[-1]
    t = Target(INFER_TARGETS[0].what, INFER_TARGETS[0].goal, met="n/a")
    t.figure = (f"at {S:,}: TTFT {o['ttft_s']:.1f} / {c['ttft_s']:.1f} / {s['ttft_s']:.1f} s, peak "
                f"{o['peak_mb']:.0f} / {c['peak_mb']:.0f} / {s['peak_mb']:.0f} MiB (one-shot / chunked / W=2)")
    cfg = d.get("config") or {}
    notes = [f"Model: dim {cfg.get('dim')}, {cfg.get('layers')} layers, {cfg.get('heads')} / {cfg.get('kv_heads')} "
             f"heads, {cfg.get('dtype')}, `{cfg.get('backend')}` backend; chunked prefill in chunks of "
             f"{cfg.get('chunk')}; W=2 is two gloo processes and its peak is the larger rank's. Peak memory is the "
             "rise of resident memory during prefill (it includes the KV cache)."]
    same = d.get("same_tokens_all_modes")
    if isinstance(same, list):
        notes.append("All three modes generated the same tokens at every length." if all(same) else
                     f"**The modes generated different tokens** at lengths "
                     f"{[L for L, ok in zip(lengths, same) if not ok]}.")
    headers = ["S", "KV cache MiB", "one-shot: TTFT / peak", "chunked: TTFT / peak (vs one-shot)",
               "sp W=2: TTFT / peak per rank (vs one-shot)"]
    return Section(md_table(headers, body), [t], notes)


# vq ---------------------------------------------------------------------------------------------------

VQ_TARGETS = [Target("vq: throughput and quality after a fixed training budget",
                     "no numeric target (frames/s, PSNR, codebook usage)", met="n/a")]


def _fps(x) -> str:
    return _num(x, ",.1f" if isinstance(x, (int, float)) and x >= 10 else ".3g")


def fmt_vq(d: dict) -> Section:
    thr = _list(d, "throughput")
    body = []
    for r in thr:
        body.append([f"`{_req(r, 'name')}`", str(r.get("mode", "-")), str(r.get("resolution", "-")),
                     _num(r.get("params_M"), ".2f"), str(r.get("codes_per_group", "-")),
                     f"{r.get('codebook_size', 0):,}", _fps(_req(r, "encode_fps")), _fps(_req(r, "decode_fps")), _num(r.get("tokens_per_second_of_video"), ",.0f"),
                     _num(r.get("tokens_per_hour_1fps"), ",.0f")])
    table = md_table(["config", "mode", "resolution", "parameters (M)", "codes per group", "codebook",
                      "encode frames/s", "decode frames/s", "codes per second of video (1 fps)",
                      "codes per hour (1 fps)"], body)
    trained = d.get("training") or []
    if not isinstance(trained, list):
        raise LayoutError("training is not a list")
    rows2 = []
    for r in trained:
        rows2.append([f"`{_req(r, 'name')}`", _num(_req(r, "train_seconds"), ",.0f"), f"{_req(r, 'steps'):,}",
                      f"{_num(r.get('psnr_untrained'), '.1f')} -> {_num(_req(r, 'psnr'), '.1f')}",
                      _num(100 * _req(r, "usage"), ".1f", " %"), _num(r.get("perplexity"), ",.0f"),
                      _num(r.get("codes_used"), ",.0f")])
    if rows2:
        table += "\n\n" + md_table(["config", "training s", "steps", "held-out PSNR dB (untrained -> trained)",
                                      "codebook used", "codebook perplexity", "codes used"], rows2)
    t = Target(VQ_TARGETS[0].what, VQ_TARGETS[0].goal, met="n/a")
    by = {r["name"]: r for r in thr}
    figs = []
    for r in trained:
        enc = by.get(r["name"], {}).get("encode_fps")
        figs.append(f"`{r['name']}`: " + (f"{enc:,.0f} frames/s encode, " if enc else "")
                    + f"PSNR {r['psnr']:.1f} dB, {100 * r['usage']:.0f} % of the codebook after "
                    f"{r['train_seconds']:,.0f} s")
    if not figs:
        figs = [f"`{r['name']}`: {r['encode_fps']:,.0f} frames/s encode" for r in thr]
    t.figure = "; ".join(figs)
    notes = ["Throughput: weights at initialisation (speed does not depend on them), the fastest of the "
             "timings. Quality: each trained config starts from scratch on generated moving-shapes videos "
             "and stops at its training-time budget; PSNR and codebook usage are measured on held-out frames. "
             "The baselines are the untrained tokenizer (PSNR) and, for token cost, the 2D per-frame configs "
             "beside the causal 3D ones."]
    if not trained:
        notes.append("No training run in this JSON (run without `--skip-train` for the quality columns).")
    images = [(f"held-out frames and reconstructions, {r['name']}", f"vq_{r['name']}_samples.png")
              for r in trained]
    return Section(table, [t], notes, images)


# data -------------------------------------------------------------------------------------------------

DATA_TARGETS = [Target("data: 1 fps sampling from an hour of video", "faster than decoding every frame"),
                Target("data: loader tokens/s", "keeps up with a training step")]


def fmt_data(d: dict) -> Section:
    v = _req(d, "video")
    runs = _list(v, "runs")
    body, dec, pyav = [], [], []
    for r in runs:
        base = _req(r, "pyav_decode_all", "seconds")
        sd, sp = _req(r, "project_decord", "seconds"), _req(r, "project_pyav", "seconds")
        dec.append(base / sd)
        pyav.append(base / sp)
        ok = all(r[k].get("correct", False) for k in ("project_decord", "project_pyav", "pyav_decode_all"))
        body.append([f"{_req(r, 'gop_seconds'):g} s", _num(r.get("file_mb"), ".1f"),
                     f"{sd:.1f} ({base / sd:.2f}x)", f"{sp:.1f} ({base / sp:.2f}x)", f"{base:.1f}",
                     "yes" if ok else "**no**"])
    table = md_table(["keyframe interval", "file MiB", "`read_video` decord s (speed-up)",
                      "`read_video` PyAV backend s (speed-up)", "PyAV decode every frame s",
                      "right frames"], body)
    samp = Target(DATA_TARGETS[0].what, DATA_TARGETS[0].goal)

    def span(xs):
        return f"{min(xs):.2f}x" if len(xs) == 1 or abs(max(xs) - min(xs)) < 5e-3 else f"{min(xs):.2f}-{max(xs):.2f}x"

    samp.figure = f"PyAV backend {span(pyav)}, decord (the default `auto`) {span(dec)}"
    samp.met = f"PyAV backend: {_yes(min(pyav) > 1)}; decord: {_yes(min(dec) > 1)}"
    ld = _req(d, "loader")
    tps = _req(ld, "tokens_per_s")
    cons = []
    if isinstance(d.get("train_step_cpu"), dict):
        c = d["train_step_cpu"]
        cons.append((f"{c.get('model', 'small model')} train step on this CPU, seq {c.get('seq_len', '?'):,} "
                     "(measured)", "the measured tokens/s of the CPU train step", _req(c, "tokens_per_s")))
    if isinstance(d.get("train_step_7b_h200"), dict):
        c = d["train_step_7b_h200"]
        cons.append((f"{c.get('model', '7B')} at {c.get('seq_len', 0):,} tokens on one H200 at "
                     f"{100 * c.get('mfu', 0):.0f} % MFU (estimated from FLOPs per token)",
                     f"the estimated tokens/s of a {c.get('model', '7B')} step on one H200", _req(c, "tokens_per_s_per_gpu")))
    rows2 = [[f"token-shard loader, rows of {ld.get('seq_len', 0):,} (padding "
              f"{100 * ld.get('padding_fraction', 0):.1f} %)", f"{tps:,.0f}", "-"]]
    rows2 += [[name, f"{x:,.0f}", f"{tps / x:,.0f}x"] for name, _, x in cons]
    table += "\n\n" + md_table(["producer / consumer", "tokens/s", "loader headroom"], rows2)
    load = Target(DATA_TARGETS[1].what, DATA_TARGETS[1].goal)
    if cons:
        _, short, worst = min(cons, key=lambda c: tps / c[2])
        load.figure = f"{tps:,.0f} tokens/s = {tps / worst:,.0f}x {short}"
        load.met = _yes(tps >= worst)
    else:
        load.figure, load.met = f"{tps:,.0f} tokens/s (no training step in the JSON)", "unknown"
    notes = [f"Video: a {v.get('minutes', '?'):g}-minute {v.get('size', '?')}p x264 file at {v.get('src_fps', '?')} fps, "
             "one frame taken per second; every returned frame is checked against the index drawn into it. "
             "Baseline: PyAV decoding every frame and converting each to RGB. Each time is the best of the "
             "interleaved repeats."]
    return Section(table, [samp, load], notes)


# the registry -----------------------------------------------------------------------------------------

BENCHES: dict[str, Bench] = {
    "model": Bench("Decoder step: longvideo vs transformers",
                   "Forward + backward time and peak resident memory of one training step of the decoder, "
                   "single process, against transformers' `LlamaForCausalLM` (sdpa attention) with the same "
                   "weights and batch; each run in a fresh process.",
                   ["model.md", "architecture.md"], fmt_model, MODEL_TARGETS),
    "ring": Bench("Ring attention",
                  "Causal attention forward + backward over W = 1, 2, 4 gloo ranks at one total length: step "
                  "time, exposed communication, balance and per-rank memory, against one process doing the "
                  "whole sequence (W = 1); a contiguous split is run beside the zigzag layout.",
                  ["ring_attention.md"], fmt_ring, RING_TARGETS),
    "kernels": Bench("Triton flash-attention kernel",
                     "Forward and forward + backward TFLOP/s of the Triton kernel against PyTorch SDPA with "
                     "the flash backend, same inputs (GPU only).",
                     ["kernels.md"], fmt_kernels, KERNEL_TARGETS),
    "train": Bench("Training: longest context per memory budget",
                   "Per-rank peak memory and throughput of a full training step (forward, backward, AdamW) of "
                   "our trainer at sp = 1, 2, 4 (DeepSpeed ZeRO-3, ring attention) against transformers' Llama "
                   "of the same shape with eager and sdpa attention; the longest context within a per-rank "
                   "budget, as in the Ring Attention paper's table.",
                   ["training.md"], fmt_train, TRAIN_TARGETS),
    "infer": Bench("Inference: time to first token and memory vs context",
                   "Time to first token and peak memory during prefill against context length, for one-shot "
                   "prefill (the baseline), chunked prefill and W = 2 sequence-parallel prefill.",
                   ["inference.md"], fmt_infer, INFER_TARGETS),
    "vq": Bench("VQ video tokenizer",
                "Encode and decode frames/s of each VQ config (2D per frame and causal 3D) and the codes it "
                "spends per second of video; held-out PSNR and codebook usage after training from scratch for "
                "a fixed time budget, against the untrained tokenizer.",
                ["vq.md"], fmt_vq, VQ_TARGETS),
    "data": Bench("Data pipeline",
                  "Sampling 1 fps from an hour of video with the project's reader against decoding every "
                  "frame; token-shard loader throughput against the tokens per second a training step "
                  "consumes.",
                  ["data.md"], fmt_data, DATA_TARGETS),
}


# ------------------------------------------------------------------------------------------- the document

def _load_tuple(v) -> str | None:
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, (int, float)) for x in v):
        return "/".join(f"{x:.1f}" for x in v)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"{v:.1f}"
    return None


def machine_line(d: dict) -> str:
    """'2-core CPU, torch X; load average 12.8/11.7/8.1 before, ...' from whichever keys the JSON has."""
    m = d.get("machine")
    parts = []
    if isinstance(m, str):
        parts.append(m)
    elif isinstance(m, dict):
        if m.get("gpu"):
            parts.append(str(m["gpu"]))
        cpus = m.get("cpus") or m.get("cpu_count") or m.get("cores")
        if cpus:
            parts.append(f"{cpus}-core CPU")
        if m.get("torch"):
            parts.append(f"torch {m['torch']}")
    loads = []
    for src in (m if isinstance(m, dict) else {}, d):
        for k, v in src.items():
            if k.startswith("loadavg") and _load_tuple(v):
                when = k[len("loadavg"):].strip("_").replace("_", " ")
                loads.append(_load_tuple(v) + (f" ({when})" if when else ""))
    text = ", ".join(parts) if parts else "not recorded"
    if loads:
        text += "; load average (1/5/15 min) " + ", ".join(loads)
    return text


def _rel(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path, start)).as_posix()


def _doc_link(bench: Bench, docs_dir: Path, out_dir: Path) -> str:
    name = next((c for c in bench.docs if (docs_dir / c).exists()), bench.docs[0])
    return f"[{name}]({_rel(docs_dir / name, out_dir)})"


def _not_measured(name: str, why: str) -> str:
    return f"_Not measured yet ({why}): run `python scripts/bench_{name}.py`._"


def _run_block(r: RunResult, have_json: bool) -> list[str]:
    if r.status == "ok":
        return []
    what = f"timed out after {r.seconds:.0f} s" if r.status == "timeout" else \
        f"failed (exit {r.returncode}) after {r.seconds:.0f} s"
    lines = [f"**The last run of `scripts/bench_{r.name}.py` {what}.** "
             + ("The figures below come from the JSON that was already there." if have_json else ""), ""]
    if r.stderr_tail:
        lines += ["```", r.stderr_tail, "```", ""]
    return lines


def read_section(name: str, bench_dir: Path) -> tuple[Section | None, str | None, dict | None]:
    """(section, why-not, raw JSON) for one benchmark; never raises on a bad or missing file."""
    path = bench_dir / f"{name}.json"
    if not path.exists():
        return None, f"no {path.name}", None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"{path.name} is not readable JSON: {type(e).__name__}", None
    if not isinstance(data, dict):
        return None, f"{path.name} is not a JSON object", None
    bench = BENCHES.get(name)
    if bench is None:
        return Section("", [], ["No formatter for this benchmark yet; see the JSON."]), None, data
    try:
        return bench.fmt(data), None, data
    except (LayoutError, KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        return None, f"{path.name} has a layout this page does not read: {e}", data


def build_markdown(bench_dir: Path = BENCH_DIR, out_path: Path = OUT_PATH, docs_dir: Path = DOCS_DIR,
                   names: list[str] | None = None, runs: dict[str, RunResult] | None = None) -> str:
    """Write out_path from bench_dir/<name>.json for every name (default: the known benchmarks plus
    any other JSON or script found) and return the text. `runs` adds the last run's failures."""
    runs = runs or {}
    if names is None:
        extra = {p.stem for p in bench_dir.glob("*.json")} | set(runs)
        names = list(BENCHES) + sorted(extra - set(BENCHES))
    out_dir = out_path.parent
    summary, sections = [], []
    for name in names:
        bench = BENCHES.get(name) or Bench(name, "", [f"{name}.md"], lambda d: Section("", []), [])
        section, why, data = read_section(name, bench_dir)
        r = runs.get(name)
        if section is None:
            targets = [Target(t.what, t.goal, "-", "not measured yet") for t in bench.targets] or \
                [Target(name, "-", "-", "not measured yet")]
        else:
            targets = section.targets or [Target(name, "-", "see below", "n/a")]
        if r is not None and r.status != "ok":
            for t in targets:
                t.met += f" (last run {'timed out' if r.status == 'timeout' else 'failed'})"
        anchor = f"#{name}"
        for t in targets:
            summary.append([f"[{t.what}]({anchor})", t.figure.replace("|", "\\|"), t.goal, t.met])

        lines = [f'<a id="{name}"></a>', f"## {bench.title} (`scripts/bench_{name}.py`)", ""]
        if bench.measures:
            lines += [bench.measures, ""]
        if r is not None:
            lines += _run_block(r, data is not None)
        if section is None:
            lines += [_not_measured(name, why), ""]
        else:
            if section.table:
                lines += [section.table, ""]
            if section.targets and any(t.met not in ("n/a",) for t in section.targets):
                lines += [f"- **{t.what.split(': ', 1)[-1]}** (target: {t.goal}): "
                          + (f"{t.figure}. " if t.figure != "-" else "") + f"Met: {t.met}."
                          for t in section.targets if t.met != "n/a"] + [""]
            for note in section.notes:
                lines += [note, ""]
            lines += [f"Machine: {machine_line(data)}.", ""]
        if section is not None:
            for alt, fname in [(bench.title, f"{name}.png")] + section.images:
                if (bench_dir / fname).exists():
                    lines += [f"![{alt}]({_rel(bench_dir / fname, out_dir)})", ""]
        ref = [f"Details: {_doc_link(bench, docs_dir, out_dir)}."]
        if data is not None:
            ref.append(f"Data: [{_rel(bench_dir / f'{name}.json', out_dir)}]"
                       f"({_rel(bench_dir / f'{name}.json', out_dir)}).")
        ref.append(f"Reproduce: `python scripts/bench_{name}.py`.")
        lines += [" ".join(ref), ""]
        sections.append("\n".join(lines))

    head = [
        "# Benchmarks", "",
        "Generated by `python scripts/run_benchmarks.py` (`make bench`) from the JSON every "
        "`scripts/bench_*.py` writes under `docs/bench/`; rebuild with `--skip-run` after rerunning one "
        "script. Every script runs its baseline side by side in the same run and records the machine and "
        "its load average: figures from the shared 2-core CPU machine are noisy, and GPU-only benchmarks "
        "say so when they were skipped.", "",
        md_table(["benchmark", "measured", "target", "met"], summary), "",
    ]
    text = "\n".join(head) + "\n" + "\n".join(sections).rstrip() + "\n"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(text)
    return text


# ------------------------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help="run only these benchmarks (model, ring, ... or bench_model.py)")
    p.add_argument("--skip-run", action="store_true", help="only regenerate the markdown from existing JSON")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per script; 0 for no limit")
    p.add_argument("--scripts-dir", type=Path, default=SCRIPTS_DIR)
    p.add_argument("--bench-dir", type=Path, default=BENCH_DIR, help="where the scripts' JSON and PNG are")
    p.add_argument("--out", type=Path, default=OUT_PATH, help="the markdown to write")
    p.add_argument("--docs-dir", type=Path, default=DOCS_DIR, help="where the detailed docs linked to live")
    args = p.parse_args(argv)

    runs: dict[str, RunResult] = {}
    if not args.skip_run:
        scripts = discover(args.scripts_dir)
        if args.only:
            want = [n.removesuffix(".py").removeprefix("bench_") for n in args.only]
            unknown = [n for n in want if n not in scripts]
            if unknown:
                p.error(f"no scripts/bench_<name>.py for {unknown}; available: {', '.join(scripts)}")
            scripts = {n: scripts[n] for n in want}
        runs = run_all(scripts, args.timeout or None)
    build_markdown(args.bench_dir, args.out, args.docs_dir, runs=runs)
    print(f"wrote {args.out}")
    bad = [r for r in runs.values() if r.status != "ok"]
    for r in bad:
        print(f"bench_{r.name}.py: {r.status}" + (f" (exit {r.returncode})" if r.status == "failed" else ""),
              file=sys.stderr)
    if runs:
        print("runs: " + ", ".join(f"{r.name} {r.status} ({r.seconds:.0f} s)" for r in runs.values()))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
