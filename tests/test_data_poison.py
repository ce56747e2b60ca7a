"""Poison samples cost themselves only: counted by reason under their name, never a stopped run.

Raw shards (through `longvideo tokenize`): json nested far too deep, an integer of 5,000 digits,
an empty key, a duplicate key; and tokenize workers killed by SIGKILL (the OOM killer) or
SIGSEGV on designated samples (tests/material/killer.py). Token shards (through TokenLoader,
local and streamed): an empty .npy member, absurd and lying headers, an object array (pickle),
zero-size codes, the same json and key poison. The good samples come out whole.
"""

import io
import json
import pickle
import tarfile

import numpy as np
import pytest
import torch
from material import killer
from material.corpus import Encoding, corpus_frames, encode

from longvideo.data import tokenize
from longvideo.data.cli import tokenize_main
from longvideo.data.codes import video_to_codes
from longvideo.data.config import DataConfig
from longvideo.data.loader import TokenLoader
from longvideo.data.shards import (
    ShardError,
    SkipStats,
    iter_token_samples,
    load_npy,
    npy_bytes,
    token_sample_members,
)
from longvideo.data.synthetic import SyntheticSpec, text_corpus
from longvideo.data.tokenize import TokenizeOptions, tokenize_shards
from longvideo.tokenizer import train_text_tokenizer
from longvideo.vq import VQConfig, VQModel, load_vq

CLIP = Encoding("mp4", "mp4", "mp4", "libx264", frames=16, size=32)


def _clip(seed: int) -> bytes:
    """A 2-second 32 x 32 H.264 clip, different for every seed."""
    return encode(CLIP, corpus_frames(CLIP.frames, CLIP.size, seed))


def _tar(path, members):
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return str(path)


def _json(caption: str) -> bytes:
    return json.dumps({"caption": caption}).encode()


DEEP = b'{"caption": "deep", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
DEEPISH = b'{"caption": "d", "x": ' + b"[" * 40 + b"]" * 40 + b"}"  # under Python's limit
BIG_INT = b'{"caption": "n", "n": ' + b"9" * 5000 + b"}"


@pytest.fixture(scope="module")
def vq_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("vq") / "vq"
    torch.manual_seed(0)
    cfg = VQConfig(
        mode="2d",
        resolution=16,
        downsample=4,
        channels=8,
        channel_mult=(1, 1, 1),
        num_res_blocks=0,
        codebook_size=16,
    )
    VQModel(cfg).save(d)
    return str(d)


def _keys(path):
    return sorted(t.key for t in iter_token_samples(str(path), SkipStats()))


def test_tokenize_counts_poison_json_and_keys_and_goes_on(tmp_path, vq_dir, capsys):
    clip0 = _clip(0)  # kept: two encodings of the same frames may differ by a rounding
    raw = _tar(
        tmp_path / "raw.tar",
        [
            ("g0.mp4", clip0),
            ("g0.json", _json("zero")),
            ("deep.mp4", _clip(1)),
            ("deep.json", DEEP),
            ("deepish.mp4", _clip(1)),
            ("deepish.json", DEEPISH),
            ("bigint.mp4", _clip(1)),
            ("bigint.json", BIG_INT),
            (".mp4", _clip(1)),  # an empty key
            (".json", _json("no key")),
            ("dir/.mp4", _clip(1)),
            ("dir/.json", _json("no key either")),
            ("./g1.mp4", _clip(2)),  # what `tar -cf x.tar .` writes: the key is g1
            ("./g1.json", _json("one")),
            ("g0.mp4", _clip(3)),  # the key again
            ("g0.json", _json("zero again")),
            ("g2.mp4", _clip(4)),
            ("g2.json", _json("two")),
        ],
    )
    out = tmp_path / "tok"
    argv = ["--vq", vq_dir, "--in", raw, "--out", str(out), "--fps", "2", "--quiet"]
    assert tokenize_main(argv) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["ok"] == 3 and stats["shards_done"] == 1
    assert stats["bad_json"] == 3 and stats["empty_key"] == 2 and stats["duplicate_key"] == 1
    assert _keys(out / "raw.tar") == ["g0", "g1", "g2"]
    got = {t.key: t for t in iter_token_samples(str(out / "raw.tar"), SkipStats())}
    assert got["g0"].meta["caption"] == "zero"  # the first of the duplicates is kept
    vc = video_to_codes(load_vq(vq_dir), clip0, fps=2.0)
    np.testing.assert_array_equal(got["g0"].codes, vc.codes)


