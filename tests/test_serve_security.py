"""`longvideo serve` attacked as a client would: sampling settings meant to break a rank, bodies
too large or too slow, headers sent a byte at a time, missing and wrong keys, a rebinding Host
header, remote media pointing at the server's own network (directly and by redirect, from a local
HTTP server the test runs), uploads that name files beside the server; and the units that defend
(sampling, address checks, the cache budget, the rank messages, incremental detokenization).

Every server runs as its own process on 127.0.0.1; nothing leaves the machine.
"""

from __future__ import annotations

import http.client
import http.server
import importlib
import json
import math
import select
import socket
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from test_serve import Server, data_url, material, messages  # noqa: F401 (material: a fixture)

from longvideo.data.synthetic import NEEDLE_QUESTION
from longvideo.infer.api import Sampling
from longvideo.infer.generation import sample_token
from longvideo.infer.media import FetchError, MediaPolicy, fetch_remote, is_public
from longvideo.infer.serve import Answer, Caches, Job, Kind, RankMessage, Stopped

KEYS = ("key-one-0123456789", "key-two-9876543210")
ENV_KEY = "key-from-the-environment"
RANK_FAILS = "what does rank one fail on?"


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """The in-process references run on one torch thread, as the servers do."""


# ---------------------------------------------------------------- a media server the test runs


class MediaServer:
    """An HTTP server on 127.0.0.1: /clip.mp4, /redirect?to=URL (302), /big (a Content-Length over
    any limit), /slow (one byte a second); `hits` lists the paths asked for."""

    def __init__(self, video: bytes):
        hits: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                hits.append(self.path)
                path, _, query = self.path.partition("?")
                if path == "/clip.mp4":
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(video)))
                    self.end_headers()
                    self.wfile.write(video)
                elif path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", urllib.parse.unquote(query.removeprefix("to=")))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif path == "/big":
                    self.send_response(200)
                    self.send_header("Content-Length", str(1 << 30))
                    self.end_headers()
                    self.wfile.write(b"\0" * 1024)
                elif path == "/slow":
                    self.send_response(200)
                    self.send_header("Content-Length", "100")
                    self.end_headers()
                    try:
                        for _ in range(100):
                            self.wfile.write(b"\0")
                            self.wfile.flush()
                            time.sleep(1.0)
                    except OSError:
                        pass
                else:
                    self.send_error(404)

        self.hits = hits
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


SHIM = textwrap.dedent('''\
    """`longvideo serve` with injected failures (and a slow model), for the tests that need them."""
    import os, sys, time
    from longvideo.infer import generation, serve, serve_cli

    real_sample, real_prepare = generation.sample_token, serve.Service._prepare


    def sample_token(logits, temperature=0.0, top_p=1.0, generator=None, top_k=0):
        if abs(temperature - 0.777) < 1e-9:  # every rank fails in the same step
            raise FloatingPointError("injected: sampling failed on every rank")
        if abs(temperature - 0.555) < 1e-9:  # a slow model: 50 ms a token
            time.sleep(0.05)
        return real_sample(logits, temperature, top_p, generator, top_k)


    def _prepare(self, msg):
        if msg.sampling.seed == 4242 and self.rank == int(os.environ["FAIL_RANK"]):
            raise RuntimeError(f"injected: rank {self.rank} cannot hold the KV cache")
        return real_prepare(self, msg)


    generation.sample_token, serve.Service._prepare = sample_token, _prepare
    sys.exit(serve_cli.main(sys.argv[1:]))
''')


