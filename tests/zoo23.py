"""Code we did not write, round twenty-three: penzai's and distrax's own examples, as their
authors wrote them (sizes are the tests'), for tests/test_authors_round23.py. Both run here
for the first time (penzai 0.2.5, distrax 0.1.9 from the package index).

google-deepmind/penzai at aac7808a3d1269ea9885094d78d2274d56fc7449:

- notebooks/how_to_think_in_penzai.ipynb: ``SimpleLinear``, ``SimpleBias``,
  ``SimpleElementwise`` and ``SimpleMLP`` (the notebook's "writing your own layers" cells), and the training cell's ``loss_fn`` (renamed ``mlp_loss_fn``, as flow.py has a
  ``loss_fn`` too); its ``example_inputs``,
  ``example_targets`` and ``StatefulTrainer`` loop are the test's (sizes cut to 3 steps).

google-deepmind/distrax at f51bffcf9094d269a0be8678762dd2849833c8b7:

- examples/flow.py: ``make_conditioner``, ``make_flow_model``, ``prepare_data``,
  ``log_prob``, ``loss_fn`` and ``eval_fn`` as written; ``main``'s ``update`` kept as
  written in ``authors_update(optimizer)`` (nested in ``main`` there; its PRNGSequence,
  tfds MNIST data and loop are left out, with ``load_dataset``). Its absl ``FLAGS`` are
  cut: ``FLAGS`` here is a namespace of the flags' defaults, which the tests set smaller.
Ours: ``import distrax`` under a filter of the one DeprecationWarning its tfp-nightly
import raises (``jax.core.pytype_aval_mappings``). Both files' two spaces of indent are made four (``ruff format``), the code is as written.
"""

# ruff: noqa: E501, RUF005, UP006, UP035, UP045 - as the authors wrote it

import dataclasses
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Mapping, Optional, Tuple

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from penzai import pz

with warnings.catch_warnings():  # tfp-nightly's jax substrate, imported by distrax, reads it
    warnings.filterwarnings("ignore", "jax.core.pytype_aval_mappings is deprecated")
    import distrax

# --- penzai: notebooks/how_to_think_in_penzai.ipynb ---------------------------------------------


@pz.pytree_dataclass
class SimpleLinear(pz.nn.Layer):
    """A simple linear layer with a single input/output axis."""

    # Parameters are annotated as `ParameterLike` to allow swapping them out after
    # initialization.
    kernel: pz.nn.ParameterLike[pz.nx.NamedArray]

    # Non-Pytree fields (which are not arraylike) should be annotated as such to
    # tell JAX not to try to convert them:
    features_axis: str = dataclasses.field(metadata={"pytree_node": False})

    def __call__(self, x: pz.nx.NamedArray, /, **unused_side_inputs) -> pz.nx.NamedArray:
        """Multiplies the input by the learned kernel."""
        # pos_x has one positional axis
        pos_x = x.untag(self.features_axis)
        # pos_kernel has two positional axes
        pos_kernel = self.kernel.value.untag("out_features", "in_features")
        # We can combine them using ordinary positional semantics:
        pos_y = pz.nx.nmap(jnp.dot)(pos_kernel, pos_x)
        return pos_y.tag(self.features_axis)

    @classmethod
    def from_config(
        cls,
        name: str,
        init_base_rng: jax.Array | None,
        in_features: int,
        out_features: int,
        features_axis: str = "features",
    ) -> "SimpleLinear":
        """Constructs a linear layer from configuration arguments."""

        def _initializer(key):
            arr = jax.nn.initializers.xavier_normal()(key, (out_features, in_features))
            return pz.nx.wrap(arr).tag("out_features", "in_features")

        return cls(
            kernel=pz.nn.make_parameter(
                name=f"{name}.kernel",
                init_base_rng=init_base_rng,
                initializer=_initializer,
            ),
            features_axis=features_axis,
        )


