"""``gguf-mcv serve``'s processes: the model lives in a worker that is started again when it dies.

:func:`serve_supervised` binds the listening socket, then runs uvicorn's own worker
supervision (:class:`uvicorn.supervisors.Multiprocess`, one worker). The worker builds
the model and the app (``load_model()``, then :func:`~gguf_mcv.server.build_app`) and
serves the socket itself, so answers and streams never cross a process boundary.

A native crash or an out-of-memory kill of the worker ends only the connections it held
(their clients see the connection close); the supervisor keeps the socket (new
connections wait in its backlog) and starts a worker again with the same settings;
conversations kept with ``keep_chats`` come back from disk. The new worker's ``/health``
reports ``worker_restarts``, ``last_worker_restart`` (Unix time) and ``last_worker_exit``;
``/metrics`` counts ``gguf_mcv_worker_restarts``.

Before any worker has served, a worker that dies :data:`MAX_LOAD_CRASHES` times in a row
stops the server with :class:`~gguf_mcv.errors.ServerWorkerError` rather than looping; so
does a load that raises (its message, once: it would fail the same way again). Once a
worker has served, a load that fails or dies is tried again after the delays of
:data:`LOAD_RETRY_DELAYS_S` (what it needs, a model file being copied or a folder moved
back, may come back); meanwhile a stand-in process holds the port and answers ``/health``
(503: ``last_load_error``, ``next_load_retry``) and every other route with a 503 in the
API's error shape. The server stops when the last delay has passed and the load fails
again. A worker that stops answering the supervisor's ping for
:data:`HEALTHCHECK_TIMEOUT_S` is killed and replaced; ``last_worker_exit`` says so. A
worker that stops cleanly (exit status 0: Ctrl-C reaches the whole process group) stops
the server, and so does SIGHUP (a closed terminal; uvicorn would start a second model
beside the first).
"""

from __future__ import annotations

import errno
import functools
import inspect
import logging
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI
from uvicorn import Config
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors.multiprocess import SIGNALS, Multiprocess, Process

from ..children import describe_exit
from ..errors import ConfigError, GgufMcvError, ServerWorkerError
from ..model import Model
from ..runtime import native_check
from . import http_errors
from .app import API_KEY_ENV, HTTP_PARSER, addresses_to_bind, bind_failure, build_app, is_loopback
from .logs import log_config
from .malloc import return_large_buffers_to_os
from .standby import standby_app
from .state import WorkerInfo

log = logging.getLogger("uvicorn.error")  # uvicorn's format and level, as its own lines

#: Workers dying in a row before any serves: the server then stops.
MAX_LOAD_CRASHES = 3
#: Seconds a serving worker may leave the supervisor's ping unanswered before it counts as
#: hung and is killed (the ping thread needs the GIL, which a busy worker holds at times).
HEALTHCHECK_TIMEOUT_S = 30
#: Seconds between tries to load the model again once a worker has served and a load failed
#: (doubling to a minute, about 5 minutes in all); after the last the server stops.
LOAD_RETRY_DELAYS_S: tuple[float, ...] = (1, 2, 4, 8, 16, 30, 60, 60, 60, 60)
#: Seconds a stopping worker has (answers cut after 5, idle conversations saved) before it is killed.
STOP_TIMEOUT_S = 60.0
#: The fault name a worker injects at its start (``$GGUF_MCV_NATIVE_FAULT``, tests only).
FAULT_NAME = "serve-worker"


@dataclass(frozen=True)
class _Worker:
    """What every worker gets: how to load the model and the app's options."""

    load_model: Callable[[], Model]
    options: dict[str, Any]
    run_dir: str  #: where a worker leaves its marks (see ``_marker``)
    supervisor: int = field(default_factory=os.getpid)  #: the supervisor's pid


