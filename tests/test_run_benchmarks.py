"""scripts/run_benchmarks.py: the markdown built from fabricated benchmark JSON by each bench
script's report() (tables, targets met or not, "not measured" for missing or malformed files, or
a script that cannot be imported), the runner's handling of scripts that fail or run past the
timeout, and what every scripts/bench_*.py exposes for the page."""

from __future__ import annotations

import ast
import importlib.util
import io
import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def rb():
    spec = importlib.util.spec_from_file_location("run_benchmarks", ROOT / "scripts" / "run_benchmarks.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def _write(d: Path, name: str, obj) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.json").write_text(obj if isinstance(obj, str) else json.dumps(obj))


def _summary(text: str) -> dict[str, list[str]]:
    """{benchmark label: [measured, target, met]} from the summary table at the top."""
    rows = {}
    for line in text.split("\n## ")[0].splitlines():
        if line.startswith("| ["):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0].split("](")[0][1:]] = cells[1:]
    return rows


def _section(text: str, name: str) -> str:
    return text.split(f'<a id="{name}"></a>')[1].split("<a id=")[0]


def model_json(hf_gib_16k: float, hf_s_4k: float) -> dict:
    return {"machine": "2-core CPU", "loadavg": [3.0, 2.0, 1.0],
            "config": {"dim": 64, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 512, "threads": 2,
                       "repeats": 1, "budget_gib": 8.0},
            "results": [],
            "table": [{"seq_len": 4096, "ours_s": 1.0, "hf_s": hf_s_4k, "ours_gib": 0.5, "hf_gib": 0.8},
                      {"seq_len": 16384, "ours_s": 5.0, "hf_s": 8.0, "ours_gib": 1.0, "hf_gib": hf_gib_16k}],
            "max_len_fit": {"longvideo": 120000.0, "transformers": 20000.0}}


def ring_json(exposed_w2: float, own_w2: float | None = None) -> dict:
    """own_w2: the transfer's own exposed share at W = 2 (None: a JSON from before it was measured)."""

    def row(world, layout, exposed, balance, saved, peak):
        own = {} if own_w2 is None else {
            "exposed_transfer_frac_max": own_w2 if (world, layout) == (2, "zigzag") else 0.001}
        return {**own, "world": world, "layout": layout, "s_local": 16384 // world, "step_s": 2.0 / world,
                "ranks": [], "exposed_frac_max": exposed, "balance_slowest_over_mean": balance,
                "ideal_ratio": 0.9, "ideal_ratio_cpu": 0.95, "saved_mem_over_single_div_w": saved,
                "peak_mem_over_single_div_w": peak, "serial_comm_frac": 0.01 * world}

    return {"args": {"seq": 16384, "heads": 4, "kv_heads": 4, "head_dim": 64, "dtype": "float32",
                     "backend": "cpu", "threads": 1, "iters": 2},
            "machine": {"cpus": 2, "torch": "2.x", "loadavg_before": [1.0, 1.0, 1.0]},
            "rows": [row(1, "zigzag", 0.0, 1.0, 1.0, 1.0), row(2, "zigzag", exposed_w2, 1.04, 1.1, 1.5),
                     row(2, "contiguous", 0.4, 1.45, 1.1, 1.5), row(4, "zigzag", 0.3, 1.08, 1.15, 2.0)]}


TRAIN = {"model": "tiny", "budget_gb": 16.0, "seq": 2048,
         "targets": {"ours_sp1_over_transformers": 16.0, "ours_spW_over_Wx_sp1": 0.9},
         "machine": {"cores": 2, "loadavg": [1.0, 1.0, 1.0]},
         "systems": [
             {"system": s, "ranks": w, "seqs": [1024, 2048], "peak_mib_per_rank": [100.0, 150.0],
              "fit": {"coef": [50.0, 0.05], "form": "a + b S", "kib_per_token": 51.2},
              "context_at_budget": ctx, "throughput": {"seq": 2048, "step_s": 1.0, "tokens_per_s": tps}}
             for s, w, ctx, tps in (("transformers eager", 1, 1000.0, 900.0), ("transformers sdpa", 1, 4000.0, 1000.0),
                                    ("ours sp=1", 1, 32000.0, 800.0), ("ours sp=2", 2, 60000.0, 1200.0),
                                    ("ours sp=4", 4, 100000.0, 1500.0))]}

