"""Test-session settings shared by every test module.

* Triton kernels run through the interpreter when there is no GPU (set before triton is imported).
* DeepSpeed uses its CPU accelerator.
* Threads are capped so several spawned ranks share the 2-core CI machine well.
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:  # decide on the interpreter before any module imports triton
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
