"""Code we did not write, round thirty continued: keras-io's "Customizing what happens in
``fit()`` with JAX", as its author (fchollet) wrote it, for tests/test_authors_round30.py (its
``train_step`` is a method of the model, so it lives apart from ``zoo30``'s).

keras-team/keras-io at f4c6e0b91770bc093f5133462d0dd9b45f42c5c9,
guides/custom_train_step_in_jax.py: the first ``CustomModel`` (``compute_loss_and_updates``
over ``stateless_call`` and ``compute_loss``; ``train_step`` over ``optimizer.stateless_apply``
and each metric's ``stateless_update_state``) and ``make_model`` (ours: a function holding the
guide's three lines that build and compile it, ``inputs = keras.Input(shape=(32,))`` ...
``model.compile(optimizer="adam", loss="mse", metrics=["mae"])``).

Cut: ``os.environ["KERAS_BACKEND"] = "jax"`` (the test module's), the guide's data and
``fit``, its lower-level ``CustomModel`` and its ``test_step`` sections.
``ruff format`` joins lines the guide breaks at 88 columns; the code is as written.
"""

import jax
import keras


class CustomModel(keras.Model):
    def compute_loss_and_updates(
        self,
        trainable_variables,
        non_trainable_variables,
        x,
        y,
        training=False,
    ):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables,
            non_trainable_variables,
            x,
            training=training,
        )
        loss = self.compute_loss(x, y, y_pred)
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        (
            trainable_variables,
            non_trainable_variables,
            optimizer_variables,
            metrics_variables,
        ) = state
        x, y = data

        # Get the gradient function.
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)

        # Compute the gradients.
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables,
            non_trainable_variables,
            x,
            y,
            training=True,
        )

        # Update trainable variables and optimizer variables.
        (
            trainable_variables,
            optimizer_variables,
        ) = self.optimizer.stateless_apply(optimizer_variables, grads, trainable_variables)

        # Update metrics.
        new_metrics_vars = []
        logs = {}
        for metric in self.metrics:
            this_metric_vars = metrics_variables[
                len(new_metrics_vars) : len(new_metrics_vars) + len(metric.variables)
            ]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(this_metric_vars, loss)
            else:
                this_metric_vars = metric.stateless_update_state(this_metric_vars, y, y_pred)
            logs[metric.name] = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars

        # Return metric logs and updated state variables.
        state = (
            trainable_variables,
            non_trainable_variables,
            optimizer_variables,
            new_metrics_vars,
        )
        return logs, state


def make_model():
    # Construct and compile an instance of CustomModel
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    model = CustomModel(inputs, outputs)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model
