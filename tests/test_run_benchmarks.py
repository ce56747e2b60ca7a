"""scripts/run_benchmarks.py: the pages built from fabricated JSON by each script's report() (figures
computed here by hand), "not measured yet" with the reason for missing or malformed files and for a
script that cannot be imported, the demos' blocks from a summary.json, the runner's handling of
scripts that fail or run past the timeout, and every committed result still rendering."""

from __future__ import annotations

import ast
import io
import json
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _write(d: Path, name: str, obj) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.json").write_text(obj if isinstance(obj, str) else json.dumps(obj))


def _summary(text: str) -> dict[str, list[str]]:
    """{target: [measured, goal, met]} from the first table of a page."""
    rows = {}
    for line in text.split("\n## ")[0].splitlines():
        if line.startswith("| ["):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0].split("](")[0][1:]] = cells[1:]
    return rows


def _section(text: str, name: str) -> str:
    return text.split(f'<a id="{name}"></a>')[1].split("<a id=")[0]


def _sys(name, ranks, ctx, tps=100.0):
    return {
        "system": name,
        "ranks": ranks,
        "seqs": [1024, 2048],
        "peak_mib_per_rank": [100.0, 150.0],
        "fit": {"coef": [50.0, 0.05], "form": "a + b S", "kib_per_token": 51.2},
        "context_at_budget": ctx,
        "throughput": {"seq": 2048, "step_s": 1.0, "tokens_per_s": tps},
    }


CONTEXT = {
    "parts": [
        {
            "label": "tiny, 4 layers",
            "model": "tiny",
            "budget_gb": 16.0,
            "machine": {"cores": 2, "loadavg": [1.0, 1, 1]},
            "systems": [
                _sys("transformers eager", 1, 1000.0),
                _sys("transformers sdpa", 1, 4000.0),
                _sys("ours sp=1", 1, 32000.0),
                _sys("ours sp=2", 2, 60000.0),
                _sys("ours sp=4", 4, 100000.0),
            ],
        },
        {
            "label": "smol",
            "model": "smol",
            "budget_gb": 4.0,
            "hf_checkpointing": True,
            "systems": [
                _sys("transformers sdpa", 1, 4000.0),
                _sys("transformers ring W=2", 2, 8000.0),
                _sys("transformers ring W=4", 4, 14000.0),
            ],
        },
    ]
}
INFER = {
    "lengths": [1024, 2048],
    "kv_cache_bytes": [2 * 2**20, 4 * 2**20],
    "config": {
        "dim": 64,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "chunk": 256,
        "backend": "cpu",
        "dtype": "float32",
    },
    "machine": {"cpus": 2, "loadavg_before": [1.0, 1.0, 1.0]},
    "modes": {
        "one_shot": [{"ttft_s": 1.0, "peak_mb": 10.0}, {"ttft_s": 2.0, "peak_mb": 40.0}],
        "chunked": [{"ttft_s": 1.5, "peak_mb": 5.0}, {"ttft_s": 2.5, "peak_mb": 10.0}],
        "sp2": [{"ttft_s": 0.8, "peak_mb": 6.0}, {"ttft_s": 1.5, "peak_mb": 20.0}],
    },
    "same_tokens_all_modes": [True, False],
}
VQ = {
    "machine": {"cpu_count": 2},
    "throughput": [
        {
            "name": "tiny",
            "mode": "2d",
            "resolution": 32,
            "codes_per_group": 16,
            "codebook_size": 1024,
            "params_M": 0.5,
            "encode_fps": 250.0,
            "decode_fps": 200.0,
            "tokens_per_hour_1fps": 57600,
        }
    ],
    "training": [
        {
            "name": "tiny",
            "train_seconds": 180.2,
            "steps": 400,
            "psnr": 24.31,
            "usage": 0.875,
            "psnr_untrained": 9.5,
            "thumbnail_psnr": {"8x8": 20.04, "16x16": 23.96},
        }
    ],
}
DATA = {
    "machine": {"cpu_count": 2},
    "video": {
        "minutes": 60,
        "size": 256,
        "src_fps": 8,
        "default_backend": "pyav",
        "runs": [
            {
                "gop_seconds": 2.0,
                "file_mb": 19.5,
                "pyav_decode_all": {"seconds": 20.0, "correct": True},
                "project_pyav": {"seconds": 10.0, "correct": True},
                "project_decord": {"seconds": 40.0, "correct": True},
            }
        ],
    },
    "loader": {"tokens_per_s": 10000.0, "seq_len": 16384, "padding_fraction": 0.05},
    "train_step_cpu": {"model": "small", "seq_len": 1024, "tokens_per_s": 100.0},
    "train_step_7b_h200": {
        "model": "7B",
        "seq_len": 32768,
        "mfu": 0.4,
        "tokens_per_s_per_gpu": 5000.0,
    },
}


