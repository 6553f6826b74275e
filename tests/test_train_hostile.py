"""Training checkpoints against paths and models that cannot continue a run (issue 32, items 4
and 10).

A checkpoint path that cannot hold checkpoints is refused before the first epoch (it was a
``FileExistsError`` after it); resuming with a model that computes something else (another
``__call__``, same class, name and param shapes) is refused, linen and nnx alike.

Then a stranger's attacks (each test's docstring says what happened before): data of odd
dtypes and ranges, outputs that are not one row of float logits, optimizers that change their
state or cannot init, checkpoint calls by hand, NumPy and JAX scalars for settings.
"""

from __future__ import annotations

import dataclasses
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import symjax_mlp as sm
from symjax_mlp.cli import main


@pytest.fixture(scope="module")
def tiny():
    """A small slice of digits: training it takes milliseconds."""
    d = sm.training.load_digits()
    return sm.training.Dataset(
        d.x_train[:64], d.y_train[:64], d.x_test[:32], d.y_test[:32], name="tiny",
        num_classes=10,
    )  # fmt: skip


def _unusable(tmp_path):
    file = tmp_path / "file"
    file.write_text("not a directory")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")  # 'which does not exist' was not true
    # a checkpoint passed for its directory: step_* were written inside it, in silence
    checkpoint = sm.training.save_checkpoint(tmp_path / "run", _state())
    return {
        "a checkpoint": (checkpoint, "holds a manifest.json: it is a checkpoint"),
        "a symlink loop": (tmp_path / "loop", "loop, which loops back"),
        "a regular file": (file, "is a file, not a directory"),
        "a dangling symlink": (dangling, "which does not exist"),
        "a path below a file": (file / "sub", "is below"),
        "a path below a dangling symlink": (dangling / "sub" / "deeper", "which does not exist"),
    }


def test_a_checkpoint_path_that_cannot_hold_checkpoints_is_refused_before_training(tiny, tmp_path):
    epochs = []
    for what, (path, says) in _unusable(tmp_path).items():
        with pytest.raises(sm.CheckpointError, match=says) as e:
            sm.training.train(
                sm.mlp((8, 10)), tiny, epochs=2, checkpoint=path, on_epoch=epochs.append
            )
        assert str(path) in str(e.value) and "pass a directory" in str(e.value), what
        with pytest.raises(sm.CheckpointError, match=says):  # and when saving directly
            sm.training.save_checkpoint(path, _state())
    assert epochs == []  # refused before the first epoch, not after it
    assert (tmp_path / "file").read_text() == "not a directory"
    assert not (tmp_path / "nowhere").exists()
    # a directory to be made, a symlink to a directory: fine
    ok = tmp_path / "real"
    ok.mkdir()
    (tmp_path / "link").symlink_to(ok)
    for path in (tmp_path / "new" / "deeper", tmp_path / "link"):
        r = sm.training.train(sm.mlp((8, 10)), tiny, epochs=1, checkpoint=path)
        assert r.checkpoint is not None and r.checkpoint.parent == path


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_checkpoint_directory_this_user_cannot_write_is_refused(tiny, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(sm.CheckpointError, match="cannot be written"):
            sm.training.train(sm.mlp((8, 10)), tiny, epochs=1, checkpoint=locked / "ckpt")
    finally:
        locked.chmod(0o700)


def test_a_checkpoint_directory_this_user_cannot_list_is_refused(tiny, tmp_path, monkeypatch):
    """A directory of mode 0o300 (written, not read) passed the check: listing its checkpoints
    then raised a bare PermissionError. Root reads anything: os.access answers as for a user."""
    access = os.access

    def no_read(path, mode, **kwargs):
        return access(path, mode, **kwargs) and not (mode & os.R_OK and str(path) == str(tmp_path))

    monkeypatch.setattr(os, "access", no_read)
    with pytest.raises(sm.CheckpointError, match=r"cannot be read: this user may not list"):
        sm.training.train(sm.mlp((8, 10)), tiny, epochs=1, checkpoint=tmp_path)
    assert list(tmp_path.iterdir()) == []  # refused before any checkpoint was written


def test_cli_train_checkpoint_file_is_exit_2_with_one_line(tmp_path, capsys):
    for path, says in _unusable(tmp_path).values():
        argv = ["train", "--epochs", "1", "--quiet", "--checkpoint", str(path)]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def _state():
    import optax

    p = {"w": jnp.zeros(2)}
    return sm.training.TrainState(p, optax.adam(1e-3).init(p), jax.random.key(0))


# -- item 4: resuming with a model that computes something else ------------------------------
def _linen(activation):
    class Net(nn.Module):  # same class name, same params: only __call__ differs
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(activation(nn.Dense(16)(x)))

    return Net()


def _nnx(activation):
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(64, 16, rngs=rngs), nnx.Linear(16, 10, rngs=rngs)

        def __call__(self, x):
            return self.b(activation(self.a(x)))

    return Net(nnx.Rngs(0))


@pytest.mark.parametrize("make", [_linen, _nnx], ids=["linen", "nnx"])
def test_resuming_with_a_model_that_computes_something_else_is_refused(tiny, tmp_path, make):
    ckpt = tmp_path / "ckpt"
    sm.training.train(make(nn.relu), tiny, epochs=1, checkpoint=ckpt)
    for other in (jnp.tanh, lambda x: nn.relu(x) * 2.0):
        with pytest.raises(sm.CheckpointError, match="computes something else"):
            sm.training.train(make(other), tiny, epochs=2, checkpoint=ckpt, resume=True)
    # the same computation resumes, and continues exactly
    r = sm.training.train(make(nn.relu), tiny, epochs=2, checkpoint=ckpt, resume=True)
    assert r.epoch == 2 and r.resumed_from is not None
    whole = sm.training.train(make(nn.relu), tiny, epochs=2, checkpoint=tmp_path / "whole")
    chex_equal = jax.tree.map(np.array_equal, r.params, whole.params)
    assert all(jax.tree.leaves(chex_equal))


def test_resuming_an_nnx_module_built_from_other_values_is_accepted(tiny, tmp_path):
    """What the probe compares is the computation, not the initial values (the checkpoint's
    replace them): a module built with another seed resumes the run."""
    ckpt = tmp_path / "ckpt"
    sm.training.train(_nnx(nn.relu), tiny, epochs=1, checkpoint=ckpt)
    other = _nnx(nn.relu)
    nnx.update(other, jax.tree.map(lambda a: a + 1.0, nnx.state(other, nnx.Param)))
    r = sm.training.train(other, tiny, epochs=2, checkpoint=ckpt, resume=True)
    assert r.epoch == 2


# -- data a researcher has at hand: bfloat16 features, int64 ids, float64 physics -------------
def _rows(x, y):
    return sm.training.Dataset(x, y, x, y % 10)


def test_bfloat16_features_train_as_their_float32_values(tiny):
    x16 = jnp.asarray(tiny.x_train, jnp.bfloat16)
    kw = {"epochs": 1, "batch_size": 16}
    got = sm.training.train(sm.mlp((8, 10)), _rows(x16, tiny.y_train), **kw)
    want = sm.training.train(
        sm.mlp((8, 10)), _rows(np.asarray(x16, np.float32), tiny.y_train), **kw
    )
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, got.params, want.params)))


def test_labels_past_int32_are_refused_not_wrapped(tiny):
    """2**32 + 1 was cast to int32 as 1: a wrong label, silently."""
    for y in (tiny.y_train.astype(np.int64) + 2**32, np.full(64, 2**63, np.uint64)):
        with pytest.raises(sm.DataError, match=r"labels are int32 class indices, so .* 0\.\."):
            sm.training.train(sm.mlp((8, 10)), _rows(tiny.x_train, y), epochs=1)


def test_float64_features_past_float32_range_are_refused_with_their_size(tiny):
    """They became inf in float32, refused as 'non-finite values ... drop or impute them'."""
    x = tiny.x_train.astype(np.float64) * 1e300
    with pytest.raises(sm.DataError, match=r"values up to .*e\+300 .* past float32's range"):
        sm.training.train(sm.mlp((8, 10)), _rows(x, tiny.y_train), epochs=1)


