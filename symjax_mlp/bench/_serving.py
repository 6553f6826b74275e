"""Serving, measured: per-request latency per dispatch mode, the micro-batcher, the HTTP server.

:func:`bench_serving` runs three sections on the chapter's MLP, each where its figures mean
something:

- ``latency``: synced batch-1 calls, one fresh subprocess per mode (JAX's dispatch mode is
  fixed when its CPU backend starts), all started first and then timed in interleaved rounds,
  one mode at a time: JAX with asynchronous dispatch (the default),
  JAX in :func:`~symjax_mlp.serving.latency_mode` (as hybridized, and with
  ``params_as_constants=True``), and PyTorch eager / ``jit.script`` / ``jit.freeze`` (the
  scripted module with its params inlined as constants) / ``compile`` (with the benchmark's
  threads and with one), each in two forms: the input already on the device, and a NumPy
  array in and out (what a server does).
- ``batcher``: one subprocess in latency mode, then one in JAX's default async dispatch: a
  :class:`~symjax_mlp.serving.Batcher` at 1 client, its calls alternated one by one with
  direct synced calls (the added µs: the median of the pairs' differences, each pair timed in
  the same microseconds), then under 1, 8, 64 concurrent clients (threads blocking in ``b(x)``,
  callers keeping that many futures in flight, and coroutines on one event loop awaiting
  ``b.asubmit(x)``): throughput against direct calls timed just before and after each row,
  p50, p99, rows per batch. Each mode's ratios are against its own direct calls (on a CPU,
  async dispatch's are the slower ones: compare its req/s, not its ratios, across modes).
- ``http``: ``symjax-mlp serve`` in a subprocess, driven over loopback by keep-alive clients
  (``.npy`` and JSON bodies) at a bounded concurrency: throughput, p50, p99.

:func:`format_serving` prints the tables and the targets (64 clients >= 5x one-at-a-time, the
batcher adding <= 10 µs at concurrency 1, JAX in latency mode >= 2x faster than the fastest
PyTorch mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import io
import itertools
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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from symjax_mlp._errors import ConfigError
from symjax_mlp.bench._timing import Progress, environment, format_seconds, usable_cores

SECTIONS = ("latency", "batcher", "http")
TORCH_MODES = ("torch_eager", "torch_script", "torch_freeze", "torch_compile")
_LABELS = {
    "jax": "JAX h(x)",
    "torch_eager": "PyTorch eager",
    "torch_script": "torch.jit.script",
    "torch_freeze": "torch.jit.freeze",
    "torch_compile": "torch.compile",
}
_CHILD = (
    "import json, sys; from symjax_mlp.bench._serving import _child; "
    "print('\\n' + json.dumps(_child(**json.loads(sys.argv[1]))))"
)


# -- timing one call at a time ---------------------------------------------------------------
def _percentiles(samples: Sequence[float]) -> dict[str, float]:
    a = np.asarray(samples, np.float64)
    return {
        "p50_s": float(np.percentile(a, 50)),
        "p90_s": float(np.percentile(a, 90)),
        "p99_s": float(np.percentile(a, 99)),
        "mean_s": float(a.mean()),
        "n": len(a),
    }


def _per_call(fn: Callable[[], Any], calls: int, repeats: int, warmup: int = 200) -> dict:
    """Times ``calls * repeats`` synced calls one by one: percentiles, and the fastest
    repeat's mean."""
    for _ in range(warmup):
        fn()
    samples = [_one_round(fn, calls) for _ in range(repeats)]
    return _summary(samples)


def _one_round(fn: Callable[[], Any], calls: int) -> list[float]:
    """``calls`` synced calls, each timed on its own (seconds)."""
    clock = time.perf_counter
    samples = np.empty(calls)
    for i in range(calls):
        t0 = clock()
        fn()
        samples[i] = clock() - t0
    return samples.tolist()


def _summary(rounds: Sequence[Sequence[float]]) -> dict:
    """Percentiles over every round's calls, and the fastest round's mean."""
    means = [float(np.mean(r)) for r in rounds]
    return {**_percentiles([x for r in rounds for x in r]), "best_repeat_mean_s": min(means)}


# -- the subprocesses ------------------------------------------------------------------------
def _child(kind: str, **kw: Any) -> dict[str, Any] | None:
    """Runs one measurement in this (fresh) process; JAX's dispatch is set first."""
    if kw.get("dispatch") == "sync":
        from symjax_mlp.serving import latency_mode

        latency_mode()  # before anything starts JAX's backend
    if kind in ("jax", "torch"):
        return _latency_child(kind, **kw)
    if kind == "batcher":
        return _batcher_rows(**kw)
    raise ConfigError(f"unknown child kind {kind!r}")


