"""Raw shards -> token shards: bad samples are skipped and counted, nothing else is lost or changed;
tokenize is resumable with atomic outputs; shards are treated as untrusted input."""

import io
import json
import os
import pickle
import tarfile

import numpy as np
import pytest
import torch

from longvideo.data.cli import make_data_main, tokenize_main
from longvideo.data.shards import SkipStats, iter_raw_samples, iter_token_samples
from longvideo.data.synthetic import SyntheticSpec, make_sample
from longvideo.data.tokenize import TokenizeOptions, tokenize_shard, tokenize_shards
from longvideo.data.video import read_video
from longvideo.vq import VQConfig, VQModel, encode_video, load_vq

SPEC = SyntheticSpec(size=32, fps=4, min_seconds=2, max_seconds=4, long_fraction=0.0)


def _add(tf, name, data, **kw):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for k, v in kw.items():
        setattr(info, k, v)
    tf.addfile(info, io.BytesIO(data))


class _Boom:
    """Unpickling this would create a file: proves nothing unpickles shard members."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _raw_shard(path, n, seed=0, bad=True):
    """n synthetic samples; with bad=True, samples 1..6 are damaged in different ways and traps are added."""
    trap = os.path.join(os.path.dirname(path), "UNPICKLED")
    expect = {"good": [], "reasons": {}}
    header_to_break = None
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(n):
            s = make_sample(seed, i, SPEC)
            mp4, js = s.mp4(), json.dumps(s.meta).encode()
            kind = (
                {
                    1: "truncated",
                    2: "garbage",
                    3: "empty",
                    4: "no_json",
                    5: "bad_json",
                    6: "broken_header",
                }.get(i)
                if bad
                else None
            )
            if kind is None:
                expect["good"].append(s.key)
            if kind == "truncated":
                mp4 = mp4[: len(mp4) // 2]
            elif kind == "garbage":
                mp4 = os.urandom(len(mp4))
            elif kind == "empty":
                mp4 = b""
            elif kind == "bad_json":
                js = b"{not json"
            if kind == "broken_header":
                header_to_break = tf.offset  # the next header written is this sample's video
            _add(tf, f"{s.key}.mp4", mp4)
            if kind != "no_json":
                _add(tf, f"{s.key}.json", js)
        if bad:  # traps: none of these may be decoded, followed or written anywhere
            _add(tf, "trap.pyd", pickle.dumps(_Boom(trap)))
            _add(tf, "trap.pickle", pickle.dumps(_Boom(trap)))
            _add(tf, "../../escape.json", b"{}")
            _add(tf, "link.mp4", b"", type=tarfile.SYMTYPE, linkname="/etc/passwd")
    if header_to_break is not None:
        with open(path, "r+b") as f:  # damage the name field: the header checksum no longer matches
            f.seek(header_to_break)
            f.write(b"\xff" * 20)
    if bad:
        expect["reasons"] = {
            "video_corrupt": 2,
            "video_empty": 1,
            "missing_json": 1,
            "bad_json": 1,
            "missing_video": 1,
            "unsafe_member": 2,
        }
    return expect, trap


def test_bad_samples_skipped_and_counted_nothing_else_lost(tmp_path, vq_dir):
    raw = str(tmp_path / "raw.tar")
    expect, trap = _raw_shard(raw, 10)
    out = str(tmp_path / "tok" / "raw.tar")
    opts = TokenizeOptions(fps=2.0, max_frames=16)
    vq = load_vq(vq_dir)
    stats = tokenize_shard(vq, raw, out, opts)
    assert stats["ok"] == len(expect["good"]) == 10 - 6  # samples out = samples in - bad ones
    assert {k: v for k, v in stats.items() if k not in ("ok", "seconds")} == expect["reasons"]
    assert not os.path.exists(trap) and not (tmp_path.parent / "escape.json").exists()
    # the good samples are complete and unchanged: codes equal an independent read + encode
    got = {t.key: t for t in iter_token_samples(out, SkipStats(), codebook_size=16)}
    assert sorted(got) == sorted(expect["good"])
    raw_samples = {s.key: s for s in iter_raw_samples(raw, SkipStats())}
    for key, t in got.items():
        clip = read_video(raw_samples[key].video, fps=2.0, max_frames=16, size=16)
        np.testing.assert_array_equal(t.codes, encode_video(vq, clip.frames).numpy())
        np.testing.assert_allclose(t.timestamps, clip.timestamps.numpy())
        assert t.meta["caption"] == raw_samples[key].meta["caption"]
        assert t.meta["tokenized"]["num_frames"] == len(clip)


def test_causal3d_timestamps_are_group_starts(tmp_path):
    torch.manual_seed(0)
    cfg = VQConfig(
        mode="causal3d",
        temporal_downsample=2,
        resolution=16,
        downsample=4,
        channels=8,
        channel_mult=(1, 1, 1),
        num_res_blocks=0,
        codebook_size=16,
    )
    VQModel(cfg).save(tmp_path / "vq3")
    vq = load_vq(tmp_path / "vq3")
    raw = str(tmp_path / "raw.tar")
    _raw_shard(raw, 2, bad=False)
    tokenize_shard(vq, raw, str(tmp_path / "out.tar"), TokenizeOptions(fps=2.0))
    for t in iter_token_samples(str(tmp_path / "out.tar"), SkipStats()):
        frames = t.meta["tokenized"]["num_frames"]
        groups = vq.group_frame_index(frames)
        assert t.codes.shape[0] == len(groups)
        np.testing.assert_allclose(t.timestamps, [g[0] / 2.0 for g in groups])


@pytest.mark.slow
def test_tokenize_resumable_atomic_and_parallel(tmp_path, vq_dir):
    raw = tmp_path / "raw"
    raw.mkdir()
    for s in range(3):
        _raw_shard(str(raw / f"shard-{s:06d}.tar"), 3, seed=s, bad=False)
    out = tmp_path / "tok"
    opts = TokenizeOptions(fps=1.0)
    first = tokenize_shards(vq_dir, str(raw), str(out), opts, workers=2, progress=False)
    assert first["ok"] == 9 and first["shards_done"] == 3
    before = {p.name: p.read_bytes() for p in out.glob("*.tar")}
    # a crash leaves at most a hidden temporary file; a rerun skips finished shards and redoes the rest
    (out / "shard-000001.tar").unlink()
    (out / ".shard-000001.tar.x1y2.tmp").write_bytes(b"partial")
    second = tokenize_shards(vq_dir, str(raw), str(out), opts, workers=1, progress=False)
    assert second["shards_skipped"] == 2 and second["shards_done"] == 1 and second["ok"] == 9
    after = {p.name: p.read_bytes() for p in out.glob("*.tar")}
    assert after == before  # same bytes whichever process wrote them
    assert json.loads((out / "tokenize_stats.json").read_text())["ok"] == 9


def test_cli_make_data_then_tokenize(tmp_path, vq_dir, capsys):
    raw, tok = tmp_path / "raw", tmp_path / "tok"
    assert (
        make_data_main(
            [
                "synthetic",
                "--out",
                str(raw),
                "--n",
                "5",
                "--size",
                "32",
                "--fps",
                "4",
                "--min-seconds",
                "2",
                "--max-seconds",
                "3",
                "--long-fraction",
                "0",
                "--samples-per-shard",
                "3",
                "--quiet",
            ]
        )
        == 0
    )
    assert sorted(p.name for p in raw.glob("*.tar")) == ["shard-000000.tar", "shard-000001.tar"]
    assert (
        tokenize_main(
            ["--vq", vq_dir, "--in", str(raw), "--out", str(tok), "--fps", "1", "--quiet"]
        )
        == 0
    )
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["ok"] == 5
    assert sum(1 for p in tok.glob("*.tar") for _ in iter_token_samples(str(p), SkipStats())) == 5
    assert (
        tokenize_main(
            ["--vq", vq_dir, "--in", str(tmp_path / "none"), "--out", str(tok), "--quiet"]
        )
        == 2
    )
