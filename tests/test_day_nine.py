"""A researcher's day nine (session 64, Part E): the idioms of a bigger model, as JAX's and
Flax's documentation writes them, around a Hybrid and a loaded artifact.

Mixed precision (linen's and nnx's ``dtype=``/``param_dtype=``, a ``jmp`` policy with its
dynamic loss scale), rematerialisation (``nn.remat``, ``nnx.remat``, ``jax.checkpoint`` with a
policy), a stack of blocks scanned (``nn.scan``, ``nnx.scan`` over ``nnx.vmap``'s blocks),
``jax.lax.scan``/``fori_loop``/``while_loop`` whose body calls ``h`` or the loaded model,
``jax.vmap`` with ``in_axes`` mixing ``None`` and ``0`` and ``out_axes`` other than 0,
``jax.jacfwd``/``jax.hessian`` of a loaded model, an artifact in an optax loss under
``jax.value_and_grad(has_aux=True)``, and ``flax.struct.dataclass`` /
``jax.tree_util.register_dataclass`` trees as inputs, outputs and params. Each that holds is
compared with the plain JAX/Flax answer (compiled, as a Hybrid compiles: bfloat16 rounds
otherwise op by op).

One stumble: a params tree's static field (``flax.struct.field(pytree_node=False)``,
``register_dataclass``'s ``meta_fields``), which jit bakes into the program, was silently
ignored by a loaded model's ``m.apply``: it answered with the field the artifact was exported
at. It is refused now, naming both values.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, struct

import symjax_mlp as sm

X = jax.random.normal(jax.random.key(9), (4, 3), jnp.float32)
_Y = jnp.array([0, 1, 2, 1])


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.tanh(nn.Dense(3)(nn.relu(nn.Dense(8)(x))))


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    """The Flax model, its variables, its Hybrid and its artifact (vjp_order=2), loaded."""
    model = _Net()
    variables = model.init(jax.random.key(1), X)
    h = sm.hybridize(model, variables)
    path = tmp_path_factory.mktemp("day9") / "net"
    loaded = sm.load(sm.export(h, path, example=X, batch="b", vjp_order=2).path)
    return model, variables, h, loaded


# -- the stumble: a params tree's static field ---------------------------------------------------
@struct.dataclass
class _Weights:
    w: jax.Array
    b: jax.Array
    scale: float = struct.field(pytree_node=False, default=2.0)


def _scaled(p: _Weights, x):
    return jnp.tanh(x @ p.w + p.b) * p.scale


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w"], meta_fields=["act"])
@dataclasses.dataclass
class _Act:
    w: jax.Array
    act: str


def _act(p: _Act, x):
    return getattr(jnp, p.act)(x @ p.w)


def test_a_loaded_models_apply_refuses_params_of_another_static_field(tmp_path):
    """``m.apply(params, x)`` over a ``flax.struct.dataclass`` whose static field differed from
    the exported one answered with the exported one, silently (``scale=5.0`` gave ``2.0``'s
    answer, where ``h.apply`` retraces): jit bakes a static field into the program, and load
    matched params by path only. Another field is a SignatureError naming both (the same one
    runs: the slow test below)."""
    p = _Weights(jnp.full((3, 2), 0.3), jnp.zeros(2), 2.0)
    path = sm.export(sm.hybridize(_scaled, p), tmp_path / "w", example=X, batch=None).path
    with pytest.raises(sm.SignatureError, match=r"params.scale=5.0.*traced at params.scale=2.0"):
        sm.load(path).apply(_Weights(p.w, p.b, 5.0), X)


@struct.dataclass
class _Activated:
    w: jax.Array
    act: object = struct.field(pytree_node=False)


def _activated(p: _Activated, x):
    return p.act(x @ p.w)


def test_a_loaded_models_apply_refuses_a_lambda_static_field_it_cannot_tell_apart(tmp_path):
    """A static field holding a lambda is recorded as ``<function <lambda>>`` (no address: the
    same bytes run to run), so another lambda matched it and ``m.apply`` answered with the
    exported one's, silently (x * 2 for x * 3). Such a field is refused; params by path run."""
    p = _Activated(jnp.full((3, 2), 0.3), lambda v: v * 2)
    path = sm.export(sm.hybridize(_activated, p), tmp_path / "w", example=X, batch=None).path
    m = sm.load(path)
    with pytest.raises(
        sm.SignatureError, match=r"params.act=<function .*<lambda>>.*A lambda or a function"
    ):
        m.apply(_Activated(p.w, lambda v: v * 3), X)
    np.testing.assert_allclose(m.apply(m.params, X), _activated(p, X), rtol=1e-6)


