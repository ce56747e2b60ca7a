"""decord in a child process: a decoder crash or hang costs one sample, never the process.

decord 0.6 kills the interpreter (SIGSEGV) on some damaged files (docs/data.md, "What crashes
decord"), so ``backend="decord"`` runs it in ``_decord_child.py``, a fresh interpreter that serves
one open video at a time and is reused (at most :data:`IDLE_WORKERS` idle ones kept). Deadlines,
memory limit, replies that are never unpickled and bytes spooled to a file: docs/data.md, "Backends".
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from longvideo.data.containers import check_container
from longvideo.data.video_base import (
    CorruptVideoError,
    EmptyVideoError,
    Orientation,
    UnsupportedVideoError,
    VideoError,
    VideoInfo,
    VideoSource,
    check_fps,
    check_frame_size,
)

OPEN_TIMEOUT_S = (
    120.0  # seconds the child may take to open a video (the whole file is indexed then)
)
READ_TIMEOUT_S, PER_FRAME_TIMEOUT_S = (
    60.0,
    2.0,
)  # seconds for one read request, plus per requested frame
MEMORY_GIB = float(
    os.environ.get("LONGVIDEO_DECODER_MEMORY_GIB", 16)
)  # a child's address space, 0: no limit
IDLE_WORKERS = 2  # idle decoder children kept for reuse per process
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_decord_child.py")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class DecoderCrashError(CorruptVideoError):
    """The decoder's child process died (a signal such as SIGSEGV, or an exit) on this video."""

    reason = "decoder_crash"


class DecoderTimeoutError(DecoderCrashError):
    """The decoder's child process did not answer in time and was killed."""

    reason = "decoder_timeout"


