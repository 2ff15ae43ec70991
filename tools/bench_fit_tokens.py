"""Positions tokenized (and seconds) by one ``chat_completion(truncate=True)`` over a conversation
that must drop turns, then by the same conversation one question longer.

    python tools/bench_fit_tokens.py --ladder DIR [--quant Q4_K_M] [--ctx 512]

DIR is a ladder from ``tools/make_test_model.py`` (the tiny preset is enough: this counts
tokenization, not answers). Run it on two checkouts to compare them.
"""

from __future__ import annotations

import time

import numpy as np
from bench import images, options, record

import gguf_mcv


def conversation(questions: int) -> list[dict]:
    """``questions`` questions with their answers (an image every third), then a last question."""
    rng = np.random.default_rng(5)
    messages: list[dict] = []
    for i in range(questions):
        content: list[dict] = [{"type": "text", "text": f"Question {i}: " + "what is going on here? " * 4}]
        if i % 3 == 0:
            url = images.data_uri(images.encoded(rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)))
            content.insert(0, {"type": "image_url", "image_url": {"url": url}})
        messages += [{"role": "user", "content": content},
                     {"role": "assistant", "content": f"Answer {i}: " + "it is a picture. " * 6}]
    return messages + [{"role": "user", "content": "And now?"}]


def main() -> None:
    parser = options.parser(__doc__, ladder=None)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--questions", type=int, default=12)
    args = parser.parse_args()
    model_path = next(args.ladder.glob(f"*{args.quant}*.gguf"))
    mmproj = next(args.ladder.glob("mmproj*.gguf"))
    messages = conversation(args.questions)
    with gguf_mcv.load(model_path=model_path, mmproj_path=mmproj, n_ctx=args.ctx, n_threads=args.threads) as model:
        calls: list[int] = []
        real = model.engine.tokenize

        def counting(text, images=()):
            prompt = real(text, images)
            calls.append(prompt.n_pos)
            return prompt

        model.engine.tokenize = counting  # type: ignore[method-assign]
        rows = []
        for label in ("first request", "one question longer"):
            calls.clear()
            start = time.perf_counter()
            reply = model.chat_completion(messages, truncate=True, max_tokens=4, temperature=0)
            took = time.perf_counter() - start
            print(f"{label}: {reply.dropped_turns} questions dropped, prompt {reply.usage.prompt_tokens} "
                  f"positions; {len(calls)} tokenize calls, {sum(calls)} positions tokenized; {took:.2f} s")
            rows.append({"request": label, "dropped_turns": reply.dropped_turns,
                         "prompt_tokens": reply.usage.prompt_tokens, "tokenize_calls": len(calls),
                         "positions_tokenized": sum(calls), "seconds": took})
            messages += [{"role": "assistant", "content": str(reply)}, {"role": "user", "content": "Why?"}]
    record.write(args.json, "bench_fit_tokens", rows, args)


if __name__ == "__main__":
    main()
