"""Training the tokenizer (docs/vq.md, "Training"): reconstruction (L1 + L2) + quantizer loss (+ an
optional patch GAN). `out_dir` receives the tokenizer (`load_vq` reads it), `train_state.pt` (what
resuming needs), `metrics.jsonl`, `samples/` and `tb/`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from longvideo.atomic import atomic_open
from longvideo.configtools import to_dict
from longvideo.data.frames import FrameSource, Source, build_frame_source
from longvideo.data.video import resize_crop
from longvideo.vq.codec import eval_mode, frames_to_input, output_to_frames
from longvideo.vq.config import VQConfig
from longvideo.vq.discriminator import PatchDiscriminator, adaptive_weight, hinge_d_loss
from longvideo.vq.model import CONFIG_FILE, VQModel
from longvideo.vq.monitor import health_warnings, labelled_grid, short_warning
from longvideo.vq.quantizer import codebook_usage

log = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
METRICS_FILE = "metrics.jsonl"
ARCH_KEYS = (
    "mode",
    "resolution",
    "downsample",
    "temporal_downsample",
    "codebook_size",
    "patch_size",
    "channels",
    "channel_mult",
    "num_res_blocks",
    "temporal_kernel",
    "quantizer",
    "fsq_levels",
    "codebook_dim",
)
"""Config fields that shape the weights: a resumed run must keep them."""


@dataclass
class TrainResult:
    out_dir: Path
    """Where the tokenizer and its logs were written."""
    step: int
    """Optimizer steps done in total (across resumes)."""
    seconds: float
    """Training wall time in total (across resumes)."""
    metrics: dict
    """Last held-out evaluation: psnr (dB), usage (fraction of codes), perplexity, codes_used."""
    history: list[dict] = field(default_factory=list)
    """Every evaluation, the first one (step 0) made before any update."""


def lr_at(cfg: VQConfig, step: int, progress: float) -> float:
    """Linear warm-up over warmup_steps, then cosine decay to 10 % at progress = 1."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of two uint8 tensors, from the mean squared error over all their pixels."""
    mse = (a.double() - b.double()).pow(2).mean().item()
    return 100.0 if mse == 0 else 10 * math.log10(255.0**2 / mse)


