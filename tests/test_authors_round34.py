"""Code we did not write, round thirty-four (jaxopt's examples are tests/zoo28.py's; sources
and commits there): what round twenty-eight left open.

- jaxopt's DEFAULT implicit differentiation of ``LBFGS(...).run`` (``solve_normal_cg``, which
  builds its ``rmatvec`` with ``jax.linear_transpose`` of the VJP of the loss's gradient) over
  a loaded ``m.apply``: JAX raised its NotImplementedError (no transpose rule for
  ``custom_vjp_call``). A loaded model's VJP module of order k is linear in its cotangents, and
  its transpose is what the VJP module of order k + 1 gives for them: exported with
  ``vjp_order=3`` the default solve now runs and equals ``net.apply``'s derivative; with
  ``vjp_order=2`` a ConfigError names both ways out (``vjp_order=3``, or
  ``implicit_diff_solve=solve_cg``, the Hessian being symmetric).
- At ``vjp_order=1`` our refusal (a ConfigError, which is a TypeError) is raised as jaxopt
  traces its ``matvec`` inside ``try: ... except TypeError`` and re-raised as "``init`` of
  solve_normal_cg is compulsory when ``matvec`` is nonsquare": ours shows chained above it.
- OTT-JAX's ICNN (tests/zoo34.py: the neural dual's default potentials), a potential whose
  gradient is the transport map: over every feature at a static batch, and ``jax.grad`` of
  the loaded potential equals ott's ``potential_gradient_fn``. A symbolic batch is refused
  by our SignatureError: its ``__call__`` ends in ``z.squeeze()`` (no axis), which JAX's
  shape polymorphism does not support (theirs).
- scenic's DETR (tests/zoo22.py) called with ``capture_intermediates=True``: ``h.apply``'s
  sown intermediates are Flax's; exported (flattened: export refuses a dict, saying so) and
  loaded, the same. scenic's ``hungarian_matcher`` (scipy in ``jax.pure_callback`` under a
  custom_vjp) in a DETR-style matching loss: hybridized, its value and grads are Flax's;
  export refuses it with our ConfigError naming pure_callback (an artifact holds no Python).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo34
from features import close, every_feature
from test_authors_round22 import detr  # noqa: F401 - round twenty-two's fixture
from test_authors_round28 import jaxopt_net  # noqa: F401 - round twenty-eight's fixture
from zoo28 import jaxopt

import symjax_mlp as sm

pytestmark = pytest.mark.slow  # each exports a model with VJP modules and runs a solver


def _loaded(tmp_path, vjp_order, case):
    net, variables, x, _ = case
    h = sm.hybridize(net.apply, variables)
    sm.export(h, tmp_path / f"m{vjp_order}", example=(x,), batch="b", vjp_order=vjp_order)
    return sm.load(tmp_path / f"m{vjp_order}"), h.params


def _fitted(l2reg, apply, params, data, **options):
    """``jaxopt.LBFGS(fun=objective).run`` as docs/unconstrained.rst writes it, to convergence,
    over ``apply``: the solution's squared norm (its derivative: implicit)."""

    def objective(p, l2reg, X, y):  # the page's names
        penalty = sum(jnp.sum(w**2) for w in jax.tree.leaves(p))
        return jnp.mean((apply(p, X)[:, 0] - y) ** 2) + 0.5 * l2reg * penalty

    solver = jaxopt.LBFGS(fun=objective, maxiter=300, tol=1e-5, **options)
    fit = solver.run(params, l2reg=l2reg, X=data[0], y=data[1]).params
    return sum(jnp.sum(w**2) for w in jax.tree.leaves(fit))


def test_linear_transpose_of_a_loaded_models_vjp_is_its_jvp(tmp_path, jaxopt_net):  # noqa: F811 - the fixture imported
    """``jax.linear_transpose`` of ``c -> vjp(m, x)(c)`` (linear in ``c``): ``net``'s JVP."""
    (m, _), (net, variables, xs, _) = _loaded(tmp_path, 2, jaxopt_net), jaxopt_net
    x, w = xs[:3], jax.random.normal(jax.random.key(340), xs[:3].shape)
    pull = lambda f: lambda c: jax.vjp(f, x)[1](c)[0]  # noqa: E731 - the input's cotangent
    got = jax.linear_transpose(pull(m), jnp.zeros((3, 4)))(w)[0]
    want = jax.jvp(lambda x: net.apply(variables, x), (x,), (w,))[1]
    close(got, want)
    assert jnp.abs(want).max() > 0.1


def test_jaxopt_default_implicit_diff_over_a_loaded_model(tmp_path, jaxopt_net):  # noqa: F811 - the fixture imported
    """Round 28's open case: ``jax.grad`` through ``LBFGS(...).run`` with jaxopt's default
    ``implicit_diff_solve`` over ``m.apply`` (``vjp_order=3``) equals it over ``net.apply``."""
    (m, params), (net, variables, *data) = _loaded(tmp_path, 3, jaxopt_net), jaxopt_net
    want = jax.grad(_fitted)(0.3, net.apply, variables, data)
    got = jax.grad(_fitted)(0.3, m.apply, params, data)
    assert abs(float(want)) > 0.1
    close(got, want, rtol=1e-3, atol=1e-4)


