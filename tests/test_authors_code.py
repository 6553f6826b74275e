"""JAX code as its authors write it: NumPy float64 params, lists of ``(W, b)`` pairs, masked
arrays, and the CLI run on a model's every output (issue 33, items 4 and 5, and the smaller
ones)."""

import itertools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import numpy.random as npr
import pytest
import safetensors.numpy
from helpers import dp_batch, dp_init, init_random_params, private_grad
from helpers import predict as mnist_predict
from helpers import readme_predict as predict
from jax.example_libraries import optimizers

import symjax_mlp as sm
from symjax_mlp.cli import main


# -- JAX's README (its predict is helpers.readme_predict) ----------------------------------------
def readme_params(sizes=(3, 4, 2), seed=0):
    rng = np.random.RandomState(seed)
    return [(rng.randn(m, n), rng.randn(n)) for m, n in itertools.pairwise(sizes)]


# -- 4. float64 params export an artifact that loads ---------------------------------------------
def test_float64_numpy_params_export_an_artifact_that_loads(tmp_path):
    h = sm.hybridize(lambda p, x: x @ p, np.ones((3, 2)))
    x = np.ones((4, 3))  # float64 too: the artifact takes what JAX traced, float32
    art = sm.export(h, tmp_path / "m", example=x)
    m = sm.load(art.path)
    np.testing.assert_array_equal(m(x.astype(np.float32)), h(x))
    manifest = json.loads((art.path / "manifest.json").read_text())
    assert [p["dtype"] for p in manifest["params"]] == ["float32"]
    assert [s["dtype"] for s in manifest["signature"]["inputs"]] == ["float32"]
    stored = safetensors.numpy.load_file(art.path / "params.safetensors")
    assert {k: v.dtype for k, v in stored.items()} == {"params": np.float32}


def test_mnist_from_scratch_params_export_load_and_run_as_jax_does(tmp_path):
    params = init_random_params(0.1, [784, 32, 10])
    images = npr.RandomState(1).rand(8, 784).astype(np.float32)
    h = sm.hybridize(mnist_predict, params)
    art = sm.export(h, tmp_path / "mnist", example=images)
    m = sm.load(art.path)
    np.testing.assert_allclose(m(images), mnist_predict(params, images), rtol=1e-5, atol=1e-5)
    assert {str(a.dtype) for a in m.params.values()} == {"float32"}
    assert sorted(m.params) == ["0/0", "0/1", "1/0", "1/1"]
    again = sm.load(art.path, params=params)  # the same float64 params, swapped in at load
    np.testing.assert_array_equal(again(images), m(images))


def test_int64_numpy_params_are_stored_as_traced(tmp_path):
    h = sm.hybridize(lambda p, x: x * p["scale"] + p["shift"], {"scale": np.arange(3), "shift": 1})
    x = np.ones((2, 3), np.int32)
    art = sm.export(h, tmp_path / "m", example=x)
    m = sm.load(art.path)
    np.testing.assert_array_equal(m(x), h(x))
    assert {k: str(a.dtype) for k, a in m.params.items()} == {"scale": "int32", "shift": "int32"}


# -- 5. params that are a list of (W, b) pairs ---------------------------------------------------
def test_readme_predict_stages_with_a_list_of_pairs_as_params():
    params, x = readme_params(), np.random.RandomState(1).randn(5, 3)
    g = sm.stage(predict)(params, x)
    assert g.primitive_counts["dot_general"] == 2 and g.primitive_counts["tanh"] == 2
    h = sm.hybridize(predict, params)
    np.testing.assert_allclose(h(x), predict(params, x), rtol=1e-5, atol=1e-5)
    hg = h.graph(x)
    assert hg.primitive_counts["dot_general"] == 2 and hg.primitive_counts["tanh"] == 2


def test_stage_takes_lists_of_arrays_anywhere_as_make_jaxpr_does():
    def f(xs, scales):
        return sum(x * s for x, s in zip(xs, scales, strict=True))

    xs = [jnp.ones(3), jnp.ones(3)]
    g = sm.stage(f)(xs, [np.float32(2), np.float32(3)])
    assert g.primitive_counts["mul"] == 2
    assert len(g.jaxpr.jaxpr.invars) == 4  # every array traced, none baked in


def test_hybridize_params_that_are_a_tuple_of_python_floats_stay_traced_in_graph():
    h = sm.hybridize(lambda p, x: x * p[0] + p[1], (2.0, 1.0))
    g = h.graph(jnp.ones(3))
    assert len(g.jaxpr.jaxpr.invars) == 3  # the two params and x: as h(x) traces them


def test_a_list_input_to_a_call_names_the_fix_for_what_it_holds():
    params, x = readme_params(), np.ones((2, 3), np.float32)
    h = sm.hybridize(lambda p, layers, x: predict(layers, x), {})
    with pytest.raises(sm.SignatureError, match=r"tuple\(args\[0\]\)") as e:
        h(params, x)
    assert "jnp.asarray" not in str(e.value)
    with pytest.raises(sm.SignatureError, match=r"jnp\.asarray\(args\[0\]\)"):
        sm.stage(lambda v: jnp.sum(jnp.asarray(v)))([1.0, 2.0])


