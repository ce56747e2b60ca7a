"""Shard files: webdataset-style tars of raw samples (video + json) and of token samples (codes,
timestamps, json), read as untrusted input (docs/data.md, "Raw shard format", "Token shard format",
"Untrusted shards"). Invalid samples are counted by reason and skipped. Raw shards are streamed;
token shards on local disk are read by random access, remote ones streamed.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import tarfile
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import numpy as np

from longvideo.atomic import atomic_open
from longvideo.data.streams import (
    ShardError,
    SkipStats,
    default_limits,
    iter_tar,
    part_bytes,
    split_name,
    usable_member,
)
from longvideo.data.video_base import VIDEO_EXTS  # the one list of accepted video extensions

log = logging.getLogger(__name__)

TOKEN_EXTS: tuple[str, ...] = ("codes.npy", "timestamps.npy", "json")


@dataclass(frozen=True, slots=True)
class Member:
    key: str
    ext: str
    offset: int
    size: int


def index_tar(path: str, stats: Optional[SkipStats] = None) -> list[Member]:
    """Headers of the regular-file members of a tar, in order, without reading their data."""
    out = []
    try:
        with tarfile.open(path, mode="r:", ignore_zeros=True) as tf:
            while True:
                try:
                    info = tf.next()
                except (tarfile.ReadError, EOFError, OSError) as e:
                    if stats is not None:
                        stats.skip("corrupt_tar", path, str(e))
                    break
                if info is None:
                    break
                if not usable_member(info, stats, path):
                    continue
                key, ext = split_name(info.name)
                out.append(Member(key, ext, info.offset_data, info.size))
    except (tarfile.ReadError, OSError) as e:
        raise ShardError("corrupt_tar", f"{path}: cannot read as tar ({e})") from e
    return out


def group_samples(
    members: list[Member], exts: Iterable[str]
) -> list[tuple[str, dict[str, Member]]]:
    """Consecutive members with the same key form a sample; members with other extensions are ignored."""
    wanted = set(exts)
    samples: list[tuple[str, dict[str, Member]]] = []
    for m in members:
        if m.ext not in wanted:
            continue
        if samples and samples[-1][0] == m.key and m.ext not in samples[-1][1]:
            samples[-1][1][m.ext] = m
        else:
            samples.append((m.key, {m.ext: m}))
    return samples


def read_member(f, m: Member, limit: int) -> bytes:
    if m.size > limit:
        raise ShardError("too_large", f"member {m.key}.{m.ext} has {m.size} bytes (limit {limit})")
    f.seek(m.offset)
    data = f.read(m.size)
    if len(data) != m.size:
        raise ShardError("truncated_tar", f"member {m.key}.{m.ext} is cut short")
    return data


def parse_json(data: bytes, key: str) -> dict:
    """Decode and check a sample's json (see docs/data.md for the fields)."""
    try:
        meta = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ShardError("bad_json", f"{key}.json is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ShardError("bad_json", f"{key}.json must hold an object")
    if "caption" in meta and not isinstance(meta["caption"], str):
        raise ShardError("bad_json", f"{key}.json: caption must be a string")
    for item in meta.get("qa", []) if isinstance(meta.get("qa", []), list) else [None]:
        if not (
            isinstance(item, dict)
            and isinstance(item.get("question"), str)
            and isinstance(item.get("answer"), str)
        ):
            raise ShardError(
                "bad_json", f"{key}.json: qa must be a list of {{question, answer}} strings"
            )
    for seg in meta.get("segments", []) if isinstance(meta.get("segments", []), list) else [None]:
        ok = isinstance(seg, dict) and isinstance(seg.get("text"), str)
        ok = ok and all(
            isinstance(seg.get(k), (int, float))
            and not isinstance(seg.get(k), bool)
            and math.isfinite(seg[k])
            for k in ("start", "end")
        )
        if not ok or seg["end"] < seg["start"]:
            raise ShardError(
                "bad_json", f"{key}.json: segments must be a list of {{start <= end, text}}"
            )
    if "fps" in meta and not (isinstance(meta["fps"], (int, float)) and meta["fps"] > 0):
        raise ShardError("bad_json", f"{key}.json: fps must be a positive number")
    return meta


@dataclass
class RawSample:
    key: str
    video: bytes
    video_ext: str
    meta: dict


def iter_raw_samples(path: str, stats: SkipStats) -> Iterator[RawSample]:
    """Samples of a raw shard (a path or URL, streamed) with a video and a valid json; the rest,
    and failures of the shard itself, are counted in ``stats``."""
    for key, parts in iter_tar(path, stats, VIDEO_EXTS + ("json",)):
        where = f"{path}:{key}"
        videos = [e for e in VIDEO_EXTS if e in parts]
        if "json" not in parts:
            stats.skip("missing_json", where)
            continue
        if not videos:
            stats.skip("missing_video", where)
            continue
        try:
            meta = parse_json(part_bytes(parts["json"]), key)
            video = part_bytes(parts[videos[0]])
        except ShardError as e:
            stats.skip(e.reason, where, str(e))
            continue
        yield RawSample(key=key, video=video, video_ext=videos[0], meta=meta)


@dataclass
class TokenSample:
    """codes: integer (G, h, w); timestamps: float64 (G,); meta: the sample's json."""

    key: str
    codes: np.ndarray
    timestamps: np.ndarray
    meta: dict


def load_npy(data: bytes, key: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (
        ValueError,
        OSError,
        EOFError,
    ) as e:  # allow_pickle=False raises ValueError for object arrays
        raise ShardError("bad_array", f"{key}: not a plain .npy array ({e})") from None


def decode_token_sample(key: str, parts: dict, codebook_size: Optional[int] = None) -> TokenSample:
    """Check and decode the three members of a token-shard sample (bytes, or streamed parts: a
    part's ShardError is raised first)."""
    blobs = {ext: part_bytes(p) for ext, p in parts.items()}
    for ext in TOKEN_EXTS:
        if ext not in blobs:
            raise ShardError(f"missing_{ext.split('.')[0]}", f"{key}: no {ext} member")
    codes = load_npy(blobs["codes.npy"], key)
    stamps = load_npy(blobs["timestamps.npy"], key)
    if codes.ndim != 3 or not np.issubdtype(codes.dtype, np.integer) or codes.shape[0] == 0:
        raise ShardError(
            "bad_array",
            f"{key}: codes must be integer (G, h, w) with G > 0, got {codes.dtype} {codes.shape}",
        )
    if (
        stamps.shape != codes.shape[:1]
        or not np.issubdtype(stamps.dtype, np.floating)
        or not np.isfinite(stamps).all()
    ):
        raise ShardError(
            "bad_array",
            f"{key}: timestamps must be finite float ({codes.shape[0]},), got "
            f"{stamps.dtype} {stamps.shape}",
        )
    lo, hi = int(codes.min()), int(codes.max())
    if lo < 0 or (codebook_size is not None and hi >= codebook_size):
        raise ShardError(
            "bad_array", f"{key}: codes span [{lo}, {hi}], outside [0, {codebook_size})"
        )
    return TokenSample(
        key=key,
        codes=codes.astype(np.int64),
        timestamps=stamps.astype(np.float64),
        meta=parse_json(blobs["json"], key),
    )


class TokenShard:
    """Random access to the samples of one token shard (headers indexed once, data read on demand)."""

    def __init__(self, path: str, stats: Optional[SkipStats] = None):
        self.path = path
        self.samples = group_samples(index_tar(path, stats), TOKEN_EXTS)

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, i: int, codebook_size: Optional[int] = None) -> TokenSample:
        key, parts = self.samples[i]
        limits = default_limits(TOKEN_EXTS)
        with open(self.path, "rb") as f:
            blobs = {ext: read_member(f, m, limits[ext]) for ext, m in parts.items()}
        return decode_token_sample(key, blobs, codebook_size)


def iter_token_samples(
    path: str, stats: SkipStats, codebook_size: Optional[int] = None
) -> Iterator[TokenSample]:
    """The valid samples of a local token shard, read by random access (the loader streams remote ones)."""
    try:
        shard = TokenShard(path, stats)
    except ShardError as e:
        stats.skip(e.reason, path, str(e))
        return
    for i in range(len(shard)):
        try:
            yield shard.read(i, codebook_size)
        except ShardError as e:
            stats.skip(e.reason, f"{path}:{shard.samples[i][0]}", str(e))


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


def token_sample_members(
    key: str, codes: np.ndarray, timestamps: np.ndarray, meta: dict
) -> dict[str, bytes]:
    """The members of a token-shard sample; codes use the narrowest unsigned dtype that fits."""
    codes = np.asarray(codes)
    dtype = np.uint16 if codes.size == 0 or int(codes.max()) < (1 << 16) else np.int32
    return {
        "codes.npy": npy_bytes(codes.astype(dtype)),
        "timestamps.npy": npy_bytes(np.asarray(timestamps, np.float64)),
        "json": json.dumps(meta, sort_keys=True).encode(),
    }


class ShardWriter:
    """Writes a tar shard atomically (longvideo.atomic): readers never see a partial shard.

    Member names are ``KEY.EXT``; mtime/uid/gid are zeroed so the same samples give the same bytes.
    """

    def __init__(self, path: str | os.PathLike):
        self._file = atomic_open(path, "wb")
        self._tar = tarfile.open(
            fileobj=self._file.__enter__(), mode="w", format=tarfile.USTAR_FORMAT
        )

    def write(self, key: str, members: dict[str, bytes]) -> None:
        if "/" in key or key.startswith(".") or not key:
            raise ValueError(f"bad sample key {key!r}")
        for ext, data in members.items():
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            self._tar.addfile(info, io.BytesIO(data))

    def close(self) -> None:
        """Finish the shard and move it into place."""
        self._tar.close()
        self._file.__exit__(None, None, None)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
            return False
        try:  # drop the partial shard: the target path is left as it was
            self._tar.close()
        finally:
            err = RuntimeError("shard aborted")
            self._file.__exit__(type(err), err, None)
        return False
