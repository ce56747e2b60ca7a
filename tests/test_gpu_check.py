"""scripts/gpu_check.py without a GPU: the dry run (the same parts on tiny shapes under the Triton
interpreter) starts, finishes, exits 0 and writes a JSON that says what it skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine run the real check: make gpu-check")
def test_dry_run_writes_its_report(tmp_path):
    out, md = tmp_path / "gpu_check.json", tmp_path / "benchmarks.md"
    md.write_text("# Benchmarks\n\nother sections\n")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--out", str(out),
                        "--md", str(md)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["mode"] == "dry-run" and "no CUDA device" in rep["skipped"]
    parts = rep["parts"]
    assert set(parts) == {"env", "correctness", "syncs", "determinism", "speed", "train", "profile"}
    assert parts["syncs"]["status"] == "skipped" and "needs CUDA" in parts["syncs"]["reason"]
    for name in ("env", "correctness", "determinism", "speed", "train", "profile"):
        assert parts[name]["status"] == "ok", (name, parts[name])
    profiled = {n: r for n, r in parts["profile"].items() if isinstance(r, dict) and "wall_ms" in r}
    assert "ours (triton, checkpointing)" in profiled and "transformers sdpa + gradient checkpointing" in profiled
    assert all(r["wall_ms"] > 0 and r["top_host"] for r in profiled.values())
    cases = parts["correctness"]["cases"]
    assert any("ring split-key backward" in c for c in cases.values()) and all(c["ok"] for c in cases.values())
    assert parts["determinism"]["forward_bitwise_equal"]
    assert all(t["met"] == "n/a" for t in rep["targets"])  # a dry run claims no GPU figure
    text = md.read_text()  # the section is appended once and replaced on the next run
    assert text.startswith("# Benchmarks\n\nother sections\n") and text.count("## GPU check") == 1
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    gpu_check.write_markdown(rep, md)
    assert md.read_text().count("## GPU check") == 1
