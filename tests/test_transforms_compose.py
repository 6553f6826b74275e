"""JAX's transforms as researchers compose them, over a Hybrid (``h``, ``h.apply``) and a loaded
model (``m``), each against the plain JAX/Flax model under the same composition.

The compositions tests/test_transforms.py leaves out: jax.shard_map (a loaded model's outputs
vary along the mesh axes its inputs vary along, as the source's do), jax.pmap, checkpoint and
remat, jax.vjp with has_aux, value_and_grad over argnums, nested vmap with other out_axes and
in_axes trees, loops and custom_vjp/custom_jvp functions calling the model, donation, x64 mode,
other float inputs, empty batches, linear_transpose, and grad through linen's BatchNorm and
Dropout in train mode (``h.apply`` as flax's own apply).
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import symjax_mlp as sm

TOL = {"rtol": 1e-5, "atol": 1e-5}
W = jax.random.normal(jax.random.key(3), (5, 3))


def _xs(*shape, seed=1):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _scaled(p, x, s):  # rows apart; s, without the batch dimension, the same for every row
    return jnp.tanh((x * s) @ p)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: fn(x, s)}: the source, its Hybrid, h.apply and the artifact loaded (vjp_order=2)."""
    h, path = sm.hybridize(_scaled, W), tmp_path_factory.mktemp("c") / "m"
    art = sm.export(h, path, example=(jnp.ones((2, 5)), jnp.ones(5)), shapes=("b, 5", None),
                    vjp_order=2)  # fmt: skip
    return {
        "source": lambda x, s: _scaled(W, x, s),
        "h": h,
        "h.apply": lambda x, s: h.apply(h.params, x, s),
        "m": sm.load(art.path),
    }


# the Hybrid's compile on each call is JAX's own jit: its cases under -m slow (~10 s in all)
MODELS = [
    pytest.param("h", marks=pytest.mark.slow),
    pytest.param("h.apply", marks=pytest.mark.slow),
    "m",
]
_MESH = Mesh(np.array(jax.devices()[:4]), ("d",))


def _sharded(f, check_vma=True, out=None):
    out = P("d") if out is None else out
    return jax.shard_map(f, mesh=_MESH, in_specs=(P("d"), P()), out_specs=out, check_vma=check_vma)


def test_shard_map_of_a_loaded_model_refuses_a_replicated_output_as_the_source(models):
    """Exported.call types its outputs as the same on every device, so jax.shard_map with
    out_specs=P() took device 0's rows for the whole batch (a (2, 3) answer for 8 rows), where
    the source's outputs are refused as varying; its outputs vary as its inputs do now."""
    m, source = models["m"], models["source"]
    x, s = _xs(8, 5), _xs(5, seed=2)
    chex.assert_trees_all_close(_sharded(m)(x, s), source(x, s), **TOL)
    with pytest.raises(ValueError, match=r"out_specs is P\(\) which implies that the"):
        _sharded(m, out=P())(x, s)  # JAX's refusal, as of the source (the slow test below)


@pytest.mark.slow  # two grads through shard_map (~1 s)
def test_grad_through_shard_map_of_a_loaded_model_wrt_sharded_and_replicated_inputs(models):
    """jax.grad through jax.shard_map of m raised JAX's raw ValueError ("Custom VJP bwd rule
    must produce an output with the same type as the args tuple ... the manual axis types do
    not match"); a replicated input's cotangent is summed over the devices, as the source's."""
    m, source = models["m"], models["source"]
    x, s = _xs(8, 5), _xs(5, seed=2)

    def loss(f):
        return lambda x, s: (_sharded(f)(x, s) ** 2).sum()

    got = jax.grad(loss(m), argnums=(0, 1))(x, s)
    chex.assert_trees_all_close(got, jax.grad(loss(source), argnums=(0, 1))(x, s), **TOL)


