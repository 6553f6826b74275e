"""The check the authors' rounds (test_authors_round8.py and later) run on each model: a
Hybrid against the authors' own function, then every feature of the library over it."""

from __future__ import annotations

import chex
import jax
import numpy as np

import symjax_mlp as sm

TOL = {"rtol": 2e-5, "atol": 2e-5}


def close(a, b, **tol):
    chex.assert_trees_all_close(a, b, **(tol or TOL))


def every_feature(tmp_path, h, ref, x, *, allow=None, batch="b", **ref_tol):
    """``h`` (a Hybrid of ``ref``, a function of the inputs ``x``) over every feature; returns
    the loaded model (its artifact of ``vjp_order=2``, ``batch`` symbolic)."""
    tol = ref_tol or TOL
    close(h(x), ref(x), **tol)
    graph = h.graph(x)
    assert graph.flops > 0 and graph.primitive_counts
    sm.export(h, tmp_path / "m", example=(x,), batch=batch, vjp_order=2)
    m = sm.load(tmp_path / "m", allow=allow)
    rows = x[:3] if batch else x
    close(m(np.asarray(rows)), ref(rows), **tol)
    one = lambda f: lambda r: f(r[None]).sum()  # noqa: E731 - one row's scalar
    close(jax.grad(lambda r: m(r).sum())(rows), jax.grad(lambda r: ref(r).sum())(rows), **tol)
    if batch:  # per-row grads and Hessians, one row a call
        close(jax.vmap(jax.grad(one(m)))(x), jax.vmap(jax.grad(one(ref)))(x), **tol)
        hess = lambda f: jax.jacrev(jax.jacrev(one(f)))(x[0])  # noqa: E731
    else:  # a static batch: the whole batch's Hessian
        hess = lambda f: jax.jacrev(jax.jacrev(lambda r: f(r).sum()))(x)  # noqa: E731
    close(hess(m), hess(ref), **tol)
    if batch:
        with sm.serving.Batcher(m, max_batch=4) as b:
            got = [b.submit(np.asarray(x[i : i + 1])).result(30) for i in range(2)]
        close(np.concatenate(got), ref(x[:2]), **tol)
    else:  # a static batch: served one request of its rows at a time
        with sm.serving.Batcher(m) as b:
            close(b.submit(np.asarray(x)).result(30), ref(x), **tol)
    return m