def attack_files(folder: Path, clip: bytes) -> dict[str, bytes]:
    """Real files beside the server (its working directory) and uploads that name them."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "clip.mp4").write_bytes(clip)
    (folder / "seg.ts").write_bytes(clip)
    from test_serve import png_image

    for i in range(3):
        (folder / f"img{i:03d}.png").write_bytes(png_image())
    hls = (
        "#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:5\n#EXT-X-MEDIA-SEQUENCE:0\n"
        "#EXTINF:5.0,\nseg.ts\n#EXT-X-ENDLIST\n"
    )
    return {
        "concat": b"ffconcat version 1.0\nfile clip.mp4\n",
        "hls": hls.encode(),
        "image sequence": b"ffconcat version 1.0\nfile img%03d.png\n",
    }


@pytest.fixture(scope="module")
def media(material):
    one, two = (MediaServer((material["media"] / "clip.mp4").read_bytes()) for _ in range(2))
    yield one, two
    one.close()
    two.close()


@pytest.fixture(scope="module")
def guarded(material, media):
    """Keys, a small upload limit and queue, short header/body/download deadlines, a small cache,
    remote media from the first media server only (and from `localhost`, a name for loopback)."""
    root = material["root"] / "guarded"
    uploads = attack_files(root / "cwd", (material["media"] / "clip.mp4").read_bytes())
    s = Server(
        material["ckpt"],
        root,
        "--media-dir",
        str(material["media"]),
        "--max-upload-mb",
        "0.25",
        "--max-queue",
        "2",
        "--max-tokens",
        "64",
        "--header-timeout",
        "2",
        "--body-timeout",
        "3",
        "--media-timeout",
        "3",
        "--cache-gb",
        "0.001",
        "--api-key",
        KEYS[0],
        "--api-key",
        KEYS[1],
        "--allow-remote-media",
        "--allowed-media-domains",
        f"127.0.0.1:{media[0].port}",
        "localhost",
        api_key=KEYS[0],
        env={"LONGVIDEO_API_KEY": ENV_KEY},
    )
    s.uploads, s.planted = uploads, set(s.written())
    yield s
    s.stop()


@pytest.fixture(scope="module")
def open_server(material, tmp_path_factory):
    """No keys; remote media from any public host; CORS for one origin; a 4 s request deadline;
    the injected failures (FAIL_RANK=0: this one process)."""
    shim = tmp_path_factory.mktemp("shim") / "serve_shim.py"
    shim.write_text(SHIM)
    s = Server(
        material["ckpt"],
        material["root"] / "open",
        "--media-dir",
        str(material["media"]),
        "--allow-remote-media",
        "--cors-origins",
        "http://ok.example",
        "--request-timeout",
        "4",
        "--max-tokens",
        "1000",
        entry=[str(shim)],
        env={"FAIL_RANK": "0"},
    )
    yield s
    s.stop()


def body(url: str, question: str = NEEDLE_QUESTION, **extra) -> dict:
    return {"model": "ckpt", "messages": messages(url, question), **extra}


def read_all(s: socket.socket) -> bytes:
    """What the server sends until it closes the connection."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def auth(key: str = KEYS[0]) -> dict:
    return {"Authorization": f"Bearer {key}"}


def refused(server, request, status: int, param=None, words: str = "", headers=None, raw=False):
    code, got, hdrs = server.post(request, raw=raw, headers=headers)
    assert code == status, (code, got)
    err = got["error"]
    assert err["param"] == param and words in err["message"], got
    assert err["request_id"] == hdrs["X-Request-Id"] and err["request_id"].startswith("req-")
    assert "Traceback" not in err["message"] and "/longvideo/" not in err["message"], got
    return err, hdrs


# ---------------------------------------------------------------- sampling


def test_sample_token_never_sees_nan_or_infinity():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[1.0, float("nan"), 3.0, -float("inf")], [1e38, -1e38, 3e38, 0.0]])
    for t in (1e-300, 1e-6, 1e-3, 0.5, 1e6):
        for top_k in (0, 1, 2):
            tok = sample_token(logits, temperature=t, top_p=0.9, generator=g, top_k=top_k)
            assert tok.dtype == torch.long and tok.tolist()[0] in (0, 2) and 0 <= tok[1] < 4
    # below 1e-5 is greedy; top_k=1 is greedy at any temperature; +inf tokens are the only ones
    assert sample_token(logits, temperature=1e-300).tolist() == [2, 2]
    assert sample_token(logits, 5.0, 1.0, g, top_k=1).tolist() == [2, 2]
    inf = torch.tensor([[0.0, float("inf"), 1.0, float("inf")]]).expand(400, 4)
    assert set(sample_token(inf, 1.0, 1.0, g).tolist()) == {1, 3}
    # 1e-5 <= t < 1e-2 samples at 1e-2, as vLLM: two logits 0.01 apart are e : 1
    close = torch.tensor([[0.0, 0.01]]).expand(20000, 2)
    share = sample_token(close, 1e-4, 1.0, g).float().mean().item()
    assert abs(share - math.e / (1 + math.e)) < 0.02, share
    with pytest.raises(ValueError, match="no finite value"):
        sample_token(torch.full((1, 4), float("nan")), 1.0)
    with pytest.raises(ValueError, match="temperature"):
        sample_token(logits, float("nan"))


