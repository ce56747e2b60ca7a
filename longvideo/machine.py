"""What machine a run was measured on (CPU, vector extensions, torch build, a one-second float32
matmul probe), so that times from different machines are read side by side (docs/benchmarks.md)."""

from __future__ import annotations

import os
import platform
import time

VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def _cpuinfo() -> tuple[str, list[str]]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor() or platform.machine(), []
    fields = {
        k.strip(): v.strip()
        for k, v in (line.split(":", 1) for line in text.splitlines() if ":" in line)
    }
    flags = set(fields.get("flags", "").split())
    return fields.get("model name", platform.machine()), [f for f in VECTOR_FLAGS if f in flags]


def matmul_gflops(seconds: float = 1.0, n: int = 512) -> float:
    """float32 n x n matmuls for about `seconds` on torch's threads: the rate in GFLOP/s."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm the threads
    reps, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds or reps == 0:
        a @ b
        reps += 1
    return 2 * n**3 * reps / elapsed / 1e9


def machine_info(probe_seconds: float = 1.0) -> dict:
    import torch

    model, flags = _cpuinfo()
    return {
        "cpu": model,
        "vector": flags,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "matmul_gflops": round(matmul_gflops(probe_seconds), 1),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def describe(m: dict) -> str:
    """'AMD EPYC (avx2), 2 cores, float32 matmul 95.0 GFLOP/s, load 0.12'; '?' for what a record lacks."""
    vector = f" ({', '.join(m['vector'])})" if m.get("vector") else ""
    return (
        f"{m.get('cpu', '?')}{vector}, {m.get('cores', '?')} cores, float32 matmul "
        f"{m.get('matmul_gflops', '?')} GFLOP/s, load {(m.get('loadavg') or ['?'])[0]}"
    )
