"""The LLaMA-style decoder. Never imports torch.distributed or deepspeed."""

from longvideo.model.attention import AttentionFn, local_attention
from longvideo.model.cache import KVCache
from longvideo.model.config import ModelConfig
from longvideo.model.head import chunked_cross_entropy
from longvideo.model.transformer import Transformer

__all__ = ["AttentionFn", "KVCache", "ModelConfig", "Transformer", "chunked_cross_entropy", "local_attention"]
