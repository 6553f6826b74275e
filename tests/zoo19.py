"""Code we did not write, round nineteen: Diffrax's and Haiku's own examples, as their authors
wrote them (sizes are the test's), for tests/test_authors_round19.py.

patrick-kidger/diffrax at 5ea5fcb05058bd22548300a10ea5ef5ce7fb75bb:

- docs/examples/neural_ode.ipynb: ``Func`` (an equinox MLP vector field, ``out_scale *
  tanh(MLP)``), ``NeuralODE`` (``diffeqsolve`` of ``Tsit5`` with a ``PIDController``'s
  adaptive steps inside the model), ``_get_data``/``get_data`` and ``dataloader``; ``main``'s
  ``grad_loss`` and ``make_step`` are kept as written, in ``authors_make_step(optim)`` (in the
  notebook they are nested in ``main``, whose data, plot and loop are left out).
- README.md's quick example: ``f`` (``-y``) under ``Dopri5``, ``t0=0, t1=1, dt0=0.1``.

google-deepmind/dm-haiku at f4d858a5cbb29140855d68f81f5fd625e078a5ae:

- examples/mnist.py: ``net_fn`` (LeNet-300-100 over ``images / 255``), ``TrainingState``,
  and ``main``'s ``loss`` and ``update`` kept as written in ``authors_update(network,
  optimiser)`` (nested in ``main`` there; its tfds data and loop left out).
- README.md: ``MyLinear``, ``forward_fn``, ``MyDropout`` (``hk.next_rng_key`` in a module
  of ``hk.transform``) and the non-trainable state example, ``forward(x, is_training)`` of
  ``hk.transform_with_state``, whose ``hk.nets.ResNet50(1000)`` is cut to ``hk.nets.ResNet18``
  of 10 classes (``hk.nets.ResNet``'s BatchNorm state, as the README means it).
- examples/haiku_lstms.ipynb: ``sine_seq``, ``unroll_net`` (``hk.LSTM(32)`` cut to 8) and
  ``model``; ``train_model``'s ``loss`` and ``update`` kept as written, in
  ``authors_lstm_update(opt)`` (its data, plots and loop left out).
"""

import math
from typing import NamedTuple

import diffrax
import equinox as eqx
import haiku as hk
import jax
import jax.nn as jnn
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

# --- diffrax: docs/examples/neural_ode.ipynb ---


class Func(eqx.Module):
    out_scale: jax.Array
    mlp: eqx.nn.MLP

    def __init__(self, data_size, width_size, depth, *, key, **kwargs):
        super().__init__(**kwargs)
        self.out_scale = jnp.array(1.0)
        self.mlp = eqx.nn.MLP(
            in_size=data_size,
            out_size=data_size,
            width_size=width_size,
            depth=depth,
            activation=jnn.softplus,
            final_activation=jax.nn.tanh,
            key=key,
        )

    def __call__(self, t, y, args):
        # Best practice is often to use `learnt_scalar * tanh(MLP(...))` for the
        # vector field.
        return self.out_scale * self.mlp(y)


class NeuralODE(eqx.Module):
    func: Func

    def __init__(self, data_size, width_size, depth, *, key, **kwargs):
        super().__init__(**kwargs)
        self.func = Func(data_size, width_size, depth, key=key)

    def __call__(self, ts, y0):
        solution = diffrax.diffeqsolve(
            diffrax.ODETerm(self.func),
            diffrax.Tsit5(),
            t0=ts[0],
            t1=ts[-1],
            dt0=ts[1] - ts[0],
            y0=y0,
            stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-6),
            saveat=diffrax.SaveAt(ts=ts),
        )
        return solution.ys


def _get_data(ts, *, key):
    y0 = jr.uniform(key, (2,), minval=-0.6, maxval=1)

    def f(t, y, args):
        x = y / (1 + y)
        return jnp.stack([x[1], -x[0]], axis=-1)

    solver = diffrax.Tsit5()
    dt0 = 0.1
    saveat = diffrax.SaveAt(ts=ts)
    sol = diffrax.diffeqsolve(diffrax.ODETerm(f), solver, ts[0], ts[-1], dt0, y0, saveat=saveat)
    ys = sol.ys
    return ys


def get_data(dataset_size, *, key):
    ts = jnp.linspace(0, 10, 100)
    key = jr.split(key, dataset_size)
    ys = jax.vmap(lambda key: _get_data(ts, key=key))(key)
    return ts, ys


def dataloader(arrays, batch_size, *, key):
    dataset_size = arrays[0].shape[0]
    assert all(array.shape[0] == dataset_size for array in arrays)
    indices = jnp.arange(dataset_size)
    while True:
        perm = jr.permutation(key, indices)
        (key,) = jr.split(key, 1)
        start = 0
        end = batch_size
        while end < dataset_size:
            batch_perm = perm[start:end]
            yield tuple(array[batch_perm] for array in arrays)
            start = end
            end = start + batch_size


def authors_make_step(optim):
    """``main``'s ``grad_loss`` and ``make_step``, as written there."""

    @eqx.filter_value_and_grad
    def grad_loss(model, ti, yi):
        y_pred = jax.vmap(model, in_axes=(None, 0))(ti, yi[:, 0])
        return jnp.mean((yi - y_pred) ** 2)

    @eqx.filter_jit
    def make_step(ti, yi, model, opt_state):
        loss, grads = grad_loss(model, ti, yi)
        updates, opt_state = optim.update(grads, opt_state)
        model = eqx.apply_updates(model, updates)
        return loss, model, opt_state

    return make_step


