"""Real test footage without downloads: camera moves over photographs shipped in Python packages.

    from material.photo_videos import real_videos, write_real_videos
    train = real_videos("train", size=64, num_frames=48)      # list of uint8 (48, 64, 64, 3)
    held = real_videos("heldout", size=64, num_frames=48)      # other photographs, never in "train"
    write_real_videos("data/real", "train", fmt="mp4")        # h264 files for `longvideo train-vq`

Moving-shapes videos (longvideo.data.synthetic) are flat colours on black; a tokenizer that does
well on them can still fail on camera footage. These videos are made from real photographs (the
sample images of scikit-image and matplotlib): a virtual camera pans over each photograph,
zooms in and out and rolls slightly along a smooth path, so the frames hold real textures,
colours, edges and noise, moving as under a hand-held camera.

* Photographs are found on disk through the packages' import specs (the packages are not
  imported) and read with PIL. scikit-image provides most of them (`pip install scikit-image`, a
  `dev` extra); without any, :class:`PhotosNotFoundError` says what to install.
* Splits are by photograph: ``HELDOUT_SCENES`` never appear in ``"train"``. The two motorcycle
  images are a stereo pair of one scene and stay together.
* Everything is a function of ``seed`` (and the scene's name): the same call gives the same frames.
"""

from __future__ import annotations

import importlib.util
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from longvideo.data.synthetic import write_mp4

# scene -> files (package, path inside the package); colour and greyscale natural photographs only
# (drawings, charts and synthetic test patterns of those packages are left out)
SCENES: dict[str, tuple[tuple[str, str], ...]] = {
    "astronaut": (("skimage", "data/astronaut.png"),),
    "chelsea": (("skimage", "data/chelsea.png"),),
    "coffee": (("skimage", "data/coffee.png"),),
    "rocket": (("skimage", "data/rocket.jpg"),),
    "motorcycle": (
        ("skimage", "data/motorcycle_left.png"),
        ("skimage", "data/motorcycle_right.png"),
    ),
    "hubble": (("skimage", "data/hubble_deep_field.jpg"),),
    "ihc": (("skimage", "data/ihc.png"),),
    "retina": (("skimage", "data/retina.jpg"),),
    "camera": (("skimage", "data/camera.png"),),
    "coins": (("skimage", "data/coins.png"),),
    "moon": (("skimage", "data/moon.png"),),
    "brick": (("skimage", "data/brick.png"),),
    "grass": (("skimage", "data/grass.png"),),
    "gravel": (("skimage", "data/gravel.png"),),
    "text": (("skimage", "data/text.png"),),
    "grace_hopper": (("matplotlib", "mpl-data/sample_data/grace_hopper.jpg"),),
}
HELDOUT_SCENES: tuple[str, ...] = ("chelsea", "coffee", "grace_hopper")
"""Held-out photographs: a cat's face, a cup on a table, a portrait in front of a flag."""
INSTALL_HINT = (
    "install scikit-image (`pip install scikit-image`, or the project's dev extra: "
    "`pip install -e '.[dev]'`); matplotlib's sample data adds one more photograph"
)


class PhotosNotFoundError(FileNotFoundError):
    """None of the photographs the videos are made from is installed."""


