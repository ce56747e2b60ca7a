"""Time to first token and peak memory against context length: one-shot prefill (the baseline),
chunked prefill and W = 2 sequence-parallel prefill, in one run (CPU, tiny model).

    python scripts/bench_infer.py                          # defaults: a few minutes on 2 CPU cores
    python scripts/bench_infer.py --lengths 4096,16384,65536 --dim 512 --layers 8

Peak memory is the rise of the resident set over the prefill, the KV cache included (docs/inference.md,
"Benchmark"). Writes docs/bench/infer.json and infer.png.
"""

from __future__ import annotations

import ctypes
import gc
import os
import time

import torch
import torch.distributed as dist
from benchreport import (
    LayoutError,
    Section,
    Target,
    arg_parser,
    fmt_num,
    md_table,
    ratio,
    req,
    req_list,
    reset_peak,
    save,
    spawn_ranks,
    status_mib,
    subplots,
)

TITLE = "Inference: time to first token and memory vs context"
DOCS = ["inference.md"]
TARGETS = [Target("infer: TTFT and peak memory vs context", "no numeric target", met="n/a")]
MODES = ("one_shot", "chunked", "sp2")


def report(result: dict) -> Section:
    lengths = req_list(result, "lengths")
    rows = [req_list(result, "modes", m) for m in MODES]
    kv = result.get("kv_cache_bytes") or [None] * len(lengths)
    if any(len(r) != len(lengths) for r in rows):
        raise LayoutError("modes and lengths differ in length")
    body = []
    for S, k, o, c, s in zip(lengths, kv, *rows):
        cells = [
            f"{fmt_num(req(x, 'ttft_s'))} s / {fmt_num(req(x, 'peak_mb'), '.1f')} MiB"
            for x in (o, c, s)
        ]
        body.append(
            [
                f"{S:,}",
                fmt_num(k and k / 2**20, ".0f"),
                cells[0],
                *[
                    f"{cell} ({fmt_num(ratio(x['peak_mb'], o['peak_mb']), '.2f')}x)"
                    for cell, x in zip(cells[1:], (c, s))
                ],
            ]
        )
    o, c, s = (r[-1] for r in rows)
    t = Target(
        TARGETS[0].what,
        TARGETS[0].goal,
        met="n/a",
        figure=(
            f"at {lengths[-1]:,}: TTFT {o['ttft_s']:.1f} / {c['ttft_s']:.1f} / {s['ttft_s']:.1f} s, peak "
            f"{o['peak_mb']:.0f} / {c['peak_mb']:.0f} / {s['peak_mb']:.0f} MiB (one-shot / chunked / W=2)"
        ),
    )
    cfg = result.get("config") or {}
    same = result.get("same_tokens_all_modes") or []
    notes = [
        f"Model: dim {cfg.get('dim')}, {cfg.get('layers')} layers, {cfg.get('heads')} / {cfg.get('kv_heads')} "
        f"heads, {cfg.get('dtype')}, `{cfg.get('backend')}` backend; chunks of {cfg.get('chunk')}; W=2's peak is "
        "the larger rank's; peaks include the KV cache. "
        + (
            "All three modes generated the same tokens at every length."
            if all(same)
            else f"**The modes generated different tokens** at lengths "
            f"{[L for L, ok in zip(lengths, same) if not ok]}."
        )
    ]
    headers = [
        "S",
        "KV cache MiB",
        "one-shot: TTFT / peak",
        "chunked: TTFT / peak (vs one-shot)",
        "sp W=2: TTFT / peak per rank (vs one-shot)",
    ]
    return Section(md_table(headers, body), [t], notes)


def _tame_malloc() -> None:
    """Large blocks straight from / back to the system (fixed thresholds), so RSS tracks live tensors."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD; setting it also disables the dynamic threshold
    libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD


def _measure(fn) -> dict:
    """fn()'s Generation as a row: TTFT, decode time a token, peak RSS rise (MiB), the tokens."""
    gc.collect()
    base = status_mib("VmRSS")
    reset_peak()
    out = fn()
    decoded = max(out.tokens.shape[1] - 1, 1)
    return {
        "ttft_s": out.ttft_s,
        "decode_ms_per_token": 1e3 * (out.total_s - out.ttft_s) / decoded,
        "peak_mb": max(0.0, status_mib("VmHWM") - base),
        "tokens": out.tokens[0].tolist(),
    }


def build_model(args):
    from longvideo.model import ModelConfig, Transformer

    cfg = ModelConfig(
        text_vocab_size=512,
        codebook_size=1024,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        max_seq_len=max(args.lengths) + 64,
    )
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def prompt(model, S: int):
    return torch.randint(
        0, model.cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(S)
    )


