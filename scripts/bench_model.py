#!/usr/bin/env python
"""Single-process forward+backward time and peak memory: longvideo's decoder vs transformers' Llama.

Both models get the same weights (dim 256, 4 layers, 4 heads / 2 kv heads, vocab 32768 by default)
and the same batch; each (model, sequence length) runs in a fresh subprocess so that its peak RSS
(ru_maxrss) is its own. Reports time and peak memory per length, the ratios, and the longest
context that fits a memory budget (from a linear fit of peak memory against length; the fit is
stated as such). Writes docs/bench/model.json and docs/bench/model.png.

    python scripts/bench_model.py                 # 4K and 16K, budget 8 GiB
    python scripts/bench_model.py --lengths 2048 4096 8192 16384 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# ------------------------------------------------------------------------------------------- report
# Read by run_benchmarks.py to build docs/benchmarks.md: the title, what is measured, the detail docs
# under docs/ (the first that exists is linked), the targets (the summary rows while nothing is
# measured) and report(), which turns this script's JSON into a table, the targets met or not, and
# notes.

from benchreport import Section, Target, fmt_num, fmt_tokens, md_table, ratio, req, req_list, yes_no

TITLE = "Decoder step: longvideo vs transformers"
MEASURES = ("Forward + backward time and peak resident memory of one training step of the decoder, single "
            "process, against transformers' `LlamaForCausalLM` (sdpa attention) with the same weights and "
            "batch; each run in a fresh process.")
DOCS = ["model.md", "architecture.md"]
TARGETS = [Target("model: peak memory at 16K", "<= 1/4 of transformers'"),
           Target("model: step time at 4K", "no slower than transformers")]


def report(result: dict) -> Section:
    rows = req_list(result, "table")
    body, by = [], {}
    for r in rows:
        S = req(r, "seq_len")
        by[S] = r
        speed = ratio(r.get("hf_s"), r.get("ours_s"))
        mem = ratio(r.get("ours_gib"), r.get("hf_gib"))
        body.append([f"{S:,}", fmt_num(r.get("ours_s")), fmt_num(r.get("hf_s")), fmt_num(speed, ".2f", "x"),
                     fmt_num(r.get("ours_gib")), fmt_num(r.get("hf_gib")), fmt_num(mem, ".3f")])
    errors = {(e.get("impl"), e.get("seq_len")): e["error"] for e in result.get("results", [])
              if isinstance(e, dict) and "error" in e}

    def missing(S):
        errs = [f"{impl} at {s:,}: {msg}" for (impl, s), msg in errors.items() if s == S]
        return "; ".join(errs) if errs else f"no complete run at {S:,} tokens"

    mem_t, speed_t = (Target(t.what, t.goal) for t in TARGETS)
    r16 = by.get(16384, {})
    mem = ratio(r16.get("ours_gib"), r16.get("hf_gib"))
    if mem is None:
        mem_t.figure, mem_t.met = missing(16384), "unknown"
    else:
        mem_t.figure = f"{mem:.3f}x ({r16['ours_gib']:.2f} vs {r16['hf_gib']:.2f} GiB)"
        mem_t.met = yes_no(mem <= 0.25)
    r4 = by.get(4096, {})
    speed = ratio(r4.get("hf_s"), r4.get("ours_s"))
    if speed is None:
        speed_t.figure, speed_t.met = missing(4096), "unknown"
    else:
        speed_t.figure = f"{speed:.2f}x transformers' speed ({r4['ours_s']:.2f} vs {r4['hf_s']:.2f} s)"
        speed_t.met = yes_no(speed >= 1.0)
    notes = []
    cfg = result.get("config") or {}
    if cfg:
        notes.append(f"Model: dim {cfg.get('dim')}, {cfg.get('layers')} layers, {cfg.get('heads')} heads / "
                     f"{cfg.get('kv_heads')} key-value heads, vocabulary {cfg.get('vocab')}, fp32; "
                     f"{cfg.get('threads')} threads, best of {cfg.get('repeats')} timed step(s) after a warm-up.")
    fits = result.get("max_len_fit") or {}
    if fits:
        ours, hf = fits.get("longvideo"), fits.get("transformers")
        line = (f"Longest context under {cfg.get('budget_gib', '?')} GiB (a linear fit of peak memory against "
                f"length, an extrapolation): longvideo {fmt_tokens(ours)}, transformers {fmt_tokens(hf)}")
        r = ratio(ours, hf)
        notes.append(line + (f" ({r:.1f}x)." if r else "."))
    for (impl, s), msg in errors.items():
        notes.append(f"{impl} at {s:,} tokens did not complete: {msg}")
    headers = ["S", "longvideo s", "transformers s", "speed-up (hf s / ours s)", "longvideo peak GiB",
               "transformers peak GiB", "memory (ours / hf)"]
    return Section(md_table(headers, body), [mem_t, speed_t], notes)


ROOT = Path(__file__).resolve().parent.parent


def child(impl: str, seq: int, args) -> dict:
    """Runs in the subprocess: build, warm up once, time `repeats` fwd+bwd steps."""
    import resource

    import torch

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    from longvideo.checkpoint import to_hf_names
    from longvideo.model import ModelConfig, Transformer

    cfg = ModelConfig(text_vocab_size=args.vocab - 4 - 64, codebook_size=64, dim=args.dim, n_layers=args.layers,
                      n_heads=args.heads, n_kv_heads=args.kv_heads, ffn_chunk=args.ffn_chunk,
                      loss_chunk=args.loss_chunk, max_seq_len=seq, rope_theta=1e6)
    ours = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    if impl == "transformers":
        from transformers import LlamaConfig, LlamaForCausalLM

        hc = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
                         num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.n_kv_heads, rope_theta=cfg.rope_theta,
                         max_position_embeddings=seq, rms_norm_eps=cfg.norm_eps)
        hc._attn_implementation = "sdpa"
        model = LlamaForCausalLM(hc)
        model.load_state_dict(to_hf_names(ours.state_dict(), cfg), strict=False)
        del ours

        def step():
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
    else:
        model = ours

        def step():
            s, w = model(ids, targets=ids.roll(-1, dims=1))
            (s / w).backward()

    model.train()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step()  # warm-up (allocator, kernels)
    times = []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"impl": impl, "seq_len": seq, "step_s": min(times), "peak_rss_bytes": peak, "base_rss_bytes": base_rss}


def run_child(impl: str, seq: int, argv: list[str], timeout: float) -> dict | None:
    cmd = [sys.executable, __file__, "--child", impl, str(seq)] + argv
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "seq_len": seq, "error": f"timeout after {timeout} s"}
    if r.returncode != 0:
        tail = (r.stderr or "").strip().splitlines()[-1:] or ["?"]
        return {"impl": impl, "seq_len": seq, "error": f"exit {r.returncode}: {tail[0]}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def fit_max_len(points: list[tuple[int, float]], budget: float) -> float | None:
    """Longest length under `budget` from a least-squares line through (length, peak bytes)."""
    if len(points) < 2:
        return None
    import numpy as np

    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    slope, icpt = np.polyfit(x, y, 1)
    return float((budget - icpt) / slope) if slope > 0 else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--ffn-chunk", type=int, default=4096)
    p.add_argument("--loss-chunk", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--budget-gib", type=float, default=8.0)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--impls", nargs="+", default=["longvideo", "transformers"])
    p.add_argument("--out", default=str(ROOT / "docs" / "bench" / "model.json"))
    p.add_argument("--child", nargs=2, metavar=("IMPL", "SEQ"), help=argparse.SUPPRESS)
    args, _ = p.parse_known_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args)))
        return 0

    passthrough = []
    for k in ("dim", "layers", "heads", "kv_heads", "vocab", "ffn_chunk", "loss_chunk", "repeats", "threads"):
        passthrough += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    results = []
    from tqdm import tqdm

    jobs = [(impl, s) for s in args.lengths for impl in args.impls]
    for impl, s in tqdm(jobs, desc="bench_model", unit="run"):
        r = run_child(impl, s, passthrough, args.timeout)
        results.append(r)
        tqdm.write(json.dumps(r))

    budget = args.budget_gib * 2**30
    table, fits = [], {}
    for impl in args.impls:
        pts = [(r["seq_len"], r["peak_rss_bytes"]) for r in results if r["impl"] == impl and "error" not in r]
        fits[impl] = fit_max_len(pts, budget)
    print(f"\n{'seq':>7} | {'ours s':>8} {'hf s':>8} {'speed hf/ours':>13} | {'ours GiB':>9} {'hf GiB':>8} {'mem ours/hf':>11}")
    for s in args.lengths:
        o = next((r for r in results if r["impl"] == "longvideo" and r["seq_len"] == s), None)
        h = next((r for r in results if r["impl"] == "transformers" and r["seq_len"] == s), None)
        row = {"seq_len": s}
        if o and "error" not in o:
            row.update(ours_s=o["step_s"], ours_gib=o["peak_rss_bytes"] / 2**30)
        if h and "error" not in h:
            row.update(hf_s=h["step_s"], hf_gib=h["peak_rss_bytes"] / 2**30)
        if "ours_s" in row and "hf_s" in row:
            row.update(speedup=row["hf_s"] / row["ours_s"], mem_ratio=row["ours_gib"] / row["hf_gib"])
        table.append(row)
        f = lambda k, fmt: format(row[k], fmt) if k in row else "-"
        print(f"{s:>7} | {f('ours_s', '8.2f')} {f('hf_s', '8.2f')} {f('speedup', '13.2f')} | "
              f"{f('ours_gib', '9.2f')} {f('hf_gib', '8.2f')} {f('mem_ratio', '11.3f')}")
    for impl, m in fits.items():
        print(f"longest context under {args.budget_gib} GiB ({impl}, linear fit): "
              f"{'-' if m is None else f'{m:,.0f}'} tokens")
    meta = {k: getattr(args, k) for k in ("dim", "layers", "heads", "kv_heads", "vocab", "ffn_chunk",
                                          "loss_chunk", "repeats", "threads", "budget_gib")}
    out = {"machine": f"{os.cpu_count()}-core CPU", "loadavg": os.getloadavg(), "config": meta,
           "results": results, "table": table, "max_len_fit": fits}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    plot(table, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}")
    return 0


def plot(table, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("ours", "longvideo"), ("hf", "transformers (sdpa)")):
        xs = [r["seq_len"] for r in table if f"{key}_s" in r]
        axes[0].plot(xs, [r[f"{key}_s"] for r in table if f"{key}_s" in r], "o-", label=label)
        axes[1].plot(xs, [r[f"{key}_gib"] for r in table if f"{key}_gib" in r], "o-", label=label)
    axes[0].set(xlabel="sequence length", ylabel="fwd+bwd seconds", title="step time")
    axes[1].set(xlabel="sequence length", ylabel="peak RSS (GiB)", title="peak memory")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
