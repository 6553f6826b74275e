"""Code we did not write, round seven: Equinox's layers as its own docs and tests use them, and
JAX's own docs, as written there (test_authors_round7eqx.py runs every feature over them).

Sources (each section below names its file):

- patrick-kidger/equinox@9336d820b2ef66b360fc6cb3611b3da5cefbb14d: equinox/nn/_rnn.py (GRUCell's
  and LSTMCell's docstrings), equinox/nn/_sequential.py (Lambda's docstring), tests/test_nn.py
  (test_prelu, test_weight_norm, test_spectral_norm, test_poolnetworkbackprop,
  test_convtranspose2d, test_adaptive_avgpool2d), docs/api/nn/stateful.md (Counter, a vmap'd
  stateful layer) and docs/tricks.md (model surgery, custom initialisation, custom
  per-parameter behaviour, ensembling on the same data).
- jax-ml/jax@cec06d116c05f0d52adfceee3d3b730fdbcb0ce5: docs/stateful-computations.md
  (CounterV2, linear regression), docs/notebooks/shard_map.md ("Neural networks", "8-way batch
  data parallelism", its FSDP), docs/notebooks/neural_network_with_tfds_data.md (its MLP;
  tensorflow and tensorflow_datasets are not installed: its data loading is cut) and
  jax/example_libraries/optimizers.py's module docstring (its ``step``).

Sizes are cut to the smallest that run, each cut said where it is made.
"""

import math
from functools import partial
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax import grad, jit, random, vmap
from jax.example_libraries import optimizers
from jax.scipy.special import logsumexp
from jaxtyping import Array


# -- equinox/nn/_rnn.py, GRUCell's docstring: a cell wrapped into a jax.lax.scan -----------------
class GRUModel(eqx.Module):  # the docstring's ``Model`` (LSTMCell's has one of the same name)
    cell: eqx.nn.GRUCell

    def __init__(self, **kwargs):
        self.cell = eqx.nn.GRUCell(**kwargs)

    def __call__(self, xs):
        scan_fn = lambda state, input: (self.cell(input, state), None)  # noqa: E731
        init_state = jnp.zeros(self.cell.hidden_size)
        final_state, _ = jax.lax.scan(scan_fn, init_state, xs)
        return final_state


# -- equinox/nn/_rnn.py, LSTMCell's docstring: its (h, c) carried by jax.lax.scan ---------------
class LSTMModel(eqx.Module):
    cell: eqx.nn.LSTMCell

    def __init__(self, *args, **kwargs):  # the docstring's ``(self, ...)``
        self.cell = eqx.nn.LSTMCell(*args, **kwargs)

    def __call__(self, xs):
        scan_fn = lambda state, input: (self.cell(input, state), None)  # noqa: E731
        init_state = (jnp.zeros(self.cell.hidden_size), jnp.zeros(self.cell.hidden_size))
        (h, c), _ = jax.lax.scan(scan_fn, init_state, xs)
        return h, c


# -- equinox/nn/_sequential.py, Lambda's docstring: a Sequential of a Linear, Lambda(relu), ... --
def sequential(key):
    """The docstring's ``eqx.nn.Sequential([eqx.nn.Linear(...), eqx.nn.Lambda(jax.nn.relu),
    ...])``, its ``...`` filled with an ``eqx.nn.RMSNorm`` (docs/api/nn/normalisation.md), a
    per-channel ``eqx.nn.PReLU`` as test_nn.py's test_prelu makes it and a last Linear. (The
    Sequential calls each layer with ``key=``, which PReLU takes not: equinox raises TypeError,
    so the PReLU goes in a Lambda, which drops the key; its slopes stay the model's arrays.)"""
    key1, key2 = jr.split(key)
    per_channel_alphas = jnp.array([0.2, 0.1, 0.1, 0.2, 0.1, 0.1, 0.2, 0.1])
    return eqx.nn.Sequential(
        [
            eqx.nn.Linear(5, 8, key=key1),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.RMSNorm(8),
            eqx.nn.Lambda(eqx.nn.PReLU(per_channel_alphas)),
            eqx.nn.Linear(8, 3, key=key2),
        ]
    )


# -- tests/test_nn.py, test_weight_norm: a Linear weight-normalised -----------------------------
def weight_norm_linear(key):
    linear = eqx.nn.Linear(4, 4, key=key)
    return eqx.nn.WeightNorm(layer=linear, weight_name="weight")


