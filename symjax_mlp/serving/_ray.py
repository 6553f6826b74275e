"""An artifact as a Ray Serve application: replicas, each a :class:`Batcher` behind our ASGI app.

Each health check copies a replica's counters into ``ray.serve.metrics`` gauges; nothing is
added per request. Ray is imported only here, when used.
"""

from __future__ import annotations

import os
import socket
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax

from symjax_mlp._artifact.format import printable
from symjax_mlp._errors import ConfigError
from symjax_mlp.serving._app import create_app, load_entry, model_name, require
from symjax_mlp.serving._batcher import Batcher
from symjax_mlp.serving._intake import check_limits, serving_batch
from symjax_mlp.serving._latency import latency_mode
from symjax_mlp.serving._requests import (
    artifact_specs,
    bucket_sizes,
    check_count,
    seconds,
    short,
)
from symjax_mlp.serving._server import bind, on_signals

_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "traces",
    "/jax/core/compile/backend_compile_duration": "compiles",
}
_GAUGES = ("requests", "completed", "failed", "rejected", "batches", "rows", "padded_rows")
_GAUGES += ("queue_depth", "traces", "compiles")


#: Set in each replica's environment (a value the caller gives in ``runtime_env`` wins): Ray
#: Serve then runs ``predict`` on the replica's own event loop, not on a second loop in another
#: thread, so a request crosses no thread to reach the batcher and none to come back (two
#: thread wake-ups and ~9 system calls a request less; Ray's throughput mode sets it too). What
#: the batcher runs on a loop is bounded: a lone request, or a batch quicker than ON_LOOP_SECONDS.
SAME_LOOP = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}

_CPUS = (
    "ray_app({artifact!r}): {n} replicas of {each} CPU each need {need} CPUs, but the Ray "
    "cluster has {cpus:g}, so Ray would wait for them forever. Ask for fewer replicas, or "
    "fewer CPUs each (ray_actor_options={{'num_cpus': 0.5}}), or join a larger cluster."
)


class Replica:
    """One Ray Serve replica (made by Ray from :func:`ray_app`'s arguments): the artifact
    loaded and compiled, a batcher, our ASGI app; ``predict`` is the handle method."""

    def __init__(self, artifact: str, load_options: dict, batcher_options: dict, app_options: dict,
                 dispatch: str) -> None:  # fmt: skip
        if dispatch == "sync":
            latency_mode()  # a fresh process: before its JAX backend starts
        self._compiled = compiled = dict.fromkeys(_EVENTS.values(), 0)  # traces, compiles

        def heard(event: str, duration: float, **kwargs: Any) -> None:  # jax.monitoring's
            if event in _EVENTS:
                compiled[_EVENTS[event]] += 1

        jax.monitoring.register_event_duration_secs_listener(heard)
        model = load_entry(artifact, **load_options)
        self.batcher = Batcher(model, name=model_name(model), **batcher_options)
        self._app_options = app_options
        self._at_start = dict(self._compiled)  # compiled: from here on, nothing more
        from ray import serve
        from ray.serve.metrics import Gauge

        self.replica = str(serve.get_replica_context().replica_id.unique_id)
        self._gauges = {
            g: Gauge(f"symjax_mlp_replica_{g}", description=f"the replica's batcher's {g}")
            for g in _GAUGES
        }

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.batcher, **self._app_options)

    async def predict(self, *inputs: Any) -> Any:
        """The model's answer to ``inputs`` (rows first), batched with the replica's others."""
        return await self.batcher.asubmit(*inputs)

    def stats(self) -> dict[str, Any]:
        """The batcher's counters, the process's traces and compiles (``compiled_at_start``:
        before its first request), its Ray replica id and its process id."""
        s = self.batcher.stats
        self._record(s)
        return {
            "replica": self.replica,
            "pid": os.getpid(),
            "batcher": s.to_dict(),
            "compiled_at_start": dict(self._at_start),
            "compiled": dict(self._compiled),
            "buckets": list(self.batcher.buckets),
        }

    def check_health(self) -> None:
        """Ray's health check: fails once the batcher is closed (Ray then replaces it)."""
        if self.batcher.closed:
            raise RuntimeError(f"{self.batcher.name} is closed; it answers no more requests.")
        self._record(self.batcher.stats)

    def _record(self, s: Any) -> None:
        values = {**s.to_dict(), **self._compiled}
        for name, gauge in self._gauges.items():
            gauge.set(float(values[name]))


