"""Peak resident-memory growth of a call, sampled by a thread (for memory tests in child processes).

sys.path.insert(0, TESTS_DIR); from memwatch import growth
mib, result = growth(lambda: encode(...))
"""

import threading
import time

import psutil


def growth(fn):
    """(peak RSS during fn minus RSS before it in MiB, fn's result)."""
    proc = psutil.Process()
    base, peak, done = proc.memory_info().rss, [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    t = threading.Thread(target=watch)
    t.start()
    try:
        out = fn()
    finally:
        done.set()
        t.join()
    return (max(peak[0], proc.memory_info().rss) - base) / 2**20, out
