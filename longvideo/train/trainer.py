"""The trainer: dp x sp mesh, ring attention, DeepSpeed ZeRO, exact loss normalisation, checkpoints,
built and run in the order docs/training.md ("What one run does, in order") gives. A NaN/inf loss,
seen by every rank through the all-reduced loss, or a NaN/inf global gradient norm skips the step
on all of them, and max_bad_steps in a row stop the run.
"""

from __future__ import annotations

import contextlib
import math
import resource
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from longvideo.checkpoint import latest_checkpoint
from longvideo.config import Config, save_config
from longvideo.configtools import ConfigError, to_dict
from longvideo.data.loader import TokenLoader
from longvideo.distributed import init_distributed
from longvideo.model import token_weights
from longvideo.parallel import Mesh, build_deepspeed_config, parallelize, shard_batch
from longvideo.parallel.loss import loss_scale
from longvideo.tokenizer import TextTokenizer
from longvideo.train import run_state as ckpt_io
from longvideo.train.logging import RunLogger, mfu, peak_flops_per_device
from longvideo.train.models import model_kind
from longvideo.train.schedule import WarmupCosine
from longvideo.train.synthetic_tokens import SyntheticTokens

BATCH_KEYS = ("input_ids", "targets", "loss_weights", "positions", "segment_ids")


class TrainingError(RuntimeError):
    """The run cannot continue (the message says why)."""


class LossDiverged(TrainingError):
    """max_bad_steps NaN/inf losses or gradient norms in a row; the last good checkpoint is kept."""


@dataclass
class TrainResult:
    status: str
    """completed | interrupted (SIGTERM/SIGINT: a checkpoint was written)."""
    step: int
    """The optimizer step reached."""
    losses: list[float] = field(default_factory=list)
    """The global loss of each step run by this call (NaN for skipped steps)."""
    run_dir: Path | None = None
    checkpoint: Path | None = None
    """The newest checkpoint written."""