def _sp_rank(rank: int, world: int, args) -> dict:
    _tame_malloc()
    from longvideo.infer.sp import sp_generate

    torch.set_num_threads(1)
    model = build_model(args)
    with torch.no_grad():
        sp_generate(model, prompt(model, 64), max_new_tokens=2)  # warm-up
        rows = []
        for S in args.lengths:
            dist.barrier()
            rows.append(
                _measure(
                    lambda: sp_generate(model, prompt(model, S), max_new_tokens=1 + args.decode)
                )
            )
    return {"rows": rows}


def plot(result: dict):
    L, m = result["lengths"], result["config"]
    fig, axes = subplots(1, 2, figsize=(11, 4))
    labels = ("one-shot prefill", f"chunked ({m['chunk']})", "sequence-parallel W=2 (per rank)")
    for mode, label, style in zip(MODES, labels, ("o-", "s-", "^-")):
        axes[0].plot(L, [r["ttft_s"] for r in result["modes"][mode]], style, label=label)
        axes[1].plot(L, [r["peak_mb"] for r in result["modes"][mode]], style, label=label)
    axes[1].plot(
        L, [b / 2**20 for b in result["kv_cache_bytes"]], "k--", label="KV cache (whole prompt)"
    )
    axes[0].set(ylabel="time to first token (s)", title="Time to first token")
    axes[1].set(ylabel="peak memory rise (MiB)", title="Peak memory during prefill")
    for ax in axes:
        ax.set(xlabel="context length (tokens)", xscale="log")
        ax.set_xticks(L, [str(x) for x in L])
        ax.minorticks_off()
    fig.suptitle(
        f"CPU ({result['machine']['cpus']} cores), tiny model: dim {m['dim']}, {m['layers']} layers, "
        f"{m['heads']}/{m['kv_heads']} heads, fp32",
        fontsize=10,
    )
    return fig


def main(argv=None) -> None:
    p = arg_parser(__doc__, "infer")
    p.add_argument(
        "--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096, 8192]
    )
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk of the chunked mode")
    p.add_argument("--decode", type=int, default=8, help="tokens decoded after the first")
    for name, default in (
        ("dim", 256),
        ("layers", 4),
        ("heads", 8),
        ("kv-heads", 2),
    ):  # the model's shape
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads of the single-process modes"
    )
    args = p.parse_args(argv)
    _tame_malloc()
    from longvideo.infer.generation import generate

    torch.set_num_threads(args.threads)
    load_before, t0 = os.getloadavg(), time.time()
    model = build_model(args)
    modes = {"one_shot": [], "chunked": []}
    with torch.no_grad():
        generate(model, prompt(model, 64), max_new_tokens=1, prefill_chunk=64)  # warm-up
        for S in args.lengths:
            for mode, chunk in (("one_shot", S), ("chunked", args.chunk)):
                modes[mode].append(
                    _measure(
                        lambda: generate(
                            model,
                            prompt(model, S),
                            max_new_tokens=1 + args.decode,
                            prefill_chunk=chunk,
                        )
                    )
                )
            print(
                f"S={S:>7}: "
                + " | ".join(
                    f"{k} TTFT {v[-1]['ttft_s']:.2f} s, peak {v[-1]['peak_mb']:.1f} MiB"
                    for k, v in modes.items()
                ),
                flush=True,
            )
    ranks = spawn_ranks(_sp_rank, 2, args, label="sp2")
    modes["sp2"] = [
        {
            **max(rs, key=lambda r: r["peak_mb"]),
            "ttft_s": max(r["ttft_s"] for r in rs),
            "decode_ms_per_token": max(r["decode_ms_per_token"] for r in rs),
            "peak_mb_per_rank": [r["peak_mb"] for r in rs],
            "ranks_agree": rs[0]["tokens"] == rs[1]["tokens"],
        }
        for rs in zip(*(r["rows"] for r in ranks))
    ]
    cfg = model.cfg
    result = {
        "bench": "infer",
        "lengths": args.lengths,
        "config": {
            "dim": args.dim,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "chunk": args.chunk,
            "backend": "auto",
            "dtype": "float32",
            "decode_tokens": args.decode,
            "single_process_threads": args.threads,
            "sp_threads_per_rank": 1,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "torch": torch.__version__,
        },
        "kv_cache_bytes": [
            2 * cfg.n_layers * S * cfg.n_kv_heads * cfg.head_dim * 4 for S in args.lengths
        ],
        "modes": modes,
        "same_tokens_all_modes": [
            a["tokens"] == b["tokens"] == c["tokens"] for a, b, c in zip(*modes.values())
        ],
        "seconds": round(time.time() - t0, 1),
    }
    save(result, args.out, plot, report)


if __name__ == "__main__":
    main()
