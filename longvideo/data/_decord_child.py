"""The decord decoder's child process (longvideo/data/isolate.py). Run as a script, not imported.

It imports numpy, decord, PyAV, the leaf ``video_base`` and ``containers`` (not torch), so it starts
fast. PyAV reads beside decord what decord does not apply: display matrix, rotate tag, sample aspect
ratio and declared duration (``facts``); it opens the file first, by the container allow-list's
rules, so decord never opens a format outside it (the parent checked it too). Requests come one at
a time on stdin, replies go to stdout (anything the C libraries print goes to stderr): a 4-byte
big-endian length, a JSON header and, when the header names ``nbytes``, that many raw bytes; never
a pickle.

    open  {"op": "open", "path": P} or {"op": "open", "nbytes": N} + N bytes
          -> {"ok": true, "num_frames", "fps", "width", "height", "facts": {"matrix", "rotate", "sar",
             "declared"} or null with "facts_error"}
    read  {"op": "read", "indices": [...]}
          -> {"ok": true, "shape": [t, h, w, 3], "times": [...], "nbytes"} + bytes
    close {"op": "close"} -> {"ok": true}
    failure of any request -> {"ok": false, "error": "..."}
"""

import io
import json
import math
import os
import resource
import struct
import sys
import tempfile

from longvideo.data.containers import SafeInput
from longvideo.data.video_base import (
    DisallowedContainerError,
    display_matrix,
    frame_rate,
    stream_facts,
)


def _read_exact(f, n):
    chunks, left = [], n
    while left:
        b = f.read(min(left, 1 << 20))
        if not b:
            raise EOFError("parent closed the pipe")
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)


def _facts(path):
    """What PyAV reads of how the video is shown (see video_base.Orientation); an error message
    instead. Opened by the container allow-list's rules (longvideo.data.containers): a format
    outside it raises DisallowedContainerError, and decord is not given the file."""
    src = path.getvalue() if hasattr(path, "getvalue") else path
    try:
        inp = SafeInput(src, "<child>")
    except DisallowedContainerError:
        raise
    except Exception as e:  # noqa: BLE001 - reported to the parent, which refuses the video
        return None, (str(e).splitlines() or [type(e).__name__])[0][:200]
    try:
        c = inp.container
        s = c.streams.video[0]
        declared, tag, sar = stream_facts(c, s, frame_rate(s) or 1.0)
        matrix = None
        for f in c.decode(s):
            matrix = display_matrix(f)
            break
        return {
            "matrix": matrix,
            "rotate": tag,
            "declared": declared,
            "sar": float(sar) if sar else None,
        }, None
    except Exception as e:  # noqa: BLE001 - reported to the parent, which refuses the video
        return None, (str(e).splitlines() or [type(e).__name__])[0][:200]
    finally:
        inp.close()


def main():
    limit = int(float(sys.argv[1]) * (1 << 30)) if len(sys.argv) > 1 else 0
    if (
        limit > 0
    ):  # a huge declared frame size fails an allocation here instead of exhausting the machine
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints from C libraries land on stderr, never in a reply

    def reply(header, payload=b""):
        h = json.dumps(header).encode()
        out.write(struct.pack(">I", len(h)) + h)
        if payload:
            out.write(payload)
        out.flush()

    import decord
    import numpy as np

    vr, spool = None, None

    def drop():
        nonlocal vr, spool
        vr = None
        if spool is not None:
            os.unlink(spool)
            spool = None

    while True:
        try:
            (n,) = struct.unpack(">I", _read_exact(inp, 4))
        except EOFError:
            return
        req = json.loads(_read_exact(inp, n))
        data = _read_exact(inp, req["nbytes"]) if req.get("nbytes") else None
        op = req.get("op")
        try:
            if op == "open":
                drop()
                path = req.get("path")
                if data is not None and os.environ.get("LONGVIDEO_DECORD_FILEOBJ") == "1":
                    path, data = (
                        io.BytesIO(data),
                        None,
                    )  # a file object, as a reader in-process would (tests)
                if (
                    data is not None
                ):  # spooled: decord crashes on truncated AVIs read from a file object
                    fd, spool = tempfile.mkstemp(prefix="longvideo-decord-")
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                    path, data = spool, None
                facts, why = _facts(path)  # first: decord only opens an allowed container
                vr = decord.VideoReader(path, ctx=decord.cpu(0), num_threads=0)
                count, fps = len(vr), float(vr.get_avg_fps())
                h, w = vr[0].shape[:2] if count > 0 else (0, 0)
                vr.seek(0)
                reply(
                    {
                        "ok": True,
                        "num_frames": count,
                        "fps": fps if math.isfinite(fps) else 0.0,
                        "width": int(w),
                        "height": int(h),
                        "facts": facts,
                        "facts_error": why,
                    }
                )
            elif op == "read":
                idx = [int(i) for i in req["indices"]]
                frames = np.ascontiguousarray(vr.get_batch(idx).asnumpy(), dtype=np.uint8)
                times = np.asarray(vr.get_frame_timestamp(idx), np.float64).reshape(-1, 2)[:, 0]
                payload = frames.tobytes()
                header = {
                    "shape": list(frames.shape),
                    "times": times.tolist(),
                    "nbytes": len(payload),
                }
                reply({"ok": True, **header}, payload)
            elif op == "close":
                drop()
                reply({"ok": True})
            else:
                reply({"ok": False, "error": f"unknown request {op!r}"})
        except Exception as e:  # decord raises RuntimeError/DECORDError for what it cannot read
            msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            reply({"ok": False, "error": msg})


if __name__ == "__main__":
    main()
