"""``gguf-mcv chat``: the interactive conversation."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import ConfigError, ContextOverflowError, GgufMcvError, MediaError
from .loading import load_model
from .printing import one_line, print_pieces, progress_line


def run_chat(args: argparse.Namespace) -> int:
    with load_model(args) as model:
        chat = model.chat(system=args.system, overflow="drop_oldest")
        images: list[str] = []
        videos: list[str] = []
        print("Type a question. /image PATH, /video PATH, /again (answer the last question anew), "
              "/save PATH, /load PATH, /reset, /exit.", file=sys.stderr)
        while True:
            try:
                line = input("> ").strip()
            except EOFError:
                return 0
            command, _, rest = line.partition(" ")
            if command == "/exit":
                return 0
            if command == "/reset":
                chat.reset()
                images.clear()
                videos.clear()
                print("(conversation cleared)", file=sys.stderr)
            elif command in ("/save", "/load") and rest.strip():
                try:
                    if command == "/save":
                        kept = chat.save(rest.strip())
                        print(f"(saved to {rest.strip()}{'' if kept else '; its turns will be evaluated again'})",
                              file=sys.stderr)
                    else:
                        chat = model.load_chat(rest.strip())
                        print(f"(loaded {len(chat.history) // 2} question(s) from {rest.strip()})", file=sys.stderr)
                except GgufMcvError as exc:
                    print(f"(error: {one_line(exc)})", file=sys.stderr)
            elif command == "/again":
                try:
                    print_pieces(chat.regenerate(stream=True, max_tokens=args.max_tokens))
                except ConfigError as exc:
                    print(f"(error: {one_line(exc)})", file=sys.stderr)
            elif command in ("/image", "/video"):
                if not Path(rest.strip()).exists():
                    print(f"(no such file: {rest.strip()})", file=sys.stderr)
                    continue
                (images if command == "/image" else videos).append(rest.strip())
                print(f"({command[1:]} added to the next question)", file=sys.stderr)
            elif line:
                try:
                    stream = chat.send(line, images, videos=videos, stream=True,
                                       max_tokens=args.max_tokens, on_progress=progress_line(args))
                    print_pieces(stream)
                    dropped = stream.reply.dropped_turns if stream.reply is not None else 0
                    if dropped > 0:
                        print(f"(the context was full: the {dropped} oldest question(s) and their "
                              "answers were dropped)", file=sys.stderr)
                except ContextOverflowError as exc:
                    print(f"(this question does not fit in the context even on its own: "
                          f"{one_line(exc)} The conversation is kept; /reset starts over.)",
                          file=sys.stderr)
                except (MediaError, ConfigError) as exc:
                    print(f"(error: {one_line(exc)})", file=sys.stderr)
                images.clear()
                videos.clear()