# -- tests/test_nn.py, test_spectral_norm: a Linear spectrally normalised (stateful) ------------
def spectral_norm(key):
    """``eqx.nn.SpectralNorm(eqx.nn.Linear(5, 6, key=...), "weight", key=...)`` and its state,
    made by ``eqx.nn.make_with_state`` (docs/api/nn/stateful.md; the test makes the state by
    ``eqx.nn.State(spectral)``, the same)."""
    key1, key2 = jr.split(key)
    return eqx.nn.make_with_state(eqx.nn.SpectralNorm)(
        eqx.nn.Linear(5, 6, key=key1), "weight", key=key2
    )


# -- tests/test_nn.py, test_poolnetworkbackprop: Conv2d, MaxPool2d, two Linears ------------------
class CNN(eqx.Module):
    conv_layer: list[eqx.nn.Conv2d | eqx.nn.MaxPool2d]
    linear_layers: list[eqx.nn.Linear]

    def __init__(self, key):
        key1, key2, key3 = jax.random.split(key, 3)
        self.conv_layer = [eqx.nn.Conv2d(3, 2, 3, key=key1), eqx.nn.MaxPool2d(2, 2)]
        # Linear(450, 256) and Linear(256, 10) over 32x32 images: 8x8 images here, 16 wide
        self.linear_layers = [
            eqx.nn.Linear(18, 16, key=key2),
            eqx.nn.Linear(16, 10, key=key3),
        ]

    def __call__(self, x):
        for layer in self.conv_layer:
            x = layer(x)
        x = jnp.ravel(x)
        for layer in self.linear_layers:
            x = layer(x)
            x = jax.nn.relu(x)
        return x


def cnn_loss_grad(cnn, x, y):
    """The test's ``loss_grad``, its ``cnn`` (closed over there) an argument."""

    @jax.vmap
    @jax.value_and_grad
    def loss_grad(x, y):
        return jax.numpy.mean((y - cnn(x)) ** 2)

    return loss_grad(x, y)


# -- tests/test_nn.py, test_convtranspose2d then test_adaptive_avgpool2d ------------------------
def upsampler(key):
    """test_convtranspose2d's strided ConvTranspose2d (3 channels in, 1 out, stride 2, padding
    1, output_padding 1, dilation 2, no bias) then test_adaptive_avgpool2d's
    ``AdaptiveAvgPool2d((2, 3))``, in a Sequential: (3, 7, 7) -> (1, 16, 16) -> (1, 2, 3). Its
    31x31 input made 7x7."""
    conv = eqx.nn.ConvTranspose2d(
        in_channels=3,
        out_channels=1,
        kernel_size=(3, 3),
        stride=2,
        padding=1,
        output_padding=1,
        dilation=2,
        use_bias=False,
        key=key,
    )
    return eqx.nn.Sequential([conv, eqx.nn.AdaptiveAvgPool2d((2, 3))])


# -- docs/api/nn/stateful.md: a custom stateful layer, and a vmap'd one ------------------------
class Counter(eqx.Module):
    index: eqx.nn.StateIndex

    def __init__(self):
        init_state = jnp.array(0)
        self.index = eqx.nn.StateIndex(init_state)

    def __call__(self, x: Array, state: eqx.nn.State) -> tuple[Array, eqx.nn.State]:
        value = state.get(self.index)
        new_x = x + value
        new_state = state.set(self.index, value + 1)
        return new_x, new_state


class CounterModel(eqx.Module):  # the page's ``Model``
    linear: eqx.nn.Linear
    counter: Counter
    v_counter: Counter

    def __init__(self, key):
        # Not-stateful layer
        self.linear = eqx.nn.Linear(2, 2, key=key)
        # Stateful layer.
        self.counter = Counter()
        # Vmap'd stateful layer. (Whose initial state will include a batch dimension.)
        self.v_counter = eqx.filter_vmap(Counter, axis_size=2)()

    def __call__(self, x: Array, state: eqx.nn.State) -> tuple[Array, eqx.nn.State]:
        # This bit happens as normal.
        assert x.shape == (2,)
        x = self.linear(x)
        x, state = self.counter(x, state)

        # For the vmap, we have to restrict our state to just those states we want to
        # vmap, and then update the overall state again afterwards.
        #
        # After all, the state for `self.counter` isn't expecting to be batched, so we
        # have to remove that.
        substate = state.substate(self.v_counter)
        x, substate = eqx.filter_vmap(self.v_counter)(x, substate)
        state = state.update(substate)

        return x, state


# -- docs/tricks.md: surgery, custom initialisation, custom per-parameter behaviour ------------
def trunc_init(weight: jax.Array, key: jax.random.PRNGKey) -> jax.Array:
    out, in_ = weight.shape
    stddev = math.sqrt(1 / in_)
    return stddev * jax.random.truncated_normal(key, shape=(out, in_), lower=-2, upper=2)


