"""Atomic file writes: readers see the old file or the new one, never a partial one.

    with atomic_open("out/shard.tar", "wb") as f:   # a temporary file beside the target, fsynced and
        f.write(...)                                  # renamed over it when the block ends cleanly
    write_json_atomic("out/stats.json", counts)
    with atomic_dir("exported", marker="config.json") as tmp:   # a directory's files, marker last
        write(tmp)

The rename never crosses file systems; an exception inside the block leaves the target untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

TMP_PREFIX = ".tmp_"
"""Prefix of temporary files and directories that a killed writer may leave behind."""


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file, or a directory's entries (a rename inside it), to disk; a no-op where that fails."""
    with contextlib.suppress(OSError):
        fd = os.open(str(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under root (before a directory is renamed into place)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


@contextlib.contextmanager
def atomic_open(
    path: str | os.PathLike, mode: str = "w", *, file_mode: int = 0o644
) -> Iterator[IO]:
    """Open a temporary file beside `path` for writing; on a clean exit it replaces `path`."""
    if not any(c in mode for c in "wx"):
        raise ValueError(f"atomic_open writes a new file; mode {mode!r} does not")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, mode.replace("x", "w")) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode)  # mkstemp creates 0600 files
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    fsync_path(path.parent)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, marker: str, clear: tuple[str, ...] = ()) -> Iterator[Path]:
    """A temporary directory beside `path` to write a directory's files into. On a clean exit they
    move into `path` (made if needed; other files there stay) one rename each, with `marker` (the
    file that says the directory is complete, such as config.json) removed from `path` first and
    moved in last: whoever sees `marker` sees a complete set of files, the old one or the new.
    `clear`: glob patterns of files in `path` that the old set had and the new one may not (an
    earlier export's weight shards), removed once the marker is gone, before the new files move in.
    An exception (or a killed process) leaves `path` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{path.name}.", dir=path.parent))
    try:
        yield tmp
        fsync_tree(tmp)
        path.mkdir(exist_ok=True)
        names = sorted(os.listdir(tmp), key=lambda n: n == marker)  # the marker last
        if marker in names:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path / marker)
            fsync_path(path)
        for stale in {p for pattern in clear for p in path.glob(pattern)}:
            stale.unlink(missing_ok=True)
        for name in names:
            dst = path / name
            if (tmp / name).is_dir() and dst.is_dir() and not dst.is_symlink():
                shutil.rmtree(dst)  # a directory is replaced whole
            os.replace(tmp / name, dst)
            if name == marker:
                fsync_path(path)
        fsync_path(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def write_json_atomic(path: str | os.PathLike, obj, **dump_kwargs) -> None:
    """JSON with indent=1 and sorted keys unless told otherwise."""
    write_text_atomic(path, json.dumps(obj, **{"indent": 1, "sort_keys": True, **dump_kwargs}))
