"""`longvideo serve` as a separate process on 127.0.0.1: the real openai client against `longvideo chat`
and an independent pipeline, multi-turn caching, sequence-parallel serving, and every bad input."""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_infer_chat import tiny_pretrained, write_video

from longvideo.checkpoint import save_project_checkpoint
from longvideo.data.synthetic import NEEDLE_QUESTION
from longvideo.data.templates import LayoutOptions, build_prompt, layout_doc
from longvideo.data.video import read_video
from longvideo.infer import cli
from longvideo.infer.serve import Answer
from longvideo.vq import encode_video

openai = pytest.importorskip("openai")
REPO = Path(__file__).resolve().parent.parent
QUESTION_2 = "What shape came first?"


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """The references here run on one torch thread, as the server does (OMP_NUM_THREADS=1)."""


class Server:
    """`python -m longvideo serve ...` (or under torchrun) on a free port, in an empty working directory."""

    def __init__(
        self,
        model,
        root: Path,
        *args: str,
        nproc: int = 1,
        timeout: float = 240,
        api_key: str = "none",
        entry: list[str] | None = None,
        env: dict | None = None,
    ):
        """entry: what runs instead of `-m longvideo serve` (a script that takes serve's flags)."""
        self.home = root / "home"
        for d in (self.home, root / "cwd", root / "tmp"):
            d.mkdir(parents=True, exist_ok=True)
        env = dict(
            os.environ,
            HOME=str(self.home),
            TMPDIR=str(root / "tmp"),
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO),
            **(env or {}),
        )
        launch = (
            [sys.executable, "-m", "longvideo"]
            if nproc == 1
            else [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={nproc}",
                "-m",
                "longvideo",
            ]
        )
        self.dirs = [self.home, root / "cwd", root / "tmp"]
        if entry is not None:
            launch = [*launch[:-2], *entry] if nproc > 1 else [sys.executable, *entry]
        else:
            launch = [*launch, "serve"]
        self.proc = subprocess.Popen(
            [*launch, "--model", str(model), "--port", "0", "--quiet", *args],
            cwd=root / "cwd",
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        got = threading.Event()
        threading.Thread(target=self._read, args=(got,), daemon=True).start()
        if not got.wait(timeout):
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.lines))
        self.client = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120
        )

    def _read(self, got: threading.Event) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r" on (http://[\d.]+:\d+)/", line)
            if m:
                self.url = m.group(1)
                got.set()

    def logged(self, text: str, timeout: float = 30) -> bool:
        """Whether the server has printed a line containing ``text`` (its output is read by a
        thread, so a line may arrive after the response it belongs to: wait for it)."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def get(self, path: str, headers: dict | None = None) -> dict:
        req = urllib.request.Request(self.url + path, headers=headers or {})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def post(self, body, raw: bool = False, headers: dict | None = None) -> tuple[int, dict, dict]:
        """POST /v1/chat/completions; (status, JSON, headers (case-insensitive))."""
        data = body if raw else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + "/v1/chat/completions",
            data=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read()), r.headers
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), e.headers

    def written(self) -> list[str]:
        """Files the server left in its working directory, home or temporary directory (importing
        torchvision makes an empty torchinductor_<user> directory in TMPDIR: not a file)."""
        return sorted(str(p) for d in self.dirs for p in d.rglob("*") if not p.is_dir())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def data_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def messages(url: str, question: str, history=()) -> list[dict]:
    """The OpenAI form: the video in the first user message, earlier turns as they were answered."""
    turns = [*history, (question, None)]
    out = []
    for i, (q, a) in enumerate(turns):
        content = (
            [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": q}]
            if i == 0
            else q
        )
        out.append({"role": "user", "content": content})
        if a is not None:
            out.append({"role": "assistant", "content": a})
    return out


def greedy(pre, ids: list[int], n: int) -> list[int]:
    """Independent decoding: full recomputation every step, no cache; the tokens before <eos>."""
    x, out = torch.tensor([ids]), []
    with torch.no_grad():
        for _ in range(n):
            tok = int(pre.model.logits(pre.model(x))[0, -1].argmax())
            out.append(tok)
            if tok == pre.tokenizer.eos_id:
                break
            x = torch.cat([x, torch.tensor([[tok]])], 1)
    return out


@pytest.fixture(scope="module")
def material(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    pre = tiny_pretrained()
    ckpt = save_project_checkpoint(
        root / "ckpt", pre.model.state_dict(), pre.config, tokenizer=pre.tokenizer, vq=pre.vq
    )
    media = root / "media"
    media.mkdir()
    write_video(media / "clip.mp4", seconds=6, seed=3)
    write_video(media / "other.mp4", seconds=5, seed=11)
    (root / "secret.mp4").write_bytes((media / "clip.mp4").read_bytes())
    return dict(root=root, pre=pre, ckpt=ckpt, media=media)


@pytest.fixture(scope="module")
def server(material):
    s = Server(
        material["ckpt"],
        material["root"] / "run",
        "--media-dir",
        str(material["media"]),
        "--max-upload-mb",
        "0.25",
        "--max-queue",
        "2",
    )
    yield s
    s.stop()


def test_openai_client_answers_as_longvideo_chat(server, material, capsys):
    pre, clip = material["pre"], material["media"] / "clip.mp4"
    assert [m.id for m in server.client.models.list().data] == ["ckpt"]
    assert (
        cli.chat_main(
            [
                "--model",
                str(material["ckpt"]),
                "--video",
                str(clip),
                "--question",
                NEEDLE_QUESTION,
                "--quiet",
            ]
        )
        == 0
    )
    chat = capsys.readouterr().out.strip()
    url = data_url(clip.read_bytes())
    r = server.client.chat.completions.create(model="ckpt", messages=messages(url, NEEDLE_QUESTION))
    assert r.choices[0].message.content == chat
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # the same through the independent pipeline (no cache, full recomputation)
    tokens = [
        t for t in greedy(pre, ids_of(pre, clip, NEEDLE_QUESTION), 6) if t != pre.tokenizer.eos_id
    ]
    assert chat == pre.tokenizer.decode(tokens).strip()
    assert r.usage.completion_tokens == len(greedy(pre, ids_of(pre, clip, NEEDLE_QUESTION), 6))
    assert r.usage.prompt_tokens == len(ids_of(pre, clip, NEEDLE_QUESTION))
    # streamed: the deltas add up to the same answer; usage comes last; file:// under --media-dir too
    for u in (url, "file://clip.mp4", f"file://{clip}"):
        stream = server.client.chat.completions.create(
            model="ckpt",
            messages=messages(u, NEEDLE_QUESTION),
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[
            0
        ].finish_reason
    # the frames the model was given, as thumbnails
    video = r.model_extra["video"]
    assert video["frames"] == 6 and len(video["timestamps"]) == 6
    with urllib.request.urlopen(server.url + video["thumbnails"]) as t:
        assert t.headers["Content-Type"] == "image/jpeg" and t.read(2) == b"\xff\xd8"
    health = server.get("/health")
    assert health["videos_encoded"] == 1  # four requests, one video, encoded once


def ids_of(pre, video: Path, question: str) -> list[int]:
    """The single-question prompt from a whole decode and a one-shot encode of the video."""
    clip = read_video(str(video), fps=1.0, size=pre.vq.cfg.resolution)
    codes = encode_video(pre.vq, clip.frames)
    return build_prompt(pre.tokenizer, pre.model.cfg.vocab, codes, clip.timestamps, question).ids


def test_follow_up_prefills_only_the_new_turn(server, material):
    pre, video = material["pre"], material["media"] / "other.mp4"
    tok = pre.tokenizer
    first = ids_of(pre, video, NEEDLE_QUESTION)
    gen1 = greedy(pre, first, 6)
    a1 = tok.decode([t for t in gen1 if t != tok.eos_id]).strip()
    # turn 2 as the training QA template lays it out: ... Answer: a1 <eos> Question: q2\nAnswer:
    second = (
        first + tok.encode(f" {a1}") + [tok.eos_id] + tok.encode(f"Question: {QUESTION_2}\nAnswer:")
    )
    want = tok.decode([t for t in greedy(pre, second, 6) if t != tok.eos_id]).strip()
    before = server.get("/health")
    url = f"file://{video.name}"
    r1 = server.client.chat.completions.create(
        model="ckpt", messages=messages(url, NEEDLE_QUESTION)
    )
    assert r1.choices[0].message.content == a1
    r2 = server.client.chat.completions.create(
        model="ckpt", messages=messages(url, QUESTION_2, [(NEEDLE_QUESTION, a1)])
    )
    assert r2.choices[0].message.content == want
    assert r2.usage.prompt_tokens == len(second)
    # the cache held the first prompt and the answer's tokens fed back (all but the last one)
    held = first + gen1[:-1]
    common = next(
        (i for i, (a, b) in enumerate(zip(held, second)) if a != b), min(len(held), len(second))
    )
    assert r2.usage.prompt_tokens_details.cached_tokens == common >= len(first)
    assert (
        server.get("/health")["videos_encoded"] == before["videos_encoded"] + 1
    )  # encoded once for both turns


def raw_post(server, body: bytes, length: int | None = None) -> tuple[int, dict]:
    """POST with a declared Content-Length (the body need not be sent whole); (status, JSON)."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(len(body) if length is None else length))
    conn.endheaders()
    conn.send(body)
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def png_image() -> bytes:
    """A photograph-sized PNG (FFmpeg would read it as a one-frame video)."""
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(
        out, "PNG"
    )
    return out.getvalue()


