"""Text to video with classifier-free guidance: tokens a second at 1, 4 and 16 frames of 256 codes,
sampled with a KV cache (the conditional and the unconditional prompt as two rows of one batched
forward), against the baseline that recomputes both whole sequences at every step (CPU, tiny model).

    python scripts/bench_generate.py                       # defaults: a few minutes on 2 CPU cores
    python scripts/bench_generate.py --frames 1,4,16,64 --recompute-frames 1,4 --dim 512

With the cache a token costs the same whatever the frame it is in (the attention over the cache
grows, the rest does not); recomputing costs a token in proportion to the sequence before it. Both
sample the same codes (greedy here: `same_codes`). Writes docs/bench/generate.json and generate.png
(docs/generation.md, "Benchmark").
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from benchreport import (
    Section,
    Target,
    arg_parser,
    fmt_num,
    md_table,
    ratio,
    req,
    req_list,
    save,
    subplots,
    yes_no,
)

TITLE = "Text to video: tokens a second with guidance, KV cache vs recomputation"
DOCS = ["generation.md"]
TARGETS = [
    Target(
        "generate: cost per token, 16 frames / 1 frame (KV cache, guidance)",
        "<= 1.5 (flat in the number of frames)",
    )
]
FLAT = 1.5
CODES = 256
"""Codes a frame (16 x 16, as LWM's VQGAN gives)."""


def spread(t: dict) -> str:
    """A timing's median ms/token and its range over the repeats (older records: the one run)."""
    lo, hi = t.get("ms_per_token_min"), t.get("ms_per_token_max")
    text = fmt_num(t["ms_per_token"], ".2f")
    return text if lo is None else f"{text} ({lo:.2f}-{hi:.2f})"


def report(result: dict) -> Section:
    rows = req_list(result, "rows")
    by = {req(r, "frames"): r for r in rows}
    body = []
    for r in rows:
        rec = r.get("recompute")
        body.append(
            [
                str(r["frames"]),
                f"{r['tokens']:,}",
                fmt_num(req(r, "cache", "tokens_per_s"), ".1f"),
                spread(req(r, "cache")),
                fmt_num(rec and rec["tokens_per_s"], ".1f"),
                spread(rec) if rec else fmt_num(None),
                fmt_num(rec and ratio(r["cache"]["tokens_per_s"], rec["tokens_per_s"]), ".1f", "x"),
            ]
        )
    lo, hi = min(by), max(by)
    flat = ratio(by[hi]["cache"]["ms_per_token"], by[lo]["cache"]["ms_per_token"])
    t = Target(
        TARGETS[0].what,
        TARGETS[0].goal,
        f"{fmt_num(flat, '.2f')} ({hi} / {lo} frames)",
        yes_no(flat is not None and flat <= FLAT),
    )
    cfg = result.get("config") or {}
    notes = [
        f"Model: dim {cfg.get('dim')}, {cfg.get('layers')} layers, {cfg.get('heads')} / "
        f"{cfg.get('kv_heads')} heads, vocabulary {cfg.get('vocab'):,}, fp32, {cfg.get('threads')} "
        f"thread(s), medians of {cfg.get('repeats', 1)} run(s); {cfg.get('codes_per_frame')} codes a frame, guidance scale "
        f"{cfg.get('cfg_scale')} (two rows a step), greedy.",
        f"Same codes with the cache and recomputed: {result.get('same_codes')}. Tokens a second "
        "count the sampled codes (each frame's forced <eof> rides along with the next code).",
    ]
    headers = [
        "frames",
        "tokens",
        "KV cache: tokens/s",
        "ms/token (median, range)",
        "recompute: tokens/s",
        "ms/token (median, range)",
        "speed-up",
    ]
    return Section(md_table(headers, body), [t], notes)


def plot(result: dict):
    rows = result["rows"]
    fig, ax = subplots(1, 1, figsize=(6, 4))
    F = [r["frames"] for r in rows]
    ax.plot(F, [r["cache"]["ms_per_token"] for r in rows], "o-", label="KV cache (two rows)")
    rec = [(r["frames"], r["recompute"]["ms_per_token"]) for r in rows if r.get("recompute")]
    if rec:
        ax.plot(*zip(*rec), "s--", label="recompute both sequences every step")
    ax.set(
        xlabel="frames generated",
        ylabel="ms per generated token",
        xscale="log",
        yscale="log",
        title="Text to video with guidance: cost per token",
    )
    ax.set_xticks(F, [str(x) for x in F])
    ax.minorticks_off()
    return fig


class RecomputeRows:
    """The baseline: no cache; every step runs each row's whole sequence again."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def start(self, prompts, room: int):
        self.rows = [list(p) for p in prompts]
        return self._last()

    @torch.no_grad()
    def feed(self, ids):
        for r, new in zip(self.rows, ids.tolist()):
            r.extend(new)
        return self._last()

    def _last(self):
        from longvideo.infer.t2v import left_pad

        ids, pos, seg = left_pad(self.rows)
        return self.model.logits(self.model(ids, pos, seg)[:, -1:])[:, -1].float()

    def agree(self, tokens):
        return tokens


def build(args):
    from types import SimpleNamespace

    from longvideo.model import ModelConfig, Transformer
    from longvideo.tokenizer import train_text_tokenizer

    tok = train_text_tokenizer(["a red square, then a blue circle. a green triangle."] * 8, 300)
    cfg = ModelConfig(
        text_vocab_size=tok.text_size,
        codebook_size=args.codebook,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        max_seq_len=max(args.frames) * (CODES + 1) + 64,
    )
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    return SimpleNamespace(model=model, tokenizer=tok)


def timing(seconds: list[float], sampled: int) -> dict:
    """Median and spread of repeated runs that each sample `sampled` codes."""
    ms = sorted(1e3 * t / sampled for t in seconds)
    median = statistics.median(ms)
    return {
        "seconds": [round(t, 3) for t in seconds],
        "ms_per_token": median,
        "ms_per_token_min": ms[0],
        "ms_per_token_max": ms[-1],
        "tokens_per_s": 1e3 / median,
    }


def run_once(pre, frames: int, cfg_scale: float, recompute: bool) -> tuple[float, list[int]]:
    """(seconds, ids) of one video sampled greedily."""
    from longvideo.data.templates import generation_prompts, video_slots
    from longvideo.infer.t2v import LocalRows, Sampling, sample_slots

    vocab = pre.model.cfg.vocab
    cond, uncond = generation_prompts(pre.tokenizer, vocab, "a red square, then a blue circle")
    slots = video_slots(pre.tokenizer, vocab, groups=frames, codes_per_group=CODES)
    rows = RecomputeRows(pre.model) if recompute else LocalRows(pre.model)
    t0 = time.perf_counter()
    (ids,) = sample_slots(
        rows,
        [cond, uncond],
        slots,
        vocab,
        Sampling(cfg_scale=cfg_scale, top_k=1),
        [torch.Generator().manual_seed(0)],
    )
    return time.perf_counter() - t0, ids


def main(argv=None) -> None:
    p = arg_parser(__doc__, "generate")

    def ints(s):
        return [int(x) for x in s.split(",")]

    p.add_argument("--frames", type=ints, default=[1, 4, 16])
    p.add_argument("--recompute-frames", type=ints, default=[1, 4], help="baseline's (affordable)")
    p.add_argument("--cfg-scale", type=float, default=3.0)
    for name, default in (("dim", 256), ("layers", 4), ("heads", 8), ("kv-heads", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--codebook", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="runs of each row; medians are reported")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before, t0 = os.getloadavg(), time.time()
    pre = build(args)
    run_once(pre, 1, args.cfg_scale, False)  # warm-up
    rows, same = [], []
    for F in args.frames:
        sampled = F * CODES
        runs = [run_once(pre, F, args.cfg_scale, False) for _ in range(args.repeats)]
        ids = runs[0][1]
        same.extend(r[1] == ids for r in runs)  # greedy: every repeat samples the same codes
        row = {"frames": F, "tokens": len(ids), "cache": timing([r[0] for r in runs], sampled)}
        if F in args.recompute_frames:
            reruns = [run_once(pre, F, args.cfg_scale, True) for _ in range(args.repeats)]
            row["recompute"] = timing([r[0] for r in reruns], sampled)
            same.extend(r[1] == ids for r in reruns)
        rows.append(row)
        print(
            f"{F:>3} frames: KV cache {row['cache']['tokens_per_s']:.1f} tokens/s"
            + (
                f", recompute {row['recompute']['tokens_per_s']:.1f} tokens/s"
                if "recompute" in row
                else ""
            )
            + f" (medians of {args.repeats})",
            flush=True,
        )
    cfg = pre.model.cfg
    result = {
        "bench": "generate",
        "config": {
            "dim": args.dim,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "vocab": cfg.vocab_size,
            "codes_per_frame": CODES,
            "cfg_scale": args.cfg_scale,
            "threads": args.threads,
            "repeats": args.repeats,
            "dtype": "float32",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "torch": torch.__version__,
        },
        "rows": rows,
        "same_codes": all(same),
        "seconds": round(time.time() - t0, 1),
    }
    save(result, args.out, plot, report)


if __name__ == "__main__":
    main()
