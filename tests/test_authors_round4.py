"""Code we did not write, round four: more of equinox's examples and flax's nnx guides, as
their authors wrote them (tests/zoo4.py, each headed by its source path and commit), run over
every feature test_authors_matrix.py runs over MATRIX (its test functions, called here), or as
its source runs where it fits none of the matrix's shapes.

- ``eqx_init_apply``: equinox docs/examples/init_apply.ipynb, ``apply_fn(params, x)`` of
  ``eqx.partition(mlp, eqx.is_inexact_array)``'s params (its static half ``None`` leaves).
- ``eqx_unet``: equinox docs/examples/unet.ipynb, a U-Net of ResnetBlocks, GroupNorms,
  strided and transposed convolutions, linear-time attention and Dropout, served by
  ``eqx.nn.inference_mode``.
- serialisation.ipynb's ``save``/``load`` (``eqx.tree_serialise_leaves`` after a json line)
  of a model trained over ``h.apply``.
- flax/linen/transforms.py's docstrings: ``linen_checkpoint`` (``nn.checkpoint``),
  ``linen_scan_lstm`` and ``linen_scan_lstm_fn`` (``nn.scan`` of an LSTMCell, as a module and
  as a function), ``linen_residual_scan`` (``nn.scan`` of stacked blocks), ``linen_remat_scan``
  (``nn.remat_scan``); and, as they run, ``nn.while_loop`` (its count carried in 'state'),
  ``nn.cond`` and ``nn.switch`` (a branch per call, counted), ``nn.switch`` over heads of other
  shapes (the index an input shared by every row), ``nn.custom_vjp`` (sign grads).
- ``nnx_cookbook``: flax docs_nnx/guides/optimization_cookbook.md's toy ``nnx.Sequential``;
  its recipes (LoRA by ``wrt=nnx.LoRAParam``, LBFGS, per-parameter rates, ``optax.MultiSteps``)
  as optax loops over ``h.apply``, and its ``nnx.EMA`` model exported after training.
- flax docs_nnx/guides/extracting_intermediates.md: ``nnx.capture`` of sown features
  hybridized as a function of the module (exported flattened), and its perturbation step.
- JAX examples/advi.py: its jitted ``objective(params, t)`` of a seed, trained by its
  ``update`` loop (example_libraries' momentum) over ``h.apply``, exported whole and per seed.
- flax docs_nnx/guides/transforms.md: ``WeightStack`` (``nnx.vmap`` of ``__init__`` and
  ``__call__``: a member per row) and ``noisy_vector_dot`` (``nnx.split_rngs(splits=4)`` over
  an ``nnx.vmap`` of ``nnx.StateAxes``: a count and a noise stream carried across calls).
"""

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
import test_authors_nnx3 as nnx3
import zoo4
from flax import nnx
from helpers import Case, _x, keyless
from test_authors_matrix import exported, loaded  # noqa: F401 - the matrix's fixtures

import symjax_mlp as sm

TOL = {"rtol": 2e-5, "atol": 2e-5}


def _init_apply():
    init_fn, apply_fn = zoo4.make_mlp(in_size=2, out_size=1, width_size=8, depth=1,
                                      key=jr.PRNGKey(5678))  # fmt: skip
    return zoo4.mlp_batch(apply_fn), init_fn()


def _unet_inputs(seed: int) -> tuple[jax.Array, jax.Array]:
    """(t, y): a time in [0, 1) per image, and (4, 1, 8, 8) images."""
    return jr.uniform(jr.key(seed + 9), (4,)), _x(seed, (4, 1, 8, 8))


def _linen(model, *example):
    """``(model, variables)``: the docstring's ``model.init(jax.random.key(0), x)``."""
    return lambda: (model, model.init(jax.random.key(0), *example))


CASES = (
    Case("eqx_init_apply", "eqx", _init_apply, lambda s: (_x(s, (4, 2)),)),
    Case("nnx_cookbook", "nnx", lambda: (zoo4.make_model(nnx.Rngs(0)), None),
         lambda s: (_x(s, (4, 2)),), classes=8),
    Case("linen_checkpoint", "linen", _linen(zoo4.CheckpointedMLP(), jnp.ones((1, 16))),
         lambda s: (_x(s, (4, 16)),)),
    Case("linen_scan_lstm", "linen", _linen(zoo4.LSTM(4), jnp.ones((2, 5, 3))),
         lambda s: (_x(s, (2, 5, 3)),),
         allow=frozenset({"dynamic_update_slice", "real_dynamic_slice"})),
    Case("linen_scan_lstm_fn", "linen", _linen(zoo4.FunctionalLSTM(4), jnp.ones((2, 5, 3))),
         lambda s: (_x(s, (2, 5, 3)),),
         allow=frozenset({"dynamic_update_slice", "real_dynamic_slice"})),
    Case("linen_residual_scan", "linen", _linen(zoo4.ResidualMLP(4), jnp.ones((1, 2))),
         lambda s: (_x(s, (4, 2)),), classes=2,
         allow=frozenset({"dynamic_slice", "dynamic_update_slice", "real_dynamic_slice"})),
    Case("linen_remat_scan", "linen", _linen(zoo4.BigModel(), jnp.ones((1, 8))),
         lambda s: (_x(s, (4, 8)),), classes=8,
         allow=frozenset({"dynamic_slice", "dynamic_update_slice", "real_dynamic_slice"})),
    Case("eqx_unet", "eqx", lambda: (zoo4.unet_batch, zoo4.unet()), _unet_inputs,
         train={"key": jr.key(1)},
         served=lambda: (zoo4.unet_batch, eqx.nn.inference_mode(zoo4.unet())),
         allow=frozenset({"convolution", "real_dynamic_slice"})),
)  # fmt: skip