def test_jaxopt_default_implicit_diff_one_order_short_names_the_ways_out(tmp_path, jaxopt_net):  # noqa: F811 - the fixture imported
    """At ``vjp_order=2`` the transpose needs the module of order 3: our ConfigError naming
    ``vjp_order=3`` and ``solve_cg``, not JAX's NotImplementedError; ``solve_cg`` then runs."""
    (m, params), (net, variables, *data) = _loaded(tmp_path, 2, jaxopt_net), jaxopt_net
    with pytest.raises(sm.ConfigError, match=r"vjp_order=3.*implicit_diff_solve=jaxopt"):
        jax.grad(_fitted)(0.3, m.apply, params, data)
    solve_cg = jaxopt.linear_solve.solve_cg
    got = jax.grad(_fitted)(0.3, m.apply, params, data, implicit_diff_solve=solve_cg)
    close(got, jax.grad(_fitted)(0.3, net.apply, variables, data), rtol=1e-3, atol=1e-4)


def test_otts_icnn_potential_and_its_transport_map_loaded(tmp_path):
    """The neural dual's default ``neural_f`` (an ICNN) over every feature (a static batch:
    it squeezes), and the loaded potential's gradient equal to ott's transport map."""
    neural_f, _ = zoo34.default_potentials(2)
    x = jax.random.normal(jax.random.key(344), (8, 2))
    params = neural_f.init(jax.random.key(345), x)["params"]  # at init, the identity map
    noise = lambda w: 0.3 * jax.random.normal(jax.random.key(346), w.shape)  # noqa: E731
    params = jax.tree.map(lambda w: jnp.abs(w + noise(w)), params)  # a trained-like potential

    def potential(p, x):
        return neural_f.apply({"params": p}, x)

    h = sm.hybridize(potential, params)
    m = every_feature(tmp_path, h, lambda x: potential(params, x), x, batch=None)
    transport = neural_f.potential_gradient_fn(params)
    close(jax.grad(lambda x: m(x).sum())(x), transport(x))
    assert jnp.abs(transport(x) - x).max() > 1e-3  # not the identity map
    with pytest.raises(sm.SignatureError, match="squeeze"):
        sm.export(h, tmp_path / "b", example=(x,), batch="b")


def test_scenic_detr_intermediates_and_hungarian_matching_loss(tmp_path, detr):  # noqa: F811 - the fixture imported
    """DETR's sown intermediates through ``h.apply``, exported and loaded; a matching loss
    of scenic's ``hungarian_matcher`` hybridized (value, grads) and refused by export."""
    DETR, variables, IMAGES, DETR_OPS = detr
    h = sm.hybridize(DETR, variables)
    kw = {"capture_intermediates": True, "mutable": ["intermediates"]}
    theirs = DETR.apply(variables, IMAGES, False, **kw)
    close(h.apply(variables, IMAGES, False, **kw), theirs, rtol=1e-4, atol=1e-4)
    sown = lambda v, x: tuple(jax.tree.leaves(DETR.apply(v, x, False, **kw)[1]))  # noqa: E731
    flat = sm.hybridize(sown, variables)
    sm.export(flat, tmp_path / "sown", example=(IMAGES,), batch="b")
    m = sm.load(tmp_path / "sown", allow=DETR_OPS)
    close(m(np.asarray(IMAGES)), tuple(jax.tree.leaves(theirs[1])), rtol=1e-4, atol=1e-4)

    targets = jax.random.uniform(jax.random.key(347), (3, 4, 4))  # boxes to match

    def matching_loss(v, x):  # DETR's: L1 box cost, matched, then the matched pairs' loss
        boxes = DETR.apply(v, x, False)["pred_boxes"]
        cost = jnp.abs(boxes[:, :, None] - targets[:, None]).sum(-1)
        match = zoo34.hungarian_matcher(cost)  # [batch, 2, 4]: rows, columns
        matched = jnp.take_along_axis(boxes, match[:, 0, :, None], axis=1)
        return jnp.abs(matched - jnp.take_along_axis(targets, match[:, 1, :, None], 1)).sum()

    hm = sm.hybridize(matching_loss, variables)
    close(jax.value_and_grad(lambda v: hm.apply(v, IMAGES))(variables),
          jax.value_and_grad(matching_loss)(variables, IMAGES), rtol=1e-4, atol=1e-4)  # fmt: skip
    with pytest.raises(sm.ConfigError, match="pure_callback"):
        sm.export(hm, tmp_path / "match", example=(IMAGES,), batch=None)  # targets: 3 rows
