"""Deploying the fleet on a running Ray cluster, and serving until stopped (``gguf-mcv serve --ray``)."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from ..errors import ClusterError, ConfigError, NoQuantFitsError
from ..server.app import API_KEY_ENV, is_loopback
from .policy import DEFAULT_IMBALANCE
from .quant import GIVEN, NodeAllowance, allowance, common_quant, local_reason

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

    Every replica loads one quant: ``load_kwargs["quant"]``, else the best every node allows
    (:func:`fleet_quant`, before any replica starts). Returns once every replica has loaded its
    model. :class:`ClusterError` when the cluster cannot be reached, already runs a fleet (checked
    before anything loads), or the replicas cannot start
    (:class:`~.quant.FleetQuantError` when no quant fits a node); :class:`ConfigError` for bad settings.
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
    _refuse_a_running_fleet(serve, address)
    load_kwargs, reason = fleet_quant(load_kwargs, num_cpus=load_kwargs.get("n_threads") or 1)
    _fresh_registry(ray)
    serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
    try:
        serve.run(application(load_kwargs, replicas=replicas, app_kwargs=app_kwargs, imbalance=imbalance,
                              spread=spread, affinity=affinity, quant_reason=reason),
                  name=APP_NAME, route_prefix="/")
    except (RuntimeError, ray.exceptions.RayError) as exc:
        raise ClusterError(f"The fleet could not start on the Ray cluster: {exc}") from exc
    if not app_kwargs.get("api_key") and not is_loopback(host):
        log.warning("Serving on %s without an API key: anyone who can reach it can use the model. "
                    "Set %s or pass --api-key.", host, API_KEY_ENV)
    return f"http://{host}:{port}"


#: The states of a Serve application that is still there to be replaced (a failed deploy is not)
_LIVE = {"NOT_STARTED", "DEPLOYING", "RUNNING", "UNHEALTHY"}


def _refuse_a_running_fleet(serve: Any, address: str) -> None:
    """A cluster serves one fleet: :class:`ClusterError` when one is there already. Deploying
    would replace it under its clients, and on the port its Serve first listened on."""
    try:
        running = serve.status().applications.get(APP_NAME)
    except Exception as exc:  # noqa: BLE001 - Ray's own errors, many classes: the cluster's state is unknown
        raise ClusterError(f"Cannot read Ray Serve's state on the cluster at {address}: {exc}") from None
    status = None if running is None else str(getattr(running.status, "value", running.status))
    if status in _LIVE:
        raise ClusterError(
            f"A gguf-mcv fleet already runs on the Ray cluster at {address} (Serve application {APP_NAME!r}, "
            f"{status}): stop it first (Ctrl-C its `gguf-mcv serve "
            "--ray`; if that process is gone, Ray's `serve shutdown -y` stops Serve on the cluster).")


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


def fleet_quant(load_kwargs: dict[str, Any], *, num_cpus: float = 1) -> tuple[dict[str, Any], str]:
    """``load_kwargs`` with the quant every replica loads, and why (``/health``'s ``quant_reason``).

    ``quant`` given: kept. A model name: the best quant every alive node with ``num_cpus`` CPUs
    allows (:func:`survey`, :func:`~.quant.common_quant`; :class:`~.quant.FleetQuantError` when a
    node allows none). Local files: their own. ``"auto"``: left to each replica's plan. Needs
    ``ray.init`` done."""
    if load_kwargs.get("model_path"):
        return load_kwargs, local_reason(load_kwargs)[1]
    if load_kwargs.get("quant"):
        return load_kwargs, GIVEN
    if load_kwargs.get("model") == "auto":
        return load_kwargs, "planned by each replica on its own node ('auto' picks the model there)"
    quant, reason = common_quant(survey(load_kwargs, num_cpus=num_cpus))
    log.warning("One quant for every replica: %s (%s).", quant, reason)
    return {**load_kwargs, "quant": quant}, reason


def survey(load_kwargs: dict[str, Any], *, num_cpus: float = 1) -> list[NodeAllowance]:
    """What each alive node with ``num_cpus`` CPUs (one that may hold a replica) allows: its own
    plan, made there by a Ray task that takes no CPU (it runs beside whatever holds them)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= num_cpus]
    task = ray.remote(num_cpus=0)(node_allowance)
    pending = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(load_kwargs)
               for node in nodes]
    try:
        return list(ray.get(pending))
    except ray.exceptions.RayTaskError as exc:
        raise ClusterError(f"Planning the fleet's quant on a node failed: {exc.cause}") from None


def node_allowance(load_kwargs: dict[str, Any]) -> NodeAllowance:
    """This node's plan for ``load_kwargs`` (:func:`gguf_mcv.resolver.plan` on this machine, as
    ``load()`` would plan it here) as a :class:`~.quant.NodeAllowance`."""
    import ray

    from ..planning.planner import LoadChoices
    from ..resolver import plan

    node = ray.get_runtime_context().get_node_id()
    k = load_kwargs
    given = LoadChoices(n_threads=k.get("n_threads"), n_threads_batch=k.get("n_threads_batch"),
                        n_gpu_layers=k.get("n_gpu_layers", 0), vision_gpu=k.get("vision_gpu"),
                        parallel=k.get("parallel", 1))
    limited = k.get("min_tokens_per_s") is not None or k.get("max_first_answer_s") is not None
    try:
        planned = plan(k["model"], ram_budget=k.get("ram_budget"), n_ctx=k.get("n_ctx"),
                       kv_cache_type=k.get("kv_cache_type"), revision=k.get("revision"),
                       min_tokens_per_s=k.get("min_tokens_per_s"), max_first_answer_s=k.get("max_first_answer_s"),
                       speed_probe=None if limited else False, vision_backend=k.get("vision_backend", "auto"),
                       vision_weights=k.get("vision_weights"), given=given)
    except NoQuantFitsError as exc:
        return NodeAllowance(node, socket.gethostname(), None, (), str(exc).splitlines()[0])
    return allowance(node, planned)


def _fresh_registry(ray: Any) -> None:
    """A new deployment lists its own replicas only: an earlier one's registry is stopped."""
    from .registry import REGISTRY_NAME, REGISTRY_NAMESPACE

    try:
        ray.kill(ray.get_actor(REGISTRY_NAME, namespace=REGISTRY_NAMESPACE))
    except ValueError:  # none yet
        pass
