"""Multi-process training: bitwise like one process, Orbax checkpoints, faults with real processes.

The processes run ``tests/workers/multiprocess_worker.py`` (``sm.training.initialize``, then
``sm.training.train``) on localhost, one CPU device each, gloo collectives over loopback. The
reference runs here, in one process, with the same ``blocks``. Faults: a SIGKILL while a save
is being written, a process that never arrives, one that stalls, one started differently.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from helpers import STRICT_WARNINGS

import symjax_mlp as sm
from symjax_mlp.training._orbax import OrbaxCheckpoints
from symjax_mlp.training._paths import checkpoints

WORKER = Path(__file__).parent / "workers" / "multiprocess_worker.py"
README = Path(__file__).parent.parent / "README.md"
sys.path.insert(0, str(WORKER.parent))
from multiprocess_worker import BATCH, LR, SIZES, problem  # noqa: E402

TIMEOUT = 6  # the runs' timeout (s): a missing or stalled process fails the others after it
ENV = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")


def orbax_steps(directory: Path) -> list[int]:
    """The committed Orbax steps in ``directory``."""
    return [step for step, _ in checkpoints(directory, orbax=True)]


def _port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _launch(n: int, out: Path, *args: str, ids=None, extra=None) -> list[subprocess.Popen]:
    """Starts processes ``ids`` (default: all) of an ``n``-process run; ``extra[i]``: more
    arguments for process ``i``."""
    port = _port()
    procs = []
    for i in range(n) if ids is None else ids:
        more = (extra or {}).get(i, ())
        cmd = [sys.executable, *STRICT_WARNINGS, str(WORKER), str(i), str(n), port,
               str(out / f"{i}.npz"), "--timeout", str(TIMEOUT), *args, *more]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return procs


def _wait(procs: list[subprocess.Popen], limit: float = 120) -> tuple[list[int], list[str], float]:
    """``(return codes, logs, seconds until the last one ended)``; kills what outlives ``limit``."""
    t0 = time.monotonic()
    try:
        logs = [p.communicate(timeout=limit)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], logs, time.monotonic() - t0


@functools.cache  # the SIGKILL tests resume to the same run
def _reference(epochs: int, blocks: int) -> list[np.ndarray]:
    """The same run in this one process."""
    result = sm.training.train(sm.mlp(SIZES), problem(), optimizer=optax.adam(LR), epochs=epochs,
                               batch_size=BATCH, blocks=blocks)  # fmt: skip
    return [np.asarray(a) for a in jax.tree.leaves(result.params)]


def _params(path: Path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"param_{i}"] for i in range(len([k for k in f.files if k.startswith("param_")]))]


def _assert_bitwise(got: list[np.ndarray], want: list[np.ndarray], where: str) -> None:
    assert len(got) == len(want), where
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and np.array_equal(g, w), (
            f"{where}: leaf {i} differs by up to {np.max(np.abs(g - w))}"
        )


# -- in this process: the blocked step, the Orbax checkpoint's checks ------------------------
def test_a_blocked_step_is_bitwise_the_same_on_1_2_4_and_8_devices():
    """The fixed reduction order: each block's gradient alone, gathered, added in block order."""
    net, opt = sm.mlp(SIZES), optax.adam(LR)
    data = problem()
    x, y = data.x_train[:64], data.y_train[:64]
    p0 = net.init(jax.random.key(0), x[:1])["params"]

    def run(step) -> list[np.ndarray]:
        params, opt_state = p0, opt.init(p0)
        for _ in range(5):
            params, opt_state, _ = step(params, opt_state, x, y, np.ones(64, np.float32))
        return [np.asarray(a) for a in jax.tree.leaves(params)]

    want = run(jax.jit(sm.training.train_step(net, opt, blocks=8)))
    for n in (1, 2, 4, 8):
        step = sm.training.shard_step(
            sm.training.train_step(net, opt, blocks=8), sm.data_mesh(n), donate=False
        )
        _assert_bitwise(run(step), want, f"{n} devices")
    whole = run(
        sm.training.shard_step(sm.training.train_step(net, opt), sm.data_mesh(8), donate=False)
    )
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(whole, want, strict=True)) < 1e-5
    with pytest.raises(sm.ConfigError, match=r"blocks=3 over 2 shards.*divide the blocks"):
        sm.training.shard_step(sm.training.train_step(net, opt, blocks=3), sm.data_mesh(2))
    with pytest.raises(sm.ConfigError, match=r"blocks=3 must divide batch_size=32"):
        sm.training.train(net, data, batch_size=32, blocks=3)


