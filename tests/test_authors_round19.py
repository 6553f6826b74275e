"""Code we did not write, round nineteen (tests/zoo19.py; sources and commits there), over
every feature: hybridize, ``h(x)`` equal to the plain model, its graph, export + load + call
equal, grads/Hessians over the loaded model, a Batcher's answers, and what is specific.

- Haiku's mnist.py: ``hk.without_apply_rng(hk.transform(net_fn))`` hybridized as
  ``hybridize(network.apply, params)`` over every feature, batch symbolic; three of the
  example's ``update`` (adam, its L2 loss, the EMA ``avg_params``) equal three of ours over
  ``h.apply``. The README's ``forward_fn`` (``MyLinear``) under ``hk.transform``, its apply
  called with the README's ``None`` rng. ``MyDropout``: ``h(key, x)`` as ``forward.apply(params,
  key, x)`` for raw and typed keys; export of the raw key first (the rng's place in
  ``apply``) was refused as inputs of unequal rows, the fix unsaid; now the refusal names the
  key and the ``shapes=`` that exports it, and that artifact's masks are Haiku's key by key.
  ``hk.transform_with_state``'s ResNet (``is_training`` a setting): ``h(state, None, x,
  is_training=True)`` returns Haiku's output and new state, the eval function over every
  feature. haiku_lstms.ipynb's ``unroll_net`` (an LSTM under ``hk.dynamic_unroll``) over every
  feature, its ``update`` against ours. An ``f`` whose ``rng`` argument apply's signature
  lost goes in positionally, as apply takes it.
- Diffrax's neural_ode.ipynb (in a process of its own, ``EQX_ON_ERROR=off``, as our refusal
  says): see ``test_neural_ode_...``; continuous_normalising_flow.ipynb's ``CNF.train``
  (tests/zoo19b.py) likewise, its grads through the loaded model as diffrax's.
"""

import os
import re
import subprocess
import sys
import textwrap

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo19
from features import close, every_feature
from flax import nnx

import symjax_mlp as sm


def _images(n=4):
    return jax.random.uniform(jax.random.key(1), (n, 28, 28, 1)) * 255


@pytest.mark.slow  # a compile or more (~3 s or more)
def test_mnist_net_every_feature_and_the_examples_update(tmp_path):
    """mnist.py's network as its ``apply`` and params over every feature; three of the
    example's ``update`` equal three adam steps of its ``loss`` over ``h.apply``."""
    network = hk.without_apply_rng(hk.transform(zoo19.net_fn))
    images = _images()
    params = network.init(jax.random.PRNGKey(0), images)
    h = sm.hybridize(network.apply, params)
    every_feature(tmp_path, h, lambda x: network.apply(params, x), images)

    optimiser = optax.adam(1e-3)
    loss, update = zoo19.authors_update(network, optimiser)
    batch = zoo19.Batch(images, jnp.arange(4) % zoo19.NUM_CLASSES)
    state = zoo19.TrainingState(params, params, optimiser.init(params))
    p, opt, avg = h.params, optimiser.init(h.params), h.params

    def ours(p, b):
        logits = h.apply(p, b.image)
        l2 = 0.5 * sum(jnp.sum(jnp.square(w)) for w in jax.tree.leaves(p))
        labels = jax.nn.one_hot(b.label, zoo19.NUM_CLASSES)
        return -jnp.sum(labels * jax.nn.log_softmax(logits)) / len(b.image) + 1e-4 * l2

    for _ in range(3):
        close(jax.grad(ours)(p, batch), jax.grad(loss)(state.params, batch))
        state = update(state, batch)
        updates, opt = optimiser.update(jax.grad(ours)(p, batch), opt)
        p = optax.apply_updates(p, updates)
        avg = optax.incremental_update(p, avg, step_size=0.001)
    close(p, state.params)
    close(avg, state.avg_params)
    close(h.replace(params=avg)(images), network.apply(state.avg_params, images))


