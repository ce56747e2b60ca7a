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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from longvideo.atomic import atomic_open
from longvideo.data.streams import (
    ShardError,
    SkipStats,
    default_limits,
    iter_tar,
    part_bytes,
    split_name,
    unique_keys,
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


def index_tar(path: str, stats: SkipStats | None = None) -> list[Member]:
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


MAX_JSON_DEPTH = 32
"""Deepest nesting of lists and objects a sample's json may have (the fields it uses need 3)."""


def json_depth(obj, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of decoded json (0 for a scalar), counted without recursion; stops once over
    ``limit``."""
    deepest, stack = 0, [(obj, 1)]
    while stack and deepest <= limit:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


def parse_json(data: bytes, key: str) -> dict:
    """Decode and check a sample's json (see docs/data.md for the fields); anything else, however
    deep or odd, is a ShardError (``bad_json``)."""
    try:
        meta = json.loads(data.decode("utf-8"))
    except ValueError as e:  # not UTF-8, not JSON, an integer of more than 4300 digits
        raise ShardError("bad_json", f"{key}.json is not valid JSON ({str(e)[:200]})") from None
    except RecursionError:
        raise ShardError("bad_json", f"{key}.json is nested too deeply") from None
    if json_depth(meta) > MAX_JSON_DEPTH:
        raise ShardError("bad_json", f"{key}.json is nested deeper than {MAX_JSON_DEPTH} levels")
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
    fps = meta.get("fps", 1.0)
    if not (isinstance(fps, (int, float)) and not isinstance(fps, bool) and 0 < fps < math.inf):
        raise ShardError("bad_json", f"{key}.json: fps must be a positive number")
    return meta


@dataclass
class RawSample:
    key: str
    video: bytes
    video_ext: str
    meta: dict


def iter_raw_samples(path: str, stats: SkipStats) -> Iterator[RawSample]:
    """Samples of a raw shard (a path or URL, streamed) with a usable key (each key once), a video
    and a valid json; the rest, and failures of the shard itself, are counted in ``stats``."""
    for key, parts in unique_keys(iter_tar(path, stats, VIDEO_EXTS + ("json",)), stats, path):
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


NPY_KINDS = "biuf"
"""dtype kinds a token shard's arrays may have: bool, signed and unsigned integers, floats."""


def load_npy(data: bytes, key: str) -> np.ndarray:
    """A plain numeric array from a .npy member, checked before anything is allocated: numpy's
    header reader (versions 1 and 2, at most 10,000 header bytes) gives the dtype, which must be
    of :data:`NPY_KINDS`, and the shape, whose bytes must be exactly the rest of the member; the
    array is a read-only view of them. Anything else (an empty member, a damaged or absurd
    header, an object array, which would need pickle) is a ShardError (``bad_array``)."""
    f = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    except Exception as e:  # noqa: BLE001 - numpy's header parser raises many kinds on damage
        why = f"{type(e).__name__}: {str(e)[:200]}"
        raise ShardError("bad_array", f"{key}: not a plain .npy array ({why})") from None
    if dtype.hasobject or dtype.kind not in NPY_KINDS or dtype.shape or dtype.names:
        raise ShardError("bad_array", f"{key}: .npy dtype {dtype} is not plain numbers")
    count = math.prod(shape)
    body = len(data) - f.tell()
    if any(d < 0 for d in shape) or count * dtype.itemsize != body:
        raise ShardError(
            "bad_array",
            f"{key}: .npy header says {dtype} {tuple(shape)} ({count * dtype.itemsize} bytes) "
            f"but {body} bytes follow it",
        )
    if count == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer(data, dtype, count, f.tell()).reshape(shape, order="F" if fortran else "C")


def decode_token_sample(key: str, parts: dict, codebook_size: int | None = None) -> TokenSample:
    """Check and decode the three members of a token-shard sample (bytes, or streamed parts: a
    part's ShardError is raised first)."""
    blobs = {ext: part_bytes(p) for ext, p in parts.items()}
    for ext in TOKEN_EXTS:
        if ext not in blobs:
            raise ShardError(f"missing_{ext.split('.')[0]}", f"{key}: no {ext} member")
    codes = load_npy(blobs["codes.npy"], key)
    stamps = load_npy(blobs["timestamps.npy"], key)
    if codes.ndim != 3 or not np.issubdtype(codes.dtype, np.integer) or codes.size == 0:
        raise ShardError(
            "bad_array",
            f"{key}: codes must be integer (G, h, w) with G, h, w > 0, got {codes.dtype} "
            f"{codes.shape}",
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

    def __init__(self, path: str, stats: SkipStats | None = None):
        self.path = path
        samples = group_samples(index_tar(path, stats), TOKEN_EXTS)
        self.samples = list(unique_keys(samples, stats, path))

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, i: int, codebook_size: int | None = None) -> TokenSample:
        key, parts = self.samples[i]
        limits = default_limits(TOKEN_EXTS)
        with open(self.path, "rb") as f:
            blobs = {ext: read_member(f, m, limits[ext]) for ext, m in parts.items()}
        return decode_token_sample(key, blobs, codebook_size)


def iter_token_tar(src: str, stats: SkipStats) -> Iterator[tuple[str, dict]]:
    """The samples of a token shard streamed front to back, as (key, parts), numbered as
    :class:`TokenShard` numbers them (usable keys, each once)."""
    return unique_keys(iter_tar(src, stats, TOKEN_EXTS), stats, src)


def iter_token_samples(
    path: str, stats: SkipStats, codebook_size: int | None = None
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
