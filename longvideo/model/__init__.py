"""The LLaMA-style decoder. Never imports torch.distributed or deepspeed."""

from longvideo._lazy import lazy_exports

_EXPORTS = {
    name: module
    for module, names in {
        "attention": ("AttentionFn", "LocalAttention"),
        "cache": ("KVCache",),
        "config": ("ModelConfig",),
        "head": ("chunked_cross_entropy", "token_weights"),
        "transformer": ("Transformer",),
    }.items()
    for name in names
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
