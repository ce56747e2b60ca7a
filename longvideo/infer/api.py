"""The OpenAI chat-completions request as `longvideo serve` reads it, and the video it names; every
refusal is an `ApiError` with its HTTP status and the field it is about (docs/serving.md)."""

from __future__ import annotations

import base64
import binascii
import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


class ApiError(Exception):
    """A refused request: HTTP `status`, the message, the request field it is about."""

    def __init__(
        self, status: int, message: str, param: Optional[str] = None, headers: Optional[dict] = None
    ):
        super().__init__(f"{param}: {message}" if param else message)
        self.status, self.param, self.headers = status, param, headers or {}

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {"message": str(self), "type": kind, "param": self.param, "code": self.status}
        }


@dataclass
class ChatRequest:
    turns: list[tuple[str, Optional[str]]]
    """(question, answer) per user turn; the last answer is None (to be generated)."""
    video_url: str
    video_field: str
    model: Optional[str] = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    fps: Optional[float] = None
    """Extensions (openai-python: extra_body): fps and max_frames, else the server's --fps, --max-frames."""
    max_frames: Optional[int] = None


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ApiError(400, message, param)


def _number(
    body: dict,
    key: str,
    integer: bool = False,
    low: Optional[float] = None,
    high: Optional[float] = None,
    open_low: bool = False,
):
    """body[key] (None when absent), checked to be a number (an integer) in range."""
    v = body.get(key)
    if v is not None:
        _check(
            isinstance(v, int if integer else (int, float)) and not isinstance(v, bool),
            key,
            f"must be {'an integer' if integer else 'a number'}",
        )
        _check(
            low is None or (v > low if open_low else v >= low),
            key,
            f"must be {'>' if open_low else '>='} {low}",
        )
        _check(high is None or v <= high, key, f"must be <= {high}")
    return v


def _content(content, where: str, user: bool) -> tuple[str, list[tuple[str, str]]]:
    """A message's text and its video URLs [(url, field)]."""
    if isinstance(content, str):
        return content.strip(), []
    _check(isinstance(content, list), where, "must be a string or a list of content parts")
    texts, videos = [], []
    for j, part in enumerate(content):
        at, kind = f"{where}[{j}]", part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            _check(isinstance(part.get("text"), str), f"{at}.text", "must be a string")
            texts.append(part["text"].strip())
        elif kind == "video_url" and user:
            url = part.get("video_url")
            url = url.get("url") if isinstance(url, dict) else url
            _check(
                isinstance(url, str) and bool(url),
                f"{at}.video_url.url",
                "must be a non-empty string",
            )
            videos.append((url, f"{at}.video_url.url"))
        else:
            allowed = "text and video_url" if user else "text"
            _check(False, f"{at}.type", f"{kind!r} is not supported here ({allowed} parts)")
    return "\n".join(t for t in texts if t), videos


def parse_request(raw: bytes) -> ChatRequest:
    """Check a chat-completions body; ApiError(400) naming the field otherwise."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not JSON: {e}") from None
    _check(isinstance(body, dict), "body", "must be a JSON object")
    msgs = body.get("messages")
    _check(isinstance(msgs, list) and len(msgs) > 0, "messages", "must be a non-empty list")
    turns, videos = [], []
    for i, m in enumerate(msgs):
        role, want = (
            m.get("role") if isinstance(m, dict) else None,
            "assistant" if i % 2 else "user",
        )
        _check(
            role not in ("system", "developer"),
            f"messages[{i}].role",
            f"{role!r} messages are not supported: the model's prompt template has no place for them",
        )
        _check(
            role == want,
            f"messages[{i}].role",
            f"must be {want!r}: messages alternate user and assistant",
        )
        text, found = _content(m.get("content"), f"messages[{i}].content", role == "user")
        if found:
            _check(
                i == 0 and len(found) == 1,
                found[-1][1],
                "one video per conversation, in the first user message",
            )
            videos = found
        if role == "user":
            _check(bool(text), f"messages[{i}].content", "has no text: ask a question")
            turns.append((text, None))
        else:
            turns[-1] = (turns[-1][0], text)
    _check(
        len(msgs) % 2 == 1, f"messages[{len(msgs) - 1}].role", "the last message must be the user's"
    )
    _check(
        bool(videos),
        "messages[0].content",
        "has no video_url part: the model answers questions about a video",
    )
    _check(body.get("n", 1) == 1, "n", "only 1 is supported")
    _check(isinstance(body.get("model", ""), str), "model", "must be a string")
    _check(isinstance(body.get("stream", False), bool), "stream", "must be true or false")
    opts = body.get("stream_options") or {}
    _check(isinstance(opts, dict), "stream_options", "must be an object")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    _check(
        isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop),
        "stop",
        "must be a non-empty string or a list of up to 4 of them",
    )
    max_tokens = _number(body, "max_completion_tokens", True, 1) or _number(
        body, "max_tokens", True, 1
    )
    return ChatRequest(
        turns,
        videos[0][0],
        videos[0][1],
        body.get("model"),
        body.get("stream", False),
        bool(opts.get("include_usage")),
        max_tokens,
        _number(body, "temperature", low=0),
        _number(body, "top_p", low=0, high=1, open_low=True),
        _number(body, "seed", True),
        stop,
        _number(body, "fps", low=0, open_low=True),
        _number(body, "max_frames", True, 1),
    )


@dataclass(frozen=True)
class MediaPolicy:
    max_bytes: int
    """Largest video accepted (413 above it)."""
    media_dir: Optional[Path] = None
    """file:// URLs are read from inside it only (403 otherwise, and without it)."""
    allow_remote: bool = False
    """http(s) URLs are fetched only when set (403 otherwise)."""
    timeout_s: float = 30.0