def test_pages_from_fabricated_results(rb, tmp_path):
    bench = tmp_path / "bench"
    for name, obj in (("context", CONTEXT), ("infer", INFER), ("vq", VQ), ("data", DATA)):
        _write(bench, name, obj)
    (bench / "infer.png").write_bytes(b"\x89PNG")
    pages, blocks = rb.render(bench, tmp_path)
    text, s = pages["benchmarks.md"], _summary(pages["benchmarks.md"])
    # context: sp=2 60000 / (2 x 32000) = 0.94, sp=4 100000 / (4 x 32000) = 0.78 < 0.9; ours / sdpa 32000 / 4000
    # = 8x < 16x; / eager 32x; ring W=2 8000 / (2 x 4000) = 1.00, W=4 14000 / (4 x 4000) = 0.88 < 0.9
    assert s["context (tiny, 4 layers): our sp=W / (W x our sp=1)"] == [
        "W=2: 0.94 (58.6K); W=4: 0.78 (97.7K)",
        ">= 0.9",
        "**no**",
    ]
    assert s["context (tiny, 4 layers): our sp=1 vs transformers (sdpa)"][0::2] == [
        "8.0x (31.2K vs 3.9K tokens)",
        "**no**",
    ]
    assert s["context (tiny, 4 layers): our sp=1 vs transformers (eager)"][2] == "yes"
    assert s["context (smol): transformers + our ring at W / (W x sdpa)"][0::2] == [
        "W=2: 1.00 (7.8K); W=4: 0.88 (13.7K)",
        "**no**",
    ]
    assert "| ours sp=2 | 2 | 1,024: 100; 2,048: 150 | 51.2 | 58.6K | 100 |" in _section(
        text, "context"
    )
    infer = _section(
        text, "infer"
    )  # chunked 10 / 40 MiB = 0.25x, sp2 20 / 40 = 0.50x of one-shot's peak
    assert (
        "| 2,048 | 4 | 2.00 s / 40.0 MiB | 2.50 s / 10.0 MiB (0.25x) | 1.50 s / 20.0 MiB (0.50x) |"
        in infer
    )
    assert "**The modes generated different tokens** at lengths [2048]." in infer
    assert "![Inference: time to first token and memory vs context](bench/infer.png)" in infer
    assert "Machine: 2-core CPU; load average (1/5/15 min) 1.0/1.0/1.0 (before)." in infer
    vq = _section(text, "vq")
    assert "| `tiny` | synthetic | 180 | 400 | 9.5 -> 24.3 | 20.0 / 24.0 | 87.5 % |" in vq
    assert (
        s["vq: throughput and held-out quality after training"][0]
        == "`tiny` 250 frames/s, PSNR 24.3 dB synthetic"
    )
    # data: 20 s / 10 s = 2.00x (pyav, the default), 20 / 40 = 0.50x; the loader's 10,000 tokens/s against the
    # slower consumer (100 tokens/s: 100x) and the faster (5,000: 2x), judged on the faster
    assert s["data: 1 fps sampling from an hour of video"][0::2] == [
        "`read_video` PyAV (default) 2.00x, `read_video` decord (child process) 0.50x",
        "default (pyav): yes",
    ]
    assert s["data: loader tokens/s"][0].startswith(
        "10,000 tokens/s = 2x the estimated tokens/s of a 7B step"
    )
    assert "| small train step on this CPU, seq 1,024 (measured) | 100 | 100x |" in _section(
        text, "data"
    )
    # the README's headline table: each benchmark's first target, linked into docs/benchmarks.md
    assert [ln.split("](")[0] for ln in blocks["benchmarks"].splitlines()[2:]] == [
        "| [context (tiny, 4 layers): our sp=W / (W x our sp=1)",
        "| [ring: per-rank activation memory",
        "| [infer: TTFT and peak memory vs context",
        "| [vq: throughput and held-out quality after training",
        "| [data: 1 fps sampling from an hour of video",
        "| [generate: cost per token, 16 frames / 1 frame (KV cache, guidance)",
        "| [hybrid: bytes per rank, U = 2 x ring 2 / ring of 4",
        "| [mcq: 1,000 questions over 1-minute videos",
        "| [serve: follow-up / first question, 10-minute video",
        "| [serve: latency with 200 slow-header connections / quiet server",
        "| [gpu-check",
    ]
    assert "(docs/benchmarks.md#infer)" in blocks["benchmarks"]
    assert "_Not measured yet (no ring.json): run `python scripts/bench_ring.py`._" in _section(
        text, "ring"
    )


