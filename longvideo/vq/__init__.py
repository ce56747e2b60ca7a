"""The VQ video tokenizer: frames -> integer codes -> frames.

    from longvideo.vq import VQConfig, VQModel, load_vq, encode_video, decode_codes, train_vq

2d mode codes each frame alone (LWM's layout); causal3d mode codes frame 0 alone and then groups
of t frames with causal temporal convolutions. See docs/vq.md.
"""

from longvideo.vq.codec import decode_codes, encode_video, iter_decode
from longvideo.vq.config import VQConfig
from longvideo.vq.model import VQModel, load_vq
from longvideo.vq.quantizer import codebook_usage
from longvideo.vq.train import TrainResult, train_vq


__all__ = ["VQConfig", "VQModel", "load_vq", "encode_video", "decode_codes", "iter_decode",
           "train_vq", "TrainResult", "codebook_usage"]
