"""The token-shard loader: dp split, determinism, exact resume, corrupt samples, batch contract."""

import json

import numpy as np
import pytest
import torch

from longvideo.data.config import DataConfig
from longvideo.data.loader import TokenLoader
from longvideo.data.shards import (
    ShardWriter,
    SkipStats,
    iter_token_samples,
    npy_bytes,
    token_sample_members,
)
from longvideo.data.synthetic import SyntheticSpec, make_sample, text_corpus
from longvideo.tokenizer import train_text_tokenizer

K = 16
SPEC = SyntheticSpec(min_seconds=2, max_seconds=6, long_fraction=0.15, long_seconds=20)


@pytest.fixture(scope="module")
def tok():
    return train_text_tokenizer(text_corpus(60, spec=SPEC), vocab_size=300)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """5 token shards of 7 samples (random 2x2 codes, one group per second, synthetic json)."""
    root = tmp_path_factory.mktemp("tok")
    keys = []
    for s in range(5):
        with ShardWriter(root / f"part-{s:03d}.tar") as w:
            for i in range(s * 7, s * 7 + 7):
                sample = make_sample(3, i, SPEC)
                codes = np.random.default_rng(i).integers(0, K, (sample.duration, 2, 2))
                w.write(
                    sample.key,
                    token_sample_members(
                        sample.key, codes, np.arange(float(sample.duration)), sample.meta
                    ),
                )
                keys.append(sample.key)
    return root, keys


def _loader(shards, tok, **kw):
    root, _ = shards
    cfg_kw = {k: kw.pop(k) for k in list(kw) if k in DataConfig.__dataclass_fields__}
    cfg = DataConfig(**{"seq_len": 96, "shuffle_buffer": 5, **cfg_kw})
    return TokenLoader(str(root), tok, tok.vocab(K), cfg, **{"batch_size": 2, **kw})


def test_batch_contract(shards, tok):
    loader = _loader(shards, tok, template_mode="all")
    b = next(loader)
    assert set(b) == {"input_ids", "targets", "loss_weights", "positions", "segment_ids"}
    for k, v in b.items():
        assert v.shape == (2, 96)
        assert v.dtype == (torch.float32 if k == "loss_weights" else torch.long)
    for row in range(2):
        seg = b["segment_ids"][row]
        for s in seg.unique().tolist():
            m = seg == s
            if s < 0:
                assert torch.all(b["loss_weights"][row][m] == 0)
                continue
            idx = m.nonzero().flatten()
            assert torch.equal(
                b["positions"][row][idx], torch.arange(len(idx))
            )  # positions restart
            assert torch.equal(
                b["targets"][row][idx[:-1]], b["input_ids"][row][idx[1:]]
            )  # shifted in-doc
            assert b["loss_weights"][row][idx[-1]] == 0


def epoch_refs(loader, epoch):
    """(shard, sample) references the loader's dp rank gets in ``epoch``, in stream order (before shuffling)."""
    order = np.random.default_rng([loader.seed, epoch]).permutation(len(loader.paths)).tolist()
    return [(s, i) for s in order for i in range(loader._len(s))][loader.dp_rank :: loader.dp_size]


def _epoch_keys(loader, epoch):
    return [loader.key_of(r) for r in epoch_refs(loader, epoch)]


def test_dp_split_disjoint_and_complete(shards, tok):
    _, keys = shards
    world = 3
    loaders = [_loader(shards, tok, dp_rank=r, dp_size=world, batch_size=1) for r in range(world)]
    for epoch in (0, 1):
        per_rank = [_epoch_keys(ld, epoch) for ld in loaders]
        flat = [k for ks in per_rank for k in ks]
        assert sorted(flat) == sorted(keys)  # complete, and no sample twice
        assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 1  # balanced
    # the batches themselves: over epoch 0 each rank sees exactly its own samples
    for r, ld in enumerate(loaders):
        seen = set()
        for _ in range(200):
            next(ld)
            seen |= {ld.key_of(ref) for row in ld.last_batch_refs for ref in row if ref[2] == 0}
            if ld.epoch >= 2:
                break
        assert seen == set(_epoch_keys(loaders[r], 0))


def test_deterministic_by_seed(shards, tok):
    a, b, c = (_loader(shards, tok, seed=s) for s in (1, 1, 2))
    for _ in range(6):
        x, y, _ = next(a), next(b), next(c)
        for k in x:
            assert torch.equal(x[k], y[k])
    order = lambda ld: [ld.key_of(r) for r in epoch_refs(ld, 0)]  # noqa: E731
    assert order(a) == order(b) and order(a) != order(c)


@pytest.mark.parametrize("skip", [3, 17])  # mid-epoch, and after the first epoch boundary
def test_resume_continues_exactly(shards, tok, skip):
    kw = dict(
        seed=5,
        template_mode="random",
        question_position="random",
        pack_bins=3,
        dp_rank=1,
        dp_size=2,
    )
    ref = _loader(shards, tok, **kw)
    for _ in range(skip):
        next(ref)
    state = json.loads(json.dumps(ref.state_dict()))  # what a checkpoint stores must survive JSON
    want = [next(ref) for _ in range(6)]
    want_keys = ref.last_batch_keys
    resumed = _loader(shards, tok, **kw)
    resumed.load_state_dict(state)
    got = [next(resumed) for _ in range(6)]
    for w, g in zip(want, got):
        for k in w:
            assert torch.equal(w[k], g[k]), k
    assert resumed.last_batch_keys == want_keys
    assert resumed.stats == ref.stats
    with pytest.raises(ValueError, match="dp_size"):
        _loader(shards, tok, **{**kw, "dp_size": 3}).load_state_dict(state)