def ray_app(
    artifact: str | os.PathLike[str],
    *,
    replicas: int = 2,
    max_batch: int | None = None,
    max_queue: int = 1024,
    warm_up_timeout: float | None = 300.0,
    runtime: str = "jax",
    entry: str | None = None,
    params_as_constants: bool = False,
    trust: bool = False,
    allow: Iterable[str] | None = None,
    verify_signature: str | os.PathLike[str] | None = None,
    max_body_bytes: int = 64 * 2**20,
    body_timeout: float = 60.0,
    max_inflight_bytes: int | None = None,
    dispatch: str = "async",
    name: str = "symjax_mlp",
    max_ongoing_requests: int | None = None,
    ray_actor_options: dict[str, Any] | None = None,
    deployment_options: dict[str, Any] | None = None,
) -> Any:
    """An artifact as a Ray Serve application of ``replicas`` replicas, each a batcher.

    The artifact is loaded here first, with every check of :func:`~symjax_mlp.load`, so a bad
    one is refused before any replica starts; then by each replica (its path, and the key's,
    must exist where they run), which compiles its batch sizes before Ray routes it anything.
    Over HTTP it serves :func:`~symjax_mlp.serving.serve`'s endpoints, bodies and codes;
    through a handle, ``await handle.predict.remote(x)``.

    Args:
      artifact: the artifact directory.
      replicas: Ray Serve's ``num_replicas``.
      max_batch, max_queue, warm_up_timeout: each replica's
        :class:`~symjax_mlp.serving.Batcher`'s. The default ``max_batch`` is 64, or, where 64
        rows of inputs hold more than ``max_inflight_bytes``, the largest power of two of rows
        within it (a static batch: its own; where constraints bound it, the largest they admit).
      runtime, entry, params_as_constants, trust, allow, verify_signature: as for
        :func:`~symjax_mlp.serving.serve` (passed to :func:`~symjax_mlp.load`).
      max_body_bytes, body_timeout, max_inflight_bytes: see
        :func:`~symjax_mlp.serving.create_app`.
      dispatch: ``"sync"``: each replica calls :func:`~symjax_mlp.serving.latency_mode`
        first thing (its process is fresh); ``"async"``: JAX's default.
      name: the deployment's name.
      max_ongoing_requests: requests Ray sends one replica at once (default: twice the
        largest batch, so a replica's batches fill up).
      ray_actor_options: Ray's, e.g. ``{"num_cpus": 0.5}`` (Ray reserves one CPU per replica,
        and waits silently for ever for replicas the cluster has no CPUs for). Its
        ``runtime_env`` gains ``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0`` (set it in
        ``env_vars`` to override): each replica answers on Ray's own event loop, a thread
        hop less each way. Your other deployments keep Ray's default.
      deployment_options: any other ``Deployment.options`` keyword (``autoscaling_config``,
        ``graceful_shutdown_timeout_s``, ...).

    Returns:
      A ``ray.serve.Application``: ``ray.serve.run(app)`` deploys it and returns a
      ``DeploymentHandle``.

    Raises:
      ConfigError: bad ``replicas``, ``dispatch``, ``max_batch``, ``max_queue``,
        ``warm_up_timeout``, ``max_ongoing_requests`` or limits of
        :func:`~symjax_mlp.serving.create_app`.
      ArtifactError, SignatureError: the artifact cannot be loaded.
      ImportError: Ray Serve is missing (``pip install 'symjax_mlp[ray]'``).

    Example:
      >>> import numpy as np, ray.serve  # doctest: +SKIP
      >>> import symjax_mlp as sm
      >>> app = sm.serving.ray_app("my_mlp", replicas=2, max_batch=64)  # doctest: +SKIP
      >>> handle = ray.serve.run(app, route_prefix="/")  # HTTP: POST /predict  # doctest: +SKIP
      >>> handle.predict.remote(np.ones((1, 512), np.float32)).result()  # doctest: +SKIP
      array([[...]], dtype=float32)
    """
    require("serving on Ray", "ray", "ray.serve", "starlette")
    from ray import serve

    where = f"ray_app({str(artifact)!r})"
    check_count(where, "replicas", replicas)
    check_count(where, "max_queue", max_queue)
    wait = seconds(warm_up_timeout, f"ray_app({str(artifact)!r}, warm_up_timeout")
    limits = check_limits(where, max_body_bytes, body_timeout, max_inflight_bytes)
    if max_ongoing_requests is not None:
        check_count(where, "max_ongoing_requests", max_ongoing_requests)
    if dispatch not in ("sync", "async"):
        raise ConfigError(f"{where}: dispatch must be 'sync' or 'async'; got {dispatch!r}.")
    artifact = os.path.abspath(artifact)  # a replica's working directory is Ray's
    if verify_signature is not None:
        verify_signature = os.path.abspath(verify_signature)
    load_options = {
        "runtime": runtime,
        "params_as_constants": params_as_constants,
        "trust": trust,
        "allow": allow if allow is None or isinstance(allow, str) else tuple(allow),  # as load
        "verify_signature": verify_signature,
        "entry": entry,
    }
    model = load_entry(artifact, **load_options)  # refused here, not in a replica's log
    max_batch = serving_batch(where, model, max_batch, limits)  # a row within a body
    _, static, _, bound = artifact_specs(model)
    buckets = bucket_sizes(where, max_batch, None, static, bound)  # those its constraints admit
    batcher_options = {"max_batch": max_batch, "max_queue": max_queue, "warm_up_timeout": wait}
    app_options = {
        "max_body_bytes": max_body_bytes,
        "body_timeout": body_timeout,
        "max_inflight_bytes": max_inflight_bytes,
    }
    options: dict[str, Any] = {
        "name": name,
        "num_replicas": replicas,
        "max_ongoing_requests": max_ongoing_requests or 2 * buckets[-1],
        "graceful_shutdown_timeout_s": 30.0,  # as serve()'s uvicorn
        **({"ray_actor_options": ray_actor_options} if ray_actor_options else {}),
        **(deployment_options or {}),
    }
    options["ray_actor_options"] = _on_one_loop(options.get("ray_actor_options"))
    deployment = serve.deployment(serve.ingress()(Replica)).options(**options)
    return deployment.bind(artifact, load_options, batcher_options, app_options, dispatch)