@pz.pytree_dataclass
class SimpleBias(pz.nn.Layer):
    """A simple bias layer."""

    # The SimpleBias layer doesn't need to store its output axis name at all!
    bias: pz.nn.ParameterLike[pz.nx.NamedArray]

    def __call__(self, x: pz.nx.NamedArray, /, **unused_side_inputs) -> pz.nx.NamedArray:
        """Adds a bias to the input."""
        return x + self.bias.value  # Automatically vectorized!

    @classmethod
    def from_config(
        cls,
        name: str,
        init_base_rng: jax.Array | None,
        features: int,
        features_axis: str = "features",
    ) -> "SimpleBias":
        """Constructs a bias layer from configuration arguments."""
        return cls(
            bias=pz.nn.make_parameter(
                name=f"{name}.bias",
                init_base_rng=init_base_rng,
                initializer=lambda _: pz.nx.zeros({features_axis: features}),
            ),
        )


@pz.pytree_dataclass
class SimpleElementwise(pz.nn.Layer):
    """A simple elementwise layer."""

    fn: Callable[[jax.Array], jax.Array] = dataclasses.field(metadata={"pytree_node": False})

    def __call__(self, x: pz.nx.NamedArray, /, **unused_side_inputs) -> pz.nx.NamedArray:
        """Runs the activation function."""
        return pz.nx.nmap(self.fn)(x)

    # No need for `from_config`, since it would be the same as `__init__`.


@pz.pytree_dataclass
class SimpleMLP(pz.nn.Sequential):
    # sublayers is inherited from Sequential, but we restate it here for clarity.
    sublayers: list[pz.nn.Layer]

    # __call__ is inherited from Sequential, so no need to reimplement it! In
    # fact, Sequential.__call__ is marked with @typing.final so you don't
    # accidentally override it.

    @classmethod
    def from_config(
        cls,
        name: str,
        init_base_rng: jax.Array | None,
        feature_sizes: Sequence[int],
        activation: Callable[[jax.Array], jax.Array] = jax.nn.relu,
        features_axis: str = "features",
    ) -> "SimpleMLP":
        """Constructs a MLP with uninitialized parameters."""
        # We build the steps of the forward pass in from_config, and push all
        # configuration arguments down to the sublayers:
        sublayers = []
        for i in range(len(feature_sizes) - 1):
            # We need to ensure parameter name uniqueness ourselves:
            sublayers.append(
                SimpleLinear.from_config(
                    name=f"{name}/block_{i}/linear",
                    init_base_rng=init_base_rng,
                    in_features=feature_sizes[i],
                    out_features=feature_sizes[i + 1],
                    features_axis=features_axis,
                )
            )
            sublayers.append(
                SimpleBias.from_config(
                    name=f"{name}/block_{i}/bias",
                    init_base_rng=init_base_rng,
                    features=feature_sizes[i + 1],
                    features_axis=features_axis,
                )
            )
            if i < len(feature_sizes) - 2:
                sublayers.append(SimpleElementwise(activation))
        return cls(sublayers)


def mlp_loss_fn(model, rng, state, current_input, current_target):
    del rng, state  # More complex training loops could use these if needed
    model_out = model(current_input)
    losses = pz.nx.nmap(jnp.square)(model_out - current_target)
    loss = losses.untag("batch", "features").unwrap().sum()
    return (loss, None, {"my_loss": loss})


# --- distrax: examples/flow.py ------------------------------------------------------------------

FLAGS = types.SimpleNamespace(  # the flags' defaults (flags.DEFINE_* in flow.py)
    flow_num_layers=8,
    mlp_num_layers=2,
    hidden_size=500,
    num_bins=4,
    batch_size=128,
    learning_rate=1e-4,
    training_steps=5000,
    eval_frequency=100,
)

Array = jnp.ndarray
PRNGKey = Array
Batch = Mapping[str, np.ndarray]
OptState = Any

MNIST_IMAGE_SHAPE = (28, 28, 1)


