"""Rare codes pruned: a tokenizer that emits only the codes its language model's data holds often.

A code the training data holds a handful of times leaves the language model's embedding of it
almost untrained, and such an embedding can pull attention where nothing is: on the hour model,
one code held 4 times in 544K training codes took half the attention of the head that finds the
flash (docs/hour.md, "Rare codes"). `prune_codes` counts the codes of token shards, keeps those
held at least `min_count` times, and maps every other code to the kept code nearest to it in the
quantiser's latent space (an FSQ grid point, or a codebook vector). The map is written beside the
tokenizer (`codes.json`, see longvideo.vq.files), so every later encode (tokenize, eval, chat,
serve, the exported processor) emits only kept codes, and the counted shards are rewritten with
it, member by member, so that they hold what the pruned tokenizer emits.

    longvideo prune-codes --vq runs/vq --tokens 'runs/tokens/{brief,short,mid,long}' --min-count 20
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from longvideo.data.shards import (
    ShardError,
    ShardWriter,
    index_tar,
    load_npy,
    npy_bytes,
    read_member,
)
from longvideo.data.streams import SkipStats, default_limits, expand_shards
from longvideo.vq import load_vq
from longvideo.vq.files import CODES_FILE, write_code_map

CODES_EXT = "codes.npy"


def _members(path: str, stats: SkipStats):
    """(Member, its bytes or the ShardError that kept them unread) of the usable members of a tar
    shard, in order: through the shard reader's own guards (index_tar: links, devices and
    escaping names are counted in `stats` and never read; read_member: each within the bound of
    its extension)."""
    members = index_tar(path, stats)
    with open(path, "rb") as f:
        for m in members:
            try:
                yield m, read_member(f, m, default_limits([m.ext])[m.ext])
            except ShardError as e:
                yield m, e


def _codes(m, data) -> np.ndarray | None:
    """A codes member's array, None when it is not a plain array (or was not read)."""
    if isinstance(data, ShardError):
        return None
    try:
        return load_npy(data, f"{m.key}.{m.ext}")
    except ShardError:
        return None


def count_codes(paths: list[str], codebook_size: int, progress: bool = False) -> dict:
    """Per code, how many times the token shards `paths` hold it (`counts`), with the samples and
    codes counted and the members passed over (`bad`: code members that are not a plain array,
    members too large to read, and unusable members such as links)."""
    counts = np.zeros(codebook_size, np.int64)
    samples = bad = 0
    stats = SkipStats()
    for path in tqdm(paths, desc="counting codes", unit="shard", disable=not progress):
        for m, data in _members(path, stats):
            if m.ext != CODES_EXT:
                continue
            codes = _codes(m, data)
            if codes is None:
                bad += 1
                continue
            codes = codes.astype(np.int64).reshape(-1)
            if codes.size and (codes.min() < 0 or codes.max() >= codebook_size):
                raise ValueError(
                    f"{path}:{m.key}.{m.ext} holds codes outside [0, {codebook_size}): "
                    "shards of another tokenizer?"
                )
            counts += np.bincount(codes, minlength=codebook_size)
            samples += 1
    bad += sum(stats.values())
    return {"counts": counts, "samples": samples, "codes": int(counts.sum()), "bad": bad}


def nearest_kept_map(latents: np.ndarray, counts: np.ndarray, min_count: int) -> np.ndarray:
    """Code c -> c when counts[c] >= min_count, else the kept code whose latent (rows of
    `latents`, (K, D)) is nearest to c's (L2; ties to the lower code). ValueError when no code is
    kept."""
    counts = np.asarray(counts)
    kept = np.nonzero(counts >= min_count)[0]
    if not len(kept):
        raise ValueError(
            f"no code is held {min_count} times or more (most: {int(counts.max())}); "
            "lower --min-count or count more shards"
        )
    latents = np.asarray(latents, np.float64)
    d2 = ((latents[:, None, :] - latents[None, kept, :]) ** 2).sum(-1)
    out = kept[d2.argmin(1)]
    out[kept] = kept
    return out.astype(np.int64)


