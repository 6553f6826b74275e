"""Code we did not write, round twenty-six (tests/zoo26.py; sources and commits there): three
libraries never run here before, over every feature (hybridize, ``h(x)`` equal to the plain
model, its graph, export + load + call equal, grads/Hessians over the loaded model, a
Batcher's answers) where their inputs allow it.

- flowjax's unconditional.ipynb: the masked autoregressive spline flow trained by its own
  ``fit_to_data`` (3 epochs, 200 points), its ``log_prob`` (the Equinox module's bound method,
  hybridized as the module itself is) over every feature, batch symbolic; its ``sample`` of a
  key, exported and loaded, the same draws for any key.
- haliax's README attention over a NamedArray: ``h(x)`` keeps its named axes; an export of the
  NamedArray was JAX's raw TypeError (its ``shape``, a dict of the axes, and ``dtype`` made it
  pass for an array), now refused naming ``hax.named`` inside; that route over every feature.
- e3nn-jax's tetris example: the Model over a jraph GraphsTuple; its positions exported (the
  graph held), the loaded model equal, invariant under a rotation, its chiral logits swapped
  by a reflection, its grads the model's.
- jaxtyping's ``batch_outer_product`` checked by beartype: its check runs at the Hybrid's
  trace (its own TypeCheckError for a batch that disagrees), exported with both inputs' ``b``
  one symbolic batch: the loaded model equal, and rows that disagree refused.
"""

import e3nn_jax as e3nn
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jraph
import numpy as np
import pytest
import zoo26
from features import close, every_feature
from zoo26 import hax

import symjax_mlp as sm

FLOW = {"dynamic_slice", "dynamic_update_slice", "gather", "real_dynamic_slice",
        "reduce_window", "scatter"}  # fmt: skip
AXES = ("batch", "position", "embed")


def _attention():
    model = zoo26.Attention.init(zoo26.Embed, zoo26.Head, zoo26.Key, key=jr.PRNGKey(0))
    x = hax.random.normal(jr.PRNGKey(1), (hax.Axis("batch", 3), zoo26.Pos, zoo26.Embed))
    return model, x


# -- flowjax: docs/examples/unconditional.ipynb ---------------------------------------------------


@pytest.mark.slow  # fit_to_data's compiles, every feature of a spline flow: a minute or more
def test_flowjax_flow_fit_to_data_then_log_prob_and_sample_exported(tmp_path):
    """``fit_to_data`` moves the flow (its losses fall, its log_prob changes); the trained
    flow's ``log_prob`` hybridized as a bound method over every feature (batch symbolic, grads
    and Hessians of the loaded model); ``sample(key, (3,))`` exported, the same draws."""
    x, untrained, flow, losses = zoo26.unconditional(n_samples=200, max_epochs=3)
    assert losses["train"][-1] < losses["train"][0]
    points = x[:8]
    assert not np.allclose(flow.log_prob(points), untrained.log_prob(points))
    h = sm.hybridize(flow.log_prob)
    every_feature(tmp_path, h, flow.log_prob, points, allow=FLOW, rtol=1e-4, atol=1e-4)
    hs = sm.hybridize(lambda f, key: f.sample(key, (3,)), flow)
    sm.export(hs, tmp_path / "s", example=(jr.key(5),), batch=None, vjp_order=0)
    m = sm.load(tmp_path / "s", allow=FLOW)
    for k in (jr.key(5), jr.key(7)):
        close(m(k), flow.sample(k, (3,)), rtol=1e-4, atol=1e-4)


# -- haliax: README.md, Example: Attention ------------------------------------------------------


@pytest.mark.slow  # the attention initialised: over 0.5 s
def test_haliax_named_array_export_is_refused_naming_hax_named(tmp_path):
    """A haliax NamedArray has a ``shape`` (a dict of its axes' sizes) and a ``dtype``, so it
    passed for an array and export failed in JAX ('Error interpreting argument ... as an
    abstract array', a TypeError); refused, naming the function of its leaves and, for any
    batch, ``hax.named`` inside."""
    model, x = _attention()
    h = sm.hybridize(model)
    said = r"args\[0\] is a NamedArray \(a registered pytree\) of 1 array.*hax\.named\(x,"
    with pytest.raises(sm.SignatureError, match=said):
        sm.export(h, tmp_path / "m", example=(x,))
    assert not (tmp_path / "m").exists()


