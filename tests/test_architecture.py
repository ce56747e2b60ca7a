"""The layering contract of docs/architecture.md, read from the source (imports inside functions too).

    5  entry points: longvideo.cli, longvideo.demo, every package's cli module
    4  longvideo.train, longvideo.infer, longvideo.export, longvideo.hf
    3  longvideo.checkpoint
    2  longvideo.data, longvideo.parallel
    1  longvideo.model, longvideo.vq, longvideo.tokenizer
    0  longvideo.kernels, configs (every `config` module and the root config), vocab, configtools,
       atomic, safepickle, distributed, _lazy, package __init__ files (lazy surfaces)

A module may import its own layer or lower ones; no cycle may exist between modules or between
packages; project modules are imported at the top of a file (never inside a function); the model
never imports torch.distributed or deepspeed, nor the runtime config (how it runs is applied from
outside); only `parallelize` (longvideo.parallel.apply) and the engine wrapper
(longvideo.parallel.engine) import deepspeed; the kernels import nothing of the project but
themselves; the ring reaches the kernels only through their public package surface. Each idea
has one home: the attention metadata and its default scale (kernels/meta.py), what ranks do
together outside attention (longvideo/distributed.py).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"longvideo": REPO / "longvideo", "longvideo.kernels": REPO / "kernels"}

LAYER_OF_PACKAGE = {
    "longvideo.kernels": 0,
    "longvideo.model": 1,
    "longvideo.vq": 1,
    "longvideo.data": 2,
    "longvideo.parallel": 2,
    "longvideo.train": 4,
    "longvideo.infer": 4,
    "longvideo.export": 4,
}
LAYER_OF_MODULE = {
    "longvideo": 0,
    "longvideo._lazy": 0,
    "longvideo.atomic": 0,
    "longvideo.configtools": 0,
    "longvideo.config": 0,
    "longvideo.vocab": 0,
    "longvideo.safepickle": 0,
    "longvideo.machine": 0,
    "longvideo.distributed": 0,
    "longvideo.tokenizer": 1,
    "longvideo.checkpoint": 3,
    "longvideo.hf": 4,
    "longvideo.cli": 5,
    "longvideo.__main__": 5,
    "longvideo.demo": 5,
}
ENTRY_POINT_SUFFIXES = (".cli", "_cli")


def modules() -> dict[str, Path]:
    out = {}
    for pkg, root in ROOTS.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = [] if rel.name == "__init__" and rel.parent == Path(".") else list(rel.parts)
            if parts and parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([pkg, *parts])
            if pkg == "longvideo" and parts and parts[0] in ("kernels", "configs"):
                if parts != ["kernels"]:  # longvideo/kernels/__init__.py: the kernels' surface
                    continue
            out[name] = path
    return out


MODULES = modules()


def package_of(name: str) -> str:
    """The component a module belongs to: longvideo.<pkg> or longvideo.kernels, else itself."""
    parts = name.split(".")
    if len(parts) >= 2 and f"longvideo.{parts[1]}" in LAYER_OF_PACKAGE:
        return f"longvideo.{parts[1]}"
    return name


def layer_of(name: str) -> int:
    if name in LAYER_OF_MODULE:
        return LAYER_OF_MODULE[name]
    if name.endswith(ENTRY_POINT_SUFFIXES):
        return 5
    pkg = package_of(name)
    if pkg == name and name not in LAYER_OF_PACKAGE:
        raise KeyError(
            f"{name} has no layer: add it to tests/test_architecture.py and docs/architecture.md"
        )
    if name == pkg and pkg != "longvideo.kernels":
        return 0  # a lazy package surface
    if name.endswith(".config"):
        return 0  # a component's config dataclass: a leaf the root config composes
    return LAYER_OF_PACKAGE[pkg]


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _project(target: str) -> str | None:
    """The project module `target` names (longest known prefix), or None for third-party ones."""
    while target:
        if target in MODULES:
            return target
        target = target.rsplit(".", 1)[0] if "." in target else ""
    return None


def imports() -> dict[str, list[tuple[str, str, bool]]]:
    """module -> [(imported name as written/resolved, project module or '', inside a function)]."""
    out: dict[str, list[tuple[str, str, bool]]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        inner = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)
            if isinstance(n, (ast.Import, ast.ImportFrom))
        }
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, node, path.name == "__init__.py")
                targets = [
                    f"{base}.{a.name}"
                    if _project(f"{base}.{a.name}") == f"{base}.{a.name}"
                    else base
                    for a in node.names
                ]
            else:
                continue
            for t in targets:
                found.append((t, _project(t) or "", id(node) in inner))
        out[name] = found
    return out


IMPORTS = imports()


def project_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for m, found in IMPORTS.items():
        for _, target, _ in found:
            if target and target != m:
                edges[m].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


def test_imports_go_down_the_layers():
    bad = [
        f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
        for m, targets in project_edges().items()
        for t in targets
        if layer_of(t) > layer_of(m)
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles_between_modules():
    assert _cycles(project_edges()) == []


def test_no_import_cycles_between_packages():
    """Components (packages, and the top-level modules) form a DAG. Config leaves and entry points
    are left out: the root config composes every component's config, and every CLI sits on top."""

    def node(m):
        return (
            None
            if layer_of(m) in (0, 5) and package_of(m) != "longvideo.kernels"
            else package_of(m)
        )

    edges: dict[str, set[str]] = defaultdict(set)
    for m, targets in project_edges().items():
        for t in targets:
            a, b = node(m), node(t)
            if a and b and a != b:
                edges[a].add(b)
    assert _cycles(edges) == []


