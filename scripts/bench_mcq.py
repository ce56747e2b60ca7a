"""Multiple-choice evaluation time, and the demo model's scene questions in Video-MME's format.

    python scripts/bench_mcq.py --model runs/demo/hf                       # 1,002 questions, 334 one-minute videos
    python scripts/bench_mcq.py --model runs/demo/hf --seconds 4-12 --videos 256 --out runs/mcq-demo
                                                                             # the demo's own lengths

Writes held-out synthetic videos (dataset seed 101, never trained on) and their three questions
(the flash colour, the last shape's colour, the first shape) as a Video-MME release (the parquet
beside data/), then runs `longvideo eval mcq --benchmark videomme` on them in likelihood mode and
reports the time, the videos encoded (once each), and the accuracy per question (task_type).
Target: 1,000 questions over one-minute videos in <= 10 minutes on a 2-core CPU.
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import pyarrow as pa
import pyarrow.parquet as pq

from longvideo.data.synthetic import (COLOUR_NAMES, FIRST_SHAPE_QUESTION, LAST_COLOUR_QUESTION, NEEDLE_QUESTION,
                                      SHAPE_KINDS, SyntheticSpec, make_sample)
from longvideo.infer import mcq
from longvideo.machine import machine_info

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--model", required=True, help="the demo's hf/ (or any model directory)")
ap.add_argument("--videos", type=int, default=334)
ap.add_argument("--seconds", default="60", help="video length, or a range lo-hi")
ap.add_argument("--out", default="runs/bench-mcq")
ap.add_argument("--json", default="docs/bench/mcq.json", help="where the figures go ('' for nowhere)")
a = ap.parse_args()
lo, hi = (int(x) for x in (a.seconds.split("-") * 2)[:2])
data = Path(a.out) / "data"
rows = []
(data / "data").mkdir(parents=True, exist_ok=True)
spec = SyntheticSpec(min_seconds=lo, max_seconds=hi, long_fraction=0.0, needle_fraction=1.0)
t0 = time.perf_counter()
for i in range(a.videos):
    s, vid = make_sample(101, i, spec), f"held{i:05d}"
    if not (data / "data" / f"{vid}.mp4").is_file():
        (data / "data" / f"{vid}.mp4").write_bytes(s.mp4())
    for k, (task, q, opts, ans) in enumerate([("flash colour", NEEDLE_QUESTION, COLOUR_NAMES, s.needle[1]),
                                               ("last colour", LAST_COLOUR_QUESTION, COLOUR_NAMES, s.scenes[-1][2].colour),
                                               ("first shape", FIRST_SHAPE_QUESTION, SHAPE_KINDS, s.scenes[0][2].kind)]):
        rows.append({"video_id": f"{i:03d}", "duration": "short", "domain": "synthetic", "sub_category": "shapes",
                     "url": "", "videoID": vid, "question_id": f"{i:03d}-{k + 1}", "task_type": task, "question": q,
                     "options": [f"{'ABCD'[j]}. {o}" for j, o in enumerate(opts)], "answer": "ABCD"[opts.index(ans)]})
(data / "videomme").mkdir(exist_ok=True)
schema = pa.schema([(k, pa.list_(pa.string()) if k == "options" else pa.string()) for k in rows[0]])
pq.write_table(pa.Table.from_pylist(rows, schema=schema), data / "videomme" / "test-00000-of-00001.parquet")
print(f"{a.videos} videos of {a.seconds} s, {len(rows)} questions written in {time.perf_counter() - t0:.0f} s")

stamps = []  # when each video's encoding started: the time between two is one video's whole work
encode = mcq.encode_video_file
mcq.encode_video_file = lambda *args, **kw: (stamps.append(time.perf_counter()), encode(*args, **kw))[1]
out = Path(a.out) / "eval"
for f in ("predictions.jsonl", "summary.json", "run.json"):  # time a whole run, not a resumed one
    (out / f).unlink(missing_ok=True)
t0, c0 = time.perf_counter(), time.process_time()
res = mcq.evaluate_mcq(a.model, "videomme", data, out, mode="likelihood")
seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
per_video = np.diff(stamps + [t0 + seconds])
tasks = res["breakdowns"]["task_type"]["labels"]
fig = {"model": a.model, "videos": a.videos, "seconds_per_video": a.seconds, "questions": res["questions"],
       "videos_encoded": len(stamps), "eval_seconds": round(seconds, 1), "eval_cpu_seconds": round(cpu, 1),
       "threads": torch.get_num_threads(),
       "seconds_per_question": round(seconds / res["questions"], 3),
       "seconds_per_video_median": round(float(np.median(per_video)), 3),
       "seconds_per_video_p10_p90": [round(float(x), 3) for x in np.percentile(per_video, [10, 90])],
       "minutes_per_1000_questions": round(seconds / res["questions"] * 1000 / 60, 2),
       "target": "<= 10 minutes for 1,000 questions over 1-minute videos (2-core CPU)",
       "accuracy": res["accuracy"], "ci95": res["ci95"],
       "by_task_type": {k: {"accuracy": v["accuracy"], "ci95": v["ci95"], "questions": v["questions"]}
                        for k, v in tasks.items()},
       "machine": machine_info()}
print(f"\n{'questions':>10} {'videos':>7} {'encoded':>8} {'eval s':>8} {'CPU s':>8} {'s/question':>11} {'min/1000 q':>11}")
print(f"{fig['questions']:>10} {a.videos:>7} {len(stamps):>8} {seconds:>8.1f} {cpu:>8.1f} "
      f"{fig['seconds_per_question']:>11.3f} {fig['minutes_per_1000_questions']:>11.2f}")
print(f"per video: median {fig['seconds_per_video_median']} s (p10-p90 {fig['seconds_per_video_p10_p90']})")
for k, v in tasks.items():
    print(f"  {k:<13} {v['accuracy']:.1%} (95 % interval {v['ci95'][0]:.1%}-{v['ci95'][1]:.1%}) of {v['questions']}")
if a.json:
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(fig, indent=1) + "\n")
    print(f"wrote {a.json}")
