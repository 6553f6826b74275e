"""Code we did not write, round eighteen (tests/zoo18.py; sources and commit there), over
every feature: hybridize, ``h(x)`` equal to the plain model, its graph, export + load + call
equal, grads/Hessians over the loaded model, a Batcher's answers, and what is specific.

- view.md: ``MyModel``'s eval view (``nnx.view(model, deterministic=True,
  use_running_average=True)``) over every feature, batch symbolic; three of the guide's
  ``train_step`` (``nnx.Optimizer(..., wrt=nnx.Param)`` over the training view, its
  ``rngs`` advancing) equal three steps of ``nnx.value_and_grad`` over ``h.apply_with_state``
  of the training view, the same ``rngs`` passed in; the guide's claim that the views share
  their weights: a Hybrid of the eval view made before training refuses export (it holds the
  weights as of hybridize), one made after equals the guide's ``eval_step``.
  ``nnx.with_attributes``' train and eval ``NoisyLinear`` s and ``nnx.recursive_map``'s
  ``add_noise``: the noise drawn from the ``rngs`` passed in, call by call as eager.
- randomness.md: ``sample_from_model`` (``nnx.with_rngs(split=5)`` over an ``nnx.vmap``
  whose ``in_axes`` is ``nnx.prefix`` of the guide's global ``model``) hybridized over the
  model: was JAX's ValueError 'vmap in_axes ... different types ... Dropout ... Dropout' (a
  Hybrid ran the function's layers as subclasses naming their ops); now its samples, call by
  call, equal the guide's. ``rnn_forward``'s recurrent dropout over an ``nnx.scan``: each
  call and the cell's ``Count`` as eager.
- vit_training.md: the ViT (sizes cut, float32) evaluated through ``nnx.view(model,
  deterministic=True)`` over every feature, batch symbolic; three of the guide's
  ``train_step`` (``optax.sgd`` with Nesterov momentum on a linear schedule, a fork of the
  rngs a step) equal the same steps over ``h.apply_with_state``.
- bridge_guide.md (``out_dim`` 64 cut to 6): ``ToNNX(LinenDot)``, ``NNXOuter``,
  ``to_linen(NNXDot)``, ``ToLinen(NNXAddConstant, skip_rng=True)`` and ``LinenOuter`` over
  every feature, batch symbolic; the guide's weight swapped in place after hybridize: export
  refused, a new Hybrid as the swapped model. ``ToNNX(nn.Dropout)``: calls as eager's.
  ``to_linen(nnx.Dropout)`` given ``rngs={'dropout': key}`` as ``apply`` takes it: was
  nnx's TypeError 'rngs must be a Rngs ... got dict' (its ``**kwargs`` let apply's keyword
  through to the nnx module), now refused naming the function of a key to hybridize, which
  answers as ``apply`` per key.
- transforms.md: ``nnx.vmap(vector_dot, in_axes=0, out_axes=1)`` hybridized over ``Weights``
  (ten kernels, one per row of ``x``) over every feature, the batch static;
  ``stateful_vector_dot`` with its count mapped and broadcast (``nnx.StateAxes``) and
  ``noisy_vector_dot``'s ten noise streams: two calls, their outputs and the held counts as
  the guide's on a twin; the guide's ``y1`` and ``y2`` differ.
- digits_diffusion_model.md: the ``UNet`` (``features`` 64 cut to 4: at 2 its LayerNorms of
  two channels make ``jax.jit`` of it differ from it eager by 0.07) of 4 x 4 images (the
  digits' 8 x 8 cut) at time 0.5 over every feature, batch symbolic; three of the example's
  ``train_step`` (``nnx.ModelAndOptimizer``, clipped adamw on its schedule, times and noise from the
  ``rngs``) equal three of ``nnx.value_and_grad`` of its ``loss_fn`` over ``h.apply``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo18
from features import close, every_feature
from flax import linen as nn
from flax import nnx
from flax.nnx import bridge

import symjax_mlp as sm

pytestmark = pytest.mark.slow  # each a compile or more (~3 s or more)


def _my_model():
    """view.md's ``rngs``, data and model, as the guide draws them (``ndata`` 16)."""
    rngs = nnx.Rngs(0)
    x, y = rngs.normal((16, zoo18.in_dim)), rngs.normal((16, zoo18.out_dim))
    model = zoo18.MyModel(zoo18.in_dim, zoo18.hidden_dim, zoo18.out_dim, 0.1, rngs=rngs)
    return model, rngs, x, y


