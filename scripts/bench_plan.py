"""Cost of building the attention tile plans on the CPU: the dense plan the Triton kernels used to
build on every call against the sorted-range plan they use now, at 64K, 256K and 1M tokens.

    python scripts/bench_plan.py                          # causal, one document, bf16 D = 128 tiles
    python scripts/bench_plan.py --seqlens 65536 --layout packed

"old": per call, classify every (query tile, key tile) pair (attention_math.classify_tiles) and
argsort each row of the table into a visit list, for the forward tiles (128 x 64) and again for the
backward's dK/dV tiles (32 x 128, transposed) and dQ tiles (128 x 64): O(tiles^2) integers, rebuilt
by every layer and every ring step. "new": attention_math.visit_ranges for the forward tiles and the
fused backward's transposed tiles: O(tiles) integers, built once per (positions, segment ids) and
kept by the caller. Each measurement runs in a fresh process: CPU seconds of the build and the
peak resident memory it adds over the process's baseline (metadata included in the baseline).

Writes docs/bench/plan.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# ------------------------------------------------------------------------------------------- report
# Read by run_benchmarks.py to build docs/benchmarks.md: the title, what is measured, the detail docs
# under docs/ (the first that exists is linked), the targets (the summary rows while nothing is
# measured) and report(), which turns this script's JSON into a table, the targets met or not, and
# notes.

from benchreport import Section, Target, fmt_num, md_table, req_list, yes_no  # noqa: E402

TITLE = "Attention tile plans: build cost"
MEASURES = ("CPU time and added peak memory of building the Triton kernels' tile plans, the previous dense "
            "(query tiles x key tiles) table against the sorted ranges, at 64K-1M tokens.")
DOCS = ["kernels.md"]
TARGETS = [Target("plan: tile plan build at 1M tokens (CPU)", "O(tiles): no query x key tile table")]


def report(result: dict) -> Section:
    t = Target(TARGETS[0].what, TARGETS[0].goal)
    rows = {(r["kind"], r["seqlen"]): r for r in req_list(result, "results")}
    body = []
    for S in sorted({S for _, S in rows}):
        old, new = rows.get(("old", S), {}), rows.get(("new", S), {})
        body.append([f"{S:,}", fmt_num(old.get("cpu_s"), ".2f"), fmt_num(new.get("cpu_s"), ".3f"),
                     fmt_num(old.get("peak_added_mib"), ",.0f"), fmt_num(new.get("peak_added_mib"), ",.0f"),
                     fmt_num(old.get("plan_mib"), ",.1f"), fmt_num(new.get("plan_mib"), ",.2f")])
    big = max((S for k, S in rows if k == "new" and "cpu_s" in rows[(k, S)]), default=None)
    if big is not None:
        new, old = rows[("new", big)], rows.get(("old", big), {})
        t.figure = (f"at {big:,} tokens: {new['cpu_s']:.2f} CPU-s, {new['plan_mib']:.1f} MiB"
                    + (f" (old: {old['cpu_s']:.0f} CPU-s, {old['plan_mib']:,.0f} MiB, per call)" if "cpu_s" in old else ""))
        t.met = yes_no(not old or new["plan_mib"] * 100 < old.get("plan_mib", 0))
    headers = ["S", "old CPU s", "new CPU s", "old peak added MiB", "new peak added MiB", "old plan MiB",
               "new plan MiB"]
    notes = [f"Tiles: {result.get('tiles', '?')}. The old plans were built by every call (every layer, every ring "
             "step); the new ones once per positions / segment ids, kept by the caller."]
    return Section(md_table(headers, body), [t], notes)



def _metadata(layout: str, S: int):
    import torch

    if layout == "causal":
        return torch.arange(S)[None], torch.zeros(1, S, dtype=torch.long)
    g = torch.Generator().manual_seed(0)  # 300 documents, positions restarting, 1/64 padding at the end
    cuts = torch.sort(torch.randint(1, S - S // 64, (299,), generator=g)).values
    starts = torch.cat([torch.zeros(1, dtype=torch.long), cuts])
    seg = torch.zeros(S, dtype=torch.long)
    seg[cuts] = 1
    seg = seg.cumsum(0)
    pos = torch.arange(S) - starts[seg]
    seg[-(S // 64):] = -1
    return pos[None], seg[None]


def _old_plan(pos, seg, causal, bm, bn, transpose):
    """The previous plan: the class table, then a stable descending argsort of each row."""
    import torch

    from longvideo.kernels import classify_tiles, tile_stats

    cls = classify_tiles(tile_stats(pos, seg, bm), tile_stats(pos, seg, bn), causal)
    if transpose:
        cls = cls.transpose(1, 2)
    order = torch.argsort(cls, dim=-1, descending=True, stable=True).to(torch.int32).contiguous()
    return order, (cls == 2).sum(-1, dtype=torch.int32), (cls == 1).sum(-1, dtype=torch.int32)


def _child(kind: str, layout: str, S: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from longvideo.kernels import _flash_attn_triton as tk

    pos, seg = _metadata(layout, S)
    base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.process_time()
    w0 = time.perf_counter()
    if kind == "old":  # what one call used to build: forward, then the backward's two plans
        plans = [_old_plan(pos, seg, True, 128, 64, False), _old_plan(pos, seg, True, 32, 128, True),
                 _old_plan(pos, seg, True, 128, 64, False)]
        nbytes = sum(t.numel() * t.element_size() for p in plans for t in p)
    else:  # built once per (positions, segment ids): forward and fused-backward plans
        plans = [tk.build_plan(pos, pos, seg, seg, True, 128, 64), tk.build_plan(pos, pos, seg, seg, True, 32, 128,
                                                                                 transpose=True)]
        nbytes = sum(p.numel() * p.element_size() for p in plans)
    cpu = time.process_time() - t0
    wall = time.perf_counter() - w0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return dict(kind=kind, layout=layout, seqlen=S, cpu_s=cpu, wall_s=wall, plan_mib=nbytes / 2**20,
                peak_added_mib=(peak_kib - base_kib) / 1024)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[65536, 262144, 1048576])
    p.add_argument("--layout", default="causal", choices=["causal", "packed"])
    p.add_argument("--kinds", nargs="+", default=["new", "old"], choices=["new", "old"])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "plan.json")
    p.add_argument("--child", nargs=3, metavar=("KIND", "LAYOUT", "S"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child[0], args.child[1], int(args.child[2]))))
        return 0
    rows = []
    for S in args.seqlens:
        for kind in args.kinds:
            r = subprocess.run([sys.executable, __file__, "--child", kind, args.layout, str(S)], capture_output=True,
                               text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            if r.returncode:
                row = dict(kind=kind, layout=args.layout, seqlen=S, error=(r.stderr or r.stdout)[-500:])
            else:
                row = json.loads(r.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = dict(benchmark="attention tile plan build cost on CPU, old (dense table + argsort) vs new (sorted ranges)",
                  machine=dict(platform=platform.platform(), cpus=os.cpu_count(), loadavg=list(os.getloadavg())),
                  tiles="forward 128 x 64; old backward 32 x 128 (dK/dV, transposed) + 128 x 64 (dQ); new backward "
                        "32 x 128 (fused, transposed)", results=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
