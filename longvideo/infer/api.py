"""The OpenAI chat-completions request as `longvideo serve` reads it: pydantic models of the body,
the checks the schema cannot say (roles alternate, one video in the first message), and the
sampling settings validated and clamped as vLLM does. Every refusal is an `ApiError` with its HTTP
status and the field it is about (docs/serving.md, "The API"; docs/security.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from longvideo.infer.generation import clamp_temperature

INT64 = (-(2**63), 2**63 - 1)
MAX_STOP_CHARS = 256
"""Longest stop string (characters)."""
MAX_SALT_CHARS = 256
"""Longest `cache_salt`."""
MAX_MESSAGES = 4096
"""Most messages in one conversation."""


class ApiError(Exception):
    """A refused request: HTTP `status`, the message, the request field it is about."""

    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict | None = None
    ):
        super().__init__(f"{param}: {message}" if param else message)
        self.status, self.param, self.headers = status, param, headers or {}

    def body(self, request_id: str | None = None) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        err = {"message": str(self), "type": kind, "param": self.param, "code": self.status}
        if request_id is not None:
            err["request_id"] = request_id
        return {"error": err}


class _Strict(BaseModel):
    """Strict types (no "1" for 1, no true for 1), no NaN or infinity; unknown fields ignored, as
    the OpenAI servers ignore the options they do not implement."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)


class VideoURL(_Strict):
    url: str = Field(min_length=1)


class ContentPart(_Strict):
    model_config = ConfigDict(extra="allow")  # image_url, input_audio ...: refused by name below
    type: str
    text: str | None = None
    video_url: VideoURL | None = None

    @field_validator("video_url", mode="before")
    @classmethod
    def _url_string(cls, v: Any) -> Any:
        return {"url": v} if isinstance(v, str) else v


class Message(_Strict):
    role: str
    content: list[ContentPart]

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"type": "text", "text": v}]
        if not isinstance(v, list):
            raise PydanticCustomError("content", "must be a string or a list of content parts")
        return v


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatCompletionBody(_Strict):
    """The body of POST /v1/chat/completions, as far as this server reads it."""

    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT64[1])
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64[1])
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT64[1])
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    stop: list[str] | None = Field(None, max_length=4)
    n: int | None = Field(None, ge=1, le=1)
    fps: float | None = Field(None, gt=0, le=1000)
    max_frames: int | None = Field(None, ge=1, le=INT64[1])
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_CHARS)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not all(0 < len(s) <= MAX_STOP_CHARS for s in v):
            raise PydanticCustomError(
                "stop",
                f"must be a non-empty string or a list of up to 4 of them, each at most "
                f"{MAX_STOP_CHARS} characters",
            )
        return v


_MESSAGES = {
    "missing": "is required",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
}


def _where(loc: tuple) -> str:
    """('messages', 0, 'content', 1, 'video_url', 'url') -> messages[0].content[1].video_url.url"""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def _explain(err: dict) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if err["loc"] == ("messages",) and kind in ("missing", "too_short", "list_type"):
        return "must be a non-empty list"
    if kind in _MESSAGES:
        return _MESSAGES[kind]
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<="}
    if kind in bounds:
        value = next(iter(ctx.values()), "?")
        if err["loc"] == ("n",):
            return "only 1 is supported"
        shown = f"{value:g}" if isinstance(value, float) else value
        return f"must be {bounds[kind]} {shown}"
    if kind == "string_too_short":
        return "must be a non-empty string"
    if kind == "too_short":
        return "must not be empty"
    if kind == "too_long":
        return f"must have at most {ctx.get('max_length')} items"
    if kind == "string_too_long":
        return f"must be at most {ctx.get('max_length')} characters"
    return err["msg"]  # a custom error's own message, or pydantic's


@dataclass(frozen=True)
class Sampling:
    """How one answer is sampled, after validation and clamping (`resolve_sampling`)."""

    temperature: float = 0.0
    """0: greedy (any temperature below 1e-5); otherwise at least 1e-2."""
    top_p: float = 1.0
    top_k: int = 0
    """0: every token."""
    seed: int = 0
    max_tokens: int = 64


