"""`longvideo serve`, the model side: the settings, the queue of checked requests, one worker that
answers them a token at a time, the caches (encoded videos and KV caches within one budget), and
under torchrun the typed messages rank 0 sends the other ranks and the agreement on every request's
failure (docs/serving.md; the HTTP side is longvideo.infer.asgi, the command
longvideo.infer.serve_cli).

One request's life on the worker, in named steps: `_encode` (decode and VQ-encode the video, or
take it from the cache), `_prompt` (the conversation's ids, refused when too long), `_plan` (which
cached KV state to keep, what to evict so the budget holds), then on every rank `_generation`:
`_prepare` (no collective), an agreement, the prefill and the tokens (each token's step agreed by
one all-reduce of rank 0's stop and every rank's failure), and one last agreement on the outcome
(longvideo.distributed.fail_together): a request that fails on any rank fails on all, its KV state is
dropped everywhere, and every rank is ready for the next.
"""

from __future__ import annotations

import hashlib
import io
import math
import sys
import threading
import time
import traceback
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from importlib import resources

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image

from longvideo.data.video import VideoError
from longvideo.distributed import broadcast_array, comm_device, fail_together
from longvideo.infer.api import ApiError, ChatRequest, Sampling, resolve_sampling
from longvideo.infer.chat import EncodedVideo, encode_video_file, fit_frames, prompt_of
from longvideo.infer.generation import Engine, LocalEngine, new_cache, prefill
from longvideo.infer.media import MediaPolicy
from longvideo.infer.sp import SequenceParallelEngine

THUMB, MAX_THUMBS = 48, 512
"""Thumbnail side (pixels); most thumbnails in a strip (spread evenly over the frames)."""
HEARTBEAT_S = 30.0
"""Under torchrun, an idle rank 0 tells the other ranks it is alive this often, so that a rank
waiting for work is never inside one collective longer than the process group's timeout."""
STUCK_GRACE_S = 60.0
"""/health says degraded when one request has run this long past --request-timeout."""


@dataclass(frozen=True)
class ServeSettings:
    """Everything `longvideo serve` is told (the CLI builds it from its flags; docs/serving.md)."""

    model: str
    name: str
    """The model's id in the API (--served-model-name, else the directory's name)."""
    media: MediaPolicy
    host: str = "127.0.0.1"
    port: int = 8000
    fps: float = 1.0
    max_frames: int | None = None
    max_upload_mb: float = 256.0
    max_queue: int = 16
    cache_gb: float = 4.0
    max_tokens: int = 2048
    """Most tokens one answer may ask for (a larger max_tokens is refused, 400)."""
    request_timeout: float = 600.0
    """One deadline per request from its arrival: reading, decoding, prefill and generation."""
    header_timeout: float = 10.0
    """Seconds a connection may take to send a request's headers."""
    body_timeout: float = 120.0
    """Seconds a request may take to send its body."""
    keep_alive_timeout: float = 5.0
    max_connections: int = 512
    """Open connections at most; beyond, new requests are answered 503."""
    api_keys: tuple[str, ...] = ()
    """Bearer keys, any of which opens /v1/... (none: no key asked)."""
    allowed_hosts: tuple[str, ...] | None = None
    """Host header values accepted (HOST or HOST:PORT; '*' any); None: the loopback names when
    bound to a loopback address, any otherwise."""
    cors_origins: tuple[str, ...] = ()
    device: str | None = None
    backend: str = "auto"
    quiet: bool = False

    def __post_init__(self):
        for ok, flag, what in (
            (self.max_queue >= 1, "--max-queue", ">= 1"),
            (self.cache_gb >= 0, "--cache-gb", ">= 0"),
            (self.max_upload_mb > 0, "--max-upload-mb", "> 0"),
            (self.fps > 0 and math.isfinite(self.fps), "--fps", "> 0"),
            (self.max_frames is None or self.max_frames >= 1, "--max-frames", ">= 1"),
            (self.max_tokens >= 1, "--max-tokens", ">= 1"),
            (self.request_timeout > 0, "--request-timeout", "> 0"),
            (self.header_timeout > 0, "--header-timeout", "> 0"),
            (self.body_timeout > 0, "--body-timeout", "> 0"),
            (self.max_connections >= 2, "--max-connections", ">= 2"),
            (all(self.api_keys), "--api-key", "a non-empty string"),
        ):
            if not ok:
                raise ValueError(f"{flag} must be {what}")

    @property
    def max_body(self) -> int:
        """Largest request body: a video of --max-upload-mb as base64, and the JSON around it."""
        return self.media.max_bytes * 4 // 3 + (1 << 20)

    def host_allow_list(self) -> tuple[str, ...] | None:
        """The Host header values accepted (None: any)."""
        if self.allowed_hosts is not None:
            return None if "*" in self.allowed_hosts else self.allowed_hosts
        loopback = self.host in ("127.0.0.1", "::1", "localhost") or self.host.startswith("127.")
        return ("127.0.0.1", "localhost", "::1", self.host) if loopback else None


