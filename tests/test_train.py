"""Training: accuracy on real data, no retracing, bitwise reproducibility and resume,
checkpoints without pickle, named errors, divergence, export of the trained model, the CLI."""

import dataclasses
import json
import shutil
import subprocess
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file

import symjax_mlp as sm
import symjax_mlp._files as files_seam  # the documented seam for crash tests
from symjax_mlp.cli import main
from symjax_mlp.training import init_params


@pytest.fixture(scope="module")
def digits():
    return sm.training.load_digits()


@pytest.fixture(scope="module")
def trained(digits):
    """The full run: default MLP and adam on the digits, 20 epochs, compiled."""
    return sm.training.train(data=digits, epochs=20)


@pytest.fixture(scope="module")
def four_epochs(digits, tmp_path_factory):
    """An uninterrupted 4-epoch run with a checkpoint after every epoch."""
    ckpt = tmp_path_factory.mktemp("uninterrupted")
    return sm.training.train(data=digits, epochs=4, checkpoint=ckpt), ckpt


def _history(result):
    return [
        {k: v for k, v in dataclasses.asdict(r).items() if k != "seconds"} for r in result.history
    ]


def test_load_digits_is_a_fixed_standardised_split(digits):
    again = sm.training.load_digits()
    assert digits.x_train.shape == (1438, 64) and digits.x_test.shape == (359, 64)
    assert digits.x_train.dtype == np.float32 and digits.y_train.dtype == np.int32
    np.testing.assert_array_equal(digits.x_test, again.x_test)
    np.testing.assert_array_equal(digits.y_train, again.y_train)
    assert set(digits.y_test) == set(range(10)) and digits.num_classes == 10
    np.testing.assert_allclose(digits.x_train.mean(axis=0), 0, atol=1e-5)
    raw = digits.x_test * digits.std + digits.mean  # standardize() inverts this
    np.testing.assert_allclose(digits.standardize(raw), digits.x_test, atol=1e-5)
    # rows of another width: NumPy's 'operands could not be broadcast together' before
    with pytest.raises(sm.DataError, match=r"digits\.standardize\(x\): x has shape \(2, 3\), "
                       r"but the statistics are of 64 features\. Pass rows"):  # fmt: skip
        digits.standardize(np.ones((2, 3)))


def test_train_reaches_95_percent_in_under_a_minute_and_never_retraces(trained):
    assert trained.test_accuracy >= 0.95, trained.test_accuracy
    assert trained.train_seconds < 60
    assert trained.trace_count == 1  # 460 steps, one trace: every batch has one signature
    assert trained.compiled and trained.step == 20 * 23 and trained.epoch == 20
    assert [r.epoch for r in trained.history] == list(range(1, 21))
    assert trained.history[-1].loss < trained.history[0].loss / 10
    assert trained.history[-1].test_accuracy == trained.test_accuracy
    json.dumps(trained.to_dict())  # the history is JSON-able


def test_step_traces_once_under_chex(digits):
    net, opt = sm.mlp((128, 64, 10)), optax.adam(1e-3)
    chex.clear_trace_counter()
    step = jax.jit(
        chex.assert_max_traces(sm.training.train_step(net, opt), n=1), donate_argnums=(0, 1)
    )
    params = init_params(net, jax.random.key(0), digits.x_train[:1])
    opt_state = opt.init(params)
    w = np.ones(64, np.float32)
    w[50:] = 0  # a padded last batch has the same signature
    for i in range(4):
        x, y = digits.x_train[64 * i : 64 * (i + 1)], digits.y_train[64 * i : 64 * (i + 1)]
        params, opt_state, metrics = step(params, opt_state, x, y, w if i == 3 else np.ones_like(w))
    assert np.isfinite(metrics["loss"]) and 0 <= metrics["correct"] <= 50


class StepNumerics(chex.TestCase):
    """The step's loss, accuracy count and update hold jitted and un-jitted.

    Digits-shaped (batch 64, 64 features, the default MLP), so the eager variant shares its
    op-by-op compilations with the eager training test.
    """

    @chex.variants(with_jit=True, without_jit=True)
    def test_weighted_loss_and_sgd_update(self):
        net, opt = sm.mlp((128, 64, 10)), optax.sgd(0.1)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((64, 64)).astype(np.float32)
        y = rng.integers(0, 10, 64).astype(np.int32)
        w = (np.arange(64) < 50).astype(np.float32)  # rows 50.. are padding
        params = init_params(net, jax.random.key(0), x[:1])

        @jax.jit
        def reference(p):
            def real_loss(p):
                logits = net.apply({"params": p}, x[:50])
                return optax.losses.softmax_cross_entropy_with_integer_labels(logits, y[:50]).mean()

            loss, grads = jax.value_and_grad(real_loss)(p)
            correct = jnp.sum(jnp.argmax(net.apply({"params": p}, x[:50]), -1) == y[:50])
            return loss, correct, jax.tree.map(lambda p, g: p - 0.1 * g, p, grads)

        loss, correct, want = reference(params)
        new, _, metrics = self.variant(sm.training.train_step(net, opt))(
            params, opt.init(params), x, y, w
        )
        chex.assert_trees_all_close(metrics["loss"], loss, rtol=1e-5)
        chex.assert_trees_all_close(metrics["correct"], correct.astype(jnp.float32))
        chex.assert_trees_all_close(new, want, rtol=1e-5, atol=1e-6)


