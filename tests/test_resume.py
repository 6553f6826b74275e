"""Resuming a run: what a checkpoint must match of the run that continues it."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import symjax_mlp as sm


@pytest.fixture(scope="module")
def tiny():
    """Two classes of 12 features, 4 steps of 16 per epoch: training it takes milliseconds."""
    x = np.random.default_rng(0).normal(size=(96, 12)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32)
    return sm.training.Dataset(x[:64], y[:64], x[64:], y[64:], name="tiny")


def test_resuming_a_checkpoint_past_the_epochs_asked_for_is_refused(tiny, tmp_path):
    """epochs=1 on a checkpoint of epoch 2 returned the epoch-2 params, silently."""
    sm.training.train(sm.mlp((8, 2)), tiny, epochs=2, batch_size=16, checkpoint=tmp_path)
    with pytest.raises(sm.CheckpointError) as e:
        sm.training.train(
            sm.mlp((8, 2)), tiny, epochs=1, batch_size=16, checkpoint=tmp_path, resume=True
        )
    message = str(e.value)
    assert "train(epochs=1, resume=True)" in message and "step_00000008" in message
    assert "at epoch 2 (step 8)" in message and "Pass epochs >= 2" in message
    done = sm.training.train(  # as many epochs as done: the run as it is
        sm.mlp((8, 2)), tiny, epochs=2, batch_size=16, checkpoint=tmp_path, resume=True
    )
    assert (done.epoch, done.step, done.resumed_from.name) == (2, 8, "step_00000008")


def test_resuming_with_a_schedule_that_differs_later_is_refused(tiny, tmp_path):
    """Two schedules that agree on the first steps passed the optimizer's fingerprint."""

    def adam(boundary):
        return optax.adam(optax.piecewise_constant_schedule(1e-3, {boundary: 0.1}))

    run = {"epochs": 1, "batch_size": 16, "checkpoint": tmp_path}
    sm.training.train(sm.mlp((8, 2)), tiny, optimizer=adam(100), **run)
    run.update(epochs=2, resume=True)
    refused = r"step_00000004 was written by an optimizer that updates otherwise at its step 4"
    with pytest.raises(sm.CheckpointError, match=refused + r": .* its updates differ by up to"):
        sm.training.train(sm.mlp((8, 2)), tiny, optimizer=adam(4), **run)
    resumed = sm.training.train(sm.mlp((8, 2)), tiny, optimizer=adam(100), **run)
    assert resumed.resumed_from.name == "step_00000004" and resumed.step == 8


def test_a_failed_save_does_not_hide_the_error_of_the_step(tiny, tmp_path, monkeypatch):
    """A step's error, raised while an asynchronous (Orbax) save failed, was replaced by the
    save's error when the checkpoints were closed: both are told, the step's raised."""
    from symjax_mlp.training import _loop
    from symjax_mlp.training._orbax import OrbaxCheckpoints

    def disk_full(self, step, *rest):
        raise OSError("disk full")

    def orbax(*args, **kwargs):  # a one-process run with a multi-process run's checkpoints
        programs, _, watch = processes(*args, **kwargs)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return programs, OrbaxCheckpoints(tmp_path, timeout=30, sharding=device), watch

    processes = _loop._processes
    monkeypatch.setattr(_loop, "_processes", orbax)
    monkeypatch.setattr(OrbaxCheckpoints, "_write", disk_full)

    def nan_at(count):  # the count-th update NaN: the loss after it is NaN
        def update(updates, seen, params=None):
            scale = jnp.where(seen == count, jnp.nan, 1.0)
            return jax.tree.map(lambda u: u * scale, updates), seen + 1

        return optax.GradientTransformation(lambda p: jnp.zeros([], jnp.int32), update)

    opt = optax.chain(optax.sgd(0.1), nan_at(5))
    with pytest.raises(sm.DivergenceError, match="at step 6") as e:
        sm.training.train(sm.mlp((8, 2)), tiny, optimizer=opt, epochs=2, batch_size=16,
                          checkpoint=tmp_path)  # fmt: skip
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert "OSError: disk full" in notes


