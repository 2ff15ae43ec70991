"""``gguf-mcv serve``: the HTTP server."""

from __future__ import annotations

import argparse

from ..errors import ConfigError
from ..options import (
    check_number,
)
from .loading import checked_load_kwargs, load_model


def run_serve(args: argparse.Namespace) -> int:
    try:
        from ..server import check_bind, serve_supervised  # lazy: per command, and an optional extra
        from ..server.logs import configure_logging
        from ..server.origins import check_allowed
    except ImportError as exc:
        raise ConfigError(f"The server needs its extra: pip install 'gguf-mcv[server]' ({exc}).") from exc
    if args.ray is None and args.replicas != 1:
        raise ConfigError("--replicas needs --ray ADDRESS: one server runs one model (see docs/cluster.md).")
    if args.ray is None:
        check_bind(args.host, args.port)  # a bad address or a port in use, before minutes of loading
    from functools import partial  # lazy: per command

    from ..units import parse_size  # lazy: per command

    keep_bytes = parse_size(args.keep_chats_size)  # a bad size, before minutes of loading
    memory = _memory_cap(args.keep_chats_memory)
    check_allowed(args.allowed_host or (), args.allowed_origin)
    if not check_number("--body-timeout", args.body_timeout) > 0:
        raise ConfigError(f"--body-timeout must be more than 0 seconds, not {args.body_timeout:g}.")
    load = checked_load_kwargs(args)  # a missing file or a bad setting, before a worker starts
    if args.ray is not None:
        return _serve_on_ray(args, load, keep_bytes, memory)
    configure_logging()  # the supervisor's warnings show too (each worker configures its own)
    # the model is loaded (again, if it dies) in the server's worker process: load_model travels by name
    serve_supervised(partial(load_model, args), host=args.host, port=args.port, api_key=args.api_key,
                     max_queue=args.max_queue, allow_local_files=args.allow_local_files,
                     allow_remote_media=args.allow_remote_media, truncate=args.truncate,
                     keep_chats=args.keep_chats, keep_chats_bytes=keep_bytes, keep_chats_memory=memory,
                     body_timeout_s=args.body_timeout, allowed_hosts=args.allowed_host,
                     allowed_origins=args.allowed_origin)
    return 0


def _memory_cap(text: str) -> int | str:
    """``--keep-chats-memory``: ``auto``, ``off`` or a size in bytes."""
    from ..units import parse_size  # lazy: per command

    if text in ("auto", "off"):
        return text
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise ConfigError(f"--keep-chats-memory takes 'auto', 'off' or a size such as 512MiB: {exc}") from None


def _serve_on_ray(args: argparse.Namespace, load: dict, keep_bytes: int, memory: int | str) -> int:
    """``serve --ray``: the same app on every replica, deployed with Ray Serve (gguf_mcv.fleet)."""
    from ..fleet.run import check_replicas, serve_on_ray  # lazy: an optional extra
    from ..server.logs import configure_logging

    check_replicas(args.replicas)
    configure_logging()
    serve_on_ray(args.ray, load, replicas=args.replicas, host=args.host, port=args.port, app_kwargs=dict(
        api_key=args.api_key, max_queue=args.max_queue, allow_local_files=args.allow_local_files,
        allow_remote_media=args.allow_remote_media, truncate=args.truncate, keep_chats=args.keep_chats,
        keep_chats_bytes=keep_bytes, keep_chats_memory=memory, body_timeout_s=args.body_timeout,
        allowed_hosts=args.allowed_host, allowed_origins=args.allowed_origin))
    return 0
