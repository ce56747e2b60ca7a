"""`longvideo serve` under a slow-client attack: an ordinary client's latency while 200 connections
send their request headers a byte at a time, against the same client's latency on the quiet server.

    python scripts/bench_serve_slow.py                    # a tiny random model made here
    python scripts/bench_serve_slow.py --model runs/demo-quick/hf

The server runs as its own process (`python -m longvideo serve`, its defaults: --header-timeout 10,
--max-connections 512). The ordinary client asks a follow-up question about a video the server has
already encoded (a data: URL, as the page sends it), one request at a time; a trial is the median of
`--requests` such requests, and each phase is `--trials` trials. The attackers (one thread, one
selector) open `--slow` connections, send `GET / HTTP/1.1` and then one header byte per connection
every `--drip` seconds; a connection the server closes (its header deadline) is opened again at
once, so `--slow` stay open throughout. Quiet and loaded trials alternate. Reported: the median of
the trials and their spread, and the ratio loaded / quiet. Writes docs/bench/serve_slow.json.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchreport import Section, Target, arg_parser, fmt_num, md_table, req, save, yes_no

TITLE = "Serving: an ordinary client among slow ones"
DOCS = ["serving.md", "security.md"]
TARGETS = [Target("serve: latency with 200 slow-header connections / quiet server", "<= 1.5")]
QUESTION, FOLLOW_UP = "What colour was the flash frame?", "What shape came first?"


def report(result: dict) -> Section:
    quiet, loaded = req(result, "quiet_ms"), req(result, "loaded_ms")
    ratio = req(result, "ratio")
    rows = [
        [
            name,
            fmt_num(statistics.median(ms), ".1f"),
            f"{min(ms):.1f}-{max(ms):.1f}",
            str(len(ms)),
        ]
        for name, ms in (
            ("quiet server", quiet),
            (f"{result['slow']} slow connections open", loaded),
        )
    ]
    table = md_table(
        ["phase", "latency (ms), median of trials", "spread (min-max)", "trials"], rows
    )
    return Section(
        table,
        [Target(TARGETS[0].what, TARGETS[0].goal, f"{ratio:.2f}", yes_no(ratio <= 1.5))],
        [
            f"each trial: the median of {result['requests']} follow-up requests "
            f"(max_tokens {result['max_tokens']}) on {result['model']}; the attackers sent one "
            f"header byte per connection every {result['drip_s']} s and reopened the "
            f"{result['reopened']} connections the server closed (at least "
            f"{result['min_open']} open at every measurement)"
        ],
    )


def tiny_model(out: Path) -> Path:
    """A random tiny model (BPE tokenizer, VQ, decoder) saved as a project checkpoint."""
    import torch

    from longvideo.checkpoint import Pretrained, save_project_checkpoint
    from longvideo.config import Config
    from longvideo.infer.config import InferConfig
    from longvideo.model import ModelConfig, Transformer
    from longvideo.tokenizer import train_text_tokenizer
    from longvideo.vq import VQConfig, VQModel

    torch.manual_seed(0)
    tok = train_text_tokenizer([QUESTION, FOLLOW_UP, "Question: Answer: red green"] * 4, 300)
    vq_cfg = VQConfig(
        mode="2d",
        resolution=16,
        downsample=4,
        temporal_downsample=2,
        codebook_size=16,
        channels=8,
        channel_mult=(1, 1, 1),
        num_res_blocks=1,
    )
    mcfg = ModelConfig(
        text_vocab_size=tok.text_size,
        codebook_size=16,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=1024,
    )
    cfg = Config(model=mcfg, vq=vq_cfg, infer=InferConfig(max_new_tokens=8, prefill_chunk=64))
    pre = Pretrained(Transformer(mcfg).eval(), cfg, tok, VQModel(vq_cfg).eval())
    return save_project_checkpoint(
        out, pre.model.state_dict(), pre.config, tokenizer=pre.tokenizer, vq=pre.vq
    )


def video_url(seconds: int) -> str:
    from longvideo.data.synthetic import SyntheticSpec, make_sample

    spec = SyntheticSpec(
        size=32, fps=4, min_seconds=seconds, max_seconds=seconds, long_fraction=0.0
    )
    return "data:video/mp4;base64," + base64.b64encode(make_sample(7, 0, spec).mp4()).decode()


class SlowClients:
    """`n` connections that send their headers a byte at a time, reopened when closed."""

    def __init__(self, host: str, port: int, n: int, drip: float):
        self.host, self.port, self.n, self.drip = host, port, n, drip
        self.sel, self.stop, self.reopened, self.open = selectors.DefaultSelector(), False, 0, 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _connect(self) -> None:
        s = socket.create_connection((self.host, self.port), timeout=10)
        s.setblocking(False)
        s.send(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        self.sel.register(s, selectors.EVENT_READ)

    def start(self) -> None:
        for _ in range(self.n):
            self._connect()
        self.open = self.n
        self.thread.start()

    def _run(self) -> None:
        last = 0.0
        while not self.stop:
            for key, _ in self.sel.select(timeout=0.05):  # readable: the server closed it
                s = key.fileobj
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    self.sel.unregister(s)
                    s.close()
                    self.reopened += 1
                    self._connect()
            if time.monotonic() - last >= self.drip:
                last = time.monotonic()
                for key in list(self.sel.get_map().values()):
                    try:
                        key.fileobj.send(b"X")
                    except OSError:
                        pass
            self.open = len(self.sel.get_map())

    def close(self) -> None:
        self.stop = True
        self.thread.join(10)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()


def ask(host: str, port: int, payload: bytes) -> float:
    """One chat completion; its latency in ms."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=120)
    conn.request("POST", "/v1/chat/completions", payload, {"Content-Type": "application/json"})
    r = conn.getresponse()
    body = r.read()
    conn.close()
    if r.status != 200:
        raise SystemExit(f"the ordinary client was refused: {r.status} {body[:300]!r}")
    return (time.perf_counter() - t0) * 1000


