"""Code we did not write, round seventeen: JAX's own docs where no round looked (tests/zoo17.py;
sources and commit there), over every feature (hybridize, ``h(x)`` equal to the plain
function, its graph, export + load + call equal, grads/Hessians over the loaded model, a
Batcher's answers) and what each doc promises of it.

- jit-compilation.md: ``selu`` over every feature, and on the doc's int32 ``jnp.arange``
  exported and served (float32 out, as jax.jit gives); ``f``'s Python ``if`` and ``g``'s
  Python ``while`` on ``n``: static as the doc's ``static_argnums``/``static_argnames`` make
  them, exported with the setting baked in; a traced ``x`` refused naming the fix.
- type_promotion.rst's weak types: ``2 * x`` of an int8 ``x`` is int8, its ``2`` a Python int
  or ``jnp.asarray(2)`` in the params or the example; a bfloat16 input times a Python float
  param stays bfloat16. The loaded model gave int32 and float32 (export traced the ``2`` and
  the ``0.5`` strongly typed, the Hybrid weakly): now the Hybrid's dtypes and values. Under
  its ``jax.numpy_dtype_promotion('strict')`` train trains as under the standard rules (it was
  refused: optax's adam mixes a Python float with an int32, our step a bool with floats).
- precision.md: the ``precision='BF16_BF16_F32'`` dot over every feature; the gradient's
  transposed dot carries the same algorithm, as the doc's jaxpr shows, through ``h.apply``.
- debugging.md's ``jax_debug_nans``: its ``f`` raises FloatingPointError from the Hybrid and
  the loaded model as from ``jax.jit(f)``; exported under the flag; NaN out without it.
- vjp-objects.md: its two-layer pipeline of ``fwd_and_bwd`` (VJP objects out of one jit into
  another) over ``h.apply`` and over two loaded models (their VJP modules): the gradients
  of ``jax.grad(two_layers)``; ``layer`` over every feature.
- hijax-types.md: its quantized ``qw`` (a ``QArray``, a hijax type jit takes whole) as the
  params of ``matmul_q``, and a ``QArray`` as an input: the Hybrid refused both ("a compiled
  call cannot pass"); now its calls and grads are jit's and the doc's, and export refuses a
  ``QArray`` param by name, naming the model that exports: float weights quantized inside
  it, exported, loaded and differentiated (no vmap: JAX 0.10.2 lacks the doc's MappingSpec).
- transfer-guard.rst: under ``jax.transfer_guard("disallow")`` export and load worked not
  (their self-test's own transfer was refused, load called the artifact's program failed), and
  a loaded model's NumPy input, refused as jax.jit refuses it, was called a corrupted artifact.
  Under the doc's global ``jax.config.update("jax_transfer_guard", "disallow")`` a Batcher
  serves (its thread's transfers are its own; its warm-up was refused as the model's fault).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo17
from features import close, every_feature

import symjax_mlp as sm


def _rows(shape=(4, 3), seed=0):
    return jax.random.normal(jax.random.key(seed), shape)


@pytest.mark.slow
def test_selu_over_every_feature_and_on_the_docs_int32_arange(tmp_path):
    """``selu`` of float rows over every feature; of the doc's int32 ``jnp.arange`` (cut to
    12, as rows of 3): exported with a symbolic batch, loaded and served, float32 as jit's."""
    h = sm.hybridize(lambda _, x: zoo17.selu(x), {})
    every_feature(tmp_path, h, zoo17.selu, _rows())
    x = jnp.arange(-6, 6).reshape(4, 3)
    sm.export(h, tmp_path / "ints", example=(x,))
    m = sm.load(tmp_path / "ints")
    want = jax.jit(zoo17.selu)(x)
    assert m(np.asarray(x)).dtype == want.dtype == jnp.float32
    close(m(np.asarray(x)), want)
    with sm.serving.Batcher(m, max_batch=4) as b:
        close(b.submit(np.asarray(x[:1])).result(30), want[:1])


