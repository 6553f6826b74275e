"""JAX transforms over a loaded model: jax.vmap, jax.grad, jax.jit, jax.lax.map/scan, a Hybrid.

``jax.vmap`` is checked against ``jax.vmap`` of the source function: merged into the batch
where rows stay apart, one call per example (``jax.lax.map``) anywhere else; every refusal by
its message (what was found, what to do).
"""

import json
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ZOO, zoo_artifact

import symjax_mlp as sm

TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """(h, m): an MLP on (b, 5) inputs and its artifact, loaded (vjp_order=1)."""
    net, x = sm.mlp((8, 3)), jnp.ones((2, 5))
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    path = tmp_path_factory.mktemp("t") / "mlp"
    return h, sm.load(sm.export(h, path, example=x, vjp_order=1).path)


def _xs(*shape, seed=1):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.parametrize(
    "vmap, xs",
    [
        pytest.param(jax.vmap, _xs(3, 4, 5), id="in_axes=0"),
        pytest.param(lambda f: jax.vmap(f, in_axes=1), _xs(4, 3, 5), id="in_axes=1"),
        pytest.param(lambda f: jax.vmap(f, in_axes=2), _xs(4, 5, 3), id="in_axes=2"),
        pytest.param(lambda f: jax.vmap(f, out_axes=1), _xs(3, 4, 5), id="out_axes=1"),
        pytest.param(lambda f: jax.vmap(jax.vmap(f)), _xs(2, 3, 4, 5), id="nested"),
        pytest.param(lambda f: jax.vmap(jax.vmap(f, in_axes=1)), _xs(2, 4, 3, 5), id="nested-1"),
        pytest.param(lambda f: jax.jit(jax.vmap(f)), _xs(3, 4, 5), id="jit-of-vmap"),
        pytest.param(lambda f: jax.vmap(jax.jit(f)), _xs(3, 4, 5), id="vmap-of-jit"),
    ],
)
def test_vmap_equals_vmap_of_the_source(mlp, vmap, xs):
    h, m = mlp
    chex.assert_trees_all_close(vmap(m)(xs), vmap(h)(xs), **TOL)


def test_one_example_and_vmap_per_example_as_the_source_takes_them(mlp, mixing, tmp_path):
    h, m = mlp
    xs = _xs(4, 5)
    chex.assert_trees_all_close(m(xs[0]), h(xs[0]), **TOL)  # (5,) -> (3,): one example
    chex.assert_trees_all_close(jax.vmap(m)(xs), jax.vmap(h)(xs), **TOL)
    chex.assert_trees_all_close(jax.jit(jax.vmap(m))(xs), h(xs), **TOL)
    with pytest.raises(sm.SignatureError, match=r"shape \(4,\), rank 1"):
        m(xs[0, :4])  # one example of the wrong width: the error names what was passed
    # an input without the batch dimension stays as it is; the batched one is the example
    g = sm.hybridize(lambda p, x, s: (x * s) @ p, _xs(5, 3))
    art = sm.export(g, tmp_path / "s", example=(jnp.ones((2, 5)), jnp.ones(5)),
                    shapes=("n, 5", None))  # fmt: skip
    s = _xs(5, seed=2)
    want = jax.vmap(g, in_axes=(0, None))(xs, s)
    chex.assert_trees_all_close(jax.vmap(sm.load(art.path), in_axes=(0, None))(xs, s), want, **TOL)
    # where rows see each other, one example is not the model's to guess: refused as before
    with pytest.raises(sm.SignatureError, match="rank 1"):
        mixing[1](xs[0])


def test_vmap_with_an_unmapped_input_and_tuple_outputs(tmp_path):
    def fn(p, x, y):
        return jnp.tanh(x @ p["w"] + y @ p["v"]), jnp.sum(x, axis=1)

    p = {"w": _xs(5, 3, seed=2), "v": _xs(2, 3, seed=3)}
    h = sm.hybridize(fn, p)
    art = sm.export(h, tmp_path / "m", example=(jnp.ones((4, 5)), jnp.ones((4, 2))))
    m = sm.load(art.path)
    xs, y = _xs(3, 4, 5), _xs(4, 2, seed=4)
    for in_axes, args in (((0, None), (xs, y)), ((None, 0), (xs[0], jnp.stack([y] * 3)))):
        want = jax.vmap(lambda x, y: fn(p, x, y), in_axes=in_axes)(*args)
        chex.assert_trees_all_close(jax.vmap(m, in_axes=in_axes)(*args), want, **TOL)


