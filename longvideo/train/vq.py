"""Training the tokenizer (docs/vq.md, "Training"): reconstruction (L1 + L2) + quantizer loss (+ an
optional patch GAN). `out_dir` receives the tokenizer (`load_vq` reads it), `train_state.pt` (what
resuming needs), `metrics.jsonl`, `samples/` and `tb/`. VQTrainer runs it in named steps from a
VQConfig and frozen VQTrainSettings; `train_vq` builds the settings from keywords.
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
    """({psnr, usage, perplexity, codes_used}, reconstructions shaped like `batch`) of held-out
    uint8 frames (N, H, W, 3) (2d) or clips (C, L, H, W, 3) (causal3d)."""
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


@dataclass(frozen=True)
class VQTrainSettings:
    """How `longvideo train-vq` runs, beside the VQConfig (the CLI builds it from its flags)."""

    out_dir: str | Path
    """Where the tokenizer, train_state.pt, metrics.jsonl, samples/ and tb/ go."""
    steps: int | None = None
    """Overrides the config's steps (None: the config's)."""
    time_budget_s: float | None = None
    """Also stop after this much training time (the learning-rate decay follows whichever of
    steps and time ends first)."""
    resume: bool = True
    """Continue the run in out_dir when it holds one."""
    device: str | None = None
    """cpu, cuda, cuda:1 ... (None: cuda when available)."""
    progress: bool = True
    """Show progress bars."""
    tensorboard: bool = True
    """Write TensorBoard logs to out_dir/tb."""


def vq_config_of(cfg) -> VQConfig:
    """cfg itself, or a root Config's `vq`; TypeError for anything else."""
    if isinstance(cfg, VQConfig):
        return cfg
    if not isinstance(getattr(cfg, "vq", None), VQConfig):
        raise TypeError(f"expected a VQConfig or a root Config, got {type(cfg).__name__}")
    return cfg.vq


