"""Code we did not write, round thirty-two: Hugging Face Transformers' Flax fine-tuning
example, as its authors wrote it, for tests/test_authors_round32.py (transformers 4.57.6 from
the package index, the last line with Flax models; transformers 5 dropped them).

huggingface/transformers at 02c067295c47e3021d0a8c3cb3d24c7aaaa8c4b1, a stored commit of 2021
(examples/flax is in no 4.57 release: pull request #40654 removed it in September 2025):

- examples/flax/text-classification/run_flax_glue.py: ``create_train_state`` (its
  ``TrainState`` with ``logits_fn``/``loss_fn``, adamw masked off biases and LayerNorm scales)
  and ``create_learning_rate_fn`` as written; ``train_step`` and ``eval_step`` as written, which
  the file defines inside ``main`` closing over ``learning_rate_fn``: here inside ``make_steps``
  (ours, one line) that takes it. Left out: the argument parsing, GLUE's download and
  tokenizer, the collators, tensorboard and the epoch loop (the tests pmap the steps as
  ``main`` does, over the one CPU device).

Ours: the import of transformers under a filter of its deprecation warning. ``ruff format``
reflowed lines to 100 columns; the code is as written.

The models themselves (``FlaxBertForSequenceClassification``, ``FlaxGPT2LMHeadModel`` with
``generate``, ``FlaxViTForImageClassification``) are transformers' library, imported, built
from small configs with random weights (no download).
"""

# ruff: noqa: E501, UP006, UP035 (the authors' code, as written)

import warnings
from typing import Any, Callable, Dict, Tuple

import jax
import jax.numpy as jnp
import optax
from flax import struct, traverse_util
from flax.training import train_state
from flax.training.common_utils import onehot

with warnings.catch_warnings():  # transformers 4 warns its Flax classes are deprecated
    warnings.simplefilter("ignore")
    import transformers  # noqa: F401 - the tests take its classes from here
    from transformers import FlaxAutoModelForSequenceClassification

Array = Any
PRNGKey = Any

# --- transformers: examples/flax/text-classification/run_flax_glue.py ------------------------


def create_train_state(
    model: FlaxAutoModelForSequenceClassification,
    learning_rate_fn: Callable[[int], float],
    is_regression: bool,
    num_labels: int,
    weight_decay: float,
) -> train_state.TrainState:
    """Create initial training state."""

    class TrainState(train_state.TrainState):
        """Train state with an Optax optimizer.

        The two functions below differ depending on whether the task is classification
        or regression.

        Args:
          logits_fn: Applied to last layer to obtain the logits.
          loss_fn: Function to compute the loss.
        """

        logits_fn: Callable = struct.field(pytree_node=False)
        loss_fn: Callable = struct.field(pytree_node=False)

    # We use Optax's "masking" functionality to not apply weight decay
    # to bias and LayerNorm scale parameters. decay_mask_fn returns a
    # mask boolean with the same structure as the parameters.
    # The mask is True for parameters that should be decayed.
    def decay_mask_fn(params):
        flat_params = traverse_util.flatten_dict(params)
        flat_mask = {
            path: (path[-1] != "bias" and path[-2:] != ("LayerNorm", "scale"))
            for path in flat_params
        }
        return traverse_util.unflatten_dict(flat_mask)

    tx = optax.adamw(
        learning_rate=learning_rate_fn,
        b1=0.9,
        b2=0.999,
        eps=1e-6,
        weight_decay=weight_decay,
        mask=decay_mask_fn,
    )

    if is_regression:

        def mse_loss(logits, labels):
            return jnp.mean((logits[..., 0] - labels) ** 2)

        return TrainState.create(
            apply_fn=model.__call__,
            params=model.params,
            tx=tx,
            logits_fn=lambda logits: logits[..., 0],
            loss_fn=mse_loss,
        )
    else:  # Classification.

        def cross_entropy_loss(logits, labels):
            xentropy = optax.softmax_cross_entropy(logits, onehot(labels, num_classes=num_labels))
            return jnp.mean(xentropy)

        return TrainState.create(
            apply_fn=model.__call__,
            params=model.params,
            tx=tx,
            logits_fn=lambda logits: logits.argmax(-1),
            loss_fn=cross_entropy_loss,
        )


def create_learning_rate_fn(
    train_ds_size: int,
    train_batch_size: int,
    num_train_epochs: int,
    num_warmup_steps: int,
    learning_rate: float,
) -> Callable[[int], jnp.array]:
    """Returns a linear warmup, linear_decay learning rate function."""
    steps_per_epoch = train_ds_size // train_batch_size
    num_train_steps = steps_per_epoch * num_train_epochs
    warmup_fn = optax.linear_schedule(
        init_value=0.0, end_value=learning_rate, transition_steps=num_warmup_steps
    )
    decay_fn = optax.linear_schedule(
        init_value=learning_rate, end_value=0, transition_steps=num_train_steps - num_warmup_steps
    )
    schedule_fn = optax.join_schedules(
        schedules=[warmup_fn, decay_fn], boundaries=[num_warmup_steps]
    )
    return schedule_fn


def make_steps(learning_rate_fn):  # ours: main's two step functions, closing over it
    # define step functions
    def train_step(
        state: train_state.TrainState, batch: Dict[str, Array], dropout_rng: PRNGKey
    ) -> Tuple[train_state.TrainState, float]:
        """Trains model with an optimizer (both in `state`) on `batch`, returning a pair `(new_state, loss)`."""
        dropout_rng, new_dropout_rng = jax.random.split(dropout_rng)
        targets = batch.pop("labels")

        def loss_fn(params):
            logits = state.apply_fn(**batch, params=params, dropout_rng=dropout_rng, train=True)[0]
            loss = state.loss_fn(logits, targets)
            return loss

        grad_fn = jax.value_and_grad(loss_fn)
        loss, grad = grad_fn(state.params)
        grad = jax.lax.pmean(grad, "batch")
        new_state = state.apply_gradients(grads=grad)
        metrics = jax.lax.pmean(
            {"loss": loss, "learning_rate": learning_rate_fn(state.step)}, axis_name="batch"
        )
        return new_state, metrics, new_dropout_rng

    p_train_step = jax.pmap(train_step, axis_name="batch", donate_argnums=(0,))

    def eval_step(state, batch):
        logits = state.apply_fn(**batch, params=state.params, train=False)[0]
        return state.logits_fn(logits)

    p_eval_step = jax.pmap(eval_step, axis_name="batch")
    return train_step, p_train_step, eval_step, p_eval_step
