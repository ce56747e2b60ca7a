"""The shipped accelerate configs (configs/accelerate/): `accelerate launch` starts the trainer with
each one that can run on a CPU, two processes; the GPU ones are loaded by accelerate's own config
reader (they need GPUs or two machines). docs/training.md, "Launchers"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs" / "accelerate"

# config -> the options added to run it on this machine's CPU with two processes
ON_CPU = {
    "cpu-2proc.yaml": [],  # as shipped
    "deepspeed-zero3.yaml": ["--num_processes", "2"],  # ships 8: its DeepSpeed JSON is what runs
}
# config -> why it only parses here
GPU_ONLY = {
    "gpu-8.yaml": "8 GPUs of one node (gpu_ids: all, NCCL)",
    "gpu-2nodes.yaml": "two machines of 8 GPUs",
}
TINY = [
    "train.steps=2",
    "train.progress=false",
    "train.tensorboard=false",
    "train.plot=false",
    "model.n_layers=1",
    "data.seq_len=128",
    "parallel.sp=2",  # one ring over both processes: the trainer refuses another world size
]


def test_every_shipped_config_is_run_or_parsed():
    assert {p.name for p in CONFIGS.glob("*.yaml")} == set(ON_CPU) | set(GPU_ONLY)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(ON_CPU))
def test_accelerate_launch_trains_on_two_cpu_processes(name, tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    # `accelerate launch`, run by this interpreter
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch"]
    cmd += ["--config_file", CONFIGS / name]
    cmd += [*ON_CPU[name], "-m", "longvideo", "train", "--config", "tiny", *TINY]
    done = subprocess.run(
        [str(c) for c in cmd + [f"train.out_dir={run}"]],
        cwd=REPO,  # the DeepSpeed config's path in deepspeed-zero3.yaml is the repository's
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "completed at step 2" in done.stdout
    ckpt = run / "checkpoints" / "step_000002"
    ranks = sorted(p.name for p in ckpt.glob("zero_pp_rank_*_model_states.pt"))
    assert ranks == [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)], ranks
    saved = yaml.safe_load((run / "config.yaml").read_text())
    if name == "deepspeed-zero3.yaml":  # the plugin's JSON reached the trainer
        shipped = yaml.safe_load((CONFIGS / name).read_text())
        json_file = shipped["deepspeed_config"]["deepspeed_config_file"]
        assert saved["train"]["deepspeed_config"] == json_file
        assert (REPO / json_file).is_file()


@pytest.mark.parametrize("name", sorted(GPU_ONLY))
def test_the_gpu_configs_load_in_accelerate(name):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    raw = yaml.safe_load((CONFIGS / name).read_text())
    cfg = load_config_from_file(str(CONFIGS / name))  # unknown keys or values raise
    assert cfg.distributed_type == DistributedType.MULTI_GPU
    assert cfg.num_processes == raw["num_processes"] and cfg.num_machines == raw["num_machines"]
    assert cfg.num_processes % cfg.num_machines == 0 and cfg.num_processes // cfg.num_machines == 8
    if cfg.num_machines > 1:
        assert cfg.main_process_ip and cfg.main_process_port and cfg.machine_rank == 0
