"""JAX's transforms composed over the zoo's real models, not a toy: each model's Hybrid (``h``,
``h.apply``) and its loaded artifact (``m``) against the plain model under the same composition.

The models, sizes cut: big_vision's ViT (an ``nn.scan`` of ``nn.remat`` blocks, a MAP head) and
MLP-Mixer (tests/zoo6.py), equinox's LSTMCell docstring model (a ``jax.lax.scan`` carrying
``(h, c)``: two outputs, exported with ``vjp_order=2``) and SpectralNorm'd Linear (stateful: its
power iteration's state threaded by the caller in training, an ``inference_mode`` model served)
(tests/zoo7eqx.py), nnx's MiniGPT (int tokens) and the BatchNorm guide's linen MLP (its batch
statistics carried by ``h.apply_with_state`` in training, the running averages exported)
(tests/helpers.py). The compositions: ``jit(vmap)``, ``vmap`` with ``in_axes`` over params (an
ensemble), per-example gradients, ``jax.checkpoint`` inside a ``jax.lax.scan`` training loop,
``custom_vjp`` wrappers, ``jax.shard_map`` over 8 devices with the batch split, sharded inputs
under ``jax.set_mesh``, ``donate_argnums``, ``jax.eval_shape``, forward mode (``jax.jvp``,
``jax.linearize``: a loaded model refuses it by name) and a Hessian of ``vjp_order=2``, and a
Batcher's answers against ``jit(vmap)``'s.

What JAX itself refuses is asserted of the plain model too: the LSTM's scan under
``jax.shard_map`` (its initial carry ``jnp.zeros`` is the same on every device, its output
carry varies: JAX's "carry input and carry output must have equal types") fails the same way
for the source and its Hybrid, and runs with ``check_vma=False``; the loaded model runs (its scan
is inside the artifact).
"""

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
import zoo6
import zoo7eqx as zoo
from flax import nnx
from helpers import N_DEVICES, BatchNormGuideMLP, DropoutGuideModel, MiniGPT, _ints, _x, made_once
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import symjax_mlp as sm

TOL = {"rtol": 2e-5, "atol": 2e-5}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-4}
MESH = Mesh(np.array(jax.devices()[:N_DEVICES]), ("d",))
SCAN = frozenset({"real_dynamic_slice", "dynamic_slice", "dynamic_update_slice"})
VIT = zoo6.Model(3, patch_size=(4, 4), width=8, depth=2, mlp_dim=16, num_heads=2,
                 posemb="sincos2d", dropout=0.1, pool_type="map", scan=True,
                 head_zeroinit=False)  # fmt: skip
MIXER = zoo6.MlpMixer(patch_size=(4, 4), num_classes=3, num_blocks=1, hidden_dim=8,
                      tokens_mlp_dim=8, channels_mlp_dim=8, stoch_depth=0.5)  # fmt: skip
BN = BatchNormGuideMLP()


@dataclasses.dataclass(frozen=True)
class Model:
    """One zoo model: ``make() -> (plain, params, h)``, ``plain(params, x)`` the model as its
    authors call it in eval mode, ``params`` in ``h.params``'s structure (``None``: an nnx
    module's, compared by its inputs only); ``x`` 8 rows (one per device)."""

    name: str
    make: Callable[[], tuple[Callable, Any, sm.Hybrid]]
    x: jax.Array
    kwargs: dict = dataclasses.field(default_factory=dict)
    vjp_order: int = 1
    allow: frozenset = frozenset()
    stateful: bool = False  # h.apply returns (out, new_state)


def _linen_logits(module):
    """big_vision's ``(logits, out)`` model as export's refusal says to export it: the logits
    of a function of its apply (tests/test_authors_round6.py's round trip)."""

    def make():
        variables = module.init(jax.random.key(0), jnp.ones((1, 8, 8, 3)))

        def logits(v, images):
            return module.apply(v, images, train=False)[0]

        return logits, variables, sm.hybridize(logits, variables)

    return make


def _lstm():
    model = eqx.filter_vmap(zoo.LSTMModel(3, 4, key=jr.key(0)))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    return lambda p, xs: eqx.combine(p, static)(xs), params, sm.hybridize(model)