def _on_one_loop(actor_options: dict[str, Any] | None) -> dict[str, Any]:
    """``actor_options`` with :data:`SAME_LOOP` among its runtime_env's env_vars, under the
    caller's own (their runtime_env and env_vars kept; their value of the variable wins)."""
    actor = dict(actor_options or {})
    env = dict(actor.get("runtime_env") or {})
    env["env_vars"] = {**SAME_LOOP, **(env.get("env_vars") or {})}
    actor["runtime_env"] = env
    return actor


def serve_on_ray(
    artifact: str | os.PathLike[str],
    *,
    address: str | None,
    host: str,
    port: int,
    ready: Callable[[str], None],
    name: str = "symjax_mlp",
    **options: Any,
) -> None:
    """``symjax-mlp serve --ray``: :func:`ray_app` on the Ray cluster at ``address``, behind
    Ray's HTTP proxy on ``host:port``, until SIGINT or SIGTERM; then the application is deleted
    (its replicas finish what they hold), and Serve shut down unless others use it."""
    app = ray_app(artifact, name=name, **options)  # a bad artifact: refused before Ray starts
    import ray
    from ray import serve

    _join(ray, address)
    try:
        replicas = options.get("replicas", 2)
        each = (options.get("ray_actor_options") or {}).get("num_cpus", 1)  # Ray's default: 1
        cpus = ray.cluster_resources().get("CPU", 0)
        if replicas * each > cpus:
            need = f"{replicas * each:g}"
            raise ConfigError(
                _CPUS.format(artifact=str(artifact), n=replicas, each=each, need=need, cpus=cpus)
            )
        try:
            serve.start(http_options={"host": host, "port": port})
        except Exception:  # Ray's proxy could not start: a port in use is the caller's error
            bind(host, port, "").close()  # a ConfigError, as serve's, unless it binds now
            raise
        serve.run(app, name=name, route_prefix="/")
        stop = threading.Event()
        with on_signals(lambda *_: stop.set()):
            ready(f"http://{f'[{host}]' if ':' in host else host}:{port}")
            while not stop.wait(0.5):
                pass
            serve.delete(name)  # waits for the replicas to drain and stop
        if not serve.status().applications:  # others' applications on a shared cluster stay
            serve.shutdown()
    finally:
        ray.shutdown()


def _join(ray: Any, address: str | None) -> None:
    """``ray.init(address=address)``; a ConfigError where no cluster answers at ``address`` (or
    RAY_ADDRESS): Ray retries a host:port nothing listens on for ever, and raises its own errors
    raw."""
    env = os.environ.get("RAY_ADDRESS", "")
    given, what = (address, "--ray-address") if address else (env, "RAY_ADDRESS")
    if not given:  # a local cluster, started here
        return _init(ray, address)
    host, _, port = given.removeprefix("ray://").rpartition(":")
    try:
        if host and port.isdigit():
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        _init(ray, address)
    except (OSError, OverflowError, ValueError) as e:  # ConnectionError: an OSError
        raise ConfigError(
            f"{what} {printable(given)}: no Ray cluster answers there ({type(e).__name__}: "
            f"{short(printable(str(e)), 200)}). Pass a running cluster's address (its head's "
            "host:port, or ray://host:10001), start one there (ray start --head), or leave "
            f"{what} out to start a local cluster."
        ) from None


def _init(ray: Any, address: str | None) -> None:
    with warnings.catch_warnings():  # Ray forks its daemons and execs them at once: harmless
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
        ray.init(address=address)
