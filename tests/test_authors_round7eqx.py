"""Code we did not write, round seven: Equinox's layers as its own docs and tests use them, and
JAX's own docs, as written there (tests/zoo7eqx.py, each section headed by its source file;
patrick-kidger/equinox@9336d820b2ef66b360fc6cb3611b3da5cefbb14d and
jax-ml/jax@cec06d116c05f0d52adfceee3d3b730fdbcb0ce5).

- Every feature test_authors_matrix.py runs over MATRIX (its test functions, called here) over:
  GRUCell's and LSTMCell's docstring models (a cell in a ``jax.lax.scan``), Lambda's
  docstring Sequential (with an RMSNorm and a per-channel PReLU), test_nn.py's WeightNorm'd
  Linear, its Conv2d/MaxPool2d CNN, its strided ConvTranspose2d then an AdaptiveAvgPool2d,
  tricks.md's symmetric-weight MLP (``eqx.tree_at(..., replace_fn=Symmetric)``), and the
  SpectralNorm'd Linear (stateful, ``eqx.nn.make_with_state``; served by
  ``eqx.nn.inference_mode``).
- Apart: the cells' scans exported with a symbolic sequence length; stateful.md's Counter and
  vmap'd Counter; tricks.md's surgery, custom initialisation (``h.replace`` after
  ``eqx.tree_at``), the symmetric model's grads, an ensemble on the same data;
  test_spectral_norm's ``eqx.tree_at`` "gradient descent"; JAX's stateful-computations page
  (CounterV2, linear regression), the shard_map notebook's data-parallel loss over 8 CPU
  devices, the tfds notebook's per-example MLP and its ``update``, and example_libraries
  optimizers' docstring ``step``.
"""

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
import test_authors_nnx3 as nnx3
import zoo7eqx as zoo
from helpers import Case, _x
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_authors_matrix import exported, loaded  # noqa: F401 - the matrix's fixtures

import symjax_mlp as sm

TOL = {"rtol": 2e-5, "atol": 2e-5}


def _spectral_batch(spectral, x, state):
    """A batch through test_spectral_norm's layer, one state for the batch (its power
    iteration reads the weight, not x), as examples/stateful.ipynb batches a stateful model."""
    return jax.vmap(spectral, in_axes=(0, None), out_axes=(0, None))(x, state)


def _infer(model, x):
    """Inference as export's refusal of a state input names it: ``jax.vmap(m)(x)[0]``."""
    return jax.vmap(model)(x)[0]


def _spectral_served():
    spectral, state = zoo.spectral_norm(jr.key(0))
    for i in range(2):  # its power iterations moved, as after training
        _, state = _spectral_batch(spectral, _x(80 + i, (4, 5)), state)
    return _infer, eqx.Partial(eqx.nn.inference_mode(spectral), state=state)


SCAN = frozenset({"real_dynamic_slice"})  # a scan's or a pool's slices at a symbolic batch
CASES = (
    Case("eqx_gru", "eqx",
         lambda: (eqx.filter_vmap(zoo.GRUModel(input_size=3, hidden_size=4, key=jr.key(0))),
                  None),
         lambda s: (_x(s, (4, 6, 3)),), allow=SCAN | {"dynamic_update_slice"}),
    Case("eqx_lstm", "eqx", lambda: (eqx.filter_vmap(zoo.LSTMModel(3, 4, key=jr.key(0))), None),
         lambda s: (_x(s, (4, 6, 3)),), allow=SCAN | {"dynamic_update_slice"}),
    Case("eqx_sequential", "eqx", lambda: (eqx.filter_vmap(zoo.sequential(jr.key(0))), None),
         lambda s: (_x(s, (4, 5)),)),
    Case("eqx_weight_norm", "eqx",
         lambda: (eqx.filter_vmap(zoo.weight_norm_linear(jr.key(0))), None),
         lambda s: (_x(s, (4, 4)),)),
    Case("eqx_pool_cnn", "eqx", lambda: (eqx.filter_vmap(zoo.CNN(jr.key(0))), None),
         lambda s: (_x(s, (4, 3, 8, 8)),),
         allow=SCAN | {"convolution", "reduce_window", "select_and_scatter"}),
    Case("eqx_upsampler", "eqx", lambda: (eqx.filter_vmap(zoo.upsampler(jr.key(0))), None),
         lambda s: (_x(s, (4, 3, 7, 7)),), allow=SCAN | {"convolution"}),
    Case("eqx_symmetric", "eqx",
         lambda: (zoo.symmetric_forward,
                  zoo.symmetric_model(eqx.nn.MLP(3, 3, 3, 1, key=jr.key(0)))),
         lambda s: (_x(s, (4, 3)),)),
    Case("eqx_spectral_norm", "eqx", lambda: (_spectral_batch, zoo.spectral_norm(jr.key(0))[0]),
         lambda s: (_x(s, (4, 5)),), carry=lambda: zoo.spectral_norm(jr.key(0))[1],
         served=_spectral_served),
)  # fmt: skip
IDS = [c.name for c in CASES]