def init_linear_weight(model, init_fn, key):
    is_linear = lambda x: isinstance(x, eqx.nn.Linear)  # noqa: E731
    get_weights = lambda m: [x.weight  # noqa: E731
                             for x in jax.tree_util.tree_leaves(m, is_leaf=is_linear)
                             if is_linear(x)]  # fmt: skip
    weights = get_weights(model)
    new_weights = [
        init_fn(weight, subkey)
        for weight, subkey in zip(weights, jax.random.split(key, len(weights)))  # noqa: B905
    ]
    new_model = eqx.tree_at(get_weights, model, new_weights)
    return new_model


class Symmetric(eqx.Module):
    matrix: jax.Array

    def get(self):
        return 0.5 * (self.matrix + self.matrix.T)


def is_symmetric(x):
    return isinstance(x, Symmetric)


def maybe_symmetric(x):
    if is_symmetric(x):
        return x.get()
    else:
        return x  # leave everything else unchanged


def resolve_symmetric(model):
    return jax.tree_util.tree_map(maybe_symmetric, model, is_leaf=is_symmetric)


def symmetric_model(model):
    """The page's user code: every Linear's weight wrapped in Symmetric by eqx.tree_at."""
    is_linear = lambda x: isinstance(x, eqx.nn.Linear)  # noqa: E731
    get_weights = lambda m: [x.weight  # noqa: E731
                             for x in jax.tree_util.tree_leaves(m, is_leaf=is_linear)
                             if is_linear(x)]  # fmt: skip
    return eqx.tree_at(get_weights, model, replace_fn=Symmetric)


@eqx.filter_grad
def loss_fn(model, x, y):
    model = resolve_symmetric(model)
    pred_y = jax.vmap(model)(x)
    return jnp.sum((y - pred_y) ** 2)


def symmetric_forward(model, x):
    """``loss_fn``'s prediction: the model resolved, then ``jax.vmap(model)(x)``."""
    model = resolve_symmetric(model)
    return jax.vmap(model)(x)


# Ensembling: every member on the same data
@eqx.filter_vmap
def make_ensemble(key):
    return eqx.nn.MLP(2, 2, 2, 2, key=key)


@eqx.filter_vmap(in_axes=(eqx.if_array(0), None))
def evaluate_ensemble(model, x):
    return model(x)


# -- jax docs/stateful-computations.md: explicit state -----------------------------------------
CounterState = int


class CounterV2:
    def count(self, n: CounterState) -> tuple[int, CounterState]:
        # You could just return n+1, but here we separate its role as
        # the output and as the counter state for didactic purposes.
        return n + 1, n + 1

    def reset(self) -> CounterState:
        return 0


class Params(NamedTuple):
    weight: jnp.ndarray
    bias: jnp.ndarray


def init(rng) -> Params:
    """Returns the initial model params."""
    weights_key, bias_key = jax.random.split(rng)
    weight = jax.random.normal(weights_key, ())
    bias = jax.random.normal(bias_key, ())
    return Params(weight, bias)


def loss(params: Params, x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    """Computes the least squares error of the model's predictions on x against y."""
    pred = params.weight * x + params.bias
    return jnp.mean((pred - y) ** 2)


LEARNING_RATE = 0.005


@jax.jit
def update(params: Params, x: jnp.ndarray, y: jnp.ndarray) -> Params:
    """Performs one SGD update step on params using the given data."""
    grad = jax.grad(loss)(params, x, y)
    new_params = jax.tree.map(lambda param, g: param - g * LEARNING_RATE, params, grad)
    return new_params


def regression_data():
    """The page's data, 128 rows: y = 2x - 1 + noise."""
    rng = jax.random.key(42)
    true_w, true_b = 2, -1
    x_rng, noise_rng = jax.random.split(rng)
    xs = jax.random.normal(x_rng, (128, 1))
    noise = jax.random.normal(noise_rng, (128, 1)) * 0.5
    ys = xs * true_w + true_b + noise
    return xs, ys


# -- jax docs/notebooks/shard_map.md, "Neural networks": the toy network and its DP loss ------
def sm_predict(params, inputs):  # the notebook's ``predict``
    for W, b in params:
        outputs = jnp.dot(inputs, W) + b
        inputs = jax.nn.relu(outputs)
    return outputs


def sm_loss(params, batch):  # the notebook's ``loss``
    inputs, targets = batch
    predictions = sm_predict(params, inputs)
    return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))


def init_layer(key, n_in, n_out):
    k1, k2 = jax.random.split(key)
    W = jax.random.normal(k1, (n_in, n_out)) / jnp.sqrt(n_in)
    b = jax.random.normal(k2, (n_out,))
    return W, b


