"""Models: construction, shapes, names, and errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import symjax_mlp as sm


def test_mlp_is_the_chapters_net():
    net = sm.mlp((256, 128, 2))
    x = jnp.ones((1, 512))
    variables = net.init(jax.random.key(0), x)
    shapes = jax.tree.map(jnp.shape, variables["params"])
    assert shapes == {
        "layers_0": {"kernel": (512, 256), "bias": (256,)},
        "layers_1": {"kernel": (256, 128), "bias": (128,)},
        "layers_2": {"kernel": (128, 2), "bias": (2,)},
    }
    assert net.apply(variables, x).shape == (1, 2)
    assert [layer.activation for layer in net.layers] == ["relu", "relu", None]


def test_dense_applies_its_activation():
    layer = sm.Dense(3, activation="relu")
    x = jnp.array([[1.0, -2.0]])
    variables = layer.init(jax.random.key(0), x)
    p = variables["params"]
    expected = np.maximum(np.asarray(x) @ np.asarray(p["kernel"]) + np.asarray(p["bias"]), 0)
    np.testing.assert_allclose(layer.apply(variables, x), expected, rtol=1e-6)


def test_every_listed_activation_runs():
    x = jnp.linspace(-2, 2, 8).reshape(2, 4)
    for name in sm.ACTIVATIONS:
        net = sm.mlp((3, 2), activation=name)
        y = net.apply(net.init(jax.random.key(0), x), x)
        assert y.shape == (2, 2) and bool(jnp.all(jnp.isfinite(y))), name


def test_unknown_activation_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown activation 'rleu'") as info:
        sm.Dense(3, activation="rleu")
    assert "relu" in str(info.value) and "gelu" in str(info.value)
    with pytest.raises(ValueError, match="unknown activation"):
        sm.mlp((3, 2), activation="nope")
    with pytest.raises(ValueError, match="unknown activation 'nope'"):
        sm.mlp((2,), activation="nope")  # one layer uses no activation, a typo is still one


@pytest.mark.parametrize("sizes", [(), (3, 0), (3, -1), (2.5,), (True, 2)])
def test_bad_sizes_are_named(sizes):
    with pytest.raises(sm.ConfigError, match="positive ints"):
        sm.mlp(sizes)


def test_widths_are_checked_where_they_are_given():
    """Dense(0) failed at init with a ZeroDivisionError, mlp(4) with "'int' object is not
    iterable"; a NumPy int is a width like any other."""
    for bad in (0, -3, True, 2.0):
        with pytest.raises(sm.ConfigError, match=r"Dense\(features=.*positive int"):
            sm.Dense(bad)
    for bad in (4, None, "256,2"):
        with pytest.raises(sm.ConfigError, match=r"pass the layers' widths as a sequence"):
            sm.mlp(bad)
    net = sm.mlp((np.int64(4), 2))
    assert [type(d.features) for d in net.layers] == [int, int]


def test_empty_containers_are_errors():
    with pytest.raises(ValueError, match="at least one layer"):
        sm.HybridSequential(())
    with pytest.raises(ValueError, match="at least one branch"):
        sm.HybridConcurrent(())


@pytest.mark.parametrize("items", [(1, 2), "ab", 5, (sm.Dense(2), None)])
def test_containers_of_what_is_no_layer_are_refused_when_built(items):
    # they were built, then init failed deep in __call__: "'int' object is not callable"
    with pytest.raises(sm.ConfigError, match=r"HybridSequential\(layers=...\): expected a seq"):
        sm.HybridSequential(items)
    with pytest.raises(sm.ConfigError, match=r"HybridConcurrent\(branches=...\): expected"):
        sm.HybridConcurrent(items)
    x = jnp.ones((1, 3))  # a plain function is a layer, as in nn.Sequential
    net = sm.HybridSequential([sm.Dense(4), nn.relu, sm.Dense(2)])
    assert net.apply(net.init(jax.random.key(0), x), x).shape == (1, 2)


def test_concurrent_feeds_every_branch_and_concatenates():
    a, b = sm.Dense(3), sm.mlp((4, 5))
    cat = sm.HybridConcurrent((a, b))
    x = jax.random.normal(jax.random.key(1), (2, 6))
    variables = cat.init(jax.random.key(0), x)
    y = cat.apply(variables, x)
    ya = a.apply({"params": variables["params"]["branches_0"]}, x)
    yb = b.apply({"params": variables["params"]["branches_1"]}, x)
    np.testing.assert_allclose(y, jnp.concatenate([ya, yb], axis=-1), rtol=1e-6)


