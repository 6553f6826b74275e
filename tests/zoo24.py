"""Code we did not write, round twenty-four: OTT's own tutorials, as their authors wrote them
(sizes are the tests'), for tests/test_authors_round24.py. OTT runs here for the first time
(ott-jax 0.6.0 from the package index, which is the tree below but for plot.py).

ott-jax/ott at 6aace50f673b877cc3394d0b53a24da0bbf11308:

- docs/tutorials/misc/100_soft_sort.ipynb: ``ConvBlock``, ``CNN``, ``cross_entropy_loss``,
  ``soft_error_loss``, ``compute_metrics``, ``TrainState``, ``create_train_state``,
  ``initialized``, ``train_step`` and ``eval_step`` as written; its ``NameSpace`` config,
  MNIST loaders (torchvision), tqdm logging, ``train_and_evaluate`` loop, plots and
  image-denoising cells are left out (the tests build the config's optimizer and feed the
  steps their own batches, ``jax.jit(functools.partial(train_step, ...))`` as the loop does).
- docs/tutorials/neural/200_Monge_Gap.ipynb: ``SklearnDistribution``, ``create_samplers`` and
  ``fit_map`` as written; ``plot_samples`` and ``plot_fit_map`` are left out (matplotlib).
  Cell 8 builds the module-level ``train_dataset`` and ``valid_dataset`` that ``fit_map``
  reads: kept as written in ``tutorial_samplers(**sizes)`` (ours: a function, so that each
  test draws the tutorial's batches afresh; its ``plot_samples`` call left out), which the
  tests assign to this module's globals.
Ours: the ott imports under a filter of the one DeprecationWarning that importing jaxopt (an
ott dependency) raises. Both notebooks' imports are cut to what the kept cells use; lines are
joined to our width (``ruff format``), the code is as written.
"""

# ruff: noqa: RUF059, UP045 - as the authors wrote it

import dataclasses
import functools
import warnings
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, Literal, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import sklearn.datasets
from flax import struct

with (
    warnings.catch_warnings()
):  # jaxopt, which ott.geometry.costs imports, warns it is unmaintained
    warnings.filterwarnings("ignore", "JAXopt is no longer maintained", DeprecationWarning)
    from ott import datasets
    from ott.geometry import pointcloud
    from ott.neural.methods import monge_gap
    from ott.neural.networks import potentials
    from ott.tools import sinkhorn_divergence, soft_sort

# --- ott: docs/tutorials/misc/100_soft_sort.ipynb -----------------------------------------------


