"""The model a run trains, chosen in one place (`model_kind`): the project's decoder, or a
transformers decoder directory (`train.hf_model`, docs/hf.md). A kind builds the model and writes
its weights into a checkpoint; the trainer, ZeRO and the loss are the same for both."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from longvideo.checkpoint import (
    CONFIG_FILE,
    CheckpointError,
    build_model,
    check_shapes,
    load_project_state,
    save_project_checkpoint,
)
from longvideo.config import Config, save_config
from longvideo.configtools import ConfigError
from longvideo.hf import HFCausalLM, RingAttentionUnsupported
from longvideo.vq.quantizer import fsq_codebook

HF_DIR = "hf"
"""A transformers kind's weights in a checkpoint: a transformers directory of this name."""


class ProjectDecoder:
    """longvideo.model.Transformer: built on the rank's device (a 7B model never sits in host memory
    once per rank), its weights from init_from, else its codes initialised as model.code_init says."""

    name = "longvideo"

    def build(self, cfg: Config, *, init_from: Optional[str], fresh: bool, log) -> nn.Module:
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
            log(
                f"initialised from {init_from} (its rope_theta {old.model.rope_theta:g}, now "
                f"{cfg.model.rope_theta:g})"
            )
        elif cfg.model.code_init == "fsq" and fresh:  # a resumed run loads its weights
            model.init_code_embeddings(fsq_codebook(cfg.vq.levels))
        return model

    def save(self, ckpt: Path, weights: dict, cfg: Config, module: nn.Module) -> None:
        save_project_checkpoint(ckpt, weights, cfg)


class TransformersDecoder:
    """A transformers causal LM (Llama, Mistral, Qwen2) behind the project's training contract
    (longvideo.hf.HFCausalLM); checkpoints hold it as a transformers directory."""

    name = "transformers"

    def __init__(self, path: str):
        self.path = path

    def build(self, cfg: Config, *, init_from: Optional[str], fresh: bool, log) -> nn.Module:
        if not Path(self.path).is_dir():
            raise ConfigError("train.hf_model", f"not a directory: {self.path}")
        if init_from:
            raise ConfigError(
                "train.init_from", "with train.hf_model the run starts from that model's weights"
            )
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
