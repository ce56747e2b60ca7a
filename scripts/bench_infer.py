"""Time to first token and peak memory against context length: one-shot, chunked and W = 2
sequence-parallel prefill, in one run (CPU, tiny model).

    python scripts/bench_infer.py                          # defaults: a few minutes on 2 CPU cores
    python scripts/bench_infer.py --lengths 4096,16384,65536 --dim 512 --layers 8

For each context length S a random prompt of S tokens is prefilled and one token is generated,
then `--decode` more tokens are decoded:

* one-shot:  the whole prompt in one forward (prefill chunk = S);
* chunked:   `--chunk` tokens per forward, all appending to one KV cache;
* sp2:       two gloo processes (one thread each): the prompt ring-prefilled in the zigzag
             layout, each rank keeps half the KV cache; decoding merges the per-rank partials.

Peak memory is the rise of the process's resident set over its level before the prefill (the
kernel's high-water mark is reset first through /proc/self/clear_refs, and glibc is told to
return large blocks to the system, so freed tensors do not hide later peaks); for sp2 the larger
of the two ranks. It includes the KV cache, which is also reported on its own. Writes
docs/bench/infer.json and docs/bench/infer.png.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

# ------------------------------------------------------------------------------------------- report
# Read by run_benchmarks.py to build docs/benchmarks.md: the title, what is measured, the detail docs
# under docs/ (the first that exists is linked), the targets (the summary rows while nothing is
# measured) and report(), which turns this script's JSON into a table, the targets met or not, and
# notes.

from benchreport import LayoutError, Section, Target, fmt_num, md_table, ratio, req, req_list

TITLE = "Inference: time to first token and memory vs context"
MEASURES = ("Time to first token and peak memory during prefill against context length, for one-shot "
            "prefill (the baseline), chunked prefill and W = 2 sequence-parallel prefill.")
DOCS = ["inference.md"]
TARGETS = [Target("infer: TTFT and peak memory vs context", "no numeric target", met="n/a")]


def report(result: dict) -> Section:
    lengths = req_list(result, "lengths")
    modes = req(result, "modes")
    one, chunk, sp = (req_list(modes, m) for m in ("one_shot", "chunked", "sp2"))
    kv = result.get("kv_cache_bytes") or [None] * len(lengths)
    if not len(one) == len(chunk) == len(sp) == len(lengths):
        raise LayoutError("modes and lengths differ in length")
    body = []
    for S, o, c, s, k in zip(lengths, one, chunk, sp, kv):
        po, pc, ps = (req(x, "peak_mb") for x in (o, c, s))
        body.append([f"{S:,}", fmt_num(k and k / 2**20, ".0f"),
                     f"{fmt_num(req(o, 'ttft_s'))} s / {fmt_num(po, '.1f')} MiB",
                     f"{fmt_num(req(c, 'ttft_s'))} s / {fmt_num(pc, '.1f')} MiB ({fmt_num(ratio(pc, po), '.2f')}x)",
                     f"{fmt_num(req(s, 'ttft_s'))} s / {fmt_num(ps, '.1f')} MiB ({fmt_num(ratio(ps, po), '.2f')}x)"])
    S, o, c, s = lengths[-1], one[-1], chunk[-1], sp[-1]
    t = Target(TARGETS[0].what, TARGETS[0].goal, met="n/a")
    t.figure = (f"at {S:,}: TTFT {o['ttft_s']:.1f} / {c['ttft_s']:.1f} / {s['ttft_s']:.1f} s, peak "
                f"{o['peak_mb']:.0f} / {c['peak_mb']:.0f} / {s['peak_mb']:.0f} MiB (one-shot / chunked / W=2)")
    cfg = result.get("config") or {}
    notes = [f"Model: dim {cfg.get('dim')}, {cfg.get('layers')} layers, {cfg.get('heads')} / {cfg.get('kv_heads')} "
             f"heads, {cfg.get('dtype')}, `{cfg.get('backend')}` backend; chunked prefill in chunks of "
             f"{cfg.get('chunk')}; W=2 is two gloo processes and its peak is the larger rank's. Peak memory is the "
             "rise of resident memory during prefill (it includes the KV cache)."]
    same = result.get("same_tokens_all_modes")
    if isinstance(same, list):
        notes.append("All three modes generated the same tokens at every length." if all(same) else
                     f"**The modes generated different tokens** at lengths "
                     f"{[L for L, ok in zip(lengths, same) if not ok]}.")
    headers = ["S", "KV cache MiB", "one-shot: TTFT / peak", "chunked: TTFT / peak (vs one-shot)",
               "sp W=2: TTFT / peak per rank (vs one-shot)"]
    return Section(md_table(headers, body), [t], notes)


ROOT = Path(__file__).resolve().parent.parent


def _tame_malloc() -> None:
    """Large blocks straight from / back to the system (fixed mmap threshold), so RSS tracks live tensors."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD; setting it also disables the dynamic threshold
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    except OSError:
        pass


