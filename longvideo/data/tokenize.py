"""``longvideo tokenize``: raw shards (video + json) -> token shards (VQ codes + timestamps + json).

Each input shard becomes one output shard of the same name, written atomically (a rerun skips
finished ones), by worker processes that each hold one VQ. A worker killed on a sample (a segfault,
the OOM killer) costs that sample only. What is skipped, kept partly and counted where:
docs/data.md, "Commands", "Partial videos" and "Untrusted shards".
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path

import torch
from tqdm import tqdm

from longvideo.atomic import TMP_PREFIX, write_json_atomic
from longvideo.data.codes import video_to_codes
from longvideo.data.shards import (
    VIDEO_EXTS,
    ShardWriter,
    SkipStats,
    group_samples,
    index_tar,
    iter_raw_samples,
    token_sample_members,
)
from longvideo.data.streams import expand_sources, is_url, shard_name
from longvideo.data.video import VideoError
from longvideo.vq.model import load_vq

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenizeOptions:
    """How ``tokenize`` reads and encodes videos (``--config`` takes them from ``data`` and ``infer``)."""

    fps: float = 1.0  # frames per second sampled from each video
    max_frames: int | None = 3600  # most frames per video (uniform sampling when the cap binds)
    max_resolution: int = 4096  # longest frame side accepted
    batch_frames: int = 16  # frames the VQ encodes at once
    backend: str = "auto"  # auto (= pyav, in this process), pyav, or decord (in a child process)
    partial_videos: str = (
        "keep"  # keep what was read of a partial video (see min_partial_fraction), or skip
    )
    min_partial_fraction: float = 0.5  # least share of a partial video read for it to be kept


OUTCOMES = ("ok", "truncated", "gaps")
"""Samples written: whole, cut short (kept), with frames lost inside (kept). With the skip reasons
they sum to the samples read."""
MEASURES = ("seconds_kept", "seconds_declared", "seconds_lost", "segments_dropped", "qa_dropped")
"""Amounts over the partial samples (not samples): seconds read and declared of the truncated
ones (kept or skipped), seconds lost in gaps, segments and QA pairs dropped past an end."""
_TIMES = ("time", "start", "end", "timestamp")


def trim_meta(meta: dict, end: float) -> tuple[dict, dict]:
    """The json without the segments and QA pairs timed past ``end`` seconds (the part of a cut
    video that was not read), and how many of each were dropped."""
    out, dropped = dict(meta), {}
    for key, counter in (("segments", "segments_dropped"), ("qa", "qa_dropped")):
        items = meta.get(key)
        if isinstance(items, list):
            kept = [
                x
                for x in items
                if not any(isinstance(x.get(k), (int, float)) and x[k] > end + 1e-3 for k in _TIMES)
            ]
            out[key], dropped[counter] = kept, len(items) - len(kept)
    return out, dropped


class _StreamFailed(Exception):
    """The shard's source failed part-way: its output is not kept, so a rerun reads it again."""


