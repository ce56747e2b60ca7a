"""Hugging Face interoperability: `import-hf`, `export`, and the processor of exported models. The
checkpoint formats themselves live in longvideo.checkpoint (also `load_pretrained`). docs/export.md.
"""

from longvideo._lazy import lazy_exports

_EXPORTS = {
    "export_hf": "hf",
    "import_hf": "hf",
    "LongVideoProcessor": "processor",
    "ProcessorSettings": "processor",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
