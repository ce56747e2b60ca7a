"""The HTTP side of `longvideo serve`: a Starlette application on uvicorn (docs/serving.md,
docs/security.md "Server").

Each request passes, in this order: a request id (in the `X-Request-Id` header of every answer,
and in the server's log next to any detail the answer leaves out); the Host allow-list (DNS
rebinding); CORS, only when --cors-origins names origins; the API key (Bearer, compared in constant
time, for /v1/...); then its endpoint. POST /v1/chat/completions takes its place in the queue from
the headers alone (429 before any of the body is read), reads the body under a size limit and a
deadline, parses it (pydantic), loads the video, and waits for the worker's events, streaming them
as server-sent events or answering once; a client that goes away at any point cancels it.

A refusal sent before the body was read first reads and discards the rest of the body (a bounded
amount, for a bounded time), so that a client which sends its whole body before it reads the
answer (Python's urllib, many others) reads the refusal instead of a reset connection; a client
that asked `Expect: 100-continue` is answered at once, its body never invited.

Against slow clients uvicorn's own limits are set (connections, keep-alive, the size of a request's
headers), and `HeaderDeadline` closes a connection that has not sent a whole request head within
--header-timeout (uvicorn has no such deadline of its own).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import socket
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, replace

import anyio
import h11
import uvicorn
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router
from uvicorn.protocols.http.h11_impl import H11Protocol

from longvideo.infer.api import ApiError, parse_request
from longvideo.infer.media import FetchError, load_video
from longvideo.infer.serve import Job, ServeSettings, Service, log, new_request_id

MAX_HEADER_BYTES = 32 * 1024
"""Largest request head (request line and headers) uvicorn's h11 parser accepts."""
DRAIN_MAX_BYTES = 64 * 2**20
"""Most bytes of an unwanted body read and discarded before a refusal is sent."""
DRAIN_MAX_S = 30.0
"""Longest time spent discarding such a body."""
DRAIN_IDLE_S = 2.0
"""A client that sends nothing for this long is not sending its body: it is answered at once."""
EVENT_GRACE_S = 5.0
"""How long past the request's deadline the HTTP side waits for the worker's word."""


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol with one more deadline: a connection must send a whole request head
    within `header_timeout` seconds of being opened, or of its previous answer, else it is closed
    (a client that trickles its headers a byte at a time holds a connection no longer)."""

    header_timeout = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_expired)

    def _disarm(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
        self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # a request head arrived

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


@dataclass
class BodyState:
    """How much of a request's body has been read (shared by the layers that may refuse it)."""

    received: int = 0
    done: bool = False
    invited: bool = False
    """receive() was called: with Expect: 100-continue, uvicorn said "100 Continue"."""


class ClientGone(Exception):
    pass


def _header(scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


async def receive_body(receive, body: BodyState) -> dict:
    body.invited = True
    msg = await receive()
    if msg["type"] == "http.request":
        body.received += len(msg.get("body", b""))
        body.done = not msg.get("more_body", False)
    return msg


async def drain(scope, receive, body: BodyState) -> bool:
    """Read and discard the rest of the body (at most DRAIN_MAX_BYTES within DRAIN_MAX_S, while
    it keeps coming); whether it was read to its end."""
    if body.done:
        return True
    expects = (_header(scope, b"expect") or "").lower() == "100-continue"
    if expects and not body.invited:
        return False  # never invite a body that will be refused
    declared = _header(scope, b"content-length")
    if declared is not None and declared.isdigit():
        if int(declared) - body.received > DRAIN_MAX_BYTES:
            return False
    start, until = body.received, time.monotonic() + DRAIN_MAX_S
    try:
        while not body.done:
            with anyio.fail_after(max(0.0, min(DRAIN_IDLE_S, until - time.monotonic()))):
                msg = await receive_body(receive, body)
            if msg["type"] != "http.request" or body.received - start > DRAIN_MAX_BYTES:
                return False
    except TimeoutError:
        return False
    return True


async def send_json(send, status: int, payload: dict, headers: dict | None = None, close=False):
    raw = json.dumps(payload).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]
    if close:
        hdrs.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": raw})


async def refuse(scope, receive, send, err: ApiError) -> None:
    """Answer `err` (JSON, its headers), the body read to its end first where that is bounded
    (not for 408: a client too slow to send its body is not waited for again)."""
    state = scope["state"]
    complete = err.status != 408 and await drain(scope, receive, state["body"])
    await send_json(
        send, err.status, err.body(state["request_id"]), err.headers, close=not complete
    )


