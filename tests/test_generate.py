"""Text to video (`longvideo generate`, docs/generation.md) against independent computations.

* An imported LWM checkpoint (tiny random weights in LWM's formats, tests/lwm_files.py) against
  LWM's rules restated on LWM's own forward pass in float64 numpy (`lwm_logits`), LWM's prompts
  tokenized as its script does, its vision-head logits mixed, <eof> forced every h*w + 1 tokens.
* A project checkpoint against a full-recompute float64 loop over the caption template.
* Forced <eof>/<eov>, guidance 1 against none, seeds, the files, the CLI, the export's generate,
  and sequence-parallel sampling on 2 ranks.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from lwm_files import (
    TOKENIZER_TEXTS,
    lwm_logits,
    lwm_tokenizer,
    random_lm,
    random_vqgan,
    write_params,
    write_vqgan,
)
from PIL import Image

from longvideo import cli
from longvideo.checkpoint import load_pretrained, save_project_checkpoint
from longvideo.data.templates import (
    CODE_SLOT,
    LayoutOptions,
    generation_prompts,
    layout_doc,
    video_slots,
)
from longvideo.data.video import read_video
from longvideo.export.lwm import import_lwm
from longvideo.infer.t2v import (
    Sampling,
    draw,
    frame_grid,
    generate_video,
    generate_videos,
    guided,
)

HEADS, DIM, LAYERS, FFN, KV_DIM, V_VISION, CODEBOOK = 4, 64, 2, 96, 32, 24, 16
PER = 16  # 4 x 4 codes a frame (16 x 16 frames)
PROMPT = "a red square, then a blue circle"


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Each test here runs on one torch thread (conftest.one_thread)."""


# ----------------------------------------------------------------------------- LWM's rules


@pytest.fixture(scope="module")
def lwm(tmp_path_factory):
    """An LWM-Chat release of random float32 weights imported (what `longvideo generate` loads)."""
    d = tmp_path_factory.mktemp("lwm_generate")
    words = "Generate an image video of red square, then blue circle".split()
    hf = lwm_tokenizer(texts=TOKENIZER_TEXTS + words * 3)  # the prompts in several pieces each
    hf.save_pretrained(d / "tokenizer")
    rng = np.random.default_rng(0)
    lm = random_lm(
        rng, v_text=len(hf), v_vision=V_VISION, dim=DIM, layers=LAYERS, ffn=FFN, kv_dim=KV_DIM
    )
    write_vqgan(
        d / "vqgan",
        random_vqgan(rng, channels=32, mult=(1, 1, 2), blocks=2, z=8, codebook=CODEBOOK),
    )
    write_params(d / "params", lm, scan=True, dtype="float32")
    overrides = [f"model.n_heads={HEADS}", "model.max_seq_len=1024", "vq.resolution=16"]
    ckpt = import_lwm(d / "params", d / "vqgan", d / "tokenizer", d / "ckpt", overrides=overrides)
    return {"hf": hf, "lm": lm, "ckpt": ckpt, "V": len(hf)}


def lwm_reference(lwm, frames: int, cfg: float) -> tuple[list[int], list[int]]:
    """LWM's vision_generation.py, greedy, on LWM's forward in float64: (its image prompt's ids,
    the generated vision ids). Codes are taken among the codebook's ids (docs/generation.md)."""
    hf, lm = lwm["hf"], lwm["lm"]

    def vision_logits(ids, vision):
        _, v = lwm_logits(
            lm, np.asarray(ids), np.asarray(vision), n_heads=HEADS, theta=5e7, eps=1e-6
        )
        return v[-1]

    def sample(cond, cond_mask, uncond, uncond_mask, n):
        out = []
        for t in range(n):
            if (t + 1) % (PER + 1) == 0:  # every frame's last token: <eof> (LWM's vision id 8192)
                out.append(CODEBOOK)
                continue
            seen = [True] * len(out)
            c = vision_logits(cond + out, cond_mask + seen)
            if cfg != 1:
                u = vision_logits(uncond + out, uncond_mask + seen)
                c = u + cfg * (c - u)
            out.append(int(np.argmax(c[:CODEBOOK])))
        return out

    image = hf.encode(
        f"<s>You are a helpful assistant. USER: Generate an image of {PROMPT} ASSISTANT: <vision>"
    )
    uncond = hf.encode("<s><vision>")
    out = sample(image, [False] * len(image), uncond, [False] * len(uncond), PER + 1)
    if frames > 1:
        video = hf.encode(
            "<s>You are a helpful assistant. USER: Generate a video of "
            f"{PROMPT} ASSISTANT: <vision>"
        )
        first = [False] * len(video), [False] * len(uncond)
        out = out + sample(
            video + out,
            first[0] + [True] * len(out),
            uncond + out,
            first[1] + [True] * len(out),
            (frames - 1) * (PER + 1),
        )
    return image, out


