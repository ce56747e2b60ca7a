"""Training checkpoints (docs/training.md, "Checkpoints"): OUT/checkpoints/step_NNNNNN/ is a project
checkpoint (longvideo.checkpoint's names) plus trainer_state.json, each rank's data position
(loader/), RNG states (rng/) and DeepSpeed's engine files; every rank writes into a `.tmp_`
directory that rank 0 renames into place before it replaces `latest`, so a killed process leaves
the previous checkpoint or the new one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from longvideo.atomic import TMP_PREFIX, fsync_path, fsync_tree, write_text_atomic
from longvideo.checkpoint import CHECKPOINTS, CONFIG_FILE, LATEST, latest_checkpoint
from longvideo.config import save_config

STATE_FILE = "trainer_state.json"


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def _jsonable(x):
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, (np.ndarray, torch.Tensor)):
        return x.tolist()
    raise TypeError(f"cannot store {type(x).__name__} in a checkpoint json")


def write_json(path: Path, obj) -> None:
    """A json file inside a staging directory (the directory itself is renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, default=_jsonable, indent=1))


def clean_stale(run_dir: Path) -> list[Path]:
    """Remove temporary checkpoint directories left by a process killed while writing."""
    ckpts = Path(run_dir) / CHECKPOINTS
    stale = sorted(ckpts.glob(f"{TMP_PREFIX}*")) if ckpts.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return stale


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints (never the one `latest` names)."""
    if keep <= 0:
        return
    ckpts = Path(run_dir) / CHECKPOINTS
    latest = latest_checkpoint(run_dir)
    done = sorted(p for p in ckpts.glob("step_*") if p.is_dir())
    for p in done[:-keep]:
        if latest is None or p.resolve() != latest.resolve():
            shutil.rmtree(p, ignore_errors=True)


def rng_state() -> tuple[dict, dict[str, torch.Tensor]]:
    """Python / NumPy (as json) and torch (as tensors) RNG states: no pickles."""
    py = random.getstate()
    npy = np.random.get_state()
    meta = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npy[0], npy[1].tolist(), int(npy[2]), int(npy[3]), float(npy[4])],
    }
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = s
    return meta, tensors


def set_rng_state(meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    v, state, gauss = meta["python"]
    random.setstate((v, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available():
        cuda = [tensors[k] for k in sorted(tensors) if k.startswith("cuda_")]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)


def save_training_checkpoint(
    *,
    engine,
    cfg,
    run_dir: Path,
    step: int,
    rank: int,
    trainer_state: dict,
    loader_state: dict,
    barrier: Callable[[], None],
    save_weights: Callable[[Path, dict, object, object], None],
    assets: dict[str, Path] | None = None,
    on_staged: Callable[[Path], None] | None = None,
) -> Path:
    """Write OUT/checkpoints/step_N atomically (a collective: every rank calls it). `engine`: a
    longvideo.parallel.Engine; `save_weights(dir, full_state, cfg, module)` writes the weights as
    the model's kind keeps them (longvideo.train.models). `assets` (name -> directory) are copied
    in, e.g. the tokenizer and VQ that chat needs."""
    ckpts = Path(run_dir) / CHECKPOINTS
    name = checkpoint_name(step)
    tmp_name = TMP_PREFIX + name
    tmp = ckpts / tmp_name
    if rank == 0:
        ckpts.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    barrier()
    # engine state: module, ZeRO-partitioned optimizer (each rank writes its own partition)
    engine.save(ckpts, tmp_name)
    weights = engine.full_state(keep=rank == 0) if cfg.train.save_weights else None
    write_json(tmp / "loader" / f"rank_{rank:05d}.json", loader_state)
    meta, tensors = rng_state()
    write_json(tmp / "rng" / f"rank_{rank:05d}.json", meta)
    save_file(tensors, str(tmp / "rng" / f"rank_{rank:05d}.safetensors"))
    if rank == 0:
        if weights is not None:
            save_weights(tmp, weights, cfg, engine.module)
        else:
            save_config(cfg, tmp / CONFIG_FILE)
        write_json(tmp / STATE_FILE, trainer_state)
        for asset, src in (assets or {}).items():
            shutil.copytree(src, tmp / asset)
    if on_staged is not None:
        on_staged(tmp)
    barrier()  # every rank's files are on disk before the directory becomes visible
    final = ckpts / name
    if rank == 0:
        fsync_tree(tmp)
        old = None
        if final.exists():  # the same step written again: move the old copy aside, drop it after
            old = ckpts / f"{TMP_PREFIX}old_{name}"
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_path(ckpts)
        write_text_atomic(ckpts / LATEST, name)  # last: the pointer only ever names complete dirs
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_training_checkpoint(*, engine, ckpt: Path, rank: int) -> dict:
    """Restore the engine (weights, optimizer) and this rank's RNG; return the saved states."""
    state = json.loads((ckpt / STATE_FILE).read_text())
    loader_file = ckpt / "loader" / f"rank_{rank:05d}.json"
    if not loader_file.is_file():
        raise FileNotFoundError(
            f"{ckpt} holds no data state for rank {rank}: it was written by a run with "
            f"world size {state.get('world_size')}; resume with the same world size"
        )
    engine.load(ckpt.parent, ckpt.name)
    set_rng_state(
        json.loads((ckpt / "rng" / f"rank_{rank:05d}.json").read_text()),
        load_file(str(ckpt / "rng" / f"rank_{rank:05d}.safetensors")),
    )
    state["loader"] = json.loads(loader_file.read_text())
    return state