def _minigpt():
    model = MiniGPT(8, 16, 8, 2, 16, 1, rngs=nnx.Rngs(0))
    model.eval()  # its Dropouts off
    return lambda _, tokens: model(tokens), None, sm.hybridize(model)


def _batchnorm():
    variables = BN.init(jax.random.key(0), _x(0, (8, 5)), train=False)

    def plain(p, x):
        return BN.apply({**p, "batch_stats": variables["batch_stats"]}, x, train=False)

    return plain, {"params": variables["params"]}, sm.hybridize(BN, variables)


def _spectral():
    """test_spectral_norm's layer as equinox serves it: ``inference_mode``, its state held."""
    spectral, state = zoo.spectral_norm(jr.key(0))
    served = eqx.Partial(eqx.nn.inference_mode(spectral), state=state)

    def infer(model, x):
        return jax.vmap(model)(x)[0]

    return lambda _, x: infer(served, x), None, sm.hybridize(infer, served)


MODELS = (
    Model("bv_vit", _linen_logits(VIT), _x(1, (8, 8, 8, 3)),
          allow=SCAN | {"convolution", "dynamic_gather", "scatter"}),
    Model("bv_mixer", _linen_logits(MIXER), _x(2, (8, 8, 8, 3)),
          allow=frozenset({"convolution"})),
    Model("eqx_lstm", _lstm, _x(3, (8, 6, 3)), vjp_order=2, allow=SCAN),
    Model("nnx_minigpt", _minigpt, _ints(4, (8, 8), 16), allow=frozenset({"gather", "scatter"}),
          stateful=True, vjp_order=0),
    Model("linen_batchnorm", _batchnorm, _x(5, (8, 5)), kwargs={"train": False}, vjp_order=2,
          stateful=True),
    Model("eqx_spectral_norm", _spectral, _x(6, (8, 5))),
)  # fmt: skip
FLOATS = [m for m in MODELS if m.vjp_order]
# the ViT's per-example grads cost ~25 s (its grads through shard_map run below); the Mixer's run
PER_EXAMPLE = [m for m in FLOATS if m.name != "bv_vit"]
CALLERS = ("h", "h.apply", "m")
GRADS = ("h.apply", "m")  # h's gradients are h.apply's (test_transforms.py runs both)


@pytest.fixture(scope="module")
def zoo_models(tmp_path_factory):
    """``zoo_models(model) -> {caller: f(x)}``, ``"source"`` the plain model; each exported once
    in the run (its first 4 rows the example, the batch symbolic) and loaded once."""
    done = {}

    def get(model: Model) -> dict[str, Callable]:
        if model.name not in done:
            plain, params, h = model.make()

            def make(path, h=h, model=model):
                sm.export(h, path, example=model.x[:4], kwargs=model.kwargs,
                          vjp_order=model.vjp_order)  # fmt: skip

            path = made_once(tmp_path_factory, f"transforms_zoo/{model.name}", make)

            def apply(x):
                out = h.apply(h.params, x, **model.kwargs)
                return out[0] if model.stateful else out

            done[model.name] = {
                "source": lambda x: plain(params, x),
                "h": lambda x: h(x, **model.kwargs),
                "h.apply": apply,
                "m": sm.load(path, allow=set(model.allow) or None),
                "hybrid": h,
                "plain": plain,
            }
        return done[model.name]

    return get


def _ids(cases):
    return [f"{m.name}-{c}" for m, c in cases]


def _cases(models, callers=CALLERS):
    return [(m, c) for m in models for c in callers]


def _row(f):
    """``f`` of one example: a batch of one, as vmap passes it without its batch dimension."""
    return lambda r: jax.tree.map(lambda y: y[0], f(r[None]))


@pytest.mark.slow  # jit(vmap), eval_shape, donation: ~0.5 to 2 s each
@pytest.mark.parametrize(("model", "caller"), _cases(MODELS), ids=_ids(_cases(MODELS)))
def test_jit_of_vmap_eval_shape_and_donation_as_the_source(zoo_models, model, caller):
    fs = zoo_models(model)
    f, x = fs[caller], model.x
    want = fs["source"](x)
    chex.assert_trees_all_close(jax.jit(jax.vmap(_row(f)))(x), want, **TOL)
    shapes = jax.eval_shape(f, jax.ShapeDtypeStruct((5, *x.shape[1:]), x.dtype))
    assert shapes == jax.eval_shape(fs["source"], jax.ShapeDtypeStruct((5, *x.shape[1:]), x.dtype))
    got, warned = _donated(f, x)
    chex.assert_trees_all_close(got, want, **TOL)
    assert warned == _donated(fs["source"], x)[1]  # JAX's, where no output can take x's buffer


