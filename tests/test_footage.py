"""Real-world shapes of footage (material.footage): every valid file read right side up at the
right times, every damaged one named, one bad packet costing only its GOP, no rank left waiting.

The reference for a valid file is an independent decode: PyAV decoding every frame in order, the
frame on screen at each sampled time picked by its timestamp, then turned (np.rot90, a flip) and
stretched the way the file was made to be shown. Orientation is also checked against the scene
itself: the top-left square spells the frame's index only when it is the right way up, and a
portrait frame's red bar lies at its bottom.
"""

import io
import json
import tarfile
import time
from contextlib import redirect_stderr

import av
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from material.footage import bad_packet_hour, ffmpeg_footage, footage, tokenize_peak_mib

from longvideo.data import isolate
from longvideo.data.cli import tokenize_main
from longvideo.data.shards import SkipStats, iter_token_samples
from longvideo.data.synthetic import decode_frame_index
from longvideo.data.tokenize import MEASURES, OUTCOMES, TokenizeOptions, tokenize_shard, trim_meta
from longvideo.data.video import (
    CorruptVideoError,
    iter_video,
    probe_video,
    read_video,
    sample_indices,
)
from longvideo.vq import VQConfig, VQModel, load_vq

# decord 0.6 picks other frames than the one on screen in these (VFR, HEVC seeks, MPEG-TS) or
# converts odd sizes differently; elsewhere it returns PyAV's frames exactly
DECORD_INEXACT = {"vfr", "hevc_10bit", "interlaced_ts", "odd_vp9"}


@pytest.fixture(scope="module")
def corpus():
    return {f.name: f for f in footage() + ffmpeg_footage()}


@pytest.fixture(autouse=True)
def _fresh_workers():
    isolate.shutdown()
    yield
    isolate.shutdown()


def independent(data: bytes, fps):
    """(frame numbers, times, shown-as-stored frames) at the sampled times, from a linear PyAV decode."""
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        start = float(s.start_time * s.time_base) if s.start_time is not None else 0.0
        rate = float(s.average_rate)
        frames = [(float(f.time) - start, f.to_ndarray(format="rgb24")) for f in c.decode(s)]
    times = np.array([t for t, _ in frames])
    picks = []
    for i in sample_indices(len(frames), rate, fps):
        on = np.flatnonzero(times <= i / rate + 0.5 / rate)
        picks.append(int(on[-1]) if len(on) else 0)
    return picks, times[picks], np.stack([frames[k][1] for k in picks])


def shown(f, stored: np.ndarray) -> torch.Tensor:
    x = np.rot90(stored, f.turns, axes=(1, 2))
    x = torch.from_numpy(np.ascontiguousarray(x[:, :, ::-1] if f.flip else x))
    if f.sar == 1:
        return x
    h, w = x.shape[1:3]
    y = F.interpolate(
        x.permute(0, 3, 1, 2).float(),
        size=(h, round(w * float(f.sar))),
        mode="bilinear",
        antialias=True,
        align_corners=False,
    )
    return y.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)


