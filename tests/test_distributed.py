"""Data parallelism: sharded inference and training equal one device, on 1, 8 and 2x1 devices.

The pytest process has JAX initialised with one CPU device. The 8-device checks run this file
as a script in a fresh process (``jax_num_cpu_devices`` must be set before JAX initialises),
which saves its results to an ``.npz``; the assertions, against single-device results computed
here, run in pytest. The multi-process check starts two ``jax.distributed`` processes on
localhost (gloo CPU collectives), each with one CPU device.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import multihost_utils
from symjax_mlp.bench import CPU_NOTE, bench_devices
from symjax_mlp.training import train_step

import symjax_mlp as sm

STEPS = 10
TOL = {"rtol": 1e-5, "atol": 1e-5}


@functools.cache
def _problem():
    """The model, optimizer, params and data shared by every process (deterministic)."""
    net, optimizer = sm.mlp((32, 16, 4)), optax.adam(1e-2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 12)).astype(np.float32)
    y = rng.integers(0, 4, 64).astype(np.int32)
    # NumPy-drawn params of init's shapes: no RNG program to compile in every process.
    shapes = jax.eval_shape(net.init, jax.random.key(0), x[:1])
    variables = jax.tree.map(lambda a: rng.normal(0, 0.3, a.shape).astype(a.dtype), shapes)
    return net, optimizer, variables, x, y


def _train(step_fn, params, optimizer, x, y, w=None):
    """STEPS steps on the same batch; returns host params and the per-step losses."""
    opt_state, losses = jax.jit(optimizer.init)(params), []
    for _ in range(STEPS):
        args = (x, y) if w is None else (x, y, w)
        params, opt_state, metrics = step_fn(params, opt_state, *args)
        losses.append(float(metrics["loss"]))
    return jax.device_get(params), losses


@functools.cache
def _single_device_train(n: int = 64):
    """Plain ``jax.jit`` training on the first ``n`` examples, on this process's one device."""
    net, optimizer, variables, x, y = _problem()
    step = jax.jit(train_step(net, optimizer))
    w = np.ones(n, np.float32)
    return _train(step, variables["params"], optimizer, x[:n], y[:n], w)


def _counted(step, traces: list):
    """``step`` that records each trace in ``traces`` (a retrace would add a second entry)."""

    def counted(*args):
        traces.append(jax.tree.map(jax.typeof, args[2:]))
        return step(*args)

    return counted


def _flat(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree.leaves_with_path(tree)}


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-W", "error", __file__, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


# -- one device, in process ---------------------------------------------------------------------
def test_data_mesh_one_device_and_clear_error_for_more():
    mesh = sm.data_mesh()
    assert dict(mesh.shape) == {"data": 1}
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,)
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        sm.data_mesh(2)


def test_shard_on_one_device_equals_hybrid():
    net, _, variables, x, _ = _problem()
    h = sm.hybridize(net, variables)
    x = x[:13]
    s = h.shard()
    assert isinstance(s, sm.Sharded) and s.n_shards == 1
    out = s(x)
    np.testing.assert_allclose(out, h(x), rtol=1e-5)
    assert out.sharding.spec == jax.sharding.PartitionSpec("data")
    s(x)
    assert s.trace_count == 1, s.trace_log


def test_shard_step_on_one_device_equals_jit():
    net, optimizer, variables, x, y = _problem()
    traces = []
    step = sm.training.shard_step(_counted(train_step(net, optimizer), traces), sm.data_mesh(1))
    got, losses = _train(step, variables["params"], optimizer, x, y)
    want, want_losses = _single_device_train()
    for k, v in _flat(want).items():
        np.testing.assert_allclose(_flat(got)[k], v, err_msg=k, **TOL)
    np.testing.assert_allclose(losses, want_losses, **TOL)
    assert losses[-1] < losses[0]
    assert len(traces) == 1, traces  # ten steps, one trace: the second call did not retrace


def test_shard_errors_say_what_to_do():
    net, _, variables, x, _ = _problem()
    h = sm.hybridize(net, variables)
    with pytest.raises(TypeError, match="expects a Hybrid"):
        sm.shard(h.fn)
    with pytest.raises(ValueError, match="axis='model' is not an axis"):
        sm.shard(h, sm.data_mesh(), axis="model")
    with pytest.raises(sm.SignatureError, match="per-example outputs"):
        sm.hybridize(lambda p, x: jnp.sum(x) * p, jnp.float32(1)).shard()(x)
    two = sm.hybridize(lambda p, a, b: a + b, {})
    with pytest.raises(sm.SignatureError, match=r"batch\) dimensions differ: \[1, 2\]"):
        two.shard()(x[:1], x[:2])


def test_public_names():
    for name in ("Sharded", "ShardedStep", "data_mesh", "shard", "shard_step", "load_sharded"):
        assert name in sm.__all__ and hasattr(sm, name)
    assert "bench_devices" in sm.__all__


