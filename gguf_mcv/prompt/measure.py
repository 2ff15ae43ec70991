"""How many positions a rendered prompt fills, measured piece by piece and remembered.

The engine tokenizes a prompt one segment at a time (:func:`plaintext.split`): text people wrote
on its own, without special tokens, and each stretch of the template's markup through libmtmd,
which in turn tokenizes the text between two images on its own and each image on its own. Tokens
never merge across those boundaries, and only the prompt's first piece may gain a BOS token, so a
prompt's positions are exactly the sum of its pieces' positions, whatever the template.
:class:`PromptMeasure` measures each piece (a plain text, a markup text, an image) once and
remembers it: dropping turns from a conversation, or asking the next question in it, measures
only the pieces that are new.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from contextlib import nullcontext
from typing import TYPE_CHECKING, Sequence

from ..errors import ConfigError
from ..vision.media import Image
from . import plaintext

if TYPE_CHECKING:
    from ..runtime.engine import Engine
    from ..runtime.generation import AnswerLock

#: Segments remembered per model (least recently used forgotten first): a few hundred bytes each.
CAPACITY = 4096
# What a segment is measured behind: a segment of the other kind, so that it stays a segment of
# its own and is not the prompt's first (no BOS token). Their own positions are subtracted.
_MARKUP_ANCHOR = "\n"
_PLAIN_ANCHOR = plaintext.plain("a")

_Key = tuple[bool, str, bytes]  # (opens the prompt, "plain"/"markup"/"image", text hash or image digest)


class PromptMeasure:
    """Positions of rendered prompts for one engine, each text and image tokenized once.

    ``lock`` (the model's answer lock) is held while the engine tokenizes. Safe to share
    between threads.
    """

    def __init__(self, engine: "Engine", lock: "AnswerLock | None" = None, capacity: int = CAPACITY) -> None:
        self.engine = engine
        self.lock = lock
        self.capacity = capacity
        self._known: OrderedDict[_Key, int] = OrderedDict()
        self._anchors: dict[str, int] = {}  # anchor text -> its positions alone
        self._guard = threading.Lock()  # guards the two dicts

    def positions(self, text: str, images: Sequence[Image] = ()) -> int:
        """The positions ``engine.tokenize(text, images)`` would fill, from the pieces measured
        before and those measured now. ConfigError when markers and images do not match."""
        pieces = self._pieces(text, images)
        with self._guard:
            found = {key: self._known[key] for key, *_ in pieces if key in self._known}
            for key in found:
                self._known.move_to_end(key)
        missing = [piece for piece in pieces if piece[0] not in found]
        if missing:
            with self.lock.hold() if self.lock is not None else nullcontext():
                for key, kind, piece_text, image in missing:
                    if key not in found:  # a piece may come twice
                        found[key] = self._measure(kind, piece_text, image, first=key[0])
            with self._guard:
                for key, *_ in missing:
                    self._known[key] = found[key]
                while len(self._known) > self.capacity:
                    self._known.popitem(last=False)
        return sum(found[key] for key, *_ in pieces)

    def _pieces(self, text: str, images: Sequence[Image]) -> list[tuple[_Key, str, str, Image | None]]:
        """``(key, kind, text, image)`` for each piece of the prompt, in order."""
        marker = self.engine.marker
        segments = plaintext.split(text)
        n_markers = sum(segment.count(marker) for segment, is_plain in segments if not is_plain)
        if n_markers != len(images):
            raise ConfigError(f"The prompt has {n_markers} image markers but {len(images)} images were given.")
        pieces: list[tuple[_Key, str, str, Image | None]] = []
        todo = iter(images)

        def add(kind: str, piece: str, image: Image | None = None) -> None:
            name = image.digest.encode() if image is not None else hashlib.blake2b(
                piece.encode(), digest_size=16).digest()
            pieces.append(((not pieces, kind, name), kind, piece, image))

        for segment, is_plain in segments:
            if is_plain:
                add("plain", segment)
                continue
            for i, between in enumerate(segment.split(marker)):
                if i:
                    add("image", marker, next(todo))
                if between:
                    add("markup", between)
        return pieces

    def _measure(self, kind: str, text: str, image: Image | None, *, first: bool) -> int:
        """Positions of one piece: tokenized alone when it opens the prompt (BOS and all), else
        behind an anchor of the other kind (so it stays a piece of its own), whose own positions
        are taken off."""
        if kind == "plain":
            text = plaintext.plain(text)
        images = () if image is None else (image,)
        if first:
            return self._tokenized(text, images)
        anchor = _MARKUP_ANCHOR if kind == "plain" else _PLAIN_ANCHOR
        if anchor not in self._anchors:
            self._anchors[anchor] = self._tokenized(anchor, ())
        return self._tokenized(anchor + text, images) - self._anchors[anchor]

    def _tokenized(self, text: str, images: Sequence[Image]) -> int:
        with self.engine.tokenize(text, images) as prompt:
            return prompt.n_pos
