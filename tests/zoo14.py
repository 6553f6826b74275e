"""Code we did not write, round fourteen: optax's own examples and docs, as their authors wrote
them (google-deepmind/optax at 2edbcbe2390da13983b92cbef94ac0460ecde1c5; each file's last
commit below), shrunk to a few features, classes and steps, for tests/test_authors_round14.py.

- examples/contrib/reduce_on_plateau.ipynb (0999ecec5a0962fc5269ac400a51ede7647316eb): the
  linen ``MLP``, ``loss_accuracy``, the ``optax.chain(optax.adam, contrib.reduce_on_plateau)``
  and its jitted ``train_step`` (``opt.update(..., value=value)``).
- examples/gradient_accumulation.ipynb (907319adac7412b0d78200f037ce495b188dae6c): the nnx
  ``MLP``, ``loss_fn``, ``build_train_step``/``fit`` over ``nnx.Optimizer``, and
  ``optax.MultiSteps(optimizer, every_k_schedule=3)``; ``build_train_step``'s ``jax.jit`` is
  ``nnx.jit`` here: under flax 0.12 a ``jax.jit`` of the module and optimizer drops their
  in-place update, so the notebook as written trains nothing (its closing check compares two
  untrained models and passes).
- examples/contrib/sam.ipynb (97663df19d467e2209f8e8d9ef480277755b746a): the drop-in
  ``contrib.sam(opt, adv_opt, sync_period=2)``, ``sam_mom``, ``sam_adam`` and ``make_step``
  (whose ``opt.update`` gets no ``value=``).
- optax/contrib/_schedule_free.py (cb8ce5412120d2398eb3d77cf8299e3b4ba16005):
  ``schedule_free_adamw``'s docstring loop, evaluating ``schedule_free_eval_params``.
- examples/lookahead_mnist.ipynb (7afa8808b421b60589f702d6837783c0b77f39e3): the nnx ``CNN``
  and ``optax.lookahead(fast_solver, SYNC_PERIOD, SLOW_LEARNING_RATE)``.
- examples/contrib/differentially_private_sgd.ipynb (86b101ecb6a0a641c4df6fb9db94ff5b39d6bf30):
  the stax CNN, ``loss_fn``, ``contrib.dpsgd(...)`` and ``train_step`` (per-example gradients
  by ``jax.vmap``), its ``predict`` passed in to run over a Hybrid's ``h.apply``.
"""

import warnings
from collections.abc import Iterable, Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import nnx
from jax.example_libraries import stax
from optax import contrib

NUM_CLASSES = 3  # fashion_mnist's 10, shrunk
FEATURES = 5  # 28 * 28, shrunk

# --- examples/contrib/reduce_on_plateau.ipynb ------------------------------------------------


class MLP(nn.Module):
    """A simple multilayer perceptron model for image classification."""

    hidden_sizes: Sequence[int] = (16, 16)  # (1000, 1000), shrunk

    @nn.compact
    def __call__(self, x):
        # Flattens images in the batch.
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(features=self.hidden_sizes[0])(x)
        x = nn.relu(x)
        x = nn.Dense(features=self.hidden_sizes[1])(x)
        x = nn.relu(x)
        x = nn.Dense(features=NUM_CLASSES)(x)
        return x


net = MLP()


@jax.jit
def loss_accuracy(params, data):
    """Computes loss and accuracy over a mini-batch.

    Args:
      params: parameters of the model.
      data: tuple of (inputs, labels).

    Returns:
      loss: float
    """
    inputs, labels = data
    logits = net.apply({"params": params}, inputs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=labels).mean()
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == labels)
    return loss, {"accuracy": accuracy}


LEARNING_RATE = 0.01
PATIENCE = 1  # 5, shrunk to the few steps run here
COOLDOWN = 0
FACTOR = 0.5
RTOL = 1e-4
ACCUMULATION_SIZE = 2  # 200, shrunk

