"""Where the demo's 1K training step goes on a CPU, and two costs it no longer pays.

    python scripts/bench_step.py                 # ~3 minutes on a 2-core CPU
    python scripts/bench_step.py --rows 100 --repeats 5

`make demo`'s first rung trains 1,024-token rows packed from 2-4 second clips (about five to a row),
one row a process, and only the answers carry a loss (the video is prompt). Two parts of that step
are measured here in one process with one thread, each with the old behaviour as the baseline:

* **data**: the token loader's time per row over shards shaped like the demo's clip set (188 shards
  of 64 clips, 8 x 8 codes a second, synthetic captions and questions), with the index of the last
  8 shards kept (before) and of the last 512 (now). The shuffle buffer draws from about a dozen
  shards at once, so with 8 kept the loader re-read tar headers for most rows.
* **head**: forward and backward of the tiny decoder (configs/tiny.yaml, 1K tokens) on rows from that
  loader, the output projection and cross-entropy applied to every token (before) or only to those
  with a loss weight (now; the loss and every gradient are the same). Both with the demo's
  answer-only loss and with the default layout's loss on video and text (where nothing is skipped
  and the figure shows what finding the kept tokens costs).

Figures are medians of `--repeats` timings (alternating the two variants). Writes
docs/bench/step.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# ------------------------------------------------------------------------------------------- report
# Read by run_benchmarks.py to build docs/benchmarks.md (see scripts/run_benchmarks.py).

from benchreport import Section, Target, fmt_num, md_table, ratio, req_list, yes_no  # noqa: E402

TITLE = "The demo's training step: data and output head"
MEASURES = ("Token-loader time a 1K row (shard indexes kept for 8 vs 512 shards) and forward + backward of the tiny "
            "decoder at 1K tokens with the output head over every token vs only the weighted ones; one thread.")
DOCS = ["training.md", "data.md"]
TARGETS = [Target("step: loader time a row, 512 shard indexes kept / 8", "< 1"),
           Target("step: forward + backward, answer-only loss, weighted tokens only / all", "< 1"),
           Target("step: forward + backward, loss on every token, weighted only / all", "<= 1.05 (no loss where nothing is skipped)")]


def report(result: dict) -> Section:
    rows = req_list(result, "results")
    by = {r["case"]: r for r in rows}
    targets = [Target(t.what, t.goal) for t in TARGETS]
    body = []
    for r in rows:
        body.append([r["case"], r["before"], r["now"], fmt_num(r.get("before_ms"), ".1f"),
                     fmt_num(r.get("now_ms"), ".1f"), fmt_num(ratio(r.get("now_ms"), r.get("before_ms")), ".2f")])
    goals = (("loader", lambda q: q < 1), ("head: answer-only loss", lambda q: q < 1),
             ("head: loss on every token", lambda q: q <= 1.05))
    for t, (case, met) in zip(targets, goals):
        q = ratio(by.get(case, {}).get("now_ms"), by.get(case, {}).get("before_ms"))
        if q is not None:
            t.figure = f"{q:.2f}x"
            t.met = yes_no(met(q))
    notes = [f"{result.get('rows', '?')} rows a timing, median of {result.get('repeats', '?')}; one process, one "
             f"thread. Tokens with a loss: {fmt_num(result.get('weighted_fraction'), '.1%')} of the answer-only rows."]
    return Section(md_table(["case", "before", "now", "before ms", "now ms", "now / before"], body), targets, notes)


# ------------------------------------------------------------------------------------------- data

def write_clip_shards(root: Path, shards: int, per_shard: int, tokenizer_out: Path):
    """Token shards shaped like the demo's clips (random codes: the loader does not look at them)."""
    import numpy as np

    from longvideo.data.shards import ShardWriter, token_sample_members
    from longvideo.data.synthetic import SyntheticSpec, make_sample, text_corpus
    from longvideo.tokenizer import train_text_tokenizer

    spec = SyntheticSpec(min_seconds=2, max_seconds=4, long_fraction=0.0, needle_fraction=1.0)
    tok = train_text_tokenizer(text_corpus(200, spec=spec), vocab_size=384)
    tok.save(tokenizer_out)
    rng = np.random.default_rng(0)
    for s in range(shards):
        with ShardWriter(root / f"shard-{s:06d}.tar") as w:
            for i in range(s * per_shard, (s + 1) * per_shard):
                sample = make_sample(2, i, spec)
                codes = rng.integers(0, 1024, (sample.duration, 8, 8))
                w.write(sample.key, token_sample_members(sample.key, codes, np.arange(float(sample.duration)),
                                                         sample.meta))
    return tok