def test_sampling_extremes_are_clamped_and_bad_values_refused(guarded, material):
    url = data_url((material["media"] / "clip.mp4").read_bytes())
    code, greedy, _ = guarded.post(body(url, temperature=0), headers=auth())
    assert code == 200, greedy
    want = greedy["choices"][0]["message"]["content"]
    for extra in ({"temperature": 1e-300}, {"temperature": 5e-6}, {"temperature": 1.7, "top_k": 1}):
        code, got, _ = guarded.post(body(url, **extra), headers=auth())
        assert code == 200 and got["choices"][0]["message"]["content"] == want, (extra, got)
    code, got, _ = guarded.post(body(url, temperature=1e-3, top_k=-1, seed=-5), headers=auth())
    assert code == 200, got
    raw_nan = json.dumps(body(url)).replace('"model"', '"temperature": NaN, "model"').encode()
    refused(guarded, raw_nan, 400, "temperature", "finite", auth(), raw=True)
    for field, value, words in (
        ("temperature", -1, ">= 0"),
        ("temperature", "1", "number"),
        ("top_p", 1.5, "<= 1"),
        ("top_k", -2, ">= -1"),
        ("max_tokens", 65, "--max-tokens"),
        ("max_tokens", 1.0, "integer"),
        ("seed", 2**63, "<="),
        ("fps", float("inf"), "finite"),
        ("cache_salt", "", "non-empty"),
        ("messages", [{"role": "user", "content": "?"}] * 4097, "at most 4096"),
    ):
        raw = json.dumps(body(url, **{field: value})).encode()  # inf is written Infinity
        refused(guarded, raw, 400, field, words, auth(), raw=True)
    refused(guarded, b"[" * 100_000, 400, None, "nested too deeply", auth(), raw=True)
    code, got, _ = guarded.post(body(url), headers=auth())
    assert code == 200 and got["choices"][0]["message"]["content"] == want


# ---------------------------------------------------------------- access


def test_api_keys_hosts_and_cors(guarded, open_server, material):
    url = "file://clip.mp4"
    refused(guarded, body(url), 401, None, "API key")
    for wrong in ("", "Bearer", "Bearer " + KEYS[0][:-1], "Basic " + KEYS[0], KEYS[0]):
        err, hdrs = refused(guarded, body(url), 401, None, "API key", {"Authorization": wrong})
        assert hdrs["WWW-Authenticate"] == "Bearer"
    for key in (*KEYS, ENV_KEY):
        code, got, _ = guarded.post(body(url), headers=auth(key))
        assert code == 200, got
    with pytest.raises(urllib.error.HTTPError) as e:
        guarded.get("/v1/models")
    assert e.value.code == 401
    assert guarded.get("/v1/models", auth())["data"][0]["id"] == "ckpt"
    health = guarded.get("/health")  # public, as vLLM's; the page too
    assert health["auth_required"] is True and health["status"] == "ok"
    with urllib.request.urlopen(guarded.url + "/") as r:
        assert b"<html" in r.read()

    # a rebinding Host header: refused before anything else; loopback names pass
    host, port = guarded.url.removeprefix("http://").split(":")
    for value, ok in (
        ("evil.example", False),
        (f"evil.example:{port}", False),
        (f"127.0.0.1.evil.example:{port}", False),
        (f"localhost:{port}", True),
        (f"127.0.0.1:{port}", True),
    ):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/health", headers={"Host": value})
        r = conn.getresponse()
        got = json.loads(r.read())
        conn.close()
        assert (r.status == 200) == ok, (value, r.status, got)
        if not ok:
            assert r.status == 400 and got["error"]["param"] == "Host"

    # CORS: none unless asked; then only for the origins named
    def cors(server, origin: str, method: str = "GET"):
        h, p = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(h, int(p), timeout=30)
        headers = {"Origin": origin, "Access-Control-Request-Method": "POST"}
        conn.request(method, "/v1/models", headers={**headers, **auth()})
        r = conn.getresponse()
        r.read()
        conn.close()
        return r.getheader("Access-Control-Allow-Origin")

    assert cors(guarded, "http://ok.example") is None
    assert cors(guarded, "http://ok.example", "OPTIONS") is None
    assert cors(open_server, "http://ok.example") == "http://ok.example"
    assert cors(open_server, "http://ok.example", "OPTIONS") == "http://ok.example"
    assert cors(open_server, "http://evil.example") is None


