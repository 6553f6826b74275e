"""Code we did not write, round thirteen: Flax's and Equinox's docs where no round looked, as
their authors wrote them (tests/zoo13.py; sources and commits there), over every feature:
hybridize, ``h(x)`` equal to the plain model, its graph, export (a symbolic batch where the
model allows one) + load + call equal, grads/Hessians over the loaded model (``vjp_order=2``),
a Batcher's answers, and the original's own steps where it trains.

- why.rst: ``Model`` trains by the guide's ``train_step`` as by ``h.apply_with_state`` (its
  dropout masks and batch statistics carried alike); ``AutoEncoder.encode`` hybridized as
  ``sm.hybridize(model.encode)`` (nnx: over the module's params; linen: refused naming
  ``method=``); the LoRA surgery's ``LoraParam`` s are params, trained alone as
  ``nnx.DiffState`` trains them; ``WeightStack`` and ``vector_dot`` (``nnx.vmap``,
  ``out_axes=1``): static batch, as the default batch's refusal says.
- filters_guide.md: int ``Param`` s, a bool ``BatchStat``, a ``Param`` subclass.
- arguments.md: ``nn.merge_param``'s dropout passed down a ``ResidualModel``'s blocks.
- setup_or_nncompact.rst: the two MLPs are one (the same params, the same answers).
- recurrent.py: ``Bidirectional`` (with ``seq_lengths``, int rows), ``RNN(return_carry=True)``.
- Equinox: pattern.md's ``CubicInterpolation`` (its ``AbstractVar``), the FAQ's buffer and
  ``rollout``, ``error_if`` (export's refusal names ``EQX_ON_ERROR``), ``filter_custom_jvp``'s
  rule through the loaded model, ``field(converter=...)``/``static=True``.
"""

import functools
import os
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo13
from features import close, every_feature
from flax import nnx
from helpers import NnxDropout
from jax import random

import symjax_mlp as sm

SLICE = {"real_dynamic_slice"}  # a scan's slices of a symbolic batch; load() names it
LOOP = {"while", "dynamic_slice", "dynamic_update_slice"}  # a scan of a symbolic length
UPDATE = {"dynamic_update_slice"}  # a scan's outputs written per step
AE = None  # a script's module-level model (why.rst's ``model = AutoEncoder(...)``), set by a test


def _x(seed, shape):
    return random.normal(random.key(seed), shape)


# -- docs_nnx/why.rst ---------------------------------------------------------------------------