def make_loader(shards: Path, tok, answer_only: bool, **kw):
    """The demo's 1K clip-rung loader: the first template, answers only (or a loss on video and text)."""
    from longvideo.data.config import DataConfig
    from longvideo.data.loader import TokenLoader

    cfg = DataConfig(train_shards=str(shards), seq_len=1024, template_mode="first", qa_vision_loss=not answer_only)
    return TokenLoader(str(shards), tok, tok.vocab(1024), cfg, batch_size=1, **kw)


def loader_ms(shards: Path, tok, kept: int, rows: int) -> float:
    loader = make_loader(shards, tok, answer_only=True, dp_rank=0, dp_size=2, max_indexed_shards=kept)
    for _ in range(20):  # fill the shuffle buffer
        next(loader)
    t0 = time.perf_counter()
    for _ in range(rows):
        next(loader)
    return (time.perf_counter() - t0) / rows * 1e3


def batches(shards: Path, tok, n: int, answer_only: bool) -> list[dict]:
    loader = make_loader(shards, tok, answer_only)
    return [next(loader) for _ in range(n)]


def step_ms(model, rows: list[dict], skip: bool) -> float:
    model.head.skip_unweighted = skip
    t0 = time.perf_counter()
    for b in rows:
        loss, _ = model(b["input_ids"], b["positions"], b["segment_ids"], targets=b["targets"],
                        loss_weights=b["loss_weights"])
        loss.backward()
    return (time.perf_counter() - t0) / len(rows) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=40, help="rows a timing")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shards", type=int, default=188, help="clip shards (the demo writes 188 of 64)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "step.json")
    args = p.parse_args(argv)
    import torch

    from longvideo.config import load_config
    from longvideo.machine import describe, machine_info
    from longvideo.model import Transformer

    torch.set_num_threads(1)
    machine = machine_info()
    print(describe(machine), flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "tokens"
        root.mkdir()
        print(f"writing {args.shards} token shards ...", flush=True)
        tok = write_clip_shards(root, args.shards, 64, Path(tmp) / "tokenizer")
        before, now = [], []
        for _ in range(args.repeats):
            before.append(loader_ms(root, tok, 8, args.rows))
            now.append(loader_ms(root, tok, 512, args.rows))
        results.append(dict(case="loader", before="8 shard indexes kept", now="512 kept",
                            before_ms=statistics.median(before), now_ms=statistics.median(now)))
        print(json.dumps(results[-1]), flush=True)

        cfg = load_config("tiny", ["model.max_seq_len=1024", "model.activation_checkpointing=false",
                                   f"model.text_vocab_size={tok.text_size}"]).model
        weighted = None
        for answer_only, case in ((True, "head: answer-only loss"), (False, "head: loss on every token")):
            torch.manual_seed(0)
            model = Transformer(cfg)
            rows = batches(root, tok, args.rows, answer_only)
            if answer_only:
                weighted = float(sum((b["loss_weights"] > 0).sum() for b in rows) / sum(b["loss_weights"].numel()
                                                                                       for b in rows))
            step_ms(model, rows[:5], True)  # warm-up
            before, now = [], []
            for _ in range(args.repeats):
                before.append(step_ms(model, rows, False))
                now.append(step_ms(model, rows, True))
                model.zero_grad(set_to_none=True)
            results.append(dict(case=case, before="head over every token", now="weighted tokens only",
                                before_ms=statistics.median(before), now_ms=statistics.median(now)))
            print(json.dumps(results[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = dict(benchmark="the demo's 1K training step on CPU: loader and output head", machine=describe(machine),
                  machine_info=machine, rows=args.rows, repeats=args.repeats, weighted_fraction=weighted,
                  results=results)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