def tokenize_shard(
    vq,
    src: str,
    dst: str,
    opts: TokenizeOptions,
    progress=None,
    *,
    skip: dict[int, str] | None = None,
    on_sample: Callable[[int, str], None] | None = None,
) -> dict:
    """Tokenize one raw shard (a path or URL) into ``dst`` (atomically). Returns its counts.

    When the source fails part-way (``shard_io_error``, e.g. a dropped connection) no output is
    written, so that a rerun tokenizes the shard again. ``on_sample(n, key)`` is called before the
    n-th sample (0-based, in the shard's order) is handled, ``progress(1)`` after it; the samples
    numbered in ``skip`` are counted as ``worker_crash`` with their message and not decoded (a
    worker died on them: see :func:`tokenize_shards`).
    """
    stats = SkipStats()
    t0 = time.time()
    skip = skip or {}
    try:
        with ShardWriter(dst) as writer:
            for n, sample in enumerate(iter_raw_samples(src, stats)):
                if on_sample is not None:
                    on_sample(n, sample.key)
                if n in skip:
                    stats.skip("worker_crash", f"{src}:{sample.key}", skip[n])
                    if progress is not None:
                        progress(1)
                    continue
                try:
                    vc = video_to_codes(
                        vq,
                        sample.video,
                        fps=opts.fps,
                        max_frames=opts.max_frames,
                        max_resolution=opts.max_resolution,
                        batch_frames=opts.batch_frames,
                        backend=opts.backend,
                    )
                except VideoError as e:
                    stats.skip(
                        e.reason, f"{src}:{sample.key}", str(e)
                    )  # video_corrupt, ..., decoder_crash
                else:
                    _write(writer, stats, sample, vc, vq, opts, f"{src}:{sample.key}")
                if progress is not None:
                    progress(1)
            if stats["shard_io_error"]:
                raise _StreamFailed(src)
    except _StreamFailed:
        pass
    out = {**stats, "seconds": round(time.time() - t0, 3)}
    write_json_atomic(stats_path(dst), out)
    return out


def _write(writer, stats: SkipStats, sample, vc, vq, opts: TokenizeOptions, where: str) -> None:
    """Write one encoded sample, or skip it as the partial-video policy says; count it either way."""
    rep, meta = vc.report, dict(sample.meta)
    lost = rep.describe()
    if rep.truncated:
        stats["seconds_kept"] += round(rep.duration, 3)
        stats["seconds_declared"] += round(rep.declared, 3)
    if rep.gaps:
        stats["seconds_lost"] += round(rep.lost_seconds, 3)
    if lost and (opts.partial_videos == "skip" or rep.fraction < opts.min_partial_fraction):
        why = f"{lost} ({rep.fraction:.0%} read; partial_videos={opts.partial_videos}, "
        stats.skip(
            "video_truncated", where, why + f"min_partial_fraction={opts.min_partial_fraction})"
        )
        return
    meta["tokenized"] = {
        "num_frames": vc.num_frames,
        "num_groups": int(vc.codes.shape[0]),
        "sample_fps": opts.fps,
        "video_ext": sample.video_ext,
        "vq_mode": vq.cfg.mode,
        "vq_resolution": vq.cfg.resolution,
    }
    if lost:
        meta, dropped = trim_meta(meta, rep.duration) if rep.truncated else (meta, {})
        stats.update(dropped)
        gaps = [[round(a, 3), round(b, 3)] for a, b in rep.gaps]
        meta["tokenized"]["partial"] = {
            "seconds_kept": round(rep.duration, 3),
            "seconds_declared": rep.declared,
            "gaps": gaps,
            **dropped,
        }
        log.warning("kept %s partly: %s", where, lost)
    members = token_sample_members(sample.key, vc.codes, vc.timestamps, meta)
    key = sample.key.replace("/", "_")
    if key.startswith("."):  # would read back with an empty key ('dir/.x' gives '._x')
        stats.skip("empty_key", where, f"the output name {key!r} would have no key")
        return
    writer.write(key, members)
    stats["truncated" if rep.truncated else "gaps" if rep.gaps else "ok"] += 1


def stats_path(shard: str | os.PathLike) -> Path:
    return Path(shard).with_name(Path(shard).name.removesuffix(".tar") + ".stats.json")


def _count_samples(path: str) -> int:
    if is_url(path):
        return 0  # counting would mean reading the whole stream
    try:
        return len(group_samples(index_tar(path), VIDEO_EXTS + ("json",)))
    except Exception:
        return 0


def _skipped(counts) -> int:
    kept = OUTCOMES + MEASURES + ("shards_done", "shards_skipped", "shards_failed")
    return sum(v for k, v in counts.items() if k not in kept)


