"""Answering under the queue: each answer on its own thread, streamed back, stopped on hang-up."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..errors import AnswerCancelled
from ..reply import Reply
from ..runtime.generation import Stream
from .bodies import read_body, require_json
from .gate import Place
from .http_errors import ClientGone, HTTPError, as_http_error, openai_error
from .state import State, state_of

T = TypeVar("T")

#: While a streamed SSE answer has not started (queued, or its images encoding), a
#: comment goes out this often, so clients and proxies with read timeouts keep waiting.
KEEPALIVE_S = 10.0


class _Job:
    """One answer generated on its own thread; what it yields reaches the event loop in a queue.

    The thread evaluates the prompt first (so bad images fail before a response starts),
    then iterates ``shape(stream)``, checking between items whether it was cancelled.
    ``done(outcome, reply, seconds)`` is called on the event loop when the thread ends;
    ``outcome`` is ``"answered"`` (with the reply), ``"cancelled"`` or ``"failed"``.
    """

    def __init__(self, start: Callable[[], Stream], shape: Callable[[Stream], Iterable[Any]],
                 done: Callable[[str, Reply | None, float], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._stop = threading.Event()
        self._start, self._shape, self._done = start, shape, done
        self._stream: Stream | None = None
        self.reply: Reply | None = None
        threading.Thread(target=self._run, name="gguf_mcv-answer", daemon=True).start()

    def cancel(self) -> None:
        """Stop the answer: between pieces, and within one image slice (or slot chunk) while
        its prompt is still being evaluated."""
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()

    async def ready(self) -> None:
        """Wait until the prompt has been evaluated; raise what went wrong before that."""
        kind, value = await self._events.get()
        if kind == "error":
            raise value

    async def items(self) -> AsyncIterator[Any]:
        """What ``shape`` yields, until the end; raises what went wrong."""
        while True:
            kind, value = await self._events.get()
            if kind == "error":
                raise value
            if kind == "end":
                self.reply = value
                return
            yield value

    async def result(self) -> Reply:
        async for _ in self.items():
            pass
        assert self.reply is not None
        return self.reply

    def _run(self) -> None:
        began, outcome, reply = time.perf_counter(), "failed", None
        try:
            self._stream = self._start()
            if self._stop.is_set():  # cancelled before the stream existed
                self._stream.cancel()
            stream = primed(self._stream)
            self._emit("ready", None)
            with stream:  # closing it stops generation and frees the model, on this thread
                for item in self._shape(stream):
                    if self._stop.is_set():
                        outcome = "cancelled"
                        return
                    self._emit("item", item)
            outcome, reply = "answered", stream.reply
            self._emit("end", reply)
        except AnswerCancelled as exc:
            outcome = "cancelled"
            self._emit("error", exc)
        except Exception as exc:
            self._emit("error", exc)
        finally:
            # a stream cancelled or failed while its prompt was evaluated is closed here, on
            # its own thread: left open, the model kept this thread as the one streaming, and
            # a later answer on a thread that reused its id was refused (ModelBusyError, a 500)
            if self._stream is not None:
                with contextlib.suppress(Exception):
                    self._stream.close()
            self._call(self._done, outcome, reply, time.perf_counter() - began)

    def _emit(self, kind: str, value: Any) -> None:
        self._call(self._events.put_nowait, (kind, value))

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is gone (server shut down)
            pass


def primed(stream: Stream) -> Stream:
    """Evaluate the prompt now (its errors surface here); a Stream of the same pieces.

    Closing the returned stream closes ``stream``.
    """
    try:
        first = [next(stream)]
    except StopIteration:  # an empty answer: stream.reply is set
        first = []

    def pieces() -> Generator[str, None, Reply]:
        with stream:
            if first:  # an exhausted Stream must not be iterated again: it would lose its reply
                yield first[0]
                yield from stream
        assert stream.reply is not None
        return stream.reply

    return Stream(pieces(), cancel=stream.cancel)


async def _or_hang_up(request: Request, awaitable: Awaitable[T]) -> T:
    """``await awaitable``, unless the client hangs up first: then :class:`ClientGone`."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_hung_up(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        raise ClientGone()
    return task.result()


async def _hung_up(request: Request) -> None:
    # the body has been read, so the next ASGI message is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def place_in_queue(request: Request) -> AsyncIterator[Place]:
    """A dependency, declared before the body's: the body, then a place in the queue.

    A full queue refuses the request (503) before its body is read; a body still arriving
    holds no place (see :func:`~.bodies.read_body` for its limits). The place is left when
    the request ends, unless a response or an answer took it over.
    """
    state = state_of(request)
    require_json(request)
    state.gate.check(state.metrics.retry_after())
    await read_body(request)
    place = state.gate.admit(state.metrics.retry_after())
    try:
        yield place
    finally:
        if place.owner == "request":
            place.leave()