@pytest.mark.slow
def test_static_fields_are_recorded_and_checked_under_grad_and_vmap(tmp_path):
    """The manifest records a params tree's static fields by path (``register_dataclass``'s
    ``meta_fields`` too: ``act='sin'`` ran the exported ``tanh``); ``jax.grad`` with respect
    to the dataclass returns one, ``jax.vmap`` over another field is refused, ``h.apply``
    retraces at it, and params by their names run as exported."""
    p = _Weights(jnp.full((3, 2), 0.3), jnp.zeros(2), 2.0)
    h = sm.hybridize(_scaled, p)
    m = sm.load(sm.export(h, tmp_path / "w", example=X, batch="b", vjp_order=1).path)
    static = json.loads((tmp_path / "w" / "manifest.json").read_text())["static"]
    assert static == {"params.scale": "2.0"}
    other = _Weights(2 * p.w, p.b + 1, 2.0)  # other weights, the same field: runs
    np.testing.assert_allclose(m.apply(other, X), jax.jit(_scaled)(other, X), rtol=1e-6)
    grads = jax.grad(lambda q: m.apply(q, X).sum())(p)
    assert type(grads) is _Weights
    chex.assert_trees_all_close(grads, jax.grad(lambda q: _scaled(q, X).sum())(p), rtol=1e-5)
    five = _Weights(p.w, p.b, 5.0)
    np.testing.assert_allclose(h.apply(five, X), jax.jit(_scaled)(five, X), rtol=1e-6)
    with pytest.raises(sm.SignatureError, match=r"params\.scale=5\.0"):
        jax.vmap(m.apply, in_axes=(0, None))(jax.tree.map(lambda a: a[None], five), X)
    np.testing.assert_allclose(m.apply(m.params, X), h(X), rtol=1e-6)
    q = _Act(jnp.ones((3, 2)), "tanh")
    m = sm.load(sm.export(sm.hybridize(_act, q), tmp_path / "a", example=X).path)
    np.testing.assert_allclose(m.apply(_Act(2 * q.w, "tanh"), X), _act(_Act(2 * q.w, "tanh"), X))
    with pytest.raises(sm.SignatureError, match=r"params.act='sin'.*traced at params.act='tanh'"):
        m.apply(_Act(q.w, "sin"), X)


# -- mixed precision ---------------------------------------------------------------------------
class _Bf16(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x))
        return nn.Dense(2, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x)


@pytest.mark.slow
def test_linen_bfloat16_compute_and_params_through_export_and_grad(tmp_path):
    """Held: ``dtype=``/``param_dtype=`` bfloat16, the outputs bfloat16 and equal to Flax's;
    the loaded model's grads with respect to the input and to the mixed-dtype params."""
    model = _Bf16()
    v = model.init(jax.random.key(2), X)
    ref = jax.jit(model.apply)(v, X)
    h = sm.hybridize(model, v)
    m = sm.load(sm.export(h, tmp_path / "bf", example=X, batch="b", vjp_order=1).path)
    for out in (h(X), m(X)):
        assert out.dtype == jnp.bfloat16
        np.testing.assert_array_equal(out.astype(jnp.float32), ref.astype(jnp.float32))

    def loss(apply, p, x):
        return apply(p, x).astype(jnp.float32).sum()

    want = jax.jit(jax.grad(functools.partial(loss, model.apply), argnums=(0, 1)))(v, X)
    got = jax.jit(jax.grad(functools.partial(loss, m.apply), argnums=(0, 1)))(v, X)
    assert jax.tree.map(lambda a: a.dtype, got[0]) == jax.tree.map(lambda a: a.dtype, want[0])
    chex.assert_trees_all_close(got, want, rtol=2e-2, atol=1e-2)


