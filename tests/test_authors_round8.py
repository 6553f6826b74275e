"""Code we did not write, round eight: JAX's own notebooks and Flax's linen guides as their
authors wrote them (tests/zoo8.py; sources and commits there), over every feature: hybridize,
``h(x)`` equal to the plain model, its graph, export (a symbolic batch where the model allows
one) + load + call equal, ``jax.grad``/``vmap``/``jacrev(jacrev)`` over the loaded model (an
artifact of ``vjp_order=2``), a Batcher's answers, and the original's own training steps.

- Custom_derivative_rules_for_Python_code.md: ``log1pexp`` (``custom_jvp``), ``f`` by
  ``defjvps``, ``clip_gradient`` (``custom_vjp``) and the implicit ``fixed_point``'s
  ``newton_sqrt`` (``custom_vjp`` over a ``while_loop``: its artifact loads with
  ``allow={'while'}``, the refusal naming it), each the activation of a one-layer net.
- vmapped_log_probs.md: the per-example ``batched_log_joint`` (a symbolic batch of betas), its
  ``elbo`` (a mean over the samples: the Batcher refuses it naming a per-row model) and the
  notebook's own variational steps over ``h.apply``.
- autodiff_cookbook.md: ``predict_dict`` and ``loss2``: per-example grads, Jacobians, the
  reverse-over-reverse ``hvp`` over the loaded model.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo8

import symjax_mlp as sm

TOL = {"rtol": 2e-5, "atol": 2e-5}


def _close(a, b, **tol):
    chex.assert_trees_all_close(a, b, **(tol or TOL))


def _every_feature(tmp_path, h, ref, x, *, allow=None, batch="b", **ref_tol):
    """``h`` (a Hybrid of ``ref``, a function of the inputs ``x``) over every feature; returns
    the loaded model (its artifact of ``vjp_order=2``, ``batch`` symbolic)."""
    tol = ref_tol or TOL
    _close(h(x), ref(x), **tol)
    graph = h.graph(x)
    assert graph.flops > 0 and graph.primitive_counts
    sm.export(h, tmp_path / "m", example=(x,), batch=batch, vjp_order=2)
    m = sm.load(tmp_path / "m", allow=allow)
    rows = x[:3] if batch else x
    _close(m(np.asarray(rows)), ref(rows), **tol)
    one = lambda f: lambda r: f(r[None]).sum()  # noqa: E731 - one row's scalar
    _close(jax.grad(lambda r: m(r).sum())(rows), jax.grad(lambda r: ref(r).sum())(rows), **tol)
    _close(jax.vmap(jax.grad(one(m)))(x), jax.vmap(jax.grad(one(ref)))(x), **tol)
    _close(jax.jacrev(jax.jacrev(one(m)))(x[0]), jax.jacrev(jax.jacrev(one(ref)))(x[0]), **tol)
    if batch:
        with sm.serving.Batcher(m, max_batch=4) as b:
            got = [b.submit(np.asarray(x[i : i + 1])).result(30) for i in range(2)]
        _close(np.concatenate(got), ref(x[:2]), **tol)
    return m


def _dense():
    return {"w": jax.random.normal(jax.random.key(0), (4, 3)) * 0.5, "b": jnp.full((3,), 0.1)}


ACTIVATIONS = {
    "log1pexp": zoo8.log1pexp,
    "defjvps_f": lambda z: zoo8.sqrt_ratio(jnp.abs(z)),  # the notebook's f is on R+
    "clip_sin": zoo8.clip_sin,
    "newton_sqrt": lambda z: jax.vmap(jax.vmap(zoo8.newton_sqrt))(jnp.abs(z) + 1.0),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_custom_derivative_rules_hybridize_export_and_differentiate_as_written(name, tmp_path):
    """Each of the notebook's custom rules as a net's activation: the Hybrid, the loaded model
    (batch symbolic, vjp_order=2) and its grads, per-row grads and Hessians (jacrev of jacrev:
    ``jax.hessian`` is forward over reverse, which a ``custom_vjp`` refuses in JAX itself, the
    notebook's own limitation) equal the plain function's: the custom rules ran, not autodiff's
    (clip_sin's clipped, the implicit fixed point's)."""
    fn, p = zoo8.custom_dense(ACTIVATIONS[name]), _dense()
    x = jax.random.normal(jax.random.key(1), (5, 4)) + 1.0
    h = sm.hybridize(fn, p)
    allow = {"while"} if name == "newton_sqrt" else None
    if allow:
        sm.export(h, tmp_path / "refused", example=(x,))
        with pytest.raises(sm.ArtifactError, match=r"allow=\{'while'\}"):
            sm.load(tmp_path / "refused")
    _every_feature(tmp_path, h, lambda r: fn(p, r), x, allow=allow)
    if name == "clip_sin":  # the custom VJP is what grad runs: its cotangents clipped
        big = jnp.full((1, 4), 3.0)
        g = jax.grad(lambda r: (100.0 * sm.load(tmp_path / "m")(r)).sum())(big)
        _close(g, jax.grad(lambda r: (100.0 * fn(p, r)).sum())(big))
        assert np.abs(g).max() <= 0.75 * np.abs(p["w"]).sum(1).max() + 1e-6


@pytest.mark.slow
def test_vmapped_log_probs_per_example_and_its_elbo_steps(tmp_path):
    """vmapped_log_probs: ``batched_log_joint`` (``jax.vmap`` of the jitted ``log_joint``) is a
    model of betas, one log-prob per row: every feature, batch symbolic. Its ``elbo`` over
    ``h.apply`` takes the notebook's own steps (``value_and_grad`` of ``elbo``, the step size
    0.01, ``normal_sample``'s keys), equal; its artifact (a mean over samples) answers any
    number of samples, and a Batcher refuses it naming a per-row model."""
    beta = jnp.asarray(np.random.RandomState(0).randn(6, zoo8.num_features), jnp.float32)
    h = sm.hybridize(lambda p, b: zoo8.batched_log_joint(b), {})
    _every_feature(tmp_path / "lj", h, zoo8.batched_log_joint, beta, rtol=1e-4, atol=1e-3)
    p = {"loc": jnp.zeros(zoo8.num_features), "log_scale": jnp.zeros(zoo8.num_features)}
    he = sm.hybridize(lambda p, eps: zoo8.elbo(p["loc"], p["log_scale"], eps), p)
    key, beta_loc, beta_log_scale, step_size = jax.random.key(10003), p["loc"], p["log_scale"], 0.01
    for _ in range(3):
        key, epsilon = zoo8.normal_sample(key, (8, zoo8.num_features))
        elbo_val, (beta_loc_grad, beta_log_scale_grad) = zoo8.elbo_val_and_grad(
            beta_loc, beta_log_scale, epsilon
        )
        beta_loc += step_size * beta_loc_grad
        beta_log_scale += step_size * beta_log_scale_grad
        val, g = jax.value_and_grad(he.apply)(p, epsilon)
        p = jax.tree.map(lambda a, d: a + step_size * d, p, g)
        _close(val, elbo_val, rtol=1e-5, atol=1e-3)
    _close(p, {"loc": beta_loc, "log_scale": beta_log_scale})
    he = he.replace(params=p)
    sm.export(he, tmp_path / "elbo", example=(epsilon,), batch="b")
    m = sm.load(tmp_path / "elbo")
    _close(
        m(np.asarray(epsilon[:5])),
        zoo8.elbo(beta_loc, beta_log_scale, epsilon[:5]),
        rtol=1e-5,
        atol=1e-3,
    )
    with pytest.raises(sm.ConfigError, match="one output row per input row"):
        sm.serving.Batcher(m, max_batch=4)


@pytest.mark.slow
def test_the_autodiff_cookbooks_predict_and_hvp_over_the_loaded_model(tmp_path):
    """autodiff_cookbook: ``predict_dict`` on its toy inputs, every feature (batch symbolic);
    its reverse-over-reverse ``hvp`` of a loaded model's summed output equals the plain one's;
    ``jax.grad(loss2)`` through ``h.apply`` equals the cookbook's."""
    params = zoo8.cookbook_params()
    h = sm.hybridize(zoo8.predict_dict, params)
    ref = lambda r: zoo8.predict_dict(params, r)  # noqa: E731
    m = _every_feature(tmp_path, h, ref, zoo8.inputs)
    v = jnp.ones(3)
    _close(zoo8.hvp(lambda r: m(r[None]).sum(), zoo8.inputs[0], v),
           zoo8.hvp(lambda r: ref(r[None]).sum(), zoo8.inputs[0], v))  # fmt: skip
    _close(jax.jacrev(lambda r: m(r))(zoo8.inputs), jax.jacrev(ref)(zoo8.inputs))

    def loss2(params_dict):  # the cookbook's loss2, over h.apply
        preds = h.apply(params_dict, zoo8.inputs)
        label_probs = preds * zoo8.targets + (1 - preds) * (1 - zoo8.targets)
        return -jnp.sum(jnp.log(label_probs))

    _close(jax.grad(loss2)(params), jax.grad(zoo8.loss2)(params))
