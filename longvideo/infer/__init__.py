"""Serving: KV-cache generation with chunked prefill, sequence-parallel prefill and decoding, chat
about a video, text to video (docs/generation.md), and the evaluations. See docs/inference.md.
Names load lazily (longvideo._lazy).
"""

from longvideo._lazy import lazy_exports

_MODULES = {
    "chat": (
        "ChatSession",
        "ContextWarning",
        "EncodedVideo",
        "answer",
        "encode_video_file",
        "load_model",
    ),
    "config": ("InferConfig",),
    "evals": (
        "QASettings",
        "Runtime",
        "TextNeedleSettings",
        "VideoNeedleSettings",
        "evaluate_qa",
        "evaluate_text_needle",
        "evaluate_video_needle",
    ),
    "generation": ("Engine", "Generation", "LocalEngine", "generate", "prefill", "sample_token"),
    "sp": ("MergedAttentionSeam", "SequenceParallelEngine", "sp_generate"),
    "t2v": ("GeneratedVideo", "generate_video", "generate_videos"),
    "t2v_eval": ("evaluate_t2v",),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