@pytest.mark.slow  # exports, IREE: 2 to 5 s each
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_matrix_feature(case, exported, loaded, tmp_path, monkeypatch):  # noqa: F811
    """Each feature test_authors_matrix.py runs over MATRIX, as round three runs them: compiled
    == eager == equinox (and served, where it has a served model), grads through h.apply,
    graph, export (batch symbolic, vjp_order=1) and load in JAX and IREE, a Batcher, vmap
    and grad over the loaded model, timeit."""
    nnx3.test_every_matrix_feature(case, exported, loaded, tmp_path, monkeypatch)


def _clone(state):
    """stateful.md's clone of a State: equinox refuses an old state used again."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    return jax.tree_util.tree_unflatten(treedef, leaves)


# -- docs/api/nn/stateful.md: Counter, and a vmap'd Counter --------------------------------------
@pytest.mark.slow  # an export and a Batcher: 1.5 s warm
def test_the_counter_pages_model_counts_as_equinox_and_exports_as_the_refusal_says(tmp_path):
    """``model(x, state)`` as the page calls it (one example, its state threaded): three calls
    of the Hybrid, compiled and eager, count as equinox's, its vmap'd counter's state
    batched; the state input refused by export, naming the inference model, which exports
    (batch symbolic), loads and serves as equinox runs it."""
    model, state = eqx.nn.make_with_state(zoo.CounterModel)(jr.PRNGKey(0))
    x = jnp.array([5.0, -1.0])
    for h in (sm.hybridize(model), sm.hybridize(model).hybridize(False)):
        ours, theirs = _clone(state), _clone(state)
        for _ in range(3):
            got, ours = h(x, ours)
            want, theirs = model(x, theirs)
            chex.assert_trees_all_close(got, want, **TOL)
        chex.assert_trees_all_close(jax.tree.leaves(ours), jax.tree.leaves(theirs))
    assert [np.asarray(n).tolist() for n in jax.tree.leaves(ours)] == [3, [3, 3]]
    assert h.graph(x, state).primitive_counts["dot_general"] == 1
    with pytest.raises(sm.SignatureError, match=r"args\[1\] is an equinox eqx\.nn\.State") as e:
        sm.export(h, tmp_path / "m", example=(x, state))
    assert "eqx.Partial(eqx.nn.inference_mode(model), state=state)" in str(e.value)
    inference_model = eqx.Partial(eqx.nn.inference_mode(model), state=ours)  # as it says
    served, xs = sm.hybridize(_infer, inference_model), jnp.stack([x, x + 1, 2 * x])
    sm.export(served, tmp_path / "m", example=xs)
    m = sm.load(tmp_path / "m")
    want = _infer(inference_model, xs)  # each example counted from the held state
    chex.assert_trees_all_close(m(np.asarray(xs)), want, **TOL)
    with sm.serving.Batcher(m, max_batch=4) as b:
        chex.assert_trees_all_close(b(np.asarray(xs[1:2])), want[1:2], **TOL)


# -- tests/test_nn.py, test_spectral_norm: its eqx.tree_at "gradient descent" -------------------
def _sigma(spectral, state):
    """test_spectral_norm's ``λ1``: the largest singular value of the normalised weight."""
    u, v = state.get(spectral.uv_index)
    σ = jnp.einsum("i,ij,j->", u, spectral.layer.weight, v)
    _, s, _ = jnp.linalg.svd(spectral.layer.weight / σ)
    return s[0]


