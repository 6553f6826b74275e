"""Self-test vectors of an honest model whose outputs hold NaN (issue 32, item 9).

``jnp.log`` and ``jnp.sqrt`` of the standard-normal vectors give NaN at export and the same
NaN at load: the model reproduces its self-test and loads. A NaN where a number was, or a
number where a NaN was, is still a changed model.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import symjax_mlp as sm
from symjax_mlp._selftest import difference


@pytest.mark.parametrize("fn", [jnp.log, jnp.sqrt, lambda x: jnp.log(x) - jnp.log(-x)])
def test_an_honest_model_with_nan_outputs_loads_and_answers_as_exported(tmp_path, fn):
    h = sm.hybridize(lambda p, x: fn(x) * p, jnp.float32(2.0))
    x = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4)
    art = sm.export(h, tmp_path / "m", example=x)
    assert "selftest.safetensors" in art.manifest["files"]
    m = sm.load(art.path)  # was: "no longer reproduces its self-test ... by up to nan"
    got, want = np.asarray(m(x)), np.asarray(h(x))
    assert np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=1e-6, equal_nan=True)


def test_difference_equals_nan_with_nan_and_inf_with_inf_only():
    a = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)
    assert difference(a, a.copy()) is None
    assert difference(a + np.float32(1e-7), a) is None  # within the tolerance
    says = difference(np.array([0.5, np.inf, -np.inf, 1.0], np.float32), a)
    assert says and "(0,)" in says and "nan" in says  # a number where a NaN was
    says = difference(np.array([np.nan, np.inf, -np.inf, np.nan], np.float32), a)
    assert says and "(3,)" in says  # a NaN where a number was
    assert "up to" in difference(np.array([np.nan, -np.inf, -np.inf, 1.0], np.float32), a)
    assert "up to 1" in difference(np.array([np.nan, np.inf, -np.inf, 2.0], np.float32), a)
    assert "shape" in difference(np.zeros(3, np.float32), a)