def test_concurrent_axis():
    cat = sm.HybridConcurrent((sm.Dense(3), sm.Dense(3)), axis=0)
    x = jnp.ones((2, 4))
    assert cat.apply(cat.init(jax.random.key(0), x), x).shape == (4, 3)


def test_a_bad_concurrent_axis_is_a_config_error():
    """axis=5 raised NumPy's "axis 5 is out of bounds", axis="x" a TypeError from inside."""
    x = jnp.ones((2, 4))
    with pytest.raises(sm.ConfigError, match=r"axis=5\): .*rank 2 .*\[-2, 1\]"):
        sm.HybridConcurrent((sm.Dense(3), sm.Dense(2)), axis=5).init(jax.random.key(0), x)
    for bad in ("x", 1.0, True):
        with pytest.raises(sm.ConfigError, match="axis is the int"):
            sm.HybridConcurrent((sm.Dense(3),), axis=bad)
    cat = sm.HybridConcurrent((sm.Dense(3), sm.Dense(2)), axis=-2 + 1)  # -1: in range
    assert cat.apply(cat.init(jax.random.key(0), x), x).shape == (2, 5)


def test_models_nest_and_are_linen_modules():
    net = sm.HybridSequential((sm.HybridConcurrent((sm.Dense(4), sm.Dense(4))), sm.Dense(1)))
    assert isinstance(net, nn.Module)
    x = jnp.ones((5, 3))
    assert net.apply(net.init(jax.random.key(0), x), x).shape == (5, 1)


def test_dtype_is_respected():
    net = sm.mlp((4, 2), dtype=jnp.bfloat16)
    x = jnp.ones((1, 3), jnp.bfloat16)
    assert net.apply(net.init(jax.random.key(0), x), x).dtype == jnp.bfloat16


def test_a_dtype_that_is_no_floating_type_is_refused_when_built():
    """mlp(dtype="float33") was built, then init raised NumPy's "data type not understood"
    (dtype=jnp.int32: flax's "Dtype must be inexact")."""
    for bad in ("float33", jnp.int32, object):
        with pytest.raises(sm.ConfigError, match=r"mlp\(dtype=.*\): .*floating type; pass e"):
            sm.mlp((4, 2), dtype=bad)
        with pytest.raises(sm.ConfigError, match=r"Dense\(dtype="):
            sm.Dense(4, dtype=bad)
    x = jnp.ones((1, 3))
    for good in ("bfloat16", np.float16, jnp.complex64):
        net = sm.mlp((4, 2), dtype=good)
        assert net.apply(net.init(jax.random.key(0), x), x).dtype == jnp.dtype(good)


def test_a_scalar_input_is_refused_naming_the_shape_a_dense_layer_takes():
    """h(1.0) raised flax's IndexError "tuple index out of range"."""
    net = sm.mlp((4, 2))
    h = sm.hybridize(net, net.init(jax.random.key(0), jnp.ones((2, 3))))
    for scalar in (1.0, jnp.float32(1), np.float32(1)):
        with pytest.raises(
            sm.SignatureError,
            match=r"Dense\(4\): the input is a scalar .*"
            r"shape \(batch, features\)",
        ):
            h(scalar)


def test_concurrent_branches_whose_shapes_differ_off_the_axis_are_refused_naming_them():
    """axis=0 over widths 2 and 3 raised JAX's TypeError, which named neither the model nor
    the axis."""
    cat, x = sm.HybridConcurrent((sm.Dense(2), sm.Dense(3)), axis=0), jnp.ones((2, 4))
    with pytest.raises(
        sm.ConfigError,
        match=r"axis=0\): .*\[\(2, 2\), \(2, 3\)\]; joined "
        r"along axis 0, they must agree .*e\.g\. axis=-1",
    ):
        cat.init(jax.random.key(0), x)


@pytest.mark.parametrize(
    ("call", "name", "bad"),
    [
        (sm.chapter.chapter_mlp, "in_features", 0),
        (sm.chapter.chapter_mlp, "in_features", 2.0),
        (sm.chapter.chapter_mlp, "batch", -1),
        (sm.chapter.chapter_mlp, "seed", "1"),
        (sm.chapter.chapter_mlp, "seed", None),
        (sm.chapter.tour, "calls", 1.5),
    ],
)
def test_the_chapters_counts_are_checked_naming_the_call(call, name, bad):
    """in_features=0 was a ZeroDivisionError, -1 an MLIRError, seed="1" a TypeError comparing
    str and int, tour(calls=1.5) range()'s TypeError."""
    with pytest.raises(sm.ConfigError, match=rf"{call.__name__}\({name}={bad!r}\): {name} must"):
        call(**{name: bad})