class Stopped(Exception):
    """A request ended early: the client went away ("cancelled") or its deadline passed
    ("timeout")."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class Job:
    """One checked request on its way through the queue and the worker."""

    req: ChatRequest
    sampling: Sampling
    key: str
    """The video's cache key: its sha256, the sampling of frames and the client's salt."""
    data: bytes
    request_id: str
    deadline: float
    """time.monotonic() by which the answer must be done."""
    emit: Callable[[tuple], None] = lambda event: None
    """Hands an event to the HTTP side: ("start", video), ("delta", text), ("done", result),
    ("error", ApiError) or ("stopped", reason)."""
    cancelled: threading.Event = field(default_factory=threading.Event)

    def check(self) -> None:
        """Stopped when the client went away or the deadline passed."""
        if self.cancelled.is_set():
            raise Stopped("cancelled")
        if time.monotonic() > self.deadline:
            raise Stopped("timeout")


@dataclass
class VideoEntry:
    video: EncodedVideo
    times: list[float]
    """Seconds of the frames in the strip."""
    jpeg: bytes

    def nbytes(self) -> int:
        return self.video.codes.nbytes + self.video.timestamps.nbytes + len(self.jpeg)


@dataclass
class KVState:
    engine: Engine
    ids: list[int]
    """The ids the engine's cache holds; the first `base` (the video part) were prefilled
    together."""
    base: int

    def nbytes(self) -> int:
        return sum(t.nbytes for t in _cache_tensors(self.engine.cache))


class Caches:
    """The encoded videos and the KV states in one least-recently-used order within one budget of
    bytes: room is made before an entry is added or a state grows, never after the fact."""

    def __init__(self, budget: int):
        self.budget = budget
        self.entries: OrderedDict[tuple[str, str], VideoEntry | KVState] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, kind: str, key: str):
        with self.lock:
            entry = self.entries.get((kind, key))
            if entry is not None:
                self.entries.move_to_end((kind, key))
            return entry

    def peek(self, kind: str, key: str):
        with self.lock:
            return self.entries.get((kind, key))

    def put(self, kind: str, key: str, entry) -> None:
        with self.lock:
            self.entries[(kind, key)] = entry
            self.entries.move_to_end((kind, key))

    def pop(self, kind: str, key: str):
        with self.lock:
            return self.entries.pop((kind, key), None)

    def nbytes(self) -> int:
        with self.lock:
            return sum(e.nbytes() for e in self.entries.values())

    def make_room(self, incoming: int, keep: tuple[tuple[str, str], ...] = ()) -> list[str]:
        """Drop the least recently used entries (not those in `keep`) until the entries and
        `incoming` bytes fit the budget; the keys of the KV states dropped."""
        dropped = []
        with self.lock:
            total = sum(e.nbytes() for e in self.entries.values())
            for k in list(self.entries):
                if total + incoming <= self.budget:
                    break
                if k in keep:
                    continue
                total -= self.entries.pop(k).nbytes()
                if k[0] == "kv":
                    dropped.append(k[1])
        return dropped


class Kind(IntEnum):
    STOP = 0
    GENERATE = 1
    IDLE = 2


@dataclass(frozen=True)
class RankMessage:
    """What rank 0 tells the other ranks, once per request (GENERATE), when idle (IDLE) and at the
    end (STOP); sent as one int64 array (no pickle), laid out by `encode` and read by `decode`
    only."""

    kind: Kind
    request_id: str = ""
    key: str = ""
    ids: tuple[int, ...] = ()
    video_end: int = 0
    reuse: int = -1
    """Tokens of the key's KV state to keep (-1: prefill a new state from the video part)."""
    sampling: Sampling = Sampling()
    evict: tuple[str, ...] = ()
    """KV states rank 0 dropped to keep the budget: every rank drops them."""

    _INTS = ("kind", "video_end", "reuse", "seed", "top_k", "max_tokens")
    _FLOATS = ("temperature", "top_p")

    def encode(self) -> np.ndarray:
        s = self.sampling
        texts = [t.encode() for t in (self.request_id, self.key, "\n".join(self.evict))]
        floats = np.asarray([s.temperature, s.top_p], np.float64).view(np.int64)
        head = [int(self.kind), self.video_end, self.reuse, s.seed, s.top_k, s.max_tokens]
        lengths = [len(self.ids), *(len(t) for t in texts)]
        body = [np.frombuffer(t, np.uint8).astype(np.int64) for t in texts]
        return np.concatenate(
            [np.asarray(head + lengths, np.int64), floats, np.asarray(self.ids, np.int64), *body]
        )

    @classmethod
    def decode(cls, arr: np.ndarray) -> RankMessage:
        kind, video_end, reuse, seed, top_k, max_tokens, n_ids, *n_text = arr[:10].tolist()
        temperature, top_p = arr[10:12].astype(np.int64).view(np.float64).tolist()
        at, texts = 12 + n_ids, []
        for n in n_text:
            texts.append(bytes(arr[at : at + n].astype(np.uint8).tolist()).decode())
            at += n
        return cls(
            kind=Kind(kind),
            request_id=texts[0],
            key=texts[1],
            ids=tuple(arr[12 : 12 + n_ids].tolist()),
            video_end=video_end,
            reuse=reuse,
            sampling=Sampling(temperature, top_p, top_k, seed, max_tokens),
            evict=tuple(t for t in texts[2].split("\n") if t),
        )

    def send(self) -> None:
        broadcast_array(self.encode(), src=0)

    @classmethod
    def receive(cls) -> RankMessage:
        return cls.decode(broadcast_array(None, src=0))


