"""One prepared GPU check of the attention kernels, the dispatch and a training step (`make gpu-check`).

    python scripts/gpu_check.py                 # on a CUDA machine: every part, at most --budget s (480)
    python scripts/gpu_check.py --parts speed   # some parts only (env always runs)
    python scripts/gpu_check.py --tune          # time candidate tile shapes, write docs/bench/gpu_tune.json
    python scripts/gpu_check.py --dry-run       # what runs without CUDA: the interpreter, tiny shapes

Parts (docs/kernels.md, "The GPU check", says what each measures): env, correctness, syncs,
determinism, speed, ring, train, context, profile; tune with --tune. Each runs in its own try with
its own time budget and a hard stop 20 s past it; the JSON (docs/bench/gpu_check.json) is rewritten
after every part, and on a GPU the check's section of docs/benchmarks.md is replaced. Without CUDA
(or with --dry-run) the same code runs on tiny shapes under TRITON_INTERPRET=1, claims no figure,
writes docs/bench/gpu_check_dry.json when gpu_check.json holds a GPU run, and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402 - the interpreter must be chosen before anything imports triton

DRY = "--dry-run" in sys.argv or not torch.cuda.is_available()
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

from bench_kernels import IMPLS, bench_case, compare_packed, device_peak, time_fn  # noqa: E402
from longvideo.kernels import AttentionPlan, block_attention, flash_attn_ref, get_backend, lse_merge_  # noqa: E402
from longvideo.kernels import _flash_attn_triton as tk  # noqa: E402
from longvideo.kernels.dispatch import DispatchBackend  # noqa: E402

BENCH = ROOT / "docs" / "bench"
MD_BEGIN, MD_END = "<!-- gpu-check:begin (written by scripts/gpu_check.py) -->", "<!-- gpu-check:end -->"
DEV, BF16 = torch.device("cpu" if DRY else "cuda"), torch.bfloat16
PARTS = ("env", "correctness", "syncs", "speed", "ring", "train", "context", "profile")
BUDGETS = dict(correctness=90, syncs=25, speed=100, ring=30, train=110, context=70, profile=40, tune=300)
LINKS = {"NVLink (450 GB/s per direction)": 450e9, "InfiniBand NDR (50 GB/s)": 50e9}
OURS, HF, HF_CKPT = "ours (auto, checkpointing)", "transformers sdpa", "transformers sdpa + gradient checkpointing"


def TIME(fn, warm=1, reps=5) -> float:
    """Median milliseconds of fn (one untimed-warm-up-free call in a dry run)."""
    return 1e3 * statistics.median(time_fn(fn, 0 if DRY else warm, 1 if DRY else reps, not DRY))


class PartTimeout(Exception):
    pass


def _sync():
    return None if DRY else torch.cuda.synchronize()


def _free():
    gc.collect()
    if not DRY:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib():
    return None if DRY else torch.cuda.max_memory_allocated() / 2**30


def _oom(e: Exception) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


# ----------------------------------------------------------------------------- inputs, reference, routes


def make_inputs(B, S, Hq, Hkv, D, seed, docs=1, pad=0):
    """bf16 q, k, v, dout and metadata: `docs` documents of random lengths (positions restarting),
    then `pad` padding tokens (segment -1)."""
    g, n = torch.Generator().manual_seed(seed), S - pad
    cuts = torch.sort(torch.randperm(n - 1, generator=g)[:docs - 1] + 1).values if docs > 1 else torch.zeros(0).long()
    seg = torch.zeros(n, dtype=torch.long).index_fill_(0, cuts, 1).cumsum(0)
    pos = torch.arange(n) - torch.cat([torch.zeros(1, dtype=torch.long), cuts])[seg]
    pos = torch.cat([pos, torch.zeros(pad, dtype=torch.long)]).expand(B, S).contiguous().to(DEV)
    seg = torch.cat([seg, torch.full((pad,), -1, dtype=torch.long)]).expand(B, S).contiguous().to(DEV)
    q, k, v, dout = (torch.randn(B, S, h, D, generator=g).to(DEV, BF16) for h in (Hq, Hkv, Hkv, Hq))
    return q, k, v, dout, (pos, pos, seg, seg)


def reference(q, k, v, dout, meta, upcast: bool):
    """Attention and its gradients, materialised one kv-head group at a time, in float64 or bf16."""
    dt, G, parts = torch.float64 if upcast else q.dtype, q.shape[2] // k.shape[2], []
    for h in range(k.shape[2]):
        qq, kk, vv = (x.detach().to(dt).requires_grad_(True) for x in (q[:, :, h * G:(h + 1) * G], k[:, :, h:h + 1],
                                                                         v[:, :, h:h + 1]))
        out, _ = flash_attn_ref(qq, kk, vv, *meta, causal=True, upcast=False)
        out.backward(dout[:, :, h * G:(h + 1) * G].to(dt))
        parts.append((out.detach(), qq.grad, kk.grad, vv.grad))
    return [torch.cat(x, 2) for x in zip(*parts)]


def compare(got: dict, truth, plain) -> dict:
    """Per tensor: error / (2 x the same-dtype error + eps); passes below 1."""
    res = {}
    for name, t, p in zip(("out", "dq", "dk", "dv"), truth, plain):
        if name in got:
            err = (got[name].double() - t).abs().max().item()
            bound = 2 * (p.double() - t).abs().max().item() + 1e-3 * (1 + t.abs().max().item())
            res[name] = dict(err=err, ratio=err / bound, ok=bool(torch.isfinite(got[name]).all()) and err <= bound)
    return dict(res, ok=all(r["ok"] for r in res.values()))


def via_autograd(backend: str, bwd_variant: str | None = None):
    def run(q, k, v, dout, meta):
        tk.set_backward(bwd_variant)
        try:
            qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
            out = block_attention(qg, kg, vg, *meta, backend=backend)
            out.backward(dout)
            return dict(out=out.detach(), dq=qg.grad, dk=kg.grad, dv=vg.grad)
        finally:
            tk.set_backward(None)
    return run


def ring_steps(be, W: int):
    """All ranks' zigzag ring steps of W on this device: per rank the forward of every key block merged
    in fp32, then every block's backward from that global out/lse; the whole sequence reassembled."""
    from longvideo.parallel import zigzag_indices

    def run(q, k, v, dout, meta):
        (pos, _, seg, _), idx = meta, [zigzag_indices(q.shape[1], W, r).to(DEV) for r in range(W)]
        acc = {n: torch.zeros(x.shape, device=DEV) for n, x in (("out", q), ("dq", q), ("dk", k), ("dv", v))}
        for qi in idx:
            o = torch.zeros(q[:, qi].shape, device=DEV)
            lse = torch.full((q.shape[0], q.shape[2], len(qi)), float("-inf"), device=DEV)
            plans = [AttentionPlan() for _ in idx]
            meta_of = lambda ki: (pos[:, qi], pos[:, ki], seg[:, qi], seg[:, ki], q.shape[-1] ** -0.5, True)  # noqa: E731
            for ki, plan in zip(idx, plans):
                lse_merge_(o, lse, *be.forward(q[:, qi], k[:, ki], v[:, ki], *meta_of(ki), plan=plan))
            for ki, plan in zip(idx, plans):
                dq, dk, dv = be.backward(dout[:, qi], q[:, qi], k[:, ki], v[:, ki], o, lse, *meta_of(ki), plan=plan)
                acc["dq"][:, qi] += dq
                acc["dk"][:, ki] += dk
                acc["dv"][:, ki] += dv
            acc["out"][:, qi] = o
        return {n: t.to(BF16) for n, t in acc.items()}
    return run


