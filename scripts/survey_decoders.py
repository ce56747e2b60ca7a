"""Which damaged videos crash (or hang) a decoder: every file of the corpus in a child process.

    python scripts/survey_decoders.py                 # writes docs/data/decoder_survey.json, prints a table

The corpus (``material.corpus``): one small real encode per accepted container and codec,
damaged copies of each (truncated at several points, bytes flipped in the header, the middle and
the tail, zeroed or swapped halves, a huge declared frame size) and a few files that are no video.

decord: each file is opened in its own fresh process, by path and from bytes (``io.BytesIO``, as a
shard member is read), and taken through the calls a reader makes: ``VideoReader(...)``, ``len``,
``get_avg_fps``, ``vr[0]``, ``get_batch`` of 1 fps indices, ``get_frame_timestamp``, then every frame
in order. The child prints each call's name before making it, so a crash is pinned to the call.
PyAV: the project's reader (``probe_video`` then ``read_video(backend="pyav")``, from bytes) over
all files in one child, restarted after the file that killed it, if any does.

A child that dies by a signal is a *crash*; one that runs past ``--timeout`` is a *hang*. Children
run with an address-space limit (``--memory-gib``) so that a huge allocation fails instead of
taking the machine's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # test material: the corpus of real encodes

DECORD_CHILD = r"""
import io, sys
path, mode = sys.argv[1], sys.argv[2]
def stage(s):
    sys.stdout.write(s + "\n"); sys.stdout.flush()
stage("import")
import decord
import numpy as np
src = path if mode == "path" else io.BytesIO(open(path, "rb").read())
try:
    stage("VideoReader")
    vr = decord.VideoReader(src, ctx=decord.cpu(0), num_threads=0)
    stage("len")
    n = len(vr)
    stage("get_avg_fps")
    fps = vr.get_avg_fps()
    if n > 0:
        stage("vr[0]")
        vr[0]
        step = max(1, int(round(fps))) if fps and fps == fps and fps > 0 else 1
        idx = list(range(0, n, step))
        stage("get_batch")
        vr.get_batch(idx).asnumpy()
        stage("get_frame_timestamp")
        vr.get_frame_timestamp(idx)
        stage("every_frame")
        vr.seek(0)
        for i in range(n):
            vr.next()
except Exception as e:
    stage("error " + type(e).__name__ + ": " + str(e).splitlines()[0][:160] if str(e) else "error " + type(e).__name__)
    sys.exit(0)
stage("ok")
"""

PYAV_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
from longvideo.data.video import VideoError, probe_video, read_video
for path in sys.argv[2:]:
    sys.stdout.write("file " + path + "\n"); sys.stdout.flush()
    data = open(path, "rb").read()
    try:
        probe_video(data)
        clip = read_video(data, fps=1.0, backend="pyav")
        sys.stdout.write("ok %d\n" % len(clip))
    except VideoError as e:
        sys.stdout.write("error " + type(e).__name__ + "\n")
    except Exception as e:
        sys.stdout.write("other " + type(e).__name__ + ": " + str(e)[:160].replace("\n", " ") + "\n")
    sys.stdout.flush()
sys.stdout.write("end\n")
"""


