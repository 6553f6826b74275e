"""Code we did not write, round twenty-five (tests/zoo25.py; sources and commits there): two
probabilistic-programming libraries never run here before. A posterior is a stack of weight
sets, the workload of ``jax.vmap(m.apply, ...)`` over a loaded model.

- NumPyro's bnn.py: its ``run_inference`` (NUTS, sizes cut) draws a posterior; NumPyro's own
  ``Predictive`` of one sample, hybridized with the sample as params and exported, run by the
  loaded model under ``jax.vmap(m.apply, ...)`` over the stacked samples and their keys,
  equals ``Predictive`` over the whole posterior, bit for bit.
- BlackJAX's howto_use_numpyro.md: eight schools' ``initialize_model`` potential, hybridized
  with the position as params (the data ``y`` its input), exported: the loaded model's
  value, gradients and Hessians (of ``m`` and of ``m.apply``) equal NumPyro's; the howto's
  window adaptation and ``inference_loop`` (a ``jax.lax.scan`` of the NUTS step) over the
  loaded log density draw the source's samples from the same keys (values bit for bit,
  gradients and so draws within float32 rounding: another compilation, as the source's own
  jitted and eager gradients differ); the README's quickstart NUTS over its own
  ``logdensity_fn`` exported (no inputs; ``m.apply`` the log density), bit for bit.
- NumPyro's handlers (``seed``, ``substitute``, ``trace``, ``Predictive``) around a model whose
  network (over every feature) is a Hybrid or a loaded model, its weights drawn outside it:
  the sites, draws and log density of bnn.py's own model. A Hybrid whose function holds a
  sample site, called under handlers entered outside it, is refused (it baked the first key
  into its program, later calls drew the same numbers with no site in the trace: silent).
  Three ``SVI`` steps of an ``AutoNormal`` guide through ``h.apply`` equal bnn.py's own.
"""

import threading
import types

import blackjax
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
import zoo25
from features import close, every_feature
from numpyro import handlers
from numpyro.infer import SVI, Predictive, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal
from numpyro.infer.util import initialize_model, log_density

import symjax_mlp as sm

D_H = 5


def _same(a, b):
    """Bit for bit, leaf by leaf."""
    jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), a, b)


