"""Ray Serve's rows: the artifact as :func:`symjax_mlp.serving.ray_app` replicas, through handles.

:func:`bench_ray` starts a local Ray cluster (the machine's CPUs, loopback), exports the
chapter's net and deploys it three times: one replica, two replicas, and a no-op deployment
(Ray's own floor: a replica answering a constant of the output's shape, no model, no batcher).

- A lone request: ``handle.predict.remote(x).result()`` one at a time, to our one-replica
  deployment and to the no-op one, interleaved; the target: ours adds <= 50 µs at the median.
  A second no-op deployment runs on one event loop, as ``ray_app``'s replicas do
  (``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0``): ours over it is what our replica's own
  code adds, ours over Ray's default no-op what a user of Ray's defaults sees.
- HTTP through Ray's proxy: the no-op replica also serves the HTTP rows' bare endpoint
  (:mod:`benchmarks.bare`: the JSON body parsed into a NumPy array, a constant answered), and
  the same keep-alive clients POST one JSON row to each, interleaved, at 1 and 16 clients; the
  targets (the HTTP section's, inside a replica): ours >= 85% of its req/s at 1, >= 90% at 16.
- 64 in flight: 64 asyncio clients in this process, each awaiting one
  ``handle.predict.remote(x)`` after another, against one replica and then two: requests per
  second, p50/p99; the target: two replicas >= 1.5x one. Where the time goes is measured
  beside it: CPU seconds per request in this process (the clients and Ray's router, which runs
  in the caller), in the replicas' processes, and in Ray's other processes (GCS, raylet,
  controller, proxy: this process's descendants), against the CPU seconds the machine had.
- The model alone, called in this process hot and after 3 ms asleep: what a lone request's
  model call costs in a replica whose caches the other processes took meanwhile.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import symjax_mlp as sm
from benchmarks.calls import percentiles
from benchmarks.children import SCRIPTS


def bench_ray(
    *,
    sizes: Sequence[int] = (256, 128, 2),
    in_features: int = 512,
    activation: str = "relu",
    lone_calls: int = 500,
    rounds: int = 5,
    http_requests: int = 1000,
    inflight: int = 64,
    seconds: float = 3.0,
    progress: Any = None,
) -> dict[str, Any]:
    """The Ray Serve rows (see the module docstring); needs the ``symjax_mlp[ray]`` extra."""
    import psutil
    import ray
    from ray import serve

    say = progress or (lambda text: None)
    result: dict[str, Any] = {"config": {"sizes": list(sizes), "inflight": inflight}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mlp"
        sm.chapter.export_mlp(path, sizes=sizes, in_features=in_features, activation=activation)
        say("Ray: starting a local cluster")
        with warnings.catch_warnings():  # Ray forks its daemons and execs them at once
            warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
            ray.init(address="local", include_dashboard=False, log_to_driver=False)
        try:
            result["env"] = {"ray": ray.__version__, "cpus": psutil.cpu_count()}
            x = np.random.default_rng(0).standard_normal((1, in_features), np.float32)
            width = sizes[-1]

            class Floor:  # no HTTP app: a handle's
                async def predict(self, x: np.ndarray) -> np.ndarray:
                    return np.zeros((x.shape[0], width), np.float32)

            class Noop(Floor):
                def __serve_build_asgi_app__(self) -> Any:  # as sm.serving.ray_app's replicas
                    from orjson import loads

                    from benchmarks import bare

                    return bare.app(width, loads)

            port = _free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            noop_app = serve.deployment(
                serve.ingress()(Noop),
                max_ongoing_requests=128,  # its replica imports benchmarks.bare from scripts/
                ray_actor_options={"runtime_env": {"env_vars": {"PYTHONPATH": SCRIPTS}}},
            )
            options = {"max_batch": 64, "dispatch": "sync"}
            one = serve.run(sm.serving.ray_app(path, replicas=1, name="one", **options),
                            name="one", route_prefix="/one")  # fmt: skip
            noop = serve.run(noop_app.bind(), name="noop", route_prefix="/noop")
            loop_env = {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}}
            floor = serve.deployment(  # no CPU of its own: the cluster's two went to the others
                Floor, ray_actor_options={"num_cpus": 0, "runtime_env": loop_env}
            )
            noop_loop = serve.run(floor.bind(), name="noop_loop", route_prefix="/noop_loop")
            say("Ray: a lone request, ours against no-op deployments")
            handles = {"ours": one, "noop": noop, "noop_one_loop": noop_loop}
            result["lone"] = _lone(handles, x, lone_calls, rounds)
            serve.delete("noop_loop")
            say("Ray: HTTP through Ray's proxy, ours against the bare endpoint in a replica")
            result["http"] = _http(port, x, http_requests, rounds)
            result["model_alone"] = _model_alone(sm.load(path), x)
            say(f"Ray: {inflight} in flight, one replica")
            result["inflight_1"] = _load(one, x, inflight, seconds, psutil)
            serve.delete("one")
            serve.delete("noop")
            two = serve.run(sm.serving.ray_app(path, replicas=2, name="two", **options),
                            name="two", route_prefix="/two")  # fmt: skip
            say(f"Ray: {inflight} in flight, two replicas")
            result["inflight_2"] = _load(two, x, inflight, seconds, psutil)
            serve.delete("two")
        finally:
            serve.shutdown()
            ray.shutdown()
    result["targets"] = _targets(result)
    return result


def _lone(handles: Mapping[str, Any], x: np.ndarray, calls: int, rounds: int) -> dict[str, Any]:
    samples: dict[str, list[float]] = {name: [] for name in handles}
    for handle in handles.values():
        for _ in range(100):
            handle.predict.remote(x).result()
    ours = handles["ours"]
    before = ours.stats.remote().result()["batcher"]
    for _ in range(rounds):  # interleaved, so that drift hits all
        for name, handle in handles.items():
            for _ in range(calls):
                t0 = time.perf_counter()
                handle.predict.remote(x).result()
                samples[name].append(time.perf_counter() - t0)
    after = ours.stats.remote().result()["batcher"]
    out: dict[str, Any] = {name: percentiles(s) for name, s in samples.items()}
    for name, s in samples.items():
        out[name]["min_s"] = float(np.min(s))
    out["added_s"] = out["ours"]["p50_s"] - out["noop"]["p50_s"]
    out["added_min_s"] = out["ours"]["min_s"] - out["noop"]["min_s"]
    out["added_over_one_loop_s"] = out["ours"]["p50_s"] - out["noop_one_loop"]["p50_s"]
    n = after["completed"] - before["completed"]
    out["in_replica_s"] = {  # where our replica's share goes, per request, in its batcher
        stage: (after["seconds"][stage] - before["seconds"][stage]) / n
        for stage in after["seconds"]
    }
    return out


def _http(port: int, x: np.ndarray, requests: int, rounds: int) -> dict[str, Any]:
    """req/s and p50/p99 through Ray's proxy, ours and the bare endpoint, each round's rows
    interleaved; the median round's req/s, the p99 of the rounds' p99s."""
    import json

    from benchmarks.http_rows import http_load

    body = json.dumps({"inputs": x.tolist()}).encode()
    out: dict[str, Any] = {}
    for c in (1, 16):
        runs: dict[str, list[dict]] = {"ours": [], "bare": []}
        for r in range(rounds + 1):  # the first round warms up Ray's proxy and both apps
            for name, path in (("ours", "/one/predict"), ("bare", "/noop/predict")):
                row = http_load("127.0.0.1", port, body, "application/json", c, requests, path)
                if r:
                    runs[name].append(row)
        out[str(c)] = {  # str: the keys JSON keeps
            name: {
                "requests_per_s": float(np.median([row["throughput_rps"] for row in rows])),
                "p50_s": float(np.median([row["p50_s"] for row in rows])),
                "p99_s": float(np.max([row["p99_s"] for row in rows])),
                "errors": sum(row["errors"] for row in rows),
            }
            for name, rows in runs.items()
        }
        ours, bare = (out[str(c)][k]["requests_per_s"] for k in ("ours", "bare"))
        out[str(c)]["ratio"] = ours / bare
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_alone(model: Any, x: np.ndarray, calls: int = 500) -> dict[str, float]:
    """The model called here, hot (one call after another) and after 3 ms asleep (as each
    lone request finds it in a replica: its caches gone to the other processes)."""
    for _ in range(100):
        np.asarray(model(x))
    hot, idle = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        np.asarray(model(x))
        hot.append(time.perf_counter() - t0)
        time.sleep(0.003)
        t0 = time.perf_counter()
        np.asarray(model(x))
        idle.append(time.perf_counter() - t0)
    return {"hot_p50_s": float(np.median(hot)), "after_3ms_idle_p50_s": float(np.median(idle))}


def _load(handle: Any, x: np.ndarray, inflight: int, seconds: float, psutil: Any) -> dict:
    pids = {s["pid"] for s in handle.broadcast("stats").results(timeout_s=60)}
    before = {s["replica"]: s["batcher"] for s in handle.broadcast("stats").results()}
    me, replicas = psutil.Process(), [psutil.Process(p) for p in pids]
    latencies: list[float] = []

    async def client(stop: float, record: bool) -> None:
        while (t0 := time.perf_counter()) < stop:
            await handle.predict.remote(x)
            if record:
                latencies.append(time.perf_counter() - t0)

    async def run(duration: float, record: bool) -> None:
        stop = time.perf_counter() + duration
        await asyncio.gather(*(client(stop, record) for _ in range(inflight)))

    asyncio.run(run(0.5, False))  # warm-up
    ray_pids = {p.pid for p in me.children(recursive=True)} - pids  # daemons, other actors
    others = [psutil.Process(p) for p in ray_pids if psutil.pid_exists(p)]
    cpu0 = _cpu([me]), _cpu(replicas), _cpu(others)
    t0 = time.perf_counter()
    asyncio.run(run(seconds, True))
    wall = time.perf_counter() - t0
    cpu1 = _cpu([me]), _cpu(replicas), _cpu(others)
    after = {s["replica"]: s["batcher"] for s in handle.broadcast("stats").results()}
    n = len(latencies)
    caller, served, daemons = (b - a for a, b in zip(cpu0, cpu1, strict=True))
    rows = sum(after[r]["rows"] - before.get(r, {}).get("rows", 0) for r in after)
    batches = sum(after[r]["batches"] - before.get(r, {}).get("batches", 0) for r in after)
    cpus = psutil.cpu_count()
    return {
        "replicas": len(pids),
        "requests_per_s": n / wall,
        **percentiles(latencies),
        "cpu_s_per_request": {
            "caller (clients + Ray's router)": caller / n,
            "replicas": served / n,
            "Ray's daemons and actors": daemons / n,
        },
        "ray_busy": (caller + served + daemons) / (wall * cpus),
        "mean_batch_rows": rows / batches if batches else 0.0,
    }


def _cpu(processes: Sequence[Any]) -> float:
    total = 0.0
    for p in processes:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def _targets(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    if lone := result.get("lone"):
        added = lone["added_s"] * 1e6
        out.append({"what": "Ray: a lone request, ours over a no-op deployment (µs added, p50)",
                    "value": added, "target": "<= 50", "met": added <= 50})  # fmt: skip
    for c, want in ((1, 0.85), (16, 0.90)):
        if r := result.get("http", {}).get(str(c)):
            out.append({"what": f"Ray HTTP, {c} client(s): ours over the bare endpoint (req/s)",
                        "value": r["ratio"], "target": f">= {want}",
                        "met": r["ratio"] >= want})  # fmt: skip
    if (a := result.get("inflight_1")) and (b := result.get("inflight_2")):
        ratio = b["requests_per_s"] / a["requests_per_s"]
        out.append({"what": "Ray: 64 in flight, two replicas over one (req/s)",
                    "value": ratio, "target": ">= 1.5", "met": ratio >= 1.5})  # fmt: skip
    return out


def format_ray(result: Mapping[str, Any]) -> str:
    """The Ray rows as text.

    Example:
      >>> print(format_ray({"targets": []}))
      Ray Serve (sm.serving.ray_app), through DeploymentHandles and its HTTP proxy
    """
    lines = ["Ray Serve (sm.serving.ray_app), through DeploymentHandles and its HTTP proxy"]
    if lone := result.get("lone"):
        lines.append("  a lone request        min µs    p50 µs    p99 µs")
        labels = ("ours (1 replica)", "no-op deployment", "no-op, one loop")
        for name, label in zip(("ours", "noop", "noop_one_loop"), labels, strict=True):
            r = lone[name]
            times = (r["min_s"], r["p50_s"], r["p99_s"])
            lines.append(f"  {label:<20}" + "".join(f"{t * 1e6:8.0f}  " for t in times).rstrip())
        lines.append(
            f"  added by ours: {lone['added_s'] * 1e6:.0f} µs at the median, "
            f"{lone['added_min_s'] * 1e6:.0f} µs at the fastest; over the no-op on one loop "
            f"(our replica's own code): {lone['added_over_one_loop_s'] * 1e6:.0f} µs at the median"
        )
        stages = ", ".join(f"{k} {v * 1e6:.0f}" for k, v in lone["in_replica_s"].items())
        lines.append(f"  in our replica's batcher, µs per request: {stages}")
    if http := result.get("http"):
        head = "HTTP through Ray's proxy"
        lines.append(f"  {head:<27}{'req/s':>6} {'p50 µs':>8} {'p99 µs':>8} {'errors':>7}")
        for c, r in http.items():
            for name, label in (("ours", "ours"), ("bare", "bare endpoint")):
                row = r[name]
                lines.append(
                    f"  {c:>2} client(s), {label:<13}{row['requests_per_s']:6.0f} "
                    f"{row['p50_s'] * 1e6:8.0f} {row['p99_s'] * 1e6:8.0f} {row['errors']:7d}"
                )
    if alone := result.get("model_alone"):
        lines.append(
            f"  the model called here: {alone['hot_p50_s'] * 1e6:.0f} µs p50 hot, "
            f"{alone['after_3ms_idle_p50_s'] * 1e6:.0f} µs after 3 ms asleep"
        )
    for key in ("inflight_1", "inflight_2"):
        if r := result.get(key):
            cpu = ", ".join(f"{k} {v * 1e6:.0f}" for k, v in r["cpu_s_per_request"].items())
            lines.append(
                f"  {result['config']['inflight']} in flight, {r['replicas']} replica(s): "
                f"{r['requests_per_s']:.0f} req/s, p50 {r['p50_s'] * 1e3:.2f} ms, "
                f"p99 {r['p99_s'] * 1e3:.2f} ms, {r['mean_batch_rows']:.1f} rows/batch; "
                f"the CPUs {r['ray_busy']:.0%} busy with Ray and us; CPU µs per request: {cpu}"
            )
    for t in result.get("targets", []):
        verdict = "met" if t["met"] else "NOT met"
        lines.append(f"  {t['what']}: {t['value']:.2f} (target {t['target']}): {verdict}")
    return "\n".join(lines)
