"""Assemble generated token bytes into text pieces that are safe to show.

A token can end in the middle of a UTF-8 character, and a stop string can span
tokens; :class:`TextAssembler` only releases text that is valid UTF-8 and that
cannot turn out to be the start of a stop string.
"""

from __future__ import annotations

import codecs
from typing import Sequence

from ..generations import THINK_MARKERS


class TextAssembler:
    """Feed token bytes, get text pieces; stops at the first stop string."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._stops = [s for s in stop if s]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self.text = ""
        self.stopped = False

    def feed(self, data: bytes) -> str:
        """Add one token's bytes; return the text that can be released now."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(data)
        for stop in self._stops:
            at = self._pending.find(stop)
            if at >= 0:
                self._pending = self._pending[:at]
                self.stopped = True
        release = self._pending if self.stopped else self._pending[: len(self._pending) - self._held()]
        self._pending = self._pending[len(release):]
        if self.stopped:
            self._pending = ""
        self.text += release
        return release

    def finish(self) -> str:
        """Release whatever is held back once generation has ended."""
        if self.stopped:
            return ""
        rest = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        self.text += rest
        return rest

    def _held(self) -> int:
        """Length of the longest tail of pending text that starts some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest


class ReasoningFilter:
    """Keep a leading ``<think>…</think>`` block out of the streamed answer.

    ``inside`` says the prompt itself already opened the think block (some
    templates end the generation prompt with ``<think>``).
    """

    OPEN, CLOSE = THINK_MARKERS

    def __init__(self, *, active: bool, inside: bool = False) -> None:
        self._state = ("thinking" if inside else "deciding") if active else "answer"
        self._buf = ""
        self.reasoning = ""

    def feed(self, text: str) -> str:
        """Return the part of ``text`` that belongs to the answer."""
        if self._state == "answer":
            return text
        self._buf += text
        if self._state == "deciding":
            head = self._buf.lstrip()
            if len(head) < len(self.OPEN) and self.OPEN.startswith(head):
                return ""
            if not head.startswith(self.OPEN):
                return self._release_all()
            self._state, self._buf = "thinking", head[len(self.OPEN):]
        if self.CLOSE not in self._buf:
            return ""
        thought, _, answer = self._buf.partition(self.CLOSE)
        self.reasoning, self._buf, self._state = thought.strip(), "", "answer"
        return answer.lstrip("\n")

    def finish(self) -> str:
        """At the end: text still undecided is answer; an unclosed think block is reasoning."""
        if self._state == "deciding":
            return self._release_all()
        if self._state == "thinking":
            self.reasoning, self._buf = self._buf.strip(), ""
        return ""

    def _release_all(self) -> str:
        text, self._buf, self._state = self._buf, "", "answer"
        return text