# -- save_checkpoint and restore_checkpoint called by hand ------------------------------------
@pytest.mark.parametrize(
    "metadata", [[1, 2], {"config": 3}, {"history": [{"epoch": 1}]}, {"history": "none"}]
)
def test_metadata_a_restore_would_refuse_is_refused_when_saving(tmp_path, metadata):
    """It was written, then every restore called the checkpoint 'corrupted or edited'."""
    with pytest.raises(sm.ConfigError, match=r"save_checkpoint\(metadata=...\): .*got "):
        sm.training.save_checkpoint(tmp_path, _state(), metadata=metadata)
    assert sm.training.latest_checkpoint(tmp_path) is None
    fine = {"config": {"lr": 0.1}, "history": [], "mine": [1, 2]}
    saved = sm.training.save_checkpoint(tmp_path, _state(), metadata=fine)
    assert sm.training.restore_checkpoint(saved, _state())[1] == fine


def test_a_state_that_is_not_a_train_state_is_a_config_error(tmp_path):
    """A params dict, None, or an rng of None was an AttributeError or TypeError."""
    saved = sm.training.save_checkpoint(tmp_path, _state())
    no_rng = sm.training.TrainState({"w": jnp.zeros(2)}, (), None)
    for state in ({"w": jnp.zeros(2)}, None, no_rng):
        with pytest.raises(sm.ConfigError, match=r"must be a TrainState.* got .* Wrap yours"):
            sm.training.save_checkpoint(tmp_path / "other", state)
        with pytest.raises(sm.ConfigError, match=r"restore_checkpoint\(like=...\): the state"):
            sm.training.restore_checkpoint(saved, state)


def test_optax_multisteps_trains_as_its_gradient_transformation(tiny, tmp_path):
    """optax.MultiSteps(opt, k) was refused: 'must be an optax.GradientTransformation'."""
    import optax

    kw = {"epochs": 2, "batch_size": 16}
    multi = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3)
    got = sm.training.train(sm.mlp((8, 10)), tiny, optimizer=multi, **kw)
    want = sm.training.train(sm.mlp((8, 10)), tiny, optimizer=multi.gradient_transformation(), **kw)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, got.params, want.params)))
    once = sm.training.train(sm.mlp((8, 10)), tiny, optimizer=optax.adam(1e-2), **kw)
    assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, got.params, once.params)))


# -- models whose output is not one row of float logits per example ---------------------------
def _returning(f):
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return f(nn.Dense(10)(x))

    return Net()


def test_logits_not_one_row_per_example_are_refused_at_the_first_trace(tiny):
    """(1, classes) for any batch passed the one-row shape check, and optax broadcast it
    against the labels: a run that trained on a wrong loss, silently."""
    for f in (lambda z: z[:1], lambda z: z.mean(axis=0, keepdims=True)):
        with pytest.raises(sm.ConfigError, match=r"logits of shape \(1, 10\) for a batch of "):
            sm.training.train(_returning(f), tiny, epochs=1, batch_size=16)


@pytest.mark.parametrize(
    ("f", "got"),
    [
        (lambda z: (z, z), "returns a tuple"),
        (lambda z: {"logits": z}, "returns a dict"),
        (lambda z: z.astype(jnp.int32), "dtype int32"),
    ],
    ids=["tuple", "dict", "int"],
)
def test_an_output_that_is_not_float_logits_is_a_config_error(tiny, f, got):
    """A tuple or dict was an AttributeError ('no attribute ndim'), int logits a TypeError."""
    with pytest.raises(sm.ConfigError, match=rf"{got} for input shape \(1, 64\)\. Return"):
        sm.training.train(_returning(f), tiny, epochs=1, batch_size=16)


def test_a_state_with_python_number_leaves_round_trips(tmp_path):
    """save_checkpoint wrote {"w": 1.0}; restoring into it was an AttributeError ('shape')."""
    state = sm.training.TrainState({"w": 1.0, "n": 3}, (), jax.random.key(0), step=2)
    saved = sm.training.save_checkpoint(tmp_path, state)
    got, _ = sm.training.restore_checkpoint(saved, state)
    assert jax.tree.map(float, got.params) == {"w": 1.0, "n": 3.0} and got.step == 2


@pytest.mark.parametrize(
    ("mean", "std"),
    [(np.zeros(7), np.ones(7)), (np.zeros(64), np.zeros(64)), (np.zeros(64), None), ("0", "1")],
    ids=["other-width", "std-zero", "mean-alone", "strings"],
)
def test_standardisation_the_export_cannot_apply_is_refused_before_training(tiny, mean, std):
    """The wrong width was a ValueError inside export after training; std 0 exported a
    model of inf and NaN outputs, silently."""
    bad = sm.training.Dataset(tiny.x_train, tiny.y_train, tiny.x_test, tiny.y_test, mean=mean,
                              std=std)  # fmt: skip
    with pytest.raises(sm.DataError, match=r"dataset\.(mean|std) |has a mean but no std"):
        sm.training.train(sm.mlp((8, 10)), bad, epochs=1)


def test_standardisation_of_any_shape_of_the_right_size_is_taken(tiny, tmp_path):
    x = tiny.x_train
    m, s = x.mean(axis=0, keepdims=True), np.where(x.std(axis=0) > 0, x.std(axis=0), 1.0)
    ok = sm.training.Dataset(x, tiny.y_train, tiny.x_test, tiny.y_test, mean=m, std=list(s))
    r = sm.training.train(sm.mlp((8, 10)), ok, epochs=1)
    assert [a.shape for a in r.standardize] == [(64,), (64,)]
    r.export(tmp_path / "model")


def test_a_checkpoint_path_that_is_not_a_str_path_is_a_config_error(tiny, tmp_path):
    """bytes and ints were a TypeError from pathlib (restore_checkpoint, latest_checkpoint)."""
    calls = {
        "train": lambda p: sm.training.train(sm.mlp((8, 10)), tiny, epochs=1, checkpoint=p),
        "save_checkpoint": lambda p: sm.training.save_checkpoint(p, _state()),
        "restore_checkpoint": lambda p: sm.training.restore_checkpoint(p, _state()),
        "latest_checkpoint": sm.training.latest_checkpoint,
    }
    for path, got in ((os.fsencode(tmp_path / "c"), "got bytes b'"), (3, "got int 3")):
        for name, call in calls.items():
            with pytest.raises(sm.ConfigError) as e:
                call(path)
            assert f"{name}: the checkpoint path must be a str or os.PathLike" in str(e.value)
            assert got in str(e.value)


def test_an_empty_checkpoint_path_is_a_config_error_for_every_call(tiny, tmp_path, monkeypatch):
    """latest_checkpoint('') and restore_checkpoint('', like) read the working directory."""
    monkeypatch.chdir(tmp_path)
    sm.training.save_checkpoint("ckpt", _state())
    (tmp_path / "ckpt" / "step_00000000").rename(tmp_path / "step_00000000")
    calls = {
        "train": lambda p: sm.training.train(sm.mlp((8, 10)), tiny, epochs=1, checkpoint=p),
        "save_checkpoint": lambda p: sm.training.save_checkpoint(p, _state()),
        "restore_checkpoint": lambda p: sm.training.restore_checkpoint(p, _state()),
        "latest_checkpoint": sm.training.latest_checkpoint,
    }
    for name, call in calls.items():
        with pytest.raises(sm.ConfigError, match=f"{name}: the checkpoint directory is ''"):
            call("")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "step_00000000"]


def test_training_labels_of_one_class_are_refused_unless_num_classes_says_more(tiny):
    """Every label the same trained silently to loss 0 and 100% accuracy."""
    one = dataclasses.replace(tiny, y_train=np.full(64, 7), y_test=np.full(32, 7), num_classes=None)
    epochs = []
    with pytest.raises(sm.DataError) as e:
        sm.training.train(data=one, epochs=1, batch_size=16, on_epoch=epochs.append)
    assert "tiny.y_train holds one class, 7, in all its 64 labels" in str(e.value)
    assert "at least two classes" in str(e.value) and epochs == []
    for ys, classes in ((tiny.y_test, None), (np.zeros(32), 1)):  # y_test's others; 1 output
        one_class = dataclasses.replace(one, y_train=ys[:1].repeat(64), y_test=ys)
        with pytest.raises(sm.DataError, match=f"holds one class, {int(ys[0])}, in all its 64"):
            sm.training.train(data=dataclasses.replace(one_class, num_classes=classes), epochs=1)
    declared = sm.training.train(data=dataclasses.replace(one, num_classes=10), epochs=1)
    assert declared.step > 0  # num_classes >= 2 says the others exist: a split without them


