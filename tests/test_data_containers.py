"""Only real containers are opened from untrusted bytes (longvideo.data.containers).

The attacks of tests/material/attacks.py name real files written into the working directory: a
35-byte concat script naming clip.avi, an HLS playlist naming seg.ts, an image-sequence pattern
and a concat script saved as ``upload.mp4``. Each goes through every entry point (read_video,
iter_video's first chunk, probe_video, video_to_codes, the decord backend, a shard through
tokenize): each is refused with a VideoError, and not one frame comes out. The attacks are first
shown to work with FFmpeg's defaults, so a refusal here is the defence's doing. Every accepted
container still reads (also tests/test_data_robust.py, frame by frame).
"""

import io
import tarfile

import pytest
import torch
from material.attacks import CONCAT, frames_via_ffmpeg, plant
from material.corpus import CONTAINERS, encode

from longvideo.data import containers, isolate
from longvideo.data.codes import video_to_codes
from longvideo.data.containers import (
    ALLOWED_FORMATS,
    FORMAT_WHITELIST,
    PROTOCOL_WHITELIST,
    check_container,
    detect_format,
    is_allowed,
)
from longvideo.data.shards import SkipStats, iter_token_samples
from longvideo.data.tokenize import TokenizeOptions, tokenize_shard
from longvideo.data.video import (
    DisallowedContainerError,
    VideoError,
    iter_video,
    probe_video,
    read_video,
)
from longvideo.vq import VQConfig, VQModel


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """The named files in a fresh working directory, and the attacks as files beside them."""
    monkeypatch.chdir(tmp_path)
    p = plant(tmp_path)
    (tmp_path / "upload.mp4").write_bytes(p.concat)
    (tmp_path / "list.m3u8").write_bytes(p.hls)
    return p


@pytest.fixture(autouse=True)
def _fresh_workers():
    isolate.shutdown()
    yield
    isolate.shutdown()


def _attacks(p):
    """(name, source, the format FFmpeg detects or None when it detects nothing)."""
    return [
        ("concat bytes", p.concat, "concat"),
        ("concat as upload.mp4", "upload.mp4", "concat"),
        ("hls bytes", p.hls, None),  # FFmpeg 8 detects HLS only from its extension or MIME type
        ("hls as list.m3u8", "list.m3u8", "hls"),
        ("image sequence bytes", p.pngs, "png_pipe"),
        ("image-sequence pattern", p.pattern, None),  # a path that is no file
    ]


def test_the_attacks_work_with_ffmpeg_defaults(planted):
    assert len(CONCAT) == 35
    assert frames_via_ffmpeg(planted.concat) == 40  # clip.avi's frames, from 35 bytes
    assert frames_via_ffmpeg(planted.hls, name="list.m3u8") == 40  # seg.ts's
    assert frames_via_ffmpeg(planted.pngs) == 3  # png_pipe: the images as frames
    import av

    with av.open(planted.pattern) as c:  # image2 reads img000.png .. img002.png
        assert c.format.name == "image2" and sum(1 for _ in c.decode(video=0)) == 3


def test_each_whitelist_alone_stops_the_concat_script(planted):
    """format_whitelist refuses the demuxer; the empty protocol_whitelist (copied into the nested
    context the concat demuxer opens) refuses the nested file even where the demuxer is allowed."""
    assert frames_via_ffmpeg(planted.concat, {"format_whitelist": FORMAT_WHITELIST}) == -1
    nested = {"format_whitelist": "concat,avi"}
    assert frames_via_ffmpeg(planted.concat, {**nested, "protocol_whitelist": "file"}) == 40
    assert (
        frames_via_ffmpeg(planted.concat, {**nested, "protocol_whitelist": PROTOCOL_WHITELIST})
        == -1
    )
    hls = {"format_whitelist": "hls,mpegts"}
    assert frames_via_ffmpeg(planted.hls, {**hls, "protocol_whitelist": "file"}, "a.m3u8") == 40
    assert (
        frames_via_ffmpeg(planted.hls, {**hls, "protocol_whitelist": PROTOCOL_WHITELIST}, "a.m3u8")
        == -1
    )