@pytest.mark.slow  # eqx_unet: 2 minutes (its eager calls, op by op)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_matrix_feature(case, exported, loaded, tmp_path, monkeypatch):  # noqa: F811
    """Each feature test_authors_matrix.py runs over MATRIX, as round three runs them."""
    nnx3.test_every_matrix_feature(case, exported, loaded, tmp_path, monkeypatch)


def _close(a, b):
    chex.assert_trees_all_close(a, b, **TOL)


# -- init_apply.ipynb's main(), as it runs: one example, int features, "SGD" by tree_map --------
@pytest.mark.slow
def test_init_apply_runs_as_its_main_and_exports_its_batched_apply(tmp_path):
    """``main(in_size=2)``: ``apply_fn(params, x)`` of ``x = jnp.arange(in_size)`` (int32, one
    example) equals the Hybrid's, before and after the notebook's "stochastic gradient
    descent" (``p + 1`` over every param, ``None`` leaves of the static half left alone); its
    export names the batched function (one example: the 2 features no batch), which exports
    with int inputs and loads equal."""
    init_fn, apply_fn = zoo4.make_mlp(in_size=2, out_size=1, width_size=8, depth=1,
                                      key=jr.PRNGKey(5678))  # fmt: skip
    x, params = jnp.arange(2), init_fn()
    h = sm.hybridize(apply_fn, params)
    y1 = h(x)
    _close(y1, apply_fn(params, x))
    params = jax.tree.map(lambda p: p + 1, params)  # "stochastic gradient descent"
    y2 = h.replace(params=jax.tree.map(lambda p: p + 1, h.params))(x)
    _close(y2, apply_fn(params, x))
    assert y1 != y2
    with pytest.raises(sm.SignatureError, match=r"one example of the model.*jax\.vmap for a f"):
        sm.export(h, tmp_path / "m", example=x)
    batched = sm.hybridize(zoo4.mlp_batch(apply_fn), params)  # as it says
    xs = jnp.arange(8).reshape(4, 2)
    sm.export(batched, tmp_path / "m", example=xs)
    m = sm.load(tmp_path / "m")
    assert m.signature.inputs[0].dtype == "int32"
    _close(m(np.asarray(xs[:3])), jax.vmap(apply_fn, in_axes=(None, 0))(params, xs[:3]))


# -- serialisation.ipynb's save/load of a model trained over h.apply ---------------------------
@pytest.mark.slow
def test_a_model_trained_over_apply_saves_and_loads_as_the_notebook_and_into_an_artifact(
    tmp_path,
):
    """Three adam steps over ``h.apply`` equal equinox's own (eqx.filter_grad); the trained
    model, ``eqx.combine`` d, saved by the notebook's ``save`` (a json line, then
    ``eqx.tree_serialise_leaves``) and read back by its ``load`` (a skeleton from ``make``)
    hybridizes equal, and its arrays are the params an artifact of the untrained model loads."""
    model = zoo4.make(key=jr.PRNGKey(0), **zoo4.hyperparameters)
    x, opt = _x(0, (4, 5)), optax.adam(1e-2)
    y = jnp.sin(x[:, :1])
    h = sm.hybridize(eqx.filter_vmap(model))
    params, state = h.params, opt.init(h.params)
    theirs, their_state = model, opt.init(eqx.filter(model, eqx.is_inexact_array))
    for _ in range(3):
        grads = jax.grad(lambda p: jnp.mean((h.apply(p, x) - y) ** 2))(params)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        grads = eqx.filter_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(theirs)
        updates, their_state = opt.update(grads, their_state)
        theirs = eqx.apply_updates(theirs, updates)
    _close(h.replace(params=params)(x), jax.vmap(theirs)(x))
    static = eqx.filter(eqx.filter_vmap(model), eqx.is_inexact_array, inverse=True)
    trained = eqx.combine(params, static).__wrapped__  # the MLP (filter_vmap wraps it)
    zoo4.save(tmp_path / "model.eqx", zoo4.hyperparameters, trained)
    newmodel = zoo4.load(tmp_path / "model.eqx")
    assert trained.layers[1].weight[2, 2] == newmodel.layers[1].weight[2, 2]  # as it checks
    _close(sm.hybridize(eqx.filter_vmap(newmodel))(x), jax.vmap(theirs)(x))
    sm.export(h, tmp_path / "m", example=x)  # untrained; the saved arrays given at load
    new = eqx.filter(eqx.filter_vmap(newmodel), eqx.is_inexact_array)
    m = sm.load(tmp_path / "m", params=new)
    _close(m(np.asarray(x)), jax.vmap(theirs)(x))