# -- eight virtual CPU devices, in a subprocess -------------------------------------------------
def _check8(out_dir: str) -> None:
    """Runs in a fresh process with 8 CPU devices; saves what pytest asserts on."""
    jax.config.update("jax_num_cpu_devices", 8)
    out_dir = Path(out_dir)
    assert jax.device_count() == 8
    res: dict = {}
    net, optimizer, variables, x, y = _problem()
    h = sm.hybridize(net, variables)
    mesh = sm.data_mesh()
    s = h.shard(mesh)
    for batch in (64, 13):
        res[f"infer_{batch}"] = np.asarray(s(x[:batch]))
    s(x)
    res["infer_trace_count"] = s.trace_count  # 64 and 13 (padded to 16): two signatures
    lowered = s.lower(x)
    res["num_partitions_8"] = "mhlo.num_partitions = 8" in lowered.as_text()
    res["out_spec_is_data"] = s(x).sharding.spec == jax.sharding.PartitionSpec("data")
    res["out_devices"] = len(s(x).sharding.device_set)
    explicit = jax.make_mesh((8,), ("data",))  # JAX's default axis types (Explicit)
    res["infer_explicit"] = np.asarray(sm.shard(h, explicit)(x[:13]))
    try:
        sm.shard(h, mesh, pad=False)(x[:13])
    except sm.SignatureError as e:
        res["nopad_error"] = str(e)

    traces = []
    step = sm.training.shard_step(_counted(train_step(net, optimizer), traces), mesh)
    p0 = variables["params"]
    hlo = step.lower(p0, jax.jit(optimizer.init)(p0), x, y).compile().as_text()
    res["all_reduce_in_hlo"] = "all-reduce" in hlo
    params, losses = _train(step, p0, optimizer, x, y)
    res.update({f"train{k}": v for k, v in _flat(params).items()}, train_losses=np.array(losses))
    res["train_traces"] = len(traces)
    params61, _ = _train(step, variables["params"], optimizer, x[:61], y[:61])
    try:
        sm.training.shard_step(train_step(net, optimizer), mesh, pad=False)(p0, None, x[:61], y[:61])
    except sm.SignatureError as e:
        res["step_nopad_error"] = str(e)
    res.update({f"train61{k}": v for k, v in _flat(params61).items()})

    art = s.export(out_dir / "art8", example=x[:1], batch="b")
    res["manifest_nr_devices"] = art.manifest["nr_devices"]
    m = load_sharded(out_dir / "art8")
    for batch in (64, 13):
        res[f"loaded_{batch}"] = np.asarray(m(x[:batch]))
    try:
        load_sharded(out_dir / "art8", sm.data_mesh(4))
    except sm.ArtifactError as e:
        res["wrong_mesh_error"] = str(e)
    sm.shard(h, sm.data_mesh(2)).export(out_dir / "art2", example=x[:1])
    res["loaded_2_of_8"] = np.asarray(load_sharded(out_dir / "art2")(x[:13]))
    # sm.export of a Sharded exports its sharded program; sm.load runs an N-device artifact
    # on a mesh of the first N devices (it once raised JAX's "exported for 8 devices" error).
    art8b = sm.export(s, out_dir / "art8b", example=x[:1])
    res["sm_export_nr_devices"] = art8b.manifest["nr_devices"]
    for batch in (64, 13):
        res[f"sm_load_{batch}"] = np.asarray(sm.load(out_dir / "art8b")(x[:batch]))
    res["sm_load_2_of_8"] = np.asarray(sm.load(out_dir / "art2")(x[:13]))

    np.savez(out_dir / "check8.npz", **res)


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    out = tmp_path_factory.mktemp("eight")
    _run(["check8", str(out)])
    with np.load(out / "check8.npz") as f:
        return out, {k: f[k][()] if f[k].shape == () else f[k] for k in f.files}


def test_8_devices_inference_equals_one_device(eight):
    _, r = eight
    net, _, variables, x, _ = _problem()
    h = sm.hybridize(net, variables)
    np.testing.assert_allclose(r["infer_64"], h(x), rtol=1e-5, atol=1e-6)
    assert r["num_partitions_8"]  # one SPMD program for all eight devices
    assert r["out_spec_is_data"] and r["out_devices"] == 8
    assert r["infer_trace_count"] == 2  # batch 64 and batch 13 (padded to 16); no retraces


def test_8_devices_batch_13_is_padded_and_trimmed(eight):
    _, r = eight
    net, _, variables, x, _ = _problem()
    want = sm.hybridize(net, variables)(x[:13])
    for key in ("infer_13", "infer_explicit"):
        assert r[key].shape == (13, 4)
        np.testing.assert_allclose(r[key], want, rtol=1e-5, atol=1e-6, err_msg=key)
    assert "batch 13 does not divide over 8 shards" in r["nopad_error"]
    assert "multiple of 8 (e.g. 16)" in r["nopad_error"]