@torch.no_grad()
def evaluate(vq: VQModel, batch: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """({psnr, usage, perplexity, codes_used}, reconstructions shaped like `batch`) of held-out uint8
    frames (N, H, W, 3) (2d) or clips (C, L, H, W, 3) (causal3d)."""
    device = next(vq.parameters()).device
    recons, codes = [], []
    clips = vq.cfg.mode != "2d"
    with eval_mode(vq):
        for part in batch if clips else batch.split(16):  # one clip, or 16 frames, per call
            rec, c, _ = vq(frames_to_input(part, device, as_clip=clips))
            recons.append(output_to_frames(rec)[None] if clips else output_to_frames(rec))
            codes.append(c.cpu())
    recon = torch.cat(recons)
    metrics = {
        "psnr": psnr(recon, batch),
        **codebook_usage(torch.cat([c.flatten() for c in codes]), vq.cfg.codebook_size),
    }
    return metrics, recon


def _check_resume(cfg: VQConfig, out: Path) -> None:
    saved = json.loads((out / CONFIG_FILE).read_text())
    now = to_dict(cfg)
    diff = [k for k in ARCH_KEYS if k in saved and saved[k] != now[k]]
    if diff:
        raise ValueError(
            f"cannot resume {out}: its tokenizer has different "
            + ", ".join(f"{k}={saved[k]!r} (now {now[k]!r})" for k in diff)
            + "; pass resume=False (--no-resume) or another output directory"
        )


def random_crops(x: torch.Tensor, size: int, gen: torch.Generator) -> torch.Tensor:
    """A random square crop of each frame (B, S, S, 3) or clip (B, L, S, S, 3), resized (antialiased
    bilinear) to size x size: side uniform in [size, S], position uniform, one crop per clip."""
    s = x.shape[-2]
    if s == size:
        return x
    out = []
    for item in x:
        c = int(torch.randint(min(size, s), s + 1, (1,), generator=gen))
        y0, x0 = (int(v) for v in torch.randint(s - c + 1, (2,), generator=gen))
        crop = resize_crop(item[..., y0 : y0 + c, x0 : x0 + c, :].reshape(-1, c, c, 3), size)
        out.append(crop.reshape(*item.shape[:-3], size, size, 3))
    return torch.stack(out)


class _Batches:
    """Random training batches: uint8 frames (B, H, W, 3) or clips (B, L, H, W, 3), cropped
    (when the frames are kept larger than the resolution: crop_scale) and flipped at random."""

    def __init__(self, src: FrameSource, cfg: VQConfig, gen: torch.Generator):
        self.src, self.cfg, self.gen = src, cfg, gen
        self.clip_len = 1 + cfg.frames_per_group * (cfg.clip_groups - 1)

    def next(self) -> torch.Tensor:
        cfg = self.cfg
        if cfg.mode == "2d":
            x = self.src.sample_frames(cfg.batch_size, self.gen)
        else:
            x = self.src.sample_clips(cfg.batch_size, self.clip_len, self.gen)
        x = random_crops(x, cfg.resolution, self.gen)
        flip = torch.rand(x.shape[0], generator=self.gen) < 0.5
        x[flip] = x[flip].flip(-2)  # horizontal flip (W is the second-last dim)
        return x

    def eval_set(self) -> torch.Tensor:
        if self.cfg.mode == "2d":
            return self.src.eval_frames(self.cfg.eval_frames)
        return self.src.eval_clips(self.cfg.eval_frames, self.clip_len)


def train_vq(
    cfg,
    source: Source | FrameSource,
    out_dir: str | Path,
    *,
    steps: int | None = None,
    time_budget_s: float | None = None,
    resume: bool = True,
    device: str | None = None,
    progress: bool = True,
    tensorboard: bool = True,
) -> TrainResult:
    """Train a tokenizer from scratch, or resume the run in `out_dir` (docs/vq.md, "Training").

    cfg: a VQConfig or a root Config (its `vq`). source: what `--data` takes, uint8 videos (T, H, W, 3)
    (one or a list), or a FrameSource. steps: overrides cfg.steps. time_budget_s: also stop after this
    much training time (the learning-rate decay follows whichever of steps and time ends first)."""
    if not isinstance(cfg, VQConfig):
        if not isinstance(getattr(cfg, "vq", None), VQConfig):
            raise TypeError(f"expected a VQConfig or a root Config, got {type(cfg).__name__}")
        cfg = cfg.vq
    if steps is not None:
        cfg = dataclasses.replace(cfg, steps=steps)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))

    torch.manual_seed(cfg.seed)
    vq = VQModel(cfg).to(device)
    disc = PatchDiscriminator(cfg.disc_channels).to(device) if cfg.disc_weight > 0 else None
    opt = torch.optim.AdamW(
        vq.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay
    )
    d_opt = (
        torch.optim.AdamW(disc.parameters(), lr=cfg.lr, betas=(0.5, 0.9), weight_decay=0.0)
        if disc is not None
        else None
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    step, elapsed, history = 0, 0.0, []

    state_path = out / STATE_FILE
    if resume and state_path.is_file():
        _check_resume(cfg, out)
        state = torch.load(state_path, map_location="cpu", weights_only=True)
        vq.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        if disc is not None and "disc" in state:
            disc.load_state_dict(state["disc"])
            d_opt.load_state_dict(state["disc_optimizer"])
        gen.set_state(state["sampler"])
        step, elapsed = int(state["step"]), float(state["seconds"])
        history = json.loads(state["history"])

    src = build_frame_source(source, cfg, progress=progress)
    batches = _Batches(src, cfg, gen)
    eval_set = batches.eval_set()
    # codes the held-out set holds: 8 frames of 256 codes can use at most a quarter of 8192 codes
    groups = eval_set.shape[0] * (
        cfg.num_groups(eval_set.shape[1]) if cfg.mode == "causal3d" else 1
    )
    held_codes = groups * cfg.codes_per_frame

    writer = None
    if tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(out / "tb"))

    def run_eval() -> dict:
        from PIL import Image

        metrics, recon = evaluate(vq, eval_set)
        png = out / "samples" / f"step_{step:07d}.png"
        metrics = {"step": step, "seconds": round(elapsed, 2), **metrics}
        history.append(metrics)
        # guard rails: compare with the untrained model (history[0]) and say what to try
        metrics["warnings"] = health_warnings(
            history,
            train_videos=len(src.train),
            lr=cfg.lr,
            max_usage=held_codes / cfg.codebook_size,
        )
        for w in metrics["warnings"]:
            log.warning("train-vq: %s (%s)", w, png)
        with open(out / METRICS_FILE, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        grid = labelled_grid(
            eval_set,
            recon,
            step=step,
            psnr=metrics["psnr"],
            usage=metrics["usage"],
            psnr_untrained=history[0]["psnr"] if step > history[0]["step"] else None,
            warnings=metrics["warnings"],
        )
        png.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(grid.numpy()).save(png)
        if writer is not None:
            for k in ("psnr", "usage", "perplexity"):
                writer.add_scalar(f"eval/{k}", metrics[k], step)
            writer.add_image("eval/originals_over_reconstructions", grid.permute(2, 0, 1), step)
            writer.flush()
        return metrics

    def save() -> None:
        vq.save(out)
        state = {
            "model": vq.state_dict(),
            "optimizer": opt.state_dict(),
            "sampler": gen.get_state(),
            "step": step,
            "seconds": elapsed,
            "history": json.dumps(history),
        }
        if disc is not None:
            state["disc"], state["disc_optimizer"] = disc.state_dict(), d_opt.state_dict()
        with atomic_open(state_path, "wb") as f:  # fsynced and renamed: never a partial state
            torch.save(state, f)

    if step == 0 and not history:
        run_eval()  # the untrained baseline
    last_weight = vq.decoder.layers[-1].conv.weight

    from tqdm import tqdm

    desc = "train-vq" + (f" (stops after {time_budget_s:g} s)" if time_budget_s else "")
    bar = tqdm(total=cfg.steps, initial=step, unit="step", desc=desc, disable=not progress)
    post: dict[str, str] = {}

    def show(**kw) -> None:
        # held-out PSNR of the last evaluation (from step 0 on) and any warning stay in the postfix
        last = history[-1]
        post.update(kw, heldout=f"{last['psnr']:.1f}dB")
        post.pop("warn", None)
        if last.get("warnings"):
            post["warn"] = short_warning(last["warnings"])
        bar.set_postfix(post, refresh=True)

    show()
    hist = torch.zeros(cfg.codebook_size, dtype=torch.long)
    vq.train()
    while step < cfg.steps and not (time_budget_s is not None and elapsed >= time_budget_s):
        t0 = time.perf_counter()
        frames = batches.next()
        x = frames_to_input(
            frames, device, as_clip=cfg.mode != "2d"
        )  # (B, 3, L, H, W); L = 1 in 2d
        lr = lr_at(
            cfg, step, max(step / cfg.steps, elapsed / time_budget_s if time_budget_s else 0.0)
        )
        for g in opt.param_groups:
            g["lr"] = lr

        recon, codes, aux = vq(x)
        err = recon - x
        rec_loss = cfg.l1_weight * err.abs().mean() + cfg.l2_weight * err.pow(2).mean()
        loss = rec_loss + aux
        gan_on = disc is not None and step >= cfg.disc_start
        if gan_on:
            fake = recon.transpose(1, 2).flatten(0, 1)  # frames (B T, 3, H, W)
            g_loss = -disc(fake).mean()
            loss = loss + cfg.disc_weight * adaptive_weight(rec_loss, g_loss, last_weight) * g_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(vq.parameters(), cfg.grad_clip)
        opt.step()
        if gan_on:
            real = x.transpose(1, 2).flatten(0, 1)
            d_loss = hinge_d_loss(disc(real), disc(fake.detach()))
            d_opt.zero_grad(set_to_none=True)
            d_loss.backward()
            d_opt.step()

        step += 1
        elapsed += time.perf_counter() - t0
        hist += torch.bincount(codes.flatten().cpu(), minlength=cfg.codebook_size)
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.steps:
            batch_psnr = 10 * math.log10(4.0 / max(err.detach().pow(2).mean().item(), 1e-10))
            used = (hist > 0).float().mean().item()
            show(loss=f"{loss.item():.4f}", batch_psnr=f"{batch_psnr:.1f}", usage=f"{used:.2f}")
            if writer is not None:
                scalars = {
                    "loss": loss.item(),
                    "rec_loss": rec_loss.item(),
                    "quant_loss": float(aux),
                    "psnr": batch_psnr,
                    "usage": used,
                    "lr": lr,
                }
                if gan_on:
                    scalars["d_loss"] = d_loss.item()
                for k, v in scalars.items():
                    writer.add_scalar(f"train/{k}", v, step)
            hist.zero_()
        if step % cfg.eval_every == 0:
            run_eval()
            show()
        if step % cfg.save_every == 0:
            save()
    bar.close()
    if history[-1]["step"] != step:  # no evaluation of the last step yet
        run_eval()
    save()
    if writer is not None:
        writer.close()
    return TrainResult(
        out_dir=out, step=step, seconds=elapsed, metrics=history[-1], history=history
    )