def code_latents(vq) -> np.ndarray:
    """(K, D) the quantiser's latent of every code."""
    with torch.no_grad():
        codes = torch.arange(vq.cfg.codebook_size).view(1, -1, 1, 1)  # (B, G, h, w)
        return vq.codes_to_latents(codes)[0, :, :, 0, 0].T.double().cpu().numpy()


def rewrite_shard(path: str, code_map: np.ndarray) -> int:
    """Rewrite a token shard atomically (ShardWriter) with `code_map` applied to its code arrays
    (each in its own dtype); every other usable member is copied as it is, a code member that is
    not a plain array too. Members the shard reader passes over (links, escaping names, members
    over their bound) are left out: no reader of token shards would read them. Returns the codes
    changed."""
    changed = 0
    with ShardWriter(path) as out:
        for m, data in _members(path, SkipStats()):
            if isinstance(data, ShardError):
                continue
            codes = _codes(m, data) if m.ext == CODES_EXT else None
            if codes is not None:
                mapped = code_map[codes.astype(np.int64)].astype(codes.dtype)
                changed += int((mapped != codes).sum())
                data = npy_bytes(mapped)
            out.write(m.key, {m.ext: data})
    return changed


def prune_codes(
    vq_dir: str | os.PathLike,
    tokens,
    min_count: int,
    *,
    rewrite: bool = True,
    progress: bool = False,
) -> dict:
    """Count the codes of the token shards `tokens` (a directory, glob, brace pattern or list:
    longvideo.data.streams.expand_shards), write `vq_dir/codes.json` mapping every code held fewer
    than `min_count` times to its nearest kept code, and (rewrite) rewrite those shards with the
    map. The counts are of the raw codes: a tokenizer already pruned is refused (its shards no
    longer hold the codes it maps away). Returns the summary also written in codes.json."""
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    vq = load_vq(vq_dir)
    if vq.code_map is not None:
        raise ValueError(
            f"{Path(vq_dir) / CODES_FILE} exists: this tokenizer is pruned already (its shards "
            "hold only kept codes); prune the tokenizer's shards before pruning, from a copy"
        )
    paths = expand_shards(tokens)
    if not paths:
        raise FileNotFoundError(f"no token shards match {tokens!r}")
    tally = count_codes(paths, vq.cfg.codebook_size, progress)
    counts = tally["counts"]
    code_map = nearest_kept_map(code_latents(vq), counts, min_count)
    held = counts > 0
    pruned = held & (code_map != np.arange(len(code_map)))
    summary = {
        "min_count": int(min_count),
        "shards": len(paths),
        "samples": tally["samples"],
        "codes_counted": tally["codes"],
        "bad_members": tally["bad"],
        "codes_held": int(held.sum()),
        "codes_kept": int((counts >= min_count).sum()),
        "codes_pruned": int(pruned.sum()),
        "share_pruned": float(counts[pruned].sum() / max(tally["codes"], 1)),
        "counts": counts.tolist(),
    }
    write_code_map(vq_dir, code_map, summary)
    if rewrite:
        summary["codes_rewritten"] = sum(
            rewrite_shard(p, code_map)
            for p in tqdm(paths, desc="rewriting shards", unit="shard", disable=not progress)
        )
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="longvideo prune-codes",
        description="Map the codes a tokenizer's token shards hold fewer than --min-count times "
        "to their nearest kept code: writes VQ/codes.json (used by every later encode) and "
        "rewrites the shards with it (docs/vq.md, 'Rare codes pruned').",
    )
    p.add_argument("--vq", required=True, help="the tokenizer directory (gets codes.json)")
    p.add_argument(
        "--tokens",
        required=True,
        nargs="+",
        help="token shards it wrote: directories, globs or brace patterns",
    )
    p.add_argument("--min-count", type=int, required=True, help="fewest times a kept code is held")
    p.add_argument("--no-rewrite", action="store_true", help="write codes.json only")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    try:
        summary = prune_codes(
            a.vq, a.tokens, a.min_count, rewrite=not a.no_rewrite, progress=not a.quiet
        )
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    print(json.dumps({k: v for k, v in summary.items() if k != "counts"}))
    return 0