def test_view_eval_model_every_feature_and_the_guides_train_steps(tmp_path):
    """MyModel's eval view over every feature; three of the guide's training steps (its views,
    its ``nnx.Optimizer``) equal ours over the training view's ``h.apply_with_state``, the
    same dropout masks drawn from the ``rngs`` each passes in; the eval view hybridized before
    training refuses export, after it equals the guide's ``eval_step``."""
    model, rngs, x, y = _my_model()
    eval_model = nnx.view(model, deterministic=True, use_running_average=True)
    before = sm.hybridize(eval_model)
    every_feature(tmp_path, before, eval_model, x)

    h, mine = sm.hybridize(nnx.view(model, deterministic=False)), nnx.clone(rngs)
    tx = optax.adam(1e-3)
    params, state, opt = h.params, h.state, tx.init(h.params)

    def loss(p, s, r):
        out, s = h.apply_with_state(p, s, x, rngs=r)
        return ((out - y) ** 2).mean(), s

    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    train_model = nnx.view(model, deterministic=False)  # training view
    for _ in range(3):
        (_, state), grads = nnx.value_and_grad(loss, has_aux=True)(params, state, mine)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        zoo18.train_step(train_model, optimizer, x, y, rngs)  # use train_model
    assert int(mine.default.count[...]) == int(rngs.default.count[...])
    trained = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for p in (params, trained):  # the bias before the BatchNorm: zero grads, adam's noise
        p["lin1"] = {"kernel": p["lin1"]["kernel"]}
    close(params, trained, rtol=1e-5, atol=1e-6)
    close(state["bn"], nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))["bn"], atol=1e-4)

    with pytest.raises(sm.ConfigError, match=r"trained in place since sm\.hybridize"):
        sm.export(before, tmp_path / "stale", example=(x,))
    after = sm.hybridize(eval_model)
    close(((after(x) - y) ** 2).mean(), zoo18.eval_step(eval_model, x, y))


def test_with_attributes_and_recursive_map_draw_noise_as_eager():
    """``nnx.with_attributes``' training ``NoisyLinear`` s draw their noise from the ``rngs``
    passed to each call, two calls as eager's two; the eval view's exports. ``recursive_map``'s
    ``add_noise`` leaves ``training`` None (the guide's own call then fails its ``assert``):
    made a training view, the same."""
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(zoo18.NoisyLinear(4, 8, rngs=rngs), zoo18.NoisyLinear(8, 2, rngs=rngs))
    plain = nnx.Sequential(nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 2, rngs=rngs))
    noisy = nnx.with_attributes(nnx.recursive_map(zoo18.add_noise, plain), training=True)
    x = jnp.ones((3, 4))
    for m in (nnx.with_attributes(model, training=True), noisy):
        h, ours, theirs = sm.hybridize(m), nnx.Rngs(7), nnx.Rngs(7)
        first = h(x, rngs=ours)
        close(first, m(x, rngs=theirs))
        close(h(x, rngs=ours), m(x, rngs=theirs))
        assert not np.allclose(first, h(x, rngs=ours))  # the stream moved on
    eval_model = nnx.with_attributes(model, training=False)
    close(sm.hybridize(eval_model)(x), eval_model(x))


def test_randomness_guides_sample_from_model_over_a_hybrid():
    """The guide's ``sample_from_model`` (its ``in_axes``: ``nnx.prefix`` of its global
    ``model``) hybridized over that model: JAX's ValueError 'vmap in_axes specification must
    be a tree prefix ... Dropout ... Dropout' (the Hybrid ran the layers as subclasses naming
    their ops, no longer of the prefix's types); now two calls equal the guide's two on a
    twin, the five masks not one, and the stream advanced as the twin's."""
    twin = zoo18.Model(nnx.Rngs(params=0, dropout=1))
    h = sm.hybridize(zoo18.sample_from_model, zoo18.model)
    x = jnp.ones((1, 20))
    for _ in range(2):
        got = h(x)
        close(got, zoo18.sample_from_model(twin, x))
        assert got.shape == (5, 1, 10) and len({np.asarray(s).tobytes() for s in got}) > 1
    held = h.state["drop"]["rngs"]["count"]
    assert int(held) == int(twin.drop.rngs.count[...]) == 2
    assert h.graph(x).primitive_counts["dot_general"] >= 1


