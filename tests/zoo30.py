"""Code we did not write, round thirty: Keras 3 on the JAX backend, keras-io's guide as its
author (fchollet) wrote it, for tests/test_authors_round30.py (keras 3.15.1 from the package
index; ``KERAS_BACKEND=jax`` is set by the test module around its import, not here).

keras-team/keras-io at 737c3e276518264ede72978da1d4d3f7989c5656,
guides/writing_a_custom_training_loop_in_jax.py ("Writing a training loop from scratch in
JAX"): ``get_model``, ``loss_fn``, ``optimizer``, ``compute_loss_and_updates``, ``grad_fn`` and
the first ``train_step`` (the guide's own, before it writes it again under ``@jax.jit``), as
written, in the guide's order.

Cut: the guide's setup lines ``os.environ["KERAS_BACKEND"] = "jax"`` (the test module's, so no
other module's process is changed) and ``import tensorflow as tf`` (tf.data only); MNIST and
its tf.data pipelines, the training loop, the metrics, add_loss and evaluation sections. The
guide's state is ``model.trainable_variables`` itself, Keras Variables: jit (JAX 0.10) refuses
those ("Triggering __jax_array__() during abstractification is no longer supported"), so the
tests pass their values, ``[v.value for v in ...]``.
"""

import jax
import keras


def get_model():
    inputs = keras.Input(shape=(784,), name="digits")
    x1 = keras.layers.Dense(64, activation="relu")(inputs)
    x2 = keras.layers.Dense(64, activation="relu")(x1)
    outputs = keras.layers.Dense(10, name="predictions")(x2)
    model = keras.Model(inputs=inputs, outputs=outputs)
    return model


model = get_model()

# Instantiate a loss function.
loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True)

# Instantiate an optimizer.
optimizer = keras.optimizers.Adam(learning_rate=1e-3)


def compute_loss_and_updates(trainable_variables, non_trainable_variables, x, y):
    y_pred, non_trainable_variables = model.stateless_call(
        trainable_variables, non_trainable_variables, x, training=True
    )
    loss = loss_fn(y, y_pred)
    return loss, non_trainable_variables


grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)


def train_step(state, data):
    trainable_variables, non_trainable_variables, optimizer_variables = state
    x, y = data
    (loss, non_trainable_variables), grads = grad_fn(
        trainable_variables, non_trainable_variables, x, y
    )
    trainable_variables, optimizer_variables = optimizer.stateless_apply(
        optimizer_variables, grads, trainable_variables
    )
    # Return updated state
    return loss, (
        trainable_variables,
        non_trainable_variables,
        optimizer_variables,
    )


# Build optimizer variables.
optimizer.build(model.trainable_variables)