def test_hybridize_of_an_nnx_modules_method_runs_it_over_the_modules_params():
    """``sm.hybridize(model.encode)`` of why.rst's nnx ``AutoEncoder``: ``encode(model, x)``
    over the module's params (as ``sm.hybridize(AutoEncoder.encode, model)``). It was refused
    naming ``hybridize(lambda _, x: f(x), {})``, which bakes the params into the program: no
    params to train, none exported."""
    model = zoo13.AutoEncoder(nnx.Rngs(0))
    x = _x(1, (4, 2))
    h = sm.hybridize(model.encode)
    assert h.name == "encode"
    close(h.params, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    close(h(x), model.encode(x))


class EqxAutoEncoder(eqx.Module):
    """Ours: why.rst's nnx ``AutoEncoder`` written in equinox (a row at a time)."""

    encoder: eqx.nn.Linear
    decoder: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = random.split(key)
        self.encoder, self.decoder = eqx.nn.Linear(2, 10, key=k1), eqx.nn.Linear(10, 2, key=k2)

    def __call__(self, x):
        return self.decoder(self.encoder(x))

    def encode(self, x):
        return jax.vmap(self.encoder)(x)


def test_hybridize_of_an_equinox_modules_method_takes_the_modules_params():
    """``sm.hybridize(model.encode)`` of an equinox module: its params are the module's (as
    ``sm.hybridize(EqxAutoEncoder.encode, model)``), so the model trained is given by
    ``h.replace(params=eqx.filter(trained, eqx.is_inexact_array))``. They were equinox's
    ``BoundMethod``'s: that replace was refused, the artifact's params named
    ``__self__/encoder/weight``, the Hybrid ``BoundMethod``."""
    model, x = EqxAutoEncoder(random.key(0)), _x(1, (4, 2))
    h = sm.hybridize(model.encode)
    assert h.name == "encode"
    trained = eqx.tree_at(lambda m: m.encoder.weight, model, 2.0 * model.encoder.weight)
    close(h.replace(params=eqx.filter(trained, eqx.is_inexact_array))(x), trained.encode(x))


def _encode(x):
    return AE.encode(x)  # the module-level model, read as a script reads it


def test_hybridize_of_a_function_holding_a_module_names_it_as_the_params():
    """``sm.hybridize(fn)`` of a function holding a module (``functools.partial(f, model)``,
    a global it reads, an equinox module in its closure): refused naming
    ``sm.hybridize(f, model)``. It named ``hybridize(lambda _, x: f(x), {})``, which bakes
    the module's params into the program (only an nnx module in a closure was caught)."""
    global AE
    AE = zoo13.AutoEncoder(nnx.Rngs(0))
    linear = eqx.nn.Linear(2, 3, key=random.key(0))
    rows = lambda m, r: jax.vmap(m)(r)  # noqa: E731
    nnx_held, eqx_held = r"closes over an nnx AutoEncoder", r"holds an equinox Linear"
    for fn, said in (
        (functools.partial(zoo13.AutoEncoder.encode, AE), nnx_held),
        (_encode, nnx_held),
        (functools.partial(rows, linear), eqx_held),
        (lambda r: rows(linear, r), eqx_held),
    ):
        with pytest.raises(sm.ConfigError, match=said + r".*sm\.hybridize\(f, model\)"):
            sm.hybridize(fn)
    h = sm.hybridize(rows, linear)  # as it says: its weight and bias are the params
    assert [a.shape for a in jax.tree.leaves(h.params)] == [(3, 2), (3,)]


@pytest.mark.slow  # five compiles (1.5 s)
def test_hybridize_of_a_partial_of_a_modules_call_or_method_runs_over_its_params():
    """``sm.hybridize(functools.partial(model, deterministic=True))`` (or of ``model.method``)
    got the generic 'needs params' refusal, whose ``lambda _, x: f(x), {}`` bakes the module's
    weights into the program: it runs over the module's params, as ``model.method`` does."""
    model, x = NnxDropout(nnx.Rngs(0)), _x(2, (4, 5))
    for partial in (
        functools.partial(model, deterministic=True),
        functools.partial(model.__call__, deterministic=True),
    ):
        h = sm.hybridize(partial)
        close(h(x), model(x, deterministic=True))
        doubled = jax.tree.map(lambda a: 2 * a, h.params)  # the weights are inputs, not constants
        nnx.update(twin := nnx.clone(model), doubled)
        close(h.apply(doubled, x)[0], twin(x, deterministic=True))  # (out, its rng state)
    mlp = eqx.nn.MLP(5, 3, 8, 1, key=random.key(0))
    h = sm.hybridize(functools.partial(mlp, key=None))
    close(h(x[0]), mlp(x[0]))
    assert len(jax.tree.leaves(h.params)) == len(jax.tree.leaves(eqx.filter(mlp, eqx.is_array)))


def test_hybridize_of_a_partial_fixing_a_modules_input_names_it_as_the_params():
    """A partial that fixes an input as well got the generic refusal whose fix bakes the
    module's weights in; it names ``sm.hybridize(f, model)``, as other holders of one do."""
    model, x = NnxDropout(nnx.Rngs(0)), _x(2, (4, 5))
    for partial in (functools.partial(model, x), functools.partial(model.__call__, x)):
        with pytest.raises(sm.ConfigError, match=r"nnx NnxDropout.*sm\.hybridize\(f, model\)"):
            sm.hybridize(partial)


@pytest.mark.slow
def test_why_autoencoder_encode_every_feature(tmp_path):
    """``sm.hybridize(model.encode)``: every feature, batch symbolic; its grads over the params
    are ``nnx.grad``'s (the decoder's zero)."""
    model = zoo13.AutoEncoder(nnx.Rngs(0))
    x = _x(1, (4, 2))
    h = sm.hybridize(model.encode)
    every_feature(tmp_path, h, model.encode, x)
    grads = jax.grad(lambda p: h.apply(p, x).sum())(h.params)
    close(grads, nnx.to_pure_dict(nnx.grad(lambda m: m.encode(x).sum())(model)))
    close(grads["decoder"], jax.tree.map(jnp.zeros_like, h.params["decoder"]))


def test_hybridize_of_a_linen_modules_method_is_refused_naming_method():
    """``sm.hybridize(model.encode, variables)`` of why.rst's linen ``AutoEncoder`` (its
    ``model.apply(..., method='encode')``): refused naming the function of the params that
    applies it, which runs as the guide's. It was a SignatureError saying encode took no
    inputs, its fix ``h()``; a Batcher of it, flax's AttributeError at its warm-up."""
    model, x = zoo13.LinenAutoEncoder(), jnp.ones((1, 2))
    params = model.init(random.key(0), x)["params"]
    for given in ({"params": params}, None):
        with pytest.raises(sm.ConfigError, match=r"LinenAutoEncoder\.encode\).*method='encode'"):
            sm.hybridize(model.encode, given)
    h = sm.hybridize(lambda p, *xs: model.apply({"params": p}, *xs, method="encode"), params)
    close(h(x), model.apply({"params": params}, x, method="encode"))
    h = sm.hybridize(model.apply, {"params": params})  # model.apply is fn(variables, *inputs)
    close(h(x), model.apply({"params": params}, x))
    with pytest.raises(sm.ConfigError, match=r"Batcher\(LinenAutoEncoder.encode\).*method='encode"):
        sm.serving.Batcher(model.encode, example=x)  # was flax's AttributeError at warm-up


@pytest.mark.slow
def test_why_model_every_feature_and_the_guides_train_step(tmp_path):
    """why.rst's ``Model`` (widths cut to 16): evaluated, every feature, batch symbolic; in
    training, three steps of ``h.apply_with_state`` (optax's adam) equal three of the guide's
    ``train_step`` (``nnx.Optimizer``, in place): the same dropout masks, the same batch
    statistics, the same params (but the bias before the BatchNorm: its grads are zero, and
    adam's steps of their rounding noise differ)."""
    model = zoo13.Model(2, 16, 3, rngs=nnx.Rngs(0))
    x, y = _x(1, (6, 2)), _x(2, (6, 3))
    evaluated = nnx.clone(model)
    evaluated.eval()
    every_feature(tmp_path, sm.hybridize(evaluated), evaluated, x)
    h = sm.hybridize(model)
    tx = optax.adam(1e-3)
    params, state, opt = h.params, h.state, tx.init(h.params)

    def loss(p, s):
        out, s = h.apply_with_state(p, s, x)
        return ((out - y) ** 2).mean(), s

    ours = []
    for _ in range(3):
        (value, state), grads = jax.value_and_grad(loss, has_aux=True)(params, state)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        ours.append(value)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    theirs = [zoo13.train_step(model, optimizer, x, y) for _ in range(3)]
    close(ours, theirs)
    trained = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    close(grads["linear"]["bias"], jnp.zeros(16), atol=1e-6)  # the BatchNorm takes its mean
    for p in (params, trained):  # so adam steps it by rounding noise: compared apart
        p["linear"] = {"kernel": p["linear"]["kernel"]}
    close(params, trained)
    stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))["bn"]
    close(state["bn"]["var"], stats["var"])
    close(state["bn"]["mean"], stats["mean"], atol=1e-4)  # of outputs after that bias