@pytest.mark.slow
def test_static_settings_of_the_docs_if_and_while(tmp_path):
    """``f``'s ``if x > 0`` and ``g``'s ``while i < n``: Python ints are static settings, as the
    doc's ``static_argnums=0`` / ``static_argnames=['n']`` make them (``g_jit_decorated``
    too, called inside the model); ``g`` exported with ``n`` baked in; ``f`` of a traced
    array refused as jax.jit refuses it, naming the static setting."""
    hf = sm.hybridize(lambda _, x: zoo17.f(x), {}, static_argnums=0)
    assert hf(10) == jax.jit(zoo17.f, static_argnums=0)(10) and hf(-3) == -6
    xs = _rows((3, 2))
    for fn in (zoo17.g, zoo17.g_jit_decorated):
        h = sm.hybridize(lambda _, x, n, fn=fn: fn(x, n), {}, static_argnames="n")
        close(h(xs, 20), jax.jit(zoo17.g, static_argnames=["n"])(xs, 20))
        close(h(xs, n=5), zoo17.g(xs, 5))
    sm.export(h, tmp_path / "g", example=(xs,), kwargs={"n": 20})
    close(sm.load(tmp_path / "g")(np.asarray(xs)), zoo17.g(xs, 20))
    with pytest.raises(sm.ControlFlowError, match="static"):
        sm.hybridize(lambda _, x: zoo17.f(x), {})(jnp.asarray(10))


@pytest.mark.parametrize("two", [2, jnp.asarray(2)], ids=["python_int", "weak_array"])
def test_a_weak_param_keeps_the_docs_int8_through_export(tmp_path, two):
    """type_promotion.rst: ``2 * x`` of ``x = jnp.arange(5, dtype='int8')`` is int8; the ``2``
    held as the params (a Python int, or the doc's weakly typed ``jnp.asarray(2)``). The
    loaded model gave int32 (``jnp.int32(2) * x``, as the doc warns): export traced the params
    strongly typed, the Hybrid weakly, as jax.jit does."""
    x = jnp.arange(5, dtype="int8").reshape(5, 1)
    h = sm.hybridize(zoo17.net_twice, two)
    want = jax.jit(zoo17.net_twice)(two, x)
    assert h(x).dtype == want.dtype == jnp.int8
    sm.export(h, tmp_path / "m", example=(x,))
    m = sm.load(tmp_path / "m")
    got = m(np.asarray(x))
    assert got.dtype == jnp.int8 and str(m.signature.outputs[0].dtype) == "int8"
    np.testing.assert_array_equal(got, want)


def test_a_weak_example_is_traced_as_the_hybrid_traced_it(tmp_path):
    """The doc's ``jnp.asarray(2)`` as an input of the example: the artifact computes ``2 * x``
    in int8 as ``h(jnp.asarray(2), x)`` did (it gave int32), and takes a Python number there;
    a strongly typed int32, which ``h`` answers in int32, is refused, not answered in int8."""
    x = jnp.arange(5, dtype="int8")
    h = sm.hybridize(lambda _, two, x: zoo17.net_twice(two, x), {})
    two = jnp.asarray(2)
    assert two.weak_type and h(two, x).dtype == jnp.int8
    sm.export(h, tmp_path / "m", example=(two, x), batch=None)
    m = sm.load(tmp_path / "m")
    got = m(2, np.asarray(x))
    assert got.dtype == jnp.int8
    np.testing.assert_array_equal(got, h(two, x))
    assert h(np.int32(2), x).dtype == jnp.int32
    with pytest.raises(sm.SignatureError) as e:
        m(np.int32(2), np.asarray(x))
    said = str(e.value)  # an int's example is 2: np.int32(2), not np.int32(2.0)
    assert "a Python number such as 2, " in said and "export at np.int32(2) to take" in said, said


@pytest.mark.slow
def test_bfloat16_rows_times_a_python_float_param_stay_bfloat16(tmp_path):
    """``tanh(0.5 * x)`` of bfloat16 rows, the ``0.5`` a Python float param: every feature in
    bfloat16, as jax.jit computes it (the loaded model computed it in float32 and returned
    float32: values off by bfloat16's rounding, no error)."""
    params, x = {"scale": 0.5}, _rows((4, 3)).astype(jnp.bfloat16) * 3
    h = sm.hybridize(zoo17.net_scaled, params)
    ref = lambda r: jax.jit(zoo17.net_scaled)(params, r)  # noqa: E731
    m = every_feature(tmp_path, h, ref, x, rtol=1e-2, atol=1e-2)
    got = m(np.asarray(x))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref(x), np.float32))


