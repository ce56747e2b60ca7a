"""Shards streamed from URLs (a local HTTP server on 127.0.0.1 that the tests start, and pipe:):
the same samples and bytes as from disk, the untrusted-input rules, a connection dropped
mid-shard, and the training loader's exact resume over streamed shards."""

import functools
import http.server
import json
import shutil
import tarfile
import threading

import numpy as np
import pytest
import torch
from test_data_loader import epoch_refs
from test_data_shards import _add, _raw_shard

from longvideo.data.config import DataConfig
from longvideo.data.loader import TokenLoader
from longvideo.data.shards import (
    TOKEN_EXTS,
    ShardWriter,
    SkipStats,
    iter_raw_samples,
    token_sample_members,
)
from longvideo.data.streams import expand_sources, is_url, iter_tar, shard_name
from longvideo.data.synthetic import SyntheticSpec, make_sample, text_corpus
from longvideo.data.tokenize import TokenizeOptions, tokenize_shards
from longvideo.tokenizer import train_text_tokenizer
from longvideo.vq import VQConfig

K = 16
SPEC = SyntheticSpec(min_seconds=2, max_seconds=6, long_fraction=0.15, long_seconds=20)


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the folder; under /drop/ it promises the whole file but sends only its first third."""

    def log_message(self, *args):
        pass

    def translate_path(self, path):
        return super().translate_path(path.replace("/drop/", "/", 1))

    def copyfile(self, source, outputfile):
        if self.path.startswith("/drop/"):
            data = source.read()
            outputfile.write(data[: len(data) // 3])
            outputfile.flush()
            self.close_connection = True
            return
        shutil.copyfileobj(source, outputfile)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, folder): an HTTP server on 127.0.0.1 serving the folder, stopped after the module."""
    root = tmp_path_factory.mktemp("www")
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Handler, directory=str(root))
    )
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", root
    httpd.shutdown()
    httpd.server_close()
    thread.join(10)


def test_sources_and_names(server):
    base, _ = server
    urls = expand_sources(f"{base}/raw/shard-{{000..002}}.tar")
    assert urls == [f"{base}/raw/shard-{i:03d}.tar" for i in range(3)] and all(
        is_url(u) for u in urls
    )
    assert expand_sources([f"{base}/a.tar", f"{base}/a.tar", "pipe:cat x.tar"]) == [
        f"{base}/a.tar",
        "pipe:cat x.tar",
    ]
    assert shard_name(urls[1]) == "shard-001.tar"
    assert shard_name("pipe:curl -s https://host/d/shard-7.tar") == "shard-7.tar"
    assert not is_url("data/raw") and not is_url("C:/x.tar") and not is_url("x:y.tar")
    with pytest.raises(ValueError):
        shard_name("pipe:cat")


def test_http_raw_shard_same_samples_and_counts_as_disk(server):
    base, root = server
    (root / "raw").mkdir(exist_ok=True)
    path = root / "raw" / "untrusted.tar"
    _raw_shard(
        str(path), 10
    )  # damaged samples, a pickle trap, an escaping name, a symlink, a broken header
    local, remote = SkipStats(), SkipStats()
    a = [(s.key, s.video, s.meta) for s in iter_raw_samples(str(path), local)]
    b = [(s.key, s.video, s.meta) for s in iter_raw_samples(f"{base}/raw/untrusted.tar", remote)]
    assert a == b and len(a) == 7 and local == remote  # 4 good + 3 whose video fails later
    assert (
        remote["unsafe_member"] == 2
        and remote["missing_json"] == 1
        and remote["missing_video"] == 1
    )
    assert not (root / "UNPICKLED").exists() and not (root.parent / "escape.json").exists()
    c = [(s.key, s.video, s.meta) for s in iter_raw_samples(f"pipe:cat {path}", SkipStats())]
    assert c == a


