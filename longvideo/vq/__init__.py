"""The VQ video tokenizer: frames -> integer codes -> frames.

    from longvideo.vq import VQConfig, VQModel, load_vq, encode_video, decode_codes

2d mode codes each frame alone (LWM's layout); causal3d mode codes frame 0 alone and then groups
of t frames with causal temporal convolutions. Its trainer is `longvideo.train.vq`. See docs/vq.md.
`LWMVQGAN` runs LWM's released VQGAN (diffusers' VQModel) behind the same interface (docs/lwm.md).
"""

from longvideo._lazy import lazy_exports

_EXPORTS = {"VQConfig": "config", "load_vq_config": "config", "VQModel": "model", "load_vq": "model",
            "build_vq": "model", "LWMVQGAN": "vqgan", "encode_video": "codec", "decode_codes": "codec",
            "iter_decode": "codec", "codebook_usage": "quantizer"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
