"""Code we did not write, round twenty-three (b): JAX MD's own example, as its authors wrote it
(sizes are the tests'), for tests/test_authors_round23b.py. JAX MD runs here for the first
time (jax-md 0.2.29 from the package index).

jax-md/jax-md at a41c7d19f6468f4e5263c32c12c9ed6cba26ebff:

- FEATURES.md, "Energy functions" example: random positions in a periodic box,
  ``space.periodic``, ``energy.soft_sphere_pair`` and its ``quantity.force``, as written,
  in ``features_example(N, spatial_dimension, box_size)`` (a script there: its constants
  ``N = 1000``, ``spatial_dimension = 2``, ``box_size = 32.0`` made the function's
  arguments, its two prints cut; it returns what they printed from).
"""

import jax.numpy as np  # noqa: F401 - its prints' np.sum, cut
from jax import random
from jax_md import energy, quantity, space


def features_example(N=1000, spatial_dimension=2, box_size=32.0):
    key = random.PRNGKey(0)
    R = box_size * random.uniform(key, (N, spatial_dimension))
    displacement_fn, shift_fn = space.periodic(box_size)  # noqa: RUF059 - as written
    energy_fn = energy.soft_sphere_pair(displacement_fn)
    force_fn = quantity.force(energy_fn)
    return R, displacement_fn, energy_fn, force_fn
