"""Which container formats video bytes may be opened as, and the one way every reader opens them.

FFmpeg picks its demuxer from the content. Some demuxers read other files: the concat demuxer
(``ffconcat version 1.0`` / ``file clip.avi``) decodes the files its script names, HLS and DASH
playlists name their segments, image2 reads a numbered image sequence. Opened with every demuxer
enabled, 35 bytes of script sent as a video would decode a file beside the process. So every
decode (PyAV in this process, and PyAV's check before decord's child is given anything) opens its
input with

- ``format_whitelist``: FFmpeg's probe still picks the demuxer, but one outside
  :data:`ALLOWED_FORMATS` is refused before its header is read;
- ``protocol_whitelist`` empty: the input is always a Python file object (bytes or a path opened
  here), so FFmpeg opens no URL of its own, and a demuxer that tries to open another file or URL
  (the whitelists are copied into nested contexts) is refused.

A refused format raises :class:`DisallowedContainerError` naming the format FFmpeg's own probe
(``av_probe_input_format3``, called on the first MiB as FFmpeg does) detected. docs/data.md,
"Formats"; docs/security.md, "Untrusted video bytes".
"""

from __future__ import annotations

import ctypes
import functools
import io
import os

import av

from longvideo.data.video_base import (
    CorruptVideoError,
    DisallowedContainerError,
    UnsupportedVideoError,
    VideoError,
    VideoSource,
)

ALLOWED_FORMATS: tuple[str, ...] = (
    "mov",  # FFmpeg's "mov,mp4,m4a,3gp,3g2,mj2" demuxer: mp4, m4v, mov, 3gp
    "mp4",
    "matroska",  # "matroska,webm": mkv, webm
    "webm",
    "avi",
    "mpegts",
    "ogg",
    "flv",
    "mpeg",  # MPEG program stream (.mpg, .mpeg)
    "gif",
    # raw video elementary streams: an .mpg written without a program stream, and what FFmpeg's
    # probe finds in a file whose container header is damaged (the damaged corpus read so before)
    "mpegvideo",
    "m4v",
    "h264",
    "hevc",
)
"""FFmpeg demuxer names untrusted video bytes may be opened with: single-file containers and raw
video streams, whose demuxers read only their own input. Never concat, hls, dash, image2, the
``*_pipe`` image demuxers, or any other demuxer."""

FORMAT_WHITELIST = ",".join(ALLOWED_FORMATS)
PROTOCOL_WHITELIST = ""
"""No protocol: the input is a file object handed to FFmpeg; nested opens are refused."""

_PROBE_MIN, _PROBE_MAX = 2048, 1 << 20  # FFmpeg's av_probe_input_buffer2 window (PROBE_BUF_MAX)
_PROBE_RETRY = 25  # AVPROBE_SCORE_RETRY: below this score FFmpeg reads more before it decides
_PADDING = 64  # AVPROBE_PADDING_SIZE zero bytes after the probe buffer


def input_options(options: dict | None = None) -> dict[str, str]:
    """``options`` plus the two whitelists (which a caller cannot override)."""
    return {
        **(options or {}),
        "format_whitelist": FORMAT_WHITELIST,
        "protocol_whitelist": PROTOCOL_WHITELIST,
    }


def is_allowed(format_name: str) -> bool:
    """Whether an FFmpeg demuxer name (a comma-separated list such as "matroska,webm") is allowed,
    as FFmpeg's ``format_whitelist`` matches it (any name of the list)."""
    return any(n in ALLOWED_FORMATS for n in format_name.split(","))


class _ProbeData(ctypes.Structure):  # libavformat's AVProbeData (public, unchanged since 2013)
    _fields_ = [
        ("filename", ctypes.c_char_p),
        ("buf", ctypes.c_void_p),
        ("buf_size", ctypes.c_int),
        ("mime_type", ctypes.c_char_p),
    ]


