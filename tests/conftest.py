"""Test setup, done once: 8 virtual CPU devices, so sharding runs in process.

``jax_num_cpu_devices`` must be set before JAX starts its CPU backend, which is why it is set
here, at import, before any test touches a device. Fixtures live in ``helpers.py``.
"""

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

from helpers import chapter  # noqa: E402, F401  (a fixture, shared by every test module)
