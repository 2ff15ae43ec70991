"""A sequence's KV state in one form for any number of KV streams (parallel slots).

With parallel slots each sequence has a KV stream of its own (``kv_unified=False``), and
llama.cpp writes a sequence's state with a header for every stream of the context: the
stream count, then for each stream its cell count (0 for every stream but the sequence's
own) and that stream's cells. Such a state loads only into a context with the same stream
count ("n_stream mismatch"), so a conversation kept or saved with four slots could not come
back with one. (A state starts with 8 bytes of llama.cpp's own — a magic number and the
sequence it was copied from, which a restore does not use — left as they are.)
:class:`StreamLayout` turns a state into the one-stream form — what a
single-sequence context writes, and what states kept before slots had streams of their own
are — and back into the form of the context at hand. The stream a state's cells are read
into is the target sequence's whatever entry they sit in, so they go in the last (the empty
entries before them are 4 bytes each; nothing need know where the cells end).

A hybrid model's state goes on after the attention part with its recurrent part (whose size
:meth:`StreamLayout.portable` is told); a purely recurrent model has no attention part, and
its states are left as they are.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import EngineError

_U32 = struct.Struct("<I")
#: llama.cpp's header of a sequence's state: its magic number and the sequence id
HEADER = 8


@dataclass(frozen=True)
class StreamLayout:
    """The KV streams of a context: how many (``n_stream``), and whether its states begin
    with them (``has_attention``: not a purely recurrent model)."""

    n_stream: int
    has_attention: bool = True

    def portable(self, data: bytes, stream: int, tail: int = 0) -> bytes:
        """``data``, the state of the sequence in ``stream``, with one stream header; ``tail``:
        bytes after the attention part (a hybrid model's recurrent part, without its header). :class:`EngineError`
        where the state is not laid out as llama.cpp lays out one sequence's state."""
        n = self.n_stream
        if n == 1 or not self.has_attention:
            return data
        head, body = data[:HEADER], data[HEADER:]
        if not 0 <= stream < n or not 0 <= tail <= len(body):
            raise EngineError(f"No KV stream {stream} of {n}, or a tail of {tail} bytes in a state of {len(data)}.")
        end = len(body) - tail - 4 * (n - 1 - stream)  # the sequence's cells end here, zeros follow
        start = 4 + 4 * stream
        if (len(body) < 4 + 4 * n or _U32.unpack_from(body, 0)[0] != n or end < start + 4
                or any(body[4:start]) or any(body[end:len(body) - tail])
                or (_U32.unpack_from(body, start)[0] == 0) != (end == start + 4)):
            raise EngineError(f"llama.cpp's KV state does not have the layout of one sequence in {n} streams.")
        return head + _U32.pack(1) + body[start:end] + body[end + 4 * (n - 1 - stream):]

    def native(self, data: bytes) -> bytes:
        """A :meth:`portable` state in this context's form."""
        n = self.n_stream
        if n == 1 or not self.has_attention:
            return data
        if len(data) < HEADER + 8 or _U32.unpack_from(data, HEADER)[0] != 1:
            raise EngineError("The saved KV state is not in the one-stream form: it cannot be restored here.")
        return data[:HEADER] + _U32.pack(n) + bytes(4 * (n - 1)) + data[HEADER + 4:]
