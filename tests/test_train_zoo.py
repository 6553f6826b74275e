"""Training over the zoo: every single-input classifier of tests/helpers.py, linen and nnx
(flags, BatchNorm, Dropout, nnx's own train()/eval() mode), through sm.training.train, its
checkpoints and exact resume, the trained model's Hybrid and its exported artifact; and the
nnx step against nnx's own optax loop."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import ZOO, NnxModes, keyless

import symjax_mlp as sm

#: the zoo's classifiers: one (4, 5) input, (4, 3) logits
CLASSIFIERS = [
    c
    for c in ZOO
    if c.kind in ("linen", "nnx") and len(c.inputs(0)) == 1 and c.name != "linen_dict"
]
MEAN, STD = np.float32(0.5), np.float32(2.0)


def _module(case):
    model, _ = case.build()  # a linen module's init is train()'s own, from its seed
    return model


@pytest.fixture(scope="module")
def data():
    """A learnable 3-class problem on 5 features, standardised with MEAN and STD."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 3)).astype(np.float32)
    x = rng.standard_normal((360, 5)).astype(np.float32)
    y = np.argmax(x @ w, axis=-1).astype(np.int32)
    mean, std = np.full(5, MEAN), np.full(5, STD)
    return sm.training.Dataset(x[:240], y[:240], x[240:], y[240:], 3, "zoo", mean, std)


def _leaves(tree):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(keyless(tree))]


@pytest.mark.parametrize("case", CLASSIFIERS, ids=lambda c: c.name)
def test_every_zoo_classifier_trains_resumes_exactly_and_ships(case, data, tmp_path):
    module = _module(case)
    given = _leaves(nnx.state(module)) if case.kind == "nnx" else None
    opt = optax.adam(3e-2)
    run = sm.training.train(module, data, optimizer=opt, epochs=4, batch_size=32)
    assert run.trace_count == 1
    assert run.history[-1].loss < run.history[0].loss and run.test_accuracy > 0.7  # it learns
    if case.kind == "nnx":  # the module given is left as it was; the trained one is new
        assert all(map(np.array_equal, _leaves(nnx.state(module)), given))
        assert run.model is not module and not run.hybridize().training_mode(*case.inputs(0))
    if case.stateful:  # its state moved as a training call moves it
        start = sm.training.init_params(module, jax.random.key(0), data.x_train[:1])
        assert not all(map(np.array_equal, _leaves(run.model_state), _leaves(start.state)))
    # checkpointed and resumed halfway, it is the uninterrupted run, bit for bit
    ckpt = tmp_path / "ckpt"
    sm.training.train(module, data, optimizer=opt, epochs=2, batch_size=32, checkpoint=ckpt)
    resumed = sm.training.train(
        module, data, optimizer=opt, epochs=4, batch_size=32, checkpoint=ckpt, resume=True
    )
    assert resumed.resumed_from is not None
    assert all(map(np.array_equal, _leaves(resumed.params), _leaves(run.params)))
    assert all(map(np.array_equal, _leaves(resumed.model_state), _leaves(run.model_state)))
    # the Hybrid and the artifact (raw features in) give the accuracy the run reported
    logits = run.hybridize()(jnp.asarray(data.x_test), **run.eval_flags)
    assert np.mean(np.argmax(np.asarray(logits), -1) == data.y_test) == run.test_accuracy
    loaded = sm.load(run.export(tmp_path / "art").path)
    predictions = np.argmax(np.asarray(loaded(data.x_test * STD + MEAN)), -1)
    assert np.mean(predictions == data.y_test) == pytest.approx(run.test_accuracy, abs=1e-9)


