"""Bounds on what a reader of the library meets (docs/architecture.md, "Style"): lines a reader
takes in at once, signatures that fit in the head, no module replaced behind the import system's
back. The formatter and the linter themselves run in `make check` and `make test` (`make lint`)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIBRARY = sorted([*(REPO / "longvideo").rglob("*.py"), *(REPO / "kernels").rglob("*.py")])
WIDE = 8
"""A signature with this many parameters (self and cls aside) counts as wide."""


def _is_triton_kernel(fn: ast.AST) -> bool:
    """@triton.jit functions: their parameters are the kernel's launch arguments."""
    return any(
        isinstance(d, ast.Attribute)
        and d.attr == "jit"
        or isinstance(d, ast.Call)
        and isinstance(d.func, ast.Attribute)
        and d.func.attr == "jit"
        for d in getattr(fn, "decorator_list", [])
    )


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> int:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
    return len([n for n in names if n not in ("self", "cls")])


def signatures() -> list[tuple[Path, str, int]]:
    """(file, function name, parameter count) of every def and lambda in the library, Triton
    kernels aside."""
    out = []
    for path in LIBRARY:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                if not _is_triton_kernel(node):
                    out.append((path, getattr(node, "name", "<lambda>"), _parameters(node)))
    return out


def test_lines_over_100_characters_are_at_most_one_percent():
    lines = [line for path in LIBRARY for line in path.read_text().splitlines()]
    long = [line for line in lines if len(line) > 100]
    assert len(long) <= 0.01 * len(lines), f"{len(long)} of {len(lines)} lines over 100 characters"


def test_wide_signatures_are_rare_and_almost_absent_below_the_model():
    sigs = signatures()
    wide = [(p.relative_to(REPO), name, n) for p, name, n in sigs if n >= WIDE]
    assert len(wide) <= 0.03 * len(sigs), f"{len(wide)} of {len(sigs)} signatures: {wide}"
    low = [
        w for w in wide if w[0].parts[0] == "kernels" or w[0].parts[:2] == ("longvideo", "parallel")
    ]
    assert len(low) <= 5, low


def test_no_module_assigns_into_sys_modules():
    for path in LIBRARY:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                is_sys_modules = (
                    isinstance(t, ast.Subscript)
                    and isinstance(t.value, ast.Attribute)
                    and t.value.attr == "modules"
                )
                assert not is_sys_modules, f"{path}:{node.lineno} assigns into sys.modules"