def _donated(f, x):
    """``jax.jit(f, donate_argnums=0)`` of a copy of ``x``, and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = jax.jit(lambda x: f(x), donate_argnums=0)(jnp.array(x, copy=True))  # compiled anew
    return out, sorted({str(w.message).split(":")[0] for w in caught})


PARAMS = [m for m in MODELS if m.name in {"eqx_lstm", "linen_batchnorm"}]  # (the Mixer: ~6 s)


@pytest.mark.slow  # ~1 s each
@pytest.mark.parametrize("model", PARAMS, ids=[m.name for m in PARAMS])
def test_vmap_over_params_and_per_example_param_grads_of_h_apply_as_the_source(zoo_models, model):
    """An ensemble (params stacked, ``in_axes=(0, None)`` and ``(0, 0)``) and per-example
    gradients with respect to the params, of ``h.apply`` as of the plain model."""
    fs = zoo_models(model)
    h, plain, x = fs["hybrid"], fs["plain"], model.x[:4]
    params = h.params if model.name != "linen_batchnorm" else {"params": h.params["params"]}
    stacked = jax.tree.map(lambda a: jnp.stack([a, 1.5 * a]), params)

    def apply(p, x):
        out = h.apply(p, x, **model.kwargs)
        return out[0] if model.stateful else out

    for axes, xs in (((0, None), x), ((0, 0), jnp.stack([x, 2 * x]))):
        got = jax.jit(jax.vmap(apply, in_axes=axes))(stacked, xs)
        chex.assert_trees_all_close(got, jax.vmap(plain, in_axes=axes)(stacked, xs), **TOL)

    def per_example(f):
        loss = lambda p, r: sum(jnp.sum(y**2) for y in jax.tree.leaves(f(p, r[None])))  # noqa: E731
        return jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, x)

    chex.assert_trees_all_close(per_example(apply), per_example(plain), **GRAD_TOL)


def _loss(f):
    return lambda x: sum(jnp.sum(y**2) for y in jax.tree.leaves(f(x)))


@pytest.mark.slow  # per-example grads, a custom_vjp, a checkpointed scan: ~1 to 8 s each
@pytest.mark.parametrize(
    ("model", "caller"), _cases(PER_EXAMPLE, GRADS), ids=_ids(_cases(PER_EXAMPLE, GRADS))
)
def test_per_example_grads_custom_vjp_and_a_checkpointed_scan_loop_as_the_source(
    zoo_models, model, caller
):
    """``vmap(grad)`` per example; a ``custom_vjp`` whose rules call ``jax.vjp`` of the model
    (its cotangent doubled); three steps of a ``jax.lax.scan`` loop descending the inputs
    through ``jax.checkpoint`` of the model (an adversarial / input-optimization loop)."""
    fs = zoo_models(model)
    f, source, x = fs[caller], fs["source"], model.x[:4]

    def per_example(f):
        return jax.vmap(jax.grad(lambda r: _loss(f)(r[None])))(x)

    chex.assert_trees_all_close(per_example(f), per_example(source), **GRAD_TOL)

    def doubled(f):
        @jax.custom_vjp
        def g(x):
            return f(x)

        def bwd(vjp, ct):
            return vjp(jax.tree.map(lambda c: 2 * c, ct))

        g.defvjp(lambda x: jax.vjp(f, x), bwd)
        return jax.grad(_loss(g))(x)

    chex.assert_trees_all_close(doubled(f), 2 * jax.grad(_loss(source))(x), **GRAD_TOL)

    def loop(f):
        def step(x, _):
            loss, g = jax.value_and_grad(_loss(jax.checkpoint(f)))(x)
            return x - 0.01 * g, loss

        return jax.jit(lambda x: jax.lax.scan(step, x, None, length=3))(x)

    chex.assert_trees_all_close(loop(f), loop(source), **GRAD_TOL)


@pytest.mark.slow  # shard_map, sharded inputs: ~1 to 4 s each
@pytest.mark.parametrize(("model", "caller"), _cases(MODELS), ids=_ids(_cases(MODELS)))
def test_shard_map_over_8_devices_and_sharded_inputs_under_set_mesh_as_the_source(
    zoo_models, model, caller
):
    fs = zoo_models(model)
    f, source, x = fs[caller], fs["source"], model.x
    want = source(x)

    def sharded(f, check_vma=True):
        return jax.shard_map(f, mesh=MESH, in_specs=P("d"), out_specs=P("d"), check_vma=check_vma)

    if model.name == "eqx_lstm" and caller != "m":  # JAX's refusal, as of the source
        for g in (f, source):
            with pytest.raises(TypeError, match="carry input and carry output must have equal"):
                sharded(g)(x)
        chex.assert_trees_all_close(sharded(f, check_vma=False)(x), want, **TOL)
    else:
        chex.assert_trees_all_close(sharded(f)(x), want, **TOL)
    chex.assert_trees_all_close(jax.jit(f)(jax.device_put(x, NamedSharding(MESH, P("d")))), want,
                                **TOL)  # fmt: skip
    with jax.set_mesh(MESH):
        chex.assert_trees_all_close(jax.jit(f)(jax.device_put(x, P("d"))), want, **TOL)


@pytest.mark.slow  # a grad through shard_map: ~1 to 3 s each
@pytest.mark.parametrize("model", FLOATS, ids=[m.name for m in FLOATS])
def test_grad_through_shard_map_of_the_loaded_model_as_the_source(zoo_models, model):
    fs = zoo_models(model)
    m, source, x = fs["m"], fs["source"], model.x
    sharded = jax.shard_map(m, mesh=MESH, in_specs=P("d"), out_specs=P("d"))
    got = jax.jit(jax.grad(_loss(sharded)))(x)
    chex.assert_trees_all_close(got, jax.grad(_loss(source))(x), **GRAD_TOL)


FORWARD = {
    "jvp": lambda f, x: jax.jvp(f, (x,), (x,)),
    "linearize": lambda f, x: jax.linearize(f, x)[1](x),
    "jit-jvp": lambda f, x: jax.jit(lambda x: jax.jvp(f, (x,), (x,)))(x),
    "hessian": lambda f, x: jax.hessian(lambda x: _loss(f)(x))(x),
}


@pytest.mark.slow  # its export in the call (~3 s), then ~0.2 s each
@pytest.mark.parametrize("name", FORWARD)
def test_forward_mode_over_a_loaded_lstm_is_refused_naming_jacrev(zoo_models, name):
    """A loaded model differentiates in reverse mode only (jax.export serializes VJP modules):
    jax.jvp, jax.linearize and jax.hessian of the loaded LSTM are refused by name as they trace,
    saying what runs (jax.jacrev, up to the artifact's vjp_order=2)."""
    m = zoo_models(MODELS[2])["m"]
    with pytest.raises(sm.ConfigError, match=r"reverse mode only.*order 2.*jax.jacrev") as e:
        FORWARD[name](m, MODELS[2].x[:1])
    assert "export again" not in str(e.value)  # it holds what a Hessian needs already


SECOND = [m for m in MODELS if m.vjp_order == 2]


@pytest.mark.slow  # jvp, linearize, two Hessians: ~1 to 3 s each
@pytest.mark.parametrize(
    ("model", "caller"), _cases(SECOND, GRADS), ids=_ids(_cases(SECOND, GRADS))
)
def test_forward_mode_of_the_hybrid_and_a_hessian_of_vjp_order_2_as_the_source(
    zoo_models, model, caller
):
    """The Hybrid runs forward mode as the source; the loaded model's Hessian is
    ``jax.jacrev(jax.jacrev(f))`` (as its refusal of ``jax.hessian`` says), per example too."""
    fs = zoo_models(model)
    f, source, x = fs[caller], fs["source"], model.x[:1]
    if caller != "m":
        for name in ("jvp", "linearize", "hessian"):
            chex.assert_trees_all_close(FORWARD[name](f, x), FORWARD[name](source, x),
                                        **GRAD_TOL)  # fmt: skip
    want = jax.hessian(_loss(source))(x)
    chex.assert_trees_all_close(jax.jacrev(jax.jacrev(_loss(f)))(x), want, **GRAD_TOL)
    if caller != "m" or model.name != "linen_batchnorm":  # (the LSTM's: ~5 s more)
        return
    x = model.x[:2]
    per_example = jax.vmap(jax.jacrev(jax.jacrev(lambda r: _loss(f)(r[None]))))(x)
    want = jax.vmap(jax.hessian(lambda r: _loss(source)(r[None])))(x)
    chex.assert_trees_all_close(per_example, want, **GRAD_TOL)


@pytest.mark.slow  # a Batcher per model: ~0.5 to 2 s
@pytest.mark.parametrize("model", MODELS, ids=[m.name for m in MODELS])
def test_a_batchers_answers_are_jit_of_vmaps_rows(zoo_models, model):
    """Each example submitted alone to a Batcher over the loaded model, answered in batches of
    up to 4: the rows ``jax.jit(jax.vmap(m))`` gives, and the source's."""
    fs = zoo_models(model)
    m, x = fs["m"], model.x
    composed = jax.jit(jax.vmap(_row(m)))(x)
    with sm.serving.Batcher(m, max_batch=4) as batcher:
        answers = [f.result() for f in [batcher.submit(r[None]) for r in x]]
    got = jax.tree.map(lambda *rows: jnp.concatenate(rows), *answers)
    chex.assert_trees_all_close(got, composed, **TOL)
    chex.assert_trees_all_close(got, fs["source"](x), **TOL)


# -- stateful models in train mode, as their authors train them ---------------------------------
def _descend(params, grads):
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


@pytest.mark.slow  # two scans of a checkpointed BatchNorm step (~1 s)
def test_a_batchnorm_training_loop_of_checkpointed_steps_carries_its_stats_as_flax():
    """The BatchNorm guide's MLP trained by a ``jax.lax.scan`` of four steps under jax.jit, each
    ``value_and_grad(jax.checkpoint(loss), has_aux=True)`` of ``h.apply_with_state(params,
    state, x, train=True)``: the losses, params and batch statistics of flax's own
    ``apply(..., mutable=["batch_stats"])`` in the same loop; then an ensemble of two states."""
    x, y = _x(7, (8, 5)), _x(8, (8, 1))
    variables = BN.init(jax.random.key(0), x, train=False)
    h = sm.hybridize(BN, variables)

    def step(apply):
        def run(carry, batch):
            def loss(params):
                out, state = apply(params, carry[1], batch[0])
                return jnp.mean((out - batch[1]) ** 2), state

            (value, state), grads = jax.value_and_grad(jax.checkpoint(loss), has_aux=True)(carry[0])
            return (_descend(carry[0], grads), state), value

        return run

    def flax_apply(params, state, x):
        out, new = BN.apply({**params, **state}, x, train=True, mutable=["batch_stats"])
        return out, new

    def h_apply(params, state, x):
        return h.apply_with_state(params, state, x, train=True)

    batches = (x.reshape(4, 2, 5), y.reshape(4, 2, 1))
    start = ({"params": variables["params"]}, {"batch_stats": variables["batch_stats"]})
    assert jax.tree.structure(start) == jax.tree.structure((h.params, h.state))
    want = jax.lax.scan(step(flax_apply), start, batches)
    got = jax.jit(lambda c: jax.lax.scan(step(h_apply), c, batches))((h.params, h.state))
    chex.assert_trees_all_close(got, want, **GRAD_TOL)
    params, state = got[0]
    ensemble = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), state)
    got = jax.vmap(h_apply, in_axes=(None, 0, None))(params, ensemble, x)
    chex.assert_trees_all_close(got, jax.vmap(flax_apply, in_axes=(None, 0, None))(params,
                                ensemble, x), **TOL)  # fmt: skip


