"""Round ten of a stranger's attacks (session 58): the doors earlier rounds did not reach, each
way in refused with a clear error of the library's. The rounds before: test_stranger9.py,
test_export_hostile.py, test_http_hostile.py, test_serving_hostile.py,
test_checkpoint_stranger.py, test_signing_stranger.py, ..."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import jax
import pytest

import symjax_mlp as sm

ENV = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")


def _served(port: int) -> bool:
    """Whether a process listens on ``port`` (a connection to it is taken)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _train_process_0(port: int, timeout: int) -> list[str]:
    """``symjax-mlp train`` as process 0 of 2 whose coordinator is 127.0.0.1:``port``."""
    return [
        sys.executable, "-m", "symjax_mlp", "train", "--epochs", "1", "--quiet",
        "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0",
        "--timeout", str(timeout),
    ]  # fmt: skip


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6], ids=["ipv4", "ipv6"])
def test_a_coordinator_port_another_process_holds_is_refused_before_jax_starts(family):
    """Process 0 on a port something else listens on: JAX's 'Failed to start RPC server'
    (JaxRuntimeError) came out of initialize, and the command line showed it as a bug of ours,
    traceback and all. Refused now before JAX's runtime starts, naming the port and what to do."""
    with socket.socket(family) as held:
        held.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))  # not JAX's [::]
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(sm.ConfigError) as e:
            sm.training.initialize(f"127.0.0.1:{port}", 2, 0, timeout=5)
    message = str(e.value)
    assert f"process 0 serves the coordinator on port {port}, but another process" in message
    assert "Stop it, or start every process with another port." in message
    assert not jax.distributed.is_initialized()


@pytest.mark.slow  # initialize's shortest timeout, 1 s
@pytest.mark.parametrize("process_id", [0, 1])
def test_a_coordinator_whose_host_is_not_found_is_named_so_at_the_timeout(monkeypatch, process_id):
    """A coordinator host no resolver knows (a typo, a cluster name from elsewhere): every
    process waited its timeout and then blamed the others, process 0 saying 'process 1 never
    connected', process 1 'process 0 (the coordinator ...) is not running'. The name is looked
    up only then (a cluster's DNS may name process 0 only once it runs)."""
    from symjax_mlp.training import _processes

    said, ended = [], threading.Event()
    monkeypatch.setattr(_processes, "end", lambda message: (said.append(message), ended.set()))
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: ended.wait(30))
    monkeypatch.setitem(_processes._settings, "timeout", 60)
    sm.training.initialize("nohost.invalid:18790", 2, process_id, timeout=1)
    (message,) = said
    assert f"process {process_id} of 2 waited 1 s at the coordinator nohost.invalid:18790: " in (
        message
    )
    assert "its host nohost.invalid is not found (" in message, message
    assert "never connected" not in message and "is not running" not in message, message
    assert message.endswith("Pass process 0's address: its IP, or a name this machine resolves.")


@pytest.mark.slow  # initialize's shortest timeout, 1 s
def test_a_coordinator_address_answered_by_something_else_is_not_blamed_on_a_missing_peer(
    monkeypatch,
):
    """Process 1 of 2 at an address where a process answers but lets it join no run (another
    program on the port, or a process 0 started with another number of processes): it said
    'process 0 never connected', though what answered there was up all along."""
    from symjax_mlp.training import _processes

    said, ended = [], threading.Event()
    monkeypatch.setattr(_processes, "end", lambda message: (said.append(message), ended.set()))
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: ended.wait(30))
    monkeypatch.setitem(_processes._settings, "timeout", 60)
    with socket.socket() as other:  # another program's port
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        sm.training.initialize(f"127.0.0.1:{port}", 2, 1, timeout=1)
    (message,) = said
    assert f"127.0.0.1:{port}: a process answers there, but not as process 0 of this run (" in (
        message
    ), message
    assert "never connected" not in message and "is not running" not in message, message