def test_cached_tokens_never_show_another_clients_conversation(guarded, material):
    url, q2 = "file://other.mp4", "What shape came first?"
    code, first, _ = guarded.post(body(url), headers=auth(KEYS[0]))
    answer = first["choices"][0]["message"]["content"]
    follow = {"model": "ckpt", "messages": messages(url, q2, [(NEEDLE_QUESTION, answer)])}
    code, mine, _ = guarded.post(follow, headers=auth(KEYS[0]))
    assert code == 200 and mine["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # the same conversation from another key, or with another cache_salt: nothing cached
    code, other, _ = guarded.post(follow, headers=auth(KEYS[1]))
    assert code == 200 and other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert other["video"]["id"] != mine["video"]["id"]
    code, salted, _ = guarded.post({**follow, "cache_salt": "mine"}, headers=auth(KEYS[0]))
    assert code == 200 and salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert other["choices"][0]["message"]["content"] == mine["choices"][0]["message"]["content"]
    # one budget for videos and KV caches, never exceeded
    health = guarded.get("/health")
    assert 0 < health["cache_bytes"] <= health["cache_budget_bytes"] == int(0.001 * 2**30)
    # a video's frames need the key too, and another key's video id shows nothing
    thumbs = guarded.url + mine["video"]["thumbnails"]
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(thumbs)
    assert e.value.code == 401


# ---------------------------------------------------------------- slow and large requests


def test_oversized_bodies_get_a_413_the_client_can_read(guarded):
    big = b'{"messages": "' + b"x" * (3 << 20) + b'"}'
    # urllib sends the whole body before it reads: it reads the 413, not a reset
    err, hdrs = refused(guarded, big, 413, None, "over the", auth(), raw=True)
    # a body without Content-Length (chunked), counted as it arrives
    host, port = guarded.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=iter([big[i : i + 65536] for i in range(0, len(big), 65536)]),
        headers={**auth(), "Content-Type": "application/json"},
        encode_chunked=True,
    )
    r = conn.getresponse()
    assert r.status == 413 and "at least" in json.loads(r.read())["error"]["message"]
    conn.close()
    # Expect: 100-continue: refused from the headers, the body never invited
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
            f"{KEYS[0]}\r\nContent-Length: {len(big)}\r\nExpect: 100-continue\r\n\r\n".encode()
        )
        head = read_all(s)
    assert head.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in head, head[:200]
    # unauthenticated and oversized: 401, readable too
    refused(guarded, big, 401, None, "API key", raw=True)
    assert guarded.get("/health")["status"] == "ok"


def test_slow_clients_are_cut_off_and_others_are_answered(guarded):
    host, port = guarded.url.removeprefix("http://").split(":")
    slow = []
    for _ in range(50):  # headers a byte at a time: each is closed after --header-timeout (2 s)
        s = socket.create_connection((host, int(port)), timeout=30)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        slow.append(s)
    assert guarded.get("/health")["status"] == "ok"  # meanwhile an ordinary client is answered
    open_, deadline = set(slow), time.monotonic() + 30
    while open_ and time.monotonic() < deadline:
        for s in list(open_):
            try:
                s.sendall(b"X")
            except OSError:
                open_.discard(s)
        readable, _, _ = select.select(list(open_), [], [], 0.5)
        for s in readable:
            try:
                gone = s.recv(1024) == b""
            except OSError:
                gone = True
            if gone:
                open_.discard(s)
    for s in slow:
        s.close()
    assert not open_, f"{len(open_)} slow connections still open"
    # a body that trickles: 408 after --body-timeout (3 s)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
            f"{KEYS[0]}\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            "{".encode()
        )
        reply = read_all(s)
    assert reply.startswith(b"HTTP/1.1 408 ") and b"--body-timeout" in reply, reply[:300]
    assert guarded.get("/health")["status"] == "ok"


