"""Code we did not write, round fourteen: optax's own examples and docs (tests/zoo14.py;
sources and commits there), each optimizer built as its authors build it, trained by
``sm.training.train`` and checked against the example's own loop, checkpointed halfway and
resumed (bitwise the uninterrupted run), exported and loaded.

- reduce_on_plateau.ipynb: the ``MLP`` by ``train()`` is the notebook's ``train_step`` loop.
- sam.ipynb: ``contrib.sam`` (and ``sam_mom``, ``sam_adam``), whose update takes no
  ``value=``: it was refused as an optimizer needing more arguments.
- schedule_free_adamw's docstring: the trained model is ``schedule_free_eval_params`` of the
  run (it was the ``y`` sequence the gradients are taken at, evaluated and exported as such).
- gradient_accumulation.ipynb: ``optax.MultiSteps`` over three batches is one batch's step; a
  first epoch shorter than its ``every_k_schedule`` was warned of as "the optimizer updated
  none".
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo14
from features import close
from flax import nnx

import symjax_mlp as sm

N = 48  # training examples: one full batch a step, so each epoch is one step


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(14)
    w = rng.standard_normal((zoo14.FEATURES, zoo14.NUM_CLASSES)).astype(np.float32)
    x = rng.standard_normal((N + 24, zoo14.FEATURES)).astype(np.float32)
    y = np.argmax(x @ w, axis=-1).astype(np.int32)
    return sm.training.Dataset(x[:N], y[:N], x[N:], y[N:], zoo14.NUM_CLASSES, "optax")


def _init(data):
    """``train()``'s initial params of the notebook's MLP (seed 0)."""
    key = jax.random.split(jax.random.key(0))[1]
    return zoo14.net.init(key, data.x_train[:1])["params"]


def _leaves(tree):
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


def _train(data, tx, epochs, **kw):
    return sm.training.train(zoo14.net, data, optimizer=tx, epochs=epochs, batch_size=N, **kw)


@pytest.mark.slow  # it trains: a compile or more
def test_reduce_on_plateau_trains_as_the_notebooks_train_step(data):
    params, batch = _init(data), (data.x_train, data.y_train)
    opt_state, step = zoo14.opt.init(params), zoo14.make_train_step(zoo14.opt)
    for _ in range(5):
        params, opt_state, _, _ = step(params, opt_state, batch)
    run = _train(data, zoo14.opt, 5)
    close(run.params, params)
    close(run.opt_state, opt_state)


@pytest.mark.slow
@pytest.mark.parametrize(
    "build", [lambda: zoo14.sam_opt, zoo14.sam_mom, zoo14.sam_adam], ids=["sam", "mom", "adam"]
)
def test_sam_trains_as_the_notebooks_make_step(build, data):
    """sam's update takes no value=: train() passed it one, and refused the optimizer."""
    sam = build()

    def loss(p):
        return zoo14.loss_accuracy(p, (data.x_train, data.y_train))[0]

    store, step = zoo14.Store(_init(data), sam.init(_init(data))), zoo14.make_step(sam, loss)
    for _ in range(4):
        store, _ = step(store)
    run = _train(data, sam, 4)
    close(run.params, store.params)


@pytest.mark.slow  # it trains: a compile or more
def test_a_schedule_free_run_is_evaluated_and_exported_at_its_eval_params(data, tmp_path):
    """train() evaluated and exported schedule-free's y (where gradients are taken), not the
    x that schedule_free_eval_params gives, as the optax docstring's loop evaluates."""
    solver = optax.contrib.schedule_free_adamw(1.0)

    def f(p):
        return zoo14.loss_accuracy(p, (data.x_train, data.y_train))[0]

    y, x, _ = zoo14.schedule_free_run(solver, f, _init(data), 3)
    assert not all(map(np.allclose, _leaves(x), _leaves(y)))  # they differ
    run = _train(data, solver, 3)
    close(run.params, x)
    logits = zoo14.net.apply({"params": x}, data.x_test)
    accuracy = np.mean(np.argmax(np.asarray(logits), -1) == data.y_test)
    assert run.test_accuracy == run.history[-1].test_accuracy == pytest.approx(accuracy)
    loaded = sm.load(run.export(tmp_path / "sf").path)
    close(loaded(data.x_test), logits)


