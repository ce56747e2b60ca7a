"""One prepared GPU check of the attention kernels, the dispatch and a training step (`make gpu-check`).

    python scripts/gpu_check.py                 # on a CUDA machine: every part, at most --budget s (480)
    python scripts/gpu_check.py --parts speed   # some parts only (env always runs)
    python scripts/gpu_check.py --parts speed --shapes 128:32:8 --seqlens 8192 32768 --budget 600
    python scripts/gpu_check.py --tune          # time candidate tile shapes, write docs/bench/gpu_tune.json
    python scripts/gpu_check.py --dry-run       # what runs without CUDA: the interpreter, tiny shapes

Parts: env, correctness, syncs, speed, ring, train; tune with --tune. docs/kernels.md, "The GPU
check", gives what each measures, its budget and the dry run without CUDA (tiny shapes, no figure).
"""

from __future__ import annotations

import argparse
import contextlib
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

import torch  # the interpreter must be chosen before anything imports triton

DRY = "--dry-run" in sys.argv or not torch.cuda.is_available()
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
import triton  # noqa: E402
from benchreport import BENCH_DIR, ROOT, md_table  # noqa: E402
from longvideo.kernels.dispatch import DispatchBackend  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from longvideo.config import load_config  # noqa: E402
from longvideo.export.hf import hf_config_dict  # noqa: E402
from longvideo.kernels import (  # noqa: E402
    AttentionMeta,
    Side,
    block_attention,
    flash_attn_ref,
    get_backend,
    lse_merge_,
)
from longvideo.kernels import _flash_attn_triton as tk  # noqa: E402
from longvideo.model import Transformer  # noqa: E402
from longvideo.parallel import apply_activation_checkpointing, zigzag_indices  # noqa: E402

MD_BEGIN, MD_END = (
    "<!-- gpu-check:begin (written by scripts/gpu_check.py) -->",
    "<!-- gpu-check:end -->",
)
DEV, BF16 = torch.device("cpu" if DRY else "cuda"), torch.bfloat16
PARTS = ("env", "correctness", "syncs", "speed", "ring", "train")
BUDGETS = dict(correctness=90, syncs=25, speed=100, ring=30, train=210, tune=300)
LINKS = {"NVLink (450 GB/s per direction)": 450e9, "InfiniBand NDR (50 GB/s)": 50e9}
OURS, HF, HF_CKPT = (
    "ours (auto, checkpointing)",
    "transformers sdpa",
    "transformers sdpa + gradient checkpointing",
)
IMPLS = ("triton", "auto", "flash", "cudnn")
PEAK_BF16_TFLOPS = {
    "H200": 989.4,
    "H100 SXM": 989.4,
    "H100 80GB HBM3": 989.4,
    "H800": 989.4,
    "GH200": 989.4,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.5,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.1,
    "L4": 121.0,
}
"""Dense bf16 tensor-core peaks (TFLOP/s) from the vendors' data sheets."""


def device_peak(name: str):
    """The data-sheet peak of the device named ``name`` (the longest matching key), or None."""
    keys = sorted(PEAK_BF16_TFLOPS, key=len, reverse=True)
    return next((PEAK_BF16_TFLOPS[k] for k in keys if k.lower() in name.lower()), None)


_sync = lambda: None if DRY else torch.cuda.synchronize()  # noqa: E731
_peak_gib = lambda: None if DRY else torch.cuda.max_memory_allocated() / 2**30  # noqa: E731
_oom = lambda e: isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()  # noqa: E731
_f = lambda x, fmt=".1f": "-" if x is None else format(x, fmt)  # noqa: E731
_met = lambda x, good: "unknown" if x is None else "yes" if good(x) else "**no**"  # noqa: E731


def TIME(fn, warm=1, reps=5):  # noqa: N802 (a constant-like helper, as the tables name it)
    """Median milliseconds of ``fn`` (one untimed run in a dry run)."""
    return 1e3 * statistics.median(time_fn(fn, 0 if DRY else warm, 1 if DRY else reps))


def _free():
    return gc.collect() or DRY or (torch.cuda.empty_cache(), torch.cuda.reset_peak_memory_stats())


class PartTimeout(Exception):
    """A part ran past its hard stop."""


