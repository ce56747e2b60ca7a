"""Benchmark the attention kernels on a GPU: ours (triton; auto) against SDPA-flash and cuDNN.

    python scripts/bench_kernels.py                       # bf16, causal, D=64 9/3 and D=128 32/8, S = 4K, 16K
    python scripts/bench_kernels.py --shapes 128:32:8 --seqlens 8192 32768 --docs 8

Forward and backward are timed apart (the backward from a kept graph with autograd.grad), medians
of --reps CUDA-event timings after --warmup calls, on the same inputs for every implementation:
`triton` (our kernel), `auto` (our per-block dispatch: dense blocks to cuDNN / SDPA flash), SDPA's
flash and cuDNN backends (GQA natively where the backend takes it, else K/V repeated inside the
timed call). FLOPs count the visible pairs (a causal sequence's half; with --docs N, the blocks of
N packed documents), forward 4*B*H*pairs*D, backward 2.5x that, so a packed row's TFLOP/s is its
speed on the work it has to do. Packed rows run ours only; SDPA's rows stay dense causal, which is
what the packed target compares with. Every timing catches its own error; the JSON is rewritten
after every case. Without CUDA it writes a JSON that says skipped.
Writes docs/bench/kernels.json (and kernels.png when something was measured).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from benchreport import Section, Target, fmt_num, md_table, ratio, req, req_list, yes_no

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TITLE = "Attention kernels"
MEASURES = ("Forward and backward TFLOP/s of our Triton kernel and per-block dispatch against PyTorch SDPA's "
            "flash and cuDNN backends, same inputs, at the shipped models' head shapes (GPU only).")
DOCS = ["kernels.md"]
TARGETS = [Target("kernels: Triton flash attention fwd+bwd", ">= 90 % of SDPA-flash throughput (GPU)"),
           Target("kernels: packed documents (Triton) vs cuDNN dense causal", "fwd >= 0.8x, fwd+bwd >= 0.75x (GPU)")]
IMPLS = ("triton", "auto", "flash", "cudnn")
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100 SXM": 989.4, "H100 80GB HBM3": 989.4, "H800": 989.4, "GH200": 989.4,
                    "H100 NVL": 835.0, "H100 PCIe": 756.5, "A100": 312.0, "A800": 312.0, "L40S": 362.1, "L4": 121.0}
"""Dense bf16 tensor-core peaks (TFLOP/s) from the vendors' data sheets."""


def _tf(r: dict, who: str, part: str):
    """TFLOP/s of one implementation and part ('fwd', 'bwd', 'fwdbwd'); the old layout's keys too."""
    old = {"triton": "ours", "flash": "sdpa"}.get(who)
    return r.get(f"{who}_{part}_tflops") or (r.get(f"{old}_{part}_tflops") if old else None)