@pytest.mark.slow
def test_why_lora_surgery_params_train_alone(tmp_path):
    """why.rst's LoRA surgery (``nnx.iter_graph``, ``LoraLinear`` over the ``Block``'s
    Linear): evaluated, every feature, batch symbolic; its ``LoraParam`` s are params beside
    the Linear's; grads over them alone through ``h.apply`` equal ``nnx.grad`` of
    ``nnx.DiffState(0, LoraParam)``."""
    model = zoo13.lora_block()
    model.eval()
    x = _x(1, (4, 5))
    h = sm.hybridize(model)
    every_feature(tmp_path, h, model, x)
    assert {"A", "B", "linear"} <= h.params["linear"].keys()
    lora = {"A": h.params["linear"]["A"], "B": h.params["linear"]["B"]}

    def ours(ab):
        p = {**h.params, "linear": {**h.params["linear"], **ab}}
        return h.apply(p, x)[0].sum()  # (out, new_state): the BatchNorm's, the Rngs'

    want = nnx.grad(lambda m: m(x).sum(), argnums=nnx.DiffState(0, zoo13.LoraParam))(model)
    close(jax.grad(ours)(lora), nnx.to_pure_dict(want)["linear"])


@pytest.mark.slow
def test_why_weight_stack_and_vector_dot_export_their_static_batch(tmp_path):
    """why.rst's ``WeightStack`` (``nnx.vmap`` on ``__init__`` and ``__call__``) and
    ``vector_dot`` under ``nnx.vmap``: one row per stacked member, ``out_axes=1``; the
    default batch's refusal names ``batch=None``; so exported, the loaded models equal, their
    grads and Hessians too; a Batcher refuses the (3, 10) output as not per row."""
    x = _x(1, (10, 2))
    weights = nnx.vmap(zoo13.create_weights, in_axes=0, out_axes=0)(jnp.arange(10))
    stack = zoo13.WeightStack(jnp.arange(10))
    close(stack(x), zoo13.stacked_dot(weights, x))  # the two spellings are one
    for name, h, module, fn in (
        ("stack", sm.hybridize(stack), stack, lambda m, r: m(r)),
        ("dot", sm.hybridize(zoo13.stacked_dot, weights), weights, zoo13.stacked_dot),
    ):
        graphdef, held = nnx.split(module)
        # a module per call, made inside the transform (nnx's own limit: one made outside it
        # and called under jax.grad raises "Cannot extract graph node from different trace")
        ref = lambda r: fn(nnx.merge(graphdef, nnx.clone(held)), r)  # noqa: E731, B023
        close(h(x), ref(x))
        assert h(x).shape == (3, 10) and h.graph(x).flops > 0
        with pytest.raises(sm.SignatureError, match=r"10 rows.*Pass batch=None"):
            sm.export(h, tmp_path / f"{name}-b", example=(x,))
        sm.export(h, tmp_path / name, example=(x,), batch=None, vjp_order=2)
        m = sm.load(tmp_path / name)
        close(m(np.asarray(x)), ref(x))
        close(jax.grad(lambda r: m(r).sum())(x), jax.grad(lambda r: ref(r).sum())(x))  # noqa: B023
        hess = lambda f: jax.jacrev(jax.jacrev(lambda r: (f(r) ** 2).sum()))(x)  # noqa: E731
        close(hess(m), hess(ref))
        with pytest.raises(sm.ConfigError, match=r"\(3, 10\) for a batch of 10"):
            sm.serving.Batcher(m)