def time_fn(fn, warmup: int, reps: int) -> list[float]:
    """Seconds of each timed call: CUDA events on a GPU, perf_counter in a dry run."""
    [fn() for _ in range(warmup)]
    out = []
    for _ in range(max(1, reps)):
        a, b = (
            (None, None)
            if DRY
            else (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        )
        _sync()
        t0 = a.record() or time.perf_counter() if a else time.perf_counter()
        fn()
        b.record() if b else None
        _sync()
        out.append(a.elapsed_time(b) / 1e3 if a else time.perf_counter() - t0)
    return out


def make_inputs(B, S, Hq, Hkv, D, seed, docs=1, pad=0):
    """bf16 q, k, v, dout and metadata: `docs` documents of random lengths (positions restarting),
    then `pad` padding tokens (segment -1)."""
    g, n = torch.Generator().manual_seed(seed), S - pad
    cuts = (
        torch.sort(torch.randperm(n - 1, generator=g)[: docs - 1] + 1).values
        if docs > 1
        else torch.zeros(0).long()
    )
    seg = torch.zeros(n, dtype=torch.long).index_fill_(0, cuts, 1).cumsum(0)
    pos = torch.arange(n) - torch.cat([torch.zeros(1, dtype=torch.long), cuts])[seg]
    pos = torch.cat([pos, torch.zeros(pad, dtype=torch.long)]).expand(B, S).contiguous().to(DEV)
    seg = (
        torch.cat([seg, torch.full((pad,), -1, dtype=torch.long)]).expand(B, S).contiguous().to(DEV)
    )
    q, k, v, dout = (torch.randn(B, S, h, D, generator=g).to(DEV, BF16) for h in (Hq, Hkv, Hkv, Hq))
    return q, k, v, dout, AttentionMeta.self_attention(pos, seg)


def reference(q, k, v, dout, meta, upcast: bool):
    """Attention and its gradients, materialised one kv-head group at a time, in float64 or bf16."""
    dt, G, parts = torch.float64 if upcast else q.dtype, q.shape[2] // k.shape[2], []
    for h in range(k.shape[2]):
        qq, kk, vv = (
            x.detach().to(dt).requires_grad_(True)
            for x in (q[:, :, h * G : (h + 1) * G], k[:, :, h : h + 1], v[:, :, h : h + 1])
        )
        out, _ = flash_attn_ref(qq, kk, vv, meta, upcast=False)
        out.backward(dout[:, :, h * G : (h + 1) * G].to(dt))
        parts.append((out.detach(), qq.grad, kk.grad, vv.grad))
    return [torch.cat(x, 2) for x in zip(*parts)]


def compare(got: dict, truth, plain) -> dict:
    """Per tensor: error / (2 x the same-dtype error + eps); passes below 1."""
    res = {}
    for name, t, p in zip(("out", "dq", "dk", "dv"), truth, plain):
        if name in got:
            err = (got[name].double() - t).abs().max().item()
            bound = 2 * (p.double() - t).abs().max().item() + 1e-3 * (1 + t.abs().max().item())
            res[name] = dict(
                err=err,
                ratio=err / bound,
                ok=bool(torch.isfinite(got[name]).all()) and err <= bound,
            )
    return dict(res, ok=all(r["ok"] for r in res.values()))


def via_autograd(backend: str, bwd_variant: str | None = None):
    """The route through block_attention's autograd (forward, then the backward of dout)."""

    def run(q, k, v, dout, meta):
        qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        try:
            tk.set_backward(bwd_variant)
            (out := block_attention(qg, kg, vg, meta, backend=backend)).backward(dout)
        finally:
            tk.set_backward(None)
        return dict(out=out.detach(), dq=qg.grad, dk=kg.grad, dv=vg.grad)

    return run


def ring_steps(backend, W: int):
    """All ranks' zigzag ring steps of W on this device: per rank the forward of every key block merged
    in fp32, then every block's backward from that global out/lse; the whole sequence reassembled.
    Each rank's blocks get the views its ring would pass (`AttentionMeta.visiting`)."""

    def run(q, k, v, dout, meta):
        pos, seg = meta.queries.positions, meta.queries.segment_ids
        idx = [zigzag_indices(q.shape[1], W, r).to(DEV) for r in range(W)]
        acc = {
            n: torch.zeros(x.shape, device=DEV)
            for n, x in (("out", q), ("dq", q), ("dk", k), ("dv", v))
        }
        for qi in idx:
            o = torch.zeros(q[:, qi].shape, device=DEV)
            lse = torch.full((q.shape[0], q.shape[2], len(qi)), float("-inf"), device=DEV)
            shard = AttentionMeta.self_attention(pos[:, qi], seg[:, qi])
            views = [shard.visiting(Side(pos[:, ki], seg[:, ki]), i) for i, ki in enumerate(idx)]
            for ki, view in zip(idx, views):
                lse_merge_(o, lse, *backend.forward(q[:, qi], k[:, ki], v[:, ki], view))
            for ki, view in zip(idx, views):
                grads = backend.backward(dout[:, qi], q[:, qi], k[:, ki], v[:, ki], o, lse, view)
                for name, i, g in zip(("dq", "dk", "dv"), (qi, ki, ki), grads):
                    acc[name][:, i] += g
            acc["out"][:, qi] = o
        return {n: t.to(BF16) for n, t in acc.items()}

    return run


def part_env(ok, entry, args):
    p = None if DRY else torch.cuda.get_device_properties(DEV)
    entry.update(
        mode="dry-run" if DRY else "gpu",
        torch=torch.__version__,
        triton=triton.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        **{}
        if DRY
        else dict(
            gpu=p.name,
            capability=list(torch.cuda.get_device_capability(DEV)),
            sms=p.multi_processor_count,
            memory_gib=p.total_memory / 2**30,
            peak_bf16_tflops=device_peak(p.name),
            cudnn=torch.backends.cudnn.version(),
        ),
    )


def part_correctness(ok, entry, args):
    """Every route against float64, the zigzag ring steps included (docs/kernels.md, "The GPU check")."""
    S, D, H, Hkv, S2 = (48, 32, 4, 2, 48) if DRY else (8192, 128, 32, 8, 4096)
    auto, flash = get_backend("auto"), DispatchBackend(dense=("flash",))  # cuDNN first; flash alone
    cases = entry.setdefault("cases", {})
    tri = {
        "triton split": via_autograd("triton", "split"),
        "triton fused": via_autograd("triton", "fused"),
    }
    for name, inputs, runs in (
        (
            f"S={S} D={D} {H}/{Hkv}, one document",
            (1, S, H, Hkv, D, 1),
            {
                **tri,
                "auto": via_autograd("auto"),
                "ring W=2, auto": ring_steps(auto, 2),
                "ring W=2, SDPA flash": ring_steps(flash, 2),
            },
        ),
        (
            f"S={S} D={D} {H}/{Hkv}, 7 packed documents + padding",
            (1, S, H, Hkv, D, 2, 7, S // 40),
            {
                **tri,
                "ring W=2, triton": ring_steps(get_backend("triton"), 2),
                "ring W=2, auto": ring_steps(auto, 2),
            },
        ),
        (
            f"S={S2} D=64 9/3 (the 135M shape)",
            (1, S2, 9, 3, 64, 3),
            {
                "triton split": tri["triton split"],
                "auto": via_autograd("auto"),
                "ring W=4, auto": ring_steps(auto, 4),
            },
        ),
        (
            f"S={S2 // 2} D=80 8/2, packed + padding",
            (1, S2 // 2, 8, 2, 80, 4, 3, 8),
            {"auto": via_autograd("auto")},
        ),
    ):
        if not ok(10):
            cases[name] = dict(status="skipped: out of time")
            continue
        t0, (q, k, v, dout, meta) = time.monotonic(), make_inputs(*inputs)
        truth, plain = reference(q, k, v, dout, meta, True), reference(q, k, v, dout, meta, False)
        res = auto.routes.clear() or flash.routes.clear() or {}
        for label, run in runs.items():
            try:
                res[label] = compare(run(q, k, v, dout, meta), truth, plain)
            except Exception as e:  # noqa: BLE001 - a route that fails is a finding
                res[label] = dict(ok=False, error=repr(e)[:300])
        cases[name] = dict(
            res,
            ok=all(r["ok"] for r in res.values()),
            seconds=time.monotonic() - t0,
            routes={f"{a} -> {b}": n for (a, b), n in (auto.routes + flash.routes).items()},
        )
        print(f"  correctness {name}: {'ok' if cases[name]['ok'] else 'FAIL'}", flush=True)
        q = k = v = dout = truth = plain = _free()
    if not all(c.get("ok") for c in cases.values() if "status" not in c):
        entry["status"] = "fail"


def part_syncs(ok, entry, args):
    """Host syncs per attention call after a warm-up call, each backend's plan kept and built in the
    call; the target counts all but auto's plan build (its one read of the metadata)."""
    if DRY:
        return entry.update(
            status="skipped",
            reason="needs CUDA (torch.cuda.set_sync_debug_mode); on CPU the tests "
            "run the Triton path under tests/sync_guard.py, which fails on any read of a tensor",
        )
    q, k, v, dout, meta = make_inputs(1, 4096, 32, 8, 128, 6, docs=3, pad=64)
    qg = q.clone().requires_grad_(True)
    kept = {b: AttentionMeta(meta.queries, meta.keys) for b in ("triton", "auto")}

    def fresh():  # a new metadata object: its plans are built in the call
        return AttentionMeta(meta.queries, meta.keys)

    calls = {
        f"{b} fwd+bwd, plan {how}": (
            lambda b=b, how=how: block_attention(
                qg, k, v, kept[b] if how == "kept" else fresh(), backend=b
            ).backward(dout)
        )
        for b in kept
        for how in ("kept", "built in the call")
    }
    res = entry.setdefault("calls", {})
    for name, fn in calls.items():
        fn()  # compile and warm up first
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        res[name] = sum(
            "synchroniz" in str(w.message).lower() and "prototype" not in str(w.message)
            for w in caught
        )
    entry["attention_syncs"] = sum(
        n for c, n in res.items() if c != "auto fwd+bwd, plan built in the call"
    )
    if entry["attention_syncs"]:
        entry["status"] = "fail"


def _calls(who: str, q, k, v, meta, group: int):
    """Implementation `who` as a function of (q, k, v) in (B, S, H, D): ours through block_attention
    with a kept plan; SDPA with GQA natively where the backend takes it, else K/V repeated in the call."""
    if who in ("triton", "auto"):
        kept = AttentionMeta(meta.queries, meta.keys)  # its plans kept across calls, as a model
        return lambda q, k, v: block_attention(q, k, v, kept, backend=who)  # step's across layers

    def call(q, k, v, expand=False):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        k, v = (x.repeat_interleave(group, 1) for x in (k, v)) if expand else (k, v)
        with sdpa_kernel(
            SDPBackend.FLASH_ATTENTION if who == "flash" else SDPBackend.CUDNN_ATTENTION
        ):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=group > 1 and not expand
            ).transpose(1, 2)

    try:
        torch.no_grad()(call)(q[:, :64], k[:, :64], v[:, :64])
        return call
    except RuntimeError:
        return lambda q, k, v: call(q, k, v, expand=True)


def bench_case(
    S: int, tokens: int, H: int, Hkv: int, D: int, docs: int, warmup: int, reps: int
) -> dict:
    """One row: per implementation the forward and the backward (from a kept graph) timed apart: median,
    min, max ms and TFLOP/s of the visible pairs (forward 4 * B * H * pairs * D, backward 2.5x that).
    Packed rows (docs > 1, equal documents, positions restarting) run ours only."""
    B, n = max(1, tokens // S), S // docs
    seg = torch.clamp(torch.arange(S, device=DEV) // n, max=docs - 1)
    meta = AttentionMeta.self_attention(
        (torch.arange(S, device=DEV) - seg * n).expand(B, S), seg.expand(B, S)
    )
    flops = 4.0 * B * H * (docs * n * (n + 1) / 2 + (S - docs * n) * n) * D
    row = dict(seqlen=S, batch=B, shape=f"{D} {H}/{Hkv}", docs=docs, fwd_tflop=flops / 1e12)
    q, k, v, dout = (torch.randn(B, S, h, D, device=DEV, dtype=BF16) for h in (H, Hkv, Hkv, H))
    [x.requires_grad_(True) for x in (q, k, v)]
    for who in IMPLS if docs == 1 else ("triton", "auto"):
        try:
            fn = _calls(who, q, k, v, meta, H // Hkv)
            with torch.no_grad():
                fwd = time_fn(lambda: fn(q, k, v), warmup, reps)
            out = fn(q, k, v)
            bwd = time_fn(
                lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), warmup, reps
            )
        except Exception as e:  # noqa: BLE001 - unsupported backend, out of memory: recorded, the others still run
            row[f"{who}_error"] = repr(e)[:300]
            continue
        for part, ts, f in (("fwd", fwd, flops), ("bwd", bwd, 2.5 * flops)):
            row[f"{who}_{part}_ms"] = [1e3 * statistics.median(ts), 1e3 * min(ts), 1e3 * max(ts)]
            row[f"{who}_{part}_tflops"] = f / statistics.median(ts) / 1e12
        row[f"{who}_fwdbwd_tflops"] = (
            3.5 * flops / (statistics.median(fwd) + statistics.median(bwd)) / 1e12
        )
    return row


def compare_packed(rows: list[dict]) -> None:
    """Each packed row's TFLOP/s over cuDNN's dense causal row of the same length and shape."""
    for r in rows:
        dense = next(
            (
                d
                for d in rows
                if d.get("docs") == 1 and (d["seqlen"], d["shape"]) == (r["seqlen"], r["shape"])
            ),
            {},
        )
        for part, a, b in (
            (p, r.get(f"triton_{p}_tflops"), dense.get(f"cudnn_{p}_tflops"))
            for p in ("fwd", "fwdbwd")
        ):
            r.update(
                {f"packed_vs_cudnn_{part}": a / b if a and b else None}
                if r.get("docs", 1) > 1
                else {}
            )


def part_speed(ok, entry, args):
    shapes, seqlens, tokens = (
        (((32, 4, 2),), (64,), 64) if DRY else (args.shapes, args.seqlens, 16384)
    )
    rows = entry.setdefault("rows", [])
    for (D, H, Hkv), S, docs in ((sh, S, d) for sh in shapes for S in seqlens for d in (1, 8)):
        if ok(10):
            rows.append(
                bench_case(S, tokens, H, Hkv, D, docs, warmup=0 if DRY else 2, reps=1 if DRY else 5)
            )
            compare_packed(rows)
            _free()


def part_ring(ok, entry, args):
    """The two zigzag block kinds timed; from them and a link's bandwidth the exposed communication of
    W ranks, predicted (docs/kernels.md, "The GPU check", gives the model)."""
    S_local, auto = 64 if DRY else 16384, get_backend("auto")
    auto.routes.clear()
    for D, H, Hkv in ((64, 9, 3), (128, 32, 8)) if ok(5) else ():
        q, k, v, dout, _ = make_inputs(1, S_local, H, Hkv, D, 8)
        z, (r0, r1) = (
            torch.zeros(1, S_local, dtype=torch.long, device=DEV),
            (zigzag_indices(4 * S_local, 4, r).to(DEV)[None] for r in (0, 1)),
        )
        t = {}
        for kind, key_pos in (("local", r0), ("visiting", r1)):  # one causal call; a rectangle
            block = AttentionMeta(Side(r0, z), Side(key_pos, z))
            o, lse = auto.forward(q, k, v, block)
            t[kind] = (
                TIME(lambda: auto.forward(q, k, v, block)),
                TIME(lambda: auto.backward(dout, q, k, v, o, lse, block)),
            )
        hop_bytes, rows = (
            2 * S_local * Hkv * D * 2 + 2 * S_local * 8,
            [],
        )  # K and V in bf16, positions and segments
        for W, (link, bw) in ((W, lb) for W in (2, 4, 8) for lb in LINKS.items()):
            fwd, bwd = ([t["local"][i]] + [t["visiting"][i]] * (W - 1) for i in (0, 1))
            hop = 1e3 * hop_bytes / bw
            exposed = (
                sum(max(0.0, hop - x) for x in fwd[:-1])
                + sum(max(0.0, 3 * hop - x) for x in bwd)
                + 2 * hop
            )
            rows.append(
                dict(
                    W=W,
                    link=link,
                    compute_ms=sum(fwd + bwd),
                    hop_ms=hop,
                    exposed_ms=exposed,
                    efficiency=sum(fwd + bwd) / (sum(fwd + bwd) + exposed),
                )
            )
        entry[f"D={D} {H}/{Hkv}"] = dict(
            s_local=S_local,
            block_ms={k_: dict(fwd=f, bwd=b) for k_, (f, b) in t.items()},
            predicted=rows,
            routes={f"{a} -> {b}": n for (a, b), n in auto.routes.items()},
        )
        _free()


def _model(system: str):
    """ours (configs/smol-135m.yaml's model, bf16, auto dispatch, activation checkpointing) or transformers'
    Llama of the same shape with SDPA attention, with or without gradient checkpointing."""
    small = dict(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        text_vocab_size=500,
        codebook_size=64,
    )
    root = load_config(ROOT / "configs" / "smol-135m.yaml")
    mcfg = replace(root.model, max_seq_len=1 << 22, **small if DRY else {})
    if system == OURS:
        with torch.device(DEV):
            model = (
                Transformer(
                    mcfg,
                    ffn_chunk=root.runtime.ffn_chunk,
                    loss_chunk=root.runtime.loss_chunk,
                    backend="auto",
                )
                .to(BF16)
                .train()
            )
        apply_activation_checkpointing(model)
        return model, mcfg
    hcfg = LlamaConfig(**hf_config_dict(mcfg), use_cache=False)
    with torch.device(DEV):
        model = LlamaForCausalLM._from_config(hcfg, attn_implementation="sdpa", dtype=BF16).train()
    if system == HF_CKPT:
        model.gradient_checkpointing_enable()
    return model, mcfg


def _step(model, system, S: int, opt):
    """One training step (forward, backward, AdamW) of `system` on S random tokens, one document."""
    ids = torch.randint(
        0, model.cfg.vocab_size if system == OURS else model.config.vocab_size, (1, S), device=DEV
    )
    pos, seg = torch.arange(S, device=DEV)[None], torch.zeros(1, S, dtype=torch.long, device=DEV)

    def step():
        if system == OURS:
            (model(ids, pos, seg, targets=ids) / S).backward()
        else:
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        model.zero_grad(set_to_none=True)

    return step


def part_train(ok, entry, args):
    """Per system: timed steps at 16K-64K, one profiled step, then the longest length that ran at
    doubling lengths within its time share (docs/kernels.md, "The GPU check")."""
    peak = None if DRY else device_peak(torch.cuda.get_device_name(DEV))
    for system in (OURS, HF, HF_CKPT):
        e, S = entry.setdefault(system, dict(rows=[])), None
        if not ok(15):
            e["status"] = "skipped: out of time"
            continue
        try:
            model, mcfg = _model(system)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=not DRY)
            for S in (32, 64) if DRY else (16384, 32768, 65536):
                _free()
                step = _step(model, system, S, opt)
                ts = time_fn(step, 2, 7 if ok(60) else 5)
                med = statistics.median(ts)
                e["rows"].append(
                    dict(
                        seqlen=S,
                        step_s=med,
                        min_s=min(ts),
                        max_s=max(ts),
                        steps=len(ts),
                        tokens_per_s=S / med,
                        peak_gib=_peak_gib(),
                        mfu=mcfg.flops_per_token(S) * S / med / peak / 1e12 if peak else None,
                    )
                )
                e["longest"] = S
                print(f"  train {system} S={S}: {S / med:,.0f} tokens/s", flush=True)
                if system != HF and len(e["rows"]) == 1:
                    with profile(
                        activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (not DRY)
                    ) as prof:
                        t0 = time.perf_counter()
                        step()
                        _sync()
                    wall, ev = time.perf_counter() - t0, prof.key_averages()
                    kern = sorted(
                        (x for x in ev if x.device_type == DeviceType.CUDA),
                        key=lambda x: -x.self_device_time_total,
                    )
                    host = sorted(
                        (x for x in ev if x.device_type == DeviceType.CPU),
                        key=lambda x: -x.self_cpu_time_total,
                    )
                    e["profile"] = dict(
                        seqlen=S,
                        wall_ms=1e3 * wall,
                        kernel_launches=sum(x.count for x in kern),
                        kernel_ms=sum(x.self_device_time_total for x in kern) / 1e3,
                        top_kernels=[
                            (x.key[:100], x.count, x.self_device_time_total / 1e3)
                            for x in kern[:12]
                        ],
                        top_host=[
                            (x.key[:100], x.count, x.self_cpu_time_total / 1e3) for x in host[:8]
                        ],
                    )
            S, last, until = 2 * S, med, time.monotonic() + (60 if system == OURS else 25)
            while (
                time.monotonic() + 4 * last < until and ok(4 * last + 5) and (not DRY or S <= 256)
            ):
                t0 = time.perf_counter()
                _free()
                _step(model, system, S, opt)()
                _sync()
                last, e["longest"], e["longest_peak_gib"], S = (
                    time.perf_counter() - t0,
                    S,
                    _peak_gib(),
                    2 * S,
                )
        except Exception as err:  # noqa: BLE001 - running out of memory is a result here
            e.update(out_of_memory_at=S) if _oom(err) else e.update(error=repr(err)[:300])
        model = opt = None
        _free()
    ours = entry[OURS]
    for other in (HF, HF_CKPT):
        o = entry.get(other, {})
        if ours.get("longest") and o.get("longest"):
            entry[f"context_vs_{other}"] = dict(
                ratio=ours["longest"] / o["longest"],
                ours_bounded="out_of_memory_at" in ours,
                other_bounded="out_of_memory_at" in o,
            )


def part_tune(ok, entry, args):
    """The fastest candidate launch shapes (docs/kernels.md, "Launch shapes"; a backward timed as
    forward + backward) go to docs/bench/gpu_tune.json and serve the later parts."""
    fwd = (
        [(16, 16, 4, 1)]
        if DRY
        else [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)]
    )
    bwd = (
        [(16, 16, 4, 1)]
        if DRY
        else [(16, 128, 8, 3), (32, 128, 8, 3), (32, 128, 8, 2), (64, 128, 8, 2), (64, 64, 8, 3)]
    )
    layouts = [
        ("split", True, False),
        ("split", False, False),
        ("split", True, True),
        ("fused", True, False),
    ]
    chosen, timings = {}, entry.setdefault("timings", [])
    for D, H, Hkv in ((32, 4, 2),) if DRY else ((128, 32, 8), (64, 9, 3)):
        key, best = (tk.head_dim_pad(D), "16bit"), {}
        q, k, v, dout, meta = make_inputs(1, 64 if DRY else 8192, H, Hkv, D, 9)
        q.requires_grad_(True)
        for what, c, (var, per_head, smem) in [("fwd", c, layouts[0]) for c in fwd] + [
            ("bwd", c, x) for c in bwd for x in layouts
        ]:
            cfg = replace(
                tk.DEFAULT_TABLE[key],
                **{what: tk.LaunchConfig(*c)},
                variant=var,
                per_head=per_head,
                kv_smem=smem,
            )
            tk.set_tile_table({key: cfg})
            candidate, row = (
                AttentionMeta(meta.queries, meta.keys),  # plans of this launch shape
                dict(
                    head_dim=D,
                    heads=[H, Hkv],
                    part=what,
                    config=c,
                    variant=var,
                    per_head=per_head,
                    kv_smem=smem,
                ),
            )
            attn = lambda: block_attention(q, k, v, candidate, backend="triton")  # noqa: E731
            try:
                row["ms"] = (
                    TIME(
                        (lambda: attn().detach())
                        if what == "fwd"
                        else (lambda: attn().backward(dout)),
                        1,
                        3,
                    )
                    if ok(8)
                    else None
                )
                best[what] = min(
                    best.get(what, (math.inf, None)),
                    (row["ms"] or math.inf, cfg),
                    key=lambda x: x[0],
                )
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory at this shape
                row["error"] = repr(e)[:200]
            timings.append(row)
        tk.set_tile_table(None)
        if all(best.get(w, (math.inf,))[0] < math.inf for w in ("fwd", "bwd")):
            chosen[key] = replace(best["bwd"][1], fwd=best["fwd"][1].fwd)
    entry["table"] = tk.table_to_json(chosen)
    if chosen and not DRY:
        tune = dict(gpu=torch.cuda.get_device_name(DEV), table=entry["table"], timings=timings)
        (BENCH_DIR / "gpu_tune.json").write_text(json.dumps(tune, indent=1) + "\n")
        tk.set_tile_table(chosen)


FUNCS = {name: globals()[f"part_{name}"] for name in (*PARTS, "tune")}


def targets(report: dict) -> list[list[str]]:
    """[what, goal, measured, met] of the GPU targets (docs/kernels.md)."""
    p = report["parts"]
    rows = {
        s: {
            r["seqlen"]: r
            for r in p.get("train", {}).get(s, {}).get("rows", [])
            if r.get("tokens_per_s")
        }
        for s in (OURS, HF, HF_CKPT)
    }
    ours, hf, hfc = rows[OURS], rows[HF], rows[HF_CKPT]
    speed = [ours[S]["tokens_per_s"] / hfc[S]["tokens_per_s"] for S in ours if S in hfc]
    mem = [
        ours[S]["peak_gib"] / hfc[S]["peak_gib"] for S in ours if S in hfc and ours[S]["peak_gib"]
    ]
    stretch = (
        ours[16384]["tokens_per_s"] / hf[16384]["tokens_per_s"]
        if 16384 in ours and 16384 in hf
        else None
    )
    packed = [
        (r["packed_vs_cudnn_fwd"], r.get("packed_vs_cudnn_fwdbwd") or 0)
        for r in p.get("speed", {}).get("rows", [])
        if r.get("packed_vs_cudnn_fwd") is not None
    ]
    vs_flash = [
        r["triton_fwdbwd_tflops"] / r["flash_fwdbwd_tflops"]
        for r in p.get("speed", {}).get("rows", [])
        if r.get("docs") == 1 and r.get("triton_fwdbwd_tflops") and r.get("flash_fwdbwd_tflops")
    ]
    syncs = p.get("syncs", {}).get("attention_syncs")
    c = p.get("train", {}).get(f"context_vs_{HF_CKPT}")
    ctx = (
        ["not measured", "unknown"]
        if not c
        else ["transformers never ran out of memory", "unknown"]
        if not c["other_bounded"]
        else [f"{c['ratio']:.1f}x", _met(c["ratio"], lambda x: x >= 8)]
        if c["ours_bounded"]
        else [
            f">= {c['ratio']:.1f}x (ours never ran out of memory)",
            "yes" if c["ratio"] >= 8 else "unknown",
        ]
    )
    out = [
        [
            "135M step vs transformers + SDPA + checkpointing, 16K-64K",
            ">= 1.1x tokens/s, peak memory <= 1/2.5",
            f"{min(speed):.2f}x (worst), memory {max(mem):.2f}x (worst)"
            if speed and mem
            else "not measured",
            _met(min(speed) if speed and mem else None, lambda x: x >= 1.1 and max(mem) <= 0.4),
        ],
        [
            "135M step vs transformers + SDPA, no checkpointing, 16K (stretch)",
            ">= 1.0x",
            _f(stretch, ".2f"),
            _met(stretch, lambda x: x >= 1.0),
        ],
        [
            "Triton fwd+bwd vs SDPA flash, one document, D = 64 and 128",
            ">= 0.9x",
            f"{min(vs_flash):.2f}x (worst)" if vs_flash else "-",
            _met(min(vs_flash, default=None), lambda x: x >= 0.9),
        ],
        [
            "packed documents (Triton) vs cuDNN dense causal, D = 64 and 128",
            "fwd >= 0.8x, fwd+bwd >= 0.75x",
            f"fwd {min(a for a, _ in packed):.2f}x, fwd+bwd {min(b for _, b in packed):.2f}x (worst)"
            if packed
            else "-",
            _met(
                packed or None,
                lambda x: min(a for a, _ in x) >= 0.8 and min(b for _, b in x) >= 0.75,
            ),
        ],
        [
            "host syncs per attention call (auto: once its plan is built)",
            "0",
            _f(syncs, "d"),
            _met(syncs, lambda x: x == 0),
        ],
        ["135M context vs transformers + SDPA + checkpointing (measured)", ">= 8x", *ctx],
    ]
    return (
        out
        if report.get("mode") == "gpu"
        else [[w, g, "dry run: no GPU figure", "n/a"] for w, g, _, _ in out]
    )


def markdown(report: dict) -> str:
    p, env = report["parts"], report["parts"].get("env", {})
    tr, cases = p.get("train", {}), p.get("correctness", {}).get("cases", {})
    routes = [
        (c, r, x)
        for c, res in cases.items()
        for r, x in res.items()
        if isinstance(x, dict) and "ok" in x
    ]
    worst = max(
        (x.get(n, {}).get("ratio", 0) for _, _, x in routes for n in ("out", "dq", "dk", "dv")),
        default=None,
    )
    rings = {sh: e for sh, e in p.get("ring", {}).items() if isinstance(e, dict)}
    ring = [
        f"{sh} W={r['W']} {r['link'].split(' (')[0]} {100 * r['efficiency']:.1f} %"
        for sh, e in rings.items()
        for r in e["predicted"]
    ]
    prof = [
        f"{n}: {e['profile']['kernel_launches']:,} kernel launches, {e['profile']['kernel_ms']:.0f} ms of device "
        f"kernels in {e['profile']['wall_ms']:.0f} ms"
        for n, e in tr.items()
        if isinstance(e, dict) and "profile" in e
    ]
    lines = [
        MD_BEGIN,
        '<a id="gpu-check"></a>',
        "## GPU check (`make gpu-check`, `scripts/gpu_check.py`)",
        "",
        f"GPU: **{env.get('gpu')}** (capability {env.get('capability')}, {env.get('sms')} SMs, {_f(env.get('memory_gib'))}"
        f" GiB, cuDNN {env.get('cudnn')}); torch {env.get('torch')}, Triton {env.get('triton')}, transformers "
        f"{env.get('transformers')}. Run {report['finished']}, {report['wall_s']:.0f} s. Parts: "
        + ", ".join(
            f"{n} {e.get('status')} ({_f(e.get('seconds'), '.0f')} s)" for n, e in p.items()
        )
        + ".",
        "",
        f"Correctness: {sum(x['ok'] for *_, x in routes)} of {len(routes)} routes within the float64 rule (2 x the "
        f"same-dtype error + eps), worst error / bound {_f(worst, '.2f')}"
        + "".join(f"; **failed: {c}, {r}**" for c, r, x in routes if not x["ok"])
        + "."
        if routes
        else "",
        "",
    ]
    for head, rows in (
        (["target", "goal", "measured", "met"], targets(report)),
        (
            [
                "S",
                "D heads",
                "docs",
                *(f"{w} fwd / bwd" for w in IMPLS),
                "packed / cuDNN fwd, fwd+bwd",
            ],
            [
                [
                    f"{r['seqlen']:,}",
                    r["shape"],
                    r["docs"],
                    *(
                        f"{_f(r.get(f'{w}_fwd_tflops'), '.0f')} / "
                        f"{_f(r.get(f'{w}_bwd_tflops'), '.0f')}"
                        for w in IMPLS
                    ),
                    f"{_f(r.get('packed_vs_cudnn_fwd'), '.2f')}, "
                    f"{_f(r.get('packed_vs_cudnn_fwdbwd'), '.2f')}",
                ]
                for r in p.get("speed", {}).get("rows", [])
                if "shape" in r
            ],
        ),
        (
            ["system", "S", "tokens/s", "step s (min-max)", "MFU %", "peak GiB"],
            [
                [
                    n,
                    f"{r['seqlen']:,}",
                    _f(r["tokens_per_s"], ",.0f"),
                    f"{r['step_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f})",
                    _f(r["mfu"] and 100 * r["mfu"], ".0f"),
                    _f(r["peak_gib"]),
                ]
                for n in (OURS, HF, HF_CKPT)
                for r in tr.get(n, {}).get("rows", [])
            ],
        ),
        (
            ["system", "longest context that ran (peak GiB)", "ran out of memory at"],
            [
                [
                    n,
                    f"{e['longest']:,} ({_f(e.get('longest_peak_gib'))})",
                    _f(e.get("out_of_memory_at"), ",d"),
                ]
                for n, e in tr.items()
                if isinstance(e, dict) and "longest" in e
            ],
        ),
    ):
        lines += [md_table(head, rows), ""] if rows else []
    lines += [
        "Kernel TFLOP/s count the visible pairs (bf16, causal, 16K tokens a batch); steps: medians after two warm-up "
        "steps; the longest context: one step at doubling lengths, measured, not fitted.",
        "",
    ]
    lines += (
        [
            f"Ring, **predicted** from this GPU's block times at {next(iter(rings.values()), {}).get('s_local')} "
            f"tokens a rank and the link's bandwidth (efficiency = compute / (compute + exposed communication)): "
            + "; ".join(ring)
            + ".",
            "",
        ]
        if ring
        else []
    )
    lines += (
        [
            "Profile of one step at 16K (each device kernel counted once): "
            + "; ".join(prof)
            + ".",
            "",
        ]
        if prof
        else []
    )
    return "\n".join(lines + ["Data: [bench/gpu_check.json](bench/gpu_check.json).", MD_END]) + "\n"


def write_markdown(report: dict, path: Path) -> None:
    text, section = (path.read_text() if path.exists() else ""), markdown(report)
    if MD_BEGIN in text and MD_END in text:
        head, rest = text.split(MD_BEGIN, 1)
        path.write_text(head + section.rstrip("\n") + rest.split(MD_END, 1)[1])
    else:
        path.write_text(text.rstrip("\n") + "\n\n" + section)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=None, help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument(
        "--tune", action="store_true", help="run the tuning part (then speed with its table)"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="tiny shapes under the interpreter even with CUDA"
    )
    p.add_argument(
        "--shapes",
        type=lambda s: tuple(map(int, s.split(":"))),
        nargs="+",
        default=[(64, 9, 3), (128, 32, 8)],
        metavar="D:H:HKV",
        help="the speed part's head dim:heads:kv heads (GPU)",
    )
    p.add_argument(
        "--seqlens",
        type=int,
        nargs="+",
        default=[4096, 16384],
        help="the speed part's lengths (GPU)",
    )
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    p.add_argument(
        "--out", type=Path, default=None, help="JSON path (default docs/bench/gpu_check.json)"
    )
    p.add_argument(
        "--md",
        type=Path,
        default=None,
        help="markdown to update (default docs/benchmarks.md on a GPU)",
    )
    args, start = p.parse_args(argv), time.monotonic()
    parts = ["env"] + [
        x
        for x in (
            args.parts.split(",") if args.parts else ["tune", "speed"] if args.tune else PARTS
        )
        if x != "env"
    ]
    if set(parts) - set(FUNCS):
        p.error(f"unknown parts {sorted(set(parts) - set(FUNCS))}; choose from {', '.join(FUNCS)}")
    out = args.out or BENCH_DIR / "gpu_check.json"
    if (
        args.out is None
        and DRY
        and out.exists()
        and json.loads(out.read_text() or "{}").get("mode") == "gpu"
    ):
        out = BENCH_DIR / "gpu_check_dry.json"  # never overwrite a GPU run with a dry run
    md = args.md if args.md is not None else (None if DRY else ROOT / "docs" / "benchmarks.md")
    report = dict(
        check="scripts/gpu_check.py",
        mode="dry-run" if DRY else "gpu",
        argv=sys.argv[1:],
        budget_s=args.budget,
        started=time.strftime("%Y-%m-%d %H:%M:%S"),
        parts={},
    )
    if DRY:
        report["skipped"] = (
            f"{'no CUDA device' if not torch.cuda.is_available() else '--dry-run'}: every part ran on "
            "tiny shapes under TRITON_INTERPRET=1 (no figure is a GPU figure)"
        )
    signal.signal(
        signal.SIGALRM,
        lambda *_: (_ for _ in ()).throw(PartTimeout("the part ran past its budget")),
    )
    for name in parts:
        entry = report["parts"][name] = dict(status="running")
        deadline = time.monotonic() + min(
            BUDGETS.get(name, 30), args.budget - (time.monotonic() - start)
        )
        ok, t0 = (lambda need=0.0, d=deadline: d - time.monotonic() > need), time.monotonic()
        print(f"[{t0 - start:5.0f} s] {name}", flush=True)
        try:
            if not ok(5):
                raise PartTimeout("the run's time budget is spent")
            signal.alarm(max(1, int(deadline - t0 + 20)))  # a hard stop 20 s past the budget
            FUNCS[name](ok, entry, args)
            entry["status"] = "ok" if entry["status"] == "running" else entry["status"]
        except PartTimeout as e:
            entry.update(status="timeout", error=str(e))
        except Exception as e:  # noqa: BLE001 - the next part still runs
            entry.update(
                status="error", error=repr(e)[:1000], traceback=traceback.format_exc()[-3000:]
            )
        finally:
            signal.alarm(0)
            tk.set_backward(None)
            entry["seconds"] = time.monotonic() - t0
        print(
            f"  -> {entry['status']} ({entry['seconds']:.0f} s) {entry.get('error', '')}",
            flush=True,
        )
        with contextlib.suppress(
            Exception
        ):  # a broken CUDA context: later parts record their own errors
            _free()
        report.update(
            wall_s=time.monotonic() - start,
            finished=time.strftime("%Y-%m-%d %H:%M:%S"),
            targets=[dict(zip(("target", "goal", "measured", "met"), r)) for r in targets(report)],
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    if md is not None:
        write_markdown(report, md)
    print(
        "\n".join(
            f"  {r['target']}: {r['measured']} (goal {r['goal']}, met: {r['met']})"
            for r in report["targets"]
        )
    )
    print(f"wrote {out}" + (f" and {md}" if md else ""))


if __name__ == "__main__":
    main()