def test_queue_full_is_decided_before_any_body_arrives(guarded):
    host, port = guarded.url.removeprefix("http://").split(":")
    holders = []
    for _ in range(3):  # --max-queue 2, and the idle worker's one: three places
        s = socket.create_connection((host, int(port)), timeout=30)
        s.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
            f"{KEYS[0]}\r\nContent-Length: 100\r\n\r\n".encode()
        )
        holders.append(s)
    time.sleep(0.5)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
            f"{KEYS[0]}\r\nContent-Length: 100\r\nExpect: 100-continue\r\n\r\n".encode()
        )
        reply = read_all(s)
    assert reply.startswith(b"HTTP/1.1 429 ") and b"retry-after: " in reply.lower(), reply[:300]
    for s in holders:  # they leave: their places are free again
        s.close()
    deadline = time.monotonic() + 30
    while True:
        code, got, _ = guarded.post(body("file://clip.mp4"), headers=auth())
        if code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert code == 200, got


def test_request_deadline_covers_generation_and_500s_carry_only_an_id(open_server, material):
    s = open_server
    url = "file://clip.mp4"
    before = s.get("/health")
    long = body(url, max_tokens=900, temperature=0.555)  # 45 s of tokens, over the 4 s deadline
    err, _ = refused(s, long, 504, None, "--request-timeout")
    code, ok, hdrs = s.post(body(url))
    assert code == 200, ok
    after = s.get("/health")
    assert after["timed_out"] == before["timed_out"] + 1 and after["status"] == "ok"
    # the model side fails (injected): 500 with the request id, the detail only in the log
    err, hdrs = refused(s, body(url, temperature=0.777), 500, None, "model's side")
    health = s.get("/health")
    assert (
        health["status"] == "degraded" and health["last_failure"]["request_id"] == err["request_id"]
    )
    assert s.logged(err["request_id"])
    assert s.logged("injected: sampling failed")
    err, _ = refused(s, body(url, seed=4242), 500, None, "model's side")
    # streamed: the deadline ends the stream with an error event
    host, port = s.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({**long, "stream": True}))
    r = conn.getresponse()
    events = [json.loads(x[6:]) for x in r.read().decode().split("\n\n") if x.startswith("data: {")]
    conn.close()
    assert r.status == 200 and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["error"]["code"] == 504 and events[-1]["error"]["request_id"]
    code, again, _ = s.post(body(url))
    assert code == 200 and again["choices"][0]["message"] == ok["choices"][0]["message"]
    assert s.get("/health")["status"] == "ok"
    # a body that trickles past the 4 s deadline (before the default --body-timeout): the 408
    # names the limit that fired
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
            "application/json\r\nContent-Length: 1000\r\n\r\n{".encode()
        )
        reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408 ") and b"--request-timeout 4 s" in reply, reply[:300]
    # unknown paths and methods: JSON, with an id
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(s.url + "/etc/passwd")
    assert e.value.code == 404 and json.loads(e.value.read())["error"]["request_id"]


# ---------------------------------------------------------------- remote media