DEEP = {"model": "tiny.yaml with 32 layers (dim 128)", "budget_gb": 16.0, "seq": 2048,
        "systems": [dict(sy, context_at_budget=ctx) for sy, ctx in zip(TRAIN["systems"][:3], (500.0, 2000.0, 40000.0))]}

INFER = {"lengths": [1024, 2048], "kv_cache_bytes": [2 * 2**20, 4 * 2**20],
         "config": {"dim": 64, "layers": 2, "heads": 4, "kv_heads": 2, "chunk": 256, "backend": "cpu",
                    "dtype": "float32"},
         "machine": {"cpus": 2, "loadavg_before": [1.0, 1.0, 1.0]},
         "modes": {"one_shot": [{"ttft_s": 1.0, "peak_mb": 10.0}, {"ttft_s": 2.0, "peak_mb": 40.0}],
                   "chunked": [{"ttft_s": 1.5, "peak_mb": 5.0}, {"ttft_s": 2.5, "peak_mb": 10.0}],
                   "sp2": [{"ttft_s": 0.8, "peak_mb": 6.0}, {"ttft_s": 1.5, "peak_mb": 20.0}]},
         "same_tokens_all_modes": [True, True]}

VQ = {"machine": {"cpu_count": 2, "loadavg_start": [1.0, 1.0, 1.0]},
      "throughput": [{"name": "tiny", "mode": "2d", "resolution": 32, "codes_per_group": 16, "codebook_size": 1024,
                      "params_M": 0.5, "frames": 64, "encode_fps": 250.0, "decode_fps": 200.0,
                      "tokens_per_second_of_video": 16.0, "tokens_per_hour_1fps": 57600},
                     {"name": "causal3d-tiny", "mode": "causal3d", "resolution": 32, "codes_per_group": 16,
                      "codebook_size": 1024, "params_M": 0.7, "frames": 64, "encode_fps": 120.0, "decode_fps": 90.0,
                      "tokens_per_second_of_video": 4.0, "tokens_per_hour_1fps": 14400}],
      "training": [{"name": "tiny", "train_seconds": 180.2, "steps": 400, "psnr": 24.31, "usage": 0.875,
                    "perplexity": 600.0, "codes_used": 896, "psnr_untrained": 9.5, "curve": []}]}

KERNELS_SKIPPED = {"machine": {"cpus": 2, "loadavg": [1.0, 1.0, 1.0]}, "config": {"target": 0.9},
                   "skipped": True, "reason": "no CUDA device"}


