"""Real-photograph test videos (material.photo_videos): determinism, shapes, split, files, errors."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from material import photo_videos as rv
from material.photo_videos import (
    HELDOUT_SCENES,
    Camera,
    PhotosNotFoundError,
    find_photos,
    load_photo,
    pan_zoom_video,
    real_videos,
    split_scenes,
    write_real_videos,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("skimage") is None,
    reason="scikit-image (the photographs) is not installed",
)


def test_photos_are_found_and_read():
    found = find_photos()
    assert len(found) >= 10
    assert len(found["motorcycle"]) == 2  # the stereo pair is one scene
    img = load_photo(found["astronaut"][0])
    assert img.dtype == np.uint8 and img.shape == (512, 512, 3)
    grey = load_photo(found["camera"][0])  # greyscale photographs come as RGB
    assert grey.shape[2] == 3 and np.array_equal(grey[..., 0], grey[..., 2])


def test_videos_are_deterministic_and_shaped():
    a = real_videos(
        scenes=["astronaut", "coffee"], videos_per_scene=2, num_frames=6, size=32, seed=7
    )
    b = real_videos(
        scenes=["astronaut", "coffee"], videos_per_scene=2, num_frames=6, size=32, seed=7
    )
    c = real_videos(
        scenes=["astronaut", "coffee"], videos_per_scene=2, num_frames=6, size=32, seed=8
    )
    assert len(a) == 4
    for x, y, z in zip(a, b, c):
        assert x.shape == (6, 32, 32, 3) and x.dtype == np.uint8
        assert np.array_equal(x, y)
        assert not np.array_equal(x, z)
    assert not np.array_equal(a[0], a[1])  # two camera paths over one photograph differ
    big = real_videos(scenes=["rocket"], videos_per_scene=1, num_frames=2, size=96)[0]
    assert big.shape == (2, 96, 96, 3)


def test_camera_moves_smoothly():
    v = real_videos(scenes=["astronaut"], videos_per_scene=1, num_frames=24, size=48, seed=1)[
        0
    ].astype(float)
    step = np.abs(np.diff(v, axis=0)).mean(
        axis=(1, 2, 3)
    )  # mean change between neighbouring frames
    far = np.abs(v[-1] - v[0]).mean()
    assert step.min() > 0.2, "the camera should move"
    assert step.max() < far, "neighbouring frames should be closer than the ends of the clip"
    assert v.std() > 30  # real texture and contrast, not a flat field


def test_heldout_split_is_by_photograph():
    train, held = split_scenes()
    assert set(held) == set(HELDOUT_SCENES) and not set(train) & set(held)
    t = real_videos("train", videos_per_scene=1, num_frames=1, size=16)
    h = real_videos("heldout", videos_per_scene=1, num_frames=1, size=16)
    assert len(t) == len(train) and len(h) == len(held)
    # a different held-out choice moves whole scenes, the stereo pair included
    train2, held2 = split_scenes(heldout=("motorcycle",))
    assert held2 == ["motorcycle"] and "motorcycle" not in train2


def test_errors_name_what_to_install(monkeypatch):
    monkeypatch.setattr(rv, "_package_dirs", lambda package: [])
    with pytest.raises(PhotosNotFoundError, match="pip install scikit-image"):
        find_photos()
    with pytest.raises(PhotosNotFoundError, match="scikit-image"):
        real_videos("train", num_frames=2, size=16)
    with pytest.raises(ValueError, match="unknown scene"):
        real_videos(scenes=["nope"])
    with pytest.raises(ValueError, match="split"):
        real_videos("validation")
    with pytest.raises(ValueError, match="zoom"):
        Camera(zoom=(0.5, 1.5))
    with pytest.raises(ValueError, match="uint8"):
        pan_zoom_video(np.zeros((8, 8), np.float32), 2)


@pytest.mark.parametrize("fmt", ["mp4", "webm"])
def test_written_files_are_real_encodes(tmp_path, fmt):
    from longvideo.data.video import read_video

    paths = write_real_videos(
        tmp_path, scenes=["coffee"], videos_per_scene=2, num_frames=8, size=32, fmt=fmt, fps=8
    )
    assert [p.name for p in paths] == [f"coffee_0.{fmt}", f"coffee_1.{fmt}"]
    clip = read_video(paths[0], fps=None)
    src = real_videos(scenes=["coffee"], videos_per_scene=1, num_frames=8, size=32)[0]
    assert tuple(clip.frames.shape) == (8, 32, 32, 3)
    err = np.abs(clip.frames.numpy().astype(float) - src.astype(float)).mean()
    assert 0 < err < 12, err  # lossy (yuv420p), but the same pictures
