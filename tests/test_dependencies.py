"""Every third-party import is declared where it belongs, and every declared package does work.

An import scan of longvideo/, kernels/, scripts/ and tests/ (ast, imports inside functions too),
each import name mapped to its distribution through the installed packages' metadata
(importlib.metadata.packages_distributions; an extra that is not installed here is matched by its
name), compared with pyproject.toml (docs/dependencies.md):

* missing: an import of a distribution pyproject.toml does not declare (transitive ones included);
* misplaced: the library (longvideo/, kernels/) importing a `dev`-only package; a library module
  importing an extra's package at its top (only inside the function that needs it, or in the
  extra's own module of EXTRA_MODULES); a dependency only tests and scripts import (it belongs in
  `dev`);
* unused: a declared package nothing imports, unless NOT_IMPORTED says what it does instead.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LIBRARY = {"longvideo": REPO / "longvideo", "longvideo.kernels": REPO / "kernels"}
OTHERS = [REPO / "scripts", REPO / "tests"]

# Packages declared for work that is not an import of them (the test checks that each is declared
# and, where it says so, never imported: a stale entry fails).
NOT_IMPORTED = {
    "sentencepiece": "transformers reads LWM's tokenizer.model with it (tests/test_lwm.py)",
    "protobuf": "transformers parses tokenizer.model with it (releases before 7 cannot)",
    "scikit-image": "its sample photographs, read by path (tests/material/photo_videos.py)",
    "pytest-timeout": "a pytest plugin: --timeout in the Makefile",
    "pip": "the packaging tests run it (wheels, --dry-run --report)",
    "setuptools": "the build backend, used without isolation by the Makefile and the tests",
    "uv": "`make lock` runs it",
    "ruff": "`make lint` runs it (format and lint, in make check and make test)",
    "filelock": "a pin for lmms-eval, which imports filelock._api (gone in filelock 4)",
}
# An import of the first name needs the distribution of the second (not the first's own).
IMPORT_NEEDS = {"torch.utils.tensorboard": "tensorboard"}
# Library modules that are an extra's own: they may import its packages at their top.
EXTRA_MODULES = {
    "longvideo.infer.lmms": "lmms",  # the lmms-eval model (an entry point of lmms-eval's)
    "longvideo.kernels._flash_attn_triton": "triton",  # loaded with the triton backend only
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    return norm(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1))


def declared() -> tuple[set[str], dict[str, set[str]]]:
    """(core distributions, extra -> its distributions, self-references left out)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {requirement_name(r) for r in project["dependencies"]}
    extras = {
        extra: {requirement_name(r) for r in reqs} - {norm(project["name"])}
        for extra, reqs in project["optional-dependencies"].items()
    }
    return core, extras


@dataclass(frozen=True)
class Import:
    name: str  # the dotted name as written
    file: str
    module: str  # the importing module (library) or the file's path
    library: bool
    top: bool  # at module level and not guarded by `except ImportError`


def _local_names() -> set[str]:
    """Top-level names of the scripts' and tests' own modules (benchreport, conftest, ...)."""
    out = set()
    for root in OTHERS:
        for p in root.rglob("*.py"):
            rel = p.relative_to(root)
            out.add(rel.parts[0].removesuffix(".py"))
    return out


