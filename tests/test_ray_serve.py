"""An artifact as Ray Serve replicas (``sm.serving.ray_app``), on a local Ray cluster on loopback.

One Ray cluster for the module (two CPUs), one application of two replicas of the chapter's
MLP, reached through ``DeploymentHandle`` calls and through Ray's HTTP proxy on a free port.
Marked ``ray``: CI installs the ``symjax_mlp[ray]`` extra and runs ``pytest -m ray``; without
Ray the module is skipped. Behaviour only, never speed (that is the benchmark's ``--ray`` rows).

What Ray guarantees when a replica dies (Ray Serve 2.60, ``ray.serve._private.router``): a
request the router could not hand to the dead replica is routed again to another one; a
request the replica had accepted is not retried (it may have run), its caller gets a
``RayActorError`` (``ActorDiedError`` or ``ActorUnavailableError``) from ``.result()``. So a
request is answered at most once, and never silently: the test asserts each one either equals
the model on its own rows or raises that error, and that no more fail than the dead replica
held.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import signal
import socket
import subprocess
import sys
import time
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import symjax_mlp as sm

ray = pytest.importorskip("ray", reason="needs the ray extra: pip install 'symjax_mlp[ray]'")
serve = pytest.importorskip("ray.serve")

pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("ray")]

APP = "mlp"
FEATURES = 512


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(artifact path, the loaded model, HTTP port): a local Ray cluster with Serve started."""
    path = tmp_path_factory.mktemp("ray") / "mlp"
    sm.chapter.export_mlp(path)
    port = _free_port()
    with warnings.catch_warnings():  # Ray forks its daemons and execs them at once
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield path, sm.load(path), port
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def handle(cluster):
    path, _, _ = cluster
    app = sm.serving.ray_app(path, replicas=2, max_batch=64, ray_actor_options={"num_cpus": 0.5})
    h = serve.run(app, name=APP, route_prefix="/")
    yield h
    serve.delete(APP)


def rows(n, seed):
    return np.random.default_rng(seed).standard_normal((n, FEATURES), np.float32)


def replica_stats(handle, timeout=60.0):
    """``stats()`` of every running replica, by replica id (``DeploymentHandle.broadcast``)."""
    return {s["replica"]: s for s in handle.broadcast("stats").results(timeout_s=timeout)}


def post(port, body, content_type="application/json", path="/predict"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "POST" if body is not None else "GET", path, body, {"Content-Type": content_type}
        )
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_every_request_gets_its_own_answer_and_nothing_compiles(cluster, handle):
    _, model, port = cluster
    before = replica_stats(handle)
    for s in before.values():  # compiled in the constructor, before the first request
        assert s["compiled_at_start"]["compiles"] >= len(s["buckets"]) == 7
        assert s["compiled"] == s["compiled_at_start"]
    inputs = [rows(1 + i % 5, seed=i) for i in range(300)]
    responses = [handle.predict.remote(x) for x in inputs]  # all in flight at once
    for x, r in zip(inputs, responses, strict=True):
        np.testing.assert_allclose(
            r.result(timeout_s=60), np.asarray(model(x)), rtol=1e-5, atol=1e-6
        )

    def over_http(i):
        x = rows(1, seed=1000 + i)
        status, body = post(port, json.dumps({"inputs": x.tolist()}))
        assert status == 200, body
        return x, np.asarray(json.loads(body)["outputs"], np.float32)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for x, y in pool.map(over_http, range(64)):
            np.testing.assert_allclose(y, np.asarray(model(x)), rtol=1e-5, atol=1e-6)
    after = replica_stats(handle)
    assert set(after) == set(before)
    for replica, s in after.items():
        assert s["compiled"] == s["compiled_at_start"], replica  # no trace, no compile
        assert s["batcher"]["completed"] > 0, replica  # both replicas served
    assert sum(s["batcher"]["completed"] for s in after.values()) == 300 + 64
    assert max(s["batcher"]["batches"] for s in after.values()) < 300  # merged into batches


