"""Hybrid sequence parallelism on CPU, 4 gloo ranks: one attention layer (q, k, v, output projections)
at one total length as a ring of 4 (U = 1), 2 Ulysses groups x a ring of 2 and pure Ulysses (U = 4).

    python scripts/bench_hybrid.py                       # S = 8192, 8 / 8 heads, D = 64
    python scripts/bench_hybrid.py --kv-heads 2 --out /tmp/gqa.json

Per rank: step time, bytes sent, peak memory and bytes saved for backward (docs/hybrid.md).
Writes docs/bench/hybrid.json.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import threading
import time

from benchreport import (
    Section,
    Target,
    arg_parser,
    md_table,
    req,
    req_list,
    save,
    settings,
    spawn_ranks,
    yes_no,
)

TITLE = "Hybrid sequence parallelism (Ulysses x ring)"
DOCS = ["hybrid.md"]
TARGETS = [
    Target("hybrid: bytes per rank, U = 2 x ring 2 / ring of 4", "<= 0.5"),
    Target("hybrid: per-rank activation memory, U = 2 x ring 2 / ring of 4", "within 1.2x"),
]


def report(result: dict) -> Section:
    rows = {int(req(r, "ulysses")): r for r in req_list(result, "rows")}
    ring, cfg = rows[1], result["config"]
    body = [
        [
            f"{u} x {4 // u}",
            f"{r['step_s']:.3f}",
            f"{r['step_s_min']:.3f}-{r['step_s_max']:.3f}",
            f"{r['bytes_sent'] / 2**20:.1f}",
            f"{r['bytes_sent'] / ring['bytes_sent']:.2f}",
            f"{r['peak_mib']:.1f}",
            f"{r['peak_mib'] / ring['peak_mib']:.2f}",
            f"{r['saved_mib']:.1f}",
        ]
        for u, r in sorted(rows.items())
    ]
    table = md_table(
        [
            "U x ring",
            "step s (slowest rank, median)",
            "spread",
            "MiB sent / rank",
            "vs ring",
            "peak MiB / rank",
            "vs ring",
            "saved for backward MiB / rank",
        ],
        body,
    )
    b, m = rows[2]["bytes_sent"] / ring["bytes_sent"], rows[2]["peak_mib"] / ring["peak_mib"]
    t = [
        Target(TARGETS[0].what, TARGETS[0].goal, f"{b:.2f}", yes_no(b <= 0.5)),
        Target(TARGETS[1].what, TARGETS[1].goal, f"{m:.2f}x", yes_no(m <= 1.2)),
    ]
    return Section(
        table,
        t,
        [
            f"S = {cfg['seq']:,}, heads {cfg['heads']}/{cfg['kv_heads']}, D = {cfg['head_dim']}, fp32; "
            f"{cfg['threads']} thread(s) a rank on {cfg['cores']} cores (shared: times indicative)."
        ],
    )


class _MallInfo(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_peak_mib(fn) -> float:
    """Runs fn(); the peak rise of malloc's bytes in use (mallinfo2, sampled every 0.5 ms), in MiB: live
    allocations rather than the resident set, which keeps freed pages (docs/hybrid.md)."""
    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = _MallInfo
    in_use = lambda: (m := mallinfo2()).uordblks + m.hblkhd  # noqa: E731
    base, done = in_use(), threading.Event()
    peak = [base]

    def sample():
        while not done.wait(0.0005):
            peak[0] = max(peak[0], in_use())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    fn()
    done.set()
    sampler.join()
    return (max(peak[0], in_use()) - base) / 2**20


def _rank(rank, world, args) -> dict:
    import torch
    import torch.distributed as dist

    from longvideo.kernels import AttentionMeta
    from longvideo.parallel import CommStats, Mesh, hybrid_attention, ring_attention, zigzag_indices

    torch.set_num_threads(args.threads)
    n, H, D, out = args.seq // world, args.heads, args.head_dim, {"rows": []}
    torch.manual_seed(0)  # the layer: q, k, v and output projections around attention
    w = [
        (torch.randn(H * D, h * D) / (H * D) ** 0.5).requires_grad_()
        for h in (H, args.kv_heads, args.kv_heads, H)
    ]
    x, dy = torch.randn(2, 1, n, H * D, generator=torch.Generator().manual_seed(rank))
    pos = zigzag_indices(args.seq, world, rank)[None]
    for u, mesh in ((u, Mesh.build(sp=world, ulysses=u)) for u in (1, 2, 4)):

        def step(stats, saved):
            def pack(
                t,
            ):  # bytes kept for backward, each storage once (the input and weights excluded)
                if t.untyped_storage().data_ptr() not in [m.data_ptr() for m in (xx, *w)]:
                    saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            xx = x.detach().requires_grad_(True)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                q, k, v = ((xx @ m).view(1, n, -1, D) for m in w[:3])
                meta = AttentionMeta.self_attention(pos, torch.zeros_like(pos))
                attend, group = (
                    (ring_attention, mesh.sp_group)
                    if u == 1
                    else (hybrid_attention, mesh.ulysses_groups)
                )  # the same arguments
                o = attend(q, k, v, meta, group=group, backend="cpu", comm_stats=stats)
                (o.reshape(1, n, -1) @ w[3]).backward(dy)

        times, stats = [], CommStats()
        for i in range(args.iters + 1):  # the first is a warm-up
            stats.reset()
            dist.barrier()
            t0 = time.perf_counter()
            step(stats, {})
            times += [time.perf_counter() - t0] if i else []
        saved: dict = {}
        peak = malloc_peak_mib(lambda: step(CommStats(), saved))
        out["rows"].append(
            {
                "ulysses": u,
                "step_s": statistics.median(times),
                "step_s_all": times,
                "bytes_sent": stats.bytes_sent,
                "peak_mib": peak,
                "saved_mib": sum(saved.values()) / 2**20,
            }
        )
    return out


def main(argv=None) -> None:
    p = arg_parser(__doc__, "hybrid")
    for name, default in (
        ("seq", 8192),
        ("heads", 8),
        ("kv-heads", 8),
        ("head-dim", 64),
        ("iters", 5),
        ("threads", 1),
    ):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args(argv)
    ranks = spawn_ranks(_rank, 4, args, label="bench_hybrid")
    rows = []
    for per in zip(
        *(r["rows"] for r in ranks)
    ):  # per split: the slowest rank's median, the largest figures
        rows.append(
            {
                "ulysses": per[0]["ulysses"],
                "step_s_min": min(min(r["step_s_all"]) for r in per),
                "step_s_max": max(max(r["step_s_all"]) for r in per),
                **{
                    k: max(r[k] for r in per)
                    for k in ("step_s", "bytes_sent", "peak_mib", "saved_mib")
                },
            }
        )
    cfg = settings(args) | {"cores": os.cpu_count()}
    save({"config": cfg, "rows": rows}, args.out, report=report)


if __name__ == "__main__":
    main()