def test_stream_bounds_and_tar_errors(server, tmp_path):
    base, root = server
    path = root / "bounds.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        _add(tf, "a.mp4", b"x" * 5000)
        _add(tf, "a.json", b"{}")
        _add(tf, "b.mp4", b"y" * 10)
        _add(tf, "b.json", b"{}")
        _add(tf, "c.pyd", b"\x80\x04K\x01.")  # a pickle: never read
    stats = SkipStats()
    got = list(iter_tar(f"{base}/bounds.tar", stats, ("mp4", "json"), {"mp4": 1000}))
    assert [k for k, _ in got] == ["a", "b"]
    assert (
        getattr(got[0][1]["mp4"], "reason", None) == "too_large" and got[1][1]["mp4"] == b"y" * 10
    )
    # a shard cut short (served honestly): what precedes the cut is read, the cut is counted
    (root / "short.tar").write_bytes(path.read_bytes()[: 1536 + 700])
    stats = SkipStats()
    got = list(iter_tar(f"{base}/short.tar", stats, ("mp4", "json")))
    assert got == [] and stats["truncated_tar"] == 1
    stats = SkipStats()
    assert (
        list(iter_tar(f"{base}/missing.tar", stats, ("mp4",))) == []
        and stats["shard_io_error"] == 1
    )
    assert list(iter_tar("pipe:exit 3", stats, ("mp4",))) == [] and stats["shard_io_error"] == 2


def _write_raw(folder, n_shards, per):
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(n_shards):
        _raw_shard(str(folder / f"shard-{s:03d}.tar"), per, seed=s, bad=False)


def test_tokenize_disk_and_http_byte_identical_and_dropped_connection(server, vq_dir, tmp_path):
    base, root = server
    _write_raw(root / "tokin", 3, 3)
    opts = TokenizeOptions(fps=1.0)
    disk = tokenize_shards(
        vq_dir, str(root / "tokin"), str(tmp_path / "disk"), opts, progress=False
    )
    web = tokenize_shards(
        vq_dir, f"{base}/tokin/shard-{{000..002}}.tar", str(tmp_path / "web"), opts, progress=False
    )
    assert disk["ok"] == web["ok"] == 9 and web["shards_done"] == 3
    for name in ("shard-000.tar", "shard-001.tar", "shard-002.tar"):
        assert (tmp_path / "disk" / name).read_bytes() == (tmp_path / "web" / name).read_bytes()
    # shard 001 comes over a connection dropped a third of the way: the run goes on with shard 002,
    # counts the loss, and keeps no output for 001 so that a rerun reads it again
    srcs = [
        f"{base}/tokin/shard-000.tar",
        f"{base}/drop/tokin/shard-001.tar",
        f"{base}/tokin/shard-002.tar",
    ]
    out = tmp_path / "dropped"
    res = tokenize_shards(vq_dir, srcs, str(out), opts, progress=False)
    assert res["shard_io_error"] == 1 and res["shards_failed"] == 1 and res["shards_done"] == 2
    assert sorted(p.name for p in out.glob("*.tar")) == ["shard-000.tar", "shard-002.tar"]
    again = tokenize_shards(
        vq_dir,
        [srcs[0], srcs[2], f"pipe:cat {root}/tokin/shard-001.tar"],
        str(out),
        opts,
        progress=False,
    )
    assert again["shards_done"] == 1 and again["shards_skipped"] == 2
    assert (out / "shard-001.tar").read_bytes() == (
        tmp_path / "disk" / "shard-001.tar"
    ).read_bytes()


# ----------------------------------------------------------------------------- training loader


@pytest.fixture(scope="module")
def tok():
    return train_text_tokenizer(text_corpus(60, spec=SPEC), vocab_size=300)


