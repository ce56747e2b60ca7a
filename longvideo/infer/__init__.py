"""Serving: KV-cache generation with chunked prefill, sequence-parallel prefill and decoding, chat
about a video, and the evaluations (QA accuracy, text and video needle in a haystack).

    from longvideo.infer import answer, ChatSession, generate
    answer("exported_dir", "clip.mp4", "What colour was the flash frame?")

See docs/inference.md.
"""

from longvideo.infer.chat import (ChatSession, ContextWarning, EncodedVideo, answer, encode_video_file,
                                  load_model)
from longvideo.infer.config import InferConfig
from longvideo.infer.engine import Engine, LocalEngine
from longvideo.infer.evals import evaluate_qa, evaluate_text_needle, evaluate_video_needle
from longvideo.infer.generate import Generation, generate, prefill, sample_token
from longvideo.infer.sp import SequenceParallelEngine, merge_partials, sp_generate

__all__ = [
    "ChatSession",
    "ContextWarning",
    "EncodedVideo",
    "Engine",
    "Generation",
    "InferConfig",
    "LocalEngine",
    "SequenceParallelEngine",
    "answer",
    "encode_video_file",
    "evaluate_qa",
    "evaluate_text_needle",
    "evaluate_video_needle",
    "generate",
    "load_model",
    "merge_partials",
    "prefill",
    "sample_token",
    "sp_generate",
]
