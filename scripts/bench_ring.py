"""Benchmark ring attention on CPU (gloo): W = 1, 2, 4 processes at one total sequence length.

    python scripts/bench_ring.py                         # defaults: a few minutes on 2 cores
    python scripts/bench_ring.py --seq 65536 --threads 4 --worlds 1,2,4 --iters 3

Causal attention, forward + backward, fp32, the `cpu` block backend. W = 1 is one process doing the
whole sequence (the baseline); W > 1 runs the zigzag layout, and also a contiguous layout to show
what the zigzag balances. Per rank: step time, exposed communication (time blocked waiting for a
transfer the compute did not hide; the part of it after both neighbours had posted their side is
the transfer's own share), compute and CPU time, peak memory of the step (malloc'd bytes
in use above the inputs, sampled) and the bytes saved for backward. Writes docs/bench/ring.json and ring.png.

Every rank uses --threads threads, as the baseline does, so T_single / (W x T_ring) = 1 means W
ranks did the one-process work W times faster; that needs W x threads free cores (the JSON records
the machine's core count and load).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# ------------------------------------------------------------------------------------------- report
# Read by run_benchmarks.py to build docs/benchmarks.md: the title, what is measured, the detail docs
# under docs/ (the first that exists is linked), the targets (the summary rows while nothing is
# measured) and report(), which turns this script's JSON into a table, the targets met or not, and
# notes.

from benchreport import Section, Target, fmt_num, md_table, req, req_list, yes_no

TITLE = "Ring attention"
MEASURES = ("Causal attention forward + backward over W = 1, 2, 4 gloo ranks at one total length: step "
            "time, exposed communication, balance and per-rank memory, against one process doing the whole "
            "sequence (W = 1); a contiguous split is run beside the zigzag layout.")
DOCS = ["ring_attention.md"]
TARGETS = [Target("ring: per-rank activation memory", "within 1.2x of single / W"),
           Target("ring: exposed communication", "< 10 % of the step at S_local >= 8K"),
           Target("ring: zigzag balance", "slowest rank within 10 % of the mean")]


def report(result: dict) -> Section:
    rows = req_list(result, "rows")
    body = []
    for r in rows:
        body.append([str(req(r, "world")), req(r, "layout"), f"{req(r, 's_local'):,}",
                     fmt_num(req(r, "step_s")), fmt_num(r.get("ideal_ratio"), ".2f"),
                     fmt_num(r.get("ideal_ratio_cpu"), ".2f"), fmt_num(100 * req(r, "exposed_frac_max"), ".1f", " %"),
                     fmt_num(r.get("exposed_transfer_frac_max") and 100 * r["exposed_transfer_frac_max"], ".1f", " %"),
                     fmt_num(r.get("serial_comm_frac") and 100 * r["serial_comm_frac"], ".1f", " %"),
                     fmt_num(req(r, "balance_slowest_over_mean"), ".3f"),
                     fmt_num(r.get("saved_mem_over_single_div_w"), ".2f", "x"),
                     fmt_num(r.get("peak_mem_over_single_div_w"), ".2f", "x")])
    zig = [r for r in rows if r["world"] > 1 and r["layout"] == "zigzag"]
    mem_t, comm_t, bal_t = (Target(t.what, t.goal) for t in TARGETS)
    if not zig:
        for t in (mem_t, comm_t, bal_t):
            t.figure, t.met = "no zigzag run with W > 1", "unknown"
        return Section(md_table(RING_HEADERS, body), [mem_t, comm_t, bal_t], [])
    saved = [(r["world"], r["saved_mem_over_single_div_w"]) for r in zig if r.get("saved_mem_over_single_div_w")]
    peak = [r["peak_mem_over_single_div_w"] for r in zig if r.get("peak_mem_over_single_div_w")]
    if saved:
        worst = max(v for _, v in saved)
        mem_t.figure = (f"saved for backward: {worst:.2f}x (worst of W = {', '.join(str(w) for w, _ in saved)})"
                        + (f"; whole-step peak {max(peak):.2f}x" if peak else ""))
        mem_t.met = (f"saved for backward: {yes_no(worst <= 1.2)}; whole-step peak: {yes_no(max(peak) <= 1.2)}"
                     if peak else yes_no(worst <= 1.2))
    else:
        mem_t.figure, mem_t.met = "no memory figures in the JSON", "unknown"
    big = [r for r in zig if r["s_local"] >= 8192]
    if big:
        ws = ", ".join(str(r["world"]) for r in big)
        wait = max(r["exposed_frac_max"] for r in big)
        own = [r["exposed_transfer_frac_max"] for r in big
               if isinstance(r.get("exposed_transfer_frac_max"), (int, float))]
        serial = [r["serial_comm_frac"] for r in big if isinstance(r.get("serial_comm_frac"), (int, float))]
        if own:  # judged on the transfer's own exposed time; waiting on a late neighbour is shown beside it
            comm_t.figure = (f"transfer's own exposed time {100 * max(own):.1f} % (worst rank, W = {ws}); all "
                             f"time blocked in wait {100 * wait:.1f} %")
            comm_t.met = yes_no(max(own) < 0.10)
        else:
            comm_t.figure = f"{100 * wait:.1f} % blocked in wait (worst rank, W = {ws}, S_local >= 8K)"
            comm_t.met = yes_no(wait < 0.10)
        if serial:
            comm_t.figure += f"; the transfers alone, unoverlapped, {100 * max(serial):.1f} % of the step"
    else:
        comm_t.figure = f"no zigzag run with S_local >= 8K (largest {max(r['s_local'] for r in zig):,})"
        comm_t.met = "unknown"
    worst = max(r["balance_slowest_over_mean"] for r in zig)
    bal_t.figure = f"slowest / mean CPU s = {worst:.3f} (worst of W = {', '.join(str(r['world']) for r in zig)})"
    bal_t.met = yes_no(worst <= 1.10)
    notes = []
    a = result.get("args") or {}
    if a:
        notes.append(f"Causal attention forward + backward, total S = {a.get('seq'):,}, {a.get('heads')} heads / "
                     f"{a.get('kv_heads')} key-value heads of dim {a.get('head_dim')}, {a.get('dtype')}, backend "
                     f"`{a.get('backend')}`, {a.get('threads')} thread(s) per rank, median of {a.get('iters')} steps.")
    notes.append("\"ideal\" is T_single / (W x T_ring): 1.0 means W ranks did the one-process work W times faster; "
                 "the wall-clock figure needs W free cores, the CPU-seconds figure does not. \"Blocked in wait\" "
                 "is all the time a rank spent in `wait()`, including waiting on a neighbour that was late "
                 "(on an oversubscribed machine, descheduled); the transfer's own exposed time is the part after "
                 "both neighbours had posted their side of the hop, and the exposed-communication target is "
                 "judged on it where the JSON has it (on the whole wait otherwise). \"Serial transfers\" is one "
                 "bare hop times the 3W-2 hops of a step, over the step: the cost if nothing overlapped. Memory is shown two ways: the activations each "
                 "rank saves for backward (what grows with depth), and the whole-step peak of one attention "
                 "call, which also counts the ring's per-call workspace (K/V blocks in flight, partial "
                 "gradients); see the detailed doc.")
    contig = [r for r in rows if r["world"] > 1 and r["layout"] == "contiguous"]
    if contig:
        notes.append("Contiguous rows (no zigzag) show the imbalance the zigzag layout removes: slowest / mean "
                     + ", ".join(f"{r['balance_slowest_over_mean']:.2f} at W = {r['world']}" for r in contig) + ".")
    return Section(md_table(RING_HEADERS, body), [mem_t, comm_t, bal_t], notes)


RING_HEADERS = ["W", "layout", "S_local", "step s (slowest rank)", "ideal (wall)", "ideal (CPU s)",
                "blocked in wait (worst rank)", "transfer's own exposed time (worst rank)",
                "serial transfers / step", "slowest / mean CPU s", "saved for backward / (single / W)",
                "step peak / (single / W)"]


ROOT = Path(__file__).resolve().parent.parent


class MallocPeak:
    """Peak bytes in use by malloc (glibc mallinfo2: heap in use + mmapped chunks) over a region,
    sampled every 0.5 ms by a thread. Counts live allocations, not pages glibc keeps after a
    free, so consecutive measurements in one process do not disturb each other."""

    def __init__(self):
        import ctypes

        class _Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                       "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

        self._fn = ctypes.CDLL("libc.so.6").mallinfo2
        self._fn.restype = _Info

    def in_use(self) -> int:
        m = self._fn()
        return m.uordblks + m.hblkhd

    def __enter__(self):
        import threading

        self.base = self.peak = self.in_use()
        self._stop = threading.Event()

        def sample():
            while not self._stop.is_set():
                self.peak = max(self.peak, self.in_use())
                time.sleep(0.0005)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.in_use())

    @property
    def delta_mib(self) -> float:
        return (self.peak - self.base) / 2**20


def _malloc_peak():
    try:
        return MallocPeak()
    except (OSError, AttributeError):  # not glibc >= 2.33
        return None


def _rank_main(rank, world, init_file, args, plan, queue):
    """One process of the benchmark world: runs every (W, layout) of the plan; ranks >= W idle."""
    try:
        torch.set_num_threads(args.threads)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=3600))
        # new_group is collective over the world: every rank creates every ring, in order
        rings = {w: dist.new_group(list(range(w))) for w in sorted({w for w, _ in plan})}
        # all timings first, then the memory steps (their sampling thread must not touch timings)
        for phase in ("time", "memory"):
            for w, layout in plan:
                if rank < w:
                    queue.put((w, layout, rank, phase, _measure(rank, w, rings[w], args, layout, phase)))
                dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        queue.put((None, None, rank, None, {"error": f"{e!r}\n{traceback.format_exc()}"}))


def _exposed_transfer(timeline: list, group) -> float:
    """Seconds this rank was blocked after both ring neighbours had posted their side of each hop:
    time attributable to the transfer itself, not to a neighbour that is late (busy, or descheduled
    on a shared machine). All ranks run on one host, so perf_counter times are comparable."""
    ev = torch.tensor(timeline, dtype=torch.float64)  # (hops, 3): posted, wait start, wait end
    W, r = dist.get_world_size(group), dist.get_rank(group)
    every = [torch.empty_like(ev) for _ in range(W)]
    dist.all_gather(every, ev, group=group)
    start = torch.stack([ev[:, 1], every[(r - 1) % W][:, 0], every[(r + 1) % W][:, 0]]).amax(0)
    return float((ev[:, 2] - start).clamp_min(0).sum())


def _measure(rank, world, group, args, layout, phase):
    from longvideo.parallel import CommStats, RingComm, ring_attention, zigzag_indices

    S, H, Hkv, D = args.seq, args.heads, args.kv_heads, args.head_dim
    n = S // world
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(rank)
    q, k, v, dout = (torch.randn(1, n, h, D, generator=g).to(dtype) for h in (H, Hkv, Hkv, H))
    if layout == "zigzag":
        pos = zigzag_indices(S, world, rank)[None]
    else:
        pos = torch.arange(rank * n, (rank + 1) * n)[None]

    def step(stats, saved=None):
        qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))

        def pack(t):  # bytes kept for backward, each storage once
            st = t.untyped_storage()
            saved[(st.data_ptr(), st.nbytes())] = st.nbytes()
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if saved is not None else None
        if hooks is not None:
            hooks.__enter__()
        try:
            out = ring_attention(qq, kk, vv, group=group, positions=pos, backend=args.backend, comm_stats=stats)
        finally:
            if hooks is not None:
                hooks.__exit__(None, None, None)
        out.backward(dout)

    if phase == "memory":
        # peak malloc'd bytes during one step above what is live before it (inputs excluded)
        saved: dict = {}
        dist.barrier(group)
        meter = _malloc_peak()
        if meter is None:
            step(CommStats(), saved)
        else:
            with meter:
                step(CommStats(), saved)
        return {"peak_mib": meter.delta_mib if meter is not None else None,
                "saved_mib": sum(saved.values()) / 2**20,
                "q_mib": n * H * D * torch.tensor([], dtype=dtype).element_size() / 2**20}
    for _ in range(args.warmup):  # first-call costs (thread pools, gloo pair buffers) stay out
        step(CommStats())
    times, cpu, exposed, transfer, compute = [], [], [], [], []
    for _ in range(args.iters):
        stats = CommStats(timeline=[])
        dist.barrier(group)
        t0, c0 = time.perf_counter(), time.process_time()
        step(stats)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        exposed.append(stats.exposed_s)
        compute.append(stats.compute_s)
        transfer.append(_exposed_transfer(stats.timeline, group) if world > 1 else 0.0)
    # a bare hop (one key/value block with its metadata, no compute): what a step would expose if
    # nothing overlapped; unlike the waits above it does not depend on the other ranks' timing
    hop = []
    if world > 1:
        ring = RingComm(group)
        send = [torch.stack([k, v]), torch.stack([pos, pos])]
        recv = [torch.empty_like(t) for t in send]
        for _ in range(3):
            dist.barrier(group)
            t0 = time.perf_counter()
            ring.exchange(send, recv).wait()
            hop.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "cpu_s": statistics.median(cpu),
            "exposed_s": statistics.median(exposed), "exposed_transfer_s": statistics.median(transfer),
            "compute_s": statistics.median(compute),
            "step_s_all": times, "s_local": n, "hop_s": statistics.median(hop) if hop else 0.0}


def run_plan(plan, args):
    """All (W, layout) runs in one spawned world of max W processes -> {(W, layout): [rank results]}."""
    world = max(w for w, _ in plan)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    results: dict = {}
    expected = 2 * sum(w for w, _ in plan)  # a timing and a memory result per rank and run
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_rank_main, args=(r, world, os.path.join(d, "rdzv"), args, plan, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        done = 0
        while done < expected:
            try:
                w, layout, rank, phase, res = queue.get(timeout=10)
            except Exception:  # noqa: BLE001 - queue.Empty: check that nobody died silently
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    for p in procs:
                        p.kill()
                    raise RuntimeError(f"ranks exited without a result: {dead}") from None
                continue
            if "error" in res:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"rank {rank} failed:\n{res['error']}")
            results.setdefault((w, layout), {}).setdefault(rank, {}).update(res)
            if phase == "time" and rank == 0:
                print(f"  timed W={w} {layout}", flush=True)
            done += 1
        for p in procs:
            p.join()
    return {key: [ranks[r] for r in range(key[0])] for key, ranks in results.items()}


def summarise(world, layout, ranks, single):
    step = max(r["step_s"] for r in ranks)  # the ring advances at the pace of its slowest rank
    cpu = [r["cpu_s"] for r in ranks]  # CPU seconds: not inflated by being descheduled on a busy machine
    row = {
        "world": world, "layout": layout, "s_local": ranks[0]["s_local"], "step_s": step,
        "ranks": ranks,
        "exposed_frac_max": max(r["exposed_s"] / r["step_s"] for r in ranks),
        "exposed_transfer_frac_max": max(r["exposed_transfer_s"] / r["step_s"] for r in ranks),
        # 3W-2 hops per step (W-1 forward, W-1 + W backward; dK/dV sums are fp32 like the block
        # here): their serial time over the step is what the overlap has to hide
        "serial_comm_frac": max(r["hop_s"] for r in ranks) * (3 * world - 2) / step if world > 1 else 0.0,
        "balance_slowest_over_mean": max(cpu) / statistics.mean(cpu),
    }
    if single is not None:
        row["ideal_ratio"] = single["step_s"] / (world * step)
        # the same ratio in CPU seconds: what wall time would show with W idle cores for W ranks
        # (the shared 2-core machine time-slices W busy processes with everyone else's work)
        row["ideal_ratio_cpu"] = single["cpu_s"] / (world * max(cpu))
        row["cpu_efficiency"] = single["cpu_s"] / sum(cpu)  # total CPU work vs one process
        if single["peak_mib"] and all(r["peak_mib"] is not None for r in ranks):
            row["peak_mem_over_single_div_w"] = max(r["peak_mib"] for r in ranks) / (single["peak_mib"] / world)
        row["saved_mem_over_single_div_w"] = max(r["saved_mib"] for r in ranks) / (single["saved_mib"] / world)
    return row


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    zig = [r for r in rows if r["layout"] == "zigzag"]
    single = dict(zig[0], cpu_s=zig[0]["ranks"][0]["cpu_s"])
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    ws = [r["world"] for r in zig]
    ax[0].plot(ws, [r["step_s"] for r in zig], "o-", label="ring, wall (zigzag)")
    ax[0].plot(ws, [single["step_s"] / w for w in ws], "k--", label="ideal wall T_single / W")
    cpu = [max(rk["cpu_s"] for rk in r["ranks"]) for r in zig]
    ax[0].plot(ws, cpu, "s-", label="ring, CPU s of slowest rank")
    ax[0].plot(ws, [single["ranks"][0]["cpu_s"] / w for w in ws], "k:", label="ideal CPU s / W")
    for r, c in zip(zig, cpu):
        if r["world"] > 1:
            ax[0].annotate(f"{r['ideal_ratio']:.0%}", (r["world"], r["step_s"]), textcoords="offset points",
                           xytext=(5, 5))
            ax[0].annotate(f"{r['ideal_ratio_cpu']:.0%}", (r["world"], c), textcoords="offset points",
                           xytext=(5, -12))
    ax[0].set(xlabel="ranks W", ylabel="fwd+bwd step (s)", title="Step time (ratio to ideal)", xticks=ws)
    ax[0].legend()
    # per-rank work (CPU seconds, immune to time-slicing) and exposed wait, zigzag vs contiguous
    labels, work, expo = [], [], []
    for r in rows:
        if r["world"] == 1:
            continue
        for i, rk in enumerate(r["ranks"]):
            labels.append(f"{r['layout'][:3]} W{r['world']}\nr{i}")
            work.append(rk["cpu_s"])
            expo.append(rk["exposed_s"])
    x = list(range(len(labels)))
    ax[1].bar([i - 0.2 for i in x], work, width=0.4, label="CPU s of the step (work)")
    ax[1].bar([i + 0.2 for i in x], expo, width=0.4, label="exposed comm / wait (wall s)")
    ax[1].set_xticks(x, labels, fontsize=7)
    ax[1].set(ylabel="seconds per step", title="Per-rank balance: zigzag vs contiguous")
    ax[1].legend(fontsize=8)
    mem = [max(rk["peak_mib"] or 0 for rk in r["ranks"]) for r in zig]
    sav = [max(rk["saved_mib"] for rk in r["ranks"]) for r in zig]
    ax[2].plot(ws, mem, "o-", label="peak during step (max rank)")
    ax[2].plot(ws, [single["ranks"][0]["peak_mib"] / w for w in ws], "k--", label="single peak / W")
    ax[2].plot(ws, sav, "s-", label="saved for backward")
    ax[2].set(xlabel="ranks W", ylabel="MiB", title="Per-rank memory", xticks=ws)
    ax[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=16384, help="total sequence length (multiple of 2 x max W)")
    ap.add_argument("--worlds", default="1,2,4", help="comma-separated ring sizes; 1 is the baseline")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (and for the baseline)")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before the timed ones")
    ap.add_argument("--no-contiguous", action="store_true", help="skip the contiguous-layout comparison")
    ap.add_argument("--out", default=str(ROOT / "docs/bench/ring.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs/bench/ring.png"))
    args = ap.parse_args(argv)
    worlds = sorted({int(w) for w in args.worlds.split(",")} | {1})
    if args.seq % (2 * max(worlds)):
        ap.error(f"--seq {args.seq} must be a multiple of 2 x {max(worlds)}")
    load_before = os.getloadavg()
    plan = [(w, layout) for w in worlds
            for layout in (("zigzag",) if (w == 1 or args.no_contiguous) else ("zigzag", "contiguous"))]
    t0 = time.perf_counter()
    measured = run_plan(plan, args)
    rows, single = [], measured[(1, "zigzag")][0]
    for w, layout in plan:
        row = summarise(w, layout, measured[(w, layout)], single)
        rows.append(row)
        print(f"W={w} {layout:10s} S_local={row['s_local']:6d} step {row['step_s']:.3f}s "
              f"ideal {row.get('ideal_ratio', 1):.2f} (cpu {row.get('ideal_ratio_cpu', 1):.2f}) exposed<={row['exposed_frac_max']:.1%} "
              f"(transfer {row['exposed_transfer_frac_max']:.1%}) "
              f"serial comm {row['serial_comm_frac']:.1%} balance {row['balance_slowest_over_mean']:.3f} "
              f"peak/(single/W) {row.get('peak_mem_over_single_div_w', float('nan')):.2f} "
              f"saved/(single/W) {row.get('saved_mem_over_single_div_w', float('nan')):.2f}", flush=True)
    print(f"total {time.perf_counter() - t0:.0f}s")
    result = {
        "benchmark": "ring attention, causal fwd+bwd, CPU gloo",
        "args": vars(args),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                    "torch": torch.__version__, "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(rows, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