def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


class PeakRSS:
    """Peak resident-set rise (bytes) over a block, from the kernel's high-water mark."""

    def __enter__(self):
        import gc

        gc.collect()
        self.base = _status_kb("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            self.exact = True
        except OSError:
            self.exact = False  # without the reset VmHWM is the process's lifetime peak
        return self

    def __exit__(self, *exc):
        self.peak = max(0, _status_kb("VmHWM") - self.base) * 1024


def build_model(args):
    import torch

    from longvideo.model import ModelConfig, Transformer

    cfg = ModelConfig(text_vocab_size=512, codebook_size=1024, dim=args.dim, n_layers=args.layers,
                      n_heads=args.heads, n_kv_heads=args.kv_heads, max_seq_len=max(args.lengths) + 64,
                      ffn_chunk=args.ffn_chunk, attn_backend=args.backend)
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def prompt(model, S: int):
    import torch

    g = torch.Generator().manual_seed(S)
    return torch.randint(0, model.cfg.vocab_size, (1, S), generator=g)


def kv_bytes(cfg, S: int) -> int:
    return 2 * cfg.n_layers * S * cfg.n_kv_heads * cfg.head_dim * 4


def run_single(model, S: int, chunk: int, decode: int) -> dict:
    from longvideo.infer.generation import generate

    ids = prompt(model, S)
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        out = generate(model, ids, max_new_tokens=1 + decode, prefill_chunk=chunk)
        wall = time.perf_counter() - t0
    return {"ttft_s": out.ttft_s, "decode_ms_per_token": 1e3 * (out.total_s - out.ttft_s) / max(decode, 1),
            "peak_mb": mem.peak / 2**20, "wall_s": wall, "tokens": out.tokens[0].tolist()}


def _sp_worker(rank: int, world: int, init_file: str, args, queue) -> None:
    _tame_malloc()
    import torch
    import torch.distributed as dist

    from longvideo.infer.sp import sp_generate

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=1800))
    try:
        model = build_model(args)
        with torch.no_grad():
            sp_generate(model, prompt(model, 64), max_new_tokens=2, backend=args.backend)  # warm-up
            for S in args.lengths:
                ids = prompt(model, S)
                dist.barrier()
                with PeakRSS() as mem:
                    out = sp_generate(model, ids, max_new_tokens=1 + args.decode, backend=args.backend)
                queue.put({"rank": rank, "S": S, "ttft_s": out.ttft_s, "peak_mb": mem.peak / 2**20,
                           "decode_ms_per_token": 1e3 * (out.total_s - out.ttft_s) / max(args.decode, 1),
                           "tokens": out.tokens[0].tolist()})
    finally:
        dist.destroy_process_group()


