"""Training: the DeepSpeed trainer over the dp x sp mesh (docs/training.md) and the VQ video
tokenizer's trainer (docs/vq.md). Names load lazily (longvideo._lazy).

    result = train(cfg, resume=True)        # one rank of a torchrun/deepspeed/accelerate world
    vq_result = train_vq(vq_cfg, "videos/", "runs/vq", time_budget_s=600)
"""

from longvideo._lazy import lazy_exports

_EXPORTS = {"TrainConfig": "config", "train": "trainer", "Trainer": "trainer", "TrainResult": "trainer",
            "TrainingError": "trainer", "LossDiverged": "trainer", "lr_at": "schedule",
            "SyntheticTokens": "synthetic_tokens", "train_vq": "vq", "VQTrainResult": "vq:TrainResult"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
