"""Masked packing: row invariants, and a packed batch computes what the unpacked documents compute."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from longvideo.data.packing import Packer, pack_row
from longvideo.model import ModelConfig, Transformer, token_weights


def _doc(ids, weights):
    return SimpleNamespace(ids=np.asarray(ids, np.int64), weights=np.asarray(weights, np.float32))


def _random_docs(rng, lengths, vocab=50):
    return [_doc(rng.integers(1, vocab, n), rng.choice([0.0, 0.5, 1.0], n)) for n in lengths]


def test_row_invariants():
    rng = np.random.default_rng(0)
    docs = _random_docs(rng, [5, 3, 7])
    row = pack_row(docs, 20, pad_id=0)
    assert all(v.shape == (20,) for v in row.values())
    np.testing.assert_array_equal(row["segment_ids"], [0] * 5 + [1] * 3 + [2] * 7 + [-1] * 5)
    np.testing.assert_array_equal(
        row["positions"], [*range(5), *range(3), *range(7), 0, 0, 0, 0, 0]
    )
    at = 0
    for d in docs:
        n = len(d.ids)
        np.testing.assert_array_equal(row["input_ids"][at : at + n], d.ids)
        np.testing.assert_array_equal(
            row["targets"][at : at + n - 1], d.ids[1:]
        )  # shifted within the doc
        np.testing.assert_array_equal(row["loss_weights"][at : at + n - 1], d.weights[1:])
        assert row["loss_weights"][at + n - 1] == 0  # never predict across a document boundary
        at += n
    assert np.all(row["loss_weights"][at:] == 0) and np.all(row["input_ids"][at:] == 0)
    with pytest.raises(ValueError):
        pack_row(docs, 14, pad_id=0)


def test_sample_norm_gives_each_document_weight_one():
    rng = np.random.default_rng(1)
    docs = _random_docs(rng, [6, 9, 4])
    row = pack_row(docs, 24, pad_id=0, loss_norm="sample")
    for s in range(3):
        assert row["loss_weights"][row["segment_ids"] == s].sum() == pytest.approx(1.0)


def test_packer_first_fit_and_state():
    p = Packer(seq_len=10, bins=2)
    assert p.add("a", 6) == [] and p.add("b", 5) == []  # b does not fit with a: second bin
    assert p.add("c", 3) == []  # fits in a's bin
    state = p.state_dict()
    closed = p.add("d", 6)  # fits nowhere, two bins open: the oldest (a, c) closes
    assert closed == [["a", "c"]]
    q = Packer(seq_len=10, bins=2)
    q.load_state_dict(state)
    assert q.add("d", 6) == closed and q.state_dict() == p.state_dict()
    with pytest.raises(ValueError):
        p.add("e", 11)
    r = Packer(seq_len=10, bins=2)
    assert r.add("x", 4) == [] and r.add("y", 6) == [["x", "y"]]  # exactly full: closes at once
    assert r.add("z", 10) == [["z"]] and r.open == []


def _tiny_model():
    torch.manual_seed(0)
    cfg = ModelConfig(
        text_vocab_size=40,
        codebook_size=6,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        multiple_of=16,
    )
    return Transformer(cfg, loss_chunk=0, backend="torch").double().eval()


def test_packed_equals_unpacked_through_the_model():
    """No attention across documents, positions restart, and the loss (sum and weight) is unchanged."""
    rng = np.random.default_rng(2)
    model = _tiny_model()
    docs = _random_docs(rng, [7, 12, 5, 9], vocab=50)
    rows = [pack_row(docs[:2], 24, 0), pack_row(docs[2:], 24, 0)]
    batch = {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in rows[0]}
    with torch.no_grad():
        hidden = model(
            batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"]
        )
        loss_sum = model.head(hidden, batch["targets"], batch["loss_weights"].double())
        weight_sum = token_weights(batch["targets"], batch["loss_weights"]).sum()
        ref_sum, ref_weight = 0.0, 0.0
        for b, pair in enumerate([docs[:2], docs[2:]]):
            at = 0
            for d in pair:
                n = len(d.ids)
                alone = pack_row([d], n, 0)  # the document alone, no padding
                ids = torch.from_numpy(alone["input_ids"])[None]
                h = model(ids)  # default positions 0..n-1, one segment
                torch.testing.assert_close(hidden[b, at : at + n], h[0], rtol=1e-10, atol=1e-10)
                t, lw = (
                    torch.from_numpy(alone["targets"])[None],
                    torch.from_numpy(alone["loss_weights"])[None],
                )
                s, w = model.head(h, t, lw.double()), token_weights(t, lw).sum()
                ref_sum, ref_weight = ref_sum + s, ref_weight + w
                at += n
    torch.testing.assert_close(loss_sum, ref_sum, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(weight_sum, ref_weight, rtol=0, atol=0)


def test_gradients_of_packed_batch_equal_unpacked():
    rng = np.random.default_rng(3)
    docs = _random_docs(rng, [6, 10, 8], vocab=50)

    def grads(rows):
        model = _tiny_model()
        total_s, total_w = 0.0, 0.0
        for r in rows:
            b = {k: torch.from_numpy(v)[None] for k, v in r.items()}
            s = model(
                b["input_ids"],
                positions=b["positions"],
                segment_ids=b["segment_ids"],
                targets=b["targets"],
                loss_weights=b["loss_weights"].double(),
            )
            total_s, total_w = (
                total_s + s,
                total_w + token_weights(b["targets"], b["loss_weights"]).sum(),
            )
        (total_s / total_w).backward()  # global normalisation by the batch's weight total
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    packed = grads([pack_row(docs, 30, 0)])
    unpacked = grads([pack_row([d], len(d.ids), 0) for d in docs])
    for name in packed:
        torch.testing.assert_close(packed[name], unpacked[name], rtol=1e-9, atol=1e-12, msg=name)