@pytest.mark.parametrize("case", CLASSIFIERS, ids=lambda c: c.name)
def test_the_eager_run_is_the_compiled_run(case, data):
    # plain SGD: Adam's m / sqrt(v) would turn rounding noise in a zero gradient (a Dense bias
    # before BatchNorm) into steps of the full learning rate, in either direction
    opt = optax.sgd(0.1)
    runs = [
        sm.training.train(_module(case), data, optimizer=opt, epochs=1, batch_size=60, compiled=c)
        for c in (True, False)
    ]
    for a, b in zip(_leaves(runs[0].params), _leaves(runs[1].params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_an_nnx_module_trains_as_train_sets_it_whatever_mode_it_is_given_in(data):
    built, evaluated = NnxModes(nnx.Rngs(0, dropout=7)), NnxModes(nnx.Rngs(0, dropout=7))
    evaluated.eval()
    runs = [sm.training.train(m, data, epochs=2, batch_size=32) for m in (built, evaluated)]
    assert all(map(np.array_equal, _leaves(runs[0].params), _leaves(runs[1].params)))
    assert not built.drop.deterministic and evaluated.drop.deterministic  # neither was switched
    assert runs[0].model.drop.deterministic and runs[0].model.norm.use_running_average


def test_the_nnx_step_is_nnx_own_optax_step():
    """One step of sm.training.train_step equals the loop nnx documents: module.train(),
    nnx.value_and_grad of the loss, optax on the Params (batch stats and dropout mask too)."""
    x = jax.random.normal(jax.random.key(1), (8, 5))
    y, w = jnp.arange(8) % 3, jnp.ones(8)
    opt = optax.sgd(0.1)

    reference = NnxModes(nnx.Rngs(0, dropout=7))
    reference.train()

    def loss(m):
        losses = optax.losses.softmax_cross_entropy_with_integer_labels(m(x), y)
        return jnp.mean(losses)

    @nnx.jit  # as nnx's guide jits its train_step (eager, each op compiled on its own)
    def reference_step(m):
        ref_loss, grads = nnx.value_and_grad(loss)(m)
        params = nnx.state(m, nnx.Param)
        updates, _ = opt.update(grads, opt.init(params), params)
        nnx.update(m, optax.apply_updates(params, updates))
        return ref_loss

    ref_loss = reference_step(reference)

    module = NnxModes(nnx.Rngs(0, dropout=7))
    start = sm.training.init_params(module, jax.random.key(0), x[:1])
    step = jax.jit(sm.training.train_step(module, opt))
    trained, _, metrics = step(start, opt.init(start.params), x, y, w)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-6)
    want = nnx.to_pure_dict(nnx.state(reference, nnx.Param))
    for a, b in zip(_leaves(trained.params), _leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    moved = nnx.to_pure_dict(nnx.state(reference, nnx.Not(nnx.Param)))
    for a, b in zip(_leaves(trained.state), _leaves(moved), strict=True):  # stats, rng count
        np.testing.assert_allclose(a, b, rtol=1e-6)  # two programs: an ulp apart


def test_an_nnx_module_resumes_whatever_its_values_and_not_another_configuration(data, tmp_path):
    """Resuming takes the module's configuration, not its values: one built from another seed
    and run eagerly (its rng count and statistics moved) resumes the checkpoint exactly; one
    with another Dropout rate is refused."""
    opt, ckpt = optax.adam(3e-2), tmp_path / "ckpt"
    whole = sm.training.train(NnxModes(nnx.Rngs(0, dropout=7)), data, optimizer=opt, epochs=2)
    sm.training.train(
        NnxModes(nnx.Rngs(0, dropout=7)), data, optimizer=opt, epochs=1, checkpoint=ckpt
    )
    other = NnxModes(nnx.Rngs(5, dropout=9))
    other(jnp.ones((4, 5)))  # eager, in training mode: its count and batch stats move
    resumed = sm.training.train(other, data, optimizer=opt, epochs=2, checkpoint=ckpt, resume=True)
    assert resumed.resumed_from is not None
    assert all(map(np.array_equal, _leaves(resumed.params), _leaves(whole.params)))
    assert all(map(np.array_equal, _leaves(resumed.model_state), _leaves(whole.model_state)))
    rate = NnxModes(nnx.Rngs(0, dropout=7))
    rate.drop.rate = 0.25
    with pytest.raises(
        sm.CheckpointError, match=r"was written with \{.model_sha256.*resume with the same settings"
    ):
        sm.training.train(rate, data, optimizer=opt, epochs=2, checkpoint=ckpt, resume=True)


class _IsTrainingNnx(nnx.Module):
    """BatchNorm behind a flag of a name that training does not find."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(5, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x, is_training: bool = False):
        return self.out(self.norm(self.dense(x), use_running_average=not is_training))


def test_an_nnx_module_that_would_train_in_inference_mode_is_refused(data):
    net = _IsTrainingNnx(nnx.Rngs(0))
    with pytest.raises(
        sm.ConfigError,
        match=r"train\(_IsTrainingNnx\): a training call of _IsTrainingNnx \(its attributes as "
        r"module.train\(\) sets them\) updates none of its state \(norm/mean, norm/var\): every "
        r"step would run it in inference mode. If is_training is its mode, name it: "
        r"train\(\.\.\., train_flags=\{'is_training': True\}, eval_flags=\{'is_training': False",
    ):
        sm.training.train(net, data, epochs=1)
    both = {"is_training": True}
    with pytest.raises(
        sm.ConfigError, match=r"inference call .*is_training=True\) updates norm/mean, norm/var"
    ):
        sm.training.train(net, data, epochs=1, train_flags=both, eval_flags=both)
    flags = {"train_flags": both, "eval_flags": {"is_training": False}}
    run = sm.training.train(net, data, epochs=2, **flags)
    assert float(jnp.abs(run.model_state["norm"]["mean"]).max()) > 1e-3


def test_train_refuses_what_is_not_a_flax_module_and_says_what_to_write():
    with pytest.raises(sm.ConfigError, match=r"flax\.linen or nnx module; got a function.*apply"):
        sm.training.train(lambda x: x, epochs=1)


@pytest.mark.parametrize("case", [c for c in CLASSIFIERS if c.kind == "nnx"], ids=lambda c: c.name)
def test_an_nnx_step_shards_over_8_devices_as_it_runs_on_one(case):
    """sm.training.shard_step of an nnx module's step: BatchNorm's statistics over the whole
    batch and the same Dropout mask, so params and state equal one device's."""
    module, opt = _module(case), optax.sgd(0.1)
    x = jax.random.normal(jax.random.key(1), (16, 5))
    y, w = jnp.arange(16) % 3, jnp.ones(16)
    steps = {
        "one": jax.jit(sm.training.train_step(module, opt)),
        "eight": sm.training.shard_step(sm.training.train_step(module, opt), sm.data_mesh(8)),
    }
    runs = {}
    for name, step in steps.items():
        params = sm.training.init_params(module, jax.random.key(0), x[:1])
        opt_state = opt.init(getattr(params, "params", params))  # a ModelVars' trainable part
        for _ in range(3):
            params, opt_state, metrics = step(params, opt_state, x, y, w)
        runs[name] = (_leaves(params), float(metrics["loss"]))
    (one, loss_one), (eight, loss_eight) = runs["one"], runs["eight"]
    assert loss_eight == pytest.approx(loss_one, rel=1e-5)
    for a, b in zip(one, eight, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


class _TrainsByDefault(nnx.Module):
    """Its __call__ trains unless told otherwise: train=True is its default."""

    def __init__(self, rngs):
        self.lin, self.out = nnx.Linear(5, 8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)

    def __call__(self, x, train: bool = True):
        return self.out(self.norm(self.lin(x), use_running_average=not train))


def test_an_nnx_module_whose_call_trains_by_default_trains(data):
    """train() found its flag (train=True for steps, train=False for inference) and checked it,
    then worked the spec out again without the inference flags and refused the module, telling
    the user to pass the eval_flags={'train': False} that changed nothing."""
    module = _TrainsByDefault(nnx.Rngs(0))
    result = sm.training.train(module, data, learning_rate=1e-2, epochs=3, batch_size=16)
    assert result.eval_flags == {"train": False} and result.test_accuracy > 0.5
    stats = nnx.state(result.model, nnx.BatchStat)
    assert not np.allclose(jax.tree.leaves(stats)[0], 0.0)  # its steps moved the mean
