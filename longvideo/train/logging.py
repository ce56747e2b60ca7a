"""Run logging on rank 0: a tqdm bar (loss, tokens/s, MFU), metrics.jsonl, TensorBoard, wandb, loss.png.
Other ranks get a `RunLogger(enabled=False)`, whose methods do nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

METRICS_FILE = "metrics.jsonl"

# dense bf16 peak FLOP/s per device, by a substring of torch.cuda.get_device_name()
GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "GH200": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A6000": 155e12,
    "L4": 121e12,
    "A10": 125e12,
    "4090": 165e12,
    "V100": 125e12,
}


def peak_flops_per_device(configured: float) -> float:
    """The configured peak, else a table lookup for the current GPU; 0 when unknown (no MFU)."""
    if configured > 0:
        return configured
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, value in GPU_PEAK_FLOPS.items():
            if key in name:
                return value
    return 0.0


def mfu(flops_per_token: float, tokens_per_s: float, peak_per_device: float, devices: int) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the peak of all devices."""
    if peak_per_device <= 0 or devices <= 0:
        return float("nan")
    return flops_per_token * tokens_per_s / (peak_per_device * devices)


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(run_dir: str | Path, out: str | Path | None = None) -> Path | None:
    """loss.png from metrics.jsonl (skipped steps leave gaps); None when there is nothing to plot."""
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    if not rows:
        return None
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, nothing to close

    losses = [
        v if math.isfinite(v) else float("nan") for v in (float(r["loss"]) for r in rows)
    ]  # gaps
    fig = Figure(figsize=(6, 3.5), dpi=120)
    ax = fig.subplots()
    ax.plot([r["step"] for r in rows], losses, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (weighted token mean)")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out) if out is not None else Path(run_dir) / "loss.png"
    fig.savefig(out)
    return out


class RunLogger:
    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int = 0,
        progress: bool = True,
        tensorboard: bool = True,
        wandb_mode: str = "disabled",
        wandb_project: str = "longvideo",
        run_name: str = "",
        config: dict | None = None,
    ):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.bar = self.tb = self.wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # drop the records after start_step: a resumed run rewrites the steps it repeats
        rows = [r for r in read_metrics(self.run_dir) if r.get("step", 0) <= start_step]
        (self.run_dir / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
        self.metrics = open(self.run_dir / METRICS_FILE, "a")
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=start_step + 1)
        if wandb_mode != "disabled":
            import wandb  # checked at start-up by the trainer

            self.wandb = wandb.init(
                project=wandb_project,
                name=run_name or None,
                mode=wandb_mode,
                dir=str(self.run_dir),
                config=config,
                resume="allow",
            )

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        # JSON has no NaN/inf: write them as the strings "nan", "inf" so a bad step stays visible
        row = {
            "step": step,
            **{
                k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in metrics.items()
            },
        }
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(f"train/{k}", v, step)
        if self.wandb is not None:
            self.wandb.log(
                {f"train/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))},
                step=step,
            )

    def progress(self, metrics: dict) -> None:
        if self.bar is None:
            return
        post = {"loss": f"{metrics['loss']:.4f}", "tok/s": f"{metrics['tokens_per_s']:.0f}"}
        if math.isfinite(metrics.get("mfu", float("nan"))):
            post["mfu"] = f"{100 * metrics['mfu']:.1f}%"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def write(self, msg: str) -> None:
        """A message that does not break the progress bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self, plot: bool = True) -> Path | None:
        if not self.enabled:
            return None
        for handle in (self.bar, self.tb, self.metrics):
            if handle is not None:
                handle.close()
        if self.wandb is not None:
            self.wandb.finish()
        return plot_losses(self.run_dir) if plot else None