def test_initialize_refuses_bad_arguments_before_starting_anything():
    cases = {
        ("localhost", 2, 0): "coordinator must be 'host:port'",
        ("127.0.0.1:1234", 2, 2): "process_id must be an int in 0 .. num_processes - 1",
        ("127.0.0.1:1234", 0, 0): "num_processes must be an int >= 1",
    }
    for args, message in cases.items():
        with pytest.raises(sm.ConfigError, match=message):
            sm.training.initialize(*args)
    with pytest.raises(
        sm.ConfigError, match=r"timeout=0\): timeout must be an int >= 1 \(seconds\)"
    ):
        sm.training.initialize("127.0.0.1:1234", 2, 0, timeout=0)
    assert not jax.distributed.is_initialized()


def test_a_timeout_past_what_jax_and_threads_take_is_refused_before_starting_anything():
    """timeout=10**10 ('for ever') reached JAX's runtime as a TypeError ('incompatible function
    arguments': it takes int32 seconds), after the alarm's thread had died of an OverflowError;
    in train(), timeout * 1000 ms past int64 read as a process that never posted."""
    with pytest.raises(sm.ConfigError, match=r"timeout=10000000000\): timeout must be an int "
                       r">= 1 \(seconds\), at most 10\*\*9"):  # fmt: skip
        sm.training.initialize("127.0.0.1:1234", 2, 0, timeout=10**10)
    assert not jax.distributed.is_initialized()
    with pytest.raises(sm.ConfigError, match=r"timeout must be an int >= 1 \(seconds\), at most"):
        sm.training.train(sm.mlp(SIZES), problem(), epochs=1, timeout=2**70)


def test_initialize_reads_a_bracketed_ipv6_coordinator_and_refuses_a_port_past_65535():
    """'[::1]:1234' gave the reachability probe the host '[::1]', brackets and all (so a
    coordinator that was up was reported 'not running'); a port of 99999 passed the check and
    reached the socket's OverflowError in the timer thread."""
    from symjax_mlp.training._processes import host_port

    assert host_port("[::1]:1234") == ("::1", 1234)
    assert host_port("127.0.0.1:1234") == ("127.0.0.1", 1234)
    for bad in ("localhost", "localhost:99999", "localhost:0", "[::1]", ":1234", 1234):
        assert host_port(bad) == ("", 0)
    with pytest.raises(sm.ConfigError, match="coordinator must be 'host:port'"):
        sm.training.initialize("localhost:99999", 2, 0)


def test_initialize_takes_numpy_integers_and_refuses_bools_and_floats(monkeypatch):
    """initialize(num_processes=np.int64(2)) was refused, 'num_processes must be an int >= 1',
    for a count a user computed with NumPy; each is passed on as its int."""
    from symjax_mlp.training import _processes

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setitem(_processes._settings, "timeout", 60)
    sm.training.initialize("127.0.0.1:1234", np.int64(2), np.int32(1), timeout=np.uint8(9))
    ((_, kw),) = calls
    assert (kw["num_processes"], kw["process_id"], kw["heartbeat_timeout_seconds"]) == (2, 1, 9)
    assert type(kw["num_processes"]) is int and type(kw["process_id"]) is int
    for args in ((True, 0), (2.0, 0), (np.int64(2), np.bool_(False)), (np.int64(-1), 0)):
        with pytest.raises(sm.ConfigError, match="must be an int"):
            sm.training.initialize("127.0.0.1:1234", *args)


