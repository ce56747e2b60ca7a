"""The model a run trains, chosen in one place (`model_kind`): the project's decoder, or a
transformers decoder directory (`train.hf_model`, docs/hf.md). A kind builds the model, says the
config its checkpoints carry, and writes its weights into a checkpoint; the trainer, ZeRO and the
loss are the same for both."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from longvideo.checkpoint import (
    CONFIG_FILE,
    HF_DIR,
    CheckpointError,
    build_model,
    check_shapes,
    load_project_state,
    save_project_checkpoint,
)
from longvideo.config import Config, save_config
from longvideo.configtools import ConfigError
from longvideo.hf import HFCausalLM, RingAttentionUnsupported
from longvideo.model.families import FamilyError, model_config_from_hf
from longvideo.vq.quantizer import fsq_codebook


class ProjectDecoder:
    """longvideo.model.Transformer: built on the rank's device (a 7B model never sits in host memory
    once per rank), its weights from init_from, else its codes initialised as model.code_init says."""

    name = "longvideo"

    def build(self, cfg: Config, *, init_from: str | None, fresh: bool, log) -> nn.Module:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        with device:
            model = build_model(cfg)
        if init_from and fresh:
            sd, old = load_project_state(init_from)
            try:
                check_shapes(sd, cfg.model, str(init_from))
            except CheckpointError as e:
                raise ConfigError("train.init_from", f"does not fit this model: {e}") from None
            model.load_state_dict(sd, strict=True)
            rope = [
                f"{k} {getattr(old.model, k)} -> {getattr(cfg.model, k)}"
                for k in ("rope_theta", "rope_scaling", "max_seq_len", "family")
                if getattr(old.model, k) != getattr(cfg.model, k)
            ]
            log(
                f"initialised from {init_from} (its rope_theta {old.model.rope_theta:g}, now "
                f"{cfg.model.rope_theta:g}"
                + (f"; changed: {'; '.join(rope)}" if rope else "")
                + ")"
            )
        elif cfg.model.code_init == "fsq" and fresh:  # a resumed run loads its weights
            model.init_code_embeddings(fsq_codebook(cfg.vq.levels))
        return model

    def checkpoint_config(self, cfg: Config) -> Config:
        """The config the run's checkpoints carry: the run's own."""
        return cfg

    def save(self, ckpt: Path, weights: dict, cfg: Config, module: nn.Module) -> None:
        save_project_checkpoint(ckpt, weights, cfg)


class TransformersDecoder:
    """A transformers causal LM (Llama, Mistral, Qwen2, Qwen3) behind the project's training
    contract (longvideo.hf.HFCausalLM); checkpoints hold it as a transformers directory (`hf/`)
    under a config.yaml whose model section is that directory's architecture in the project's
    terms (longvideo.model.families), so every tool that reads a project checkpoint reads them."""

    name = "transformers"

    def __init__(self, path: str):
        self.path = path

    def checkpoint_config(self, cfg: Config) -> Config:
        """The run's config with the model section of the transformers directory: its family's
        architecture, the run's vocabulary layout and codebook, the text ids the rest (a model
        imported with `longvideo import-hf` and exported has exactly the run's vocabulary), and a
        context of at least data.seq_len. ConfigError naming train.hf_model where the project's
        decoder could not compute the model (then no tool could read its checkpoints)."""
        hf_cfg = json.loads((Path(self.path) / "config.json").read_text())
        rows = int(hf_cfg.get("vocab_size") or 0)
        non_text = cfg.model.vocab_size - cfg.model.text_vocab_size
        if rows <= non_text:
            raise ConfigError(
                "train.hf_model",
                f"{self.path} has {rows} ids, not more than the {non_text} vision tokens and "
                "codes of model.codebook_size: its checkpoints would hold no text ids",
            )
        try:
            mcfg = model_config_from_hf(
                hf_cfg,
                cfg.model,
                text_vocab_size=rows - non_text,
                codebook_size=cfg.model.codebook_size,
            )
        except (FamilyError, ConfigError) as e:
            raise ConfigError("train.hf_model", f"{self.path}: {e}") from None
        if cfg.data.seq_len > mcfg.max_seq_len and mcfg.rope_scaling.type != "dynamic":
            mcfg = replace(mcfg, max_seq_len=cfg.data.seq_len)
        return replace(cfg, model=mcfg)

    def build(self, cfg: Config, *, init_from: str | None, fresh: bool, log) -> nn.Module:
        if not Path(self.path).is_dir():
            raise ConfigError("train.hf_model", f"not a directory: {self.path}")
        if init_from:
            raise ConfigError(
                "train.init_from", "with train.hf_model the run starts from that model's weights"
            )
        self.checkpoint_config(cfg)  # a model no tool could read is refused before it loads
        try:
            model = HFCausalLM.from_pretrained(
                self.path, seq_len=cfg.data.seq_len, loss_chunk=cfg.runtime.loss_chunk
            )
        except RingAttentionUnsupported as e:
            raise ConfigError("train.hf_model", str(e)) from None
        tc = cfg.train
        shards = tc.data_source == "shards" or (tc.data_source == "auto" and cfg.data.train_shards)
        need = cfg.model.vocab_size if shards else (tc.synthetic_vocab or cfg.model.text_vocab_size)
        if model.vocab_size < need:
            raise ConfigError(
                "train.hf_model",
                f"{self.path} predicts {model.vocab_size} ids, but the data uses "
                f"{need} (text, the vision tokens and the VQ codes): extend its "
                "vocabulary with `longvideo import-hf` and train the project "
                "checkpoint instead",
            )
        return model

    def save(self, ckpt: Path, weights: dict, cfg: Config, module: nn.Module) -> None:
        module.save_hf(ckpt / HF_DIR, weights)
        save_config(cfg, ckpt / CONFIG_FILE)


def model_kind(cfg: Config):
    """The kind of model `cfg` trains: the one place the choice is made."""
    return TransformersDecoder(cfg.train.hf_model) if cfg.train.hf_model else ProjectDecoder()