def test_a_bad_timeout_is_refused_in_one_process_too(tiny):
    """timeout='60' or -1 was accepted in one process, refused only once scaled out."""
    for timeout in ("60", -1, 0, 1.5):
        with pytest.raises(sm.ConfigError, match=r"timeout must be an int >= 1 \(seconds\)"):
            sm.training.train(sm.mlp((8, 10)), tiny, epochs=1, timeout=timeout)


@pytest.mark.parametrize("compiled", [True, False])
def test_an_optimizer_whose_state_changes_structure_is_named(tiny, compiled):
    """Compiled: a RetraceError whose two signatures were identical; eager: a run whose
    checkpoints no resume could restore."""
    import optax

    def update(g, state, params=None):
        return jax.tree.map(lambda a: -0.01 * a, g), {"n": jnp.zeros(())}

    changes = optax.GradientTransformation(lambda p: (), update)
    with pytest.raises(sm.ConfigError, match=r"update returned a state unlike .*\(\) -> \{'n'"):
        sm.training.train(sm.mlp((8, 10)), tiny, optimizer=changes, compiled=compiled, epochs=1)


def test_an_optimizer_that_cannot_init_the_params_is_a_config_error(tiny):
    """optax.lookahead wants LookaheadParams: its init was an AttributeError ('fast')."""
    import optax

    def init(params):
        raise AttributeError("'dict' object has no attribute 'fast'")

    odd = optax.GradientTransformation(init, optax.adam(1e-3).update)
    with pytest.raises(sm.ConfigError, match=r"optimizer.init\(params\) raised AttributeError: "):
        sm.training.train(sm.mlp((8, 10)), tiny, optimizer=odd, epochs=1)


def test_running_out_of_memory_in_optimizer_init_is_not_called_the_optimizers_kind(tiny):
    """An out-of-memory in optimizer.init was a ConfigError: 'use an optimizer that takes them'."""
    import optax

    def init(params):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 bytes")

    big = optax.GradientTransformation(init, optax.adam(1e-3).update)
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED") as e:
        sm.training.train(sm.mlp((8, 10)), tiny, optimizer=big, epochs=1)
    assert not isinstance(e.value, sm.SymjaxError)


def test_train_step_labels_and_weights_not_one_per_row_are_a_signature_error():
    """w of shape (batch, 1) broadcast against the per-row losses: a wrong loss, silently;
    float or (batch, 1) labels were optax's TypeError or ValueError."""
    import optax

    net, x, y = sm.mlp((8, 3)), jnp.ones((4, 5)), jnp.array([0, 1, 2, 0])
    params = net.init(jax.random.key(0), x)["params"]
    step = jax.jit(sm.training.train_step(net, optax.sgd(0.1)))
    opt_state = optax.sgd(0.1).init(params)
    for yy, w in ((y, jnp.ones((4, 1))), (y[:, None], jnp.ones(4)), (y * 1.0, jnp.ones(4))):
        with pytest.raises(sm.SignatureError, match=r"expected one integer label y and one "):
            step(params, opt_state, x, yy, w)
    assert step(params, opt_state, x, y, jnp.ones(4))[2]["loss"].shape == ()


def test_shard_step_takes_lists_and_names_what_is_not_a_step():
    """Lists were a ValueError of device_put; shard_step(None) a TypeError of jax.jit, and
    donate='no' was taken as True."""
    import optax

    net, x = sm.mlp((8, 3)), np.ones((4, 5), np.float32)
    params = net.init(jax.random.key(0), x)["params"]
    step = sm.training.shard_step(sm.training.train_step(net, optax.sgd(0.1)), donate=False)
    opt_state = optax.sgd(0.1).init(params)
    from_lists = step(params, opt_state, x.tolist(), [0, 1, 2, 0])
    from_arrays = step(params, opt_state, x, np.array([0, 1, 2, 0]))
    assert jax.tree.map(np.array_equal, from_lists[0], from_arrays[0]) == jax.tree.map(
        lambda a: True, params
    )
    for bad in ({"step": None}, {"donate": "no"}, {"pad": 1}):
        kw = {"step": sm.training.train_step(net, optax.sgd(0.1)), **bad}
        with pytest.raises(sm.ConfigError, match=r"shard_step\(step, donate=, pad=\): got "):
            sm.training.shard_step(kw.pop("step"), **kw)


def test_shard_step_takes_numpy_bools_as_pythons():
    """donate=np.bool_(False), pad=np.True_ (a sweep's settings) were refused as no bool, where
    jax.jit and Hybrid's settings take them; donating nothing keeps the caller's params."""
    import optax

    net, x = sm.mlp((8, 3)), np.ones((4, 5), np.float32)
    params = net.init(jax.random.key(0), x)["params"]
    step = sm.training.shard_step(
        sm.training.train_step(net, optax.sgd(0.1)), donate=np.bool_(False), pad=np.True_
    )
    step(params, optax.sgd(0.1).init(params), x[:3], np.array([0, 1, 2]))
    assert (step.pad, type(step.pad)) == (True, bool)
    assert all(not a.is_deleted() for a in jax.tree.leaves(params))  # donate was False


def test_shard_step_mesh_errors_name_the_call_and_the_fix():
    """A mesh that is no Mesh, an axis not of it, a batch that does not split: the messages
    began 'expected a jax.sharding.Mesh' or 'axis=...' or 'shard_step(...)', not the call."""
    import optax

    net, x = sm.mlp((8, 3)), np.ones((5, 5), np.float32)
    train_step = sm.training.train_step(net, optax.sgd(0.1))
    call = r"^symjax_mlp\.training\.shard_step\(\.\.\.\): "
    with pytest.raises(sm.ConfigError, match=call + r"mesh is a str.*Pass mesh=sm\.data_mesh"):
        sm.training.shard_step(train_step, "data")
    with pytest.raises(sm.ConfigError, match=call + r"axis='model' is not an axis of the mesh"):
        sm.training.shard_step(train_step, sm.data_mesh(2), axis="model")
    step = sm.training.shard_step(train_step, sm.data_mesh(2), donate=False, pad=False)
    params = net.init(jax.random.key(0), x)["params"]
    with pytest.raises(sm.SignatureError, match=call + r"batch 5 does not divide over 2"):
        step(params, optax.sgd(0.1).init(params), x, np.zeros(5, np.int32))


def test_init_params_and_train_step_name_what_is_not_a_model_key_or_batch():
    """init_params(net, 0, x) (a seed for the key) was flax's InvalidRngError about a
    'JitTracer(~int32[])', init_params('mlp', ...) an AttributeError, x as lists "'list' object
    has no attribute 'shape'"; train_step(None, opt) was taken, to fail at the first step."""
    import optax

    net, x = sm.mlp((8, 3)), np.ones((4, 5), np.float32)
    init = "symjax_mlp.training.init_params"
    with pytest.raises(sm.ConfigError, match=rf"^{init}\(HybridSequential, \.\.\.\): key must "
                       r"be a PRNG key, e\.g\. jax\.random\.key\(0\); got int 0"):  # fmt: skip
        sm.training.init_params(net, 0, x)
    for call in (
        lambda: sm.training.init_params("mlp", jax.random.key(0), x),
        lambda: sm.training.train_step(None, optax.sgd(0.1)),
    ):
        with pytest.raises(sm.ConfigError, match=r"^symjax_mlp\.training\.\w+\(\w+, \.\.\.\): "
                           r"the model must be a flax\.linen or nnx module; got a"):  # fmt: skip
            call()
    from_lists = sm.training.init_params(net, jax.random.key(0), x.tolist())
    from_array = sm.training.init_params(net, jax.random.key(0), x)
    assert jax.tree.all(jax.tree.map(np.array_equal, from_lists, from_array))
    raw = sm.training.init_params(net, jax.random.PRNGKey(0), x)  # the legacy uint32 key
    assert jax.tree.structure(raw) == jax.tree.structure(from_array)


def test_a_step_given_rows_of_another_width_than_the_params_is_a_signature_error():
    """x of 6 features for params made for 5 was flax's ScopeParamShapeError ('the given
    initializer is expected to generate shape (6, 8)'), jitted or not."""
    import optax

    net, x, y, w = sm.mlp((8, 3)), np.ones((4, 5), np.float32), np.array([0, 1, 2, 0]), np.ones(4)
    params = sm.training.init_params(net, jax.random.key(0), x)
    step = sm.training.train_step(net, optax.sgd(0.1))
    says = (
        r"^symjax_mlp\.training\.train_step\(HybridSequential, \.\.\.\): the inputs "
        r"\(args\[0\]: float32\[4, 6\]\) do not fit the params: param layers_0/kernel has "
        r"shape \(5, 8\), and these inputs make it \(6, 8\)"
    )
    for run in (step, jax.jit(step)):
        with pytest.raises(sm.SignatureError, match=says):
            run(params, optax.sgd(0.1).init(params), np.ones((4, 6), np.float32), y, w)