def _dots(jaxpr):
    """The precision of each ``dot_general`` in ``jaxpr``, nested jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(str(eqn.params["precision"]))
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _dots(inner)
    return found


@pytest.mark.slow
def test_a_dot_algorithm_over_every_feature_and_in_its_gradient(tmp_path):
    """precision.md's ``BF16_BF16_F32`` dot over every feature (per row, ``loss`` without
    its sum); ``loss``'s gradient over ``h.apply`` carries the preset on both dots, the
    forward and the transposed one, as the doc's jaxpr of ``jax.grad(loss)`` does."""
    w, x = _rows((8, 2), 1), _rows((4, 8), 2)
    net = lambda w, x: jnp.dot(x, w, precision="BF16_BF16_F32")  # noqa: E731
    every_feature(tmp_path, sm.hybridize(net, w), lambda r: net(w, r), x)
    h = sm.hybridize(lambda w, x: zoo17.loss(x, w), zoo17.w)
    grad = jax.grad(h.apply)
    dots = _dots(jax.make_jaxpr(grad)(zoo17.w, zoo17.x).jaxpr)
    assert len(dots) == 2 and all("BF16_BF16_F32" in d for d in dots)
    close(grad(zoo17.w, zoo17.x), jax.grad(zoo17.loss, argnums=1)(zoo17.x, zoo17.w))


@pytest.mark.slow
def test_debug_nans_raises_from_the_hybrid_and_the_loaded_model(tmp_path):
    """debugging.md: under ``jax.debug_nans(True)`` the doc's ``f`` raises FloatingPointError
    from ``jax.jit(f)``; from the Hybrid and the loaded model too (exported under the flag:
    its self-test's NaN is the model's answer); without it, NaN as jit's."""
    h = sm.hybridize(lambda _, x: zoo17.f_nan(x), {})
    x = jnp.full((2, 3), 5.0)
    with jax.debug_nans(True):
        sm.export(h, tmp_path / "m", example=(x,))
        m = sm.load(tmp_path / "m")
        for call in (jax.jit(zoo17.f_nan), h, m):
            with pytest.raises(FloatingPointError):
                call(x)
    assert np.isnan(m(x)).all() and np.isnan(jax.jit(zoo17.f_nan)(x)).all()


def test_a_transfer_guard_refuses_what_jax_refuses_and_nothing_of_ours(tmp_path):
    """transfer-guard.rst's ``jax.transfer_guard("disallow")``: export and load run (their
    self-tests' vectors are ours to move; load said the program failed on them); a loaded
    model runs on device arrays, and a NumPy input is refused with JAX's own error, as
    ``jax.jit`` refuses it (it was an ArtifactError calling the artifact corrupted); explicit
    ``jax.device_put`` passes."""
    h = sm.hybridize(lambda _, x: zoo17.selu(x), {})
    x, host = _rows(), np.asarray(_rows())
    jitted = jax.jit(zoo17.selu)
    with jax.transfer_guard("disallow"):
        sm.export(h, tmp_path / "m", example=(x,))
        m = sm.load(tmp_path / "m")
        close(m(x), jitted(x))
        close(m(jax.device_put(host)), jitted(x))
        for call in (jitted, m):
            with pytest.raises(jax.errors.JaxRuntimeError, match="Disallowed host-to-device"):
                call(host)


@pytest.mark.slow
def test_a_batcher_serves_under_a_global_transfer_guard(tmp_path):
    """transfer-guard.rst's global ``jax.config.update("jax_transfer_guard", "disallow")``: a
    Batcher's thread moves its batches to the device and back, its own transfers; it was
    refused at warm-up, as if the model could not run on zero rows."""
    h = sm.hybridize(lambda _, x: zoo17.selu(x), {})
    x = _rows()
    sm.export(h, tmp_path / "m", example=(x,))
    m, rows = sm.load(tmp_path / "m"), np.asarray(x)
    jax.config.update("jax_transfer_guard", "disallow")
    try:
        with sm.serving.Batcher(m, max_batch=4) as b:
            got = [b.submit(rows[i : i + 1]).result(30) for i in range(2)]
    finally:
        jax.config.update("jax_transfer_guard", None)
    close(np.concatenate(got), zoo17.selu(x[:2]))