def _chapter(sizes: Sequence[int], in_features: int, activation: str | None, seed: int):
    import jax

    from symjax_mlp._hybrid.hybrid import hybridize
    from symjax_mlp._models import mlp

    net = mlp(tuple(sizes), activation=activation)
    rng = np.random.default_rng(seed)
    xn = rng.standard_normal((1, in_features), dtype=np.float32)
    variables = jax.jit(net.init)(jax.random.key(seed), xn)
    return hybridize(net, variables, name="mlp"), variables, xn


def _jax_latency(
    *, dispatch, sizes, in_features, activation, seed, constants=False
) -> tuple[Callable, dict]:
    """JAX's batch-1 calls: what to report, and the call of each form."""
    import jax

    from symjax_mlp.serving import dispatch_mode

    h, _, xn = _chapter(sizes, in_features, activation, seed)
    if constants:
        h = h.replace(params_as_constants=True)
    x = jax.device_put(xn)
    forms = {
        "device": lambda: h(x).block_until_ready(),
        "numpy": lambda: np.asarray(h(xn)),
    }

    def meta() -> dict:
        return {
            "mode": "jax",
            "dispatch": dispatch_mode(),
            "constants": h.params_as_constants,
            "threads": None,
            "device": str(jax.devices()[0]),
            "traces": h.trace_count,
        }

    return meta, forms


def _torch_latency(*, mode, threads, sizes, in_features, activation, seed) -> tuple[Callable, dict]:
    """The PyTorch twin's batch-1 calls in ``mode``: what to report, and each form's call."""
    import warnings

    import jax
    import torch  # optional extra: symjax_mlp[torch]

    from symjax_mlp.bench._twins import dense_layers

    _, variables, xn = _chapter(sizes, in_features, activation, seed)
    acts = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh, "sigmoid": torch.nn.Sigmoid}
    if activation not in acts:
        raise ConfigError(f"no PyTorch twin for activation {activation!r}")
    gpu = jax.default_backend() == "gpu" and torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    if not gpu:
        torch.set_num_threads(threads)
    layers, modules = dense_layers(variables), []
    for i, (kernel, bias) in enumerate(layers):
        kernel = np.array(kernel)
        lin = torch.nn.Linear(*kernel.shape)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(kernel.T.copy()))
            lin.bias.copy_(torch.from_numpy(np.array(bias)))
        modules += [lin] + ([acts[activation]()] if i < len(layers) - 1 else [])
    net = torch.nn.Sequential(*modules).eval().to(device)
    tx = torch.from_numpy(xn).to(device)
    t0 = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jit.script is deprecated in torch 2.x; still timed
        if mode == "torch_script":
            net = torch.jit.script(net)
        elif mode == "torch_freeze":
            net = torch.jit.freeze(torch.jit.script(net))
        elif mode == "torch_compile":
            net = torch.compile(net)
        net(tx)
    build_s = time.perf_counter() - t0
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    def on_device() -> Any:
        with torch.no_grad():
            y = net(tx)
        sync()
        return y

    def numpy_in_out() -> np.ndarray:
        with torch.no_grad():
            return net(torch.from_numpy(xn).to(device)).cpu().numpy()

    meta = {
        "mode": mode,
        "dispatch": None,
        "threads": None if gpu else threads,
        "device": str(device),
        "torch": torch.__version__,
        "build_s": build_s,
    }
    return lambda: meta, {"device": on_device, "numpy": numpy_in_out}


def _latency_child(kind: str, warmup: int, **kw: Any) -> None:
    """A latency subprocess: builds its mode, then times one round per request on stdin
    (``{"calls": n}``), printing each round's samples, until ``{"quit": true}``; idle (blocked
    on stdin, using no core) while the other modes run theirs."""
    meta, forms = (_jax_latency if kind == "jax" else _torch_latency)(**kw)
    for fn in forms.values():
        for _ in range(warmup):
            fn()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        if ask.get("quit"):
            return
        for fn in forms.values():  # caches and branch predictors warm again after idling
            for _ in range(min(warmup, 50)):
                fn()
        rounds = {form: _one_round(fn, ask["calls"]) for form, fn in forms.items()}
        print(json.dumps({"meta": meta(), "rounds": rounds}), flush=True)


