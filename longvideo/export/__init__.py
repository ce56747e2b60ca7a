"""Hugging Face interoperability: import, export, and loading any checkpoint for inference."""

from longvideo.export.hf import (
    CheckpointError,
    Pretrained,
    export_hf,
    import_hf,
    load_pretrained,
    load_project_state,
    save_project_checkpoint,
)
from longvideo.export.processor import LongVideoProcessor

__all__ = ["CheckpointError", "LongVideoProcessor", "Pretrained", "export_hf", "import_hf", "load_pretrained", "load_project_state",
           "save_project_checkpoint"]
