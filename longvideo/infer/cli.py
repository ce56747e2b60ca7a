"""`longvideo chat` and `longvideo eval` (docs/inference.md, docs/evaluation.md); under torchrun
sequence-parallel (longvideo.infer.sp), rank 0 reading the inputs and writing the results.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch.distributed as dist

from longvideo.atomic import atomic_open
from longvideo.data.video import VIDEO_EXTS, VideoError
from longvideo.distributed import broadcast_text, fail_together, local_device, torchrun_world
from longvideo.infer import evals, mcq
from longvideo.infer.benchmarks import BENCHMARKS
from longvideo.infer.chat import (
    ChatSession,
    encode_video_file,
    infer_config,
    load_model,
    share_video,
)
from longvideo.infer.sp import SequenceParallelEngine
from longvideo.infer.t2v import OUTPUT_EXTS, generate_video, write_frames
from longvideo.infer.t2v_eval import evaluate_t2v
from longvideo.parallel import split_group
from longvideo.vq import load_vq

EXIT_ERROR = 2
KNOWN_ERRORS = (VideoError, FileNotFoundError, ValueError, RuntimeError)
"""What a command reports as one 'error:' line (and EXIT_ERROR); anything else is a bug: a traceback."""


def _error(prog: str, err: BaseException) -> int:
    print(f"{prog}: error: {err}", file=sys.stderr)
    return EXIT_ERROR


@contextlib.contextmanager
def _plain_warnings():
    """Warnings as one 'warning: ...' line for a person at a terminal, restored afterwards."""
    saved = warnings.formatwarning
    warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"
    try:
        yield
    finally:
        warnings.formatwarning = saved


def _shared_args(p: argparse.ArgumentParser, max_new_tokens: int | None, help_tokens: str) -> None:
    """The flags chat and every eval task share."""
    p.add_argument(
        "--model", required=True, help="exported Hugging Face directory or project checkpoint"
    )
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=help_tokens)
    p.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)"
    )
    p.add_argument(
        "--backend", default="auto", help="block-attention backend of sequence-parallel prefill"
    )
    p.add_argument(
        "--ulysses",
        type=int,
        default=1,
        help="torchrun: head-parallel prefill in groups of this "
        "many ranks, a ring across them (docs/hybrid.md)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def chat_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="longvideo chat", description="Answer questions about a video."
    )
    _shared_args(p, None, "most answer tokens (default: model config)")
    p.add_argument("--video", required=True, help=f"video file ({', '.join(VIDEO_EXTS)})")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--question", help="one question; the answer is printed")
    g.add_argument(
        "--interactive",
        action="store_true",
        help="read questions from stdin until an empty "
        "line; the video is encoded and prefilled once",
    )
    p.add_argument(
        "--fps", type=float, default=1.0, help="frames per second read from the video (default 1)"
    )
    p.add_argument(
        "--max-frames", type=int, default=None, help="most frames read (uniform over the video)"
    )
    p.add_argument(
        "--temperature", type=float, default=None, help="0 = greedy (default: model config)"
    )
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold")
    p.add_argument(
        "--prefill-chunk", type=int, default=None, help="tokens per prefill chunk (single process)"
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    return p


def _questions(args) -> Iterator[str]:
    if args.question is not None:
        yield args.question
        return
    interactive = sys.stdin.isatty()
    while True:
        try:
            q = input("question> ") if interactive else sys.stdin.readline()
        except EOFError:
            return
        if not q or not q.strip() or q.strip().lower() in ("exit", "quit"):
            return
        yield q.strip()


def chat_main(argv: list[str]) -> int:
    args = chat_parser().parse_args(argv)
    with _plain_warnings():
        return _chat(args)


def _chat(args) -> int:
    """One process, or every rank of a torchrun world (sequence-parallel prefill and decoding); rank 0
    reads the video and the questions and prints the answers."""
    device = local_device(args.device)
    with torchrun_world(
        device, timedelta(days=1) if args.interactive else timedelta(minutes=30)
    ) as distributed:
        rank = dist.get_rank() if distributed else 0
        try:
            error, pretrained, enc = None, None, None
            try:
                pretrained = load_model(args.model, device)
                heads = split_group(None, args.ulysses) if distributed else None
                cfg = infer_config(
                    pretrained,
                    max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    prefill_chunk=args.prefill_chunk,
                    seed=args.seed,
                )
                if rank == 0:
                    enc = encode_video_file(
                        pretrained,
                        args.video,
                        fps=args.fps,
                        max_frames=args.max_frames,
                        question=args.question,
                        max_new_tokens=cfg.max_new_tokens,
                        batch_frames=cfg.encode_batch_frames,
                        progress=not args.quiet,
                    )
            except KNOWN_ERRORS as e:
                error = e
            fail_together(
                error
            )  # every rank learns of any rank's error before the collectives start
            engine = (
                SequenceParallelEngine(pretrained.model, backend=args.backend, ulysses=heads)
                if distributed
                else None
            )
            session = ChatSession(
                pretrained, share_video(enc) if distributed else enc, infer=cfg, engine=engine
            )
            questions = _questions(args) if rank == 0 else None
            while True:
                q, error = "", None
                if rank == 0:
                    try:
                        q = next(questions, "")
                    except Exception as e:  # noqa: BLE001 - a question that cannot be read stops every rank
                        error = e
                fail_together(error)
                if distributed:
                    q = broadcast_text(q if rank == 0 else None, src=0)
                if not q:
                    break
                out = session.ask(q)
                if rank == 0:
                    print(out, flush=True)
            return 0
        except KNOWN_ERRORS as e:
            where = f" (rank {rank})" if distributed else ""
            print(f"longvideo chat: error{where}: {e}", file=sys.stderr)
            return EXIT_ERROR


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="longvideo eval",
        description="QA accuracy and needle-in-a-haystack "
        "evaluations; each writes NAME.json and a heatmap NAME.png into --out.",
    )
    sub = p.add_subparsers(dest="task", required=True)

    def task(name: str, help: str, lengths: list[int] | None = None, unit: str = ""):
        sp = sub.add_parser(name, help=help)
        _shared_args(sp, 16, "most answer tokens (default 16)")
        sp.add_argument("--out", required=True, help="output directory for the JSON and the PNG")
        if lengths:  # a needle grid
            sp.add_argument(
                "--lengths", type=_ints, default=lengths, help=f"{unit}, comma separated"
            )
            sp.add_argument(
                "--depths",
                type=_floats,
                default=[0.0, 0.25, 0.5, 0.75, 1.0],
                help="needle depths in [0, 1]",
            )
            sp.add_argument("--seed", type=int, default=0)
        return sp

    qa = task("qa", "accuracy on the questions of QA shards (token or raw)")
    qa.add_argument("--shards", required=True, help="directory, glob or brace pattern of shards")
    qa.add_argument("--max-samples", type=int, default=None)
    qa.add_argument("--fps", type=float, default=1.0, help="raw shards: frames per second read")
    qa.add_argument(
        "--lengths",
        type=_floats,
        default=(),
        help="video lengths in seconds, comma separated: accuracy per question type and length "
        "(a video counts at the shortest length it does not exceed)",
    )
    tn = task(
        "text-niah",
        "text needle in a haystack (LWM's protocol)",
        [256, 512, 1024],
        "context lengths in tokens",
    )
    tn.add_argument("--rounds", type=int, default=2, help="needles per cell")
    vn = task(
        "video-niah",
        "video needle in a haystack (needle frame at a depth)",
        [16, 32, 64],
        "video lengths in frames (1 fps)",
    )
    vn.add_argument(
        "--colours", default=None, help="needle colours, comma separated (default: all)"
    )
    vn.add_argument(
        "--source-fps",
        type=int,
        default=8,
        help="frame rate the backgrounds are rendered at "
        "before 1 fps sampling (as the training videos)",
    )
    vn.add_argument(
        "--shape-scale",
        type=float,
        default=1.0,
        help="generated backgrounds' shapes: radii times this (as the training videos')",
    )
    vn.add_argument(
        "--trials",
        type=_ints,
        default=None,
        help="trials per cell: one number, or one per length (default: one per colour)",
    )
    vn.add_argument(
        "--haystack", default=None, help="a video to cut the backgrounds from (read at 1 fps)"
    )
    vn.add_argument(
        "--needle",
        default=None,
        help="an image inserted instead of the colour flashes (needs --question and --answer)",
    )
    vn.add_argument("--question", default=None, help="the question about the needle image")
    vn.add_argument("--answer", default=None, help="its answer (exact match)")
    vn.add_argument(
        "--lookalikes",
        choices=("keep", "scrub", "add"),
        default="keep",
        help="a diagnostic: scrub the flash's codes from every other frame, or add 3%% more "
        "frames holding one (docs/hour.md, 'Look-alike codes'); default: keep",
    )
    vn.add_argument(
        "--control",
        action="store_true",
        help="also ask each trial over its background with no needle (one more prompt a trial): "
        "answers the bare background also gets are counted as defaults, not readings",
    )
    vn.add_argument(
        "--exact-frames",
        action="store_true",
        help="splice the generated backgrounds and "
        "colour flashes exactly as drawn, not through the training videos' codec",
    )
    mc = task(
        "mcq",
        "multiple-choice benchmarks in their release layout (docs/evaluation.md); "
        "writes predictions.jsonl, summary.json and summary.png; resumable",
    )
    mc.add_argument("--benchmark", required=True, choices=BENCHMARKS)
    mc.add_argument(
        "--data", required=True, help="the benchmark's folder as released (or generic: a .jsonl)"
    )
    mc.add_argument(
        "--mode",
        choices=mcq.MODES,
        default="likelihood",
        help="likelihood: score each option's text; generate: parse the letter the model writes",
    )
    mc.add_argument(
        "--subtitles",
        action="store_true",
        help="the subtitles at the sampled frames before the question",
    )
    mc.add_argument("--fps", type=float, default=1.0, help="frames per second read (default 1)")
    mc.add_argument(
        "--max-frames", type=int, default=None, help="most frames a video, spread over all of it"
    )
    mc.add_argument("--limit", type=int, default=None, help="the first N questions only")
    t2v = sub.add_parser(
        "t2v",
        help="text to video: generate from held-out captions, read each frame's colour and shape "
        "(docs/generation.md); writes t2v.json and t2v.png",
    )
    t2v.add_argument("--model", required=True, help="a checkpoint or export that generates video")
    t2v.add_argument("--shards", required=True, help="held-out shards (raw or token) with captions")
    t2v.add_argument("--out", required=True, help="output directory for the JSON and the PNG")
    t2v.add_argument("--samples", type=int, default=32, help="captions generated from (default 32)")
    t2v.add_argument("--max-frames", type=int, default=8, help="most frames a video (default 8)")
    t2v.add_argument("--cfg-scale", type=float, default=3.0, help="guidance scale (default 3)")
    t2v.add_argument("--top-k", type=int, default=None, help="top-k of the codes (default none)")
    t2v.add_argument("--top-p", type=float, default=1.0)
    t2v.add_argument("--temperature", type=float, default=1.0)
    t2v.add_argument("--seed", type=int, default=0, help="video i is sampled with seed + i")
    t2v.add_argument(
        "--model-ends",
        action="store_true",
        help="the model ends each video (<eov>) within --max-frames; every captioned scene is "
        "expected (default: the held-out video's length, the scenes that start within it)",
    )
    t2v.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)"
    )
    t2v.add_argument("--quiet", action="store_true", help="no progress bar")
    vq = sub.add_parser(
        "vq-needle",
        help="does a one-frame flash survive the video tokenizer (per offset in a group)",
    )
    vq.add_argument("--model", required=True, help="a model directory with vq/, or a VQ directory")
    vq.add_argument("--out", required=True, help="output directory for the JSON and the PNG")
    vq.add_argument("--frames", type=int, default=120, help="video length in frames (1 fps)")
    vq.add_argument("--trials", type=int, default=64)
    vq.add_argument("--seed", type=int, default=0)
    vq.add_argument("--source-fps", type=int, default=8)
    vq.add_argument(
        "--shape-scale",
        type=float,
        default=1.0,
        help="generated backgrounds' shapes: radii times this (as the training videos')",
    )
    vq.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def eval_main(argv: list[str]) -> int:
    args = eval_parser().parse_args(argv)
    with _plain_warnings():
        return _eval(args)


def _eval(args) -> int:
    """One process, or every rank of a torchrun world running the same evaluation (rank 0 writes)."""
    if args.task == "t2v":
        try:
            res = evaluate_t2v(
                args.model,
                args.shards,
                out_dir=args.out,
                samples=args.samples,
                max_frames=args.max_frames,
                cfg_scale=args.cfg_scale,
                top_k=args.top_k,
                top_p=args.top_p,
                temperature=args.temperature,
                seed=args.seed,
                model_ends=args.model_ends,
                progress=not args.quiet,
                device=local_device(args.device),
            )
        except KNOWN_ERRORS as e:
            return _error("longvideo eval", e)
        print(
            f"text to video: colours in order {res['accuracy']:.1%} of {res['n']} videos (chance "
            f"{res['chance']:.1%}); colours and shapes in order {res['shapes_in_order']:.1%} "
            f"(chance {res['chance_shapes']:.1%}); first frame {res['first_scene']:.1%}"
        )
        print(f"wrote {res['json']} and {res['png']}")
        return 0
    if args.task == "vq-needle":
        model = Path(args.model)
        vq_dir = (
            (model / "config.json").is_file()
            and (model / "model.safetensors").is_file()
            and not (model / "vq").is_dir()
        )  # a VQ directory, not a model's
        try:
            res = evals.evaluate_vq_needle(
                load_vq(model) if vq_dir else args.model,
                num_frames=args.frames,
                trials=args.trials,
                seed=args.seed,
                source_fps=args.source_fps,
                shape_scale=args.shape_scale,
                out_dir=args.out,
                progress=not args.quiet,
            )
        except KNOWN_ERRORS as e:
            return _error("longvideo eval", e)
        print(
            f"flash colour after the tokenizer: {res['rate']:.1%} of {res['trials']} "
            f"(by position in the group: {res['rate_by_offset']}); shapes in the other "
            f"{res['shape_frames']} frames: colour {res['shape_colour_rate']:.1%} (chance "
            f"{res['shape_colour_chance']:.1%}), kind {res['shape_kind_rate']:.1%} (chance "
            f"{res['shape_kind_chance']:.1%})"
        )
        print(f"wrote {res['json']} and {res['png']}")
        return 0
    device = local_device(args.device)
    with torchrun_world(device, timedelta(minutes=30)) as distributed:
        rank, group = (dist.get_rank(), dist.group.WORLD) if distributed else (0, None)
        try:
            pretrained = load_model(args.model, device)
            heads = split_group(None, args.ulysses) if distributed else None
            factory = lambda p: SequenceParallelEngine(p.model, backend=args.backend, ulysses=heads)  # noqa: E731
            run = dict(
                max_new_tokens=args.max_new_tokens,
                progress=not args.quiet and rank == 0,
                engine_factory=factory if distributed else None,
            )
            out = args.out if rank == 0 else None
            if args.task == "mcq":
                res = mcq.evaluate_mcq(
                    pretrained,
                    args.benchmark,
                    args.data,
                    args.out,
                    mode=args.mode,
                    subtitles=args.subtitles,
                    fps=args.fps,
                    max_frames=args.max_frames,
                    limit=args.limit,
                    group=group,
                    **run,
                )
                if not res:  # ranks > 0: the summary is rank 0's
                    return 0
                skipped = sum(v["count"] for v in res["skipped"].values())
                unparseable = (
                    f", {res['unparseable']} unparseable" if args.mode == "generate" else ""
                )
                line = (
                    f"{args.benchmark} accuracy {res['accuracy']:.3f} (95 % interval {res['ci95'][0]:.3f}-"
                    f"{res['ci95'][1]:.3f}; chance {res['chance']:.3f}) over {res['questions']} questions, "
                    f"{skipped} skipped{unparseable}"
                )
            elif args.task == "qa":
                res = evals.evaluate_qa(
                    pretrained,
                    args.shards,
                    out_dir=out,
                    max_samples=args.max_samples,
                    fps=args.fps,
                    lengths=tuple(args.lengths),
                    group=group,
                    **run,
                )
                line = (
                    f"QA accuracy {res['accuracy']:.3f} (chance {res['chance'] or float('nan'):.3f}; "
                    f"substring {res['substring_accuracy']:.3f}) over {res['questions']} questions "
                    f"of {res['samples']} videos"
                    + "".join(
                        f"\n  {t}: {r['accuracy']:.3f} (chance {r['chance'] or float('nan'):.3f}, "
                        f"{r['count']} asked)"
                        for t, r in res["per_type"].items()
                    )
                )
            elif args.task == "text-niah":
                res = evals.evaluate_text_needle(
                    pretrained,
                    lengths=args.lengths,
                    depths=args.depths,
                    seed=args.seed,
                    rounds=args.rounds,
                    out_dir=out,
                    **run,
                )
                line = (
                    f"text needle accuracy {res['accuracy']:.3f} over {len(res['cells'])} needles"
                )
            else:
                colours = [c.strip() for c in args.colours.split(",")] if args.colours else None
                trials = args.trials[0] if args.trials and len(args.trials) == 1 else args.trials
                res = evals.evaluate_video_needle(
                    pretrained,
                    lengths=args.lengths,
                    depths=args.depths,
                    seed=args.seed,
                    colours=colours,
                    trials=trials,
                    source_fps=args.source_fps,
                    shape_scale=args.shape_scale,
                    out_dir=out,
                    group=group,
                    haystack=args.haystack,
                    needle=args.needle,
                    question=args.question,
                    answer=args.answer,
                    decoded=not args.exact_frames,
                    lookalikes=args.lookalikes,
                    control=args.control,
                    **run,
                )
                line = (
                    f"video needle accuracy {res['accuracy']:.3f} (chance {res['chance']:.3f}) "
                    f"over {len(res['cells'])} needles"
                )
                if args.control:
                    read = sum(m["read"] for m in res["misses"].values())
                    told = sum(m["decidable"] for m in res["misses"].values())
                    line += (
                        f"; read {read} of the {told} needles whose bare background "
                        "gets another answer"
                    )
                if res["needles_dropped"]:
                    line += (
                        f"\nwarning: {res['needles_dropped']} of {len(res['cells'])} needles were dropped "
                        f"to fit the model's context of {res['context']} tokens; those trials are guesses "
                        f"(cells: needle_kept)"
                    )
            if rank == 0:
                print(
                    line
                    + (
                        f" (sequence-parallel over {dist.get_world_size()} ranks)"
                        if distributed
                        else ""
                    )
                )
                print(f"wrote {res['json']} and {res['png']}")
        except KNOWN_ERRORS as e:
            return _error("longvideo eval", e)
    return 0


def generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="longvideo generate",
        description="Generate a video (or an image) from text with classifier-free guidance "
        "(docs/generation.md); under torchrun the sampling is sequence-parallel.",
    )
    p.add_argument(
        "--model", required=True, help="exported Hugging Face directory or project checkpoint"
    )
    p.add_argument("--prompt", required=True, help="the caption of the video")
    p.add_argument("--frames", type=int, default=1, help="frames to generate (default 1: an image)")
    p.add_argument(
        "--out", required=True, help="FILE.mp4, FILE.gif or FILE.png (several frames: a grid)"
    )
    p.add_argument(
        "--cfg-scale",
        type=float,
        default=1.0,
        help="classifier-free guidance scale (1: none; default 1)",
    )
    p.add_argument(
        "--cfg-scale-video",
        type=float,
        default=None,
        help="LWM models: the scale of the frames after the first (default: --cfg-scale)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="sample among the k most likely codes (1: greedy; default: none, LWM models 8192 for "
        "the first frame and 100 after it, as LWM's script)",
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1)"
    )
    p.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature (0: greedy; default 1)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same video)")
    p.add_argument(
        "--model-ends",
        action="store_true",
        help="the model may end the video with <eov> before --frames (not for LWM models)",
    )
    p.add_argument(
        "--save-codes", default=None, help="also write the sampled codes (frames, h, w) as .npy"
    )
    p.add_argument("--fps", type=float, default=None, help="frame rate written (default: model's)")
    p.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)"
    )
    p.add_argument("--backend", default="auto", help="block-attention backend under torchrun")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def generate_main(argv: list[str]) -> int:
    args = generate_parser().parse_args(argv)
    with _plain_warnings():
        return _generate(args)


def _generate(args) -> int:
    """One process, or every rank of a torchrun world sampling together; rank 0 writes the files."""
    if Path(args.out).suffix.lower() not in OUTPUT_EXTS:
        return _error(
            "longvideo generate", ValueError(f"--out must end with one of {', '.join(OUTPUT_EXTS)}")
        )
    device = local_device(args.device)
    with torchrun_world(device, timedelta(minutes=30)) as distributed:
        rank = dist.get_rank() if distributed else 0
        try:
            error, pretrained = None, None
            try:
                pretrained = load_model(args.model, device)
            except KNOWN_ERRORS as e:
                error = e
            fail_together(error)
            out = generate_video(
                pretrained,
                args.prompt,
                frames=args.frames,
                cfg_scale=args.cfg_scale,
                cfg_scale_video=args.cfg_scale_video,
                top_k=args.top_k,
                top_p=args.top_p,
                temperature=args.temperature,
                seed=args.seed,
                model_ends=args.model_ends,
                decode=rank == 0,
                group=dist.group.WORLD if distributed else None,
                backend=args.backend,
                progress=not args.quiet and rank == 0,
            )
            if rank == 0:
                write_frames(out.frames, args.out, args.fps or out.fps)
                if args.save_codes:
                    with atomic_open(args.save_codes, "wb") as f:
                        np.save(f, out.codes)
                print(
                    f"wrote {args.out}: {len(out.codes)} frames of {out.codes.shape[1]}x"
                    f"{out.codes.shape[2]} codes, {len(out.ids)} tokens in {out.seconds:.1f} s "
                    f"({out.tokens_per_s:.1f} tokens/s)"
                )
            return 0
        except KNOWN_ERRORS as e:
            where = f" (rank {rank})" if distributed else ""
            print(f"longvideo generate: error{where}: {e}", file=sys.stderr)
            return EXIT_ERROR