def _worker_main(conn, vq_dir: str, threads: int) -> None:
    """A tokenize worker process: loads the VQ once, then tokenizes the shards it is sent
    (``(src, dst, opts, skip)``; None ends it), telling the parent over ``conn`` which sample it
    starts and finishes, so that a worker killed on a sample costs that sample only."""
    try:
        torch.set_num_threads(max(1, threads))
        vq = load_vq(vq_dir)
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops the run
        conn.send(("fatal", traceback.format_exc()))
        return
    conn.send(("ready",))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        src, dst, opts, skip = job
        try:
            res = tokenize_shard(
                vq,
                src,
                dst,
                opts,
                progress=lambda n: conn.send(("sample_done",)),
                skip=skip,
                on_sample=lambda n, key: conn.send(("sample", n, key)),
            )
        except BaseException:  # noqa: BLE001 - a bug, not a bad sample: the parent stops the run
            conn.send(("error", traceback.format_exc()))
            return
        conn.send(("result", res))


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = {"SIGKILL": ", as the OOM killer does", "SIGSEGV": ": a segfault"}.get(name, "")
        return f"killed by {name}{hint}"
    return f"exit status {code}"


@dataclass
class _Job:
    src: str
    dst: str
    opts: TokenizeOptions
    skip: dict[int, str] = field(default_factory=dict)  # samples a worker died on
    blind_deaths: int = 0  # worker deaths outside any sample
    reported: int = -1  # the newest sample counted on the progress bar


