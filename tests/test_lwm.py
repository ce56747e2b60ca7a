"""LWM's released checkpoints: import (streamed), parity with LWM's computations, chat, export.

Tiny random weights are written in LWM's own formats (tests/lwm_files.py: tux msgpack stream,
per-layer and scan_decoder, float32 and bfloat16, flax's chunked arrays; a pickle of flax VQGAN
parameters) and imported with `longvideo import-lwm`. Checked against independent computations:
every tensor, LWM's forward pass in numpy (text and vision logits), LWM's VQGAN in torch.nn.functional
on the flax arrays, LWM's vision-chat prompt; then import -> chat -> export -> transformers generate.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from lwm_files import (
    lm_shapes,
    lwm_logits,
    lwm_prompt,
    lwm_tokenizer,
    random_lm,
    random_vqgan,
    round_bf16,
    vqgan_decode,
    vqgan_encode,
    write_params,
    write_params_streaming,
    write_vqgan,
)
from safetensors.torch import load_file
from vision_ids import is_vision

from longvideo import cli
from longvideo.checkpoint import load_pretrained
from longvideo.data.templates import PromptOptions, build_prompt
from longvideo.export.lwm import LWMImportError, import_lwm
from longvideo.safepickle import UnsafePickleError, load_array_pickle
from longvideo.tokenizer import TextTokenizer
from longvideo.vocab import SPECIAL_TOKENS, Vocab
from longvideo.vq import decode_codes, encode_video

TESTS = Path(__file__).resolve().parent
HEADS, DIM, LAYERS, FFN, KV_DIM, V_VISION, CODEBOOK = 4, 64, 2, 96, 32, 24, 16
OVERRIDES = [f"model.n_heads={HEADS}", "model.max_seq_len=1024", "vq.resolution=16"]
QUESTION = "What colour was the flash frame?"


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Each test here runs on one torch thread (conftest.one_thread)."""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """LWM's three inputs (random weights): a tokenizer dir, the LM arrays, the VQGAN params."""
    d = tmp_path_factory.mktemp("lwm_files")
    hf = lwm_tokenizer()
    hf.save_pretrained(d / "tokenizer")
    rng = np.random.default_rng(0)
    lm = random_lm(
        rng, v_text=len(hf), v_vision=V_VISION, dim=DIM, layers=LAYERS, ffn=FFN, kv_dim=KV_DIM
    )
    vq = random_vqgan(rng, channels=32, mult=(1, 1, 2), blocks=2, z=8, codebook=CODEBOOK)
    write_vqgan(d / "vqgan", vq)
    return {"dir": d, "hf": hf, "lm": lm, "vq": vq, "v_text": len(hf)}


def write_and_import(files, out: Path, *, scan: bool, dtype: str, chunk_bytes=None) -> Path:
    params = out.parent / f"{out.name}.params"
    write_params(params, files["lm"], scan=scan, dtype=dtype, chunk_bytes=chunk_bytes)
    rc = cli.main(
        [
            "import-lwm",
            "--params",
            str(params),
            "--vqgan",
            str(files["dir"] / "vqgan"),
            "--tokenizer",
            str(files["dir"] / "tokenizer"),
            "--config",
            "lwm-chat-1m",
            "--out",
            str(out),
            "--quiet",
            *OVERRIDES,
        ]
    )
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def ckpt(files, tmp_path_factory):
    """The scan_decoder / bfloat16 / chunked release imported (what the chat scripts load)."""
    return write_and_import(
        files,
        tmp_path_factory.mktemp("lwm") / "ckpt",
        scan=True,
        dtype="bfloat16",
        chunk_bytes=3000,
    )


# ----------------------------------------------------------------------------- weights


