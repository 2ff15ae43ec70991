"""The HTTP API on Ray Serve: one address for a fleet, each conversation answered where its cache is.

    from gguf_mcv.fleet import deploy
    deploy("auto", {"model": "minicpm-v-4.6"}, replicas=3)     # http://127.0.0.1:8080, as `gguf-mcv serve`

Modules: ``keys`` (a request's routing key), ``policy`` (the choice of replica, pure),
``router`` (the policy as Serve's request router), ``asgi`` (a forwarded request through the
server's app), ``deployment`` (the front and the replicas), ``quant`` (the one quant every node
allows, pure), ``run`` (deploying on a cluster, the quant chosen first).
``keys``, ``policy`` and ``quant`` need no Ray; the others import it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["application", "deploy", "serve_on_ray"]


def __getattr__(name: str) -> Any:
    if name in ("deploy", "serve_on_ray"):  # imported when first asked for: they import Ray
        from . import run

        return getattr(run, name)
    if name == "application":
        from .deployment import application

        return application
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
