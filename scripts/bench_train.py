"""Benchmark training on CPU: throughput and per-rank memory at sp = 1, 2, 4, and the shape of the
Ring Attention paper's Table 3 (longest context that fits a per-rank memory budget).

    python scripts/bench_train.py                                  # tiny model, a few minutes
    python scripts/bench_train.py --deep-layers 32                 # also 7B's depth at the tiny width
    python scripts/bench_train.py --seq 8192 --mem-seqs 2048,4096,8192 --budget-gb 64

Systems, each a full training step (forward, backward, AdamW) in fp32 on CPU:
  * transformers, eager attention: LlamaForCausalLM of the same shape (materialises the S x S
    attention weights: the paper's "vanilla" column),
  * transformers, sdpa attention: the same model with memory-efficient attention (the paper's
    second column),
  * ours at sp = 1, 2, 4: `longvideo.train.Trainer` (DeepSpeed ZeRO-3, ring attention over sp
    ranks, blockwise feed-forward, chunked loss, activation checkpointing as configured).

Memory is the per-rank resident-set high-water mark of one step (VmHWM, reset before the step;
glibc is told to map large blocks separately so freed memory does not linger in the heap).
For each system a least-squares fit of peak memory against the total sequence length S (linear,
plus an S^2 term for eager attention) gives the longest S whose step fits `--budget-gb` per rank.
Targets: ours at sp = 1 reaches >= 16x the transformers model's context; ours at sp = W reaches
>= 0.9 x W x ours at sp = 1. Writes JSON and a PNG (docs/bench/train.{json,png} by default).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

# ------------------------------------------------------------------------------------------- report
# Read by run_benchmarks.py to build docs/benchmarks.md: the title, what is measured, the detail docs
# under docs/ (the first that exists is linked), the targets (the summary rows while nothing is
# measured) and report(), which turns this script's JSON into a table, the targets met or not, and
# notes.

import re
from benchreport import (Section, Target, fmt_num, fmt_tokens, md_table, ratio, req, req_list, reset_peak,
                         spawn_ranks, status_mib, yes_no)

TITLE = "Training: longest context per memory budget"
MEASURES = ("Per-rank peak memory and throughput of a full training step (forward, backward, AdamW) of our "
            "trainer at sp = 1, 2, 4 (DeepSpeed ZeRO-3, ring attention) against transformers' Llama of the "
            "same shape with eager and sdpa attention; the longest context within a per-rank budget, as in "
            "the Ring Attention paper's table.")
DOCS = ["training.md"]
TARGETS = [Target("train: our sp=1 context vs transformers (eager)", ">= 16x"),
           Target("train: our sp=1 context vs transformers (sdpa)", ">= 16x"),
           Target("train: our sp=W context", ">= 0.9 x W x our sp=1")]


def _train_shape(part: dict, goals: dict, label: str) -> tuple[str, list[Target], list[str]]:
    """Table, target rows and notes for one model shape of bench_train's JSON."""
    systems = req_list(part, "systems")
    seqs = sorted({s for sy in systems for s in req(sy, "seqs")})
    by = {}
    body = []
    for sy in systems:
        name = req(sy, "system")
        by[name] = sy
        peaks = dict(zip(sy["seqs"], req(sy, "peak_mib_per_rank")))
        body.append([name, str(req(sy, "ranks"))] + [fmt_num(peaks.get(S), ",.0f") for S in seqs]
                    + [f"{fmt_num(req(sy, 'fit', 'kib_per_token'), ',.1f')} ({sy['fit'].get('form', '?')})",
                       fmt_tokens(req(sy, "context_at_budget")),
                       fmt_num(req(sy, "throughput", "tokens_per_s"), ",.0f")])
    hf_goal = goals.get("ours_sp1_over_transformers", 16.0)
    w_goal = goals.get("ours_spW_over_Wx_sp1", 0.9)
    eager_t, sdpa_t, w_t = (Target(t.what.replace("train:", label), t.goal) for t in TARGETS)
    eager_t.goal = sdpa_t.goal = f">= {hf_goal:g}x"
    w_t.goal = f">= {w_goal:g} x W x our sp=1"
    ours1 = by.get("ours sp=1")
    for t, attn in ((eager_t, "eager"), (sdpa_t, "sdpa")):
        hf = by.get(f"transformers {attn}")
        r = ratio(ours1 and ours1["context_at_budget"], hf and hf["context_at_budget"])
        if r is None:
            t.figure, t.met = f"needs 'ours sp=1' and 'transformers {attn}' in the JSON", "unknown"
        else:
            t.figure = (f"{r:,.1f}x ({fmt_tokens(ours1['context_at_budget'])} vs "
                        f"{fmt_tokens(hf['context_at_budget'])} tokens)")
            t.met = yes_no(r >= hf_goal)
    parts, oks = [], []
    for sy in systems:
        if sy["system"].startswith("ours sp=") and sy["ranks"] > 1 and ours1:
            r = ratio(sy["context_at_budget"], sy["ranks"] * ours1["context_at_budget"])
            if r is not None:
                parts.append(f"sp={sy['ranks']}: {r:.2f} ({fmt_tokens(sy['context_at_budget'])})")
                oks.append(r >= w_goal)
    targets = [eager_t, sdpa_t]
    if parts:
        w_t.figure, w_t.met = "; ".join(parts), yes_no(all(oks))
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