@pytest.mark.slow  # a scan of checkpointed SpectralNorm steps (~1 s)
def test_a_spectral_norm_training_loop_threads_its_state_as_equinox():
    """test_spectral_norm's layer trained in a ``jax.lax.scan`` (its state threaded by the caller,
    ``h.apply(params, x, state)``, one state for the batch as examples/stateful.ipynb batches
    it), each step through ``jax.checkpoint``: equinox's own losses, weights and power-iteration
    state (its served ``inference_mode`` model is MODELS' eqx_spectral_norm)."""
    spectral, state = zoo.spectral_norm(jr.key(0))

    def batch(spectral, x, state):
        return jax.vmap(spectral, in_axes=(0, None), out_axes=(0, None))(x, state)

    h = sm.hybridize(batch, spectral)
    params, static = eqx.partition(spectral, eqx.is_inexact_array)
    xs = _x(9, (3, 8, 5))

    def loop(apply, params):
        def step(carry, x):
            def loss(p):
                out, new = apply(p, x, carry[1])
                return jnp.sum(out**2), new

            (value, new), grads = jax.value_and_grad(jax.checkpoint(loss), has_aux=True)(carry[0])
            return (_descend(carry[0], grads), new), value

        return jax.jit(lambda c: jax.lax.scan(step, c, xs))((params, state))

    (trained, state_h), losses = loop(h.apply, h.params)
    (want, state_eqx), want_losses = loop(
        lambda p, x, s: batch(eqx.combine(p, static), x, s), params
    )
    chex.assert_trees_all_close(losses, want_losses, **GRAD_TOL)
    chex.assert_trees_all_close(jax.tree.leaves((trained, state_h)),
                                jax.tree.leaves((want, state_eqx)), **GRAD_TOL)  # fmt: skip


