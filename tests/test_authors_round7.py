"""Code we did not write, round seven: Flax's own guides as their authors wrote them (tests/zoo7.py,
google/flax@18f8f311c275d57f46d95e41b15aa97b454754c0), run over every feature
test_authors_matrix.py runs over MATRIX (its test functions, called here), or as the guide runs
them where they fit none of the matrix's shapes.

- rng_guide.md: the training loop's ``Model`` (a ``self.variable`` drawn from an 'other' stream,
  dropout in two modules, a param shaped as its inputs: its batch fixed) and the guide's own
  ``update``; ``make_rng('params')`` inside ``apply`` behind a traced ``add_noise`` flag; the
  ``nn.vmap``'d ``BatchModel`` (params per row); the ``nn.scan``'d ``ScanMLP`` called on
  ``(x, None)``; the sharp edge's params-less model on a Python int.
- haiku_migration_guide.rst (Flax side): BatchNorm and its ``train_step`` (the whole matrix);
  the ``AutoEncoder``'s ``method="encode"`` and the ``nn.scan`` of ``RNNCell`` s (the whole
  matrix); ``FooModule``'s counter.
- model_surgery.md's CNN (the whole matrix), its surgery given by ``h.replace``.
- ensembling.rst's pmapped ensemble of 8 CNNs trained over ``h.apply``, its mean probabilities
  served; flax_sharp_bits.md's dropout mode as a module attribute.
- docs_nnx: surgery.md's ``TwoLayerMLP`` swapped, shared, weight-tied (the whole matrix) and
  monkey-patched, its renamed checkpoint and its LoRA partial initialization; pytree.md's nnx
  module as a jitted function's argument and its ``nnx.Pytree`` s as params;
  jax_and_nnx_transforms.rst's two train steps; flax_gspmd.md's sharded ``MultiDotReluDot`` on
  a 2x4 mesh of the 8 CPU devices; haiku_to_flax.rst's nnx side: its dropout ``Model`` (the
  whole matrix, and its ``train_step``), ``AutoEncoder.encode`` and ``nnx.scan`` RNN (the whole
  matrix), its ``Counter`` FooModule.
"""

from types import SimpleNamespace

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_authors_nnx3 as nnx3
import zoo7
from flax import nnx
from helpers import Case, _x, keyless
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from test_authors_matrix import exported, loaded  # noqa: F401 - the matrix's fixtures

import symjax_mlp as sm

TOL = {"rtol": 2e-5, "atol": 2e-5}


def _linen(model, example, rngs=None, **kw):
    """``(model, variables)``: the guide's ``module.init(rngs, x, ...)``."""
    return lambda: (model, model.init(rngs or jax.random.key(0), example, **kw))


def _rng_loop():
    """rng_guide's ``variables = module.init(init_rngs, x, train=False)``."""
    params_rng, other_rng, _ = jax.random.split(jax.random.key(0), 3)
    init_rngs = {"params": params_rng, "other": other_rng}
    return zoo7.RngLoopModel(), zoo7.RngLoopModel().init(init_rngs, jnp.ones((1, 3)), train=False)


def _nnx_surgery(how):
    """surgery.md's ``TwoLayerMLP(4, rngs=nnx.Rngs(0))`` after one of its Pythonic surgeries."""

    def build():
        model = zoo7.TwoLayerMLP(4, rngs=nnx.Rngs(0))
        if how == "swapped":
            model.linear1, model.linear2 = model.linear2, model.linear1
        elif how == "shared":
            model.linear2 = model.linear1
        elif how == "tied":
            model.linear1.kernel = model.linear2.kernel  # the bias parameter is kept separate
        return model, None

    return build


def _hk_nnx_eval():
    """haiku_to_flax.rst's ``Model(784, 256, 10, rngs=nnx.Rngs(0))`` (sizes cut), ``.eval()``."""
    model = zoo7.NnxModel(12, 16, 10, rngs=nnx.Rngs(0))
    model.eval()
    return model, None


WHOLE = (
    Case("haiku_bn", "linen", _linen(zoo7.BnModel(16, 10), jnp.ones((1, 12)), training=False),
         lambda s: (_x(s, (4, 12)),), train={"training": True}, eval={"training": False}),
    Case("haiku_rnn", "linen", _linen(zoo7.RNN(8), jnp.ones((3, 5, 4))),
         lambda s: (_x(s, (4, 5, 4)),),
         allow=frozenset({"dynamic_update_slice", "real_dynamic_slice"})),
    Case("surgery_cnn", "linen", _linen(zoo7.SurgeryCNN(), jnp.ones((1, 8, 8, 1))),
         lambda s: (_x(s, (4, 8, 8, 1)),), classes=10,
         allow=frozenset({"convolution", "reduce_window"})),
    Case("haiku_autoencoder_encode", "fn",
         lambda: (lambda v, x: zoo7.AutoEncoder(8, 12).apply(v, x, method="encode"),
                  zoo7.AutoEncoder(8, 12).init(jax.random.key(0), x=jnp.ones((1, 12)))),
         lambda s: (_x(s, (4, 12)),)),
    Case("hk_nnx_model", "nnx", lambda: (zoo7.NnxModel(12, 16, 10, rngs=nnx.Rngs(0)), None),
         lambda s: (_x(s, (4, 12)),), served=_hk_nnx_eval),
    Case("hk_nnx_rnn", "nnx", lambda: (zoo7.NnxRNN(4, 8, rngs=nnx.Rngs(0)), None),
         lambda s: (_x(s, (4, 5, 4)),),
         allow=frozenset({"dynamic_update_slice", "real_dynamic_slice"})),
    Case("hk_nnx_encode", "nnx",
         lambda: (lambda m, x: m.encode(x), zoo7.NnxAutoEncoder(12, 8, 12, rngs=nnx.Rngs(0))),
         lambda s: (_x(s, (4, 12)),)),
    Case("nnx_surgery_swapped", "nnx", _nnx_surgery("swapped"), lambda s: (_x(s, (4, 4)),)),
    Case("nnx_surgery_shared", "nnx", _nnx_surgery("shared"), lambda s: (_x(s, (4, 4)),)),
    Case("nnx_surgery_tied", "nnx", _nnx_surgery("tied"), lambda s: (_x(s, (4, 4)),)),
)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", WHOLE, ids=lambda c: c.name)
def test_every_matrix_feature(case, exported, loaded, tmp_path, monkeypatch):  # noqa: F811
    """Each feature test_authors_matrix.py runs over MATRIX, as round three runs them."""
    nnx3.test_every_matrix_feature(case, exported, loaded, tmp_path, monkeypatch)


