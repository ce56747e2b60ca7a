"""The OpenAI chat-completions request as `longvideo serve` reads it, and the video it names.

    req = parse_request(body)                     # bytes of a POST /v1/chat/completions body
    req.turns                                     # [(question, answer), ..., (question, None)]
    data = load_video(req.video_url, req.video_field, MediaPolicy(max_bytes=..., media_dir=...))

Messages alternate user / assistant and end with a user message; their content is a string or a
list of parts, `{"type": "text", "text": ...}` and `{"type": "video_url", "video_url": {"url": ...}}`
as vLLM and SGLang accept them. The one video belongs to the first user message. The URL is a
`data:video/...;base64,` URL, a `file://` path inside the media directory, or an `http(s)` URL when
remote media are allowed. Every refusal is an `ApiError` with the HTTP status and the field it names
(`messages[0].content[1].video_url.url`), so a client learns what to change.
"""

from __future__ import annotations

import base64
import binascii
import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


class ApiError(Exception):
    """A request the server refuses: HTTP `status`, a message, the request field it is about."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(f"{param}: {message}" if param else message)
        self.status, self.param, self.headers = status, param, headers or {}

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.status}}


@dataclass
class ChatRequest:
    turns: list[tuple[str, Optional[str]]]
    """(question, answer) per user turn; the last answer is None (to be generated)."""
    video_url: str
    video_field: str
    """Where the URL sits in the request, for messages."""
    model: Optional[str] = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    fps: Optional[float] = None
    """Extension (openai-python: extra_body): frames per second read; default the server's --fps."""
    max_frames: Optional[int] = None
    """Extension: most frames read; default the server's --max-frames."""


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ApiError(400, message, param)


def _number(body: dict, key: str, *, integer: bool = False, low: Optional[float] = None,
            high: Optional[float] = None, low_open: bool = False):
    v = body.get(key)
    if v is None:
        return None
    kind = int if integer else (int, float)
    _check(isinstance(v, kind) and not isinstance(v, bool), key, f"must be {'an integer' if integer else 'a number'}")
    _check(low is None or (v > low if low_open else v >= low), key, f"must be {'>' if low_open else '>='} {low}")
    _check(high is None or v <= high, key, f"must be <= {high}")
    return v


def _text_of(content: Any, where: str, *, allow_video: bool) -> tuple[str, list[tuple[str, str]]]:
    """The text of a message's content and its video URLs [(url, field)]."""
    if isinstance(content, str):
        return content, []
    _check(isinstance(content, list), where, "must be a string or a list of content parts")
    texts, videos = [], []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        _check(isinstance(part, dict), at, "must be an object with a type")
        kind = part.get("type")
        if kind == "text":
            _check(isinstance(part.get("text"), str), f"{at}.text", "must be a string")
            texts.append(part["text"])
        elif kind == "video_url" and allow_video:
            v = part.get("video_url")
            url = v.get("url") if isinstance(v, dict) else v
            _check(isinstance(url, str) and bool(url), f"{at}.video_url.url", "must be a non-empty string")
            videos.append((url, f"{at}.video_url.url"))
        else:
            allowed = "text and video_url parts" if allow_video else "text parts only"
            _check(False, f"{at}.type", f"{kind!r} is not supported here ({allowed})")
    return "\n".join(t.strip() for t in texts if t.strip()), videos


