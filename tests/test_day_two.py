"""A researcher's day two, as README's "Train it", "Serve it" and "Scale out" write it: train,
checkpoint, Ctrl-C and resume, serve, and a 2-process run on one machine (session 58, Part E).

Each test is a stumble of that day: where the library, its help or its errors misled.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import symjax_mlp as sm
from symjax_mlp.serving import _bodies

ENV = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")


def _port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


@pytest.mark.slow
def test_ctrl_c_of_one_process_ends_the_other_with_exit_75_naming_it(tmp_path):
    """README, Scale out: Ctrl-C of process 1 of a 2-process `symjax-mlp train` made process 0
    fail in its next collective with gloo's JaxRuntimeError, reported as "a bug in symjax_mlp"
    (exit 1), then aborted by JAX's shutdown barrier (SIGABRT, a C++ stack trace). It now ends
    at once with exit status 75, naming the process it lost and how to resume."""
    port = _port()

    def start(i: int) -> subprocess.Popen:
        cmd = [sys.executable, "-P", "-m", "symjax_mlp", "train", "--coordinator",
               f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
               "--sizes", "16,10", "--epochs", "10000", "--checkpoint", "ckpt",
               "--timeout", "60", "--quiet"]  # fmt: skip
        return subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stderr=subprocess.PIPE, text=True)

    procs = [start(0), start(1)]
    try:
        deadline = time.monotonic() + 120
        while not any(p.name.isdigit() for p in (tmp_path / "ckpt").glob("*")):  # it trains
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGINT)
        t0 = time.monotonic()
        err1 = procs[1].communicate(timeout=60)[1]
        err0 = procs[0].communicate(timeout=60)[1]
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[1].returncode == 130, err1
    assert procs[0].returncode == 75, err0  # was 1 ("a bug"), then -6 (JAX's abort)
    assert "process 0 of 2 lost process 1 in step" in err0, err0
    assert "every process with --resume" in err0 and "bug" not in err0, err0  # the CLI's words
    assert took < 30, took  # at once: not after the 60 s timeout


def test_curl_d_without_a_content_type_is_told_the_header_to_add():
    """`curl -d '{"inputs": ...}' localhost:8000/predict`, the first try at the server, sends a
    form (application/x-www-form-urlencoded): the 415 said to send application/json, not how."""
    with sm.serving.Batcher(lambda x: x, example=np.zeros((1, 2), np.float32), max_batch=1) as b:
        with pytest.raises(_bodies.BadRequest) as e:
            _bodies.decode(b, b'{"inputs": [[1, 2]]}', "application/x-www-form-urlencoded")
        with pytest.raises(_bodies.BadRequest) as other:
            _bodies.decode(b, b"hello", "text/plain")
    assert e.value.status == 415, e.value
    assert "with curl, -H 'Content-Type: application/json'" in str(e.value), e.value
    assert "curl" not in str(other.value), other.value  # only where curl's default is the cause


@pytest.mark.slow  # 3 s: a training run and three exports
def test_a_trained_models_artifact_says_it_takes_raw_features(tmp_path):
    """`result.export(path)` bakes the data's standardisation in, and `result.hybridize()` does
    not: a colleague given the artifact (and `symjax-mlp inspect`) could not tell which it
    takes, and standardised inputs (`data.x_test`) gave 31% on digits, silently."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(5.0, 3.0, (16, 3)).astype(np.float32), np.arange(16) % 2
    data = sm.training.Dataset(x, y, x, y, mean=x.mean(0), std=x.std(0))
    result = sm.training.train(sm.mlp((4, 2)), data, epochs=1, batch_size=16)
    raw = result.export(tmp_path / "raw", metadata={"license": "MIT"})
    standardised = result.export(tmp_path / "std", raw_inputs=False)
    assert sorted(raw.metadata) == ["inputs", "license"], raw.metadata
    assert raw.metadata["inputs"].startswith("raw features"), raw.metadata
    assert sm.inspect(tmp_path / "raw").metadata == raw.metadata  # as a colleague reads it
    assert standardised.metadata == {}
    mine = result.export(tmp_path / "mine", metadata={"inputs": "pixels, 0..16"})
    assert mine.metadata == {"inputs": "pixels, 0..16"}  # the user's card wins


@pytest.mark.slow  # 3 s: a fresh process
def test_process_0_refuses_its_json_target_before_it_joins_the_run(tmp_path):
    """Relaunching README's 2-process run with --resume found run.json from the first run:
    process 0 refused it after joining, so process 1 waited, and when JAX's shutdown barrier
    timed out it aborted both (SIGABRT, a C++ stack trace). Now the refusal comes first: exit
    2, no coordinator started (a process 1 then names process 0 as not running)."""
    (tmp_path / "run.json").write_text("{}")
    cmd = [sys.executable, "-P", "-m", "symjax_mlp", "train", "--coordinator",
           f"127.0.0.1:{_port()}", "--num-processes", "2", "--process-id", "0",
           "--json", "run.json", "--timeout", "5"]  # fmt: skip
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr  # was 75 after the timeout: process 1 never came
    assert "--json run.json: already exists" in done.stderr, done.stderr
    assert time.monotonic() - t0 < 5 + 3, done.stderr  # before initialize's wait


@pytest.mark.slow  # two short training runs (2-7 s)
@pytest.mark.filterwarnings("default:--resume.*holds no checkpoint yet:UserWarning")  # train's
def test_train_resume_says_what_it_resumes_or_that_it_starts_over(tmp_path, capsys):
    """`symjax-mlp train --checkpoint ckpt_typo --resume` trained from the start, as silently as
    a resume (train's resume=True continues a checkpoint "if it holds one"): only an "epoch 1/N"
    told the two apart, and nothing under --quiet but the JSON's resumed_from."""
    from symjax_mlp.cli import main

    argv = ["train", "--sizes", "8,10", "--checkpoint", str(tmp_path / "ckpt"), "--resume"]
    assert main([*argv, "--epochs", "1"]) == 0
    err = capsys.readouterr().err
    said = f"--resume: {tmp_path / 'ckpt'} holds no checkpoint yet; training from the start"
    assert f"symjax-mlp train: warning: {said}\n" in err, err  # train's warning, in the CLI's words
    assert main([*argv, "--epochs", "2"]) == 0
    err = capsys.readouterr().err
    assert f"resuming from {tmp_path / 'ckpt' / 'step_00000023'}" in err, err