@pytest.mark.parametrize(
    "vmap, xs",
    [
        pytest.param(jax.vmap, jnp.ones((0, 4, 5)), id="in_axes=0"),
        pytest.param(lambda f: jax.vmap(f, in_axes=1, out_axes=1), jnp.ones((4, 0, 5)), id="1"),
        pytest.param(lambda f: jax.jit(jax.vmap(f)), jnp.ones((0, 4, 5)), id="jit"),
        pytest.param(lambda f: jax.vmap(jax.vmap(f)), jnp.ones((2, 0, 4, 5)), id="nested"),
        pytest.param(jax.vmap, jnp.ones((0, 5)), id="examples"),
    ],
)
def test_vmap_over_no_example_gives_empty_outputs_as_the_source(mlp, vmap, xs):
    # merged, it was a batch of 0, which the module refuses: "the shapes ... cannot be resolved"
    h, m = mlp
    got, want = vmap(m)(xs), vmap(h)(xs)
    assert got.shape == want.shape and got.dtype == want.dtype


def test_one_example_as_a_list_and_of_a_wrong_dtype_and_lists_that_are_no_array(mlp):
    h, m = mlp
    chex.assert_trees_all_close(m([0.5] * 5), h(jnp.full((1, 5), 0.5))[0], **TOL)  # as a batch
    with pytest.raises(sm.SignatureError, match=r"dtype int32 .*x.astype\(np.float32\)"):
        m(np.ones(5, np.int32))  # not 'add the batch dimension': it is the dtype
    # a ragged list, or jax.grad over a list (of tracers): the signature's error, not NumPy's
    for call in (
        lambda: m([[1.0] * 5, [1.0] * 4]),
        lambda: jax.grad(lambda x: m(x).sum())([[1.0] * 5]),
    ):
        with pytest.raises(sm.SignatureError, match=r"args\[0\] is a list that is not an array"):
            call()


def test_vmap_compiles_once_per_shape(mlp):
    h, m = mlp
    lowered = []

    def listen(event, _, **kw):
        if "jaxpr_to_mlir" in event:
            lowered.append(event)

    f, xs = jax.vmap(m), _xs(3, 6, 5)
    f(xs).block_until_ready()
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for seed in range(3):
            f(_xs(3, 6, 5, seed=seed + 2)).block_until_ready()
        assert lowered == []  # the same shape: neither lowered nor compiled again
        f(_xs(3, 7, 5)).block_until_ready()
        assert lowered  # a new shape is (the count counts)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    chex.assert_trees_all_close(f(xs), jax.vmap(h)(xs), **TOL)


def _mean_norm(p, x):
    return (x - x.mean(0)) / (x.std(0) + 1) @ p


def _softmax_over_batch(p, x):
    return jax.nn.softmax(x @ p, axis=0)


@pytest.mark.parametrize(
    "fn, why",
    [
        (_mean_norm, "(reduces over|reads) the batch"),
        (_softmax_over_batch, "reduce reduces over the batch axis"),
        (lambda p, x: jnp.cumsum(x, axis=0) @ p, "dynamic dimensions are not the batch's"),
        (lambda p, x: jnp.sort(x, axis=0) @ p, "sort is not known to keep rows apart"),
        (lambda p, x: jax.lax.rev(x, (0,)) @ p, "reverse moves rows along the batch axis"),
        (lambda p, x: (x + jnp.arange(x.shape[0])[:, None]) @ p, "counts along the batch axis"),
        (lambda p, x: jnp.roll(x, 1, axis=0) @ p, "combines rows with the batch size"),
        (lambda p, x: x.reshape(5, -1).T @ p, "reshape.* mixes rows"),
    ],
    ids=["batch-norm", "softmax", "cumsum", "sort", "reverse", "row-index", "roll", "reshape"],
)
def test_vmap_runs_one_call_per_example_where_rows_see_each_other(tmp_path, fn, why):
    h = sm.hybridize(fn, _xs(5, 3))
    art = sm.export(h, tmp_path / "m", example=jnp.ones((4, 5)))
    m = sm.load(art.path, trust=True)  # a cumsum or sort lowers to ops load() asks to allow
    assert m.manifest["rows"]["independent"] is False
    assert re.search(why, m.manifest["rows"]["why"])
    xs = _xs(2, 4, 5)
    want = jnp.stack([h(x) for x in xs])  # each slice a whole call, as vmap means
    chex.assert_trees_all_close(jax.vmap(m)(xs), want, jax.lax.map(m, xs), **TOL)
    merged = h(xs.reshape(8, 5)).reshape(2, 4, 3)  # what merging the rows would give
    assert not np.allclose(jax.vmap(m)(xs), merged, **TOL)


