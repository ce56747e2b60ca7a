"""scripts/gpu_check.py without a GPU: the dry run (the same parts on tiny shapes under the Triton
interpreter) starts, finishes, exits 0, passes every correctness route, and writes a JSON and a
markdown section that claim no GPU figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # out of make check's five minutes; make test runs it
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU machine run the real check: make gpu-check"
)
def test_dry_run_writes_its_report(tmp_path):
    out, md = tmp_path / "gpu_check.json", tmp_path / "benchmarks.md"
    md.write_text("# Benchmarks\n\nother sections\n")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_check.py"),
            "--dry-run",
            "--out",
            str(out),
            "--md",
            str(md),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["mode"] == "dry-run" and "no CUDA device" in rep["skipped"]
    parts = rep["parts"]
    assert set(parts) == {"env", "correctness", "syncs", "speed", "ring", "train"}
    assert parts["syncs"]["status"] == "skipped" and "needs CUDA" in parts["syncs"]["reason"]
    assert all(parts[n]["status"] == "ok" for n in parts if n != "syncs"), {
        n: p.get("error") for n, p in parts.items()
    }
    cases = parts["correctness"]["cases"]
    routes = {r for c in cases.values() for r in c if isinstance(c[r], dict) and "ok" in c[r]}
    assert {
        "triton split",
        "triton fused",
        "auto",
        "ring W=2, auto",
        "ring W=2, triton",
        "ring W=4, auto",
    } <= routes
    assert all(c["ok"] for c in cases.values())
    one_doc = next(c for n, c in cases.items() if "one document" in n)
    assert set(one_doc["routes"]) == {
        "causal -> cpu-flash",
        "dense -> cpu-flash",
    }  # every zigzag step dense
    speed = parts["speed"]["rows"]
    assert {r["docs"] for r in speed} == {1, 8} and all(r["triton_fwd_tflops"] > 0 for r in speed)
    assert all(r["auto_bwd_tflops"] > 0 for r in speed)
    for shape in (
        "D=64 9/3",
        "D=128 32/8",
    ):  # both block kinds timed, the exposure predicted per link
        ring = parts["ring"][shape]
        assert set(ring["block_ms"]) == {"local", "visiting"} and set(ring["routes"]) == {
            "causal -> cpu-flash",
            "dense -> cpu-flash",
        }
        assert {(p["W"], p["link"][:6]) for p in ring["predicted"]} == {
            (w, l) for w in (2, 4, 8) for l in ("NVLink", "Infini")
        }
    for system in (
        "ours (auto, checkpointing)",
        "transformers sdpa",
        "transformers sdpa + gradient checkpointing",
    ):
        rows = parts["train"][system]["rows"]
        assert len(rows) == 2 and all(
            r["steps"] >= 5 and r["min_s"] <= r["step_s"] <= r["max_s"] for r in rows
        ), rows
        assert parts["train"][system]["longest"] > max(
            r["seqlen"] for r in rows
        )  # measured past the timed lengths
    profiled = {
        n: e["profile"] for n, e in parts["train"].items() if isinstance(e, dict) and "profile" in e
    }
    assert set(profiled) == {
        "ours (auto, checkpointing)",
        "transformers sdpa + gradient checkpointing",
    }
    assert all(
        p["wall_ms"] > 0 and p["top_host"] and p["kernel_launches"] == 0 for p in profiled.values()
    )  # no device
    assert all(t["met"] == "n/a" for t in rep["targets"])  # a dry run claims no GPU figure
    text = md.read_text()  # the section is appended once and replaced on the next run
    assert text.startswith("# Benchmarks\n\nother sections\n") and text.count("## GPU check") == 1
    assert "**predicted**" in text and "measured, not fitted" in text
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    gpu_check.write_markdown(rep, md)
    assert md.read_text().count("## GPU check") == 1
    gpu = dict(
        rep,
        mode="gpu",
        parts=dict(
            parts,
            speed=dict(
                rows=[  # the kernel target read from GPU-mode rows
                    dict(docs=1, triton_fwdbwd_tflops=90.0, flash_fwdbwd_tflops=100.0),
                    dict(docs=1, triton_fwdbwd_tflops=120.0, flash_fwdbwd_tflops=100.0),
                    dict(docs=8, triton_fwdbwd_tflops=1.0),
                ]
            ),
        ),
    )
    kernel = next(
        t for t in gpu_check.targets(gpu) if t[0].startswith("Triton fwd+bwd vs SDPA flash")
    )
    assert kernel[2:] == ["0.90x (worst)", "yes"]
