"""Mark text a person wrote so that no part of it is read as control tokens or media markers.

Prompts are rendered by Jinja chat templates into one string, and llama.cpp reads
special-token text (``<|im_end|>``, ``<image>``) and libmtmd's media marker in that
string as control tokens and images. Only the template's own markup may do that:
user, system and assistant content is wrapped in two private-use characters
before rendering, and the engine tokenizes what lies between them as plain text.
"""

from __future__ import annotations

import re

OPEN = "\ue000"
CLOSE = "\ue001"
_SENTINELS = re.compile(f"[{OPEN}{CLOSE}]")


def plain(text: str) -> str:
    """``text`` marked as plain (sentinel characters it contains are dropped)."""
    text = _SENTINELS.sub("", text)
    return f"{OPEN}{text}{CLOSE}" if text else ""


def unmark(text: str) -> str:
    """``text`` without the marks (for showing it back to a person)."""
    return _SENTINELS.sub("", text)


def split(text: str) -> list[tuple[str, bool]]:
    """``text`` as (segment, is_plain) pieces in order, marks removed.

    A template that cuts content (``content.split(...)``) can leave a mark without its
    partner: a lone closing mark is dropped, a lone opening mark makes the rest plain.
    """
    pieces: list[tuple[str, bool]] = []
    pos = 0
    while pos < len(text):
        start = text.find(OPEN, pos)
        stray_close = text.find(CLOSE, pos)
        if stray_close != -1 and (start == -1 or stray_close < start):
            _add(pieces, text[pos:stray_close], False)
            pos = stray_close + 1
            continue
        if start == -1:
            _add(pieces, text[pos:], False)
            break
        _add(pieces, text[pos:start], False)
        end = text.find(CLOSE, start + 1)
        end = len(text) if end == -1 else end
        _add(pieces, text[start + 1:end], True)
        pos = end + 1
    return pieces


def _add(pieces: list[tuple[str, bool]], segment: str, is_plain: bool) -> None:
    segment = segment.replace(OPEN, "") if is_plain else segment
    if not segment:
        return
    if pieces and pieces[-1][1] == is_plain:
        pieces[-1] = (pieces[-1][0] + segment, is_plain)
    else:
        pieces.append((segment, is_plain))