def run_sp(args) -> dict[int, dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_sp_worker, args=(r, 2, os.path.join(d, "rdzv"), args, queue)) for r in range(2)]
        for p in procs:
            p.start()
        rows = [queue.get(timeout=3600) for _ in range(2 * len(args.lengths))]
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise RuntimeError(f"sequence-parallel workers failed: {[p.exitcode for p in procs]}")
    out = {}
    for S in args.lengths:
        ranks = [r for r in rows if r["S"] == S]
        out[S] = {"ttft_s": max(r["ttft_s"] for r in ranks), "peak_mb": max(r["peak_mb"] for r in ranks),
                  "peak_mb_per_rank": [r["peak_mb"] for r in sorted(ranks, key=lambda r: r["rank"])],
                  "decode_ms_per_token": max(r["decode_ms_per_token"] for r in ranks),
                  "tokens": ranks[0]["tokens"], "ranks_agree": all(r["tokens"] == ranks[0]["tokens"] for r in ranks)}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = result["lengths"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    styles = {"one_shot": ("one-shot prefill", "o-"), "chunked": (f"chunked ({result['config']['chunk']})", "s-"),
              "sp2": ("sequence-parallel W=2 (per rank)", "^-")}
    for mode, (label, style) in styles.items():
        rows = result["modes"][mode]
        axes[0].plot(L, [r["ttft_s"] for r in rows], style, label=label)
        axes[1].plot(L, [r["peak_mb"] for r in rows], style, label=label)
    axes[1].plot(L, [b / 2**20 for b in result["kv_cache_bytes"]], "k--", label="KV cache (whole prompt)")
    axes[0].set(xlabel="context length (tokens)", ylabel="time to first token (s)", xscale="log",
                title="Time to first token")
    axes[1].set(xlabel="context length (tokens)", ylabel="peak memory rise (MiB)", xscale="log",
                title="Peak memory during prefill")
    from matplotlib.ticker import NullFormatter

    for ax in axes:
        ax.set_xticks(L, [str(x) for x in L])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    m = result["config"]
    fig.suptitle(f"CPU ({result['machine']['cpus']} cores, shared), tiny model: dim {m['dim']}, {m['layers']} layers, "
                 f"{m['heads']}/{m['kv_heads']} heads, fp32", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096, 8192])
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk of the chunked mode")
    p.add_argument("--decode", type=int, default=8, help="tokens decoded after the first (decode speed)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn-chunk", type=int, default=4096, help="the model's blockwise feed-forward chunk")
    p.add_argument("--backend", default="auto")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the single-process modes (sp2 ranks use one each)")
    p.add_argument("--out", default=str(ROOT / "docs" / "bench" / "infer.json"))
    p.add_argument("--replot", action="store_true", help="only redraw the PNG from an existing --out JSON")
    args = p.parse_args(argv)
    if args.replot:
        out = Path(args.out)
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        return 0

    _tame_malloc()
    import torch

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    t_start = time.time()
    model = build_model(args)
    with torch.no_grad():
        run_single(model, 64, 64, 1)  # warm-up
        modes = {"one_shot": [], "chunked": []}
        for S in args.lengths:
            modes["one_shot"].append(run_single(model, S, S, args.decode))
            modes["chunked"].append(run_single(model, S, args.chunk, args.decode))
            print(f"S={S:>7}: one-shot ttft {modes['one_shot'][-1]['ttft_s']:.2f} s, peak "
                  f"{modes['one_shot'][-1]['peak_mb']:.1f} MiB | chunked ttft {modes['chunked'][-1]['ttft_s']:.2f} s, "
                  f"peak {modes['chunked'][-1]['peak_mb']:.1f} MiB", flush=True)
    sp = run_sp(args)
    modes["sp2"] = [sp[S] for S in args.lengths]
    for S, r in zip(args.lengths, modes["sp2"]):
        print(f"S={S:>7}: sp2 ttft {r['ttft_s']:.2f} s, peak per rank {r['peak_mb']:.1f} MiB", flush=True)
    same = [a["tokens"] == b["tokens"] == c["tokens"] for a, b, c in zip(*modes.values())]
    kv = [kv_bytes(model.cfg, S) for S in args.lengths]
    result = {
        "bench": "infer",
        "lengths": args.lengths,
        "config": {"dim": args.dim, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                   "chunk": args.chunk, "ffn_chunk": args.ffn_chunk, "backend": args.backend, "dtype": "float32",
                   "single_process_threads": args.threads, "sp_threads_per_rank": 1, "decode_tokens": args.decode},
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                    "torch": torch.__version__, "python": sys.version.split()[0]},
        "kv_cache_bytes": kv,
        "modes": modes,
        "ratios": {
            "chunked_over_one_shot_peak": [c["peak_mb"] / max(o["peak_mb"], 1e-9)
                                           for c, o in zip(modes["chunked"], modes["one_shot"])],
            "sp2_over_one_shot_peak": [s["peak_mb"] / max(o["peak_mb"], 1e-9)
                                       for s, o in zip(modes["sp2"], modes["one_shot"])],
            "chunked_over_one_shot_ttft": [c["ttft_s"] / o["ttft_s"] for c, o in zip(modes["chunked"], modes["one_shot"])],
            "sp2_over_one_shot_ttft": [s["ttft_s"] / o["ttft_s"] for s, o in zip(modes["sp2"], modes["one_shot"])],
        },
        "same_tokens_all_modes": same,
        "seconds": round(time.time() - t_start, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')} in {result['seconds']} s; same tokens in every mode: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
