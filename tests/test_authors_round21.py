"""Code we did not write, round twenty-one (tests/zoo21.py and tests/zoo21b.py; sources and
commit there): five more of Diffrax's examples, each in a process of its own under
``EQX_ON_ERROR=off`` (diffrax's runtime checks are ``eqx.error_if``, which export refuses
naming that setting), over the features that apply: the Hybrid equal to the original,
export, load, the loaded model's answers and grads, and the example's own training step
against ours over ``h.apply``.

- neural_cde.ipynb: ``NeuralCDE`` (a cubic-spline control, ``PIDController``) over a batch of
  the example's spirals, its four spline coefficients four inputs of the artifact.
- stiff_ode.ipynb: ``main`` (``Kvaerno5``: optimistix's Newton and lineax's LU inside) under
  the notebook's 64 bits, over a batch of rate constants.
- steady_state.ipynb: ``loss`` (to ``t1=inf``, ``steady_state_event``, ``ImplicitAdjoint``).
- latent_ode.ipynb: ``LatentODE.train`` and ``sample``, their ``key`` keyword-only.
- kalman_filter.ipynb: ``KalmanFilter`` (``Dopri5``, a ``LinearInterpolation`` of the data).
- Optimistix's optimise_diffeq.ipynb (tests/zoo21c.py): ``least_squares`` of its ``residuals``
  by ``LevenbergMarquardt``, the fitted parameters as a function of the data, an implicit
  layer (its grads by the implicit function theorem).

An adaptive solve's steps depend on the program it is compiled in (rounding decides a step's
acceptance), so its answers are compared with the original compiled alike (both
``eqx.filter_jit``, or both unjitted): the original's own ``make_step`` and its ``grad_loss``
differ by 0.6% at the same params.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import symjax_mlp as sm


def _run(script, tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), str(tmp_path), os.path.dirname(__file__)],
        env={**os.environ, "EQX_ON_ERROR": "off"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0 and run.stdout.split()[-1] == "ok", run.stderr[-3000:]


_CDE = r"""
import sys; sys.path.insert(0, sys.argv[2])
import equinox as eqx, jax, jax.numpy as jnp, jax.random as jr, numpy as np, optax, pytest, zoo21
from features import close
import symjax_mlp as sm
ts, coeffs, labels, data_size = zoo21.get_data(4, False, key=jr.PRNGKey(0))
model = zoo21.NeuralCDE(data_size, 8, 8, 1, key=jr.PRNGKey(5678))
f = lambda m, ti, *coeff_i: jax.vmap(m)(ti, coeff_i)  # the example's loss calls it so
ref = eqx.filter_jit(f)  # compiled as ours: eager's adaptive steps differ (round-off, 5e-3)
h = sm.hybridize(f, model)
close(h(ts, *coeffs), ref(model, ts, *coeffs))
assert h.graph(ts, *coeffs).flops > 0
# the model itself, one sample, its evolving_out a setting
one = sm.hybridize(model)
c0 = tuple(c[0] for c in coeffs)
evolving = eqx.filter_jit(lambda m, t, c: m(t, c, evolving_out=True))(model, ts[0], c0)
close(one(ts[0], c0, evolving_out=True), evolving)
with pytest.raises(sm.ConfigError, match="VJP of order 2 .*Export it with vjp_order=1"):
    sm.export(h, sys.argv[1] + "/two", example=(ts, *coeffs), vjp_order=2)
sm.export(h, sys.argv[1] + "/m", example=(ts, *coeffs), vjp_order=1)
m = sm.load(sys.argv[1] + "/m", trust=True)
rows = (ts[:3], *(c[:3] for c in coeffs))
close(m(*map(np.asarray, rows)), ref(model, *rows))
grad = lambda g: jax.jit(jax.grad(lambda *r: g(*r).sum(), argnums=(1, 2, 3, 4)))
close(grad(m)(*rows), grad(lambda *r: f(model, *r))(*rows))
# main's make_step (adam, binary cross-entropy) against ours over the Hybrid's apply
optim = optax.adam(1e-2)
loss, make_step = zoo21.authors_cde_make_step(optim)
opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
p, opt = h.params, optim.init(h.params)

def ours(p, ti, label_i, *coeff_i):
    pred = h.apply(p, ti, *coeff_i)
    return -jnp.mean(label_i * jnp.log(pred) + (1 - label_i) * jnp.log(1 - pred))