def test_bad_input_is_a_clear_error_and_the_server_keeps_serving(server, material):
    clip = (material["media"] / "clip.mp4").read_bytes()
    good = data_url(clip)

    def body(url=good, question=NEEDLE_QUESTION, **extra):
        return {"model": "ckpt", "messages": messages(url, question), **extra}

    assert server.post(body())[0] == 200  # the clip is encoded (all 6 frames) and cached
    cases = [  # (request, status, words the message must hold, the field named)
        (b"{not json", 400, "not JSON", None),
        (b"[1, 2]", 400, "JSON object", "body"),
        ({"model": "ckpt"}, 400, "non-empty list", "messages"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": good}}]}
                ]
            },
            400,
            "not supported",
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "system", "content": "be brief"}]},
            400,
            "not supported",
            "messages[0].role",
        ),
        (
            {"messages": [{"role": "user", "content": "no video here"}]},
            400,
            "no video_url",
            "messages[0].content",
        ),
        (body(temperature="hot"), 400, "number", "temperature"),
        (body(max_tokens=0), 400, ">= 1", "max_tokens"),
        (body(top_p=0), 400, "> 0", "top_p"),
        (body(n=2), 400, "only 1", "n"),
        (body(stop=[""]), 400, "non-empty string", "stop"),
        ({**body(), "model": "gpt-4o"}, 404, "not served here", "model"),
        (
            body(url=data_url(b"plain text, not a video " * 40)),
            400,
            "not a readable video",
            "messages[0].content[0].video_url.url",
        ),
        (
            body(url=data_url(clip[: len(clip) // 2])),
            400,
            "not a readable video",
            "messages[0].content[0].video_url.url",
        ),  # truncated
        (
            body(url=data_url(clip[:64] + bytes(range(256)) * 8)),
            400,
            "not a readable video",
            "messages[0].content[0].video_url.url",
        ),  # corrupt
        (
            body(url=data_url(clip, "image/png")),
            400,
            "must hold a video",
            "messages[0].content[0].video_url.url",
        ),
        (
            body(url=data_url(png_image())),
            400,
            "a PNG image, not a video",
            "messages[0].content[0].video_url.url",
        ),
        (
            body(url="data:video/mp4;base64,@@@@"),
            400,
            "not valid base64",
            "messages[0].content[0].video_url.url",
        ),
        (
            body(url=data_url(os.urandom(300_000))),
            413,
            "over the server's limit",
            "messages[0].content[0].video_url.url",
        ),
        (
            body(url=f"file://{material['root'] / 'secret.mp4'}"),
            403,
            "outside --media-dir",
            "messages[0].content[0].video_url.url",
        ),
        (body(url="file://../secret.mp4"), 403, "'..'", "messages[0].content[0].video_url.url"),
        (
            body(url="file://missing.mp4"),
            404,
            "no such file",
            "messages[0].content[0].video_url.url",
        ),
        (
            body(url="http://127.0.0.1:9/clip.mp4"),
            403,
            "--allow-remote-media",
            "messages[0].content[0].video_url.url",
        ),
        (
            body(max_tokens=1000),
            400,
            "more than the model's context of 1024; no frame budget fits",
            "messages",
        ),
        (
            body(max_tokens=1000, fps=0.5),
            400,
            "not one frame fits in the model's context of 1024",
            "messages",
        ),
    ]
    for request, status, words, param in cases:
        code, got, _ = server.post(request, raw=isinstance(request, bytes))
        assert code == status, (
            request if isinstance(request, bytes) else json.dumps(request)[:300],
            got,
        )
        assert words in got["error"]["message"] and got["error"]["param"] == param, got
    # too long for the context: the message says how many tokens and which frame budget would fit
    code, got, _ = server.post(body(max_tokens=940))
    assert code == 400, got
    m = re.search(
        r"the prompt is (\d+) tokens .* a frame budget of (\d+) frames would fit",
        got["error"]["message"],
    )
    assert m and int(m.group(1)) + 940 > 1024, got
    code, ok, _ = server.post(body(max_tokens=940, max_frames=int(m.group(2))))
    assert code == 200 and ok["video"]["frames"] == int(m.group(2)), ok
    # a body over the limit is refused before it is read (413), a missing video part names the field
    assert raw_post(server, b"{}", length=3 << 20)[0] == 413
    # the server still answers, and wrote nothing
    code, ok, _ = server.post(body())
    assert code == 200 and ok["choices"][0]["message"]["content"] is not None
    assert server.get("/health")["status"] == "ok"
    assert server.written() == []


def _slow_stream(server, url: str, max_tokens: int = 800):
    """Open a streamed request and return the connection and response once its first event is in."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    payload = json.dumps(
        {
            "model": "ckpt",
            "messages": messages(url, NEEDLE_QUESTION),
            "max_tokens": max_tokens,
            "stream": True,
            "stop": ["never to be seen"],
        }
    )
    conn.request(
        "POST", "/v1/chat/completions", body=payload, headers={"Content-Type": "application/json"}
    )
    return conn, conn.getresponse()


def test_queue_full_is_429_and_a_client_that_leaves_frees_its_slot(server, material):
    url = "file://clip.mp4"
    # a client that disconnects mid-stream: generation stops (counted as cancelled), the server goes on
    before = server.get("/health")
    conn, r = _slow_stream(server, url)
    assert r.status == 200 and r.readline().startswith(b"data: ")
    r.close()  # this hangs up
    conn.close()
    deadline = time.time() + 60
    while (h := server.get("/health"))["busy"] or h["cancelled"] == before["cancelled"]:
        assert time.time() < deadline, h
        time.sleep(0.1)
    assert h["cancelled"] == before["cancelled"] + 1 and h["served"] == before["served"]
    # 8 concurrent slow requests on a queue of 2: one runs, two wait, the rest are told to retry
    results = []

    def client():
        code, got, headers = server.post(
            {
                "model": "ckpt",
                "messages": messages(url, NEEDLE_QUESTION),
                "max_tokens": 400,
                "stop": ["never to be seen"],
            }
        )
        results.append((code, headers.get("Retry-After"), got))

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    codes = sorted(c for c, _, _ in results)
    assert len(results) == 8 and set(codes) == {200, 429} and codes.count(200) >= 3, codes
    for code, retry, got in results:
        if code == 429:
            assert int(retry) >= 1 and "retry in" in got["error"]["message"]
        else:
            assert got["usage"]["completion_tokens"] == 400  # answered whole
    assert server.get("/health")["queued"] == 0


@pytest.mark.slow  # out of make check's five minutes; make test runs it
@pytest.mark.distributed
def test_sequence_parallel_server_answers_as_one_process(server, material):
    """Under torchrun (2 gloo ranks) the ring-prefilled, sharded answers are the single process's,
    and a follow-up extends the sharded cache (the replicated tail) instead of prefilling again."""
    sp = Server(
        material["ckpt"], material["root"] / "sp", "--media-dir", str(material["media"]), nproc=2
    )
    try:
        history = []
        for q in (NEEDLE_QUESTION, QUESTION_2):
            want = server.client.chat.completions.create(
                model="ckpt", messages=messages("file://clip.mp4", q, history)
            )
            got = sp.client.chat.completions.create(
                model="ckpt", messages=messages("file://clip.mp4", q, history), stream=False
            )
            assert got.choices[0].message.content == want.choices[0].message.content
            assert got.usage.completion_tokens == want.usage.completion_tokens
            history.append((q, got.choices[0].message.content))
        assert got.usage.prompt_tokens_details.cached_tokens > 0
        assert sp.get("/health")["world_size"] == 2
    finally:
        sp.stop()


@pytest.mark.slow  # out of make check's five minutes; make test runs it
@pytest.mark.distributed
def test_one_rank_failing_at_start_up_stops_every_rank(material, tmp_path):
    """Under torchrun, a rank that cannot load the model makes every rank stop at start-up with one
    error line naming it (exit 2 each), instead of the others serving or waiting in a collective."""
    shim = (
        tmp_path / "rank1_fails.py"
    )  # the real `longvideo serve`, except that rank 1 cannot load the model
    shim.write_text(
        textwrap.dedent("""\
        import os, sys
        from longvideo.infer import serve_cli as serve
        load = serve.load_model


        def load_model(path, device):
            if os.environ["RANK"] == "1":
                raise FileNotFoundError("rank 1 cannot read the model")
            return load(path, device)


        serve.load_model = load_model
        sys.exit(serve.main(sys.argv[1:]))
    """)
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    # --monitor-interval: torchrun stops the other rank after the first exits; give rank 0 time to say why
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "--monitor-interval=2",
            str(shim),
            "--model",
            str(material["ckpt"]),
            "--port",
            "0",
            "--quiet",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "longvideo serve: error (rank 1): rank 1 cannot read the model" in out, out
    assert (
        "longvideo serve: error (rank 0): rank 1 failed, so every rank stops: FileNotFoundError: rank 1 "
        "cannot read the model"
    ) in out, out
    assert " on http://" not in out and "longvideo/infer/" not in out, (
        out
    )  # no rank served, none raised


def test_follow_up_prompt_is_the_training_layout_of_the_conversation():
    """The prompt of turn 2 is the start of the QA training document with both pairs, up to where
    the second answer begins (so a model sees at serving time what it was trained on)."""
    pre = tiny_pretrained()
    codes, times = torch.randint(0, 16, (3, 4, 4)).numpy(), np.arange(3.0)
    pairs = [(NEEDLE_QUESTION, "red"), (QUESTION_2, "a circle")]
    doc = layout_doc(
        pre.tokenizer,
        pre.model.cfg.vocab,
        codes,
        times,
        {"qa": [{"question": q, "answer": a} for q, a in pairs]},
        "qa",
        False,
        LayoutOptions(),
        max_len=1024,
    )
    prompt = build_prompt(
        pre.tokenizer, pre.model.cfg.vocab, codes, times, QUESTION_2, history=pairs[:1]
    )
    assert doc.ids[: len(prompt.ids)].tolist() == prompt.ids
    assert doc.ids[len(prompt.ids) :].tolist() == pre.tokenizer.encode(" a circle") + [
        pre.tokenizer.eos_id
    ]
    first = build_prompt(pre.tokenizer, pre.model.cfg.vocab, codes, times, NEEDLE_QUESTION)
    assert prompt.ids[: len(first.ids)] == first.ids and prompt.video_end == first.video_end


class _CharTokenizer:
    """One token per character (ids are code points): decoding is exact and prefix-stable."""

    def decode(self, ids):
        return "".join(map(chr, ids))


@pytest.mark.parametrize("stop", [[], ["END"], ["x", "world"]])
def test_streamed_deltas_add_up_to_the_answer_and_never_show_a_stop_string(stop):
    text = "  hello world END and more  "
    answer, sent = Answer(_CharTokenizer(), stop), []
    for ch in text:
        sent.append(answer.add(ord(ch)))
        assert not any(s in "".join(sent) for s in stop)
        if answer.finish:
            break
    sent.append(answer.flush())
    cut = min((text.index(s) for s in stop if s in text), default=len(text))
    assert "".join(sent) == answer.text() == text[:cut].strip()
    assert answer.finish == ("stop" if cut < len(text) else None)
    assert sum(bool(d) for d in sent) > 3  # it streamed
