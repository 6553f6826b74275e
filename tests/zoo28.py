"""Code we did not write, round twenty-eight: jaxopt's own examples, as their authors wrote
them, for tests/test_authors_round28.py (jaxopt 0.8.5 from the package index; archived, no
longer maintained, still widely used).

google/jaxopt at 2de13bf01fd29e22862236a0d869f2b14e1629d4:

- examples/implicit_diff/ridge_reg_implicit_diff.py: ``ridge_objective``, ``ridge_solver``
  (``@implicit_diff.custom_root(jax.grad(ridge_objective))`` around conjugate gradient) and
  ``outer_objective`` as written; ``main`` (sklearn's diabetes data, absl's ``app``, the
  OptaxSolver loop) is left out: the tests' data are features of a hybridized or loaded model.
- docs/unconstrained.rst: ``ridge_reg_objective`` and ``lbfgs_fit`` (ours, a function
  holding the page's two lines ``solver = jaxopt.LBFGS(fun=ridge_reg_objective,
  maxiter=maxiter)`` and ``res = solver.run(init_params, l2reg=l2reg, X=X, y=y)``, its ``fun``
  a parameter so the tests can hand it a loss of ``h.apply``).

Ours: ``import jaxopt`` under a filter of the DeprecationWarning its import raises (no longer
maintained). The two spaces of indent are made four (``ruff format``), the code is as written.
"""

import warnings

import jax
import jax.numpy as jnp

with warnings.catch_warnings():  # jaxopt's import warns it is no longer maintained
    warnings.filterwarnings("ignore", "JAXopt is no longer maintained", DeprecationWarning)
    import jaxopt
    from jaxopt import implicit_diff, linear_solve

# --- jaxopt: examples/implicit_diff/ridge_reg_implicit_diff.py ------------------------------


def ridge_objective(params, l2reg, data):
    """Ridge objective function."""
    X_tr, y_tr = data
    residuals = jnp.dot(X_tr, params) - y_tr
    return 0.5 * jnp.mean(residuals**2) + 0.5 * l2reg * jnp.sum(params**2)


@implicit_diff.custom_root(jax.grad(ridge_objective))
def ridge_solver(init_params, l2reg, data):
    """Solve ridge regression by conjugate gradient."""
    X_tr, y_tr = data

    def matvec(u):
        return jnp.dot(X_tr.T, jnp.dot(X_tr, u))

    return linear_solve.solve_cg(
        matvec=matvec,
        b=jnp.dot(X_tr.T, y_tr),
        ridge=len(y_tr) * l2reg,
        init=init_params,
        maxiter=20,
    )


# Perhaps confusingly, theta is a parameter of the outer objective,
# but l2reg = jnp.exp(theta) is an hyper-parameter of the inner objective.
def outer_objective(theta, init_inner, data):
    """Validation loss."""
    X_tr, X_val, y_tr, y_val = data
    # We use the bijective mapping l2reg = jnp.exp(theta)
    # both to optimize in log-space and to ensure positivity.
    l2reg = jnp.exp(theta)
    w_fit = ridge_solver(init_inner, l2reg, (X_tr, y_tr))
    y_pred = jnp.dot(X_val, w_fit)
    loss_value = jnp.mean((y_pred - y_val) ** 2)
    # We return w_fit as auxiliary data.
    # Auxiliary data is stored in the optimizer state (see below).
    return loss_value, w_fit


# --- jaxopt: docs/unconstrained.rst ----------------------------------------------------------


def ridge_reg_objective(params, l2reg, X, y):
    residuals = jnp.dot(X, params) - y
    return jnp.mean(residuals**2) + 0.5 * l2reg * jnp.sum(params**2)


def lbfgs_fit(ridge_reg_objective, init_params, l2reg, X, y, maxiter):
    solver = jaxopt.LBFGS(fun=ridge_reg_objective, maxiter=maxiter)
    res = solver.run(init_params, l2reg=l2reg, X=X, y=y)
    return res