def test_a_checkpoint_without_its_manifest_or_with_an_edited_probe_is_named_broken(tiny, tmp_path):
    """A step_* without manifest.json was 'no checkpoint in step_*: expected step_*
    directories'; an edited probe was 'written by a model (an optimizer) that computes
    something else: the checkpoint's probe is malformed'."""
    run = {"epochs": 1, "batch_size": 16, "checkpoint": tmp_path}
    sm.training.train(sm.mlp((8, 2)), tiny, **run)
    run.update(epochs=2, resume=True)
    manifest = sm.training.latest_checkpoint(tmp_path) / "manifest.json"
    text = manifest.read_text()
    for key, value in (("optimizer_probe", None), ("model_probe", "1.0"), ("model_probe", [True])):
        edited = json.loads(text)
        meta = edited["metadata"]
        (meta if key == "optimizer_probe" else meta["config"])[key] = value
        manifest.write_text(json.dumps(edited))
        broken = f"step_00000004: its metadata's {key} is not a list of numbers; the checkpoint"
        with pytest.raises(sm.CheckpointError, match=broken):
            sm.training.train(sm.mlp((8, 2)), tiny, **run)
    manifest.unlink()
    with pytest.raises(sm.CheckpointError, match=r"step_00000004/manifest\.json: the file is "
                       r"missing; .* \(remove this checkpoint's directory"):  # fmt: skip
        sm.training.train(sm.mlp((8, 2)), tiny, **run)


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_a_newer_step_that_is_no_checkpoint_is_refused_before_training(tiny, tmp_path, kind):
    """A file or symlink named like a newer step_* was passed over by the resume; training then
    failed only when saving that step ('already exists'), after the epoch's work."""
    run = {"epochs": 1, "batch_size": 16, "checkpoint": tmp_path}
    sm.training.train(sm.mlp((8, 2)), tiny, **run)
    stray = tmp_path / "step_00000008"
    stray.write_text("x") if kind == "file" else stray.symlink_to(tmp_path / "step_00000004")
    (tmp_path / "step_00000002").write_text("older: never saved over")
    epochs = []
    run.update(epochs=2, resume=True, on_epoch=epochs.append)
    with pytest.raises(sm.CheckpointError) as e:
        sm.training.train(sm.mlp((8, 2)), tiny, **run)
    assert f"{stray} is a {kind}, not a checkpoint directory" in str(e.value)
    assert "newer than step_00000004" in str(e.value) and "Remove it" in str(e.value)
    assert epochs == []  # refused before the first epoch, not after it
    stray.unlink()
    assert sm.training.train(sm.mlp((8, 2)), tiny, **run).step == 8


@pytest.mark.parametrize("kind", ["file", "symlink", "uncommitted"])
def test_a_newer_orbax_step_that_is_no_checkpoint_is_refused_before_training(
    tiny, tmp_path, monkeypatch, kind
):
    """Orbax's checkpoints had no such check: its resume took a symlink or an uncommitted save
    for the newest step and failed on it; a file named like a step was deleted by the save."""
    from symjax_mlp.training import _loop
    from symjax_mlp.training._orbax import OrbaxCheckpoints

    def orbax(*args, **kwargs):  # a one-process run with a multi-process run's checkpoints
        programs, _, watch = processes(*args, **{**kwargs, "checkpoint": None})
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return programs, OrbaxCheckpoints(tmp_path, timeout=30, sharding=device), watch

    processes = _loop._processes
    monkeypatch.setattr(_loop, "_processes", orbax)
    run = {"epochs": 1, "batch_size": 16, "checkpoint": tmp_path}
    sm.training.train(sm.mlp((8, 2)), tiny, **run)
    stray = tmp_path / "8"
    if kind == "file":
        stray.write_text("x")
    elif kind == "symlink":
        stray.symlink_to(tmp_path / "4")
    else:  # a save whose commit never came: its arrays, no _CHECKPOINT_METADATA
        (stray / "state").mkdir(parents=True)
    epochs = []
    run.update(epochs=2, resume=True, on_epoch=epochs.append)
    with pytest.raises(sm.CheckpointError) as e:
        sm.training.train(sm.mlp((8, 2)), tiny, **run)
    what = "a directory without _CHECKPOINT_METADATA" if kind == "uncommitted" else f"a {kind}"
    assert f"{stray} is {what}" in str(e.value)
    if kind != "symlink":  # refused before Orbax reads through it (test_checkpoint_stranger.py)
        assert "not a checkpoint directory" in str(e.value) and "newer than 4" in str(e.value)
        assert "Remove it" in str(e.value)
    assert epochs == []  # refused before the first epoch, not after it
    if kind == "uncommitted":
        shutil.rmtree(stray)
    else:
        stray.unlink()
    assert sm.training.train(sm.mlp((8, 2)), tiny, **run).step == 8


