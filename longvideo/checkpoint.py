"""The checkpoint formats on disk, in one place: project checkpoints, training runs and exported
directories (docs/export.md, "The formats on disk"), all read by `load_pretrained`. Writes are
atomic; weights are read with safetensors only: ZeRO shards (train.save_weights=false) are torch
pickles, read only on request and with torch's weights-only unpickler (`consolidate_checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import math
import pickle
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from longvideo.atomic import atomic_open, write_bytes_atomic
from longvideo.config import Config, load_config, save_config
from longvideo.model import ModelConfig, Transformer
from longvideo.model.families import COMMON, check_family, hf_config, hf_name, own_name
from longvideo.parallel.engine import consolidate_zero_checkpoint
from longvideo.tokenizer import TextTokenizer
from longvideo.vq import VQModel, load_vq

CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded Hugging Face directory's
EXPORT_CONFIG = "longvideo.yaml"
TOKENIZER_DIR = "tokenizer"
VQ_DIR = "vq"
HF_DIR = "hf"
"""A `train.hf_model` checkpoint's weights: a transformers directory (config.yaml's model section
is its architecture, written by the trainer)."""
CHECKPOINTS = "checkpoints"
LATEST = "latest"

TIED_HEAD, TIED_TO = "head.weight", "tok_embeddings.weight"


class CheckpointError(ValueError):
    """A checkpoint does not match what the config (or the format) says it should hold."""


def untie(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The state dict as stored: a tied head is dropped (it is the embedding)."""
    return {k: v for k, v in sd.items() if not (cfg.tie_embeddings and k == TIED_HEAD)}