@pytest.mark.slow
def test_nnx_bfloat16_layers_through_export(tmp_path):
    """Held: nnx's ``dtype=``/``param_dtype=`` per layer, the params kept in their dtypes."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(3, 8, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
            self.b = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    module = Net(nnx.Rngs(0))
    ref = nnx.jit(lambda mod, x: mod(x))(module, X)
    h = sm.hybridize(module)
    assert h.params["a"]["kernel"].dtype == jnp.bfloat16
    m = sm.load(sm.export(h, tmp_path / "nnx", example=X, batch="b").path)
    np.testing.assert_array_equal(h(X), ref)
    np.testing.assert_array_equal(m(X), ref)


@pytest.mark.slow
def test_a_jmp_policy_and_its_dynamic_loss_scale_through_h_and_a_loaded_model(tmp_path):
    """Held: jmp's ``params=float32,compute=bfloat16,output=float32`` policy in the model, its
    ``DynamicLossScale`` around a loss of ``h.apply`` and ``m.apply``: the unscaled grads equal
    those of the plain function, compiled."""
    import jmp  # (imports nothing that touches jax.config)

    policy = jmp.get_policy("params=float32,compute=bfloat16,output=float32")

    def forward(params, x):
        p, x = policy.cast_to_compute((params, x))
        return policy.cast_to_output(jnp.tanh(x @ p["w"] + p["b"]))

    params = {"w": jnp.full((3, 5), 0.1), "b": jnp.zeros(5)}
    h = sm.hybridize(forward, params)
    m = sm.load(sm.export(h, tmp_path / "jmp", example=X, vjp_order=1).path)
    scale = jmp.DynamicLossScale(jnp.float32(2**15))

    def grads(apply):
        g = jax.jit(jax.grad(lambda p: scale.scale(jnp.mean(apply(p, X) ** 2))))(params)
        return scale.unscale(g), jmp.all_finite(g)

    want = grads(forward)
    for apply in (h.apply, m.apply):
        chex.assert_trees_all_equal(grads(apply), want)
    assert m(X).dtype == jnp.float32
    np.testing.assert_array_equal(m(X), jax.jit(forward)(params, X))


# -- rematerialisation and scanned layers -------------------------------------------------------
class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        return nn.tanh(nn.Dense(3)(x)), None


class _Remat(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.remat(_Block)()(x)[0]
        return x


class _Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            nn.remat(_Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=4
        )
        return stack()(x, None)[0]


@pytest.mark.slow
@pytest.mark.parametrize("model", [_Remat(), _Scanned()], ids=["nn.remat", "nn.scan"])
def test_remat_and_scanned_linen_blocks_export_and_differentiate(model, tmp_path):
    """Held: ``nn.remat`` blocks and ``nn.scan`` over a stack of them (params stacked on axis
    0), through ``h.apply``'s grads and the loaded model's, equal to Flax's. A scanned stack's
    artifact holds a loop, which load refuses from a stranger (README) and takes with
    ``trust=True``."""
    v = model.init(jax.random.key(3), X)
    h = sm.hybridize(model, v)
    path = sm.export(h, tmp_path / "m", example=X, batch="b", vjp_order=1).path
    if isinstance(model, _Scanned):
        with pytest.raises(sm.ArtifactError, match="dynamic_slice"):
            sm.load(path)
    m = sm.load(path, trust=True)
    ref = jax.jit(model.apply)(v, X)
    np.testing.assert_allclose(h(X), ref, rtol=1e-6)
    np.testing.assert_allclose(m(X), ref, rtol=1e-6)
    want = jax.jit(jax.grad(lambda p: model.apply(p, X).sum()))(v)
    chex.assert_trees_all_close(jax.grad(lambda p: h.apply(p, X).sum())(v), want, rtol=1e-5)
    chex.assert_trees_all_close(jax.grad(lambda p: m.apply(p, X).sum())(v), want, rtol=1e-5)


@pytest.mark.slow
def test_nnx_scan_over_vmapped_blocks_with_nnx_remat(tmp_path):
    """Held: Flax's "scan over layers" (``nnx.vmap`` makes the blocks, ``nnx.scan`` of an
    ``nnx.remat`` step runs them), hybridized, its grads and its artifact equal nnx's."""

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 3, rngs=rngs)

        def __call__(self, x):
            return nnx.tanh(self.lin(x))

    class Stack(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=4)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Block(rngs)

            self.blocks = make(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            @nnx.remat
            def step(x, block):
                return block(x)

            return step(x, self.blocks)

    module = Stack(nnx.Rngs(0))
    ref = nnx.jit(lambda mod, x: mod(x))(module, X)
    h = sm.hybridize(module)
    assert h.params["blocks"]["lin"]["kernel"].shape == (4, 3, 3)
    np.testing.assert_allclose(h(X), ref, rtol=1e-6)
    want = nnx.grad(lambda mod: mod(X).sum())(module)
    got = jax.grad(lambda p: h.apply(p, X).sum())(h.params)
    chex.assert_trees_all_close(jax.tree.leaves(got), jax.tree.leaves(want), rtol=1e-5)
    path = sm.export(h, tmp_path / "stack", example=X, batch="b", vjp_order=1).path
    m = sm.load(path, trust=True)
    np.testing.assert_allclose(m(X), ref, rtol=1e-6)
    x_grad = nnx.grad(lambda x, mod: mod(x).sum())(X, module)
    np.testing.assert_allclose(jax.grad(lambda x: m(x).sum())(X), x_grad, rtol=1e-5)


@pytest.mark.slow
def test_jax_checkpoint_around_h_and_a_loaded_model(net):
    """Held: ``jax.checkpoint`` (with ``nothing_saveable``) around a call of ``h``, of
    ``h.apply`` and of the loaded model, under ``jax.grad`` and ``jax.jit``."""
    model, v, h, m = net
    want = jax.grad(lambda x: model.apply(v, x).sum())(X)
    policy = jax.checkpoint_policies.nothing_saveable
    for call in (h, functools.partial(h.apply, v), m):
        f = jax.checkpoint(lambda x, call=call: call(x).sum(), policy=policy)
        np.testing.assert_allclose(jax.grad(f)(X), want, rtol=1e-5)
        np.testing.assert_allclose(jax.jit(jax.grad(f))(X), want, rtol=1e-5)


# -- loops, vmap and derivatives ----------------------------------------------------------------
@pytest.mark.slow
def test_lax_scan_fori_loop_and_while_loop_bodies_call_h_and_the_loaded_model(net):
    """Held: each loop's body calls ``h``, ``h.apply`` or the loaded model, as it would
    ``model.apply``; the scan's grads with respect to its carry and to the params too."""
    model, v, h, m = net

    def scanned(f, x):
        return jax.lax.scan(lambda c, _: (f(c), c.sum()), x, None, length=3)

    want = jax.jit(functools.partial(scanned, functools.partial(model.apply, v)))(X)
    for f in (h, functools.partial(h.apply, v), m):
        chex.assert_trees_all_close(scanned(f, X), want, rtol=1e-5)
        chex.assert_trees_all_close(jax.jit(functools.partial(scanned, f))(X), want, rtol=1e-5)
    n = jnp.int32(4)
    loop = jax.jit(lambda n: jax.lax.fori_loop(0, n, lambda i, c: model.apply(v, c) * i, X))(n)
    for f in (h, m):
        got = jax.jit(lambda n, f=f: jax.lax.fori_loop(0, n, lambda i, c: f(c) * i, X))(n)
        np.testing.assert_allclose(got, loop, rtol=1e-5)
        got = jax.lax.while_loop(lambda c: c[0] < 3, lambda c, f=f: (c[0] + 1, f(c[1])), (0, X))[1]
        np.testing.assert_allclose(got, want[0], rtol=1e-5)
    grad = jax.grad(lambda x: scanned(functools.partial(model.apply, v), x)[0].sum())(X)
    np.testing.assert_allclose(jax.grad(lambda x: scanned(m, x)[0].sum())(X), grad, rtol=1e-4)

    def by_params(apply, p):
        return jax.lax.scan(lambda c, _: (apply(p, c), None), X, None, length=3)[0].sum()

    want_p = jax.grad(functools.partial(by_params, model.apply))(v)
    for apply in (h.apply, m.apply):
        got = jax.grad(functools.partial(by_params, apply))(v)
        chex.assert_trees_all_close(got, want_p, rtol=1e-4)


@pytest.mark.slow
def test_vmap_in_axes_mixing_none_and_0_with_out_axes_not_0(net):
    """Held: ``jax.vmap`` of ``m.apply``/``h.apply`` over an ensemble (``in_axes=(0, None)``),
    over inputs (``(None, 0)``), over both, over one weight only (a tree of ``in_axes``), with
    ``out_axes`` 1, 2 and -1; of the loaded model with ``in_axes=1``."""
    model, v, h, m = net
    xs = jnp.stack([X, 2 * X])  # (2, 4, 3)
    ens = jax.tree.map(lambda w: jnp.stack([w, 2 * w]), v)
    one = jax.tree.map(lambda _: None, v)
    one["params"]["Dense_1"]["kernel"] = 0
    some = jax.tree.map(lambda w: w, v)
    some["params"]["Dense_1"]["kernel"] = ens["params"]["Dense_1"]["kernel"]
    cases = [((0, None), 1, ens, X), ((None, 0), 1, v, xs), ((0, 0), 2, ens, xs),
             ((one, None), -1, some, X), ((None, 1), 1, v, jnp.swapaxes(xs, 0, 1))]  # fmt: skip
    for in_axes, out_axes, p, x in cases:
        want = jax.vmap(model.apply, in_axes=in_axes, out_axes=out_axes)(p, x)
        for apply in (h.apply, m.apply):
            got = jax.vmap(apply, in_axes=in_axes, out_axes=out_axes)(p, x)
            np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=str(in_axes))
    want = jax.vmap(functools.partial(model.apply, v), in_axes=1, out_axes=2)(xs)
    np.testing.assert_allclose(jax.vmap(m, in_axes=1, out_axes=2)(xs), want, rtol=1e-5)