def test_missing_and_malformed_json(rb, tmp_path):
    bench = tmp_path / "bench"
    _write(bench, "data", {"video": {"runs": "nonsense"}})
    _write(bench, "ring", "{not json")
    _write(bench, "context", [1, 2, 3])
    _write(bench, "infer", {"lengths": [1024], "modes": {"one_shot": [{"ttft_s": 1.0}]}})
    pages, _ = rb.render(bench, tmp_path)
    text = pages["benchmarks.md"]
    for name in rb.ORDER:
        sec = _section(text, name)
        assert "_Not measured yet (" in sec and f"run `python scripts/bench_{name}.py`._" in sec, (
            name
        )
        assert "|---|" not in sec, name
    assert "data.json has a layout its report does not read" in _section(text, "data")
    assert "ring.json is not readable JSON" in _section(text, "ring")
    assert "context.json is not a JSON object" in _section(text, "context")
    assert "no vq.json" in _section(text, "vq")
    rows = _summary(text)
    assert len(rows) == sum(len(rb.load_bench(n, p).TARGETS) for n, p in rb.discover().items())
    assert all(row[2] == "not measured yet" for row in rows.values())
    assert (
        "| [gpu-check](benchmarks.md#gpu-check) | - | see its section | not measured yet |"
        in pages["results.md"]
    )


def _summary_json(seconds=1764.0):
    return {
        "plan": {},
        "seconds": seconds,
        "stage_seconds": {"vq": 222.0, "lm": 1104.0},
        "machine": {
            "cpu": "AMD EPYC",
            "vector": ["avx2"],
            "cores": 2,
            "matmul_gflops": 66.2,
            "loadavg": [0.5, 1, 1],
        },
        "qa": {
            "accuracy": 0.9,
            "chance": 0.29,
            "per_question": {"What shape came first?": {"accuracy": 0.828, "chance": 1 / 3}},
        },
        "video_niah": {
            "accuracy": 0.989,
            "chance": 0.25,
            "lengths": [8, 40],
            "grid": [[1.0, 0.95], [1.0, 0.99]],
        },
    }


