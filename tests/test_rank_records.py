"""Typed records between ranks (longvideo.distributed.broadcast_record): every kind of field
round-trips exactly, in one process and through a 2-rank gloo broadcast from either rank; a record
of another type, or a field no record carries, is refused with its name."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from longvideo.distributed import broadcast_array, broadcast_record, decode_record, encode_record
from longvideo.infer.evals import TrialCodes
from longvideo.infer.mcq import PendingQuestions, VideoMessage


@dataclass(frozen=True)
class Everything:
    flag: bool
    count: int
    ratio: float
    name: str
    nothing: str | None
    ints: np.ndarray
    floats: np.ndarray
    nested: tuple


def everything() -> Everything:
    return Everything(
        flag=True,
        count=-(2**63),
        ratio=-0.1,
        name="naïve → ok\t\n",
        nothing=None,
        ints=np.arange(24, dtype=np.int32).reshape(2, 3, 4) - 7,
        floats=np.array([[1.5, -np.inf], [np.nan, 1e-300]]),
        nested=(("q1", "subtitles"), ("q2", ""), (), (False, 2**63 - 1, np.zeros((0, 3)))),
    )


def same(a, b) -> bool:
    """Equal values of equal types (arrays: dtype, shape and bits; NaN equals NaN)."""
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and a.tobytes() == b.tobytes()
        )
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def check_everything(got: Everything) -> None:
    want = everything()
    assert type(got) is Everything
    for name in Everything.__dataclass_fields__:
        expected = getattr(want, name)
        if name == "ints":  # integer arrays travel as int64
            expected = expected.astype(np.int64)
        assert same(getattr(got, name), expected), name


def test_every_field_kind_round_trips():
    check_everything(decode_record(Everything, encode_record(everything())))
    codes = np.random.default_rng(0).integers(0, 8192, (5, 3, 4, 4))
    trial = decode_record(TrialCodes, encode_record(TrialCodes(32, 3, codes)))
    assert (trial.length, trial.trial) == (32, 3) and same(trial.codes, codes)


def test_refusals_name_the_field_or_the_type():
    with pytest.raises(TypeError, match=r"Everything.nested\[1\] holds a list"):
        encode_record(Everything(True, 1, 1.0, "", None, np.zeros(1), np.zeros(1), ((), [1])))
    with pytest.raises(ValueError, match=r"Everything.count = 18446744073709551616 does not fit"):
        encode_record(Everything(True, 2**64, 1.0, "", None, np.zeros(1), np.zeros(1), ()))
    with pytest.raises(TypeError, match="holds a ndarray"):  # text arrays have no kind here
        encode_record(TrialCodes(1, 1, np.array(["a"])))
    with pytest.raises(ValueError, match="not a TrialCodes record"):
        decode_record(TrialCodes, encode_record(PendingQuestions(("a",))))
    with pytest.raises(TypeError, match="dataclass instance"):
        encode_record({"trial": 1})


def _broadcast_body(rank, world):
    import torch.distributed as dist

    got = broadcast_record(everything() if rank == 1 else None, Everything, src=1)
    check_everything(got)
    # one video's message on a sub-group whose rank 0 is global rank 1
    group = dist.new_group([1, 0])
    stamps = np.array([0.0, 4.0, 8.0])
    sent = VideoMessage(
        video="/data/v.mp4",
        codes=np.arange(12).reshape(3, 2, 2),
        timestamps=stamps,
        num_frames=9,
        duration=9.5,
        fps=1.0,
        subtitles=(("q1", "hello"), ("q2", "")),
    )
    msg = broadcast_record(sent if rank == 1 else None, VideoMessage, src=1, group=group)
    assert msg.video == "/data/v.mp4" and msg.skip_reason == "" and msg.subtitles == sent.subtitles
    video = msg.encoded()
    assert same(video.codes, np.arange(12).reshape(3, 2, 2)) and same(video.timestamps, stamps)
    assert (video.num_frames, video.duration, video.fps) == (9, 9.5, 1.0)
    skip = VideoMessage(video="/data/w.mp4", skip_reason="missing_video", skip_detail="gone")
    msg = broadcast_record(skip if rank == 0 else None, VideoMessage, src=0)
    assert msg == skip and msg.encoded() is None
    # every rank refuses an array of another record type
    arr = encode_record(PendingQuestions(("x",))) if rank == 0 else None
    with pytest.raises(ValueError, match="not a TrialCodes record"):
        decode_record(TrialCodes, broadcast_array(arr, src=0))


@pytest.mark.distributed
def test_a_record_round_trips_through_a_two_rank_gloo_broadcast():
    from distributed import run_ranks

    run_ranks(_broadcast_body, world=2, timeout=120)