@pytest.mark.slow  # shard_map's matrix (~15 s): CI runs it with `-m slow`
@pytest.mark.parametrize("name", MODELS)
def test_shard_map_with_grad_vmap_and_a_hessian_inside_as_the_source(models, name):
    f, source = models[name], models["source"]
    x, s = _xs(8, 5), _xs(5, seed=2)
    for check_vma in (True, False):
        chex.assert_trees_all_close(_sharded(f, check_vma)(x, s), source(x, s), **TOL)
    chex.assert_trees_all_close(jax.jit(_sharded(f))(x, s), source(x, s), **TOL)
    with pytest.raises(ValueError, match=r"out_specs is P\(\) which implies that the"):
        _sharded(f, out=P())(x, s)
    mean = _sharded(lambda x, s: jax.lax.pmean(f(x, s), "d"), out=P())  # one, replicated
    chex.assert_trees_all_close(mean(x, s), source(x, s).reshape(4, 2, 3).mean(0), **TOL)

    def loss(f, check_vma=True):
        return lambda x, s: (_sharded(f, check_vma)(x, s) ** 2).sum()

    want = jax.grad(loss(source), argnums=(0, 1))(x, s)
    for check_vma in (True, False):
        got = jax.grad(loss(f, check_vma), argnums=(0, 1))(x, s)
        chex.assert_trees_all_close(got, want, **TOL)
    got = jax.jit(jax.grad(loss(f), argnums=1))(x, s)  # the replicated one alone
    chex.assert_trees_all_close(got, want[1], **TOL)

    def per_example(f):  # vmap inside: merged into the batch on each device
        return _sharded(jax.vmap(lambda x, s: f(x[None], s)[0], in_axes=(0, None)))

    chex.assert_trees_all_close(per_example(f)(x, s), source(x, s), **TOL)
    got = jax.grad(lambda s: per_example(f)(x, s).sum())(s)
    chex.assert_trees_all_close(got, jax.grad(lambda s: source(x, s).sum())(s), **TOL)

    def sum_of(f):
        return lambda s: _sharded(f)(x, s).sum()

    got = jax.jacrev(jax.jacrev(sum_of(f)))(s)  # the VJP module of order 2, on each device
    chex.assert_trees_all_close(got, jax.hessian(sum_of(source))(s), **TOL)


@pytest.mark.slow  # (~0.3-1 s each)
@pytest.mark.parametrize("name", MODELS)
def test_pmap_and_grad_of_pmap(models, name):
    f, source = models[name], models["source"]
    x, s = _xs(4, 2, 5), _xs(5, seed=2)
    pmapped = jax.pmap(f, in_axes=(0, None))
    chex.assert_trees_all_close(pmapped(x, s), jax.vmap(source, in_axes=(0, None))(x, s), **TOL)
    got = jax.grad(lambda s: pmapped(x, s).sum())(s)
    want = jax.grad(lambda s: source(x.reshape(8, 5), s).sum())(s)
    chex.assert_trees_all_close(got, want, **TOL)


def _loss(f):
    return lambda x, s: (jnp.sin(f(x, s)) ** 2).sum()


_AD = {  # each a function of (f, x, s), over the model f and over the source alike
    "checkpoint": lambda f, x, s: jax.grad(_loss(jax.checkpoint(f)), argnums=(0, 1))(x, s),
    "remat-policy-jit": lambda f, x, s: jax.jit(jax.grad(_loss(jax.remat(
        f, policy=jax.checkpoint_policies.nothing_saveable))))(x, s),
    "vjp-has-aux": lambda f, x, s: jax.vjp(lambda x: (f(x, s), f(x, s).sum()), x,
                                           has_aux=True)[1:][::-1],  # (aux, vjp_fn) to compare
    "value-and-grad-argnums": lambda f, x, s: jax.value_and_grad(
        lambda a, b: (f(a, s) * f(b, s)).sum(), argnums=(0, 1))(x, 2 * x),
    "grad-wrt-the-unbatched-input": lambda f, x, s: jax.grad(_loss(f), argnums=1)(x, s),
    "vmap-of-checkpoint-grad": lambda f, x, s: jax.vmap(
        jax.grad(_loss(jax.checkpoint(f))), in_axes=(0, None))(x.reshape(2, 2, 5), s),
    "fori-loop-grad": lambda f, x, s: jax.grad(lambda x: jax.lax.fori_loop(
        0, 3, lambda i, c: c + f(x * i, s).sum(), 0.0))(x),
    "while-loop": lambda f, x, s: jax.lax.while_loop(
        lambda c: c[0] < 3, lambda c: (c[0] + 1, f(c[1], s) @ W.T), (0, x)),
    "scan-grad": lambda f, x, s: jax.grad(lambda xs: jax.lax.scan(
        lambda c, x: (c + _loss(f)(x, s), None), 0.0, xs)[0])(x.reshape(2, 2, 5)),
    "ensure-compile-time-eval": lambda f, x, s: jax.jit(_ensured(f, x, s))(1.0),
    "donate": lambda f, x, s: jax.jit(lambda x: x + f(x, s) @ W.T, donate_argnums=0)(x + 0),
}  # fmt: skip


