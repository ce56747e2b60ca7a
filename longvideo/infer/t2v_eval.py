"""How faithful generated videos are to their captions (`longvideo eval t2v`, docs/generation.md,
"Faithfulness"): videos are generated from held-out captions of the synthetic set and every frame is
read from its pixels (longvideo.data.synthetic.read_frame: the colour and the shape drawn); a video
is faithful when the colours it shows, in order, are the captioned ones. Chance: how often a video
drawn from the dataset itself shows a caption's colours in order, for videos of the same length.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from longvideo.data.shards import index_tar, iter_raw_samples, iter_token_samples
from longvideo.data.streams import ShardError, SkipStats, expand_shards
from longvideo.data.synthetic import (
    COLOUR_NAMES,
    SHAPE_KINDS,
    SyntheticSpec,
    make_sample,
    read_frame,
)
from longvideo.infer.chat import load_model
from longvideo.infer.t2v import generate_videos
from longvideo.vq import decode_codes

SCENE = re.compile(rf"\b({'|'.join(COLOUR_NAMES)}) ({'|'.join(SHAPE_KINDS)})\b")
CHANCE_DRAWS = 4000
"""Videos drawn from the dataset per length to estimate chance."""


def caption_scenes(caption: str) -> list[tuple[str, str]]:
    """The (colour, shape) of each scene a caption names, in order ("a red square, then ...")."""
    return SCENE.findall(caption)


def collapse(seq: Sequence) -> list:
    """seq without repeats in a row: what one sees change, frame after frame."""
    return [x for i, x in enumerate(seq) if i == 0 or x != seq[i - 1]]


def score_video(readings: Sequence[dict], scenes: Sequence[tuple[str, str]]) -> dict:
    """A generated video's readings against its caption's scenes: colours_in_order (the colours of
    the frames that show a shape, repeats in a row merged, are the caption's, repeats merged alike),
    shapes_in_order (the same for colour and shape), first_scene (the first frame shows the first
    scene). Flashes and empty frames are left out."""
    shown = [(r["colour"], r["shape"]) for r in readings if r["kind"] == "shape"]
    first = readings[0] if readings else {"kind": "empty"}
    return {
        "colours_in_order": collapse([c for c, _ in shown]) == collapse([c for c, _ in scenes]),
        "shapes_in_order": collapse(shown) == collapse(list(scenes)),
        "first_scene": first["kind"] == "shape" and (first["colour"], first["shape"]) == scenes[0],
        "shown": collapse(shown),
    }


_CHANCE: dict[int, tuple[Counter, Counter]] = {}


def chance_of(
    scenes: Sequence[tuple[str, str]], seconds: int, seed: int = 0
) -> tuple[float, float]:
    """How often a video of `seconds` drawn from the synthetic set shows these colours in order, and
    these (colour, shape) scenes in order (Monte Carlo over CHANCE_DRAWS videos; no pixels
    drawn)."""
    if seconds not in _CHANCE:
        spec = SyntheticSpec(
            min_seconds=seconds, max_seconds=seconds, long_fraction=0.0, needle_fraction=0.0
        )
        colours, pairs = Counter(), Counter()
        for i in range(CHANCE_DRAWS):
            drawn = [(s.colour, s.kind) for _, _, s in make_sample(seed + 10_000, i, spec).scenes]
            colours[tuple(collapse([c for c, _ in drawn]))] += 1
            pairs[tuple(collapse(drawn))] += 1
        _CHANCE[seconds] = (colours, pairs)
    colours, pairs = _CHANCE[seconds]
    return (
        colours[tuple(collapse([c for c, _ in scenes]))] / CHANCE_DRAWS,
        pairs[tuple(collapse(list(scenes)))] / CHANCE_DRAWS,
    )


def held_out(shards, limit: int) -> Iterator[tuple[str, dict, np.ndarray | None]]:
    """(key, meta, codes or None) of the samples with a caption, raw or token shards, in order."""
    paths = expand_shards(shards)
    if not paths:
        raise FileNotFoundError(f"no shards match {shards!r}")
    stats, n = SkipStats(), 0
    for path in paths:
        try:
            is_tokens = any(m.ext == "codes.npy" for m in index_tar(path))
        except ShardError:
            continue
        samples = (
            ((s.key, s.meta, s.codes) for s in iter_token_samples(path, stats))
            if is_tokens
            else ((s.key, s.meta, None) for s in iter_raw_samples(path, stats))
        )
        for key, meta, codes in samples:
            if n >= limit:
                return
            if isinstance(meta.get("caption"), str) and caption_scenes(meta["caption"]):
                n += 1
                yield key, meta, codes


def scenes_within(meta: dict, seconds: float) -> list[tuple[str, str]]:
    """The caption's scenes that start within the first `seconds` (all when it has no timing)."""
    scenes = caption_scenes(meta["caption"])
    segs = meta.get("segments") or []
    if len(segs) == len(scenes):
        scenes = [s for s, seg in zip(scenes, segs) if float(seg["start"]) < seconds] or scenes[:1]
    return scenes


def truth_at(meta: dict, t: float) -> tuple[str, str] | None:
    """The (colour, shape) on screen at second t of a synthetic video; None during a flash."""
    for f in [meta.get("needle"), *(meta.get("flashes") or [])]:
        if f and float(f["start"]) <= t < float(f["end"]):
            return None
    for seg, scene in zip(meta.get("segments") or [], caption_scenes(meta["caption"])):
        if float(seg["start"]) <= t < float(seg["end"]):
            return scene
    return None


def save_grid(records: list[dict], videos: list[np.ndarray], path: Path, rows: int = 16) -> None:
    """A PNG: per generated video a row, its caption (and whether its colours are in order) on the
    left, its frames to the right."""
    from PIL import Image, ImageDraw

    rows = min(rows, len(videos))
    H, W = videos[0].shape[1:3]
    cols = max(len(v) for v in videos[:rows])
    text_w, pad = 300, 4
    img = Image.new("RGB", (text_w + cols * (W + pad), rows * (H + pad) + pad), "white")
    draw = ImageDraw.Draw(img)
    for r, (rec, frames) in enumerate(zip(records[:rows], videos[:rows])):
        y = pad + r * (H + pad)
        words, lines, line = rec["caption"].split(), [], ""
        for w in words:  # wrap at about 46 characters
            if len(line) + len(w) > 46:
                lines.append(line)
                line = ""
            line = f"{line} {w}".strip()
        lines.append(line)
        mark = "colours in order" if rec["colours_in_order"] else "colours NOT in order"
        for i, text in enumerate([*lines, mark]):
            fill = (
                "black" if i < len(lines) else ("darkgreen" if rec["colours_in_order"] else "red")
            )
            draw.text((pad, y + 2 + 12 * i), text, fill=fill)
        for c, f in enumerate(frames):
            img.paste(Image.fromarray(f), (text_w + c * (W + pad), y))
    img.save(path)


@torch.no_grad()
def evaluate_t2v(
    model,
    shards,
    *,
    out_dir=None,
    samples: int = 32,
    max_frames: int = 8,
    cfg_scale: float = 3.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    temperature: float = 1.0,
    seed: int = 0,
    model_ends: bool = False,
    batch: int = 16,
    group=None,
    progress: bool = True,
    device: str | torch.device = "cpu",
) -> dict:
    """Generate a video from each of the first `samples` captions of held-out shards (raw or
    token), as many frames as the video had at the model's fps (at most max_frames; the scenes that
    start within them are expected) or, with model_ends, as many as the model makes before its
    <eov> (at most max_frames; every scene is expected), read every frame and score it (module
    docstring). With token shards the frames the VQ decodes from the real codes are read too
    (`probe_on_real`: how well the reading works on the tokenizer's own frames). Videos of one
    length are sampled `batch` at a time in one batched forward (video i with seed + i). Writes
    t2v.json and t2v.png into out_dir."""
    pre = load_model(model, device)
    fps = pre.config.data.fps
    records, videos, real = [], [], Counter()
    todo = list(held_out(shards, samples))
    if not todo:
        raise ValueError(f"no captioned samples in {shards!r}")

    def frames_of(meta: dict) -> int:
        if model_ends:  # the model ends each video (<eov>) within max_frames
            return max_frames
        seconds = float(meta.get("duration") or max_frames / fps)
        return max(1, min(max_frames, int(round(seconds * fps))))

    # videos of the same length are sampled together, one batched forward (video i with seed + i)
    by_length: dict[int, list[int]] = {}
    for i, (_, meta, _) in enumerate(todo):
        by_length.setdefault(frames_of(meta), []).append(i)
    generated: dict[int, object] = {}
    bar = tqdm(total=len(todo), desc="t2v", unit="video", disable=not progress)
    for frames, idx in sorted(by_length.items()):
        for b in range(0, len(idx), batch):
            part = idx[b : b + batch]
            outs = generate_videos(
                pre,
                [todo[i][1]["caption"] for i in part],
                frames=frames,
                cfg_scale=cfg_scale,
                top_k=top_k,
                top_p=top_p,
                temperature=temperature,
                seed=[seed + i for i in part],
                model_ends=model_ends,
                group=group,
            )
            generated.update(zip(part, outs))
            bar.update(len(part))
    bar.close()
    for i, (key, meta, codes) in enumerate(todo):
        gen, frames = generated[i], frames_of(meta)
        scenes = (
            caption_scenes(meta["caption"]) if model_ends else scenes_within(meta, frames / fps)
        )
        # chance: videos of the dataset as long as this one (as long as the frames asked for)
        seconds = float(meta.get("duration") or frames / fps)
        chance_len = max(1, int(round(seconds if model_ends else frames / fps)))
        frames = len(gen.codes)
        video = gen.frames.numpy()
        readings = [read_frame(f) for f in video]
        chance, chance_shapes = chance_of(scenes, chance_len)
        records.append(
            {
                "key": key,
                "caption": meta["caption"],
                "frames": frames,
                "expected": [list(s) for s in scenes],
                "read": [[r["kind"], r["colour"], r["shape"]] for r in readings],
                **score_video(readings, scenes),
                "chance": chance,
                "chance_shapes": chance_shapes,
                "tokens_per_s": gen.tokens_per_s,
            }
        )
        videos.append(video)
        if codes is not None:  # the reading on the tokenizer's frames of the real video
            for t, frame in enumerate(decode_codes(pre.vq, codes).numpy()[:frames]):
                want = truth_at(meta, t / fps)
                if want is not None:
                    r = read_frame(frame)
                    real["frames"] += 1
                    real["colour"] += r["colour"] == want[0]
                    real["shape"] += (r["colour"], r["shape"]) == want
    n = len(records)

    def rate(k: str) -> float:
        return float(np.mean([r[k] for r in records]))

    result = {
        "n": n,
        "accuracy": rate("colours_in_order"),
        "chance": rate("chance"),
        "shapes_in_order": rate("shapes_in_order"),
        "chance_shapes": rate("chance_shapes"),
        "first_scene": rate("first_scene"),
        "settings": {
            "cfg_scale": cfg_scale,
            "top_k": top_k,
            "top_p": top_p,
            "temperature": temperature,
            "seed": seed,
            "max_frames": max_frames,
            "model_ends": model_ends,
        },
        "tokens_per_s": rate("tokens_per_s"),
        "probe_on_real": (
            {
                "frames": real["frames"],
                "colour": real["colour"] / real["frames"],
                "colour_and_shape": real["shape"] / real["frames"],
            }
            if real["frames"]
            else None
        ),
        "samples": records,
    }
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        result["json"], result["png"] = str(out / "t2v.json"), str(out / "t2v.png")
        save_grid(records, videos, out / "t2v.png")
        (out / "t2v.json").write_text(json.dumps(result, indent=1))
    return result
