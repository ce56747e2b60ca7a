"""One prepared GPU check of the Triton attention and a training step, in one run (`make gpu-check`).

    python scripts/gpu_check.py                 # on a CUDA machine: every part, at most --budget s (480)
    python scripts/gpu_check.py --parts speed   # some parts only (env always runs)
    python scripts/gpu_check.py --tune          # time candidate tile shapes, write docs/bench/gpu_tune.json
    python scripts/gpu_check.py --dry-run       # what runs without CUDA: the interpreter, tiny shapes

Parts, each in its own try with its own time budget (a part that fails or runs out of time is
recorded and the next one starts; the JSON is rewritten after every part):

* env          GPU name, capability, memory, versions.
* correctness  kernel vs float64 at multi-tile shapes: S = 8192, bf16, head dim 128, GQA 32/8, one
               document and packed documents with padding; both backward variants; a ring-style
               split-key backward (two key blocks, global out/lse); head dim 80; the decode path.
               Rule: error <= 2 x the same-dtype PyTorch error + eps, for out, dq, dk and dv.
* syncs        host syncs counted with torch.cuda.set_sync_debug_mode on: flash_attn forward +
               backward with and without a kept plan, the decode path, ring steps (a visible and an
               empty key block), and a whole model step (non-attention code included).
* determinism  two forwards bitwise equal; the backward of each variant compared bitwise.
* speed        forward and forward+backward TFLOP/s at S = 4K, 8K, 16K (bf16, D = 128, GQA 32/8)
               against SDPA-flash and cuDNN SDPA, both backward variants timed; the tile plans'
               build time on the GPU at 64K, 256K and 1M tokens.
* train        one training step (forward, backward, AdamW) of the smol-135m shape
               (configs/smol-135m.yaml) in bf16 at 16K, 32K, 64K tokens: tokens/s, MFU, peak
               memory; the same for transformers' Llama with SDPA (with and without gradient
               checkpointing); the longest context that fits the GPU, from a linear fit of peak
               memory against length (the attention is O(S) memory for all of them).
* tune         (--tune only) time candidate launch shapes per (head dim, dtype) and write the
               fastest as a launch table (docs/bench/gpu_tune.json; LONGVIDEO_FLASH_TABLE=<that
               file> makes the kernels use it). Later parts of the same run use it.

Writes docs/bench/gpu_check.json and, on a GPU, replaces the GPU-check section of
docs/benchmarks.md (between its markers; appended when absent). Without CUDA (or with --dry-run)
it runs the same code on tiny shapes under TRITON_INTERPRET=1, skips what needs a GPU, says so in
the JSON (docs/bench/gpu_check_dry.json when gpu_check.json holds a GPU run) and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402 - the interpreter must be chosen before anything imports triton

DRY = "--dry-run" in sys.argv or not torch.cuda.is_available()
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

from bench_kernels import _sdpa_call, attention_flops, device_peak, time_cuda  # noqa: E402
from longvideo.kernels import AttentionPlan, RingPlans, flash_attn_ref, get_backend  # noqa: E402
from longvideo.kernels import _flash_attn_triton as tk  # noqa: E402
from longvideo.kernels.flash_attn import flash_attn  # noqa: E402

BENCH = ROOT / "docs" / "bench"
MD_BEGIN = "<!-- gpu-check:begin (written by scripts/gpu_check.py) -->"
MD_END = "<!-- gpu-check:end -->"
DEV = torch.device("cpu" if DRY else "cuda")
EPS = {torch.float32: 2e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}
PARTS = ("env", "correctness", "syncs", "determinism", "speed", "train", "profile")
BUDGETS = {"correctness": 100, "syncs": 40, "determinism": 30, "speed": 110, "train": 170, "profile": 60,
           "tune": 300}
TARGETS = {
    "fwd+bwd vs SDPA-flash (S >= 4K, bf16, D = 128)": ">= 0.9x",
    "host syncs per attention call": "0",
    "plan build / training step at 64K": "<= 2 %",
    "135M-shape context vs transformers + SDPA": ">= 8x",
}


class PartTimeout(Exception):
    pass


class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.monotonic(), seconds

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)

    def ok(self, need: float = 0.0) -> bool:
        return self.left() > need


def _sync():
    if not DRY:
        torch.cuda.synchronize()


def _free():
    gc.collect()
    if not DRY:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


# ----------------------------------------------------------------------------- inputs and reference


def packed_meta(B: int, S: int, docs: int, pad: int, seed: int):
    """Documents of random lengths (positions restarting), then `pad` padding tokens (segment -1)."""
    g = torch.Generator().manual_seed(seed)
    n = S - pad
    cuts = torch.sort(torch.randperm(n - 1, generator=g)[:docs - 1] + 1).values if docs > 1 else torch.zeros(0)
    seg = torch.zeros(n, dtype=torch.long)
    seg[cuts.long()] = 1
    seg = seg.cumsum(0)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), cuts.long()])
    pos = torch.arange(n) - starts[seg]
    pos = torch.cat([pos, torch.zeros(pad, dtype=torch.long)])
    seg = torch.cat([seg, torch.full((pad,), -1, dtype=torch.long)])
    return pos.expand(B, S).contiguous().to(DEV), seg.expand(B, S).contiguous().to(DEV)


def make_inputs(B, S, Hq, Hkv, D, dtype, seed, docs=1, pad=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v, dout = (torch.randn(B, S, h, D, generator=g, device=DEV).to(dtype) for h in (Hq, Hkv, Hkv, Hq))
    pos, seg = packed_meta(B, S, docs, pad, seed)
    return q, k, v, dout, (pos, pos, seg, seg)


def reference(q, k, v, dout, meta, causal, upcast: bool):
    """Materialised attention and its gradients, one kv head (and its query heads) at a time:
    float64 (upcast) or the inputs' dtype. Returns out, dq, dk, dv in that dtype."""
    dt = torch.float64 if upcast else q.dtype
    Hq, Hkv = q.shape[2], k.shape[2]
    G = Hq // Hkv
    outs, dqs, dks, dvs = [], [], [], []
    for hk in range(Hkv):
        qq = q[:, :, hk * G:(hk + 1) * G].detach().to(dt).requires_grad_(True)
        kk = k[:, :, hk:hk + 1].detach().to(dt).requires_grad_(True)
        vv = v[:, :, hk:hk + 1].detach().to(dt).requires_grad_(True)
        out, _ = flash_attn_ref(qq, kk, vv, *meta, causal=causal, upcast=False)
        out.backward(dout[:, :, hk * G:(hk + 1) * G].to(dt))
        outs.append(out.detach())
        dqs.append(qq.grad)
        dks.append(kk.grad)
        dvs.append(vv.grad)
        del out, qq, kk, vv
    return torch.cat(outs, 2), torch.cat(dqs, 2), torch.cat(dks, 2), torch.cat(dvs, 2)