def _close(a, b):
    chex.assert_trees_all_close(a, b, **TOL)


def _exported(tmp_path, h, example, allow=None, **kw):
    """``h`` exported (``kw``: export's options) and loaded (``allow``: load's)."""
    sm.export(h, tmp_path / "m", example=example, **kw)
    return sm.load(tmp_path / "m", allow=allow)


@pytest.mark.slow
def test_the_rng_guides_training_loop_runs_as_its_update_and_exports_its_fixed_batch(tmp_path):
    """rng_guide's loop model: its kernel param is shaped as the init's inputs, (1, 3), so its
    batch is fixed (the guide's own): train/eval calls equal linen's (dropout from the Hybrid's
    split stream, 'other_collection' held); its ``update`` over ``h.apply`` of its apply taking
    the dropout key as an input gives the guide's own 10 steps' params; export's default
    symbolic batch is refused naming ``batch=None`` (before: only ``shapes=``), which exports,
    loads, serves and differentiates as the source."""
    model, variables = _rng_loop()
    x, y, key = jnp.ones((1, 3)), jnp.ones((1, 2)), jax.random.key(3)
    h = sm.hybridize(model, variables, rngs=key)
    _, sub = jax.random.split(key)
    _close(h(x, train=True), model.apply(variables, x, train=True, rngs={"dropout": sub}))
    _close(h(x, train=False), model.apply(variables, x, train=False))
    # the guide's update over a Hybrid of its apply taking the dropout key as an input (as
    # export's refusal of a held stream says): the guide's own keys, its own 10 steps
    f = sm.hybridize(lambda v, x, key: model.apply(v, x, train=True, rngs={"dropout": key}),
                     variables)  # fmt: skip
    shim = SimpleNamespace(apply=lambda v, x, train, rngs: f.apply(v, x, rngs["dropout"]))
    want = got = {k: variables[k] for k in ("params", "other_collection")}
    train_rng = rng = jax.random.key(1)
    for _ in range(10):
        want, train_rng = zoo7.make_update(model, x, y)(want, train_rng)
        got, rng = zoo7.make_update(shim, x, y)(got, rng)
    _close(got["params"], want["params"])
    with pytest.raises(sm.SignatureError, match=r"submodule_kernel.*batch=None"):
        sm.export(h, tmp_path / "b", example=(x,), kwargs={"train": False})
    m = _exported(tmp_path, h, (x,), kwargs={"train": False}, batch=None, vjp_order=1)
    _close(m(np.asarray(x)), model.apply(variables, x, train=False))
    with sm.serving.Batcher(m, max_batch=1) as b:
        _close(b.submit(np.asarray(x)).result(30), m(np.asarray(x)))
    grads = jax.grad(lambda x: m(x).sum())(x)
    _close(grads, jax.grad(lambda x: model.apply(variables, x, train=False).sum())(x))


@pytest.mark.slow
def test_make_rng_params_inside_apply_draws_from_the_hybrids_params_stream(tmp_path):
    """rng_guide's "Using jax.jit" model draws noise from ``make_rng('params')`` in ``apply``,
    behind a traced ``add_noise``: the Hybrid's ``rngs={'params': key}`` stream gives linen's
    draws (split anew per call), True or False, a Python or an array flag; export refuses to
    bake the stream in, naming the key-as-input function, which exports and loads as linen."""
    model, (init_rng, apply_rng) = zoo7.NoiseModel(), jax.random.split(jax.random.key(0))
    x = jnp.ones((8, 1))
    variables = model.init(init_rng, x, False)
    h = sm.hybridize(model, variables, rngs={"params": apply_rng})
    key = apply_rng
    for flag in (True, jnp.bool_(True), False):
        key, sub = jax.random.split(key)
        _close(h(x, flag), model.apply(variables, x, flag, rngs={"params": sub}))
    with pytest.raises(sm.ConfigError, match=r"stream 'params'.*wrap_key_data"):
        sm.export(h, tmp_path / "x", example=(x, False))
    f = sm.hybridize(lambda params, x, key: model.apply(
        params, x, True, rngs={"params": jax.random.wrap_key_data(key)}), variables)  # fmt: skip
    data = jax.random.key_data(apply_rng)
    m = _exported(tmp_path, f, (x, data), shapes=("b, ...", None))
    _close(m(np.asarray(x), np.asarray(data)),
           model.apply(variables, x, True, rngs={"params": apply_rng}))  # fmt: skip