@pytest.mark.parametrize("frames, cfg", [(1, 3.0), (3, 3.0), (3, 1.0)])
def test_lwm_checkpoint_follows_lwms_script(lwm, frames, cfg):
    """Greedy (top_k 1) codes of an imported LWM checkpoint equal LWM's rules on LWM's own
    forward."""
    image, want = lwm_reference(lwm, frames, cfg)
    got = generate_video(lwm["ckpt"], PROMPT, frames=frames, cfg_scale=cfg, top_k=1)
    V = lwm["V"]
    assert got.ids == [V + i for i in want]
    assert got.codes.shape == (frames, 4, 4) and got.frames.shape == (frames, 16, 16, 3)
    assert got.codes.reshape(frames, -1).tolist() == [
        want[g * (PER + 1) : g * (PER + 1) + PER] for g in range(frames)
    ]
    if frames == 1:
        assert got.prompt_ids[0] == image and got.prompt_ids[1] == lwm["hf"].encode("<s><vision>")
        assert image[:2] == [1, 1]  # the literal <s> and the tokenizer's BOS, as LWM's script has


def boosted(model, ids: list[int], by: float = 1e4):
    """The model with these ids' logits raised by `by` everywhere (they would win every step)."""
    orig = model.logits

    def logits(hidden):
        out = orig(hidden).clone()
        out[..., ids] += by
        return out

    model.logits = logits
    return model


def test_lwm_frames_end_with_forced_eof(lwm):
    """Even a model that always prefers <eof> and <eov> gets codes inside a frame and <eof> at each
    frame's end, <eov> never (LWM's script forces <eof> after every frame, the last one too)."""
    pre = load_pretrained(lwm["ckpt"])
    v = pre.model.cfg.vocab
    boosted(pre.model, [v.eof, v.eov, v.size - 1])
    got = generate_video(pre, PROMPT, frames=3, cfg_scale=3.0, top_k=1, decode=False)
    assert len(got.ids) == 3 * (PER + 1)
    for t, i in enumerate(got.ids):
        if (t + 1) % (PER + 1) == 0:
            assert i == v.eof
        else:
            assert v.vq_offset <= i < v.vq_offset + v.codebook_size


# ----------------------------------------------------------------------------- the project's layout