def compare(got: dict, truth, plain, dtype) -> dict:
    """Per tensor: error vs float64, the same-dtype error, the bound 2 x that + eps, and pass."""
    res, ok = {}, True
    for name, t, p in zip(("out", "dq", "dk", "dv"), truth, plain):
        if name not in got:
            continue
        g = got[name]
        err, base = _err(g, t), _err(p, t)
        bound = 2 * base + EPS[dtype] * (1 + t.abs().max().item())
        finite = bool(torch.isfinite(g).all())
        res[name] = dict(err=err, same_dtype_err=base, bound=bound, ratio=err / bound if bound else None,
                         ok=finite and err <= bound)
        ok &= res[name]["ok"]
    res["ok"] = ok
    return res


def ours(q, k, v, dout, meta, causal=True, plan=None):
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = flash_attn(qg, kg, vg, *meta, causal=causal, plan=plan)
    out.backward(dout)
    return dict(out=out.detach(), dq=qg.grad, dk=kg.grad, dv=vg.grad)


# ----------------------------------------------------------------------------- parts


def part_env(budget, entry, args):
    import triton

    entry.update(mode="dry-run" if DRY else "gpu", torch=torch.__version__, triton=triton.__version__,
                 python=platform.python_version(), platform=platform.platform())
    try:
        import transformers

        entry["transformers"] = transformers.__version__
    except Exception as e:  # noqa: BLE001
        entry["transformers"] = f"unavailable: {e!r}"
    if DRY:
        entry["gpu"] = None
        entry["note"] = "no CUDA device: a dry run on tiny shapes under TRITON_INTERPRET=1; no figure is a GPU figure"
        return
    p = torch.cuda.get_device_properties(DEV)
    entry.update(gpu=p.name, capability=list(torch.cuda.get_device_capability(DEV)), sms=p.multi_processor_count,
                 memory_gib=p.total_memory / 2**30, peak_bf16_tflops=device_peak(p.name),
                 cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)