def test_a_resumes_checkpoint_errors_start_with_the_call_and_name_the_path(tiny, tmp_path):
    """They began with the path (a checkpoint's own errors too, read for the resume), where
    train()'s other messages start with 'symjax_mlp.training.train:'."""
    run = {"epochs": 1, "batch_size": 16, "checkpoint": tmp_path}
    sm.training.train(sm.mlp((8, 2)), tiny, **run)
    step = sm.training.latest_checkpoint(tmp_path)
    cases = {
        "": f"{tmp_path} already holds checkpoints (newest: step_00000004)",
        "batch": f"{step} was written with {{'batch_size': 16}}, but this run has",
        "manifest": f"{step / 'manifest.json'}: the file is missing; the checkpoint is",
    }
    for case, says in cases.items():
        kw = {**run, "epochs": 2, "resume": bool(case), "batch_size": 8 if case == "batch" else 16}
        if case == "manifest":
            (step / "manifest.json").unlink()
        with pytest.raises(sm.CheckpointError) as e:
            sm.training.train(sm.mlp((8, 2)), tiny, **kw)
        assert str(e.value).startswith(f"symjax_mlp.training.train: {says}"), str(e.value)


def test_restore_checkpoint_errors_start_with_the_call_and_name_the_path(tiny, tmp_path):
    """restore_checkpoint's messages about a checkpoint it read began with the path (those
    about a path that holds none with the call): each starts with the call now."""
    run = {"epochs": 1, "batch_size": 16, "checkpoint": tmp_path}
    result = sm.training.train(sm.mlp((8, 2)), tiny, **run)
    like = sm.training.TrainState({}, (), jax.random.key(0))
    call = "symjax_mlp.training.restore_checkpoint: "
    with pytest.raises(sm.CheckpointError) as e:
        sm.training.restore_checkpoint(tmp_path, like)
    assert str(e.value).startswith(f"{call}{result.checkpoint} does not fit this model")
    (result.checkpoint / "manifest.json").unlink()
    with pytest.raises(sm.CheckpointError) as e:
        sm.training.restore_checkpoint(result.checkpoint, like)
    assert str(e.value).startswith(f"{call}{result.checkpoint / 'manifest.json'}: the file is")


def test_save_checkpoint_errors_and_restores_state_check_start_with_the_call(tmp_path):
    """save_checkpoint's messages began 'save_checkpoint:' or 'save_checkpoint(keep=...)', and
    restore_checkpoint's of a like= that is no TrainState 'restore_checkpoint(like=...)', where
    the library's start with the public call, as restore_checkpoint's others do."""
    p = {"w": jnp.zeros(2)}
    good = sm.training.TrainState(p, optax.adam(1e-3).init(p), jax.random.key(0))
    bad = sm.training.TrainState({"s": np.array(["a"])}, (), jax.random.key(0))
    (tmp_path / "file").write_text("")
    save = "symjax_mlp.training.save_checkpoint"
    cases = [
        ((tmp_path, good), {"keep": 0}, f"{save}(keep=0): pass how many"),
        ((tmp_path, None), {}, f"{save}: the state must be a TrainState"),
        ((tmp_path / "file", good), {}, f"{save}: the checkpoint directory {tmp_path / 'file'}"),
        ((tmp_path, bad), {}, f"{save}: the state's leaf 'params/s' is <U1[1]"),
        ((tmp_path, good), {"metadata": {"x": float("nan")}}, f"{save}(metadata=...): "),
        ((tmp_path, good), {"metadata": {"config": 1}}, f"{save}(metadata=...): the metadata"),
    ]
    for args, kw, says in cases:
        with pytest.raises(sm.SymjaxError) as e:
            sm.training.save_checkpoint(*args, **kw)
        assert str(e.value).startswith(says), str(e.value)
    sm.training.save_checkpoint(tmp_path / "run", dataclasses.replace(good, step=5))
    with pytest.raises(sm.CheckpointError) as e:
        sm.training.save_checkpoint(tmp_path / "run", good)
    assert str(e.value).startswith(f"{save}: {tmp_path / 'run'} already holds step_00000005")
    with pytest.raises(sm.CheckpointError) as e:  # the same step again
        sm.training.save_checkpoint(tmp_path / "run", dataclasses.replace(good, step=5))
    assert str(e.value).startswith(f"{save}: checkpoint {tmp_path / 'run' / 'step_00000005'}")
    with pytest.raises(sm.ConfigError) as e:
        sm.training.restore_checkpoint(tmp_path, None)
    says = "symjax_mlp.training.restore_checkpoint(like=...): the state must be a TrainState"
    assert str(e.value).startswith(says), str(e.value)