@pytest.mark.slow
def test_vjp_objects_pipeline_over_the_hybrid_and_loaded_layers(tmp_path):
    """vjp-objects.md: forward through two layers, then backward, on its own schedule, with
    ``fwd_and_bwd`` of ``h.apply`` (weights and input) and of two loaded models (each layer
    exported, its input only): the gradients end-to-end ``jax.grad(two_layers)`` gives."""
    W1, W2, x0 = zoo17.W1, zoo17.W2, zoo17.x0 / 10  # (tanh of ones @ ones saturates)
    h = sm.hybridize(zoo17.layer, W1)
    every_feature(tmp_path / "every", h, lambda r: zoo17.layer(W1, r), _rows((4, 3)))
    dW1_ref, dW2_ref, dx0_ref = jax.grad(zoo17.two_layers, argnums=(0, 1, 2))(W1, W2, x0)
    fwd, bwd = zoo17.fwd_and_bwd(h.apply)
    x1, res1 = fwd(W1, x0)
    x2, res2 = fwd(W2, x1)
    dW2, dx1 = bwd(res2, jnp.ones_like(x2))
    dW1, dx0 = bwd(res1, dx1)
    close((dW1, dW2, dx0), (dW1_ref, dW2_ref, dx0_ref))
    for name, w in (("l1", W1), ("l2", W2)):
        sm.export(h.replace(params=w), tmp_path / name, example=(x0,), vjp_order=1)
    (fwd1, bwd1), (fwd2, bwd2) = (zoo17.fwd_and_bwd(sm.load(tmp_path / n)) for n in ("l1", "l2"))
    x1, res1 = fwd1(x0)
    x2, res2 = fwd2(x1)
    (dx1,) = bwd2(res2, jnp.ones_like(x2))
    (dx0,) = bwd1(res1, dx1)
    close(dx0, dx0_ref)


@pytest.mark.slow
def test_train_runs_under_the_docs_strict_promotion():
    """type_promotion.rst's ``jax.numpy_dtype_promotion('strict')``: ``sm.training.train``
    trains as under the standard rules, bitwise (it was refused: optax's adam mixes a Python
    float with its int32 count, blamed on the optimizer with optax.adam as the fix; then our
    step's accuracy multiplied the weights by a bool)."""
    want = sm.training.train(epochs=1)
    with jax.numpy_dtype_promotion("strict"):
        got = sm.training.train(epochs=1)
    chex.assert_trees_all_equal(got.params, want.params)


@pytest.mark.slow
def test_hijax_quantized_arrays_as_params_and_inputs(tmp_path):
    """hijax-types.md's ``QArray``: ``qw`` as the params of ``matmul_q`` (jit takes a value of
    a registered hijax type whole; the Hybrid refused it as no array) and as an input to
    ``dequantize``: calls and the doc's ``loss`` grads as jit's; export refuses a QArray param
    naming the hijax type and what exports, the float weights quantized in the model."""
    x, qw, w = zoo17.x_q, zoo17.qw, zoo17.w_q
    h = sm.hybridize(lambda qw, x: zoo17.matmul_q(x, qw), qw)
    close(h(x), jax.jit(zoo17.matmul_q)(x, qw))
    close(h.eager(x), zoo17.matmul_q(x, qw))
    grads = jax.grad(lambda x, qw: jnp.sum(h.apply(qw, x) ** 2), argnums=(0, 1))(x, qw)
    close(grads, jax.grad(zoo17.loss_q, argnums=(0, 1))(x, qw))
    hd = sm.hybridize(lambda _, q: zoo17.dequantize(q), {})
    close(hd(qw), jax.jit(zoo17.dequantize)(qw))
    with pytest.raises(sm.ArtifactError, match=r"QArray, a value of a jax\.experimental\.hijax"):
        sm.export(h, tmp_path / "q", example=(x,))
    net = lambda w, x: zoo17.matmul_q(x, zoo17.quantize(w))  # noqa: E731
    sm.export(sm.hybridize(net, w), tmp_path / "m", example=(x,), vjp_order=1)
    m = sm.load(tmp_path / "m")
    close(m(np.asarray(x)), net(w, x))
    close(jax.grad(lambda r: m(r).sum())(x), jax.grad(lambda r: net(w, r).sum())(x))