class _Worker:
    """One decoder child and its pipes."""

    def __init__(self):
        self.owner = os.getpid()
        self.spool = tempfile.mkdtemp(prefix="longvideo-decoder-")
        self.log = tempfile.TemporaryFile()
        # the child imports the package's leaf video_base: from this checkout, installed or not
        path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, TMPDIR=self.spool, MALLOC_ARENA_MAX="2", PYTHONPATH=path)
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-u", _CHILD, str(MEMORY_GIB)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            close_fds=True,
        )
        self._buf = bytearray()

    def _death(self, label: str, timed_out: bool = False) -> VideoError:
        if timed_out:
            self.kill()
            return DecoderTimeoutError(
                "decord did not answer in time; its process was killed", label
            )
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.returncode
        signalled = code is not None and code < 0
        how = f"killed by {signal.Signals(-code).name}" if signalled else f"exit status {code}"
        tail = self.stderr_tail()
        self.kill()
        return DecoderCrashError(
            f"decord's process died ({how})" + (f": {tail}" if tail else ""), label
        )

    def reset_log(self) -> None:
        """Empty the child's stderr file (the child shares its offset), so it does not grow with reuse."""
        try:
            self.log.seek(0)
            self.log.truncate()
        except (OSError, ValueError):
            pass

    def stderr_tail(self, limit: int = 300) -> str:
        try:
            self.log.seek(0, os.SEEK_END)
            size = self.log.tell()
            self.log.seek(max(0, size - limit))
            lines = [
                ln for ln in self.log.read().decode(errors="replace").splitlines() if ln.strip()
            ]
            return lines[-1][:200] if lines else ""
        except (OSError, ValueError):
            return ""

    def _recv(self, n: int, deadline: float, label: str) -> bytearray:
        fd = self.proc.stdout.fileno()
        while len(self._buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._death(label, timed_out=True)
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(fd, max(1 << 16, min(n - len(self._buf), 1 << 24)))
            if not chunk:
                raise self._death(label)
            self._buf += chunk
        out = self._buf[:n]  # a bytearray: frames made from it are writable
        del self._buf[:n]
        return out

    def call(
        self, header: dict, payload: bytes | None, timeout: float, label: str
    ) -> tuple[dict, bytearray]:
        """Send one request and wait for its reply (header, raw bytes)."""
        if payload is not None:
            header = dict(header, nbytes=len(payload))
        h = json.dumps(header).encode()
        try:
            self.proc.stdin.write(struct.pack(">I", len(h)) + h)
            if payload:
                self.proc.stdin.write(payload)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._death(label) from None
        deadline = time.monotonic() + timeout
        (size,) = struct.unpack(">I", self._recv(4, deadline, label))
        if size > 1 << 26:
            self.kill()
            raise DecoderCrashError(
                f"decord's process sent a malformed reply ({size}-byte header)", label
            )
        try:
            reply = json.loads(self._recv(size, deadline, label))
            nbytes = int(reply.get("nbytes", 0)) if reply.get("ok") else 0
        except (ValueError, TypeError, AttributeError):
            self.kill()
            raise DecoderCrashError("decord's process sent a malformed reply", label) from None
        data = self._recv(nbytes, deadline, label) if nbytes else b""
        return reply, data

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.log.close()
        shutil.rmtree(self.spool, ignore_errors=True)


_idle: list[_Worker] = []
_lock = threading.Lock()


def _acquire() -> _Worker:
    with _lock:
        while _idle:
            w = _idle.pop()
            if w.owner == os.getpid() and w.proc.poll() is None:
                return w
            if w.owner == os.getpid():
                w.kill()
    return _Worker()


def _release(w: _Worker) -> None:
    with _lock:
        if w.proc.poll() is None and w.owner == os.getpid() and len(_idle) < IDLE_WORKERS:
            _idle.append(w)
            return
    if w.owner == os.getpid():
        w.kill()


@atexit.register
def shutdown() -> None:
    """Stop the idle decoder children of this process."""
    with _lock:
        workers = [w for w in _idle if w.owner == os.getpid()]
        _idle.clear()
    for w in workers:
        w.kill()


class IsolatedDecordBackend:
    """The reader interface of longvideo.data.video (``info``, ``read``, ``close``) over a decord child."""

    name = "decord"

    def __init__(self, src: VideoSource, label: str, max_resolution: int):
        self.label = label
        self._w: _Worker | None = None
        if importlib.util.find_spec("decord") is None:  # a set-up error, not a bad video
            raise ImportError(
                "the decord video backend needs decord, an optional extra: "
                "pip install 'longvideo[decord]' (or use the default backend, pyav)"
            )
        # decord's own FFmpeg would open any format (concat scripts, playlists, image
        # sequences): the child is given only what PyAV opens as an allowed container
        check_container(src, label)
        self._w = _acquire()
        self._w.reset_log()
        if isinstance(src, (bytes, bytearray, memoryview)):
            req, payload = {"op": "open"}, bytes(src)
        else:
            req, payload = {"op": "open", "path": os.path.abspath(os.fspath(src))}, None
        reply, _ = self._call(req, payload, OPEN_TIMEOUT_S)
        try:
            n, fps = int(reply["num_frames"]), float(reply["fps"])
            w, h = int(reply["width"]), int(reply["height"])
            facts = reply["facts"]
            if facts is not None:
                matrix = None if facts["matrix"] is None else [int(x) for x in facts["matrix"]]
                declared = None if facts["declared"] is None else float(facts["declared"])
                # decord 0.6 turns frames by the matrix's (or the tag's) angle, without its flips
                done = Orientation.from_container(matrix, facts["rotate"], flips=False)
                o = Orientation.from_container(matrix, facts["rotate"], facts["sar"]).after(done)
        except (KeyError, TypeError, ValueError):
            raise self._malformed() from None
        try:
            if (
                facts is None
            ):  # decord shows stored frames; without PyAV's facts it cannot tell which way up
                why = reply.get("facts_error")
                raise UnsupportedVideoError(
                    "decord cannot tell how this video is shown (PyAV, which reads "
                    f"its display matrix for decord, cannot open it: {why}); use "
                    "backend=pyav",
                    label,
                )
            if n <= 0:
                raise EmptyVideoError("decord finds no frames", label)
            check_fps(fps, label)
            check_frame_size(w, h, max_resolution, label)
        except VideoError:
            self.close()
            raise
        self.stored = (h, w)
        self.info = VideoInfo.of_stored(
            w, h, o, num_frames=n, fps=fps, duration=n / fps, declared=declared
        )
        self.exhausted, self.end, self.gaps = (
            False,
            None,
            [],
        )  # decord reads every frame asked or raises

    def _malformed(self) -> DecoderCrashError:
        """Kill the child that sent a reply this side cannot read."""
        if self._w is not None:
            self._w.kill()
            self._w = None
        return DecoderCrashError("decord's process sent a malformed reply", self.label)

    def _call(self, req: dict, payload: bytes | None, timeout: float) -> tuple[dict, bytearray]:
        if self._w is None:
            raise CorruptVideoError("the decoder was closed", self.label)
        try:
            reply, data = self._w.call(req, payload, timeout, self.label)
        except VideoError:
            self._w = None  # the worker killed itself
            raise
        if not reply.get("ok"):
            err = str(reply.get("error", "unknown error"))[:300]
            if req["op"] == "open":
                self.close()
                raise CorruptVideoError(f"decord cannot open it: {err}", self.label)
            raise CorruptVideoError(f"decord decode failed: {err}", self.label)
        return reply, data

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stored uint8 (t, H, W, 3) frames and float64 (t,) start times of ``indices``."""
        indices = np.asarray(indices, np.int64)
        reply, data = self._call(
            {"op": "read", "indices": indices.tolist()},
            None,
            READ_TIMEOUT_S + PER_FRAME_TIMEOUT_S * len(indices),
        )
        try:
            shape = tuple(int(x) for x in reply["shape"])
            times = np.asarray(reply["times"], np.float64)
        except (KeyError, TypeError, ValueError):
            raise self._malformed() from None
        want = (len(indices), *self.stored, 3)
        if shape != want or len(data) != int(np.prod(shape)) or times.shape != (len(indices),):
            raise CorruptVideoError(
                f"decord returned frames {shape} for a request of {want}", self.label
            )
        return np.frombuffer(data, np.uint8).reshape(shape), times

    def close(self) -> None:
        w, self._w = self._w, None
        if w is None:
            return
        try:
            w.call({"op": "close"}, None, OPEN_TIMEOUT_S, self.label)
        except VideoError:
            return  # the worker is gone already
        _release(w)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