def _limits(memory_gib: float):
    def apply():
        lim = int(memory_gib * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_child(args: list[str], timeout: float, memory_gib: float) -> tuple[str, list[str], float]:
    """(outcome, stdout lines, peak RSS MiB): outcome is 'exit N', 'signal NAME' or 'hang'."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                            preexec_fn=_limits(memory_gib))
    deadline = time.monotonic() + timeout
    status = rusage = None
    while True:
        pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            status, rusage = st, ru
            break
        if time.monotonic() > deadline:
            proc.kill()
            _, status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = 0
            out = proc.stdout.read().decode(errors="replace").splitlines()
            return "hang", out, rusage.ru_maxrss / 1024
        time.sleep(0.01)
    proc.returncode = 0  # reaped above
    out = proc.stdout.read().decode(errors="replace").splitlines()
    if os.WIFSIGNALED(status):
        outcome = f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    else:
        outcome = f"exit {os.WEXITSTATUS(status)}"
    return outcome, out, rusage.ru_maxrss / 1024


def build_corpus(folder: Path) -> list[dict]:
    from material.corpus import CONTAINERS, damaged, encode, not_videos

    files = []
    for enc in CONTAINERS:
        good = encode(enc)
        items = [("good", good)] + list(damaged(good, enc.ext))
        for name, data in items:
            p = folder / f"{enc.name}.{name}.{enc.ext}"
            p.write_bytes(data)
            files.append({"file": p.name, "container": enc.name, "codec": enc.codec, "damage": name,
                          "bytes": len(data), "path": str(p)})
    for name, ext, data in not_videos():
        p = folder / f"none.{name}.{ext}"
        p.write_bytes(data)
        files.append({"file": p.name, "container": "none", "codec": "-", "damage": name, "bytes": len(data),
                      "path": str(p)})
    return files


def survey_decord(files: list[dict], timeout: float, memory_gib: float) -> None:
    for i, f in enumerate(files):
        for mode in ("path", "bytes"):
            outcome, out, rss = run_child([sys.executable, "-c", DECORD_CHILD, f["path"], mode], timeout, memory_gib)
            last = out[-1] if out else ""
            if outcome.startswith("exit") and last == "ok":
                result = "ok"
            elif outcome.startswith("exit") and last.startswith("error"):
                result = "error"
            elif outcome.startswith("exit"):
                result = f"died ({outcome})"
            else:
                result = "crash" if outcome.startswith("signal") else "hang"
            stage = last if result in ("crash", "hang") or result.startswith("died") else ""
            f[f"decord_{mode}"] = {"result": result, "outcome": outcome, "call": stage,
                                   "detail": last if result == "error" else "", "peak_rss_mib": round(rss, 1)}
        print(f"[{i + 1}/{len(files)}] {f['file']}: decord path {f['decord_path']['result']} "
              f"{f['decord_path']['call']}, bytes {f['decord_bytes']['result']} {f['decord_bytes']['call']}",
              flush=True)


def survey_pyav(files: list[dict], timeout: float, memory_gib: float) -> None:
    todo = list(files)
    while todo:
        paths = [f["path"] for f in todo]
        outcome, out, _ = run_child([sys.executable, "-c", PYAV_CHILD, str(ROOT)] + paths,
                                    timeout * len(paths), memory_gib)
        results, current = {}, None
        for line in out:
            if line.startswith("file "):
                current = line[5:]
            elif current is not None and line != "end":
                results[current] = line
        done = 0
        for f in todo:
            if f["path"] in results:
                r = results[f["path"]]
                f["pyav"] = {"result": "ok" if r.startswith("ok") else "error" if r.startswith("error") else "other",
                             "detail": r}
                done += 1
            elif f["path"] == current:  # the file being read when the child died
                f["pyav"] = {"result": "crash" if outcome.startswith("signal") else "hang", "detail": outcome}
                done += 1
                break
            else:
                break
        todo = todo[done:]
        if out and out[-1] == "end":
            break


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per file before a child counts as hung")
    p.add_argument("--memory-gib", type=float, default=8.0, help="address-space limit of each child")
    p.add_argument("--out", default=str(ROOT / "docs" / "data" / "decoder_survey.json"))
    p.add_argument("--keep", default=None, help="keep the corpus files in this folder")
    a = p.parse_args(argv)
    import av
    import decord

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(a.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        files = build_corpus(folder)
        print(f"{len(files)} files", flush=True)
        t = time.time()
        survey_decord(files, a.timeout, a.memory_gib)
        survey_pyav(files, a.timeout, a.memory_gib)
        seconds = time.time() - t
    for f in files:
        f.pop("path")
    summary = {
        "decord_path": dict(Counter(f["decord_path"]["result"] for f in files)),
        "decord_bytes": dict(Counter(f["decord_bytes"]["result"] for f in files)),
        "pyav": dict(Counter(f.get("pyav", {}).get("result", "missing") for f in files)),
    }
    res = {"machine": {"platform": platform.platform(), "python": platform.python_version(),
                       "decord": decord.__version__, "av": av.__version__,
                       "ffmpeg": ".".join(map(str, av.library_versions.get("libavformat", ())))},
           "timeout_s": a.timeout, "memory_gib": a.memory_gib, "seconds": round(seconds, 1),
           "summary": summary, "files": files}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(report(res))
    return 0


def report(res: dict) -> str:
    """Markdown: the summary counts, then every file that crashed or hung a decoder."""
    lines = ["| reader | ok | error (skipped cleanly) | crash | hang |", "|---|---|---|---|---|"]
    for key, label in (("decord_path", "decord, by path"), ("decord_bytes", "decord, from bytes"),
                       ("pyav", "PyAV (project reader)")):
        c = res["summary"][key]
        lines.append(f"| {label} | {c.get('ok', 0)} | {c.get('error', 0)} | {c.get('crash', 0)} | {c.get('hang', 0)} |")
    lines += ["", "| file | bytes | decord by path | decord from bytes | PyAV |", "|---|---|---|---|---|"]
    for f in res["files"]:
        bad = [f["decord_path"]["result"], f["decord_bytes"]["result"], f.get("pyav", {}).get("result", "")]
        if any(r not in ("ok", "error") for r in bad):
            cells = []
            for key in ("decord_path", "decord_bytes"):
                d = f[key]
                cells.append(d["result"] if d["result"] in ("ok", "error")
                             else f"**{d['result']}** ({d['outcome']}) in `{d['call']}`")
            cells.append(f.get("pyav", {}).get("result", "-"))
            lines.append(f"| `{f['file']}` | {f['bytes']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