# -- transforms.md's WeightStack: a member per row, its output's batch on axis 1 ----------------
def _stack_loss(out, y):
    """Cross-entropy of WeightStack's (3, rows) output, its classes on axis 0."""
    return optax.softmax_cross_entropy_with_integer_labels(out.T, y).mean()


@pytest.mark.slow
def test_the_weight_stack_runs_differentiates_exports_and_trains_as_nnx(tmp_path):
    """``WeightStack(jnp.arange(4))(x)``, its params made by an ``nnx.vmap`` of ``__init__``
    and applied by one of ``__call__`` (``out_axes=1``): the Hybrid equals it, its grads
    ``nnx.grad``'s; export names its 4 members (batch=None exports, loaded under jax.vmap and
    jax.grad as the Hybrid); a Batcher refuses its output's batch on axis 1; train() raises
    vmap's ValueError on the one row it looks at, noted with a loop over h.apply, which trains
    as nnx.Optimizer does."""
    x, y = _x(1, (4, 2)), jnp.arange(4) % 3
    model = zoo4.WeightStack(jnp.arange(4))
    h = sm.hybridize(model)
    _close(h(x), model(x))
    got = jax.grad(lambda p: _stack_loss(h.apply(p, x), y))(h.params)
    want = nnx.grad(lambda m: _stack_loss(m(x), y))(model)
    _close(got, nnx.to_pure_dict(want))
    assert h.graph(x).primitive_counts["dot_general"] == 1
    with pytest.raises(sm.SignatureError, match=r"example's 4 rows \(bias: \(4, 3\)\).*batch=No"):
        sm.export(h, tmp_path / "m", example=x)
    sm.export(h, tmp_path / "m", example=x, batch=None, vjp_order=1)  # as it says
    m = sm.load(tmp_path / "m")
    xs = jnp.stack([x, _x(2, (4, 2))])
    _close(jax.vmap(m)(xs), jax.vmap(h)(xs))
    _close(jax.grad(lambda a: m(a).sum())(x), jax.grad(lambda a: h(a).sum())(x))
    with pytest.raises(sm.ConfigError, match=r"output out is of shape \(3, 4\) for a batch of 4"):
        sm.serving.Batcher(m, max_batch=4)
    data = sm.training.Dataset(np.asarray(x), np.asarray(y), np.asarray(x), np.asarray(y), 3)
    with pytest.raises(ValueError, match="vmap got inconsistent sizes") as e:
        sm.training.train(model, data, epochs=1, batch_size=4)
    assert any("a loop of your own over h.apply" in note for note in e.value.__notes__)

    opt = optax.adam(1e-2)  # as it says; against nnx.Optimizer's own step
    params, state = h.params, opt.init(h.params)
    optimizer = nnx.Optimizer(model, opt, wrt=nnx.Param)
    for _ in range(3):
        value, grads = jax.value_and_grad(lambda p: _stack_loss(h.apply(p, x), y))(params)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        want, grads = nnx.value_and_grad(lambda m: _stack_loss(m(x), y))(model)
        optimizer.update(model, grads)
        np.testing.assert_allclose(value, want, **TOL)
    _close(h.replace(params=params)(x), model(x))


@pytest.mark.slow  # its nnx.vmap'd init and train()'s look: 0.5 s
def test_a_model_raising_on_the_row_train_looks_at_is_noted_with_why_and_a_loop_over_apply():
    """train() looks at the model on one row: WeightStack's 4 members take none, and vmap's
    ValueError ('inconsistent sizes ... axis 0 of argument x of type float32[1,2]', a row never
    sent) came out of train() unexplained; now raised as it is (the model's own), noted with
    that row, why, and the loop that trains a model of fixed rows."""
    x, y = np.ones((4, 2), np.float32), np.arange(4) % 3
    data = sm.training.Dataset(x, y, x, y, 3)
    with pytest.raises(ValueError, match="vmap got inconsistent sizes") as e:
        sm.training.train(zoo4.WeightStack(jnp.arange(4)), data, epochs=1, batch_size=4)
    assert not isinstance(e.value, sm.SymjaxError)
    assert (
        "symjax_mlp.training.train(WeightStack): raised by the model on one row of x_train, "
        "shape (1, 2): train() looks at the model on one row, and trains it on batches of any "
        "size up to batch_size (the last one smaller). A model whose params fix its rows (an "
        "ensemble, one member per row: nnx.vmap or eqx.filter_vmap over stacked params) trains "
        "in a loop of your own over h.apply: h = sm.hybridize(model), jax.grad of your loss of "
        "h.apply(params, x), an optax update, h.replace(params=params)."
    ) in e.value.__notes__  # after JAX's own note on its filtered traceback


