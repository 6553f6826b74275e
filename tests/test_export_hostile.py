"""Export as a stranger uses it: odd paths, odd param names, odd dtypes. Whatever exports loads
and gives the source model's answers; whatever cannot is refused at export, by name."""

import jax.numpy as jnp
import numpy as np
import pytest

import symjax_mlp as sm
from symjax_mlp._npy import write_outputs


@pytest.mark.parametrize("key", ["a\nb", "tab\there", "nul\x00", "rtl\u202e", "__metadata__"])
def test_a_param_key_load_could_not_read_is_refused_at_export(tmp_path, key):
    h = sm.hybridize(lambda p, x: x @ p[key], {key: jnp.ones((3, 2))})
    with pytest.raises(sm.ConfigError, match=r"export\(<lambda>\): a param has the path"):
        sm.export(h, tmp_path / "a", example=jnp.ones((2, 3)))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("dtype_in", "dtype_out"),
    [("float8_e4m3fn", "float32"), ("float32", "float8_e5m2"), ("float32", "float4_e2m1fn"),
     ("uint4", "float32")],
)  # fmt: skip
def test_float8_and_int4_inputs_or_outputs_export_and_load(tmp_path, dtype_in, dtype_out):
    h = sm.hybridize(lambda p, x: x.astype(dtype_out) * p["s"].astype(dtype_out), {"s": 1.0})
    x = jnp.ones((2, 3), dtype_in)
    sm.export(h, tmp_path / "a", example=x)  # no self-test vectors: their file cannot hold them
    y = sm.load(tmp_path / "a")(x)
    assert y.dtype == dtype_out
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(h(x), np.float32))


def test_a_name_of_250_bytes_exports_and_writes_outputs(tmp_path):
    """A file name may have 255 bytes; the temporary sibling's suffix must not push it over."""
    h = sm.hybridize(lambda p, x: x * p["s"], {"s": 2.0})
    x = jnp.ones((2, 3))
    art = sm.export(h, tmp_path / ("a" * 250), example=x)
    np.testing.assert_array_equal(sm.load(art.path)(x), h(x))
    sm.export(h, art.path, example=x, overwrite=True)  # the old one swapped out beside it
    write_outputs(h(x), tmp_path / ("y" * 246 + ".npy"))
    assert np.load(tmp_path / ("y" * 246 + ".npy")).shape == (2, 3)
    assert sorted(p.name[0] for p in tmp_path.iterdir()) == ["a", "y"]  # no litter


@pytest.mark.parametrize("path", [b"my_mlp", "a\x00b", 3, None])
def test_a_path_that_is_no_str_or_has_a_nul_is_a_config_error(path):
    h = sm.hybridize(lambda p, x: x * p["s"], {"s": 2.0})
    with pytest.raises(sm.ConfigError, match=r"symjax_mlp\.export\(\.\.\., path=.*a str or a"):
        sm.export(h, path, example=jnp.ones((2, 3)))
