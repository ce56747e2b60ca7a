"""longvideo as an installed package: a wheel, installed into a fresh environment outside the checkout,
finds its configs, its kernels (as `longvideo.kernels`, never the top-level name `kernels`) and
runs `longvideo train --config tiny`."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _run(cmd, **kw):
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert res.returncode == 0, f"{cmd} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # no build isolation: setuptools comes from this environment, nothing is downloaded
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            out,
            REPO,
        ]
    )
    (whl,) = out.glob("longvideo-*.whl")
    return whl


def test_wheel_holds_the_package_its_kernels_and_configs(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"longvideo"}, tops  # no top-level `kernels` or `configs` to clash with others
    for must in (
        "longvideo/kernels/flash_attn.py",
        "longvideo/kernels/attention_math.py",
        "longvideo/configs/tiny.yaml",
        "longvideo/configs/stages/tiny-1k.yaml",
        "longvideo/configs/vq/tiny.yaml",
        "longvideo/configs/deepspeed/zero3.json",
        "longvideo/configs/accelerate/cpu-2proc.yaml",
    ):
        assert must in names, must
    on_disk = {
        p.relative_to(REPO / "configs").as_posix()
        for p in (REPO / "configs").rglob("*")
        if p.suffix in (".yaml", ".json")
    }
    assert {
        n[len("longvideo/configs/") :] for n in names if n.startswith("longvideo/configs/")
    } >= on_disk


def test_installed_wheel_runs_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])
    py = venv / "bin" / "python"
    _run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel])
    # the new environment sees this one's dependencies (torch, deepspeed, ...) after its own packages;
    # a plain path entry, so this environment's editable-install hook does not come along
    child_site = _run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    ).stdout.strip()
    Path(child_site, "parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    probe = (
        "import importlib.util, longvideo, longvideo.kernels, longvideo.configtools as c; "
        "print(longvideo.__file__); print(longvideo.kernels.__file__); print(c.CONFIG_DIR); "
        "print(getattr(importlib.util.find_spec('kernels'), 'origin', None))"
    )
    lines = _run([py, "-c", probe], cwd=work, env=env).stdout.split()
    site = str(venv)
    assert all(x.startswith(site) for x in lines[:3]), lines  # the wheel's copy, not the checkout's
    # we install no top-level `kernels` (Hugging Face's, which transformers >= 5.25 needs, may be there)
    assert lines[3] == "None" or not lines[3].startswith(site), lines
    run = work / "run"
    res = _run(
        [
            venv / "bin" / "longvideo",
            "train",
            "--config",
            "tiny",
            "train.steps=2",
            "train.progress=false",
            "train.tensorboard=false",
            "train.plot=false",
            "model.n_layers=1",
            "data.seq_len=128",
            f"train.out_dir={run}",
        ],
        cwd=work,
        env=env,
        timeout=600,
    )
    assert (run / "checkpoints" / "latest").is_file(), res.stdout