def report(result: dict) -> Section:
    t, tp = (Target(x.what, x.goal) for x in TARGETS)
    if req(result, "skipped"):
        t.figure = tp.figure = "-"
        t.met = tp.met = "not measurable here"
        return Section("", [t, tp], [f"Skipped: {result.get('reason', 'no reason recorded')}. Run "
                                     "`python scripts/bench_kernels.py` on a CUDA machine."])
    body, vs_flash, vs_cudnn = [], [], []
    for r in req_list(result, "results"):
        cells = [f"{req(r, 'seqlen'):,}", str(r.get("shape", "-")), str(r.get("docs", 1))]
        for part in ("fwd", "bwd", "fwdbwd"):
            cells += [fmt_num(_tf(r, who, part), ".0f") for who in IMPLS]
        body.append(cells)
        rb = ratio(_tf(r, "triton", "fwdbwd"), _tf(r, "flash", "fwdbwd"))
        if rb is not None and r.get("docs", 1) == 1:
            vs_flash.append((r["seqlen"], rb))
        if r.get("packed_vs_cudnn_fwd") is not None:
            vs_cudnn.append((r["seqlen"], r["packed_vs_cudnn_fwd"], r.get("packed_vs_cudnn_fwdbwd")))
    if vs_flash:
        S, worst = min(vs_flash, key=lambda x: x[1])
        t.figure, t.met = f"{worst:.0%} of SDPA flash (worst, at S = {S:,})", yes_no(worst >= 0.9)
    else:
        t.figure, t.met = "no length measured on both sides", "unknown"
    if vs_cudnn:
        f, fb = min(x[1] for x in vs_cudnn), min((x[2] for x in vs_cudnn if x[2] is not None), default=None)
        tp.figure = f"fwd {f:.2f}x, fwd+bwd {fmt_num(fb, '.2f')}x (worst row)"
        tp.met = yes_no(f >= 0.8 and fb is not None and fb >= 0.75)
    else:
        tp.figure, tp.met = "no packed row", "unknown"
    headers = ["S", "D / heads", "docs"] + [f"{p} {w}" for p in ("fwd", "bwd", "fwd+bwd") for w in IMPLS]
    notes = [f"TFLOP/s of the visible pairs, bf16; median of {(result.get('config') or {}).get('reps', '?')} "
             "timed calls. `auto` is our dispatch (dense blocks to cuDNN / flash); packed rows compare with "
             "cuDNN's dense causal row of the same length and shape."]
    return Section(md_table(headers, body), [t, tp], notes)


def device_peak(name: str) -> float | None:
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):  # most specific name first
        if key.lower() in name.lower():
            return PEAK_BF16_TFLOPS[key]
    return None


def attention_flops(B: int, H: int, S: int, D: int, causal: bool) -> float:
    """Forward FLOPs: two S x S x D matmuls per head (2 FLOPs per multiply-add), half if causal."""
    return 4.0 * B * H * S * S * D / (2 if causal else 1)


def time_fn(fn, warmup: int, reps: int, cuda: bool | None = None) -> list[float]:
    """Seconds of each timed call: CUDA events on a GPU, perf_counter otherwise (dry runs)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(max(1, reps)):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def packed_meta(B: int, S: int, docs: int, device):
    """docs equal documents per row (the last takes the remainder), positions restarting."""
    n = max(1, S // docs)
    seg = torch.clamp(torch.arange(S, device=device) // n, max=docs - 1)
    pos = torch.arange(S, device=device) - seg * n
    return pos.expand(B, S).contiguous(), seg.expand(B, S).contiguous()


def _calls(who: str, q, k, v, meta, group: int):
    """The attention of implementation `who` as a function of (q, k, v), (B, S, H, D) layout."""
    from longvideo.kernels import AttentionPlan, block_attention

    if who in ("triton", "auto"):
        plan = AttentionPlan()  # kept across calls, as a model step keeps it across layers
        return lambda q, k, v: block_attention(q, k, v, *meta, backend=who, plan=plan)
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.FLASH_ATTENTION if who == "flash" else SDPBackend.CUDNN_ATTENTION

    def call(q, k, v, expand=False):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        if expand and group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=group > 1 and not expand
                                                  ).transpose(1, 2)
    try:  # does this backend take GQA natively?
        with torch.no_grad():
            call(q[:, :64], k[:, :64], v[:, :64])
        return call
    except RuntimeError:
        return lambda q, k, v: call(q, k, v, expand=True)


def bench_case(S: int, tokens: int, H: int, Hkv: int, D: int, docs: int, *, warmup: int = 2, reps: int = 5,
               impls=IMPLS, dtype=torch.bfloat16, device=None, peak=None) -> dict:
    """One row: per implementation, forward and backward times (median, min, max ms) and TFLOP/s."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    B = max(1, tokens // S)
    pos, seg = packed_meta(B, S, docs, device)
    n = S // docs
    pairs = docs * n * (n + 1) / 2 + (S - docs * n) * n  # the visible pairs of one row (causal)
    fwd_flops = 4.0 * B * H * pairs * D
    row = dict(seqlen=S, batch=B, shape=f"{D} {H}/{Hkv}", head_dim=D, heads=H, kv_heads=Hkv, docs=docs,
               fwd_tflop=fwd_flops / 1e12)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(B, S, h, D, generator=g, device=device, dtype=dtype) for h in (H, Hkv, Hkv, H))
    for x in (q, k, v):
        x.requires_grad_(True)
    for who in impls if docs == 1 else ("triton", "auto"):
        try:
            fn = _calls(who, q, k, v, (pos, pos, seg, seg), H // Hkv)
            cuda = device.type == "cuda"
            with torch.no_grad():
                fwd = time_fn(lambda: fn(q, k, v), warmup, reps, cuda)
            out = fn(q, k, v)
            bwd = time_fn(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), warmup, reps, cuda)
            del out
        except Exception as e:  # noqa: BLE001 - unsupported backend, OOM: recorded, the others still run
            row[f"{who}_error"] = repr(e)[:300]
            continue
        for part, ts, flops in (("fwd", fwd, fwd_flops), ("bwd", bwd, 2.5 * fwd_flops)):
            med = statistics.median(ts)
            row[f"{who}_{part}_ms"] = [1e3 * med, 1e3 * min(ts), 1e3 * max(ts)]
            row[f"{who}_{part}_tflops"] = flops / med / 1e12
        row[f"{who}_fwdbwd_tflops"] = 3.5 * fwd_flops / (statistics.median(fwd) + statistics.median(bwd)) / 1e12
        if peak:
            row[f"{who}_fwdbwd_frac_peak"] = row[f"{who}_fwdbwd_tflops"] / peak
    return row


