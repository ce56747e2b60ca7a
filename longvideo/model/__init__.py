"""The LLaMA-style decoder. Never imports torch.distributed or deepspeed."""

from longvideo._lazy import lazy_exports

_EXPORTS = {
    "AttentionFn": "attention",
    "LocalAttention": "attention",
    "local_attention": "attention",
    "KVCache": "cache",
    "ModelConfig": "config",
    "chunked_cross_entropy": "head",
    "token_weights": "head",
    "Transformer": "transformer",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
