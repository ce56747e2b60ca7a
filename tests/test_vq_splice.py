"""SplicingEncoder: a video with frames replaced encodes to exactly what encoding the edited video
from the start gives, while re-encoding only the part the edit reaches."""

import numpy as np
import pytest
import torch

from longvideo.vq import VQConfig, VQModel, encode_video
from longvideo.vq.codec import SplicingEncoder


def _vq(mode: str) -> VQModel:
    torch.manual_seed(0)
    extra = (
        dict(temporal_downsample=4, temporal_kernel=3, downsample=8, channel_mult=(1, 2, 4))
        if mode == "causal3d"
        else dict(downsample=4, channel_mult=(1, 2))
    )
    cfg = VQConfig(
        mode=mode,
        resolution=16,
        codebook_size=64,
        patch_size=2,
        channels=8,
        num_res_blocks=1,
        **extra,
    )
    return VQModel(cfg).eval()


@pytest.mark.parametrize("mode", ["2d", "causal3d"])
def test_spliced_codes_equal_a_full_encode(mode):
    vq = _vq(mode)
    g = torch.Generator().manual_seed(1)
    T = 77  # causal3d: frame 0, 19 whole groups, one padded group
    frames = torch.randint(0, 256, (T, 16, 16, 3), dtype=torch.uint8, generator=g)
    enc = SplicingEncoder(vq, frames, batch_frames=8)
    assert torch.equal(enc.codes, encode_video(vq, frames, batch_frames=8))
    flash = torch.full((16, 16, 3), 200, dtype=torch.uint8)
    changed = 0
    for edits in (
        {0: flash},
        {1: flash},
        {37: flash},
        {40: flash, 41: flash},
        {T - 1: flash},
        {5: flash, 60: flash},
    ):
        edited = frames.clone()
        for k, f in edits.items():
            edited[k] = f
        want = encode_video(vq, edited, batch_frames=8)
        got = enc.codes_with(edits)
        assert torch.equal(got, want), edits
        changed += not torch.equal(got, enc.codes)
    assert (
        changed >= 3
    )  # the edits are visible in the codes (a random tiny VQ may quantise one away)


def test_causal3d_splice_stops_where_the_edit_no_longer_reaches(monkeypatch):
    """An edit early in a long video re-encodes a few pieces, not the rest of the video."""
    from longvideo.vq import codec

    vq = _vq("causal3d")
    frames = torch.from_numpy(
        np.random.default_rng(2).integers(0, 256, (401, 16, 16, 3), dtype=np.uint8)
    )
    enc = SplicingEncoder(vq, frames, batch_frames=8)
    calls = []
    real = codec._encode_piece
    monkeypatch.setattr(codec, "_encode_piece", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = enc.codes_with({20: torch.zeros(16, 16, 3, dtype=torch.uint8)})
    edited = frames.clone()
    edited[20] = 0
    monkeypatch.setattr(codec, "_encode_piece", real)
    assert torch.equal(got, encode_video(vq, edited, batch_frames=8))
    assert 1 <= len(calls) < len(enc.piece_codes) // 4, (len(calls), len(enc.piece_codes))


def test_splice_rejects_frames_outside_the_video():
    vq = _vq("2d")
    enc = SplicingEncoder(vq, torch.zeros(4, 16, 16, 3, dtype=torch.uint8))
    with pytest.raises(IndexError, match="outside"):
        enc.codes_with({4: torch.zeros(16, 16, 3, dtype=torch.uint8)})