# -- docs_nnx/guides/filters_guide.md -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`flax.nnx.State` will be deprecated")  # the guide's split
def test_filters_guide_int_params_a_bool_batch_stat_and_a_param_subclass(tmp_path):
    """The guide's ``Foo`` (``nnx.Param(0)``, ``nnx.BatchStat(True)``) and ``Bar`` (a
    ``SpecialParam``): their int Params are the Hybrid's params (the SpecialParam too, as the
    guide's own ``split(bar, SpecialParam, nnx.Param)`` finds them), the BatchStat held as
    state; every feature, batch symbolic."""
    x = _x(1, (4, 3))
    foo, bar = zoo13.Foo(), zoo13.Bar()
    hf = sm.hybridize(zoo13.net_foo, foo)
    assert hf.params == {"a": 0} and hf.state == {"b": True}
    every_feature(tmp_path / "foo", hf, lambda r: zoo13.net_foo(foo, r), x)
    hb = sm.hybridize(zoo13.net_bar, bar)
    _, special, params = zoo13.split(bar, zoo13.SpecialParam, nnx.Param)
    assert hb.params == nnx.to_pure_dict(nnx.merge_state(special, params)) == {"a": 0, "b": 0}
    every_feature(tmp_path / "bar", hb, lambda r: zoo13.net_bar(bar, r), x)
    close(hb.replace(params={"a": 2, "b": 1})(x), 3 * x + 1)


# -- docs/guides/flax_fundamentals: arguments.md, setup_or_nncompact.rst ------------------------