def test_labels_with_fractions_are_refused_with_the_fix(tiny):
    """y of 1.5s (a regression target, or a score) said 'dataset.y_train[0] is
    np.float64(1.5); expected integer class labels': NumPy's repr, and no fix."""
    data = dataclasses.replace(tiny, y_train=tiny.y_train + 0.5)
    says = (
        r"^symjax_mlp\.training\.train: tiny\.y_train\[0\] is [0-9.]+5; expected integer class "
        r"labels, the class indices\. Map the values to them: np\.unique\(y, return_inverse=True"
        r"\)\[1\]"
    )
    with pytest.raises(sm.DataError, match=says):
        sm.training.train(sm.mlp((8, 10)), data, epochs=1)


def _dropout(rate):
    class Net(nn.Module):  # same class, name and params: only the dropout rate differs
        @nn.compact
        def __call__(self, x, train: bool = False):
            return nn.Dense(10)(nn.Dropout(rate, deterministic=not train)(nn.Dense(16)(x)))

    return Net()


def test_resuming_with_another_dropout_rate_is_refused(tiny, tmp_path):
    """The probe ran the inference call only, where dropout is off: a run written with rate
    0.5 resumed with 0.1, silently."""
    import json

    ckpt = tmp_path / "ckpt"
    sm.training.train(_dropout(0.5), tiny, epochs=1, checkpoint=ckpt)
    with pytest.raises(sm.CheckpointError, match="computes something else"):
        sm.training.train(_dropout(0.1), tiny, epochs=2, checkpoint=ckpt, resume=True)
    # a checkpoint written before the training call's probe was recorded still resumes
    manifest = sm.training.latest_checkpoint(ckpt) / "manifest.json"
    text = json.loads(manifest.read_text())
    del text["metadata"]["config"]["model_probe_train"]
    manifest.write_text(json.dumps(text))
    r = sm.training.train(_dropout(0.5), tiny, epochs=2, checkpoint=ckpt, resume=True)
    whole = sm.training.train(_dropout(0.5), tiny, epochs=2)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, r.params, whole.params)))


def test_a_resume_with_another_optimizer_says_what_differs_not_only_hashes(tiny, tmp_path):
    """The message named optimizer_sha256 and two hashes, nothing a reader could act on."""
    ckpt = tmp_path / "ckpt"
    sm.training.train(sm.mlp((8, 10)), tiny, epochs=1, checkpoint=ckpt)
    with pytest.raises(sm.CheckpointError, match=r"what differs: the optimizer: its kind, hyper"):
        sm.training.train(
            sm.mlp((8, 10)), tiny, epochs=2, learning_rate=1e-2, checkpoint=ckpt, resume=True
        )


def test_a_learning_rate_from_a_jax_or_numpy_sweep_is_a_number(tiny):
    """for lr in jnp.logspace(-4, -2, 3): a 0-d array was refused as 'not a number > 0'."""
    kw = {"epochs": 1, "batch_size": 16}
    want = sm.training.train(sm.mlp((8, 10)), tiny, learning_rate=1e-2, **kw)
    for lr in (jnp.float32(1e-2), np.array(1e-2, np.float32), jnp.logspace(-3, -2, 2)[1]):
        got = sm.training.train(sm.mlp((8, 10)), tiny, learning_rate=lr, **kw)
        assert all(jax.tree.leaves(jax.tree.map(np.array_equal, got.params, want.params)))
    with pytest.raises(sm.ConfigError, match="learning_rate must be a number > 0"):
        sm.training.train(sm.mlp((8, 10)), tiny, learning_rate=jnp.array([1e-2]), **kw)


def test_numpy_integer_settings_are_their_ints(tiny, tmp_path):
    """seed=np.int64(3) was an AttributeError ('bit_length'); batch_size=np.int64(16) was
    refused as 'must be an int'."""
    ints = {"seed": 3, "batch_size": 16, "epochs": 1, "checkpoint_every": 1}
    want = sm.training.train(sm.mlp((8, 10)), tiny, **ints)
    got = sm.training.train(
        sm.mlp((8, 10)), tiny, checkpoint=tmp_path, **{k: np.int64(v) for k, v in ints.items()}
    )
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, got.params, want.params)))
    assert got.checkpoint is not None