@pytest.mark.slow
def test_the_rng_guides_vmapped_batch_model_exports_one_row_per_member(tmp_path):
    """rng_guide's ``nn.vmap`` BatchModel (params and 'other_collection' per row): equal to
    linen; export's symbolic batch refused naming ``batch=None``, which loads as linen, under
    grad too."""
    model, x = zoo7.BatchModel(), _x(0, (3, 4))
    variables = model.init({"params": jax.random.key(0), "other": jax.random.key(1)}, x)
    h = sm.hybridize(model, variables)
    _close(h(x), model.apply(variables, x))
    with pytest.raises(sm.SignatureError, match=r"one per member.*batch=None"):
        sm.export(h, tmp_path / "b", example=(x,))
    m = _exported(tmp_path, h, (x,), batch=None, vjp_order=1)
    _close(m(np.asarray(x)), model.apply(variables, x))
    want = jax.grad(lambda x: model.apply(variables, x).sum())(x)
    _close(jax.grad(lambda x: m(x).sum())(x), want)


@pytest.mark.slow
def test_the_rng_guides_scan_mlp_called_on_an_empty_carry_exports_flattened(tmp_path):
    """rng_guide's ``nn.scan`` ScanMLP, called ``(x, None)`` as the guide does: equal to linen,
    its graph counts the scan; its ``(y, None)`` out refused by export naming the flattened
    function, which exports (batch symbolic), loads and serves as linen."""
    model, x = zoo7.ScanMLP(), jnp.ones((3, 2))
    variables = model.init(jax.random.key(0), x, None)
    h = sm.hybridize(model, variables)
    _close(h(x + 1, None)[0], model.apply(variables, x + 1, None)[0])
    assert h(x, None)[1] is None
    assert "scan" in str(h.graph(x, None))
    with pytest.raises(sm.SignatureError, match=r"tuple\(jax\.tree\.leaves\(out\)\)"):
        sm.export(h, tmp_path / "x", example=(x, None))
    flat = sm.hybridize(lambda p, x: tuple(jax.tree.leaves(h.apply(p, x, None))), h.params)
    m = _exported(tmp_path, flat, (x,), allow={"dynamic_slice"})
    rows = _x(1, (5, 2))
    _close(m(np.asarray(rows))[0], model.apply(variables, rows, None)[0])
    with sm.serving.Batcher(m, max_batch=4) as b:
        _close(b.submit(np.asarray(rows[:1])).result(30)[0], m(np.asarray(rows[:1]))[0])


@pytest.mark.slow
def test_the_rng_guides_sharp_edge_draws_as_linen_and_its_export_names_the_key_input(tmp_path):
    """rng_guide's sharp edge (no params, a stream named 'rng', a Python int in): the Hybrid
    draws as linen does, the two names' collision included (the guide's point: the same
    values); export refuses to bake the stream in, naming the key as an input."""
    model, key = zoo7.SharpEdgeModel(), jax.random.key(33)
    h = sm.hybridize(model, {}, rngs={"rng": key})
    _, sub = jax.random.split(key)
    got, want = h(0), model.apply({}, 0, rngs={"rng": sub})
    _close(got, want)
    assert got[0] == got[1]  # the guide's own collision, kept
    with pytest.raises(sm.ConfigError, match=r"stream 'rng'.*wrap_key_data"):
        sm.export(h, tmp_path / "x", example=(jnp.zeros(2, jnp.int32),))


@pytest.mark.slow
def test_the_haiku_guides_counter_counts_as_linen_and_exports_as_its_refusal_says(tmp_path):
    """haiku_migration_guide's FooModule: each call adds 1 to its 'counter', as linen's
    ``apply(..., mutable=['counter'])``; export refuses to bake it in, and the step as a
    function of the counter (the refusal's recipe) exports and loads as linen."""
    model, x = zoo7.FooModule(), _x(0, (2, 6))
    variables = model.init(jax.random.key(0), jnp.ones((1, 6)))
    h, want = sm.hybridize(model, variables), dict(variables)
    for _ in range(3):
        out, updates = model.apply(want, x, mutable=["counter"])
        want = {**want, **updates}
        _close(h(x), out)
    _close(h.state, {"counter": want["counter"]})
    with pytest.raises(sm.ConfigError, match=r"'counter'.*jax\.tree\.flatten"):
        sm.export(h, tmp_path / "x", example=(x,))
    leaves, tree = jax.tree.flatten(variables["counter"])
    step = sm.hybridize(lambda p, x, *state: (lambda out, new: (out, *jax.tree.leaves(new)))(
        *model.apply({"params": p, "counter": jax.tree.unflatten(tree, state)}, x,
                     mutable=["counter"])), variables["params"])  # fmt: skip
    m = _exported(tmp_path, step, (x, *leaves), shapes=("b, ...", None))
    got = m(np.asarray(x), np.asarray(leaves[0]))
    out, updates = model.apply(variables, x, mutable=["counter"])
    _close(got, (out, updates["counter"]["count"]))