def _package_dirs(package: str) -> list[Path]:
    """The package's directories on disk, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])]


def find_photos(scenes: Sequence[str] | None = None) -> dict[str, list[Path]]:
    """Files of each scene that is installed: {scene: [path, ...]} in SCENES order.

    scenes: restrict to these names (unknown names raise ValueError). Raises PhotosNotFoundError
    when none of them is installed.
    """
    names = list(SCENES) if scenes is None else list(scenes)
    unknown = [n for n in names if n not in SCENES]
    if unknown:
        raise ValueError(f"unknown scene(s) {unknown}; known: {sorted(SCENES)}")
    dirs: dict[str, list[Path]] = {}
    found: dict[str, list[Path]] = {}
    for name in names:
        files = []
        for package, rel in SCENES[name]:
            if package not in dirs:
                dirs[package] = _package_dirs(package)
            for d in dirs[package]:
                if (d / rel).is_file():
                    files.append(d / rel)
                    break
        if files:
            found[name] = files
    if not found:
        raise PhotosNotFoundError(
            f"no photographs found for the real-video scenes {names}: {INSTALL_HINT}"
        )
    return found


def split_scenes(heldout: Sequence[str] = HELDOUT_SCENES) -> tuple[list[str], list[str]]:
    """(training scenes, held-out scenes) among those installed; held-out scenes never train."""
    found = find_photos()
    held = [s for s in found if s in set(heldout)]
    train = [s for s in found if s not in set(heldout)]
    if not train or not held:
        raise PhotosNotFoundError(
            f"need photographs on both sides of the split, found training scenes "
            f"{train} and held-out scenes {held}: {INSTALL_HINT}"
        )
    return train, held


def load_photo(path) -> np.ndarray:
    """A photograph as uint8 RGB (H, W, 3) (greyscale is repeated over the channels)."""
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()


@dataclass(frozen=True)
class Camera:
    """How the virtual camera moves. Sizes are fractions of the photograph's short side."""

    zoom: tuple[float, float] = (0.3, 0.8)
    """Range of the visible square's side (small = zoomed in)."""
    max_roll_deg: float = 4.0
    """Largest roll (rotation) either way, in degrees."""
    period_frames: tuple[float, float] = (48.0, 160.0)
    """Range of the periods of the path's oscillations, in frames (larger = slower)."""

    def __post_init__(self):
        lo, hi = self.zoom
        if not 0 < lo <= hi <= 0.9:
            raise ValueError(f"zoom must satisfy 0 < min <= max <= 0.9, got {self.zoom}")
        if not 0 <= self.max_roll_deg <= 10:
            raise ValueError(f"max_roll_deg must be in [0, 10], got {self.max_roll_deg}")
        if not 0 < self.period_frames[0] <= self.period_frames[1]:
            raise ValueError(
                f"period_frames must be positive and increasing, got {self.period_frames}"
            )


def camera_path(num_frames: int, rng: np.random.Generator, camera: Camera = Camera()) -> np.ndarray:
    """(T, 4) float64: per frame x, y in [0, 1] (where the view sits in its allowed range), zoom, roll (rad).

    Each parameter is the sum of two sinusoids of random period, phase and weight: smooth, with
    changes of direction and speed, different for every seed.
    """
    t = np.arange(num_frames, dtype=np.float64)
    out = np.empty((num_frames, 4))
    for k in range(4):
        periods = rng.uniform(*camera.period_frames, size=2)
        phases = rng.uniform(0, 2 * math.pi, size=2)
        weights = rng.uniform(0.3, 1.0, size=2)
        s = sum(w * np.sin(2 * math.pi * t / p + ph) for w, p, ph in zip(weights, periods, phases))
        out[:, k] = s / weights.sum()  # in [-1, 1]
    out[:, :2] = 0.5 + 0.5 * out[:, :2]
    lo, hi = camera.zoom
    out[:, 2] = lo + (hi - lo) * (0.5 + 0.5 * out[:, 2])
    out[:, 3] *= math.radians(camera.max_roll_deg)
    return out