@pytest.mark.slow
def test_arguments_residual_model_dropout_passed_down(tmp_path):
    """arguments.md's ``ResidualModel`` (``MyDropout``'s ``nn.merge_param``, a template
    passed to its blocks): ``train=False`` every feature (exported with
    ``kwargs={'train': False}``); ``train=True`` with a key per call, as ``h.apply``'s refusal
    of ``rngs=`` says, is ``model.apply``'s, bitwise; export of ``train=True`` is refused
    naming the key input."""
    model, x = zoo13.ResidualModel(drop_rate=0.5), _x(1, (5, 4))
    variables = model.init(random.key(0), x, train=False)
    h = sm.hybridize(model, variables, rngs={"dropout": random.key(3)})
    close(h(x, train=False), model.apply(variables, x, train=False))
    evaluated = sm.hybridize(lambda v, r: model.apply(v, r, train=False), variables)
    every_feature(tmp_path, evaluated, lambda r: model.apply(variables, r, train=False), x)
    key = random.key(7)
    with pytest.raises(sm.ConfigError, match=r"for a key per call, hybridize"):
        h.apply(variables, x, train=True, rngs={"dropout": key})
    keyed = sm.hybridize(  # as it says
        lambda v, r, k: model.apply(v, r, train=True, rngs={"dropout": k}), variables
    )
    got = keyed(x, key)
    np.testing.assert_array_equal(got, model.apply(variables, x, train=True, rngs={"dropout": key}))
    assert not np.allclose(got, h(x, train=False))
    sm.export(h, tmp_path / "k", example=(x,), kwargs={"train": False})
    close(sm.load(tmp_path / "k")(x[:2]), model.apply(variables, x[:2], train=False))
    with pytest.raises(sm.ConfigError, match=r"rng stream 'dropout'.*wrap_key_data"):
        sm.export(h, tmp_path / "t", example=(x,), kwargs={"train": True})


@pytest.mark.slow
def test_setup_and_compact_mlps_are_one(tmp_path):
    """setup_or_nncompact.rst's two ``MLP`` s: the same param tree, each every feature, batch
    symbolic; one's Hybrid given the other's params answers as the other."""
    x = _x(1, (4, 3))
    setup, compact = zoo13.SetupMLP(), zoo13.CompactMLP()
    vs, vc = setup.init(random.key(0), x), compact.init(random.key(1), x)
    assert jax.tree.structure(vs) == jax.tree.structure(vc)
    hs = sm.hybridize(setup, vs)
    every_feature(tmp_path / "s", hs, lambda r: setup.apply(vs, r), x)
    every_feature(tmp_path / "c", sm.hybridize(compact, vc), lambda r: compact.apply(vc, r), x)
    close(hs.replace(params=vc)(x), compact.apply(vc, x))


# -- flax/nnx/nn/recurrent.py ----------------------------------------------------------------------


def _fresh(module):
    """The module, a copy per call made inside the transform (nnx's own limit: an RNN's Rngs
    counted under jax.grad raises TraceContextError)."""
    graphdef, held = nnx.split(module)
    return lambda *a, **k: nnx.merge(graphdef, nnx.clone(held))(*a, **k)


@pytest.mark.slow
def test_bidirectional_rnn_with_and_without_seq_lengths(tmp_path):
    """``Bidirectional``'s docstring layer (two ``RNN`` s of a ``GRUCell``, its Rngs held as
    state): every feature, batch symbolic; with ``seq_lengths`` (int rows beside the float
    ones, the backward RNN flipping each row by its length) the loaded model, its grads and a
    Batcher's answers equal the layer's."""
    layer = zoo13.bidirectional()
    x = _x(1, (4, 3, 3))
    assert layer(x).shape == (4, 3, 8)  # the docstring's (2, 3, 8), batch 4
    ref = _fresh(layer)
    every_feature(tmp_path / "x", sm.hybridize(layer), ref, x, allow=SLICE | UPDATE)
    lengths = jnp.array([1, 2, 3, 3], jnp.int32)
    h = sm.hybridize(lambda m, r, n: m(r, seq_lengths=n), layer)
    close(h(x, lengths), ref(x, seq_lengths=lengths))
    sm.export(h, tmp_path / "n", example=(x, lengths), vjp_order=1)
    m = sm.load(tmp_path / "n", allow=SLICE | UPDATE | {"gather", "scatter"})
    close(m(x[:2], lengths[:2]), ref(x[:2], seq_lengths=lengths[:2]))
    g = lambda f: jax.grad(lambda r: f(r, lengths).sum())(x)  # noqa: E731
    close(g(m), g(lambda r, n: ref(r, seq_lengths=n)))
    with sm.serving.Batcher(m, max_batch=4) as b:
        got = [b.submit(np.asarray(x[i : i + 1]), lengths[i : i + 1]).result(30) for i in range(3)]
    close(np.concatenate(got), ref(x[:3], seq_lengths=lengths[:3]))


