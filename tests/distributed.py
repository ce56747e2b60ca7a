"""Run a function on W gloo ranks in spawned processes and fail the test if any rank fails.

    def body(rank, world, tmp):      # module-level, so it can be pickled
        ...assert...
    run_ranks(body, world=2, args=(tmp,))

Each rank gets torch.distributed initialised (gloo, file rendezvous) and torch threads capped at 1.
An exception or assertion in any rank is re-raised in the test with that rank's traceback; a rank
that hangs fails the test after `timeout` seconds instead of hanging the suite. A rank that
passed exits at once (os._exit(0)), skipping native teardown.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world, init_file, fn, args, errq, threads):
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(threads)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
        try:
            fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        errq.put((rank, traceback.format_exc()))
        raise SystemExit(1) from None
    # The rank passed and its process group is down. Leave without the interpreter's teardown:
    # native threads that gloo or DeepSpeed's CPU communication leave behind have aborted a rank
    # there now and then ("terminate called without an active exception", exit -6) after every
    # assertion had passed, failing a test whose body had succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world: int, args: tuple = (), timeout: float = 300.0, threads: int = 1) -> None:
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "rendezvous")
        procs = [
            ctx.Process(target=_worker, args=(r, world, init_file, fn, args, errq, threads))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = []
        while not errq.empty():
            errors.append(errq.get())
        if errors:
            rank, tb = sorted(errors)[0]
            raise AssertionError(f"rank {rank} of {world} failed:\n{tb}")
        if hung:
            raise AssertionError(f"ranks {hung} of {world} did not finish within {timeout} s")
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise AssertionError(f"ranks exited with non-zero codes: {bad}")


def chat_lines(ckpt: str, clip: str, question: str, max_new_tokens: int = 8) -> list[str]:
    """What `longvideo chat --quiet` prints on this rank for one question about `clip` (CPU); the
    command's return code must be 0. Rank bodies compare it with one process's answer."""
    import contextlib
    import io

    from longvideo.infer import cli

    argv = ["--model", ckpt, "--video", clip, "--question", question, "--quiet"]
    argv += ["--device", "cpu", "--max-new-tokens", str(max_new_tokens)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli._chat(cli.chat_parser().parse_args(argv))
    assert rc == 0, f"longvideo chat returned {rc}"
    return buf.getvalue().splitlines()