@pytest.mark.slow  # 40 calls of the Hybrid: 1 s
def test_spectral_norms_power_iterations_run_in_the_hybrid_and_follow_its_surgery():
    """As the test: calls bring λ1 to 1; ``eqx.tree_at`` moves the weight (its "gradient
    descent"), given to the Hybrid by ``h.replace``; calls bring λ1 back to 1; in inference
    mode (a Hybrid of ``eqx.nn.inference_mode``'s layer) the state stays. Its 100 calls made
    20 (λ1 within 1e-3)."""
    spectral, state = zoo.spectral_norm(jr.key(0))
    x = jr.normal(jr.key(1), (4, 5))
    h = sm.hybridize(_spectral_batch, spectral)
    for _ in range(20):
        _, state = h(x, state)
    assert jnp.allclose(_sigma(spectral, state), 1, atol=1e-3)
    spectral = eqx.tree_at(lambda s: s.layer.weight, spectral, spectral.layer.weight + 1)
    assert not jnp.allclose(_sigma(spectral, state), 1, atol=1e-3)
    h = h.replace(params=eqx.filter(spectral, eqx.is_inexact_array))
    theirs = _clone(state)
    for _ in range(20):
        got, state = h(x, state)
        want, theirs = _spectral_batch(spectral, x, theirs)
    chex.assert_trees_all_close(got, want, **TOL)
    assert jnp.allclose(_sigma(spectral, state), 1, atol=1e-3)
    spectral = eqx.tree_at(lambda s: s.layer.weight, spectral, spectral.layer.weight + 1)
    frozen = sm.hybridize(_spectral_batch, eqx.nn.inference_mode(spectral, value=True))
    for _ in range(3):
        _, state = frozen(x, state)
    assert not jnp.allclose(_sigma(spectral, state), 1, atol=1e-3)


# -- docs/tricks.md: model surgery, custom initialisation, custom per-parameter behaviour ------
@pytest.mark.slow  # MLPs' initialisers compile: 1 s cold
def test_tricks_surgery_and_custom_init_reach_the_hybrid_by_replace():
    """``eqx.tree_at(where, mlp, new_final_layer)`` and ``init_linear_weight(model, trunc_init,
    key)``: a new model of the same shapes given to the Hybrid by ``h.replace`` of its arrays
    answers as the new model; a final layer of another size is refused at ``h.replace``
    naming hybridizing the other model, which answers as it."""
    mlp = eqx.nn.MLP(2, 2, 8, 2, key=jr.key(0))  # the page's MLP(...)
    h, x = sm.hybridize(eqx.filter_vmap(mlp)), jr.normal(jr.key(1), (4, 2))
    where = lambda m: m.layers[-1]  # noqa: E731
    new_final_layer = eqx.nn.Linear(8, 2, key=jr.key(5))
    for new in (eqx.tree_at(where, mlp, new_final_layer),
                zoo.init_linear_weight(mlp, zoo.trunc_init, jr.PRNGKey(3))):  # fmt: skip
        got = h.replace(params=eqx.filter(eqx.filter_vmap(new), eqx.is_inexact_array))(x)
        chex.assert_trees_all_close(got, jax.vmap(new)(x), **TOL)
        assert not np.allclose(got, h(x))
    wider = eqx.tree_at(where, mlp, eqx.nn.Linear(8, 3, key=jr.key(5)))
    with pytest.raises(sm.ConfigError, match=r"layers\[2\]\.weight is shaped \(3, 8\).*hybridize"):
        h.replace(params=eqx.filter(eqx.filter_vmap(wider), eqx.is_inexact_array))
    got = sm.hybridize(eqx.filter_vmap(wider))(x)  # as it says
    chex.assert_trees_all_close(got, jax.vmap(wider)(x), **TOL)