def test_demo_blocks_from_a_summary(rb, tmp_path):
    bench = tmp_path / "bench"
    _write(bench, "demo", _summary_json())  # and no demo-hour.json
    _write(
        bench,
        "suite-check",
        {
            "seconds": 183.0,
            "tests": {"passed": 1234, "skipped": 2},
            "machine": _summary_json()["machine"],
        },
    )  # as tests/conftest.py writes it
    blocks = rb.demo_blocks(bench)
    assert blocks["demo-times"].splitlines()[2:] == [
        "| `make demo` | 29.4 min | AMD EPYC (avx2), 2 cores, float32 matmul 66.2 GFLOP/s, load 0.5 |",
        "| `make demo-hour` | not measured yet (no demo-hour.json) | - |",
        "| `make test` | not measured yet (no suite-test.json) | - |",
        "| `make check` | 3.0 min (1,234 tests passed) | AMD EPYC (avx2), 2 cores, float32 matmul 66.2 GFLOP/s, load 0.5 |",
    ]
    results = blocks["demo-results"].splitlines()[2:]
    assert results == [
        "| video needle, every length and depth | 98.9 % | not measured yet | 25.0 % |",
        "| video needle, the longest videos | 97.0 % (40 frames) | not measured yet | 25.0 % |",
        '| QA: "What shape came first?" | 82.8 % | not measured yet | 33.3 % |',
    ]
    # a needle grid run with the control: the reads of the decidable, all and at the longest
    controlled = _summary_json()
    controlled["video_niah"]["misses"] = {
        "8": {"wrong": 0, "read": 12, "defaults": 3, "decidable": 12},
        "40": {"wrong": 1, "read": 9, "defaults": 4, "decidable": 10},
    }
    _write(bench, "demo", controlled)
    assert rb.demo_blocks(bench)["demo-results"].splitlines()[4] == (
        "| video needle, read (the answer is not the bare background's), of the decidable: "
        "all · the longest | 21 of 22 · 9 of 10 | not measured yet | - |"
    )
    # a demo that also generates videos: its colours-in-order figure, with its chance
    _write(
        bench, "demo", {**_summary_json(), "t2v": {"accuracy": 0.8125, "chance": 0.035, "n": 48}}
    )
    assert rb.demo_blocks(bench)["demo-results"].splitlines()[-1] == (
        "| text to video: the captioned colours in order | 81.2 % | not measured yet | 3.5 % |"
    )
    _write(bench, "demo", "{broken")
    assert (
        "not measured yet (demo.json is not readable JSON: JSONDecodeError)"
        in rb.demo_blocks(bench)["demo-times"]
    )