def _saved(
    tmp_path: Path, opt: optax.GradientTransformation | None = None
) -> tuple[OrbaxCheckpoints, sm.training.TrainState, Path]:
    net, opt = sm.mlp(SIZES), opt or optax.adam(LR)
    params = net.init(jax.random.key(0), np.zeros((1, 12), np.float32))["params"]
    state = sm.training.TrainState(params, opt.init(params), jax.random.key(3), step=8, epoch=1)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    store = OrbaxCheckpoints(tmp_path / "ck", timeout=30, sharding=sharding)
    path = store.save(state, {"config": {}, "history": []})
    store.close()
    return OrbaxCheckpoints(tmp_path / "ck", timeout=30, sharding=sharding), state, path


def _states(opt: optax.GradientTransformation | None = None):
    """``state(step)``: a training state at ``step``, its params shifted by ``step``."""
    net, opt = sm.mlp(SIZES), opt or optax.adam(LR)
    params = net.init(jax.random.key(0), np.zeros((1, 12), np.float32))["params"]

    def state(step: int) -> sm.training.TrainState:
        moved = jax.tree.map(lambda a: a + step, params)
        return sm.training.TrainState(moved, opt.init(moved), jax.random.key(step), step=step)

    return state


def test_saves_queue_two_deep_then_wait_and_a_failed_one_raises_at_the_next(tmp_path, monkeypatch):
    """Orbax's blocking part of a save can take longer than the steps between two saves: the
    training thread queues up to two (each a device copy), waits past that, and a save that
    failed raises in the training thread at the next save, a CheckpointError naming the
    directory; every queued one is handed to Orbax, in order (none superseded here: Orbax says
    no save is committing)."""
    import threading

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    store = OrbaxCheckpoints(tmp_path / "ck", timeout=30, sharding=sharding)
    monkeypatch.setattr(store.manager, "is_saving_in_progress", lambda: False)
    gate, written, write, state = threading.Event(), [], OrbaxCheckpoints._write, _states()

    def slow(self, step, *rest):
        gate.wait(30)
        written.append(step)
        if step == 3:
            raise OSError("disk full")
        write(self, step, *rest)

    monkeypatch.setattr(OrbaxCheckpoints, "_write", slow)
    store.save(state(1), {})  # being written
    store.save(state(2), {})  # queued: two in all, neither waited for
    third = threading.Thread(target=store.save, args=(state(3), {}))
    third.start()
    third.join(1.0)
    assert third.is_alive() and written == []  # a third waits for the first
    gate.set()
    third.join(30)
    assert not third.is_alive()
    with pytest.raises(sm.CheckpointError, match="disk full"):  # 3 failed: said at the next
        for step in (4, 5, 6):
            store.save(state(step), {})
    store.close()
    assert written[:3] == [1, 2, 3] and orbax_steps(tmp_path / "ck")[-1] >= 2


def test_a_save_made_while_the_one_before_commits_is_superseded_and_the_last_is_written(
    tmp_path, monkeypatch
):
    """Saves came every ~160 ms and Orbax's commit of one took longer: each save waited for
    the commit before it (the steps with it). A save made while one commits is now superseded
    at once; the run's last save waits and is written; close() leaves it committed, and it
    restores bitwise; the steps past the newest two are deleted (in Orbax's background) by
    then. Orbax's commit is faked slow: it ends when ``committed`` is set."""
    import threading

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    store = OrbaxCheckpoints(tmp_path / "ck", timeout=30, sharding=sharding)
    manager, committed, waiting, state = (
        store.manager,
        threading.Event(),
        threading.Event(),
        _states(),
    )
    wait = manager.wait_until_finished

    def wait_for_the_commit_before() -> None:
        if manager.all_steps():
            waiting.set()
            committed.wait(30)
        wait()

    committing = lambda: bool(manager.all_steps()) and not committed.is_set()  # noqa: E731
    monkeypatch.setattr(manager, "is_saving_in_progress", committing)
    monkeypatch.setattr(manager, "wait_until_finished", wait_for_the_commit_before)
    store.save(state(1), {})  # written, then committing until `committed`
    saver = threading.Thread(target=lambda: [store.save(state(s), {}) for s in (2, 3, 4, 5)])
    saver.start()
    saver.join(20)
    assert not saver.is_alive() and not committed.is_set()  # none waited for the commit
    store._finish()  # the writer is done with 2..5, all superseded
    assert store.superseded == [2, 3, 4, 5] and orbax_steps(tmp_path / "ck") == []
    path = store.save(state(6), {"last": True}, last=True)  # 1 still commits: written anyway
    assert waiting.wait(10)  # the writer waits for 1's commit, then writes 6
    committed.set()
    store.save(state(7), {"last": True})  # none committing: written
    store.close()
    assert store.superseded == [2, 3, 4, 5] and orbax_steps(tmp_path / "ck") == [6, 7]
    reader = OrbaxCheckpoints(tmp_path / "ck", timeout=30, sharding=sharding)
    got, meta = reader.restore(path, state(0))
    reader.close()
    _assert_bitwise(*(
        [np.asarray(a) for a in jax.tree.leaves((s.params, s.opt_state))] for s in (got, state(6))
    ), "restored")  # fmt: skip
    assert got.step == 6 and meta == {"last": True}


