"""`longvideo import-lwm`: LWM's released JAX checkpoints (LWM-Chat-32K/128K/1M) as a project checkpoint.

`params` is a tux streaming checkpoint (longvideo.export.tux) of LWM's FlaxVideoLLaMAForCausalLM
(its arrays: TOP_PARAMS and LAYER_PARAMS, the layers per index or stacked under SCAN); `vqgan` a
pickle of flax arrays (longvideo.safepickle, longvideo.vq.vqgan). The arrays are streamed one at a
time into the `lwm` vocabulary layout: docs/lwm.md, "What the conversion does" and "Memory".
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from longvideo.atomic import atomic_dir
from longvideo.checkpoint import (
    CONFIG_FILE,
    TOKENIZER_DIR,
    VQ_DIR,
    WEIGHTS_FILE,
    CheckpointError,
    streaming_weights,
)
from longvideo.config import Config, load_config, save_config
from longvideo.export.tux import ArrayRecord, read_elements, scan_params
from longvideo.model import ModelConfig
from longvideo.safepickle import load_array_pickle
from longvideo.tokenizer import TextTokenizer
from longvideo.vq.vqgan import vqgan_from_flax

LAYER_PARAMS: dict[str, tuple[str, str]] = {  # LWM block parameter -> (ours, conversion)
    "attention/wq/kernel": ("attn.wq.weight", "rope"),
    "attention/wk/kernel": ("attn.wk.weight", "rope"),
    "attention/wv/kernel": ("attn.wv.weight", "dense"),
    "attention/wo/kernel": ("attn.wo.weight", "dense"),
    "feed_forward/w1/kernel": ("ffn.w_gate.weight", "dense"),
    "feed_forward/w3/kernel": ("ffn.w_up.weight", "dense"),
    "feed_forward/w2/kernel": ("ffn.w_down.weight", "dense"),
    "attention_norm/kernel": ("attn_norm.weight", "vector"),
    "ffn_norm/kernel": ("ffn_norm.weight", "vector"),
}
TOP_PARAMS = (
    "transformer/wte/embedding",
    "transformer/vte/embedding",
    "transformer/ln_f/kernel",
    "lm_head/kernel",
    "vision_head/kernel",
)
SCAN = "transformer/h/scan_decoder/"
LWM_HEADS = {256: 2, 1024: 8, 2048: 16, 3200: 32, 4096: 32, 5120: 40, 6656: 52, 8192: 64}
"""Attention heads of LWM's standard LLaMA configs (lwm/llama.py), by width."""
BLOCK_BYTES = 16 << 20
"""Bytes converted at once when an embedding or head table is copied in blocks."""


class LWMImportError(CheckpointError):
    """LWM's files do not hold what an LWM-Chat model needs; names the file and the array."""


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection (out, in): per head, LWM's pairs (2i, 2i+1) -> (i, i + D/2), the
    rotation of interleaved pairs onto half-against-half (docs/lwm.md, "Weights")."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)


@dataclasses.dataclass(frozen=True)
class LWMTree:
    """The arrays of an LWM params file by name, and how its layers are stored."""

    path: str
    arrays: dict[str, ArrayRecord]
    scan: bool
    n_layers: int

    def get(self, name: str) -> ArrayRecord:
        if name not in self.arrays:
            raise LWMImportError(
                f"{self.path}: no array '{name}' (an LWM-Chat params file holds "
                f"{', '.join(TOP_PARAMS)} and the LLaMA blocks)"
            )
        return self.arrays[name]

    def layer(self, param: str, i: int) -> tuple[ArrayRecord, int, tuple[int, ...]]:
        """(record, first element, shape) of layer i's `param` (a slice of a stacked array when scanned)."""
        if self.scan:
            rec = self.get(SCAN + param)
            per = rec.numel // rec.shape[0]
            return rec, i * per, tuple(rec.shape[1:])
        rec = self.get(f"transformer/h/{i}/{param}")
        return rec, 0, tuple(rec.shape)


