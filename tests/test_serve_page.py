"""The page of `longvideo serve` in headless Chromium: pick a video, ask, a follow-up; the streamed
answers are the API's, the thumbnails are the frames the model was given; a screenshot is kept.

Chromium is Debian's `chromium` package, installed here with apt-get when /usr/bin/chromium is
missing (the test is skipped, with the reason printed, only when it cannot be installed). It is
driven over the DevTools protocol on a pipe (--remote-debugging-pipe), with no other dependency.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from test_serve import QUESTION_2, REPO, Server, material, messages  # noqa: F401 (material: a fixture)

from longvideo.data.synthetic import NEEDLE_QUESTION

ARTEFACTS = Path(os.environ.get("LONGVIDEO_TEST_ARTEFACTS", REPO / "outputs" / "test-artefacts"))
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--remote-debugging-pipe",
]


def chromium() -> str:
    """The path of Debian's chromium, installed with apt-get if needed; skip (saying why) if impossible."""
    found = shutil.which("chromium") or (
        "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
    )
    if found:
        return found
    log = []
    for cmd in (
        ["apt-get", "install", "-y", "-q", "chromium"],
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "chromium"],
    ):
        try:
            r = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=900,
                env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"),
            )
            log.append(f"$ {' '.join(cmd)} -> {r.returncode}: {r.stderr.strip()[-300:]}")
        except (OSError, subprocess.TimeoutExpired) as e:
            log.append(f"$ {' '.join(cmd)} -> {e}")
        if os.path.exists("/usr/bin/chromium"):
            return "/usr/bin/chromium"
    reason = "Chromium cannot be installed here:\n" + "\n".join(log)
    print(reason)
    pytest.skip(reason)


class Browser:
    """A headless Chromium page over the DevTools protocol (JSON messages ending in NUL on fds 3 and 4)."""

    def __init__(self, exe: str, profile: Path):
        to_chrome, self._w = os.pipe()
        self._r, from_chrome = os.pipe()

        def fds():  # the child reads commands on fd 3 and writes answers on fd 4
            os.dup2(to_chrome, 3)
            os.dup2(from_chrome, 4)

        self.proc = subprocess.Popen(
            [exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            preexec_fn=fds,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome)
        os.close(from_chrome)
        self._id, self._buf, self.session = 0, b"", None
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]

    def call(self, method: str, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if self.session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self._buf:
                chunk = os.read(self._r, 1 << 16)
                assert chunk, "chromium closed the DevTools pipe"
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                assert "error" not in reply, reply
                return reply["result"]

    def js(self, expr: str):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in r, r
        return r["result"].get("value")

    def wait(self, expr: str, timeout: float = 120.0):
        deadline = time.time() + timeout
        while not (value := self.js(expr)):
            assert time.time() < deadline, f"timed out waiting for {expr}"
            time.sleep(0.1)
        return value

    def close(self):
        self.proc.kill()
        self.proc.wait(10)
        os.close(self._w)
        os.close(self._r)


def test_page_uploads_a_video_and_streams_the_apis_answers(material, tmp_path):
    exe = chromium()
    server = Server(material["ckpt"], material["root"] / "page")
    browser = Browser(exe, tmp_path / "profile")
    try:
        clip = material["media"] / "clip.mp4"
        browser.call("Page.enable")
        browser.call("Page.navigate", url=server.url + "/")
        browser.wait(
            "document.readyState === 'complete' && document.getElementById('model').textContent === 'ckpt'"
        )
        root = browser.call("DOM.getDocument")["root"]["nodeId"]
        node = browser.call("DOM.querySelector", nodeId=root, selector="#file")["nodeId"]
        browser.call("DOM.setFileInputFiles", nodeId=node, files=[str(clip)])
        browser.wait("!document.getElementById('send').disabled")
        answers = []
        for i, q in enumerate((NEEDLE_QUESTION, QUESTION_2)):
            browser.js(
                f"document.getElementById('q').value = {json.dumps(q)};"
                "document.getElementById('ask').requestSubmit()"
            )
            bubble = f"document.querySelectorAll('.assistant')[{i}]"
            state = browser.wait(
                f"{bubble} && {bubble}.dataset.state !== 'streaming' && {bubble}.dataset.state"
            )
            assert state == "done", browser.js(f"{bubble}.textContent")
            answers.append(browser.js(f"{bubble}.textContent"))
            # streamed: the answer arrived in several deltas (the model was asked for 6 tokens)
            assert int(browser.js(f"{bubble}.dataset.chunks")) > 1
        # the API's answers to the same conversation
        url, history = "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode(), []
        for q, got in zip((NEEDLE_QUESTION, QUESTION_2), answers):
            r = server.client.chat.completions.create(
                model="ckpt", messages=messages(url, q, history)
            )
            assert got == r.choices[0].message.content
            history.append((q, got))
        # the strip shows the 6 frames the model was given; nothing came from another origin
        assert (
            browser.wait(
                "document.getElementById('thumbs').complete && "
                "document.getElementById('thumbs').naturalWidth"
            )
            == 6 * 48
        )
        assert "6 frames given to the model" in browser.js(
            "document.getElementById('stripinfo').textContent"
        )
        origins = browser.js(
            "performance.getEntriesByType('resource').map(e => new URL(e.name).origin)"
        )
        assert set(origins) <= {server.url}, origins
        ARTEFACTS.mkdir(parents=True, exist_ok=True)
        png = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
        (ARTEFACTS / "serve_page.png").write_bytes(png)
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        print(f"screenshot: {ARTEFACTS / 'serve_page.png'}")
    finally:
        browser.close()
        server.stop()


def test_page_asks_for_the_api_key_and_sends_it(material, tmp_path):
    """A server started with --api-key: the page shows its key field, and with the key typed in
    it asks, streams the answer and shows the thumbnails (fetched with the key too)."""
    exe = chromium()
    server = Server(material["ckpt"], material["root"] / "page-key", "--api-key", "k-123")
    browser = Browser(exe, tmp_path / "profile")
    try:
        browser.call("Page.enable")
        browser.call("Page.navigate", url=server.url + "/")
        browser.wait(
            "document.readyState === 'complete' && !document.getElementById('keybox').hidden"
        )
        root = browser.call("DOM.getDocument")["root"]["nodeId"]
        node = browser.call("DOM.querySelector", nodeId=root, selector="#file")["nodeId"]
        browser.call(
            "DOM.setFileInputFiles", nodeId=node, files=[str(material["media"] / "clip.mp4")]
        )
        browser.wait("!document.getElementById('send').disabled")

        def ask(i: int) -> str:
            browser.js(
                f"document.getElementById('q').value = {json.dumps(NEEDLE_QUESTION)};"
                "document.getElementById('ask').requestSubmit()"
            )
            bubble = f"document.querySelectorAll('.assistant')[{i}]"
            return browser.wait(
                f"{bubble} && {bubble}.dataset.state !== 'streaming' && {bubble}.dataset.state"
            )

        assert ask(0) == "error"  # no key yet: the server's 401, shown
        assert "API key" in browser.js("document.querySelectorAll('.assistant')[0].textContent")
        browser.js(
            "const k = document.getElementById('key'); k.value = 'k-123';"
            "k.dispatchEvent(new Event('change'))"
        )
        assert ask(1) == "done"
        thumbs = "document.getElementById('thumbs')"
        assert browser.wait(f"{thumbs}.complete && {thumbs}.naturalWidth") == 6 * 48
    finally:
        browser.close()
        server.stop()