def report(result: dict) -> Section:
    goals = result.get("targets") or {}
    table, targets, notes = _train_shape(result, goals, "train:")
    deep = result.get("deeper_model")
    if isinstance(deep, dict):
        m = re.search(r"(\d+) layers", str(deep.get("model", "")))
        label = f"train ({m.group(1)} layers):" if m else "train (deeper model):"
        t2, g2, n2 = _train_shape(deep, goals, label)
        table += f"\n\n**{label[:-1].capitalize()}**\n\n" + t2
        targets += g2
        notes += [f"{label[:-1].capitalize()}: {n}" for n in n2]
    return Section(table, targets, notes)


ROOT = Path(__file__).resolve().parent.parent


def _overrides(args, sp: int, out_dir: str) -> list[str]:
    return [f"model.n_layers={args.layers}", f"parallel.sp={sp}", "train.zero_stage=3", "train.micro_batch_size=1",
            "train.grad_accum=1", "train.steps=1000", "train.warmup_steps=1", "train.progress=false",
            "train.tensorboard=false", "train.plot=false", f"data.seq_len={args.seq}", f"train.out_dir={out_dir}",
            *args.override]


def _batch(cfg, S: int, seed: int):
    from longvideo.train.synthetic_tokens import SyntheticTokens

    data = SyntheticTokens(seq_len=S, batch_size=1, vocab=cfg.train.synthetic_vocab or cfg.model.text_vocab_size,
                           seed=seed)
    return data.batch(0)


# ---- our trainer, one rank ------------------------------------------------------------------------

def _ours_rank(rank, world, init_file, args, queue):
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(max(1, args.threads // world))
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=3600))
        from longvideo.config import load_config
        from longvideo.train.trainer import Trainer

        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(args.config, _overrides(args, world, tmp))
            t = Trainer(cfg)

            def step(S, seed):
                mb = t.shard(_batch(cfg, S, seed))
                t.optimizer_step(t.forward_backward([mb]))

            step(min(args.mem_seqs), 0)  # warm-up: optimizer state, allocator, kernels
            res = {"rank": rank, "baseline_mib": status_mib("VmRSS"), "mem": {}, "step_s": []}
            for S in sorted(args.mem_seqs):
                dist.barrier()
                reset_peak()
                step(S, 1)
                res["mem"][S] = status_mib("VmHWM")
            for i in range(args.steps + 1):
                dist.barrier()
                t0 = time.perf_counter()
                step(args.seq, 2 + i)
                if i > 0:  # the first one warms up this length
                    res["step_s"].append(time.perf_counter() - t0)
            dist.barrier()
        queue.put(res)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        queue.put({"rank": rank, "error": f"{e!r}\n{traceback.format_exc()}"})


