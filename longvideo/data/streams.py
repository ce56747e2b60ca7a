"""Shard sources: local paths, brace patterns and the URLs webdataset understands, read as streams.

    expand_sources("https://host/data/shard-{000000..000099}.tar")   # 100 URLs
    expand_sources("data/raw")                                       # the *.tar files of a folder
    for key, parts in iter_tar(url, stats, ("mp4", "json")): ...      # parts: {ext: bytes or ShardError}

A source (docs/data.md, "Remote shards") is read once, front to back, nothing copied to disk, by
the untrusted-input rules defined here and shared with longvideo.data.shards (docs/data.md,
"Untrusted shards"). A failure is counted by reason and ends the shard.
"""

from __future__ import annotations

import glob
import http.client
import logging
import os
import re
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_JSON_BYTES = 16 << 20  # largest member accepted, per kind
MAX_VIDEO_BYTES = 8 << 30
MAX_NPY_BYTES = 1 << 30


class ShardError(ValueError):
    """A shard or one of its samples is unusable; ``reason`` is the counter it is filed under."""

    def __init__(self, reason: str, message: str):
        self.reason = reason
        super().__init__(message)


class SkipStats(Counter):
    """Counts of skipped samples by reason (plus ``ok``); logs each skip once at WARNING."""

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        self[reason] += 1
        log.warning("skipped %s (%s)%s", where, reason, f": {detail}" if detail else "")


def expand_shards(spec: str | os.PathLike | Iterable[str]) -> list[str]:
    """Sorted shard paths from a directory, a glob, a brace pattern (``a-{000..009}.tar``, or
    alternatives ``tokens/{short,long}``) or a list of those."""
    if not isinstance(spec, (str, os.PathLike)):
        return sorted(set(p for s in spec for p in expand_shards(s)))
    spec = str(spec)
    if os.path.isdir(spec):
        return sorted(str(p) for p in Path(spec).glob("*.tar"))
    alt = re.search(r"\{([^{}]*,[^{}]*)\}", spec)
    if alt:
        return expand_shards(
            [spec[: alt.start()] + a + spec[alt.end() :] for a in alt.group(1).split(",")]
        )
    m = re.search(r"\{(\d+)\.\.(\d+)\}", spec)
    if m:
        head, tail, width = spec[: m.start()], spec[m.end() :], len(m.group(1))
        numbers = range(int(m.group(1)), int(m.group(2)) + 1)
        return expand_shards([f"{head}{i:0{width}d}{tail}" for i in numbers])
    if any(c in spec for c in "*?["):
        return sorted(glob.glob(spec))
    return [spec] if os.path.isfile(spec) else []


def split_name(name: str) -> tuple[str, str]:
    """'dir/abc.codes.npy' -> ('dir/abc', 'codes.npy'): the key ends at the basename's first dot.
    A leading './' (tar's name for members of the current directory) is not part of the key."""
    while name.startswith("./"):
        name = name[2:]
    head, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), (ext.lower() if dot else "")


def usable_member(info: tarfile.TarInfo, stats: SkipStats | None, where: str) -> bool:
    """Whether a member is a regular file with a relative name without '..' or NUL (usable as a key,
    never followed as a path); links, devices and escaping names are counted (``unsafe_member``)."""
    name = info.name
    safe = bool(name) and not name.startswith("/") and "\x00" not in name
    if info.isreg() and safe and ".." not in name.replace("\\", "/").split("/"):
        return True
    if stats is not None and not info.isdir():
        stats.skip("unsafe_member", f"{where}:{name!r}")
    return False


def unique_keys(samples: Iterable[tuple[str, T]], stats: SkipStats | None, where: str):
    """The samples of one shard whose key is usable, each key once: a key with an empty name (a
    member called '.mp4' or 'dir/.json') is counted as ``empty_key``, a key met before in the
    shard as ``duplicate_key`` (the first is kept), and both are skipped."""
    seen: set[str] = set()
    for key, parts in samples:
        reason = (
            "empty_key" if not key.rpartition("/")[2] else "duplicate_key" if key in seen else None
        )
        if reason is not None:
            if stats is not None:
                stats.skip(reason, f"{where}:{key!r}")
            continue
        seen.add(key)
        yield key, parts