async def _begin(request: Request, place: Place, start: Callable[[], Stream],
                 shape: Callable[[Stream], Iterable[Any]]) -> _Job:
    """Wait for the model, start the answer (it leaves ``place`` when it ends), wait until it runs."""
    state = state_of(request)
    await _or_hang_up(request, place.turn())
    job = _Job(start, shape, partial(_finished, state, place))
    place.owner = "answer"
    with _cancelled_on_error(job):
        await _or_hang_up(request, job.ready())
    return job


@contextmanager
def _cancelled_on_error(job: _Job) -> Iterator[None]:
    """Stop ``job`` if anything goes wrong (a hang-up too); answer its errors over HTTP."""
    try:
        yield
    except (ClientGone, HTTPError):
        job.cancel()
        raise
    except Exception as exc:
        job.cancel()
        raise as_http_error(exc) from None
    except BaseException:
        job.cancel()
        raise


def _finished(state: State, place: Place, outcome: str, reply: Reply | None, seconds: float) -> None:
    place.leave()
    state.metrics.record(outcome, reply, seconds)


async def answer(request: Request, place: Place, start: Callable[[], Stream]) -> Reply:
    """The whole answer (the generation stops if the client hangs up)."""
    job = await _begin(request, place, start, iter)
    with _cancelled_on_error(job):
        return await _or_hang_up(request, job.result())


async def answer_stream(request: Request, place: Place, start: Callable[[], Stream],
                        shape: Callable[[Stream], Iterable[Any]], ndjson: bool) -> Response:
    """A streaming response of what ``shape`` makes of the answer: NDJSON lines or SSE events.

    An SSE answer that has not started within :data:`KEEPALIVE_S` (a long queue, a long
    image encoding) gets its response started anyway, with SSE comments until it does;
    its errors then arrive in the stream. NDJSON has no comments: it waits.
    """
    if ndjson:
        job = await _begin(request, place, start, shape)
        return _AnswerResponse(_ndjson_lines(job), "application/x-ndjson", stop=job.cancel)
    begun = asyncio.ensure_future(_begin(request, place, start, shape))
    try:
        await asyncio.wait({begun}, timeout=KEEPALIVE_S)
    except BaseException:
        begun.cancel()
        raise
    if begun.done():
        job = begun.result()
        return _AnswerResponse(_sse_events(job), "text/event-stream", stop=job.cancel)
    if place.owner == "request":  # else the answer has its place already
        place.owner = "response"
    return _AnswerResponse(_sse_once_begun(begun), "text/event-stream",
                           stop=partial(_abandon, begun, place))


class _AnswerResponse(StreamingResponse):
    """A streaming answer that calls ``stop`` however the response ends (a hang-up too)."""

    def __init__(self, content: AsyncIterator[str], media_type: str, stop: Callable[[], None]) -> None:
        super().__init__(content, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.stop = stop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stop()


def _abandon(begun: asyncio.Task[_Job], place: Place) -> None:
    """Stop an answer whose response has ended, whether or not the answer had started."""
    if begun.done() and not begun.cancelled() and begun.exception() is None:
        begun.result().cancel()
    begun.cancel()  # still waiting for the model or the prompt: give up
    if place.owner == "response":  # no answer thread took the place over
        place.leave()


async def _sse_once_begun(begun: asyncio.Task[_Job]) -> AsyncIterator[str]:
    """SSE comments until the answer has started, then its events (its errors in the stream)."""
    while not begun.done():
        yield ": keep-alive\n\n"
        await asyncio.wait({begun}, timeout=KEEPALIVE_S)
    try:
        job = begun.result()
    except ClientGone:
        return
    except Exception as exc:
        yield _sse_error(exc)
        yield "data: [DONE]\n\n"
        return
    async for event in _sse_events(job):
        yield event


async def _sse_events(job: _Job) -> AsyncIterator[str]:
    try:
        async for chunk in job.items():
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    except Exception as exc:  # the response has started: the error goes in the stream
        yield _sse_error(exc)
    yield "data: [DONE]\n\n"


def _sse_error(exc: Exception) -> str:
    return f"data: {json.dumps(openai_error(as_http_error(exc)), ensure_ascii=False)}\n\n"


async def _ndjson_lines(job: _Job) -> AsyncIterator[str]:
    try:
        async for line in job.items():
            yield json.dumps(line, ensure_ascii=False) + "\n"
    except Exception as exc:
        yield json.dumps({"error": as_http_error(exc).message}, ensure_ascii=False) + "\n"