@pytest.mark.slow  # a compile or more (~3 s or more)
def test_readme_forward_fn_with_its_none_rng(tmp_path):
    """README's ``forward_fn`` (``MyLinear``) under ``hk.transform``: the Hybrid of its apply
    called and exported with the README's ``None`` rng answers as ``forward.apply``."""
    forward = hk.transform(zoo19.forward_fn)
    x = jax.random.normal(jax.random.key(2), (4, 3))
    params = forward.init(next(hk.PRNGSequence(42)), x)
    h = sm.hybridize(forward.apply, params)
    close(h(None, x), forward.apply(params, None, x))
    one = sm.hybridize(lambda p, x: forward.apply(p, None, x), params)
    every_feature(tmp_path, one, lambda r: forward.apply(params, None, r), x)


@pytest.mark.slow  # a compile or more (~3 s or more)
def test_my_dropout_rng_first_exports_as_the_refusal_says(tmp_path):
    """README's ``MyDropout``: ``h(key, x)`` is ``forward.apply(params, key, x)`` for a raw
    and a typed key; export with the raw key first was refused as inputs of unequal rows;
    now the refusal names the key and ``shapes=``, and that artifact's masks are Haiku's."""
    forward = hk.transform(lambda x: zoo19.MyDropout()(x))
    key1, key2 = jax.random.split(jax.random.PRNGKey(42), 2)
    x = jax.random.normal(jax.random.key(2), (4, 3))
    params = forward.init(key1, x)
    h = sm.hybridize(forward.apply, params)
    for key in (key2, jax.random.key(7)):
        close(h(key, x), forward.apply(params, key, x))
    with pytest.raises(
        sm.SignatureError, match=r"raw jax.random.PRNGKey.*shapes=\(None, 'b, \.\.\.'\)"
    ):
        sm.export(h, tmp_path / "refused", example=(key2, x))
    sm.export(h, tmp_path / "m", example=(key2, x), shapes=(None, "b, ..."))
    m = sm.load(tmp_path / "m")
    for key in (key2, jax.random.PRNGKey(9)):
        close(m(np.asarray(key), np.asarray(x[:3])), forward.apply(params, key, x[:3]))


@pytest.mark.slow  # a compile or more (~3 s or more)
def test_transform_with_state_resnet_state_and_eval_every_feature(tmp_path):
    """The README's ``transform_with_state`` ResNet: ``h(state, None, x, is_training=True)``
    returns Haiku's output and state, twice over; its eval (the state the training calls
    left) over every feature, batch static: its export was refused, "param key
    'res_net18/~/block_group_0/...' ... contains '/' ... Rename it" (Haiku names every module
    so); the loaded model takes Haiku's params tree as ``load(params=...)``."""
    fwd = hk.transform_with_state(zoo19.forward)
    x = jax.random.normal(jax.random.key(3), (2, 16, 16, 3))
    params, state = fwd.init(jax.random.PRNGKey(0), x, is_training=True)
    h = sm.hybridize(fwd.apply, params)
    ours, theirs = state, state
    for _ in range(2):
        out, ours = h(ours, None, x, is_training=True)
        want, theirs = fwd.apply(params, theirs, None, x, is_training=True)
        close(out, want, rtol=1e-4, atol=1e-4)
        close(ours, theirs, rtol=1e-4, atol=1e-4)
    ev = lambda p, r: fwd.apply(p, theirs, None, r, is_training=False)[0]  # noqa: E731
    every_feature(tmp_path, sm.hybridize(ev, params), lambda r: ev(params, r), x, batch=None,
                  allow={"convolution", "reduce_window", "select_and_scatter"},
                  rtol=1e-4, atol=1e-4)  # fmt: skip
    m = sm.load(
        tmp_path / "m", allow={"convolution", "reduce_window", "select_and_scatter"}, params=params
    )  # Haiku's own tree, its keys 'res_net18/~/...'
    close(m(np.asarray(x)), ev(params, x), rtol=1e-4, atol=1e-4)