def run_ours(args, sp: int) -> dict:
    ranks = spawn_ranks(_ours_rank, sp, args, label=f"sp={sp}")
    return _summarise(f"ours sp={sp}", sp, args, ranks, _seqs(args))


# ---- transformers baseline, one process -------------------------------------------------------------

def _hf_proc(args, attn: str, queue):
    try:
        torch.set_num_threads(args.threads)
        from transformers import LlamaConfig, LlamaForCausalLM

        from longvideo.config import load_config

        cfg = load_config(args.config, _overrides(args, 1, "unused"))
        m = cfg.model
        hf = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim,
                         num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
                         num_key_value_heads=m.n_kv_heads, rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                         max_position_embeddings=1 << 22, tie_word_embeddings=m.tie_embeddings,
                         attn_implementation=attn)
        torch.manual_seed(0)
        model = LlamaForCausalLM(hf)
        model.train()
        tc = cfg.train
        opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)

        def step(S, seed):
            b = _batch(cfg, S, seed)
            labels = torch.where(b["loss_weights"] > 0, b["targets"], -100)
            # transformers shifts labels itself: give it the inputs' labels one position early
            labels = torch.cat([torch.full_like(labels[:, :1], -100), labels[:, :-1]], dim=1)
            out = model(input_ids=b["input_ids"], labels=labels)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)

        seqs = _seqs(args, attn)
        step(min(seqs), 0)
        res = {"rank": 0, "baseline_mib": status_mib("VmRSS"), "mem": {}, "step_s": []}
        for S in seqs:
            reset_peak()
            step(S, 1)
            res["mem"][S] = status_mib("VmHWM")
        for i in range(args.steps + 1):
            t0 = time.perf_counter()
            step(args.seq, 2 + i)
            if i > 0:
                res["step_s"].append(time.perf_counter() - t0)
        queue.put(res)
    except BaseException as e:  # noqa: BLE001
        import traceback

        queue.put({"rank": 0, "error": f"{e!r}\n{traceback.format_exc()}"})


def _seqs(args, attn: str = "") -> list[int]:
    return sorted(args.eager_mem_seqs if attn == "eager" else args.mem_seqs)


def run_hf(args, attn: str) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    p = ctx.Process(target=_hf_proc, args=(args, attn, queue))
    p.start()
    res = queue.get()
    p.join()
    if "error" in res:
        raise RuntimeError(f"transformers ({attn}) failed:\n{res['error']}")
    return _summarise(f"transformers {attn}", 1, args, [res], _seqs(args, attn), quadratic=attn == "eager")


# ---- fits and summary ---------------------------------------------------------------------------------

def fit(seqs: list[int], mem: list[float], quadratic: bool) -> list[float]:
    """Least-squares coefficients [a, b(, c)] of mem = a + b S (+ c S^2), S in tokens, mem in MiB."""
    cols = [[1.0, s, s * s] if quadratic else [1.0, s] for s in seqs]
    A = torch.tensor(cols, dtype=torch.float64)
    y = torch.tensor(mem, dtype=torch.float64)[:, None]
    return torch.linalg.lstsq(A, y).solution.flatten().tolist()


def context_at(coef: list[float], budget_mib: float) -> float:
    """Largest S with a + b S (+ c S^2) <= budget."""
    a, b = coef[0], coef[1]
    c = coef[2] if len(coef) > 2 else 0.0
    if c > 1e-12:
        return (-b + math.sqrt(b * b + 4 * c * (budget_mib - a))) / (2 * c)
    return (budget_mib - a) / b if b > 0 else float("inf")