def tie(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The state dict the model loads: a tied head is the embedding tensor itself."""
    if cfg.tie_embeddings and TIED_TO in sd:
        sd = dict(sd)
        sd[TIED_HEAD] = sd[TIED_TO]
    return sd


def build_model(cfg: Config) -> Transformer:
    """The project decoder of `cfg` as a run uses it: its architecture (cfg.model), its runtime chunk
    sizes (cfg.runtime) and the block-attention backend (cfg.parallel.backend). A model its family
    cannot express (model.family) is a ConfigError here, before a run starts, not at export."""
    check_family(cfg.model)
    return Transformer(
        cfg.model,
        ffn_chunk=cfg.runtime.ffn_chunk,
        loss_chunk=cfg.runtime.loss_chunk,
        backend=cfg.parallel.backend,
    )


def check_shapes(sd: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> None:
    """Every tensor the config expects, with its shape, and nothing else; else CheckpointError."""
    with torch.device("meta"):  # shapes without memory
        expected = Transformer(cfg).state_dict()
    missing = sorted(set(expected) - set(sd))
    if missing:
        raise CheckpointError(
            f"{source}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    extra = sorted(set(sd) - set(expected))
    if extra:
        raise CheckpointError(f"{source}: unexpected tensors {extra[:5]}")
    for k, t in expected.items():
        if tuple(sd[k].shape) != tuple(t.shape):
            raise CheckpointError(
                f"{source}: tensor '{k}' has shape {tuple(sd[k].shape)}, "
                f"the config expects {tuple(t.shape)}"
            )


def write_weights(
    path: str | Path, sd: dict[str, torch.Tensor], metadata: dict | None = None
) -> None:
    """A safetensors file, atomically (contiguous CPU copies; no shared storage)."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in sd.items()}
    write_bytes_atomic(path, save(tensors, metadata=metadata))


SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class StreamingWeights:
    """A safetensors file written tensor by tensor: the header (every name, dtype and shape) first,
    then each tensor's bytes, whole or in pieces (`at` = flat element offset), in any order. Only
    the piece being written is in memory. `close` checks that every byte of every tensor was
    written exactly once."""

    def __init__(
        self,
        f: IO[bytes],
        specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ):
        self.f, self.specs = f, dict(specs)
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self.offsets: dict[str, int] = {}
        pos = 0
        # wider dtypes first, as safetensors lays files out: every tensor starts aligned to its item size
        for name, (dtype, shape) in sorted(self.specs.items(), key=lambda kv: -kv[1][0].itemsize):
            if dtype not in SAFETENSORS_DTYPES:
                raise CheckpointError(
                    f"tensor '{name}': dtype {dtype} cannot be stored in safetensors"
                )
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [pos, pos + nbytes],
            }
            self.offsets[name] = pos
            pos += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        self.base = 8 + len(raw)
        self.total = pos
        self.pieces: dict[str, list[tuple[int, int]]] = {name: [] for name in self.specs}

    def write(self, name: str, tensor: torch.Tensor, at: int = 0) -> None:
        """Write `tensor` (same dtype) as elements [at, at + numel) of tensor `name`, C order."""
        if name not in self.specs:
            raise CheckpointError(f"tensor '{name}' is not in the file's header")
        dtype, shape = self.specs[name]
        if tensor.dtype != dtype:
            raise CheckpointError(f"tensor '{name}' is {dtype} in the header, got {tensor.dtype}")
        n, size = tensor.numel(), math.prod(shape)
        if at < 0 or at + n > size:
            raise CheckpointError(f"tensor '{name}': elements [{at}, {at + n}) outside its {size}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self.f.seek(self.base + self.offsets[name] + at * dtype.itemsize)
        self.f.write(data)
        self.pieces[name].append((at, at + n))

    def close(self) -> None:
        for name, pieces in self.pieces.items():
            end = 0
            for a, b in sorted(pieces):
                if a != end:
                    what = "overlap" if a < end else "a gap"
                    raise CheckpointError(
                        f"tensor '{name}': its pieces leave {what} at element {min(a, end)}"
                    )
                end = b
            if end != (size := math.prod(self.specs[name][1])):
                raise CheckpointError(f"tensor '{name}': only {end} of {size} elements written")
        self.f.seek(self.base + self.total)
        self.f.truncate()


@contextlib.contextmanager
def streaming_weights(
    path: str | Path,
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    metadata: dict[str, str] | None = None,
) -> Iterator[StreamingWeights]:
    """Write a safetensors file atomically, tensor by tensor (see StreamingWeights)."""
    with atomic_open(path, "w+b") as f:
        w = StreamingWeights(f, specs, metadata)
        yield w
        w.close()


def save_project_checkpoint(
    out_dir: str | Path,
    state_dict: dict[str, torch.Tensor],
    cfg: Config,
    tokenizer: TextTokenizer | None = None,
    vq: VQModel | None = None,
    progress=None,
) -> Path:
    """Write config.yaml + model.safetensors (+ tokenizer/, vq/) into out_dir. progress: a tqdm
    bar (or None), advanced by each tensor's bytes as it is written (one at a time)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = untie(state_dict, cfg.model)
    if progress is None:
        write_weights(out / WEIGHTS_FILE, weights)
    else:
        specs = {k: (v.dtype, tuple(v.shape)) for k, v in weights.items()}
        with progress, streaming_weights(out / WEIGHTS_FILE, specs) as w:
            progress.reset(total=sum(v.numel() * v.element_size() for v in weights.values()))
            for k, v in weights.items():
                w.write(k, v)
                progress.update(v.numel() * v.element_size())
    save_config(cfg, out / CONFIG_FILE)
    if tokenizer is not None:
        tokenizer.save(out / TOKENIZER_DIR)
    if vq is not None:
        vq.save(out / VQ_DIR)
    return out


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names in RUN/checkpoints (or in a checkpoints dir); None if none."""
    run_dir = Path(run_dir)
    for ckpts in (run_dir / CHECKPOINTS, run_dir):
        pointer = ckpts / LATEST
        if pointer.is_file():
            name = pointer.read_text().strip()
            ckpt = ckpts / name
            if not ckpt.is_dir():
                raise FileNotFoundError(f"{pointer} names {name}, which does not exist")
            return ckpt
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a checkpoint dir, a run dir or a checkpoints dir."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    engine_files = any(path.glob("*model_states.pt"))
    weights = (path / WEIGHTS_FILE).is_file() or (path / HF_DIR / "config.json").is_file()
    if (path / CONFIG_FILE).is_file() and (weights or engine_files):
        return path
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise FileNotFoundError(
            f"{path} is neither a checkpoint ({CONFIG_FILE} + {WEIGHTS_FILE}, {HF_DIR}/ or "
            f"DeepSpeed shards) nor a run directory with {CHECKPOINTS}/{LATEST}"
        )
    return ckpt


class PickleRefusedError(CheckpointError):
    """A checkpoint's weights are only in torch pickles, and reading them was not allowed (or
    torch's weights-only unpickler refused them)."""


def _consolidate(ckpt: Path, trust_pickle: bool) -> dict[str, torch.Tensor]:
    try:
        return consolidate_zero_checkpoint(ckpt.parent, ckpt.name, trust_pickle=trust_pickle)
    except pickle.UnpicklingError as e:
        why = (str(e).strip().splitlines() or ["refused"])[0][:300]
        raise PickleRefusedError(
            f"{ckpt}: torch's weights-only unpickler refused its ZeRO shards ({why}). Nothing "
            "was run. Only if you wrote this run yourself: `longvideo consolidate --ckpt "
            f"{ckpt} --trust-pickle` reads them with the full unpickler and writes {WEIGHTS_FILE}"
        ) from None


def _zero_state(ckpt: Path, cfg: Config, trust_pickle: bool) -> dict[str, torch.Tensor]:
    """The model's state (own names, tied) from a checkpoint's ZeRO shards; a `train.hf_model`
    run's shards hold a transformers decoder's names behind "model." (hf.HFCausalLM)."""
    sd = _consolidate(ckpt, trust_pickle)
    if cfg.train.hf_model:
        prefix = "model."
        sd = {k.removeprefix(prefix): v for k, v in sd.items() if k.startswith(prefix)}
        return from_hf_names(sd, cfg.model)
    return tie(sd, cfg.model)


def load_project_state(
    path: str | Path, *, allow_pickle: bool = False
) -> tuple[dict[str, torch.Tensor], Config]:
    """(state dict with the model's own names, tied where the config ties, Config) of a project
    checkpoint, or of the latest checkpoint of a training run (a `train.hf_model` run's too: its
    `hf/` directory, under config.yaml's model section). Weights come from model.safetensors; a
    checkpoint that holds only DeepSpeed's ZeRO shards (torch pickles, train.save_weights=false) is
    refused unless ``allow_pickle``, and then read with torch's weights-only unpickler
    (docs/security.md, "Checkpoints")."""
    ckpt = resolve_checkpoint(path)
    cfg = load_config(ckpt / CONFIG_FILE)
    if (ckpt / HF_DIR / "config.json").is_file() and not (ckpt / WEIGHTS_FILE).is_file():
        return from_hf_names(read_safetensors_dir(ckpt / HF_DIR), cfg.model), cfg
    if (ckpt / WEIGHTS_FILE).is_file():
        sd = load_file(str(ckpt / WEIGHTS_FILE))
    elif not allow_pickle:
        raise PickleRefusedError(
            f"{ckpt} holds no {WEIGHTS_FILE}, only DeepSpeed's ZeRO shards: torch pickles, which "
            "can run code when read, so they are not read. Consolidate them once into "
            f"{WEIGHTS_FILE} with `longvideo consolidate --ckpt {ckpt}` (torch's weights-only "
            "unpickler: tensors only, nothing runs), or pass allow_pickle=True to read them so"
        )
    else:
        return _zero_state(ckpt, cfg, trust_pickle=False), cfg
    return tie(sd, cfg.model), cfg


def consolidate_checkpoint(path: str | Path, *, trust_pickle: bool = False) -> Path:
    """Write model.safetensors into a checkpoint (or a run's latest) that holds only DeepSpeed's
    ZeRO shards, consolidated to fp32 and read with torch's weights-only unpickler
    (``trust_pickle``: the full one, for runs you wrote). Returns the weights file; a checkpoint
    that has one already is left as it is."""
    ckpt = resolve_checkpoint(path)
    out = ckpt / WEIGHTS_FILE
    if out.is_file():
        return out
    cfg = load_config(ckpt / CONFIG_FILE)
    sd = _zero_state(ckpt, cfg, trust_pickle)
    check_shapes(sd, cfg.model, str(ckpt))
    write_weights(out, untie(sd, cfg.model))
    return out


def to_hf_names(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our names -> transformers' names (longvideo.model.families; a tied head is left out:
    transformers re-ties it)."""
    out = {}
    for name, t in untie(sd, cfg).items():
        try:
            out[hf_name(name)] = t
        except KeyError:
            raise CheckpointError(f"unexpected parameter '{name}'") from None
    return out


def from_hf_names(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' names -> ours (tied as the config says)."""
    out = {}
    for name, t in sd.items():
        try:
            own = own_name(name)
        except KeyError:
            raise CheckpointError(
                f"unexpected tensor '{name}' in the Hugging Face checkpoint"
            ) from None
        if own is not None:  # None: a rotary buffer some versions save; recomputed from the config
            out[own] = t
    if not cfg.tie_embeddings and TIED_HEAD not in out:
        raise CheckpointError(
            "the checkpoint has no lm_head.weight but tie_word_embeddings is false"
        )
    return tie(untie(out, cfg), cfg)


def read_safetensors_dir(path: Path, progress=None) -> dict[str, torch.Tensor]:
    """model.safetensors, or the shards listed in model.safetensors.index.json. progress: a tqdm
    bar (or None) advanced by each tensor's bytes."""
    single = path / WEIGHTS_FILE
    index = path / WEIGHTS_INDEX
    if single.is_file():
        files = [single]
    elif index.is_file():
        files = [
            path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))
        ]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"shard listed in {index} is missing: {f}")
    else:
        raise FileNotFoundError(f"no {WEIGHTS_FILE} (or {WEIGHTS_INDEX}) in {path}")
    if progress is None:
        sd = {}
        for f in files:
            sd.update(load_file(str(f)))
        return sd
    with progress:
        progress.reset(total=sum(f.stat().st_size for f in files))
        sd = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    sd[k] = st.get_tensor(k)
                    progress.update(sd[k].numel() * sd[k].element_size())
        return sd