def test_replace_with_an_equinox_layer_of_another_size_is_refused_at_replace():
    """``h.replace(params=...)`` of a ``Linear(3, 4)``'s arrays resized as a ``Linear(3, 5)``'s:
    refused at ``replace``, naming the leaf, both shapes and hybridizing the other module
    (before: at the first call, naming neither leaf nor shapes); arrays of the same size are
    taken."""
    h = sm.hybridize(eqx.nn.Linear(3, 4, key=jr.key(0)))
    resized = (jnp.zeros((5, 3)), jnp.zeros(5))
    other = eqx.tree_at(lambda m: (m.weight, m.bias), h.params, resized)
    said = r"^Linear\.replace\(params=\.\.\.\): params\.weight is shaped \(5, 3\), where "
    with pytest.raises(sm.ConfigError, match=said + r".* is \(4, 3\).*sm\.hybridize\(new_"):
        h.replace(params=other)
    same = jax.tree.map(jnp.zeros_like, h.params)
    assert h.replace(params=same).params is same


@pytest.mark.slow  # the MLP's initialisers and two grads compile: 1.4 s
def test_the_symmetric_models_grads_through_apply_equal_its_loss_fns():
    """tricks.md's ``loss_fn`` (``eqx.filter_grad``, the model resolved inside): the same
    loss over ``h.apply`` of the Hybrid of its prediction gives its grads, leaf for leaf,
    each a Symmetric's ``matrix``."""
    model = zoo.symmetric_model(eqx.nn.MLP(3, 3, 3, 1, key=jr.key(0)))
    h, x, y = sm.hybridize(zoo.symmetric_forward, model), _x(0, (4, 3)), _x(1, (4, 3))
    grads = jax.grad(lambda p: jnp.sum((y - h.apply(p, x)) ** 2))(h.params)
    want = zoo.loss_fn(model, x, y)
    chex.assert_trees_all_close(jax.tree.leaves(grads), jax.tree.leaves(want), **TOL)
    assert isinstance(want.layers[0].weight, zoo.Symmetric)


@pytest.mark.slow  # an export: 1 s
def test_an_ensemble_evaluated_on_the_same_data_exports_with_static_shapes_as_refused(tmp_path):
    """tricks.md's ``evaluate_ensemble`` (every member on one example, no batch): a symbolic
    batch is refused naming batch=None, which exports, loads and answers as equinox; a
    Batcher over it is refused naming per-row outputs, with max_batch=4 too (it named a
    symbolic batch, which export refuses for this model)."""
    mlp_ensemble = zoo.make_ensemble(jax.random.split(jax.random.PRNGKey(0), 8))
    x = jax.random.normal(jax.random.PRNGKey(0), (2,))
    h = sm.hybridize(zoo.evaluate_ensemble, mlp_ensemble)
    want = zoo.evaluate_ensemble(mlp_ensemble, x)
    chex.assert_trees_all_close(h(x), want, **TOL)
    with pytest.raises(sm.SignatureError, match=r"batch='b'.*Or pass batch=None"):
        sm.export(h, tmp_path / "m", example=x)
    sm.export(h, tmp_path / "m", example=x, batch=None)  # as it says
    m = sm.load(tmp_path / "m")
    chex.assert_trees_all_close(m(np.asarray(x)), want, **TOL)
    for max_batch in (None, 4):  # 4 said 'export it with a symbolic batch', refused above
        with pytest.raises(sm.ConfigError, match=r"out is of shape \(8, 2\).*per-row outputs"):
            sm.serving.Batcher(m, max_batch=max_batch)


# -- jax docs/stateful-computations.md -----------------------------------------------------------
def test_counter_v2s_count_is_refused_without_params_and_counts_as_its_jit_as_it_says():
    """``jax.jit(counter.count)``: a method of no params, refused naming the lambda that
    takes none; that Hybrid, under jax.jit as the page jits it, counts 1, 2, 3 from an int."""
    counter = zoo.CounterV2()
    with pytest.raises(sm.ConfigError, match=r"hybridize\(lambda _, x: f\(x\), \{\}\)"):
        sm.hybridize(counter.count)
    fast_count = jax.jit(sm.hybridize(lambda _, n: counter.count(n), {}))  # as it says
    state, values = counter.reset(), []
    for _ in range(3):
        value, state = fast_count(state)
        values.append(int(value))
    assert values == [1, 2, 3]