def test_a_saves_derived_metadata_is_computed_on_the_writer_thread_from_the_copy(tmp_path):
    """The optimizer's probe of each save's metadata ran on the training thread before the
    save, unmeasured: 5-20 ms a save. ``derived`` runs on the writer thread, from the state's
    copy: the save returns while it runs, and the checkpoint holds what it returned."""
    import threading

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    store = OrbaxCheckpoints(tmp_path / "ck", timeout=30, sharding=sharding)
    returned, seen, state = threading.Event(), [], _states()

    def derived(copy):  # waits for the save to return: it would wait for derived before
        seen.append((threading.current_thread(), returned.wait(10)))
        return {"probe": [float(jax.tree.leaves(copy.params)[0].ravel()[0])]}

    path = store.save(state(2), {"history": []}, derived=derived)
    returned.set()
    store.close()
    assert seen == [(seen[0][0], True)] and seen[0][0] is not threading.current_thread()
    reader = OrbaxCheckpoints(tmp_path / "ck", timeout=30, sharding=sharding)
    _, meta = reader.restore(path, state(0))
    reader.close()
    want = float(jax.tree.leaves(state(2).params)[0].ravel()[0])
    assert meta == {"history": [], "probe": [want]}


def test_an_orbax_checkpoint_holds_no_array_metadatas(tmp_path):
    """Orbax's default jax.Array handler writes an ArrayMetadata store whose directory every
    process but 0 polls for, every 250 ms: each commit of a 2-process run took ~260 ms, not
    ~60, and the saves queued behind it. Our manifest holds the shapes and dtypes instead."""
    _, _, path = _saved(tmp_path)
    assert (path / "state").is_dir() and not list(path.rglob("array_metadatas"))