_ODE = r"""
import sys; sys.path.insert(0, sys.argv[2])
import diffrax, equinox as eqx, jax, jax.numpy as jnp, jax.random as jr, numpy as np, optax
import pytest, zoo19
from features import close
import symjax_mlp as sm
model = zoo19.NeuralODE(2, 8, 2, key=jr.PRNGKey(5678))
ts, y0 = jnp.linspace(0, 1, 5), jr.uniform(jr.PRNGKey(1), (4, 2), minval=-0.6, maxval=1)
f = lambda m, y: jax.vmap(m, in_axes=(None, 0))(ts, y)
h = sm.hybridize(f, model)
close(h(y0), f(model, y0))
with pytest.raises(sm.ConfigError, match="VJP of order 2 .*Export it with vjp_order=1"):
    sm.export(h, sys.argv[1] + "/two", example=(y0,), vjp_order=2)
sm.export(h, sys.argv[1] + "/m", example=(y0,), vjp_order=1)
with pytest.raises(sm.ArtifactError, match=r"constant ran 65,536 trips \(a bound the check"):
    sm.load(sys.argv[1] + "/m")  # the adaptive loop's trips are data's: counted at the bound
m = sm.load(sys.argv[1] + "/m", allow={"compute", "while", "scatter", "gather", "dynamic_slice",
    "dynamic_gather", "dynamic_update_slice", "sort", "dynamic_update_slice"})
close(m(np.asarray(y0[:3])), f(model, y0[:3]))
close(jax.grad(lambda r: m(r).sum())(y0[:3]), jax.grad(lambda r: f(model, r).sum())(y0[:3]))
# the notebook's make_step (adabelief) against ours over the Hybrid's apply, three steps
optim = optax.adabelief(3e-3)
make_step = zoo19.authors_make_step(optim)
ts_d, ys = zoo19.get_data(8, key=jr.PRNGKey(0))
ti = ts_d[:10]
hh = sm.hybridize(lambda m, ti, y0: jax.vmap(m, in_axes=(None, 0))(ti, y0), model)
p, opt = hh.params, optim.init(hh.params)
opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
loss = lambda p, yi: jnp.mean((yi - hh.apply(p, ti, yi[:, 0])) ** 2)
for _, (yi,) in zip(range(3), zoo19.dataloader((ys[:, :10],), 4, key=jr.PRNGKey(2))):
    theirs, model, opt_state = make_step(ti, yi, model, opt_state)
    mine, grads = jax.value_and_grad(loss)(p, yi)
    updates, opt = optim.update(grads, opt)
    p = optax.apply_updates(p, updates)
    close(mine, theirs)
close(p, eqx.filter(model, eqx.is_inexact_array))
# BacksolveAdjoint: the Hybrid's param grads and the loaded model's input grads as diffrax's
def back(m, y0):
    solve = lambda y: diffrax.diffeqsolve(
        diffrax.ODETerm(m.func), diffrax.Tsit5(), ts[0], ts[-1], ts[1] - ts[0], y,
        stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-6),
        saveat=diffrax.SaveAt(ts=ts), adjoint=diffrax.BacksolveAdjoint()).ys
    return jax.vmap(solve)(y0)
hb = sm.hybridize(back, model)
close(jax.grad(lambda q: hb.apply(q, y0).sum())(hb.params),
      eqx.filter_grad(lambda mm: back(mm, y0).sum())(model))
sm.export(hb, sys.argv[1] + "/b", example=(y0,), vjp_order=1)
mb = sm.load(sys.argv[1] + "/b", trust=True)
close(mb(np.asarray(y0[:3])), back(model, y0[:3]))
close(jax.grad(lambda r: mb(r).sum())(y0[:3]), jax.grad(lambda r: back(model, r).sum())(y0[:3]))
# the README's quick example (Dopri5, dt0=0.1): its solve of each row's y0
rs = lambda p, y: jax.vmap(zoo19.readme_solve)(y * p["s"])
hr = sm.hybridize(rs, {"s": jnp.asarray(1.0)})
sm.export(hr, sys.argv[1] + "/r", example=(y0,), vjp_order=1)
mr = sm.load(sys.argv[1] + "/r", trust=True)
close(mr(np.asarray(y0[:3])), jax.vmap(zoo19.readme_solve)(y0[:3]))
close(jax.grad(lambda r: mr(r).sum())(y0[:3]), jax.grad(lambda r: rs(hr.params, r).sum())(y0[:3]))
print("ok")
"""