def test_long_samples_cut_and_counted(shards, tok):
    loader = _loader(shards, tok, seq_len=64, batch_size=4)
    for _ in range(10):
        b = next(loader)
        assert (b["segment_ids"] >= 0).sum() > 0
    assert loader.stats["docs_cut"] > 0 and loader.stats["groups_dropped"] > 0


def test_each_shard_index_read_once_per_epoch(tmp_path, tok, monkeypatch):
    """A shuffle buffer that spans more shards than a handful does not make the loader re-read tar
    headers: over one epoch of 30 small shards each shard's index is read once."""
    import longvideo.data.loader as loader_mod

    for s in range(30):
        with ShardWriter(tmp_path / f"part-{s:03d}.tar") as w:
            for i in range(s * 3, s * 3 + 3):
                sample = make_sample(5, i, SPEC)
                w.write(
                    sample.key,
                    token_sample_members(
                        sample.key,
                        np.zeros((sample.duration, 2, 2), np.int64),
                        np.arange(float(sample.duration)),
                        sample.meta,
                    ),
                )
    reads = []
    real = loader_mod.TokenShard
    monkeypatch.setattr(
        loader_mod, "TokenShard", lambda path, stats=None: reads.append(path) or real(path, stats)
    )
    loader = TokenLoader(
        str(tmp_path), tok, tok.vocab(K), DataConfig(seq_len=96, shuffle_buffer=40), batch_size=1
    )
    while loader.epoch == 0:
        next(loader)
    assert len(reads) == len(set(reads)) == 30


def test_corrupt_token_samples_skipped_and_counted(tmp_path, tok):
    good = 0
    with ShardWriter(tmp_path / "bad.tar") as w:
        for i in range(8):
            s = make_sample(0, i, SPEC)
            members = token_sample_members(
                s.key, np.zeros((s.duration, 2, 2), int), np.arange(float(s.duration)), s.meta
            )
            if i == 2:
                members["codes.npy"] = _pickled_npy()
            elif i == 4:
                del members["json"]
            elif i == 6:
                members["codes.npy"] = npy_bytes(
                    np.full((s.duration, 2, 2), K + 5)
                )  # outside the codebook
            else:
                good += 1
            w.write(s.key, members)
    # one pass over the shard: exact counts by reason
    stats = SkipStats()
    kept = [t.key for t in iter_token_samples(str(tmp_path / "bad.tar"), stats, codebook_size=K)]
    assert len(kept) == good and stats == {"bad_array": 2, "missing_json": 1}
    # the loader: every good sample reaches a batch in epoch 0, nothing else does
    cfg = DataConfig(seq_len=200, shuffle_buffer=4)
    loader = TokenLoader(str(tmp_path), tok, tok.vocab(K), cfg, batch_size=1)
    seen = set()
    while loader.epoch < 2:  # rows may close a little after their epoch ends
        next(loader)
        seen |= {loader.key_of(r) for row in loader.last_batch_refs for r in row if r[2] == 0}
    assert seen == set(kept)
    assert loader.stats["bad_array"] >= 2 and loader.stats["missing_json"] >= 1


def _pickled_npy():
    """An object-dtype .npy (its payload is a pickle): loading must refuse it, never unpickle."""
    import io

    buf = io.BytesIO()
    np.save(buf, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    return buf.getvalue()


class _ByteTokenizer:
    """Bytes as text ids (enough for the layout; keeps the spawned ranks free of transformers)."""

    text_size, bos_id, eos_id, pad_id = 259, 256, 257, 258

    def encode(self, text):
        return list(text.encode())

    def vocab(self, codebook_size):
        from longvideo.vocab import Vocab

        return Vocab(self.text_size, codebook_size)


def _sp_rank_body(rank, world, root):
    from longvideo.parallel import shard_batch

    tok = _ByteTokenizer()
    cfg = DataConfig(seq_len=96, shuffle_buffer=5, template_mode="all")
    loader = TokenLoader(
        root, tok, tok.vocab(K), cfg, batch_size=2
    )  # every sp rank reads the same batch
    for _ in range(3):
        full = next(loader)
        local = shard_batch(full, None)
        chunk = 96 // (2 * world)
        idx = torch.cat(
            [
                torch.arange(rank * chunk, (rank + 1) * chunk),
                torch.arange((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk),
            ]
        )
        for k, v in full.items():
            assert torch.equal(local[k], v[:, idx]), (
                k
            )  # the ring's zigzag layout; positions/segments travel along


@pytest.mark.slow
@pytest.mark.distributed
def test_batches_shard_over_sp_ranks_with_the_ring_layout(shards):
    from distributed import run_ranks

    run_ranks(_sp_rank_body, world=2, args=(str(shards[0]),), timeout=240)
