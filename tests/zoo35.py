"""Code we did not write, round thirty-five: what rounds thirty-three and thirty-four left
unrun, for tests/test_authors_round35.py. The authors' code runs from the packages the index
ships; the one piece written out here is from a package's own text.

- dynamax 1.0.3 (the package index; its README is the package's long description, its
  METADATA, the same text as probml/dynamax's README.md), "Example usage": the two lines after
  the sample, ``hmm.initialize(key3, method="kmeans", emissions=emissions)`` and
  ``hmm.fit_em(params, props, emissions, num_iters=20)``, as written, in ``readme_fit`` (ours:
  a function of what the README's lines before them make, tests/zoo33b.py's ``readme``).
  ``fit_em`` itself (its jitted ``lax.scan`` of ``em_step``: ``vmap`` of ``self.e_step`` over
  the sequences, ``log_prior``, ``m_step``) is dynamax's, src/dynamax/ssm.py, imported.
- transformers 4.57.6 (the package index), imported, not copied: ``generate``'s greedy search
  (src/transformers/generation/flax_utils.py, ``_greedy_search``: its ``lax.while_loop``
  calling ``self.decode`` with ``past_key_values``) and FlaxT5ForConditionalGeneration's
  ``init_cache``, ``prepare_inputs_for_generation`` and ``update_inputs_for_generation``
  (src/transformers/models/t5/modeling_flax_t5.py).
- ott-jax 0.6.0 (the package index: ott-jax/ott at 6aace50f673b877cc3394d0b53a24da0bbf11308
  but for plot.py, as tests/zoo24.py records), imported, not copied:
  src/ott/neural/methods/neuraldual.py, ``W2NeuralDual`` (its default ICNN potentials,
  tests/zoo34.py's ``default_potentials``, its default optimizers and conjugate solver) and
  its own training loop, ``train_neuraldual_parallel`` over ``get_step_fn``; the data from
  src/ott/datasets.py, ``create_gaussian_mixture_samplers``.

Ours: ``T5Jnp``, the ``jax.numpy`` transformers' T5 module is given under JAX 0.10.
"""

# ruff: noqa: RUF059 (the README's code, as written)

import jax.numpy as jnp
import jax.random as jr


def readme_fit(hmm, emissions):  # ours: the README's lines after its sample, in its order
    key1, key2, key3 = jr.split(jr.PRNGKey(0), 3)

    # Make a new Gaussian HMM and fit it with EM
    params, props = hmm.initialize(key3, method="kmeans", emissions=emissions)
    params, lls = hmm.fit_em(params, props, emissions, num_iters=20)
    return params, lls  # ours


class T5Jnp:
    """``jax.numpy`` for transformers' T5 module, whose ``jnp.clip(x, a_max=...)`` (4.57.6,
    modeling_flax_t5.py's relative position buckets) JAX 0.10 no longer takes (``TypeError:
    clip() got an unexpected keyword argument 'a_max'``): theirs, not ours. The same number
    as ``min``/``max``; everything else is ``jax.numpy``'s."""

    def __getattr__(self, name):
        return getattr(jnp, name)

    @staticmethod
    def clip(x, a_min=None, a_max=None):
        return jnp.clip(x, min=a_min, max=a_max)