opt = optax.chain(
    optax.adam(LEARNING_RATE),
    contrib.reduce_on_plateau(
        patience=PATIENCE,
        cooldown=COOLDOWN,
        factor=FACTOR,
        rtol=RTOL,
        accumulation_size=ACCUMULATION_SIZE,
    ),
)


def make_train_step(opt):
    """The notebook's ``train_step``, of the ``opt`` given (it closes over the global one)."""

    @jax.jit
    def train_step(params, opt_state, batch):
        """Performs a one step update."""
        (value, aux), grad = jax.value_and_grad(loss_accuracy, has_aux=True)(params, batch)
        updates, opt_state = opt.update(grad, opt_state, params, value=value)
        params = optax.apply_updates(params, updates)
        return params, opt_state, value, aux

    return train_step


# --- examples/gradient_accumulation.ipynb ------------------------------------------------------


class NnxMLP(nnx.Module):
    """A simple multilayer perceptron model using flax.nnx (the notebook's ``MLP``)."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(FEATURES, 16, rngs=rngs)  # 28 * 28 -> 512, shrunk
        self.linear2 = nnx.Linear(16, 16, rngs=rngs)
        self.linear3 = nnx.Linear(16, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        # Flattens inputs in the batch.
        x = x.reshape((x.shape[0], -1))
        x = self.linear1(x)
        x = jax.nn.relu(x)
        x = self.linear2(x)
        x = jax.nn.relu(x)
        x = self.linear3(x)
        return x


def loss_fn(model, batch):
    """Computes loss over a mini-batch."""
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    ).mean()
    return loss


def build_train_step():
    """Builds a function for executing a single step in the optimization."""

    @nnx.jit  # jax.jit as written: under flax 0.12 its in-place update is lost (trains nothing)
    def update(model, optimizer, batch):
        grads = nnx.grad(loss_fn)(model, batch)
        optimizer.update(model, grads)

    return update


def fit(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    batches: Iterable[dict[str, jnp.ndarray]],
):
    """Executes a train loop over the train batches using the given optimizer."""

    train_step = build_train_step()

    for batch in batches:
        train_step(model, optimizer, batch)


def accumulating(optimizer):
    """The notebook's gradient accumulation of ``optimizer`` over three batches."""
    return optax.MultiSteps(optimizer, every_k_schedule=3)


# --- examples/contrib/sam.ipynb ----------------------------------------------------------------

lr = 0.01
rho = 0.1
sam_inner = optax.sgd(lr)  # the notebook's ``opt``
adv_opt = optax.chain(contrib.normalize(), optax.sgd(rho))
sam_opt = contrib.sam(sam_inner, adv_opt, sync_period=2)  # This is the drop-in SAM optimizer.


def sam_mom(lr=1e-3, momentum=0.1, rho=0.1, sync_period=2):
    opt = optax.sgd(lr, momentum=momentum)
    adv_opt = optax.chain(contrib.normalize(), optax.sgd(rho))
    return contrib.sam(opt, adv_opt, sync_period=sync_period)


def sam_adam(lr=1e-3, b1=0.9, b2=0.999, rho=0.03, sync_period=5):
    """A SAM optimizer using Adam for the outer optimizer."""
    opt = optax.adam(lr, b1=b1, b2=b2)
    adv_opt = optax.chain(contrib.normalize(), optax.adam(rho))
    return contrib.sam(opt, adv_opt, sync_period=sync_period)


class Store(NamedTuple):
    params: jax.typing.ArrayLike
    state: optax.OptState
    step: int = 0


def make_step(opt, loss):
    """The notebook's ``make_step``; its ``loss`` (a 2-D surface there) is passed in."""

    @jax.jit
    def step(store):
        value, grads = jax.value_and_grad(loss)(store.params)
        updates, state = opt.update(grads, store.state, store.params)
        params = optax.apply_updates(store.params, updates)
        return store._replace(params=params, state=state, step=store.step + 1), value

    return step


# --- optax/contrib/_schedule_free.py: schedule_free_adamw's example -----------------------------