def parse_request(raw: bytes) -> ChatRequest:
    """Validate a chat-completions body; raises ApiError(400) naming the field."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not JSON: {e}") from None
    _check(isinstance(body, dict), "body", "must be a JSON object")
    msgs = body.get("messages")
    _check(isinstance(msgs, list) and len(msgs) > 0, "messages", "must be a non-empty list")
    turns: list[list] = []
    videos: list[tuple[str, str]] = []
    for i, m in enumerate(msgs):
        _check(isinstance(m, dict), f"messages[{i}]", "must be an object with role and content")
        role = m.get("role")
        want = "user" if i % 2 == 0 else "assistant"
        if role in ("system", "developer"):
            _check(False, f"messages[{i}].role", f"{role!r} messages are not supported: the model's prompt "
                   "template has no place for them")
        _check(role == want, f"messages[{i}].role", f"must be {want!r}: messages alternate user and assistant, "
               f"starting with user")
        text, found = _text_of(m.get("content"), f"messages[{i}].content", allow_video=role == "user")
        if found:
            _check(i == 0 and len(found) == 1 and not videos, found[-1][1],
                   "one video per conversation, in the first user message")
            videos += found
        if role == "user":
            _check(bool(text), f"messages[{i}].content", "has no text: ask a question")
            turns.append([text, None])
        else:
            turns[-1][1] = text
    _check(msgs[-1].get("role") == "user", f"messages[{len(msgs) - 1}].role", "the last message must be the user's")
    _check(bool(videos), "messages[0].content", "has no video_url part: the model answers questions about a video")
    _check(body.get("n", 1) == 1, "n", "only 1 is supported")
    model = body.get("model")
    _check(model is None or isinstance(model, str), "model", "must be a string")
    stream = body.get("stream", False)
    _check(isinstance(stream, bool), "stream", "must be true or false")
    opts = body.get("stream_options") or {}
    _check(isinstance(opts, dict), "stream_options", "must be an object")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    _check(isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop), "stop",
           "must be a non-empty string or a list of up to 4 of them")
    max_tokens = _number(body, "max_completion_tokens", integer=True, low=1)
    return ChatRequest(
        turns=[(q, a) for q, a in turns], video_url=videos[0][0], video_field=videos[0][1], model=model,
        stream=stream, include_usage=bool(opts.get("include_usage")), stop=stop,
        max_tokens=max_tokens if max_tokens is not None else _number(body, "max_tokens", integer=True, low=1),
        temperature=_number(body, "temperature", low=0), top_p=_number(body, "top_p", low=0, high=1, low_open=True),
        seed=_number(body, "seed", integer=True), fps=_number(body, "fps", low=0, low_open=True),
        max_frames=_number(body, "max_frames", integer=True, low=1))


# ----------------------------------------------------------------------------- the video's bytes

@dataclass(frozen=True)
class MediaPolicy:
    max_bytes: int
    """Largest video accepted (413 above it)."""
    media_dir: Optional[Path] = None
    """file:// URLs are served from inside this directory only (403 otherwise)."""
    allow_remote: bool = False
    """http(s) URLs are fetched only when set (403 otherwise)."""
    timeout_s: float = 30.0


def _too_large(n: int, policy: MediaPolicy, where: str) -> ApiError:
    return ApiError(413, f"the video is {n / 2**20:.1f} MiB, over the server's limit of "
                    f"{policy.max_bytes / 2**20:.1f} MiB (--max-upload-mb)", where)


def load_video(url: str, where: str, policy: MediaPolicy) -> bytes:
    """The bytes of the video at `url`, within the policy; ApiError otherwise."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        head, sep, payload = url.partition(",")
        _check(bool(sep) and head.lower().endswith(";base64"), where, "a data URL must be data:video/...;base64,...")
        _check(head[5:].lower().startswith("video/"), where, f"a data URL must hold a video, not {head[5:].split(';')[0]!r}")
        if len(payload) * 3 // 4 > policy.max_bytes:
            raise _too_large(len(payload) * 3 // 4, policy, where)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ApiError(400, f"the data URL is not valid base64: {e}", where) from None
    if scheme == "file":
        if policy.media_dir is None:
            raise ApiError(403, "file:// URLs are refused: the server was started without --media-dir", where)
        rest = url[5:].split("?", 1)[0].split("#", 1)[0]
        path = Path(urllib.parse.unquote(rest[2:] if rest.startswith("//") else rest))  # file:///abs, file://rel
        root = policy.media_dir.resolve()
        if ".." in path.parts:
            raise ApiError(403, "a file:// path may not contain '..'", where)
        full = (path if path.is_absolute() else root / path).resolve()
        if not full.is_relative_to(root):
            raise ApiError(403, "the file is outside --media-dir", where)
        if not full.is_file():
            raise ApiError(404, "no such file in --media-dir", where)
        if full.stat().st_size > policy.max_bytes:
            raise _too_large(full.stat().st_size, policy, where)
        return full.read_bytes()
    if scheme in ("http", "https"):
        if not policy.allow_remote:
            raise ApiError(403, "remote media are refused: start the server with --allow-remote-media", where)
        try:
            with urllib.request.urlopen(url, timeout=policy.timeout_s) as r:
                data = r.read(policy.max_bytes + 1)
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ApiError(400, f"cannot fetch the video: {e}", where) from None
        if len(data) > policy.max_bytes:
            raise _too_large(len(data), policy, where)
        return data
    raise ApiError(400, "must be a data:video/...;base64, URL, a file:// path or an http(s) URL", where)
