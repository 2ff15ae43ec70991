"""Deploying the fleet on a running Ray cluster, and serving until stopped (``gguf-mcv serve --ray``)."""

from __future__ import annotations

import logging
import time
from typing import Any

from ..errors import ClusterError, ConfigError
from ..server.app import API_KEY_ENV, is_loopback
from .policy import DEFAULT_IMBALANCE

log = logging.getLogger("gguf_mcv.fleet")
APP_NAME = "gguf_mcv"


def check_replicas(replicas: object) -> int:
    """``replicas`` as a positive whole number; :class:`ConfigError` otherwise."""
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ConfigError(f"--replicas must be a whole number >= 1, not {replicas!r}.")
    return replicas


def deploy(address: str, load_kwargs: dict[str, Any], *, replicas: int = 1, host: str = "127.0.0.1",
           port: int = 8080, app_kwargs: dict[str, Any] | None = None, imbalance: int = DEFAULT_IMBALANCE,
           spread: bool = True, affinity: bool = True) -> str:
    """Deploy the fleet on the cluster at ``address`` (``"auto"``: this machine's); its base URL.

    Returns once every replica has loaded its model. :class:`ClusterError` when the cluster
    cannot be reached or the replicas cannot start; :class:`ConfigError` for bad settings.
    """
    check_replicas(replicas)
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(f"Port {port} is out of range: use a port from 1 to 65535.")
    app_kwargs = dict(app_kwargs or {})
    if app_kwargs.get("allowed_hosts") is None and not is_loopback(host):
        app_kwargs["allowed_hosts"] = ["*"]  # as the single server: bound for the network, any Host
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ConfigError(f"Serving on Ray needs its extra: pip install 'gguf-mcv[cluster]' ({exc}).") from None
    from ..jobs.batch_ray import check_reachable  # the batch job's check: a dead address fails fast
    from .deployment import application

    check_reachable(address)
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False, ignore_reinit_error=True)
    except (ConnectionError, RuntimeError) as exc:
        raise ClusterError(f"Cannot reach the Ray cluster at {address}: {exc}") from None
    _fresh_registry(ray)
    serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
    try:
        serve.run(application(load_kwargs, replicas=replicas, app_kwargs=app_kwargs, imbalance=imbalance,
                              spread=spread, affinity=affinity), name=APP_NAME, route_prefix="/")
    except (RuntimeError, ray.exceptions.RayError) as exc:
        raise ClusterError(f"The fleet could not start on the Ray cluster: {exc}") from exc
    if not app_kwargs.get("api_key") and not is_loopback(host):
        log.warning("Serving on %s without an API key: anyone who can reach it can use the model. "
                    "Set %s or pass --api-key.", host, API_KEY_ENV)
    return f"http://{host}:{port}"


def serve_on_ray(address: str, load_kwargs: dict[str, Any], **options: Any) -> None:
    """:func:`deploy`, then serve until interrupted; the application is deleted on the way out."""
    from ray import serve

    url = deploy(address, load_kwargs, **options)
    # a warning, so it shows at the default level: the line a script waits for
    log.warning("Serving on %s (Ray Serve, %d replicas); Ctrl-C stops.", url, options.get("replicas", 1))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)


def _fresh_registry(ray: Any) -> None:
    """A new deployment lists its own replicas only: an earlier one's registry is stopped."""
    from .registry import REGISTRY_NAME, REGISTRY_NAMESPACE

    try:
        ray.kill(ray.get_actor(REGISTRY_NAME, namespace=REGISTRY_NAMESPACE))
    except ValueError:  # none yet
        pass