def _guarded(tree: ast.AST) -> set[int]:
    """ids of import nodes inside a function or a try that catches ImportError."""
    out = set()
    for node in ast.walk(tree):
        inner = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner = [node]
        elif isinstance(node, ast.Try) and any(
            h.type is not None
            and any(
                isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError")
                for n in ast.walk(h.type)
            )
            for h in node.handlers
        ):
            inner = node.body
        for part in inner:
            out |= {id(n) for n in ast.walk(part) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def scan() -> list[Import]:
    found = []
    files = [(p, pkg, root) for pkg, root in LIBRARY.items() for p in root.rglob("*.py")]
    files += [(p, None, root) for root in OTHERS for p in root.rglob("*.py")]
    for path, pkg, root in files:
        tree = ast.parse(path.read_text())
        guarded = _guarded(tree)
        module = str(path.relative_to(REPO))
        if pkg is not None:
            parts = list(path.relative_to(root).with_suffix("").parts)
            module = ".".join([pkg, *[p for p in parts if p != "__init__"]])
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                found.append(
                    Import(name, str(path), module, pkg is not None, id(node) not in guarded)
                )
    return found


def distribution_of(name: str, installed: dict[str, list[str]], known: set[str]) -> str | None:
    """The distribution an import needs; None for the standard library and the project's own."""
    for prefix, dist in IMPORT_NEEDS.items():
        if name == prefix or name.startswith(prefix + "."):
            return dist
    top = name.split(".")[0]
    if top in sys.stdlib_module_names or top in ("longvideo", "kernels") or top in _LOCAL:
        return None
    dists = [norm(d) for d in installed.get(top, [])]
    for d in dists:  # a name several distributions provide (google.*): the declared one
        if d in known:
            return d
    return dists[0] if dists else norm(top)  # not installed here: an extra's, by its name


_LOCAL = _local_names()


def findings() -> dict[str, list[str]]:
    core, extras = declared()
    extra_of = defaultdict(set)
    for extra, dists in extras.items():
        for d in dists:
            extra_of[d].add(extra)
    known = core | set(extra_of)
    installed = importlib.metadata.packages_distributions()
    missing, misplaced = [], []
    used_by_library, used_anywhere = set(), set()
    for imp in scan():
        dist = distribution_of(imp.name, installed, known)
        if dist is None:
            continue
        used_anywhere.add(dist)
        where = f"{imp.file.removeprefix(str(REPO) + '/')}: import {imp.name} ({dist})"
        if dist not in known:
            missing.append(where)
            continue
        if not imp.library:
            continue
        used_by_library.add(dist)
        if dist in core:
            continue
        own = EXTRA_MODULES.get(imp.module)
        if extra_of[dist] <= {"dev"}:
            misplaced.append(f"{where}: the library imports a dev-only package")
        elif imp.top and own not in extra_of[dist]:
            misplaced.append(
                f"{where}: a package of the extra {sorted(extra_of[dist])} imported at the top of "
                "a library module (import it inside the function that needs it)"
            )
    unused = sorted(
        d for d in known if d not in used_anywhere and d not in {norm(k) for k in NOT_IMPORTED}
    )
    only_tests = sorted(d for d in core if d not in used_by_library and d in used_anywhere)
    misplaced += [f"{d}: a core dependency only tests and scripts import (dev)" for d in only_tests]
    stale = sorted(k for k in NOT_IMPORTED if norm(k) not in known or norm(k) in used_anywhere)
    return {"missing": missing, "misplaced": misplaced, "unused": unused, "stale": stale}


FINDINGS = findings()


def test_every_import_is_declared():
    assert FINDINGS["missing"] == []


def test_every_import_is_declared_where_it_belongs():
    assert FINDINGS["misplaced"] == []


def test_every_declared_package_is_used():
    assert FINDINGS["unused"] == []


def test_the_packages_used_otherwise_are_declared_and_not_imported():
    assert FINDINGS["stale"] == []


def test_the_scan_sees_what_it_must():
    """The scan itself: it finds imports inside functions, maps import names that differ from
    their distribution's, and reads pyproject's extras."""
    imports = scan()
    names = {(i.module, i.name, i.top) for i in imports}
    assert ("longvideo.vq.vqgan", "diffusers.VQModel", False) in names  # lazy: inside a function
    assert ("longvideo.infer.serve", "PIL.Image", True) in names
    installed = importlib.metadata.packages_distributions()
    core, extras = declared()
    assert distribution_of("PIL.Image", installed, core) == "pillow"
    assert distribution_of("yaml", installed, core) == "pyyaml"
    assert (
        distribution_of("torch.utils.tensorboard.SummaryWriter", installed, core) == "tensorboard"
    )
    assert distribution_of("json", installed, core) is None
    assert "lmms-eval" in extras["lmms"] and "diffusers" in extras["lwm"]


def _lwm_vqgan():
    from longvideo.vq import VQConfig
    from longvideo.vq.vqgan import LWMVQGAN

    LWMVQGAN(VQConfig(arch="lwm-vqgan", quantizer="vq"))


def _videomme(tmp_path):
    from longvideo.infer.benchmarks import _videomme

    _videomme(tmp_path)


def _decord(tmp_path):
    from longvideo.data.video import read_video

    (tmp_path / "a.mp4").write_bytes(b"not read")
    read_video(tmp_path / "a.mp4", backend="decord")


@pytest.mark.parametrize(
    "hidden, call, extra",
    [
        ("diffusers", lambda tmp: _lwm_vqgan(), "lwm"),
        ("pyarrow.parquet", _videomme, "videomme"),
        ("decord", _decord, "decord"),
    ],
    ids=["lwm", "videomme", "second-video-backend"],  # runs where decord is missing
)
def test_a_missing_extra_is_named_by_the_error(hidden, call, extra, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, hidden, None)  # as if not installed
    with pytest.raises(ImportError, match=re.escape(f"pip install 'longvideo[{extra}]'")):
        call(tmp_path)


def test_one_version(capsys):
    """The version lives in longvideo/__init__.py; the metadata and `longvideo --version` read it
    from there."""
    import longvideo
    from longvideo import cli

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "longvideo.__version__"
    assert importlib.metadata.version("longvideo") == longvideo.__version__
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"longvideo {longvideo.__version__}\n"


def _pins(lock: Path) -> dict[str, list[tuple[str, str]]]:
    """name -> [(version, marker)] of a lock's `name==version ; marker` lines."""
    out = defaultdict(list)
    for line in lock.read_text().splitlines():
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)\s*(?:;\s*(.*))?$", line)
        if m:
            out[norm(m.group(1))].append((m.group(2), m.group(3) or ""))
    return out


@pytest.mark.parametrize(
    "lock, extras",
    [
        (
            "requirements.lock",
            ("dev", "decord", "wandb", "lwm", "videomme", "accelerate", "triton"),
        ),
        ("requirements-lmms.lock", ("lmms",)),
    ],
)
def test_the_lock_holds_every_declared_package_inside_its_range(lock, extras):
    """`make lock` ran after pyproject.toml last changed: every dependency of the environment the
    lock builds is pinned there, at a version its range allows (Python 3.11 on Linux)."""
    from packaging.markers import Marker
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    env = {"python_version": "3.11", "python_full_version": "3.11.7", "sys_platform": "linux"}
    env |= {"platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
    pins = _pins(REPO / lock)
    bad = []
    for req in reqs:
        name = norm(req.name)
        if name == "longvideo" or (req.marker and not req.marker.evaluate(env)):
            continue
        versions = [
            v for v, marker in pins.get(name, []) if not marker or Marker(marker).evaluate(env)
        ]
        if len(versions) != 1:
            bad.append(f"{req}: {len(versions)} pins in {lock}")
        elif lock == "requirements.lock" and not req.specifier.contains(
            versions[0], prereleases=True
        ):
            bad.append(f"{req}: {lock} pins {versions[0]}")
    assert not bad, "run `make lock`:\n" + "\n".join(bad)