def _batcher_rows(
    *, dispatch, sizes, in_features, activation, seed, clients, requests, max_batch
) -> dict:
    from symjax_mlp.serving import Batcher, dispatch_mode

    h, _, xn = _chapter(sizes, in_features, activation, seed)
    pool = np.random.default_rng(seed + 1).standard_normal((256, 1, in_features), np.float32)
    rows = [pool[i] for i in range(len(pool))]
    following = itertools.cycle(rows).__next__

    def direct(x: np.ndarray) -> np.ndarray:
        return np.asarray(h(x))

    n_direct = max(200, requests // 4)
    t0 = time.perf_counter()
    timing = _per_call(lambda: direct(following()), n_direct, 1)
    one = {**timing, "throughput_rps": 1.0 / timing["mean_s"], "wall_s": time.perf_counter() - t0}
    out = []
    with Batcher(h, example=xn, max_batch=max_batch) as b:
        compiled = h.trace_count  # every bucket traced and compiled by now
        c1 = _paired_c1(b, direct, rows, max(200, requests // 2))
        for clients_of in KINDS.values():  # warm every path
            clients_of(b, rows, 1, 50)
        direct_before = _direct_rps(direct, rows, n_direct)
        for c in clients:
            for kind, clients_of in KINDS.items():
                before = b.stats
                lat, wall = clients_of(b, rows, c, requests)
                after = b.stats
                batches = after.batches - before.batches
                direct_after = _direct_rps(direct, rows, n_direct)  # and the next row's before
                base = (direct_before + direct_after) / 2  # the same seconds as the row
                direct_before = direct_after
                out.append(
                    {
                        "clients": c,
                        "kind": kind,
                        "requests": len(lat),
                        "throughput_rps": len(lat) / wall,
                        "direct_rps": base,
                        "vs_direct": len(lat) / wall / base,
                        "rows_per_batch": (after.rows - before.rows) / max(1, batches),
                        "padded_rows": after.padded_rows - before.padded_rows,
                        "batches": batches,
                        **_percentiles(lat),
                    }
                )
        stats = b.stats.to_dict()
        retraced = h.trace_count - compiled
    return {
        "dispatch": dispatch_mode(),
        "max_batch": max_batch,
        "direct": one,
        "c1": c1,
        "rows": out,
        "buckets": list(b.buckets),
        "traces_while_serving": retraced,
        "stats": stats,
    }


def _paired_c1(b: Any, direct: Callable, rows: list[np.ndarray], calls: int) -> dict:
    """A direct call and ``b(x)`` on the same input, alternated call by call (which goes first
    flips every pair), so that both see the same machine: the batcher's own cost at
    concurrency 1 is the median of the pairs' differences (robust to a busy machine, whose
    preemptions shift the two p50s apart at random; their difference is reported too)."""
    clock, k = time.perf_counter, len(rows)
    for i in range(100):
        direct(rows[i % k])
        b(rows[i % k])
    d, w = np.empty(calls), np.empty(calls)
    for i in range(calls):
        x = rows[i % k]
        if i & 1:
            t0 = clock()
            direct(x)
            t1 = clock()
            b(x)
            t2 = clock()
            d[i], w[i] = t1 - t0, t2 - t1
        else:
            t0 = clock()
            b(x)
            t1 = clock()
            direct(x)
            t2 = clock()
            w[i], d[i] = t1 - t0, t2 - t1
    direct_p, batcher_p = _percentiles(d), _percentiles(w)
    return {
        "direct": direct_p,
        "batcher": batcher_p,
        "added_p50_s": batcher_p["p50_s"] - direct_p["p50_s"],
        "added_paired_median_s": float(np.median(w - d)),
    }


def _direct_rps(direct: Callable, rows: list[np.ndarray], n: int) -> float:
    """One-at-a-time synced calls per second, over ``n`` calls."""
    k = len(rows)
    start = time.perf_counter()
    for i in range(n):
        direct(rows[i % k])
    return n / (time.perf_counter() - start)


def _threads(b: Any, rows: list[np.ndarray], c: int, requests: int) -> tuple[list[float], float]:
    """``c`` threads, each calling ``b(x)`` in a loop (a closed loop of blocking clients)."""
    per = max(1, requests // c)
    lats: list[list[float]] = [[] for _ in range(c)]
    gate = threading.Barrier(c + 1)

    def client(j: int) -> None:
        clock, mine, k = time.perf_counter, lats[j], len(rows)
        gate.wait()
        for i in range(per):
            t0 = clock()
            b(rows[(i * c + j) % k])
            mine.append(clock() - t0)

    threads = [threading.Thread(target=client, args=(j,)) for j in range(c)]
    for t in threads:
        t.start()
    gate.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return [x for mine in lats for x in mine], time.perf_counter() - start


def _futures(b: Any, rows: list[np.ndarray], c: int, requests: int) -> tuple[list[float], float]:
    """``c`` requests kept in flight through ``submit`` and done-callbacks (async clients).

    A client's callback (on the batcher's thread) records its latency and submits the next
    request; ``next()`` on the shared counter and ``list.append`` are atomic, so no lock."""
    clock, done, k = time.perf_counter, threading.Event(), len(rows)
    lat: list[float] = []
    failed: list[BaseException] = []
    total = max(c, requests)
    issued = itertools.count()

    def launch() -> None:
        i = next(issued)
        if i < total:
            t0 = clock()
            b.submit(rows[i % k]).add_done_callback(lambda f: finished(f, t0))

    def finished(f: Any, t0: float) -> None:
        error = f.exception()
        if error is not None:  # stop, and let the caller see it
            failed.append(error)
            done.set()
            return
        lat.append(clock() - t0)
        if len(lat) == total:
            done.set()
        else:
            launch()

    start = clock()
    for _ in range(c):
        launch()
    done.wait()
    if failed:
        raise failed[0]
    return lat, clock() - start


def _asyncio(b: Any, rows: list[np.ndarray], c: int, requests: int) -> tuple[list[float], float]:
    """``c`` coroutines on one event loop (this thread), each awaiting ``b.asubmit(x)`` in a
    loop: an asyncio server's handlers."""
    per, k, clock = max(1, requests // c), len(rows), time.perf_counter
    lats: list[float] = []

    async def client(j: int) -> None:
        for i in range(per):
            t0 = clock()
            await b.asubmit(rows[(i * c + j) % k])
            lats.append(clock() - t0)

    async def main() -> float:
        start = clock()
        await asyncio.gather(*(client(j) for j in range(c)))
        return clock() - start

    return lats, asyncio.run(main())


KINDS = {"threads": _threads, "futures": _futures, "asyncio": _asyncio}


def _latency_rows(
    modes: Sequence[tuple[str, dict]],
    net: Mapping[str, Any],
    *,
    calls: int,
    rounds: int,
    env: Mapping[str, str] | None,
    timeout: float,
    say: Callable[[str], None],
    notes: list[str],
) -> dict[str, Any]:
    """Every mode in its own fresh process, all started first (one at a time), then timed in
    ``rounds`` interleaved rounds of ``calls`` synced calls (mode after mode, the order
    rotating each round), so that a busy spell of the machine lands on every mode alike."""
    children: list[tuple[str, dict, subprocess.Popen, Any]] = []
    try:
        for kind, kw in modes:
            label = _mode_label({"mode": kind, **kw})  # as its row will be labelled
            say(f"latency: starting {label} in a fresh process")
            errors = tempfile.TemporaryFile("w+")  # noqa: SIM115  (a file: never fills up)
            args = json.dumps({"kind": kind, "warmup": 200, **kw, **net})
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, args],
                env=_child_env(env),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
            )
            children.append((kind, kw, proc, errors))
            try:
                _answer(proc, errors, timeout, f"the {label} subprocess")
            except RuntimeError as e:
                if kind == "jax":
                    raise
                notes.append(f"{label} skipped: {str(e)[-300:]}")
                _stop(*children.pop()[2:])
        samples: list[dict[str, list]] = [{} for _ in children]
        metas: list[dict] = [{} for _ in children]
        for r in range(rounds):
            say(f"latency: round {r + 1}/{rounds}, {len(children)} modes in turn")
            for i in itertools.islice(itertools.cycle(range(len(children))), r, r + len(children)):
                _, kw, proc, errors = children[i]
                proc.stdin.write(json.dumps({"calls": calls}) + "\n")
                proc.stdin.flush()
                got = _answer(proc, errors, timeout, f"the latency subprocess ({kw})")
                metas[i] = got["meta"]
                for form, xs in got["rounds"].items():
                    samples[i].setdefault(form, []).append(xs)
                time.sleep(0.05)  # let a thread pool's spin-wait end before the next mode
    finally:
        for _, _, proc, errors in children:
            _stop(proc, errors)
    rows = [
        {**meta, "forms": {form: _summary(xs) for form, xs in by_form.items()}}
        for meta, by_form in zip(metas, samples, strict=True)
    ]
    return {"rows": rows, "rounds": rounds, "calls_per_round": calls}


def _stop(proc: subprocess.Popen, errors: Any) -> None:
    """Asks a latency subprocess to quit (kills it after 10 s) and closes its files."""
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            proc.stdin.write(json.dumps({"quit": True}) + "\n")
            proc.stdin.flush()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdin, proc.stdout, errors):
        with contextlib.suppress(OSError):
            stream.close()


def _answer(proc: subprocess.Popen, errors: Any, timeout: float, who: str) -> dict[str, Any]:
    """The next JSON line a subprocess prints (at most ``timeout`` s away)."""
    ready = selectors.DefaultSelector()
    ready.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not ready.select(timeout):
            raise RuntimeError(f"bench_serving: {who} gave no answer within {timeout} s")
        line = proc.stdout.readline()
    finally:
        ready.close()
    if not line:
        proc.wait()
        errors.seek(0)
        raise RuntimeError(
            f"bench_serving: {who} failed (exit {proc.returncode}):\n{errors.read()[-3000:]}"
        )
    return json.loads(line)


def _child_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """The environment of a subprocess: ours, ``env``, and no GPU memory grab (on a GPU the
    parent already holds JAX's preallocated share)."""
    full = dict(os.environ, **(env or {}))
    full.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return full


def _run_child(kind: str, kw: dict, env: Mapping[str, str] | None, timeout: float) -> dict:
    full = _child_env(env)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps({"kind": kind, **kw})],
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench_serving: the {kind} subprocess ({kw.get('mode', kw.get('dispatch'))}) failed "
            f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the HTTP section ------------------------------------------------------------------------
@contextlib.contextmanager
def _server(artifact: str, max_batch: int, env: Mapping[str, str] | None, timeout: float):
    """``symjax-mlp serve`` on a free loopback port; yields ``(host, port, proc)``."""
    cmd = [sys.executable, "-m", "symjax_mlp", "serve", artifact, "--host", "127.0.0.1"]
    cmd += ["--port", "0", "--max-batch", str(max_batch)]
    errors = tempfile.TemporaryFile("w+")  # noqa: SIM115  (a file, not a pipe: never fills up)
    proc = subprocess.Popen(
        cmd, env=_child_env(env), stdout=subprocess.PIPE, stderr=errors, text=True
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


def _http_load(host: str, port: int, body: bytes, kind: str, c: int, requests: int) -> dict:
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
            conn.request("GET", "/health")
            conn.getresponse().read()
            gate.wait()
            clock = time.perf_counter
            for _ in range(per):
                t0 = clock()
                conn.request("POST", "/predict", body=body, headers=headers)
                resp = conn.getresponse()
                resp.read()
                lats[j].append(clock() - t0)
                errors[j] += resp.status != 200
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(j,)) for j in range(c)]
    for t in threads:
        t.start()
    gate.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    lat = [x for mine in lats for x in mine]
    return {"throughput_rps": len(lat) / wall, "errors": sum(errors), **_percentiles(lat)}


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