def thumbnail_strip(chunks: list[torch.Tensor]) -> tuple[bytes, np.ndarray]:
    """Chunks of frames uint8 (t, H, W, 3) -> one JPEG with up to MAX_THUMBS of them side by side,
    and the indices of those frames."""
    x = torch.cat(
        [
            F.interpolate(c.permute(0, 3, 1, 2).float(), size=(THUMB, THUMB), mode="area")
            for c in chunks
        ]
    )
    pick = np.linspace(0, len(x) - 1, min(len(x), MAX_THUMBS)).round().astype(int)
    strip = (
        x[pick].round().clamp(0, 255).to(torch.uint8).permute(2, 0, 3, 1).reshape(THUMB, -1, 3)
    )  # h, T*w
    out = io.BytesIO()
    Image.fromarray(strip.numpy()).save(out, "JPEG", quality=85)
    return out.getvalue(), pick


class Answer:
    """The answer's text as tokens arrive, detokenized incrementally (each token decodes a window of
    the last few ids, not the whole answer, as vLLM's detokenizer does): cut at a stop string,
    stripped as `longvideo chat` prints it, streamed in deltas that never take back what was sent
    (a stop string's possible start, trailing spaces and an unfinished UTF-8 character wait for
    the next token)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop, self.ids, self.sent, self.finish = tokenizer, stop, [], "", None
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.raw, self.prefix, self.read, self._final = "", 0, 0, None

    def _decode_new(self, final: bool = False) -> None:
        before = self.tok.decode(self.ids[self.prefix : self.read])
        now = self.tok.decode(self.ids[self.prefix :])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self.raw += now[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)

    def _cut(self, text: str) -> str:
        for s in self.stop:
            if s in text:
                text, self.finish = text[: text.index(s)], "stop"
        return text

    def text(self) -> str:
        """The whole answer (one full decode, cut at the first stop string, stripped)."""
        if self._final is None:
            self._final = self._cut(self.tok.decode(self.ids)).strip()
        return self._final

    def add(self, tok: int) -> str:
        """Take a generated token (not the end of sequence); the text to send now."""
        self.ids.append(tok)
        seen = len(self.raw)
        self._decode_new()
        window = self.raw[max(0, seen - self.hold) :]
        if any(s in window for s in self.stop):
            return self.flush(self._cut(self.raw).strip())
        show = self.raw.lstrip()
        return self._send(show[: max(0, len(show) - self.hold)].rstrip())

    def flush(self, show: str | None = None) -> str:
        return self._send(self.text() if show is None else show)

    def _send(self, show: str) -> str:
        if not show.startswith(self.sent):
            return ""
        delta, self.sent = show[len(self.sent) :], show
        return delta


@dataclass
class Stats:
    served: int = 0
    cancelled: int = 0
    rejected: int = 0
    """Refused with 429 (the queue was full)."""
    errors: int = 0
    """Answered with an error (4xx or 5xx) by the worker."""
    failed: int = 0
    """Failed on the model's side (500), every rank agreeing."""
    timed_out: int = 0
    videos_encoded: int = 0