@pytest.mark.slow
def test_vmap_of_a_two_input_two_output_artifact_with_mixed_axes(tmp_path):
    """Held: an artifact of two inputs and two outputs under ``jax.vmap`` with ``in_axes``
    ``(0, None)``, ``(None, 0)``, ``(0, 0)``, ``(1, None)`` and per-output ``out_axes``; its
    ``m.apply`` with the params unmapped; ``jax.grad`` through one of them."""

    def f(p, x, y):
        z = jnp.tanh(x @ p["w"])
        return z * y[:, None], (z**2).sum(-1)

    params, y = {"w": jnp.full((3, 2), 0.2)}, jnp.arange(4.0)
    h = sm.hybridize(f, params)
    m = sm.load(sm.export(h, tmp_path / "two", example=(X, y), batch="b", vjp_order=1).path)
    xs, ys = jnp.stack([X, 2 * X, 3 * X]), jnp.stack([y, y + 1, y + 2])
    plain = functools.partial(f, params)
    cases = [((0, None), (1, 0), xs, y), ((None, 0), 1, X, ys), ((0, 0), (2, 1), xs, ys),
             ((1, None), -1, jnp.swapaxes(xs, 0, 1), y)]  # fmt: skip
    for in_axes, out_axes, a, b in cases:
        want = jax.jit(jax.vmap(plain, in_axes=in_axes, out_axes=out_axes))(a, b)
        for g in (h, m, functools.partial(m.apply, params)):
            got = jax.vmap(g, in_axes=in_axes, out_axes=out_axes)(a, b)
            chex.assert_trees_all_close(got, want, rtol=1e-5)

    def loss(g, x):
        return jax.vmap(g, in_axes=(0, None), out_axes=(1, 0))(x, y)[0].sum()

    np.testing.assert_allclose(jax.grad(functools.partial(loss, m))(xs),
                               jax.grad(functools.partial(loss, plain))(xs), rtol=1e-5)  # fmt: skip