EXPORT_KEYS = tuple(
    sorted(COMMON - {"architectures", "model_type", "rope_parameters", "rope_scaling"})
) + ("attn_logn_base",)
"""The config.json keys an exported directory's longvideo.yaml must agree with (those that change
what the model computes); a key config.json leaves out is not compared."""


def check_export_config(path: Path, cfg: Config) -> None:
    """An exported directory is read through its longvideo.yaml, transformers through its
    config.json: a value edited in one only would make the two run different models, so a
    disagreement is refused, naming the keys."""
    try:
        on_disk = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / 'config.json'}: not readable JSON ({e})") from None
    ours = json.loads(json.dumps(hf_config(cfg.model)))
    differ = [
        f"{k} (config.json {on_disk[k]!r}, {EXPORT_CONFIG} {ours.get(k)!r})"
        for k in EXPORT_KEYS
        if k in on_disk and on_disk[k] != ours.get(k)
    ]
    if differ:
        raise CheckpointError(
            f"{path}: config.json and {EXPORT_CONFIG} disagree on {', '.join(differ)}; this "
            f"project reads {EXPORT_CONFIG}, transformers config.json: edit both alike, or export "
            "again (docs/export.md)"
        )


@dataclass
class Pretrained:
    """A loaded model with what it needs to read videos and text."""

    model: Transformer
    config: Config
    tokenizer: TextTokenizer | None = None
    vq: VQModel | None = None
    path: Path | None = None


