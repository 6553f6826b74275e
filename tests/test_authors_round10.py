"""Code we did not write, round ten: JAX's own notebooks where no round looked, as their authors
wrote them (tests/zoo10.py; sources and commit there), over every feature: hybridize, ``h(x)``
equal to the plain model, its graph, export (a symbolic batch where the model allows one) +
load + call equal, grads/Hessians over the loaded model (``vjp_order=2``), a Batcher's answers;
or export's refusal, naming what works. None of these originals trains.

- Writing_custom_interpreters_in_Jax.md: a net that evaluates ``make_jaxpr`` of another
  function equation by equation (``eval_jaxpr``), and one that inverts ``exp(tanh(x))`` by
  walking its jaxpr backwards (``inverse``): every feature, batch symbolic.
- convolutions.md: ``jnp.convolve``'s moving average, ``jsp.signal.convolve``'s Gaussian
  smoothing and ``lax.conv_general_dilated`` over ``conv_dimension_numbers`` (NHWC, HWIO):
  'SAME', 'VALID', strided and dilated, every feature, batch symbolic.
- control-flow.md: ``cond``, ``while_loop`` and ``fori_loop`` in one net (JAX differentiates no
  ``while_loop`` in reverse: the export of a VJP is refused naming ``vjp_order=0``); ``f(x, n)``
  with ``n`` static (``static_argnames``), ``example_fun``'s static ``length``, and
  ``jax_check_positive_even`` (ints in, bools out).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo10
from features import close as _close
from features import every_feature
from flax import nnx

import symjax_mlp as sm

CONV = {"convolution"}  # load() names it: an MLP artifact never convolves


def _n(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape)


@pytest.mark.slow
def test_custom_interpreter_eval_jaxpr_as_a_model(tmp_path):
    """``eval_jaxpr`` of ``make_jaxpr(f)`` (the notebook's ``f(w, b, x)``) binds each equation's
    primitive itself: the Hybrid, export (batch symbolic) and the loaded model's grads equal
    the plain function's."""
    p = {"w": _n((4, 3)) * 0.5, "b": jnp.full((3,), 0.1)}
    x = _n((5, 4), 1)
    h = sm.hybridize(zoo10.net_eval, p)
    _close(h(x), zoo10.f_dense(p["w"], p["b"], x))
    every_feature(tmp_path, h, lambda r: zoo10.net_eval(p, r), x)


@pytest.mark.slow
def test_custom_interpreter_inverse_as_a_model(tmp_path):
    """``inverse(f)`` (its jaxpr walked backwards through ``inverse_registry``) of ``f(x)``
    gives ``x`` back, through the Hybrid and the loaded model; grads and Hessians equal."""
    p = {"s": jnp.asarray(2.0)}
    x = _n((5, 3), 2) * 0.5
    y = zoo10.f(x)
    h = sm.hybridize(zoo10.net_inverse, p)
    _close(h(y), 2.0 * x, rtol=1e-4, atol=1e-4)
    every_feature(tmp_path, h, lambda r: zoo10.net_inverse(p, r), y, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_convolve_smoothing_1d_and_2d(tmp_path):
    """``jnp.convolve(y, window, mode='same')`` per row and ``jsp.signal.convolve`` of the
    Gaussian window per image: every feature, batch symbolic."""
    p = {"s": jnp.asarray(1.5)}
    y = jnp.sin(jnp.linspace(0, 10, 24)) + 0.2 * _n((4, 24), 3)
    h = sm.hybridize(zoo10.net_smooth, p)
    every_feature(tmp_path / "1d", h, lambda r: zoo10.net_smooth(p, r), y, allow=CONV)
    img = 50 * _n((4, 12, 10), 4)
    h2 = sm.hybridize(zoo10.net_smooth_image, p)
    every_feature(
        tmp_path / "2d",
        h2,
        lambda r: zoo10.net_smooth_image(p, r),
        img,
        allow=CONV,
        rtol=1e-4,
        atol=1e-3,
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo10.CONVS)
def test_conv_general_dilated_with_dimension_numbers(name, tmp_path):
    """The notebook's edge ``kernel`` (HWIO) over NHWC images, ``dn`` from the traced shapes:
    every feature, batch symbolic, each padding/stride/dilation as its cells."""
    p = {"kernel": zoo10.kernel}
    img = zoo10.make_img(4) + 0.1 * _n((4, 12, 10, 3), 5)
    net = zoo10.net_conv(*zoo10.CONVS[name])
    h = sm.hybridize(net, p)
    every_feature(tmp_path, h, lambda r: net(p, r), img, allow=CONV, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_control_flow_cond_while_fori(tmp_path):
    """``cond``/``while_loop``/``fori_loop``: the Hybrid equals the plain net; JAX has no
    reverse-mode ``while_loop``, so an export with a VJP is refused naming ``vjp_order=0``;
    exported without one, loaded allowing 'while', it answers as the net, in a Batcher too."""
    p = {"s": jnp.asarray(1.0)}
    x = jnp.arange(12.0).reshape(4, 3) - 4.0
    h = sm.hybridize(zoo10.net_control, p)
    _close(h(x), zoo10.net_control(p, x))
    assert h.graph(x).primitive_counts
    with pytest.raises(sm.SymjaxError, match="vjp_order=0"):
        sm.export(h, tmp_path / "vjp", example=(x,), vjp_order=1)
    sm.export(h, tmp_path / "m", example=(x,), vjp_order=0)
    m = sm.load(tmp_path / "m", allow={"while"})
    _close(m(np.asarray(x[:3])), zoo10.net_control(p, x[:3]))
    with sm.serving.Batcher(m, max_batch=4) as b:
        got = [b.submit(np.asarray(x[i : i + 1])).result(30) for i in range(2)]
    _close(np.concatenate(got), zoo10.net_control(p, x[:2]))


@pytest.mark.slow
def test_static_n_as_jit_static_argnames(tmp_path):
    """``jit(f, static_argnames='n')`` in a net whose ``n`` is static for the Hybrid too (by
    name and by position): equal per ``n``; the export bakes ``n`` in, every feature."""
    p = {"s": jnp.asarray(1.0)}
    x = _n((5, 4), 6)
    for static in ({"static_argnames": "n"}, {"static_argnums": 1}):
        h = sm.hybridize(zoo10.net_sum, p, **static)
        for n in (2, 3):
            _close(h(x, n), zoo10.net_sum(p, x, n))
            _close(h(x, n=n), zoo10.net_sum(p, x, n))
    h = sm.hybridize(zoo10.net_sum, p, static_argnames="n")
    assert h.graph(x, 2).primitive_counts
    sm.export(h, tmp_path / "m", example=(x, 2), vjp_order=2)
    with pytest.raises(sm.ArtifactError, match=r"allow=\{'real_dynamic_slice'\}"):
        sm.load(tmp_path / "m")  # a row's x[i] under a symbolic batch: named, as policy says
    m = sm.load(tmp_path / "m", allow={"real_dynamic_slice"})
    ref = lambda r: zoo10.net_sum(p, r, 2)  # noqa: E731
    _close(m(np.asarray(x[:3])), ref(x[:3]))
    _close(jax.grad(lambda r: m(r).sum())(x), jax.grad(lambda r: ref(r).sum())(x))
    one = lambda f: lambda r: f(r[None]).sum()  # noqa: E731
    _close(jax.vmap(jax.grad(one(m)))(x), jax.vmap(jax.grad(one(ref)))(x))
    with sm.serving.Batcher(m, max_batch=4) as b:
        got = [b.submit(np.asarray(x[i : i + 1])).result(30) for i in range(2)]
    _close(np.concatenate(got), ref(x[:2]))


@pytest.mark.slow
def test_example_fun_static_length_and_check_positive_even(tmp_path):
    """``good_example_jit(length, val)`` in a net, ``length`` static: one trace per length;
    ``jax_check_positive_even`` (ints in, bools out) exported, loaded and served."""
    p = {"s": jnp.asarray(2.0)}
    net = lambda p, length, val: zoo10.good_example_jit(length, val) * p["s"]  # noqa: E731
    h = sm.hybridize(net, p, static_argnames="length")
    for length in (10, 5):
        _close(h(length, jnp.asarray(4.0)), net(p, length, jnp.asarray(4.0)))
    hc = sm.hybridize(lambda p, x: zoo10.jax_check_positive_even(x), {})
    x = jnp.array([[-1, 2, 5], [24, 0, -2]])
    want = np.asarray(zoo10.jax_check_positive_even(x))
    np.testing.assert_array_equal(hc(x), want)
    sm.export(hc, tmp_path / "c", example=(x,))
    m = sm.load(tmp_path / "c")
    np.testing.assert_array_equal(m(np.asarray(x)), want)
    with sm.serving.Batcher(m, max_batch=4) as b:
        np.testing.assert_array_equal(b.submit(np.asarray(x[:1])).result(30), want[:1])


def test_params_mutated_after_hybridize_are_read_nowhere():
    """A dict of params changed in place after hybridize (``p["w"] = ...``): ``h(x)`` reads the
    params as held, and eager and ``h.params`` did read the mutation (3x what ``h(x)``
    answered, silently); now they read what ``h(x)`` does (export too: the next test)."""
    p = {"w": jnp.ones((2, 2))}
    h = sm.hybridize(lambda p, x: x @ p["w"], p)
    x = jnp.ones((1, 2))
    assert h.params is p  # unchanged: the params given
    want = np.asarray(h.eager(x))
    p["w"] = p["w"] * 3
    _close(h.params, {"w": jnp.ones((2, 2))})
    _close(h.eager(x), want)


@pytest.mark.slow
def test_params_mutated_after_hybridize_are_not_exported(tmp_path):
    """The compiled ``h(x)``, ``h.apply(h.params, x)`` and the export of a Hybrid whose dict of
    params was changed in place: all the held params' answer (the artifact answered 3x
    ``h(x)``); ``h.replace(params=p)`` takes the new ones."""
    p = {"w": jnp.ones((2, 2))}
    h = sm.hybridize(lambda p, x: x @ p["w"], p)
    x = jnp.ones((1, 2))
    want = np.asarray(h(x))
    p["w"] = p["w"] * 3
    _close(h(x), want)
    _close(h.apply(h.params, x), want)
    sm.export(h, tmp_path / "m", example=(x,))
    _close(sm.load(tmp_path / "m")(np.asarray(x)), want)
    _close(h.replace(params=p)(x), 3 * want)


@pytest.mark.slow
def test_jit_methods_strategy_3_pytree_class_as_params(tmp_path):
    """new_docs/201/jit.md's Strategy 3: ``CustomClass`` (its ``x`` a child, ``mul`` static
    aux data, ``calc`` jitted) as a Hybrid's params: every feature, ``h.apply`` over a
    ``mul=False`` instance as JAX's own. Its ``c.mul = False`` after hybridize left ``h(y)``
    multiplying while eager and export did not (silently two answers); now all multiply, as
    held, and ``h.replace(params=c)`` takes the mutated one. Strategy 1 (a plain class) is
    refused as params naming a closure; Strategy 2 is the doc's own trap, not ours."""
    c = zoo10.CustomClass(jnp.array(2.0), True)
    h = sm.hybridize(lambda c, y: c.calc(y), c)
    y = _n((5, 3), 7)
    every_feature(tmp_path / "s3", h, lambda r: c.calc(r), y)
    off = zoo10.CustomClass(jnp.array(2.0), False)
    _close(h.apply(off, y), off.calc(y))
    _close(jax.grad(lambda c: h.apply(c, y).sum())(c).x, jax.grad(lambda c: c.calc(y).sum())(c).x)
    want = np.asarray(c.calc(y))
    c.mul = False  # the doc: "mutation is detected" by jit (a new treedef)
    _close(h(y), want)
    _close(h.hybridize(False)(y), want)
    sm.export(h, tmp_path / "after", example=(y,))
    _close(sm.load(tmp_path / "after")(np.asarray(y)), want)
    _close(h.replace(params=c)(y), y)
    with pytest.raises(sm.ConfigError, match=r"CustomClass1.*close over it"):
        sm.hybridize(lambda c, y: c.calc(y), zoo10.CustomClass1(jnp.array(2.0), True))


VECTORIZED = {  # automatic-vectorization.md's batched convolves, ``w`` the param
    "manually_vectorized": lambda p, xs: zoo10.manually_vectorized_convolve(xs, p),
    "auto_batch": lambda p, xs: zoo10.auto_batch_convolve(
        xs, jnp.broadcast_to(p, (xs.shape[0], 3))
    ),
    "v3": lambda p, xs: zoo10.batch_convolve_v3(xs, p),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", VECTORIZED)
def test_automatic_vectorization_convolves(name, tmp_path):
    """The doc's batched ``convolve`` s, ``w`` the param: every feature, batch symbolic (the
    loaded model needs what load names: a row's slices under a symbolic batch)."""
    w, xs = jnp.array([2.0, 3.0, 4.0]), _n((4, 5), 8)
    net = VECTORIZED[name]
    allow = {"dynamic_gather", "real_dynamic_slice", "dynamic_slice", "scatter"}
    every_feature(tmp_path, sm.hybridize(net, w), lambda r: net(w, r), xs, allow=allow)


@pytest.mark.slow
def test_automatic_vectorization_python_loops_refused_naming_the_loop(tmp_path):
    """``manually_batched_convolve`` loops over ``range(xs.shape[0])`` and ``convolve`` under
    ``vmap(in_axes=1)`` over ``range(len(x))`` of the leading axis: a symbolic batch was
    refused as "fixes its batch size ... a reshape or a vmap of axis_size" (neither is there);
    now it names the Python loop, jax.vmap/lax.map, and the shapes= of a batch in axis 1,
    which exports, loads and answers as the doc's function."""
    w, xs = jnp.array([2.0, 3.0, 4.0]), _n((4, 5), 9)
    manual = lambda p, xs: zoo10.manually_batched_convolve(xs, jnp.broadcast_to(p, (4, 3)))  # noqa: E731
    loop = r"Python int \(range\(x.shape\[0\]\).*jax.vmap or lax.map"
    with pytest.raises(sm.SignatureError, match=loop):
        sm.export(sm.hybridize(manual, w), tmp_path / "manual", example=(xs,))
    sm.export(sm.hybridize(manual, w), tmp_path / "manual", example=(xs,), batch=None)
    _close(sm.load(tmp_path / "manual")(np.asarray(xs)), manual(w, xs))
    v2 = lambda p, xst: zoo10.auto_batch_convolve_v2(xst, jnp.tile(p[:, None], (1, xst.shape[1])))  # noqa: E731
    h2, xst = sm.hybridize(v2, w), xs.T
    with pytest.raises(sm.SignatureError, match=loop + r".*shapes=\('5, b',\)"):
        sm.export(h2, tmp_path / "v2", example=(xst,))
    sm.export(h2, tmp_path / "v2", example=(xst,), shapes=("5, b",))
    m = sm.load(tmp_path / "v2", allow={"real_dynamic_slice", "dynamic_slice"})
    _close(m(np.asarray(xst[:, :2])), v2(w, xst[:, :2]))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:'.value' (access|setter) is now deprecated")  # the demo's
def test_nnx_demo_surgery_monkey_patched_block(tmp_path):
    """docs_nnx/guides/demo.md's MLP after its surgery: the monkey-patched function in
    ``blocks`` is refused naming ``model.blocks[2] = nnx.static(...)`` (it said
    ``model.blocks.2``, no Python); so marked, the shared block and tied kernel train as the
    module does (two train-mode calls, its BatchNorm stats and ``Count`` carried), and in eval
    mode every feature answers as the module."""
    model = zoo10.demo_model()
    with pytest.raises(sm.ConfigError, match=r"model\.blocks\[2\] = nnx\.static\("):
        sm.hybridize(model)
    model.blocks[2] = nnx.static(zoo10.my_optimized_layer)
    ref = nnx.clone(model)
    h = sm.hybridize(model)
    x = _n((3, 4), 10)
    for _ in range(2):
        _close(h(x), ref(x), rtol=1e-5, atol=1e-5)
    assert int(h.state["count"]) == int(ref.count.get_value()) == 3
    model.eval()
    ref.eval()
    fresh = lambda r: nnx.clone(ref)(r)  # noqa: E731 - its Count written under jax.grad too
    every_feature(tmp_path, h, fresh, x, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_debug_nans_flag_over_export_load_and_call(tmp_path):
    """thinking_in_jax.md's debugging flags (``jax.debug_nans``) over a net whose example gives
    NaN (``jnp.log`` of negatives, recorded in its self-test): under the flag, export raised
    FloatingPointError for its own vectors and load said the artifact "is corrupted, was
    edited, or was made for another JAX"; now both pass, and a call that makes a NaN raises
    JAX's FloatingPointError, as a jitted function under the flag does (not ArtifactError)."""
    x = _n((4, 3), 11)
    h = sm.hybridize(lambda p, x: jnp.log(x) * p, jnp.asarray(1.0))
    with jax.debug_nans(True):
        sm.export(h, tmp_path / "m", example=(x,))
        m = sm.load(tmp_path / "m")
        _close(m(np.abs(np.asarray(x))), jnp.log(jnp.abs(x)))
        with pytest.raises(FloatingPointError):
            m(np.asarray(x))
    got = sm.load(tmp_path / "m")(np.asarray(x))  # the flag off: NaN where JAX gives NaN
    np.testing.assert_array_equal(np.isnan(got), np.isnan(jnp.log(x)))
