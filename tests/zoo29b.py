"""Code we did not write, round twenty-nine continued: held state that grows and a module
trained in place, for tests/test_held_state.py.

google/flax at 18f8f311c275d57f46d95e41b15aa97b454754c0:

- docs_nnx/guides/pytree.md, "sow": ``Block`` (it sows ``"y_mean"`` with
  ``self.sow(nnx.Intermediate, ...)``; BatchNorm in training mode, Dropout) and ``MLP``, and
  the cell that makes the model and captures it (``guide`` below: a function, so that each
  test has its own model).
- docs_nnx/mnist_tutorial.md: ``loss_fn``, ``train_step`` and ``eval_step``, the
  ``nnx.Optimizer`` and ``nnx.MultiMetric`` as the tutorial makes them (``make_training``
  below: their cell's code, a function so that each test has its own); its ``CNN`` is
  tests/helpers.py's ``TutorialCNN``, taken from the same file at the same commit. Left out:
  the dataset, TensorBoard, the plots and the Orbax export.

Ours: the files' two spaces of indent are made four (``ruff format``), the code is as written.
"""

import jax.numpy as jnp
import optax
from flax import nnx
from helpers import TutorialCNN as CNN

# --- docs_nnx/guides/pytree.md ("sow") ----------------------------------------------------------


class Block(nnx.Module):
    def __init__(self, din: int, dout: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(din, dout, rngs=rngs)
        self.bn = nnx.BatchNorm(dout, use_running_average=False, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, deterministic=False, rngs=rngs)

    def __call__(self, x):
        y = nnx.relu(self.dropout(self.bn(self.linear(x))))
        self.sow(nnx.Intermediate, "y_mean", jnp.mean(y))
        return y


class MLP(nnx.Module):
    def __init__(self, num_layers, dim, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(dim, dim, rngs) for _ in range(num_layers)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def guide():  # the guide's cell: the model, its input, and its capture of the model
    model = MLP(num_layers=3, dim=20, rngs=nnx.Rngs(0))
    x = jnp.ones((10, 20))
    _, intermediates = nnx.capture(model, nnx.Intermediate)(x)
    return model, x, intermediates


# --- docs_nnx/mnist_tutorial.md -----------------------------------------------------------------


def make_training(model):  # the tutorial's cell: the optimizer and metrics of the model
    learning_rate = 0.005
    momentum = 0.9

    optimizer = nnx.Optimizer(model, optax.adamw(learning_rate, momentum), wrt=nnx.Param)
    metrics = nnx.MultiMetric(
        accuracy=nnx.metrics.Accuracy(),
        loss=nnx.metrics.Average("loss"),
    )
    return optimizer, metrics


def loss_fn(model: CNN, batch, rngs: nnx.Rngs | None = None):
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    ).mean()
    return loss, logits


@nnx.jit
def train_step(
    model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, rngs: nnx.Rngs, batch
):
    """Train for a single step."""
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch, rngs)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])  # In-place updates.
    optimizer.update(model, grads)  # In-place updates.


@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
    loss, logits = loss_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])  # In-place updates.


def views(model):  # the tutorial's train_model and eval_model
    train_model = nnx.view(model, deterministic=False, use_running_average=False)
    eval_model = nnx.view(model, deterministic=True, use_running_average=True)
    return train_model, eval_model