def schedule_free_run(solver, f, params, steps):
    """The docstring's loop: ``steps`` updates, then the params to evaluate and the state."""
    opt_state = solver.init(params)
    eval_params = params
    for _ in range(steps):
        grad = jax.grad(f)(params)
        updates, opt_state = solver.update(grad, opt_state, params)
        params = optax.apply_updates(params, updates)
        eval_params = optax.contrib.schedule_free_eval_params(opt_state, params)
    return params, eval_params, opt_state


# --- examples/lookahead_mnist.ipynb ------------------------------------------------------------

FAST_LEARNING_RATE = 0.002
SLOW_LEARNING_RATE = 0.1
SYNC_PERIOD = 5
IMG = (8, 8, 1)  # mnist's (28, 28, 1), shrunk


class CNN(nnx.Module):
    """A simple CNN model."""

    def __init__(self, in_features, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(in_features=in_features, out_features=4, kernel_size=(3, 3),
                              rngs=rngs)  # fmt: skip
        self.pool1 = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.conv2 = nnx.Conv(in_features=4, out_features=8, kernel_size=(3, 3), rngs=rngs)
        self.pool2 = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.dense1 = nnx.Linear(in_features=2 * 2 * 8, out_features=16, rngs=rngs)
        self.dense2 = nnx.Linear(in_features=16, out_features=NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        x = self.conv1(x)
        x = nnx.relu(x)
        x = self.pool1(x)
        x = self.conv2(x)
        x = nnx.relu(x)
        x = self.pool2(x)
        x = x.reshape((x.shape[0], -1))  # flatten
        x = self.dense1(x)
        x = nnx.relu(x)
        x = self.dense2(x)
        return x


fast_solver = optax.adam(FAST_LEARNING_RATE)
solver = optax.lookahead(fast_solver, SYNC_PERIOD, SLOW_LEARNING_RATE)

# --- examples/contrib/differentially_private_sgd.ipynb ---------------------------------------

DPSGD = True
LEARNING_RATE_DP = 0.25  # the notebook's LEARNING_RATE
NOISE_MULTIPLIER = 1.3
L2_NORM_CLIP = 1.5
DP_IMG = (16, 16, 1)  # mnist's (28, 28, 1), shrunk

init_random_params, predict = stax.serial(
    stax.Conv(4, (4, 4), padding="SAME", strides=(2, 2)),  # 16 (8, 8), shrunk
    stax.Relu,
    stax.MaxPool((2, 2), (1, 1)),
    stax.Conv(8, (2, 2), padding="VALID", strides=(2, 2)),  # 32 (4, 4), shrunk
    stax.Relu,
    stax.MaxPool((2, 2), (1, 1)),
    stax.Flatten,
    stax.Dense(16),  # 32, shrunk
    stax.Relu,
    stax.Dense(NUM_CLASSES),
)


def dp_tx():
    """The notebook's ``tx`` (optax 0.2.8 warns that its ``seed`` is deprecated, and takes
    no ``key`` yet)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", '"seed" is deprecated', DeprecationWarning)
        return contrib.dpsgd(
            learning_rate=LEARNING_RATE_DP, l2_norm_clip=L2_NORM_CLIP,
            noise_multiplier=NOISE_MULTIPLIER, seed=1337)  # fmt: skip


def make_dp_train_step(tx, predict):
    """The notebook's ``loss_fn`` and ``train_step`` of ``tx``, over the ``predict`` given."""

    def loss_fn(params, batch):
        images, labels = batch
        logits = predict(params, images)
        return optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits

    @jax.jit
    def train_step(params, opt_state, batch):
        grad_fn = jax.grad(loss_fn, has_aux=True)
        if DPSGD:
            # Inserts a dimension in axis 1 to use jax.vmap over the batch.
            batch = jax.tree.map(lambda x: x[:, None], batch)
            # Uses jax.vmap across the batch to extract per-example gradients.
            grad_fn = jax.vmap(grad_fn, in_axes=(None, 0))
        grads, _ = grad_fn(params, batch)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        return new_params, new_opt_state

    return train_step
