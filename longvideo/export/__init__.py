"""Hugging Face interoperability: `import-hf`, `export`, and the processor of exported models. The
checkpoint formats themselves live in longvideo.checkpoint (also `load_pretrained`). docs/export.md.
"""

from longvideo._lazy import lazy_exports

_MODULES = {
    "hf": ("export_hf", "import_hf"),
    "processor": ("LongVideoProcessor", "ProcessorSettings"),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