@functools.lru_cache(maxsize=1)
def _ffmpeg_probe():
    """libavformat's ``av_probe_input_format3`` from the copy PyAV loaded (None where it cannot be
    found: then refusals name no format)."""
    candidates = []
    try:
        with open("/proc/self/maps") as f:
            candidates = [ln.split()[-1] for ln in f if "libavformat" in ln and "/" in ln]
    except OSError:
        pass
    base = os.path.dirname(os.path.dirname(os.path.abspath(av.__file__)))
    for d in (os.path.join(base, "av.libs"), os.path.join(base, "av", ".dylibs")):
        if os.path.isdir(d):
            candidates += [os.path.join(d, n) for n in os.listdir(d) if "libavformat" in n]
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
    for path in dict.fromkeys(candidates):
        try:
            fn = ctypes.CDLL(path, mode=mode).av_probe_input_format3
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_void_p
        fn.argtypes = [ctypes.POINTER(_ProbeData), ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        return fn
    return None


def detect_format(head: bytes, filename: str = "") -> str | None:
    """The demuxer FFmpeg's probe picks for a file that starts with ``head`` (and is called
    ``filename``: some probes weigh the extension), as ``avformat_open_input`` does: windows of
    2 KiB doubling to 1 MiB (or the end of the data), the first format that scores above the
    retry threshold (above 0 in the 1 MiB window). None: nothing matched, or the probe cannot be
    called here."""
    fn = _ffmpeg_probe()
    if fn is None:
        return None
    head = bytes(head[:_PROBE_MAX])
    size = _PROBE_MIN
    while True:
        n = min(size, len(head))
        buf = ctypes.create_string_buffer(head[:n] + bytes(_PADDING), n + _PADDING)
        pd = _ProbeData(os.fsencode(filename), ctypes.cast(buf, ctypes.c_void_p), n, None)
        score = ctypes.c_int(0)
        fmt = fn(ctypes.byref(pd), 1, ctypes.byref(score))
        if fmt and score.value > (_PROBE_RETRY if size < _PROBE_MAX else 0):
            return ctypes.cast(fmt, ctypes.POINTER(ctypes.c_char_p))[0].decode()
        if n >= len(head) or size >= _PROBE_MAX:
            return None
        size *= 2


def _head(src: VideoSource) -> bytes:
    if isinstance(src, (bytes, bytearray, memoryview)):
        return bytes(memoryview(src)[:_PROBE_MAX])
    try:
        with open(src, "rb") as f:
            return f.read(_PROBE_MAX)
    except OSError:
        return b""


def refusal(src: VideoSource, label: str) -> DisallowedContainerError | None:
    """The error for ``src`` when FFmpeg detects a format outside the allow-list, else None."""
    name = "" if isinstance(src, (bytes, bytearray, memoryview)) else os.fspath(src)
    fmt = detect_format(_head(src), name)
    if fmt is None or is_allowed(fmt):
        return None
    return DisallowedContainerError(fmt, label)


class SafeInput:
    """An FFmpeg input opened by the allow-list's rules: ``container`` (a PyAV InputContainer) over
    a file object this class owns; ``close()`` closes both."""

    def __init__(self, src: VideoSource, label: str, options: dict | None = None):
        if isinstance(src, (bytes, bytearray, memoryview)):
            self._file = io.BytesIO(bytes(src))
        else:
            try:
                self._file = open(src, "rb")
            except OSError as e:
                raise VideoError(f"cannot open it: {e.strerror or e}", label) from e
        try:
            self.container = av.open(self._file, mode="r", options=input_options(options))
        except Exception as e:
            self._file.close()
            refused = refusal(src, label)
            if refused is not None:
                raise refused from None
            if isinstance(e, av.error.ArgumentError) and _ffmpeg_probe() is None:
                # EINVAL is also what the format whitelist answers; the probe cannot say which
                raise DisallowedContainerError("", label) from e
            raise CorruptVideoError(f"PyAV cannot open it: {str(e)[:200]}", label) from e
        fmt = self.container.format.name
        if not is_allowed(fmt):  # never reached while FFmpeg honours format_whitelist
            self.close()
            raise DisallowedContainerError(fmt, label)

    def close(self) -> None:
        try:
            self.container.close()
        finally:
            self._file.close()


def check_container(src: VideoSource, label: str) -> str:
    """Open ``src`` as :class:`SafeInput` does and close it: the demuxer's name, or the error a
    reader would raise (decord's child is only given what passes). A container without a video
    stream is refused here too."""
    inp = SafeInput(src, label)
    try:
        if not inp.container.streams.video:
            raise UnsupportedVideoError("no video stream", label)
        return inp.container.format.name
    finally:
        inp.close()