class VQTrainer:
    """The tokenizer's training in named steps: `__init__` builds the model, the discriminator,
    their optimizers and the sampler's generator; `resume` loads out_dir's train_state.pt;
    `load_data` reads the frames and the held-out set; `evaluate` scores the held-out set (logged,
    drawn, kept in the history); `step` is one optimizer step; `save` writes the tokenizer and
    the state; `run` does them all in the order that makes a run and its resumption the same."""

    def __init__(self, cfg: VQConfig, settings: VQTrainSettings):
        if settings.steps is not None:
            cfg = dataclasses.replace(cfg, steps=settings.steps)
        self.cfg, self.settings = cfg, settings
        self.out = Path(settings.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = torch.device(
            settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        torch.manual_seed(cfg.seed)
        self.vq = VQModel(cfg).to(self.device)
        self.disc = (
            PatchDiscriminator(cfg.disc_channels).to(self.device) if cfg.disc_weight > 0 else None
        )
        self.opt = torch.optim.AdamW(
            self.vq.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay
        )
        self.disc_opt = (
            torch.optim.AdamW(self.disc.parameters(), lr=cfg.lr, betas=(0.5, 0.9), weight_decay=0.0)
            if self.disc is not None
            else None
        )
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.steps_done, self.elapsed, self.history = 0, 0.0, []
        self.writer = None
        self.code_counts = torch.zeros(cfg.codebook_size, dtype=torch.long)

    @property
    def state_path(self) -> Path:
        return self.out / STATE_FILE

    def resume(self) -> bool:
        """Load out_dir's train_state.pt when resuming and there is one; whether it did."""
        if not (self.settings.resume and self.state_path.is_file()):
            return False
        _check_resume(self.cfg, self.out)
        state = torch.load(self.state_path, map_location="cpu", weights_only=True)
        self.vq.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        if self.disc is not None and "disc" in state:
            self.disc.load_state_dict(state["disc"])
            self.disc_opt.load_state_dict(state["disc_optimizer"])
        self.gen.set_state(state["sampler"])
        self.steps_done, self.elapsed = int(state["step"]), float(state["seconds"])
        self.history = json.loads(state["history"])
        return True

    def load_data(self, source: Source | FrameSource) -> None:
        """The frames to train on and the held-out set."""
        cfg = self.cfg
        self.src = build_frame_source(source, cfg, progress=self.settings.progress)
        self.batches = _Batches(self.src, cfg, self.gen)
        self.eval_set = self.batches.eval_set()
        # codes the held-out set holds: 8 frames of 256 codes can use at most a quarter of 8192
        groups = self.eval_set.shape[0] * (
            cfg.num_groups(self.eval_set.shape[1]) if cfg.mode == "causal3d" else 1
        )
        self.held_codes = groups * cfg.codes_per_frame

    def open_writer(self) -> None:
        if self.settings.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.out / "tb"))

    def evaluate(self) -> dict:
        """Score the held-out set: append to the history and metrics.jsonl, warn when the run
        looks broken, draw samples/step_N.png and log to TensorBoard."""
        from PIL import Image

        cfg, step = self.cfg, self.steps_done
        metrics, recon = evaluate(self.vq, self.eval_set)
        png = self.out / "samples" / f"step_{step:07d}.png"
        metrics = {"step": step, "seconds": round(self.elapsed, 2), **metrics}
        self.history.append(metrics)
        # guard rails: compare with the untrained model (history[0]) and say what to try
        metrics["warnings"] = health_warnings(
            self.history,
            train_videos=len(self.src.train),
            lr=cfg.lr,
            max_usage=self.held_codes / cfg.codebook_size,
        )
        for w in metrics["warnings"]:
            log.warning("train-vq: %s (%s)", w, png)
        with open(self.out / METRICS_FILE, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        first = self.history[0]
        grid = labelled_grid(
            self.eval_set,
            recon,
            step=step,
            psnr=metrics["psnr"],
            usage=metrics["usage"],
            psnr_untrained=first["psnr"] if step > first["step"] else None,
            warnings=metrics["warnings"],
        )
        png.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(grid.numpy()).save(png)
        if self.writer is not None:
            for k in ("psnr", "usage", "perplexity"):
                self.writer.add_scalar(f"eval/{k}", metrics[k], step)
            self.writer.add_image(
                "eval/originals_over_reconstructions", grid.permute(2, 0, 1), step
            )
            self.writer.flush()
        return metrics

    def save(self) -> None:
        """The tokenizer (load_vq reads it) and train_state.pt (what resuming needs)."""
        self.vq.save(self.out)
        state = {
            "model": self.vq.state_dict(),
            "optimizer": self.opt.state_dict(),
            "sampler": self.gen.get_state(),
            "step": self.steps_done,
            "seconds": self.elapsed,
            "history": json.dumps(self.history),
        }
        if self.disc is not None:
            state["disc"] = self.disc.state_dict()
            state["disc_optimizer"] = self.disc_opt.state_dict()
        with atomic_open(self.state_path, "wb") as f:  # fsynced and renamed: never a partial state
            torch.save(state, f)

    def stopped(self) -> bool:
        budget = self.settings.time_budget_s
        return self.steps_done >= self.cfg.steps or (budget is not None and self.elapsed >= budget)

    def step(self) -> dict | None:
        """One optimizer step (and the discriminator's); its scalars on log steps, else None."""
        cfg, budget = self.cfg, self.settings.time_budget_s
        t0 = time.perf_counter()
        frames = self.batches.next()
        x = frames_to_input(frames, self.device, as_clip=cfg.mode != "2d")  # (B, 3, L, H, W)
        progress = max(self.steps_done / cfg.steps, self.elapsed / budget if budget else 0.0)
        lr = lr_at(cfg, self.steps_done, progress)
        for g in self.opt.param_groups:
            g["lr"] = lr

        recon, codes, aux = self.vq(x)
        err = recon - x
        rec_loss = cfg.l1_weight * err.abs().mean() + cfg.l2_weight * err.pow(2).mean()
        loss = rec_loss + aux
        gan_on = self.disc is not None and self.steps_done >= cfg.disc_start
        if gan_on:
            fake = recon.transpose(1, 2).flatten(0, 1)  # frames (B T, 3, H, W)
            g_loss = -self.disc(fake).mean()
            last_weight = self.vq.decoder.layers[-1].conv.weight
            weight = adaptive_weight(rec_loss, g_loss, last_weight)
            loss = loss + cfg.disc_weight * weight * g_loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.vq.parameters(), cfg.grad_clip)
        self.opt.step()
        if gan_on:
            real = x.transpose(1, 2).flatten(0, 1)
            d_loss = hinge_d_loss(self.disc(real), self.disc(fake.detach()))
            self.disc_opt.zero_grad(set_to_none=True)
            d_loss.backward()
            self.disc_opt.step()

        self.steps_done += 1
        self.elapsed += time.perf_counter() - t0
        self.code_counts += torch.bincount(codes.flatten().cpu(), minlength=cfg.codebook_size)
        if not (self.steps_done % cfg.log_every == 0 or self.steps_done == cfg.steps):
            return None
        scalars = {
            "loss": loss.item(),
            "rec_loss": rec_loss.item(),
            "quant_loss": float(aux),
            "psnr": 10 * math.log10(4.0 / max(err.detach().pow(2).mean().item(), 1e-10)),
            "usage": (self.code_counts > 0).float().mean().item(),
            "lr": lr,
        }
        if gan_on:
            scalars["d_loss"] = d_loss.item()
        self.code_counts.zero_()
        return scalars

    def log(self, scalars: dict) -> None:
        if self.writer is not None:
            for k, v in scalars.items():
                self.writer.add_scalar(f"train/{k}", v, self.steps_done)

    def run(self, source: Source | FrameSource) -> TrainResult:
        """Train (or resume) until the steps or the time budget run out."""
        from tqdm import tqdm

        cfg, budget = self.cfg, self.settings.time_budget_s
        self.resume()
        self.load_data(source)
        self.open_writer()
        if self.steps_done == 0 and not self.history:
            self.evaluate()  # the untrained baseline
        desc = "train-vq" + (f" (stops after {budget:g} s)" if budget else "")
        bar = tqdm(
            total=cfg.steps,
            initial=self.steps_done,
            unit="step",
            desc=desc,
            disable=not self.settings.progress,
        )
        postfix = _Postfix(bar, self.history)
        postfix.show()
        self.vq.train()
        while not self.stopped():
            scalars = self.step()
            bar.update(1)
            if scalars is not None:
                postfix.show(
                    loss=f"{scalars['loss']:.4f}",
                    batch_psnr=f"{scalars['psnr']:.1f}",
                    usage=f"{scalars['usage']:.2f}",
                )
                self.log(scalars)
            if self.steps_done % cfg.eval_every == 0:
                self.evaluate()
                postfix.show()
            if self.steps_done % cfg.save_every == 0:
                self.save()
        bar.close()
        if self.history[-1]["step"] != self.steps_done:  # no evaluation of the last step yet
            self.evaluate()
        self.save()
        if self.writer is not None:
            self.writer.close()
        return TrainResult(
            out_dir=self.out,
            step=self.steps_done,
            seconds=self.elapsed,
            metrics=self.history[-1],
            history=self.history,
        )