def test_tables_and_targets(rb, tmp_path):
    bench = tmp_path / "docs" / "bench"
    _write(bench, "model", model_json(hf_gib_16k=5.0, hf_s_4k=1.2))
    _write(bench, "ring", ring_json(exposed_w2=0.25, own_w2=0.02))
    _write(bench, "kernels", KERNELS_SKIPPED)
    _write(bench, "train", {**TRAIN, "deeper_model": DEEP})
    _write(bench, "infer", INFER)
    _write(bench, "vq", VQ)
    for png in ("infer.png", "vq_tiny_samples.png"):
        (bench / png).write_bytes(b"\x89PNG")
    out = tmp_path / "docs" / "benchmarks.md"
    text = rb.build_markdown(bench, out, tmp_path / "docs")
    assert out.read_text() == text
    s = _summary(text)

    # model: 1.0 / 5.0 GiB = 0.2 <= 1/4; 1.2 s / 1.0 s = 1.2x transformers' speed at 4K
    assert s["model: peak memory at 16K"][0].startswith("0.200x") and s["model: peak memory at 16K"][2] == "yes"
    assert s["model: step time at 4K"][0].startswith("1.20x") and s["model: step time at 4K"][2] == "yes"
    model = _section(text, "model")
    assert "| 16,384 | 5.00 | 8.00 | 1.60x | 1.00 | 5.00 | 0.200 |" in model
    assert "longvideo 117.2K, transformers 19.5K (6.0x)" in model

    # ring: exposed 5 % at S_local 8K (W=4 has S_local 4K, outside the target), worst balance 1.08,
    # worst saved-for-backward 1.15x single / W
    # the target is read on the transfer's own exposed time (2 %), not on all the waiting (25 %)
    assert s["ring: exposed communication"][0] == ("transfer's own exposed time 2.0 % (worst rank, W = 2); all time "
                                                   "blocked in wait 25.0 %; the transfers alone, unoverlapped, "
                                                   "2.0 % of the step")
    assert s["ring: exposed communication"][2] == "yes"
    assert s["ring: zigzag balance"][0].startswith("slowest / mean CPU s = 1.080") and s["ring: zigzag balance"][2] == "yes"
    assert s["ring: per-rank activation memory"][0].startswith("saved for backward: 1.15x")
    assert s["ring: per-rank activation memory"][2] == "saved for backward: yes; whole-step peak: **no**"
    assert "| 2 | contiguous | 8,192 | 1.00 | 0.90 | 0.95 | 40.0 % | 0.1 % | 2.0 % | 1.450 | 1.10x | 1.50x |" in _section(text, "ring")

    assert s["kernels: Triton flash attention fwd+bwd"][2] == "not measurable here"
    assert "Skipped: no CUDA device" in _section(text, "kernels")

    # train: 32000 / 1000 = 32x eager (met), 32000 / 4000 = 8x sdpa (not met);
    # sp=2: 60000 / (2 x 32000) = 0.94, sp=4: 100000 / (4 x 32000) = 0.78 -> not met
    assert s["train: our sp=1 context vs transformers (eager)"][0].startswith("32.0x")
    assert s["train: our sp=1 context vs transformers (eager)"][2] == "yes"
    assert s["train: our sp=1 context vs transformers (sdpa)"][0].startswith("8.0x")
    assert s["train: our sp=1 context vs transformers (sdpa)"][2] == "**no**"
    assert s["train: our sp=W context"][0].startswith("sp=2: 0.94 (58.6K); sp=4: 0.78")
    assert s["train: our sp=W context"][2] == "**no**"
    assert "Caution" not in _section(text, "train")  # every peak rose by half
    # the deeper shape: its own rows (40000 / 500 = 80x, 40000 / 2000 = 20x), no sp = W row (sp = 1 only)
    assert s["train (32 layers): our sp=1 context vs transformers (eager)"][0].startswith("80.0x")
    assert s["train (32 layers): our sp=1 context vs transformers (sdpa)"][0].startswith("20.0x")
    assert s["train (32 layers): our sp=1 context vs transformers (sdpa)"][2] == "yes"
    assert not any(k.startswith("train (32 layers): our sp=W") for k in s)
    assert "**Train (32 layers)**" in _section(text, "train")

    infer = _section(text, "infer")
    assert "| 2,048 | 4 | 2.00 s / 40.0 MiB | 2.50 s / 10.0 MiB (0.25x) | 1.50 s / 20.0 MiB (0.50x) |" in infer
    assert "![Inference: time to first token and memory vs context](bench/infer.png)" in infer
    assert s["infer: TTFT and peak memory vs context"][2] == "n/a"
    assert "Machine: 2-core CPU; load average (1/5/15 min) 1.0/1.0/1.0 (before)." in infer
    assert "[inference.md](inference.md)" in infer

    vq = _section(text, "vq")
    assert "| `causal3d-tiny` | causal3d | 32 | 0.70 | 16 | 1,024 | 120.0 | 90.0 | 4 | 14,400 |" in vq
    assert "| `tiny` | 180 | 400 | 9.5 -> 24.3 | 87.5 % | 600 | 896 |" in vq
    assert "![held-out frames and reconstructions, tiny](bench/vq_tiny_samples.png)" in vq
    assert "![VQ video tokenizer](bench/vq.png)" not in vq  # no vq.png written
    assert s["vq: throughput and quality after a fixed training budget"][0] == \
        "`tiny`: 250 frames/s encode, PSNR 24.3 dB, 88 % of the codebook after 180 s"

    # nothing written for data: its section says how to measure it
    assert "_Not measured yet (no data.json): run `python scripts/bench_data.py`._" in _section(text, "data")


