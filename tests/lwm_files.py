"""LWM's released file formats, written from random numpy weights, and LWM's computations in numpy.

Written from the formats' descriptions (tux's StreamingCheckpointer, flax's msgpack serialization,
LWM's vision_llama.py / vqgan.py / vision_chat.py), independently of the importer under test:

* `write_params`: a tux streaming checkpoint of an LWM-Chat model (per-layer or scan_decoder
  layout; float32 or bfloat16; optionally flax's chunked form for big arrays).
* `write_vqgan`: a pickle of LWM's flax VQGAN parameters.
* `lwm_logits`: LWM's forward pass (vision-mask embedding, LLaMA blocks with interleaved RoPE,
  text and vision heads) in float64 numpy.
* `vqgan_encode` / `vqgan_decode`: LWM's VQGAN in torch.nn.functional on the flax arrays.
* `lwm_tokenizer`: a small tokenizer that behaves like LWM's (SentencePiece-style word
  boundaries, BOS added by `encode`, `<s>` read as BOS), and `lwm_prompt`, LWM's construct_input.
"""

from __future__ import annotations

import pickle

import msgpack
import numpy as np
import torch
import torch.nn.functional as F

LAYER_KEYS = (
    "attention/wq/kernel",
    "attention/wk/kernel",
    "attention/wv/kernel",
    "attention/wo/kernel",
    "feed_forward/w1/kernel",
    "feed_forward/w2/kernel",
    "feed_forward/w3/kernel",
    "attention_norm/kernel",
    "ffn_norm/kernel",
)


# ----------------------------------------------------------------------------- the language model