class _Slot:
    """One worker process as the parent sees it: its pipe, its job and the sample it is on."""

    def __init__(self, ctx, vq_dir: str, threads: int):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, vq_dir, threads), daemon=True)
        self.proc.start()
        child.close()
        self.ready, self.job, self.sample = False, None, None

    def give(self, job: _Job) -> None:
        self.job, self.sample = job, None
        self.conn.send((job.src, job.dst, job.opts, dict(job.skip)))

    def stop(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self.conn.send(None)
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


MAX_START_FAILURES = 3
"""Workers that may die before loading the VQ, in a row, before ``tokenize`` gives up."""


def _remove_partial(dst: str) -> None:
    """The temporary files a killed writer left beside ``dst`` and its stats (longvideo.atomic)."""
    for name in (Path(dst).name, stats_path(dst).name):
        for tmp in Path(dst).parent.glob(f"{TMP_PREFIX}{name}.*"):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _run_workers(vq_dir, jobs, workers, threads, done_shard, bar) -> None:
    """Tokenize ``jobs`` in ``workers`` processes. A worker that dies (a segfault, the OOM killer)
    while encoding a sample costs that sample: it is counted under ``worker_crash`` and its shard
    is tokenized again without it by a fresh worker; a worker that dies outside any sample costs
    its shard one more try, then the shard (``shards_failed``, no output: a rerun tries again)."""
    ctx = mp.get_context("spawn")
    pending = deque(_Job(*j) for j in jobs)
    slots = [_Slot(ctx, vq_dir, threads) for _ in range(workers)]
    start_failures = 0
    try:
        while pending or any(w.job is not None for w in slots):
            for w in slots:
                if w.ready and w.job is None and pending:
                    w.give(pending.popleft())
            wait([w.conn for w in slots] + [w.proc.sentinel for w in slots], timeout=1.0)
            for i, w in enumerate(slots):
                alive = True
                try:
                    while w.conn.poll():
                        _message(w, w.conn.recv(), done_shard, bar)
                except (EOFError, OSError, pickle.UnpicklingError):
                    alive = False  # the pipe closed, or a message was cut short: it died
                if alive and w.proc.is_alive():
                    continue
                w.proc.join(timeout=10)
                how = _death(w.proc.exitcode)
                job, started = w.job, w.ready
                w.conn.close()
                slots[i] = _Slot(ctx, vq_dir, threads)
                if job is None:
                    start_failures = 0 if started else start_failures + 1
                    if start_failures >= MAX_START_FAILURES:
                        raise RuntimeError(f"tokenize workers die before starting ({how})")
                    continue
                _remove_partial(job.dst)
                if w.sample is not None:
                    n, key = w.sample
                    job.skip[n] = f"the tokenize worker died ({how}) while encoding it"
                    log.error("a tokenize worker died (%s) on %s:%s", how, job.src, key)
                    pending.appendleft(job)
                elif job.blind_deaths == 0:
                    job.blind_deaths += 1
                    log.error("a tokenize worker died (%s) on %s; retrying it", how, job.src)
                    pending.appendleft(job)
                else:
                    log.error("tokenize workers died twice (%s) on %s: not kept", how, job.src)
                    done_shard({"worker_crash": 1, "shard_io_error": 0}, failed=True)
    finally:
        for w in slots:
            w.stop()


def _message(w: _Slot, msg: tuple, done_shard, bar) -> None:
    """Act on one message of worker ``w``."""
    kind = msg[0]
    if kind == "ready":
        w.ready = True
    elif kind == "sample":
        w.sample = (msg[1], msg[2])
    elif kind == "sample_done":
        if w.sample is not None and w.sample[0] > w.job.reported:  # not twice for a shard redone
            w.job.reported = w.sample[0]
            bar.update(1)
        w.sample = None
    elif kind == "result":
        w.job = w.sample = None
        done_shard(msg[1])
    elif kind == "fatal":
        raise RuntimeError(f"a tokenize worker could not start:\n{msg[1]}")
    elif kind == "error":
        raise RuntimeError(f"tokenizing {w.job.src} failed:\n{msg[1]}")


def tokenize_shards(
    vq_dir: str,
    inputs,
    out_dir: str,
    opts: TokenizeOptions = TokenizeOptions(),
    *,
    workers: int = 1,
    progress: bool = True,
) -> dict:
    """Tokenize every raw shard of ``inputs`` into ``out_dir``, skipping finished outputs. Returns the
    summed counts: :data:`OUTCOMES`, skip reasons, :data:`MEASURES` and ``shards_done/skipped/failed``."""
    paths = expand_sources(inputs)
    if not paths:
        raise FileNotFoundError(f"no raw shards match {inputs!r}")
    names = [shard_name(p) for p in paths]
    if len(set(names)) != len(names):
        raise ValueError(
            "input shards must have distinct file names (outputs are named after them)"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    total = Counter()
    jobs = []
    for src, name in zip(paths, names):
        dst = out / name
        if dst.exists():
            total["shards_skipped"] += 1
            sp = stats_path(dst)
            if sp.exists():
                total.update(
                    {k: v for k, v in json.loads(sp.read_text()).items() if k != "seconds"}
                )
        else:
            _remove_partial(str(dst))  # what a killed run left behind
            jobs.append((src, str(dst), opts))
    bar = tqdm(
        total=sum(_count_samples(j[0]) for j in jobs) or None,
        unit="video",
        desc="tokenize",
        disable=not progress,
    )
    cores = os.cpu_count() or 1
    workers = max(1, min(workers, len(jobs) or 1))

    def done_shard(res: dict, failed: bool = False) -> None:
        total.update({k: v for k, v in res.items() if k != "seconds" and v})
        failed = failed or bool(res.get("shard_io_error"))
        total["shards_failed" if failed else "shards_done"] += 1
        bar.set_postfix(
            ok=total["ok"], partial=total["truncated"] + total["gaps"], skipped=_skipped(total)
        )

    if workers == 1:
        vq = load_vq(vq_dir)
        for src, dst, o in jobs:
            done_shard(tokenize_shard(vq, src, dst, o, progress=bar.update))
    else:
        _run_workers(vq_dir, jobs, workers, max(1, cores // workers), done_shard, bar)
    bar.close()
    result = dict(total)
    write_json_atomic(out / "tokenize_stats.json", result)
    return result
