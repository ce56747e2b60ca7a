"""`longvideo serve`: an OpenAI-compatible chat server about videos, with a web page at `/`; HTTP
threads queue checked requests, one worker answers them a token at a time (docs/serving.md).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import queue
import select
import signal
import socket
import sys
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlsplit

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image

from longvideo.data.ranks import fail_together
from longvideo.data.video import VideoError
from longvideo.infer.api import ApiError, ChatRequest, MediaPolicy, load_video, parse_request
from longvideo.infer.chat import EncodedVideo, encode_video_file, fit_frames, load_model, prompt_of
from longvideo.infer.generation import Engine, LocalEngine
from longvideo.infer.sp import (
    SequenceParallelEngine,
    broadcast_array,
    broadcast_text,
    comm_device,
    local_device,
    torchrun_world,
)

THUMB, MAX_THUMBS = 48, 512
"""Thumbnail side (pixels); most thumbnails in a strip (spread evenly over the frames)."""


@dataclass
class Job:
    req: ChatRequest
    key: str
    """The video's sha256 and sampling: the key of both caches."""
    data: bytes
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)


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
    """The ids the engine's cache holds; the first `base` (the video part) were prefilled together."""
    base: int

    def nbytes(self) -> int:
        c = self.engine.cache
        return sum(t.nbytes for t in [*c.k, *c.v, c.positions, c.segment_ids])