@pytest.mark.slow  # an export, a load, 20 steps: 1.5 s
def test_the_linear_regression_loss_trains_exports_and_is_refused_by_a_batcher(tmp_path):
    """The page's ``loss(params, x, y)`` hybridized: its value, 20 SGD steps of its ``update``
    over ``h.apply`` equal to the page's own (1000 made 20), exported with the batch symbolic,
    loaded, its grads over x and y equal; a Batcher refused naming per-row outputs (it
    reduces over the rows)."""
    xs, ys = zoo.regression_data()
    params = zoo.init(jax.random.key(42))
    h = sm.hybridize(zoo.loss, params)
    np.testing.assert_allclose(h(xs, ys), zoo.loss(params, xs, ys), **TOL)

    @jax.jit
    def update(params, x, y):  # the page's, its loss over h.apply
        grad = jax.grad(h.apply)(params, x, y)
        return jax.tree.map(lambda param, g: param - g * zoo.LEARNING_RATE, params, grad)

    ours = theirs = params
    for _ in range(20):
        ours, theirs = update(ours, xs, ys), zoo.update(theirs, xs, ys)
    assert isinstance(ours, zoo.Params)
    chex.assert_trees_all_close(ours, theirs, **TOL)
    trained = h.replace(params=ours)
    sm.export(trained, tmp_path / "m", example=(xs, ys), vjp_order=1)
    m = sm.load(tmp_path / "m")
    for rows in (128, 5):
        got = m(np.asarray(xs[:rows]), np.asarray(ys[:rows]))
        np.testing.assert_allclose(got, zoo.loss(theirs, xs[:rows], ys[:rows]), **TOL)
    got = jax.grad(m, argnums=(0, 1))(xs, ys)
    chex.assert_trees_all_close(got, jax.grad(zoo.loss, argnums=(1, 2))(theirs, xs, ys), **TOL)
    with pytest.raises(sm.ConfigError, match=r"output out is float32\[\].*reduces over the b"):
        sm.serving.Batcher(m)


# -- jax docs/notebooks/shard_map.md: 8-way batch data parallelism -------------------------------
@pytest.mark.slow  # shard_map over 8 devices, exports: 3 s
def test_the_shard_map_data_parallel_loss_runs_differentiates_and_exports_on_its_mesh(tmp_path):
    """The notebook's ``loss_dp`` (``@jax.shard_map(out_specs=P())`` over ``jax.set_mesh``'s
    8-device mesh of Explicit axes, a pmean of the local losses), its batch split and its
    params replicated as it puts them: the Hybrid's loss and grads equal the reference
    ``loss``'s and ``loss_dp``'s. Exported with the batch symbolic, the artifact (8 devices)
    was written and every load refused it ('the shapes of the module cannot be resolved
    ... Export the model again', which did the same; jax.export's own call fails alike): now
    export refuses it naming batch=None, which loads (allow={'all_reduce'}) and answers as
    the notebook; its ``predict``, exported outside the mesh, takes any batch."""
    mesh = jax.make_mesh((8,), ("batch",))
    params, batch = zoo.sm_init(jax.random.key(0), zoo.layer_sizes, zoo.batch_size)
    with jax.set_mesh(mesh):
        batch = jax.device_put(batch, NamedSharding(mesh, P("batch")))
        params = jax.device_put(params, NamedSharding(mesh, P()))
        loss_dp = zoo.loss_dp_of(P)
        want = jax.jit(zoo.sm_loss)(params, batch)
        h = sm.hybridize(loss_dp, params)
        np.testing.assert_allclose(h(batch), want, **TOL)
        np.testing.assert_allclose(jax.jit(loss_dp)(params, batch), want, **TOL)
        grads = jax.jit(jax.grad(lambda p: h.apply(p, batch)))(params)
        chex.assert_trees_all_close(grads, jax.jit(jax.grad(zoo.sm_loss))(params, batch), **TOL)
        with pytest.raises(sm.SignatureError, match=r"args\[0\] is a tuple of 2 arrays"):
            sm.export(h, tmp_path / "m", example=(batch,))
        flat = sm.hybridize(lambda p, inputs, targets: h.apply(p, (inputs, targets)), params)
        said = (
            r"^export\(<lambda>\): the program is sharded over 8 devices \(\{'batch': 8\}\) "
            r"and its shapes are symbolic \(float32\[b,16\], float32\[b,4\]\), and JAX "
            r"cannot resolve them for a call \(its shape refinement fails: JaxRuntimeError, "
            r"below\): load\(\) would refuse every call.*Pass batch=None"
        )
        with pytest.raises(sm.SignatureError, match=said):
            sm.export(flat, tmp_path / "m", example=batch)
        assert not (tmp_path / "m").exists()
        sm.export(flat, tmp_path / "m", example=batch, batch=None)  # as it says
        m = sm.load(tmp_path / "m", allow={"all_reduce"})
        np.testing.assert_allclose(m(*map(np.asarray, batch)), want, **TOL)
    sm.export(sm.hybridize(zoo.sm_predict, jax.device_get(params)), tmp_path / "p",
              example=np.asarray(batch[0]))  # fmt: skip
    inputs = np.asarray(batch[0])[:5]
    got = sm.load(tmp_path / "p")(inputs)
    np.testing.assert_allclose(got, zoo.sm_predict(jax.device_get(params), inputs), **TOL)


