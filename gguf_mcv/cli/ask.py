"""``gguf-mcv ask`` and ``video``: one question about images or a video."""

from __future__ import annotations

import argparse

from .loading import load_model, sampling_kwargs
from .printing import print_answer, progress_line


def run_ask(args: argparse.Namespace) -> int:
    from ..selftest import EXAMPLE_IMAGE  # lazy: per command

    *images, prompt = args.args
    if args.example:
        images = [str(EXAMPLE_IMAGE), *images]
    with load_model(args) as model:
        reply = model.ask(prompt, images, stream=not args.json, detail=args.detail,
                          on_progress=progress_line(args), **sampling_kwargs(args))
        print_answer(reply, args.json)
    return 0


def run_video(args: argparse.Namespace) -> int:
    with load_model(args) as model:
        reply = model.ask_video(
            args.prompt, args.video, max_frames=args.frames, fps=args.fps,
            dedupe=not args.no_dedupe, timestamps=not args.no_timestamps, stream=not args.json,
            on_progress=progress_line(args, "frame"), **sampling_kwargs(args))
        print_answer(reply, args.json)
    return 0