@pytest.mark.slow  # a compile or more (~3 s or more)
def test_neural_ode_through_the_loaded_model(tmp_path):
    """neural_ode.ipynb's ``NeuralODE`` (Tsit5, PIDController, RecursiveCheckpointAdjoint) over
    a batch of initial values, in a process of its own under ``EQX_ON_ERROR=off`` (diffrax's
    max-steps check is an ``eqx.error_if``, which our refusal names): the Hybrid, the loaded
    model and its grads equal the original's; load's refusal counts its adaptive loops at the
    check's bound and now says so (it said only "could take hours", of a call of
    milliseconds); ``vjp_order=2`` is refused naming order 1 (the original's own
    ``jacrev(jacrev)`` fails: its loop's trip count is data's); three of the notebook's
    ``make_step`` (adabelief) equal three steps over ``h.apply``; under ``BacksolveAdjoint``
    the Hybrid's param grads and the loaded model's input grads are diffrax's; so are the
    README's quick example's (Dopri5) through its loaded model."""
    here = os.path.dirname(__file__)
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_ODE), str(tmp_path), here],
        env={**os.environ, "EQX_ON_ERROR": "off"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0 and run.stdout.split()[-1] == "ok", run.stderr[-3000:]


@pytest.mark.slow  # a compile or more (~3 s or more)
def test_params_whose_slashed_keys_join_to_one_path_are_refused(tmp_path):
    """Keys holding '/' are stored as Haiku names them; two that join to the same path
    ({'a/b': w, 'a': {'b': v}}) are refused naming it (one would have shadowed the other)."""
    p = {"a/b": jnp.ones(3), "a": {"b": jnp.zeros(3)}}
    h = sm.hybridize(lambda p, x: x * p["a/b"] + p["a"]["b"], p)
    with pytest.raises(sm.ConfigError, match=r"two params share the path 'a/b' .*'a/b' and 'a'"):
        sm.export(h, tmp_path / "m", example=(jnp.ones((2, 3)),))


def test_an_init_apply_pair_is_told_to_hybridize_its_apply():
    """``hybridize(f, params)`` of Haiku's ``Transformed`` and ``TransformedWithState`` (an
    (init, apply) pair, not callable) said only what it expects; now it names ``f.apply``, the
    params of ``init``'s ``(params, state)``, and the rng and state arguments of ``h``."""
    for make in (hk.transform, hk.transform_with_state):
        with pytest.raises(sm.ConfigError, match=r"got Transformed.*sm.hybridize\(f.apply, "):
            sm.hybridize(make(zoo19.forward_fn), {"my_linear": {"w": jnp.ones((3, 10))}})


@pytest.mark.slow  # two exports (~3 s)
def test_transform_with_state_apply_exports_as_its_refusal_writes_it(tmp_path):
    """``transform_with_state``'s apply exported with its state dict, the ``None`` rng and
    ``is_training`` as Haiku's users pass them: refused (an artifact's inputs are arrays),
    naming a function over the dict's leaves. That function called ``h.apply(params, state,
    x)``, dropping the settings between and after (Haiku then took ``x`` as its rng); now
    they are in their places, and the function as written exports and answers as Haiku."""
    fwd = hk.transform_with_state(
        lambda x, is_training: hk.Linear(2)(hk.BatchNorm(True, True, 0.9)(x, is_training))
    )
    x = jax.random.normal(jax.random.key(4), (4, 3))
    params, state = fwd.init(jax.random.PRNGKey(0), x, True)
    h = sm.hybridize(fwd.apply, params)
    with pytest.raises(sm.SignatureError, match=r"args\[0\] is a dict") as refused:
        sm.export(h, tmp_path / "refused", example=(state, None, x, False), batch=None)
    leaves, tree = jax.tree.flatten(state)
    written = re.search(r"sm\.hybridize\(lambda .*?, h\.params\)", str(refused.value)).group()
    f = eval(written, {"sm": sm, "jax": jax, "h": h, "tree": tree})  # our advice, as written
    g = sm.hybridize(lambda p, *xs: tuple(jax.tree.leaves(f.apply(p, *xs))), h.params)
    sm.export(g, tmp_path / "m", example=(*leaves, x), batch=None)
    m = sm.load(tmp_path / "m")
    close(
        m(*map(np.asarray, leaves), np.asarray(x)),
        tuple(jax.tree.leaves(fwd.apply(params, state, None, x, False))),
    )


def _noisy(x, rng=None):  # an f whose argument Haiku's apply also names: rng
    y = hk.Linear(3)(x)
    return y if rng is None else y + jax.random.normal(rng, y.shape)


@pytest.mark.slow  # compiles and an export (~2 s)
def test_an_argument_named_as_apply_s_rng_goes_in_as_apply_takes_it(tmp_path):
    """``f(x, rng=None)``: Haiku's apply declares ``(params, rng=None, x)`` (f's ``rng`` lost
    into its own, a default before ``x``), and ``hybridize`` raised inspect's ValueError;
    ``without_apply_rng``'s declares ``(params, x)``, and export refused ``(x, key)`` as too
    many arguments. Both go in positionally, as apply takes them; by name, Haiku says why not."""
    x, key = jax.random.normal(jax.random.key(2), (4, 3)), jax.random.PRNGKey(5)
    forward = hk.transform(_noisy)
    params = forward.init(jax.random.PRNGKey(0), x)
    close(sm.hybridize(forward.apply, params)(None, x, key), forward.apply(params, None, x, key))
    bare = hk.without_apply_rng(hk.transform(_noisy))
    h = sm.hybridize(bare.apply, params)
    close(h(x, key), bare.apply(params, x, key))
    with pytest.raises(TypeError, match="pass them positionally"):
        h(x, rng=key)
    sm.export(h, tmp_path / "m", example=(x, key), shapes=("b, ...", None))
    m = sm.load(tmp_path / "m")
    close(m(np.asarray(x[:2]), np.asarray(key)), bare.apply(params, x[:2], key))
    linear = nnx.Linear(3, 2, rngs=nnx.Rngs(0))  # stage's wrapper of (*args, **kwargs): as declared
    with pytest.raises(sm.SignatureError, match=r"do not fit Linear's inputs \(inputs, "):
        sm.stage(linear)(x, nope=1)


@pytest.mark.slow  # an unroll's export of vjp_order=2 and its loads (~30 s)
def test_haiku_lstms_unroll_net_every_feature_and_its_update(tmp_path):
    """haiku_lstms.ipynb's ``unroll_net`` (``hk.LSTM`` under ``hk.dynamic_unroll``, time-major
    ``[T, B, F]``, so the batch static): ``h(None, x)`` is ``model.apply``'s output and
    ``LSTMState``, its prediction over every feature (a scan's slices allowed); three of
    ``train_model``'s ``update`` (adam over its MSE) equal three steps over ``h.apply``."""
    x, y = zoo19.sine_seq(np.array([0.1, 1.0, 2.0, 3.0]), 6, 3 * 6 / 4)
    x, y = jnp.asarray(x[..., None], jnp.float32), jnp.asarray(y[..., None], jnp.float32)
    params = zoo19.model.init(jax.random.PRNGKey(428), x)
    h = sm.hybridize(zoo19.model.apply, params)
    close(h(None, x), zoo19.model.apply(params, None, x))
    pred = sm.hybridize(lambda p, s: zoo19.model.apply(p, None, s)[0], params)
    allow = {"dynamic_slice", "dynamic_update_slice"}
    every_feature(tmp_path, pred, lambda s: zoo19.model.apply(params, None, s)[0], x,
                  batch=None, allow=allow)  # fmt: skip

    opt = optax.adam(1e-3)
    loss, update = zoo19.authors_lstm_update(opt)
    theirs, their_opt = params, opt.init(params)
    p, o = h.params, opt.init(h.params)

    def ours(p, x, y):
        return jnp.mean(jnp.square(h.apply(p, None, x)[0] - y))

    for step in range(3):
        their_loss, theirs, their_opt = update(step, theirs, their_opt, x, y)
        got, grads = jax.value_and_grad(ours)(p, x, y)
        close(got, their_loss)
        updates, o = opt.update(grads, o)
        p = optax.apply_updates(p, updates)
    close(p, theirs)
    close(ours(p, x, y), loss(theirs, x, y))
    close(h.replace(params=p)(None, x), zoo19.model.apply(theirs, None, x))


_CNF = r"""
import sys; sys.path.insert(0, sys.argv[2])
import equinox as eqx, jax, jax.random as jr, numpy as np, pytest, zoo19b
from features import close
import symjax_mlp as sm
model = zoo19b.CNF(data_size=2, exact_logp=True, num_blocks=1, width_size=8, depth=1,
                   key=jr.PRNGKey(5678))
y = jr.uniform(jr.PRNGKey(1), (4, 2), minval=-1, maxval=1)
f = lambda m, y: jax.vmap(lambda r: m.train(r, key=jr.PRNGKey(0)))(y)
h = sm.hybridize(f, model)
close(h(y), f(model, y))
assert h.graph(y).flops > 0
close(jax.grad(lambda q: h.apply(q, y).sum())(h.params),
      eqx.filter_grad(lambda mm: f(mm, y).sum())(model))
with pytest.raises(sm.ConfigError, match="VJP of order 2 .*Export it with vjp_order=1"):
    sm.export(h, sys.argv[1] + "/two", example=(y,), vjp_order=2)
with pytest.raises(ValueError, match="Reverse-mode differentiation does not work"):
    jax.jacrev(jax.jacrev(lambda r: f(model, r[None]).sum()))(y[0])  # nor does the original
sm.export(h, sys.argv[1] + "/m", example=(y,), vjp_order=1)
m = sm.load(sys.argv[1] + "/m", trust=True)
rows, one = y[:3], lambda g: lambda r: g(r[None]).sum()
close(m(np.asarray(rows)), f(model, rows))
close(jax.grad(lambda r: m(r).sum())(rows), jax.grad(lambda r: f(model, r).sum())(rows))
close(jax.vmap(jax.grad(one(m)))(y), jax.vmap(jax.grad(one(lambda r: f(model, r))))(y))
with sm.serving.Batcher(m, max_batch=4) as b:
    got = [b.submit(np.asarray(y[i : i + 1])).result(30) for i in range(2)]
close(np.concatenate(got), f(model, y[:2]))
print("ok")
"""


@pytest.mark.slow  # a process of its own, exports of nested solves (~60 s)
def test_continuous_normalising_flow_through_the_loaded_model(tmp_path):
    """continuous_normalising_flow.ipynb's ``CNF.train`` (``exact_logp``: a ``jax.vjp`` in the
    vector field, Tsit5's fixed steps backward in time) over a batch, in a process of its own
    under ``EQX_ON_ERROR=off``: the Hybrid, its param grads, the loaded model, its input grads
    (per row too) and a Batcher's answers equal the original's; ``vjp_order=2`` is refused
    naming order 1, as the original's own Hessian fails."""
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CNF), str(tmp_path), os.path.dirname(__file__)],
        env={**os.environ, "EQX_ON_ERROR": "off"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0 and run.stdout.split()[-1] == "ok", run.stderr[-3000:]
