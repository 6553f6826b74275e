"""Code we did not write, round thirty continued: keras-io's convnet with batch normalization
and dropout, as its author (fchollet) wrote it, for tests/test_authors_round30.py (``zoo30``'s
guide has a ``get_model`` and a ``train_step`` of its own, so this one lives apart).

keras-team/keras-io at 4ff39a6c72ebd753d9ef8c2b81f28c9976dc9424,
guides/distributed_training_with_jax.py ("Multi-GPU distributed training with JAX"):
``get_model`` (a small MNIST convnet: BatchNormalization, whose moving statistics are
non-trainable variables, and Dropout, whose seed generator's state is one too), ``model``,
``optimizer``, ``loss``, ``optimizer.build``, ``compute_loss`` (``model.stateless_call(...,
training=True)``), ``compute_gradients`` and ``train_step`` (``@jax.jit``, Keras's own step the
tests compare ours with), as written.

Cut: ``os.environ["KERAS_BACKEND"] = "jax"`` (the test module's), ``import tensorflow as tf``,
the ``jax.sharding`` imports, ``get_datasets`` (MNIST, tf.data), ``model.build(one_batch)`` (a
functional model is built), the mesh, replication and the training loop.
``ruff format`` joins lines the guide breaks at 88 columns; the code is as written.
"""

import jax
import keras


def get_model():
    # Make a simple convnet with batch normalization and dropout.
    inputs = keras.Input(shape=(28, 28, 1))
    x = keras.layers.Rescaling(1.0 / 255.0)(inputs)
    x = keras.layers.Conv2D(filters=12, kernel_size=3, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization(scale=False, center=True)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(
        filters=24,
        kernel_size=6,
        use_bias=False,
        strides=2,
    )(x)
    x = keras.layers.BatchNormalization(scale=False, center=True)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(
        filters=32,
        kernel_size=6,
        padding="same",
        strides=2,
        name="large_k",
    )(x)
    x = keras.layers.BatchNormalization(scale=False, center=True)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(256, activation="relu")(x)
    x = keras.layers.Dropout(0.5)(x)
    outputs = keras.layers.Dense(10)(x)
    model = keras.Model(inputs, outputs)
    return model


model = get_model()
optimizer = keras.optimizers.Adam(1e-3)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

# Initialize all state with .build()
optimizer.build(model.trainable_variables)


# This is the loss function that will be differentiated.
# Keras provides a pure functional forward pass: model.stateless_call
def compute_loss(trainable_variables, non_trainable_variables, x, y):
    y_pred, updated_non_trainable_variables = model.stateless_call(
        trainable_variables, non_trainable_variables, x, training=True
    )
    loss_value = loss(y, y_pred)
    return loss_value, updated_non_trainable_variables


# Function to compute gradients
compute_gradients = jax.value_and_grad(compute_loss, has_aux=True)


# Training step, Keras provides a pure functional optimizer.stateless_apply
@jax.jit
def train_step(train_state, x, y):
    trainable_variables, non_trainable_variables, optimizer_variables = train_state
    (loss_value, non_trainable_variables), grads = compute_gradients(
        trainable_variables, non_trainable_variables, x, y
    )

    trainable_variables, optimizer_variables = optimizer.stateless_apply(
        optimizer_variables, grads, trainable_variables
    )

    return loss_value, (
        trainable_variables,
        non_trainable_variables,
        optimizer_variables,
    )
