"""Shared fixtures: the chapter's MLP, hybridized, and its batch-1 input."""

import jax
import jax.numpy as jnp
import pytest

import symjax_mlp as sm


@pytest.fixture
def chapter():
    """(net, variables, h, x): mlp((256, 128, 2)) on a (1, 512) float32 input."""
    net = sm.mlp((256, 128, 2))
    x = jax.random.normal(jax.random.key(0), (1, 512), jnp.float32)
    variables = net.init(jax.random.key(1), x)
    return net, variables, sm.hybridize(net, variables), x