def serve_supervised(load_model: Callable[[], Model], *, host: str = "127.0.0.1", port: int = 8080,
                     log_level: str = "info", **options: Any) -> None:
    """Serve the model ``load_model()`` returns from a worker process that is started again when
    it dies, until interrupted (see the module doc; call it from the main thread: it handles
    the signals that stop it). ``options`` are :func:`build_app`'s.

    ``load_model`` runs in each worker, so it must pickle: a module-level function or a
    :func:`functools.partial` of one, e.g. ``partial(gguf_mcv.load, "minicpm-v-4")``.
    :class:`ConfigError` if the address cannot be served; :class:`ServerWorkerError` if the
    model cannot be loaded, or the worker dies :data:`MAX_LOAD_CRASHES` times in a row loading it.
    """
    try:
        inspect.signature(build_app).bind(None, **options)
    except TypeError as exc:
        raise ConfigError(f"serve_supervised takes build_app's options: {exc}.") from None
    if options.get("max_queue", 0) < 0 or options.get("max_body_bytes", 1) < 1:
        raise ConfigError("max_queue must be >= 0 and max_body_bytes >= 1.")
    try:
        pickle.dumps(load_model)
    except Exception as exc:  # pickle raises several kinds
        raise ConfigError(f"load_model must pickle (it runs in the worker process): use a module-level "
                          f"function or a functools.partial of one ({exc}).") from None
    if options.get("allowed_hosts") is None and not is_loopback(host):
        options["allowed_hosts"] = ["*"]  # for the network, as serve() is (see build_app)
    sockets = bind_sockets(host, port)
    try:
        with tempfile.TemporaryDirectory(prefix="gguf-mcv-serve-") as run_dir:
            worker = _Worker(load_model, options, run_dir)
            # a graceful-shutdown limit: an endless stream must not keep Ctrl-C waiting
            config = Config(functools.partial(_worker_app, worker, WorkerInfo()), factory=True,
                            log_level=log_level, log_config=log_config(log_level), timeout_graceful_shutdown=5,
                            timeout_worker_healthcheck=HEALTHCHECK_TIMEOUT_S, http=HTTP_PARSER)
            key = os.environ.get(API_KEY_ENV) if options.get("api_key") is None else options["api_key"]
            if not key and not is_loopback(host):
                log.warning("Serving on %s without an API key: anyone who can reach it can use the model. "
                            "Set %s or pass api_key.", host, API_KEY_ENV)
            Supervisor(config, sockets, worker, f"http://{_url_host(host)}:{port}").run()
    finally:
        for sock in sockets:
            sock.close()


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """The listening sockets the workers share: each address of ``host``, bound as asyncio's
    server would bind it (reusing the address, IPv6 only on IPv6); :class:`ConfigError` if one
    cannot be, as :func:`~gguf_mcv.server.check_bind` says."""
    addresses = addresses_to_bind(host, port)
    sockets: list[socket.socket] = []
    lacking: list[OSError] = []
    try:
        for family, kind, proto, _, sockaddr in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                lacking.append(exc)  # as asyncio does: skipped if another address binds
                sockets.pop().close()
            else:
                sock.set_inheritable(True)
        if not sockets:
            raise lacking[0]
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise ConfigError(bind_failure(host, port, exc)) from None
    return sockets


