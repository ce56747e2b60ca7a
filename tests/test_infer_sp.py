"""Sequence-parallel serving: exact partial merge, and W = 2 answers equal to W = 1."""

import math

import pytest
import torch

from distributed import run_ranks
from kernels import flash_attn_ref, get_backend
from longvideo.infer.sp import merge_partials


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("sq", [1, 5])
def test_merge_partials_equals_attention_over_all_keys(sq):
    torch.manual_seed(0)
    B, Sk, Hq, Hkv, D = 2, 40, 4, 2, 8
    q = torch.randn(B, sq, Hq, D, dtype=torch.float64)
    k = torch.randn(B, Sk, Hkv, D, dtype=torch.float64)
    v = torch.randn(B, Sk, Hkv, D, dtype=torch.float64)
    q_pos = torch.arange(Sk - sq, Sk)[None].expand(B, sq)
    k_pos = torch.arange(Sk)[None].expand(B, Sk)
    q_seg = torch.zeros(B, sq, dtype=torch.long)
    k_seg = torch.zeros(B, Sk, dtype=torch.long)
    k_seg[:, 3:6] = -1  # padding inside a shard
    want, _ = flash_attn_ref(q, k, v, q_pos, k_pos, q_seg, k_seg, causal=True)
    be = get_backend("torch")
    # three uneven key sets, one of them entirely invisible (only padding)
    cuts = [(0, 3), (3, 6), (6, 17), (17, Sk)]
    outs, lses = [], []
    for a, b in cuts:
        o, l = be.forward(q, k[:, a:b], v[:, a:b], q_pos, k_pos[:, a:b], q_seg, k_seg[:, a:b],
                          1 / math.sqrt(D), True)
        outs.append(o)
        lses.append(l)
    assert bool(torch.isinf(lses[1]).all())
    got = merge_partials(outs, lses)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # no visible key anywhere: zeros, not nan
    empty = merge_partials([outs[1]], [lses[1]])
    assert torch.equal(empty, torch.zeros_like(empty))