# both unjitted: an adaptive solve's steps differ with the program it is compiled in (the
# original's own make_step returns 1.241 where its grad_loss returns 1.233, the same params)
make_step, step = make_step.__wrapped__, jax.value_and_grad(ours)
for _, data_i in zip(range(2), zoo21.dataloader((ts, labels) + coeffs, 2, key=jr.PRNGKey(1))):
    bxe, acc, model, opt_state = make_step(model, data_i, opt_state)
    mine, grads = step(p, *data_i)
    updates, opt = optim.update(grads, opt)
    p = optax.apply_updates(p, updates)
    close(mine, bxe)
close(p, eqx.filter(model, eqx.is_inexact_array))
close(h.replace(params=p)(ts, *coeffs), ref(model, ts, *coeffs))
close(ours(p, ts, labels, *coeffs), loss(model, ts, labels, coeffs)[0])
print("ok")
"""


@pytest.mark.slow  # a process of its own, exports of solves (30 s or more)
def test_neural_cde_through_the_loaded_model_and_its_make_step(tmp_path):
    """neural_cde.ipynb's ``NeuralCDE`` over a batch of its spirals (``ts`` and the four
    coefficient arrays of ``backward_hermite_coefficients``, five inputs, batch symbolic):
    the Hybrid, the model hybridized alone with ``evolving_out=True``, the loaded model and
    its grads with respect to every input equal the original's; ``vjp_order=2`` is refused
    naming order 1 (an adaptive loop); two of ``main``'s ``make_step`` (adam over its binary
    cross-entropy) equal two steps over ``h.apply``."""
    _run(_CDE, tmp_path)


_STIFF = r"""
import sys; sys.path.insert(0, sys.argv[2])
import jax
jax.config.update("jax_enable_x64", True)  # the notebook's first line after its imports
import jax.numpy as jnp, numpy as np, zoo21
from features import close
import symjax_mlp as sm
x64 = {"rtol": 1e-10, "atol": 1e-12}
rates = jnp.array([[0.04, 3e7, 1e4], [0.05, 3e7, 1e4], [0.04, 1e7, 2e4]])
f = lambda p, k: jax.vmap(lambda r: zoo21.main(r[0], r[1], r[2]).ys)(k)
h = sm.hybridize(f, {})
want = f({}, rates)
assert want.dtype == jnp.float64
close(h(rates), want, **x64)
sm.export(h, sys.argv[1] + "/m", example=(rates,), vjp_order=1)
m = sm.load(sys.argv[1] + "/m", trust=True)
got = m(np.asarray(rates[:2]))
assert got.dtype == np.float64
close(got, want[:2], **x64)
close(jax.grad(lambda r: m(r)[:, -1].sum())(rates[:2]),
      jax.grad(lambda r: f({}, r)[:, -1].sum())(rates[:2]), rtol=1e-8, atol=1e-12)
# Robertson's Python-float rates are no params, as eqx.filter_grad takes none of them
rob = zoo21.Robertson(0.04, 3e7, 1e4)
hr = sm.hybridize(rob)
assert jax.tree.leaves(hr.params) == []
y = jnp.array([0.9, 0.05, 0.05])
close(hr(0.0, y, None), rob(0.0, y, None), **x64)
print("ok")
"""


@pytest.mark.slow  # a process of its own, exports of solves (30 s or more)
def test_stiff_ode_main_in_64_bits_through_the_loaded_model(tmp_path):
    """stiff_ode.ipynb's ``main`` (``Kvaerno5`` with ``PIDController(rtol=1e-8)``) under the
    notebook's ``jax_enable_x64``, over a batch of rate constants: the Hybrid's, the loaded
    model's float64 answers and its grads are the original's to 64-bit tolerances; the
    ``Robertson`` vector field hybridized alone holds its Python floats as constants."""
    _run(_STIFF, tmp_path)


_STEADY = r"""
import sys; sys.path.insert(0, sys.argv[2])
import jax, jax.numpy as jnp, numpy as np, optax, zoo21
from features import close
import symjax_mlp as sm
h = sm.hybridize(zoo21.loss, zoo21.model)
target = zoo21.target_steady_state
close(h(target), zoo21.loss(zoo21.model, target))
# the notebook's make_step (sgd, nesterov momentum) against ours over the Hybrid's apply
model, opt_state = zoo21.model, zoo21.opt_state
p, opt = h.params, zoo21.optim.init(h.params)
for _ in range(3):
    model, opt_state = zoo21.make_step(model, opt_state, target)
    updates, opt = zoo21.optim.update(jax.grad(h.apply)(p, target), opt)
    p = optax.apply_updates(p, updates)