def test_a_bad_request_is_a_4xx_with_the_servers_message(cluster, handle):
    _, _, port = cluster
    status, body = post(port, json.dumps({"inputs": [[1.0, 2.0]]}))
    answer = json.loads(body)
    assert status == 422 and answer["error"] == "SignatureError", body
    assert "input args[0] has shape (1, 2)" in answer["message"]
    assert "Pass rows of shape (512,)" in answer["message"]
    assert str(cluster[0]) not in answer["message"]  # the model's name, never its path
    status, body = post(port, b"{not json")
    assert status == 400 and json.loads(body)["error"] == "BadRequest", body
    status, body = post(port, b"x", content_type="text/plain")
    assert status == 415, body
    status, body = post(port, None, path="/health")
    assert status == 200 and json.loads(body)["status"] == "ok", body
    status, body = post(port, None, path="/metrics")  # the replica's, as `symjax-mlp serve`'s
    assert status == 200 and b"# TYPE symjax_mlp_http_requests_total counter" in body, body
    assert b"symjax_mlp_batcher_requests_total" in body, body
    status, body = post(port, None, path="/signature")
    assert status == 200 and json.loads(body)["max_batch"] == 64, body
    with pytest.raises(sm.SignatureError, match=r"has shape \(1, 2\)"):  # through a handle
        handle.predict.remote(np.ones((1, 2), np.float32)).result(timeout_s=30)


def _serve_actors():
    names = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"]: a for a in names if a["namespace"] == "serve" and "REPLICA" in a["name"]}


def test_a_killed_replica_is_replaced_and_no_request_is_lost_or_answered_twice(cluster, handle):
    _, model, _ = cluster
    victim = next(iter(replica_stats(handle)))
    name = next(n for n in _serve_actors() if victim in n)
    inputs = [rows(2, seed=5000 + i) for i in range(400)]
    responses, killed = [], False
    for i, x in enumerate(inputs):
        responses.append(handle.predict.remote(x))
        if i == 150:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            killed = True
        time.sleep(0.001)
    assert killed
    answered, failed = 0, 0
    for x, r in zip(inputs, responses, strict=True):
        try:
            y = r.result(timeout_s=120)
        except ray.exceptions.RayActorError:  # accepted by the dead replica: failed, visibly
            failed += 1
            continue
        np.testing.assert_allclose(y, np.asarray(model(x)), rtol=1e-5, atol=1e-6)
        answered += 1
    print(f"kill: {answered} answered, {failed} failed")
    assert answered + failed == len(inputs)  # every request resolved, none hangs
    assert failed <= 128  # at most what the dead replica held (its max_ongoing_requests)
    deadline, now = time.monotonic() + 60, {}
    while time.monotonic() < deadline:  # Ray starts a replacement
        try:
            now = replica_stats(handle)
        except ray.exceptions.RayActorError:  # the broadcast still reached the dead one
            time.sleep(0.5)
            continue
        if victim not in now and len(now) == 2:
            break
        time.sleep(0.5)
    assert victim not in now and len(now) == 2
    x = rows(3, seed=9)
    np.testing.assert_allclose(
        handle.predict.remote(x).result(timeout_s=60), np.asarray(model(x)), rtol=1e-5, atol=1e-6
    )
    for s in now.values():
        assert s["compiled"] == s["compiled_at_start"]