def sm_init(key, layer_sizes, batch_size):  # the notebook's ``init``
    key, *keys = jax.random.split(key, len(layer_sizes))
    params = list(map(init_layer, keys, layer_sizes[:-1], layer_sizes[1:]))

    key, *keys = jax.random.split(key, 3)
    inputs = jax.random.normal(keys[0], (batch_size, layer_sizes[0]))
    targets = jax.random.normal(keys[1], (batch_size, layer_sizes[-1]))

    return params, (inputs, targets)


layer_sizes = [16, 8, 8, 4]  # [784, 128, 128, 128, 128, 128, 8]
batch_size = 32


def loss_dp_of(P):
    """``loss_dp`` as the notebook decorates it, ``@jax.shard_map(out_specs=P())``, over the
    mesh set by ``jax.set_mesh`` when this is called (the decorator binds it when it runs)."""

    @jax.shard_map(out_specs=P())
    def loss_dp(params, local_batch):
        inputs, targets = local_batch
        predictions = sm_predict(params, inputs)  # use reference 'predict`
        local_loss = jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))
        return jax.lax.pmean(local_loss, "batch")

    return loss_dp


def loss_fsdp_of(P):
    """``loss_fsdp``, the notebook's FSDP (its params sharded ``P('batch')``, each layer's
    fragments all-gathered inside a remat that saves no all_gather), over the mesh set by
    ``jax.set_mesh`` when this is called."""

    @partial(jax.remat, policy=lambda op, *_, **__: str(op) != "all_gather")
    def predict_fsdp(params_frag, inputs):
        for W_frag, b_frag in params_frag:
            W = jax.lax.all_gather(W_frag, "batch", tiled=True)
            b = jax.lax.all_gather(b_frag, "batch", tiled=True)
            outputs = jnp.dot(inputs, W) + b
            inputs = jax.nn.relu(outputs)
        return outputs

    @jax.shard_map(out_specs=P())
    def loss_fsdp(local_params, local_batch):
        inputs, targets = local_batch
        predictions = predict_fsdp(local_params, inputs)
        local_loss = jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))
        return jax.lax.pmean(local_loss, "batch")

    return loss_fsdp


# -- jax docs/notebooks/neural_network_with_tfds_data.md: a per-example MLP, vmapped ------------
def random_layer_params(m, n, key, scale=1e-2):
    w_key, b_key = random.split(key)
    return scale * random.normal(w_key, (n, m)), scale * random.normal(b_key, (n,))


def init_network_params(sizes, key):
    keys = random.split(key, len(sizes))
    return [random_layer_params(m, n, k) for m, n, k in zip(sizes[:-1], sizes[1:], keys)]  # noqa: B905


tfds_layer_sizes = [16, 8, 8, 10]  # [784, 512, 512, 10]
step_size = 0.01
n_targets = 10


def relu(x):
    return jnp.maximum(0, x)


def predict(params, image):
    # per-example predictions
    activations = image
    for w, b in params[:-1]:
        outputs = jnp.dot(w, activations) + b
        activations = relu(outputs)

    final_w, final_b = params[-1]
    logits = jnp.dot(final_w, activations) + final_b
    return logits - logsumexp(logits)


batched_predict = vmap(predict, in_axes=(None, 0))


def one_hot(x, k, dtype=jnp.float32):
    """Create a one-hot encoding of x of size k."""
    return jnp.array(x[:, None] == jnp.arange(k), dtype)


def accuracy(params, images, targets):
    target_class = jnp.argmax(targets, axis=1)
    predicted_class = jnp.argmax(batched_predict(params, images), axis=1)
    return jnp.mean(predicted_class == target_class)


def tfds_loss(params, images, targets):  # the notebook's ``loss``
    preds = batched_predict(params, images)
    return -jnp.mean(preds * targets)


@jit
def tfds_update(params, x, y):  # the notebook's ``update``
    grads = grad(tfds_loss)(params, x, y)
    return [(w - step_size * dw, b - step_size * db)
            for (w, b), (dw, db) in zip(params, grads)]  # fmt: skip  # noqa: B905


# -- jax/example_libraries/optimizers.py's docstring: its Example Usage ------------------------
def optimizers_steps(loss_fn, params, learning_rate, num_steps):
    """The docstring's example: ``(values, params)`` after ``num_steps`` of ``step``."""
    opt_init, opt_update, get_params = optimizers.sgd(learning_rate)
    opt_state = opt_init(params)

    def step(step, opt_state):
        value, grads = jax.value_and_grad(loss_fn)(get_params(opt_state))
        opt_state = opt_update(step, grads, opt_state)
        return value, opt_state

    values = []
    for i in range(num_steps):
        value, opt_state = step(i, opt_state)
        values.append(value)
    return values, get_params(opt_state)