# -- transforms.md's noisy_vector_dot: nnx.split_rngs over an nnx.vmap of StateAxes ---------------
def keyed(weights, x, key):
    """The refusal's fix: the noise stream reseeded from a key input (raw key data)."""
    nnx.reseed(weights, noise=jax.random.wrap_key_data(key))
    return zoo4.noisy_vector_dot(weights, x)


@pytest.mark.slow
def test_noisy_vector_dot_carries_its_count_and_stream_and_exports_keyed(tmp_path):
    """Two calls of the guide's ``noisy_vector_dot(weights, x)`` (``y1 != y2``: the stream
    split anew) equal the Hybrid's, its Count and rng count carried as the guide's. Export
    names the 4 rows ``splits=4`` fixes, then (batch=None) the baked stream, naming
    ``nnx.reseed`` from a key input with shapes=('b, ...', None); that keyed function so
    exported was refused as taking a dimension as a Python number, naming the very same
    shapes= as the fix; now it names the 4 rows, and exports with batch=None, loaded equal
    under jax.grad."""
    x = _x(1, (4, 2))
    weights, theirs = zoo4.noisy_weights(), zoo4.noisy_weights()
    h = sm.hybridize(zoo4.noisy_vector_dot, weights)
    y1, y2 = zoo4.noisy_vector_dot(theirs, x), zoo4.noisy_vector_dot(theirs, x)
    assert not jnp.allclose(y1, y2)
    _close([h(x), h(x)], [y1, y2])
    _close(keyless(h.state), keyless(nnx.to_pure_dict(nnx.state(theirs, nnx.Not(nnx.Param)))))
    assert int(h.state["count"]) == 2
    with pytest.raises(sm.SignatureError, match=r"fixes its batch size to 4 rows.*batch=None"):
        sm.export(h, tmp_path / "m", example=x)  # splits=4: 4 rows
    with pytest.raises(sm.ConfigError, match=r"rng stream 'noise'.*nnx\.reseed\(model, noise="):
        sm.export(h, tmp_path / "m", example=x, batch=None)  # as it says
    key = jax.random.key_data(jax.random.key(7))
    h = sm.hybridize(keyed, zoo4.noisy_weights())  # as it says
    want = keyed(zoo4.noisy_weights(), x, key)
    _close(h(x, key), want)
    with pytest.raises(sm.SignatureError, match=r"fixes its batch size to 4 rows") as e:
        sm.export(h, tmp_path / "m", example=(x, key), shapes=("b, ...", None))
    assert "Keep only the batch symbolic" not in str(e.value)
    sm.export(h, tmp_path / "m", example=(x, key), batch=None, vjp_order=1)  # as it says
    m = sm.load(tmp_path / "m", allow={"scatter"})
    _close(m(np.asarray(x), np.asarray(key)), want)
    grad = jax.grad(lambda a: m(a, key).sum())(x)
    _close(grad, jax.grad(lambda a: keyed(zoo4.noisy_weights(), a, key).sum())(x))


# -- nn.while_loop's WhileLoopExample: its state counts the loop's steps across calls -------------
@pytest.mark.slow
def test_the_while_loop_counts_as_flax_and_exports_one_step_as_the_refusal_writes_it(tmp_path):
    """``apply(initial_vars, x, mutable=['state'])`` loops until acc is 10 (9 Dense more after
    init's one), the next call not at all: the Hybrid's two calls equal flax's, acc held; its
    grads are JAX's ValueError as flax's own (a while loop of a dynamic trip count); staging
    ``apply`` with flax's ``mutable=['state']`` was refused naming ``jnp.asarray`` of the names,
    now the tuple, which stages; export refuses the carried state naming one step as a function
    of it, which exports, loads (allow={'while'}) and runs equal."""
    model, x = zoo4.WhileLoopExample(), _x(0, (4, 2))
    initial_vars = model.init(jax.random.key(0), x)
    h = sm.hybridize(model, initial_vars)
    result, state = model.apply(initial_vars, x, mutable=["state"])
    again, _ = model.apply({**initial_vars, **state}, x, mutable=["state"])
    _close([h(x), h(x)], [result, again])
    _close(again, x)  # acc at 10: no step
    assert int(h.state["state"]["acc"]) == 10
    assert h.graph(x).primitive_counts["while"] == 1
    for grad in (lambda: jax.grad(lambda p: h.apply(p, x)[0].sum())(h.params),
                 lambda: jax.grad(lambda p: model.apply({**initial_vars, "params": p}, x,
                                                        mutable=["state"])[0].sum())(
                     initial_vars["params"])):  # fmt: skip
        with pytest.raises(ValueError, match="Reverse-mode differentiation does not work"):
            grad()
    with pytest.raises(sm.SignatureError, match=r"list of 1 name\(s\).*the tuple \('state',\)"):
        sm.stage(model.apply)(initial_vars, x, mutable=["state"])
    staged = sm.stage(model.apply)(initial_vars, x, mutable=("state",))  # as it says
    assert staged.primitive_counts["while"] == 1
    with pytest.raises(sm.ConfigError, match=r"writes the collection 'state'.*batch=None") as e:
        sm.export(h, tmp_path / "m", example=x)
    assert "jax.tree.flatten(variables['state'])" in str(e.value)
    variables = initial_vars  # as it says
    leaves, tree = jax.tree.flatten(variables["state"])
    step = sm.hybridize(
        lambda p, x, *state: (lambda out, new: (out, *jax.tree.leaves(new)))(
            *model.apply(
                {"params": p, "state": jax.tree.unflatten(tree, state)}, x, mutable=["state"]
            )
        ),
        variables["params"],
    )
    sm.export(step, tmp_path / "m", example=(x, *leaves), batch=None)
    m = sm.load(tmp_path / "m", allow={"while"})
    out, acc = m(np.asarray(x), *map(np.asarray, leaves))
    _close(out, result)
    assert int(acc) == 10