# --- diffrax: README.md ---


def f(t, y, args):
    return -y


def readme_solve(y0):
    """The README's ``diffeqsolve(term, solver, t0=0, t1=1, dt0=0.1, y0=y0)``."""
    term = diffrax.ODETerm(f)
    solver = diffrax.Dopri5()
    solution = diffrax.diffeqsolve(term, solver, t0=0, t1=1, dt0=0.1, y0=y0)
    return solution.ys


# --- haiku: examples/mnist.py ---

NUM_CLASSES = 10  # MNIST has 10 classes (hand-written digits).


class Batch(NamedTuple):
    image: np.ndarray  # [B, H, W, 1]
    label: np.ndarray  # [B]


class TrainingState(NamedTuple):
    params: hk.Params
    avg_params: hk.Params
    opt_state: optax.OptState


def net_fn(images: jax.Array) -> jax.Array:
    """Standard LeNet-300-100 MLP network."""
    x = images.astype(jnp.float32) / 255.0
    mlp = hk.Sequential([
        hk.Flatten(),
        hk.Linear(300), jax.nn.relu,
        hk.Linear(100), jax.nn.relu,
        hk.Linear(NUM_CLASSES),
    ])  # fmt: skip
    return mlp(x)


def authors_update(network, optimiser):
    """``main``'s ``loss`` and ``update``, as written there."""

    def loss(params: hk.Params, batch: Batch) -> jax.Array:
        """Cross-entropy classification loss, regularised by L2 weight decay."""
        batch_size, *_ = batch.image.shape
        logits = network.apply(params, batch.image)
        labels = jax.nn.one_hot(batch.label, NUM_CLASSES)

        l2_regulariser = 0.5 * sum(jnp.sum(jnp.square(p)) for p in jax.tree.leaves(params))
        log_likelihood = jnp.sum(labels * jax.nn.log_softmax(logits))

        return -log_likelihood / batch_size + 1e-4 * l2_regulariser

    @jax.jit
    def update(state: TrainingState, batch: Batch) -> TrainingState:
        """Learning rule (stochastic gradient descent)."""
        grads = jax.grad(loss)(state.params, batch)
        updates, opt_state = optimiser.update(grads, state.opt_state)
        params = optax.apply_updates(state.params, updates)
        # Compute avg_params, the exponential moving average of the "live" params.
        # We use this only for evaluation (cf. https://doi.org/10.1137/0330046).
        avg_params = optax.incremental_update(params, state.avg_params, step_size=0.001)
        return TrainingState(params, avg_params, opt_state)

    return loss, update


# --- haiku: README.md ---


class MyLinear(hk.Module):
    def __init__(self, output_size, name=None):
        super().__init__(name=name)
        self.output_size = output_size

    def __call__(self, x):
        j, k = x.shape[-1], self.output_size
        w_init = hk.initializers.TruncatedNormal(1.0 / np.sqrt(j))
        w = hk.get_parameter("w", shape=[j, k], dtype=x.dtype, init=w_init)
        b = hk.get_parameter("b", shape=[k], dtype=x.dtype, init=jnp.zeros)
        return jnp.dot(x, w) + b


def forward_fn(x):
    model = MyLinear(10)
    return model(x)


class MyDropout(hk.Module):
    def __init__(self, rate=0.5, name=None):
        super().__init__(name=name)
        self.rate = rate

    def __call__(self, x):
        key = hk.next_rng_key()
        p = jax.random.bernoulli(key, 1.0 - self.rate, shape=x.shape)
        return x * p / (1.0 - self.rate)


def forward(x, is_training):
    net = hk.nets.ResNet18(10)  # the README's hk.nets.ResNet50(1000), cut
    return net(x, is_training)


# --- haiku: examples/haiku_lstms.ipynb ---


def sine_seq(
    phase: float,
    seq_len: int,
    samples_per_cycle: int,
):
    """Returns x, y in [T, B] tensor."""
    t = np.arange(seq_len + 1) * (2 * math.pi / samples_per_cycle)
    t = t.reshape([-1, 1]) + phase
    sine_t = np.sin(t)
    return sine_t[:-1, :], sine_t[1:, :]


def unroll_net(seqs: jax.Array):
    """Unrolls an LSTM over seqs, mapping each output to a scalar."""
    # seqs is [T, B, F].
    core = hk.LSTM(LSTM_SIZE)  # the notebook's hk.LSTM(32), cut
    batch_size = seqs.shape[1]
    outs, state = hk.dynamic_unroll(core, seqs, core.initial_state(batch_size))
    # We could include this Linear as part of the recurrent core!
    # However, it's more efficient on modern accelerators to run the linear once
    # over the entire sequence than once per sequence element.
    return hk.BatchApply(hk.Linear(1))(outs), state


LSTM_SIZE = 8
model = hk.transform(unroll_net)


def authors_lstm_update(opt):
    """``train_model``'s ``loss`` and ``update``, as written there (nested in it)."""

    @jax.jit
    def loss(params, x, y):
        pred, _ = model.apply(params, None, x)
        return jnp.mean(jnp.square(pred - y))

    @jax.jit
    def update(step, params, opt_state, x, y):
        l, grads = jax.value_and_grad(loss)(params, x, y)  # noqa: E741 - the authors' name
        grads, opt_state = opt.update(grads, opt_state)
        params = optax.apply_updates(params, grads)
        return l, params, opt_state

    return loss, update