def test_same_seed_gives_bitwise_identical_params(digits, four_epochs):
    first, _ = four_epochs
    second = sm.training.train(data=digits, epochs=4)
    chex.assert_trees_all_equal(first.params, second.params)
    chex.assert_trees_all_equal(first.opt_state, second.opt_state)
    assert _history(first) == _history(second)


def test_resume_continues_exactly_as_the_uninterrupted_run(digits, four_epochs, tmp_path):
    full, _ = four_epochs
    part = sm.training.train(data=digits, epochs=2, checkpoint=tmp_path)
    assert part.checkpoint.name == "step_00000046"
    resumed = sm.training.train(data=digits, epochs=4, checkpoint=tmp_path, resume=True)
    assert resumed.resumed_from.name == "step_00000046" and resumed.step == full.step
    chex.assert_trees_all_equal(resumed.params, full.params)  # bitwise
    chex.assert_trees_all_equal(resumed.opt_state, full.opt_state)
    assert _history(resumed) == _history(full)
    assert resumed.test_accuracy == full.test_accuracy


def test_checkpoints_are_safetensors_and_json_and_restore_bitwise(four_epochs):
    full, ckpt = four_epochs
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000069", "step_00000092"]  # keep=2
    newest = sm.training.latest_checkpoint(ckpt)
    assert sorted(p.name for p in newest.iterdir()) == ["manifest.json", "state.safetensors"]
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["step"] == 92 and manifest["epoch"] == 4
    assert manifest["metadata"]["config"]["batch_size"] == 64
    tensors = load_file(newest / "state.safetensors")  # no pickle anywhere
    assert tensors["params/layers_0/kernel"].shape == (64, 128)
    assert {"opt_state/0/count", "opt_state/0/mu/layers_2/bias", "rng"} <= set(tensors)
    like = sm.training.TrainState(
        jax.tree.map(jnp.zeros_like, full.params),
        optax.adam(1e-3).init(full.params),
        jax.random.key(7),
    )
    state, meta = sm.training.restore_checkpoint(ckpt, like)
    chex.assert_trees_all_equal(state.params, full.params)
    chex.assert_trees_all_equal(state.opt_state, full.opt_state)
    assert state.step == 92 and len(meta["history"]) == 4


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    params = {"w": jnp.arange(3.0)}
    state = sm.training.TrainState(params, optax.adam(1e-3).init(params), jax.random.key(0), step=1)
    good = sm.training.save_checkpoint(tmp_path, state)

    def crash(file, data):
        file.write_bytes(data[: len(data) // 2])  # half a file, then the disk is full
        raise OSError("disk full")

    monkeypatch.setattr(files_seam, "write_file", crash)
    with pytest.raises(sm.CheckpointError, match=r"disk full.*Anything there before is unchanged"):
        sm.training.save_checkpoint(tmp_path, dataclasses.replace(state, step=2))
    assert [p.name for p in tmp_path.iterdir()] == [good.name]  # no half checkpoint, no temp
    assert sm.training.latest_checkpoint(tmp_path) == good


def _tiny_state(step: int, epoch: int = 0):
    params = {"w": jnp.arange(3.0)}
    opt = optax.adam(1e-3)
    return sm.training.TrainState(params, opt.init(params), jax.random.key(0), step, epoch)


def test_checkpoint_names_steps_past_eight_digits_and_refuses_going_back(tmp_path):
    """Step 10**8 wrote step_100000000, which latest_checkpoint never found (a resume went
    back in time, and keep= left old ones); a step older than the newest was written and then
    pruned at once, its path returned though deleted."""
    for step in (99_999_999, 10**8, 10**8 + 1):
        newest = sm.training.save_checkpoint(tmp_path, _tiny_state(step))
    assert newest.exists() and sm.training.latest_checkpoint(tmp_path) == newest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_100000000", "step_100000001"]
    assert sm.training.restore_checkpoint(tmp_path, _tiny_state(0))[0].step == 10**8 + 1
    with pytest.raises(sm.CheckpointError, match=r"already holds step_100000001, newer than"):
        sm.training.save_checkpoint(tmp_path, _tiny_state(5))
    assert not (tmp_path / "step_00000005").exists()
    with pytest.raises(sm.ConfigError, match=r"step and epoch are counts"):
        sm.training.save_checkpoint(tmp_path / "other", _tiny_state(-1))
    with pytest.raises(sm.ConfigError, match=r"metadata is JSON: strings, finite numbers"):
        sm.training.save_checkpoint(tmp_path / "nan", _tiny_state(1), metadata={"x": np.nan})
    assert not (tmp_path / "nan").exists() or not any((tmp_path / "nan").iterdir())
    for keep in ("2", True, 0, 1.5):  # "2" was a bare TypeError, True kept one
        with pytest.raises(sm.ConfigError, match=rf"keep={keep!r}\): pass how many checkpoints"):
            sm.training.save_checkpoint(tmp_path / "keep", _tiny_state(1), keep=keep)
    assert not (tmp_path / "keep").exists()


def test_an_edited_or_planted_checkpoint_is_refused(tmp_path):
    """The manifest is not hashed: its step must match its directory, its history be finite
    numbers (a NaN once resumed, trained an epoch, then crashed the save); a step_* that is
    a symlink to elsewhere is not one of this directory's checkpoints."""
    good = sm.training.save_checkpoint(tmp_path / "a", _tiny_state(3, 1))
    record = {"epoch": 1, "step": 3, "loss": 0.5, "train_accuracy": 0.9, "test_accuracy": 0.9,
              "seconds": 1.0}  # fmt: skip
    for edit, message in (
        ({"step": 10**30}, r"its step is 10+, but the directory is step_00000003"),
        ({"metadata": {"history": [{**record, "loss": float("nan")}]}}, r"metadata.history"),
    ):
        bad = tmp_path / "edited" / good.name
        shutil.rmtree(bad.parent, ignore_errors=True)
        shutil.copytree(good, bad)
        manifest = json.loads((bad / "manifest.json").read_text())
        (bad / "manifest.json").write_text(json.dumps({**manifest, **edit}))
        with pytest.raises(sm.CheckpointError, match=message):
            sm.training.restore_checkpoint(bad, _tiny_state(0))
    planted = tmp_path / "b"
    sm.training.save_checkpoint(planted, _tiny_state(1))
    (planted / "step_00000050").symlink_to(good, target_is_directory=True)
    assert sm.training.latest_checkpoint(planted).name == "step_00000001"


def test_checkpoint_mismatches_are_named(digits, four_epochs):
    full, ckpt = four_epochs
    with pytest.raises(sm.CheckpointError, match=r"already holds checkpoints .*resume=True"):
        sm.training.train(data=digits, epochs=5, checkpoint=ckpt)
    with pytest.raises(sm.CheckpointError, match=r"\{'batch_size': 64\}.*\{'batch_size': 32\}"):
        sm.training.train(data=digits, epochs=5, batch_size=32, checkpoint=ckpt, resume=True)
    narrow = {**full.params, "layers_0": {"kernel": jnp.zeros((32, 128)), "bias": jnp.zeros(128)}}
    like = sm.training.TrainState(narrow, optax.adam(1e-3).init(narrow), jax.random.key(0))
    with pytest.raises(
        sm.CheckpointError,
        match=r"'params/layers_0/kernel' has shape \(64, 128\).*expects shape \(32, 128\)",
    ):
        sm.training.restore_checkpoint(ckpt, like)
    like = sm.training.TrainState(full.params, optax.sgd(0.1).init(full.params), jax.random.key(0))
    with pytest.raises(sm.CheckpointError, match="does not fit this model and optimizer"):
        sm.training.restore_checkpoint(ckpt, like)


@pytest.mark.parametrize(
    ("change", "sizes", "message"),
    [
        (
            {"y_train": "minus_one"},
            (32, 10),
            r"labels out of range: digits.y_train holds values from -1 to 9 .*first y_train\[0\] "
            r"= -1\), but digits.num_classes is 10, so labels must be integers in 0..9",
        ),
        ({}, (32, 5), r"labels out of range: .*the model has 5 outputs, so .* in 0..4"),
        (
            {"x_test": "narrow"},
            (32, 10),
            r"digits.x_test has 63 features per example but x_train has 64",
        ),
        ({"x_train": "nan"}, (32, 10), r"digits.x_train\[5, 7\] is NaN\); expected finite"),
        ({"x_train": "empty"}, (32, 10), r"digits.x_train is empty \(shape \(0, 64\)\)"),
    ],
)
def test_bad_input_is_named_before_training(digits, change, sizes, message):
    def never(*args):
        pytest.fail("the optimizer was initialised: training began before the data check")

    untouched = optax.GradientTransformation(never, never)
    fields = {}
    for name, how in change.items():
        a = getattr(digits, name).copy()
        if how == "minus_one":
            a[0] = -1
        elif how == "narrow":
            a = a[:, :63]
        elif how == "nan":
            a[5, 7] = np.nan
        elif how == "empty":
            a, fields["y_train"] = a[:0], digits.y_train[:0]
        fields[name] = a
    with pytest.raises(sm.DataError, match=message) as e:
        sm.training.train(sm.mlp(sizes), dataclasses.replace(digits, **fields), optimizer=untouched)
    assert str(e.value).startswith("symjax_mlp.training.train: ")  # began with 'digits.'


@pytest.mark.parametrize("classes", ["10", 0, True, 10.0])
def test_a_num_classes_that_is_not_a_count_is_named(digits, classes):
    # '10' was a NumPy UFuncTypeError, 0 asked for labels in 0..-1, True and 10.0 passed
    with pytest.raises(
        sm.DataError, match=rf"^symjax_mlp\.training\.train: digits.num_classes is {classes!r}; "
    ):
        sm.training.train(sm.mlp((32, 10)), dataclasses.replace(digits, num_classes=classes))


@pytest.mark.parametrize("classes", [11, 2**70])
def test_a_num_classes_past_the_models_outputs_is_refused(digits, classes):
    # it passed: the labels in range of both, num_classes (2**70 too) was never read again
    with pytest.raises(
        sm.DataError, match=rf"digits.num_classes is {classes}, but the model has 10 outputs"
    ):
        sm.training.train(sm.mlp((32, 10)), dataclasses.replace(digits, num_classes=classes))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"learning_rate": -1}, r"learning_rate must be a number > 0 .*got -1"),  # ascent
        ({"learning_rate": "0.1"}, r"learning_rate must be a number > 0 .*got '0.1'"),
        ({"learning_rate": float("inf")}, r"learning_rate must be a number > 0 .*got inf"),
        ({"seed": "a"}, r"seed must be an int.*; got 'a'"),
        ({"compiled": "no"}, r"compiled must be True or False; got 'no'"),  # was truthy
        ({"resume": "no", "checkpoint": "ck"}, r"resume must be True or False; got 'no'"),
        ({"on_epoch": 3}, r"on_epoch must be a function .*got 3"),  # was after the 1st epoch
        # each epoch is padded to whole batches: a MemoryError traceback before
        ({"batch_size": 10**8}, r"batch_size=100000000 is more than the \d+ training examples"),
        ({"epochs": "2"}, r"epochs must be an int >= 0; got '2'\. Pass .*epochs=20"),
        ({"batch_size": 0}, r"batch_size must be an int >= 1; got 0\. Pass .*batch_size=64"),
        ({"checkpoint_every": 1.0}, r"checkpoint_every must be an int >= 1; got 1\.0\. Pass"),
        ({"blocks": 0}, r"blocks must be an int >= 1; got 0\. Pass e\.g\. blocks=1"),
        ({"timeout": 0}, r"timeout must be an int >= 1 \(seconds\), at most 10\*\*9; got 0"),
        ({"optimizer": "adam"}, r"optimizer must be an optax.GradientTransformation .*got str"),
        ({"optimizer": optax.sgd(0.1), "learning_rate": 0.1}, r"learning_rate sets the default"),
        ({"resume": True}, r"resume=True needs checkpoint=DIR"),
        ({"model": len}, r"model must be a flax.linen or nnx module; got a builtin_function"),
    ],
)
def test_a_bad_setting_is_refused_before_training(digits, tmp_path, options, message):
    """Each message starts with the call, as the library's others do (these began with the
    setting's name alone: 'epochs must be an int >= 0; got '2'.', no fix)."""
    if "checkpoint" in options:
        options = {**options, "checkpoint": tmp_path / options["checkpoint"]}
    options = {"model": sm.mlp((32, 10)), "epochs": 1, **options}
    with pytest.raises(sm.ConfigError, match=message) as e:
        sm.training.train(data=digits, **options)
    assert str(e.value).startswith("symjax_mlp.training.train: ")
    assert not (tmp_path / "ck").exists()