def load_pretrained(
    path: str | Path, device: str | torch.device = "cpu", *, allow_pickle: bool = False
) -> Pretrained:
    """Load a project checkpoint, a training run, or an exported Hugging Face directory (eval mode).
    Weights are read from safetensors only; ``allow_pickle``: see :func:`load_project_state`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model directory not found: {path}")
    if (path / EXPORT_CONFIG).is_file() and (
        path / "config.json"
    ).is_file():  # an exported directory
        cfg = load_config(path / EXPORT_CONFIG)
        check_export_config(path, cfg)
        sd = from_hf_names(read_safetensors_dir(path), cfg.model)
        tok_dir = path
    else:
        sd, cfg = load_project_state(path, allow_pickle=allow_pickle)
        tok_dir = path / TOKENIZER_DIR
    check_shapes(sd, cfg.model, str(path))
    model = build_model(cfg)
    model.load_state_dict(sd)
    model.to(device).eval()
    has_tokenizer = any((tok_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))
    tokenizer = TextTokenizer.from_dir(tok_dir, cfg.model.vocab_layout) if has_tokenizer else None
    vq = load_vq(path / VQ_DIR) if (path / VQ_DIR).is_dir() else None
    return Pretrained(model=model, config=cfg, tokenizer=tokenizer, vq=vq, path=path)
