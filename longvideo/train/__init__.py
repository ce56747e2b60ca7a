"""Training: the DeepSpeed trainer over the dp x sp mesh (`train`, docs/training.md) and the VQ video
tokenizer's trainer (`train_vq`, docs/vq.md, "Training"). Names load lazily (longvideo._lazy)."""

from longvideo._lazy import lazy_exports

_EXPORTS = {
    "TrainConfig": "config",
    "train": "trainer",
    "Trainer": "trainer",
    "TrainResult": "trainer",
    "TrainingError": "trainer",
    "LossDiverged": "trainer",
    "lr_at": "schedule",
    "SyntheticTokens": "synthetic_tokens",
    "train_vq": "vq",
    "VQTrainResult": "vq:TrainResult",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