def test_8_devices_training_equals_one_device(eight):
    _, r = eight
    want, want_losses = _single_device_train()
    for k, v in _flat(want).items():
        np.testing.assert_allclose(r[f"train{k}"], v, err_msg=k, **TOL)
    np.testing.assert_allclose(r["train_losses"], want_losses, **TOL)
    assert r["all_reduce_in_hlo"]  # XLA reduces the gradients; nothing by hand
    assert r["train_traces"] == 1  # lower + ten steps: one trace, one program
    want61, _ = _single_device_train(61)  # 61 rows: 3 weight-0 pad rows
    assert "batch 61 does not divide over 8 shards" in r["step_nopad_error"]
    for k, v in _flat(want61).items():
        np.testing.assert_allclose(r[f"train61{k}"], v, err_msg=k, **TOL)


def test_8_devices_export_loads_on_matching_mesh_only(eight):
    out, r = eight
    net, _, variables, x, _ = _problem()
    h = sm.hybridize(net, variables)
    assert r["manifest_nr_devices"] == 8
    for batch in (64, 13):
        np.testing.assert_allclose(r[f"loaded_{batch}"], h(x[:batch]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r["loaded_2_of_8"], h(x[:13]), rtol=1e-5, atol=1e-6)
    assert "exported for 8 devices, but the mesh {'data': 4} has 4" in r["wrong_mesh_error"]
    # Here, in pytest, JAX sees one device: loading the 8-device artifact is a clear error.
    for loader in (sm.load, load_sharded):
        with pytest.raises(sm.ArtifactError, match="8 devices"):
            loader(out / "art8")


def test_8_devices_sm_export_and_sm_load_of_a_sharded_model(eight):
    out, r = eight
    net, _, variables, x, _ = _problem()
    h = sm.hybridize(net, variables)
    assert r["sm_export_nr_devices"] == 8
    for key, rows in (("sm_load_64", 64), ("sm_load_13", 13), ("sm_load_2_of_8", 13)):
        assert r[key].shape == (rows, 4)
        np.testing.assert_allclose(r[key], h(x[:rows]), rtol=1e-5, atol=1e-6, err_msg=key)
    with pytest.raises(sm.ArtifactError, match=r"sharded over 8 devices.*sees 1"):
        sm.load(out / "art8b")  # here, in pytest, JAX sees one device


def test_bench_devices_reports_rows_and_says_cpu_is_correctness_only():
    small = {"sizes": (16, 4), "in_features": 12, "batch": 64, "repeats": 2, "train_steps": 2}
    here = bench_devices(1, **small)  # JAX here sees one device: runs in this process
    assert not here["in_subprocess"] and [r["devices"] for r in here["rows"]] == [1]
    res = bench_devices(8, **small)  # needs 8 devices: a subprocess with 8 CPU devices
    assert res["in_subprocess"] and res["virtual_cpu_devices"] and res["note"] == CPU_NOTE
    assert "correctness" in CPU_NOTE and "not how it scales" in CPU_NOTE
    assert [r["devices"] for r in res["rows"]] == [1, 2, 4, 8]
    for row in here["rows"] + res["rows"]:
        assert row["matches_1_device"], row
        assert row["inference_examples_per_s"] > 0 and row["train_examples_per_s"] > 0


# -- two processes (jax.distributed), one CPU device each ----------------------------------------
def _worker(process_id: str, port: str, out_file: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id), initialization_timeout=60
    )
    net, optimizer, variables, x, y = _problem()
    mesh = sm.data_mesh()  # spans both processes' devices
    step = sm.training.shard_step(train_step(net, optimizer), mesh)
    params, losses = _train(step, variables["params"], optimizer, x, y)
    out = sm.shard(sm.hybridize(net, variables), mesh)(x[:13])
    res = {f"train{k}": v for k, v in _flat(params).items()}  # _train fetched them to host
    res["losses"] = np.array(losses)
    res["infer_13"] = multihost_utils.process_allgather(out, tiled=True)
    res["counts"] = np.array([jax.process_count(), jax.device_count(), jax.local_device_count()])
    np.savez(out_file, **res)
    jax.distributed.shutdown()


def test_two_processes_agree_with_one(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-W",
                "error",
                __file__,
                "worker",
                str(i),
                port,
                str(tmp_path / f"{i}.npz"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        logs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(logs)
    net, _, variables, x, _ = _problem()
    want, want_losses = _single_device_train()
    rows = np.asarray(sm.hybridize(net, variables)(x[:13]))
    for i in range(2):
        with np.load(tmp_path / f"{i}.npz") as r:
            assert r["counts"].tolist() == [2, 2, 1]
            for k, v in _flat(want).items():
                np.testing.assert_allclose(r[f"train{k}"], v, err_msg=f"process {i}: {k}", **TOL)
            np.testing.assert_allclose(r["losses"], want_losses, **TOL)
            assert r["infer_13"].shape == (13, 4)
            np.testing.assert_allclose(r["infer_13"], rows, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    {"check8": _check8, "worker": _worker}[sys.argv[1]](*sys.argv[2:])