def test_a_checkpoint_directory_that_cannot_be_listed_is_a_checkpoint_error(tmp_path, monkeypatch):
    """latest_checkpoint and restore_checkpoint of a directory this user may not read raised
    os's raw PermissionError (from Path.iterdir); root reads anything, so listing is refused."""
    saved = sm.training.save_checkpoint(tmp_path / "run", _state())
    listdir = os.listdir

    def refused(path="."):
        if os.fspath(path) == os.fspath(tmp_path / "run"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return listdir(path)

    monkeypatch.setattr(os, "listdir", refused)
    says = r"run cannot be listed \(Permission denied\), .* Pass a checkpoint directory this"
    for call in (
        sm.training.latest_checkpoint,
        lambda p: sm.training.restore_checkpoint(p, _state()),
    ):
        with pytest.raises(sm.CheckpointError, match=says):
            call(tmp_path / "run")
    monkeypatch.setattr(os, "listdir", listdir)
    assert sm.training.latest_checkpoint(tmp_path / "run") == saved


def test_numpy_integer_timeout_and_keep_are_their_ints(tiny, tmp_path):
    """train(timeout=np.int64(5)) was refused, 'timeout must be an int >= 1 (seconds); got
    np.int64(5)', where np.int64 epochs, batch_size and seed are their ints; so was
    save_checkpoint(keep=np.int64(1)) ('pass how many checkpoints to keep, an int >= 1')."""
    r = sm.training.train(sm.mlp((8, 10)), tiny, epochs=1, batch_size=16, timeout=np.int64(5))
    assert r.step == 4
    state = _state()
    sm.training.save_checkpoint(tmp_path, state, keep=np.int64(1))
    newest = sm.training.save_checkpoint(
        tmp_path, dataclasses.replace(state, step=1), keep=np.int64(1)
    )
    assert [p.name for p in tmp_path.iterdir()] == [newest.name]


def test_labels_or_features_of_a_kind_that_is_no_number_say_what_to_pass(tiny):
    """bool labels were 'dataset.y_train has dtype bool; expected int labels.', str features
    'has dtype <U32; expected real numbers.': no fix. Each says what to pass."""
    t = tiny
    cases = (
        (t.x_train, t.y_train.astype(bool), r"y_train has dtype bool; .* Pass y.astype\(np.int32"),
        (t.x_train.astype(str), t.y_train, r"x_train has dtype <U\d+; .* Pass numeric features"),
    )
    for x, y, says in cases:
        with pytest.raises(sm.DataError, match=says):
            sm.training.train(sm.mlp((8, 10)), sm.training.Dataset(x, y, t.x_test, t.y_test))


def test_a_dataset_named_by_a_path_checkpoints(tiny, tmp_path):
    """name=Path(...) trained an epoch, then failed to save: 'save_checkpoint(metadata=...):
    Object of type PosixPath is not JSON serializable', metadata the caller never passed."""
    from pathlib import Path

    named = sm.training.Dataset(tiny.x_train, tiny.y_train, tiny.x_test, tiny.y_test,
                                name=Path("data") / "tiny")  # fmt: skip
    r = sm.training.train(sm.mlp((8, 10)), named, epochs=1, checkpoint=tmp_path / "c")
    again = sm.training.train(sm.mlp((8, 10)), named, epochs=2, checkpoint=tmp_path / "c",
                              resume=True)  # fmt: skip
    assert r.checkpoint is not None and again.resumed_from == r.checkpoint


@pytest.mark.parametrize("largest", [10**9, 2**31 - 2, 2**16 + 1])
def test_id_like_labels_are_refused_before_the_default_model_is_built(tiny, largest):
    """Labels such as 10**9 built an MLP of 10**9 outputs, which died of out-of-memory."""
    y = np.where(tiny.y_train % 2, largest, 7)
    ids = sm.training.Dataset(tiny.x_train, y, tiny.x_train, y)
    with pytest.raises(sm.DataError) as e:
        sm.training.train(data=ids, epochs=1)
    message = str(e.value)
    assert f"the labels go up to {largest} but take only 2 distinct values" in message
    assert "np.unique(" in message and "return_inverse=True" in message


def test_many_classes_that_all_occur_are_not_refused():
    x = np.random.default_rng(0).normal(size=(2**16 + 2, 2)).astype(np.float32)
    y = np.arange(len(x))  # past 2**16 classes, each a label: class indices, not IDs
    result = sm.training.train(data=sm.training.Dataset(x, y, x[:4], y[:4]), epochs=0)
    assert result.params["layers_2"]["bias"].shape == (2**16 + 2,)


def test_features_of_width_0_and_ragged_rows_are_data_errors(tiny):
    """Width 0 was a ZeroDivisionError of the initialiser, ragged rows NumPy's ValueError."""
    narrow = sm.training.Dataset(tiny.x_train[:, :0], tiny.y_train, tiny.x_test, tiny.y_test)
    with pytest.raises(sm.DataError, match=r"x_train is empty \(shape \(64, 0\)\); expected at "
                       "least one feature per example"):  # fmt: skip
        sm.training.train(sm.mlp((8, 10)), narrow, epochs=1)
    ragged = sm.training.Dataset([[0.0, 1.0], [2.0]], [0, 1], [[0.0, 1.0]], [0])
    with pytest.raises(sm.DataError, match=r"dataset\.x_train is not an array of numbers .*"
                       "expected rows of equal length"):  # fmt: skip
        sm.training.train(sm.mlp((8, 10)), ragged, epochs=1)
    ragged_labels = sm.training.Dataset(tiny.x_train[:2], [0, [1]], tiny.x_test, tiny.y_test)
    with pytest.raises(sm.DataError, match=r"dataset\.y_train is not an array of numbers"):
        sm.training.train(sm.mlp((8, 10)), ragged_labels, epochs=1)


class _PythonIf(nn.Module):
    """An `if` on an array: in every call, or (``in_training``) only in the training call."""

    in_training: bool = False

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(10)(x)
        if (train or not self.in_training) and float(h.sum()) > 0:
            return -h
        return h


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("in_training", [False, True])
def test_python_control_flow_in_the_model_is_a_control_flow_error(tiny, compiled, in_training):
    """It was JAX's ConcretizationTypeError, from the model's init or its first step."""
    with pytest.raises(sm.ControlFlowError) as e:
        sm.training.train(_PythonIf(in_training), tiny, epochs=1, compiled=compiled)
    message = str(e.value)
    assert message.startswith("symjax_mlp.training.train(_PythonIf): the model needs a concrete")
    assert "ConcretizationTypeError" in message and "jnp.where or jax.lax.cond" in message


class _Temperature(nn.Module):
    """A scalar param initialised by a Python float: weakly typed."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(x) / self.param("temperature", lambda key: 1.0)


class _NnxTemperature(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(64, 10, rngs=nnx.Rngs(0))
        self.temperature = nnx.Param(jnp.asarray(1.0))

    def __call__(self, x):
        return self.dense(x) / self.temperature


@pytest.mark.parametrize("make", [_Temperature, _NnxTemperature])
def test_a_param_initialised_by_a_python_float_trains_compiled(tiny, make):
    """Its weakly typed value came back from the first update strongly typed: RetraceError
    'traced again' with the same inputs as the first trace."""
    params = sm.training.init_params(make(), jax.random.key(0), tiny.x_train[:1])
    assert not any(a.weak_type for a in jax.tree.leaves(params))
    result = sm.training.train(make(), tiny, epochs=2)
    assert result.trace_count == 1 and result.params["temperature"].dtype == jnp.float32


class _NoParams(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x[:, :10] * 2.0


class _IntParam(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(x) * self.param("scale", lambda key: jnp.ones((), jnp.int32))


@pytest.mark.parametrize(
    ("make", "got"), [(_NoParams, "no params"), (_IntParam, r"params\['scale'\] of dtype int32")]
)
def test_a_model_without_float_params_to_train_is_a_config_error(tiny, make, got):
    """No params was a KeyError ('params'); an int param jax.grad's TypeError."""
    with pytest.raises(sm.ConfigError, match=rf"train\({make.__name__}\): the model has {got}; "):
        sm.training.train(make(), tiny, epochs=1)


def test_an_optimizer_state_of_a_python_float_trains_compiled(tiny):
    """Its state 1.0, weakly typed, came back from the first update strongly typed: a
    RetraceError naming two identical signatures."""
    import optax

    def update(grads, decay, params=None):
        return jax.tree.map(lambda g: -0.01 * decay * g, grads), jnp.float32(0.9) * decay

    decaying = optax.GradientTransformation(lambda params: 1.0, update)
    result = sm.training.train(sm.mlp((8, 10)), tiny, optimizer=decaying, epochs=2)
    assert result.trace_count == 1 and result.opt_state.dtype == jnp.float32


def test_features_or_labels_given_as_a_generator_or_none_are_named(tiny):
    """A generator (or None) became a 0-d object array: 'x_train has shape (); expected 2-D
    features', which named neither what was given nor the fix."""
    rows = (r for r in tiny.x_train)
    data = sm.training.Dataset(rows, tiny.y_train, tiny.x_test, tiny.y_test)
    with pytest.raises(sm.DataError, match=r"dataset\.x_train is not an array of numbers \(a "
                       r"generator\); .* \(a generator's: list\(rows\)\)"):  # fmt: skip
        sm.training.train(sm.mlp((8, 10)), data, epochs=1)
    data = sm.training.Dataset(tiny.x_train, None, tiny.x_test, tiny.y_test)
    with pytest.raises(sm.DataError, match=r"dataset\.y_train is not an array of numbers \(a "
                       "NoneType\\)"):  # fmt: skip
        sm.training.train(sm.mlp((8, 10)), data, epochs=1)


@pytest.mark.parametrize("dtype", [np.float16, jnp.bfloat16])
def test_labels_of_a_narrow_float_dtype_train_like_int_labels(tiny, dtype):
    """float16 labels overflowed NumPy's cast of the int32 limit they are compared with (a
    RuntimeWarning; an error where warnings are), bfloat16 ones were 'expected int labels'."""
    data = sm.training.Dataset(
        tiny.x_train, tiny.y_train.astype(dtype), tiny.x_test, tiny.y_test.astype(dtype)
    )
    run = {"epochs": 1, "batch_size": 16}
    want = sm.training.train(sm.mlp((8, 10)), tiny, **run).params
    got = sm.training.train(sm.mlp((8, 10)), data, **run).params
    assert jax.tree.all(jax.tree.map(np.array_equal, got, want))


def test_a_file_named_like_a_checkpoint_is_refused_with_what_to_pass(tmp_path):
    """restore_checkpoint on a FILE named step_NNNNNNNN said "[Errno 20] Not a directory" and
    no fix: it says the file is no checkpoint, what a checkpoint is, and what to pass."""
    saved = sm.training.save_checkpoint(tmp_path / "run", _state())
    for name in ("step_00000007", "notes.txt"):
        (tmp_path / name).write_text("not a checkpoint")
        with pytest.raises(sm.CheckpointError) as e:
            sm.training.restore_checkpoint(tmp_path / name, _state())
        message = str(e.value)
        assert f"{tmp_path / name} is a file, not a checkpoint" in message
        assert "a step_* directory holding manifest.json" in message and "pass one" in message
    assert sm.training.restore_checkpoint(saved, _state())[0].step == 0


def test_initialize_names_every_keyword_it_shows(capsys):
    """initialize()'s message showed the call positionally, initialize('h:1', 2, 5,
    timeout=60): the CLI's options line named --timeout alone. Every keyword is name=value."""
    from symjax_mlp.cli import main

    says = r"initialize\(coordinator='h:1', num_processes=2, process_id=5, timeout=60\): pro"
    with pytest.raises(sm.ConfigError, match=says):
        sm.training.initialize("h:1", 2, 5)
    argv = ["train", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "5"]
    assert main([*argv, "--quiet"]) == 2
    said = capsys.readouterr().err.splitlines()[-1]
    assert "process_id= is --process-id" in said and "num_processes= is --num-processes" in said
    assert "coordinator= is --coordinator" in said and "timeout= is --timeout" in said


def test_a_checkpoint_path_past_name_max_is_no_checkpoint_not_an_oserror(tmp_path):
    """Path.exists() and Path.is_dir() raise OSError (ENAMETOOLONG) on a name past NAME_MAX,
    where os.path says False: restore_checkpoint raised that OSError, latest_checkpoint too."""
    long = tmp_path / ("a" * 300)
    assert sm.training.latest_checkpoint(long) is None
    with pytest.raises(sm.CheckpointError, match=r"aaa cannot be read \(File name too long\)"):
        sm.training.restore_checkpoint(long, _state())


def test_an_odd_step_name_says_what_it_is_what_a_checkpoint_is_and_what_to_pass(tmp_path):
    """restore_checkpoint(d / ("step_" + "0" * 300)) said '[Errno 36] File name too long' with
    no fix; a step_* that does not exist or is a symlink loop was 'the file is missing; the
    checkpoint is incomplete, corrupted or was edited' or an Errno, no fix; a NUL in the path
    was os's raw ValueError from save_checkpoint. Each names the path, what a checkpoint is and
    what to pass; no OSError escapes; latest_checkpoint passes the odd names over (restoring
    the directory refuses them, as resume and init_from do)."""
    saved = sm.training.save_checkpoint(tmp_path / "run", _state())
    (tmp_path / "run" / "step_00000009").symlink_to(tmp_path / "run" / "step_00000009")
    (tmp_path / "run" / "step_00000010").write_text("a file")
    odd = {
        "step_" + "0" * 300: r"cannot be read \(File name too long\)",
        "step_abc": "does not exist",
        "step_-1": "does not exist",
        "step_1e3": "does not exist",
        "step_00000004": "does not exist",  # named like a step: it was 'the file is missing'
        "run/step_00000009": r"cannot be read \(Too many levels of symbolic links\)",
        "run/step_00000010": "is a file, not a checkpoint",
        "run/step_00000000/state.safetensors/x": r"cannot be read \(Not a directory\)",
    }
    fix = r"\. A checkpoint is a step_\* directory holding manifest.json, .*: pass one, or the"
    for name, why in odd.items():
        with pytest.raises(
            sm.CheckpointError, match=rf"^symjax_mlp.training.restore_checkpoint: .*{why}{fix}"
        ):
            sm.training.restore_checkpoint(tmp_path / name, _state())
    (tmp_path / "empty").mkdir()
    with pytest.raises(sm.CheckpointError, match=rf"empty holds no step_\* checkpoint{fix}"):
        sm.training.restore_checkpoint(tmp_path / "empty", _state())
    assert sm.training.latest_checkpoint(tmp_path / "run") == saved
    with pytest.raises(sm.CheckpointError, match=r"step_00000009 is a symlink.*pass it over"):
        sm.training.restore_checkpoint(tmp_path / "run", _state())  # as resume and init_from
    for call in (
        lambda p: sm.training.save_checkpoint(p, _state()),
        lambda p: sm.training.restore_checkpoint(p, _state()),
        sm.training.latest_checkpoint,
    ):
        with pytest.raises(sm.ConfigError, match=r"directory '.*a\\x00b' holds a NUL\. Pass a"):
            call(str(tmp_path / "a\0b"))


def test_data_that_is_no_dataset_names_the_class_that_exists_and_how_to_wrap_it(tiny):
    """A dict of arrays was 'train() expects a symjax_mlp.Dataset', a name the package does
    not have (it is symjax_mlp.training.Dataset): now the call, what came, and the wrap."""
    fields = {k: getattr(tiny, k) for k in ("x_train", "y_train", "x_test", "y_test")}
    cases = {
        "dict of keys \\['x_test', .*Dataset\\(\\*\\*data\\)": fields,
        "tuple of 4 items.*Dataset\\(\\*data\\)": tuple(fields.values()),
        "generator.*Dataset\\(x_train, y_train, x_test, y_test\\)": (v for v in fields.values()),
    }
    for says, data in cases.items():
        with pytest.raises(sm.ConfigError, match="^symjax_mlp.training.train: data must be a "
                           f"symjax_mlp.training.Dataset; got a {says}"):  # fmt: skip
            sm.training.train(sm.mlp((8, 10)), data, epochs=1)
    assert sm.training.train(sm.mlp((8, 10)), sm.training.Dataset(**fields), epochs=1).step == 1


def test_load_digits_refuses_bad_settings_naming_the_call():
    """test_fraction='0.2' or None and seed='1' or 1.5 were raw TypeErrors (Python's '<', and
    NumPy's SeedSequence), seed=-1 NumPy's ValueError; np.int64 seeds were and are fine."""
    for kw, says in (
        ({"test_fraction": "0.2"}, r"test_fraction='0\.2', seed=0\): test_fraction must be"),
        ({"test_fraction": None}, r"test_fraction must be a number in \(0, 1\)"),
        ({"test_fraction": True}, r"test_fraction must be a number in \(0, 1\)"),
        ({"seed": "1"}, r"seed='1'\): seed must be an int >= 0; pass e\.g\. seed=0"),
        ({"seed": -1}, r"seed must be an int >= 0"),
        ({"seed": 1.5}, r"seed must be an int >= 0"),
    ):
        with pytest.raises(sm.ConfigError, match=r"^symjax_mlp\.training\.load_digits\(.*" + says):
            sm.training.load_digits(**kw)
    a = sm.training.load_digits(seed=np.int64(1), test_fraction=np.float32(0.25))
    b = sm.training.load_digits(seed=1, test_fraction=0.25)
    assert np.array_equal(a.y_test, b.y_test)


def test_train_step_takes_numpy_integer_blocks(tiny):
    """train_step(net, opt, blocks=np.int64(2)) was refused, 'blocks must be an int >= 1'."""
    import optax

    net, opt = sm.mlp((8, 10)), optax.sgd(0.1)
    x, y, w = tiny.x_train[:16], tiny.y_train[:16], np.ones(16, np.float32)
    params = net.init(jax.random.key(0), x[:1])["params"]
    got = [
        jax.jit(sm.training.train_step(net, opt, blocks=b))(params, opt.init(params), x, y, w)[0]
        for b in (np.int64(2), 2)
    ]
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, *got)))