# ----------------------------------------------------------------------------- parts


def part_env(ok, entry, args):
    import transformers
    import triton

    entry.update(mode="dry-run" if DRY else "gpu", torch=torch.__version__, triton=triton.__version__,
                 transformers=transformers.__version__, python=platform.python_version(), platform=platform.platform())
    if not DRY:
        p = torch.cuda.get_device_properties(DEV)
        entry.update(gpu=p.name, capability=list(torch.cuda.get_device_capability(DEV)), sms=p.multi_processor_count,
                     memory_gib=p.total_memory / 2**30, peak_bf16_tflops=device_peak(p.name),
                     cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)


def part_correctness(ok, entry, args):
    """Every route against float64: triton (both backward variants), auto (cuDNN first; SDPA flash
    alone), and zigzag ring steps of W = 2 and 4 with the global out/lse."""
    S, D, H, Hkv, S2 = (48, 32, 4, 2, 48) if DRY else (8192, 128, 32, 8, 4096)
    auto, flash = get_backend("auto", DEV), DispatchBackend(dense=("flash",))
    cases = entry.setdefault("cases", {})
    tri = {"triton split": via_autograd("triton", "split"), "triton fused": via_autograd("triton", "fused")}
    for name, inputs, runs in (
            (f"S={S} D={D} {H}/{Hkv}, one document", (1, S, H, Hkv, D, 1),
             {**tri, "auto": via_autograd("auto"), "ring W=2, auto": ring_steps(auto, 2),
              "ring W=2, SDPA flash": ring_steps(flash, 2)}),
            (f"S={S} D={D} {H}/{Hkv}, 7 packed documents + padding", (1, S, H, Hkv, D, 2, 7, S // 40),
             {**tri, "ring W=2, triton": ring_steps(get_backend("triton", DEV), 2), "ring W=2, auto": ring_steps(auto, 2)}),
            (f"S={S2} D=64 9/3 (the 135M shape)", (1, S2, 9, 3, 64, 3),
             {"triton split": tri["triton split"], "auto": via_autograd("auto"), "ring W=4, auto": ring_steps(auto, 4)}),
            (f"S={S2 // 2} D=80 8/2, packed + padding", (1, S2 // 2, 8, 2, 80, 4, 3, 8), {"auto": via_autograd("auto")})):
        if not ok(10):
            cases[name] = dict(status="skipped: out of time")
            continue
        t0, (q, k, v, dout, meta) = time.monotonic(), make_inputs(*inputs)
        truth, plain = reference(q, k, v, dout, meta, True), reference(q, k, v, dout, meta, False)
        auto.routes.clear()
        flash.routes.clear()
        res = {}
        for label, run in runs.items():
            try:
                res[label] = compare(run(q, k, v, dout, meta), truth, plain)
            except Exception as e:  # noqa: BLE001 - a route that fails is a finding
                res[label] = dict(ok=False, error=repr(e)[:300])
        cases[name] = dict(res, ok=all(r["ok"] for r in res.values()), seconds=time.monotonic() - t0,
                           routes={f"{a} -> {b}": n for (a, b), n in (auto.routes + flash.routes).items()})
        print(f"  correctness {name}: {'ok' if cases[name]['ok'] else 'FAIL'}", flush=True)
        del q, k, v, dout, truth, plain
        _free()
    q, k, v, _, (pos, _, seg, _) = make_inputs(1, S, H, Hkv, D, 5)  # decode: queries at the end of a long prompt
    res = {}
    for n in (1, 16):
        qm = (pos[:, -n:], pos, seg[:, -n:], seg)
        truth, plain = flash_attn_ref(q[:, -n:].double(), k.double(), v.double(), *qm)[0], \
            flash_attn_ref(q[:, -n:], k, v, *qm, upcast=False)[0]
        res[f"Sq={n}"] = compare(dict(out=block_attention(q[:, -n:], k, v, *qm)), (truth,), (plain,))
    cases[f"decode, Sk={S}"] = dict(res, ok=all(r["ok"] for r in res.values()))
    q, k, v, dout, meta = make_inputs(1, S2, 32, 8, 128, 7, docs=3, pad=8)  # the split backward: bitwise repeatable
    r1, r2 = (via_autograd("triton", "split")(q, k, v, dout, meta) for _ in "ab")
    entry["split_backward_bitwise_repeatable"] = all(torch.equal(r1[n], r2[n]) for n in r1)
    if not entry["split_backward_bitwise_repeatable"] or not all(c.get("ok") for c in cases.values() if "status" not in c):
        entry["status"] = "fail"


def count_syncs(fn) -> dict:
    """Host syncs of fn() in torch's sync debug mode (warnings counted), then once in error mode."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    n = sum("synchroniz" in str(w.message).lower() and "prototype" not in str(w.message) for w in caught)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        mode = "passed"
    except RuntimeError as e:
        mode = f"raised: {str(e)[:200]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return dict(syncs=n, error_mode=mode)


def part_syncs(ok, entry, args):
    if DRY:
        entry.update(status="skipped", reason="needs CUDA (torch.cuda.set_sync_debug_mode); on CPU the tests run "
                     "the Triton path under tests/sync_guard.py, which fails on any tensor-to-Python conversion")
        return
    q, k, v, dout, meta = make_inputs(1, 4096, 32, 8, 128, 6, docs=3, pad=64)
    qg = q.clone().requires_grad_(True)
    kept = {b: AttentionPlan() for b in ("triton", "auto")}
    calls = {f"{b} fwd+bwd, plan kept": lambda b=b: block_attention(qg, k, v, *meta, backend=b, plan=kept[b]).backward(dout)
             for b in kept}
    calls |= {f"{b} fwd+bwd, plan built in the call": lambda b=b: block_attention(qg, k, v, *meta, backend=b).backward(dout)
              for b in kept}
    calls["decode forward (Sq = 4)"] = lambda: block_attention(q[:, -4:], k, v, meta[0][:, -4:], meta[1],
                                                               meta[2][:, -4:], meta[3])
    res = entry.setdefault("calls", {})
    for name, fn in calls.items():
        try:
            fn()  # compile and warm up first
            res[name] = count_syncs(fn) if ok(5) else dict(status="skipped: out of time")
        except Exception as e:  # noqa: BLE001
            res[name] = dict(error=repr(e)[:300])
    judged = [r for n, r in res.items() if n != "auto fwd+bwd, plan built in the call"]  # auto reads it to build
    entry["attention_syncs"] = sum(r["syncs"] for r in judged) if all("syncs" in r for r in judged) else None
    if entry["attention_syncs"] != 0:
        entry["status"] = "fail"


def part_speed(ok, entry, args):
    shapes, seqlens, tokens = (((32, 4, 2),), (64,), 64) if DRY else (((64, 9, 3), (128, 32, 8)), (4096, 16384), 16384)
    rows = entry.setdefault("rows", [])
    for (D, H, Hkv), S, docs in ((sh, S, d) for sh in shapes for S in seqlens for d in (1, 8)):
        if ok(10):
            rows.append(bench_case(S, tokens, H, Hkv, D, docs, warmup=0 if DRY else 2, reps=1 if DRY else 5, device=DEV,
                                   peak=None if DRY else device_peak(torch.cuda.get_device_name(DEV))))
            compare_packed(rows)
            _free()
    entry["plan_build"] = []  # the Triton plans' build time on this device: causal, one document
    for S in (4096,) if DRY else (65536, 262144, 1048576):
        pos, seg, c = torch.arange(S, device=DEV)[None], torch.zeros(1, S, dtype=torch.long, device=DEV), \
            tk.tile_config(128, BF16)
        entry["plan_build"].append(dict(seqlen=S, ms=TIME(lambda: (
            tk.build_plan(pos, pos, seg, seg, True, c.fwd.block_m, c.fwd.block_n),
            tk.build_plan(pos, pos, seg, seg, True, c.bwd.block_m, c.bwd.block_n, transpose=True)))))


def part_ring(ok, entry, args):
    """What one GPU shows of a ring: each zigzag step's block timed at real shapes with the dispatch;
    the exposed communication of W ranks over a link computed from those times (predicted)."""
    from longvideo.parallel import zigzag_indices

    S_local, be = 64 if DRY else 16384, get_backend("auto", DEV)
    for D, H, Hkv in ((64, 9, 3), (128, 32, 8)):
        if not ok(5):
            break
        q, k, v, dout, _ = make_inputs(1, S_local, H, Hkv, D, 8)
        z = torch.zeros(1, S_local, dtype=torch.long, device=DEV)
        r0, r1 = (zigzag_indices(4 * S_local, 4, r).to(DEV)[None] for r in (0, 1))  # every step: S_local^2 / 2 pairs
        times = {}
        for kind, kp in (("local (causal)", r0), ("visiting (one dense rectangle)", r1)):
            plan, args_ = AttentionPlan(), (r0, kp, z, z, D ** -0.5, True)
            o, lse = be.forward(q, k, v, *args_, plan=plan)
            times[kind] = dict(fwd_ms=TIME(lambda: be.forward(q, k, v, *args_, plan=plan)),
                               bwd_ms=TIME(lambda: be.backward(dout, q, k, v, o, lse, *args_, plan=plan)))
        hop_bytes = 2 * S_local * Hkv * D * 2 + 2 * S_local * 8  # K and V in bf16, positions and segments
        rows = []
        for W, (link, bw) in ((W, lb) for W in (2, 4, 8) for lb in LINKS.items()):
            fwd = [times["local (causal)"]["fwd_ms"]] + [times["visiting (one dense rectangle)"]["fwd_ms"]] * (W - 1)
            bwd = [times["local (causal)"]["bwd_ms"]] + [times["visiting (one dense rectangle)"]["bwd_ms"]] * (W - 1)
            hop, dkv = 1e3 * hop_bytes / bw, 2e3 * hop_bytes / bw  # the travelling dK/dV partial sums are fp32
            exposed = sum(max(0.0, hop - t) for t in fwd[:-1]) + sum(max(0.0, hop + dkv - t) for t in bwd) + dkv
            rows.append(dict(W=W, link=link, compute_ms=sum(fwd + bwd), hop_ms=hop, exposed_ms=exposed,
                             efficiency=sum(fwd + bwd) / (sum(fwd + bwd) + exposed)))
        entry[f"D={D} {H}/{Hkv}"] = dict(s_local=S_local, block_times=times, predicted=rows,
                                         routes={f"{a} -> {b}": n for (a, b), n in be.routes.items()})
        _free()


def _model(system: str):
    """ours (configs/smol-135m.yaml's model, bf16, auto dispatch, activation checkpointing) or transformers'
    Llama of the same shape with SDPA attention, with or without gradient checkpointing."""
    from longvideo.config import load_config

    mcfg = replace(load_config(ROOT / "configs" / "smol-135m.yaml").model, max_seq_len=1 << 22)
    if DRY:
        mcfg = replace(mcfg, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, text_vocab_size=500,
                       codebook_size=64)
    if system == OURS:
        from longvideo.model import Transformer
        from longvideo.model.attention import LocalAttention

        with torch.device(DEV):
            model = Transformer(mcfg).to(BF16).train()
        model.set_attention(LocalAttention("auto"))
        model.activation_checkpointing = True
        return model, mcfg
    from transformers import LlamaConfig, LlamaForCausalLM

    hcfg = LlamaConfig(vocab_size=mcfg.vocab_size, hidden_size=mcfg.dim, intermediate_size=mcfg.ffn_dim,
                       num_hidden_layers=mcfg.n_layers, num_attention_heads=mcfg.n_heads,
                       num_key_value_heads=mcfg.n_kv_heads, max_position_embeddings=1 << 22, rms_norm_eps=mcfg.norm_eps,
                       rope_theta=mcfg.rope_theta, tie_word_embeddings=mcfg.tie_embeddings, use_cache=False)
    with torch.device(DEV):
        model = LlamaForCausalLM._from_config(hcfg, attn_implementation="sdpa", dtype=BF16).train()
    if system == HF_CKPT:
        model.gradient_checkpointing_enable()
    return model, mcfg


def _for_systems(ok, entry, body, order=(OURS, HF, HF_CKPT)):
    """body(system, step_of(S), mcfg) per system: step_of(S) is one training step (forward, backward,
    AdamW) on S random tokens; the model is built and freed here."""
    for system in order:
        if not ok(10):
            entry.setdefault(system, {})["status"] = "skipped: out of time"
            continue
        try:
            model, mcfg = _model(system)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=not DRY)

            def step_of(S, model=model, opt=opt):
                ids = torch.randint(0, mcfg.vocab_size, (1, S), device=DEV)
                pos, seg = torch.arange(S, device=DEV)[None], torch.zeros(1, S, dtype=torch.long, device=DEV)

                def step():
                    if system == OURS:
                        loss, w = model(ids, pos, seg, targets=ids)
                        (loss / w).backward()
                    else:
                        model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    model.zero_grad(set_to_none=True)
                return step
            body(system, step_of, mcfg)
        except Exception as e:  # noqa: BLE001
            entry.setdefault(system, {})["error"] = repr(e)[:300]
        model = opt = None
        _free()


def part_train(ok, entry, args):
    """Median of >= 5 timed steps after two warm-up steps, with min and max, at 16K, 32K, 64K."""
    peak = None if DRY else device_peak(torch.cuda.get_device_name(DEV))

    def body(system, step_of, mcfg):
        rows = entry.setdefault(system, {}).setdefault("rows", [])
        for S in (32, 64) if DRY else (16384, 32768, 65536):
            try:
                step, ts = step_of(S), []
                _free()
                for _ in range(2):
                    step()
                _sync()
                while len(ts) < 5 or (len(ts) < 9 and ok(30)):
                    t0 = time.perf_counter()
                    step()
                    _sync()
                    ts.append(time.perf_counter() - t0)
                med = statistics.median(ts)
                rows.append(dict(seqlen=S, step_s=med, min_s=min(ts), max_s=max(ts), steps=len(ts), tokens_per_s=S / med,
                                 peak_gib=_peak_gib(), mfu=mcfg.flops_per_token(S) * S / med / peak / 1e12 if peak else None))
            except Exception as e:  # noqa: BLE001 - OOM is a result here
                rows.append(dict(seqlen=S, error=repr(e)[:300], oom=_oom(e)))
            print(f"  train {system} S={S}: {rows[-1].get('tokens_per_s', rows[-1].get('error'))}", flush=True)
            if rows[-1].get("oom") or not ok(15):
                break
    _for_systems(ok, entry, body)


def part_context(ok, entry, args):
    """The longest length each system ran (one step with its optimizer): from twice the train part's
    longest, doubling until it runs out of memory or the time is spent (a step's time about
    quadruples with the length). transformers first: it runs out of memory within seconds."""
    train = args.report["parts"].get("train", {})

    def body(system, step_of, mcfg):
        e, ran = entry.setdefault(system, {}), [r["seqlen"] for r in train.get(system, {}).get("rows", [])
                                                if r.get("tokens_per_s")]
        e.update(longest=max(ran, default=None), from_train=True)
        S, last, n = 2 * max(ran, default=64 if DRY else 65536), 1.0, 0
        while ok(4 * last + 5) and (not DRY or n < 2):
            t0 = time.perf_counter()
            try:
                _free()
                step_of(S)()
                _sync()
            except Exception as err:  # noqa: BLE001
                e.update(out_of_memory_at=S) if _oom(err) else e.update(error=repr(err)[:300])
                break
            last, n = time.perf_counter() - t0, n + 1
            e.update(longest=S, step_s=last, peak_gib=_peak_gib(), from_train=False)
            S *= 2
    _for_systems(ok, entry, body, order=(HF, HF_CKPT, OURS))
    ours = entry.get(OURS, {})
    for name, other in (("vs_transformers_sdpa", HF), ("vs_transformers_sdpa_checkpointing", HF_CKPT)):
        o = entry.get(other, {})
        if ours.get("longest") and o.get("longest"):
            entry[name] = dict(ratio=ours["longest"] / o["longest"], ours_bounded="out_of_memory_at" in ours,
                               other_bounded="out_of_memory_at" in o)


def part_profile(ok, entry, args):
    """One step at 16K under the profiler, ours beside transformers + checkpointing: device kernels
    counted once each (the kernel events, never also the op that launched them) and the top host ops."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def body(system, step_of, mcfg):
        step = step_of(64 if DRY else 16384)
        step()
        _sync()
        with profile(activities=[ProfilerActivity.CPU] + ([] if DRY else [ProfilerActivity.CUDA])) as prof:
            t0 = time.perf_counter()
            step()
            _sync()
        wall, events = time.perf_counter() - t0, prof.key_averages()
        kern = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: -e.self_device_time_total)
        host = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: -e.self_cpu_time_total)
        entry[system] = dict(wall_ms=1e3 * wall, kernel_launches=sum(e.count for e in kern),
                             kernel_ms=sum(e.self_device_time_total for e in kern) / 1e3,
                             top_kernels=[dict(name=e.key[:100], calls=e.count, ms=e.self_device_time_total / 1e3)
                                          for e in kern[:12]],
                             top_host=[dict(op=e.key[:100], calls=e.count, self_ms=e.self_cpu_time_total / 1e3)
                                       for e in host[:8]])
    _for_systems(ok, entry, body, order=(OURS, HF_CKPT))


def part_tune(ok, entry, args):
    """Candidate launch shapes timed at the shipped head counts (S = 8192); the fastest forward and
    backward (backward: forward + backward timed) written as a table and used by the later parts."""
    import dataclasses

    fwd = [(16, 16, 4, 1)] if DRY else [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)]
    bwd = [(16, 16, 4, 1)] if DRY else [(16, 128, 8, 3), (32, 128, 8, 3), (32, 128, 8, 2), (64, 128, 8, 2), (64, 64, 8, 3)]
    layouts = [("split", True, False), ("split", False, False), ("split", True, True), ("fused", True, False)]
    chosen, timings = {}, entry.setdefault("timings", [])
    for D, H, Hkv in ((32, 4, 2),) if DRY else ((128, 32, 8), (64, 9, 3)):
        pad, best = tk.head_dim_pad(D), {}
        q, k, v, dout, meta = make_inputs(1, 64 if DRY else 8192, H, Hkv, D, 9)
        q.requires_grad_(True)
        for what, c, (var, per_head, smem) in [("fwd", c, layouts[0]) for c in fwd] + [("bwd", c, lay) for c in bwd
                                                                                       for lay in layouts]:
            cfg = dataclasses.replace(tk.DEFAULT_TABLE[(pad, "16bit")], **{what: tk.LaunchConfig(*c)}, variant=var,
                                      per_head=per_head, kv_smem=smem)
            tk.set_tile_table({(pad, "16bit"): cfg})
            plan, row = AttentionPlan(), dict(head_dim=D, heads=[H, Hkv], part=what, config=c, variant=var,
                                              per_head=per_head, kv_smem=smem)
            fn = (lambda: block_attention(q.detach(), k, v, *meta, backend="triton", plan=plan)) if what == "fwd" \
                else (lambda: block_attention(q, k, v, *meta, backend="triton", plan=plan).backward(dout))
            try:
                row["ms"] = TIME(fn, 1, 3) if ok(8) else None
                if row["ms"] is not None and (what not in best or row["ms"] < best[what][0]):
                    best[what] = (row["ms"], cfg)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory at this shape
                row["error"] = repr(e)[:200]
            timings.append(row)
        tk.set_tile_table(None)
        if len(best) == 2:
            chosen[(pad, "16bit")] = dataclasses.replace(best["bwd"][1], fwd=best["fwd"][1].fwd)
    entry["table"] = tk.table_to_json(chosen)
    if chosen and not DRY:
        (BENCH / "gpu_tune.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(DEV), table=entry["table"],
                                                             timings=timings), indent=1) + "\n")
        tk.set_tile_table(chosen)