def test_targets_not_met(rb, tmp_path):
    bench = tmp_path / "bench"
    _write(bench, "model", model_json(hf_gib_16k=3.0, hf_s_4k=0.9))
    _write(bench, "ring", ring_json(exposed_w2=0.15))
    _write(bench, "kernels", {**KERNELS_SKIPPED, "skipped": False,
                              "results": [{"seqlen": 4096, "batch": 16, "ours_fwd_tflops": 300.0,
                                           "sdpa_fwd_tflops": 320.0, "ours_fwdbwd_tflops": 200.0,
                                           "sdpa_fwdbwd_tflops": 250.0, "max_abs_diff_vs_sdpa": 0.004}]})
    flat = json.loads(json.dumps(TRAIN))
    flat["systems"][2]["peak_mib_per_rank"] = [1000.0, 1020.0]  # ours sp=1: a 2 % rise, a noisy slope
    _write(bench, "train", flat)
    text = rb.build_markdown(bench, tmp_path / "b.md", tmp_path)
    assert "Caution" not in _section(text, "infer")
    caution = [ln for ln in _section(text, "train").splitlines() if ln.startswith("Caution")]
    assert len(caution) == 1 and "ours sp=1 20 MiB over 1,000" in caution[0] and "sp=2" not in caution[0]
    s = _summary(text)
    assert s["model: peak memory at 16K"][0].startswith("0.333x") and s["model: peak memory at 16K"][2] == "**no**"
    assert s["model: step time at 4K"][0].startswith("0.90x") and s["model: step time at 4K"][2] == "**no**"
    # without the transfer's own share in the JSON the whole wait is judged
    assert s["ring: exposed communication"][0].startswith("15.0 % blocked in wait")
    assert s["ring: exposed communication"][2] == "**no**"
    # 200 / 250 = 80 % < 90 %
    assert s["kernels: Triton flash attention fwd+bwd"][0].startswith("80% of SDPA flash")
    assert s["kernels: Triton flash attention fwd+bwd"][2] == "**no**"