TRAIN_TRANSFORMS = {
    "jit": lambda f, x: jax.jit(f)(x),
    "vmap": lambda f, x: jax.vmap(lambda r: f(r[None]))(x),
    "grad": lambda f, x: jax.grad(lambda x: f(x).sum())(x),
    "eval_shape": lambda f, x: jax.eval_shape(f, x),
    "shard_map": lambda f, x: jax.shard_map(f, mesh=MESH, in_specs=P("d"), out_specs=P("d"))(x),
    "checkpoint-scan": lambda f, x: jax.lax.scan(
        lambda c, _: (c, jax.checkpoint(f)(c)), x, None, length=2
    ),
}


@pytest.mark.slow  # six refusals and an eager call (~1 s)
def test_the_batchnorm_hybrids_own_train_call_inside_a_transform_is_refused_naming_apply():
    """``h(x, train=True)`` of the BatchNorm guide's MLP inside jax.jit, vmap, grad, eval_shape,
    shard_map or a checkpointed scan would hold tracers as its batch statistics: refused by
    name, pointing to ``h.apply`` (the loop above), the held statistics untouched; an eager call
    after it moves them as flax's own apply does."""
    x = _x(10, (8, 5))
    variables = BN.init(jax.random.key(0), x, train=False)
    h = sm.hybridize(BN, variables)
    for transform in TRAIN_TRANSFORMS.values():
        with pytest.raises(sm.ControlFlowError, match=r"inside a JAX transformation.*h\.apply"):
            transform(lambda x: h(x, train=True), x)
        chex.assert_trees_all_equal(h.state, {"batch_stats": variables["batch_stats"]})
    out, new = BN.apply(variables, x, train=True, mutable=["batch_stats"])
    chex.assert_trees_all_close(h(x, train=True), out, **TOL)
    chex.assert_trees_all_close(h.state, new, **TOL)