HTTP_TIMEOUT_S = (
    60.0  # socket timeout of http(s) reads: a stalled connection fails (shard_io_error)
)
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+):")

Part = bytes | ShardError


def part_bytes(part: Part) -> bytes:
    """A streamed part's bytes; raises the ShardError (``too_large``) it stands for."""
    if isinstance(part, ShardError):
        raise part
    return part


class SourceIOError(OSError):
    """Reading a shard's source failed (connection refused or dropped, a pipe command failed)."""

    reason = "shard_io_error"


def _schemes() -> set[str]:
    try:
        from webdataset.gopen import gopen_schemes

        known = {k for k in gopen_schemes if not k.startswith("_")}
    except ImportError:  # pragma: no cover
        known = set()
    return known | {"http", "https", "pipe", "file"}


def is_url(src) -> bool:
    """Whether ``src`` names a URL (``scheme:...`` with a scheme webdataset opens), not a local path."""
    if not isinstance(src, str):
        return False
    m = _SCHEME.match(src)
    return bool(m) and m.group(1).lower() in _schemes()


def expand_sources(spec) -> list[str]:
    """Shard sources from a spec: a local directory, glob or brace pattern (sorted paths, see
    :func:`expand_shards`), a URL or URL brace pattern (in pattern order),
    or a list of any of these (concatenated; duplicates dropped, first kept)."""
    if isinstance(spec, (list, tuple)) and not any(is_url(str(s)) for s in spec):
        return expand_shards([os.fspath(s) for s in spec])  # local only: sorted, as before
    if isinstance(spec, (list, tuple)):
        return list(dict.fromkeys(p for s in spec for p in expand_sources(s)))
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if is_url(spec):
        from webdataset.shardlists import expand_urls

        return list(dict.fromkeys(expand_urls(spec)))
    return expand_shards(spec)


def shard_name(src: str) -> str:
    """The file name a source stands for: a path's or URL's last component, or for ``pipe:`` the
    last word of the command that looks like a file name (the output of ``tokenize`` is named after it)."""
    if is_url(src) and src.lower().startswith("pipe:"):
        words = [w for w in src[5:].split() if re.search(r"\.tar(\.\w+)?$", w)]
        name = words[-1].rsplit("/", 1)[-1] if words else ""
    elif is_url(src):
        name = urllib.parse.unquote(urllib.parse.urlparse(src).path.rsplit("/", 1)[-1])
    else:
        name = Path(src).name
    if not name or name in (".", "..") or "/" in name or "\x00" in name:
        raise ValueError(
            f"cannot name an output after {src!r}: give each shard a distinct file name "
            "ending in .tar"
        )
    return name


class _Guarded:
    """A binary reader whose failures surface as :class:`SourceIOError` (tar errors stay tar errors)."""

    def __init__(self, f, where: str, length: int | None = None):
        self.f, self.where, self.length, self.done = f, where, length, 0

    def read(self, n: int = -1) -> bytes:
        try:
            data = self.f.read(n)
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise SourceIOError(f"{self.where}: read failed: {type(e).__name__}: {e}") from e
        self.done += len(data)
        if not data and n != 0 and self.length is not None and self.done < self.length:
            # http.client ends a read early without an error when the connection drops
            raise SourceIOError(
                f"{self.where}: the connection closed after {self.done} of {self.length} bytes"
            )
        return data

    def close(self) -> None:
        try:
            self.f.close()
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise SourceIOError(f"{self.where}: {type(e).__name__}: {e}") from e


