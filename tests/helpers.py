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


def small(seed=0, sizes=(16, 3), features=8):
    """(h, x): a small MLP, hybridized, and a (2, features) float32 input."""
    net = sm.mlp(sizes)
    x = jax.random.normal(jax.random.key(100 + seed), (2, features), jnp.float32)
    return sm.hybridize(net, net.init(jax.random.key(seed), x)), x


def rand(batch, features=8, seed=0):
    """A (batch, features) float32 normal input."""
    return jax.random.normal(jax.random.key(seed), (batch, features), jnp.float32)