def random_lm(
    rng: np.random.Generator,
    *,
    v_text: int,
    v_vision: int,
    dim: int,
    layers: int,
    ffn: int,
    kv_dim: int | None = None,
) -> dict[str, np.ndarray]:
    """LWM parameter names (flat, '/'-joined, per layer) -> float32 arrays (kernels are (in, out))."""
    kv_dim = kv_dim or dim

    def dense(i, o):
        return (rng.standard_normal((i, o)) / np.sqrt(i)).astype(np.float32)

    p = {
        "transformer/wte/embedding": rng.standard_normal((v_text, dim)).astype(np.float32),
        "transformer/vte/embedding": rng.standard_normal((v_vision, dim)).astype(np.float32),
        "transformer/ln_f/kernel": (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32),
        "lm_head/kernel": dense(dim, v_text),
        "vision_head/kernel": dense(dim, v_vision),
    }
    for i in range(layers):
        h = f"transformer/h/{i}/"
        p[h + "attention/wq/kernel"] = dense(dim, dim)
        p[h + "attention/wk/kernel"] = dense(dim, kv_dim)
        p[h + "attention/wv/kernel"] = dense(dim, kv_dim)
        p[h + "attention/wo/kernel"] = dense(dim, dim)
        p[h + "feed_forward/w1/kernel"] = dense(dim, ffn)
        p[h + "feed_forward/w2/kernel"] = dense(ffn, dim)
        p[h + "feed_forward/w3/kernel"] = dense(dim, ffn)
        p[h + "attention_norm/kernel"] = (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
        p[h + "ffn_norm/kernel"] = (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    return p


def round_bf16(p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The float32 values a bfloat16 file holds."""
    return {k: torch.from_numpy(v).bfloat16().float().numpy() for k, v in p.items()}


def _ext(arr: np.ndarray, dtype: str) -> msgpack.ExtType:
    """flax's msgpack extension for one array: (shape, dtype name, raw C-order bytes)."""
    if dtype == "bfloat16":
        raw = (
            torch.from_numpy(np.ascontiguousarray(arr, np.float32))
            .bfloat16()
            .view(torch.int16)
            .numpy()
            .tobytes()
        )
    else:
        raw = np.ascontiguousarray(arr, np.dtype(dtype)).tobytes()
    return msgpack.ExtType(1, msgpack.packb((list(arr.shape), dtype, raw), use_bin_type=True))


def flax_to_bytes(arr: np.ndarray, dtype: str, chunk_bytes: int | None = None) -> bytes:
    """flax.serialization.to_bytes of one array; arrays above `chunk_bytes` in flax's chunked form."""
    item = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    if chunk_bytes is not None and arr.size * item > chunk_bytes:
        per = max(1, chunk_bytes // item)
        flat = arr.reshape(-1)
        chunks = {
            str(i): _ext(flat[s : s + per], dtype) for i, s in enumerate(range(0, flat.size, per))
        }
        tree = {
            "__msgpack_chunked_array__": True,
            "shape": {str(i): d for i, d in enumerate(arr.shape)},
            "chunks": chunks,
        }
        return msgpack.packb(tree, use_bin_type=True)
    return msgpack.packb(_ext(arr, dtype), use_bin_type=True)


def write_params(
    path,
    params: dict[str, np.ndarray],
    *,
    scan: bool,
    dtype: str = "float32",
    chunk_bytes: int | None = None,
    order_seed: int = 0,
) -> None:
    """A tux StreamingCheckpointer file: msgpack (key path, to_bytes(array)) records, in a shuffled
    order (a flattened dict's order is not something a reader may rely on)."""
    items = dict(params)
    if scan:
        layers = sorted({int(k.split("/")[2]) for k in params if k.startswith("transformer/h/")})
        items = {k: v for k, v in params.items() if not k.startswith("transformer/h/")}
        for key in LAYER_KEYS:
            items[f"transformer/h/scan_decoder/{key}"] = np.stack(
                [params[f"transformer/h/{i}/{key}"] for i in layers]
            )
    names = list(items)
    np.random.default_rng(order_seed).shuffle(names)
    packer = msgpack.Packer()
    with open(path, "wb") as f:
        for name in names:
            f.write(packer.pack((name.split("/"), flax_to_bytes(items[name], dtype, chunk_bytes))))


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def lwm_logits(
    p: dict[str, np.ndarray],
    ids: np.ndarray,
    vision_mask: np.ndarray,
    *,
    n_heads: int,
    theta: float,
    eps: float,
) -> tuple[np.ndarray, np.ndarray]:
    """LWM's forward pass over one sequence (positions 0..S-1), float64: (text logits, vision logits).

    ids are LWM's ids: text ids where vision_mask is false, vision ids (0..8447) where it is true."""
    g = {k: v.astype(np.float64) for k, v in p.items()}
    x = np.where(
        vision_mask[:, None],
        g["transformer/vte/embedding"][np.where(vision_mask, ids, 0)],
        g["transformer/wte/embedding"][np.where(vision_mask, 0, ids)],
    )
    S, dim = x.shape
    D = dim // n_heads
    freqs = 1.0 / theta ** (np.arange(0, D, 2) / D)
    rot = np.exp(1j * np.arange(S)[:, None] * freqs[None, :])  # (S, D/2)

    def rope(t):  # (S, H, D): complex multiplication on interleaved pairs
        c = t[..., 0::2] + 1j * t[..., 1::2]
        c = c * rot[:, None, :]
        return np.stack([c.real, c.imag], -1).reshape(t.shape)

    n_layers = len({k.split("/")[2] for k in p if k.startswith("transformer/h/")})
    causal = np.tril(np.ones((S, S), bool))
    for i in range(n_layers):
        L = {k: g[f"transformer/h/{i}/{k}"] for k in LAYER_KEYS}
        h = _rms(x, L["attention_norm/kernel"], eps)
        q = (h @ L["attention/wq/kernel"]).reshape(S, n_heads, D)
        k = (h @ L["attention/wk/kernel"]).reshape(S, -1, D)
        v = (h @ L["attention/wv/kernel"]).reshape(S, -1, D)
        q, k = rope(q), rope(k)
        rep = n_heads // k.shape[1]
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D)
        s = np.where(causal[None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", a, v).reshape(S, dim)
        x = x + o @ L["attention/wo/kernel"]
        h = _rms(x, L["ffn_norm/kernel"], eps)
        a1 = h @ L["feed_forward/w1/kernel"]
        x = (
            x
            + ((a1 / (1 + np.exp(-a1))) * (h @ L["feed_forward/w3/kernel"]))
            @ L["feed_forward/w2/kernel"]
        )
    x = _rms(x, g["transformer/ln_f/kernel"], eps)
    return x @ g["lm_head/kernel"], x @ g["vision_head/kernel"]


# ----------------------------------------------------------------------------- the VQGAN


def random_vqgan(
    rng: np.random.Generator,
    *,
    channels: int,
    mult: tuple[int, ...],
    blocks: int,
    z: int,
    codebook: int,
) -> dict:
    """Nested flax parameters of LWM's VQGANModel (lwm/vqgan.py's module and auto-naming order)."""

    def conv(i, o, k=3):
        return {
            "kernel": (rng.standard_normal((k, k, i, o)) / np.sqrt(k * k * i)).astype(np.float32),
            "bias": (0.05 * rng.standard_normal(o)).astype(np.float32),
        }

    def gn(c):
        return {
            "scale": (1 + 0.1 * rng.standard_normal(c)).astype(np.float32),
            "bias": (0.1 * rng.standard_normal(c)).astype(np.float32),
        }

    def resnet(i, o):
        r = {"GroupNorm_0": gn(i), "Conv_0": conv(i, o), "GroupNorm_1": gn(o), "Conv_1": conv(o, o)}
        if i != o:
            r["Conv_2"] = conv(i, o, 1)
        return r

    widths = [channels * m for m in mult]
    n = len(widths)
    enc = {"Conv_0": conv(3, channels)}
    c = channels
    for i in range(n):
        blk = {}
        for j in range(blocks):
            blk[f"ResnetBlock_{j}"] = resnet(c, widths[i])
            c = widths[i]
        if i != n - 1:
            blk["Downsample_0"] = {"Conv_0": conv(c, c)}
        enc[f"DownsamplingBlock_{i}"] = blk
    enc["MidBlock_0"] = {"ResnetBlock_0": resnet(c, c), "ResnetBlock_1": resnet(c, c)}
    enc["GroupNorm_0"] = gn(c)
    enc["Conv_1"] = conv(c, z)
    c = widths[-1]
    dec = {
        "Conv_0": conv(z, c),
        "MidBlock_0": {"ResnetBlock_0": resnet(c, c), "ResnetBlock_1": resnet(c, c)},
    }
    for k, level in enumerate(
        reversed(range(n))
    ):  # created deepest first: UpsamplingBlock_0 is level n-1
        blk = {}
        for j in range(blocks + 1):
            blk[f"ResnetBlock_{j}"] = resnet(c, widths[level])
            c = widths[level]
        if level != 0:
            blk["Upsample_0"] = {"Conv_0": conv(c, c)}
        dec[f"UpsamplingBlock_{k}"] = blk
    dec["GroupNorm_0"] = gn(c)
    dec["Conv_1"] = conv(c, 3)
    return {
        "encoder": enc,
        "decoder": dec,
        "quantize": {"embeddings": rng.standard_normal((codebook, z)).astype(np.float32)},
        "quant_conv": conv(z, z, 1),
        "post_quant_conv": conv(z, z, 1),
    }


def write_vqgan(path, params: dict, protocol: int = pickle.HIGHEST_PROTOCOL) -> None:
    with open(path, "wb") as f:
        pickle.dump(params, f, protocol=protocol)


def _t(a):
    return torch.from_numpy(np.asarray(a)).double()


def _conv(x, p, stride=1, pad=None):
    k = _t(p["kernel"]).permute(3, 2, 0, 1)
    if pad is None:
        pad = k.shape[-1] // 2  # flax 'SAME' for odd kernels at stride 1
    return F.conv2d(x, k, _t(p["bias"]), stride=stride, padding=pad)


def _gn(x, p):
    return F.group_norm(x, 32, _t(p["scale"]), _t(p["bias"]), eps=1e-6)


def _res(x, p):
    h = _conv(F.silu(_gn(x, p["GroupNorm_0"])), p["Conv_0"])
    h = _conv(F.silu(_gn(h, p["GroupNorm_1"])), p["Conv_1"])
    return h + (_conv(x, p["Conv_2"]) if "Conv_2" in p else x)


def vqgan_encode(params: dict, pixels: torch.Tensor) -> torch.Tensor:
    """LWM's VQGANModel.encode: pixels (N, 3, H, W) in [-1, 1] -> codes (N, h, w), float64."""
    e = params["encoder"]
    x = _conv(pixels.double(), e["Conv_0"])
    levels = len([k for k in e if k.startswith("DownsamplingBlock_")])
    for i in range(levels):
        blk = e[f"DownsamplingBlock_{i}"]
        for j in range(len([k for k in blk if k.startswith("ResnetBlock_")])):
            x = _res(x, blk[f"ResnetBlock_{j}"])
        if "Downsample_0" in blk:  # pad right/bottom by one, stride-2 VALID conv
            x = _conv(F.pad(x, (0, 1, 0, 1)), blk["Downsample_0"]["Conv_0"], stride=2, pad=0)
    x = _res(_res(x, e["MidBlock_0"]["ResnetBlock_0"]), e["MidBlock_0"]["ResnetBlock_1"])
    x = _conv(F.silu(_gn(x, e["GroupNorm_0"])), e["Conv_1"])
    x = _conv(x, params["quant_conv"], pad=0)
    emb = _t(params["quantize"]["embeddings"])
    z = x.permute(0, 2, 3, 1).reshape(-1, emb.shape[1])
    d = (z**2).sum(1, keepdim=True) + (emb.T**2).sum(0, keepdim=True) - 2 * z @ emb.T
    return d.argmin(1).reshape(x.shape[0], x.shape[2], x.shape[3])


def vqgan_decode(params: dict, codes: torch.Tensor) -> torch.Tensor:
    """LWM's VQGANModel.decode of codes (N, h, w): pixels (N, 3, H, W) clipped to [-1, 1], float64."""
    emb = _t(params["quantize"]["embeddings"])
    x = emb[codes].permute(0, 3, 1, 2)
    x = _conv(x, params["post_quant_conv"], pad=0)
    d = params["decoder"]
    x = _conv(x, d["Conv_0"])
    x = _res(_res(x, d["MidBlock_0"]["ResnetBlock_0"]), d["MidBlock_0"]["ResnetBlock_1"])
    for k in range(len([k for k in d if k.startswith("UpsamplingBlock_")])):
        blk = d[f"UpsamplingBlock_{k}"]
        for j in range(len([k for k in blk if k.startswith("ResnetBlock_")])):
            x = _res(x, blk[f"ResnetBlock_{j}"])
        if "Upsample_0" in blk:
            x = _conv(F.interpolate(x, scale_factor=2, mode="nearest"), blk["Upsample_0"]["Conv_0"])
    x = _conv(F.silu(_gn(x, d["GroupNorm_0"])), d["Conv_1"])
    return x.clamp(-1, 1)


# ----------------------------------------------------------------------------- tokenizer and prompt

TOKENIZER_TEXTS = [
    "You are a helpful assistant. USER: What colour was the flash frame?\n",
    "<vision> </vision> ASSISTANT: red green blue yellow the a an of",
    "What shape came first? square circle triangle\n",
    "Question: Answer: it was\n",
] * 4


def lwm_tokenizer(vocab_size: int = 260, texts: list[str] | None = None):
    """A small BPE tokenizer with LLaMA's (LWM's) behaviour: a "▁" prepended to each encoded string
    and spaces as "▁" (transformers 4.x's LLaMA normalizer), BOS added by `encode`, `<s>` special.
    texts: what it is trained on (default TOKENIZER_TEXTS)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(TOKENIZER_TEXTS if texts is None else texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def lwm_prompt(hf_tokenizer, codes: np.ndarray, question: str, eof: int = 8192, eov: int = 8193):
    """LWM's vision_chat.py construct_input for one prompt (without its left padding):
    (LWM ids, vision mask). codes: (frames, h, w) VQ codes."""
    vision = []
    for t in range(len(codes)):
        vision.extend(codes[t].reshape(-1).tolist())
        vision.append(eov if t == len(codes) - 1 else eof)
    text_1 = hf_tokenizer.encode(f"<s>You are a helpful assistant. USER: {question}\n")
    start, end = hf_tokenizer.encode("<vision>"), hf_tokenizer.encode("</vision>")
    tail = hf_tokenizer.encode(" ASSISTANT:")
    tokens = text_1 + start + vision + end + tail
    mask = (
        [False] * (len(text_1) + len(start))
        + [True] * len(vision)
        + [False] * (len(end) + len(tail))
    )
    return np.asarray(tokens), np.asarray(mask)


def write_params_streaming(
    path,
    shapes: dict[str, tuple[int, ...]],
    *,
    dtype: str = "float32",
    seed: int = 0,
    chunk_bytes: int | None = None,
) -> int:
    """A tux checkpoint of random arrays with the given names and shapes, generated one at a time
    (so the writer never holds more than one); returns the file's size in bytes."""
    rng = np.random.default_rng(seed)
    packer = msgpack.Packer()
    with open(path, "wb") as f:
        for name, shape in shapes.items():
            arr = rng.standard_normal(shape, dtype=np.float32)
            f.write(packer.pack((name.split("/"), flax_to_bytes(arr, dtype, chunk_bytes))))
            del arr
        return f.tell()


def lm_shapes(
    *, v_text: int, v_vision: int, dim: int, layers: int, ffn: int
) -> dict[str, tuple[int, ...]]:
    """Names and shapes of an LWM-Chat params file in the scan_decoder layout."""
    s = {
        "transformer/wte/embedding": (v_text, dim),
        "transformer/vte/embedding": (v_vision, dim),
        "transformer/ln_f/kernel": (dim,),
        "lm_head/kernel": (dim, v_text),
        "vision_head/kernel": (dim, v_vision),
    }
    per = {
        "attention/wq/kernel": (dim, dim),
        "attention/wk/kernel": (dim, dim),
        "attention/wv/kernel": (dim, dim),
        "attention/wo/kernel": (dim, dim),
        "feed_forward/w1/kernel": (dim, ffn),
        "feed_forward/w2/kernel": (ffn, dim),
        "feed_forward/w3/kernel": (dim, ffn),
        "attention_norm/kernel": (dim,),
        "ffn_norm/kernel": (dim,),
    }
    for k, shape in per.items():
        s[f"transformer/h/scan_decoder/{k}"] = (layers, *shape)
    return s