@pytest.mark.slow  # shard_map over 4 devices, two exports and loads: 2 s (6 s first)
def test_the_shard_map_fsdp_loss_exports_with_its_params_sharded_and_loads(tmp_path):
    """The notebook's ``loss_fsdp`` takes its params sharded ``P('batch')``, each device a
    fragment it all-gathers. Export staged them unsharded, so every device saw the whole
    arrays and the model raised (dot_general's contracting dimensions, 16 and 64), which was
    named 'args[0] is a Python tuple ... not an array'. Export stages params and inputs
    split over a mesh as they are where the program maps them by hand (a shard_map): the
    artifact (4 devices) loads and answers as the notebook's ``loss``; with the batch
    symbolic it is refused naming batch=None. A model of no shard_map over those params
    (``predict``) exports one device's program, as it did, which loads anywhere."""
    mesh = jax.make_mesh((4,), ("batch",))  # the last bias has 4 features: 8 do not divide it
    params, batch = zoo.sm_init(jax.random.key(0), zoo.layer_sizes, zoo.batch_size)
    want = zoo.sm_loss(params, batch)
    with jax.set_mesh(mesh):
        batch = jax.device_put(batch, P("batch"))
        params = jax.device_put(params, P("batch"))
        h = sm.hybridize(zoo.loss_fsdp_of(P), params)
        np.testing.assert_allclose(h(batch), want, **TOL)
        flat = sm.hybridize(lambda p, inputs, targets: h.apply(p, (inputs, targets)), params)
        with pytest.raises(sm.SignatureError, match=r"sharded over 4 devices.*Pass batch=None"):
            sm.export(flat, tmp_path / "m", example=batch)
        art = sm.export(flat, tmp_path / "m", example=batch, batch=None)
    assert art.manifest["nr_devices"] == 4
    m = sm.load(art.path, allow={"all_reduce", "all_gather"})
    np.testing.assert_allclose(m(*map(np.asarray, batch)), want, **TOL)
    inputs = np.asarray(batch[0])
    art = sm.export(sm.hybridize(zoo.sm_predict, params), tmp_path / "p", example=inputs)
    assert art.manifest["nr_devices"] == 1
    want = zoo.sm_predict(jax.device_get(params), inputs[:5])
    np.testing.assert_allclose(sm.load(art.path)(inputs[:5]), want, **TOL)