class LRU(OrderedDict):
    """Least recently used first; `trim` drops the oldest while the entries hold over `budget` bytes."""

    def __init__(self, budget: int):
        super().__init__()
        self.budget = budget

    def use(self, key: str):
        if key in self:
            self.move_to_end(key)
        return self.get(key)

    def nbytes(self) -> int:
        return sum(v.nbytes() for v in list(self.values()))

    def trim(self) -> None:
        while self and self.nbytes() > self.budget:
            self.popitem(last=False)


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
    """The answer's text as tokens arrive: cut at a stop string, stripped as `longvideo chat` prints
    it, streamed in deltas that never take back what was sent (a stop string's possible start,
    trailing spaces and an unfinished UTF-8 character wait for the next token)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop, self.ids, self.sent, self.finish = tokenizer, stop, [], "", None
        self.hold = max((len(s) for s in stop), default=1) - 1

    def text(self) -> str:
        text = self.tok.decode(self.ids)
        for s in self.stop:
            if s in text:
                text, self.finish = text[: text.index(s)], "stop"
        return text.strip()

    def add(self, tok: int) -> str:
        """Take a generated token (not the end of sequence); the text to send now."""
        self.ids.append(tok)
        show = self.text()
        if self.finish is None:
            show = show[: max(0, len(show) - self.hold)].rstrip().rstrip("\ufffd").rstrip()
        return self.flush(show)

    def flush(self, show: Optional[str] = None) -> str:
        show = self.text() if show is None else show
        if not show.startswith(self.sent):
            return ""
        delta, self.sent = show[len(self.sent) :], show
        return delta


class Service:
    """The model, its caches and the queue: `run` on rank 0, `follow` on the other ranks."""

    def __init__(self, pretrained, args, name: str):
        self.pre, self.args, self.name, self.infer = pretrained, args, name, pretrained.config.infer
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.device = next(pretrained.model.parameters()).device
        self.videos, self.states = LRU(int(args.cache_gb * 2**30)), LRU(int(args.cache_gb * 2**30))
        self.media = MediaPolicy(
            int(args.max_upload_mb * 2**20),
            args.media_dir and Path(args.media_dir),
            args.allow_remote_media,
        )
        self.max_body = self.media.max_bytes * 4 // 3 + (1 << 20)  # base64 and the JSON around it
        self.waiting: deque[Job] = deque()
        self.cond, self.busy, self.times = threading.Condition(), False, deque(maxlen=20)
        self.stats = dict(served=0, cancelled=0, rejected=0, errors=0, videos_encoded=0)
        self.page = resources.files("longvideo.infer").joinpath("serve_page.html").read_bytes()

    def health(self) -> dict:
        return dict(
            status="ok",
            model=self.name,
            queued=len(self._live()),
            max_queue=self.args.max_queue,
            busy=self.busy,
            world_size=self.world,
            max_upload_mb=self.args.max_upload_mb,
            cache_bytes=self.videos.nbytes() + self.states.nbytes(),
            **self.stats,
        )

    def _live(self) -> list[Job]:
        with self.cond:
            return [j for j in self.waiting if not j.cancelled.is_set()]

    def submit(self, req: ChatRequest, data: bytes) -> Job:
        fps, max_frames = req.fps or self.args.fps, req.max_frames or self.args.max_frames
        job = Job(req, f"{hashlib.sha256(data).hexdigest()[:32]}-{fps:g}-{max_frames or 0}", data)
        with self.cond:
            live = self._live()
            if len(live) >= self.args.max_queue:
                self.stats["rejected"] += 1
                wait = max(
                    1, math.ceil(sum(self.times) / max(1, len(self.times)) * (len(live) + 1))
                )
                raise ApiError(
                    429,
                    f"the server is busy: {len(live)} requests are waiting (--max-queue); "
                    f"retry in {wait} s",
                    headers={"Retry-After": str(wait)},
                )
            self.waiting = deque(live + [job])
            self.cond.notify()
        return job

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with self.cond:
                self.cond.wait_for(lambda: self.waiting or stop.is_set(), timeout=0.5)
                job = self.waiting.popleft() if self.waiting else None
            if job is not None and job.cancelled.is_set():
                self.stats["cancelled"] += 1
            elif job is not None:
                self.busy, t0 = True, time.perf_counter()
                try:
                    self._answer(job)
                except Exception as e:  # noqa: BLE001 - the client gets a 500, the server keeps serving
                    self.stats["errors"] += 1
                    print(
                        f"longvideo serve: answering failed: {type(e).__name__}: {e}",
                        file=sys.stderr,
                    )
                    job.events.put(
                        ("error", ApiError(500, f"answering failed: {type(e).__name__}: {e}"))
                    )
                finally:
                    self.busy = False
                    self.times.append(time.perf_counter() - t0)
        if self.world > 1:
            broadcast_array(np.zeros(3, np.int64), src=0)  # stop

    def _video(self, job: Job, history, question: str, max_tokens: int) -> VideoEntry:
        if (entry := self.videos.use(job.key)) is not None:
            return entry
        req, chunks, times = job.req, [], []
        try:
            enc = encode_video_file(
                self.pre,
                job.data,
                fps=req.fps or self.args.fps,
                progress=False,
                max_frames=req.max_frames or self.args.max_frames,
                question=question,
                max_new_tokens=max_tokens,
                batch_frames=self.infer.encode_batch_frames,
                history=history,
                on_frames=lambda f, t: (chunks.append(f), times.extend(t.tolist())),
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
                f"the conversation is {len(text.ids)} tokens without the video and "
                f"max_tokens is {max_tokens}: not one frame fits in the model's context of "
                f"{self.pre.model.cfg.max_seq_len} tokens ({e}); shorten the conversation or "
                f"lower max_tokens",
                "messages",
            ) from None
        jpeg, pick = thumbnail_strip(chunks)
        self.videos[job.key] = entry = VideoEntry(enc, [times[i] for i in pick], jpeg)
        self.stats["videos_encoded"] += 1
        return entry

    def _prompt(self, job: Job, max_tokens: int):
        """The job's video and prompt ids, or ApiError (unreadable, too long for the context)."""
        history, question = job.req.turns[:-1], job.req.turns[-1][0]
        entry = self._video(job, history, question, max_tokens)
        v, limit = entry.video, self.pre.model.cfg.max_seq_len
        try:
            prompt = prompt_of(self.pre, v.codes, v.timestamps, question, history)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        if (n := len(prompt.ids)) + max_tokens > limit:
            k = fit_frames(self.pre, v.num_frames, question, max_tokens, v.duration, history)
            hint = (
                f"a frame budget of {k} frames would fit (the request's max_frames, or --max-frames)"
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

    def _answer(self, job: Job) -> None:
        req, emit, infer = job.req, job.events.put, self.infer
        max_tokens = req.max_tokens or infer.max_new_tokens
        try:
            entry, prompt = self._prompt(job, max_tokens)
        except ApiError as e:
            self.stats["errors"] += 1
            return emit(("error", e))
        v = entry.video
        emit(
            (
                "start",
                dict(
                    id=job.key,
                    frames=v.num_frames,
                    fps=v.fps,
                    duration=v.duration,
                    timestamps=entry.times,
                    thumbnails=f"/v1/videos/{job.key}/frames.jpg",
                    thumb_size=THUMB,
                ),
            )
        )
        seed = infer.seed if req.seed is None else req.seed
        sampling = (
            infer.temperature if req.temperature is None else req.temperature,
            infer.top_p if req.top_p is None else req.top_p,
        )
        if self.world > 1:
            broadcast_array(np.asarray([1, prompt.video_end, seed, *prompt.ids], np.int64), src=0)
            broadcast_array(np.asarray(sampling, np.float64), src=0)
            broadcast_text(job.key, src=0)
        answer, eos, count = Answer(self.pre.tokenizer, req.stop), self.pre.tokenizer.eos_id, [0]

        def on_token(tok: int) -> bool:
            count[0] += 1
            if tok == eos:
                answer.finish = "stop"
            elif delta := answer.add(tok):
                emit(("delta", delta))
            if answer.finish is None and (count[0] >= max_tokens or job.cancelled.is_set()):
                answer.finish = "length" if count[0] >= max_tokens else "cancelled"
            return answer.finish is None

        cached = self._generate(job.key, prompt.ids, prompt.video_end, seed, *sampling, on_token)
        self.stats["cancelled" if answer.finish == "cancelled" else "served"] += 1
        if delta := answer.flush():
            emit(("delta", delta))
        n = len(prompt.ids)
        emit(
            (
                "done",
                dict(
                    content=answer.text(),
                    finish_reason=answer.finish,
                    usage=dict(
                        prompt_tokens=n,
                        completion_tokens=count[0],
                        total_tokens=n + count[0],
                        prompt_tokens_details=dict(cached_tokens=cached),
                    ),
                ),
            )
        )
        self.videos.trim()

    def follow(self) -> None:
        """Ranks > 0: answer what rank 0 sends until it says stop."""
        while int(
            (head := broadcast_array(None, src=0))[0]
        ):  # go, video_end, seed, then the prompt's ids
            temperature, top_p = broadcast_array(None, src=0).tolist()
            key = broadcast_text(None, src=0)
            self._generate(
                key, head[3:].tolist(), int(head[1]), int(head[2]), temperature, top_p, None
            )

    def _go(self, go: bool) -> bool:
        if self.world > 1:
            flag = torch.tensor([int(go)], device=comm_device())
            dist.broadcast(flag, src=0)
            go = bool(flag.item())
        return go

    @torch.no_grad()
    def _generate(
        self,
        key: str,
        ids: list[int],
        video_end: int,
        seed: int,
        temperature: float,
        top_p: float,
        on_token: Optional[Callable[[int], bool]],
    ) -> int:
        """Answer the prompt `ids` on the KV state of `key` (every rank; on_token, rank 0's, says after
        each token whether to go on). Returns how many prompt tokens came from the cache."""
        state, cached = self.states.use(key), 0
        common = (
            next(
                (i for i, (a, b) in enumerate(zip(state.ids, ids)) if a != b),
                min(len(state.ids), len(ids)),
            )
            if state
            else 0
        )
        if state is not None and common >= state.base:
            cached = min(common, len(ids) - 1)
            state.engine.keep(cached)
            state.ids = state.ids[:cached]
        else:  # the video part first, as ChatSession.ask prefills it
            base = min(video_end, len(ids) - 1)
            engine = (
                SequenceParallelEngine(self.pre.model, backend=self.args.backend)
                if self.world > 1
                else LocalEngine(self.pre.model, prefill_chunk=self.infer.prefill_chunk)
            )
            engine.set_prefix(torch.tensor([ids[:base]], dtype=torch.long, device=self.device))
            self.states[key] = state = KVState(engine, ids[:base], base)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        rest, engine = ids[len(state.ids) :], state.engine
        try:
            while True:
                out = engine.generate(
                    torch.tensor([rest], dtype=torch.long, device=self.device),
                    max_new_tokens=1,
                    temperature=temperature,
                    top_p=top_p,
                    generator=gen,
                    vocab_limit=self.pre.model.cfg.vocab.answer_limit,
                )
                state.ids, tok = state.ids + rest, int(out.tokens[0, 0])
                if not self._go(on_token(tok) if on_token else True):
                    break
                engine.keep(engine.held)
                rest = [tok]
        except BaseException:
            self.states.pop(key, None)  # its cache may hold a half-fed token
            raise
        self.states.trim()
        return cached


class Handler(BaseHTTPRequestHandler):
    protocol_version, server_version = "HTTP/1.1", "longvideo"
    timeout = 120  # seconds a connection may stall in a read or a write

    def log_message(self, fmt, *args) -> None:
        if not self.server.service.args.quiet:
            sys.stderr.write(f"{self.address_string()} {fmt % args}\n")

    def _send(
        self, status: int, body, ctype: str = "application/json", headers: Optional[dict] = None
    ):
        body = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        for k, v in {
            "Content-Type": ctype,
            "Content-Length": str(len(body)),
            **(headers or {}),
        }.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _error(self, e: ApiError) -> None:
        self._send(e.status, e.body(), headers=e.headers)

    def do_GET(self) -> None:
        path, svc = urlsplit(self.path).path, self.server.service
        parts = path.strip("/").split("/")
        if path in ("/", "/index.html"):
            self._send(200, svc.page, "text/html; charset=utf-8")
        elif path == "/health":
            self._send(200, svc.health())
        elif path == "/v1/models":
            model = dict(id=svc.name, object="model", created=0, owned_by="longvideo")
            self._send(200, dict(object="list", data=[model]))
        elif (
            len(parts) == 4
            and parts[:2] == ["v1", "videos"]
            and parts[3] == "frames.jpg"
            and (entry := svc.videos.get(parts[2])) is not None
        ):
            self._send(200, entry.jpeg, "image/jpeg")
        else:
            self._error(
                ApiError(
                    404, f"nothing at GET {path} (a video's frames are kept while it is cached)"
                )
            )

    def do_POST(self) -> None:
        path, svc = urlsplit(self.path).path, self.server.service
        try:
            if path != "/v1/chat/completions":
                raise ApiError(404, f"no such endpoint: POST {path}")
            size = self.headers.get("Content-Length", "")
            if not size.isdigit() or int(size) > svc.max_body:
                self.close_connection = True  # the body is not read
                if not size.isdigit():
                    raise ApiError(411, "a Content-Length header is required")
                raise ApiError(
                    413,
                    f"the request body is {int(size) / 2**20:.1f} MiB, over the "
                    f"{svc.max_body / 2**20:.1f} MiB of a video of --max-upload-mb "
                    f"{svc.args.max_upload_mb:g} sent as base64",
                )
            req = parse_request(self.rfile.read(int(size)))
            if req.model not in (None, svc.name):
                raise ApiError(
                    404, f"the model {req.model!r} is not served here (GET /v1/models)", "model"
                )
            self._respond(svc.submit(req, load_video(req.video_url, req.video_field, svc.media)))
        except ApiError as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _next(self, job: Job):
        """The job's next event; None (and the job cancelled) once the client has hung up."""
        while True:
            try:
                return job.events.get(timeout=0.2)
            except queue.Empty:
                try:
                    gone = (
                        select.select([self.connection], [], [], 0)[0]
                        and self.connection.recv(1, socket.MSG_PEEK) == b""
                    )
                except OSError:
                    gone = True
                if gone:
                    job.cancelled.set()
                    self.close_connection = True
                    return None

    def _respond(self, job: Job) -> None:
        first = self._next(job)
        if first is not None and first[0] == "error":
            self._error(first[1])
        if first is None or first[0] == "error":
            return
        head = dict(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.server.service.name,
        )
        if not job.req.stream:
            while (ev := self._next(job)) is not None and ev[0] == "delta":
                pass
            if ev is not None and ev[0] == "error":
                self._error(ev[1])
            elif ev is not None:
                msg = dict(role="assistant", content=ev[1]["content"])
                self._send(
                    200,
                    dict(
                        head,
                        object="chat.completion",
                        choices=[
                            dict(
                                index=0,
                                message=msg,
                                finish_reason=ev[1]["finish_reason"],
                                logprobs=None,
                            )
                        ],
                        usage=ev[1]["usage"],
                        video=first[1],
                    ),
                )
            return

        def chunk(delta: Optional[dict], finish=None, **extra) -> None:
            choices = (
                []
                if delta is None
                else [dict(index=0, delta=delta, finish_reason=finish, logprobs=None)]
            )
            body = dict(head, object="chat.completion.chunk", choices=choices, **extra)
            self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
            self.wfile.flush()

        self.close_connection = True
        self.send_response(200)
        for k, v in (
            ("Content-Type", "text/event-stream"),
            ("Cache-Control", "no-cache"),
            ("Connection", "close"),
            ("X-Accel-Buffering", "no"),
        ):
            self.send_header(k, v)
        self.end_headers()
        try:
            chunk(dict(role="assistant", content=""), video=first[1])
            while (ev := self._next(job)) is not None and ev[0] == "delta":
                chunk(dict(content=ev[1]))
            if ev is not None and ev[0] == "error":
                self.wfile.write(f"data: {json.dumps(ev[1].body())}\n\n".encode())
            elif ev is not None:
                chunk({}, ev[1]["finish_reason"])
                if job.req.include_usage:
                    chunk(None, usage=ev[1]["usage"])
                self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            job.cancelled.set()  # the worker stops at the next token


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="longvideo serve",
        description="An OpenAI-compatible chat server about "
        "videos (POST /v1/chat/completions) with a web page at /.",
    )
    p.add_argument(
        "--model", required=True, help="exported Hugging Face directory or project checkpoint"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model's id in the API (default: its directory's name)",
    )
    p.add_argument(
        "--fps", type=float, default=1.0, help="frames per second read from a video (default 1)"
    )
    p.add_argument(
        "--max-frames", type=int, default=None, help="most frames read (uniform over the video)"
    )
    p.add_argument(
        "--media-dir", default=None, help="serve file:// video URLs from inside this directory"
    )
    p.add_argument("--allow-remote-media", action="store_true", help="fetch http(s) video URLs")
    p.add_argument(
        "--max-upload-mb", type=float, default=256, help="largest video accepted (default 256)"
    )
    p.add_argument(
        "--max-queue", type=int, default=16, help="requests waiting before 429 (default 16)"
    )
    p.add_argument(
        "--cache-gb",
        type=float,
        default=4.0,
        help="bound of the KV caches kept for follow-ups, and of the encoded videos (default 4)",
    )
    p.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)"
    )
    p.add_argument(
        "--backend", default="auto", help="block-attention backend for sequence-parallel serving"
    )
    p.add_argument("--quiet", action="store_true", help="no request log")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.max_queue < 1 or args.cache_gb < 0 or args.max_upload_mb <= 0 or args.fps <= 0:
        print(
            "longvideo serve: error: need --max-queue >= 1, --cache-gb >= 0, --max-upload-mb > 0, "
            "--fps > 0",
            file=sys.stderr,
        )
        return 2
    device = local_device(args.device)
    # the other ranks wait for rank 0's next job in a broadcast: a long timeout
    with torchrun_world(device, timedelta(days=365)) as distributed:
        rank, error = dist.get_rank() if distributed else 0, None
        try:
            pre = load_model(args.model, device)
            if pre.tokenizer is None or pre.vq is None:
                raise ValueError(f"{args.model} has no text tokenizer or no VQ video tokenizer")
            svc = Service(pre, args, args.served_model_name or Path(args.model).resolve().name)
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            error = e
        try:
            fail_together(
                error
            )  # every rank learns whether one failed before the collectives start
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            print(
                f"longvideo serve: error (rank {rank}): {str(e) or type(e).__name__}",
                file=sys.stderr,
            )
            return 2
        if rank > 0:
            svc.follow()
            return 0
        httpd = ThreadingHTTPServer((args.host, args.port), Handler)
        httpd.daemon_threads, httpd.service = True, svc
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        print(
            f"longvideo serve: {svc.name} on http://{httpd.server_address[0]}:{httpd.server_address[1]}/ "
            f"({svc.world} rank{'s' * (svc.world > 1)})",
            flush=True,
        )
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        svc.run(stop)
        httpd.shutdown()
        return 0