def _http_rows(
    *, sizes, in_features, activation, seed, clients, requests, max_batch, env, timeout, say
) -> dict:
    import jax

    from symjax_mlp._export import export
    from symjax_mlp._hybrid.hybrid import hybridize
    from symjax_mlp._models import mlp

    net = mlp(tuple(sizes), activation=activation)
    xn = np.random.default_rng(seed).standard_normal((1, in_features), dtype=np.float32)
    h = hybridize(net, jax.jit(net.init)(jax.random.key(seed), xn), name="mlp")
    npy = io.BytesIO()
    np.save(npy, xn, allow_pickle=False)
    bodies = {
        "npy": (npy.getvalue(), "application/x-npy"),
        "json": (json.dumps({"inputs": xn.tolist()}).encode(), "application/json"),
    }
    rows = []
    with tempfile.TemporaryDirectory(prefix="symjax_mlp_serve_") as tmp:
        art = os.path.join(tmp, "mlp")
        export(h, art, example=xn, batch="b")
        say("starting symjax-mlp serve")
        with _server(art, max_batch, env, timeout) as (host, port, proc):
            for c in clients:
                for name, (body, kind) in bodies.items():
                    say(f"HTTP: {c} client(s), {name} bodies")
                    before = _scrape(host, port)
                    row = _http_load(host, port, body, kind, c, requests)
                    after = _scrape(host, port)
                    key_b, key_r = (
                        "symjax_mlp_batcher_batches_total",
                        "symjax_mlp_batcher_rows_total",
                    )
                    batches = after.get(key_b, 0) - before.get(key_b, 0)
                    row["rows_per_batch"] = (after.get(key_r, 0) - before.get(key_r, 0)) / max(
                        1, batches
                    )
                    rows.append({"clients": c, "body": name, **row})
            metrics = _scrape(host, port)
        exit_code = proc.returncode
    return {"rows": rows, "server_exit_code": exit_code, "metrics": metrics}


