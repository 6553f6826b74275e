"""Code we did not write, round thirty-four: OTT-JAX's input convex neural network as its
neural dual builds it, for tests/test_authors_round34.py (ott-jax 0.6.0 from the package
index, which is ott-jax/ott at 6aace50f673b877cc3394d0b53a24da0bbf11308 but for plot.py, as
tests/zoo24.py records).

- src/ott/neural/methods/neuraldual.py, ``W2NeuralDual.__init__``: its default potentials,
  the two lines ``neural_f = icnn.ICNN(dim_data=dim_data, dim_hidden=[64, 64, 64, 64])`` and
  ``neural_g = ...`` as written, in ``default_potentials`` (ours: a function holding them, so
  the tests build the networks without training the dual); ``icnn.ICNN`` itself (its
  ``__call__`` ends in ``z.squeeze()``) and ``BasePotential.potential_gradient_fn`` (the
  transport map, ``jax.vmap(jax.grad(...))``) are ott's, imported.

Ours: the import under a filter of the DeprecationWarning importing jaxopt (an ott dependency)
raises.
"""

import warnings

with warnings.catch_warnings():  # jaxopt, which ott imports, warns it is unmaintained
    warnings.filterwarnings("ignore", "JAXopt is no longer maintained", DeprecationWarning)
    from ott.neural.networks import icnn


def default_potentials(dim_data):
    neural_f = icnn.ICNN(dim_data=dim_data, dim_hidden=[64, 64, 64, 64])
    neural_g = icnn.ICNN(dim_data=dim_data, dim_hidden=[64, 64, 64, 64])
    return neural_f, neural_g