@pytest.mark.slow  # it trains: a compile or more
def test_gradient_accumulation_is_one_batch_and_its_first_epochs_are_not_warned_of(data):
    """MultiSteps(every_k_schedule=3) over three batches of a third is the notebook's one batch;
    its first epochs (fewer steps than 3) moved nothing, warned of as a frozen optimizer."""
    nine = sm.training.Dataset(data.x_train[:9], data.y_train[:9], data.x_test, data.y_test, 3)
    batch = {"image": jnp.asarray(nine.x_train), "label": jnp.asarray(nine.y_train)}
    single = zoo14.NnxMLP(nnx.Rngs(0))
    zoo14.fit(single, nnx.Optimizer(single, optax.sgd(1e-1), wrt=nnx.Param), [batch])
    tx = zoo14.accumulating(optax.sgd(1e-1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        thirds = sm.training.train(zoo14.NnxMLP(nnx.Rngs(0)), nine, optimizer=tx, batch_size=3,
                                   epochs=1)  # fmt: skip
        ones = sm.training.train(zoo14.NnxMLP(nnx.Rngs(0)), nine, optimizer=tx, batch_size=9,
                                 epochs=3)  # fmt: skip
    want = nnx.state(single, nnx.Param)
    close(nnx.state(thirds.model, nnx.Param), want, atol=1e-6, rtol=1e-5)
    close(nnx.state(ones.model, nnx.Param), want, atol=1e-6, rtol=1e-5)


EXAMPLES = {
    "reduce_on_plateau": lambda: zoo14.opt,
    "sam_adam": zoo14.sam_adam,
    "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(1e-2),
    "multi_steps": lambda: zoo14.accumulating(optax.adam(1e-2)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_each_example_optimizer_resumes_bitwise_and_ships(name, data, tmp_path):
    tx = EXAMPLES[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        run = _train(data, tx, 6)
        ckpt = tmp_path / "ckpt"
        _train(data, tx, 3, checkpoint=ckpt)
        resumed = _train(data, tx, 6, checkpoint=ckpt, resume=True)
    assert resumed.resumed_from is not None
    assert all(map(np.array_equal, _leaves(resumed.params), _leaves(run.params)))
    assert all(map(np.array_equal, _leaves(resumed.opt_state), _leaves(run.opt_state)))
    loaded = sm.load(run.export(tmp_path / "art").path)
    close(loaded(data.x_test), zoo14.net.apply({"params": run.params}, data.x_test))
    predicted = np.argmax(np.asarray(loaded(data.x_test)), -1)
    assert np.mean(predicted == data.y_test) == pytest.approx(run.test_accuracy, abs=1e-9)


REFUSED = {  # each refused before the first step, naming what works instead
    "lookahead": (lambda: zoo14.solver, r"(?s)'fast'.*LookaheadParams.*lookahead_mnist"),
    "dpsgd": (zoo14.dp_tx, r"(?s)per-example gradients.*differentially_private_sgd example"),
    "sophia": (lambda: optax.contrib.sophia(1e-2), r"(?s)obj_fn.*obj_fn=loss"),
}


@pytest.mark.slow  # the first pays train()'s compile of the model's init: ~1 s
@pytest.mark.parametrize("name", REFUSED)
def test_an_optimizer_the_step_cannot_feed_is_refused_naming_what_works(name, data):
    """lookahead_mnist's solver updates LookaheadParams, dpsgd per-example gradients, sophia
    calls obj_fn=: each refusal said 'fix the optimizer, or pass optax.adam'."""
    build, said = REFUSED[name]
    with pytest.raises(sm.ConfigError, match=said):
        _train(data, build(), 1)


@pytest.mark.slow
def test_dpsgd_runs_in_the_notebooks_loop_over_h_apply(data, tmp_path):
    """The loop dpsgd's refusal names runs over a Hybrid's h.apply as over the stax predict,
    and the trained model exports."""
    _, params = zoo14.init_random_params(jax.random.PRNGKey(1337), (-1, *zoo14.DP_IMG))
    h = sm.hybridize(zoo14.predict, params)
    images = jnp.asarray(np.resize(data.x_train, (N, *zoo14.DP_IMG)))
    batch = (images, jnp.asarray(data.y_train))
    theirs, ours = (params, zoo14.dp_tx().init(params)), (h.params, zoo14.dp_tx().init(h.params))
    their_step = zoo14.make_dp_train_step(zoo14.dp_tx(), zoo14.predict)
    our_step = zoo14.make_dp_train_step(zoo14.dp_tx(), h.apply)
    for _ in range(3):
        theirs, ours = their_step(*theirs, batch), our_step(*ours, batch)
    close(ours[0], theirs[0])
    trained = h.replace(params=ours[0])
    sm.export(trained, tmp_path / "dp", example=(images[:2],), batch="b")
    loaded = sm.load(tmp_path / "dp", allow={"convolution", "reduce_window"})
    close(loaded(np.asarray(images[:5])), zoo14.predict(theirs[0], images[:5]))


@pytest.mark.slow
def test_a_checkpoint_of_another_value_taking_optimizer_is_refused(data, tmp_path):
    """reduce_on_plateau's update needs value=: the optimizer's fingerprint and the probe of its
    next update ran without it and measured nothing, so the notebook's checkpoint resumed under
    adam(0.1) in place of adam(0.01), silently."""
    _train(data, zoo14.opt, 2, checkpoint=tmp_path)
    plateau = optax.contrib.reduce_on_plateau(
        patience=zoo14.PATIENCE, cooldown=zoo14.COOLDOWN, factor=zoo14.FACTOR, rtol=zoo14.RTOL,
        accumulation_size=zoo14.ACCUMULATION_SIZE,
    )  # fmt: skip
    other = optax.chain(optax.adam(10 * zoo14.LEARNING_RATE), plateau)
    with pytest.raises(sm.CheckpointError, match="the optimizer: its kind, hyperparameters"):
        _train(data, other, 4, checkpoint=tmp_path, resume=True)  # its fingerprint runs value=


@pytest.mark.slow
def test_schedule_free_over_the_params_wrt_selects_is_evaluated_at_theirs(data):
    """With wrt=, schedule-free's state is in multi_transform's, a MaskedNode for each frozen
    param: the trained ones are evaluated at their eval params, the frozen ones as they were."""
    start, xy = _init(data), (data.x_train, data.y_train)
    labels = {k: jax.tree.map(lambda _, k=k: "on" if k == "Dense_2" else "off", v)
              for k, v in start.items()}  # fmt: skip
    free = {"on": optax.contrib.schedule_free_adamw(1e-2), "off": optax.set_to_zero()}
    loss = lambda p: zoo14.loss_accuracy(p, xy)[0]  # noqa: E731 - the docstring's f
    tx = optax.multi_transform(free, labels)
    y, state = start, tx.init(start)
    for _ in range(3):  # the docstring's loop, its eval params taken of the inner state below
        updates, state = tx.update(jax.grad(loss)(y), state, y)
        y = optax.apply_updates(y, updates)
    inner = state.inner_states["on"].inner_state  # z: a MaskedNode for each frozen param
    b1 = inner.b1
    x = jax.tree.map(lambda y, z: (y - (1.0 - b1) * z) / b1, y["Dense_2"], inner.z["Dense_2"])
    wrt = lambda p, _: p[0] == "Dense_2"  # noqa: E731
    run = _train(data, optax.contrib.schedule_free_adamw(1e-2), 3, wrt=wrt)
    close(run.params["Dense_2"], x)
    for frozen in ("Dense_0", "Dense_1"):
        assert all(map(np.array_equal, _leaves(run.params[frozen]), _leaves(start[frozen])))
