"""Code we did not write, round twenty-one (continued): Optimistix's example of fitting an ODE's
parameters, as its authors wrote it, for tests/test_authors_round21.py.

patrick-kidger/optimistix at 6415ab15480ebdb7386e17850105ce0dba6786ec:

- docs/examples/optimise_diffeq.ipynb: ``vector_field`` (Lotka-Volterra), ``solve`` (diffrax's
  ``Tsit5`` with ``DirectAdjoint``, for the forward-mode autodiff Levenberg-Marquardt uses),
  ``get_data`` and ``residuals`` as written. Its module-level fit (``optx.least_squares`` of
  ``residuals`` by ``LevenbergMarquardt(rtol=1e-8, atol=1e-8, verbose=True)`` from zeros) is
  written in the test, as a function of the data; its plot is left out.
"""

# ruff: noqa: F722, F821 - jaxtyping's shape strings, as the authors wrote them
import diffrax as dfx  # https://github.com/patrick-kidger/diffrax
import equinox as eqx  # https://github.com/patrick-kidger/equinox
import jax.numpy as jnp
from jaxtyping import Array, Float  # https://github.com/google/jaxtyping


def vector_field(t, y: Float[Array, "2"], parameters: Float[Array, "4"]) -> Float[Array, "2"]:
    prey, predator = y
    α, β, γ, δ = parameters
    d_prey = α * prey - β * prey * predator
    d_predator = -γ * predator + δ * prey * predator
    d_y = jnp.stack([d_prey, d_predator])
    return d_y


def solve(
    parameters: Float[Array, "4"], y0: Float[Array, "2"], saveat: dfx.SaveAt
) -> Float[Array, "ts"]:
    """Solve a single ODE."""
    term = dfx.ODETerm(vector_field)
    solver = dfx.Tsit5()
    t0 = saveat.subs.ts[0]
    t1 = saveat.subs.ts[-1]
    dt0 = 0.1
    sol = dfx.diffeqsolve(
        term,
        solver,
        t0,
        t1,
        dt0,
        y0,
        args=parameters,
        saveat=saveat,
        # support forward-mode autodiff, which is used by Levenberg--Marquardt
        adjoint=dfx.DirectAdjoint(),
    )
    return sol.ys


def get_data() -> tuple[Float[Array, "3 2"], Float[Array, "3 50"]]:
    """Simulate some training data."""
    # We consider three possible initial conditions.
    y0_a = jnp.array([9.0, 9.0])
    y0_b = jnp.array([10.0, 10.0])
    y0_c = jnp.array([11.0, 11.0])
    y0s = jnp.stack([y0_a, y0_b, y0_c])
    true_parameters = jnp.array([0.1, 0.02, 0.4, 0.02])
    saveat = dfx.SaveAt(ts=jnp.linspace(0, 30, 20))
    batch_solve = eqx.filter_jit(eqx.filter_vmap(solve, in_axes=(None, 0, None)))
    values = batch_solve(true_parameters, y0s, saveat)
    return y0s, values


def residuals(parameters, y0s__values):
    y0s, values = y0s__values
    saveat = dfx.SaveAt(ts=jnp.linspace(0, 30, 20))
    batch_solve = eqx.filter_vmap(solve, in_axes=(None, 0, None))
    pred_values = batch_solve(parameters, y0s, saveat)
    return values - pred_values