def test_remote_media_cannot_reach_the_servers_network(open_server, guarded, media, material):
    one, two = media
    where = "messages[0].content[0].video_url.url"
    # any public host allowed: loopback, private, link-local, metadata ... refused before connecting
    for url in (
        f"{one.url}/clip.mp4",
        f"http://localhost:{one.port}/clip.mp4",
        f"http://[::1]:{one.port}/clip.mp4",
        f"http://[::ffff:127.0.0.1]:{one.port}/clip.mp4",
        "http://169.254.169.254/latest/meta-data/",
        "http://[fd00:ec2::254]/latest/meta-data/",
        "http://10.0.0.7/clip.mp4",
        "http://192.168.1.1/clip.mp4",
        "http://0.0.0.0:80/clip.mp4",
        "http://224.0.0.1/clip.mp4",
    ):
        refused(open_server, body(url), 403, where, "not public")
    refused(open_server, body(f"http://user:pw@127.0.0.1:{one.port}/x"), 400, where, "credentials")
    refused(open_server, body("gopher://127.0.0.1:70/x"), 400, where, "http(s) URL")
    assert one.hits == []  # not one connection was made
    # --allowed-media-domains 127.0.0.1:PORT localhost: that address and port only, by name
    code, got, _ = guarded.post(body(f"{one.url}/clip.mp4"), headers=auth())
    assert code == 200, got
    code, ref, _ = guarded.post(body("file://clip.mp4"), headers=auth())
    assert got["choices"][0]["message"] == ref["choices"][0]["message"]
    refused(guarded, body(f"{two.url}/clip.mp4"), 403, where, "--allowed-media-domains", auth())
    redirect = f"{one.url}/redirect?to="
    for target, words in (
        (f"{two.url}/clip.mp4", "--allowed-media-domains"),  # another port
        (f"http://localhost:{one.port}/clip.mp4", "not public"),  # an allowed name, loopback
        ("http://10.0.0.7/clip.mp4", "--allowed-media-domains"),
        ("file:///etc/passwd", "only http and https"),
    ):
        err, _ = refused(guarded, body(redirect + target), 403, where, words, auth())
        assert "redirect" in err["message"] or "only http" in err["message"]
    # the other port was never contacted, nor the first one again under the name localhost
    assert two.hits == [] and one.hits.count("/clip.mp4") == 1, (one.hits, two.hits)
    refused(guarded, body(f"{one.url}/big"), 413, where, "--max-upload-mb", auth())
    err, _ = refused(guarded, body(f"{one.url}/slow"), 504, where, "3 s", auth())
    assert "127.0.0.1" not in err["message"] and "Errno" not in err["message"]
    assert guarded.get("/health")["status"] == "ok"


# ---------------------------------------------------------------- uploads naming local files


def _allow_list():
    for name in ("longvideo.data.containers", "longvideo.data.video"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "ALLOWED_FORMATS"):
            return module.ALLOWED_FORMATS
    pytest.skip("the video reader has no container allow-list here (ALLOWED_FORMATS)")


def test_uploads_naming_files_beside_the_server_are_refused(guarded, material):
    """Concat scripts, HLS playlists and image sequences that name real files in the server's
    working directory: refused (400, naming the detected format), nothing of those files decoded.
    Needs the reader's container allow-list (longvideo.data.containers); skipped without it."""
    _allow_list()
    where = "messages[0].content[0].video_url.url"
    for what, payload in guarded.uploads.items():
        err, _ = refused(
            guarded, body(data_url(payload)), 400, where, "not a readable video", auth()
        )
        if what != "hls":  # FFmpeg picks HLS only for a name ending .m3u8: bytes are not opened
            assert "'concat'" in err["message"], (what, err)
    code, got, _ = guarded.post(body("file://clip.mp4"), headers=auth())
    assert code == 200, got
    assert set(guarded.written()) == guarded.planted


# ---------------------------------------------------------------- two ranks


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_survive_failed_requests(material, tmp_path):
    """Under torchrun (2 gloo ranks): temperature 1e-300 is answered (greedy), a failure on every
    rank and one on rank 1 alone each fail only their request (500 with its id, /health degraded),
    and every rank answers the next request as the single process does."""
    shim = tmp_path / "serve_shim.py"
    shim.write_text(SHIM)
    one = Server(material["ckpt"], tmp_path / "one", "--media-dir", str(material["media"]))
    try:
        code, want, _ = one.post(body("file://clip.mp4"))
        assert code == 200
    finally:
        one.stop()
    sp = Server(
        material["ckpt"],
        tmp_path / "sp",
        "--media-dir",
        str(material["media"]),
        nproc=2,
        entry=[str(shim)],
        env={"FAIL_RANK": "1"},
    )
    try:
        url = "file://clip.mp4"
        code, got, _ = sp.post(body(url, temperature=1e-300))
        assert code == 200 and got["choices"][0]["message"] == want["choices"][0]["message"]
        for bad in (body(url, temperature=0.777), body(url, seed=4242)):
            err, _ = refused(sp, bad, 500, None, "model's side")
            health = sp.get("/health")
            assert health["status"] == "degraded" and health["world_size"] == 2
            assert health["last_failure"]["request_id"] == err["request_id"]
            code, got, _ = sp.post(body(url))
            assert code == 200 and got["choices"][0]["message"] == want["choices"][0]["message"]
            assert sp.get("/health")["status"] == "ok"
        assert sp.logged("injected: rank 1 cannot hold the KV cache")
        assert sp.logged("failed (rank 1)") and sp.proc.poll() is None
    finally:
        sp.stop()


