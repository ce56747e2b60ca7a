"""The attention metadata object reaches every backend unchanged (docs/architecture.md, "The
attention metadata"): recording backends registered in place of `torch`, `cpu`, `triton` and
`auto` capture what they are called with, through single-device attention, a ring of 2 and the
Ulysses hybrid; the Triton launcher captures what the kernels launch with.

What "unchanged" means: single-device calls get the very object the model built; a ring step gets
that object's view (`visiting`): the same query side, causal and scale, the visiting keys, and a
plan store nested in the object's own; the hybrid's ring gets the views of the group's metadata,
which the object keeps in its store.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from attn_cases import packed_meta
from distributed import run_ranks

from longvideo.kernels import AttentionMeta, Side, block_attention, get_backend, register_backend
from longvideo.kernels import _flash_attn_triton as tk
from longvideo.model import ModelConfig, Transformer
from longvideo.parallel import RingAttentionSeam, shard_batch, split_group
from longvideo.parallel.ulysses import group_meta

NAMES = ("torch", "cpu", "triton", "auto")


class Recording:
    """A block backend that records each call's metadata object and hands the call to `inner`."""

    def __init__(self, inner):
        self.inner, self.name, self.sync_free = inner, inner.name, inner.sync_free
        self.calls: list[tuple[str, AttentionMeta]] = []

    def forward(self, q, k, v, meta):
        self.calls.append(("forward", meta))
        return self.inner.forward(q, k, v, meta)

    def backward(self, dout, q, k, v, out, lse, meta):
        self.calls.append(("backward", meta))
        return self.inner.backward(dout, q, k, v, out, lse, meta)


@pytest.fixture
def recorders():
    recs = {name: Recording(get_backend(name)) for name in NAMES}
    replaced = {name: register_backend(name, rec) for name, rec in recs.items()}
    yield recs
    for name, old in replaced.items():
        register_backend(name, old)


class RecordingSeam:
    """A model seam that records the metadata object the model hands it."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __call__(self, q, k, v, meta):
        self.seen.append(meta)
        return self.inner(q, k, v, meta)


def _model(backend: str, layers: int = 2) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        text_vocab_size=40,
        codebook_size=20,
        dim=32,
        n_layers=layers,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=128,
    )
    return Transformer(cfg, backend=backend)


def _batch(S: int = 40):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 60, (1, S), generator=g)
    pos, seg = packed_meta(1, S, g, min_len=2, max_len=6, restart=True, pad=2)  # > 4 pieces
    return {"input_ids": ids, "positions": pos, "segment_ids": seg}


def _step(model, batch) -> None:
    model(batch["input_ids"], batch["positions"], batch["segment_ids"], targets=batch["input_ids"])
    model(
        batch["input_ids"], batch["positions"], batch["segment_ids"], targets=batch["input_ids"]
    ).backward()


def test_one_object_from_the_model_to_every_single_device_backend(recorders):
    """The model builds one object per forward; every layer's seam, the dispatch (`auto`) and the
    route it chose (`cpu` for packed documents on CPU) get that very object, both directions."""
    model = _model("auto", layers=3)
    seam = RecordingSeam(model.attention_fn)
    model.set_attention(seam)
    _step(model, _batch())
    first, second = seam.seen[:3], seam.seen[3:]
    assert len(seam.seen) == 6 and all(m is first[0] for m in first)
    assert all(m is second[0] for m in second) and second[0] is not first[0]  # one per forward
    for name in ("auto", "cpu"):
        calls = recorders[name].calls
        assert {kind for kind, _ in calls} == {"forward", "backward"}, name
        assert all(meta is first[0] or meta is second[0] for _, meta in calls), name
    assert second[0].plans.builds >= 1  # the dispatch's choice and the cpu tile plan, kept there
    # torch and triton, called by name, get the caller's object too, non-default causal and scale
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 24, 2, 16, generator=g) for _ in range(3))
    meta = AttentionMeta.default(q, k, causal=False, scale=0.3)
    for name in ("torch", "triton"):
        block_attention(q.requires_grad_(True), k, v, meta, backend=name).sum().backward()
        assert [m for _, m in recorders[name].calls] == [meta, meta], name


def test_the_triton_launch_gets_the_metadata(monkeypatch):
    """Down to the launch: the custom op rebuilds the object from `AttentionMeta.tensors()`, the
    very tensors, with the caller's causal and scale, and the launcher reads them from it."""
    seen = []
    launch = tk.flash_attn_forward

    def recording_launch(q, k, v, meta):
        seen.append(meta)
        return launch(q, k, v, meta)

    monkeypatch.setattr(tk, "flash_attn_forward", recording_launch)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 24, 2, 16, generator=g) for _ in range(3))
    pos, seg = packed_meta(1, 24, g, min_len=3, max_len=10)
    meta = AttentionMeta.self_attention(pos, seg, causal=False, scale=0.3)
    block_attention(q, k, v, meta, backend="triton")
    (launched,) = seen
    assert all(a is b for a, b in zip(launched.tensors(), meta.tensors()))
    assert (launched.causal, launched.scale) == (False, 0.3)