def compare_packed(rows: list[dict]) -> None:
    """Fill each packed row's ratio to cuDNN's dense causal row of the same length and shape."""
    for r in rows:
        dense = next((d for d in rows if d.get("docs") == 1 and d["seqlen"] == r["seqlen"]
                      and d.get("shape") == r.get("shape")), None)
        if r.get("docs", 1) > 1 and dense:
            for part in ("fwd", "fwdbwd"):
                r[f"packed_vs_cudnn_{part}"] = ratio(r.get(f"triton_{part}_tflops"), dense.get(f"cudnn_{part}_tflops"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["64:9:3", "128:32:8"], help="head_dim:heads:kv_heads")
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="batch = max(1, tokens // seqlen)")
    p.add_argument("--docs", type=int, default=8, help="packed documents of the packed rows (1: none)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "kernels.json")
    args = p.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "attention kernels vs SDPA flash and cuDNN", "config": vars(args) | {"out": str(args.out)},
              "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count(),
                          "loadavg": list(os.getloadavg())}}
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        result.update(skipped=True, reason="no CUDA device: the kernels' speed can only be measured on a GPU")
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"bench_kernels: skipped ({result['reason']}); wrote {args.out}")
        return 0
    name = torch.cuda.get_device_name()
    result["machine"].update(gpu=name, peak_bf16_tflops=device_peak(name))
    result.update(skipped=False, results=[])
    for shape in args.shapes:
        D, H, Hkv = (int(x) for x in shape.split(":"))
        for S in args.seqlens:
            for docs in sorted({1, args.docs}):
                row = bench_case(S, args.tokens, H, Hkv, D, docs, warmup=args.warmup, reps=args.reps,
                                 peak=device_peak(name))
                result["results"].append(row)
                compare_packed(result["results"])
                print(f"S={S} D={D} {H}/{Hkv} docs={docs}: " + ", ".join(
                    f"{w} {row.get(f'{w}_fwd_tflops', 0):.0f}/{row.get(f'{w}_bwd_tflops', 0):.0f}" for w in IMPLS)
                    + " TFLOP/s fwd/bwd", flush=True)
                args.out.write_text(json.dumps(result, indent=1) + "\n")
                torch.cuda.empty_cache()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