class Ticket:
    """A request's place in the queue, taken when its headers arrive (before its body is read or
    decoded) and given back once (by the worker taking it up, or when it is refused or leaves)."""

    def __init__(self, service: Service):
        self.service, self.held = service, True

    def release(self) -> None:
        with self.service.cond:
            if self.held:
                self.held = False
                self.service.admitted -= 1


class Service:
    """The model, its caches and the queue: `run` on rank 0, `follow` on the other ranks."""

    def __init__(self, pretrained, settings: ServeSettings):
        self.pre, self.settings, self.infer = pretrained, settings, pretrained.config.infer
        self.name = settings.name
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device = next(pretrained.model.parameters()).device
        self.caches = Caches(int(settings.cache_gb * 2**30))
        self.kv_token_bytes = sum(
            t.nbytes for t in _cache_tensors(new_cache(pretrained.model, 1, 1))
        )
        """Bytes of one token in a KV cache (a bound for the sequence-parallel ranks' shards)."""
        self.waiting: deque[tuple[Job, Ticket]] = deque()
        self.cond, self.admitted = threading.Condition(), 0
        self.busy_since: float | None = None
        self.times = deque(maxlen=20)
        self.stats = Stats()
        self.last_failure: dict | None = None
        self.worker_alive = True
        self.evicted: list[str] = []
        """KV states dropped since the last message (the other ranks drop them with the next)."""
        self.page = resources.files("longvideo.infer").joinpath("serve_page.html").read_bytes()

    # ---- the HTTP side's calls (any thread) ----

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body) of /health: ok, degraded (the last request failed on the model's
        side, or one has run past its deadline) or unavailable (the worker stopped: 503)."""
        status, reason, now = "ok", None, time.monotonic()
        busy = self.busy_since
        if not self.worker_alive:
            status, reason = "unavailable", "the worker has stopped; restart the server"
        elif busy is not None and now - busy > self.settings.request_timeout + STUCK_GRACE_S:
            status = "degraded"
            reason = f"one request has run {now - busy:.0f} s, past --request-timeout"
        elif self.last_failure is not None:
            status = "degraded"
            reason = "the last request failed on the model's side (see the server's log)"
        with self.cond:
            queued = sum(not j.cancelled.is_set() for j, _ in self.waiting)
        body = dict(
            status=status,
            reason=reason,
            last_failure=self.last_failure,
            model=self.name,
            queued=queued,
            max_queue=self.settings.max_queue,
            busy=busy is not None,
            world_size=self.world,
            max_upload_mb=self.settings.max_upload_mb,
            auth_required=bool(self.settings.api_keys),
            cache_bytes=self.caches.nbytes(),
            cache_budget_bytes=self.caches.budget,
            **vars(self.stats),
        )
        return (503 if status == "unavailable" else 200), body

    def admit(self) -> Ticket:
        """A place in the queue, or ApiError 429 with Retry-After when --max-queue requests are
        waiting besides the one being answered (decided from the headers alone: nothing of the
        body has been read or decoded)."""
        with self.cond:
            # an idle worker takes the next request at once: it does not wait in the queue
            room = self.settings.max_queue + (self.busy_since is None and not self.waiting)
            if self.admitted >= room:
                self.stats.rejected += 1
                n = self.admitted
                wait = max(1, math.ceil(sum(self.times) / max(1, len(self.times)) * (n + 1)))
                raise ApiError(
                    429,
                    f"the server is busy: {n} requests are waiting (--max-queue); retry in "
                    f"{wait} s",
                    headers={"Retry-After": str(wait)},
                )
            self.admitted += 1
            return Ticket(self)

    def sampling(self, req: ChatRequest) -> Sampling:
        return resolve_sampling(
            req,
            temperature=self.infer.temperature,
            top_p=self.infer.top_p,
            seed=self.infer.seed,
            max_tokens=self.infer.max_new_tokens,
            cap=self.settings.max_tokens,
        )

    def cache_key(self, data: bytes, req: ChatRequest, tenant: str) -> str:
        """The video's key in both caches: its bytes, the frames asked and the client's salt (the
        API key it used, and its `cache_salt`), so that no client's cached tokens show another's."""
        fps = req.fps or self.settings.fps
        max_frames = req.max_frames or self.settings.max_frames or 0
        h = hashlib.sha256()
        for part in (tenant, req.cache_salt or "", f"{fps:g}", str(max_frames)):
            h.update(part.encode() + b"\0")
        h.update(data)
        return h.hexdigest()[:32]

    def thumbnails(self, key: str) -> bytes | None:
        entry = self.caches.peek("video", key)
        return entry.jpeg if entry is not None else None

    def submit(self, job: Job, ticket: Ticket) -> None:
        with self.cond:
            self.waiting.append((job, ticket))
            self.cond.notify()

    # ---- rank 0's worker ----

    def run(self, stop: threading.Event) -> None:
        """Answer queued jobs until `stop`; then tell the other ranks to stop."""
        last_message, broken = time.monotonic(), False
        try:
            while not stop.is_set():
                with self.cond:
                    self.cond.wait_for(lambda: self.waiting or stop.is_set(), timeout=0.5)
                    job, ticket = self.waiting.popleft() if self.waiting else (None, None)
                if job is None:
                    if self.world > 1 and time.monotonic() - last_message > HEARTBEAT_S:
                        RankMessage(Kind.IDLE).send()
                        last_message = time.monotonic()
                    continue
                ticket.release()
                if job.cancelled.is_set():
                    self.stats.cancelled += 1
                    continue
                self.busy_since = t0 = time.monotonic()
                try:
                    self._serve(job)
                finally:
                    self.busy_since = None
                    self.times.append(time.monotonic() - t0)
                    last_message = time.monotonic()
        except _Collective as e:
            broken = True
            log(f"the ranks cannot agree any more, the worker stops: {e.__cause__!r}")
            raise
        finally:
            self.worker_alive = False
            if self.world > 1 and not broken:
                RankMessage(Kind.STOP).send()

    def _serve(self, job: Job) -> None:
        """One job, its outcome emitted; only a broken process group raises from here."""
        try:
            job.check()
            entry, prompt = self._prompt(job)
            job.emit(("start", self._video_info(job.key, entry)))
            cached, answer, count = self._answer(job, prompt)
        except Stopped as e:
            return self._stopped(job, e.reason)
        except ApiError as e:
            self.stats.errors += 1
            return job.emit(("error", e))
        except Exception as e:  # noqa: BLE001 - the client gets a 500 and the request id
            return self._failed(job, e)
        if answer.finish in ("cancelled", "timeout"):
            return self._stopped(job, answer.finish)
        self.stats.served += 1
        self.last_failure = None
        if delta := answer.flush():
            job.emit(("delta", delta))
        n = len(prompt.ids)
        usage = dict(
            prompt_tokens=n,
            completion_tokens=count,
            total_tokens=n + count,
            prompt_tokens_details=dict(cached_tokens=cached),
        )
        job.emit(("done", dict(content=answer.text(), finish_reason=answer.finish, usage=usage)))

    def _stopped(self, job: Job, reason: str) -> None:
        if reason == "timeout":
            self.stats.timed_out += 1
            self.stats.errors += 1
            job.emit(
                (
                    "error",
                    ApiError(
                        504,
                        f"the request did not finish within --request-timeout "
                        f"{self.settings.request_timeout:g} s",
                    ),
                )
            )
        else:
            self.stats.cancelled += 1
            job.emit(("stopped", reason))

    def _failed(self, job: Job, e: BaseException) -> None:
        self.stats.failed += 1
        self.stats.errors += 1
        self.last_failure = dict(request_id=job.request_id, at=time.time())
        log(
            f"request {job.request_id} failed on the model's side:\n"
            + "".join(traceback.format_exception(e)).rstrip()
        )
        job.emit(("error", ApiError(500, "answering failed on the model's side")))

    def _video_info(self, key: str, entry: VideoEntry) -> dict:
        v = entry.video
        return dict(
            id=key,
            frames=v.num_frames,
            fps=v.fps,
            duration=v.duration,
            timestamps=entry.times,
            thumbnails=f"/v1/videos/{key}/frames.jpg",
            thumb_size=THUMB,
        )

    def _encode(self, job: Job, history, question: str) -> VideoEntry:
        """The job's video decoded and VQ-encoded (checking the client and the deadline after every
        chunk of frames), or taken from the cache."""
        if (entry := self.caches.get("video", job.key)) is not None:
            return entry
        req, chunks, times = job.req, [], []

        def on_frames(frames, t):
            job.check()
            chunks.append(frames)
            times.extend(t.tolist())

        try:
            enc = encode_video_file(
                self.pre,
                job.data,
                fps=req.fps or self.settings.fps,
                progress=False,
                max_frames=req.max_frames or self.settings.max_frames,
                question=question,
                max_new_tokens=job.sampling.max_tokens,
                batch_frames=self.infer.encode_batch_frames,
                history=history,
                on_frames=on_frames,
            )
        except VideoError as e:
            raise ApiError(
                400,
                f"not a readable video ({len(job.data)} bytes): {str(e).removeprefix('<bytes>: ')}",
                req.video_field,
            ) from None
        except ValueError as e:  # not one frame fits: say what does not
            side = self.pre.vq.cfg.resolution // self.pre.vq.cfg.downsample
            text = prompt_of(
                self.pre, np.zeros((0, side, side), np.int64), np.zeros(0), question, history
            )
            raise ApiError(
                400,
                f"the conversation is {len(text.ids)} tokens without the video and max_tokens is "
                f"{job.sampling.max_tokens}: not one frame fits in the model's context of "
                f"{self.pre.model.cfg.max_seq_len} tokens ({e}); shorten the conversation or "
                "lower max_tokens",
                "messages",
            ) from None
        jpeg, pick = thumbnail_strip(chunks)
        entry = VideoEntry(enc, [times[i] for i in pick], jpeg)
        self.evicted += self.caches.make_room(entry.nbytes())
        self.caches.put("video", job.key, entry)
        self.stats.videos_encoded += 1
        return entry

    def _prompt(self, job: Job):
        """The job's video and prompt ids, or ApiError (unreadable, too long for the context)."""
        history, question = job.req.turns[:-1], job.req.turns[-1][0]
        entry = self._encode(job, history, question)
        v, limit, max_tokens = entry.video, self.pre.model.cfg.max_seq_len, job.sampling.max_tokens
        try:
            prompt = prompt_of(self.pre, v.codes, v.timestamps, question, history)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        if (n := len(prompt.ids)) + max_tokens > limit:
            k = fit_frames(self.pre, v.num_frames, question, max_tokens, v.duration, history)
            hint = (
                f"a frame budget of {k} frames would fit (the request's max_frames, or "
                "--max-frames)"
                if k
                else "no frame budget fits: shorten the conversation or lower max_tokens"
            )
            raise ApiError(
                400,
                f"the prompt is {n} tokens ({prompt.video_end} up to the end of the video's "
                f"{v.num_frames} frames) and max_tokens is {max_tokens}: {n + max_tokens} tokens, "
                f"more than the model's context of {limit}; {hint}",
                "messages",
            )
        return entry, prompt

    def _plan(self, job: Job, ids: list[int], video_end: int) -> RankMessage:
        """Which part of the key's KV state to keep (rank 0 decides for every rank), and room in
        the budget for what this answer will hold, made before it is needed."""
        state, reuse = self.caches.get("kv", job.key), -1
        if state is not None:
            common = next(
                (i for i, (a, b) in enumerate(zip(state.ids, ids)) if a != b),
                min(len(state.ids), len(ids)),
            )
            if common >= state.base:
                reuse = min(common, len(ids) - 1)
        held = state.nbytes() if state is not None and reuse >= 0 else 0
        need = self.kv_token_bytes * (len(ids) + job.sampling.max_tokens + 256) - held
        keep = (("kv", job.key), ("video", job.key))
        self.evicted += self.caches.make_room(max(0, need), keep)
        if reuse < 0 and state is not None:
            self.caches.pop("kv", job.key)
            self.evicted.append(job.key)
        evict, self.evicted = tuple(dict.fromkeys(self.evicted)), []
        return RankMessage(
            Kind.GENERATE,
            request_id=job.request_id,
            key=job.key,
            ids=tuple(ids),
            video_end=video_end,
            reuse=reuse,
            sampling=job.sampling,
            evict=evict,
        )

    def _answer(self, job: Job, prompt) -> tuple[int, Answer, int]:
        """Generate on every rank; (cached prompt tokens, the answer, tokens generated)."""
        msg = self._plan(job, prompt.ids, prompt.video_end)
        answer, eos, count = (
            Answer(self.pre.tokenizer, job.req.stop),
            self.pre.tokenizer.eos_id,
            [0],
        )
        max_tokens = job.sampling.max_tokens

        def on_token(tok: int) -> bool:
            count[0] += 1
            if tok == eos:
                answer.finish = "stop"
            elif delta := answer.add(tok):
                job.emit(("delta", delta))
            if answer.finish is None:
                if job.cancelled.is_set():
                    answer.finish = "cancelled"
                elif time.monotonic() > job.deadline:
                    answer.finish = "timeout"
                elif count[0] >= max_tokens:
                    answer.finish = "length"
            return answer.finish is None

        if self.world > 1:
            msg.send()
        self._generation(msg, on_token, job.check)
        self.evicted += self.caches.make_room(0)
        return max(0, msg.reuse), answer, count[0]

    # ---- every rank ----

    def follow(self) -> None:
        """Ranks > 0: answer what rank 0 sends until it says stop."""
        while (msg := RankMessage.receive()).kind != Kind.STOP:
            if msg.kind == Kind.GENERATE:
                try:
                    self._generation(msg, None, None)
                except _Collective:
                    raise
                except Exception as e:  # noqa: BLE001 - every rank failed this request together
                    log(f"request {msg.request_id} failed (rank {self.rank}): {e}")

    def _generation(self, msg: RankMessage, on_token, check) -> None:
        """Answer `msg` on the KV state of its key (collective under torchrun: every rank calls it
        with the same message). on_token (rank 0's) says after each token whether to go on; check
        (rank 0's) raises Stopped between prefill chunks of one process."""
        for key in msg.evict:
            self.caches.pop("kv", key)
        error, state = None, None
        try:
            state = self._prepare(msg)
        except Exception as e:  # noqa: BLE001 - agreed below
            error = e
        self._agree(error, msg.key)
        try:
            self._decode(state, msg, on_token, check)
        except Stopped:
            self.caches.pop("kv", msg.key)
            raise
        except Exception as e:  # noqa: BLE001 - agreed below
            error = e
        self._agree(error, msg.key)

    def _agree(self, error: BaseException | None, key: str) -> None:
        """Every rank learns whether one failed (one all-reduce under torchrun); a failure drops
        the key's KV state on every rank (it may hold a half-fed token) and raises everywhere."""
        try:
            fail_together(error)
        except Exception:
            self.caches.pop("kv", key)
            raise
        except BaseException as e:  # a broken process group: nothing more can be agreed
            raise _Collective(e) from e

    def _prepare(self, msg: RankMessage) -> KVState:
        """The KV state to answer on, no collective: the kept part of the cached one, or a new
        engine whose prefix is prefilled by `_decode`."""
        ids = list(msg.ids)
        if msg.reuse >= 0:
            state = self.caches.get("kv", msg.key)
            if state is None:
                raise RuntimeError(f"rank {self.rank} does not hold the KV state {msg.key}")
            state.engine.keep(msg.reuse)
            state.ids = state.ids[: msg.reuse]
            return state
        base = min(msg.video_end, len(ids) - 1)
        engine = (
            SequenceParallelEngine(self.pre.model, backend=self.settings.backend)
            if self.world > 1
            else LocalEngine(self.pre.model, prefill_chunk=self.infer.prefill_chunk)
        )
        return KVState(engine, [], base)

    @torch.no_grad()
    def _decode(self, state: KVState, msg: RankMessage, on_token, check) -> None:
        ids, s = list(msg.ids), msg.sampling
        if not state.ids and msg.reuse < 0:
            self.caches.put("kv", msg.key, state)
            prefix = torch.tensor([ids[: state.base]], dtype=torch.long, device=self.device)
            if isinstance(state.engine, LocalEngine) and check is not None:
                _checked_prefix(state.engine, prefix, check)
            else:
                state.engine.set_prefix(prefix)
            state.ids = ids[: state.base]
        gen = torch.Generator(device=self.device).manual_seed(s.seed)
        rest, engine = ids[len(state.ids) :], state.engine
        while True:
            error, go = None, False
            try:
                out = engine.generate(
                    torch.tensor([rest], dtype=torch.long, device=self.device),
                    max_new_tokens=1,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    top_k=s.top_k,
                    generator=gen,
                    vocab_limit=self.pre.model.cfg.vocab.answer_limit,
                )
                state.ids, tok = state.ids + rest, int(out.tokens[0, 0])
                go = on_token(tok) if on_token is not None else True
            except Exception as e:  # noqa: BLE001 - agreed in this step, raised after it
                error = e
            if not self._step(go, error is not None):
                if error is not None:
                    raise error
                return  # stopped, or another rank failed: the agreement that follows says which
            engine.keep(engine.held)
            rest = [tok]

    def _step(self, go: bool, failed: bool) -> bool:
        """Whether every rank goes on to the next token: one all-reduce of rank 0's stop and every
        rank's failure under torchrun."""
        if self.world == 1:
            return go and not failed
        flags = torch.tensor(
            [int(self.rank == 0 and not go), int(failed)], dtype=torch.long, device=comm_device()
        )
        try:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        except BaseException as e:
            raise _Collective(e) from e
        return not any(flags.tolist())


class _Collective(BaseException):
    """A collective itself failed (a rank died, the process group timed out): not one request's
    failure; the worker stops and the server says it is unavailable."""


def _cache_tensors(cache) -> list[torch.Tensor]:
    return [*cache.k, *cache.v, cache.positions, cache.segment_ids]


def _checked_prefix(engine: LocalEngine, ids: torch.Tensor, check: Callable[[], None]) -> None:
    """engine.set_prefix(ids), the same chunks, with `check` before each chunk (the request's
    deadline and client during a long prefill)."""
    B, P = ids.shape
    engine.cache = new_cache(engine.model, B, P + engine.spare)
    for s in range(0, P, engine.prefill_chunk):
        check()
        prefill(engine.model, ids[:, s : s + engine.prefill_chunk], engine.cache, chunk=P)
    engine.prefix_len = engine.local_prefix_len = P


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:20]}"


def log(text: str) -> None:
    print(f"longvideo serve: {text}", file=sys.stderr, flush=True)