class Supervisor(Multiprocess):
    """uvicorn's supervisor of one worker: counting restarts, stopping a crash loop, retrying
    the load of a server that has served (see the module doc)."""

    def __init__(self, config: Config, sockets: list[socket.socket], worker: _Worker, url: str) -> None:
        self._handlers = {sig: signal.getsignal(sig) for sig in SIGNALS}
        super().__init__(config, sockets)  # replaces those signal handlers until run() ends
        self.worker, self.url = worker, url
        self.info = WorkerInfo()
        self.serving = False  #: the current worker finished its start-up
        self.served = False  #: a worker has served since the server started
        self.load_crashes = 0  #: workers that died in a row before loading the model
        self.load_failures = 0  #: loads that failed in a row after a worker had served
        self.retry_at: float | None = None  #: while a stand-in holds the port: when to load again
        self.answered_at = time.monotonic()  #: when the worker last answered a ping
        self.failure: str | None = None
        self.announced = False

    def run(self) -> None:
        """Supervise until a signal stops the server; :class:`ServerWorkerError` after a load failure."""
        try:
            self.init_processes()
            while not self.should_exit.wait(0.5):
                self.handle_signals()
                self.keep_subprocess_alive()
            self.terminate_all()
            self.join_all()
        finally:
            for sig, handler in self._handlers.items():
                signal.signal(sig, handler)
        if self.failure is not None:
            raise ServerWorkerError(self.failure)

    def init_processes(self) -> None:
        self._start(functools.partial(_worker_app, self.worker, self.info))
        self.retry_at = None

    def _start(self, app: Callable[[], FastAPI]) -> None:
        self.config.app = app  # pickled by start()
        process = Process(self.config, self.sockets)
        process.start()
        self.processes, self.serving = [process], False
        self.answered_at = time.monotonic()

    def keep_subprocess_alive(self) -> None:
        if self.should_exit.is_set() or not self.processes:
            return
        process = self.processes[0]
        if self.retry_at is not None:  # a stand-in holds the port until the next load
            if time.time() < self.retry_at and process.process.is_alive():
                return
            _stop(process)
            self.info = replace(self.info, restarts=self.info.restarts + 1, last_restart=time.time(),
                                next_load_retry=None)
            self.init_processes()
            return
        how = None
        if process.process.is_alive():
            if not self.serving:  # starting: no hang check, a load takes what it takes
                self.serving = process.is_ready(timeout=0.5)
                self.answered_at = time.monotonic()
                if self.serving and not self.announced:
                    self.announced = True
                    log.info("Serving on %s (Press CTRL+C to quit); the model runs in worker process [%s].",
                             self.url, process.pid)
                return
            answered = ping(process, self.config.timeout_worker_healthcheck)
            if answered:
                self.answered_at = time.monotonic()
                return
            if answered is None:  # silent while alive; False: it exited while pinged (its exit says why)
                silent = time.monotonic() - self.answered_at
                how = f"killed by the supervisor: hung, it had not answered for {silent:.0f} s"
                log.error("The model worker [%s] did not answer for %.0f s: killing it.", process.pid, silent)
        process.kill()
        process.process.join()  # uvicorn's join() logs a line for it
        self._after(process, how)

    def _after(self, process: Process, how: str | None = None) -> None:
        """Start a worker again after ``process`` died (``how``: killed by the supervisor), or stop the server."""
        code = process.exitcode if process.exitcode is not None else -signal.SIGKILL
        if how is None and code == FILES_CHANGED_EXIT:
            how = "ended by itself: a weights file changed under its model"
        if how is None:
            how = describe_exit(code) + (" (out of memory?)" if code == -signal.SIGKILL else "")
        loaded = _marker(self.worker.run_dir, "loaded", process.pid).exists()
        if code == 0:
            log.info("The model worker [%s] stopped: stopping the server.", process.pid)
            self.should_exit.set()
            return
        if loaded:
            self.served, self.load_crashes, self.load_failures = True, 0, 0
        elif self.served:  # it loaded before: what it needs may come back (a file being copied)
            error = (_read_error(self.worker.run_dir, process.pid) if code == STARTUP_FAILURE else None) or (
                f"the worker was {how} while loading the model")
            self._retry_later(how, error)
            return
        elif code == STARTUP_FAILURE:  # the first load raised: it would again
            self.failure = _read_error(self.worker.run_dir, process.pid) or (
                f"The model worker could not start ({how}): see the log above.")
            self.should_exit.set()
            return
        else:
            self.load_crashes += 1
        if self.load_crashes >= MAX_LOAD_CRASHES:
            self.failure = (
                f"The model worker died {self.load_crashes} times in a row while loading the model "
                f"(last: {how}); the server stops. See the log above: a native kernel this machine "
                "cannot run (gguf-mcv plan shows the native check's findings) or too little memory "
                "(try a smaller --quant or --ctx) are the usual causes.")
            self.should_exit.set()
            return
        self.info = replace(self.info, restarts=self.info.restarts + 1, last_restart=time.time(), last_exit=how)
        log.warning("The model worker [%s] was %s while %s; starting it again (restart %d).", process.pid,
                    how, "serving: answers in progress were cut off" if loaded else "loading the model",
                    self.info.restarts)
        self.init_processes()

    def _retry_later(self, how: str, error: str) -> None:
        """After a failed load of a server that has served: a stand-in until the next try, or the end."""
        self.load_failures += 1
        if self.load_failures > len(LOAD_RETRY_DELAYS_S):
            self.failure = (f"The model could not be loaded again: {self.load_failures} tries in a row failed "
                            f"over {sum(LOAD_RETRY_DELAYS_S):.0f} s (last: {error}); the server stops.")
            self.should_exit.set()
            return
        delay = LOAD_RETRY_DELAYS_S[self.load_failures - 1]
        retry_at = time.time() + delay
        self.info = replace(self.info, last_exit=how, last_load_error=error, next_load_retry=retry_at)
        log.warning("Loading the model again failed (%s); trying again in %g s (try %d of %d).", error, delay,
                    self.load_failures + 1, len(LOAD_RETRY_DELAYS_S) + 1)
        self._start(functools.partial(standby_app, self.info, self.worker.options))
        self.retry_at = retry_at

    def handle_hup(self) -> None:
        # a closed terminal, as before the split (uvicorn would start a second model beside the first)
        log.info("Received SIGHUP, exiting.")
        self.should_exit.set()

    def handle_ttin(self) -> None:
        log.info("Received SIGTTIN: ignored, one worker holds the model.")

    def handle_ttou(self) -> None:
        log.info("Received SIGTTOU: ignored, one worker holds the model.")

    def join_all(self) -> None:
        for process in self.processes:
            process.process.join(STOP_TIMEOUT_S)
            if process.process.is_alive():
                log.warning("The model worker [%s] did not stop within %.0f s: killing it.", process.pid,
                            STOP_TIMEOUT_S)
                process.kill()
                process.process.join()  # uvicorn's join() logs a line for it