# ---------------------------------------------------------------- units


def test_addresses_that_are_not_public():
    for a in (
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.0.1",
        "169.254.169.254",
        "100.100.100.200",
        "0.0.0.0",
        "224.0.0.1",
        "255.255.255.255",
        "::1",
        "::",
        "fe80::1",
        "fd00:ec2::254",
        "ff02::1",
        "::ffff:10.0.0.1",
        "64:ff9b::a00:1",
        "2002:a00:1::1",
        "2001:db8::1",
        "not an address",
    ):
        assert not is_public(a), a
    for a in ("93.184.216.34", "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8"):
        assert is_public(a), a


def test_remote_fetch_checks_what_a_name_resolves_to():
    """A public-looking name resolving to a private address (DNS rebinding) is refused before any
    connection; every address counts; an IP literal in the allow-list is the only exception."""

    def resolver(names):
        return lambda host, port: names[host]

    where = "url"
    names = {"media.example": ["10.0.0.5"], "mixed.example": ["8.8.8.8", "127.0.0.1"]}
    policy = MediaPolicy(1 << 20, allow_remote=True, resolver=resolver(names))
    for url in ("http://media.example/v.mp4", "https://mixed.example/v.mp4"):
        with pytest.raises(FetchError) as e:
            fetch_remote(url, where, policy)
        assert e.value.status == 403 and "not public" in str(e.value)
        assert "10.0.0.5" not in str(e.value) and "127.0.0.1" not in str(e.value)
        assert ".example" in e.value.detail  # the log says which name and addresses
    listed = MediaPolicy(
        1 << 20, allow_remote=True, allowed_domains=("media.example",), resolver=resolver(names)
    )
    with pytest.raises(FetchError, match="not public"):
        fetch_remote("http://media.example/v.mp4", where, listed)
    with pytest.raises(FetchError, match="allowed-media-domains"):
        fetch_remote("http://mixed.example/v.mp4", where, listed)
    with pytest.raises(FetchError, match="allow-remote-media"):
        fetch_remote("http://media.example/v.mp4", where, MediaPolicy(1 << 20))


def test_one_cache_budget_is_never_exceeded():
    class Entry:
        def __init__(self, n):
            self.n = n

        def nbytes(self):
            return self.n

    caches, rng = Caches(1000), np.random.default_rng(0)
    for i in range(200):
        kind, n = ("kv", "video")[i % 2], int(rng.integers(1, 400))
        dropped = caches.make_room(n, keep=(("kv", "pinned"),) if i > 5 else ())
        assert all(k != "pinned" for k in dropped)
        if i == 5:
            kind, key = "kv", "pinned"
        else:
            key = str(i)
        caches.put(kind, key, Entry(n if key != "pinned" else 50))
        assert caches.nbytes() <= 1000
    assert caches.peek("kv", "pinned") is not None


def test_rank_messages_round_trip():
    msg = RankMessage(
        Kind.GENERATE,
        request_id="req-abc",
        key="0123abcd",
        ids=(1, 2, 3, 2**40),
        video_end=2,
        reuse=-1,
        sampling=Sampling(temperature=0.7, top_p=0.9, top_k=5, seed=-(2**63), max_tokens=12),
        evict=("k1", "k2"),
    )
    assert RankMessage.decode(msg.encode()) == msg
    assert RankMessage.decode(RankMessage(Kind.STOP).encode()) == RankMessage(Kind.STOP)


def test_incremental_detokenization_adds_up_to_the_full_decode():
    from test_infer_chat import tiny_pretrained

    tok = tiny_pretrained().tokenizer
    rng = np.random.default_rng(1)
    for stop in ([], ["e"], ["the ", "xyz"]):
        for _ in range(20):
            ids = rng.integers(0, tok.text_size, 40).tolist()
            answer, sent = Answer(tok, stop), []
            for i in ids:
                sent.append(answer.add(i))
                if answer.finish:
                    break
            sent.append(answer.flush())
            assert "".join(sent) == answer.text()
            full = tok.decode(answer.ids)
            cut = min((full.index(s) for s in stop if s in full), default=len(full))
            assert answer.text() == full[:cut].strip()


