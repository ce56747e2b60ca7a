"""Build the Triton attention kernels for Hopper (sm_90a) on a machine without a GPU and report, per
kernel, registers, register spills and shared memory from `ptxas -v`.

    python tests/ptxas_report.py                       # head dims 64 80 128 256, bf16, every kernel
    python tests/ptxas_report.py --head-dims 128 --kernels fwd bwd_fused
    python tests/ptxas_report.py --json out.json

Triton's own compiler and its bundled ptxas run on the CPU: no CUDA device is needed. Pointers and
strides are marked 16-byte aligned, as Triton specialises them at launch for aligned tensors. The
launch shapes are those of kernels/_flash_attn_triton.py's table for (head dim, dtype). Exits 1
when a build overflows shared memory, or spills registers in a table row not timed on a GPU
(`GPU_TIMED`: there the measured fastest shape stands), unless --no-fail.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # build for the GPU, even when called from a test session

ROOT = Path(__file__).resolve().parents[1]
SHARED_LIMIT = 227 * 1024  # bytes of shared memory a Hopper block may use
KERNELS = ("fwd", "decode", "bwd_fused", "bwd_split", "dq")


def _jobs(k, D: int, dt: str, kernels):
    """(name, jit function, pointer types, constexprs, launch config) for each kernel asked for."""
    import torch

    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
    cfg = k.tile_config(D, tdt)
    flags = k._flags(tdt)
    pad = k.head_dim_pad(D)
    T = "*" + dt
    meta = {n: "*i32" for n in ("QPOS", "KPOS", "QSEG", "KSEG", "PLAN")}
    f32 = "*fp32"
    common = dict(HEAD_DIM=D, HEAD_DIM_PAD=pad, CAUSAL=True, **flags)
    out = []
    if "fwd" in kernels:
        c = cfg.fwd
        out.append(
            (
                "fwd",
                k._fwd_kernel,
                dict(meta, Q=T, K=T, V=T, O=T, LSE=f32),
                dict(common, EVEN_D=D == pad, BLOCK_M=c.block_m, BLOCK_N=c.block_n),
                c,
            )
        )
    if "decode" in kernels:
        c = cfg.decode
        out.append(
            (
                "decode",
                k._decode_kernel,
                dict(meta, Q=T, K=T, V=T, OP=f32, LP=f32),
                dict(common, BLOCK_M=c.block_m, BLOCK_N=c.block_n),
                c,
            )
        )
    bwd_ptrs = dict(meta, Q=T, K=T, V=T, DO=T, LSE2=f32, DELTA=f32, DQ=f32, DK=f32, DV=f32)
    c = cfg.bwd
    if "bwd_fused" in kernels:
        out.append(
            (
                "bwd_fused",
                k._bwd_kernel,
                bwd_ptrs,
                dict(
                    common,
                    EVEN_D=D == pad,
                    BLOCK_M=c.block_m,
                    BLOCK_N=c.block_n,
                    PER_HEAD=True,
                    ATOMIC_KV=True,
                    FUSED_DQ=True,
                    KV_SMEM=cfg.kv_smem,
                ),
                c,
            )
        )
    if "bwd_split" in kernels:
        out.append(
            (
                "bwd_split",
                k._bwd_kernel,
                bwd_ptrs,
                dict(
                    common,
                    EVEN_D=D == pad,
                    BLOCK_M=c.block_m,
                    BLOCK_N=c.block_n,
                    PER_HEAD=False,
                    ATOMIC_KV=False,
                    FUSED_DQ=False,
                    KV_SMEM=cfg.kv_smem,
                ),
                c,
            )
        )
    if "dq" in kernels:
        c = cfg.dq
        out.append(
            (
                "dq",
                k._bwd_dq_kernel,
                dict(meta, Q=T, K=T, V=T, DO=T, LSE2=f32, DELTA=f32, DQ=f32),
                dict(common, EVEN_D=D == pad, BLOCK_M=c.block_m, BLOCK_N=c.block_n),
                c,
            )
        )
    return out


def build(D: int, dt: str, kernels, cache_dir: str | None = None) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if cache_dir:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
    sys.path.insert(0, str(ROOT))
    from longvideo.kernels import _flash_attn_triton as k

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    rows = []
    for name, fn, ptrs, const, cfg in _jobs(k, D, dt, kernels):
        t0 = time.time()
        sig = {
            n: ptrs.get(n, "constexpr" if n in const else "fp32" if n.endswith("scale") else "i32")
            for n in fn.arg_names
        }
        # what the launcher specialises on for aligned tensors: 16-aligned pointers and strides
        attrs = {
            (i,): [["tt.divisibility", 16]]
            for i, n in enumerate(fn.arg_names)
            if sig[n].startswith("*") or (n.startswith("stride_") and n != "stride_plan")
        }
        src = ASTSource(
            fn=fn,
            signature=sig,
            constexprs={(fn.arg_names.index(n),): v for n, v in const.items()},
            attrs=attrs,
        )
        ck = triton.compile(
            src,
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        )
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ck.asm["ptx"])
        r = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        )
        os.unlink(f.name)
        regs = [int(x) for x in re.findall(r"Used (\d+) registers", r.stderr)]
        spill = [
            int(a) + int(b)
            for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
        ]
        rows.append(
            dict(
                kernel=name,
                head_dim=D,
                dtype=dt,
                block_m=cfg.block_m,
                block_n=cfg.block_n,
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
                registers=max(regs or [0]),
                spill_bytes=sum(spill),
                shared_bytes=ck.metadata.shared,
                build_s=round(time.time() - t0, 1),
            )
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 80, 128, 256])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--no-fail", action="store_true")
    args = p.parse_args(argv)
    rows = []
    for D in args.head_dims:
        for row in build(D, args.dtype, args.kernels):
            rows.append(row)
            print(
                f"D={row['head_dim']:>3} {row['kernel']:<9} {row['block_m']:>3}x{row['block_n']:<3} "
                f"w{row['num_warps']} s{row['num_stages']}: {row['registers']:>3} registers, "
                f"{row['spill_bytes']} bytes spilled, {row['shared_bytes'] / 1024:.0f} KiB shared "
                f"({row['build_s']} s)",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    from longvideo.kernels import (
        _flash_attn_triton as k,
    )  # importable now: build() put ROOT on the path

    kind = "fp32" if args.dtype == "fp32" else "16bit"
    bad = [
        r
        for r in rows
        if r["shared_bytes"] > SHARED_LIMIT
        or (r["spill_bytes"] and (k.head_dim_pad(r["head_dim"]), kind) not in k.GPU_TIMED)
    ]
    if bad and not args.no_fail:
        print("FAILED: " + ", ".join(f"D={r['head_dim']} {r['kernel']}" for r in bad))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