# -- the whole benchmark ---------------------------------------------------------------------
def bench_serving(
    *,
    sections: Sequence[str] = SECTIONS,
    sizes: Sequence[int] = (256, 128, 2),
    in_features: int = 512,
    activation: str | None = "relu",
    calls: int = 500,
    repeats: int = 20,
    torch: bool = True,
    torch_modes: Sequence[str] = TORCH_MODES,
    clients: Sequence[int] = (1, 8, 64),
    requests: int = 4000,
    max_batch: int = 64,
    batcher_dispatch: Sequence[str] = ("sync", "async"),
    http_clients: Sequence[int] = (1, 16),
    http_requests: int = 600,
    env: Mapping[str, str] | None = None,
    seed: int = 0,
    timeout: float = 600.0,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Measures serving the chapter's MLP: latency per dispatch mode, the batcher, HTTP.

    Every section runs in fresh subprocesses (the dispatch mode is fixed when JAX's CPU
    backend starts), one after another, so no two measurements share the cores.

    Args:
      sections: any of ``"latency"``, ``"batcher"``, ``"http"``.
      sizes, in_features, activation: the net, ``mlp(sizes)`` on ``(1, in_features)`` rows.
      calls, repeats: synced batch-1 calls per round, and rounds (the modes take turns, the
        order rotating each round), in the latency section. Many short rounds, at least as
        many as modes, put each mode at each place of the turn (after each other mode) and
        spread a busy spell of the machine over all of them. On a 2-core VM, two runs each,
        alternated: 5 rounds of 2000 calls read the PyTorch/JAX target 1.64x and 1.66x (and
        params as constants slower than the plain call); 20 rounds of 500 read 1.99x twice.
      torch: add the PyTorch rows (when torch is installed; else a note).
      torch_modes: which of ``torch_eager``, ``torch_script``, ``torch_freeze``,
        ``torch_compile``.
      clients: concurrent in-process clients of the batcher.
      requests: requests per concurrency level (half as many interleaved pairs at 1 client,
        a quarter as many direct calls around each level).
      max_batch: the batcher's (and server's) largest batch.
      batcher_dispatch: the dispatch modes the batcher section runs in, each in its own
        fresh process: ``"sync"`` (:func:`~symjax_mlp.serving.latency_mode`, as
        ``symjax-mlp serve``; ``result["batcher"]``) and/or ``"async"`` (JAX's default;
        ``result["batcher_async"]``).
      http_clients, http_requests: concurrent HTTP clients, requests per level.
      env: extra environment for the subprocesses (e.g. ``{"XLA_FLAGS": ...}``).
      seed: for the params and the inputs.
      timeout: seconds per subprocess.
      progress: called with a status line as the run goes.

    Returns:
      A dict with ``config``, ``env``, ``notes``, ``targets`` and one entry per section run:
      ``latency`` (``rows``: ``mode``, ``dispatch``, ``threads``, ``forms``: ``device`` and
      ``numpy``, each ``p50_s``, ``p90_s``, ``p99_s``, ``mean_s``, ``best_repeat_mean_s``),
      ``batcher`` (and ``batcher_async``: ``direct``; ``c1``: ``direct`` and ``batcher``
      percentiles of the interleaved calls, ``added_paired_median_s``, ``added_p50_s``; and
      ``rows``: ``clients``, ``kind``, ``throughput_rps``, ``direct_rps``, ``vs_direct``,
      ``p50_s``, ``p99_s``, ``rows_per_batch``, ...), ``http`` (``rows``: ``clients``,
      ``body``, ``throughput_rps``, ``p50_s``, ``p99_s``, ``errors``, ``rows_per_batch``).

    Raises:
      ConfigError: an unknown section or torch mode, or a size below 1.
      RuntimeError: a subprocess failed (its stderr is in the message).
    """
    bad = sorted(set(sections) - set(SECTIONS)) + sorted(set(torch_modes) - set(TORCH_MODES))
    if bad:
        raise ConfigError(
            f"bench_serving: unknown section or torch mode {bad}; sections are {SECTIONS}, "
            f"torch modes {TORCH_MODES}."
        )
    if not batcher_dispatch or set(batcher_dispatch) - {"sync", "async"}:
        raise ConfigError(
            f"bench_serving: batcher_dispatch must name 'sync' and/or 'async'; got "
            f"{list(batcher_dispatch)!r}."
        )
    if min(calls, repeats, requests, max_batch, http_requests, *clients, *http_clients) < 1:
        raise ConfigError(
            "bench_serving: calls, repeats, requests, clients, max_batch must be >= 1."
        )
    say = progress or (lambda _: None)
    net = {"sizes": list(sizes), "in_features": in_features, "activation": activation, "seed": seed}
    notes: list[str] = []
    result: dict[str, Any] = {
        "config": {
            **net,
            "sections": list(sections),
            "calls": calls,
            "repeats": repeats,
            "clients": list(clients),
            "requests": requests,
            "max_batch": max_batch,
            "batcher_dispatch": list(batcher_dispatch),
            "http_clients": list(http_clients),
            "http_requests": http_requests,
            "env": dict(env or {}),
        },
        "env": environment(),
        "notes": notes,
    }
    if "latency" in sections:
        modes = [("jax", {"dispatch": d}) for d in ("async", "sync")]
        modes.append(("jax", {"dispatch": "sync", "constants": True}))
        if torch:
            try:
                import torch as _torch  # noqa: F401  (only to know it is there)
            except ImportError:
                notes.append("torch rows skipped: torch is not installed (symjax_mlp[torch])")
            else:
                on_cpu = result["env"]["backend"] == "cpu"  # threads matter only there
                threads = [usable_cores()] + ([1] if usable_cores() > 1 and on_cpu else [])
                for mode in torch_modes:
                    for n in threads if mode != "torch_compile" else threads[:1]:
                        modes.append(("torch", {"mode": mode, "threads": n}))
        result["latency"] = _latency_rows(
            modes, net, calls=calls, rounds=repeats, env=env, timeout=timeout, say=say,
            notes=notes,
        )  # fmt: skip
    if "batcher" in sections:
        for dispatch in batcher_dispatch:
            say(f"batcher, {dispatch} dispatch: 1 client, then {', '.join(map(str, clients))}")
            kw = {"dispatch": dispatch, **net, "clients": list(clients), "requests": requests}
            key = "batcher" if dispatch == "sync" else "batcher_async"
            result[key] = _run_child("batcher", {**kw, "max_batch": max_batch}, env, timeout)
    if "http" in sections:
        result["http"] = _http_rows(
            **net,
            clients=list(http_clients),
            requests=http_requests,
            max_batch=max_batch,
            env=env,
            timeout=timeout,
            say=say,
        )
    result["targets"] = _targets(result)
    return result


def _targets(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    lat = result.get("latency", {}).get("rows", [])
    jax_sync = [r for r in lat if r["mode"] == "jax" and r["dispatch"] == "sync"]
    torch_rows = [r for r in lat if r["mode"] != "jax"]
    if jax_sync and torch_rows:
        p50 = lambda r: r["forms"]["device"]["p50_s"]  # noqa: E731
        best, ours = min(torch_rows, key=p50), min(jax_sync, key=p50)
        ratio = p50(best) / p50(ours)
        out.append(
            {
                "name": "latency_vs_fastest_torch",
                "what": f"fastest PyTorch p50 ({_mode_label(best)}) / fastest JAX latency-mode "
                f"p50 ({_mode_label(ours)})",
                "value": ratio,
                "target": ">= 2",
                "met": ratio >= 2,
            }
        )
    for key in ("batcher", "batcher_async"):
        b = result.get(key)
        if not b:
            continue
        mode = "" if key == "batcher" else ", async dispatch"
        base = "" if key == "batcher" else " in async dispatch"  # what its ratio is against
        suffix = "" if key == "batcher" else "_async"
        for kind in KINDS:
            top = max((r for r in b["rows"] if r["kind"] == kind), key=lambda r: r["clients"])
            ratio = top["vs_direct"]
            out.append(
                {
                    "name": f"batcher_throughput_{top['clients']}_{kind}{suffix}",
                    "what": f"{top['clients']} clients ({kind}{mode}) req/s / one-at-a-time "
                    f"req/s{base}",
                    "value": ratio,
                    "target": ">= 5",
                    "met": ratio >= 5,
                }
            )
        added = b["c1"]["added_paired_median_s"]
        out.append(
            {
                "name": f"batcher_overhead_c1{suffix}",
                "what": f"b(x) - direct call at 1 client, interleaved, median (µs{mode})",
                "value": added * 1e6,
                "target": "<= 10",
                "met": added <= 10e-6,
            }
        )
    h = result.get("http")
    if h and h["rows"]:
        worst = max(h["rows"], key=lambda r: r["p99_s"])
        out.append(
            {
                "name": "http_p99",
                "what": f"worst HTTP p99 (ms; {worst['clients']} clients, {worst['body']})",
                "value": worst["p99_s"] * 1e3,
                "target": "reported",
                "met": None,
            }
        )
    return out


def _mode_label(r: Mapping[str, Any]) -> str:
    label = _LABELS.get(r["mode"], r["mode"])
    if r["mode"] == "jax":
        baked = ", params as constants" if r.get("constants") else ""
        return f"{label}, {r['dispatch']} dispatch{baked}"
    return label + (f", {r['threads']} thread(s)" if r.get("threads") else "")


def _format_batcher(b: Mapping[str, Any]) -> str:
    us, d, c1 = format_seconds, b["direct"], b["c1"]
    lines = [
        f"Micro-batcher: max_batch {b['max_batch']}, {b['dispatch']} dispatch, in-process "
        f"clients (buckets {b['buckets']} compiled ahead, "
        f"{b['traces_while_serving']} traces while serving)",
        f"  at 1 client, calls interleaved with direct ones: b(x) adds "
        f"{c1['added_paired_median_s'] * 1e6:.1f} µs (median of the pairs; direct p50 "
        f"{us(c1['direct']['p50_s'])}, b(x) p50 {us(c1['batcher']['p50_s'])})",
        f"  {'clients':<22} {'req/s':>9} {'p50':>10} {'p99':>10} {'rows/batch':>10} "
        f"{'vs one-at-a-time':>16}",
        f"  {'one at a time, direct':<22} {d['throughput_rps']:>9.0f} {us(d['p50_s']):>10} "
        f"{us(d['p99_s']):>10} {1.0:>10.1f} {1.0:>15.2f}x",
    ]
    for r in b["rows"]:
        who = f"{r['clients']} {r['kind']}"
        lines.append(
            f"  {who:<22} {r['throughput_rps']:>9.0f} {us(r['p50_s']):>10} "
            f"{us(r['p99_s']):>10} {r['rows_per_batch']:>10.1f} {r['vs_direct']:>15.2f}x"
        )
    lines.append("  (vs one-at-a-time: against direct calls timed just before and after each row)")
    return "\n".join(lines)


def format_serving(result: Mapping[str, Any]) -> str:
    """The serving benchmark as text: the latency table, the batcher, HTTP, the targets.

    Example:
      >>> from symjax_mlp.bench import format_serving
      >>> print(format_serving({"notes": [], "targets": []}))
      Serving benchmark: no sections were run.
    """
    us = format_seconds
    parts: list[str] = []
    lat = result.get("latency")
    if lat:
        lines = [
            "Per-request latency: the chapter MLP at batch 1, synced, one fresh process per mode"
            f" ({lat.get('rounds', '?')} rounds of {lat.get('calls_per_round', '?')} calls, the "
            "modes interleaved)",
            f"  {'mode':<46} {'on device p50':>13} {'p99':>9}   "
            f"{'numpy in/out p50':>16} {'p99':>9}",
        ]
        for r in lat["rows"]:
            d, n = r["forms"]["device"], r["forms"]["numpy"]
            lines.append(
                f"  {_mode_label(r):<46} {us(d['p50_s']):>13} {us(d['p99_s']):>9}   "
                f"{us(n['p50_s']):>16} {us(n['p99_s']):>9}"
            )
        parts.append("\n".join(lines))
    for key in ("batcher", "batcher_async"):
        b = result.get(key)
        if b:
            parts.append(_format_batcher(b))
    h = result.get("http")
    if h:
        lines = [
            "HTTP: symjax-mlp serve on loopback (uvicorn, keep-alive clients, bounded load)",
            f"  {'clients':>7} {'body':<5} {'req/s':>9} {'p50':>10} {'p99':>10} "
            f"{'rows/batch':>10} {'errors':>6}",
        ]
        for r in h["rows"]:
            lines.append(
                f"  {r['clients']:>7} {r['body']:<5} {r['throughput_rps']:>9.0f} "
                f"{us(r['p50_s']):>10} {us(r['p99_s']):>10} {r['rows_per_batch']:>10.1f} "
                f"{r['errors']:>6}"
            )
        lines.append(f"  server exit code after SIGINT: {h['server_exit_code']}")
        parts.append("\n".join(lines))
    if not parts:
        return "Serving benchmark: no sections were run."
    targets = result.get("targets", [])
    if targets:
        lines = ["Targets"]
        for t in targets:
            verdict = "reported" if t["met"] is None else ("met" if t["met"] else "MISSED")
            lines.append(f"  {t['what']}: {t['value']:.2f} (target {t['target']}): {verdict}")
        parts.append("\n".join(lines))
    env = result.get("env", {})
    where = f"{env.get('device', '?')}, {env.get('cpu_usable', '?')} usable cores"
    parts.append(f"Ran on {where}; jax {env.get('jax', '?')}.")
    parts.extend(f"note: {n}" for n in result.get("notes", []))
    return "\n\n".join(parts)
