"""``longvideo tokenize``: raw shards (video + json) -> token shards (VQ codes + timestamps + json).

Each input shard becomes one output shard of the same name, written atomically (a rerun skips
finished ones), by worker processes that each hold one VQ. What is skipped, kept partly and counted
where: docs/data.md, "Commands" and "Partial videos".
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from longvideo.atomic import write_json_atomic
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
    max_frames: Optional[int] = 3600  # most frames per video (uniform sampling when the cap binds)
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


_VQ = _QUEUE = None  # the worker's VQ model (loaded once per process) and its progress queue


def _init_worker(vq_dir: str, threads: int, queue) -> None:
    global _VQ, _QUEUE
    torch.set_num_threads(max(1, threads))
    _VQ = load_vq(vq_dir)
    _QUEUE = queue


class _StreamFailed(Exception):
    """The shard's source failed part-way: its output is not kept, so a rerun reads it again."""


def tokenize_shard(vq, src: str, dst: str, opts: TokenizeOptions, progress=None) -> dict:
    """Tokenize one raw shard (a path or URL) into ``dst`` (atomically). Returns its counts.

    When the source fails part-way (``shard_io_error``, e.g. a dropped connection) no output is
    written, so that a rerun tokenizes the shard again.
    """
    stats = SkipStats()
    t0 = time.time()
    try:
        with ShardWriter(dst) as writer:
            for sample in iter_raw_samples(src, stats):
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
    writer.write(sample.key.replace("/", "_"), members)
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


def _worker_job(args) -> dict:
    src, dst, opts = args
    return tokenize_shard(_VQ, src, dst, opts, progress=lambda n: _QUEUE.put(n))


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
            jobs.append((src, str(dst), opts))
    bar = tqdm(
        total=sum(_count_samples(j[0]) for j in jobs) or None,
        unit="video",
        desc="tokenize",
        disable=not progress,
    )
    cores = os.cpu_count() or 1
    workers = max(1, min(workers, len(jobs) or 1))

    def done_shard(res: dict) -> None:
        total.update({k: v for k, v in res.items() if k != "seconds"})
        total["shards_failed" if res.get("shard_io_error") else "shards_done"] += 1
        bar.set_postfix(
            ok=total["ok"], partial=total["truncated"] + total["gaps"], skipped=_skipped(total)
        )

    if workers == 1:
        vq = load_vq(vq_dir)
        for src, dst, o in jobs:
            done_shard(tokenize_shard(vq, src, dst, o, progress=bar.update))
    else:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        with ctx.Pool(
            workers, initializer=_init_worker, initargs=(vq_dir, max(1, cores // workers), queue)
        ) as pool:
            pending = [pool.apply_async(_worker_job, (job,)) for job in jobs]
            while pending:
                while not queue.empty():
                    bar.update(queue.get())
                done = [r for r in pending if r.ready()]
                for r in done:
                    done_shard(r.get())  # re-raises a worker's exception here
                    pending.remove(r)
                if not done:
                    time.sleep(0.05)
            while not queue.empty():
                bar.update(queue.get())
    bar.close()
    result = dict(total)
    write_json_atomic(out / "tokenize_stats.json", result)
    return result