def _check_ring_views(calls, root: AttentionMeta, steps: int) -> None:
    """Every call got a step view of `root`: its query side, causal and scale, and the plan store
    of one step, nested in root's store."""
    stores = [root.plans.nested(("ring step", i)) for i in range(steps)]
    assert calls
    for _, meta in calls:
        assert meta.queries is root.queries and (meta.causal, meta.scale) == (
            root.causal,
            root.scale,
        )
        assert any(meta.plans is store for store in stores)


def _ring_and_hybrid_body(rank, world):
    group = dist.group.WORLD
    recs = {name: Recording(get_backend(name)) for name in NAMES}
    for name, rec in recs.items():
        register_backend(name, rec)
    local = shard_batch(_batch(), group)
    # the ring of 2 through the model: the seam gets the model's object, every step a view of it
    model = _model("auto")
    seam = RecordingSeam(RingAttentionSeam(group, "auto"))
    model.set_attention(seam)
    _step(model, local)
    roots = {id(m): m for m in seam.seen}
    assert len(roots) == 2  # one object per forward, every layer
    calls = recs["auto"].calls
    for root in roots.values():
        _check_ring_views([c for c in calls if c[1].queries is root.queries], root, world)
    assert all(any(m.queries is r.queries for r in roots.values()) for _, m in calls)
    first = next(iter(roots.values()))
    visiting = [m for _, m in calls if m.plans is first.plans.nested(("ring step", 1))]
    shards = [torch.empty_like(local["positions"]) for _ in range(world)]
    dist.all_gather(shards, local["positions"].contiguous())
    assert visiting  # step 1 brings the other rank's keys, with the positions it sent
    assert all(torch.equal(m.keys.positions, shards[1 - rank]) for m in visiting)

    # the hybrid (U = 2, a ring of one group): the seam's object keeps the group's metadata, whose
    # views reach the backend; non-default causal and scale travel with it
    heads = split_group(group, 2)
    for rec in recs.values():
        rec.calls.clear()
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, local["positions"].shape[1], 4, 16, generator=g) for _ in range(3))
    shard = AttentionMeta.self_attention(
        local["positions"], local["segment_ids"], causal=False, scale=0.3
    )
    out = RingAttentionSeam(group, "torch", heads)(q.requires_grad_(True), k, v, shard)
    out.sum().backward()
    gathered = group_meta(shard, heads)  # kept in shard's store: no second gather
    assert gathered is group_meta(shard, heads)
    assert (gathered.causal, gathered.scale) == (False, 0.3)
    assert gathered.queries.length == 2 * shard.queries.length
    exact = recs["torch"].calls
    assert [kind for kind, _ in exact] == ["forward", "backward"]
    assert all(m is gathered for _, m in exact)  # a ring of one: the group's object itself


@pytest.mark.distributed
def test_the_object_reaches_the_backends_through_the_ring_and_the_hybrid():
    run_ranks(_ring_and_hybrid_body, world=2, timeout=240)


def test_views_share_what_they_should():
    """visiting: the same queries, causal and scale, another key side, one plan store per step kept
    by the owner; with_scale: the same plans; with_keys: a store of its own."""
    pos = torch.arange(8)[None]
    seg = torch.zeros(1, 8, dtype=torch.long)
    meta = AttentionMeta.self_attention(pos, seg, causal=False, scale=0.5)
    keys = Side(pos + 8, seg)
    step = meta.visiting(keys, 1)
    assert step.queries is meta.queries and step.keys is keys
    assert (step.causal, step.scale) == (False, 0.5)
    assert meta.visiting(Side(pos, seg), 1).plans is step.plans  # the next layer finds the plans
    assert meta.visiting(keys, 0).plans is not step.plans
    assert meta.with_scale(0.25).plans is meta.plans and meta.with_scale(0.5) is meta
    assert meta.with_keys(keys).plans is not meta.plans
    assert AttentionMeta.find(meta.handle) is meta
    assert meta.scale_for(64) == 0.5
    assert AttentionMeta.default(pos[..., None], pos[..., None]).scale_for(64) == 0.125