@pytest.mark.slow  # ~1 s
def test_the_dropout_guides_train_call_under_vmap_and_grad_draws_as_flax_under_them():
    """``h(x, training=True)`` of the dropout guide's model (``rngs=`` held) under jax.vmap and
    jax.grad: its key is split outside the traced rows (no tracer held), so each call is one
    draw, every row masked by one key as flax's own apply under the same vmap; the held stream
    moves once per call (the second call's mask differs)."""
    model, x, key = DropoutGuideModel(8), _x(11, (8, 5)), jax.random.key(3)
    variables = model.init(jax.random.key(0), x, training=False)
    h = sm.hybridize(model, variables, rngs=key)

    def flax(x, dropout):
        return model.apply(variables, x, training=True, rngs={"dropout": dropout})

    first, second = jax.random.split(key)[1], jax.random.split(jax.random.split(key)[0])[1]
    got = jax.vmap(lambda r: h(r[None], training=True)[0])(x)
    chex.assert_trees_all_close(got, jax.vmap(lambda r: flax(r[None], first)[0])(x), **TOL)
    got = jax.grad(lambda x: (h(x, training=True) ** 2).sum())(x)
    chex.assert_trees_all_close(got, jax.grad(lambda x: (flax(x, second) ** 2).sum())(x), **TOL)