close(p, model)
assert abs(float(p.steady_state)) > 1e-3  # the steps moved it
sm.export(h, sys.argv[1] + "/m", example=(target,), batch=None, vjp_order=2)
m = sm.load(sys.argv[1] + "/m", trust=True)
theirs = lambda t: zoo21.loss(zoo21.model, t)
close(m(np.asarray(target)), theirs(target))
close(jax.grad(m)(target), jax.grad(theirs)(target))
close(jax.jacrev(jax.jacrev(m))(target), jax.hessian(theirs)(target))  # reverse only
trained = sm.load(sys.argv[1] + "/m", trust=True, params=p)
close(trained(np.asarray(target)), zoo21.loss(model, target))
print("ok")
"""


@pytest.mark.slow  # a process of its own, exports of solves (30 s or more)
def test_steady_state_loss_and_make_step_through_the_implicit_adjoint(tmp_path):
    """steady_state.ipynb's ``loss`` (a solve to ``t1=inf`` with no step bound, stopped by
    ``steady_state_event``, differentiated by the implicit function theorem) as a Hybrid of
    its model: equal to the original; three of the notebook's ``make_step`` (sgd with
    nesterov momentum) equal three steps over ``h.apply``; exported with ``vjp_order=2``, the
    loaded model's value, grad and Hessian in the target are the original's, and loaded with
    the trained params it answers as the trained model."""
    _run(_STEADY, tmp_path)


_LATENT = r"""
import sys; sys.path.insert(0, sys.argv[2])
import re
import equinox as eqx, jax, jax.numpy as jnp, jax.random as jr, numpy as np, optax, pytest, zoo21b
from features import close
import symjax_mlp as sm
ts, ys = zoo21b.get_data(4, key=jr.PRNGKey(0))
model = zoo21b.LatentODE(data_size=2, hidden_size=4, latent_size=4, width_size=8, depth=1,
                         key=jr.PRNGKey(5678))
train = eqx.filter_jit(lambda m, t, y, key: m.train(t, y, key=key))
h = sm.hybridize(model.train)  # train(model, ts, ys, *, key)
k1, k2 = jr.PRNGKey(1), jr.PRNGKey(2)
a, b = h(ts[0], ys[0], key=k1), h(ts[0], ys[0], key=k2)
close(a, train(model, ts[0], ys[0], k1))
close(b, train(model, ts[0], ys[0], k2))
assert abs(float(a - b)) > 1e-3  # the key is an input, not a constant of the first call
keys = jr.split(k1, 4)  # the example's loss: jax.vmap(model.train)(ts_i, ys_i, key=key_i)
close(jax.vmap(h)(ts, ys, key=keys), jax.vmap(train, in_axes=(None, 0, 0, 0))(model, ts, ys, keys))
# sample(ts, *, key): a key in export's kwargs is refused, naming a function that gives it a
# place; that function, as written, exports, and its artifact takes raw and typed keys
s = sm.hybridize(model.sample)
with pytest.raises(sm.SignatureError, match=r"kwargs\['key'\] is an array") as refused:
    sm.export(s, sys.argv[1] + "/no", example=(ts[0],), kwargs={"key": k1}, batch=None)
written = re.search(r"sm\.hybridize\(lambda .*?, h\.params\)", str(refused.value)).group()
g = eval(written, {"sm": sm, "h": s})
sample = eqx.filter_jit(lambda m, t, key: m.sample(t, key=key))
for i, (key, other) in enumerate([(k1, k2), (jr.key(3), jr.key(4))]):
    sm.export(g, sys.argv[1] + f"/s{i}", example=(ts[0], key), batch=None, vjp_order=0)
    m = sm.load(sys.argv[1] + f"/s{i}", trust=True)
    arg = np.asarray(other) if i == 0 else other
    close(m(np.asarray(ts[0]), arg), sample(model, ts[0], other))
# main's make_step (adam over the mean of vmapped train) against ours over a Hybrid's apply
optim = optax.adam(1e-2)
make_step = zoo21b.authors_latent_make_step(optim)
hb = sm.hybridize(lambda m, ts_i, ys_i, key_i: jax.vmap(m.train)(ts_i, ys_i, key=key_i), model)

def ours(p, ts_i, ys_i, key_i):
    return jnp.mean(hb.apply(p, ts_i, ys_i, jr.split(key_i, ts_i.shape[0])))

opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
p, opt, step = hb.params, optim.init(hb.params), jax.jit(jax.value_and_grad(ours))
their_key = our_key = jr.PRNGKey(7)
for _, (ts_i, ys_i) in zip(range(2), zoo21b.dataloader((ts, ys), 2, key=jr.PRNGKey(8))):
    value, model, opt_state, their_key = make_step(model, opt_state, ts_i, ys_i, their_key)
    mine, grads = step(p, ts_i, ys_i, our_key)
    our_key = jr.split(our_key, 1)[0]
    updates, opt = optim.update(grads, opt)
    p = optax.apply_updates(p, updates)
    close(mine, value)
close(p, eqx.filter(model, eqx.is_inexact_array))
print("ok")
"""


@pytest.mark.slow  # a process of its own, exports of solves (30 s or more)
def test_latent_ode_keyword_key_train_sample_and_make_step(tmp_path):
    """latent_ode.ipynb's ``LatentODE``: ``train(ts, ys, *, key)`` hybridized as a bound
    method answers as the original for each key (the key an input, not the first call's
    constant), under ``jax.vmap`` with ``key=`` as the example's loss calls it too;
    ``sample(ts, *, key)`` with the key in export's ``kwargs`` is refused naming a function
    that gives it a place, which exports as written and answers as ``sample`` for raw and
    typed keys; two of ``main``'s ``make_step`` equal two steps over ``h.apply``."""
    _run(_LATENT, tmp_path)


_KALMAN = r"""
import sys; sys.path.insert(0, sys.argv[2])
import equinox as eqx, jax, jax.numpy as jnp, numpy as np, optax, pytest, zoo21b
from features import close
import symjax_mlp as sm
ts = jnp.arange(0, 1.0, 0.01)  # main's: jnp.arange(0, 5.0, 0.01)
xs, ys = zoo21b.simulate_lti_system(
    zoo21b.harmonic_oscillator(0.3), jnp.array([1.0, 0.0]), ts, std_measurement_noise=1.0)
kmf = zoo21b.KalmanFilter(zoo21b.harmonic_oscillator(0.7), jnp.array([0.0, 0.0]),
                          jnp.diag(jnp.ones((2,))) * 10.0, jnp.diag(jnp.ones((2,))) * 0.1,
                          jnp.diag(jnp.ones((1,))))
h = sm.hybridize(kmf)  # its us=None default: no control
close(h(ts, ys), kmf(ts, ys))
with pytest.raises(sm.ConfigError, match="VJP of order 2 .*Export it with vjp_order=1"):
    sm.export(h, sys.argv[1] + "/two", example=(ts, ys), batch=None, vjp_order=2)
sm.export(h, sys.argv[1] + "/m", example=(ts, ys), batch=None, vjp_order=1)
m = sm.load(sys.argv[1] + "/m", trust=True)
close(m(np.asarray(ts), np.asarray(ys)), kmf(ts, ys))
# unjitted both: jax.jit(jax.grad) of the original itself differs from its jax.grad by 0.6%
close(jax.grad(lambda y: m(ts, y).sum())(ys), jax.grad(lambda y: kmf(ts, y).sum())(ys))
# main's loss_fn (its filter_spec: only Q_root and R_root trained) against ours over those
# two leaves of h.apply's params; its make_step fails in optax 0.2.8's adam (None grads)
filter_spec, loss_fn, _ = zoo21b.authors_kalman_make_step(kmf, optax.adam(1e-2))
value, grads = loss_fn(*eqx.partition(kmf, filter_spec), ts, ys, xs)

def ours(qr, p, ts, ys, xs):
    p = eqx.tree_at(lambda k: (k.Q_root, k.R_root), p, qr)
    return jnp.mean((xs - h.apply(p, ts, ys)) ** 2)

mine, qr_grads = jax.value_and_grad(ours)((h.params.Q_root, h.params.R_root), h.params, ts, ys, xs)
close(mine, value)
close(qr_grads, (grads.Q_root, grads.R_root))
assert grads.sys.A is None and float(jnp.abs(qr_grads[0]).sum()) > 0
print("ok")
"""


@pytest.mark.slow  # a process of its own, exports of solves (30 s or more)
def test_kalman_filter_through_the_loaded_model_and_its_masked_make_step(tmp_path):
    """kalman_filter.ipynb's ``KalmanFilter`` (state and covariance one ``Dopri5`` solve, its
    measurements a ``LinearInterpolation``) hybridized as the module: the Hybrid, the loaded
    model and its grads in the measurements equal the original's; ``vjp_order=2`` is refused
    naming order 1; ``main``'s ``loss_fn`` (its ``filter_spec`` trains ``Q_root`` and ``R_root``
    only) has the value and grads of ours over those two leaves of ``h.apply``'s params (its
    ``make_step`` fails in optax 0.2.8's adam, which refuses the other leaves' None grads)."""
    _run(_KALMAN, tmp_path)


