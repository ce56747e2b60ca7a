"""Video -> VQ codes: the one path that `tokenize`, chat, the processor and the evaluations take.

    vc = video_to_codes(vq, "talk.mp4", fps=1.0, max_frames=3600)
    vc.codes        # int64 (G, h, w): one code map per frame (2d) or per temporal group (causal3d)
    vc.timestamps   # float64 (G,): seconds of each group's first frame
    vc.num_frames   # frames read

The video is decoded by longvideo.data.video and streamed into the VQ `batch_frames` frames at a
time, so memory does not grow with the video's length; `vc.report` says what the read kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from longvideo.data.video import DEFAULT_MAX_RESOLUTION, ReadReport, VideoSource, iter_video
from longvideo.vq.codec import encode_video
from longvideo.vq.model import VQModel


@dataclass
class VideoCodes:
    """A video as VQ codes."""

    codes: np.ndarray  # int64 (G, h, w)
    timestamps: np.ndarray  # float64 (G,), seconds of each group's first frame
    num_frames: int  # frames read from the video
    report: ReadReport | None = None  # what the read kept (video_to_codes)


def frames_to_codes(
    vq: VQModel, chunks: Iterable[tuple[torch.Tensor, torch.Tensor]], *, batch_frames: int = 16
) -> VideoCodes:
    """Encode chunks of (frames uint8 (n, H, W, 3) at the tokenizer's resolution, times (n,) seconds)."""
    stamps: list[torch.Tensor] = []

    def frames() -> Iterator[torch.Tensor]:
        for chunk, times in chunks:
            stamps.append(torch.as_tensor(times))
            yield chunk

    with torch.no_grad():
        codes = encode_video(vq, frames(), batch_frames=batch_frames)
    times = torch.cat(stamps).double().numpy() if stamps else np.zeros(0)
    groups = vq.group_frame_index(len(times))
    codes = np.asarray(codes.cpu()).astype(np.int64)
    if codes.shape[0] != len(groups):
        raise RuntimeError(
            f"VQ returned {codes.shape[0]} code groups for {len(times)} frames, "
            f"expected {len(groups)}"
        )
    return VideoCodes(
        codes=codes,
        timestamps=np.asarray([times[g[0]] for g in groups], np.float64),
        num_frames=len(times),
    )


def video_to_codes(
    vq: VQModel,
    video: VideoSource,
    *,
    fps: float = 1.0,
    max_frames: int | None = None,
    max_resolution: int = DEFAULT_MAX_RESOLUTION,
    batch_frames: int = 16,
    backend: str = "auto",
    progress: bool = False,
    total_frames: int | None = None,
    on_frames: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> VideoCodes:
    """Decode `video` (a path or the file's bytes) at `fps` (at most `max_frames`, spread over the
    whole video) and VQ-encode it; raises a VideoError for a missing or unreadable video. progress:
    a bar of frames (`total_frames` sizes it). on_frames: called with each chunk the VQ is given
    (uint8 (t, H, W, 3)) and its times (a server's thumbnails)."""
    reader = iter_video(
        video,
        fps=fps,
        max_frames=max_frames,
        size=vq.cfg.resolution,
        max_resolution=max_resolution,
        backend=backend,
    )
    bar = tqdm(total=total_frames, unit="frame", desc="encoding video", disable=not progress)

    def chunks():
        for frames, times in reader:
            bar.update(int(frames.shape[0]))
            if on_frames is not None:
                on_frames(frames, times)
            yield frames, times

    try:
        vc = frames_to_codes(vq, chunks(), batch_frames=batch_frames)
    finally:
        bar.close()
    vc.report = reader.report
    return vc