def test_randomness_guides_recurrent_dropout_over_a_hybrid():
    """``rnn_forward`` (``nnx.with_rngs(broadcast=)``, ``nnx.scan``) hybridized over a cell
    (din 3, dout 4): two calls as the guide's two on a twin, and the cell's ``Count`` of steps
    as the twin's."""
    cell = zoo18.RNNCell(3, 4, nnx.Rngs(params=0, recurrent_dropout=1))
    twin = zoo18.RNNCell(3, 4, nnx.Rngs(params=0, recurrent_dropout=1))
    xs = jax.random.normal(jax.random.key(0), (2, 5, 3))
    h = sm.hybridize(zoo18.rnn_forward, cell)
    for _ in range(2):
        close(h(xs), zoo18.rnn_forward(twin, xs))
    assert int(h.state["count"]) == int(twin.count[...]) == 10


def _vit():
    config = zoo18.ModelConfig(num_classes=3, in_channels=1, img_size=4, patch_size=2,
                               num_layers=1, num_heads=2, mlp_dim=16, hidden_size=8,
                               use_bfloat16=False)  # fmt: skip
    return zoo18.VisionTransformer(config, rngs=nnx.Rngs(1))


def test_vit_eval_view_every_feature_and_the_guides_train_steps(tmp_path):
    """The ViT's eval view over every feature (compared with the view under ``jax.jit``:
    Hessians of it eager take half a minute); three of the guide's ``train_step`` (its
    ``nnx.Optimizer``, a fork of ``nnx.Rngs(12)`` a step) equal three over
    ``h.apply_with_state``, each given an ``nnx.Rngs`` of the same fork's key."""
    model = _vit()
    x = jax.random.normal(jax.random.key(0), (5, 4, 4, 1))
    labels = jnp.array([0, 1, 2, 1, 0])
    eval_model = nnx.view(model, deterministic=True)
    allow = {"convolution", "dynamic_gather", "real_dynamic_slice", "scatter"}
    ref = jax.jit(lambda r: eval_model(r))
    every_feature(tmp_path, sm.hybridize(eval_model), ref, x, allow=allow)

    h = sm.hybridize(nnx.view(model, deterministic=False))
    tx = optax.sgd(optax.linear_schedule(1e-3, 0.0, 10), 0.8, nesterov=True)
    params, state, opt = h.params, h.state, tx.init(h.params)

    def loss(p, s, key):
        logits, s = h.apply_with_state(p, s, x, rngs=nnx.Rngs(key))
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), s

    theirs = _vit()
    optimizer = nnx.Optimizer(theirs, tx, wrt=nnx.Param)
    ours_rngs, their_rngs, ours, want = nnx.Rngs(12), nnx.Rngs(12), [], []
    for _ in range(3):
        key = ours_rngs.fork().default.key[...]
        (value, state), grads = jax.value_and_grad(loss, has_aux=True)(params, state, key)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        ours.append(value)
        train_view = nnx.view(theirs, deterministic=False)
        want.append(zoo18.vit_train_step(train_view, optimizer, their_rngs, (x, labels)))
    close(ours, want)
    close(params, nnx.to_pure_dict(nnx.state(theirs, nnx.Param)))


X32 = jax.random.normal(jax.random.key(42), (4, 32))


def _linen_dot():
    """The guide's ``bridge.lazy_init(bridge.ToNNX(LinenDot(64), rngs=nnx.Rngs(0)), x)``."""
    model = bridge.ToNNX(zoo18.LinenDot(6), rngs=nnx.Rngs(0))
    return bridge.lazy_init(model, X32)


def _plain(module):
    """A ToNNX module's linen apply over its weights now (eager ToNNX under jax.grad draws
    from its own Rngs across trace levels: flax's TraceContextError)."""
    return lambda r: module.to_nnx__module.apply({"params": {"w": module.w[...]}}, r)


BRIDGED = {
    "to_nnx": lambda: (_linen_dot(), None),
    "nnx_outer": lambda: (bridge.lazy_init(zoo18.NNXOuter(6, rngs=nnx.Rngs(0)), X32), None),
    "to_linen": lambda: (m := bridge.to_linen(zoo18.NNXDot, 32, out_dim=6),
                         m.init(jax.random.key(0), X32)),
    "to_linen_skip_rng": lambda: (m := bridge.ToLinen(zoo18.NNXAddConstant, skip_rng=True),
                                  m.init(jax.random.key(0), X32)),
    "linen_outer": lambda: (m := zoo18.LinenOuter(out_dim=6), m.init(jax.random.key(0), X32)),
}  # fmt: skip