def test_project_modules_are_imported_at_the_top():
    bad = [
        f"{m} imports {t} inside a function"
        for m, found in IMPORTS.items()
        for _, t, inner in found
        if inner and t
    ]
    assert not bad, "\n".join(bad)


def test_model_never_imports_distributed_code():
    bad = [
        f"{m}: {name}"
        for m, found in IMPORTS.items()
        if package_of(m) == "longvideo.model"
        for name, _, _ in found
        if name.startswith(("torch.distributed", "deepspeed"))
    ]
    assert not bad, bad


def test_model_reads_no_runtime_config():
    bad = [
        f"{m}: {t}"
        for m, found in IMPORTS.items()
        if package_of(m) == "longvideo.model"
        for _, t, _ in found
        if t in ("longvideo.parallel.config", "longvideo.config")
    ]
    assert not bad, bad


def test_only_parallelize_and_the_engine_import_deepspeed():
    allowed = {"longvideo.parallel.apply", "longvideo.parallel.engine"}
    bad = sorted(
        {
            m
            for m, found in IMPORTS.items()
            for name, _, _ in found
            if name.split(".")[0] == "deepspeed" and m not in allowed
        }
    )
    assert not bad, f"{bad} import deepspeed; go through longvideo.parallel (parallelize, Engine)"


def test_kernels_import_nothing_else_of_the_project():
    bad = [
        f"{m}: {t}"
        for m, found in IMPORTS.items()
        if package_of(m) == "longvideo.kernels"
        for _, t, _ in found
        if t and package_of(t) != "longvideo.kernels"
    ]
    assert not bad, bad


def test_parallel_uses_only_the_public_kernel_interface():
    bad = [
        f"{m}: {t}"
        for m, found in IMPORTS.items()
        if package_of(m) == "longvideo.parallel"
        for _, t, _ in found
        if t.startswith("longvideo.kernels.")
    ]
    assert not bad, bad


def _defined(names: set[str]) -> dict[str, list[str]]:
    """name -> the modules defining a top-level function or class of that name."""
    out: dict[str, list[str]] = defaultdict(list)
    for m, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
                out[node.name].append(m)
    return out


def _calls(attribute: str) -> list[str]:
    """The modules that call `<something>.<attribute>(...)`."""
    return sorted(
        m
        for m, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == attribute
    )


DISTRIBUTED_HELPERS = {
    "init_distributed",
    "torchrun_world",
    "local_device",
    "group_size_rank",
    "comm_device",
    "broadcast_array",
    "broadcast_text",
    "broadcast_record",
    "encode_record",
    "decode_record",
    "fail_together",
    "together",
    "RankFailedError",
}


def test_distributed_helpers_have_one_home():
    """Process-group start-up, broadcasts and failure agreement are defined in longvideo.distributed
    only (other modules may re-export them under an older name); nothing else starts a process
    group, and nothing pickles objects across ranks."""
    homes = _defined(DISTRIBUTED_HELPERS)
    assert {n: ms for n, ms in homes.items() if ms != ["longvideo.distributed"]} == {}
    assert set(homes) == DISTRIBUTED_HELPERS
    assert _calls("init_process_group") == ["longvideo.distributed"] * 2
    assert _calls("broadcast_object_list") == _calls("all_gather_object") == []


ATTENTION_PATH = (
    "longvideo.model.attention",
    "longvideo.model.transformer",
    "longvideo.hf",
    "longvideo.infer.sp",
)
_SCALE = re.compile(r"1(\.0)?\s*/\s*(math|torch|np)\.sqrt\(|\*\*\s*-0\.5")