def test_shutdown_drains_the_requests_in_flight(cluster):
    path, model, _ = cluster
    app = sm.serving.ray_app(
        path,
        replicas=2,
        max_batch=64,
        name="drain",
        ray_actor_options={"num_cpus": 0.5},
        max_ongoing_requests=4096,
    )
    h = serve.run(app, name="drain", route_prefix="/drain")
    inputs = [rows(64, seed=7000 + i) for i in range(600)]
    started = []

    async def answered(response):
        y = await response
        return y, time.monotonic()

    async def main():
        pending = [asyncio.ensure_future(answered(h.predict.remote(x))) for x in inputs]
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        started.append(time.monotonic())
        deleting = asyncio.get_running_loop().run_in_executor(None, serve.delete, "drain")
        outcomes = await asyncio.gather(*pending, return_exceptions=True)
        await deleting
        return outcomes

    outcomes = asyncio.run(asyncio.wait_for(main(), 180))
    for x, outcome in zip(inputs, outcomes, strict=True):
        assert not isinstance(outcome, BaseException), outcome
        np.testing.assert_allclose(outcome[0], np.asarray(model(x)), rtol=1e-5, atol=1e-6)
    late = sum(t > started[0] for _, t in outcomes)
    print(f"drain: {late} of {len(inputs)} answered after the shutdown began")
    assert late > 0  # the shutdown began with requests in flight, and they were answered


def test_the_cli_serves_on_ray_until_sigint(cluster):
    path, model, _ = cluster
    cmd = [sys.executable, "-m", "symjax_mlp", "serve", str(path), "--ray", "--replicas", "1"]
    cmd += ["--port", "0", "--ray-address", "local", "--max-batch", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # once the replica is up
        assert line.startswith(f"serving {path} on http://127.0.0.1:"), line + proc.stderr.read()
        port = int(line.split()[3].rsplit(":", 1)[1])
        x = rows(2, seed=3)
        status, body = post(port, json.dumps({"inputs": x.tolist()}))
        assert status == 200, body
        y = np.asarray(json.loads(body)["outputs"], np.float32)
        np.testing.assert_allclose(y, np.asarray(model(x)), rtol=1e-5, atol=1e-6)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "symjax-mlp serve: shut down cleanly" in out
    assert "RuntimeWarning" not in err and "Traceback" not in err


def test_a_bad_artifact_or_option_is_refused_before_any_replica_starts(cluster, tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    path, _, _ = cluster
    public = tmp_path / "key.pub"
    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    pem = key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    public.write_bytes(pem)
    with pytest.raises(sm.ArtifactError, match="is not signed"):  # load()'s own check
        sm.serving.ray_app(path, verify_signature=public)
    with pytest.raises(sm.ArtifactError):
        sm.serving.ray_app(tmp_path / "nothing-here")
    with pytest.raises(sm.ConfigError, match=r"replicas must be an int >= 1; got 0"):
        sm.serving.ray_app(path, replicas=0)
    with pytest.raises(sm.ConfigError, match=r"max_batch must be an int >= 1; got 0"):
        sm.serving.ray_app(path, max_batch=0)


def test_bad_batcher_or_app_options_are_refused_before_any_replica_starts(tmp_path):
    """max_queue and the app's limits were checked by each replica only, in Ray's log."""
    path = sm.chapter.export_mlp(tmp_path / "m").path
    for bad in ({"max_queue": 0}, {"max_body_bytes": None}, {"body_timeout": -1}):
        option = next(iter(bad))
        with pytest.raises(sm.ConfigError, match=rf"ray_app\(.*\): {option} must be"):
            sm.serving.ray_app(path, **bad)
    with pytest.raises(sm.ConfigError, match="max_inflight_bytes=10 is less than"):
        sm.serving.ray_app(path, max_inflight_bytes=10)
    with pytest.raises(sm.ConfigError, match=r"ray_app\(.*warm_up_timeout=-1\): pass seconds"):
        sm.serving.ray_app(path, warm_up_timeout=-1)
    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2.0))  # its batch at least 70 rows
    bound = sm.export(h, tmp_path / "b", example=jnp.ones((70, 3)), shapes=("b, 3",),
                      constraints=("b >= 70",)).path  # fmt: skip
    with pytest.raises(sm.ConfigError, match=r"admits \(b >= 70\)"):
        sm.serving.ray_app(bound, max_batch=64)