def _ensured(f, x, s):
    def g(c):
        with jax.ensure_compile_time_eval():
            y = f(x, s)  # a constant of the jit
        return y + c

    return g


def _vjp_compared(out):
    aux, vjp = out if isinstance(out, tuple) and callable(out[1]) else (None, None)
    return out if vjp is None else (aux, vjp(jnp.ones((4, 3))))


_SLOW_AD = {"checkpoint", "vmap-of-checkpoint-grad"}  # (~0.4-0.7 s each)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(
    "how", [pytest.param(k, marks=pytest.mark.slow) if k in _SLOW_AD else k for k in sorted(_AD)]
)
def test_differentiation_and_loops_as_the_source(models, name, how):
    x, s = _xs(4, 5), _xs(5, seed=2)
    got = _vjp_compared(_AD[how](models[name], x, s))
    want = _vjp_compared(_AD[how](models["source"], x, s))
    chex.assert_trees_all_close(got, want, **TOL)


def _over(xs):  # nested vmaps as researchers write them, over (2, 3, 4, 5) inputs
    return {
        "out_axes-1-2": lambda f: jax.vmap(jax.vmap(f, out_axes=1), out_axes=2)(xs),
        "out_axes-minus-1": lambda f: jax.vmap(f, out_axes=-1)(xs[0]),
        "in_axes-minus-1": lambda f: jax.vmap(f, in_axes=-1)(jnp.moveaxis(xs[0], 0, -1)),
        "spmd_axis_name": lambda f: jax.vmap(f, spmd_axis_name="d")(xs[0]),
        "in_axes-dict": lambda f: jax.vmap(
            lambda d: f(d["x"]) + d["c"], in_axes=({"x": 1, "c": None},)
        )({"x": jnp.moveaxis(xs[0], 0, 1), "c": 1.0}),
        "axis_size-unmapped": lambda f: jax.vmap(f, in_axes=None, axis_size=3)(xs[0, 0]),
        "vmap-of-scan": lambda f: jax.vmap(
            lambda x: jax.lax.scan(lambda c, r: (c, f(r[None])[0]), 0.0, x)[1]
        )(xs[0]),
        "no-example": lambda f: jax.vmap(jax.vmap(f))(xs[:, :0]),
        "grad-of-no-example": lambda f: jax.grad(lambda x: jax.vmap(f)(x).sum())(xs[0, :0]),
    }


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("how", sorted(_over(_xs(1))))
def test_nested_vmap_as_the_source(models, name, how):
    s, xs = _xs(5, seed=2), _xs(2, 3, 4, 5)
    f, source = models[name], models["source"]
    got = _over(xs)[how](lambda x: f(x, s))
    want = _over(xs)[how](lambda x: source(x, s))
    assert got.shape == want.shape and got.dtype == want.dtype
    chex.assert_trees_all_close(got, want, **TOL)


@pytest.mark.parametrize("name", MODELS)
def test_custom_vjp_and_custom_jvp_functions_that_call_the_model(models, name):
    f, source = models[name], models["source"]
    x, s = _xs(4, 5), _xs(5, seed=2)

    def clipped(f):  # a custom_vjp whose forward and backward both call the model
        @jax.custom_vjp
        def g(x):
            return f(x, s)

        def backward(x, ct):
            return (jnp.clip(jax.vjp(lambda x: f(x, s), x)[1](ct)[0], -0.1, 0.1),)

        g.defvjp(lambda x: (f(x, s), x), backward)
        return g

    def straight_through(f):  # a custom_jvp: its tangent, a linear map of its own
        @jax.custom_jvp
        def g(x):
            return f(x, s)

        g.defjvp(lambda p, t: (f(p[0], s), t[0] @ W))
        return g

    chex.assert_trees_all_close(
        jax.grad(lambda x: clipped(f)(x).sum())(x),
        jax.grad(lambda x: clipped(source)(x).sum())(x), **TOL,
    )  # fmt: skip
    for transform in (
        lambda g: jax.jvp(g, (x,), (x,)),
        lambda g: jax.grad(lambda x: g(x).sum())(x),
    ):
        got, want = transform(straight_through(f)), transform(straight_through(source))
        chex.assert_trees_all_close(got, want, **TOL)


