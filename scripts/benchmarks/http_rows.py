"""Serving's HTTP rows: ``symjax-mlp serve`` in a subprocess, driven over loopback.

:func:`http_rows` exports the chapter's net, starts the server on a free port
(:func:`_server`), and drives it with keep-alive clients (``.npy`` and JSON bodies) at each
bounded concurrency (:func:`http_load`), reading rows per batch from its ``/metrics``. The
yardstick runs beside it: a bare starlette endpoint under the same uvicorn settings
(:data:`_BARE`) that parses the JSON body into a NumPy array (with orjson, as ``serve``
does) and answers a constant of the output's shape, driven by the same clients; and serve's
ceiling (:data:`_CEILING`), that endpoint answering the model's outputs: no model's call can
reach the bare endpoint, and serve adds to the ceiling what its batcher, checks and bounds
cost. Every row is run ``rounds`` times, interleaved with the others, and reported by its run of
median req/s, with the CPU time its server process spent a request (``/proc``): where the time
goes.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

import symjax_mlp as sm
from benchmarks.calls import gated, percentiles
from benchmarks.children import child_env

# -- the HTTP section ------------------------------------------------------------------------
#: The bare endpoint (:mod:`benchmarks.bare`): ``python -c _BARE OUT_WIDTH``; uvicorn as
#: ``serve`` configures it.
_BARE = """
import socket, sys, uvicorn
from orjson import loads  # serve's parser (the serve extra's), so the rows compare the rest
from benchmarks.bare import app
sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # as serve's
sock.bind(("127.0.0.1", 0))
sock.listen(2048)
config = uvicorn.Config(app(int(sys.argv[1]), loads), log_level="warning", access_log=False,
                        lifespan="on", timeout_graceful_shutdown=30, limit_concurrency=1000)
