"""Chat end to end on a generated mp4: CLI and Python API against an independent pipeline."""

import io
import warnings

import numpy as np
import pytest
import torch

from longvideo.checkpoint import Pretrained, save_project_checkpoint
from longvideo.config import Config
from longvideo.data.synthetic import NEEDLE_QUESTION, SyntheticSpec, make_sample
from longvideo.data.templates import build_prompt
from longvideo.data.video import read_video
from longvideo.infer import cli
from longvideo.infer.chat import ChatSession, ContextWarning, answer, encode_video_file
from longvideo.infer.config import InferConfig
from longvideo.model import ModelConfig, Transformer
from longvideo.tokenizer import train_text_tokenizer
from longvideo.vq import VQConfig, VQModel, encode_video

TEXTS = [
    "What colour was the flash frame? red green blue yellow",
    "What shape came first? square circle triangle",
    "Question: Answer: the a an of",
] * 4


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Each test here runs on one torch thread (conftest.one_thread)."""


def tiny_pretrained(max_seq_len: int = 1024, mode: str = "2d", seed: int = 0) -> Pretrained:
    """A random tiny model with a real BPE tokenizer and a random tiny VQ (16x16 frames, 4x4 codes)."""
    torch.manual_seed(seed)
    tok = train_text_tokenizer(TEXTS, vocab_size=300)
    vq_cfg = VQConfig(
        mode=mode,
        resolution=16,
        downsample=4,
        temporal_downsample=2,
        codebook_size=16,
        channels=8,
        channel_mult=(1, 1, 1),
        num_res_blocks=1,
    )
    vq = VQModel(vq_cfg).eval()
    mcfg = ModelConfig(
        text_vocab_size=tok.text_size,
        codebook_size=16,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=max_seq_len,
        init_std=0.2,
    )
    cfg = Config(model=mcfg, vq=vq_cfg, infer=InferConfig(max_new_tokens=6, prefill_chunk=48))
    return Pretrained(
        model=Transformer(mcfg, ffn_chunk=64).eval(), config=cfg, tokenizer=tok, vq=vq
    )


def write_video(path, seconds=6, seed=3):
    spec = SyntheticSpec(
        size=32,
        fps=4,
        min_seconds=seconds,
        max_seconds=seconds,
        long_fraction=0.0,
        needle_fraction=1.0,
    )
    sample = make_sample(seed, 0, spec)
    path.write_bytes(sample.mp4())
    return sample


def reference_answer_ids(pre: Pretrained, video_path, question: str, n_new: int, fps: float = 1.0):
    """Independent pipeline: read everything, encode at once, greedy decoding by full recomputation."""
    clip = read_video(str(video_path), fps=fps, size=pre.vq.cfg.resolution)
    codes = encode_video(pre.vq, clip.frames)
    ids = torch.tensor(
        [build_prompt(pre.tokenizer, pre.model.cfg.vocab, codes, clip.timestamps, question).ids]
    )
    out = []
    with torch.no_grad():
        for _ in range(n_new):
            tok = int(pre.model.logits(pre.model(ids))[0, -1].argmax())
            out.append(tok)
            if tok == pre.tokenizer.eos_id:
                break
            ids = torch.cat([ids, torch.tensor([[tok]])], 1)
    return [t for t in out if t != pre.tokenizer.eos_id] if pre.tokenizer.eos_id in out else out


def test_answer_matches_independent_pipeline(tmp_path):
    pre = tiny_pretrained()
    write_video(tmp_path / "clip.mp4")
    want = reference_answer_ids(pre, tmp_path / "clip.mp4", NEEDLE_QUESTION, 6)
    session = ChatSession.from_video(pre, str(tmp_path / "clip.mp4"), progress=False)
    assert session.video.codes.shape == (6, 4, 4) and session.video.fps == 1.0
    got = session.ask(NEEDLE_QUESTION)
    gen = session.last.tokens[0].tolist()
    assert gen[: len(want)] == want
    assert got == pre.tokenizer.decode(want).strip()
    # the Python API gives the same answer, from the video's bytes too
    assert answer(pre, (tmp_path / "clip.mp4").read_bytes(), NEEDLE_QUESTION) == got


def test_cli_chat_single_and_interactive(tmp_path, capsys, monkeypatch):
    pre = tiny_pretrained()
    ckpt = save_project_checkpoint(
        tmp_path / "ckpt", pre.model.state_dict(), pre.config, tokenizer=pre.tokenizer, vq=pre.vq
    )
    write_video(tmp_path / "clip.mp4")
    questions = [NEEDLE_QUESTION, "What shape came first?"]
    expected = [
        pre.tokenizer.decode(reference_answer_ids(pre, tmp_path / "clip.mp4", q, 6)).strip()
        for q in questions
    ]
    rc = cli.chat_main(
        [
            "--model",
            str(ckpt),
            "--video",
            str(tmp_path / "clip.mp4"),
            "--question",
            questions[0],
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and out.splitlines() == [expected[0]]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(questions) + "\n\n"))
    rc = cli.chat_main(
        ["--model", str(ckpt), "--video", str(tmp_path / "clip.mp4"), "--interactive", "--quiet"]
    )
    out = capsys.readouterr().out
    assert rc == 0 and out.splitlines() == expected


def test_follow_up_questions_do_not_reencode(tmp_path, monkeypatch):
    pre = tiny_pretrained()
    write_video(tmp_path / "clip.mp4")
    session = ChatSession.from_video(pre, str(tmp_path / "clip.mp4"), progress=False)
    calls = []
    monkeypatch.setattr("longvideo.vq.encode_video", lambda *a, **k: calls.append(1))
    first = session.ask(NEEDLE_QUESTION)
    prefix_s = session.engine.prefix_s
    session.ask("What shape came first?")
    again = session.ask(NEEDLE_QUESTION)
    assert again == first and not calls
    assert session.engine.prefix_s == prefix_s  # the video's prefix was prefilled once


def test_long_video_is_sampled_at_a_lower_fps_with_a_warning(tmp_path):
    pre = tiny_pretrained(max_seq_len=120)  # 17 tokens per frame: only a few frames fit
    write_video(tmp_path / "clip.mp4", seconds=12)
    with pytest.warns(ContextWarning, match=r"effective fps 0\.\d+"):
        enc = encode_video_file(
            pre,
            str(tmp_path / "clip.mp4"),
            fps=1.0,
            question=NEEDLE_QUESTION,
            max_new_tokens=6,
            progress=False,
        )
    assert 0 < enc.codes.shape[0] < 12
    assert enc.fps == pytest.approx(enc.codes.shape[0] / 12.0)
    assert np.all(np.diff(enc.timestamps) > 1.0)  # spread over the whole video
    session = ChatSession(pre, enc)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fitted prompt stays within the context
        session.ask(NEEDLE_QUESTION)
    assert session.last.prompt_len + 6 <= 120


def test_missing_and_corrupt_videos_are_clear_errors(tmp_path, capsys):
    pre = tiny_pretrained()
    ckpt = save_project_checkpoint(
        tmp_path / "ckpt", pre.model.state_dict(), pre.config, tokenizer=pre.tokenizer, vq=pre.vq
    )
    rc = cli.chat_main(
        ["--model", str(ckpt), "--video", str(tmp_path / "nope.mp4"), "--question", "hi"]
    )
    err = capsys.readouterr().err
    assert rc != 0 and "nope.mp4" in err and "no such file" in err
    (tmp_path / "bad.mp4").write_bytes(b"\x00\x01not a video" * 100)
    rc = cli.chat_main(
        ["--model", str(ckpt), "--video", str(tmp_path / "bad.mp4"), "--question", "hi"]
    )
    err = capsys.readouterr().err
    assert rc != 0 and "bad.mp4" in err
    rc = cli.chat_main(
        [
            "--model",
            str(tmp_path / "no_model"),
            "--video",
            str(tmp_path / "bad.mp4"),
            "--question",
            "hi",
        ]
    )
    assert rc != 0 and "no_model" in capsys.readouterr().err
