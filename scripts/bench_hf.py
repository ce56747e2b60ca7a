"""Benchmark a transformers model trained with ring attention (longvideo.hf) on CPU: the longest
context one training step fits in a per-rank memory budget, and tokens/s, against the same model
with transformers' sdpa attention, in one run.

    python scripts/bench_hf.py                  # defaults below, ~9 min on 2 busy cores
    python scripts/bench_hf.py --quick          # W = 1, 2 and shorter sequences (~4 min)
    python scripts/bench_hf.py --layers 30 --lengths 2048,4096,8192 --budget-gb 16   # a bigger machine

The model is a LlamaForCausalLM of SmolLM-135M's shape (hidden 576, 9 query / 3 key-value heads,
ffn 1536, vocab 49152, tied embeddings) with fewer layers (default 2 of 30) so that the CPU run
stays short (with checkpointing each further layer keeps only its 576-float input per token, ~2 KiB,
against ~590 KiB per token for the logits and their gradients); random weights and tokens.
Systems, each a full training step (forward, backward, AdamW) in fp32 with gradient checkpointing
on (`model.gradient_checkpointing_enable()`), one document of S tokens per step:

  * sdpa: attn_implementation="sdpa", one process on the whole sequence;
  * ring W=1, 2, 4: attn_implementation="ring" over W gloo processes, each holding S / W tokens
    (longvideo.hf.shard_batch), gradients averaged with all_reduce, every rank a full replica of
    the parameters and optimizer state (no ZeRO, so that only the activations differ).

Memory is each rank's resident-set high-water mark during one step (VmHWM, reset before the step;
glibc maps large blocks separately so that memory freed earlier does not linger). For each system
a least-squares line of the worst rank's peak against the total length S gives the longest S whose
step fits `--budget-gb` per rank. Below ~800 tokens per rank the peak is set by the optimizer step
(fresh gradients and AdamW's temporaries, independent of S), so the default lengths start above
that; the line is then the activations' (mostly the S x 49152 logits and their gradients). Each
system runs the same per-rank lengths (`--lengths`), so a ring of W measures totals W times longer.
tokens/s is `--seq` over the wall time of a step at that total length, after the memory steps:
the slowest rank's time, the fastest of `--steps` steps (other jobs on a shared machine only ever
add time). Every rank of a system shares the machine's cores (`--threads` in all), so on 2 cores
W = 4 is four processes on two cores. On a machine shared with other jobs the wall time of the same
step varies several-fold; tokens per CPU second (the CPU time of all of a system's ranks, all
threads, fastest step) is the steadier measure of the work a step costs.

Writes JSON and a PNG (docs/bench/hf.{json,png} by default); `report(result)` formats the JSON as a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# ------------------------------------------------------------------------------------------- report
# Read by run_benchmarks.py to build docs/benchmarks.md: the title, what is measured, the detail docs
# under docs/ (the first that exists is linked), the targets (the summary rows while nothing is
# measured) and report(), which turns this script's JSON into a table, the targets met or not, and
# notes.

from benchreport import Section, Target, reset_peak, spawn_ranks, status_mib, yes_no  # noqa: E402

TITLE = "Ring attention inside transformers models"
MEASURES = ("Longest trainable context of a SmolLM-135M-shape transformers Llama (fewer layers on CPU) under a "
            "per-rank memory budget, with attn_implementation='ring' at W = 1, 2, 4 against 'sdpa', and tokens/s, "
            "in one run.")
DOCS = ["hf.md"]
TARGETS = [Target("hf: context of ring W = 4 vs sdpa, same per-rank budget", ">= 3.6x (W x 0.9)")]


def report(result: dict) -> Section:
    """The table of one result JSON, and the context target: ring W = 4 against sdpa under one budget."""
    systems = result["systems"]
    base = next((s for s in systems if s["system"] == "sdpa"), None)
    steps = len(systems[0]["throughput"]["steps_s"]) if systems else 0
    load = ", ".join(f"{x:.1f}" for x in result["machine"]["loadavg_before"])
    head = (f"{result['model']}; budget {result['budget_gb']:g} GiB per rank; tokens/s at S = {result['seq']:,}, "
            f"fastest of {steps} step(s) ({result['machine']['cores']} cores shared by all ranks, load average "
            f"{load} before the run).")
    columns = ("| system | ranks | peak per rank at the measured S (MiB) | KiB per token per rank | longest S in budget "
               "| vs sdpa | tokens/s (wall) | tokens per CPU s | vs sdpa (CPU) |")
    lines = [head, "", columns, "|---|---|---|---|---|---|---|---|---|"]
    for s in systems:
        peaks = "; ".join(f"{S:,}: {m:,.0f}" for S, m in zip(s["seqs"], s["peak_mib_per_rank"]))
        ctx, tps, tpc = s["context_at_budget"], s["throughput"]["tokens_per_s"], s["throughput"]["tokens_per_cpu_s"]
        rc = f"{ctx / base['context_at_budget']:.2f}x" if base else "-"
        rt = f"{tpc / base['throughput']['tokens_per_cpu_s']:.2f}x" if base else "-"
        lines.append(f"| {s['system']} | {s['ranks']} | {peaks} | {s['fit']['kib_per_token']:,.0f} | {ctx:,.0f} | {rc} "
                     f"| {tps:,.1f} | {tpc:,.1f} | {rt} |")
    table = "\n".join(lines[2:])
    t = Target(TARGETS[0].what, TARGETS[0].goal)
    w4 = next((x for x in systems if x["system"] == "ring W=4"), None)
    if base and w4:
        r = w4["context_at_budget"] / base["context_at_budget"]
        t.figure = f"{r:.2f}x ({w4['context_at_budget']:,.0f} vs {base['context_at_budget']:,.0f} tokens)"
        t.met = yes_no(r >= 3.6)
    else:
        t.figure, t.met = "no ring W=4 and sdpa run in the JSON", "unknown"
    return Section(table, [t], [lines[0]])


SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=1 << 22)


def _model(layers: int, attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, attn_implementation=attn, **SMOL))
    model.train()
    model.gradient_checkpointing_enable()
    return model


def _tokens(S: int, seed: int) -> torch.Tensor:
    return torch.randint(0, SMOL["vocab_size"], (1, S), generator=torch.Generator().manual_seed(seed))


def _worker(rank, world, init_file, system, args, queue):
    """One rank of a system: the memory steps at each per-rank length, then the timed steps."""
    try:
        torch.set_num_threads(max(1, args.threads // world))
        import torch.distributed as dist

        ring = system.startswith("ring")
        if ring:
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=3600))
            from longvideo.hf import enable_ring_attention, shard_batch

            enable_ring_attention(dist.group.WORLD, backend="cpu")
        model = _model(args.layers, "ring" if ring else "sdpa")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(S: int, seed: int) -> None:
            ids = _tokens(S, seed)
            if ring:
                batch = shard_batch({"input_ids": ids, "labels": ids}, dist.group.WORLD)
                loss = model(**batch, use_cache=False).loss
            else:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            if ring and world > 1:
                for p in model.parameters():  # what DDP / DeepSpeed would do: average over the ranks
                    dist.all_reduce(p.grad)
                    p.grad /= world
            opt.step()
            opt.zero_grad(set_to_none=True)

        def barrier():
            if ring:
                dist.barrier()

        step(128 * world, 0)  # warm-up: optimizer state, allocator
        res = {"rank": rank, "baseline_mib": status_mib("VmRSS"), "mem": {}, "step_s": {}, "timed_s": [],
               "timed_cpu_s": []}
        for i, n in enumerate(sorted(args.lengths)):
            S = n * world
            barrier()
            reset_peak()
            t0 = time.perf_counter()
            step(S, 1 + i)
            res["step_s"][S] = time.perf_counter() - t0
            res["mem"][S] = status_mib("VmHWM")
        for i in range(args.steps):
            barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step(args.seq, 100 + i)
            res["timed_s"].append(time.perf_counter() - t0)
            res["timed_cpu_s"].append(time.process_time() - c0)  # all of this process's threads
        barrier()
        queue.put(res)
        if ring:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        queue.put({"rank": rank, "error": f"{e!r}\n{traceback.format_exc()}"})


def run_system(system: str, world: int, args) -> dict:
    t0 = time.perf_counter()
    ranks = spawn_ranks(_worker, world, system, args, label=system)
    seqs = sorted(n * world for n in args.lengths)
    peak = [max(r["mem"][S] for r in ranks) for S in seqs]  # the rank that needs most
    coef = fit(seqs, peak)
    step_s = {S: max(r["step_s"][S] for r in ranks) for S in ranks[0]["step_s"]}  # the slowest rank
    timed = [max(r["timed_s"][i] for r in ranks) for i in range(args.steps)]
    cpu = [sum(r["timed_cpu_s"][i] for r in ranks) for i in range(args.steps)]  # the work of all ranks
    return {
        "system": system, "ranks": world, "seqs": seqs, "per_rank_lengths": sorted(args.lengths),
        "peak_mib_per_rank": peak, "baseline_mib_per_rank": max(r["baseline_mib"] for r in ranks),
        "fit": {"coef": coef, "form": "a + b S (MiB, S total tokens)", "kib_per_token": coef[1] * 1024},
        "context_at_budget": context_at(coef, args.budget_gb * 1024),
        "memory_step_s": {str(S): v for S, v in sorted(step_s.items())},
        "throughput": {"seq": args.seq, "steps_s": timed, "step_s": min(timed), "tokens_per_s": args.seq / min(timed),
                       "steps_cpu_s": cpu, "cpu_s": min(cpu), "tokens_per_cpu_s": args.seq / min(cpu)},
        "wall_s": time.perf_counter() - t0,
    }


def fit(seqs: list[int], mem: list[float]) -> list[float]:
    """Least-squares [a, b] of mem = a + b S."""
    A = torch.tensor([[1.0, float(s)] for s in seqs], dtype=torch.float64)
    y = torch.tensor(mem, dtype=torch.float64)[:, None]
    return torch.linalg.lstsq(A, y).solution.flatten().tolist()


def context_at(coef: list[float], budget_mib: float) -> float:
    a, b = coef
    return (budget_mib - a) / b if b > 0 else math.inf


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = result["systems"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2), dpi=120)
    for i, s in enumerate(systems):
        c = f"C{i}"
        sdpa = s["system"] == "sdpa"  # drawn hollow and dashed: ring W=1 lies on top of it
        ax1.plot(s["seqs"], s["peak_mib_per_rank"], "s" if sdpa else "o", color=c, label=s["system"],
                 mfc="none" if sdpa else c, ms=9 if sdpa else 6)
        a, b = s["fit"]["coef"]
        xs = [0, s["context_at_budget"]]
        ax1.plot(xs, [a + b * x for x in xs], "--" if sdpa else "-", color=c, lw=1)
    ax1.axhline(result["budget_gb"] * 1024, color="k", ls="--", lw=1, label=f"budget {result['budget_gb']:g} GiB")
    ax1.set_xlabel("total sequence length S (tokens)")
    ax1.set_ylabel("peak memory per rank (MiB)")
    ax1.set_title("measured (points) and fitted (lines)", fontsize=9)
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    names = [s["system"] for s in systems]
    ctx = [s["context_at_budget"] for s in systems]
    bars = ax2.bar(range(len(names)), ctx, color=[f"C{i}" for i in range(len(names))])
    ax2.set_xticks(range(len(names)), names, fontsize=8)
    ax2.set_ylabel("longest trainable S (tokens)")
    ax2.set_title(f"longest context within {result['budget_gb']:g} GiB per rank", fontsize=9)
    for b, v in zip(bars, ctx):
        ax2.text(b.get_x() + b.get_width() / 2, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
    x = range(len(names))
    for off, key, label, hatch in ((-0.2, "tokens_per_s", "tokens / s (wall)", ""),
                                   (0.2, "tokens_per_cpu_s", "tokens / CPU s (all ranks)", "//")):
        vals = [s["throughput"][key] for s in systems]
        bars = ax3.bar([i + off for i in x], vals, width=0.4, color=[f"C{i}" for i in x], hatch=hatch,
                       edgecolor="k", lw=0.5, label=label)
        for bar, v in zip(bars, vals):
            ax3.text(bar.get_x() + bar.get_width() / 2, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=7)
    ax3.set_xticks(list(x), names, fontsize=8)
    ax3.set_ylabel("tokens per second")
    ax3.set_ylim(0, 1.3 * max(max(s["throughput"]["tokens_per_s"], s["throughput"]["tokens_per_cpu_s"])
                              for s in systems))
    ax3.legend(fontsize=7, loc="upper left", ncol=2)
    ax3.set_title(f"training throughput at S = {result['seq']} ({result['machine']['cores']} cores shared)",
                  fontsize=9)
    fig.suptitle(result["model"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2, help="decoder layers (SmolLM-135M has 30)")
    p.add_argument("--lengths", default="1024,2048",
                   help="per-rank sequence lengths of the memory steps (above ~800, where the activations, not the "
                        "optimizer step, set the peak)")
    p.add_argument("--seq", type=int, default=2048, help="total sequence length of the timed steps")
    p.add_argument("--steps", type=int, default=2, help="timed steps per system (the fastest counts)")
    p.add_argument("--rings", default="1,2,4", help="ring sizes W")
    p.add_argument("--budget-gb", type=float, default=4.0, help="memory per rank for the context column")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads shared by a system's ranks")
    p.add_argument("--quick", action="store_true", help="lengths 768,1024, W = 1, 2, S = 1024, one timed step")
    p.add_argument("--out", default=str(ROOT / "docs" / "bench" / "hf.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.rings, args.seq, args.steps = "768,1024", "1,2", 1024, 1
    args.lengths = [int(x) for x in args.lengths.split(",")]
    rings = [int(x) for x in args.rings.split(",")]
    # the workers inherit this: glibc maps every block >= 64 KiB on its own and unmaps it when freed,
    # so the resident-set peak of a step is that step's, not memory the heap kept from before
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    load_before = os.getloadavg()
    systems = []
    for name, world in [("sdpa", 1)] + [(f"ring W={w}", w) for w in rings]:
        print(f"{name} ...", flush=True)
        systems.append(run_system(name, world, args))
        s = systems[-1]
        print(f"  {s['fit']['kib_per_token']:.0f} KiB/token/rank, context {s['context_at_budget']:,.0f}, "
              f"{s['throughput']['tokens_per_s']:.1f} tokens/s, {s['throughput']['tokens_per_cpu_s']:.1f} tokens/CPU s "
              f"({s['wall_s']:.0f} s)", flush=True)
    by = {s["system"]: s for s in systems}
    sdpa = by["sdpa"]
    ratios = {}
    for w in rings:
        r = by[f"ring W={w}"]
        ratios[f"context_ring{w}_over_sdpa"] = r["context_at_budget"] / sdpa["context_at_budget"]
        ratios[f"tokens_per_s_ring{w}_over_sdpa"] = r["throughput"]["tokens_per_s"] / sdpa["throughput"]["tokens_per_s"]
        ratios[f"tokens_per_cpu_s_ring{w}_over_sdpa"] = (r["throughput"]["tokens_per_cpu_s"]
                                                        / sdpa["throughput"]["tokens_per_cpu_s"])
    import transformers

    result = {
        "model": (f"LlamaForCausalLM, SmolLM-135M shape with {args.layers} of 30 layers (hidden 576, 9/3 heads, "
                  f"ffn 1536, vocab 49152, tied), fp32, gradient checkpointing, AdamW"),
        "layers": args.layers, "budget_gb": args.budget_gb, "seq": args.seq, "systems": systems, "ratios": ratios,
        "machine": {"cores": os.cpu_count(), "threads": args.threads, "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg(), "platform": platform.platform(), "torch": torch.__version__,
                    "transformers": transformers.__version__},
        "argv": sys.argv[1:] if argv is None else argv,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(report(result).table)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