FUNCS = dict(env=part_env, correctness=part_correctness, syncs=part_syncs, speed=part_speed, ring=part_ring,
             train=part_train, context=part_context, profile=part_profile, tune=part_tune)


# ----------------------------------------------------------------------------- report


def _f(x, fmt=".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _met(x, good) -> str:
    return "unknown" if x is None else "yes" if good(x) else "**no**"


def targets(report: dict) -> list[list[str]]:
    """[what, goal, measured, met] of the GPU targets (docs/kernels.md)."""
    p = report["parts"]
    rows = {s: {r["seqlen"]: r for r in p.get("train", {}).get(s, {}).get("rows", []) if r.get("tokens_per_s")}
            for s in (OURS, HF, HF_CKPT)}
    ours, hf, hfc = rows[OURS], rows[HF], rows[HF_CKPT]
    speed = [ours[S]["tokens_per_s"] / hfc[S]["tokens_per_s"] for S in ours if S in hfc]
    mem = [ours[S]["peak_gib"] / hfc[S]["peak_gib"] for S in ours if S in hfc and ours[S]["peak_gib"]]
    stretch = ours[16384]["tokens_per_s"] / hf[16384]["tokens_per_s"] if 16384 in ours and 16384 in hf else None
    packed = [(r["packed_vs_cudnn_fwd"], r.get("packed_vs_cudnn_fwdbwd") or 0)
              for r in p.get("speed", {}).get("rows", []) if r.get("packed_vs_cudnn_fwd") is not None]
    syncs = p.get("syncs", {}).get("attention_syncs")
    build = next((x["ms"] for x in p.get("speed", {}).get("plan_build", []) if x["seqlen"] == 65536), None)
    frac = build / 1e3 / ours[65536]["step_s"] if build and 65536 in ours else None
    c = p.get("context", {}).get("vs_transformers_sdpa_checkpointing")
    ctx = ["not measured", "unknown"] if not c else ["transformers never ran out of memory", "unknown"] \
        if not c["other_bounded"] else [f"{c['ratio']:.1f}x", _met(c["ratio"], lambda x: x >= 8)] if c["ours_bounded"] \
        else [f">= {c['ratio']:.1f}x (ours never ran out of memory)", "yes" if c["ratio"] >= 8 else "unknown"]
    out = [["135M step vs transformers + SDPA + checkpointing, 16K-64K", ">= 1.1x tokens/s, peak memory <= 1/2.5",
            f"{min(speed):.2f}x (worst), memory {max(mem):.2f}x (worst)" if speed and mem else "not measured",
            _met(min(speed) if speed and mem else None, lambda x: x >= 1.1 and max(mem) <= 0.4)],
           ["135M step vs transformers + SDPA, no checkpointing, 16K (stretch)", ">= 1.0x", _f(stretch, ".2f"),
            _met(stretch, lambda x: x >= 1.0)],
           ["packed documents (Triton) vs cuDNN dense causal, D = 64 and 128", "fwd >= 0.8x, fwd+bwd >= 0.75x",
            f"fwd {min(a for a, _ in packed):.2f}x, fwd+bwd {min(b for _, b in packed):.2f}x (worst)" if packed else "-",
            _met(packed or None, lambda x: min(a for a, _ in x) >= 0.8 and min(b for _, b in x) >= 0.75)],
           ["host syncs per attention call (auto: once its plan is built)", "0", _f(syncs, "d"), _met(syncs, lambda x: x == 0)],
           ["plan build / training step at 64K", "<= 2 %", _f(frac and 100 * frac, ".2f"), _met(frac, lambda x: x <= 0.02)],
           ["135M context vs transformers + SDPA + checkpointing (measured)", ">= 8x", *ctx]]
    return out if report.get("mode") == "gpu" else [[w, g, "dry run: no GPU figure", "n/a"] for w, g, _, _ in out]


def markdown(report: dict) -> str:
    p, env = report["parts"], report["parts"].get("env", {})
    g = lambda part, *keys: p.get(part, {}).get(*keys) if len(keys) == 1 else p.get(part, {})  # noqa: E731
    lines = [MD_BEGIN, '<a id="gpu-check"></a>', "## GPU check (`make gpu-check`, `scripts/gpu_check.py`)", "",
             f"GPU: **{env.get('gpu')}** (capability {env.get('capability')}, {env.get('sms')} SMs, "
             f"{_f(env.get('memory_gib'))} GiB, cuDNN {env.get('cudnn')}); torch {env.get('torch')}, Triton "
             f"{env.get('triton')}, transformers {env.get('transformers')}. Run {report['finished']}, {report['wall_s']:.0f} s."]
    ring = [(f"{sh}, W={r['W']}, {r['link']}", _f(r["compute_ms"]), _f(r["exposed_ms"], ".2f"), f"{100 * r['efficiency']:.1f} %")
            for sh, e in g("ring").items() if isinstance(e, dict) for r in e.get("predicted", [])]
    tables = [
        ("", ["part", "status", "seconds"], [[n, e.get("status"), _f(e.get("seconds"), ".0f")] for n, e in p.items()]),
        ("", ["target", "goal", "measured", "met"], targets(report)),
        ("Correctness, error / bound (bound = 2 x the same-dtype error + eps; < 1 passes):",
         ["case", "route", "out", "dq", "dk", "dv", "ok"],
         [[c, r, *(_f((x.get(n) or {}).get("ratio"), ".2f") for n in ("out", "dq", "dk", "dv")), x["ok"]]
          for c, res in g("correctness", "cases").items() for r, x in res.items() if isinstance(x, dict) and "ok" in x]
         if g("correctness", "cases") else []),
        ("Kernels, TFLOP/s of the visible pairs, forward / backward (bf16, causal, 16K tokens a batch):",
         ["S", "D heads", "docs", *IMPLS, "packed / cuDNN: fwd, fwd+bwd"],
         [[f"{r['seqlen']:,}", r.get("shape"), r.get("docs"), *(f"{_f(r.get(f'{w}_fwd_tflops'), '.0f')} / "
           f"{_f(r.get(f'{w}_bwd_tflops'), '.0f')}" for w in IMPLS),
           f"{_f(r.get('packed_vs_cudnn_fwd'), '.2f')}, {_f(r.get('packed_vs_cudnn_fwdbwd'), '.2f')}"]
          for r in g("speed", "rows") or [] if "seqlen" in r]),
        (f"Ring on one GPU, {next((e['s_local'] for e in g('ring').values() if isinstance(e, dict)), 0):,} tokens a "
         "rank: each step's blocks measured, the communication **predicted** from the link's bandwidth:", ["shape, ring, link", "compute ms", "exposed ms", "efficiency"], ring),
        ("Training step, smol-135m shape, bf16, AdamW: median of the timed steps (min-max):",
         ["system", "S", "tokens/s", "step s (min-max)", "MFU %", "peak GiB"],
         [[s_, f"{r['seqlen']:,}", _f(r.get("tokens_per_s"), ",.0f"), f"{_f(r.get('step_s'), '.3f')} "
           f"({_f(r.get('min_s'), '.3f')}-{_f(r.get('max_s'), '.3f')})", _f(r.get("mfu") and 100 * r["mfu"], ".0f"),
           _f(r.get("peak_gib"))] for s_ in (OURS, HF, HF_CKPT) for r in g("train").get(s_, {}).get("rows", [])]),
        ("Longest context that ran (one training step at doubling lengths; measured, not fitted):",
         ["system", "longest that ran", "peak GiB there", "ran out of memory at"],
         [[s_, _f(e.get("longest"), ",d"), _f(e.get("peak_gib")), _f(e.get("out_of_memory_at"), ",d")]
          for s_, e in g("context").items() if isinstance(e, dict) and "longest" in e]),
        ("One profiled step at 16K (each device kernel counted once):",
         ["system", "wall ms", "kernel launches", "kernel ms", "top kernels (ms)"],
         [[n, _f(r["wall_ms"], ".0f"), f"{r['kernel_launches']:,}", _f(r["kernel_ms"], ".0f"),
           "; ".join(f"{k['name'][:40]} {k['ms']:.0f}" for k in r["top_kernels"][:4])]
          for n, r in g("profile").items() if isinstance(r, dict) and "wall_ms" in r])]
    for title, head, rows in tables:
        if rows:
            lines += ([title, ""] if title else [""]) + ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows] + [""]
    return "\n".join(lines + ["Data: [bench/gpu_check.json](bench/gpu_check.json).", MD_END]) + "\n"


