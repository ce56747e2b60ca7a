"""Plain clips of moving shapes for the tests that need pixels but no dataset sample (VQ models,
tokenize's memory): the synthetic dataset's shapes, without its scenes, captions or needle."""

from __future__ import annotations

import numpy as np

from longvideo.data.synthetic import COLOURS, _shape_mask, random_shape


def moving_shapes_video(num_frames: int, size: int = 64, seed: int = 0) -> np.ndarray:
    """A clip of two random shapes (deterministic in ``seed``) bouncing on black: uint8
    (num_frames, size, size, 3); the later shape is drawn over the earlier one."""
    if num_frames <= 0 or size <= 0:
        raise ValueError(f"num_frames and size must be positive, got {num_frames}, {size}")
    rng = np.random.default_rng(seed)
    t = np.arange(num_frames, dtype=np.float64)
    out = np.zeros((num_frames, size, size, 3), np.uint8)
    for shape in [random_shape(rng, size) for _ in range(2)]:
        out[_shape_mask(shape, *shape.centre(t, size), size)] = np.asarray(
            COLOURS[shape.colour], np.uint8
        )
    return out
