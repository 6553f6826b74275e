"""Data parallelism: sharded inference and training equal one device, on 1, 8 and 2x1 devices.

conftest.py starts JAX with 8 virtual CPU devices, so the 1-, 2- and 8-device checks run here,
in process, on meshes of the first N devices (``sm.data_mesh(N)``). Two checks need other
processes: an artifact sharded over more devices than are visible here is exported by a
``python -c`` child with 16 devices, and the multi-process check starts two ``jax.distributed``
processes on localhost (gloo CPU collectives, one CPU device each) running
``tests/workers/distributed_worker.py``.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import N_DEVICES, STRICT_WARNINGS, ZOO, keyless

import symjax_mlp as sm

STEPS = 10
TOL = {"rtol": 1e-5, "atol": 1e-5}
SIZES, LR = (32, 16, 4), 1e-2
WORKER = Path(__file__).parent / "workers" / "distributed_worker.py"


@functools.cache
def _problem():
    """The model, optimizer, params and data every check shares (deterministic)."""
    net, optimizer = sm.mlp(SIZES), optax.adam(LR)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 12)).astype(np.float32)
    y = rng.integers(0, 4, 64).astype(np.int32)
    # NumPy-drawn params of init's shapes: host arrays, never donated away by a sharded step.
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
    """Plain ``jax.jit`` training on the first ``n`` examples, on one device."""
    net, optimizer, variables, x, y = _problem()
    step = jax.jit(sm.training.train_step(net, optimizer))
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


def _assert_params_close(got, want, where: str = "") -> None:
    got = _flat(got)
    for k, v in _flat(want).items():
        np.testing.assert_allclose(got[k], v, err_msg=f"{where}{k}", **TOL)


def _hybrid():
    net, _, variables, x, _ = _problem()
    return sm.hybridize(net, variables), x


# -- meshes and one device -----------------------------------------------------------------
def test_data_mesh_sizes_and_clear_error_for_more_than_visible():
    assert jax.device_count() == N_DEVICES == 8
    assert dict(sm.data_mesh().shape) == {"data": 8}  # default: every visible device
    for n in (1, 2, 8):
        mesh = sm.data_mesh(n)
        assert dict(mesh.shape) == {"data": n}
        assert list(mesh.devices.flat) == jax.devices()[:n]  # the first n devices
        assert mesh.axis_types == (jax.sharding.AxisType.Auto,)
    with pytest.raises(ValueError, match=r"data_mesh\(9\): JAX sees 8 device\(s\)") as e:
        sm.data_mesh(9)
    assert "n_devices must be 1..8" in str(e.value)
    assert "xla_force_host_platform_device_count" in str(e.value)  # says how to get more
    with pytest.raises(ValueError, match=r"n_devices must be 1\.\.8"):
        sm.data_mesh(0)


def test_shard_on_one_device_equals_hybrid():
    h, x = _hybrid()
    x = x[:13]
    s = h.shard(sm.data_mesh(1))
    assert isinstance(s, sm.Hybrid) and s is not h
    assert (s.n_shards, s.axis, s.pad, dict(s.mesh.shape)) == (1, "data", True, {"data": 1})
    assert (h.mesh, h.n_shards) == (None, 1)  # h itself is unchanged
    out = s(x)
    np.testing.assert_allclose(out, h(x), rtol=1e-5)
    assert out.sharding.spec == jax.sharding.PartitionSpec("data")
    s(x)
    assert s.trace_count == 1, s.trace_log


def test_shard_step_on_one_device_equals_jit():
    net, optimizer, variables, x, y = _problem()
    traces = []
    step = sm.training.shard_step(
        _counted(sm.training.train_step(net, optimizer), traces), sm.data_mesh(1)
    )
    assert isinstance(step, sm.training.ShardedStep) and step.n_shards == 1
    got, losses = _train(step, variables["params"], optimizer, x, y)
    want, want_losses = _single_device_train()
    _assert_params_close(got, want)
    np.testing.assert_allclose(losses, want_losses, **TOL)
    assert losses[-1] < losses[0]
    assert len(traces) == 1, traces  # ten steps, one trace: the second call did not retrace


def test_shard_errors_say_what_to_do():
    h, x = _hybrid()
    with pytest.raises(TypeError, match="expects a Hybrid"):
        sm.shard(h.fn)
    with pytest.raises(ValueError, match="axis='model' is not an axis"):
        sm.shard(h, sm.data_mesh(), axis="model")
    with pytest.raises(sm.SignatureError, match="per-example outputs"):
        sm.hybridize(lambda p, x: jnp.sum(x) * p, jnp.float32(1)).shard()(x)
    two = sm.hybridize(lambda p, a, b: a + b, {})
    with pytest.raises(
        sm.SignatureError, match=r"batch\) dimensions differ: \{'args\[0\]': 1, 'args\[1\]': 2\}"
    ):
        two.shard()(x[:1], x[:2])


def test_public_names():
    for name in ("Hybrid", "data_mesh", "shard", "load", "export"):
        assert name in sm.__all__ and hasattr(sm, name)
    for name in ("ShardedStep", "shard_step"):
        assert name in sm.training.__all__ and hasattr(sm.training, name)
    for gone in ("Sharded", "load_sharded", "ShardedStep", "shard_step", "bench_devices"):
        assert gone not in sm.__all__ and not hasattr(sm, gone)  # one home for each name


# -- eight devices, in process -------------------------------------------------------------
@pytest.mark.slow  # an 8-device program: 0.7 s
def test_a_sharded_hybrid_splits_the_arrays_of_a_dict_or_tuple_input():
    """h(x) takes tuples and dicts of arrays, its shard refused them: a dict as 'args[0] is a
    scalar' (NumPy's shape of a dict), a tuple as batch sizes [1, 8] (NumPy's array of it)."""
    h = sm.hybridize(lambda p, d, t: d["x"] @ p + t[0], jnp.ones((3, 2)))
    x, b = jnp.arange(24.0).reshape(8, 3), jnp.ones((8, 2))
    s = h.shard(sm.data_mesh(8))
    got = s({"x": x[:5]}, (b[:5],))  # 5 rows: split unevenly inside the program
    np.testing.assert_allclose(got, x[:5] @ jnp.ones((3, 2)) + 1, rtol=1e-6)
    with pytest.raises(sm.SignatureError, match=r"args\[0\]\['x'\] is a scalar; every input"):
        s({"x": jnp.float32(1)}, (b,))
    with pytest.raises(sm.SignatureError, match=r"differ: .*'args\[1\]\[0\]': 4\}"):
        s({"x": x}, (b[:4],))


def test_8_devices_inference_equals_one_device():
    h, x = _hybrid()
    s = h.shard(sm.data_mesh(8))
    assert s.n_shards == 8 and dict(s.mesh.shape) == {"data": 8}
    out = s(x)
    np.testing.assert_allclose(out, h(x), rtol=1e-5, atol=1e-6)
    assert out.sharding.spec == jax.sharding.PartitionSpec("data")
    assert len(out.sharding.device_set) == 8
    s(x[:13])
    s(x)
    assert s.trace_count == 2, s.trace_log  # batch 64 and batch 13 (split unevenly); no retraces
    assert "mhlo.num_partitions = 8" in s.lower(x).as_text()  # one SPMD program for all eight


def test_8_devices_batch_13_is_padded_and_trimmed():
    h, x = _hybrid()
    want = h(x[:13])
    explicit = jax.make_mesh((8,), ("data",))  # JAX's default axis types (Explicit)
    assert explicit.axis_types == (jax.sharding.AxisType.Explicit,)
    for name, mesh in (("auto", sm.data_mesh(8)), ("explicit", explicit)):
        got = sm.shard(h, mesh)(x[:13])
        assert got.shape == (13, 4), name
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    with pytest.raises(sm.SignatureError, match="batch 13 does not divide over 8 shards") as e:
        sm.shard(h, sm.data_mesh(8), pad=False)(x[:13])
    assert "multiple of 8 (e.g. 16)" in str(e.value)


def test_8_devices_training_equals_one_device():
    net, optimizer, variables, x, y = _problem()
    mesh = sm.data_mesh(8)
    traces = []
    step = sm.training.shard_step(_counted(sm.training.train_step(net, optimizer), traces), mesh)
    assert step.n_shards == 8
    p0 = variables["params"]
    hlo = step.lower(p0, jax.jit(optimizer.init)(p0), x, y).compile().as_text()
    assert "all-reduce" in hlo  # XLA reduces the gradients; nothing by hand
    got, losses = _train(step, p0, optimizer, x, y)
    want, want_losses = _single_device_train()
    _assert_params_close(got, want)
    np.testing.assert_allclose(losses, want_losses, **TOL)
    assert len(traces) == 1, traces  # lower + ten steps: one trace, one program

    got61, _ = _train(step, p0, optimizer, x[:61], y[:61])  # 61 rows: 3 weight-0 pad rows
    want61, _ = _single_device_train(61)
    _assert_params_close(got61, want61, "batch 61: ")
    no_pad = sm.training.shard_step(sm.training.train_step(net, optimizer), mesh, pad=False)
    with pytest.raises(sm.SignatureError, match="batch 61 does not divide over 8 shards"):
        no_pad(p0, None, x[:61], y[:61])


def test_8_devices_export_records_nr_devices_and_loads_on_a_matching_mesh_only(tmp_path):
    h, x = _hybrid()
    s = sm.shard(h, sm.data_mesh(8))
    art = sm.export(s, tmp_path / "art8", example=x[:1], batch="b")
    assert art.manifest["nr_devices"] == 8 and sm.inspect(art.path).manifest["nr_devices"] == 8
    loaded = {
        "no mesh": sm.load(art.path),  # no mesh of 8 around: the first 8 devices
        "mesh=": sm.load(art.path, mesh=sm.data_mesh(8)),
    }
    for how, m in loaded.items():
        for batch in (64, 13):
            out = m(x[:batch])
            assert out.shape == (batch, 4), (how, batch)
            np.testing.assert_allclose(out, h(x[:batch]), rtol=1e-5, atol=1e-6, err_msg=how)
            assert out.sharding.device_set == set(jax.devices()), how
    for n in (4, 1):
        with pytest.raises(
            sm.ArtifactError,
            match=rf"exported for 8 device\(s\), but the mesh \{{'data': {n}\}} has {n}",
        ):
            sm.load(art.path, mesh=sm.data_mesh(n))


def test_2_device_export_runs_on_2_of_the_8_devices(tmp_path):
    h, x = _hybrid()
    art = sm.export(sm.shard(h, sm.data_mesh(2)), tmp_path / "art2", example=x[:1])
    assert art.manifest["nr_devices"] == 2
    want = h(x[:13])
    m = sm.load(art.path)
    out = m(x[:13])  # no caller mesh: the first 2 devices
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert out.sharding.device_set == set(jax.devices()[:2])
    last_two = sm.data_mesh(2, devices=jax.devices()[6:])
    with jax.set_mesh(last_two):  # the caller's mesh of 2 devices is used
        out = m(x[:13])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert out.sharding.device_set == set(jax.devices()[6:])
    middle = sm.data_mesh(2, devices=jax.devices()[4:6])
    out = sm.load(art.path, mesh=middle)(x[:13])  # mesh=: exactly those devices
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert out.sharding.device_set == set(jax.devices()[4:6])
    with pytest.raises(sm.ArtifactError, match=r"exported for 2 device\(s\).*sm.data_mesh\(2\)"):
        sm.load(art.path, mesh=sm.data_mesh(8))
    with pytest.raises(sm.ConfigError, match=r"sharded over 2 devices.*without params_as_const"):
        sm.load(art.path, params_as_constants=True)


def test_jax_grad_through_a_sharded_hybrid_and_a_sharded_artifact(tmp_path):
    """jax.grad of a sharded Hybrid placed its traced inputs with device_put (a raw
    AttributeError); of a loaded sharded artifact, it asked for the concrete mesh inside the
    trace (a raw ValueError). The first is constrained to the mesh; the second runs under the
    mesh set around it, or says to set one."""
    h, x = _hybrid()
    rows = x[:13]  # 13 rows on 2 shards: one padding row under the gradient too

    def loss(f):
        return jax.grad(lambda v: f(v).sum())(rows)

    want = loss(h)
    hs = sm.shard(h, sm.data_mesh(2))
    np.testing.assert_allclose(loss(hs), want, rtol=1e-5, atol=1e-6)
    art = sm.export(hs, tmp_path / "art2", example=x[:1], vjp_order=1)
    m = sm.load(art.path)
    with pytest.raises(sm.ConfigError, match=r"needs the mesh set around it: with jax.set_mesh"):
        loss(m)
    with jax.set_mesh(sm.data_mesh(2)):
        np.testing.assert_allclose(loss(m), want, rtol=1e-5, atol=1e-6)


_EXPORT_16 = """
import sys, jax, numpy as np, symjax_mlp as sm
assert jax.device_count() == 16, jax.devices()
net, x = sm.mlp((4, 2)), np.ones((1, 3), np.float32)
h = sm.hybridize(net, net.init(jax.random.key(0), x))
sm.export(sm.shard(h, sm.data_mesh(16)), sys.argv[1], example=x)
"""


def test_an_artifact_for_more_devices_than_visible_is_refused(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="16")
    proc = subprocess.run(
        [sys.executable, *STRICT_WARNINGS, "-c", _EXPORT_16, str(tmp_path / "art16")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sm.inspect(tmp_path / "art16").manifest["nr_devices"] == 16
    for mesh in (None, sm.data_mesh(8)):
        with pytest.raises(sm.ArtifactError, match=r"sharded over 16 devices.*sees 8"):
            sm.load(tmp_path / "art16", mesh=mesh)  # here JAX sees 8


# -- two processes (jax.distributed), one CPU device each ----------------------------------
@pytest.mark.slow  # (the README suite: within 10 minutes on 2 cores)
def test_two_processes_agree_with_one(tmp_path):
    net, _, variables, x, y = _problem()
    leaves = jax.tree.leaves(variables)
    problem = {f"param_{i}": a for i, a in enumerate(leaves)}
    np.savez(tmp_path / "problem.npz", sizes=SIZES, lr=LR, steps=STEPS, x=x, y=y, **problem)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")

    def files(i: int) -> list[str]:
        return [str(tmp_path / "problem.npz"), str(tmp_path / f"{i}.npz")]

    procs = [
        subprocess.Popen(
            [sys.executable, *STRICT_WARNINGS, str(WORKER), str(i), port, *files(i)],
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
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(logs)
    want, want_losses = _single_device_train()
    want_leaves = jax.tree.leaves({"params": want})
    assert len(want_leaves) == len(leaves)
    rows = np.asarray(sm.hybridize(net, variables)(x[:13]))
    for i in range(2):
        with np.load(tmp_path / f"{i}.npz") as r:
            assert r["counts"].tolist() == [2, 2, 1]  # 2 processes, 2 devices, 1 of them here
            for j, v in enumerate(want_leaves):
                np.testing.assert_allclose(r[f"param_{j}"], v, err_msg=f"process {i}", **TOL)
            np.testing.assert_allclose(r["losses"], want_losses, **TOL)
            assert r["infer_13"].shape == (13, 4)
            np.testing.assert_allclose(r["infer_13"], rows, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [c for c in ZOO if c.stateful], ids=lambda c: c.name)
def test_a_stateful_hybrid_shards_with_its_state_replicated(case):
    """BatchNorm and Dropout models, linen and nnx: sharded over 8 devices, training calls
    give what one device gives (BatchNorm's statistics over the whole batch, not per shard)
    and move the state alike; an eval call of 13 rows too (split unevenly)."""
    one, eight = case.hybridize(), case.hybridize().shard(sm.data_mesh(8))
    for i in range(3):
        x = jax.random.normal(jax.random.key(i), (16, 5))
        chex.assert_trees_all_close(eight(x, **case.train), one(x, **case.train), **TOL)
    chex.assert_trees_all_close(keyless(eight.state), keyless(one.state), **TOL)
    x = jax.random.normal(jax.random.key(9), (13, 5))
    chex.assert_trees_all_close(eight(x, **case.eval), one(x, **case.eval), **TOL)
    chex.assert_trees_all_close(keyless(eight.state), keyless(one.state), **TOL)
    assert eight.lower(x, **case.eval).as_text()  # the stateful sharded program lowers


@pytest.mark.parametrize("name", ["linen_batchnorm", "nnx_modes_eval"])
def test_a_sharded_stateful_hybrid_exports_and_loads_on_a_mesh(name, tmp_path):
    case = next(c for c in ZOO if c.name == name)
    x = jax.random.normal(jax.random.key(3), (4, 5))
    art = sm.export(case.hybridize().shard(sm.data_mesh(2)), tmp_path / name, example=x,
                    kwargs=case.eval)  # fmt: skip
    loaded = sm.load(art.path, mesh=sm.data_mesh(2))
    chex.assert_trees_all_close(loaded(x), case.hybridize()(x, **case.eval), **TOL)


def test_a_training_call_whose_batch_does_not_divide_moves_the_state_as_one_device():
    """13 rows of BatchNorm in training over 8 shards were refused (padding rows would have
    entered the batch statistics); now XLA splits them unevenly inside the program, masking
    what it pads: the output and the running statistics are one device's."""
    case = next(c for c in ZOO if c.name == "linen_batchnorm")
    one, eight = case.hybridize(), case.hybridize().shard(sm.data_mesh(8))
    x = jax.random.normal(jax.random.key(0), (13, 5))
    chex.assert_trees_all_close(eight(x, train=True), one(x, train=True), **TOL)
    chex.assert_trees_all_close(keyless(eight.state), keyless(one.state), **TOL)


@pytest.mark.parametrize("count", ["calls", "zcalls"])  # a held path before, after "total"
def test_a_batch_sum_a_call_adds_is_seen_by_its_own_path_whatever_the_held_names(count):
    """A call that adds state (a batch sum, as a linen sow inside bridge.ToNNX adds one) was
    read against the held state's paths, zipped short: with a held count named before the
    sum's "total", the count was named as moving (a Batcher refused the Hybrid as in training
    mode); named after it, the sum was missed and a sharded call padded 13 rows to 16 and held
    their sum, silently. Now the count moves nothing that a call reads from its rows (what a
    call adds, the Batcher never holds), and a sharded call pads nothing: its sum is one
    device's, whatever the names."""
    from flax import nnx

    class Sower(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
            setattr(self, count, nnx.BatchStat(jnp.zeros(())))

        def __call__(self, x):
            y = self.linear(x)
            getattr(self, count)[...] += 1
            self.total = nnx.Intermediate(y.sum())  # added by the first call
            return y

    h, x = sm.hybridize(Sower()), jnp.ones((13, 3))
    assert h.moved_state(x) == []
    eight = sm.hybridize(Sower()).shard(sm.data_mesh(8))
    chex.assert_trees_all_close(eight(x), h(x), **TOL)
    chex.assert_trees_all_close(eight.state, h.state, **TOL)