@pytest.mark.slow
def test_the_haiku_guides_batchnorm_train_step_over_h_apply_equals_its_own():
    """haiku_migration_guide's BatchNorm ``train_step`` (SGD 0.1, ``mutable='batch_stats'``),
    run over the Hybrid's ``h.apply``: the same params and batch_stats after 3 steps."""
    model, (x, labels) = zoo7.BnModel(16, 10), (_x(0, (4, 12)), jnp.arange(4) % 10)
    variables = model.init(jax.random.key(0), jnp.ones((1, 12)), training=False)
    h = sm.hybridize(model, variables)
    step = zoo7.make_bn_train_step(model)
    params, stats = variables["params"], variables["batch_stats"]

    def hybrid_step(params, batch_stats, inputs, labels):  # the guide's, over h.apply
        def loss_fn(params):
            logits, updates = h.apply_with_state(
                {"params": params}, {"batch_stats": batch_stats}, inputs, training=True
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, updates["batch_stats"]

        grads, batch_stats = jax.grad(loss_fn, has_aux=True)(params)
        params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
        return params, batch_stats

    want, got = (params, stats), (h.params["params"], h.state["batch_stats"])
    for _ in range(3):
        want, got = step(*want, x, labels), hybrid_step(*got, x, labels)
    _close(got, want)


@pytest.mark.slow
def test_the_surgery_guides_normalized_kernel_given_by_replace_serves_as_linen(tmp_path):
    """model_surgery.md's CNN, its surgery (flatten, ``Dense_1/kernel`` normalized, unflatten,
    ``freeze``) given to the Hybrid by ``h.replace``: a FrozenDict of params, equal to linen on
    the same, and exported and loaded as it."""
    model, x = zoo7.SurgeryCNN(), _x(0, (2, 8, 8, 1))
    variables = model.init(jax.random.key(0), jnp.ones((1, 8, 8, 1)))
    h = sm.hybridize(model, variables)
    operated = zoo7.surgery(variables["params"])
    h2 = h.replace(params={"params": operated})
    want = model.apply({"params": operated}, x)
    _close(h2(x), want)
    assert not np.allclose(h(x), want)  # the operation changed the answers; h keeps its own
    m = _exported(tmp_path, h2, (x,), allow={"convolution", "reduce_window"})
    _close(m(np.asarray(x)), want)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["shared", "tied"])
def test_nnx_surgery_shared_and_tied_train_as_nnx_grad(how):
    """surgery.md's sharing and weight-tying: the Hybrid's params hold the shared Linear and
    the tied kernel once (as nnx.state), and ``h.apply``'s grads equal ``nnx.grad``'s."""
    x, (model, _) = _x(0, (3, 4)), _nnx_surgery(how)()
    h = sm.hybridize(model)
    want = nnx.grad(lambda m: (m(x) ** 2).sum())(model)
    got = jax.grad(lambda p: (h.apply(p, x) ** 2).sum())(h.params)
    _close(got, nnx.to_pure_dict(want))
    assert ("linear2" not in got) == (how == "shared")


@pytest.mark.slow  # (0.5-0.7 s alone: nnx.Linear's first initializations)
def test_a_monkey_patched_nnx_module_is_refused_naming_nnx_static():
    """surgery.md's monkey-patching (``model.linear2 = awesome_layer``, a function where a
    Linear was): nnx keeps the function in the module's state, and the Hybrid's jit met it as
    an argument, raising JAX's raw TypeError (nnx.jit raises it too); now refused at
    hybridize, naming the attribute and ``nnx.static`` (with which it runs: below)."""
    model = zoo7.TwoLayerMLP(4, rngs=nnx.Rngs(0))

    def awesome_layer(x):
        return x

    model.linear2 = awesome_layer
    with pytest.raises(sm.ConfigError, match=r"state\['linear2'\] holds the function "
                       r".*awesome_layer.*model\.linear2 = nnx\.static"):  # fmt: skip
        sm.hybridize(model)
    with pytest.raises(sm.ConfigError, match=r"linear2"):
        sm.hybridize(lambda m, x: m(x), model)


@pytest.mark.slow
def test_a_monkey_patched_nnx_module_marked_static_runs_as_the_guides():
    """surgery.md's monkey-patching, the function marked ``nnx.static`` as the refusal says:
    the Hybrid gives the guide's ``model.linear1(x)``."""
    model, x = zoo7.TwoLayerMLP(4, rngs=nnx.Rngs(0)), _x(0, (3, 4))

    def awesome_layer(x):
        return x

    model.linear2 = nnx.static(awesome_layer)
    h = sm.hybridize(model)
    _close(h(x), model.linear1(x))
    assert "linear2" not in h.params


@pytest.mark.slow
def test_the_pytree_guides_module_argument_runs_trains_and_exports_as_its_jitted_forward(
    tmp_path,
):
    """pytree.md's ``forward(weights, x)`` over an nnx ``Linear`` passed as a jitted function's
    argument: the Hybrid equals the guide's ``jax.jit(forward)``, its grads nnx's, and it
    exports (batch symbolic), loads and serves as it."""
    weights, x = zoo7.PytreeLinear(2, 3, rngs=nnx.Rngs(0)), _x(0, (5, 2))
    h = sm.hybridize(zoo7.forward, weights)
    _close(h(x), jax.jit(zoo7.forward)(weights, x))
    want = nnx.grad(lambda w: (zoo7.forward(w, x) ** 2).sum())(weights)
    _close(jax.grad(lambda p: (h.apply(p, x) ** 2).sum())(h.params), nnx.to_pure_dict(want))
    m = _exported(tmp_path, h, (x,))
    _close(m(np.asarray(x[:3])), zoo7.forward(weights, x[:3]))
    with sm.serving.Batcher(m, max_batch=4) as b:
        _close(b.submit(np.asarray(x[:1])).result(30), zoo7.forward(weights, x[:1]))


def _mlp_forward(mlp, x):
    """A forward over pytree.md's ``nnx.Pytree`` MLP (the guide gives none): its layers in turn."""
    for layer in mlp.layers:
        x = x @ layer.w + layer.b
    return x