@pytest.mark.slow
def test_train_runs_under_a_global_transfer_guard(tmp_path):
    """transfer-guard.rst's global ``jax.config.update("jax_transfer_guard", "disallow")``:
    ``sm.training.train`` moves its own data and keys (JAX's error at its first key, then called
    the model's fault on one row), checkpoints, and gives bitwise the params it gives without
    the guard; ``on_epoch``, the user's code, still runs under the user's guard."""
    want, guarded = sm.training.train(epochs=1), []

    def on_epoch(_):
        with pytest.raises(jax.errors.JaxRuntimeError, match="Disallowed host-to-device"):
            jax.jit(jnp.sin)(np.ones(3))
        guarded.append(True)

    jax.config.update("jax_transfer_guard", "disallow")
    try:
        got = sm.training.train(epochs=1, checkpoint=tmp_path / "c", on_epoch=on_epoch)
    finally:
        jax.config.update("jax_transfer_guard", None)
    chex.assert_trees_all_equal(got.params, want.params)
    assert guarded == [True]


def test_a_hijax_primitives_flops_are_not_counted_and_said_so():
    """hijax-types.md's ``MatmulQ`` of a ``QArray`` in ``h.graph``: its primitive is counted
    and its flops are said not to be (``flops_exact`` false, a lower bound): they read 0,
    exact, a silent wrong figure."""
    h = sm.hybridize(lambda qw, x: zoo17.matmul_q(x, qw), zoo17.qw)
    g = h.graph(zoo17.x_q)
    assert g.primitive_counts == {"call_hi_primitive": 1}
    assert not g.flops_exact and g.flops_unknown == ("call_hi_primitive",)


@pytest.mark.slow
def test_hijax_quantized_matmul_eager_and_in_a_batcher():
    """hijax-types.md's ``MatmulQ`` of a ``QArray``: ``h.eager`` and a Batcher of the Hybrid
    give jit's answers, row by row."""
    x, qw = zoo17.x_q, zoo17.qw
    h = sm.hybridize(lambda qw, x: zoo17.matmul_q(x, qw), qw)
    want = jax.jit(zoo17.matmul_q)(x, qw)
    close(h.eager(x), want)
    with sm.serving.Batcher(h, max_batch=4, example=x[:1]) as b:
        got = [b.submit(np.asarray(x[i : i + 1])).result(30) for i in range(len(x))]
    close(np.concatenate(got), want)


def test_debug_print_and_callback_fire_per_call_and_export_refuses_them(tmp_path, capfd):
    """debugging.md's ``jax.debug.print`` and ``jax.debug.callback`` inside a hybridized model
    fire on every call of one trace, as under ``jax.jit`` (a ``print`` only per trace); export
    refuses them by name, as the README says."""
    seen = []

    def f(w, x):
        jax.debug.print("x sum {}", x.sum())
        jax.debug.callback(lambda v: seen.append(float(v)), x.sum())
        return x @ w

    h = sm.hybridize(f, zoo17.w_q)
    for _ in range(2):
        jax.block_until_ready(h(zoo17.x_q))
    jax.effects_barrier()
    want = float(zoo17.x_q.sum())
    assert seen == [want, want] and h.trace_count == 1
    assert capfd.readouterr().out.count(f"x sum {want}") == 2
    with pytest.raises(sm.ConfigError, match="debug_callback, debug_print"):
        sm.export(h, tmp_path / "m", example=(zoo17.x_q,))


def _doubling(w, x):  # a while_loop whose trip count depends on the input: no VJP
    return jax.lax.while_loop(lambda c: c.sum() < 100.0, lambda c: c * w, x)


@pytest.mark.slow
def test_grad_of_a_loaded_while_loop_says_what_export_with_a_vjp_needs(tmp_path):
    """A model whose ``lax.while_loop`` carries its input, exported with ``vjp_order=0``:
    ``jax.grad`` of the loaded model says its loop must become a ``lax.scan`` first (it said
    only "export it again with vjp_order=1", which export refuses for that loop, as here)."""
    h, x = sm.hybridize(_doubling, jnp.float32(1.5)), jnp.ones((2, 3))
    with pytest.raises(sm.ConfigError, match="while_loop"):
        sm.export(h, tmp_path / "vjp", example=(x,), vjp_order=1)
    sm.export(h, tmp_path / "m", example=(x,))
    m = sm.load(tmp_path / "m", allow={"while"})
    close(m(x), jax.jit(_doubling)(1.5, x))
    with pytest.raises(sm.ConfigError, match="reverse-differentiate one that carries") as e:
        jax.grad(lambda x: m(x).sum())(x)
    assert "lax.scan" in str(e.value) and "vjp_order=1" in str(e.value)
