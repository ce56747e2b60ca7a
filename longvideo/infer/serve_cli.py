"""`longvideo serve`: the flags, the settings they make (the one place that reads argparse), and
start-up: every rank loads the model and agrees it did, rank 0 serves HTTP (longvideo.infer.asgi)
while its worker and the other ranks answer (longvideo.infer.serve). docs/serving.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from longvideo.distributed import fail_together, local_device, torchrun_world
from longvideo.infer.asgi import bind, start_http
from longvideo.infer.chat import load_model
from longvideo.infer.media import MediaPolicy, check_domains
from longvideo.infer.serve import ServeSettings, Service, log

API_KEY_ENV = "LONGVIDEO_API_KEY"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="longvideo serve",
        description="An OpenAI-compatible chat server about videos (POST /v1/chat/completions) "
        "with a web page at /.",
    )
    add = p.add_argument
    add("--model", required=True, help="exported Hugging Face directory or project checkpoint")
    add("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    add("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    add("--served-model-name", default=None, help="the model's id in the API (default: its name)")
    add("--fps", type=float, default=1.0, help="frames per second read from a video (default 1)")
    add("--max-frames", type=int, default=None, help="most frames read (uniform over the video)")
    add("--media-dir", default=None, help="serve file:// video URLs from inside this directory")
    add("--allow-remote-media", action="store_true", help="fetch http(s) video URLs")
    add(
        "--allowed-media-domains",
        nargs="+",
        default=(),
        metavar="HOST[:PORT]",
        help="with --allow-remote-media: the only hosts fetched from (an IP address named here is "
        "fetched from even when it is not public)",
    )
    add("--media-timeout", type=float, default=30.0, help="seconds for one download (default 30)")
    add("--max-upload-mb", type=float, default=256, help="largest video accepted (default 256)")
    add("--max-queue", type=int, default=16, help="requests waiting before 429 (default 16)")
    add(
        "--cache-gb",
        type=float,
        default=4.0,
        help="one budget for the encoded videos and the KV caches kept for follow-ups (default 4)",
    )
    add("--max-tokens", type=int, default=2048, help="largest max_tokens accepted (default 2048)")
    add(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds one request may take, from its arrival to its last token (default 600)",
    )
    add("--header-timeout", type=float, default=10.0, help="seconds to send a request's headers")
    add("--body-timeout", type=float, default=120.0, help="seconds to send a request's body")
    add("--keep-alive-timeout", type=float, default=5.0, help="idle seconds a connection is kept")
    add("--max-connections", type=int, default=512, help="open connections at most (then 503)")
    add(
        "--api-key",
        action="append",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1/... (repeatable; also ${API_KEY_ENV})",
    )
    add(
        "--allowed-hosts",
        nargs="+",
        default=None,
        metavar="HOST[:PORT]",
        help="Host header values answered ('*': any; default: the loopback names when bound to "
        "a loopback address, any otherwise)",
    )
    add("--cors-origins", nargs="+", default=(), help="origins allowed by CORS (default: none)")
    add("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    add("--backend", default="auto", help="block-attention backend for sequence-parallel serving")
    add("--quiet", action="store_true", help="no request log")
    return p


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """The settings the flags say (ValueError naming the flag when one cannot hold)."""
    check_domains(tuple(args.allowed_media_domains))
    if args.media_timeout <= 0:
        raise ValueError("--media-timeout must be > 0")
    keys = list(args.api_key or [])
    if os.environ.get(API_KEY_ENV):
        keys.append(os.environ[API_KEY_ENV])
    media = MediaPolicy(
        max_bytes=int(args.max_upload_mb * 2**20),
        media_dir=Path(args.media_dir) if args.media_dir else None,
        allow_remote=args.allow_remote_media,
        allowed_domains=tuple(args.allowed_media_domains),
        timeout_s=args.media_timeout,
    )
    return ServeSettings(
        model=args.model,
        name=args.served_model_name or Path(args.model).resolve().name,
        media=media,
        host=args.host,
        port=args.port,
        fps=args.fps,
        max_frames=args.max_frames,
        max_upload_mb=args.max_upload_mb,
        max_queue=args.max_queue,
        cache_gb=args.cache_gb,
        max_tokens=args.max_tokens,
        request_timeout=args.request_timeout,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        max_connections=args.max_connections,
        api_keys=tuple(keys),
        allowed_hosts=tuple(args.allowed_hosts) if args.allowed_hosts else None,
        cors_origins=tuple(args.cors_origins),
        device=args.device,
        backend=args.backend,
        quiet=args.quiet,
    )


def main(argv: list[str]) -> int:
    try:
        settings = settings_from_args(parser().parse_args(argv))
    except ValueError as e:
        print(f"longvideo serve: error: {e}", file=sys.stderr)
        return 2
    device = local_device(settings.device)
    # ranks > 0 wait in a collective while rank 0 reads and encodes a request's video (at most
    # --request-timeout) or is idle (it says so every serve.HEARTBEAT_S)
    with torchrun_world(device, timedelta(seconds=settings.request_timeout + 300)) as distributed:
        rank, error = dist.get_rank() if distributed else 0, None
        try:
            pre = load_model(settings.model, device)
            if pre.tokenizer is None or pre.vq is None:
                raise ValueError(f"{settings.model} has no text tokenizer or no VQ video tokenizer")
            svc = Service(pre, settings)
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            error = e
        try:
            fail_together(error)  # every rank learns whether one failed before the collectives
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            print(
                f"longvideo serve: error (rank {rank}): {str(e) or type(e).__name__}",
                file=sys.stderr,
            )
            return 2
        if rank > 0:
            svc.follow()
            return 0
        return _serve_rank0(svc, settings)


def _serve_rank0(svc: Service, settings: ServeSettings) -> int:
    try:
        sock = bind(settings.host, settings.port)
    except OSError as e:
        log(f"error: cannot listen on {settings.host}:{settings.port}: {e.strerror or e}")
        stopped = threading.Event()
        stopped.set()
        svc.run(stopped)  # tells the other ranks to stop
        return 2
    server, thread = start_http(svc, sock)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    notes = [f"{svc.world} rank{'s' * (svc.world > 1)}"]
    if settings.api_keys:
        notes.append(f"{len(settings.api_keys)} API key{'s' * (len(settings.api_keys) > 1)}")
    elif settings.host_allow_list() is None:
        notes.append("no API key: anyone who reaches this address may use it (--api-key)")
    if settings.host_allow_list() is None:
        notes.append("any Host header accepted (--allowed-hosts)")
    print(f"longvideo serve: {svc.name} on http://{shown}:{port}/ ({', '.join(notes)})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        svc.run(stop)
    finally:
        server.should_exit = True
        thread.join(10)
    return 0