def test_a_learning_rate_of_any_real_number_type_is_its_float(tiny):
    """learning_rate=Fraction(1, 64) passed the check (a numbers.Real) and failed in optax's
    update: a raw TypeError ('unsupported operand type(s) for *: Fraction and ...')."""
    from fractions import Fraction

    kw = {"epochs": 1, "batch_size": 16}
    want = sm.training.train(sm.mlp((8, 10)), tiny, learning_rate=1 / 64, **kw)
    got = sm.training.train(sm.mlp((8, 10)), tiny, learning_rate=Fraction(1, 64), **kw)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, got.params, want.params)))


def test_a_results_export_refuses_an_example_and_a_raw_inputs_that_is_no_bool(tiny, tmp_path):
    """r.export(path, example=x), as sm.export takes, was Python's TypeError ('got multiple
    values for keyword argument'); raw_inputs='no' was truthy: the standardisation baked in."""
    std = dataclasses.replace(tiny, mean=np.zeros(64, np.float32), std=np.ones(64, np.float32))
    r = sm.training.train(sm.mlp((8, 10)), std, epochs=1, batch_size=16)
    with pytest.raises(sm.ConfigError, match=r"TrainResult\.export: the example is the result's "
                       r"own, a row of its 64 features; drop example="):  # fmt: skip
        r.export(tmp_path / "a", example=np.zeros((1, 64), np.float32))
    with pytest.raises(sm.ConfigError, match=r"raw_inputs must be True or False; got 'no'"):
        r.export(tmp_path / "b", raw_inputs="no")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert (
        sm.load(r.export(tmp_path / "c", raw_inputs=False).path).signature.inputs[0].shape[1] == 64
    )


def test_an_optimizer_holding_a_prng_key_trains_again_checkpoints_and_resumes_bitwise(
    tiny, tmp_path
):
    """optax.noisy_sgd(key=k) keeps k in its state: the first train() donated k's buffer, so
    a second run with the optimizer (a sweep, a resume) raised 'Array has been deleted'; and
    a checkpoint of its state was NumPy's TypeError on the typed key."""
    import optax

    key = jax.random.key(0)
    kw = {"batch_size": 16, "optimizer": optax.noisy_sgd(0.1, key=key)}
    want = sm.training.train(sm.mlp((8, 10)), tiny, epochs=2, **kw)
    assert not key.is_deleted()
    sm.training.train(sm.mlp((8, 10)), tiny, epochs=1, checkpoint=tmp_path, **kw)
    got = sm.training.train(sm.mlp((8, 10)), tiny, epochs=2, checkpoint=tmp_path, resume=True, **kw)
    assert got.resumed_from is not None and got.step == want.step
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, got.params, want.params)))
    keys = [leaf for leaf in jax.tree.leaves(got.opt_state) if jax.dtypes.issubdtype(
        leaf.dtype, jax.dtypes.prng_key)]  # fmt: skip
    assert len(keys) == 1  # restored as a key, as it was saved


