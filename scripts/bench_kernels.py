"""Benchmark the attention kernels on a GPU: ours (triton; auto) against SDPA-flash and cuDNN.

    python scripts/bench_kernels.py                       # bf16, causal, D=64 9/3 and D=128 32/8, S = 4K, 16K
    python scripts/bench_kernels.py --shapes 128:32:8 --seqlens 8192 32768 --docs 8

The same measurement as `scripts/gpu_check.py`'s speed part (`gpu_check.bench_case`): forward and
backward timed apart, medians of CUDA-event timings, TFLOP/s of the visible pairs, on the same
inputs for `triton` (our kernel), `auto` (our per-block dispatch: dense blocks to cuDNN / SDPA
flash), SDPA's flash and cuDNN backends; packed rows (--docs) run ours and compare with cuDNN's
dense causal row of the same length. Without CUDA it writes a JSON that says skipped.
Writes docs/bench/kernels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from benchreport import Section, Target, fmt_num, md_table, ratio, req, req_list, yes_no

ROOT = Path(__file__).resolve().parents[1]
TITLE = "Attention kernels"
MEASURES = ("Forward and backward TFLOP/s of our Triton kernel and per-block dispatch against PyTorch SDPA's "
            "flash and cuDNN backends, same inputs, at the shipped models' head shapes (GPU only).")
DOCS = ["kernels.md"]
TARGETS = [Target("kernels: Triton flash attention fwd+bwd", ">= 90 % of SDPA-flash throughput (GPU)"),
           Target("kernels: packed documents (Triton) vs cuDNN dense causal", "fwd >= 0.8x, fwd+bwd >= 0.75x (GPU)")]
IMPLS = ("triton", "auto", "flash", "cudnn")


def _tf(r: dict, who: str, part: str):
    """TFLOP/s of one implementation and part; rows of the earlier layout name triton `ours`, flash `sdpa`."""
    return r.get(f"{who}_{part}_tflops") or r.get(f"{dict(triton='ours', flash='sdpa').get(who)}_{part}_tflops")


def report(result: dict) -> Section:
    t, tp = (Target(x.what, x.goal) for x in TARGETS)
    if req(result, "skipped"):
        t.figure, tp.figure, t.met, tp.met = "-", "-", "not measurable here", "not measurable here"
        return Section("", [t, tp], [f"Skipped: {result.get('reason', 'no reason recorded')}. Run "
                                     "`python scripts/bench_kernels.py` on a CUDA machine."])
    rows, body = req_list(result, "results"), []
    for r in rows:
        body.append([f"{req(r, 'seqlen'):,}", str(r.get("shape", "-")), str(r.get("docs", 1))]
                    + [fmt_num(_tf(r, w, part), ".0f") for part in ("fwd", "bwd", "fwdbwd") for w in IMPLS])
    vs = [(r["seqlen"], ratio(_tf(r, "triton", "fwdbwd"), _tf(r, "flash", "fwdbwd"))) for r in rows if r.get("docs", 1) == 1]
    vs = [x for x in vs if x[1] is not None]
    if vs:
        S, worst = min(vs, key=lambda x: x[1])
        t.figure, t.met = f"{worst:.0%} of SDPA flash (worst, at S = {S:,})", yes_no(worst >= 0.9)
    else:
        t.figure, t.met = "no length measured on both sides", "unknown"
    packed = [(r["packed_vs_cudnn_fwd"], r.get("packed_vs_cudnn_fwdbwd") or 0) for r in rows if r.get("packed_vs_cudnn_fwd")]
    tp.figure = f"fwd {min(a for a, _ in packed):.2f}x, fwd+bwd {min(b for _, b in packed):.2f}x (worst)" if packed else "-"
    tp.met = yes_no(min(a for a, _ in packed) >= 0.8 and min(b for _, b in packed) >= 0.75) if packed else "unknown"
    headers = ["S", "D / heads", "docs"] + [f"{p} {w}" for p in ("fwd", "bwd", "fwd+bwd") for w in IMPLS]
    return Section(md_table(headers, body), [t, tp], [
        f"TFLOP/s of the visible pairs, bf16, causal; median of {(result.get('config') or {}).get('reps', '?')} timed "
        "calls. `auto` is our dispatch (dense blocks to cuDNN / flash); packed rows compare with cuDNN's dense causal "
        "row of the same length and shape."])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["64:9:3", "128:32:8"], help="head_dim:heads:kv_heads")
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="batch = max(1, tokens // seqlen)")
    p.add_argument("--docs", type=int, default=8, help="documents of the packed rows (1: none)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "kernels.json")
    args = p.parse_args(argv)
    import torch

    result = dict(benchmark="attention kernels vs SDPA flash and cuDNN", config=vars(args) | dict(out=str(args.out)),
                  machine=dict(platform=platform.platform(), torch=torch.__version__, cpus=os.cpu_count()))
    if args.out.parent.mkdir(parents=True, exist_ok=True) or not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        result.update(skipped=True, reason="no CUDA device: the kernels' speed can only be measured on a GPU")
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"bench_kernels: skipped ({result['reason']}); wrote {args.out}")
        return 0
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check as check

    result.update(skipped=False, results=[])
    result["machine"].update(gpu=(name := torch.cuda.get_device_name()), peak_bf16_tflops=check.device_peak(name))
    for D, H, Hkv in (tuple(int(x) for x in s.split(":")) for s in args.shapes):
        for S, docs in ((S, d) for S in args.seqlens for d in sorted({1, args.docs})):
            result["results"].append(row := check.bench_case(S, args.tokens, H, Hkv, D, docs, args.warmup, args.reps))
            check.compare_packed(result["results"])
            print(f"S={S} D={D} {H}/{Hkv} docs={docs}: fwd/bwd TFLOP/s " + ", ".join(
                f"{w} {row.get(f'{w}_fwd_tflops', 0):.0f}/{row.get(f'{w}_bwd_tflops', 0):.0f}" for w in IMPLS), flush=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
            torch.cuda.empty_cache()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