@pytest.mark.slow  # five worker processes start (two, and three after the deaths)
def test_tokenize_workers_survive_killed_workers(tmp_path, vq_dir, monkeypatch, caplog):
    """SIGKILL and SIGSEGV of the worker on three designated samples of two shards: each is
    counted (worker_crash) under its name, every other sample is tokenized, no shard is lost."""
    victims = {"a1": "SIGKILL", "b1": "SIGSEGV", "b3": "SIGKILL"}
    layout = {"s1": ["a0", "a1", "a2"], "s2": ["b0", "b1", "b2", "b3"], "s3": ["c0", "c1"]}
    clips, shards, kill = {}, [], {}
    for s, keys in layout.items():
        members = []
        for key in keys:
            clips[key] = _clip(len(clips) + 10)
            members += [(f"{key}.mp4", clips[key]), (f"{key}.json", _json(key))]
            if key in victims:
                kill[killer.digest(clips[key])] = victims[key]
        shards.append(_tar(tmp_path / f"{s}.tar", members))
    monkeypatch.setattr(tokenize, "_worker_main", killer.worker_main)
    monkeypatch.setenv(killer.KILL_ENV, json.dumps(kill))
    out = tmp_path / "tok"
    opts = TokenizeOptions(fps=2.0)
    with caplog.at_level("ERROR", logger="longvideo.data.tokenize"):
        res = tokenize_shards(vq_dir, shards, str(out), opts, workers=2, progress=False)
    assert res["worker_crash"] == 3 and res["ok"] == 6
    assert res["shards_done"] == 3 and "shards_failed" not in res
    for key, sig in victims.items():
        assert any(f":{key}" in r.message and sig in r.message for r in caplog.records), key
    assert _keys(out / "s1.tar") == ["a0", "a2"]
    assert _keys(out / "s2.tar") == ["b0", "b2"]
    assert _keys(out / "s3.tar") == ["c0", "c1"]
    per_shard = json.loads((out / "s2.stats.json").read_text())
    assert per_shard["worker_crash"] == 2 and per_shard["ok"] == 2
    assert not [p.name for p in out.iterdir() if p.name.startswith(".tmp_")]
    vq = load_vq(vq_dir)  # the samples a restarted worker wrote equal a direct encode
    got = {t.key: t for t in iter_token_samples(str(out / "s2.tar"), SkipStats())}
    for key in ("b0", "b2"):
        np.testing.assert_array_equal(got[key].codes, video_to_codes(vq, clips[key], fps=2.0).codes)


# ---- token shards: TokenLoader ---------------------------------------------------------------


def _npy(descr: str, shape, body: bytes = b"", version=(1, 0)) -> bytes:
    f = io.BytesIO()
    fmt = np.lib.format
    fmt.write_array_header_1_0(f, {"descr": descr, "fortran_order": False, "shape": shape})
    head = f.getvalue()
    if version == (2, 0):  # the same header behind version 2's 4-byte length
        f = io.BytesIO()
        fmt.write_array_header_2_0(f, {"descr": descr, "fortran_order": False, "shape": shape})
        head = f.getvalue()
    return head + body


class _Boom:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _poison_npys(trap):
    """(name, bytes) of .npy members that are no plain array; none may allocate much or unpickle."""
    long_header = b"\x93NUMPY\x01\x00" + (60000).to_bytes(2, "little") + b" " * 60000
    return [
        ("empty", b""),
        ("magic only", b"\x93NUMPY\x01\x00"),
        ("absurd shape", _npy("<u2", (10**15, 2, 2), bytes(64))),
        ("absurd shape v2", _npy("<u2", (2**62, 2, 2), bytes(64), version=(2, 0))),
        ("shape lies", _npy("<u2", (4, 2, 2), bytes(8))),
        ("negative shape", _npy("<u2", (-4, 2, 2), bytes(8))),
        ("trailing bytes", _npy("<u2", (1, 2, 2), bytes(8 + 3))),
        ("object array", _npy("|O", (1,), pickle.dumps(np.array([_Boom(trap)], object)))),
        ("header of 60000 bytes", long_header),
        ("not a header", b"\x93NUMPY\x01\x00\x10\x00{'descr': ]]]]]]]]]}\n"),
        ("structured", _npy("[('a', '<u2')]", (1,), bytes(2))),
        ("bytes dtype", _npy("|S4", (1,), bytes(4))),
    ]