@pytest.mark.slow  # two processes of the command line (~5 s)
def test_a_second_process_0_on_a_coordinators_port_is_refused_not_sharing_it(tmp_path):
    """gRPC binds with SO_REUSEPORT: a second process 0 (this run's started twice, or another
    run's on the same port) shared the port with the first, each peer joined either one, and
    both waited out their timeout saying their process 1 never connected. The second now exits
    2 at once, in one line without a traceback; the first is left as it was."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = subprocess.Popen(
        _train_process_0(port, 60), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while not _served(port) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert first.poll() is None and _served(port), "the first process 0 did not serve"
        second = subprocess.run(
            _train_process_0(port, 60), env=ENV, capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 2, second.stderr
        lines = second.stderr.splitlines()
        assert "Traceback" not in second.stderr and "a bug" not in second.stderr, second.stderr
        assert f"process 0 serves the coordinator on port {port}" in lines[0], lines
        assert first.poll() is None  # still serving: its run is not the second's to end
    finally:
        first.kill()
        first.communicate()


@pytest.mark.slow  # a local Ray cluster started and stopped (~20 s)
@pytest.mark.ray
@pytest.mark.xdist_group("ray")
def test_serve_on_ray_on_a_port_in_use_is_refused_as_serve_refuses_it(tmp_path):
    """``symjax-mlp serve --ray --port P`` with P in use: Ray's proxy could not bind, and its
    RayTaskError came out as a bug of ours, traceback and all, where ``serve`` without --ray
    says 'cannot listen on ...' in one line (exit status 2)."""
    pytest.importorskip("ray.serve", reason="needs the ray extra: pip install 'symjax_mlp[ray]'")
    art = sm.chapter.export_mlp(tmp_path / "mlp")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cmd = [sys.executable, "-m", "symjax_mlp", "serve", str(art.path), "--ray"]
        cmd += ["--replicas", "1", "--replica-cpus", "0.5", "--host", "127.0.0.1"]
        done = subprocess.run(
            [*cmd, "--port", str(port)], env=ENV, capture_output=True, text=True, timeout=300
        )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "a bug in symjax_mlp" not in done.stderr, done.stderr[-3000:]  # Ray logs its own
    said = done.stderr.strip().splitlines()[-1]
    assert said.startswith(
        f"symjax-mlp serve: error: cannot listen on 127.0.0.1:{port} (Address already in use)."
    ), said


@pytest.mark.slow  # Ray imported, the artifact loaded per address (~5 s)
@pytest.mark.ray
@pytest.mark.xdist_group("ray")
def test_serve_on_ray_joining_no_cluster_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """``--ray-address`` (or RAY_ADDRESS) where no cluster answers: a closed host:port was
    retried by Ray for ever (a process that never served nor ended), ``ray://`` to it and a
    malformed address were Ray's ConnectionError and ValueError, shown as bugs of ours with
    their tracebacks."""
    ray = pytest.importorskip("ray", reason="needs the ray extra: pip install 'symjax_mlp[ray]'")
    with warnings.catch_warnings():  # Ray Serve's own pydantic deprecations, as it imports
        warnings.simplefilter("ignore")
        import ray.serve
    from symjax_mlp.cli import main

    art = sm.chapter.export_mlp(tmp_path / "mlp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens there once the block ends
    argv = ["serve", str(art.path), "--ray", "--replicas", "1", "--replica-cpus", "0.5"]
    argv += ["--host", "127.0.0.1", "--port", "0", "--dispatch", "async"]  # JAX ran here
    addresses = (f"127.0.0.1:{closed}", f"ray://127.0.0.1:{closed}", "no-address", None)
    for address in addresses:  # None: Ray's own RAY_ADDRESS, as the variable was given
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{closed}")
        what = "RAY_ADDRESS" if address is None else "--ray-address"
        assert main(argv if address is None else [*argv, "--ray-address", address]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith(
            f"symjax-mlp serve: error: {what} {address or f'127.0.0.1:{closed}'}: no Ray "
            "cluster answers there ("
        ), err
        assert f"leave {what} out to start a local cluster." in err
        assert not ray.is_initialized()


def test_serve_verify_and_bench_print_an_odd_artifact_path_escaped(capsys):
    """An artifact directory named with an escape and a newline (a stranger's download, a
    shared volume): ``inspect``, ``run`` and every error printed it escaped, but ``serve``'s
    ready line, ``verify``'s report and ``bench``'s table printed it raw, so the escape acted on
    the terminal and the newline split the line (a log reader took 'x on http://...' for a
    line of its own)."""
    from symjax_mlp.serving._app import print_ready

    odd, shown = "/srv/es\x1b[31mc\nx", "/srv/es\\x1b[31mc\\nx"
    print_ready(odd)("http://127.0.0.1:8000")
    out = capsys.readouterr().out
    assert out.startswith(f"serving {shown} on http://127.0.0.1:8000 (POST /predict") and (
        out.count("\n") == 1
    ), out
    check = sm.VerifyCheck("jax", 1, True, 0.0)
    report = sm.VerifyReport(Path(odd), "the artifact", 1e-5, 1e-5, (check,), {"jax": 0.5})
    assert str(report).splitlines()[0] == f"verify {shown}: OK"
    timing = sm.CallTiming(odd, 10, "async", (2e-6,), (1e-6,), (1e-6,), (1e-6,))
    assert str(timing).splitlines()[0].startswith(f"{shown}: 10 calls x 1 repeats, per call")
    assert "\x1b" not in str(report) + str(timing)