def pan_zoom_video(
    photo: np.ndarray, num_frames: int, size: int = 64, *, seed: int = 0, camera: Camera = Camera()
) -> np.ndarray:
    """Frames a camera sees moving over `photo` (uint8 (H, W, 3)): uint8 (num_frames, size, size, 3).

    Each frame is the view's square region, rolled, resampled to size x size with an antialiased
    resize (no aliasing when zoomed out) followed by a bilinear rotation.
    """
    import torch
    import torch.nn.functional as F

    if num_frames < 1 or size < 2:
        raise ValueError(f"need num_frames >= 1 and size >= 2, got {num_frames}, {size}")
    if photo.dtype != np.uint8 or photo.ndim != 3 or photo.shape[2] != 3:
        raise ValueError(f"expected a uint8 (H, W, 3) photograph, got {photo.dtype} {photo.shape}")
    h, w = photo.shape[:2]
    short = min(h, w)
    path = camera_path(num_frames, np.random.default_rng(seed), camera)
    img = torch.from_numpy(photo).permute(2, 0, 1).float()[None]  # (1, 3, H, W)
    frames = np.empty((num_frames, size, size, 3), np.uint8)
    pix = torch.arange(size, dtype=torch.float64) + 0.5 - size / 2  # output pixel centres
    for i, (ux, uy, zoom, roll) in enumerate(path):
        side = zoom * short  # the view's side in photo pixels
        half = (
            side / 2 * (abs(math.cos(roll)) + abs(math.sin(roll)))
        )  # half-extent of the rolled view
        cx = half + ux * max(w - 2 * half, 0.0)
        cy = half + uy * max(h - 2 * half, 0.0)
        # crop a margin around the view, resize it to the output's scale, then rotate-sample
        x0, x1 = max(0, int(cx - half) - 2), min(w, int(math.ceil(cx + half)) + 2)
        y0, y1 = max(0, int(cy - half) - 2), min(h, int(math.ceil(cy + half)) + 2)
        scale = size / side
        rh, rw = max(2, round((y1 - y0) * scale)), max(2, round((x1 - x0) * scale))
        crop = F.interpolate(
            img[:, :, y0:y1, x0:x1],
            size=(rh, rw),
            mode="bilinear",
            antialias=True,
            align_corners=False,
        )
        sy, sx = rh / (y1 - y0), rw / (x1 - x0)  # the exact scales after rounding
        ccx, ccy = (cx - x0) * sx, (cy - y0) * sy
        c, s = math.cos(roll), math.sin(roll)
        v, u = torch.meshgrid(pix, pix, indexing="ij")
        x = ccx + (u * c - v * s) * sx / scale
        y = ccy + (u * s + v * c) * sy / scale
        grid = torch.stack([2 * x / rw - 1, 2 * y / rh - 1], -1)[None].float()
        out = F.grid_sample(crop, grid, mode="bilinear", padding_mode="border", align_corners=False)
        frames[i] = out[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()
    return frames


def _scene_seed(seed: int, scene: str, index: int) -> list[int]:
    return [seed, zlib.crc32(scene.encode()), index]


def real_videos(
    split: str = "train",
    *,
    videos_per_scene: int = 2,
    num_frames: int = 48,
    size: int = 64,
    seed: int = 0,
    camera: Camera = Camera(),
    scenes: Sequence[str] | None = None,
    heldout: Sequence[str] = HELDOUT_SCENES,
) -> list[np.ndarray]:
    """Videos over the photographs of `split` ("train", "heldout" or "all"): uint8 (T, size, size, 3) each.

    `videos_per_scene` camera paths per scene; a scene with several photographs (a stereo pair)
    spreads its videos over them. Scenes are in SCENES order, videos of one scene together.
    `scenes` overrides the split with explicit names.
    """
    if scenes is None:
        if split not in ("train", "heldout", "all"):
            raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
        train, held = split_scenes(heldout) if split != "all" else (list(find_photos()), [])
        scenes = {"train": train, "heldout": held, "all": train}[split]
    found = find_photos(scenes)
    missing = [s for s in scenes if s not in found]
    if missing:
        raise PhotosNotFoundError(
            f"photographs of scene(s) {missing} are not installed: {INSTALL_HINT}"
        )
    videos = []
    photos: dict[Path, np.ndarray] = {}
    for scene in scenes:
        files = found[scene]
        for i in range(videos_per_scene):
            f = files[i % len(files)]
            if f not in photos:
                photos[f] = load_photo(f)
            rng_seed = int(np.random.SeedSequence(_scene_seed(seed, scene, i)).generate_state(1)[0])
            videos.append(pan_zoom_video(photos[f], num_frames, size, seed=rng_seed, camera=camera))
    return videos


def write_real_videos(
    out_dir, split: str = "train", *, fmt: str = "mp4", fps: float = 8.0, crf: int = 18, **kwargs
) -> list[Path]:
    """Encode `real_videos(split, **kwargs)` as files in out_dir: `<scene>_<k>.mp4` (h264) or .webm (VP9).

    Returns the paths written. The files are real lossy encodes (yuv420p), as a camera's would be.
    """
    if fmt not in ("mp4", "webm"):
        raise ValueError(f"fmt must be 'mp4' or 'webm', got {fmt!r}")
    scenes = kwargs.pop("scenes", None)
    heldout = kwargs.get("heldout", HELDOUT_SCENES)
    if scenes is None:
        train, held = split_scenes(heldout) if split != "all" else (list(find_photos()), [])
        scenes = {"train": train, "heldout": held, "all": train}[split]
    per = kwargs.get("videos_per_scene", 2)
    videos = real_videos(split, scenes=scenes, **kwargs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    names = [f"{s}_{k}" for s in scenes for k in range(per)]
    for name, video in zip(names, videos):
        dst = out / f"{name}.{fmt}"
        if fmt == "mp4":
            write_mp4([video], fps=fps, dst=dst, crf=crf)
        else:
            _write_webm(video, fps, dst, crf)
        paths.append(dst)
    return paths


def _write_webm(video: np.ndarray, fps: float, dst: Path, crf: int) -> None:
    from fractions import Fraction

    import av

    h, w = video.shape[1:3]
    if h % 2 or w % 2:
        raise ValueError(f"yuv420p needs even frame sides, got {h}x{w}")
    with av.open(str(dst), mode="w", format="webm") as container:
        stream = container.add_stream("libvpx-vp9", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.thread_count = 1
        stream.options = {"crf": str(crf), "b": "0", "deadline": "realtime", "cpu-used": "8"}
        for img in video:
            for packet in stream.encode(
                av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
            ):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
