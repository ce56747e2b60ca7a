"""`longvideo serve` under use: a follow-up question against the first one on a 10-minute video (the
KV cache hit), then 50 requests from 8 concurrent clients (each answered or refused with 429, none
lost) and the server's resident memory after them against its level after the warm-up.

    python scripts/bench_serve.py --model /tmp/demo-quick/hf    # default: runs/demo-quick/hf, trained
                                                                # first with `longvideo.demo --quick`

The server runs as its own process (`python -m longvideo serve`); requests go through the real
openai client with videos as data: URLs. Writes docs/bench/serve.json.
"""

from __future__ import annotations

import base64
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchreport import ROOT, Section, Target, arg_parser, fmt_num, md_table, req, save, yes_no

TITLE = "Serving: follow-up questions and concurrent clients"
DOCS = ["serving.md"]
TARGETS = [
    Target("serve: follow-up / first question, 10-minute video", "<= 0.2"),
    Target(
        "serve: 50 requests, 8 clients: answered or 429, RSS after / after warm-up",
        "none lost, <= 1.10",
    ),
]
QUESTIONS = [
    "What colour was the flash frame?",
    "What shape came first?",
    "What colour was the last shape?",
]


def report(result: dict) -> Section:
    first, follow, load = req(result, "first_s"), req(result, "follow_up_s"), req(result, "load")
    r, rss = req(result, "ratio"), load["rss_after_mb"] / load["rss_warm_mb"]
    table = md_table(
        ["measure", "median", "spread (min-max)"],
        [
            [
                "first question (s)",
                fmt_num(statistics.median(first)),
                f"{min(first):.2f}-{max(first):.2f}",
            ],
            [
                "follow-up (s)",
                fmt_num(statistics.median(follow)),
                f"{min(follow):.2f}-{max(follow):.2f}",
            ],
            [
                f"{load['requests']} requests, {load['clients']} clients: latency (s)",
                fmt_num(load["latency_median_s"]),
                f"{load['latency_min_s']:.2f}-{load['latency_max_s']:.2f}",
            ],
        ],
    )
    lost = load["requests"] - load["answered"] - load["rejected_429"]
    return Section(
        table,
        [
            Target(TARGETS[0].what, TARGETS[0].goal, f"{r:.3f}", yes_no(r <= 0.2)),
            Target(
                TARGETS[1].what,
                TARGETS[1].goal,
                f"{load['answered']} answered, {load['rejected_429']} 429, "
                f"{lost} lost; RSS {rss:.3f}",
                yes_no(lost == 0 and rss <= 1.10),
            ),
        ],
        [
            f"{result['video_seconds']} s video, {result['frames']} frames of it given to the model ({result['model']})"
        ],
    )


def start(model: str, max_queue: int):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "longvideo",
            "serve",
            "--model",
            model,
            "--port",
            "0",
            "--quiet",
            "--max-queue",
            str(max_queue),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        if m := re.search(r" on (http://[\d.]+:\d+)/", line):
            return proc, m.group(1)
    raise SystemExit("the server did not start")


def video_url(seconds: int, seed: int) -> str:
    from longvideo.data.synthetic import SyntheticSpec, make_sample

    spec = SyntheticSpec(
        min_seconds=seconds, max_seconds=seconds, long_fraction=0.0, needle_fraction=1.0
    )
    return "data:video/mp4;base64," + base64.b64encode(make_sample(seed, 0, spec).mp4()).decode()


def ask(client, model: str, url: str, question: str, history=()):
    """One chat completion (the video in the first user message, then the earlier turns); (response, seconds)."""
    msgs = []
    for i, (q, answer) in enumerate([*history, (question, None)]):
        video = [{"type": "video_url", "video_url": {"url": url}}] if i == 0 else []
        msgs.append({"role": "user", "content": [*video, {"type": "text", "text": q}]})
        msgs += [{"role": "assistant", "content": answer}] if answer is not None else []
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=msgs)
    return r, time.perf_counter() - t0


def main(argv=None) -> None:
    p = arg_parser(__doc__, "serve")
    p.add_argument(
        "--model",
        default=None,
        help="model directory (default: runs/demo-quick/hf, made if missing)",
    )
    p.add_argument("--seconds", type=int, default=600, help="video length (default 10 minutes)")
    p.add_argument("--trials", type=int, default=3, help="videos for the first / follow-up timing")
    for flag, default in (("--requests", 50), ("--clients", 8), ("--max-queue", 4)):
        p.add_argument(flag, type=int, default=default)
    a = p.parse_args(argv)
    import openai
    import psutil

    from longvideo.machine import describe, machine_info

    model = a.model or str(ROOT / "runs" / "demo-quick" / "hf")
    if not Path(model).is_dir():
        print(
            f"training the demo model first: python -m longvideo.demo --quick --out {Path(model).parent}"
        )
        subprocess.run(
            [sys.executable, "-m", "longvideo.demo", "--quick", "--out", str(Path(model).parent)],
            check=True,
        )
    proc, url = start(model, a.max_queue)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        name = client.models.list().data[0].id
        videos = [video_url(a.seconds, 100 + i) for i in range(a.trials)]
        first, follow = [], []
        for v in videos:  # a new video each time: decode, encode and prefill it; then the follow-up
            r, t = ask(client, name, v, QUESTIONS[0])
            r2, t2 = ask(
                client, name, v, QUESTIONS[1], [(QUESTIONS[0], r.choices[0].message.content)]
            )
            first.append(t), follow.append(t2)
            print(
                f"first {t:.2f} s, follow-up {t2:.2f} s (cached {r2.usage.prompt_tokens_details.cached_tokens} "
                f"of {r2.usage.prompt_tokens} prompt tokens)"
            )
        server = psutil.Process(proc.pid)
        warm = server.memory_info().rss / 2**20

        def one(
            i: int,
        ):  # a refused client waits as told (Retry-After), then sends its next request
            try:
                return "answered", ask(
                    client, name, videos[i % len(videos)], QUESTIONS[i % len(QUESTIONS)]
                )[1]
            except openai.RateLimitError as e:
                time.sleep(float(e.response.headers.get("Retry-After", 1)))
                return "rejected", None
            except Exception as e:  # noqa: BLE001 - a lost request
                return "lost", repr(e)

        with ThreadPoolExecutor(a.clients) as pool:
            outcomes = list(pool.map(one, range(a.requests)))
        latency = [t for k, t in outcomes if k == "answered"]
        time.sleep(2.0)
        after = server.memory_info().rss / 2**20
        load = dict(
            requests=a.requests,
            clients=a.clients,
            max_queue=a.max_queue,
            answered=len(latency),
            rejected_429=sum(k == "rejected" for k, _ in outcomes),
            errors=[t for k, t in outcomes if k == "lost"][:5],
            rss_warm_mb=round(warm, 1),
            rss_after_mb=round(after, 1),
            latency_median_s=statistics.median(latency),
            latency_min_s=min(latency),
            latency_max_s=max(latency),
        )
        frames = r.model_extra["video"]["frames"]
    finally:
        proc.terminate()
        proc.wait(30)
    result = dict(
        model=model,
        video_seconds=a.seconds,
        frames=frames,
        first_s=first,
        follow_up_s=follow,
        ratio=statistics.median(follow) / statistics.median(first),
        load=load,
        machine=describe(machine_info()),
    )
    save(result, a.out, report=report)


if __name__ == "__main__":
    main()