@pytest.mark.slow  # compiles the attention several times
@pytest.mark.filterwarnings("ignore:jax.core.is_constant_dim is deprecated")  # haliax's, on b
def test_haliax_attention_keeps_its_axes_and_exports_named_inside(tmp_path):
    """``h(x)`` of the NamedArray is the model's, its axes kept; the refusal's route, the
    positional array named inside (haliax takes a symbolic batch as an axis size), over every
    feature; three SGD steps over ``h.apply`` equal ``eqx.filter_grad``'s."""
    model, x = _attention()
    h = sm.hybridize(model)
    got, want = h(x), model(x)
    assert got.axes == want.axes
    close(got.array, want.array)
    named = lambda p, a: h.apply(p, hax.named(a, AXES)).array  # noqa: E731 - as it says
    ref = lambda a: model(hax.named(a, AXES)).array  # noqa: E731
    every_feature(tmp_path, sm.hybridize(named, h.params), ref, x.array)
    loss = lambda f: jnp.mean(f(x).array ** 2)  # noqa: E731
    params, theirs = h.params, model
    for _ in range(3):
        grads = jax.grad(lambda p: loss(lambda a: h.apply(p, a)))(params)
        params = jax.tree.map(lambda a, b: a - 0.1 * b, params, grads)
        grads = eqx.filter_grad(loss)(theirs)
        theirs = eqx.apply_updates(theirs, jax.tree.map(lambda b: -0.1 * b, grads))
    close(params, eqx.filter(theirs, eqx.is_inexact_array))


# -- e3nn-jax: examples/tetris_point.py ---------------------------------------------------------


@pytest.mark.slow  # e3nn's tensor products compile for a while
def test_e3nn_tetris_exported_is_equivariant_and_equal(tmp_path):
    """The Model over one tetris graph (a GraphsTuple: refused as an input, naming the function
    of its arrays); its positions exported with the graph held, ``vjp_order=1``: the loaded
    logits equal the model's, are the same for rotated positions, and a reflection swaps the
    two chiral logits (odd x even); its grads by the positions are the model's."""
    graphs = jraph.unbatch(zoo26.tetris())[0]
    model = zoo26.Model()
    params = model.init(jr.PRNGKey(3), graphs)
    h = sm.hybridize(model, params)
    want = model.apply(params, graphs)
    close(h(graphs), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(sm.SignatureError, match=r"args\[0\] is a GraphsTuple of 6 arrays"):
        sm.export(h, tmp_path / "g", example=(graphs,), batch=None)

    def ref(pos):
        return model.apply(params, graphs._replace(nodes=pos))

    hp = sm.hybridize(lambda p, pos: h.apply(p, graphs._replace(nodes=pos)), h.params)
    pos = graphs.nodes
    sm.export(hp, tmp_path / "m", example=(pos,), batch=None, vjp_order=1)
    m = sm.load(tmp_path / "m", allow={"gather", "scatter", "reduce_window"})
    close(m(np.asarray(pos)), want, rtol=1e-4, atol=1e-4)
    rotation = e3nn.rand_matrix(jr.PRNGKey(7), ())
    close(m(np.asarray(pos @ rotation.T)), want, rtol=1e-4, atol=1e-4)
    close(m(np.asarray(-pos))[:, :2], want[:, 1::-1], rtol=1e-4, atol=1e-4)
    grads = jax.grad(lambda p: m(p)[0, 0])(pos)
    close(grads, jax.grad(lambda p: ref(p)[0, 0])(pos), rtol=1e-4, atol=1e-4)


# -- jaxtyping: jaxtyping/_decorator.py, jaxtyped's docstring -----------------------------------


@pytest.mark.slow  # a trace and an export: over 0.5 s
def test_jaxtyping_checked_by_beartype_exports_one_symbolic_batch(tmp_path):
    """The type check runs at the trace: ``h(x, y)`` with 4 rows of ``y`` to 5 of ``x`` is
    jaxtyping's TypeCheckError; exported, ``b`` is one symbolic batch: equal on 2 rows, 2 and
    3 rows refused naming both."""
    h = sm.hybridize(lambda _, x, y: zoo26.batch_outer_product(x, y), {})
    x, y = jr.normal(jr.key(0), (5, 3)), jr.normal(jr.key(1), (5, 2))
    close(h(x, y), zoo26.batch_outer_product(x, y))
    with pytest.raises(Exception, match="whilst typechecking parameter 'y'") as e:
        h(x, y[:4])
    assert type(e.value).__module__.startswith("jaxtyping")
    sm.export(h, tmp_path / "m", example=(x, y), vjp_order=1)
    m = sm.load(tmp_path / "m")
    close(m(np.asarray(x[:2]), np.asarray(y[:2])), zoo26.batch_outer_product(x[:2], y[:2]))
    with pytest.raises(sm.SignatureError, match=r"args\[1\]\.shape\[0\] is 3 but args\[0\]"):
        m(np.asarray(x[:2]), np.asarray(y[:3]))