_FIT = r"""
import sys; sys.path.insert(0, sys.argv[2])
import jax, jax.numpy as jnp, lineax as lx, numpy as np, optimistix as optx, pytest, zoo21c
from features import close
import symjax_mlp as sm
(y0s, values) = zoo21c.get_data()
init_parameters = jnp.zeros(4)

def fitted(solver):  # the notebook's sol = optx.least_squares(...), of the data
    return lambda p, values: optx.least_squares(
        zoo21c.residuals, solver, p, args=(y0s, values)).value

solver = optx.LevenbergMarquardt(rtol=1e-8, atol=1e-8, verbose=True)  # as written
h = sm.hybridize(fitted(solver), init_parameters)
with pytest.raises(sm.ConfigError, match=r"calls back into Python \(debug_print\)"):
    sm.export(h, sys.argv[1] + "/verbose", example=(values,), batch=None)
quiet = sm.hybridize(fitted(optx.LevenbergMarquardt(rtol=1e-8, atol=1e-8)), init_parameters)
with pytest.raises(sm.ConfigError, match=r"lapack_sormqr_ffi.*linear_solver=lx\.SVD\(\)"):
    sm.export(quiet, sys.argv[1] + "/qr", example=(values,), batch=None)  # lineax's QR
fit = fitted(optx.LevenbergMarquardt(rtol=1e-8, atol=1e-8, linear_solver=lx.SVD()))
h = sm.hybridize(fit, init_parameters)  # as the refusal says
want = jax.jit(fit)(init_parameters, values)
close(h(values), want, rtol=1e-4, atol=1e-6)
sm.export(h, sys.argv[1] + "/m", example=(values,), batch=None, vjp_order=1)
m = sm.load(sys.argv[1] + "/m", trust=True)
close(m(np.asarray(values)), want, rtol=1e-4, atol=1e-6)
close(want, jnp.array([0.1, 0.02, 0.4, 0.02]), rtol=1e-3, atol=1e-5)  # the data's parameters
theirs = jax.jit(jax.grad(lambda v: fit(init_parameters, v)[0]))(values)
close(jax.grad(lambda v: m(v)[0])(values), theirs, rtol=1e-3, atol=1e-6)  # implicit, loaded
print("ok")
"""


@pytest.mark.slow  # a process of its own, exports of solves (30 s or more)
def test_optimise_diffeq_fit_as_an_implicit_layer_exports_as_the_refusal_says(tmp_path):
    """optimise_diffeq.ipynb's fit (``least_squares`` of ``residuals``, Levenberg-Marquardt)
    as a function of the data: export refuses the solver's
    ``verbose=True`` (a ``jax.debug.print``) and then lineax's QR, whose ``ormqr`` kernel
    ``jax.export`` will not write (it raised JAX's bare ValueError: now a ConfigError naming
    the kernel and ``linear_solver=lx.SVD()``); with that solver the Hybrid and the loaded
    model fit as the original, and the loaded model's grad in the data (implicit) is its."""
    _run(_FIT, tmp_path)


def _ormqr(p, x):  # jax.lax.linalg.ormqr's documented use, as lineax's QR solver calls it
    h, taus = jnp.linalg.qr(p["a"], mode="raw")
    return jax.lax.linalg.ormqr(h.mT, taus, x.T, transpose=True).T


@pytest.mark.slow  # an export (~1 s)
def test_a_kernel_jax_will_not_export_is_refused_naming_it_and_what_does(tmp_path):
    """A function calling ``jax.lax.linalg.ormqr`` (lineax's QR solve, optimistix's
    Levenberg-Marquardt's): export raised jax.export's bare ValueError ("Cannot serialize
    code with custom calls whose targets have no compatibility guarantees"); now a
    ConfigError names the kernel, why no artifact can carry it, and the solvers that export."""
    h = sm.hybridize(_ormqr, {"a": jax.random.normal(jax.random.key(0), (4, 4))})
    x = jnp.ones((2, 4))
    assert h(x).shape == (2, 4)
    with pytest.raises(sm.ConfigError, match=r"export\(_ormqr\): .*kernel\(s\) lapack_sormqr_ffi,"
                       r" .*no compatibility guarantee.*linear_solver=lx\.SVD\(\)"):  # fmt: skip
        sm.export(h, tmp_path / "m", example=(x,))
    assert not (tmp_path / "m").exists()