class _Postfix:
    """The progress bar's postfix: the last step's figures, the held-out PSNR of the last
    evaluation (from step 0 on) and its first warning."""

    def __init__(self, bar, history: list[dict]):
        self.bar, self.history, self.items = bar, history, {}

    def show(self, **figures) -> None:
        last = self.history[-1]
        self.items.update(figures, heldout=f"{last['psnr']:.1f}dB")
        self.items.pop("warn", None)
        if last.get("warnings"):
            self.items["warn"] = short_warning(last["warnings"])
        self.bar.set_postfix(self.items, refresh=True)


def train_vq(cfg, source: Source | FrameSource, out_dir, /, **options) -> TrainResult:
    """Train a tokenizer from scratch, or resume the run in `out_dir` (docs/vq.md, "Training").

    cfg: a VQConfig or a root Config (its `vq`). source: what `--data` takes, uint8 videos
    (T, H, W, 3) (one or a list), or a FrameSource. out_dir: the output directory, or a
    VQTrainSettings. options: VQTrainSettings fields (steps, time_budget_s, resume, device,
    progress, tensorboard), replacing those of the settings."""
    cfg = vq_config_of(cfg)
    if isinstance(out_dir, VQTrainSettings):
        settings = dataclasses.replace(out_dir, **options)
    else:
        settings = VQTrainSettings(out_dir=out_dir, **options)
    return VQTrainer(cfg, settings).run(source)