@pytest.mark.slow  # (~1-6 s)
def test_linear_transpose_of_a_loaded_linear_model_is_jax_s_refusal_and_vjp_transposes(tmp_path):
    """jax.linear_transpose cannot see inside a custom_vjp (JAX's NotImplementedError, as for
    its own); jax.vjp at any point is the transpose of a linear model; h's is JAX's own."""
    h = sm.hybridize(lambda p, x: x @ p, W)
    m = sm.load(sm.export(h, tmp_path / "m", example=jnp.ones((2, 5)), vjp_order=1).path)
    x, ct = _xs(4, 5), _xs(4, 3, seed=2)
    want = jax.linear_transpose(lambda x: x @ W, x)(ct)
    for f in (h, lambda x: h.apply(h.params, x)):
        chex.assert_trees_all_close(jax.linear_transpose(f, x)(ct), want, **TOL)
    chex.assert_trees_all_close(jax.vjp(m, jnp.zeros_like(x))[1](ct), want, **TOL)
    with pytest.raises(NotImplementedError, match=r"Transpose rule .* for 'custom_vjp_call'"):
        jax.linear_transpose(m, x)(ct)


@pytest.mark.slow  # (~1-6 s)
def test_other_float_inputs_and_x64_mode(models):
    """h takes bfloat16 and float16 as flax does (float32 out); m refuses them by name; in x64
    mode float32 inputs, jax.grad and Python scalars give the float32 answers."""
    x, s = _xs(4, 5), _xs(5, seed=2)
    source, h, m = models["source"], models["h"], models["m"]
    for dtype in (jnp.bfloat16, jnp.float16):
        got, want = h(x.astype(dtype), s), source(x.astype(dtype), s)
        assert got.dtype == want.dtype
        chex.assert_trees_all_close(got, want, **TOL)
        with pytest.raises(sm.SignatureError, match=rf"dtype {jnp.dtype(dtype)} .*astype"):
            m(x.astype(dtype), s)
    want, grad = source(x, s), jax.grad(_loss(source))(x, s)
    with jax.enable_x64(True):
        for f in (h, m):
            assert f(x, s).dtype == jnp.float32
            chex.assert_trees_all_close(f(x, s), want, **TOL)
            chex.assert_trees_all_close(jax.grad(_loss(f))(x, s), grad, **TOL)
            got = jax.jit(lambda x, k, f=f: f(x * k, s))(x, 2.0)
            chex.assert_trees_all_close(got, source(2 * x, s), **TOL)


class _Trained(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(8)(x))
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(3)(jax.nn.relu(x))


@pytest.mark.slow  # (~1-6 s)
def test_grad_through_batchnorm_and_dropout_in_train_mode_as_flax_apply():
    """h.apply of a linen model in train mode under jax.grad(has_aux=True): the loss, its
    gradient and the new batch statistics of flax's own apply with the key h holds (split
    once, as each call splits it); h.apply holds nothing, so twice is the same dropout."""
    net, x, key = _Trained(), _xs(6, 5), jax.random.key(42)
    variables = net.init(jax.random.key(0), x)
    h = sm.hybridize(net, variables, rngs=key)
    dropout = jax.random.split(key)[1]

    def loss(apply):
        def f(params, x):
            out, state = apply(params, x)
            return (out**2).sum(), state["batch_stats"]

        return f

    def flax_apply(params, x):
        return net.apply({**params, "batch_stats": variables["batch_stats"]}, x, train=True,
                         rngs={"dropout": dropout}, mutable=["batch_stats"])  # fmt: skip

    def h_apply(params, x):
        return h.apply(params, x, train=True)

    for transform in (
        lambda f: jax.value_and_grad(f, has_aux=True)(h.params, x),
        lambda f: jax.jit(jax.grad(f, argnums=(0, 1), has_aux=True))(h.params, x),
        lambda f: jax.vmap(f, in_axes=(None, 0))(h.params, x.reshape(2, 3, 5)),
    ):
        got, want = transform(loss(h_apply)), transform(loss(flax_apply))
        chex.assert_trees_all_close(got, want, **TOL)
    chex.assert_trees_all_close(h_apply(h.params, x)[0], h_apply(h.params, x)[0])
    assert not np.allclose(h_apply(h.params, x)[0], h.apply(h.params, x)[0])  # eval: no dropout