# -- jax docs/notebooks/neural_network_with_tfds_data.md, and optimizers' docstring -------------
@pytest.mark.slow  # exports, a Batcher, training: 2 s
def test_the_tfds_notebooks_per_example_mlp_exports_vmapped_as_refused_and_trains(tmp_path):
    """Its ``predict`` takes one image: exported with a symbolic batch it is refused naming
    jax.vmap; its ``batched_predict`` (``vmap(predict, in_axes=(None, 0))``) exports, loads,
    serves and differentiates as the notebook's; three steps of its ``update`` over
    ``h.apply`` equal its own, and example_libraries.optimizers' docstring ``step`` (sgd) over
    ``h.apply`` equals it over the notebook's loss."""
    params = zoo.init_network_params(zoo.tfds_layer_sizes, random_key := jax.random.key(0))
    image = jax.random.normal(jax.random.key(1), (16,))
    h = sm.hybridize(zoo.predict, params)
    np.testing.assert_allclose(h(image), zoo.predict(params, image), **TOL)
    with pytest.raises(sm.SignatureError, match=r"jax\.vmap for a function"):
        sm.export(h, tmp_path / "m", example=image)
    h = sm.hybridize(zoo.batched_predict, params)  # as it says: the notebook's own vmap
    images = jax.random.normal(jax.random.key(1), (10, 16))
    targets = zoo.one_hot(jnp.arange(10) % 10, zoo.n_targets)
    sm.export(h, tmp_path / "m", example=images, vjp_order=1)
    m, want = sm.load(tmp_path / "m"), zoo.batched_predict(params, images)
    np.testing.assert_allclose(m(np.asarray(images)), want, **TOL)
    with sm.serving.Batcher(m, max_batch=4) as b:
        np.testing.assert_allclose(b(np.asarray(images[3:4])), want[3:4], **TOL)
    got = jax.grad(lambda x: -jnp.mean(m(x) * targets))(images)
    np.testing.assert_allclose(got, jax.grad(lambda x: zoo.tfds_loss(params, x, targets))(images),
                               **TOL)  # fmt: skip

    @jax.jit
    def update(params, x, y):  # the notebook's, its loss over h.apply
        grads = jax.grad(lambda p: -jnp.mean(h.apply(p, x) * y))(params)
        return [(w - zoo.step_size * dw, b - zoo.step_size * db)
                for (w, b), (dw, db) in zip(params, grads, strict=True)]  # fmt: skip

    ours = theirs = params
    for _ in range(3):
        ours, theirs = update(ours, images, targets), zoo.tfds_update(theirs, images, targets)
    chex.assert_trees_all_close(ours, theirs, **TOL)
    np.testing.assert_allclose(
        jnp.mean(jnp.argmax(h.replace(params=ours)(images), 1) == jnp.arange(10) % 10),
        zoo.accuracy(theirs, images, targets),
    )
    del random_key
    values, stepped = zoo.optimizers_steps(
        lambda p: -jnp.mean(h.apply(p, images) * targets), params, 0.1, 3
    )
    want_values, want = zoo.optimizers_steps(
        lambda p: zoo.tfds_loss(p, images, targets), params, 0.1, 3
    )
    np.testing.assert_allclose(values, want_values, **TOL)
    chex.assert_trees_all_close(stepped, want, **TOL)


@pytest.mark.slow  # two exports: 2 s
@pytest.mark.parametrize("case", CASES[:2], ids=IDS[:2])
def test_the_rnn_cells_scans_export_a_symbolic_sequence_length(case, tmp_path):
    """GRUCell's and LSTMCell's docstring models scan any number of steps: exported with
    shapes=("b, t, 3",) the artifact (its loop's trip count t, which load names and takes
    allowed by name) answers as equinox for 6, 2 and 9 steps; a Batcher over it is refused
    naming the symbolic t (it pads and merges rows)."""
    h, (x,) = case.hybridize(), case.inputs(0)
    model, _ = case.build()
    sm.export(h, tmp_path / "m", example=x, shapes=("b, t, 3",))
    with pytest.raises(sm.ArtifactError, match=r"a while loop whose trip count is not a const"):
        sm.load(tmp_path / "m")  # its scan's steps are t: named, and allowed by name
    m = sm.load(tmp_path / "m", allow={"real_dynamic_slice", "while"})
    for steps in (6, 2, 9):
        xs = _x(steps, (3, steps, 3))
        chex.assert_trees_all_close(m(np.asarray(xs)), model(xs), **TOL)
    with pytest.raises(sm.ConfigError, match=r"float32\[b, t, 3\].*its size t is symbolic"):
        sm.serving.Batcher(m, max_batch=4)