def _refused(fn, detected):
    with pytest.raises(VideoError) as e:
        fn()
    if detected is not None:
        assert isinstance(e.value, DisallowedContainerError)
        assert e.value.reason == "video_disallowed_container" and e.value.format == detected
        assert f"'{detected}'" in str(e.value)
    return e.value


def _tiny_vq():
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
    return VQModel(cfg).eval()


@pytest.mark.parametrize("backend", ["pyav", "decord"])
def test_every_entry_point_refuses_every_attack(planted, backend):
    vq = _tiny_vq()
    for name, src, detected in _attacks(planted):
        delivered = []

        def first_chunk():
            for frames, _ in iter_video(src, fps=8.0, chunk_frames=1, backend=backend):
                delivered.append(frames)
                break

        def codes():
            video_to_codes(
                vq, src, fps=8.0, backend=backend, on_frames=lambda f, t: delivered.append(f)
            )

        _refused(lambda: read_video(src, fps=8.0, backend=backend), detected)
        _refused(first_chunk, detected)
        _refused(lambda: probe_video(src, backend=backend), detected)
        _refused(codes, detected)
        assert delivered == [], name


def test_decord_child_is_never_given_a_refused_input(planted, monkeypatch):
    """The check runs before a child is taken; and a child asked directly refuses on its own."""

    def no_child():
        raise AssertionError("a decord child was asked to open a refused input")

    monkeypatch.setattr(isolate, "_acquire", no_child)
    for _name, src, detected in _attacks(planted):
        _refused(lambda: read_video(src, backend="decord"), detected)
    monkeypatch.undo()
    monkeypatch.chdir(planted.folder)
    w = isolate._Worker()
    try:  # what the child does when given the bytes anyway (a file replaced after the check)
        reply, data = w.call({"op": "open"}, CONCAT, 60.0, "<bytes>")
        assert not reply["ok"] and "'concat'" in reply["error"] and data == b""
        reply, data = w.call({"op": "open"}, planted.clip, 60.0, "<bytes>")
        assert reply["ok"] and reply["num_frames"] == 40
    finally:
        w.kill()


def test_refused_without_the_probe_that_names_it(planted, monkeypatch):
    """Where FFmpeg's probe cannot be called, the whitelist still refuses; the name is missing."""
    monkeypatch.setattr(containers, "_ffmpeg_probe", lambda: None)
    assert detect_format(planted.concat) is None
    with pytest.raises(DisallowedContainerError) as e:
        read_video(planted.concat)
    assert e.value.format == ""
    assert len(read_video(planted.clip, fps=2.0)) == 10


def test_tokenize_counts_a_refused_shard_member_and_goes_on(planted, tmp_path):
    vq = _tiny_vq()
    vq.save(tmp_path / "vq")
    from longvideo.vq import load_vq

    members = [
        ("a.avi", planted.clip),
        ("a.json", b'{"caption": "a"}'),
        ("evil.mp4", planted.concat),
        ("evil.json", b'{"caption": "b"}'),
        ("seq.mp4", planted.pngs),
        ("seq.json", b'{"caption": "c"}'),
        ("z.ts", planted.segment),
        ("z.json", b'{"caption": "d"}'),
    ]
    raw = tmp_path / "raw.tar"
    with tarfile.open(raw, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    out = tmp_path / "tok.tar"
    stats = tokenize_shard(load_vq(tmp_path / "vq"), str(raw), str(out), TokenizeOptions(fps=2.0))
    assert stats["video_disallowed_container"] == 2 and stats["ok"] == 2
    got = {t.key: t for t in iter_token_samples(str(out), SkipStats())}
    assert set(got) == {"a", "z"}
    assert got["a"].meta["tokenized"]["num_frames"] == 10  # 40 frames at 8 fps, read at 2 fps


def test_every_accepted_container_is_allowed(tmp_path):
    for enc in CONTAINERS:
        data = encode(enc)
        fmt = detect_format(data)
        assert fmt is not None and is_allowed(fmt), (enc.name, fmt)
        path = tmp_path / f"v.{enc.ext}"
        path.write_bytes(data)
        assert check_container(data, "<bytes>") == check_container(str(path), str(path))
    assert not any(is_allowed(f) for f in ("concat", "hls", "dash", "image2", "png_pipe", "tty"))
    assert is_allowed("mov,mp4,m4a,3gp,3g2,mj2") and "concat" not in ALLOWED_FORMATS