@pytest.mark.slow
def test_an_nnx_pytree_of_plain_arrays_as_params_is_split_as_an_nnx_module():
    """pytree.md's ``nnx.Pytree`` MLP (``nnx.data`` arrays, no Variable) and ``Bar`` (an int
    made data, an ``nnx.List``, a Param) as a function's params: refused before, as 'holding
    ArrayImpl variables, which its calls change', telling to pass the module as the params,
    which it was; now split as an nnx module is (its float arrays the params where it holds no
    Param, as nnx's array leaves; else its Params), equal to the plain function, with grads."""
    mlp, x = zoo7.DataMLP(num_layers=2, dim=3), _x(0, (2, 3))
    h = sm.hybridize(_mlp_forward, mlp)
    _close(h(x), _mlp_forward(mlp, x))
    grads = jax.grad(lambda p: h.apply(p, x).sum())(h.params)
    want = jax.grad(lambda m: _mlp_forward(m, x).sum())(mlp)
    _close(jax.tree.leaves(grads), jax.tree.leaves(want))
    bar = zoo7.Bar(1.0, True)

    def f(b, x):
        return x * b.x + b.y + b.ls[1] + b.bias

    hb = sm.hybridize(f, bar)
    _close(hb(x), f(bar, x))
    assert jax.tree.structure(hb.params) == jax.tree.structure({"bias": 0})