@pytest.mark.parametrize("name", BRIDGED)
def test_bridge_guides_modules_every_feature(tmp_path, name):
    """Each of the guide's bridged modules over every feature, batch symbolic (an nnx module
    compared through its linen apply or a jitted twin, a linen one through ``apply``)."""
    model, variables = BRIDGED[name]()
    if variables is not None:
        h, ref = sm.hybridize(model, variables), lambda r: model.apply(variables, r)
    elif name == "to_nnx":
        h, ref = sm.hybridize(model), _plain(model)
    else:
        twin = BRIDGED[name]()[0]
        h, ref = sm.hybridize(model), lambda r: twin.b[...] + _plain(twin.dot)(r)
    every_feature(tmp_path, h, ref, X32)


def test_bridge_weight_swapped_in_place_and_dropout_keys(tmp_path):
    """ "In-place swap your weight array and the model still works": the Hybrid made before
    refuses export, one made after answers as the swapped model. ``ToNNX(nn.Dropout)``: two
    calls as eager's two. ``to_linen(nnx.Dropout)`` called with apply's ``rngs=`` dict is
    refused (was nnx's TypeError), and the function of a key it names gives ``apply``'s
    answer per key: the same key, the same mask."""
    model = _linen_dot()
    h = sm.hybridize(model)
    model.w[...] = jax.random.normal(jax.random.key(1), (32, 6))  # the guide's .value warns
    with pytest.raises(sm.ConfigError, match=r"\['w'\]"):
        sm.export(h, tmp_path / "m", example=(X32,))
    close(sm.hybridize(model)(X32), _plain(model)(X32))

    def dropout():
        m = bridge.ToNNX(nn.Dropout(rate=0.5, deterministic=False), rngs=nnx.Rngs(dropout=0))
        return bridge.lazy_init(m, X32)

    h, twin = sm.hybridize(dropout()), dropout()
    for _ in range(2):
        close(h(X32), twin(X32))

    model = bridge.to_linen(nnx.Dropout, rate=0.5)
    variables = model.init({"dropout": jax.random.key(0)}, X32)
    h = sm.hybridize(model, variables)
    with pytest.raises(sm.ConfigError, match=r"rngs= is ToLinen\.apply's own keyword"):
        h(X32, rngs={"dropout": jax.random.key(1)})
    keyed = sm.hybridize(
        lambda variables, x, key: model.apply(variables, x, rngs={"dropout": key}), variables
    )
    got = [keyed(X32, jax.random.key(k)) for k in (1, 2, 1)]
    for k, y in zip((1, 2, 1), got, strict=True):
        close(y, model.apply(variables, X32, rngs={"dropout": jax.random.key(k)}))
    assert not np.allclose(got[0], got[1])
    close(got[0], got[2])


def _weights(cls, count=None, **kw):
    """The guide's ``Weights(kernel=..., bias=...)`` of ten rows (or one, with ``seed``)."""
    rows = () if "seed" in kw else (10,)
    kernel, bias = jax.random.uniform(jax.random.key(0), (*rows, 2, 3)), jnp.zeros((*rows, 3))
    return cls(kernel, bias, **({} if count is None else {"count": count}), **kw)


def test_transforms_guides_vector_dot_every_feature(tmp_path):
    """``vector_dot`` over ``nnx.vmap`` (``in_axes=0, out_axes=1``) of ten weights, row by row
    of ``x`` (10, 2): every feature with the batch static (the rows are tied to the weights),
    but a Batcher's, which refuses its rows out along axis 1;
    compared with the weights made anew inside each transform (eager nnx refuses a module
    made outside ``jax.grad``'s trace)."""
    weights, x = _weights(zoo18.Weights), jax.random.normal(jax.random.key(1), (10, 2))
    f = nnx.vmap(zoo18.vector_dot, in_axes=0, out_axes=1)
    ref = lambda r: f(_weights(zoo18.Weights), r)  # noqa: E731 - made in each trace
    with pytest.raises(sm.ConfigError, match="per-row outputs"):  # its last feature: (3, 10)
        every_feature(tmp_path, sm.hybridize(f, weights), ref, x, batch=None)


