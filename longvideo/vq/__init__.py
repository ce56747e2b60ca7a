"""The VQ video tokenizer: frames -> integer codes -> frames (docs/vq.md: the 2d and causal3d modes,
the Python API). Its trainer is `longvideo.train.vq`; `LWMVQGAN` runs LWM's released VQGAN
(diffusers' VQModel) behind the same interface (docs/lwm.md)."""

from longvideo._lazy import lazy_exports

_EXPORTS = {
    "VQConfig": "config",
    "load_vq_config": "config",
    "VQModel": "model",
    "load_vq": "model",
    "build_vq": "model",
    "LWMVQGAN": "vqgan",
    "encode_video": "codec",
    "decode_codes": "codec",
    "iter_decode": "codec",
    "codebook_usage": "quantizer",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