def read_tree(path: str | Path) -> LWMTree:
    """Index an LWM params file and check that it holds exactly an LWM-Chat model's arrays."""
    records = scan_params(path)
    arrays: dict[str, ArrayRecord] = {}
    for rec in records:
        key = rec.key
        while key and key[0] == "params":  # a tree saved with its 'params' collection level
            key = key[1:]
        name = "/".join(key)
        if name in arrays:
            raise LWMImportError(f"{path}: array '{name}' appears twice")
        arrays[name] = rec
    scan = any(n.startswith(SCAN) for n in arrays)
    if scan:
        if any(re.match(r"transformer/h/\d+/", n) for n in arrays):
            raise LWMImportError(f"{path}: holds both stacked (scan_decoder) and per-layer blocks")
        norm = arrays.get(SCAN + "attention_norm/kernel")
        if norm is None or len(norm.shape) != 2:
            raise LWMImportError(f"{path}: no stacked '{SCAN}attention_norm/kernel' (layers, dim)")
        n_layers = norm.shape[0]
        expected = set(TOP_PARAMS) | {SCAN + p for p in LAYER_PARAMS}
    else:
        found = sorted(
            {int(m.group(1)) for n in arrays for m in [re.match(r"transformer/h/(\d+)/", n)] if m}
        )
        if not found or found != list(range(len(found))):
            raise LWMImportError(f"{path}: decoder layers {found[:8]} are not 0..n-1")
        n_layers = len(found)
        expected = set(TOP_PARAMS) | {f"transformer/h/{i}/{p}" for i in found for p in LAYER_PARAMS}
    missing, extra = sorted(expected - set(arrays)), sorted(set(arrays) - expected)
    if missing:
        raise LWMImportError(
            f"{path}: missing arrays {missing[:5]} (tied or other heads are not supported)"
        )
    if extra:
        raise LWMImportError(f"{path}: unexpected arrays {extra[:5]}")
    if scan:
        for p in LAYER_PARAMS:
            rec = arrays[SCAN + p]
            if not rec.shape or rec.shape[0] != n_layers:
                raise LWMImportError(
                    f"{path}: stacked '{SCAN + p}' has shape {rec.shape}; the layer axis "
                    f"must come first (param_scan_axis=0) with {n_layers} layers"
                )
    return LWMTree(str(path), arrays, scan, n_layers)