def expected_tensors(lm: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The project's tensors from LWM's arrays, spelt out: stacked tables, transposed kernels, and the
    q/k rows of each head reordered from interleaved pairs (0, 1), (2, 3), ... to halves."""
    D = DIM // HEADS

    def halves(w_out_in, heads):
        order = np.concatenate(
            [h * D + np.r_[np.arange(0, D, 2), np.arange(1, D, 2)] for h in range(heads)]
        )
        return w_out_in[order]

    out = {
        "tok_embeddings.weight": np.concatenate(
            [lm["transformer/wte/embedding"], lm["transformer/vte/embedding"]]
        ),
        "head.weight": np.concatenate([lm["lm_head/kernel"].T, lm["vision_head/kernel"].T]),
        "norm.weight": lm["transformer/ln_f/kernel"],
    }
    for i in range(LAYERS):
        h = lambda k: lm[f"transformer/h/{i}/{k}"]  # noqa: E731
        out[f"layers.{i}.attn.wq.weight"] = halves(h("attention/wq/kernel").T, HEADS)
        out[f"layers.{i}.attn.wk.weight"] = halves(h("attention/wk/kernel").T, KV_DIM // D)
        out[f"layers.{i}.attn.wv.weight"] = h("attention/wv/kernel").T
        out[f"layers.{i}.attn.wo.weight"] = h("attention/wo/kernel").T
        out[f"layers.{i}.ffn.w_gate.weight"] = h("feed_forward/w1/kernel").T
        out[f"layers.{i}.ffn.w_up.weight"] = h("feed_forward/w3/kernel").T
        out[f"layers.{i}.ffn.w_down.weight"] = h("feed_forward/w2/kernel").T
        out[f"layers.{i}.attn_norm.weight"] = h("attention_norm/kernel")
        out[f"layers.{i}.ffn_norm.weight"] = h("ffn_norm/kernel")
    return out


@pytest.mark.parametrize(
    "scan,dtype,chunk",
    [(False, "bfloat16", None), (True, "float32", 2000)],
    ids=["per-layer-bf16", "scan-fp32-chunked"],
)
def test_every_tensor_arrives_exactly(files, tmp_path, scan, dtype, chunk):
    out = write_and_import(files, tmp_path / "ckpt", scan=scan, dtype=dtype, chunk_bytes=chunk)
    _check_tensors(files, out, dtype)


def test_scan_bf16_release_arrives_exactly(files, ckpt):
    _check_tensors(files, ckpt, "bfloat16")


def _check_tensors(files, out: Path, dtype: str):
    got = load_file(str(out / "model.safetensors"))
    lm = round_bf16(files["lm"]) if dtype == "bfloat16" else files["lm"]
    want = expected_tensors(lm)
    assert set(got) == set(want)
    for name, w in want.items():
        t = got[name]
        assert t.dtype == (torch.bfloat16 if dtype == "bfloat16" else torch.float32), name
        assert torch.equal(t.float(), torch.from_numpy(np.ascontiguousarray(w))), name
    p = load_pretrained(out)
    m = p.config.model
    assert (m.vocab_layout, m.text_vocab_size, m.vision_vocab_size, m.codebook_size) == (
        "lwm",
        files["v_text"],
        V_VISION,
        CODEBOOK,
    )
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim) == (
        DIM,
        LAYERS,
        HEADS,
        KV_DIM // (DIM // HEADS),
        FFN,
    )
    assert (m.rope_theta, m.norm_eps, m.max_seq_len) == (5e7, 1e-6, 1024)
    assert p.config.vq.arch == "lwm-vqgan" and p.config.data.prompt_template == "lwm"


def test_text_and_vision_logits_equal_lwm_forward(files, ckpt):
    """LWM's forward (vision-mask embedding, interleaved RoPE, text and vision heads) in numpy."""
    p = load_pretrained(ckpt)
    V = files["v_text"]
    rng = np.random.default_rng(5)
    ids = rng.integers(0, V, 40)
    vision = np.zeros(40, bool)
    vision[6:30] = True
    ids[vision] = rng.integers(0, V_VISION, int(vision.sum()))
    text_ref, vision_ref = lwm_logits(
        round_bf16(files["lm"]), ids, vision, n_heads=HEADS, theta=5e7, eps=1e-6
    )
    unified = torch.from_numpy(np.where(vision, V + ids, ids))[None]
    with torch.no_grad():
        logits = p.model.logits(p.model(unified))[0].double().numpy()
    scale = np.abs(text_ref).max()
    np.testing.assert_allclose(logits[:, :V], text_ref, atol=2e-5 * scale, rtol=0)
    np.testing.assert_allclose(logits[:, V:], vision_ref, atol=2e-5 * scale, rtol=0)


# ----------------------------------------------------------------------------- VQGAN


def test_vqgan_codes_and_reconstructions_equal_lwm(files, ckpt):
    """The adapter (diffusers' VQModel) against LWM's VQGAN written on the flax arrays."""
    from diffusers import VQModel as DiffusersVQModel

    vq = load_pretrained(ckpt).vq
    assert (
        isinstance(vq.net, DiffusersVQModel) and vq.cfg.latent_size == 4 and vq.cfg.downsample == 4
    )
    frames = torch.from_numpy(
        np.random.default_rng(1).integers(0, 256, (5, 16, 16, 3)).astype(np.uint8)
    )
    pixels = frames.double().div(127.5).sub(1).permute(0, 3, 1, 2)  # LWM: x / 127.5 - 1
    want_codes = vqgan_encode(files["vq"], pixels)
    want_frames = (
        vqgan_decode(files["vq"], want_codes)
        .add(1)
        .mul(127.5)
        .round()
        .to(torch.uint8)
        .permute(0, 2, 3, 1)
    )
    vq64 = vq.double()
    codes = encode_video(vq64, frames, batch_frames=2)  # the codec path chat and tokenize take
    assert torch.equal(codes, want_codes)
    assert torch.equal(decode_codes(vq64, codes, batch_groups=3), want_frames)
    vq32 = vq.float()  # as loaded: float32
    assert torch.equal(encode_video(vq32, frames), want_codes)
    rec = vq32.decode(vq32.codes_to_latents(want_codes[None]))[0].movedim(1, 0)
    torch.testing.assert_close(
        rec.double(), vqgan_decode(files["vq"], want_codes), atol=1e-5, rtol=0
    )


def test_pickles_that_run_code_are_refused(tmp_path, files, capsys):
    marker = tmp_path / "ran"

    class RunsCommand:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    class Evaluates:
        def __reduce__(self):
            return eval, (f"open({str(marker)!r}, 'w').close()",)

    def loads_array_pickle(data: bytes):
        (tmp_path / "pickled").write_bytes(data)
        return load_array_pickle(tmp_path / "pickled")

    arrays = {"encoder": {"Conv_0": {"kernel": np.zeros((3, 3, 3, 32), np.float32)}}}
    write_params(tmp_path / "params", files["lm"], scan=False)
    for payload in (
        RunsCommand(),
        {"ok": arrays, "quantize": {"embeddings": Evaluates()}},
        [np.zeros(2), subprocess.Popen],
    ):
        data = pickle.dumps(payload)
        with pytest.raises(UnsafePickleError, match="refusing"):
            loads_array_pickle(data)
        (tmp_path / "vqgan").write_bytes(data)
        rc = cli.main(
            [
                "import-lwm",
                "--params",
                str(tmp_path / "params"),
                "--vqgan",
                str(tmp_path / "vqgan"),
                "--tokenizer",
                str(files["dir"] / "tokenizer"),
                "--out",
                str(tmp_path / "o"),
                "--quiet",
            ]
        )
        assert rc == 1 and "refusing" in capsys.readouterr().err
        assert not marker.exists()
    with pytest.raises(UnsafePickleError, match="Python objects"):
        loads_array_pickle(pickle.dumps({"a": np.array([None, 1], dtype=object)}))
    # what LWM's file is, in any protocol: arrays in dicts
    for protocol in (2, 4, 5):
        write_vqgan(tmp_path / "v", files["vq"], protocol=protocol)
        back = load_array_pickle(tmp_path / "v")
        assert np.array_equal(back["quantize"]["embeddings"], files["vq"]["quantize"]["embeddings"])


# ----------------------------------------------------------------------------- prompt


def test_prompt_is_lwm_vision_chat_prompt(files):
    """build_prompt(template lwm) == LWM's construct_input (tokenizer.encode of its four pieces,
    each with BOS, the first reading a literal <s>), vision ids moved after the text ids."""
    tok = TextTokenizer(files["hf"], layout="lwm")
    V = files["v_text"]
    vocab = tok.vocab(CODEBOOK, V_VISION)
    codes = np.random.default_rng(2).integers(0, CODEBOOK, (3, 4, 4))
    ours = build_prompt(
        tok, vocab, codes, np.arange(3.0), QUESTION, PromptOptions(template="lwm")
    ).ids
    lwm_ids, vision = lwm_prompt(files["hf"], codes, QUESTION, eof=CODEBOOK, eov=CODEBOOK + 1)
    assert ours == np.where(vision, V + lwm_ids, lwm_ids).tolist()
    bos = files["hf"].bos_token_id
    assert ours[:2] == [bos, bos] and ours.count(bos) == 5 and ours.count(vocab.eov) == 1
    assert ours.count(vocab.eof) == 2 and sum(vocab.vq_offset <= i < vocab.eof for i in ours) == 48
    text = tok.decode(ours)  # the vision ids are not text
    assert text.startswith(f"You are a helpful assistant. USER: {QUESTION}\n<vision>")
    assert text.replace(" ", "").endswith("<vision></vision>ASSISTANT:")


def test_lwm_tokenizer_keeps_sentencepiece_word_boundaries():
    """transformers 5 reads LLaMA's tokenizer.model with a pre-tokenizer that drops the boundary
    marker SentencePiece (and LWM) put before a leading space: " A" must still be "▁▁A"."""
    from transformers import LlamaTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581": 3, "A": 4, "\u2581A": 5}
    llama = LlamaTokenizer(vocab=vocab, merges=[("\u2581", "A")])
    assert llama.encode(" A", add_special_tokens=False) == [5]  # what transformers does
    tok = TextTokenizer(llama, layout="lwm")
    assert tok.text_size == 6 and tok.encode(" A") == [3, 5] and tok.encode("A A") == [5, 5]


def test_lwm_tokenizer_model_encodes_as_sentencepiece(tmp_path):
    """A directory holding only a LLaMA-style tokenizer.model (as LWM's releases ship it) loads, and
    the lwm layout encodes every prompt piece exactly as SentencePiece (LWM's tokenizer) does."""
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    texts = [
        "You are a helpful assistant. USER: What colour was the flash frame?",
        "<vision> </vision> ASSISTANT: red green blue",
        "What shape came first? square circle",
    ] * 20
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        vocab_size=360,
        model_type="bpe",
        byte_fallback=True,
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    tok = TextTokenizer.from_dir(tmp_path, layout="lwm")
    assert (tok.text_size, tok.bos_id, tok.eos_id) == (360, 1, 2)
    for text in (
        f"You are a helpful assistant. USER: {QUESTION}\n",
        "<vision>",
        "</vision>",
        " ASSISTANT:",
        "  two  spaces",
        "\u00fcn\u00ef",
    ):
        assert tok.encode(text) == sp.encode(text), text


def special_ids(v: Vocab) -> dict[str, int]:
    """The special tokens that have an id of their own, by name."""
    if v.is_lwm:
        return {"<eof>": v.eof, "<eov>": v.eov}
    return {tok: v.text_size + i for i, tok in enumerate(SPECIAL_TOKENS)}


def added_tokens(v: Vocab) -> tuple[str, ...]:
    """The special tokens the text tokenizer gets (after its own ids): none in the lwm layout."""
    return () if v.is_lwm else SPECIAL_TOKENS


def test_vocab_layouts():
    v = Vocab(text_size=100, codebook_size=16, layout="lwm", vision_size=24)
    assert (v.size, v.vq_offset, v.eof, v.eov, v.vision_start, v.vision_end, v.answer_limit) == (
        124,
        100,
        116,
        117,
        None,
        None,
        100,
    )
    assert (
        v.video_end == v.eov
        and added_tokens(v) == ()
        and special_ids(v) == {"<eof>": 116, "<eov>": 117}
    )
    assert is_vision(v, torch.tensor([99, 100, 123, 124])).tolist() == [False, True, True, False]
    d = Vocab(text_size=100, codebook_size=16)
    assert (d.size, d.vq_offset, d.eof, d.eov, d.video_end, d.answer_limit) == (
        120,
        104,
        102,
        103,
        101,
        None,
    )
    assert Vocab(100, 8192, "lwm").vision_size == 8448
    with pytest.raises(ValueError, match="vision_size"):
        Vocab(100, 16, "lwm", 17)


# ----------------------------------------------------------------------------- chat and export


@pytest.fixture(scope="module")
def chat_case(ckpt, tmp_path_factory):
    from test_infer_chat import write_video

    clip = tmp_path_factory.mktemp("lwm_video") / "clip.mp4"
    write_video(clip)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(
            [
                "chat",
                "--model",
                str(ckpt),
                "--video",
                str(clip),
                "--question",
                QUESTION,
                "--quiet",
                "--max-new-tokens",
                "8",
                "--device",
                "cpu",
            ]
        )
    assert rc == 0
    return clip, buf.getvalue().strip()


def test_import_chat_export_generate_end_to_end(files, ckpt, chat_case, tmp_path):
    """`longvideo chat` on the import, and transformers' generate on its export, answer alike."""
    from transformers import AutoModelForCausalLM

    from longvideo.export import LongVideoProcessor
    from longvideo.infer.chat import ChatSession, infer_config

    clip, printed = chat_case
    V = files["v_text"]
    pre = load_pretrained(ckpt)
    session = ChatSession.from_video(
        pre, str(clip), infer=infer_config(pre, max_new_tokens=8), progress=False
    )
    assert session.ask(QUESTION) == printed and printed
    generated = session.last.tokens[0].tolist()
    assert max(generated) < V  # text ids only, as LWM's text head samples
    # the prompt is LWM's: its ids, from the codes chat encoded
    lwm_ids, vision = lwm_prompt(
        files["hf"], session.video.codes, QUESTION, eof=CODEBOOK, eov=CODEBOOK + 1
    )
    prompt = session.prompt(QUESTION).ids
    assert prompt == np.where(vision, V + lwm_ids, lwm_ids).tolist()
    with torch.no_grad():
        free = pre.model.logits(pre.model(torch.tensor([prompt])))[0, -1]
    assert int(free[:V].argmax()) == generated[0]

    assert cli.main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    proc = LongVideoProcessor.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == V + V_VISION
    inputs = proc(str(clip), QUESTION)
    assert inputs["input_ids"][0].tolist() == prompt
    out = model.generate(
        **inputs, max_new_tokens=8
    )  # greedy, vision ids suppressed (generation_config)
    eos = files["hf"].eos_token_id
    answer_ids = out[0, len(prompt) :].tolist()
    stop = generated.index(eos) + 1 if eos in generated else len(generated)
    assert answer_ids[:stop] == generated[:stop]
    assert proc.decode(out[0], prompt_length=len(prompt)) == printed

    # where the vision head dominates, both still answer with text ids only
    with torch.no_grad():
        pre.model.head.weight[V:] *= 1000
        model.lm_head.weight[V:] *= 1000
        assert int(pre.model.logits(pre.model(torch.tensor([prompt])))[0, -1].argmax()) >= V
    session = ChatSession(pre, session.video, infer=infer_config(pre, max_new_tokens=8))
    session.ask(QUESTION)
    assert max(session.last.tokens[0].tolist()) < V
    assert max(model.generate(**inputs, max_new_tokens=8)[0, len(prompt) :].tolist()) < V


def _sp_body(rank, world, ckpt, clip, expected):
    from distributed import chat_lines

    assert chat_lines(ckpt, clip, QUESTION) == ([expected] if rank == 0 else [])


@pytest.mark.slow
@pytest.mark.distributed
def test_sequence_parallel_chat_on_lwm_import(ckpt, chat_case):
    """`longvideo chat` under torchrun (W = 2, ring prefill, sharded cache) answers as one process."""
    from distributed import run_ranks

    clip, printed = chat_case
    run_ranks(_sp_body, world=2, args=(str(ckpt), str(clip), printed), timeout=300)


# ----------------------------------------------------------------------------- errors and memory


def test_bad_inputs_are_named(files, tmp_path):
    lm = dict(files["lm"])
    del lm["vision_head/kernel"]
    write_params(tmp_path / "params", lm, scan=False)
    with pytest.raises(LWMImportError, match="vision_head/kernel"):
        import_lwm(
            tmp_path / "params",
            files["dir"] / "vqgan",
            files["dir"] / "tokenizer",
            tmp_path / "o",
            overrides=OVERRIDES,
        )
    write_params(tmp_path / "params", files["lm"], scan=False)
    with pytest.raises(LWMImportError, match="model.n_heads"):  # width 64 is no standard LWM config
        import_lwm(
            tmp_path / "params",
            files["dir"] / "vqgan",
            files["dir"] / "tokenizer",
            tmp_path / "o",
            overrides=["vq.resolution=16"],
        )
    (tmp_path / "params").write_bytes(b"\x93junk")
    rc = cli.main(
        [
            "import-lwm",
            "--params",
            str(tmp_path / "params"),
            "--vqgan",
            str(files["dir"] / "vqgan"),
            "--tokenizer",
            str(files["dir"] / "tokenizer"),
            "--out",
            str(tmp_path / "o"),
            "--quiet",
            *OVERRIDES,
        ]
    )
    assert rc == 1
    assert not (tmp_path / "o" / "config.yaml").exists()


_MEASURE = """
import sys
from pathlib import Path
from longvideo.config import load_config
from longvideo.export.lwm import model_config_from_tree, read_tree, write_weights

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

params, out = Path(sys.argv[1]), Path(sys.argv[2])
before = status("VmRSS")
tree = read_tree(params)
cfg = model_config_from_tree(tree, load_config("lwm-chat-1m").model, 8192, n_heads=8)
write_weights(tree, cfg, out)
print(status("VmHWM") - before)
"""


@pytest.mark.slow
def test_streaming_import_needs_far_less_memory_than_the_file(tmp_path):
    """A ~300 MB float32 params file (largest array 98 MB) converts with a peak RSS growth of well
    under half the file: tensors are read, converted and written one (layer slice) at a time."""
    shapes = lm_shapes(v_text=32000, v_vision=8448, dim=768, layers=2, ffn=2048)
    size = write_params_streaming(tmp_path / "params", shapes, chunk_bytes=1 << 25)
    assert size > 250e6
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            _MEASURE,
            str(tmp_path / "params"),
            str(tmp_path / "out.safetensors"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "1"},
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    growth = int(res.stdout.split()[-1])
    assert growth < size / 2, (
        f"peak RSS grew by {growth / 1e6:.0f} MB for a {size / 1e6:.0f} MB file"
    )
    got = load_file(str(tmp_path / "out.safetensors"))
    assert got["tok_embeddings.weight"].shape == (32000 + 8448, 768) and len(got) == 3 + 2 * 9


def test_streaming_weights_writes_pieces_in_any_order_and_checks_them(tmp_path):
    from longvideo.checkpoint import CheckpointError, streaming_weights

    a, b, c = torch.arange(3, dtype=torch.bfloat16), torch.randn(2, 3), torch.tensor(True)
    specs = {"a": (a.dtype, (3,)), "b": (b.dtype, (2, 3)), "c": (c.dtype, ())}
    with streaming_weights(tmp_path / "w.safetensors", specs, metadata={"format": "pt"}) as w:
        w.write("b", b[1], at=3)
        w.write("a", a)
        w.write("b", b[0])
        w.write("c", c)
    got = load_file(str(tmp_path / "w.safetensors"))
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b) and bool(got["c"])
    for pieces, words in (
        ([("a", a[:2], 0)], "only 2 of 3"),
        ([("a", a, 0), ("a", a[:1], 0)], "overlap"),
        ([("a", a.float(), 0)], "bfloat16"),
        ([("a", a, 1)], "outside"),
    ):
        with pytest.raises(CheckpointError, match=words):
            with streaming_weights(tmp_path / "x.safetensors", {"a": specs["a"]}) as w:
                for name, t, at in pieces:
                    w.write(name, t, at=at)
        assert not (tmp_path / "x.safetensors").exists()
