"""Serving: KV-cache generation with chunked prefill, sequence-parallel prefill and decoding, chat
about a video, and the evaluations (QA accuracy, text and video needle in a haystack).

    from longvideo.infer import answer, ChatSession, generate
    answer("exported_dir", "clip.mp4", "What colour was the flash frame?")

See docs/inference.md. Names load lazily (longvideo._lazy).
"""

from longvideo._lazy import lazy_exports

_EXPORTS = {
    "ChatSession": "chat",
    "ContextWarning": "chat",
    "EncodedVideo": "chat",
    "answer": "chat",
    "encode_video_file": "chat",
    "load_model": "chat",
    "InferConfig": "config",
    "evaluate_qa": "evals",
    "evaluate_text_needle": "evals",
    "evaluate_video_needle": "evals",
    "Engine": "generation",
    "Generation": "generation",
    "LocalEngine": "generation",
    "generate": "generation",
    "prefill": "generation",
    "sample_token": "generation",
    "MergedAttentionSeam": "sp",
    "SequenceParallelEngine": "sp",
    "sp_generate": "sp",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
