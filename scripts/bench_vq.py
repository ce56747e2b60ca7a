"""VQ tokenizer benchmark: encode/decode throughput per config, and held-out quality after training.

    python scripts/bench_vq.py                                    # defaults: about 40 minutes on 2 cores
    python scripts/bench_vq.py --skip-train --configs tiny lwm-256
    python scripts/bench_vq.py --configs --train --real lwm-256:10:batch_size=2 --out /tmp/vq.json   # one part

Throughput at initialisation; `--train name:steps` on generated videos, `--real name:steps[:k=v,...]` on
videos over photographs held out by photograph, against the untrained tokenizer and bicubic thumbnails
(docs/vq.md). Runs stop at their step counts. Writes docs/bench/vq.json, vq.png and sample grids.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from benchreport import (
    ROOT,
    LayoutError,
    Section,
    Target,
    arg_parser,
    fmt_num,
    md_table,
    req,
    req_list,
    save,
    subplots,
)

from longvideo.data.frames import FrameSource, build_frame_source, synthetic_videos
from longvideo.machine import machine_info
from longvideo.train.vq import psnr, train_vq
from longvideo.vq import VQModel, decode_codes, encode_video
from longvideo.vq.config import load_vq_config

sys.path.insert(0, str(ROOT / "tests"))  # test material (videos over photographs) for train_steps

TITLE = "VQ video tokenizer"
DOCS = ["vq.md"]
TARGETS = [
    Target(
        "vq: throughput and held-out quality after training",
        "no numeric target (frames/s, PSNR, codebook usage)",
        met="n/a",
    )
]


def report(result: dict) -> Section:
    thr = req_list(result, "throughput")
    table = md_table(
        [
            "config",
            "mode",
            "resolution",
            "parameters (M)",
            "codes per group",
            "codebook",
            "encode frames/s",
            "decode frames/s",
            "codes per hour (1 fps)",
        ],
        [
            [
                f"`{req(r, 'name')}`",
                r.get("mode", "-"),
                r.get("resolution", "-"),
                fmt_num(r.get("params_M")),
                r.get("codes_per_group", "-"),
                f"{r.get('codebook_size', 0):,}",
                *[
                    fmt_num(req(r, k), ",.1f" if r[k] >= 10 else ".2g")
                    for k in ("encode_fps", "decode_fps")
                ],
                fmt_num(r.get("tokens_per_hour_1fps"), ",.0f"),
            ]
            for r in thr
        ],
    )
    trained = (result.get("training") or []) + (result.get("training_real") or [])
    if not all(isinstance(r, dict) for r in trained):
        raise LayoutError("training rows are not objects")
    if trained:
        table += "\n\n" + md_table(
            [
                "config",
                "videos",
                "training s",
                "steps",
                "held-out PSNR dB (untrained -> trained)",
                "8 x 8 / 16 x 16 thumbnail PSNR dB",
                "codebook used",
            ],
            [
                [
                    f"`{req(r, 'name')}`",
                    r.get("data", "synthetic"),
                    fmt_num(req(r, "train_seconds"), ",.0f"),
                    f"{req(r, 'steps'):,}",
                    f"{fmt_num(r.get('psnr_untrained'), '.1f')} -> {fmt_num(req(r, 'psnr'), '.1f')}",
                    " / ".join(
                        fmt_num((r.get("thumbnail_psnr") or {}).get(k), ".1f")
                        for k in ("8x8", "16x16")
                    ),
                    fmt_num(100 * req(r, "usage"), ".1f", " %"),
                ]
                for r in trained
            ],
        )
    psnr = {}
    for r in trained:
        psnr.setdefault(r["name"], []).append(f"{r['psnr']:.1f} dB {r.get('data', 'synthetic')}")
    t = Target(
        TARGETS[0].what,
        TARGETS[0].goal,
        met="n/a",
        figure="; ".join(
            f"`{r['name']}` {r['encode_fps']:,.0f} frames/s"
            + (f", PSNR {' / '.join(psnr[r['name']])}" if r["name"] in psnr else "")
            for r in thr
            if r["encode_fps"] >= 1
        ),
    )
    notes = [
        "Throughput: the fastest of the timings. Quality: held-out frames, each config trained from scratch; "
        "the untrained tokenizer and bicubic thumbnails are the baselines."
    ]
    images = [
        (
            f"held-out frames and reconstructions, {r['name']} ({r.get('data', 'synthetic')})",
            f"vq_{r['name']}{'_real' if r.get('data') == 'real' else ''}_samples.png",
        )
        for r in trained
    ]
    return Section(table, [t], notes, images)


def throughput(name: str, frames: int, repeats: int) -> dict:
    cfg = load_vq_config(str(ROOT / "configs" / "vq" / f"{name}.yaml"), [])
    if cfg.resolution >= 128:  # seconds a frame on a CPU
        frames, repeats = 5, 1
    torch.manual_seed(0)
    vq, r, batch = VQModel(cfg).eval(), cfg.resolution, min(16, frames)
    video = torch.randint(
        0, 256, (frames, r, r, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    encode_video(vq, video[:batch], batch_frames=batch)  # warm-up
    enc, dec = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        codes = encode_video(vq, video, batch_frames=batch)
        t1 = time.perf_counter()
        out = decode_codes(vq, codes, batch_groups=max(1, batch // cfg.frames_per_group))
        enc.append(t1 - t0)
        dec.append(time.perf_counter() - t1)
    return {
        "name": name,
        "mode": cfg.mode,
        "resolution": r,
        "codes_per_group": cfg.codes_per_frame,
        "codebook_size": cfg.codebook_size,
        "params_M": round(sum(p.numel() for p in vq.parameters()) / 1e6, 2),
        "frames": frames,
        "encode_fps": frames / min(enc),
        "decode_fps": out.shape[0] / min(dec),
        "tokens_per_hour_1fps": cfg.tokens_per_hour(1.0),
    }


def thumbnail_psnr(frames: torch.Tensor, side: int) -> float:
    """PSNR of uint8 frames (..., H, W, 3) against their side x side thumbnails upsampled bicubically."""
    f = frames.reshape(-1, *frames.shape[-3:])
    small = F.interpolate(
        f.permute(0, 3, 1, 2).float(), size=(side, side), mode="bicubic", antialias=True
    )
    up = (
        F.interpolate(small, size=f.shape[1:3], mode="bicubic")
        .round()
        .clamp(0, 255)
        .to(torch.uint8)
    )
    return psnr(up.permute(0, 2, 3, 1), f)


def train_steps(
    name: str, steps: int, videos: int, work: Path, docs: Path, real: bool, overrides: list[str]
) -> dict:
    cfg = load_vq_config(str(ROOT / "configs" / "vq" / f"{name}.yaml"), overrides)
    big = (
        cfg.resolution >= 128
    )  # a CPU makes a handful of steps there: evaluate at the start and the end only
    cfg = dataclasses.replace(
        cfg,
        steps=steps,
        save_every=steps,
        eval_every=steps if big else 100,
        **({"eval_frames": 8 if cfg.mode == "2d" else 9} if big else {}),
    )
    if real:
        from material.photo_videos import real_videos

        per, n = (
            (4, 48) if not big else (2, 24)
        )  # fewer, shorter videos at 256 x 256 keep the pool small
        src = FrameSource(
            *[
                [
                    torch.from_numpy(v)
                    for v in real_videos(
                        split, videos_per_scene=k, num_frames=n, size=size, seed=seed
                    )
                ]
                for split, k, size, seed in (
                    ("train", per, cfg.train_size, 0),
                    ("heldout", 2, cfg.resolution, 1),
                )
            ]
        )
    else:
        src = build_frame_source(synthetic_videos(videos, cfg, fps=4.0, seed=0), cfg)
    held = (
        src.eval_frames(cfg.eval_frames)
        if cfg.mode == "2d"
        else src.eval_clips(cfg.eval_frames, 1 + cfg.frames_per_group * (cfg.clip_groups - 1))
    )
    out = work / (name + ("_real" if real else ""))
    res = train_vq(cfg, src, out, resume=False, progress=True, tensorboard=False)
    if not big:  # 256 x 256 grids of a few CPU steps are megabytes of untrained pictures
        shutil.copy(
            sorted((out / "samples").glob("step_*.png"))[-1], docs / f"vq_{out.name}_samples.png"
        )
    return {
        "name": name,
        "data": "real" if real else "synthetic",
        "overrides": overrides,
        "train_seconds": round(res.seconds, 1),
        "steps": res.step,
        "batch_size": cfg.batch_size,
        **{k: res.metrics[k] for k in ("psnr", "usage", "perplexity", "codes_used")},
        "psnr_untrained": res.history[0]["psnr"],
        "heldout_frames": held.reshape(-1, *held.shape[-3:]).shape[0],
        "thumbnail_psnr": {f"{s}x{s}": thumbnail_psnr(held, s) for s in (8, 16)},
        "curve": [{k: h[k] for k in ("step", "seconds", "psnr", "usage")} for h in res.history],
    }


def plot(result: dict):
    fig, axes = subplots(1, 3, figsize=(15, 4.2))
    rows = result["throughput"]
    for off, key in ((-0.2, "encode_fps"), (0.2, "decode_fps")):
        axes[0].bar([i + off for i in range(len(rows))], [r[key] for r in rows], 0.4, label=key[:6])
    axes[0].set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=15)
    axes[0].set(yscale="log", ylabel="frames / s (CPU)", title="throughput")
    for r in result.get("training", []) + result.get("training_real", []):
        for ax, key, scale in ((axes[1], "psnr", 1), (axes[2], "usage", 100)):
            ax.plot(
                [c["step"] for c in r["curve"]],
                [scale * c[key] for c in r["curve"]],
                marker="o",
                ms=3,
                ls="-" if r.get("data") == "real" else "--",
                label=f"{r['name']} ({r.get('data', 'synthetic')})",
            )
    axes[1].set(xlabel="training steps", ylabel="held-out PSNR (dB)", title="quality vs training")
    axes[2].set(
        xlabel="training steps",
        ylabel="codebook used (%)",
        title="codebook usage (held-out frames)",
    )
    return fig


def main(argv: list[str] | None = None) -> None:
    p = arg_parser(__doc__, "vq")
    p.add_argument(
        "--configs",
        nargs="*",
        default=["tiny", "causal3d-tiny", "lwm-256", "causal3d-256"],
        help="configs/vq/<name>.yaml to time",
    )
    p.add_argument(
        "--fps-frames", type=int, default=64, help="frames a timing (5 for 256 x 256 configs)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="timings a config (1 for 256 x 256); the fastest counts",
    )
    p.add_argument(
        "--train", nargs="*", default=["tiny:1500", "causal3d-tiny:800"], metavar="NAME:STEPS"
    )
    p.add_argument(
        "--real",
        nargs="*",
        default=["tiny:3500", "causal3d-tiny:1600", "lwm-256:10:batch_size=2", "causal3d-256:10"],
        metavar="NAME:STEPS[:key=value,...]",
    )
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--videos", type=int, default=60, help="synthetic training videos")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_info(), "throughput": [], "training": [], "training_real": []}
    for name in a.configs:
        result["throughput"].append(throughput(name, a.fps_frames, a.repeats))
        print(json.dumps(result["throughput"][-1]), flush=True)
    with tempfile.TemporaryDirectory() as work:
        for key, specs in (("training", a.train), ("training_real", a.real)):
            for spec in [] if a.skip_train else specs:
                name, steps, over = (spec.split(":", 2) + ["", ""])[:3]
                row = train_steps(
                    name,
                    int(steps),
                    a.videos,
                    Path(work),
                    out.parent,
                    key == "training_real",
                    [o for o in over.split(",") if o],
                )
                result[key].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
    save(result, out, plot, report)


if __name__ == "__main__":
    main()