def model_config_from_tree(
    tree: LWMTree, base: ModelConfig, codebook_size: int, n_heads: int | None = None
) -> ModelConfig:
    """The ModelConfig of the arrays (widths, depth, vocabularies) on top of `base` (theta, context,
    epsilon). n_heads: given, else base's when its width matches, else LWM's standard value."""
    v_text, dim = tree.get("transformer/wte/embedding").shape
    v_vis, dim_v = tree.get("transformer/vte/embedding").shape
    _, _, q_shape = tree.layer("attention/wq/kernel", 0)
    _, _, k_shape = tree.layer("attention/wk/kernel", 0)
    _, _, f_shape = tree.layer("feed_forward/w1/kernel", 0)
    checks = {
        "transformer/vte/embedding": (tree.get("transformer/vte/embedding").shape, (v_vis, dim)),
        "lm_head/kernel": (tree.get("lm_head/kernel").shape, (dim, v_text)),
        "vision_head/kernel": (tree.get("vision_head/kernel").shape, (dim, v_vis)),
        "transformer/ln_f/kernel": (tree.get("transformer/ln_f/kernel").shape, (dim,)),
        "attention/wq/kernel": (q_shape, (dim, dim)),
    }
    for name, (got, want) in checks.items():
        if tuple(got) != want or dim_v != dim:
            raise LWMImportError(
                f"{tree.path}: '{name}' has shape {tuple(got)}, expected {want} "
                f"(text vocabulary {v_text}, vision vocabulary {v_vis}, width {dim})"
            )
    if n_heads is None and base.dim == dim:
        n_heads = base.n_heads
    elif n_heads is None:
        n_heads = LWM_HEADS.get(dim, dim // 128 if dim % 128 == 0 else 0)
    if not n_heads or dim % n_heads:
        raise LWMImportError(
            f"width {dim} is not one of LWM's standard configs; give the number of heads "
            f"(model.n_heads=...)"
        )
    head_dim = dim // n_heads
    if k_shape[1] % head_dim:
        raise LWMImportError(
            f"{tree.path}: wk has {k_shape[1]} outputs, not a multiple of head_dim {head_dim}"
        )
    if v_vis < codebook_size + 2:
        raise LWMImportError(
            f"{tree.path}: the vision vocabulary has {v_vis} ids, fewer than the VQGAN's "
            f"{codebook_size} codes + <eof> + <eov>"
        )
    return dataclasses.replace(
        base,
        vocab_layout="lwm",
        text_vocab_size=v_text,
        vision_vocab_size=v_vis,
        codebook_size=codebook_size,
        dim=dim,
        n_layers=tree.n_layers,
        n_heads=n_heads,
        n_kv_heads=k_shape[1] // head_dim,
        ffn_dim=f_shape[1],
        tie_embeddings=False,
    )


def _plan(tree: LWMTree, cfg: ModelConfig) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every output tensor with its dtype (its source's) and shape, in file order."""
    dt = {name: rec.torch_dtype for name, rec in tree.arrays.items()}
    specs = {
        "tok_embeddings.weight": (dt["transformer/wte/embedding"], (cfg.vocab_size, cfg.dim)),
        "norm.weight": (dt["transformer/ln_f/kernel"], (cfg.dim,)),
        "head.weight": (dt["lm_head/kernel"], (cfg.vocab_size, cfg.dim)),
    }
    for i in range(cfg.n_layers):
        for param, (ours, kind) in LAYER_PARAMS.items():
            rec, _, shape = tree.layer(param, i)
            specs[f"layers.{i}.{ours}"] = (
                rec.torch_dtype,
                shape if kind == "vector" else shape[::-1],
            )
    return specs


def _copy_table(
    f, w, rec: ArrayRecord, name: str, row0: int, dtype: torch.dtype, kernel: bool
) -> None:
    """An embedding table (rows, dim), or a head kernel (dim, rows) transposed, into rows row0.. of
    `name` (rows, dim), BLOCK_BYTES of rows at a time: a kernel's block is `dim` short reads of its
    columns, so the peak stays one block, never the whole array."""
    dim, rows = rec.shape if kernel else rec.shape[::-1]
    step = max(1, BLOCK_BYTES // max(1, dim * rec.itemsize))
    for r in range(0, rows, step):
        n = min(step, rows - r)
        if kernel:
            block = torch.stack(
                [read_elements(f, rec, d * rows + r, n) for d in range(dim)]
            ).t()  # (n, dim)
        else:
            block = read_elements(f, rec, r * dim, n * dim)
        w.write(name, block.contiguous().to(dtype), at=(row0 + r) * dim)


def _convert(kind: str, t: torch.Tensor, shape: tuple[int, ...], cfg: ModelConfig, param: str):
    if kind == "vector":
        return t.view(shape)
    w = t.view(shape).t()  # (in, out) -> (out, in)
    if kind == "rope":
        heads = cfg.n_heads if param.endswith("wq/kernel") else cfg.n_kv_heads
        w = interleaved_to_half(w, heads)
    return w.contiguous()


def write_weights(
    tree: LWMTree,
    cfg: ModelConfig,
    out_file: Path,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Stream the params file's arrays, converted, into `out_file` (safetensors, ours names)."""
    specs = _plan(tree, cfg)
    v_text = cfg.text_vocab_size
    with (
        streaming_weights(out_file, specs, metadata={"format": "pt", "source": "lwm"}) as w,
        open(tree.path, "rb") as f,
    ):
        for src, name, row0 in (
            ("transformer/wte/embedding", "tok_embeddings.weight", 0),
            ("transformer/vte/embedding", "tok_embeddings.weight", v_text),
            ("lm_head/kernel", "head.weight", 0),
            ("vision_head/kernel", "head.weight", v_text),
        ):
            _copy_table(
                f, w, tree.get(src), name, row0, specs[name][0], kernel=src.endswith("/kernel")
            )
        w.write("norm.weight", read_elements(f, tree.get("transformer/ln_f/kernel")))
        for i in range(cfg.n_layers):
            for param, (ours, kind) in LAYER_PARAMS.items():
                rec, start, shape = tree.layer(param, i)
                t = read_elements(f, rec, start, math.prod(shape))
                w.write(f"layers.{i}.{ours}", _convert(kind, t, shape, cfg, param))
            if progress:
                progress(f"layer {i + 1}/{cfg.n_layers}")


def import_lwm(
    params: str | Path,
    vqgan: str | Path,
    tokenizer: str | Path,
    out_dir: str | Path,
    config: str | Path = "lwm-chat-1m",
    overrides: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Convert LWM's `params` + `vqgan` + tokenizer into a project checkpoint at out_dir."""
    t0 = time.perf_counter()
    root = load_config(config, list(overrides))
    for p in (params, vqgan):
        if not Path(p).is_file():
            raise FileNotFoundError(f"not found: {p}")
    tok = TextTokenizer.from_dir(tokenizer, layout="lwm")  # the cheap checks first
    tree = read_tree(params)
    vq = vqgan_from_flax(load_array_pickle(vqgan), base=root.vq)
    explicit_heads = any(o.split("=", 1)[0].strip() == "model.n_heads" for o in overrides)
    n_heads = root.model.n_heads if explicit_heads else None
    mcfg = model_config_from_tree(tree, root.model, vq.cfg.codebook_size, n_heads)
    cfg: Config = dataclasses.replace(
        root, model=mcfg, vq=vq.cfg, data=dataclasses.replace(root.data, prompt_template="lwm")
    )
    if tok.text_size != mcfg.text_vocab_size:
        raise LWMImportError(
            f"the tokenizer in {tokenizer} has {tok.text_size} ids, LWM's text embedding "
            f"{mcfg.text_vocab_size} rows"
        )
    with atomic_dir(out_dir, marker=CONFIG_FILE) as out:  # moved in whole, config.yaml last
        write_weights(tree, mcfg, out / WEIGHTS_FILE, progress)
        tok.save(out / TOKENIZER_DIR)
        vq.save(out / VQ_DIR)
        save_config(cfg, out / CONFIG_FILE)  # a directory without it is not a checkpoint
    out = Path(out_dir)
    if progress:
        progress(f"done in {time.perf_counter() - t0:.1f} s")
    return out