def test_ray_apps_default_max_batch_is_the_one_its_docstring_states(tmp_path):
    """ray_app's docstring stated no default max_batch, which since 0.18 is bounded by
    max_inflight_bytes, as serve's: it states it now, and each replica's batcher (and Ray's
    max_ongoing_requests, twice its largest batch) gets what it states."""
    doc = " ".join(sm.serving.ray_app.__doc__.replace("``", "").split())
    assert (
        "The default max_batch is 64, or, where 64 rows of inputs hold more than "
        "max_inflight_bytes, the largest power of two of rows within it" in doc
    ), doc
    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2.0))
    row = 2**16  # float32: 256 KiB a row
    path = sm.export(h, tmp_path / "m", example=jnp.ones((1, row)), shapes=(f"b, {row}",)).path
    for limits in ({}, {"max_body_bytes": 2**20}, {"max_body_bytes": 2**20, "max_batch": 32}):
        held = limits.get("max_body_bytes", 64 * 2**20) * 4  # max_inflight_bytes' default
        want = limits.get("max_batch") or min(64, 2 ** int(np.log2(held // (4 * row))))
        app = sm.serving.ray_app(path, replicas=1, **limits)
        deployment = app._bound_deployment  # Ray gives no public accessor
        assert deployment.init_args[2]["max_batch"] == want, limits
        assert deployment.max_ongoing_requests == 2 * want, limits


def test_each_replica_answers_on_rays_own_event_loop(cluster, handle):
    """ray_app's replicas start with RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 (read in
    each replica process's own environment): Ray runs predict on the replica's loop, with no
    thread hop to a second loop and back, where Ray's default hopped twice a request."""
    pids = {s["pid"] for s in replica_stats(handle).values()}
    assert len(pids) == 2
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.partition(b"=")[::2] for v in f.read().split(b"\0") if v)
        assert env.get(b"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD") == b"0"


def test_the_one_loop_setting_keeps_the_callers_runtime_env_and_yields_to_theirs(tmp_path):
    """Only ray_app's own replicas get the setting, under the caller's runtime_env (kept, and
    their own value of the variable wins); the caller's dict is not changed."""
    path = sm.chapter.export_mlp(tmp_path / "m", sizes=(4, 2)).path
    given = {"num_cpus": 0.5, "runtime_env": {"env_vars": {"MINE": "1"}, "pip": ["six"]}}
    app = sm.serving.ray_app(path, replicas=1, ray_actor_options=given)
    actor = app._bound_deployment.ray_actor_options  # Ray gives no public accessor
    assert actor["num_cpus"] == 0.5 and actor["runtime_env"]["pip"] == ["six"]
    want = {"MINE": "1", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
    assert actor["runtime_env"]["env_vars"] == want
    assert given["runtime_env"]["env_vars"] == {"MINE": "1"}  # the caller's, unchanged
    theirs = {"runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}}}
    app = sm.serving.ray_app(path, replicas=1, deployment_options={"ray_actor_options": theirs})
    env = app._bound_deployment.ray_actor_options["runtime_env"]["env_vars"]
    assert env == {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}


def test_the_cli_refuses_more_replicas_than_the_cluster_has_cpus(cluster):
    path, _, _ = cluster
    address = ray.get_runtime_context().gcs_address  # the module's cluster: 2 CPUs
    cmd = [sys.executable, "-m", "symjax_mlp", "serve", str(path), "--ray", "--replicas", "8"]
    out = subprocess.run(
        [*cmd, "--ray-address", address], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    assert "8 replicas of 1.0 CPU each need 8 CPUs, but the Ray cluster has 2" in out.stderr
    assert "ray_actor_options= is --replica-cpus N" in out.stderr


def test_importing_the_library_imports_no_ray():
    code = "import sys, symjax_mlp, symjax_mlp.serving; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