def open_source(src: str):
    """A binary stream of the source's bytes (read front to back; close it when done)."""
    try:
        if not is_url(src):
            return _Guarded(open(src, "rb"), src)
        scheme = _SCHEME.match(src).group(1).lower()
        if scheme in ("http", "https"):
            req = urllib.request.Request(
                src, headers={"User-Agent": "longvideo", "Accept-Encoding": "identity"}
            )
            resp = urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S)
            length = resp.headers.get("Content-Length")
            return _Guarded(resp, src, int(length) if length and length.isdigit() else None)
        from webdataset.gopen import gopen

        return _Guarded(gopen(src, "rb"), src)
    except SourceIOError:
        raise
    except (OSError, http.client.HTTPException, ValueError, urllib.error.URLError) as e:
        raise SourceIOError(f"{src}: cannot open: {type(e).__name__}: {e}") from e


def default_limits(exts: Iterable[str]) -> dict[str, int]:
    """Size bound of each extension: json 16 MiB, arrays 1 GiB, anything else (video) 8 GiB."""
    return {
        e: MAX_JSON_BYTES
        if e == "json"
        else MAX_NPY_BYTES
        if e.endswith("npy")
        else MAX_VIDEO_BYTES
        for e in exts
    }


def iter_tar(
    src: str, stats: SkipStats, exts: Iterable[str], limits: dict[str, int] | None = None
) -> Iterator[tuple[str, dict[str, Part]]]:
    """The samples of one tar shard as ``(key, {ext: bytes})``, streamed front to back.

    Consecutive members with the same key and different extensions form a sample (as
    longvideo.data.shards.group_samples does); members of other extensions are passed over unread.
    A member over its bound (``limits``, default :func:`default_limits`) is given as a ShardError
    (``too_large``) for the caller to count with its sample. A failure (source, tar format) is
    counted in ``stats`` under its reason and ends the shard, after yielding the sample read so far
    when the failure is in the tar format.
    """
    wanted = tuple(exts)
    limits = dict(default_limits(wanted), **(limits or {}))
    key, parts = None, {}
    try:
        f = open_source(src)
    except SourceIOError as e:
        stats.skip(e.reason, src, str(e))
        return
    failed = None
    try:
        tf = tarfile.open(fileobj=f, mode="r|", ignore_zeros=True)
        while True:
            info = tf.next()
            if info is None:
                break
            tf.members = []  # a stream keeps no index
            if not usable_member(info, stats, src):
                continue
            k, ext = split_name(info.name)
            if ext not in wanted:
                continue
            if key is not None and (k != key or ext in parts):
                yield key, parts
                key, parts = None, {}
            if info.size > limits[ext]:
                data: Part = ShardError(
                    "too_large", f"member {k}.{ext} has {info.size} bytes (limit {limits[ext]})"
                )
            else:
                data = tf.extractfile(info).read()
                if len(data) != info.size:
                    raise ShardError("truncated_tar", f"member {k}.{ext} is cut short")
            key = k
            parts[ext] = data
    except SourceIOError as e:
        failed, key = e, None  # the sample being read is lost with the rest of the shard
    except ShardError as e:
        failed = e
    except tarfile.ReadError as e:
        msg = str(e)
        failed = ShardError(
            "truncated_tar" if "unexpected end" in msg else "corrupt_tar", f"{src}: {msg}"
        )
    except (EOFError, tarfile.TarError) as e:
        failed = ShardError("corrupt_tar", f"{src}: {type(e).__name__}: {e}")
    finally:
        try:
            f.close()
        except (
            SourceIOError
        ) as e:  # a pipe command that exited non-zero: the cause of any tar error
            failed, key = e, None
    # a member cut short (truncated_tar) leaves its sample incomplete: counted with the failure
    if key is not None and not (
        isinstance(failed, ShardError) and failed.reason == "truncated_tar"
    ):
        yield key, parts
    if failed is not None:
        stats.skip(failed.reason, src, str(failed))
