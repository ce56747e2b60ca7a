"""Multiple-choice evaluation time, and the demo model's scene questions in Video-MME's format:
`python scripts/bench_mcq.py --model runs/demo/hf` (1,002 questions on 334 one-minute videos, 768 on
256 videos of 4-12 s). Held-out synthetic videos (dataset seed 101, never trained on) and their three
questions (flash colour, last colour, first shape) are written as a Video-MME release and scored by
`longvideo eval mcq --benchmark videomme`, likelihood mode; docs/bench/mcq.json gets the figures."""

import argparse
import time
from pathlib import Path

from benchreport import BENCH_DIR, Section, Target, fmt_num, md_table, req_list, save, yes_no

TITLE = "Multiple-choice benchmarks: time and the demo model's answers"
DOCS = ["evaluation.md"]
TARGETS = [
    Target(
        "mcq: 1,000 questions over 1-minute videos",
        "<= 10 minutes on a 2-core CPU, one encode a video",
    ),
    Target("mcq: flash colour as 4-way choice, demo model", ">= 90 % (chance 25 %)"),
]


def report(result: dict) -> Section:
    speed, acc = (Target(t.what, t.goal) for t in TARGETS)
    rows = []
    for c in req_list(result, "cases"):
        kinds = c["by_task_type"]
        rows.append(
            [c["seconds"], str(c["questions"]), f"{c['videos_encoded']} / {c['videos']}"]
            + [
                fmt_num(c[k], ".1f")
                for k in ("eval_seconds", "eval_cpu_seconds", "minutes_per_1000_questions")
            ]
            + [
                f"{kinds[k]['accuracy']:.1%}"
                for k in ("flash colour", "last colour", "first shape")
            ]
        )
        if c["seconds"] == "60":
            speed.figure = f"{c['minutes_per_1000_questions']:.1f} min ({c['videos_encoded']} encodes, {c['videos']} videos)"
            speed.met = yes_no(
                c["minutes_per_1000_questions"] <= 10 and c["videos_encoded"] == c["videos"]
            )
        else:
            acc.figure, acc.met = (
                f"{kinds['flash colour']['accuracy']:.1%}",
                yes_no(kinds["flash colour"]["accuracy"] >= 0.9),
            )
    head = [
        "video s",
        "questions",
        "encoded",
        "wall s",
        "CPU s",
        "min / 1,000",
        "flash",
        "last colour",
        "first shape",
    ]
    return Section(
        md_table(head, rows), [speed, acc], [f"model {result.get('model')}; one process"]
    )


def write_release(data: Path, videos: int, lo: int, hi: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from longvideo.data.synthetic import (
        COLOUR_NAMES,
        FIRST_SHAPE_QUESTION,
        LAST_COLOUR_QUESTION,
        NEEDLE_QUESTION,
        SHAPE_KINDS,
        SyntheticSpec,
        make_sample,
    )

    for d in ("data", "videomme"):
        (data / d).mkdir(parents=True, exist_ok=True)
    spec, rows = (
        SyntheticSpec(min_seconds=lo, max_seconds=hi, long_fraction=0.0, needle_fraction=1.0),
        [],
    )
    for i in range(videos):
        s, vid = make_sample(101, i, spec), f"held{i:05d}"
        if not (data / "data" / f"{vid}.mp4").is_file():
            (data / "data" / f"{vid}.mp4").write_bytes(s.mp4())
        for k, (task, q, opts, ans) in enumerate(
            [
                ("flash colour", NEEDLE_QUESTION, COLOUR_NAMES, s.needle[1]),
                ("last colour", LAST_COLOUR_QUESTION, COLOUR_NAMES, s.scenes[-1][2].colour),
                ("first shape", FIRST_SHAPE_QUESTION, SHAPE_KINDS, s.scenes[0][2].kind),
            ]
        ):
            rows.append(
                {
                    "video_id": f"{i:03d}",
                    "duration": "short",
                    "domain": "synthetic",
                    "sub_category": "shapes",
                    "url": "",
                    "videoID": vid,
                    "question_id": f"{i:03d}-{k + 1}",
                    "task_type": task,
                    "question": q,
                    "options": [f"{'ABCD'[j]}. {o}" for j, o in enumerate(opts)],
                    "answer": "ABCD"[opts.index(ans)],
                }
            )
    schema = pa.schema(
        [(k, pa.list_(pa.string()) if k == "options" else pa.string()) for k in rows[0]]
    )
    pq.write_table(
        pa.Table.from_pylist(rows, schema=schema), data / "videomme" / "test-00000-of-00001.parquet"
    )


def main() -> None:
    from longvideo.infer.mcq import evaluate_mcq
    from longvideo.machine import machine_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", default="runs/demo/hf", help="the demo's hf/ (or any model directory)"
    )
    ap.add_argument(
        "--cases",
        default="60:334,4-12:256",
        help="video seconds (or lo-hi):videos, comma separated",
    )
    ap.add_argument("--out", default="runs/bench-mcq")
    ap.add_argument(
        "--json", default=str(BENCH_DIR / "mcq.json"), help="where the figures go ('' for nowhere)"
    )
    a = ap.parse_args()
    cases = []
    for case in a.cases.split(","):
        seconds, videos = case.split(":")
        lo, hi = (int(x) for x in (seconds.split("-") * 2)[:2])
        data, out = Path(a.out) / seconds / "data", Path(a.out) / seconds / "eval"
        write_release(data, int(videos), lo, hi)
        [
            (out / f).unlink(missing_ok=True) for f in ("predictions.jsonl", "run.json")
        ]  # a whole run, not a resumed one
        t0, c0 = time.perf_counter(), time.process_time()
        res = evaluate_mcq(a.model, "videomme", data, out, mode="likelihood")
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        cases.append(
            {
                "seconds": seconds,
                "videos": int(videos),
                "questions": res["questions"],
                "videos_encoded": res["videos_encoded"],
                "eval_seconds": round(wall, 1),
                "eval_cpu_seconds": round(cpu, 1),
                "minutes_per_1000_questions": round(wall / res["questions"] * 1000 / 60, 2),
                "accuracy": res["accuracy"],
                "ci95": res["ci95"],
                "by_task_type": res["breakdowns"]["task_type"]["labels"],
            }
        )
    result = {"model": a.model, "cases": cases, "machine": machine_info()}
    if a.json:
        save(result, a.json, report=report)


if __name__ == "__main__":
    main()