@pytest.fixture(scope="module")
def posterior():
    """bnn.py's data (20 points, 30 test points) and ``run_inference``'s 8 samples (30 warmup
    steps, one chain, no progress bar as under its docs build)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("NUMPYRO_SPHINXBUILD", "1")
    X, Y, X_test = zoo25.get_data(N=20, N_test=30)
    args = types.SimpleNamespace(num_warmup=30, num_samples=8, num_chains=1)
    rng_key, rng_key_predict = jax.random.split(jax.random.key(0))
    samples = zoo25.run_inference(zoo25.model, args, rng_key, X, Y, D_H)
    mp.undo()
    return X_test, samples, rng_key_predict


@pytest.mark.slow  # NUTS (~20 s)
def test_bnn_posterior_predictive_by_a_loaded_model_under_vmap(posterior, tmp_path):
    """``Predictive`` of one posterior sample (its params) and a key, hybridized and exported;
    ``jax.vmap(m.apply, in_axes=(0, 0, None))`` over the stacked samples and the keys
    ``Predictive`` splits equals ``Predictive`` over the posterior, bit for bit; the samples
    differ (the chain moved), and so do the predictions."""
    X_test, samples, key = posterior
    assert len(set(np.asarray(samples["prec_obs"]).tolist())) == 8
    want = Predictive(zoo25.model, samples)(key, X_test, None, D_H)["Y"]
    one = jax.tree.map(lambda a: a[0], samples)

    def predictive(s, rng_key, x):
        return Predictive(zoo25.model, s, batch_ndims=0)(rng_key, x, None, D_H)["Y"]

    h = sm.hybridize(predictive, one)
    keys = jax.random.split(key, 8)
    _same(h(keys[0], X_test), want[0])
    sm.export(h, tmp_path / "bnn", example=(keys[0], X_test), batch=None)
    m = sm.load(tmp_path / "bnn")
    got = jax.vmap(m.apply, in_axes=(0, 0, None))(samples, keys, X_test)
    _same(got, want)
    assert np.ptp(np.asarray(want[:, 0, 0])) > 0.01


def _eight_schools():
    """The howto's ``initialize_model`` (its key a fixed date's): the position and the
    potential of the data."""
    rng_key = jax.random.key(20261207)
    rng_key, init_key = jax.random.split(rng_key)
    init_params, potential_fn_gen, *_ = initialize_model(
        init_key,
        zoo25.eight_schools_noncentered,
        model_args=(zoo25.J, zoo25.sigma, zoo25.y),
        dynamic_args=True,
    )
    return init_params.z, lambda z, y: potential_fn_gen(zoo25.J, zoo25.sigma, y)(z)


@pytest.mark.slow  # a compile or more (~0.5 s or more)
def test_eight_schools_potential_exported_and_its_derivatives(tmp_path):
    """The potential with the position as params (a dict), of the data ``y`` (an artifact's
    input is an array): ``h(y)``, its graph, the loaded model's value, its gradient and
    Hessian with respect to ``y`` and, through ``m.apply``, to the position, equal NumPyro's.
    (Not ``every_feature``: a log density is one number for all rows, which no Batcher
    serves.)"""
    position, potential = _eight_schools()
    y = jnp.asarray(zoo25.y, jnp.float32)
    h = sm.hybridize(potential, position)
    close(h(y), potential(position, y))
    assert h.graph(y).flops > 0
    sm.export(h, tmp_path / "m", example=(y,), batch=None, vjp_order=2)
    m = sm.load(tmp_path / "m")
    close(m(y), potential(position, y))
    for f in (jax.grad, lambda g: jax.jacrev(jax.jacrev(g))):  # reverse mode, as loaded
        close(f(m)(y), f(lambda data: potential(position, data))(y))
        close(f(m.apply)(position, y), f(potential)(position, y))


@pytest.mark.slow  # two window adaptations and NUTS chains (~20 s)
def test_blackjax_howto_nuts_over_the_loaded_log_density(tmp_path):
    """The howto's ``window_adaptation`` (cut to 40 steps) and ``inference_loop`` (30 draws)
    of BlackJAX's NUTS over ``logdensity_fn = -m.apply(position, y)`` equal those over the
    source's ``-potential`` from the same keys: the step size, the inverse mass matrix and
    every draw, within float32's rounding, not bit for bit: the gradient is another XLA
    compilation (the loaded model's vjp, fused apart from BlackJAX's step), as the source's
    own gradient differs jitted and eager (by 3e-5 here); the values are equal. The chain
    moves."""
    position, potential = _eight_schools()
    y = jnp.asarray(zoo25.y, jnp.float32)
    sm.export(sm.hybridize(potential, position), tmp_path / "p", example=(y,), batch=None,
              vjp_order=1)  # fmt: skip
    m = sm.load(tmp_path / "p")
    runs = []
    zs = [jax.tree.map(lambda a, i=i: a + 0.1 * i, position) for i in range(10)]
    for z in zs:  # the values bit for bit, the gradient within rounding
        _same(jax.jit(m.apply)(z, y), jax.jit(potential)(z, y))
    for logdensity_fn in (lambda z: -potential(z, y), lambda z: -m.apply(z, y)):
        adapt = blackjax.window_adaptation(blackjax.nuts, logdensity_fn, target_acceptance_rate=0.8)
        (last_state, parameters), _ = adapt.run(jax.random.key(1), position, 40)
        kernel = blackjax.nuts(logdensity_fn, **parameters).step
        states, infos = zoo25.inference_loop(jax.random.key(2), kernel, last_state, 30)
        runs.append((parameters, states.position, infos))
    close(runs[1], runs[0], rtol=1e-5, atol=1e-5)
    assert len(set(np.asarray(runs[0][1]["mu"]).tolist())) > 5


@pytest.mark.slow  # NUTS (~5 s)
def test_blackjax_readme_nuts_over_a_loaded_log_density(tmp_path):
    """The README's quickstart (step size 1e-3, unit inverse mass matrix, the position a dict
    ``{"loc", "scale"}``) over the loaded model of its own ``logdensity_fn`` (the position as
    params, its ``observed`` a constant: an artifact of no inputs, ``m.apply(x)``): 100 jitted
    steps from ``fold_in`` keys, the README's loop, equal the source's bit for bit."""
    initial_position = {"loc": jnp.float32(1.0), "scale": jnp.float32(2.0)}
    h = sm.hybridize(zoo25.logdensity_fn, initial_position)
    _same(h(), zoo25.logdensity_fn(initial_position))
    sm.export(h, tmp_path / "r", example=(), batch=None, vjp_order=1)
    m = sm.load(tmp_path / "r")
    _same(m(), h())
    rng_key = jax.random.key(0)
    chains = []
    for logdensity_fn in (zoo25.logdensity_fn, m.apply):
        nuts = blackjax.nuts(logdensity_fn, 1e-3, jnp.array([1.0, 1.0]))
        state = nuts.init(initial_position)
        step = jax.jit(nuts.step)
        for i in range(100):
            state, _ = step(jax.random.fold_in(rng_key, i), state)
        chains.append(state.position)
    _same(chains[1], chains[0])
    assert abs(chains[0]["loc"] - 1.0) > 1e-3


def _network(w, X):
    """bnn.py's flow D_X => D_H => D_H => D_Y, of the weights its model samples."""
    z1 = zoo25.nonlin(jnp.matmul(X, w["w1"]))
    z2 = zoo25.nonlin(jnp.matmul(z1, w["w2"]))
    return jnp.matmul(z2, w["w3"])


