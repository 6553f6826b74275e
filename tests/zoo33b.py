"""Code we did not write, round thirty-three (b): dynamax's README example, as its authors
wrote it, for tests/test_authors_round33.py (dynamax 1.0.3 from the package index; the README
is the package's long description, its METADATA, the same text as probml/dynamax's README.md).

"Example usage": the Gaussian HMM made and sampled, as written, inside ``readme`` (ours, one
line) that returns what the README makes. Cut: the EM fits (``hmm.initialize(key3,
method="kmeans", ...)`` and ``hmm.fit_em``, twice: over three minutes on the suite's two
cores), matplotlib's three plotting lines, the ``print`` lines, and the batch of 200
sequences (the tests sample their own few under the README's ``vmap``); the README's smoother
call is the tests' (``hmm.smoother(params, emissions)`` over the true parameters). Ours: the
import of dynamax under a filter of the deprecation warning its tfp-nightly substrate raises
under JAX 0.10 (as tests/zoo23.py's distrax).
"""

# ruff: noqa: RUF059 (the README's code, as written)

import warnings

import jax.numpy as jnp  # noqa: F401 - the README's import
import jax.random as jr

with warnings.catch_warnings():  # tfp-nightly's jax substrate, imported by dynamax, reads it
    warnings.filterwarnings("ignore", "jax.core.pytype_aval_mappings is deprecated")
    from dynamax.hidden_markov_model import GaussianHMM


def readme():  # ours: the README's lines, in its order
    key1, key2, key3 = jr.split(jr.PRNGKey(0), 3)
    num_states = 3
    emission_dim = 2
    num_timesteps = 1000

    # Make a Gaussian HMM and sample data from it
    hmm = GaussianHMM(num_states, emission_dim)
    true_params, _ = hmm.initialize(key1)
    true_states, emissions = hmm.sample(true_params, key2, num_timesteps)
    return hmm, true_params, true_states, emissions, key2  # ours