def test_a_state_leaf_no_checkpoint_can_store_is_named(tmp_path):
    """A str, complex128 or object leaf was safetensors' raw SafetensorError ('Unknown dtype
    "str32"'), naming no leaf; nothing is written."""
    for leaf, says in (("x", r"<U1\[\]"), (1 + 2j, r"complex128\[\]"), (np.zeros(2, object), "")):
        state = sm.training.TrainState({"w": jnp.zeros(2), "odd": leaf}, (), jax.random.key(0))
        with pytest.raises(sm.ConfigError, match=rf"save_checkpoint: the state's leaf 'params/odd'"
                           rf" is {says}.*cannot store .* Keep it out of the state"):  # fmt: skip
            sm.training.save_checkpoint(tmp_path, state)
    assert list(tmp_path.iterdir()) == []


def test_an_optimizer_that_takes_the_loss_trains_and_resumes_bitwise(tiny, tmp_path):
    """optax.contrib.reduce_on_plateau's update takes value= (the loss), as optax documents
    for a GradientTransformationExtraArgs: train()'s step passed none, a raw TypeError
    ('missing 1 required keyword-only argument: value') at the first step."""
    import optax

    def opt():
        return optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=1))

    kw = {"batch_size": 16}
    want = sm.training.train(sm.mlp((8, 10)), tiny, epochs=2, optimizer=opt(), **kw)
    sm.training.train(sm.mlp((8, 10)), tiny, epochs=1, optimizer=opt(), checkpoint=tmp_path, **kw)
    got = sm.training.train(
        sm.mlp((8, 10)), tiny, epochs=2, optimizer=opt(), checkpoint=tmp_path, resume=True, **kw
    )
    assert got.resumed_from is not None and got.step == want.step == 8
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, got.params, want.params)))


def test_an_optimizer_needing_more_than_the_loss_is_refused_before_the_first_step(tiny, tmp_path):
    """optax.lbfgs()'s update needs grad= and value_fn= (its line search): train() ran to the
    first step and failed there with optax's raw TypeError ('missing 2 required keyword-only
    arguments: 'grad' and 'value_fn''). It is refused first, naming what train() passes."""
    import optax

    epochs = []
    with pytest.raises(
        sm.ConfigError,
        match=r"^symjax_mlp\.training\.train: the optimizer's update raised TypeError: "
        r"scale_by_zoom_linesearch.*'value_fn'.*optimizer\.update\(grads, opt_state, params, "
        r"value=loss\) and nothing more.*optax\.lbfgs.*Pass an optimizer such as",
    ):
        sm.training.train(
            sm.mlp((8, 10)), tiny, epochs=1, batch_size=16, optimizer=optax.lbfgs(),
            checkpoint=tmp_path / "ck", on_epoch=epochs.append,
        )  # fmt: skip
    assert epochs == [] and not (tmp_path / "ck").exists()


