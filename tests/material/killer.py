"""A tokenize worker that dies on designated samples, as one hit by a segfault or the OOM killer.

``tokenize_shards`` starts its workers with ``longvideo.data.tokenize._worker_main``; a test puts
:func:`worker_main` there and names the victims in the environment (which spawned workers
inherit): ``KILL_ENV`` holds JSON ``{sha256 of the video bytes: signal name}``. In the worker, the
sample whose video has that digest makes the process send itself that signal just before its
video would be decoded; every other sample is tokenized as usual.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal

KILL_ENV = "LONGVIDEO_TEST_KILL_ON"


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def worker_main(conn, vq_dir, threads):
    from longvideo.data import tokenize

    victims = json.loads(os.environ.get(KILL_ENV, "{}"))
    real = tokenize.video_to_codes

    def video_to_codes(vq, video, **kw):
        sig = victims.get(digest(bytes(video)))
        if sig is not None:
            os.kill(os.getpid(), getattr(signal, sig))
        return real(vq, video, **kw)

    tokenize.video_to_codes = video_to_codes
    tokenize._worker_main(conn, vq_dir, threads)
