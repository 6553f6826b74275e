"""Shared test fixtures and helpers (imported by tests; never a test module itself).

``chapter`` is the chapter's MLP, hybridized, with its batch-1 input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import symjax_mlp as sm

N_DEVICES = 8  # conftest.py starts JAX with this many virtual CPU devices


@pytest.fixture
def chapter():
    """(net, variables, h, x): mlp((256, 128, 2)) on a (1, 512) float32 input."""
    net = sm.mlp((256, 128, 2))
    x = jax.random.normal(jax.random.key(0), (1, 512), jnp.float32)
    variables = net.init(jax.random.key(1), x)
    return net, variables, sm.hybridize(net, variables), x