def part_correctness(budget, entry, args):
    if DRY:
        S, H, Hkv, D, D2, S2 = 48, 4, 2, 32, 80, 40
    else:
        S, H, Hkv, D, D2, S2 = 8192, 32, 8, 128, 80, 4096
    dt = torch.bfloat16
    cases = entry.setdefault("cases", {})

    def run_case(name, q, k, v, dout, meta, variants=("fused",), extra=None):
        if not budget.ok(10):
            cases[name] = dict(status="skipped: out of time")
            return None
        t0 = time.monotonic()
        truth = reference(q, k, v, dout, meta, True, upcast=True)
        plain = reference(q, k, v, dout, meta, True, upcast=False)
        res = {}
        for variant in variants:
            tk.set_backward(variant)
            try:
                res[variant] = compare(ours(q, k, v, dout, meta), truth, plain, dt)
            finally:
                tk.set_backward(None)
        if extra is not None:
            res.update(extra(truth, plain))
        res["ok"] = all(r["ok"] for r in res.values() if isinstance(r, dict))
        res["seconds"] = time.monotonic() - t0
        cases[name] = res
        print(f"  correctness {name}: {'ok' if res['ok'] else 'FAIL'} ({res['seconds']:.1f} s)", flush=True)
        return truth, plain

    q, k, v, dout, meta = make_inputs(1, S, H, Hkv, D, dt, seed=1)
    run_case(f"S={S} bf16 D={D} GQA {H}/{Hkv}, one document", q, k, v, dout, meta, variants=("fused", "split"))
    del q, k, v, dout
    _free()

    q, k, v, dout, meta = make_inputs(1, S, H, Hkv, D, dt, seed=2, docs=7, pad=S // 40)
    be = get_backend("triton", DEV)
    scale = 1 / math.sqrt(D)

    def ring_split(truth, plain):
        """Ring-style backward: the global out/lse from all keys, then each key block's backward."""
        qp, kp, qs, ks = meta
        out, lse = be.forward(q, k, v, qp, kp, qs, ks, scale, True)
        cut = S // 3 + 5
        dq = torch.zeros(q.shape, dtype=torch.float32, device=DEV)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=DEV)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=DEV)
        for sl in (slice(0, cut), slice(cut, S)):
            gq, gk, gv = be.backward(dout, q, k[:, sl], v[:, sl], out, lse, qp, kp[:, sl], qs, ks[:, sl], scale, True,
                                     plan=AttentionPlan())
            dq += gq
            dk[:, sl] += gk
            dv[:, sl] += gv
        got = dict(out=out, dq=dq.to(dt), dk=dk.to(dt), dv=dv.to(dt))
        return {"ring split-key backward": compare(got, truth, plain, dt)}

    run_case(f"S={S} bf16 D={D} GQA {H}/{Hkv}, 7 packed documents + padding", q, k, v, dout, meta,
             variants=("fused", "split"), extra=ring_split)
    del q, k, v, dout
    _free()

    q, k, v, dout, meta = make_inputs(1, S2, 8, 2, D2, dt, seed=3, docs=3, pad=S2 // 50)
    run_case(f"S={S2} bf16 D={D2} GQA 8/2, packed + padding", q, k, v, dout, meta)
    del q, k, v, dout
    _free()

    if budget.ok(10):  # decode: a few queries at the end of a long prompt, forward only
        q, k, v, dout, (pos, _, seg, _) = make_inputs(1, S, H, Hkv, D, dt, seed=4)
        res = {}
        for n in (1, 16):
            qm = (pos[:, -n:], pos, seg[:, -n:], seg)
            truth = flash_attn_ref(q[:, -n:].double(), k.double(), v.double(), *qm)[0]
            plain = flash_attn_ref(q[:, -n:], k, v, *qm, upcast=False)[0]
            res[f"Sq={n}"] = compare(dict(out=flash_attn(q[:, -n:], k, v, *qm)), (truth,), (plain,), dt)
        res["ok"] = all(r["ok"] for r in res.values())
        cases[f"decode, Sk={S}"] = res
        del q, k, v, dout
        _free()
    entry["ok"] = all(c.get("ok", False) for c in cases.values() if "status" not in c)
    if not entry["ok"]:
        entry["status"] = "fail"


def count_syncs(fn) -> dict:
    """Host syncs of fn() as torch's sync debug mode reports them (warn mode, warnings counted),
    then once more in error mode (the first sync raises)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # the notice that sync debug mode is a prototype is a warning too; it is not a sync
    syncs = [str(w.message) for w in caught
             if "synchroniz" in str(w.message).lower() and "prototype feature" not in str(w.message)]
    res = dict(syncs=len(syncs), first=[m[:200] for m in syncs[:2]])
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        res["error_mode"] = "passed"
    except RuntimeError as e:
        res["error_mode"] = f"raised: {str(e)[:200]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return res


def part_syncs(budget, entry, args):
    if DRY:
        entry.update(status="skipped", reason="needs CUDA (torch.cuda.set_sync_debug_mode); on CPU the test suite "
                     "runs the same calls under tests/sync_guard.py, which fails on any tensor-to-Python conversion")
        return
    from longvideo.model import ModelConfig, Transformer, token_weights
    from longvideo.parallel import apply_activation_checkpointing
    from longvideo.parallel.ring import backward_step, forward_step

    dt = torch.bfloat16
    q, k, v, dout, meta = make_inputs(1, 4096, 32, 8, 128, dt, seed=5, docs=3, pad=64)
    qp, kp, qs, ks = meta
    be = get_backend("triton", DEV)
    scale = 1 / math.sqrt(128)
    kept = AttentionPlan()
    qg = q.clone().requires_grad_(True)

    def with_plan():
        flash_attn(qg, k, v, *meta, plan=kept).backward(dout)

    def without_plan():
        flash_attn(qg, k, v, *meta).backward(dout)

    def decode():
        flash_attn(q[:, -4:], k, v, qp[:, -4:], kp, qs[:, -4:], ks)

    plans = RingPlans()
    out = torch.zeros(q.shape, dtype=torch.float32, device=DEV)
    lse = torch.full((1, 32, 4096), float("-inf"), device=DEV)

    def ring_steps():
        out.zero_()
        lse.fill_(float("-inf"))
        for i, kpos in enumerate((kp, kp + 100000)):  # a visible block, then one entirely in the future
            forward_step(be, q, k, v, qp, kpos, qs, ks, True, scale, plans.step(i), out, lse)
        for i, kpos in enumerate((kp, kp + 100000)):
            backward_step(be, dout, q, k, v, out, lse, qp, kpos, qs, ks, True, scale, plans.step(i))

    cfg = ModelConfig(text_vocab_size=1000, codebook_size=64, dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_dim=512)
    model = Transformer(cfg, ffn_chunk=4096, backend="triton").to(DEV, dt).train()
    apply_activation_checkpointing(model)
    ids = torch.randint(0, 1000, (1, 4096), device=DEV)

    def model_step():
        loss = model(ids, qp, qs, targets=ids)
        (loss / token_weights(ids).sum()).backward()

    calls = {"flash_attn fwd+bwd, plan kept": with_plan, "flash_attn fwd+bwd, plans built in the call": without_plan,
             "decode forward (Sq = 4)": decode, "ring steps, triton (a visible and an empty block)": ring_steps,
             "model step (2 layers, whole step incl. non-attention code)": model_step}
    res = entry.setdefault("calls", {})
    for name, fn in calls.items():
        if not budget.ok(5):
            res[name] = dict(status="skipped: out of time")
            continue
        try:
            fn()  # compile and warm up first: Triton's first launch is not what is measured
            res[name] = count_syncs(fn)
        except Exception as e:  # noqa: BLE001
            res[name] = dict(error=repr(e)[:300])
        print(f"  syncs {name}: {res[name]}", flush=True)
    attn = [r for n, r in res.items() if not n.startswith("model")]
    entry["attention_syncs"] = sum(r.get("syncs", 0) for r in attn) if all("syncs" in r for r in attn) else None
    if entry["attention_syncs"] != 0:
        entry["status"] = "fail"


def part_determinism(budget, entry, args):
    S, H, Hkv, D = (48, 4, 2, 32) if DRY else (4096, 32, 8, 128)
    q, k, v, dout, meta = make_inputs(1, S, H, Hkv, D, torch.bfloat16, seed=6, docs=3, pad=S // 64)
    plan = AttentionPlan()
    with torch.no_grad():
        a, b = flash_attn(q, k, v, *meta, plan=plan), flash_attn(q, k, v, *meta, plan=plan)
    entry["forward_bitwise_equal"] = bool(torch.equal(a, b))
    for variant in ("fused", "split"):
        tk.set_backward(variant)
        try:
            r1, r2 = ours(q, k, v, dout, meta, plan=plan), ours(q, k, v, dout, meta, plan=plan)
        finally:
            tk.set_backward(None)
        entry[f"backward_{variant}"] = {n: dict(bitwise_equal=bool(torch.equal(r1[n], r2[n])),
                                                max_abs_diff=_err(r1[n], r2[n])) for n in ("dq", "dk", "dv")}
    if not entry["forward_bitwise_equal"] or not all(x["bitwise_equal"] for x in entry["backward_split"].values()):
        entry["status"] = "fail"


def _time(fn, warmup=2, reps=5) -> float:
    return time_cuda(fn, 0 if DRY else warmup, 1 if DRY else reps)


def part_speed(budget, entry, args):
    from torch.nn.attention import SDPBackend

    seqlens = (64,) if DRY else (4096, 8192, 16384)
    tokens = 64 if DRY else 16384
    H, Hkv, D = (4, 2, 32) if DRY else (32, 8, 128)
    dt = torch.bfloat16
    peak = None if DRY else device_peak(torch.cuda.get_device_name(DEV))
    rows = entry.setdefault("rows", [])
    for S in seqlens:
        if not budget.ok(15):
            rows.append(dict(seqlen=S, status="skipped: out of time"))
            continue
        B = max(1, tokens // S)
        row = dict(seqlen=S, batch=B, heads=H, kv_heads=Hkv, head_dim=D)
        rows.append(row)
        fwd_flops = attention_flops(B, H, S, D, True)
        q, k, v, dout, meta = make_inputs(B, S, H, Hkv, D, dt, seed=7)
        q.requires_grad_(True)
        k.requires_grad_(True)
        v.requires_grad_(True)
        plan = AttentionPlan()

        def ours_fwd():
            with torch.no_grad():
                flash_attn(q, k, v, *meta, plan=plan)

        def ours_fwdbwd():
            q.grad = k.grad = v.grad = None
            flash_attn(q, k, v, *meta, plan=plan).backward(dout)

        qt, kt, vt, dtt = (x.transpose(1, 2) for x in (q, k, v, dout))
        timed = [("ours_fwd", ours_fwd, fwd_flops)]
        for variant in ("fused", "split"):
            def fb(variant=variant):
                tk.set_backward(variant)
                try:
                    ours_fwdbwd()
                finally:
                    tk.set_backward(None)
            timed.append((f"ours_fwdbwd_{variant}", fb, 3.5 * fwd_flops))
        for label, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            call = _sdpa_call(backend, None, "native", H // Hkv)
            try:
                with torch.no_grad():
                    call(qt[:, :, :256], kt[:, :, :256], vt[:, :, :256])
            except Exception:  # noqa: BLE001 - no native GQA here: repeat K/V in the call
                call = _sdpa_call(backend, None, "expanded", H // Hkv)
                row[f"{label}_gqa"] = "expanded"

            def s_fwd(call=call):
                with torch.no_grad():
                    call(qt, kt, vt)

            def s_fwdbwd(call=call):
                q.grad = k.grad = v.grad = None
                call(qt, kt, vt).backward(dtt)

            timed += [(f"{label}_fwd", s_fwd, fwd_flops), (f"{label}_fwdbwd", s_fwdbwd, 3.5 * fwd_flops)]
        for name, fn, flops in timed:
            if not budget.ok(5):
                row[name + "_error"] = "skipped: out of time"
                continue
            try:
                sec = _time(fn)
                row[name + "_ms"] = sec * 1e3
                row[name + "_tflops"] = flops / sec / 1e12
                if peak:
                    row[name + "_frac_peak"] = row[name + "_tflops"] / peak
            except Exception as e:  # noqa: BLE001
                row[name + "_error"] = repr(e)[:300]
        best = max((row.get(f"ours_fwdbwd_{v}_tflops") or 0) for v in ("fused", "split"))
        if row.get("sdpa_flash_fwdbwd_tflops") and best:
            row["ratio_fwdbwd_vs_flash"] = best / row["sdpa_flash_fwdbwd_tflops"]
        if row.get("sdpa_flash_fwd_tflops") and row.get("ours_fwd_tflops"):
            row["ratio_fwd_vs_flash"] = row["ours_fwd_tflops"] / row["sdpa_flash_fwd_tflops"]
        print(f"  speed S={S}: " + ", ".join(f"{k_[:-7]} {v_:.0f}" for k_, v_ in row.items() if k_.endswith("_tflops"))
              + " TFLOP/s", flush=True)
        del q, k, v, dout, qt, kt, vt, dtt
        _free()
    ratios = [r["ratio_fwdbwd_vs_flash"] for r in rows if "ratio_fwdbwd_vs_flash" in r]
    entry["min_ratio_fwdbwd_vs_flash"] = min(ratios) if ratios else None
    # the tile plans' build time on this device (forward + fused backward plans, causal, one document)
    plans = entry.setdefault("plan_build", [])
    for S in ((4096, 16384) if DRY else (65536, 262144, 1048576)):
        if not budget.ok(3):
            break
        pos = torch.arange(S, device=DEV)[None]
        seg = torch.zeros(1, S, dtype=torch.long, device=DEV)
        cfg = tk.tile_config(128, dt)

        def build():
            tk.build_plan(pos, pos, seg, seg, True, cfg.fwd.block_m, cfg.fwd.block_n)
            tk.build_plan(pos, pos, seg, seg, True, cfg.bwd.block_m, cfg.bwd.block_n, transpose=True)

        plans.append(dict(seqlen=S, ms=_time(build, 2, 5) * 1e3))
    if entry["min_ratio_fwdbwd_vs_flash"] is None and not DRY:
        entry["status"] = "fail"


def _step_stats(step, S: int, budget, steps: int = 2) -> dict:
    """Time and peak memory of `steps` training steps at length S (the first one warms up and is
    timed apart); peak memory includes the model and its optimizer state."""
    _free()
    t_first = time.perf_counter()
    step()
    _sync()
    t_first = time.perf_counter() - t_first
    times = []
    for _ in range(steps - 1):
        if not budget.ok(3 * t_first + 5):
            break
        t0 = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - t0)
    sec = min(times) if times else t_first
    peak = None if DRY else torch.cuda.max_memory_allocated() / 2**30
    return dict(seqlen=S, step_s=sec, first_step_s=t_first, tokens_per_s=S / sec, peak_gib=peak,
                timed_steps=len(times))


def our_step(model, S: int, opt=None):
    """One training step of our model on S random tokens (one document): forward, backward, and
    the optimizer's step when one is given (else the gradients are dropped)."""
    ids = torch.randint(0, model.cfg.vocab_size, (1, S), device=DEV)
    pos = torch.arange(S, device=DEV)[None]
    seg = torch.zeros(1, S, dtype=torch.long, device=DEV)

    def step():
        loss = model(ids, pos, seg, targets=ids)
        (loss / ids.numel()).backward()
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)
    return step