def test_a_list_of_names_given_as_a_call_input_is_refused_naming_the_tuple():
    """A list of strings is no array to make (its refusal named jnp.asarray of it): a list of
    names is a setting, as flax's mutable= is; the tuple it names is taken as one."""
    h = sm.hybridize(lambda p, x, names: x * p["w"] * len(names), {"w": jnp.float32(2)})
    with pytest.raises(sm.SignatureError) as e:
        h(jnp.ones(2), ["state", "cache"])
    assert str(e.value) == (
        "<lambda>: args[1] is a Python list of 2 name(s), but an input must be an array and a "
        "setting hashable, which a list is not. A list of names is a setting, as flax's "
        "mutable= is: pass the tuple ('state', 'cache')."
    )
    _close(h(jnp.ones(2), ("state", "cache")), jnp.full(2, 4.0))  # as it says


# -- nn.cond's CondExample and nn.switch's: a branch per call, its count in 'state' ---------------
@pytest.mark.slow
def test_cond_and_switch_branch_and_count_as_flax():
    """``CondExample()(x, pred)`` and ``SwitchExample()(x, index)``, the predicate and index
    arrays (traced, one program): each call's output and counts equal flax's, carried by
    hand; a Python ``True`` is a setting (a second trace)."""
    x = _x(0, (4, 3))
    for model, picks in ((zoo4.CondExample(), [True, False, True]),
                         (zoo4.SwitchExample(), [2, 0, 2, 1])):  # fmt: skip
        variables = model.init(jax.random.key(0), x, jnp.asarray(picks[0]))
        h, theirs = sm.hybridize(model, variables), variables
        for pick in picks:
            out, state = model.apply(theirs, x, jnp.asarray(pick), mutable=["state"])
            theirs = {**theirs, **state}
            _close(h(x, jnp.asarray(pick)), out)
            _close(h.state["state"], state["state"])
        assert h.trace_count == 1
    h = sm.hybridize(zoo4.CondExample(), zoo4.CondExample().init(jax.random.key(0), x, True))
    _close([h(x, True), h(x, False)], [h.eager(x, True), -h.eager(x, True)])
    assert h.trace_count == 2


# -- nn.switch's MultiHeadSwitchExample: heads of other shapes, the index an input --------------
@pytest.mark.slow
def test_the_multi_head_switch_exports_its_index_shared_by_every_row(tmp_path):
    """Its three heads, each run on init; the index an int input shared by the batch
    (shapes=('b, 3', None)): loaded, each head equals flax's; under jax.grad too; a Batcher
    refuses the shared scalar naming a function that closes over it, which serves."""
    model, x = zoo4.MultiHeadSwitchExample(), _x(0, (4, 3))
    variables = model.init(jax.random.key(0), x, 0)
    h = sm.hybridize(model, variables)
    sm.export(h, tmp_path / "m", example=(x, jnp.asarray(1)), shapes=("b, 3", None),
              vjp_order=1)  # fmt: skip
    m = sm.load(tmp_path / "m")
    for i in range(3):
        want = model.apply(variables, x[:3], jnp.asarray(i))
        _close(m(np.asarray(x[:3]), np.asarray(i, np.int32)), want)
        grad = jax.grad(lambda a, i=i: m(a, np.int32(i)).sum())(x)
        _close(grad, jax.grad(lambda a, i=i: model.apply(variables, a, jnp.asarray(i)).sum())(x))
    with pytest.raises(sm.ConfigError, match=r"args\[1\] is int32\[\], without the batch 'b'.*"
                       r"export a function that closes over it"):  # fmt: skip
        sm.serving.Batcher(m, max_batch=4)
    head = sm.hybridize(lambda v, x: model.apply(v, x, 2), variables)  # as it says
    sm.export(head, tmp_path / "head", example=x)
    with sm.serving.Batcher(sm.load(tmp_path / "head"), max_batch=4) as b:
        rows = [f.result(30) for f in [b.submit(np.asarray(x[i : i + 1])) for i in range(3)]]
    _close(np.concatenate(rows), model.apply(variables, x[:3], 2))