@pytest.fixture(scope="module")
def token_shards(server):
    base, root = server
    folder = root / "tok"
    folder.mkdir()
    for s in range(4):
        with ShardWriter(folder / f"part-{s:03d}.tar") as w:
            for i in range(s * 6, s * 6 + 6):
                sample = make_sample(3, i, SPEC)
                codes = np.random.default_rng(i).integers(0, K, (sample.duration, 2, 2))
                w.write(
                    sample.key,
                    token_sample_members(
                        sample.key, codes, np.arange(float(sample.duration)), sample.meta
                    ),
                )
    return str(folder), f"{base}/tok/part-{{000..003}}.tar"


def _loader(src, tok, **kw):
    cfg_kw = {k: kw.pop(k) for k in list(kw) if k in DataConfig.__dataclass_fields__}
    cfg = DataConfig(**{"seq_len": 96, "shuffle_buffer": 5, **cfg_kw})
    return TokenLoader(src, tok, tok.vocab(K), cfg, **{"batch_size": 2, **kw})


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in x:
            assert torch.equal(x[k], y[k]), k


KW = dict(
    seed=5, template_mode="random", question_position="random", pack_bins=3, dp_rank=1, dp_size=2
)


def test_loader_http_equals_disk(token_shards, tok):
    disk, web = token_shards
    a, b = _loader(disk, tok, **KW), _loader(web, tok, **KW)
    _same([next(a) for _ in range(25)], [next(b) for _ in range(25)])  # over two epochs
    assert a.last_batch_keys == b.last_batch_keys
    assert {k: v for k, v in a.stats.items()} == {k: v for k, v in b.stats.items()}
    assert [a.key_of(r) for r in epoch_refs(a, 1)] == [b.key_of(r) for r in epoch_refs(b, 1)]


@pytest.mark.parametrize("skip", [4, 13])  # mid-epoch, and after the first epoch boundary
def test_loader_http_resume_matches_uninterrupted_run(token_shards, tok, skip):
    _, web = token_shards
    ref = _loader(web, tok, **KW)
    for _ in range(skip):
        next(ref)
    state = json.loads(json.dumps(ref.state_dict()))
    assert (
        state["cursor"][1] > 0 or state["cursor"][0] > 0
    )  # the per-shard sample offset is recorded
    want = [next(ref) for _ in range(8)]
    resumed = _loader(web, tok, **KW)
    resumed.load_state_dict(state)
    got = [next(resumed) for _ in range(8)]
    _same(want, got)
    assert resumed.last_batch_keys == ref.last_batch_keys and resumed.stats == ref.stats


def test_loader_goes_on_after_a_dropped_shard(token_shards, tok, server):
    base, _ = server
    srcs = [f"{base}/tok/part-000.tar", f"{base}/drop/tok/part-001.tar", f"{base}/tok/part-002.tar"]
    loader = _loader(srcs, tok, seed=1)
    for _ in range(12):
        next(loader)
    assert loader.stats["shard_io_error"] >= 1
    keys = {k for row in loader.last_batch_keys for k in row}
    assert keys  # batches keep coming from the other shards
    full = {key for key, _ in iter_tar(f"{base}/tok/part-001.tar", SkipStats(), TOKEN_EXTS)}
    part = {key for key, _ in iter_tar(srcs[1], SkipStats(), TOKEN_EXTS)}
    assert part < full  # the dropped shard gave only what arrived before the drop


def test_train_vq_frames_from_http_shards_equal_disk(server):
    from longvideo.data.frames import build_frame_source

    base, root = server
    _write_raw(root / "vqin", 2, 3)
    cfg = VQConfig(
        mode="2d",
        resolution=16,
        downsample=4,
        channels=8,
        channel_mult=(1, 1, 1),
        num_res_blocks=0,
        codebook_size=16,
        fps=2.0,
        eval_frames=4,
    )
    disk = build_frame_source(str(root / "vqin"), cfg)
    web = build_frame_source(f"{base}/vqin/shard-{{000..001}}.tar", cfg)
    assert len(disk.train) + len(disk.heldout) == 6
    for a, b in zip(disk.train + disk.heldout, web.train + web.heldout):
        assert torch.equal(a, b)