def test_the_attention_metadata_and_default_scale_have_one_home():
    """AttentionMeta, Side and default_scale are defined in kernels/meta.py only; no other module
    on the attention path (kernels, parallel, the model's attention, inference's seams, hf) writes
    1/sqrt(d), and none keys plans by tensor versions (the plan stores are the metadata's)."""
    homes = _defined({"AttentionMeta", "Side", "default_scale", "PlanCache", "RingPlans"})
    assert homes == {
        n: ["longvideo.kernels.meta"] for n in ("AttentionMeta", "Side", "default_scale")
    }
    path_modules = [
        m
        for m in MODULES
        if package_of(m) in ("longvideo.kernels", "longvideo.parallel") or m in ATTENTION_PATH
    ]
    restating = [
        m
        for m in path_modules
        if m != "longvideo.kernels.meta" and _SCALE.search(MODULES[m].read_text())
    ]
    assert not restating, f"{restating} write the default softmax scale (use default_scale)"
    versions = [
        m
        for m in path_modules
        for node in ast.walk(ast.parse(MODULES[m].read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "_version"
    ]
    assert not versions, f"{versions} key something by tensor versions"


@pytest.mark.parametrize("module", ["longvideo.config", "longvideo.cli"])
def test_composing_the_config_imports_no_runtime_code(module):
    code = (
        f"import sys, {module}; heavy = [m for m in ('torch', 'deepspeed', 'av', 'decord', 'transformers') "
        "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr


LAZY_PACKAGES = sorted(p for p in LAYER_OF_PACKAGE if p != "longvideo.kernels")


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_lazy_surfaces_resolve_and_never_name_a_submodule(package):
    """Every public name of a package resolves; none is also a submodule's name (importing the
    submodule would bind the module over the name and `from package import name` would return it)."""
    import importlib

    pkg = importlib.import_module(package)
    submodules = {
        m.rsplit(".", 1)[1] for m in MODULES if m.startswith(package + ".") and m.count(".") == 2
    }
    clash = sorted(set(pkg.__all__) & submodules)
    assert not clash, f"{package} exports {clash}, which are also submodule names"
    for name in pkg.__all__:
        assert getattr(pkg, name) is not None, name


_SHADOW = """
import sys
sys.path.append(sys.argv[1])             # last: an installed `kernels` comes first
import kernels
import longvideo.kernels as ours
from transformers import LlamaConfig     # transformers >= 5.25 imports Hugging Face's `kernels`
print(kernels.__file__, ours.__file__, kernels is not ours and hasattr(ours, "get_backend"))
"""


def test_the_kernels_folder_is_no_regular_package():
    """The top-level kernels/ folder has no __init__.py, so from the checkout's root it is at most a
    namespace portion, which Python ranks below a regular package anywhere on sys.path; the surface
    of `longvideo.kernels` is longvideo/kernels/__init__.py, which finds the folder's modules."""
    assert not list((REPO / "kernels").glob("__init__.*"))
    code = (
        "import importlib.util, sys; "
        "sys.path[:] = [p for p in sys.path if 'site-packages' not in p]; "
        "s = importlib.util.find_spec('kernels'); "
        "print(s.origin, list(s.submodule_search_locations))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    origin, locations = done.stdout.split(" ", 1)
    assert origin == "None" and str(REPO / "kernels") in locations  # a namespace, nothing more


@pytest.mark.parametrize("other", [True, False], ids=["another-kernels-package", "none-other"])
def test_the_checkouts_kernels_folder_never_takes_the_top_level_name(tmp_path, other):
    """Run from the repository's root, `import kernels` gets another distribution's package (PyPI's
    `kernels`, which transformers imports) where one is installed, and transformers imports either
    way; the project's own kernels stay `longvideo.kernels`."""
    if other:
        (tmp_path / "kernels").mkdir()
        (tmp_path / "kernels" / "__init__.py").write_text("")
    done = subprocess.run(
        [sys.executable, "-c", _SHADOW, str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    # transformers imports, whatever `kernels` it finds
    assert done.returncode == 0, done.stderr[-2000:]
    theirs, ours, distinct = done.stdout.split()
    assert Path(ours) == REPO / "longvideo" / "kernels" / "__init__.py" and distinct == "True"
    # an installed `kernels` (here the test's, or Hugging Face's) always wins over the folder
    assert Path(theirs).parent != REPO / "kernels", theirs
    if other and Path(theirs).parent.parent == tmp_path:
        assert Path(theirs) == tmp_path / "kernels" / "__init__.py"
