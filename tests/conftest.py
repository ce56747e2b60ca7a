"""Test-session settings shared by every test module.

* Triton kernels run through the interpreter when there is no GPU (set before triton is imported).
* DeepSpeed uses its CPU accelerator.
* Threads are capped so several spawned ranks share the 2-core CI machine well.
* DeepSpeed's JIT-built ops go under the venv, so two checkouts' venvs never rebuild each other's.
* Tests of the decord backend (marked `decord`, or named after it, or taking it as a parameter) are
  skipped where decord is not installed, the main environment (`pip check` calls its wheel
  unsupported); tests/test_decord.py runs them in the decord extra's own environment.
* With LONGVIDEO_SUITE_JSON=PATH, a session that passes writes its wall time, test counts and the
  machine there (`make results` puts `make test` / `make check` times in the README from it).
"""

import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

try:  # decide on the interpreter before any module imports triton
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


import importlib.util  # noqa: E402

import pytest  # noqa: E402

_START = time.time()
HAVE_DECORD = importlib.util.find_spec("decord") is not None


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(
        reason="decord is an optional extra, not in the main environment: tests/test_decord.py "
        "runs these in its own"
    )
    for item in items:
        if item.path.name == "test_decord.py":  # the runner of the others
            continue
        if "decord" in item.name or item.get_closest_marker("decord"):
            item.add_marker(pytest.mark.decord)
            if not HAVE_DECORD:
                item.add_marker(skip)


@pytest.fixture(scope="module")
def rb():
    """scripts/run_benchmarks.py imported as a module (it is a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "run_benchmarks", Path(__file__).parent.parent / "scripts" / "run_benchmarks.py"
    )
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("LONGVIDEO_SUITE_JSON")
    if not out or exitstatus != 0:
        return
    import json

    from longvideo.machine import machine_info

    stats = session.config.pluginmanager.get_plugin("terminalreporter").stats
    record = {
        "seconds": round(time.time() - _START, 1),
        "markexpr": session.config.option.markexpr or None,
        "tests": {
            "passed": len([r for r in stats.get("passed", []) if r.when == "call"]),
            "skipped": len(stats.get("skipped", [])),
        },
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(out).write_text(json.dumps(record, indent=1) + "\n")


@pytest.fixture
def one_thread():
    """Run a test on one torch thread (several spawned ranks share the 2-core machine)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def vq_dir(tmp_path_factory):
    """A saved, untrained tiny 2d VQ (16 x 16 frames -> 4 x 4 codes of 16): shapes, not quality."""
    import torch

    from longvideo.vq import VQConfig, VQModel

    torch.manual_seed(0)
    cfg = VQConfig(
        mode="2d",
        resolution=16,
        downsample=4,
        channels=8,
        channel_mult=(1, 1, 1),
        num_res_blocks=0,
        codebook_size=16,
    )
    d = tmp_path_factory.mktemp("vq")
    VQModel(cfg).save(d)
    return str(d)