def make_conditioner(
    event_shape: Sequence[int], hidden_sizes: Sequence[int], num_bijector_params: int
) -> hk.Sequential:
    """Creates an MLP conditioner for each layer of the flow."""
    return hk.Sequential(
        [
            hk.Flatten(preserve_dims=-len(event_shape)),
            hk.nets.MLP(hidden_sizes, activate_final=True),
            # We initialize this linear layer to zero so that the flow is initialized
            # to the identity function.
            hk.Linear(
                np.prod(event_shape) * num_bijector_params, w_init=jnp.zeros, b_init=jnp.zeros
            ),
            hk.Reshape(tuple(event_shape) + (num_bijector_params,), preserve_dims=-1),
        ]
    )


def make_flow_model(
    event_shape: Sequence[int], num_layers: int, hidden_sizes: Sequence[int], num_bins: int
) -> distrax.Transformed:
    """Creates the flow model."""
    # Alternating binary mask.
    mask = jnp.arange(0, np.prod(event_shape)) % 2
    mask = jnp.reshape(mask, event_shape)
    mask = mask.astype(bool)

    def bijector_fn(params: Array):
        return distrax.RationalQuadraticSpline(params, range_min=0.0, range_max=1.0)

    # Number of parameters for the rational-quadratic spline:
    # - `num_bins` bin widths
    # - `num_bins` bin heights
    # - `num_bins + 1` knot slopes
    # for a total of `3 * num_bins + 1` parameters.
    num_bijector_params = 3 * num_bins + 1

    layers = []
    for _ in range(num_layers):
        layer = distrax.MaskedCoupling(
            mask=mask,
            bijector=bijector_fn,
            conditioner=make_conditioner(event_shape, hidden_sizes, num_bijector_params),
        )
        layers.append(layer)
        # Flip the mask after each layer.
        mask = jnp.logical_not(mask)

    # We invert the flow so that the `forward` method is called with `log_prob`.
    flow = distrax.Inverse(distrax.Chain(layers))
    base_distribution = distrax.Independent(
        distrax.Uniform(low=jnp.zeros(event_shape), high=jnp.ones(event_shape)),
        reinterpreted_batch_ndims=len(event_shape),
    )

    return distrax.Transformed(base_distribution, flow)


def prepare_data(batch: Batch, prng_key: Optional[PRNGKey] = None) -> Array:
    data = batch["image"].astype(np.float32)
    if prng_key is not None:
        # Dequantize pixel values {0, 1, ..., 255} with uniform noise [0, 1).
        data += jax.random.uniform(prng_key, data.shape)
    return data / 256.0  # Normalize pixel values from [0, 256) to [0, 1).


@hk.without_apply_rng
@hk.transform
def log_prob(data: Array) -> Array:
    model = make_flow_model(
        event_shape=data.shape[1:],
        num_layers=FLAGS.flow_num_layers,
        hidden_sizes=[FLAGS.hidden_size] * FLAGS.mlp_num_layers,
        num_bins=FLAGS.num_bins,
    )
    return model.log_prob(data)


def loss_fn(params: hk.Params, prng_key: PRNGKey, batch: Batch) -> Array:
    data = prepare_data(batch, prng_key)
    # Loss is average negative log likelihood.
    loss = -jnp.mean(log_prob.apply(params, data))
    return loss


@jax.jit
def eval_fn(params: hk.Params, batch: Batch) -> Array:
    data = prepare_data(batch)  # We don't dequantize during evaluation.
    loss = -jnp.mean(log_prob.apply(params, data))
    return loss


def authors_update(optimizer):
    """``main``'s ``update``, as written there."""

    @jax.jit
    def update(
        params: hk.Params, prng_key: PRNGKey, opt_state: OptState, batch: Batch
    ) -> Tuple[hk.Params, OptState]:
        """Single SGD update step."""
        grads = jax.grad(loss_fn)(params, prng_key, batch)
        updates, new_opt_state = optimizer.update(grads, opt_state)
        new_params = optax.apply_updates(params, updates)
        return new_params, new_opt_state

    return update