def _host_ok(scope, allowed: tuple[str, ...] | None) -> bool:
    if allowed is None:
        return True
    value = (_header(scope, b"host") or "").strip().lower()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
    elif value.count(":") == 1:
        host, port = value.split(":")
    else:
        host, port = value, None
    host = host.rstrip(".")
    for entry in allowed:
        e = entry.lower()
        if e.startswith("["):
            e_host, _, e_rest = e[1:].partition("]")
            e_port = e_rest[1:] if e_rest.startswith(":") else None
        elif e.count(":") == 1:
            e_host, e_port = e.split(":")
        else:
            e_host, e_port = e, None
        if host and host == e_host.rstrip(".") and e_port in (None, port):
            return True
    return False


class Guard:
    """The outermost layer: the request id, the Host allow-list, a JSON 500 (with the id, no
    detail) for anything that escapes, the access log."""

    def __init__(self, app, settings: ServeSettings):
        self.app, self.settings = app, settings
        self.hosts = settings.host_allow_list()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid, t0, status = new_request_id(), time.perf_counter(), [0]
        scope.setdefault("state", {})
        scope["state"].update(request_id=rid, body=BodyState(), tenant="")

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                headers = [*message.get("headers", []), (b"x-request-id", rid.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            if not _host_ok(scope, self.hosts):
                err = ApiError(
                    400,
                    "this Host header is not one the server answers to (--allowed-hosts)",
                    "Host",
                )
                await refuse(scope, receive, send_with_id, err)
            else:
                await self.app(scope, receive, send_with_id)
        except Exception as e:  # noqa: BLE001 - logged with its id; the client gets the id only
            log(
                f"request {rid} ({scope['method']} {scope['path']}) raised:\n"
                + "".join(traceback.format_exception(e)).rstrip()
            )
            if status[0] == 0:
                err = ApiError(500, "internal error (the server's log has the detail)")
                await send_json(send_with_id, 500, err.body(rid), close=True)
        finally:
            if not self.settings.quiet:
                client = scope.get("client") or ("-", 0)
                ms = (time.perf_counter() - t0) * 1000
                log(
                    f'{client[0]} "{scope["method"]} {scope["path"]}" {status[0]} {ms:.0f} ms {rid}'
                )


class Auth:
    """Bearer keys for /v1/... (as vLLM's --api-key): every key compared in constant time, 401
    with `WWW-Authenticate: Bearer` otherwise. The key that matched salts the caches."""

    def __init__(self, app, keys: tuple[str, ...]):
        self.app = app
        self.keys = [(k.encode(), hashlib.sha256(k.encode()).hexdigest()[:16]) for k in keys]

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and self.keys
            and scope["path"].startswith("/v1/")
            and scope["method"] != "OPTIONS"
        ):
            given = (_header(scope, b"authorization") or "").encode("latin-1")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            tenant = None
            for key, salt in self.keys:  # no early exit: the time does not say which key is close
                if secrets.compare_digest(token, key) and tenant is None:
                    tenant = salt
            if tenant is None:
                err = ApiError(
                    401,
                    "a valid API key is required: send 'Authorization: Bearer <key>'",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await refuse(scope, receive, send, err)
            scope["state"]["tenant"] = tenant
        await self.app(scope, receive, send)


class Endpoint:
    """A Starlette endpoint for some methods; others are answered 405 in JSON."""

    def __init__(self, fn, methods=("GET", "HEAD")):
        self.fn, self.methods = fn, methods

    async def __call__(self, scope, receive, send):
        if scope["method"] not in self.methods:
            err = ApiError(
                405, f"{scope['method']} is not allowed here ({', '.join(self.methods)})"
            )
            return await refuse(scope, receive, send, err)
        response = await self.fn(Request(scope, receive))
        await response(scope, receive, send)


def json_response(status: int, body: dict) -> Response:
    return JSONResponse(body, status_code=status)


def build_app(service: Service):
    """The ASGI application: Guard -> [CORS] -> Auth -> routes."""
    settings = service.settings

    async def page(request: Request) -> Response:
        return Response(service.page, media_type="text/html; charset=utf-8")

    async def health(request: Request) -> Response:
        status, body = service.health()
        return json_response(status, body)

    async def models(request: Request) -> Response:
        model = dict(id=service.name, object="model", created=0, owned_by="longvideo")
        return json_response(200, dict(object="list", data=[model]))

    async def frames(request: Request) -> Response:
        jpeg = service.thumbnails(request.path_params["key"])
        if jpeg is None:
            rid = request.scope["state"]["request_id"]
            err = ApiError(404, "no such video (a video's frames are kept while it is cached)")
            return json_response(404, err.body(rid))
        return Response(jpeg, media_type="image/jpeg")

    async def not_found(scope, receive, send):
        err = ApiError(404, f"nothing at {scope['method']} {scope['path']}")
        await refuse(scope, receive, send, err)

    router = Router(
        routes=[
            Route("/", Endpoint(page)),
            Route("/index.html", Endpoint(page)),
            Route("/health", Endpoint(health)),
            Route("/v1/models", Endpoint(models)),
            Route("/v1/videos/{key}/frames.jpg", Endpoint(frames)),
            Route("/v1/chat/completions", ChatCompletions(service)),
        ],
        default=not_found,
    )
    app = Auth(router, settings.api_keys)
    if settings.cors_origins:
        app = CORSMiddleware(
            app,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
            expose_headers=["X-Request-Id", "Retry-After"],
        )
    return Guard(app, settings)


class ChatCompletions:
    """POST /v1/chat/completions (module docstring)."""

    def __init__(self, service: Service):
        self.service, self.settings = service, service.settings

    async def __call__(self, scope, receive, send):
        if scope["method"] != "POST":
            return await refuse(scope, receive, send, ApiError(405, "use POST"))
        state, svc = scope["state"], self.service
        deadline = time.monotonic() + self.settings.request_timeout
        try:
            ticket = svc.admit()
        except ApiError as e:
            return await refuse(scope, receive, send, e)
        cancelled, watcher = threading.Event(), None
        try:
            raw = await self._read(scope, receive, state["body"], deadline)
            req = await asyncio.to_thread(parse_request, raw)
            if req.model not in (None, svc.name):
                raise ApiError(
                    404, f"the model {req.model!r} is not served here (GET /v1/models)", "model"
                )
            sampling = svc.sampling(req)
            watcher = asyncio.ensure_future(_watch(receive, cancelled))
            try:
                left = max(0.001, deadline - time.monotonic())  # the download's share of it
                media = replace(
                    self.settings.media, timeout_s=min(self.settings.media.timeout_s, left)
                )
                data = await asyncio.to_thread(
                    load_video, req.video_url, req.video_field, media, cancelled.is_set
                )
            except FetchError as e:
                if e.detail:
                    log(f"request {state['request_id']}: media refused or failed: {e.detail}")
                raise
            key = await asyncio.to_thread(svc.cache_key, data, req, state["tenant"])
            if cancelled.is_set():
                raise ClientGone()
            loop, events = asyncio.get_running_loop(), asyncio.Queue()

            def emit(event):
                try:
                    loop.call_soon_threadsafe(events.put_nowait, event)
                except RuntimeError:  # the loop has closed: nobody is listening
                    pass

            job = Job(req, sampling, key, data, state["request_id"], deadline, emit, cancelled)
            svc.submit(job, ticket)
            await Responder(job, events, watcher, send, svc.name).run()
        except ApiError as e:
            if not cancelled.is_set():  # else the client has gone: nobody to tell
                await refuse(scope, receive, send, e)
        except ClientGone:
            pass
        finally:
            cancelled.set()  # the worker stops at its next check if it still runs this job
            ticket.release()
            if watcher is not None:
                watcher.cancel()

    async def _read(self, scope, receive, body: BodyState, deadline: float) -> bytes:
        """The whole body: 413 over --max-upload-mb's worth (declared or counted), 408 past
        --body-timeout (or the request's deadline), 400 for a bad Content-Length."""
        limit = self.settings.max_body
        declared = _header(scope, b"content-length")
        if declared is not None and not declared.isdigit():
            raise ApiError(400, "the Content-Length header is not a number")

        def too_big(n: int) -> ApiError:
            return ApiError(
                413,
                f"the request body is {'at least ' if declared is None else ''}"
                f"{n / 2**20:.1f} MiB, over the {limit / 2**20:.1f} MiB of a video of "
                f"--max-upload-mb {self.settings.max_upload_mb:g} sent as base64",
            )

        if declared is not None and int(declared) > limit:
            raise too_big(int(declared))
        chunks = []
        left = max(0.0, deadline - time.monotonic())
        by_deadline = left < self.settings.body_timeout  # which of the two limits can fire
        try:
            with anyio.fail_after(min(self.settings.body_timeout, left)):
                while not body.done:
                    msg = await receive_body(receive, body)
                    if msg["type"] != "http.request":
                        raise ClientGone()
                    chunks.append(msg.get("body", b""))
                    if body.received > limit:
                        raise too_big(body.received)
        except TimeoutError:
            limit_name, seconds = (
                ("--request-timeout", self.settings.request_timeout)
                if by_deadline
                else ("--body-timeout", self.settings.body_timeout)
            )
            raise ApiError(
                408, f"the request body did not arrive within {limit_name} {seconds:g} s"
            ) from None
        return b"".join(chunks)


async def _watch(receive, cancelled: threading.Event) -> None:
    """Set `cancelled` when the client goes away (the body has been read: receive() says nothing
    else)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            cancelled.set()
            return


class Responder:
    """Turns the worker's events for one job into the HTTP answer: one JSON body, or server-sent
    events (`chat.completion.chunk`s, then `data: [DONE]`)."""

    def __init__(self, job: Job, events: asyncio.Queue, watcher, send, model: str):
        self.job, self.events, self.watcher, self.send = job, events, watcher, send
        self.head = dict(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model)

    async def next(self):
        """The next event; None once the client has gone (the job is then cancelled); an error
        event of 504 when the worker has said nothing by the deadline."""
        get = asyncio.ensure_future(self.events.get())
        left = self.job.deadline + EVENT_GRACE_S - time.monotonic()
        done, _ = await asyncio.wait(
            {get, self.watcher}, timeout=max(0.0, left), return_when=asyncio.FIRST_COMPLETED
        )
        if get in done:
            event = get.result()
            return None if event[0] == "stopped" else event
        get.cancel()
        self.job.cancelled.set()
        if self.watcher in done:
            return None
        return ("error", ApiError(504, "the request did not finish within --request-timeout"))

    async def run(self) -> None:
        rid = self.job.request_id
        first = await self.next()
        if first is None:
            return
        if first[0] == "error":
            return await send_json(self.send, first[1].status, first[1].body(rid), first[1].headers)
        if not self.job.req.stream:
            while (ev := await self.next()) is not None and ev[0] == "delta":
                pass
            if ev is None:
                return
            if ev[0] == "error":
                return await send_json(self.send, ev[1].status, ev[1].body(rid), ev[1].headers)
            msg = dict(role="assistant", content=ev[1]["content"])
            choice = dict(index=0, message=msg, finish_reason=ev[1]["finish_reason"], logprobs=None)
            body = dict(
                self.head,
                object="chat.completion",
                choices=[choice],
                usage=ev[1]["usage"],
                video=first[1],
            )
            return await send_json(self.send, 200, body)
        await self.send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )
        await self.chunk(dict(role="assistant", content=""), video=first[1])
        while (ev := await self.next()) is not None and ev[0] == "delta":
            await self.chunk(dict(content=ev[1]))
        if ev is not None and ev[0] == "error":
            await self.event(ev[1].body(rid))
        elif ev is not None:
            await self.chunk({}, ev[1]["finish_reason"])
            if self.job.req.include_usage:
                await self.chunk(None, usage=ev[1]["usage"])
            await self.write(b"data: [DONE]\n\n")
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def chunk(self, delta: dict | None, finish=None, **extra) -> None:
        choices = (
            []
            if delta is None
            else [dict(index=0, delta=delta, finish_reason=finish, logprobs=None)]
        )
        await self.event(dict(self.head, object="chat.completion.chunk", choices=choices, **extra))

    async def event(self, payload: dict) -> None:
        await self.write(f"data: {json.dumps(payload)}\n\n".encode())

    async def write(self, raw: bytes) -> None:
        await self.send({"type": "http.response.body", "body": raw, "more_body": True})


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def start_http(service: Service, sock: socket.socket) -> tuple[uvicorn.Server, threading.Thread]:
    """uvicorn serving the application on `sock` in a thread of its own (the worker keeps the
    main thread); the server and its thread."""
    s = service.settings
    protocol = type("Protocol", (HeaderDeadline,), {"header_timeout": s.header_timeout})
    config = uvicorn.Config(
        build_app(service),
        http=protocol,
        ws="none",
        lifespan="off",
        loop="asyncio",
        log_config=None,
        access_log=False,
        server_header=False,
        limit_concurrency=s.max_connections,
        timeout_keep_alive=max(1, round(s.keep_alive_timeout)),
        timeout_graceful_shutdown=5,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    return server, thread