def test_missing_and_malformed_json(rb, tmp_path):
    bench = tmp_path / "bench"
    _write(bench, "data", {"video": {"runs": "nonsense"}})  # a layout the formatter does not read
    _write(bench, "ring", "{not json")
    _write(bench, "train", [1, 2, 3])
    _write(bench, "infer", {"lengths": [1024], "modes": {"one_shot": [{"ttft_s": 1.0}]}})
    text = rb.build_markdown(bench, tmp_path / "b.md", tmp_path)
    for name in rb.ORDER:
        sec = _section(text, name)
        assert f"_Not measured yet (" in sec and f"run `python scripts/bench_{name}.py`._" in sec, name
        assert "| --- |" not in sec and "|---|" not in sec, name  # no table
    assert "data.json has a layout this page does not read" in _section(text, "data")
    assert "ring.json is not readable JSON" in _section(text, "ring")
    assert "no model.json" in _section(text, "model")
    s = _summary(text)
    assert len(s) == sum(len(rb.load_bench(n, p).targets) for n, p in rb.discover().items())
    assert all(row[2] == "not measured yet" for row in s.values())


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_runner_reports_failures_and_timeouts(rb, tmp_path):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    # like the real scripts, each runs only as __main__ (the CLI below imports them for the page)
    (scripts / "bench_ok.py").write_text("if __name__ == '__main__':\n    print('hello from ok')\n")
    (scripts / "bench_bad.py").write_text(
        "import sys\nif __name__ == '__main__':\n    print('boom: bad input', file=sys.stderr)\n    sys.exit(3)\n")
    pidfile = tmp_path / "child.pid"
    (scripts / "bench_slow.py").write_text(
        "import subprocess, sys, time\nif __name__ == '__main__':\n"
        f"    p = subprocess.Popen(['sleep', '60'])\n    open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "    print('slow started', file=sys.stderr, flush=True)\n    time.sleep(60)\n")
    found = rb.discover(scripts)
    assert list(found) == ["bad", "ok", "slow"]
    out, err = io.BytesIO(), io.BytesIO()
    t0 = time.perf_counter()
    runs = rb.run_all(found, timeout=3, cwd=tmp_path, out=out, err=err)
    assert time.perf_counter() - t0 < 20
    assert [runs[n].status for n in ("bad", "ok", "slow")] == ["failed", "ok", "timeout"]
    assert runs["bad"].returncode == 3 and "boom: bad input" in runs["bad"].stderr_tail
    assert "slow started" in runs["slow"].stderr_tail and "timeout" in runs["slow"].stderr_tail
    assert b"hello from ok" in out.getvalue() and b"boom: bad input" in err.getvalue()
    # the whole process group went, including what the script spawned
    assert not _alive(int(pidfile.read_text()))

    bench = tmp_path / "bench"
    _write(bench, "infer", INFER)
    text = rb.build_markdown(bench, tmp_path / "b.md", tmp_path,
                             runs={"infer": rb.RunResult("infer", "failed", 3, 1.0, "boom: bad input"), **runs})
    sec = _section(text, "infer")
    assert "failed (exit 3)" in sec and "boom: bad input" in sec and "already there" in sec
    assert "| 1,024 |" in sec  # the existing figures are still shown
    assert "(last run failed)" in _summary(text)["infer: TTFT and peak memory vs context"][2]
    assert "timed out" in _section(text, "slow")

    # through the CLI: --only runs the one script, the markdown is written, the exit status says it failed
    md = tmp_path / "c.md"
    rc = rb.main(["--only", "bench_bad.py", "--scripts-dir", str(scripts), "--bench-dir", str(bench),
                  "--out", str(md), "--docs-dir", str(tmp_path), "--timeout", "5"])
    assert rc == 1 and "boom: bad input" in md.read_text()
    assert rb.main(["--skip-run", "--bench-dir", str(bench), "--out", str(md), "--docs-dir", str(tmp_path)]) == 0
    assert "boom" not in md.read_text()
    with pytest.raises(SystemExit):
        rb.main(["--only", "nosuch", "--scripts-dir", str(scripts), "--out", str(md)])


def test_readme_summary_is_rewritten_between_its_markers(rb, tmp_path):
    """The README's benchmark table is generated from the same rows as docs/benchmarks.md, with links
    into it; a README without the markers is left as it is."""
    bench = tmp_path / "bench"
    bench.mkdir()
    _write(bench, "model", model_json(4.0, 1.2))
    docs = tmp_path / "docs"
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{rb.README_BEGIN}\nold table\n{rb.README_END}\n\nafter\n")
    text = rb.build_markdown(bench, docs / "benchmarks.md", docs, names=["model"], readme=readme)
    got = readme.read_text()
    assert "old table" not in got and got.startswith("# x\n\n") and got.endswith("\n\nafter\n")
    assert "[model: peak memory at 16K](docs/benchmarks.md#model)" in got
    rows = [ln for ln in got.splitlines() if ln.startswith("| [model")]
    assert [r.replace("docs/benchmarks.md#", "#") for r in rows] == \
        [ln for ln in text.splitlines() if ln.startswith("| [model")]
    plain = tmp_path / "PLAIN.md"
    plain.write_text("no markers\n")
    assert rb.update_readme(plain, [["[a](#a)", "1", "2", "yes"]], docs / "benchmarks.md") is False
    assert plain.read_text() == "no markers\n"


def _is_main_guard(node: ast.stmt) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
            and [c.value for c in node.test.comparators if isinstance(c, ast.Constant)] == ["__main__"])


def test_every_bench_script_exposes_its_report(rb, capfd):
    """Each scripts/bench_*.py has TITLE, MEASURES, DOCS, TARGETS and report(), and importing it (as
    the runner does for the page) runs nothing: its main() is called only under `__main__`."""
    import benchreport

    found = rb.discover()
    assert list(found)[:len(rb.ORDER)] == rb.ORDER
    for name, path in found.items():
        tree = ast.parse(path.read_text())
        guards = [n for n in tree.body if _is_main_guard(n)]
        assert len(guards) == 1, f"{path.name}: no `if __name__ == '__main__':` block"
        assert "main" in ast.unparse(guards[0]), path.name
        calls = [ast.unparse(n) for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
        assert all(c.startswith("sys.path.insert(") for c in calls), f"{path.name} calls at import: {calls}"
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), path.name

        t0 = time.perf_counter()
        bench = rb.load_bench(name, path)
        assert bench.error is None, f"{path.name}: {bench.error}"
        assert time.perf_counter() - t0 < 120, path.name  # an import, not a benchmark run
        assert isinstance(bench.title, str) and bench.title and bench.title != name, path.name
        assert isinstance(bench.measures, str) and bench.measures, path.name
        assert bench.docs and all(isinstance(d, str) and d.endswith(".md") for d in bench.docs), path.name
        assert bench.targets and all(isinstance(t, benchreport.Target) for t in bench.targets), path.name
        assert callable(bench.report), path.name
        mod = sys.modules[f"bench_{name}"]
        assert callable(mod.main) and mod.TARGETS == bench.targets, path.name
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)  # nothing ran


