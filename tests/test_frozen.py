"""Frozen params, as flax's and equinox's docs freeze them: train(wrt=...) against the nnx
optimization cookbook's ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)`` and linen's optax loop
(``optax.multi_transform`` with ``optax.set_to_zero()``); and a Batcher of a model whose params
fix its rows (transforms.md's WeightStack, one ensemble member per row)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo4
from flax import nnx

import symjax_mlp as sm

TOL = {"rtol": 2e-5, "atol": 2e-6}


def _data():
    """32 rows of 2 features, 8 classes: one full batch per epoch (its order shuffled)."""
    x = np.random.default_rng(0).normal(size=(32, 2)).astype(np.float32)
    y = np.arange(32) % 8
    return sm.training.Dataset(x, y, x, y, 8)


def _xent(logits, y):  # train()'s loss on a batch of no padding
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _leaves(tree):
    return {
        jax.tree_util.keystr(p): np.asarray(a) for p, a in jax.tree_util.tree_leaves_with_path(tree)
    }


class _Head(nn.Module):  # a base to freeze, a head to train
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="head")(nn.relu(nn.Dense(8, name="base")(x)))


@pytest.mark.slow  # four runs of train() (7 s)
def test_an_nnx_lora_model_trains_its_lora_params_only_as_the_cookbooks_optimizer(tmp_path):
    """train(lora_model, wrt=nnx.LoRAParam): the base's params bitwise as built, the LoRA
    params as the cookbook's ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)`` loop trains them
    (its grads ``nnx.DiffState(0, nnx.LoRAParam)``); its optimizer state the LoRA params' only;
    a resumed run continues it bitwise; one of another wrt is refused, the checkpoint named."""
    data, steps = _data(), 3
    model = zoo4.lora_model(nnx.Rngs(1))
    built = _leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    run = {"optimizer": optax.adam(1e-2), "batch_size": 32}
    got = sm.training.train(model, data, wrt=nnx.LoRAParam, epochs=steps, **run)

    theirs = zoo4.lora_model(nnx.Rngs(1))
    optimizer = nnx.Optimizer(theirs, optax.adam(1e-2), wrt=nnx.LoRAParam)
    diff = nnx.DiffState(0, nnx.LoRAParam)
    for _ in range(steps):
        grads = nnx.grad(lambda m: _xent(m(data.x_train), data.y_train), argnums=diff)(theirs)
        optimizer.update(theirs, grads)
    want = _leaves(nnx.to_pure_dict(nnx.state(theirs, nnx.Param)))
    for path, a in _leaves(got.params).items():
        if "lora" in path:
            assert not np.array_equal(a, built[path]), path
            np.testing.assert_allclose(a, want[path], **TOL, err_msg=path)
        else:
            np.testing.assert_array_equal(a, built[path], err_msg=path)  # bitwise
    moments = got.opt_state.inner_states["trained"].inner_state[0].mu
    assert sorted(_leaves(moments)) == sorted(p for p in built if "lora" in p)

    sm.training.train(zoo4.lora_model(nnx.Rngs(1)), data, wrt=nnx.LoRAParam, epochs=2,
                      checkpoint=tmp_path, **run)  # fmt: skip
    resumed = sm.training.train(zoo4.lora_model(nnx.Rngs(1)), data, wrt=nnx.LoRAParam,
                                epochs=steps, checkpoint=tmp_path, resume=True, **run)  # fmt: skip
    assert resumed.resumed_from is not None
    for path, a in _leaves(resumed.params).items():
        np.testing.assert_array_equal(a, _leaves(got.params)[path], err_msg=path)
    with pytest.raises(sm.CheckpointError, match="does not fit this model and optimizer"):
        sm.training.train(zoo4.lora_model(nnx.Rngs(1)), data, wrt=nnx.PathContains("lora_a"),
                          epochs=steps, checkpoint=tmp_path, resume=True, **run)  # fmt: skip


@pytest.mark.slow  # two runs of train() (3 s)
def test_a_linen_head_trains_as_its_optax_loop_and_multi_transform_works_as_wrt():
    """A linen model's wrt, a function of each param's path: its base bitwise as initialised,
    its head as linen's own loop trains it (optax.multi_transform of adam and set_to_zero by a
    label function over the params' names); that very optimizer given to train() (its params a
    dict of the names, as model.init gives them) trains bitwise as wrt= does."""
    data, steps = _data(), 3
    tx = optax.adam(1e-2)
    got = sm.training.train(_Head(), data, optimizer=tx, wrt=lambda path, _: path[0] == "head",
                            epochs=steps, batch_size=32)  # fmt: skip

    def labels(params):  # the way linen's users freeze: a label by each param's path
        return jax.tree_util.tree_map_with_path(
            lambda p, _: "frozen" if p[0].key == "base" else "train", params
        )

    theirs = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)
    key = jax.random.split(jax.random.key(0))[1]  # train()'s init key of seed=0
    params = _Head().init(key, data.x_train[:1])["params"]
    initial, state = params, theirs.init(params)

    def loss(p):
        return _xent(_Head().apply({"params": p}, data.x_train), data.y_train)

    for _ in range(steps):
        grads = jax.grad(loss)(params)
        updates, state = theirs.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(got.params["head"]["kernel"], params["head"]["kernel"], **TOL)
    np.testing.assert_allclose(got.params["head"]["bias"], params["head"]["bias"], **TOL)
    for name in ("kernel", "bias"):
        np.testing.assert_array_equal(got.params["base"][name], initial["base"][name])
    same = sm.training.train(_Head(), data, optimizer=theirs, epochs=steps, batch_size=32)
    for path, a in _leaves(same.params).items():
        np.testing.assert_array_equal(a, _leaves(got.params)[path], err_msg=path)


@pytest.mark.slow  # train()'s checks up to the optimizer (0.1 s warm, 0.9 s alone)
def test_a_wrt_that_selects_no_param_or_is_no_filter_is_refused_naming_the_params():
    """nnx.LoRAParam of a linen model (its params are arrays, no Variables) selects nothing:
    every step would leave the model as it is; refused before any step, naming its params'
    paths and a filter that selects. An int is no filter: refused naming what is."""
    data = _data()
    with pytest.raises(sm.ConfigError) as e:
        sm.training.train(_Head(), data, wrt=nnx.LoRAParam, epochs=1, batch_size=32)
    assert "selects none of the 4 params of _Head (base/bias, base/kernel, head/bias, " in str(
        e.value
    )
    assert "lambda path, _: path[0] == 'head'" in str(e.value)
    with pytest.raises(sm.ConfigError, match=r"wrt must be an nnx filter .*got 3 "):
        sm.training.train(_Head(), data, wrt=3, epochs=1, batch_size=32)


@pytest.mark.slow  # the nnx module's spec and params (0.9 s)
def test_labels_of_an_nnx_state_are_refused_with_the_tree_the_optimizer_gets_and_wrt():
    """The nnx way to label params, nnx.map_state over nnx.state(model, nnx.Param), gives an
    nnx.State; train() passes the optimizer the params as a dict (nnx.to_pure_dict's), so
    optax.multi_transform's init raised a pytree structure error naming 'use an optimizer that
    takes them'; now noted with the tree it gets, why a type test never holds, and wrt=."""
    model = zoo4.lora_model(nnx.Rngs(1))
    labels = nnx.map_state(
        lambda _, v: "lora" if isinstance(v, nnx.LoRAParam) else "frozen",
        nnx.state(model, nnx.Param),
    )
    tx = optax.multi_transform({"lora": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)
    with pytest.raises(sm.ConfigError, match=r"optimizer\.init\(params\) raised ValueError") as e:
        sm.training.train(model, _data(), optimizer=tx, epochs=1, batch_size=32)
    assert e.value.__notes__ == [
        "symjax_mlp.training.train: an nnx module's params reach the optimizer as "
        "nnx.to_pure_dict(nnx.state(model, nnx.Param)) gives them, a dict of arrays by path: no "
        "nnx.State (labels made by nnx.map_state do not fit it) and no Variable types (a label "
        "function's isinstance(v, nnx.LoRAParam) is never true). To train some params only, "
        "pass wrt= an nnx filter: train(model, data, optimizer=tx, wrt=nnx.LoRAParam)."
    ]


@pytest.mark.slow  # two runs of train() (2 s)
def test_a_first_epoch_that_moves_no_param_is_warned_and_one_that_moves_any_is_not():
    """A label function testing isinstance(v, nnx.LoRAParam) gets plain arrays, so
    optax.multi_transform froze every param and train() trained nothing, in silence: after the
    first epoch, every param bitwise as built, a RuntimeWarning says so and names wrt=. Labels
    by path that train the head: no warning (warnings are errors here)."""
    model = zoo4.lora_model(nnx.Rngs(1))
    frozen = optax.multi_transform(
        {"lora": optax.adam(1e-2), "frozen": optax.set_to_zero()},
        lambda params: jax.tree.map(
            lambda v: "lora" if isinstance(v, nnx.LoRAParam) else "frozen", params
        ),
    )
    with pytest.warns(RuntimeWarning, match=r"after epoch 1 \(1 steps\) every param is bitwise"):
        got = sm.training.train(model, _data(), optimizer=frozen, epochs=2, batch_size=32)
    built = _leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    trained = _leaves(got.params)
    assert trained.keys() == built.keys()
    for k, a in built.items():
        np.testing.assert_array_equal(trained[k], a, err_msg=k)
    head = optax.multi_transform(
        {"train": optax.adam(1e-2), "frozen": optax.set_to_zero()},
        lambda params: jax.tree_util.tree_map_with_path(
            lambda path, _: "train" if path[0].key == "head" else "frozen", params
        ),
    )
    sm.training.train(_Head(), _data(), optimizer=head, epochs=2, batch_size=32)


def test_export_and_the_batcher_tell_an_ensemble_by_one_predicate():
    """Export's refusal of an ensemble's batch and a Batcher's of its fixed rows each tested
    "every param leads with the example's rows" (two copies, one of them raising IndexError for
    no rows); one predicate now, naming the first member, and no rows is no ensemble."""
    from symjax_mlp._specs import ensemble_member

    assert ensemble_member({"bias": (4, 3), "kernel": (4, 2, 3)}, (4,)) == ("bias", (4, 3))
    assert ensemble_member({"bias": (4, 3), "kernel": (2, 3)}, (4,)) is None
    assert ensemble_member({}, (4,)) is None and ensemble_member({"scale": ()}, ()) is None


@pytest.mark.slow  # nnx.vmap's init and a Batcher's warm-up (0.6 to 1 s)
def test_a_batcher_of_an_ensemble_names_its_fixed_rows_and_serves_it_vmapped_as_it_says():
    """WeightStack (a member per row, every param leading with 4): a Batcher of its Hybrid
    raised JAX's 'vmap got inconsistent sizes' warming up on a batch of 1 row; now a ConfigError
    naming the 4 rows, a param and the buckets, with the fix it names, which serves it."""
    h = sm.hybridize(zoo4.WeightStack(jnp.arange(4)))
    x = np.ones((4, 2), np.float32)
    with pytest.raises(sm.ConfigError) as e:
        sm.serving.Batcher(h, example=x, max_batch=4)
    assert str(e.value).startswith(
        "Batcher(WeightStack): the model raised warming up on a batch of 1 rows (zeros), and "
        "every param leads with the example's 4 rows (bias: (4, 3))"
    )
    assert "batches of (1, 2, 4) rows" in str(e.value)
    assert "Batcher(jax.vmap(h), example=x[None])" in str(e.value)  # as it says:
    xs = np.stack([x, 2 * x, -x])
    with sm.serving.Batcher(jax.vmap(h), example=x[None], max_batch=4) as b:
        np.testing.assert_allclose(b(xs), jax.vmap(h)(xs), **TOL)
        np.testing.assert_allclose(b(xs[1:2])[0], h(xs[1]), **TOL)


@pytest.mark.slow  # three eager steps, twice (4 s)
def test_an_equinox_model_freezes_over_apply_as_equinoxs_frozen_layer_recipe():
    """train() takes flax models only (its error names a loop over h.apply); an equinox model
    freezes there as equinox's frozen_layer example does, its filter spec built by eqx.tree_at
    on h.params (the model's arrays, as an eqx module): the frozen leaves bitwise as built, the
    rest as equinox's own loop trains them."""
    import equinox as eqx

    model = eqx.nn.MLP(2, 3, 8, 2, key=jax.random.key(0))
    x, y, tx = jnp.ones((5, 2)), jnp.arange(5) % 3, optax.adam(1e-2)

    def last_layer(tree):  # frozen_layer.ipynb's filter_spec: only the last layer trains
        spec = jax.tree.map(lambda _: False, tree)
        layer = lambda t: (t.layers[-1].weight, t.layers[-1].bias)  # noqa: E731
        return eqx.tree_at(layer, spec, replace=(True, True))

    def frozen_loop(tree, call):  # its steps, as the example writes them, over call(tree, x)
        spec, state = last_layer(tree), tx.init(eqx.filter(tree, last_layer(tree)))
        for _ in range(3):
            diff, static = eqx.partition(tree, spec)
            grads = jax.grad(lambda d, s=static: _xent(call(eqx.combine(d, s), x), y))(diff)
            updates, state = tx.update(grads, state)
            tree = eqx.apply_updates(tree, updates)
        return tree, spec

    h = sm.hybridize(model)  # one example, as eqx.nn layers take it
    params, spec = frozen_loop(h.params, jax.vmap(h.apply, (None, 0)))
    theirs, _ = frozen_loop(model, lambda m, x: jax.vmap(m)(x))
    kept = [eqx.filter(t, spec, inverse=True) for t in (params, h.params)]
    for a, b in zip(*map(jax.tree.leaves, kept), strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise
    np.testing.assert_allclose(jax.vmap(h.replace(params=params))(x), jax.vmap(theirs)(x), **TOL)
    with pytest.raises(sm.ConfigError, match=r"must be a flax\.linen or nnx module.*h\.apply"):
        sm.training.train(model, _data(), epochs=1)