def _stop(process: Process) -> None:
    """Stop a stand-in (SIGTERM, then SIGKILL if it has not stopped within :data:`STOP_TIMEOUT_S`)."""
    process.terminate()
    process.process.join(STOP_TIMEOUT_S)
    if process.process.is_alive():
        process.kill()
        process.process.join()


def _worker_app(worker: _Worker, info: WorkerInfo) -> FastAPI:
    """In a worker: load the model and build the app. A load that raises leaves its message for
    the supervisor and ends the worker with uvicorn's start-up failure status."""
    _die_with(worker.supervisor)
    if hasattr(signal, "SIGHUP"):  # a closed terminal: the supervisor stops this worker cleanly
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    native_check.inject_fault(FAULT_NAME)
    model = None
    try:
        model = worker.load_model()
        app = build_app(model, **worker.options)
    except Exception as exc:
        if model is not None:
            model.close()
        if not isinstance(exc, (GgufMcvError, OSError)):  # a bug, not bad input: its traceback
            log.exception("Loading the model failed:")
        _write(_marker(worker.run_dir, "error", os.getpid()), " ".join(str(exc).split()) or type(exc).__name__)
        sys.exit(STARTUP_FAILURE)
    app.state.gguf.worker = info
    http_errors.on_model_file_changed = _end_for_reload
    return_large_buffers_to_os()
    _write(_marker(worker.run_dir, "loaded", os.getpid()), "")
    return app


#: A worker's exit status when a weights file changed under its model: the supervisor starts a
#: new worker, which loads the files as they are now (or waits for them, on the retry schedule).
FILES_CHANGED_EXIT = 3
#: Seconds a worker whose files changed keeps running, so its 503 answers reach their clients.
FILES_CHANGED_GRACE_S = 1.0


def ping(process: Process, timeout: float) -> bool | None:
    """Whether the worker ``process`` answers a ping within ``timeout`` seconds: True, it did;
    False, it exited first; None, it is alive and silent.

    uvicorn's own ``Process.ping`` waits only on the pipe, whose worker end the supervisor holds
    too: a worker that exits while pinged (one whose files changed) would read as hung for the
    whole timeout. Waiting on the process's sentinel as well tells the two apart at once."""
    deadline = time.monotonic() + timeout
    try:
        process.parent_conn.send(b"ping")
        ready = wait([process.parent_conn, process.process.sentinel], timeout)
        if process.parent_conn in ready:
            process.parent_conn.recv()
            return True
    except (OSError, EOFError, pickle.UnpicklingError):
        pass
    # the sentinel closes as the worker exits, a moment before the exit can be reaped: a busy
    # machine would read that moment as silence
    while process.process.exitcode is None and time.monotonic() < deadline:
        if not wait([process.process.sentinel], 0):
            return None
        time.sleep(0.01)
    return False if process.process.exitcode is not None else None


def _end_for_reload(exc: BaseException) -> None:
    """In a worker whose model's files changed: end it soon, with :data:`FILES_CHANGED_EXIT`. Every
    answer it could still give would be refused the same way, and the mapped weights may be gone."""
    log.warning("%s The model worker [%s] ends so that the model is loaded again.", exc, os.getpid())
    timer = threading.Timer(FILES_CHANGED_GRACE_S, os._exit, args=(FILES_CHANGED_EXIT,))
    timer.daemon = True
    timer.start()


def _die_with(supervisor: int) -> None:
    """Linux: a SIGTERM (a clean stop) for this worker when the supervisor dies, even by SIGKILL,
    so no orphan keeps the model and the port."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != supervisor:  # it died before the call
            os.kill(os.getpid(), signal.SIGTERM)


def _marker(run_dir: str, kind: str, pid: int | None) -> Path:
    """A worker's file in the run folder: ``error-<pid>`` (why its load failed), ``loaded-<pid>``."""
    return Path(run_dir) / f"{kind}-{pid}"


def _write(path: Path, text: str) -> None:
    try:
        path.with_suffix(".tmp").write_text(text)
        os.replace(path.with_suffix(".tmp"), path)
    except OSError:
        log.error("Cannot write %s: %s", path, text)


def _read_error(run_dir: str, pid: int | None) -> str | None:
    try:
        return _marker(run_dir, "error", pid).read_text() or None
    except OSError:
        return None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