def _nan_at(count: int) -> optax.GradientTransformation:
    """Makes the ``count``-th update (0-based) NaN: the loss after it is NaN."""

    def update(updates, seen, params=None):
        scale = jnp.where(seen == count, jnp.nan, 1.0)
        return jax.tree.map(lambda u: u * scale, updates), seen + 1

    return optax.GradientTransformation(lambda p: jnp.zeros([], jnp.int32), update)


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(digits, tmp_path):
    opt = optax.chain(optax.adam(1e-3), _nan_at(30))
    seen = []
    with pytest.raises(sm.DivergenceError, match=r"loss is nan at step 31 \(epoch 2, batch 9") as e:
        sm.training.train(
            data=digits, optimizer=opt, epochs=3, checkpoint=tmp_path, on_epoch=seen.append
        )
    assert (e.value.step, e.value.epoch) == (31, 2) and [r.epoch for r in seen] == [1]
    assert str(e.value).startswith("symjax_mlp.training.train: training diverged: the loss")
    assert e.value.checkpoint.name == "step_00000023" and "kept" in str(e.value)
    assert sm.training.latest_checkpoint(tmp_path) == e.value.checkpoint
    resumed = sm.training.train(
        data=digits, epochs=1, checkpoint=tmp_path, resume=True, optimizer=opt
    )
    assert resumed.step == 23 and all(np.isfinite(x).all() for x in jax.tree.leaves(resumed.params))

    # A huge learning rate; the second transformation keeps the params themselves as its state,
    # which train() must copy, since params and optimizer state are both donated.
    keeps_params = optax.GradientTransformation(lambda p: p, lambda u, s, p=None: (u, s))
    opt = optax.chain(optax.sgd(1e30), keeps_params)
    with pytest.raises(sm.DivergenceError, match=r"at step 1 .*no checkpoint was written") as e:
        sm.training.train(data=digits, optimizer=opt, epochs=1)
    assert e.value.checkpoint is None