# -- examples/differentially_private_sgd.py: private_grad, as its private_update calls it -------
def test_private_grad_runs_as_the_example_calls_it_its_numbers_static_its_key_traced():
    """A (images, labels) tuple and a raw PRNGKey in, its settings Python numbers (static, as
    the example's jit over private_update holds them): the noised, per-example-clipped grads
    equal jax.jit's, called alone and by h.apply in the example's own @jit private_update."""
    params = dp_init(jax.random.PRNGKey(0), (-1, 16, 16, 1))[1]
    rng, batch, settings = jax.random.PRNGKey(0), dp_batch(0), (1.0, 1.1, 4)
    step_rng = jax.random.fold_in(rng, 0)  # private_update's, at step 0
    want = jax.jit(private_grad, static_argnums=(3, 4, 5))(params, batch, step_rng, *settings)
    h = sm.hybridize(private_grad, params)
    chex.assert_trees_all_close(h(batch, step_rng, *settings), want, rtol=1e-5, atol=1e-6)
    assert h.trace_log[0].static == (("args[2]", "1.0"), ("args[3]", "1.1"), ("args[4]", "4"))
    opt_init, opt_update, get_params = optimizers.sgd(0.15)

    @jax.jit
    def private_update(rng, i, opt_state, batch):
        params = get_params(opt_state)
        rng = jax.random.fold_in(rng, i)  # get new key for new random numbers
        return opt_update(i, h.apply(params, batch, rng, *settings), opt_state)

    stepped = get_params(private_update(rng, 0, opt_init(params), batch))
    chex.assert_trees_all_close(stepped, jax.tree.map(lambda p, g: p - 0.15 * g, params, want),
                                rtol=1e-5, atol=1e-6)  # fmt: skip


# -- masked arrays are refused, not silently unmasked --------------------------------------------
def masked(x):
    return np.ma.masked_array(x, mask=np.arange(x.size).reshape(x.shape) % 2 == 0)


def float32_params():
    return [(W.astype(np.float32), b.astype(np.float32)) for W, b in readme_params()]


def test_a_masked_input_to_a_hybrid_is_refused():
    h = sm.hybridize(predict, float32_params())
    x = np.ones((2, 3), np.float32)
    h(x)
    with pytest.raises(sm.SignatureError, match=r"masked") as e:
        h(masked(x))
    assert "x.filled(" in str(e.value) and "np.asarray(x)" in str(e.value)
    with pytest.raises(sm.SignatureError, match=r"args\[0\]\[1\] is a NumPy masked array"):
        h.graph((x, masked(x)))


def test_a_masked_input_to_a_loaded_model_is_refused(tmp_path):
    h = sm.hybridize(predict, float32_params())
    x = np.ones((2, 3), np.float32)
    m = sm.load(sm.export(h, tmp_path / "m", example=x).path)
    m(x)  # the same shape and dtype, seen once: the check must still run
    with pytest.raises(sm.SignatureError, match=r"masked") as e:
        m(masked(x))
    assert "x.filled(" in str(e.value) and "np.asarray(x)" in str(e.value)


# -- symjax-mlp run: one --output path per output ------------------------------------------------
def outputs_of(tmp_path, n):
    """``run ART --input x.npy`` for an artifact returning ``n`` arrays (x * p, x + p, ...)."""
    x = np.ones((2, 4), np.float32)
    fn = (lambda p, x: x * p) if n == 1 else (lambda p, x: tuple(x * p + i for i in range(n)))
    art = sm.export(sm.hybridize(fn, jnp.float32(2)), tmp_path / "m", example=x).path
    np.save(tmp_path / "x.npy", x)
    return ["run", str(art), "--input", str(tmp_path / "x.npy")]


def test_run_with_more_output_paths_than_outputs_exits_2_writing_nothing(tmp_path, capsys):
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    assert main([*outputs_of(tmp_path, 1), "--output", str(a), "--output", str(b)]) == 2
    err = capsys.readouterr().err
    assert "2 --output paths" in err and "returns 1 array," in err and "Traceback" not in err
    assert not a.exists() and not b.exists()


def test_run_with_fewer_output_paths_than_outputs_exits_2_writing_nothing(tmp_path, capsys):
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    assert main([*outputs_of(tmp_path, 3), "--output", str(a), "--output", str(b)]) == 2
    err = capsys.readouterr().err
    assert "2 --output paths" in err and "returns 3 arrays" in err and "Traceback" not in err
    assert not a.exists() and not b.exists()


def test_run_writes_one_npy_per_output_path(tmp_path, capsys):
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    assert main([*outputs_of(tmp_path, 2), "--output", str(a), "--output", str(b)]) == 0
    np.testing.assert_array_equal(np.load(a), np.full((2, 4), 2.0))
    np.testing.assert_array_equal(np.load(b), np.full((2, 4), 3.0))
    out = capsys.readouterr().out
    assert f"wrote {a}: float32[2, 4]" in out and f"wrote {b}: float32[2, 4]" in out


def test_run_refuses_a_path_twice_and_stdout_beside_files(tmp_path, capsys):
    a = tmp_path / "a.npy"
    run = outputs_of(tmp_path, 2)
    assert main([*run, "--output", str(a), "--output", str(a)]) == 2
    assert "given 2 times" in capsys.readouterr().err
    assert main([*run, "--output", "-", "--output", str(a)]) == 2
    assert "stdout takes one array" in capsys.readouterr().err
    assert not a.exists()
