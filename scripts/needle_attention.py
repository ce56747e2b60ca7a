#!/usr/bin/env python
"""Where the answer to the flash question looks: for one generated background with each flash
colour (and with none) spliced in, the model's answer, the log-probability of each colour, and per
layer and head the share of the answer position's attention on the flash frame's codes, with the
codes the most flash-attending head attends to most (docs/hour.md, "Rare codes").

    python scripts/needle_attention.py --model runs/demo-hour/hf --length 3600 --background-seed 3002
    python scripts/needle_attention.py --model runs/demo-hour/hf --length 3600 --background-seed 3002 \\
        --tokens 'runs/demo-hour/tokens/{brief,short,mid,long}' --out runs/attention.json

`--background-seed` is the seed `eval video-niah` gives trial t of its column j: its --seed +
1000 j + t (each cell of its JSON names it under `background`). With `--tokens`, each listed code
also says how many times those token shards hold it (a code the training data holds a handful of
times has an almost untrained embedding). One process; an hour's prompt takes a few seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch


def flash_attention(model, ids: torch.Tensor, flash: torch.Tensor):
    """(hidden states, per layer the (heads,) attention share of the last position on the token
    positions `flash`, per layer the (heads, S) attention row of the last position, per layer the
    largest difference between the model's attention output at the last position and the row
    applied to the values: the row is the attention the model used when it is small)."""
    shares, rows, gaps = [], [], []
    base = model.attention_fn

    def record(q, k, v, meta):
        out = base(q, k, v, meta)
        rep = q.shape[2] // k.shape[2]
        last = q[0, -1].double()  # (Hq, D)
        keys = k[0].double().repeat_interleave(rep, dim=1)  # (S, Hq, D)
        row = torch.softmax(torch.einsum("hd,shd->hs", last, keys) / math.sqrt(last.shape[-1]), -1)
        mixed = torch.einsum("hs,shd->hd", row, v[0].double().repeat_interleave(rep, dim=1))
        gaps.append(float((mixed - out[0, -1].double()).abs().max()))
        shares.append(row[:, flash].sum(-1))
        rows.append(row)
        return out

    hidden = model(ids, attention_fn=record)
    return hidden, shares, rows, gaps


def main(argv: list[str] | None = None) -> int:
    from longvideo.data.prune import count_codes
    from longvideo.data.streams import expand_shards
    from longvideo.infer.chat import prompt_of
    from longvideo.infer.evals import (
        NEEDLE_QUESTION,
        Runtime,
        VideoNeedleEvaluation,
        VideoNeedleSettings,
        haystack_frames,
        needle_index,
    )
    from longvideo.vq.codec import SplicingEncoder

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an exported model directory (with vq/)")
    p.add_argument("--length", type=int, default=3600, help="frames at 1 fps")
    p.add_argument("--background-seed", type=int, default=0)
    p.add_argument("--depth", type=float, default=0.5)
    p.add_argument("--source-fps", type=int, default=1, help="as `eval video-niah --source-fps`")
    p.add_argument("--top", type=int, default=6, help="codes listed for the flash head")
    p.add_argument("--tokens", nargs="*", default=None, help="token shards to count codes in")
    p.add_argument("--out", default=None, help="also write the result as JSON here")
    a = p.parse_args(argv)
    torch.set_grad_enabled(False)

    settings = VideoNeedleSettings(lengths=(a.length,), trials=1, source_fps=a.source_fps)
    ev = VideoNeedleEvaluation(a.model, settings, Runtime(progress=False))
    pre, vocab = ev.pretrained, ev.pretrained.model.cfg.vocab
    colours = [c for c, _ in ev.needles]
    answer_ids = [pre.tokenizer.encode(" " + c)[0] for c in colours]
    counts = None
    if a.tokens:
        counts = count_codes(expand_shards(a.tokens), pre.vq.cfg.codebook_size)["counts"]
    frames = haystack_frames(a.length, ev.size, a.background_seed, a.source_fps, decoded=True)
    background = SplicingEncoder(pre.vq, frames, batch_frames=ev.infer.encode_batch_frames)
    frame = needle_index(a.length, a.depth)
    stamps = ev.column(0).stamps
    result = {
        "model": a.model,
        "length": a.length,
        "background_seed": a.background_seed,
        "depth": a.depth,
        "flash_frame": frame,
        "trials": [],
    }
    for name, needle in [("none", None), *ev.needles]:
        codes = background.codes_with({} if needle is None else {frame: needle}).numpy()
        prompt = prompt_of(pre, codes.astype(np.int64), stamps, NEEDLE_QUESTION)
        ids = torch.tensor([prompt.ids])
        video = torch.nonzero((ids[0] >= vocab.vq_offset) & (ids[0] < vocab.size)).flatten()
        per = int(np.prod(codes.shape[1:]))
        group = next(g for g, m in enumerate(pre.vq.group_frame_index(a.length)) if frame in m)
        flash = video[group * per : (group + 1) * per]
        hidden, shares, rows, gaps = flash_attention(pre.model, ids, flash)
        if max(gaps) > 1e-3:
            raise RuntimeError(f"the recorded attention is not the model's (off by {max(gaps)})")
        logp = torch.log_softmax(pre.model.logits(hidden[:, -1:])[0, -1].double(), -1)
        layer, head = max(
            ((i, h) for i in range(len(shares)) for h in range(len(shares[i]))),
            key=lambda ih: float(shares[ih[0]][ih[1]]),
        )
        row = rows[layer][head]
        mass: dict[int, float] = {}
        for t, w in zip(ids[0].tolist(), row.tolist()):
            mass[t] = mass.get(t, 0.0) + w
        top = sorted(mass.items(), key=lambda tw: -tw[1])[: a.top]
        listed = []
        for t, w in top:
            code = t - vocab.vq_offset if vocab.vq_offset <= t < vocab.size else None
            item = {"token": t, "code": code, "share": w, "in_prompt": int((ids[0] == t).sum())}
            if counts is not None and code is not None:
                item["training_count"] = int(counts[code])
            listed.append(item)
        trial = {
            "flash": name,
            "answer": colours[int(torch.argmax(logp[answer_ids]))],
            "log_prob": {c: float(logp[i]) for c, i in zip(colours, answer_ids)},
            "flash_codes": [int(ids[0, i]) - vocab.vq_offset for i in flash],
            "flash_share": [s.tolist() for s in shares],
            "flash_head": {"layer": layer, "head": head, "share": float(shares[layer][head])},
            "flash_head_top": listed,
        }
        result["trials"].append(trial)
        heads = " | ".join(
            f"L{i} " + " ".join(f"{x:.2f}" for x in s.tolist()) for i, s in enumerate(shares)
        )
        print(f"{name:>6}: answers {trial['answer']:<6} flash share {heads}")
        top_text = ", ".join(
            f"{x['code'] if x['code'] is not None else 'text'}: {x['share']:.2f}"
            + (f" (held {x['training_count']}x)" if "training_count" in x else "")
            for x in listed
        )
        print(f"        layer {layer} head {head} attends to {top_text}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