def _model_of(net):
    """bnn.py's ``model`` with its network ``net(weights, X)`` (a Hybrid's ``apply`` or a
    loaded model's): the same sites, priors and likelihood, the weights drawn outside it."""

    def model(X, Y, D_H, D_Y=1):
        N, D_X = X.shape
        shapes = {"w1": (D_X, D_H), "w2": (D_H, D_H), "w3": (D_H, D_Y)}
        w = {
            k: numpyro.sample(k, dist.Normal(jnp.zeros(s), jnp.ones(s))) for k, s in shapes.items()
        }
        z3 = net(w, X)
        prec_obs = numpyro.sample("prec_obs", dist.Gamma(3.0, 1.0))
        with numpyro.plate("data", N):
            numpyro.sample("Y", dist.Normal(z3, 1.0 / jnp.sqrt(prec_obs)).to_event(1), obs=Y)

    return model


@pytest.mark.slow  # a compile or more (~0.5 s or more)
def test_numpyro_handlers_around_a_hybrid_and_a_loaded_network(tmp_path):
    """bnn.py's network (its flow, of weights) over every feature; bnn.py's model with that
    network a Hybrid (``h.apply``) or the loaded model (``m.apply``): under ``seed`` and
    ``trace`` the sites and draws of bnn.py's own model, under ``substitute`` its ``predict``
    (bnn.py's own helper) and its log density, and ``Predictive`` over stacked weights (a
    ``lax.map``, or with ``parallel=True`` a vmap, over ``m.apply``) equal to bnn.py's; the
    potential NUTS samples (``initialize_model``'s), its value and gradient too. (A NUTS chain
    over it is not bnn.py's chain: the gradients differ by float32 rounding, 1e-7 relative,
    another compilation, which a few dozen leapfrog steps of a tanh network amplify.)"""
    X, Y, X_test = zoo25.get_data(N=20, N_test=30)
    shapes = {"w1": (3, D_H), "w2": (D_H, D_H), "w3": (D_H, 1)}
    w = {k: jax.random.normal(jax.random.key(i), s) for i, (k, s) in enumerate(shapes.items())}
    h = sm.hybridize(_network, w)
    m = every_feature(tmp_path, h, lambda x: _network(w, x), X_test)
    key = jax.random.key(3)
    theirs = handlers.trace(handlers.seed(zoo25.model, key)).get_trace(X, Y, D_H)
    samples = {k: jnp.stack([w[k] * (1 + i / 8) for i in range(4)]) for k in w}
    samples["prec_obs"] = jnp.arange(1.0, 5.0)
    want = Predictive(zoo25.model, samples)(key, X_test, None, D_H)["Y"]
    one = jax.tree.map(lambda a: a[1], samples)
    for net in (h.apply, m.apply):
        model = _model_of(net)
        ours = handlers.trace(handlers.seed(model, key)).get_trace(X, Y, D_H)
        assert list(ours) == list(theirs)
        close({k: s["value"] for k, s in ours.items()}, {k: s["value"] for k, s in theirs.items()})
        close(zoo25.predict(model, key, one, X_test, D_H),
              zoo25.predict(zoo25.model, key, one, X_test, D_H))  # fmt: skip
        close(log_density(model, (X, Y, D_H), {}, one)[0],
              log_density(zoo25.model, (X, Y, D_H), {}, one)[0])  # fmt: skip
        for parallel in (False, True):  # samples one at a time (lax.map), or a vmap
            close(Predictive(model, samples, parallel=parallel)(key, X_test, None, D_H)["Y"], want)
    theirs_potential = initialize_model(key, zoo25.model, model_args=(X, Y, D_H))[1]
    ours_potential = initialize_model(key, model, model_args=(X, Y, D_H))[1]  # m.apply's
    for i in range(3):  # NUTS's potential (unconstrained), its value and gradient
        z = jax.tree.map(lambda a, i=i: a * (1 + i), {**one, "prec_obs": jnp.log(one["prec_obs"])})
        close(jax.value_and_grad(ours_potential)(z), jax.value_and_grad(theirs_potential)(z))