def test_a_results_export_adds_kwargs_to_its_eval_flags(tiny, tmp_path):
    """r.export(path, kwargs={...}) replaced the result's eval_flags (the model exported in
    training mode, silently) and, where the standardisation is baked in, ended in a raw
    TypeError of the wrapped model; the model's keywords now add to its eval_flags."""

    class Scaled(nn.Module):  # training mode adds 1: a model exported in it differs
        @nn.compact
        def __call__(self, x, train: bool = True, scale: float = 1.0):
            return nn.Dense(10)(x) * scale + (1.0 if train else 0.0)

    std = dataclasses.replace(tiny, mean=np.zeros(64, np.float32), std=np.ones(64, np.float32))
    r = sm.training.train(Scaled(), std, epochs=1, batch_size=16)
    x = np.asarray(tiny.x_test[:3], np.float32)
    want = np.asarray(r.hybridize()(x, train=False, scale=2.0))
    for raw in (True, False):
        art = r.export(tmp_path / f"raw_{raw}", raw_inputs=raw, kwargs={"scale": 2.0})
        np.testing.assert_allclose(sm.load(art.path)(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(sm.ConfigError, match=r"kwargs must be a dict of the model's keyword "
                       r"arguments; got str 'scale'\. Pass e\.g\. kwargs="):  # fmt: skip
        r.export(tmp_path / "bad", kwargs="scale")


def test_train_step_refuses_what_is_no_optimizer_when_made():
    """train_step(net, optax.adam) (the function, not called) and train_step(net, None) made a
    step whose first call raised a raw AttributeError ('function' object has no attribute
    'update'); they are refused when the step is made, naming what was given."""
    import optax

    for bad, named in ((optax.adam, "function <function adam"), (None, "NoneType None")):
        with pytest.raises(sm.ConfigError, match=r"train_step\(HybridSequential, \.\.\.\): "
                           r"optimizer must be an optax\.GradientTransformation, e\.g\. "
                           rf"optax\.adam\(1e-3\) .*; got {named}"):  # fmt: skip
            sm.training.train_step(sm.mlp((8, 3)), bad)
    assert callable(sm.training.train_step(sm.mlp((8, 3)), optax.MultiSteps(optax.sgd(0.1), 2)))


def test_one_hot_labels_are_refused_saying_how_to_make_class_indices(tiny):
    """y as one-hot rows (Keras' form) was refused as 'has shape (64, 10); expected one integer
    label per row' with no fix: it says to pass y.argmax(axis=1) (a column: y.reshape(-1))."""
    eye = np.eye(10, dtype=np.float32)
    one_hot = dataclasses.replace(tiny, y_train=eye[tiny.y_train], y_test=eye[tiny.y_test])
    says = r"y_train has shape \(\d+, 10\); expected one integer label per row .*Pass the class "
    with pytest.raises(sm.DataError, match=says + r"indices: y\.argmax\(axis=1\) of one-hot"):
        sm.training.train(sm.mlp((8, 10)), one_hot, epochs=1)


def test_train_step_of_an_optimizer_needing_more_than_the_loss_names_what_it_passes():
    """train_step(net, optax.lbfgs()) in a loop of one's own: its first (traced) call raised
    optax's raw TypeError ('missing 2 required keyword-only arguments'), not what it passes."""
    import optax

    net, x, y = sm.mlp((8, 3)), jnp.ones((4, 5)), jnp.array([0, 1, 2, 0])
    params = net.init(jax.random.key(0), x)["params"]
    opt = optax.lbfgs()
    step = jax.jit(sm.training.train_step(net, opt))
    says = r"train_step\(HybridSequential, \.\.\.\): the optimizer's update raised TypeError: "
    with pytest.raises(sm.ConfigError, match=says + r".*'value_fn'\. The training step calls "
                       r"optimizer\.update\(grads, opt_state, params, value=loss\)"):  # fmt: skip
        step(params, opt.init(params), x, y, jnp.ones(4))


def test_numpy_bool_settings_are_pythons_in_the_result(tiny):
    """compiled=np.True_ (or 1) passed the check and was kept as it was: result.compiled was
    np.True_, and json.dumps(result.to_dict()) raised 'Object of type bool is not JSON
    serializable' (a multi-process run's agreed settings, with resume=np.True_, too)."""
    import json

    for flag in (np.True_, 1):
        r = sm.training.train(sm.mlp((8, 10)), tiny, epochs=1, batch_size=16, compiled=flag)
        assert r.compiled is True and json.loads(json.dumps(r.to_dict()))["compiled"] is True


def test_a_ctrl_c_while_pruning_leaves_no_half_deleted_checkpoint(tmp_path, monkeypatch):
    """Ctrl-C in ``symjax-mlp train`` as it removed the oldest of ``keep`` checkpoints left a
    step_* directory of manifest.json alone, listed as a checkpoint that no restore could read.
    Now what it left is out of sight, and the next save removes it."""
    import shutil

    for step in (1, 2):
        sm.training.save_checkpoint(tmp_path, dataclasses.replace(_state(), step=step))

    def interrupted(path, ignore_errors=False):  # the state file goes, then the Ctrl-C
        os.unlink(os.path.join(path, "state.safetensors"))
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sm.training.save_checkpoint(tmp_path, dataclasses.replace(_state(), step=3), keep=2)
    monkeypatch.undo()
    seen = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert seen == ["step_00000002", "step_00000003"], seen
    for name in seen:
        sm.training.restore_checkpoint(tmp_path / name, _state())
    sm.training.save_checkpoint(tmp_path, dataclasses.replace(_state(), step=4), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]


# -- session 47: a full disk, a damaged state file, a step's non-logits, an optimizer that raises
def test_a_full_disk_while_saving_names_the_call_and_what_to_do(tmp_path, monkeypatch):
    """ENOSPC was 'cannot write .../step_00000002: [Errno 28] No space left on device. Anything
    there before is unchanged.': no call named, nothing to do."""
    import errno

    import symjax_mlp._files as files_seam

    good = sm.training.save_checkpoint(tmp_path, dataclasses.replace(_state(), step=1))

    def full(file, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files_seam, "write_file", full)
    says = r"^symjax_mlp\.training\.save_checkpoint: cannot write .*No space left.*Free space"
    with pytest.raises(sm.CheckpointError, match=says + r".*resume=True") as e:
        sm.training.save_checkpoint(tmp_path, dataclasses.replace(_state(), step=2))
    assert isinstance(e.value.__cause__, OSError)
    assert [p.name for p in tmp_path.iterdir()] == [good.name]  # the last good one, intact


@pytest.mark.parametrize("name", ["a", "exp. A"])  # a path holding ". A" cut the reason short
def test_a_damaged_state_file_is_named_a_broken_checkpoint_with_a_checkpoints_fix(tmp_path, name):
    """A truncated state.safetensors said only 'is not a valid safetensors file: its header
    claims ... bytes'; another run's, 'Restore the file, or write it again (export the artifact
    again)': no checkpoint's fix."""
    path = sm.training.save_checkpoint(tmp_path / name, _state())
    another_run = dataclasses.replace(_state(), params={"w": jnp.ones(2)})
    other = sm.training.save_checkpoint(tmp_path / "b", another_run)
    blob, file = (other / "state.safetensors").read_bytes(), path / "state.safetensors"
    for damaged, says in ((blob[:40], "its header claims"), (blob, "sha256 is")):
        file.write_bytes(damaged)
        with pytest.raises(sm.CheckpointError, match=rf"{says}.*; the checkpoint is incomplete, "
                           "corrupted or was edited. Resume from an older") as e:  # fmt: skip
            sm.training.restore_checkpoint(path, _state())
        assert "artifact" not in str(e.value)


@pytest.mark.parametrize(
    ("f", "got"),
    [
        (lambda z: (z, z), "a tuple"),
        (lambda z: z.astype(jnp.int32), "int32"),
        (lambda z: z * (1 + 1j), "complex64"),
    ],
    ids=["tuple", "int", "complex"],
)
def test_train_step_refuses_an_output_that_is_not_float_logits(f, got):
    """train_step of a model returning a tuple was JAX's TracerArrayConversionError, of int or
    complex logits optax's TypeError ('a subdtype of numpy.floating')."""
    import optax

    net, opt, x = _returning(f), optax.sgd(0.1), jnp.ones((4, 3))
    params = net.init(jax.random.key(0), x)["params"]
    step = sm.training.train_step(net, opt)
    with pytest.raises(sm.ConfigError, match=rf"train_step: the model's training call returns "
                       rf"{got}.*expected \(batch, classes\) float logits"):  # fmt: skip
        step(params, opt.init(params), x, jnp.zeros(4, jnp.int32), jnp.ones(4))


@pytest.mark.parametrize("kind", [ValueError, KeyError])
def test_an_optimizer_whose_update_raises_is_named_before_the_first_step(tiny, kind):
    """An update raising ValueError or KeyError escaped train() as that raw error (its init's
    were already a ConfigError naming optimizer.init)."""
    import optax

    def update(updates, state, params=None):
        raise kind("boom")

    opt = optax.GradientTransformation(lambda p: (), update)
    with pytest.raises(sm.ConfigError, match=r"optimizer\.update\(grads, opt_state, params\) "
                       rf"raised {kind.__name__}: .*boom.*Fix the optimizer") as e:  # fmt: skip
        sm.training.train(sm.mlp((8, 10)), tiny, optimizer=opt, epochs=1, batch_size=16)
    assert isinstance(e.value.__cause__, kind)


def test_an_optimizer_update_of_another_form_is_a_config_error_naming_it(tiny):
    """An update returning three values, or updates missing a leaf, escaped as Python's or
    JAX's ValueError ('too many values to unpack', 'pytree structure error') from the step."""
    import optax

    forms = {
        "a tuple of 3": lambda u, s, p=None: (u, s, 1),
        "updates of another tree": lambda u, s, p=None: ({"layers_0": u["layers_0"]}, s),
    }
    for got, update in forms.items():
        opt = optax.GradientTransformation(lambda p: (), update)
        with pytest.raises(sm.ConfigError, match=rf"optimizer\.update\(.*\) returned {got}.*"
                           r"expected \(updates, opt_state\)"):  # fmt: skip
            sm.training.train(sm.mlp((8, 10)), tiny, optimizer=opt, epochs=1, batch_size=16)


def test_an_optimizer_state_holding_no_array_is_refused_naming_its_leaf(tiny):
    """optimizer.init returning {'name': 'adam'} was JAX's TypeError ('Error interpreting
    argument ... as an abstract array')."""
    import optax

    opt = optax.GradientTransformation(lambda p: {"name": "adam"}, lambda u, s, p=None: (u, s))
    with pytest.raises(sm.ConfigError, match=r"optimizer\.init\(params\) returned a state whose "
                       r"\['name'\] is a str"):  # fmt: skip
        sm.training.train(sm.mlp((8, 10)), tiny, optimizer=opt, epochs=1, batch_size=16)


def test_restoring_into_another_dtype_names_the_dtype_that_wrote_it(tmp_path):
    """A float32 checkpoint restored into a float16 state said 'written for another model or
    feature width': the same model, in another dtype."""
    import optax

    path = sm.training.save_checkpoint(tmp_path, _state())
    p = {"w": jnp.zeros(2, jnp.float16)}
    like = sm.training.TrainState(p, optax.adam(1e-3).init(p), jax.random.key(0))
    with pytest.raises(sm.CheckpointError, match=r"dtype float16\. The checkpoint holds float32 "
                       r"values: .*param_dtype.*jax_enable_x64"):  # fmt: skip
        sm.training.restore_checkpoint(path, like)


class _StopsEarly:
    """Rows that say there are 48 (``len``) and give 10 when read (a reader that ran dry)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return 48

    def __getitem__(self, i):
        if i >= 10:
            raise StopIteration
        return self.rows[i]


def test_data_that_stops_early_or_cannot_be_read_is_a_data_error(tiny):
    """Features and labels that both stopped at 10 of their 48 rows trained on those 10, in
    silence; a value whose __array__ raised escaped as that raw error."""

    class Unreadable:
        def __array__(self, dtype=None, copy=None):
            raise RuntimeError("the file went away")

    x, y = tiny.x_train[:48], tiny.y_train[:48]
    stops = sm.training.Dataset(_StopsEarly(x), _StopsEarly(y), tiny.x_test, tiny.y_test)
    with pytest.raises(sm.DataError, match=r"x_train has 48 rows \(its len\) but gave 10 when "):
        sm.training.train(sm.mlp((8, 10)), stops, epochs=1, batch_size=8)
    unreadable = sm.training.Dataset(Unreadable(), y, tiny.x_test, tiny.y_test)
    with pytest.raises(sm.DataError, match=r"x_train is not an array of numbers \(RuntimeError: "
                       "the file went away\\)") as e:  # fmt: skip
        sm.training.train(sm.mlp((8, 10)), unreadable, epochs=1, batch_size=8)
    assert isinstance(e.value.__cause__, RuntimeError)


def test_a_working_directory_this_user_cannot_write_is_quoted(tmp_path, monkeypatch):
    """``save_checkpoint("ckpt", ...)`` in a read-only working directory said "this user may
    not write to .." (the parent's '.', then the sentence's): it reads as the parent, ``..``."""
    access = os.access
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "access", lambda p, mode, **k: str(p) != "." and access(p, mode, **k))
    with pytest.raises(sm.CheckpointError) as e:
        sm.training.save_checkpoint("ckpt", _state())
    assert "may not write to '.' (the working directory)" in str(e.value), str(e.value)
    assert "make it writable, or pass a path this user may write" in str(e.value)
    assert not (tmp_path / "ckpt").exists()
