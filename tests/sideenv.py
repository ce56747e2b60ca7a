"""Environments for the extras that cannot join the main one, layered over it
(docs/dependencies.md).

lmms-eval 0.7.3 pins PyAV < 16 (the project needs 16 or later) and decord's wheel declares a tag
`pip check` calls unsupported: each goes into its own virtual environment beside the checkout,
`.venv-lmms` and `.venv-decord`, that sees the environment it was built from (its packages come
first, then the base's, through a .pth file that runs site.addsitedir, so the base's editable
install of the checkout comes along) and holds only what its extra needs different, installed with
pip from its lock. An environment is rebuilt when its lock, its requirements or its base change.

    python tests/sideenv.py lmms     # what `make lmms-env` runs; prints the environment's python
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# name -> (the extra of pyproject.toml it installs, the lock it installs from)
SIDE_ENVS = {
    "lmms": ("lmms", "requirements-lmms.lock"),
    "decord": ("decord", "requirements.lock"),
}


def extra_requirements(extra: str) -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(project["optional-dependencies"][extra])


def side_env_dir(name: str, base_prefix: str = sys.prefix) -> Path:
    """.venv-NAME for the checkout's .venv; another base gets a directory of its own."""
    if Path(base_prefix).resolve() == (REPO / ".venv").resolve():
        return REPO / f".venv-{name}"
    tag = hashlib.sha256(str(Path(base_prefix).resolve()).encode()).hexdigest()[:8]
    return REPO / f".venv-{name}-{tag}"


def _run(cmd: list, **kw) -> str:
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if res.returncode != 0:
        raise RuntimeError(
            f"{' '.join(map(str, cmd))} failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}"
        )
    return res.stdout


def build(name: str) -> Path:
    """The python of side environment `name`, built (or rebuilt) over the running interpreter's
    environment when missing or stale."""
    extra, lock = SIDE_ENVS[name]
    requirements = extra_requirements(extra)
    base_site = sysconfig.get_paths()["purelib"]
    key = json.dumps(
        {
            "lock": hashlib.sha256((REPO / lock).read_bytes()).hexdigest(),
            "requirements": requirements,
            "base": base_site,
            "python": sys.version,
        },
        sort_keys=True,
    )
    env = side_env_dir(name)
    py = env / "bin" / "python"
    stamp = env / ".installed"
    if stamp.is_file() and stamp.read_text() == key and py.exists():
        return py
    shutil.rmtree(env, ignore_errors=True)
    # no pip of its own: the base's pip, found through the .pth, installs into this prefix
    _run([sys.executable, "-m", "venv", "--without-pip", env])
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    Path(site, "base_env.pth").write_text(f"import site; site.addsitedir({base_site!r})\n")
    _run([py, "-m", "pip", "install", "-q", "-c", REPO / lock, *requirements], cwd=REPO)
    stamp.write_text(key)
    return py


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in SIDE_ENVS:
        sys.exit(f"usage: python tests/sideenv.py {{{','.join(SIDE_ENVS)}}}")
    print(build(sys.argv[1]))