def test_load_npy_refuses_poison_and_reads_plain_arrays(tmp_path):
    trap = tmp_path / "UNPICKLED"
    for name, data in _poison_npys(str(trap)):
        with pytest.raises(ShardError) as e:
            load_npy(data, name)
        assert e.value.reason == "bad_array", name
    assert not trap.exists()
    rng = np.random.default_rng(0)
    for arr in (
        rng.integers(0, 9, (3, 2, 2)).astype(np.uint16),
        rng.standard_normal(5),
        np.asfortranarray(rng.integers(0, 9, (3, 4)).astype(">i4")),
        np.zeros((0, 2, 2), np.int32),
        np.array([True, False]),
    ):
        for data in (
            npy_bytes(arr),
            _npy(np.lib.format.dtype_to_descr(arr.dtype), arr.shape, arr.tobytes()),
        ):
            got = load_npy(data, "ok")
            assert got.dtype == arr.dtype and got.shape == arr.shape
            np.testing.assert_array_equal(got, arr)


K = 16
SPEC = SyntheticSpec(min_seconds=2, max_seconds=6)
LOADER_COUNTS = {"ok", "docs", "docs_cut", "groups_dropped", "tokens", "pad_tokens"}


def _good_members(key, seed):
    codes = np.random.default_rng(seed).integers(0, K, (4, 2, 2))
    return token_sample_members(key, codes, np.arange(4.0), {"caption": f"caption {key}"})


def _token_shard(path, trap):
    """Six good samples and a poison sample for every kind; returns the good keys and the counts."""
    members, good = [], []

    def add(key, parts):
        members.extend((f"{key}.{ext}", data) for ext, data in parts.items())

    for i in range(3):
        add(f"good{i}", _good_members(f"good{i}", i))
        good.append(f"good{i}")
    for j, (_name, data) in enumerate(_poison_npys(trap)):
        add(f"npy{j}", {**_good_members(f"npy{j}", 50 + j), "codes.npy": data})
    add("stamps", {**_good_members("stamps", 90), "timestamps.npy": _npy("<f8", (10**12,))})
    add("zero", {**_good_members("zero", 91), "codes.npy": npy_bytes(np.zeros((4, 0, 2), "u2"))})
    add("deep", {**_good_members("deep", 92), "json": DEEP})
    add("bigint", {**_good_members("bigint", 93), "json": BIG_INT})
    add("", _good_members("", 94))  # an empty key: members '.codes.npy', ...
    add("good0", _good_members("good0", 95))  # a duplicate key
    for i in range(3, 6):
        add(f"good{i}", _good_members(f"good{i}", i))
        good.append(f"good{i}")
    counts = {"bad_array": len(_poison_npys(trap)) + 2, "bad_json": 2}
    counts.update({"empty_key": 1, "duplicate_key": 1})
    _tar(path, members)
    return good, counts


@pytest.fixture(scope="module")
def tok():
    return train_text_tokenizer(text_corpus(40, spec=SPEC), vocab_size=300)


@pytest.mark.parametrize("streamed", [False, True])
def test_token_loader_skips_poison_and_trains_on_the_rest(tmp_path, tok, streamed):
    trap = tmp_path / "UNPICKLED"
    path = tmp_path / "tok.tar"
    good, counts = _token_shard(path, str(trap))
    stats = SkipStats()
    assert sorted(t.key for t in iter_token_samples(str(path), stats, K)) == sorted(good)
    assert {k: v for k, v in stats.items()} == counts
    src = f"file:{path}" if streamed else str(path)
    cfg = DataConfig(seq_len=64, shuffle_buffer=4, templates=("caption",))
    loader = TokenLoader(src, tok, tok.vocab(K), cfg, batch_size=1)
    seen = set()
    for _ in range(200):
        batch = next(loader)
        assert batch["input_ids"].shape == (1, 64)
        seen.update(k for row in loader.last_batch_keys for k in row)
        if loader.epoch >= 2:
            break
    assert loader.epoch >= 2 and seen == set(good)
    skipped = {k for k in loader.stats if k not in LOADER_COUNTS}
    assert skipped == set(counts) and all(loader.stats[k] >= v for k, v in counts.items())
    assert not trap.exists()