def _summarise(name, world, args, ranks, seqs, quadratic=False) -> dict:
    per_rank_peak = [max(r["mem"][S] for r in ranks) for S in seqs]  # the rank that needs most
    coef = fit(seqs, per_rank_peak, quadratic)
    step_s = statistics.median(max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"])))
    return {
        "system": name, "ranks": world, "seqs": seqs, "peak_mib_per_rank": per_rank_peak,
        "baseline_mib_per_rank": max(r["baseline_mib"] for r in ranks),
        "fit": {"coef": coef, "form": "a + b S + c S^2" if quadratic else "a + b S",
                "kib_per_token": coef[1] * 1024},
        "context_at_budget": context_at(coef, args.budget_gb * 1024),
        "throughput": {"seq": args.seq, "step_s": step_s, "tokens_per_s": args.seq / step_s},
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in (result, result.get("deeper_model")) if p]
    fig, axes = plt.subplots(len(parts), 2, figsize=(11, 4 * len(parts)), dpi=120, squeeze=False)
    for (ax1, ax2), part in zip(axes, parts):
        systems = part["systems"]
        for s in systems:
            line, = ax1.plot(s["seqs"], s["peak_mib_per_rank"], "o", label=s["system"])
            xs = [min(s["seqs"]) + i * (max(s["seqs"]) - min(s["seqs"])) / 40 for i in range(41)]
            c = s["fit"]["coef"]
            ax1.plot(xs, [c[0] + c[1] * x + (c[2] * x * x if len(c) > 2 else 0) for x in xs], "-",
                     color=line.get_color(), lw=1)
        ax1.set_xlabel("total sequence length S (tokens)")
        ax1.set_ylabel("peak memory per rank (MiB)")
        ax1.set_title(part["model"], fontsize=8)
        ax1.legend(fontsize=8)
        ax1.grid(alpha=0.3)
        names = [s["system"] for s in systems]
        ctx = [s["context_at_budget"] for s in systems]
        bars = ax2.bar(range(len(names)), ctx, color=[f"C{i}" for i in range(len(names))])
        ax2.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax2.set_yscale("log")
        ax2.set_ylabel("max context (tokens)")
        ax2.set_title(f"longest context within {part['budget_gb']:g} GiB per rank (fit)", fontsize=9)
        for b, v in zip(bars, ctx):
            ax2.text(b.get_x() + b.get_width() / 2, v, f"{v / 1024:,.0f}K", ha="center", va="bottom", fontsize=7)
    fig.suptitle(f"one training step (forward, backward, AdamW), fp32, CPU ({result['machine']['cores']} cores)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def measure_shape(args, sps: list[int]) -> dict:
    """Every system at one model shape: {model, budget_gb, seq, systems, ratios}."""
    systems = []
    for attn in [a for a in args.hf.split(",") if a]:
        print(f"transformers ({attn}) ...", flush=True)
        systems.append(run_hf(args, attn))
    for sp in sps:
        print(f"ours sp={sp} ...", flush=True)
        systems.append(run_ours(args, sp))
    by = {s["system"]: s for s in systems}
    ratios = {}
    ours1 = by.get("ours sp=1")
    if ours1:
        for attn in ("eager", "sdpa"):
            if f"transformers {attn}" in by:
                ratios[f"ours_sp1_over_transformers_{attn}"] = (ours1["context_at_budget"]
                                                                 / by[f"transformers {attn}"]["context_at_budget"])
        for sp in sps:
            if sp > 1:
                ratios[f"ours_sp{sp}_over_{sp}x_sp1"] = by[f"ours sp={sp}"]["context_at_budget"] / (sp * ours1["context_at_budget"])
                ratios[f"tokens_per_s_sp{sp}_over_sp1"] = (by[f"ours sp={sp}"]["throughput"]["tokens_per_s"]
                                                          / ours1["throughput"]["tokens_per_s"])
    from longvideo.config import load_config

    m = load_config(args.config, _overrides(args, 1, "unused")).model
    return {
        "model": f"{args.config} with {m.n_layers} layers (dim {m.dim}, {m.n_heads}/{m.n_kv_heads} heads, "
                 f"vocab {m.vocab_size}, activation checkpointing {m.activation_checkpointing})",
        "budget_gb": args.budget_gb, "seq": args.seq, "systems": systems, "ratios": ratios,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny.yaml")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (LLaMA-2 7B has 32)")
    p.add_argument("--seq", type=int, default=2048, help="total sequence length for the throughput steps")
    p.add_argument("--mem-seqs", default="4096,8192,16384",
                   help="total lengths for the memory fit (above the loss/ffn chunk sizes, so the fit is linear)")
    p.add_argument("--eager-mem-seqs", default="512,1024,2048",
                   help="lengths for transformers' eager attention, whose S x S weights outgrow memory sooner")
    p.add_argument("--sps", default="1,2,4", help="sequence-parallel sizes of our trainer")
    p.add_argument("--hf", default="eager,sdpa", help="transformers attention implementations ('' = none)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per system")
    p.add_argument("--budget-gb", type=float, default=16.0, help="memory per rank for the context column")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads shared by a system's ranks")
    p.add_argument("--override", action="append", default=[], help="extra dotted config override")
    p.add_argument("--deep-layers", type=int, default=0,
                   help="also measure transformers and ours sp=1 at this depth (e.g. 32, LLaMA-2 7B's)")
    p.add_argument("--deep-mem-seqs", default="2048,4096,8192", help="lengths for the deeper model's fit")
    p.add_argument("--deep-eager-mem-seqs", default="256,512,1024", help="lengths for its eager baseline")
    p.add_argument("--out", default=str(ROOT / "docs" / "bench" / "train.json"))
    args = p.parse_args(argv)
    args.deep_mem_seqs = [int(x) for x in args.deep_mem_seqs.split(",")]
    args.deep_eager_mem_seqs = [int(x) for x in args.deep_eager_mem_seqs.split(",")]
    args.mem_seqs = [int(x) for x in args.mem_seqs.split(",")]
    args.eager_mem_seqs = [int(x) for x in args.eager_mem_seqs.split(",")]
    sps = [int(x) for x in args.sps.split(",")]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # the workers inherit this: glibc then maps every block >= 64 KiB on its own and unmaps it when
    # freed, so the resident-set peak of a step is that step's, not memory the heap kept from before
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

    result = measure_shape(args, sps)
    if args.deep_layers:
        # a second shape: LLaMA-2 7B's depth at the tiny width, where activation checkpointing and the
        # blockwise pieces save what they save on the real model (one layer input kept per layer)
        import copy

        deep = copy.copy(args)
        deep.layers, deep.seq = args.deep_layers, min(args.deep_mem_seqs)
        deep.mem_seqs, deep.eager_mem_seqs = args.deep_mem_seqs, args.deep_eager_mem_seqs
        print(f"--- {args.deep_layers} layers ---", flush=True)
        result["deeper_model"] = measure_shape(deep, [1])
    result.update({
        "targets": {"ours_sp1_over_transformers": 16.0, "ours_spW_over_Wx_sp1": 0.9},
        "machine": {"cores": os.cpu_count(), "loadavg": os.getloadavg(), "platform": platform.platform(),
                    "torch": torch.__version__, "threads": args.threads},
        "argv": sys.argv[1:] if argv is None else argv,
    })
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    for part in (result, result.get("deeper_model")):
        if part is None:
            continue
        print(part["model"])
        print(f"{'system':<22}{'KiB/token':>12}{'context@' + format(args.budget_gb, 'g') + 'GiB':>18}{'tok/s':>10}")
        for sy in part["systems"]:
            print(f"{sy['system']:<22}{sy['fit']['kib_per_token']:>12.1f}{sy['context_at_budget']:>18,.0f}"
                  f"{sy['throughput']['tokens_per_s']:>10.0f}")
        for k, v in part["ratios"].items():
            print(f"  {k}: {v:.2f}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