class _NanOnOutliers(nn.Module):  # its loss and gradients are NaN on a batch holding an outlier
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x) * jnp.where(jnp.any(x[:, 0] > 5), jnp.nan, 1.0)


@pytest.mark.slow
def test_apply_if_finites_skipped_steps_are_not_a_divergence():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 3, 64).astype(np.int32)
    x[7, 0] = 9.0  # one batch an epoch holds it
    data = sm.training.Dataset(x, y, x[:16], y[:16])
    with pytest.raises(sm.DivergenceError, match="the loss is nan"):
        sm.training.train(_NanOnOutliers(), data=data, epochs=2, batch_size=8)
    skipping = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=5)
    result = sm.training.train(_NanOnOutliers(), data=data, epochs=2, batch_size=8,
                               optimizer=skipping)  # fmt: skip
    assert int(result.opt_state.total_notfinite) == 2 and result.step == 16  # one an epoch
    assert all(np.isfinite(r.loss) for r in result.history)  # its finite steps' mean
    assert all(np.isfinite(a).all() for a in jax.tree.leaves(result.params))


def test_eager_step_matches_compiled(digits, four_epochs):
    full, _ = four_epochs
    eager = sm.training.train(data=digits, epochs=1, compiled=False)
    assert not eager.compiled and eager.trace_count == 0
    np.testing.assert_allclose(eager.history[0].loss, full.history[0].loss, rtol=1e-5)
    assert abs(eager.history[0].test_accuracy - full.history[0].test_accuracy) <= 2 / 359