IMAGES = {b"\x89PNG": "a PNG image", b"\xff\xd8\xff": "a JPEG image", b"BM": "a BMP image"}
"""Still images FFmpeg would read as one-frame videos: refused (an animated GIF is a video)."""


def load_video(url: str, where: str, policy: MediaPolicy) -> bytes:
    """The bytes of the video at `url` within the policy; ApiError otherwise."""
    data = _fetch(url, where, policy)
    kind = next((k for magic, k in IMAGES.items() if data.startswith(magic)), None)
    kind = kind or ("a WebP image" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else None)
    _check(kind is None, where, f"this is {kind}, not a video")
    return data


def _fetch(url: str, where: str, policy: MediaPolicy) -> bytes:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""

    def size_ok(n: int) -> None:
        if n > policy.max_bytes:
            raise ApiError(
                413,
                f"the video is {n / 2**20:.1f} MiB, over the server's limit of "
                f"{policy.max_bytes / 2**20:.1f} MiB (--max-upload-mb)",
                where,
            )

    if scheme == "data":
        head, _, payload = url.partition(",")
        _check(
            head.lower().endswith(";base64"), where, "a data URL must be data:video/...;base64,..."
        )
        _check(
            head[5:].lower().startswith("video/"),
            where,
            f"a data URL must hold a video, not {head[5:].split(';')[0]!r}",
        )
        size_ok(len(payload) * 3 // 4)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ApiError(400, f"the data URL is not valid base64: {e}", where) from None
    if scheme == "file":
        if policy.media_dir is None:
            raise ApiError(
                403, "file:// URLs are refused: the server was started without --media-dir", where
            )
        rest = url[5:].split("?", 1)[0].split("#", 1)[0]
        rest = rest[2:] if rest.startswith("//") else rest  # file:///abs, file://rel
        path = Path(urllib.parse.unquote(rest))
        root = policy.media_dir.resolve()
        full = (root / path).resolve()  # an absolute path replaces the root
        if ".." in path.parts or not full.is_relative_to(root):
            raise ApiError(
                403,
                "a file:// path may not contain '..'"
                if ".." in path.parts
                else "the file is outside --media-dir",
                where,
            )
        if not full.is_file():
            raise ApiError(404, "no such file in --media-dir", where)
        size_ok(full.stat().st_size)
        return full.read_bytes()
    if scheme in ("http", "https"):
        if not policy.allow_remote:
            raise ApiError(
                403, "remote media are refused: start the server with --allow-remote-media", where
            )
        try:
            with urllib.request.urlopen(url, timeout=policy.timeout_s) as r:
                data = r.read(policy.max_bytes + 1)
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ApiError(400, f"cannot fetch the video: {e}", where) from None
        size_ok(len(data))
        return data
    raise ApiError(
        400, "must be a data:video/...;base64, URL, a file:// path or an http(s) URL", where
    )