SPLIT_NOISE = nnx.StateAxes({nnx.RngState: 0, (nnx.Param, zoo18.Count): None})
STATEFUL = {  # the guide's weights, its function of them, and where it reads the count
    "mapped": (lambda: _weights(zoo18.CountedWeights, jnp.arange(10)),
               nnx.vmap(zoo18.stateful_vector_dot, in_axes=0, out_axes=1)),
    "broadcast": (lambda: _weights(zoo18.CountedWeights, jnp.array(0)),
                  nnx.vmap(zoo18.stateful_vector_dot, out_axes=1,
                           in_axes=(nnx.StateAxes({nnx.Param: 0, zoo18.Count: None}), 0))),
    "noise": (lambda: _weights(zoo18.NoisyWeights, jnp.array(0),
                               seed=jax.random.split(jax.random.key(0), num=10)),
              nnx.vmap(zoo18.noisy_vector_dot, in_axes=(SPLIT_NOISE, 0))),
}  # fmt: skip


@pytest.mark.parametrize("name", STATEFUL)
def test_transforms_guides_state_propagates_through_a_hybrid(name):
    """Two calls of the guide's function hybridized over its weights: outputs and the count
    the Hybrid holds as the guide's on a twin (each row's, or one broadcast); the noisy one's
    two calls differ, as the guide prints."""
    build, f = STATEFUL[name]
    twin, x = build(), jax.random.normal(jax.random.key(1), (10, 2))
    h, got = sm.hybridize(f, build()), []
    for _ in range(2):
        got.append(h(x))
        close(got[-1], f(twin, x))
        close(h.state["count"], twin.count[...])
    assert (name == "noise") != np.allclose(got[0], got[1])


@functools.cache
def _unet_schedule():
    """The example's optimizer: adamw on a warm-up then cosine schedule, clipped at 0.5."""
    learning_rate, warmup_steps, total_steps = 5e-4, 1000, 2000  # num_epochs = total_steps
    schedule_fn = optax.join_schedules(
        schedules=[
            optax.linear_schedule(init_value=0.0, end_value=learning_rate,
                                  transition_steps=warmup_steps),
            optax.cosine_decay_schedule(init_value=learning_rate,
                                        decay_steps=total_steps - warmup_steps, alpha=0.01),
        ],
        boundaries=[warmup_steps],
    )  # fmt: skip
    adamw = optax.adamw(learning_rate=schedule_fn, weight_decay=2e-5, b1=0.9, b2=0.999, eps=1e-8)
    return optax.chain(optax.clip_by_global_norm(0.5), adamw)


def test_diffusion_unet_every_feature_and_the_examples_train_steps(tmp_path):
    """The UNet at time 0.5 over every feature (compared with it under ``jax.jit``: Hessians
    of it eager take minutes; their entries reach 357, and JAX's own rev-rev and rev-fwd
    Hessians of it differ by 4e-4 in float32: ``atol`` 3e-3); three of the example's
    ``train_step`` on a twin equal three of ``nnx.value_and_grad`` of the example's
    ``loss_fn`` over ``h.apply``, each given an ``nnx.Rngs(0)`` of its own."""
    model = zoo18.UNet(1, 1, 4, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (5, 4, 4, 1))
    half = lambda r: jnp.full(r.shape[:1], 0.5)  # noqa: E731 - t per row
    graphdef, state = nnx.split(model)
    ref = jax.jit(lambda r: nnx.merge(graphdef, state)(r, half(r)))
    allow = {"convolution", "dynamic_gather", "real_dynamic_slice", "reduce_window", "scatter"}
    allow |= {"select_and_scatter"}  # (the ops load names, as it refused them)
    h = sm.hybridize(lambda m, r: m(r, half(r)), model)
    every_feature(tmp_path, h, ref, x, allow=allow, rtol=1e-4, atol=3e-3)

    h, tx, images = sm.hybridize(model), _unet_schedule(), jnp.tanh(x)
    params, opt, ours_rngs, ours = h.params, tx.init(h.params), nnx.Rngs(0), []

    def loss(p, rngs):
        return zoo18.loss_fn(lambda xt, t: h.apply(p, xt, t), images, rngs)

    for _ in range(3):
        value, grads = nnx.value_and_grad(loss)(params, ours_rngs)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        ours.append(value)
    twin, rngs = zoo18.UNet(1, 1, 4, rngs=nnx.Rngs(0)), nnx.Rngs(0)
    optimizer = nnx.ModelAndOptimizer(twin, tx)
    theirs = [zoo18.diffusion_train_step(twin, images, rngs, optimizer) for _ in range(3)]
    close(ours, theirs, rtol=1e-5, atol=1e-6)
    close(params, nnx.to_pure_dict(nnx.state(twin, nnx.Param)), rtol=1e-4, atol=1e-6)