def test_a_complex_model_resumes_and_an_optimizer_otherwise_on_imaginary_parts_is_refused(
    tiny, tmp_path
):
    """A model with complex params trained and wrote checkpoints, but resuming one called it
    corrupted (its reader knew no complex64), and the optimizer's probe kept only the real
    parts of the updates (NumPy's ComplexWarning), so it could not tell an optimizer that
    updates the imaginary parts otherwise."""
    import flax.linen as nn

    class Complex(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.normal(0.1, jnp.complex64), (x.shape[-1], 2))
            return jnp.abs(x.astype(jnp.complex64) @ w)

    def sgd(imaginary):  # what optax.sgd(0.1) does to real parts
        def update(g, state, params=None):
            return jax.tree.map(lambda u: -0.1 * (u.real + 1j * imaginary * u.imag), g), state

        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    run = {"epochs": 1, "batch_size": 16, "checkpoint": tmp_path}
    sm.training.train(Complex(), tiny, optimizer=sgd(1.0), **run)
    run.update(epochs=2, resume=True)
    refused = r"step_00000004 was written by an optimizer that updates otherwise at its step 4"
    with pytest.raises(sm.CheckpointError, match=refused):
        sm.training.train(Complex(), tiny, optimizer=sgd(3.0), **run)
    resumed = sm.training.train(Complex(), tiny, optimizer=sgd(1.0), **run)
    assert resumed.resumed_from.name == "step_00000004" and resumed.step == 8


def test_the_optimizer_probe_is_compiled_once_and_samples_what_op_by_op_did():
    """Each save ran the optimizer's update op by op for its probe: 5-20 ms of the training
    thread a save (a step's time or more) and seconds at the first. It is compiled once (the
    update traced once for three saves) and samples the same values, so older checkpoints
    resume: the op-by-op update's, sampled as before, within the resume's tolerance."""
    from symjax_mlp.training import _resume

    calls, adam = [], optax.adam(1e-3)
    counted = optax.GradientTransformation(adam.init, lambda *a: calls.append(1) or adam.update(*a))
    params = {"b": jnp.zeros(3), "w": jnp.linspace(-1.0, 1.0, 600).reshape(20, 30)}
    _, state = adam.update(params, adam.init(params), params)  # a state past its first step
    probe = _resume.optimizer_probe(counted)
    got = [probe(params, state) for _ in range(3)]
    assert len(calls) == 1 and got[0] == got[2]
    updates, _ = adam.update(_resume._fixed(params), state, params)  # op by op, as it was
    leaves = [np.asarray(u, np.float64).ravel() for u in jax.tree.leaves(updates)]
    want = [u[np.linspace(0, u.size - 1, min(128, u.size)).astype(int)] for u in leaves]
    assert len(got[0]) == 3 + 128
    assert (
        _resume.probe_difference(np.concatenate(want), got[0], "", _resume._UPDATE_TOLERANCE)
        is None
    )


def test_a_saves_device_copy_is_one_array_per_dtype_and_unpacks_bitwise():
    """A multi-process save's device copy made an array per leaf of the training state, each
    costing the dispatch (on the training thread, measured as the save's wait) what a small
    array's copy does. It makes one per dtype (and one per PRNG key); the writer thread slices
    them on the host, uncompiled (compiling took 0.3-0.6 s at the first save, and the save after
    next waited), bitwise, each leaf with its sharding (NaN payloads, keys, empty leaves too)."""
    from symjax_mlp.training import _orbax

    nan = np.array([0x7FC00001, 0x7F800000, 0xFFC12345], np.uint32).view(np.float32)
    leaves = [
        jnp.asarray(nan),
        jnp.arange(6, dtype=jnp.float32).reshape(2, 3),
        jnp.int32(7),
        jnp.zeros((0, 4), jnp.float32),
        jnp.asarray([1 + 2j], jnp.complex64),
        jnp.linspace(0, 1, 5, dtype=jnp.bfloat16),
        jax.random.split(jax.random.key(1), 2),
    ]
    packed = _orbax._pack(leaves)
    assert len(packed[0]) == 4 and len(packed[1]) == 1  # float32, int32, complex64, bfloat16
    got = _orbax._unpack([(a.shape, a.dtype, a.sharding) for a in leaves], packed)
    for a, b in zip(leaves, got, strict=True):
        assert (a.shape, a.dtype, a.sharding) == (b.shape, b.dtype, b.sharding)
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
