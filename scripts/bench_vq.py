"""VQ tokenizer benchmark: encode/decode throughput per config, and quality after a training budget.

    python scripts/bench_vq.py                                    # defaults: a few minutes on a CPU
    python scripts/bench_vq.py --train tiny:600 causal3d-tiny:300 --fps-frames 128
    python scripts/bench_vq.py --skip-train --configs tiny lwm-256
    python scripts/bench_vq.py --update --configs --train --real lwm-256:240:batch_size=2   # one part

1. Throughput: frames per second that `encode_video` and `decode_codes` process for each config
   (weights at initialisation: speed does not depend on them), side by side in one run, with the
   codes each config spends per second of video at 1 fps (2d: one group per frame; causal3d: one
   group per 4 frames, so a quarter of the tokens).
2. Quality: each `name:seconds` of --train trains that config from scratch on generated
   moving-shapes videos (the demo's data) for that much training time, and reports held-out PSNR,
   the fraction of the codebook used and its perplexity along the way. `tiny:180` is the demo's
   budget: three minutes.
3. Quality on real footage: each `name:seconds` of --real trains that config from scratch on
   videos over real photographs (material.photo_videos: a camera panning, zooming and rolling
   over scikit-image's sample photographs) and evaluates on videos over *other* photographs,
   never trained on. Baselines on the same held-out frames: the untrained tokenizer, and 8 x 8
   and 16 x 16 thumbnails upsampled bicubically (what 192 and 768 bytes per frame give).

Writes docs/bench/vq.json, docs/bench/vq.png, docs/bench/vq_<config>_samples.png (synthetic) and
docs/bench/vq_<config>_real_samples.png (real), held-out originals above their reconstructions
at the end of training, each labelled with its PSNR (64 x 64 configs only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # test material: videos over photographs

from longvideo.vq import VQModel, decode_codes, encode_video  # noqa: E402
from longvideo.data.frames import FrameSource, build_frame_source, synthetic_videos  # noqa: E402
from longvideo.train.vq import psnr, train_vq  # noqa: E402
from longvideo.vq.config import load_vq_config  # noqa: E402

# ------------------------------------------------------------------------------------------- report
# Read by run_benchmarks.py to build docs/benchmarks.md: the title, what is measured, the detail docs
# under docs/ (the first that exists is linked), the targets (the summary rows while nothing is
# measured) and report(), which turns this script's JSON into a table, the targets met or not, and
# notes.

from benchreport import LayoutError, Section, Target, fmt_num, md_table, req, req_list  # noqa: E402

TITLE = "VQ video tokenizer"
MEASURES = ("Encode and decode frames/s of each VQ config (2D per frame and causal 3D) and the codes it "
            "spends per second of video; held-out PSNR and codebook usage after training from scratch for a "
            "fixed time budget, against the untrained tokenizer.")
DOCS = ["vq.md"]
TARGETS = [Target("vq: throughput and quality after a fixed training budget",
                  "no numeric target (frames/s, PSNR, codebook usage)", met="n/a")]


def _fps(x) -> str:
    return fmt_num(x, ",.1f" if isinstance(x, (int, float)) and x >= 10 else ".3g")


def report(result: dict) -> Section:
    thr = req_list(result, "throughput")
    body = []
    for r in thr:
        body.append([f"`{req(r, 'name')}`", str(r.get("mode", "-")), str(r.get("resolution", "-")),
                     fmt_num(r.get("params_M"), ".2f"), str(r.get("codes_per_group", "-")),
                     f"{r.get('codebook_size', 0):,}", _fps(req(r, "encode_fps")), _fps(req(r, "decode_fps")), fmt_num(r.get("tokens_per_second_of_video"), ",.0f"),
                     fmt_num(r.get("tokens_per_hour_1fps"), ",.0f")])
    table = md_table(["config", "mode", "resolution", "parameters (M)", "codes per group", "codebook",
                      "encode frames/s", "decode frames/s", "codes per second of video (1 fps)",
                      "codes per hour (1 fps)"], body)
    trained = result.get("training") or []
    if not isinstance(trained, list):
        raise LayoutError("training is not a list")
    rows2 = []
    for r in trained:
        rows2.append([f"`{req(r, 'name')}`", fmt_num(req(r, "train_seconds"), ",.0f"), f"{req(r, 'steps'):,}",
                      f"{fmt_num(r.get('psnr_untrained'), '.1f')} -> {fmt_num(req(r, 'psnr'), '.1f')}",
                      fmt_num(100 * req(r, "usage"), ".1f", " %"), fmt_num(r.get("perplexity"), ",.0f"),
                      fmt_num(r.get("codes_used"), ",.0f")])
    if rows2:
        table += "\n\n" + md_table(["config", "training s", "steps", "held-out PSNR dB (untrained -> trained)",
                                      "codebook used", "codebook perplexity", "codes used"], rows2)
    real = result.get("training_real") or []
    if not isinstance(real, list):
        raise LayoutError("training_real is not a list")
    rows3 = [[f"`{req(r, 'name')}`", fmt_num(req(r, "train_seconds"), ",.0f"), f"{req(r, 'steps'):,}",
              f"{fmt_num(r.get('psnr_untrained'), '.1f')} -> {fmt_num(req(r, 'psnr'), '.1f')}",
              " / ".join(fmt_num((r.get("thumbnail_psnr") or {}).get(k), ".1f") for k in ("8x8", "16x16")),
              fmt_num(100 * req(r, "usage"), ".1f", " %"), fmt_num(r.get("codes_used"), ",.0f")] for r in real]
    if rows3:
        table += "\n\n" + md_table(["config (real footage)", "training s", "steps",
                                      "held-out PSNR dB (untrained -> trained)",
                                      "8 x 8 / 16 x 16 thumbnail PSNR dB", "codebook used", "codes used"], rows3)
    t = Target(TARGETS[0].what, TARGETS[0].goal, met="n/a")
    by = {r["name"]: r for r in thr}
    figs = []
    for r in trained + real:
        enc = by.get(r["name"], {}).get("encode_fps")
        if r.get("data") == "real":
            figs.append(f"`{r['name']}` on real footage: PSNR {r['psnr']:.1f} dB, {100 * r['usage']:.0f} % of "
                        f"the codebook after {r['train_seconds']:,.0f} s")
            continue
        figs.append(f"`{r['name']}`: " + (f"{enc:,.0f} frames/s encode, " if enc else "")
                    + f"PSNR {r['psnr']:.1f} dB, {100 * r['usage']:.0f} % of the codebook after "
                    f"{r['train_seconds']:,.0f} s")
    if not figs:
        figs = [f"`{r['name']}`: {r['encode_fps']:,.0f} frames/s encode" for r in thr]
    t.figure = "; ".join(figs)
    notes = ["Throughput: weights at initialisation (speed does not depend on them), the fastest of the "
             "timings. Quality: each trained config starts from scratch on generated moving-shapes videos "
             "and stops at its training-time budget; PSNR and codebook usage are measured on held-out frames. "
             "The baselines are the untrained tokenizer (PSNR) and, for token cost, the 2D per-frame configs "
             "beside the causal 3D ones. Real footage: videos over photographs, held out by photograph; "
             "thumbnails upsampled bicubically are the simple-codec baseline."]
    if not trained:
        notes.append("No training run in this JSON (run without `--skip-train` for the quality columns).")
    images = [(f"held-out frames and reconstructions, {r['name']}", f"vq_{r['name']}_samples.png")
              for r in trained]
    images += [(f"held-out real frames and reconstructions, {r['name']}", f"vq_{r['name']}_real_samples.png")
               for r in real]
    return Section(table, [t], notes, images)


def throughput(name: str, frames: int, batch: int, repeats: int) -> dict:
    cfg = load_vq_config(str(ROOT / "configs" / "vq" / f"{name}.yaml"), [])
    torch.manual_seed(0)
    vq = VQModel(cfg).eval()
    r = cfg.resolution
    video = torch.randint(0, 256, (frames, r, r, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    encode_video(vq, video[: min(frames, batch)], batch_frames=batch)  # warm-up
    enc, dec = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        codes = encode_video(vq, video, batch_frames=batch)
        enc.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = decode_codes(vq, codes, batch_groups=max(1, batch // cfg.frames_per_group))
        dec.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in vq.parameters())
    return {"name": name, "mode": cfg.mode, "resolution": r, "codes_per_group": cfg.codes_per_frame,
            "codebook_size": cfg.codebook_size, "params_M": round(params / 1e6, 2), "frames": frames,
            "encode_fps": frames / min(enc), "decode_fps": out.shape[0] / min(dec),
            "tokens_per_second_of_video": cfg.tokens_per_hour(1.0) / 3600,
            "tokens_per_hour_1fps": cfg.tokens_per_hour(1.0)}


def thumbnail_psnr(frames: torch.Tensor, side: int) -> float:
    """PSNR of uint8 frames (..., H, W, 3) against their side x side thumbnails upsampled bicubically."""
    import torch.nn.functional as F

    f = frames.reshape(-1, *frames.shape[-3:]).permute(0, 3, 1, 2).float()
    small = F.interpolate(f, size=(side, side), mode="bicubic", antialias=True, align_corners=False)
    up = F.interpolate(small, size=f.shape[-2:], mode="bicubic", align_corners=False)
    up = up.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    return psnr(up, frames.reshape(-1, *frames.shape[-3:]))


def real_source(cfg) -> FrameSource:
    """Videos over the training photographs (at cfg.train_size: crop_scale) and over the held-out ones."""
    from material.photo_videos import real_videos

    # fewer, shorter videos at 256 x 256 keep the pool in RAM small (a CPU makes few steps there anyway)
    per, frames = (4, 48) if cfg.resolution <= 128 else (2, 24)
    train = real_videos("train", videos_per_scene=per, num_frames=frames, size=cfg.train_size, seed=0)
    held = real_videos("heldout", videos_per_scene=2, num_frames=frames, size=cfg.resolution, seed=1)
    return FrameSource([torch.from_numpy(v) for v in train], [torch.from_numpy(v) for v in held])


def train_budget(name: str, seconds: float, videos: int, work: Path, docs: Path, *, real: bool = False,
                 overrides: list[str] | None = None) -> dict:
    cfg = load_vq_config(str(ROOT / "configs" / "vq" / f"{name}.yaml"), overrides or [])
    # the step count only sets the length of the learning-rate decay; time stops the run
    big = cfg.resolution >= 128  # a CPU makes a handful of steps: evaluate at the start and the end only
    cfg = dataclasses.replace(cfg, steps=100_000, eval_every=100_000 if big else 100, save_every=100_000,
                              **({"eval_frames": 8 if cfg.mode == "2d" else 9} if big else {}))
    src = real_source(cfg) if real else build_frame_source(synthetic_videos(videos, cfg, fps=4.0, seed=0), cfg)
    held = src.eval_frames(cfg.eval_frames) if cfg.mode == "2d" else src.eval_clips(
        cfg.eval_frames, 1 + cfg.frames_per_group * (cfg.clip_groups - 1))
    out = work / (name + ("_real" if real else ""))
    t0 = time.perf_counter()
    res = train_vq(cfg, src, out, time_budget_s=seconds, resume=False, progress=True, tensorboard=False)
    wall = time.perf_counter() - t0
    if not big:  # 256 x 256 grids of a few CPU steps are megabytes of untrained pictures
        last = sorted((out / "samples").glob("step_*.png"))[-1]
        shutil.copy(last, docs / f"vq_{name}{'_real' if real else ''}_samples.png")
    return {"name": name, "data": "real" if real else "synthetic", "overrides": overrides or [],
            "train_seconds": round(res.seconds, 1), "wall_seconds": round(wall, 1),
            "steps": res.step, "steps_per_s": res.step / max(res.seconds, 1e-9), "batch_size": cfg.batch_size,
            "crop_scale": cfg.crop_scale, "psnr": res.metrics["psnr"],
            "usage": res.metrics["usage"], "perplexity": res.metrics["perplexity"],
            "codes_used": res.metrics["codes_used"], "psnr_untrained": res.history[0]["psnr"],
            "psnr_min": min(h["psnr"] for h in res.history), "warnings": res.metrics.get("warnings", []),
            "heldout_frames": int(held.reshape(-1, *held.shape[-3:]).shape[0]),
            "thumbnail_psnr": {"8x8": thumbnail_psnr(held, 8), "16x16": thumbnail_psnr(held, 16)},
            "curve": [{k: h[k] for k in ("step", "seconds", "psnr", "usage", "perplexity")} for h in res.history]}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    rows = results["throughput"]
    names = [r["name"] for r in rows]
    x = range(len(rows))
    axes[0].bar([i - 0.2 for i in x], [r["encode_fps"] for r in rows], 0.4, label="encode")
    axes[0].bar([i + 0.2 for i in x], [r["decode_fps"] for r in rows], 0.4, label="decode")
    axes[0].set_xticks(list(x), names, rotation=15)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("frames / s (CPU)")
    axes[0].set_title("throughput")
    axes[0].legend()
    for r in results["training"] + results.get("training_real", []):
        c = r["curve"]
        label = r["name"] + (" (real)" if r.get("data") == "real" else " (shapes)")
        style = "-" if r.get("data") == "real" else "--"
        axes[1].plot([p["seconds"] for p in c], [p["psnr"] for p in c], style, marker="o", ms=3, label=label)
        axes[2].plot([p["seconds"] for p in c], [100 * p["usage"] for p in c], style, marker="o", ms=3,
                     label=label)
    axes[1].set_xlabel("training seconds")
    axes[1].set_ylabel("held-out PSNR (dB)")
    axes[1].set_title("quality vs training time")
    axes[2].set_xlabel("training seconds")
    axes[2].set_ylabel("codebook used (%)")
    axes[2].set_title("codebook usage (held-out frames)")
    for ax in axes[1:]:
        ax.grid(alpha=0.3)
        if results["training"]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="*", default=["tiny", "causal3d-tiny", "lwm-256", "causal3d-256"],
                   help="configs/vq/<name>.yaml to time")
    p.add_argument("--fps-frames", type=int, default=64, help="frames encoded per timing (small configs)")
    p.add_argument("--fps-frames-256", type=int, default=5, help="frames per timing for 256 x 256 configs")
    p.add_argument("--repeats", type=int, default=2, help="timings per small config (the fastest is kept)")
    p.add_argument("--repeats-256", type=int, default=1, help="timings per 256 x 256 config")
    p.add_argument("--train", nargs="*", default=["tiny:180", "causal3d-tiny:180"], metavar="NAME:SECONDS",
                   help="configs to train from scratch and their training-time budgets")
    p.add_argument("--real", nargs="*", default=["tiny:600", "causal3d-tiny:300", "lwm-256:240", "causal3d-256:240"],
                   metavar="NAME:SECONDS[:key=value,...]",
                   help="configs to train from scratch on real-photograph videos (held out by photograph), "
                        "their training-time budgets and optional config overrides")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--videos", type=int, default=60, help="synthetic training videos")
    p.add_argument("--out", default=str(ROOT / "docs" / "bench" / "vq.json"))
    p.add_argument("--update", action="store_true",
                   help="keep the rows of --out that this run does not redo (run the benchmark in parts)")
    a = p.parse_args(argv)

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY") if k in os.environ}
    results = {"machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                           "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                           "loadavg_start": list(os.getloadavg()), "env": env},
               "throughput": [], "training": [], "training_real": []}
    for name in a.configs:
        big = load_vq_config(str(ROOT / "configs" / "vq" / f"{name}.yaml"), []).resolution >= 128
        n = a.fps_frames_256 if big else a.fps_frames
        row = throughput(name, n, batch=min(16, n), repeats=a.repeats_256 if big else a.repeats)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        results["throughput"].append(row)
    if not a.skip_train:
        with tempfile.TemporaryDirectory() as work:
            for spec in a.train:
                name, _, secs = spec.partition(":")
                row = train_budget(name, float(secs or 180), a.videos, Path(work), out.parent)
                print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
                results["training"].append(row)
            for spec in a.real:
                name, _, rest = spec.partition(":")
                secs, _, over = rest.partition(":")
                row = train_budget(name, float(secs or 600), a.videos, Path(work), out.parent, real=True,
                                   overrides=[o for o in over.split(",") if o])
                print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
                results["training_real"].append(row)
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    for key in ("training", "training_real"):
        for r in results[key]:
            r["loadavg_end"] = results["machine"]["loadavg_end"]
    if a.update and out.is_file():  # earlier parts: keep the rows not redone now, in their order
        old = json.loads(out.read_text())
        for key in ("throughput", "training", "training_real"):
            new = {r["name"]: r for r in results[key]}
            kept = [new.pop(r["name"], r) for r in old.get(key, [])]
            results[key] = kept + list(new.values())
        results["machine"]["parts"] = old.get("machine", {}).get("parts", [old.get("machine")]) + [
            dict(results["machine"])]
    # one row per config for the summary table: throughput joined with training quality
    trained = {r["name"]: r for r in results["training"]}
    results["results"] = [{**t, **{k: trained[t["name"]][k] for k in ("psnr", "usage", "perplexity", "steps",
                                                                        "train_seconds")
                                   if t["name"] in trained}} for t in results["throughput"]]
    results["results"] += [{"name": r["name"], **{k: r[k] for k in ("psnr", "usage", "perplexity", "steps",
                                                                    "train_seconds")}}
                           for r in results["training"] if r["name"] not in {t["name"] for t in results["throughput"]}]
    out.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