@pytest.mark.slow
def test_jacfwd_and_hessian_of_a_loaded_model_name_jacrev_which_gives_the_hessian(net):
    """Held: ``jax.jacfwd`` and ``jax.hessian`` of the loaded model are a ConfigError naming
    ``jax.jacrev(jax.jacrev(f))`` (an artifact carries VJPs only, README), which equals
    ``jax.hessian`` of the Flax model; ``jax.hessian`` of ``h`` runs as is."""
    model, v, h, m = net
    x = X[0]
    want = jax.hessian(lambda x: model.apply(v, x).sum())(x)
    for forward in (jax.jacfwd, jax.hessian):
        with pytest.raises(sm.ConfigError, match=r"jax\.jacrev\(jax\.jacrev\(f\)\)"):
            forward(lambda x: m(x).sum())(x)
    got = jax.jacrev(jax.jacrev(lambda x: m(x).sum()))(x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(jax.hessian(lambda x: h(x).sum())(x), want, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_an_artifact_in_an_optax_loss_under_value_and_grad_has_aux(net):
    """Held: three adam steps of a loss of ``m.apply`` returning ``(loss, {logits, acc})``
    through ``jax.value_and_grad(has_aux=True)`` in a jitted step: params, loss and aux equal
    those of ``model.apply``'s and ``h.apply``'s."""
    model, v, h, m = net
    tx = optax.adam(1e-2)

    def loss(p, apply):
        logits = apply(p, X)
        value = optax.softmax_cross_entropy_with_integer_labels(logits, _Y).mean()
        return value, {"logits": logits, "acc": (logits.argmax(-1) == _Y).mean()}

    @functools.partial(jax.jit, static_argnums=2)
    def step(p, opt, apply):
        (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(p, apply)
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt, value, aux

    def run(apply):
        p, opt = v, tx.init(v)
        for _ in range(3):
            p, opt, value, aux = step(p, opt, apply)
        return p, value, aux

    want = run(model.apply)
    for apply in (h.apply, m.apply):
        chex.assert_trees_all_close(run(apply), want, rtol=1e-4, atol=1e-6)


# -- dataclass trees in and out ------------------------------------------------------------------
@struct.dataclass
class _Batch:
    x: jax.Array
    mask: jax.Array
    temperature: float = struct.field(pytree_node=False, default=1.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Out:
    logits: jax.Array
    probs: jax.Array


class _Masked(nn.Module):
    @nn.compact
    def __call__(self, b: _Batch):
        y = jnp.where(b.mask[:, None], nn.Dense(3)(b.x) / b.temperature, 0.0)
        return _Out(y, jax.nn.softmax(y))


@pytest.mark.slow
def test_dataclass_inputs_and_outputs_through_export_as_its_refusal_says(tmp_path):
    """Held: a Hybrid takes a ``flax.struct.dataclass`` batch and returns a
    ``register_dataclass`` output, equal to Flax's; export refuses the tree input with the
    recipe (its leaves by place, the output's leaves), and the recipe's artifact, its output
    unflattened, equals Flax's, its grad too."""
    model = _Masked()
    batch = _Batch(X, jnp.array([True, False, True, True]), 2.0)
    v = model.init(jax.random.key(4), batch)
    want = jax.jit(model.apply)(v, batch)
    h = sm.hybridize(model, v)
    got = h(batch)
    assert type(got) is _Out
    chex.assert_trees_all_close(got, want, rtol=1e-6)
    with pytest.raises(sm.SignatureError, match=r"args\[0\] is a _Batch .*jax.tree.unflatten"):
        sm.export(h, tmp_path / "refused", example=batch)
    leaves, tree = jax.tree.flatten(batch)
    flat = sm.hybridize(
        lambda p, *xs: tuple(jax.tree.leaves(h.apply(p, jax.tree.unflatten(tree, xs)))), h.params
    )
    m = sm.load(sm.export(flat, tmp_path / "m", example=tuple(leaves), vjp_order=1).path)
    out = jax.tree.unflatten(jax.tree.structure(want), m(*leaves))
    chex.assert_trees_all_close(out, want, rtol=1e-6)
    grad = jax.grad(lambda x: model.apply(v, _Batch(x, batch.mask, 2.0)).probs.sum())(X)
    np.testing.assert_allclose(jax.grad(lambda x: m(x, batch.mask)[1].sum())(X), grad, rtol=1e-4)