def test_broken_and_bare_scripts_and_order(rb, tmp_path):
    """A script that cannot be imported says so on the page and the others are still built; a script
    without report() gets the generic section; other scripts follow the known ones, by name."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "bench_infer.py").write_text((ROOT / "scripts" / "bench_infer.py").read_text())  # a real one
    for name in ("data", "model"):
        (scripts / f"bench_{name}.py").write_text("if __name__ == '__main__':\n    raise SystemExit('ran')\n")
    (scripts / "bench_broken.py").write_text("import no_such_module_for_this_test\n")
    (scripts / "bench_exits.py").write_text("import sys\nsys.exit(2)\n")
    (scripts / "bench_hf.py").write_text("TITLE = 'Hugging Face comparison'\n"
                                         "if __name__ == '__main__':\n    raise SystemExit('ran')\n")
    assert list(rb.discover(scripts)) == ["model", "infer", "data", "broken", "exits", "hf"]

    bench = tmp_path / "bench"
    _write(bench, "infer", INFER)
    _write(bench, "broken", {"x": 1})
    _write(bench, "hf", {"x": 1})
    _write(bench, "aaa", {"x": 1})  # a JSON without a script
    text = rb.build_markdown(bench, tmp_path / "b.md", tmp_path, scripts_dir=scripts)
    order = [ln.split('"')[1] for ln in text.splitlines() if ln.startswith('<a id="')]
    assert order == ["model", "infer", "data", "aaa", "broken", "exits", "hf"]
    broken = _section(text, "broken")
    assert ("_Not measured yet (formatter could not be loaded: ModuleNotFoundError: No module named "
            "'no_such_module_for_this_test'): run `python scripts/bench_broken.py`._") in broken
    assert "Data: [bench/broken.json]" in broken
    assert "formatter could not be loaded: SystemExit: 2" in _section(text, "exits")
    hf = _section(text, "hf")
    assert "## Hugging Face comparison (`scripts/bench_hf.py`)" in hf
    assert "No formatter for this benchmark yet; see the JSON." in hf
    assert "No formatter for this benchmark yet; see the JSON." in _section(text, "aaa")
    assert "| 1,024 |" in _section(text, "infer")  # the others are built as usual
    s = _summary(text)
    assert s["broken"][2] == "not measured yet" and s["hf"][2] == "n/a"


def test_gpu_check_section_survives_a_rebuild(rb, tmp_path):
    """scripts/gpu_check.py writes its own section of the page and JSON that is not a bench_*.py
    result: a rebuild keeps the section and makes no benchmark section of that JSON."""
    bench = tmp_path / "bench"
    _write(bench, "gpu_check", {"mode": "gpu", "parts": {}})
    _write(bench, "plan", {"results": [{"kind": "new", "seqlen": 1024, "cpu_s": 0.01, "plan_mib": 0.1,
                                        "peak_added_mib": 1.0},
                                       {"kind": "old", "seqlen": 1024, "cpu_s": 0.5, "plan_mib": 100.0,
                                        "peak_added_mib": 20.0}]})
    out = tmp_path / "benchmarks.md"
    out.write_text("stale page\n<!-- gpu-check:begin (written by scripts/gpu_check.py) -->\n## GPU check\n"
                   "H200 figures\n<!-- gpu-check:end -->\n")
    text = rb.build_markdown(bench, out, tmp_path)
    assert "stale page" not in text and text.count("## GPU check\nH200 figures\n<!-- gpu-check:end -->") == 1
    assert '<a id="gpu_check">' not in text and "bench_gpu_check" not in text
    assert _summary(text)["plan: tile plan build at 1M tokens (CPU)"][-1] == "yes"
    assert rb.build_markdown(bench, out, tmp_path).count("## GPU check") == 1  # kept once on every rebuild