class ConvBlock(nn.Module):
    """A simple CNN block."""

    features: int = 32
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(features=self.features, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.Conv(features=self.features, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.max_pool(x, window_shape=(2, 2), strides=(2, 2))
        return x


class CNN(nn.Module):
    """A simple CNN model."""

    num_classes: int = 10
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = ConvBlock(features=32)(x)
        x = ConvBlock(features=64)(x)
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nn.Dense(features=512)(x)
        x = nn.relu(x)
        x = nn.Dense(features=self.num_classes)(x)
        return x


def cross_entropy_loss(logits: jnp.array, labels: jnp.array):
    logits = nn.log_softmax(logits)
    return -jnp.sum(labels * logits) / labels.shape[0]


def soft_error_loss(logits: jnp.array, labels: jnp.array):
    """The average distance between the best rank and the rank of the true class."""
    ranks_fn = jax.jit(functools.partial(soft_sort.ranks, axis=-1))
    soft_ranks = ranks_fn(logits)
    return jnp.mean(nn.relu(labels.shape[-1] - 1 - jnp.sum(labels * soft_ranks, axis=1)))


def compute_metrics(logits: jnp.array, labels: jnp.array, loss_fn: Any):
    loss = loss_fn(logits, labels)
    ce = cross_entropy_loss(logits, labels)
    accuracy = jnp.argmax(logits, -1) == jnp.argmax(labels, -1)
    return {
        "loss": jnp.mean(loss),
        "cross_entropy": jnp.mean(ce),
        "accuracy": jnp.mean(accuracy),
    }


@struct.dataclass
class TrainState:
    step: int
    opt_state: Any
    model_state: Any
    params: Any


def create_train_state(rng, config, model):
    """Create initial training state."""
    params, model_state = initialized(rng, config.height, config.width, config.n_channels, model)
    opt_state = config.optimizer.init(params)
    state = TrainState(step=0, opt_state=opt_state, model_state=model_state, params=params)
    return state


def initialized(key, height: int, width: int, n_channels: int, model: nn.Module):
    """Initialize the model parameters."""
    input_shape = (1, height, width, n_channels)

    @jax.jit
    def init(*args):
        return model.init(*args)

    variables = init({"params": key}, jnp.ones(input_shape, jnp.float32))
    model_state, params = variables.pop("params")
    return params, model_state


def train_step(apply_fn, loss_fn, optimizer, state, batch):
    """Perform a single training step."""

    def compute_loss(params):
        variables = {"params": params, **state.model_state}
        logits = apply_fn(variables, batch["image"])
        loss = loss_fn(logits, batch["label"])
        return loss, logits

    (loss, logits), grads = jax.value_and_grad(compute_loss, has_aux=True)(state.params)
    updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    metrics = compute_metrics(logits, batch["label"], loss_fn=loss_fn)
    new_state = state.replace(step=state.step + 1, opt_state=new_opt_state, params=new_params)
    return new_state, metrics


def eval_step(apply_fn, loss_fn, state, batch):
    params = state.params
    variables = {"params": params, **state.model_state}
    logits = apply_fn(variables, batch["image"], train=False, mutable=False)
    return compute_metrics(logits, batch["label"], loss_fn=loss_fn)


# --- ott: docs/tutorials/neural/200_Monge_Gap.ipynb ---------------------------------------------


@dataclasses.dataclass
class SklearnDistribution:
    """A class to define toy probability 2-dimensional distributions.

    Produces rotated ``moons`` and ``s_curve`` sklearn datasets, using
    ``theta_rotation``.
    """

    name: Literal["moon", "s_curve"]
    theta_rotation: float = 0.0
    mean: Optional[jnp.ndarray] = None
    noise: float = 0.01
    scale: float = 1.0
    batch_size: int = 1024
    rng: Optional[jax.Array] = None

    def __iter__(self) -> Iterator[jnp.ndarray]:
        """Random sample generator from Gaussian mixture.

        Returns:
        A generator of samples from the Gaussian mixture.
        """
        return self._create_sample_generators()

    def _create_sample_generators(self) -> Iterator[jnp.ndarray]:
        rng = jax.random.key(0) if self.rng is None else self.rng

        # define rotation matrix tp rotate samples
        rotation = jnp.array(
            [
                [jnp.cos(self.theta_rotation), -jnp.sin(self.theta_rotation)],
                [jnp.sin(self.theta_rotation), jnp.cos(self.theta_rotation)],
            ]
        )
        while True:
            rng, _ = jax.random.split(rng)
            seed = jax.random.randint(rng, [], minval=0, maxval=1e5).item()
            if self.name == "moon":
                samples, _ = sklearn.datasets.make_moons(
                    n_samples=(self.batch_size, 0),
                    random_state=seed,
                    noise=self.noise,
                )
            elif self.name == "s_curve":
                x, _ = sklearn.datasets.make_s_curve(
                    n_samples=self.batch_size,
                    random_state=seed,
                    noise=self.noise,
                )
                samples = x[:, [2, 0]]
            else:
                raise NotImplementedError(f"SklearnDistribution `{self.name}` not implemented.")

            samples = jnp.asarray(samples, dtype=jnp.float32)
            samples = jnp.squeeze(jnp.matmul(rotation[None, :], samples.T).T)
            mean = jnp.zeros(2) if self.mean is None else self.mean
            samples = mean + self.scale * samples
            yield samples


def create_samplers(
    source_kwargs: Mapping[str, Any] = MappingProxyType({}),
    target_kwargs: Mapping[str, Any] = MappingProxyType({}),
    train_batch_size: int = 256,
    valid_batch_size: int = 256,
    rng: Optional[jax.Array] = None,
) -> tuple[datasets.Dataset, datasets.Dataset, int]:
    """Samplers from ``SklearnDistribution``."""
    rng = jax.random.key(0) if rng is None else rng
    rng1, rng2, rng3, rng4 = jax.random.split(rng, 4)
    train_dataset = datasets.Dataset(
        source_iter=iter(
            SklearnDistribution(rng=rng1, batch_size=train_batch_size, **source_kwargs)
        ),
        target_iter=iter(
            SklearnDistribution(rng=rng2, batch_size=train_batch_size, **target_kwargs)
        ),
    )
    valid_dataset = datasets.Dataset(
        source_iter=iter(
            SklearnDistribution(rng=rng3, batch_size=valid_batch_size, **source_kwargs)
        ),
        target_iter=iter(
            SklearnDistribution(rng=rng4, batch_size=valid_batch_size, **target_kwargs)
        ),
    )
    dim_data = 2
    return train_dataset, valid_dataset, dim_data


def tutorial_samplers(**sizes):  # ours: cell 8, a function (see the docstring)
    train_dataset, valid_dataset, dim_data = create_samplers(
        source_kwargs={
            "name": "moon",
            "theta_rotation": jnp.pi / 6,
            "mean": jnp.array([0.0, -0.5]),
            "noise": 0.05,
        },
        target_kwargs={
            "name": "s_curve",
            "scale": 0.6,
            "mean": jnp.array([1.0, -2.0]),
            "theta_rotation": jnp.pi / 2,
            "noise": 0.05,
        },
        **sizes,
    )
    return train_dataset, valid_dataset, dim_data


train_dataset = valid_dataset = None  # ours: cell 8's globals, set by the tests


def fit_map(
    cost_fn,
    relative_epsilon_fitting=1e-1,
    relative_epsilon_regularizer=1e-2,
    regularizer_strength=1.0,
    num_train_iters=5000,
):
    dim_data = 2
    # define the neural map
    model = potentials.PotentialMLP(dim_hidden=[32, 64, 32], is_potential=False, act_fn=nn.gelu)

    # define the optimizer to learn the neural map
    lr = 1e-3
    optimizer = optax.adam(learning_rate=lr)

    # Compute an order of magnitude for epsilon fitting
    y = next(train_dataset.target_iter)
    epsilon_fitting_scale = pointcloud.PointCloud(y).mean_cost_matrix
    epsilon_fitting = relative_epsilon_fitting * epsilon_fitting_scale
    print("Selected `epsilon_fitting`:", epsilon_fitting)

    @jax.jit
    def fitting_loss(x, y):
        div, out = sinkhorn_divergence.sinkdiv(x, y, epsilon=epsilon_fitting, static_b=True)
        return div, out.n_iters

    if cost_fn is None:
        regularizer = None
    else:
        # Compute an order of magnitude for epsilon regularizer
        x = next(train_dataset.source_iter)
        epsilon_regularizer_scale = pointcloud.PointCloud(x, y).mean_cost_matrix
        epsilon_regularizer = relative_epsilon_regularizer * epsilon_regularizer_scale
        print("Selected `epsilon_regularizer`:", epsilon_regularizer)

        def regularizer(x, y):
            gap, out = monge_gap.monge_gap_from_samples(
                x,
                y,
                cost_fn=cost_fn,
                epsilon=epsilon_regularizer,
                return_output=True,
            )
            return gap, out.n_iters

    # define solver
    solver = monge_gap.MongeGapEstimator(
        dim_data=dim_data,
        fitting_loss=fitting_loss,
        regularizer=regularizer,
        model=model,
        optimizer=optimizer,
        regularizer_strength=regularizer_strength,
        num_train_iters=num_train_iters,
        logging=True,
        valid_freq=25,
    )

    return solver.train_map_estimator(
        trainloader_source=train_dataset.source_iter,
        trainloader_target=train_dataset.target_iter,
        validloader_source=valid_dataset.source_iter,
        validloader_target=valid_dataset.target_iter,
    )