@pytest.mark.slow  # a compile or more (~0.5 s or more)
def test_a_sample_site_inside_a_hybrid_under_outer_handlers_is_refused():
    """A Hybrid whose function draws ``numpyro.sample`` itself, called in a model under
    ``seed`` and ``trace``: traced once, its program baked the first key in, the trace held a
    tracer, and a second call under another seed drew the same numbers with no site in its
    trace (silent). Refused, naming the site, the handlers and both routes; handlers inside
    the Hybrid's function (``seed`` there) are its own, and run."""
    h = sm.hybridize(lambda _, x: numpyro.sample("w", dist.Normal(jnp.zeros(3), 1.0)) * x, {})
    x = jnp.ones(3)
    said = r"'w' inside the Hybrid.*handlers entered outside the Hybrid \(seed, trace\).*h.apply"
    for k in (0, 1):
        with pytest.raises(sm.ConfigError, match=said):
            handlers.trace(handlers.seed(lambda: h(x), jax.random.key(k))).get_trace()

    def inside(_, key, x):
        return handlers.seed(lambda: numpyro.sample("w", dist.Normal(jnp.zeros(3), 1.0)), key)() * x

    g = sm.hybridize(inside, {})
    draws = [g(jax.random.key(k), x) for k in (0, 1)]
    close(draws[0], handlers.seed(lambda: numpyro.sample("w", dist.Normal(jnp.zeros(3), 1.0)),
                                  jax.random.key(0))())  # fmt: skip
    assert np.abs(draws[0] - draws[1]).max() > 0.1


@pytest.mark.slow  # SVI's compiles (~20 s)
def test_numpyro_svi_of_an_auto_normal_guide_through_h_apply():
    """Three ``SVI`` steps (``AutoNormal`` guide, ``Trace_ELBO``, NumPyro's Adam 0.01) of bnn.py's
    model with its network ``h.apply`` equal three of bnn.py's own model: the losses and the
    guide's params, bit for bit."""
    X, Y, _ = zoo25.get_data(N=20, N_test=30)
    shapes = {"w1": (3, D_H), "w2": (D_H, D_H), "w3": (D_H, 1)}
    h = sm.hybridize(_network, {k: jnp.zeros(s) for k, s in shapes.items()})
    runs = []
    for model in (zoo25.model, _model_of(h.apply)):
        svi = SVI(model, AutoNormal(model), numpyro.optim.Adam(0.01), Trace_ELBO())
        state = svi.init(jax.random.key(0), X, Y, D_H)
        step = jax.jit(lambda s, svi=svi: svi.update(s, X, Y, D_H))
        losses = []
        for _ in range(3):
            state, loss = step(state)
            losses.append(loss)
        runs.append((losses, svi.get_params(state)))
    _same(runs[1], runs[0])
    assert runs[0][0][0] != runs[0][0][2]


@pytest.mark.slow  # a compile or more (~0.5 s or more)
def test_another_threads_numpyro_model_passes_a_hybrids_trace():
    """NumPyro's handler stack is one list for every thread: while a Hybrid (no site of its
    own) traces here, another thread's model, inside its own ``seed``, draws its site as it
    would alone (the refusal is for the tracing thread's sites only)."""
    entered, traced, drawn, finished = (threading.Event() for _ in range(4))
    got = {}

    def model():
        entered.set()
        traced.wait(30)
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
        drawn.set()
        finished.wait(30)  # its seed exits after the trace: NumPyro's stack is last in, first out
        return z

    def other():
        try:
            got["z"] = handlers.seed(model, jax.random.key(0))()
        except Exception as e:  # (what the test reports)
            got["error"] = e
            drawn.set()

    def f(_, x):
        traced.set()
        drawn.wait(30)  # the other thread draws while this trace runs
        return x * 2

    thread = threading.Thread(target=other)
    thread.start()
    entered.wait(30)
    h = sm.hybridize(f, {})
    close(h(jnp.ones(3)), 2 * jnp.ones(3))
    finished.set()
    thread.join(30)
    assert "error" not in got, got.get("error")
    alone = handlers.seed(lambda: numpyro.sample("z", dist.Normal(0.0, 1.0)), jax.random.key(0))
    _same(got["z"], alone())