# -- nn.custom_vjp's Foo: sign gradients for its Dense ----------------------------------------
@pytest.mark.slow
def test_a_custom_vjp_gives_sign_grads_through_apply_and_trains_as_flax(tmp_path):
    """``jax.grad(Foo().apply)(variables, x)`` is the sign of the Dense's grads: through
    ``h.apply`` too, and three SGD steps over it equal flax's; exported (one example:
    batch=None) with its VJP, the loaded model's input grads equal flax's."""
    model, x = zoo4.Foo(), jnp.ones((2,))
    variables = model.init(jax.random.key(0), x)
    h = sm.hybridize(model, variables)
    _close(h(x), model.apply(variables, x))
    got, want = jax.grad(h.apply)(h.params, x), jax.grad(model.apply)(variables, x)
    _close(got, want)
    assert all(np.isin(np.asarray(g), (-1, 0, 1)).all() for g in jax.tree.leaves(got))
    opt, params, theirs = optax.sgd(0.1), h.params, variables
    state, their_state = opt.init(params), opt.init(theirs)
    for i in range(3):
        xi = _x(i, (2,))
        updates, state = opt.update(jax.grad(h.apply)(params, xi), state)
        params = optax.apply_updates(params, updates)
        updates, their_state = opt.update(jax.grad(model.apply)(theirs, xi), their_state)
        theirs = optax.apply_updates(theirs, updates)
    _close(params, theirs)
    sm.export(h.replace(params=params), tmp_path / "m", example=x, batch=None, vjp_order=1)
    m = sm.load(tmp_path / "m")
    _close(jax.grad(m)(x), jax.grad(lambda a: model.apply(theirs, a))(x))


@pytest.mark.slow  # four traces (1.5 s)
def test_shapes_of_only_the_batch_on_an_ensemble_name_its_members_not_the_same_shapes(tmp_path):
    """An ensemble (a member per row) with an input shared by every row, exported with only the
    batch symbolic: refused as taking a dimension as a Python number, naming these very
    shapes= as the fix; now naming its members' rows and batch=None, which exports."""
    h = sm.hybridize(lambda p, x, s: jax.vmap(lambda w, r: r @ w * s)(p["w"], x),
                     {"w": jnp.ones((4, 3, 2))})  # fmt: skip
    example = (jnp.ones((4, 3)), jnp.float32(2))
    with pytest.raises(sm.SignatureError) as e:
        sm.export(h, tmp_path / "m", example=example, shapes=("b, 3", None))
    assert "Every param's leading dimension is the example's 4 rows (w: (4, 3, 2))" in str(e.value)
    assert "Python number" not in str(e.value) and "batch=None" in str(e.value)
    sm.export(h, tmp_path / "m", example=example, batch=None)  # as it says
    _close(sm.load(tmp_path / "m")(*map(np.asarray, example)), jnp.full((4, 2), 6.0))


# -- optimization_cookbook.md's recipes, over h.apply, against its nnx.Optimizer loops ---------
def _cookbook_tx(recipe, labels):
    """The cookbook's optimizer for ``recipe``; ``labels`` its per-param rates' partition."""
    rates = {"kernel": optax.adam(1e-3), "bias": optax.adam(1e-2)}
    if recipe == "per_param":
        return optax.partition(rates, labels)
    if recipe == "multisteps":
        return optax.MultiSteps(optax.adam(1e-3), every_k_schedule=3)
    return optax.lbfgs(1e-3) if recipe == "lbfgs" else optax.adam(1e-3)


def _cookbook_theirs(recipe, x, y, steps):
    """The cookbook's own loop for ``recipe``, as written there (nnx.jit where it jits)."""
    model = (zoo4.lora_model if recipe == "lora" else zoo4.make_model)(nnx.Rngs(1))
    wrt = nnx.LoRAParam if recipe == "lora" else nnx.Param
    param_tys = nnx.map_state(lambda p, v: list(p)[-1], nnx.state(model, nnx.Param))
    optimizer = nnx.Optimizer(model, _cookbook_tx(recipe, param_tys), wrt=wrt)

    def train_step(model, optimizer, x, y):
        if recipe != "lbfgs":
            loss, grads = nnx.value_and_grad(zoo4.loss_fn, argnums=nnx.DiffState(0, wrt))(
                model, x, y
            )
            optimizer.update(model, grads)
            return loss
        graphdef = nnx.graphdef(model)  # Create state-based loss function for LBFGS
        loss_fn_state = lambda state: zoo4.loss_fn(nnx.merge(graphdef, state), x, y)  # noqa: E731
        loss, grads = nnx.value_and_grad(zoo4.loss_fn)(model, x, y)
        optimizer.update(model, grads, grad=grads, value=loss, value_fn=loss_fn_state)
        return loss

    step = train_step if recipe == "lbfgs" else nnx.jit(train_step)
    losses = [float(step(model, optimizer, x, y)) for _ in range(steps)]
    return model, losses


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["lora", "lbfgs", "per_param", "multisteps"])
def test_the_cookbooks_recipes_over_apply_train_as_its_nnx_optimizer(recipe):
    """Each recipe of optimization_cookbook.md as an optax loop over ``h.apply`` (its frozen
    base the params a ``set_to_zero`` partition holds still, LBFGS's line search calling
    h.apply through ``value_fn``, per-parameter rates partitioned by h.params' names, adam
    every 3 steps) gives the losses and the model its own ``nnx.Optimizer`` loop gives."""
    rngs = nnx.Rngs(0)
    x, y = rngs.normal((32, 2)), rngs.normal((32, 8))  # its fake data
    h = sm.hybridize((zoo4.lora_model if recipe == "lora" else zoo4.make_model)(nnx.Rngs(1)))
    names = jax.tree_util.tree_map_with_path(lambda p, _: p[-1].key, h.params)
    if recipe == "lora":  # what wrt=nnx.LoRAParam trains, the rest held still
        labels = jax.tree.map(lambda n: "lora" if n.startswith("lora") else "frozen", names)
        tx = optax.partition({"lora": _cookbook_tx("lora", None), "frozen": optax.set_to_zero()},
                             labels)  # fmt: skip
    else:
        tx = _cookbook_tx(recipe, names)

    def loss(p):
        return jnp.mean((h.apply(p, x) - y) ** 2)

    params, state, losses = h.params, tx.init(h.params), []
    for _ in range(4):
        value, grads = jax.value_and_grad(loss)(params)
        extra = {"value": value, "grad": grads, "value_fn": loss} if recipe == "lbfgs" else {}
        updates, state = tx.update(grads, state, params, **extra)
        params = optax.apply_updates(params, updates)
        losses.append(float(value))
    theirs, their_losses = _cookbook_theirs(recipe, x, y, 4)
    np.testing.assert_allclose(losses, their_losses, **TOL)
    _close(h.replace(params=params)(x), theirs(x))
    if recipe == "lora":  # its base as it was
        _close(params["layers"][0]["base_module"], h.params["layers"][0]["base_module"])