def _sq(f):
    return lambda x: (f(x) ** 2).sum()


@pytest.fixture(scope="module")
def mixing(tmp_path_factory):
    """(h, m): a model whose rows see each other and its artifact, loaded (vjp_order=1)."""
    h, path = sm.hybridize(_mean_norm, _xs(5, 3)), tmp_path_factory.mktemp("t") / "mixing"
    return h, sm.load(sm.export(h, path, example=jnp.ones((4, 5)), vjp_order=1).path)


@pytest.mark.parametrize(
    "vmap, xs",
    [
        pytest.param(lambda f: jax.vmap(f, in_axes=1), _xs(4, 3, 5), id="in_axes=1"),
        pytest.param(lambda f: jax.vmap(f, in_axes=2), _xs(4, 5, 3), id="in_axes=2"),
        pytest.param(lambda f: jax.vmap(f, out_axes=2), _xs(3, 4, 5), id="out_axes=2"),
        pytest.param(lambda f: jax.vmap(jax.vmap(f, in_axes=1)), _xs(2, 4, 3, 5), id="nested"),
        pytest.param(lambda f: jax.jit(jax.vmap(f)), _xs(3, 4, 5), id="jit-of-vmap"),
        pytest.param(lambda f: jax.vmap(jax.jit(f)), _xs(3, 4, 5), id="vmap-of-jit"),
        pytest.param(jax.vmap, jnp.ones((0, 4, 5)), id="no-example"),
        pytest.param(lambda f: jax.grad(_sq(jax.vmap(f))), _xs(3, 4, 5), id="grad-of-vmap"),
        pytest.param(lambda f: jax.vmap(jax.grad(_sq(f))), _xs(3, 4, 5), id="vmap-of-grad"),
    ],
)
def test_vmap_where_rows_see_each_other_equals_vmap_of_the_source(mixing, vmap, xs):
    h, m = mixing
    got, want = vmap(m)(xs), vmap(h)(xs)
    assert got.shape == want.shape
    chex.assert_trees_all_close(got, want, **TOL)


def test_vmap_over_examples_where_rows_see_each_other_names_why_and_the_batch_of_one(mixing):
    """jax.vmap(m) over (4, 5) gives m each (5,) example, which an artifact whose rows are not
    kept apart cannot take: the signature's error only said to add the batch dimension."""
    h, m = mixing
    xs = _xs(4, 5)
    for call in (lambda: jax.vmap(m)(xs), lambda: m(xs[0])):
        with pytest.raises(
            sm.SignatureError,
            match=r"rank 1, .*not known to stay apart \(.*"
            r"batch.*\)\. Give it a batch of one: m\(x\[None\]\)\[0\], under "
            r"jax\.vmap: jax\.vmap\(lambda x: m\(x\[None\]\)\[0\]\)",
        ):
            call()
    got = jax.vmap(lambda x: m(x[None])[0])(xs)
    chex.assert_trees_all_close(got, jax.vmap(lambda x: h(x[None])[0])(xs), **TOL)


def test_vmap_over_a_sequence_model_of_two_symbolic_dimensions(tmp_path):
    # (b, t, 5): the module cannot show rows apart, so each example is a whole call
    def attend(p, x):  # each sequence attends over its own steps
        a = jax.nn.softmax(jnp.einsum("btd,bsd->bts", x, x), axis=-1)
        return jnp.einsum("bts,bsd->btd", a, x) @ p

    h = sm.hybridize(attend, _xs(5, 3))
    art = sm.export(h, tmp_path / "m", example=jnp.ones((2, 4, 5)), shapes=("b, t, 5",))
    m = sm.load(art.path)
    assert m.manifest["rows"]["independent"] is False
    for xs in (_xs(3, 2, 4, 5), _xs(2, 1, 7, 5)):
        want = jnp.stack([m(x) for x in xs])
        chex.assert_trees_all_close(jax.vmap(m)(xs), want, jax.vmap(h)(xs), **TOL)
        chex.assert_trees_all_close(jax.jit(jax.vmap(m))(xs), want, **TOL)