def test_the_chapter_takes_numpy_ints_and_a_static_numpy_batch(tmp_path):
    """export_mlp(batch=np.int64(2)) was refused as no name of a symbolic dimension."""
    h, x = sm.chapter.chapter_mlp((np.int64(4), 2), in_features=np.int64(3), seed=np.int64(1))
    assert x.shape == (1, 3) and h(x).shape == (1, 2)
    art = sm.chapter.export_mlp(tmp_path / "m", sizes=(4,), in_features=3, batch=np.int64(2))
    assert art.signature.inputs[0].shape == (2, 3)
    with pytest.raises(sm.ConfigError, match=r"unknown format \['x'\]; expected one of"):
        sm.chapter.describe_mlp((4,), in_features=3, format=["x"])


@pytest.mark.parametrize(
    ("make", "prefix"),
    [
        (lambda: sm.Dense(3, activation="rleu"), "symjax_mlp.Dense(activation='rleu'): "),
        (lambda: sm.Dense(0), "symjax_mlp.Dense(features=0): "),
        (lambda: sm.Dense(3, dtype="int8"), "symjax_mlp.Dense(dtype='int8'): "),
        (lambda: sm.mlp((2,), activation="nope"), "symjax_mlp.mlp(activation='nope'): "),
        (lambda: sm.mlp(()), "symjax_mlp.mlp(sizes=()): "),
        (lambda: sm.HybridSequential(()), "symjax_mlp.HybridSequential(layers=()): "),
        (lambda: sm.HybridConcurrent([1]), "symjax_mlp.HybridConcurrent(branches=...): "),
        (lambda: sm.chapter.chapter_mlp(batch=-1), "symjax_mlp.chapter.chapter_mlp(batch=-1): "),
        (lambda: sm.chapter.tour(calls=-1), "symjax_mlp.chapter.tour(calls=-1): "),
        (  # mlp's own refusals, headed as the chapter's call (passed in, not rewritten)
            lambda: sm.chapter.describe_mlp((2,), activation="nope"),
            "symjax_mlp.chapter.describe_mlp(activation='nope'): ",
        ),
        (lambda: sm.chapter.export_mlp("x", sizes=()), "symjax_mlp.chapter.export_mlp(sizes=()): "),
        (
            lambda: sm.chapter.describe_mlp(in_features=0),
            "symjax_mlp.chapter.describe_mlp(in_features=0): ",
        ),
        (
            lambda: sm.chapter.describe_mlp((2,), in_features=2, format="x"),
            "symjax_mlp.chapter.describe_mlp(format='x'): ",
        ),
        (
            lambda: sm.chapter.chapter_mlp((2**40, 2**40), in_features=1),
            "symjax_mlp.chapter.chapter_mlp(sizes=(1099511627776, 1099511627776)): ",
        ),
    ],
)
def test_a_refused_model_names_the_public_call(make, prefix):
    """Messages began "unknown activation", "mlp(sizes=...)", "unknown format": no public call
    (the house form is symjax_mlp.<call>(...): what, expected, fix)."""
    with pytest.raises(sm.ConfigError) as info:
        make()
    assert str(info.value).startswith(prefix), str(info.value)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: sm.Dense(2, param_dtype="int8"), r"Dense\(param_dtype='int8'\): .* floating"),
        (lambda: sm.HybridSequential(np.array([1, 2])), r"expected a sequence of modules"),
        (lambda: sm.HybridSequential(None), r"expected a sequence of modules.*got None"),
        (lambda: sm.chapter.tour(calls=0, print=None), r"tour\(print=None\): print takes"),
    ],
)
def test_what_flax_or_python_refused_raw_is_refused_when_built(make, says):
    """Dense(param_dtype="int8") failed at init with flax's "dtype argument to `uniform` must be
    a float dtype", HybridSequential(np.array(...)) with NumPy's ambiguous truth value,
    HybridSequential(None) was "an empty sequence", tour(print=None) a TypeError."""
    with pytest.raises(sm.ConfigError, match=says):
        make()


def test_concatenating_scalars_says_so_not_an_empty_range_of_axes():
    cat = sm.HybridConcurrent((lambda x: x.sum(), lambda x: x.sum()))
    with pytest.raises(sm.ConfigError, match=r"outputs are scalars \(shapes \[\(\), \(\)\]\)"):
        cat.init(jax.random.key(0), jnp.ones((2, 3)))
