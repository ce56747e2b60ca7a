"""Rare codes pruned (longvideo.data.prune): the map against hand-made latents and counts, and the
whole command on real H.264 clips tokenized here: the shards it rewrites hold exactly what the
pruned tokenizer emits for the same clips, and nothing else changes."""

import io
import json
import shutil
import tarfile

import numpy as np
import pytest
import torch
from material.corpus import Encoding, corpus_frames, encode

from longvideo.cli import main as cli_main
from longvideo.data.cli import tokenize_main
from longvideo.data.codes import video_to_codes
from longvideo.data.prune import nearest_kept_map, prune_codes
from longvideo.data.shards import ShardWriter, SkipStats, iter_token_samples
from longvideo.vq import VQModel, load_vq

CLIP = Encoding("mp4", "mp4", "mp4", "libx264", frames=16, size=32)


def test_nearest_kept_map_by_hand():
    """Five codes on a line (latent = its position), three held often enough: each rare code goes
    to the nearest kept one (a tie to the lower), the kept ones stay."""
    latents = np.array([[0.0], [1.0], [2.0], [3.0], [4.0]])
    counts = np.array([9, 1, 0, 7, 5])
    assert nearest_kept_map(latents, counts, 5).tolist() == [0, 0, 3, 3, 4]
    assert nearest_kept_map(latents, counts, 6).tolist() == [0, 0, 3, 3, 3]
    assert nearest_kept_map(latents, counts, 1).tolist() == [0, 1, 1, 3, 4]  # 2 ties 1 and 3
    with pytest.raises(ValueError, match="no code is held 10 times"):
        nearest_kept_map(latents, counts, 10)


@pytest.fixture()
def tokenized(tmp_path, vq_dir):
    """A copy of the tiny 2d tokenizer (conftest.vq_dir: pruning writes into it) and two raw
    shards of real H.264 clips, tokenized."""
    vq = tmp_path / "vq"
    shutil.copytree(vq_dir, vq)
    clips = {f"c{i}": encode(CLIP, corpus_frames(CLIP.frames, CLIP.size, i)) for i in range(4)}
    raw = tmp_path / "raw"
    for s, keys in enumerate((["c0", "c1"], ["c2", "c3"])):
        with ShardWriter(raw / f"raw-{s}.tar") as w:
            for k in keys:
                w.write(k, {"mp4": clips[k], "json": b'{"caption": "x"}'})
    tok = tmp_path / "tok"
    argv = ["--vq", str(vq), "--in", str(raw), "--out", str(tok), "--fps", "4", "--quiet"]
    assert tokenize_main(argv) == 0
    return vq, tok, clips


def _samples(tok):
    return {
        t.key: t for p in sorted(tok.glob("*.tar")) for t in iter_token_samples(str(p), SkipStats())
    }


def test_prune_codes_rewrites_shards_to_what_the_pruned_tokenizer_emits(tokenized, capsys):
    vq_dir, tok, clips = tokenized
    K = load_vq(vq_dir).cfg.codebook_size
    before = _samples(tok)
    held = np.bincount(
        np.concatenate([t.codes.reshape(-1).astype(np.int64) for t in before.values()]),
        minlength=K,
    )
    # poison in a shard: a link named like a code array (never followed) and an object array
    # (never unpickled; copied as it is)
    shard = sorted(tok.glob("*.tar"))[0]
    obj = io.BytesIO()
    np.save(obj, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with tarfile.open(shard, "a") as tf:
        link = tarfile.TarInfo("evil.codes.npy")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(link)
        info = tarfile.TarInfo("obj.codes.npy")
        info.size = len(obj.getvalue())
        tf.addfile(info, io.BytesIO(obj.getvalue()))
    min_count = int(np.sort(held[held > 0])[len(held[held > 0]) // 2])  # about half are kept
    argv = ["prune-codes", "--vq", str(vq_dir), "--tokens", str(tok), "--min-count", str(min_count)]
    assert cli_main([*argv, "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    body = json.loads((vq_dir / "codes.json").read_text())
    code_map = np.array(body["map"])
    kept = held >= min_count
    assert body["counts"] == held.tolist() and summary["codes_kept"] == int(kept.sum())
    assert summary["bad_members"] == 2
    with tarfile.open(shard) as tf:
        names = tf.getnames()
        assert "evil.codes.npy" not in names
        assert tf.extractfile("obj.codes.npy").read() == obj.getvalue()
    assert summary["codes_pruned"] == int(((held > 0) & ~kept).sum()) > 0
    assert summary["share_pruned"] == pytest.approx(held[(held > 0) & ~kept].sum() / held.sum())
    assert (code_map[kept] == np.nonzero(kept)[0]).all() and kept[code_map].all()
    after = _samples(tok)
    assert set(after) == set(before)
    changed = 0
    pruned_vq = load_vq(vq_dir)
    for key, t in after.items():
        old = before[key]
        assert t.meta == old.meta and np.array_equal(t.timestamps, old.timestamps)
        assert t.codes.dtype == old.codes.dtype
        np.testing.assert_array_equal(t.codes, code_map[old.codes.astype(np.int64)])
        changed += int((t.codes != old.codes).sum())
        # the pruned tokenizer, given the clip, emits exactly what the rewritten shard holds
        again = video_to_codes(pruned_vq, clips[key], fps=4.0).codes
        np.testing.assert_array_equal(again, t.codes)
    assert changed == summary["codes_rewritten"] > 0
    # pruning again is refused: the shards no longer hold the codes it would count
    with pytest.raises(ValueError, match="pruned already"):
        prune_codes(vq_dir, str(tok), min_count)
    # saving the tokenizer keeps its map; the unpruned tokenizer emits every code as itself
    pruned_vq.save(vq_dir.parent / "copy")
    assert torch.equal(load_vq(vq_dir.parent / "copy").code_map, torch.tensor(code_map))


def test_code_map_file_is_checked(tokenized):
    vq_dir, _, _ = tokenized
    assert load_vq(vq_dir).code_map is None
    K = load_vq(vq_dir).cfg.codebook_size
    bad = {
        "short": {"map": [0, 1]},
        "range": {"map": [K] * K},
        "not kept": {"map": [1, 2] + list(range(2, K))},  # 0 -> 1, but 1 -> 2
        "no map": {"counts": []},
    }
    for body in bad.values():
        (vq_dir / "codes.json").write_text(json.dumps(body))
        with pytest.raises(ValueError, match="codes.json"):
            load_vq(vq_dir)
    (vq_dir / "codes.json").write_text(json.dumps({"map": list(range(K))}))
    vq = load_vq(vq_dir)
    assert vq.code_map is not None
    # a tokenizer saved without a map (new weights) leaves no stale map behind
    fresh = VQModel(vq.cfg)
    fresh.save(vq_dir)
    assert not (vq_dir / "codes.json").exists() and load_vq(vq_dir).code_map is None
