"""Data pipeline benchmark: sampling 1 fps from an hour of video, and token-shard loader throughput.

    python scripts/bench_data.py                      # one-hour 256p video (generated once, cached)
    python scripts/bench_data.py --minutes 10 --src-fps 24 --gop-seconds 4

1. Video: seconds to take 1 frame per second from a generated ``--minutes``-long 256p mp4 with each
   backend of the project's reader side by side: ``read_video(backend="pyav")`` (the default,
   ``auto``), ``read_video(backend="decord")`` (decord in its child process, frames sent back over a
   pipe), and for reference decord called directly in this process (``get_batch``; not offered by
   the reader, since decord can crash the process), against decoding every frame with PyAV (the way
   a reader that does not seek works), all in one run. Every sampled frame carries its own index in
   a corner, so the benchmark also checks that the right frames came back.
2. Loader: tokens per second the token-shard loader produces (layout + packing, LWM-like 256 codes
   per frame), against the tokens per second a training step consumes: measured for a small model
   on this CPU, and estimated for LLaMA-7B at 32K tokens on one H200 at 40 % MFU.

Writes docs/bench/data.json and docs/bench/data.png; ``report(result)`` turns the JSON into markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from longvideo.data.synthetic import decode_frame_index, frame_index_video, write_mp4  # noqa: E402
from longvideo.data.video import read_video, sample_indices  # noqa: E402

# ------------------------------------------------------------------------------------------- report
# Read by run_benchmarks.py to build docs/benchmarks.md: the title, what is measured, the detail docs
# under docs/ (the first that exists is linked), the targets (the summary rows while nothing is
# measured) and report(), which turns this script's JSON into a table, the targets met or not, and
# notes.

from benchreport import Section, Target, fmt_num, md_table, req, req_list, yes_no  # noqa: E402

TITLE = "Data pipeline"
MEASURES = ("Sampling 1 fps from an hour of video with the project's reader against decoding every frame; "
            "token-shard loader throughput against the tokens per second a training step consumes.")
DOCS = ["data.md"]
TARGETS = [Target("data: 1 fps sampling from an hour of video", "faster than decoding every frame"),
           Target("data: loader tokens/s", "keeps up with a training step")]


def report(result: dict) -> Section:
    """1 fps sampling of an hour per reader side by side, and loader throughput against consumers."""
    v = req(result, "video")
    runs = req_list(v, "runs")
    cols = [("project_pyav", "`read_video` PyAV (default)"), ("project_decord", "`read_video` decord (child process)"),
            ("decord_inprocess", "decord in-process (reference)")]
    cols = [(k, label) for k, label in cols if all(k in r for r in runs)]
    body, speed = [], {k: [] for k, _ in cols}
    for r in runs:
        base = req(r, "pyav_decode_all", "seconds")
        cells = []
        for k, _ in cols:
            sec = req(r, k, "seconds")
            speed[k].append(base / sec)
            cells.append(f"{sec:.1f} ({base / sec:.2f}x)")
        ok = all(r[k].get("correct", False) for k in [c for c, _ in cols] + ["pyav_decode_all"])
        body.append([f"{req(r, 'gop_seconds'):g} s", fmt_num(r.get("file_mb"), ".1f"), *cells, f"{base:.1f}",
                     "yes" if ok else "**no**"])
    table = md_table(["keyframe interval", "file MiB", *[label + " s (speed-up)" for _, label in cols],
                      "PyAV decode every frame s", "right frames"], body)
    samp = Target(TARGETS[0].what, TARGETS[0].goal)

    def span(xs):
        return f"{min(xs):.2f}x" if len(xs) == 1 or abs(max(xs) - min(xs)) < 5e-3 else f"{min(xs):.2f}-{max(xs):.2f}x"

    default = v.get("default_backend", "pyav")
    samp.figure = ", ".join(f"{label} {span(speed[k])}" for k, label in cols)
    samp.met = f"default ({default}): {yes_no(min(speed['project_' + default]) > 1)}" \
        if f"project_{default}" in speed else "unknown"
    ld = req(result, "loader")
    tps = req(ld, "tokens_per_s")
    cons = []
    if isinstance(result.get("train_step_cpu"), dict):
        c = result["train_step_cpu"]
        cons.append((f"{c.get('model', 'small model')} train step on this CPU, seq {c.get('seq_len', '?'):,} "
                     "(measured)", "the measured tokens/s of the CPU train step", req(c, "tokens_per_s")))
    if isinstance(result.get("train_step_7b_h200"), dict):
        c = result["train_step_7b_h200"]
        cons.append((f"{c.get('model', '7B')} at {c.get('seq_len', 0):,} tokens on one H200 at "
                     f"{100 * c.get('mfu', 0):.0f} % MFU (estimated from FLOPs per token)",
                     f"the estimated tokens/s of a {c.get('model', '7B')} step on one H200", req(c, "tokens_per_s_per_gpu")))
    rows2 = [[f"token-shard loader, rows of {ld.get('seq_len', 0):,} (padding "
              f"{100 * ld.get('padding_fraction', 0):.1f} %)", f"{tps:,.0f}", "-"]]
    rows2 += [[name, f"{x:,.0f}", f"{tps / x:,.0f}x"] for name, _, x in cons]
    table += "\n\n" + md_table(["producer / consumer", "tokens/s", "loader headroom"], rows2)
    load = Target(TARGETS[1].what, TARGETS[1].goal)
    if cons:
        _, short, worst = min(cons, key=lambda c: tps / c[2])
        load.figure = f"{tps:,.0f} tokens/s = {tps / worst:,.0f}x {short}"
        load.met = yes_no(tps >= worst)
    else:
        load.figure, load.met = f"{tps:,.0f} tokens/s (no training step in the JSON)", "unknown"
    notes = [f"Video: a {v.get('minutes', '?'):g}-minute {v.get('size', '?')}p x264 file at {v.get('src_fps', '?')} fps, "
             "one frame taken per second; every returned frame is checked against the index drawn into it. "
             "Baseline: PyAV decoding every frame and converting each to RGB. Each time is the best of the "
             "interleaved repeats."]
    return Section(table, [samp, load], notes)


CORNER = 64  # pixels of the index pattern in the top-left corner


def bench_frames(start: int, stop: int, size: int) -> np.ndarray:
    """Frames [start, stop): a static gradient, a bouncing square, and the frame index in a corner."""
    yy, xx = np.mgrid[0:size, 0:size]
    base = np.stack([xx * 255 // size, yy * 255 // size, np.full_like(xx, 96)], -1).astype(np.uint8)
    out = np.repeat(base[None], stop - start, 0)
    side, span = size // 5, size - size // 5
    for k, i in enumerate(range(start, stop)):
        x, y = abs((i * 3) % (2 * span) - span), abs((i * 5) % (2 * span) - span)
        out[k, y: y + side, x: x + side] = (230, 40, 40)
    out[:, :CORNER, :CORNER] = frame_index_video(start, stop, CORNER)
    return out


def make_video(path: Path, minutes: float, size: int, fps: int, gop_seconds: float) -> None:
    from tqdm import tqdm

    n = int(round(minutes * 60 * fps))
    chunk = 256
    bar = tqdm(total=n, unit="frame", desc=f"generating {path.name}")

    def chunks():
        for a in range(0, n, chunk):
            frames = bench_frames(a, min(a + chunk, n), size)
            bar.update(len(frames))
            yield frames

    tmp = path.with_suffix(".part.mp4")
    write_mp4(chunks(), fps, tmp, crf=23, gop=max(1, int(round(gop_seconds * fps))), preset="ultrafast")
    bar.close()
    os.replace(tmp, path)


def _check(frames, indices) -> bool:
    return [decode_frame_index(f[:CORNER, :CORNER]) for f in frames] == list(indices)


def time_project_reader(path: Path, backend: str) -> dict:
    t = time.perf_counter()
    clip = read_video(str(path), fps=1.0, backend=backend)
    sec = time.perf_counter() - t
    want = sample_indices(round(clip.duration * clip.fps), clip.fps, 1.0)
    return {"seconds": sec, "frames": len(clip), "correct": _check(clip.frames.numpy(), want)}


def time_decord_inprocess(path: Path) -> dict:
    """decord in this process, as the reader used it before it was isolated: open, get_batch of 1 fps."""
    import decord

    t = time.perf_counter()
    vr = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=0)
    idx = sample_indices(len(vr), float(vr.get_avg_fps()), 1.0)
    frames = []
    for a in range(0, len(idx), 256):
        frames.append(vr.get_batch(idx[a: a + 256].tolist()).asnumpy())
    sec = time.perf_counter() - t
    frames = np.concatenate(frames)
    return {"seconds": sec, "frames": len(frames), "correct": _check(frames, idx)}


def time_pyav_decode_all(path: Path) -> dict:
    """Decode every frame, convert each to RGB and keep the one on screen at each whole second."""
    import av

    t = time.perf_counter()
    kept, idx_kept = [], []
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        s.thread_type = "AUTO"
        fps = float(s.average_rate)
        want = set(sample_indices(s.frames, fps, 1.0).tolist())
        for i, frame in enumerate(c.decode(s)):
            rgb = frame.to_ndarray(format="rgb24")  # a reader that decodes everything converts everything
            if i in want:
                kept.append(rgb)
                idx_kept.append(i)
    sec = time.perf_counter() - t
    return {"seconds": sec, "frames": len(kept), "frames_decoded": i + 1, "correct": _check(kept, idx_kept)}


# ----------------------------------------------------------------------------- loader

def write_token_shards(root: Path, n: int, groups: int, side: int, codebook: int) -> None:
    from longvideo.data.shards import ShardWriter, token_sample_members
    from longvideo.data.synthetic import SyntheticSpec, make_sample

    spec = SyntheticSpec(long_fraction=0.0, min_seconds=groups, max_seconds=groups)
    rng = np.random.default_rng(0)
    per = 16
    for s in range(0, n, per):
        with ShardWriter(root / f"tok-{s // per:04d}.tar") as w:
            for i in range(s, min(s + per, n)):
                meta = make_sample(0, i, spec).meta
                codes = rng.integers(0, codebook, (groups, side, side))
                w.write(f"s{i:06d}", token_sample_members("", codes, np.arange(float(groups)), meta))


def time_loader(root: Path, seq_len: int, batches: int, codebook: int) -> dict:
    from longvideo.data.config import DataConfig
    from longvideo.data.loader import TokenLoader
    from longvideo.data.synthetic import text_corpus
    from longvideo.tokenizer import train_text_tokenizer

    tok = train_text_tokenizer(text_corpus(100), vocab_size=512)
    cfg = DataConfig(seq_len=seq_len, template_mode="all", shuffle_buffer=64)
    loader = TokenLoader(str(root), tok, tok.vocab(codebook), cfg, batch_size=1)
    next(loader)  # shard headers, first reads
    t = time.perf_counter()
    real = 0
    for _ in range(batches):
        b = next(loader)
        real += int((b["segment_ids"] >= 0).sum())
    sec = time.perf_counter() - t
    return {"seconds": sec, "batches": batches, "seq_len": seq_len, "tokens_per_s": batches * seq_len / sec,
            "real_tokens_per_s": real / sec, "padding_fraction": loader.padding_fraction,
            "docs_cut": loader.stats["docs_cut"]}


def time_train_step(seq_len: int, steps: int) -> dict:
    """Forward + backward + AdamW of a small decoder on this CPU (the demo's scale)."""
    from longvideo.model import ModelConfig, Transformer

    cfg = ModelConfig(text_vocab_size=512, codebook_size=1024, dim=256, n_layers=4, n_heads=8, multiple_of=64,
                      max_seq_len=seq_len, ffn_chunk=0, loss_chunk=1024)
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len))
    w = torch.ones(1, seq_len)

    def step():
        s, tot = model(ids, targets=ids, loss_weights=w)
        (s / tot).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sec = (time.perf_counter() - t) / steps
    return {"model": "dim 256, 4 layers, 8 heads", "params": cfg.num_params(), "seq_len": seq_len,
            "seconds_per_step": sec, "tokens_per_s": seq_len / sec}