def main(argv=None) -> None:
    p = arg_parser(__doc__, "serve_slow")
    p.add_argument("--model", default=None, help="model directory (default: a tiny random one)")
    p.add_argument("--slow", type=int, default=200, help="slow connections (default 200)")
    p.add_argument("--drip", type=float, default=1.0, help="seconds between their header bytes")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--requests", type=int, default=20, help="requests per trial")
    p.add_argument("--max-tokens", type=int, default=8)
    a = p.parse_args(argv)
    from longvideo.machine import describe, machine_info

    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or str(tiny_model(Path(tmp) / "model"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "longvideo", "serve", "--model", model, "--port", "0"]
            + ["--quiet"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            for line in proc.stdout:
                if m := re.search(r" on http://([\d.]+):(\d+)/", line):
                    host, port = m.group(1), int(m.group(2))
                    break
            else:
                raise SystemExit("the server did not start")
            result = measure(host, port, a, model)
        finally:
            proc.terminate()
            proc.wait(30)
    result["machine"] = describe(machine_info())
    save(result, a.out, report=report)


def measure(host: str, port: int, a, model: str) -> dict:
    url = video_url(20)
    parts = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    first = {"messages": [{"role": "user", "content": parts}], "max_tokens": a.max_tokens}
    conn = http.client.HTTPConnection(host, port, timeout=300)
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(first), {"Content-Type": "application/json"}
    )
    answer = json.loads(conn.getresponse().read())["choices"][0]["message"]["content"]
    conn.close()
    turns = [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
    follow = dict(first, messages=first["messages"] + turns)
    payload = json.dumps(follow).encode()
    for _ in range(5):  # warm-up
        ask(host, port, payload)

    def trial() -> float:
        return statistics.median(ask(host, port, payload) for _ in range(a.requests))

    # quiet and loaded trials alternate, so that a change in the machine's load between them
    # weighs on both phases alike
    quiet, loaded, seen, reopened = [], [], [], 0
    for t in range(a.trials):
        quiet.append(trial())
        slow = SlowClients(host, port, a.slow, a.drip)
        slow.start()
        try:
            time.sleep(2 * a.drip)
            loaded.append(trial())
            seen.append(slow.open)
        finally:
            slow.close()
            reopened += slow.reopened
        print(f"trial {t + 1}: quiet {quiet[-1]:.1f} ms, {slow.open} slow open {loaded[-1]:.1f} ms")
    return dict(
        model="tiny random model (dim 32, 2 layers)" if a.model is None else model,
        slow=a.slow,
        drip_s=a.drip,
        requests=a.requests,
        max_tokens=a.max_tokens,
        quiet_ms=quiet,
        loaded_ms=loaded,
        ratio=statistics.median(loaded) / statistics.median(quiet),
        reopened=reopened,
        min_open=min(seen),
    )


if __name__ == "__main__":
    main()
