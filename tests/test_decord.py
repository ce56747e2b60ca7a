"""The decord backend's tests, in the decord extra's own environment (tests/sideenv.py).

decord is an optional extra: its wheel declares a tag `pip check` calls unsupported, so the main
environment does not hold it and conftest.py skips the tests that need it there. This test builds
`.venv-decord` over the running environment (decord added from the lock) and runs them in it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import sideenv
from conftest import HAVE_DECORD

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.mark.skipif(HAVE_DECORD, reason="decord is installed here: its tests run in this session")
def test_the_decord_backend_in_its_own_environment():
    py = sideenv.build("decord")
    files = sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").glob("test_*.py")
        if p.name != Path(__file__).name and "decord" in p.read_text()
    )
    done = subprocess.run(
        [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=900", "-m", "decord"]
        + files,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    tail = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    summary = done.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 10 and "skipped" not in summary, tail