def estimate_7b_h200(seq_len: int = 32768, mfu: float = 0.4, peak_flops: float = 989e12) -> dict:
    from longvideo.model import ModelConfig

    cfg = ModelConfig(text_vocab_size=32000, codebook_size=8192, dim=4096, n_layers=32, n_heads=32)
    tps = peak_flops * mfu / cfg.flops_per_token(seq_len)
    return {"model": "LLaMA-7B (LWM)", "seq_len": seq_len, "mfu": mfu, "peak_flops": peak_flops,
            "tokens_per_s_per_gpu": tps}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    v = res["video"]
    labels = ["read_video PyAV (default)", "read_video decord (child process)", "decord in-process (reference)",
              "PyAV decode every frame"]
    keys = ["project_pyav", "project_decord", "decord_inprocess", "pyav_decode_all"]
    keys, labels = zip(*[(k, lab) for k, lab in zip(keys, labels) if all(k in r for r in v["runs"])])
    colours = ["tab:cyan", "tab:blue", "tab:purple", "tab:gray"][: len(keys)]
    width = 0.8 / len(keys)
    for j, (key, label, colour) in enumerate(zip(keys, labels, colours)):
        xs = [i + (j - (len(keys) - 1) / 2) * width for i in range(len(v["runs"]))]
        secs = [r[key]["seconds"] for r in v["runs"]]
        a.bar(xs, secs, width, label=label, color=colour)
        for x, sec in zip(xs, secs):
            a.text(x, sec, f"{sec:.1f}", ha="center", va="bottom", fontsize=7)
    a.set_xticks(range(len(v["runs"])), [f"GOP {r['gop_seconds']:g} s" for r in v["runs"]])
    a.set_ylabel("seconds")
    a.set_ylim(0, 1.3 * max(r[k]["seconds"] for r in v["runs"] for k in keys))
    a.legend(fontsize=7, loc="upper left", ncol=2)
    a.set_title(f"1 fps from a {v['minutes']:g}-min {v['size']}p video ({v['src_fps']} fps)")
    ld = res["loader"]
    names = ["loader\n(this CPU)", "train step\nsmall model, CPU", "train step 7B\nH200 est. per GPU"]
    vals = [ld["tokens_per_s"], res["train_step_cpu"]["tokens_per_s"], res["train_step_7b_h200"]["tokens_per_s_per_gpu"]]
    b.bar(names, vals, color=["tab:green", "tab:orange", "tab:red"])
    b.set_yscale("log")
    for i, s in enumerate(vals):
        b.text(i, s, f"{s:,.0f}", ha="center", va="bottom")
    b.set_ylabel("tokens / s")
    b.set_title(f"token-shard loader vs consumption (seq {ld['seq_len']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0, help="video length")
    p.add_argument("--size", type=int, default=256, help="frame side (256p)")
    p.add_argument("--src-fps", type=int, default=8, help="frame rate of the generated video")
    p.add_argument("--gop-seconds", type=float, nargs="+", default=[2.0],
                   help="keyframe interval(s) of the generated video; one video per value")
    p.add_argument("--cache", default=os.path.join(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"),
                                                   "longvideo", "bench"), help="where the video is kept")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats of each video timing (best kept)")
    p.add_argument("--seq-len", type=int, default=16384, help="loader sequence length")
    p.add_argument("--batches", type=int, default=20, help="loader batches timed")
    p.add_argument("--samples", type=int, default=64, help="token-shard samples written for the loader")
    p.add_argument("--train-seq-len", type=int, default=1024, help="sequence length of the CPU train step")
    p.add_argument("--out", default=str(ROOT / "docs" / "bench" / "data.json"))
    p.add_argument("--plot", default=str(ROOT / "docs" / "bench" / "data.png"))
    a = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)

    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    res = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                       "loadavg_start": os.getloadavg()}}
    v = {"minutes": a.minutes, "size": a.size, "src_fps": a.src_fps, "runs": []}
    for gop in a.gop_seconds:
        video = cache / f"bench_{a.minutes:g}min_{a.size}p_{a.src_fps}fps_gop{gop:g}s.mp4"
        if not video.exists():
            t = time.perf_counter()
            make_video(video, a.minutes, a.size, a.src_fps, gop)
            print(f"generated {video} in {time.perf_counter() - t:.0f} s")
        run = {"gop_seconds": gop, "file_mb": video.stat().st_size / 2**20}
        methods = {"project_pyav": lambda: time_project_reader(video, "auto"),
                   "project_decord": lambda: time_project_reader(video, "decord"),
                   "decord_inprocess": lambda: time_decord_inprocess(video),
                   "pyav_decode_all": lambda: time_pyav_decode_all(video)}
        # interleaved repeats, best kept: the machine is shared, so the minimum is the least disturbed
        for rep in range(a.repeats):
            for key, fn in methods.items():
                print(f"GOP {gop:g} s, repeat {rep + 1}/{a.repeats}: {key} ...", flush=True)
                r = fn()
                r["loadavg_1min"] = os.getloadavg()[0]
                if key not in run:
                    run[key] = dict(r, all_seconds=[r["seconds"]])
                else:
                    run[key]["all_seconds"].append(r["seconds"])
                    run[key]["correct"] = run[key]["correct"] and r["correct"]
                    if r["seconds"] < run[key]["seconds"]:
                        run[key].update(seconds=r["seconds"], loadavg_1min=r["loadavg_1min"])
        base = run["pyav_decode_all"]["seconds"]
        run["speedup_decord"] = base / run["project_decord"]["seconds"]
        run["speedup_pyav_backend"] = base / run["project_pyav"]["seconds"]
        run["speedup_decord_inprocess"] = base / run["decord_inprocess"]["seconds"]
        v["runs"].append(run)
    from longvideo.data.video import _open

    v["default_backend"] = _open(str(video), "bench", 4096, "auto").name  # what backend="auto" runs
    res["video"] = v

    with tempfile.TemporaryDirectory() as tmp:
        print("writing token shards ...", flush=True)
        write_token_shards(Path(tmp), a.samples, groups=60, side=16, codebook=8192)
        print("timing the loader ...", flush=True)
        res["loader"] = time_loader(Path(tmp), a.seq_len, a.batches, 8192)
    print("timing a CPU train step ...", flush=True)
    res["train_step_cpu"] = time_train_step(a.train_seq_len, steps=2)
    res["train_step_7b_h200"] = estimate_7b_h200()
    res["loader"]["ratio_to_cpu_step"] = res["loader"]["tokens_per_s"] / res["train_step_cpu"]["tokens_per_s"]
    res["loader"]["ratio_to_7b_h200_gpu"] = (res["loader"]["tokens_per_s"]
                                             / res["train_step_7b_h200"]["tokens_per_s_per_gpu"])
    res["machine"]["loadavg_end"] = os.getloadavg()

    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    plot(res, Path(a.plot))
    print(json.dumps(res, indent=1))
    print(report(res).table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