def project_ckpt(tmp_path_factory, every: int) -> Path:
    from test_infer_chat import tiny_pretrained

    pre = tiny_pretrained()
    cfg = dataclasses.replace(
        pre.config, data=dataclasses.replace(pre.config.data, timestamp_every=every)
    )
    out = tmp_path_factory.mktemp(f"project_t{every}") / "ckpt"
    return save_project_checkpoint(
        out, pre.model.state_dict(), cfg, tokenizer=pre.tokenizer, vq=pre.vq
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return project_ckpt(tmp_path_factory, 0)


@pytest.fixture(scope="module")
def project_stamped(tmp_path_factory):
    """Timestamp text before every second frame, as a model trained with timestamp_every 2 reads."""
    return project_ckpt(tmp_path_factory, 2)


def project_reference(pre, frames: int, cfg: float, every: int = 0):
    """The caption template with the caption first, greedy, recomputed in float64 at every step:
    (conditional prompt, generated ids)."""
    m = copy.deepcopy(pre.model).double()
    tok, v = pre.tokenizer, m.cfg.vocab
    cond = [tok.bos_id, *tok.encode(PROMPT), v.vision_start]
    uncond = [tok.bos_id, v.vision_start]

    def last(ids):
        with torch.no_grad():
            return m.logits(m(torch.tensor([ids])))[0, -1]

    out: list[int] = []
    for g in range(frames):
        if every and g % every == 0:
            out += tok.encode(f"[{float(g):.1f}s]")  # 1 fps: frame g at g seconds
        for _ in range(PER):
            c = last(cond + out)
            if cfg != 1:
                u = last(uncond + out)
                c = u + cfg * (c - u)
            out.append(v.vq_offset + int(c[v.vq_offset : v.vq_offset + v.codebook_size].argmax()))
        out.append(v.eov if g == frames - 1 else v.eof)
    return cond, out


@pytest.mark.parametrize("frames, cfg", [(1, 3.0), (3, 3.0), (3, 1.0)])
def test_project_checkpoint_equals_full_recompute(project, frames, cfg):
    pre = load_pretrained(project)
    cond, want = project_reference(pre, frames, cfg)
    got = generate_video(project, PROMPT, frames=frames, cfg_scale=cfg, top_k=1)
    assert got.prompt_ids[0] == cond and got.ids == want
    assert got.codes.shape == (frames, 4, 4) and got.frames.shape == (frames, 16, 16, 3)


def test_timestamps_are_forced_as_training_lays_them_out(project_stamped):
    """With timestamp_every 2 the generated ids are the training document of the caption template
    (caption first) with the sampled codes, token for token."""
    pre = load_pretrained(project_stamped)
    cond, want = project_reference(pre, 3, 3.0, every=2)
    got = generate_video(pre, PROMPT, frames=3, cfg_scale=3.0, top_k=1)
    assert got.ids == want
    opts = LayoutOptions(timestamp_every=2, caption_position="before")
    doc = layout_doc(
        pre.tokenizer,
        pre.model.cfg.vocab,
        got.codes,
        np.arange(3.0),
        {"caption": PROMPT},
        "caption",
        True,
        opts,
        max_len=1024,
    )
    v = pre.model.cfg.vocab
    assert doc.ids.tolist() == cond + got.ids + [v.vision_end, pre.tokenizer.eos_id]


def test_project_frames_end_with_eof_and_eov(project):
    """A model that always prefers <eof>/<eov> (and text) still samples codes inside a frame; frames
    end with <eof>, the last with <eov>; with model_ends the model may stop after any frame."""
    pre = load_pretrained(project)
    v = pre.model.cfg.vocab
    boosted(pre.model, [v.eof, v.eov, v.vision_end, 0])
    got = generate_video(pre, PROMPT, frames=3, cfg_scale=2.0, top_k=1, decode=False)
    assert [got.ids[g * (PER + 1) + PER] for g in range(3)] == [v.eof, v.eof, v.eov]
    codes = [i for t, i in enumerate(got.ids) if (t + 1) % (PER + 1)]
    assert all(v.vq_offset <= i < v.vq_offset + v.codebook_size for i in codes)
    boosted(pre.model, [v.eov])  # now <eov> wins the sampled ends too
    ends = generate_video(pre, PROMPT, frames=3, cfg_scale=2.0, top_k=1, model_ends=True)
    assert len(ends.ids) == PER + 1 and ends.ids[-1] == v.eov and ends.codes.shape == (1, 4, 4)
    slots = video_slots(
        pre.tokenizer, v, groups=3, codes_per_group=PER, model_ends=True
    )  # the slots: codes, a sampled end (<eof> or <eov>), ..., the last end <eov>
    assert slots.count(CODE_SLOT) == 3 * PER and slots[-1] == v.eov


def test_guidance_one_is_no_guidance(project):
    """cfg 1 runs the conditional row alone; a scale a hair above 1 runs both rows (the batched,
    left-padded unconditional row beside it) and samples the very same video."""
    torch.manual_seed(0)
    c, u = torch.randn(50), torch.randn(50)
    assert torch.equal(guided(c, None, 3.0), c)
    torch.testing.assert_close(guided(c, u, 1.0), c)
    pre = load_pretrained(project)
    kw = dict(frames=3, temperature=1.0, top_k=8, seed=5, decode=False)
    one = generate_video(pre, PROMPT, cfg_scale=1.0, **kw)
    both = generate_video(pre, PROMPT, cfg_scale=1.0 + 1e-9, **kw)
    assert one.ids == both.ids


def test_a_batch_samples_what_each_video_would_alone(project, lwm):
    """Several prompts in one batched forward (left-padded rows, a generator per video): video i is
    the video generated alone with seed + i, sampled or greedy, in both layouts."""
    prompts = [
        PROMPT,
        "a green triangle",
        "a yellow circle, then a red triangle, then a blue square",
    ]
    for ckpt in (project, lwm["ckpt"]):
        pre = load_pretrained(ckpt)
        pre.model.double()
        for kw in (dict(top_k=1), dict(temperature=1.0, top_k=6, top_p=0.95)):
            kw.update(frames=3, cfg_scale=2.5, seed=11, decode=False)
            batch = generate_videos(pre, prompts, **kw)
            assert len(batch) == 3 and batch[0].batch == 3
            for i, p in enumerate(prompts):
                alone = generate_video(pre, p, **{**kw, "seed": 11 + i})
                assert batch[i].ids == alone.ids and batch[i].prompt_ids == alone.prompt_ids


def test_seeds_reproduce_and_differ(project):
    pre = load_pretrained(project)
    kw = dict(frames=3, cfg_scale=3.0, temperature=1.0, top_p=0.9, top_k=8, decode=False)
    a, b = (generate_video(pre, PROMPT, seed=7, **kw) for _ in range(2))
    c = generate_video(pre, PROMPT, seed=8, **kw)
    assert a.ids == b.ids and not np.array_equal(a.codes, c.codes)


def test_draw_keeps_top_k_and_nucleus():
    """The sampler: argmax when greedy; top-k keeps the k most likely; top-p the nucleus; the kept
    tokens in proportion."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    g = torch.Generator().manual_seed(0)

    def counts(s):
        draws = [draw(probs.log(), s, g) for _ in range(2000)]
        return torch.bincount(torch.tensor(draws), minlength=4).double() / len(draws)

    want = torch.tensor([0.625, 0.375, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(counts(Sampling(top_k=2)), want, atol=0.04, rtol=0)
    torch.testing.assert_close(counts(Sampling(top_p=0.7)), want, atol=0.04, rtol=0)
    torch.testing.assert_close(counts(Sampling()), probs.double(), atol=0.04, rtol=0)
    assert draw(torch.tensor([0.1, 2.0, -1.0]), Sampling(top_k=1), g) == 1
    assert draw(torch.tensor([0.1, 2.0, -1.0]), Sampling(temperature=0), g) == 1
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0)


# ----------------------------------------------------------------------------- files and CLI


def test_cli_writes_mp4_gif_png_the_reader_reads(project, tmp_path, capsys):
    want = generate_video(project, PROMPT, frames=3, cfg_scale=3.0, top_k=1)
    frames = want.frames.numpy()
    for ext in ("mp4", "gif", "png"):
        out, codes = tmp_path / f"v.{ext}", tmp_path / f"{ext}.npy"
        args = ["generate", "--model", str(project), "--prompt", PROMPT, "--frames", "3"]
        args += ["--cfg-scale", "3", "--top-k", "1", "--out", str(out), "--save-codes", str(codes)]
        assert cli.main([*args, "--quiet", "--device", "cpu"]) == 0
        assert np.array_equal(np.load(codes), want.codes) and np.load(codes).dtype == np.int64
        if ext == "png":  # several frames: one grid, lossless; a picture, not a video container
            assert np.array_equal(_png(out), frame_grid(frames))
            continue
        got = read_video(str(out), fps=None).frames.numpy()
        assert got.shape == frames.shape
        err = np.abs(got.astype(int) - frames.astype(int)).mean()
        assert err < (6 if ext == "gif" else 25), (ext, err)  # a palette; H.264 in yuv420p
    assert "wrote" in capsys.readouterr().out
    one = tmp_path / "one.png"
    assert cli.main(["generate", "--model", str(project), "--prompt", PROMPT, "--out", str(one),
                     "--top-k", "1", "--quiet", "--device", "cpu"]) == 0  # fmt: skip
    first = generate_video(project, PROMPT, frames=1, top_k=1).frames[0].numpy()
    assert np.array_equal(_png(one), first)


def _png(path) -> np.ndarray:
    """A PNG's pixels (the video reader refuses still images: docs/security.md)."""
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def test_cli_errors_are_named(project, tmp_path, capsys):
    base = ["generate", "--prompt", PROMPT, "--quiet", "--device", "cpu"]
    assert cli.main([*base, "--model", str(project), "--out", str(tmp_path / "x.avi")]) == 2
    assert "--out must end with one of .mp4, .gif, .png" in capsys.readouterr().err
    assert (
        cli.main([*base, "--model", str(tmp_path / "none"), "--out", str(tmp_path / "x.mp4")]) == 2
    )
    assert "model directory not found" in capsys.readouterr().err
    bad = [*base, "--model", str(project), "--out", str(tmp_path / "x.mp4"), "--frames", "0"]
    assert cli.main(bad) == 2 and "frames must be >= 1" in capsys.readouterr().err
    bad = [*base, "--model", str(project), "--out", str(tmp_path / "x.mp4"), "--top-p", "0"]
    assert cli.main(bad) == 2 and "top_p" in capsys.readouterr().err
    assert not list(tmp_path.glob("x.*"))
    with pytest.raises(ValueError, match="caption is empty"):
        generate_video(project, "  ", frames=1)


# ----------------------------------------------------------------------------- the export


@pytest.mark.parametrize("which", ["project_stamped", "lwm"])
def test_export_generate_equals_the_command(which, request, tmp_path):
    """The exported directory with transformers' generate and LongVideoProcessor's guidance gives
    the codes and frames of `longvideo generate` (top_k 1)."""
    from transformers import AutoModelForCausalLM

    from longvideo.export import LongVideoProcessor

    src = request.getfixturevalue(which)
    ckpt = src["ckpt"] if which == "lwm" else src
    assert cli.main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    proc = LongVideoProcessor.from_pretrained(tmp_path / "hf")
    for frames, cfg in ((1, 3.0), (3, 3.0), (3, 1.0)):
        want = generate_video(ckpt, PROMPT, frames=frames, cfg_scale=cfg, top_k=1)
        got = proc.generate_video(model, PROMPT, frames=frames, cfg_scale=cfg, top_k=1)
        assert got.ids == want.ids and np.array_equal(got.codes, want.codes), (frames, cfg)
        assert torch.equal(got.frames, want.frames)


# ----------------------------------------------------------------------------- sequence parallel


def _sp_body(rank, world, ckpt, want_ids):
    import torch.distributed as dist

    pre = load_pretrained(ckpt)
    pre.model.double()
    got = generate_video(
        pre,
        PROMPT,
        frames=3,
        cfg_scale=3.0,
        top_k=1,
        decode=False,
        group=dist.group.WORLD,
        reshard_min=8,
        backend="torch",
    )
    assert got.ids == want_ids and got.reshards >= 1


@pytest.mark.slow
@pytest.mark.distributed
def test_sequence_parallel_sampling_equals_one_process(project, lwm):
    """Two gloo ranks: the rows ring-prefilled and sharded again as they grow (every 8 tokens at
    first) give the codes of one
    process, for the project's layout and LWM's two prompts."""
    from distributed import run_ranks

    for ckpt in (project, lwm["ckpt"]):
        pre = load_pretrained(ckpt)
        pre.model.double()
        want = generate_video(pre, PROMPT, frames=3, cfg_scale=3.0, top_k=1, decode=False)
        run_ranks(_sp_body, world=2, args=(str(ckpt), want.ids), timeout=300)


def test_generation_prompts_need_their_layout(project, lwm):
    pre, lw = load_pretrained(project), load_pretrained(lwm["ckpt"])
    with pytest.raises(ValueError, match="lwm layout"):
        generation_prompts(pre.tokenizer, pre.model.cfg.vocab, PROMPT, template="lwm")
    with pytest.raises(ValueError, match="longvideo layout"):
        generation_prompts(lw.tokenizer, lw.model.cfg.vocab, PROMPT, template="qa")


# ----------------------------------------------------------------------------- faithfulness


def test_read_frame_reads_what_the_renderer_drew():
    """Colour and shape of rendered frames (every kind, colour, position), flashes, empty frames."""
    from longvideo.data.synthetic import COLOURS, SyntheticSpec, make_sample, read_frame

    spec = SyntheticSpec(needle_fraction=0.0, long_fraction=0.0)
    seen, colour_ok, shape_ok = 0, 0, 0
    for i in range(60):
        s = make_sample(0, i, spec)
        for t, frame in enumerate(s.frames_at(np.arange(0, s.num_frames, spec.fps))):
            scene = next(sh for a, b, sh in s.scenes if a <= t < b)
            r = read_frame(frame)
            assert r["kind"] == "shape"
            seen += 1
            colour_ok += r["colour"] == scene.colour
            shape_ok += r["shape"] == scene.kind
    assert seen > 300 and colour_ok == seen and shape_ok >= 0.99 * seen, (seen, shape_ok)
    for name, rgb in COLOURS.items():
        flash = np.broadcast_to(np.asarray(rgb, np.uint8), (64, 64, 3))
        assert read_frame(flash)["kind"] == "flash" and read_frame(flash)["colour"] == name
    assert read_frame(np.zeros((64, 64, 3), np.uint8))["kind"] == "empty"


def test_scoring_colours_in_order_and_chance():
    from longvideo.infer.t2v_eval import caption_scenes, chance_of, collapse, score_video

    scenes = caption_scenes("a red square, then a blue circle, then a red triangle.")
    assert scenes == [("red", "square"), ("blue", "circle"), ("red", "triangle")]
    assert collapse([1, 1, 2, 2, 1]) == [1, 2, 1]

    def shape(colour, kind="square"):
        return {"kind": "shape", "colour": colour, "shape": kind}

    empty, flash = {"kind": "empty"}, {"kind": "flash", "colour": "green"}
    good = [
        shape("red"),
        flash,
        shape("red"),
        empty,
        shape("blue", "circle"),
        shape("red", "triangle"),
    ]
    got = score_video(good, scenes)
    assert got["colours_in_order"] and got["shapes_in_order"] and got["first_scene"]
    assert not score_video([shape("blue"), shape("red")], scenes)["colours_in_order"]
    assert not score_video([shape("red"), shape("blue")], scenes)["colours_in_order"]  # one missing
    wrong_kind = score_video([shape("red"), shape("blue"), shape("red")], scenes)
    assert wrong_kind["colours_in_order"] and not wrong_kind["shapes_in_order"]
    # a 2-second video is one scene of a uniformly drawn colour and kind: chance 1/4 and 1/12
    colour, pair = chance_of([("red", "square")], 2)
    assert abs(colour - 0.25) < 0.03 and abs(pair - 1 / 12) < 0.02


def test_eval_t2v_writes_its_json_and_grid(project, tmp_path, capsys):
    """`longvideo eval t2v` on held-out raw shards: a video per caption, as long as its source at
    1 fps (at most --max-frames), read and scored, in batches that sample what each video would
    alone."""
    import json

    from longvideo.data.synthetic import SyntheticSpec, write_synthetic_shards
    from longvideo.infer.t2v_eval import evaluate_t2v

    spec = SyntheticSpec(size=16, min_seconds=2, max_seconds=4, long_fraction=0, needle_fraction=0)
    write_synthetic_shards(tmp_path / "raw", 5, seed=4, spec=spec, progress=False)
    args = ["eval", "t2v", "--model", str(project), "--shards", str(tmp_path / "raw")]
    args += ["--out", str(tmp_path / "ev"), "--samples", "4", "--max-frames", "3", "--quiet"]
    assert cli.main([*args, "--device", "cpu"]) == 0
    assert "colours in order" in capsys.readouterr().out
    res = json.loads((tmp_path / "ev/t2v.json").read_text())
    assert res["n"] == 4 and 0 <= res["accuracy"] <= 1 and 0 < res["chance"] < 1
    assert (tmp_path / "ev/t2v.png").is_file() and res["probe_on_real"] is None
    one = res["samples"][1]
    assert one["frames"] == min(3, len(one["read"])) and one["frames"] <= 3
    alone = generate_video(project, one["caption"], frames=one["frames"], cfg_scale=3.0, seed=1)
    from longvideo.data.synthetic import read_frame

    assert [
        [r["kind"], r["colour"], r["shape"]] for r in map(read_frame, alone.frames.numpy())
    ] == one["read"]
    again = evaluate_t2v(project, str(tmp_path / "raw"), samples=4, max_frames=3, batch=1)
    assert [s["read"] for s in again["samples"]] == [s["read"] for s in res["samples"]]


def _sp_cli_body(rank, world, ckpt, out):
    from longvideo.infer import cli as infer_cli

    args = ["--model", ckpt, "--prompt", PROMPT, "--frames", "3", "--cfg-scale", "3"]
    args += ["--top-k", "1", "--out", f"{out}.gif", "--save-codes", f"{out}.npy", "--quiet"]
    assert infer_cli._generate(infer_cli.generate_parser().parse_args(args)) == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_generate_under_torchrun_writes_what_one_process_writes(project, tmp_path):
    """`longvideo generate` in a 2-rank world: rank 0 writes the video and the codes of one process."""
    from distributed import run_ranks

    want = generate_video(project, PROMPT, frames=3, cfg_scale=3.0, top_k=1)
    run_ranks(_sp_cli_body, world=2, args=(str(project), str(tmp_path / "sp")), timeout=300)
    assert np.array_equal(np.load(tmp_path / "sp.npy"), want.codes)
    assert len(read_video(str(tmp_path / "sp.gif"), fps=None)) == 3