def test_a_loaded_model_exported_again_with_a_symbolic_batch(models, tmp_path):
    """jax.export (and sm.export) of a function calling m traces it with a symbolic batch, and
    m's checks compared it with numbers: JAX's InconclusiveDimensionOperation ("Symbolic
    dimension comparison 'b' > '2147483647' is inconclusive"), which sm.export took for the
    function's own use of the batch ("the function needs a concrete value of the symbolic
    batch"); under jax.vmap the merged batch's ('2*n' <= '2147483647'), as an ArtifactError."""
    m, source = models["m"], models["source"]
    (b,) = jax.export.symbolic_shape("b")
    x, s = _xs(4, 5), _xs(5, seed=2)
    specs = jax.ShapeDtypeStruct((b, 5), jnp.float32), jax.ShapeDtypeStruct((5,), jnp.float32)
    again = jax.export.export(jax.jit(m))(*specs)
    chex.assert_trees_all_close(again.call(x, s), source(x, s), **TOL)


@pytest.mark.slow  # a jax.export and an sm.export (~1 s)
def test_vmap_of_a_loaded_model_and_a_hybrid_calling_it_exported_again(models, tmp_path):
    m, source = models["m"], models["source"]
    (b,) = jax.export.symbolic_shape("b")
    x, s = _xs(4, 5), _xs(5, seed=2)
    mapped = jax.ShapeDtypeStruct((b, 2, 5), jnp.float32), jax.ShapeDtypeStruct((5,), jnp.float32)
    again = jax.export.export(jax.jit(jax.vmap(m, in_axes=(0, None))))(*mapped)
    want = jax.vmap(source, in_axes=(0, None))(x.reshape(2, 2, 5), s)
    chex.assert_trees_all_close(again.call(x.reshape(2, 2, 5), s), want, **TOL)
    outer = sm.hybridize(lambda p, x, s: m(x, s) * p, jnp.float32(2))
    art = sm.export(outer, tmp_path / "again", example=(x, s), shapes=("b, 5", None))
    chex.assert_trees_all_close(sm.load(art.path)(x, s), 2 * source(x, s), **TOL)


@pytest.mark.slow  # an export and two jax.exports (~1.5 s)
def test_vmap_of_a_bounded_model_exported_again_runs_one_example_at_a_time(tmp_path):
    """A symbolic merged batch may break the bound (b <= 3) as it runs: vmap maps one call per
    example then, each checked by the artifact as it runs; without a bound it merges."""
    h = sm.hybridize(lambda p, x: jnp.tanh(x @ p), W)
    art = sm.export(h, tmp_path / "m", example=jnp.ones((2, 5)), shapes=("b, 5",),
                    constraints=("b <= 3",))  # fmt: skip
    m, (n,) = sm.load(art.path), jax.export.symbolic_shape("n")
    xs = _xs(4, 2, 5)
    for shape in ((n, 2, 5), (4, n, 5)):
        again = jax.export.export(jax.jit(jax.vmap(m)))(jax.ShapeDtypeStruct(shape, jnp.float32))
        assert "stablehlo.while" in again.mlir_module()  # one example at a time
        chex.assert_trees_all_close(again.call(xs), jax.vmap(h)(xs), **TOL)


@pytest.mark.slow  # (~0.6-2 s)
def test_ensembles_and_per_example_gradients_over_h_apply():
    """jax.vmap of h.apply over stacked params (an ensemble) and of jax.grad over examples
    (per-example gradients, as DP-SGD takes them), as of flax's apply."""
    net, x = sm.mlp((8, 3)), _xs(6, 5)
    variables = net.init(jax.random.key(0), x)
    h = sm.hybridize(net, variables)
    stacked = jax.vmap(lambda k: net.init(k, x))(jax.random.split(jax.random.key(5), 3))

    def loss(apply):
        return lambda p, x: (apply(p, x[None]) ** 2).sum()

    def both(apply, params):
        ensemble = jax.vmap(apply, in_axes=(0, None))(stacked, x)
        return ensemble, jax.jit(jax.vmap(jax.grad(loss(apply)), in_axes=(None, 0)))(params, x)

    chex.assert_trees_all_close(both(h.apply, h.params), both(net.apply, variables), **TOL)