@dataclass
class ChatRequest:
    turns: list[tuple[str, str | None]]
    """(question, answer) per user turn; the last answer is None (to be generated)."""
    video_url: str
    video_field: str
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    fps: float | None = None
    """Extensions (openai-python: extra_body): fps and max_frames, else the server's --fps and
    --max-frames."""
    max_frames: int | None = None
    top_k: int | None = None
    """vLLM's extension: -1 or 0 for every token."""
    cache_salt: str | None = None
    """vLLM's extension: requests with different salts never share a cache."""


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ApiError(400, message, param)


def _text(parts: list[ContentPart], where: str, user: bool) -> tuple[str, list[tuple[str, str]]]:
    """A message's text and its video URLs [(url, field)]."""
    texts, videos = [], []
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        if part.type == "text":
            _check(part.text is not None, f"{at}.text", "must be a string")
            texts.append(part.text.strip())
        elif part.type == "video_url" and user:
            _check(part.video_url is not None, f"{at}.video_url.url", "must be a non-empty string")
            videos.append((part.video_url.url, f"{at}.video_url.url"))
        else:
            allowed = "text and video_url" if user else "text"
            _check(False, f"{at}.type", f"{part.type!r} is not supported here ({allowed} parts)")
    return "\n".join(t for t in texts if t), videos


def parse_request(raw: bytes) -> ChatRequest:
    """Check a chat-completions body; ApiError(400) naming the field otherwise."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise ApiError(400, f"the request body is not JSON: {reason}") from None
    _check(isinstance(body, dict), "body", "must be a JSON object")
    try:
        req = ChatCompletionBody.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        raise ApiError(400, _explain(err), _where(err["loc"])) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    turns, videos = [], []
    for i, m in enumerate(req.messages):
        want = "assistant" if i % 2 else "user"
        _check(
            m.role not in ("system", "developer"),
            f"messages[{i}].role",
            f"{m.role!r} messages are not supported: the model's prompt template has no place for "
            "them",
        )
        _check(
            m.role == want,
            f"messages[{i}].role",
            f"must be {want!r}: messages alternate user and assistant",
        )
        text, found = _text(m.content, f"messages[{i}].content", m.role == "user")
        if found:
            _check(
                i == 0 and len(found) == 1,
                found[-1][1],
                "one video per conversation, in the first user message",
            )
            videos = found
        if m.role == "user":
            _check(bool(text), f"messages[{i}].content", "has no text: ask a question")
            turns.append((text, None))
        else:
            turns[-1] = (turns[-1][0], text)
    n = len(req.messages)
    _check(n % 2 == 1, f"messages[{n - 1}].role", "the last message must be the user's")
    _check(
        bool(videos),
        "messages[0].content",
        "has no video_url part: the model answers questions about a video",
    )
    return ChatRequest(
        turns=turns,
        video_url=videos[0][0],
        video_field=videos[0][1],
        model=req.model,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        max_tokens=req.max_completion_tokens or req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        stop=list(req.stop or []),
        fps=req.fps,
        max_frames=req.max_frames,
        top_k=req.top_k,
        cache_salt=req.cache_salt,
    )


def resolve_sampling(
    req: ChatRequest, *, temperature: float, top_p: float, seed: int, max_tokens: int, cap: int
) -> Sampling:
    """The request's sampling, the server's defaults (the model's `infer:` settings) where it says
    nothing, clamped as vLLM's SamplingParams clamps: a temperature below 1e-5 is greedy (top_p and
    top_k then do nothing), one below 1e-2 is raised to 1e-2; top_k -1 is 0 (every token).
    `max_tokens` above `cap` (--max-tokens) is refused, naming the field."""
    asked = req.max_tokens if req.max_tokens is not None else min(max_tokens, cap)
    _check(asked <= cap, "max_tokens", f"must be <= {cap} (the server's --max-tokens)")
    t = clamp_temperature(temperature if req.temperature is None else req.temperature)
    greedy = t == 0
    return Sampling(
        temperature=t,
        top_p=1.0 if greedy else (top_p if req.top_p is None else req.top_p),
        top_k=0 if greedy or req.top_k is None else max(0, req.top_k),
        seed=seed if req.seed is None else req.seed,
        max_tokens=asked,
    )