def hf_llama(mcfg, max_len: int, checkpointing: bool):
    """transformers' Llama of the same shape as our model config, bf16, SDPA attention, on the device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hcfg = LlamaConfig(vocab_size=mcfg.vocab_size, hidden_size=mcfg.dim, intermediate_size=mcfg.ffn_dim,
                       num_hidden_layers=mcfg.n_layers, num_attention_heads=mcfg.n_heads,
                       num_key_value_heads=mcfg.n_kv_heads, max_position_embeddings=max_len,
                       rms_norm_eps=mcfg.norm_eps, rope_theta=mcfg.rope_theta,
                       tie_word_embeddings=mcfg.tie_embeddings, use_cache=False)
    with torch.device(DEV):
        model = LlamaForCausalLM._from_config(hcfg, attn_implementation="sdpa", dtype=torch.bfloat16).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def part_train(budget, entry, args):
    from dataclasses import replace

    from longvideo.config import load_config
    from longvideo.model import Transformer
    from longvideo.parallel import apply_activation_checkpointing

    root = load_config(ROOT / "configs" / "smol-135m.yaml")
    mcfg, rt = root.model, root.runtime
    if DRY:
        mcfg = replace(mcfg, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, text_vocab_size=500,
                       codebook_size=64)
        seqlens = (32, 64)
    else:
        seqlens = (16384, 32768, 65536)
    mcfg = replace(mcfg, max_seq_len=max(seqlens))
    dt = torch.bfloat16
    peak = None if DRY else device_peak(torch.cuda.get_device_name(DEV))
    entry["model"] = dict(config="configs/smol-135m.yaml" + (" (shrunk for the dry run)" if DRY else ""),
                          dim=mcfg.dim, layers=mcfg.n_layers, heads=mcfg.n_heads, kv_heads=mcfg.n_kv_heads,
                          head_dim=mcfg.head_dim, vocab=mcfg.vocab_size, params=mcfg.num_params(),
                          activation_checkpointing=rt.activation_checkpointing, dtype="bfloat16",
                          optimizer="AdamW")

    def ours():
        with torch.device(DEV):  # initialised on the device: no CPU init of 139M parameters
            model = Transformer(mcfg, ffn_chunk=rt.ffn_chunk, loss_chunk=rt.loss_chunk, backend="triton").to(dt).train()
        if rt.activation_checkpointing:
            apply_activation_checkpointing(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=not DRY)

        return (lambda S: our_step(model, S, opt)), (model, opt)

    def hf(checkpointing):
        def build():
            model = hf_llama(mcfg, max(seqlens), checkpointing)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=not DRY)

            def make(S):
                ids = torch.randint(0, mcfg.vocab_size, (1, S), device=DEV)

                def step():
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                return step
            return make, (model, opt)
        return build

    systems = entry.setdefault("systems", {})
    for name, build in (("ours (triton, checkpointing)", ours), ("transformers sdpa", hf(False)),
                        ("transformers sdpa + gradient checkpointing", hf(True))):
        rows = systems.setdefault(name, [])
        if not budget.ok(15):
            rows.append(dict(status="skipped: out of time"))
            continue
        try:
            make, held = build()
        except Exception as e:  # noqa: BLE001
            rows.append(dict(error=f"building the model: {e!r}"[:300]))
            continue
        for S in seqlens:
            if not budget.ok(10):
                rows.append(dict(seqlen=S, status="skipped: out of time"))
                continue
            try:
                r = _step_stats(make(S), S, budget, steps=1 if DRY else 2)
                r["mfu"] = mcfg.flops_per_token(S) * r["tokens_per_s"] / (peak * 1e12) if peak else None
            except Exception as e:  # noqa: BLE001 - OOM is a result here
                r = dict(seqlen=S, error=repr(e)[:300], oom="out of memory" in repr(e).lower())
            _free()
            rows.append(r)
            print(f"  train {name} S={S}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                        for k, v in r.items()), flush=True)
            if r.get("oom"):
                break  # longer ones will not fit either
        del make, held
        _free()
    # the longest context: peak memory is a + b S for all three (flash attention, chunked loss in ours)
    if not DRY:
        budget_gib = torch.cuda.get_device_properties(DEV).total_memory / 2**30 * 0.95
        fits = {}
        for name, rows in systems.items():
            pts = [(r["seqlen"], r["peak_gib"]) for r in rows if r.get("peak_gib")]
            if len(pts) >= 2:
                (s0, m0), (s1, m1) = pts[0], pts[-1]
                b = (m1 - m0) / (s1 - s0)
                fits[name] = dict(gib_per_1k_tokens=b * 1024, fixed_gib=m0 - b * s0,
                                  longest_context=int((budget_gib - (m0 - b * s0)) / b) if b > 0 else None,
                                  budget_gib=budget_gib, from_points=pts)
        entry["longest_context_fit"] = fits
        ours_fit = fits.get("ours (triton, checkpointing)", {}).get("longest_context")
        hf_fit = fits.get("transformers sdpa", {}).get("longest_context")
        entry["context_ratio_vs_transformers_sdpa"] = ours_fit / hf_fit if ours_fit and hf_fit else None


def _profile_step(step, rows: int = 20) -> dict:
    """One profiled call of step() (after a warm-up call): wall time, the summed time of the device
    kernels (wall minus that is time the GPU waited for the host), the ops with the most device
    time and the ops with the most host time."""
    from torch.profiler import ProfilerActivity, profile

    step()
    _sync()
    acts = [ProfilerActivity.CPU] + ([] if DRY else [ProfilerActivity.CUDA])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        _sync()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    dev = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"

    def top(key, n):
        ranked = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:n]
        return [dict(op=e.key[:120], calls=e.count, device_ms=getattr(e, dev, 0) / 1e3,
                     host_self_ms=e.self_cpu_time_total / 1e3) for e in ranked]
    kernels_ms = sum(getattr(e, dev, 0) for e in events) / 1e3
    return dict(wall_ms=wall * 1e3, device_kernels_ms=kernels_ms, launches=sum(e.count for e in events
                                                                                if getattr(e, dev, 0) > 0),
                top_device=top(dev, rows), top_host=top("self_cpu_time_total", rows // 2))


def _print_profile(name: str, r: dict) -> None:
    print(f"  profile {name}: wall {r.get('wall_ms', 0):.0f} ms, kernels {r.get('device_kernels_ms', 0):.0f} ms"
          + "".join(f"\n      {t['device_ms']:8.1f} ms {t['calls']:5d}x {t['op'][:90]}" for t in r.get("top_device", [])[:12]),
          flush=True)


def part_profile(budget, entry, args):
    """Where one training step of the 135M shape spends its time, ours beside transformers + SDPA
    with gradient checkpointing (the nearest like-for-like system), at 16K tokens."""
    from dataclasses import replace

    from longvideo.config import load_config
    from longvideo.model import Transformer
    from longvideo.parallel import apply_activation_checkpointing

    root = load_config(ROOT / "configs" / "smol-135m.yaml")
    mcfg, rt = root.model, root.runtime
    S = 16384
    if DRY:
        mcfg = replace(mcfg, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, text_vocab_size=500,
                       codebook_size=64)
        S = 64
    dt = torch.bfloat16
    variants = {"ours (triton, checkpointing)": dict(ffn_chunk=rt.ffn_chunk),
                "ours, feed-forward in 4096-token chunks": dict(ffn_chunk=4096)}
    for name, over in variants.items():
        if not budget.ok(15):
            entry[name] = dict(status="skipped: out of time")
            continue
        try:
            with torch.device(DEV):
                model = Transformer(replace(mcfg, max_seq_len=S), loss_chunk=rt.loss_chunk, backend="triton",
                                    **over).to(dt).train()
                apply_activation_checkpointing(model)
            entry[name] = _profile_step(our_step(model, S))
        except Exception as e:  # noqa: BLE001
            entry[name] = dict(error=repr(e)[:300])
        model = None
        _free()
        _print_profile(name, entry[name])
    if budget.ok(15):
        try:
            hf = hf_llama(mcfg, S, checkpointing=True)
            ids = torch.randint(0, mcfg.vocab_size, (1, S), device=DEV)

            def hf_step():
                hf(input_ids=ids, labels=ids).loss.backward()
                hf.zero_grad(set_to_none=True)
            entry["transformers sdpa + gradient checkpointing"] = _profile_step(hf_step)
        except Exception as e:  # noqa: BLE001
            entry["transformers sdpa + gradient checkpointing"] = dict(error=repr(e)[:300])
        _print_profile("transformers sdpa + gradient checkpointing", entry["transformers sdpa + gradient checkpointing"])


def part_tune(budget, entry, args):
    """Time candidate launch shapes for the head dims the model and the speed target use."""
    import dataclasses

    S, H, Hkv = (64, 4, 2) if DRY else (8192, 32, 8)
    dt = torch.bfloat16
    cands = {"fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3)],
             "bwd": [(32, 128, 8, 3), (16, 128, 8, 2), (64, 64, 8, 2), (32, 64, 4, 3), (64, 128, 8, 2)]}
    if DRY:
        cands = {"fwd": [(16, 16, 4, 1)], "bwd": [(16, 16, 4, 1)]}
    chosen, timings = {}, []
    for D in ((32,) if DRY else (128, 64)):
        if not budget.ok(20):
            break
        pad = tk.head_dim_pad(D)
        base = tk.DEFAULT_TABLE[(pad, "16bit")]
        q, k, v, dout, meta = make_inputs(1, S, H, Hkv, D, dt, seed=8)
        q.requires_grad_(True)
        best = {}
        for what in ("fwd", "bwd"):
            for c in cands[what]:
                for variant, per_head in ((("fused", True), ("fused", False), ("split", False)) if what == "bwd"
                                          else (("fused", True),)):
                    if not budget.ok(8):
                        break
                    lc = tk.LaunchConfig(*c)
                    cfg = dataclasses.replace(base, **{what: lc}, variant=variant, per_head=per_head)
                    tk.set_tile_table({(pad, "16bit"): cfg})
                    if DRY:  # the interpreter ignores the table: exercise the code, time nothing real
                        pass
                    plan = AttentionPlan()
                    if what == "fwd":
                        def fn():
                            with torch.no_grad():
                                flash_attn(q, k, v, *meta, plan=plan)
                    else:
                        def fn():
                            q.grad = None
                            flash_attn(q, k, v, *meta, plan=plan).backward(dout)
                    try:
                        sec = _time(fn, 1, 3)
                        timings.append(dict(head_dim=D, part=what, config=c, variant=variant, per_head=per_head,
                                            ms=sec * 1e3))
                        if what not in best or sec < best[what][0]:
                            best[what] = (sec, lc, variant, per_head)
                    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory at this shape
                        timings.append(dict(head_dim=D, part=what, config=c, variant=variant, error=repr(e)[:200]))
        tk.set_tile_table(None)
        if "fwd" in best and "bwd" in best:
            chosen[(pad, "16bit")] = dataclasses.replace(base, fwd=best["fwd"][1], bwd=best["bwd"][1],
                                                         variant=best["bwd"][2], per_head=best["bwd"][3])
        del q, k, v, dout
        _free()
    entry["timings"] = timings
    entry["table"] = tk.table_to_json(chosen)
    if chosen and not DRY:
        out = BENCH / "gpu_tune.json"
        out.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(DEV), seqlen=S, heads=[H, Hkv],
                                       table=tk.table_to_json(chosen), timings=timings), indent=1) + "\n")
        entry["written"] = str(out.relative_to(ROOT))
        tk.set_tile_table(chosen)  # later parts of this run use it
    elif DRY:
        entry["note"] = "dry run: the interpreter uses its own 16-wide tiles; nothing was written"


FUNCS = {"env": part_env, "correctness": part_correctness, "syncs": part_syncs, "determinism": part_determinism,
         "speed": part_speed, "train": part_train, "profile": part_profile, "tune": part_tune}


# ----------------------------------------------------------------------------- report


def targets(report: dict) -> list[list[str]]:
    p = report["parts"]
    if report.get("mode") != "gpu":
        return [[what, goal, "dry run: no GPU figure", "n/a"] for what, goal in TARGETS.items()]
    rows = []
    r = p.get("speed", {}).get("min_ratio_fwdbwd_vs_flash")
    rows.append(["fwd+bwd vs SDPA-flash (S >= 4K, bf16, D = 128)", ">= 0.9x",
                 f"{r:.2f}x (worst length, best variant)" if r else "not measured", _met(r, lambda x: x >= 0.9)])
    s = p.get("syncs", {}).get("attention_syncs")
    rows.append(["host syncs per attention call", "0", "not measured" if s is None else str(s),
                 _met(s, lambda x: x == 0)])
    step = next((x for x in p.get("train", {}).get("systems", {}).get("ours (triton, checkpointing)", [])
                 if x.get("seqlen") == 65536 and x.get("step_s")), None)
    build = next((x for x in p.get("speed", {}).get("plan_build", []) if x.get("seqlen") == 65536), None)
    frac = build["ms"] / 1e3 / step["step_s"] if step and build else None
    rows.append(["plan build / training step at 64K", "<= 2 %", f"{100 * frac:.3f} %" if frac is not None
                 else "not measured", _met(frac, lambda x: x <= 0.02)])
    c = p.get("train", {}).get("context_ratio_vs_transformers_sdpa")
    rows.append(["135M-shape context vs transformers + SDPA", ">= 8x", f"{c:.1f}x (fit)" if c else "not measured",
                 _met(c, lambda x: x >= 8)])
    return rows


def _met(x, ok) -> str:
    if x is None:
        return "unknown"
    return "yes" if ok(x) else "**no**"


def _f(x, fmt=".1f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(report: dict) -> str:
    p = report["parts"]
    env = p.get("env", {})
    lines = [MD_BEGIN, '<a id="gpu-check"></a>', "## GPU check (`make gpu-check`, `scripts/gpu_check.py`)", "",
             f"GPU: **{env.get('gpu')}** (capability {env.get('capability')}, {env.get('sms')} SMs, "
             f"{_f(env.get('memory_gib'))} GiB); torch {env.get('torch')}, Triton {env.get('triton')}, "
             f"transformers {env.get('transformers')}. Run {report['finished']}, {report['wall_s']:.0f} s.", "",
             "| part | status | seconds |", "|---|---|---|"]
    for name, e in p.items():
        lines.append(f"| {name} | {e.get('status')} | {_f(e.get('seconds'), '.0f')} |")
    lines += ["", "| target | goal | measured | met |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in targets(report)]
    corr = p.get("correctness", {}).get("cases", {})
    if corr:
        lines += ["", "Correctness (error / allowed bound, bound = 2 x same-dtype error + eps; < 1 passes):", "",
                  "| case | variant | out | dq | dk | dv | ok |", "|---|---|---|---|---|---|---|"]
        for case, res in corr.items():
            for variant, r in res.items():
                if isinstance(r, dict) and "ok" in r:
                    cells = [_f((r.get(n) or {}).get("ratio"), ".2f") for n in ("out", "dq", "dk", "dv")]
                    lines.append(f"| {case} | {variant} | " + " | ".join(cells) + f" | {'yes' if r['ok'] else '**no**'} |")
    sy = p.get("syncs", {}).get("calls", {})
    if sy:
        lines += ["", "| call (sync debug mode) | host syncs | error mode |", "|---|---|---|"]
        lines += [f"| {n} | {r.get('syncs', r.get('error', r.get('status')))} | {r.get('error_mode', '-')} |"
                  for n, r in sy.items()]
    det = p.get("determinism", {})
    if "forward_bitwise_equal" in det:
        bw = {v: all(x["bitwise_equal"] for x in det.get(f"backward_{v}", {}).values()) for v in ("fused", "split")}
        lines += ["", f"Determinism: forward bitwise equal over two runs: {det['forward_bitwise_equal']}; backward "
                  f"bitwise equal: fused (dQ atomics) {bw['fused']}, split {bw['split']}."]
    rows = p.get("speed", {}).get("rows", [])
    if rows:
        lines += ["", "TFLOP/s (causal, bf16, D = 128, GQA 32/8; FLOPs of the visible half; fwd+bwd = 3.5 x fwd):", "",
                  "| S | batch | ours fwd | flash fwd | cuDNN fwd | ours fwd+bwd fused | ours fwd+bwd split | "
                  "flash fwd+bwd | cuDNN fwd+bwd | best / flash fwd+bwd |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            cells = [_f(r.get(k + "_tflops")) for k in ("ours_fwd", "sdpa_flash_fwd", "sdpa_cudnn_fwd",
                                                         "ours_fwdbwd_fused", "ours_fwdbwd_split", "sdpa_flash_fwdbwd",
                                                         "sdpa_cudnn_fwdbwd")]
            lines.append(f"| {r['seqlen']:,} | {r.get('batch', '-')} | " + " | ".join(cells)
                         + f" | {_f(r.get('ratio_fwdbwd_vs_flash'), '.2f')} |")
        pb = p["speed"].get("plan_build", [])
        if pb:
            lines += ["", "Plan build on the GPU (forward + backward plans, causal): "
                      + ", ".join(f"{x['seqlen']:,} tokens {x['ms']:.2f} ms" for x in pb) + "."]
    tr = p.get("train", {}).get("systems", {})
    if tr:
        lines += ["", "Training step, smol-135m shape, bf16, AdamW:", "",
                  "| system | S | tokens/s | MFU | peak GiB |", "|---|---|---|---|---|"]
        for name, rs in tr.items():
            for r in rs:
                if "seqlen" not in r:
                    lines.append(f"| {name} | - | {r.get('status') or r.get('error', '')[:80]} | | |")
                    continue
                lines.append(f"| {name} | {r['seqlen']:,} | {_f(r.get('tokens_per_s'), ',.0f')} | "
                             f"{_f(r.get('mfu') and 100 * r['mfu'], '.0f')} % | {_f(r.get('peak_gib'))} |"
                             if "error" not in r and "status" not in r else
                             f"| {name} | {r['seqlen']:,} | {r.get('status') or r.get('error', '')[:80]} | | |")
        for name, fit in p["train"].get("longest_context_fit", {}).items():
            lines.append(f"\nLongest context, {name}: {fit['longest_context']:,} tokens "
                         f"({fit['gib_per_1k_tokens']:.3f} GiB per 1K tokens over {fit['fixed_gib']:.1f} GiB, "
                         f"fit to {len(fit['from_points'])} points, budget {fit['budget_gib']:.0f} GiB)."
                         if fit.get("longest_context") else f"\nLongest context, {name}: no fit.")
    prof = {n: r for n, r in p.get("profile", {}).items() if isinstance(r, dict) and "wall_ms" in r}
    if prof:
        lines += ["", "One profiled training step (forward + backward, no optimizer), smol-135m shape, 16K tokens "
                  "(the profiler slows host-bound code: compare rows with each other, not with the table above):", "",
                  "| system | wall ms | launches | top device ops (ms) |", "|---|---|---|---|"]
        for name, r in prof.items():
            ops = "; ".join(f"{t['op'][:40]} {t['device_ms']:.0f}" for t in r["top_device"][:4])
            lines.append(f"| {name} | {r['wall_ms']:.0f} | {r['launches']:,} | {ops} |")
    tune = p.get("tune", {}).get("table")
    if tune:
        lines += ["", "Tuned launch shapes (`--tune`, fastest of the candidates; the kernels use them by default):", "",
                  "| head dim | fwd | bwd | variant |", "|---|---|---|---|"]
        for r in tune:
            lines.append(f"| {r['head_dim_pad']} | {r['fwd']['block_m']}x{r['fwd']['block_n']} w{r['fwd']['num_warps']} "
                         f"s{r['fwd']['num_stages']} | {r['bwd']['block_m']}x{r['bwd']['block_n']} "
                         f"w{r['bwd']['num_warps']} s{r['bwd']['num_stages']} | {r['variant']}"
                         f"{' (per query head)' if r['per_head'] else ''} |")
    if report.get("note"):
        lines += ["", report["note"]]
    lines += ["", "Data: [bench/gpu_check.json](bench/gpu_check.json).", MD_END]
    return "\n".join(lines) + "\n"


def write_markdown(report: dict, path: Path) -> None:
    text = path.read_text() if path.exists() else ""
    section = markdown(report)
    if MD_BEGIN in text and MD_END in text:
        head, rest = text.split(MD_BEGIN, 1)
        text = head + section.rstrip("\n") + rest.split(MD_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=None, help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--tune", action="store_true", help="run the tuning part (then speed with its table)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes under the interpreter even with CUDA")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default docs/bench/gpu_check.json)")
    p.add_argument("--md", type=Path, default=None, help="markdown to update (default docs/benchmarks.md on a GPU; "
                   "none in a dry run)")
    args = p.parse_args(argv)
    start = time.monotonic()
    parts = ["env"] + [x for x in (args.parts.split(",") if args.parts else
                                   (["tune", "speed"] if args.tune else list(PARTS[1:]))) if x != "env"]
    unknown = [x for x in parts if x not in FUNCS]
    if unknown:
        p.error(f"unknown parts {unknown}; choose from {', '.join(FUNCS)}")
    out = args.out
    if out is None:
        out = BENCH / "gpu_check.json"
        if DRY and out.exists():
            try:
                if json.loads(out.read_text()).get("mode") == "gpu":
                    out = BENCH / "gpu_check_dry.json"  # never overwrite a GPU run with a dry run
            except ValueError:
                pass
    md = args.md if args.md is not None else (None if DRY else ROOT / "docs" / "benchmarks.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    report = dict(check="scripts/gpu_check.py", mode="dry-run" if DRY else "gpu", argv=sys.argv[1:],
                  budget_s=args.budget, started=time.strftime("%Y-%m-%d %H:%M:%S"), parts={})
    if DRY:
        report["skipped"] = ("no CUDA device" if not torch.cuda.is_available() else "--dry-run") + \
            ": every part ran on tiny shapes under TRITON_INTERPRET=1 (figures are not GPU figures); GPU-only parts " \
            "say so in their entries"

    def write():
        report["wall_s"] = time.monotonic() - start
        report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        out.write_text(json.dumps(report, indent=1, default=str) + "\n")

    def on_alarm(signum, frame):
        raise PartTimeout("the part ran past its budget")

    signal.signal(signal.SIGALRM, on_alarm)
    for name in parts:
        entry = report["parts"][name] = dict(status="running")
        left = args.budget - (time.monotonic() - start)
        budget = Budget(min(BUDGETS.get(name, 30), left))
        if budget.left() < 5:
            entry.update(status="skipped", reason="the run's time budget is spent")
            write()
            continue
        print(f"[{time.monotonic() - start:5.0f} s] {name} (budget {budget.left():.0f} s)", flush=True)
        t0 = time.monotonic()
        try:
            signal.alarm(max(1, int(budget.left() + 20)))  # a hard stop 20 s past the budget
            FUNCS[name](budget, entry, args)
            if entry["status"] == "running":
                entry["status"] = "ok"
        except PartTimeout as e:
            entry.update(status="timeout", error=str(e))
        except Exception as e:  # noqa: BLE001 - the next part still runs
            entry.update(status="error", error=repr(e)[:1000], traceback=traceback.format_exc()[-3000:])
        finally:
            signal.alarm(0)
            tk.set_backward(None)
            entry["seconds"] = time.monotonic() - t0
        print(f"  -> {entry['status']} ({entry['seconds']:.0f} s)" + (f": {entry.get('error')}" if "error" in entry
                                                                        else ""), flush=True)
        try:
            _free()
        except Exception:  # noqa: BLE001 - a broken CUDA context: later parts record their own errors
            pass
        write()
    write()
    report["targets"] = [dict(zip(("target", "goal", "measured", "met"), r)) for r in targets(report)]
    write()
    if md is not None:
        write_markdown(report, md)
        print(f"updated {md}")
    print(f"wrote {out}")
    for r in targets(report):
        print(f"  {r[0]}: {r[2]} (goal {r[1]}, met: {r[3]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
