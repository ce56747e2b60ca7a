"""longvideo as an installed package: a wheel, installed with --no-deps into a fresh environment
over this one (built from the lock), outside the checkout, imports every module, finds its configs,
its kernels (as `longvideo.kernels`, never the top-level name `kernels`) and runs `longvideo train
--config tiny`; its metadata carries ranges, the license and the version; and `pip install .` into
an environment that holds another supported torch keeps that torch."""

from __future__ import annotations

import email
import json
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import longvideo

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


def _layered_venv(venv: Path) -> Path:
    """A fresh environment that sees this one's packages after its own; its python. A plain path
    entry, so this environment's editable install of the checkout does not come along."""
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    py = venv / "bin" / "python"
    child_site = _run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    ).stdout.strip()
    Path(child_site, "parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py


def _pip(py: Path) -> list:
    """This environment's pip, run in the environment of `py` (which has none of its own)."""
    return [sys.executable, "-m", "pip", "--python", py]


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[Path, Path]:
    """(venv, a working directory outside the checkout): the wheel installed with --no-deps into
    an environment over this one, whose dependencies come from the lock (`make install`)."""
    root = tmp_path_factory.mktemp("installed")
    py = _layered_venv(root / "venv")
    _run([*_pip(py), "install", "-q", "--no-deps", "--no-index", wheel])
    (root / "elsewhere").mkdir()
    return root / "venv", root / "elsewhere"


def test_wheel_metadata(wheel):
    """Ranges, not pins, for torch; the SPDX license and its file; one version everywhere."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(z.read(name))
        assert f"longvideo-{longvideo.__version__}.dist-info/licenses/LICENSE" in z.namelist()
        assert "longvideo/py.typed" in z.namelist()
    assert meta["Version"] == longvideo.__version__
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    assert meta["Requires-Python"] == ">=3.11"
    core = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert not [r for r in core if "==" in r], core  # nothing pinned in the package's metadata
    torch = next(r for r in core if re.match(r"torch\b", r))
    assert re.search(r">=", torch) and re.search(r"<", torch), torch


def test_every_module_of_the_wheel_imports(installed):
    """Outside the checkout, every module of the installed wheel imports, except those of an extra
    this environment lacks, which fail naming that extra's package."""
    venv, work = installed
    probe = """
import importlib, json, pkgutil, longvideo
out = {}
for m in pkgutil.walk_packages(longvideo.__path__, "longvideo."):
    if m.name.endswith("__main__"):
        continue  # running the program is what importing it does
    try:
        mod = importlib.import_module(m.name)
        assert mod.__file__.startswith(longvideo.__path__[0]), mod.__file__
        out[m.name] = None
    except ModuleNotFoundError as e:
        out[m.name] = e.name
print(json.dumps(out))
"""
    res = _run([venv / "bin" / "python", "-c", probe], cwd=work, env=_clean_env())
    modules = json.loads(res.stdout.strip().splitlines()[-1])
    ours = {
        "longvideo." + ".".join(p.relative_to(root).with_suffix("").parts).replace(".__init__", "")
        for root in (REPO / "longvideo",)
        for p in root.rglob("*.py")
    }
    kernels = {f"longvideo.kernels.{p.stem}" for p in (REPO / "kernels").glob("*.py")}
    expected = {m.removesuffix(".__init__") for m in ours | kernels} - {"longvideo.__main__"}
    assert set(modules) >= expected - {"longvideo"}, sorted(expected - set(modules))
    failed = {m: pkg for m, pkg in modules.items() if pkg is not None}
    extras_missing = {"lmms_eval"}  # the lmms extra lives in its own environment
    assert all(pkg.split(".")[0] in extras_missing for pkg in failed.values()), failed
    assert "longvideo.infer.lmms" in failed or _has("lmms_eval")


def _has(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_installed_wheel_runs_outside_the_checkout(installed):
    venv, work = installed
    py = venv / "bin" / "python"
    env = _clean_env()
    assert _run([venv / "bin" / "longvideo", "--version"], cwd=work, env=env).stdout.split() == [
        "longvideo",
        longvideo.__version__,
    ]
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


def test_pip_install_keeps_another_supported_torch(tmp_path):
    """`pip install .` into an environment that holds the oldest torch pyproject.toml allows keeps
    that torch: pip's own resolution (--dry-run --report), offline, over this environment's
    packages, with that torch's metadata in front of this one's (the resolver reads no more)."""
    floor = re.search(r'"torch>=([\d.]+)', (REPO / "pyproject.toml").read_text()).group(1)
    other = ".".join((floor.split(".") + ["0", "0"])[:3])
    py = _layered_venv(tmp_path / "venv")
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout
    info = Path(site.strip(), f"torch-{other}.dist-info")
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {other}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")
    seen = _run([py, "-c", "import importlib.metadata as m; print(m.version('torch'))"])
    assert seen.stdout.strip() == other
    report = tmp_path / "report.json"
    _run(
        [
            *_pip(py),
            "install",
            "--dry-run",
            "--no-index",  # nothing to fetch: whatever pip would change fails here
            "--no-build-isolation",
            "--report",
            report,
            "-q",
            REPO,
        ],
        env=_clean_env(),
    )
    to_install = [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]
    assert to_install == ["longvideo"], to_install  # torch and every other package stay