def write_markdown(report: dict, path: Path) -> None:
    text, section = (path.read_text() if path.exists() else ""), markdown(report)
    if MD_BEGIN in text and MD_END in text:
        head, rest = text.split(MD_BEGIN, 1)
        path.write_text(head + section.rstrip("\n") + rest.split(MD_END, 1)[1])
    else:
        path.write_text(text.rstrip("\n") + "\n\n" + section)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=None, help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--tune", action="store_true", help="run the tuning part (then speed with its table)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes under the interpreter even with CUDA")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default docs/bench/gpu_check.json)")
    p.add_argument("--md", type=Path, default=None, help="markdown to update (default docs/benchmarks.md on a GPU)")
    args = p.parse_args(argv)
    start = time.monotonic()
    parts = ["env"] + [x for x in (args.parts.split(",") if args.parts else ["tune", "speed"] if args.tune
                                   else PARTS[1:]) if x != "env"]
    if set(parts) - set(FUNCS):
        p.error(f"unknown parts {sorted(set(parts) - set(FUNCS))}; choose from {', '.join(FUNCS)}")
    out = args.out or BENCH / "gpu_check.json"
    if args.out is None and DRY and out.exists() and json.loads(out.read_text() or "{}").get("mode") == "gpu":
        out = BENCH / "gpu_check_dry.json"  # never overwrite a GPU run with a dry run
    md = args.md if args.md is not None else (None if DRY else ROOT / "docs" / "benchmarks.md")
    args.report = report = dict(check="scripts/gpu_check.py", mode="dry-run" if DRY else "gpu", argv=sys.argv[1:],
                                budget_s=args.budget, started=time.strftime("%Y-%m-%d %H:%M:%S"), parts={})
    if DRY:
        report["skipped"] = ("no CUDA device" if not torch.cuda.is_available() else "--dry-run") + \
            ": every part ran on tiny shapes under TRITON_INTERPRET=1 (no figure is a GPU figure)"

    def write():
        report.update(wall_s=time.monotonic() - start, finished=time.strftime("%Y-%m-%d %H:%M:%S"))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str) + "\n")

    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(PartTimeout("the part ran past its budget")))
    for name in parts:
        entry = report["parts"][name] = dict(status="running")
        deadline = time.monotonic() + min(BUDGETS.get(name, 30), args.budget - (time.monotonic() - start))
        ok = lambda need=0.0, deadline=deadline: deadline - time.monotonic() > need  # noqa: E731
        if not ok(5):
            entry.update(status="skipped", reason="the run's time budget is spent")
            continue
        print(f"[{time.monotonic() - start:5.0f} s] {name}", flush=True)
        t0 = time.monotonic()
        try:
            signal.alarm(max(1, int(deadline - time.monotonic() + 20)))  # a hard stop 20 s past the budget
            FUNCS[name](ok, entry, args)
            entry["status"] = "ok" if entry["status"] == "running" else entry["status"]
        except PartTimeout as e:
            entry.update(status="timeout", error=str(e))
        except Exception as e:  # noqa: BLE001 - the next part still runs
            entry.update(status="error", error=repr(e)[:1000], traceback=traceback.format_exc()[-3000:])
        finally:
            signal.alarm(0)
            tk.set_backward(None)
            entry["seconds"] = time.monotonic() - t0
        print(f"  -> {entry['status']} ({entry['seconds']:.0f} s) {entry.get('error', '')}", flush=True)
        try:
            _free()
        except Exception:  # noqa: BLE001 - a broken CUDA context: later parts record their own errors
            pass
        write()
    report["targets"] = [dict(zip(("target", "goal", "measured", "met"), r)) for r in targets(report)]
    write()
    if md is not None:
        write_markdown(report, md)
    for r in targets(report):
        print(f"  {r[0]}: {r[2]} (goal {r[1]}, met: {r[3]})")
    print(f"wrote {out}" + (f" and {md}" if md else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