print(f"bare on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
uvicorn.Server(config).run(sockets=[sock])
"""

#: The same endpoint parsing with the standard library's json (the issue's first yardstick).
_BARE_STDLIB = _BARE.replace("from orjson import loads", "from json import loads")

#: ``serve``'s ceiling: the bare endpoint answering the artifact's outputs, ``python -c _CEILING
#: OUT_WIDTH ARTIFACT``; loaded as ``serve`` loads it (latency mode; gc.freeze once compiled),
#: called on each parsed array, written by orjson. No batcher, no checks, no bounds: what serve
#: would reach if all it added to the bare endpoint were the model's call.
_CEILING = _BARE.replace(
    "from benchmarks.bare import app",
    """from benchmarks.bare import app
import gc, numpy as np, orjson, symjax_mlp as sm
sm.serving.latency_mode()
model = sm.load(sys.argv[2])
answer = lambda x: orjson.dumps({"outputs": np.asarray(model(x)).tolist()})
answer(np.zeros((1, *model.signature.inputs[0].shape[1:]), np.float32))
gc.freeze()""",
).replace("app(int(sys.argv[1]), loads)", "app(int(sys.argv[1]), loads, answer)")


@contextlib.contextmanager
def _server(cmd: list[str], env: Mapping[str, str] | None, timeout: float):
    """The server ``cmd`` starts, once it printed its URL; yields ``(host, port, proc)``."""
    errors = tempfile.TemporaryFile("w+")  # noqa: SIM115  (a file, not a pipe: never fills up)
    proc = subprocess.Popen(
        cmd, env=child_env(env), stdout=subprocess.PIPE, stderr=errors, text=True
    )
    try:
        url = _wait_for_url(proc, errors, timeout)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        yield host, int(port), proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
        errors.close()


def _wait_for_url(proc: subprocess.Popen, errors: Any, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
        while time.monotonic() < deadline:
            if not sel.select(timeout=0.5):
                if proc.poll() is not None:
                    break
                continue
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            found = re.search(r"(http://\S+:\d+)", line)
            if found:
                return found.group(1)
    proc.kill()
    proc.wait()
    errors.seek(0)
    raise RuntimeError(
        f"bench_serving: the server did not start within {timeout} s:\n{errors.read()[-3000:]}"
    )


def http_load(
    host: str, port: int, body: bytes, kind: str, c: int, requests: int, path: str = "/predict"
) -> dict:
    """``requests`` POSTs of ``body`` to ``path`` from ``c`` keep-alive clients at once."""
    per = max(1, requests // c)
    lats: list[list[float]] = [[] for _ in range(c)]
    errors = [0] * c
    gate = threading.Barrier(c + 1)
    headers = {"Content-Type": kind}

    def client(j: int) -> None:
        conn = http.client.HTTPConnection(host, port, timeout=60)
        conn.connect()
        # No Nagle delay, as urllib3 and httpx set: http.client writes the headers and the
        # body apart, and Nagle may hold the body back until the headers are acknowledged
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            conn.request("GET", path.rsplit("/", 1)[0] + "/health")  # the app's, under a prefix
            conn.getresponse().read()
            gate.wait()
            clock = time.perf_counter
            for _ in range(per):
                t0 = clock()
                conn.request("POST", path, body=body, headers=headers)
                resp = conn.getresponse()
                resp.read()
                lats[j].append(clock() - t0)
                errors[j] += resp.status != 200
        finally:
            conn.close()

    wall = gated(client, c, gate)
    lat = [x for mine in lats for x in mine]
    return {"throughput_rps": len(lat) / wall, "errors": sum(errors), **percentiles(lat)}


def _scrape(host: str, port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            found[name] = float(value)
    return found


def http_rows(
    *, sizes, in_features, activation, seed, clients, requests, max_batch, env, timeout, say,
    rounds: int = 3,
) -> dict:  # fmt: skip
    """The HTTP section: what :func:`benchmarks.serving.bench_serving` reports under ``http``."""
    import jax

    net = sm.mlp(tuple(sizes), activation=activation)
    xn = np.random.default_rng(seed).standard_normal((1, in_features), dtype=np.float32)
    h = sm.hybridize(net, jax.jit(net.init)(jax.random.key(seed), xn), name="mlp")
    npy = io.BytesIO()
    np.save(npy, xn, allow_pickle=False)
    bodies = {
        "npy": (npy.getvalue(), "application/x-npy"),
        "json": (json.dumps({"inputs": xn.tolist()}).encode(), "application/json"),
    }
    rows: list[dict] = []
    bare: dict[int, dict] = {}
    stdlib: dict[int, dict] = {}
    ceiling: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="symjax_mlp_serve_") as tmp:
        art = os.path.join(tmp, "mlp")
        sm.export(h, art, example=xn, batch="b")
        say("starting symjax-mlp serve and the bare starlette endpoint")
        serve = [sys.executable, "-m", "symjax_mlp", "serve", art, "--host", "127.0.0.1"]
        serve += ["--port", "0", "--max-batch", str(max_batch)]
        yardstick = [sys.executable, "-c", _BARE, str(sizes[-1])]
        with (
            _server(serve, env, timeout) as (host, port, proc),
            _server(yardstick, env, timeout) as bare_server,
            _server([*yardstick[:2], _BARE_STDLIB, *yardstick[3:]], env, timeout) as std,
            _server([*yardstick[:2], _CEILING, *yardstick[3:], art], env, timeout) as top,
        ):
            body, kind = bodies["json"]
            for c in clients:
                say(f"HTTP: {c} client(s), serve and the bare endpoints, {rounds} rounds")
                runs: dict[str, list[dict]] = {k: [] for k in ("bare", "stdlib", "top", *bodies)}
                for _ in range(rounds):  # interleaved: drift hits every row alike
                    runs["bare"].append(_measure(*bare_server, body, kind, c, requests))
                    runs["stdlib"].append(_measure(*std, body, kind, c, requests))
                    runs["top"].append(_measure(*top, body, kind, c, requests))
                    for name, (b, k) in bodies.items():
                        before = _scrape(host, port)
                        row = _measure(host, port, proc, b, k, c, requests)
                        after = _scrape(host, port)
                        key_b, key_r = (
                            "symjax_mlp_batcher_batches_total",
                            "symjax_mlp_batcher_rows_total",
                        )
                        batches = after.get(key_b, 0) - before.get(key_b, 0)
                        rows_ = after.get(key_r, 0) - before.get(key_r, 0)
                        row["rows_per_batch"] = rows_ / max(1, batches)
                        runs[name].append(row)
                bare[c] = {"clients": c, "body": "json", **_median_run(runs["bare"])}
                stdlib[c] = {"clients": c, "body": "json", "parser": "json",
                             **_median_run(runs["stdlib"])}  # fmt: skip
                ceiling[c] = {"clients": c, "body": "json", **_median_run(runs["top"])}
                rows += [{"clients": c, "body": n, **_median_run(runs[n])} for n in bodies]
            say("HTTP: where a lone request's time goes (Server-Timing; an idle CPU)")
            lone = {**served_timing(host, port, *bodies["json"]), **_idle_probe(art, env, timeout)}
            metrics = _scrape(host, port)
        exit_code = proc.returncode
    for row in rows:
        if row["body"] == "json":
            row["vs_bare"] = row["throughput_rps"] / bare[row["clients"]]["throughput_rps"]
            row["vs_bare_stdlib"] = row["throughput_rps"] / stdlib[row["clients"]]["throughput_rps"]
            row["vs_ceiling"] = row["throughput_rps"] / ceiling[row["clients"]]["throughput_rps"]
    return {
        "rows": rows,
        "bare": list(bare.values()),
        "bare_stdlib": list(stdlib.values()),
        "ceiling": list(ceiling.values()),
        "server_exit_code": exit_code,
        "metrics": metrics,
        "rounds": rounds,
        "lone": lone,
    }


def served_timing(host: str, port: int, body: bytes, kind: str, n: int = 600) -> dict:
    """Medians of serve's ``Server-Timing`` stages (seconds) over ``n`` lone requests, one
    client: what the server's model call costs between two requests of a lone client."""
    conn = http.client.HTTPConnection(host, port, timeout=60)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stages: dict[str, list[float]] = {}
    try:
        for _ in range(n):
            conn.request("POST", "/predict", body=body, headers={"Content-Type": kind})
            resp = conn.getresponse()
            resp.read()
            for name, ms in re.findall(r"(\w+);dur=([\d.]+)", resp.getheader("Server-Timing", "")):
                stages.setdefault(name, []).append(float(ms) / 1e3)
    finally:
        conn.close()
    return {f"served_{k}_s": float(np.median(v)) for k, v in stages.items()}


#: A fresh latency-mode process times the artifact's batch-1 call three ways, interleaved:
#: back to back, after its CPU idled (a sleep, as a server between a lone client's requests),
#: and after the CPU stayed busy as long (a spin). Prints medians in seconds, as JSON.
_IDLE = """
import json, sys, time
import numpy as np, symjax_mlp as sm
sm.serving.latency_mode()
m = sm.load(sys.argv[1])
x = np.ones(m.signature.inputs[0].shape[1:], np.float32)[None]
def spin(d=3e-4):
    end = time.perf_counter() + d
    while time.perf_counter() < end:
        pass
ways = {"hot": lambda: None, "after_sleep": lambda: time.sleep(3e-4), "after_spin": spin}
took = {k: [] for k in ways}
for _ in range(2000):
    for k, before in ways.items():
        before()
        t = time.perf_counter()
        np.asarray(m(x))
        took[k].append(time.perf_counter() - t)
print(json.dumps({f"call_{k}_s": float(np.median(v[200:])) for k, v in took.items()}))
"""


def _idle_probe(art: str, env: Mapping[str, str] | None, timeout: float) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _IDLE, art], env=child_env(env), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    if out.returncode:
        return {"idle_probe_error": out.stderr[-500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure(host: str, port: int, proc: Any, body: bytes, kind: str, c: int, n: int) -> dict:
    """One run of :func:`http_load`, with the server process's CPU seconds a request."""
    cpu = _cpu_s(proc.pid)
    row = http_load(host, port, body, kind, c, n)
    after = _cpu_s(proc.pid)
    row["server_cpu_s"] = None if cpu is None or after is None else (after - cpu) / row["n"]
    return row


def _cpu_s(pid: int) -> float | None:
    """CPU seconds the threads of process ``pid`` ran so far (the scheduler's nanoseconds,
    ``/proc/<pid>/task/*/schedstat``); None off Linux."""
    try:
        tasks = Path(f"/proc/{pid}/task")
        return sum(int((t / "schedstat").read_text().split()[0]) for t in tasks.iterdir()) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _median_run(runs: list[dict]) -> dict:
    """The run of median req/s (its latencies and CPU with it); every run's req/s beside."""
    ordered = sorted(runs, key=lambda r: r["throughput_rps"])
    return {
        **ordered[len(ordered) // 2],
        "errors": sum(r["errors"] for r in runs),
        "runs_rps": [r["throughput_rps"] for r in runs],
    }


def http_targets(h: Mapping[str, Any] | None) -> list[dict]:
    """Issue 31's bar: serve's JSON req/s against the bare endpoint's, in the same run."""
    out = []
    for r in (h or {}).get("rows", []):
        if "vs_bare" in r:
            want = 0.85 if r["clients"] == 1 else 0.90
            out.append(
                {
                    "name": f"http_vs_bare_c{r['clients']}",
                    "what": f"serve/bare starlette req/s, {r['clients']} client(s), JSON bodies",
                    "value": r["vs_bare"],
                    "target": f">= {want}",
                    "met": r["vs_bare"] >= want,
                }
            )
    return out