@pytest.mark.slow
def test_the_transforms_guides_train_steps_over_h_apply_equal_nnx_and_jax_transforms():
    """jax_and_nnx_transforms.rst's two train_steps (nnx.jit + nnx.grad on the module; jax.jit
    + jax.grad on ``(graphdef, state)``), 3 steps each from ``nnx.Linear(2, 3, rngs=nnx.Rngs(0))``:
    the guide's step over the Hybrid's ``h.apply`` (SGD 0.1 on ``h.params``), and over a Hybrid
    of ``nnx.merge(graphdef, state)`` taking the nnx.State as its params, give the same params
    and answers."""
    x, y = (
        jax.random.normal(jax.random.key(0), (1, 2)),
        jax.random.normal(jax.random.key(1), (1, 3)),
    )
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    h = sm.hybridize(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    merged = sm.hybridize(lambda state, x: nnx.merge(graphdef, state)(x), state)

    def step(h, params):  # the guide's loss and update, over h.apply
        grads = jax.grad(lambda p: ((h.apply(p, x) - y) ** 2).mean())(params)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    params, merged_params = h.params, merged.params
    for _ in range(3):
        zoo7.nnx_train_step(model, x, y)
        graphdef, state = zoo7.jax_train_step(graphdef, state, x, y)
        params, merged_params = step(h, params), step(merged, merged_params)
    _close(params, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    _close(jax.tree.leaves(merged_params), jax.tree.leaves(state))
    _close(h.replace(params=params)(x), model(x))
    _close(merged.replace(params=merged_params)(x), nnx.merge(graphdef, state)(x))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The 'split' argument of 'fork':DeprecationWarning")
@pytest.mark.filterwarnings("ignore:'sharding' is deprecated:DeprecationWarning")  # the guide's
def test_the_gspmd_guides_sharded_model_runs_trains_and_exports_on_its_mesh(tmp_path):
    """flax_gspmd.md's MultiDotReluDot, made on its 2x4 (data, model) mesh of the 8 CPU devices
    with its params sharded by ``nnx.with_partitioning``: the Hybrid keeps the params' shardings
    and gives the model's answer, sharded over 'data'; the guide's adam ``train_step`` and the
    same step over ``h.apply`` agree (the first step's params to round-off; adam's later steps
    amplify round-off of the differently fused programs: their losses to 1e-3); exported on the
    mesh (batch symbolic), it loads, serves and differentiates as the model, on any rows."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rngs = nnx.Rngs(0)
    with jax.set_mesh(mesh):
        x = jax.device_put(rngs.normal((8, 16)), P("data", None))
        label = jax.device_put(rngs.normal((8, 16)), P("data", None))
        model = zoo7.MultiDotReluDot(16, 2, rngs=nnx.Rngs(0))
        h, want = sm.hybridize(model), model(x)
        got = h(x)
        _close(got, want)
        assert got.sharding.spec[0] == "data"
        spec = jax.tree.map(lambda a: a.sharding.spec, h.params)
        assert spec["layers"]["dot1"]["kernel"] == P(None, None, "model")
        sm.export(h, tmp_path / "m", example=(x,), vjp_order=1)
        optimizer, tx = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), optax.adam(1e-3)

        @jax.jit
        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(lambda p: jnp.mean((h.apply(p, x) - y) ** 2))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        params, opt_state = h.params, tx.init(h.params)
        for i in range(5):
            model, loss = zoo7.gspmd_train_step(model, optimizer, x, label)
            params, opt_state, hybrid_loss = step(params, opt_state, x, label)
            np.testing.assert_allclose(hybrid_loss, loss, rtol=1e-3)
            if i == 0:
                _close(params, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    m = sm.load(
        tmp_path / "m", allow={"dynamic_slice", "dynamic_update_slice", "real_dynamic_slice"}
    )
    rows = np.asarray(x)[:3]
    _close(m(rows), want[:3])
    with sm.serving.Batcher(m, max_batch=4) as b:
        _close(b.submit(rows[:1]).result(30), want[:1])
    source = jax.grad(lambda x: h.apply(h.params, x).sum())
    with jax.set_mesh(mesh):
        want_grads = source(jnp.asarray(rows))
    loss = jax.grad(lambda x: m(x).sum())
    with pytest.raises(sm.ConfigError, match=r"jax\.set_mesh\(jax\.make_mesh\(\(2, 4\)"):
        loss(jnp.asarray(rows))  # sharded over 8 devices: the mesh set around, as it says
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"))):
        _close(loss(jnp.asarray(rows)), want_grads)


@pytest.mark.slow
def test_the_ensembling_guides_pmapped_ensemble_trains_over_h_apply_as_over_linen(tmp_path):
    """ensembling.rst: an ensemble of 8 CNNs, one per CPU device, made by its pmapped
    ``create_train_state``; one epoch of its ``train_epoch`` (pmapped ``apply_model`` with
    ``pmean`` of the members' probabilities, ``update_model``) over a Hybrid's ``h.apply`` gives
    linen's states, losses and accuracies. (Its fake data are zeros; random images here, so the
    members' convolutions train.) The ensemble's mean probabilities, hybridized over the
    stacked params, export (batch symbolic), load, serve and differentiate as the members'."""
    from flax import jax_utils

    linen = zoo7.make_ensemble(zoo7.SurgeryCNN().apply, init_shape=(1, 8, 8, 1))
    create_train_state, _, _, train_epoch = linen
    state = create_train_state(jax.random.split(jax.random.key(0), jax.device_count()), 0.1, 0.9)
    h = sm.hybridize(zoo7.SurgeryCNN(), {"params": jax_utils.unreplicate(state.params)})
    hybrid_train_epoch = zoo7.make_ensemble(h.apply, init_shape=(1, 8, 8, 1))[3]
    images, labels = _x(1, (32, 8, 8, 1)), jnp.arange(32) % 10
    train_ds = {"image": images, "label": labels}
    want = train_epoch(state, train_ds, 8, jax.random.key(1))
    got = hybrid_train_epoch(state, train_ds, 8, jax.random.key(1))
    _close(got[0].params, want[0].params)
    _close(got[1:], want[1:])
    stacked = want[0].params

    def ensemble(params, x):  # the members' mean probabilities, as apply_model's pmean
        return jnp.mean(jax.vmap(lambda p: jax.nn.softmax(h.apply({"params": p}, x)))(params), 0)

    x = images[:4]
    probs = jnp.mean(
        jnp.stack([jax.nn.softmax(zoo7.SurgeryCNN().apply({"params": p}, x))
                   for p in (jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(8))]),
        0,
    )  # fmt: skip
    served = sm.hybridize(ensemble, stacked)
    _close(served(x), probs)
    m = _exported(tmp_path, served, (x,), allow={"convolution", "reduce_window"}, vjp_order=1)
    _close(m(np.asarray(x[:3])), probs[:3])
    with sm.serving.Batcher(m, max_batch=4) as b:
        _close(b.submit(np.asarray(x[:1])).result(30), probs[:1])
    _close(jax.grad(lambda x: m(x)[:, 0].sum())(x), jax.grad(lambda x: served(x)[:, 0].sum())(x))


@pytest.mark.slow
def test_the_sharp_bits_dropout_as_a_module_attribute_runs_as_linen(tmp_path):
    """flax_sharp_bits.md's ``MyModel`` (its dropout mode the module's ``training``
    attribute, no call flag; 3-d inputs): ``training=False`` as the guide's ``apply`` with its
    dropout key (off), exported (batch symbolic) and loaded as it; ``training=True`` (its
    ``clone``) draws from the Hybrid's 'dropout' stream as linen does, export refusing to bake
    the stream in."""
    root_key = jax.random.key(seed=0)
    main_key, params_key, dropout_key = jax.random.split(key=root_key, num=3)
    my_model = zoo7.MyModel(num_neurons=3, training=False)
    x = jax.random.uniform(key=main_key, shape=(3, 4, 4))
    variables = my_model.init(params_key, x)
    y = my_model.apply(variables, x, rngs={"dropout": dropout_key})
    h = sm.hybridize(my_model, variables, rngs=dropout_key)
    _close(h(x), y)
    m = _exported(tmp_path, h, (x,))
    _close(m(np.asarray(x[:2])), y[:2])
    training = my_model.clone(training=True)
    ht = sm.hybridize(training, variables, rngs=dropout_key)
    _, sub = jax.random.split(dropout_key)
    got = ht(x)
    _close(got, training.apply(variables, x, rngs={"dropout": sub}))
    assert (got == 0).any() and not (y == 0).any()
    with pytest.raises(sm.ConfigError, match=r"stream 'dropout'.*wrap_key_data"):
        sm.export(ht, tmp_path / "t", example=(x,))


@pytest.mark.slow
def test_the_lr_schedule_guides_steps_equal_the_librarys_train_step_and_the_hybrids():
    """lr_schedule.rst: its warmup-cosine schedule in ``optax.sgd``; 4 steps of its
    ``train_step`` (over linen's apply, and over the Hybrid's ``h.apply``) and of
    ``sm.training.train_step`` with the same optimizer give the same params and losses, and
    the schedule's learning rates (0 at step 0, rising in the warm-up)."""
    config = zoo7.get_config()
    config.batch_size, config.train_ds_size = 8, 16
    steps_per_epoch = config.train_ds_size // config.batch_size
    learning_rate_fn = zoo7.create_learning_rate_fn(config, 0.1, steps_per_epoch)
    state = zoo7.create_train_state(jax.random.key(0), config, learning_rate_fn, (1, 8, 8, 1))
    h = sm.hybridize(zoo7.SurgeryCNN(), {"params": state.params})
    guide_step = zoo7.make_lr_train_step(zoo7.SurgeryCNN().apply)
    hybrid_step = zoo7.make_lr_train_step(h.apply)
    tx = optax.sgd(learning_rate_fn, config.momentum)
    step = jax.jit(sm.training.train_step(zoo7.SurgeryCNN(), tx))
    params, opt_state, hybrid_state = state.params, tx.init(state.params), state
    batch = {"image": _x(2, (8, 8, 8, 1)), "label": jnp.arange(8) % 10}
    rates = []
    for _ in range(4):
        state, metrics = guide_step(state, batch, learning_rate_fn)
        hybrid_state, hybrid_metrics = hybrid_step(hybrid_state, batch, learning_rate_fn)
        params, opt_state, ours = step(params, opt_state, batch["image"], batch["label"],
                                       jnp.ones(8))  # fmt: skip
        _close(hybrid_metrics, metrics)
        _close(ours["loss"], metrics["loss"])
        rates.append(float(metrics["learning_rate"]))
    _close(hybrid_state.params, state.params)
    _close(params, state.params)
    assert rates[0] == 0.0 and rates[0] < rates[1] < rates[2]


@pytest.mark.slow  # (nnx.Linear's first initializations: over 0.5 s alone)
def test_an_nnx_module_given_as_its_hybrids_params_is_refused_naming_its_values():
    """pytree.md passes its nnx module itself to its jitted ``forward(weights, x)``; given so to
    ``h.apply`` (or ``h.replace(params=)``), the refusal listed the same names twice, 'missing
    params['kernel'], unexpected params.kernel'; now it says the module was given, not its
    values, and names ``nnx.state(module, nnx.Param)``, which runs as the guide's forward."""
    weights, x = zoo7.PytreeLinear(2, 3, rngs=nnx.Rngs(0)), jnp.ones((1, 2))
    h = sm.hybridize(zoo7.forward, weights)
    said = r"nnx module PytreeLinear itself, not its values.*nnx\.state\(module, nnx\.Param\)"
    with pytest.raises(sm.ConfigError, match=said):
        h.apply(weights, x)
    with pytest.raises(sm.ConfigError, match=said):
        h.replace(params=weights)(x)
    _close(h.apply(nnx.state(weights, nnx.Param), x), zoo7.forward(weights, x))


@pytest.mark.slow
def test_an_nnx_pytree_of_plain_arrays_inside_the_params_is_a_pytree_of_them(tmp_path):
    """pytree.md's ``nnx.Pytree`` MLP inside plain params (``{'mlp': mlp}``): refused before as
    'holding ArrayImpl variables, which its calls change' (under ``h.apply``: 'holding
    DynamicJaxprTracer variables'), though it holds no Variable; now its arrays are the params'
    leaves, as any pytree's: equal to the plain function, grads as JAX's, exported and loaded.
    An nnx module holding a BatchStat inside the params is still refused (test_hybrid_state)."""
    mlp, x = zoo7.DataMLP(num_layers=2, dim=3), _x(0, (2, 3))

    def fn(p, x):
        return _mlp_forward(p["mlp"], x)

    h = sm.hybridize(fn, {"mlp": mlp})
    _close(h(x), _mlp_forward(mlp, x))
    grads = jax.grad(lambda p: h.apply(p, x).sum())(h.params)
    want = jax.grad(lambda p: fn(p, x).sum())({"mlp": mlp})
    _close(jax.tree.leaves(grads), jax.tree.leaves(want))
    m = _exported(tmp_path, h, (x,))
    _close(m(np.asarray(x)), _mlp_forward(mlp, x))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:'.value' (access|setter) is now deprecated")  # the guide's
def test_the_nnx_haiku_guides_counter_counts_as_nnx_and_exports_as_its_refusal_says(tmp_path):
    """haiku_to_flax.rst's nnx FooModule (a ``Counter(nnx.Variable)`` each call adds 1 to, with
    the guide's deprecated ``.value``): the Hybrid's calls and counter are eager nnx's; export
    refuses to bake the counter in, and one step as a function of it, over the guide's own
    ``nnx.split(model, nnx.Param, Counter)``, exports (batch symbolic) and loads as nnx."""
    model, eager = (zoo7.NnxFooModule(rngs=nnx.Rngs(0)) for _ in range(2))
    x = _x(0, (2, 6))
    h = sm.hybridize(model)
    for _ in range(3):
        _close(h(x), eager(x))
    _close(h.state, {"counter": eager.counter[...]})
    with pytest.raises(sm.ConfigError, match=r"'counter'.*one step as a function of that state"):
        sm.export(h, tmp_path / "x", example=(x,))
    graphdef, params, counter = nnx.split(
        zoo7.NnxFooModule(rngs=nnx.Rngs(0)), nnx.Param, zoo7.Counter
    )

    def step(params, x, count):
        m = nnx.merge(graphdef, params, jax.tree.map(lambda _: count, counter))
        return m(x), m.counter[...]

    m = _exported(tmp_path, sm.hybridize(step, params), (x, jnp.int32(5)), shapes=("b, ...", None))
    fresh = zoo7.NnxFooModule(rngs=nnx.Rngs(0))
    fresh.counter[...] = jnp.int32(5)
    _close(m(np.asarray(x), np.int32(5)), (fresh(x), fresh.counter[...]))


@pytest.mark.slow
def test_the_nnx_haiku_guides_dropout_train_step_over_h_apply_equals_its_own():
    """haiku_to_flax.rst's nnx ``train_step`` (``model.train()``, dropout drawing from the
    module's Rngs, SGD 0.1 over ``nnx.split(model, nnx.Param, ...)``), 3 steps; the same over
    the Hybrid's ``h.apply_with_state`` (its rng state threaded) gives the same params and
    rng state, and the trained Hybrid in eval mode nnx's ``model.eval()`` answers."""
    model, labels = zoo7.NnxModel(12, 16, 10, rngs=nnx.Rngs(0)), jnp.arange(4) % 10
    hybridized = zoo7.NnxModel(12, 16, 10, rngs=nnx.Rngs(0))
    h = sm.hybridize(hybridized)
    model.train()  # set deterministic=False
    params, state, x = h.params, h.state, _x(0, (4, 12))

    def loss(params, state):
        logits, state = h.apply_with_state(params, state, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), state

    for _ in range(3):
        zoo7.nnx_hk_train_step(model, x, labels)
        grads, state = jax.grad(loss, has_aux=True)(params, state)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    _close(params, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    _close(keyless(state), keyless(nnx.state(model, nnx.Not(nnx.Param))))
    model.eval()
    hybridized.eval()  # the Hybrid's module: its mode switches the Hybrid
    _close(h.replace(params=params, state=state)(x), model(x))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring")  # the guide's
def test_the_nnx_surgery_guides_renamed_checkpoint_restores_and_replaces_as_nnx(tmp_path):
    """surgery.md's checkpoint surgery: ``TwoLayerMLP``'s state saved by Orbax, restored as a
    raw dict, ``linear1/2`` renamed ``layer1/2``, fitted into ``ModifiedTwoLayerMLP`` by
    ``nnx.replace_by_pure_dict``: the restored model's Hybrid answers as the old model; the
    same renaming given to a fresh ModifiedTwoLayerMLP's Hybrid by ``h.replace`` does too,
    and the old names given unrenamed are refused naming both."""
    import orbax.checkpoint as orbax

    x = jnp.ones((3, 4))
    checkpointer = orbax.PyTreeCheckpointer()
    old_model = zoo7.TwoLayerMLP(4, rngs=nnx.Rngs(0))
    checkpointer.save(tmp_path / "nnx-surgery-state", nnx.state(old_model), force=True)
    raw_dict = checkpointer.restore(tmp_path / "nnx-surgery-state")
    raw_dict["layer1"] = raw_dict.pop("linear1")
    raw_dict["layer2"] = raw_dict.pop("linear2")
    abs_model = nnx.eval_shape(lambda: zoo7.ModifiedTwoLayerMLP(4, rngs=nnx.Rngs(0)))
    graph_def, state = nnx.split(abs_model)
    nnx.replace_by_pure_dict(state, zoo7.process_raw_dict(raw_dict))
    restored_model = nnx.merge(graph_def, state)
    want = old_model(x)
    _close(sm.hybridize(restored_model)(x), want)
    h_old = sm.hybridize(old_model)
    h = sm.hybridize(zoo7.ModifiedTwoLayerMLP(4, rngs=nnx.Rngs(1)))
    renamed = {"layer1": h_old.params["linear1"], "layer2": h_old.params["linear2"]}
    _close(h.replace(params=renamed)(x), want)
    with pytest.raises(sm.ConfigError, match=r"missing .*'layer1'.*unexpected .*'linear1'"):
        h.replace(params=h_old.params)(x)


@pytest.mark.slow
def test_the_nnx_surgery_guides_partially_initialized_lora_model_hybridizes_and_exports(tmp_path):
    """surgery.md's memory-efficient partial initialization (an ``nnx.jit``-made TwoLayerMLP
    whose ``linear1`` is a LoRALinear, the old state donated into it): its Hybrid holds the
    LoRA params beside the old ones, answers as it, and exports (batch symbolic) and loads."""
    old_state = nnx.state(zoo7.TwoLayerMLP(4, rngs=nnx.Rngs(0)))
    good_model, x = zoo7.partial_init(old_state, nnx.Rngs(42)), _x(0, (3, 4))
    h = sm.hybridize(good_model)
    assert set(h.params["linear1"]["lora"]) == {"lora_a", "lora_b"}
    want = good_model(x)
    _close(h(x), want)
    m = _exported(tmp_path, h, (x,))
    _close(m(np.asarray(x[:2])), want[:2])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["shared", "replaced"])
def test_nnx_surgery_after_hybridize_is_refused_by_export_and_a_batcher(how, tmp_path):
    """surgery.md's sharing (``model.linear2 = model.linear1``) or monkey-patching (an
    ``nnx.static`` function in ``linear2``'s place) done to a module after ``sm.hybridize``: the
    Hybrid runs the module as hybridized (its Params held then), and export wrote that
    silently, an artifact of a model that no longer is (a swap was refused, as trained in
    place); now export and a Batcher refuse both, naming the Params gone and the module
    operated on; hybridized again, it exports as it is now."""
    model, x = zoo7.TwoLayerMLP(4, rngs=nnx.Rngs(0)), _x(0, (3, 4))
    h = sm.hybridize(model)
    if how == "shared":
        model.linear2 = model.linear1
    else:
        model.linear2 = nnx.static(lambda x: x)
    said = r"holds other Params \(\['linear2'\]\['bias'\], \['linear2'\]\['kernel'\]\).*operated on"
    with pytest.raises(sm.ConfigError, match=said):
        sm.export(h, tmp_path / "x", example=(x,))
    with pytest.raises(sm.ConfigError, match=said):
        sm.serving.Batcher(h, example=x[:1], max_batch=4)
    m = _exported(tmp_path, sm.hybridize(model), (x,))
    _close(m(np.asarray(x)), model(x))