@pytest.mark.slow
def test_rnn_return_carry_exports_as_refused(tmp_path):
    """``nnx.RNN(nnx.LSTMCell(...), return_carry=True)``: its ``((c, h), outputs)`` is refused
    at export naming ``tuple(jax.tree.leaves(h.apply(...)[0]))``; so exported, the loaded model
    returns those leaves, equal."""
    rnn = nnx.RNN(nnx.LSTMCell(3, 5, rngs=nnx.Rngs(0)), return_carry=True)
    x = _x(1, (4, 3, 3))
    h = sm.hybridize(rnn)
    close(h(x), _fresh(rnn)(x))
    with pytest.raises(sm.SignatureError, match=r"tuple\(jax\.tree\.leaves\(h\.apply\("):
        sm.export(h, tmp_path / "refused", example=(x,))
    flat = sm.hybridize(  # as it says
        lambda params, *xs, **kw: tuple(jax.tree.leaves(h.apply(params, *xs, **kw)[0])), h.params
    )
    sm.export(flat, tmp_path / "m", example=(x,), vjp_order=1)
    m = sm.load(tmp_path / "m", allow=SLICE | UPDATE)
    close(m(x[:2]), tuple(jax.tree.leaves(_fresh(rnn)(x[:2]))))


# -- Equinox ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_pattern_cubic_interpolation_fits_by_its_own_grads(tmp_path):
    """pattern.md's ``CubicInterpolation`` (``coeffs`` an ``eqx.AbstractVar`` made concrete,
    ``jnp.polyfit`` its fill): every feature, batch symbolic (``jnp.polyval``'s scan: load
    names its slices); three gradient steps over ``h.apply`` toward other data equal
    ``eqx.filter_grad``'s; the stepped coefficients still pass ``__check_init__``."""
    ts = jnp.linspace(0, 1, 8)
    interp = zoo13.CubicInterpolation(ts, jnp.sin(3 * ts))
    x = jnp.linspace(0, 1, 5)
    h = sm.hybridize(interp)
    every_feature(tmp_path, h, interp, x, allow=SLICE)
    assert interp.degree() == 4
    target = jnp.cos(3 * x)
    ours, theirs = h.params, interp
    step = lambda m, g: jax.tree.map(lambda a, b: a - 0.1 * b, m, g)  # noqa: E731
    for _ in range(3):
        ours = step(ours, jax.grad(lambda p: ((h.apply(p, x) - target) ** 2).sum())(ours))
        theirs = step(theirs, eqx.filter_grad(lambda m: ((m(x) - target) ** 2).sum())(theirs))
    close(ours, theirs)
    close(h.replace(params=ours)(x), theirs(x))


@pytest.mark.slow
def test_faq_buffer_is_not_trained_and_rollout_exports_as_refused(tmp_path):
    """faq.md's ``Model`` (a buffer behind ``jax.lax.stop_gradient``): every feature, batch
    symbolic; its buffer's grads through ``h.apply`` are zero, as ``eqx.filter_grad``'s.
    ``rollout`` (an MLP carried through a scan by ``eqx.partition``/``eqx.combine``) returns
    a list: export's refusal names ``tuple(jax.tree.leaves(...))``; so exported (the
    sequence length symbolic), the loaded rollout equals, its grads too."""
    model = zoo13.BufferModel(jnp.ones(3), 2.0 * jnp.ones(3))
    x = _x(1, (5, 3))
    h = sm.hybridize(model)
    every_feature(tmp_path / "buffer", h, model, x)
    grads = jax.grad(lambda p: h.apply(p, x).sum())(h.params)
    close(grads.buffer, jnp.zeros(3))
    close(grads, eqx.filter_grad(lambda m: m(x).sum())(model))
    mlp = eqx.nn.MLP(3, 2, 8, 2, key=random.key(0))
    xs = _x(2, (6, 3))
    h = sm.hybridize(zoo13.rollout, mlp)
    close(h(xs), zoo13.rollout(mlp, xs))
    with pytest.raises(sm.SignatureError, match=r"tuple\(jax\.tree\.leaves\(out\)\)"):
        sm.export(h, tmp_path / "refused", example=(xs,))
    flat = sm.hybridize(lambda p, *a: tuple(jax.tree.leaves(h.apply(p, *a))), h.params)
    sm.export(flat, tmp_path / "flat", example=(xs,))  # as it says
    close(sm.load(tmp_path / "flat", allow=LOOP)(xs[:4]), tuple(zoo13.rollout(mlp, xs[:4])))
    one = sm.hybridize(lambda p, *a: h.apply(p, *a)[0], h.params)  # its one leaf
    every_feature(tmp_path / "one", one, lambda r: zoo13.rollout(mlp, r)[0], xs, allow=LOOP)


