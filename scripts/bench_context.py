"""The longest context a training step fits in a per-rank memory budget, and tokens/s (CPU, one run).

    python scripts/bench_context.py                    # tiny.yaml, 4 layers, W = 1, 2, 4 (~25 min on 2 cores)
    python scripts/bench_context.py --layers 32 --systems eager,sdpa,ours1 --lengths 2048,4096,8192
    python scripts/bench_context.py --quick            # short lengths, W <= 2: a smoke run of every system

Systems `eager`, `sdpa` (transformers' Llama), `ringW` (it with our ring over W gloo ranks), `oursW` (our
trainer at sp = W); memory is the worst rank's resident-set peak, fitted against S (docs/training.md,
"Benchmark"). Writes docs/bench/context.json (a part per --label) and context.png.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from benchreport import (
    LayoutError,
    Section,
    Target,
    arg_parser,
    fmt_num,
    fmt_tokens,
    md_table,
    ratio,
    req,
    req_list,
    reset_peak,
    save,
    spawn_ranks,
    status_mib,
    subplots,
    yes_no,
)

from longvideo.config import load_config
from longvideo.machine import machine_info

TITLE = "Training: longest context per memory budget"
DOCS = ["training.md", "hf.md"]
HF_GOAL, W_GOAL = 16.0, 0.9
TARGETS = [
    Target("context: our sp=W / (W x our sp=1)", f">= {W_GOAL:g}"),
    Target("context: transformers + our ring at W / (W x sdpa)", f">= {W_GOAL:g}"),
    Target("context: our sp=1 vs transformers (sdpa)", f">= {HF_GOAL:g}x"),
]


def _part(p: dict) -> tuple[str, list[Target]]:
    """One measured shape: its table, and the targets its systems allow."""
    systems = {req(s, "system"): s for s in req_list(p, "systems")}
    table = md_table(
        [
            "system",
            "ranks",
            "peak MiB per rank at S tokens",
            "KiB per token (fit)",
            f"context within {p.get('budget_gb', '?')} GiB (fit)",
            "tokens/s",
        ],
        [
            [
                n,
                req(s, "ranks"),
                "; ".join(
                    f"{S:,}: {m:,.0f}" for S, m in zip(req(s, "seqs"), req(s, "peak_mib_per_rank"))
                ),
                fmt_num(req(s, "fit", "kib_per_token"), ",.1f"),
                fmt_tokens(req(s, "context_at_budget")),
                fmt_num(req(s, "throughput", "tokens_per_s"), ",.0f"),
            ]
            for n, s in systems.items()
        ],
    )
    ctx, label, out = (
        {n: s["context_at_budget"] for n, s in systems.items()},
        p.get("label", "?"),
        [],
    )
    for kind, base, what in (
        ("ours sp=", "ours sp=1", "our sp=W / (W x our sp=1)"),
        ("transformers ring W=", "transformers sdpa", "transformers + our ring at W / (W x sdpa)"),
    ):
        rs = [
            (s["ranks"], ctx[n] / (s["ranks"] * ctx[base]), ctx[n])
            for n, s in systems.items()
            if n.startswith(kind) and s["ranks"] > 1 and ctx.get(base)
        ]
        if rs:
            out.append(
                Target(
                    f"context ({label}): {what}",
                    f">= {W_GOAL:g}",
                    "; ".join(f"W={w}: {r:.2f} ({fmt_tokens(c)})" for w, r, c in rs),
                    yes_no(all(r >= W_GOAL for _, r, _ in rs)),
                )
            )
    for attn in ("sdpa", "eager"):
        if (r := ratio(ctx.get("ours sp=1"), ctx.get(f"transformers {attn}"))) is not None:
            out.append(
                Target(
                    f"context ({label}): our sp=1 vs transformers ({attn})",
                    f">= {HF_GOAL:g}x",
                    f"{r:,.1f}x ({fmt_tokens(ctx['ours sp=1'])} vs {fmt_tokens(ctx[f'transformers {attn}'])}"
                    " tokens)",
                    yes_no(r >= HF_GOAL),
                )
            )
    return table, out


def report(result: dict) -> Section:
    tables, targets = [], []
    for p in req_list(result, "parts"):
        table, t = _part(p)
        m = p.get("machine") or {}
        tables.append(
            f"**{p.get('label')}**: {p.get('model')}; transformers with"
            f"{'' if p.get('hf_checkpointing') else 'out'} gradient checkpointing; {m.get('cpu', 'CPU')}, "
            f"{m.get('cores', '?')} cores, load "
            f"{fmt_num((m.get('loadavg') or m.get('loadavg_before') or [None])[0], '.1f')}; "
            f"{p.get('date', 'date not recorded')}.\n\n{table}"
        )
        targets += t
    if not targets:
        raise LayoutError("no part has the systems a target compares")
    return Section(
        "\n\n".join(tables),
        targets,
        [
            "Context columns: the longest S whose fitted per-rank peak fits the budget, extrapolated from the measured "
            "lengths; tokens/s on a machine whose cores every rank of a system shares."
        ],
    )


def _batch(cfg, S: int, seed: int) -> dict:
    from longvideo.train.synthetic_tokens import SyntheticTokens

    vocab = cfg.train.synthetic_vocab or cfg.model.text_vocab_size
    return SyntheticTokens(seq_len=S, batch_size=1, vocab=vocab, seed=seed).batch(0)


def _hf_step(cfg, attn: str, world: int, checkpointing: bool):
    """A training step of transformers' Llama of cfg.model's shape, with eager, sdpa or our ring attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from longvideo.export.hf import hf_config_dict
    from longvideo.hf import enable_ring_attention, shard_batch

    if attn == "ring":
        enable_ring_attention(dist.group.WORLD, backend="cpu")
    torch.manual_seed(0)
    hcfg = hf_config_dict(dataclasses.replace(cfg.model, max_seq_len=1 << 22))
    model = LlamaForCausalLM(LlamaConfig(**hcfg, attn_implementation=attn)).train()
    if checkpointing:
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
    )

    def step(S: int, seed: int) -> None:
        b = _batch(cfg, S, seed)
        labels = torch.where(b["loss_weights"] > 0, b["targets"], -100)  # already shifted
        if attn == "ring":
            batch = shard_batch(
                {"input_ids": b["input_ids"], "shift_labels": labels}, dist.group.WORLD
            )
        else:
            batch = {"input_ids": b["input_ids"], "shift_labels": labels, "labels": labels}
        model(**batch, use_cache=False).loss.backward()
        for p in model.parameters() if world > 1 else ():  # what DDP does: the ranks' mean
            dist.all_reduce(p.grad)
            p.grad /= world
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _rank(rank: int, world: int, system: str, seqs: list[int], args) -> dict:
    """One rank of a system: a warm-up, one step at each memory length, then the timed steps."""
    torch.set_num_threads(max(1, args.threads // world))
    kind = system.rstrip("0123456789")
    tmp = tempfile.mkdtemp()  # our trainer's run directory
    cfg = load_config(args.config, _overrides(args, world if kind == "ours" else 1, tmp))
    if kind == "ours":
        from longvideo.train.trainer import Trainer

        t = Trainer(cfg)

        def step(S, seed):
            t.optimizer_step(t.forward_backward([t.shard(_batch(cfg, S, seed))]))
    else:
        step = _hf_step(cfg, kind, world, args.hf_checkpointing)
    barrier = dist.barrier if dist.is_initialized() else (lambda: None)  # eager and sdpa run alone
    step(min(seqs), 0)
    res = {"mem": {}, "step_s": [], "cpu_s": []}
    for S in seqs:
        barrier()
        reset_peak()
        step(S, 1)
        res["mem"][S] = status_mib("VmHWM")
    for i in range(args.steps + 1):  # the first warms this length up
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step(args.seq, 2 + i)
        res["step_s"] += [time.perf_counter() - t0] if i else []
        res["cpu_s"] += [time.process_time() - c0] if i else []
    barrier()
    shutil.rmtree(tmp, ignore_errors=True)
    return res


def _overrides(args, sp: int, out_dir: str = "unused") -> list[str]:
    return [
        f"model.n_layers={args.layers}",
        f"parallel.sp={sp}",
        "train.zero_stage=3",
        "train.micro_batch_size=1",
        "train.grad_accum=1",
        "train.steps=1000",
        "train.warmup_steps=1",
        "train.progress=false",
        "train.tensorboard=false",
        "train.plot=false",
        f"data.seq_len={args.seq}",
        f"train.out_dir={out_dir}",
    ]


def run_system(system: str, args) -> dict:
    """Measure one system; its peaks, the fit, the context within the budget and its tokens/s."""
    world = int("".join(c for c in system if c.isdigit()) or 1)
    seqs = sorted(args.eager_lengths if system == "eager" else args.lengths)
    ranks = spawn_ranks(
        _rank,
        world,
        system,
        seqs,
        args,
        label=system,
        gloo_timeout_s=None if system in ("eager", "sdpa") else 3600.0,
    )
    peak = [max(r["mem"][S] for r in ranks) for S in seqs]  # the rank that needs most
    A = torch.tensor(
        [[1.0, S, S * S][: 3 if system == "eager" else 2] for S in seqs], dtype=torch.float64
    )
    coef = (
        torch.linalg.lstsq(A, torch.tensor(peak, dtype=torch.float64)[:, None])
        .solution.flatten()
        .tolist()
    )
    a, b, c, budget = *(coef + [0.0])[:3], args.budget_gb * 1024  # MiB = a + b S (+ c S^2)
    ctx = (
        (-b + math.sqrt(b * b + 4 * c * (budget - a))) / (2 * c)
        if c > 1e-12
        else (budget - a) / b
        if b > 0
        else math.inf
    )
    wall = statistics.median(max(r["step_s"][i] for r in ranks) for i in range(args.steps))
    cpu = statistics.median(sum(r["cpu_s"][i] for r in ranks) for i in range(args.steps))
    name = {"ours": f"ours sp={world}", "ring": f"transformers ring W={world}"}.get(
        system.rstrip("0123456789"), f"transformers {system}"
    )
    return {
        "system": name,
        "ranks": world,
        "seqs": seqs,
        "peak_mib_per_rank": peak,
        "fit": {
            "coef": coef,
            "form": "a + b S" + " + c S^2" * (len(coef) > 2),
            "kib_per_token": b * 1024,
        },
        "context_at_budget": ctx,
        "throughput": {
            "seq": args.seq,
            "step_s": wall,
            "tokens_per_s": args.seq / wall,
            "tokens_per_cpu_s": args.seq / cpu,
        },
    }


def plot(result: dict):
    fig, axes = subplots(
        len(result["parts"]), 2, figsize=(11, 4 * len(result["parts"])), squeeze=False
    )
    for (ax1, ax2), p in zip(axes, result["parts"]):
        for i, s in enumerate(p["systems"]):
            xs = [min(s["seqs"]) + k * (max(s["seqs"]) - min(s["seqs"])) / 40 for k in range(41)]
            ax1.plot(s["seqs"], s["peak_mib_per_rank"], "o", color=f"C{i}", label=s["system"])
            ax1.plot(
                xs,
                [sum(c * x**j for j, c in enumerate(s["fit"]["coef"])) for x in xs],
                color=f"C{i}",
                lw=1,
            )
            ax2.bar(i, s["context_at_budget"], color=f"C{i}")
            ax2.text(
                i,
                s["context_at_budget"],
                fmt_tokens(s["context_at_budget"]),
                ha="center",
                fontsize=7,
            )
        ax1.set(
            xlabel="total sequence length S (tokens)",
            ylabel="peak memory per rank (MiB)",
            title=p["label"],
        )
        ax2.set_xticks(
            range(len(p["systems"])), [s["system"] for s in p["systems"]], rotation=20, fontsize=7
        )
        ax2.set(
            yscale="log",
            ylabel="longest context (tokens)",
            title=f"within {p['budget_gb']:g} GiB per rank (fit)",
        )
    return fig


def main(argv=None) -> None:
    p = arg_parser(__doc__, "context")
    p.add_argument(
        "--config", default="tiny.yaml", help="the model's shape (and our trainer's settings)"
    )
    p.add_argument("--layers", type=int, default=4, help="decoder layers (LLaMA-2 7B has 32)")
    p.add_argument("--systems", default="eager,sdpa,ring2,ring4,ours1,ours2,ours4")
    p.add_argument("--lengths", default="4096,8192,16384", help="total lengths of the memory fit")
    p.add_argument(
        "--eager-lengths", default="512,1024,2048", help="the same for eager (S x S weights)"
    )
    p.add_argument("--seq", type=int, default=2048, help="total length of the timed steps")
    p.add_argument("--steps", type=int, default=2, help="timed steps a system (the median counts)")
    p.add_argument(
        "--budget-gb", type=float, default=16.0, help="memory per rank for the context column"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="threads shared by a system's ranks",
    )
    p.add_argument("--no-hf-checkpointing", dest="hf_checkpointing", action="store_false")
    p.add_argument(
        "--label", default=None, help="this part's name in the JSON (default: config and layers)"
    )
    p.add_argument(
        "--quick", action="store_true", help="lengths 512,1024 (eager 128-512), W <= 2, one step"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.eager_lengths, args.seq, args.steps = "512,1024", "128,256,512", 512, 1
        args.systems = ",".join(
            s for s in args.systems.split(",") if not s[-1].isdigit() or int(s[-1]) <= 2
        )
    args.lengths, args.eager_lengths = (
        [int(x) for x in v.split(",")] for v in (args.lengths, args.eager_lengths)
    )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # the ranks inherit it
    m = load_config(args.config, _overrides(args, 1)).model
    part = {
        "label": args.label or f"{Path(args.config).stem}, {m.n_layers} layers",
        "model": f"{args.config} with {m.n_layers} layers (dim {m.dim}, {m.n_heads}/{m.n_kv_heads} heads, "
        f"vocab {m.vocab_size})",
        "budget_gb": args.budget_gb,
        "seq": args.seq,
        "hf_checkpointing": args.hf_checkpointing,
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d"),
        "argv": sys.argv[1:] if argv is None else argv,
        "systems": [],
    }
    for s in args.systems.split(","):
        print(f"{s} ...", flush=True)
        part["systems"].append(run_system(s, args))
    out = Path(args.out)
    old = json.loads(out.read_text()).get("parts", []) if out.exists() else []
    table, targets = _part(part)
    print(table + "\n" + "\n".join(f"{t.what}: {t.figure} ({t.met})" for t in targets))
    save({"parts": [q for q in old if q.get("label") != part["label"]] + [part]}, out, plot)


if __name__ == "__main__":
    main()