def test_decoding_stops_when_the_client_leaves_or_the_deadline_passes(material):
    """The worker checks the job after every chunk of decoded frames: a cancelled or late job
    stops there, and nothing of it is cached."""
    from longvideo.infer.serve import ServeSettings, Service

    settings = ServeSettings(model="m", name="m", media=MediaPolicy(1 << 24))
    svc = Service(material["pre"], settings)
    data = (material["media"] / "clip.mp4").read_bytes()
    from longvideo.infer.api import ChatRequest

    req = ChatRequest(turns=[(NEEDLE_QUESTION, None)], video_url="x", video_field="url")
    for reason in ("cancelled", "timeout"):
        job = Job(req, Sampling(max_tokens=6), "k", data, "req-1", time.monotonic() + 60)
        if reason == "cancelled":
            job.cancelled.set()
        else:
            job.deadline = time.monotonic() - 1
        with pytest.raises(Stopped) as e:
            svc._encode(job, [], NEEDLE_QUESTION)
        assert e.value.reason == reason
        assert svc.stats.videos_encoded == 0 and svc.caches.nbytes() == 0


def test_flags_become_settings_and_bad_ones_are_named(monkeypatch, capsys):
    from longvideo.infer import serve_cli
    from longvideo.infer.asgi import _host_ok

    monkeypatch.setenv("LONGVIDEO_API_KEY", ENV_KEY)
    args = serve_cli.parser().parse_args(["--model", "m", "--api-key", "a", "--host", "0.0.0.0"])
    s = serve_cli.settings_from_args(args)
    assert s.api_keys == ("a", ENV_KEY) and s.host_allow_list() is None  # not loopback: any
    s = serve_cli.settings_from_args(serve_cli.parser().parse_args(["--model", "m"]))
    assert set(s.host_allow_list()) == {"127.0.0.1", "localhost", "::1"}
    argv = ["--model", "m", "--allowed-hosts", "*"]
    assert (
        serve_cli.settings_from_args(serve_cli.parser().parse_args(argv)).host_allow_list() is None
    )
    for bad, flag in (
        (["--max-queue", "0"], "--max-queue"),
        (["--request-timeout", "0"], "--request-timeout"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--api-key", ""], "--api-key"),
        (["--allowed-media-domains", "host:port"], "--allowed-media-domains"),
        (["--media-timeout", "-1"], "--media-timeout"),
    ):
        assert serve_cli.main(["--model", "m", *bad]) == 2
        assert f"longvideo serve: error: {flag}" in capsys.readouterr().err
    # Host headers as the allow-list reads them
    scope = lambda host: {"headers": [(b"host", host.encode())]}  # noqa: E731
    allowed = ("localhost", "[::1]:8000", "videos.example.org:443")
    for host, ok in (
        ("localhost", True),
        ("LOCALHOST:9", True),
        ("localhost.:9", True),
        ("[::1]:8000", True),
        ("[::1]:8001", False),
        ("videos.example.org:443", True),
        ("videos.example.org", False),
        ("evil.localhost", False),
        ("", False),
    ):
        assert _host_ok(scope(host), allowed) == ok, host


def test_health_says_when_the_server_cannot_serve(material):
    from longvideo.infer.serve import ServeSettings, Service

    svc = Service(
        material["pre"],
        ServeSettings(model="m", name="m", media=MediaPolicy(1 << 20), request_timeout=1),
    )
    assert svc.health()[0] == 200 and svc.health()[1]["status"] == "ok"
    svc.last_failure = {"request_id": "req-x", "at": 0.0}
    assert svc.health()[1]["status"] == "degraded"
    svc.last_failure, svc.busy_since = None, time.monotonic() - 1000  # stuck past its deadline
    status, health = svc.health()
    assert status == 200 and health["status"] == "degraded" and "past" in health["reason"]
    svc.worker_alive = False
    status, health = svc.health()
    assert status == 503 and health["status"] == "unavailable"