class _Conv(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(nn.Conv(4, (3,))(x))
        return jax.nn.softmax(nn.Dense(2)(x.reshape(x.shape[0], -1)), axis=-1)


def test_rows_kept_apart_through_conv_layernorm_reshape_and_softmax(tmp_path):
    net, x = _Conv(), jnp.ones((2, 8, 3))
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    m = sm.load(sm.export(h, tmp_path / "m", example=x).path, allow={"convolution"})
    assert m.manifest["rows"] == {"dim": "b", "independent": True, "why": ""}
    xs = _xs(3, 2, 8, 3)
    chex.assert_trees_all_close(jax.vmap(m)(xs), jax.vmap(h)(xs), **TOL)


def _edit_manifest(path, edit):
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_an_artifact_without_a_rows_verdict_maps_one_call_per_example(tmp_path, mlp):
    h, _ = mlp
    art = sm.export(h, tmp_path / "old", example=jnp.ones((2, 5)))
    _edit_manifest(art.path, lambda m: m.pop("rows"))  # as exported before the field existed
    m = sm.load(art.path)
    chex.assert_trees_all_close(m(jnp.ones((2, 5))), h(jnp.ones((2, 5))), **TOL)
    xs = _xs(3, 2, 5)
    chex.assert_trees_all_close(jax.vmap(m)(xs), jax.vmap(h)(xs), **TOL)


@pytest.mark.parametrize(
    "rows",
    [
        "yes",
        {"dim": "b", "independent": "true", "why": ""},
        {"dim": "b", "independent": True, "why": "a reason"},
        {"dim": "b", "independent": True},
        {"dim": 3, "independent": False, "why": "x"},
    ],
)
def test_the_rows_field_is_type_checked(tmp_path, mlp, rows):
    h, _ = mlp
    art = sm.export(h, tmp_path / "m", example=jnp.ones((2, 5)))
    _edit_manifest(art.path, lambda m: m.update(rows=rows))
    with pytest.raises(sm.ArtifactError, match=r"rows is .*corrupted or was edited"):
        sm.load(art.path)


def test_vmap_over_an_input_without_the_batch_dimension_maps_one_call_per_example(tmp_path):
    h = sm.hybridize(lambda p, x, s: (x * s) @ p, _xs(5, 3))
    art = sm.export(h, tmp_path / "m", example=(jnp.ones((2, 5)), jnp.ones(5)),
                    shapes=("n, 5", None))  # fmt: skip
    m = sm.load(art.path)
    assert m.manifest["rows"]["dim"] == "n"
    xs, s = _xs(3, 2, 5), _xs(5, seed=2)
    want = jax.vmap(h, in_axes=(0, None))(xs, s)
    chex.assert_trees_all_close(jax.vmap(m, in_axes=(0, None))(xs, s), want, **TOL)
    ss = jnp.stack([s, 2 * s, 3 * s])  # its rows cannot join the batch: one call each
    chex.assert_trees_all_close(jax.vmap(m)(xs, ss), jax.vmap(h)(xs, ss), **TOL)


def test_static_shapes_map_one_call_per_example(tmp_path, mlp):
    h, _ = mlp
    m = sm.load(sm.export(h, tmp_path / "m", example=jnp.ones((2, 5)), batch=None).path)
    assert "static shapes" in m.manifest["rows"]["why"]
    xs = _xs(3, 2, 5)
    chex.assert_trees_all_close(jax.vmap(m)(xs), jax.vmap(h)(xs), **TOL)
    xss = _xs(2, 3, 2, 5)
    chex.assert_trees_all_close(jax.vmap(jax.vmap(m))(xss), jax.vmap(jax.vmap(h))(xss), **TOL)


def test_jit_lax_map_lax_scan_and_a_hybrid_over_a_loaded_model(mlp):
    h, m = mlp
    x, xs = _xs(4, 5), _xs(3, 4, 5)
    chex.assert_trees_all_close(jax.jit(lambda x: m(x) + 1)(x), h(x) + 1, **TOL)
    chex.assert_trees_all_close(jax.lax.map(m, xs), jax.vmap(h)(xs), **TOL)
    chex.assert_trees_all_close(jax.lax.map(m, xs, batch_size=2), jax.vmap(h)(xs), **TOL)

    def step(carry, x):
        y = m(x)
        return carry + y.sum(), y

    total, ys = jax.lax.scan(step, jnp.float32(0), xs)
    chex.assert_trees_all_close(ys, jax.vmap(h)(xs), **TOL)
    chex.assert_trees_all_close(total, jax.vmap(h)(xs).sum(), **TOL)
    outer = sm.hybridize(lambda p, x: m(x) * p, jnp.float32(2))
    chex.assert_trees_all_close(outer(x), 2 * h(x), **TOL)
    chex.assert_trees_all_close(outer.eager(x), 2 * h(x), **TOL)


def test_grad_of_a_model_exported_without_a_vjp_names_the_fix(tmp_path, mlp):
    h, _ = mlp
    m = sm.load(sm.export(h, tmp_path / "m", example=jnp.ones((2, 5))).path)
    with pytest.raises(sm.ConfigError, match=r"exported without one \(vjp_order=0\).*vjp_order=1"):
        jax.grad(lambda x: m(x).sum())(jnp.ones((2, 5)))  # a ConfigError, as jax.jvp's refusal


def test_grad_vmap_of_grad_and_grad_of_vmap(mlp):
    h, m = mlp
    x, xs = _xs(4, 5), _xs(3, 4, 5)

    def loss(f):
        return lambda x: (f(x) ** 2).sum()

    chex.assert_trees_all_close(jax.grad(loss(m))(x), jax.grad(loss(h))(x), **TOL)
    want = jax.vmap(jax.grad(loss(h)))(xs)
    chex.assert_trees_all_close(jax.vmap(jax.grad(loss(m)))(xs), want, **TOL)
    chex.assert_trees_all_close(jax.grad(loss(jax.vmap(m)))(xs), want, **TOL)
    with pytest.raises(sm.ConfigError, match=r"order 2.*\(vjp_order=1\).*vjp_order=2"):
        jax.grad(lambda x: jax.grad(loss(m))(x).sum())(x)


@pytest.mark.slow  # the transforms matrix (~5-12 s): CI runs it with `-m slow`
def test_each_entry_point_under_vmap_grad_jit_map_scan_and_in_a_hybrid(tmp_path):
    net, x = sm.mlp((8, 3)), jnp.ones((2, 5))
    variables = net.init(jax.random.key(0), x)
    h = sm.hybridize(net, variables)
    embed = sm.hybridize(lambda v, x: jnp.tanh(net.apply(v, x)), variables)
    norm = sm.hybridize(lambda v, x: net.apply(v, x) - net.apply(v, x).mean(0), variables)
    points = {"predict": h, "embed": embed, "norm": norm}
    m = sm.load(sm.export(points, tmp_path / "m", example=x, vjp_order=1).path)
    xs = _xs(3, 2, 5)
    for name in ("predict", "embed"):
        f, source = m[name], points[name]
        assert f.manifest["rows"]["independent"]
        chex.assert_trees_all_close(jax.vmap(f)(xs), jax.vmap(source)(xs), **TOL)
        got = jax.grad(lambda x, f=f: f(x).sum())(xs[0])
        want = jax.grad(lambda x, f=source: f(x).sum())(xs[0])
        chex.assert_trees_all_close(got, want, **TOL)
        want = jax.vmap(source)(xs)
        chex.assert_trees_all_close(jax.jit(lambda x, f=f: f(x) + 1)(xs[0]), want[0] + 1, **TOL)
        chex.assert_trees_all_close(jax.lax.map(f, xs), want, **TOL)
        _, ys = jax.lax.scan(lambda c, x, f=f: (c, f(x)), 0, xs)
        chex.assert_trees_all_close(ys, want, **TOL)
        outer = sm.hybridize(lambda p, x, f=f: f(x) * p, jnp.float32(2))
        chex.assert_trees_all_close(outer(xs[0]), 2 * want[0], **TOL)
    # an entry point whose rows see each other: jit, lax.map and vmap take whole batches
    f = m["norm"]
    chex.assert_trees_all_close(jax.jit(f)(xs[0]), norm(xs[0]), **TOL)
    chex.assert_trees_all_close(jax.lax.map(f, xs), jax.vmap(norm)(xs), **TOL)
    chex.assert_trees_all_close(jax.vmap(f)(xs), jax.vmap(norm)(xs), **TOL)
    got = jax.grad(lambda xs: jnp.tanh(jax.vmap(f)(xs)).sum())(xs)
    want = jax.grad(lambda xs: jnp.tanh(jax.vmap(norm)(xs)).sum())(xs)
    chex.assert_trees_all_close(got, want, **TOL)


# an artifact takes arrays: a dict input is refused by export (tests/test_zoo.py)
_ARRAY_INPUTS = [c for c in ZOO if not any(isinstance(x, dict) for x in c.inputs(0))]


@pytest.mark.parametrize("case", _ARRAY_INPUTS, ids=lambda c: c.name)
def test_vmap_over_the_zoo(tmp_path_factory, case):
    inputs = case.inputs(0)
    arrays = [i for i, x in enumerate(inputs) if hasattr(x, "shape")]

    m = sm.load(zoo_artifact(tmp_path_factory, case))
    model, params = case.build()

    def source(*xs):  # the plain Flax model, in the mode export bakes in
        args = list(inputs)
        for i, x in zip(arrays, xs, strict=True):
            args[i] = x
        if case.kind == "nnx":
            return model(*args, **case.eval)
        if case.kind == "fn":
            return model(params, *args, **case.eval)
        return model.apply(params, *args, **case.eval)

    stacked = [jnp.stack([case.inputs(s)[i] for s in range(3)]) for i in arrays]
    assert m.manifest["rows"] == {"dim": "b", "independent": True, "why": ""}
    want = jax.jit(jax.vmap(source))(*stacked)  # jitted: run op by op, each op compiles alone
    chex.assert_trees_all_close(jax.vmap(m)(*stacked), want, **TOL)


def test_the_iree_runtime_under_a_transform_says_to_load_with_jax(tmp_path, mlp):
    pytest.importorskip("iree.runtime")
    h, _ = mlp
    m = sm.load(sm.export(h, tmp_path / "m", example=jnp.ones((2, 5))).path, runtime="iree")
    for transform, x in ((jax.vmap, _xs(3, 2, 5)), (jax.jit, _xs(2, 5))):
        with pytest.raises(sm.ConfigError, match=r"iree runtime runs outside JAX.*runtime='jax'"):
            transform(m)(x)


@pytest.mark.slow  # the transforms matrix (~5-12 s): CI runs it with `-m slow`
def test_a_hessian_by_jacrev_of_jacrev_equals_the_source(tmp_path, mlp):
    # the VJP module under two vmaps (jacrev of jacrev) runs one element at a time at each
    h, _ = mlp
    m = sm.load(sm.export(h, tmp_path / "m", example=jnp.ones((2, 5)), vjp_order=2).path)
    x = _xs(2, 5)

    def loss(f):
        return lambda x: jnp.tanh(f(x)).sum()

    want = jax.hessian(loss(h))(x)
    chex.assert_trees_all_close(jax.jacrev(jax.jacrev(loss(m)))(x), want, **TOL)
    chex.assert_trees_all_close(jax.jacrev(jax.jacrev(m))(x), jax.jacrev(jax.jacrev(h))(x), **TOL)
    chex.assert_trees_all_close(jax.jit(jax.jacrev(jax.jacrev(loss(m))))(x), want, **TOL)


def _jvp(f):
    return lambda x: jax.jvp(f, (x,), (x,))


@pytest.mark.parametrize(
    "transform",
    [jax.jacfwd, jax.hessian, _jvp, lambda f: jax.jit(_jvp(f)), lambda f: jax.jit(jax.jacfwd(f)),
     lambda f: jax.jit(jax.hessian(f)), lambda f: jax.vmap(_jvp(f)), lambda f: _jvp(jax.vmap(f)),
     lambda f: _jvp(jax.grad(f)), lambda f: lambda x: jax.linearize(f, x),
     lambda f: jax.jit(lambda x: jax.linearize(f, x)[0]),
     lambda f: lambda x: jax.linearize(jax.grad(f), x)],
    ids=["jacfwd", "hessian", "jvp", "jit-jvp", "jit-jacfwd", "jit-hessian", "vmap-jvp",
         "jvp-vmap", "jvp-grad", "linearize", "jit-linearize", "linearize-grad"],
)  # fmt: skip
def test_forward_mode_names_reverse_mode_not_a_corrupted_artifact(mlp, transform):
    # under jax.jit, JAX's own TypeError came where the outer jit lowered, far from the call;
    # jax.linearize returned, and its linear function raised JAX's TypeError when called
    _, m = mlp
    with pytest.raises(sm.ConfigError, match=r"reverse mode only.*holds them up to order 1.*"
                       r"jax.jacrev\(jax.jacrev\(f\)\).*export again") as e:  # fmt: skip
        transform(lambda x: m(x).sum())(_xs(2, 5))
    assert isinstance(e.value, sm.SymjaxError)


def test_linearize_of_jit_of_a_loaded_model_is_refused_as_it_traces(tmp_path):
    """jax.jit traces the model before jax.linearize sees a tangent, so the call found none:
    linearize returned, and its linear function raised JAX's TypeError ("can't apply
    forward-mode autodiff (jvp) to a custom_vjp function") where it lowered. Refused as
    linearize traces now, also where jit traced the model before."""
    net, x = sm.mlp((7, 3)), _xs(2, 5)
    h = sm.hybridize(net, net.init(jax.random.key(42), x))
    m = sm.load(sm.export(h, tmp_path / "m", example=x, vjp_order=1).path)
    forward = r"jax.linearize differentiate forward.*reverse mode only.*jax.jacrev"
    jm = jax.jit(m)
    with pytest.raises(sm.ConfigError, match=forward):
        jax.linearize(jm, x)
    chex.assert_trees_all_close(jm(x), h(x), **TOL)  # traced by jit alone
    for f in (jm, jax.jit(m), jax.jit(lambda x: m(x) * 2)):
        with pytest.raises(sm.ConfigError, match=forward):
            jax.linearize(f, x)
    c = _xs(2, 5, seed=3)  # a constant inside linearize: no tangent reaches the model
    y, lin = jax.linearize(lambda w: w * jax.jit(m)(c).sum(), 2.0)
    chex.assert_trees_all_close((y, lin(1.0)), (2 * h(c).sum(), h(c).sum()), **TOL)
    want = jax.grad(lambda x: h(x).sum())(x)
    chex.assert_trees_all_close(jax.grad(lambda x: jm(x).sum())(x), want, **TOL)


def test_jvp_and_jacfwd_of_jit_of_a_loaded_model_are_refused_as_they_trace(tmp_path):
    """jax.jit traces the model before jax.jvp (jacfwd's too) sees a tangent, so the call found
    none, and JAX's raw TypeError ("can't apply forward-mode autodiff (jvp) to a custom_vjp
    function") came as the jitted program was differentiated. Refused as they trace now, as
    jax.jvp(m) and jax.linearize(jax.jit(m)) are; a constant inside jvp still runs."""
    net, x = sm.mlp((6, 3)), _xs(2, 5)
    h = sm.hybridize(net, net.init(jax.random.key(7), x))
    m = sm.load(sm.export(h, tmp_path / "m", example=x, vjp_order=1).path)
    forward = r"jax.jvp, jax.jacfwd.*differentiate forward.*reverse mode only.*jax.jacrev"
    jm = jax.jit(m)
    chex.assert_trees_all_close(jm(x), h(x), **TOL)  # traced by jit alone first
    calls = [lambda f: jax.jvp(f, (x,), (x,)), lambda f: jax.jacfwd(f)(x)]
    for f in (jm, jax.jit(m), jax.jit(lambda x: m(x) * 2), jax.jit(lambda x: m(x).sum())):
        for call in calls:
            with pytest.raises(sm.ConfigError, match=forward):
                call(f)
    c = _xs(2, 5, seed=3)  # a constant inside jvp: no tangent reaches the model
    y, t = jax.jvp(lambda w: w * jax.jit(m)(c).sum(), (2.0,), (1.0,))
    chex.assert_trees_all_close((y, t), (2 * h(c).sum(), h(c).sum()), **TOL)
    y, t = jax.jvp(lambda w: w * jax.grad(lambda c: jm(c).sum())(c), (x,), (x,))
    want = jax.grad(lambda c: h(c).sum())(c)
    chex.assert_trees_all_close((y, t), (x * want, x * want), **TOL)
    want = jax.grad(lambda x: h(x).sum())(x)
    chex.assert_trees_all_close(jax.grad(lambda x: jm(x).sum())(x), want, **TOL)


def test_hessian_of_jit_of_a_loaded_model_is_refused_as_it_traces(tmp_path):
    """jax.hessian is jacfwd(jacrev): forward mode over the reverse mode that traced the jitted
    model, which found jax.vjp innermost and ran; JAX's raw TypeError ("can't apply
    forward-mode autodiff (jvp) to a custom_vjp function") followed. A jax.vjp whose primals
    jax.jvp traces is forward mode now; jacrev of jacrev still runs."""
    net, x = sm.mlp((6, 3)), _xs(2, 5)
    h = sm.hybridize(net, net.init(jax.random.key(5), x))
    m = sm.load(sm.export(h, tmp_path / "m", example=x, vjp_order=2).path)
    forward = r"jax.hessian and jax.linearize differentiate forward.*order 2.*jax.jacrev"
    calls = [
        jax.hessian, lambda f: jax.jacfwd(jax.jacrev(f)), lambda f: _jvp(jax.grad(f)),
        lambda f: lambda x: jax.linearize(jax.grad(f), x)[1](x),
    ]  # fmt: skip
    for call in calls:
        for f in (jax.jit(lambda x: m(x).sum()), lambda x: jax.jit(m)(x).sum()):
            with pytest.raises(sm.ConfigError, match=forward):
                call(f)(x)
    want = jax.hessian(lambda x: h(x).sum())(x)
    chex.assert_trees_all_close(
        jax.jacrev(jax.jacrev(lambda x: jax.jit(m)(x).sum()))(x), want, **TOL
    )


def test_grad_at_a_constant_inside_jax_linearize_of_another_function_runs(mlp):
    # jax.grad traces the model as jax.linearize does: refused by which of them calls it
    h, m = mlp
    x, c = _xs(2, 5), _xs(2, 5, seed=2)

    def f(model):
        return lambda y: y * jax.grad(lambda c: model(c).sum())(c)

    (got, lin), (want, _) = jax.linearize(f(m), x), jax.linearize(f(h), x)
    chex.assert_trees_all_close(got, want, **TOL)
    chex.assert_trees_all_close(lin(x), want, **TOL)


def test_lax_cond_and_switch_with_a_batched_predicate_under_vmap(mlp):
    # vmap batches every operand of a cond whose predicate is batched, the closed-over
    # weights too: the program ran with (n, ...) weights (a rank mismatch)
    h, m = mlp
    xs, on = _xs(3, 4, 5), jnp.array([True, False, True])

    def cond(f):
        return jax.vmap(lambda x, c: jax.lax.cond(c, f, lambda x: -h(x), x))

    def switch(f):
        return jax.vmap(lambda x, i: jax.lax.switch(i, [f, lambda x: -h(x)], x))

    chex.assert_trees_all_close(cond(m)(xs, on), cond(h)(xs, on), **TOL)
    chex.assert_trees_all_close(switch(m)(xs, on.astype(int)), switch(h)(xs, on.astype(int)), **TOL)

    def loss(f):
        return lambda xs: cond(f)(xs, on).sum()

    chex.assert_trees_all_close(jax.grad(loss(m))(xs), jax.grad(loss(h))(xs), **TOL)


def test_load_inside_jit_eval_shape_vmap_and_grad_runs_its_checks_outside_the_trace(mlp):
    """sm.load called in a function jax.jit traces raised JAX's TracerArrayConversionError
    (its self-test compared traced outputs), with JAX's traceback; the weights it placed
    must not be tracers either, or the model would fail once the trace is over."""
    h, m = mlp
    x, kept = _xs(2, 5), []

    def f(x):
        kept.append(sm.load(m.path))
        return kept[-1](x)

    for transform, xs in ((jax.jit, x), (jax.vmap, _xs(3, 2, 5)),
                          (lambda f: jax.grad(lambda x: f(x).sum()), x)):  # fmt: skip
        np.testing.assert_allclose(transform(f)(xs), transform(h)(xs), **TOL)
    assert jax.eval_shape(f, x).shape == (2, 3)
    np.testing.assert_allclose(kept[0](x), h(x), **TOL)  # after the trace: concrete weights
    np.testing.assert_allclose(kept[-1](x), h(x), **TOL)


def test_vmap_whose_merged_batch_breaks_a_bound_runs_one_example_at_a_time(tmp_path):
    """jax.vmap of 4 examples of b = 2 over an artifact of b <= 3 merged them into b = 8,
    and the program refused it ("the shapes of the module cannot be resolved"): each example
    is within the bound, so vmap runs them one by one instead."""
    h = sm.hybridize(lambda p, x: jnp.tanh(x * p), jnp.float32(2))
    art = sm.export(h, tmp_path / "m", example=jnp.ones((2, 3)), shapes=("b, 3",),
                    constraints=("b <= 3",))  # fmt: skip
    m, xs = sm.load(art.path), _xs(4, 2, 3)
    assert m.manifest["rows"]["independent"]  # rows apart: merging was allowed
    for vmap in (jax.vmap, lambda f: jax.jit(jax.vmap(f))):
        np.testing.assert_allclose(vmap(m)(xs), jax.vmap(h)(xs), **TOL)
    np.testing.assert_allclose(jax.vmap(m)(xs[:1]), jax.vmap(h)(xs[:1]), **TOL)  # merged: b = 2


def test_forward_mode_of_a_jitted_loaded_model_is_refused_after_its_grad(mlp):
    """jax.grad of jax.jit(m) traced the program's forward rule once, and JAX reuses that
    trace: a later jax.jvp, jacfwd or linearize of jax.jit(m) skipped the refusal and raised
    JAX's raw TypeError ("can't apply forward-mode autodiff (jvp) to a custom_vjp function")
    as it lowered. ConfigError now, whatever ran before; jax.grad still runs after."""
    h, m = mlp
    x, loss = _xs(2, 5, seed=4), lambda x: jax.jit(m)(x).sum()
    forward = r"differentiate forward.*reverse mode only.*jax.jacrev"
    want = jax.grad(lambda x: h(x).sum())(x)
    chex.assert_trees_all_close(jax.grad(loss)(x), want, **TOL)
    for call in [_jvp, jax.jacfwd, lambda f: lambda x: jax.linearize(f, x)[1](x), _jvp]:
        with pytest.raises(sm.ConfigError, match=forward):
            call(jax.jit(m))(x)
    chex.assert_trees_all_close(jax.grad(loss)(x), want, **TOL)