def test_blocks_are_rewritten_between_their_markers(rb, tmp_path):
    bench = tmp_path / "bench"
    _write(bench, "demo", _summary_json())
    readme = tmp_path / "README.md"
    readme.write_text(
        "# x\n\n<!-- demo-times:begin (generated) -->\nold\n<!-- demo-times:end -->\nafter 29.4 min\n"
    )
    assert (
        rb.main(
            [
                "--skip-run",
                "--bench-dir",
                str(bench),
                "--docs-dir",
                str(tmp_path),
                "--readme",
                str(readme),
            ]
        )
        == 0
    )
    got = readme.read_text()
    assert (
        got.startswith("# x\n\n<!-- demo-times:begin (generated) -->\n| command |")
        and "old" not in got
    )
    assert got.endswith(
        "| 29.4 min | AMD EPYC (avx2), 2 cores, float32 matmul 66.2 GFLOP/s, load 0.5 |\n"
        "| `make demo-hour` | not measured yet (no demo-hour.json) | - |\n"
        "| `make test` | not measured yet (no suite-test.json) | - |\n"
        "| `make check` | not measured yet (no suite-check.json) | - |\n<!-- demo-times:end -->\n"
        "after 29.4 min\n"
    )
    assert (tmp_path / "results.md").read_text().count("| `make demo` | 29.4 min |") == 1
    with pytest.raises(ValueError, match="no generated block named 'nosuch'"):
        rb.fill_blocks("<!-- nosuch:begin -->\nx\n<!-- nosuch:end -->", {"benchmarks": ""})


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_runner_reports_failures_and_timeouts(rb, tmp_path, capfd):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "bench_ok.py").write_text("if __name__ == '__main__':\n    print('hello from ok')\n")
    (scripts / "bench_bad.py").write_text(
        "import sys\nif __name__ == '__main__':\n    print('boom: bad input', file=sys.stderr)\n    sys.exit(3)\n"
    )
    pidfile = tmp_path / "child.pid"
    (scripts / "bench_slow.py").write_text(
        "import subprocess, sys, time\nif __name__ == '__main__':\n"
        f"    p = subprocess.Popen(['sleep', '60'])\n    open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "    print('slow started', file=sys.stderr, flush=True)\n    time.sleep(60)\n"
    )
    found = rb.discover(scripts)
    assert list(found) == ["bad", "ok", "slow"]
    err = io.BytesIO()
    t0 = time.perf_counter()
    runs = rb.run_all(found, timeout=3, cwd=tmp_path, err=err)
    assert time.perf_counter() - t0 < 30
    assert [runs[n].status for n in ("bad", "ok", "slow")] == ["failed", "ok", "timeout"]
    assert runs["bad"].returncode == 3 and "boom: bad input" in runs["bad"].stderr_tail
    assert "slow started" in runs["slow"].stderr_tail and "timeout" in runs["slow"].stderr_tail
    assert "hello from ok" in capfd.readouterr().out and b"boom: bad input" in err.getvalue()
    # the whole process group went, what the script spawned too (a killed process can show in
    # /proc for a moment after the signal on a busy machine: wait for it, a few seconds at most)
    child, deadline = int(pidfile.read_text()), time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)

    bench = tmp_path / "bench"
    _write(bench, "infer", INFER)
    pages, blocks = rb.render(
        bench, tmp_path, runs={"infer": rb.RunResult("infer", "failed", 3, 1.0, "boom"), **runs}
    )
    sec = _section(pages["benchmarks.md"], "infer")
    assert (
        "failed (exit 3)" in sec and "boom" in sec and "already there" in sec and "| 1,024 |" in sec
    )
    assert (
        _summary(pages["benchmarks.md"])["infer: TTFT and peak memory vs context"][2]
        == "n/a (last run failed)"
    )
    assert (
        "last run" not in blocks["benchmarks"] + pages["results.md"]
    )  # those come from the JSON alone
    # through the CLI: --only runs the one script, the page says it failed, the exit status too
    md, docs = (
        tmp_path / "benchmarks.md",
        ["--docs-dir", str(tmp_path), "--readme", str(tmp_path / "none.md")],
    )
    assert (
        rb.main(
            [
                "--only",
                "bench_bad.py",
                "--scripts-dir",
                str(scripts),
                "--bench-dir",
                str(bench),
                *docs,
                "--timeout",
                "5",
            ]
        )
        == 1
    )
    assert "boom: bad input" in md.read_text()
    assert (
        rb.main(["--skip-run", "--bench-dir", str(bench), *docs]) == 0
        and "boom" not in md.read_text()
    )
    with pytest.raises(SystemExit):
        rb.main(["--only", "nosuch", "--scripts-dir", str(scripts), *docs])