def test_error_if_export_refusal_names_eqx_on_error(tmp_path):
    """``eqx.error_if``'s docstring ``f`` (``x < 0`` an error): export is refused naming the
    ``EQX_ON_ERROR`` settings that export it (it named only a ``pure_callback`` the user never
    wrote)."""
    h = sm.hybridize(zoo13.net_checked, {"w": jnp.asarray(2.0)})
    with pytest.raises(sm.ConfigError, match=r"equinox's runtime check.*EQX_ON_ERROR=off"):
        sm.export(h, tmp_path / "m", example=(jnp.ones((2, 3)),))


@pytest.mark.slow
def test_error_if_checks_and_exports_as_its_refusal_says(tmp_path):
    """``error_if`` before an MLP (``Checked``): the Hybrid answers on good rows and raises
    equinox's message on bad ones; export's refusal names ``EQX_ON_ERROR``, and as it says,
    under ``EQX_ON_ERROR=off`` it exports with a symbolic batch, under ``EQX_ON_ERROR=nan``
    with ``batch=None``, its bad rows NaN (a process each: equinox reads it when imported)."""
    model = zoo13.Checked(eqx.nn.MLP(3, 2, 8, 2, key=random.key(0)))
    x = jnp.abs(_x(1, (4, 3)))
    h = sm.hybridize(model)
    close(h(x), model(x))
    with pytest.raises(Exception, match="x must be >= 0"):
        jax.block_until_ready(h(-x))
    with pytest.raises(sm.ConfigError, match=r"EQX_ON_ERROR=off.*EQX_ON_ERROR=nan"):
        sm.export(h, tmp_path / "m", example=(x,))
    script = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})
        import equinox as eqx, jax, jax.numpy as jnp, numpy as np, zoo13
        import symjax_mlp as sm
        model = zoo13.Checked(eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0)))
        x = jnp.abs(jax.random.normal(jax.random.key(1), (4, 3)))
        batch = None if sys.argv[1] == "nan" else "b"
        sm.export(sm.hybridize(model), sys.argv[2], example=(x,), batch=batch)
        m = sm.load(sys.argv[2])
        np.testing.assert_allclose(m(np.asarray(x)), model(x), rtol=2e-5, atol=2e-5)
        print(np.isnan(m(np.asarray(-x))).all())
        """
    )
    for mode, bad_is_nan in (("off", "False"), ("nan", "True")):
        env = {**os.environ, "EQX_ON_ERROR": mode}
        run = subprocess.run(
            [sys.executable, "-c", script, mode, str(tmp_path / mode)],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.split()[-1] == bad_is_nan


@pytest.mark.slow
def test_filter_custom_jvp_rule_through_the_loaded_model(tmp_path):
    """``filter_custom_jvp``'s docstring ``call`` (its rule: ``2 * tx``, ``y`` undifferentiated)
    after a dense layer: every feature, batch symbolic; the loaded model's grads are the
    rule's (twice the true ones), not ``fn``'s."""
    p = {"w": 0.5 * _x(0, (3, 2))}
    x = _x(1, (5, 3))
    h = sm.hybridize(zoo13.net_call, p)
    m = every_feature(tmp_path, h, lambda r: zoo13.net_call(p, r), x)
    close(jax.grad(lambda r: m(r).sum())(x[:3]), jnp.broadcast_to(2.0 * p["w"].sum(1), (3, 3)))


@pytest.mark.slow
def test_field_converter_and_static_field(tmp_path):
    """``eqx.field(converter=jnp.asarray)`` (a Python float made an array: a param) beside a
    ``static=True`` int (held in the program): every feature, batch symbolic; the converted
    field is the one param."""
    module = zoo13.MyModule(1.5)
    x = _x(1, (4, 2))
    h = sm.hybridize(module)
    assert jax.tree.leaves(h.params) == [1.5]
    every_feature(tmp_path, h, module, x)
    close(h.replace(params=eqx.tree_at(lambda m: m.foo, h.params, jnp.asarray(2.0)))(x), 2 * x**2)