def test_exported_model_reproduces_the_test_accuracy_in_a_fresh_process(trained, digits, tmp_path):
    trained.export(tmp_path / "digits_mlp")  # the standardisation travels with the model
    raw = digits.x_test * digits.std + digits.mean  # the pixels as they come
    np.save(tmp_path / "x.npy", raw.astype(np.float32))
    in_process = np.asarray(trained.hybridize()(digits.x_test)).argmax(-1)
    code = (
        "import json, sys, numpy as np, symjax_mlp as sm\n"
        "m = sm.load(sys.argv[1])\n"
        "pred = np.asarray(m(np.load(sys.argv[2]))).argmax(-1)\n"
        "print(json.dumps(pred.tolist()))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "digits_mlp"), str(tmp_path / "x.npy")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    pred = np.array(json.loads(run.stdout.splitlines()[-1]))
    np.testing.assert_array_equal(pred, in_process)
    assert np.mean(pred == digits.y_test) == trained.test_accuracy


def test_cli_train_progress_json_checkpoint_resume(tmp_path, capsys):
    ckpt, hist = tmp_path / "ckpt", tmp_path / "h.json"
    argv = ["train", "--epochs", "1", "--checkpoint", str(ckpt), "--json", str(hist)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "epoch 1/1 [####################] loss " in err and "test " in err
    assert out.startswith("test accuracy ") and "after 1 epochs (23 steps, compiled)" in out
    assert len(json.loads(hist.read_text())["history"]) == 1

    # --json PATH exists: refused before any training, with the way out
    assert main(["train", "--epochs", "1", "--quiet", "--resume", *argv[3:]]) == 2
    assert "h.json: already exists; pass --overwrite" in capsys.readouterr().err
    # --resume with the target already reached: restores, trains nothing, reports the same
    assert main(["train", "--epochs", "1", "--quiet", "--resume", "--overwrite", *argv[3:]]) == 0
    out2, err = capsys.readouterr()
    assert err == "" and out2.split(" after")[0] == out.split(" after")[0]
    data = json.loads(hist.read_text())
    assert [r["epoch"] for r in data["history"]] == [1] and data["resumed_from"].endswith("23")

    assert main(["train", "--sizes", "32,5", "--quiet"]) == 2
    assert "labels out of range" in capsys.readouterr().err


class _BatchNormNet(nn.Module):
    """A digits classifier with BatchNorm: batch statistics while training, running ones after."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(64)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        return nn.Dense(10)(x)


class _DropoutNet(nn.Module):
    """A digits classifier with Dropout: a fresh mask every step, none in inference."""

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(nn.Dropout(0.2)(x, deterministic=deterministic))


@pytest.mark.parametrize("net", [_BatchNormNet(), _DropoutNet()], ids=["batchnorm", "dropout"])
def test_train_batchnorm_and_dropout_models_and_ship_them(digits, net, tmp_path):
    result = sm.training.train(net, data=digits, epochs=3, checkpoint=tmp_path / "ckpt")
    assert result.trace_count == 1 and result.test_accuracy > 0.8  # it learns
    assert result.model_state is not None
    if "batch_stats" in result.model_state:  # the running statistics moved off their init
        mean = result.model_state["batch_stats"]["BatchNorm_0"]["mean"]
        assert float(jnp.abs(mean).max()) > 1e-3
        assert result.eval_flags == {"train": False}
    else:
        assert result.eval_flags == {"deterministic": True} and "rng" in result.model_state
    # resuming restores the state too, and continues
    more = sm.training.train(net, data=digits, epochs=4, checkpoint=tmp_path / "ckpt", resume=True)
    assert more.epoch == 4 and more.resumed_from is not None
    # the exported model runs in inference mode and reproduces the run's accuracy
    art = result.export(tmp_path / "art")
    raw = (digits.x_test * digits.std + digits.mean).astype(np.float32)
    predictions = np.argmax(np.asarray(sm.load(art.path)(raw)), axis=-1)
    assert np.mean(predictions == digits.y_test) == pytest.approx(result.test_accuracy, abs=1e-9)


def test_resume_refuses_another_model_or_optimizer(digits, tmp_path):
    ckpt = tmp_path / "ckpt"
    sm.training.train(sm.mlp((32, 10)), data=digits, epochs=1, checkpoint=ckpt)
    with pytest.raises(sm.CheckpointError, match="model_sha256"):
        sm.training.train(
            sm.mlp((32, 10), activation="tanh"), data=digits, epochs=2, checkpoint=ckpt, resume=True
        )
    with pytest.raises(sm.CheckpointError, match="optimizer_sha256"):
        sm.training.train(
            sm.mlp((32, 10)),
            data=digits,
            epochs=2,
            checkpoint=ckpt,
            resume=True,
            optimizer=optax.adam(3e-2),
        )


def test_an_edited_epoch_is_refused(digits, tmp_path):
    ckpt = tmp_path / "ckpt"
    sm.training.train(sm.mlp((32, 10)), data=digits, epochs=1, checkpoint=ckpt)
    manifest_file = sm.training.latest_checkpoint(ckpt) / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["epoch"] = 9
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(sm.CheckpointError, match=r"records epoch 9.*history has 1 epoch"):
        sm.training.train(sm.mlp((32, 10)), data=digits, epochs=5, checkpoint=ckpt, resume=True)


class _IsTrainingNet(nn.Module):
    """BatchNorm and Dropout behind a flag that training does not find by name."""

    @nn.compact
    def __call__(self, x, is_training: bool = False):
        x = nn.BatchNorm(use_running_average=not is_training, momentum=0.5)(nn.Dense(32)(x))
        return nn.Dense(10)(nn.Dropout(0.5)(nn.relu(x), deterministic=not is_training))


class _IsTrainingDropoutNet(nn.Module):
    """Dropout behind such a flag, and no state: only a call with the flag flipped shows it."""

    @nn.compact
    def __call__(self, x, is_training: bool = False):
        return nn.Dense(10)(
            nn.Dropout(0.5)(nn.relu(nn.Dense(32)(x)), deterministic=not is_training)
        )


class _AttributeModeNet(nn.Module):
    """Dropout whose mode is an attribute, fixed for every call: train() cannot switch it."""

    training: bool = True

    @nn.compact
    def __call__(self, x):
        x = nn.Dropout(0.5, deterministic=not self.training)(nn.relu(nn.Dense(32)(x)))
        return nn.Dense(10)(x)


def _never_initialised():
    def never(*args):
        pytest.fail("the optimizer was initialised: training began before the flag check")

    return optax.GradientTransformation(never, never)


def test_a_model_whose_flag_is_not_found_is_refused_before_training(digits):
    net, opt = _IsTrainingNet(), _never_initialised()
    with pytest.raises(
        sm.ConfigError,
        match=r"train\(_IsTrainingNet\): _IsTrainingNet's __call__ takes none of the flags .*"
        r"\(train, training, deterministic\), and a call with its defaults draws no rng and "
        r"updates none of its state \('batch_stats'\): every step would run it in inference "
        r"mode.*A call with is_training=True updates the collection 'batch_stats'. If "
        r"is_training is its mode, name it: train\(\.\.\., train_flags=\{'is_training': "
        r"True\}, eval_flags=\{'is_training': False\}\)",
    ):
        sm.training.train(net, digits, optimizer=opt)
    with pytest.raises(sm.ConfigError, match=r"is_training=True draws from the rng stream 'drop"):
        sm.training.train(_IsTrainingDropoutNet(), digits, optimizer=opt)
    with pytest.raises(sm.ConfigError, match=r"train_step\(_IsTrainingNet.*train_flags=\{'is_tr"):
        step = sm.training.train_step(net, optax.sgd(0.1))
        step(None, None, digits.x_train[:4], digits.y_train[:4], np.ones(4, np.float32))
    with pytest.raises(sm.ConfigError, match=r"names 'is_trainig', which _IsTrainingNet.__call__"):
        sm.training.train(net, digits, optimizer=opt, train_flags={"is_trainig": True})
    with pytest.raises(sm.ConfigError, match=r"inference call.*updates the collection 'batch_st"):
        both = {"is_training": True}  # eval_flags that leave it training
        sm.training.train(net, digits, optimizer=opt, train_flags=both, eval_flags=both)


def test_train_flags_name_a_flag_of_any_name(digits):
    flags = {"train_flags": {"is_training": True}, "eval_flags": {"is_training": False}}
    opt = optax.adam(1e-2)
    result = sm.training.train(_IsTrainingNet(), digits, optimizer=opt, epochs=2, **flags)
    mean = result.model_state["batch_stats"]["BatchNorm_0"]["mean"]
    assert float(jnp.abs(mean).max()) > 1e-3  # batch statistics, so the training mode
    assert "rng" in result.model_state  # a training call draws dropout masks
    assert result.eval_flags == {"is_training": False} and result.trace_count == 1
    assert result.test_accuracy > 0.8
    h = result.hybridize()
    logits = h(jnp.asarray(digits.x_test), **result.eval_flags)
    assert np.mean(np.argmax(np.asarray(logits), -1) == digits.y_test) == result.test_accuracy


def test_a_mode_set_as_an_attribute_is_named_with_its_rng_stream(digits):
    opt = _never_initialised()
    with pytest.raises(
        sm.ConfigError,
        match=r"_AttributeModeNet's inference call \(model.apply\(variables, x\)\) draws from the "
        r"rng stream 'dropout', so it is not in inference mode.*attribute "
        r"_AttributeModeNet\(training=True\).*def __call__\(self, x, train: bool = False\)",
    ):
        sm.training.train(_AttributeModeNet(), digits, optimizer=opt)
    # train_step trains it as it is (its defaults draw dropout masks): nothing to refuse there
    net, sgd = _AttributeModeNet(), optax.sgd(0.1)
    params = init_params(net, jax.random.key(0), digits.x_train[:1])
    assert "rng" in params.state
    step = jax.jit(sm.training.train_step(net, sgd))
    x, y = digits.x_train[:8], digits.y_train[:8]
    _, _, metrics = step(params, sgd.init(params.params), x, y, np.ones(8, np.float32))
    assert np.isfinite(metrics["loss"])


def _small_data(cls=sm.training.Dataset):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    return cls(x[:32], y[:32], x[32:], y[32:], 2, "small")


def test_train_checks_its_data_and_works_out_the_models_spec_once():
    """train() ran the data check twice (a copy of the data each time) and worked the model's
    spec out three times, an abstract init each: in train, in init_params and in the step's
    trace. Now one check, one spec, and the init that makes the params."""
    made, inits = [], []

    @dataclasses.dataclass(frozen=True, eq=False)
    class Counted(sm.training.Dataset):
        def __post_init__(self):
            made.append(self.name)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            if self.is_initializing():
                inits.append(type(x).__name__)
            return nn.Dense(2)(x)

    data = _small_data(Counted)
    result = sm.training.train(Net(), data, epochs=2, batch_size=16)
    assert result.step == 4 and result.trace_count == 1
    assert len(made) == 2  # the data given, and the one checked copy of it
    assert len(inits) == 2, inits  # the spec's abstract init, and the params' init


@pytest.mark.parametrize(
    "flags", [{"train_flags": {"mode": True}}, {"eval_flags": {"mode": False}}]
)
def test_a_required_flag_set_for_one_call_only_is_named_not_a_type_error(flags):
    """__call__(self, x, mode) with mode given for the training call only (or the inference
    call only): a TypeError from inside Flax escaped train(), a bug's traceback on the CLI.
    Now a ConfigError that names the flag and both calls."""

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, mode):
            return nn.Dense(2)(nn.Dropout(0.1, deterministic=not mode)(x))

    says = r"requires 'mode' \(no default\).*train_flags=\{'mode': True\}, eval_flags=\{'mode'"
    with pytest.raises(sm.ConfigError, match=says):
        sm.training.train(Net(), _small_data(), epochs=1, batch_size=16, **flags)
    both = {"train_flags": {"mode": True}, "eval_flags": {"mode": False}}
    assert sm.training.train(Net(), _small_data(), epochs=1, batch_size=16, **both).step == 2


def test_flax_imagenet_resnet_steps_as_its_pmap_step_on_one_device():
    """BatchNorm(axis_name='batch') with no pmap: the pieces bind the axis over the whole batch,
    as train.py's jax.pmap(axis_name='batch') does on one device (was JAX's NameError)."""
    from helpers import RESNET, _x

    x, y, opt = _x(1, (4, 8, 8, 3)), jnp.array([0, 1, 2, 3]), optax.sgd(0.1)
    params = init_params(RESNET, jax.random.key(0), x[:1])
    step = jax.jit(sm.training.train_step(RESNET, opt))
    got, _, metrics = step(params, opt.init(params.params), x, y, jnp.ones(4))

    def pmap_step(params, batch_stats, x, y):  # train.py's train_step, less its weight decay
        def loss_fn(params):
            variables = {"params": params, "batch_stats": batch_stats}
            logits, new = RESNET.apply(variables, x, mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return loss, new

        (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        grads = jax.lax.pmean(grads, axis_name="batch")
        updates = opt.update(grads, opt.init(params))[0]
        return optax.apply_updates(params, updates), new["batch_stats"], loss

    one = jax.pmap(pmap_step, axis_name="batch")
    want = one(*jax.tree.map(lambda a: a[None], (params.params, params.state["batch_stats"], x, y)))
    want = jax.tree.map(lambda a: a[0], want)
    chex.assert_trees_all_close(
        (got.params, got.state["batch_stats"], metrics["loss"]), want, rtol=1e-5, atol=1e-6
    )


def test_a_train_step_run_under_the_users_pmap_reduces_over_its_devices_as_flax_does():
    """train.py's way, jax.pmap(step, axis_name='batch') over 2 devices: BatchNorm's statistics
    are the global batch's on every device, as Flax's own pmap step gives; the step's own
    binding of 'batch' (for a call with no pmap) shadowed the pmap's, so each device kept its
    half's statistics."""

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.BatchNorm(use_running_average=not train, axis_name="batch")(nn.Dense(4)(x))
            return nn.Dense(3)(x)

    x, y, opt = jnp.arange(24.0).reshape(8, 3) % 7, jnp.arange(8) % 3, optax.sgd(0.1)
    params = init_params(Net(), jax.random.key(0), x[:1])
    step = sm.training.train_step(Net(), opt)
    whole = jax.jit(step)(params, opt.init(params.params), x, y, jnp.ones(8))[0].state
    halves = jax.tree.map(lambda a: jnp.stack([a, a]), (params, opt.init(params.params)))
    split = [a.reshape(2, 4, *a.shape[1:]) for a in (x, y, jnp.ones(8))]
    got = jax.pmap(step, axis_name="batch", devices=jax.devices()[:2])(*halves, *split)[0].state
    for device in range(2):  # the running statistics moved by the whole batch's, on both
        chex.assert_trees_all_close(jax.tree.map(lambda a, d=device: a[d], got), whole, rtol=1e-5)


def test_an_nnx_batchnorm_over_an_axis_name_steps_as_one_over_the_whole_batch():
    """nnx.BatchNorm(axis_name='batch') with no pmap steps as without the axis name (one
    device: the batch's statistics), not JAX's NameError."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, axis_name):
            self.lin = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
            self.bn = nnx.BatchNorm(4, axis_name=axis_name, rngs=nnx.Rngs(0))

        def __call__(self, x, train: bool = False):
            return self.bn(self.lin(x), use_running_average=not train)

    x, y, opt = jnp.arange(12.0).reshape(4, 3) % 5, jnp.array([0, 1, 2, 3]), optax.sgd(0.1)
    runs = []
    for net in (Net("batch"), Net(None)):
        params = init_params(net, jax.random.key(0), x[:1])
        step = jax.jit(sm.training.train_step(net, opt))
        runs.append(step(params, opt.init(params.params), x, y, jnp.ones(4)))
    chex.assert_trees_all_close(*runs, rtol=1e-6, atol=1e-7)  # a mean over 1 device: round-off