class SkippableAdamW(torch.optim.AdamW):
    """AdamW whose update (of every partition ZeRO calls `step()` on) is suppressed while `skip` is
    set (a non-finite loss), or when `grad_norm()` (the global gradient norm DeepSpeed computed
    for this step, the same on every rank) is not finite: DeepSpeed's own overflow check depends
    on its version, precision and ZeRO stage."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = False
        self.grad_norm: Callable[[], float | None] = lambda: None

    def step(self, closure=None):
        if self.skip or not finite_or_unknown(self.grad_norm()):
            return None
        return super().step(closure)


def finite_or_unknown(x: float | None) -> bool:
    return x is None or math.isfinite(x)


class Trainer:
    """One training run. `train()` below is the usual entry; tests drive the pieces directly:

    t = Trainer(cfg)
    stats = t.forward_backward(t.next_micro_batches())   # gradients reduced, not applied
    metrics = t.optimizer_step(stats)                    # update (or skip), schedule
    """

    def __init__(
        self,
        cfg: Config,
        *,
        resume: bool = False,
        init_from: str | None = None,
        batches: Iterable[dict] | None = None,
        callbacks: Iterable[Callable] = (),
    ):
        self.cfg = cfg
        tc = cfg.train
        self.callbacks = list(callbacks)
        self.run_dir = Path(tc.out_dir)
        init_distributed(cfg.parallel.timeout_s)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = Mesh.from_config(cfg.parallel)  # dp * sp != world raises here, before any work
        self.bf16 = tc.precision == "bf16" or (tc.precision == "auto" and torch.cuda.is_available())
        ds_config = build_deepspeed_config(tc, world_size=self.world, bf16=self.bf16)
        self.zero_stage = ds_config["zero_optimization"]["stage"]
        self.kind = model_kind(cfg)
        self._check_run_dir(resume)
        self.resume_from = latest_checkpoint(self.run_dir) if resume else None
        if tc.wandb != "disabled":
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "train.wandb",
                    f"'{tc.wandb}' needs the wandb package (pip install 'longvideo[wandb]')",
                ) from None
        # copied into the run and every checkpoint (chat reads them there)
        self.assets = {
            name: src for name, src in (("tokenizer", tc.tokenizer_dir), ("vq", tc.vq_dir)) if src
        }
        for name, src in self.assets.items():
            if not Path(src).is_dir():
                raise ConfigError(f"train.{name}_dir", f"not a directory: {src}")

        # the data source is checked (shards found, tokenizer readable) before the model is built
        self.loader = batches if batches is not None else self._make_loader()

        torch.manual_seed(tc.seed)  # identical initial weights on every rank
        init_from = init_from if init_from is not None else (tc.init_from or None)
        model = self.kind.build(
            cfg, init_from=init_from, fresh=self.resume_from is None, log=self._say
        )
        # what checkpoints carry (a transformers directory's architecture in the project's terms)
        self.cfg = cfg = self.kind.checkpoint_config(cfg)
        self.optimizer = SkippableAdamW(
            self._param_groups(model),
            lr=tc.lr,
            betas=(tc.adam_beta1, tc.adam_beta2),
            eps=tc.adam_eps,
            weight_decay=tc.weight_decay,
        )
        self.engine = parallelize(
            model, self.mesh, cfg, optimizer=self.optimizer, ds_config=ds_config
        )
        self.optimizer.grad_norm = self.engine.step_grad_norm
        self.model = self.engine.module
        self.device = self.engine.device
        self.schedule = WarmupCosine(
            self.optimizer,
            lr=tc.lr,
            warmup_steps=tc.warmup_steps,
            total_steps=tc.steps,
            min_lr_ratio=tc.min_lr_ratio,
        )
        self._batches = None
        self.step = 0
        self.tokens_seen = 0
        self.bad_in_a_row = 0
        self.last_saved: int | None = None
        self.last_checkpoint: Path | None = None
        self.stop_requested = False
        self.seq_len = cfg.data.seq_len
        self.peak_flops = peak_flops_per_device(tc.peak_flops)
        self.flops_per_token = cfg.model.flops_per_token(self.seq_len)
        if self.resume_from is not None:
            self._resume(self.resume_from)

    def _check_run_dir(self, resume: bool) -> None:
        if self.rank == 0:
            stale = ckpt_io.clean_stale(self.run_dir)
            if stale:
                print(
                    f"removed {len(stale)} incomplete checkpoint(s) left by an interrupted write: "
                    f"{', '.join(p.name for p in stale)}",
                    flush=True,
                )
        if not resume and latest_checkpoint(self.run_dir) is not None:
            raise ConfigError(
                "train.out_dir",
                f"{self.run_dir} already holds checkpoints; pass --resume "
                f"to continue that run, or choose another out_dir",
            )

    def _say(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    @staticmethod
    def _param_groups(model) -> list[dict]:
        decay, no_decay = [], []
        for _, p in model.named_parameters():
            (decay if p.dim() >= 2 else no_decay).append(p)  # norm gains are not decayed
        return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]

    def _make_loader(self):
        cfg, tc = self.cfg, self.cfg.train
        if tc.data_source == "shards" and not cfg.data.train_shards:
            raise ConfigError(
                "data.train_shards", "train.data_source is 'shards' but no shards are set"
            )
        if tc.data_source == "shards" or (tc.data_source == "auto" and cfg.data.train_shards):
            if not tc.tokenizer_dir:
                raise ConfigError(
                    "train.tokenizer_dir", "data.train_shards needs the text tokenizer directory"
                )
            tok = TextTokenizer.from_dir(tc.tokenizer_dir)
            # every rank draws a batch each micro step: one whose shard fails makes them all fail at once
            return TokenLoader(
                cfg.data.train_shards,
                tok,
                cfg.model.vocab,
                cfg.data,
                batch_size=tc.micro_batch_size,
                dp_rank=self.mesh.dp_rank,
                dp_size=self.mesh.dp,
                group=self.mesh.world_group if self.mesh.distributed else None,
            )
        vocab = tc.synthetic_vocab or cfg.model.text_vocab_size
        return SyntheticTokens(
            seq_len=cfg.data.seq_len,
            batch_size=tc.micro_batch_size,
            vocab=vocab,
            seed=tc.seed,
            dp_rank=self.mesh.dp_rank,
            dp_size=self.mesh.dp,
        )

    def _emit(self, event: str, **info) -> None:
        for cb in self.callbacks:
            cb(event, self, **info)

    def shard(self, batch: dict) -> dict:
        """This rank's part of a (B, S) batch: the zigzag shard of its sp group, on the device."""
        local = shard_batch({k: batch[k] for k in BATCH_KEYS}, self.mesh.sp_group)
        return {k: v.to(self.device, non_blocking=True) for k, v in local.items()}

    def next_micro_batches(self) -> list[dict]:
        """grad_accum batches of this dp rank, sharded for this sp rank."""
        if self._batches is None:
            self._batches = iter(self.loader)
        return [self.shard(next(self._batches)) for _ in range(self.cfg.train.grad_accum)]

    def forward_backward(self, micro_batches: list[dict]) -> dict:
        """Forward and backward of one step's micro-batches (this rank's shards). Afterwards the
        reduced gradients are in the engine (deepspeed.utils.safe_get_full_grad reads them) and
        `optimizer_step` applies them."""
        if len(micro_batches) != self.cfg.train.grad_accum:
            raise ValueError(
                f"expected {self.cfg.train.grad_accum} micro-batches, got {len(micro_batches)}"
            )
        local_weight = sum(
            token_weights(mb["targets"], mb["loss_weights"]).sum() for mb in micro_batches
        )
        # the whole step's weight total, known before the first backward (all micro-batches count);
        # DeepSpeed averages gradients over all dp x sp ranks ("mean")
        scale, total_weight = loss_scale(local_weight, self.mesh, grad_reduction="mean")
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, mb in enumerate(micro_batches):
            part = self.engine(
                mb["input_ids"],
                mb["positions"],
                mb["segment_ids"],
                targets=mb["targets"],
                loss_weights=mb["loss_weights"],
            )
            self.engine.backward(part * scale)
            loss_sum += part.detach().double()
            if i < len(micro_batches) - 1:
                self.engine.step()  # not a boundary: DeepSpeed only accumulates
        return {"loss_sum": loss_sum, "total_weight": total_weight}

    def optimizer_step(self, stats: dict) -> dict:
        """Apply the step (or skip it on a NaN/inf loss or gradient norm: every rank sees the same
        all-reduced values), advance the schedule; return metrics."""
        # one all-reduce: the loss (every rank then makes the same skip decision) and a stop request
        summed = torch.stack(
            [
                stats["loss_sum"],
                torch.tensor(float(self.stop_requested), dtype=torch.float64, device=self.device),
            ]
        )
        dist.all_reduce(summed)
        total = stats["total_weight"]
        loss = float(summed[0]) / total if total > 0 else float("nan")
        stop = bool(summed[1] > 0)
        ok = math.isfinite(loss)
        self.optimizer.skip = not ok
        try:
            self.engine.step()
        finally:
            self.optimizer.skip = False
        norm_ok = finite_or_unknown(self.engine.step_grad_norm())
        applied = ok and norm_ok and self.engine.was_step_applied()
        lr = self.schedule.current()
        grad_norm = self.engine.grad_norm()
        self.schedule.step()
        self.step += 1
        self.bad_in_a_row = 0 if applied else self.bad_in_a_row + 1
        tokens = (
            self.cfg.train.micro_batch_size
            * self.cfg.train.grad_accum
            * self.mesh.dp
            * self.seq_len
        )
        self.tokens_seen += tokens
        return {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "skipped": not applied,
            "tokens": tokens,
            "stop": stop,
        }

    def train_step(self) -> dict:
        t0 = time.perf_counter()
        stats = self.forward_backward(self.next_micro_batches())
        metrics = self.optimizer_step(stats)
        dt = time.perf_counter() - t0
        tokens_per_s = metrics["tokens"] / dt
        return {
            **metrics,
            "step_time": dt,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu(self.flops_per_token, tokens_per_s, self.peak_flops, self.world),
            "peak_mem_gb": peak_memory_gb(self.device),
        }

    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "bad_in_a_row": self.bad_in_a_row,
            "schedule": self.schedule.state_dict(),
            "world_size": self.world,
            "dp": self.mesh.dp,
            "sp": self.mesh.sp,
            "zero_stage": self.zero_stage,
            "time": time.time(),
        }

    def save(self) -> Path:
        """A complete checkpoint of the current step (collective)."""
        loader_state = self.loader.state_dict() if hasattr(self.loader, "state_dict") else {}
        path = ckpt_io.save_training_checkpoint(
            engine=self.engine,
            cfg=self.cfg,
            run_dir=self.run_dir,
            step=self.step,
            rank=self.rank,
            trainer_state=self.trainer_state(),
            loader_state=loader_state,
            barrier=dist.barrier,
            assets=self.assets,
            save_weights=self.kind.save,
            on_staged=lambda p: self._emit("checkpoint_staged", path=p),
        )
        if self.rank == 0:
            ckpt_io.prune_checkpoints(self.run_dir, self.cfg.train.keep_checkpoints)
        self.last_saved, self.last_checkpoint = self.step, path
        self._emit("checkpoint_saved", path=path)
        return path

    def _resume(self, ckpt: Path) -> None:
        state = ckpt_io.load_training_checkpoint(engine=self.engine, ckpt=ckpt, rank=self.rank)
        shape = (state["world_size"], state["dp"], state["sp"])
        if shape != (self.world, self.mesh.dp, self.mesh.sp):
            raise ConfigError(
                "parallel",
                f"{ckpt} was written with world {shape[0]} (dp {shape[1]} x sp "
                f"{shape[2]}); an exact resume needs the same, this run has "
                f"world {self.world} (dp {self.mesh.dp} x sp {self.mesh.sp})",
            )
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.bad_in_a_row = int(state["bad_in_a_row"])
        self.schedule.load_state_dict(state["schedule"])
        if state["loader"] and hasattr(self.loader, "load_state_dict"):
            self.loader.load_state_dict(state["loader"])
        self.last_saved, self.last_checkpoint = self.step, ckpt
        self._say(f"resumed from {ckpt} at step {self.step}")

    @contextlib.contextmanager
    def _graceful_signals(self):
        """SIGTERM / first SIGINT: finish the step, write a checkpoint, exit. A second SIGINT aborts."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum, frame):
            if self.stop_requested and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.stop_requested = True

        old = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def run(self) -> TrainResult:
        tc = self.cfg.train
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.cfg, self.run_dir / "config.yaml")
            for name, src in self.assets.items():
                if not (self.run_dir / name).exists():
                    shutil.copytree(src, self.run_dir / name)
        log = RunLogger(
            self.run_dir,
            enabled=self.rank == 0,
            total_steps=tc.steps,
            start_step=self.step,
            progress=tc.progress,
            tensorboard=tc.tensorboard,
            wandb_mode=tc.wandb,
            wandb_project=tc.wandb_project,
            run_name=self.cfg.name,
            config=to_dict(self.cfg) if tc.wandb != "disabled" else None,
        )
        result = TrainResult(status="completed", step=self.step, run_dir=self.run_dir)
        try:
            with self._graceful_signals():
                while self.step < tc.steps:
                    m = self.train_step()
                    result.losses.append(m["loss"])
                    if self.step % tc.log_every == 0 or m["skipped"]:
                        log.log(self.step, {k: v for k, v in m.items() if k not in ("stop",)})
                    log.progress(m)
                    self._emit("step_end", step=self.step, metrics=m)
                    if m["skipped"]:
                        log.write(
                            f"warning: step {self.step}: loss {m['loss']}, gradient norm "
                            f"{m['grad_norm']}; update skipped ({self.bad_in_a_row} in a row, "
                            f"the run stops at {tc.max_bad_steps})"
                        )
                        if self.bad_in_a_row >= tc.max_bad_steps:
                            kept = (
                                self.last_checkpoint.name
                                if self.last_checkpoint
                                else "none written"
                            )
                            raise LossDiverged(
                                f"{self.bad_in_a_row} non-finite losses or gradient norms in "
                                f"a row (step "
                                f"{self.step}); stopping. Last good checkpoint: {kept}"
                            )
                    if m["stop"]:
                        result.status = "interrupted"
                        log.write(f"stop requested: writing a checkpoint at step {self.step}")
                        break
                    # no periodic checkpoint inside a streak of bad steps: the last one stays the good one
                    if (
                        tc.checkpoint_every
                        and self.step % tc.checkpoint_every == 0
                        and self.bad_in_a_row == 0
                    ):
                        self.save()
                if self.last_saved != self.step:
                    self.save()
        finally:
            log.close(plot=tc.plot)
        result.step, result.checkpoint = self.step, self.last_checkpoint
        return result


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def train(
    cfg: Config,
    *,
    resume: bool = False,
    init_from: str | None = None,
    batches: Iterable[dict] | None = None,
    callbacks: Iterable[Callable] = (),
) -> TrainResult:
    """Train `cfg` in this process as one rank of the launcher's world (or a world of one).

    resume: continue from OUT/checkpoints/latest when there is one (same world shape). init_from: the
    model weights of a checkpoint or run dir. batches: (B, S) batch dicts instead of the configured
    data. callbacks: `cb(event, trainer, **info)` on step_end(step, metrics), checkpoint_staged(path)
    and checkpoint_saved(path)."""
    return Trainer(
        cfg, resume=resume, init_from=init_from, batches=batches, callbacks=callbacks
    ).run()
