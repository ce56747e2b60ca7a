"""Benchmark the Triton flash-attention kernel against PyTorch SDPA (flash backend) in one run.

    python scripts/bench_kernels.py                      # bf16, D=128, causal, S = 4K, 16K, 64K
    python scripts/bench_kernels.py --seqlens 8192 --heads 32 --kv-heads 8 --docs 4

Reports TFLOP/s of the forward and of forward+backward for both, their ratio (target: the kernel
reaches >= 90 % of SDPA-flash forward+backward throughput), and each as a fraction of the device's
dense bf16 peak. FLOPs count only the visible half of a causal score matrix (4*B*H*S^2*D / 2 for the
forward, 2.5x that for the backward), for both implementations. With --docs N the sequence is N
packed documents (segment ids); SDPA then runs the same attention with an explicit boolean mask
through its memory-efficient backend (flash cannot take a mask), and the FLOP count stays that of
causal attention over the whole sequence, so the ratio shows what segment-aware tile skipping buys.

GQA (--kv-heads): SDPA gets enable_gqa where its backend takes it, else K and V repeated to the
query heads inside the timed call (what a model using that backend has to do); the JSON records
which (`sdpa_gqa`). Each length also compares outputs and the three gradients with SDPA's on the
same inputs. Every case runs in its own try: an error of any type is recorded in the JSON (and the
JSON is rewritten after every case), and the run goes on.

Needs a CUDA device; without one it prints why and writes a JSON that says skipped.
Writes docs/bench/kernels.json and, when something was measured, docs/bench/kernels.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

# ------------------------------------------------------------------------------------------- report
# Read by run_benchmarks.py to build docs/benchmarks.md: the title, what is measured, the detail docs
# under docs/ (the first that exists is linked), the targets (the summary rows while nothing is
# measured) and report(), which turns this script's JSON into a table, the targets met or not, and
# notes.

from benchreport import Section, Target, fmt_num, md_table, ratio, req, req_list, yes_no

TITLE = "Triton flash-attention kernel"
MEASURES = ("Forward and forward + backward TFLOP/s of the Triton kernel against PyTorch SDPA with the "
            "flash backend, same inputs (GPU only).")
DOCS = ["kernels.md"]
TARGETS = [Target("kernels: Triton flash attention fwd+bwd", ">= 90 % of SDPA-flash throughput (GPU)")]


def report(result: dict) -> Section:
    t = Target(TARGETS[0].what, TARGETS[0].goal)
    if req(result, "skipped"):
        t.figure, t.met = "-", "not measurable here"
        return Section("", [t], [f"Skipped: {result.get('reason', 'no reason recorded')}. Run "
                                 "`python scripts/bench_kernels.py` on a CUDA machine."])
    goal = (result.get("config") or {}).get("target", 0.9)
    t.goal = f">= {goal:.0%} of SDPA-flash throughput (GPU)"
    body, ratios = [], []
    for r in req_list(result, "results"):
        rf = ratio(r.get("ours_fwd_tflops"), r.get("sdpa_fwd_tflops"))
        rb = ratio(r.get("ours_fwdbwd_tflops"), r.get("sdpa_fwdbwd_tflops"))
        if rb is not None:
            ratios.append((r["seqlen"], rb))
        diff = r.get("max_abs_diff_vs_sdpa")
        body.append([f"{req(r, 'seqlen'):,}", str(r.get("batch", "-")), fmt_num(r.get("ours_fwd_tflops"), ".1f"),
                     fmt_num(r.get("sdpa_fwd_tflops"), ".1f"), fmt_num(rf, ".2f"), fmt_num(r.get("ours_fwdbwd_tflops"), ".1f"),
                     fmt_num(r.get("sdpa_fwdbwd_tflops"), ".1f"), fmt_num(rb, ".2f"),
                     fmt_num(r.get("ours_fwdbwd_frac_peak") and 100 * r["ours_fwdbwd_frac_peak"], ".0f", " %"),
                     diff if isinstance(diff, str) else fmt_num(diff, ".2g")])
    if ratios:
        S, worst = min(ratios, key=lambda x: x[1])
        t.figure = f"{worst:.0%} of SDPA flash (worst, at S = {S:,})"
        t.met = yes_no(worst >= goal)
    else:
        t.figure, t.met = "no length measured on both sides", "unknown"
    cfg = result.get("config") or {}
    notes = [f"Causal, {cfg.get('dtype')}, {cfg.get('heads')} heads"
             + (f" / {cfg['kv_heads']} key-value heads" if cfg.get("kv_heads") else "")
             + f", head dim {cfg.get('head_dim')}, {cfg.get('docs', 1)} document(s) per sequence, "
             f"{cfg.get('tokens', '?')} tokens per batch; median of {cfg.get('reps')} timed calls. "
             f"FLOPs: {result.get('flops', 'see the script')}."]
    for r in result["results"]:
        errs = [f"{k[:-6]}: {v}" for k, v in r.items() if k.endswith("_error")]
        if errs:
            notes.append(f"S = {r['seqlen']:,} failed in part: " + "; ".join(errs))
    headers = ["S", "batch", "ours fwd TFLOP/s", "SDPA fwd TFLOP/s", "fwd ratio", "ours fwd+bwd TFLOP/s",
               "SDPA fwd+bwd TFLOP/s", "fwd+bwd ratio", "ours fwd+bwd % of peak", "max abs diff vs SDPA"]
    return Section(md_table(headers, body), [t], notes)


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, from the vendors' data sheets.
PEAK_BF16_TFLOPS = {
    "H200": 989.4,
    "H100 SXM": 989.4, "H100 80GB HBM3": 989.4, "H800": 989.4, "GH200": 989.4,
    "H100 NVL": 835.0, "H100 PCIe": 756.5,
    "A100": 312.0, "A800": 312.0,
    "L40S": 362.1, "L4": 121.0,
}


def device_peak(name: str) -> float | None:
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):  # most specific name first
        if key.lower() in name.lower():
            return PEAK_BF16_TFLOPS[key]
    return None


def attention_flops(B: int, H: int, S: int, D: int, causal: bool) -> float:
    """Forward FLOPs: two S x S x D matmuls per head (2 FLOPs per multiply-add), half if causal."""
    f = 4.0 * B * H * S * S * D
    return f / 2 if causal else f


def time_cuda(fn, warmup: int, reps: int) -> float:
    """Median seconds per call, timed with CUDA events (wall clock on a CPU: dry runs only)."""
    if not torch.cuda.is_available():
        times = []
        for _ in range(max(1, reps)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def packed_meta(B: int, S: int, docs: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """docs equal documents per row (the last takes the remainder); positions restart per document."""
    n = max(1, S // docs)
    idx = torch.arange(S, device=device)
    seg = torch.clamp(idx // n, max=docs - 1)
    pos = idx - seg * n
    return pos.expand(B, S).contiguous(), seg.expand(B, S).contiguous()


def _sdpa_call(backend, mask, gqa: str, group: int):
    """SDPA with the chosen backend; GQA natively ("native") or by repeating K/V ("expanded")."""
    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F

    def call(qq, kk, vv):
        if gqa == "expanded" and group > 1:
            kk, vv = kk.repeat_interleave(group, dim=1), vv.repeat_interleave(group, dim=1)
        extra = dict(enable_gqa=True) if gqa == "native" and group > 1 else {}
        with sdpa_kernel(backend):
            if mask is None:
                return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, **extra)
            return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, **extra)

    return call


def bench_one(S: int, args, device, row: dict) -> dict:
    """Fills `row` as it goes (so a failure part-way keeps what was measured)."""
    from torch.nn.attention import SDPBackend

    from longvideo.kernels import AttentionPlan
    from longvideo.kernels import _flash_attn_triton as tk
    from longvideo.kernels.flash_attn import flash_attn

    dtype = getattr(torch, args.dtype)
    B = max(1, args.tokens // S)
    H, Hkv, D = args.heads, args.kv_heads or args.heads, args.head_dim
    fwd_flops = attention_flops(B, H, S, D, True)
    row.update({"seqlen": S, "batch": B, "heads": H, "kv_heads": Hkv, "head_dim": D, "docs": args.docs,
                "fwd_tflop": fwd_flops / 1e12, "bwd_variant": args.bwd_variant or tk.tile_config(D, dtype).variant})
    if args.bwd_variant:
        tk.set_backward(args.bwd_variant)
    torch.manual_seed(0)
    q = torch.randn(B, S, H, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, S, Hkv, D, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, S, Hkv, D, device=device, dtype=dtype, requires_grad=True)
    dout = torch.randn(B, S, H, D, device=device, dtype=dtype)
    pos, seg = packed_meta(B, S, args.docs, device)
    plan = AttentionPlan()  # kept across calls, as a model step keeps it across layers

    def ours_fwd():
        with torch.no_grad():
            flash_attn(q, k, v, pos, pos, seg, seg, causal=True, plan=plan)

    def ours_fwdbwd():
        q.grad = k.grad = v.grad = None
        flash_attn(q, k, v, pos, pos, seg, seg, causal=True, plan=plan).backward(dout)

    # SDPA takes (B, H, S, D): the transposed views a model would pass
    qt, kt, vt, dt = (x.transpose(1, 2) for x in (q, k, v, dout))
    mask = None
    if args.docs > 1:
        same = seg[0][:, None] == seg[0][None, :]
        mask = same & torch.ones(S, S, dtype=torch.bool, device=device).tril()
    backend = SDPBackend.FLASH_ATTENTION if mask is None else SDPBackend.EFFICIENT_ATTENTION
    group = H // Hkv
    gqa = "none" if group == 1 else "native"
    sdpa = _sdpa_call(backend, mask, gqa, group)
    if group > 1:
        try:  # does this backend take enable_gqa?
            with torch.no_grad():
                sdpa(qt[:, :, :128], kt[:, :, :128], vt[:, :, :128])
        except Exception:  # noqa: BLE001 - any refusal: repeat K/V instead
            gqa = "expanded"
            sdpa = _sdpa_call(backend, mask, gqa, group)
    row["sdpa_backend"] = backend.name
    row["sdpa_gqa"] = gqa

    def sdpa_fwd():
        with torch.no_grad():
            sdpa(qt, kt, vt)

    def sdpa_fwdbwd():
        q.grad = k.grad = v.grad = None
        sdpa(qt, kt, vt).backward(dt)

    # agreement on this input, outputs and gradients (a sanity check of the GPU build, not a benchmark)
    try:
        q.grad = k.grad = v.grad = None
        ours = flash_attn(q, k, v, pos, pos, seg, seg, plan=plan)
        ours.backward(dout)
        g_ours = [x.grad.float() for x in (q, k, v)]
        q.grad = k.grad = v.grad = None
        theirs = sdpa(qt, kt, vt).transpose(1, 2)
        theirs.backward(dout)
        g_sdpa = [x.grad.float() for x in (q, k, v)]
        row["max_abs_diff_vs_sdpa"] = (ours.float() - theirs.float()).abs().max().item()
        row["grad_max_abs_diff_vs_sdpa"] = {n: (a - b).abs().max().item() for n, a, b in
                                            zip(("dq", "dk", "dv"), g_ours, g_sdpa)}
        row["grad_max_abs_vs"] = {n: b.abs().max().item() for n, b in zip(("dq", "dk", "dv"), g_sdpa)}
        del ours, theirs, g_ours, g_sdpa
    except Exception as e:  # noqa: BLE001 - recorded, the timings still run
        row["max_abs_diff_vs_sdpa"] = f"error: {e!r}"[:300]
    q.grad = k.grad = v.grad = None

    cuda = device.type == "cuda"
    for name, fn, flops in (("ours_fwd", ours_fwd, fwd_flops), ("ours_fwdbwd", ours_fwdbwd, 3.5 * fwd_flops),
                            ("sdpa_fwd", sdpa_fwd, fwd_flops), ("sdpa_fwdbwd", sdpa_fwdbwd, 3.5 * fwd_flops)):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            sec = time_cuda(fn, args.warmup, args.reps)
        except Exception as e:  # noqa: BLE001 - OOM, compile errors, unsupported backends: record, go on
            row[name + "_error"] = repr(e)[:300]
            if cuda:
                torch.cuda.empty_cache()
            continue
        row[name + "_ms"] = sec * 1e3
        row[name + "_tflops"] = flops / sec / 1e12
        if cuda:
            row[name + "_peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    for part in ("fwd", "fwdbwd"):
        a, b = row.get(f"ours_{part}_tflops"), row.get(f"sdpa_{part}_tflops")
        if a and b:
            row[f"ratio_{part}"] = a / b
        if args.peak:
            for who in ("ours", "sdpa"):
                if row.get(f"{who}_{part}_tflops"):
                    row[f"{who}_{part}_frac_peak"] = row[f"{who}_{part}_tflops"] / args.peak
    del q, k, v, dout, qt, kt, vt, dt
    if cuda:
        torch.cuda.empty_cache()
    if args.bwd_variant:
        tk.set_backward(None)
    return row


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{r['seqlen'] // 1024}K" for r in results]
    x = range(len(results))
    for ax, part in zip(axes, ("fwd", "fwdbwd")):
        for off, who, color in ((-0.2, "ours", "tab:blue"), (0.2, "sdpa", "tab:gray")):
            vals = [r.get(f"{who}_{part}_tflops") or 0 for r in results]
            ax.bar([i + off for i in x], vals, width=0.4, color=color,
                   label="Triton kernel" if who == "ours" else "SDPA flash")
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.set_title("forward" if part == "fwd" else "forward + backward")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--tokens", type=int, default=65536, help="batch = max(1, tokens // seqlen)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=0, help="0: same as --heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--docs", type=int, default=1, help="packed documents per sequence (segment ids)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=None, help="override the device's dense peak")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "kernels.json")
    p.add_argument("--target", type=float, default=0.9, help="required fwd+bwd ratio to SDPA flash")
    p.add_argument("--bwd-variant", default=None, choices=["fused", "split"],
                   help="the kernel's backward variant (default: its launch table's)")
    args = p.parse_args(argv)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "triton flash attention vs torch SDPA (flash backend)",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "loadavg": list(os.getloadavg())},
        "config": {k: (os.path.relpath(v, ROOT) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "flops": "causal forward = 4*B*H*S^2*D/2; backward = 2.5 x forward; forward+backward = 3.5 x forward",
    }
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        reason = ("no CUDA device: the kernel's speed can only be measured on a GPU "
                  "(on CPU it runs only under TRITON_INTERPRET=1, for correctness tests)")
        print(f"bench_kernels: skipped - {reason}")
        report.update(skipped=True, reason=reason)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
        return 0

    import triton

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    args.peak = args.peak_tflops or device_peak(name)
    report["machine"].update(gpu=name, capability=list(torch.cuda.get_device_capability(device)),
                             triton=triton.__version__, peak_bf16_tflops=args.peak)
    results = []
    t0 = time.time()

    def write(final: bool) -> None:
        ratios = [r["ratio_fwdbwd"] for r in results if "ratio_fwdbwd" in r]
        report.update(skipped=False, results=results, wall_s=time.time() - t0, complete=final,
                      min_ratio_fwdbwd=min(ratios) if ratios else None,
                      meets_target=bool(ratios) and min(ratios) >= args.target)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    for S in args.seqlens:
        row: dict = {"seqlen": S}
        results.append(row)
        try:
            bench_one(S, args, device, row)
        except Exception as e:  # noqa: BLE001 - a failed case is recorded; the others still run
            row["case_error"] = repr(e)[:500]
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        print(f"S={S:>6} B={row.get('batch', '?'):>3}  fwd: ours {row.get('ours_fwd_tflops', float('nan')):6.1f} "
              f"sdpa {row.get('sdpa_fwd_tflops', float('nan')):6.1f} TFLOP/s | fwd+bwd: ours "
              f"{row.get('ours_fwdbwd_tflops', float('nan')):6.1f} sdpa {row.get('sdpa_fwdbwd_tflops', float('nan')):6.1f}"
              f" | ratio fwd+bwd {row.get('ratio_fwdbwd', float('nan')):.2f}"
              + (f" | error {row['case_error']}" if "case_error" in row else ""), flush=True)
        write(False)
    write(True)
    print(f"wrote {args.out}")
    if any(r.get("ours_fwd_tflops") for r in results):
        try:
            png = args.out.with_suffix(".png")
            plot(results, png, f"{name}: causal {args.dtype}, D={args.head_dim}, H={args.heads}, docs={args.docs}")
            print(f"wrote {png}")
        except Exception as e:  # noqa: BLE001 - the JSON is what matters
            print(f"plot failed: {e!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