@pytest.mark.slow
def test_the_cookbooks_ema_model_exports_its_averages_once_hybridized_after_training(tmp_path):
    """``ema.apply_to(model)``, hybridized before the cookbook's steps (its ``ema.update``
    moves the averages in place): export refuses the stale params naming ``h.refresh()``;
    refreshed, it equals ``ema_model`` and its eval loss (its nnx.jit
    eval_step no training), exported too."""
    rngs = nnx.Rngs(0)
    x, y = rngs.normal((32, 2)), rngs.normal((32, 8))
    model = zoo4.make_model(nnx.Rngs(1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    ema = nnx.EMA(model, decay=0.9)
    ema_model = ema.apply_to(model)
    early = sm.hybridize(ema_model)

    @nnx.jit
    def train_step(model, optimizer, ema, x, y):
        loss, grads = nnx.value_and_grad(zoo4.loss_fn)(model, x, y)  # noqa: RUF059 (as written)
        optimizer.update(model, grads)
        ema.update(model)

    @nnx.jit
    def eval_step(model, x, y):
        return zoo4.loss_fn(model, x, y)

    for _ in range(3):
        train_step(model, optimizer, ema, x, y)
    with pytest.raises(sm.ConfigError, match=r"trained in place since sm\.hybridize.*"
                       r"Take the module as it is now: h = h\.refresh\(\)"):  # fmt: skip
        sm.export(early, tmp_path / "m", example=x)
    h = early.refresh()  # as it says
    _close(h(x), ema_model(x))
    np.testing.assert_allclose(zoo4.loss_fn(h, x, y), eval_step(ema_model, x, y), **TOL)
    sm.export(h, tmp_path / "m", example=x)
    _close(sm.load(tmp_path / "m")(np.asarray(x)), ema_model(x))


@pytest.mark.slow  # nnx.jit, an export: 1.4 s
def test_an_nnx_jit_eval_step_is_no_training_in_place_to_export(tmp_path):
    """The cookbook's ``eval_step`` (an nnx.jit of the loss) writes the module's Params back as
    new arrays of the same values: export refused the Hybrid as 'trained in place since
    sm.hybridize', naming a fix it did not need; an optimizer's step still is refused."""
    model, x = zoo4.make_model(nnx.Rngs(1)), jnp.ones((4, 2))
    h = sm.hybridize(model)
    nnx.jit(zoo4.loss_fn)(model, x, jnp.ones((4, 8)))  # the cookbook's eval_step
    sm.export(h, tmp_path / "m", example=x)
    _close(sm.load(tmp_path / "m")(np.asarray(x)), model(x))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    optimizer.update(model, nnx.grad(zoo4.loss_fn)(model, x, jnp.ones((4, 8))))
    with pytest.raises(sm.ConfigError, match=r"trained in place since sm\.hybridize"):
        sm.export(h, tmp_path / "n", example=x)


# -- JAX's advi.py: its jitted objective of a seed, trained by example_libraries' momentum ---------
@pytest.mark.slow
def test_advi_trains_as_its_main_loop_and_serves_its_objective_per_seed(tmp_path):
    """``objective(params, t)`` (jitted as written, its seed ``random.key(t)``) hybridized with
    the variational params: equal for an int32 seed; five steps of its ``update`` loop (momentum
    of ``grad(objective)``) over ``h.apply`` give its params; exported whole (a scalar seed:
    shapes=(None,)) a Batcher refused it naming export(batch='b'), which refuses a scalar; now
    named a model of one value per call and jax.vmap over the seeds, which serves each."""
    h = sm.hybridize(zoo4.objective, zoo4.init_params)
    _close(h(jnp.int32(3)), zoo4.objective(zoo4.init_params, 3))
    opt_state = theirs = zoo4.opt_init(zoo4.init_params)

    @jax.jit
    def update(i, opt_state):  # its update, over h.apply
        gradient = jax.grad(h.apply)(zoo4.get_params(opt_state), i)
        return zoo4.opt_update(i, gradient, opt_state)

    for t in range(5):
        opt_state, theirs = update(t, opt_state), zoo4.update(t, theirs)
    params = zoo4.get_params(opt_state)
    _close(params, zoo4.get_params(theirs))
    trained = h.replace(params=params)
    sm.export(trained, tmp_path / "m", example=jnp.int32(0), shapes=(None,))
    m = sm.load(tmp_path / "m")
    _close(m(np.int32(7)), zoo4.objective(params, 7))
    with pytest.raises(sm.ConfigError, match=r"every input is a scalar.*jax\.vmap"):
        sm.serving.Batcher(m, max_batch=4)
    per_seed = sm.hybridize(jax.vmap(zoo4.objective, in_axes=(None, 0)), params)  # as it says
    sm.export(per_seed, tmp_path / "seeds", example=jnp.arange(4, dtype=jnp.int32))
    with sm.serving.Batcher(sm.load(tmp_path / "seeds", allow={"real_dynamic_slice"}),
                            max_batch=4) as b:  # fmt: skip
        got = [f.result(30) for f in [b.submit(np.array([t], np.int32)) for t in (7, 8, 9)]]
    _close(np.concatenate(got), jnp.stack([zoo4.objective(params, t) for t in (7, 8, 9)]))


@pytest.mark.slow  # an export: 2 s
def test_a_batcher_of_a_model_of_scalars_names_a_vmap_not_the_batch_it_cannot_have(tmp_path):
    """An artifact whose every input is a scalar (advi's objective of a seed) takes one value a
    call: a Batcher named export(..., batch='b'), which refuses a scalar ('no batch
    dimension'); now it names calling it directly or a jax.vmap over the values."""
    h = sm.hybridize(lambda p, t: p * t, jnp.float32(2))
    sm.export(h, tmp_path / "m", example=jnp.float32(3), batch=None)
    with pytest.raises(sm.ConfigError) as e:
        sm.serving.Batcher(sm.load(tmp_path / "m"), max_batch=4)
    assert "every input is a scalar: the model takes one value per call" in str(e.value)
    assert "batch='b'" not in str(e.value) and "jax.vmap(fn, in_axes=(None, 0))" in str(e.value)


# -- extracting_intermediates.md: nnx.capture of sown features, and of perturbations' grads --------
@pytest.mark.slow
def test_captured_intermediates_come_back_as_nnx_captures_them_and_export_flattened(tmp_path):
    """``nnx.capture(model, nnx.Intermediate)(x, y)`` hybridized as a function of the module:
    its loss and its two sown features equal the guide's, its grads nnx.grad's; export refuses
    the State it returns naming ``tuple(jax.tree.leaves(out))``, which exports and loads equal.
    The guide's perturbation ``train_step`` (nnx.grad inside, of a module holding no Param)
    gives its grads and activations as the guide's."""
    rngs = nnx.Rngs(0)
    model = zoo4.SowFoo(rngs=rngs)
    x, y = rngs.normal((2, 8))  # Dummy input for testing

    def captured(m, x, y):
        return nnx.capture(m, nnx.Intermediate)(x, y)

    h = sm.hybridize(captured, model)
    result, intms = nnx.capture(model, nnx.Intermediate)(x, y)
    got, got_intms = h(x, y)
    _close(got, result)
    _close(nnx.to_pure_dict(got_intms), nnx.to_pure_dict(intms))
    grads = jax.grad(lambda p: h.apply(p, x, y)[0])(h.params)
    _close(grads, nnx.to_pure_dict(nnx.grad(lambda m: captured(m, x, y)[0])(model)))
    with pytest.raises(sm.SignatureError, match=r"Return tuple\(jax\.tree\.leaves\(out\)\)"):
        sm.export(h, tmp_path / "m", example=(x, y), batch=None)
    flat = sm.hybridize(lambda m, x, y: tuple(jax.tree.leaves(captured(m, x, y))), model)
    sm.export(flat, tmp_path / "m", example=(x, y), batch=None)  # as it says
    _close(list(sm.load(tmp_path / "m")(np.asarray(x), np.asarray(y))),
           [result, *jax.tree.leaves(intms)])  # fmt: skip
    step = sm.hybridize(zoo4.perturb_train_step, zoo4.PerturbModel())
    want = zoo4.perturb_train_step(zoo4.PerturbModel(), jnp.float32(1.0))
    _close(nnx.to_pure_dict(step(jnp.float32(1.0))), nnx.to_pure_dict(want))