# a failed read leaves futures of Orbax's event loop unretrieved (asyncio logs them when they
# are collected, at the end of the test): Orbax's, not an error of ours
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_orbax_checkpoint_restores_exactly_and_refuses_foreign_edited_or_truncated(tmp_path):
    store, state, path = _saved(tmp_path)
    assert store.latest() == path and path.name == "8"
    restored, meta = store.restore(path, state)
    _assert_bitwise(*(
        [np.asarray(a) for a in jax.tree.leaves((s.params, s.opt_state))] for s in (restored, state)
    ), "restored")  # fmt: skip
    assert (restored.step, restored.epoch, meta) == (8, 1, {"config": {}, "history": []})
    assert np.array_equal(jax.random.key_data(restored.rng), jax.random.key_data(state.rng))

    wider = sm.mlp((32, 4)).init(jax.random.key(0), np.zeros((1, 12), np.float32))["params"]
    foreign = sm.training.TrainState(wider, optax.adam(LR).init(wider), jax.random.key(0))
    with pytest.raises(
        sm.CheckpointError, match=r"layers_0/bias. has shape \(16,\).*expects shape \(32,\)"
    ):
        store.restore(path, foreign)
    sgd = sm.training.TrainState(state.params, optax.sgd(LR).init(state.params), state.rng)
    with pytest.raises(sm.CheckpointError, match="does not fit this model and optimizer"):
        store.restore(path, sgd)

    data = {f: f.read_bytes() for f in (path / "state").rglob("*") if f.parent.name == "d"}
    assert data, list((path / "state").rglob("*"))  # the arrays' files, as tensorstore has them
    for f, blob in data.items():
        f.write_bytes(blob[: len(blob) // 2])  # truncated
    with pytest.raises(sm.CheckpointError, match=r"8: its arrays (cannot be read|are not the)"):
        store.restore(path, state)
    for f, blob in data.items():
        f.write_bytes(blob[:-9] + bytes([blob[-9] ^ 1]) + blob[-8:])  # one bit flipped
    with pytest.raises(sm.CheckpointError, match=r"8: its arrays (cannot be read|are not the)"):
        store.restore(path, state)
    for f, blob in data.items():
        f.write_bytes(blob)
    store.restore(path, state)  # whole again
    other = dataclasses.replace(state, params=jax.tree.map(lambda a: a + 1, state.params), step=16)
    writer = OrbaxCheckpoints(path.parent, timeout=30, sharding=store.sharding)
    writer.save(other, {"config": {}, "history": []})
    writer.close()
    shutil.rmtree(path / "state")
    shutil.copytree(path.parent / "16" / "state", path / "state")  # valid arrays, another step's
    with pytest.raises(sm.CheckpointError, match=r"8: its arrays are not the ones saved"):
        store.restore(path, state)  # tensorstore's checksums pass: our sha256 does not
    (path / "meta" / "metadata").write_text('{"format": "something else"}')
    with pytest.raises(sm.CheckpointError, match="meta item is missing or malformed"):
        store.restore(path, state)
    gc.collect()  # Orbax's unretrieved futures go now, under this test's filter


def test_an_orbax_checkpoint_of_an_optimizer_state_holding_a_prng_key_round_trips(tmp_path):
    """optax.noisy_sgd's state holds a typed key: Orbax's save of it failed (no such dtype)."""
    store, state, path = _saved(tmp_path, optax.noisy_sgd(LR, key=jax.random.key(5)))
    got, _ = store.restore(path, state)
    store.close()
    want = jax.random.key_data(jax.tree.leaves(state.opt_state)[1])
    key = jax.tree.leaves(got.opt_state)[1]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    assert np.array_equal(jax.random.key_data(key), want)
    gc.collect()  # Orbax's unretrieved futures go now, under this test's filter


def test_one_process_refuses_a_directory_of_orbax_checkpoints(tmp_path):
    _saved(tmp_path)
    with pytest.raises(sm.CheckpointError, match="checkpoints of a multi-process run"):
        sm.training.train(sm.mlp(SIZES), problem(), checkpoint=tmp_path / "ck", resume=True)


# -- real processes --------------------------------------------------------------------------
# Runs that must succeed take a long timeout: a first compile on a busy machine (CI's two cores,
# two test processes) may take longer than TIMEOUT. Runs side by side compete for the cores and
# spin in their collectives: only the fault runs that mostly wait share the time.
PATIENT = ("--timeout", "60")


@pytest.mark.slow
def test_2_and_4_processes_train_bitwise_like_one_process(tmp_path):
    """Every other process names the one checkpoint directory by another path (alias/ck,
    alias a symlink to real, for real/ck): they share it. The directories were once compared
    by os.path.abspath, by name, and these two were refused as two. Whether a save is
    superseded (one is committing) is process 0's answer for all: process 1 of the 2 says one
    always is, and its first save is written; process 0 of the 4 says so, and only the last
    is. A process deciding alone would wait at Orbax's barrier for a save the others skip."""
    want = None
    for n in (2, 4):
        out = tmp_path / str(n)
        (out / "real").mkdir(parents=True)
        (out / "alias").symlink_to(out / "real")
        paths = {i: ("--checkpoint", str(out / ("real", "alias")[i % 2] / "ck")) for i in range(n)}
        paths[{2: 1, 4: 0}[n]] += ("--committing",)
        launched = _launch(n, out, "--blocks", "4", *PATIENT, extra=paths)
        if want is None:  # while the first run starts
            want = _reference(epochs=2, blocks=4)
        codes, logs, _ = _wait(launched)
        assert codes == [0] * n, "\n---\n".join(logs)
        for i in range(n):
            _assert_bitwise(_params(out / f"{i}.npz"), want, f"{n} processes, process {i}")
            with np.load(out / f"{i}.npz") as f:  # TrainResult says so on every process
                assert f["superseded"].tolist() == {2: [], 4: [8]}[n], (n, i)
        steps = {2: ["16", "8"], 4: ["16"]}[n]  # Orbax's
        assert sorted(p.name for p in (out / "real" / "ck").iterdir()) == steps


@pytest.mark.slow
@pytest.mark.parametrize("killed", [0, 1])
def test_sigkill_during_a_save_then_relaunching_resumes_bitwise(tmp_path, killed):
    ck = str(tmp_path / "ck")
    procs = _launch(2, tmp_path, "--checkpoint", ck, "--epochs", "3",
                    extra={killed: ("--kill-after-save", "2")})  # fmt: skip
    codes, logs, seconds = _wait(procs)
    assert codes[killed] == -signal.SIGKILL, logs[killed]
    assert codes[1 - killed] != 0, logs[1 - killed]  # the other failed too, in bounded time
    assert seconds < 3 * TIMEOUT + 30, seconds
    resumed = _launch(2, tmp_path, "--checkpoint", ck, "--epochs", "3", "--resume", *PATIENT)
    want = _reference(epochs=3, blocks=2)
    codes, logs, _ = _wait(resumed)
    assert codes == [0, 0], "\n---\n".join(logs)
    for i in range(2):
        with np.load(tmp_path / f"{i}.npz") as f:
            assert int(f["resumed_step"]) in (8, 16) and int(f["step"]) == 24
        _assert_bitwise(_params(tmp_path / f"{i}.npz"), want, f"resumed, process {i}")


@pytest.mark.slow
def test_a_process_that_never_arrives_or_stalls_fails_the_others_within_the_timeout(tmp_path):
    """Side by side, their waits overlapping: two runs of one process each (its other process
    never arrives), and a run whose process 1 stalls after its first epoch. Each failure names
    the process it waited for."""
    (tmp_path / "alone").mkdir()
    (tmp_path / "stalled").mkdir()
    t0 = time.monotonic()
    alone = _launch(2, tmp_path / "alone", ids=[0]) + _launch(2, tmp_path / "alone", ids=[1])
    stalled = _launch(2, tmp_path / "stalled", "--epochs", "2", extra={1: ("--stall-after", "1")})
    try:
        codes, logs, _ = _wait(alone)
        seconds = time.monotonic() - t0
        assert codes == [sm.training.EXIT_STATUS] * 2, logs
        assert f"process 0 of 2 waited {TIMEOUT} s at the coordinator" in logs[0]
        assert "process 1 never connected" in logs[0]
        assert "process 0 (the coordinator, serving 127.0.0.1:" in logs[1]
        assert seconds < TIMEOUT + 20, f"one that never arrived failed the other after {seconds} s"

        log0 = stalled[0].communicate(timeout=120)[0]
        seconds = time.monotonic() - t0
        _wait(stalled[1:], limit=3 * TIMEOUT)
        assert stalled[0].returncode == sm.training.EXIT_STATUS, log0
        waited = f"process 0 of 2 waited {TIMEOUT} s in step 8 for process 1 (done with step 7)"
        assert waited in log0, log0
        assert seconds < TIMEOUT + 40, f"one that stalled failed the other after {seconds} s"
    finally:  # what a failed assert left running (the stalled process sleeps for an hour)
        for proc in (*alone, *stalled):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.mark.slow
def test_processes_started_differently_are_refused_before_the_first_collective(tmp_path):
    """One run, process 1 started with another seed and another checkpoint directory under
    the same name: ck, and hop/../ck where hop is a symlink to other/inner, so other/ck. Each
    process names what differs, both of it, before gloo connects and before either directory
    is made. Processes given other directories once each trained an epoch, then Orbax's save
    waited on a barrier the other never reached; ck and hop/../ck, compared by
    os.path.abspath, were taken as one, and the two stores' barriers timed out."""
    (tmp_path / "other" / "inner").mkdir(parents=True)
    (tmp_path / "hop").symlink_to(tmp_path / "other" / "inner")
    args = {0: ("--checkpoint", str(tmp_path / "ck")),
            1: ("--checkpoint", f"{tmp_path}/hop/../ck", "--seed", "1")}  # fmt: skip
    codes, logs, _ = _wait(_launch(2, tmp_path, extra=args))
    assert codes == [1, 1], logs
    said = "process 1 was started with {'checkpoint': '"  # a long path cut in its middle
    assert said in logs[0] and "/other/ck', 'seed': 1}, but process 0 with {" in logs[0], logs[0]
    assert f"{tmp_path.name}/ck', 'seed': 0}}. Every process" in logs[0], logs[0]
    said = "process 0 was started with {'checkpoint': '"
    assert said in logs[1] and "/ck', 'seed': 0}, but process 1 with {" in logs[1], logs[1]
    assert "/other/ck', 'seed': 1}." in logs[1], logs[1]
    for log in logs:
        assert "ConfigError" in log and "refused before the first step" in log
        assert "Gloo" not in log  # gloo connects at the first collective: none ran
    assert not (tmp_path / "ck").exists() and not (tmp_path / "other" / "ck").exists()


def test_the_cli_refuses_processes_without_a_coordinator(capsys):
    from symjax_mlp.cli import main

    assert main(["train", "--num-processes", "2", "--epochs", "1"]) == 2
    assert "--num-processes needs --coordinator HOST:PORT" in capsys.readouterr().err
    assert main(["train", "--coordinator", "localhost", "--num-processes", "2"]) == 2
    assert "coordinator must be 'host:port'" in capsys.readouterr().err


@pytest.mark.slow
def test_the_cli_starts_a_2_process_run_as_the_readme_shows(tmp_path):
    """The README's block, run here rather than by ``tests/test_readme.py`` (one 2-process run,
    not two): as written, but on a free port and with ``--json`` given to process 1 too, which
    must leave it to process 0."""
    blocks = re.findall(r"^```bash\n(.*?)^```\n", README.read_text(), re.M | re.S)
    (block,) = [b for b in blocks if "--num-processes 2" in b]
    assert block.count("127.0.0.1:1234") == 2, block
    script = block.replace("127.0.0.1:1234", f"127.0.0.1:{_port()}")
    (second,) = [line for line in script.splitlines() if "--process-id 1" in line]
    script = script.replace(second, f"{second} --json run1.json")
    env = dict(ENV, PATH=os.pathsep.join([str(Path(sys.executable).parent), ENV["PATH"]]))
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, f"{script}\nfailed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["step"] == 46 and len(run["checkpoint_waits"]) == 2, run
    assert not (tmp_path / "run1.json").exists()  # process 0 writes the results
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["23", "46"]  # Orbax's


# -- a multi-process run's checkpoints, read by a new run (init_from) -------------------------
@pytest.fixture(scope="module")
def orbax_run(tmp_path_factory) -> tuple[Path, list[np.ndarray]]:
    """``(its checkpoint directory, its params)`` of a real 2-process run: Orbax's steps 8, 16."""
    out = tmp_path_factory.mktemp("orbax_run")
    codes, logs, _ = _wait(_launch(2, out, "--checkpoint", str(out / "ck"), *PATIENT))
    assert codes == [0, 0], "\n---\n".join(logs)
    assert sorted(p.name for p in (out / "ck").iterdir()) == ["16", "8"]
    return out / "ck", _params(out / "0.npz")


def _start(init_from: Path, model=None, **run) -> list[np.ndarray]:
    """The params a one-process run of no epochs starts with, from ``init_from``, its optimizer
    another than the one that wrote it."""
    result = sm.training.train(model or sm.mlp(SIZES), problem(), optimizer=optax.sgd(0.5),
                               epochs=0, batch_size=BATCH, init_from=init_from, **run)  # fmt: skip
    return [np.asarray(a) for a in jax.tree.leaves(result.params)]


@pytest.mark.slow
def test_one_process_starts_from_a_2_process_runs_orbax_checkpoint_bitwise(orbax_run):
    """init_from refused a directory of Orbax checkpoints: a run on two processes could not be
    fine-tuned in one (a notebook). Its newest is read (another optimizer: none of it is used),
    a step named is that step; another model is refused as a one-process run's checkpoint is."""
    ck, trained = orbax_run
    _assert_bitwise(_start(ck), trained, "init_from the run's directory")
    _assert_bitwise(_start(ck / "16"), trained, "init_from its newest step")
    assert not any(np.array_equal(a, b) for a, b in zip(_start(ck / "8"), trained, strict=True))
    with pytest.raises(sm.CheckpointError, match="model's configuration") as e:
        _start(ck, sm.mlp((8, 4)))
    said = str(e.value)
    assert said.startswith(f"symjax_mlp.training.train(init_from='{ck}'): {ck / '16'} was "), said
    assert "pass that model, or leave init_from out" in said


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Orbax's futures
def test_init_from_an_orbax_step_truncated_or_never_committed_is_refused_or_passed_over(
    orbax_run, tmp_path
):
    """As a resume: a truncated or edited step refused, a save never committed refused if named,
    passed over (for the newest committed one) if it is Orbax's unfinished temporary directory;
    the directory read is left as it was (read_only: nothing cleaned up, nothing written)."""
    ck = tmp_path / "ck"
    shutil.copytree(orbax_run[0], ck)
    step_8 = _start(ck / "8")
    data = {f: f.read_bytes() for f in (ck / "16" / "state").rglob("*") if f.parent.name == "d"}
    for f, blob in data.items():
        f.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(sm.CheckpointError, match=r"16: its arrays (cannot be read|are not the)"):
        _start(ck)
    for f, blob in data.items():
        f.write_bytes(blob)
    meta = ck / "16" / "meta" / "metadata"
    saved, edited = meta.read_text(), json.loads(meta.read_text())
    edited["tensors"][-2][2] = "float33"  # an optimizer's tensor: anyone's JSON, read
    meta.write_text(json.dumps(edited))
    with pytest.raises(sm.CheckpointError, match=r"16: .*declares a tensor no array can be"):
        _start(ck)
    meta.write_text(saved)
    (ck / "16" / "_CHECKPOINT_METADATA").rename(tmp_path / "marker")
    with pytest.raises(sm.CheckpointError, match=r"16: .*its save was never committed"):
        _start(ck / "16")
    (ck / "16").rename(
        ck / "16.orbax-checkpoint-tmp-1765000000"
    )  # as Orbax names an unfinished one
    before = sorted(str(p.relative_to(ck)) for p in ck.rglob("*"))
    _assert_bitwise(_start(ck), step_8, "init_from passing over an uncommitted save")
    assert sorted(str(p.relative_to(ck)) for p in ck.rglob("*")) == before
    gc.collect()  # Orbax's unretrieved futures go now, under this test's filter


@pytest.mark.slow
def test_a_2_process_run_starts_from_either_kind_of_checkpoint_bitwise_like_one_process(
    orbax_run, tmp_path
):
    """init_from a multi-process run's Orbax checkpoints, and a one-process run's step_* ones:
    2 processes train on from them bitwise as one process does (blocks=2)."""
    one = tmp_path / "one"
    sm.training.train(sm.mlp(SIZES), problem(), optimizer=optax.adam(LR), epochs=1,
                      batch_size=BATCH, seed=1, checkpoint=one)  # fmt: skip
    for source in (orbax_run[0], one):
        out = tmp_path / f"from_{source.name}"
        out.mkdir()
        launched = _launch(2, out, "--epochs", "1", "--init-from", str(source), *PATIENT)
        result = sm.training.train(sm.mlp(SIZES), problem(), optimizer=optax.adam(LR), epochs=1,
                                   batch_size=BATCH, blocks=2, init_from=source)  # fmt: skip
        want = [np.asarray(a) for a in jax.tree.leaves(result.params)]
        codes, logs, _ = _wait(launched)
        assert codes == [0, 0], "\n---\n".join(logs)
        for i in range(2):
            _assert_bitwise(_params(out / f"{i}.npz"), want, f"from {source.name}, process {i}")
