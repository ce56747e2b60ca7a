"""Training: the DeepSpeed trainer over the dp x sp mesh, checkpoints, schedule and logging.

    from longvideo.train import train, load_model_state
    result = train(cfg, resume=True)                 # one rank of a torchrun/deepspeed/accelerate world
    state_dict, cfg = load_model_state("runs/x")     # fp32 weights of the latest checkpoint

See docs/training.md. Attributes load lazily: `longvideo.config` imports this package's config
module, and the trainer imports `longvideo.config`.
"""

from longvideo.train.config import TrainConfig

_LAZY = {
    "train": "longvideo.train.trainer",
    "Trainer": "longvideo.train.trainer",
    "TrainResult": "longvideo.train.trainer",
    "TrainingError": "longvideo.train.trainer",
    "LossDiverged": "longvideo.train.trainer",
    "load_model_state": "longvideo.train.checkpoint",
    "latest_checkpoint": "longvideo.train.checkpoint",
    "lr_at": "longvideo.train.schedule",
    "build_deepspeed_config": "longvideo.train.deepspeed_config",
    "SyntheticTokens": "longvideo.train.synthetic",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'longvideo.train' has no attribute '{name}'")


__all__ = ["TrainConfig", *_LAZY]
