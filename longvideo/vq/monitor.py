"""Guard rails of tokenizer training (docs/vq.md, "Guard rails"): a decoder that memorises a few
training scenes looks healthy on its training batches, and only held-out frames show it.
`health_warnings` compares each held-out evaluation with the untrained model's and says what to try;
`labelled_grid` draws held-out originals above their reconstructions, each with its PSNR.
"""

from __future__ import annotations

import math

import numpy as np
import torch

USAGE_FLOOR = 0.05
"""A held-out codebook usage below this fraction is reported as a collapse."""


def frame_psnrs(orig: torch.Tensor, recon: torch.Tensor) -> torch.Tensor:
    """PSNR (dB) of each frame of uint8 (..., H, W, 3) tensors: float64 (N,) over the flattened frames."""
    a = orig.reshape(-1, *orig.shape[-3:]).double()
    b = recon.reshape(-1, *recon.shape[-3:]).double()
    mse = (a - b).pow(2).mean((1, 2, 3))
    return torch.where(
        mse > 0, 10 * torch.log10(255.0**2 / mse.clamp_min(1e-12)), torch.full_like(mse, 100.0)
    )


def health_warnings(
    history: list[dict],
    *,
    train_videos: int | None = None,
    lr: float | None = None,
    max_usage: float = 1.0,
) -> list[str]:
    """Warnings about the last evaluation in `history` (history[0] is the untrained model's): held-out
    PSNR below the untrained model's (the decoder fits its training frames), and held-out codebook
    usage below USAGE_FLOOR x max_usage (the most the held-out set can use: codes it holds / size)."""
    if len(history) < 2 or history[-1]["step"] <= history[0]["step"]:
        return []
    first, last = history[0], history[-1]
    out = []
    if last["psnr"] < first["psnr"]:
        few = (
            f" ({train_videos} training video{'s' if train_videos != 1 else ''}; held-out videos "
            "are never trained on)"
            if train_videos is not None and train_videos < 10
            else ""
        )
        out.append(
            f"held-out PSNR {last['psnr']:.2f} dB at step {last['step']} is below the untrained "
            f"model's {first['psnr']:.2f} dB: it codes unseen video worse than before training (it is "
            f"memorising a few training scenes, or diverging). Try more and more varied training videos{few}, random crops "
            f"(crop_scale=2), a lower lr"
            + (f" (now {lr:g})" if lr else "")
            + " or a longer warmup_steps, and look at the sample grid"
        )
    floor = USAGE_FLOOR * min(1.0, max_usage)
    if last["usage"] < floor:
        used = last.get("codes_used")
        out.append(
            f"codebook collapse: {used if used is not None else '?'} codes "
            f"({100 * last['usage']:.1f} % of the codebook) used on held-out frames at step "
            f"{last['step']}, under {100 * floor:.2g} %. Try a lower lr"
            + (f" (now {lr:g})" if lr else "")
            + ", a longer warmup_steps and more varied training videos (with quantizer: vq, "
            "try quantizer: fsq, whose codes cannot die)"
        )
    return out


def short_warning(warnings: list[str]) -> str:
    """A few words for a progress bar: which checks failed."""
    tags = [
        "PSNR<untrained" if w.startswith("held-out PSNR") else "codebook collapse" for w in warnings
    ]
    return ("WARNING " + ", ".join(tags)) if tags else ""


def labelled_grid(
    orig: torch.Tensor,
    recon: torch.Tensor,
    *,
    step: int,
    psnr: float,
    usage: float,
    psnr_untrained: float | None = None,
    warnings: list[str] | None = None,
    max_cols: int = 8,
) -> torch.Tensor:
    """uint8 image (H', W', 3): a title (step, PSNRs, usage, warnings in red), then rows of held-out
    originals above their reconstructions, each with its PSNR (red below the untrained model's).
    orig/recon: frames (N, H, W, 3), rows of max_cols, or clips (C, L, H, W, 3), one per row."""
    from PIL import Image, ImageDraw, ImageFont

    if orig.ndim == 4:
        n = orig.shape[0]
        cols = min(n, max_cols)
        idx = [list(range(i, min(i + cols, n))) for i in range(0, n, cols)]
    else:
        c, length = orig.shape[:2]
        cols = min(length, max_cols * 2)
        idx = [[r * length + k for k in range(cols)] for r in range(c)]
    flat_o, flat_r = (
        orig.reshape(-1, *orig.shape[-3:]),
        recon.reshape(-1, *recon.shape[-3:]),
    )  # frames
    scores = frame_psnrs(flat_o, flat_r).tolist()
    h, w = orig.shape[-3:-1]
    gap, lab = 2, 12
    font = ImageFont.load_default()
    title = [
        f"step {step}: held-out PSNR {psnr:.2f} dB"
        + (f" (untrained {psnr_untrained:.2f} dB)" if psnr_untrained is not None else "")
        + f", codebook used {100 * usage:.1f} %",
        "rows: originals, then reconstructions (PSNR dB)",
    ]
    title += [("WARNING: " + short_warning([wn])[8:]) for wn in (warnings or [])]
    top = 12 * len(title) + 4
    text_w = max(ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength(t, font=font) for t in title)
    width = max(cols * (w + gap) - gap, int(math.ceil(text_w)) + 4)
    height = top + len(idx) * (2 * h + lab + 2 * gap)
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for i, line in enumerate(title):
        draw.text(
            (2, 1 + 12 * i),
            line,
            fill=(200, 0, 0) if line.startswith("WARNING") else (0, 0, 0),
            font=font,
        )
    y = top
    for row in idx:
        for col, k in enumerate(row):
            x = col * (w + gap)
            canvas.paste(Image.fromarray(flat_o[k].numpy()), (x, y))
            canvas.paste(Image.fromarray(flat_r[k].numpy()), (x, y + h + gap))
            bad = psnr_untrained is not None and scores[k] < psnr_untrained
            text = f"{scores[k]:.1f}" if math.isfinite(scores[k]) else "-"
            draw.text(
                (x + 1, y + 2 * h + gap), text, fill=(200, 0, 0) if bad else (0, 0, 0), font=font
            )
        y += 2 * h + lab + 2 * gap
    return torch.from_numpy(np.asarray(canvas).copy())