def test_broken_and_bare_scripts_and_kept_gpu_section(rb, tmp_path):
    scripts, bench = tmp_path / "scripts", tmp_path / "bench"
    scripts.mkdir()
    (scripts / "bench_infer.py").write_text((ROOT / "scripts" / "bench_infer.py").read_text())
    (scripts / "bench_broken.py").write_text("import no_such_module_for_this_test\n")
    (scripts / "bench_exits.py").write_text("import sys\nsys.exit(2)\n")
    (scripts / "bench_bare.py").write_text(
        "TITLE = 'Bare'\nif __name__ == '__main__':\n    raise SystemExit('ran')\n"
    )
    assert list(rb.discover(scripts)) == ["infer", "bare", "broken", "exits"]
    for name, obj in (
        ("infer", INFER),
        ("broken", {"x": 1}),
        ("bare", {"x": 1}),
        ("aaa", {"x": 1}),
        (
            "gpu_check",
            {"targets": [{"target": "t", "goal": "g", "measured": "1.1x", "met": "yes"}]},
        ),
    ):
        _write(bench, name, obj)
    (tmp_path / "benchmarks.md").write_text(
        "stale\n<!-- gpu-check:begin (gpu_check.py) -->\n## GPU check\nH200\n"
        "<!-- gpu-check:end -->\n"
    )
    pages, blocks = rb.render(bench, tmp_path, scripts)
    text = pages["benchmarks.md"]
    assert [ln.split('"')[1] for ln in text.splitlines() if ln.startswith('<a id="')] == [
        "infer",
        "bare",
        "broken",
        "exits",
        "aaa",
    ]
    assert (
        "_Not measured yet (its script could not be loaded: ModuleNotFoundError: No module named "
        "'no_such_module_for_this_test'): run `python scripts/bench_broken.py`._"
    ) in _section(text, "broken")
    assert "could not be loaded: SystemExit: 2" in _section(text, "exits")
    assert (
        "## Bare (`scripts/bench_bare.py`)" in text
        and "No report for this benchmark yet" in _section(text, "aaa")
    )
    assert "| 1,024 |" in _section(text, "infer")
    assert "stale" not in text and text.count("## GPU check\nH200\n<!-- gpu-check:end -->") == 1
    assert (
        "| [gpu-check: t](docs/benchmarks.md#gpu-check) | 1.1x | g | yes |" in blocks["benchmarks"]
    )


def _is_main_guard(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and ast.unparse(node.test) in ("__name__ == '__main__'", '__name__ == "__main__"')
    )


def test_every_script_keeps_the_contract_and_renders_its_committed_result(rb, capfd):
    """Each scripts/bench_*.py has a docstring, TITLE, DOCS, TARGETS and report(); importing it runs
    nothing (main() only under __main__); and its report reads the JSON committed under docs/bench/."""
    import benchreport

    found = rb.discover()
    assert list(found)[: len(rb.ORDER)] == rb.ORDER
    for name, path in found.items():
        tree = ast.parse(path.read_text())
        assert [n for n in tree.body if _is_main_guard(n)], (
            f"{path.name}: no `if __name__ == '__main__':` block"
        )
        calls = [
            ast.unparse(n)
            for n in tree.body
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
        ]
        assert all(c.startswith("sys.path.insert(") for c in calls), (
            f"{path.name} calls at import: {calls}"
        )
        mod = rb.load_bench(name, path)
        assert not isinstance(mod, str), f"{path.name}: {mod}"
        assert (
            mod.TITLE
            and rb.Result(name, mod, None, None, None).measures()
            and mod.TARGETS
            and callable(mod.report)
        ), path.name
        assert all(isinstance(t, benchreport.Target) for t in mod.TARGETS), path.name
        assert mod.DOCS and all((ROOT / "docs" / d).exists() for d in mod.DOCS), path.name
        if (ROOT / "docs" / "bench" / f"{name}.json").exists():
            r = rb.read_result(name, mod, ROOT / "docs" / "bench")
            assert r.why is None and r.section.targets, f"{name}.json: {r.why}"
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)


def test_a_scripts_json_keeps_its_settings_but_not_where_it_was_written(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import benchreport

    p = benchreport.arg_parser("A bench.", "ring")
    p.add_argument("--seq", type=int, default=16)
    args = p.parse_args(["--out", "/somewhere/on/this/machine/ring.json", "--seq", "64"])
    assert benchreport.settings(args) == {"seq": 64}