def assert_upright(frames: torch.Tensor, numbers):
    """The scene reads the right way up: its square spells the frame number; a portrait's bar is red, below."""
    side = min(frames.shape[1:3]) // 4 * 4
    assert [decode_frame_index(x[:side, :side].numpy()) for x in frames] == list(numbers)
    if frames.shape[1] > frames.shape[2]:
        bar = frames[:, side + side // 4 :].float().mean(dim=(0, 1, 2))
        assert bar[0] > 150 and bar[1] < 60, bar


def valid(corpus):
    return [f for f in corpus.values() if f.expect == "ok"]


@pytest.mark.parametrize("fps", [1.0, 3.0])
def test_valid_footage_equals_an_independent_decode_shown_as_made(corpus, fps):
    for f in valid(corpus):
        numbers, times, stored = independent(f.data, fps)
        clip = read_video(f.data, fps=fps)
        want = shown(f, stored)
        assert clip.frames.shape == want.shape, f.name
        torch.testing.assert_close(
            clip.frames, want, rtol=0, atol=0 if f.sar == 1 else 1, msg=f.name
        )
        np.testing.assert_allclose(clip.timestamps.numpy(), times, atol=1e-6, err_msg=f.name)
        assert_upright(clip.frames, numbers)
        info = probe_video(f.data)
        assert (info.height, info.width) == tuple(want.shape[1:3]), f.name  # what a player shows
        assert (
            not clip.report.truncated and not clip.report.gaps and clip.report.describe() == ""
        ), f.name


def test_streamed_chunks_and_resizing_follow_the_shown_frames(corpus):
    for f in valid(corpus):
        whole = read_video(f.data, fps=2.0, size=32)
        parts = list(iter_video(f.data, fps=2.0, size=32, chunk_frames=3))
        torch.testing.assert_close(torch.cat([p[0] for p in parts]), whole.frames, rtol=0, atol=0)
        assert whole.frames.shape[1:] == (32, 32, 3)
    # the anamorphic scene: 64 stored columns shown as 96, so a square crop keeps the whole pattern
    ana = read_video(corpus["anamorphic"].data, fps=1.0, size=48)
    assert_upright(ana.frames, [0, 12, 24])


def test_decord_shows_footage_the_right_way_up(corpus):
    for f in valid(corpus):
        ref = read_video(f.data, fps=1.0)
        got = read_video(f.data, fps=1.0, backend="decord")
        assert got.frames.shape == ref.frames.shape, f.name
        if f.name not in DECORD_INEXACT:
            torch.testing.assert_close(got.frames, ref.frames, rtol=0, atol=0, msg=f.name)


def test_damaged_footage_is_named(corpus):
    cut = read_video(corpus["cut_mkv"].data, fps=1.0)
    rep = cut.report
    assert rep.truncated and rep.declared == pytest.approx(10.0) and 5.0 <= rep.duration < 7.0
    assert 0.5 < rep.fraction < 0.7 and "cut short" in rep.describe()
    assert_upright(
        cut.frames, [8 * k for k in range(len(cut))]
    )  # what is there is read, at its true times
    with pytest.raises(CorruptVideoError):
        read_video(corpus["mp4_no_index"].data)


def test_decord_names_damaged_footage(corpus):
    with pytest.raises(CorruptVideoError):
        read_video(corpus["mp4_no_index"].data, backend="decord")
    assert read_video(corpus["cut_mkv"].data, backend="decord").report.truncated


def test_an_hour_with_a_bad_packet_every_ten_minutes_loses_only_their_gops():
    data, bad = bad_packet_hour()
    with av.open(io.BytesIO(data)) as c:  # decoding it in one go stops at the first bad packet
        with pytest.raises(av.FFmpegError):
            for _ in c.decode(video=0):
                pass
    clip = read_video(data, fps=1.0)
    times = clip.timestamps.numpy()
    assert [decode_frame_index(x.numpy()) for x in clip.frames] == [round(t * 2) for t in times]
    # keyframes every 30 s: a bad packet costs the rest of its GOP and nothing else
    lost = sorted(set(range(3600)) - {round(t) for t in times})
    gops = {int(t // 30) for t in bad}
    assert (
        len(gops) == 6
        and lost
        and all(t // 30 in gops and t > bad[sorted(gops).index(t // 30)] - 1 for t in lost)
    )
    assert len(clip.report.gaps) == 6 and clip.report.lost_seconds <= 6 * 30
    assert len(clip) >= 3600 - 6 * 30 and not clip.report.truncated


def _tiny_vq(path):
    torch.manual_seed(0)
    VQModel(
        VQConfig(
            mode="2d",
            resolution=16,
            downsample=4,
            channels=8,
            channel_mult=(1, 1, 1),
            num_res_blocks=0,
            codebook_size=16,
        )
    ).save(path)
    return load_vq(path)


def _shard(path, items):
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for key, ext, data, meta in items:
            for name, blob in ((f"{key}.{ext}", data), (f"{key}.json", json.dumps(meta).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tf.addfile(info, io.BytesIO(blob))


def test_tokenize_counts_footage_by_reason(corpus, tmp_path):
    vq = _tiny_vq(tmp_path / "vq")
    timed = {
        "caption": "x",
        "segments": [
            {"start": 0, "end": 2, "text": "a"},
            {"start": 2, "end": 4, "text": "b"},
            {"start": 4, "end": 8, "text": "c"},
        ],
        "qa": [{"question": "q1", "answer": "a1"}, {"question": "q2", "answer": "a2", "time": 9.0}],
    }
    gappy, _ = bad_packet_hour(minutes=10, every_minutes=5)
    items = [
        (f.name, f.ext, f.data, timed if f.name == "cut_mkv" else {"caption": f.name})
        for f in corpus.values()
    ]
    items.append(("gappy", "webm", gappy, {"caption": "gaps"}))
    _shard(tmp_path / "raw.tar", items)
    runs = {
        "default": TokenizeOptions(),
        "skip": ["--partial-videos", "skip"],
        "strict": ["--min-partial-fraction", "0.9"],
    }
    got = {}
    for name, opts in runs.items():
        if isinstance(opts, list):  # through the command line
            assert (
                tokenize_main(
                    [
                        "--vq",
                        str(tmp_path / "vq"),
                        "--in",
                        str(tmp_path / "raw.tar"),
                        "--out",
                        str(tmp_path / name),
                        "--quiet",
                        *opts,
                    ]
                )
                == 0
            )
            (tmp_path / name / "raw.tar").rename(tmp_path / f"{name}.tar")
            stats = json.loads((tmp_path / name / "tokenize_stats.json").read_text())
        else:
            stats = tokenize_shard(
                vq, str(tmp_path / "raw.tar"), str(tmp_path / f"{name}.tar"), opts
            )
        samples = {s.key: s for s in iter_token_samples(str(tmp_path / f"{name}.tar"), SkipStats())}
        counts = {k: v for k, v in stats.items() if k not in MEASURES + ("seconds", "shards_done")}
        assert sum(counts.values()) == len(items) and sum(stats.get(k, 0) for k in OUTCOMES) == len(
            samples
        )
        got[name] = (stats, samples)
    n_ok = len(valid(corpus))
    stats, samples = got["default"]
    assert (stats["ok"], stats["truncated"], stats["gaps"], stats["video_corrupt"]) == (
        n_ok,
        1,
        1,
        1,
    )
    assert stats["seconds_declared"] == pytest.approx(10.0) and 5.0 <= stats["seconds_kept"] < 7.0
    assert (
        0 < stats["seconds_lost"] <= 60
        and stats["segments_dropped"] == 1
        and stats["qa_dropped"] == 1
    )
    part = samples["cut_mkv"].meta
    assert [s["text"] for s in part["segments"]] == ["a", "b"] and [
        q["question"] for q in part["qa"]
    ] == ["q1"]
    assert part["tokenized"]["partial"]["seconds_declared"] == pytest.approx(10.0)
    assert len(samples["gappy"].meta["tokenized"]["partial"]["gaps"]) == 2
    assert all("partial" not in samples[f.name].meta["tokenized"] for f in valid(corpus))
    stats, samples = got["skip"]
    assert stats["video_truncated"] == 2 and "cut_mkv" not in samples and "gappy" not in samples
    stats, samples = got["strict"]  # 60 % of the cut file was read, 90 % of the gappy one
    assert stats["video_truncated"] == 1 and "cut_mkv" not in samples and "gappy" in samples


def test_trim_meta_drops_what_falls_past_the_end():
    meta = {
        "segments": [{"start": 0, "end": 3, "text": "a"}, {"start": 3, "end": 5.5, "text": "b"}],
        "qa": [
            {"question": "q", "answer": "a", "start": 1.0, "end": 2.0},
            {"question": "r", "answer": "b"},
        ],
    }
    out, dropped = trim_meta(meta, 5.0)
    assert [s["text"] for s in out["segments"]] == ["a"] and len(out["qa"]) == 2
    assert (
        dropped == {"segments_dropped": 1, "qa_dropped": 0} and len(meta["segments"]) == 2
    )  # not changed


def test_chat_reads_footage_as_shown_and_warns_of_a_cut(corpus, tmp_path):
    from test_infer_chat import tiny_pretrained

    from longvideo.infer.chat import encode_video_file

    pre = tiny_pretrained()
    for f in list(valid(corpus)) + [corpus["cut_mkv"]]:
        path = tmp_path / f"{f.name}.{f.ext}"
        path.write_bytes(f.data)
        ref = read_video(f.data, fps=1.0, size=pre.vq.cfg.resolution)
        with (
            pytest.warns(UserWarning, match="partly unreadable")
            if f.expect == "truncated"
            else _no_warning()
        ):
            video = encode_video_file(pre, str(path), fps=1.0, progress=False)
        assert video.num_frames == len(ref), f.name
        np.testing.assert_allclose(
            video.timestamps, ref.timestamps.numpy()[: len(video.timestamps)], atol=1e-9
        )


class _no_warning:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("error", UserWarning)

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


@pytest.mark.slow  # out of make check's five minutes; make test runs it
def test_tokenizing_ten_minutes_stays_small_and_flat(tmp_path):
    """Peak memory above the start of tokenizing 256 x 256 video (the hour tokenizer's VQ); 11-25 s."""
    short, long = tokenize_peak_mib(120, tmp_path), tokenize_peak_mib(600, tmp_path)
    assert long < 150, (short, long)
    assert long - short < 40, (short, long)  # flat in the length, not 5x


# ----------------------------------------------------------------------------- no rank waits forever


def _loader_body(rank, world, root):
    import shutil

    import torch.distributed as dist

    from longvideo.data.config import DataConfig
    from longvideo.data.loader import TokenLoader
    from longvideo.data.shards import ShardWriter, token_sample_members
    from longvideo.distributed import RankFailedError
    from longvideo.tokenizer import train_text_tokenizer

    tok = train_text_tokenizer(["a red circle", "a blue square"] * 20, vocab_size=280)
    mine = root / f"rank{rank}"  # each rank reads its own copy, as on a node's local disk
    mine.mkdir()
    with ShardWriter(mine / "part-000.tar") as w:
        for i in range(40):
            w.write(
                f"s{i:03d}",
                token_sample_members(
                    f"s{i:03d}",
                    np.full((3, 2, 2), i % 16),
                    np.arange(3.0),
                    {"caption": "a red circle"},
                ),
            )
    loader = TokenLoader(
        str(mine),
        tok,
        tok.vocab(16),
        DataConfig(seq_len=64, shuffle_buffer=2, pack_bins=1),
        batch_size=1,
        dp_rank=rank,
        dp_size=world,
        group=dist.group.WORLD,
    )
    next(loader)
    if rank == 1:
        shutil.rmtree(mine)  # the disk goes: this rank's next read raises
    t0, err = time.time(), None
    try:
        for _ in range(40):
            batch = next(loader)
            total = batch["input_ids"].sum()
            dist.all_reduce(total)  # the training step's collective
    except (FileNotFoundError, RankFailedError) as e:
        err = e
    assert err is not None and time.time() - t0 < 30
    if rank == 1:
        assert isinstance(err, FileNotFoundError)
    else:
        assert (
            isinstance(err, RankFailedError)
            and "rank 1" in str(err)
            and "FileNotFoundError" in str(err)
        )


@pytest.mark.distributed
def test_a_rank_whose_shard_vanishes_stops_every_rank(tmp_path):
    from distributed import run_ranks

    run_ranks(_loader_body, world=2, args=(tmp_path,), timeout=120)


def test_fail_together_in_one_process_only_reraises():
    from longvideo.distributed import fail_together

    assert not torch.distributed.is_initialized()
    assert fail_together(None) is None
    with pytest.raises(FileNotFoundError, match="gone"):
        fail_together(FileNotFoundError("gone"))


def _needle_body(rank, world):
    import torch.distributed as dist
    from test_infer_chat import tiny_pretrained
    from test_infer_evals import ConstantEngine

    from longvideo.distributed import RankFailedError
    from longvideo.infer import evals

    pre = tiny_pretrained(max_seq_len=512)
    if rank == 1:

        def broken(*a, **k):
            raise OSError("the background cannot be read")

        evals.haystack_frames = broken
    t0 = time.time()
    with pytest.raises(RankFailedError if rank == 0 else OSError) as e:
        evals.evaluate_video_needle(
            pre,
            lengths=(6,),
            depths=(0.0, 1.0),
            colours=("red", "green"),
            trials=4,
            engine_factory=lambda p: ConstantEngine(p.tokenizer, " red"),
            progress=False,
            encode_group=dist.group.WORLD,
        )
    assert time.time() - t0 < 30 and "the background cannot be read" in str(e.value)


@pytest.mark.distributed
def test_a_rank_whose_encoding_raises_stops_the_shared_needle_encoding():
    from distributed import run_ranks

    run_ranks(_needle_body, world=2, timeout=180)


def _chat_body(rank, world, model, video):
    from longvideo.infer import cli

    err = io.StringIO()
    t0 = time.time()
    with redirect_stderr(err):
        rc = cli._chat(
            cli.chat_parser().parse_args(
                [
                    "--model",
                    model,
                    "--video",
                    video,
                    "--question",
                    "what?",
                    "--quiet",
                    "--device",
                    "cpu",
                ]
            )
        )
    assert rc == cli.EXIT_ERROR and time.time() - t0 < 30
    assert "PyAV cannot open it" in err.getvalue(), err.getvalue()  # rank 0's error, on both ranks
    assert ("rank 0 failed" in err.getvalue()) == (rank == 1), err.getvalue()


@pytest.mark.distributed
def test_chat_prefill_stops_every_rank_when_rank_0_cannot_read_the_video(corpus, tmp_path):
    from distributed import run_ranks
    from test_infer_chat import tiny_pretrained

    from longvideo.checkpoint import save_project_checkpoint

    pre = tiny_pretrained()
    ckpt = save_project_checkpoint(
        tmp_path / "ckpt", pre.model.state_dict(), pre.config, tokenizer=pre.tokenizer, vq=pre.vq
    )
    video = tmp_path / "phone.mp4"
    video.write_bytes(corpus["mp4_no_index"].data)
    run_ranks(_chat_body, world=2, args=(str(ckpt), str(video)), timeout=120)
